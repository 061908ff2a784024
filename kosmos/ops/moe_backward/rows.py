"""The backward's row passes (one Triton launch each on CUDA or under TRITON_INTERPRET=1, torch where Triton cannot
run), each bitwise the torch line it stands for on the GPU:

* ``gather_rows`` / ``scaled_rows`` / ``gather_rows_and_scaled``: x_rows, dy_rows and do = bf16(w * dy_rows) (one
  fp32 product) from the token rows, straight into the padded layout (index -1: a zero gap row; ``limit``: rows
  past the last expert's padded end left unwritten); ``do_rows_of`` for the packed layout;
* ``unpermute_sum``: the dispatch backward -- each token's k expert rows summed in slot order in fp32;
* ``swiglu_h``: h = bf16(silu(g) u) with torch's CUDA sigmoid (``dgrad2_emits_h``: whether dgrad2's epilogue emits
  it instead); ``sum_partials``: the fused dgrad2's gate partials summed left to right.
Tests: tests/test_moe_backward.py (test_swiglu_h*, test_scaled_rows_and_unpermute_sum_bitwise_torch,
test_gather_rows_and_padded_layout, test_dgrad2_emitted_h*)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...reference import moe as mr
from ...config import MoEBackwardConfig, check_config
from ...core import planning
from .tiles import _to_out, _torch_sigmoid, _triton_runs, _unpermute_sum_cols
from .layout import _pair_rows


@triton.jit
def _sum_partials_kernel(p_ptr, out_ptr, R, NP, BLOCK: tl.constexpr):
    """out[r] = ((p[r, 0] + p[r, 1]) + p[r, 2]) + ... in fp32, left to right: the order of the per-partial
    torch adds it replaces (bitwise the same)."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = r < R
    rp = p_ptr + r.to(tl.int64) * NP
    acc = tl.load(rp, mask=m, other=0.0)
    for i in range(1, NP):
        acc += tl.load(rp + i, mask=m, other=0.0)
    tl.store(out_ptr + r, acc, mask=m)


def sum_partials(p: torch.Tensor) -> torch.Tensor:
    """[R, N] fp32 -> [R]: each row's N partials summed left to right in fp32 (one launch)."""
    out = torch.empty(p.shape[0], dtype=torch.float32, device=p.device)
    if p.shape[0]:
        block = 1024
        _sum_partials_kernel[(triton.cdiv(p.shape[0], block),)](p, out, p.shape[0], p.shape[1], BLOCK=block,
                                                                 num_warps=4)
    return out


@triton.jit
def _gather_rows_kernel(src_ptr, idx_ptr, w_ptr, out_ptr, scaled_ptr, limit_ptr, H, BH: tl.constexpr,
                        PLAIN: tl.constexpr, SCALED: tl.constexpr, RNE_BITS: tl.constexpr, HAS_LIMIT: tl.constexpr):
    """From one read of src[idx[i]]: out[i] = src[idx[i]] (PLAIN) and scaled[i] = bf16(w[i] * fp32(src[idx[i]]))
    (SCALED: one fp32 product rounded to nearest even); a row with idx[i] < 0 is zeros (the padded row layout's
    gap rows). HAS_LIMIT: rows i >= limit[0] (past the padded layout's last expert: read by no one) are not
    written at all."""
    i = tl.program_id(0)
    if HAS_LIMIT:
        if i >= tl.load(limit_ptr):
            return
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    row = tl.load(idx_ptr + i).to(tl.int64)
    m = c < H
    v = tl.load(src_ptr + tl.maximum(row, 0) * H + c, mask=c < tl.where(row >= 0, H, 0), other=0.0)
    if PLAIN:
        tl.store(out_ptr + i.to(tl.int64) * H + c, v, mask=m)
    if SCALED:
        tl.store(scaled_ptr + i.to(tl.int64) * H + c,
                 _to_out(v.to(tl.float32) * tl.load(w_ptr + i), tl.bfloat16, RNE_BITS), mask=m)


