"""The env record written first in every results file (SCHEMA.md): GPU, versions, the code that ran.

``source_sha()`` names that code even where git cannot (a copied tree, uncommitted edits):

    python -m kosmos_bench.environment --source-sha    # the value for the tree it is run from

(before this module existed: ``python -m kosmos_bench.tp --source-sha``; same value for the same files).
"""
from __future__ import annotations

import hashlib
import os
import subprocess

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds kosmos/ and kosmos_bench/


def source_sha(root: str = SOURCE_ROOT) -> str:
    """sha1 over the paths and bytes of every .py file under kosmos/ and kosmos_bench/: names the code that
    ran even where git cannot (a copied tree, uncommitted edits). `python -m kosmos_bench.environment
    --source-sha` prints it for the tree it is run from, e.g. a `git worktree` of a commit."""
    h = hashlib.sha1()
    for pkg in ("kosmos", "kosmos_bench"):
        for dirpath, dirnames, files in sorted(os.walk(os.path.join(root, pkg))):
            dirnames.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(f.read() + b"\0")
    return h.hexdigest()


def in_checkout() -> bool:
    """Whether the sources are a git checkout of their own (a ``.git`` folder, or a worktree's ``.git`` file, beside
    kosmos/). An installed package is not, even inside some other repository: git there would name that
    repository's commit."""
    return os.path.exists(os.path.join(SOURCE_ROOT, ".git"))


def git_commit() -> str | None:
    """The source tree's commit (KOSMOS_GIT_COMMIT wins: a copied tree may have no .git); None outside a
    checkout of its own."""
    sha = os.environ.get("KOSMOS_GIT_COMMIT")
    if not sha and in_checkout():
        try:
            sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                 cwd=SOURCE_ROOT).stdout.strip()
        except Exception:
            sha = None
    return sha if sha and len(sha) == 40 and all(c in "0123456789abcdef" for c in sha) else None


def git_dirty() -> bool | None:
    """True when kosmos/ or kosmos_bench/ differ from the commit; None without git, or when KOSMOS_GIT_COMMIT
    names the commit (a copied tree's .git may be stale: source_sha then says which code ran)."""
    if os.environ.get("KOSMOS_GIT_COMMIT") or not in_checkout():
        return None
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--", "kosmos", "kosmos_bench"],
                             capture_output=True, text=True, timeout=5, cwd=SOURCE_ROOT)
        return bool(out.stdout.strip()) if out.returncode == 0 else None
    except Exception:
        return None


def _driver() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip() or None
    except Exception:
        return None


def environment(argv=None, suite=None, bench="tp") -> dict:
    """The env record written first in every results file (keys: SCHEMA.md)."""
    import datetime
    import platform
    import time

    import torch
    import triton

    import kosmos

    from .harness import world_info

    cuda = torch.cuda.is_available()
    return {
        "type": "env", "run_id": f"{time.strftime('%Y%m%dT%H%M%S')}-{platform.node()}",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if cuda else None, "gpu_count": _gpus_used(),
        "sm_count": torch.cuda.get_device_properties(0).multi_processor_count if cuda else None,
        "driver": _driver(), "cuda": torch.version.cuda, "torch": torch.__version__, "triton": triton.__version__,
        "kosmos": kosmos.__version__, "git_commit": git_commit(), "git_dirty": git_dirty(),
        "source_sha": source_sha(), "hostname": platform.node(), "argv": list(argv or []), "suite": suite,
        "bench": bench,
    }


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--source-sha"]:
        print(source_sha())
    else:
        sys.exit("usage: python -m kosmos_bench.environment --source-sha")


def _gpus_used() -> int:
    """The GPUs the run's ranks use: one per rank, or one for all with KOSMOS_RANKS_ON_ONE_GPU (the header said
    2 for two ranks sharing one GPU until session 15: results/h200x1/train-*-w2-onegpu.jsonl)."""
    from .harness import world_info
    from .launcher import ranks_on_one_gpu
    return 1 if ranks_on_one_gpu() else world_info()[1]
