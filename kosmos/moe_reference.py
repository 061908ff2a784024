"""Pure-torch references of the MoE expert layer (router, dispatch, expert FFN, combine, fold).

Routing (router logits always in fp32):
  softmax          p = softmax(x @ Wr^T); (w, e) = topk(p, k); w /= sum(w) if renormalize
                   (Mixtral, Qwen3: renormalize; Qwen2-57B: not).
  sigmoid-grouped  DeepSeek-V3: s = sigmoid(x @ Wr^T); choice = s + bias; the E experts form n_group groups,
                   a group's score is the sum of its top-2 choice values; keep the topk_group best groups;
                   e = topk(choice restricted to kept groups, k); w = s[e] (no bias);
                   w /= sum(w) if renormalize; w *= routed_scaling.
Expert e (SwiGLU): y_e(x) = (silu(x @ W13[e][:, :F]) * (x @ W13[e][:, F:])) @ W2[e], W13 [H, 2F], W2 [F, H].
Fold: y[t] = sum_{j < k} w[t, j] * y_{e[t, j]}(x[t]), in top-k slot order j = 0..k-1 (topk's order).
Experts are split evenly over W ranks: global expert g lives on rank g // (E/W) as local expert g % (E/W).
Shared experts are outside the op.

``moe_forward_ref_local`` takes every rank's tokens in one process (CPU tests); ``moe_forward_a2a`` is the
distributed layer built from NCCL all-to-all the way Megatron's all-to-all dispatcher does it -- with
``fp32=True`` the reference, with ``fp32=False`` the ``nccl-a2a`` baseline (bf16, grouped GEMMs on CUDA).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROUTINGS = ("softmax", "sigmoid-grouped")


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


def moe_forward_ref_local(xs, router_weight, w13s, w2s, *, top_k: int, routing: str = "softmax", **route_kw):
    """Every rank's tokens ``xs[r]`` [T_r, H] and experts ``w13s[r]`` [E/W, H, 2F], ``w2s[r]`` [E/W, F, H]
    in one process -> each rank's y [T_r, H] in fp32."""
    w13 = torch.cat([w.float() for w in w13s])
    w2 = torch.cat([w.float() for w in w2s])
    out = []
    for x in xs:
        weights, experts = route(x, router_weight, top_k, routing, **route_kw)
        y = torch.zeros(x.shape, dtype=torch.float32)
        xf = x.float()
        for j in range(top_k):  # fixed slot order
            for e in experts[:, j].unique().tolist():
                rows = (experts[:, j] == e).nonzero(as_tuple=True)[0]
                y[rows] += weights[rows, j, None] * expert_ffn(xf[rows], w13[e], w2[e])
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


def moe_forward_a2a(x, router_weight, w13, w2, *, top_k: int, routing: str = "softmax", group=None,
                    fp32: bool = True, **route_kw):
    """The MoE layer over ``group`` with NCCL/gloo all-to-all (Megatron's all-to-all dispatcher):
    route, permute (token, expert) pairs by expert, exchange counts (read on the host: NCCL needs the split
    sizes there), all_to_all_single the rows, group them by local expert, SwiGLU experts, all_to_all_single
    back, unpermute, fold. x [T, H] this rank's tokens; w13 [E/W, H, 2F], w2 [E/W, F, H] this rank's experts.
    Returns y [T, H].

    ``fp32=True`` (the reference): rows upcast to fp32, experts one by one in fp32, the fold in fp32 in slot
    order; returns fp32. ``fp32=False`` (the ``nccl-a2a`` baseline): bf16 rows on the wire, grouped GEMMs, and
    the fold as one batched GEMM ``y[t] = w[t, :] @ pair_out[t, :, :]`` (weights cast to x.dtype, fp32
    accumulation inside the GEMM); returns x.dtype. One host sync per call (the split sizes)."""
    import torch.distributed as dist
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    local = w13.shape[0]
    n_tokens, hidden = x.shape
    weights, experts = route(x, router_weight, top_k, routing, **route_kw)
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
    got = rows.new_empty((sum(recv_splits), hidden))
    if world > 1:
        dist.all_to_all_single(got, rows, recv_splits, send_splits, group=group)
    else:
        got.copy_(rows)
    # got holds, per source rank, rows sorted by local expert: regroup by local expert (stable, so within an
    # expert the rows stay in source-rank order)
    chunk_expert = torch.arange(local, device=x.device).repeat(world)  # chunk (source s, expert i) -> i
    src_expert = torch.repeat_interleave(chunk_expert, recv.reshape(-1).to(x.device), output_size=got.shape[0])
    by_expert = torch.argsort(src_expert, stable=True)
    out_sorted = _experts_forward(got.index_select(0, by_expert), recv.sum(0), w13, w2, fp32)
    out = torch.empty_like(out_sorted)
    out.index_copy_(0, by_expert, out_sorted)
    back = out.new_empty((sum(send_splits), hidden))
    if world > 1:
        dist.all_to_all_single(back, out, send_splits, recv_splits, group=group)
    else:
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


def apply_routing_ref(x, weights, experts, w13_all, w2_all):
    """fp32 y [T, H] for tokens x [T, H] given a routing (weights [T, k], global experts [T, k]) and ALL experts'
    weights (w13_all [E, H, 2F], w2_all [E, F, H]); fold in slot order. Lets a test check the expert math of an
    implementation against its own routing decisions, separately from the router."""
    xf = x.float()
    y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(experts.shape[1]):
        for e in experts[:, j].unique().tolist():
            rows = (experts[:, j] == e).nonzero(as_tuple=True)[0]
            y[rows] += weights[rows, j, None].float() * expert_ffn(xf[rows], w13_all[e].float(), w2_all[e].float())
    return y
