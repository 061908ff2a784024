#!/usr/bin/env bash
# The next one-GPU session's first device call (written in session 7, not yet run): what session 7 built on the CPU
# and could not run on a GPU (its device time was spent on the architecture checks). One call, < 10 minutes:
#
#   KOSMOS_GIT_COMMIT=<sha> bash dev/archive/x1_session.sh check
#
# 1. the MXFP8 quant kernels' GPU tests (bit-exact vs the reference) -- first thing before any MXFP8 kernel work;
# 2. `kosmos env` and the custom-point / dry-run paths of the bench on a real GPU (issue: the suite as users meet
#    it) -- a custom TP GEMM and a custom MoE layer at world 1, every implementation that can run there;
# 3. the whole GPU test selection, as the last step (it is the longest).
set -u
stage=${1:?usage: x1_session.sh check|mxfp8|gpu-all|moe-mxfp8|moe-bwd|train|grid|deepep|s9final|tiles|s10a|s10b|s10c|s10d|s10e|s11a|s11b|s11c|s11d|s12a|s12b|s12c|s12d|s12e|s12f|s12g|s13a|s13b|s13c|s13d|s13e|s13f|s13g|s13h|s13i|s13j|s14a|s14b|s14c|s14d|s14e|s14f|s15a|s15b|s15c|s15h|s16a|s16b|s16c|s16d|s16e|s16f|s16h|s17a|s17b|s17d|s18a|s18b|s18c|s18d|s18e|s18g|s18h|s19a|s19b|s19c|s19d|s19e|s19f|s19g|s20a|s20b|s20c|s20d|s20e|s20f|s20g|s20h|s21a|s21b|s21c|s21d|s21e|s22a|s22b|s22c|s22d|s23a|s23b|s23c|s23d|s24a|s24b|s24c|s24d|s24e|s24f|s24g|s24h|s24i|s24j|s24k}
out=${OUT:?run on the device machine, where OUT is set}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
# A stage writes its files into a /tmp dir of its own (a warm machine keeps /tmp between calls, so a shared dir
# would return the earlier calls' files again); keep() packs that dir into $OUT/<stage>.tar.gz, the one file that
# comes back, and is called after each step so that a timeout still returns what was done.
begin_stage() {
  real_out=$out; tarball=$1; export OUT=/tmp/$1-out; out=$OUT; rm -rf "$out"; mkdir -p "$out"
}
keep() { tar czf "$real_out/part.tgz" -C "$out" . && mv "$real_out/part.tgz" "$real_out/$tarball.tar.gz"; }
gpu_tests() {  # LOGNAME SECONDS SELECTION FILE...: the GPU tests of a -k selection, failures and the summary line
  local log=$1 secs=$2 sel=$3; shift 3
  timeout "$secs" python -m pytest -v -p no:cacheprovider --timeout $((secs - 20)) -m gpu "$@" -k "$sel" \
    > "$out/$log.log" 2>&1
  echo "$log rc=$?"; grep -E "FAILED|ERROR" "$out/$log.log" | sed 's/ *\[.*//'; tail -1 "$out/$log.log"; keep
}
grid_run() {  # SECONDS: the public grid (suites/tp-grid.yaml, both TP ops, kosmos rows) at W=1, rendered (md, text)
  timeout "$1" python -m kosmos_bench.cli bench tp --tp 1 --suite suites/tp-grid.yaml --impl kosmos \
    --out "$out/tp-grid-w1.jsonl" > "$out/bench-grid.log" 2>&1; echo "grid rc=$?"
  timeout 20 python -m kosmos_bench.cli report "$out/tp-grid-w1.jsonl" --format md --out "$out/tp-grid-w1.md" \
    >> "$out/bench-grid.log" 2>&1
  COLUMNS=100 timeout 20 python -m kosmos_bench.cli report "$out/tp-grid-w1.jsonl" > "$out/tp-grid-w1.txt" \
    2>> "$out/bench-grid.log"; keep
  echo "rows: $(grep -c '"type": "result"' "$out/tp-grid-w1.jsonl") of 96, ok $(grep -c '"status": "ok"' \
    "$out/tp-grid-w1.jsonl")"
}
llama3_w1_run() {  # SECONDS NAME: the llama3 per-rank TP suite at W=1 (kosmos, nccl+cublas), rendered (md, text)
  timeout "$1" python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b,llama3-8b \
    --impl kosmos,nccl+cublas --out "$out/$2.jsonl" > "$out/bench-llama3.log" 2>&1; echo "llama3 bench rc=$?"
  timeout 20 python -m kosmos_bench.cli report "$out/$2.jsonl" --format md --out "$out/$2.md" \
    >> "$out/bench-llama3.log" 2>&1
  COLUMNS=100 timeout 20 python -m kosmos_bench.cli report "$out/$2.jsonl" > "$out/$2.txt" \
    2>> "$out/bench-llama3.log"; keep
}
expand_gemm_checks_and_timings() {  # s22c / s23a: each MX-expand GEMM build checked in its own process, then the
  # timings of those that passed (with quantize+gluon-mx-expand when gluon-mx-expand did) and the qkv-4k profile
  local v rc left ok_builds=""
  for v in gluon-mx-expand gluon-mx-expand-bits; do
    CUDA_LAUNCH_BLOCKING=1 timeout 90 python -m dev.archive.gluon_expand_diag gemm $v > "$out/gemm-$v.log" 2>&1
    rc=$?; echo "gemm $v rc=$rc"; grep -E "^\{|Error|error" "$out/gemm-$v.log" | tail -2 | cut -c1-300; keep
    [ $rc -eq 0 ] && ok_builds="$ok_builds,$v"
  done
  case "$ok_builds" in *gluon-mx-expand,*|*gluon-mx-expand) ok_builds="$ok_builds,quantize+gluon-mx-expand";; esac
  left=$((560 - SECONDS)); echo "timed builds: torch,gluon,gluon-rs-copy$ok_builds; left $left s"
  if [ $left -gt 60 ]; then
    timeout $left python -m dev.gluon_mx_probe --skip-checks --variants "torch,gluon,gluon-rs-copy$ok_builds" \
      --profile qkv-4k --json "$out/gluon-mx-expand.jsonl" > "$out/gluon-mx-expand.log" 2>&1
    echo "gluon expand timings rc=$?"; keep; tail -30 "$out/gluon-mx-expand.log"
  fi
}
deepep_install() {  # the shared DeepEP wheel (carried in .wheels/) into .deepep-site, on PYTHONPATH
  if [ -d .wheels ]; then
    python3 -m pip install -q --no-deps --target .deepep-site .wheels/deep_ep-*.whl > "$out/deepep-install.log" 2>&1
    echo "deepep install rc=$?"; export PYTHONPATH=$PWD/.deepep-site:$PYTHONPATH
  fi
}
train_dsv3_w2_onegpu() {  # UNTIL CAP: the deepseek-v3 EP = 2 proxy, both ranks on one GPU (at most CAP s; skipped with < 60 s to UNTIL)
  local left=$(($1 - SECONDS)); [ $left -gt $2 ] && left=$2
  if [ $left -gt 60 ]; then
    KOSMOS_RANKS_ON_ONE_GPU=1 timeout $left python -m kosmos_bench.cli bench train --model deepseek-v3 --seq 1024 \
      --scale 0.125 --layers 2 --tp 2 --steps 20 --out "$out/train-deepseek-v3-w2-onegpu.jsonl" \
      > "$out/train-deepseek-v3-w2-onegpu.log" 2>&1; echo "train dsv3 w2 one gpu rc=$?"
    timeout 40 python -m kosmos_bench.cli report "$out/train-deepseek-v3-w2-onegpu.jsonl" --format md \
      --out "$out/train-deepseek-v3-w2-onegpu.md" --chart "$out/train-deepseek-v3-w2-onegpu-loss.png" \
      >> "$out/train-deepseek-v3-w2-onegpu.log" 2>&1; keep
    grep "^| " "$out/train-deepseek-v3-w2-onegpu.md" | head -8
  fi
}
one_launch_gpu_tests() {  # the one launch's GPU tests in the time left before $deadline: W = 1, then simulated ranks
  local left=$((deadline - SECONDS)); echo "left for tests: $left s"
  [ $left -gt 60 ] && gpu_tests gpu-tests-one-launch $((left * 6 / 10)) "one_launch and not ep_" tests/test_moe_backward.py
  left=$((deadline - SECONDS))
  [ $left -gt 40 ] && timeout $left python -m pytest -v -p no:cacheprovider --timeout $((left - 10)) -m "gpu or ranks" \
    tests/test_moe_backward.py -k "ep_" > "$out/gpu-tests-ep.log" 2>&1; echo "ep tests rc=$?"; \
    tail -1 "$out/gpu-tests-ep.log"; keep
}
bwd_rows() {  # the MoE bench's kosmos / nccl-a2a bwd and fwd+bwd rows of a JSONL file: time and peak memory
  python - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("impl") in ("kosmos", "nccl-a2a", "grouped-mm", "kosmos-expert-gemms") and r.get("direction") in ("bwd", "fwd+bwd"):
        print(r["impl"], r.get("model"), r["direction"], r.get("tokens"), r.get("routing"), r.get("status"),
              round(r.get("time_ms") or 0, 3), "peak GiB", round((r.get("peak_mem_bytes") or 0) / 2**30, 1),
              (r.get("reason") or "")[:80])
PY
}
case $stage in
  check)
    timeout 120 python -m pytest -q -p no:cacheprovider -m "gpu or gpu_optional" tests/test_quant.py \
      > "$out/gpu-tests-quant.log" 2>&1; echo "quant tests rc=$?"; tail -2 "$out/gpu-tests-quant.log"
    timeout 60 python -m kosmos_bench.cli env > "$out/kosmos-env.txt" 2>&1; echo "kosmos env rc=$?"
    timeout 30 python -m kosmos_bench.cli bench tp --shape 8192x1024x8192 --op ag_gemm --tp 1 --dry-run \
      > "$out/dry-run.txt" 2>&1; echo "dry run rc=$?"
    timeout 120 python -m kosmos_bench.cli bench tp --shape 8192x1024x8192,4096x4096x1024 --op ag_gemm,gemm_rs \
      --tp 1 --out "$out/custom-tp.jsonl" > "$out/custom.log" 2>&1; echo "custom tp rc=$?"
    timeout 120 python -m kosmos_bench.cli bench moe --hidden 2048 --ffn 1024 --experts 16 --top-k 4 --ep 1 \
      --tokens 2048 --out "$out/custom-moe.jsonl" >> "$out/custom.log" 2>&1; echo "custom moe rc=$?"
    timeout 240 python -m pytest -q -p no:cacheprovider -m "gpu or ranks or multi_gpu or gpu_optional" tests/ \
      > "$out/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"; tail -2 "$out/gpu-tests.log"
    head -20 "$out/kosmos-env.txt" ;;
  mxfp8)  # session 8: the MXFP8 TP results (issue 14's W=1 bar), bf16 and mxfp8 rows of one run
    timeout 420 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b --dtype bf16,mxfp8 \
      --out "$out/tp-mxfp8-w1-shard2.jsonl" > "$out/bench-mxfp8.log" 2>&1; echo "bench rc=$?"
    timeout 90 python -m pytest -q -p no:cacheprovider -m gpu tests/test_bench_harness.py tests/test_cli.py \
      -k "mxfp8" > "$out/gpu-tests-bench-mx.log" 2>&1; echo "bench gpu tests rc=$?"; tail -1 "$out/gpu-tests-bench-mx.log"
    tail -30 "$out/bench-mxfp8.log" ;;
  gpu-all)  # session 9's first call: every GPU test (session 8 ran only part), then the DEQ / MX probes
    timeout 420 python -m pytest -q -p no:cacheprovider -m "gpu or ranks or multi_gpu or gpu_optional" tests/ \
      > "$out/gpu-tests.log" 2>&1; echo "gpu tests rc=$?"; tail -2 "$out/gpu-tests.log"
    grep -E "^(FAILED|ERROR)" "$out/gpu-tests.log" | head -20
    timeout 60 python -m dev.archive.deq_probe > "$out/deq-probe.log" 2>&1; echo "deq probe rc=$?"
    timeout 90 python -m dev.archive.mx_probe --seqs 4096 --json "$out/mx-probe.jsonl" > "$out/mx-probe.log" 2>&1
    echo "mx probe rc=$?"; tail -30 "$out/deq-probe.log"; grep -v "^{" "$out/mx-probe.log" | tail -8 ;;
  moe-mxfp8)  # the MXFP8 MoE results (issue 14's MoE bar: mxfp8 kosmos <= 1.05x the bf16 kosmos time, EP=1)
    timeout 540 python -m kosmos_bench.cli bench moe --ep 1 --dtype bf16,mxfp8 --tokens 4096,8192 \
      --out "$out/moe-mxfp8-ep1.jsonl" > "$out/bench-moe-mxfp8.log" 2>&1; echo "bench rc=$?"
    tail -30 "$out/bench-moe-mxfp8.log" ;;
  moe-bwd)  # the MoE backward at EP=1 (issue 15's bench; the one-launch backward is not built yet)
    timeout 540 python -m kosmos_bench.cli bench moe --ep 1 --direction fwd,bwd,fwd+bwd --tokens 4096 \
      --out "$out/moe-bwd-ep1.jsonl" > "$out/bench-moe-bwd.log" 2>&1; echo "bench rc=$?"
    tail -30 "$out/bench-moe-bwd.log" ;;
  train)  # issue 16's W=1 bar: the llama3-8b 2-layer proxy at seq 4096, kosmos within 3% of nccl+cublas
    timeout 300 python -m kosmos_bench.cli bench train --model llama3-8b --layers 2 --seq 4096 --tp 1 --steps 20 \
      --out "$out/train-llama3-8b-w1.jsonl" > "$out/bench-train.log" 2>&1; echo "train rc=$?"
    timeout 240 python -m kosmos_bench.cli bench train --model deepseek-v3 --layers 2 --seq 4096 --scale 0.25 \
      --tp 1 --steps 20 --out "$out/train-deepseek-v3-w1.jsonl" >> "$out/bench-train.log" 2>&1
    echo "train moe rc=$?"; tail -30 "$out/bench-train.log" ;;
  grid)  # issue 13 (parts 1, 3): today's TP kernels on the public grid (suites/tp-grid.yaml: 48 GEMMs x both ops)
    # at W=1 against cuBLAS alone (t_gemm_ms), with the host enqueue time per call. Estimated 1.5-4 min (the suite's
    # header says how); the timeouts keep the stage under 8 min (400 + 2 x 30 s). Partial rows survive a timeout.
    timeout 400 python -m kosmos_bench.cli bench tp --tp 1 --suite suites/tp-grid.yaml --impl kosmos \
      --out "$out/tp-grid-w1.jsonl" > "$out/bench-grid.log" 2>&1; echo "bench rc=$?"
    timeout 30 python -m kosmos_bench.cli report "$out/tp-grid-w1.jsonl" --format md --out "$out/tp-grid-w1.md" \
      >> "$out/bench-grid.log" 2>&1; echo "report md rc=$?"
    COLUMNS=100 timeout 30 python -m kosmos_bench.cli report "$out/tp-grid-w1.jsonl" > "$out/tp-grid-w1.txt" \
      2>> "$out/bench-grid.log"; echo "report text rc=$?"
    echo "rows: $(grep -c '"type": "result"' "$out/tp-grid-w1.jsonl") of 96, ok $(grep -c '"status": "ok"' \
      "$out/tp-grid-w1.jsonl")"; grep -v '^{' "$out/bench-grid.log" | grep -iE "error|Traceback" | head -5
    sed -n '/^kosmos against cuBLAS alone at world 1 (t_gemm_ms \/ time_ms: TFLOP/,$p' "$out/tp-grid-w1.txt" ;;
  deepep)  # issue 18 part 1: the deepep baseline on the shared DeepEP wheel, 2 ranks on one GPU over gloo (< 4 min).
    # Needs the wheel in .wheels/ (ignored via .git/info/exclude): the device call names it in carry: [".wheels"]
    python3 -m pip install -q --no-deps --target .deepep-site .wheels/deep_ep-*.whl > "$out/deepep-install.log" 2>&1
    echo "deepep install rc=$?"
    export PYTHONPATH=$PWD/.deepep-site:$PYTHONPATH
    timeout 30 python -c "import torch, deep_ep; print('torch', torch.__version__, 'deep_ep', deep_ep.__file__,
      'Buffer.num_sms', deep_ep.Buffer.num_sms, 'topk_idx_t', deep_ep.topk_idx_t, 'sm90',
      deep_ep.Buffer.is_sm90_compiled())" > "$out/deepep-import.txt" 2>&1; echo "deepep import rc=$?"
    timeout 110 python -m pytest -q -p no:cacheprovider -rs tests/test_deepep.py > "$out/deepep-tests.log" 2>&1
    echo "deepep tests rc=$?"
    # one tiny point through the bench itself, every rank on cuda:0 (launcher.py): a correctness run, not a timing
    KOSMOS_RANKS_ON_ONE_GPU=1 timeout 90 python -m kosmos_bench.cli bench moe --hidden 1024 --ffn 512 --experts 16 \
      --top-k 4 --ep 2 --tokens 512 --routing uniform,zipf:1.2 --impl nccl-a2a,deepep --no-expert-gemms --iters 5 \
      --warmup 2 --out "$out/moe-deepep-1gpu.jsonl" > "$out/bench-deepep.log" 2>&1; echo "bench rc=$?"
    grep -v "^{" "$out/bench-deepep.log" | grep -iE "error|Traceback" | head -5
    tail -3 "$out/deepep-import.txt"; grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed" "$out/deepep-tests.log" | tail -8
    [ -f "$out/moe-deepep-1gpu.jsonl" ] && python - "$out/moe-deepep-1gpu.jsonl" <<'EOF'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("type") == "result":
        err = "-" if r.get("rel_err") is None else f"{r['rel_err']:.2e}"
        print(f"{r['routing']:9} {r['impl']:9} {r['status']:11} rel_err {err} {r.get('reason') or ''}"
              f" {r.get('note') or ''}")
