"""The W = 1 MXFP8 GEMM of both TP ops: c = mx(a) @ b in one warp-specialised launch (Gluon, Hopper).

Math: mx(a) are the MX values of A [M, K] (bf16 numbers: kosmos/quant.py), either rounded from a bf16 ``a``
(quant.mx_round: MXFP8 quantize + dequantize, RCEIL scales) or expanded from an MXTensor (quant.dequantize_mx);
b [K, N] bf16 (the weight's MX values, quant.mx_round); c [M, N] bf16, fp32 accumulation, each output element one
dot product over K in a fixed order (bitwise deterministic).

One persistent program per SM, two partitions:
  MMA warps (8, the default partition): the persistent bf16 GEMM -- tiles 128 x BN (BN = 256, or 128 where
    tile_width's wave model says so) in GROUP_M order, dealt round-robin; a ring of STAGES (TILES: 4 at BN 256,
    6 at 128) slots (A 128 x 64, B BN x 64) TMA-loaded STAGES - 1 k-steps ahead; async wgmma
    from shared memory with one group in flight; the epilogue through a 128 x 64 piece and TMA stores. A is read
    from ``values``, a workspace buffer [M, K] bf16 that the row pass writes.
  Row pass (4 warps): A's MX values made ONCE for the whole grid, in parts of [16 rows, 512 columns] (bf16 words
    loaded, rounded by the packed bf16x2 arithmetic below; or payload k-pairs and scale bytes loaded and expanded
    by cvt.rn.f16x2.e4m3x2), stored to ``values``. Parts are numbered in the order the tiles need them
    (GROUP_M row-block group, then 512-column chunk, then row block, then the 16-row slice) and dealt round-robin
    over the programs, so the first wave's first chunks are written first, by ~all programs at once.

Synchronisation (``counters``, int32, zero between launches):
  [0]                                  programs that have left (the last one zeroes everything below)
  [1 + rb * (kcs + 1) + kc]            parts of (row block rb, chunk kc) written; done at BM / 16
  [1 + rb * (kcs + 1) + kcs]           parts of row block rb written; done at (BM / 16) * kcs
  A part ends with the pass's barrier, then gpu-scope release increments of both counts (its stores are generic
  ones that the MMA's TMA -- the async proxy -- reads next). The MMA warps, at a tile's first k-step, read the
  row block's total once (_acquire: a gpu-scope acquire atomic, then the generic -> async proxy fence); while it
  is short, each chunk's first k-step waits for that chunk's count (_wait_count: bounded like device.wait_geq,
  WAIT_MX_PASS in the error record). No launch argument carries an epoch: the counters start at zero and the last
  program out resets them after the join of both partitions (and advances the workspace's device epoch, the count
  of calls completed), so a CUDA-graph replay starts clean. Deadlock-freedom: the grid is at most the SM count
  with one program per SM (208 KiB of shared memory), so every part's program runs; a row pass waits for nothing.

Route: W1_MX of both TP ops (ops/tp_common.tp_route: an MXFP8 call at W = 1, untraced, self policy, where
``unavailable`` says None), except on the few-tile shapes of tp_common.w1_mx_pass_first, which take one host pass
and the bf16 static GEMM (gemm/w1_static.py) instead. ``w1_mx_call`` launches it and stores the call's plan.
Limits: Hopper (sm_90) and Triton 3.6.x only (the Gluon API this is written against); tiles 128 x 256 or 128 x 128
(tile_width), unsplit -- no K split, stream-K, tail tiles or two programs per SM; no trace events.
Tests: tests/test_all_gather_matmul.py (test_w1_mx_kernel_each_tile_width, test_w1_mx_kernel_timeout_reaches_the_host,
test_w1_mx_tile_width_rule, the W = 1 MXFP8 calls), tests/test_matmul_reduce_scatter.py (its W = 1 MXFP8 calls),
tests/test_cuda_graphs.py (MX replays bitwise equal to eager). Design, where it stands and the alternatives measured
and parked (rounding in the mainloop, a partition feeding A through shared memory, per-tile expansion, a wait per
chunk): docs/design/gemm.md; figures: docs/perf/quant.md.
"""
from __future__ import annotations

import torch
import triton

