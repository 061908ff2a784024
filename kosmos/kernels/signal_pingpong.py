"""Signal round-trip microbenchmark: rank 0 and rank 1 bounce a flag ``iters`` times.

Rank 0: notify(peer flag = i) then wait(own flag >= i); rank 1: wait(own flag >= i) then notify(peer flag = i).
One program per rank, the same device.notify / device.wait_geq every fused op uses; the time per iteration
is one round trip (two one-way signal latencies). Flags live in the symmetric signal buffer and are
written with ever-growing values, so repeated runs need no reset.
"""
import torch
import triton
import triton.language as tl

from .. import device as dev
from .. import runtime


@triton.jit(do_not_specialize=["rank", "base", "timeout_us"])
def _pingpong_kernel(peer_sig, sig_ptr, err_ptr, rank, base, iters, timeout_us, SLOT: tl.constexpr):
    timeout_ns = tl.cast(timeout_us, tl.int64) * 1000
    peer = 1 - rank
    remote = dev.peer_ptr(peer_sig, peer, tl.int32) + SLOT
    for i in range(1, iters + 1):
        if rank == 0:
            tl.atomic_xchg(remote, base + i, sem="release", scope="sys")
            dev.wait_geq(sig_ptr + SLOT, base + i, timeout_ns, err_ptr, 3, rank, i, SLOT)
        else:
            dev.wait_geq(sig_ptr + SLOT, base + i, timeout_ns, err_ptr, 3, rank, i, SLOT)
            tl.atomic_xchg(remote, base + i, sem="release", scope="sys")


def signal_round_trip_us(iters: int = 2000, group=None) -> float:
    """Mean round-trip time in microseconds between ranks 0 and 1 (ranks >= 2 idle)."""
    ws = runtime.get_workspace(group)
    if ws.world.size < 2:
        raise ValueError("the signal round trip needs at least 2 ranks")
    ws.ensure(1 << 20, 1)
    slot = runtime.PINGPONG_SLOT  # a slot no op uses; values only grow across runs
    base = ws.pingpong_count
    ws.pingpong_count += iters
    r = ws.world.rank
    if r > 1:
        return float("nan")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    _pingpong_kernel[(1,)](ws.peer_signals, ws.signals, ws.errors, r, base, iters, max(1, ws.timeout_ns() // 1000), SLOT=slot,
                           num_warps=1)
    end.record()
    ws.after_launch()
    ws.check_errors()
    return start.elapsed_time(end) * 1e3 / iters
