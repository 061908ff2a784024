#!/usr/bin/env bash
# The two-GPU session plan of NOTES.md ("Next session's device plan") as three device calls, each under the
# device tool's 10-minute limit, each writing at most 8 files under $OUT and printing a short table last.
#
#   KOSMOS_GIT_COMMIT=<sha of the tree> bash dev/x2_session.sh tests   # ~6 min: every GPU test
#   KOSMOS_GIT_COMMIT=<sha> bash dev/x2_session.sh ab                  # ~6 min: config A/B + traces
#   KOSMOS_GIT_COMMIT=<sha> bash dev/x2_session.sh suite               # <= 9.5 min: the default suite
#
# KOSMOS_GIT_COMMIT names the commit in the env records (the device's copy of the tree has a stale .git).
set -u
stage=${1:?usage: x2_session.sh tests|ab|suite}
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
  *) echo "unknown stage $stage: tests, ab or suite" >&2; exit 2 ;;
esac
