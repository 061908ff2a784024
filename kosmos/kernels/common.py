"""Tile-level building blocks shared by the fused-op kernels (GEMM mainloop, output stores, row copies),
plus the host-side input checks every op runs before it launches.

Measured / tried and parked: the GEMM mainloop (tile_matmul) and the epilogue stores in kosmos/planning.py's
module docstring; the row copies (copy_flat: copy step, int32 pointer advance, TMA copies) in
all_gather_matmul.py's; store_rows' int64 tile start + int32 offsets (bbf1f19) in moe_forward.py's."""
import torch
import triton
import triton.language as tl

from ..codes import TRACE_EVENTS as _TRACE_EVENTS, WAIT_SPLIT_K
from .. import device as dev
from ..quant import dequantize_mx, mx_scale_f32, round_to_mx
from ..schedule import POLICIES

TRACE_EVENTS = _TRACE_EVENTS.value  # events per program of a trace buffer


@triton.jit
def tile_matmul(a_desc, b_desc, row, col, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc[BM, BN] = A[row:row+BM, :K] @ B[:K, col:col+BN] in fp32 (TMA loads; OOB rows/cols read as 0).
    B_KMAJOR: B is stored [N, K] (a transposed weight view) instead of [K, N]."""
    return tile_matmul_steps(a_desc, b_desc, row, col, 0, tl.cdiv(K, BK), BM, BN, BK, B_KMAJOR, DOT_FP32)


@triton.jit
def tile_matmul_steps(a_desc, b_desc, row, col, step_lo, step_hi, BM: tl.constexpr, BN: tl.constexpr,
                      BK: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """tile_matmul over K steps [step_lo, step_hi) only (columns step_lo*BK .. step_hi*BK of A): one part of a
    K split."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for kk in range(step_lo, step_hi):
        acc = _k_step(a_desc, b_desc, row, col, kk, acc, BK, B_KMAJOR, DOT_FP32)
    return acc


@triton.jit
def _k_step(a_desc, b_desc, row, col, kk, acc, BK: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """acc + A[row:, kk*BK:+BK] @ B[kk*BK:+BK, col:] (TMA loads), one step of the GEMM mainloops."""
    a = a_desc.load([row, kk * BK])
    if B_KMAJOR:
        b = b_desc.load([col, kk * BK]).T
    else:
        b = b_desc.load([kk * BK, col])
    if DOT_FP32:  # the CPU interpreter's bf16 dot is wrong; fp32 is exact
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def tile_matmul_tail(a_desc, b_desc, b2_desc, row, col, K, BM: tl.constexpr, BN: tl.constexpr, BN_TAIL: tl.constexpr,
                     BK: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr, STAGES: tl.constexpr):
    """tile_matmul of a tile BN + BN_TAIL columns wide, as two accumulators: acc[BM, BN] of columns
    [col, col + BN) and acc2[BM, BN_TAIL] of [col + BN, col + BN + BN_TAIL), the tail's B through its own
    descriptor (b2_desc, blocks of BN_TAIL columns). Triton's blocks are powers of two; two MMAs per K step on
    the same A tile make a 192- or 160-wide tile."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    acc2 = tl.zeros((BM, BN_TAIL), dtype=tl.float32)
    for kk in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
        # dev/tail_probe's statement order (load A; load B, MMA; load B2, MMA): its own barrier per B2 load
        a = a_desc.load([row, kk * BK])  # one A tile for both MMAs
        if DOT_FP32:  # the CPU interpreter's bf16 dot is wrong; fp32 is exact
            a = a.to(tl.float32)
        if B_KMAJOR:
            b = b_desc.load([col, kk * BK]).T
        else:
            b = b_desc.load([kk * BK, col])
        if DOT_FP32:
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc)
        if B_KMAJOR:
            b2 = b2_desc.load([col + BN, kk * BK]).T
        else:
            b2 = b2_desc.load([kk * BK, col + BN])
        if DOT_FP32:
            b2 = b2.to(tl.float32)
        acc2 = tl.dot(a, b2, acc2)
    return acc, acc2


@triton.jit
def tile_matmul_cyclic(a_desc, b_desc, row, col, first, count, k_steps, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, B_KMAJOR: tl.constexpr, DOT_FP32: tl.constexpr):
    """tile_matmul over ``count`` <= k_steps K steps first, first + 1, ... taken modulo k_steps (a stream-K
    piece: its steps may wrap around the tile's end)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for j in range(0, count):
        kk = first + j
        kk = tl.where(kk >= k_steps, kk - k_steps, kk)
        acc = _k_step(a_desc, b_desc, row, col, kk, acc, BK, B_KMAJOR, DOT_FP32)
    return acc


@triton.jit
def _grouped_tile(t, n_m, n_n, GROUP_M: tl.constexpr):
    """Tile t's (m, n) in planning._grouped's order (GROUP_M m-tiles share each n-tile, for L2)."""
    per_group = GROUP_M * n_n
    first_m = (t // per_group) * GROUP_M
    size = tl.minimum(n_m - first_m, GROUP_M)
    return first_m + (t % per_group) % size, (t % per_group) // size


@triton.jit
def w1_matmul_kernel(a_desc, b_desc, c_desc, p_desc, b2_desc, c2_desc, epoch_ptr, M, N, K, c_ptr, part_ptr, cnt_ptr,
                     err_ptr, timeout_ns, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, B_KMAJOR: tl.constexpr,
                     GROUP_M: tl.constexpr, STAGES: tl.constexpr, DOT_FP32: tl.constexpr, SPLIT: tl.constexpr,
                     RB: tl.constexpr, OP: tl.constexpr, STREAM_K: tl.constexpr = False, BN_TAIL: tl.constexpr = 0):
    """C = A @ B at one rank, where a TP op has nothing to wait for: persistent, program p taking tiles p,
    p + GRID, ... of the grouped order (static: no queue claim, no task table, no exit protocol), and one
    software-pipelined loop over the (tile, k) pairs (``flatten``), so the next tile's first loads are in flight
    during this tile's epilogue. Per tile the same mainloop (tile_matmul) and epilogue values (store_tile's
    TMA stores) as the self-scheduled kernels: the same bits. The epilogue's tile is recomputed from its own
    counter (the pipeliner then carries nothing across the flattened loop). Program 0 advances the workspace's
    device epoch as every KOSMOS launch does (nothing here reads it: no peers; but the calls of other kernels on
    the same workspace, and a replayed graph's count, see one epoch per launch). Measurements: planning.tile_config's
    docstring.

    SPLIT > 1 (planning.w1_plan: too few tiles to fill the SMs): the K steps of every tile are cut into SPLIT
    parts, computed at once by the SPLIT programs of one *split group* (programs g*SPLIT .. g*SPLIT+SPLIT-1; the
    grid is a whole number of groups). Group g takes tiles g, g + GROUPS, ... in rounds. Per round each member
    stores its fp32 partial [BM, BN] (buffer half = round parity, so a fast member's next round never overwrites
    a partial a slower member still reads), counts itself in at the group's counter (release), waits for all
    SPLIT (bounded: wait_geq), then sums row blocks s, s + SPLIT, ... (RB rows each) of the tile over the parts
    0 .. SPLIT-1 in that order -- deterministic, and the sum is spread over the whole group rather than left to
    its last member (session 11's split-K lost that way). Co-residency: the grid is at most one program per SM
    and a group only waits on its own members in the same round. The last member out resets the group's two
    counters (arrivals, exits) to 0, the state every launch starts from.

    STREAM_K (planning.w1_plan: a last wave of tiles that leaves many SMs idle): data-parallel, then stream-K.
    With T tiles on GRID programs, the first (T // GRID - 1) * GRID tiles run as SPLIT = 1 does (the flattened
    loop); the rest -- one wave plus the partial one, or all T when T < GRID -- have their K steps laid end to
    end (tile-major) and cut into GRID equal runs, program p taking positions [p*W/GRID, (p+1)*W/GRID). A run
    crosses tiles; each piece is one tile_matmul_cyclic. A piece at positions [i0, i1) of its tile computes K
    steps [S - i1, S - i0) (S = K steps per tile), and a whole tile inside a run starts at the run's clock
    modulo S: so every program reads the same K step at the same time except in its run's last piece --
    session 17's stream-K read positions in order, and the runs' clocks then sat at K offsets spread over the
    whole K range, the SMs working on distinct K slices: no L2 reuse (measured 0.5x at 6000x5120x14336, where
    its runs are seven tiles long and nothing waits). The piece holding a tile's first position (its *owner*,
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
    the first MMA: both measured (session 19, Triton 3.6; planning.w1_plan's docstring) -- flattened 0.62x of
    cuBLAS, one barrier for all three loads 0.71-0.75x, this form 0.86-0.90x."""
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN + BN_TAIL)
    if BN_TAIL > 0:
        tl.static_assert(SPLIT == 1 and not STREAM_K, "a tail tile runs unsplit only")
        t_out = pid - grid
        # NOT flattened: Triton 3.6 pipelines the flattened two-MMA loop badly (s19a/s19c: 0.62x cuBLAS flattened,
        # 0.89x as a plain tile loop at 1024x3072x8192, dev/tail_probe)
        for t in tl.range(pid, n_m * n_n, grid, flatten=False, num_stages=STAGES):  # dev/tail_probe's loop form
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
        k_steps = tl.cdiv(K, BK)
        n_tiles = n_m * n_n
        dp_tiles = tl.maximum(n_tiles // grid - 1, 0) * grid
        t_out = pid - grid
        for t in tl.range(pid, dp_tiles, grid, flatten=True, num_stages=STAGES):
            tm, tn = _grouped_tile(t, n_m, n_n, GROUP_M)
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
            acc = tile_matmul(a_desc, b_desc, tm * BM, tn * BN, K, BM, BN, BK, B_KMAJOR, DOT_FP32)
            t_out += grid
            om, on = _grouped_tile(t_out, n_m, n_n, GROUP_M)
            # always TMA (C is exactly [M, N]: the descriptor clips a ragged last m-tile): store_tile's runtime
            # branch inside the flattened loop failed Triton 3.6's pipeliner ('scf.if' region operands, session 16)
            store_tile_tma(c_desc, acc, om * BM, on * BN, BM, BN)
    else:
        groups = grid // SPLIT
        g = pid // SPLIT
        s = pid % SPLIT
        k_steps = tl.cdiv(K, BK)
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
                   stream_k: bool = False, tail: int = 0):
    """(grid, runtime arguments, constexpr / option keywords) of w1_matmul_kernel for C [M, N] = A [M, K] @ B
    (b_store [K, N], or [N, K] when ``b_kmajor``) at tile ``cfg``: min(programs, tiles) programs; ``epoch_slot``
    the workspace's device epoch (int32 [1]), advanced by the launch. ``split`` > 1: the K split, on
    w1_split_grid(...) programs, with ``partials`` (fp32, w1_partial_elems(...)), ``counters`` (int32, 2 per
    split group, zero) and the error record ``errors`` / ``timeout_ns`` of its bounded waits, which name the
    TP op ``op`` (a codes.OP_* value). ``stream_k``: the stream-K schedule on min(programs, tiles * steps)
    programs, with ``partials`` (fp32, >= one tile per program), ``counters`` (int32, one per tile, zero).
    ``tail`` > 0 (unsplit only): tiles cfg.BN + tail columns wide (the kernel's BN_TAIL)."""
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
    if stream_k:
        grid = w1_stream_k_grid(programs, tiles, k, cfg)
        p_desc = tma_descriptor(partials[:grid * cfg.BM * cfg.BN].view(grid * cfg.BM, cfg.BN), [cfg.BM, cfg.BN // 2])
    elif split == 1:
        grid = max(1, min(programs, tiles))
        partials = counters = errors = epoch_slot
    else:
        grid = w1_split_grid(programs, tiles, split)
    return grid, (a_desc, b_desc, c_desc, p_desc, b2_desc, c2_desc, epoch_slot, m, n, k, c, partials, counters, errors,
                  timeout_ns), kw


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
    from .. import launch_plan, planning, runtime
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


# ------------------------------------------------------------------------------- MXFP8: dequantize on arrival
# The MX operand of a TP op is expanded to bf16 rows by DEQ tasks (a stage of the op's queue, in demand order;
# each task one run of DEQ_ROWS rows, flagged when written), and the GEMM tiles, after waiting for the flags
# of their rows, run the bf16 mainloop above unchanged. Why not expand inside the GEMM's load path: measured
# 1.36-2.5x slower (kernels/all_gather_matmul.py's docstring, "Tried and parked").
DEQ_COLS: tl.constexpr = tl.constexpr(16)  # MX blocks (of 32 elements) per step of a DEQ task's row loop


@triton.jit
def mx_dequant_rows(q_ptr, s_ptr, out_ptr, rows, K, ROWS: tl.constexpr, NB: tl.constexpr):
    """out[:rows, :K] (bf16) = the MX values of q (E4M3 [rows, K], row-major) with scales s (E8M0 [rows, K/32]);
    rows <= ROWS. Exact (kosmos/quant.py: every finite MX value below 2**128 whose lowest bit is >= 2**-133 is a
    bf16; others round to nearest even as dequantize_mx does). The scale 2**(S-127) is built from its fp32
    bits (S = 0: the subnormal 2**-127; 0xFF: NaN); the E4M3 -> fp32 conversion and the product are exact.
    Steps of [ROWS, NB, 32] elements; the offsets inside a step are int32 and computed once (ROWS * K fits),
    only the base offsets advance. Measured (one H200, session 8, dev/mx_probe.py): per-element int64 offsets
    and these int32 ones gave the same W=1 MX op time (1.152x cuBLAS bf16 over the 8 llama3-70b per-rank GEMMs
    of seq 4k/8k), i.e. the DEQ tasks cost ~70 us at qkv-4k (32M elements: ~1.4 TB/s, ~11 GB/s per program).
    A 2-D [ROWS, 512] variant loading each element's scale byte (the same address 32 times) plus GPU-scope
    reads in the DEQ checks measured 1.34x (and ran the first two bench runs by mistake: results/h200x1/s8/).
    Alone (dev/deq_probe.py, session 9): 2.4 TB/s with 132 programs, 27 GB/s per program with 8; more bytes
    in flight per program (two steps, larger steps, TMA boxes pipelined over 3 stages) reach at most 45 GB/s,
    and an integer expansion without conversion instructions is slower (20 GB/s): the expansion is bound by
    instruction issue, not memory latency. Inside the op the faster variants changed nothing (the AG op's
    docstring)."""
    KB = K // 32
    r = tl.arange(0, ROWS)
    b = tl.arange(0, NB)
    j = tl.arange(0, 32)
    soffs = r[:, None] * KB + b[None, :]
    offs = soffs[:, :, None] * 32 + j[None, None, :]
    rmask = (r < rows)[:, None]
    for b0 in range(0, KB, NB):
        smask = rmask & (b[None, :] < KB - b0)
        scale = mx_scale_f32(tl.load(s_ptr + b0 + soffs, mask=smask, other=127).to(tl.int32))
        q = tl.load(q_ptr + b0 * 32 + offs, mask=smask[:, :, None], other=0.0)
        tl.store(out_ptr + b0 * 32 + offs, (q.to(tl.float32) * scale[:, :, None]).to(tl.bfloat16),
                 mask=smask[:, :, None])


@triton.jit
def deq_needed(p, n_comp, n_chunks, n_tn, WORLD: tl.constexpr, PARTS: tl.constexpr, GROUP_M: tl.constexpr,
               RS_ORDER: tl.constexpr):
    """How many DEQ tasks (from the front of the DEQ table) the first ``p`` tiles of the compute table need.
    Both tables follow planning.py's orders: AllGather+GEMM slot by slot, each slot in GROUP_M-row bands
    (the DEQ table: slot by slot, chunks ascending); GEMM+ReduceScatter band by band, owners innermost (the
    DEQ table: chunks ascending, owners innermost). A band's tiles need all its chunks."""
    q = tl.minimum(tl.maximum(p, 1), n_comp) - 1  # the last tile counted
    if RS_ORDER:
        band = (q // WORLD) // (GROUP_M * n_tn)
        return tl.minimum(n_chunks, (band + 1) * GROUP_M) * WORLD * PARTS
    else:
        per_slot = n_chunks * n_tn
        band = (q % per_slot) // (GROUP_M * n_tn)
        return (q // per_slot) * n_chunks * PARTS + tl.minimum(n_chunks, (band + 1) * GROUP_M) * PARTS


@triton.jit
def deq_lagging(deq_head, tile_head, n_deq, n_comp, GRID: tl.constexpr, n_chunks, n_tn, WORLD: tl.constexpr,
                PARTS: tl.constexpr, GROUP_M: tl.constexpr, RS_ORDER: tl.constexpr):
    """Whether the DEQ queue is behind what the tiles claimed so far plus one more wave (GRID tiles) will
    need: then a program about to claim a tile takes a DEQ task instead. So the rows are expanded about one
    wave ahead of the tiles, by few programs at a time, while the others compute (instead of a serial pass
    over all rows before the first tile)."""
    hd = dev.load_uniform(deq_head)
    lag = 0
    if hd < n_deq:
        ht = dev.load_uniform(tile_head)
        lag = (hd < deq_needed(ht + GRID, n_comp, n_chunks, n_tn, WORLD, PARTS, GROUP_M, RS_ORDER)).to(tl.int32)
    return lag


@triton.jit
def deq_should_help(deq_head, need, flag_ptr, epoch, PARTS: tl.constexpr):
    """A tile waiting for its rows runs a DEQ task itself while its rows are not all expanded and DEQ tasks it
    needs (positions < need) are still unclaimed."""
    hd = dev.load_uniform(deq_head)
    do_help = 0
    if hd < need:
        ready = 1
        for i in tl.static_range(PARTS):
            ready = ready & (dev.load_uniform(flag_ptr + i) >= epoch).to(tl.int32)
        do_help = 1 - ready
    return do_help


@triton.jit
def wait_rows_dequantized(flag_ptr, PARTS: tl.constexpr, epoch, timeout_ns, err_ptr, OP: tl.constexpr,
                          WAIT: tl.constexpr, rank, task, index):
    """Wait (bounded) until the PARTS DEQ flags of one tile's rows, flag_ptr[0 .. PARTS), reach epoch."""
    ok = 1
    for i in tl.static_range(PARTS):
        if ok != 0:
            ok = dev.wait_geq(flag_ptr + i, epoch, timeout_ns, err_ptr, OP, WAIT, rank, task, index + i)
    return ok


@triton.jit
def load_task(table, t):
    """Fields 0..2 of row t of an int32 [n, 4] task table (planning.py)."""
    return tl.load(table + t * 4), tl.load(table + t * 4 + 1), tl.load(table + t * 4 + 2)


@triton.jit
def store_tile(c_desc, c_ptr, acc, row, col, rows_valid, N, BM: tl.constexpr, BN: tl.constexpr):
    """Store acc (fp32) as bf16 at C[row:row+rows_valid, col:col+BN]: TMA (two half-width stores) for a full
    tile, masked pointer stores when the tile ends inside the rows (a shard boundary)."""
    if rows_valid >= BM:
        store_tile_tma(c_desc, acc, row, col, BM, BN)
    else:
        store_rows(c_ptr, acc.to(tl.bfloat16), row, col, rows_valid, N, BM, BN)


@triton.jit
def store_tile_tma(c_desc, acc, row, col, BM: tl.constexpr, BN: tl.constexpr):
    """acc (fp32) as bf16 at C[row:row+BM, col:col+BN] by two half-width TMA stores (rows and columns past C's
    end are clipped by the descriptor)."""
    acc3 = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
    lo, hi = tl.split(acc3)
    c_desc.store([row, col], lo.to(tl.bfloat16))
    c_desc.store([row, col + BN // 2], hi.to(tl.bfloat16))


@triton.jit
def store_rows(ptr, val, row, col, rows_valid, N, BM: tl.constexpr, BN: tl.constexpr):
    """Masked pointer store of val[BM, BN] at ptr[row + i, col + j] for i < rows_valid, col + j < N. The
    tile's start is one int64 scalar and the offsets inside it int32 (a tile spans far fewer than 2**31
    elements), so no per-element 64-bit index is ever formed."""
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    base = ptr + (tl.cast(row, tl.int64) * N + col)
    mask = (offs_m[:, None] < rows_valid) & (offs_n[None, :] < N - col)
    tl.store(base + (offs_m[:, None] * N + offs_n[None, :]), val, mask=mask)


@triton.jit
def store_block(ptr, val, row, col, rows_valid, cols_valid, N, BM: tl.constexpr, BN: tl.constexpr):
    """store_rows with its own column bound: val[BM, BN] at ptr[row + i, col + j] (row stride N) for
    i < rows_valid, j < cols_valid -- a tile that is one of several column blocks of a row (gate | up)."""
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    base = ptr + (tl.cast(row, tl.int64) * N + col)
    mask = (offs_m[:, None] < rows_valid) & (offs_n[None, :] < cols_valid)
    tl.store(base + (offs_m[:, None] * N + offs_n[None, :]), val, mask=mask)


@triton.jit
def copy_flat(src_ptr, dst_ptr, n_elems, BLOCK: tl.constexpr):
    """dst[:n_elems] = src[:n_elems] for contiguous buffers (whole rows of a row-major matrix are one
    contiguous run), BLOCK elements at a time: fully coalesced 16-byte accesses. One program's rate grows
    with the bytes in flight per step (one H200, read + write, 8 programs: 33 GB/s each at 4096 bf16, 83 at
    16384; `kosmos_bench.copy_probe`). Advancing pointers with int32 offsets measured the same speed and
    took more registers in the AllGather+GEMM kernel (Triton 3.6), so the indices stay int64."""
    offs = tl.arange(0, BLOCK)
    for start in range(0, n_elems, BLOCK):
        idx = tl.cast(start, tl.int64) + offs
        mask = idx < n_elems
        tl.store(dst_ptr + idx, tl.load(src_ptr + idx, mask=mask), mask=mask)


# ---------------------------------------------------------------------------------------------- host side
def host_descriptors(a, b_store, b_kmajor: bool, c, cfg):
    """TMA descriptors of A [rows, K] (tiles [BM, BK]), B ([K, N] tiles [BK, BN], or [N, K] tiles [BN, BK] when
    k-major) and C [rows, N] (half-width [BM, BN/2] store tiles), built on the host: they reach the kernel as
    launch parameters. Building them on the device cost every program ~2 us at the start of a call (one H200,
    132 one-tile programs: 10.8 vs 8.6 us, `kosmos_bench.fixed_cost`)."""
    b_block = [cfg.BN, cfg.BK] if b_kmajor else [cfg.BK, cfg.BN]
    return (tma_descriptor(a, [cfg.BM, cfg.BK]), tma_descriptor(b_store, b_block),
            tma_descriptor(c, [cfg.BM, cfg.BN // 2]))


_DESCRIPTOR_TEMPLATES: dict = {}


def tma_descriptor(t, block_shape):
    """A host-built TMA descriptor of the 2-D row-major tensor ``t`` with tiles of ``block_shape``.

    Triton validates a new ``TensorDescriptor`` in Python (~9 us on the CPU of the dev box, three or four per
    call); the fields depend only on the layout and the base, so each layout is validated once and later
    calls copy that template and set ``base``. ``t`` itself passed ``check_matrix`` (16-byte aligned) or is
    a fresh allocation. The template keeps no tensor alive."""
    key = (tuple(t.shape), tuple(t.stride()), t.dtype, tuple(block_shape))
    tmpl = _DESCRIPTOR_TEMPLATES.get(key)
    if tmpl is None:
        from triton.tools.tensor_descriptor import TensorDescriptor
        tmpl = TensorDescriptor.from_tensor(t, list(block_shape))  # validated here, once per layout
        tmpl.base = None
        if len(_DESCRIPTOR_TEMPLATES) > 4096:  # many one-off shapes: start over rather than grow
            _DESCRIPTOR_TEMPLATES.clear()
        _DESCRIPTOR_TEMPLATES[key] = tmpl
    desc = object.__new__(type(tmpl))
    desc.__dict__.update(tmpl.__dict__)
    desc.base = t
    return desc


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
        from ..quant import check_mx
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


PRECISIONS = (None, "bf16", "mxfp8")


def quantize_request(a_name: str, a, precision) -> bool:
    """Whether a TP op is to quantize a bf16 ``a`` to MXFP8 itself (``precision="mxfp8"``); an MXTensor ``a`` is
    MXFP8 already (precision None or "mxfp8"), a bf16 one without it is computed in bf16."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: choose None, 'bf16' or 'mxfp8'")
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


def w1_mx_gluon(world: int, trace, policy: str, device) -> bool:
    """Whether a W = 1 MXFP8 call runs the Gluon kernel (kernels/w1_mx_matmul.py): untraced, self policy, on a
    GPU it supports; otherwise the op's own kernel with DEQ tasks (and, from bf16, quant.quantize_mx first)."""
    if world != 1 or trace is not None or policy != "self":
        return False
    from .w1_mx_matmul import unavailable
    return unavailable(device) is None


MX_PASS_FIRST_MIN_MACS = 1 << 28  # below: launch-bound calls, where one launch (the Gluon kernel) beats two


def w1_mx_pass_first(m: int, n: int, k: int, programs: int) -> bool:
    """Whether a W = 1 MXFP8 call that w1_mx_gluon gives the Gluon kernel runs instead as one pass that makes A's
    MX values (quant.round_to_mx from bf16, quant.dequantize_mx from an MXTensor) and then the bf16 static GEMM
    on them (planning.w1_plan: K split, stream-K, tail tiles, two programs per SM -- schedules the Gluon kernel
    lacks). Taken for C [m, n] of >= MX_PASS_FIRST_MIN_MACS multiply-adds where N <= 1536 (few column tiles to
    spread the in-launch rounding over; tail tiles), where w1_plan runs two programs per SM (short K), or where
    m >= 1024 and the Gluon kernel's tiles (w1_mx_matmul.tile_width) fill under 0.9 of their waves -- the
    separate pass reads 2 and writes 2 bytes per element of A (~3.3 TB/s, ~5.5 us at least), cheap against the
    idle SMs it saves there, dear against small M's 15-50 us GEMMs.

    Measured (session 24, one H200, Triton 3.6, dev/mx_tile_probe on the 48 grid GEMMs, A bf16 rounded in each
    call, results/h200x1/s24/s24e; in-sample: the conditions were drawn from these figures): the Gluon kernel
    alone 0.844 geomean of cuBLAS bf16, the pass + bf16 GEMM alone 0.859, this rule 0.872 (the better path per
    shape: 0.875); it picks the pass at 24 shapes (e.g. 2048x1536x5120 0.492 -> 0.691, 512x1536x7168 0.443 ->
    0.604, 6000x5120x14336 0.911 -> 0.964) and keeps every llama3-70b TP=2 per-rank GEMM on the Gluon kernel
    (session 23's mx_data_probe: the pass + bf16 GEMM 1-8% slower there but at fc2-16k, a tie). Held out (12
    shapes off the grid, picks written before the run, s24f): within 3% of the better path at 11 of 12; the
    miss, 1536x2560x3072 (one wave of 120 Gluon tiles, fill 0.91), runs 0.683 where the pass makes 0.797; over
    the 12 the rule 0.818 = the pass always 0.818, the better per shape 0.830. The committed grid run
    (results/h200x1/tp-grid-mxfp8-w1.*, 398ef82): 0.876 / 0.878 of cuBLAS bf16 (AG / RS; 0.844 / 0.845 before)."""
    from .. import planning
    from .w1_mx_matmul import BM, tile_width
    if m * n * k < MX_PASS_FIRST_MIN_MACS:
        return False
    bn = tile_width(m, n, programs)
    tiles = -(-m // BM) * -(-n // bn)
    fill = tiles / (-(-tiles // programs) * programs)
    return n <= 1536 or planning.w1_plan(m, n, k, programs=programs).per_sm > 1 or (fill < 0.9 and m >= 1024)


def mx_values_first(a, quantize: bool):
    """A's MX values as bf16 for w1_mx_pass_first's path: round_to_mx(a) for a bf16 ``a`` the op quantizes,
    dequantize_mx of an MXTensor ``a``."""
    return round_to_mx(a) if quantize else dequantize_mx(*a)


def check_launch(policy: str, comm_programs, trace, grid: int) -> None:
    """Checks that depend on the grid (the device's SM count)."""
    policy_args(policy, comm_programs, grid)
    if trace is not None and tuple(trace.shape) != (grid, TRACE_EVENTS, 4):
        raise ValueError(f"trace buffer must be int64 [{grid}, {TRACE_EVENTS}, 4]")


def check_tma_dims(**dims) -> None:
    for name, v in dims.items():
        if v % 8:
            raise ValueError(f"{name}={v} must be a multiple of 8 (rows of 16 bytes are needed by TMA)")


def policy_args(policy: str, comm_programs, grid: int, lo: int = 1):
    """(POLICY constexpr, S). Public ops need 1 <= S < grid; CPU tests use S = 0 / grid (one role only)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
    if policy == "fixed":
        if comm_programs is None or not lo <= comm_programs <= grid - lo:
            raise ValueError(f"fixed-role policy needs {lo} <= comm_programs <= {grid - lo}, got {comm_programs}")
        return POLICIES[policy], int(comm_programs)
    return POLICIES[policy], 0
