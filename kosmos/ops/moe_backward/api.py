"""The MoE layer's backward, entry points: ``moe_backward`` (over an EP group or at one rank) and
``moe_backward_w1`` (one rank). For this rank's dy [T, H] and the forward's routing decision (weights [T, k] fp32,
experts [T, k] global ids), with w13 [E/W, H, 2F] / w2 [E/W, F, H] this rank's experts: dx [T, H] bf16,
d_router_weight [E, H] fp32 (this rank's tokens' part), dw13 / dw2 in the parameters' dtype (fp32 accumulation
rounded once; ``wgrad_dtype=torch.float32`` keeps the fp32 sums) -- reference.moe.moe_backward_ref's stages.

The route, decided the same way on every rank: the one launch (one_launch.py) at W = 1 on the padded layout
(``MoEBackwardConfig.one_launch``) and at W > 1 on CUDA without ``saved_gu`` (``one_launch_ep``); the multi-launch
path (multi_launch.py: the expert GEMM kernels, the row passes of rows.py, ``dist.all_to_all_single`` between them
at W > 1, the router backward in torch) elsewhere -- the CPU, saved g | u at W > 1, ``one_launch=False``. With the
routing given from outside (``routing="given"``) there is no router backward: the gradient of the given weights
comes back instead of the router weight's. ``precision="mxfp8"``: the MX backward (mx.py: every backward GEMM on MX
operands along its own K), on the multi-launch path in the padded layout at any W. Argument checks raise ValueError
before any collective or launch (the one launch on the packed layout, ``policy="fixed"`` at W = 1 or without the
one launch, shapes, routing names).
Also here: the router's GEMMs at fp32-level error on bf16 tensor cores (``bf16_mm_fp32``, ``router_gemm_backward``)
and ``expert_backward_operands`` (the bench's expert-part operands).

Host synchronisation: none at W = 1 (counts by layout.expert_counts, not torch.bincount) nor in the one launch's
steady state at W > 1; the multi-launch path at W > 1 reads its split sizes on the host (one sync). Determinism:
stable sorts, fixed summation orders, no float atomics; the exchanges only move rows. Tests: tests/test_moe_backward.py
(``moe_backward`` vs the reference at W = 1 and over two ranks, padded vs packed bitwise, never-syncs on the GPU,
the refusals), tests/test_bench_moe.py (the bench's backward rows). Design: docs/design/moe_backward.md."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ...config import MoEBackwardConfig, check_config

from ...core import runtime
from ...core.runtime import world_size
from ...reference import moe as mr
from ...reference.moe import GIVEN, ROUTING_KINDS, all_to_all_rows, check_given_routing
from ..moe_forward import _check_same_shape_on_every_rank, weights_nk
from ...core.schedule import POLICIES, policy_args
from .tiles import _triton_runs
from .layout import SCB_MTILES, WGRAD_PAD_ROWS, _pair_rows, ep_layout, ep_local_buffers, expert_counts, padded_layout
from .rows import do_rows_of, gather_rows, gather_rows_and_scaled, unpermute_sum
from .multi_launch import expert_backward_gemms
from .mx import check_mx_weights, expert_backward_gemms_mx, expert_gemm1_operand, moe_mx_weights
from .router import RouterBackward, _router_tiles
from .one_launch import expert_backward_ep_launch, expert_backward_one_launch


# -------------------------------------------------------------------------------------------- the whole backward
def _expert_gemm1(x_rows: torch.Tensor, w13: torch.Tensor, counts: torch.Tensor, pad_offs=None) -> torch.Tensor:
    """[g | u] = x_rows @ W13[e] per expert (the forward's GEMM1, recomputed): torch._grouped_mm on CUDA (bf16
    out, fp32 accumulation), one expert at a time elsewhere. ``pad_offs``: x_rows in the padded layout
    (padded_row_offsets): each expert's group runs to its padded end, so its zero gap rows give zero rows."""
    c32 = counts.to(torch.int32)
    if pad_offs is None:
        starts, lens = torch.cumsum(c32, 0, dtype=torch.int32) - c32, c32
    else:
        starts, lens = pad_offs.to(torch.int32), (c32 + WGRAD_PAD_ROWS - 1) // WGRAD_PAD_ROWS * WGRAD_PAD_ROWS
    if x_rows.is_cuda and hasattr(torch, "_grouped_mm") and x_rows.shape[0] > 0:
        return torch._grouped_mm(x_rows, w13, offs=starts + lens)
    out = torch.zeros((x_rows.shape[0], w13.shape[2]), dtype=torch.bfloat16, device=x_rows.device)
    for e, (start, n) in enumerate(zip(starts.tolist(), counts.tolist())):
        if n:
            out[start:start + n] = (x_rows[start:start + n].float() @ w13[e].float()).to(torch.bfloat16)
    return out


