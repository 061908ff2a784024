"""The MoE benchmark (``kosmos bench moe``): a proxy of one model's MoE layer -- its hidden size, expert FFN
size, number of experts, top-k and routing (``kosmos.models.MOE_MODELS``), experts split evenly over the EP
ranks -- run by every implementation on the same inputs, checked against the fp32 reference, then timed side
by side in the collective-safe loop of ``timing.py``. Runs inside one process per rank (``launcher.spawn``),
like the TP benchmark, through the same harness (harness.py: check -> agree across ranks -> time -> row; a
failing implementation is recorded and the sweep goes on); rows are JSON lines after an env line (SCHEMA.md).

Implementations of the layer (registry family "moe_fwd"; y [T, H] bf16 from x [T, H] bf16 of this rank):
  kosmos           kosmos.moe_forward(..., policy="self", config=the moe_fwd config of ``--config``): the
                   one-launch fused layer.
  nccl-a2a         kosmos.moe_reference.moe_forward_a2a(fp32=False): Megatron's all-to-all dispatcher with
                   torch._grouped_mm (the baseline of the speedup column).
  deepep           DeepEP V1's intranode Buffer dispatch/combine around the same grouped GEMMs, at DeepEP's own
                   recommended configs and SM count (``deepep_callable``); "unavailable" when ``import deep_ep``
                   fails, at W not 2, 4 or 8, or for shapes its kernels refuse. Written against the sources of the
                   wheel in ../shared/wheels (commit 567632d) and run on the CPU against a stand-in Buffer; not yet
                   run on a GPU (tests/test_deepep.py, ``dev/archive/x1_session.sh deepep``).
  fixed-role       kosmos.moe_forward(..., policy="fixed", comm_programs=S) at S = 16.
  fixed-role-best  the same at the best S of ``fixed_sweep`` (the tuned oracle a fixed-role library needs;
                   harness.best_fixed_split, shared with the TP bench).
  hf-grouped-mm    transformers' own layer (moe_hf.py): the model's transformers family's router module, then its
                   experts module through ExpertsInterface "grouped_mm" (transformers' default on a GPU), on the
                   same x, router weight and bias, the experts in transformers' layout (w13 / w2 transposed, copied
                   once, untimed); no shared experts (kosmos has none either). EP = 1 and bf16 only, every direction
                   (the backward by autograd, ``autograd_backward``); its output checked against the fp32 layer for
                   its own routing decision (``hf_forward_reference``: transformers' Qwen / Mixtral routers round the
                   logits to bf16). "unavailable" without transformers >= 5.13, at W > 1, at mxfp8, and where the
                   point's memory estimate (``hf_check_bytes``) exceeds the GPU (``hf_memory_problem``).
  hf-eager         the same with experts implementation "eager": the experts class's own loop over the experts.
  liger            Liger-Kernel's fused MoE (moe_liger.py): the point's router (``route``, torch), then Liger's
                   LigerFusedMoEFunction on that decision, its weights in transformers' layout (copied once,
                   untimed); EP = 1 and bf16, every direction (its autograd); "unavailable" without liger_kernel,
                   CUDA, at W > 1, at mxfp8, or past ``liger_check_bytes``. Not in the suites: ``--impl liger``.
Precisions (``--dtype bf16,mxfp8``: every point runs at each, bf16 first; each row's ``dtype`` says which). At
mxfp8 every implementation starts from the same bf16 x; the experts' weights' MX values (``quant.mx_values``,
blocks along H for W13, along F for W2) are made once, outside the timed call, like a cached weight:
  kosmos           kosmos.moe_forward(x, ..., w13_mx, w2_mx, precision="mxfp8"): the op quantizes x inside the call;
                   fixed-role and fixed-role-best the same with policy "fixed". A kosmos without ``precision``
                   gives a failed row (TypeError) and the sweep goes on.
  nccl-a2a         moe_mx.moe_forward_a2a_mx(fp32=False): quantize x, all-to-all of the payload (as uint8) and the
                   scales, dequantize, torch._grouped_mm with the MX weight values, SwiGLU, h -> its MX values,
                   GEMM2, bf16 combine, fold (moe_mx.py's docstring).
  deepep           unavailable ("no MXFP8 path in the deepep baseline yet").
  The expert GEMMs alone (moe_experts) have no rows at mxfp8; the moe_fwd rows' t_gemm_ms is grouped-mm at bf16
  on the same rows at both dtypes (timed without a row at mxfp8).
The check at mxfp8 (harness.Reference): the MX layer's fp32 math (moe_reference's ``mx=True``, distributed:
moe_mx.moe_forward_a2a_mx(fp32=True)) within TOLERANCE["mxfp8"] (1e-2); nccl-a2a against the same with GEMM1's
output rounded to bf16 (its own rounding; row ``note``). Every mxfp8 row also records ``rel_err_bf16`` (against the
bf16 layer's fp32 reference). Every moe_fwd row records ``wire_bytes`` (moe_mx.wire_bytes: dispatch payload +
scales at mxfp8, H*(1 + 1/32) bytes a row, and the bf16 combine, 2H; SCHEMA.md).
Expert GEMMs alone (family and op ``moe_experts``, on exactly the per-local-expert row counts this rank
receives):
  grouped-mm           torch._grouped_mm x2 with the SwiGLU between (moe_reference._experts_forward, the GEMMs
                       of nccl-a2a); its time is the t_gemm_ms of the moe_fwd rows.
  kosmos-expert-gemms  kosmos.ops.moe_forward.expert_gemms: the fused kernel's GEMM1+SwiGLU+GEMM2 alone
                       (with the moe_fwd config).
  The issue's bar: kosmos-expert-gemms reaches >= 80% of grouped-mm's TFLOP/s (report: speedup >= 0.8).
  At bwd (bf16; not at fwd+bwd) the same two on the same rows, with a fresh output gradient dy [R, H] ~ N(0, 1)
  and gate weights w [R] ~ U(0, 1) per row: grouped-mm is autograd through its forward (graph built once,
  outside the timed call, and kept) for do = w * dy -- dgrad2, wgrad2, the SwiGLU backward, dgrad1, wgrad1;
  kosmos-expert-gemms is moe_backward's expert part (kernels.moe_backward.expert_backward_gemms: the same four
  GEMMs with the SwiGLU backward and the gate gradient in dgrad2's epilogue) on its padded row layout and the
  forward's g | u, both made outside the timed call (expert_backward_operands). Checked (expert_backward_reference)
  against fp32 formulas: dx_rows, dw13, dw2 (rel_err_grads). FLOPs 2x the forward's; grouped-mm's time is the
  t_gemm_ms of the bwd moe_fwd rows.

Directions (``--direction fwd,bwd,fwd+bwd``, suite key ``direction``: every point in each, after each dtype; each
row's ``direction`` says which; rows without it are fwd):
  fwd      the forward, as above.
  bwd      the backward alone: each timed call is a ``timing.Split`` -- the forward runs untimed before the L2 flush
           and the barrier (collective-safe: every rank runs it in step), then only the backward is timed.
           kosmos: ``moe_forward(..., return_routing=True)`` untimed (at W = 1 with ``save_gu=True``, as
           kosmos.nn.MoE trains: GEMM1's g | u kept), then on its decision
           ``kosmos.kernels.moe_backward.moe_backward_w1`` (W = 1, on the saved g | u) or ``moe_backward`` over
           the EP group (W > 1: its one launch, GEMM1 recomputed inside it, the exchanges as stages) timed.
           nccl-a2a: autograd through ``moe_forward_a2a(fp32=False)`` with x and the parameters requiring grad
           (torch._grouped_mm has a derivative; the row exchanges are moe_reference.AllToAllRows at W > 1), the
           forward (its graph) untimed, ``torch.autograd.grad`` timed. At mxfp8 (every W): kosmos
           ``moe_forward(precision="mxfp8", return_routing=True)`` untimed, then ``moe_backward(precision="mxfp8")``
           (the MX backward: the multi-launch path, every backward GEMM on MX operands along its own K;
           kosmos/ops/moe_backward/mx.py) with the experts' four MX copies (MoEMXWeights) made once outside the
           timed call; nccl-a2a autograd through ``moe_mx.moe_forward_a2a_mx_train(fp32=False)`` -- the same MX
           rounding rules as autograd Functions around its grouped GEMMs, bf16 rows on the wire, the same MX
           copies. deepep: the same autograd timing through its layer (``deepep_layer``: DeepEP's dispatch and
           combine as autograd Functions -- dispatch's backward a combine of the gradient, combine's a cached
           dispatch -- around nccl-a2a's expert GEMMs); bf16 only, and as in the forward at W 2, 4 or 8 only. fixed-role, fixed-role-best (W > 1, bf16; at W = 1 "unavailable": no
           communication): the forward at policy "fixed" untimed, then ``moe_backward(..., one_launch=True,
           policy="fixed", comm_programs=S)`` timed -- the backward's ONE launch with its exchanges as stages and its
           fixed-role split (programs < S: COMBINE-BWD, PERMUTE-BWD, DISPATCH-BWD, UNPERMUTE; the rest: the GEMMs,
           SwiGLU, wgrads and router stages; kernels/moe_backward.py's "The one launch at W > 1"), at S = 16 /
           the best S of fixed_sweep as in the forward. The kosmos row at W > 1 runs the same launch with the self
           policy (moe_backward's default there, ONE_LAUNCH_EP), so the two rows are the two policies of one launch.
           The output gradient dy ~ N(0, 1) bf16, this rank's.
  fwd+bwd  both in one timed call.
  Checked (``grad_reference``): dx, d_router, dw13 and dw2 each against an fp32 reference, relative Frobenius
  error; the row's rel_err is the largest (tolerance GRAD_TOLERANCE, 3e-2: bf16 through several GEMMs; at mxfp8
  GRAD_TOLERANCE_MX against the MX layer's fp32 math, ``moe_backward_ref(mx=True)`` / at W > 1 autograd through
  ``moe_forward_a2a_mx_train(fp32=True)``), each in ``rel_err_grads``. W = 1: ``moe_reference.moe_backward_ref``
  (explicit formulas) for the implementation's own routing decision (nccl-a2a: ``route`` on the same inputs, the
  call moe_forward_a2a makes), a chunk of experts at a time, each chunk's weight gradients compared as they come
  (memory: grad_reference). W > 1: autograd
  through ``moe_forward_a2a(fp32=True)`` over the group on fp32 copies of the inputs, for the decision of
  ``route`` (fp32 logits), computed once per point before any implementation runs (it is collective: inside an
  implementation's check a failing rank would leave its peers waiting); an implementation whose decision differs
  fails with that reason (the inputs are redrawn away from routing ties, so a correct one agrees). What it
  gives per rank: dx of this rank's tokens, d_router from this rank's tokens (replicated: to be all-reduced, as
  moe_backward returns it), dw13 / dw2 of this rank's experts from every rank's tokens. FLOPs: 2x the forward's at bwd, 3x at fwd+bwd. t_comm_ms is the
  forward's only (null at bwd, fwd+bwd); t_gemm_ms at bwd is grouped-mm's backward expert GEMMs (the moe_experts
  bwd rows), null at fwd+bwd.

Inputs (``make_router_inputs``, ``make_expert_weights``): x ~ N(0, 1) bf16 (different on every rank), router
weight ~ N(0, 1/H) bf16 (logits ~ N(0, 1), replicated), w13 ~ N(0, 1/H), w2 ~ N(0, 1/F) bf16 (each rank its own
experts); DeepSeek-V3's score-correction bias ~ N(0, 0.002^2), rounded to bf16 values, passed as fp32 [E] (it moves
some choices but keeps "uniform" near-uniform: max/mean expert load 1.4 vs 1.3 from sampling alone, 2k tokens).
  uniform  nothing else: every expert is equally popular in expectation (random inputs and router, as in
           DeepEP's tests -- which draw random scores -- but through the op's own router).
  zipf:S   skewed popularity through a constant input feature: x[:, 0] = c (c = 1) and router_weight[e, 0] =
           offset_e / c with offset_e = -S * ln(rank_e), where rank_e in 1..E is expert e's popularity rank
           from a seeded permutation (so the popular experts are spread over the EP ranks). The op's own router
           then sees logit_e + offset_e: for softmax routing p_e is multiplied by rank_e^-S (Zipf with exponent
           S); for sigmoid routing the popular experts' scores rise the same way. S > 0.
Well-separated routing: two correct implementations can disagree on an expert choice when a token's k-th and
(k+1)-th candidates are closer than their rounding difference (router logits are fp32 everywhere, but summed in
different orders: ~1e-6 apart). Such a flip changes that token's output completely, so the generator redraws
every token whose routing margin (``routing_margin``: the gap at the top-k boundary, and for group-limited
routing also at the top-groups boundary, computed in fp64 on the actual bf16 inputs) is below
ROUTING_MARGIN (1e-3 in logit units for softmax, 0.25e-3 in sigmoid-score units, i.e. >= 250x the rounding
difference). About 1-3% of tokens are redrawn (``redrawn_tokens`` in each row's extra); the comparison then
covers every token with the strict tolerance (bf16: relative Frobenius error <= 1e-2; NaN never passes).

FLOPs: a rank's tokens make T*k (token, expert) pairs, each 2*H*2F (GEMM1) + 2*F*H (GEMM2) = 6*H*F, so
tflops = 6*T*k*H*F / time per GPU for moe_fwd. For moe_experts, 6*R*H*F / time with R the largest number of rows
any rank received (the time is the slowest rank's, normally the busiest).
"""
from __future__ import annotations

