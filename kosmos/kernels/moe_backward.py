"""The MoE layer's backward: its pieces, on the way to one launch (issue: the MoE backward in one launch).

So far: the per-expert weight gradient, the one GEMM shape of the backward the forward kernel has no twin of.

    dW[e] = A[rows of e]^T @ B[rows of e]            A [R, KA], B [R, KB] bf16, rows of expert e consecutive
                                                      (counts[e] of them, zero allowed), dW [E, KA, KB] fp32
It is GEMM2's weight gradient (A = h [R, F], B = do [R, H]: dW2[e] = h^T do) and GEMM1's (A = the expert rows
x_rows [R, H], B = [dg | du] [R, 2F]: dW13[e] = x_rows^T [dg | du]) -- moe_reference.gemm2_backward_ref and
gemm1_backward_ref.

Determinism: one program owns each output tile (e, i, j) and sums the expert's rows in ascending order, BR
rows per step, with fp32 accumulation: no atomics, the result does not depend on the schedule (bitwise
reproducible). The grid is static -- E * ceil(KA/BI) * ceil(KB/BJ) tiles whatever the counts -- and the
expert row offsets are an exclusive cumsum of counts on the device, so nothing synchronises with the host.
An expert without rows gets zeros.

Math per tile: acc[BI, BJ] += A[r0:r0+BR, i*BI:+BI]^T @ B[r0:r0+BR, j*BJ:+BJ] (tl.dot of the transposed A
tile); rows past the expert's end load as zeros.

Not yet run on a GPU (session 8, 2026-12-01: interpreter tests only); no speed figures. Compiles for sm_90a
(local Triton 3.9, 128x128 tiles, 64-row steps, 8 warps, 3 stages): 98 registers, no spills, 96 KiB shared. In the one-launch
backward these tiles become a stage whose tasks wait for the rows' dgrad flags, as the forward's GEMM2 waits
for GEMM1's tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import planning


@triton.jit
def _expert_wgrad_kernel(a_ptr, b_ptr, offs_ptr, counts_ptr, out_ptr, KA, KB,
                         BI: tl.constexpr, BJ: tl.constexpr, BR: tl.constexpr, DOT_FP32: tl.constexpr):
    pid = tl.program_id(0)
    n_i = tl.cdiv(KA, BI)
    n_j = tl.cdiv(KB, BJ)
    e = pid // (n_i * n_j)
    ti = (pid // n_j) % n_i
    tj = pid % n_j
    first = tl.load(offs_ptr + e)
    rows = tl.load(counts_ptr + e)
    ci = ti * BI + tl.arange(0, BI)
    cj = tj * BJ + tl.arange(0, BJ)
    acc = tl.zeros((BI, BJ), dtype=tl.float32)
    r = tl.arange(0, BR)
    for r0 in range(0, rows, BR):
        rr = (first + r0 + r).to(tl.int64)
        rm = (r0 + r) < rows
        a = tl.load(a_ptr + rr[:, None] * KA + ci[None, :], mask=rm[:, None] & (ci < KA)[None, :], other=0.0)
        b = tl.load(b_ptr + rr[:, None] * KB + cj[None, :], mask=rm[:, None] & (cj < KB)[None, :], other=0.0)
        if DOT_FP32:  # the CPU interpreter's bf16 dot is wrong; fp32 is exact
            acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc)
        else:
            acc = tl.dot(tl.trans(a), b, acc)
    out = out_ptr + e.to(tl.int64) * KA * KB
    tl.store(out + ci[:, None] * KB + cj[None, :], acc, mask=(ci < KA)[:, None] & (cj < KB)[None, :])


def expert_weight_grads(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """dW [E, KA, KB] fp32 with dW[e] = a[rows of e]^T @ b[rows of e]; a [R, KA], b [R, KB] bf16 on one device,
    the rows of expert e the next counts[e] after those of experts < e (sum(counts) <= R). Deterministic (the
    module docstring). CUDA, or the CPU under TRITON_INTERPRET=1."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.bfloat16:
            raise ValueError(f"{name} must be a 2-D torch.bfloat16 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a has {a.shape[0]} rows but b has {b.shape[0]}: one row per (token, expert) pair each")
    if a.device != b.device or counts.device != a.device:
        raise ValueError(f"a, b and counts must be on one device (got {a.device}, {b.device}, {counts.device})")
    if counts.dim() != 1 or counts.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"counts must be a 1-D int32/int64 tensor, got {counts.dtype} {tuple(counts.shape)}")
    n_exp, ka, kb = counts.shape[0], a.shape[1], b.shape[1]
    out = torch.empty((n_exp, ka, kb), dtype=torch.float32, device=a.device)
    if n_exp == 0:
        return out
    counts32 = counts.to(torch.int32)
    offs = torch.cumsum(counts32, 0, dtype=torch.int32) - counts32  # exclusive: no host synchronisation
    if planning.interpreting():
        bi, bj, br, warps, stages = 16, 16, 16, 4, 1
    else:  # a first choice (unmeasured): 128x128 output tiles, 64 rows per step
        bi, bj, br, warps, stages = 128, 128, 64, 8, 3
    grid = (n_exp * triton.cdiv(ka, bi) * triton.cdiv(kb, bj),)
    _expert_wgrad_kernel[grid](a, b, offs, counts32, out, ka, kb, BI=bi, BJ=bj, BR=br,
                               DOT_FP32=planning.interpreting(), num_warps=warps, num_stages=stages)
    return out


def expert_weight_grads_ref(a: torch.Tensor, b: torch.Tensor, counts) -> torch.Tensor:
    """The same in fp64 (then fp32), one expert at a time (any device)."""
    out, start = [], 0
    for n in [int(c) for c in counts.tolist()]:
        out.append(a[start:start + n].double().t() @ b[start:start + n].double())
        start += n
    return torch.stack(out).float() if out else torch.empty((0, a.shape[1], b.shape[1]))
