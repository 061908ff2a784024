"""The one launch's exchange stages at W > 1 (one_launch.py: where they sit in the drain order, what waits for them),
over the forward's peer mechanism (symmetric data regions of layout.EPLayout, peer pointer tables, epoch flags):

* ``_ep_combine_block`` (COMBINE-BWD) and ``_ep_publish``: this rank's token rows -- x, dy, per-slot metadata (the
  receiver's local expert or -1, the pair's place), gate weights -- once to every rank holding one of the token's
  experts, at the receiver's row [rank * T + t] (no slot atomics); then this rank's pair counts and flag;
* ``_ep_ensure_plan``: the receiver's plan (counts, pad_offs, first_mtile, base[s, e]) built by one CAS-elected
  program once every source's flag holds the epoch;
* ``_ep_permute_task`` (PERMUTE-BWD): gap rows zeroed, received rows placed in the padded layout at pad_offs[e] +
  base[s, e] + place -- (source rank, pair) order inside an expert, the multi-launch path's;
* ``_ep_dispatch_mtile`` (DISPATCH-BWD): an m-tile's dx rows and gate gradients to their tokens' ranks' combine rows
  [t*k + j], with a system-scope release on the receiver's per-block counter.
No row's place depends on an atomic; no float atomics. Tests: tests/test_moe_backward.py ``-k ep_`` (simulated ranks
under the interpreter and on one GPU), tests/test_ranks_one_gpu.py."""
from __future__ import annotations

import triton
import triton.language as tl

from ...core import device as dev
from ...core.codes import OP_MOE_BACKWARD, WAIT_BWD_COMBINE, WAIT_BWD_PLAN
from .tiles import _mtile_expert, _to_out