EOF
    ;;
  s9final)  # session 9's last call (<= ~330 s): the DEQ A/B (arch_session.sh deq9; carry .base .var .wheels), then what
            # time is left: the one-GPU EP=2 training proxy (loss agreement), the grid (partial rows are kept).
            # Everything lands in one tarball ($OUT/s9-final.tar.gz: at most 8 files come back).
    real_out=$out; export OUT=/tmp/s9o; out=$OUT; mkdir -p "$out"
    keep() { tar czf "$real_out/part.tgz" -C "$out" . && mv "$real_out/part.tgz" "$real_out/s9-final.tar.gz"; }
    DEQ_RUN_S=50 bash dev/archive/arch_session.sh deq9; keep
    left=$((320 - SECONDS))
    if [ $left -gt 60 ]; then
      python3 -m pip install -q --no-deps --target .deepep-site .wheels/deep_ep-*.whl > /dev/null 2>&1
      PYTHONPATH=$PWD/.deepep-site:$PYTHONPATH KOSMOS_RANKS_ON_ONE_GPU=1 timeout 60 python -m kosmos_bench.cli bench train --model deepseek-v3 --layers 2 \
        --seq 1024 --scale 0.125 --tp 2 --steps 10 --impl nccl-a2a,deepep,kosmos \
        --out "$out/train-deepseek-v3-ep2-1gpu.jsonl" > "$out/bench-train-ep2.log" 2>&1; echo "train ep2 rc=$?"
      grep -v "^{" "$out/bench-train-ep2.log" | grep -E "failed|ok|unavailable|Error" | head -6; keep
    fi
    left=$((320 - SECONDS))
    if [ $left -gt 40 ]; then
      timeout $left python -m kosmos_bench.cli bench tp --tp 1 --suite suites/tp-grid.yaml --impl kosmos \
        --out "$out/tp-grid-w1.jsonl" > "$out/bench-grid.log" 2>&1; echo "grid rc=$? (limit $left s)"
      echo "grid rows: $(grep -c '"type": "result"' "$out/tp-grid-w1.jsonl") of 96"
    fi
    keep; echo "tarball: $(du -k "$real_out/s9-final.tar.gz" | cut -f1) KiB" ;;
  tiles)  # issue 13 part 1: which tile each grid GEMM wants (dev/tile_probe.py: the 48 GEMMs of suites/tp-grid.yaml x
          # both ops x 8 candidate tiles at W=1, each checked against fp32 then timed against torch.matmul; ~32
          # compiles). Estimated 2.5-5 min (the probe's docstring); no new work after 420 s (partial rows kept).
    timeout 460 python -m dev.tile_probe --max-seconds 420 --json "$out/tile-probe.jsonl" > "$out/tile-probe.log" 2>&1
    echo "tile probe rc=$?"; grep -E "^(tile probe:|done )" "$out/tile-probe.log"
    grep -E "Traceback|Error" "$out/tile-probe.log" | head -5
    grep -o '"status": "[a-z]*"' "$out/tile-probe.jsonl" | sort | uniq -c
    python -m dev.tile_probe --table "$out/tile-probe.jsonl" ;;
  s10a)  # session 10's first call (<= 550 s; one tarball $OUT/s10a.tar.gz). Trees (carry .snap .base .var):
         #   . = main HEAD, .base = 66a569a (the committed MX run), .var/tma = d24f136 (session 9's TMA DEQ tree,
         #   which ran every "old/rows8/tma" row of its DEQ A/B), .var/old = cde9bc8 (before session 8's kernel
         #   changes), .var/cg = branch cuda-graphs-rebased (with its tests).
         # 1. the branch's GPU tests while Triton 3.6 compiles the register tables (HEAD bf16 + mx, branch bf16);
         # 2. with the CPU quiet: the MX run difference (mxfp8 kosmos: .base, ., .var/tma), then the bf16 A/B
         #    (TP W=1: old, head, cg, head, cg; MoE EP=1: head, cg), each tree run from its own directory.
    begin_stage s10a
    in_tree() { local root=$1; shift; ( cd "$root" && PYTHONPATH=. "$@" ); }
    own_regs() { in_tree "$1" timeout 280 python dev/kernel_resources.py --world 1,2,8 $3 --json "$2"; }
    ( own_regs . "$out/regs-head-bf16.json" "" > "$out/regs-head-bf16.txt" 2>&1 &
      own_regs . "$out/regs-head-mx.json" --mx > "$out/regs-head-mx.txt" 2>&1 &
      own_regs .var/cg "$out/regs-cg-bf16.json" "" > "$out/regs-cg-bf16.txt" 2>&1 & wait ) &
    regs_pid=$!
    in_tree .var/cg timeout 230 python -m pytest -v -p no:cacheprovider -m "gpu or ranks or gpu_optional" \
      tests/test_cuda_graphs.py tests/test_runtime.py tests/test_tp_ops_together.py tests/test_moe_forward.py \
      tests/test_all_gather_matmul.py tests/test_matmul_reduce_scatter.py > "$out/cg-gpu-tests.log" 2>&1
    echo "cg gpu tests rc=$? (124: the 230 s limit)"; grep -cE " PASSED" "$out/cg-gpu-tests.log"
    grep -E "(FAILED|ERROR)" "$out/cg-gpu-tests.log" | head -8; tail -1 "$out/cg-gpu-tests.log"
    wait $regs_pid; keep
    run_one() {  # kind name dir limit tag
      if [ $((SECONDS + $4)) -gt 540 ]; then echo "$1 $2 $5 skipped (deadline)"; return; fi
      local t0=$SECONDS
      case $1 in
        mx) in_tree $3 timeout $4 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b \
              --impl kosmos --dtype mxfp8 --out "$out/mx-$2-$5.jsonl" >> "$out/runs.log" 2>&1 ;;
        tp) in_tree $3 timeout $4 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b \
              --impl kosmos --out "$out/tp-$2-$5.jsonl" >> "$out/runs.log" 2>&1 ;;
        moe) in_tree $3 timeout $4 python -m kosmos_bench.cli bench moe --ep 1 --impl kosmos --no-expert-gemms \
              --iters 20 --out "$out/moe-$2-$5.jsonl" >> "$out/runs.log" 2>&1 ;;
      esac
      echo "$1 $2 $5 rc=$? $((SECONDS - t0)) s"
    }
    run_one mx base .base 60 1; run_one mx head . 60 1; run_one mx tma .var/tma 60 1; keep
    run_one tp old .var/old 60 1; run_one tp head . 45 1; run_one tp cg .var/cg 60 1; keep
    run_one moe head . 70 1; run_one moe cg .var/cg 80 1; keep
    run_one tp head . 40 2; run_one tp cg .var/cg 40 2; keep
    grep -E "^(all_|matmul|moe)" "$out"/regs-*.txt | sed "s|$out/||"
    ab() { python -m dev.ab_compare $1 --vs $2 | grep -E "source|geomean|^llama|^deepseek|^qwen" | sed "s/^/$3: /"; }
    ab "$out/mx-base-1.jsonl" "$out/mx-head-1.jsonl" "mx head/66a569a"
    ab "$out/mx-base-1.jsonl" "$out/mx-tma-1.jsonl" "mx tma/66a569a" | grep geomean
    ab "$out/tp-old-1.jsonl" "$out/tp-head-1.jsonl" "tp head/cde9bc8" | grep -E "geomean|source"
    ab "$(ls $out/tp-head-*.jsonl)" "$(ls $out/tp-cg-*.jsonl)" "tp cg/head"
    ab "$out/moe-head-1.jsonl" "$out/moe-cg-1.jsonl" "moe cg/head" | grep -E "geomean|source"
    keep; echo "tarball: $(du -k "$real_out/s10a.tar.gz" | cut -f1) KiB" ;;
  s10b)  # session 10's second call (<= 550 s; tarball $OUT/s10b.tar.gz; trees as s10a): the MoE A/B's second
         # round in the other order (cg, head), the tile probe for what time allows (gemm_rs and ag_gemm, shape
         # by shape), then the branch's GPU tests that s10a's 230 s did not reach (dev/cg-done.txt: node ids
         # that ran; each test limited to 60 s so a hang names itself).
    begin_stage s10b
    in_tree() { local root=$1; shift; ( cd "$root" && PYTHONPATH=. "$@" ); }
    for tree in cg:.var/cg head:.; do
      t0=$SECONDS
      in_tree ${tree#*:} timeout 80 python -m kosmos_bench.cli bench moe --ep 1 --impl kosmos --no-expert-gemms \
        --iters 20 --out "$out/moe-${tree%%:*}-2.jsonl" >> "$out/runs.log" 2>&1; echo "moe ${tree%%:*} 2 rc=$? $((SECONDS - t0)) s"
    done; keep
    left=$((330 - SECONDS))
    timeout $((left + 40)) python -m dev.tile_probe --max-seconds $left --json "$out/tile-probe.jsonl" \
      > "$out/tile-probe.log" 2>&1; echo "tile probe rc=$? (budget $left s)"; keep
    grep -o '"status": "[a-z]*"' "$out/tile-probe.jsonl" | sort | uniq -c
    left=$((535 - SECONDS))
    in_tree .var/cg timeout $left python -m pytest -v -p no:cacheprovider --timeout 60 \
      -m "gpu or ranks or gpu_optional" tests/test_all_gather_matmul.py tests/test_matmul_reduce_scatter.py \
      $(sed 's/^/--deselect /' dev/cg-done.txt) > "$out/cg-gpu-tests-2.log" 2>&1
    echo "cg gpu tests rc=$? (limit $left s; 124: the limit)"; grep -cE " PASSED" "$out/cg-gpu-tests-2.log"
    grep -E "(FAILED|ERROR|Timeout)" "$out/cg-gpu-tests-2.log" | head -8; tail -1 "$out/cg-gpu-tests-2.log"
    python -m dev.tile_probe --table "$out/tile-probe.jsonl" | tail -30
    keep ;;
  s10c)  # session 10's third call (<= 330 s; tarball $OUT/s10c.tar.gz): CUDA graphs in the bench (issue 13 part 2:
         # eager vs replayed, TP and MoE, one file each), the MoE backward's stage costs (dev/moe_bwd_probe),
         # the MXFP8 training proxy (issue 16), then the host-cost profile (dev/fixed_cost) with what is left.
    begin_stage s10c
    for g in eager graph; do
      flag=""; [ $g = graph ] && flag=--cuda-graph
      timeout 50 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b --seq 4096 \
        --impl kosmos,nccl+cublas $flag --out "$out/tp-$g.jsonl" >> "$out/bench-graph.log" 2>&1; echo "tp $g rc=$?"
      timeout 60 python -m kosmos_bench.cli bench moe --ep 1 --model qwen3-235b --tokens 4096 --routing uniform \
        --impl kosmos,nccl-a2a --no-expert-gemms $flag --out "$out/moe-$g.jsonl" >> "$out/bench-graph.log" 2>&1
      echo "moe $g rc=$?"
    done; keep
    timeout 140 python -m dev.moe_bwd_probe --json "$out/moe-bwd-probe.jsonl" > "$out/moe-bwd-probe.log" 2>&1
    echo "moe bwd probe rc=$?"; keep
    timeout 100 python -m kosmos_bench.cli bench train --model llama3-8b --layers 2 --seq 4096 --tp 1 --steps 20 \
      --dtype mxfp8 --out "$out/train-llama3-8b-w1-mxfp8.jsonl" > "$out/bench-train-mx.log" 2>&1; echo "train mx rc=$?"
    keep
    left=$((320 - SECONDS)); [ $left -gt 20 ] && { timeout $left python -m dev.fixed_cost > "$out/fixed-cost.log" 2>&1
      echo "fixed cost rc=$?"; }
    keep
    python - "$out" <<'PYEOF'
import json, sys, glob
for f in sorted(glob.glob(sys.argv[1] + "/*-eager.jsonl") + glob.glob(sys.argv[1] + "/*-graph.jsonl")):
    for line in open(f):
        r = json.loads(line)
        if r.get("type") == "result":
            t = "-" if r.get("time_ms") is None else f"{r['time_ms']:.4f}"
            h = "-" if r.get("host_ms") is None else f"{r['host_ms'] * 1000:.0f}us"
            print(f"{f.split('/')[-1]:18} {r.get('layer', ''):8} {r['impl']:12} {r['status']:7} {t:>9} host {h:>7} "
                  f"{(r.get('reason') or '')[:60]}")
