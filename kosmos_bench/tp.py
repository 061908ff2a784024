"""The TP+SP benchmark (``kosmos bench tp``): for each (model, layer, seq) GEMM, check every implementation
against the fp32 reference on the same random inputs, then time them side by side in one loop
(collective-safe; the check -> agree -> time -> row steps are harness.py's, shared with ``bench moe``).

Runs inside one process per rank (launcher.spawn). Implementations (registry family "tp", one maker per name
for both ops; C = allgather(A) @ B for ag_gemm, C_shard = RS(A @ B) for gemm_rs):
  kosmos           kosmos.all_gather_matmul / matmul_reduce_scatter (policy "self"), with the op's config
                   (``--config``: AllGatherMatmulConfig for ag_gemm, MatmulReduceScatterConfig for gemm_rs).
  nccl+cublas      NCCL all_gather / reduce_scatter + cuBLAS (kosmos.reference, bf16): the baseline.
  torch-async-tp   torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter (>= 2 ranks).
  fixed-role       the KOSMOS ops with policy "fixed" at S = 16 communication programs (>= 2 ranks).
  fixed-role-best  the same at the fastest S of ``fixed_sweep`` that passes (harness.best_fixed_split).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import kosmos
from kosmos import reference, runtime
from kosmos.config import config_dict
from kosmos.models import CUSTOM, TPGemm

from . import harness, timing
from .harness import Settings, policy_kwargs, world_info
from .registry import names, register


def make_inputs(g: TPGemm, world: int, rank: int, seed: int):
    """Fresh random bf16 inputs of this rank (different on every rank, never zeros)."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank * 104729 + g.m * 31 + g.n * 17 + g.k)
    rows = g.m // world if g.op == "ag_gemm" else g.m
    a = torch.randn(rows, g.k, device="cuda", generator=gen).to(torch.bfloat16)
    b = (torch.randn(g.k, g.n, device="cuda", generator=gen) / math.sqrt(g.k)).to(torch.bfloat16)
    return a, b


@dataclass
class TPInputs:
    g: TPGemm
    a: torch.Tensor
    b: torch.Tensor


# --------------------------------------------------------------------------- implementations (registry "tp")
# each maker: (TPInputs, params, config or None) -> (callable returning this rank's output, workspace bytes)


@register("tp", "kosmos", kosmos=True)
def _kosmos(inp: TPInputs, params: dict, config):
    kw = dict(config=config, **policy_kwargs(params))
    if inp.g.op == "ag_gemm":
        return (lambda: kosmos.all_gather_matmul(inp.a, inp.b, **kw)[1]), None
    return (lambda: kosmos.matmul_reduce_scatter(inp.a, inp.b, **kw)), None


@register("tp", "nccl+cublas", baseline=True)
def _nccl_cublas(inp: TPInputs, params: dict, config):
    a, b = inp.a, inp.b
    if inp.g.op == "ag_gemm":
        a_full = torch.empty((a.shape[0] * world_info()[1], a.shape[1]), dtype=a.dtype, device=a.device)
        return (lambda: reference.all_gather_matmul_ref(a, b, fp32=False, a_full=a_full)[1]), 0
    return (lambda: reference.matmul_reduce_scatter_ref(a, b, fp32=False)), 0


def _async_tp_available(world: int):
    if world == 1:
        return False, "torch async-TP needs a process group of >= 2 ranks"
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "fused_all_gather_matmul"):
        return False, f"torch {torch.__version__} has no torch.ops.symm_mem.fused_all_gather_matmul"
    return True, None


@register("tp", "torch-async-tp", available=_async_tp_available)
def _async_tp(inp: TPInputs, params: dict, config):
    import torch.distributed._symmetric_memory as symm_mem
    ops, a, b = torch.ops.symm_mem, inp.a, inp.b
    name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(name)
    if inp.g.op == "ag_gemm":
        return (lambda: ops.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=name)[1][0]), None
    return (lambda: ops.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0, group_name=name)), None


harness.register_fixed("tp", _kosmos)

TP_IMPLS = names("tp")  # ("kosmos", "nccl+cublas", "torch-async-tp", "fixed-role", "fixed-role-best")


@dataclass
class TPSettings(Settings):
    impls: tuple = TP_IMPLS
    trace_dir: str | None = None


def reference_output(g: TPGemm, a, b):
    if g.op == "ag_gemm":
        return reference.all_gather_matmul_ref(a, b, fp32=True)[1]
    return reference.matmul_reduce_scatter_ref(a, b, fp32=True)


