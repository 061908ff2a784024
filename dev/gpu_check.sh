#!/usr/bin/env bash
# The GPU test suite on one GPU machine, in one command:
#
#   bash dev/gpu_check.sh                 # the whole GPU selection: -m "gpu or ranks or multi_gpu or gpu_optional"
#   bash dev/gpu_check.sh --quick         # the quick tier for work in progress: the same selection, "not slow"
#   bash dev/gpu_check.sh --log FILE      # also write the whole output to FILE (and FILE's .times.jsonl beside it)
#   bash dev/gpu_check.sh -- -k moe       # anything after -- goes to pytest as it is
#
# Most of the suite's time is Triton compiling kernels on the CPU while the GPU idles (measured 2026-12-06, one H100,
# 16 CPUs, 8 workers: 3 min 53 s of wall time held 54 min of user CPU time, the GPU 8% busy on average). So the
# tests run in several pytest-xdist processes (--workers N, default 8, at most the CPU count) that share the GPU: their
# compiles overlap on the host's cores, their kernels take turns on the GPU (without MPS the driver time-slices the
# processes' contexts), and they share one Triton cache directory
# (TRITON_CACHE_DIR, default ~/.triton/cache): a kernel one worker compiled is loaded, not rebuilt, by the others.
# --workers 1 runs the tests in one process, as plain pytest does.
#
# Before the tests: installs this tree in editable mode if `kosmos` does not import from it (the GPU machine has no
# package registry: --no-deps), and DeepEP / Liger-Kernel from .whl/deep_ep-*.whl / .whl/liger_kernel-*.whl if carried
# (their tests skip without them). Prints an environment line, pytest's summary and the slowest tests, then `time`'s
# lines; exits with pytest's status (non-zero on any failure, or when nothing was collected).
set -uo pipefail
cd "$(dirname "$0")/.."

workers=$(( $(nproc) < 8 ? $(nproc) : 8 )) quick=0 log="" extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick=1 ;;
    --workers) workers=${2:?--workers needs a number}; shift ;;
    --log) log=${2:?--log needs a file}; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
  shift
done
case "$workers" in ''|*[!0-9]*|0) echo "gpu_check.sh: --workers takes a positive whole number, not '$workers'" >&2
  exit 2 ;; esac
if [ -n "$log" ]; then
  mkdir -p "$(dirname "$log")" && : > "$log" || { echo "gpu_check.sh: cannot write the log '$log'" >&2; exit 2; }
  exec > >(tee -a "$log") 2>&1
fi

py=python3
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_check.sh: no CUDA GPU here (torch.cuda.is_available() is False): every GPU test would skip." >&2
  echo "  On a CPU machine run the CPU suite instead: python -m pytest -q" >&2
  exit 2
fi
here=$PWD
if [ "$(cd /tmp && "$py" -c 'import os, kosmos; print(os.path.dirname(os.path.dirname(kosmos.__file__)))' \
        2>/dev/null)" != "$here" ]; then
  echo "installing this tree (pip install --no-deps --no-build-isolation -e .) ..."
  "$py" -m pip install -q --no-deps --no-build-isolation -e . > /tmp/kosmos-gpu-check-install.log 2>&1 \
    || { cat /tmp/kosmos-gpu-check-install.log; echo "gpu_check.sh: the install failed" >&2; exit 2; }
fi
wheel=$(ls .whl/deep_ep-*.whl 2>/dev/null | head -1)
if [ -n "$wheel" ] && ! "$py" -c "import deep_ep" 2>/dev/null; then
  "$py" -m pip install -q --no-deps --target /tmp/kosmos-deepep-site "$wheel" > /dev/null 2>&1 \
    && export PYTHONPATH="$PYTHONPATH:/tmp/kosmos-deepep-site" || echo "DeepEP: installing $wheel failed"
fi
wheel=$(ls .whl/liger_kernel-*.whl 2>/dev/null | head -1)  # Liger-Kernel (pure Python): bench moe's liger row
if [ -n "$wheel" ] && ! "$py" -c "import liger_kernel" 2>/dev/null; then
  "$py" -m pip install -q --no-deps --target /tmp/kosmos-liger-site "$wheel" > /dev/null 2>&1 \
    && export PYTHONPATH="$PYTHONPATH:/tmp/kosmos-liger-site" || echo "Liger-Kernel: installing $wheel failed"
fi

sel="gpu or ranks or multi_gpu or gpu_optional"
[ $quick = 1 ] && sel="($sel) and not slow"
args=(-q -p no:cacheprovider -m "$sel" -r fEs --durations 15 --durations-min 5)
if [ "$workers" -gt 1 ]; then
  "$py" -c "import xdist" 2>/dev/null || { echo "gpu_check.sh: --workers $workers needs pytest-xdist" \
    "(python3 -m pip install pytest-xdist), or pass --workers 1" >&2; exit 2; }
  args+=(-n "$workers")
  # worksteal (xdist >= 3.2): an idle worker takes queued tests from a busy one, so a few long tests at the end of
  # one worker's share do not leave the others idle
  "$py" -c "import sys, xdist; sys.exit(tuple(map(int, xdist.__version__.split('.')[:2])) < (3, 2))" 2>/dev/null \
    && args+=(--dist worksteal)
fi
"$py" -c "import pytest_timeout" 2>/dev/null && args+=(--timeout 600)  # a hung test fails, the run goes on
[ -n "$log" ] && { : > "${log%.log}.times.jsonl"; args+=(--times-log "${log%.log}.times.jsonl"); }

cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
"$py" - "$workers" "$sel" "$cache" <<'EOF'
import os, subprocess, sys
import torch, triton
workers, sel, cache = sys.argv[1:]
try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True).stdout
except OSError:
    commit, dirty = "", ""
changed = [line[3:] for line in dirty.splitlines() if line.strip()]
if os.environ.get("KOSMOS_GIT_COMMIT"):  # a copy of the tree whose .git is not its own (the device tool's)
    commit, changed = os.environ["KOSMOS_GIT_COMMIT"][:12] + " (KOSMOS_GIT_COMMIT)", []
entries = len(os.listdir(cache)) if os.path.isdir(cache) else 0
print(f"gpu_check: {torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}, {os.cpu_count()} CPUs, "
      f"torch {torch.__version__}, triton {triton.__version__}, commit {commit or '?'}"
      f"{' + uncommitted changes to ' + ', '.join(changed[:6]) + (' ...' if len(changed) > 6 else '') if changed else ''}; "
      f"workers {workers}; -m \"{sel}\"; Triton cache {cache} ({'cold' if entries == 0 else f'{entries} entries'})")
EOF

{ time "$py" -m pytest "${args[@]}" tests/ "${extra[@]}"; } 2>&1
rc=$?
echo "gpu_check: pytest exit status $rc"
exit $rc