PYEOF
    grep -v "^{" "$out/bench-train-mx.log" | tail -8; tail -25 "$out/moe-bwd-probe.log"; tail -25 "$out/fixed-cost.log" ;;
  s10d)  # session 10's fourth call (<= 260 s; tarball $OUT/s10d.tar.gz): what the launch plans and the MoE backward
         # speed pass must show on a GPU before the grid is worth running:
         # 1. GPU tests: CUDA graphs (capture with plans), the MoE forward (its plan) and backward (the TMA kernels,
         #    swiglu_h bitwise vs torch), the TP ops together; each test limited to 60 s;
         # 2. host time per eager call with plans, fast launch on and off (dev/fixed_cost --plans);
         # 3. the MoE backward's stages after the speed pass (dev/moe_bwd_probe).
    begin_stage s10d
    timeout 110 python -m pytest -v -p no:cacheprovider --timeout 60 -m "gpu or ranks or gpu_optional" \
      tests/test_cuda_graphs.py tests/test_moe_backward.py tests/test_moe_forward.py tests/test_tp_ops_together.py \
      > "$out/gpu-tests-d.log" 2>&1
    echo "gpu tests rc=$? $SECONDS s"; grep -cE " PASSED" "$out/gpu-tests-d.log"
    grep -E "(FAILED|ERROR|Timeout)" "$out/gpu-tests-d.log" | head -8; tail -1 "$out/gpu-tests-d.log"; keep
    timeout 60 python -m dev.fixed_cost --plans > "$out/fixed-cost-plans.log" 2>&1; echo "fixed cost rc=$? $SECONDS s"
    keep
    timeout 100 python -m dev.moe_bwd_probe --json "$out/moe-bwd-probe.jsonl" > "$out/moe-bwd-probe.log" 2>&1
    echo "moe bwd probe rc=$? $SECONDS s"; keep
    grep -vE "^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ " "$out/fixed-cost-plans.log" | grep -v Warning | tail -30
    sed -n '/== moe backward stages/,/composed/p' "$out/moe-bwd-probe.log" ;;
  s10e)  # session 10's last call (<= S10E_END s, default 390; tarball $OUT/s10e.tar.gz): the measurements, then tests:
         # 1. the grid with the wave-model tile rule (issue 13 part 1), both ops, W=1, vs cuBLAS alone;
         # 2. the default suite's llama3-70b TP=2 per-rank GEMMs at W=1 (the rule keeps their tile: no worse);
         # 3. host time per eager call with plans after the hook fix (dev/fixed_cost --plans);
         # 4. GPU tests of the TP op files (new tiles at W=1 and on simulated ranks, plans) with the time left.
    begin_stage s10e
    timeout 140 python -m kosmos_bench.cli bench tp --tp 1 --suite suites/tp-grid.yaml --impl kosmos \
      --out "$out/tp-grid-w1.jsonl" > "$out/bench-grid.log" 2>&1; echo "grid rc=$? $SECONDS s"
    echo "grid rows: $(grep -c '"type": "result"' "$out/tp-grid-w1.jsonl") of 96, ok $(grep -c '"status": "ok"' \
      "$out/tp-grid-w1.jsonl")"; keep
    timeout 40 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b --impl kosmos \
      --out "$out/tp-w1-shard2.jsonl" > "$out/bench-suite.log" 2>&1; echo "suite rc=$? $SECONDS s"; keep
    timeout 60 python -m dev.fixed_cost --plans > "$out/fixed-cost-plans.log" 2>&1; echo "fixed cost rc=$? $SECONDS s"
    sed -n '1,16p' "$out/fixed-cost-plans.log"; keep
    left=$((${S10E_END:-390} - SECONDS))
    timeout $left python -m pytest -v -p no:cacheprovider --timeout 60 -m "gpu or ranks or gpu_optional" \
      tests/test_matmul_reduce_scatter.py tests/test_all_gather_matmul.py > "$out/gpu-tests-e.log" 2>&1
    echo "gpu tests rc=$? (limit $left s; 124: the limit)"; grep -cE " PASSED" "$out/gpu-tests-e.log"
    grep -E "(FAILED|ERROR|Timeout)" "$out/gpu-tests-e.log" | head -8; tail -1 "$out/gpu-tests-e.log"; keep
    COLUMNS=110 timeout 20 python -m kosmos_bench.cli report "$out/tp-grid-w1.jsonl" 2>/dev/null | \
      sed -n '/kosmos against cuBLAS alone/,$p' | head -40 ;;
  s11a)  # written in session 10 for the next one-GPU session's first call (<= 560 s; tarball $OUT/s11a.tar.gz).
         # Trees (carry .snap .var): . = main HEAD, .var/splitk = branch split-k, .var/bwd2 = branch moe-bwd-2
         # (git archive each; NOTES.md "Next one-GPU session"). Nothing of these has run on a GPU yet.
         # 1. the trace tests fixed on the CPU in session 10, then HEAD's Triton 3.6 registers (background);
         # 2. A/Bs, each tree from its own directory: the grid (main vs split-k, both ops) and the MoE backward
         #    probe (main vs moe-bwd-2, qwen3 4k);
         # 3. the branches' GPU tests with what time is left.
    begin_stage s11a
    in_tree() { local root=$1; shift; ( cd "$root" && PYTHONPATH=. "$@" ); }
    timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/test_all_gather_matmul.py \
      tests/test_matmul_reduce_scatter.py -k trace > "$out/trace-tests.log" 2>&1; echo "trace tests rc=$?"
    tail -1 "$out/trace-tests.log"; keep
    ( for v in "" --mx --tiles; do timeout 280 python dev/kernel_resources.py --world 1,2,8 $v \
        --json "$out/regs-head${v//-/_}.json" > "$out/regs-head${v//-/_}.txt" 2>&1; done ) &
    regs_pid=$!
    for tree in main:. splitk:.var/splitk; do
      in_tree ${tree#*:} timeout 100 python -m kosmos_bench.cli bench tp --tp 1 --suite suites/tp-grid.yaml \
        --impl kosmos --out "$out/grid-${tree%%:*}.jsonl" >> "$out/runs.log" 2>&1; echo "grid ${tree%%:*} rc=$?"
    done; keep
    for tree in main:. bwd2:.var/bwd2; do
      in_tree ${tree#*:} timeout 110 python -m dev.moe_bwd_probe --json "$out/bwd-${tree%%:*}.jsonl" \
        > "$out/bwd-${tree%%:*}.log" 2>&1; echo "bwd probe ${tree%%:*} rc=$?"
    done; keep
    wait $regs_pid
    left=$((550 - SECONDS))
    [ $left -gt 30 ] && for tree in splitk:.var/splitk bwd2:.var/bwd2; do
      in_tree ${tree#*:} timeout $((left / 2)) python -m pytest -q -p no:cacheprovider --timeout 60 \
        -m "gpu or ranks or gpu_optional" tests/test_moe_backward.py tests/test_matmul_reduce_scatter.py \
        tests/test_all_gather_matmul.py > "$out/gpu-tests-${tree%%:*}.log" 2>&1
      echo "gpu tests ${tree%%:*} rc=$?"; tail -1 "$out/gpu-tests-${tree%%:*}.log"
    done; keep
    python -m dev.ab_compare "$out/grid-main.jsonl" --vs "$out/grid-splitk.jsonl" | tail -3
    for t in main bwd2; do sed -n '/kosmos whole/,/composed/p' "$out/bwd-$t.log" | sed "s/^/$t: /"; done ;;
  s11b)  # session 11, second call (<= 560 s; tarball $OUT/s11b.tar.gz): g | u saved by the forward (save_gu).
         # 1. Triton 3.6 registers of moe_forward (+ save_gu) and the moe_backward kernels (background, CPU);
         # 2. the GPU tests of the MoE forward / backward / plans / graphs;
         # 3. the MoE backward probe at qwen3 4k (the whole backward on the forward's g | u);
         # 4. the backward GEMMs' tile variants and the forward with / without save_gu (dev/archive/moe_bwd_tiles).
    begin_stage s11b
    ( timeout 200 python dev/kernel_resources.py --world 1,2,8 --kernels moe_forward,moe_backward \
        --json "$out/regs-moe.json" > "$out/regs-moe.txt" 2>&1 ) &
    regs_pid=$!
    timeout 200 python -m pytest -q -p no:cacheprovider --timeout 60 -m "gpu or ranks or gpu_optional" \
      tests/test_moe_backward.py tests/test_moe_forward.py tests/test_launch_plan.py tests/test_cuda_graphs.py \
      tests/test_bench_moe.py > "$out/gpu-tests-moe.log" 2>&1; echo "gpu tests rc=$?"; tail -1 "$out/gpu-tests-moe.log"
    grep -E "^(FAILED|ERROR)" "$out/gpu-tests-moe.log" | head -8; keep
    timeout 120 python -m dev.moe_bwd_probe --json "$out/bwd-probe.jsonl" > "$out/bwd-probe.log" 2>&1
    echo "bwd probe rc=$?"; keep
    left=$((540 - SECONDS)); [ $left -gt 200 ] && left=200
    [ $left -gt 30 ] && timeout $left python -m dev.archive.moe_bwd_tiles --max-seconds $((left - 25)) \
      --json "$out/bwd-tiles.jsonl" > "$out/bwd-tiles.log" 2>&1; echo "tiles rc=$?"
    wait $regs_pid; keep
    sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe.log"; grep -E "gemm1_recompute|gu_saved" "$out/bwd-probe.log" | tail -2
    sed -n '/== best/,$p' "$out/bwd-tiles.log"; grep forward "$out/bwd-tiles.log" | head -4
    grep -E "moe_forward|dgrad|wgrad" "$out/regs-moe.txt" | head -14 ;;
  s11c)  # session 11, last call (<= 540 s; tarball $OUT/s11c.tar.gz): save_gu's GPU tests, the bench's MoE backward
         # rows at qwen3 4k (issue 15's committed result), the backward GEMM tiles again (dgrad2 fixed, dgrad1's
         # new default), the probe's stages with what time is left.
    begin_stage s11c
    timeout 150 python -m pytest -v -p no:cacheprovider --timeout 60 -m "gpu or ranks or gpu_optional" \
      tests/test_moe_backward.py tests/test_launch_plan.py > "$out/gpu-tests-bwd.log" 2>&1
    echo "gpu tests bwd rc=$?"; tail -1 "$out/gpu-tests-bwd.log"
    timeout 60 python -m pytest -v -p no:cacheprovider --timeout 40 -m gpu tests/test_moe_forward.py -k "w1" \
      > "$out/gpu-tests-fwd.log" 2>&1; echo "gpu tests fwd rc=$?"; tail -1 "$out/gpu-tests-fwd.log"
    grep -hE "(FAILED|ERROR)" "$out"/gpu-tests-*.log | head -8; keep
    timeout 200 python -m kosmos_bench.cli bench moe --ep 1 --model qwen3-235b --tokens 4096 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1.jsonl" > "$out/bench-moe-bwd.log" 2>&1
    echo "bench rc=$?"; keep
    timeout 70 python -m dev.archive.moe_bwd_tiles --only dgrad2,dgrad1 --max-seconds 55 --json "$out/bwd-tiles.jsonl" \
      > "$out/bwd-tiles.log" 2>&1; echo "tiles rc=$?"; keep
    left=$((535 - SECONDS))
    [ $left -gt 40 ] && timeout $left python -m dev.moe_bwd_probe --max-seconds $((left - 20)) --json \
      "$out/bwd-probe.jsonl" > "$out/bwd-probe.log" 2>&1; echo "bwd probe rc=$?"; keep
    grep -v "^{" "$out/bench-moe-bwd.log" | tail -14
    sed -n '/== best/,$p' "$out/bwd-tiles.log"; sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe.log" ;;
  s11d)  # session 11, fourth call (<= 330 s; tarball $OUT/s11d.tar.gz): the forward's GPU tests that s11c's 60 s
         # cut short (nn.MoE's backward on the saved g | u among them), the bench's MoE backward rows at the final
         # tiles (issue 15's committed result), the probe with what is left.
    begin_stage s11d
    timeout 110 python -m pytest -v -p no:cacheprovider --timeout 80 -m gpu tests/test_moe_forward.py \
      -k "w1_nn_moe_backward or w1_fixed_role or w1_expert_gemms" > "$out/gpu-tests-fwd.log" 2>&1
    echo "gpu tests fwd rc=$?"; grep -E "PASSED|FAILED|ERROR" "$out/gpu-tests-fwd.log" | sed 's/ *\[.*//'; keep
    timeout 110 python -m kosmos_bench.cli bench moe --ep 1 --model qwen3-235b --tokens 4096 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1.jsonl" > "$out/bench-moe-bwd.log" 2>&1
    echo "bench rc=$?"; keep
    left=$((320 - SECONDS))
    [ $left -gt 40 ] && timeout $left python -m dev.moe_bwd_probe --no-profile --max-seconds $((left - 20)) \
      --json "$out/bwd-probe.jsonl" > "$out/bwd-probe.log" 2>&1; echo "bwd probe rc=$?"; keep
    grep -v "^{" "$out/bench-moe-bwd.log" | grep -A6 "direction bwd" | head -8
    sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe.log" ;;
  s12a)  # written in session 11 for the next one-GPU session's first call (<= 420 s; tarball $OUT/s12a.tar.gz):
         # what session 11 changed after its last device call, and the checks it could not run.
    begin_stage s12a
    timeout 120 python -m pytest -v -p no:cacheprovider --timeout 60 -m gpu tests/test_moe_backward.py \
      -k "never_syncs or forwards_gate_up" > "$out/gpu-tests-bwd.log" 2>&1
    echo "gpu tests bwd rc=$?"; grep -E "PASSED|FAILED|ERROR" "$out/gpu-tests-bwd.log" | sed 's/ *\[.*//'; keep
    timeout 150 python -m pytest -v -p no:cacheprovider --timeout 80 -m "gpu or ranks" tests/test_cuda_graphs.py \
      -k "moe or capture or stalled" > "$out/gpu-tests-graphs.log" 2>&1
    echo "gpu tests graphs rc=$?"; grep -E "PASSED|FAILED|ERROR" "$out/gpu-tests-graphs.log" | sed 's/ *\[.*//'; keep
    left=$((400 - SECONDS))
    [ $left -gt 60 ] && timeout $left python -m dev.moe_bwd_probe --max-seconds $((left - 20)) \
      --json "$out/bwd-probe.jsonl" > "$out/bwd-probe.log" 2>&1; echo "bwd probe rc=$?"; keep
    grep -E "^  (sort|gu_saved) " "$out/bwd-probe.log" | tail -2; sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe.log" ;;
  s12b)  # session 12, second call (<= 560 s; tarball $OUT/s12b.tar.gz): dgrad2 unfused (the dgrad1 GEMM for z, then
         # the SwiGLU-backward pass) against the fused epilogue, wgrad's TMA stores; the backward's whole call
         # with dgrad2 unfused; Triton 3.6 registers; the changed kernels' GPU tests; deepseek-v3's probe.
    begin_stage s12b
    ( timeout 200 python dev/kernel_resources.py --world 1 --kernels moe_backward \
        --json "$out/regs-bwd.json" > "$out/regs-bwd.txt" 2>&1 ) &
    regs_pid=$!
    timeout 100 python -m pytest -v -p no:cacheprovider --timeout 60 -m gpu tests/test_moe_backward.py \
      -k "weight_grads or dgrad" > "$out/gpu-tests-bwd.log" 2>&1
    echo "gpu tests bwd rc=$?"; grep -E "PASSED|FAILED|ERROR" "$out/gpu-tests-bwd.log" | sed 's/ *\[.*//' | grep -v PASSED
    tail -1 "$out/gpu-tests-bwd.log"; keep
    timeout 170 python -m dev.archive.moe_bwd_tiles --only dgrad2,wgrad2,wgrad1 --max-seconds 150 \
      --json "$out/bwd-tiles.jsonl" > "$out/bwd-tiles.log" 2>&1; echo "tiles rc=$?"; keep
    timeout 110 python -m dev.moe_bwd_probe --dgrad2 unfused --max-seconds 90 --json "$out/bwd-probe-unfused.jsonl" \
      > "$out/bwd-probe-unfused.log" 2>&1; echo "bwd probe unfused rc=$?"; keep
    wait $regs_pid; keep
    left=$((540 - SECONDS))
    [ $left -gt 60 ] && timeout $left python -m dev.moe_bwd_probe --model deepseek-v3 --no-profile \
      --max-seconds $((left - 25)) --json "$out/bwd-probe-dsv3.jsonl" > "$out/bwd-probe-dsv3.log" 2>&1
    echo "bwd probe dsv3 rc=$?"; keep
    grep -E "^  (dgrad2|wgrad)" "$out/bwd-tiles.log"
    sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe-unfused.log"; grep -E "^  dgrad2_swiglu " "$out/bwd-probe-unfused.log"
    grep -E "wgrad|dgrad|swiglu_backward" "$out/regs-bwd.txt"
    sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe-dsv3.log"; tail -3 "$out/bwd-probe-dsv3.log" ;;
  s12c)  # session 12, third call (<= 560 s; tarball $OUT/s12c.tar.gz): the router's GEMMs on tensor cores and dgrad2
         # unfused (the new defaults) in the probe at qwen3 and deepseek-v3 4k; wgrad with more, smaller programs
         # per SM at both; the MX MoE kernel's Triton 3.6 registers on main and on moe-mx-halves (.base).
    begin_stage s12c
    here=$PWD
    ( for t in main:. mxh:.base; do (cd "${t#*:}" && timeout 200 python dev/kernel_resources.py --world 1,2,8 \
        --kernels moe_forward --mx > "$out/regs-mx-${t%%:*}.txt" 2>&1); done ) &
    regs_pid=$!
    timeout 100 python -m pytest -v -p no:cacheprovider --timeout 60 -m gpu tests/test_moe_backward.py \
      -k "router or dgrad2 or never_syncs or forwards_gate_up" > "$out/gpu-tests-bwd.log" 2>&1
    echo "gpu tests bwd rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-bwd.log" | sed 's/ *\[.*//'
    tail -1 "$out/gpu-tests-bwd.log"; keep
    timeout 100 python -m dev.moe_bwd_probe --no-profile --max-seconds 80 --json "$out/bwd-probe-qwen3.jsonl" \
      > "$out/bwd-probe-qwen3.log" 2>&1; echo "bwd probe qwen3 rc=$?"; keep
    timeout 150 python -m dev.moe_bwd_probe --model deepseek-v3 --no-profile --max-seconds 130 \
      --json "$out/bwd-probe-dsv3.jsonl" > "$out/bwd-probe-dsv3.log" 2>&1; echo "bwd probe dsv3 rc=$?"; keep
    timeout 150 python -m dev.archive.moe_bwd_tiles --model deepseek-v3 --only wgrad2,wgrad1,dgrad2 --max-seconds 130 \
      --json "$out/bwd-tiles-dsv3.jsonl" > "$out/bwd-tiles-dsv3.log" 2>&1; echo "tiles dsv3 rc=$?"; keep
    left=$((530 - SECONDS)); [ $left -gt 110 ] && left=110
    [ $left -gt 30 ] && timeout $left python -m dev.archive.moe_bwd_tiles --only wgrad2,wgrad1 --max-seconds $((left - 15)) \
      --json "$out/bwd-tiles-qwen3.jsonl" > "$out/bwd-tiles-qwen3.log" 2>&1; echo "tiles qwen3 rc=$?"
    wait $regs_pid; keep
    for m in qwen3 dsv3; do sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe-$m.log" | head -3; \
      grep -E "^  (dgrad2_swiglu|router_logits|router_bwd|wgrad1|wgrad2) " "$out/bwd-probe-$m.log"; done
    for m in dsv3 qwen3; do echo "tiles $m"; grep -E "^  (dgrad2|wgrad)" "$out/bwd-tiles-$m.log"; done
    for t in main mxh; do echo "regs $t"; grep -E "moe" "$out/regs-mx-$t.txt"; done ;;
  s12d)  # session 12, fourth call (<= 330 s; tarball $OUT/s12d.tar.gz): deepseek-v3 4k tiles (~128 rows per expert):
         # 64-row m-tiles for dgrad1 / dgrad2's GEMM, the wgrad variants (wgrad1 OOMed in call c: fp32 copies in
         # rel), and the router test with its thresholds from call c.
    begin_stage s12d
    timeout 60 python -m pytest -v -s -p no:cacheprovider --timeout 40 -m gpu tests/test_moe_backward.py \
      -k "router" > "$out/gpu-tests-router.log" 2>&1
    echo "gpu tests router rc=$?"; grep -E "PASSED|FAILED|errors vs" "$out/gpu-tests-router.log" | cut -c1-200; keep
    timeout 250 python -m dev.archive.moe_bwd_tiles --model deepseek-v3 --only dgrad1,dgrad2,wgrad2,wgrad1 --max-seconds 230 \
      --json "$out/bwd-tiles-dsv3.jsonl" > "$out/bwd-tiles-dsv3.log" 2>&1; echo "tiles dsv3 rc=$?"; keep
    grep -E "^  (dgrad|wgrad)" "$out/bwd-tiles-dsv3.log" | cut -c1-150 ;;
  s12e)  # session 12, last call (<= 580 s; tarball $OUT/s12e.tar.gz): issue 15's committed results -- the MoE
         # backward bench at EP=1, qwen3-235b and deepseek-v3 (chunked fp32 gradient check), 4k and 8k tokens --
         # and the changed backward's GPU tests.
    begin_stage s12e
    timeout 80 python -m pytest -v -p no:cacheprovider --timeout 60 -m gpu tests/test_moe_backward.py \
      -k "weight_grads or dgrad2 or never_syncs or w1" > "$out/gpu-tests-bwd.log" 2>&1
    echo "gpu tests bwd rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-bwd.log" | sed 's/ *\[.*//'
    tail -1 "$out/gpu-tests-bwd.log"; keep
    timeout 200 python -m kosmos_bench.cli bench moe --ep 1 --model qwen3-235b --tokens 4096,8192 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1.jsonl" > "$out/bench-qwen3.log" 2>&1
    echo "bench qwen3 rc=$?"; keep
    left=$((570 - SECONDS))
    timeout $left python -m kosmos_bench.cli bench moe --ep 1 --model deepseek-v3 --tokens 4096,8192 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1-deepseek-v3.jsonl" > "$out/bench-dsv3.log" 2>&1
    echo "bench dsv3 rc=$?"; keep
    for m in qwen3 dsv3; do grep -v "^{" "$out/bench-$m.log" | grep -iE "bwd|error|fail" | head -12; done ;;
  s12f)  # session 12, closing call (<= 330 s; tarball $OUT/s12f.tar.gz): deepseek-v3 8k zipf:1.2 alone (the point
         # s12e's sweep lost to out-of-memory; gc.collect() per point since), then issue 14's MX MoE A/B:
         # moe-mx-halves (.base) and main, interleaved twice, qwen3-235b 4k fwd, bf16 + mxfp8, each from its tree.
    begin_stage s12f
    timeout 130 python -m kosmos_bench.cli bench moe --ep 1 --model deepseek-v3 --tokens 8192 --routing zipf:1.2 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1-deepseek-v3-8k-zipf.jsonl" > "$out/bench-dsv3-8k.log" 2>&1
    echo "bench dsv3 8k zipf rc=$?"; keep
    for pass in 1 2; do for t in mxh:.base main:.; do
      left=$((320 - SECONDS)); [ $left -lt 30 ] && break 2
      (cd "${t#*:}" && timeout $left python -m kosmos_bench.cli bench moe --ep 1 --model qwen3-235b --tokens 4096 \
        --dtype bf16,mxfp8 --out "$out/mx-ab-${t%%:*}-$pass.jsonl" > "$out/mx-ab-${t%%:*}-$pass.log" 2>&1)
      echo "mx ab ${t%%:*} pass $pass rc=$?"; keep
    done; done
    grep -v "^{" "$out/bench-dsv3-8k.log" | tail -12 ;;
  s12g)  # session 12, spare minutes (<= 200 s; tarball $OUT/s12g.tar.gz): the merged MX halves tree and the shared
         # SwiGLU-backward formula on the GPU: their tests and Triton 3.6 registers.
    begin_stage s12g
    ( timeout 150 python dev/kernel_resources.py --world 1,2,8 --kernels moe_forward --mx > "$out/regs-mx.txt" 2>&1 ) &
    regs_pid=$!
    timeout 80 python -m pytest -v -p no:cacheprovider --timeout 60 -m gpu tests/test_moe_backward.py \
      -k "dgrad2 or w1" > "$out/gpu-tests-bwd.log" 2>&1
    echo "gpu tests bwd rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-bwd.log" | sed 's/ *\[.*//'; tail -1 "$out/gpu-tests-bwd.log"
    timeout 90 python -m pytest -v -p no:cacheprovider --timeout 60 -m "gpu or ranks" tests/test_moe_forward.py \
      -k "mx" > "$out/gpu-tests-fwd-mx.log" 2>&1
    echo "gpu tests fwd mx rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-fwd-mx.log" | sed 's/ *\[.*//'
    tail -1 "$out/gpu-tests-fwd-mx.log"; keep
    wait $regs_pid; grep moe "$out/regs-mx.txt"; keep ;;
  s13a)  # session 13, first call (<= 480 s; tarball $OUT/s13a.tar.gz): the flat wgrad on the padded row layout
         # (built in session 12, never on a GPU): its GPU test, Triton 3.6 registers, then the tiles probe's wgrad
         # variants at deepseek-v3 4k (wgrad2 and wgrad1 separately: memory) and qwen3 4k.
    begin_stage s13a
    ( timeout 200 python dev/kernel_resources.py --world 1 --kernels moe_backward > "$out/regs-bwd.txt" 2>&1 ) &
    regs_pid=$!
    gpu_tests gpu-tests-padded 90 "padded" tests/test_moe_backward.py
    for k in wgrad2 wgrad1; do
      timeout 120 python -m dev.archive.moe_bwd_tiles --model deepseek-v3 --only $k --max-seconds 100 \
        --json "$out/tiles-dsv3-$k.jsonl" > "$out/tiles-dsv3-$k.log" 2>&1; echo "tiles dsv3 $k rc=$?"; keep
    done
    left=$((470 - SECONDS)); [ $left -gt 120 ] && left=120
    [ $left -gt 30 ] && timeout $left python -m dev.archive.moe_bwd_tiles --only wgrad2,wgrad1 --max-seconds $((left - 15)) \
      --json "$out/tiles-qwen3.jsonl" > "$out/tiles-qwen3.log" 2>&1; echo "tiles qwen3 rc=$?"
    wait $regs_pid; keep
    grep -E "wgrad" "$out/regs-bwd.txt"
    for f in tiles-dsv3-wgrad2 tiles-dsv3-wgrad1 tiles-qwen3; do echo "$f"; grep -E "^  (wgrad)" "$out/$f.log" | cut -c1-150; done ;;
  s13b)  # session 13, second call (<= 560 s; tarball $OUT/s13b.tar.gz): moe_backward on the padded row layout
         # (gathers straight into it, the flat wgrad, dgrads on padded offsets): its GPU tests, Triton 3.6 registers,
         # the layouts' A/B in one process (bitwise + interleaved timing) at deepseek-v3 and qwen3 4k, the tiles
         # probe's wgrad1 at deepseek-v3 (OOMed in s13a: the finite check's fp32 copy), the stage probe at dsv3.
    begin_stage s13b
    ( timeout 200 python dev/kernel_resources.py --world 1 --kernels moe_backward > "$out/regs-bwd.txt" 2>&1 ) &
    regs_pid=$!
    gpu_tests gpu-tests-bwd 120 "padded or never_syncs or forwards_gate_up or dgrad" tests/test_moe_backward.py
    for m in deepseek-v3 qwen3-235b; do
      timeout 110 python -m dev.moe_bwd_layout_ab --model $m --json "$out/layout-ab-$m.jsonl" \
        > "$out/layout-ab-$m.log" 2>&1; echo "layout ab $m rc=$?"; keep
    done
    timeout 110 python -m dev.archive.moe_bwd_tiles --model deepseek-v3 --only wgrad1 --max-seconds 90 \
      --json "$out/tiles-dsv3-wgrad1.jsonl" > "$out/tiles-dsv3-wgrad1.log" 2>&1; echo "tiles dsv3 wgrad1 rc=$?"; keep
    left=$((545 - SECONDS)); [ $left -gt 150 ] && left=150
    [ $left -gt 60 ] && timeout $left python -m dev.moe_bwd_probe --model deepseek-v3 --no-profile \
      --max-seconds $((left - 25)) --json "$out/bwd-probe-dsv3.jsonl" > "$out/bwd-probe-dsv3.log" 2>&1
    echo "bwd probe dsv3 rc=$?"; wait $regs_pid; keep
    grep -E "wgrad-flat|gather|scaled" "$out/regs-bwd.txt"
    for m in deepseek-v3 qwen3-235b; do grep -v "^{" "$out/layout-ab-$m.log" | tail -8; done
    grep -E "^  wgrad1" "$out/tiles-dsv3-wgrad1.log" | cut -c1-150
    sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe-dsv3.log"; tail -4 "$out/bwd-probe-dsv3.log" ;;
  s13c)  # session 13, third call (<= 560 s; tarball $OUT/s13c.tar.gz): the padded backward's fixed GPU test and the
         # few-rows flat tiles; where the backward's host time goes (cProfile, qwen3 4k); issue 15's committed
         # qwen3-235b bench (4k, 8k; fwd, bwd, fwd+bwd).
    begin_stage s13c
    gpu_tests gpu-tests-bwd 90 "padded" tests/test_moe_backward.py
    timeout 80 python -m dev.moe_bwd_layout_ab --model qwen3-235b --passes 1 --host-profile 10 \
      --json "$out/host-profile-qwen3.jsonl" > "$out/host-profile-qwen3.log" 2>&1; echo "host profile rc=$?"; keep
    timeout 300 python -m kosmos_bench.cli bench moe --ep 1 --model qwen3-235b --tokens 4096,8192 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1.jsonl" > "$out/bench-qwen3.log" 2>&1
    echo "bench qwen3 rc=$?"; keep
    grep -v "^{" "$out/host-profile-qwen3.log" | head -40 | cut -c1-160
    grep -v "^{" "$out/bench-qwen3.log" | grep -iE "bwd|error|fail|peak" | head -14 ;;
  s13d)  # session 13, fourth call (<= 560 s; tarball $OUT/s13d.tar.gz): issue 15's committed deepseek-v3 bench (4k,
         # 8k; fwd, bwd, fwd+bwd) on the padded backward, and each point's peak memory (the sweep's growth in s12e).
    begin_stage s13d
    timeout 540 python -m kosmos_bench.cli bench moe --ep 1 --model deepseek-v3 --tokens 4096,8192 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1-deepseek-v3.jsonl" > "$out/bench-dsv3.log" 2>&1
    echo "bench dsv3 rc=$?"; keep
    bwd_rows "$out/moe-bwd-ep1-deepseek-v3.jsonl"
    grep -v "^{" "$out/bench-dsv3.log" | grep -iE "bwd|error|fail" | head -12 ;;
  s13e)  # session 13, fifth call (<= 560 s; tarball $OUT/s13e.tar.gz): deepseek-v3 4k zipf:1.2, where the padded
         # backward lost (s13d: 21.97 -> 23.53 ms): the layouts' A/B there, the wgrad tiles on its row counts, and
         # the stage probe (padded).
    begin_stage s13e
    timeout 120 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --routing zipf:1.2 --passes 2 \
      --json "$out/layout-ab-dsv3-zipf.jsonl" > "$out/layout-ab-dsv3-zipf.log" 2>&1; echo "layout ab rc=$?"; keep
    for k in wgrad2 wgrad1; do
      timeout 130 python -m dev.archive.moe_bwd_tiles --model deepseek-v3 --routing zipf:1.2 --only $k --max-seconds 110 \
        --json "$out/tiles-dsv3-zipf-$k.jsonl" > "$out/tiles-dsv3-zipf-$k.log" 2>&1; echo "tiles $k rc=$?"; keep
    done
    left=$((545 - SECONDS)); [ $left -gt 160 ] && left=160
    [ $left -gt 60 ] && timeout $left python -m dev.moe_bwd_probe --model deepseek-v3 --routing zipf:1.2 --no-profile \
      --max-seconds $((left - 25)) --json "$out/bwd-probe-dsv3-zipf.jsonl" > "$out/bwd-probe-dsv3-zipf.log" 2>&1
    echo "bwd probe rc=$?"; keep
    grep -v "^{" "$out/layout-ab-dsv3-zipf.log" | tail -6
    for k in wgrad2 wgrad1; do head -1 "$out/tiles-dsv3-zipf-$k.log"; grep -E "^  wgrad" "$out/tiles-dsv3-zipf-$k.log" | cut -c1-130; done
    grep -E "^  stage" "$out/bwd-probe-dsv3-zipf.log" | cut -c1-90; sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe-dsv3-zipf.log" | head -3 ;;
  s13f)  # session 13, sixth call (<= 560 s; tarball $OUT/s13f.tar.gz): the flat wgrad on 128x256 s3 at every row count
         # (the few-rows tile lost 3 ms at deepseek-v3 4k zipf in s13e): issue 15's committed deepseek-v3 bench again,
         # then the stage probe at deepseek-v3 8k zipf:1.2 (the point furthest from the bar in s13d).
    begin_stage s13f
    timeout 400 python -m kosmos_bench.cli bench moe --ep 1 --model deepseek-v3 --tokens 4096,8192 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1-deepseek-v3.jsonl" > "$out/bench-dsv3.log" 2>&1
    echo "bench dsv3 rc=$?"; keep
    left=$((545 - SECONDS)); [ $left -gt 170 ] && left=170
    [ $left -gt 60 ] && timeout $left python -m dev.moe_bwd_probe --model deepseek-v3 --tokens 8192 --routing zipf:1.2 \
      --max-seconds $((left - 25)) --json "$out/bwd-probe-dsv3-8k-zipf.jsonl" > "$out/bwd-probe-dsv3-8k-zipf.log" 2>&1
    echo "bwd probe rc=$?"; keep
    bwd_rows "$out/moe-bwd-ep1-deepseek-v3.jsonl"
    grep -E "^  stage" "$out/bwd-probe-dsv3-8k-zipf.log" | cut -c1-90
    sed -n '/kosmos whole/,/composed/p' "$out/bwd-probe-dsv3-8k-zipf.log" | head -3 ;;
  s13g)  # session 13, seventh call (<= 400 s; tarball $OUT/s13g.tar.gz): the flat wgrad's tiles at deepseek-v3 8k
         # zipf:1.2 (wgrad2 0.82x torch there in s13f), wgrad2 and wgrad1 separately (memory).
    begin_stage s13g
    for k in wgrad2 wgrad1; do
      timeout 170 python -m dev.archive.moe_bwd_tiles --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --only $k \
        --max-seconds 150 --json "$out/tiles-dsv3-8k-zipf-$k.jsonl" > "$out/tiles-dsv3-8k-zipf-$k.log" 2>&1
      echo "tiles $k rc=$?"; keep
    done
    for k in wgrad2 wgrad1; do head -1 "$out/tiles-dsv3-8k-zipf-$k.log"; grep -E "^  wgrad" "$out/tiles-dsv3-8k-zipf-$k.log" | cut -c1-130; done ;;
  s13h)  # session 13, last call (<= 590 s; tarball $OUT/s13h.tar.gz): dy_rows and do from one gather, the flat wgrad's
         # 256x128 tile where dW's first dimension is the shorter (wgrad2): the GPU tests, Triton 3.6 registers, the
         # wgrad2 tiles at qwen3 4k and deepseek-v3 4k (does 256x128 win there too?), then issue 15's committed
         # benches (qwen3-235b, deepseek-v3; 4k, 8k; fwd, bwd, fwd+bwd).
    begin_stage s13h
    ( timeout 200 python dev/kernel_resources.py --world 1 --kernels moe_backward > "$out/regs-bwd.txt" 2>&1 ) &
    regs_pid=$!
    gpu_tests gpu-tests-bwd 100 "padded or never_syncs or forwards_gate_up" tests/test_moe_backward.py
    for m in qwen3-235b deepseek-v3; do
      timeout 80 python -m dev.archive.moe_bwd_tiles --model $m --only wgrad2 --max-seconds 65 \
        --json "$out/tiles-$m-wgrad2.jsonl" > "$out/tiles-$m-wgrad2.log" 2>&1; echo "tiles $m rc=$?"; keep
    done
    timeout 170 python -m kosmos_bench.cli bench moe --ep 1 --model qwen3-235b --tokens 4096,8192 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1.jsonl" > "$out/bench-qwen3.log" 2>&1
    echo "bench qwen3 rc=$?"; keep
    left=$((580 - SECONDS))
    timeout $left python -m kosmos_bench.cli bench moe --ep 1 --model deepseek-v3 --tokens 4096,8192 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1-deepseek-v3.jsonl" > "$out/bench-dsv3.log" 2>&1
    echo "bench dsv3 rc=$?"; wait $regs_pid; keep
    grep -E "wgrad-flat|gather|scaled" "$out/regs-bwd.txt"
    for m in qwen3-235b deepseek-v3; do grep -E "flat|default" "$out/tiles-$m-wgrad2.log" | cut -c1-120; done
    for f in moe-bwd-ep1 moe-bwd-ep1-deepseek-v3; do bwd_rows "$out/$f.jsonl"; done ;;
  s13i)  # session 13, spare minutes (<= 240 s; tarball $OUT/s13i.tar.gz): issue 14's MX MoE forward on the merged
         # halves tree (never timed since the merge): qwen3-235b 4k, 8k, bf16 + mxfp8 in one sweep.
    begin_stage s13i
    timeout 230 python -m kosmos_bench.cli bench moe --ep 1 --model qwen3-235b --tokens 4096,8192 --dtype bf16,mxfp8 \
      --out "$out/moe-mxfp8-ep1-qwen3.jsonl" > "$out/bench-mx.log" 2>&1; echo "bench mx rc=$?"; keep
    grep -v "^{" "$out/bench-mx.log" | grep -iE "mxfp8|ratio|kosmos" | head -16 ;;
  s13j)  # session 13, last minutes (<= 200 s; tarball $OUT/s13j.tar.gz): the flat wgrad with a TMA-store epilogue
         # (one [E, KA, KB] descriptor): its GPU test, then wgrad2 / wgrad1 at deepseek-v3 8k zipf:1.2 (the point
         # furthest behind torch), the first five variants of each.
    begin_stage s13j
    gpu_tests gpu-tests-padded 60 "padded_gpu" tests/test_moe_backward.py
    for k in wgrad2 wgrad1; do
      timeout 65 python -m dev.archive.moe_bwd_tiles --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --only $k \
        --max-seconds 50 --json "$out/tiles-dsv3-8k-zipf-$k.jsonl" > "$out/tiles-dsv3-8k-zipf-$k.log" 2>&1
      echo "tiles $k rc=$?"; keep
    done
    for k in wgrad2 wgrad1; do grep -E "^  wgrad" "$out/tiles-dsv3-8k-zipf-$k.log" | head -6 | cut -c1-120; done ;;
  s14a)  # written in session 13 for the next one-GPU session (<= 560 s; tarball $OUT/s14a.tar.gz): branch
         # dgrad2-valid-rows (.base: `git archive dgrad2-valid-rows kosmos kosmos_bench suites tests dev pyproject.toml
         # | tar -x -C .snap/.base`) against main: the SwiGLU pass reads z's gap rows as zeros (no z memset) and the
         # row gathers skip the rows past the last expert. Its GPU tests, then the deepseek-v3 backward bench
         # interleaved twice, each tree from its own directory; then dev.ab_compare.
    begin_stage s14a
    (cd .base && timeout 90 python -m pytest -v -p no:cacheprovider --timeout 60 -m gpu tests/test_moe_backward.py \
      -k "padded or never_syncs or forwards_gate_up or dgrad2" > "$out/gpu-tests-branch.log" 2>&1)
    echo "gpu tests branch rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-branch.log" | sed 's/ *\[.*//'
    tail -1 "$out/gpu-tests-branch.log"; keep
    for pass in 1 2 3; do for t in valid:.base main:.; do
      left=$((545 - SECONDS)); [ $left -lt 60 ] && break 2
      commit=$KOSMOS_GIT_COMMIT; [ "${t#*:}" = .base ] && commit=${BASE_COMMIT:-unknown}  # each tree its own sha
      (cd "${t#*:}" && KOSMOS_GIT_COMMIT=$commit timeout $left python -m kosmos_bench.cli bench moe --ep 1 --model deepseek-v3 \
        --tokens 4096,8192 --direction bwd --impl kosmos --no-expert-gemms \
        --out "$out/ab-${t%%:*}-$pass.jsonl" > "$out/ab-${t%%:*}-$pass.log" 2>&1)
      echo "ab ${t%%:*} pass $pass rc=$?"; keep
    done; done
    python -m dev.ab_compare "$out"/ab-main-*.jsonl --vs "$out"/ab-valid-*.jsonl --impl kosmos 2>&1 | tail -12 ;;
  s14b)  # written in session 13 for the next one-GPU session (<= 560 s; tarball $OUT/s14b.tar.gz): branch moe-mx-w1
         # (helper; .base: `git archive moe-mx-w1 kosmos kosmos_bench suites tests dev pyproject.toml | tar -x -C
         # .snap/.base`): the MXFP8 forward at W=1 with x's MX values dispatched as bf16 rows. Its GPU tests, then
         # mx_w1_rows=values against =payload in that one tree (a config knob: same process kind, interleaved
         # twice), qwen3-235b 4k/8k, bf16 + mxfp8 (issue 14's bar: mxfp8 <= 1.05x bf16). Predicted 1.13 -> ~1.11.
    begin_stage s14b
    (cd .base && timeout 120 python -m pytest -v -p no:cacheprovider --timeout 80 -m "gpu or ranks" \
      tests/test_moe_forward.py tests/test_quant.py tests/test_cuda_graphs.py -k "mx" > "$out/gpu-tests-mx.log" 2>&1)
    echo "gpu tests mx rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-mx.log" | sed 's/ *\[.*//'
    tail -1 "$out/gpu-tests-mx.log"; keep
    for pass in 1 2 3; do for v in values payload; do
      left=$((545 - SECONDS)); [ $left -lt 60 ] && break 2
      (cd .base && KOSMOS_GIT_COMMIT=${BASE_COMMIT:-unknown} timeout $left python -m kosmos_bench.cli bench moe --ep 1 \
        --model qwen3-235b --tokens 4096,8192 \
        --dtype bf16,mxfp8 --impl kosmos --no-expert-gemms --config moe_fwd.mx_w1_rows=$v --out "$out/mx-$v-$pass.jsonl" > "$out/mx-$v-$pass.log" 2>&1)
      echo "mx $v pass $pass rc=$?"; keep
    done; done
    for f in "$out"/mx-*-*.log; do echo "$f"; sed -n '/mxfp8 \/ bf16/,/^$/p' "$f" | head -9; done ;;
  s14c)  # session 14 (<= 400 s; tarball $OUT/s14c.tar.gz): issue 14's MX forward by task kind (moe_probe --dtype
         # bf16,mxfp8, qwen3-235b and deepseek-v3 4k: where mxfp8's extra 15% goes), then issue 15's dgrad tiles
         # at deepseek-v3 8k zipf:1.2 (0.96x torch there, 1.25x at 4k).
    begin_stage s14c
    for m in qwen3-235b deepseek-v3; do
      timeout 120 python -m dev.moe_probe --model $m --tokens 4096 --dtype bf16,mxfp8 --out "$out/probe-$m" \
        > "$out/probe-$m.log" 2>&1; echo "probe $m rc=$?"; keep
    done
    timeout 130 python -m dev.archive.moe_bwd_tiles --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --only dgrad1,dgrad2 \
      --max-seconds 100 --json "$out/tiles-dsv3-8k-zipf-dgrad.jsonl" > "$out/tiles-dsv3-8k-zipf-dgrad.log" 2>&1
    echo "tiles dgrad rc=$?"; keep
    for m in qwen3-235b deepseek-v3; do grep -vE "^\s*$" "$out/probe-$m.log" | grep -v Warning | tail -24; done
    grep -E "^  dgrad" "$out/tiles-dsv3-8k-zipf-dgrad.log" | cut -c1-120 | head -20 ;;
  s14d)  # session 14 (<= 420 s; tarball $OUT/s14d.tar.gz): branch mx-round-float (.base: `git archive mx-round-float
         # kosmos kosmos_bench suites tests dev pyproject.toml | tar -x -C .snap/.base`) against main: h's MX rounding
         # in GEMM1's epilogue on the floating-point path. Its GPU tests, then qwen3-235b 4k/8k bf16 + mxfp8
         # (kosmos only) interleaved twice, each tree from its own directory; the branch's MX forward by task
         # kind; deepseek-v3 4k/8k on the branch if time is left.
    begin_stage s14d
    (cd .base && timeout 150 python -m pytest -v -p no:cacheprovider --timeout 120 -m "gpu or ranks" \
      tests/test_quant.py tests/test_moe_forward.py -k "in_register or kernel_matches or mxfp8" \
      > "$out/gpu-tests-branch.log" 2>&1)
    echo "gpu tests branch rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-branch.log" | sed 's/ *\[.*//'
    tail -1 "$out/gpu-tests-branch.log"; keep
    for pass in 1 2; do for t in float:.base main:.; do
      left=$((380 - SECONDS)); [ $left -lt 40 ] && break 2
      commit=$KOSMOS_GIT_COMMIT; [ "${t#*:}" = .base ] && commit=${BASE_COMMIT:-unknown}
      (cd "${t#*:}" && KOSMOS_GIT_COMMIT=$commit timeout $left python -m kosmos_bench.cli bench moe --ep 1 \
        --model qwen3-235b --tokens 4096,8192 --dtype bf16,mxfp8 --impl kosmos --no-expert-gemms \
        --out "$out/ab-${t%%:*}-$pass.jsonl" > "$out/ab-${t%%:*}-$pass.log" 2>&1)
      echo "ab ${t%%:*} pass $pass rc=$?"; keep
    done; done
    (cd .base && timeout 90 python -m dev.moe_probe --model qwen3-235b --tokens 4096 --dtype mxfp8 \
      --out "$out/probe-branch" > "$out/probe-branch.log" 2>&1); echo "probe branch rc=$?"; keep
    left=$((560 - SECONDS))
    [ $left -gt 60 ] && (cd .base && KOSMOS_GIT_COMMIT=${BASE_COMMIT:-unknown} timeout $left python -m kosmos_bench.cli \
      bench moe --ep 1 --model deepseek-v3 --tokens 4096,8192 --dtype bf16,mxfp8 --impl kosmos --no-expert-gemms \
      --out "$out/dsv3-float.jsonl" > "$out/dsv3-float.log" 2>&1; echo "dsv3 branch rc=$?"); keep
    python -m dev.ab_compare "$out"/ab-main-*.jsonl --vs "$out"/ab-float-*.jsonl --impl kosmos 2>&1 | tail -12
    grep -E "gemm1|gemm2|median" "$out/probe-branch.log"
    [ -f "$out/dsv3-float.log" ] && sed -n '/mxfp8 \/ bf16/,/^$/p' "$out/dsv3-float.log" | head -9 ;;
  s14e)  # session 14's last call (<= 470 s; tarball $OUT/s14e.tar.gz). Trees: .base = branch mx-quantize-float
         # (quantize_mx on the floating-point path), .ol = branch moe-bwd-one-launch (the backward's expert part in
         # one persistent launch), . = main. 1. quantize: its GPU tests, quantize_mx alone in both trees (the
         # branch's probe script over main's package for main), interleaved twice. 2. the one launch: its GPU
         # tests, then dev.moe_bwd_layout_ab --variants padded,one-launch at qwen3-235b and deepseek-v3 4k (one
         # process each, bitwise first). 3. if time is left: issue 14's committed MoE run (bf16 + mxfp8, both
         # models, kosmos + nccl-a2a) from .base.
    begin_stage s14e
    (cd .base && timeout 70 python -m pytest -q -p no:cacheprovider --timeout 60 -m gpu tests/test_quant.py \
      > "$out/gpu-tests-quant.log" 2>&1); echo "gpu tests quant rc=$?"; tail -1 "$out/gpu-tests-quant.log"
    grep -E "^FAILED" "$out/gpu-tests-quant.log" | head -5
    for pass in 1 2; do
      (cd .base && timeout 40 python dev/mx_probe.py --quantize-only --json "$out/quant-float-$pass.jsonl" \
        > "$out/quant-float-$pass.log" 2>&1); echo "quant float $pass rc=$?"
      timeout 40 python .base/dev/mx_probe.py --quantize-only --json "$out/quant-main-$pass.jsonl" \
        > "$out/quant-main-$pass.log" 2>&1; echo "quant main $pass rc=$?"
    done; keep
    (cd .ol && timeout 150 python -m pytest -v -p no:cacheprovider --timeout 130 -m gpu tests/test_moe_backward.py \
      -k "one_launch" > "$out/gpu-tests-one-launch.log" 2>&1); echo "gpu tests one launch rc=$?"
    grep -E "PASSED|FAILED|ERROR" "$out/gpu-tests-one-launch.log" | sed 's/ *\[.*//' | cut -c1-150
    tail -1 "$out/gpu-tests-one-launch.log"; keep
    for m in qwen3-235b deepseek-v3; do
      left=$((400 - SECONDS)); [ $left -lt 40 ] && break
      (cd .ol && timeout $left python -m dev.moe_bwd_layout_ab --model $m --variants padded,one-launch --passes 2 \
        --iters 10 --warmup 3 --json "$out/one-launch-ab-$m.jsonl" > "$out/one-launch-ab-$m.log" 2>&1)
      echo "one launch ab $m rc=$?"; keep
    done
    left=$((455 - SECONDS))
    [ $left -gt 150 ] && (cd .base && KOSMOS_GIT_COMMIT=${BASE_COMMIT:-unknown} timeout $left python -m kosmos_bench.cli \
      bench moe --ep 1 --dtype bf16,mxfp8 --tokens 4096,8192 --impl kosmos,nccl-a2a --no-expert-gemms \
      --out "$out/moe-mxfp8-ep1.jsonl" > "$out/bench-moe-mxfp8.log" 2>&1; echo "moe mxfp8 rc=$?"); keep
    for f in "$out"/quant-*-*.log; do echo "${f##*/}"; grep "quantize_mx" "$f"; done
    for m in qwen3-235b deepseek-v3; do grep -E "bitwise|median of" "$out/one-launch-ab-$m.log" 2>/dev/null; done
    [ -f "$out/bench-moe-mxfp8.log" ] && sed -n '/mxfp8 \/ bf16/,/^$/p' "$out/bench-moe-mxfp8.log" | head -14 ;;
  s14f)  # session 14, the last minutes (<= 160 s; tarball $OUT/s14f.tar.gz), on branch moe-bwd-one-launch rebased
         # on main: the one launch's GPU tests at that code (the timeout test for both SWIGLU forms), then the TP
         # ops in MXFP8 with the floating-point quantize_mx (kosmos rows, llama3-70b TP=2 per-rank GEMMs).
    begin_stage s14f
    gpu_tests gpu-tests-one-launch 75 "one_launch" tests/test_moe_backward.py
    timeout $((150 - SECONDS)) python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b \
      --dtype bf16,mxfp8 --impl kosmos --out "$out/tp-mxfp8-kosmos.jsonl" > "$out/bench-tp-mx.log" 2>&1
    echo "tp mx rc=$?"; keep
    sed -n '/mxfp8 \/ bf16/,/^$/p' "$out/bench-tp-mx.log" | head -18 ;;
  s15a)  # session 15, first call (<= 420 s; tarball $OUT/s15a.tar.gz): what main has not run on a GPU (expert_gemms'
         # error path, the refactored skewed-layer tests), the host cost of each piece of an eager call's hit path
         # (issue 13: dev.fixed_cost --parts, then --plans), and the one launch against the multi-launch backward
         # at deepseek-v3 4k uniform with one traced call (per-stage table; where its +2-3% goes).
    begin_stage s15a
    gpu_tests gpu-tests-main 120 "expert_gemms or padded_rows_bitwise_packed_gpu or one_launch_bitwise_default_gpu" \
      tests/test_moe_forward.py tests/test_moe_backward.py
    timeout 60 python -m dev.fixed_cost --parts > "$out/fixed-cost-parts.log" 2>&1; echo "parts rc=$?"; keep
    timeout 70 python -m dev.fixed_cost --plans > "$out/fixed-cost-plans.log" 2>&1; echo "plans rc=$?"; keep
    left=$((400 - SECONDS)); [ $left -gt 200 ] && left=200
    timeout $left python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 4096 --routing uniform \
      --variants padded,one-launch --passes 2 --iters 10 --warmup 3 --trace "$out/traces" \
      --json "$out/one-launch-ab-dsv3-4096.jsonl" > "$out/one-launch-ab-dsv3-4096.log" 2>&1
    echo "one launch ab rc=$?"; keep
    sed -n '/^piece/,$p' "$out/fixed-cost-parts.log"
    grep -E "^(all_gather|matmul_reduce|moe_forward|torch)" "$out/fixed-cost-plans.log" | head -14
    grep -vE "Warning|warn" "$out/one-launch-ab-dsv3-4096.log" | tail -16 ;;
  s15b)  # session 15 (<= 340 s; tarball $OUT/s15b.tar.gz): issue 15's bar at the two deepseek-v3 points that missed it
         # in the committed 188a3a4 run (zipf:1.2 at 4k and 8k: 1.297x / 1.296x, bar 1.3x), at the current code
         # (valid-rows dgrad2 since): bwd only, kosmos and nccl-a2a, no expert-GEMM rows.
    begin_stage s15b
    timeout 210 python -m kosmos_bench.cli bench moe --ep 1 --model deepseek-v3 --tokens 4096,8192 --routing zipf:1.2 \
      --direction bwd --impl kosmos,nccl-a2a --no-expert-gemms --out "$out/moe-bwd-ep1-deepseek-v3-zipf.jsonl" \
      > "$out/bench-dsv3-zipf.log" 2>&1
    echo "bench dsv3 zipf rc=$?"; keep
    timeout 30 python -m kosmos_bench.cli report "$out/moe-bwd-ep1-deepseek-v3-zipf.jsonl" --format md \
      --out "$out/moe-bwd-ep1-deepseek-v3-zipf.md" >> "$out/bench-dsv3-zipf.log" 2>&1; keep
    bwd_rows "$out/moe-bwd-ep1-deepseek-v3-zipf.jsonl"
    grep -v "^{" "$out/bench-dsv3-zipf.log" | grep -iE "bwd|error|fail" | head -12
    # issue 16: the deepseek-v3 proxy at EP = 2 on one GPU with every implementation (deepep from .wheels/)
    deepep_install
    train_dsv3_w2_onegpu 330 100 ;;
  s15h)  # session 15 (<= 400 s; tarball $OUT/s15h.tar.gz): issue 13's host cost -- the hit path without the per-call
         # CUDA event (the mirror's flag word read directly), the cached CUDA availability and workspace lookup,
         # and launch_plan.DirectLaunch (Triton 3.6's C launcher with the argument list expanded once): its GPU
         # tests (errors, timeouts, plans, CUDA graphs; every W=1 TP op test, whose calls take the plans' fast
         # path), the pieces' host ns (fixed_cost --parts), then host us per eager call in this tree and in
         # .base (the tree before; this fixed_cost.py copied there).
    begin_stage s15h
    gpu_tests gpu-tests-host 110 "plan or graph or capture or error or timeout or stall or poison or fast or mirror or one_launch_bounded" \
      tests/test_launch_plan.py tests/test_runtime.py tests/test_cuda_graphs.py tests/test_all_gather_matmul.py \
      tests/test_matmul_reduce_scatter.py tests/test_moe_backward.py
    gpu_tests gpu-tests-tp-w1 130 "w1 or world1 or gpu" tests/test_all_gather_matmul.py \
      tests/test_matmul_reduce_scatter.py tests/test_nn_tp.py
    timeout 50 python -m dev.fixed_cost --parts > "$out/fixed-cost-parts.log" 2>&1; echo "parts rc=$?"; keep
    [ -d .base ] && cp dev/fixed_cost.py .base/dev/fixed_cost.py
    for t in new:. base:.base; do
      [ -d "${t#*:}" ] || continue
      left=$((390 - SECONDS)); [ $left -lt 30 ] && break
      (cd "${t#*:}" && timeout $((left < 50 ? left : 50)) python -m dev.fixed_cost --plans --fast-only \
        > "$out/fixed-cost-${t%%:*}-1.log" 2>&1); echo "fixed cost ${t%%:*} rc=$?"; keep
    done
    grep -vE "^(class|def|    |$)" "$out/fixed-cost-parts.log" | grep -E "ns$|closure|raw|:" | head -60
    for f in "$out"/fixed-cost-*-[12].log; do echo "${f##*/}"; grep -E "^(all_gather|matmul_reduce|moe_forward|torch|plan of)" "$f"; done ;;
  s15c)  # session 15 (<= 560 s; tarball $OUT/s15c.tar.gz): issue 16 at simulated W = 2 -- KOSMOS's own W > 1 ops
         # with both ranks' processes on this GPU over gloo, their symmetric buffers mapped by CUDA IPC: the ops'
         # GPU tests (both TP ops bf16 + MXFP8, the MoE layer, vs fp32 references), the train proxies' GPU tests,
         # then `kosmos bench train` at TP / EP = 2 on one GPU (llama3-8b and deepseek-v3 proxies, 20 steps), each
         # rendered (md + loss chart); then, if time is left, issue 13's host us per eager call (3 rounds).
    begin_stage s15c
    gpu_tests gpu-tests-ipc 200 "one_gpu" tests/test_ranks_one_gpu.py tests/test_bench_train.py
    for m in "llama3-8b --seq 2048 --scale 0.25" "deepseek-v3 --seq 1024 --scale 0.125"; do set -- $m
      left=$((470 - SECONDS)); [ $left -lt 60 ] && break; [ $left -gt 150 ] && left=150
      KOSMOS_RANKS_ON_ONE_GPU=1 timeout $left python -m kosmos_bench.cli bench train --model "$@" --layers 2 --tp 2 \
        --steps 20 --out "$out/train-$1-w2-onegpu.jsonl" > "$out/train-$1-w2-onegpu.log" 2>&1
      echo "train $1 w2 one gpu rc=$?"
      timeout 40 python -m kosmos_bench.cli report "$out/train-$1-w2-onegpu.jsonl" --format md \
        --out "$out/train-$1-w2-onegpu.md" --chart "$out/train-$1-w2-onegpu-loss.png" >> "$out/train-$1-w2-onegpu.log" 2>&1
      echo "report $1 rc=$?"; keep
      python - "$out/train-$1-w2-onegpu.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("type") == "result":
        print(r["impl"], r["status"], r.get("world"), "loss diff", r.get("loss_max_rel_diff"),
              "last loss", (r.get("losses") or [None])[-1], (r.get("reason") or "")[:100])
