#!/usr/bin/env bash
# `kosmos bench train --hf` for several transformers families on one GPU, in one call:
#
#   bash dev/train_hf_runs.sh DIR [FAMILY ...]     # default: qwen3_moe mixtral deepseek_v3
#   bash dev/train_hf_runs.sh --compile-only DIR   # the compile step alone (e.g. beside the GPU test suite)
#   bash dev/train_hf_runs.sh --timed-only DIR     # the timed runs alone (after a --compile-only)
#
# First compiles the KOSMOS kernels of every family at once (one process per family, --layers 1, one untimed step,
# results thrown away: Triton's compiles run on the CPU, so they overlap; the kernels do not depend on the layer
# count), then runs the families one after the other (the timed runs share the GPU with nothing), each into
# DIR/train-hf-<model>.jsonl with its log beside it. Exits non-zero when a run failed (its partial rows are kept).
set -uo pipefail
cd "$(dirname "$0")/.."
mode=all
case "${1:-}" in --compile-only) mode=compile; shift ;; --timed-only) mode=timed; shift ;; esac
dir=${1:?usage: dev/train_hf_runs.sh [--compile-only|--timed-only] DIR [FAMILY ...]}; shift
families=("$@"); [ ${#families[@]} -gt 0 ] || families=(qwen3_moe mixtral deepseek_v3)
mkdir -p "$dir" || exit 2
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
kosmos=(python3 -m kosmos_bench.cli)
warm=$(mktemp -d)
[ "$mode" = timed ] || for f in "${families[@]}"; do
  timeout "${WARM_TIMEOUT:-240}" "${kosmos[@]}" bench train --hf "$f" --layers 1 --steps 1 --warmup 0 --impl kosmos \
    --out "$warm/$f.jsonl" > "$warm/$f.log" 2>&1 &
done
wait
for f in "$warm"/*.log; do [ -e "$f" ] && cp "$f" "$dir/compile-$(basename "$f")"; done
echo "compiled in $SECONDS s"
[ "$mode" = compile ] && exit 0
rc=0
for f in "${families[@]}"; do
  model=$(python3 -c "from kosmos_bench.train_hf import resolve_model; print(resolve_model('$f'))")
  timeout "${RUN_TIMEOUT:-300}" "${kosmos[@]}" bench train --hf "$f" --out "$dir/train-hf-$model.jsonl" \
    > "$dir/train-hf-$model.log" 2>&1
  code=$?
  if [ $code -ne 0 ]; then rc=1; echo "$f: exit $code"; tail -5 "$dir/train-hf-$model.log"; fi
  echo "$f done at $SECONDS s"
done
for f in "$dir"/train-hf-*.jsonl; do "${kosmos[@]}" report "$f" 2>/dev/null | sed -n '5,20p'; done
exit $rc
