"""The MoE benchmark (``kosmos bench moe``): a proxy of one model's MoE layer -- its hidden size, expert FFN
size, number of experts, top-k and routing (``kosmos.models.MOE_MODELS``), experts split evenly over the EP
ranks -- run by every implementation on the same inputs, checked against the fp32 reference, then timed side
by side in the collective-safe loop of ``timing.py``. Runs inside one process per rank (``launcher.spawn``),
like the TP benchmark, and shares its conventions: failures are agreed across ranks (``tp.agree``), rows are
JSON lines after an env line (SCHEMA.md), a failing implementation is recorded and the sweep goes on.

Implementations of the layer (op ``moe_fwd``; y [T, H] bf16 from x [T, H] bf16 of this rank):
  kosmos           kosmos.moe_forward(..., policy="self"): the one-launch fused layer (imported lazily; until it
                   exists the row is "failed" with reason "kosmos.moe_forward not available: ...").
  nccl-a2a         kosmos.moe_reference.moe_forward_a2a(fp32=False): Megatron's all-to-all dispatcher with
                   torch._grouped_mm (the baseline of the speedup column).
  deepep           DeepEP's intranode Buffer dispatch/combine around the same grouped GEMMs ("unavailable" when
                   ``import deep_ep`` fails). UNTESTED: written against DeepEP's documented API, never run yet.
  fixed-role       kosmos.moe_forward(..., policy="fixed", comm_programs=S) at S = 16.
  fixed-role-best  the same at the best S of ``fixed_sweep`` (the tuned oracle a fixed-role library needs).
Expert GEMMs alone (op ``moe_experts``, on exactly the per-local-expert row counts this rank receives):
  grouped-mm           torch._grouped_mm x2 with the SwiGLU between (moe_reference._experts_forward, the GEMMs
                       of nccl-a2a); its time is the t_gemm_ms of the moe_fwd rows.
  kosmos-expert-gemms  kosmos.kernels.moe_forward.expert_gemms: the fused kernel's GEMM1+SwiGLU+GEMM2 alone.
  The issue's bar: kosmos-expert-gemms reaches >= 80% of grouped-mm's TFLOP/s (report: speedup >= 0.8).

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

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import kosmos
from kosmos import runtime
from kosmos.models import MOE_MODELS, MoEModel, UnknownModelError
from kosmos.moe_reference import _experts_forward, moe_forward_a2a, route

from . import timing
from .tp import FIXED_SWEEP, Unavailable, _max_over_ranks, environment, world_info
from .tp import check_and_time as _check_and_time

MOE_IMPLS = ("kosmos", "nccl-a2a", "deepep", "fixed-role", "fixed-role-best")
EXPERT_IMPLS = ("grouped-mm", "kosmos-expert-gemms")
KOSMOS_IMPLS = ("kosmos", "fixed-role", "fixed-role-best")
DEFAULT_FIXED_PROGRAMS = 16
ROUTING_MARGIN = 1e-3       # logit units; sigmoid scores use SIGMOID_SLOPE_MAX * ROUTING_MARGIN
SIGMOID_SLOPE_MAX = 0.25
SOFTMAX_UNDERFLOW = 80.0    # logits this far below a token's top one have fp32 probability ~0 (ties)
MAX_REDRAW_ROUNDS = 30
ZIPF_FEATURE = 1.0          # c: the constant input feature x[:, 0] of zipf routing
BIAS_STD = 0.002            # DeepSeek-V3 score-correction bias (sigmoid-grouped); larger skews "uniform"


class KernelMissing(Exception):
    """A KOSMOS entry point is not importable yet: recorded as failed (not unavailable)."""


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


def moe_cases(models, tokens, routings, ep: int) -> list[MoECase]:
    """Every (model, tokens, routing) point; ValueError if a model's experts do not split evenly over ep."""
    out = []
    for name in models:
        m = moe_model(name)
        if ep < 1 or m.experts % ep:
            raise ValueError(f"{name} has {m.experts} experts: they do not split evenly over --ep {ep}")
        for t in tokens:
            if not isinstance(t, int) or t <= 0:
                raise ValueError(f"tokens must be positive integers, got {t!r}")
            for r in routings:
                out.append(MoECase(name, t, str(parse_routing(r))))
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