from ..core import device as dev
from ..core import launch_plan, planning, runtime
from ..core.codes import WAIT_MX_PASS
from ..core.descriptors import GluonDescriptor
from ..core.device import ERR_FLAG
from ..quant import _rceil_exponent, mx_scale_f32
from .tiles import _grouped_tile

try:  # Gluon (Triton's tile-level language with explicit layouts, partitions and wgmma)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_wait)
    GLUON_MISSING = None
except Exception as e:  # noqa: BLE001 -- any import failure: the ops keep their Triton path
    GLUON_MISSING = f"{type(e).__name__}: {e}"

BM, BK, EPI_N, GROUP_M = 128, 64, 64, 8
TILES = {256: 4, 128: 6}          # the MMA tile's width BN -> ring stages (208 KiB of shared memory either way)
MX_TILE128_RATE = 0.83            # a 128 x 128 tile's rate relative to 128 x 256 on many waves (tile_width)
KC, PART_ROWS = 512, 16           # a row-pass part: [PART_ROWS, KC]
MMA_WARPS, PASS_WARPS, PASS_REGS = 8, 4, 104
MAXNREG = 168                     # 64K registers / 384 threads, as ptxas allocates every partition within it
VERIFIED_TRITON = ("3.6.",)       # the Gluon API this is written against (the GPU box's Triton)
ROUND, EXPAND = 1, 2              # the row pass's job


def unavailable(device) -> str | None:
    """Why this kernel cannot run on ``device`` (None: it can)."""
    if GLUON_MISSING is not None:
        return f"no Gluon ({GLUON_MISSING})"
    if not triton.__version__.startswith(VERIFIED_TRITON):
        return f"Triton {triton.__version__} (written for {', '.join(VERIFIED_TRITON)}x)"
    if planning.interpreting() or device.type != "cuda":
        return "not a CUDA device (or the Triton interpreter)"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "not Hopper (sm_90)"
    return None