PY
    done
    left=$((550 - SECONDS))
    [ $left -gt 40 ] && { timeout $left python -m dev.fixed_cost --plans --fast-only > "$out/fixed-cost-new.log" 2>&1;
      echo "fixed cost rc=$?"; keep; sed -n '/^median of/,$p' "$out/fixed-cost-new.log"; grep -E "DirectLaunch|direct" "$out/fixed-cost-new.log" | tail -3; } ;;
  s16a)  # session 16, first call (<= 300 s; tarball $OUT/s16a.tar.gz): issue 16's W=1 bar at the current code (the
         # committed row was session 9's 2f61068: 0.980x), rendered; then the cProfile of the eager calls still
         # over issue 13's 30 us (MX TP, MoE).
    begin_stage s16a
    timeout 220 python -m kosmos_bench.cli bench train --model llama3-8b --layers 2 --seq 4096 --tp 1 --steps 20 \
      --out "$out/train-llama3-8b-w1.jsonl" > "$out/train-llama3-8b-w1.log" 2>&1; echo "train rc=$?"
    timeout 40 python -m kosmos_bench.cli report "$out/train-llama3-8b-w1.jsonl" --format md \
      --out "$out/train-llama3-8b-w1.md" --chart "$out/train-llama3-8b-w1-loss.png" >> "$out/train-llama3-8b-w1.log" 2>&1
    echo "report rc=$?"; keep
    left=$((290 - SECONDS)); [ $left -gt 70 ] && left=70
    [ $left -gt 20 ] && { timeout $left python -m dev.fixed_cost --profile > "$out/fixed-cost-profile.log" 2>&1;
      echo "profile rc=$?"; keep; grep -E "^====|host time per call" "$out/fixed-cost-profile.log"; }
    grep "^| " "$out/train-llama3-8b-w1.md" | head -5 ;;
  s16b)  # session 16 (<= 450 s; tarball $OUT/s16b.tar.gz): what main has not run on a GPU -- the one launch with
         # BWD_SWIGLU_COL_PAIRS (bitwise the multi-launch gradients) and bench moe's backward expert-GEMM rows
         # (the knob and the one-launch-pairs variant were removed after this call: no gain; the stage is a record)
         # (end to end) --, then the one launch's A/B at deepseek-v3 4k zipf:1.2 (padded multi-launch, the one launch,
         # the one launch with column pairs; one traced call of the last), then issue 16's deepseek-v3 W=1 proxy at
         # the current code (the committed one is session 9's).
    begin_stage s16b
    gpu_tests gpu-tests-s16 230 "one_launch_bitwise_default_gpu or directions_end_to_end" tests/test_moe_backward.py \
      tests/test_bench_moe.py
    left=$((400 - SECONDS)); [ $left -gt 170 ] && left=170
    timeout $left python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 4096 --routing zipf:1.2 \
      --variants padded,one-launch,one-launch-pairs --passes 2 --iters 10 --warmup 3 --trace "$out/traces" \
      --json "$out/one-launch-ab-dsv3-4096-zipf.jsonl" > "$out/one-launch-ab-dsv3-4096-zipf.log" 2>&1
    echo "one launch ab rc=$?"; keep
    left=$((440 - SECONDS))
    if [ $left -gt 60 ]; then
      timeout $left python -m kosmos_bench.cli bench train --model deepseek-v3 --layers 2 --seq 4096 --scale 0.25 \
        --tp 1 --steps 20 --out "$out/train-deepseek-v3-w1.jsonl" > "$out/train-deepseek-v3-w1.log" 2>&1
      echo "train dsv3 w1 rc=$?"
      timeout 30 python -m kosmos_bench.cli report "$out/train-deepseek-v3-w1.jsonl" --format md \
        --out "$out/train-deepseek-v3-w1.md" --chart "$out/train-deepseek-v3-w1-loss.png" \
        >> "$out/train-deepseek-v3-w1.log" 2>&1; keep
      grep "^| " "$out/train-deepseek-v3-w1.md" | head -5
    fi
    grep -vE "Warning|warn" "$out/one-launch-ab-dsv3-4096-zipf.log" | tail -18 ;;
  s16c)  # session 16 (<= 590 s; tarball $OUT/s16c.tar.gz): issue 15's committed bench at one commit -- both models,
         # 4k and 8k, uniform and zipf:1.2, fwd, bwd, fwd+bwd, with the backward's expert GEMMs alone (new) -- each
         # rendered.
    begin_stage s16c
    for m in qwen3-235b:moe-bwd-ep1:230 deepseek-v3:moe-bwd-ep1-deepseek-v3:570; do
      IFS=: read -r model name until <<< "$m"
      left=$((until - SECONDS)); [ $left -lt 60 ] && break
      timeout $left python -m kosmos_bench.cli bench moe --ep 1 --model $model --tokens 4096,8192 \
        --direction fwd,bwd,fwd+bwd --out "$out/$name.jsonl" > "$out/bench-$model.log" 2>&1
      echo "bench $model rc=$?"
      timeout 20 python -m kosmos_bench.cli report "$out/$name.jsonl" --format md --out "$out/$name.md" \
        >> "$out/bench-$model.log" 2>&1; keep
      bwd_rows "$out/$name.jsonl"
      grep -E "expert GEMMs alone" "$out/$name.md"
    done ;;
  s16d)  # session 16 (<= 300 s; tarball $OUT/s16d.tar.gz): issue 13's grid -- dev.flat_probe (a statically scheduled
         # persistent GEMM with the flattened tile x K loop, against today's op and torch.matmul, 20 grid shapes)
    begin_stage s16d
    timeout 280 python -m dev.flat_probe --max-seconds 230 --json "$out/flat-probe.jsonl" > "$out/flat-probe.log" 2>&1
    echo "flat probe rc=$?"; keep
    grep -vE "Warning|warn" "$out/flat-probe.log" | tail -12 ;;
  s16e)  # session 16 (<= 560 s; tarball $OUT/s16e.tar.gz): issue 13 -- the static W=1 GEMM (common.w1_matmul_kernel)
         # in both TP ops: the GPU tests (W=1 TP ops, plans, CUDA graphs, nn layers; bitwise the self-scheduled
         # kernel), dev.flat_probe (kosmos now = the static kernel), the public grid (suites/tp-grid.yaml), host us.
    begin_stage s16e
    gpu_tests gpu-tests-w1 190 "w1 or world1 or gpu or plan or graph or capture or static" \
      tests/test_matmul_reduce_scatter.py tests/test_all_gather_matmul.py tests/test_launch_plan.py \
      tests/test_cuda_graphs.py tests/test_nn_tp.py
    timeout 60 python -m dev.flat_probe --max-seconds 45 --json "$out/flat-probe.jsonl" > "$out/flat-probe.log" 2>&1
    echo "flat probe rc=$?"; keep
    left=$((500 - SECONDS)); [ $left -gt 240 ] && left=240
    grid_run $left
    left=$((550 - SECONDS))
    [ $left -gt 30 ] && { timeout $left python -m dev.fixed_cost --plans --fast-only > "$out/fixed-cost.log" 2>&1;
      echo "fixed cost rc=$?"; keep; sed -n '/^median of/,$p' "$out/fixed-cost.log" | head -9; }
    grep -vE "Warning|warn" "$out/flat-probe.log" | sed -n '/^variant/,/^best/p'
    sed -n '/^kosmos against cuBLAS alone at world 1/,/^$/p' "$out/tp-grid-w1.txt" | head -14 ;;
  s16f)  # session 16 (<= 420 s; tarball $OUT/s16f.tar.gz): s16e again after the fix (TMA stores only in the static
         # W=1 GEMM): its GPU tests, then the public grid (suites/tp-grid.yaml, both TP ops, kosmos rows).
    begin_stage s16f
    gpu_tests gpu-tests-w1 130 "w1 or world1 or static or capture" tests/test_matmul_reduce_scatter.py \
      tests/test_all_gather_matmul.py tests/test_cuda_graphs.py tests/test_nn_tp.py
    grid_run $((405 - SECONDS))
    sed -n '/^kosmos against cuBLAS alone at world 1/,/^$/p' "$out/tp-grid-w1.txt" | head -14 ;;
  s16h)  # what session 16 left without a GPU run (<= 300 s; tarball $OUT/s16h.tar.gz): at main, the CUDA-graph tests
         # (the static W=1 GEMM's epoch and capture mends) and the W=1 TP op tests (the w1_matmul_launch refactor);
         # with .base = branch host-mx rebased on main: its quant / MoE-hit GPU tests and both trees' host us.
    begin_stage s16h
    gpu_tests gpu-tests-graphs 80 "w1_tp_op_replays or w1_moe_forward_replays or first_call or stalled" \
      tests/test_cuda_graphs.py
    gpu_tests gpu-tests-tp-w1 80 "w1 or world1 or static" tests/test_matmul_reduce_scatter.py \
      tests/test_all_gather_matmul.py
    if [ -d .base ]; then
      (cd .base && gpu_tests gpu-tests-host-mx 70 "fast_path_bitwise or bad_inputs_raise_after or hit_quantizes" \
        tests/test_quant.py tests/test_moe_forward.py)
      for t in main:. host-mx:.base; do
        (cd "${t#*:}" && timeout 40 python -m dev.fixed_cost --plans --fast-only > "$out/fixed-cost-${t%%:*}.log" 2>&1)
        echo "fixed cost ${t%%:*} rc=$?"; keep
      done
    fi
    for f in "$out"/fixed-cost-*.log; do [ -f "$f" ] && { echo "${f##*/}";
      grep -E "^  (all_gather|matmul_reduce|moe_forward|torch|quantize)" "$f" | head -8; }; done ;;
  s17a)  # session 17: the llama3 per-rank TP suite at W=1 (kosmos runs the static W=1 GEMM), against nccl+cublas
    begin_stage s17a
    llama3_w1_run 270 tp-llama3-w1; tail -25 "$out/tp-llama3-w1.txt" ;;
  s17b)  # session 17: the static W=1 GEMM's K split -- its GPU tests, the split probe (every grid shape of
         # dev/flat_probe, the product kernel unsplit and at each split), then the grid with planning.w1_plan
    begin_stage s17b
    gpu_tests gpu-tests-split 150 "w1 or world1 or static or split" tests/test_matmul_reduce_scatter.py \
      tests/test_all_gather_matmul.py tests/test_launch_plan.py
    gpu_tests gpu-tests-graphs 80 "w1_tp_op_replays or first_call or stalled" tests/test_cuda_graphs.py
    timeout 200 python -m dev.flat_probe --splits --max-seconds 170 --json "$out/split-probe.jsonl" \
      > "$out/split-probe.log" 2>&1; echo "split probe rc=$?"; keep
    grep -A12 "^variant" "$out/split-probe.log"
    grid_run 200 ;;
  s17d)  # session 17 (also what s17c ran at 13edb16, less its graph tests): stream-K in the static W=1 GEMM -- tests (split / stream-K kernels, the ops, graph replays),
         # the probe (unsplit / split / stream-K on flat_probe's 20 shapes), the grid with w1_plan's rule
    begin_stage s17d
    gpu_tests gpu-tests-split 170 "w1 or world1 or static or split" tests/test_matmul_reduce_scatter.py \
      tests/test_all_gather_matmul.py tests/test_launch_plan.py
    gpu_tests gpu-tests-graphs 90 "w1_tp_op_replays or first_call or stalled" tests/test_cuda_graphs.py
    timeout 150 python -m dev.flat_probe --splits --max-seconds 130 --json "$out/split-probe.jsonl" \
      > "$out/split-probe.log" 2>&1; echo "split probe rc=$?"; keep
    grep -A8 "^variant" "$out/split-probe.log"
    grid_run 200
    grep -A4 "against cuBLAS alone at world 1 (t_gemm" "$out/tp-grid-w1.txt" | head -5 ;;
  s18a)  # session 18: stream-K v2 in the static W=1 GEMM (data-parallel waves, then K-synchronised stream-K runs)
         # -- tests (split / stream-K kernels, the ops, graph replays), the probe on the shapes w1_plan streams
    begin_stage s18a
    gpu_tests gpu-tests-split 150 "w1 or world1 or static or split or stream" tests/test_matmul_reduce_scatter.py \
      tests/test_all_gather_matmul.py tests/test_launch_plan.py tests/test_planning.py
    gpu_tests gpu-tests-graphs 80 "w1_tp_op_replays or first_call or stalled" tests/test_cuda_graphs.py
    timeout 170 python -m dev.flat_probe --splits --max-seconds 150 --json "$out/sk-probe.jsonl" --shapes \
      512x5120x5120,1024x3072x8192,2048x1536x5120,3000x3072x7168,6000x1536x1024,2048x6912x8192,4096x1536x4096,\
