"""GEMM+ReduceScatter in one self-scheduling persistent launch: ``matmul_reduce_scatter``.

Computes, on rank r of W (M rows, Ms = M / W per owner):
    P_r     = a_r @ b_r                           a [M, K/W] bf16; b [K/W, N] bf16 (this rank's row shard,
                                                  row-major or the .t() of a row-major [N, K/W])
    c_shard = sum_{s=0..W-1} P_s[r*Ms:(r+1)*Ms]   [Ms, N] bf16, a new tensor
K/W and N are multiples of 8, M divisible by W. Each partial tile is one fp32 dot product per element, rounded to
bf16 once (as NCCL's bf16 reduce-scatter does); the W partials are summed in fp32 in the fixed rank order
0..W-1 -- two runs give bitwise-identical results, and no float atomics are used.

Routes (tp_common.tp_route, the one decision both TP ops make; a first call builds and stores its launch plan,
``_replay`` relaunches it after the same host pre-step):
  FUSED      this module's kernel: any W, trace buffers, the fixed-role policy, MXFP8 through DEQ tasks.
  W1_STATIC  bf16, W = 1, untraced, self policy: gemm/w1_static.py (the same tiles, mainloop and epilogue as
             FUSED, so the same bits; nothing to reduce).
  W1_MX      MXFP8 at W = 1, untraced, self policy, where gemm/w1_mx.py runs (Hopper, Triton 3.6): c = mx(a) @ b;
             on few-tile shapes (tp_common.w1_mx_pass_first) one host pass makes a's MX values, then W1_STATIC.

Tasks (planning.plan_matmul_reduce_scatter), by stage in demand order:
  STAGE_TILE    TILE(owner, m, n): the partial tile of the owner's rows, stored (bf16, pointer stores, local HBM)
                into this rank's staging buffer (the symmetric workspace viewed as [M, N]) and published with
                notify(owner's flag[r, tile] = epoch): one remote atomic, no bulk remote stores. Owners staggered
                (rank r makes tile i for r+1, r+2, ..., r), so a tile's W partials appear at about the same time
                on every rank. Shared fetch-add queue.
  STAGE_REDUCE  REDUCE(m, n): one of this rank's own tiles: wait for flag[s, tile] >= epoch for every s, then read
                the W partials from the ranks' staging buffers over NVLink (pull) in steps of _red_rows rows, sum
                them in rank order and store c_shard. Owned (self policy): task t belongs to program t % GRID.
  STAGE_DEQ     MXFP8 only (below).
``MatmulReduceScatterConfig(push_partials=True)``: TILE stores into slot r of the owner's staging (viewed as
[W, Ms, N]; remote stores, then the same notify) and REDUCE reads its W slots from local memory.
W = 1: the tiles store straight into c_shard; no reduce tasks, no staging (the reduce path compiles out).

Signals of rank q (core/runtime.py: the workspace layout, Epochs; the epoch is the workspace's device slot + 1,
read by every program at its start and advanced by the last one out, device.exit_program):
  FLAG_BASE + s*T + t   written by rank s (release, system scope) when its partial of q's tile t is in place
                        (T tiles per owner); waited by q's REDUCE.
  DONE_BASE + p         rank p's launch has ended; the first staging write of a call waits for every
                        done[p] >= epoch - 1, because p may still be pulling the last call's partials.

Policy (core/schedule.py: the stages TILE then REDUCE, the reduce tasks owned and run ready-first):
  self   before each compute tile a program looks at its own next reduce task; if all W inputs are ready
         (schedule.all_ready) it runs it, else it computes -- so programs that reduce more compute less, and the
         pulls run as soon as their data exists and the owning program reaches a tile boundary: no split
         parameter, no shared reduce head, no CAS. Once the compute queue is empty it runs its remaining reduce
         tasks, waiting for each.
  fixed  programs pid < comm_programs only reduce (a shared queue, in order, waiting), the others only compute.

Deadlock-freedom: compute tiles never wait (but for the previous call's end on the peers, and under MXFP8 for
their rows' DEQ flags, whose tasks wait for nothing); a reduce task runs early only when its inputs are already
there, so every waiting program waits for compute tiles that running programs (or peers) have claimed or will
claim; the grid is at most one program per SM. Every wait is bounded (device.wait_geq): once any program of the
launch has recorded a timeout every wait gives up at once, and a program whose wait gave up leaves the loop;
nothing polls the error flag between tasks, so a program that never waits just finishes its compute tiles. The
launch always ends and the host raises.

MXFP8 (a a kosmos.quant.MXTensor [M, K/W], K/W % 32 == 0; b the bf16 MX values of the weight, quant.mx_round;
with ``precision="mxfp8"`` quant.quantize_mx makes the MXTensor first) on FUSED: nothing MX travels -- the partials
and the reduction stay bf16 / fp32. DEQ tasks (tp_dequant.py; 32-row runs, table chunks ascending with owners
innermost) expand a's rows into a local bf16 buffer after the staging and set local flags after the partial
flags; a tile waits for its rows' flags, then runs the bf16 mainloop unchanged. Nothing for a DEQ task to wait for
(a is local); the TILE programs take them ahead of demand (deq_lagging) and while a tile waits for its rows
(deq_should_help), the AllGather+GEMM policy.

Tests: tests/test_matmul_reduce_scatter.py (interpreter: epochs, both policies, push_partials, k-major b, timeouts,
input checks; GPU: the W = 1 routes and MXFP8, the static GEMM's schedules bitwise against this kernel, simulated
ranks W = 2..8 through tests/opcases.py's OnRanksCases), tests/test_tp_ops_together.py, tests/test_cuda_graphs.py,
tests/test_launch_plan.py, tests/test_planning.py (task tables, the stagger).
Why, and the alternatives measured and parked: docs/design/matmul_reduce_scatter.md; figures:
docs/perf/matmul_reduce_scatter.md (MXFP8: docs/perf/quant.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import MatmulReduceScatterConfig, check_config, default_config
from ..core import device as dev
from ..core import launch_plan, planning, runtime
from ..core import schedule as sched
from ..core.codes import EV_COMM, EV_COMPUTE, EV_WAIT, OP_MATMUL_REDUCE_SCATTER, WAIT_MX_ROWS, WAIT_RS_PARTIAL
from ..core.descriptors import host_descriptors
from ..core.schedule import check_launch, policy_args
from ..gemm.tiles import load_task, store_rows, store_tile, tile_matmul, tile_matmul_scaled_steps
from ..gemm.w1_mx import w1_mx_call
from ..gemm.w1_static import w1_matmul_launch
from .tp_common import (W1_MX, W1_STATIC, check_operands, fp8_block_operands, fp8_block_w1, is_fp8_block_call,
                        pre_step, quantize_request, split_mx, tp_route)
from .tp_dequant import deq_lagging, deq_needed, deq_should_help, mx_dequant_rows, wait_rows_dequantized

OP_CODE = OP_MATMUL_REDUCE_SCATTER.value
STAGE_TILE: tl.constexpr = tl.constexpr(0)
STAGE_REDUCE: tl.constexpr = tl.constexpr(1)
STAGE_DEQ: tl.constexpr = tl.constexpr(2)  # MXFP8: a's rows expanded to bf16, taken by the TILE programs first
COMM_STAGES: tl.constexpr = tl.constexpr(1 << 1)  # REDUCE
ALL_STAGES: tl.constexpr = tl.constexpr(0b11)
W1_STAGES: tl.constexpr = tl.constexpr(1 << 0)  # at W = 1: TILE only (the tiles go straight into c_shard)


@triton.jit
def _reduce_tile(t, mt, nt, c_ptr, peer_data, sig_ptr, err_ptr, Ms, N, rank, epoch, timeout_ns,
                 tiles_per_owner, n_tn, stage_ptr, WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 RED_ROWS: tl.constexpr, FLAG_BASE: tl.constexpr, PUSH: tl.constexpr):
    """Reduce task t = this rank's tile (mt, nt); returns 0 if a wait gave up (the caller drains)."""
    tile = mt * n_tn + nt
    ok = 1
    for s in tl.static_range(WORLD):
        slot = FLAG_BASE + s * tiles_per_owner + tile
        ok = ok & dev.wait_geq(sig_ptr + slot, epoch, timeout_ns, err_ptr, OP_MATMUL_REDUCE_SCATTER, WAIT_RS_PARTIAL,
                               rank, t, slot)
    rows_valid = Ms - mt * BM
    offs_r = tl.arange(0, RED_ROWS)
    offs_n = tl.arange(0, BN)
    inner = offs_r[:, None] * N + offs_n[None, :]  # int32 offsets inside the tile; its start is an int64 scalar
    for r0 in range(0, BM, RED_ROWS):
        mask = (offs_r[:, None] < rows_valid - r0) & (offs_n[None, :] < N - nt * BN)
        acc = tl.zeros((RED_ROWS, BN), dtype=tl.float32)
        for s in tl.static_range(WORLD):  # fixed rank order: deterministic
            if PUSH:  # source s pushed its partial into slot s of this rank's staging: a local read
                part = stage_ptr + (tl.cast(s * Ms + mt * BM + r0, tl.int64) * N + nt * BN)
            else:  # pull: this rank's rows of source s's staging, over NVLink
                part = dev.peer_ptr(peer_data, s, tl.bfloat16) + (
                    tl.cast(rank * Ms + mt * BM + r0, tl.int64) * N + nt * BN)
            acc += tl.load(part + inner, mask=mask, other=0.0).to(tl.float32)
        store_rows(c_ptr, acc.to(tl.bfloat16), mt * BM + r0, nt * BN, rows_valid - r0, N, RED_ROWS, BN)
    return ok


