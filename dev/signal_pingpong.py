"""Signal round-trip microbenchmark (a developer probe; `dev.devcheck` runs it at W >= 2): rank 0 and rank 1 bounce a flag ``iters`` times.

Rank 0: notify(peer flag = i) then wait(own flag >= i); rank 1: wait(own flag >= i) then notify(peer flag = i).
One program per rank, the same device.notify / device.wait_geq every fused op uses; the time per iteration
is one round trip (two one-way signal latencies). Flags live in the symmetric signal buffer and are
written with ever-growing values, so repeated runs need no reset.
"""
import torch
import triton
import triton.language as tl

from kosmos.core import device as dev
from kosmos.core import runtime

PINGPONG_SLOT = 32  # between the done flags [0, 8) and the op flags (runtime.FLAG_BASE = 64): no op uses it
OP_PINGPONG = 15    # the op code its wait records (runtime.OP_NAMES has no entry: decoded as "op15")


@triton.jit(do_not_specialize=["rank", "base", "timeout_us"])
def _pingpong_kernel(peer_sig, sig_ptr, err_ptr, rank, base, iters, timeout_us, SLOT: tl.constexpr):
    timeout_ns = tl.cast(timeout_us, tl.int64) * 1000
    peer = 1 - rank
    remote = dev.peer_ptr(peer_sig, peer, tl.int32) + SLOT
    for i in range(1, iters + 1):
        # wait tag 0: a timeout is decoded as "signal SLOT"
        if rank == 0:
            dev.notify(remote, base + i)
            dev.wait_geq(sig_ptr + SLOT, base + i, timeout_ns, err_ptr, 15, 0, rank, i, SLOT)
        else:
            dev.wait_geq(sig_ptr + SLOT, base + i, timeout_ns, err_ptr, 15, 0, rank, i, SLOT)
            dev.notify(remote, base + i)


def signal_round_trip_us(iters: int = 2000, group=None) -> float:
    """Mean round-trip time in microseconds between ranks 0 and 1 (ranks >= 2 idle)."""
    ws = runtime.get_workspace(group)
    if ws.world.size < 2:
        raise ValueError("the signal round trip needs at least 2 ranks")
    ws.ensure(1 << 20, 1)
    slot = PINGPONG_SLOT
    # both ranks' slots hold the same last value (each was written by the other rank), so each starts from its
    # own: no state kept between runs, and a workspace regrown (signals zeroed) starts again from 0
    base = int(ws.signals[slot].item())
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