import gc
import importlib
import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

import kosmos
from kosmos import moe_forward
from kosmos.core import runtime
from kosmos.config import MoEBackwardConfig, config_dict
from kosmos.ops.moe_backward.multi_launch import expert_backward_gemms
from kosmos.ops.moe_backward.api import expert_backward_operands, moe_backward, moe_backward_w1  # (moe_backward_w1: one rank)
from kosmos.ops.moe_backward.mx import MoEMXWeights, moe_mx_weights
from kosmos.ops.moe_forward import expert_gemms
from kosmos.models import MOE_MODELS, MoEModel, UnknownModelError
from kosmos.reference.moe import _experts_forward, moe_backward_ref, moe_forward_a2a, route
from kosmos.reference import FrobeniusError

from . import harness, moe_hf, moe_liger, moe_mx, registry, timing
from .harness import Settings, policy_kwargs, world_info
from .registry import names, register

MX = "mxfp8"
MOE_DTYPES = ("bf16", MX)
FWD, BWD, FWD_BWD = "fwd", "bwd", "fwd+bwd"
DIRECTIONS = (FWD, BWD, FWD_BWD)  # --direction: what is timed (module docstring)
GRADS = ("dx", "d_router", "dw13", "dw2")  # the backward's outputs, in moe_backward_w1's order
GRAD_TOLERANCE = 3e-2  # bf16 gradients through several GEMMs (dgrad2, SwiGLU backward, dgrad1, wgrads)
# mxfp8 gradients against the MX layer's fp32 math: every GEMM operand MX-rounded from bf16 intermediates (g | u, z,
# [dg | du], h), so a bf16-level difference there moves a whole MX quantum now and then (measured on the CPU, tiny
# shapes: kosmos 0.5-1.4e-2, nccl-a2a's MX autograd 0.3-2e-2); below the MX-vs-bf16 gap (0.05-0.1), so a bf16
# backward passed off as MX fails
GRAD_TOLERANCE_MX = 5e-2
# the FLOPs of each direction in units of the forward's expert GEMMs (6*T*k*H*F): the backward is a data and a
# weight gradient per GEMM (the kosmos backward's GEMM1 recompute is not counted: not useful work)
DIRECTION_FLOPS = {FWD: 1.0, BWD: 2.0, FWD_BWD: 3.0}

ROUTING_MARGIN = 1e-3       # logit units; sigmoid scores use SIGMOID_SLOPE_MAX * ROUTING_MARGIN
SIGMOID_SLOPE_MAX = 0.25
SOFTMAX_UNDERFLOW = 80.0    # logits this far below a token's top one have fp32 probability ~0 (ties)
MAX_REDRAW_ROUNDS = 30
ZIPF_FEATURE = 1.0          # c: the constant input feature x[:, 0] of zipf routing
BIAS_STD = 0.002            # DeepSeek-V3 score-correction bias (sigmoid-grouped); larger skews "uniform"


# --------------------------------------------------------------------------- models, routing specs, cases


def moe_model(name: str) -> MoEModel:
    try:
        return MOE_MODELS[name]
    except KeyError:
        raise UnknownModelError(f"unknown MoE model {name!r}; known: {', '.join(MOE_MODELS)}") from None


@dataclass(frozen=True)
class RoutingSpec:
    kind: str               # "uniform" | "zipf"
    s: float | None = None  # zipf exponent

    def __str__(self) -> str:
        return self.kind if self.kind == "uniform" else f"zipf:{self.s:g}"


def parse_routing(text) -> RoutingSpec:
    """'uniform' or 'zipf:S' (S > 0, finite) -> RoutingSpec; ValueError with the accepted forms otherwise."""
    if not isinstance(text, str):
        raise ValueError(f"routing must be a string like 'uniform' or 'zipf:1.2', got {text!r}")
    t = text.strip().lower()
    if t == "uniform":
        return RoutingSpec("uniform")
    if t == "zipf" or t.startswith("zipf:"):
        _, _, arg = t.partition(":")
        if not arg:
            raise ValueError(f"routing {text!r}: zipf needs an exponent, e.g. 'zipf:1.2'")
        try:
            s = float(arg)
        except ValueError:
            raise ValueError(f"routing {text!r}: the zipf exponent {arg!r} is not a number; use e.g. 'zipf:1.2'") \
                from None
        if not math.isfinite(s) or s <= 0:
            raise ValueError(f"routing {text!r}: the zipf exponent must be a finite number > 0")
        return RoutingSpec("zipf", s)
    raise ValueError(f"unknown routing {text!r}; use 'uniform' or 'zipf:S' with S > 0 (e.g. 'zipf:1.2')")


@dataclass(frozen=True)
class MoECase:
    model: str
    tokens: int   # per rank
    routing: str  # canonical RoutingSpec string
    custom: dict | None = None  # a custom model's MoEModel fields (kosmos.models.custom_moe_model); None: named


def case_model(case: MoECase) -> MoEModel:
    """The MoEModel of ``case``: its custom fields, else the named model."""
    return MoEModel(**case.custom) if case.custom else moe_model(case.model)


def moe_cases(models, tokens, routings, ep: int) -> list[MoECase]:
    """Every (model, tokens, routing) point; ``models`` are names or MoEModel objects (a custom model: its fields
    travel with each case); ``tokens`` a list for every model or a mapping {model name: list} (a suite's per-model
    tokens). ValueError if a model's experts do not split evenly over ep, or the mapping has no tokens for it."""
    out = []
    for model in models:
        m = model if isinstance(model, MoEModel) else moe_model(model)
        custom = asdict(m) if isinstance(model, MoEModel) else None
        if ep < 1 or m.experts % ep:
            raise ValueError(f"{m.name} has {m.experts} experts: they do not split evenly over --ep {ep}")
        if isinstance(tokens, dict) and m.name not in tokens:
            raise ValueError(f"no tokens for {m.name}: the suite gives them per model ({', '.join(tokens)}); "
                             f"pass --tokens")
        for t in (tokens[m.name] if isinstance(tokens, dict) else tokens):
            if not isinstance(t, int) or t <= 0:
                raise ValueError(f"tokens must be positive integers, got {t!r}")
            for r in routings:
                out.append(MoECase(m.name, t, str(parse_routing(r)), custom))
    return out


def route_kwargs(m: MoEModel, bias) -> dict:
    """Routing keyword arguments of ``route`` / ``moe_forward`` for model ``m`` (without top_k)."""
    return dict(routing=m.routing, renormalize=m.renormalize, bias=bias, n_group=m.n_group,
                topk_group=m.topk_group, routed_scaling=m.routed_scaling)


# --------------------------------------------------------------------------- inputs


def routing_margin(x, router_weight, m: MoEModel, bias=None):
    """Per token [T] fp64: how far its expert choice is from flipping, in the units the choice is made in
    (softmax: logits; sigmoid-grouped: score + bias, divided by SIGMOID_SLOPE_MAX so that both compare with
    ROUTING_MARGIN). Softmax: gap between the k-th and (k+1)-th logit. Sigmoid-grouped: the smaller of the gap
    between the topk_group-th and next group score and the gap between the k-th and (k+1)-th candidate of the
    kept groups. Computed in fp64 on the given (bf16) tensors: the exact router of those inputs. A softmax
    token whose k-th logit is > SOFTMAX_UNDERFLOW below its top one gets margin 0 (fp32 probabilities tie)."""
    k, n_exp = m.top_k, m.experts
    logits = x.double() @ router_weight.double().t()
    inf = torch.full((x.shape[0],), math.inf, dtype=torch.float64, device=x.device)
    if m.routing == "softmax":
        if k >= n_exp:
            return inf
        top = logits.topk(k + 1, dim=-1).values
        margin = top[:, k - 1] - top[:, k]
        # fp32 softmax underflows to 0 below ~exp(-87): a k-th choice that far below the top one ties with
        # every other underflowed expert in the probabilities (whatever its logit margin)
        return margin.masked_fill(top[:, 0] - top[:, k - 1] > SOFTMAX_UNDERFLOW, 0.0)
    choice = torch.sigmoid(logits) + (bias.double() if bias is not None else 0.0)
    per_group = n_exp // m.n_group
    group_score = choice.view(-1, m.n_group, per_group).topk(min(2, per_group), dim=-1).values.sum(-1)
    margin = inf.clone()
    if m.topk_group < m.n_group:
        g = group_score.topk(m.topk_group + 1, dim=-1).values
        margin = torch.minimum(margin, g[:, m.topk_group - 1] - g[:, m.topk_group])
    keep = torch.zeros_like(group_score, dtype=torch.bool)
    keep.scatter_(1, group_score.topk(m.topk_group, dim=-1).indices, True)
    masked = choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), -math.inf)
    if k < m.topk_group * per_group:
        c = masked.topk(k + 1, dim=-1).values
        margin = torch.minimum(margin, c[:, k - 1] - c[:, k])
    return margin / SIGMOID_SLOPE_MAX


