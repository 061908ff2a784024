"""Jit tile functions shared by the backward's standalone kernels (multi_launch.py, rows.py) and the one launch's
tasks (one_launch.py), so that both compute every tile with the same code and the same bits, and their GPU tiles:

* ``_wgrad_step`` / ``_wgrad_flat_run`` / ``_wgrad_flat_loop``: the weight gradient's fp32 row steps and the flat
  loop over a program's tiles (padded layout), with the optional claimed runs (``DYNAMIC``);
* ``_dgrad1_tile``: rows [R, K] @ W[e]^T (or @ W[e], ``B_KN``) for one (m-tile, N-tile) -- both data gradients and
  the W > 1 launch's GU recompute; ``_mtile_rows`` / ``_mtile_expert`` / ``_n_mtiles``: the m-tile numbering;
* ``_swiglu_backward_values`` / ``_rows`` / ``_cols``: the SwiGLU backward (sigmoid as torch's CUDA kernel computes
  it, ``_torch_sigmoid``); ``_unpermute_sum_cols``: a token's k rows summed in slot order in fp32;
* ``_to_out``: fp32 -> bf16 rounded to nearest even, on the interpreter too (whose cast truncates);
* ``DGRAD1_TILES``, ``WGRAD_FLAT_TILES*`` (``wgrad_flat_tiles``) and ``_bwd_tiles`` (the one launch's).
Every function's result depends only on its inputs and fixed orders, never on the program that runs it. The
tiles' measurements: docs/design/moe_backward.md and docs/perf/moe_backward.md."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core import device as dev
from ...core import planning

try:  # libdevice's expf (Triton >= 3.0 spells it this way)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice


@triton.jit
def _to_out(acc, out_ty: tl.constexpr, RNE_BITS: tl.constexpr):
    """acc (fp32) in out_ty, rounded to nearest even. RNE_BITS (the CPU interpreter, whose fp32 -> bf16 cast
    truncates): the rounding done on the bits, so the interpreter's bf16 equals torch's .to(torch.bfloat16) as
    the GPU's cvt.rn.bf16.f32 does (finite values)."""
    if out_ty == tl.bfloat16 and RNE_BITS:
        bits = acc.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    else:
        return acc.to(out_ty)


