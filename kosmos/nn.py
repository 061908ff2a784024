"""Drop-in modules and autograd functions over the fused ops.

Tensor + sequence parallelism (Megatron's layout: activations sharded along the sequence, dim 0, between the
parallel regions; weights in ``nn.Linear``'s [out, in] layout):

``ColumnParallelLinear``  y [s, ..., out/W] = allgather_s(x [s/W, ..., in]) @ W_local^T   (QKV, FC1)
    forward  all_gather_matmul(x_shard, W_local^T)
    backward dx_shard = reduce_scatter(dy @ W_local)       -> matmul_reduce_scatter(dy, W_local)
             dW_local = dy^T @ allgather(x_shard)           (x re-gathered with NCCL, not kept: activation memory)
``RowParallelLinear``     y [s/W, ..., out] = reduce_scatter_s(x [s, ..., in/W] @ W_local^T)  (attn-out, FC2)
    forward  matmul_reduce_scatter(x, W_local^T)
    backward dx = allgather(dy_shard) @ W_local            -> all_gather_matmul(dy_shard, W_local)
             dW_local = allgather(dy_shard)^T @ x           (the gathered dy comes out of the same launch)
so every collective of the layer, forward and backward, runs fused with a GEMM. No bias (add it outside: with
sequence parallelism a bias belongs after the reduce-scatter, on the sharded output).

Precision: ``dtype=torch.bfloat16`` (default) or ``dtype="mxfp8"``. MXFP8 keeps the parameter in bf16 (the
master weight) and computes the forward on MX values: the activation is quantized per call (``quant.to_mx``,
what the AllGather moves), the weight's MX values (``quant.mx_round``, blocks along ``in``) are cached until the
parameter changes (its ``_version``). The backward uses the forward's MX operands with the incoming gradient in
bf16 -- dx = dy @ W_mx (fused as above), dW = dy^T @ x_mx (x_mx's payload and scales are kept, 1.03 bytes per
element; a column layer re-gathers them with NCCL, 0.52x of the bf16 bytes) -- and passes the gradients
straight through the quantizers to x and the master weight (the MX training recipes do the same; dy itself
is not quantized here). ``dtype="fp8-block"`` (tensor-parallel size 1 so far; in and out multiples of 128):
block-scaled FP8 on the FP8 tensor cores (``FP8BlockLinearFn``), the weight's 128x128 blocks cached as above,
every backward GEMM on operands quantized along its own K.

``MoE`` -- the routed-expert part of an MoE layer in one launch (``kosmos.moe_forward``). It trains at any
expert-parallel size: the backward is ``kosmos.ops.moe_backward.moe_backward`` (every gradient from the forward's
routing decision; bf16: one launch for the expert part at one rank, and at W > 1 on CUDA one launch with the
exchanges as its stages (GEMM1 recomputed inside it); the multi-launch path with all-to-alls between launches on the
CPU and with ``save_gate_up=True`` at W > 1).
``dtype="mxfp8"`` trains too: bf16 parameters (the master weights), the forward on MX values
(``moe_forward(precision="mxfp8")``: x quantized per call, the experts' MX values along H / F), and the MX backward
(``moe_backward(precision="mxfp8")``, kosmos/ops/moe_backward/mx.py): every backward GEMM multiplies both its
operands' MX values with blocks of 32 along that GEMM's own K -- dgrad2 dy and W2 along H, wgrad2 h and w*dy along
the rows, dgrad1 [dg | du] and W13 along 2F, wgrad1 x and [dg | du] along the rows (blocks of 32 rows of one expert)
-- each rounded from its bf16 values, with fp32 accumulation, the SwiGLU, gate and router backward in fp32 and the
gradients straight through the quantizers. This differs from the linears' rule above (the forward's MX operands,
dy in bf16): every MoE backward GEMM, dy included, is an MX GEMM. It runs on the multi-launch path at any W (the
one launch is bf16 only) and recomputes g | u on the MX operands (``save_gate_up`` applies to bf16); the module
keeps four MX copies of its expert weights (``MoEMXWeights``: the forward's two, the backward's two -- W13 along 2F,
W2 along H) until a parameter changes, two while it only runs without gradients.
The forward keeps x, the parameters and the routing (weights, experts: T*k each), and by default at one rank
GEMM1's g | u (T*k x 2F bf16 and the rows' (source, token, slot); ``save_gate_up``): the backward skips
recomputing GEMM1. At W > 1, and with ``save_gate_up=False``, the backward recomputes GEMM1 instead (at W > 1 the
forward cannot know its row count and would keep the worst case).
Shared experts are not included: add them beside it, e.g. ``y = moe(x) + shared(x)``. ``moe`` is the same layer as
a function over given tensors, and takes transformers' expert layout (gate_up [E, 2F, H], down [E, H, F], passed as
their ``.transpose(1, 2)``) as it is: ``kosmos.integrations.transformers`` runs it on a model's own parameters.
``moe_experts`` is the expert part alone with the routing decision given by the caller (top-k ids and weights, no
router; ``MoEExpertsFn``): what transformers' ExpertsInterface calls an experts implementation with. Its backward is
``moe_backward(routing="given")``: gradients for x, the given weights, w13 and w2.

The why and the costs: docs/design/quant.md (MX linears), docs/design/moe_forward.md and moe_backward.md (MoE).
Tests: tests/test_nn_tp.py (the linears at W = 1, 2, bf16 and MXFP8, the MX weight cache), test_moe_forward.py
(``MoE`` trains at one rank, in bf16 and MXFP8, MXFP8 arguments, ``moe_experts``' autograd and refusals);
tests/test_moe_backward.py (the MX backward: test_moe_backward_mx*).
"""
from __future__ import annotations

