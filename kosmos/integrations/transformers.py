"""The sparse MoE blocks of a HuggingFace transformers (>= 5.13) model on KOSMOS: ``patch(model)``.

    from kosmos.integrations.transformers import patch
    patched = patch(model)          # every sparse MoE block it can run now runs kosmos.nn.moe
    ...                             # train (autograd), torch.no_grad / inference_mode, model.generate
    patched.unpatch()               # every patched block runs its own forward again

    register_experts()                              # or: any model's experts on KOSMOS, its router its own
    model.set_experts_implementation("kosmos")      # kosmos.nn.moe_experts with the model's routing

What a patched block computes. Its forward (replaced on the block instance; the class is untouched) takes the
block's input [..., H] as rows x [T, H] and runs the block's router and routed experts as one ``kosmos.nn.moe``
call -- one launch forward, one backward (kosmos.nn's MoEFn) -- on the block's own parameters: the router weight
``gate.weight`` [E, H] and the experts' ``gate_up_proj`` [E, 2F, H] (gate | up, concatenated) and ``down_proj``
[E, H, F], passed as their ``.transpose(1, 2)`` views. It adds the shared expert(s) by calling the model's own
modules, as the model does, and returns the block's output shape (a tensor, as these blocks return). The blocks
and the routing KOSMOS runs for each (checked against transformers 5.13's, 5.17's and 5.25's code, line by line):

  MixtralSparseMoeBlock    p = softmax(x Wr^T) over all E experts; top-k of p; renormalised (always)
  Qwen2MoeSparseMoeBlock   softmax over all experts, top-k, renormalised iff config.norm_topk_prob; plus
                           sigmoid(shared_expert_gate(x)) * shared_expert(x)
  Qwen3MoeSparseMoeBlock   softmax, top-k, renormalised iff norm_topk_prob
  OlmoeSparseMoeBlock      softmax, top-k, renormalised iff norm_topk_prob
  DeepseekV3MoE            s = sigmoid(x Wr^T) (fp32); choice = s + e_score_correction_bias; n_group groups
                           scored by the sum of their top-2 choices, the topk_group best kept; top-k of the choice
                           in the kept groups; weights s[e], renormalised (+1e-20) iff norm_topk_prob, then times
                           routed_scaling_factor; plus shared_experts(x)
  (kosmos.reference.moe.route is the same math; tests/test_integrations_hf.py checks each router against it.)
The expert is SwiGLU: down(silu(gate) * up). Rounding differs from transformers' bf16 path, not the math: KOSMOS
computes the softmax routers' logits in fp32 from the bf16 operands (transformers rounds them to bf16 first), so a
token whose k-th and (k+1)-th logits lie within bf16 rounding of each other can choose another expert; it keeps
the gate weights in fp32 (Qwen2/Qwen3/OLMoE round them to bf16) and sums a token's k expert outputs in fp32.

Where the parameters stay: nothing is copied or re-registered. ``state_dict`` keys and tensors are the model's,
save / load round-trips unchanged, gradients land on the model's own parameters (the kernels read the transposed
views as stored and return the weight gradients in the parameters' own layout), and optimizer steps and gradient
accumulation act on them. DeepSeek-V3's e_score_correction_bias is
read each call (as fp32) and gets no gradient, as in transformers. A router weight kept in fp32 (transformers 5.25
keeps DeepSeek-V3's ``gate.weight`` fp32 in a bf16 model, ``_keep_in_fp32_modules_strict``) is rounded to bf16 for
the launch each call (E x H values); its gradient returns through that cast, in fp32.

Router logits: when the block's router module (``block.gate``) has forward hooks -- transformers installs one to
record router logits for ``output_router_logits`` (the auxiliary load-balancing loss) -- the patched forward also
calls that module on x, so its hooks see the model's own router output (with autograd, so an auxiliary loss trains
the router weight); its routing is not used. Without hooks the router runs only inside the KOSMOS launch.

Refused (the block keeps its own forward; one ``RefusedBlockWarning`` per block naming it and the reason, and the
same line in ``Patched.refused``): a block class not in the table above (its router is not one KOSMOS verified);
a router module of another class than the family's; expert biases; an activation other than SiLU, or a custom
``_apply_gate``; interleaved gate/up (``is_concatenated=False``); the transposed expert layout (``is_transposed``,
not covered); experts without a gate (``has_gate=False``); Mixtral's ``router_jitter_noise > 0`` while the block is
in training mode (a block patched in eval mode runs its own forward whenever it is in training mode, with one
warning); expert parameters other than bf16, a router weight other than bf16 or fp32 (cast the model to bf16
first); a norm after the experts (``has_post_expert_norm``); experts set up for expert parallelism; E > 256, top_k > min(E, 16), H or F not
multiples of 8; DeepSeek-V3 groups KOSMOS cannot form (E % n_group, fewer than 2 experts a group, topk_group >
n_group, top_k > the kept groups' experts); parameters on the meta device (offloaded) or router and experts on
different devices; hooks on the experts module, forward pre-hooks on the router, an accelerate ``_hf_hook`` on
either (none of those would run); a block whose forward is already replaced on the instance. ``strict=True``
raises one ValueError naming every refused block instead, and patches nothing.

Routing given from outside: the experts implementation "kosmos". transformers' ``ExpertsInterface`` calls an
experts implementation as ``fn(experts, hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``, the
routing already chosen by the model's own router. ``register_experts()`` registers ``experts_forward`` under the
name "kosmos" (idempotent; returns the name); a model selects it with ``model.set_experts_implementation("kosmos")``
or ``from_pretrained(..., experts_implementation="kosmos")`` / ``from_config(...)``. It runs
``kosmos.nn.moe_experts`` (routing "given": the dispatch, both expert GEMMs and the combine in one launch; the
backward without a router part) on the module's own ``gate_up_proj`` / ``down_proj`` as ``.transpose(1, 2)``
views, with gradients for the hidden states, ``top_k_weights`` (transformers' autograd carries them on into the
model's router, whatever its kind) and both parameters. So any family whose experts module dispatches through the
interface runs its experts on KOSMOS, whatever its router, when the experts are KOSMOS's math; the router itself
runs as the model's code, outside the launch. ``experts_forward`` raises a one-line ValueError for what
``experts_refusal`` lists -- the experts checks above (biases, no gate, interleaved or transposed layout, not SiLU,
a custom ``_apply_gate``, not bf16, the limits) and an experts module under a tensor- or expert-parallel plan
(transformers' EP passes local ids with sentinels >= E, not supported) -- and for hidden states not in bf16; on a
device other than CUDA ``kosmos.moe_forward`` raises. ``patch(model, experts=True)`` selects "kosmos" for the
blocks it refuses as a whole (e.g. a router KOSMOS does not run) when their experts pass ``experts_refusal``, while
the verified blocks run whole as above. Expert parallelism (W > 1) is not set up here: the patched blocks and the
kosmos experts run every expert on the block's device (EP = 1).

The kernels need CUDA bf16 tensors; on the CPU ``kosmos.moe_forward`` refuses the call (tests stand its reference in).
Tests: tests/test_integrations_hf.py (CPU: tiny models of the five families, the "kosmos" experts implementation
against transformers' eager one; GPU: the real kernels, patched blocks and the experts implementation).
"""
from __future__ import annotations

