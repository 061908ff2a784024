"""The router backward as stages of the one launch (one_launch.py; ``RouterBackward`` carries its inputs). Per token
t, from the fp32 logits l_t (recomputed before the launch by api.bf16_mm_fp32) and the rows' gate gradients:
    dw[t, j] = dw_rows[inv[t*k + j]]
    softmax          p = softmax(l_t) (max subtracted, libdevice expf, one IEEE reciprocal of the sum), q_j = p[e_j]
    sigmoid-grouped  q_j = sigmoid(l_t[e_j])      (the bias and the group limit only chose e_j: no gradient)
    renormalize      S = sum_j q_j + 1e-20, w_j = c q_j / S, dq_j = (c dw_j - <dw, w>) / S;  else dq_j = c dw_j
    softmax          dl_t = p (dp - <dq, q>), dp = dq at the selected experts, 0 elsewhere
    sigmoid-grouped  dl_t[e_j] = dq_j q_j (1 - q_j), 0 at the other experts
    hi = bf16(dl), lo = bf16(dl - hi)             dl_hl [T, 2 * EP] bf16: hi in [0, E), lo in [EP, EP + E), EP = E
                                                  rounded up to 8 (16-byte aligned halves for TMA)
    d_router = hi^T x + lo^T x  [E, H] fp32       dx = bf16(dx_e + hi Wr + lo Wr)  [T, H]
(c = routed_scaling; reference.moe's router_weights_backward_ref, router_logits_backward_ref,
router_gemm_backward_ref.) Stages: ROUTER_DL (``_router_dlogits_block``, BWD_ROUTER_TOKENS tokens a task),
ROUTER_DW (``_router_dw_stage`` / ``_router_dw_tile``: BWD_ROUTER_DW_TILES dWr tiles, tokens ascending), ROUTER_DX
(``_router_dx_tile``: BWD_ROUTER_DX_TILES dx tiles, experts ascending); their waits: one_launch.py's docstring.
The products of bf16 values are exact in fp32, so both GEMMs are fp32 GEMMs to ~2^-17 relative on bf16 tensor
cores; every row and tile is one task's in a fixed order (no float atomics): bitwise the same on every run and
grid, fp32-level against the torch router. Tests: tests/test_moe_backward.py
(test_moe_backward_one_launch_router_in_launch*, test_moe_backward_one_launch_router_bounded_wait_gpu, the
bounded-waits cases with ROUTER_DL or UNPERMUTE left out)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...core import device as dev
from ...core import planning
from ...core import schedule as sched
from ...core.codes import EV_BWD_ROUTER_DW, EV_WAIT, OP_MOE_BACKWARD, WAIT_BWD_ROUTER_DL
from .tiles import _to_out, _torch_sigmoid, _trace_clock
from .layout import SCB_ROUTER_DL_DONE, STAGE_BWD_ROUTER_DW

try:  # libdevice's expf (Triton >= 3.0 spells it this way)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    from triton.language.extra.cuda import libdevice


BWD_ROUTER_TOKENS = 8  # tokens per ROUTER_DL task (GPU): [8, next_pow2(E)] fp32 blocks (spill-free in the launch)

# the router GEMMs' tiles (GPU): dx_r = dl Wr (BM x BN over [T, H], BK of E per step) and dWr = dl^T x (BI x BJ
# over [E, H], BR tokens per step); hi and lo dl tiles share one TMA load of the Wr / x tile per step
BWD_ROUTER_DX_TILES = (128, 128, 64, 3)  # (BM, BN, BK, stages)
BWD_ROUTER_DW_TILES = (128, 128, 64, 3)  # (BI, BJ, BR, stages)


@triton.jit
def _expf(v, INTERP: tl.constexpr):
    """exp in fp32 as torch's CUDA kernels compute it (libdevice expf; the interpreter: numpy's exp)."""
    if INTERP:
        return tl.exp(v)
    else:
        return libdevice.exp(v)


@triton.jit
def _router_slot(j, tok64, tm, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, ER, mx, rs, TOPK: tl.constexpr,
                 SOFTMAX: tl.constexpr, INTERP: tl.constexpr):
    """Slot j of the tokens tok64 [UT] (those with tm): (e_j, q_j, dw_j) [UT] -- the selected expert, its routing
    probability p[e_j] (softmax: exp(l - mx) * rs, the full row's operations) or score sigmoid(l[e_j]), and the
    pair's gate gradient dw_rows[inv[t*k + j]]."""
    pair = tok64 * TOPK + j
    e_j = tl.load(experts_ptr + pair, mask=tm, other=0).to(tl.int64)
    l_j = tl.load(logits_ptr + tok64 * ER + e_j, mask=tm, other=0.0)
    if SOFTMAX:
        q_j = _expf(l_j - mx, INTERP) * rs
    else:
        q_j = _torch_sigmoid(l_j, INTERP)
    dw_j = tl.load(dw_rows_ptr + tl.load(inv_ptr + pair, mask=tm, other=0).to(tl.int64), mask=tm, other=0.0)
    return e_j, tl.where(tm, q_j, 0.0), dw_j


@triton.jit
def _router_dlogits_block(b, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, dlhl_ptr, T, ER, EP, c,
                          TOPK: tl.constexpr, ERP2: tl.constexpr, UT: tl.constexpr,
                          SOFTMAX: tl.constexpr, RENORM: tl.constexpr, INTERP: tl.constexpr):
    """The one launch's ROUTER_DL task b: tokens [b*UT, b*UT + UT), each row on its own (this module's
    docstring): the gate gradients dw[t, j] = dw_rows[inv[t*k + j]] (the pairs' rows, the
    multi-launch path's dweights scatter), the routing recomputed from the fp32 logits (q_j = p[e_j] or s[e_j],
    S = sum_j q_j + 1e-20, w_j = c q_j / S or c q_j), dq (router_weights_backward_ref) and dl [UT, ER]
    (router_logits_backward_ref: softmax p (dp - <dq, q>), sigmoid dq s (1 - s) at the selected experts), stored
    split for the bf16 tensor cores as hi = bf16(dl) into dlhl[t, 0:ER] and lo = bf16(dl - hi) into dlhl[t, EP:EP+ER]
    (round to nearest even; columns ER..EP of each half are never written and never read). The k slots in
    static loops over [UT] vectors (each slot's values reloaded per pass, from L1: fewer registers than [UT, k]
    tiles -- the one launch has none to spare); the sums over the slots in slot order."""
    tok = b * UT + tl.arange(0, UT)
    tm = tok < T
    tok64 = tl.minimum(tok, T - 1).to(tl.int64)  # past T: a valid row, nothing stored
    cols = tl.arange(0, ERP2)
    i = tl.minimum(tok, T - 1) - b * UT  # the block's rows from its first token: int32 offsets inside the block
    mx = tl.zeros((UT,), dtype=tl.float32)
    rs = tl.zeros((UT,), dtype=tl.float32)
    if SOFTMAX:
        lg = tl.load(logits_ptr + (b * UT).to(tl.int64) * ER + (i[:, None] * ER + cols[None, :]),
                     mask=(cols < ER)[None, :], other=float("-inf"))
        mx = tl.max(lg, 1)
        rs = tl.math.div_rn(tl.full(mx.shape, 1.0, tl.float32), tl.sum(_expf(lg - mx[:, None], INTERP), 1))
    denom = tl.zeros((UT,), dtype=tl.float32)
    dww = tl.zeros((UT,), dtype=tl.float32)
    if RENORM:  # S, then <dw, w> (w_j = (q_j / S) c: route's and routing_weights_ref's order)
        for j in tl.static_range(TOPK):
            e_j, q_j, dw_j = _router_slot(j, tok64, tm, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, ER, mx, rs,
                                          TOPK, SOFTMAX, INTERP)
            denom += q_j
        denom = denom + 1e-20
        for j in tl.static_range(TOPK):
            e_j, q_j, dw_j = _router_slot(j, tok64, tm, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, ER, mx, rs,
                                          TOPK, SOFTMAX, INTERP)
            dww += dw_j * (tl.math.div_rn(q_j, denom) * c)
    dp = tl.zeros((UT, ERP2), dtype=tl.float32)  # softmax: dq at the selected experts; sigmoid: dl itself
    r = tl.zeros((UT,), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        e_j, q_j, dw_j = _router_slot(j, tok64, tm, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, ER, mx, rs, TOPK,
                                      SOFTMAX, INTERP)
        if RENORM:
            dq_j = tl.math.div_rn(c * dw_j - dww, denom)
        else:
            dq_j = c * dw_j
        if SOFTMAX:
            r += dq_j * q_j
            dp = tl.where(cols[None, :] == e_j[:, None], dq_j[:, None], dp)
        else:
            dp = tl.where(cols[None, :] == e_j[:, None], (dq_j * q_j * (1.0 - q_j))[:, None], dp)
    if SOFTMAX:
        p = _expf(lg - mx[:, None], INTERP) * rs[:, None]
        dl = p * (dp - r[:, None])
    else:
        dl = dp
    hi = _to_out(dl, tl.bfloat16, INTERP)
    lo = _to_out(dl - hi.to(tl.float32), tl.bfloat16, INTERP)
    o = i[:, None] * (2 * EP) + cols[None, :]
    cm = tm[:, None] & (cols < ER)[None, :]
    row0 = dlhl_ptr + (b * UT).to(tl.int64) * (2 * EP)
    tl.store(row0 + o, hi, mask=cm)
    tl.store(row0 + EP + o, lo, mask=cm)


@triton.jit
def _router_dw_tile(ti, tj, hi_desc, lo_desc, x_desc, dwr_ptr, T, H, ER, BI: tl.constexpr, BJ: tl.constexpr,
                    BR: tl.constexpr, DOT_FP32: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """The one launch's ROUTER_DW task (ti, tj): dWr[ti-tile, tj-tile] = sum over the tokens in ascending order, BR
    per step, of hi^T x + lo^T x (one fp32 accumulator; the hi and lo tiles share the step's x tile) -- the
    d(router weight) tile [BI, BJ] fp32, stored once. Tokens past T and experts past ER read as zeros (TMA)."""
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    for r in tl.range(0, T, BR, num_stages=LOOP_STAGES):
        b = x_desc.load([r, tj * BJ])
        a = hi_desc.load([r, ti * BI])
        if DOT_FP32:
            acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc)
        else:
            acc = tl.dot(tl.trans(a), b, acc)
        a = lo_desc.load([r, ti * BI])
        if DOT_FP32:
            acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc)
        else:
            acc = tl.dot(tl.trans(a), b, acc)
    ci = ti * BI + tl.arange(0, BI)
    cj = tj * BJ + tl.arange(0, BJ)
    tl.store(dwr_ptr + ci[:, None].to(tl.int64) * H + cj[None, :], acc, mask=(ci < ER)[:, None] & (cj < H)[None, :])


@triton.jit
def _router_dx_tile(m, n, hi_desc, lo_desc, wr_desc, dx_e_ptr, dx_ptr, T, H, ER, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr, LOOP_STAGES: tl.constexpr):
    """The one launch's ROUTER_DX task (m, n): dx_r = hi Wr + lo Wr over the experts in ascending order, BK per
    step (one fp32 accumulator; hi and lo share the step's Wr tile), then dx = bf16(dx_e + dx_r) for tokens
    [m*BM, +BM), columns [n*BN, +BN) -- moe_backward's (dx_e + dx_r).to(bf16), the dispatch backward's fp32 rows
    read back from dx_e (UNPERMUTE's). Experts past ER read as zeros (TMA), tokens past T are not stored."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in tl.range(0, ER, BK, num_stages=LOOP_STAGES):
        b = wr_desc.load([k0, n * BN])
        a = hi_desc.load([m * BM, k0])
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
        a = lo_desc.load([m * BM, k0])
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    rows = m * BM + tl.arange(0, BM)
    cols = n * BN + tl.arange(0, BN)
    mask = (rows < T)[:, None] & (cols < H)[None, :]
    o = rows[:, None].to(tl.int64) * H + cols[None, :]
    dx_e = tl.load(dx_e_ptr + o, mask=mask, other=0.0)
    tl.store(dx_ptr + o, _to_out(dx_e + acc, tl.bfloat16, DOT_FP32), mask=mask)


@triton.jit
def _router_dw_stage(scratch_ptr, take, ok, n_ev, pid, dlhl_ptr, x_ptr, dwr_ptr, T, H, ER, EP, timeout_ns, err_ptr,
                     trace_ptr, RUT: tl.constexpr, RW_BI: tl.constexpr, RW_BJ: tl.constexpr, RW_BR: tl.constexpr,
                     DOT_FP32: tl.constexpr, R_STAGES: tl.constexpr, TRACE: tl.constexpr):
    """The ROUTER_DW stage's loop (this module's docstring): dWr = dl^T x per [E, H] tile, after one wait per program on
    every dlogits block; ``take``: whether this program takes the stage (_takes). Returns (ok, n_ev)."""
    if take & (ok != 0):
        t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DW)
        n_wj = tl.cdiv(H, RW_BJ)
        waited = 0
        while (t < tl.cdiv(ER, RW_BI) * n_wj) & (ok != 0):
            t0 = _trace_clock(TRACE)
            if waited == 0:  # once per program: every dlogits block (the reduction runs over all tokens)
                ok = dev.wait_geq(scratch_ptr + SCB_ROUTER_DL_DONE, tl.cdiv(T, RUT), timeout_ns, err_ptr,
                                  OP_MOE_BACKWARD, WAIT_BWD_ROUTER_DL, 0, t, -1)
                waited = 1
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                t0 = t1
            if ok != 0:
                hi_w = tl.make_tensor_descriptor(dlhl_ptr, shape=[T, ER], strides=[2 * EP, 1],
                                                 block_shape=[RW_BR, RW_BI])
                lo_w = tl.make_tensor_descriptor(dlhl_ptr + EP, shape=[T, ER], strides=[2 * EP, 1],
                                                 block_shape=[RW_BR, RW_BI])
                x_w = tl.make_tensor_descriptor(x_ptr, shape=[T, H], strides=[H, 1], block_shape=[RW_BR, RW_BJ])
                _router_dw_tile(t // n_wj, t % n_wj, hi_w, lo_w, x_w, dwr_ptr, T, H, ER, RW_BI, RW_BJ, RW_BR,
                                DOT_FP32, R_STAGES)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_ROUTER_DW, t, t0, _trace_clock(TRACE), TRACE)
            t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DW)
    return ok, n_ev


class RouterBackward(NamedTuple):
    """The router backward's inputs for the one launch (expert_backward_one_launch(router=)): the layer's input x
    [T, H] and router weight [E, H] (both used as bf16, as moe_backward's tensor-core router GEMMs use them), the
    fp32 logits [T, E] (recomputed before the launch by bf16_mm_fp32(x, router_weight.t())), the decision experts
    [T, k], and the routing's differentiable part: ``routing`` ("softmax" or "sigmoid-grouped": the bias and the
    groups only chose the experts, they get no gradient), ``renormalize``, ``routed_scaling``."""
    x: torch.Tensor
    router_weight: torch.Tensor
    logits: torch.Tensor
    experts: torch.Tensor
    routing: str = "softmax"
    renormalize: bool = True
    routed_scaling: float = 1.0


def _router_tiles():
    """The router stages' tiles: (tokens per ROUTER_DL task, (BM, BN, BK) of dx_r, (BI, BJ, BR) of dWr, stages)."""
    if planning.interpreting():
        return 4, (16, 16, 16), (16, 16, 16), 1
    if BWD_ROUTER_DX_TILES[3] != BWD_ROUTER_DW_TILES[3]:
        raise ValueError(f"the router's dx and dWr tiles need one stage count: {BWD_ROUTER_DX_TILES}, "
                         f"{BWD_ROUTER_DW_TILES}")
    return BWD_ROUTER_TOKENS, BWD_ROUTER_DX_TILES[:3], BWD_ROUTER_DW_TILES[:3], BWD_ROUTER_DX_TILES[3]
