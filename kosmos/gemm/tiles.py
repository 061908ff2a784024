"""Tile-level GEMM pieces every fused kernel inlines (jit functions only, no kernel of their own).

* ``tile_matmul`` / ``tile_matmul_steps`` / ``tile_matmul_tail`` / ``tile_matmul_cyclic``: one output tile's fp32
  accumulator from TMA descriptor loads of A [rows, K] and B ([K, N], or [N, K] k-major), over all of K, a K step
  range, a tile with extra tail columns, or a cyclic range of K steps (stream-K).
* ``tile_matmul_scaled_steps`` / ``tile_matmul_scaled_cyclic``: the same over E4M3 operands with block scales
  (fp8-block: one fp32 scale per 1x128 of A and per 128x128 of B, each 128-element K step promoted into the
  accumulator times its scales).
* ``_grouped_tile``: tile t's (m, n) in the grouped order (GROUP_M m-tiles share each n-tile, for L2).
* ``load_task``: fields 0..2 of a row of an int32 [n, 4] task table (core/planning.py).
* ``store_tile`` / ``store_tile_tma`` / ``store_rows`` / ``store_block``: the epilogue stores (TMA where the tile
  is whole, masked pointer stores at ragged edges).
* ``copy_flat``: a flat element copy (the row pushes of the communication tasks).

``tile_matmul`` (and the tail tile) compute each output element as one fp32 dot over K in K-step order, so a tile's
bits do not depend on which program computes it or when. Under TRITON_INTERPRET=1 the dots run in fp32 (DOT_FP32),
as Triton's interpreter gets bf16 dots wrong. Tests: through the ops (tests/test_all_gather_matmul.py,
tests/test_matmul_reduce_scatter.py: the static GEMM's schedules bitwise against the self-scheduled kernel).
Design: docs/design/gemm.md; figures: docs/perf/all_gather_matmul.md."""
import triton
import triton.language as tl


