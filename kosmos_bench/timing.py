"""Collective-safe timing: same iteration count on every rank, L2 flushed and a barrier before each timed
call, CUDA events around the call, and the op's time per iteration = max over ranks. Reports the median and
the 20th/80th percentiles.

Device time, not host time: after the barrier the GPU is given ~2 ms of spinning (``torch.cuda._sleep``)
before the start event, so the host enqueues the call while the GPU is busy -- as it does in a training
step, where the host runs ahead. Without it, every Python-side cost of an op (argument checks, Triton's
launcher) would count as GPU time, because the barrier leaves the GPU idle. The spin is longer where the call's
own host time is (``hide_cycles``: HOST_HIDE_MARGIN x the median host time of the warm-up calls, the same on every
rank): the MoE backward's calls take 2.5-5 ms of host time (session 20, one H200: deepseek-v3 4k, the one launch
3.8 ms, the multi-launch path 4.9, nccl-a2a's autograd 2.5), and with the fixed 2 ms the GPU sat idle for the
part of the host time that preceded a big launch -- ~1 ms of the one launch's 21.1 ms (its kernels' span 18.9 ms
plus 1.2 ms of torch ops before it). The host's enqueue time is
measured separately and reported as ``host_ms`` (median), so it is not hidden from the reader: in the same loop,
per timed call, the CPU wall time (``time.perf_counter``) from entering the call to its return, taken between
the start and the end event's records -- no synchronisation in between, so the device timing is unchanged, and the
GPU is still spinning, so the call never waits on a full launch queue. A call that synchronises inside (a
``.item()``, a host copy) shows it there as the rest of the ~2 ms spin.

``--cuda-graph`` (``capture_graph``): one call of the implementation, after warm-up, is captured into a
``torch.cuda.CUDAGraph`` and the timing loop times ``graph.replay()`` instead of the call (same flush,
barrier, spin and events; ``host_ms`` is then the replay's enqueue time). Every replay writes the captured
call's outputs.

A ``Split`` (the MoE bench's backward) is timed in two parts: for every iteration, warm-up included, its ``setup``
(the forward) runs first, untimed, before the L2 flush and the barrier, and only ``run(state)`` is timed. Every rank
runs the same setups in the same order, so a setup may hold collectives.

``host_ms`` is NOT the per-call enqueue cost of an eager call: after each barrier the host is cold (its clock and
caches idle while it waited), and on an H200 host it reads ~100 us for kosmos and ~96 us for nccl+cublas alike.
The enqueue cost issue 13 bars (<= 30 us per eager call at W=1) is ``host_enqueue_us``'s: the median of back-to-back
calls after HOST_WARM_S of warm-up calls, with no barrier, flush or synchronisation among them (``kosmos bench tp
--host-calls``, rows of type "host").
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

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


# ~2 ms at H100/H200 clocks: more than the TP implementations' measured enqueue time (kosmos 0.2-0.5 ms,
# torch async-TP up to 0.84 ms on 2x H200); a call whose warm-up host time is longer gets a longer spin
# (hide_cycles), so no implementation's host time leaks into its GPU time
HOST_HIDE_CYCLES = 4_000_000
HOST_HIDE_MARGIN = 1.5  # the spin covers this many times the call's median warm-up host time (plus 0.5 ms)
HOST_HIDE_MAX_MS = 100.0  # ... up to this: a call that slow on the host is not hidden further
_CYCLES_PER_MS = {}


def _cycles_per_ms(device) -> float:
    """``torch.cuda._sleep`` cycles per ms on ``device``: one HOST_HIDE_CYCLES spin timed by events, once per
    process (an idle GPU's clock may be low: the estimate errs towards a longer spin)."""
    rate = _CYCLES_PER_MS.get(device)
    if rate is None:
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(HOST_HIDE_CYCLES)
        end.record()
        end.synchronize()
        rate = _CYCLES_PER_MS[device] = HOST_HIDE_CYCLES / max(start.elapsed_time(end), 1e-3)
    return rate


def hide_ms(warm_host_ms: list[float]) -> float:
    """The host time a timed call's spin must cover, in ms: HOST_HIDE_MARGIN x the median of the warm-up calls'
    host times + 0.5 ms (the first call, which may compile, is left out where there are others), capped at
    HOST_HIDE_MAX_MS; 0 without warm-up calls."""
    if not warm_host_ms:
        return 0.0
    steady = warm_host_ms[1:] or warm_host_ms
    return min(HOST_HIDE_MAX_MS, HOST_HIDE_MARGIN * statistics.median(steady) + 0.5)


def hide_cycles(host_ms: float, device) -> int:
    """Spin cycles before a timed call: HOST_HIDE_CYCLES, or enough for ``host_ms`` (hide_ms) where longer."""
    return max(HOST_HIDE_CYCLES, int(host_ms * _cycles_per_ms(device))) if host_ms > 0 else HOST_HIDE_CYCLES


@dataclass
class Split:
    """A call timed in two parts: ``setup()`` (untimed) -> state, then ``run(state)`` (timed) -> the output.
    Called as a whole (``split()``: run(setup())) where nothing is timed, e.g. the correctness check."""
    setup: Callable
    run: Callable

    def __call__(self):
        return self.run(self.setup())


HOST_CALLS = 200  # back-to-back calls of one host enqueue measurement (issue 13's bar: their median)
# warm-up before them: the host's clock ramps up under load (dev/fixed_cost.py, session 15). 0.2 s left the first
# host row of a sweep high (s20c: kosmos ag_gemm bf16 median 34.9 us with p20 25.6, measured first, against gemm_rs
# bf16 24.4 / 23.4 on the same hit path right after): 1 s (the CLI's texts say so; a test keeps them in step)
HOST_WARM_S = 1.0


def host_enqueue_us(fn, calls: int = HOST_CALLS, warm_s: float = HOST_WARM_S, sync=None,
                    even_out=None) -> dict:
    """Host enqueue time of an eager call of ``fn``: ``calls`` back-to-back calls, ``time.perf_counter`` around
    each, no synchronisation inside the loop, after ``warm_s`` seconds of warm-up calls of ``fn`` and one
    ``sync()`` (default ``torch.cuda.synchronize``; another callable, e.g. a no-op, for CPU callables). ``sync()``
    again after the calls, so that their device work is done when this returns.

    Why so: after 5 warm-up calls session 15 measured 54-64 us on a hit path that a long run measured at 34-37 us
    (the host's clock ramps up under load), and the bench's in-loop ``host_ms`` (time_op) reads ~100 us because
    every timed call there follows a barrier (module docstring). The figure here is the steady state's. The
    calls are not synchronised, so once the device runs slower than the host enqueues, the launch queue fills and
    a call waits for room: the figure is then the device's rate per call, an upper bound of the host's.

    ``even_out(n)``: this rank's warm-up call count -> the count every rank must reach (the max over ranks);
    the missing calls are made before the sync. A callable holding a collective needs it (the warm-up is timed,
    so ranks make different numbers of calls; each call must be matched on every rank).

    Returns {"host_us": median, "p20_us", "p80_us": the 20th/80th percentiles, "calls": ``calls``,
    "warmup_calls": the warm-up calls made}, times in microseconds of this process."""
    if calls < 1:
        raise ValueError(f"calls={calls}: at least one timed call")
    sync = torch.cuda.synchronize if sync is None else sync
    warm, t_end = 0, time.perf_counter() + warm_s
    while warm == 0 or time.perf_counter() < t_end:  # at least one: first-call work (compiles, plans) stays out
        fn()
        warm += 1
    if even_out is not None:
        for _ in range(int(even_out(warm)) - warm):
            fn()
            warm += 1
    sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    sync()
    q = statistics.quantiles(times, n=5) if len(times) >= 2 else times * 4
    return {"host_us": statistics.median(times), "p20_us": q[0], "p80_us": q[3], "calls": calls,
            "warmup_calls": warm}


def capture_graph(fn, warmup: int = 3):
    """``fn`` captured into a CUDA graph -> the graph's ``replay`` (the graph lives as long as the callable).
    torch's recipe: ``warmup`` calls on a side stream first (lazy initialisation, compiles, cached plans and
    workspaces all happen outside the capture), then one call captured. Every rank captures in step (a captured
    collective runs only at replay). Raises what the capture raised (the caller records it)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph.replay


def time_op(fn, *, iters: int = 20, warmup: int = 5, group=None, flush: bool = True,
            hide_host: bool = True) -> dict:
    """Median / p20 / p80 in ms of ``fn()`` over ``iters`` timed calls (max over ranks per call), and the
    median over the same timed calls of the host time inside one call (``host_ms``: from entering ``fn`` to its
    return, module docstring; max over ranks), and the spin before each timed call in ms (``hidden_ms``: hide_cycles
    of the warm-up calls' host times, module docstring). ``fn`` a ``Split``: its ``setup()`` before each call, untimed
    (before the flush and the barrier), and only ``run(state)`` timed, on the device and on the host."""
    device = torch.cuda.current_device()
    setup, call = (fn.setup, fn.run) if isinstance(fn, Split) else (None, None)
    warm_host = []
    for _ in range(warmup):
        state = setup() if setup is not None else None
        t0 = time.perf_counter()
        if setup is not None:
            call(state)
        else:
            fn()
        warm_host.append((time.perf_counter() - t0) * 1e3)
        state = None
    spin = torch.tensor([hide_ms(warm_host) if hide_host else 0.0], device="cuda")
    if dist.is_initialized():  # one spin on every rank: the ranks start each call in step
        dist.all_reduce(spin, op=dist.ReduceOp.MAX, group=group)
    spin_cycles = hide_cycles(spin.item(), device)
    barrier(group)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    host = []
    for i in range(iters):
        state = setup() if setup is not None else None  # untimed: every rank, in step, before the barrier
        if flush:
            flush_l2(device)
        barrier(group)
        if hide_host:
            torch.cuda._sleep(spin_cycles)
        starts[i].record()
        t0 = time.perf_counter()
        if setup is not None:
            call(state)
        else:
            fn()
        host.append((time.perf_counter() - t0) * 1e3)
        ends[i].record()
        state = None  # the setup's tensors (a forward's graph) go before the next one is made
    torch.cuda.synchronize()
    per_iter = torch.tensor([s.elapsed_time(e) for s, e in zip(starts, ends)] + [statistics.median(host)],
                            device="cuda")
    if dist.is_initialized():
        dist.all_reduce(per_iter, op=dist.ReduceOp.MAX, group=group)
    vals = per_iter.tolist()
    host_ms = vals.pop()
    ms = sorted(vals)
    q = statistics.quantiles(ms, n=5) if len(ms) >= 2 else [ms[0]] * 4
    return {"time_ms": statistics.median(ms), "p20_ms": q[0], "p80_ms": q[3], "samples": len(ms),
            "host_ms": host_ms, "hidden_ms": round(spin_cycles / _cycles_per_ms(device), 3) if hide_host else 0.0}
