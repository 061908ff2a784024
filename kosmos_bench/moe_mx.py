"""The MXFP8 MoE layer built from all-to-all (the ``nccl-a2a`` baseline of ``kosmos bench moe --dtype mxfp8``), and
its fp32 reference, distributed like ``kosmos.moe_reference.moe_forward_a2a`` (which this mirrors step by step:
route, permute the (token, slot) pairs by expert, exchange the counts, all-to-all the rows, regroup by local
expert, experts, all-to-all back, unpermute, fold).

MX semantics (kosmos/moe_reference.py's module docstring, ``expert_ffn_mx``): the router on the bf16 tokens; each
expert multiplies the MX values of x (blocks along H) with the MX values of W13 (blocks along H) and W2 (blocks
along F); its SwiGLU output h is rounded to bf16 and then to its MX values (blocks along F) before W2; fold in
fp32 (the reference) or as one batched bf16 GEMM with fp32 accumulation (the baseline, as at bf16).

``moe_forward_a2a_mx(fp32=False)`` (the baseline): x quantized once per call (``quant.to_mx``: E4M3 payload +
E8M0 scale per 32 along H; the kernel on CUDA, the reference elsewhere), the pairs' payload rows (as uint8) and
scale rows dispatched by two all-to-alls, dequantized on arrival (bf16: exact MX values), GEMM1 with the MX
values of W13, SwiGLU in bf16, h -> ``quant.mx_values`` (blocks along F), GEMM2 with the MX values of W2 (both
GEMMs ``torch._grouped_mm`` on CUDA, one expert at a time elsewhere), the bf16 outputs back by one all-to-all,
the fold as at bf16. The weights' MX values are made once by the caller (``mx_expert_weights``: a cached weight).
``fp32=True`` (the reference): the bf16 rows dispatched as they are, each local expert by ``expert_ffn_mx`` on
the ORIGINAL bf16 weights in fp32, the fold in fp32 in slot order -- ``moe_forward_ref_local(..., mx=True)``
distributed.

GEMM1's output: torch._grouped_mm has bf16 outputs only, so the baseline rounds GEMM1's [g | u] to bf16 and runs
the SwiGLU in bf16 before h's MX rounding, where the MX layer (and the kosmos kernel) rounds the fp32 SwiGLU
output once. The MX rounding of h (3 mantissa bits) turns those extra bf16 roundings into ~1.7e-2 of relative
error against the MX layer (measured on the CPU: 1.5-1.9e-2 at H 64, F 32; 2.8e-3 with an fp32 GEMM1 output), so
the baseline is checked against ``moe_forward_a2a_mx(fp32=True, gemm1_bf16=True)``: the MX layer with that
rounding (``expert_ffn_mx_gemm1_bf16``), at the same 1e-2 (row ``note``: BASELINE_NOTE).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kosmos import quant
from kosmos.reference.moe import expert_ffn_mx, mx_rows_ref, route

BASELINE_NOTE = ("GEMM1's output rounded to bf16 before the SwiGLU (torch._grouped_mm has bf16 outputs only): "
                 "checked against the MX layer with that rounding")



def _exchange_counts(flat_expert, local: int, world: int, group):
    """The per-expert pair counts exchanged once (one host sync): (recv [W, E/W] rows each rank sends to each of
    this rank's experts, rows sent to each rank, rows received from each)."""
    send = torch.bincount(flat_expert, minlength=local * world).view(world, local)
    recv = torch.empty_like(send)
    if world > 1:
        dist.all_to_all_single(recv, send, group=group)
    else:
        recv.copy_(send)
    send_splits, recv_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()
    return recv, send_splits, recv_splits

def expert_ffn_mx_gemm1_bf16(x, w13, w2):
    """``expert_ffn_mx`` with GEMM1's output rounded to bf16 and the SwiGLU in bf16 (the baseline's rounding)."""
    f = w2.shape[0]
    h = (quant.mx_values(x.to(torch.bfloat16)).float() @ quant.mx_values(w13.to(torch.bfloat16), dim=0).float())
    h = h.to(torch.bfloat16)
    h = (F.silu(h[:, :f]) * h[:, f:]).contiguous()
    return quant.mx_values(h).float() @ quant.mx_values(w2.to(torch.bfloat16), dim=0).float()


def mx_expert_weights(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MX values (bf16) of the expert weights, blocks along their K: w13 [E, H, 2F] along H, w2 [E, F, H]
    along F (what ``kosmos.moe_forward(..., precision="mxfp8")`` and the baseline multiply with)."""
    return quant.mx_values(w13, dim=1), quant.mx_values(w2, dim=1)


def _grouped(x: torch.Tensor, counts: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Local expert i's weight w[i] on the next counts[i] rows of x (bf16 out): torch._grouped_mm on CUDA, one
    expert at a time elsewhere (the per-expert loop of moe_reference._experts_forward)."""
    if x.is_cuda and hasattr(torch, "_grouped_mm") and x.shape[0] > 0:
        return torch._grouped_mm(x, w, offs=torch.cumsum(counts.to(device=x.device), 0, dtype=torch.int32))
    out = x.new_empty((x.shape[0], w.shape[2]))
    start = 0
    for i, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = x[start:start + n] @ w[i]
        start += n
    return out


def mx_experts_forward(x_sorted, counts, w13_mx, w2_mx) -> torch.Tensor:
    """The baseline's expert side: rows x_sorted [R, H] (bf16 MX values) grouped by local expert, counts
    [E_local]; w13_mx, w2_mx the weights' MX values. GEMM1, SwiGLU (bf16), h -> MX values along F, GEMM2."""
    if x_sorted.shape[0] == 0:
        return x_sorted.new_empty((0, w2_mx.shape[2]))
    f = w2_mx.shape[1]
    h = _grouped(x_sorted, counts, w13_mx)
    h = quant.mx_values((F.silu(h[:, :f]) * h[:, f:]).contiguous())
    return _grouped(h, counts, w2_mx)


def _exchange(parts: list, send_splits, recv_splits, world: int, group=None) -> list:
    """all_to_all_single of each [rows, ...] tensor of ``parts`` (rows split by ``send_splits``); at W = 1 the
    tensors themselves."""
    if world == 1:
        return parts
    out = []
    for t in parts:
        got = t.new_empty((sum(recv_splits), *t.shape[1:]))
        dist.all_to_all_single(got, t, recv_splits, send_splits, group=group)
        out.append(got)
    return out


def moe_forward_a2a_mx(x, router_weight, w13, w2, *, top_k: int, routing: str = "softmax", group=None,
                       fp32: bool = True, gemm1_bf16: bool = False, **route_kw):
    """The MXFP8 MoE layer over ``group`` (module docstring). x [T, H] bf16 this rank's tokens. ``fp32=True``:
    w13 [E/W, H, 2F], w2 [E/W, F, H] this rank's bf16 experts, returns fp32 (the reference). ``fp32=False``: w13,
    w2 their MX values (``mx_expert_weights``), returns bf16 (the baseline). ``gemm1_bf16`` (fp32 only): the
    reference of the baseline's rounding (``expert_ffn_mx_gemm1_bf16``). One host sync (the split sizes)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    local = w13.shape[0]
    n_tokens, hidden = x.shape
    weights, experts = route(x, router_weight, top_k, routing, **route_kw)   # on the bf16 tokens
    flat_expert = experts.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    token = order // top_k
    if fp32:
        parts = [x.index_select(0, token)]
    else:  # quantize each token once, send its payload (as bytes) and scales once per pair
        payload, scales = quant.to_mx(x)
        parts = [payload.view(torch.uint8).index_select(0, token), scales.index_select(0, token)]
    recv, send_splits, recv_splits = _exchange_counts(flat_expert, local, world, group)
    got = _exchange(parts, send_splits, recv_splits, world, group)
    n_got = got[0].shape[0]
    chunk_expert = torch.arange(local, device=x.device).repeat(world)
    src_expert = torch.repeat_interleave(chunk_expert, recv.reshape(-1).to(x.device), output_size=n_got)
    by_expert = torch.argsort(src_expert, stable=True)
    counts = recv.sum(0)
    if fp32:
        rows = got[0].index_select(0, by_expert)
        out_sorted = torch.empty((n_got, hidden), dtype=torch.float32, device=x.device)
        start, ffn = 0, expert_ffn_mx_gemm1_bf16 if gemm1_bf16 else expert_ffn_mx
        for i, n in enumerate(counts.tolist()):
            if n:
                out_sorted[start:start + n] = ffn(rows[start:start + n], w13[i], w2[i])
            start += n
    else:
        pay = got[0].index_select(0, by_expert).view(torch.float8_e4m3fn)
        rows = quant.from_mx((pay, got[1].index_select(0, by_expert))) if n_got else \
            x.new_empty((0, hidden))
        out_sorted = mx_experts_forward(rows, counts, w13, w2)
    out = torch.empty_like(out_sorted)
    out.index_copy_(0, by_expert, out_sorted)
    back = _exchange([out], recv_splits, send_splits, world, group)[0]   # the combine: bf16 (fp32: the reference)
    pair_out = torch.empty_like(back)
    pair_out.index_copy_(0, order, back)
    pair_out = pair_out.view(n_tokens, top_k, hidden)
    if not fp32:
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), pair_out).squeeze(1)
    y = torch.zeros((n_tokens, hidden), dtype=torch.float32, device=x.device)
    for j in range(top_k):
        y += weights[:, j, None] * pair_out[:, j]
    return y


def a2a_comm_parts(x, experts, local: int, world: int, mx: bool):
    """The collectives of the nccl-a2a baseline alone, at its splits: the dispatch (bf16 rows; mxfp8: the payload
    bytes and the scales) and the bf16 combine, or None at world size 1."""
    if world == 1:
        return None
    send = torch.bincount(experts.reshape(-1), minlength=local * world).view(world, local).sum(1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send_splits, recv_splits = torch.stack([send, recv]).tolist()
    hidden = x.shape[1]
    out = x.new_empty((sum(send_splits), hidden))   # the bf16 combine's buffers (and the bf16 dispatch's)
    got = x.new_empty((sum(recv_splits), hidden))
    if mx:
        pay = [torch.empty((sum(s), hidden), dtype=torch.uint8, device=x.device) for s in (send_splits, recv_splits)]
        sc = [torch.empty((sum(s), hidden // 32), dtype=torch.uint8, device=x.device)
              for s in (send_splits, recv_splits)]

        def dispatch():
            dist.all_to_all_single(pay[1], pay[0], recv_splits, send_splits)
            dist.all_to_all_single(sc[1], sc[0], recv_splits, send_splits)
    else:
        def dispatch():
            dist.all_to_all_single(got, out, recv_splits, send_splits)

    def fn():
        dispatch()
        dist.all_to_all_single(out, got, send_splits, recv_splits)
    return fn


def cross_rank_pairs(experts, local: int, world: int) -> int:
    """How many (token, slot) pairs of every rank go to an expert on another rank (summed over ranks; collective)."""
    dest = experts.reshape(-1) // local
    rank = dist.get_rank() if dist.is_initialized() else 0
    t = torch.tensor([int((dest != rank).sum().item())], dtype=torch.int64, device=experts.device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return int(t.item())


def wire_bytes(dtype: str, cross_pairs: int, hidden: int, world: int) -> int:
    """Bytes a rank sends in the layer's all-to-alls, the mean over ranks: ``cross_pairs`` (every rank's pairs to
    an expert on another rank) / W rows each way; dispatch H*2 bytes a row at bf16, H*(1 + 1/32) at mxfp8
    (payload + an E8M0 scale per 32), combine H*2 (bf16 at every dtype). 0 at W = 1."""
    if world <= 1:
        return 0
    dispatch = hidden + hidden // 32 if dtype == "mxfp8" else 2 * hidden
    return cross_pairs * (dispatch + 2 * hidden) // world


# ------------------------------------------------------------------------------------ the MX layer with a backward

def _q_cols(t: torch.Tensor) -> torch.Tensor:
    """t [R, K]'s MX values along K (bf16 first), in t's dtype."""
    return quant.mx_values(t.to(torch.bfloat16).contiguous()).to(t.dtype) if t.numel() else t


def _q_rows(t: torch.Tensor, counts: torch.Tensor, fp32: bool) -> torch.Tensor:
    """t [R, K] (rows grouped by expert, counts[i] of expert i)'s MX values along the rows: blocks of 32 rows of one
    expert from its first row, the last completed by zero rows (reference.moe.mx_rows_ref per expert); bf16 first,
    t's dtype out. fp32 (the reference): the torch reference expert by expert; else the expert rows gathered into
    a layout padded to 32 per expert (gap rows zero) and ``quant.round_to_mx_rows`` on it (CUDA or the
    interpreter)."""
    if not t.numel():
        return t
    if fp32 or not (t.is_cuda or _interpreting()):
        out, start = torch.empty_like(t), 0
        for n in counts.tolist():
            if n:
                out[start:start + n] = mx_rows_ref(t[start:start + n])
            start += n
        return out
    from kosmos.ops.moe_backward.layout import padded_layout
    from kosmos.ops.moe_backward.rows import gather_rows
    _, row_of, real_of, _ = padded_layout(counts, t.shape[0], pad=32)
    return quant.round_to_mx_rows(gather_rows(t.to(torch.bfloat16).contiguous(), real_of))[row_of].to(t.dtype)


def _interpreting() -> bool:
    from kosmos.core import planning
    return planning.interpreting()


def _gemm(a: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, fp32: bool) -> torch.Tensor:
    """Local expert i's w[i] [K, N] on the next counts[i] rows of a [R, K]: fp32 math expert by expert (fp32), else
    ``_grouped`` (bf16 out)."""
    if not fp32:
        return _grouped(a.to(torch.bfloat16), counts, w.to(torch.bfloat16))
    out, start = a.new_zeros((a.shape[0], w.shape[2]), dtype=torch.float32), 0
    for i, n in enumerate(counts.tolist()):
        if n:
            out[start:start + n] = a[start:start + n].float() @ w[i].float()
        start += n
    return out


def _wgrad(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor, fp32: bool) -> torch.Tensor:
    """[E, KA, KB] with [i] = a[rows of i]^T b[rows of i] (zeros for an expert without rows): torch._grouped_mm on
    CUDA (bf16 out; what autograd's grouped-mm backward does), fp32 math expert by expert elsewhere or with fp32."""
    if not fp32 and a.is_cuda and hasattr(torch, "_grouped_mm") and a.shape[0] > 0:
        offs = torch.cumsum(counts.to(device=a.device), 0, dtype=torch.int32)
        return torch._grouped_mm(a.to(torch.bfloat16).t(), b.to(torch.bfloat16), offs=offs)
    out = a.new_zeros((counts.shape[0], a.shape[1], b.shape[1]), dtype=torch.float32)
    start = 0
    for i, n in enumerate(counts.tolist()):
        if n:
            out[i] = a[start:start + n].float().t() @ b[start:start + n].float()
        start += n
    return out if fp32 else out.to(torch.bfloat16)


class _MXGemm1(torch.autograd.Function):
    """[g | u] = Q_H(rows) @ Q_H(W13[e]) per expert; backward: d rows = Q_2F(dc) @ Q_2F(W13[e])^T, dW13[e] =
    Q_R(rows)^T @ Q_R(dc) (kosmos.ops.moe_backward.mx's table; straight through the quantizers). ``w13`` the
    parameter (gets dW13), ``w13_fwd`` / ``w13_bwd`` its MX values along H / along 2F (made once, outside)."""

    @staticmethod
    def forward(ctx, rows, w13, w13_fwd, w13_bwd, counts, fp32):
        ctx.save_for_backward(rows, w13_bwd, counts)
        ctx.fp32 = fp32
        return _gemm(_q_cols(rows), w13_fwd, counts, fp32)

    @staticmethod
    def backward(ctx, dc):
        rows, w13_bwd, counts = ctx.saved_tensors
        fp32 = ctx.fp32
        d_rows = _gemm(_q_cols(dc), w13_bwd.transpose(1, 2), counts, fp32).to(rows.dtype)
        dw13 = _wgrad(_q_rows(rows, counts, fp32), _q_rows(dc, counts, fp32), counts, fp32)
        return d_rows, dw13, None, None, None, None


class _MXGatedGemm2(torch.autograd.Function):
    """c = w * (Q_F(h) @ Q_F(W2[e])) per expert row (its gate weight w; the fold then sums c over a token's slots);
    backward for dc (each row's token gradient dy): z = Q_H(dc) @ Q_H(W2[e])^T, dh = w z, dW2[e] = Q_R(h)^T @
    Q_R(bf16(w dc)), dw = <z, h> (kosmos.ops.moe_backward.mx's table)."""

    @staticmethod
    def forward(ctx, h, w2, w2_fwd, w2_bwd, w, counts, fp32):
        ctx.save_for_backward(h, w2_bwd, w, counts)
        ctx.fp32 = fp32
        o = _gemm(_q_cols(h), w2_fwd, counts, fp32)
        return w[:, None] * o if fp32 else (w[:, None] * o.float()).to(torch.bfloat16)

    @staticmethod
    def backward(ctx, dc):
        h, w2_bwd, w, counts = ctx.saved_tensors
        fp32 = ctx.fp32
        z = _gemm(_q_cols(dc), w2_bwd.transpose(1, 2), counts, fp32).float()
        do = w[:, None] * dc.float()
        dw2 = _wgrad(_q_rows(h, counts, fp32), _q_rows(do if fp32 else do.to(torch.bfloat16), counts, fp32),
                     counts, fp32)
        return (w[:, None] * z).to(h.dtype), dw2, None, None, (z * h.float()).sum(-1), None, None


def moe_forward_a2a_mx_train(x, router_weight, w13, w2, mx_weights, *, top_k: int, routing: str = "softmax",
                             group=None, fp32: bool = False, experts=None, **route_kw):
    """The MXFP8 layer with its MX backward (kosmos.ops.moe_backward.mx's rules) by autograd, built like
    reference.moe.moe_forward_a2a: route (bf16 x; the weights differentiable), the (token, slot) rows and their
    gate weights to the experts' ranks (reference.moe.all_to_all_rows: bf16 rows, the MX rounding on arrival --
    wgrad1 needs x's bf16 rows there anyway), each local expert's GEMM1 (_MXGemm1), SwiGLU, GEMM2 with the gate
    weight on its rows (_MXGatedGemm2), the rows back, each token's slots summed. x [T, H], w13 / w2 this rank's
    bf16 experts (the leaves that get the gradients), ``mx_weights`` their MoEMXWeights (made once, outside a timed
    call). ``fp32=False``: the nccl-a2a baseline's MX training layer (grouped GEMMs on CUDA, bf16 activations, the
    SwiGLU in bf16 on GEMM1's bf16 output as the MX forward baseline runs it; returns bf16); ``fp32=True``: the
    reference (fp32 math expert by expert, the fold in fp32; returns fp32) -- autograd through it is
    moe_backward_ref(mx=True), distributed. ``experts``: use this decision (moe_forward_a2a's). One host sync."""
    from kosmos.reference.moe import all_to_all_rows, route_or_given
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    local = w13.shape[0]
    n_tokens, hidden = x.shape
    weights, experts = route_or_given(x, router_weight, top_k, routing, experts, route_kw)
    flat_expert = experts.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    rows = x.index_select(0, order // top_k)
    w_rows = weights.reshape(-1).float().index_select(0, order)
    recv, send_splits, recv_splits = _exchange_counts(flat_expert, local, world, group)
    if world > 1:
        rows = all_to_all_rows(rows, recv_splits, send_splits, group)
        w_rows = all_to_all_rows(w_rows[:, None], recv_splits, send_splits, group)[:, 0]
    chunk_expert = torch.arange(local, device=x.device).repeat(world)
    src_expert = torch.repeat_interleave(chunk_expert, recv.reshape(-1).to(x.device), output_size=rows.shape[0])
    by_expert = torch.argsort(src_expert, stable=True)
    counts = recv.sum(0)
    xs, ws = rows.index_select(0, by_expert), w_rows.index_select(0, by_expert)
    f = w2.shape[1]
    gu = _MXGemm1.apply(xs, w13, mx_weights.w13, mx_weights.w13_bwd, counts, fp32)
    h = F.silu(gu[:, :f]) * gu[:, f:]
    c = _MXGatedGemm2.apply(h, w2, mx_weights.w2, mx_weights.w2_bwd, ws, counts, fp32)
    if world > 1 and rows.shape[0] == 0 and rows.requires_grad:  # nothing received: still a graph through both
        c = c + rows.sum()  # all-to-alls, so that this rank joins its peers' backward ones
    out = torch.empty_like(c)
    out.index_copy_(0, by_expert, c)
    back = all_to_all_rows(out, send_splits, recv_splits, group) if world > 1 else out
    pair_out = torch.empty_like(back)
    pair_out.index_copy_(0, order, back)
    y = pair_out.view(n_tokens, top_k, hidden).float().sum(1)
    return y if fp32 else y.to(x.dtype)