import types
import warnings
from dataclasses import dataclass, field

import torch

from .. import nn as _nn
from ..ops.moe_forward import MAX_EXPERTS, MAX_TOPK

# 5.0 brought the 3-D gate_up_proj / down_proj experts and ExpertsInterface; 5.13 is the first release whose five
# families have the structure checked here (DeepSeek-V3's DeepseekV3TopkRouter choosing the experts itself, beside
# DeepseekV3Experts; 5.0-5.12 route in the block over a DeepseekV3NaiveMoe) -- read against 5.13.0 and 5.17.0, run
# with 5.17
MIN_TRANSFORMERS = (5, 13)


class RefusedBlockWarning(UserWarning):
    """A sparse MoE block ``patch`` left as it was; the message names it and the reason."""


@dataclass(frozen=True)
class Family:
    """A transformers MoE family whose sparse block KOSMOS runs whole: the class names of its block, router,
    experts and config (in ``transformers.models.<name>.modeling_<name>`` / ``transformers``), the KOSMOS routing
    kind, and its shared expert(s): None, "gated" (Qwen2-MoE: sigmoid(shared_expert_gate(x)) * shared_expert(x))
    or "plain" (DeepSeek-V3: shared_experts(x))."""
    name: str
    block: str
    router: str
    experts: str
    config: str
    routing: str
    shared: str | None = None

    @property
    def module(self) -> str:
        return f"transformers.models.{self.name}.modeling_{self.name}"