@triton.jit
def tile_matmul(a_desc, b_desc, row, col, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc[BM, BN] = A[row:row+BM, :K] @ B[:K, col:col+BN] in fp32 (TMA loads; OOB rows/cols read as 0).
    B_KMAJOR: B is stored [N, K] (a transposed weight view) instead of [K, N]."""
    return tile_matmul_steps(a_desc, b_desc, row, col, 0, tl.cdiv(K, BK), BM, BN, BK, B_KMAJOR, DOT_FP32)


@triton.jit
def tile_matmul_steps(a_desc, b_desc, row, col, step_lo, step_hi, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """tile_matmul over K steps [step_lo, step_hi) only (columns step_lo*BK .. step_hi*BK of A): one part of a
    K split."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(step_lo, step_hi):
        acc = _k_step(a_desc, b_desc, row, col, kk, acc, BK, B_KMAJOR, DOT_FP32)
    return acc


@triton.jit
def _k_step(a_desc, b_desc, row, col, kk, acc, BK: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + A[row:, kk*BK:+BK] @ B[kk*BK:+BK, col:] (TMA loads), one step of the GEMM mainloops."""
    a = a_desc.load([row, kk * BK])
    if B_KMAJOR:
        b = b_desc.load([col, kk * BK]).T
    else:
        b = b_desc.load([kk * BK, col])
    if DOT_FP32:  # the CPU interpreter's bf16 dot is wrong; fp32 is exact
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def _k_step_scaled(a_desc, b_desc, row, col, kk, acc, sa_ptr, sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk, M, N,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr):
    """One K step of a block-scaled FP8 GEMM (BK = 128, one scale block): the step's product of the E4M3 tiles
    A[row:, kk*BK:+BK] and B (k-major [N, K], as FP8 tensor cores take it) in a fresh fp32 accumulator, promoted
    into ``acc`` times A's row scales sa[rows, kk] and B's block scales sb[cols // 128, kk] (DeepSeek-V3's
    per-128 promotion: the tensor core's partial sum never spans two scale blocks). Rows / columns past M / N
    read scale 0. With power-of-two scales the product of the scales and its product with the partial are exact,
    so only the tensor core's sum and the fp32 add round."""
    a = a_desc.load([row, kk * BK])
    b = b_desc.load([col, kk * BK]).T
    if DOT_FP32:  # the interpreter: fp32 dots on the E4M3 values (exact conversions)
        part = tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        part = tl.dot(a, b)
    rows = row + tl.arange(0, BM)
    cols = col + tl.arange(0, BN)
    sa = tl.load(sa_ptr + rows.to(tl.int64) * sa_sm + kk * sa_sk, mask=rows < M, other=0.0)
    sb = tl.load(sb_ptr + (cols // 128).to(tl.int64) * sb_sn + kk * sb_sk, mask=cols < N, other=0.0)
    return acc + part * (sa[:, None] * sb[None, :])


@triton.jit
def tile_matmul_scaled_steps(a_desc, b_desc, row, col, step_lo, step_hi, sa_ptr, sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk,
                             M, N, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr):
    """tile_matmul_steps of a block-scaled FP8 GEMM (_k_step_scaled's steps [step_lo, step_hi))."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(step_lo, step_hi):
        acc = _k_step_scaled(a_desc, b_desc, row, col, kk, acc, sa_ptr, sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk, M, N,
                             BM, BN, BK, DOT_FP32)
    return acc


@triton.jit
def tile_matmul_scaled_cyclic(a_desc, b_desc, row, col, first, count, k_steps, sa_ptr, sb_ptr, sa_sm, sa_sk, sb_sn,
                              sb_sk, M, N, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                              DOT_FP32: tl.constexpr):
    """tile_matmul_cyclic of a block-scaled FP8 GEMM (stream-K pieces)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(0, count):
        kk = first + j
        kk = tl.where(kk >= k_steps, kk - k_steps, kk)
        acc = _k_step_scaled(a_desc, b_desc, row, col, kk, acc, sa_ptr, sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk, M, N,
                             BM, BN, BK, DOT_FP32)
    return acc


@triton.jit
def tile_matmul_tail(a_desc, b_desc, b2_desc, row, col, K, BM: tl.constexpr, BN: tl.constexpr, BN_TAIL: tl.constexpr,
                     BK: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr, STAGES: tl.constexpr):
    """tile_matmul of a tile BN + BN_TAIL columns wide, as two accumulators: acc[BM, BN] of columns
    [col, col + BN) and acc2[BM, BN_TAIL] of [col + BN, col + BN + BN_TAIL), the tail's B through its own
    descriptor (b2_desc, blocks of BN_TAIL columns). Triton's blocks are powers of two; two MMAs per K step on
    the same A tile make a 192- or 160-wide tile."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN_TAIL), dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
        # dev/archive/tail_probe's statement order (load A; load B, MMA; load B2, MMA): its own barrier per B2 load
        a = a_desc.load([row, kk * BK])  # one A tile for both MMAs
        if DOT_FP32:  # the CPU interpreter's bf16 dot is wrong; fp32 is exact
            a = a.to(tl.float32)
        if B_KMAJOR:
            b = b_desc.load([col, kk * BK]).T
        else:
            b = b_desc.load([kk * BK, col])
        if DOT_FP32:
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if B_KMAJOR:
            b2 = b2_desc.load([col + BN, kk * BK]).T
        else:
            b2 = b2_desc.load([kk * BK, col + BN])
        if DOT_FP32:
            b2 = b2.to(tl.float32)
        acc2 = tl.dot(a, b2, acc2)
    return acc, acc2


@triton.jit
def tile_matmul_cyclic(a_desc, b_desc, row, col, first, count, k_steps, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """tile_matmul over ``count`` <= k_steps K steps first, first + 1, ... taken modulo k_steps (a stream-K
    piece: its steps may wrap around the tile's end)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(0, count):
        kk = first + j
        kk = tl.where(kk >= k_steps, kk - k_steps, kk)
        acc = _k_step(a_desc, b_desc, row, col, kk, acc, BK, B_KMAJOR, DOT_FP32)
    return acc


@triton.jit
def _grouped_tile(t, n_m, n_n, GROUP_M: tl.constexpr):
    """Tile t's (m, n) in planning._grouped's order (GROUP_M m-tiles share each n-tile, for L2)."""
    per_group = GROUP_M * n_n
    first_m = (t // per_group) * GROUP_M
    size = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (t % per_group) % size, (t % per_group) // size


@triton.jit
def load_task(table, t):
    """Fields 0..2 of row t of an int32 [n, 4] task table (planning.py)."""
    return tl.load(table + t * 4), tl.load(table + t * 4 + 1), tl.load(table + t * 4 + 2)


@triton.jit
def store_tile(c_desc, c_ptr, acc, row, col, rows_valid, N, BM: tl.constexpr, BN: tl.constexpr):
    """Store acc (fp32) as bf16 at C[row:row+rows_valid, col:col+BN]: TMA (two half-width stores) for a full
    tile, masked pointer stores when the tile ends inside the rows (a shard boundary)."""
    if rows_valid >= BM:
        store_tile_tma(c_desc, acc, row, col, BM, BN)
    else:
        store_rows(c_ptr, acc.to(tl.bfloat16), row, col, rows_valid, N, BM, BN)


@triton.jit
def store_tile_tma(c_desc, acc, row, col, BM: tl.constexpr, BN: tl.constexpr):
    """acc (fp32) as bf16 at C[row:row+BM, col:col+BN] by two half-width TMA stores (rows and columns past C's
    end are clipped by the descriptor)."""
    acc3 = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
    lo, hi = tl.split(acc3)
    c_desc.store([row, col], lo.to(tl.bfloat16))
    c_desc.store([row, col + BN // 2], hi.to(tl.bfloat16))


@triton.jit
def store_rows(ptr, val, row, col, rows_valid, N, BM: tl.constexpr, BN: tl.constexpr):
    """Masked pointer store of val[BM, BN] at ptr[row + i, col + j] for i < rows_valid, col + j < N. The
    tile's start is one int64 scalar and the offsets inside it int32 (a tile spans far fewer than 2**31
    elements), so no per-element 64-bit index is ever formed."""
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    base = ptr + (tl.cast(row, tl.int64) * N + col)
    mask = (offs_m[:, None] < rows_valid) & (offs_n[None, :] < N - col)
    tl.store(base + (offs_m[:, None] * N + offs_n[None, :]), val, mask=mask)


@triton.jit
def store_block(ptr, val, row, col, rows_valid, cols_valid, N, BM: tl.constexpr, BN: tl.constexpr):
    """store_rows with its own column bound: val[BM, BN] at ptr[row + i, col + j] (row stride N) for
    i < rows_valid, j < cols_valid -- a tile that is one of several column blocks of a row (gate | up)."""
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    base = ptr + (tl.cast(row, tl.int64) * N + col)
    mask = (offs_m[:, None] < rows_valid) & (offs_n[None, :] < cols_valid)
    tl.store(base + (offs_m[:, None] * N + offs_n[None, :]), val, mask=mask)


@triton.jit
def copy_flat(src_ptr, dst_ptr, n_elems, BLOCK: tl.constexpr):
    """dst[:n_elems] = src[:n_elems] for contiguous buffers (whole rows of a row-major matrix are one
    contiguous run), BLOCK elements at a time: fully coalesced 16-byte accesses. One program's rate grows
    with the bytes in flight per step (hence AllGatherMatmulConfig.copy_block's default of 16384). Advancing
    pointers with int32 offsets was no faster and took more registers in the AllGather+GEMM kernel, so the
    indices stay int64 (docs/design/all_gather_matmul.md)."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, n_elems, BLOCK):
        idx = tl.cast(start, tl.int64) + offs
        mask = idx < n_elems
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=mask), mask=mask)