def kosmos_moe_forward():
    """kosmos.moe_forward, imported lazily (another file, written separately)."""
    fn = getattr(kosmos, "moe_forward", None)
    if fn is not None:
        return fn
    try:
        from kosmos.kernels.moe_forward import moe_forward
    except Exception as e:
        raise KernelMissing(f"kosmos.moe_forward not available: {type(e).__name__}: {e}") from None
    return moe_forward


def kosmos_expert_gemms():
    try:
        from kosmos.kernels.moe_forward import expert_gemms
    except Exception as e:
        raise KernelMissing(f"kosmos.kernels.moe_forward.expert_gemms not available: {type(e).__name__}: {e}") \
            from None
    return expert_gemms


@dataclass
class MoEInputs:
    model: MoEModel
    x: torch.Tensor
    router_weight: torch.Tensor
    bias: torch.Tensor | None
    w13: torch.Tensor
    w2: torch.Tensor

    def route_kw(self) -> dict:
        return route_kwargs(self.model, self.bias)


def impl_callable(name: str, inp: MoEInputs, params: dict):
    """(zero-argument callable running ``name`` on this rank and returning y [T, H], its extra workspace bytes
    or None). Raises Unavailable / KernelMissing."""
    m = inp.model
    if name in KOSMOS_IMPLS:
        fn = kosmos_moe_forward()
        policy = "self" if name == "kosmos" else "fixed"
        s = None if name == "kosmos" else params["comm_programs"]
        return (lambda: fn(inp.x, inp.router_weight, inp.w13, inp.w2, top_k=m.top_k, **inp.route_kw(), group=None,
                           policy=policy, comm_programs=s)), None
    if name == "nccl-a2a":
        return (lambda: moe_forward_a2a(inp.x, inp.router_weight, inp.w13, inp.w2, top_k=m.top_k, fp32=False,
                                        **inp.route_kw())), 0
    if name == "deepep":
        return deepep_callable(inp)
    raise ValueError(f"unknown implementation {name!r}; choose from {', '.join(MOE_IMPLS)}")


_DEEPEP = {}


def deepep_callable(inp: MoEInputs):
    """DeepEP (normal, intranode mode) around the nccl-a2a GEMMs: route (same router as nccl-a2a) ->
    Buffer.get_dispatch_layout -> Buffer.dispatch (each token once per destination rank, with its top-k
    indices local to the receiver, -1 elsewhere) -> expand to one row per (token, local expert), grouped GEMMs,
    weight by the gate and sum per received token (one bmm) -> Buffer.combine (sums the ranks' partials).
    UNTESTED on a GPU: follows DeepEP's tests/test_intranode.py and Megatron's DeepEP dispatcher."""
    try:
        import deep_ep
    except Exception as e:  # ImportError, or a broken build failing at import
        raise Unavailable(f"deep_ep is not importable ({type(e).__name__}: {e})") from None
    rank, world = world_info()
    if world not in (2, 4, 8):
        raise Unavailable(f"DeepEP's intranode kernels run on 2, 4 or 8 ranks, not {world}")
    m, x = inp.model, inp.x
    hidden_bytes = x.shape[1] * max(x.element_size(), 2)
    nvl_bytes = max(cfg.get_nvl_buffer_size_hint(hidden_bytes, world)
                    for cfg in (deep_ep.Buffer.get_dispatch_config(world), deep_ep.Buffer.get_combine_config(world)))
    buf = _DEEPEP.get("buffer")
    if buf is None or _DEEPEP.get("nvl_bytes", 0) < nvl_bytes:
        _DEEPEP.clear()
        buf = _DEEPEP["buffer"] = deep_ep.Buffer(dist.group.WORLD, nvl_bytes, 0)
        _DEEPEP["nvl_bytes"] = nvl_bytes
    idx_dtype = getattr(deep_ep, "topk_idx_t", torch.int64)
    k, local = m.top_k, inp.w13.shape[0]

    def fn():
        weights, experts = route(x, inp.router_weight, k, **inp.route_kw())
        topk_idx = experts.to(idx_dtype)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, m.experts)
        recv_x, recv_idx, recv_w, recv_counts, handle, _ = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        y_part = deepep_expert_side(recv_x, recv_idx, recv_w, recv_counts, inp.w13, inp.w2, local)
        y, _, _ = buf.combine(y_part, handle)
        return y

    return fn, _DEEPEP["nvl_bytes"]