3000x6144x5120,2048x5120x4096,6000x5120x14336,6000x3072x5120,1024x6144x7168,512x14336x2880,256x28672x5120,\
4096x6912x7168,512x6912x14336,8192x8192x4096,512x1536x7168 > "$out/sk-probe.log" 2>&1; echo "sk probe rc=$?"; keep
    grep -A8 "^variant" "$out/sk-probe.log" ;;
  s18b)  # session 18: the grid with w1_plan's stream-K v2, then dev/sk_probe (the stream-K phase's cost taken apart)
    begin_stage s18b
    grid_run 230
    grep -A4 "against cuBLAS alone at world 1 (t_gemm" "$out/tp-grid-w1.txt" | head -5
    timeout 150 python -m dev.sk_probe --max-seconds 130 --json "$out/sk-parts.jsonl" > "$out/sk-parts.log" 2>&1
    echo "sk_probe rc=$?"; keep; grep -A14 "^shape" "$out/sk-parts.log" ;;
  s18c)  # session 18: the CUDA-graph replays at a stream-K shape; dev/sk_probe's sigma order under two waves
    begin_stage s18c
    gpu_tests gpu-tests-graphs 60 "w1_tp_op_replays" tests/test_cuda_graphs.py
    timeout 250 python -m dev.sk_probe --max-seconds 230 --tiles 128x256,128x128 --json "$out/sk-sigma.jsonl" \
      --shapes 512x14336x2880,256x28672x5120,4096x1536x4096,1024x6144x7168,512x5120x5120,2048x1536x5120,\
