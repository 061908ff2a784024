"""The backward's expert GEMMs as separate kernels: the multi-launch path of ``moe_backward`` (the one launch's
correctness twin; what runs on the CPU, with saved g | u at W > 1, and with ``one_launch=False``), and the pieces
the tests and dev/moe_bwd_probe check one by one. Rows grouped by expert (counts[e] of expert e, zero allowed),
packed or in the padded layout (layout.py); bf16 operands, fp32 accumulation:

1. The per-expert weight gradient dW[e] = A[rows of e]^T B[rows of e] -> [E, KA, KB] bf16 (or fp32), rounded once:
   GEMM2's (A = h [R, F], B = do = w * dy_rows [R, H]) and GEMM1's (A = x_rows [R, H], B = [dg | du] [R, 2F]).
   ``expert_weight_grads`` on packed rows (kernel "persistent": two programs per SM walking the experts in order;
   "tiles": one program per tile; masked pointers where KA or KB is not a multiple of 8),
   ``expert_weight_grads_padded`` on the padded layout (one flat loop over a program's row steps of all its
   tiles, pipelined across tiles). An expert without rows gets zeros.
2. GEMM2's data gradient with the SwiGLU backward (``expert_dgrad2_swiglu``), per expert row p (token t, gate weight
   w_p): z_p = dy_rows[p] W2[e]^T [R, F]; h_p = silu(g_p) u_p from g | u; the gate gradient dw_rows[p] = <z_p, h_p>
   (= <dy_t, o_p>); dh = w_p z_p, dg = dh u silu'(g), du = dh silu(g) -> [dg | du] [R, 2F] bf16; h bf16 too
   (``emit_h``). Default (config.dgrad2_fused False): the GEMM (z rounded to bf16) then a SwiGLU pass; fused: the
   SwiGLU backward in the GEMM's epilogue, its gate partials summed in order by rows.sum_partials.
3. GEMM1's data gradient (``expert_dgrad1``): dx_rows[p] = [dg | du]_p W13[e]^T [R, H] bf16.

Determinism: one program owns each output tile and sums in a fixed order (weight gradients: the expert's rows
ascending, BR per step; data gradients: K ascending; the gate gradient: column steps left to right); no atomics.
The grids are static (e.g. E * ceil(KA / BI) * ceil(KB / BJ) tiles whatever the counts; m-tiles past the last
expert's rows exit at once) and the row offsets are device-side cumsums: nothing synchronises with the host.
Runs on CUDA (TMA -> shared memory -> wgmma) or the CPU under TRITON_INTERPRET=1 (small tiles, fp32 dots).
Tests: tests/test_moe_backward.py (test_expert_weight_grads*, test_expert_dgrad2_swiglu*, test_expert_dgrad1*,
test_dgrad2_emitted_h*), tests/test_moe_bwd_probe.py, tests/test_bench_moe.py::
test_kosmos_expert_backward_matches_moe_backward_stages. Tiles and the alternatives measured against them:
docs/design/moe_backward.md ("The kernels", "Parked alternatives"); figures: docs/perf/moe_backward.md."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core import runtime
from ...config import MoEBackwardConfig, check_config
from ...core import planning
from .tiles import (DGRAD1_TILES, WGRAD_FLAT_TILES, WGRAD_FLAT_TILES_FP32, _dgrad1_tile, _mtile_rows,
                    _swiglu_backward_rows, _swiglu_backward_values, _to_out, _wgrad_flat_run, _wgrad_step,
                    wgrad_flat_tiles)
from .layout import WGRAD_PAD_ROWS, _mtile_plan
from .rows import dgrad2_emits_h, sum_partials, swiglu_h
from ..moe_forward import weights_nk


@triton.jit
def _wgrad_tile_tma(a_desc, b_desc, rows, ti, tj, BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr,
                    DOT_FP32: tl.constexpr):
    """The fp32 sum A[rows, ti-tile]^T B[rows, tj-tile] over an expert's rows in ascending order, BR per step,
    through its TMA descriptors (one tile of both TMA wgrad kernels: the same sum, hence the same bits)."""
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    for r0 in range(0, rows, BR):
        acc = _wgrad_step(a_desc, b_desc, r0, ti, tj, acc, BI, BJ, DOT_FP32)
    return acc


@triton.jit
def _expert_wgrad_kernel(a_ptr, b_ptr, offs_ptr, counts_ptr, out_ptr, KA, KB,
                         BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, DOT_FP32: tl.constexpr):
    """One output tile (e, i, j) of dW[e] = A[rows of e]^T B[rows of e], the operands through TMA: each program's
    descriptors cover its expert's rows alone (base = the expert's first row, shape [counts[e], K]), so a row
    step past the expert's end reads zeros -- never the next expert's rows -- and the loop (pipelined by
    num_stages) runs TMA -> shared memory -> wgmma with A's transpose a shared-memory view. Out in out_ptr's dtype
    (bf16 or fp32) from the fp32 accumulator, through a masked store."""
    pid = tl.program_id(0)
    n_i = tl.cdiv(KA, BI)
    n_j = tl.cdiv(KB, BJ)
    e = pid // (n_i * n_j)
    ti = (pid // n_j) % n_i
    tj = pid % n_j
    first = tl.load(offs_ptr + e).to(tl.int64)
    rows = tl.load(counts_ptr + e)
    a_desc = tl.make_tensor_descriptor(a_ptr + first * KA, shape=[rows, KA], strides=[KA, 1], block_shape=[BR, BI])
    b_desc = tl.make_tensor_descriptor(b_ptr + first * KB, shape=[rows, KB], strides=[KB, 1], block_shape=[BR, BJ])
    acc = _wgrad_tile_tma(a_desc, b_desc, rows, ti, tj, BI, BJ, BR, DOT_FP32)
    ci = ti * BI + tl.arange(0, BI)
    cj = tj * BJ + tl.arange(0, BJ)
    out = out_ptr + e.to(tl.int64) * KA * KB
    tl.store(out + ci[:, None] * KB + cj[None, :], _to_out(acc, out_ptr.dtype.element_ty, DOT_FP32),
             mask=(ci < KA)[:, None] & (cj < KB)[None, :])


@triton.jit
def _expert_wgrad_ptr_kernel(a_ptr, b_ptr, offs_ptr, counts_ptr, out_ptr, KA, KB,
                             BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, DOT_FP32: tl.constexpr):
    """The same with masked pointer loads and stores: the fallback where a TMA descriptor cannot describe the
    operands (KA or KB not a multiple of 8 bf16 elements: row strides not 16-byte aligned)."""
    pid = tl.program_id(0)
    n_i = tl.cdiv(KA, BI)
    n_j = tl.cdiv(KB, BJ)
    e = pid // (n_i * n_j)
    ti = (pid // n_j) % n_i
    tj = pid % n_j
    first = tl.load(offs_ptr + e)
    rows = tl.load(counts_ptr + e)
    ci = ti * BI + tl.arange(0, BI)
    cj = tj * BJ + tl.arange(0, BJ)
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    r = tl.arange(0, BR)
    for r0 in range(0, rows, BR):
        rr = (first + r0 + r).to(tl.int64)
        rm = (r0 + r) < rows
        a = tl.load(a_ptr + rr[:, None] * KA + ci[None, :], mask=rm[:, None] & (ci < KA)[None, :], other=0.0)
        b = tl.load(b_ptr + rr[:, None] * KB + cj[None, :], mask=rm[:, None] & (cj < KB)[None, :], other=0.0)
        if DOT_FP32:
            acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc)
        else:
            acc = tl.dot(tl.trans(a), b, acc)
    out = out_ptr + e.to(tl.int64) * KA * KB
    tl.store(out + ci[:, None] * KB + cj[None, :], _to_out(acc, out_ptr.dtype.element_ty, DOT_FP32),
             mask=(ci < KA)[:, None] & (cj < KB)[None, :])


@triton.jit
def _expert_wgrad_persistent_kernel(a_ptr, b_ptr, offs_ptr, counts_ptr, out_ptr, KA, KB, E,
                                    BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, GRID: tl.constexpr,
                                    DOT_FP32: tl.constexpr):
    """_expert_wgrad_kernel's tiles on a persistent grid of GRID programs: global tile g = e * n_tiles + t
    (t = ti * n_j + tj, the tiles of one expert consecutive) is program g % GRID's, and every program walks
    the experts in order, so the programs resident at a time work on one expert's tiles (its rows stay in L2)
    and each program builds its two TMA descriptors (its expert's rows, as _expert_wgrad_kernel's) once per
    expert instead of once per tile (~n_tiles / GRID tiles per expert and program), with no program launch
    per tile. Each tile as in _expert_wgrad_kernel: one program, the rows in ascending order, BR per step,
    fp32 accumulation rounded once -- bitwise its result. The tile is stored through masked pointers (a
    per-expert TMA store was slower: docs/design/moe_backward.md). tl.range(flatten=True) cannot fuse the tile
    and row loops here: Triton fuses neither this nest inside the expert loop nor one whose row bound is loaded
    per tile (TTGIR, Triton 3.9); _expert_wgrad_flat_kernel flattens it by hand."""
    pid = tl.program_id(0)
    n_i = tl.cdiv(KA, BI)
    n_j = tl.cdiv(KB, BJ)
    n_t = n_i * n_j
    ci0 = tl.arange(0, BI)
    cj0 = tl.arange(0, BJ)
    for e in range(0, E):
        first = tl.load(offs_ptr + e).to(tl.int64)
        rows = tl.load(counts_ptr + e)
        t0 = (pid + GRID - (e * n_t) % GRID) % GRID  # this program's first tile of expert e
        a_desc = tl.make_tensor_descriptor(a_ptr + first * KA, shape=[rows, KA], strides=[KA, 1],
                                           block_shape=[BR, BI])
        b_desc = tl.make_tensor_descriptor(b_ptr + first * KB, shape=[rows, KB], strides=[KB, 1],
                                           block_shape=[BR, BJ])
        out = out_ptr + tl.cast(e, tl.int64) * KA * KB
        for t in range(t0, n_t, GRID):
            ti = t // n_j
            tj = t % n_j
            acc = _wgrad_tile_tma(a_desc, b_desc, rows, ti, tj, BI, BJ, BR, DOT_FP32)
            ci = ti * BI + ci0
            cj = tj * BJ + cj0
            tl.store(out + ci[:, None] * KB + cj[None, :], _to_out(acc, out_ptr.dtype.element_ty, DOT_FP32),
                     mask=(ci < KA)[:, None] & (cj < KB)[None, :])


WGRAD_TILES = (128, 128, 64, 8, 3)  # GPU (BI, BJ, BR, warps, stages); the variants tried: docs/design/moe_backward.md
WGRAD_PERSISTENT_TILES = (128, 128, 64, 8, 3)  # the same for the persistent kernel (2 programs per SM)
WGRAD_PROGRAMS_PER_SM = 2  # 128 x 128, <= 96 KiB shared, ~105 registers x 256 threads: two fit an SM (else one)
WGRAD_KERNELS = ("persistent", "tiles")

# the packed path's GEMM2 weight gradient where the experts average <= 160 rows (the row mean known on the host:
# rows / experts, no sync): 4 warps, 2 stages, 2 programs per SM -- faster at ~128 rows per expert, a tie or a
# loss at ~256 (docs/design/moe_backward.md); GEMM1's weight gradient keeps the default tiles everywhere
WGRAD2_FEW_ROWS_PER_EXPERT = 160
WGRAD2_FEW_ROWS_TILES = (128, 128, 64, 4, 2, 2)


def wgrad2_tiles(h: torch.Tensor, counts: torch.Tensor):
    """The tiles of GEMM2's weight gradient for h's rows over counts' experts: WGRAD2_FEW_ROWS_TILES where the
    experts average <= WGRAD2_FEW_ROWS_PER_EXPERT rows (on the GPU), else None (expert_weight_grads' default)."""
    few = h.is_cuda and h.shape[0] <= WGRAD2_FEW_ROWS_PER_EXPERT * max(1, counts.shape[0])
    return WGRAD2_FEW_ROWS_TILES if few else None


def _check_wgrad_operands(a, b, counts, out_dtype, names=("a", "b"), extra=()) -> None:
    """expert_weight_grads' (and its padded twin's) argument checks: 2-D contiguous bf16 operands with one row
    each per (token, expert) pair, counts 1-D int32/int64, everything (and ``extra``) on one device, bf16 or
    fp32 out."""
    for name, t in zip(names, (a, b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be a 2-D torch.bfloat16 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{names[0]} has {a.shape[0]} rows but {names[1]} has {b.shape[0]}: one row per (token, "
                         f"expert) pair each")
    devices = [t.device for t in (a, b, counts, *extra)]
    if len(set(devices)) != 1:
        raise ValueError(f"{', '.join(names)} and counts must be on one device (got {', '.join(map(str, devices))})")
    if counts.dim() != 1 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"counts must be a 1-D int32/int64 tensor, got {counts.dtype} {tuple(counts.shape)}")
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be torch.bfloat16 or torch.float32, got {out_dtype}")


def _persistent_programs(per_sm: int, t: torch.Tensor, n_tiles: int) -> int:
    """A persistent wgrad grid: per_sm programs per SM of t's GPU (the CPU interpreter: 3, a few programs with
    several tiles and experts each; compile-only: an H200's 132 SMs), at most one per tile."""
    if t.is_cuda:
        programs = per_sm * runtime.num_sms(t.device)
    else:
        programs = 3 if planning.interpreting() else per_sm * 132
    return max(1, min(programs, n_tiles))


def expert_weight_grads(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor,
                        out_dtype: torch.dtype = torch.bfloat16, kernel: str | None = None,
                        tiles=None, config: MoEBackwardConfig | None = None) -> torch.Tensor:
    """dW [E, KA, KB] in ``out_dtype`` (bf16, the parameters' dtype, by default; or fp32) with dW[e] =
    a[rows of e]^T @ b[rows of e], accumulated in fp32 and rounded once (the bf16 result is the fp32 one rounded
    to nearest even, bitwise); a [R, KA], b [R, KB] bf16 on one device, the rows of expert e the next counts[e]
    after those of experts < e (sum(counts) <= R). Deterministic (this module's docstring). CUDA, or the CPU under
    TRITON_INTERPRET=1. ``kernel``: "persistent" (_expert_wgrad_persistent_kernel) or "tiles" (one program per
    output tile, _expert_wgrad_kernel); None: ``config.wgrad_kernel``. Both give the same bits (the same per-tile sums);
    rows not 16-byte aligned take the masked-pointer kernel either way. ``tiles``: (BI, BJ, BR, warps, stages[,
    programs per SM of the persistent grid]) on the GPU instead of WGRAD_PERSISTENT_TILES / WGRAD_TILES (the
    probe's --wgrad-tiles)."""
    kernel = check_config(MoEBackwardConfig, config).wgrad_kernel if kernel is None else kernel
    if kernel not in WGRAD_KERNELS:
        raise ValueError(f"kernel must be one of {WGRAD_KERNELS}, got {kernel!r}")
    _check_wgrad_operands(a, b, counts, out_dtype)
    n_exp, ka, kb = counts.shape[0], a.shape[1], b.shape[1]
    out = torch.empty((n_exp, ka, kb), dtype=out_dtype, device=a.device)
    if n_exp == 0 or out.numel() == 0:
        return out
    counts32 = counts.to(torch.int32)
    offs = torch.cumsum(counts32, 0, dtype=torch.int32) - counts32  # exclusive: no host synchronisation
    persistent = kernel == "persistent"
    per_sm_given = []
    if planning.interpreting():
        bi, bj, br, warps, stages = 16, 16, 16, 4, 1
    else:
        bi, bj, br, warps, stages, *per_sm_given = tiles or (WGRAD_PERSISTENT_TILES if persistent else WGRAD_TILES)
    n_tiles = n_exp * triton.cdiv(ka, bi) * triton.cdiv(kb, bj)
    grid = (n_tiles,)
    aligned = ka % 8 == 0 and kb % 8 == 0 and all(t.data_ptr() % 16 == 0 for t in (a, b, out))
    if aligned:
        runtime.ensure_triton_allocator()
    if aligned and persistent:
        smem = stages * br * (bi + bj) * 2
        per_sm = WGRAD_PROGRAMS_PER_SM if (bi, bj) == (128, 128) and smem <= 96 * 1024 else 1
        if per_sm_given:  # a sixth entry of ``tiles``: the persistent grid's programs per SM
            per_sm = per_sm_given[0]
        programs = _persistent_programs(per_sm, a, n_tiles)
        _expert_wgrad_persistent_kernel[(programs,)](a, b, offs, counts32, out, ka, kb, n_exp, BI=bi, BJ=bj, BR=br,
                                                     GRID=programs, DOT_FP32=planning.interpreting(),
                                                     num_warps=warps, num_stages=stages)
        return out
    fn = _expert_wgrad_kernel if aligned else _expert_wgrad_ptr_kernel
    fn[grid](a, b, offs, counts32, out, ka, kb, BI=bi, BJ=bj, BR=br, DOT_FP32=planning.interpreting(),
             num_warps=warps, num_stages=stages)
    return out


WGRAD_FLAT_SMEM_LIMIT = 232448  # an H200 SM's shared memory per block (227 KiB)
WGRAD_FLAT_SMEM_PER_SM = 2 * 112 * 1024  # programs per SM by the shared estimate (an H200 SM: 228 KiB, 1 KiB each)


@triton.jit
def _expert_wgrad_flat_kernel(a_ptr, b_ptr, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, E, R_PAD,
                              BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, GRID: tl.constexpr,
                              ELP2: tl.constexpr, DOT_FP32: tl.constexpr):
    """_expert_wgrad_persistent_kernel's tiles (global tile g = e * n_tiles + t, program g % GRID's) as ONE
    software-pipelined loop over this program's row steps, all its tiles' in a row, so the TMA loads of the next
    tile are in flight during this tile's epilogue (the persistent kernel's pipeline drains at every tile).

    The operands are in the padded layout (padded_row_offsets): expert e's rows from pad_offs[e], the rows
    after its last up to the next multiple of BR zero in at least ONE operand (the other finite there: 0 * x
    = 0), so one descriptor per operand over the whole [R_PAD, K] array (built once) serves every expert and
    the last, partial step of a tile sums exactly what the clipped per-expert descriptors' zeros gave. A tile
    of an expert with counts[e] rows takes max(1, cdiv(counts[e], BR)) steps; an expert without rows takes
    one step at row R_PAD (past the array: TMA reads zeros) and stores zeros. Per tile: the same rows in the
    same ascending BR-row steps, fp32 accumulation rounded once -- bitwise the other kernels' result.

    Why not tl.range(flatten=True) over a tile loop with the row loop nested: Triton's FuseNestedLoops fuses
    an inner loop only if its bounds are invariant to the outer loop (its isOuterLoopInvariant; the bound here
    is counts[e], a load per tile), so it leaves such a nest alone (TTGIR, Triton 3.9); this is the nest
    flattened by hand (the pre-flatten persistent-matmul tutorial's form: the tile advance and its scalar loads
    in an ``if`` at the step counter's wrap, the epilogue in an ``if`` at the tile's last step), which the
    pipeliner pipelines (one scf.for, the descriptor loads num_stages - 1 steps ahead). The loop's trip count, this
    program's total steps, comes from counts in one vector reduction first."""
    _wgrad_flat_run(tl.program_id(0), a_ptr, b_ptr, pad_offs_ptr, counts_ptr, out_ptr, KA, KB, E, R_PAD, BI, BJ, BR,
                    GRID, ELP2, DOT_FP32)


def expert_weight_grads_padded(a_pad: torch.Tensor, b_pad: torch.Tensor, counts: torch.Tensor,
                               pad_offs: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16, *,
                               pad: int = WGRAD_PAD_ROWS, tiles=None) -> torch.Tensor:
    """expert_weight_grads on operands ALREADY in the padded row layout, through _expert_wgrad_flat_kernel:
    dW [E, KA, KB] with dW[e] = a_pad[pad_offs[e] : +counts[e]]^T @ b_pad[the same rows], bitwise
    expert_weight_grads' result on the unpadded rows (fp32 accumulation rounded once; bf16 or fp32 out).

    a_pad [R_pad, KA], b_pad [R_pad, KB] bf16, contiguous, KA and KB multiples of 8 (TMA only: no pointer
    fallback); pad_offs = padded_row_offsets(counts, pad) (each expert's first row a multiple of ``pad``) and
    R_pad >= the last expert's padded end (padded_rows_bound(R, E, pad) always is); pad_expert_rows builds the
    layout. Contract on the gap rows (after an expert's last row, up to the next multiple of ``pad``): zero in
    at least one of a_pad, b_pad, and finite in the other (the kernel sums 0 * x there) -- both zero is what
    pad_expert_rows gives. Rows of no expert are never read. ``tiles``: (BI, BJ, BR, warps, stages[, programs per
    SM]) on the GPU (WGRAD_FLAT_TILES); BR must divide ``pad``. CUDA, or the CPU under TRITON_INTERPRET=1."""
    _check_wgrad_operands(a_pad, b_pad, counts, out_dtype, names=("a_pad", "b_pad"), extra=(pad_offs,))
    if pad_offs.shape != counts.shape or pad_offs.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pad_offs must be an int32/int64 tensor shaped like counts, got {pad_offs.dtype} "
                         f"{tuple(pad_offs.shape)}")
    n_exp, ka, kb = counts.shape[0], a_pad.shape[1], b_pad.shape[1]
    if ka % 8 or kb % 8:
        raise ValueError(f"KA = {ka} and KB = {kb} must be multiples of 8 (TMA rows 16-byte aligned)")
    per_sm_given = []
    if planning.interpreting():
        bi, bj, br, warps, stages = 16, 16, 16, 4, 1
    else:
        bi, bj, br, warps, stages, *per_sm_given = tiles or (
            WGRAD_FLAT_TILES_FP32 if out_dtype == torch.float32 else WGRAD_FLAT_TILES)
    if pad % br:
        raise ValueError(f"the row step BR = {br} must divide the layout's pad = {pad}")
    out = torch.empty((n_exp, ka, kb), dtype=out_dtype, device=a_pad.device)
    if n_exp == 0 or out.numel() == 0:
        return out
    if any(t.data_ptr() % 16 for t in (a_pad, b_pad)):
        raise ValueError("a_pad and b_pad must be 16-byte aligned (TMA)")
    runtime.ensure_triton_allocator()
    n_tiles = n_exp * triton.cdiv(ka, bi) * triton.cdiv(kb, bj)
    # shared: the pipeline's stages plus the epilogue's layout conversion (live together in the flat loop)
    smem = stages * br * (bi + bj) * 2 + bi * bj * out.element_size()
    if smem > WGRAD_FLAT_SMEM_LIMIT and not planning.interpreting():
        raise ValueError(f"wgrad tiles {bi}x{bj}x{br} with {stages} stages and a {out.dtype} output need "
                         f"{smem} B of shared memory, over the SM's {WGRAD_FLAT_SMEM_LIMIT} B")
    per_sm = per_sm_given[0] if per_sm_given else max(1, WGRAD_FLAT_SMEM_PER_SM // smem) if smem else 1
    per_sm = min(per_sm, 2)
    programs = _persistent_programs(per_sm, a_pad, n_tiles)
    _expert_wgrad_flat_kernel[(programs,)](a_pad, b_pad, pad_offs.to(torch.int32), counts.to(torch.int32), out,
                                           ka, kb, n_exp, a_pad.shape[0], BI=bi, BJ=bj, BR=br, GRID=programs,
                                           ELP2=triton.next_power_of_2(n_exp), DOT_FP32=planning.interpreting(),
                                           num_warps=warps, num_stages=stages)
    return out


@triton.jit
def _dgrad2_epilogue(z, wp, gu_t, dgu_t, h_t, dwp_t, col, rows_valid, F, n_parts, part,
                     BM: tl.constexpr, BH: tl.constexpr, EMIT_H: tl.constexpr, INTERP: tl.constexpr):
    """One BH-column slice of a dgrad2 tile: z [BM, BH] fp32 (= dy_rows W2[e]^T at F-columns col..col+BH),
    wp [BM] the rows' gate weights; gu_t / dgu_t / h_t / dwp_t the tile's first row of gu [., 2F], dgu [., 2F],
    h [., F], dwp [., n_parts] (int64 scalar offsets; int32 inside the tile: no per-element 64-bit index).
    Loads g | u, stores the gate partial ``part`` = sum over the slice of z * h, [dg | du] bf16 and (EMIT_H)
    h = silu(g) u bf16 -- bitwise swiglu_h's (the same arithmetic: _torch_sigmoid, (g * s) * u)."""
    i = tl.arange(0, BM)
    c = tl.arange(0, BH)
    rm = i < rows_valid
    mask = rm[:, None] & ((col + c) < F)[None, :]
    o2 = i[:, None] * (2 * F) + (col + c)[None, :]
    g = tl.load(gu_t + o2, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_t + F + o2, mask=mask, other=0.0).to(tl.float32)
    h, dg, du = _swiglu_backward_values(z, wp, g, u, INTERP)
    if EMIT_H:
        tl.store(h_t + (i[:, None] * F + (col + c)[None, :]), _to_out(h, tl.bfloat16, INTERP), mask=mask)
    tl.store(dwp_t + i * n_parts + part, tl.sum(z * h, 1), mask=rm)
    tl.store(dgu_t + o2, _to_out(dg, tl.bfloat16, INTERP), mask=mask)
    tl.store(dgu_t + F + o2, _to_out(du, tl.bfloat16, INTERP), mask=mask)


@triton.jit
def _dgrad2_swiglu_kernel(dyr_ptr, gu_ptr, w2_ptr, wp_ptr, offs_ptr, counts_ptr, dgu_ptr, dwp_ptr, h_ptr, H, F,
                          n_mtiles, ELP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                          DOT_FP32: tl.constexpr, TMA: tl.constexpr = False, SPLIT: tl.constexpr = True,
                          EMIT_H: tl.constexpr = False, B_KN: tl.constexpr = False):
    """One (expert, m-tile, F-tile) of item 2 of this module's docstring. The m-tiles of all experts are numbered
    consecutively (an expert's first m-tile from the exclusive cumsum of ceil(counts / BM)). SPLIT: the
    epilogue in two BN/2-column halves, one after the other (the accumulator split in registers), so that
    g, u and the fp32 temporaries of half a tile are alive at a time (BN = 128 without spills); a gate
    partial per half (dwp [R, 2 * ceil(F / BN)]). EMIT_H: h = silu(g) u (bf16) stored too (for wgrad2).
    B_KN: W2 stored [E, H, F] (transformers' ``down_proj``), read as it is."""
    pid = tl.program_id(0)
    n_f = tl.cdiv(F, BN)
    gm = pid // n_f
    nf = pid % n_f
    e, rr, rm = _mtile_rows(n_mtiles, offs_ptr, counts_ptr, gm, ELP2, BM)
    if tl.sum(rm.to(tl.int32), 0) == 0:  # past the last expert's rows (the static grid bound): nothing to do
        return
    cf = nf * BN + tl.arange(0, BN)
    fm = cf < F
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    ck = tl.arange(0, BK)
    w2e = w2_ptr + e.to(tl.int64) * F * H
    first = tl.load(offs_ptr + e).to(tl.int64)
    lm0 = (gm - tl.load(n_mtiles + e)) * BM
    if TMA:  # per-expert descriptors: W2[e] [F, H] and A's rows clipped at the expert's end (zeros past them)
        a_desc = tl.make_tensor_descriptor(dyr_ptr + first * H, shape=[tl.load(counts_ptr + e), H],
                                           strides=[H, 1], block_shape=[BM, BK])
        if B_KN:
            bk_desc = tl.make_tensor_descriptor(w2e, shape=[H, F], strides=[F, 1], block_shape=[BK, BN])
            for k0 in range(0, H, BK):
                a = a_desc.load([lm0, k0])
                b = bk_desc.load([k0, nf * BN])
                if DOT_FP32:
                    acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
                else:
                    acc = tl.dot(a, b, acc)
        else:
            b_desc = tl.make_tensor_descriptor(w2e, shape=[F, H], strides=[H, 1], block_shape=[BN, BK])
            for k0 in range(0, H, BK):
                a = a_desc.load([lm0, k0])
                b = b_desc.load([nf * BN, k0])
                if DOT_FP32:
                    acc = tl.dot(a.to(tl.float32), tl.trans(b.to(tl.float32)), acc)
                else:
                    acc = tl.dot(a, tl.trans(b), acc)
    else:
        for k0 in range(0, H, BK):
            km = (k0 + ck) < H
            a = tl.load(dyr_ptr + rr[:, None] * H + (k0 + ck)[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            if B_KN:  # B[k, n] = W2[e][k, n] (stored [H, F])
                b = tl.load(w2e + (k0 + ck)[:, None].to(tl.int64) * F + cf[None, :], mask=km[:, None] & fm[None, :],
                            other=0.0)
            else:  # B[k, n] = W2[e][n, k]: rows of W2[e] (F of them, H long), read transposed
                b = tl.load(w2e + cf[None, :].to(tl.int64) * H + (k0 + ck)[:, None], mask=km[:, None] & fm[None, :],
                            other=0.0)
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
            else:
                acc = tl.dot(a, b, acc)
    row0 = first + lm0  # the tile's first row (int64)
    rows_valid = tl.load(counts_ptr + e) - lm0
    wp = tl.load(wp_ptr + rr, mask=rm, other=0.0)
    gu_t = gu_ptr + row0 * (2 * F)
    dgu_t = dgu_ptr + row0 * (2 * F)
    h_t = h_ptr + row0 * F
    if SPLIT:
        n_parts = 2 * n_f
        dwp_t = dwp_ptr + row0 * n_parts
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
        _dgrad2_epilogue(lo, wp, gu_t, dgu_t, h_t, dwp_t, nf * BN, rows_valid, F, n_parts, 2 * nf, BM, BN // 2,
                         EMIT_H, DOT_FP32)
        _dgrad2_epilogue(hi, wp, gu_t, dgu_t, h_t, dwp_t, nf * BN + BN // 2, rows_valid, F, n_parts, 2 * nf + 1,
                         BM, BN // 2, EMIT_H, DOT_FP32)
    else:
        dwp_t = dwp_ptr + row0 * n_f
        _dgrad2_epilogue(acc, wp, gu_t, dgu_t, h_t, dwp_t, nf * BN, rows_valid, F, n_f, nf, BM, BN, EMIT_H,
                         DOT_FP32)


@triton.jit
def _swiglu_backward_kernel(z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr, valid_ptr, R, F, BR: tl.constexpr,
                            BF: tl.constexpr, EMIT_H: tl.constexpr, INTERP: tl.constexpr, HAS_VALID: tl.constexpr):
    """The dgrad2 epilogue's arithmetic as a pass of its own over BR rows (the unfused dgrad2): z [R, F] bf16
    (= dy_rows W2[e]^T from the GEMM), g | u, w -> [dg | du] bf16, h bf16 (EMIT_H) and the gate gradient dw[r]
    = sum over F of z * h, summed in BF-column steps left to right in fp32 (deterministic). HAS_VALID: z's rows
    with valid[r] == 0 (the padded layout's gap rows, which the GEMM does not write) read as zeros."""
    i = tl.program_id(0) * BR + tl.arange(0, BR)
    _swiglu_backward_rows(i, i < R, z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr, valid_ptr, F, BF, EMIT_H, INTERP,
                          HAS_VALID)


# the fused dgrad2's GPU tile (BM, BN, BK, warps, stages); the epilogue in two BN/2-column halves (the tiles
# tried, all bitwise the default's: docs/design/moe_backward.md)
DGRAD2_TILES = (128, 128, 64, 8, 4)



def expert_dgrad2_swiglu(dy_rows: torch.Tensor, gu: torch.Tensor, w2: torch.Tensor, w_pair: torch.Tensor,
                         counts: torch.Tensor, *, emit_h: bool = False, tiles=None, fused: bool | None = None,
                         offs=None, valid=None, config: MoEBackwardConfig | None = None):
    """Item 2 of this module's docstring for expert-sorted rows: dy_rows [R, H] bf16 (each row's token gradient),
    gu [R, 2F] bf16 (the forward's g | u), w2 [E, F, H] bf16, w_pair [R] fp32 (each row's gate weight), counts
    [E] (rows per expert, consecutive). Returns (dgu [R, 2F] bf16 = [dg | du], dw_rows [R] fp32 = <dy_t, o_p>,
    the gate partials summed in order) and, with ``emit_h``, h = silu(g) u [R, F] bf16 from the same epilogue
    (bitwise swiglu_h(gu, F): the same arithmetic) as a third. Rows past sum(counts) are left unspecified
    (moe_backward has none). ``tiles``: (BM, BN, BK, warps, stages) instead of DGRAD2_TILES (GPU). ``fused``
    (None: ``config.dgrad2_fused``): False computes z = dy_rows W2[e]^T with the dgrad1 GEMM kernel (``tiles`` its tile,
    default DGRAD1_TILES), rounded to bf16 as autograd's GEMM output is, then the epilogue's arithmetic in a pass
    of its own (_swiglu_backward_kernel): the same outputs up to that rounding of z. ``offs`` (unfused only):
    each expert's first row in the padded layout (padded_row_offsets; the gap rows of gu zero, of w_pair finite)
    with ``valid`` [R] (bool: the rows of some expert, padded_layout's real_of >= 0), whose other rows then come
    out zero in dgu, h and dw_rows: the SwiGLU pass reads z there as zeros (the GEMM leaves them unwritten)."""
    r_all, h = dy_rows.shape
    e, f, h2 = w2.shape
    if h2 != h or gu.shape != (r_all, 2 * f) or w_pair.shape != (r_all,) or counts.shape != (e,):
        raise ValueError(f"shapes disagree: dy_rows {tuple(dy_rows.shape)}, gu {tuple(gu.shape)}, w2 "
                         f"{tuple(w2.shape)}, w_pair {tuple(w_pair.shape)}, counts {tuple(counts.shape)}")
    if (offs is None) != (valid is None) or (valid is not None and valid.shape != (r_all,)):
        raise ValueError(f"offs and valid come together (the padded layout), valid shaped [{r_all}]")
    config = check_config(MoEBackwardConfig, config)
    if not (config.dgrad2_fused if fused is None else fused):
        z = expert_dgrad1(dy_rows, w2, counts, tiles=tiles, offs=offs)
        dgu = torch.empty((r_all, 2 * f), dtype=torch.bfloat16, device=dy_rows.device)
        dw_rows = torch.empty((r_all,), dtype=torch.float32, device=dy_rows.device)
        hb = torch.empty((r_all, f) if emit_h else (1,), dtype=torch.bfloat16, device=dy_rows.device)
        if r_all and f:
            br, bf = (4, 16) if planning.interpreting() else (8, min(256, triton.next_power_of_2(f)))
            has_valid = valid is not None
            _swiglu_backward_kernel[(triton.cdiv(r_all, br),)](z, gu.contiguous(), w_pair.float().contiguous(), dgu,
                                                               hb, dw_rows,
                                                               valid.contiguous().view(torch.uint8) if has_valid
                                                               else dw_rows, r_all, f, BR=br, BF=bf, EMIT_H=emit_h,
                                                               INTERP=planning.interpreting(), HAS_VALID=has_valid,
                                                               num_warps=8)
        return (dgu, dw_rows, hb) if emit_h else (dgu, dw_rows)
    if offs is not None:
        raise ValueError("expert_dgrad2_swiglu: the padded layout (offs=) runs unfused only")
    if planning.interpreting():
        bm, bn, bk, warps, stages = 16, 16, 16, 4, 1
    else:
        bm, bn, bk, warps, stages = tiles or DGRAD2_TILES
    split = config.dgrad2_split and bn >= 16
    counts32, offs, first_pad, elp2, n_m = _mtile_plan(counts, r_all, bm)  # n_m: a static m-tile bound
    n_f = -(-f // bn)
    dgu = torch.empty((r_all, 2 * f), dtype=torch.bfloat16, device=dy_rows.device)
    dwp = torch.empty((r_all, 2 * n_f if split else n_f), dtype=torch.float32, device=dy_rows.device)
    hb = torch.empty((r_all, f) if emit_h else (1,), dtype=torch.bfloat16, device=dy_rows.device)
    nk = weights_nk(w2)
    tma = h % 8 == 0 and f % 8 == 0 and dy_rows.is_contiguous() and (w2.is_contiguous() or nk) and \
        all(t.data_ptr() % 16 == 0 for t in (dy_rows, w2))
    if tma:
        runtime.ensure_triton_allocator()
    _dgrad2_swiglu_kernel[(n_m * n_f,)](dy_rows, gu.contiguous(), w2, w_pair.float().contiguous(), offs, counts32,
                                          dgu, dwp, hb, h, f, first_pad, ELP2=elp2, BM=bm, BN=bn, BK=bk,
                                          DOT_FP32=planning.interpreting(), TMA=tma, SPLIT=split, EMIT_H=emit_h,
                                          B_KN=nk, num_warps=warps, num_stages=stages)
    if emit_h:
        return dgu, sum_partials(dwp), hb
    return dgu, sum_partials(dwp)


@triton.jit
def _dgrad1_kernel(dgu_ptr, w13_ptr, offs_ptr, counts_ptr, first_mtile_ptr, dx_ptr, H, K,
                   ELP2: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr,
                   TMA: tl.constexpr = False, B_KN: tl.constexpr = False):
    """One (expert, m-tile, H-tile) of item 3: dx_rows = [dg | du] @ W13[e]^T, K = 2F (W13 [E, H, K]); any
    rows [R, K] @ W[e]^T with W [E, H, K] likewise (GEMM2's data gradient unfused: dy_rows W2[e]^T, K = H).
    B_KN: W stored [E, K, H] (transformers' layout), read as it is."""
    pid = tl.program_id(0)
    n_h = tl.cdiv(H, BN)
    _dgrad1_tile(pid // n_h, pid % n_h, dgu_ptr, w13_ptr, offs_ptr, counts_ptr, first_mtile_ptr, dx_ptr, H, K, ELP2,
                 BM, BN, BK, DOT_FP32, TMA, None, B_KN)


def expert_dgrad1(dgu: torch.Tensor, w13: torch.Tensor, counts: torch.Tensor, *, tiles=None,
                  offs=None) -> torch.Tensor:
    """Item 3 of this module's docstring: dgu [R, 2F] bf16, w13 [E, H, 2F] bf16 (contiguous, or transformers'
    [E, 2F, H] as its .transpose(1, 2)), counts [E] -> dx_rows [R, H] bf16 (rows of no expert: unspecified). ``tiles``: (BM, BN, BK, warps, stages)
    instead of DGRAD1_TILES (GPU). ``offs``: each expert's first row (the padded layout's padded_row_offsets)
    instead of the rows packed in expert order."""
    r_all = dgu.shape[0]
    e, h, f2 = w13.shape
    if dgu.shape[1] != f2 or counts.shape != (e,):
        raise ValueError(f"shapes disagree: dgu {tuple(dgu.shape)}, w13 {tuple(w13.shape)}, "
                         f"counts {tuple(counts.shape)}")
    if planning.interpreting():
        bm, bn, bk, warps, stages = 16, 16, 16, 4, 1
    else:
        bm, bn, bk, warps, stages = tiles or DGRAD1_TILES
    counts32, offs, first_mtile, elp2, n_m = _mtile_plan(counts, r_all, bm, offs)
    dx = torch.empty((r_all, h), dtype=torch.bfloat16, device=dgu.device)
    nk = weights_nk(w13)
    tma = f2 % 8 == 0 and h % 8 == 0 and dgu.is_contiguous() and (w13.is_contiguous() or nk) and \
        all(t.data_ptr() % 16 == 0 for t in (dgu, w13))
    if tma:
        runtime.ensure_triton_allocator()
    _dgrad1_kernel[(n_m * -(-h // bn),)](dgu, w13, offs, counts32, first_mtile, dx, h, f2, ELP2=elp2, BM=bm,
                                         BN=bn, BK=bk, DOT_FP32=planning.interpreting(), TMA=tma, B_KN=nk,
                                         num_warps=warps, num_stages=stages)
    return dx


def expert_weight_grads_ref(a: torch.Tensor, b: torch.Tensor, counts) -> torch.Tensor:
    """The same in fp64 (then fp32), one expert at a time (any device)."""
    out, start = [], 0
    for n in [int(c) for c in counts.tolist()]:
        out.append(a[start:start + n].double().t() @ b[start:start + n].double())
        start += n
    return torch.stack(out).float() if out else torch.empty((0, a.shape[1], b.shape[1]))


# moe_backward's expert rows in the padded layout (padded_layout) by default, for the flat wgrad loop (faster than
# the persistent kernel at every measured shape: docs/design/moe_backward.md); packed: the persistent wgrad kernel
def expert_backward_gemms(dy_rows, do_rows, x_rows, gu, w_pair, w13, w2, counts, wgrad_dtype, *, pad_offs=None,
                          valid=None, config: MoEBackwardConfig | None = None):
    """The backward's expert part on rows already grouped by local expert (the multi-launch path of
    ``moe_backward``; ``kosmos bench moe --direction bwd`` times it alone as kosmos-expert-gemms): dy_rows [R, H]
    (each row its token's output gradient), do_rows = w_pair * dy_rows, x_rows [R, H], gu [R, 2F] (GEMM1's
    g | u), w_pair [R] fp32 (the rows' gate weights) ->
      dgrad2 + SwiGLU backward + gate gradient (expert_dgrad2_swiglu, h = silu(g) u from its epilogue too, or
      swiglu_h: dgrad2_emits_h()), dW2 = h^T do and dW13 = x_rows^T [dg | du] (expert_weight_grads), dx_rows =
      [dg | du] W13^T (expert_dgrad1),
    returned as (dx_rows [R, H], dw_rows [R] fp32 -- the gate weights' gradients --, dw13, dw2 in
    ``wgrad_dtype``). ``pad_offs`` (padded_layout's): the rows in the padded layout (gap rows zero, ``valid``
    False there), both weight gradients on the flat loop (expert_weight_grads_padded); None: packed rows."""
    f, hidden = w2.shape[1], w2.shape[2]
    padded = pad_offs is not None
    nk = weights_nk(w13)
    if dgrad2_emits_h(config) or padded:  # h = silu(g) u from dgrad2's epilogue (bitwise swiglu_h's)
        dgu, dw_rows, h = expert_dgrad2_swiglu(dy_rows, gu, w2, w_pair, counts, emit_h=True,
                                               fused=False if padded else None, offs=pad_offs, valid=valid,
                                               config=config)
    else:
        dgu, dw_rows = expert_dgrad2_swiglu(dy_rows, gu, w2, w_pair, counts, config=config)
        h = swiglu_h(gu, f, config)
    # the weight gradients in the weights' layout: dW = A^T B per expert, or for transformers' layout B^T A
    # (stored [E, N, K], returned as its .transpose(1, 2) like the weight itself)
    pair2, pair13 = ((do_rows, h), (dgu, x_rows)) if nk else ((h, do_rows), (x_rows, dgu))
    if padded:  # do (gathered with dy_rows; gap rows zero) and both weight gradients on the flat loop
        dw2 = expert_weight_grads_padded(*pair2, counts, pad_offs, out_dtype=wgrad_dtype,
                                         tiles=wgrad_flat_tiles(wgrad_dtype, pair2[0].shape[1], pair2[1].shape[1]))
        dw13 = expert_weight_grads_padded(*pair13, counts, pad_offs, out_dtype=wgrad_dtype,
                                          tiles=wgrad_flat_tiles(wgrad_dtype, pair13[0].shape[1], pair13[1].shape[1]))
        dx_rows = expert_dgrad1(dgu, w13, counts, offs=pad_offs)
    else:
        dw2 = expert_weight_grads(*pair2, counts, out_dtype=wgrad_dtype,
                                  tiles=wgrad2_tiles(h, counts), config=config)  # square: either layout
        dw13 = expert_weight_grads(*pair13, counts, out_dtype=wgrad_dtype, config=config)
        dx_rows = expert_dgrad1(dgu, w13, counts)
    if nk:
        dw13, dw2 = dw13.transpose(1, 2), dw2.transpose(1, 2)
    return dx_rows, dw_rows, dw13, dw2
