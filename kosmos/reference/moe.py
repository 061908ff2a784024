"""Pure-torch references of the MoE expert layer (router, dispatch, expert FFN, combine, fold).

Routing (router logits always in fp32):
  softmax          p = softmax(x @ Wr^T); (w, e) = topk(p, k); w /= sum(w) if renormalize
                   (Mixtral, Qwen3: renormalize; Qwen2-57B: not).
  sigmoid-grouped  DeepSeek-V3: s = sigmoid(x @ Wr^T); choice = s + bias; the E experts form n_group groups,
                   a group's score is the sum of its top-2 choice values; keep the topk_group best groups;
                   e = topk(choice restricted to kept groups, k); w = s[e] (no bias);
                   w /= sum(w) if renormalize; w *= routed_scaling.
  given            no router: (w [T, k], e [T, k]) come from the caller (transformers' ExpertsInterface passes
                   top_k_weights / top_k_index); the layer is the expert part alone, and its gradients are those
                   of x, w and the experts' weights (``apply_routing_ref``, ``moe_experts_backward_ref``).
Expert e (SwiGLU): y_e(x) = (silu(x @ W13[e][:, :F]) * (x @ W13[e][:, F:])) @ W2[e], W13 [H, 2F], W2 [F, H].
Fold: y[t] = sum_{j < k} w[t, j] * y_{e[t, j]}(x[t]), in top-k slot order j = 0..k-1 (topk's order).
Experts are split evenly over W ranks: global expert g lives on rank g // (E/W) as local expert g % (E/W).
Shared experts are outside the op.
Backward: ``moe_backward_ref`` -- every gradient stage by stage with explicit formulas (no autograd), in the
order a one-launch backward runs them, and which forward tensors such a backward saves or recomputes.

MXFP8 (``mx=True``; OCP MX, kosmos/quant.py): the router stays on the bf16 tokens; each expert multiplies the MX
values of x (blocks along H) with the MX values of W13 (blocks along H) and W2 (blocks along F), and its
SwiGLU output h is rounded to bf16 and then to its MX values (blocks along F) before W2 -- what a layer that
dispatches MX tokens, runs GEMM1 on them and re-quantizes h for GEMM2 computes; fold in fp32 as in bf16.
Its backward (``moe_backward_ref(mx=True)``, ``moe_experts_backward_ref(mx=True)``): every backward GEMM multiplies
the MX values of both its operands with blocks of 32 along that GEMM's own K (the rows' K: blocks of 32 rows of one
expert, ``mx_rows_ref``), fp32 accumulation; the SwiGLU, combine and router backward in fp32 as in bf16; gradients
straight through the quantizers (the rules: ``moe_backward_ref``'s docstring, "MXFP8").

``moe_forward_ref_local`` takes every rank's tokens in one process (CPU tests); ``moe_forward_a2a`` is the
distributed layer built from NCCL all-to-all the way Megatron's all-to-all dispatcher does it -- with
``fp32=True`` the reference, with ``fp32=False`` the ``nccl-a2a`` baseline (bf16, grouped GEMMs on CUDA).
Tests: tests/test_moe_reference.py (routing rules, the local and all-to-all layers, the backward against autograd,
with the routing given too, the MXFP8 math against explicit quantization); every MoE kernel test compares against
these.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..quant import mx_values

ROUTINGS = ("softmax", "sigmoid-grouped")  # the routers KOSMOS runs itself
GIVEN = "given"  # the routing decision passed in by the caller (no router)
ROUTING_KINDS = ROUTINGS + (GIVEN,)  # moe_forward's ROUTING constexpr is an index into this


def check_given_routing(weights, experts, n_tokens: int, n_experts: int, top_k: int | None = None,
                        check_ids: bool = True) -> int:
    """The checks of a given routing decision for T = ``n_tokens`` tokens over E = ``n_experts`` experts: weights
    [T, k] floating point, experts [T, k] integer (global expert ids), on one device; ``top_k`` (if given) equal
    to k. ``check_ids``: also every id in [0, E) (reads the ids: a host synchronisation on a GPU -- callers on
    CUDA pass False). Returns k; ValueError in one line otherwise."""
    for name, t in (("weights", weights), ("experts", experts)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"routing='given': {name} must be a 2-D tensor [T, k], got "
                             f"{tuple(getattr(t, 'shape', ())) or type(t).__name__}")
    if not weights.is_floating_point():
        raise ValueError(f"routing='given': weights must be floating point, got {weights.dtype}")
    if experts.is_floating_point() or experts.is_complex() or experts.dtype == torch.bool:
        raise ValueError(f"routing='given': experts must hold integer expert ids, got {experts.dtype}")
    if weights.shape != experts.shape or weights.shape[0] != n_tokens:
        raise ValueError(f"routing='given': weights {tuple(weights.shape)} and experts {tuple(experts.shape)} must "
                         f"both be [T={n_tokens}, k]")
    if weights.device != experts.device:
        raise ValueError(f"routing='given': weights on {weights.device} but experts on {experts.device}")
    k = weights.shape[1]
    if top_k is not None and k != top_k:
        raise ValueError(f"routing='given': the decision has k={k} slots per token but top_k={top_k}")
    if check_ids and experts.numel() and (int(experts.min()) < 0 or int(experts.max()) >= n_experts):
        raise ValueError(f"routing='given': expert ids must lie in [0, {n_experts}), got "
                         f"[{int(experts.min())}, {int(experts.max())}]")
    return k


def route(x, router_weight, top_k: int, routing: str = "softmax", *, renormalize: bool = True, bias=None,
          n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0):
    """(weights [T, k] fp32, experts [T, k] int64) for tokens x [T, H] and router_weight [E, H]."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")
    n_experts = router_weight.shape[0]
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {n_experts}]")
    logits = x.float() @ router_weight.float().t()
    if routing == "softmax":
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
    else:
        if n_experts % n_group or not 1 <= topk_group <= n_group:
            raise ValueError(f"sigmoid-grouped routing needs E % n_group == 0 and 1 <= topk_group <= n_group "
                             f"(E={n_experts}, n_group={n_group}, topk_group={topk_group})")
        if top_k > topk_group * (n_experts // n_group):
            raise ValueError(f"top_k={top_k} exceeds the experts of {topk_group} groups")
        scores = torch.sigmoid(logits)
        choice = scores + (bias.float() if bias is not None else 0.0)
        per_group = n_experts // n_group
        grouped = choice.view(-1, n_group, per_group)
        group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(topk_group, dim=-1).indices, True)
        masked = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
        experts = masked.topk(top_k, dim=-1).indices
        weights = scores.gather(1, experts)
    if renormalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling, experts


