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
from kosmos.reference.moe import expert_ffn_mx, route

BASELINE_NOTE = ("GEMM1's output rounded to bf16 before the SwiGLU (torch._grouped_mm has bf16 outputs only): "
                 "checked against the MX layer with that rounding")


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
    per_expert = torch.bincount(flat_expert, minlength=local * world)
    send = per_expert.view(world, local)
    recv = torch.empty_like(send)
    if world > 1:
        dist.all_to_all_single(recv, send, group=group)
    else:
        recv.copy_(send)
    send_splits, recv_splits = torch.stack([send.sum(1), recv.sum(1)]).tolist()
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