def zipf_offsets(n_experts: int, s: float, gen) -> torch.Tensor:
    """fp32 [E]: offset_e = -s * ln(rank_e), rank_e = 1 + position of e in a seeded permutation."""
    perm = torch.randperm(n_experts, generator=gen, device=gen.device)
    rank = torch.empty(n_experts, dtype=torch.float32, device=gen.device)
    rank[perm] = torch.arange(1, n_experts + 1, dtype=torch.float32, device=gen.device)
    return -s * torch.log(rank)


def _gen(device, seed: int):
    return torch.Generator(device=device).manual_seed(seed)


def make_router_inputs(m: MoEModel, tokens: int, routing, rank: int, seed: int, device="cpu"):
    """(x [T, H] bf16 this rank's, router_weight [E, H] bf16 replicated, bias fp32 [E] or None, redrawn) for
    ``routing`` ('uniform' | 'zipf:S' | RoutingSpec). Deterministic per (seed, rank); the router weight, bias
    and popularity permutation depend on the seed only (the same on every rank). Every token's routing margin
    is >= ROUTING_MARGIN (fragile tokens are redrawn; ``redrawn`` counts them)."""
    spec = routing if isinstance(routing, RoutingSpec) else parse_routing(routing)
    device = torch.device(device)
    shared = _gen(device, 1_000_003 * seed + 17)
    wr = torch.randn(m.experts, m.hidden, generator=shared, device=device) / math.sqrt(m.hidden)
    bias = None
    if m.routing == "sigmoid-grouped":
        bias = (torch.randn(m.experts, generator=shared, device=device) * BIAS_STD).to(torch.bfloat16).float()
    if spec.kind == "zipf":
        wr[:, 0] = zipf_offsets(m.experts, spec.s, shared) / ZIPF_FEATURE
    wr = wr.to(torch.bfloat16)
    own = _gen(device, 1_000_003 * seed + 7919 * (rank + 1) + tokens)

    def draw(n):
        rows = torch.randn(n, m.hidden, generator=own, device=device, dtype=torch.bfloat16)
        if spec.kind == "zipf":
            rows[:, 0] = ZIPF_FEATURE
        return rows

    x = draw(tokens)
    redrawn = 0
    for _ in range(MAX_REDRAW_ROUNDS):
        bad = (routing_margin(x, wr, m, bias) < ROUTING_MARGIN).nonzero(as_tuple=True)[0]
        if bad.numel() == 0:
            return x, wr, bias, redrawn
        redrawn += bad.numel()
        x[bad] = draw(bad.numel())
    raise ValueError(f"{m.name} routing {spec}: {bad.numel()} of {tokens} tokens still have a routing margin "
                     f"< {ROUTING_MARGIN:g} after {MAX_REDRAW_ROUNDS} redraws (ties in the router: a zipf exponent "
                     f"this large saturates it); use a smaller S")


def make_expert_weights(m: MoEModel, world: int, rank: int, seed: int, device="cpu"):
    """This rank's experts (global experts rank*E/W .. (rank+1)*E/W - 1): w13 [E/W, H, 2F] (gate | up) and
    w2 [E/W, F, H], bf16, drawn directly in bf16 (no fp32 temporaries of the full weights)."""
    local = m.experts // world
    gen = _gen(torch.device(device), 1_000_003 * seed + 104_729 * (rank + 1) + 5)
    w13 = torch.randn(local, m.hidden, 2 * m.expert_ffn, generator=gen, device=device, dtype=torch.bfloat16)
    w13.mul_(1 / math.sqrt(m.hidden))
    w2 = torch.randn(local, m.expert_ffn, m.hidden, generator=gen, device=device, dtype=torch.bfloat16)
    w2.mul_(1 / math.sqrt(m.expert_ffn))
    return w13, w2


def expert_load(experts, n_experts: int):
    """int64 [E]: how many (token, slot) pairs chose each expert."""
    return torch.bincount(experts.reshape(-1), minlength=n_experts)


# --------------------------------------------------------------------------- implementations


@dataclass
class MoEInputs:
    model: MoEModel
    x: torch.Tensor
    router_weight: torch.Tensor
    bias: torch.Tensor | None
    w13: torch.Tensor
    w2: torch.Tensor
    dtype: str = "bf16"
    w13_mx: torch.Tensor | None = None  # mxfp8: the expert weights' MX values (moe_mx.mx_expert_weights), made once
    w2_mx: torch.Tensor | None = None
    direction: str = FWD
    dy: torch.Tensor | None = None  # bwd, fwd+bwd: the output gradient [T, H] bf16 (N(0, 1), this rank's)
    bwd_config: MoEBackwardConfig | None = None  # bwd, fwd+bwd: the kosmos backward's (``--config moe_bwd.*``)
    mx_weights: MoEMXWeights | None = None  # mxfp8 bwd, fwd+bwd: the experts' four MX copies, made once

    def route_kw(self) -> dict:
        return route_kwargs(self.model, self.bias)

    def backward_kw(self) -> dict:
        """moe_backward_w1's routing arguments and its config."""
        m = self.model
        return dict(routing=m.routing, renormalize=m.renormalize, routed_scaling=m.routed_scaling,
                    config=self.bwd_config)


@dataclass
class ExpertInputs:
    """The expert GEMMs' inputs: rows sorted by local expert [R, H], rows per local expert (int32), weights; at
    bwd also each row's output gradient dy_sorted [R, H] bf16 and gate weight w_sorted [R] fp32."""
    x_sorted: torch.Tensor
    counts: torch.Tensor
    w13: torch.Tensor
    w2: torch.Tensor
    direction: str = FWD
    dy_sorted: torch.Tensor | None = None
    w_sorted: torch.Tensor | None = None


# each maker: (inputs, params, config or None) -> (callable returning y of this rank, workspace bytes or None)


def _kosmos_backward_available(world: int, dtype) -> tuple[bool, str | None]:
    return True, None


def _a2a_backward_available(world: int, dtype) -> tuple[bool, str | None]:
    return True, None


KOSMOS_DIRECTIONS = {FWD: None, BWD: _kosmos_backward_available, FWD_BWD: _kosmos_backward_available}
A2A_DIRECTIONS = {FWD: None, BWD: _a2a_backward_available, FWD_BWD: _a2a_backward_available}
def _fixed_backward_available(world: int, dtype) -> tuple[bool, str | None]:
    """fixed-role / fixed-role-best at bwd, fwd+bwd: at W > 1 where the kosmos backward runs (bf16: the one launch's
    fixed-role split, moe_backward(one_launch=True, policy="fixed")); at W = 1 never -- no communication to give
    programs to (the forward's reason, harness.needs_peers)."""
    ok, reason = harness.needs_peers(world)
    if not ok:
        return False, reason
    if dtype == MX:
        return False, "the MXFP8 backward runs on the multi-launch path: no fixed-role split"
    return _kosmos_backward_available(world, dtype)


FIXED_DIRECTIONS = {FWD: None, BWD: _fixed_backward_available, FWD_BWD: _fixed_backward_available}


# each maker: (inputs, params, config or None) -> (callable returning y of this rank, workspace bytes or None);
# at bwd the callable is a timing.Split (the forward untimed, the backward timed) and at fwd+bwd a plain callable,
# both returning (dx, d_router, dw13, dw2, experts): the gradients and the routing decision they are for


@register("moe_fwd", "kosmos", kosmos=True, directions=KOSMOS_DIRECTIONS)
def _kosmos_layer(inp: MoEInputs, params: dict, config):
    if inp.direction != FWD:
        return _kosmos_backward(inp, params, config), None
    if inp.dtype == MX:  # x in bf16 (the op quantizes it inside the call), the weights' MX values made once
        return (lambda: moe_forward(inp.x, inp.router_weight, inp.w13_mx, inp.w2_mx, top_k=inp.model.top_k,
                                    **inp.route_kw(), group=None, config=config, precision=MX,
                                    **policy_kwargs(params))), None
    return (lambda: moe_forward(inp.x, inp.router_weight, inp.w13, inp.w2, top_k=inp.model.top_k, **inp.route_kw(),
                                group=None, config=config, **policy_kwargs(params))), None


def _kosmos_backward(inp: MoEInputs, params: dict, config):
    """bwd: moe_forward(return_routing=True) untimed, moe_backward_w1 (W = 1) or moe_backward over the default
    group (W > 1) on its decision timed; fwd+bwd: both. fixed-role / fixed-role-best (``params`` with
    comm_programs S; W > 1 only): the forward at policy "fixed", S as in the fwd rows, and the backward's one launch
    with its fixed-role split at the same S (moe_backward(one_launch=True, policy="fixed", comm_programs=S))."""
    multi = dist.is_initialized() and dist.get_world_size() > 1
    mx = inp.dtype == MX
    save = not multi and not mx  # as kosmos.nn.MoE trains by default: g | u kept from the forward at one rank
    fixed = params.get("comm_programs") is not None
    bwd_kw = dict(one_launch=True, **policy_kwargs(params)) if fixed else {}
    if mx:  # the MX layer (nn.MoE(dtype="mxfp8")): the forward on the MX copies, the MX backward (multi-launch)
        return _kosmos_backward_mx(inp, params, config)

    def forward():
        out = moe_forward(inp.x, inp.router_weight, inp.w13, inp.w2, top_k=inp.model.top_k, **inp.route_kw(),
                          group=None, config=config, return_routing=True, save_gu=save, **policy_kwargs(params))
        return out[1], out[2], (out[3] if save else None)

    def backward(state):
        weights, experts, saved = state
        grads = (moe_backward if multi else moe_backward_w1)(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy,
                                                             weights, experts, saved_gu=saved,
                                                             **inp.backward_kw(), **bwd_kw)
        return (*grads, experts)

    return timing.Split(forward, backward) if inp.direction == BWD else (lambda: backward(forward()))


def _kosmos_backward_mx(inp: MoEInputs, params: dict, config):
    """mxfp8 bwd / fwd+bwd: moe_forward(precision="mxfp8", return_routing=True) on the forward's MX copies untimed
    (bwd), then moe_backward(precision="mxfp8", mx_weights=the four copies) over the default group timed."""
    def forward():
        out = moe_forward(inp.x, inp.router_weight, inp.w13_mx, inp.w2_mx, top_k=inp.model.top_k, **inp.route_kw(),
                          group=None, config=config, precision=MX, return_routing=True, **policy_kwargs(params))
        return out[1], out[2]

    def backward(state):
        weights, experts = state
        grads = moe_backward(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy, weights, experts, precision=MX,
                             mx_weights=inp.mx_weights, **inp.backward_kw())
        return (*grads, experts)

    return timing.Split(forward, backward) if inp.direction == BWD else (lambda: backward(forward()))


def a2a_backward(inp: MoEInputs):
    """nccl-a2a's backward: autograd through ``moe_forward_a2a(fp32=False)`` (torch._grouped_mm has a derivative;
    autograd_backward); at mxfp8 through ``moe_mx.moe_forward_a2a_mx_train(fp32=False)`` (the MX backward's
    rounding rules as autograd Functions around its grouped GEMMs)."""
    if inp.dtype == MX:
        return autograd_backward(inp, lambda *leaves: moe_mx.moe_forward_a2a_mx_train(
            *leaves, inp.mx_weights, top_k=inp.model.top_k, fp32=False, **inp.route_kw()))
    return autograd_backward(inp, lambda *leaves: moe_forward_a2a(*leaves, top_k=inp.model.top_k, fp32=False,
                                                                  **inp.route_kw()))


