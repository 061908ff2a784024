"""Pure-torch references of the two TP ops (AllGather+GEMM, GEMM+ReduceScatter) and the error measure.

With ``fp32=True`` (tests, bench checks) the math runs in fp32 on upcast inputs: the ground truth.
With ``fp32=False`` the same code is the ``nccl+cublas`` baseline: NCCL collective + torch.matmul in bf16.
Tests and baselines import these functions, so they cannot drift apart. The ``*_local`` variants take every
rank's inputs in one process (CPU tests, single-process checks). ``rel_err`` / ``FrobeniusError``: the relative
Frobenius error every test and bench row reports (inf for any NaN or inf). Tests: tests/test_reference.py.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..core import runtime


def _mm(a, b, fp32: bool):
    return a.float() @ b.float() if fp32 else a @ b


def all_gather_matmul_ref(a_shard, b, group=None, *, fp32: bool = True, a_full=None):
    """(a_full, c) = (allgather(a_shard), allgather(a_shard) @ b) with NCCL + torch.matmul."""
    w = dist.get_world_size(group) if dist.is_initialized() else 1
    if a_full is None:
        a_full = torch.empty((a_shard.shape[0] * w, a_shard.shape[1]), dtype=a_shard.dtype, device=a_shard.device)
    if w > 1:
        runtime.all_gather_into(a_full, a_shard, group)
    else:
        a_full.copy_(a_shard)
    return a_full, _mm(a_full, b, fp32)


def matmul_reduce_scatter_ref(a, b, group=None, *, fp32: bool = True):
    """This rank's M/W rows of sum_r a_r @ b_r with torch.matmul + NCCL reduce-scatter."""
    w = dist.get_world_size(group) if dist.is_initialized() else 1
    partial = _mm(a, b, fp32)
    if w == 1:
        return partial
    if runtime.host_staged(group, partial):  # gloo with CUDA tensors (ranks on one GPU)
        host = torch.empty((a.shape[0] // w, b.shape[1]), dtype=partial.dtype)
        dist.reduce_scatter_tensor(host, partial.cpu(), group=group)
        return host.to(a.device)
    out = torch.empty((a.shape[0] // w, b.shape[1]), dtype=partial.dtype, device=a.device)
    dist.reduce_scatter_tensor(out, partial, group=group)
    return out


def all_gather_matmul_ref_local(shards, b):
    """Single process: every rank's a_shard in ``shards`` (rank order) -> (a_full, c) in fp32."""
    a_full = torch.cat(shards)
    return a_full, a_full.float() @ b.float()


def matmul_reduce_scatter_ref_local(a_list, b_list):
    """Single process: every rank's (a, b) -> list of each rank's c_shard in fp32, summed in rank order."""
    w = len(a_list)
    total = a_list[0].float() @ b_list[0].float()
    for a, b in zip(a_list[1:], b_list[1:]):
        total = total + a.float() @ b.float()
    return list(total.chunk(w))


def fp8_block_matmul_ref(a, b) -> torch.Tensor:
    """The fp64 product A @ W^T of block-scaled FP8 operands (quant.FP8BlockTensor: A [M, K] 1x128, W [N, K]
    128x128), each dequantized exactly (quant.dequantize_fp8_block_ref in fp32): the ground truth of an
    fp8-block GEMM, whose only roundings are its fp32 sums and the bf16 output."""
    from .. import quant
    return (quant.dequantize_fp8_block_ref(a, torch.float32).double()
            @ quant.dequantize_fp8_block_ref(b, torch.float32).double().t())


def rel_err(out, ref) -> float:
    """Relative Frobenius error; NaN/inf anywhere in out or ref gives inf (never passes)."""
    return FrobeniusError().add(out, ref).value()


class FrobeniusError:
    """``rel_err`` of a tensor compared piece by piece: ``add(out_piece, ref_piece)`` for each piece (any split of
    the elements), then ``value()`` = ||out - ref||_F / ||ref||_F from the pieces' squared norms summed in fp64 --
    the one-piece value is rel_err's, bitwise (sqrt of a double's square is that double), and a split changes it
    only by the order the squared norms are summed in. So that a reference too large to hold whole is compared
    as it is computed (the MoE backward's fp32 weight gradients at deepseek-v3: 42 GiB, kosmos_bench.moe's
    grad_reference). Each piece in fp32 (out.float() - ref.float(), norms in fp32, as rel_err always took them);
    NaN/inf in any piece makes the value inf."""

    def __init__(self):
        self.diff_sq = 0.0
        self.ref_sq = 0.0
        self.finite = True

    def add(self, out, ref) -> "FrobeniusError":
        if tuple(out.shape) != tuple(ref.shape):
            raise ValueError(f"output shape {tuple(out.shape)}, expected {tuple(ref.shape)}")
        out = out.float()
        ref = ref.float()
        if not torch.isfinite(out).all() or not torch.isfinite(ref).all():
            self.finite = False
        if self.finite:
            self.ref_sq += ref.norm().item() ** 2
            self.diff_sq += (out - ref).norm().item() ** 2
        return self

    def value(self) -> float:
        if not self.finite:
            return float("inf")
        denom = math.sqrt(self.ref_sq)
        return math.sqrt(self.diff_sq) / (denom if denom > 0 else 1.0)
