#!/usr/bin/env bash
# The next one-GPU session's first device call (written in session 7, not yet run): what session 7 built on the CPU
# and could not run on a GPU (its device time was spent on the architecture checks). One call, < 10 minutes:
#
#   KOSMOS_GIT_COMMIT=<sha> bash dev/x1_session.sh check
#
# 1. the MXFP8 quant kernels' GPU tests (bit-exact vs the reference) -- first thing before any MXFP8 kernel work;
# 2. `kosmos env` and the custom-point / dry-run paths of the bench on a real GPU (issue: the suite as users meet
#    it) -- a custom TP GEMM and a custom MoE layer at world 1, every implementation that can run there;
# 3. the whole GPU test selection, as the last step (it is the longest).
set -u
stage=${1:?usage: x1_session.sh check|mxfp8|gpu-all|moe-mxfp8|moe-bwd|train}
out=${OUT:?run on the device machine, where OUT is set}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
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
    timeout 60 python -m dev.deq_probe > "$out/deq-probe.log" 2>&1; echo "deq probe rc=$?"
    timeout 90 python -m dev.mx_probe --seqs 4096 --json "$out/mx-probe.jsonl" > "$out/mx-probe.log" 2>&1
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
  *) echo "unknown stage $stage: check|mxfp8|gpu-all|moe-mxfp8|moe-bwd|train" >&2; exit 2 ;;
esac