FAMILIES = {f.name: f for f in (
    Family("mixtral", "MixtralSparseMoeBlock", "MixtralTopKRouter", "MixtralExperts", "MixtralConfig", "softmax"),
    Family("qwen2_moe", "Qwen2MoeSparseMoeBlock", "Qwen2MoeTopKRouter", "Qwen2MoeExperts", "Qwen2MoeConfig",
           "softmax", "gated"),
    Family("qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoeTopKRouter", "Qwen3MoeExperts", "Qwen3MoeConfig",
           "softmax"),
    Family("olmoe", "OlmoeSparseMoeBlock", "OlmoeTopKRouter", "OlmoeExperts", "OlmoeConfig", "softmax"),
    Family("deepseek_v3", "DeepseekV3MoE", "DeepseekV3TopkRouter", "DeepseekV3Experts", "DeepseekV3Config",
           "sigmoid-grouped", "plain"),
)}


def require_transformers():
    """The ``transformers`` module (>= MIN_TRANSFORMERS); ImportError in one line if it is missing or older."""
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"kosmos.integrations.transformers needs transformers >= "
                          f"{'.'.join(map(str, MIN_TRANSFORMERS))} (pip install 'kosmos[hf]'): {e}") from None
    version = tuple(int(p) for p in transformers.__version__.split(".")[:2] if p.isdigit())
    if version < MIN_TRANSFORMERS:
        raise ImportError(f"kosmos.integrations.transformers needs transformers >= "
                          f"{'.'.join(map(str, MIN_TRANSFORMERS))} (the MoE blocks it knows); found "
                          f"{transformers.__version__}")
    return transformers


def family_of(module) -> Family | None:
    """The Family whose sparse block ``module`` is (exactly that class, not a subclass), else None."""
    cls = type(module)
    for fam in FAMILIES.values():
        if cls.__name__ == fam.block and cls.__module__ == fam.module:
            return fam
    return None


def route_kwargs(fam: Family, gate) -> dict:
    """kosmos.nn.moe's routing arguments (top_k, routing, renormalize, routed_scaling, and for sigmoid-grouped
    n_group, topk_group, bias) of router module ``gate`` of family ``fam``."""
    kw = dict(top_k=int(gate.top_k), routing=fam.routing)
    if fam.name == "mixtral":  # MixtralTopKRouter always renormalises
        kw["renormalize"] = True
    else:
        kw["renormalize"] = bool(gate.norm_topk_prob)
    if fam.routing == "sigmoid-grouped":
        kw.update(routed_scaling=float(gate.routed_scaling_factor), n_group=int(gate.num_group),
                  topk_group=int(gate.topk_group), bias=gate.e_score_correction_bias.float())
    return kw


# --------------------------------------------------------------------------- the patched forward