# ------------------------------------------------------- the one launch at W > 1: the exchanges as stages
@triton.jit
def _ep_combine_block(b, x_ptr, dy_ptr, exp_ptr, w_ptr, pidx_ptr, peer_data, off_rx, off_rdy, off_meta, off_w, T, H,
                      El, rank, WORLD: tl.constexpr, TOPK: tl.constexpr, KP2: tl.constexpr, XB: tl.constexpr,
                      XBH: tl.constexpr):
    """COMBINE-BWD task b: tokens [b*XB, +XB) of this rank. To every rank d: the tokens' metadata rows (per slot j:
    d's local expert or -1, and the pair's place among this rank's pairs of that expert -- computed at the source
    from its stable expert sort) and gate weights; each token's x and dy rows once to every d holding one of its
    experts. Everything lands at d's receive row [rank * T + t]: the token's own index, so no slot atomics and
    nothing whose place depends on the schedule."""
    rows = b * XB + tl.arange(0, XB)
    tm = rows < T
    kc = tl.arange(0, KP2)[None, :]
    pm = tm[:, None] & (kc < TOPK)
    po = rows[:, None] * TOPK + kc
    e = tl.load(exp_ptr + po, mask=pm, other=0)
    dest = tl.where(pm, e // El, -1)
    le = e - dest * El
    idx = tl.load(pidx_ptr + po, mask=pm, other=0)
    wv = tl.load(w_ptr + po, mask=pm, other=0.0)
    at = (rank * T + rows).to(tl.int64)
    for d in tl.static_range(WORLD):
        meta = dev.peer_region(peer_data, d, off_meta, tl.int32) + at[:, None] * (2 * TOPK) + 2 * kc
        tl.store(meta, tl.where(dest == d, le, -1), mask=pm)
        tl.store(meta + 1, idx, mask=pm)
        tl.store(dev.peer_region(peer_data, d, off_w, tl.float32) + at[:, None] * TOPK + kc, wv, mask=pm)
    for c0 in range(0, H, XBH):
        c = c0 + tl.arange(0, XBH)
        m = tm[:, None] & (c < H)[None, :]
        o = rows.to(tl.int64)[:, None] * H + c[None, :]
        xv = tl.load(x_ptr + o, mask=m)
        dv = tl.load(dy_ptr + o, mask=m)
        o2 = at[:, None] * H + c[None, :]
        for dd in range(WORLD):  # dynamic: one destination's pointers live at a time
            has = tl.max(tl.where(dest == dd, 1, 0), 1) > 0
            mm = m & has[:, None]
            tl.store(dev.peer_region(peer_data, dd, off_rx, tl.bfloat16) + o2, xv, mask=mm)
            tl.store(dev.peer_region(peer_data, dd, off_rdy, tl.bfloat16) + o2, dv, mask=mm)


@triton.jit
def _ep_publish(send_cnt_ptr, peer_data, peer_sig, off_cnt, El, rank, epoch, WORLD: tl.constexpr,
                ELP2: tl.constexpr, FLAG_BASE: tl.constexpr):
    """The rank's last COMBINE-BWD task: this rank's pair counts of d's experts into d's count row [rank], then
    flag FLAG_BASE + rank = epoch on d (release: every COMBINE task's stores, acquired through the task count)."""
    i = tl.arange(0, ELP2)
    for d in tl.static_range(WORLD):
        c = tl.load(send_cnt_ptr + d * El + i, mask=i < El, other=0)
        tl.store(dev.peer_region(peer_data, d, off_cnt, tl.int32) + rank * El + i, c, mask=i < El)
        dev.notify(dev.peer_ptr(peer_sig, d, tl.int32) + FLAG_BASE + rank, epoch)


@triton.jit
def _ep_ensure_plan(sig_ptr, cnt_ptr, counts_ptr, pad_offs_ptr, first_mtile_ptr, base_ptr, state_ptr, El, rank,
                    epoch, timeout_ns, err_ptr, WORLD: tl.constexpr, WP2: tl.constexpr, ELP2: tl.constexpr,
                    BM: tl.constexpr, PAD: tl.constexpr, FLAG_BASE: tl.constexpr):
    """This call's plan at the holder, once every source's flag holds the epoch (CAS-elected builder, as
    moe_forward._ensure_plan; the others wait for it): counts[e] = sum over sources, pad_offs (the padded layout),
    first_mtile (padded with 2**30 to ELP2, as _mtile_plan's), base[s, e] = the rows of e from sources < s.
    Returns 0 on a timeout."""
    ok = 1
    state = dev.load_uniform(state_ptr)
    if state < 2:
        for s in tl.static_range(WORLD):
            ok = ok & dev.wait_geq(sig_ptr + FLAG_BASE + s, epoch, timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                   WAIT_BWD_COMBINE, rank, -1, s)
        if ok != 0:
            won = 0
            if state == 0:
                won = (tl.atomic_cas(state_ptr, 0, 1, sem="acq_rel", scope="gpu") == 0).to(tl.int32)
            if won != 0:
                si = tl.arange(0, WP2)[:, None]
                ei = tl.arange(0, ELP2)[None, :]
                sm = (si < WORLD) & (ei < El)
                c = tl.load(cnt_ptr + si * El + ei, mask=sm, other=0, volatile=True)
                tot = tl.sum(c, 0)
                e1 = tl.arange(0, ELP2)
                em = e1 < El
                padded = tl.cdiv(tot, PAD) * PAD
                mt = tl.cdiv(tot, BM)
                tl.store(counts_ptr + e1, tot, mask=em)
                tl.store(pad_offs_ptr + e1, tl.cumsum(padded, 0) - padded, mask=em)
                tl.store(first_mtile_ptr + e1, tl.where(em, tl.cumsum(mt, 0) - mt, 2**30))
                tl.store(base_ptr + si * El + ei, tl.cumsum(c, 0) - c, mask=sm)
                tl.debug_barrier()
                tl.atomic_xchg(state_ptr, 2, sem="release", scope="gpu")
    if ok != 0:  # the acquire (and proxy fence) of the plan for every program
        ok = dev.wait_geq(state_ptr, 2, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_PLAN, rank, -1, 0)
    return ok


@triton.jit
def _ep_permute_task(p, recv_x, recv_dy, recv_meta, recv_w, counts_ptr, pad_offs_ptr, base_ptr, x_rows, dy_rows,
                     do_rows, gu_ptr, wp_ptr, valid_ptr, row_meta_ptr, placed_ptr, T, H, F, El, rank,
                     WORLD: tl.constexpr, TOPK: tl.constexpr, KP2: tl.constexpr, XB: tl.constexpr,
                     XBH: tl.constexpr, PAD: tl.constexpr, INTERP: tl.constexpr):
    """PERMUTE-BWD task p. p < El: expert p's gap rows (after its last row, up to the pad) zeroed in x_rows, dy_rows,
    do_rows, g | u, w_pair and valid -- the layout's contract (the flat wgrad and the SwiGLU pass read them).
    Else received rows [b*XB, +XB) of source s = (rank + (p - El) // blocks) % W (own rows first): every pair's
    row at its deterministic place pad_offs[e] + base[s, e] + idx -- (source rank, pair order) inside an expert,
    the multi-launch path's order -- with x, dy, do = bf16(w * dy) (gather_rows_and_scaled's product), w, valid
    and (source, pair) for the dispatch backward. +1 on placed[e] per row and per gap task (release)."""
    if p < El:
        n = tl.load(counts_ptr + p)
        r0 = tl.load(pad_offs_ptr + p) + n
        n_gap = tl.cdiv(n, PAD) * PAD - n
        for g0 in range(0, n_gap, XB):
            r = g0 + tl.arange(0, XB)
            rm = r < n_gap
            row = (r0 + r).to(tl.int64)
            tl.store(wp_ptr + row, tl.zeros([XB], tl.float32), mask=rm)
            tl.store(valid_ptr + row, tl.zeros([XB], tl.uint8), mask=rm)
            zero = tl.zeros([XB, XBH], tl.bfloat16)
            for c0 in range(0, H, XBH):
                c = c0 + tl.arange(0, XBH)
                o = row[:, None] * H + c[None, :]
                m = rm[:, None] & (c < H)[None, :]
                tl.store(x_rows + o, zero, mask=m)
                tl.store(dy_rows + o, zero, mask=m)
                tl.store(do_rows + o, zero, mask=m)
            for c0 in range(0, 2 * F, XBH):
                c = c0 + tl.arange(0, XBH)
                tl.store(gu_ptr + row[:, None] * (2 * F) + c[None, :], zero, mask=rm[:, None] & (c < 2 * F)[None, :])
        tl.debug_barrier()
        tl.atomic_add(placed_ptr + p, 1, sem="release", scope="gpu")
    else:
        n_xb = tl.cdiv(T, XB)
        s = (rank + (p - El) // n_xb) % WORLD
        tok = ((p - El) % n_xb) * XB + tl.arange(0, XB)
        tm = tok < T
        kc = tl.arange(0, KP2)[None, :]
        km = tm[:, None] & (kc < TOPK)
        at = (s * T + tok).to(tl.int64)
        le = tl.load(recv_meta + at[:, None] * (2 * TOPK) + 2 * kc, mask=km, other=-1)
        idx = tl.load(recv_meta + at[:, None] * (2 * TOPK) + 2 * kc + 1, mask=km, other=0)
        valid = km & (le >= 0)
        le = tl.where(valid, le, 0)
        dst = tl.load(pad_offs_ptr + le, mask=valid, other=0) + tl.load(base_ptr + s * El + le, mask=valid,
                                                                        other=0) + idx
        w = tl.load(recv_w + at[:, None] * TOPK + kc, mask=valid, other=0.0)
        d64 = dst.to(tl.int64)
        tl.store(row_meta_ptr + d64 * 2, s + 0 * dst, mask=valid)
        tl.store(row_meta_ptr + d64 * 2 + 1, tok[:, None] * TOPK + kc, mask=valid)
        tl.store(wp_ptr + d64, w, mask=valid)
        tl.store(valid_ptr + d64, tl.full(dst.shape, 1, tl.uint8), mask=valid)
        for c0 in range(0, H, XBH):
            c = c0 + tl.arange(0, XBH)
            cm = (c < H)[None, :]
            so = at[:, None] * H + c[None, :]
            xv = tl.load(recv_x + so, mask=tm[:, None] & cm)
            dv = tl.load(recv_dy + so, mask=tm[:, None] & cm)
            for j in range(TOPK):  # dynamic: unrolled, the k slots' pointers would be live together
                dj = tl.sum(tl.where(kc == j, d64, 0), 1)
                vj = tl.max(tl.where((kc == j) & valid, 1, 0), 1) > 0
                wj = tl.sum(tl.where(kc == j, w, 0.0), 1)
                o = dj[:, None] * H + c[None, :]
                mm = vj[:, None] & cm
                tl.store(x_rows + o, xv, mask=mm)
                tl.store(dy_rows + o, dv, mask=mm)
                tl.store(do_rows + o, _to_out(dv.to(tl.float32) * wj[:, None], tl.bfloat16, INTERP), mask=mm)
        tl.debug_barrier()
        tl.atomic_add(placed_ptr + le, 1, mask=valid, sem="release", scope="gpu")


@triton.jit
def _ep_dispatch_mtile(gm, first_mtile_ptr, pad_offs_ptr, counts_ptr, dx_rows, dw_rows, row_meta_ptr, peer_data,
                       peer_ctr, off_cx, off_cdw, H, TOPK: tl.constexpr, ELP2: tl.constexpr, BM: tl.constexpr,
                       XB: tl.constexpr, XBH: tl.constexpr, UT: tl.constexpr):
    """DISPATCH-BWD task gm (its dgrad1 tiles done): each real row's dx (bf16) and gate gradient (fp32) straight
    into its token's rank's combine rows [t*k + j], then +1 per row on that rank's counter of the token's
    UNPERMUTE block (release, system scope: the rows are remote)."""
    e = _mtile_expert(first_mtile_ptr, gm, ELP2)
    lm0 = (gm - tl.load(first_mtile_ptr + e)) * BM
    row0 = tl.load(pad_offs_ptr + e) + lm0
    n_rows = tl.minimum(tl.load(counts_ptr + e) - lm0, BM)
    for r0 in range(0, n_rows, XB):
        r = r0 + tl.arange(0, XB)
        rm = r < n_rows
        row = (row0 + r).to(tl.int64)
        src = tl.load(row_meta_ptr + row * 2, mask=rm, other=0)
        pair = tl.load(row_meta_ptr + row * 2 + 1, mask=rm, other=0)
        dst = dev.peer_region(peer_data, src, off_cx, tl.bfloat16) + pair.to(tl.int64) * H
        for c0 in range(0, H, XBH):
            c = c0 + tl.arange(0, XBH)
            m = rm[:, None] & (c < H)[None, :]
            tl.store(dst[:, None] + c[None, :], tl.load(dx_rows + row[:, None] * H + c[None, :], mask=m), mask=m)
        tl.store(dev.peer_region(peer_data, src, off_cdw, tl.float32) + pair, tl.load(dw_rows + row, mask=rm),
                 mask=rm)
        tl.debug_barrier()
        tl.atomic_add(dev.peer_region(peer_ctr, src, 0, tl.int32) + (pair // TOPK) // UT, 1, mask=rm, sem="release",
                      scope="sys")
