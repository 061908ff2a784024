"""Gluon probe (issue 14): a persistent bf16 GEMM for Hopper whose mainloop rounds A to its MXFP8 values.

(The full design notes and the prediction follow in the next commit.)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kosmos.quant import _rceil_exponent, mx_round_bf16

IMPLS = {"kosmos": 0, "packed": 1}  # ROUND_IMPL: which arithmetic rounds A (module docstring)


# ============================================================================================ MX rounding of a tile
@gluon.jit
def _absmax_bf16x2(a, b):
    """max(|a|, |b|) of each 16-bit half of two int32 words holding bf16 pairs, NaN-propagating (a NaN gives the
    canonical 0x7FFF); the result's sign bits are meaningless (xorsign), the caller masks them."""
    return gl.inline_asm_elementwise("max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _splat2(h):
    """A 16-bit pattern in both halves of an int32 word."""
    return h | (h << 16)


@gluon.jit
def _mx_round_words(w):
    """The MX values of bf16 pairs: ``w`` int32 [R, NB, 16], each word two consecutive bf16 of a row, the last axis
    one MX block of 32 elements; returns the words of their MX values (module docstring, "packed"): the same
    values as kosmos.quant.mx_round_bf16 bit for bit, but a NaN/Inf block reads 0x7FFF / 0xFFFF (canonical NaN with
    the input's sign) where mx_round_bf16 writes 0x7FC0."""
    amax_w = gl.reduce(w, 2, _absmax_bf16x2)                          # [R, NB]: per half, the max magnitude
    amax = gl.maximum(amax_w & 0x7FFF, (amax_w >> 16) & 0x7FFF) << 16  # fp32 bits of the block's amax
    nonfinite = amax >= 0x7F800000
    xexp = _rceil_exponent(amax)                                      # kosmos.quant's RCEIL exponent, as is
    shift = gl.where(xexp < -90, 64, gl.where(xexp > 90, -64, 0))     # as _mx_round_scaled: keeps C a normal
    s16 = _splat2(gl.where(nonfinite, 0x7FC0, (131 + shift) << 7))    # bf16 2**(shift + 4) (NaN: block -> NaN)
    s1 = _splat2(gl.where(nonfinite, 0x7FC0, (127 + shift) << 7))     # bf16 2**shift
    cb = _splat2((xexp + shift + 125) << 7)                           # bf16 2**(X + shift - 2), normal
    sinv = _splat2((127 - shift) << 7)                                # bf16 2**-shift
    return gl.inline_asm_elementwise(
        """{
        .reg .b32 c, t;
        mul.rn.bf16x2 c, $1, $2;
        and.b32 c, c, 0xFF80FF80;
        max.xorsign.abs.bf16x2 c, c, $3;
        fma.rn.bf16x2 t, $1, $4, c;
        sub.rn.bf16x2 t, t, c;
        mul.rn.bf16x2 t, t, $5;
        lop3.b32 $0, t, $1, 0x80008000, 0xF8;
        }""",
        "=r,r,r,r,r,r",
        [w, gl.expand_dims(s16, 2), gl.expand_dims(cb, 2), gl.expand_dims(s1, 2), gl.expand_dims(sinv, 2)],
        dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _word_view(buf):
    """An int32 view [BM, BK/2] of a bf16 [BM, BK] tile with a 128-byte-swizzled NVMMA layout: the same bytes (the
    swizzle permutes 16-byte chunks within 128-byte rows, whatever the element width)."""
    return buf._reinterpret(gl.int32, [buf.shape[0], buf.shape[1] // 2],
                            gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2))


@gluon.jit
def _round_load(src, IMPL: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """Registers of a bf16 [BM, BK] shared tile, in BM / ROWS chunks of ROWS rows (a tuple): each thread holds whole
    MX blocks (32 consecutive elements of a row; "kosmos": bf16 [ROWS, BK], "packed": int32 words [ROWS, BK/2])."""
    BM: gl.constexpr = src.shape[0]
    BK: gl.constexpr = src.shape[1]
    xs = ()
    if IMPL == 0:
        lay: gl.constexpr = gl.BlockedLayout([1, 32], [32 * 32 // BK, BK // 32], [WARPS, 1], [1, 0])
        for c in gl.static_range(BM // ROWS):
            xs = xs + (src.slice(c * ROWS, ROWS).load(lay), )
    else:
        lay: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 32 // BK, BK // 32], [WARPS, 1], [1, 0])
        words = _word_view(src)
        for c in gl.static_range(BM // ROWS):
            xs = xs + (words.slice(c * ROWS, ROWS).load(lay), )
    return xs


@gluon.jit
def _round_store(xs, dst, IMPL: gl.constexpr, ROWS: gl.constexpr, WARPS: gl.constexpr):
    """Round the chunks of ``_round_load`` to their MX values and store them into the bf16 [BM, BK] tile ``dst``."""
    BK: gl.constexpr = dst.shape[1]
    if IMPL == 0:
        lay: gl.constexpr = gl.BlockedLayout([1, 32], [32 * 32 // BK, BK // 32], [WARPS, 1], [1, 0])
        for c in gl.static_range(len(xs)):
            x3 = gl.reshape(xs[c], [ROWS, BK // 32, 32])
            y = gl.convert_layout(gl.reshape(mx_round_bf16(x3), [ROWS, BK]), lay)
            dst.slice(c * ROWS, ROWS).store(y)
    else:
        lay: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 32 // BK, BK // 32], [WARPS, 1], [1, 0])
        words = _word_view(dst)
        for c in gl.static_range(len(xs)):
            w3 = gl.reshape(xs[c], [ROWS, BK // 32, 16])
            y = gl.convert_layout(gl.reshape(_mx_round_words(w3), [ROWS, BK // 2]), lay)
            words.slice(c * ROWS, ROWS).store(y)


@gluon.jit
def _round_only_kernel(x_desc, y_desc, IMPL: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr):
    """y = the MX values of x (bf16 [M, K], one [BM, BK] tile per program), through the same shared-memory path as
    the GEMM's rounding partition: for the bitwise check against kosmos.quant."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    off_m = gl.program_id(0) * BM
    off_k = gl.program_id(1) * BK
    src = gl.allocate_shared_memory(x_desc.dtype, [BM, BK], x_desc.layout)
    dst = gl.allocate_shared_memory(y_desc.dtype, [BM, BK], y_desc.layout)
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(bar, count=1)
    mbarrier.expect(bar, x_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(x_desc, [off_m, off_k], bar, src)
    mbarrier.wait(bar, 0)
    xs = _round_load(src, IMPL, ROWS, num_warps)
    _round_store(xs, dst, IMPL, ROWS, num_warps)
    fence_async_shared()
    tma.async_copy_shared_to_global(y_desc, [off_m, off_k], dst)
    tma.store_wait(0)
    mbarrier.invalidate(bar)


# ============================================================================================ the GEMM's partitions
@gluon.jit
def _tile_coords(t, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
    """Output tile t -> (pid_m, pid_n): GROUP_M row tiles walk the columns together (L2 reuse of B)."""
    width = GROUP_M * num_pid_n
    first_m = (t // width) * GROUP_M
    size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (t % width) % size_m, (t % width) // size_m


@gluon.jit
def _step_coords(g, M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr):
    """This program's k-step g (counted over all its tiles) -> (off_m, off_n, off_k, exists). Tiles are dealt
    round-robin: program p takes tiles p, p + nprog, ..."""
    k_steps = gl.cdiv(K, BK)
    num_pid_m = gl.cdiv(M, BM)
    num_pid_n = gl.cdiv(N, BN)
    t = gl.program_id(0) + (g // k_steps) * gl.num_programs(0)
    pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, GROUP_M)
    return pid_m * BM, pid_n * BN, (g % k_steps) * BK, t < num_pid_m * num_pid_n


@gluon.jit
def _issue_loads(g, a_desc, b_desc, a_bufs, b_bufs, b_ready, M, N, K, LOAD_A: gl.constexpr,
                 B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA loads of k-step g into MMA-ring slot g % S: B, and A too when ``LOAD_A`` (the plain build); ``b_ready``
    completes when the bytes have landed. No load when step g does not exist."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    if B_KMAJOR:
        BN: gl.constexpr = b_desc.block_type.shape[0]
    else:
        BN: gl.constexpr = b_desc.block_type.shape[1]
    s = g % b_bufs.shape[0]
    off_m, off_n, off_k, exists = _step_coords(g, M, N, K, BM, BN, BK, GROUP_M)
    bar = b_ready.index(s)
    if LOAD_A:
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=exists)
        tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_bufs.index(s), pred=exists)
    else:
        mbarrier.expect(bar, b_desc.block_type.nbytes, pred=exists)
    if B_KMAJOR:
        tma.async_copy_global_to_shared(b_desc, [off_n, off_k], bar, b_bufs.index(s), pred=exists)
    else:
        tma.async_copy_global_to_shared(b_desc, [off_k, off_n], bar, b_bufs.index(s), pred=exists)


@gluon.jit
def _issue_raw(g, a_desc, raw, raw_ready, M, N, K, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """TMA load of k-step g's bf16 A tile into raw slot g % R (``raw_ready``); none when step g does not exist."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    r = g % raw.shape[0]
    off_m, off_n, off_k, exists = _step_coords(g, M, N, K, BM, BN, BK, GROUP_M)
    mbarrier.expect(raw_ready.index(r), a_desc.block_type.nbytes, pred=exists)
    tma.async_copy_global_to_shared(a_desc, [off_m, off_k], raw_ready.index(r), raw.index(r), pred=exists)


@gluon.jit
def _num_steps(M, N, K, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr):
    """(k-steps per tile, this program's k-steps over all its tiles)."""
    num_tiles = gl.cdiv(M, BM) * gl.cdiv(N, BN)
    my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))
    k_steps = gl.cdiv(K, BK)
    return k_steps, my_tiles * k_steps


@gluon.jit
def _round_partition(a_desc, raw, raw_ready, a_bufs, a_ready, a_done, M, N, K, IMPL: gl.constexpr,
                     ROWS: gl.constexpr, WARPS: gl.constexpr, GROUP_M: gl.constexpr, BN: gl.constexpr):
    """The rounding partition (WARPS warps), ROUND_MX only. It owns the raw A ring (R slots): loads R k-steps
    ahead, and refills a slot as soon as its registers hold the tile. Per k-step g: wait ``raw_ready``; raw bf16 A
    tile -> registers; refill the slot with step g + R; round to MX values; wait until the MMA that last read
    rounded slot g % SA is done (``a_done``); store; fence (generic -> async proxy); arrive ``a_ready``."""
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    SA: gl.constexpr = a_bufs.shape[0]
    R: gl.constexpr = raw.shape[0]
    k_steps, total = _num_steps(M, N, K, BM, BN, BK)
    for g in gl.static_range(R):
        _issue_raw(g, a_desc, raw, raw_ready, M, N, K, BN, GROUP_M)
    for it in range(total):
        r = it % R
        mbarrier.wait(raw_ready.index(r), (it // R) & 1)
        xs = _round_load(raw.index(r), IMPL, ROWS, WARPS)
        fence_async_shared()  # our generic reads of the slot before the async-proxy (TMA) write that refills it
        gl.thread_barrier()   # ... of all WARPS warps
        _issue_raw(it + R, a_desc, raw, raw_ready, M, N, K, BN, GROUP_M)
        sa = it % SA
        mbarrier.wait(a_done.index(sa), ((it // SA) & 1) ^ 1)
        _round_store(xs, a_bufs.index(sa), IMPL, ROWS, WARPS)
        fence_async_shared()  # our generic writes before the wgmma's async-proxy reads
        mbarrier.arrive(a_ready.index(sa))


@gluon.jit
def _mma_partition(a_desc, b_desc, c_desc, a_bufs, b_bufs, b_ready, a_ready, a_done, c_smem, M, N, K,
                   ROUND_MX: gl.constexpr, B_KMAJOR: gl.constexpr, GROUP_M: gl.constexpr,
                   num_warps: gl.constexpr):
    """The MMA warps (num_warps = 8: two warpgroups of 64 rows each). Owns the B ring (SB slots; plain: the A+B
    ring) and loads SB - 1 k-steps ahead. Per k-step g: wait ``b_ready`` (and ``a_ready``, ROUND_MX); async wgmma
    on (A slot, B slot); wait until one wgmma group is in flight, i.e. step g - 1's is done; release step g - 1:
    ``a_done`` (ROUND_MX) and the refill of its B slot with step g - 1 + SB. Epilogue per tile: fp32 accumulator
    -> bf16 -> c_smem in BN / EPI_N column pieces -> TMA stores (waited for before the piece buffer is reused)."""
    BM: gl.constexpr = a_bufs.shape[1]
    BK: gl.constexpr = a_bufs.shape[2]
    SA: gl.constexpr = a_bufs.shape[0]
    SB: gl.constexpr = b_bufs.shape[0]
    EPI_N: gl.constexpr = c_smem.shape[1]
    if B_KMAJOR:
        BN: gl.constexpr = b_bufs.shape[1]
    else:
        BN: gl.constexpr = b_bufs.shape[2]
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
    k_steps, total = _num_steps(M, N, K, BM, BN, BK)
    for g in gl.static_range(SB - 1):
        _issue_loads(g, a_desc, b_desc, a_bufs, b_bufs, b_ready, M, N, K, not ROUND_MX, B_KMAJOR, GROUP_M)
    acc = gl.zeros([BM, BN], gl.float32, acc_layout)
    it = 0
    for tile in range(total // k_steps):
        off_m, off_n, off_k, exists = _step_coords(it, M, N, K, BM, BN, BK, GROUP_M)
        for ki in range(k_steps):
            s = it % SB
            mbarrier.wait(b_ready.index(s), (it // SB) & 1)
            if ROUND_MX:
                sa = it % SA
                mbarrier.wait(a_ready.index(sa), (it // SA) & 1)
                a = a_bufs.index(sa)
            else:
                a = a_bufs.index(s)
            b = b_bufs.index(s)
            if B_KMAJOR:
                b = b.permute((1, 0))
            acc = warpgroup_mma(a, b, acc, use_acc=ki > 0, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            gl.thread_barrier()  # both warpgroups' step it - 1 is done
            if ROUND_MX:  # (the tile's last step is released after the loop)
                mbarrier.arrive(a_done.index((it + SA - 1) % SA), pred=ki > 0)
            _issue_loads(it + SB - 1, a_desc, b_desc, a_bufs, b_bufs, b_ready, M, N, K, not ROUND_MX, B_KMAJOR,
                         GROUP_M)
            it += 1
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        gl.thread_barrier()
        if ROUND_MX:
            mbarrier.arrive(a_done.index((it + SA - 1) % SA))
        c = acc.to(gl.bfloat16)
        cs = (c, )
        for _ in gl.static_range((BN // EPI_N).bit_length() - 1):  # split the columns in halves, log2 times
            nxt = ()
            for j in gl.static_range(len(cs)):
                x = cs[j]
                nxt = nxt + x.reshape(BM, 2, x.shape[1] // 2).permute(0, 2, 1).split()
            cs = nxt
        for j in gl.static_range(len(cs)):
            tma.store_wait(0)
            c_smem.store(cs[j])
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n + j * EPI_N], c_smem)
    tma.store_wait(0)


@gluon.jit
def _gemm_kernel(a_desc, b_desc, c_desc, M, N, K, ROUND_MX: gl.constexpr, IMPL: gl.constexpr,
                 B_KMAJOR: gl.constexpr, STAGES: gl.constexpr, A_STAGES: gl.constexpr, RAW_STAGES: gl.constexpr,
                 GROUP_M: gl.constexpr, ROUND_ROWS: gl.constexpr, ROUND_WARPS: gl.constexpr,
                 ROUND_REGS: gl.constexpr, num_warps: gl.constexpr):
    """C [M, N] = A [M, K] @ B (bf16, fp32 accumulation), persistent (module docstring). Plain: one partition
    (the MMA warps load A and B themselves). ROUND_MX: warp_specialize([MMA warps, ROUND_WARPS rounding warps])."""
    BM: gl.constexpr = a_desc.block_type.shape[0]
    BK: gl.constexpr = a_desc.block_type.shape[1]
    if B_KMAJOR:
        BN: gl.constexpr = b_desc.block_type.shape[0]
    else:
        BN: gl.constexpr = b_desc.block_type.shape[1]
    dtype: gl.constexpr = a_desc.dtype
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    b_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(b_ready.index(i), count=1)
    if ROUND_MX:
        a_bufs = gl.allocate_shared_memory(dtype, [A_STAGES, BM, BK], a_desc.layout)
        raw = gl.allocate_shared_memory(dtype, [RAW_STAGES, BM, BK], a_desc.layout)
        a_ready = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
        a_done = gl.allocate_shared_memory(gl.int64, [A_STAGES, 1], mbarrier.MBarrierLayout())
        raw_ready = gl.allocate_shared_memory(gl.int64, [RAW_STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(A_STAGES):
            mbarrier.init(a_ready.index(i), count=1)
            mbarrier.init(a_done.index(i), count=1)
        for i in gl.static_range(RAW_STAGES):
            mbarrier.init(raw_ready.index(i), count=1)
        gl.warp_specialize([
            (_mma_partition, (a_desc, b_desc, c_desc, a_bufs, b_bufs, b_ready, a_ready, a_done, c_smem, M, N, K,
                              ROUND_MX, B_KMAJOR, GROUP_M, num_warps)),
            (_round_partition, (a_desc, raw, raw_ready, a_bufs, a_ready, a_done, M, N, K, IMPL, ROUND_ROWS,
                                ROUND_WARPS, GROUP_M, BN)),
        ], [ROUND_WARPS], [ROUND_REGS])
    else:
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BM, BK], a_desc.layout)
        _mma_partition(a_desc, b_desc, c_desc, a_bufs, b_bufs, b_ready, b_ready, b_ready, c_smem, M, N, K, ROUND_MX,
                       B_KMAJOR, GROUP_M, num_warps)


# ============================================================================================ host side
BM, BN, BK = 128, 256, 64
LLAMA_SHAPES = {  # llama3-70b TP=2 per-rank GEMMs (M tokens, N out, K in)
    **{f"{name}-{m // 1024}k": (m, n, k) for m in (4096, 8192)
       for name, n, k in (("qkv", 5120, 8192), ("fc1", 28672, 8192), ("attn_out", 8192, 4096),
                          ("fc2", 8192, 14336))},
}
VARIANTS = ("torch", "gluon", "gluon-mx-packed", "gluon-mx-kosmos")


def config(round_mx: bool, impl: str = "packed", **over) -> dict:
    """Launch parameters of one build. Plain: 8 warps, one partition, 4 stages of A+B (192 KiB) + a 128x64 C piece
    (16 KiB). ROUND_MX: 12 warps (MMA 8 + rounding 4), 4 B stages (128 KiB), 2 rounded-A stages (32 KiB), 3 raw-A
    stages (48 KiB), the C piece (16 KiB): 224 KiB of the 227. maxnreg: registers per thread at launch, 64K /
    threads (ptxas allocates every partition within it: module docstring); ROUND_REGS: the rounding partition's
    setmaxnreg budget, the MMA partition gets the rest."""
    cfg = dict(STAGES=4, A_STAGES=2, RAW_STAGES=3, EPI_N=64, GROUP_M=8, ROUND_ROWS=64, ROUND_WARPS=4,
               ROUND_REGS=104 if impl == "packed" else 128, num_warps=8)
    cfg.update(over)
    warps = cfg["num_warps"] + (cfg["ROUND_WARPS"] if round_mx else 0)
    cfg.setdefault("maxnreg", min(255, 65536 // (32 * warps)) // 8 * 8)
    return cfg


def _nvmma(block):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16)


def gemm_launch(a, b, c, *, round_mx: bool, impl: str = "packed", b_kmajor: bool = True, num_sms: int = 132,
                **over):
    """(kernel, grid, args, kwargs) of C = A @ B: ``a`` bf16 [M, K], ``b`` the weight bf16 [N, K] (``b_kmajor``) or
    [K, N], ``c`` bf16 [M, N]; M, N, K multiples of 128, 256, 64."""
    cfg = config(round_mx, impl, **over)
    m, k = a.shape
    n = b.shape[0] if b_kmajor else b.shape[1]
    if m % BM or n % BN or k % BK:
        raise ValueError(f"M, N, K = {m}, {n}, {k}: the probe needs multiples of {BM}, {BN}, {BK}")
    b_block = [BN, BK] if b_kmajor else [BK, BN]
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], _nvmma([BM, BK]))
    b_desc = TensorDescriptor.from_tensor(b, b_block, _nvmma(b_block))
    c_desc = TensorDescriptor.from_tensor(c, [BM, cfg["EPI_N"]], _nvmma([BM, cfg["EPI_N"]]))
    grid = (min(num_sms, (m // BM) * (n // BN)), )
    kw = dict(ROUND_MX=round_mx, IMPL=IMPLS[impl], B_KMAJOR=b_kmajor, STAGES=cfg["STAGES"],
              A_STAGES=cfg["A_STAGES"], RAW_STAGES=cfg["RAW_STAGES"], GROUP_M=cfg["GROUP_M"],
              ROUND_ROWS=cfg["ROUND_ROWS"], ROUND_WARPS=cfg["ROUND_WARPS"], ROUND_REGS=cfg["ROUND_REGS"],
              num_warps=cfg["num_warps"], maxnreg=cfg["maxnreg"])
    return _gemm_kernel, grid, (a_desc, b_desc, c_desc, m, n, k), kw


def gluon_matmul(a, b, *, round_mx=False, impl="packed", b_kmajor=True, out=None, **over):
    """C = A @ B^T (b [N, K]) or A @ B (b [K, N], b_kmajor=False), bf16 out, with A rounded to its MX values in the
    mainloop when ``round_mx``."""
    n = b.shape[0] if b_kmajor else b.shape[1]
    c = torch.empty(a.shape[0], n, dtype=torch.bfloat16, device=a.device) if out is None else out
    kernel, grid, args, kw = gemm_launch(a, b, c, round_mx=round_mx, impl=impl, b_kmajor=b_kmajor,
                                         num_sms=torch.cuda.get_device_properties(a.device).multi_processor_count,
                                         **over)
    kernel[grid](*args, **kw)
    return c


def round_launch(x, y, impl: str):
    """(kernel, grid, args, kwargs) of the rounding-only kernel y = MX values of x (bf16 [M, K])."""
    d = [TensorDescriptor.from_tensor(t, [BM, BK], _nvmma([BM, BK])) for t in (x, y)]
    return _round_only_kernel, (x.shape[0] // BM, x.shape[1] // BK), tuple(d), dict(IMPL=IMPLS[impl], ROWS=64,
                                                                                     num_warps=4)


def gluon_mx_round(x, impl="packed"):
    y = torch.empty_like(x)
    kernel, grid, args, kw = round_launch(x, y, impl)
    kernel[grid](*args, **kw)
    return y


# -------------------------------------------------------------------------------------------- checks (GPU)
def _scaled_rows(m, k, gen, exps=(0, -100, -20, 20, 100)):
    """randn bf16 [m, k] on the GPU, row i scaled by 2**exps[i % len(exps)] (2**+-100: the +-64 pre-scaling path
    of the rounding, whose blocks have |X| > 90)."""
    x = torch.randn(m, k, generator=gen, device="cuda")
    e = torch.tensor(exps, dtype=torch.float32, device="cuda").repeat(m // len(exps) + 1)[:m]
    return (x * torch.exp2(e)[:, None]).to(torch.bfloat16)


def _round_inputs(gen):
    """Inputs of the bitwise rounding check, bf16 [1024, 4096]: random bit patterns (every exponent, subnormals,
    NaN and Inf in ~12% of the blocks), randn rows at 2**{0, +-20, +-100, -120, -126, -133} (subnormal rows, the
    +-64 pre-scaling), and hand-made blocks (zeros, -0, power-of-two and 448 * 2**k amax, E4M3 ties)."""
    m, k = 1024, 4096
    bits = torch.randint(-32768, 32768, (m // 4, k), generator=gen, device="cuda", dtype=torch.int32)
    x_bits = bits.to(torch.int16).view(torch.bfloat16)
    x_rows = _scaled_rows(m // 2, k, gen, exps=(0, -100, -20, 20, 100, -120, -126, -133))
    special = torch.randn(m // 4, k, generator=gen, device="cuda").to(torch.bfloat16).view(m // 4, k // 32, 32)
    special[0::8] = 0.0
    special[1::8] = -0.0
    special[2::8, :, 0] = 2.0 ** 7                                     # amax a power of two
    special[3::8, :, 0] = 448.0 * 2.0 ** -3                            # amax = 448 * 2**k
    special[4::8] = torch.tensor([1.0625, 1.1875, 17.0, 3 * 2.0 ** -10, 15 * 2.0 ** -10] * 6 + [448.0, -448.0],
                                 device="cuda").to(torch.bfloat16)     # ties, subnormal E4M3 values (X = 0)
    special[5::8, :, 1] = float("inf")
    special[6::8, :, 2] = float("nan")
    return torch.cat([x_bits, x_rows, special.view(m // 4, k)])


def check_rounding(impl: str, gen) -> dict:
    """The rounding-only kernel against kosmos.quant.dequantize_mx(*quantize_mx(x)), bit for bit (NaN-aware:
    ``nan_payload_diff`` counts elements where both are NaN with different bits -- expected for "packed")."""
    from kosmos.quant import dequantize_mx, quantize_mx
    x = _round_inputs(gen)
    ref = dequantize_mx(*quantize_mx(x))
    y = gluon_mx_round(x, impl)
    rb, yb = ref.view(torch.int16), y.view(torch.int16)
    both_nan = torch.isnan(ref) & torch.isnan(y)
    bad = (rb != yb) & ~both_nan
    return {"kind": "check", "what": f"round-only {impl}", "elements": x.numel(), "mismatches": int(bad.sum()),
            "nan_payload_diff": int(((rb != yb) & both_nan).sum()), "ok": bool(bad.sum() == 0)}


def _rel_err(c, ref) -> tuple[float, float]:
    """(whole-matrix relative Frobenius error, worst row's relative error), in fp64 on the GPU."""
    d = (c.double() - ref.double())
    rows = d.norm(dim=1) / ref.double().norm(dim=1).clamp_min(1e-300)
    return float(d.norm() / ref.double().norm()), float(rows.max())


BF16_TOL = 4e-3  # one bf16 rounding of the output is <= 2**-9 = 0.00195 relative per element


def check_gemm(m, n, k, *, round_mx, impl, b_kmajor, gen) -> dict:
    """Fresh inputs (rows of A at 2**{0, +-20, +-100}), NaN-poisoned output; against an fp32 torch.matmul of
    A (plain) or of kosmos.quant's MX values of A (ROUND_MX), worst row's relative error <= BF16_TOL."""
    from kosmos.quant import dequantize_mx, quantize_mx
    a = _scaled_rows(m, k, gen)
    w = (torch.randn(n, k, generator=gen, device="cuda") / 64).to(torch.bfloat16)
    b = w if b_kmajor else w.t().contiguous()
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    gluon_matmul(a, b, round_mx=round_mx, impl=impl, b_kmajor=b_kmajor, out=c)
    torch.cuda.synchronize()
    a_ref = dequantize_mx(*quantize_mx(a)) if round_mx else a
    ref = torch.matmul(a_ref.float(), w.float().t())
    err, row_err = _rel_err(c, ref)
    out = {"kind": "check", "what": f"gemm {'mx-' + impl if round_mx else 'bf16'} {'B[N,K]' if b_kmajor else 'B[K,N]'}",
           "M": m, "N": n, "K": k, "rel_err": err, "row_rel_err": row_err, "nan": int(torch.isnan(c).sum()),
           "ok": bool(row_err <= BF16_TOL and not torch.isnan(c).any())}
    if round_mx:  # how far the MX values are from A: a ROUND_MX that rounded nothing would pass this, not the above
        out["rel_err_vs_bf16_ref"] = _rel_err(c, torch.matmul(a.float(), w.float().t()))[0]
    return out


# -------------------------------------------------------------------------------------------- timing (GPU)
def bench_shape(name, m, n, k, variants, gen, iters, warmup) -> list[dict]:
    """Each variant's time (kosmos_bench.timing.time_op: L2 flushed before every call, the host hidden by a spin),
    its ratio to torch.matmul and its relative error against an fp32 reference (the MX reference for the MX
    variants)."""
    from kosmos.quant import dequantize_mx, quantize_mx
    from kosmos_bench.timing import time_op
    a = (torch.randn(m, k, generator=gen, device="cuda")).to(torch.bfloat16)
    w = (torch.randn(n, k, generator=gen, device="cuda") / 64).to(torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    calls = {"torch": lambda: torch.matmul(a, w.t()),
             "gluon": lambda: gluon_matmul(a, w, out=c),
             "gluon-mx-packed": lambda: gluon_matmul(a, w, round_mx=True, impl="packed", out=c),
             "gluon-mx-kosmos": lambda: gluon_matmul(a, w, round_mx=True, impl="kosmos", out=c)}
    ref = torch.matmul(a.float(), w.float().t())
    ref_mx = torch.matmul(dequantize_mx(*quantize_mx(a)).float(), w.float().t()) if any(
        "mx" in v for v in variants) else None
    rows = []
    for v in variants:
        out = calls[v]()
        err = _rel_err(out, ref_mx if "mx" in v else ref)[0]
        t = time_op(calls[v], iters=iters, warmup=warmup)
        rows.append({"kind": "time", "shape": name, "M": m, "N": n, "K": k, "variant": v, "time_ms": t["time_ms"],
                     "p20_ms": t["p20_ms"], "p80_ms": t["p80_ms"], "tflops": 2 * m * n * k / t["time_ms"] / 1e9,
                     "rel_err": err})
    base = next((r["time_ms"] for r in rows if r["variant"] == "torch"), None)
    for r in rows:
        r["ratio_vs_torch"] = r["time_ms"] / base if base else None
    del a, w, c, ref, ref_mx
    return rows


# -------------------------------------------------------------------------------------------- compile only (CPU)
def _ptx_facts(ptx: str, ttgir: str) -> dict:
    """What the PTX / TTGIR say about the mainloop: wgmma count and whether A comes from shared memory (a 64-bit
    descriptor after the accumulator list, not a {4 x b32} register list), TMA loads, setmaxnreg budgets."""
    wg = re.findall(r"wgmma\.mma_async\.sync\.aligned\.(\S+)\s+\{[^}]*\},\s*(\S+)", ptx)
    dots = re.findall(r"ttng\.warp_group_dot\s+%\S+,\s*%\S+,.*?:\s*(!ttg\.memdesc|tensor)", ttgir)
    return {"wgmma": len(wg), "wgmma_shapes": sorted({s for s, _ in wg}),
            "wgmma_a_from_smem": bool(wg) and all(not a.startswith("{") for _, a in wg),
            "ttgir_dot_a": sorted(set(dots)),
            "tma_loads": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.shared::cluster\.global", ptx)),
            "tma_stores": len(re.findall(r"cp\.async\.bulk\.tensor\.\dd\.global\.shared::cta", ptx)),
            "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx)))}


def _sass_mix(compiled) -> dict:
    """SASS opcode counts of the cubin (cuobjdump, shipped in the Triton wheel), None where unavailable."""
    import shutil
    import subprocess
    import tempfile
    tool = shutil.which("cuobjdump") or os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                                                     "cuobjdump")
    if not os.path.exists(tool) or "cubin" not in compiled.asm:
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        run = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True)
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", run.stdout)
    counts = {}
    for op in ops:
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def compile_only(json_path=None, b_kmajor=True) -> list[dict]:
    """Compile every build for sm_90a without a GPU (dev/kernel_resources.py's stand-in driver): registers, spills,
    shared memory (ptxas -v on the PTX), the facts of ``_ptx_facts``."""
    from dev.kernel_resources import _use_stand_in_driver
    if not torch.cuda.is_available():
        _use_stand_in_driver()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    m, n, k = LLAMA_SHAPES["qkv-4k"]
    a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    b = torch.empty((n, k) if b_kmajor else (k, n), dtype=torch.bfloat16, device=dev)
    c = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    builds = [("gluon", False, "packed"), ("gluon-mx-packed", True, "packed"), ("gluon-mx-kosmos", True, "kosmos")]
    rows = []
    print(f"triton {triton.__version__}, torch {torch.__version__}, sm_90a, B {'[N, K]' if b_kmajor else '[K, N]'}")
    print(f"{'build':<24} {'regs':>5} {'spill B':>8} {'stack B':>8} {'smem KiB':>9}  {'setmaxnreg':<28} "
          f"{'wgmma':>5} {'A smem':>6} {'TMA ld':>6}")
    for name, round_mx, impl in builds:
        kernel, grid, args, kw = gemm_launch(a, b, c, round_mx=round_mx, impl=impl, b_kmajor=b_kmajor)
        compiled = kernel.warmup(*args, grid=grid, **kw)
        rows.append(_compile_row(name, compiled, kw))
    for impl in IMPLS:
        x = torch.empty(1024, 4096, dtype=torch.bfloat16, device=dev)
        kernel, grid, args, kw = round_launch(x, torch.empty_like(x), impl)
        rows.append(_compile_row(f"round-only {impl}", kernel.warmup(*args, grid=grid, **kw), kw))
    if json_path:
        with open(json_path, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return rows


def _compile_row(name, compiled, kw) -> dict:
    from dev.kernel_resources import _resources
    r = {"kind": "compile", "build": name, "triton": triton.__version__,
         **{k: v for k, v in kw.items() if k.isupper() or k in ("num_warps", "maxnreg")},
         **_resources(compiled), **_ptx_facts(compiled.asm["ptx"], compiled.asm["ttgir"]),
         "sass_ops": _sass_mix(compiled)}
    r["shared_kib"] = round(compiled.metadata.shared / 1024, 1)
    regs = " ".join(f"{d}{v}" for d, v in r["setmaxnreg"])
    print(f"{name:<24} {r['regs']:>5} {str(r['spill_bytes']):>8} {str(r['stack_bytes']):>8} {r['shared_kib']:>9}  "
          f"{regs:<28} {r['wgmma']:>5} {str(r['wgmma_a_from_smem']):>6} {r['tma_loads']:>6}", flush=True)
    return r


# -------------------------------------------------------------------------------------------- CLI
def _parse_shapes(text):
    out = []
    for item in text.split(","):
        if item in LLAMA_SHAPES:
            out.append((item, *LLAMA_SHAPES[item]))
        elif re.fullmatch(r"\d+x\d+x\d+", item):
            out.append((item, *map(int, item.split("x"))))
        else:
            raise SystemExit(f"unknown shape {item!r}: one of {', '.join(LLAMA_SHAPES)} or MxNxK")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compile-only", action="store_true", help="compile for sm_90a (no GPU needed) and report "
                    "registers / spills / shared memory / wgmma operands, then stop")
    ap.add_argument("--shapes", default=",".join(LLAMA_SHAPES), help="comma-separated: " + ", ".join(LLAMA_SHAPES)
                    + " or MxNxK")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated: " + ", ".join(VARIANTS))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--skip-checks", action="store_true", help="timing only (the checks take ~10 s)")
    ap.add_argument("--json", default=None, help="write one JSON object per line here")
    ap.add_argument("--b-kn", action="store_true", help="--compile-only: B as [K, N] instead of the weight [N, K]")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: Gluon has no interpreter path here")
    if args.compile_only:
        compile_only(args.json, b_kmajor=not args.b_kn)
        return 0
    if not torch.cuda.is_available():
        ap.error("no GPU: use --compile-only here")
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}")
    shapes = _parse_shapes(args.shapes)
    rows = [{"kind": "env", "triton": triton.__version__, "torch": torch.__version__,
             "device": torch.cuda.get_device_name(), "variants": variants}]
    out = open(args.json, "w") if args.json else None

    def emit(r):
        rows.append(r)
        if out:
            out.write(json.dumps(r) + "\n")
            out.flush()

    emit(rows[0])
    gen = torch.Generator(device="cuda").manual_seed(1234)
    failed = 0
    if not args.skip_checks:
        checks = []
        for impl in [v.rsplit("-", 1)[1] for v in variants if v.startswith("gluon-mx-")]:
            checks.append(lambda impl=impl: check_rounding(impl, gen))
        if "gluon" in variants:
            checks += [lambda: check_gemm(2048, 5120, 1024, round_mx=False, impl="packed", b_kmajor=True, gen=gen),
                       lambda: check_gemm(1024, 2560, 2048, round_mx=False, impl="packed", b_kmajor=False, gen=gen)]
        for impl in [v.rsplit("-", 1)[1] for v in variants if v.startswith("gluon-mx-")]:
            checks += [lambda impl=impl: check_gemm(2048, 5120, 1024, round_mx=True, impl=impl, b_kmajor=True,
                                                    gen=gen),
                       lambda impl=impl: check_gemm(1024, 2560, 2048, round_mx=True, impl=impl, b_kmajor=False,
                                                    gen=gen)]
        for chk in checks:
            r = chk()
            emit(r)
            failed += not r["ok"]
            print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                           if k != "kind"), flush=True)
    for name, m, n, k in shapes:
        for r in bench_shape(name, m, n, k, variants, gen, args.iters, args.warmup):
            emit(r)
        torch.cuda.empty_cache()
    if out:
        out.close()
    print(f"\n{'shape':<12} {'M':>5} {'N':>6} {'K':>6} " + " ".join(f"{v:>16}" for v in variants))
    by = {}
    for r in rows:
        if r["kind"] == "time":
            by.setdefault(r["shape"], {})[r["variant"]] = r
    for name, m, n, k in shapes:
        cells = []
        for v in variants:
            r = by[name][v]
            ratio = f" {r['ratio_vs_torch']:.3f}x" if r["ratio_vs_torch"] and v != "torch" else ""
            cells.append(f"{r['time_ms']:.3f}{ratio}".rjust(16))
        print(f"{name:<12} {m:>5} {n:>6} {k:>6} " + " ".join(cells))
    print("(time_ms median, and its ratio to torch.matmul; rel_err of each row: see --json)")
    errs = {v: max(by[s][v]["rel_err"] for s, *_ in shapes) for v in variants}
    print("worst rel_err vs its fp32 reference: " + ", ".join(f"{v} {e:.2e}" for v, e in errs.items()))
    if failed:
        print(f"{failed} CHECK(S) FAILED: the times above are of wrong kernels")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