def autograd_backward(inp: MoEInputs, layer, leaves=None, grads_as=None):
    """A baseline's backward by autograd through its forward ``layer(x, router_weight, w13, w2) -> y`` (nccl-a2a:
    moe_forward_a2a; deepep: deepep_layer), called on leaf copies of the inputs that require grad; bwd: the forward
    (its graph) untimed, ``torch.autograd.grad`` for dy timed; fwd+bwd: both. Returns (dx, d_router, dw13, dw2,
    experts) with the routing decision ``route`` gives on the same inputs (the call both layers make). A layer that
    returns (y, experts) reports its own decision instead (the hf-* baselines); ``leaves``: the tensors to
    differentiate, in that order, when they are not copies of the inputs (the hf-* baselines' own parameters, in
    transformers' layout), and ``grads_as(grads)`` their gradients as (dx, d_router, dw13, dw2) in the inputs'
    layout (views)."""
    if leaves is None:
        leaves = [t.detach().requires_grad_(True) for t in (inp.x, inp.router_weight, inp.w13, inp.w2)]
        _, experts = route(inp.x, inp.router_weight, inp.model.top_k, **inp.route_kw())

    def forward():
        return layer(*leaves)

    def backward(out):
        y, decision = out if isinstance(out, tuple) else (out, experts)
        grads = torch.autograd.grad(y, leaves, inp.dy)
        return (*(grads_as(grads) if grads_as else grads), decision)

    return timing.Split(forward, backward) if inp.direction == BWD else (lambda: backward(forward()))


@register("moe_fwd", "nccl-a2a", baseline=True, directions=A2A_DIRECTIONS)
def _nccl_a2a(inp: MoEInputs, params: dict, config):
    if inp.direction != FWD:
        return a2a_backward(inp), 0
    if inp.dtype == MX:
        return (lambda: moe_mx.moe_forward_a2a_mx(inp.x, inp.router_weight, inp.w13_mx, inp.w2_mx,
                                                  top_k=inp.model.top_k, fp32=False, **inp.route_kw())), 0
    return (lambda: moe_forward_a2a(inp.x, inp.router_weight, inp.w13, inp.w2, top_k=inp.model.top_k, fp32=False,
                                    **inp.route_kw())), 0


GRAD_REF_CHUNK_BYTES = 1 << 30  # fp32 weight gradients of one chunk of experts in the W = 1 check (deepseek-v3: 6)


