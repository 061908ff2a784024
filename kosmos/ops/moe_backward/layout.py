"""Row layouts and the one launch's numbering, all host-side or device-side without host synchronisation:

* the padded row layout (``WGRAD_PAD_ROWS`` = 64): expert e's rows from pad_offs[e] = the exclusive cumsum of
  ceil(counts / 64) * 64, at most R + E * 63 rows (``padded_rows_bound``), the gap rows zero in at least one operand
  -- one TMA descriptor per operand then serves every expert (``padded_row_offsets``, ``padded_layout``: the sorted
  rows' padded places; ``pad_expert_rows``: a stand-alone copy into it);
* the m-tile plan (``_mtile_plan``: each expert's first m-tile, a static bound) and ``expert_counts`` (a scatter-add,
  exact in any order; torch.bincount would read its max back to the host);
* the one launch's stage numbers (``BWD_*``, ``STAGE_BWD_*``), the stage masks of the CPU tests' phases at W > 1
  (``EP_PHASES``, ``EP_PHASES_FIXED``) and of the fixed policy's communication role (``BWD_COMM_STAGES``), and its
  local scratch slots (``SCB_*``; their protocol: one_launch.py's docstring);
* the W > 1 buffers: ``EPLayout`` (the symmetric data regions' byte offsets and the worst-case row bounds),
  ``ep_local_buffers``, ``ep_pair_places`` (each pair's place inside its expert at the source: atomic-free rows).
Tests: tests/test_moe_backward.py (test_gather_rows_and_padded_layout, test_expert_counts_equals_bincount,
test_expert_weight_grads_padded*, test_moe_backward_one_launch_ep_layout_refuses_other_shapes)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core import planning
from .tiles import _bwd_tiles


# ---- the padded row layout (the flat wgrad loop's, and the one launch's) ---------------------------------------
WGRAD_PAD_ROWS = 64  # the padded layout's granularity: each expert's rows start at a multiple of it (the GPU's BR)


def padded_rows_bound(rows: int, n_experts: int, pad: int = WGRAD_PAD_ROWS) -> int:
    """A host-known bound on the padded layout's rows: sum over e of ceil(counts[e] / pad) * pad <= rows +
    n_experts * (pad - 1) for any counts summing to <= rows (no host synchronisation)."""
    return rows + n_experts * (pad - 1)


def padded_row_offsets(counts: torch.Tensor, pad: int = WGRAD_PAD_ROWS) -> torch.Tensor:
    """First padded row of each expert (int32, on counts' device, no host synchronisation): the exclusive cumsum
    of ceil(counts[e] / pad) * pad -- every expert's rows start at a multiple of ``pad``."""
    c = counts.to(torch.int32)
    padded = (c + pad - 1) // pad * pad
    return torch.cumsum(padded, 0, dtype=torch.int32) - padded


def pad_expert_rows(x: torch.Tensor, counts: torch.Tensor, pad_offs: torch.Tensor, padded_rows: int) -> torch.Tensor:
    """x [R, K] with expert e's counts[e] rows consecutive (experts in order) -> [padded_rows, K] in the padded
    layout: expert e's rows at pad_offs[e] onwards, every other row zero (the gaps and the tail past the last
    expert). A gather per padded row (device-side, no host synchronisation, deterministic): reads the rows once,
    writes the padded array twice (index_select, then zeros over the gap rows). A stand-alone copy (tests, the
    probe): moe_backward's row gathers write the padded layout directly."""
    e = counts.shape[0]
    if e == 0 or x.shape[0] == 0:
        return x.new_zeros(padded_rows, x.shape[1])
    c = counts.to(torch.int32)
    offs = torch.cumsum(c, 0, dtype=torch.int32) - c
    po = pad_offs.to(torch.int32).contiguous()
    q = torch.arange(padded_rows, device=x.device, dtype=torch.int32)
    eq = (torch.searchsorted(po, q, right=True) - 1).clamp(0, e - 1)  # the last expert starting at or before q
    within = q - po[eq]  # an expert without rows shares its successor's start and loses the tie
    valid = (within >= 0) & (within < c[eq])
    src = (within + offs[eq]).clamp(0, x.shape[0] - 1)
    out = x.index_select(0, src.long())
    return out.masked_fill_(~valid[:, None], 0)


def padded_layout(counts: torch.Tensor, rows: int, pad: int = WGRAD_PAD_ROWS):
    """The padded row layout of ``rows`` expert-sorted rows (counts [E] per expert, in order), on the device
    with no host synchronisation: (pad_offs [E] int32 = padded_row_offsets, row_of [rows] int64 -- sorted row
    i's padded row --, real_of [padded_rows_bound(rows, E)] int64 -- each padded row's sorted row, -1 for the
    gap rows and the tail), end [1] int32 -- the last expert's padded end: rows from it on are read by no one).
    moe_backward gathers its expert rows through real_of (gather_rows: -1 gives zeros; none past ``end``) and
    reads them back through row_of."""
    e = counts.shape[0]
    dev_ = counts.device
    c = counts.to(torch.int64)
    pad_offs = padded_row_offsets(counts, pad)
    expert_of = torch.repeat_interleave(torch.arange(e, device=dev_), c, output_size=rows)
    row_of = torch.arange(rows, device=dev_) + (pad_offs.to(torch.int64) - (torch.cumsum(c, 0) - c))[expert_of]
    real_of = torch.full((padded_rows_bound(rows, e, pad),), -1, dtype=torch.int64, device=dev_)
    real_of[row_of] = torch.arange(rows, device=dev_)
    end = (pad_offs[-1:] + (c[-1:].to(torch.int32) + pad - 1) // pad * pad) if e else pad_offs.new_zeros(1)
    return pad_offs, row_of, real_of, end


def _mtile_plan(counts: torch.Tensor, rows: int, bm: int, offs=None):
    """(counts int32, first row per expert, first m-tile per expert padded to a power of two, static m-tile
    bound) -- all on the device, no host synchronisation. ``offs``: each expert's first row (the padded layout's
    padded_row_offsets) instead of the rows packed in expert order."""
    e = counts.shape[0]
    counts32 = counts.to(torch.int32)
    if offs is None:
        offs = torch.cumsum(counts32, 0, dtype=torch.int32) - counts32
    elif offs.shape != counts.shape:
        raise ValueError(f"offs {tuple(offs.shape)} must be shaped like counts {tuple(counts.shape)}")
    else:
        offs = offs.to(torch.int32).contiguous()
    mtiles = (counts32 + bm - 1) // bm
    elp2 = triton.next_power_of_2(max(e, 1))
    first_mtile = torch.full((elp2,), 2**30, dtype=torch.int32, device=counts.device)
    first_mtile[:e] = torch.cumsum(mtiles, 0, dtype=torch.int32) - mtiles
    return counts32, offs, first_mtile, elp2, -(-rows // bm) + e


def expert_counts(flat: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Pairs per expert, int64 [n_experts], with no host synchronisation: torch.bincount on CUDA reads its
    input's max back to the host to size the output (minlength or not), which would stall every backward call
    on the GPU. An integer scatter-add is exact in any order, so the counts stay deterministic."""
    flat = flat.reshape(-1).long()
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


# ------------------------------------------------------------- the backward's expert part in one launch (W = 1)
# the stages (stage s's queue head is scratch[s]; WGRAD has none: statically owned). The drain order is the
# kernel's code order: DGRAD2 (SWIGLU inside it or its own queue next), DGRAD1, ROUTER_DL, WGRAD, ROUTER_DW,
# UNPERMUTE, ROUTER_DX (the three ROUTER_* stages only with the router backward in the launch)
BWD_DGRAD2, BWD_SWIGLU, BWD_DGRAD1, BWD_WGRAD, BWD_UNPERMUTE = 0, 1, 2, 3, 4
BWD_ROUTER_DL, BWD_ROUTER_DW, BWD_ROUTER_DX = 5, 6, 7

# W > 1 only (one_launch.py's docstring): the exchange's stages; their heads sit after the W = 1
# scratch (xs_base), so the W = 1 layout does not depend on them
BWD_COMBINE, BWD_PERMUTE, BWD_GU, BWD_DISPATCH = 8, 9, 10, 11
BWD_ALL_STAGES = (1 << 12) - 1

# the stages that read the W > 1 plan (each program entering them makes sure it exists)
EP_PLAN_STAGE_BITS = sum(1 << s for s in (BWD_PERMUTE, BWD_GU, BWD_DGRAD2, BWD_SWIGLU, BWD_DGRAD1, BWD_DISPATCH,
                                          BWD_WGRAD))

# the CPU interpreter's phases of one call at W > 1 (every rank's launch of a phase before any rank's next one):
# the rows out, the expert part and the rows back, the dispatch backward's sums and the router
EP_PHASES = (1 << BWD_COMBINE, EP_PLAN_STAGE_BITS, BWD_ALL_STAGES & ~EP_PLAN_STAGE_BITS & ~(1 << BWD_COMBINE))

# the fixed-role ablation's communication stages (one_launch.py's docstring, "Fixed-role policy"):
# the rows out (COMBINE-BWD), into the expert layout (PERMUTE-BWD), back (DISPATCH-BWD) and summed per token
# (UNPERMUTE) -- the forward's ROUTE (dispatch), PERMUTE and FOLD; programs pid < S take only these
BWD_COMM_STAGE_BITS = sum(1 << s for s in (BWD_COMBINE, BWD_PERMUTE, BWD_DISPATCH, BWD_UNPERMUTE))
BWD_COMM_STAGES: tl.constexpr = tl.constexpr(BWD_COMM_STAGE_BITS)

# the interpreter's phases under the fixed policy: DISPATCH-BWD gets a phase of its own -- the communication
# programs are the lowest pids, which the interpreter runs first, so in EP_PHASES' second phase they would reach
# DISPATCH-BWD before any compute program had run the DGRAD1 tiles it waits for
EP_PHASES_FIXED = (EP_PHASES[0], EP_PHASES[1] & ~(1 << BWD_DISPATCH), 1 << BWD_DISPATCH, EP_PHASES[2])
EP_PLAN_STAGES: tl.constexpr = tl.constexpr(EP_PLAN_STAGE_BITS)
STAGE_BWD_COMBINE: tl.constexpr = tl.constexpr(BWD_COMBINE)
STAGE_BWD_PERMUTE: tl.constexpr = tl.constexpr(BWD_PERMUTE)
STAGE_BWD_GU: tl.constexpr = tl.constexpr(BWD_GU)
STAGE_BWD_DISPATCH: tl.constexpr = tl.constexpr(BWD_DISPATCH)
BWD_EP_TOKENS = 16  # tokens (rows) per COMBINE / PERMUTE block and rows per DISPATCH step (GPU)
BWD_EP_COLS = 256   # their column step (GPU): [16, 256] bf16 blocks
STAGE_BWD_DGRAD2: tl.constexpr = tl.constexpr(BWD_DGRAD2)
STAGE_BWD_SWIGLU: tl.constexpr = tl.constexpr(BWD_SWIGLU)
STAGE_BWD_DGRAD1: tl.constexpr = tl.constexpr(BWD_DGRAD1)
STAGE_BWD_WGRAD: tl.constexpr = tl.constexpr(BWD_WGRAD)
STAGE_BWD_UNPERMUTE: tl.constexpr = tl.constexpr(BWD_UNPERMUTE)
STAGE_BWD_ROUTER_DL: tl.constexpr = tl.constexpr(BWD_ROUTER_DL)
STAGE_BWD_ROUTER_DW: tl.constexpr = tl.constexpr(BWD_ROUTER_DW)
STAGE_BWD_ROUTER_DX: tl.constexpr = tl.constexpr(BWD_ROUTER_DX)

# local scratch (int32, zeroed by the last program out): [0, 8) queue heads (WGRAD's: its rendezvous count), the
# exit counter, SwiGLU m-tiles done, dgrad1 tiles done, router dlogits blocks done, the two wgrad loops' run heads,
# then finished dgrad2 column tiles per m-tile [max m-tiles], SwiGLU-done flags per m-tile [max m-tiles] and
# (router in the launch) finished UNPERMUTE tasks per token block of the router's dx tiles [ceil(T / BM)]
SCB_EXIT: tl.constexpr = tl.constexpr(8)
SCB_SWIGLU_DONE: tl.constexpr = tl.constexpr(9)
SCB_DGRAD1_DONE: tl.constexpr = tl.constexpr(10)
SCB_ROUTER_DL_DONE: tl.constexpr = tl.constexpr(11)
SCB_WGRAD2_HEAD: tl.constexpr = tl.constexpr(12)  # config.wgrad_dynamic: the claimed runs of each flat loop
SCB_WGRAD1_HEAD: tl.constexpr = tl.constexpr(13)
SCB_MTILES: tl.constexpr = tl.constexpr(14)
BWD_ZERO_BLOCK: tl.constexpr = tl.constexpr(1024)  # scratch entries the last program out zeroes per step


def _pair_rows(order: torch.Tensor, row_of=None) -> torch.Tensor:
    """Each pair p = t*k + j's expert row (inv[order[i]] = i, or row_of[i] in the padded layout): the dispatch
    backward's gather index (unpermute_sum and the one launch)."""
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.shape[0], dtype=order.dtype, device=order.device) if row_of is None else \
        row_of.to(order.dtype)
    return inv


class EPLayout:
    """The one launch at W > 1: byte offsets of its regions in a rank's symmetric data buffer (every rank the same
    T, H, F, E, k: the forward's contract) and the host-known bounds of its local buffers (the worst case: every
    token of every rank to this rank's experts, as moe_forward.Layout)."""

    def __init__(self, world: int, tokens: int, hidden: int, ffn: int, top_k: int, local_experts: int, bm: int,
                 ut: int):
        def up(v):
            return (v + 255) // 256 * 256
        wt = world * tokens
        self.off_recv_x = 0                                         # [W*T, H] bf16: source s's token t at s*T + t
        self.off_recv_dy = up(wt * hidden * 2)                      # [W*T, H] bf16
        self.off_meta = up(self.off_recv_dy + wt * hidden * 2)      # [W*T, 2k] int32: (local expert or -1, place)
        self.off_w = up(self.off_meta + wt * 2 * top_k * 4)         # [W*T, k] fp32: the gate weights
        self.off_cnt = up(self.off_w + wt * top_k * 4)              # [W, E/W] int32: pairs per (source, expert)
        self.off_comb_x = up(self.off_cnt + world * local_experts * 4)  # [T*k, H] bf16: the pairs' dx rows back
        self.off_comb_dw = up(self.off_comb_x + tokens * top_k * hidden * 2)  # [T*k] fp32: their gate gradients
        self.data_bytes = up(self.off_comb_dw + tokens * top_k * 4)
        self.max_rows = wt * min(top_k, local_experts)
        self.r_pad = padded_rows_bound(self.max_rows, local_experts)
        self.max_mtiles = -(-self.max_rows // bm) + local_experts
        self.fold_blocks = -(-tokens // ut)                         # the symmetric counters: one per UNPERMUTE block

    def regions(self, data: torch.Tensor, world: int, tokens: int, hidden: int, top_k: int, local_experts: int):
        """(recv_x, recv_dy, meta, w, cnt, comb_x, comb_dw) views of a rank's symmetric data buffer (uint8)."""
        wt = world * tokens
        def view(off, n, dtype):
            return data[off:off + n * torch.tensor([], dtype=dtype).element_size()].view(dtype)
        return (view(self.off_recv_x, wt * hidden, torch.bfloat16), view(self.off_recv_dy, wt * hidden, torch.bfloat16),
                view(self.off_meta, wt * 2 * top_k, torch.int32), view(self.off_w, wt * top_k, torch.float32),
                view(self.off_cnt, world * local_experts, torch.int32),
                view(self.off_comb_x, tokens * top_k * hidden, torch.bfloat16),
                view(self.off_comb_dw, tokens * top_k, torch.float32))


def ep_tiles():
    """(tokens per COMBINE / PERMUTE block, their column step) of the one launch at W > 1."""
    return (4, 16) if planning.interpreting() else (BWD_EP_TOKENS, BWD_EP_COLS)


def ep_layout(world: int, tokens: int, hidden: int, ffn: int, top_k: int, local_experts: int,
              out_dtype: torch.dtype = torch.bfloat16) -> EPLayout:
    """The EPLayout of a call (the launch's m-tile and UNPERMUTE block)."""
    (bm, *_), _, _, _, (ut, _), _ = _bwd_tiles(out_dtype, hidden, ffn)
    return EPLayout(world, tokens, hidden, ffn, top_k, local_experts, bm, ut)


def ep_local_buffers(alloc, lay: EPLayout, hidden: int, ffn: int, top_k: int, tokens: int, local_experts: int,
                     world: int) -> dict:
    """The one launch's local buffers at W > 1 from ``alloc(name, numel, dtype)`` (a workspace's ``local``, or the
    tests' allocator): the expert rows in the padded layout (worst case R_pad rows), their metadata, the plan,
    the intermediates, the scratch; none needs clearing between calls (the launch writes what it reads)."""
    r = lay.r_pad
    elp2 = triton.next_power_of_2(max(local_experts, 1))
    b = dict(dy_rows=(r, hidden), do_rows=(r, hidden), x_rows=(r, hidden), gu=(r, 2 * ffn), z=(r, ffn),
             dgu=(r, 2 * ffn), h=(r, ffn), dx_rows=(r, hidden))
    out = {k: alloc(f"moe_bwd.ep.{k}", s[0] * s[1], torch.bfloat16)[:s[0] * s[1]].view(s) for k, s in b.items()}
    out.update(w_pair=alloc("moe_bwd.ep.w_pair", r, torch.float32)[:r],
               dw_rows=alloc("moe_bwd.ep.dw_rows", r, torch.float32)[:r],
               valid=alloc("moe_bwd.ep.valid", r, torch.uint8)[:r],
               row_meta=alloc("moe_bwd.ep.row_meta", 2 * r, torch.int32)[:2 * r],
               counts=alloc("moe_bwd.ep.counts", local_experts, torch.int32)[:local_experts],
               pad_offs=alloc("moe_bwd.ep.pad_offs", local_experts, torch.int32)[:local_experts],
               first_mtile=alloc("moe_bwd.ep.first_mtile", elp2, torch.int32)[:elp2],
               base=alloc("moe_bwd.ep.base", world * local_experts, torch.int32)[:world * local_experts],
               iota=alloc("moe_bwd.ep.iota", tokens * top_k, torch.int32)[:tokens * top_k])
    return out


def ep_pair_places(experts: torch.Tensor, n_exp: int):
    """(place [T*k] int32, per-expert pairs [E] int32) of this rank's pairs p = t*k + j: p's place among this rank's
    pairs of its expert in token order (the stable expert sort's rank inside the expert: the multi-launch path's
    order) -- computed at the source, sent with the rows, so the holder places every row without atomics. Device
    ops only: no host synchronisation."""
    flat = experts.reshape(-1).long()
    per = expert_counts(flat, n_exp)
    order = torch.sort(flat, stable=True).indices
    place = torch.empty_like(flat)
    place[order] = torch.arange(flat.numel(), device=flat.device) - (torch.cumsum(per, 0) - per)[flat[order]]
    return place.to(torch.int32), per.to(torch.int32)
