#!/usr/bin/env bash
# The architecture issue's one-GPU checks as device calls (each < 10 minutes, files under $OUT, a short table
# last). The old tree (the commit before the architecture work) is exported into .base/ and carried:
#
#   rm -rf .base && mkdir .base && git archive f5456a4 kosmos kosmos_bench suites | tar -x -C .base
#   KOSMOS_GIT_COMMIT=<sha> bash dev/archive/arch_session.sh tests   # every GPU test (W=1 + simulated W=2..8) and
#                                                            # the register/spill table of both trees
#   KOSMOS_GIT_COMMIT=<sha> bash dev/archive/arch_session.sh tp      # W=1 A/B, llama3-70b TP=2 per-rank GEMMs
#   KOSMOS_GIT_COMMIT=<sha> bash dev/archive/arch_session.sh moe     # W=1 A/B, the MoE suite at EP=1
#
# A/B: old, new, old, new, interleaved in one call, each tree run from its own directory (in_tree);
# `python -m dev.ab_compare` prints new/old per shape and the geomean, and refuses files of one source.
# Device run: carry [".base"].
set -u
stage=${1:?usage: arch_session.sh tests|regs|tp|moe|final|ab9|deq9}
out=${OUT:?run on the device machine, where OUT is set}
export PYTHONUNBUFFERED=1
[ -d .base/kosmos ] || { echo "no .base/ tree (see the header)"; exit 2; }
# Run a command inside one tree: `python -m` imports the package of the working directory first (it heads
# sys.path), so PYTHONPATH=.base alone ran the working tree -- every A/B of sessions 7-9 compared a tree with
# itself (found in session 10 from the rows' source_sha; dev/ab_compare.py now refuses such a pair).
# Out paths must be absolute ($OUT is).
in_tree() { local root=$1; shift; ( cd "$root" && PYTHONPATH=. "$@" ); }
regs() {  # tree json
  PYTHONPATH=".:$1" timeout 280 python -c "import sys; sys.path.insert(0, '$1'); sys.argv = ['kr', '--world', '1,2,8', '--json', '$2']
import importlib.util; spec = importlib.util.spec_from_file_location('kr', 'dev/kernel_resources.py')
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); sys.exit(m.main())"
}
case $stage in
  tests)
    # compile both trees' kernels on the CPU while the GPU tests run (ptxas figures of Triton 3.6)
    ( regs .base "$out/regs-old.json" > "$out/regs-old.txt" 2>&1; regs . "$out/regs-new.json" > "$out/regs-new.txt" 2>&1 ) &
    # TESTS: the GPU test selection (default: the marked GPU and simulated-rank tests, tests/conftest.py)
    PYTHONPATH=. timeout 500 python -m pytest -q -p no:cacheprovider --durations=15 \
      ${TESTS:--m "gpu or ranks or multi_gpu or gpu_optional" tests/} \
      > "$out/gpu-tests.log" 2>&1
    echo "pytest rc=$?"
    wait
    grep -E "^(triton|kernel|all_|matmul|moe)" "$out/regs-old.txt" | sed 's/^/old /'
    grep -E "^(triton|kernel|all_|matmul|moe)" "$out/regs-new.txt" | sed 's/^/new /'
    tail -22 "$out/gpu-tests.log" ;;
  regs)  # the new tree's register table alone
    regs . "$out/regs-new.json" > "$out/regs-new.txt" 2>&1; cat "$out/regs-new.txt" | grep -v -i warn ;;
  tp)
    [ -n "${WITH_REGS:-}" ] && ( regs . "$out/regs-new.json" > "$out/regs-new.txt" 2>&1 ) &
    for round in 1 2; do
      for tree in old new; do
        root=.; [ $tree = old ] && root=.base
        in_tree $root timeout 130 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b \
          --impl kosmos --out "$out/tp-w1-$tree-$round.jsonl" >> /tmp/tp-w1-runs.log 2>&1
        echo "tp $tree round $round rc=$?"
      done
    done
    wait
    [ -f "$out/regs-new.txt" ] && grep -E "^(all_|matmul|moe)" "$out/regs-new.txt"
    PYTHONPATH=. python -m dev.ab_compare "$out"/tp-w1-old-*.jsonl --vs "$out"/tp-w1-new-*.jsonl | tee "$out/ab-tp.txt" ;;
  moe)  # MOE_ROUNDS (default 2) rounds of old, new; MOE_ITERS timed iterations (default 20)
    for round in $(seq 1 ${MOE_ROUNDS:-2}); do
      for tree in old new; do
        root=.; [ $tree = old ] && root=.base
        in_tree $root timeout ${MOE_TIMEOUT:-130} python -m kosmos_bench.cli bench moe --ep 1 --impl kosmos \
          --no-expert-gemms --iters ${MOE_ITERS:-20} --out "$out/moe-ep1-$tree-$round.jsonl" >> "$out/moe-runs.log" 2>&1
        echo "moe $tree round $round rc=$?"
      done
    done
    PYTHONPATH=. python -m dev.ab_compare "$out"/moe-ep1-old-*.jsonl --vs "$out"/moe-ep1-new-*.jsonl | tee "$out/ab-moe.txt" ;;
  final)  # the GPU tests, both trees' register tables (compiled on the CPU meanwhile), one MoE A/B round
    ( regs .base "$out/regs-old.json" > /tmp/regs-old.txt 2>&1; regs . "$out/regs-new.json" > /tmp/regs-new.txt 2>&1 ) &
    PYTHONPATH=. timeout ${TEST_TIMEOUT:-220} python -m pytest -q -p no:cacheprovider --durations=5 \
      -m "gpu or ranks or multi_gpu or gpu_optional" tests/ > "$out/gpu-tests.log" 2>&1
    echo "pytest rc=$?"; tail -3 "$out/gpu-tests.log"
    wait
    grep -E "^(triton|all_|matmul|moe)" /tmp/regs-old.txt | sed 's/^/old /'
    grep -E "^(triton|all_|matmul|moe)" /tmp/regs-new.txt | sed 's/^/new /'
    MOE_ROUNDS=1 bash "$0" moe ;;
  ab9)  # session 9: interleaved old/new A/B (TP W=1 suite x2 rounds, MoE EP=1 x1) + both trees' registers,
        # each tree compiled by its own dev/kernel_resources.py (archive the old tree with it); a deadline
        # (AB_DEADLINE_S, default 540) skips runs that would not fit
    ( own_regs() { PYTHONPATH="$1" timeout 400 python "$1/dev/kernel_resources.py" --world 1,2,8 --json "$2"; }
      own_regs .base "$out/regs-old.json" > /tmp/regs-old.txt 2>&1; own_regs . "$out/regs-new.json" > /tmp/regs-new.txt 2>&1 ) &
    deadline=${AB_DEADLINE_S:-540}
    run_one() {  # kind tree round limit
      local root=.; [ $2 = old ] && root=.base
      if [ $((SECONDS + $4)) -gt $deadline ]; then echo "$1 $2 round $3 skipped (deadline)"; return; fi
      local t0=$SECONDS
      if [ $1 = tp ]; then
        in_tree $root timeout $4 python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 --model llama3-70b \
          --impl kosmos --out "$out/tp-w1-$2-$3.jsonl" >> /tmp/ab-runs.log 2>&1
      else
        in_tree $root timeout $4 python -m kosmos_bench.cli bench moe --ep 1 --impl kosmos --no-expert-gemms \
          --iters 20 --out "$out/moe-ep1-$2-$3.jsonl" >> /tmp/ab-runs.log 2>&1
      fi
      echo "$1 $2 round $3 rc=$? $((SECONDS - t0)) s"
    }
    run_one tp old 1 120; run_one tp new 1 120; run_one moe old 1 110; run_one moe new 1 110
    run_one tp old 2 90; run_one tp new 2 90
    wait
    grep -E "^(all_|matmul|moe)" /tmp/regs-old.txt | sed 's/^/old /'
    grep -E "^(all_|matmul|moe)" /tmp/regs-new.txt | sed 's/^/new /'
    tail -5 /tmp/ab-runs.log
    PYTHONPATH=. python -m dev.ab_compare "$out"/moe-ep1-old-*.jsonl --vs "$out"/moe-ep1-new-*.jsonl
    PYTHONPATH=. python -m dev.ab_compare "$out"/tp-w1-old-*.jsonl --vs "$out"/tp-w1-new-*.jsonl ;;
  deq9)  # session 9: the MXFP8 DEQ A/B at W=1 (kosmos mxfp8 rows, llama3-70b TP=2 per-rank GEMMs): .base (the
         # old DEQ), .var/rows8 (8-row DEQ tasks), . (8-row tasks through TMA), two rounds interleaved;
         # the new tree's MX GPU tests first and its registers compiled meanwhile (Triton 3.6)
    ( PYTHONPATH=. timeout 300 python dev/kernel_resources.py --world 1,2,8 --mx --json "$out/regs-mx-new.json" \
        > /tmp/regs-mx-new.txt 2>&1 ) &
    PYTHONPATH=. timeout 60 python -m pytest -q -p no:cacheprovider -m gpu tests/test_all_gather_matmul.py \
      tests/test_matmul_reduce_scatter.py tests/test_quant.py -k "mx" > "$out/gpu-tests-mx.log" 2>&1
    echo "mx gpu tests rc=$?"; tail -1 "$out/gpu-tests-mx.log"; grep -E "^(FAILED|ERROR)" "$out/gpu-tests-mx.log" | head -5
    for round in 1 2; do
      for tree in old rows8 tma; do
        root=.; [ $tree = old ] && root=.base; [ $tree = rows8 ] && root=.var/rows8
        t0=$SECONDS
        in_tree $root timeout ${DEQ_RUN_S:-80} python -m kosmos_bench.cli bench tp --tp 1 --shapes-tp 2 \
          --model llama3-70b --impl kosmos --dtype mxfp8 --out "$out/mx-$tree-$round.jsonl" >> /tmp/deq-runs.log 2>&1
        echo "mx $tree round $round rc=$? $((SECONDS - t0)) s"
      done
    done
    wait
    grep -E "^(all_|matmul|moe)" /tmp/regs-mx-new.txt
    for tree in rows8 tma; do
      PYTHONPATH=. python -m dev.ab_compare "$out"/mx-old-*.jsonl --vs "$out"/mx-$tree-*.jsonl | tail -16 | sed "s/^/$tree: /"
    done ;;
  *) echo "unknown stage $stage: tests, tp or moe" >&2; exit 2 ;;
esac
