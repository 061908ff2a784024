"""The TP+SP benchmark (``kosmos bench tp``): for each (model, layer, seq) GEMM, check every implementation
against the fp32 reference on the same random inputs, then time them side by side in one loop
(collective-safe; the check -> agree -> time -> row steps are harness.py's, shared with ``bench moe``).

Runs inside one process per rank (launcher.spawn). Implementations (registry family "tp", one maker per name
for both ops; C = allgather(A) @ B for ag_gemm, C_shard = RS(A @ B) for gemm_rs):
  kosmos           kosmos.all_gather_matmul / matmul_reduce_scatter (policy "self"), with the op's config
                   (``--config``: AllGatherMatmulConfig for ag_gemm, MatmulReduceScatterConfig for gemm_rs).
  nccl+cublas      NCCL all_gather / reduce_scatter + cuBLAS (kosmos.reference, bf16): the baseline.
  torch-async-tp   torch.ops.symm_mem.fused_all_gather_matmul / fused_matmul_reduce_scatter (>= 2 ranks).
  fixed-role       the KOSMOS ops with policy "fixed" at S = 16 communication programs (>= 2 ranks).
  fixed-role-best  the same at the fastest S of ``fixed_sweep`` that passes (harness.best_fixed_split).

Precisions (``--dtype bf16,mxfp8``: every GEMM runs at each, bf16 first; each row's ``dtype`` says which). At
mxfp8 every implementation starts from the same bf16 activation ``a`` as at bf16 (make_inputs) and quantizes it
inside the timed call (``kosmos.quant.quantize_mx``: MXFP8, E4M3 + an E8M0 scale per 32 elements along K); the
weight's low-precision form is made once, outside the timed call, like a cached weight:
  kosmos           the kosmos op on a with precision="mxfp8" (it quantizes a itself: inside the launch at W = 1 on
                   Hopper, kernels/w1_mx_matmul.py; quantize_mx first otherwise) and b_mx = mx_round(b^T)^T (the
                   weight's MX values in bf16, blocks along K); fixed-role and fixed-role-best the same with
                   policy "fixed".
  nccl+cublas      quantize_mx(a); AG: NCCL all_gather_into_tensor of the payload (as uint8) and of the scales into
                   preallocated buffers, dequantize_mx, torch.matmul with b_mx. RS: dequantize_mx, torch.matmul
                   with b_mx, NCCL reduce_scatter_tensor of the bf16 partial. At W=1 the collectives are skipped
                   (the all-gather is the identity; at bf16 the reference copies it).
  triton-dot-scaled the same collectives; GEMM = dot_scaled.dot_scaled_matmul (tl.dot_scaled) with the weight
                   quantized once (quantize_mx of the [N, K] weight). mxfp8 only.
  fp8-rowwise      per-row FP8 E4M3 (scale = row amax / 448, fp32) of a, all-gather of payload (uint8) + scales
                   (AG), torch._scaled_mm with the weight quantized once per output row (scale_a [M, 1], scale_b
                   [1, N]); RS: local _scaled_mm then reduce_scatter_tensor. Another scaling than MX, so it is
                   checked against the fp32 reference of the ORIGINAL bf16 inputs at 5e-2 (its row's ``note``).
                   mxfp8 only.
  torch-async-tp   unavailable at mxfp8 ("no MXFP8 path in torch async-TP"); no row at fp8-block.
At fp8-block (block-scaled FP8: E4M3 with an fp32 scale per 1x128 of A and per 128x128 of the [N, K] weight;
kosmos.quant.quantize_fp8_block) the weight is quantized once (b_fp8), A inside the timed call:
  kosmos           the kosmos op with precision="fp8-block" on a and b_fp8 (any W: at W > 1 the payload and
                   scales travel, 1 + 4/128 bytes an element).
  nccl+cublas      the bf16 baseline on the original bf16 inputs (its row's ``note``): at fp8-block the report's
                   speedup column is the speed over NCCL + cuBLAS in bf16.
  cublas-fp8-block quantize_fp8_block(a); AG: NCCL all-gather of payload and scales; torch._scaled_mm with the
                   1x128 / 128x128 scales (cuBLAS's block-scaled FP8 GEMM, CUDA >= 12.9 on sm_90); RS: local
                   _scaled_mm, reduce_scatter of the bf16 partial. Unavailable where this torch refuses the scales.
  fp8-rowwise      as at mxfp8. fixed-role*: unavailable (the fp8-block route runs the self policy only).
The check at fp8-block: the fp32 product of the dequantized fp8-block inputs within TOLERANCE["fp8-block"]
(nccl+cublas: the bf16 reference; fp8-rowwise: the bf16 inputs' at 5e-2); every row records rel_err_bf16.
The check at mxfp8 (harness.Reference): the fp32 product of the dequantized MX inputs (quantize_mx(a) in fp32,
gathered / reduced as at bf16, times mx_round(b) in fp32) within TOLERANCE["mxfp8"] (1e-2, as bf16: the reference
has the MX rounding); every mxfp8 row also records ``rel_err_bf16``, the error against the fp32 reference of the
original bf16 inputs. Every row's ``t_gemm_ms`` is torch.matmul in BF16 on the shape (cuBLAS bf16 alone, at
mxfp8 too: "vs cuBLAS bf16" compares like with like); ``t_comm_ms`` the NCCL collective alone of what the
dtype moves (mxfp8 AG: payload + scales; RS: the bf16 partials); ``wire_bytes`` the bytes this rank sends in
the op's collective (``wire_bytes()``).

Host enqueue time (``--host-calls N``, ``--host-shape MxNxK``; issue 13's bar: <= 30 us per eager call at W=1): once
per sweep, after the GEMMs, a ``HostCase`` per (op, dtype) of the sweep runs every implementation of that dtype on
one small custom GEMM (default 128x256x256, one tile): availability and the check as for a result row, then
``timing.host_enqueue_us`` (N back-to-back eager calls after timing.HOST_WARM_S of warm-up) and a row of type "host" each
(harness.Runner.host). The result rows' ``host_ms`` is another figure: the host time inside a call of the timing
loop, each after a barrier (cold host; timing.py).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

import kosmos
from kosmos import quant, reference
from kosmos.core import runtime
from kosmos.config import config_dict
from kosmos.models import CUSTOM, TPGemm

from . import harness, timing
from .harness import Settings, policy_kwargs, world_info
from . import registry
from .registry import names, register


def make_inputs(g: TPGemm, world: int, rank: int, seed: int):
    """Fresh random bf16 inputs of this rank (different on every rank, never zeros)."""
    gen = torch.Generator(device="cuda").manual_seed(seed * 7919 + rank * 104729 + g.m * 31 + g.n * 17 + g.k)
    rows = g.m // world if g.op == "ag_gemm" else g.m
    a = torch.randn(rows, g.k, device="cuda", generator=gen).to(torch.bfloat16)
    b = (torch.randn(g.k, g.n, device="cuda", generator=gen) / math.sqrt(g.k)).to(torch.bfloat16)
    return a, b


@dataclass
class TPInputs:
    g: TPGemm
    a: torch.Tensor
    b: torch.Tensor
    dtype: str = "bf16"
    b_mx: torch.Tensor | None = None  # mxfp8: the weight's MX values in bf16, [K, N] (mx_round(b^T)^T)
    b_fp8: quant.FP8BlockTensor | None = None  # fp8-block: the [N, K] weight with 128x128 blocks


MX = "mxfp8"
FP8B = "fp8-block"
MX_ONLY = {MX: None}  # registry dtypes of the MXFP8-only baselines
FP8_ONLY = {MX: None, FP8B: None}  # fp8-rowwise: at both 8-bit dtypes
FP8B_ONLY = {FP8B: None}
FP8B_BF16_NOTE = "at fp8-block: the bf16 NCCL + cuBLAS baseline on the original bf16 inputs"
FP8_ROWWISE_TOL = 5e-2
FP8_ROWWISE_NOTE = ("per-row FP8 E4M3 scaling (not MX): checked against the fp32 reference of the original bf16 "
                    "inputs at 5e-2")
E4M3_MAX = 448.0


def wire_bytes(op: str, impl: str, dtype: str, m: int, n: int, k: int, world: int) -> int:
    """Bytes this rank sends in the op's collective (W = ``world``; each rank sends its share to W-1 peers):
    ag_gemm: m*k*2*(W-1)/W at bf16, m*k*(1 + 1/32)*(W-1)/W at mxfp8 (payload + one E8M0 scale per 32; kosmos,
    fixed-role*, nccl+cublas, triton-dot-scaled), m*k*(W-1)/W + m*4*(W-1)/W for fp8-rowwise (payload + an fp32
    scale per row), m*k*(1 + 4/128)*(W-1)/W at fp8-block (payload + an fp32 scale per 128; its nccl+cublas row is
    bf16); gemm_rs: the bf16 partials, m*n*2*(W-1)/W, whatever the dtype. 0 at W = 1."""
    if world <= 1:
        return 0
    if op == "gemm_rs" or (dtype == FP8B and impl == "nccl+cublas"):
        per_rank = m * n * 2 if op == "gemm_rs" else m * k * 2
    elif dtype not in (MX, FP8B):
        per_rank = m * k * 2
    elif impl == "fp8-rowwise":
        per_rank = m * k + m * 4
    elif dtype == FP8B:
        per_rank = m * k + m * (k // 128) * 4
    else:
        per_rank = m * (k + k // 32)
    return per_rank * (world - 1) // world


def _gather_into(out: torch.Tensor, part: torch.Tensor, world: int) -> torch.Tensor:
    """NCCL all_gather_into_tensor of ``part`` into ``out`` (preallocated); at W = 1 ``part`` itself."""
    if world == 1:
        return part
    dist.all_gather_into_tensor(out, part)
    return out


def _scatter_sum(partial: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """NCCL reduce_scatter_tensor of ``partial`` into ``out`` (preallocated; None at W = 1: ``partial``)."""
    if out is None:
        return partial
    dist.reduce_scatter_tensor(out, partial)
    return out


def _quantized_collective(inp: TPInputs, gemm, quantize=quant.quantize_mx, block: int = 32, scale_dtype=torch.uint8):
    """The timed call of the NCCL-based MXFP8 (and fp8-block) baselines: ``quantize(a)`` (quantize_mx, or
    quantize_fp8_block with block 128 and fp32 scales); AG: all-gather payload (as uint8) and scales into
    preallocated buffers, then ``gemm(payload, scales)``; RS: ``gemm`` of the local quantized a, then
    reduce_scatter of the bf16 partial. The collectives are skipped at W = 1."""
    a, g = inp.a, inp.g
    world = world_info()[1]
    if g.op == "ag_gemm":
        rows, k = a.shape
        pay = torch.empty((rows * world, k), dtype=torch.uint8, device=a.device)
        sc = torch.empty((rows * world, k // block), dtype=scale_dtype, device=a.device)

        def call():
            q = quantize(a)
            p = _gather_into(pay, q.payload.view(torch.uint8), world).view(torch.float8_e4m3fn)
            return gemm(p, _gather_into(sc, q.scales, world))
        return call
    out = None if world == 1 else torch.empty((a.shape[0] // world, g.n), dtype=torch.bfloat16, device=a.device)

    def local():
        q = quantize(a)
        return _scatter_sum(gemm(q.payload, q.scales), out)
    return local


def rowwise_fp8(x: torch.Tensor):
    """Per-row FP8 E4M3 of ``x`` [R, K]: (payload float8_e4m3fn [R, K], fp32 scales [R, 1] = row amax / 448;
    an all-zero row gets scale 1)."""
    amax = x.abs().amax(dim=1, keepdim=True).float()
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


# --------------------------------------------------------------------------- implementations (registry "tp")
# each maker: (TPInputs, params, config or None) -> (callable returning this rank's output, workspace bytes)


@register("tp", "kosmos", kosmos=True)
def _kosmos(inp: TPInputs, params: dict, config):
    kw = dict(config=config, **policy_kwargs(params))
    if inp.dtype == FP8B:  # the activation quantized in the timed call (by the op), the weight once
        a, b = inp.a, inp.b_fp8
        if inp.g.op == "ag_gemm":
            return (lambda: kosmos.all_gather_matmul(a, b, precision=FP8B, **kw)[1]), None
        return (lambda: kosmos.matmul_reduce_scatter(a, b, precision=FP8B, **kw)), None
    if inp.dtype == MX:  # the activation quantized in the timed call, the weight's MX values made once
        a, b = inp.a, inp.b_mx
        if inp.g.op == "ag_gemm":
            return (lambda: kosmos.all_gather_matmul(a, b, precision=MX, **kw)[1]), None
        return (lambda: kosmos.matmul_reduce_scatter(a, b, precision=MX, **kw)), None
    if inp.g.op == "ag_gemm":
        return (lambda: kosmos.all_gather_matmul(inp.a, inp.b, **kw)[1]), None
    return (lambda: kosmos.matmul_reduce_scatter(inp.a, inp.b, **kw)), None


@register("tp", "nccl+cublas", baseline=True)
def _nccl_cublas(inp: TPInputs, params: dict, config):
    a, b = inp.a, inp.b
    if inp.dtype == MX:
        b_mx = inp.b_mx
        return _quantized_collective(inp, lambda p, s: quant.dequantize_mx(p, s) @ b_mx), 0
    if inp.g.op == "ag_gemm":
        a_full = torch.empty((a.shape[0] * world_info()[1], a.shape[1]), dtype=a.dtype, device=a.device)
        return (lambda: reference.all_gather_matmul_ref(a, b, fp32=False, a_full=a_full)[1]), 0
    return (lambda: reference.matmul_reduce_scatter_ref(a, b, fp32=False)), 0


def _async_tp_available(world: int):
    if world == 1:
        return False, "torch async-TP needs a process group of >= 2 ranks"
    ops = getattr(torch.ops, "symm_mem", None)
    if ops is None or not hasattr(ops, "fused_all_gather_matmul"):
        return False, f"torch {torch.__version__} has no torch.ops.symm_mem.fused_all_gather_matmul"
    return True, None


@register("tp", "torch-async-tp", available=_async_tp_available,
          dtypes={"bf16": None, MX: "no MXFP8 path in torch async-TP"})
def _async_tp(inp: TPInputs, params: dict, config):
    import torch.distributed._symmetric_memory as symm_mem
    ops, a, b = torch.ops.symm_mem, inp.a, inp.b
    name = dist.group.WORLD.group_name
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(name)
    if inp.g.op == "ag_gemm":
        return (lambda: ops.fused_all_gather_matmul(a, [b], gather_dim=0, group_name=name)[1][0]), None
    return (lambda: ops.fused_matmul_reduce_scatter(a, b, "sum", scatter_dim=0, group_name=name)), None


harness.register_fixed("tp", _kosmos, dtypes={"bf16": None, MX: None,
                                              FP8B: "the fp8-block route runs the self policy only"})


def _dot_scaled_available(world: int):
    try:
        import triton.language as tl
    except ImportError as e:
        return False, f"triton: {e}"
    return (True, None) if hasattr(tl, "dot_scaled") else (False, "this Triton has no tl.dot_scaled")


@register("tp", "triton-dot-scaled", available=_dot_scaled_available, dtypes=MX_ONLY)
def _triton_dot_scaled(inp: TPInputs, params: dict, config):
    from .dot_scaled import dot_scaled_matmul
    w_mx = quant.quantize_mx(inp.b.t().contiguous())  # the [N, K] weight, quantized once (blocks along K)
    return _quantized_collective(inp, lambda p, s: dot_scaled_matmul((p, s), w_mx)), 0


def _scaled_mm_available(world: int):
    return (True, None) if hasattr(torch, "_scaled_mm") else (False, f"torch {torch.__version__} has no _scaled_mm")


@register("tp", "fp8-rowwise", available=_scaled_mm_available, dtypes=FP8_ONLY)
def _fp8_rowwise(inp: TPInputs, params: dict, config):
    a, g = inp.a, inp.g
    world = world_info()[1]
    w_fp8, w_scale = rowwise_fp8(inp.b.t().contiguous())  # once: the [N, K] weight, a scale per output row
    scale_b = w_scale.t().contiguous()  # [1, N]

    def mm(x, sx):
        return torch._scaled_mm(x, w_fp8.t(), scale_a=sx, scale_b=scale_b, out_dtype=torch.bfloat16)
    if g.op == "ag_gemm":
        rows, k = a.shape
        pay = torch.empty((rows * world, k), dtype=torch.uint8, device=a.device)
        sc = torch.empty((rows * world, 1), dtype=torch.float32, device=a.device)

        def call():
            q, s = rowwise_fp8(a)
            return mm(_gather_into(pay, q.view(torch.uint8), world).view(torch.float8_e4m3fn),
                      _gather_into(sc, s, world))
        return call, 0
    out = None if world == 1 else torch.empty((a.shape[0] // world, g.n), dtype=torch.bfloat16, device=a.device)
    return (lambda: _scatter_sum(mm(*rowwise_fp8(a)), out)), 0

def blockwise_scaled_mm(a8: quant.FP8BlockTensor, w8: quant.FP8BlockTensor) -> torch.Tensor:
    """torch._scaled_mm on fp8-block operands (A [M, K] 1x128, the weight [N, K] 128x128): cuBLAS's block-scaled
    FP8 GEMM, bf16 out. Its scale layouts (torch 2.9+ on CUDA >= 12.9, sm_90): scale_a [M, K/128] M-major (an
    outer-dim-major transpose of ours), scale_b [K/128, N/128] (the transpose of the weight's scales)."""
    sa = a8.scales.t().contiguous().t()
    return torch._scaled_mm(a8.payload, w8.payload.t(), scale_a=sa, scale_b=w8.scales.t(),
                            out_dtype=torch.bfloat16)


@register("tp", "cublas-fp8-block", available=_scaled_mm_available, dtypes=FP8B_ONLY)
def _cublas_fp8_block(inp: TPInputs, params: dict, config):
    a, w8 = inp.a, inp.b_fp8
    try:  # this torch / CUDA may not take block-wise scales: then the row is unavailable, with torch's reason
        blockwise_scaled_mm(quant.quantize_fp8_block(a[:min(128, a.shape[0])].contiguous()), w8)
    except (RuntimeError, ValueError, TypeError) as e:
        raise registry.Unavailable(f"torch._scaled_mm refuses block-wise scales here: {str(e).splitlines()[0][:200]}")
    return _quantized_collective(inp, lambda p, sc: blockwise_scaled_mm(quant.FP8BlockTensor(p, sc), w8),
                          quant.quantize_fp8_block, 128, torch.float32), 0


TP_IMPLS = names("tp")  # kosmos, nccl+cublas, torch-async-tp, fixed-role, fixed-role-best, triton-dot-scaled,
#                         fp8-rowwise, cublas-fp8-block
TP_DTYPES = ("bf16", MX, FP8B)


def impls_at(impls, dtype: str) -> tuple:
    """The implementations of ``impls`` that have a row at ``dtype`` (registry dtypes)."""
    return registry.impls_at("tp", impls, dtype)


@dataclass
class TPSettings(Settings):
    impls: tuple = TP_IMPLS
    trace_dir: str | None = None


def reference_output(g: TPGemm, a, b):
    if g.op == "ag_gemm":
        return reference.all_gather_matmul_ref(a, b, fp32=True)[1]
    return reference.matmul_reduce_scatter_ref(a, b, fp32=True)


def mx_weight(b: torch.Tensor) -> torch.Tensor:
    """The MX values of weight ``b`` [K, N] in bf16, blocks along K: mx_round of the [N, K] weight, transposed."""
    # row-major [K, N], the layout of the bf16 rows' b, so both dtypes run the same B path (a k-major view was
    # suspected of a slowdown in session 8; the rerun showed the same times: the cause was a dequant variant)
    return quant.mx_round(b.t().contiguous()).t().contiguous()


def references(g: TPGemm, a, b, dtype: str, b_mx=None):
    """impl name -> what its output is checked against. bf16: the fp32 reference. mxfp8: the fp32 product of the
    dequantized MX inputs (TOLERANCE["mxfp8"]), fp8-rowwise the bf16 inputs' (5e-2); both record rel_err_bf16.
    fp8-block (``b_mx`` is then the weight's FP8BlockTensor): the dequantized fp8-block inputs' product
    (TOLERANCE["fp8-block"]), nccl+cublas (bf16 there) the fp32 reference, fp8-rowwise as at mxfp8."""
    ref = reference_output(g, a, b)
    if dtype not in (MX, FP8B):
        return lambda name: ref
    also = {"rel_err_bf16": ref}
    rowwise = harness.Reference(ref, FP8_ROWWISE_TOL, also)
    if dtype == FP8B:
        a32 = quant.dequantize_fp8_block(quant.quantize_fp8_block(a), torch.float32)
        b32 = quant.dequantize_fp8_block(b_mx, torch.float32).t()  # b_mx: the weight's FP8BlockTensor here
        low = harness.Reference(reference_output(g, a32, b32), harness.TOLERANCE[FP8B], also)
        return lambda name: rowwise if name == "fp8-rowwise" else ref if name == "nccl+cublas" else low
    ref_mx = reference_output(g, quant.quantize_mx(a).dequantize(torch.float32), b_mx)
    mx = harness.Reference(ref_mx, harness.TOLERANCE[MX], also)
    return lambda name: rowwise if name == "fp8-rowwise" else mx


def identity(g: TPGemm, world: int, dtype: str) -> dict:
    """The identity keys of a row of GEMM ``g``."""
    return {"type": "result", "bench": "tp", "op": g.op, "layer": g.layer, "model": g.model, "seq": g.seq,
            "m": g.m, "n": g.n, "k": g.k, "world": world, "dtype": dtype}


# the host enqueue measurement's defaults (`kosmos bench tp --host-shape / --host-calls`): one 128x256 output tile,
# K = 256 (a multiple of 32: MX blocks), as dev/fixed_cost.py --plans measures it
HOST_SHAPE = (128, 256, 256)
HOST_CALLS = timing.HOST_CALLS


@dataclass(frozen=True)
class HostCase:
    """The host enqueue measurement of one (op, dtype) of a sweep: every implementation on the small GEMM ``g``,
    ``calls`` back-to-back eager calls each after ``warm_s`` s of warm-up (module docstring)."""
    g: TPGemm
    dtype: str
    calls: int = HOST_CALLS
    warm_s: float = timing.HOST_WARM_S


def host_cases(cases: list, dtypes, shape, calls: int, world: int) -> list[HostCase]:
    """A HostCase per (op of ``cases``, dtype) on the custom GEMM ``shape`` (M, N, K) of that op; none when
    ``calls`` is 0."""
    from kosmos.models import custom_tp_gemm
    if not calls:
        return []
    ops = dict.fromkeys(c["op"] for c in cases)
    return [HostCase(custom_tp_gemm(op, *shape, world), d, calls) for op in ops for d in dtypes]


def host_identity(hc: HostCase, world: int) -> dict:
    return {**identity(hc.g, world, hc.dtype), "type": "host"}


def failed_rows(g: TPGemm, world: int, st: TPSettings, reason: str) -> list[dict]:
    """The rows of a GEMM that failed as a whole (one per implementation that runs at ``st.dtype``)."""
    return [harness.failed_row(identity(g, world, st.dtype), "tp", name, reason, st.config(g.op))
            for name in impls_at(st.impls, st.dtype)]


def failed_host_rows(hc: HostCase, world: int, st: TPSettings, reason: str) -> list[dict]:
    """The host rows of a HostCase that failed as a whole (one per implementation that runs at its dtype)."""
    return [harness.host_row(host_identity(hc, world), registry.get("tp", name), harness.Result("failed", reason),
                             calls=hc.calls, warm_s=hc.warm_s, config=st.config(hc.g.op))
            for name in impls_at(st.impls, hc.dtype)]


def _case_inputs(g: TPGemm, st: TPSettings):
    """(TPInputs, references) of GEMM ``g`` on this rank at ``st.dtype``: fresh inputs, the weight's MX form made
    once outside every timed call (a cached weight)."""
    rank, world = world_info()
    a, b = make_inputs(g, world, rank, st.seed)
    if st.dtype == FP8B:
        b_fp8 = quant.quantize_fp8_block(b.t().contiguous(), quant.FP8_BLOCK)
        return TPInputs(g, a, b, st.dtype, None, b_fp8), references(g, a, b, st.dtype, b_fp8)
    b_mx = mx_weight(b) if st.dtype == MX else None
    return TPInputs(g, a, b, st.dtype, b_mx), references(g, a, b, st.dtype, b_mx)


def _baseline_parts(g: TPGemm, a, b, st: TPSettings):
    """cuBLAS GEMM alone (the local GEMM of this shape, bf16 at every dtype) and the NCCL collective alone (of what
    the dtype moves: mxfp8 AG the payload and the scales), in ms."""
    world = world_info()[1]
    if g.op == "ag_gemm":
        # the gathered input's shape with random data: torch.empty memory may hold zeros, and cuBLAS on zeros
        # runs faster than on real data (13% once on an H200): the GEMM-alone time would flatter cuBLAS
        a_full = torch.randn((a.shape[0] * world, a.shape[1]), device=a.device).to(a.dtype)
        gemm = lambda: a_full @ b  # noqa: E731
        comm = (lambda: dist.all_gather_into_tensor(a_full, a)) if world > 1 else None
        if st.dtype in (MX, FP8B) and world > 1:  # what moves: the payload and its scales
            q = quant.quantize_mx(a) if st.dtype == MX else quant.quantize_fp8_block(a)
            pay = torch.empty((a_full.shape[0], a.shape[1]), dtype=torch.uint8, device=a.device)
            sc = torch.empty((a_full.shape[0],) + tuple(q.scales.shape[1:]), dtype=q.scales.dtype, device=a.device)

            def comm():
                dist.all_gather_into_tensor(pay, q.payload.view(torch.uint8))
                dist.all_gather_into_tensor(sc, q.scales)
    else:
        partial = a @ b
        out = torch.empty((a.shape[0] // world, b.shape[1]), dtype=a.dtype, device=a.device)
        gemm = lambda: a @ b  # noqa: E731
        comm = (lambda: dist.reduce_scatter_tensor(out, partial)) if world > 1 else None
    t_gemm = timing.time_op(gemm, iters=st.iters, warmup=st.warmup)["time_ms"]
    t_comm = timing.time_op(comm, iters=st.iters, warmup=st.warmup)["time_ms"] if comm else 0.0
    return t_gemm, t_comm


def run_case(g: TPGemm, st: TPSettings, on_row=None) -> list[dict]:
    """Check and time every implementation of ``st.impls`` on GEMM ``g``; returns the result rows (all
    ranks return the same rows). ``on_row(row)`` is called as each row is ready."""
    world = world_info()[1]
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    inputs, ref = _case_inputs(g, st)
    t_gemm, t_comm = _baseline_parts(g, inputs.a, inputs.b, st)
    runner = harness.Runner(st, device, lambda: harness.recover(device), on_row, extra=st.extra)
    config = st.config(g.op)

    def impl_fields(name):
        fields = {"wire_bytes": wire_bytes(g.op, name, st.dtype, g.m, g.n, g.k, world)}
        if name == "fp8-rowwise":
            return {**fields, "note": FP8_ROWWISE_NOTE}
        return {**fields, "note": FP8B_BF16_NOTE} if name == "nccl+cublas" and st.dtype == FP8B else fields

    results = runner.run("tp", impls_at(st.impls, st.dtype), inputs=inputs, ref=ref,
                         identity=identity(g, world, st.dtype), flops=2.0 * g.m * g.n * g.k, config=config,
                         impl_fields=impl_fields, t_gemm_ms=t_gemm, t_comm_ms=t_comm)
    del inputs, ref
    torch.cuda.empty_cache()
    if st.trace_dir and st.dtype == "bf16" and "kosmos" in results and results["kosmos"].status == "ok":
        _write_trace(g, st, config)
    return runner.rows


def run_host_case(hc: HostCase, st: TPSettings, on_row=None, device=None) -> list[dict]:
    """The host rows of HostCase ``hc`` (every implementation of ``st.impls`` at its dtype: checked, then its
    host enqueue time measured; harness.Runner.host); all ranks return the same rows."""
    world = world_info()[1]
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    inputs, ref = _case_inputs(hc.g, st)
    runner = harness.Runner(st, device, lambda: harness.recover(device), on_row)
    runner.host("tp", impls_at(st.impls, st.dtype), inputs=inputs, ref=ref, identity=host_identity(hc, world),
                calls=hc.calls, warm_s=hc.warm_s, config=st.config(hc.g.op))
    return runner.rows


def bench_rank(rank, world, suite: dict, cases: list, out: str, trace_dir, argv, configs=None):
    """One rank of `kosmos bench tp` (launcher.spawn); rank 0 writes the env line and every row as it is ready."""
    from .environment import environment
    from .sweep import run_sweep
    dtypes = suite["dtype"] if isinstance(suite["dtype"], (list, tuple)) else [suite["dtype"]]
    st = TPSettings(impls=tuple(suite["impls"]), iters=suite["iters"], warmup=suite["warmup"],
                    fixed_sweep=tuple(suite["fixed_sweep"]), dtype=dtypes[0], trace_dir=trace_dir,
                    configs=dict(configs or {}), cuda_graph=bool(suite.get("cuda_graph")))
    by_dtype = {d: replace(st, dtype=d) for d in dtypes}
    device = torch.device("cuda", torch.cuda.current_device())
    # a case is (GEMM, dtype): each GEMM at every dtype in turn, so the precisions of a shape run back to back;
    # then the host enqueue measurement of each (op, dtype) (HostCase; none with host_calls 0 or in older suites)
    hosts = host_cases(cases, dtypes, suite.get("host_shape", HOST_SHAPE), suite.get("host_calls", 0), world)
    run_sweep(out, environment(argv=argv, suite=suite, bench="tp"), rank,
              [(TPGemm(**c), d) for c in cases for d in dtypes] + hosts, describe=describe,
              run_one=lambda case, write: run_host_case(case, by_dtype[case.dtype], on_row=write, device=device)
              if isinstance(case, HostCase) else run_case(case[0], by_dtype[case[1]], on_row=write),
              failed_rows=lambda case, why: failed_host_rows(case, world, by_dtype[case.dtype], why)
              if isinstance(case, HostCase) else failed_rows(case[0], world, by_dtype[case[1]], why),
              recover=lambda: harness.recover(device),
              # m, n, k too: custom shapes (model and layer "custom") may share a seq; the type: a host row and a
              # result row of one shape are two rows
              key=lambda r: (r["type"], r["model"], r["layer"], r["seq"], r["op"], r["m"], r["n"], r["k"],
                             r["dtype"], r["impl"]))


def describe(case) -> str:
    """One line naming a case, GEMM ``g``, (g, dtype) or a HostCase (the progress bar)."""
    if isinstance(case, HostCase):
        g = case.g
        return f"host enqueue {g.op} [{g.m}x{g.n}x{g.k}] {case.dtype}, {case.calls} calls"
    g, dtype = case if isinstance(case, tuple) else (case, None)
    what = f"custom {g.op}" if g.model == CUSTOM else f"{g.model} {g.layer} seq={g.seq}"
    return f"{what} [{g.m}x{g.n}x{g.k}]" + (f" {dtype}" if dtype else "")


def _write_trace(g: TPGemm, st: TPSettings, config):
    from kosmos.core.schedule import TRACE_EVENTS
    rank, world = world_info()
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    a, b = make_inputs(g, world, rank, st.seed)
    buf = torch.zeros((grid, TRACE_EVENTS, 4), dtype=torch.int64, device="cuda")
    timing.barrier()
    if g.op == "ag_gemm":
        kosmos.all_gather_matmul(a, b, config=config, trace=buf)
    else:
        kosmos.matmul_reduce_scatter(a, b, config=config, trace=buf)
    runtime.check_errors()
    what = f"{g.op}-{g.m}x{g.n}x{g.k}" if g.model == CUSTOM else f"{g.layer}-{g.seq}"  # custom: one file each
    harness.write_trace(buf, f"{st.trace_dir}/trace-{g.model}-{what}-w{world}.json",
                        {"op": g.op, "model": g.model, "layer": g.layer, "seq": g.seq, "m": g.m, "n": g.n, "k": g.k,
                         "world": world, "config": config_dict(config)})
