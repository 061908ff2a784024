"""What the two TP ops share on the host: their input checks and the one route decision.

``check_operands`` runs every check that needs no process group (types, dtypes, shapes, devices, TMA alignment,
the policy) and ``quantize_request`` reads ``precision``, so both ops raise the same errors for the same inputs.
``tp_route`` decides, once for both ops, which path a call takes -- FUSED (the op's own kernel), W1_STATIC
(gemm/w1_static.py) or W1_MX (gemm/w1_mx.py) -- and which host step runs before the launch (PRE_QUANTIZE,
PRE_ROUND, PRE_EXPAND: ``pre_step``, which a plan's replay repeats); ``w1_mx_pass_first`` is its few-tile rule.
Tests: tests/opcases.py's InputChecks (run by both ops' test files), tests/test_all_gather_matmul.py
(test_tp_route_is_one_decision_for_both_ops, test_w1_mx_pass_first_rule, test_w1_mx_pass_first_path).
Design: docs/design/all_gather_matmul.md, docs/design/matmul_reduce_scatter.md; the pass-first rule and how its
thresholds were drawn: docs/design/gemm.md.
"""
from typing import NamedTuple

import torch

from ..core import planning, runtime
from ..core.schedule import POLICIES
from ..gemm import w1_mx
from ..quant import (FP8BlockTensor, check_fp8_block, check_mx, dequantize_mx, quantize_fp8_block, quantize_mx,
                     round_to_mx)
from ..quant import FP8_BLOCK as FP8_BLOCK_ROWS


def check_matrix(name: str, t, device=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D, got shape {tuple(t.shape)}")
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be torch.bfloat16, got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)})")
    if t.data_ptr() % 16:
        raise ValueError(f"{name} must start at a 16-byte aligned address (TMA); got a view at storage offset "
                         f"{t.storage_offset()} -- .clone() it")


def b_layout(b: torch.Tensor):
    """Return (b_storage, kmajor): a row-major [K, N] b, or a transposed view of a row-major [N, K] weight."""
    if b.is_contiguous():
        return b, False
    if b.t().is_contiguous():
        return b.t(), True
    raise ValueError(f"b must be row-major [K, N] or the transpose of a row-major [N, K] tensor; got strides "
                     f"{b.stride()} for shape {tuple(b.shape)}")


def check_operands(a_name: str, a, b, policy: str):
    """Every check that needs no process group, in one place: returns (rows, K, N, b_store, b_kmajor).
    ``a`` is a bf16 matrix or an MXFP8 one (a ``kosmos.quant.MXTensor``; b stays bf16: quant.mx_round)."""
    if isinstance(a, tuple):
        check_mx(a_name, a)
        a = a[0]
    else:
        check_matrix(a_name, a)
    check_matrix("b", b)
    if a.device.type != "cuda":
        raise ValueError(f"{a_name} must be a CUDA tensor, got {a.device}")
    if b.device != a.device:
        raise ValueError(f"b is on {b.device} but {a_name} is on {a.device}")
    if not a.is_contiguous():
        raise ValueError(f"{a_name} must be contiguous")
    rows, k = a.shape
    if b.shape[0] != k:
        raise ValueError(f"{a_name} is [{rows}, {k}] but b is {list(b.shape)}: b must have K={k} rows")
    n = b.shape[1]
    check_tma_dims(K=k, N=n)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
    return (rows, k, n) + b_layout(b)


FP8_BLOCK = "fp8-block"
PRECISIONS = (None, "bf16", "mxfp8", FP8_BLOCK)


