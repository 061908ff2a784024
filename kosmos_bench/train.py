"""The end-to-end training proxies (``kosmos bench train``): a small model built from KOSMOS's own modules, trained
for a few steps with each implementation swapped in layer by layer -- same weights, same data -- timing each
step and recording every step's loss, which must agree with the baseline's.

The model: ``layers`` blocks (default 2), Megatron's TP+SP layout (activations [s/W, b, hidden], sharded along
the sequence, between the parallel regions; W = ``--tp``)::

    ProxyBlock (dense, llama3 shapes: kosmos.models.dense_model)
      h = x + attn_out(SDPA_causal(split_heads(qkv(rms1(x)))))     qkv column-parallel, attn_out row-parallel
      y = h + fc2(silu(gate) * up),  gate|up = fc1(rms2(h))         fc1 column-parallel, fc2 row-parallel
    MoEProxyBlock (deepseek-v3 / qwen3-235b shapes: kosmos.models.MOE_MODELS; W = EP size, see below)
      h = x + attention (as above, its linears at W = 1), y = h + moe(rms2(h))   (routed experts, no shared one)

The full QKV weight is [q | k | v] (heads, kv_heads, kv_heads blocks of head_dim rows), the full FC1 weight
[gate | up]; each rank's shard holds its heads/W query heads and kv_heads/W KV heads as [q_r | k_r | v_r], FC1's
[gate_r | up_r] of its ffn/W columns (so the model at W ranks is the model at one, sharded); GQA by
repeating each KV head over its query heads. RMSNorm weights are replicated: their gradients are summed over the
TP ranks after the backward (Megatron's sequence-parallel norm all-reduce), for every implementation alike.

The MoE proxy at W ranks (``--tp`` is then the EP size) trains as DeepSeek-V3 does: attention data-parallel --
every rank its own ``batch`` sequences (the global batch W * batch), whole heads, its linears at W = 1 (a process
group of the rank alone, ``local_group``) -- and the experts split E/W a rank over the group; every parameter but
the experts' (attention, router, norms) is replicated and its gradient summed over the ranks after the backward
(``replicated_params``; over gloo too, CUDA tensors included). Its sizes do not depend on W, so the proxy at W
ranks is the proxy at one rank with batch W * batch (tests/test_bench_train.py compares the two).

Implementations (``impl``; default: every one of the proxy's kind, the baseline first; one that cannot train
here gets an "unavailable" row with the reason -- ``unavailable_reason`` -- and the run goes on):
  nccl+cublas    the baseline (dense): the same layers' math with NCCL collectives + torch matmuls, the autograd
                 Functions below calling kosmos.reference (all_gather_matmul_ref / matmul_reduce_scatter_ref,
                 fp32=False): forward AG+GEMM / GEMM+RS, backward dx by GEMM+RS / AG+GEMM, dW from the re-gathered
                 activation (column) or gathered gradient (row) -- exactly what kosmos.nn's layers compute.
  torch-async-tp the four TP+SP linears through torch's async-TP fused ops, as the TP bench calls them
                 (torch.ops.symm_mem.fused_all_gather_matmul(a, [W^T], gather_dim=0) /
                 fused_matmul_reduce_scatter(a, W^T, "sum", scatter_dim=0)), in autograd Functions with Megatron's
                 sequence-parallel backward: column dx = fused GEMM+RS of dy with W, dW = dy^T @ the gathered input
                 (the one the forward's fused op returned, kept as torch's compiled async-TP keeps it); row: dy
                 fused AG+GEMM with W, dW = dy_full^T @ x. Unavailable at W = 1 (nothing to overlap), at mxfp8, on
                 the CPU and over gloo (symmetric memory needs an NCCL group of one GPU per rank). Written against
                 torch 2.11's ops; on the CPU only its Functions' math is tested (torch's fallbacks of the ops).
  kosmos         kosmos.nn.ColumnParallelLinear / RowParallelLinear (the fused ops, forward and backward); at
                 W > 1 on one GPU over gloo the ops' symmetric buffers are CUDA-IPC mappings
                 (runtime.Workspace._ipc_symmetric): the real kernels and protocol, time-sliced.
  nccl-a2a       the MoE baseline: an nn.Module around kosmos.moe_reference.moe_forward_a2a (fp32=False, the
                 bench's nccl-a2a) under autograd: its row all-to-alls are differentiable (AllToAllRows: the
                 backward is the reverse all_to_all_single, the split sizes swapped), so it trains at any W.
  deepep         DeepEP V1's intranode dispatch / combine (the bench's Buffer: moe._deepep_buffer, DeepEP's
                 recommended configs) around nccl-a2a's expert GEMMs (moe.deepep_layer, as the bench's bwd rows),
                 in autograd Functions with Megatron's DeepEP backward: dispatch's is a combine of the gradient with
                 the same handle (topk_weights= the weights' gradient), combine's a cached-mode dispatch (handle=). The
                 Buffer is freed after the implementation (in step). Unavailable when deep_ep does not import, at
                 W not 2, 4 or 8 (so at W = 1) and for shapes DeepEP's kernels refuse (moe.deepep_shape_problem).
  kosmos (MoE)   kosmos.nn.MoE (its backward: kernels.moe_backward.moe_backward, one launch with the exchanges
                 as stages at W > 1); at W > 1 on CUDA ranks (one GPU per rank over NCCL, or every rank on one GPU over
                 gloo through CUDA IPC); unavailable on CPU ranks (its forward is the one-launch kernel).
In the MoE proxy the attention's linears are the dense implementation of the same name's family (kosmos ->
kosmos.nn layers, nccl-a2a and deepep -> the nccl+cublas Functions), at W = 1.

Ranks on one GPU (KOSMOS_RANKS_ON_ONE_GPU=1, launcher.py): every rank on cuda:0 over gloo -- for loss agreement
of every implementation but torch-async-tp (KOSMOS through CUDA IPC, DeepEP's intranode Buffer, the collectives
of the baselines through host copies where gloo lacks the CUDA form) at W > 1 on one GPU; the times are no
measurement, and every row says so (``extra``: {"ranks_on_one_gpu": true}, as the MoE bench marks its rows).

Weights: every parameter is drawn once from ``seed`` (a CPU generator per parameter, the full unsharded tensor,
N(0, 1/fan_in); RMSNorm weights 1) and each rank keeps its shard exactly as the kosmos layers shard it (column:
rows of [out, in], per section as above; row: columns; MoE experts: E/W, at W = 1 all of them; the MoE proxy's
attention linears whole), so every implementation starts from the same model.

Data (fixed, synthetic): step i's input x_i ~ N(0, 1) [seq, global batch, hidden] from a generator seeded
(seed, i) on the device, the same on every rank (each keeps its part: dense its sequence chunk, MoE its
sequences), and one fixed target T ~ N(0, 1) of the same shape; loss = mean((proxy(x_i) - T)^2) over the whole
global batch (each rank's part summed over the ranks). AdamW (lr 1e-3 * min(1, 1024 / hidden) -- ``adamw_lr``:
at 1e-3 a 4096-wide proxy diverges --, betas (0.9, 0.95), weight decay 0.01, fp32 moments over the bf16
parameters: torch's AdamW). The recorded loss of step i is the loss of the forward of step i (before that step's
update).

Step: forward, backward, the replicated parameters' gradient all-reduce, AdamW step, zero_grad. ``warmup`` steps
(default 3) are run and not recorded, then ``steps`` (default 20) timed: CUDA events around each step on the
GPU, max over ranks (perf_counter on the CPU). Every implementation restarts from the initial weights and the
same data, so the warm-up steps are part of every implementation's run: the recorded losses are steps
warmup..warmup+steps-1.

Agreement (``LOSS_RTOL``): every step's loss of an implementation within 2e-2 relative of the baseline's
(|l - l_base| <= 2e-2 * |l_base|; covers the final loss): bf16 activations and weights, with fp32
accumulation in different orders, drift apart by ~1e-3 over 20 steps at these sizes; a step that trains
differently -- a wrong gradient -- shows at the first step already. A disagreeing implementation's row is
"failed" with the first step that disagrees as the reason (its timing is still recorded). A non-finite loss
fails too.

Precision: ``dtype`` "bf16" (default) or "mxfp8": the kosmos layers take dtype="mxfp8" (the forward on MX values
of x and W, straight-through gradients); the baseline then quantizes the same way (kosmos.quant to_mx / from_mx
of the activation, mx_round of the weight, before the bf16 Functions, gradients straight through), so the two
still train the same model. The MoE proxy at mxfp8: kosmos.nn.MoE(dtype="mxfp8") (the MX forward, the MX backward:
every backward GEMM on MX operands along its own K, kosmos/ops/moe_backward/mx.py) and the nccl-a2a baseline
through kosmos_bench.moe_mx.moe_forward_a2a_mx_train (the same MX rounding rules as autograd Functions around its
grouped GEMMs, the experts' MX copies rounded from the parameters at every forward); its attention linears at
mxfp8 as the dense proxy's; deepep unavailable (no MXFP8 path). The loss bar is LOSS_RTOL at mxfp8 too: both train
the same MX math, and the bf16-level differences of their intermediates (the baseline's SwiGLU in bf16 on GEMM1's
bf16 output; summation orders) move an MX quantum now and then -- per-element noise that the loss, a mean over
every output element, averages (measured on the CPU, tiny shapes: see tests/test_bench_train.py's mxfp8 test).

Sizes: the model's shapes by default; ``scale`` (e.g. 0.0625) or ``hidden`` (scale = hidden / model hidden)
shrink hidden, ffn (rounded to a multiple of 32 * W, at least that), heads and kv_heads (at least W, heads a
multiple of kv_heads) for a quick run; head_dim stays unless ``head_dim`` is given. MoE: hidden and expert_ffn
scaled, the expert count, top_k and the router kept.

Rows (SCHEMA.md, "train"): one per implementation after the env line (environment.environment(bench="train")),
each with ``extra`` (a dict: ``ranks_on_one_gpu`` when so); ``world`` is the TP size (MoE: the EP size).
"""
from __future__ import annotations