def expert_ffn(x, w13, w2):
    """SwiGLU expert: x [n, H], w13 [H, 2F] (gate | up), w2 [F, H] -> [n, H] (math in x's dtype)."""
    f = w2.shape[0]
    h = x @ w13
    return (F.silu(h[:, :f]) * h[:, f:]) @ w2


def expert_ffn_mx(x, w13, w2):
    """The MXFP8 expert (module docstring), fp32 math on MX values: x [n, H] bf16, w13 [H, 2F], w2 [F, H]."""
    f = w2.shape[0]
    h = mx_values(x.to(torch.bfloat16)).float() @ mx_values(w13.to(torch.bfloat16), dim=0).float()
    h = (F.silu(h[:, :f]) * h[:, f:]).to(torch.bfloat16)
    return mx_values(h).float() @ mx_values(w2.to(torch.bfloat16), dim=0).float()


def mx_along(t, dim: int):
    """The MX values of ``t`` (any float dtype; ``t.shape[dim]`` a multiple of 32) with blocks of 32 along ``dim``,
    from t rounded to bf16 first (what a kernel holds before it rounds), in t's dtype."""
    return mx_values(t.to(torch.bfloat16), dim=dim).to(t.dtype)


def mx_rows_ref(t):
    """The MX values of t [n, K] with blocks of 32 consecutive rows per column (blocks along the rows, counted from
    row 0), from t rounded to bf16 first, in t's dtype. A last block of fewer than 32 rows is rounded as if zero
    rows completed it (zeros change no block's largest magnitude, hence no scale). The operand rounding of a GEMM
    whose K is the rows -- a weight gradient over one expert's rows, which start a block."""
    n = t.shape[0]
    pad = -n % 32
    padded = torch.cat([t, t.new_zeros((pad,) + tuple(t.shape[1:]))]) if pad else t
    return mx_along(padded, 0)[:n] if n else t.clone()


def moe_forward_ref_local(xs, router_weight, w13s, w2s, *, top_k: int, routing: str = "softmax", mx: bool = False,
                          **route_kw):
    """Every rank's tokens ``xs[r]`` [T_r, H] and experts ``w13s[r]`` [E/W, H, 2F], ``w2s[r]`` [E/W, F, H]
    in one process -> each rank's y [T_r, H] in fp32 (``mx``: the MXFP8 layer's math, module docstring)."""
    w13 = torch.cat([w if mx else w.float() for w in w13s])
    w2 = torch.cat([w if mx else w.float() for w in w2s])
    out = []
    for x in xs:
        weights, experts = route(x, router_weight, top_k, routing, **route_kw)
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        xf = x if mx else x.float()
        for j in range(top_k):  # fixed slot order
            for e in experts[:, j].unique().tolist():
                rows = (experts[:, j] == e).nonzero(as_tuple=True)[0]
                ffn = expert_ffn_mx if mx else expert_ffn
                y[rows] += weights[rows, j, None] * ffn(xf[rows], w13[e], w2[e])
        out.append(y)
    return out


def _experts_forward(x_sorted, counts, w13, w2, fp32: bool):
    """Run local expert i on the next counts[i] rows of x_sorted [R, H]; counts [E_local] (any int dtype, on
    x_sorted's device). fp32=False on CUDA: two ``torch._grouped_mm`` (bf16 in, fp32 accumulate, bf16 out) with
    the SwiGLU between them -- no host sync, no fp32 copies. Otherwise one expert at a time (fp32=True: upcast
    to fp32, the reference)."""
    if not fp32 and x_sorted.is_cuda and hasattr(torch, "_grouped_mm") and x_sorted.shape[0] > 0:
        offs = torch.cumsum(counts.to(device=x_sorted.device), 0, dtype=torch.int32)
        h = torch._grouped_mm(x_sorted, w13, offs=offs)
        f = w2.shape[1]
        return torch._grouped_mm(F.silu(h[:, :f]) * h[:, f:], w2, offs=offs)
    out = torch.empty((x_sorted.shape[0], w2.shape[2]), dtype=torch.float32 if fp32 else x_sorted.dtype,
                      device=x_sorted.device)
    start = 0
    for i, n in enumerate(counts.tolist()):
        if n:
            xi = x_sorted[start:start + n]
            out[start:start + n] = expert_ffn(xi.float(), w13[i].float(), w2[i].float()) if fp32 else \
                expert_ffn(xi, w13[i], w2[i])
        start += n
    return out