def _launch_gather_rows(src: torch.Tensor, idx: torch.Tensor, w, plain: bool, limit=None):
    """(src[idx] or None, bf16(w * src[idx]) or None) by _gather_rows_kernel (``w`` None: no scaled rows;
    ``limit``: a 1-element int tensor, rows from it on left unwritten)."""
    r, h = idx.shape[0], src.shape[1]
    if src.shape[0] == 0:  # no rows to read: every index is -1, every row zero (and no launch on an empty src)
        return (src.new_zeros((r, h)) if plain else None,
                torch.zeros((r, h), dtype=torch.bfloat16, device=src.device) if w is not None else None)
    out = torch.empty((r, h), dtype=src.dtype, device=src.device) if plain else None
    scaled = torch.empty((r, h), dtype=torch.bfloat16, device=src.device) if w is not None else None
    if r and h:
        bh = min(1024, triton.next_power_of_2(h))
        _gather_rows_kernel[(r, triton.cdiv(h, bh))](src.contiguous(), idx.contiguous(),
                                                     src if w is None else w.float().contiguous(),
                                                     src if out is None else out, src if scaled is None else scaled,
                                                     idx if limit is None else limit, h, BH=bh, PLAIN=plain,
                                                     SCALED=w is not None, RNE_BITS=planning.interpreting(),
                                                     HAS_LIMIT=limit is not None, num_warps=4)
    return out, scaled