def grad_reference_chunk(m: MoEModel) -> int:
    """Experts per chunk of the W = 1 gradient check: GRAD_REF_CHUNK_BYTES of their fp32 dw13 + dw2, at least one."""
    return max(1, GRAD_REF_CHUNK_BYTES // (3 * m.hidden * m.expert_ffn * 4))


GiB = 1 << 30


def backward_check_bytes(m: MoEModel, tokens: int) -> dict:
    """Bytes of what is live while one implementation's backward is checked at W = 1 (grad_reference), balanced
    load (R = tokens * top_k expert rows): the point's inputs, the implementation's output, and then the larger of
    its own working set inside the call (kosmos moe_backward_w1: the x / dy / do / dx rows [R, H], g | u saved and
    gathered and [dg | du] [R, 2F], h [R, F], bf16; nccl-a2a's autograd holds about as much) and the reference's
    (grad_reference's docstring); ``peak`` sums them. Not counted: KOSMOS's forward workspace, torch's own
    workspaces, the allocator's fragmentation (each row's peak_mem_bytes is the measured one)."""
    t, h, f, e, k = tokens, m.hidden, m.expert_ffn, m.experts, m.top_k
    r, c = t * k, min(grad_reference_chunk(m), e)
    out = {
        "weights (w13, w2 bf16)": e * 3 * h * f * 2,
        "x, dy, router weight (bf16)": 2 * t * h * 2 + e * h * 2,
        "output: dw13, dw2 (bf16)": e * 3 * h * f * 2,
        "output: dx (bf16), d_router (fp32)": t * h * 2 + e * h * 4,
        "implementation's working set": 4 * r * h * 2 + 3 * r * 2 * f * 2 + r * f * 2,
        "reference: x, dy (fp32)": 2 * t * h * 4,
        "reference: dx_pair [T*k, H] (fp32)": r * h * 4,
        "reference: dx_experts, dx_router, dx (fp32)": 3 * t * h * 4,
        "reference: one chunk's dw13, dw2 (fp32)": c * 3 * h * f * 4,
        "reference: the chunk's comparison (fp32 out, difference)": 2 * c * 2 * h * f * 4,
        "reference: one expert's weights upcast (fp32)": 3 * h * f * 4,
        "reference: the chunk's per-row tensors (fp32)": -(-r * c // e) * (5 * h + 8 * f) * 4,
    }
    ref = sum(v for key, v in out.items() if key.startswith("reference"))
    own = out["implementation's working set"]
    out["peak"] = sum(v for key, v in out.items() if not key.startswith("reference")) - own + max(own, ref)
    return out


def grad_reference(inp: MoEInputs, world: int = 1) -> harness.Reference:
    """The check of a backward's output (dx, d_router, dw13, dw2, experts): each gradient against an fp32
    reference within GRAD_TOLERANCE; rel_err is the largest of the four, each in the row's ``rel_err_grads``.
    W = 1: moe_reference.moe_backward_ref for the implementation's own decision ``experts`` (every expert local).
    W > 1: grad_reference_distributed (collective: every rank calls this in step, before any implementation).

    Memory at W = 1: the reference runs ``grad_reference_chunk`` experts at a time (moe_backward_ref's
    expert_chunk; 6 at deepseek-v3) and compares each chunk's fp32 dw13 / dw2 with the same experts' slice of
    the implementation's gradients as it comes (kosmos.reference.FrobeniusError: the squared norms of the
    differences and of the reference summed over the chunks), then drops it; dx and d_router whole, in fp32.
    The same rel_err as comparing the whole tensors, up to the order the squared norms are summed in
    (tests/test_bench_moe.py). The implementation's gradients are checked and dropped before the next
    implementation runs (harness.check_and_time keeps only the errors). Unchunked, the reference held 42 GiB of
    fp32 weight gradients at deepseek-v3 (and ~5 / ~9 GiB of [T*k, ...] fp32 stage tensors at 4k / 8k tokens
    while it ran), and rel_err then made two more fp32 copies of dw13 (56 GiB): ~140 GiB at peak, past an H200's
    139 GiB. Now (``backward_check_bytes``, balanced load, EP = 1): deepseek-v3 at 4k tokens ~46 GiB (weights 21,
    the implementation's gradients 21, the reference 4.0), at 8k ~48 GiB (the reference 5.6, the implementation's
    own working set 5.3); qwen3-235b 4k ~13 GiB."""
    mx = inp.dtype == MX
    tol = GRAD_TOLERANCE_MX if mx else GRAD_TOLERANCE
    if world > 1:
        return grad_reference_distributed(inp)
    chunk = grad_reference_chunk(inp.model)

    def ref(out):
        for o, like in zip(out, (inp.x, inp.router_weight, inp.w13, inp.w2)):
            harness.check_output(o, like.shape)
        errs = {name: FrobeniusError() for name in GRADS}

        def compare(e0, dw13, dw2):  # one chunk of experts' fp32 weight gradients, dropped after this
            errs["dw13"].add(out[2][e0:e0 + dw13.shape[0]], dw13)
            errs["dw2"].add(out[3][e0:e0 + dw2.shape[0]], dw2)

        dx, d_router, _, _ = moe_backward_ref(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy,
                                              top_k=inp.model.top_k, **inp.route_kw(), experts=out[len(GRADS)],
                                              expert_chunk=chunk, on_weight_grads=compare, mx=mx)
        errs["dx"].add(out[0], dx)
        errs["d_router"].add(out[1], d_router)
        return {name: e.value() for name, e in errs.items()}
    return harness.Reference(ref, tol, parts=GRADS, parts_key="rel_err_grads")


def grad_reference_distributed(inp: MoEInputs, group=None) -> harness.Reference:
    """The W > 1 backward check: autograd through moe_forward_a2a(fp32=True) over ``group`` on fp32 leaf copies of
    x, the router weight and this rank's experts, for ``route``'s decision (fp32 logits), with this rank's dy;
    the gradients are computed here, once (the call is collective). The returned Reference checks an output's
    four gradients against them and first that its decision equals route's (else a one-line ValueError: the
    implementation routed differently, which on these tie-free inputs is a bug)."""
    _, decision = route(inp.x, inp.router_weight, inp.model.top_k, **inp.route_kw())
    leaves = [t.detach().float().requires_grad_(True) for t in (inp.x, inp.router_weight, inp.w13, inp.w2)]
    if inp.dtype == MX:  # the MX layer's fp32 math with its MX backward (moe_backward_ref(mx=True), distributed)
        y = moe_mx.moe_forward_a2a_mx_train(*leaves, inp.mx_weights, top_k=inp.model.top_k, fp32=True,
                                            experts=decision, group=group, **inp.route_kw())
    else:
        y = moe_forward_a2a(*leaves, top_k=inp.model.top_k, fp32=True, experts=decision, group=group,
                            **inp.route_kw())
    grads = tuple(g.detach() for g in torch.autograd.grad(y, leaves, inp.dy.float()))
    del y, leaves

    def ref(out):
        got = out[len(GRADS)]
        if not torch.equal(got.long().to(decision.device), decision):
            diff = int((got.long().to(decision.device) != decision).any(-1).sum())
            raise ValueError(f"routing decision differs from route()'s on {diff} of {decision.shape[0]} tokens "
                             "(the fp32 reference is for route's decision)")
        return grads
    return harness.Reference(ref, GRAD_TOLERANCE, parts=GRADS, parts_key="rel_err_grads")


def deepep_available(world: int) -> tuple[bool, str | None]:
    try:
        importlib.import_module("deep_ep")
    except Exception as e:  # ImportError, or a broken build failing at import
        return False, f"deep_ep is not importable ({type(e).__name__}: {e})"
    if world not in (2, 4, 8):
        return False, f"DeepEP's intranode kernels run on 2, 4 or 8 ranks, not {world}"
    return True, None


@register("moe_fwd", "deepep", available=deepep_available,
          dtypes={"bf16": None, MX: "no MXFP8 path in the deepep baseline yet"})
def _deepep(inp: MoEInputs, params: dict, config):
    return deepep_callable(inp)


harness.register_fixed("moe_fwd", _kosmos_layer, FIXED_DIRECTIONS)


# transformers' own experts (moe_hf.py): bf16 at EP = 1, in every direction (autograd_backward through them)
HF_DTYPES = {"bf16": None, MX: "transformers' experts have no MXFP8 path"}
HF_MEMORY_SHARE = 0.95  # of the GPU's memory an hf-* point's estimated peak (hf_check_bytes) may take


def hf_check_bytes(m: MoEModel, tokens: int, direction: str, impl: str) -> dict:
    """Bytes of what is live while an hf-* implementation runs and is checked at EP = 1 (balanced load, R = tokens
    * top_k expert rows), by item, and ``peak`` = the items that stay + the larger of its own working set and the
    check's reference (the reference runs after the call). Both weight layouts are resident (the point's, and the
    transformers-layout copy the layer is built with). fwd: the layer's per-row tensors (x gathered [R, H], gate |
    up [R, 2F], SwiGLU [R, F], outputs [R, H], weighted in fp32) and the fp32 reference for its decision. bwd,
    fwd+bwd: the weight gradients (bf16, both matrices), the rows autograd saves (x, gate | up, silu(gate) and h,
    outputs) and the backward's fp32 row tensors (3 x [R, H]), against grad_reference's working set
    (backward_check_bytes); hf-eager adds one dense [E, 2F, H] tensor: autograd's backward of ``gate_up_proj[e]``
    (SelectBackward) is a zero tensor the size of the whole parameter per expert, summed into the gradient.
    Not counted: torch's workspaces, the allocator's fragmentation, KOSMOS's workspace (not used here)."""
    t, h, f, e, k = tokens, m.hidden, m.expert_ffn, m.experts, m.top_k
    r, weights = t * k, e * 3 * h * f * 2
    out = {"weights (w13, w2 bf16)": weights, "weights in transformers' layout (copy)": weights,
           "x, router weight (bf16)": t * h * 2 + e * h * 2}
    if direction == FWD:
        out["output y (bf16), the point's fp32 reference"] = t * h * 2 + t * h * 4
        own = r * (h * 2 + 2 * f * 2 + 2 * f * 2 + h * 2 + 2 * h * 4)
        ref = 3 * r * h * 4 + t * h * 4 + 3 * h * f * 4
    else:
        out.update({"dy (bf16)": t * h * 2, "output: dw13, dw2 (bf16)": weights,
                    "output: dx, d_router": t * h * 2 + e * h * 4})
        own = r * (2 * h * 2 + 2 * f * 2 + 2 * f * 2) + 3 * r * h * 4
        if impl == "hf-eager":
            own += e * 2 * f * h * 2
        ref = sum(v for key, v in backward_check_bytes(m, tokens).items() if key.startswith("reference"))
    out["implementation's working set"] = own
    out["reference (the check, after the call)"] = ref
    out["peak"] = sum(out.values()) - own - ref + max(own, ref)
    return out


def hf_memory_problem(m: MoEModel, tokens: int, direction: str, impl: str, total_bytes: int) -> str | None:
    """Why ``impl`` cannot run this point on a GPU of ``total_bytes`` (its hf_check_bytes peak over HF_MEMORY_SHARE
    of them), else None."""
    need = hf_check_bytes(m, tokens, direction, impl)["peak"]
    if need <= HF_MEMORY_SHARE * total_bytes:
        return None
    return (f"needs ~{need / GiB:.0f} GiB at {m.name} {tokens} tokens {direction} (estimate, hf_check_bytes"
            + (": autograd's dense per-expert weight gradients" if impl == "hf-eager" and direction != FWD else "")
            + f"), more than {HF_MEMORY_SHARE:.0%} of this GPU's {total_bytes / GiB:.0f} GiB")


def _hf_maker(name: str):
    """The maker of hf-grouped-mm / hf-eager (moe_hf's docstring): the layer built on this point's weights (the
    transformers-layout copy made here, untimed); fwd: ``layer(x)`` -> (y, its decision), no autograd; bwd,
    fwd+bwd: autograd_backward through it, differentiating x and the layer's own parameters, the weight gradients
    returned as views in KOSMOS's layout. On a GPU whose memory the point's estimate (hf_check_bytes) exceeds:
    unavailable, with the estimate."""
    def make(inp: MoEInputs, params: dict, config):
        m, dev = inp.model, inp.x.device
        if dev.type == "cuda":
            problem = hf_memory_problem(m, inp.x.shape[0], inp.direction, name,
                                        torch.cuda.get_device_properties(dev).total_memory)
            if problem:
                raise registry.Unavailable(problem)
        grad = inp.direction != FWD
        layer, weights = moe_hf.hf_layer(m, inp.router_weight, inp.bias, inp.w13, inp.w2, moe_hf.HF_IMPLS[name],
                                         requires_grad=grad)
        if not grad:
            return (lambda: layer(inp.x)), 0
        x = inp.x.detach().requires_grad_(True)
        return autograd_backward(inp, lambda x, *_: layer(x), leaves=[x, *weights], grads_as=_kosmos_layout), 0
    return make


def _kosmos_layout(grads):
    """(dx, d_router, d gate_up_proj [E, 2F, H], d down_proj [E, H, F]) -> the last two as [E, H, 2F] / [E, F, H]
    views (the layout of w13 / w2)."""
    dx, d_router, d_gate_up, d_down = grads
    return dx, d_router, d_gate_up.transpose(1, 2), d_down.transpose(1, 2)


for _name in moe_hf.HF_IMPLS:
    register("moe_fwd", _name, available=moe_hf.hf_available, dtypes=HF_DTYPES)(_hf_maker(_name))

# Liger-Kernel's fused MoE (moe_liger.py: Liger's own pieces): its experts on the point's router (route, in torch);
# bf16, EP = 1, every direction (its autograd Function); "unavailable" without liger_kernel, CUDA, or at EP > 1
def liger_check_bytes(m: MoEModel, tokens: int, direction: str) -> dict:
    """Bytes live while the liger row runs and is checked at EP = 1 (balanced load, R = tokens * top_k rows), by
    item, ``peak`` as in ``hf_check_bytes``: the same resident items as hf-grouped-mm's (both weight layouts,
    the inputs, the outputs, the check's reference), with Liger's own working set. fwd: the router's fp32 logits and
    probabilities [T, E], the routing metadata (int32), gate | up [R, 2F], SwiGLU [R, F], Y [R, H] (bf16). bwd,
    fwd+bwd: gate | up saved (bf16), the router's saved fp32 [T, E] tensors and metadata, plus the larger of the
    forward's transients (SwiGLU, Y) and the backward's (d gate | up [R, 2F], s * SwiGLU [R, F], dx rows [R, H], the
    gate gradient [R], the router's fp32 backward: [T, E] and its part of dx [T, H]). Not counted: torch's and
    Triton's workspaces (autotuning's L2-flush buffer), fragmentation."""
    t, h, f, e, k = tokens, m.hidden, m.expert_ffn, m.experts, m.top_k
    r = t * k
    out = hf_check_bytes(m, tokens, direction, "hf-grouped-mm")
    out["weights in Liger's layout (copy)"] = out.pop("weights in transformers' layout (copy)")
    ref = out.pop("reference (the check, after the call)")
    for key in ("implementation's working set", "peak"):
        out.pop(key)
    router, meta = 2 * t * e * 4, 4 * r * 4
    if direction == FWD:
        own = router + meta + r * (2 * f * 2 + f * 2 + h * 2)
    else:
        saved = r * 2 * f * 2 + router + meta
        own = saved + max(r * (f * 2 + h * 2), r * (2 * f * 2 + f * 2 + h * 2 + 2) + t * e * 4 + t * h * 4)
    out["implementation's working set"] = own
    out["reference (the check, after the call)"] = ref
    out["peak"] = sum(out.values()) - own - ref + max(own, ref)
    return out


def liger_memory_problem(m: MoEModel, tokens: int, direction: str, total_bytes: int) -> str | None:
    """Why the liger row cannot run this point on a GPU of ``total_bytes`` (liger_check_bytes' peak over
    HF_MEMORY_SHARE of them), else None."""
    need = liger_check_bytes(m, tokens, direction)["peak"]
    if need <= HF_MEMORY_SHARE * total_bytes:
        return None
    return (f"needs ~{need / GiB:.0f} GiB at {m.name} {tokens} tokens {direction} (estimate, liger_check_bytes), "
            f"more than {HF_MEMORY_SHARE:.0%} of this GPU's {total_bytes / GiB:.0f} GiB")


def liger_maker(inp, params: dict, config):
    """The maker of the liger row (registered below): Liger's weights made here (untimed); fwd: the
    layer's y; bwd, fwd+bwd: autograd_backward through it, the weight gradients as views in KOSMOS's layout.
    ``inp``: MoEInputs. Workspace: none (0)."""
    m, dev = inp.model, inp.x.device
    try:
        fn = moe_liger.liger_function()
    except ImportError as e:  # (liger_available said yes; a second process may differ)
        raise registry.Unavailable(str(e)) from None
    if dev.type == "cuda":
        problem = liger_memory_problem(m, inp.x.shape[0], inp.direction,
                                       torch.cuda.get_device_properties(dev).total_memory)
        if problem:
            raise registry.Unavailable(problem)
    layer = moe_liger.liger_layer(fn, m.top_k, inp.route_kw())
    gate_up, down = moe_liger.liger_weights(inp.w13, inp.w2)
    if inp.direction == FWD:
        x, wr = inp.x, inp.router_weight
        return (lambda: layer(x, wr, gate_up, down)[0]), 0
    leaves = [inp.x.detach().requires_grad_(True), inp.router_weight.detach().requires_grad_(True),
              gate_up.requires_grad_(True), down.requires_grad_(True)]
    return autograd_backward(inp, layer, leaves=leaves, grads_as=moe_liger.kosmos_grads), 0


register("moe_fwd", "liger", available=moe_liger.liger_available, dtypes=moe_liger.LIGER_DTYPES)(liger_maker)


def hf_forward_reference(inp: MoEInputs) -> harness.Reference:
    """The check of an hf-* forward's output (y, its decision): y against the fp32 layer for that decision
    (moe_forward_a2a(fp32=True, experts=...): the weights from fp32 logits), within the bf16 tolerance; the row's
    ``rel_err_parts`` repeats it as {"y": ...}."""
    def ref(out):
        return (moe_forward_a2a(inp.x, inp.router_weight, inp.w13, inp.w2, top_k=inp.model.top_k, fp32=True,
                                experts=out[1], **inp.route_kw()),)
    return harness.Reference(ref, harness.TOLERANCE["bf16"], parts=("y",))


# the expert GEMMs alone are compared at bf16, in the forward and the backward (no rows at mxfp8 or fwd+bwd);
# at bwd each returns (dx_rows, dw13, dw2, row_of): row_of maps the packed rows into its own layout (None: packed)
EXPERT_DIRECTIONS = {FWD: None, BWD: None}


@register("moe_experts", "grouped-mm", baseline=True, dtypes={"bf16": None}, directions=EXPERT_DIRECTIONS)
def _grouped_mm(inp: ExpertInputs, params: dict, config):
    if inp.direction == BWD:
        return _grouped_mm_backward(inp), 0
    return (lambda: _experts_forward(inp.x_sorted, inp.counts, inp.w13, inp.w2, fp32=False)), 0


def _grouped_mm_backward(inp: ExpertInputs):
    """grouped-mm at bwd: autograd through _experts_forward's torch._grouped_mm GEMMs and SwiGLU (nccl-a2a's
    expert part), its graph built once outside the timed call and kept (retain_graph), the output gradient
    do = w * dy; torch.autograd.grad timed: dgrad2, wgrad2, the SwiGLU backward, dgrad1, wgrad1."""
    leaves = [t.detach().requires_grad_(True) for t in (inp.x_sorted, inp.w13, inp.w2)]
    y = _experts_forward(leaves[0], inp.counts, leaves[1], leaves[2], fp32=False)
    do = (inp.w_sorted[:, None] * inp.dy_sorted.float()).to(y.dtype)
    return lambda: (*torch.autograd.grad(y, leaves, do, retain_graph=True), None)


@register("moe_experts", "kosmos-expert-gemms", kosmos=True, dtypes={"bf16": None}, directions=EXPERT_DIRECTIONS)
def _kosmos_expert_gemms(inp: ExpertInputs, params: dict, config):
    if inp.direction == BWD:
        return _kosmos_expert_backward(inp), None
    return (lambda: expert_gemms(inp.x_sorted, inp.counts, inp.w13, inp.w2, config=config)), None


def _kosmos_expert_backward(inp: ExpertInputs):
    """kosmos-expert-gemms at bwd: moe_backward's expert part (expert_backward_gemms: dgrad2 with the SwiGLU
    backward and the gate gradient in its epilogue, both weight gradients, dgrad1) on its own row layout (padded,
    as moe_backward gathers them) with g | u from GEMM1, all made outside the timed call
    (expert_backward_operands). It computes the gate weights' gradients too (grouped-mm has none to make)."""
    ops = expert_backward_operands(inp.x_sorted, inp.dy_sorted, inp.w_sorted, inp.w13, inp.counts)
    row_of = ops.pop("row_of")
    wdt = inp.w13.dtype

    def call():
        dx_rows, _, dw13, dw2 = expert_backward_gemms(w13=inp.w13, w2=inp.w2, wgrad_dtype=wdt, **ops)
        return dx_rows, dw13, dw2, row_of
    return call


EXPERT_GRADS = ("dx", "dw13", "dw2")


def expert_backward_reference(inp: ExpertInputs, chunk: int) -> harness.Reference:
    """The check of the expert GEMMs' backward (dx_rows, dw13, dw2, row_of): each against fp32 formulas
    (moe_reference's stage references: GEMM1 again, SwiGLU, gemm2_backward_ref, swiglu_backward_ref,
    gemm1_backward_ref; do = w * dy), ``chunk`` experts at a time, compared as they come (FrobeniusError) --
    grad_reference's memory rule; within GRAD_TOLERANCE."""
    from kosmos.reference import moe as mr

    def ref(out):
        dx_rows, dw13, dw2, row_of = out
        if row_of is not None:
            dx_rows = dx_rows[row_of]
        for o, like in zip((dx_rows, dw13, dw2), (inp.x_sorted, inp.w13, inp.w2)):
            harness.check_output(o, like.shape)
        errs = {name: FrobeniusError() for name in EXPERT_GRADS}
        counts = inp.counts.tolist()
        starts = [0]
        for n in counts:
            starts.append(starts[-1] + n)
        for e0 in range(0, len(counts), chunk):
            e1 = min(e0 + chunk, len(counts))
            r0, r1 = starts[e0], starts[e1]
            groups = [(e - e0, torch.arange(starts[e] - r0, starts[e + 1] - r0, device=inp.x_sorted.device))
                      for e in range(e0, e1) if counts[e]]
            x = inp.x_sorted[r0:r1].float()
            one = torch.zeros((r1 - r0, 1), dtype=torch.long, device=x.device)
            w13, w2 = inp.w13[e0:e1].float(), inp.w2[e0:e1].float()
            g, u, h, _ = mr.expert_pairs_forward_ref(x, one, w13, w2, groups)
            do = inp.w_sorted[r0:r1, None].float() * inp.dy_sorted[r0:r1].float()
            dh, dw2_ref = mr.gemm2_backward_ref(do, h, w2, groups)
            dg, du = mr.swiglu_backward_ref(dh, g, u)
            dx_ref, dw13_ref = mr.gemm1_backward_ref(dg, du, x, one, w13, groups)
            errs["dx"].add(dx_rows[r0:r1], dx_ref)
            errs["dw13"].add(dw13[e0:e1], dw13_ref)
            errs["dw2"].add(dw2[e0:e1], dw2_ref)
            del g, u, h, do, dh, dg, du, dx_ref, dw13_ref, dw2_ref
        return {name: e.value() for name, e in errs.items()}
    return harness.Reference(ref, GRAD_TOLERANCE, parts=EXPERT_GRADS, parts_key="rel_err_grads")


MOE_IMPLS = names("moe_fwd")  # ("kosmos", "nccl-a2a", "deepep", "fixed-role", "fixed-role-best", "hf-grouped-mm", "hf-eager", "liger")
EXPERT_IMPLS = names("moe_experts")  # ("grouped-mm", "kosmos-expert-gemms")


_DEEPEP = {}  # this process's DeepEP Buffer ("buffer") and the note of its rows ("note")

# What DeepEP V1's intranode kernels accept (its csrc at commit 567632d): a bf16 token moves as pairs of 16-byte
# vectors (hidden % 16) and half a token (+ an 8-byte mbarrier) is staged per warp in 8 KiB of shared memory by
# the SM90 (TMA) dispatch (hidden <= 8176); notify_dispatch gives a local expert one of 128 threads; top-k <= 32;
# 2, 4 or 8 ranks (deepep_available).
DEEPEP_HIDDEN_MULTIPLE = 16
DEEPEP_MAX_HIDDEN = 8176
DEEPEP_MAX_LOCAL_EXPERTS = 128
DEEPEP_MAX_TOP_K = 32


def deepep_shape_problem(m: MoEModel, world: int) -> str | None:
    """Why DeepEP's intranode kernels cannot run model ``m`` at ``world`` ranks (None: they can); a device-side
    assert would trap the CUDA context, so the maker refuses first ("unavailable" row)."""
    if m.hidden % DEEPEP_HIDDEN_MULTIPLE or m.hidden > DEEPEP_MAX_HIDDEN:
        return (f"DeepEP's intranode dispatch needs hidden % {DEEPEP_HIDDEN_MULTIPLE} == 0 and hidden <= "
                f"{DEEPEP_MAX_HIDDEN} (bf16), got {m.hidden}")
    if m.experts // world > DEEPEP_MAX_LOCAL_EXPERTS:
        return (f"DeepEP's intranode dispatch takes <= {DEEPEP_MAX_LOCAL_EXPERTS} experts per rank, "
                f"got {m.experts // world}")
    if m.top_k > DEEPEP_MAX_TOP_K:
        return f"DeepEP's intranode kernels take top-k <= {DEEPEP_MAX_TOP_K}, got {m.top_k}"
    return None


def deepep_release(destroy: bool = True) -> None:
    """Drop this process's DeepEP Buffer. ``destroy``: free it now with ``Buffer.destroy()`` -- a GPU barrier
    between the ranks, so collective: every rank calls it in step. Without (after a failure, when a peer may be
    gone or the context broken): the buffer is only dropped (its memory stays until the process ends; DeepEP
    prints a warning then), rather than risking a barrier no peer joins."""
    buf = _DEEPEP.pop("buffer", None)
    _DEEPEP.clear()
    if buf is not None and destroy:
        buf.destroy()


def _deepep_buffer(deep_ep, world: int, hidden_bytes: int):
    """The Buffer of DeepEP's own sizing recipe (its README's get_buffer): the NVLink buffer is the larger of the
    recommended dispatch and combine configs' ``get_nvl_buffer_size_hint(hidden_bytes, world)``; no RDMA buffer
    (intranode; the wheel, built without NVSHMEM, asserts in get_rdma_buffer_size_hint). Reused while big
    enough, else destroyed (collective: every rank makes the same callable in step) and made again."""
    configs = (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world))
    nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, world) for cfg in configs)
    buf = _DEEPEP.get("buffer")
    if buf is None or buf.num_nvl_bytes < nvl_bytes:
        deepep_release()
        # explicitly_destroy: freed by deepep_release in step, never by a destructor at exit (whose barrier
        # would wait for a peer that may have exited already)
        buf = _DEEPEP["buffer"] = deep_ep.Buffer(dist.group.WORLD, nvl_bytes, 0, explicitly_destroy=True)
    return buf, configs