class AllToAllRows(torch.autograd.Function):
    """dist.all_to_all_single of rows with autograd: [sum(in_splits), ...] -> [sum(out_splits), ...] (split sizes
    on the host); the backward is the reverse all-to-all of the gradient, the split sizes swapped (every row goes
    back where it came from). ``all_to_all_rows(x, out_splits, in_splits, group)``."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group=None):
        import torch.distributed as dist
        ctx.splits, ctx.group = (list(out_splits), list(in_splits)), group
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), list(out_splits), list(in_splits), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        import torch.distributed as dist
        out_splits, in_splits = ctx.splits
        dx = g.new_empty((sum(in_splits),) + tuple(g.shape[1:]))
        dist.all_to_all_single(dx, g.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


def all_to_all_rows(x, out_splits, in_splits, group=None):
    return AllToAllRows.apply(x, out_splits, in_splits, group)


def moe_forward_a2a(x, router_weight, w13, w2, *, top_k: int, routing: str = "softmax", group=None,
                    fp32: bool = True, experts=None, **route_kw):
    """The MoE layer over ``group`` with NCCL/gloo all-to-all (Megatron's all-to-all dispatcher):
    route, permute (token, expert) pairs by expert, exchange counts (read on the host: NCCL needs the split
    sizes there), all_to_all_single the rows, group them by local expert, SwiGLU experts, all_to_all_single
    back, unpermute, fold. x [T, H] this rank's tokens; w13 [E/W, H, 2F], w2 [E/W, F, H] this rank's experts.
    Returns y [T, H].

    ``fp32=True`` (the reference): rows upcast to fp32, experts one by one in fp32, the fold in fp32 in slot
    order; returns fp32. ``fp32=False`` (the ``nccl-a2a`` baseline): bf16 rows on the wire, grouped GEMMs, and
    the fold as one batched GEMM ``y[t] = w[t, :] @ pair_out[t, :, :]`` (weights cast to x.dtype, fp32
    accumulation inside the GEMM); returns x.dtype. One host sync per call (the split sizes). Differentiable at
    any W (the row exchanges through AllToAllRows; the counts' exchange carries no gradient): the training
    proxy's nccl-a2a baseline is this function under autograd. ``experts`` [T, k] (global ids): use this routing
    decision instead of ``route``'s, with its weights from ``routing_weights_ref`` on the fp32 logits (so the
    router weight still gets its gradient): the distributed fp32 reference of a backward taken for a kernel's
    own decision (kosmos_bench.moe.grad_reference at W > 1)."""
    import torch.distributed as dist
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    local = w13.shape[0]
    n_tokens, hidden = x.shape
    weights, experts = route_or_given(x, router_weight, top_k, routing, experts, route_kw)
    flat_expert = experts.reshape(-1)                       # pair p = token p // k, slot p % k
    order = torch.argsort(flat_expert, stable=True)         # pairs grouped by expert, hence by rank
    rows = x.index_select(0, order // top_k)
    if fp32:
        rows = rows.float()
    per_expert = torch.bincount(flat_expert, minlength=local * world)
    send = per_expert.view(world, local)                    # [dest rank, local expert]
    recv = torch.empty_like(send)                           # [source rank, local expert]
    if world > 1:
        dist.all_to_all_single(recv, send, group=group)
    else:
        recv.copy_(send)
    send_splits, recv_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()  # the one host sync
    if world > 1:  # differentiable (AllToAllRows): autograd runs through the layer at any W
        got = all_to_all_rows(rows, recv_splits, send_splits, group)
    else:
        got = rows.new_empty((sum(recv_splits), hidden))
        got.copy_(rows)
    # got holds, per source rank, rows sorted by local expert: regroup by local expert (stable, so within an
    # expert the rows stay in source-rank order)
    chunk_expert = torch.arange(local, device=x.device).repeat(world)  # chunk (source s, expert i) -> i
    src_expert = torch.repeat_interleave(chunk_expert, recv.reshape(-1).to(x.device), output_size=got.shape[0])
    by_expert = torch.argsort(src_expert, stable=True)
    out_sorted = _experts_forward(got.index_select(0, by_expert), recv.sum(0), w13, w2, fp32)
    if world > 1 and got.shape[0] == 0 and got.requires_grad:  # nothing received: still a graph through both
        out_sorted = out_sorted + got.sum()  # all-to-alls, so that this rank joins its peers' backward ones
    out = torch.empty_like(out_sorted)
    out.index_copy_(0, by_expert, out_sorted)
    if world > 1:
        back = all_to_all_rows(out, send_splits, recv_splits, group)
    else:
        back = out.new_empty((sum(send_splits), hidden))
        back.copy_(out)
    pair_out = torch.empty_like(back)
    pair_out.index_copy_(0, order, back)                    # pair order again: token-major, slot-minor
    pair_out = pair_out.view(n_tokens, top_k, hidden)
    if not fp32:
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), pair_out).squeeze(1)
    y = torch.zeros((n_tokens, hidden), dtype=torch.float32, device=x.device)
    for j in range(top_k):                                  # fold in fixed slot order
        y += weights[:, j, None] * pair_out[:, j]
    return y


def apply_routing_ref(x, weights, experts, w13_all, w2_all, mx: bool = False):
    """fp32 y [T, H] for tokens x [T, H] given a routing (weights [T, k], global experts [T, k]) and ALL experts'
    weights (w13_all [E, H, 2F], w2_all [E, F, H]); fold in slot order. Lets a test check the expert math of an
    implementation against its own routing decisions, separately from the router. ``mx``: the MXFP8 experts
    (``expert_ffn_mx``: x and the weights rounded to MX here)."""
    xf = x.float()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(experts.shape[1]):
        for e in experts[:, j].unique().tolist():
            rows = (experts[:, j] == e).nonzero(as_tuple=True)[0]
            out = expert_ffn_mx(x[rows], w13_all[e], w2_all[e]) if mx else \
                expert_ffn(xf[rows], w13_all[e].float(), w2_all[e].float())
            y[rows] += weights[rows, j, None].float() * out
    return y


# ----------------------------------------------------------------------------------------------------------------
# Backward reference: the layer's gradients written out stage by stage, explicit formulas, no autograd,
# in the order a one-launch backward would run them. Pairs p = t*k + j (token-major, slot-minor, as in
# moe_forward_a2a); per-pair tensors are [T*k, ...]. Every sum has a fixed order and no tensor is accumulated into
# by index (no index_add): per expert, its pairs in ascending p inside one GEMM; per token, its slots j = 0..k-1.

def _acc_dtype(*tensors):
    """fp64 when any input is fp64, else fp32 (bf16/fp16/fp32 inputs are upcast)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_mx_shapes(mx: bool, hidden: int, ffn: int) -> None:
    if mx and (hidden % 32 or ffn % 32):
        raise ValueError(f"mx=True needs H={hidden} and F={ffn} to be multiples of 32 (MX blocks)")


def _pairs_by_expert(experts, n_experts: int):
    """[(e, pairs)] for every expert with rows, e ascending; pairs = the flat pair indices p = t*k + j that chose
    e, ascending (a fixed, sort-free order: one compare and one nonzero per expert). Empty experts are absent."""
    flat = experts.reshape(-1)
    counts = torch.bincount(flat, minlength=n_experts).tolist()
    return [(e, (flat == e).nonzero(as_tuple=True)[0]) for e in range(n_experts) if counts[e]]


def route_or_given(x, router_weight, top_k: int, routing: str, experts, route_kw: dict):
    """(weights [T, k] fp32, experts [T, k] int64) of the a2a layers: ``route``'s decision when ``experts`` is
    None, else that decision with its weights from ``routing_weights_ref`` on the fp32 logits (differentiable in
    the router weight)."""
    if experts is None:
        return route(x, router_weight, top_k, routing, **route_kw)
    experts = experts.long()
    if tuple(experts.shape) != (x.shape[0], top_k):
        raise ValueError(f"experts has shape {tuple(experts.shape)}, expected ({x.shape[0]}, {top_k})")
    logits = x.float() @ router_weight.float().t()
    weights = routing_weights_ref(logits, experts, routing, renormalize=route_kw.get("renormalize", True),
                                  routed_scaling=route_kw.get("routed_scaling", 1.0))[0]
    return weights, experts


def routing_weights_ref(logits, experts, routing: str, *, renormalize: bool = True, routed_scaling: float = 1.0):
    """Differentiable part of the routing, given the decision ``experts`` [T, k] (top-k selection itself has no
    gradient): (weights [T, k], full [T, E], denom [T, 1] or None), in logits' dtype.

        softmax          full = p = softmax(l);   q_j = p[e_j]
        sigmoid-grouped  full = s = sigmoid(l);   q_j = s[e_j]   (the bias chose e and appears nowhere here)
        renormalize      denom S = sum_j q_j + 1e-20;  w_j = (q_j / S) * c      else  w_j = q_j * c
    with c = routed_scaling -- the same formulas, in the same order, as ``route``."""
    full = torch.softmax(logits, dim=-1) if routing == "softmax" else torch.sigmoid(logits)
    q = full.gather(1, experts)
    denom = q.sum(-1, keepdim=True) + 1e-20 if renormalize else None
    weights = (q / denom if renormalize else q) * routed_scaling
    return weights, full, denom


def expert_pairs_forward_ref(x, experts, w13, w2, groups):
    """The forward's per-pair tensors (what a backward saves or recomputes): for pair p = (t, j), e = e[t, j],
        [g_p | u_p] = x_t @ W13[e]   (g gate, u up: [P, F] each),   h_p = silu(g_p) * u_p,   o_p = h_p @ W2[e]
    in x's dtype. Returns (g, u, h, o), h and o [P, F] and [P, H]. ``groups`` from ``_pairs_by_expert``."""
    n_tok, k = experts.shape
    f = w2.shape[1]
    g = x.new_zeros((n_tok * k, f))
    u = x.new_zeros((n_tok * k, f))
    o = x.new_zeros((n_tok * k, x.shape[1]))
    for e, p in groups:
        a = x[p // k] @ w13[e].to(x.dtype)
        g[p], u[p] = a[:, :f], a[:, f:]
    h = g * torch.sigmoid(g) * u
    for e, p in groups:
        o[p] = h[p] @ w2[e].to(h.dtype)
    return g, u, h, o


def combine_backward_ref(dy, weights, o):
    """Combine (y[t] = sum_j w[t, j] o_(t, j)) backward: dy [T, H], weights [T, k], o [P, H] ->
        do_(t, j) = w[t, j] * dy[t]                [P, H]
        dw[t, j]  = <dy[t], o_(t, j)>              [T, k]   (sum over H)
    A kernel sends dy[t] once per destination rank holding one of t's experts (the mirror of combine) with
    w[t, :]; do is formed on the expert's rank."""
    (n_tok, k), hidden = weights.shape, dy.shape[1]
    do = (weights[:, :, None] * dy[:, None, :]).reshape(n_tok * k, hidden)
    dw = (o.view(n_tok, k, hidden) * dy[:, None, :]).sum(-1)
    return do, dw


def gate_grad_from_h_ref(dy, h, experts, w2, groups):
    """The gate gradient without o: dw[t, j] = <dy[t], h_p @ W2[e]> = <dy[t] @ W2[e]^T, h_p>. z_p = dy[t] @ W2[e]^T
    is GEMM2's data gradient before the w scaling (dh_p = w[t, j] z_p), so a kernel gets dw as a row dot in the
    GEMM2-dgrad epilogue and never saves nor recomputes o. Returns dw [T, k]."""
    n_tok, k = experts.shape
    dw = h.new_zeros(n_tok * k)
    for e, p in groups:
        dw[p] = ((dy[p // k] @ w2[e].to(dy.dtype).t()) * h[p]).sum(-1)
    return dw.view(n_tok, k)


def gemm2_backward_ref(do, h, w2, groups):
    """GEMM2 (o_p = h_p @ W2[e]) backward, per expert e with pairs P_e (ascending p; none: dW2[e] = 0):
        dh[P_e]  = do[P_e] @ W2[e]^T               data gradient   [P, F]
        dW2[e]   = h[P_e]^T @ do[P_e]              weight gradient [E, F, H], sum over P_e in ascending p
    """
    dh = do.new_zeros(h.shape)
    dw2 = do.new_zeros(w2.shape)
    for e, p in groups:
        dh[p] = do[p] @ w2[e].to(do.dtype).t()
        dw2[e] = h[p].t() @ do[p]
    return dh, dw2


def swiglu_backward_ref(dh, g, u):
    """SwiGLU (h = silu(g) * u) backward, elementwise, with s = sigmoid(g), silu(g) = g s,
    silu'(g) = s + g s (1 - s):
        dg = dh * u * silu'(g),    du = dh * silu(g)"""
    s = torch.sigmoid(g)
    return dh * u * (s + g * s * (1 - s)), dh * (g * s)


def gemm1_backward_ref(dg, du, x, experts, w13, groups):
    """GEMM1 ([g | u]_p = x_t @ W13[e]) backward, per expert e with pairs P_e (ascending p), da = [dg | du]:
        dx_pair[P_e] = da[P_e] @ W13[e]^T                      [P, H]
        dW13[e]      = x[t(P_e)]^T @ da[P_e]                   [E, H, 2F], sum over P_e in ascending p
    (x[t(P_e)]: the expert's rows as dispatched -- saved, or re-dispatched from x)."""
    k = experts.shape[1]
    da = torch.cat([dg, du], dim=-1)
    dx_pair = da.new_zeros((da.shape[0], x.shape[1]))
    dw13 = da.new_zeros(w13.shape)
    for e, p in groups:
        dx_pair[p] = da[p] @ w13[e].to(da.dtype).t()
        dw13[e] = x[p // k].t() @ da[p]
    return dx_pair, dw13


def dispatch_backward_ref(dx_pair, top_k: int):
    """Dispatch (token t copied to each of its k experts) backward: dx_e[t] = sum_{j=0..k-1} dx_pair_(t, j), summed
    in slot order j = 0, 1, ..., k-1 (a kernel that pre-sums a token's rows per destination rank sums in another
    fixed order: deterministic, not bitwise this one). [P, H] -> [T, H]."""
    pairs = dx_pair.view(dx_pair.shape[0] // top_k, top_k, dx_pair.shape[1])
    dx = pairs[:, 0].clone()
    for j in range(1, top_k):
        dx += pairs[:, j]
    return dx


def router_weights_backward_ref(dw, weights, denom, *, routed_scaling: float = 1.0):
    """Through the weights' normalisation and scaling (w_j = c q_j / S, S = sum_i q_i + 1e-20; or w_j = c q_j):
        renormalize   dq_j = (c dw_j - <dw, w>) / S        (since dw_i/dq_j = c (delta_ij - q_i / S) / S)
        otherwise     dq_j = c dw_j
    dw, weights [T, k]; denom [T, 1] or None (no renormalisation). Returns dq [T, k]."""
    c = routed_scaling
    if denom is None:
        return c * dw
    return (c * dw - (dw * weights).sum(-1, keepdim=True)) / denom


def router_logits_backward_ref(dq, full, experts, routing: str):
    """From the selected probabilities/scores q_j = full[e_j] back to the logits l [T, E]:
        softmax          dl = p * (dp - <dp, p>),  dp = dq scattered to the selected experts (0 elsewhere), so
                         <dp, p> = sum_j dq_j p[e_j]; every expert's logit gets a gradient
        sigmoid-grouped  dl[e_j] = dq_j s_j (1 - s_j), 0 for unselected experts (only the k selected s are needed);
                         the bias only chose e: no gradient (DeepSeek-V3)"""
    q = full.gather(1, experts)
    if routing == "softmax":
        dp = torch.zeros_like(full).scatter_(1, experts, dq)
        return full * (dp - (dq * q).sum(-1, keepdim=True))
    return torch.zeros_like(full).scatter_(1, experts, dq * q * (1 - q))


def router_gemm_backward_ref(dlogits, x, router_weight):
    """Router GEMM (l = x @ Wr^T) backward: d(router weight) = dl^T x [E, H]; the router's part of dx = dl @ Wr."""
    return dlogits.t() @ x, dlogits @ router_weight


def moe_experts_backward_ref(x, w13, w2, dy, weights, experts, *, mx: bool = False):
    """Gradients of the expert part with the routing given (y = ``apply_routing_ref(x, weights, experts, w13, w2)``,
    routing ``given``: no router): (dx [T, H], d_weights [T, k], dw13 [E, H, 2F], dw2 [E, F, H]) for the output
    gradient dy [T, H] -- ``moe_backward_ref``'s stages 1-5 on the given weights, without its router stages:
      d_weights[t, j] = <dy[t], o_(t, j)>   (combine_backward_ref: the gate gradient of each (token, slot))
      dx = dispatch_backward_ref(dx_pair)   (no router part: the decision came from outside)
    x [T, H], weights [T, k] (any float dtype), experts [T, k] global ids in [0, E) (a token may name an expert
    twice: its two pairs are separate rows), w13 [E, H, 2F], w2 [E, F, H]. Math in fp64 when any input is fp64,
    else fp32; the gradients come back in that dtype. Deterministic (moe_backward_ref's summation orders).
    ``mx``: the MXFP8 layer's backward (moe_backward_ref's "MXFP8"; the gate gradient is its z-h row dot)."""
    n_tok, hidden = x.shape
    n_experts = w13.shape[0]
    top_k = check_given_routing(weights, experts, n_tok, n_experts)
    experts = experts.long()
    _check_mx_shapes(mx, hidden, w2.shape[1])
    acc = _acc_dtype(x, w13, w2, dy, weights)
    xa, dya, wa = x.to(acc), dy.to(acc), weights.to(acc)
    groups = _pairs_by_expert(experts, n_experts)
    pairs, rows, dw13, dw2 = _expert_rows_backward_ref(xa, dya, wa, w13, w2, groups, 0, top_k, mx)
    n_pairs = n_tok * top_k
    dx_pair = xa.new_zeros((n_pairs, hidden))
    dweights = xa.new_zeros(n_pairs)
    dx_pair[pairs], dweights[pairs] = rows["dx_pair"], rows["dweights"]
    return dispatch_backward_ref(dx_pair, top_k), dweights.view(n_tok, top_k), dw13, dw2


def moe_backward_ref(x, router_weight, w13, w2, dy, *, top_k: int, routing: str = "softmax",
                     renormalize: bool = True, bias=None, n_group: int = 1, topk_group: int = 1,
                     routed_scaling: float = 1.0, experts=None, return_stages: bool = False,
                     expert_chunk: int | None = None, on_weight_grads=None, mx: bool = False):
    """Gradients of the MoE layer y = moe(x) (``route`` + ``apply_routing_ref`` over ALL experts, one process) for
    the output gradient dy [T, H]: (dx [T, H], d_router_weight [E, H], dw13 [E, H, 2F], dw2 [E, F, H]), plus a
    dict of every stage's tensors when ``return_stages``. Arguments as ``route`` takes them (x [T, H],
    router_weight [E, H], bias [E] for sigmoid-grouped), w13 [E, H, 2F] (gate | up), w2 [E, F, H].

    Written out stage by stage with explicit formulas (no autograd), in the order a one-launch backward runs them:
      0. routing decision: ``experts`` [T, k] as passed in (what a kernel saves), or recomputed with ``route``
         (fp32 logits, exactly the forward reference's choice). Top-k selection has no gradient, and neither has
         the bias (it only changes the choice). The weights are recomputed from the logits l = x @ Wr^T given
         the decision (``routing_weights_ref``), together with the per-pair forward g, u, h, o
         (``expert_pairs_forward_ref``) -- in a kernel these come from saved tensors or a recompute (below);
      1. combine-backward     do_(t,j) = w[t,j] dy[t];  dw[t,j] = <dy[t], o_(t,j)>           combine_backward_ref
      2. GEMM2 dgrad, wgrad   dh = do @ W2[e]^T;  dW2[e] = h^T do   (per expert)           gemm2_backward_ref
      3. SwiGLU backward      dg = dh u silu'(g);  du = dh silu(g)                         swiglu_backward_ref
      4. GEMM1 dgrad, wgrad   dx_pair = [dg|du] @ W13[e]^T;  dW13[e] = x_rows^T [dg|du]    gemm1_backward_ref
      5. dispatch-backward    dx_e[t] = sum_j dx_pair_(t,j), slot order                    dispatch_backward_ref
      6. router backward      dw -> dq (normalisation, scaling)                            router_weights_backward_ref
                              dq -> dl (softmax / sigmoid)                                 router_logits_backward_ref
                              dWr = dl^T x;  dx_r = dl @ Wr                                router_gemm_backward_ref
      7. dx = dx_e + dx_r.
    Stage 6 needs only stage 1's dw (and the routing tensors), so a kernel may run it beside stages 2-5.
    Stages 1-4 run a run of ``expert_chunk`` experts at a time (None: all E at once), on those experts' pairs
    alone (``_expert_rows_backward_ref``): per expert the same GEMMs on the same values whatever the chunk, so
    every gradient is the same (on the CPU up to the last bit of the elementwise sigmoid, whose vector lanes and
    scalar tail round apart; tested) and the per-pair tensors are chunk-sized, but for
    dx_pair [T*k, H], kept whole in pair order so that stage 5 sums the slots in order. ``on_weight_grads``:
    called as on_weight_grads(e0, dw13[e0:e1], dw2[e0:e1]) with each chunk's weight gradients (then dropped),
    which come back as None: for a caller that compares them chunk by chunk and cannot hold them whole
    (deepseek-v3's fp32 weight gradients are 42 GiB; kosmos_bench.moe.grad_reference).
    Math in fp64 when any input is fp64, else fp32 (bf16 inputs are upcast); the gradients come back in that
    dtype. Deterministic: no index_add; per expert its pairs in ascending p = t*k + j inside one GEMM (a kernel's
    wgrad tile owner sums its row tiles in a fixed order), per token its slots in order j = 0..k-1.

    What a one-launch backward must have from the forward, per rank, for deepseek-v3 at T = 4096 tokens per rank
    (H 7168, F 2048, k 8, E 256 over W ranks; bf16 unless said; R = expert rows on the rank = T*k = 32768 on
    average -- the forward's workspace is sized for the worst case W*T*min(k, E/W) rows, W times these figures):
      tensor                      shape      bytes      needed by                    save or recompute
      weights w                   [T, k] f32 128 KiB    combine-bwd (do = w dy)      save
      experts e                   [T, k] i32 128 KiB    every stage (the decision)   save (a recompute is the router
                                                                                     GEMM + top-k, ties included)
      S = sum of selected s       [T] f32    16 KiB     sigmoid router bwd           save (s_j = w_j S / c), or the
                                                                                     k selected logits: k*H MACs/token
      p = softmax(l)              [T, E] f32 4 MiB      softmax router bwd (all E)   recompute l = x Wr^T: 2TEH =
                                                                                     15 GFLOP (x is kept anyway)
      x                           [T, H]     56 MiB     router wgrad, re-dispatch    the layer's input (kept by
                                                                                     autograd anyway)
      expert rows x_rows          [R, H]     448 MiB    GEMM1 wgrad                  save, or re-dispatch x: the
                                                                                     forward's dispatch + permute
      g | u                       [R, 2F]    256 MiB    SwiGLU bwd                   save (recompute = GEMM1 fwd,
                                                                                     2*R*H*2F = 1.92 TFLOP)
      h = silu(g) u               [R, F]     128 MiB    GEMM2 wgrad (h^T do)         recompute from g | u (elementwise)
      o = h W2                    [R, H]     448 MiB    dw = <dy, o>                 neither: dw = <dy W2^T, h>, a row
                                                                                     dot in the GEMM2-dgrad epilogue
                                                                                     (gate_grad_from_h_ref); a recompute
                                                                                     is GEMM2 fwd, 0.96 TFLOP
    So the minimum saved set is w, e, S (or p's recompute), g | u and the expert rows (or their re-dispatch):
    ~704 MiB per rank at balanced load, on top of x. ``backward_saved_bytes`` computes these figures.

    MXFP8 (``mx=True``): the backward of the MXFP8 layer (module docstring: x and the weights as MX values, h
    rounded to bf16 then to MX along F), straight through its quantizers, with every backward GEMM on MX operands:
    both operands of each GEMM rounded (``mx_along``: to bf16 first, then to MX) with blocks of 32 along that
    GEMM's own K, fp32 accumulation. Q_H, Q_F, Q_2F: blocks along those columns; Q_R: blocks of 32 rows of one
    expert from its first row, the last block completed by zero rows (``mx_rows_ref``). Per expert e, its rows
    in ascending p (x_r = x[t(p)], dy_r = dy[t(p)], w_r the pair's gate weight):
      0. [g | u] = Q_H(x_r) @ Q_H(W13[e]), h = silu(g) u   (the forward's GEMM1, recomputed; fp32)
      1. z = Q_H(dy_r) @ Q_H(W2[e])^T            dgrad2, K = H: its operand is the token gradient dy, the gate
                                                 weight a row scale of its fp32 result (dh = w_r z), as the
                                                 kernels apply it
         dw_r = <z, h>                           the gate gradient (the z-h row dot, with the fp32 h)
      2. dW2[e] = Q_R(h)^T @ Q_R(do), do = w_r dy_r         wgrad2, K = rows
      3. dg, du = SwiGLU backward of dh = w_r z      fp32, as in bf16
      4. dx_pair = Q_2F([dg | du]) @ Q_2F(W13[e])^T        dgrad1, K = 2F (F % 32 == 0: no block spans g and u)
         dW13[e] = Q_R(x_r)^T @ Q_R([dg | du])             wgrad1, K = rows (x_r's bf16 values, not its
                                                           forward MX values: each GEMM rounds its own)
    Stages 5-7 as in bf16 (the router backward on the bf16 x and router weight, which the forward's router
    used). The TP linears' MX backward (kosmos.nn) is another rule: the forward's MX operands, dy in bf16."""
    if routing not in ROUTINGS:
        raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")
    n_tok, hidden = x.shape
    n_experts = router_weight.shape[0]
    if experts is None:
        _, experts = route(x, router_weight, top_k, routing, renormalize=renormalize, bias=bias, n_group=n_group,
                           topk_group=topk_group, routed_scaling=routed_scaling)
    else:
        experts = experts.long()
        if experts.shape != (n_tok, top_k):
            raise ValueError(f"experts has shape {tuple(experts.shape)}, expected ({n_tok}, {top_k})")
        if experts.numel() and (experts.min() < 0 or experts.max() >= n_experts):
            raise ValueError(f"experts must lie in [0, {n_experts})")
        if top_k > 1 and (experts.sort(-1).values.diff(dim=-1) == 0).any():
            raise ValueError("a token's experts must be distinct")
    _check_mx_shapes(mx, hidden, w2.shape[1])
    acc = _acc_dtype(x, router_weight, w13, w2, dy)
    # the expert weights stay in their dtype and are upcast one expert at a time (w13[e].to(acc) in the stage
    # references): a whole fp32 copy of DeepSeek-V3's 256 experts is 42 GiB, and ran the bench out of memory
    xa, wra, dya = (t.to(acc) for t in (x, router_weight, dy))

    logits = xa @ wra.t()
    weights, full, denom = routing_weights_ref(logits, experts, routing, renormalize=renormalize,
                                               routed_scaling=routed_scaling)
    groups = _pairs_by_expert(experts, n_experts)
    chunk = n_experts if expert_chunk is None else expert_chunk
    if chunk < 1:
        raise ValueError(f"expert_chunk must be >= 1, got {expert_chunk}")
    n_pairs = n_tok * top_k
    # stages 1-4 a run of ``chunk`` experts at a time; dx_pair and the gate gradient in pair order (dx_pair
    # whole, so that stage 5 sums every token's slots in order j = 0..k-1 whatever the chunks)
    dx_pair = xa.new_empty((n_pairs, hidden))
    dweights = xa.new_empty(n_pairs)
    dw13 = dw2 = None
    if on_weight_grads is None:
        dw13 = xa.new_empty(w13.shape) if chunk < n_experts else None
        dw2 = xa.new_empty(w2.shape) if chunk < n_experts else None
    kept = {}  # return_stages: the per-pair stage tensors, in pair order
    for e0 in range(0, n_experts, chunk):
        e1 = min(e0 + chunk, n_experts)
        pairs, rows, dw13_c, dw2_c = _expert_rows_backward_ref(
            xa, dya, weights, w13[e0:e1], w2[e0:e1], [(e, p) for e, p in groups if e0 <= e < e1], e0, top_k, mx)
        dx_pair[pairs], dweights[pairs] = rows.pop("dx_pair"), rows.pop("dweights")
        if on_weight_grads is not None:
            on_weight_grads(e0, dw13_c, dw2_c)
        elif chunk < n_experts:
            dw13[e0:e1], dw2[e0:e1] = dw13_c, dw2_c
        else:
            dw13, dw2 = dw13_c, dw2_c
        if return_stages:
            for name, t in rows.items():
                if name not in kept:
                    kept[name] = t.new_zeros((n_pairs,) + tuple(t.shape[1:]))
                kept[name][pairs] = t
        del pairs, rows, dw13_c, dw2_c
    dweights = dweights.view(n_tok, top_k)
    dx_experts = dispatch_backward_ref(dx_pair, top_k)                         # 5
    dq = router_weights_backward_ref(dweights, weights, denom, routed_scaling=routed_scaling)  # 6
    dlogits = router_logits_backward_ref(dq, full, experts, routing)
    d_router_weight, dx_router = router_gemm_backward_ref(dlogits, xa, wra)
    dx = dx_experts + dx_router                                                # 7
    if not return_stages:
        return dx, d_router_weight, dw13, dw2
    stages = dict(experts=experts, logits=logits, weights=weights, full=full, denom=denom, **kept,
                  dweights=dweights, dx_pair=dx_pair, dx_experts=dx_experts, dq=dq, dlogits=dlogits,
                  dx_router=dx_router)
    return dx, d_router_weight, dw13, dw2, stages


def _expert_rows_backward_ref(xa, dya, weights, w13, w2, groups, e0: int, top_k: int, mx: bool = False):
    """Stages 1-4 of ``moe_backward_ref`` for the pairs of one run of experts: ``groups`` (from
    ``_pairs_by_expert``) those of experts e0 .. e0 + len(w13) - 1, w13 / w2 their slices. The run's pairs become
    rows in expert order (ascending p inside an expert), row i the one token of a top-1 layer (x_rows[i] =
    x[t(p_i)], dy_rows[i] = dy[t(p_i)], its gate weight w_p), so that the stage references run on these rows
    alone: per expert the same GEMMs on the same values as on every pair at once, and the per-pair tensors
    [rows, ...] instead of [T*k, ...]. Returns (pairs [rows] -- row i is pair pairs[i] --, {stage: [rows, ...]}
    (g, u, h, o, do, dh, dg, du, dx_pair, dweights), dw13 [len(w13), H, 2F], dw2 [len(w2), F, H]). ``mx``: the
    MXFP8 stages (moe_backward_ref's "MXFP8"), by ``_expert_rows_backward_mx_ref``."""
    pairs = torch.cat([p for _, p in groups]) if groups else torch.zeros(0, dtype=torch.long, device=xa.device)
    local, start = [], 0
    for e, p in groups:
        local.append((e - e0, torch.arange(start, start + p.numel(), device=xa.device)))
        start += p.numel()
    x_rows, dy_rows = xa[pairs // top_k], dya[pairs // top_k]
    if mx:
        rows, dw13, dw2 = _expert_rows_backward_mx_ref(x_rows, dy_rows, weights.reshape(-1)[pairs], w13, w2, local)
        return pairs, rows, dw13, dw2
    one = torch.zeros((pairs.numel(), 1), dtype=torch.long, device=xa.device)  # the rows' [rows, 1] decision
    g, u, h, o = expert_pairs_forward_ref(x_rows, one, w13, w2, local)
    do, dweights = combine_backward_ref(dy_rows, weights.reshape(-1)[pairs].view(-1, 1), o)   # 1
    dh, dw2 = gemm2_backward_ref(do, h, w2, local)                                             # 2
    dg, du = swiglu_backward_ref(dh, g, u)                                                     # 3
    dx_rows, dw13 = gemm1_backward_ref(dg, du, x_rows, one, w13, local)                        # 4
    rows = dict(g=g, u=u, h=h, o=o, do=do, dh=dh, dg=dg, du=du, dx_pair=dx_rows, dweights=dweights.view(-1))
    return pairs, rows, dw13, dw2


def _expert_rows_backward_mx_ref(x_rows, dy_rows, w_rows, w13, w2, local):
    """The MXFP8 stages 0-4 (moe_backward_ref's "MXFP8") on one run of experts' rows: x_rows, dy_rows [n, H] and
    w_rows [n] (each row's gate weight) in the math dtype, ``local`` [(expert index into w13 / w2, its row
    indices, ascending)]; the weights in their dtype, rounded to MX from their bf16 values. Returns ({stage:
    [n, ...]} as _expert_rows_backward_ref's, o the forward's MX GEMM2 output), dw13, dw2."""
    acc = x_rows.dtype
    n, f = x_rows.shape[0], w2.shape[1]
    g, u, z = (x_rows.new_zeros((n, f)) for _ in range(3))
    o, dx_rows = x_rows.new_zeros(x_rows.shape), x_rows.new_zeros(x_rows.shape)
    dw13, dw2 = x_rows.new_zeros(w13.shape), x_rows.new_zeros(w2.shape)
    for e, r in local:
        w13e, w2e = w13[e].to(acc), w2[e].to(acc)
        a = mx_along(x_rows[r], 1) @ mx_along(w13e, 0)                 # 0. GEMM1 (the forward's)
        g[r], u[r] = a[:, :f], a[:, f:]
        h_e = g[r] * torch.sigmoid(g[r]) * u[r]
        o[r] = mx_along(h_e, 1) @ mx_along(w2e, 0)                     # the forward's GEMM2 (h via bf16)
        z[r] = mx_along(dy_rows[r], 1) @ mx_along(w2e, 1).t()          # 1. dgrad2, K = H
        dw2[e] = mx_rows_ref(h_e).t() @ mx_rows_ref(w_rows[r, None] * dy_rows[r])   # 2. wgrad2, K = rows
    h = g * torch.sigmoid(g) * u
    do = w_rows[:, None] * dy_rows
    dh = w_rows[:, None] * z
    dweights = (z * h).sum(-1)
    dg, du = swiglu_backward_ref(dh, g, u)                             # 3.
    da = torch.cat([dg, du], dim=-1)
    for e, r in local:
        w13e = w13[e].to(acc)
        dx_rows[r] = mx_along(da[r], 1) @ mx_along(w13e, 1).t()        # 4. dgrad1, K = 2F
        dw13[e] = mx_rows_ref(x_rows[r]).t() @ mx_rows_ref(da[r])      #    wgrad1, K = rows
    rows = dict(g=g, u=u, h=h, o=o, do=do, dh=dh, dg=dg, du=du, dx_pair=dx_rows, dweights=dweights)
    return rows, dw13, dw2


def backward_saved_bytes(tokens: int, hidden: int, ffn: int, top_k: int, n_experts: int, rows: int | None = None):
    """Bytes per rank of each forward tensor ``moe_backward_ref``'s docstring lists (bf16 activations, fp32
    routing tensors, int32 experts); rows = expert rows on the rank (default tokens * top_k, balanced load)."""
    r = tokens * top_k if rows is None else rows
    return dict(weights=tokens * top_k * 4, experts=tokens * top_k * 4, denom=tokens * 4,
                probs=tokens * n_experts * 4, x=tokens * hidden * 2, x_rows=r * hidden * 2, gate_up=r * 2 * ffn * 2,
                h=r * ffn * 2, o=r * hidden * 2)
