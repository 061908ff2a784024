"""``kosmos --version`` and ``kosmos env``: the versions, and what a bug report needs (kosmos and its git commit,
Python, torch, CUDA, triton, NCCL, the driver, the GPUs with their memory and SMs, peer access and
``nvidia-smi topo -m``), on any machine: without a GPU it says "no CUDA GPU" and the rest still prints.
Every probe is guarded, so a broken piece shows as its one-line error instead of stopping the report."""
from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import shutil
import subprocess
import sys

from .environment import SOURCE_ROOT, _driver, git_commit, git_dirty, in_checkout

# environment variables that change what a run does (shown by `kosmos env` when set)
ENV_PREFIXES = ("CUDA_VISIBLE_DEVICES", "NCCL_", "KOSMOS_", "TORCH_SYMM_MEM", "TRITON_", "TORCH_NCCL_")


def _why(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".splitlines()[0][:200]


def module_version(name: str) -> str:
    """``name.__version__`` of the importable module, else why it is not importable."""
    try:
        mod = importlib.import_module(name)
    except Exception as e:  # ImportError, or a broken build failing at import
        return f"not importable ({_why(e)})"
    return str(getattr(mod, "__version__", None) or _dist_version(name) or "unknown version")


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def version_line() -> str:
    """``kosmos --version``: one line with the versions of kosmos, torch and triton."""
    return "  ".join(f"{name} {module_version(name)}" for name in ("kosmos", "torch", "triton"))


def _git() -> str:
    """The source tree's commit, or why there is none (an installed wheel has no git checkout)."""
    if not os.environ.get("KOSMOS_GIT_COMMIT") and not in_checkout():
        return "no git checkout (an installed package)"
    sha = git_commit()
    if sha is None:
        return "unknown (git not available)"
    dirty = git_dirty()
    return sha + {True: " (uncommitted changes in kosmos/ or kosmos_bench/)", False: "", None: ""}[dirty]


def _nccl(torch) -> str:
    try:
        v = torch.cuda.nccl.version()
    except Exception:  # a CPU-only build has no NCCL
        return "none in this torch build"
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def _gpu_lines(torch) -> list[str]:
    try:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as e:
        return [f"GPUs:        no CUDA GPU ({_why(e)})"]
    if n == 0:
        return ["GPUs:        no CUDA GPU (torch.cuda.is_available() is False)"]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    lines = [f"GPUs:        {n} visible" + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")]
    for i in range(n):
        try:
            p = torch.cuda.get_device_properties(i)
            lines.append(f"  {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
                         f"sm_{p.major}{p.minor}")
        except Exception as e:
            lines.append(f"  {i}: {_why(e)}")
    if n > 1:
        lines.append("peer access (row -> column):")
        lines.append("      " + " ".join(f"{j:>4}" for j in range(n)))
        for i in range(n):
            cells = []
            for j in range(n):
                try:
                    cell = "-" if i == j else ("yes" if torch.cuda.can_device_access_peer(i, j) else "no")
                except Exception:
                    cell = "?"
                cells.append(f"{cell:>4}")
            lines.append(f"  {i:>3} " + " ".join(cells))
    return lines


def _topology() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return ["nvidia-smi topo -m: nvidia-smi not found"]
    try:
        out = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=20)
    except Exception as e:
        return [f"nvidia-smi topo -m: {_why(e)}"]
    text = (out.stdout or out.stderr).rstrip()
    return ["nvidia-smi topo -m:"] + ["  " + line for line in text.splitlines()]


def env_report() -> str:
    """``kosmos env``: the lines of a bug report's environment section."""
    lines = [f"kosmos:      {module_version('kosmos')}, at {os.path.join(SOURCE_ROOT, 'kosmos')}",
             f"git commit:  {_git()}",
             f"python:      {platform.python_version()} ({platform.python_implementation()}, {sys.executable})",
             f"platform:    {platform.platform()}"]
    try:
        import torch
    except Exception as e:
        return "\n".join(lines + [f"torch:       not importable ({_why(e)})"])
    lines += [f"torch:       {torch.__version__} (CUDA {torch.version.cuda or 'none: CPU-only build'})",
              f"triton:      {module_version('triton')}",
              f"NCCL:        {_nccl(torch)}",
              f"driver:      {_driver() or 'unknown (nvidia-smi not found or failed)'}"]
    lines += _gpu_lines(torch)
    lines += _topology()
    lines.append("optional:    " + ", ".join(f"{name} {module_version(name)}" for name in ("deep_ep", "liger_kernel", "matplotlib")))
    env = sorted(f"{k}={v}" for k, v in os.environ.items() if k.startswith(ENV_PREFIXES))
    lines.append("environment: " + (", ".join(env) if env else "nothing set of " + ", ".join(
        p if p == "CUDA_VISIBLE_DEVICES" else p + "*" for p in ENV_PREFIXES)))
    return "\n".join(lines)