def deepep_expert_side(recv_x, recv_idx, recv_w, recv_counts, w13, w2, local: int):
    """Received tokens [R, H] with their top-k local expert indices [R, k] (-1: not on this rank) and gate
    weights [R, k] -> this rank's partial output [R, H] = sum over its local slots of w * expert(x). Pure torch
    (CPU-testable); recv_counts: list of rows per local expert (DeepEP returns it on the host)."""
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


# --------------------------------------------------------------------------- check and time


@dataclass
class MoESettings:
    impls: tuple = MOE_IMPLS
    iters: int = 20
    warmup: int = 5
    fixed_sweep: tuple = FIXED_SWEEP
    fixed_default: int = DEFAULT_FIXED_PROGRAMS
    dtype: str = "bf16"
    seed: int = 0
    expert_gemms: bool = True
    extra: dict = field(default_factory=dict)


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


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _recover(device):
    """After a failure: drop KOSMOS's (possibly poisoned) workspace and DeepEP's buffer, realign the ranks."""
    _sync(device)
    kosmos.reset_workspaces()
    _DEEPEP.clear()
    if dist.is_initialized():
        dist.barrier()


def _rel_err(out, ref) -> float:
    from kosmos.reference import rel_err
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"output is a {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
    return rel_err(out, ref)


def check_and_time(make, ref, st: MoESettings, device):
    """(status, reason, rel_err, timing dict or None, extra workspace bytes) of one implementation.
    ``make()`` -> (callable, workspace bytes or None). Every rank calls this with the same arguments."""
    return _check_and_time(make, lambda out: _rel_err(out, ref), st, device, lambda: _recover(device),
                           quiet=(KernelMissing,))


class _Memory:
    """Peak GPU memory (caching allocator) of one implementation: absolute and above what was resident."""

    def __init__(self, device):
        self.device = device
        self.base = None
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)

    def peak(self) -> tuple:
        if self.base is None:
            return None, None
        p = torch.cuda.max_memory_allocated(self.device)
        return int(_max_over_ranks(p, self.device)), int(_max_over_ranks(p - self.base, self.device))


def base_row(case: MoECase, world: int, dtype: str) -> dict:
    """The identity fields of a row of ``case`` (also used for a whole point that failed)."""
    m = moe_model(case.model)
    return {
        "type": "result", "bench": "moe", "op": "moe_fwd", "layer": "moe", "model": case.model, "seq": case.tokens,
        "m": case.tokens, "n": m.hidden, "k": m.expert_ffn, "world": world, "ep": world, "dtype": dtype,
        "tokens": case.tokens, "experts": m.experts, "top_k": m.top_k, "routing": case.routing, "hidden": m.hidden,
        "expert_ffn": m.expert_ffn,
    }


def failed_rows(case: MoECase, world: int, st: MoESettings, reason: str) -> list[dict]:
    rows = []
    names = [("moe_experts", n) for n in (EXPERT_IMPLS if st.expert_gemms else ())] + \
            [("moe_fwd", n) for n in st.impls]
    for op, name in names:
        row = base_row(case, world, st.dtype)
        row.update(op=op, layer="experts" if op == "moe_experts" else "moe", impl=name, status="failed",
                   reason=reason, time_ms=None, tflops=None)
        rows.append(row)
    return rows


