"""The MoE layer's MXFP8 backward (``moe_backward(precision="mxfp8")``): the backward of moe_forward's MXFP8 layer,
every backward GEMM on MX operands -- reference.moe.moe_backward_ref(mx=True)'s stages, its "MXFP8" rules:

  GEMM                    operands (both rounded to MX, blocks of 32 along the GEMM's K)         K
  GEMM1 (recomputed)      x_rows Q_H,  W13[e] Q_H  (the forward's MX values: g | u as it had it)  H
  dgrad2  z = dy W2^T     dy_rows Q_H, W2[e] Q_H   (then dh = w z, the gate gradient <z, h>)       H
  wgrad2  dW2 = h^T do    h Q_R,       do = bf16(w dy) Q_R                                         rows
  dgrad1  dx = dgu W13^T  [dg | du] Q_2F,  W13[e] Q_2F                                             2F
  wgrad1  dW13 = x^T dgu  x_rows Q_R,  [dg | du] Q_R                                               rows
Q_R: blocks of 32 rows of one expert, from its first row (``quant.round_to_mx_rows``). Every operand is rounded
from its bf16 values (x, dy, the bf16 weights; h, do, [dg | du] as the bf16 kernels produce them), so each GEMM
rounds its own operands: x's wgrad operand is x's bf16 rows rounded along the rows, not the forward's MX values.
The SwiGLU backward, the gate gradient and the router backward stay fp32 (on the bf16 x and router weight, as
the forward's router), and the gradients pass straight through every quantizer to x and to the bf16 weights.
(The TP linears' MX backward in kosmos.nn is another rule: the forward's MX operands, dy in bf16.)

Path: the multi-launch path on the padded row layout only (each expert's rows from a multiple of 64, gap rows zero:
a row block never spans two experts, and a gap row changes no scale), at any W (the exchanges move bf16 rows; the
rounding is per row along H, or per expert along the rows, so it commutes with them). Rounding passes are
separate launches around the bf16 backward's kernels, whose compiled code is unchanged: ``round_to_mx`` (rows
along H / 2F: x_rows and dy_rows before their GEMMs, [dg | du] before dgrad1) and ``round_to_mx_rows`` (h, do,
x_rows, [dg | du] before the weight gradients). The weights' backward MX values come in ``MoEMXWeights`` (what
nn.MoE caches until a parameter changes) or are rounded per call. Not covered (one-line ValueErrors in
moe_backward): the one launch (W = 1 and W > 1), the packed layout, a saved g | u (the forward saves none at
MXFP8: g | u is recomputed on the MX operands), H or F not multiples of 32.

Determinism: the rounding passes are elementwise per block (no atomics); the kernels' orders as in bf16 -- the
gradients are bitwise reproducible. Tests: tests/test_moe_backward.py (test_moe_backward_mx*), the reference:
tests/test_moe_reference.py (test_mx_backward_reference_matches_autograd_of_the_rounded_math)."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ... import quant
from ...config import MoEBackwardConfig
from ..moe_forward import weights_nk
from .multi_launch import expert_dgrad1, expert_dgrad2_swiglu, expert_weight_grads_padded
from .tiles import wgrad_flat_tiles


class MoEMXWeights(NamedTuple):
    """The MX values of an MoE layer's expert weights that its MXFP8 forward and backward multiply, each in the
    weight's layout (contiguous, or transformers' ``.transpose(1, 2)`` view): ``w13`` / ``w2`` the forward's
    (blocks along H and along F: moe_forward(precision="mxfp8")'s w13 / w2; w13's is also the backward's GEMM1
    recompute), ``w13_bwd`` blocks along 2F (dgrad1's K), ``w2_bwd`` blocks along H (dgrad2's K)."""
    w13: torch.Tensor
    w2: torch.Tensor
    w13_bwd: torch.Tensor
    w2_bwd: torch.Tensor


def mx_like(w: torch.Tensor, dim: int) -> torch.Tensor:
    """The MX values (bf16) of an expert weight w [E, K, N] with blocks of 32 along ``dim`` (1 or 2), in w's layout:
    contiguous for a contiguous w, else (transformers' layout, moe_forward.weights_nk) the .transpose(1, 2) of a
    contiguous tensor, as w is."""
    if weights_nk(w):
        return quant.mx_values(w.transpose(1, 2), dim=3 - dim).transpose(1, 2)
    return quant.mx_values(w, dim=dim)


def moe_mx_weights(w13: torch.Tensor, w2: torch.Tensor) -> MoEMXWeights:
    """The four MX copies of the experts' bf16 weights w13 [E, H, 2F] / w2 [E, F, H] (MoEMXWeights; four rounding
    passes over the weights, 2 bytes per element each)."""
    with torch.no_grad():
        return MoEMXWeights(mx_like(w13, 1), mx_like(w2, 1), mx_like(w13, 2), mx_like(w2, 2))


def check_mx_weights(mxw, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """One-line ValueErrors: ``mxw`` must be a MoEMXWeights of w13 / w2's shapes, bf16, on their device."""
    if not isinstance(mxw, MoEMXWeights):
        raise ValueError(f"mx_weights must be a MoEMXWeights (moe_mx_weights(w13, w2)), got {type(mxw).__name__}")
    for name, t, like in zip(MoEMXWeights._fields, mxw, (w13, w2, w13, w2)):
        if not isinstance(t, torch.Tensor) or t.shape != like.shape or t.dtype != torch.bfloat16 \
                or t.device != like.device:
            raise ValueError(f"mx_weights.{name} must be a bf16 tensor of shape {tuple(like.shape)} on {like.device}, "
                             f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")


def expert_gemm1_operand(x_rows: torch.Tensor) -> torch.Tensor:
    """x_rows' MX values along H (the forward's GEMM1 operand, for the g | u recompute): round_to_mx per row (the
    padded layout's gap rows stay zero; rows past its end, unwritten, are rounded and read by no one)."""
    return quant.round_to_mx(x_rows) if x_rows.numel() else x_rows


def expert_backward_gemms_mx(dy_rows, do_rows, x_rows, gu, w_pair, mxw: MoEMXWeights, counts, wgrad_dtype, *,
                             pad_offs, valid, nk: bool, config: MoEBackwardConfig | None = None):
    """The MXFP8 expert part (the module docstring's table) on rows in the padded layout (padded_layout: pad_offs,
    ``valid`` the rows of some expert): dy_rows, do_rows = bf16(w_pair * dy_rows), x_rows [R, H] bf16 (gap rows
    zero), gu [R, 2F] (GEMM1 on the MX operands), w_pair [R] fp32; ``mxw``: the MX weights (w13_bwd, w2_bwd used
    here); ``nk``: the master weights in transformers' layout (the weight gradients come back in it).
    Returns (dx_rows [R, H] bf16, dw_rows [R] fp32 -- the gate gradients --, dw13, dw2 in ``wgrad_dtype``), as
    multi_launch.expert_backward_gemms does for bf16."""
    dy_q = quant.round_to_mx(dy_rows) if dy_rows.numel() else dy_rows
    dgu, dw_rows, h = expert_dgrad2_swiglu(dy_q, gu, mxw.w2_bwd, w_pair, counts, emit_h=True, fused=False,
                                           offs=pad_offs, valid=valid, config=config)
    rows_mx = lambda t: quant.round_to_mx_rows(t) if t.numel() else t  # noqa: E731
    h_r, do_r, x_r, dgu_r = rows_mx(h), rows_mx(do_rows), rows_mx(x_rows), rows_mx(dgu)
    pair2, pair13 = ((do_r, h_r), (dgu_r, x_r)) if nk else ((h_r, do_r), (x_r, dgu_r))
    dw2 = expert_weight_grads_padded(*pair2, counts, pad_offs, out_dtype=wgrad_dtype,
                                     tiles=wgrad_flat_tiles(wgrad_dtype, pair2[0].shape[1], pair2[1].shape[1]))
    dw13 = expert_weight_grads_padded(*pair13, counts, pad_offs, out_dtype=wgrad_dtype,
                                      tiles=wgrad_flat_tiles(wgrad_dtype, pair13[0].shape[1], pair13[1].shape[1]))
    dx_rows = expert_dgrad1(quant.round_to_mx(dgu) if dgu.numel() else dgu, mxw.w13_bwd, counts, offs=pad_offs)
    if nk:
        dw13, dw2 = dw13.transpose(1, 2), dw2.transpose(1, 2)
    return dx_rows, dw_rows, dw13, dw2
