#!/usr/bin/env bash
# The two-GPU session plan of NOTES.md ("Next session's device plan") as three device calls, each under the
# device tool's 10-minute limit, each writing at most 8 files under $OUT and printing a short table last.
#
#   KOSMOS_GIT_COMMIT=<sha of the tree> bash dev/archive/x2_session.sh tests   # ~6 min: every GPU test
#   KOSMOS_GIT_COMMIT=<sha> bash dev/archive/x2_session.sh ab                  # ~6 min: config A/B + traces
#   KOSMOS_GIT_COMMIT=<sha> bash dev/archive/x2_session.sh suite               # <= 9.5 min: the default suite
#   KOSMOS_GIT_COMMIT=<sha> bash dev/archive/x2_session.sh tp-mx               # issue 17: TP bf16 + mxfp8, a trace
#   KOSMOS_GIT_COMMIT=<sha> bash dev/archive/x2_session.sh moe-mx              # issues 17, 18: MoE + deepep (carry .wheels)
#   KOSMOS_GIT_COMMIT=<sha> bash dev/archive/x2_session.sh train               # issue 19: the training proxies at W=2
# tp-mx, moe-mx and train were written in session 9 and have not run end to end on one GPU (--tp 1) yet.
#
# KOSMOS_GIT_COMMIT names the commit in the env records (the device's copy of the tree has a stale .git).
set -u
stage=${1:?usage: x2_session.sh tests|ab|suite|tp-mx|moe-mx|moe-bwd|train}
out=${OUT:?run on the device machine, where OUT is set}
export PYTHONUNBUFFERED=1 PYTHONPATH=.
bench() { timeout "$1" python -m kosmos_bench.cli bench tp "${@:2}" > /dev/null 2>&1; echo "  rc=$? $*"; }
case $stage in
  tests)
    timeout 560 python -m pytest -q --durations=10 -m "gpu or ranks or multi_gpu or gpu_optional" tests/ \
      > "$out/gpu-tests-w2.log" 2>&1
    echo "pytest rc=$?"; tail -15 "$out/gpu-tests-w2.log" ;;
  ab)
    # AllGather+GEMM pushers: 1 chunk per push task (default), `auto` (~16 pushers), 4 chunks per task
    for v in 1 auto 4; do
      bench 120 --model llama3-70b --op ag_gemm --impl kosmos,nccl+cublas --config push_chunks=$v \
        --out "$out/ag-push-$v.jsonl"
    done
    # GEMM+RS: pull the partials (default) or push them from the epilogue
    for v in 0 1; do
      bench 120 --model llama3-70b --op gemm_rs --impl kosmos,nccl+cublas --config push_partials=$v \
        --out "$out/rs-push-$v.jsonl"
    done
    # where the program time goes now (compare with NOTES.md "Where W=2 program time went")
    bench 120 --model llama3-70b --op qkv,attn_out --seq 8192 --impl kosmos --trace --out "$out/trace-8k.jsonl"
    python -m dev.trace_breakdown "$out"/trace-8k-traces/*.json
    for v in auto 4; do python -m dev.ab_compare "$out/ag-push-1.jsonl" --vs "$out/ag-push-$v.jsonl"; done
    python -m dev.ab_compare "$out/rs-push-0.jsonl" --vs "$out/rs-push-1.jsonl" ;;
  suite)
    # the default suite, llama3-70b first (the bar shapes) so that a timeout can only cut llama3-8b;
    # both runs append to one file (the report keys rows to their env line by run_id)
    impls=kosmos,nccl+cublas,torch-async-tp,fixed-role,fixed-role-best
    bench 330 --model llama3-70b --impl $impls --out "$out/tp-bf16.jsonl"
    bench 230 --model llama3-8b --impl $impls --out "$out/tp-bf16.jsonl"
    python -m kosmos_bench.cli report "$out/tp-bf16.jsonl" --format md --out "$out/tp-bf16.md" > /dev/null
    tail -25 "$out/tp-bf16.md" ;;
  tp-mx)  # issue 17: the TP suite at bf16 and mxfp8 in one run, llama3-70b (the bar's 12 shapes) first, every
          # implementation; one traced point (qkv 8k) for its timeline. ~9 min.
    impls=kosmos,nccl+cublas,torch-async-tp,triton-dot-scaled,fp8-rowwise,fixed-role,fixed-role-best
    timeout 420 python -m kosmos_bench.cli bench tp --model llama3-70b --dtype bf16,mxfp8 --impl $impls \
      --out "$out/tp-bf16-mxfp8.jsonl" > "$out/bench-tp-mx.log" 2>&1; echo "llama3-70b rc=$?"
    timeout 60 python -m kosmos_bench.cli bench tp --model llama3-70b --op qkv --seq 8192 --dtype bf16,mxfp8 \
      --impl kosmos --trace --out "$out/tp-trace.jsonl" > /dev/null 2>&1; echo "trace rc=$?"
    python -m kosmos_bench.cli report "$out/tp-bf16-mxfp8.jsonl" --format md --out "$out/tp-bf16-mxfp8.md" \
      > /dev/null 2>&1
    grep -v "^{" "$out/bench-tp-mx.log" | tail -30 ;;
  moe-mx)  # issue 17 / 18 part 2: the MoE suite at bf16 and mxfp8 with deepep (carry [".wheels"]: the shared
           # DeepEP wheel, ../shared/wheels/README.md), one traced point for its timeline. ~9 min.
    python3 -m pip install -q --no-deps --target .deepep-site .wheels/deep_ep-*.whl > /dev/null 2>&1
    export PYTHONPATH=$PWD/.deepep-site:$PYTHONPATH
    timeout 480 python -m kosmos_bench.cli bench moe --dtype bf16,mxfp8 --out "$out/moe-bf16-mxfp8.jsonl" \
      > "$out/bench-moe-mx.log" 2>&1; echo "moe rc=$?"
    timeout 60 python -m kosmos_bench.cli bench moe --model deepseek-v3 --tokens 8192 --routing uniform \
      --impl kosmos --no-expert-gemms --trace --out "$out/moe-trace.jsonl" > /dev/null 2>&1; echo "trace rc=$?"
    python -m kosmos_bench.cli report "$out/moe-bf16-mxfp8.jsonl" --format md --out "$out/moe-bf16-mxfp8.md" \
      > /dev/null 2>&1
    grep -v "^{" "$out/bench-moe-mx.log" | tail -30 ;;
  moe-bwd)  # issue 19: the MoE forward and backward at EP=2 on the default suite, every implementation (deepep from
            # .wheels: carry [".wheels"]); the backward rows are checked against the distributed fp32 reference
            # (kosmos_bench.moe.grad_reference_distributed). ~9 min: split with --model if it runs long.
    python3 -m pip install -q --no-deps --target .deepep-site .wheels/deep_ep-*.whl > /dev/null 2>&1
    export PYTHONPATH=$PWD/.deepep-site:$PYTHONPATH
    timeout 540 python -m kosmos_bench.cli bench moe --direction fwd,bwd --out "$out/moe-bwd.jsonl" \
      > "$out/bench-moe-bwd.log" 2>&1; echo "moe fwd,bwd rc=$?"
    python -m kosmos_bench.cli report "$out/moe-bwd.jsonl" --format md --out "$out/moe-bwd.md" > /dev/null 2>&1
    grep -v "^{" "$out/bench-moe-bwd.log" | tail -30 ;;
  train)  # issue 19: the training proxies at W=2 (llama3-70b TP=2; deepseek-v3 / qwen3-235b EP=2 scaled down)
    timeout 240 python -m kosmos_bench.cli bench train --model llama3-70b --layers 2 --seq 8192 --tp 2 --steps 20 \
      --out "$out/train.jsonl" > "$out/bench-train.log" 2>&1; echo "llama3-70b rc=$?"
    for m in deepseek-v3 qwen3-235b; do
      timeout 150 python -m kosmos_bench.cli bench train --model $m --layers 2 --seq 4096 --scale 0.25 --tp 2 \
        --steps 20 --out "$out/train.jsonl" >> "$out/bench-train.log" 2>&1; echo "$m rc=$?"
    done
    python -m kosmos_bench.cli report "$out/train.jsonl" --format md --out "$out/train.md" --chart "$out/train-loss.png" \
      > /dev/null 2>&1
    tail -20 "$out/train.md" ;;
  *) echo "unknown stage $stage: tests, ab, suite, tp-mx, moe-mx, moe-bwd or train" >&2; exit 2 ;;
esac