def _rows(hidden_states: torch.Tensor) -> torch.Tensor:
    """hidden_states [..., H] as rows [T, H], contiguous and 16-byte aligned (what the kernels read)."""
    x = hidden_states.reshape(-1, hidden_states.shape[-1])
    if not x.is_contiguous() or x.data_ptr() % 16:
        x = x.clone(memory_format=torch.contiguous_format)
    return x


_JITTER_WARNED: set = set()


def _kosmos_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A patched sparse MoE block's forward (bound to the block; the module docstring says what it computes)."""
    fam = family_of(self)
    if self.training and getattr(self, "jitter_noise", 0) > 0:  # Mixtral's router jitter: the block's own forward
        if id(self) not in _JITTER_WARNED:
            _JITTER_WARNED.add(id(self))
            warnings.warn(f"{type(self).__name__} with router_jitter_noise={self.jitter_noise} in training mode runs "
                          f"its own forward (KOSMOS does not apply the jitter)", RefusedBlockWarning, stacklevel=2)
        return type(self).forward(self, hidden_states)
    gate, experts = self.gate, self.experts
    x = _rows(hidden_states)
    if gate._forward_hooks:  # e.g. the router-logits recorder of output_router_logits: run the model's router for it
        gate(x)
    router_weight = gate.weight if gate.weight.dtype == torch.bfloat16 else gate.weight.to(torch.bfloat16)
    y = _nn.moe(x, router_weight, experts.gate_up_proj.transpose(1, 2), experts.down_proj.transpose(1, 2),
                **route_kwargs(fam, gate))
    if fam.shared == "gated":
        y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    y = y.reshape(hidden_states.shape)
    if fam.shared == "plain":
        y = y + self.shared_experts(hidden_states)
    return y


def _is_patched(block) -> bool:
    fwd = block.__dict__.get("forward")
    return isinstance(fwd, types.MethodType) and fwd.__func__ is _kosmos_forward


# --------------------------------------------------------------------------- what is refused


def _experts_kind_refusal(experts) -> str | None:
    """Why KOSMOS cannot compute what experts module ``experts`` computes (biases, no gate, the gate/up layout, the
    activation, a custom gating), or None: the checks ``refusal`` and ``experts_refusal`` share."""
    if getattr(experts, "has_bias", False) or any(getattr(experts, n, None) is not None
                                                  for n in ("gate_up_proj_bias", "down_proj_bias", "up_proj_bias")):
        return "expert biases (KOSMOS's experts have none)"
    if not getattr(experts, "has_gate", True) or getattr(experts, "gate_up_proj", None) is None:
        return "experts without a gate (no gate_up_proj): KOSMOS runs gated SwiGLU experts"
    if not getattr(experts, "is_concatenated", True):
        return "interleaved gate/up (is_concatenated=False): KOSMOS reads gate | up concatenated"
    if getattr(experts, "is_transposed", False):
        return "transposed expert layout (is_transposed=True): not covered"
    if getattr(experts, "has_post_expert_norm", False):
        return "a norm after the experts (has_post_expert_norm=True): KOSMOS's experts have none"
    if getattr(experts, "_is_expert_parallel", False):
        return "experts sharded for transformers' expert parallelism (sentinel ids): not covered"
    act = getattr(experts, "act_fn", None)
    if type(act).__name__ not in ("SiLU", "SiLUActivation"):
        hidden_act = getattr(getattr(experts, "config", None), "hidden_act", None)
        if hidden_act in (None, "silu", "swish"):  # the module's act_fn was replaced: name it
            return f"its act_fn {type(act).__name__} is not SiLU (KOSMOS's experts are SwiGLU)"
        return f"hidden_act {hidden_act!r} is not SiLU (KOSMOS's experts are SwiGLU)"
    from transformers.integrations.moe import _default_apply_gate
    if getattr(type(experts), "_apply_gate", _default_apply_gate) is not _default_apply_gate:
        return "a custom gating (_apply_gate) of its experts: KOSMOS runs silu(gate) * up"
    return None