1024x3072x8192,512x6912x14336 > "$out/sk-sigma.log" 2>&1
    echo "sk_probe rc=$?"; keep; grep -A40 "^shape" "$out/sk-sigma.log" ;;
  s18d)  # session 18: dev/sk_probe's TMA-stored partials (counted at once / late) against the product's stream-K
    begin_stage s18d
    timeout 200 python -m dev.sk_probe --max-seconds 180 --tiles 128x256,128x128 --json "$out/sk-tma.jsonl" \
      --variants unsplit,product,full,store,pieces,full-tma,full-tma-late --shapes \
8192x8192x4096,6000x3072x5120,3000x3072x7168,1024x3072x8192,512x5120x5120,2048x1536x5120,512x14336x2880 \
      > "$out/sk-tma.log" 2>&1
    echo "sk_probe rc=$?"; keep; grep -A40 "^shape" "$out/sk-tma.log" ;;
  s18e)  # session 18: flat_probe --occupancy (two programs per SM, warp-specialised loops) on short-K and few-tile shapes
    begin_stage s18e
    timeout 240 python -m dev.flat_probe --occupancy --max-seconds 220 --json "$out/occupancy.jsonl" --shapes \
6000x1536x1024,3000x5120x1024,4096x14336x1024,8192x6144x1024,1024x8192x1024,256x1536x1024,512x6912x1024,\
16384x28672x1024,4096x1536x4096,2048x5120x4096,512x3072x2048,256x8192x2048,512x5120x5120,1024x3072x8192,\
8192x8192x4096 > "$out/occupancy.log" 2>&1; echo "occupancy probe rc=$?"; keep
    grep -A10 "^variant" "$out/occupancy.log" ;;
  s18g)  # session 18's last call: the W=1 TP tests, graph replays, the router-in-launch GPU tests (issue 15), the grid
         # and the llama3 per-rank suite at W=1 (s18f, the same less the router tests, was refused twice and removed)
    begin_stage s18g
    gpu_tests gpu-tests-w1 110 "w1 or world1 or static or split or stream" tests/test_matmul_reduce_scatter.py \
      tests/test_all_gather_matmul.py tests/test_launch_plan.py tests/test_planning.py
    gpu_tests gpu-tests-graphs 45 "w1_tp_op_replays" tests/test_cuda_graphs.py
    gpu_tests gpu-tests-router 100 "one_launch" tests/test_moe_backward.py
    grid_run 100
    grep -A4 "against cuBLAS alone at world 1 (t_gemm" "$out/tp-grid-w1.txt" | head -5
    llama3_w1_run 150 tp-bf16-w1-shard2
    grep -A4 "against cuBLAS alone at world 1 (t_gemm" "$out/tp-bf16-w1-shard2.txt" | head -5 ;;
  s18h)  # session 18: the router-in-launch GPU tests s18g's time budget cut off
    begin_stage s18h
    gpu_tests gpu-tests-router 110 "router_in_launch_gpu and softmax or router_bounded_wait_gpu" tests/test_moe_backward.py ;;
  s19a)  # session 19: the tail tiles (128 + 64 / 32 columns) -- GPU tests, flat_probe --tails on the shapes the wave
         # model would give them and three many-wave ones; issue 15: the router in the one launch timed
         # (deepseek-v3 4k zipf:1.2)
    begin_stage s19a
    gpu_tests gpu-tests-tail 80 "tail" tests/test_matmul_reduce_scatter.py
    timeout 190 python -m dev.flat_probe --tails --max-seconds 170 --json "$out/tails.jsonl" --shapes \
1024x3072x8192,2048x1536x5120,4096x1536x4096,1024x6144x7168,512x5120x5120,2048x5120x4096,6000x1536x1024,\
3000x3072x7168,3000x5120x1024,6000x3072x5120,16384x3072x4096,8192x6144x4096,16384x5120x8192,512x3072x2048,\
256x4096x4096,256x6144x8192,3000x6144x5120 \
      > "$out/tails.log" 2>&1; echo "tails probe rc=$?"; keep
    grep -A10 "^variant" "$out/tails.log"
    timeout 150 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 4096 --routing zipf:1.2 --passes 3 \
      --variants padded,one-launch,one-launch-torch-router --json "$out/router-ab.jsonl" > "$out/router-ab.log" 2>&1
    echo "router ab rc=$?"; keep; tail -4 "$out/router-ab.log" ;;
  s19b)  # session 19: issue 15's one launch at W > 1 (helper branch one-launch-ep) on a GPU -- simulated ranks W = 2, 4,
         # the stalled peer, the public op with two ranks on one GPU; the W = 1 one-launch GPU tests again
    begin_stage s19b
    timeout 200 python -m pytest -v -p no:cacheprovider --timeout 180 -m "gpu or ranks" tests/test_moe_backward.py \
      -k "ep_" > "$out/gpu-tests-ep.log" 2>&1; echo "ep tests rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-ep.log" \
      | sed 's/ *\[.*//'; tail -1 "$out/gpu-tests-ep.log"; keep
    gpu_tests gpu-tests-ep-public 120 "moe_backward" tests/test_ranks_one_gpu.py
    gpu_tests gpu-tests-nosync 80 "never_syncs" tests/test_moe_backward.py
    gpu_tests gpu-tests-one-launch-w1 120 "one_launch and not ep_ and not router" tests/test_moe_backward.py ;;
  s19c)  # session 19: why the tail tiles lost (dev/archive/tail_probe: Triton 3.6's TTGIR of the product, a plain-loop copy);
         # the one launch at W > 1 on simulated ranks again (s19b's failures were the test's CPU-vs-GPU compare)
    begin_stage s19c
    timeout 150 python -m dev.archive.tail_probe --json "$out/tail-probe.jsonl" --ir-dir "$out/ir" > "$out/tail-probe.log" 2>&1
    echo "tail probe rc=$?"; keep; tail -26 "$out/tail-probe.log"
    timeout 150 python -m pytest -v -p no:cacheprovider --timeout 130 -m "gpu or ranks" tests/test_moe_backward.py \
      -k "ep_" > "$out/gpu-tests-ep.log" 2>&1; echo "ep tests rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-ep.log" \
      | sed 's/ *\[.*//'; tail -1 "$out/gpu-tests-ep.log"; keep ;;
  s19d)  # session 19: w1_plan's 128x192 tail tiles (plain tile loop) -- the W=1 TP tests, graph replays, the grid
    begin_stage s19d
    gpu_tests gpu-tests-w1 110 "w1 or world1 or static or split or stream or tail" tests/test_matmul_reduce_scatter.py \
      tests/test_all_gather_matmul.py tests/test_launch_plan.py tests/test_planning.py
    gpu_tests gpu-tests-graphs 45 "w1_tp_op_replays" tests/test_cuda_graphs.py
    grid_run 230
    grep -A4 "against cuBLAS alone at world 1 (t_gemm" "$out/tp-grid-w1.txt" | head -5 ;;
  s19e)  # session 19: s19d's tail tiles ran at 0.71-0.74x in the op against 0.89 in dev/archive/tail_probe's copy: the product's
         # tile loop now in the probe's form (outer tl.range flatten=False, num_stages) -- probe, tail tests, the grid
    begin_stage s19e
    timeout 100 python -m dev.archive.tail_probe --json "$out/tail-probe.jsonl" > "$out/tail-probe.log" 2>&1
    echo "tail probe rc=$?"; keep; grep -E "product-tail|probe-tail-192-loop|w1-128x256" "$out/tail-probe.log"
    gpu_tests gpu-tests-tail 60 "tail" tests/test_matmul_reduce_scatter.py
    grid_run 230
    grep -A4 "against cuBLAS alone at world 1 (t_gemm" "$out/tp-grid-w1.txt" | head -5 ;;
  s19f)  # session 19: the product's tail loop in the probe's statement order (s19e: still 0.71-0.75x against 0.87-0.89)
    begin_stage s19f
    timeout 100 python -m dev.archive.tail_probe --json "$out/tail-probe.jsonl" --ir-dir "$out/ir" > "$out/tail-probe.log" 2>&1
    echo "tail probe rc=$?"; keep; grep -E "product-tail|probe-tail-192-loop|w1-128x256" "$out/tail-probe.log"
    gpu_tests gpu-tests-tail 40 "tail" tests/test_matmul_reduce_scatter.py ;;
  s19g)  # session 19: the grid with w1_plan's 128x192 tail tiles (s19f's fixed loop)
    begin_stage s19g
    grid_run 140
    grep -A4 "against cuBLAS alone at world 1 (t_gemm" "$out/tp-grid-w1.txt" | head -5 ;;
  s20a)  # session 20, first call: cuBLAS's kernels on the grid's few-tile shapes (issue 13), the host bar (fixed_cost
         # --plans), issue 15's one launch against the launches it replaces at deepseek-v3 4k zipf:1.2 with a trace of
         # its stages, the multi-launch path's stages (moe_bwd_probe); then the W=1 TP tests and the graph replays
         # (tail-tile and split cases new) in the time left
    begin_stage s20a
    deadline=$((SECONDS + 560))
    timeout 60 python -m dev.archive.cublas_names --json "$out/cublas-names.jsonl" > "$out/cublas-names.log" 2>&1
    echo "cublas names rc=$?"; keep; cat "$out/cublas-names.log" | cut -c1-170
    timeout 60 python -m dev.fixed_cost --plans > "$out/fixed-cost-plans.log" 2>&1; echo "plans rc=$?"; keep
    tail -12 "$out/fixed-cost-plans.log"
    timeout 150 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 4096 --routing zipf:1.2 --passes 2 \
      --variants padded,one-launch --trace "$out/trace" --json "$out/one-launch-ab.jsonl" > "$out/one-launch-ab.log" 2>&1
    echo "one-launch ab rc=$?"; keep; tail -22 "$out/one-launch-ab.log"
    timeout 110 python -m dev.moe_bwd_probe --model deepseek-v3 --routing zipf:1.2 --no-profile --max-seconds 90 \
      --json "$out/bwd-probe-dsv3.jsonl" > "$out/bwd-probe-dsv3.log" 2>&1; echo "bwd probe rc=$?"; keep
    tail -30 "$out/bwd-probe-dsv3.log"
    left=$((deadline - SECONDS)); echo "left for tests: $left s"
    [ $left -gt 60 ] && gpu_tests gpu-tests-graphs 60 "w1_tp_op_replays" tests/test_cuda_graphs.py
    left=$((deadline - SECONDS))
    [ $left -gt 40 ] && gpu_tests gpu-tests-w1 $left "w1 or world1 or static or split or stream or tail" \
      tests/test_matmul_reduce_scatter.py tests/test_all_gather_matmul.py tests/test_launch_plan.py tests/test_planning.py
    ;;
  s20b)  # session 20: the adaptive host-hiding spin (kosmos_bench.timing) on issue 15's A/B (one launch vs padded,
         # deepseek-v3 4k zipf:1.2 and uniform, qwen3 4k); flat_probe --odd (cuBLAS's tile counts with our tail tiles)
    begin_stage s20b
    timeout 170 python -m dev.flat_probe --odd --max-seconds 150 --json "$out/odd.jsonl" --shapes \