import importlib
import json
import math
import statistics
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F

from kosmos import quant, reference
from kosmos.reference.moe import moe_forward_a2a
from kosmos.models import DENSE_MODELS, MOE_MODELS, dense_model

from .harness import error_reason

DENSE_IMPLS = ("nccl+cublas", "torch-async-tp", "kosmos")
MOE_IMPLS = ("nccl-a2a", "deepep", "kosmos")
BASELINE = {"dense": "nccl+cublas", "moe": "nccl-a2a"}
DTYPES = ("bf16", "mxfp8")
LOSS_RTOL = 2e-2
DEFAULT_MODEL, DEFAULT_SEQ, DEFAULT_BATCH = "llama3-8b", 4096, 1
DEFAULT_LAYERS, DEFAULT_STEPS, DEFAULT_WARMUP = 2, 20, 3
ADAMW = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
LR_HIDDEN = 1024  # the learning rate is ADAMW's lr * min(1, LR_HIDDEN / hidden): see adamw_lr


def adamw_lr(hidden: int) -> float:
    """AdamW's step moves every weight by ~lr whatever its gradient's scale, and the weights are drawn with std
    1/sqrt(fan_in): at a fixed lr the relative update grows with the width. Measured (one H200,
    results/h200x1/s9/c5/): at lr 1e-3 the llama3-8b proxy (hidden 4096) diverged in both implementations from
    the 8th step (loss 2.5 -> 13 -> 84 for nccl+cublas, 650 for kosmos: chaos, not a comparison), while the
    deepseek-v3 proxy at hidden 1792 trained smoothly (2.53 -> 2.34 over 20 steps, the two within 5e-4). So lr
    scales as 1 / hidden above 1024: 2.5e-4 at 4096, 1.25e-4 at 8192."""
    return ADAMW["lr"] * min(1.0, LR_HIDDEN / hidden)


class Unavailable(Exception):
    """An implementation that cannot train here: its row is "unavailable" with the message."""


# --------------------------------------------------------------------------- shapes


@dataclass(frozen=True)
class ProxyShape:
    model: str
    kind: str            # "dense" | "moe"
    hidden: int
    ffn: int             # dense: the MLP's ffn; MoE: expert_ffn
    heads: int
    kv_heads: int
    head_dim: int
    layers: int = DEFAULT_LAYERS
    seq: int = DEFAULT_SEQ
    batch: int = DEFAULT_BATCH
    scale: float = 1.0
    experts: int | None = None
    top_k: int | None = None
    routing: str | None = None
    route_kw: dict = field(default_factory=dict)


def _round_to(v: float, multiple: int) -> int:
    return max(multiple, int(round(v / multiple)) * multiple)