def bf16_mm_fp32(a: torch.Tensor, b: torch.Tensor, config: MoEBackwardConfig | None = None) -> torch.Tensor:
    """a @ b in fp32 for a, b whose values are bf16: the products are exact in fp32 (8-bit significands), so a
    bf16 tensor-core GEMM with fp32 accumulation (torch.mm(..., out_dtype=torch.float32) on CUDA) is the fp32
    GEMM up to the summation order -- ~10x the fp32 SIMT GEMM's rate. The router's logits, as moe_forward's
    router computes them (tensor cores, fp32 accumulation). ``config.router_gemms`` "fp32" or a CPU tensor:
    a.float() @ b.float()."""
    if a.is_cuda and check_config(MoEBackwardConfig, config).router_gemms == "tensor-cores":
        return torch.mm(a.to(torch.bfloat16), b.to(torch.bfloat16), out_dtype=torch.float32)
    return a.float() @ b.float()


def router_gemm_backward(dlogits: torch.Tensor, x: torch.Tensor, router_weight: torch.Tensor,
                         config: MoEBackwardConfig | None = None):
    """reference.moe.router_gemm_backward_ref (d(router weight) = dl^T x [E, H], the router's part of dx = dl Wr)
    for bf16 x, Wr and fp32 dl on bf16 tensor cores: dl = hi + lo + r with hi = bf16(dl), lo = bf16(dl - hi)
    (|r| <= 2^-18 |dl|), split once for both GEMMs, so hi @ b + lo @ b (fp32 accumulation, products exact) is
    the fp32 GEMM to ~2^-17 relative -- two bf16 GEMMs instead of one fp32 SIMT GEMM each (at deepseek-v3 4k
    tokens 2 x 15 GFLOP). ``config.router_gemms`` "fp32" or CPU tensors: the reference's fp32 formulas."""
    if not (dlogits.is_cuda and check_config(MoEBackwardConfig, config).router_gemms == "tensor-cores"):
        return dlogits.t() @ x.float(), dlogits @ router_weight.float()
    hi = dlogits.to(torch.bfloat16)
    lo = (dlogits - hi.float()).to(torch.bfloat16)
    pair = lambda a, b: bf16_mm_fp32(a[0], b) + bf16_mm_fp32(a[1], b)  # noqa: E731
    return pair((hi.t(), lo.t()), x), pair((hi, lo), router_weight)


def _exchange(t: torch.Tensor, send_splits, recv_splits, group) -> torch.Tensor:
    """The rows of ``t`` to their ranks (reference.moe.all_to_all_rows; split sizes on the host)."""
    return all_to_all_rows(t, recv_splits, send_splits, group)


def _wgrad_dtype(w13: torch.Tensor, wgrad_dtype) -> torch.dtype:
    """The weight gradients' dtype: ``wgrad_dtype`` if given, else the parameters' (bf16; fp32 parameters: fp32)."""
    if wgrad_dtype is not None:
        return wgrad_dtype
    return torch.float32 if w13.dtype == torch.float32 else torch.bfloat16