def deepep_callable(inp: MoEInputs):
    """The ``deepep`` baseline: DeepEP V1's intranode (NVLink) normal-mode dispatch/combine around nccl-a2a's GEMMs.

    fwd: one call is ``deepep_layer`` (route -> layout -> dispatch -> expert side -> combine), its exchanges called
    directly. bwd, fwd+bwd: ``autograd_backward`` -- nccl-a2a's timing of its autograd backward -- through
    ``deepep_layer`` with the exchanges as autograd Functions (dispatch's backward is a combine of the gradient,
    combine's a cached-mode dispatch: DeepEP's own pairing, as Megatron's DeepEP dispatcher uses it); the expert
    part's backward is autograd through the same torch._grouped_mm GEMMs and SwiGLU as nccl-a2a's. Synchronous
    (async_finish=False: the current stream waits for DeepEP's communication stream); dispatch waits on the host
    for the received counts, as nccl-a2a's split sizes do (a cached dispatch reuses the handle's: no wait).

    Configuration, DeepEP's own, not tuned down: ``Buffer.get_dispatch_config(W)`` and
    ``Buffer.get_combine_config(W)`` (its recommended per world size; W = 2: NVL chunks send/recv 24/256 and
    10/256 tokens) at ``Buffer.num_sms`` = its default, 20 SMs (10 channels); DeepEP's README example and
    tests/test_intranode.py set 24 (``Buffer.set_num_sms``), which this baseline does not. The Buffer: DeepEP's
    sizing (``_deepep_buffer``), made here, outside the timed call; the row's workspace_bytes is its NVLink buffer.

    What has run: the forward on one GPU, two ranks (tests/test_deepep.py's GPU test), and the autograd Functions
    in the training proxy's EP = 2 deepep (NOTES.md); the bench's bwd rows on the CPU with a stand-in Buffer that
    mirrors the wheel's signatures (tests/test_deepep.py), their GPU test written, not yet run."""
    import deep_ep
    world = world_info()[1]
    m, x = inp.model, inp.x
    problem = deepep_shape_problem(m, world)
    if problem:
        raise registry.Unavailable(problem)
    hidden_bytes = x.shape[1] * max(x.element_size(), 2)  # DeepEP's get_hidden_bytes
    buf, configs = _deepep_buffer(deep_ep, world, hidden_bytes)
    _DEEPEP["note"] = (f"DeepEP intranode: Buffer.get_dispatch_config({world}) / get_combine_config({world}) "
                       f"(its recommended), Buffer.num_sms={deep_ep.Buffer.num_sms} (its default)")

    def layer(x, router_weight, w13, w2, grad=True):
        return deepep_layer(buf, configs, x, router_weight, w13, w2, top_k=m.top_k, n_experts=m.experts,
                            grad=grad, **inp.route_kw())

    if inp.direction != FWD:
        return autograd_backward(inp, layer), buf.num_nvl_bytes
    return (lambda: layer(x, inp.router_weight, inp.w13, inp.w2, grad=False)), buf.num_nvl_bytes