def quantize_request(a_name: str, a, precision) -> bool:
    """Whether a TP op is to quantize a bf16 ``a`` to MXFP8 itself (``precision="mxfp8"``); an MXTensor ``a`` is
    MXFP8 already (precision None or "mxfp8"), a bf16 one without it is computed in bf16."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose None, 'bf16', 'mxfp8' or 'fp8-block'")
    if isinstance(a, tuple):
        if precision == "bf16":
            raise ValueError(f"{a_name} is an MXTensor but precision='bf16'")
        return False
    if precision == "mxfp8":
        if not isinstance(a, torch.Tensor) or a.dtype != torch.bfloat16:
            raise ValueError(f"precision='mxfp8' quantizes a bf16 {a_name}; got "
                             f"{getattr(a, 'dtype', type(a).__name__)}")
        if a.dim() == 2 and a.shape[1] % 32:
            raise ValueError(f"precision='mxfp8' needs K={a.shape[1]} to be a multiple of 32 (MX blocks)")
        return True
    return False


def check_tma_dims(**dims) -> None:
    for name, v in dims.items():
        if v % 8:
            raise ValueError(f"{name}={v} must be a multiple of 8 (rows of 16 bytes are needed by TMA)")


# ------------------------------------------------------------------------------------------ the route decision
# The routes a TP op's call can take (TPRoute.kind):
FUSED = "fused"          # the op's own persistent kernel: any W, traces, the fixed-role policy, MX with DEQ tasks
W1_STATIC = "w1-static"  # W = 1, bf16 operands, self policy, untraced: gemm/w1_static.py (nothing to wait for)
W1_MX = "w1-mx"          # W = 1 MXFP8 on a GPU with Gluon: gemm/w1_mx.py (quantizes or expands A in the launch)
# What runs on the host before the launch (TPRoute.pre; a plan replays the same step):
PRE_QUANTIZE = "first"   # quant.quantize_mx: a bf16 A to MXFP8, then the fused kernel's MX path
PRE_ROUND = "round"      # quant.round_to_mx: a bf16 A's MX values as bf16, then the static GEMM
PRE_EXPAND = "expand"    # quant.dequantize_mx: an MXTensor A's values as bf16, then the static GEMM

MX_PASS_FIRST_MIN_MACS = 1 << 28  # below: launch-bound calls, where one launch (the Gluon kernel) beats two


class TPRoute(NamedTuple):
    kind: str              # FUSED, W1_STATIC or W1_MX
    pre: str | None        # None, PRE_QUANTIZE, PRE_ROUND or PRE_EXPAND


def tp_route(world: int, a, quantize: bool, m: int, n: int, k: int, trace, policy: str, device,
             programs: int) -> TPRoute:
    """The route of a TP op's call, the one decision both ops make (``a``: the op's A operand, an MXTensor or
    bf16; ``quantize``: the op is to quantize a bf16 ``a`` itself; C is [m, n], K = ``k``; ``programs`` the SMs):

    * an MXFP8 call (MXTensor ``a`` or ``quantize``) at W = 1, untraced, self policy, where gemm/w1_mx.py's
      Gluon kernel runs (``w1_mx.unavailable``): W1_MX, unless ``w1_mx_pass_first`` says the shape runs faster as
      one pass over A (PRE_ROUND from bf16, PRE_EXPAND from an MXTensor) and then the W1_STATIC GEMM;
    * any other MXFP8 call: FUSED, after PRE_QUANTIZE when ``a`` is bf16;
    * bf16 at W = 1, untraced, self policy: W1_STATIC;
    * everything else (W > 1, a trace buffer, the fixed-role ablation): FUSED."""
    mx = quantize or isinstance(a, tuple)
    w1 = world == 1 and trace is None and policy == "self"
    if mx and w1 and w1_mx.unavailable(device) is None:
        if w1_mx_pass_first(m, n, k, programs):
            return TPRoute(W1_STATIC, PRE_ROUND if quantize else PRE_EXPAND)
        return TPRoute(W1_MX, None)
    if mx:
        return TPRoute(FUSED, PRE_QUANTIZE if quantize else None)
    return TPRoute(W1_STATIC if w1 else FUSED, None)


def split_mx(a):
    """(payload, scales) of an MXTensor A, (a, None) of a bf16 one."""
    return a if isinstance(a, tuple) else (a, None)


def pre_step(a, pre: str | None):
    """The host step of TPRoute.pre on A: quantize_mx / round_to_mx / dequantize_mx, or ``a`` itself."""
    if pre is None:
        return a
    if pre == PRE_QUANTIZE:
        return quantize_mx(a)
    return round_to_mx(a) if pre == PRE_ROUND else dequantize_mx(*a)


def w1_mx_pass_first(m: int, n: int, k: int, programs: int) -> bool:
    """Whether a W = 1 MXFP8 call the Gluon kernel could take runs faster as one pass that makes A's MX values
    (quant.round_to_mx from bf16, quant.dequantize_mx from an MXTensor) followed by the bf16 static GEMM on them
    (planning.w1_plan's K split, stream-K, tail tiles and two programs per SM: schedules the Gluon kernel lacks).
    True for C [m, n] of >= MX_PASS_FIRST_MIN_MACS multiply-adds where N <= 1536 (few column tiles to spread the
    in-launch rounding over), where w1_plan runs two programs per SM (short K), or where m >= 1024 and the Gluon
    kernel's tiles (w1_mx.tile_width) fill under 0.9 of their waves. The separate pass reads 2 and writes 2 bytes
    per element of A (~3.3 TB/s on an H200): cheap against the idle SMs it saves there, dear against small M's
    15-50 us GEMMs. How the thresholds were drawn, and the held-out check: docs/design/gemm.md."""
    if m * n * k < MX_PASS_FIRST_MIN_MACS:
        return False
    bn = w1_mx.tile_width(m, n, programs)
    tiles = -(-m // w1_mx.BM) * -(-n // bn)
    fill = tiles / (-(-tiles // programs) * programs)
    return n <= 1536 or planning.w1_plan(m, n, k, programs=programs).per_sm > 1 or (fill < 0.9 and m >= 1024)


# ------------------------------------------------------------------------------------------ fp8-block (W = 1)
def is_fp8_block_call(a, b, precision) -> bool:
    """Whether a TP op's call takes the fp8-block route: ``precision="fp8-block"`` or an FP8BlockTensor operand."""
    return precision == FP8_BLOCK or isinstance(a, FP8BlockTensor) or isinstance(b, FP8BlockTensor)


def fp8_block_operands(a_name: str, a, b, precision, policy: str, trace):
    """(A, W, device): a TP op's fp8-block operands, checked -- ``a`` bf16 [M, K] (quantized here, 1x128 blocks,
    quant.quantize_fp8_block) or an FP8BlockTensor with 1x128 blocks; ``b`` an FP8BlockTensor with 128x128 blocks
    of the weight W [N, K] (B = W^T: quantize the weight once, ``quant.quantize_fp8_block(w, 128)``), or bf16
    [K, N] (quantized here on every call: a [K, N] read and an [N, K] copy). One-line refusals: the fixed-role
    policy, a trace buffer, another precision with an FP8BlockTensor, and what gemm/w1_static.fp8_block_operands
    refuses."""
    from ..gemm.w1_static import fp8_block_operands as check_pair
    if precision not in (None, FP8_BLOCK):
        raise ValueError(f"an FP8BlockTensor operand with precision={precision!r}: pass precision='fp8-block' or None")
    if policy != "self" or trace is not None:
        raise ValueError("precision='fp8-block' runs the self policy without a trace buffer")
    if isinstance(a, torch.Tensor):
        check_matrix(a_name, a)
        if a.device.type != "cuda" or not a.is_contiguous():
            raise ValueError(f"{a_name} must be a contiguous CUDA tensor, got {a.device}"
                             f"{'' if a.is_contiguous() else ', not contiguous'}")
        a8 = quantize_fp8_block(a, 1)
    else:
        a8 = a
    check_fp8_block(a_name, a8)
    dev = a8.payload.device
    if isinstance(b, torch.Tensor):
        check_matrix("b", b, dev)
        b8 = quantize_fp8_block(b.t().contiguous(), FP8_BLOCK_ROWS)
    else:
        b8 = b
    check_pair(a8, b8)
    return a8, b8, dev


def fp8_block_w1(a8, b8, ws):
    """C bf16 = A @ W^T at W = 1 for operands fp8_block_operands returned: one launch of the static W = 1 GEMM's
    scaled mainloop (gemm/w1_static.fp8_block_matmul) on workspace ``ws``'s epoch and error record. (At W > 1 each
    op runs its fused kernel's SCALED mainloop: the ops' ``_fp8_block``.)"""
    from ..gemm.w1_static import fp8_block_matmul
    ws.ensure(1, 0)
    ws.before_launch()
    c = fp8_block_matmul(a8, b8, programs=runtime.num_sms(a8.payload.device), epoch_slot=ws.epoch_slot,
                         errors=ws.errors)
    ws.after_launch()
    return c
