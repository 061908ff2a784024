"""Liger-Kernel's fused MoE as the ``liger`` baseline of ``kosmos bench moe`` (issue 43, item 3).

What Liger computes: ``liger_kernel.ops.fused_moe.LigerFusedMoEFunction.apply(x, gate_up_proj, down_proj,
top_k_index, top_k_weights)`` (liger_kernel/ops/fused_moe.py; the Function Liger's own ``LigerExperts`` -- its patch
of transformers v5's MoE experts modules -- calls) is the EXPERTS ONLY, for a routing decision given from outside: x
[T, H], top_k_index [T, k] int32, top_k_weights [T, k] (its kernels load them as fp32) -> y [T, H] in x's dtype.
Triton, in portable tl.dot (no TMA / WGMMA): three routing-metadata kernels (a per-expert histogram, prefix sums, a
sort-by-expert scatter; SonicMoE's) with ONE host sync (``.item()``: the number of 64-row tiles, to size the buffers
and grids), then a fused gather + GEMM1 + SwiGLU (gate and up in separate fp32 accumulators), GEMM2 to Y [T*k, H]
bf16, and a weighted gather-sum over each token's k rows (fp32 accumulation). Every kernel but the routing ones is
autotuned (``triton.autotune`` keyed on the sizes H, F (, k), 16 to 40 configs) on its first call at new sizes: that
happens in the bench's check call, before timing (LIGER_FUSED_MOE_AUTOTUNE=0, set before liger_kernel is imported,
pins one config each; the bench leaves Liger's default, autotuning, on). Its autograd backward (a
torch.autograd.Function) recomputes dA' = dO @ W2^T instead of saving Y, applies the SwiGLU backward from the saved
gate | up, and returns dx, d gate_up_proj, d down_proj and d top_k_weights (the gate weights' gradient, accumulated
in dy's dtype, bf16, with atomics) -- so the router's gradient flows through the weights. EP = 1 only: every expert
on one GPU (Liger's expert-parallel module, LigerExpertParallelFusedMoe, is a different op that needs the separate
native liger_cute_kernels package and NVSHMEM, not in this wheel; not used here).

Weight layout (transformers v5's, the same as the hf-* baselines'): gate_up_proj [E, 2F, H] with the gate rows
first then the up rows = w13 [E, H, 2F] (gate | up) transposed, down_proj [E, H, F] = w2 [E, F, H] transposed.
``liger_weights`` makes both ONCE when the baseline is built, outside the timed call (contiguous copies: Liger's
Function makes every input contiguous itself -- ``ensure_contiguous`` -- so transposed views would be copied in
every timed call). ``kosmos_grads`` gives the weight gradients back as [E, H, 2F] / [E, F, H] views for the check.

How the baseline runs the layer (``liger_layer``): the router is KOSMOS's torch router, ``kosmos.reference.moe.route``
on the point's x, router weight and bias (fp32 logits, the call nccl-a2a and deepep make), so the decision and the
gate weights are exactly the point's; its int64 experts are cast to int32 (as LigerExperts does) and its fp32
weights passed as they are; then Liger's experts. Both are inside the timed call (the layer is router + experts,
as every other row), and the row's ``note`` says that the router is torch's, not Liger's. bf16 only (no MXFP8 path:
"unavailable" at mxfp8), every direction:

  fwd      ``layer(x, router_weight, gate_up_proj, down_proj)`` -> y; checked like nccl-a2a against the point's
           fp32 reference (same decision).
  bwd      ``moe.autograd_backward`` as the hf-* rows: the forward (its graph) untimed, ``torch.autograd.grad`` of y
           for dy timed -- Liger's backward kernels and route's backward (softmax / sigmoid, top-k gather,
           renormalisation, the router GEMM) in torch -- differentiating x, the router weight and the Liger-layout
           weights (leaves made once); checked by grad_reference for the decision (dx, d_router, dw13, dw2).
  fwd+bwd  both in one timed call.

Not in the timed call: the layout copies, the leaves, Liger's import. In it: route (with its x.float() copy, the
same as nccl-a2a's router), the int32 cast of the experts, and whatever Liger's Function allocates itself (its
routing metadata, gate | up [T*k, 2F], SwiGLU [T*k, F], Y [T*k, H]; at bwd its gradients' buffers). Not
capturable in a CUDA graph (the host sync above): under ``--cuda-graph`` the fwd row is expected to fail its capture
("CUDA graph capture: ...", not tried yet), the bwd row is "unavailable" like every split call.

Availability (``liger_available``): liger_kernel importable with its fused MoE (LigerFusedMoEFunction), a CUDA
device (Triton kernels), and one rank; else an "unavailable" row with the one-line reason. On a GPU whose memory the
point's estimate exceeds (``moe.liger_check_bytes``, the hf-* rule ``moe.HF_MEMORY_SHARE``): "unavailable" with it.

Where Liger comes from: the pure-Python wheel liger_kernel-0.8.5-py3-none-any.whl (892 KB, sha256
60789cd576af073ab9b192b570d2597fd0cdad489cd62fb44fb16256d43754c9), carried to the GPU machine in .whl/ (git-ignored)
and installed there by dev/gpu_check.sh with ``pip install --no-deps --target`` beside DeepEP's; written against
its sources (liger_kernel/ops/fused_moe.py, fused_moe_kernels.py). Anywhere else: ``pip install liger-kernel``.
On the CPU its Triton kernels run under TRITON_INTERPRET=1 in fp32 (tests/test_bench_moe_liger.py checks this
module's layer against the fp32 references there); bf16 does not run in the interpreter.
"""
from __future__ import annotations