def deepep_layer(buf, configs, x, router_weight, w13, w2, *, top_k: int, n_experts: int, grad: bool = True,
                 **route_kw):
    """The MoE layer through DeepEP: y [T, H] of this rank's tokens x [T, H] bf16 (w13 / w2 this rank's experts).
    ``route`` (the router nccl-a2a runs: fp32 weights, int64 experts = ``deep_ep.topk_idx_t``) ->
    ``buf.get_dispatch_layout(topk_idx, E)`` (tokens per rank and per expert, int32; is_token_in_rank) ->
    ``buf.dispatch(x, ..., topk_idx, topk_weights)``: every token once per rank holding any of its experts, with
    its top-k indices made local (-1 for another rank's experts) and its weights (0 there), the rows per local
    expert as a host list, and the handle -> ``deepep_expert_side``: the same torch._grouped_mm x2 + SwiGLU as
    nccl-a2a, the gate-weighted sum of a received token's local slots (one bmm, as nccl-a2a's fold) ->
    ``buf.combine(partial, handle)``: the ranks' partials summed (no weights) on the token's own rank, bf16.
    ``configs``: (dispatch config, combine config). Used by the bench (deepep_callable) and the training proxy
    (train.DeepEPMoE).

    ``grad``: the two exchanges as the autograd Functions _DeepEPDispatch / _DeepEPCombine, so that autograd runs
    through the layer; False: called directly (the bench's fwd rows: the same DeepEP calls, no autograd
    bookkeeping in the timed call).

    The gate weights' gradient: DeepEP's combine adds the partials without weights, so the weighting happens in
    torch, in deepep_expert_side, where autograd sees it: it gives d(recv_topk_weights) [R, k] (<d partial, the
    slot's expert output> at this rank's slots, 0 at the masked -1 slots). _DeepEPDispatch's backward passes it
    as combine's ``topk_weights``, which DeepEP sums per slot over the ranks the token went to; each slot is
    nonzero on the one rank holding its expert, so the sum is d(topk_weights) [T, k] on the token's rank, and
    autograd carries it on through route's softmax / sigmoid and renormalisation to the router weight and x."""
    import deep_ep
    weights, experts = route(x, router_weight, top_k, **route_kw)
    topk_idx = experts.to(deep_ep.topk_idx_t).contiguous()
    layout = buf.get_dispatch_layout(topk_idx, n_experts)[:4]  # per rank, per RDMA rank (None), per expert, in rank
    state = _DeepEPState(buf, *configs)
    dispatch, combine = (_DeepEPDispatch.apply, _DeepEPCombine.apply) if grad else (_deepep_dispatch, _deepep_combine)
    recv_x, recv_w = dispatch(x.contiguous(), weights.float().contiguous(), topk_idx, layout, state)
    part = deepep_expert_side(recv_x, state.recv_idx, recv_w, state.counts, w13, w2, w13.shape[0])
    return combine(part, state)


class _DeepEPState:
    """What a DeepEP dispatch leaves for its combine and both backwards: the Buffer, its configs, the handle,
    the received top-k indices (local, -1 elsewhere) and rows per local expert."""

    def __init__(self, buf, dispatch_config, combine_config):
        self.buf, self.dispatch_config, self.combine_config = buf, dispatch_config, combine_config
        self.handle = self.recv_idx = self.counts = None


def _deepep_dispatch(x, topk_weights, topk_idx, layout, state: _DeepEPState):
    """``Buffer.dispatch`` with the layout of ``get_dispatch_layout``: (x [T, H] bf16, topk_weights [T, k] fp32)
    -> (recv_x [R, H], recv_topk_weights [R, k]); the handle, recv_topk_idx and the per-expert counts go to
    ``state``."""
    per_rank, per_rdma_rank, per_expert, in_rank = layout
    recv_x, recv_idx, recv_w, counts, handle, _ = state.buf.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=topk_weights,
        config=state.dispatch_config)
    state.handle, state.recv_idx, state.counts = handle, recv_idx, list(counts)
    return recv_x, recv_w


def _deepep_combine(partial, state: _DeepEPState):
    """``Buffer.combine(partial, handle)``: every received row's partial [R, H] summed back on its token's rank
    (no weights), bf16 [T, H]."""
    y, _, _ = state.buf.combine(partial.contiguous(), state.handle, config=state.combine_config)
    return y


class _DeepEPDispatch(torch.autograd.Function):
    """_deepep_dispatch under autograd. Backward as DeepEP pairs them (and Megatron's DeepEP dispatcher,
    fused_a2a.FusedDispatch, uses them): ``Buffer.combine`` of the received rows' gradient with the same handle --
    a token's rows summed over the ranks it went to -- and ``topk_weights=`` the received weights' gradient,
    summed the same way (deepep_layer's docstring: the gate weights' gradient)."""

    @staticmethod
    def forward(ctx, x, topk_weights, topk_idx, layout, state):
        ctx.state = state
        return _deepep_dispatch(x, topk_weights, topk_idx, layout, state)

    @staticmethod
    def backward(ctx, d_recv_x, d_recv_w):
        st = ctx.state
        dx, dw, _ = st.buf.combine(d_recv_x.contiguous(), st.handle, topk_weights=d_recv_w.float().contiguous(),
                                   config=st.combine_config)
        return dx, dw, None, None, None


class _DeepEPCombine(torch.autograd.Function):
    """_deepep_combine under autograd. Backward as DeepEP pairs them (Megatron's fused_a2a.FusedCombine):
    ``Buffer.dispatch`` of the output gradient in cached mode (``handle=`` the dispatch's: its layout reused, no
    top-k), every token's gradient row to each rank that sent it a partial."""

    @staticmethod
    def forward(ctx, partial, state):
        ctx.state = state
        return _deepep_combine(partial, state)

    @staticmethod
    def backward(ctx, dy):
        st = ctx.state
        d_partial = st.buf.dispatch(dy.contiguous(), handle=st.handle, config=st.dispatch_config)[0]
        return d_partial, None


def deepep_expert_side(recv_x, recv_idx, recv_w, recv_counts, w13, w2, local: int):
    """Received tokens [R, H] with their top-k local expert indices [R, k] (-1: not on this rank) and gate
    weights [R, k] -> this rank's partial output [R, H] (recv_x's dtype) = sum over its local slots of
    w * expert(x), the experts run as nccl-a2a runs them (``_experts_forward``, bf16 grouped GEMMs on CUDA) and
    the sum as its fold (one bmm, weights in x's dtype). recv_counts: rows per local expert, a host list (what
    DeepEP's dispatch returns). Whatever the weights hold at -1 slots is ignored; R = 0 gives [0, H]. Pure
    torch (CPU-tested)."""
    n_recv, k = recv_idx.shape
    hidden = recv_x.shape[1]
    valid = recv_idx >= 0
    flat = torch.where(valid, recv_idx, local).reshape(-1)   # invalid slots sort last
    order = torch.argsort(flat, stable=True)[:sum(recv_counts)]
    rows = recv_x.index_select(0, order // k)
    counts = torch.tensor(recv_counts, dtype=torch.int32, device=recv_x.device)
    out = _experts_forward(rows, counts, w13, w2, fp32=False)
    pair = recv_x.new_zeros((n_recv * k, hidden))
    pair.index_copy_(0, order, out)
    w = torch.where(valid, recv_w, torch.zeros_like(recv_w)).to(recv_x.dtype)
    return torch.bmm(w.unsqueeze(1), pair.view(n_recv, k, hidden)).squeeze(1)


# --------------------------------------------------------------------------- one point


@dataclass
class MoESettings(Settings):
    impls: tuple = MOE_IMPLS
    expert_gemms: bool = True
    trace_dir: str | None = None  # --trace: one traced kosmos forward per point (bf16) written here


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t)
    return t


def _all_gather_int(v: int, device) -> list[int]:
    if not dist.is_initialized():
        return [v]
    out = torch.zeros(dist.get_world_size(), dtype=torch.int64, device=device)
    out[dist.get_rank()] = v
    dist.all_reduce(out)
    return out.tolist()


def _recover(device):
    """After a failure: drop KOSMOS's (possibly poisoned) workspace and DeepEP's buffer, realign the ranks."""
    harness.recover(device, cleanup=(lambda: deepep_release(destroy=False),))


def base_row(case: MoECase, world: int, dtype: str, op: str = "moe_fwd", direction: str = FWD) -> dict:
    """The identity keys of a row of ``case`` for ``op`` ("moe_fwd" or "moe_experts") in ``direction``."""
    m = case_model(case)
    return {
        "type": "result", "bench": "moe", "op": op, "layer": "experts" if op == "moe_experts" else "moe",
        "model": case.model, "seq": case.tokens, "m": case.tokens, "n": m.hidden, "k": m.expert_ffn, "world": world,
        "ep": world, "dtype": dtype, "direction": direction, "tokens": case.tokens, "experts": m.experts, "top_k": m.top_k,
        "routing": case.routing, "hidden": m.hidden, "expert_ffn": m.expert_ffn,
    }


def failed_rows(case: MoECase, world: int, st: MoESettings, reason: str) -> list[dict]:
    """The rows of a point that failed as a whole (one per implementation of either op that runs at
    ``st.dtype`` and ``st.direction``)."""
    experts = registry.impls_at("moe_experts", EXPERT_IMPLS, st.dtype, st.direction) if st.expert_gemms else ()
    ops = [("moe_experts", n) for n in experts] + [("moe_fwd", n) for n in registry.impls_at("moe_fwd", st.impls,
                                                                                          st.dtype, st.direction)]
    return [harness.failed_row(base_row(case, world, st.dtype, op, st.direction), op, name, reason,
                               st.config("moe_fwd")) for op, name in ops]