512x3072x2048,256x6144x8192,512x1536x7168,256x4096x4096,512x5120x5120,256x8192x2048,4096x1536x4096,\
1024x3072x8192,2048x1536x5120,6000x1536x1024,256x1536x1024 > "$out/odd.log" 2>&1; echo "odd probe rc=$?"; keep
    grep -A12 "^variant" "$out/odd.log"; grep "best per shape" "$out/odd.log"
    for pt in "deepseek-v3 zipf:1.2" "deepseek-v3 uniform" "qwen3-235b uniform"; do
      set -- $pt
      timeout 130 python -m dev.moe_bwd_layout_ab --model $1 --tokens 4096 --routing $2 --passes 2 \
        --variants padded,one-launch --json "$out/ab-$1-$2.jsonl" > "$out/ab-$1-$2.log" 2>&1
      echo "ab $1 $2 rc=$?"; keep; tail -3 "$out/ab-$1-$2.log"
    done ;;
  s20c)  # session 20: the bench's back-to-back host enqueue rows (issue 13's host bar, --host-calls; helper branch
         # host-bar) on the llama3-8b per-rank GEMMs at W=1, bf16 and mxfp8, rendered; issue 15's A/B at 8k zipf
    begin_stage s20c
    timeout 200 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-8b --seq 4096 \
      --dtype bf16,mxfp8 --impl kosmos,nccl+cublas --out "$out/tp-host-w1.jsonl" > "$out/bench-host.log" 2>&1
    echo "bench host rc=$?"
    timeout 30 python -m kosmos_bench.cli report "$out/tp-host-w1.jsonl" --format md --out "$out/tp-host-w1.md" \
      >> "$out/bench-host.log" 2>&1
    COLUMNS=120 timeout 30 python -m kosmos_bench.cli report "$out/tp-host-w1.jsonl" > "$out/tp-host-w1.txt" \
      2>> "$out/bench-host.log"; keep
    grep -A14 "Host enqueue time per eager call" "$out/tp-host-w1.md" | head -24
    timeout 200 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --passes 2 \
      --variants padded,one-launch --json "$out/ab-dsv3-8k-zipf.jsonl" > "$out/ab-dsv3-8k-zipf.log" 2>&1
    echo "ab 8k rc=$?"; keep; tail -3 "$out/ab-dsv3-8k-zipf.log" ;;
  s20d)  # session 20: why the one launch is 1.089x the multi-launch path at deepseek-v3 8k zipf:1.2 (s20c; 1.040x at 4k):
         # its trace at 8k zipf and the multi-launch path's stages there (moe_bwd_probe)
    begin_stage s20d
    timeout 150 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --passes 1 \
      --iters 5 --warmup 2 --variants padded,one-launch --trace "$out/trace" --json "$out/ab-8k.jsonl" > "$out/ab-8k.log" 2>&1
    echo "ab 8k trace rc=$?"; keep; tail -16 "$out/ab-8k.log"
    timeout 200 python -m dev.moe_bwd_probe --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --no-profile \
      --max-seconds 170 --iters 5 --warmup 2 --json "$out/bwd-probe-8k.jsonl" > "$out/bwd-probe-8k.log" 2>&1
    echo "bwd probe rc=$?"; keep; grep -A18 "== moe backward stages" "$out/bwd-probe-8k.log" | cut -c1-100 ;;
  s20e)  # session 20: the one launch's WGRAD1 rendezvous (BWD_WGRAD1_SYNC) -- A/B against the same tree without it and
         # the multi-launch path at deepseek-v3 4k / 8k zipf:1.2 and 4k uniform, a trace at 8k; the one launch's GPU
         # tests (W = 1 and the simulated-rank W > 1 ones) in the time left
    begin_stage s20e
    deadline=$((SECONDS + 560))
    timeout 170 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --passes 2 \
      --iters 8 --warmup 3 --variants padded,one-launch,one-launch-nosync --trace "$out/trace" \
      --json "$out/ab-8k-zipf.jsonl" > "$out/ab-8k-zipf.log" 2>&1
    echo "ab 8k zipf rc=$?"; keep; tail -15 "$out/ab-8k-zipf.log"
    for rt in zipf:1.2 uniform; do
      timeout 110 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 4096 --routing $rt --passes 2 \
        --variants padded,one-launch,one-launch-nosync --json "$out/ab-4k-$rt.jsonl" > "$out/ab-4k-$rt.log" 2>&1
      echo "ab 4k $rt rc=$?"; keep; tail -1 "$out/ab-4k-$rt.log"
    done
    one_launch_gpu_tests ;;
  s20f)  # session 20: where the GPU idles in one backward call (one launch vs padded) at deepseek-v3 4k and 8k zipf:1.2
    begin_stage s20f
    for tk in 4096 8192; do
      timeout 150 python -m dev.archive.moe_bwd_gaps --tokens $tk > "$out/gaps-$tk.log" 2>&1; echo "gaps $tk rc=$?"; keep
      grep -E "^==|gap |idle" "$out/gaps-$tk.log" | head -30
    done ;;
  s20g)  # session 20: the MoE backward bench's deepseek-v3 zipf:1.2 points (the issue-15 bar's closest) under the adaptive
         # host-hiding spin (nccl-a2a's autograd takes ~2.5 ms of host per call, more than the old fixed 2 ms spin)
    begin_stage s20g
    timeout 300 python -m kosmos_bench.cli bench moe --ep 1 --model deepseek-v3 --tokens 4096,8192 --routing zipf:1.2 \
      --direction bwd --impl kosmos,nccl-a2a --out "$out/moe-bwd-dsv3-zipf.jsonl" > "$out/bench-moe-bwd.log" 2>&1
    echo "bench moe bwd rc=$?"; keep
    timeout 30 python -m kosmos_bench.cli report "$out/moe-bwd-dsv3-zipf.jsonl" --format md \
      --out "$out/moe-bwd-dsv3-zipf.md" >> "$out/bench-moe-bwd.log" 2>&1; keep
    bwd_rows "$out/moe-bwd-dsv3-zipf.jsonl" ;;
  s20h)  # session 20, last call: the one launch's wgrad loops with their last 1/16 in claimed runs (BWD_WGRAD_DYNAMIC) --
         # bitwise against the multi-launch path (layout_ab checks dw13 / dw2) and timed at deepseek-v3 8k / 4k zipf
    begin_stage s20h
    timeout 110 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --passes 2 \
      --iters 5 --warmup 3 --variants padded,one-launch --json "$out/ab-8k-zipf.jsonl" > "$out/ab-8k-zipf.log" 2>&1
    echo "ab 8k zipf rc=$?"; keep; grep -E "bitwise|median" "$out/ab-8k-zipf.log"
    timeout 70 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 4096 --routing zipf:1.2 --passes 2 \
      --iters 8 --warmup 3 --variants padded,one-launch --json "$out/ab-4k-zipf.jsonl" > "$out/ab-4k-zipf.log" 2>&1
    echo "ab 4k zipf rc=$?"; keep; grep -E "bitwise|median" "$out/ab-4k-zipf.log" ;;
  s21a)  # session 21, first call: the GPU's Triton; issue 15's one launch with DGRAD1 lean (BWD_DGRAD1_LEAN) against
         # session 20's form (one-launch-strict), larger claimed wgrad shares (dyn4, dyn4-run16) and the multi-launch
         # path at deepseek-v3 8k / 4k zipf:1.2; the one launch's GPU tests; issue 13's host rows with 1 s of warm-up
    begin_stage s21a
    deadline=$((SECONDS + 560))
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$out/versions.txt"
    timeout 230 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --passes 2 \
      --iters 5 --warmup 3 --variants padded,one-launch,one-launch-strict,one-launch-dyn4,one-launch-dyn4-run16 \
      --json "$out/ab-8k-zipf.jsonl" > "$out/ab-8k-zipf.log" 2>&1
    echo "ab 8k zipf rc=$?"; keep; grep -E "bitwise|median" "$out/ab-8k-zipf.log"
    timeout 110 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 4096 --routing zipf:1.2 --passes 2 \
      --iters 8 --warmup 3 --variants padded,one-launch,one-launch-strict,one-launch-dyn4 \
      --json "$out/ab-4k-zipf.jsonl" > "$out/ab-4k-zipf.log" 2>&1
    echo "ab 4k zipf rc=$?"; keep; grep -E "median" "$out/ab-4k-zipf.log"
    timeout 60 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-8b --seq 4096 --op ag_gemm,gemm_rs \
      --dtype bf16,mxfp8 --impl kosmos,nccl+cublas --out "$out/tp-host-w1.jsonl" > "$out/bench-host.log" 2>&1
    echo "bench host rc=$?"
    timeout 20 python -m kosmos_bench.cli report "$out/tp-host-w1.jsonl" --format md --out "$out/tp-host-w1.md" \
      >> "$out/bench-host.log" 2>&1; keep
    grep -A12 "Host enqueue time per eager call" "$out/tp-host-w1.md" | head -20
    one_launch_gpu_tests ;;
  s21b)  # session 21: the one launch's SWIGLU pass software-pipelined (BWD_SWIGLU_STAGES = 3) against the nested loops
         # (one-launch-swiglu-nested) and the multi-launch path at deepseek-v3 8k / 4k zipf:1.2, 3 passes, a trace at
         # 8k; the bounded-wait GPU test whose regex s21a's DGRAD1 record missed, and the other one-launch GPU tests
    begin_stage s21b
    deadline=$((SECONDS + 470))
    timeout 200 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 8192 --routing zipf:1.2 --passes 3 \
      --iters 6 --warmup 3 --variants padded,one-launch,one-launch-swiglu-nested --trace "$out/trace" \
      --json "$out/ab-8k-zipf.jsonl" > "$out/ab-8k-zipf.log" 2>&1
    echo "ab 8k zipf rc=$?"; keep; grep -E "bitwise|median" "$out/ab-8k-zipf.log"; tail -13 "$out/ab-8k-zipf.log"
    timeout 100 python -m dev.moe_bwd_layout_ab --model deepseek-v3 --tokens 4096 --routing zipf:1.2 --passes 3 \
      --iters 8 --warmup 3 --variants padded,one-launch,one-launch-swiglu-nested \
      --json "$out/ab-4k-zipf.jsonl" > "$out/ab-4k-zipf.log" 2>&1
    echo "ab 4k zipf rc=$?"; keep; grep -E "median" "$out/ab-4k-zipf.log"
    left=$((deadline - SECONDS)); echo "left for tests: $left s"
    [ $left -gt 60 ] && gpu_tests gpu-tests-one-launch $((left - 5)) "one_launch and not ep_" tests/test_moe_backward.py ;;
  s21c)  # session 21: ONE_LAUNCH = True -- the A/B at the points s21b did not cover (deepseek-v3 4k / 8k uniform,
         # qwen3-235b 4k / 8k uniform and zipf:1.2; padded vs one-launch, interleaved), then issue 15's committed bench
         # at this commit (both models, 4k / 8k, fwd / bwd / fwd+bwd), rendered
    begin_stage s21c
    for pt in "deepseek-v3 4096 uniform" "deepseek-v3 8192 uniform" "qwen3-235b 4096 uniform" "qwen3-235b 4096 zipf:1.2" \
              "qwen3-235b 8192 uniform" "qwen3-235b 8192 zipf:1.2"; do
      set -- $pt; tag="$1-$2-${3/:/}"
      timeout 90 python -m dev.moe_bwd_layout_ab --model $1 --tokens $2 --routing $3 --passes 2 --iters 6 --warmup 3 \
        --variants padded,one-launch --json "$out/ab-$tag.jsonl" > "$out/ab-$tag.log" 2>&1
      echo "ab $tag rc=$?"; keep; grep -E "median" "$out/ab-$tag.log"
    done
    timeout 150 python -m kosmos_bench.cli bench moe --ep 1 --model qwen3-235b --tokens 4096,8192 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1.jsonl" > "$out/bench-qwen3.log" 2>&1
    echo "bench qwen3 rc=$?"; keep
    timeout 220 python -m kosmos_bench.cli bench moe --ep 1 --model deepseek-v3 --tokens 4096,8192 \
      --direction fwd,bwd,fwd+bwd --out "$out/moe-bwd-ep1-deepseek-v3.jsonl" > "$out/bench-dsv3.log" 2>&1
    echo "bench dsv3 rc=$?"; keep
    for f in moe-bwd-ep1 moe-bwd-ep1-deepseek-v3; do
      timeout 20 python -m kosmos_bench.cli report "$out/$f.jsonl" --format md --out "$out/$f.md" >> "$out/bench-qwen3.log" 2>&1
      bwd_rows "$out/$f.jsonl"
    done; keep ;;
  s21d)  # session 21, last call: issue 14's Gluon probe (helper branch gluon-mx: a GEMM rounding A to MX values in its
         # mainloop, beside the MMA warps) first, then with ONE_LAUNCH = True every MoE-backward GPU test and issue 15's
         # deepseek-v3 W=1 training proxy (the committed one ran the multi-launch path)
    begin_stage s21d
    deadline=$((SECONDS + 540))
    if [ -f dev/gluon_mx_probe.py ]; then
      timeout 170 python -m dev.gluon_mx_probe --json "$out/gluon-mx-probe.jsonl" > "$out/gluon-mx-probe.log" 2>&1
      echo "gluon probe rc=$?"; keep; tail -16 "$out/gluon-mx-probe.log"
    fi
    timeout 130 python -m kosmos_bench.cli bench train --model deepseek-v3 --layers 2 --seq 4096 --scale 0.25 \
      --tp 1 --steps 20 --out "$out/train-deepseek-v3-w1.jsonl" > "$out/train-deepseek-v3-w1.log" 2>&1
    echo "train dsv3 w1 rc=$?"
    timeout 30 python -m kosmos_bench.cli report "$out/train-deepseek-v3-w1.jsonl" --format md \
      --out "$out/train-deepseek-v3-w1.md" --chart "$out/train-deepseek-v3-w1-loss.png" \
      >> "$out/train-deepseek-v3-w1.log" 2>&1; keep
    grep "^| " "$out/train-deepseek-v3-w1.md" | head -6
    left=$((deadline - SECONDS)); echo "left for tests: $left s"
    [ $left -gt 60 ] && timeout $left python -m pytest -v -p no:cacheprovider --timeout $((left - 10)) -m "gpu or ranks" \
      tests/test_moe_backward.py > "$out/gpu-tests-moe-bwd.log" 2>&1; echo "moe bwd tests rc=$?"; \
      grep -E "FAILED|ERROR" "$out/gpu-tests-moe-bwd.log" | sed 's/ *\[.*//'; tail -1 "$out/gpu-tests-moe-bwd.log"; keep ;;
  s21e)  # session 21: every MoE-backward GPU test again after the tests name the multi-launch path they compare with
         # (one_launch=False; s21d: 9 failed comparing the new default, the one launch, with the one launch)
    begin_stage s21e
    timeout 330 python -m pytest -v -p no:cacheprovider --timeout 320 -m "gpu or ranks" tests/test_moe_backward.py \
      tests/test_moe_bwd_probe.py > "$out/gpu-tests-moe-bwd.log" 2>&1; echo "moe bwd tests rc=$?"
    grep -E "FAILED|ERROR" "$out/gpu-tests-moe-bwd.log" | sed 's/ *\[.*//'; tail -1 "$out/gpu-tests-moe-bwd.log"; keep ;;
  s22a)  # session 22, first call: issue 15 at W > 1 with the one launch the default there (ONE_LAUNCH_EP): the two-ranks-
         # on-one-GPU MoE tests (forward, backward, the default's bits), the simulated-rank one-launch tests (W = 2, 4, 8),
         # the deepep baseline's forward and backward on the shared wheel (.wheels/, carried), the deepseek-v3 EP = 2
         # training proxy on one GPU; issue 13: the plain Gluon GEMM on the grid's aligned shapes under 0.90
    begin_stage s22a
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee "$out/versions.txt"
    timeout 200 python -m pytest -v -p no:cacheprovider --timeout 190 -m "gpu or ranks" tests/test_ranks_one_gpu.py \
      tests/test_moe_backward.py -k "two_ranks or ep_at_world or ep_stalled" > "$out/gpu-tests-ranks.log" 2>&1
    echo "ranks tests rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-ranks.log" | sed 's/ *\[.*//'; tail -1 "$out/gpu-tests-ranks.log"; keep
    deepep_install
    timeout 170 python -m pytest -v -rs -p no:cacheprovider --timeout 160 -m gpu tests/test_deepep.py \
      > "$out/gpu-tests-deepep.log" 2>&1; echo "deepep tests rc=$?"
    grep -E "FAILED|ERROR|SKIPPED" "$out/gpu-tests-deepep.log" | head -5; tail -1 "$out/gpu-tests-deepep.log"; keep
    timeout 60 python -m dev.gluon_mx_probe --variants torch,gluon \
      --shapes 2048x5120x4096,4096x1536x4096,2048x1536x5120,1024x3072x8192,512x5120x5120,512x3072x2048 \
      --json "$out/gluon-grid.jsonl" > "$out/gluon-grid.log" 2>&1; echo "gluon grid rc=$?"; keep; tail -10 "$out/gluon-grid.log"
    train_dsv3_w2_onegpu 560 120 ;;
  s22b)  # session 22: issue 14's Gluon probe with A given as MX and expanded in wgmma's register operand (helper branch
         # gluon-mx-expand: expand-only bitwise checks, GEMM checks, timings, qkv-4k profile); issue 15's fixed-role
         # split of the W > 1 one launch on simulated ranks (W = 2, 8) and every MoE direction through the bench with
         # both ranks on one GPU (kosmos, nccl-a2a, deepep, fixed-role, fixed-role-best: rows and gradient checks, no
         # timing claim)
    begin_stage s22b
    timeout 240 python -m dev.gluon_mx_probe --variants expand --profile qkv-4k --json "$out/gluon-mx-expand.jsonl" \
      > "$out/gluon-mx-expand.log" 2>&1; echo "gluon expand rc=$?"; keep; tail -32 "$out/gluon-mx-expand.log"
    timeout 220 python -m pytest -v -p no:cacheprovider --timeout 210 -m "gpu or ranks" tests/test_moe_backward.py \
      -k "ep_at_world or ep_stalled" > "$out/gpu-tests-fixed.log" 2>&1
    echo "fixed tests rc=$?"; grep -E "FAILED|ERROR" "$out/gpu-tests-fixed.log" | sed 's/ *\[.*//'; tail -1 "$out/gpu-tests-fixed.log"; keep
    deepep_install
    left=$((570 - SECONDS)); [ $left -gt 150 ] && left=150
    KOSMOS_RANKS_ON_ONE_GPU=1 timeout $left python -m kosmos_bench.cli bench moe --hidden 1024 --ffn 512 --experts 16 \
      --top-k 4 --ep 2 --tokens 512 --routing uniform,zipf:1.2 --direction fwd,bwd,fwd+bwd \
      --impl kosmos,nccl-a2a,deepep,fixed-role,fixed-role-best --no-expert-gemms --iters 5 --warmup 2 \
      --out "$out/moe-ep2-onegpu.jsonl" > "$out/bench-ep2-onegpu.log" 2>&1; echo "bench ep2 one gpu rc=$?"; keep
    grep -v "^{" "$out/bench-ep2-onegpu.log" | grep -iE "error|Traceback" | head -5
    [ -f "$out/moe-ep2-onegpu.jsonl" ] && python - "$out/moe-ep2-onegpu.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("type") == "result":
        err = "-" if r.get("rel_err") is None else f"{r['rel_err']:.2e}"
        print(f"{r.get('direction', 'fwd'):7} {r['routing']:9} {r['impl']:15} {r['status']:11} rel_err {err} "
              f"{(r.get('reason') or '')[:90]}")