import math

import torch

from . import quant
from .core import runtime
from .core.runtime import world_size
from .ops.all_gather_matmul import all_gather_matmul
from .ops.matmul_reduce_scatter import matmul_reduce_scatter
from .ops.moe_backward import moe_backward
from .ops.moe_backward.mx import MoEMXWeights, moe_mx_weights
from .ops.moe_forward import moe_forward
from .reference.moe import GIVEN, ROUTINGS, check_given_routing


def _all_gather_rows(x_shard: torch.Tensor, group) -> torch.Tensor:
    w = world_size(group)
    if w == 1:
        return x_shard
    out = x_shard.new_empty((x_shard.shape[0] * w,) + tuple(x_shard.shape[1:]))
    return runtime.all_gather_into(out, x_shard, group)


def _all_gather_mx(x, group) -> torch.Tensor:
    """The dequantized MX values of allgather(x) for an MXTensor x (payload and scales gathered with NCCL)."""
    payload, scales = x
    if world_size(group) == 1:
        return quant.from_mx(x)
    p = _all_gather_rows(payload.view(torch.uint8), group).view(payload.dtype)
    return quant.from_mx(quant.MXTensor(p, _all_gather_rows(scales, group)))


class AllGatherMatmulMXFn(torch.autograd.Function):
    """MXFP8 c = allgather(mx(a_shard)) @ b_mx: ``b`` is the bf16 weight view (gets the gradient), ``b_mx`` its
    MX values (what is multiplied). Backward: module docstring."""

    @staticmethod
    def forward(ctx, a_shard, b, b_mx, group=None):
        a_mx = quant.to_mx(a_shard)
        _, c = all_gather_matmul(a_mx, b_mx, group)
        ctx.save_for_backward(a_mx.payload, a_mx.scales, b_mx)
        ctx.group = group
        return c

    @staticmethod
    def backward(ctx, dc):
        payload, scales, b_mx = ctx.saved_tensors
        dc = dc.contiguous()
        da = db = None
        if ctx.needs_input_grad[0]:
            da = matmul_reduce_scatter(dc, b_mx.t(), ctx.group)
        if ctx.needs_input_grad[1]:
            db = _all_gather_mx(quant.MXTensor(payload, scales), ctx.group).t() @ dc
        return da, db, None, None