def run_case(case: MoECase, st: MoESettings, on_row=None, device=None) -> list[dict]:
    """Check and time every implementation on one (model, tokens, routing) point; returns the rows (every rank
    returns the same rows). ``on_row(row)`` is called as each row is ready."""
    rank, world = world_info()
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else \
            torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        # every point starts without KOSMOS buffers sized by an earlier (larger) point, so that the peak memory
        # recorded here is this point's own (measured otherwise: qwen3-235b 4096 right after deepseek-v3 16384
        # carried 2.3 GiB of symmetric workspace and deepseek-sized local buffers). Collective: every rank runs
        # the same points.
        kosmos.reset_workspaces()
        # and without an earlier point's tensors that only a reference cycle still holds (closures of its
        # timed calls): session 12's deepseek-v3 sweep grew from 48 GiB at its first backward point to an out-of-
        # memory at its fourth (the same point alone is predicted to fit); collected here, not at Python's leisure
        gc.collect()
        torch.cuda.empty_cache()
        torch.backends.cuda.matmul.allow_tf32 = False
        # allocate time_op's L2-flush buffer now (keyed like time_op keys it), so no impl's peak includes it
        timing.flush_l2(torch.cuda.current_device())
    m = case_model(case)
    if m.experts % world:
        raise ValueError(f"{m.name} has {m.experts} experts: they do not split evenly over {world} ranks")
    local = m.experts // world
    x, wr, bias, redrawn = make_router_inputs(m, case.tokens, case.routing, rank, st.seed, device)
    w13, w2 = make_expert_weights(m, world, rank, st.seed, device)
    mx = st.dtype == MX
    fwd = st.direction == FWD
    # mxfp8: the weights' MX values once, outside every timed call (a cached weight); bwd / fwd+bwd: all four
    # copies (MoEMXWeights: the forward's two and the backward's two), as kosmos.nn.MoE caches them
    mxw = moe_mx_weights(w13, w2) if mx and not fwd else None
    w_mx = moe_mx.mx_expert_weights(w13, w2) if mx and fwd else (mxw[:2] if mxw is not None else (None, None))
    dy = None if fwd else torch.randn(case.tokens, m.hidden, generator=_gen(device, 1_000_003 * st.seed + 613 * rank
                                                                            + 11), device=device, dtype=torch.bfloat16)
    inp = MoEInputs(m, x, wr, bias, w13, w2, st.dtype, *w_mx, direction=st.direction, dy=dy,
                    bwd_config=None if st.direction == FWD else st.config("moe_bwd"), mx_weights=mxw)
    # bwd, fwd+bwd: every gradient against moe_backward_ref for the implementation's own decision (grad_reference)
    ref = (moe_forward_a2a(x, wr, w13, w2, top_k=m.top_k, fp32=True, **inp.route_kw()) if fwd
           else grad_reference(inp, world))
    if mx and fwd:  # checked against the MX layer's fp32 math (nccl-a2a: with its bf16 GEMM1 output, moe_mx's docstring);
        # the error against the bf16 layer's is recorded
        also = {"rel_err_bf16": ref}
        refs = {g: harness.Reference(moe_mx.moe_forward_a2a_mx(x, wr, w13, w2, top_k=m.top_k, fp32=True,
                                                               gemm1_bf16=g, **inp.route_kw()),
                                     harness.TOLERANCE[MX], also) for g in (False, True)}
        ref = lambda name: refs[name == "nccl-a2a"]  # noqa: E731
    elif fwd:  # the hf-* baselines route with transformers' router: checked for their own decision
        point_ref, hf_ref = ref, hf_forward_reference(inp)
        ref = lambda name: hf_ref if name in moe_hf.HF_IMPLS else point_ref  # noqa: E731

    _, experts = route(x, wr, m.top_k, **inp.route_kw())
    load = _sum_over_ranks(expert_load(experts, m.experts))
    counts = load[rank * local:(rank + 1) * local].to(torch.int32)
    rows_per_rank = load.view(world, local).sum(1).tolist()
    redrawn_all = sum(_all_gather_int(redrawn, device))
    pairs = world * case.tokens * m.top_k
    extra = {
        "router": m.routing, "renormalize": m.renormalize, "n_group": m.n_group, "topk_group": m.topk_group,
        "routed_scaling": m.routed_scaling, "experts_per_rank": local, "seed": st.seed,
        "routing_margin": ROUTING_MARGIN, "redrawn_tokens": redrawn_all, "rows_per_rank": rows_per_rank,
        "top_expert_share": load.max().item() / pairs, "load_max_over_mean": load.max().item() * m.experts / pairs,
        **st.extra,
    }
    # the forward's all-to-alls alone and the expert GEMMs alone: measured in the forward direction only
    comm = moe_mx.a2a_comm_parts(x, experts, local, world, mx) if fwd else None
    t_comm = (timing.time_op(comm, iters=st.iters, warmup=st.warmup)["time_ms"] if comm else 0.0) if fwd else None
    wire = moe_mx.wire_bytes(st.dtype, moe_mx.cross_rank_pairs(experts, local, world), m.hidden, world)
    del experts, comm
    runner = harness.Runner(st, device, lambda: _recover(device), on_row, extra=extra, mem_delta=True)
    config = st.config("moe_fwd")  # the expert GEMMs alone run with the layer's config too

    # expert GEMMs alone, on the row counts this rank receives (the rows' values: fresh N(0, 1)); at mxfp8 no rows,
    # only grouped-mm's bf16 time (the moe_fwd rows' t_gemm_ms: bf16 at every dtype, like the TP bench's cuBLAS)
    t_gemm = None
    if st.expert_gemms and fwd:
        x_sorted = torch.randn(int(counts.sum().item()), m.hidden, generator=_gen(device, 31 * st.seed + rank),
                               device=device, dtype=torch.bfloat16)
    if st.expert_gemms and fwd and mx:
        t_gemm = timing.time_op(lambda: _experts_forward(x_sorted, counts, w13, w2, fp32=False), iters=st.iters,
                                warmup=st.warmup)["time_ms"]
        del x_sorted
    elif st.expert_gemms and fwd:
        done = runner.run("moe_experts", EXPERT_IMPLS, inputs=ExpertInputs(x_sorted, counts, w13, w2),
                          ref=_experts_forward(x_sorted, counts, w13, w2, fp32=True),
                          identity=base_row(case, world, st.dtype, "moe_experts"),
                          flops=6.0 * max(rows_per_rank) * m.hidden * m.expert_ffn, config=config, t_gemm_ms=None,
                          t_comm_ms=None)
        t_gemm = done["grouped-mm"].time_ms  # the t_gemm_ms of the moe_fwd rows
        del x_sorted
    elif st.expert_gemms and st.direction == BWD and not mx:  # the backward's expert GEMMs alone (fresh rows)
        gen = _gen(device, 31 * st.seed + rank)
        n_rows = int(counts.sum().item())
        x_sorted, dy_sorted = (torch.randn(n_rows, m.hidden, generator=gen, device=device, dtype=torch.bfloat16)
                               for _ in range(2))
        w_sorted = torch.rand(n_rows, generator=gen, device=device)  # the rows' gate weights, in [0, 1)
        einp = ExpertInputs(x_sorted, counts, w13, w2, BWD, dy_sorted, w_sorted)
        done = runner.run("moe_experts", EXPERT_IMPLS, inputs=einp,
                          ref=expert_backward_reference(einp, grad_reference_chunk(m)),
                          identity=base_row(case, world, st.dtype, "moe_experts", BWD),
                          flops=DIRECTION_FLOPS[BWD] * 6.0 * max(rows_per_rank) * m.hidden * m.expert_ffn,
                          config=config, t_gemm_ms=None, t_comm_ms=None)
        t_gemm = done["grouped-mm"].time_ms  # the t_gemm_ms of the moe_fwd bwd rows
        del x_sorted, dy_sorted, w_sorted, einp

    flops = DIRECTION_FLOPS[st.direction] * 6.0 * case.tokens * m.top_k * m.hidden * m.expert_ffn
    runner.run("moe_fwd", registry.impls_at("moe_fwd", st.impls, st.dtype, st.direction), inputs=inp, ref=ref,
               identity=base_row(case, world, st.dtype, direction=st.direction), flops=flops, config=config, t_gemm_ms=t_gemm, t_comm_ms=t_comm, wire_bytes=wire,
               impl_fields=lambda name: _impl_fields(name, mx, inp.bwd_config, m))
    if st.trace_dir and fwd and not mx and any(r["impl"] == "kosmos" and r["op"] == "moe_fwd" and r["status"] == "ok"
                                                for r in runner.rows):
        _write_trace(case, inp, world, config, st.trace_dir)
    return runner.rows  # the point's tensors go with this frame; bench_rank empties the CUDA cache after it


def _write_trace(case: MoECase, inp: MoEInputs, world: int, config, trace_dir: str) -> None:
    """One kosmos forward of the point with its per-program task timeline (``bench moe --trace``; the MoE kernel's
    trace kinds: route, dispatch, permute, GEMM1, GEMM2, combine, fold, waits) -> trace-<model>-<tokens>-<routing>
    -w<W>.json (harness.write_trace; draw with `kosmos report --timeline FILE`). Collective."""
    from kosmos.core.schedule import TRACE_EVENTS
    device = inp.x.device
    grid = runtime.num_sms(device) if device.type == "cuda" else 4  # (CPU: the tests' fake forward)
    buf = torch.zeros((grid, TRACE_EVENTS, 4), dtype=torch.int64, device=device)
    if device.type == "cuda":
        timing.barrier()
    moe_forward(inp.x, inp.router_weight, inp.w13, inp.w2, top_k=inp.model.top_k, **inp.route_kw(), group=None,
                config=config, trace=buf)
    runtime.check_errors()
    m = inp.model
    routing = case.routing.replace(":", "")
    harness.write_trace(buf, f"{trace_dir}/trace-{case.model}-{case.tokens}-{routing}-w{world}.json",
                        {"op": "moe_fwd", "model": case.model, "tokens": case.tokens, "routing": case.routing,
                         "m": case.tokens, "n": m.hidden, "k": m.expert_ffn, "experts": m.experts, "top_k": m.top_k,
                         "world": world, "config": config_dict(config)})


def _impl_fields(name: str, mx: bool, bwd_config=None, m: MoEModel | None = None) -> dict:
    """Row fields of one implementation alone: nccl-a2a's rounding note at mxfp8; deepep's configuration (the
    note its callable left, taken by this row); kosmos's backward config at bwd and fwd+bwd (``bwd_config``); the
    hf-* baselines' transformers version, family and experts implementation (``m``: the point's model)."""
    if name == "kosmos" and bwd_config is not None:
        return {"bwd_config": config_dict(bwd_config)}
    if name in moe_hf.HF_IMPLS and m is not None and not mx:
        return {"note": moe_hf.hf_note(name, m)}
    if name == "liger" and not mx:
        return {"note": moe_liger.liger_note()}
    if name == "deepep":
        note = _DEEPEP.pop("note", None)
        return {"note": note} if note else {}
    return {"note": moe_mx.BASELINE_NOTE} if mx and name == "nccl-a2a" else {}


# --------------------------------------------------------------------------- one rank of `kosmos bench moe`


def bench_rank(rank, world, suite: dict, cases: list, out: str, argv, configs=None, trace_dir=None):
    """One rank of `kosmos bench moe` (launcher.spawn); rank 0 writes the env line and every row as it is ready."""
    from .environment import environment
    from .sweep import run_sweep

    dtypes = suite["dtype"] if isinstance(suite["dtype"], (list, tuple)) else [suite["dtype"]]
    directions = suite.get("direction") or [FWD]
    directions = directions if isinstance(directions, (list, tuple)) else [directions]
    from .launcher import ranks_on_one_gpu
    # every rank on one GPU (KOSMOS_RANKS_ON_ONE_GPU, launcher.py): a correctness run; each row says so
    shared = {"ranks_on_one_gpu": True} if world > 1 and ranks_on_one_gpu() else {}
    st = MoESettings(impls=tuple(suite["impls"]), iters=suite["iters"], warmup=suite["warmup"],
                     fixed_sweep=tuple(suite["fixed_sweep"]), dtype=dtypes[0], seed=suite["seed"],
                     expert_gemms=suite["expert_gemms"], configs=dict(configs or {}), extra=shared,
                     trace_dir=trace_dir, cuda_graph=bool(suite.get("cuda_graph")))
    settings = {(d, g): replace(st, dtype=d, direction=g) for d in dtypes for g in directions}
    device = torch.device("cuda", torch.cuda.current_device())
    # a case is (point, dtype, direction): each point at every dtype in turn (as the TP bench does), each dtype in
    # every direction
    run_sweep(out, environment(argv=argv, suite=suite, bench="moe"), rank,
              [(MoECase(**c), d, g) for c in cases for d in dtypes for g in directions],
              describe=lambda case: f"{case[0].model} tokens={case[0].tokens} {case[0].routing} EP={world} "
                                    f"{case[1]} {case[2]}",
              run_one=lambda case, write: run_case(case[0], settings[case[1:]], on_row=write, device=device),
              failed_rows=lambda case, why: failed_rows(case[0], world, settings[case[1:]], why),
              recover=lambda: _recover(device),
              key=lambda r: (r["model"], r["tokens"], r["routing"], r["op"], r["dtype"], r.get("direction", FWD),
                             r["impl"]))
    deepep_release()  # every rank, after the same sweep: DeepEP's Buffer freed in step (its barrier), not at exit