@triton.jit
def _deq_task(t, deq_table, a_mx, a_scales, deq_ptr, sig_ptr, Ms, K, epoch, n_chunks, DEQ_BASE,
              BM: tl.constexpr, DEQ_ROWS: tl.constexpr, DEQ_PARTS: tl.constexpr, DEQ_NB: tl.constexpr):
    """DEQ task t: rows (owner, chunk, part) of a to bf16, then its flag (nothing to wait for: a is local)."""
    owner, chunk, part = load_task(deq_table, t)
    r0 = chunk * BM + part * DEQ_ROWS
    row = (owner * Ms + r0).to(tl.int64)
    mx_dequant_rows(a_mx + row * K, a_scales + row * (K // 32), deq_ptr + row * K,
                    tl.maximum(tl.minimum(Ms - r0, DEQ_ROWS), 0), K, DEQ_ROWS, DEQ_NB)
    dev.notify(sig_ptr + DEQ_BASE + (owner * n_chunks + chunk) * DEQ_PARTS + part, epoch)


@triton.jit(do_not_specialize=["rank", "timeout_us", "n_comp", "n_red", "fixed_comm", "n_deq"])
def _matmul_reduce_scatter_kernel(
        a_desc, b_desc, c_desc, c_ptr, stage_ptr, a_mx, a_scales, deq_ptr, deq_table, n_deq,
        sa_ptr, sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk,
        peer_data, peer_sig, sig_ptr,
        comp_table, n_comp, red_table, n_red,
        heads_ptr, err_ptr, trace_ptr,
        Ms, N, K, rank, epoch_ptr, timeout_us, fixed_comm,
        WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GRID: tl.constexpr,
        POLICY: tl.constexpr, B_KMAJOR: tl.constexpr, TRACE: tl.constexpr, DOT_FP32: tl.constexpr,
        RED_ROWS: tl.constexpr, PUSH: tl.constexpr,
        FLAG_BASE: tl.constexpr, DONE_BASE: tl.constexpr, NUM_HEADS: tl.constexpr, EXIT_SLOT: tl.constexpr,
        ADVANCE: tl.constexpr, A_MX: tl.constexpr, DEQ_ROWS: tl.constexpr, DEQ_PARTS: tl.constexpr,
        DEQ_NB: tl.constexpr,
        GROUP_M: tl.constexpr, SCALED: tl.constexpr = False):
    """The FUSED route's kernel (module docstring): GRID programs, one per SM, each running the TILE / REDUCE
    loop (and, for MXFP8, DEQ tasks), then device.exit_program (done flags, the epoch). SCALED (fp8-block): A and
    B are E4M3 (B k-major, BK = 128) with fp32 scales sa [M, K/128] and sb [ceil(N/128), K/128] (strides sa_sm,
    sa_sk, sb_sn, sb_sk): the tiles run gemm/tiles.tile_matmul_scaled_steps; the partials and the reduction
    stay bf16 / fp32."""
    pid = tl.program_id(0)
    # the timeout travels in microseconds: always an i32 argument, so set_timeout never triggers a
    # recompile (with ns, 5 s was i64 and 0.5 s i32: the recompile's host time once hid a stalled peer)
    timeout_ns = tl.cast(timeout_us, tl.int64) * 1000
    epoch = dev.call_epoch(epoch_ptr)  # this call's epoch, from the device slot (runtime.py: Epochs)
    n_tn = tl.cdiv(N, BN)
    tiles_per_owner = tl.cdiv(Ms, BM) * n_tn

    stages = sched.program_stages(pid, POLICY, fixed_comm, W1_STAGES if WORLD == 1 else ALL_STAGES, COMM_STAGES)
    my_red = pid  # self: this program's next owned reduce task (its tasks are pid, pid + GRID, ...)
    if POLICY == sched.POLICY_SELF:
        red_done = (my_red >= n_red).to(tl.int32)
    else:  # fixed: the reducer programs share the reduce queue
        red_done = ((n_red == 0) | (sched.has_stage(stages, STAGE_REDUCE) == 0)).to(tl.int32)
    comp_done = (sched.has_stage(stages, STAGE_TILE) == 0).to(tl.int32)
    deq_done = comp_done | (n_deq == 0).to(tl.int32)  # MXFP8: the TILE programs expand a's rows first
    n_chunks = tl.cdiv(Ms, BM)
    DEQ_BASE = FLAG_BASE + WORLD * tiles_per_owner
    # the next own reduce task's tile, loaded once per task rather than at every tile boundary
    red_mt = tl.load(red_table + my_red * 4, mask=my_red < n_red, other=0)
    red_nt = tl.load(red_table + my_red * 4 + 1, mask=my_red < n_red, other=0)
    handshake = 0
    peers_ok = 1
    n_ev = 0
    while (red_done == 0) | (comp_done == 0):
        t_red = -1
        mt = red_mt
        nt = red_nt
        if WORLD == 1:  # no reduce tasks: with this constexpr branch t_red stays the literal -1 and the whole
            pass        # reduce path compiles out (its registers and spills at W = 1 with it)
        elif red_done == 0:
            if POLICY == sched.POLICY_SELF:  # owned tasks, ready-first: nothing to claim, nothing contended
                if comp_done == 1:  # the tiles are drained: take the next own task and wait for it
                    t_red = my_red
                elif sched.all_ready(sig_ptr + FLAG_BASE + red_mt * n_tn + red_nt, tiles_per_owner, epoch,
                                     WORLD) != 0:
                    t_red = my_red
                if t_red >= 0:
                    my_red += GRID
                    red_done = (my_red >= n_red).to(tl.int32)
                    red_mt = tl.load(red_table + my_red * 4, mask=my_red < n_red, other=0)
                    red_nt = tl.load(red_table + my_red * 4 + 1, mask=my_red < n_red, other=0)
            else:  # fixed: the reducer programs share the reduce queue in order, waiting
                t_red = sched.claim(heads_ptr + STAGE_REDUCE)
                if t_red >= n_red:
                    red_done = 1
                    t_red = -1
                else:
                    mt = tl.load(red_table + t_red * 4)
                    nt = tl.load(red_table + t_red * 4 + 1)
        if t_red >= 0:
            t0 = dev.now_ns()
            if _reduce_tile(t_red, mt, nt, c_ptr, peer_data, sig_ptr, err_ptr, Ms, N, rank, epoch, timeout_ns,
                            tiles_per_owner, n_tn, stage_ptr, WORLD, BM, BN, RED_ROWS, FLAG_BASE, PUSH) == 0:
                red_done = 1  # timed out, or another program did: drain (see the docstring)
                comp_done = 1
            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMM, t_red, t0, dev.now_ns(), TRACE)
        elif comp_done == 0:
            did_deq = 0
            if A_MX:  # before a tile: a DEQ task instead while the DEQ queue is behind the next wave's demand
                if deq_done == 0:
                    if deq_lagging(heads_ptr + STAGE_DEQ, heads_ptr + STAGE_TILE, n_deq, n_comp, GRID, n_chunks,
                                   n_tn, WORLD, DEQ_PARTS, GROUP_M, 1) != 0:
                        did_deq = 1
                        td = sched.claim(heads_ptr + STAGE_DEQ)
                        if td < n_deq:
                            t0 = dev.now_ns()
                            _deq_task(td, deq_table, a_mx, a_scales, deq_ptr, sig_ptr, Ms, K, epoch, n_chunks,
                                      DEQ_BASE, BM, DEQ_ROWS, DEQ_PARTS, DEQ_NB)
                            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMM, td, t0, dev.now_ns(), TRACE)
                        else:
                            deq_done = 1
            if did_deq == 0:
                t = sched.claim(heads_ptr + STAGE_TILE)
                if t < n_comp:
                    owner, mt, nt = load_task(comp_table, t)
                    t0 = dev.now_ns()
                    if A_MX:  # wait for the tile's rows to be expanded, running the DEQ tasks it needs meanwhile
                        deq_flag = DEQ_BASE + (owner * n_chunks + mt) * DEQ_PARTS
                        need = deq_needed(t + 1, n_comp, n_chunks, n_tn, WORLD, DEQ_PARTS, GROUP_M, 1)
                        helping = 1
                        while helping != 0:
                            if deq_should_help(heads_ptr + STAGE_DEQ, need, sig_ptr + deq_flag, epoch,
                                               DEQ_PARTS) != 0:
                                td = sched.claim(heads_ptr + STAGE_DEQ)
                                if td < n_deq:
                                    _deq_task(td, deq_table, a_mx, a_scales, deq_ptr, sig_ptr, Ms, K, epoch,
                                              n_chunks, DEQ_BASE, BM, DEQ_ROWS, DEQ_PARTS, DEQ_NB)
                            else:
                                helping = 0
                        if wait_rows_dequantized(sig_ptr + deq_flag, DEQ_PARTS, epoch, timeout_ns, err_ptr,
                                                 OP_MATMUL_REDUCE_SCATTER, WAIT_MX_ROWS, rank, t, deq_flag) == 0:
                            red_done = 1
                            comp_done = 1
                        t1 = dev.now_ns()
                        n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                        t0 = t1
                    if SCALED:
                        acc = tile_matmul_scaled_steps(a_desc, b_desc, owner * Ms + mt * BM, nt * BN, 0,
                                                       tl.cdiv(K, BK), sa_ptr, sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk,
                                                       Ms * WORLD, N, BM, BN, BK, DOT_FP32)
                    else:
                        acc = tile_matmul(a_desc, b_desc, owner * Ms + mt * BM, nt * BN, K, BM, BN, BK, B_KMAJOR,
                                          DOT_FP32)
                    if WORLD == 1:
                        store_tile(c_desc, c_ptr, acc, mt * BM, nt * BN, Ms - mt * BM, N, BM, BN)
                    else:
                        if handshake == 0:  # peers may still be pulling last call's partials from staging
                            peers_ok = dev.wait_peers_done(sig_ptr, DONE_BASE, WORLD, epoch, timeout_ns, err_ptr,
                                                           OP_MATMUL_REDUCE_SCATTER, rank)
                            handshake = 1
                            if peers_ok == 0:  # a peer never finished the last call: write nothing, drain
                                red_done = 1
                                comp_done = 1
                        if peers_ok != 0:
                            if PUSH:  # into slot r of the owner's staging (remote stores unless own rows)
                                store_rows(dev.peer_ptr(peer_data, owner, tl.bfloat16), acc.to(tl.bfloat16),
                                           rank * Ms + mt * BM, nt * BN, Ms - mt * BM, N, BM, BN)
                            else:
                                store_rows(stage_ptr, acc.to(tl.bfloat16), owner * Ms + mt * BM, nt * BN,
                                           Ms - mt * BM, N, BM, BN)
                            sig = dev.peer_ptr(peer_sig, owner, tl.int32)
                            dev.notify(sig + FLAG_BASE + rank * tiles_per_owner + mt * n_tn + nt, epoch)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMPUTE, t, t0, dev.now_ns(), TRACE)
                else:
                    comp_done = 1
    dev.exit_program(heads_ptr, EXIT_SLOT, NUM_HEADS, GRID, peer_sig, DONE_BASE, rank, WORLD, epoch, epoch_ptr,
                     ADVANCE)


