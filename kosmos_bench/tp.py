"""The TP+SP benchmark: for each (model, layer, seq) GEMM, check every implementation against the fp32
reference on the same random inputs, then time them side by side in one loop (collective-safe).

Runs inside one process per rank (launcher.spawn). Every rank executes the same sequence of collectives;
failures are agreed across ranks (``agree``) so one rank's exception never leaves the others waiting.
"""
from __future__ import annotations

import json
import math
import os
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import kosmos
from kosmos import reference, runtime
from kosmos.models import TPGemm

from . import timing

TP_IMPLS = ("kosmos", "nccl+cublas", "torch-async-tp", "fixed-role", "fixed-role-best")
DEFAULT_FIXED_PROGRAMS = 16
FIXED_SWEEP = (8, 16, 24, 32, 48, 64)
TOLERANCE = {"bf16": 1e-2, "mxfp8": 5e-2}


@dataclass
class TPSettings:
    impls: tuple = TP_IMPLS
    iters: int = 20
    warmup: int = 5
    fixed_sweep: tuple = FIXED_SWEEP
    fixed_default: int = DEFAULT_FIXED_PROGRAMS
    dtype: str = "bf16"
    trace_dir: str | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)


def world_info():
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def error_reason(e: BaseException) -> str:
    """One line of at most 300 characters saying what went wrong (a row's ``reason``)."""
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def agree(ok: bool, reason: str | None) -> tuple[bool, str | None]:
    """All ranks learn whether every rank succeeded, and the first failing rank's reason."""
    if not dist.is_initialized():
        return ok, reason
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, (ok, reason))
    for r, (o, why) in enumerate(got):
        if not o:
            return False, f"rank {r}: {why}"
    return True, None


def make_inputs(g: TPGemm, world: int, rank: int, seed: int):
    """Fresh random bf16 inputs of this rank (different on every rank, never zeros)."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank * 104729 + g.m * 31 + g.n * 17 + g.k)
    rows = g.m // world if g.op == "ag_gemm" else g.m
    a = torch.randn(rows, g.k, device="cuda", generator=gen).to(torch.bfloat16)
    b = (torch.randn(g.k, g.n, device="cuda", generator=gen) / math.sqrt(g.k)).to(torch.bfloat16)
    return a, b


def impl_callable(name: str, g: TPGemm, a, b, params: dict):
    """A zero-argument callable running implementation ``name`` on this rank; returns the rank's output."""
    ag = g.op == "ag_gemm"
    if name == "kosmos":
        return (lambda: kosmos.all_gather_matmul(a, b)[1]) if ag else (lambda: kosmos.matmul_reduce_scatter(a, b))
    if name in ("fixed-role", "fixed-role-best"):
        s = params["comm_programs"]
        if ag:
            return lambda: kosmos.all_gather_matmul(a, b, policy="fixed", comm_programs=s)[1]
        return lambda: kosmos.matmul_reduce_scatter(a, b, policy="fixed", comm_programs=s)
    if name == "nccl+cublas":
        if ag:
            a_full = torch.empty((a.shape[0] * world_info()[1], a.shape[1]), dtype=a.dtype, device=a.device)
            return lambda: reference.all_gather_matmul_ref(a, b, fp32=False, a_full=a_full)[1]
        return lambda: reference.matmul_reduce_scatter_ref(a, b, fp32=False)
    if name == "torch-async-tp":
        return _async_tp_callable(g, a, b)
    raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(TP_IMPLS)}")


class Unavailable(Exception):
    pass


def _async_tp_callable(g: TPGemm, a, b):
    if not dist.is_initialized() or dist.get_world_size() == 1:
        raise Unavailable("torch async-TP needs a process group of >= 2 ranks")
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "fused_all_gather_matmul"):
        raise Unavailable(f"torch {torch.__version__} has no torch.ops.symm_mem.fused_all_gather_matmul")
    import torch.distributed._symmetric_memory as symm_mem
    name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(name)
    if g.op == "ag_gemm":
        return lambda: ops.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=name)[1][0]
    return lambda: ops.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0, group_name=name)


def reference_output(g: TPGemm, a, b):
    if g.op == "ag_gemm":
        return reference.all_gather_matmul_ref(a, b, fp32=True)[1]
    return reference.matmul_reduce_scatter_ref(a, b, fp32=True)