class MatmulReduceScatterMXFn(torch.autograd.Function):
    """MXFP8 c_shard = reduce_scatter(mx(a) @ b_mx); ``b`` gets the gradient, ``b_mx`` is multiplied."""

    @staticmethod
    def forward(ctx, a, b, b_mx, group=None):
        a_mx = quant.to_mx(a)
        ctx.save_for_backward(a_mx.payload, a_mx.scales, b_mx)
        ctx.group = group
        return matmul_reduce_scatter(a_mx, b_mx, group)

    @staticmethod
    def backward(ctx, dc_shard):
        payload, scales, b_mx = ctx.saved_tensors
        dc_full, da = all_gather_matmul(dc_shard.contiguous(), b_mx.t(), ctx.group)
        db = (quant.from_mx(quant.MXTensor(payload, scales)).t() @ dc_full
              if ctx.needs_input_grad[1] else None)  # dc_full: valid until the next KOSMOS call
        return (da if ctx.needs_input_grad[0] else None), db, None, None


def _pad_rows(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """``t`` [R, C] with zero rows appended up to a multiple of ``multiple`` (``t`` itself when R is one)."""
    extra = -t.shape[0] % multiple
    return t if not extra else torch.cat([t, t.new_zeros((extra, t.shape[1]))])


def _fp8_block_t(t: quant.FP8BlockTensor) -> quant.FP8BlockTensor:
    """The 128x128-block FP8BlockTensor of W^T from W's (the same blocks, transposed: both dims multiples of 128)."""
    return quant.FP8BlockTensor(t.payload.t().contiguous(), t.scales.t().contiguous(), t.block_rows)


class FP8BlockLinearFn(torch.autograd.Function):
    """Block-scaled FP8 y = x @ W^T at tensor-parallel size 1 (gemm/w1_static.fp8_block_matmul; CUDA, or the CPU
    under TRITON_INTERPRET=1). ``w8`` is W's 128x128-block FP8BlockTensor (the layer caches it), ``weight`` gets
    the gradient. Backward, every GEMM on operands quantized along its own K (the gradients straight through the
    quantizers): dx = fp8(dy, 1x128 along out) @ (W^T's 128x128 blocks: W's, transposed); dW = fp8(dy^T, 1x128
    along the tokens) @ fp8(x^T, 128x128), the tokens zero-padded to a multiple of 128 (zeros add nothing)."""

    @staticmethod
    def forward(ctx, x, weight, w8, w8t):
        from .gemm.w1_static import fp8_block_matmul
        ctx.save_for_backward(x)
        ctx.w8t = w8t
        return fp8_block_matmul(quant.to_fp8_block(_pad_rows(x, 8), 1), w8)[:x.shape[0]]  # (TMA: rows of 8)

    @staticmethod
    def backward(ctx, dy):
        from .gemm.w1_static import fp8_block_matmul
        (x,) = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_block_matmul(quant.to_fp8_block(_pad_rows(dy, 8), 1), ctx.w8t)[:dy.shape[0]]
        if ctx.needs_input_grad[1]:
            dyt = _pad_rows(dy, quant.FP8_BLOCK).t().contiguous()          # [out, M'], K = the tokens
            xt = _pad_rows(x, quant.FP8_BLOCK).t().contiguous()            # [in, M']
            dw = fp8_block_matmul(quant.to_fp8_block(dyt, 1), quant.to_fp8_block(xt, quant.FP8_BLOCK))
        return dx, dw, None, None


class AllGatherMatmulFn(torch.autograd.Function):
    """c = allgather(a_shard) @ b with the backward also fused (see the module docstring)."""

    @staticmethod
    def forward(ctx, a_shard, b, group=None):
        _, c = all_gather_matmul(a_shard, b, group)
        ctx.save_for_backward(a_shard, b)
        ctx.group = group
        return c

    @staticmethod
    def backward(ctx, dc):
        a_shard, b = ctx.saved_tensors
        dc = dc.contiguous()
        da = db = None
        if ctx.needs_input_grad[0]:
            da = matmul_reduce_scatter(dc, b.t(), ctx.group)
        if ctx.needs_input_grad[1]:
            db = _all_gather_rows(a_shard, ctx.group).t() @ dc
        return da, db, None


class MatmulReduceScatterFn(torch.autograd.Function):
    """c_shard = reduce_scatter(a @ b) with the backward also fused (see the module docstring)."""

    @staticmethod
    def forward(ctx, a, b, group=None):
        ctx.save_for_backward(a, b)
        ctx.group = group
        return matmul_reduce_scatter(a, b, group)

    @staticmethod
    def backward(ctx, dc_shard):
        a, b = ctx.saved_tensors
        dc_full, da = all_gather_matmul(dc_shard.contiguous(), b.t(), ctx.group)
        db = a.t() @ dc_full if ctx.needs_input_grad[1] else None  # dc_full: valid until the next KOSMOS call
        return (da if ctx.needs_input_grad[0] else None), db, None


PRECISIONS = ("bf16", "mxfp8")
LINEAR_PRECISIONS = PRECISIONS + ("fp8-block",)  # the linears also run block-scaled FP8 (W = 1 so far)


class _ParallelLinear(torch.nn.Module):
    def __init__(self, in_features: int, out_features: int, *, shard_out: bool, group=None, device=None,
                 dtype=torch.bfloat16):
        super().__init__()
        if isinstance(dtype, str):
            if dtype not in LINEAR_PRECISIONS:
                raise ValueError(f"dtype {dtype!r}: choose torch.bfloat16 or one of {', '.join(LINEAR_PRECISIONS)}")
            self.precision = dtype
            dtype = torch.bfloat16  # the master weight
        else:
            self.precision = "bf16"
        if self.precision == "fp8-block":
            if world_size(group) != 1:
                raise ValueError(f"dtype='fp8-block' runs at tensor-parallel size 1 so far; this group has "
                                 f"{world_size(group)} ranks")
            if in_features % 128 or out_features % 128:
                raise ValueError(f"dtype='fp8-block' needs in_features={in_features} and out_features="
                                 f"{out_features} to be multiples of 128 (the K of the forward and of dx)")
        if self.precision == "mxfp8" and in_features % (32 * (1 if shard_out else world_size(group))):
            raise ValueError(f"dtype='mxfp8' needs the GEMM's K ({'in' if shard_out else 'in/W'}) to be a multiple "
                             f"of 32 (MX blocks); in_features={in_features}")
        self._mx_cache = None
        w = world_size(group)
        sharded = out_features if shard_out else in_features
        if sharded % w:
            raise ValueError(f"{'out' if shard_out else 'in'}_features={sharded} does not divide by the "
                             f"tensor-parallel size {w}")
        self.in_features, self.out_features, self.group = in_features, out_features, group
        shape = (out_features // w, in_features) if shard_out else (out_features, in_features // w)
        self.weight = torch.nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        with torch.no_grad():
            self.weight.normal_(0.0, 1.0 / math.sqrt(in_features))

    def _mx_weight_t(self) -> torch.Tensor:
        """The weight's MX values, transposed to [in, out] (cached until the parameter changes)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._mx_cache is None or self._mx_cache[0] != key:
            with torch.no_grad():
                self._mx_cache = (key, quant.mx_round(self.weight.detach()).t())
        return self._mx_cache[1]

    def _fp8_block_weight(self) -> tuple:
        """(W's, W^T's) 128x128-block FP8BlockTensors: the forward's and dx's operands (cached until the parameter
        changes; W^T's is W's blocks transposed, made once rather than in every backward)."""
        key = (self.weight.data_ptr(), self.weight._version)
        if self._mx_cache is None or self._mx_cache[0] != key:
            with torch.no_grad():
                w8 = quant.to_fp8_block(self.weight.detach().contiguous(), quant.FP8_BLOCK)
                self._mx_cache = (key, (w8, _fp8_block_t(w8)))
        return self._mx_cache[1]

    def _flat(self, x: torch.Tensor, features: int) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-1] != features:
            raise ValueError(f"expected input [..., {features}], got {tuple(x.shape)}")
        return x.reshape(-1, features)


class ColumnParallelLinear(_ParallelLinear):
    """Column-parallel linear with sequence parallelism: x [s/W, ..., in] (this rank's sequence chunk) ->
    y [s, ..., out/W]; weight [out/W, in]. AllGather+GEMM forward, GEMM+ReduceScatter backward."""

    def __init__(self, in_features: int, out_features: int, group=None, device=None, dtype=torch.bfloat16):
        super().__init__(in_features, out_features, shard_out=True, group=group, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = world_size(self.group)
        if self.precision == "fp8-block":
            y = FP8BlockLinearFn.apply(self._flat(x, self.in_features).contiguous(), self.weight,
                                       *self._fp8_block_weight())
        elif self.precision == "mxfp8":
            y = AllGatherMatmulMXFn.apply(self._flat(x, self.in_features), self.weight.t(), self._mx_weight_t(),
                                          self.group)
        else:
            y = AllGatherMatmulFn.apply(self._flat(x, self.in_features), self.weight.t(), self.group)
        return y.view((x.shape[0] * w,) + tuple(x.shape[1:-1]) + (self.weight.shape[0],))


class RowParallelLinear(_ParallelLinear):
    """Row-parallel linear with sequence parallelism: x [s, ..., in/W] -> y [s/W, ..., out] (this rank's
    sequence chunk, summed over ranks in rank order); weight [out, in/W]. GEMM+ReduceScatter forward,
    AllGather+GEMM backward."""

    def __init__(self, in_features: int, out_features: int, group=None, device=None, dtype=torch.bfloat16):
        super().__init__(in_features, out_features, shard_out=False, group=group, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = world_size(self.group)
        if x.shape[0] % w:
            raise ValueError(f"the sequence dimension {x.shape[0]} does not divide by the tensor-parallel size {w}")
        if self.precision == "fp8-block":
            y = FP8BlockLinearFn.apply(self._flat(x, self.weight.shape[1]).contiguous(), self.weight,
                                       *self._fp8_block_weight())
        elif self.precision == "mxfp8":
            y = MatmulReduceScatterMXFn.apply(self._flat(x, self.weight.shape[1]), self.weight.t(),
                                              self._mx_weight_t(), self.group)
        else:
            y = MatmulReduceScatterFn.apply(self._flat(x, self.weight.shape[1]), self.weight.t(), self.group)
        return y.view((x.shape[0] // w,) + tuple(x.shape[1:-1]) + (self.out_features,))


def _moe_forward_saving(ctx, x, router_weight, w13, w2, save_gate_up, **kw):
    """MoEFn's and MoEExpertsFn's forward: moe_forward with the routing decision returned; the decision and (with
    ``save_gate_up``) GEMM1's g | u kept on ``ctx`` for the backward. Returns (y, weights, experts)."""
    out = moe_forward(x, router_weight, w13, w2, return_routing=True, save_gu=save_gate_up, **kw)
    ctx.saved_gu = out[3] if save_gate_up else None  # kept until the backward (the graph's lifetime)
    return out[:3]


class MoEFn(torch.autograd.Function):
    """y = moe_forward(x, ...) over the EP group with its backward (kosmos.ops.moe_backward.moe_backward: its one
    launch where it runs, the module docstring says where); the bias gets no gradient; d(router weight) is this rank's
    tokens' part (all-reduce it over the data-parallel ranks like any replicated parameter's gradient).
    ``mx_weights`` (a MoEMXWeights of w13 / w2): the MXFP8 layer -- the forward on its MX values
    (moe_forward(precision="mxfp8")), the MX backward (moe_backward(precision="mxfp8"): the gradients of w13 / w2,
    the bf16 weights, straight through the quantizers); g | u is then recomputed, never saved."""

    @staticmethod
    def forward(ctx, x, router_weight, w13, w2, bias, top_k, routing, route_kw, group=None, save_gate_up=False,
                mx_weights=None):
        mx = mx_weights is not None
        y, weights, experts = _moe_forward_saving(
            ctx, x, router_weight, mx_weights.w13 if mx else w13, mx_weights.w2 if mx else w2,
            save_gate_up and not mx, top_k=top_k, routing=routing, bias=bias, group=group,
            **(dict(precision="mxfp8") if mx else {}), **route_kw)
        ctx.save_for_backward(x, router_weight, w13, w2, weights, experts)
        ctx.routing = routing
        ctx.route_kw = route_kw
        ctx.group = group
        ctx.mx_weights = mx_weights  # kept until the backward, as saved_gu
        return y

    @staticmethod
    def backward(ctx, dy):
        x, router_weight, w13, w2, weights, experts = ctx.saved_tensors
        kw = {k: v for k, v in ctx.route_kw.items() if k in ("renormalize", "routed_scaling")}
        if ctx.mx_weights is not None:
            kw.update(precision="mxfp8", mx_weights=ctx.mx_weights)
        dx, d_router, dw13, dw2 = moe_backward(x, router_weight, w13, w2, dy.contiguous(), weights, experts,
                                               group=ctx.group, routing=ctx.routing, saved_gu=ctx.saved_gu, **kw)
        ctx.saved_gu = ctx.mx_weights = None
        return dx, d_router, dw13, dw2, None, None, None, None, None, None, None


class MoEExpertsFn(torch.autograd.Function):
    """y = moe_forward(x, None, w13, w2, routing="given", weights=top_k_weights, experts=top_k_index) -- the expert
    part with the routing decision given -- with its backward (moe_backward(routing="given")): gradients for x,
    top_k_weights (each (token, slot)'s <dy_t, o_(t, j)>, in top_k_weights' dtype), w13 and w2 (in their layout);
    none for top_k_index."""

    @staticmethod
    def forward(ctx, x, top_k_weights, w13, w2, top_k_index, group=None, save_gate_up=False):
        y, weights, experts = _moe_forward_saving(ctx, x, None, w13, w2, save_gate_up, top_k=top_k_index.shape[1],
                                                  routing=GIVEN, group=group, weights=top_k_weights,
                                                  experts=top_k_index)
        ctx.save_for_backward(x, w13, w2, weights, experts)
        ctx.group = group
        ctx.weights_dtype = top_k_weights.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w13, w2, weights, experts = ctx.saved_tensors
        dx, dweights, dw13, dw2 = moe_backward(x, None, w13, w2, dy.contiguous(), weights, experts, group=ctx.group,
                                               routing=GIVEN, saved_gu=ctx.saved_gu)
        ctx.saved_gu = None
        return dx, dweights.to(ctx.weights_dtype), dw13, dw2, None, None, None


class MoE(torch.nn.Module):
    """This rank's share of an expert-parallel MoE layer: router weight [E, H] (replicated), w13 [E/W, H, 2F]
    (gate | up) and w2 [E/W, F, H] for the experts g with g // (E/W) == rank. ``forward(x [T, H]) -> [T, H]``.
    ``save_gate_up``: keep GEMM1's g | u from the forward for the backward (None: at one rank only; the module
    docstring says why)."""

    def __init__(self, hidden: int, expert_ffn: int, experts: int, top_k: int, *, routing: str = "softmax",
                 renormalize: bool = True, n_group: int = 1, topk_group: int = 1, routed_scaling: float = 1.0,
                 group=None, device=None, dtype=torch.bfloat16, save_gate_up: bool | None = None):
        super().__init__()
        if routing not in ROUTINGS:
            raise ValueError(f"unknown routing {routing!r}; choose from {', '.join(ROUTINGS)}")
        self.precision = "bf16"
        if isinstance(dtype, str):  # "mxfp8": bf16 parameters, the MXFP8 layer (moe_forward's precision)
            if dtype not in PRECISIONS:
                raise ValueError(f"dtype {dtype!r}: choose torch.bfloat16 or one of {', '.join(PRECISIONS)}")
            if dtype == "mxfp8" and (hidden % 32 or expert_ffn % 32):
                raise ValueError(f"dtype='mxfp8' needs hidden={hidden} and expert_ffn={expert_ffn} to be multiples "
                                 f"of 32 (MX blocks)")
            self.precision, dtype = dtype, torch.bfloat16
        self._mx_cache = None
        world = world_size(group)
        if experts % world:
            raise ValueError(f"{experts} experts do not split evenly over {world} ranks")
        local = experts // world
        # training: keep GEMM1's g | u from the forward for the backward (no GEMM1 recompute) -- by default at
        # one rank, where it is exactly T*k rows x 2F bf16; at W > 1 the forward cannot know its row count
        # and would keep the worst case (W*T*min(k, E/W) rows), so the backward recomputes there
        self.save_gate_up = (world == 1) if save_gate_up is None else bool(save_gate_up)
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
        mx_weights = None
        if self.precision == "mxfp8":
            mx_weights = self._mx_weights(backward=_needs_grad(x, self.router_weight, self.w13, self.w2))
        return moe(x, self.router_weight, self.w13, self.w2, top_k=self.top_k, routing=self.routing, bias=self.bias,
                   group=self.group, precision=self.precision, save_gate_up=self.save_gate_up,
                   mx_weights=mx_weights, **self.route_kw)

    def _mx_weights(self, backward: bool) -> MoEMXWeights:
        """The experts' MX values (MoEMXWeights), cached until a parameter changes (its ``_version``): the forward's
        two copies, and the backward's two more once a forward needs gradients."""
        key = tuple((p.data_ptr(), p._version) for p in (self.w13, self.w2))
        cache = self._mx_cache
        if cache is None or cache[0] != key or (backward and cache[1].w13_bwd is None):
            with torch.no_grad():
                if backward:
                    mxw = moe_mx_weights(self.w13.detach(), self.w2.detach())
                else:
                    mxw = MoEMXWeights(quant.mx_values(self.w13.detach(), dim=1),
                                       quant.mx_values(self.w2.detach(), dim=1), None, None)
            self._mx_cache = cache = (key, mxw)
        return cache[1]


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def moe(x: torch.Tensor, router_weight: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *, top_k: int,
        routing: str = "softmax", bias: torch.Tensor | None = None, group=None, precision: str = "bf16",
        save_gate_up: bool | None = None, mx_weights: MoEMXWeights | None = None, **route_kw) -> torch.Tensor:
    """The routed-expert layer as a function: ``moe_forward`` in one launch, with autograd (``MoEFn``) when a
    gradient is needed -- what ``MoE.forward`` and ``kosmos.integrations.transformers`` run.

    x [T, H] bf16; router_weight [E, H] bf16; w13 [E, H, 2F] / w2 [E, F, H], contiguous or -- transformers'
    ``gate_up_proj`` [E, 2F, H] / ``down_proj`` [E, H, F] -- their ``.transpose(1, 2)``: the kernels read either
    layout as it is, and the weight gradients come back in the weights' layout (no copy); route_kw:
    ``renormalize``, ``routed_scaling``, and for ``routing="sigmoid-grouped"`` ``n_group`` / ``topk_group``
    (``bias`` [E] is the expert-choice bias, no gradient). ``save_gate_up``: keep GEMM1's g | u for the
    backward (None: at one rank).

    ``precision="mxfp8"`` (H and F multiples of 32): the MXFP8 layer. The forward multiplies the experts' MX values:
    ``mx_weights.w13`` / ``.w2`` (a ``MoEMXWeights``, ``kosmos.ops.moe_backward.moe_mx_weights(w13, w2)``, what
    nn.MoE caches); without ``mx_weights``, w13 / w2 themselves when no gradient is needed (they must then hold the
    MX values: ``quant.mx_values(w13, dim=1)``, ``(w2, dim=1)``), else the copies rounded here from w13 / w2, per
    call. When a gradient is needed w13 / w2 are the bf16 weights and get the gradients of the MX backward
    (moe_backward(precision="mxfp8"): every backward GEMM on MX operands along its own K, straight through the
    quantizers; kosmos/ops/moe_backward/mx.py); g | u is recomputed there (``save_gate_up`` does not apply)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
    mx = precision == "mxfp8"
    if _needs_grad(x, router_weight, w13, w2):
        if mx and (mx_weights is None or mx_weights.w13_bwd is None):
            mx_weights = moe_mx_weights(w13.detach(), w2.detach())
        if save_gate_up is None:
            save_gate_up = world_size(group) == 1
        return MoEFn.apply(x, router_weight, w13, w2, bias, top_k, routing, dict(route_kw), group,
                           bool(save_gate_up), mx_weights if mx else None)
    if mx and mx_weights is not None:
        w13, w2 = mx_weights.w13, mx_weights.w2
    return moe_forward(x, router_weight, w13, w2, top_k=top_k, routing=routing, bias=bias, group=group,
                       precision=precision, **route_kw)


def moe_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w13: torch.Tensor,
                w2: torch.Tensor, *, group=None, save_gate_up: bool | None = None) -> torch.Tensor:
    """The expert part of an MoE layer with the routing decision given (no router): y [T, H] bf16 with
    y[t] = sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(x[t]) -- ``moe_forward(routing="given")``, one
    launch (the dispatch, both expert GEMMs and the combine) -- with autograd (``MoEExpertsFn``) when a gradient is
    needed: gradients for x, top_k_weights (fp32 in the kernels, returned in top_k_weights' dtype), w13 and w2,
    none for top_k_index. What transformers' ExpertsInterface asks of an experts implementation
    (``kosmos.integrations.transformers.register_experts``).

    x [T, H] bf16; top_k_index [T, k] integer global expert ids in [0, E) (checked on CPU tensors; on CUDA not --
    that would synchronise -- and an id outside makes the launch index outside its buffers); top_k_weights [T, k]
    any float dtype, used as they are (no renormalisation, no scaling); w13 [E/W, H, 2F] / w2 [E/W, F, H] bf16 this
    rank's experts, contiguous or -- transformers' ``gate_up_proj`` [E, 2F, H] / ``down_proj`` [E, H, F] -- their
    ``.transpose(1, 2)``, read as they are (the weight gradients come back in the weights' layout). ``group``: the
    expert-parallel group (global expert g on rank g // (E/W); the same generic forward and backward as ``moe``'s,
    with the router left out). ``save_gate_up``: keep GEMM1's g | u for the backward (None: at one rank)."""
    check_given_routing(top_k_weights, top_k_index, x.shape[0], w13.shape[0] * world_size(group),
                        check_ids=top_k_index.device.type == "cpu")
    if _needs_grad(x, top_k_weights, w13, w2):
        if save_gate_up is None:
            save_gate_up = world_size(group) == 1
        return MoEExpertsFn.apply(x, top_k_weights, w13, w2, top_k_index, group, bool(save_gate_up))
    return moe_forward(x, None, w13, w2, top_k=top_k_index.shape[1], routing=GIVEN, group=group,
                       weights=top_k_weights, experts=top_k_index)