@triton.jit
def _wgrad_step(a_desc, b_desc, r, ti, tj, acc, BI: tl.constexpr, BJ: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + A[r:r+BR, ti-tile]^T B[r:r+BR, tj-tile] (fp32): one row step of every TMA wgrad kernel."""
    a = a_desc.load([r, ti * BI])
    b = b_desc.load([r, tj * BJ])
    if DOT_FP32:  # the CPU interpreter's bf16 dot is wrong; fp32 is exact
        return tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc)
    return tl.dot(tl.trans(a), b, acc)


# the flat wgrad's GPU tiles (BI, BJ, BR, warps, stages[, programs per SM]); every variant tried gives the same dW
# bits (docs/design/moe_backward.md)
WGRAD_FLAT_TILES = (128, 256, 64, 8, 3)  # 208 KiB of shared (the host's estimate) with a bf16 output: one per SM
WGRAD_FLAT_TILES_FP32 = (128, 128, 64, 8, 2)  # fp32 output: 128x256 would need 272 KiB

# The 256-wide side of the tile on the shorter of dW's two dimensions (measured for both weight gradients:
# docs/design/moe_backward.md, "Other flat tiles")
WGRAD_FLAT_TILES_TALL = (256, 128, 64, 8, 3)


def wgrad_flat_tiles(out_dtype: torch.dtype, ka: int, kb: int):
    """The flat wgrad's tiles for dW [E, ka, kb]: WGRAD_FLAT_TILES_FP32 for an fp32 output; else the 256-wide
    side on the shorter dimension, WGRAD_FLAT_TILES_TALL where ka < kb, WGRAD_FLAT_TILES otherwise."""
    if out_dtype == torch.float32:
        return WGRAD_FLAT_TILES_FP32
    return WGRAD_FLAT_TILES_TALL if ka < kb else WGRAD_FLAT_TILES


@triton.jit
def _wgrad_flat_run(pid, a_ptr, b_ptr, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, E, R_PAD,
                    BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, GRID, ELP2: tl.constexpr,
                    DOT_FP32: tl.constexpr, LOOP_STAGES: tl.constexpr = None, head_ptr=None,
                    DYNAMIC: tl.constexpr = 0, DYNAMIC_16THS: tl.constexpr = 1):
    """Program ``pid``'s whole share of _expert_wgrad_flat_kernel (its docstring): the standalone kernel's body and
    the one-launch backward's WGRAD stage. LOOP_STAGES: the flat loop's pipeline depth where it differs from the
    launch's num_stages (the one launch: its GEMM stages' depth). ``GRID``: the programs sharing the loops, ``pid``
    in [0, GRID) -- a constexpr from every caller but the one launch's fixed-role build (its compute programs:
    pid - S of GRID - S, runtime values), hence not annotated tl.constexpr (that would forbid the runtime value);
    a constexpr argument still specialises the function.

    DYNAMIC > 0 (the one launch, config.wgrad_dynamic): the tiles g < n_static (all but DYNAMIC_16THS / 16 of
    them, rounded down to whole GRID rounds) are statically owned as above; the rest are claimed in runs of DYNAMIC
    consecutive tiles from the atomic counter ``head_ptr`` (zero at the launch's start), each run one flat loop
    of its own, so a program the hardware runs slower (some SMs run both wgrads a few percent slower, whatever
    their tile shares) ends with fewer runs instead of holding every other program up. Per tile the same sum in
    the same order: the same bits whoever runs it."""
    n_j = tl.cdiv(KB, BJ)
    n_t = tl.cdiv(KA, BI) * n_j
    n_static = E * n_t
    if DYNAMIC > 0:
        n_static = (E * n_t * (16 - DYNAMIC_16THS) // 16) // GRID * GRID
    # this program's steps: over experts x, (its tiles of x below n_static) * max(1, cdiv(counts[x], BR))
    x = tl.arange(0, ELP2)
    cnt = tl.load(counts_ptr + x, mask=x < E, other=0)
    lo = x * n_t
    hi = tl.minimum(lo + n_t, n_static)
    first_g = lo + (pid - lo % GRID + GRID) % GRID  # this program's first global tile >= lo
    mine = tl.where((x < E) & (first_g < hi), (hi - first_g + GRID - 1) // GRID, 0)
    total = tl.sum(mine * tl.maximum(tl.cdiv(cnt, BR), 1), 0)
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[R_PAD, KA], strides=[KA, 1], block_shape=[BR, BI])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[R_PAD, KB], strides=[KB, 1], block_shape=[BR, BJ])
    if DYNAMIC > 0:  # one flat loop instance for the static share and every claimed run (one set of its buffers)
        n_tiles = E * n_t
        g_first = pid - GRID
        stride = pid * 0 + GRID
        seg = total
        more = total >= 0
        while more:
            _wgrad_flat_loop(g_first, stride, seg, a_desc, b_desc, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, R_PAD,
                             n_t, n_j, BI, BJ, BR, DOT_FP32, LOOP_STAGES)
            g0 = n_static + tl.atomic_add(head_ptr, 1, sem="relaxed", scope="gpu") * DYNAMIC
            seg = 0
            for g in range(g0, tl.minimum(g0 + DYNAMIC, n_tiles)):
                seg += tl.maximum(tl.cdiv(tl.load(counts_ptr + g // n_t), BR), 1)
            g_first = g0 - 1
            stride = 1
            more = g0 < n_tiles
    else:
        _wgrad_flat_loop(pid - GRID, GRID, total, a_desc, b_desc, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, R_PAD,
                         n_t, n_j, BI, BJ, BR, DOT_FP32, LOOP_STAGES)


@triton.jit
def _wgrad_flat_loop(g, stride, total, a_desc, b_desc, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, R_PAD, n_t, n_j,
                     BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, DOT_FP32: tl.constexpr,
                     LOOP_STAGES: tl.constexpr):
    """The flat loop over ``total`` row steps of the tiles g + stride, g + 2 * stride, ... (global tile g = e * n_t
    + ti * n_j + tj), in order: the tile advance at the step counter's wrap, the store at a tile's last step."""
    ki = -1
    steps = 0
    e = 0
    ti = 0
    tj = 0
    row0 = 0
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    for _ in tl.range(0, total, num_stages=LOOP_STAGES):
        ki = tl.where(ki == steps - 1, 0, ki + 1)
        if ki == 0:  # the next tile of this program
            g += stride
            e = g // n_t
            t = g % n_t
            ti = t // n_j
            tj = t % n_j
            rows = tl.load(counts_ptr + e)
            steps = tl.maximum(tl.cdiv(rows, BR), 1)
            row0 = tl.where(rows > 0, tl.load(pad_offs_ptr + e), R_PAD)
        acc = _wgrad_step(a_desc, b_desc, row0 + ki * BR, ti, tj, acc, BI, BJ, DOT_FP32)
        if ki == steps - 1:  # the tile's last step: store it, start the next from zero
            ci = ti * BI + tl.arange(0, BI)
            cj = tj * BJ + tl.arange(0, BJ)
            out = out_ptr + e.to(tl.int64) * KA * KB
            tl.store(out + ci[:, None] * KB + cj[None, :], _to_out(acc, out_ptr.dtype.element_ty, DOT_FP32),
                     mask=(ci < KA)[:, None] & (cj < KB)[None, :])
            acc = tl.zeros((BI, BJ), dtype=tl.float32)


@triton.jit
def _mtile_rows(first_mtile_ptr, offs_ptr, counts_ptr, gm, ELP2: tl.constexpr, BM: tl.constexpr):
    """(expert e, its rows' int64 indices [BM], their mask) of global m-tile gm. e is the last expert whose
    first m-tile is <= gm (an exclusive cumsum padded with 2**30 to ELP2 entries; an expert without rows shares
    its successor's first tile and loses the tie); tiles past an expert's rows are masked off entirely."""
    mt = tl.load(first_mtile_ptr + tl.arange(0, ELP2))
    e = tl.sum((mt <= gm).to(tl.int32), 0) - 1
    r = (gm - tl.load(first_mtile_ptr + e)) * BM + tl.arange(0, BM)
    return e, (tl.load(offs_ptr + e) + r).to(tl.int64), r < tl.load(counts_ptr + e)


@triton.jit
def _torch_sigmoid(g, INTERP: tl.constexpr):
    """sigmoid(g) = 1 / (1 + exp(-g)) in fp32 as torch's CUDA kernel computes it: libdevice expf (CUDA's expf)
    and an IEEE division (the interpreter: numpy's exp). swiglu_h's and dgrad2's epilogue's."""
    if INTERP:
        e = tl.exp(-g)
    else:
        e = libdevice.exp(-g)
    return tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + e)


@triton.jit
def _swiglu_backward_values(z, wp, g, u, INTERP: tl.constexpr):
    """(h, dg, du) in fp32 from z = dy_rows W2[e]^T, the rows' gate weights wp [BM] and g, u (fp32): h = silu(g) u
    (swiglu_h's arithmetic: _torch_sigmoid, (g * s) * u), dh = w z, dg = dh u silu'(g), du = dh silu(g). The
    fused epilogue's and the unfused pass's one formula."""
    s = _torch_sigmoid(g, INTERP)
    silu = g * s
    h = silu * u
    dh = z * wp[:, None]
    return h, dh * u * (s + silu * (1.0 - s)), dh * silu


@triton.jit
def _swiglu_backward_rows(i, rm, z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr, valid_ptr, F, BF: tl.constexpr,
                          EMIT_H: tl.constexpr, INTERP: tl.constexpr, HAS_VALID: tl.constexpr):
    """_swiglu_backward_kernel's rows i (int32 [BR], those with rm): the standalone pass's program and a block of
    the one-launch backward's SWIGLU task. Every row's arithmetic depends on that row alone (and BF)."""
    zm = rm
    if HAS_VALID:
        zm = rm & (tl.load(valid_ptr + i, mask=rm, other=0) != 0)
    i64 = i.to(tl.int64)
    wp = tl.load(wp_ptr + i, mask=rm, other=0.0)
    dw = tl.zeros(i.shape, dtype=tl.float32)
    c0 = tl.arange(0, BF)
    for col in range(0, F, BF):
        dw += _swiglu_backward_cols(i64, rm, zm, wp, col + c0, z_ptr, gu_ptr, dgu_ptr, h_ptr, F, EMIT_H, INTERP)
    tl.store(dw_ptr + i, dw, mask=rm)


@triton.jit
def _swiglu_backward_cols(i64, rm, zm, wp, c, z_ptr, gu_ptr, dgu_ptr, h_ptr, F, EMIT_H: tl.constexpr,
                          INTERP: tl.constexpr):
    """One column step of the SwiGLU backward pass: rows i64 (those with rm; z read as zeros where not zm),
    columns c -> h (EMIT_H), [dg | du] stored; returns the step's gate-gradient partial sum(z * h) per row."""
    mask = rm[:, None] & (c < F)[None, :]
    o2 = i64[:, None] * (2 * F) + c[None, :]
    z = tl.load(z_ptr + i64[:, None] * F + c[None, :], mask=zm[:, None] & (c < F)[None, :], other=0.0).to(tl.float32)
    g = tl.load(gu_ptr + o2, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + F + o2, mask=mask, other=0.0).to(tl.float32)
    h, dg, du = _swiglu_backward_values(z, wp, g, u, INTERP)
    if EMIT_H:
        tl.store(h_ptr + i64[:, None] * F + c[None, :], _to_out(h, tl.bfloat16, INTERP), mask=mask)
    part = tl.sum(z * h, 1)
    tl.store(dgu_ptr + o2, _to_out(dg, tl.bfloat16, INTERP), mask=mask)
    tl.store(dgu_ptr + F + o2, _to_out(du, tl.bfloat16, INTERP), mask=mask)
    return part


@triton.jit
def _dgrad1_tile(gm, nh, dgu_ptr, w13_ptr, offs_ptr, counts_ptr, first_mtile_ptr, dx_ptr, H, K,
                 ELP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
                 TMA: tl.constexpr, LOOP_STAGES: tl.constexpr = None, B_KN: tl.constexpr = False,
                 RNE_OUT: tl.constexpr = False):
    """Global m-tile gm, H-tile nh of _dgrad1_kernel (the standalone kernel's program and the one-launch
    backward's DGRAD2 / DGRAD1 task): rows [R, K] @ W[e]^T into dx (bf16), rows of no expert not stored; an
    m-tile past the last expert's rows stores nothing. LOOP_STAGES: as _wgrad_flat_run's. B_KN: W stored
    [E, K, H], rows @ W[e] (the one launch's GU task at W > 1: [g | u] = x_rows W13[e], H = 2F, K = the hidden
    size; both data gradients on transformers' layout). RNE_OUT: stored rounded to nearest even on the
    interpreter too (_to_out: torch's recompute's rounding; the GPU rounds so either way)."""
    e, rr, rm = _mtile_rows(first_mtile_ptr, offs_ptr, counts_ptr, gm, ELP2, BM)
    if tl.sum(rm.to(tl.int32), 0) > 0:  # else past the last expert's rows: nothing to do
        ch = nh * BN + tl.arange(0, BN)
        hm = ch < H
        ck = tl.arange(0, BK)
        w13e = w13_ptr + e.to(tl.int64) * H * K
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if TMA:  # the W13 tile within W13[e] (shape [H, 2F]); A's rows clipped at the expert's end
            first = tl.load(offs_ptr + e).to(tl.int64)
            lm0 = (gm - tl.load(first_mtile_ptr + e)) * BM
            a_desc = tl.make_tensor_descriptor(dgu_ptr + first * K, shape=[tl.load(counts_ptr + e), K],
                                               strides=[K, 1], block_shape=[BM, BK])
            if B_KN:
                bk_desc = tl.make_tensor_descriptor(w13e, shape=[K, H], strides=[H, 1], block_shape=[BK, BN])
                for k0 in tl.range(0, K, BK, num_stages=LOOP_STAGES):
                    a = a_desc.load([lm0, k0])
                    b = bk_desc.load([k0, nh * BN])
                    if DOT_FP32:
                        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
                    else:
                        acc = tl.dot(a, b, acc)
            else:
                b_desc = tl.make_tensor_descriptor(w13e, shape=[H, K], strides=[K, 1], block_shape=[BN, BK])
                for k0 in tl.range(0, K, BK, num_stages=LOOP_STAGES):
                    a = a_desc.load([lm0, k0])
                    b = b_desc.load([nh * BN, k0])
                    if DOT_FP32:
                        acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
                    else:
                        acc = tl.dot(a, tl.trans(b), acc)
        else:
            for k0 in tl.range(0, K, BK, num_stages=LOOP_STAGES):
                km = (k0 + ck) < K
                a = tl.load(dgu_ptr + rr[:, None] * K + (k0 + ck)[None, :], mask=rm[:, None] & km[None, :],
                            other=0.0)
                if B_KN:
                    b = tl.load(w13e + (k0 + ck)[:, None].to(tl.int64) * H + ch[None, :],
                                mask=km[:, None] & hm[None, :], other=0.0)
                else:
                    b = tl.load(w13e + ch[None, :].to(tl.int64) * K + (k0 + ck)[:, None],
                                mask=km[:, None] & hm[None, :], other=0.0)
                if DOT_FP32:
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
                else:
                    acc = tl.dot(a, b, acc)
        if RNE_OUT:
            tl.store(dx_ptr + rr[:, None] * H + ch[None, :], _to_out(acc, tl.bfloat16, DOT_FP32),
                     mask=rm[:, None] & hm[None, :])
        else:
            tl.store(dx_ptr + rr[:, None] * H + ch[None, :], acc.to(tl.bfloat16), mask=rm[:, None] & hm[None, :])


# both dgrads' GPU tile (BM, BN, BK, warps, stages): the wider N tile halves the re-reads of each [dg | du] row
# block (K = 2F); the tiles tried: docs/design/moe_backward.md
DGRAD1_TILES = (128, 256, 64, 8, 4)
COMPILE_ONLY = False  # dev/kernel_resources.py: CPU tensors stand in for CUDA ones (sm_90a compiles, nothing runs)


def _triton_runs(t: torch.Tensor) -> bool:
    """Whether the small gather kernels run for tensors like t (else their torch twins): CUDA or the interpreter."""
    return t.is_cuda or planning.interpreting() or COMPILE_ONLY


@triton.jit
def _unpermute_sum_cols(t, c, m, rows_ptr, inv_ptr, out_ptr, H, K: tl.constexpr, UNROLL: tl.constexpr = False):
    """Token t's columns c (those with m) of _unpermute_sum_kernel: its program (t a scalar), and a block of the
    one-launch backward's UNPERMUTE task (t [UT, 1] valid token indices, c [1, BH], m [UT, BH]). Element-wise
    fp32 adds in slot order: the bits depend on neither the blocking nor UNROLL (the slot loop unrolled, so the
    K loads of a block are in flight together -- one persistent program per SM has no other memory-level
    parallelism; the adds stay in slot order)."""
    acc = tl.load(rows_ptr + tl.load(inv_ptr + t * K).to(tl.int64) * H + c, mask=m, other=0.0).to(tl.float32)
    if UNROLL:
        for j in tl.static_range(1, K):
            row = tl.load(inv_ptr + t * K + j).to(tl.int64)
            acc += tl.load(rows_ptr + row * H + c, mask=m, other=0.0).to(tl.float32)
    else:
        for j in range(1, K):
            row = tl.load(inv_ptr + t * K + j).to(tl.int64)
            acc += tl.load(rows_ptr + row * H + c, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + tl.cast(t, tl.int64) * H + c, acc, mask=m)


BWD_UNPERMUTE_TOKENS = 8  # tokens per UNPERMUTE task (GPU): [8, 256] blocks, the k slots' loads in flight together


@triton.jit
def _trace_clock(TRACE: tl.constexpr):
    """The global timer where the launch is traced, else 0 (no timer read at all)."""
    if TRACE:
        return dev.now_ns()
    else:
        return tl.full([], 0, tl.int64)


@triton.jit
def _n_mtiles(counts_ptr, E, ELP2: tl.constexpr, BM: tl.constexpr):
    """The m-tiles of all experts, sum of ceil(counts / BM) (the one launch's task counts)."""
    x = tl.arange(0, ELP2)
    return tl.sum(tl.cdiv(tl.load(counts_ptr + x, mask=x < E, other=0), BM), 0)


@triton.jit
def _mtile_expert(first_mtile_ptr, gm, ELP2: tl.constexpr):
    """The expert of global m-tile gm (_mtile_rows' rule)."""
    return tl.sum((tl.load(first_mtile_ptr + tl.arange(0, ELP2)) <= gm).to(tl.int32), 0) - 1


def _bwd_tiles(out_dtype: torch.dtype, h: int, f: int, nk: bool = False):
    """The one launch's tiles: ((BM, BN, BK, stages) of both dgrads, (SwiGLU rows, columns), wgrad2's and wgrad1's
    (BI, BJ, BR, stages), (UNPERMUTE tokens, columns), warps) -- the standalone kernels' (the interpreter's small
    ones). ``nk``: the weight gradients in transformers' layout (dW2 [H, F], dW13 [2F, H] per expert). A
    ValueError unless every stage has 8 warps and both wgrads one row step (one kernel)."""
    if planning.interpreting():
        return (16, 16, 16, 1), (4, 16), (16, 16, 16, 1), (16, 16, 16, 1), (2, 16), 4
    bm, bn, bk, warps, stages = DGRAD1_TILES
    w2 = wgrad_flat_tiles(out_dtype, *((h, f) if nk else (f, h)))
    w1 = wgrad_flat_tiles(out_dtype, *((2 * f, h) if nk else (h, 2 * f)))
    if not warps == w2[3] == w1[3] == 8 or w2[2] != w1[2]:  # one kernel: one warp count, one row step
        raise ValueError(f"the one launch needs one warp count and one wgrad row step: dgrad {DGRAD1_TILES}, "
                         f"wgrad2 {w2}, wgrad1 {w1}")
    return ((bm, bn, bk, stages), (8, min(256, triton.next_power_of_2(f))), (*w2[:3], w2[4]), (*w1[:3], w1[4]),
            (BWD_UNPERMUTE_TOKENS, min(256, triton.next_power_of_2(h))), warps)