def _max_over_ranks(x: float, device="cuda") -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def check_and_time(make, compare, st, device, recover, quiet=()):
    """(status, reason, rel_err, timing dict or None, extra) of one implementation, for every bench: ``make()``
    -> (callable, extra), ``compare(out)`` -> relative error against the reference; a failure on any rank
    fails the implementation on every rank (``recover()`` then realigns them) and the sweep goes on.
    Exceptions of the ``quiet`` types are recorded without a traceback. Every rank calls this in step."""
    extra = None
    try:
        fn, extra = make()
        out = fn()
        runtime.check_errors()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        err = compare(out)
        del out
        ok, why = True, None
    except Unavailable as e:
        ok, why, err = False, "unavailable: " + str(e), None
    except Exception as e:  # recorded as failed, the sweep goes on
        ok, why, err = False, error_reason(e), None
        if not isinstance(e, quiet):
            traceback.print_exc()
    ok, why = agree(ok, why)
    if not ok:
        recover()
        status = "unavailable" if why and "unavailable: " in why else "failed"
        return status, why.replace("unavailable: ", ""), None, None, extra
    err = _max_over_ranks(err, device)
    tol = TOLERANCE[st.dtype]
    if not err <= tol:  # NaN fails too
        return "failed", f"rel_err {err:.2e} > {tol:.0e}", err, None, extra
    try:
        t = timing.time_op(fn, iters=st.iters, warmup=st.warmup)
        runtime.check_errors()
        ok, why = True, None
    except Exception as e:
        ok, why, t = False, error_reason(e), None
        traceback.print_exc()
    ok, why = agree(ok, why)
    if not ok:
        recover()
        return "failed", why, err, None, extra
    return "ok", None, err, t, extra


def _check_and_time(name, g, a, b, ref, params, st: TPSettings):
    """(status, reason, rel_err, timing dict or None) for one TP implementation."""
    status, why, err, t, _ = check_and_time(lambda: (impl_callable(name, g, a, b, params), None),
                                            lambda out: reference.rel_err(out, ref), st, torch.device("cuda"),
                                            _recover)
    return status, why, err, t


def _recover():
    """After a failure: drop the (possibly poisoned) workspace on every rank and realign the ranks."""
    torch.cuda.synchronize()
    kosmos.reset_workspaces()
    if dist.is_initialized():
        dist.barrier()


