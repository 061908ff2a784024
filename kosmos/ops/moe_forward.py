"""The whole MoE expert layer (forward) in one self-scheduling persistent launch: ``moe_forward``; the expert GEMMs
alone: ``expert_gemms``. The why, the parked alternatives and registers: docs/design/moe_forward.md; measurements:
docs/perf/moe_forward.md (MXFP8: docs/perf/quant.md); runtime, epochs, waits, the policy: docs/design/core.md.

Math (rank r of W; T tokens per rank, the same T on every rank; E experts, El = E/W per rank, top-k):
    (w, e)   = route(x @ Wr^T)                x [T, H] bf16, Wr [E, H]; logits, scores and weights in fp32
    h_p      = silu(x_t @ W13[e][:, :F]) * (x_t @ W13[e][:, F:])     one row per (token t, slot j), e = e[t, j]
    o_p      = h_p @ W2[e]                    (h_p rounded to bf16 once, o_p rounded to bf16 once)
    y[t]     = sum_{j=0..k-1} w[t, j] * o_(t, j)      in fp32, in slot order j = 0..k-1, rounded to bf16
Routing: ``softmax`` (p = softmax(logits), top-k of p, optional renormalisation) or ``sigmoid-grouped``
(DeepSeek-V3: s = sigmoid(logits); choice = s + bias; a group's score is the sum of its top-2 choices; keep
the topk_group best groups; top-k of choice inside them; w = s[e], renormalised, times routed_scaling) -- or
``given``: no router, (w, e) passed in by the caller (transformers' ExpertsInterface), put into the routing
buffers by the host and loaded by ROUTE.
Ties pick the lowest expert index. Global expert g lives on rank g // El as local expert g % El. E <= 256,
top_k <= 16, H and F multiples of 8 (32 for MXFP8). Shared experts are not part of this op (run them beside it).
The math, bf16 and MXFP8: kosmos/reference/moe.py.

Stages (one queue each, one atomic head in local scratch), in drain order, and what each task waits for:
  ROUTE(b)       tokens [b*RB, +RB): logits (tensor cores, fp32 accumulate), top-k, weights (routing given:
                 the block's given weights and experts, loaded); then the dispatch
                 (EP exchange 1): each token pushed ONCE per destination rank d holding any of its experts into
                 d's receive region of source r (slot = an atomic counter per d), each [RB, BH] block of x loaded
                 once and stored to every destination, with a metadata row (token; per slot j d's local expert
                 or -1 and the pair's index among r's rows for that expert, from an atomic per-expert counter).
                 The rank's last ROUTE task publishes the per-expert counts and row count to every d, then raises
                 d's flag FLAG_BASE + r = epoch. Waits: before a program's first push, every peer's done flag
                 >= epoch - 1 (the peers finished reading the previous call's rows).
  PERMUTE(s, b)  received rows [b*PB, +PB) of source s (own source first): each row copied to each of its local
                 experts' contiguous row ranges (expert-major, sources in rank order inside an expert); placed
                 rows counted per expert. Waits (a program's first PERMUTE / GEMM task, ``_ensure_plan``): every
                 source's flag >= epoch, then the plan -- the per-expert row offsets, first m-tile per expert and
                 each source's base inside each expert, computed once per call into local memory by a
                 CAS-elected program.
  GEMM1(tile)    rows [m*BM, +BM) of local expert le, BNH gate + BNH up columns, SwiGLU in the epilogue, h
                 stored bf16 (``save_gu``: also g | u); finished column tiles counted per m-tile. An expert's
                 last m-tile of at most BM/2 rows runs as a half-height tile (``half_tail``). Waits: all of the
                 expert's rows placed.
  GEMM2(tile)    rows [m*BM, +BM) of le, BN output columns; the epilogue (EP exchange 2, the combine) stores each
                 row straight into the combine buffer of its token's rank at [t, j] (remote stores, four column
                 quarters), then adds 1 to that rank's fold counter of the token's block (release, system
                 scope). Waits: every GEMM1 column tile of its m-tile.
  FOLD(b)        tokens [b*FB, +FB) of this rank: y = sum_j w[t, j] o_(t, j) in slot order, then the counter
                 reset to 0. Waits: the block's fold counter = tokens * k * ceil(H / BN) (every row piece from
                 every rank).
A GEMM task index maps to (expert, m-tile, n-tile) through the plan; inside an expert all m-tiles of one n-tile
are consecutive, so a weight tile is read from HBM once while it is hot in L2. Tiles: ``planning.moe_config``.

Determinism: every output row is one dot product per element (independent of which rows share a tile), and the
fold sums in slot order in fp32, so y is bitwise reproducible although row placement inside an expert depends on
atomics.

Synchronisation (per rank q): the epoch is the workspace's device slot + 1, read by every program at its start,
advanced by the last one out of the call's FINAL launch. Signals FLAG_BASE + s: source s's rows, metadata and
counts for q are written. Symmetric counters [0, ceil(T/FB)): fold counters, added to by every rank's GEMM2,
reset by their consumer (peers add again only after q's next dispatch). Local scratch (zeroed by the last program
out, ``exit_program_zeroing``): queue heads, exit counter, plan state, routed-task count, send counters,
per-expert pair counters, placed-row counters, finished-GEMM1-tile counters. Combine writes need no handshake:
they follow the owner's own dispatch of this call.

Policy (schedule.py's loop, stepping one stage at a time with ``has_stage``): self -- every program takes tasks in
stage order, moving on when a queue is exhausted; fixed -- programs pid < S only move data (ROUTE, PERMUTE,
FOLD), the others only run the expert GEMMs. Deadlock-freedom: a task waits only on tasks of earlier stages (all
claimed by running programs before any program moves on, or, under fixed, by the other role, which never waits on
it) or on peers' earlier stages, which never wait on this rank's later stages; every wait is bounded
(``device.wait_geq``, the stage named in the error record: codes.WAIT_MOE_*), and after a timeout the loop drains.

Workspace: symmetric data = receive rows [W, T, H] + metadata [W, T, 1+2k] + counts [W, El+1] + combine
[T, k, H]; local = routing [T, k] x2, expert rows [W*T*min(k, El), H] + their (source, token, slot),
SwiGLU output [W*T*min(k, El), F], plan, scratch: sized for the worst case (every token of every rank to
this rank's experts), so no call can overflow. ``save_gu``'s g | u is not workspace: a fresh tensor per call,
returned as a ``SavedGateUp`` (``in_backward_order``: the backward's unique row order, atomics-independent).

MXFP8 (``precision="mxfp8"``): x is quantized before the launch (quant.quantize_mx; on a plan hit
quant.quantize_planned); ROUTE routes on the bf16 x and pushes each token's E4M3 payload (as bf16 pairs) and its
E8M0 scales (after the payload in the receive region, addressed by int32 offsets: W * T * H/32 < 2**31); PERMUTE
dequantizes while it places the rows (exact: bf16 expert rows, so both GEMMs stay bf16 MMAs); GEMM1's epilogue
rounds h to bf16 and then to its MX values (quant.mx_round_bf16, blocks of 32 along F, in two column halves);
the weights arrive as their MX values. The dispatch moves 0.52x of the bf16 bytes; the combine stays bf16.

Tests: tests/test_moe_forward.py (against the reference at simulated W = 1, 2, 4 and on GPUs, MXFP8, routing
given (against the reference, and bitwise the routed launch on the router's decision), device epochs and replays, skewed and empty experts, fixed role and determinism, SavedGateUp's order, traces, input
checks, shape agreement across ranks, timeouts and a stalled peer, nn.MoE), test_moe_reference.py,
test_cuda_graphs.py, test_ranks_one_gpu.py.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..config import MoEForwardConfig, check_config
from ..core import device as dev
from ..core import launch_plan, planning, runtime
from ..core import schedule as sched
from ..core.codes import (EV_COMM, EV_PERMUTE, EV_ROUTE, EV_WAIT, OP_MOE_FORWARD, WAIT_MOE_COMBINE,
                     WAIT_MOE_DISPATCH, WAIT_MOE_GEMM1, WAIT_MOE_PERMUTE, WAIT_MOE_PLAN)
from ..core.schedule import POLICIES, check_launch, policy_args
from ..gemm.tiles import store_block, store_rows
from ..quant import mx_round_bf16, mx_scale_f32, quantize_mx, quantize_plan, quantize_planned
from ..reference.moe import GIVEN, ROUTING_KINDS, check_given_routing

OP_CODE = OP_MOE_FORWARD.value
# the stages, in schedule.py's drain order (host: bit positions of the ``stages`` mask of ``launch``)
ROUTE, PERMUTE, GEMM1, GEMM2, FOLD = 0, 1, 2, 3, 4
ALL_STAGES = 0b11111
COMM_STAGES = (1 << ROUTE) | (1 << PERMUTE) | (1 << FOLD)
COMPUTE_STAGES = (1 << GEMM1) | (1 << GEMM2)
STAGE_ROUTE: tl.constexpr = tl.constexpr(ROUTE)
STAGE_PERMUTE: tl.constexpr = tl.constexpr(PERMUTE)
STAGE_GEMM1: tl.constexpr = tl.constexpr(GEMM1)
STAGE_GEMM2: tl.constexpr = tl.constexpr(GEMM2)
STAGE_FOLD: tl.constexpr = tl.constexpr(FOLD)
NUM_STAGES: tl.constexpr = tl.constexpr(5)
COMM_STAGE_MASK: tl.constexpr = tl.constexpr(COMM_STAGES)
# a finished task's trace kind: EV_COMM for ROUTE's dispatch half, else EV_PERMUTE + (stage - PERMUTE)
assert [EV_PERMUTE.value + s - PERMUTE for s in (PERMUTE, GEMM1, GEMM2, FOLD)] == [5, 6, 7, 8]
ZERO_BLOCK: tl.constexpr = tl.constexpr(1024)  # scratch entries the last program out zeroes per step
MAX_TOPK = 16
MAX_EXPERTS = 256  # the router keeps all logits of a token block in one tile

# local scratch layout (int32): [0, 5) queue heads, then the exit counter, plan state, finished ROUTE tasks,
# rows sent per destination [MAX_WORLD], pairs per global expert [MAX_EXPERTS], placed rows per local expert
# [El], finished GEMM1 column tiles per m-tile [max m-tiles]
SC_EXIT: tl.constexpr = tl.constexpr(5)
SC_PLAN: tl.constexpr = tl.constexpr(6)
SC_ROUTED: tl.constexpr = tl.constexpr(7)
SC_SEND: tl.constexpr = tl.constexpr(8)
SC_CNT: tl.constexpr = tl.constexpr(16)
SC_PERM: tl.constexpr = tl.constexpr(16 + MAX_EXPERTS)


def _p2(x: int, lo: int = 2) -> int:
    return max(lo, 1 << max(0, math.ceil(math.log2(max(1, x)))))


# ------------------------------------------------------------------------------------------------ device
@triton.jit
def _route_block(b, x_desc, wr_desc, bias_ptr, topk_w_ptr, topk_e_ptr, T, H, E, routed_scaling,
                 TOPK: tl.constexpr, KP2: tl.constexpr, EP2: tl.constexpr, ROUTING: tl.constexpr,
                 RENORM: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, NGP2: tl.constexpr,
                 RB: tl.constexpr, BK: tl.constexpr, DOT_FP32: tl.constexpr):
    """Router of tokens [b*RB, +RB): returns (weights [RB, KP2] fp32, experts [RB, KP2] int32) and stores
    them for the fold (slots >= TOPK are padding). ROUTING == 2 (``given``): no router -- the caller's decision,
    which the host put into topk_w / topk_e before the launch, is loaded (wr_desc, bias are not read)."""
    if ROUTING == 2:
        g_rows = b * RB + tl.arange(0, RB)
        g_cols = tl.arange(0, KP2)[None, :]
        g_mask = (g_rows < T)[:, None] & (g_cols < TOPK)
        sel_w = tl.load(topk_w_ptr + g_rows[:, None] * TOPK + g_cols, mask=g_mask, other=0.0)
        sel_e = tl.load(topk_e_ptr + g_rows[:, None] * TOPK + g_cols, mask=g_mask, other=0)
    else:  # ROUTING 0 / 1: the router
        t0 = b * RB
        acc = tl.zeros((RB, EP2), dtype=tl.float32)
        for kk in range(0, tl.cdiv(H, BK)):
            a = x_desc.load([t0, kk * BK])
            w = wr_desc.load([0, kk * BK])
            if DOT_FP32:
                acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
            else:
                acc = tl.dot(a, tl.trans(w), acc)
        cols = tl.arange(0, EP2)[None, :]
        valid = cols < E
        kcols = tl.arange(0, KP2)[None, :]
        sel_w = tl.zeros((RB, KP2), dtype=tl.float32)
        sel_e = tl.zeros((RB, KP2), dtype=tl.int32)
        if ROUTING == 0:  # softmax top-k
            logits = tl.where(valid, acc, float("-inf"))
            p = tl.exp(logits - tl.max(logits, 1)[:, None])
            p = p / tl.sum(p, 1)[:, None]
            score = tl.where(valid, p, -1.0)
            for j in tl.static_range(TOPK):
                m = tl.max(score, 1)
                idx = tl.min(tl.where(score == m[:, None], cols, EP2), 1)
                sel_w = tl.where(kcols == j, m[:, None], sel_w)
                sel_e = tl.where(kcols == j, idx[:, None], sel_e)
                score = tl.where(cols == idx[:, None], -2.0, score)
        else:  # sigmoid scores, bias for the choice only, group-limited top-k (DeepSeek-V3)
            s = tl.sigmoid(acc)
            bias = tl.load(bias_ptr + cols, mask=valid, other=0.0)
            choice = tl.where(valid, s + bias, float("-inf"))
            per_group = E // N_GROUP
            grp = cols // per_group
            gcols = tl.arange(0, NGP2)[None, :]
            gscore = tl.full((RB, NGP2), float("-inf"), dtype=tl.float32)
            for g in tl.static_range(N_GROUP):
                cg = tl.where(grp == g, choice, float("-inf"))
                m1 = tl.max(cg, 1)
                i1 = tl.min(tl.where(cg == m1[:, None], cols, EP2), 1)
                m2 = tl.max(tl.where(cols == i1[:, None], float("-inf"), cg), 1)
                sc = tl.where(per_group >= 2, m1 + m2, m1)
                gscore = tl.where(gcols == g, sc[:, None], gscore)
            keep = tl.zeros((RB, EP2), dtype=tl.int32)
            for i in tl.static_range(TOPK_GROUP):
                m = tl.max(gscore, 1)
                gi = tl.min(tl.where(gscore == m[:, None], gcols, NGP2), 1)
                keep = tl.where(grp == gi[:, None], 1, keep)
                gscore = tl.where(gcols == gi[:, None], float("-inf"), gscore)
            score = tl.where((keep != 0) & valid, choice, float("-inf"))
            for j in tl.static_range(TOPK):
                m = tl.max(score, 1)
                idx = tl.min(tl.where(score == m[:, None], cols, EP2), 1)
                wj = tl.sum(tl.where(cols == idx[:, None], s, 0.0), 1)
                sel_w = tl.where(kcols == j, wj[:, None], sel_w)
                sel_e = tl.where(kcols == j, idx[:, None], sel_e)
                score = tl.where(cols == idx[:, None], float("-inf"), score)
        if RENORM:
            sel_w = sel_w / (tl.sum(sel_w, 1)[:, None] + 1e-20)
        sel_w = sel_w * routed_scaling
        rows = t0 + tl.arange(0, RB)
        mask = (rows < T)[:, None] & (kcols < TOPK)
        tl.store(topk_w_ptr + rows[:, None] * TOPK + kcols, sel_w, mask=mask)
        tl.store(topk_e_ptr + rows[:, None] * TOPK + kcols, sel_e, mask=mask)
    return sel_w, sel_e


@triton.jit
def _dispatch_block(b, sel_e, x_ptr, peer_data, scratch_ptr, off_recv, off_rmeta, T, H, El, rank,
                    WORLD: tl.constexpr, WP2: tl.constexpr, TOPK: tl.constexpr, KP2: tl.constexpr,
                    RB: tl.constexpr, BH: tl.constexpr, xs_ptr, off_rscale, KB, A_MX: tl.constexpr,
                    KBP2: tl.constexpr):
    """Push tokens [b*RB, +RB) once to each destination rank holding one of their experts (+ metadata).
    MXFP8 (A_MX): x_ptr is the E4M3 payload read as bf16 pairs (H is then half the hidden size) and the KB
    scale bytes of each row follow to the destination's scale region at off_rscale."""
    MW: tl.constexpr = 1 + 2 * TOPK
    rows = b * RB + tl.arange(0, RB)
    tmask = rows < T
    kcols = tl.arange(0, KP2)[None, :]
    pair = tmask[:, None] & (kcols < TOPK)
    dest = sel_e // El
    local_e = sel_e - dest * El
    # index of each (token, expert) pair among this rank's pairs of that expert
    idx = tl.atomic_add(scratch_ptr + SC_CNT + sel_e, 1, mask=pair, sem="relaxed", scope="gpu")
    dcols = tl.arange(0, WP2)[None, :]
    slots = tl.full((RB, WP2), -1, dtype=tl.int64)
    # per destination: which rows go there, their slots, and their metadata
    src = x_ptr + rows.to(tl.int64) * H
    for d in tl.static_range(WORLD):
        has = tl.max(tl.where(pair & (dest == d), 1, 0), 1) > 0
        slot = tl.atomic_add(scratch_ptr + SC_SEND + d + 0 * rows, 1, mask=has, sem="relaxed", scope="gpu")
        slot = tl.where(has, slot, 0)
        at = (rank * T + slot).to(tl.int64)
        meta = dev.peer_region(peer_data, d, off_rmeta, tl.int32) + at * MW
        tl.store(meta, rows, mask=has)
        on_d = pair & (dest == d)
        tl.store(meta[:, None] + 1 + 2 * kcols, tl.where(on_d, local_e, -1), mask=has[:, None] & (kcols < TOPK))
        tl.store(meta[:, None] + 2 + 2 * kcols, idx, mask=has[:, None] & (kcols < TOPK))
        # destination row index (or -1) of each token, kept in one [RB, WP2] tensor
        slots = tl.where((dcols == d) & has[:, None], at[:, None], slots)
    # the rows: each column block is loaded once and stored to every destination (a dynamic loop over
    # destinations, so that only one block of pointers is live)
    for c0 in range(0, H, BH):
        c = c0 + tl.arange(0, BH)
        cm = (c < H)[None, :]
        v = tl.load(src[:, None] + c[None, :], mask=tmask[:, None] & cm)
        for dd in range(WORLD):
            at_d = tl.sum(tl.where(dcols == dd, slots, 0), 1)
            dst = dev.peer_region(peer_data, dd, off_recv, tl.bfloat16) + at_d * H
            tl.store(dst[:, None] + c[None, :], v, mask=(at_d >= 0)[:, None] & cm)
    if A_MX:  # int32 offsets from scalar bases (moe_forward checks W*T*KB < 2**31): an [RB, KBP2] block of
        # 64-bit pointers spills (docs/design/moe_forward.md, "Registers and spills")
        sc = tl.arange(0, KBP2)
        scm = (sc < KB)[None, :]
        vs = tl.load(xs_ptr + ((rows * KB)[:, None] + sc[None, :]), mask=tmask[:, None] & scm)
        for dd in range(WORLD):
            at_d = tl.sum(tl.where(dcols == dd, slots, 0), 1)
            base = dev.peer_region(peer_data, dd, off_rscale, tl.uint8)
            tl.store(base + ((at_d.to(tl.int32) * KB)[:, None] + sc[None, :]), vs,
                     mask=(at_d >= 0)[:, None] & scm)