def identity(g: TPGemm, world: int, dtype: str) -> dict:
    """The identity keys of a row of GEMM ``g``."""
    return {"type": "result", "bench": "tp", "op": g.op, "layer": g.layer, "model": g.model, "seq": g.seq,
            "m": g.m, "n": g.n, "k": g.k, "world": world, "dtype": dtype}


def failed_rows(g: TPGemm, world: int, st: TPSettings, reason: str) -> list[dict]:
    """The rows of a GEMM that failed as a whole (one per implementation)."""
    return [harness.failed_row(identity(g, world, st.dtype), "tp", name, reason, st.config(g.op))
            for name in st.impls]


def _baseline_parts(g: TPGemm, a, b, st: TPSettings):
    """cuBLAS GEMM alone (the local GEMM of this shape) and the NCCL collective alone, in ms."""
    world = world_info()[1]
    if g.op == "ag_gemm":
        # the gathered input's shape with random data: torch.empty memory may hold zeros, and cuBLAS on zeros
        # runs faster than on real data (13% once on an H200): the GEMM-alone time would flatter cuBLAS
        a_full = torch.randn((a.shape[0] * world, a.shape[1]), device=a.device).to(a.dtype)
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
    device = torch.device("cuda", torch.cuda.current_device())
    a, b = make_inputs(g, world, rank, st.seed)
    ref = reference_output(g, a, b)
    t_gemm, t_comm = _baseline_parts(g, a, b, st)
    runner = harness.Runner(st, device, lambda: harness.recover(device), on_row, extra=st.extra)
    config = st.config(g.op)
    results = runner.run("tp", st.impls, inputs=TPInputs(g, a, b), ref=ref, identity=identity(g, world, st.dtype),
                         flops=2.0 * g.m * g.n * g.k, config=config, t_gemm_ms=t_gemm, t_comm_ms=t_comm)
    del a, b, ref
    torch.cuda.empty_cache()
    if st.trace_dir and "kosmos" in results and results["kosmos"].status == "ok":
        _write_trace(g, st, config)
    return runner.rows


def bench_rank(rank, world, suite: dict, cases: list, out: str, trace_dir, argv, configs=None):
    """One rank of `kosmos bench tp` (launcher.spawn); rank 0 writes the env line and every row as it is ready."""
    from .environment import environment
    from .sweep import run_sweep
    st = TPSettings(impls=tuple(suite["impls"]), iters=suite["iters"], warmup=suite["warmup"],
                    fixed_sweep=tuple(suite["fixed_sweep"]), dtype=suite["dtype"], trace_dir=trace_dir,
                    configs=dict(configs or {}))
    device = torch.device("cuda", torch.cuda.current_device())
    run_sweep(out, environment(argv=argv, suite=suite, bench="tp"), rank, [TPGemm(**c) for c in cases],
              describe=describe, run_one=lambda g, write: run_case(g, st, on_row=write),
              failed_rows=lambda g, why: failed_rows(g, world, st, why), recover=lambda: harness.recover(device),
              # m, n, k too: custom shapes (model and layer "custom") may share a seq
              key=lambda r: (r["model"], r["layer"], r["seq"], r["op"], r["m"], r["n"], r["k"], r["impl"]))


def describe(g: TPGemm) -> str:
    """One line naming GEMM ``g`` (the progress bar)."""
    if g.model == CUSTOM:
        return f"custom {g.op} [{g.m}x{g.n}x{g.k}]"
    return f"{g.model} {g.layer} seq={g.seq} [{g.m}x{g.n}x{g.k}]"


def _write_trace(g: TPGemm, st: TPSettings, config):
    from kosmos.kernels.common import TRACE_EVENTS
    rank, world = world_info()
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    a, b = make_inputs(g, world, rank, st.seed)
    buf = torch.zeros((grid, TRACE_EVENTS, 4), dtype=torch.int64, device="cuda")
    timing.barrier()
    if g.op == "ag_gemm":
        kosmos.all_gather_matmul(a, b, config=config, trace=buf)
    else:
        kosmos.matmul_reduce_scatter(a, b, config=config, trace=buf)
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
               "k": g.k, "world": world, "impl": "kosmos", "config": config_dict(config),
               "kinds": {str(k): v for k, v in runtime.TRACE_KINDS.items()},
               "ranks": [{"rank": r, "events": ev} for r, ev in enumerate(gathered)]}
        what = f"{g.op}-{g.m}x{g.n}x{g.k}" if g.model == CUSTOM else f"{g.layer}-{g.seq}"  # custom: one file each
        path = f"{st.trace_dir}/trace-{g.model}-{what}-w{world}.json"
        with open(path, "w") as f:
            json.dump(doc, f)