def _red_rows(cfg, world: int) -> int:
    """Rows per step of a reduce task: a step loads W partials of [rows, BN] at once, so rows = 16384 //
    (BN * W) (a power of two, at most BM) keeps the bytes in flight -- and the registers -- the same at every
    world size: 32 rows at W = 2 and BN 256. A fixed 32 rows spilled at W = 8 (the 8 loads of a step are all
    issued before the adds); 64 rows at W = 2 spilled and timed as noise against 32
    (docs/design/matmul_reduce_scatter.md)."""
    rows = max(1, 16384 // (cfg.BN * max(1, world)))
    return max(1, min(cfg.BM, 1 << (rows.bit_length() - 1)))


def _launch_args(a, b_store, b_kmajor, c, stage, peer_data, peer_sig, signals, heads, errors, *, rank, world, epoch_slot,
           timeout_ns, grid, cfg, config=None, policy="self", comm_programs=None, trace=None, a_scales=None,
           dequantized=None, advance=True, fp8_scales=None):
    """The kernel's runtime arguments and constexpr / option keywords of ``launch`` (also a plan's template).
    Launch on explicit buffers (the public op builds them from the workspace; CPU tests build their own).
    Here a fixed split may be 0 or grid (one role only), which CPU tests use to order ranks' phases.
    ``epoch_slot`` (int32 [1], local): the device epoch; the launch runs at slot + 1 and advances it
    (``advance=False``: not -- a CPU test's first launch of a call split in two, like its fixed-role phases).
    MXFP8: ``a`` is the E4M3 payload, ``a_scales`` its E8M0 bytes and ``dequantized`` (bf16 [M, K], local)
    receives its expanded rows, which the tiles multiply. fp8-block: ``a`` and ``b_store`` are E4M3 payloads (b
    k-major [N, K], cfg.BK 128) and ``fp8_scales`` their fp32 scales (sa [M, K/128], sb [ceil(N/128), K/128]):
    the kernel's SCALED mainloop."""
    m, k = a.shape
    ms, n = c.shape
    pol, fixed = policy_args(policy, comm_programs, grid, lo=0)
    config = config or default_config(MatmulReduceScatterConfig)  # checked by the op
    key = ("rs", rank, world, ms, n, cfg, str(a.device))
    comp_t, red_t, _ = planning.cached_tables(
        key, lambda: planning.plan_matmul_reduce_scatter(rank, world, ms, n, cfg, a.device))
    trace_buf = trace if trace is not None else heads
    mx = a_scales is not None
    if mx:
        dq = planning.dequant_plan(cfg, k)
        deq_t = planning.cached_tables(("rs-deq", rank, world, ms, cfg, dq, str(a.device)),
                                       lambda: planning.plan_dequant(rank, world, ms, cfg, dq, "rs", a.device))
        a_desc, b_desc, c_desc = host_descriptors(dequantized, b_store, b_kmajor, c, cfg)
        mx_args = (a, a_scales, dequantized, deq_t, deq_t.shape[0])
    else:
        dq = planning.DequantPlan(1, 1, 1)
        a_desc, b_desc, c_desc = host_descriptors(a, b_store, b_kmajor, c, cfg)
        mx_args = (a, a, a, comp_t, 0)
    if fp8_scales is not None:
        if not b_kmajor or cfg.BK != 128 or mx:
            raise ValueError(f"matmul_reduce_scatter launch: fp8-block scales need a k-major B and BK 128, without "
                             f"MX scales (b_kmajor {b_kmajor}, BK {cfg.BK})")
        sa, sb = fp8_scales
        scale_args = (sa, sb, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    else:
        scale_args = (epoch_slot, epoch_slot, 0, 0, 0, 0)
    args = (
        a_desc, b_desc, c_desc, c, stage, *mx_args, *scale_args, peer_data, peer_sig, signals,
        comp_t, comp_t.shape[0], red_t, red_t.shape[0], heads, errors, trace_buf,
        ms, n, k, rank, epoch_slot, max(1, timeout_ns // 1000), fixed)
    kw = dict(
        WORLD=world, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GRID=grid, POLICY=pol, B_KMAJOR=b_kmajor,
        TRACE=trace is not None, DOT_FP32=planning.interpreting(), RED_ROWS=_red_rows(cfg, world), PUSH=config.push_partials,
        FLAG_BASE=runtime.FLAG_BASE, DONE_BASE=runtime.DONE_BASE, NUM_HEADS=runtime.NUM_HEADS,
        EXIT_SLOT=runtime.EXIT_SLOT, ADVANCE=bool(advance), A_MX=mx, DEQ_ROWS=dq.ROWS, DEQ_PARTS=dq.PARTS,
        DEQ_NB=dq.NB, GROUP_M=planning.GROUP_M, SCALED=fp8_scales is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return args, kw


def launch(*a, **k):
    """Launch on explicit buffers, the normal (unplanned) way: ``_launch_args``' docstring."""
    args, kw = _launch_args(*a, **k)
    return _matmul_reduce_scatter_kernel[(kw["GRID"],)](*args, **kw)


def matmul_reduce_scatter(a, b: torch.Tensor, group=None, *,
                          config: MatmulReduceScatterConfig | None = None, policy: str = "self",
                          comm_programs: int | None = None, trace: torch.Tensor | None = None,
                          precision: str | None = None) -> torch.Tensor:
    """``c_shard`` = this rank's M/W rows of ``sum_r a_r @ b_r`` over ``group`` (fixed rank order).

    a [M, K/W] bf16 CUDA with M divisible by W, or MXFP8 (a ``kosmos.quant.MXTensor``, K/W a multiple of 32:
    expanded to bf16 rows inside the launch; the partials and the reduction stay bf16 / fp32); b [K/W, N] bf16
    CUDA (row-major, or the ``.t()`` of a row-major [N, K/W] weight; for MX semantics ``quant.mx_round`` of
    it). K/W and N must be multiples of 8. Returns a new [M/W, N] bf16 tensor.
    ``config`` (``kosmos.MatmulReduceScatterConfig``, default: its defaults) holds the op's knobs.
    ``policy="fixed"`` with ``comm_programs=S`` runs the fixed-role ablation; ``trace`` as in
    ``all_gather_matmul``. ``precision="mxfp8"`` with a bf16 ``a``: the op quantizes it to MXFP8 itself and
    multiplies its MX values -- inside the launch at W = 1 on Hopper (gemm/w1_mx.py, which also takes every
    W = 1 MXTensor call; on tp_common.w1_mx_pass_first's shapes one pass makes the values first, then the bf16
    static GEMM), else quant.quantize_mx first (module docstring: Routes). ``precision="fp8-block"``: the
    operands as in ``all_gather_matmul``; any W (at W > 1 the fused kernel's scaled mainloop: ``_fp8_block``).
    """
    # the plan of this call signature (core/launch_plan.py); a miss validates and builds it
    first = a[0] if isinstance(a, tuple) and a else a
    ws, key, plan = launch_plan.find("rs", group, (a, b, trace), (config, policy, comm_programs, precision),
                                     getattr(first, "device", None))
    if plan is not None:
        return _replay(plan, ws, a, b, trace)
    if is_fp8_block_call(a, b, precision):
        return _fp8_block(a, b, group, precision, policy, trace, check_config(MatmulReduceScatterConfig, config))
    config = check_config(MatmulReduceScatterConfig, config)
    quantize = quantize_request("a", a, precision)
    m, k, n, b_store, b_kmajor = check_operands("a", a, b, policy)
    ws = runtime.get_workspace(group, first.device)
    if m % ws.world.size:
        raise ValueError(f"M={m} rows of a must divide by the world size {ws.world.size}")
    grid = runtime.num_sms(first.device)
    route = tp_route(ws.world.size, a, quantize, m, n, k, trace, policy, first.device, grid)
    a, a_scales = split_mx(pre_step(a, route.pre))
    if route.kind == W1_MX:  # at W = 1 there is nothing to reduce: c = mx(a) @ b
        return w1_mx_call(a, a_scales, b_store, b_kmajor, ws, key, grid, OP_CODE, quantize)[1]
    check_launch(policy, comm_programs, trace, grid)
    w, ms = ws.world.size, m // ws.world.size
    cfg = planning.tile_config(ms, n, k, world=w, programs=grid, mx=a_scales is not None)
    stage_bytes = m * n * 2 if w > 1 else 0  # at W=1 the tiles go straight into c_shard: no staging
    flags = w * -(-ms // cfg.BM) * -(-n // cfg.BN)  # (triton.cdiv costs ~7 us per host call)
    if a_scales is not None:  # MXFP8: a's dequantized rows after the staging; one flag per DEQ task
        flags += w * -(-ms // cfg.BM) * planning.dequant_plan(cfg, k).PARTS
    deq_off = -(-stage_bytes // 16) * 16
    ws.ensure(deq_off + (m * k * 2 if a_scales is not None else 0), flags)
    runtime.ensure_triton_allocator()
    ws.before_launch()
    c = torch.empty((ms, n), dtype=torch.bfloat16, device=a.device)
    if route.kind == W1_STATIC:  # nothing to wait for
        kl = w1_matmul_launch(a, b_store, b_kmajor, c, planning.w1_plan(ms, n, k, programs=grid), ws, grid,
                              op=OP_CODE)
    else:
        kl = _fused_launch(a, a_scales, b_store, b_kmajor, c, ws, m, k, stage_bytes, deq_off, grid, cfg, config,
                           policy, comm_programs, trace)
    info = dict(c_shape=(ms, n), device=a.device, mx=a_scales is not None, b_kmajor=b_kmajor,
                clean=launch_plan.clean_check(ws), pre=route.pre)
    if key is not None:
        plan = launch_plan.make_plan(kl, dict(a=a, s=a_scales, b=b_store, c=c, trace=trace), ws, info)
        if plan is not None:
            launch_plan.store(ws, key, plan)
    kl.launch(list(kl.args), outputs=(c,), clean=info["clean"], self_check=trace is None)
    ws.after_launch()
    return c


def _replay(plan, ws, a, b, trace):
    """A plan hit: the route's host step, then the first call's launch with this call's tensors."""
    info = plan.info
    c = torch.empty(info["c_shape"], dtype=torch.bfloat16, device=info["device"])
    a = pre_step(a, info["pre"])
    payload, scales = a if info["mx"] else (a, None)
    plan.call(ws, dict(a=payload, s=scales, b=b.t() if info["b_kmajor"] else b, c=c, trace=trace), (c,),
              trace is not None)
    return c


def _fp8_block(a, b, group, precision, policy, trace, config):
    """precision="fp8-block" (tp_common.fp8_block_operands): at W = 1 the static GEMM's scaled mainloop
    (tp_common.fp8_block_w1), at W > 1 this op's fused kernel with the SCALED mainloop (planning.FP8_BLOCK_TILE;
    the partials and the reduction stay bf16 / fp32). No cached plan yet: each call validates and launches."""
    a8, b8, dev = fp8_block_operands("a", a, b, precision, policy, trace)
    ws = runtime.get_workspace(group, dev)
    w = ws.world.size
    if w == 1:
        return fp8_block_w1(a8, b8, ws)
    m, k = a8.payload.shape
    n = b8.payload.shape[0]
    if m % w:
        raise ValueError(f"M={m} rows of a must divide by the world size {w}")
    ms, grid, cfg = m // w, runtime.num_sms(dev), planning.FP8_BLOCK_TILE
    stage_bytes = m * n * 2
    ws.ensure(stage_bytes, w * -(-ms // cfg.BM) * -(-n // cfg.BN))
    runtime.ensure_triton_allocator()
    ws.before_launch()
    c = torch.empty((ms, n), dtype=torch.bfloat16, device=dev)
    stage = ws.data[:stage_bytes].view(torch.bfloat16).view(m, n)
    args, kw = _launch_args(a8.payload, b8.payload, True, c, stage, ws.peer_data, ws.peer_signals, ws.signals,
                            ws.heads, ws.errors, rank=ws.world.rank, world=w, epoch_slot=ws.epoch_slot,
                            timeout_ns=ws.timeout_ns(), grid=grid, cfg=cfg, config=config, policy=policy,
                            fp8_scales=(a8.scales, b8.scales))
    _matmul_reduce_scatter_kernel[(grid,)](*args, **kw)
    ws.after_launch()
    return c


def _fused_launch(a, a_scales, b_store, b_kmajor, c, ws, m, k, stage_bytes, deq_off, grid, cfg, config, policy,
                  comm_programs, trace):
    """Route FUSED: the GEMM+ReduceScatter kernel's launch (any W; MX operands expanded by its DEQ tasks)."""
    w, r = ws.world.size, ws.world.rank
    stage = ws.data[:stage_bytes].view(torch.bfloat16).view(m, c.shape[1]) if w > 1 else c
    dequantized = (ws.data[deq_off:deq_off + m * k * 2].view(torch.bfloat16).view(m, k)
                   if a_scales is not None else None)
    args, kw = _launch_args(a, b_store, b_kmajor, c, stage, ws.peer_data, ws.peer_signals, ws.signals,
                            ws.heads, ws.errors, rank=r, world=w, epoch_slot=ws.epoch_slot,
                            timeout_ns=ws.timeout_ns(), grid=grid, cfg=cfg, config=config, policy=policy,
                            comm_programs=comm_programs, trace=trace, a_scales=a_scales, dequantized=dequantized)
    return launch_plan.KernelLaunch(_matmul_reduce_scatter_kernel, grid, args, kw)