@triton.jit
def _publish_counts(scratch_ptr, peer_data, peer_sig, off_cnt, El, rank, epoch, WORLD: tl.constexpr,
                    ELP2: tl.constexpr, FLAG_BASE: tl.constexpr):
    """Last ROUTE task of the rank: tell every destination how many pairs per local expert and how many rows
    it sent there, then raise the destination's flag[rank]."""
    i = tl.arange(0, ELP2)
    for d in tl.static_range(WORLD):
        c = tl.load(scratch_ptr + SC_CNT + d * El + i, mask=i < El, other=0, volatile=True)
        n_rows = tl.load(scratch_ptr + SC_SEND + d + 0 * i, volatile=True)
        cnt = dev.peer_region(peer_data, d, off_cnt, tl.int32) + rank * (El + 1)
        tl.store(cnt + i, c, mask=i < El)
        tl.store(cnt + El + 0 * i, n_rows, mask=i == 0)
        dev.notify(dev.peer_ptr(peer_sig, d, tl.int32) + FLAG_BASE + rank, epoch)


@triton.jit
def _ensure_plan(sig_ptr, cnt_ptr, plan_ptr, scratch_ptr, El, rank, epoch, timeout_ns, err_ptr,
                 WORLD: tl.constexpr, WP2: tl.constexpr, ELP2: tl.constexpr, BM: tl.constexpr,
                 FLAG_BASE: tl.constexpr, GEMMS_ONLY: tl.constexpr):
    """Make sure this call's plan exists (and is visible to this program); returns 0 on timeout.

    plan (int32): [0, El) first row of each local expert; [El, 2El) its first m-tile; [2El] m-tiles in all;
    [2El+1, 3El+1) rows of each expert; [3El+1 + s*El + e] first row of source s inside expert e."""
    ok = 1
    state = dev.load_uniform(scratch_ptr + SC_PLAN)
    if state < 2:
        if not GEMMS_ONLY:
            for s in tl.static_range(WORLD):
                ok = ok & dev.wait_geq(sig_ptr + FLAG_BASE + s, epoch, timeout_ns, err_ptr, OP_MOE_FORWARD,
                                       WAIT_MOE_DISPATCH, rank, -1, s)
        if ok != 0:
            won = 0
            if state == 0:
                won = (tl.atomic_cas(scratch_ptr + SC_PLAN, 0, 1, sem="acq_rel", scope="gpu") == 0).to(tl.int32)
            if won != 0:
                si = tl.arange(0, WP2)[:, None]
                ei = tl.arange(0, ELP2)[None, :]
                c = tl.load(cnt_ptr + si * (El + 1) + ei, mask=(si < WORLD) & (ei < El), other=0, volatile=True)
                tot = tl.sum(c, 0)
                mt = (tot + BM - 1) // BM
                e1 = tl.arange(0, ELP2)
                em = e1 < El
                tl.store(plan_ptr + e1, tl.cumsum(tot, 0) - tot, mask=em)
                tl.store(plan_ptr + El + e1, tl.cumsum(mt, 0) - mt, mask=em)
                tl.store(plan_ptr + 2 * El + e1 * 0, tl.sum(mt, 0) + e1 * 0, mask=e1 == 0)
                tl.store(plan_ptr + 2 * El + 1 + e1, tot, mask=em)
                tl.store(plan_ptr + 3 * El + 1 + si * El + ei, tl.cumsum(c, 0) - c, mask=(si < WORLD) & (ei < El))
                tl.debug_barrier()
                tl.atomic_xchg(scratch_ptr + SC_PLAN, 2, sem="release", scope="gpu")
    if ok != 0:  # also the acquire (+ proxy fence for TMA readers) of everything the plan stands for
        ok = dev.wait_geq(scratch_ptr + SC_PLAN, 2, timeout_ns, err_ptr, OP_MOE_FORWARD, WAIT_MOE_PLAN, rank, -1, 0)
    return ok