PY
    ;;
  s22c)  # session 22: why s22b's Gluon MX-expand probe hit "illegal instruction" in its first check -- each expansion
         # and each GEMM build in its own process (CUDA_LAUNCH_BLOCKING=1), compute-sanitizer on the expand-only
         # kernel where it exists; then the timings of the builds whose GEMM check passed (checks done here)
    begin_stage s22c
    for e in cvt bits; do
      CUDA_LAUNCH_BLOCKING=1 timeout 90 python -m dev.archive.gluon_expand_diag expand $e > "$out/expand-$e.log" 2>&1
      echo "expand-only $e rc=$?"; grep -E "^\{|Error|error" "$out/expand-$e.log" | tail -2 | cut -c1-300; keep
    done
    san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
    if [ -n "$san" ]; then
      timeout 150 "$san" --tool memcheck --show-backtrace no python -m dev.archive.gluon_expand_diag expand cvt \
        > "$out/sanitizer-cvt.log" 2>&1; echo "sanitizer rc=$?"; grep -vE "^\{" "$out/sanitizer-cvt.log" | head -12 | cut -c1-200; keep
    else echo "no compute-sanitizer"; fi
    expand_gemm_checks_and_timings ;;
  s23a)  # session 23: the MX-expand probe with k-major scales (the s22c fault's fix): each expansion and GEMM build
         # checked in its own process, compute-sanitizer only if the expand-only kernel still fails, then the
         # timings of the builds whose GEMM check passed at the 8 llama shapes and the clock64 profile at qkv-4k
    begin_stage s23a
    for e in cvt bits; do
      CUDA_LAUNCH_BLOCKING=1 timeout 90 python -m dev.archive.gluon_expand_diag expand $e > "$out/expand-$e.log" 2>&1
      rc=$?; echo "expand-only $e rc=$rc"; grep -E "^\{|Error|error" "$out/expand-$e.log" | tail -2 | cut -c1-300; keep
      san=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
      if [ $rc -ne 0 ] && [ -n "$san" ] && [ ! -f "$out/sanitizer.log" ]; then
        timeout 150 "$san" --tool memcheck --show-backtrace no python -m dev.archive.gluon_expand_diag expand $e \
          > "$out/sanitizer.log" 2>&1; echo "sanitizer rc=$?"; grep -vE "^\{" "$out/sanitizer.log" | head -12 | cut -c1-200; keep
      fi
    done
    expand_gemm_checks_and_timings ;;
  s23b)  # session 23: gluon-mx-rowpass (A rounded once per [16, 512] part by a row-pass partition, the plain
         # mainloop, one acquire per tile when the row block is done), checks + the 8 llama shapes + profile, then
         # two config variants of it (KC = 1024; 32-row parts)
    begin_stage s23b
    timeout 240 python -m dev.gluon_mx_probe --variants torch,gluon,gluon-mx-rowpass,quantize+gluon-mx-expand \
      --profile qkv-4k --json "$out/rowpass.jsonl" > "$out/rowpass.log" 2>&1
    echo "rowpass rc=$?"; keep; grep -E "ok=False|Error" "$out/rowpass.log" | head -5; tail -24 "$out/rowpass.log"
    for c in KC=1024 ROUND_ROWS=32,ROUND_REGS=152; do
      timeout 120 python -m dev.gluon_mx_probe --skip-checks --variants torch,gluon-mx-rowpass --config $c \
        --profile none --json "$out/rowpass-$c.jsonl" > "$out/rowpass-$c.log" 2>&1
      echo "rowpass $c rc=$?"; keep; grep -A9 "^ratio to" "$out/rowpass-$c.log" | head -1; grep -E "^(qkv|fc|attn)" "$out/rowpass-$c.log" | head -8
    done ;;
  s23c)  # session 23: the row pass at rounding (bf16 A) and expanding (MX A: the op on an MXTensor) with checks,
         # the 8 llama shapes, profile qkv-4k
    begin_stage s23c
    timeout 300 python -m dev.gluon_mx_probe --variants rowpass --profile qkv-4k --json "$out/rowpass.jsonl" \
      > "$out/rowpass.log" 2>&1
    echo "rowpass rc=$?"; keep; grep -E "ok=False|Error" "$out/rowpass.log" | head -5; tail -26 "$out/rowpass.log" ;;
  s23d)  # session 23: the W = 1 MXFP8 Gluon kernel in the ops (kernels/w1_mx_matmul.py): the MX GPU tests around it
    begin_stage s23d
    gpu_tests mx-w1 500 "mx or quantizes or graph or plan" tests/test_all_gather_matmul.py \
      tests/test_matmul_reduce_scatter.py tests/test_cuda_graphs.py tests/test_launch_plan.py tests/test_nn_tp.py ;;
  s23e)  # session 23: the committed W = 1 TP run at bf16 and mxfp8 (issue 14's bar), rendered
    begin_stage s23e
    timeout 560 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b --dtype bf16,mxfp8 \
      --out "$out/tp-mxfp8-w1-shard2.jsonl" > "$out/bench.log" 2>&1; echo "bench rc=$?"; keep
    timeout 20 python -m kosmos_bench.cli report "$out/tp-mxfp8-w1-shard2.jsonl" --format md \
      --out "$out/tp-mxfp8-w1-shard2.md" >> "$out/bench.log" 2>&1
    COLUMNS=120 timeout 20 python -m kosmos_bench.cli report "$out/tp-mxfp8-w1-shard2.jsonl" > "$out/report.txt" \
      2>> "$out/bench.log"; keep; tail -5 "$out/bench.log"; head -60 "$out/report.txt" ;;
  s23g)  # session 23: the TP ops' GPU tests (all of them) and the one-GPU ranks tests of the TP ops after the W = 1
         # MX change (plan keys carry the precision; the MX info dicts grew)
    begin_stage s23g
    gpu_tests tp-gpu 330 "not moe" tests/test_all_gather_matmul.py tests/test_matmul_reduce_scatter.py \
      tests/test_tp_ops_together.py tests/test_launch_plan.py tests/test_nn_tp.py tests/test_cuda_graphs.py
    timeout 250 python -m pytest -v -p no:cacheprovider --timeout 230 -m "ranks" -k "not moe and not MoE" \
      tests/ > "$out/ranks.log" 2>&1; echo "ranks rc=$?"; grep -E "FAILED|ERROR" "$out/ranks.log" | sed 's/ *\[.*//' | head
    tail -1 "$out/ranks.log"; keep ;;
  s23h)  # session 23: issue 14's MoE bar re-measured at this commit (s14e's command: EP = 1, both models, 4k / 8k)
    begin_stage s23h
    timeout 330 python -m kosmos_bench.cli bench moe --ep 1 --dtype bf16,mxfp8 --tokens 4096,8192 \
      --impl kosmos,nccl-a2a --no-expert-gemms --out "$out/moe-mxfp8-ep1.jsonl" > "$out/bench-moe-mxfp8.log" 2>&1
    echo "bench rc=$?"; keep
    timeout 20 python -m kosmos_bench.cli report "$out/moe-mxfp8-ep1.jsonl" --format md --out "$out/moe-mxfp8-ep1.md" \
      >> "$out/bench-moe-mxfp8.log" 2>&1; keep; tail -30 "$out/bench-moe-mxfp8.log" ;;
  s24a)  # session 24: w1_mx_matmul's tile widths and its bounded wait (GPU tests), then dev/mx_tile_probe on the 48
         # grid shapes (gluon 128 x 256 / 128 x 128, round + the bf16 static GEMM, cuBLAS on bf16 and MX operands)
    begin_stage s24a
    gpu_tests mx-w1 200 "tile_width or each_tile_width or mx_kernel_timeout or quantizes" \
      tests/test_all_gather_matmul.py tests/test_matmul_reduce_scatter.py
    timeout $((560 - SECONDS)) python -m dev.mx_tile_probe --json "$out/mx-tile-probe.jsonl" > "$out/mx-tile-probe.log" 2>&1
    echo "probe rc=$?"; keep; grep -iE "error|Traceback" "$out/mx-tile-probe.log" | head -5; tail -56 "$out/mx-tile-probe.log" ;;
  s24b)  # session 24: s24a's probe again, the gluon launches bound once (s24a timed a self-check per call)
    begin_stage s24b
    timeout 540 python -m dev.mx_tile_probe --json "$out/mx-tile-probe.jsonl" > "$out/mx-tile-probe.log" 2>&1
    echo "probe rc=$?"; keep; grep -iE "error|Traceback" "$out/mx-tile-probe.log" | head -5; tail -56 "$out/mx-tile-probe.log" ;;
  s24c)  # session 24: the MX GPU tests after the tile-width change (s23d's selection), then the MX grid in the bench
    begin_stage s24c
    gpu_tests mx-w1 220 "mx or quantizes or graph or plan" tests/test_all_gather_matmul.py \
      tests/test_matmul_reduce_scatter.py tests/test_cuda_graphs.py tests/test_launch_plan.py tests/test_nn_tp.py
    timeout $((570 - SECONDS)) python -m kosmos_bench.cli bench tp --tp 1 --suite suites/tp-grid.yaml --dtype mxfp8 \
      --impl kosmos --out "$out/tp-grid-mxfp8-w1.jsonl" > "$out/bench-grid-mx.log" 2>&1; echo "grid mx rc=$?"; keep
    timeout 20 python -m kosmos_bench.cli report "$out/tp-grid-mxfp8-w1.jsonl" --format md \
      --out "$out/tp-grid-mxfp8-w1.md" >> "$out/bench-grid-mx.log" 2>&1; keep
    echo "rows: $(grep -c '"type": "result"' "$out/tp-grid-mxfp8-w1.jsonl") of 96, ok $(grep -c '"status": "ok"' \
      "$out/tp-grid-mxfp8-w1.jsonl")"; grep -E "against cuBLAS alone" "$out/tp-grid-mxfp8-w1.md" | cut -c1-400 ;;
  s24d)  # session 24: host enqueue time, an old tree (carried untracked in .abtree/) against this one, interleaved
    begin_stage s24d
    for i in 1 2; do
      (cd .abtree && timeout 120 python -m dev.fixed_cost --plans --fast-only) > "$out/host-old-$i.log" 2>&1
      echo "old $i rc=$?"; keep
      timeout 120 python -m dev.fixed_cost --plans --fast-only > "$out/host-new-$i.log" 2>&1; echo "new $i rc=$?"; keep
    done
    for f in "$out"/host-*.log; do echo "== $f"; grep -A9 "^median of" "$f"; done ;;
  s24e)  # session 24: host-noise modes, quant's GPU tests (round_to_mx), the MX tile probe with one-kernel rounding
    begin_stage s24e
    timeout 150 python -m dev.host_noise > "$out/host-noise.log" 2>&1; echo "host noise rc=$?"; keep
    tail -12 "$out/host-noise.log"
    gpu_tests quant 120 "" tests/test_quant.py
    timeout $((560 - SECONDS)) python -m dev.mx_tile_probe --json "$out/mx-tile-probe.jsonl" > "$out/mx-tile-probe.log" 2>&1
    echo "probe rc=$?"; keep; grep -iE "error|Traceback" "$out/mx-tile-probe.log" | head -5; tail -8 "$out/mx-tile-probe.log" ;;
  s24f)  # session 24: the pass-first path's GPU tests and s23d's MX selection; the probe on 12 held-out shapes; the
         # MX grid in the bench again; host-noise modes
    begin_stage s24f
    gpu_tests mx-w1 200 "mx or quantizes or graph or plan or pass_first" tests/test_all_gather_matmul.py \
      tests/test_matmul_reduce_scatter.py tests/test_cuda_graphs.py tests/test_launch_plan.py tests/test_nn_tp.py
    timeout 120 python -m dev.mx_tile_probe --rounds 2 --json "$out/mx-tile-heldout.jsonl" --shapes \
      768x2048x4096,1536x2560x3072,2560x10240x2048,5000x3584x6144,12288x1024x4096,640x12288x8192,1024x1024x12288,3072x7168x1536,7168x2048x2048,384x20480x4096,1792x5632x5632,10240x4096x3072 \
      > "$out/mx-tile-heldout.log" 2>&1; echo "held-out probe rc=$?"; keep; tail -20 "$out/mx-tile-heldout.log"
    timeout $((480 - SECONDS)) python -m kosmos_bench.cli bench tp --tp 1 --suite suites/tp-grid.yaml --dtype mxfp8 \
      --impl kosmos --out "$out/tp-grid-mxfp8-w1.jsonl" > "$out/bench-grid-mx.log" 2>&1; echo "grid mx rc=$?"; keep
    timeout 20 python -m kosmos_bench.cli report "$out/tp-grid-mxfp8-w1.jsonl" --format md \
      --out "$out/tp-grid-mxfp8-w1.md" >> "$out/bench-grid-mx.log" 2>&1; keep
    grep -E "against cuBLAS alone|Host enqueue" "$out/tp-grid-mxfp8-w1.md" | cut -c1-400
    timeout $((575 - SECONDS)) python -m dev.host_noise --rounds 5 > "$out/host-noise.log" 2>&1; echo "host noise rc=$?"
    keep; tail -12 "$out/host-noise.log" ;;
  s24g)  # session 24: the W = 1 MX op, an old tree (carried untracked in .abtree/) against this one, interleaved
    begin_stage s24g
    for i in 1 2; do
      (cd .abtree && timeout 140 python -m dev.mx_data_probe --json "$out/ab-old-$i.jsonl") > "$out/ab-old-$i.log" 2>&1
      echo "old $i rc=$?"; keep
      timeout 140 python -m dev.archive.mx_data_probe --json "$out/ab-new-$i.jsonl" > "$out/ab-new-$i.log" 2>&1
      echo "new $i rc=$?"; keep
    done
    for f in "$out"/ab-*.log; do echo "== $f"; grep -E "mxfp8 op|bf16 operands" "$f"; done ;;
  s24h)  # session 24: every TP GPU test after the W = 1 MX dispatch change (s23g's first selection)
    begin_stage s24h
    gpu_tests tp-gpu 450 "not moe" tests/test_all_gather_matmul.py tests/test_matmul_reduce_scatter.py \
      tests/test_tp_ops_together.py tests/test_launch_plan.py tests/test_nn_tp.py tests/test_cuda_graphs.py tests/test_quant.py ;;
  s24i)  # session 24: the tiles of quant.py's streaming kernels (dev/archive/quant_tiles_probe)
    begin_stage s24i
    timeout 300 python -m dev.archive.quant_tiles_probe --json "$out/quant-tiles.jsonl" > "$out/quant-tiles.log" 2>&1
    echo "probe rc=$?"; keep; grep -iE "error|Traceback" "$out/quant-tiles.log" | head -5; tail -14 "$out/quant-tiles.log" ;;
  s24j)  # session 24: dequantize_mx's conversion path: quant GPU tests, the pass-first / MX tests, the tiles probe
    begin_stage s24j
    gpu_tests quant 150 "" tests/test_quant.py
    gpu_tests mx 200 "pass_first or quantizes or mx" tests/test_all_gather_matmul.py tests/test_matmul_reduce_scatter.py \
      tests/test_nn_tp.py tests/test_cuda_graphs.py
    timeout 200 python -m dev.archive.quant_tiles_probe --json "$out/quant-tiles.jsonl" > "$out/quant-tiles.log" 2>&1
    echo "probe rc=$?"; keep; grep -iE "error|Traceback" "$out/quant-tiles.log" | head -5; tail -18 "$out/quant-tiles.log" ;;
  s24k)  # session 24: the Gluon kernel's fixed bounded wait: its timeout test, repeated while time allows
    begin_stage s24k
    for i in 1 2 3 4 5; do
      timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/test_all_gather_matmul.py \
        -k "mx_kernel_timeout" > "$out/timeout-$i.log" 2>&1; echo "timeout test $i rc=$?"; tail -1 "$out/timeout-$i.log"; keep
    done ;;
  *) echo "unknown stage $stage: check|mxfp8|gpu-all|moe-mxfp8|moe-bwd|train|grid|deepep|s9final|tiles|s10a|s10b|s10c|s10d|s10e|s11a|s11b|s11c|s11d|s12a|s12b|s12c|s12d|s12e|s12f|s12g|s13a|s13b|s13c|s13d|s13e|s13f|s13g|s13h|s13i|s13j|s14a|s14b|s14c|s14d|s14e|s14f|s15a|s15b|s15c|s15h|s16a|s16b|s16c|s16d|s16e|s16f|s16h|s17a|s17b|s17d|s18a|s18b|s18c|s18d|s18e|s18g|s18h|s19a|s19b|s19c|s19d|s19e|s19f|s19g|s20a|s20b|s20c|s20d|s20e|s20f|s20g|s20h|s21a|s21b|s21c|s21d|s21e|s22a|s22b|s22c|s22d|s23a|s23b|s23c|s23d|s24a|s24b|s24c|s24d|s24e|s24f|s24g|s24h|s24i|s24j|s24k" >&2; exit 2 ;;
esac
