"""Collective-safe timing: same iteration count on every rank, L2 flushed and a barrier before each timed
call, CUDA events around the call, and the op's time per iteration = max over ranks. Reports the median and
the 20th/80th percentiles."""
from __future__ import annotations

import statistics

import torch
import torch.distributed as dist

_L2_FLUSH = {}


def flush_l2(device) -> None:
    buf = _L2_FLUSH.get(device)
    if buf is None:
        # 4x the L2 of an H100/H200, read from the device so that other parts get their own size
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
        buf = _L2_FLUSH[device] = torch.empty(4 * max(l2, 1 << 20), dtype=torch.uint8, device=device)
    buf.zero_()


def barrier(group=None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)
    torch.cuda.synchronize()


def time_op(fn, *, iters: int = 20, warmup: int = 5, group=None, flush: bool = True) -> dict:
    """Median / p20 / p80 in ms of ``fn()`` over ``iters`` timed calls (max over ranks per call)."""
    device = torch.cuda.current_device()
    for _ in range(warmup):
        fn()
    barrier(group)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if flush:
            flush_l2(device)
        barrier(group)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    per_iter = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)], device="cuda")
    if dist.is_initialized():
        dist.all_reduce(per_iter, op=dist.ReduceOp.MAX, group=group)
    ms = sorted(per_iter.tolist())
    q = statistics.quantiles(ms, n=5) if len(ms) >= 2 else [ms[0]] * 4
    return {"time_ms": statistics.median(ms), "p20_ms": q[0], "p80_ms": q[3], "samples": len(ms)}