import importlib

import torch

from kosmos.models import MoEModel
from kosmos.reference.moe import route

LIGER_DTYPES = {"bf16": None, "mxfp8": "Liger's fused MoE has no MXFP8 path"}
WHEEL_SHA256 = "60789cd576af073ab9b192b570d2597fd0cdad489cd62fb44fb16256d43754c9"  # liger_kernel-0.8.5 (py3-none-any)
INSTALL_HINT = "pip install liger-kernel; on the GPU machine carry .whl/liger_kernel-*.whl"


def liger_version() -> str:
    try:
        from importlib.metadata import version
        return version("liger_kernel")
    except Exception:  # not installed, or installed without its metadata
        mod = importlib.import_module("liger_kernel")
        return getattr(mod, "__version__", "(unknown version)")


def liger_function():
    """Liger's fused-MoE autograd Function, ``liger_kernel.ops.fused_moe.LigerFusedMoEFunction`` (its Triton
    implementation, the one LigerExperts gets on CUDA: imported from the submodule, so that a LIGER_KERNEL_IMPL
    backend override cannot swap it). ImportError with a one-line reason when liger_kernel is missing, broken, or has
    no fused MoE."""
    no_moe = ("has no fused MoE (liger_kernel.ops.fused_moe.LigerFusedMoEFunction; this baseline is written against "
              "0.8.5)")
    try:
        mod = importlib.import_module("liger_kernel.ops.fused_moe")
    except ModuleNotFoundError as e:
        if e.name == "liger_kernel":
            raise ImportError(f"liger_kernel is not installed ({INSTALL_HINT})") from None
        if e.name == "liger_kernel.ops.fused_moe":
            raise ImportError(f"liger_kernel {liger_version()} {no_moe}") from None
        raise ImportError(f"liger_kernel is not importable (ModuleNotFoundError: {e})") from None
    except Exception as e:  # a broken install failing at import
        first = (str(e).splitlines() or [""])[0]
        raise ImportError(f"liger_kernel is not importable ({type(e).__name__}: {first})") from None
    fn = getattr(mod, "LigerFusedMoEFunction", None)
    if fn is None:
        raise ImportError(f"liger_kernel {liger_version()} {no_moe}")
    return fn


def liger_available(world: int) -> tuple[bool, str | None]:
    """Whether the liger baseline can run here: its fused MoE importable, a CUDA device, one rank (EP = 1)."""
    try:
        liger_function()
    except ImportError as e:
        return False, str(e)
    if not torch.cuda.is_available():
        return False, "Liger's fused MoE is Triton GPU kernels: no CUDA device here"
    if world != 1:
        return False, (f"Liger's fused MoE (LigerFusedMoEFunction) holds every expert on one GPU: EP = 1 only, not "
                       f"{world} ranks")
    return True, None


def liger_note() -> str:
    """The row note: what ran (Liger's version and Function, the router in torch, the layout copy)."""
    try:
        version = liger_version()
    except Exception:
        version = "(not importable)"
    return (f"liger_kernel {version}: LigerFusedMoEFunction (experts only) on the point's routing from KOSMOS's torch "
            f"router (kosmos.reference.moe.route, fp32 logits, in the timed call); weights in Liger's layout "
            f"(gate_up_proj [E, 2F, H], down_proj [E, H, F]) copied once, untimed; no shared experts")


def liger_weights(w13, w2):
    """KOSMOS's expert weights -> Liger's layout, contiguous copies (made once, untimed): (gate_up_proj [E, 2F, H]:
    rows 0..F-1 the gate, F..2F-1 the up projection; down_proj [E, H, F]) from w13 [E, H, 2F] (gate | up) and
    w2 [E, F, H]."""
    return w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()


def kosmos_grads(grads):
    """(dx, d_router, d gate_up_proj [E, 2F, H], d down_proj [E, H, F]) -> the last two as [E, H, 2F] / [E, F, H]
    views (the layout of w13 / w2)."""
    dx, d_router, d_gate_up, d_down = grads
    return dx, d_router, d_gate_up.transpose(1, 2), d_down.transpose(1, 2)


def liger_layer(fn, top_k: int, route_kw: dict):
    """``layer(x, router_weight, gate_up_proj, down_proj)`` -> (y [T, H], experts [T, k] int64): ``route`` (the point's
    router, in torch) then Liger's experts ``fn.apply`` on that decision (module docstring)."""
    def layer(x, router_weight, gate_up_proj, down_proj):
        weights, experts = route(x, router_weight, top_k, **route_kw)
        return fn.apply(x, gate_up_proj, down_proj, experts.to(torch.int32), weights), experts
    return layer