def _hooked(module, pre_only: bool = False) -> bool:
    return bool(module._forward_pre_hooks or (not pre_only and module._forward_hooks)
                or getattr(module, "_hf_hook", None) is not None)


def refusal(block) -> str | None:
    """Why ``patch`` leaves ``block`` as it is (one line), or None if KOSMOS runs it."""
    fam = family_of(block)
    if fam is None:
        return (f"{type(block).__name__} is not a block KOSMOS runs (its router is not one KOSMOS verified; "
                f"supported: {', '.join(f.block for f in FAMILIES.values())})")
    if "forward" in block.__dict__:
        return ("already patched by kosmos" if _is_patched(block)
                else "its forward is already replaced on the instance (another tool's hook?)")
    gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
    if type(gate).__name__ != fam.router or type(gate).__module__ != fam.module:
        return f"its router is a {type(gate).__name__}, not the {fam.router} KOSMOS verified"
    if type(experts).__name__ != fam.experts or type(experts).__module__ != fam.module:
        return f"its experts are a {type(experts).__name__}, not {fam.experts}"
    why = _experts_kind_refusal(experts)
    if why is not None:
        return why
    if getattr(block, "jitter_noise", 0) > 0 and block.training:
        return (f"router_jitter_noise={block.jitter_noise} in training mode (noise on the block's input, which "
                f"KOSMOS does not apply); patch in eval mode to run KOSMOS outside training")
    params = {"router weight": gate.weight, "gate_up_proj": experts.gate_up_proj, "down_proj": experts.down_proj}
    bad = {n: p.dtype for n, p in params.items()
           if p.dtype != torch.bfloat16 and not (n == "router weight" and p.dtype == torch.float32)}
    if bad:
        return (f"parameters in {', '.join(sorted({str(d) for d in bad.values()}))} ({', '.join(bad)}): KOSMOS runs "
                f"bf16 -- cast the model to bf16 (model.to(torch.bfloat16)) before patch")
    devices = {p.device for p in params.values()}
    if any(d.type == "meta" for d in devices):
        return "parameters on the meta device (offloaded or not loaded)"
    if len(devices) > 1:
        return f"router and experts on different devices ({', '.join(sorted(map(str, devices)))})"
    if _hooked(experts):
        return "hooks on its experts module, which the KOSMOS forward does not call"
    if _hooked(gate, pre_only=True):
        return "forward pre-hooks (or an accelerate hook) on its router, which would not run"
    e, h = gate.weight.shape
    if experts.gate_up_proj.dim() != 3 or experts.gate_up_proj.shape[0] != e or experts.gate_up_proj.shape[2] != h:
        return f"gate_up_proj {tuple(experts.gate_up_proj.shape)} is not [E={e}, 2F, H={h}]"
    f = experts.gate_up_proj.shape[1] // 2
    if tuple(experts.down_proj.shape) != (e, h, f):
        return f"down_proj {tuple(experts.down_proj.shape)} is not [E, H, F] = [{e}, {h}, {f}]"
    k = int(gate.top_k)
    if e > MAX_EXPERTS:
        return f"E={e} experts > {MAX_EXPERTS} (KOSMOS's router keeps a token's logits in one tile)"
    if not 1 <= k <= min(e, MAX_TOPK):
        return f"top_k={k} is not in [1, {min(e, MAX_TOPK)}] (KOSMOS's limit)"
    if h % 8 or f % 8:
        return f"H={h} and F={f} must be multiples of 8 (TMA rows of 16 bytes)"
    if fam.routing == "sigmoid-grouped":
        n_group, topk_group = int(gate.num_group), int(gate.topk_group)
        if n_group < 1 or e % n_group or e // n_group < 2:
            return f"E={e} experts do not form n_group={n_group} groups of at least 2 (the router sums a group's top 2)"
        if not 1 <= topk_group <= n_group:
            return f"topk_group={topk_group} is not in [1, n_group={n_group}]"
        if k > topk_group * (e // n_group):
            return f"top_k={k} exceeds the {topk_group * (e // n_group)} experts of the {topk_group} groups kept"
    return None


# --------------------------------------------------------------------------- the "kosmos" experts implementation

EXPERTS_IMPLEMENTATION = "kosmos"  # its name in transformers' ExpertsInterface (register_experts)


def uses_experts_interface(experts) -> bool:
    """Whether ``experts`` is an experts module whose forward transformers dispatches through its ExpertsInterface
    (a class decorated with ``@use_experts_implementation``: its config's ``_experts_implementation`` picks the
    function)."""
    fwd = getattr(type(experts), "forward", None)
    return (isinstance(experts, torch.nn.Module) and hasattr(experts, "config") and "has_gate" in vars(experts)
            and getattr(fwd, "__wrapped__", None) is not None)


def _parallel(experts) -> bool:
    """Whether the experts module runs under a transformers tensor- or expert-parallel plan: the plan marks every
    module it installs (``_is_hooked``), shards the parameters (DTensor) and, for EP, sets ``num_experts`` to the
    rank's count while the router hands out local ids with sentinels (>= the local count) for the other ranks'."""
    if getattr(experts, "_is_hooked", False):
        return True
    params = [getattr(experts, n, None) for n in ("gate_up_proj", "down_proj")]
    if any(c.__name__ == "DTensor" for p in params for c in type(p).__mro__):
        return True
    n = getattr(experts, "num_experts", None)
    return n is not None and isinstance(params[0], torch.Tensor) and params[0].dim() == 3 and params[0].shape[0] != n


def experts_refusal(experts) -> str | None:
    """Why the "kosmos" experts implementation cannot run experts module ``experts`` (one line), or None: what
    ``refusal`` checks of a block's experts (biases, a gate, the concatenated non-transposed layout, SiLU, the
    default gating, bf16 parameters, the shapes and limits), plus no tensor- or expert-parallel plan on it
    (transformers' EP hands the experts local ids with sentinels >= E: not supported; KOSMOS runs EP = 1 here)."""
    if not isinstance(experts, torch.nn.Module):
        return f"a {type(experts).__name__} is not an experts module"
    if _parallel(experts):
        return ("a tensor- or expert-parallel plan is applied to it (transformers' EP passes local ids with "
                "sentinels >= E, which KOSMOS does not take): the kosmos experts run EP = 1")
    why = _experts_kind_refusal(experts)
    if why is not None:
        return why
    gate_up, down = experts.gate_up_proj, getattr(experts, "down_proj", None)
    if not isinstance(down, torch.Tensor) or gate_up.dim() != 3 or down.dim() != 3:
        return "gate_up_proj / down_proj are not 3-D expert tensors"
    bad = {n: p.dtype for n, p in (("gate_up_proj", gate_up), ("down_proj", down)) if p.dtype != torch.bfloat16}
    if bad:
        return (f"parameters in {', '.join(sorted({str(d) for d in bad.values()}))} ({', '.join(bad)}): KOSMOS runs "
                f"bf16 -- cast the model to bf16 (model.to(torch.bfloat16))")
    if gate_up.device.type == "meta" or down.device.type == "meta":
        return "parameters on the meta device (offloaded or not loaded)"
    e, f2, h = gate_up.shape
    f = f2 // 2
    if f2 % 2 or tuple(down.shape) != (e, h, f):
        return f"gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} are not [E, 2F, H], [E, H, F]"
    if e > MAX_EXPERTS:
        return f"E={e} experts > {MAX_EXPERTS} (KOSMOS's dispatch counts pairs per expert in {MAX_EXPERTS} slots)"
    if h % 8 or f % 8:
        return f"H={h} and F={f} must be multiples of 8 (TMA rows of 16 bytes)"
    return None


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The "kosmos" experts implementation (transformers' ExpertsInterface signature; ``self`` the experts module):
    ``kosmos.nn.moe_experts`` on hidden_states [T, H] with the given routing (top_k_index [T, k] ids in [0, E),
    top_k_weights [T, k]) and the module's own parameters -- ``gate_up_proj.transpose(1, 2)``,
    ``down_proj.transpose(1, 2)`` -- in one launch forward and one backward (gradients for hidden_states,
    top_k_weights and both parameters). Returns [T, H] bf16. What it cannot run raises ValueError in one line
    (``experts_refusal``; hidden states not bf16, k > 16); on a device other than CUDA ``kosmos.moe_forward``
    raises (the kernels need CUDA)."""
    why = experts_refusal(self)
    if why is None and hidden_states.dtype != torch.bfloat16:
        why = f"hidden states in {hidden_states.dtype}: KOSMOS runs bf16 -- cast the model to bf16"
    if why is None and not (top_k_index.dim() == 2 and 1 <= top_k_index.shape[1] <= MAX_TOPK):
        why = f"top_k_index {tuple(top_k_index.shape)} is not [T, k] with 1 <= k <= {MAX_TOPK}"
    if why is not None:
        raise ValueError(f"kosmos experts implementation: {type(self).__name__}: {why}")
    y = _nn.moe_experts(_rows(hidden_states), top_k_index, top_k_weights, self.gate_up_proj.transpose(1, 2),
                        self.down_proj.transpose(1, 2))
    return y.view(hidden_states.shape)


def register_experts() -> str:
    """Register ``experts_forward`` as the experts implementation "kosmos" in transformers' ``ExpertsInterface``
    (every model; idempotent) and return that name. A model then selects it with
    ``model.set_experts_implementation("kosmos")`` or ``from_pretrained(..., experts_implementation="kosmos")``
    (``from_config`` too), for every experts module of the model that dispatches through the interface."""
    require_transformers()
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface
    if ALL_EXPERTS_FUNCTIONS.get(EXPERTS_IMPLEMENTATION) is not experts_forward:
        ExpertsInterface.register(EXPERTS_IMPLEMENTATION, experts_forward)
    return EXPERTS_IMPLEMENTATION


def _holds_3d_experts(module) -> bool:
    experts = getattr(module, "experts", None)
    down = getattr(experts, "down_proj", None) if isinstance(experts, torch.nn.Module) else None
    return isinstance(down, torch.Tensor) and down.dim() == 3


def moe_blocks(model) -> list:
    """[(name, module)] of the sparse MoE blocks of ``model`` in ``named_modules`` order: a block of a known family,
    or any module whose ``experts`` module holds 3-D expert parameters (``down_proj``; such a block of another
    class is refused, not skipped)."""
    return [(name, module) for name, module in model.named_modules()
            if family_of(module) is not None or _holds_3d_experts(module)]


# --------------------------------------------------------------------------- patch / unpatch


@dataclass
class Patched:
    """What ``patch`` did: ``blocks`` {name: block} that now run KOSMOS, ``originals`` {name: the block's forward
    before} and ``refused`` {name: reason} (left as they were); with ``patch(model, experts=True)`` also
    ``experts`` {name: the block's experts module} of the blocks whose experts now run the "kosmos" experts
    implementation (their router stays the model's), and ``experts_before`` the model's experts implementation
    before (``model.get_experts_implementation()``; None: not changed). ``unpatch()`` gives every patched block
    its own forward back and the model its experts implementation (repeatable); a ``with patch(model):`` block
    unpatches at its end."""
    blocks: dict = field(default_factory=dict)
    originals: dict = field(default_factory=dict)
    refused: dict = field(default_factory=dict)
    experts: dict = field(default_factory=dict)
    experts_before: dict | None = None
    model: object = field(default=None, repr=False)

    def unpatch(self) -> None:
        for block in self.blocks.values():
            if _is_patched(block):
                del block.__dict__["forward"]
        if self.experts_before is not None:
            self.model.set_experts_implementation(self.experts_before)
            self.experts_before = None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()

    def __str__(self) -> str:
        lines = [f"kosmos: {len(self.blocks)} sparse MoE block(s) patched"
                 + (f", {len(self.experts)} on the kosmos experts implementation" if self.experts else "")
                 + f", {len(self.refused)} refused"]
        lines += [f"  {name}: {reason}" for name, reason in self.refused.items()]
        return "\n".join(lines)


def _experts_served(model, found, refused: dict) -> dict:
    """patch(experts=True)'s plan (nothing changed yet): the refused blocks whose experts module dispatches through
    transformers' ExpertsInterface and passes ``experts_refusal`` -- {name: experts module} -- when every such block's
    experts can run "kosmos" (the setting is model-wide), and those names taken out of ``refused``; otherwise {}, the
    reason added to each such block's refusal."""
    cand = [(n, b) for n, b in found if n in refused and not _is_patched(b)
            and uses_experts_interface(getattr(b, "experts", None))]
    if not cand:
        return {}
    if not hasattr(model, "set_experts_implementation"):
        for n, _ in cand:
            refused[n] += f"; not a transformers model ({type(model).__name__}): its experts implementation is not set"
        return {}
    bad = {n: why for n, b in cand if (why := experts_refusal(b.experts))}
    if bad:
        for n, _ in cand:
            refused[n] += (f"; nor can its experts run the kosmos experts implementation: {bad[n]}" if n in bad else
                           "; its experts could run the kosmos experts implementation, but not every such block's "
                           "can (the setting is model-wide)")
        return {}
    for n, _ in cand:
        del refused[n]
    return {n: b.experts for n, b in cand}


def patch(model, *, strict: bool = False, experts: bool = False) -> Patched:
    """Run every sparse MoE block of transformers model ``model`` that KOSMOS can run on ``kosmos.nn.moe`` (the
    module docstring: what it computes, which blocks, the refusals). Returns the ``Patched`` record. A refused
    block is left as it was, with a ``RefusedBlockWarning`` naming it and the reason; ``strict=True`` raises one
    ValueError naming every refused block (or saying there is no block) and patches nothing.

    ``experts=True``: a block refused as a whole (a router KOSMOS does not run, hooks, ...) whose experts module
    dispatches through transformers' ExpertsInterface runs its experts on the "kosmos" experts implementation
    instead (``register_experts``; ``model.set_experts_implementation("kosmos")``, model-wide: only when every
    such block's experts pass ``experts_refusal``), its router and the rest of the block staying the model's; such
    blocks are listed in ``Patched.experts``, not refused, and ``unpatch`` restores the model's implementation."""
    require_transformers()
    found = moe_blocks(model)
    refused = {name: why for name, block in found if (why := refusal(block))}
    served = _experts_served(model, found, refused) if experts else {}
    label = {name: f"{name or '(model)'} ({type(block).__name__})" for name, block in found}
    if strict and (refused or not found):
        what = "; ".join(f"{label[n]}: {why}" for n, why in refused.items()) or \
            f"no sparse MoE block in this {type(model).__name__}"
        raise ValueError(f"kosmos patch(strict=True): {len(refused)} of {len(found)} sparse MoE block(s) refused, "
                         f"nothing patched -- {what}" if found else f"kosmos patch(strict=True): {what}")
    out = Patched(refused=refused, experts=served, model=model)
    if served:
        register_experts()
        out.experts_before = model.get_experts_implementation()
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    for name, block in found:
        if name in served:  # its block as it was, its experts on "kosmos"
            continue
        if name in refused:
            warnings.warn(f"kosmos: {label[name]} left as it was: {refused[name]}", RefusedBlockWarning, stacklevel=2)
            continue
        out.originals[name] = block.forward
        block.forward = types.MethodType(_kosmos_forward, block)
        out.blocks[name] = block
    if not found:
        warnings.warn(f"kosmos: no sparse MoE block in this {type(model).__name__}; nothing patched",
                      RefusedBlockWarning, stacklevel=2)
    return out
