"""The W = 1 static GEMM: C = A @ B for a TP op at one rank, where there is nothing to gather or wait for.

``w1_matmul_kernel`` is persistent and static (program p takes tiles p, p + GRID, ... of the grouped order: no
queue, no task table), with four schedules chosen by core/planning.py's ``w1_plan``: unsplit, a K split (SPLIT
programs per tile, partial sums in fp32 added in fixed order: deterministic; a bounded wait per group),
stream-K (data-parallel waves first, then the last tiles' K steps spread over the programs) and tail tiles (BN +
BN_TAIL columns). ``w1_matmul_args`` / ``w1_matmul_launch`` build its launch; the grid and buffer helpers size
it. It is the W1_STATIC route of both TP ops (ops/tp_common.tp_route: bf16, or A's MX values after a host pass,
at W = 1, untraced, self policy); unsplit, it gives the bits of their self-scheduled kernels, and the K split and
stream-K sum their fp32 partials in a fixed order (deterministic). Tests: tests/test_matmul_reduce_scatter.py
(unsplit bitwise against the self-scheduled kernel; tail tiles, stream-K, the K split),
tests/test_all_gather_matmul.py (the W = 1 cases), tests/test_cuda_graphs.py, tests/test_planning.py (w1_plan).
Design, and why each schedule: docs/design/gemm.md; figures: docs/perf/all_gather_matmul.md."""
import torch
import triton
import triton.language as tl

from ..core import device as dev
from ..core import launch_plan, planning, runtime
from ..core.codes import WAIT_SPLIT_K
from ..core.descriptors import host_descriptors, tma_descriptor
from .tiles import (_grouped_tile, store_block, store_tile, store_tile_tma, tile_matmul, tile_matmul_cyclic,
                    tile_matmul_scaled_cyclic, tile_matmul_scaled_steps, tile_matmul_steps, tile_matmul_tail)


