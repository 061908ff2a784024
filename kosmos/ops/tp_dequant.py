"""The TP ops' MXFP8 dequantize-on-arrival tasks (jit pieces both TP kernels inline on their FUSED route).

The MX operand of a TP op (E4M3 payload + E8M0 scales per 32 along K) is expanded to bf16 rows by DEQ tasks: a
queue of the op outside its stage masks, in demand order (planning.plan_dequant), each task one run of DEQ_ROWS
rows (``mx_dequant_rows``) into a local bf16 buffer, then its local flag set to the epoch. A GEMM tile waits
(bounded, ``wait_rows_dequantized``) for the flags of its rows and then runs the bf16 mainloop unchanged; the
expansion is exact (every MX value is a bf16). ``deq_needed`` / ``deq_lagging`` keep the DEQ queue about one wave
of tiles ahead of the tile queue; ``deq_should_help`` lets a waiting tile run a DEQ task itself. Deadlock-free: a
DEQ task waits at most for a peer's push (AllGather+GEMM), which waits for nothing in the launch.
Tests: tests/test_all_gather_matmul.py and tests/test_matmul_reduce_scatter.py (the MX cases: W = 1, and W = 2..8
on simulated ranks), tests/test_planning.py (deq_needed covers every tile). Design and the parked alternatives
(expansion in the load path, a serial pass, TMA DEQ, 8-row tasks): docs/design/all_gather_matmul.md (MXFP8); the
format and why the expansion is exact: docs/design/quant.md; figures: docs/perf/quant.md.
"""
import triton
import triton.language as tl

from ..core import device as dev
from ..quant import mx_scale_f32

DEQ_COLS: tl.constexpr = tl.constexpr(16)  # MX blocks (of 32 elements) per step of a DEQ task's row loop


@triton.jit
def mx_dequant_rows(q_ptr, s_ptr, out_ptr, rows, K, ROWS: tl.constexpr, NB: tl.constexpr):
    """out[:rows, :K] (bf16) = the MX values of q (E4M3 [rows, K], row-major) with scales s (E8M0 [rows, K/32]);
    rows <= ROWS. Exact (kosmos/quant.py: every finite MX value below 2**128 whose lowest bit is >= 2**-133 is a
    bf16; others round to nearest even as dequantize_mx does). The scale 2**(S-127) is built from its fp32
    bits (S = 0: the subnormal 2**-127; 0xFF: NaN); the E4M3 -> fp32 conversion and the product are exact.
    Steps of [ROWS, NB, 32] elements, one scale byte loaded per MX block; the offsets inside a step are int32
    and computed once (ROWS * K fits), only the base offsets advance. The expansion is bound by instruction
    issue, not memory latency: more bytes in flight per program did not make the op faster
    (docs/design/all_gather_matmul.md, MXFP8 alternatives)."""
    KB = K // 32
    r = tl.arange(0, ROWS)
    b = tl.arange(0, NB)
    j = tl.arange(0, 32)
    soffs = r[:, None] * KB + b[None, :]
    offs = soffs[:, :, None] * 32 + j[None, None, :]
    rmask = (r < rows)[:, None]
    for b0 in range(0, KB, NB):
        smask = rmask & (b[None, :] < KB - b0)
        scale = mx_scale_f32(tl.load(s_ptr + b0 + soffs, mask=smask, other=127).to(tl.int32))
        q = tl.load(q_ptr + b0 * 32 + offs, mask=smask[:, :, None], other=0.0)
        tl.store(out_ptr + b0 * 32 + offs, (q.to(tl.float32) * scale[:, :, None]).to(tl.bfloat16),
                 mask=smask[:, :, None])


@triton.jit
def deq_needed(p, n_comp, n_chunks, n_tn, WORLD: tl.constexpr, PARTS: tl.constexpr, GROUP_M: tl.constexpr,
               RS_ORDER: tl.constexpr):
    """How many DEQ tasks (from the front of the DEQ table) the first ``p`` tiles of the compute table need.
    Both tables follow planning.py's orders: AllGather+GEMM slot by slot, each slot in GROUP_M-row bands
    (the DEQ table: slot by slot, chunks ascending); GEMM+ReduceScatter band by band, owners innermost (the
    DEQ table: chunks ascending, owners innermost). A band's tiles need all its chunks."""
    q = tl.minimum(tl.maximum(p, 1), n_comp) - 1  # the last tile counted
    if RS_ORDER:
        band = (q // WORLD) // (GROUP_M * n_tn)
        return tl.minimum(n_chunks, (band + 1) * GROUP_M) * WORLD * PARTS
    else:
        per_slot = n_chunks * n_tn
        band = (q % per_slot) // (GROUP_M * n_tn)
        return (q // per_slot) * n_chunks * PARTS + tl.minimum(n_chunks, (band + 1) * GROUP_M) * PARTS


@triton.jit
def deq_lagging(deq_head, tile_head, n_deq, n_comp, GRID: tl.constexpr, n_chunks, n_tn, WORLD: tl.constexpr,
                PARTS: tl.constexpr, GROUP_M: tl.constexpr, RS_ORDER: tl.constexpr):
    """Whether the DEQ queue is behind what the tiles claimed so far plus one more wave (GRID tiles) will
    need: then a program about to claim a tile takes a DEQ task instead. So the rows are expanded about one
    wave ahead of the tiles, by few programs at a time, while the others compute (instead of a serial pass
    over all rows before the first tile)."""
    hd = dev.load_uniform(deq_head)
    lag = 0
    if hd < n_deq:
        ht = dev.load_uniform(tile_head)
        lag = (hd < deq_needed(ht + GRID, n_comp, n_chunks, n_tn, WORLD, PARTS, GROUP_M, RS_ORDER)).to(tl.int32)
    return lag


@triton.jit
def deq_should_help(deq_head, need, flag_ptr, epoch, PARTS: tl.constexpr):
    """A tile waiting for its rows runs a DEQ task itself while its rows are not all expanded and DEQ tasks it
    needs (positions < need) are still unclaimed."""
    hd = dev.load_uniform(deq_head)
    do_help = 0
    if hd < need:
        ready = 1
        for i in tl.static_range(PARTS):
            ready = ready & (dev.load_uniform(flag_ptr + i) >= epoch).to(tl.int32)
        do_help = 1 - ready
    return do_help


@triton.jit
def wait_rows_dequantized(flag_ptr, PARTS: tl.constexpr, epoch, timeout_ns, err_ptr, OP: tl.constexpr,
                          WAIT: tl.constexpr, rank, task, index):
    """Wait (bounded) until the PARTS DEQ flags of one tile's rows, flag_ptr[0 .. PARTS), reach epoch."""
    ok = 1
    for i in tl.static_range(PARTS):
        if ok != 0:
            ok = dev.wait_geq(flag_ptr + i, epoch, timeout_ns, err_ptr, OP, WAIT, rank, task, index + i)
    return ok
