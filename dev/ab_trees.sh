#!/usr/bin/env bash
# Interleaved A/B of two source trees on one GPU machine: old, new, old, new, ... in one call, each tree run from
# its own directory, then `python -m dev.ab_compare` (new / old per shape and the geomean).
#
#   rm -rf .base && mkdir .base && git archive <old-sha> kosmos kosmos_bench suites | tar -x -C .base
#   bash dev/ab_trees.sh tp  [--old .base] [--rounds 2] [-- extra bench args]   # llama3-70b TP=2 per-rank GEMMs, W=1
#   bash dev/ab_trees.sh moe [--old .base] [--rounds 2] [-- extra bench args]   # the default MoE suite at EP=1
#
# Device call: carry [".base"] (ignored through .git/info/exclude). Files land in $OUT (or --out DIR):
# {tp,moe}-{old,new}-<round>.jsonl, ab-{tp,moe}.txt; each bench's own output goes to {tp,moe}-runs.log.
# Why each tree runs from its own directory: `python -m` puts the working directory first on sys.path, so
# PYTHONPATH=.base alone runs the working tree (dev/ab_compare.py refuses two files of one source_sha).
set -u
bench=${1:?usage: ab_trees.sh tp|moe [--old DIR] [--rounds N] [--out DIR] [-- bench args]}; shift
old=.base rounds=2 out=${OUT:-} extra=() per_run_timeout=200
while [ $# -gt 0 ]; do
  case "$1" in
    --old) old=${2:?}; shift ;;
    --rounds) rounds=${2:?}; shift ;;
    --out) out=${2:?}; shift ;;
    --timeout) per_run_timeout=${2:?}; shift ;;
    --) shift; extra=("$@"); break ;;
    *) echo "ab_trees.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
  shift
done
[ -n "$out" ] || { echo "ab_trees.sh: no output folder (set OUT or pass --out DIR)" >&2; exit 2; }
[ -d "$old/kosmos" ] || { echo "ab_trees.sh: no old tree at '$old' (see the header)" >&2; exit 2; }
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
case $bench in
  tp) args=(bench tp --tp 1 --shapes-tp 2 --model llama3-70b --impl kosmos) ;;
  moe) args=(bench moe --ep 1 --impl kosmos --no-expert-gemms --iters 20) ;;
  *) echo "ab_trees.sh: the bench is tp or moe, not '$bench'" >&2; exit 2 ;;
esac
in_tree() { local root=$1; shift; ( cd "$root" && PYTHONPATH=. "$@" ); }
for round in $(seq 1 "$rounds"); do
  for tree in old new; do
    root=.; [ $tree = old ] && root=$old
    start=$(date +%s)
    in_tree "$root" timeout "$per_run_timeout" python3 -m kosmos_bench.cli "${args[@]}" "${extra[@]}" \
      --out "$out/$bench-$tree-$round.jsonl" >> "$out/$bench-runs.log" 2>&1
    echo "ab_trees: $bench $tree round $round rc=$? ($(( $(date +%s) - start )) s)"
  done
done
PYTHONPATH=. python3 -m dev.ab_compare "$out/$bench"-old-*.jsonl --vs "$out/$bench"-new-*.jsonl | tee "$out/ab-$bench.txt"