@triton.jit
def w1_matmul_kernel(a_desc, b_desc, c_desc, p_desc, b2_desc, c2_desc, epoch_ptr, M, N, K, c_ptr, part_ptr, cnt_ptr,
                     err_ptr, timeout_ns, sa_ptr, sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, B_KMAJOR: tl.constexpr, GROUP_M: tl.constexpr,
                     STAGES: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT: tl.constexpr, RB: tl.constexpr,
                     OP: tl.constexpr, STREAM_K: tl.constexpr = False, BN_TAIL: tl.constexpr = 0,
                     SCALED: tl.constexpr = False):
    """C = A @ B at one rank, where a TP op has nothing to wait for: persistent, program p taking tiles p,
    p + GRID, ... of the grouped order (static: no queue claim, no task table, no exit protocol), and one
    software-pipelined loop over the (tile, k) pairs (``flatten``), so the next tile's first loads are in flight
    during this tile's epilogue. Per tile the same mainloop (tile_matmul) and epilogue values (store_tile's
    TMA stores) as the self-scheduled kernels: the same bits. The epilogue's tile is recomputed from its own
    counter (the pipeliner then carries nothing across the flattened loop). Program 0 advances the workspace's
    device epoch as every KOSMOS launch does (nothing here reads it: no peers; but the calls of other kernels on
    the same workspace, and a replayed graph's count, see one epoch per launch). Why static, and what it
    measured: docs/design/gemm.md.

    SPLIT > 1 (planning.w1_plan: too few tiles to fill the SMs): the K steps of every tile are cut into SPLIT
    parts, computed at once by the SPLIT programs of one *split group* (programs g*SPLIT .. g*SPLIT+SPLIT-1; the
    grid is a whole number of groups). Group g takes tiles g, g + GROUPS, ... in rounds. Per round each member
    stores its fp32 partial [BM, BN] (buffer half = round parity, so a fast member's next round never overwrites
    a partial a slower member still reads), counts itself in at the group's counter (release), waits for all
    SPLIT (bounded: wait_geq), then sums row blocks s, s + SPLIT, ... (RB rows each) of the tile over the parts
    0 .. SPLIT-1 in that order -- deterministic, and the sum is spread over the whole group rather than left to
    its last member (a serial sum by the last split measured slower: docs/design/gemm.md). Co-residency: the grid
    is at most one program per SM and a group only waits on its own members in the same round. The last member
    out resets the group's two counters (arrivals, exits) to 0, the state every launch starts from.

    STREAM_K (planning.w1_plan: a last wave of tiles that leaves many SMs idle): data-parallel, then stream-K.
    With T tiles on GRID programs, the first (T // GRID - 1) * GRID tiles run as SPLIT = 1 does (the flattened
    loop); the rest -- one wave plus the partial one, or all T when T < GRID -- have their K steps laid end to
    end (tile-major) and cut into GRID equal runs, program p taking positions [p*W/GRID, (p+1)*W/GRID). A run
    crosses tiles; each piece is one tile_matmul_cyclic. A piece at positions [i0, i1) of its tile computes K
    steps [S - i1, S - i0) (S = K steps per tile), and a whole tile inside a run starts at the run's clock
    modulo S: so every program reads the same K step at the same time except in its run's last piece (pieces
    reading their positions in order put the runs' clocks at K offsets spread over the whole K range, the SMs on
    distinct K slices: no L2 reuse; docs/design/gemm.md). The piece holding a tile's first position (its *owner*,
    the last piece of its program's run) finishes the tile: alone it stores the tile (TMA); else it waits for
    the count of the other pieces at the tile's counter, adds their fp32 partials to its accumulator in program
    order, half a tile at a time (TMA loads of the partial buffer as a [GRID*BM, BN] matrix), stores the halves
    in bf16 and resets the counter to 0. Every other piece is the *first* piece of its program's run, so each
    program stores at most one partial (slot = program id, pointer stores, released by the counter; the owner's
    acquire includes the proxy fence its TMA loads need) before it waits for anything: no wait can be
    circular. Under the interpreter the programs run last first (one valid order of a GPU's).

    BN_TAIL > 0 (SPLIT 1 only; planning.w1_plan: a tile width between Triton's powers of two fills the last
    wave better): each tile is BN + BN_TAIL columns wide, two accumulators (tile_matmul_tail; the tail's B
    blocks through b2_desc, its store through c2_desc, blocks [BM, BN_TAIL]). Every output element is still
    one fp32 dot over K in K-step order. The tile loop is not flattened and the K loop keeps B2's load after
    the first MMA, so B2 has a barrier of its own: both measured faster on Triton 3.6 than a flattened loop or
    one barrier for all three loads (docs/design/gemm.md).

    SCALED (fp8-block): A and B are E4M3 (B k-major, BK = 128) with fp32 scales sa [M, K/128] (strides sa_sm,
    sa_sk) and sb [ceil(N/128), K/128] (sb_sn, sb_sk); every schedule but the tail tile runs the scaled mainloop
    (tiles.tile_matmul_scaled_steps / _cyclic); the partials, their sums and the stores are the same."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN + BN_TAIL)
    k_steps = tl.cdiv(K, BK)
    if BN_TAIL > 0:
        tl.static_assert(SPLIT == 1 and not STREAM_K and not SCALED, "a tail tile runs unsplit and unscaled only")
        t_out = pid - grid
        # NOT flattened: Triton 3.6 pipelines the flattened two-MMA loop badly (dev/archive/tail_probe; docs/design/gemm.md)
        for t in tl.range(pid, n_m * n_n, grid, flatten=False, num_stages=STAGES):  # dev/archive/tail_probe's loop form
            tm, tn = _grouped_tile(t, n_m, n_n, GROUP_M)
            acc, acc2 = tile_matmul_tail(a_desc, b_desc, b2_desc, tm * BM, tn * (BN + BN_TAIL), K, BM, BN, BN_TAIL,
                                         BK, B_KMAJOR, DOT_FP32, STAGES)
            t_out += grid
            om, on = _grouped_tile(t_out, n_m, n_n, GROUP_M)
            store_tile_tma(c_desc, acc, om * BM, on * (BN + BN_TAIL), BM, BN)
            c2_desc.store([om * BM, on * (BN + BN_TAIL) + BN], acc2.to(tl.bfloat16))
    elif STREAM_K:
        if dev.INTERPRET:  # the interpreter runs programs in order: last first, so owners find their parts stored
            pid = grid - 1 - pid
        n_tiles = n_m * n_n
        dp_tiles = tl.maximum(n_tiles // grid - 1, 0) * grid
        t_out = pid - grid
        for t in tl.range(pid, dp_tiles, grid, flatten=True, num_stages=STAGES):
            tm, tn = _grouped_tile(t, n_m, n_n, GROUP_M)
            if SCALED:
                acc = tile_matmul_scaled_steps(a_desc, b_desc, tm * BM, tn * BN, 0, k_steps, sa_ptr, sb_ptr, sa_sm,
                                               sa_sk, sb_sn, sb_sk, M, N, BM, BN, BK, DOT_FP32)
            else:
                acc = tile_matmul(a_desc, b_desc, tm * BM, tn * BN, K, BM, BN, BK, B_KMAJOR, DOT_FP32)
            t_out += grid
            om, on = _grouped_tile(t_out, n_m, n_n, GROUP_M)
            store_tile_tma(c_desc, acc, om * BM, on * BN, BM, BN)
        work = tl.cast(n_tiles - dp_tiles, tl.int64) * k_steps
        start = (pid * work) // grid
        end = ((pid + 1) * work) // grid
        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        pos = start
        while pos < end:
            u = pos // k_steps
            i0 = (pos - u * k_steps).to(tl.int32)
            i1 = tl.minimum(k_steps, end - u * k_steps).to(tl.int32)
            # the piece's K steps: positions [i0, i1) of the tile take K steps [S - i1, S - i0), so the piece
            # that opens a run starts at K step 0; a whole tile starts where the run's clock is (mod S)
            first = k_steps - i1
            if i1 - i0 == k_steps:
                first = ((pos - start) % k_steps).to(tl.int32)
            t = (dp_tiles + u).to(tl.int32)
            tm, tn = _grouped_tile(t, n_m, n_n, GROUP_M)
            if SCALED:
                acc = tile_matmul_scaled_cyclic(a_desc, b_desc, tm * BM, tn * BN, first, i1 - i0, k_steps, sa_ptr,
                                                sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk, M, N, BM, BN, BK, DOT_FP32)
            else:
                acc = tile_matmul_cyclic(a_desc, b_desc, tm * BM, tn * BN, first, i1 - i0, k_steps, BM, BN, BK,
                                         B_KMAJOR, DOT_FP32)
            if i0 == 0:
                # the program holding the tile's last position: the largest p with p*W/GRID <= that position
                last = ((u * k_steps + k_steps) * grid + work - 1) // work - 1
                others = (last - pid).to(tl.int32)
                if others > 0:
                    # the tile's other pieces (the first piece of programs pid+1 .. last, stored at their slots)
                    # added to this one in program order, half a tile at a time, then stored as bf16
                    dev.wait_geq(cnt_ptr + t, others, timeout_ns, err_ptr, OP, WAIT_SPLIT_K, 0, t, t)
                    acc3 = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
                    lo, hi = tl.split(acc3)
                    for j in range(1, others + 1):
                        lo += p_desc.load([(pid + j) * BM, 0])
                    c_desc.store([tm * BM, tn * BN], lo.to(tl.bfloat16))
                    for j in range(1, others + 1):
                        hi += p_desc.load([(pid + j) * BM, BN // 2])
                    c_desc.store([tm * BM, tn * BN + BN // 2], hi.to(tl.bfloat16))
                    tl.store(cnt_ptr + t, 0)
                else:
                    store_tile_tma(c_desc, acc, tm * BM, tn * BN, BM, BN)
            else:
                tl.store(part_ptr + tl.cast(pid, tl.int64) * (BM * BN) + (offs_m[:, None] * BN + offs_n[None, :]),
                         acc)
                tl.debug_barrier()
                tl.atomic_add(cnt_ptr + t, 1, sem="release", scope="gpu")
            pos = u * k_steps + i1
    elif SPLIT == 1:
        t_out = pid - grid
        for t in tl.range(pid, n_m * n_n, grid, flatten=True, num_stages=STAGES):
            tm, tn = _grouped_tile(t, n_m, n_n, GROUP_M)
            if SCALED:
                acc = tile_matmul_scaled_steps(a_desc, b_desc, tm * BM, tn * BN, 0, k_steps, sa_ptr, sb_ptr, sa_sm,
                                               sa_sk, sb_sn, sb_sk, M, N, BM, BN, BK, DOT_FP32)
            else:
                acc = tile_matmul(a_desc, b_desc, tm * BM, tn * BN, K, BM, BN, BK, B_KMAJOR, DOT_FP32)
            t_out += grid
            om, on = _grouped_tile(t_out, n_m, n_n, GROUP_M)
            # always TMA (C is exactly [M, N]: the descriptor clips a ragged last m-tile): store_tile's runtime
            # branch inside the flattened loop fails Triton 3.6's pipeliner ('scf.if' region operands)
            store_tile_tma(c_desc, acc, om * BM, on * BN, BM, BN)
    else:
        groups = grid // SPLIT
        g = pid // SPLIT
        s = pid % SPLIT
        lo = s * k_steps // SPLIT
        hi = (s + 1) * k_steps // SPLIT
        offs_m = tl.arange(0, BM)
        offs_r = tl.arange(0, RB)
        offs_n = tl.arange(0, BN)
        arrivals = cnt_ptr + g
        n_tiles = n_m * n_n
        r = 0
        for t in range(g, n_tiles, groups):
            tm, tn = _grouped_tile(t, n_m, n_n, GROUP_M)
            if SCALED:
                acc = tile_matmul_scaled_steps(a_desc, b_desc, tm * BM, tn * BN, lo, hi, sa_ptr, sb_ptr, sa_sm, sa_sk,
                                               sb_sn, sb_sk, M, N, BM, BN, BK, DOT_FP32)
            else:
                acc = tile_matmul_steps(a_desc, b_desc, tm * BM, tn * BN, lo, hi, BM, BN, BK, B_KMAJOR, DOT_FP32)
            half = part_ptr + tl.cast((r % 2) * grid, tl.int64) * (BM * BN)
            mine = half + pid * (BM * BN)
            tl.store(mine + (offs_m[:, None] * BN + offs_n[None, :]), acc)
            tl.debug_barrier()
            tl.atomic_add(arrivals, 1, sem="release", scope="gpu")
            r += 1
            dev.wait_geq(arrivals, r * SPLIT, timeout_ns, err_ptr, OP, WAIT_SPLIT_K, 0, t, g, True)
            parts = half + (g * SPLIT) * (BM * BN)
            for blk in range(s, BM // RB, SPLIT):
                rows = blk * RB + offs_r
                idx = rows[:, None] * BN + offs_n[None, :]
                total = tl.load(parts + idx, cache_modifier=".cg")
                for j in tl.static_range(1, SPLIT):
                    total += tl.load(parts + j * (BM * BN) + idx, cache_modifier=".cg")
                row0 = tm * BM + blk * RB
                store_block(c_ptr, total.to(tl.bfloat16), row0, tn * BN, M - row0, N - tn * BN, N, RB, BN)
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + groups + g, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
            tl.store(arrivals, 0)
            tl.store(cnt_ptr + groups + g, 0)
    if pid == 0:
        tl.store(epoch_ptr, tl.load(epoch_ptr) + 1)


def w1_matmul_args(a, b_store, b_kmajor: bool, c, cfg, epoch_slot, programs: int, group_m: int, dot_fp32: bool,
                   split: int = 1, partials=None, counters=None, errors=None, timeout_ns: int = 0, op: int = 0,
                   stream_k: bool = False, tail: int = 0, scales=None):
    """(grid, runtime arguments, constexpr / option keywords) of w1_matmul_kernel for C [M, N] = A [M, K] @ B
    (b_store [K, N], or [N, K] when ``b_kmajor``) at tile ``cfg``: min(programs, tiles) programs; ``epoch_slot``
    the workspace's device epoch (int32 [1]), advanced by the launch. ``split`` > 1: the K split, on
    w1_split_grid(...) programs, with ``partials`` (fp32, w1_partial_elems(...)), ``counters`` (int32, 2 per
    split group, zero) and the error record ``errors`` / ``timeout_ns`` of its bounded waits, which name the
    TP op ``op`` (a codes.OP_* value). ``stream_k``: the stream-K schedule on min(programs, tiles * steps)
    programs, with ``partials`` (fp32, >= one tile per program), ``counters`` (int32, one per tile, zero).
    ``tail`` > 0 (unsplit only): tiles cfg.BN + tail columns wide (the kernel's BN_TAIL). ``scales`` (fp8-block:
    a and b_store E4M3, b k-major, cfg.BK 128, no tail): (sa [M, K/128], sb [ceil(N/128), K/128]) fp32, any
    strides -- the kernel's SCALED mainloop."""
    m, k = a.shape
    n = c.shape[1]
    if tail and (split > 1 or stream_k):
        raise ValueError(f"w1_matmul_args: a tail of {tail} columns runs unsplit only (split {split}, "
                         f"stream_k {stream_k})")
    tiles = -(-m // cfg.BM) * -(-n // (cfg.BN + tail))
    a_desc, b_desc, c_desc = host_descriptors(a, b_store, b_kmajor, c, cfg)
    p_desc = b2_desc = c2_desc = c_desc  # unused unless stream-K / a tail
    if tail:
        b2_desc = tma_descriptor(b_store, [tail, cfg.BK] if b_kmajor else [cfg.BK, tail])
        c2_desc = tma_descriptor(c, [cfg.BM, tail])
    kw = dict(BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, B_KMAJOR=b_kmajor, GROUP_M=group_m, STAGES=cfg.num_stages,
              DOT_FP32=dot_fp32, SPLIT=split, RB=w1_reduce_rows(cfg.BM, split), OP=op, STREAM_K=stream_k,
              BN_TAIL=tail, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if scales is not None:
        if tail or not b_kmajor or cfg.BK != 128:
            raise ValueError(f"w1_matmul_args: fp8-block scales need a k-major B, BK 128 and no tail (b_kmajor "
                             f"{b_kmajor}, BK {cfg.BK}, tail {tail})")
        sa, sb = scales
        scale_args = (sa, sb, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
        kw["SCALED"] = True
    else:
        scale_args = (epoch_slot, epoch_slot, 0, 0, 0, 0)
    if stream_k:
        grid = w1_stream_k_grid(programs, tiles, k, cfg)
        p_desc = tma_descriptor(partials[:grid * cfg.BM * cfg.BN].view(grid * cfg.BM, cfg.BN), [cfg.BM, cfg.BN // 2])
    elif split == 1:
        grid = max(1, min(programs, tiles))
        partials = counters = errors = epoch_slot
    else:
        grid = w1_split_grid(programs, tiles, split)
    return grid, (a_desc, b_desc, c_desc, p_desc, b2_desc, c2_desc, epoch_slot, m, n, k, c, partials, counters, errors,
                  timeout_ns) + scale_args, kw


def w1_reduce_rows(bm: int, split: int) -> int:
    """Rows per block of a split group's sum (RB x BN fp32 loaded per part): the member's whole share, BM /
    split rows, in one block where that is a power of two (no latency-bound block loop), else 16."""
    share = bm // split
    return share if split > 1 and share * split == bm and share & (share - 1) == 0 else min(16, bm)


def w1_stream_k_grid(programs: int, tiles: int, k: int, cfg) -> int:
    """Programs of a stream-K launch: one per SM, but no more than the K steps of all tiles."""
    return max(1, min(programs, tiles * -(-k // cfg.BK)))


def w1_split_grid(programs: int, tiles: int, split: int) -> int:
    """Programs of a K-split launch: whole split groups, at most ``programs`` and no more groups than tiles."""
    return max(1, min(programs // split, tiles)) * split


def w1_partial_elems(grid: int, tiles: int, split: int, cfg) -> int:
    """fp32 elements of a K-split launch's partial buffer: one [BM, BN] per program, twice (round parity)
    when a group takes more than one tile."""
    rounds = -(-tiles // (grid // split))
    return (2 if rounds > 1 else 1) * grid * cfg.BM * cfg.BN


def w1_matmul_launch(a, b_store, b_kmajor: bool, c, plan, ws, programs: int, op: int = 0):
    """The KernelLaunch of the static W=1 GEMM for a TP op's first call of a shape (its plan's launch) on
    workspace ``ws``; refused inside a CUDA-graph capture, like every first call. ``plan``: planning.w1_plan's
    W1Plan for ``programs`` SMs -- its tile, K split or stream-K (their partials and counters are workspace
    buffers) and programs per SM; ``op`` the caller's codes.OP_* value."""
    runtime.capture_refusal("its static W=1 GEMM for this shape is not planned yet")
    cfg, split, stream_k = plan.tile, plan.split, plan.stream_k
    programs *= plan.per_sm
    extra = {}
    m, n = a.shape[0], c.shape[1]
    tiles = -(-m // cfg.BM) * -(-n // plan.width)
    if stream_k:
        grid = w1_stream_k_grid(programs, tiles, a.shape[1], cfg)
        ws.ensure_counters(tiles)
        extra = dict(partials=ws.local("w1_split_partials", grid * cfg.BM * cfg.BN, torch.float32),
                     counters=ws.counters, errors=ws.errors, timeout_ns=ws.timeout_ns(), stream_k=True)
    elif split > 1:
        grid = w1_split_grid(programs, tiles, split)
        ws.ensure_counters(2 * (grid // split))
        extra = dict(partials=ws.local("w1_split_partials", w1_partial_elems(grid, tiles, split, cfg),
                                       torch.float32),
                     counters=ws.counters, errors=ws.errors, timeout_ns=ws.timeout_ns())
    g, args, kw = w1_matmul_args(a, b_store, b_kmajor, c, cfg, ws.epoch_slot, programs, planning.GROUP_M,
                                 planning.interpreting(), split=split, op=op, tail=plan.tail, **extra)
    return launch_plan.KernelLaunch(w1_matmul_kernel, g, args, kw)


def fp8_block_operands(a, b) -> tuple[int, int, int]:
    """(M, K, N) of fp8_block_matmul's operands, or a one-line ValueError: ``a`` an FP8BlockTensor with 1x128 blocks
    [M, K], ``b`` one with 128x128 blocks [N, K], M and N multiples of 8 (TMA)."""
    from .. import quant
    m, k = quant.check_fp8_block("a", a)
    n, kb = quant.check_fp8_block("b", b)
    if a.block_rows != 1 or b.block_rows != quant.FP8_BLOCK:
        raise ValueError(f"a needs 1x128 blocks and b 128x128 blocks (block_rows 1 and 128), got "
                         f"{a.block_rows} and {b.block_rows}")
    if kb != k:
        raise ValueError(f"a is [{m}, {k}] but b is [{n}, {kb}]: both need K={k} columns")
    if m % 8 or n % 8:
        raise ValueError(f"M={m} and N={n} must be multiples of 8 (rows of 16 bytes are needed by TMA)")
    return m, k, n


def fp8_block_matmul(a, b, *, programs: int | None = None, epoch_slot=None, errors=None) -> torch.Tensor:
    """C [M, N] bf16 = A @ W^T on block-scaled FP8 operands, one launch of the static W = 1 GEMM (SCALED):
    ``a`` a quant.FP8BlockTensor with 1x128 blocks [M, K], ``b`` one with 128x128 blocks of the weight [N, K]
    (K % 128 == 0, M and N multiples of 8; CUDA, or the CPU under TRITON_INTERPRET=1). Each output element is
    the per-128 partial sums of the E4M3 products times their two scales, added in fp32 in K order, rounded to
    bf16 once (deterministic for every schedule). The schedule is planning.fp8_block_plan's for ``programs``
    (default: the SMs). No cached plan: a direct launch with its own buffers. ``epoch_slot``: a workspace's
    device epoch (int32 [1]), advanced by the launch as every KOSMOS launch does (the TP ops' fp8-block route
    passes theirs); default a scratch one. ``errors``: the error record the K split's and stream-K's bounded waits
    write (a workspace's, read by its next ``before_launch``); default a scratch one, read after the launch (a device
    sync: a timed-out wait raises RuntimeError here)."""
    m, k, n = fp8_block_operands(a, b)
    dev = a.payload.device
    if programs is None:
        programs = runtime.num_sms(dev) if dev.type == "cuda" else 4
    plan = planning.fp8_block_plan(m, n, k, programs=programs)
    cfg = plan.tile
    c = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
    epoch = epoch_slot if epoch_slot is not None else torch.zeros(1, dtype=torch.int32, device=dev)
    tiles = -(-m // cfg.BM) * -(-n // cfg.BN)
    extra = {}
    if plan.stream_k or plan.split > 1:
        if plan.stream_k:
            grid = w1_stream_k_grid(programs, tiles, k, cfg)
            extra = dict(partials=torch.empty(grid * cfg.BM * cfg.BN, dtype=torch.float32, device=dev),
                         counters=torch.zeros(tiles, dtype=torch.int32, device=dev), stream_k=True)
        else:
            grid = w1_split_grid(programs, tiles, plan.split)
            extra = dict(partials=torch.empty(w1_partial_elems(grid, tiles, plan.split, cfg), dtype=torch.float32,
                                              device=dev),
                         counters=torch.zeros(2 * (grid // plan.split), dtype=torch.int32, device=dev),
                         split=plan.split)
        record = errors if errors is not None else torch.zeros(runtime.ERR_SLOTS, dtype=torch.int64, device=dev)
        extra.update(errors=record, timeout_ns=10**10)
    if dev.type == "cuda":
        runtime.ensure_triton_allocator()
    g, args, kw = w1_matmul_args(a.payload, b.payload, True, c, cfg, epoch, programs, planning.GROUP_M,
                                 planning.interpreting(), scales=(a.scales, b.scales), **extra)
    w1_matmul_kernel[(g,)](*args, **kw)
    if extra and errors is None and int(extra["errors"][0]):
        raise RuntimeError(f"fp8_block_matmul: a bounded wait timed out (error record {extra['errors'].tolist()})")
    return c