def scaled_rows(src: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(w[:, None] * src[idx].float()).to(bf16) -- bitwise -- in one pass: src [T, H] bf16, idx [R] int, w [R]
    fp32 -> [R, H] bf16 (no gathered copy, no fp32 temporary); rows with idx < 0 are zeros."""
    return _launch_gather_rows(src, idx, w, plain=False)[1]


def gather_rows_and_scaled(src: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, limit=None):
    """(gather_rows(src, idx), scaled_rows(src, idx, w)) from one read of the rows (bitwise the two calls'):
    moe_backward's dy_rows for GEMM2's data gradient and do = w * dy_rows for its weight gradient. ``limit``:
    as gather_rows'."""
    return _launch_gather_rows(src, idx, w, plain=True, limit=limit)


def gather_rows(src: torch.Tensor, idx: torch.Tensor, limit=None) -> torch.Tensor:
    """src[idx] with zero rows where idx < 0 (the padded layout's gap rows), in one pass: src [T, H], idx [R]
    int -> [R, H] in src's dtype; torch where Triton cannot run. ``limit`` (a 1-element int tensor on the
    device, e.g. padded_layout's end): rows from limit[0] on are left unwritten (unspecified)."""
    if not _triton_runs(src):
        out = src[idx.clamp(min=0).long()]
        return out.masked_fill_((idx < 0)[:, None], 0)
    return _launch_gather_rows(src, idx, None, plain=True, limit=limit)[0]


@triton.jit
def _swiglu_h_kernel(gu_ptr, h_ptr, F, BF: tl.constexpr, INTERP: tl.constexpr):
    """h[r] = bf16((g * sigmoid(g)) * u), g | u = gu[r] in fp32, sigmoid(g) = 1 / (1 + exp(-g)) as torch's CUDA
    kernel computes it: libdevice expf (CUDA's expf) and an IEEE division (the interpreter: numpy's exp)."""
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BF + tl.arange(0, BF)
    m = c < F
    g = tl.load(gu_ptr + r * (2 * F) + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + r * (2 * F) + F + c, mask=m, other=0.0).to(tl.float32)
    s = _torch_sigmoid(g, INTERP)
    tl.store(h_ptr + r * F + c, _to_out((g * s) * u, tl.bfloat16, INTERP), mask=m)


def swiglu_h(gu: torch.Tensor, f: int, config: MoEBackwardConfig | None = None) -> torch.Tensor:
    """h = silu(g) * u -> bf16 from gu = [g | u] [R, 2F] bf16 in one pass (no fp32 copies of g, u): bitwise
    ``(g * torch.sigmoid(g) * u).to(bf16)`` of the fp32 g, u on the GPU (torch's CUDA sigmoid is 1 / (1 + expf(-x))
    with an IEEE division; test_swiglu_h_bitwise_torch_gpu), within one bf16 rounding under the interpreter (numpy's
    exp); torch where Triton cannot run, or with ``config.swiglu_h_torch``."""
    if check_config(MoEBackwardConfig, config).swiglu_h_torch or not _triton_runs(gu):
        g, u = gu[:, :f].float(), gu[:, f:].float()
        return (g * torch.sigmoid(g) * u).to(torch.bfloat16).contiguous()
    r = gu.shape[0]
    h = torch.empty((r, f), dtype=torch.bfloat16, device=gu.device)
    if r and f:
        bf = min(1024, triton.next_power_of_2(f))
        _swiglu_h_kernel[(r, triton.cdiv(f, bf))](gu.contiguous(), h, f, BF=bf, INTERP=planning.interpreting(),
                                                  num_warps=4)
    return h


def dgrad2_emits_h(config: MoEBackwardConfig | None = None) -> bool:
    """Whether moe_backward (and the probe's stages) take h from dgrad2's epilogue: ``config.dgrad2_emits_h``,
    unless h goes through the torch line (``config.swiglu_h_torch``)."""
    config = check_config(MoEBackwardConfig, config)
    return config.dgrad2_emits_h and not config.swiglu_h_torch


@triton.jit
def _unpermute_sum_kernel(rows_ptr, inv_ptr, out_ptr, H, K: tl.constexpr, BH: tl.constexpr):
    """out[t] = ((rows[inv[t*K]] + rows[inv[t*K+1]]) + ...) in fp32, slot order."""
    t = tl.program_id(0)
    c = tl.program_id(1) * BH + tl.arange(0, BH)
    _unpermute_sum_cols(t, c, c < H, rows_ptr, inv_ptr, out_ptr, H, K)


def unpermute_sum(rows: torch.Tensor, order: torch.Tensor, top_k: int, row_of=None) -> torch.Tensor:
    """The dispatch backward from expert-sorted rows: rows [P, H] (row i is pair order[i], p = t*k + j) ->
    dx_e [T, H] fp32, dx_e[t] = sum_j rows of (t, j) in slot order j = 0..k-1 -- bitwise
    reference.moe.dispatch_backward_ref of the rows put back in pair order, without the [P, H] pair-order and
    fp32 copies (one gather-sum launch; the torch path where Triton cannot run). ``row_of`` [P]: rows in a
    padded layout, sorted pair i at rows[row_of[i]] (rows then has more rows than pairs)."""
    p, h = order.shape[0], rows.shape[1]
    if not _triton_runs(rows):
        pair = torch.empty((p, h), dtype=rows.dtype, device=rows.device)
        pair[order] = rows if row_of is None else rows[row_of]
        return mr.dispatch_backward_ref(pair.float(), top_k)
    inv = _pair_rows(order, row_of)
    out = torch.empty((p // top_k, h), dtype=torch.float32, device=rows.device)
    if p and h:
        bh = min(1024, triton.next_power_of_2(h))
        _unpermute_sum_kernel[(p // top_k, triton.cdiv(h, bh))](rows.contiguous(), inv, out, h, K=top_k, BH=bh,
                                                                num_warps=4)
    return out


def do_rows_of(dy, tok, dy_rows, w_pair, world: int) -> torch.Tensor:
    """GEMM2's weight-gradient operand do = w_pair * dy_rows (bf16, one fp32 product per element; bitwise
    ``(w_pair[:, None] * dy_rows.float()).to(bf16)``): at W=1 straight from dy's token rows (dy_rows[i] =
    dy[tok[i]]), at W > 1 from the received dy_rows; torch where Triton cannot run."""
    if not _triton_runs(dy_rows):
        return (w_pair[:, None] * dy_rows.float()).to(torch.bfloat16).contiguous()
    if world == 1:
        return scaled_rows(dy.to(torch.bfloat16), tok, w_pair)
    return scaled_rows(dy_rows, torch.arange(dy_rows.shape[0], device=dy_rows.device), w_pair)