def _a2a_comm_only(x, experts, local: int, world: int):
    """The NCCL all-to-alls of nccl-a2a alone (dispatch rows out, expert outputs back, same splits), or None at
    world size 1."""
    if world == 1:
        return None
    send = torch.bincount(experts.reshape(-1), minlength=local * world).view(world, local).sum(1)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send_splits, recv_splits = torch.stack([send, recv]).tolist()
    out = x.new_empty((sum(send_splits), x.shape[1]))
    got = x.new_empty((sum(recv_splits), x.shape[1]))

    def fn():
        dist.all_to_all_single(got, out, recv_splits, send_splits)
        dist.all_to_all_single(out, got, send_splits, recv_splits)
    return fn


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
        torch.cuda.empty_cache()
        torch.backends.cuda.matmul.allow_tf32 = False
        # allocate time_op's L2-flush buffer now (keyed like time_op keys it), so no impl's peak includes it
        timing.flush_l2(torch.cuda.current_device())
    m = moe_model(case.model)
    if m.experts % world:
        raise ValueError(f"{m.name} has {m.experts} experts: they do not split evenly over {world} ranks")
    local = m.experts // world
    x, wr, bias, redrawn = make_router_inputs(m, case.tokens, case.routing, rank, st.seed, device)
    w13, w2 = make_expert_weights(m, world, rank, st.seed, device)
    inp = MoEInputs(m, x, wr, bias, w13, w2)
    ref = moe_forward_a2a(x, wr, w13, w2, top_k=m.top_k, fp32=True, **inp.route_kw())

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
    comm = _a2a_comm_only(x, experts, local, world)
    t_comm = timing.time_op(comm, iters=st.iters, warmup=st.warmup)["time_ms"] if comm else 0.0
    del experts, comm
    rows = []

    def emit(op, name, status, reason, err, t, params, flops, ws, mem, t_gemm):
        tm = t["time_ms"] if t else None
        peak, peak_delta = mem.peak()
        row = base_row(case, world, st.dtype)
        row.update({
            "op": op, "layer": "experts" if op == "moe_experts" else "moe", "impl": name, "status": status,
            "reason": reason, "time_ms": tm, "p20_ms": t["p20_ms"] if t else None,
            "p80_ms": t["p80_ms"] if t else None, "tflops": flops / (tm * 1e-3) / 1e12 if tm else None,
            "rel_err": err, "t_gemm_ms": t_gemm, "t_comm_ms": t_comm if op == "moe_fwd" else None,
            "host_ms": t["host_ms"] if t else None, "workspace_bytes": ws, "peak_mem_bytes": peak,
            "peak_mem_delta_bytes": peak_delta, "params": params, "extra": dict(extra),
        })
        rows.append(row)
        if on_row:
            on_row(row)

    # expert GEMMs alone, on the row counts this rank receives (the rows' values: fresh N(0, 1))
    t_gemm = None
    if st.expert_gemms:
        n_rows = int(counts.sum().item())
        r_max = max(rows_per_rank)
        x_sorted = torch.randn(n_rows, m.hidden, generator=_gen(device, 31 * st.seed + rank), device=device,
                               dtype=torch.bfloat16)
        ref_e = _experts_forward(x_sorted, counts, w13, w2, fp32=True)
        makers = {
            "grouped-mm": lambda: ((lambda: _experts_forward(x_sorted, counts, w13, w2, fp32=False)), 0),
            "kosmos-expert-gemms": lambda: (_bind_expert_gemms(kosmos_expert_gemms(), x_sorted, counts, w13, w2),
                                            None),
        }
        for name in EXPERT_IMPLS:
            mem = _Memory(device)
            status, reason, err, t, ws = check_and_time(makers[name], ref_e, st, device)
            if name == "kosmos-expert-gemms" and status == "ok":
                ws = _kosmos_workspace_bytes(device)
            emit("moe_experts", name, status, reason, err, t, {}, 6.0 * r_max * m.hidden * m.expert_ffn, ws, mem,
                 None)
            if name == "grouped-mm" and status == "ok":
                t_gemm = t["time_ms"]
        del x_sorted, ref_e

    flops = 6.0 * case.tokens * m.top_k * m.hidden * m.expert_ffn
    grid = runtime.num_sms(device) if device.type == "cuda" else None
    for name in st.impls:
        mem = _Memory(device)
        if name in ("fixed-role", "fixed-role-best") and world == 1:
            params = {"comm_programs": st.fixed_default} if name == "fixed-role" else {}
            emit("moe_fwd", name, "unavailable", "no communication at world size 1", None, None, params, flops,
                 None, mem, t_gemm)
            continue
        if name == "fixed-role-best":
            best, first_failure = None, None
            for s in st.fixed_sweep:
                if grid is not None and not 1 <= s < grid:
                    continue
                res = check_and_time(lambda: impl_callable(name, inp, {"comm_programs": s}), ref, st, device)
                if res[0] == "ok" and (best is None or res[3]["time_ms"] < best[1][3]["time_ms"]):
                    best = (s, res)
                if res[0] != "ok" and first_failure is None:
                    first_failure = f"S={s}: {res[1]}"
                    if "not available" in res[1]:
                        break  # no kernel to sweep
            if best is None:
                emit("moe_fwd", name, "failed", f"no fixed split passed ({first_failure or 'empty sweep'})", None,
                     None, {"sweep": list(st.fixed_sweep)}, flops, None, mem, t_gemm)
            else:
                s, (status, reason, err, t, _) = best
                emit("moe_fwd", name, status, reason, err, t, {"comm_programs": s, "sweep": list(st.fixed_sweep)},
                     flops, _kosmos_workspace_bytes(device), mem, t_gemm)
            continue
        params = {"comm_programs": st.fixed_default} if name == "fixed-role" else {}
        status, reason, err, t, ws = check_and_time(lambda: impl_callable(name, inp, params), ref, st, device)
        if name in KOSMOS_IMPLS and status == "ok":
            ws = _kosmos_workspace_bytes(device)
        emit("moe_fwd", name, status, reason, err, t, params, flops, ws, mem, t_gemm)
    return rows  # the point's tensors go with this frame; bench_rank empties the CUDA cache after it