def expert_backward_operands(x_sorted, dy_sorted, w_sorted, w13, counts, *, padded: bool | None = None,
                             config: MoEBackwardConfig | None = None) -> dict:
    """``expert_backward_gemms``'s operands (a dict of its arguments but the weights and the wgrad dtype, plus
    ``row_of``) from rows already sorted by local expert and packed -- x_sorted, dy_sorted [R, H] bf16, w_sorted
    [R] fp32, counts [E_local] -- in the layout ``moe_backward`` puts them in (padded: ``config.padded_rows`` where it
    applies, as there); gu = GEMM1 of x (bf16, torch._grouped_mm: what the forward saves). ``row_of`` [R]: the
    row of the layout that packed row i is (None: packed). For timing the expert part alone (the bench)."""
    rows, hidden = x_sorted.shape
    f = w13.shape[2] // 2
    if padded is None:
        padded = check_config(MoEBackwardConfig, config).padded_rows
    padded = padded and _triton_runs(x_sorted) and hidden % 8 == 0 and f % 8 == 0
    w_sorted = w_sorted.float()
    if not padded:
        return dict(dy_rows=dy_sorted, do_rows=(dy_sorted.float() * w_sorted[:, None]).to(dy_sorted.dtype),
                    x_rows=x_sorted, gu=_expert_gemm1(x_sorted, w13, counts), w_pair=w_sorted, counts=counts,
                    pad_offs=None, valid=None, row_of=None)
    pad_offs, row_of, real_of, end = padded_layout(counts, rows)
    valid, real = real_of >= 0, real_of.clamp(min=0)
    idx = torch.where(valid, real, -1) if rows else torch.full_like(real_of, -1)
    w_pair = torch.where(valid, w_sorted[real], 0.0) if rows else torch.zeros(real_of.shape, device=x_sorted.device)
    x_rows = gather_rows(x_sorted, idx, end)
    dy_rows, do_rows = gather_rows_and_scaled(dy_sorted, idx, w_pair, end)
    return dict(dy_rows=dy_rows, do_rows=do_rows, x_rows=x_rows, gu=_expert_gemm1(x_rows, w13, counts, pad_offs),
                w_pair=w_pair, counts=counts, pad_offs=pad_offs, valid=valid, row_of=row_of)


