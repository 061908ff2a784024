"""Drop-in modules over the fused ops.

``MoE`` -- the routed-expert part of an MoE layer in one launch (``kosmos.moe_forward``), forward only for now
(the backward launch is future work: calling it on tensors that require grad raises instead of silently
dropping gradients). Shared experts are not included: add them beside it, e.g. ``y = moe(x) + shared(x)``.
"""
from __future__ import annotations

import math

import torch

from .kernels.moe_forward import moe_forward
from .moe_reference import ROUTINGS


class MoE(torch.nn.Module):
    """This rank's share of an expert-parallel MoE layer: router weight [E, H] (replicated), w13 [E/W, H, 2F]
    (gate | up) and w2 [E/W, F, H] for the experts g with g // (E/W) == rank. ``forward(x [T, H]) -> [T, H]``."""

    def __init__(self, hidden: int, expert_ffn: int, experts: int, top_k: int, *, routing: str = "softmax",
                 renormalize: bool = True, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
                 group=None, device=None, dtype=torch.bfloat16):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")
        import torch.distributed as dist
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if experts % world:
            raise ValueError(f"{experts} experts do not split evenly over {world} ranks")
        local = experts // world
        self.group, self.top_k, self.routing = group, top_k, routing
        self.route_kw = dict(renormalize=renormalize, routed_scaling=routed_scaling)
        if routing == "sigmoid-grouped":
            self.route_kw.update(n_group=n_group, topk_group=topk_group)
        kw = dict(device=device, dtype=dtype)
        self.router_weight = torch.nn.Parameter(torch.empty(experts, hidden, **kw))
        self.w13 = torch.nn.Parameter(torch.empty(local, hidden, 2 * expert_ffn, **kw))
        self.w2 = torch.nn.Parameter(torch.empty(local, expert_ffn, hidden, **kw))
        self.bias = (torch.nn.Parameter(torch.zeros(experts, device=device, dtype=torch.float32), requires_grad=False)
                     if routing == "sigmoid-grouped" else None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            for p in (self.router_weight, self.w13):
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-2] if p.dim() == 3 else p.shape[-1]))
            self.w2.normal_(0.0, 1.0 / math.sqrt(self.w2.shape[1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in
                                                                (self.router_weight, self.w13, self.w2))):
            raise RuntimeError("kosmos.nn.MoE has no backward yet: run it under torch.no_grad() / inference_mode, "
                               "or freeze its parameters")
        return moe_forward(x, self.router_weight, self.w13, self.w2, top_k=self.top_k, routing=self.routing,
                           bias=self.bias, group=self.group, **self.route_kw)