def _baseline_parts(g: TPGemm, a, b, st: TPSettings):
    """cuBLAS GEMM alone (the local GEMM of this shape) and the NCCL collective alone, in ms."""
    world = world_info()[1]
    if g.op == "ag_gemm":
        a_full = torch.empty((a.shape[0] * world, a.shape[1]), dtype=a.dtype, device=a.device)
        gemm = lambda: a_full @ b  # noqa: E731
        comm = (lambda: dist.all_gather_into_tensor(a_full, a)) if world > 1 else None
    else:
        partial = a @ b
        out = torch.empty((a.shape[0] // world, b.shape[1]), dtype=a.dtype, device=a.device)
        gemm = lambda: a @ b  # noqa: E731
        comm = (lambda: dist.reduce_scatter_tensor(out, partial)) if world > 1 else None
    t_gemm = timing.time_op(gemm, iters=st.iters, warmup=st.warmup)["time_ms"]
    t_comm = timing.time_op(comm, iters=st.iters, warmup=st.warmup)["time_ms"] if comm else 0.0
    return t_gemm, t_comm


def run_case(g: TPGemm, st: TPSettings, on_row=None) -> list[dict]:
    """Check and time every implementation of ``st.impls`` on GEMM ``g``; returns the result rows (all
    ranks return the same rows). ``on_row(row)`` is called as each row is ready."""
    rank, world = world_info()
    torch.backends.cuda.matmul.allow_tf32 = False
    a, b = make_inputs(g, world, rank, st.seed)
    ref = reference_output(g, a, b)
    t_gemm, t_comm = _baseline_parts(g, a, b, st)
    rows = []

    def emit(name, status, reason, err, t, params):
        tm = t["time_ms"] if t else None
        row = {
            "type": "result", "bench": "tp", "op": g.op, "layer": g.layer, "model": g.model, "seq": g.seq,
            "m": g.m, "n": g.n, "k": g.k, "world": world, "dtype": st.dtype, "impl": name, "status": status,
            "reason": reason, "time_ms": tm, "p20_ms": t["p20_ms"] if t else None,
            "p80_ms": t["p80_ms"] if t else None,
            "tflops": (2.0 * g.m * g.n * g.k / (tm * 1e-3) / 1e12) if tm else None,
            "rel_err": err, "t_gemm_ms": t_gemm, "t_comm_ms": t_comm, "host_ms": t["host_ms"] if t else None,
            "workspace_bytes": kosmos.workspace_bytes() if name in ("kosmos", "fixed-role", "fixed-role-best")
            and status == "ok" else (0 if name == "nccl+cublas" else None),
            "peak_mem_bytes": torch.cuda.max_memory_allocated(), "params": params, "extra": dict(st.extra),
        }
        rows.append(row)
        if on_row:
            on_row(row)

    grid = torch.cuda.get_device_properties(0).multi_processor_count
    for name in st.impls:
        torch.cuda.reset_peak_memory_stats()
        if name == "fixed-role-best":
            best = None
            for s in st.fixed_sweep:
                if not 1 <= s < grid:
                    continue
                res = _check_and_time(name, g, a, b, ref, {"comm_programs": s}, st)
                if res[0] == "ok" and (best is None or res[3]["time_ms"] < best[1][3]["time_ms"]):
                    best = (s, res)
            if best is None:
                emit(name, "failed", "no fixed split passed", None, None, {"sweep": list(st.fixed_sweep)})
            else:
                s, (status, reason, err, t) = best
                emit(name, status, reason, err, t, {"comm_programs": s, "sweep": list(st.fixed_sweep)})
            continue
        params = {"comm_programs": st.fixed_default} if name == "fixed-role" else {}
        if world == 1 and name in ("fixed-role", "fixed-role-best"):
            emit(name, "unavailable", "no communication at world size 1", None, None, params)
            continue
        status, reason, err, t = _check_and_time(name, g, a, b, ref, params, st)
        emit(name, status, reason, err, t, params)
        if name == "kosmos" and status == "ok" and st.trace_dir:
            _write_trace(g, st)
    del a, b, ref
    torch.cuda.empty_cache()
    return rows


def _write_trace(g: TPGemm, st: TPSettings):
    from kosmos.kernels.common import TRACE_EVENTS
    rank, world = world_info()
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    a, b = make_inputs(g, world, rank, st.seed)
    buf = torch.zeros((grid, TRACE_EVENTS, 4), dtype=torch.int64, device="cuda")
    timing.barrier()
    if g.op == "ag_gemm":
        kosmos.all_gather_matmul(a, b, trace=buf)
    else:
        kosmos.matmul_reduce_scatter(a, b, trace=buf)
    runtime.check_errors()
    events = []
    host = buf.cpu()
    for p in range(grid):
        for e in host[p]:
            if int(e[3]) > 0:
                events.append([p, int(e[0]), int(e[1]), int(e[2]), int(e[3])])
    gathered = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, events)
    else:
        gathered = [events]
    if rank == 0:
        os.makedirs(st.trace_dir, exist_ok=True)
        doc = {"type": "trace", "op": g.op, "model": g.model, "layer": g.layer, "seq": g.seq, "m": g.m, "n": g.n,
               "k": g.k, "world": world, "impl": "kosmos",
               "kinds": {str(k): v for k, v in runtime.TRACE_KINDS.items()},
               "ranks": [{"rank": r, "events": ev} for r, ev in enumerate(gathered)]}
        path = f"{st.trace_dir}/trace-{g.model}-{g.layer}-{g.seq}-w{world}.json"
        with open(path, "w") as f:
            json.dump(doc, f)


SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # holds kosmos/ and kosmos_bench/


def source_sha(root: str = SOURCE_ROOT) -> str:
    """sha1 over the paths and bytes of every .py file under kosmos/ and kosmos_bench/: names the code that
    ran even where git cannot (a copied tree, uncommitted edits). `python -m kosmos_bench.tp --source-sha`
    prints it for the tree it is run from, e.g. a `git worktree` of a commit."""
    import hashlib
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


def environment(argv=None, suite=None, bench="tp") -> dict:
    """The env record written first in every results file."""
    import datetime
    import platform
    import subprocess

    import triton

    def git_commit():
        """The source tree's commit (KOSMOS_GIT_COMMIT wins: a copied tree may have no .git)."""
        sha = os.environ.get("KOSMOS_GIT_COMMIT")
        if not sha:
            try:
                sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                                     cwd=SOURCE_ROOT).stdout.strip()
            except Exception:
                sha = None
        return sha if sha and len(sha) == 40 and all(c in "0123456789abcdef" for c in sha) else None

    def git_dirty():
        """True when kosmos/ or kosmos_bench/ differ from the commit; None without git, or when
        KOSMOS_GIT_COMMIT names the commit (a copied tree's .git may be stale: source_sha then says which
        code ran)."""
        if os.environ.get("KOSMOS_GIT_COMMIT"):
            return None
        try:
            out = subprocess.run(["git", "status", "--porcelain", "--", "kosmos", "kosmos_bench"],
                                 capture_output=True, text=True, timeout=5, cwd=SOURCE_ROOT)
            return bool(out.stdout.strip()) if out.returncode == 0 else None
        except Exception:
            return None

    driver = None
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.split("\n")[0].strip() or None
    except Exception:
        pass
    return {
        "type": "env", "run_id": f"{time.strftime('%Y%m%dT%H%M%S')}-{platform.node()}",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpu_count": world_info()[1], "sm_count": torch.cuda.get_device_properties(0).multi_processor_count
        if torch.cuda.is_available() else None, "driver": driver, "cuda": torch.version.cuda,
        "torch": torch.__version__, "triton": triton.__version__, "kosmos": kosmos.__version__,
        "git_commit": git_commit(), "git_dirty": git_dirty(), "source_sha": source_sha(),
        "hostname": platform.node(), "argv": list(argv or []), "suite": suite,
        "bench": bench,
        # developer knobs (NOTES.md) in effect, so that a run under an override says so
        "knobs": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KOSMOS_") and k != "KOSMOS_GIT_COMMIT"},
    }


if __name__ == "__main__":
    import sys
    if sys.argv[1:] == ["--source-sha"]:
        print(source_sha())
    else:
        sys.exit("usage: python -m kosmos_bench.tp --source-sha")