def proxy_shape(model: str = DEFAULT_MODEL, *, layers: int = DEFAULT_LAYERS, seq: int = DEFAULT_SEQ,
                batch: int = DEFAULT_BATCH, tp: int = 1, scale: float | None = None, hidden: int | None = None,
                head_dim: int | None = None) -> ProxyShape:
    """The proxy's shapes for ``model`` (dense or MoE), scaled as the module docstring says; ValueError for what
    does not fit (seq not dividing by tp, an unknown model)."""
    if model in MOE_MODELS:
        m = MOE_MODELS[model]
        base_hidden, base_ffn, heads, kv, hd = m.hidden, m.expert_ffn, 32, 8, 128  # attention: llama3-like
    elif model in DENSE_MODELS:
        d = dense_model(model)
        if not d.gated:
            raise ValueError(f"{model}: the proxy's MLP is SwiGLU (gated models only)")
        base_hidden, base_ffn, heads, kv, hd = d.hidden, d.ffn, d.heads, d.kv_heads, d.head_dim
    else:
        raise ValueError(f"unknown model {model!r} (--model); dense: {', '.join(DENSE_MODELS)}; MoE: "
                         f"{', '.join(MOE_MODELS)}")
    if hidden is not None:
        scale = hidden / base_hidden
    scale = 1.0 if scale is None else float(scale)
    if not 0 < scale <= 1:
        raise ValueError(f"--hidden {hidden}: give a size from 1 to the model's {base_hidden} (the proxy scales "
                         f"it down)" if hidden is not None else f"--scale {scale}: give a factor in (0, 1]")
    moe = model in MOE_MODELS
    if moe and m.experts % tp:
        raise ValueError(f"{model}: its {m.experts} experts do not split evenly over {tp} ranks")
    # the MoE proxy's attention is data-parallel (every rank whole heads on its own sequences) and its experts are
    # split over the ranks: only the dense proxy's sizes depend on the TP size
    sp = 1 if moe else tp
    if seq % sp:
        raise ValueError(f"--seq {seq} must divide by the TP size {tp} (sequence parallelism splits the tokens)")
    q = 32 * sp
    h = hidden if hidden is not None else (base_hidden if scale == 1 else _round_to(base_hidden * scale, q))
    f = base_ffn if scale == 1 else _round_to(base_ffn * scale, q)
    kv_s = max(sp, int(round(kv * scale)))
    heads_s = max(kv_s, int(round(heads * scale)) // kv_s * kv_s)
    for what, v in (("heads", heads_s), ("kv_heads", kv_s), ("ffn", f)):
        if v % sp:
            raise ValueError(f"{model}: {what}={v} does not divide by the TP size {tp}")
    common = dict(model=model, hidden=h, ffn=f, heads=heads_s, kv_heads=kv_s, head_dim=head_dim or hd,
                  layers=layers, seq=seq, batch=batch, scale=scale)
    if model in MOE_MODELS:
        route_kw = dict(renormalize=m.renormalize, routed_scaling=m.routed_scaling)
        if m.routing == "sigmoid-grouped":
            route_kw.update(n_group=m.n_group, topk_group=m.topk_group)
        return ProxyShape(kind="moe", experts=m.experts, top_k=m.top_k, routing=m.routing, route_kw=route_kw,
                          **common)
    return ProxyShape(kind="dense", **common)


# --------------------------------------------------------------------------- the baseline's layers


def _world(group=None) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _gather_rows(x, group):
    """allgather(x) along rows with NCCL (x itself at W = 1)."""
    w = _world(group)
    if w == 1:
        return x
    out = x.new_empty((x.shape[0] * w,) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


class _AGMatmulRef(torch.autograd.Function):
    """c = allgather(a_shard) @ b by NCCL + torch.matmul; backward as kosmos.nn.AllGatherMatmulFn's."""

    @staticmethod
    def forward(ctx, a_shard, b, group=None):
        ctx.save_for_backward(a_shard, b)
        ctx.group = group
        return reference.all_gather_matmul_ref(a_shard, b, group, fp32=False)[1]

    @staticmethod
    def backward(ctx, dc):
        a_shard, b = ctx.saved_tensors
        dc = dc.contiguous()
        da = reference.matmul_reduce_scatter_ref(dc, b.t(), ctx.group, fp32=False)
        db = _gather_rows(a_shard, ctx.group).t() @ dc if ctx.needs_input_grad[1] else None
        return da, db, None


class _MatmulRSRef(torch.autograd.Function):
    """c_shard = reduce_scatter(a @ b) by torch.matmul + NCCL; backward as kosmos.nn.MatmulReduceScatterFn's."""

    @staticmethod
    def forward(ctx, a, b, group=None):
        ctx.save_for_backward(a, b)
        ctx.group = group
        return reference.matmul_reduce_scatter_ref(a, b, group, fp32=False)

    @staticmethod
    def backward(ctx, dc_shard):
        a, b = ctx.saved_tensors
        dc_full, da = reference.all_gather_matmul_ref(dc_shard.contiguous(), b.t(), ctx.group, fp32=False)
        db = a.t() @ dc_full if ctx.needs_input_grad[1] else None
        return da, db, None


# --------------------------------------------------------------------------- torch async-TP's layers


def _symm_ops():
    """torch.ops.symm_mem (the async-TP fused ops); tests substitute torch's own fallbacks (CPU, gloo)."""
    return torch.ops.symm_mem


def _group_name(group) -> str:
    return (group if group is not None else dist.group.WORLD).group_name


class _AGMatmulAsyncTP(torch.autograd.Function):
    """c = allgather(a_shard) @ b by torch.ops.symm_mem.fused_all_gather_matmul (gather_dim 0, as the TP bench
    calls it). Backward, Megatron's sequence-parallel column layer: da = reduce_scatter(dc @ b^T) by
    fused_matmul_reduce_scatter, db = a_full^T @ dc on the gathered input the forward's fused op returned (kept,
    as torch's compiled async-TP keeps its all-gather's output for the backward: no re-gather)."""

    @staticmethod
    def forward(ctx, a_shard, b, group=None):
        name = _group_name(group)
        a_full, (c,) = _symm_ops().fused_all_gather_matmul(a_shard.contiguous(), [b], gather_dim=0, group_name=name)
        ctx.save_for_backward(a_full, b)
        ctx.group_name = name
        return c

    @staticmethod
    def backward(ctx, dc):
        a_full, b = ctx.saved_tensors
        dc = dc.contiguous()
        da = _symm_ops().fused_matmul_reduce_scatter(dc, b.t(), "sum", scatter_dim=0,
                                                   group_name=ctx.group_name)
        db = a_full.t() @ dc if ctx.needs_input_grad[1] else None
        return da, db, None


class _MatmulRSAsyncTP(torch.autograd.Function):
    """c_shard = reduce_scatter(a @ b) by torch.ops.symm_mem.fused_matmul_reduce_scatter ("sum", scatter_dim 0).
    Backward, Megatron's sequence-parallel row layer: (dc_full, da) = allgather(dc_shard), allgather(dc_shard) @
    b^T by fused_all_gather_matmul, db = a^T @ dc_full."""

    @staticmethod
    def forward(ctx, a, b, group=None):
        name = _group_name(group)
        ctx.save_for_backward(a, b)
        ctx.group_name = name
        return _symm_ops().fused_matmul_reduce_scatter(a.contiguous(), b, "sum", scatter_dim=0, group_name=name)

    @staticmethod
    def backward(ctx, dc_shard):
        a, b = ctx.saved_tensors
        dc_full, (da,) = _symm_ops().fused_all_gather_matmul(dc_shard.contiguous(), [b.t()], gather_dim=0,
                                                             group_name=ctx.group_name)
        db = a.t() @ dc_full if ctx.needs_input_grad[1] else None
        return da, db, None


def async_tp_problem(world: int, dtype: str = "bf16", device="cpu", backend: str | None = None) -> str | None:
    """Why torch-async-tp cannot train here (None: it can): W = 1 (nothing to overlap), mxfp8, a CPU run or a
    group other than NCCL (symmetric memory needs one GPU per rank: not gloo, not every rank on one GPU), or a
    torch without the fused ops."""
    if world == 1:
        return ("torch async-TP at W = 1: there is nothing to overlap (no all-gather or reduce-scatter to fuse with "
                "the GEMMs); it needs >= 2 ranks")
    if dtype != "bf16":
        return "no MXFP8 path in torch async-TP"
    if torch.device(device).type != "cuda" or backend != "nccl":
        where = "the CPU" if torch.device(device).type != "cuda" else f"a {backend} group"
        return ("torch async-TP's fused ops need symmetric memory over an NCCL group of one GPU per rank; this run "
                f"is on {where}")
    try:
        importlib.import_module("torch.distributed._symmetric_memory")  # defines the torch.ops.symm_mem ops
    except Exception as e:
        return f"torch {torch.__version__}: torch.distributed._symmetric_memory does not import ({e})"
    ops = getattr(torch.ops, "symm_mem", None)
    missing = [n for n in ("fused_all_gather_matmul", "fused_matmul_reduce_scatter")
               if ops is None or not hasattr(ops, n)]
    if missing:
        return f"torch {torch.__version__} has no torch.ops.symm_mem.{' / '.join(missing)}"
    return None


class _StraightThrough(torch.autograd.Function):
    """q in the forward, the gradient passed to x unchanged (the MX layers' contract)."""

    @staticmethod
    def forward(ctx, x, q):
        return q

    @staticmethod
    def backward(ctx, g):
        return g, None


def _mx_act(x2d):
    return _StraightThrough.apply(x2d, quant.from_mx(quant.to_mx(x2d.detach().contiguous())))


class _RefParallelLinear(torch.nn.Module):
    """The baseline's column / row parallel linear: kosmos.nn's layer math (same weight layout and sharding) with
    NCCL + torch matmuls; ``precision`` "mxfp8" quantizes x and W as the kosmos layer does."""

    ag_matmul, matmul_rs = _AGMatmulRef, _MatmulRSRef  # the forward's collectives + GEMMs and their backward

    def __init__(self, in_features, out_features, *, shard_out: bool, group=None, device=None,
                 dtype=torch.bfloat16):
        super().__init__()
        self.precision = dtype if isinstance(dtype, str) else "bf16"
        w = _world(group)
        self.in_features, self.out_features, self.group, self.shard_out = in_features, out_features, group, shard_out
        shape = (out_features // w, in_features) if shard_out else (out_features, in_features // w)
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=torch.bfloat16))

    def forward(self, x):
        w = _world(self.group)
        k = self.weight.shape[1]
        a = x.reshape(-1, k)
        wt = self.weight.t()
        if self.precision == "mxfp8":
            a = _mx_act(a)
            wt = _StraightThrough.apply(self.weight, quant.mx_round(self.weight.detach())).t()
        if self.shard_out:
            y = self.ag_matmul.apply(a, wt, self.group)
            return y.view((x.shape[0] * w,) + tuple(x.shape[1:-1]) + (self.weight.shape[0],))
        y = self.matmul_rs.apply(a, wt, self.group)
        return y.view((x.shape[0] // w,) + tuple(x.shape[1:-1]) + (self.out_features,))


class _AsyncTPParallelLinear(_RefParallelLinear):
    """The torch-async-tp column / row parallel linear: the same weight layout and math, the forward by torch's
    fused async-TP ops, the backward Megatron's (_AGMatmulAsyncTP / _MatmulRSAsyncTP). bf16 only."""
    ag_matmul, matmul_rs = _AGMatmulAsyncTP, _MatmulRSAsyncTP


def make_linear(family: str, column: bool, in_features: int, out_features: int, *, group=None, device=None,
                dtype="bf16"):
    """A column (``column``) or row parallel linear of ``family`` ("kosmos", "nccl+cublas" or
    "torch-async-tp")."""
    layer_dtype = torch.bfloat16 if dtype == "bf16" else dtype
    if family == "kosmos":
        import kosmos.nn as knn
        cls = knn.ColumnParallelLinear if column else knn.RowParallelLinear
        return cls(in_features, out_features, group=group, device=device, dtype=layer_dtype)
    if family in ("nccl+cublas", "torch-async-tp"):
        cls = _RefParallelLinear if family == "nccl+cublas" else _AsyncTPParallelLinear
        return cls(in_features, out_features, shard_out=column, group=group, device=device, dtype=layer_dtype)
    raise ValueError(f"unknown linear family {family!r}")


class A2AMoE(torch.nn.Module):
    """The nccl-a2a MoE baseline with autograd at any W: moe_reference.moe_forward_a2a(fp32=False) (differentiable
    all-to-alls) on parameters laid out as kosmos.nn.MoE's (router [E, H], w13 [E/W, H, 2F],
    w2 [E/W, F, H]). ``precision`` "mxfp8": moe_mx.moe_forward_a2a_mx_train(fp32=False) instead (the MX layer with
    kosmos's MX backward rules), the experts' MX copies rounded from the parameters at every forward."""

    def __init__(self, hidden, expert_ffn, experts, top_k, *, routing="softmax", group=None, device=None,
                 precision="bf16", **route_kw):
        super().__init__()
        local = experts // _world(group)
        kw = dict(device=device, dtype=torch.bfloat16)
        self.precision = precision
        self.group, self.top_k, self.routing, self.route_kw = group, top_k, routing, route_kw
        self.experts = experts
        self.router_weight = torch.nn.Parameter(torch.empty(experts, hidden, **kw))
        self.w13 = torch.nn.Parameter(torch.empty(local, hidden, 2 * expert_ffn, **kw))
        self.w2 = torch.nn.Parameter(torch.empty(local, expert_ffn, hidden, **kw))
        self.bias = (torch.nn.Parameter(torch.zeros(experts, device=device, dtype=torch.float32), requires_grad=False)
                     if routing == "sigmoid-grouped" else None)

    def _route_kw(self) -> dict:
        kw = dict(self.route_kw)
        if self.bias is not None:
            kw["bias"] = self.bias
        return kw

    def forward(self, x):
        if self.precision == "mxfp8":
            from kosmos.ops.moe_backward import moe_mx_weights

            from . import moe_mx
            return moe_mx.moe_forward_a2a_mx_train(x, self.router_weight, self.w13, self.w2,
                                                   moe_mx_weights(self.w13.detach(), self.w2.detach()),
                                                   top_k=self.top_k, routing=self.routing, group=self.group,
                                                   fp32=False, **self._route_kw())
        return moe_forward_a2a(x, self.router_weight, self.w13, self.w2, top_k=self.top_k, routing=self.routing,
                             group=self.group, fp32=False, **self._route_kw())


class DeepEPMoE(A2AMoE):
    """The deepep MoE baseline with autograd: moe.deepep_layer (the router nccl-a2a runs, DeepEP V1's intranode
    dispatch -> moe.deepep_expert_side, the same _experts_forward grouped GEMMs as nccl-a2a and the gate-weighted
    sum of a received token's local slots -> DeepEP's combine), both exchanges autograd Functions. The Buffer: the
    bench's (moe._deepep_buffer: DeepEP's recommended configs and sizing, on the world group), freed by run_train
    after the implementation (moe.deepep_release, in step). The same parameters (names, order, layout) as A2AMoE,
    so the same weights."""

    def forward(self, x):
        import deep_ep

        from . import moe
        buf, configs = moe._deepep_buffer(deep_ep, _world(self.group), x.shape[1] * max(x.element_size(), 2))
        return moe.deepep_layer(buf, configs, x, self.router_weight, self.w13, self.w2, top_k=self.top_k,
                                n_experts=self.experts, routing=self.routing, **self._route_kw())


def deepep_problem(shape: "ProxyShape", world: int) -> str | None:
    """Why the deepep baseline cannot train ``shape`` at ``world`` ranks (None: it can): deep_ep not importable,
    W not 2, 4 or 8 (so never at W = 1), or a shape DeepEP's intranode kernels refuse (moe.py)."""
    from types import SimpleNamespace

    from . import moe
    ok, why = moe.deepep_available(world)
    if not ok:
        return why
    return moe.deepep_shape_problem(SimpleNamespace(hidden=shape.hidden, experts=shape.experts, top_k=shape.top_k),
                                    world)


# --------------------------------------------------------------------------- the proxy


class ProxyBlock(torch.nn.Module):
    """One transformer block (module docstring): x [s/W, b, hidden] -> [s/W, b, hidden]. ``mlp``: None for the
    TP SwiGLU MLP, or a module [T, hidden] -> [T, hidden] (the MoE proxy, at W = 1)."""

    def __init__(self, shape: ProxyShape, family: str, *, group=None, device=None, dtype="bf16", mlp=None):
        super().__init__()
        w = _world(group)
        self.shape, self.group, self.world = shape, group, w
        h, hd = shape.hidden, shape.head_dim
        self.heads_local, self.kv_local = shape.heads // w, shape.kv_heads // w
        self.norm1 = torch.nn.RMSNorm(h, eps=1e-5, device=device, dtype=torch.bfloat16)
        self.norm2 = torch.nn.RMSNorm(h, eps=1e-5, device=device, dtype=torch.bfloat16)
        lin = dict(group=group, device=device, dtype=dtype)
        self.qkv = make_linear(family, True, h, (shape.heads + 2 * shape.kv_heads) * hd, **lin)
        self.attn_out = make_linear(family, False, shape.heads * hd, h, **lin)
        self.mlp = mlp
        if mlp is None:
            self.fc1 = make_linear(family, True, h, 2 * shape.ffn, **lin)
            self.fc2 = make_linear(family, False, shape.ffn, h, **lin)

    def attention(self, x):
        s, b = x.shape[0] * self.world, x.shape[1]
        hd, hq, hk = self.shape.head_dim, self.heads_local, self.kv_local
        qkv = self.qkv(self.norm1(x))  # [s, b, (hq + 2 hk) hd]
        q, k, v = qkv.split([hq * hd, hk * hd, hk * hd], dim=-1)
        q, k, v = (t.reshape(s, b, -1, hd).permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hd]
        if hq != hk:
            k, v = (t.repeat_interleave(hq // hk, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.attn_out(o.permute(2, 0, 1, 3).reshape(s, b, hq * hd))

    def forward(self, x):
        x = x + self.attention(x)
        y = self.norm2(x)
        if self.mlp is not None:
            return x + self.mlp(y.reshape(-1, y.shape[-1])).view_as(y)
        gate, up = self.fc1(y).chunk(2, dim=-1)
        return x + self.fc2(F.silu(gate) * up)


class Proxy(torch.nn.Module):
    """``blocks`` in sequence. ``data_parallel``: the MoE proxy at W > 1 (attention, router and norms replicated,
    each rank on its own sequences: every replicated parameter's gradient is summed over the ranks)."""

    def __init__(self, blocks, data_parallel: bool = False):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)
        self.data_parallel = data_parallel

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


_LOCAL_GROUPS = {}


def local_group(group=None):
    """A process group of this rank alone (the MoE proxy's data-parallel attention runs its linears at W = 1):
    ``dist.new_group([r], backend="gloo")`` for every rank r of ``group`` (collective: every rank makes all of
    them, in the same order), made once per group; None without a process group. Its linears make no collective
    call (W = 1: kosmos.reference copies and multiplies), so gloo serves CUDA tensors too and no NCCL
    communicator is split off for it."""
    if _world(group) == 1:
        return group
    key = id(group)
    if key not in _LOCAL_GROUPS:
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        mine = None
        for r in ranks:
            g = dist.new_group([r], backend="gloo")
            if r == dist.get_rank():
                mine = g
        _LOCAL_GROUPS[key] = mine
    return _LOCAL_GROUPS[key]


def _backend(group=None) -> str | None:
    return dist.get_backend(group) if dist.is_initialized() and _world(group) > 1 else None


def unavailable_reason(shape: ProxyShape, impl: str, world: int, dtype: str = "bf16", *, device="cpu",
                       backend: str | None = None) -> str | None:
    """Why ``impl`` cannot train ``shape`` at ``world`` ranks (None: it can); ``backend``: the group's ("nccl",
    "gloo"; None at W = 1). On a GPU over gloo (KOSMOS_RANKS_ON_ONE_GPU: every rank on one GPU) torch async-TP's
    W > 1 ops cannot run (symmetric memory needs one GPU per rank); KOSMOS's run through CUDA IPC (runtime.py),
    the baselines and DeepEP as they are. On CPU ranks kosmos.nn.MoE cannot run (its one-launch forward)."""
    cuda = torch.device(device).type == "cuda"
    if shape.kind == "moe":
        if dtype != "bf16" and impl == "deepep":
            return "no MXFP8 path in the deepep baseline"
        if impl == "kosmos" and world > 1 and not cuda:
            return (f"kosmos.nn.MoE at W > 1 needs CUDA ranks (its forward is the one-launch layer over symmetric "
                    f"memory or CUDA IPC); here CPU ranks over {backend}")
        if impl == "deepep":
            return deepep_problem(shape, world)
        return None
    if impl == "torch-async-tp":
        return async_tp_problem(world, dtype, device, backend)
    return None


def build_proxy(shape: ProxyShape, impl: str, *, group=None, device="cpu", dtype="bf16", seed: int = 0,
                rank: int = 0) -> Proxy:
    """The proxy of ``impl`` with the weights of ``seed`` (this rank's shards); raises Unavailable for what
    cannot train here (``unavailable_reason``)."""
    w = _world(group)
    known = MOE_IMPLS if shape.kind == "moe" else DENSE_IMPLS
    if impl not in known:
        raise ValueError(f"unknown {shape.kind} proxy implementation {impl!r}; choose from {', '.join(known)}")
    local = local_group(group) if shape.kind == "moe" else group  # collective at W > 1: before any refusal
    why = unavailable_reason(shape, impl, w, dtype, device=device, backend=_backend(group))
    if why:
        raise Unavailable(why)
    if shape.kind == "moe":
        family = "kosmos" if impl == "kosmos" else "nccl+cublas"
        blocks = []
        for _ in range(shape.layers):
            if impl == "kosmos":
                import kosmos.nn as knn
                mlp = knn.MoE(shape.hidden, shape.ffn, shape.experts, shape.top_k, routing=shape.routing,
                              group=group, device=device, dtype=torch.bfloat16 if dtype == "bf16" else dtype,
                              **shape.route_kw)
            else:
                cls = DeepEPMoE if impl == "deepep" else A2AMoE
                mlp = cls(shape.hidden, shape.ffn, shape.experts, shape.top_k, routing=shape.routing, group=group,
                          device=device, precision=dtype, **shape.route_kw)
            # attention data-parallel: its linears at W = 1 (a group of this rank alone), the experts over group
            blocks.append(ProxyBlock(shape, family, group=local, device=device, dtype=dtype, mlp=mlp))
    else:
        if impl == "torch-async-tp" and torch.device(device).type == "cuda":
            import warnings

            import torch.distributed._symmetric_memory as symm_mem
            if hasattr(symm_mem, "enable_symm_mem_for_group"):  # as the TP bench (deprecated, a no-op, in newer torch)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", FutureWarning)
                    symm_mem.enable_symm_mem_for_group(_group_name(group))
        blocks = [ProxyBlock(shape, impl, group=group, device=device, dtype=dtype) for _ in range(shape.layers)]
    proxy = Proxy(blocks, data_parallel=shape.kind == "moe" and w > 1)
    init_weights(proxy, seed, rank, w)
    return proxy


def _shard_of(owner, rank: int, world: int) -> tuple[int, int]:
    """(rank, world) of the parameters of module ``owner``: its own group's (a linear of the MoE proxy's
    data-parallel attention: (0, 1)), else this process's."""
    ow = _world(getattr(owner, "group", None))
    return (rank, world) if ow == world else (0, ow)


def init_weights(proxy: Proxy, seed: int, rank: int, world: int) -> None:
    """Every parameter from ``seed`` (module docstring): the full tensor drawn on the CPU, this rank's shard kept.
    Column layers: rows (chunk r of dim 0); row layers: columns (chunk r of dim 1); MoE experts: chunk r of dim 0;
    router and norms replicated (and the MoE proxy's attention linears at W > 1: their group is this rank
    alone)."""
    full_world, full_rank = world, rank
    with torch.no_grad():
        for index, (name, p) in enumerate(proxy.named_parameters()):
            if name.endswith("norm1.weight") or name.endswith("norm2.weight"):
                p.fill_(1.0)
                continue
            if name.endswith(".bias"):  # the sigmoid-grouped router's bias: zeros, no gradient
                p.zero_()
                continue
            g = torch.Generator().manual_seed(seed * 1_000_003 + index)
            owner = proxy.get_submodule(name.rsplit(".", 1)[0])
            rank, world = _shard_of(owner, full_rank, full_world)
            if name.endswith("router_weight"):
                full, dim = torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]), None
            elif name.endswith("w13") or name.endswith("w2"):
                full = torch.randn((p.shape[0] * world,) + tuple(p.shape[1:]), generator=g) / math.sqrt(p.shape[1])
                dim = 0
            else:
                column = getattr(owner, "shard_out", None)
                if column is None:  # a kosmos.nn layer
                    import kosmos.nn as knn
                    column = isinstance(owner, knn.ColumnParallelLinear)
                shape = (p.shape[0] * world, p.shape[1]) if column else (p.shape[0], p.shape[1] * world)
                full, dim = torch.randn(shape, generator=g) / math.sqrt(shape[1]), (0 if column else 1)
                sections = _column_sections(proxy, name) if column else None
                if sections:  # [q | k | v] / [gate | up]: this rank's share of each section
                    p.copy_(torch.cat([part.chunk(world, 0)[rank] for part in full.split(sections)]).to(p.dtype))
                    continue
            p.copy_((full if dim is None else full.chunk(world, dim)[rank]).to(p.dtype))


def _column_sections(proxy: Proxy, name: str):
    """The row sections of a full column weight: QKV [q | k | v] (heads*hd, kv*hd, kv*hd), FC1 [gate | up]."""
    shape = proxy.blocks[0].shape
    if name.endswith("qkv.weight"):
        return [shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.kv_heads * shape.head_dim]
    if name.endswith("fc1.weight"):
        return [shape.ffn, shape.ffn]
    return None


def replicated_params(proxy: Proxy):
    """The parameters every rank holds whole whose gradients come from its own tokens, summed over the ranks after
    the backward: the dense proxy's norms (each rank its sequence chunk); the MoE proxy's at W > 1 every parameter
    but the experts' (data-parallel attention, router and norms: each rank its own sequences)."""
    if getattr(proxy, "data_parallel", False):
        return [p for n, p in proxy.named_parameters() if p.requires_grad and not n.endswith((".w13", ".w2"))]
    return [p for n, p in proxy.named_parameters() if "norm" in n]


# --------------------------------------------------------------------------- training


@dataclass
class TrainSettings:
    impls: tuple = ()
    steps: int = DEFAULT_STEPS
    warmup: int = DEFAULT_WARMUP
    dtype: str = "bf16"
    seed: int = 0
    loss_rtol: float = LOSS_RTOL
    extra: dict = field(default_factory=dict)  # every row's ``extra`` (e.g. ranks_on_one_gpu)


def global_batch(shape: ProxyShape, world: int) -> int:
    """Sequences per step over all ranks: ``batch`` (dense: TP+SP, every rank a chunk of the same sequences), or
    ``batch`` per rank (MoE: data-parallel attention, every rank its own ``batch`` sequences)."""
    return shape.batch * (world if shape.kind == "moe" else 1)


def _rank_part(t, shape: ProxyShape, rank: int, world: int):
    """This rank's part of a [seq, global batch, hidden] tensor: dense its sequence chunk, MoE its sequences."""
    return t.chunk(world, 1 if shape.kind == "moe" else 0)[rank]


def step_input(shape: ProxyShape, step: int, seed: int, device, rank: int, world: int):
    """Step ``step``'s input: x ~ N(0, 1) [seq, global batch, hidden] (seeded (seed, step), the same on every
    rank), this rank's part (``_rank_part``), bf16."""
    g = torch.Generator(device=device).manual_seed(seed * 7919 + 1 + step)
    x = torch.randn(shape.seq, global_batch(shape, world), shape.hidden, generator=g, device=device)
    return _rank_part(x, shape, rank, world).to(torch.bfloat16).contiguous()


def fixed_target(shape: ProxyShape, seed: int, device, rank: int, world: int):
    g = torch.Generator(device=device).manual_seed(seed * 7919 + 104729)
    t = torch.randn(shape.seq, global_batch(shape, world), shape.hidden, generator=g, device=device)
    return _rank_part(t, shape, rank, world).contiguous()


def _sum_over_ranks(t, group=None):
    if _world(group) > 1:
        dist.all_reduce(t, group=group)
    return t


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """One step's time in ms from construction to ``stop()``: CUDA events on the GPU (``stop`` waits for the
    step's kernels), perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = torch.device(device).type == "cuda"
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        if self.cuda:
            self.end.record()
            self.end.synchronize()
            return self.start.elapsed_time(self.end)
        return (time.perf_counter() - self.t0) * 1e3


def train_losses(proxy: Proxy, shape: ProxyShape, st: TrainSettings, device, *, group=None, rank=0,
                 timed: bool = True):
    """Run ``st.warmup + st.steps`` steps of ``proxy``; returns (losses of the timed steps, step times in ms)."""
    world = _world(group)
    n_total = shape.seq * global_batch(shape, world) * shape.hidden
    target = fixed_target(shape, st.seed, device, rank, world)
    opt = torch.optim.AdamW(proxy.parameters(), **{**ADAMW, "lr": adamw_lr(shape.hidden)})
    shared = replicated_params(proxy)
    losses, times = [], []
    for i in range(st.warmup + st.steps):
        x = step_input(shape, i, st.seed, device, rank, world)
        _sync(device)
        if world > 1:
            dist.barrier()
        clock = StepClock(device)
        y = proxy(x)
        local = ((y.float() - target) ** 2).sum() / n_total
        local.backward()
        for p in shared:
            if p.grad is None and world > 1:  # every rank joins every all-reduce (a rank without a path: zeros)
                p.grad = torch.zeros_like(p)
            if p.grad is not None:
                _sum_over_ranks(p.grad, group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ms = clock.stop()
        loss = _sum_over_ranks(local.detach().double().reshape(1), group)
        if i >= st.warmup:
            losses.append(loss.item())
            times.append(ms)
    if world > 1:  # the step time: max over ranks per step
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        times = t.tolist()
    return losses, times


def loss_disagreement(losses, base, rtol: float = LOSS_RTOL) -> str | None:
    """None when every step's loss is within ``rtol`` of the baseline's (and finite), else the reason naming the
    first step that is not."""
    if len(losses) != len(base):
        return f"{len(losses)} losses against the baseline's {len(base)}"
    for i, (l, b) in enumerate(zip(losses, base)):
        if not math.isfinite(l):
            return f"loss at step {i} is {l}"
        if not abs(l - b) <= rtol * abs(b):
            return f"loss at step {i} {l:.6g} vs the baseline's {b:.6g} (rel diff {abs(l - b) / abs(b):.2e} > " \
                   f"{rtol:.0e}): trains differently"
    return None


def max_rel_diff(losses, base) -> float | None:
    if not losses or not base or len(losses) != len(base):
        return None
    return max(abs(l - b) / abs(b) if b else abs(l - b) for l, b in zip(losses, base))


def identity(shape: ProxyShape, world: int, dtype: str) -> dict:
    """The identity keys of a train row."""
    return {"type": "result", "bench": "train", "model": shape.model, "kind": shape.kind, "layers": shape.layers,
            "seq": shape.seq, "batch": shape.batch, "hidden": shape.hidden, "ffn": shape.ffn, "heads": shape.heads,
            "kv_heads": shape.kv_heads, "head_dim": shape.head_dim, "experts": shape.experts, "top_k": shape.top_k,
            "scale": shape.scale, "world": world, "dtype": dtype}


def _agree(ok: bool, why, group=None):
    if _world(group) == 1:
        return ok, why
    got = [None] * _world(group)
    dist.all_gather_object(got, (ok, why), group=group)
    for r, (o, w) in enumerate(got):
        if not o:
            return False, w if all(not g[0] and g[1] == w for g in got) else f"rank {r}: {w}"
    return True, None


def run_train(shape: ProxyShape, st: TrainSettings, device="cpu", *, group=None, rank: int | None = None,
              on_row=None, build=build_proxy) -> list[dict]:
    """Train the proxy with each implementation of ``st.impls`` (the baseline first, whatever the order given) and
    return a row per implementation (every rank the same rows); ``on_row(row)`` as each is ready; ``rank``: this
    process's rank in ``group`` (default: its rank there). ``build``:
    (shape, impl, **kw) -> Proxy (tests pass a perturbed one)."""
    world = _world(group)
    if rank is None:
        rank = dist.get_rank(group) if dist.is_initialized() else 0
    if shape.kind == "moe":
        local_group(group)  # collective (new_group): every rank here, before any implementation

    def attempt(name):
        proxy = build(shape, name, group=group, device=device, dtype=st.dtype, seed=st.seed, rank=rank)
        return train_losses(proxy, shape, st, device, group=group, rank=rank)

    def after(name, ok):
        if name == "deepep":  # DeepEP's Buffer freed in step (its destroy is a barrier): only when every rank is ok
            from . import moe
            moe.deepep_release(destroy=ok)

    return train_rows(st.impls or (MOE_IMPLS if shape.kind == "moe" else DENSE_IMPLS), BASELINE[shape.kind],
                      attempt, identity(shape, world, st.dtype), shape.seq * shape.batch /
                      (world if shape.kind == "dense" else 1), st, device, group=group, on_row=on_row, after=after)


def train_rows(impls, base_name: str, attempt, identity_row: dict, tokens_per_gpu: float, st: TrainSettings, device,
               *, group=None, on_row=None, after=None) -> list[dict]:
    """One train row per implementation (the baseline ``base_name`` first): ``attempt(name)`` trains it and returns
    (losses, step times in ms), raising Unavailable when it cannot run here (an "unavailable" row) or anything
    else (a "failed" row with the reason; the others still run). The ranks agree on each outcome; the losses are
    checked against the baseline's (``loss_disagreement``); ``after(name, ok)`` runs after each attempt (every
    rank); ``on_row(row)`` as each row is ready. Rows: ``identity_row`` plus the fields of SCHEMA.md's train rows."""
    world = _world(group)
    impls = sorted(impls, key=lambda n: n != base_name)
    rows, base_losses = [], None
    cuda = torch.device(device).type == "cuda"
    for name in impls:
        row = dict(identity_row)
        row.update(impl=name, baseline=name == base_name, steps=st.steps, warmup=st.warmup, status="ok", reason=None,
                   step_ms=None, step_p20_ms=None, step_p80_ms=None, step_times_ms=None, tokens_per_s=None,
                   peak_mem_bytes=None, losses=None, final_loss=None, loss_rtol=st.loss_rtol,
                   loss_max_rel_diff=None, extra={**st.extra, **identity_row.get("extra", {})})
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        result = {}
        try:
            result["losses"], result["times"] = attempt(name)
            ok, why = True, None
        except Unavailable as e:
            ok, why = False, "unavailable: " + str(e)
        except Exception as e:  # recorded, the other implementations still run
            traceback.print_exc()
            ok, why = False, error_reason(e)
        ok, why = _agree(ok, why, group)
        if after:
            after(name, ok)
        if not ok:
            row["status"] = "unavailable" if why.startswith("unavailable: ") else "failed"
            row["reason"] = why.replace("unavailable: ", "", 1) if row["status"] == "unavailable" else why
            if name == base_name:
                base_losses = None
        else:
            losses, times = result["losses"], result["times"]
            ms = statistics.median(times)
            q = statistics.quantiles(times, n=5) if len(times) >= 2 else [times[0]] * 4
            peak = torch.cuda.max_memory_allocated(device) if cuda else 0
            if cuda and world > 1:
                t = torch.tensor([float(peak)], device=device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
                peak = int(t.item())
            row.update(step_ms=ms, step_p20_ms=q[0], step_p80_ms=q[3], step_times_ms=times,
                       tokens_per_s=tokens_per_gpu / (ms * 1e-3) if ms > 0 else None, peak_mem_bytes=int(peak),
                       losses=losses, final_loss=losses[-1] if losses else None)
            if name == base_name:
                base_losses = losses
                bad = next((f"loss at step {i} is {l}" for i, l in enumerate(losses) if not math.isfinite(l)), None)
            elif base_losses is None:
                bad = None
                row["reason"] = f"losses not compared: the baseline {base_name} did not train"
            else:
                bad = loss_disagreement(losses, base_losses, st.loss_rtol)
                row["loss_max_rel_diff"] = max_rel_diff(losses, base_losses)
            if bad:
                row.update(status="failed", reason=bad)
        rows.append(row)
        if on_row:
            on_row(row)
    return rows


# --------------------------------------------------------------------------- ranks and the command


def train_rank(rank: int, world: int, shape_kw: dict, st_kw: dict, out: str, argv, cpu: bool = False):
    """One rank of `kosmos bench train` (launcher.spawn; ``cpu``: on the CPU in this process, as the tests run it):
    rank 0 writes the env line and every row as it is ready."""
    from .environment import environment
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    shape = proxy_shape(tp=world, **shape_kw)
    st = TrainSettings(**st_kw)
    from .launcher import ranks_on_one_gpu
    if not cpu and world > 1 and ranks_on_one_gpu():  # every rank on cuda:0 over gloo: loss agreement only
        st.extra = {**st.extra, "ranks_on_one_gpu": True}
    env = environment(argv=argv, bench="train")
    f = open(out, "a") if rank == 0 else None

    def write(row):
        if f:
            f.write(json.dumps({**row, "run_id": env["run_id"]}) + "\n")
            f.flush()
    try:
        if f:
            f.write(json.dumps(env) + "\n")
            f.flush()
        run_train(shape, st, device, rank=rank, on_row=write)
    finally:
        if f:
            f.close()
