"""Test-session setup, and the platform markers of the kernel tests.

Without a GPU the Triton kernels run under the CPU interpreter. ``TRITON_INTERPRET`` is read when triton and
kosmos.device are imported, so it is set here, at conftest import time, before any test module imports them.
On a machine with CUDA it is left alone, so the GPU tests run real kernels (and the interpreter tests skip).

Markers (registered in pyproject.toml); a marked test is skipped here when its platform is absent:

* ``interpreter`` -- Triton kernels under the CPU interpreter, on CPU tensors: skipped unless
  TRITON_INTERPRET=1 (set above when there is no CUDA), since they would otherwise run GPU tiles on CPU tensors.
* ``gpu`` -- one Hopper (sm_90+) GPU, real kernels: skipped without one.
* ``ranks`` -- W = 2..8 simulated ranks on one Hopper GPU (simranks.py): skipped without one.
* ``multi_gpu`` -- one process per GPU, 2 Hopper GPUs: skipped with fewer.
* ``gpu_optional`` -- runs everywhere: on a GPU machine with real CUDA tensors, on a CPU-only one with
  stand-ins (the TP ops' input checks), so the GPU suite runs it too.

* ``slow`` -- not a platform: a GPU test of tens of seconds (end-to-end runs, real-size layers), left out of the
  quick tier.

The whole GPU test suite (every test that needs or uses a GPU), on the GPU machine, in parallel processes that
share the GPU: ``bash dev/gpu_check.sh`` (``--quick``: without the ``slow`` tests). By hand, in one process:

    python -m pytest -q -m "gpu or ranks or multi_gpu or gpu_optional" tests/

(``-m "gpu or ranks"`` alone is the one-GPU part; ``-m interpreter`` the CPU-interpreter kernel tests.)
``--times-log PATH`` appends each test phase's outcome and seconds to PATH as JSON lines while the run goes on.
"""
import json
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability(0)[0] >= 9
N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0


def _gpu_skip():
    if not HAS_CUDA:
        return "needs a CUDA GPU"
    if not IS_HOPPER:
        return "needs a Hopper (sm_90+) GPU: TMA descriptors"
    return None


def _skip_reason(item):
    """Why ``item`` cannot run on this machine (None: it can), from its platform marker."""
    if item.get_closest_marker("interpreter") and not INTERPRET:
        return "CPU interpreter tests: need TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)"
    if item.get_closest_marker("gpu") or item.get_closest_marker("ranks") or item.get_closest_marker("multi_gpu"):
        reason = _gpu_skip()
        if reason:
            return reason
    if item.get_closest_marker("multi_gpu") and N_GPUS < 2:
        return "needs 2 CUDA GPUs"
    return None


def pytest_addoption(parser):
    parser.addoption("--times-log", metavar="PATH", default=None,
                     help="append one JSON line per test phase (nodeid, phase, outcome, seconds, worker) to PATH as "
                          "each test ends, so that a run stopped part-way still says where its time went "
                          "(dev/gpu_check.sh writes it)")


def pytest_runtest_logreport(report):
    # runs in the xdist controller too (the workers' reports are forwarded), so one process writes the file
    path = getattr(pytest_runtest_logreport, "path", None)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(dict(nodeid=report.nodeid, phase=report.when, outcome=report.outcome,
                                    seconds=round(report.duration, 3),
                                    worker=getattr(report, "node", None) and report.node.gateway.id)) + "\n")


def pytest_configure(config):
    worker = hasattr(config, "workerinput")  # an xdist worker: its controller writes the log
    pytest_runtest_logreport.path = None if worker else config.getoption("--times-log")


def pytest_collection_modifyitems(config, items):
    for item in items:
        reason = _skip_reason(item)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def no_tf32():
    """fp32 references with TF32 off (restored afterwards)."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


@pytest.fixture
def ranks_setup(no_tf32):
    """What the simulated-rank tests need: TF32 off and Triton's allocator set (the launches go straight to
    the kernels, not through the public ops that set it)."""
    from kosmos.core import runtime
    runtime.ensure_triton_allocator()