def moe_backward(x, router_weight, w13, w2, dy, weights, experts, *, group=None, routing: str = "softmax",
                 renormalize: bool = True, routed_scaling: float = 1.0, wgrad_dtype=None, saved_gu=None,
                 padded: bool | None = None, one_launch: bool | None = None, programs: int | None = None,
                 router_in_launch: bool | None = None, policy: str = "self", comm_programs: int | None = None,
                 config: MoEBackwardConfig | None = None, precision: str = "bf16", mx_weights=None):
    """Gradients of the MoE layer over the EP ``group`` (None or one rank: all E experts local) for this rank's
    output gradient dy [T, H], given the forward's routing decision for this rank's tokens (``weights`` [T, k]
    fp32 and ``experts`` [T, k], global expert ids, e.g. ``moe_forward(..., return_routing=True)``), with
    w13 [E/W, H, 2F] / w2 [E/W, F, H] this rank's experts: (dx [T, H] bf16, d_router_weight [E, H] fp32 -- this
    rank's tokens' part, to be all-reduced like any replicated parameter's gradient --, dw13 [E/W, H, 2F] and
    dw2 [E/W, F, H] in the parameters' dtype (bf16: fp32 accumulation, rounded once; ``wgrad_dtype=torch.float32``
    for the fp32 accumulators), from every rank's tokens) -- reference.moe.moe_backward_ref's stages, with the three
    expert GEMM shapes on multi_launch.py's kernels and the rest in torch. w13 / w2 may also be the
    ``.transpose(1, 2)`` of contiguous [E/W, 2F, H] / [E/W, F, H] tensors (transformers' ``gate_up_proj`` /
    ``down_proj``; moe_forward.weights_nk): every path reads them as they are, and dw13 / dw2 then come back in
    that layout too (the transposes of contiguous [E/W, 2F, H] / [E/W, H, F]: dW^T = B^T A per expert, the same
    flat wgrad loop with its operands swapped).

    ``routing="given"`` (the forward's decision came from the caller: moe_forward's routing ``given``): no router,
    ``router_weight`` None, E = W * E/W; returns (dx [T, H] bf16 = bf16(dx_e), d_weights [T, k] fp32 -- each
    (token, slot)'s gate gradient <dy_t, o_(t, j)>, the dw_rows of the expert part put back in pair order --,
    dw13, dw2) -- reference.moe.moe_experts_backward_ref. The expert part runs as for the routers (one launch
    with the router stages left out, or the multi-launch path), nothing else; ``router_in_launch=True`` is
    refused. Expert ids are checked against [0, E) on CPU tensors only (on CUDA that would synchronise).

    The stages:

      pairs sorted by expert (stable: ascending p = t*k + j inside an expert), hence by destination rank;
      W > 1: the expert rows x_rows, dy_rows and the pairs' gate weights to the experts' ranks
      (dist.all_to_all_single, split sizes read on the host: one sync), regrouped by local expert (stable:
      source rank, then pair order); at W = 1 nothing synchronises with the host (counts by expert_counts,
      not torch.bincount; test_moe_backward_w1_never_syncs_gpu);
      [g | u]: the forward's (``saved_gu``, a moe_forward.SavedGateUp from ``moe_forward(..., save_gu=True)``,
      gathered into this order) or recomputed (GEMM1 again, torch._grouped_mm);
      dgrad2 + SwiGLU backward + gate gradient (expert_dgrad2_swiglu; h = silu(g) u from its epilogue too,
      or swiglu_h: dgrad2_emits_h()); dW2 = h^T (w dy) and
      dW13 = x_rows^T [dg | du] (expert_weight_grads); dx_rows = [dg | du] W13^T (expert_dgrad1);
      W > 1: dx_rows and the gate gradients back to the tokens' ranks;
      dispatch backward (slot order), router backward in fp32 (logits recomputed), dx = dx_experts + dx_router.

    The stages above are the multi-launch path: several launches and, at W > 1, NCCL (or gloo) all-to-alls
    between them -- the one launch's correctness twin, and what runs where the one launch does not (the CPU,
    saved g | u at W > 1, one_launch=False). Deterministic (no atomics anywhere; stable sorts; fixed summation
    orders; the all-to-alls only move rows).

    ``padded`` (None: ``config.padded_rows``; only where Triton runs and H, F are multiples of 8): the expert rows
    (x_rows, dy_rows, g | u, do, h, [dg | du], dx_rows) in the padded layout -- each expert's rows from a multiple
    of WGRAD_PAD_ROWS, the gap rows zero, written so by the row gathers themselves -- and both weight gradients
    by the flat wgrad loop (expert_weight_grads_padded). Every row's arithmetic is the packed layout's and the
    gap rows add exact zeros: the same bits (tested).

    ``one_launch`` (None: ``config.one_launch`` at W = 1 on the padded layout, ``config.one_launch_ep`` at W > 1
    on CUDA without ``saved_gu``; elsewhere the multi-launch path): the expert part -- dgrad2, the SwiGLU
    backward, dgrad1, both weight gradients and the dispatch backward -- in ONE persistent launch
    (expert_backward_one_launch; one_launch.py's docstring), at W = 1 on the padded layout (the same tile
    arithmetic and orders, so the same bits: tested); at W > 1 on CUDA the whole backward with its exchanges as
    stages of that launch over the group's workspace (expert_backward_ep_launch: g | u recomputed inside it,
    ``saved_gu`` refused; not the multi-launch path's bits, its g | u being torch's); elsewhere (the packed
    layout, W > 1 on the CPU) a ValueError. ``programs``: its grid (None: one program per SM).
    ``router_in_launch`` (None: ``config.router_in_launch``; with one_launch only): the router backward as stages
    of that launch too (router.py: dx and d_router from the launch, fp32-level like the torch ops' -- not their
    bits); False: the torch ops after the launch, bitwise the multi-launch path.

    ``policy="fixed"`` with ``comm_programs=S`` (1 <= S < the grid): the fixed-role ablation of the one launch at
    W > 1 (one_launch=True) -- programs pid < S run only its communication stages (COMBINE-BWD, PERMUTE-BWD,
    DISPATCH-BWD, UNPERMUTE), the others only the rest; the same gradients, bit for bit, as the self policy. A
    ValueError at W = 1 (no communication) and with the multi-launch path (no programs to split).

    ``precision="mxfp8"``: the backward of moe_forward's MXFP8 layer, every backward GEMM on MX operands rounded
    along its own K (mx.py's docstring; reference.moe.moe_backward_ref(mx=True)), on the multi-launch path in the
    padded layout at any W; w13 / w2 are the bf16 weights (their gradients come back as for bf16, straight through
    the quantizers), ``mx_weights`` their MoEMXWeights (mx.moe_mx_weights; None: rounded here, per call). Refused
    with a ValueError: one_launch=True, router_in_launch=True, padded=False (or Triton unable to run), saved_gu, H
    or F not multiples of 32."""
    config = check_config(MoEBackwardConfig, config)
    mx = _check_precision(precision, x, w2, one_launch, router_in_launch, padded, saved_gu)
    if mx:  # the multi-launch path on the padded layout (_check_precision: Triton runs, H and F multiples of 32)
        one_launch, padded = False, True
        mx_weights = moe_mx_weights(w13, w2) if mx_weights is None else mx_weights
        check_mx_weights(mx_weights, w13, w2)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
    if routing not in ROUTING_KINDS:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTING_KINDS)}")
    given = routing == GIVEN
    n_tok, hidden = x.shape
    local = w13.shape[0]
    if given:  # no router: E from the experts here and the world size
        if router_weight is not None:
            raise ValueError("moe_backward(routing='given'): no router -- pass router_weight=None")
        if router_in_launch:
            raise ValueError("moe_backward(routing='given'): no router backward to run in the launch "
                             "(router_in_launch=True)")
        router_in_launch = False
        world = world_size(group)
        n_exp = local * world
        check_given_routing(weights, experts, n_tok, n_exp, check_ids=experts.device.type == "cpu")
    else:
        n_exp = router_weight.shape[0]
        world = 1 if local == n_exp else world_size(group)  # every expert here: nothing to exchange
    if local * world != n_exp:
        raise ValueError(f"w13 holds {local} experts per rank: {local} x {world} ranks != {n_exp} router experts")
    if policy == "fixed" and world == 1:
        raise ValueError("moe_backward(policy='fixed'): no communication at world size 1 (the fixed-role split needs "
                         "W > 1)")
    if one_launch is None and world > 1:  # the same decision on every rank (same devices, same saved_gu use)
        one_launch = (config.one_launch_ep and x.is_cuda and saved_gu is None and padded is not False
                      and hidden % 8 == 0 and w2.shape[1] % 8 == 0)
    if policy == "fixed" and not one_launch:
        raise ValueError("moe_backward(policy='fixed') needs one_launch=True: the fixed-role split is of the one "
                         "launch's programs (the multi-launch path has none)")
    if one_launch and world > 1:  # the exchanges inside the launch (checked before any: every rank the same way)
        return _moe_backward_ep(x, router_weight, w13, w2, dy, weights, experts, group, routing, renormalize,
                                routed_scaling, wgrad_dtype, saved_gu, padded, programs, router_in_launch, policy,
                                comm_programs, config, n_exp)
    k = experts.shape[1]
    experts = experts.long()
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices                    # expert-sorted pair i <- pair order[i]
    tok = order // k
    dy_b = dy.to(torch.bfloat16)
    w_pair = weights.reshape(-1).float()[order].contiguous()
    per_expert = expert_counts(flat, n_exp)  # no host sync (torch.bincount syncs on CUDA)
    if world > 1:
        x_rows, dy_rows = x[tok].contiguous(), dy_b[tok].contiguous()
        send = per_expert.view(world, local)                         # [dest rank, local expert]
        recv = torch.empty_like(send)                                # [source rank, local expert]
        dist.all_to_all_single(recv, send, group=group)
        send_splits, recv_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the one host sync
        x_rows, dy_rows, w_pair = (_exchange(t, send_splits, recv_splits, group) for t in (x_rows, dy_rows, w_pair))
        # per source rank, rows sorted by local expert: regroup by local expert (stable: source rank order)
        chunk_expert = torch.arange(local, device=x.device).repeat(world)
        src_expert = torch.repeat_interleave(chunk_expert, recv.reshape(-1).to(x.device), output_size=x_rows.shape[0])
        by_expert = torch.sort(src_expert, stable=True).indices
        src_x, src_dy, src_idx = x_rows, dy_rows, by_expert          # sorted row i = src[src_idx[i]]
        w_pair = w_pair[by_expert].contiguous()
        counts = recv.sum(0)
    else:
        send_splits = recv_splits = by_expert = None
        src_x, src_dy, src_idx = x, dy_b, tok
        counts = per_expert
    rows = src_idx.shape[0]
    f = w2.shape[1]
    if padded is None:
        padded = config.padded_rows
    padded = padded and _triton_runs(x) and hidden % 8 == 0 and f % 8 == 0
    if one_launch is None:
        one_launch = config.one_launch and world == 1 and padded
    if router_in_launch and not one_launch:
        raise ValueError("moe_backward(router_in_launch=True) needs the one launch (one_launch=True, or config.one_launch "
                         "where it applies): the router backward is a stage of that launch")
    elif one_launch and not padded:
        raise ValueError(f"moe_backward(one_launch=True) needs the padded row layout (padded=False was given, or "
                         f"H={hidden} / F={f} are not multiples of 8, or Triton cannot run on {x.device})")
    if padded:  # every expert row gathered straight into the padded layout (gap rows: index -1, zeros)
        pad_offs, row_of, real_of, end = padded_layout(counts, rows)
        valid, real = real_of >= 0, real_of.clamp(min=0)
        def into_padded(idx):  # a gather index of the sorted rows -> of the padded ones (-1: a zero row)
            return torch.where(valid, idx[real], -1) if rows else torch.full_like(real_of, -1)
        src_idx = into_padded(src_idx)
        w_pair = torch.where(valid, w_pair[real], 0.0) if rows else torch.zeros(real_of.shape, device=x.device)
        x_rows = gather_rows(src_x, src_idx, end)  # rows past ``end``: left unwritten (read by no one)
        dy_rows, do_rows = gather_rows_and_scaled(src_dy, src_idx, w_pair, end)  # do = w * dy: one read of dy
    else:
        pad_offs = row_of = None
        if world == 1:
            x_rows, dy_rows = x[tok].contiguous(), dy_b[tok].contiguous()
        else:
            x_rows, dy_rows = x_rows[by_expert].contiguous(), dy_rows[by_expert].contiguous()
    if saved_gu is not None:
        if saved_gu.gu.shape[1] != w13.shape[2] or saved_gu.world != world or saved_gu.top_k != k:
            raise ValueError(f"saved_gu (rows of width {saved_gu.gu.shape[1]}, world {saved_gu.world}, top_k "
                             f"{saved_gu.top_k}) is not this layer's forward (2F={w13.shape[2]}, world {world}, "
                             f"top_k {k})")
        if padded:
            gu = gather_rows(saved_gu.gu, into_padded(saved_gu.backward_order_index(counts, rows)), end)
        else:
            gu = saved_gu.in_backward_order(counts, rows)
    elif mx:  # GEMM1 on the forward's MX operands (x_rows and W13 along H)
        gu = _expert_gemm1(expert_gemm1_operand(x_rows), mx_weights.w13, counts, pad_offs)
    else:
        gu = _expert_gemm1(x_rows, w13, counts, pad_offs)
    wdt = _wgrad_dtype(w13, wgrad_dtype)
    if one_launch:  # the expert part in one launch (W = 1, padded); the router backward too (router_in_launch)
        in_launch = config.router_in_launch if router_in_launch is None else router_in_launch
        router = RouterBackward(x, router_weight, bf16_mm_fp32(x, router_weight.t(), config), experts, routing,
                                renormalize, routed_scaling) if in_launch else None
        out = expert_backward_one_launch(
            dy_rows, do_rows, x_rows, gu, w_pair, valid, w13, w2, counts, pad_offs, _pair_rows(order, row_of), n_tok,
            k, wdt, programs=programs, router=router, config=config)
        if router is not None:
            dx, _, dw13, dw2, d_router = out
            return dx, d_router, dw13, dw2
        dx_e, dw_rows, dw13, dw2 = out
    else:
        if not padded:
            do_rows = do_rows_of(dy, tok, dy_rows, w_pair, world)
        if mx:
            dx_rows, dw_rows, dw13, dw2 = expert_backward_gemms_mx(dy_rows, do_rows, x_rows, gu, w_pair, mx_weights,
                                                                   counts, wdt, pad_offs=pad_offs, valid=valid,
                                                                   nk=weights_nk(w13), config=config)
        else:
            dx_rows, dw_rows, dw13, dw2 = expert_backward_gemms(dy_rows, do_rows, x_rows, gu, w_pair, w13, w2,
                                                                counts, wdt, pad_offs=pad_offs,
                                                                valid=valid if padded else None, config=config)
        if by_expert is not None:  # back to the received order, then to the tokens' ranks
            if row_of is not None:  # out of the padded layout first
                dx_rows, dw_rows, row_of = dx_rows[row_of], dw_rows[row_of], None
            dx_back, dw_back = torch.empty_like(dx_rows), torch.empty_like(dw_rows)
            dx_back[by_expert], dw_back[by_expert] = dx_rows, dw_rows
            dx_rows = _exchange(dx_back, recv_splits, send_splits, group)
            dw_rows = _exchange(dw_back, recv_splits, send_splits, group)
        dx_e = unpermute_sum(dx_rows, order, k, row_of=row_of)          # pair order p = t*k + j; slot order, fp32
    dweights = torch.empty((order.shape[0],), dtype=dw_rows.dtype, device=dw_rows.device)
    dweights[order] = dw_rows if row_of is None else dw_rows[row_of]
    if given:  # no router: the gate gradients are the weights' own
        return dx_e.to(torch.bfloat16), dweights.view(n_tok, k), dw13, dw2
    return _router_backward_torch(x, router_weight, experts, dweights.view(n_tok, k), dx_e, routing, renormalize,
                                  routed_scaling, config) + (dw13, dw2)