if GLUON_MISSING is None:
    # the constants above as constexprs (what @gluon.jit code may read)
    BM_ = gl.constexpr(BM)
    BK_ = gl.constexpr(BK)
    EPI_N_ = gl.constexpr(EPI_N)
    GROUP_M_ = gl.constexpr(GROUP_M)
    KC_ = gl.constexpr(KC)
    PART_ROWS_ = gl.constexpr(PART_ROWS)
    PASS_WARPS_ = gl.constexpr(PASS_WARPS)
    PASS_REGS_ = gl.constexpr(PASS_REGS)

    @gluon.jit
    def _absmax_bf16x2(a, b):
        """max(|a|, |b|) of each 16-bit half of two words of bf16 pairs, NaN-propagating (0x7FFF); the result's
        sign bits are meaningless (xorsign), the caller masks them."""
        return gl.inline_asm_elementwise("max.NaN.xorsign.abs.bf16x2 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=gl.int32, is_pure=True, pack=1)

    @gluon.jit
    def _tree_absmax(w):
        """[R, NB, 16] words -> [R, NB]: _absmax_bf16x2 over the last axis as a tree of depth 4 (15 ops; a chain
        would be 15 deep)."""
        R: gl.constexpr = w.shape[0]
        NB: gl.constexpr = w.shape[1]
        m = w
        for _ in gl.static_range(3):  # 16 -> 8 -> 4 -> 2 words
            a, b = m.reshape(R, NB, m.shape[2] // 2, 2).split()
            m = _absmax_bf16x2(a, b)
        a, b = m.split()
        return gl.convert_layout(_absmax_bf16x2(a, b), gl.SliceLayout(2, w.type.layout))

    @gluon.jit
    def _splat2(h):
        return h | (h << 16)

    @gluon.jit
    def _mx_round_words(w):
        """The MX values of bf16 pairs, bit for bit quant.mx_round: ``w`` int32 [R, NB, 16], each word two
        consecutive bf16 of a row (low half first), the last axis one MX block. The block's amax by a tree of
        bf16x2 max; its RCEIL exponent X (quant._rceil_exponent); each pair rounded to the E4M3 grid scaled by
        2**X with bf16x2 arithmetic: c = the pair's magnitude bits times 2**(s + 4) cut to a power of two (and at
        least 2**(X + s - 2), the grid's subnormal step), t = (v * 2**s + c) - c rounds to that step exactly
        (nearest even), times 2**-s, sign restored; s = +-64 keeps every constant a bf16 normal for extreme X.
        A block holding a NaN or Inf becomes 0x7FC0 in every element, as mx_round writes it."""
        amax_w = _tree_absmax(w)
        amax = gl.maximum(amax_w & 0x7FFF, (amax_w >> 16) & 0x7FFF) << 16  # fp32 bits of the block's amax
        nonfinite = amax >= 0x7F800000
        xexp = _rceil_exponent(amax)
        shift = gl.where(xexp < -90, 64, gl.where(xexp > 90, -64, 0))
        s16 = _splat2(gl.where(nonfinite, 0x7FC0, (131 + shift) << 7))   # bf16 2**(shift + 4)
        s1 = _splat2(gl.where(nonfinite, 0x7FC0, (127 + shift) << 7))    # bf16 2**shift
        cb = _splat2((xexp + shift + 125) << 7)                          # bf16 2**(X + shift - 2)
        sinv = _splat2((127 - shift) << 7)                               # bf16 2**-shift
        y = gl.inline_asm_elementwise(
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
        return gl.where(gl.expand_dims(nonfinite, 2), 0x7FC07FC0, y)

    # One k-pair of payload bytes (16 bits, element 2j low) under its block's multiplier 2**(S - 127) as fp32
    # (quant.mx_scale_f32: S = 0 the subnormal 2**-127, 0xFF NaN) -> its two bf16 values (one word), bit for bit
    # quant.dequantize_mx: E4M3x2 -> f16x2 (exact; NaN stays NaN), f16 -> f32 (exact), fp32 multiplies (exact: an
    # MX value has 4 significant bits and none below 2**-136; >= 2**128 is inf), one rounding f32x2 -> bf16x2
    # (bf16 subnormals and underflow as dequantize_mx), then min.s16x2 with 0x7FC0: the hardware's NaN 0x7FFF
    # becomes dequantize_mx's 0x7FC0 and every other result is left alone.
    _EXPAND_PAIR = gl.constexpr("""{
            .reg .b16 e0, e1;
            .reg .b32 h, qnan;
            .reg .f32 f0, f1;
            cvt.rn.f16x2.e4m3x2 h, $1;
            mov.b32 {e0, e1}, h;
            cvt.f32.f16 f0, e0;
            cvt.f32.f16 f1, e1;
            mul.rn.f32 f0, f0, $2;
            mul.rn.f32 f1, f1, $2;
            cvt.rn.bf16x2.f32 $0, f1, f0;
            mov.b32 qnan, 0x7FC07FC0;
            min.s16x2 $0, $0, qnan;
            }""")

    @gluon.jit
    def _row_pass(src, src_scales, values, counters, M, K, PASS: gl.constexpr, WARPS: gl.constexpr):
        """The row-pass partition (module docstring): every part [PART_ROWS_, KC_] of A this program is dealt, made
        into MX values in ``values`` (bf16 [M, K]), then counted."""
        lay: gl.constexpr = gl.BlockedLayout([1, 16], [32 * 32 // KC_, KC_ // 32], [WARPS, 1], [1, 0])
        KW: gl.constexpr = KC_ // 2      # words (bf16 pairs) per part row
        CH: gl.constexpr = BM_ // PART_ROWS_
        words_out = values.to(gl.pointer_type(gl.int32), bitcast=True)
        num_m = gl.cdiv(M, BM_)
        kcs = gl.cdiv(K, KC_)
        n_parts = num_m * kcs * CH
        per_group = GROUP_M_ * kcs * CH
        rows = gl.arange(0, PART_ROWS_, layout=gl.SliceLayout(1, lay))
        cols = gl.arange(0, KW, layout=gl.SliceLayout(0, lay))
        for q in range(gl.program_id(0), n_parts, gl.num_programs(0)):
            g = q // per_group
            rem = q % per_group
            gm = gl.minimum(num_m - g * GROUP_M_, GROUP_M_)
            kc = rem // (gm * CH)
            r2 = rem % (gm * CH)
            rb = g * GROUP_M_ + r2 // CH
            r = rb * BM_ + (r2 % CH) * PART_ROWS_ + rows
            w = kc * KW + cols
            mask = (r < M)[:, None] & (w < K // 2)[None, :]   # K % 32 == 0: whole blocks in or out
            offs = r.to(gl.int64)[:, None] * (K // 2) + w[None, :]
            if PASS == 1:
                x = gl.load(src.to(gl.pointer_type(gl.int32), bitcast=True) + offs, mask=mask, other=0)
                y = gl.reshape(_mx_round_words(gl.reshape(x, [PART_ROWS_, KW // 16, 16])), [PART_ROWS_, KW])
            else:
                p = gl.load(src.to(gl.pointer_type(gl.int16), bitcast=True) + offs, mask=mask, other=0)
                p3 = p.reshape([PART_ROWS_, KC_ // 32, 16])
                s_lay: gl.constexpr = gl.SliceLayout(2, p3.type.layout)
                sr = rb * BM_ + (r2 % CH) * PART_ROWS_ + gl.arange(0, PART_ROWS_, layout=gl.SliceLayout(1, s_lay))
                sb = kc * (KC_ // 32) + gl.arange(0, KC_ // 32, layout=gl.SliceLayout(0, s_lay))
                sc = gl.load(src_scales + sr.to(gl.int64)[:, None] * (K // 32) + sb[None, :],
                             mask=(sr < M)[:, None] & (sb < K // 32)[None, :], other=127)
                w3 = gl.inline_asm_elementwise(_EXPAND_PAIR, "=r,h,r",
                                               [p3, gl.expand_dims(mx_scale_f32(sc.to(gl.int32)), 2)],
                                               dtype=gl.int32, is_pure=True, pack=1)
                y = w3.reshape([PART_ROWS_, KW])
            gl.store(words_out + offs, gl.convert_layout(y, lay), mask=mask)
            gl.thread_barrier()  # every warp's stores of the part before the releases
            row = counters + 1 + rb * (kcs + 1)
            gl.atomic_add(row + kc, 1, sem="release", scope="gpu")
            gl.atomic_add(row + kcs, 1, sem="release", scope="gpu")

    @gluon.jit
    def _now_ns():
        return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=gl.int64, is_pure=False,
                                         pack=1)

    @gluon.jit
    def _acquire(flag):
        """``*flag`` by one gpu-scope acquire atomic (Triton broadcasts a scalar atomic's result: every thread
        of the partition decides alike)."""
        return gl.atomic_add(flag, 0, sem="acquire", scope="gpu")

    @gluon.jit
    def _proxy_fence():
        """Generic -> async proxy: the rows other programs stored are read next by this program's TMA."""
        gl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [], dtype=gl.int32,
                                  is_pure=False, pack=1)

    @gluon.jit
    def _wait_count(flag, target, timeout_ns, errors, OP: gl.constexpr, task, index):
        """device.wait_geq for this Gluon kernel (the Triton one builds layout-free tensors Gluon refuses): spin
        until ``*flag >= target`` or ``timeout_ns`` passed or another program recorded a timeout; the first to
        time out fills the error record (device._record_error: WAIT_MX_PASS, ``task`` the tile, ``index`` the
        chunk), the host raises after the launch. Then the proxy fence.
        As in device.wait_geq, each thread polls with volatile loads and leaves the loop on its own clock, and
        one uniform read (_acquire) after the loop decides for the partition: a scalar atomic inside the loop
        (its result is broadcast through a barrier of the partition) can hang -- the threads' own %globaltimer
        reads split them at the timeout, some leave the loop, the others wait at the atomic's barrier for them
        (docs/design/gemm.md)."""
        v = _acquire(flag)
        if v < target:
            t0 = _now_ns()
            seen = gl.load(flag, volatile=True)
            elapsed = t0 * 0
            while (seen < target) & (elapsed <= timeout_ns):
                seen = gl.load(flag, volatile=True)
                elapsed = _now_ns() - t0
                if gl.load(errors + ERR_FLAG, volatile=True) != 0:
                    elapsed = timeout_ns + 1  # another program gave up: drain
            v = _acquire(flag)
            if v < target:
                zero = gl.to_tensor(0).to(gl.int64)
                if gl.atomic_cas(errors + ERR_FLAG, zero, zero + 1, sem="relaxed", scope="gpu") == 0:
                    dev._record_error(errors, OP, WAIT_MX_PASS, 0, task, index, target, v, _now_ns() - t0)
        _proxy_fence()

    @gluon.jit
    def _tile_of(t, M, N, BN: gl.constexpr):
        """Tile t's (row, column) offsets in the TP kernels' GROUP_M order (tiles._grouped_tile: pure
        arithmetic, so the Triton helper serves Gluon code too)."""
        pid_m, pid_n = _grouped_tile(t, gl.cdiv(M, BM_), gl.cdiv(N, BN), GROUP_M_)
        return pid_m * BM_, pid_n * BN

    @gluon.jit
    def _issue_loads(s, ki, t, off_m, off_n, a_desc, b_desc, a_bufs, b_bufs, ready, M, N, K, counters, errors,
                     timeout_us, rows_ok, OP: gl.constexpr, B_KMAJOR: gl.constexpr, BN: gl.constexpr):
        """TMA loads of the load cursor's k-step into ring slot s (``ready`` completes when they land); none
        past the last tile. Before a chunk's first load, the row pass's counts (module docstring): at the tile's
        first k-step the row block's total (``rows_ok``, returned), while short the chunk's own count."""
        exists = t < gl.cdiv(M, BM_) * gl.cdiv(N, BN)
        off_k = ki * BK_
        if exists & (off_k % KC_ == 0):
            kcs = gl.cdiv(K, KC_)
            row = counters + 1 + (off_m // BM_) * (kcs + 1)
            if off_k == 0:
                rows_ok = (_acquire(row + kcs) >= (BM_ // PART_ROWS_) * kcs).to(gl.int32)
                if rows_ok != 0:
                    _proxy_fence()
            if rows_ok == 0:
                _wait_count(row + off_k // KC_, BM_ // PART_ROWS_, timeout_us.to(gl.int64) * 1000, errors, OP, t,
                            off_k // KC_)
        bar = ready.index(s)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes, pred=exists)
        tma.async_copy_global_to_shared(a_desc, [off_m, off_k], bar, a_bufs.index(s), pred=exists)
        if B_KMAJOR:
            tma.async_copy_global_to_shared(b_desc, [off_n, off_k], bar, b_bufs.index(s), pred=exists)
        else:
            tma.async_copy_global_to_shared(b_desc, [off_k, off_n], bar, b_bufs.index(s), pred=exists)
        return rows_ok

    @gluon.jit
    def _next_step(ki, t, off_m, off_n, M, N, K, BN: gl.constexpr):
        """The load cursor one k-step on (tile coordinates recomputed only when the tile changes)."""
        ki += 1
        if ki == gl.cdiv(K, BK_):
            ki = 0
            t += gl.num_programs(0)
            off_m, off_n = _tile_of(t, M, N, BN)
        return ki, t, off_m, off_n

    @gluon.jit
    def _store_tile(acc, c_desc, c_smem, off_m, off_n):
        """A tile's epilogue: the fp32 accumulator [R, C] as bf16, its columns halved log2(C / c_smem's width)
        times into pieces, each stored by TMA through ``c_smem`` once the previous store has left it."""
        R: gl.constexpr = acc.shape[0]
        EPI: gl.constexpr = c_smem.shape[1]
        cs = (acc.to(gl.bfloat16), )
        for _ in gl.static_range((acc.shape[1] // EPI).bit_length() - 1):
            nxt = ()
            for j in gl.static_range(len(cs)):
                x = cs[j]
                nxt = nxt + x.reshape(R, 2, x.shape[1] // 2).permute(0, 2, 1).split()
            cs = nxt
        for j in gl.static_range(len(cs)):
            tma.store_wait(0)
            c_smem.store(cs[j])
            fence_async_shared()
            tma.async_copy_shared_to_global(c_desc, [off_m, off_n + j * EPI], c_smem)

    @gluon.jit
    def _mma_loop(a_desc, b_desc, c_desc, a_bufs, b_bufs, ready, c_smem, M, N, K, counters, errors, timeout_us,
                  OP: gl.constexpr, B_KMAJOR: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr,
                  num_warps: gl.constexpr):
        """The MMA partition (module docstring). Per k-step: wait for the slot, async wgmma, wait until one group
        is in flight (step - 1 done), a barrier of the 8 warps (both warpgroups are past step - 1), refill step
        - 1's slot with step + STAGES - 1."""
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                             instr_shape=[16, BN, 16])
        k_steps = gl.cdiv(K, BK_)
        num_tiles = gl.cdiv(M, BM_) * gl.cdiv(N, BN)
        my_tiles = gl.cdiv(num_tiles - gl.program_id(0), gl.num_programs(0))
        lt = gl.program_id(0)
        l_m, l_n = _tile_of(lt, M, N, BN)
        lk = 0
        rows_ok = gl.to_tensor(0)
        for g in gl.static_range(STAGES - 1):
            rows_ok = _issue_loads(g, lk, lt, l_m, l_n, a_desc, b_desc, a_bufs, b_bufs, ready, M, N, K, counters,
                                   errors, timeout_us, rows_ok, OP, B_KMAJOR, BN)
            lk, lt, l_m, l_n = _next_step(lk, lt, l_m, l_n, M, N, K, BN)
        it = 0
        for tile in range(my_tiles):
            off_m, off_n = _tile_of(gl.program_id(0) + tile * gl.num_programs(0), M, N, BN)
            acc = gl.zeros([BM_, BN], gl.float32, acc_layout)
            for ki in range(k_steps):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                b = b_bufs.index(s)
                if B_KMAJOR:
                    b = b.permute((1, 0))
                acc = warpgroup_mma(a_bufs.index(s), b, acc, use_acc=ki > 0, is_async=True)
                acc = warpgroup_mma_wait(1, deps=(acc, ))
                gl.thread_barrier()
                rows_ok = _issue_loads((it + STAGES - 1) % STAGES, lk, lt, l_m, l_n, a_desc, b_desc, a_bufs, b_bufs,
                                       ready, M, N, K, counters, errors, timeout_us, rows_ok, OP, B_KMAJOR, BN)
                lk, lt, l_m, l_n = _next_step(lk, lt, l_m, l_n, M, N, K, BN)
                it += 1
            acc = warpgroup_mma_wait(0, deps=(acc, ))
            gl.thread_barrier()
            _store_tile(acc, c_desc, c_smem, off_m, off_n)
        tma.store_wait(0)

    @gluon.jit
    def _w1_mx_matmul_kernel(a_desc, b_desc, c_desc, src, src_scales, values, counters, errors, epoch_slot, M, N,
                             K, timeout_us, PASS: gl.constexpr, OP: gl.constexpr, B_KMAJOR: gl.constexpr,
                             BN: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
        """c = mx(A) @ B (module docstring): the MMA partition and the row pass, then the last program out
        resets ``counters`` and advances the workspace's device epoch (calls completed: runtime.device_epoch;
        nothing here reads it)."""
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
        c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):
            mbarrier.init(ready.index(j), count=1)
        gl.warp_specialize([
            (_mma_loop, (a_desc, b_desc, c_desc, a_bufs, b_bufs, ready, c_smem, M, N, K, counters, errors,
                         timeout_us, OP, B_KMAJOR, BN, STAGES, num_warps)),
            (_row_pass, (src, src_scales, values, counters, M, K, PASS, PASS_WARPS_)),
        ], [PASS_WARPS_], [PASS_REGS_])
        left = gl.atomic_add(counters, 1, sem="acq_rel", scope="gpu")
        if left == gl.num_programs(0) - 1:  # every program has left: nobody reads the counts any more
            zl: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
            n = 1 + gl.cdiv(M, BM_) * (gl.cdiv(K, KC_) + 1)
            for base in range(0, n, 1024):
                o = base + gl.arange(0, 1024, layout=zl)
                gl.store(counters + o, 0, mask=o < n)
            gl.atomic_add(epoch_slot, 1, sem="release", scope="gpu")


def counter_slots(m: int, k: int) -> int:
    return 1 + -(-m // BM) * (-(-k // KC) + 1)


def _desc(t, block):
    dt = {torch.bfloat16: gl.bfloat16}[t.dtype]
    return GluonDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, dt))


def w1_mx_matmul_launch(a, scales, b_store, b_kmajor: bool, c, values, ws, programs: int, op: int, bn: int = 256):
    """The KernelLaunch of c = mx(a) @ b: ``a`` bf16 [M, K] (rounded to MX by the row pass) with ``scales`` None,
    or an MX payload float8_e4m3fn [M, K] with its ``scales`` uint8 [M, K/32] (expanded); ``values`` the
    workspace's bf16 [M, K] buffer the pass fills (it is A's MX values after the launch); ``b_store`` [K, N] or,
    ``b_kmajor``, the weight [N, K]; ``c`` [M, N] bf16. K % 32 == 0, N % 8 == 0 (the caller has checked)."""
    m, k = a.shape
    n = c.shape[1]
    ws.ensure_counters(counter_slots(m, k))
    grid = min(programs, -(-m // BM) * -(-n // bn))
    b_desc = _desc(b_store, [bn, BK] if b_kmajor else [BK, bn])
    args = (_desc(values, [BM, BK]), b_desc, _desc(c, [BM, EPI_N]), a, a if scales is None else scales, values,
            ws.counters, ws.errors, ws.epoch_slot, m, n, k, max(1, ws.timeout_ns() // 1000))
    kw = dict(PASS=ROUND if scales is None else EXPAND, OP=op, B_KMAJOR=b_kmajor, BN=bn, STAGES=TILES[bn],
              num_warps=MMA_WARPS, maxnreg=MAXNREG)
    return launch_plan.KernelLaunch(_w1_mx_matmul_kernel, grid, args, kw)


def tile_width(m: int, n: int, programs: int) -> int:
    """The MMA tile's width BN (TILES) for c [m, n] on ``programs`` SMs: planning.tile_config's wave model over the
    two Gluon tiles -- ceil(T / programs) waves of T tiles, a 128 x 128 tile costing 0.5 / MX_TILE128_RATE of a
    128 x 256 one -- the wider on a tie within 1%. MX_TILE128_RATE is the measured many-wave rate of the
    128 x 128 build (8 MMA warps, 6 stages), fitted in-sample on the 48 grid GEMMs (docs/design/gemm.md)."""
    def cost(bn):
        tiles = -(-m // BM) * -(-n // bn)
        return -(-tiles // programs) * (bn / 256) / (1.0 if bn == 256 else MX_TILE128_RATE)
    return 128 if cost(128) < cost(256) * 0.99 else 256


def w1_mx_call(a, scales, b_store, b_kmajor: bool, ws, key, programs: int, op: int, quantize: bool,
               bn: int | None = None):
    """A TP op's W = 1 MXFP8 call through this kernel (the ops have validated everything): ``a`` bf16 (rounded to
    MX in the launch) with ``scales`` None, or an MXTensor's payload with its ``scales``; the plan of the call is
    stored under ``key`` (launch_plan: a hit replays it with the next call's tensors); ``bn`` the tile width
    (None: tile_width's rule; a developer probe sets it). Returns (values, c):
    A's MX values as bf16 [M, K] (a view of the workspace, valid until the next call on it) and c."""
    m, k = a.shape
    n = b_store.shape[0] if b_kmajor else b_store.shape[1]
    ws.ensure(m * k * 2, 0)
    values = ws.data[:m * k * 2].view(torch.bfloat16).view(m, k)
    c = torch.empty((m, n), dtype=torch.bfloat16, device=a.device)
    runtime.ensure_triton_allocator()
    ws.before_launch()
    kl = w1_mx_matmul_launch(a, scales, b_store, b_kmajor, c, values, ws, programs, op,
                             tile_width(m, n, programs) if bn is None else bn)
    info = dict(c_shape=(m, n), device=a.device, mx=scales is not None, b_kmajor=b_kmajor, a_full=None,
                clean=launch_plan.clean_check(ws), pre=None, returns="values" if quantize else "input",
                a_values=values)
    if key is not None:
        plan = launch_plan.make_plan(kl, dict(a=a, s=scales, b=b_store, c=c), ws, info)
        if plan is not None:
            launch_plan.store(ws, key, plan)
    kl.launch(list(kl.args), outputs=(c,), clean=info["clean"])
    ws.after_launch()
    return values, c
