"""The ``triton-dot-scaled`` baseline's GEMM: C = A @ B with both operands MXFP8, through Triton's own
``tl.dot_scaled`` -- the MX path Triton offers on Hopper (which has no MX tensor cores: Triton lowers it by
upcasting each operand tile to bf16 inside the K loop, then a bf16 MMA).

A: payload e4m3 [M, K] + scales uint8 [M, K/32]; B: payload e4m3 [N, K] (a weight in nn.Linear layout) + scales
[N, K/32]; C bf16 [M, N]. A plain tiled kernel (one program per C tile, GROUP_M swizzle for L2, pointer loads,
software-pipelined by Triton). Tile: the fastest of the configurations tried on one H200 (dev/archive/mx_probe.py;
the figures are in kosmos/kernels/all_gather_matmul.py's docstring) -- a fixed rule, no autotuning at call time.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BM, BN, BK, num_warps, num_stages): the default, and the other candidates dev/archive/mx_probe.py times
DOT_SCALED_TILE = (128, 128, 64, 4, 4)
DOT_SCALED_CANDIDATES = [(128, 128, 64, 4, 4), (128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
                         (128, 128, 32, 4, 5), (128, 256, 64, 8, 3)]


@triton.jit
def _dot_scaled_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, M, N, K,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    group = pid // (GROUP_M * n_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(n_m - first_m, GROUP_M)
    pm = first_m + (pid % (GROUP_M * n_n)) % size_m
    pn = (pid % (GROUP_M * n_n)) // size_m
    offs_m = pm * BM + tl.arange(0, BM)
    offs_n = pn * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    offs_s = tl.arange(0, BK // 32)
    KB = K // 32
    mm = offs_m < M
    nn = offs_n < N
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        kmask = (k0 + offs_k) < K
        smask = (k0 // 32 + offs_s) < KB
        a = tl.load(a_ptr + offs_m.to(tl.int64)[:, None] * K + (k0 + offs_k)[None, :],
                    mask=mm[:, None] & kmask[None, :], other=0.0)
        sa = tl.load(as_ptr + offs_m.to(tl.int64)[:, None] * KB + (k0 // 32 + offs_s)[None, :],
                     mask=mm[:, None] & smask[None, :], other=127)
        b = tl.load(b_ptr + offs_n.to(tl.int64)[None, :] * K + (k0 + offs_k)[:, None],
                    mask=nn[None, :] & kmask[:, None], other=0.0)
        sb = tl.load(bs_ptr + offs_n.to(tl.int64)[:, None] * KB + (k0 // 32 + offs_s)[None, :],
                     mask=nn[:, None] & smask[None, :], other=127)
        acc = tl.dot_scaled(a, sa, "e4m3", b, sb, "e4m3", acc)
    c = c_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(c, acc.to(tl.bfloat16), mask=mm[:, None] & nn[None, :])


def dot_scaled_matmul(a, b, tile=DOT_SCALED_TILE) -> torch.Tensor:
    """``a`` (payload [M, K], scales [M, K/32]) @ ``b``^T with ``b`` = (payload [N, K], scales [N, K/32]) in
    MXFP8 through tl.dot_scaled; bf16 [M, N]."""
    (ap, as_), (bp, bs) = a, b
    m, k = ap.shape
    n = bp.shape[0]
    bm, bn, bk, warps, stages = tile
    c = torch.empty((m, n), dtype=torch.bfloat16, device=ap.device)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _dot_scaled_kernel[grid](ap, as_, bp, bs, c, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps,
                             num_stages=stages)
    return c