def _kosmos_workspace_bytes(device):
    """KOSMOS's symmetric workspace per rank (torch symmetric memory: not in the caching allocator's peak).
    Grow-only, so this is the most any KOSMOS call of this process has needed so far."""
    return runtime.workspace_bytes() if device.type == "cuda" else None


def _bind_expert_gemms(fn, x_sorted, counts, w13, w2):
    return lambda: fn(x_sorted, counts, w13, w2)


# --------------------------------------------------------------------------- one rank of `kosmos bench moe`


def bench_rank(rank, world, suite: dict, cases: list, out: str, argv):
    """Runs on every rank (launcher.spawn); rank 0 writes the env line and every row as soon as it is ready."""
    from .sweep import run_sweep

    st = MoESettings(impls=tuple(suite["impls"]), iters=suite["iters"], warmup=suite["warmup"],
                     fixed_sweep=tuple(suite["fixed_sweep"]), dtype=suite["dtype"], seed=suite["seed"],
                     expert_gemms=suite["expert_gemms"])
    env = environment(argv=argv, suite=suite, bench="moe")
    device = torch.device("cuda", torch.cuda.current_device())
    run_sweep(out, env, rank, [MoECase(**c) for c in cases],
              describe=lambda case: f"{case.model} tokens={case.tokens} {case.routing} EP={world}",
              run_one=lambda case, write: run_case(case, st, on_row=write, device=device),
              failed_rows=lambda case, why: failed_rows(case, world, st, why), recover=lambda: _recover(device),
              key=lambda r: (r["model"], r["tokens"], r["routing"], r["op"], r["impl"]))
