"""transformers' own MoE layer as baselines of ``kosmos bench moe``: ``hf-grouped-mm`` and ``hf-eager``.

What they run: the router module and the experts module of the model's transformers family (``MoEModel.hf_family``,
the classes of kosmos.integrations.transformers.FAMILIES; a custom model: qwen3_moe for softmax routing,
deepseek_v3 for sigmoid-grouped), built with the point's sizes and routing from the family's config class, called
as the family's sparse block calls them -- ``_, weights, experts = router(x)`` then ``experts(x, experts,
weights)`` -- without shared experts (KOSMOS's layer has none either). The experts dispatch through transformers'
``ExpertsInterface`` on ``config._experts_implementation``: "grouped_mm" (hf-grouped-mm: transformers'
``grouped_mm_experts_forward``, its default on a GPU) or "eager" (hf-eager: the experts class's own loop over the
experts that received tokens).

Like for like with kosmos: the same x, the same router weight (the module's ``weight`` shares its storage), the
same DeepSeek-V3 score-correction bias, the same expert weights in transformers' layout -- gate_up_proj [E, 2F, H]
= w13.transpose(1, 2) and down_proj [E, H, F] = w2.transpose(1, 2), copied once when the layer is built (untimed)
-- and the routing computation of the model's own router module (which the bench checks against the MoEModel's
routing: ``hf_layer`` raises if they differ). Each call returns (y [T, H], its routing decision [T, k]); the
decision is transformers' (Qwen/Mixtral routers round the logits to bf16 before the softmax, so near-tied tokens
may choose other experts than KOSMOS's fp32 logits), and the bench checks the output against the fp32 reference
for that decision (kosmos_bench.moe).

Imports transformers only when called (``hf_available`` says whether it can be).
"""
from __future__ import annotations

import importlib

import torch

from kosmos.integrations.transformers import FAMILIES, Family, require_transformers, route_kwargs
from kosmos.models import MoEModel

# bench implementation -> transformers' experts implementation (config._experts_implementation)
HF_IMPLS = {"hf-grouped-mm": "grouped_mm", "hf-eager": "eager"}


def hf_available(world: int) -> tuple[bool, str | None]:
    """Whether the hf-* baselines can run here: transformers >= 5 importable, one rank (EP = 1)."""
    try:
        require_transformers()
    except ImportError as e:
        return False, str(e)
    if world != 1:
        return False, (f"transformers' experts hold every expert on one GPU: EP = 1 only, not {world} ranks (no "
                       f"expert parallelism in these baselines)")
    return True, None


def hf_family(m: MoEModel) -> Family:
    """The transformers family whose router and experts the hf-* baselines build for ``m``."""
    return FAMILIES[m.hf_family or ("deepseek_v3" if m.routing == "sigmoid-grouped" else "qwen3_moe")]


def hf_note(impl: str, m: MoEModel) -> str:
    """The row note of ``impl`` at model ``m``: what ran (transformers' version, the family's classes)."""
    fam = hf_family(m)
    try:
        version = require_transformers().__version__
    except ImportError:
        version = "(not importable)"
    return (f"transformers {version}: {fam.router} + {fam.experts}, experts_implementation="
            f"{HF_IMPLS[impl]!r}, no shared experts")


def hf_config(m: MoEModel, experts_implementation: str):
    """(family, its config) with ``m``'s hidden size, expert FFN, experts, top-k and routing, SiLU experts."""
    transformers = require_transformers()
    fam = hf_family(m)
    sizes = dict(hidden_size=m.hidden, num_experts_per_tok=m.top_k, hidden_act="silu",
                 experts_implementation=experts_implementation)
    if fam.name == "mixtral":
        kw = dict(intermediate_size=m.expert_ffn, num_local_experts=m.experts)
    elif fam.name == "olmoe":
        kw = dict(intermediate_size=m.expert_ffn, num_experts=m.experts, norm_topk_prob=m.renormalize)
    elif fam.name in ("qwen2_moe", "qwen3_moe"):
        kw = dict(moe_intermediate_size=m.expert_ffn, num_experts=m.experts, norm_topk_prob=m.renormalize)
    else:  # deepseek_v3
        kw = dict(moe_intermediate_size=m.expert_ffn, n_routed_experts=m.experts, n_group=m.n_group,
                  topk_group=m.topk_group, norm_topk_prob=m.renormalize, routed_scaling_factor=m.routed_scaling)
    return fam, getattr(transformers, fam.config)(**sizes, **kw)


def hf_layer(m: MoEModel, router_weight, bias, w13, w2, experts_implementation: str, requires_grad: bool):
    """(layer, params) of transformers' router + experts for model ``m`` on these weights (module docstring):
    ``layer(x)`` -> (y [T, H], experts [T, k]); ``params`` = [router.weight, experts.gate_up_proj,
    experts.down_proj], nn.Parameters (requiring grad iff ``requires_grad``). ValueError if the family's router,
    built from ``m``, would not route as ``m`` says (e.g. Mixtral's always renormalises)."""
    fam, cfg = hf_config(m, experts_implementation)
    module = importlib.import_module(fam.module)
    with torch.device("meta"):  # no initialisation: every parameter is given below
        router, experts = getattr(module, fam.router)(cfg), getattr(module, fam.experts)(cfg)
    router.weight = torch.nn.Parameter(router_weight, requires_grad=requires_grad)
    experts.gate_up_proj = torch.nn.Parameter(w13.transpose(1, 2).contiguous(), requires_grad=requires_grad)
    experts.down_proj = torch.nn.Parameter(w2.transpose(1, 2).contiguous(), requires_grad=requires_grad)
    if fam.routing == "sigmoid-grouped":
        router.e_score_correction_bias = bias.float() if bias is not None else torch.zeros(
            m.experts, device=router_weight.device)
    kw = route_kwargs(fam, router)
    want = dict(top_k=m.top_k, routing=m.routing, renormalize=m.renormalize)
    if m.routing == "sigmoid-grouped":
        want.update(routed_scaling=m.routed_scaling, n_group=m.n_group, topk_group=m.topk_group)
    elif m.routed_scaling != 1.0:
        want["routed_scaling"] = m.routed_scaling
    got = {key: kw.get(key, 1.0 if key == "routed_scaling" else None) for key in want}
    if got != want:
        raise ValueError(f"{m.name}: transformers' {fam.router} routes with {got}, the model with {want}")

    def layer(x):
        _, weights, chosen = router(x)
        return experts(x, chosen, weights), chosen
    return layer, [router.weight, experts.gate_up_proj, experts.down_proj]