@triton.jit
def _permute_block(p, recv_ptr, rmeta_ptr, cnt_ptr, plan_ptr, scratch_ptr, xe_ptr, xe_meta_ptr, T, H, El, rank,
                   WORLD: tl.constexpr, TOPK: tl.constexpr, KP2: tl.constexpr, PB: tl.constexpr,
                   BH: tl.constexpr, rq_ptr, rs_ptr, A_MX: tl.constexpr):
    """Copy received rows [b*PB, +PB) of source s into their local experts' row ranges. MXFP8 (A_MX): the
    received rows are E4M3 payload (rq_ptr) + E8M0 scales (rs_ptr), dequantized to bf16 on the way (exact;
    the dequantize-on-arrival of the TP ops, here fused into the copy that places the rows anyway)."""
    MW: tl.constexpr = 1 + 2 * TOPK
    n_pb = tl.cdiv(T, PB)
    s = (rank + p // n_pb) % WORLD  # own rows first: they are there before any peer's
    r0 = (p % n_pb) * PB
    n_rows = tl.load(cnt_ptr + s * (El + 1) + El, volatile=True)
    if r0 < n_rows:
        rows = r0 + tl.arange(0, PB)
        rmask = rows < n_rows
        kcols = tl.arange(0, KP2)[None, :]
        kmask = rmask[:, None] & (kcols < TOPK)
        meta = rmeta_ptr + (s * T + rows).to(tl.int64) * MW
        tok = tl.load(meta, mask=rmask, other=0)
        le = tl.load(meta[:, None] + 1 + 2 * kcols, mask=kmask, other=-1)
        idx = tl.load(meta[:, None] + 2 + 2 * kcols, mask=kmask, other=0)
        valid = kmask & (le >= 0)
        le = tl.where(valid, le, 0)
        first = tl.load(plan_ptr + le, mask=valid, other=0, volatile=True)
        base = tl.load(plan_ptr + 3 * El + 1 + s * El + le, mask=valid, other=0, volatile=True)
        dst = first + base + idx
        xm = xe_meta_ptr + dst.to(tl.int64) * 3
        tl.store(xm, s + 0 * dst, mask=valid)
        tl.store(xm + 1, tok[:, None] + 0 * dst, mask=valid)
        tl.store(xm + 2, kcols + 0 * dst, mask=valid)
        src = recv_ptr + (s * T + rows).to(tl.int64) * H
        NBH: tl.constexpr = BH // 32
        qsrc = rq_ptr + (s * T + rows).to(tl.int64) * H
        ssrc = rs_ptr + (s * T + rows).to(tl.int64) * (H // 32)
        for c0 in range(0, H, BH):
            c = c0 + tl.arange(0, BH)
            cm = (c < H)[None, :]
            if A_MX:
                bq = tl.arange(0, NBH)
                col3 = c0 + bq[None, :, None] * 32 + tl.arange(0, 32)[None, None, :]
                q = tl.load(qsrc[:, None, None] + col3, mask=rmask[:, None, None] & (col3 < H), other=0.0)
                sb = tl.load(ssrc[:, None] + c0 // 32 + bq[None, :],
                             mask=rmask[:, None] & ((c0 // 32 + bq) < H // 32)[None, :], other=127).to(tl.int32)
                v3 = q.to(tl.float32) * mx_scale_f32(sb)[:, :, None]
                v = tl.reshape(v3.to(tl.bfloat16), (PB, BH))
            else:
                v = tl.load(src[:, None] + c[None, :], mask=rmask[:, None] & cm)
            for j in range(TOPK):  # a dynamic loop: unrolled, the k stores' pointers would spill
                dj = tl.sum(tl.where(kcols == j, dst, 0), 1)
                vj = tl.max(tl.where((kcols == j) & valid, 1, 0), 1) > 0
                tl.store(xe_ptr + dj.to(tl.int64)[:, None] * H + c[None, :], v, mask=vj[:, None] & cm)
        tl.debug_barrier()
        tl.atomic_add(scratch_ptr + SC_PERM + le, 1, mask=valid, sem="release", scope="gpu")


@triton.jit
def _gemm_task(g, plan_ptr, El, n_tiles_n, ELP2: tl.constexpr, BM: tl.constexpr):
    """GEMM task index -> (local expert, its first row, its rows, global m-tile, m, n)."""
    e = tl.arange(0, ELP2)
    tile0 = tl.load(plan_ptr + El + e, mask=e < El, other=0, volatile=True)
    le = tl.sum(((tile0 * n_tiles_n <= g) & (e < El)).to(tl.int32), 0) - 1
    first = tl.load(plan_ptr + le, volatile=True)
    t0 = tl.load(plan_ptr + El + le, volatile=True)
    rows = tl.load(plan_ptr + 2 * El + 1 + le, volatile=True)
    mt = tl.cdiv(rows, BM)
    li = g - t0 * n_tiles_n
    m = li % mt
    n = li // mt
    return le, first, rows, t0 + m, m, n


@triton.jit
def _gemm1_tile(le, first, rows, m, n, xe_ptr, w13_desc, hb_ptr, gu_ptr, H, F, BM: tl.constexpr, BK: tl.constexpr,
                BNH: tl.constexpr, DOT_FP32: tl.constexpr, A_MX: tl.constexpr, SAVE_GU: tl.constexpr,
                W_NK: tl.constexpr):
    """h[rows m*BM.., cols n*BNH..] = silu(x @ W13_gate) * (x @ W13_up) for local expert le.
    W13 is viewed as [El*H, 2F]: a K block past H reads the next expert's rows, multiplied by A's
    out-of-bounds columns, which TMA fills with zeros. W_NK: W13 stored as [El*2F, H] (transformers'
    ``gate_up_proj``), its [BNH, BK] tiles transposed in the dot; K past H is out of bounds (zeros), N rows past
    a half's F read the other half's rows, never stored. SAVE_GU: g and u themselves (bf16, rounded once) into
    gu [rows, 2F] as well, for the backward (moe_forward's ``save_gu``)."""
    a_desc = tl.make_tensor_descriptor(xe_ptr + first.to(tl.int64) * H, shape=[rows, H], strides=[H, 1],
                                       block_shape=[BM, BK])
    acc_g = tl.zeros((BM, BNH), dtype=tl.float32)
    acc_u = tl.zeros((BM, BNH), dtype=tl.float32)
    for kk in range(0, tl.cdiv(H, BK)):
        a = a_desc.load([m * BM, kk * BK])
        if W_NK:
            bg = tl.trans(w13_desc.load([le * 2 * F + n * BNH, kk * BK]))
            bu = tl.trans(w13_desc.load([le * 2 * F + F + n * BNH, kk * BK]))
        else:
            bg = w13_desc.load([le * H + kk * BK, n * BNH])
            bu = w13_desc.load([le * H + kk * BK, F + n * BNH])
        if DOT_FP32:
            acc_g = tl.dot(a.to(tl.float32), bg.to(tl.float32), acc_g)
            acc_u = tl.dot(a.to(tl.float32), bu.to(tl.float32), acc_u)
        else:
            acc_g = tl.dot(a, bg, acc_g)
            acc_u = tl.dot(a, bu, acc_u)
    if SAVE_GU:  # g's columns stop at F (past it the tile holds u's first columns: never stored as g)
        store_block(gu_ptr, acc_g.to(tl.bfloat16), first + m * BM, n * BNH, rows - m * BM, F - n * BNH, 2 * F,
                    BM, BNH)
        store_block(gu_ptr, acc_u.to(tl.bfloat16), first + m * BM, F + n * BNH, rows - m * BM, F - n * BNH, 2 * F,
                    BM, BNH)
    h = (acc_g * tl.sigmoid(acc_g) * acc_u).to(tl.bfloat16)
    if A_MX and BNH >= 64:  # GEMM2 multiplies h's MX values (blocks of 32 along F), rounded and stored one
        # column half at a time (BNH / 64 whole blocks each): fewer int32 temporaries live at once
        lo, hi = tl.split(tl.permute(tl.reshape(h, (BM, 2, BNH // 2)), (0, 2, 1)))
        store_rows(hb_ptr, _mx_values_bf16(lo, BM, BNH // 2), first + m * BM, n * BNH, rows - m * BM, F, BM,
                   BNH // 2)
        store_rows(hb_ptr, _mx_values_bf16(hi, BM, BNH // 2), first + m * BM, n * BNH + BNH // 2, rows - m * BM,
                   F, BM, BNH // 2)
    elif A_MX:  # one MX block per row (the interpreter's 32-column tiles)
        store_rows(hb_ptr, _mx_values_bf16(h, BM, BNH), first + m * BM, n * BNH, rows - m * BM, F, BM, BNH)
    else:
        store_rows(hb_ptr, h, first + m * BM, n * BNH, rows - m * BM, F, BM, BNH)


@triton.jit
def _mx_values_bf16(h, BM: tl.constexpr, BN: tl.constexpr):
    """The MX values (bf16) of a [BM, BN] bf16 tile, blocks of 32 along its columns (quant.mx_round_bf16)."""
    return tl.reshape(mx_round_bf16(tl.reshape(h, (BM, BN // 32, 32))), (BM, BN))


@triton.jit
def _gemm2_tile(le, first, rows, m, n, hb_ptr, w2_desc, F, H, BM: tl.constexpr, BK: tl.constexpr,
                BN: tl.constexpr, DOT_FP32: tl.constexpr, W_NK: tl.constexpr):
    """acc = h[rows m*BM.., :] @ W2[le][:, cols n*BN..] (fp32). W2 viewed as [El*F, H] (W_NK: stored [El*H, F],
    transformers' ``down_proj``, its [BN, BK] tiles transposed in the dot; K past F out of bounds, zeros)."""
    a_desc = tl.make_tensor_descriptor(hb_ptr + first.to(tl.int64) * F, shape=[rows, F], strides=[F, 1],
                                       block_shape=[BM, BK])
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(0, tl.cdiv(F, BK)):
        a = a_desc.load([m * BM, kk * BK])
        if W_NK:
            b = tl.trans(w2_desc.load([le * H + n * BN, kk * BK]))
        else:
            b = w2_desc.load([le * F + kk * BK, n * BN])
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _gemm2_task(le, first, rows, m, n, hb_ptr, w2_desc, y_ptr, xe_meta_ptr, peer_data, peer_ctr, off_comb, F, H,
                TOPK: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, FB: tl.constexpr,
                GEMMS_ONLY: tl.constexpr, DOT_FP32: tl.constexpr, W_NK: tl.constexpr):
    """One GEMM2 tile and its epilogue: rows into y (expert_gemms) or back to their tokens' ranks."""
    acc = _gemm2_tile(le, first, rows, m, n, hb_ptr, w2_desc, F, H, BM, BK, BN, DOT_FP32, W_NK)
    if GEMMS_ONLY:
        store_rows(y_ptr, acc.to(tl.bfloat16), first + m * BM, n * BN, rows - m * BM, H, BM, BN)
    else:
        _combine_rows(acc, first, rows, m, n, xe_meta_ptr, peer_data, peer_ctr, off_comb, H, TOPK, BM, BN, FB)


@triton.jit
def _store_quarter(row_ptr, val, rmask, col0, H, BQ: tl.constexpr):
    c = tl.arange(0, BQ)
    tl.store(row_ptr[:, None] + c[None, :], val.to(tl.bfloat16), mask=rmask[:, None] & ((col0 + c) < H)[None, :])


@triton.jit
def _combine_rows(acc, first, rows, m, n, xe_meta_ptr, peer_data, peer_ctr, off_comb, H,
                  TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, FB: tl.constexpr):
    """Store each row of a GEMM2 tile into the combine buffer of its token's rank at [token, slot], then add 1
    to that rank's fold counter of the token's block (after a CTA barrier: release covers every thread's
    stores)."""
    r = m * BM + tl.arange(0, BM)
    rmask = r < rows
    xm = xe_meta_ptr + (first + r).to(tl.int64) * 3
    src = tl.load(xm, mask=rmask, other=0)
    tok = tl.load(xm + 1, mask=rmask, other=0)
    slot = tl.load(xm + 2, mask=rmask, other=0)
    row_ptr = dev.peer_region(peer_data, src, off_comb, tl.bfloat16) + ((tok * TOPK + slot).to(tl.int64) * H + n * BN)
    # four column quarters: a [BM, BN] tensor of 64-bit pointers would not fit in registers
    lo, hi = tl.split(tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1)))
    q0, q1 = tl.split(tl.permute(tl.reshape(lo, (BM, 2, BN // 4)), (0, 2, 1)))
    _store_quarter(row_ptr, q0, rmask, n * BN, H, BN // 4)
    _store_quarter(row_ptr + BN // 4, q1, rmask, n * BN + BN // 4, H, BN // 4)
    q2, q3 = tl.split(tl.permute(tl.reshape(hi, (BM, 2, BN // 4)), (0, 2, 1)))
    _store_quarter(row_ptr + BN // 2, q2, rmask, n * BN + BN // 2, H, BN // 4)
    _store_quarter(row_ptr + 3 * (BN // 4), q3, rmask, n * BN + 3 * (BN // 4), H, BN // 4)
    tl.debug_barrier()
    ctr = dev.peer_region(peer_ctr, src, 0, tl.int32) + tok // FB
    tl.atomic_add(ctr, 1, mask=rmask, sem="release", scope="sys")


@triton.jit
def _fold_block(b, comb_ptr, topk_w_ptr, y_ptr, ctr_ptr, T, H, n_tiles2, rank, epoch, timeout_ns, err_ptr,
                TOPK: tl.constexpr, KP2: tl.constexpr, FB: tl.constexpr, BH: tl.constexpr):
    t0 = b * FB
    n_tok = tl.minimum(T - t0, FB)
    ok = dev.wait_geq(ctr_ptr + b, n_tok * TOPK * n_tiles2, timeout_ns, err_ptr, OP_MOE_FORWARD, WAIT_MOE_COMBINE,
                      rank, b, b)
    if ok != 0:
        rows = t0 + tl.arange(0, FB)
        rmask = rows < T
        kcols = tl.arange(0, KP2)[None, :]
        w = tl.load(topk_w_ptr + rows[:, None] * TOPK + kcols, mask=rmask[:, None] & (kcols < TOPK), other=0.0)
        for c0 in range(0, H, BH):
            c = c0 + tl.arange(0, BH)
            m2 = rmask[:, None] & (c < H)[None, :]
            acc = tl.zeros((FB, BH), dtype=tl.float32)
            for j in range(TOPK):  # fixed slot order: deterministic (dynamic loop: unrolled, it spills)
                wj = tl.sum(tl.where(kcols == j, w, 0.0), 1)
                v = tl.load(comb_ptr + (rows * TOPK + j).to(tl.int64)[:, None] * H + c[None, :], mask=m2,
                            other=0.0)
                acc += wj[:, None] * v.to(tl.float32)
            tl.store(y_ptr + rows.to(tl.int64)[:, None] * H + c[None, :], acc.to(tl.bfloat16), mask=m2)
        tl.debug_barrier()
        tl.store(ctr_ptr + b, 0)  # consumer reset: peers add again only after this rank's next dispatch


@triton.jit(do_not_specialize=["T", "rank", "timeout_us", "fixed_comm", "stages", "scratch_n",
                               "off_recv", "off_rmeta", "off_cnt", "off_comb"])
def _moe_forward_kernel(
        x_ptr, wr_ptr, bias_ptr, w13_ptr, w2_ptr, y_ptr,
        recv_ptr, rmeta_ptr, cnt_ptr, comb_ptr,
        peer_data, peer_sig, peer_ctr, sig_ptr, ctr_ptr,
        off_recv, off_rmeta, off_cnt, off_comb,
        xq_ptr, xs_ptr, rq_ptr, rs_ptr, off_rscale,
        topk_w_ptr, topk_e_ptr, xe_ptr, xe_meta_ptr, hb_ptr, gu_ptr, plan_ptr, scratch_ptr, scratch_n, err_ptr,
        trace_ptr, T, H, F, E, El, rank, epoch_ptr, timeout_us, fixed_comm, routed_scaling, stages,
        WORLD: tl.constexpr, TOPK: tl.constexpr, KP2: tl.constexpr, EP2: tl.constexpr, ELP2: tl.constexpr,
        WP2: tl.constexpr, ROUTING: tl.constexpr, RENORM: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, NGP2: tl.constexpr,
        RB: tl.constexpr, PB: tl.constexpr, FB: tl.constexpr, BH: tl.constexpr, BM: tl.constexpr,
        BK: tl.constexpr, BNH: tl.constexpr, BN: tl.constexpr, GRID: tl.constexpr, POLICY: tl.constexpr,
        GEMMS_ONLY: tl.constexpr, FINAL: tl.constexpr, DOT_FP32: tl.constexpr, TRACE: tl.constexpr,
        HALF_TAIL: tl.constexpr,
        FLAG_BASE: tl.constexpr, DONE_BASE: tl.constexpr, A_MX: tl.constexpr, KBP2: tl.constexpr,
        SAVE_GU: tl.constexpr, W_NK: tl.constexpr = False):
    pid = tl.program_id(0)
    timeout_ns = tl.cast(timeout_us, tl.int64) * 1000
    epoch = dev.call_epoch(epoch_ptr)  # this call's epoch, from the device slot (device.call_epoch)
    x_desc = tl.make_tensor_descriptor(x_ptr, shape=[T, H], strides=[H, 1], block_shape=[RB, BK])
    if ROUTING == 2:  # routing given: no router weight (wr_ptr is a stand-in, never read)
        wr_desc = x_desc
    else:
        wr_desc = tl.make_tensor_descriptor(wr_ptr, shape=[E, H], strides=[H, 1], block_shape=[EP2, BK])
    if W_NK:  # the experts' weights as transformers stores them: gate_up [El, 2F, H], down [El, H, F]
        w13_desc = tl.make_tensor_descriptor(w13_ptr, shape=[El * 2 * F, H], strides=[H, 1],
                                             block_shape=[BNH, BK])
        w2_desc = tl.make_tensor_descriptor(w2_ptr, shape=[El * H, F], strides=[F, 1], block_shape=[BN, BK])
    else:
        w13_desc = tl.make_tensor_descriptor(w13_ptr, shape=[El * H, 2 * F], strides=[2 * F, 1],
                                             block_shape=[BK, BNH])
        w2_desc = tl.make_tensor_descriptor(w2_ptr, shape=[El * F, H], strides=[H, 1], block_shape=[BK, BN])
    n_route = tl.cdiv(T, RB)
    n_perm = WORLD * tl.cdiv(T, PB)
    n_fold = tl.cdiv(T, FB)
    n1 = tl.cdiv(F, BNH)
    n2 = tl.cdiv(H, BN)
    perm_ctr = scratch_ptr + SC_PERM
    g1_ctr = perm_ctr + El

    mine = sched.program_stages(pid, POLICY, fixed_comm, stages, COMM_STAGE_MASK)
    cur = 0
    handshake = 0
    peers_ok = 1
    plan_ok = 0
    n_ev = 0
    while cur < NUM_STAGES:
        if dev.aborted(err_ptr):
            cur = NUM_STAGES
        elif not sched.has_stage(mine, cur):  # steps stage by stage: schedule.next_stage's selects spill
            cur += 1                              # more in this register-bound kernel
        else:
            if (cur >= STAGE_PERMUTE) & (cur <= STAGE_GEMM2) & (plan_ok == 0):
                t_w = dev.now_ns()
                plan_ok = _ensure_plan(sig_ptr, cnt_ptr, plan_ptr, scratch_ptr, El, rank, epoch, timeout_ns,
                                       err_ptr, WORLD, WP2, ELP2, BM, FLAG_BASE, GEMMS_ONLY)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, -1, t_w, dev.now_ns(), TRACE)
            if (cur >= STAGE_PERMUTE) & (cur <= STAGE_GEMM2) & (plan_ok == 0):
                cur = NUM_STAGES  # timed out waiting for a peer: drain
            else:
                n_tasks = n_route
                if cur == STAGE_PERMUTE:
                    n_tasks = n_perm
                elif cur == STAGE_GEMM1:
                    n_tasks = tl.load(plan_ptr + 2 * El, volatile=True) * n1
                elif cur == STAGE_GEMM2:
                    n_tasks = tl.load(plan_ptr + 2 * El, volatile=True) * n2
                elif cur == STAGE_FOLD:
                    n_tasks = n_fold
                t = sched.claim(scratch_ptr + cur)  # the stage's queue head is scratch[stage]
                t0 = dev.now_ns()
                if t >= n_tasks:
                    cur += 1
                elif cur == STAGE_ROUTE:
                    sel_w, sel_e = _route_block(t, x_desc, wr_desc, bias_ptr, topk_w_ptr, topk_e_ptr, T, H, E,
                                                routed_scaling, TOPK, KP2, EP2, ROUTING, RENORM, N_GROUP,
                                                TOPK_GROUP, NGP2, RB, BK, DOT_FP32)
                    # the task's two halves apart on the timeline: routing (kind route), then the row
                    # pushes with the publish (kind comm)
                    t1 = dev.now_ns()
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_ROUTE, t, t0, t1, TRACE)
                    t0 = t1
                    if handshake == 0:  # a peer may still be reading last call's rows from its buffers
                        peers_ok = dev.wait_peers_done(sig_ptr, DONE_BASE, WORLD, epoch, timeout_ns, err_ptr,
                                                       OP_MOE_FORWARD, rank)
                        handshake = 1
                    if peers_ok != 0:
                        if A_MX:  # the payload as bf16 pairs (H / 2 per row), then the scales
                            _dispatch_block(t, sel_e, xq_ptr, peer_data, scratch_ptr, off_recv, off_rmeta, T, H // 2,
                                            El, rank, WORLD, WP2, TOPK, KP2, RB, BH, xs_ptr, off_rscale, H // 32,
                                            A_MX, KBP2)
                        else:
                            _dispatch_block(t, sel_e, x_ptr, peer_data, scratch_ptr, off_recv, off_rmeta, T, H, El,
                                            rank, WORLD, WP2, TOPK, KP2, RB, BH, xs_ptr, off_rscale, H // 32, A_MX,
                                            KBP2)
                        tl.debug_barrier()
                        n_done = tl.atomic_add(scratch_ptr + SC_ROUTED, 1, sem="acq_rel", scope="sys")
                        if n_done == n_route - 1:
                            _publish_counts(scratch_ptr, peer_data, peer_sig, off_cnt, El, rank, epoch, WORLD,
                                            ELP2, FLAG_BASE)
                elif cur == STAGE_PERMUTE:
                    _permute_block(t, recv_ptr, rmeta_ptr, cnt_ptr, plan_ptr, scratch_ptr, xe_ptr, xe_meta_ptr,
                                   T, H, El, rank, WORLD, TOPK, KP2, PB, BH, rq_ptr, rs_ptr, A_MX)
                elif cur == STAGE_GEMM1:
                    le, first, rows, gm, m, n = _gemm_task(t, plan_ptr, El, n1, ELP2, BM)
                    ok = 1
                    if not GEMMS_ONLY:
                        ok = dev.wait_geq(perm_ctr + le, rows, timeout_ns, err_ptr, OP_MOE_FORWARD, WAIT_MOE_PERMUTE,
                                          rank, t, le)
                        t1 = dev.now_ns()
                        n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                        t0 = t1
                    if ok != 0:
                        # an expert's last m-tile with at most BM/2 rows: a half-height tile (half the MACs)
                        if HALF_TAIL & (rows - m * BM <= BM // 2):
                            _gemm1_tile(le, first, rows, 2 * m, n, xe_ptr, w13_desc, hb_ptr, gu_ptr, H, F, BM // 2,
                                        BK, BNH, DOT_FP32, A_MX, SAVE_GU, W_NK)
                        else:
                            _gemm1_tile(le, first, rows, m, n, xe_ptr, w13_desc, hb_ptr, gu_ptr, H, F, BM, BK, BNH,
                                        DOT_FP32, A_MX, SAVE_GU, W_NK)
                        tl.debug_barrier()
                        tl.atomic_add(g1_ctr + gm, 1, sem="release", scope="gpu")
                elif cur == STAGE_GEMM2:
                    le, first, rows, gm, m, n = _gemm_task(t, plan_ptr, El, n2, ELP2, BM)
                    ok = dev.wait_geq(g1_ctr + gm, n1, timeout_ns, err_ptr, OP_MOE_FORWARD, WAIT_MOE_GEMM1, rank, t,
                                      gm)
                    t1 = dev.now_ns()
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                    t0 = t1
                    if ok != 0:
                        if HALF_TAIL & (rows - m * BM <= BM // 2):
                            _gemm2_task(le, first, rows, 2 * m, n, hb_ptr, w2_desc, y_ptr, xe_meta_ptr, peer_data,
                                        peer_ctr, off_comb, F, H, TOPK, BM // 2, BK, BN, FB, GEMMS_ONLY, DOT_FP32,
                                        W_NK)
                        else:
                            _gemm2_task(le, first, rows, m, n, hb_ptr, w2_desc, y_ptr, xe_meta_ptr, peer_data,
                                        peer_ctr, off_comb, F, H, TOPK, BM, BK, BN, FB, GEMMS_ONLY, DOT_FP32,
                                        W_NK)
                else:
                    _fold_block(t, comb_ptr, topk_w_ptr, y_ptr, ctr_ptr, T, H, n2, rank, epoch, timeout_ns,
                                err_ptr, TOPK, KP2, FB, BH)
                if t < n_tasks:  # ROUTE's dispatch half is comm; the other stages have a kind each (codes.py)
                    kind = tl.where(cur == STAGE_ROUTE, EV_COMM, EV_PERMUTE - STAGE_PERMUTE + cur)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, kind, t, t0, dev.now_ns(), TRACE)
    if FINAL:
        dev.exit_program_zeroing(scratch_ptr, scratch_n, SC_EXIT, GRID, peer_sig, DONE_BASE, rank, WORLD, epoch,
                                 epoch_ptr, ZERO_BLOCK)


# -------------------------------------------------------------------------------------------------- host
class Layout:
    """Byte offsets of the regions of the symmetric data buffer, and the local buffer sizes, for one shape."""

    def __init__(self, world: int, tokens: int, hidden: int, ffn: int, top_k: int, local_experts: int,
                 cfg: planning.MoETiles):
        def up(v):
            return (v + 255) // 256 * 256
        self.off_recv = 0
        self.off_rscale = up(world * tokens * hidden)  # MXFP8: the payload, then the scales, inside recv
        self.off_rmeta = up(world * tokens * hidden * 2)
        self.off_cnt = up(self.off_rmeta + world * tokens * (1 + 2 * top_k) * 4)
        self.off_comb = up(self.off_cnt + world * (local_experts + 1) * 4)
        self.data_bytes = up(self.off_comb + tokens * top_k * hidden * 2)
        self.max_rows = world * tokens * min(top_k, local_experts)  # every token of every rank to this rank
        self.max_mtiles = -(-self.max_rows // cfg.BM) + local_experts
        self.scratch_n = int(SC_PERM.value) + local_experts + self.max_mtiles
        self.plan_n = 3 * local_experts + 1 + world * local_experts
        self.fold_blocks = -(-tokens // cfg.FB)

    def regions(self, data: torch.Tensor, world: int, tokens: int, hidden: int, top_k: int, local_experts: int):
        """(recv [W*T, H] bf16, meta int32, counts int32, combine [T*k, H] bf16) views of a rank's data buffer."""
        def view(off, n_bytes, dtype):
            return data[off:off + n_bytes].view(dtype)
        recv = view(self.off_recv, world * tokens * hidden * 2, torch.bfloat16)
        meta = view(self.off_rmeta, world * tokens * (1 + 2 * top_k) * 4, torch.int32)
        cnt = view(self.off_cnt, world * (local_experts + 1) * 4, torch.int32)
        comb = view(self.off_comb, tokens * top_k * hidden * 2, torch.bfloat16)
        return recv, meta, cnt, comb

    def mx_regions(self, data: torch.Tensor, world: int, tokens: int, hidden: int):
        """MXFP8: (received payload [W*T, H] e4m3, scales [W*T, H/32] uint8), inside the recv region."""
        n = world * tokens
        q = data[self.off_recv:self.off_recv + n * hidden].view(torch.float8_e4m3fn).view(n, hidden)
        s = data[self.off_rscale:self.off_rscale + n * (hidden // 32)].view(n, hidden // 32)
        return q, s


def weights_nk(w: torch.Tensor) -> bool:
    """Whether an expert weight given as [E, K, N] (w13 [E, H, 2F], w2 [E, F, H]) is the transpose of a contiguous
    [E, N, K] tensor -- transformers' ``gate_up_proj`` [E, 2F, H] / ``down_proj`` [E, H, F] passed as
    ``.transpose(1, 2)`` -- rather than contiguous itself. The kernels read both layouts as they are."""
    return w.dim() == 3 and not w.is_contiguous() and w.transpose(1, 2).is_contiguous()


def check_moe_inputs(x, router_weight, w13, w2, top_k, routing, bias, n_group, topk_group, world, weights=None,
                     experts=None, routed_scaling=1.0):
    """Every check of ``moe_forward``'s inputs, before anything launches; returns (T, H, E, El, F). Routing
    ``given``: no router weight (None), the decision ``weights`` / ``experts`` [T, top_k] instead (their ids
    checked against [0, E) where they are CPU tensors only: reading CUDA ids would synchronise)."""
    given = routing == GIVEN
    if given and router_weight is not None:
        raise ValueError("routing='given' reads no router weight: pass router_weight=None")
    named = (("x", x, 2),) + ((("router_weight", router_weight, 2),) if not given else ()) + \
        (("w13", w13, 3), ("w2", w2, 3))
    for name, t, dims in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != dims:
            raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
        if t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be torch.bfloat16, got {t.dtype}")
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
        if not t.is_contiguous() and not (dims == 3 and weights_nk(t)):
            raise ValueError(f"{name} must be contiguous" + (" or the .transpose(1, 2) of a contiguous tensor "
                                                             "(transformers' expert layout)" if dims == 3 else ""))
        if t.numel() == 0:
            raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
        if t.data_ptr() % 16:
            raise ValueError(f"{name} must start at a 16-byte aligned address (TMA) -- .clone() it")
    if weights_nk(w13) != weights_nk(w2):
        raise ValueError("w13 and w2 must share one layout: both contiguous, or both transposed views of "
                         "transformers' gate_up_proj [E, 2F, H] and down_proj [E, H, F]")
    t_, h = x.shape
    el, h13, f2 = w13.shape
    el2, f, h2 = w2.shape
    e, h_r = (el * world, h) if given else router_weight.shape
    if h_r != h or h13 != h or h2 != h:
        raise ValueError(f"hidden sizes disagree: x {tuple(x.shape)}, router_weight {tuple(router_weight.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} (expected [T, H], [E, H], [E/W, H, 2F], "
                         f"[E/W, F, H])" if not given else
                         f"hidden sizes disagree: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} "
                         f"(expected [T, H], [E/W, H, 2F], [E/W, F, H])")
    if el2 != el or f2 != 2 * f:
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} must be [E/W, H, 2F] and [E/W, F, H]")
    if h % 8 or f % 8:
        raise ValueError(f"H={h} and F={f} must be multiples of 8 (rows of 16 bytes are needed by TMA)")
    if el * world != e:
        raise ValueError(f"router_weight has E={e} experts but this rank holds {el} and the world size is {world}: "
                         f"E must equal world * (E/W)")
    if e > MAX_EXPERTS:
        raise ValueError(f"E={e} experts > {MAX_EXPERTS}: the router keeps a token block's logits in one tile"
                         if not given else f"E={e} experts > {MAX_EXPERTS}: the dispatch counts pairs per expert in "
                         f"{MAX_EXPERTS} slots")
    if not isinstance(top_k, int) or not 1 <= top_k <= min(e, MAX_TOPK):
        raise ValueError(f"top_k={top_k!r} must be an int in [1, {min(e, MAX_TOPK)}]")
    if routing not in ROUTING_KINDS:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTING_KINDS)}")
    if routing != "sigmoid-grouped":
        if bias is not None or n_group != 1 or topk_group != 1:
            raise ValueError("bias, n_group and topk_group belong to routing='sigmoid-grouped'")
    else:
        if not 1 <= n_group <= e or e % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"sigmoid-grouped routing needs E % n_group == 0 and 1 <= topk_group <= n_group "
                             f"(E={e}, n_group={n_group}, topk_group={topk_group})")
        if top_k > topk_group * (e // n_group):
            raise ValueError(f"top_k={top_k} exceeds the {topk_group * (e // n_group)} experts of {topk_group} groups")
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (e,)
                                 or bias.device != x.device or not bias.is_floating_point()):
            raise ValueError(f"bias must be a floating-point tensor of shape ({e},) on {x.device}")
    if given:
        if routed_scaling != 1.0:
            raise ValueError("routing='given' uses the given weights as they are: scale them before the call "
                             f"(routed_scaling={routed_scaling} given)")
        check_given_routing(weights, experts, t_, e, top_k, check_ids=getattr(experts, "device", None) is not None
                            and experts.device.type == "cpu")
        if weights.device != x.device:
            raise ValueError(f"routing='given': weights and experts are on {weights.device} but x is on {x.device}")
    elif weights is not None or experts is not None:
        raise ValueError(f"weights / experts are the decision of routing='given', not of routing={routing!r}")
    if x.device.type != "cuda":  # last, so that CPU-side tests see every other check
        raise ValueError(f"x must be a CUDA tensor, got {x.device}")
    return t_, h, e, el, f


def _launch_args(x, router_weight, bias, w13, w2, y, bufs: dict, *, rank, world, epoch_slot, timeout_ns, grid,
           cfg: planning.MoETiles, top_k, routing="softmax", renormalize=True, n_group=1, topk_group=1,
           routed_scaling=1.0, policy="self", comm_programs=None, stages=ALL_STAGES, gemms_only=False,
           trace=None, x_mx=None, gu=None):
    """The kernel's runtime arguments and constexpr / option keywords of ``launch`` (also a plan's template).
    Launch on explicit buffers (``moe_forward`` builds them from the workspace; CPU tests build their own).

    ``bufs``: data (this rank's symmetric bytes), sig, ctr (its signals / counters), peer_data, peer_sig,
    peer_ctr (int64 address tables), topk_w, topk_e, xe, xe_meta, hb, plan, scratch, errors, layout.
    ``stages`` (bitmask of ROUTE..FOLD) lets CPU tests run a rank's stages in separate launches so that no
    program of the sequential interpreter waits on a rank that has not run yet; the last program zeroes the
    scratch, signals done and advances the device epoch (``epoch_slot``, int32 [1]: the launch runs at slot
    + 1) only in a launch that includes FOLD (or the GEMM-only mode), so every launch of one call sees the same
    epoch. ``x_mx`` (a quant.MXTensor of x):
    the MXFP8 layer (dispatch moves x_mx, PERMUTE dequantizes, GEMM1 rounds h to MX; w13 / w2 hold MX values).
    ``gu`` (bf16 [xe rows, 2F]): GEMM1 also stores g | u there, in xe's row order (moe_forward's ``save_gu``).
    ``routing="given"``: router_weight None (x stands in for its pointer, never read); the caller has put the
    decision into bufs' topk_w (fp32) / topk_e (int32 global ids) [T*k] before the launch."""
    t_, h = x.shape
    given = routing == GIVEN
    el, f = w2.shape[0], w2.shape[1]
    e = el * world if given else router_weight.shape[0]
    lay: Layout = bufs["layout"]
    pol, fixed = policy_args(policy, comm_programs, grid, lo=0)
    if gemms_only:  # no exchange: the regions are unused (typed stand-ins), the counts come from the caller
        recv = comb = bufs["hb"]
        meta = cnt = bufs["counts"]
    else:
        recv, meta, cnt, comb = lay.regions(bufs["data"], world, t_, h, top_k, el)
    n_group_c = n_group if routing == "sigmoid-grouped" else 1
    mx = x_mx is not None
    if mx and not gemms_only:
        rq, rs = lay.mx_regions(bufs["data"], world, t_, h)
        mx_args = (x_mx.payload.view(torch.bfloat16), x_mx.scales, rq, rs, lay.off_rscale)
    else:
        mx_args = (x, bufs["plan"], recv, bufs["plan"], 0)
    args = (
        x, x if given else router_weight, bias if bias is not None else bufs["plan"], w13, w2, y,
        recv, meta, cnt, comb,
        bufs["peer_data"], bufs["peer_sig"], bufs["peer_ctr"], bufs["sig"], bufs["ctr"],
        lay.off_recv, lay.off_rmeta, lay.off_cnt, lay.off_comb, *mx_args,
        bufs["topk_w"], bufs["topk_e"], bufs["xe"], bufs["xe_meta"], bufs["hb"],
        gu if gu is not None else bufs["plan"], bufs["plan"], bufs["scratch"],
        lay.scratch_n, bufs["errors"], trace if trace is not None else bufs["errors"],
        t_, h, f, e, el, rank, epoch_slot, max(1, timeout_ns // 1000), fixed, float(routed_scaling), stages)
    kw = dict(
        WORLD=world, TOPK=top_k, KP2=_p2(top_k), EP2=_p2(e, 16), ELP2=_p2(el), WP2=_p2(world),
        ROUTING=ROUTING_KINDS.index(routing), RENORM=bool(renormalize) and not given, N_GROUP=n_group_c,
        TOPK_GROUP=topk_group if routing == "sigmoid-grouped" else 1, NGP2=_p2(n_group_c),
        RB=cfg.RB, PB=cfg.PB, FB=cfg.FB, BH=cfg.BH, BM=cfg.BM, BK=cfg.BK, BNH=cfg.BNH, BN=cfg.BN, GRID=grid,
        POLICY=pol, GEMMS_ONLY=gemms_only, FINAL=gemms_only or bool(stages & (1 << FOLD)),
        DOT_FP32=planning.interpreting(), TRACE=trace is not None, HALF_TAIL=cfg.half_tail,
        FLAG_BASE=runtime.FLAG_BASE, DONE_BASE=runtime.DONE_BASE, A_MX=mx, KBP2=_p2(max(1, h // 32)),
        SAVE_GU=gu is not None, W_NK=weights_nk(w13),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return args, kw


def launch(*a, **k):
    """Launch on explicit buffers, the normal (unplanned) way: ``_launch_args``' docstring."""
    args, kw = _launch_args(*a, **k)
    _moe_forward_kernel[(kw["GRID"],)](*args, **kw)




def _local_buffers(ws, lay: Layout, tokens, hidden, ffn, top_k):
    try:
        return dict(
            topk_w=ws.local("moe.topk_w", tokens * top_k, torch.float32),
            topk_e=ws.local("moe.topk_e", tokens * top_k, torch.int32),
            xe=ws.local("moe.xe", lay.max_rows * hidden, torch.bfloat16),
            xe_meta=ws.local("moe.xe_meta", lay.max_rows * 3, torch.int32),
            hb=ws.local("moe.hb", lay.max_rows * ffn, torch.bfloat16),
            plan=ws.local("moe.plan", lay.plan_n, torch.int32),
            scratch=ws.local("moe.scratch", lay.scratch_n, torch.int32))
    except torch.OutOfMemoryError as err:
        need = lay.max_rows * (hidden + ffn) * 2
        raise runtime.KosmosError(
            f"moe_forward: cannot allocate its worst-case buffers ({need / 2**30:.2f} GiB for {lay.max_rows} expert "
            f"rows = every token of every rank routed here): {err}") from err


def moe_forward(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, top_k: int,
                routing: str = "softmax", renormalize: bool = True, bias: torch.Tensor | None = None,
                n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0, group=None,
                config: MoEForwardConfig | None = None, policy: str = "self", comm_programs: int | None = None,
                return_routing: bool = False, trace: torch.Tensor | None = None, precision: str = "bf16",
                save_gu: bool = False, weights: torch.Tensor | None = None, experts: torch.Tensor | None = None):
    """The MoE expert layer over the expert-parallel ``group``, in one launch: ``y`` [T, H] bf16.

    x [T, H] bf16 CUDA: this rank's tokens (T, H, F, E, top_k and routing must be the same on every rank:
    checked with one small all-gather the first time a shape is seen, a ValueError on every rank if they
    differ); router_weight [E, H] bf16
    (replicated); w13 [E/W, H, 2F] (gate | up) and w2 [E/W, F, H] bf16: this rank's experts, global expert g
    on rank g // (E/W); both contiguous, or both the ``.transpose(1, 2)`` of contiguous [E/W, 2F, H] and
    [E/W, H, F] tensors (transformers' ``gate_up_proj`` / ``down_proj``), read as they are (``weights_nk``).
    routing: ``softmax`` (``renormalize`` the top-k weights or not) or ``sigmoid-grouped`` (DeepSeek-V3: ``bias`` [E] for the choice, ``n_group``/``topk_group``,
    ``routed_scaling``). E <= 256, top_k <= 16, H and F multiples of 8. Shared experts are not part of the op.
    ``routing="given"``: no router -- the routing decision comes from the caller: ``weights`` [T, top_k] (any
    float dtype, used in fp32 as they are: ``renormalize`` does not apply, ``routed_scaling`` must stay 1) and
    ``experts`` [T, top_k] (integer global expert ids in [0, E), E = W * E/W; a token may name an expert twice),
    on x's device; ``router_weight`` must be None. The host copies them into the launch's routing buffers (two
    small copies) and the ROUTE stage loads them instead of computing the router GEMM; dispatch, both expert
    GEMMs and the combine run in the same launch as for the routers. The ids are not checked on CUDA (that
    would read them on the host: a synchronisation): an id outside [0, E) makes the launch index outside its
    buffers -- transformers' EP sentinels (ids >= E) are not supported.
    ``config`` (``kosmos.MoEForwardConfig``, default: its defaults) holds the op's knobs.
    ``policy="fixed"`` with ``comm_programs=S`` runs the fixed-role ablation. ``return_routing=True`` also
    returns (weights [T, k] fp32, experts [T, k] int64) as the kernel's router chose them (routing given: the given
    ones). ``trace`` (int64
    [grid, 1024, 4]) records each program's tasks (kinds in ``runtime.TRACE_KINDS``) for the timeline.
    ``precision="mxfp8"``: the MXFP8 layer (kosmos/reference/moe.py's module docstring has the math): x is
    quantized (quant.quantize_mx, a separate launch) and dispatched as E4M3 payload + scales (0.52x of the
    bf16 bytes), dequantized where the rows are placed; GEMM2 multiplies the MX values of h. ``w13`` and ``w2``
    must then hold the MX values of the expert weights (``quant.mx_values(w13, dim=1)``, ``(w2, dim=1)``: blocks
    along H and F), kept by the caller like any cached weight; H and F multiples of 32. The router runs on the
    bf16 x.
    ``save_gu=True`` (bf16, with ``return_routing=True``): GEMM1's epilogue also stores its g | u (the SwiGLU
    input, bf16, rounded once from the fp32 accumulators) for the backward, which then skips recomputing GEMM1:
    returns (y, weights, experts, SavedGateUp). Memory: a fresh [W*T*min(k, E/W), 2F] bf16 tensor per call
    (the worst case of rows this rank can receive; exactly the T*k rows at W = 1) plus the rows' (source,
    token, slot) [same rows, 3] int32.

    A call signature seen before launches through its plan (core/launch_plan.py); such a hit quantizes x (mxfp8)
    through the plan's quantize plan without its checks (quant.quantize_planned).
    """
    if save_gu and (not return_routing or precision != "bf16"):
        raise ValueError("moe_forward: save_gu=True needs return_routing=True and precision='bf16' (the backward's "
                         "inputs)")
    # the plan of this call signature (core/launch_plan.py); a miss validates and builds it
    ws, key, plan = (launch_plan.find("moe", group, (x, router_weight, w13, w2, bias, trace, weights, experts),
                                      (top_k, routing, renormalize, n_group, topk_group, routed_scaling, config,
                                       policy, comm_programs, precision, save_gu), x.device)
                     if isinstance(x, torch.Tensor) else (None, None, None))
    if plan is not None:
        info = plan.info
        bias32 = bias.float().contiguous() if bias is not None else None
        y = torch.empty(info["y_shape"], dtype=torch.bfloat16, device=x.device)
        x_mx = quantize_planned(x, info["xq_key"]) if info["mx"] else None  # x passed its checks (the key)
        gu = torch.empty(info["gu_shape"], dtype=torch.bfloat16, device=x.device) if save_gu else None
        if weights is not None:  # routing given (the key: weights / experts passed its checks)
            _put_given(info["bufs"], weights, experts)
        plan.call(ws, dict(x=x, router=router_weight, bias=bias32, w13=w13, w2=w2, y=y, trace=trace, gu=gu,
                           xq=x_mx.payload.view(torch.bfloat16) if x_mx is not None else None,
                           xs=x_mx.scales if x_mx is not None else None), (y,), trace is not None)
        return _moe_result(y, info["bufs"], x.shape[0], top_k, return_routing, gu, info["world"])
    config = check_config(MoEForwardConfig, config)
    if precision not in ("bf16", "mxfp8"):
        raise ValueError(f"precision {precision!r}: choose 'bf16' or 'mxfp8'")
    w = runtime.world_size(group)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
    t_, h, e, el, f = check_moe_inputs(x, router_weight, w13, w2, top_k, routing, bias, n_group, topk_group, w,
                                       weights, experts, routed_scaling)
    ws = runtime.get_workspace(group, x.device)
    r = ws.world.rank
    grid = runtime.num_sms(x.device)
    check_launch(policy, comm_programs, trace, grid)
    mx = precision == "mxfp8"
    if mx and (h % 32 or f % 32):
        raise ValueError(f"precision='mxfp8' needs H={h} and F={f} to be multiples of 32 (MX blocks)")
    if mx and w * t_ * (h // 32) >= 2**31:  # the dispatch's scale offsets are int32
        raise ValueError(f"precision='mxfp8': {w} ranks x {t_} tokens x {h // 32} scale bytes per row exceed the "
                         f"2**31-byte scale region the dispatch addresses; use fewer tokens per call")
    cfg = planning.moe_config(config, mx=mx)
    lay = Layout(w, t_, h, f, top_k, el, cfg)
    _check_same_shape_on_every_rank(ws, (t_, h, f, e, top_k, ROUTING_KINDS.index(routing)))
    ws.ensure(lay.data_bytes, w)
    ws.ensure_counters(lay.fold_blocks)
    runtime.ensure_triton_allocator()
    bufs = _local_buffers(ws, lay, t_, h, f, top_k)
    bufs.update(data=ws.data, sig=ws.signals, ctr=ws.counters, peer_data=ws.peer_data, peer_sig=ws.peer_signals,
                peer_ctr=ws.peer_counters, errors=ws.errors, layout=lay)
    bias32 = bias.float().contiguous() if bias is not None else None
    ws.before_launch()
    y = torch.empty((t_, h), dtype=torch.bfloat16, device=x.device)
    x_mx = quantize_mx(x) if mx else None
    # the self-check compares y only: gu's row placement (like xe's) follows atomics, its values do not
    gu = torch.empty((lay.max_rows, 2 * f), dtype=torch.bfloat16, device=x.device) if save_gu else None
    if routing == GIVEN:
        _put_given(bufs, weights, experts)
    args, kw = _launch_args(x, router_weight, bias32, w13, w2, y, bufs, rank=r, world=w, epoch_slot=ws.epoch_slot,
                            timeout_ns=ws.timeout_ns(), grid=grid, cfg=cfg, top_k=top_k, routing=routing,
                            renormalize=renormalize, n_group=n_group, topk_group=topk_group,
                            routed_scaling=routed_scaling, policy=policy, comm_programs=comm_programs,
                            trace=trace, x_mx=x_mx, gu=gu)
    kl = launch_plan.KernelLaunch(_moe_forward_kernel, grid, args, kw)
    info = dict(y_shape=(t_, h), gu_shape=(lay.max_rows, 2 * f), world=w, mx=mx, bufs=bufs,
                clean=launch_plan.clean_check(ws), xq_key=quantize_plan(x) if mx else None)
    if key is not None:
        sources = dict(x=x, router=router_weight, bias=bias32, w13=w13, w2=w2, y=y, trace=trace, gu=gu,
                       xq=x_mx.payload.view(torch.bfloat16) if mx else None, xs=x_mx.scales if mx else None)
        plan = launch_plan.make_plan(kl, sources, ws, info)
        if plan is not None:
            launch_plan.store(ws, key, plan)
    kl.launch(list(args), outputs=(y,), clean=info["clean"], self_check=trace is None)
    ws.after_launch()
    return _moe_result(y, bufs, t_, top_k, return_routing, gu, w)


class SavedGateUp:
    """GEMM1's g | u from a forward call (``moe_forward(..., save_gu=True)``), for ``moe_backward(saved_gu=)``.

    ``gu`` [rows, 2F] bf16 and ``meta`` [rows, 3] int32 (source rank, token, slot) hold the rows in the
    forward's placement: expert-major and contiguous per local expert, sources in rank order inside an expert,
    but inside a source in the order of an atomic counter. ``in_backward_order`` gathers them into the
    backward's order (pairs by expert, then source rank, then p = token*k + slot), which is unique, so the
    result does not depend on the atomics: the backward stays bitwise reproducible."""

    def __init__(self, gu: torch.Tensor, meta: torch.Tensor, tokens: int, top_k: int, world: int):
        self.gu, self.meta, self.tokens, self.top_k, self.world = gu, meta, tokens, top_k, world

    def in_backward_order(self, counts: torch.Tensor, rows: int) -> torch.Tensor:
        """gu's first ``rows`` rows (= sum(counts), this rank's expert rows; host-known: T*k at W = 1) in the
        backward's order; ``counts`` [E/W] rows per local expert (on the device; no host synchronisation):
        one argsort of the rows' unique keys, one row gather (faster than scattering the rows to their places:
        docs/design/moe_forward.md)."""
        if rows == 0:
            return self.gu[:0]
        return self.gu[self.backward_order_index(counts, rows)]

    def backward_order_index(self, counts: torch.Tensor, rows: int) -> torch.Tensor:
        """The gather index of ``in_backward_order`` (int64 [rows]: backward row i is gu[index[i]]), for callers
        that gather into another layout (moe_backward's padded rows)."""
        meta = self.meta[:rows].long()
        dev_ = self.gu.device
        ends = torch.cumsum(counts.to(device=dev_, dtype=torch.int64), 0)
        le = torch.searchsorted(ends, torch.arange(rows, device=dev_), right=True)
        per_rank = self.tokens * self.top_k
        key = (le * self.world + meta[:, 0]) * per_rank + meta[:, 1] * self.top_k + meta[:, 2]
        return torch.argsort(key)


def _put_given(bufs, weights, experts) -> None:
    """Routing given: the caller's decision into the launch's routing buffers (what ROUTE would have stored)."""
    n = weights.numel()
    bufs["topk_w"][:n].view(weights.shape).copy_(weights)
    bufs["topk_e"][:n].view(experts.shape).copy_(experts)


def _moe_result(y, bufs, t_, top_k, return_routing, gu=None, world=1):
    if return_routing:
        out = (y, bufs["topk_w"][:t_ * top_k].view(t_, top_k).clone(),
               bufs["topk_e"][:t_ * top_k].view(t_, top_k).long())
        if gu is not None:  # the placement metadata: the workspace's copy is overwritten by the next call
            out += (SavedGateUp(gu, bufs["xe_meta"].view(-1, 3)[:gu.shape[0]].clone(), t_, top_k, world),)
        return out
    return y


def _check_same_shape_on_every_rank(ws, key: tuple) -> None:
    """The kernel lays out every rank's buffers from T, H, F, E and k: a rank calling with other values would
    write outside them. Checked once per new key with one small all-gather (like a workspace growth, never in
    the steady state)."""
    key = ("moe",) + key
    seen = ws.agreed_shapes
    if key in seen or ws.world.size == 1:
        return
    runtime.capture_refusal("its cross-rank check of this shape (one all-gather) has not run yet")
    import torch.distributed as dist
    on = "cpu" if runtime.gloo_group(ws.world.group) else ws.world.device  # gloo: host tensors
    mine = torch.tensor(key[1:], dtype=torch.int64, device=on)
    got = [torch.empty_like(mine) for _ in range(ws.world.size)]
    dist.all_gather(got, mine, group=ws.world.group)
    names = ("T (tokens per rank)", "H", "F", "E", "top_k", "routing")
    for r, g in enumerate(got):
        diff = [f"{n}={int(a)} on rank {r} vs {int(b)} here" for n, a, b in zip(names, g.tolist(), key[1:])
                if a != b]
        if diff:
            raise ValueError("moe_forward: every rank must call with the same shapes and routing: " + "; ".join(diff))
    seen.add(key)


def expert_gemms(x_sorted: torch.Tensor, counts: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                 config: MoEForwardConfig | None = None) -> torch.Tensor:
    """The layer's expert GEMMs alone (GEMM1 + SwiGLU + GEMM2, same device code and tiles as ``moe_forward``) on
    rows already grouped by local expert: ``x_sorted`` [R, H] bf16, ``counts`` [E/W] int (rows per expert,
    summing to R, on the GPU; never read on the host). Returns [R, H] bf16. For measuring the GEMMs against
    ``torch._grouped_mm``; it involves no other rank."""
    for name, t, dims in (("x_sorted", x_sorted, 2), ("w13", w13, 3), ("w2", w2, 3)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims or t.dtype != torch.bfloat16 or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {dims}-D torch.bfloat16 tensor")
    el, h, f2 = w13.shape
    r_, hx = x_sorted.shape
    if hx != h or tuple(w2.shape) != (el, f2 // 2, h) or counts.shape != (el,):
        raise ValueError(f"shapes disagree: x_sorted {tuple(x_sorted.shape)}, counts {tuple(counts.shape)}, "
                         f"w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    f = f2 // 2
    cfg = planning.moe_config(check_config(MoEForwardConfig, config))
    ws = runtime.get_workspace(None, x_sorted.device)
    lay = Layout(1, max(1, r_), h, f, 1, el, cfg)
    lay.max_rows = r_
    lay.max_mtiles = -(-r_ // cfg.BM) + el
    lay.scratch_n = int(SC_PERM.value) + el + lay.max_mtiles
    runtime.ensure_triton_allocator()
    grid = runtime.num_sms(x_sorted.device) if x_sorted.is_cuda else 3  # 3 programs under the CPU interpreter
    # everything but x, the weights and the output is made once and kept: no allocation or extra kernel per call
    own_sig = ws.local("moe.gemms_sig", 64, torch.int32)
    own_tbl = ws.local("moe.gemms_sig_tbl", 1, torch.int64, init=lambda t: t.fill_(own_sig.data_ptr()))
    # the counts serve as source 0's row of the count table (the GEMM-only plan reads counts[:E/W] only)
    cnt = counts if counts.dtype == torch.int32 and counts.is_contiguous() else counts.to(torch.int32).contiguous()
    bufs = dict(
        data=ws.local("moe.gemms_data", 256, torch.uint8), sig=own_sig, ctr=own_sig,
        peer_data=ws.local("moe.gemms_tbl", 1, torch.int64), peer_sig=own_tbl, peer_ctr=own_tbl, counts=cnt,
        layout=lay, topk_w=own_sig, topk_e=own_sig, xe=x_sorted, xe_meta=own_sig,
        hb=ws.local("moe.gemms_hb", max(1, r_) * f, torch.bfloat16),
        plan=ws.local("moe.gemms_plan", lay.plan_n, torch.int32),
        scratch=ws.local("moe.gemms_scratch", lay.scratch_n, torch.int32))
    y = torch.empty((r_, h), dtype=torch.bfloat16, device=x_sorted.device)
    if r_ == 0:
        return y
    # a timed-out wait (GEMM2 on a GEMM1 tile) goes where every op's does: the workspace's error record on CUDA,
    # raised by the next call or kosmos.check_errors(); on the CPU (the interpreter) right after the launch
    bufs["errors"] = runtime.one_rank_errors(ws, x_sorted.device)
    router = ws.local("moe.gemms_router", el * h, torch.bfloat16)[:el * h].view(el, h)  # unused by the GEMMs
    # its own epoch slot: these launches are not calls of the workspace's group (no peer keeps step with them)
    launch(x_sorted[:1], router, None, w13, w2, y, bufs, rank=0, world=1,
           epoch_slot=ws.local("moe.gemms_epoch", 1, torch.int32), timeout_ns=ws.timeout_ns(),
           grid=grid, cfg=cfg, top_k=1, stages=(1 << GEMM1) | (1 << GEMM2), gemms_only=True)
    runtime.after_one_rank_launch(ws, x_sorted.device, bufs["errors"])
    return y