PRECISIONS = ("bf16", "mxfp8")


def _check_precision(precision, x, w2, one_launch, router_in_launch, padded, saved_gu) -> bool:
    """moe_backward's precision and what ``precision="mxfp8"`` does not cover (one-line ValueErrors, before any
    collective or launch); returns whether it is mxfp8."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose 'bf16' or 'mxfp8'")
    if precision == "bf16":
        return False
    hidden, f = x.shape[1], w2.shape[1]
    if hidden % 32 or f % 32:
        raise ValueError(f"moe_backward(precision='mxfp8') needs H={hidden} and F={f} to be multiples of 32 "
                         f"(MX blocks)")
    if one_launch or router_in_launch:
        raise ValueError("moe_backward(precision='mxfp8') runs on the multi-launch path: one_launch / router_in_launch "
                         "are bf16 only")
    if padded is False or not _triton_runs(x):
        raise ValueError(f"moe_backward(precision='mxfp8') needs the padded row layout (padded=False was given, or "
                         f"Triton cannot run on {x.device}): its row blocks start at each expert's first row")
    if saved_gu is not None:
        raise ValueError("moe_backward(precision='mxfp8') recomputes g | u on the MX operands: pass saved_gu=None")
    return True


def _router_backward_torch(x, router_weight, experts, dweights, dx_e, routing, renormalize, routed_scaling,
                           config: MoEBackwardConfig):
    """The router backward in torch after the expert part (logits recomputed, fp32 routing backward, the router
    GEMMs on bf16 tensor cores): (dx = bf16(dx_e + dx_r), d_router)."""
    logits = bf16_mm_fp32(x, router_weight.t(), config)
    w_re, full, denom = mr.routing_weights_ref(logits, experts, routing, renormalize=renormalize,
                                               routed_scaling=routed_scaling)
    dq = mr.router_weights_backward_ref(dweights, w_re, denom, routed_scaling=routed_scaling)
    dlogits = mr.router_logits_backward_ref(dq, full, experts, routing)
    d_router, dx_r = router_gemm_backward(dlogits, x, router_weight, config)
    return (dx_e + dx_r).to(torch.bfloat16), d_router


def _moe_backward_ep(x, router_weight, w13, w2, dy, weights, experts, group, routing, renormalize, routed_scaling,
                     wgrad_dtype, saved_gu, padded, programs, router_in_launch, policy, comm_programs,
                     config: MoEBackwardConfig, n_exp: int):
    """moe_backward(one_launch=True) at W > 1: the one launch with its exchanges (expert_backward_ep_launch) on the
    group's workspace -- its symmetric data, signals, counters and peer tables, its epoch slot and done flags
    (shared with the forward and the TP ops, as every op on a workspace shares them), its error record (a timeout
    raises KosmosTimeoutError at the next KOSMOS call or kosmos.check_errors()). No host synchronisation in the
    steady state (the first call of a shape: the forward's cross-rank shape check and the buffers' growth)."""
    n_tok, hidden = x.shape
    f = w2.shape[1]
    if not x.is_cuda:
        raise ValueError(f"moe_backward(one_launch=True) at W > 1 needs CUDA tensors (the symmetric workspace), got "
                         f"{x.device}")
    if saved_gu is not None:
        raise ValueError("moe_backward(one_launch=True) at W > 1 recomputes g | u inside the launch: saved_gu is not "
                         "used there (pass saved_gu=None)")
    if padded is False or hidden % 8 or f % 8:
        raise ValueError(f"moe_backward(one_launch=True) needs the padded row layout (padded=False was given, or "
                         f"H={hidden} / F={f} are not multiples of 8)")
    if routing not in ROUTING_KINDS:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTING_KINDS)}")
    grid = programs or runtime.num_sms(x.device)
    policy_args(policy, comm_programs, grid)  # a bad split: a ValueError before any collective or launch
    ws = runtime.get_workspace(group, x.device)
    world, rank, el, k = ws.world.size, ws.world.rank, w13.shape[0], experts.shape[1]
    wdt = _wgrad_dtype(w13, wgrad_dtype)
    lay = ep_layout(world, n_tok, hidden, f, k, el, wdt)
    _check_same_shape_on_every_rank(ws, (n_tok, hidden, f, n_exp, k, ROUTING_KINDS.index(routing)))
    ws.ensure(lay.data_bytes, world)
    ws.ensure_counters(lay.fold_blocks)
    bufs = ep_local_buffers(ws.local, lay, hidden, f, k, n_tok, el, world)
    n_scratch = int(SCB_MTILES.value) + 4 * lay.max_mtiles + -(-n_tok // _router_tiles()[1][0]) + 6 + el
    bufs.update(layout=lay, data=ws.data, sig=ws.signals, ctr=ws.counters, peer_data=ws.peer_data,
                peer_sig=ws.peer_signals, peer_ctr=ws.peer_counters, errors=ws.errors,
                scratch=ws.local("moe_bwd.ep.scratch", n_scratch, torch.int32))  # zeroed once, then by the launch
    in_launch = config.router_in_launch if router_in_launch is None else router_in_launch
    router = RouterBackward(x, router_weight, bf16_mm_fp32(x, router_weight.t(), config), experts, routing,
                            renormalize, routed_scaling) if in_launch else None
    ws.before_launch()
    got = expert_backward_ep_launch(x, dy, weights, experts, w13, w2, bufs, rank=rank, world=world,
                                    epoch_slot=ws.epoch_slot, timeout_ns=ws.timeout_ns(), grid=grid, out_dtype=wdt,
                                    router=router, policy=policy, comm_programs=comm_programs, config=config)
    ws.after_launch()
    if router is not None:
        dx, _, dw13, dw2, d_router, _ = got
        return dx, d_router, dw13, dw2
    dx_e, dweights, dw13, dw2, _ = got
    if routing == GIVEN:  # no router: the gate gradients are the weights' own
        return dx_e.to(torch.bfloat16), dweights, dw13, dw2
    return _router_backward_torch(x, router_weight, experts.long(), dweights, dx_e, routing, renormalize,
                                  routed_scaling, config) + (dw13, dw2)


def moe_backward_w1(x, router_weight, w13, w2, dy, weights, experts, *, routing: str = "softmax",
                    renormalize: bool = True, routed_scaling: float = 1.0, wgrad_dtype=None, saved_gu=None,
                    padded: bool | None = None, one_launch: bool | None = None, programs: int | None = None,
                    router_in_launch: bool | None = None, config: MoEBackwardConfig | None = None,
                    precision: str = "bf16", mx_weights=None):
    """``moe_backward`` at one rank (all E experts local)."""
    return moe_backward(x, router_weight, w13, w2, dy, weights, experts, group=None, routing=routing,
                        renormalize=renormalize, routed_scaling=routed_scaling, wgrad_dtype=wgrad_dtype,
                        saved_gu=saved_gu, padded=padded, one_launch=one_launch, programs=programs,
                        router_in_launch=router_in_launch, config=config, precision=precision,
                        mx_weights=mx_weights)
