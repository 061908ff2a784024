"""AllGather+GEMM in one self-scheduling persistent launch: ``all_gather_matmul``.

Computes, on rank r of W (Ms = M / W rows per shard):
    a_full = allgather(a_shard)    a_shard [Ms, K] bf16; a_full [M, K] bf16, slot s holding rank s's rows
    c      = a_full @ b            b [K, N] bf16 (row-major, or the .t() of a row-major [N, K]); c [M, N] bf16
K and N are multiples of 8. fp32 accumulation; each output element is one dot product over K in K-step order, so
the bits do not depend on the schedule (bitwise deterministic; no atomics touch data). ``a_full`` is a view of the
symmetric workspace, valid until the next KOSMOS call on the group (at W = 1 nothing is gathered: a_shard itself,
or A's MX values where the op quantized it).

Routes (tp_common.tp_route, the one decision both TP ops make; ``_first_call_*`` build the first call of a
signature and store its launch plan, ``_replay`` relaunches it after the same host pre-step):
  FUSED      this module's kernel: any W, trace buffers, the fixed-role policy, MXFP8 through DEQ tasks.
  W1_STATIC  bf16, W = 1, untraced, self policy: gemm/w1_static.py (the same tiles, mainloop and epilogue as
             FUSED, so the same bits; nothing to gather or wait for).
  W1_MX      MXFP8 at W = 1, untraced, self policy, where gemm/w1_mx.py runs (Hopper, Triton 3.6); on few-tile
             shapes (tp_common.w1_mx_pass_first) one host pass makes A's MX values and W1_STATIC multiplies them.

Tasks (planning.plan_all_gather_matmul), by stage in demand order, one queue head each:
  STAGE_PUSH  PUSH(peer, chunk): rows [chunk*BM, +BM) of a_shard (one contiguous run, copy_flat) stored into slot
              r of the peer's gathered buffer over NVLink, then notify(peer's flag[r, chunk] = epoch). Peers r+1,
              r+2, ... (staggered), chunks ascending; with push_chunks > 1 a task moves chunks i, i + stride, ...,
              each flagged as it lands (planning.ag_comm_config).
  STAGE_TILE  TILE(slot, m, n): the C tile of gathered rows slot*Ms + m*BM, own slot first, then r-1, r-2, ...,
              GROUP_M m-tiles per n-tile. For slot != r it first waits for flag[slot, m] >= epoch; own-slot tiles
              read a_shard and never wait. One mainloop for both sources: each tile picks one of two host-built A
              descriptors (a_shard, or the whole gathered [M, K]).
  STAGE_COPY  COPY(r, chunk): the same rows into this rank's own slot, only so that ``a_full`` is complete.
  STAGE_DEQ   MXFP8 only: a queue outside the stage masks (below).
At W = 1 there is nothing to push or copy: TILE only.

Signals of rank q (core/runtime.py: the workspace layout, Epochs):
  epoch                     the workspace's device slot + 1, read by every program at its start and stored back by
                            the last program out (device.exit_program): no launch argument carries it, so a
                            CUDA-graph replay runs at the next epoch.
  FLAG_BASE + s*chunks + j  written by rank s (release, system scope) once chunk j is in q's slot s; q's tiles wait.
  DONE_BASE + p             written by rank p's last program as p's launch ends; a rank's first push of a call
                            waits for done[p] >= epoch - 1 on every peer, so it never overwrites rows p still reads.

Policy (core/schedule.py's loop):
  self   every program takes a PUSH task while any is unclaimed (always ready; the peers consume them first), then
         the next tile; once the tiles are drained, the COPY tasks -- nothing in the launch waits for them, so they
         fill the programs that run out of tiles during the last wave. How many programs communicate follows from
         how many comm tasks are left: no split parameter.
  fixed  programs pid < comm_programs take only PUSH then COPY, the others only TILE (the ablation).

Deadlock-freedom: a tile waits only for a peer's push; pushes are claimed before any compute (self) or by their
own programs (fixed) and wait only for the peers' previous call; COPY tasks never wait; the grid is at most one
program per SM, so all are co-resident. Every wait is bounded (device.wait_geq): once any program of the launch has
recorded a timeout every wait gives up at once, a program whose wait gave up leaves the loop, and a handshake that
failed makes the pushes write nothing. Nothing polls the error flag between tasks, so a program that never waits
finishes its tiles; the launch always ends and the host raises.

MXFP8 (a_shard a kosmos.quant.MXTensor: payload e4m3 [Ms, K] + E8M0 scales [Ms, K/32], K % 32 == 0; b the bf16 MX
values of the weight, quant.mx_round; with ``precision="mxfp8"`` quant.quantize_mx makes the MXTensor first) on
FUSED, dequantize on arrival: PUSH/COPY move the payload (its bytes as bf16 pairs), then the scales, one flag after
both (1 + 1/32 bytes per element, 0.52x of bf16). DEQ(slot, chunk, part) tasks (tp_dequant.py) expand DEQ_ROWS-row
runs into a local bf16 buffer [M, K] -- a peer's slot after waiting for its flag -- and set the local flag
DEQ_BASE + (slot*chunks + chunk)*DEQ_PARTS + part; a tile (own slot too) waits for its chunk's DEQ_PARTS flags, then
runs the bf16 mainloop unchanged over the expanded rows (exact: every MX value is a bf16). A TILE program takes a
DEQ task instead of a tile while the DEQ head lags what the claimed tiles plus one wave need (deq_lagging), and a
tile waiting for its rows runs the DEQ tasks it needs (deq_should_help). Deadlock-free: a DEQ task waits only for a
peer's push, which waits for nothing in this launch. Workspace: [payload M*K | scales M*K/32 | bf16 M*K*2], each
16-byte aligned (at W = 1 the bf16 rows only).

Tests: tests/test_all_gather_matmul.py (interpreter: epochs, both policies, comm tasks of several chunks, k-major b,
timeouts and the handshake, input checks; GPU: the W = 1 routes and MXFP8, tp_route, simulated ranks W = 2..8 through
tests/opcases.py's OnRanksCases), tests/test_tp_ops_together.py (both ops: W = 1 random shapes and workspace, W = 2
correctness, determinism, back-to-back calls), tests/test_cuda_graphs.py (replays bitwise equal to eager),
tests/test_launch_plan.py (plans built once, replayed bitwise), tests/test_planning.py (task tables, deq_needed).
Why, and the alternatives measured and parked: docs/design/all_gather_matmul.md; figures: docs/perf/all_gather_matmul.md
(MXFP8: docs/perf/quant.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..config import AllGatherMatmulConfig, check_config
from ..core import device as dev
from ..core import launch_plan, planning, runtime
from ..core import schedule as sched
from ..core.codes import EV_COMM, EV_COMPUTE, EV_WAIT, OP_ALL_GATHER_MATMUL, WAIT_AG_ROWS, WAIT_MX_ROWS
from ..core.descriptors import host_descriptors, tma_descriptor
from ..core.schedule import check_launch, policy_args
from ..gemm.tiles import copy_flat, load_task, store_tile, tile_matmul, tile_matmul_scaled_steps
from ..gemm.w1_mx import w1_mx_call
from ..gemm.w1_static import w1_matmul_launch
from ..quant import FP8BlockTensor, MXTensor
from .tp_common import (PRE_QUANTIZE, PRE_ROUND, W1_MX, W1_STATIC, check_operands, fp8_block_operands,
                        fp8_block_w1, is_fp8_block_call, pre_step, quantize_request, split_mx, tp_route)
from .tp_dequant import deq_lagging, deq_needed, deq_should_help, mx_dequant_rows, wait_rows_dequantized

OP_CODE = OP_ALL_GATHER_MATMUL.value
STAGE_PUSH: tl.constexpr = tl.constexpr(0)
STAGE_DEQ: tl.constexpr = tl.constexpr(1)   # MXFP8: dequantize rows to bf16 (a queue, not in the stage masks:
                                            # taken by TILE programs ahead of demand or while waiting)
STAGE_TILE: tl.constexpr = tl.constexpr(2)
STAGE_COPY: tl.constexpr = tl.constexpr(3)
NUM_STAGES: tl.constexpr = tl.constexpr(4)
COMM_STAGES: tl.constexpr = tl.constexpr((1 << 0) | (1 << 3))  # PUSH | COPY
ALL_STAGES: tl.constexpr = tl.constexpr(0b1101)     # bf16: PUSH, TILE, COPY
W1_STAGES: tl.constexpr = tl.constexpr(1 << 2)      # at W = 1: TILE only (nothing to push or copy)
TASK_PUSH: tl.constexpr = tl.constexpr(planning.PUSH)  # a comm table row's kind (else planning.COPY)


@triton.jit
def _deq_task(t, deq_table, rank, a_mx, g_mx, a_scales, g_scales, deq_ptr, sig_ptr, err_ptr, Ms, K, epoch,
              timeout_ns, n_chunks, FLAG_BASE: tl.constexpr, DEQ_BASE, BM: tl.constexpr, DEQ_ROWS: tl.constexpr,
              DEQ_PARTS: tl.constexpr, DEQ_NB: tl.constexpr):
    """DEQ task t: rows (slot, chunk, part) to bf16 -- the own shard's, or a peer's once they have landed --
    then its flag. Returns 0 when the wait for the peer's rows gave up (nothing written, no flag)."""
    slot, chunk, part = load_task(deq_table, t)
    ok = 1
    if slot != rank:  # a peer's rows: wait for them to land
        ok = dev.wait_geq(sig_ptr + FLAG_BASE + slot * n_chunks + chunk, epoch, timeout_ns, err_ptr,
                          OP_ALL_GATHER_MATMUL, WAIT_AG_ROWS, rank, t, FLAG_BASE + slot * n_chunks + chunk)
    r0 = chunk * BM + part * DEQ_ROWS
    rows = tl.maximum(tl.minimum(Ms - r0, DEQ_ROWS), 0)
    row = (slot * Ms + r0).to(tl.int64)
    if slot == rank:
        q = a_mx + r0.to(tl.int64) * K
        sc = a_scales + r0.to(tl.int64) * (K // 32)
    else:
        q = g_mx + row * K
        sc = g_scales + row * (K // 32)
    if ok != 0:
        mx_dequant_rows(q, sc, deq_ptr + row * K, rows, K, DEQ_ROWS, DEQ_NB)
        dev.notify(sig_ptr + DEQ_BASE + (slot * n_chunks + chunk) * DEQ_PARTS + part, epoch)
    return ok


@triton.jit(do_not_specialize=["rank", "timeout_us", "n_comm", "n_push", "n_comp", "fixed_comm",
                               "comm_stride", "n_deq"])
def _all_gather_matmul_kernel(
        a_ptr, a_host_desc, g_host_desc, b_desc, c_desc, c_ptr, gather_ptr,
        a_mx, g_mx, a_scales, g_scales, scale_off, deq_ptr, deq_table, n_deq,
        sa_ptr, sg_ptr, sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk,
        peer_data, peer_sig, sig_ptr,
        comm_table, n_comm, n_push, comp_table, n_comp,
        heads_ptr, err_ptr, trace_ptr,
        Ms, N, K, rank, epoch_ptr, timeout_us, fixed_comm, comm_stride,
        WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GRID: tl.constexpr,
        POLICY: tl.constexpr, B_KMAJOR: tl.constexpr, TRACE: tl.constexpr, DOT_FP32: tl.constexpr,
        COPY_BLOCK: tl.constexpr, FLAG_BASE: tl.constexpr, DONE_BASE: tl.constexpr, NUM_HEADS: tl.constexpr,
        EXIT_SLOT: tl.constexpr, ADVANCE: tl.constexpr, A_MX: tl.constexpr, DEQ_ROWS: tl.constexpr,
        DEQ_PARTS: tl.constexpr,
        DEQ_NB: tl.constexpr, GROUP_M: tl.constexpr, SCALED: tl.constexpr = False):
    """The FUSED route's kernel (module docstring): GRID programs, one per SM, each running the stage loop over
    PUSH, TILE and COPY (and, for MXFP8, DEQ), then device.exit_program (done flags, the epoch). SCALED
    (fp8-block): the rows move as MX rows do -- E4M3 payload, then K/32 bytes of scales a row (K/128 fp32) --
    no DEQ task, and the tiles run gemm/tiles.tile_matmul_scaled_steps on the E4M3 rows (own shard: a_host_desc
    and sa_ptr [Ms, K/128]; a peer's: g_host_desc and sg_ptr [M, K/128], the gathered scales) and the k-major
    E4M3 weight with its 128x128 scales sb_ptr."""
    pid = tl.program_id(0)
    # the timeout travels in microseconds: always an i32 argument, so set_timeout never triggers a
    # recompile (with ns, 5 s was i64 and 0.5 s i32: the recompile's host time once hid a stalled peer)
    timeout_ns = tl.cast(timeout_us, tl.int64) * 1000
    epoch = dev.call_epoch(epoch_ptr)  # this call's epoch, from the device slot (runtime.py: Epochs)
    n_chunks = tl.cdiv(Ms, BM)
    MOVES_SCALES: tl.constexpr = A_MX or SCALED  # MX and fp8-block rows: E4M3 payload + K/32 bytes of scales
    if MOVES_SCALES:  # rows move as E4M3 payload (a_ptr / gather_ptr are its bytes read as bf16 pairs) + scales
        row_elems = K // 2
    else:
        row_elems = K

    KB = K // 32
    DEQ_BASE = FLAG_BASE + WORLD * n_chunks  # MXFP8: flags (slot, chunk, part) of the dequantized rows

    # comm table rows [0, n_push) are the pushes, [n_push, n_comm) the own-slot copies (none at W = 1)
    stages = sched.program_stages(pid, POLICY, fixed_comm, W1_STAGES if WORLD == 1 else ALL_STAGES, COMM_STAGES)
    stage = sched.next_stage(stages, -1, NUM_STAGES)
    handshake = 0
    peers_ok = 1
    n_ev = 0
    while stage < NUM_STAGES:
        cur = stage
        if A_MX:  # before a tile: a DEQ task instead while the DEQ queue is behind the next wave's demand
            if stage == STAGE_TILE:
                if deq_lagging(heads_ptr + STAGE_DEQ, heads_ptr + STAGE_TILE, n_deq, n_comp, GRID, n_chunks,
                               tl.cdiv(N, BN), WORLD, DEQ_PARTS, GROUP_M, 0) != 0:
                    cur = STAGE_DEQ
        t = sched.claim(heads_ptr + cur)
        if cur == STAGE_DEQ:
            if t < n_deq:
                t0 = dev.now_ns()
                if _deq_task(t, deq_table, rank, a_mx, g_mx, a_scales, g_scales, deq_ptr, sig_ptr, err_ptr,
                             Ms, K, epoch, timeout_ns, n_chunks, FLAG_BASE, DEQ_BASE, BM, DEQ_ROWS, DEQ_PARTS,
                             DEQ_NB) == 0:
                    stage = NUM_STAGES
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMM, t, t0, dev.now_ns(), TRACE)
        elif stage == STAGE_TILE:
            if t < n_comp:
                slot, mt, nt = load_task(comp_table, t)
                t0 = dev.now_ns()
                if A_MX:  # the rows' DEQ tasks (every slot, the own one too) must have written them; while
                    # they are not, this program runs the DEQ tasks up to the ones it needs (deadlock-free:
                    # a DEQ task waits only for a peer's push)
                    deq_flag = DEQ_BASE + (slot * n_chunks + mt) * DEQ_PARTS
                    need = deq_needed(t + 1, n_comp, n_chunks, tl.cdiv(N, BN), WORLD, DEQ_PARTS, GROUP_M, 0)
                    helping = 1
                    while helping != 0:
                        if deq_should_help(heads_ptr + STAGE_DEQ, need, sig_ptr + deq_flag, epoch,
                                           DEQ_PARTS) != 0:
                            td = sched.claim(heads_ptr + STAGE_DEQ)
                            if td < n_deq:
                                if _deq_task(td, deq_table, rank, a_mx, g_mx, a_scales, g_scales, deq_ptr,
                                             sig_ptr, err_ptr, Ms, K, epoch, timeout_ns, n_chunks, FLAG_BASE,
                                             DEQ_BASE, BM, DEQ_ROWS, DEQ_PARTS, DEQ_NB) == 0:
                                    helping = 0
                        else:
                            helping = 0
                    if wait_rows_dequantized(sig_ptr + deq_flag, DEQ_PARTS, epoch, timeout_ns, err_ptr,
                                             OP_ALL_GATHER_MATMUL, WAIT_MX_ROWS, rank, t, deq_flag) == 0:
                        stage = NUM_STAGES
                    t1 = dev.now_ns()
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                    t0 = t1
                elif slot != rank:
                    if dev.wait_geq(sig_ptr + FLAG_BASE + slot * n_chunks + mt, epoch, timeout_ns, err_ptr,
                                    OP_ALL_GATHER_MATMUL, WAIT_AG_ROWS, rank, t,
                                    FLAG_BASE + slot * n_chunks + mt) == 0:
                        stage = NUM_STAGES  # timed out, or another program did: this program drains (docstring)
                    t1 = dev.now_ns()
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                    t0 = t1
                # one GEMM loop for both sources (two call sites would each reserve their own pipeline
                # buffers), fed by one of two host-built descriptors picked per tile (a device-built one per
                # tile was slower: docs/design/all_gather_matmul.md). Rows past a remote slot read the next
                # slot's rows (zeros past M): they only feed output rows that store_tile masks off.
                # (MXFP8: g_host_desc is over the dequantized rows of every slot)
                if A_MX:
                    a_desc = g_host_desc
                    a_row = slot * Ms + mt * BM
                elif slot == rank:
                    a_desc = a_host_desc
                    a_row = mt * BM
                else:
                    a_desc = g_host_desc
                    a_row = slot * Ms + mt * BM
                if SCALED:  # the row scales of the same rows: the own shard's, or the gathered ones
                    if slot == rank:
                        s_rows = sa_ptr
                        s_bound = Ms
                    else:
                        s_rows = sg_ptr
                        s_bound = Ms * WORLD
                    acc = tile_matmul_scaled_steps(a_desc, b_desc, a_row, nt * BN, 0, tl.cdiv(K, BK), s_rows,
                                                   sb_ptr, sa_sm, sa_sk, sb_sn, sb_sk, s_bound, N, BM, BN, BK,
                                                   DOT_FP32)
                else:
                    acc = tile_matmul(a_desc, b_desc, a_row, nt * BN, K, BM, BN, BK, B_KMAJOR, DOT_FP32)
                store_tile(c_desc, c_ptr, acc, slot * Ms + mt * BM, nt * BN, Ms - mt * BM, N, BM, BN)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMPUTE, t, t0, dev.now_ns(), TRACE)
            else:
                stage = sched.next_stage(stages, stage, NUM_STAGES)
        else:
            if stage == STAGE_PUSH:
                end = n_push
            else:
                t = n_push + t
                end = n_comm
            if t < end:
                t0 = dev.now_ns()
                kind = tl.load(comm_table + t * 4)
                peer = tl.load(comm_table + t * 4 + 1)
                chunk0 = tl.load(comm_table + t * 4 + 2)
                n_moved = tl.load(comm_table + t * 4 + 3)
                if (kind == TASK_PUSH) & (handshake == 0):  # nobody may still be reading what we are about to overwrite
                    peers_ok = dev.wait_peers_done(sig_ptr, DONE_BASE, WORLD, epoch, timeout_ns, err_ptr,
                                                   OP_ALL_GATHER_MATMUL, rank)
                    handshake = 1
                    if peers_ok == 0:
                        stage = NUM_STAGES
                for j in range(n_moved):
                    chunk = chunk0 + j * comm_stride
                    rows = tl.minimum(Ms - chunk * BM, BM)
                    src = a_ptr + chunk.to(tl.int64) * BM * row_elems
                    dst_row = (rank * Ms + chunk * BM).to(tl.int64) * row_elems
                    if peers_ok == 0:  # a peer never finished the last call: write nothing (the loop drains)
                        pass
                    elif kind == TASK_PUSH:
                        dst = dev.peer_ptr(peer_data, peer, tl.bfloat16) + dst_row
                        copy_flat(src, dst, rows * row_elems, COPY_BLOCK)
                        if MOVES_SCALES:
                            s_off = (rank * Ms + chunk * BM).to(tl.int64) * (K // 32)
                            copy_flat(a_scales + chunk.to(tl.int64) * BM * (K // 32),
                                      dev.peer_ptr(peer_data, peer, tl.uint8) + scale_off + s_off,
                                      rows * (K // 32), COPY_BLOCK)
                        sig = dev.peer_ptr(peer_sig, peer, tl.int32)
                        dev.notify(sig + FLAG_BASE + rank * n_chunks + chunk, epoch)
                    else:
                        copy_flat(src, gather_ptr + dst_row, rows * row_elems, COPY_BLOCK)
                        if MOVES_SCALES:
                            s_off = (rank * Ms + chunk * BM).to(tl.int64) * (K // 32)
                            copy_flat(a_scales + chunk.to(tl.int64) * BM * (K // 32), g_scales + s_off,
                                      rows * (K // 32), COPY_BLOCK)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMM, t, t0, dev.now_ns(), TRACE)
            else:
                stage = sched.next_stage(stages, stage, NUM_STAGES)
    dev.exit_program(heads_ptr, EXIT_SLOT, NUM_HEADS, GRID, peer_sig, DONE_BASE, rank, WORLD, epoch, epoch_ptr,
                     ADVANCE)


def _launch_args(a_shard, b_store, b_kmajor, c, gather, peer_data, peer_sig, signals, heads, errors, *, rank, world,
           epoch_slot, timeout_ns, grid, cfg, config=None, policy="self", comm_programs=None, trace=None,
           a_scales=None, gather_scales=None, scale_offset=0, dequantized=None, advance=True, fp8_scales=None):
    """The kernel's runtime arguments and constexpr / option keywords of ``launch`` (also a plan's template).
    Launch on explicit buffers (the public op builds them from the workspace; CPU tests build their own).
    Here a fixed split may be 0 or grid (one role only), which CPU tests use to order ranks' phases.
    ``epoch_slot`` (int32 [1], local): the device epoch; the launch runs at slot + 1 and advances it
    (``advance=False``: not -- a CPU test's first launch of a call split in two, like its fixed-role phases).
    MXFP8: a_shard / gather are E4M3 payloads, a_scales / gather_scales their E8M0 bytes, a peer's gathered
    scales start ``scale_offset`` bytes into its data buffer (after the [M, K] payload), and ``dequantized``
    (bf16 [M, K], local) receives every slot's expanded rows, which the tiles multiply. fp8-block
    (``fp8_scales`` = (own row scales fp32 [Ms, K/128], gathered row scales fp32 [M, K/128], the weight's
    [ceil(N/128), K/128])): a_shard / gather are E4M3 payloads, b_store the k-major E4M3 weight, cfg.BK 128; the
    rows and their scales move as MX rows do (the scales as bytes; the gathered ones ``scale_offset`` bytes into a
    peer's data buffer), no DEQ task, the SCALED mainloop."""
    ms, k = a_shard.shape
    mx = a_scales is not None
    n = c.shape[1]
    pol, fixed = policy_args(policy, comm_programs, grid, lo=0)
    per_task, copy_block = planning.ag_comm_config(world, ms, cfg.BM, config)
    key = ("ag", rank, world, ms, n, cfg, per_task, str(a_shard.device))
    comm_t, comp_t, _ = planning.cached_tables(
        key, lambda: planning.plan_all_gather_matmul(rank, world, ms, n, cfg, a_shard.device, per_task))
    trace_buf = trace if trace is not None else heads
    n_push = planning.ag_push_tasks(world, ms, cfg.BM, per_task)
    if mx:
        dq = planning.dequant_plan(cfg, k)
        deq_t = planning.cached_tables(("ag-deq", rank, world, ms, cfg, dq, str(a_shard.device)),
                                       lambda: planning.plan_dequant(rank, world, ms, cfg, dq, "ag", a_shard.device))
        # the tiles read every slot from the dequantized rows: one bf16 descriptor (a_host_desc unused)
        _, b_desc, c_desc = host_descriptors(dequantized, b_store, b_kmajor, c, cfg)
        a_desc = gather_desc = tma_descriptor(dequantized, [cfg.BM, cfg.BK])
        a_rows, g_rows = a_shard.view(torch.bfloat16), gather.view(torch.bfloat16)  # bytes as bf16 pairs
        mx_args = (a_shard, gather, a_scales, gather_scales, scale_offset, dequantized, deq_t, deq_t.shape[0])
    elif fp8_scales is not None:
        if not b_kmajor or cfg.BK != 128:
            raise ValueError(f"all_gather_matmul launch: fp8-block needs a k-major B and BK 128 (b_kmajor "
                             f"{b_kmajor}, BK {cfg.BK})")
        dq = planning.DequantPlan(1, 1, 1)
        a_desc, b_desc, c_desc = host_descriptors(a_shard, b_store, b_kmajor, c, cfg)
        gather_desc = tma_descriptor(gather, [cfg.BM, cfg.BK])
        a_rows, g_rows = a_shard.view(torch.bfloat16), gather.view(torch.bfloat16)  # bytes as bf16 pairs
        sa, sg, _ = fp8_scales
        mx_args = (a_shard, gather, sa.view(torch.uint8), sg.view(torch.uint8), scale_offset, gather, comp_t, 0)
    else:
        dq = planning.DequantPlan(1, 1, 1)
        a_desc, b_desc, c_desc = host_descriptors(a_shard, b_store, b_kmajor, c, cfg)
        gather_desc = tma_descriptor(gather, [cfg.BM, cfg.BK])
        a_rows, g_rows = a_shard, gather
        mx_args = (a_shard, gather, a_shard, gather, 0, gather, comp_t, 0)
    if fp8_scales is not None:
        sa, sg, sb = fp8_scales
        scale_args = (sa, sg, sb, sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    else:
        scale_args = (epoch_slot, epoch_slot, epoch_slot, 0, 0, 0, 0)
    args = (
        a_rows, a_desc, gather_desc, b_desc, c_desc, c, g_rows, *mx_args, *scale_args,
        peer_data, peer_sig, signals,
        comm_t, comm_t.shape[0], n_push, comp_t, comp_t.shape[0], heads, errors, trace_buf,
        ms, n, k, rank, epoch_slot, max(1, timeout_ns // 1000), fixed,
        planning.ag_comm_stride(ms, cfg.BM, per_task))
    kw = dict(
        WORLD=world, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GRID=grid, POLICY=pol, B_KMAJOR=b_kmajor,
        TRACE=trace is not None, DOT_FP32=planning.interpreting(), COPY_BLOCK=copy_block,
        FLAG_BASE=runtime.FLAG_BASE, DONE_BASE=runtime.DONE_BASE, NUM_HEADS=runtime.NUM_HEADS,
        EXIT_SLOT=runtime.EXIT_SLOT, ADVANCE=bool(advance), A_MX=mx, DEQ_ROWS=dq.ROWS, DEQ_PARTS=dq.PARTS,
        DEQ_NB=dq.NB,
        GROUP_M=planning.GROUP_M, SCALED=fp8_scales is not None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return args, kw


def launch(*a, **k):
    """Launch on explicit buffers, the normal (unplanned) way: ``_launch_args``' docstring."""
    args, kw = _launch_args(*a, **k)
    return _all_gather_matmul_kernel[(kw["GRID"],)](*args, **kw)




def all_gather_matmul(a_shard, b: torch.Tensor, group=None, *,
                      config: AllGatherMatmulConfig | None = None, policy: str = "self",
                      comm_programs: int | None = None, trace: torch.Tensor | None = None,
                      precision: str | None = None):
    """``(a_full, c)`` with ``a_full = allgather(a_shard)`` over ``group`` and ``c = a_full @ b``.

    a_shard [M/W, K] bf16 CUDA, or MXFP8 (a ``kosmos.quant.MXTensor``: payload e4m3fn [M/W, K] + scales uint8
    [M/W, K/32], K a multiple of 32; what moves is the payload and scales, 0.52x of the bf16 bytes); b [K, N]
    bf16 CUDA (row-major, or the ``.t()`` of a row-major [N, K] weight; for MX semantics the weight's MX
    values, ``quant.mx_round``). K and N must be multiples of 8. Returns ``a_full`` [M, K] (an MXTensor for
    MX input) -- a view of the symmetric workspace, valid until the next KOSMOS call on this group
    (``.clone()`` it to keep it) -- and a new ``c`` [M, N] bf16.
    ``config`` (``kosmos.AllGatherMatmulConfig``, default: its defaults) holds the op's knobs.
    ``policy="fixed"`` with ``comm_programs=S`` runs the fixed-role ablation. ``trace`` (int64
    [grid, 1024, 4]) records per-program task events.
    ``precision="mxfp8"`` with a bf16 ``a_shard``: the op quantizes it to MXFP8 itself (quant.quantize_mx's
    rule) and multiplies its MX values; ``a_full`` is then the gathered MX values as bf16 [M, K] (a workspace
    view, as above). At W = 1 on Hopper the quantization runs inside the launch (gemm/w1_mx.py, which also takes
    every W = 1 MXTensor call), except on the shapes of tp_common.w1_mx_pass_first, where one pass makes A's MX
    values (``a_full``, a new tensor) and the bf16 static GEMM multiplies them; elsewhere quant.quantize_mx runs
    first, then the MX path (module docstring: Routes).
    ``precision="fp8-block"`` (or an FP8BlockTensor a_shard or b): block-scaled FP8 on the FP8 tensor cores --
    a_shard bf16 (quantized 1x128 by the op) or an FP8BlockTensor, b an FP8BlockTensor of the [N, K] weight with
    128x128 blocks (quant.quantize_fp8_block(w, 128); a bf16 b is quantized on every call). At W = 1 returns
    (a_shard, c); at W > 1 the payload and scales travel (1 + 4/128 bytes an element, 0.52x of bf16's) and
    a_full is an FP8BlockTensor view of the workspace (``_fp8_block``; tp_common.fp8_block_operands: refusals).
    """
    # the plan of this call signature (core/launch_plan.py); a miss validates and builds it
    first = a_shard[0] if isinstance(a_shard, tuple) and a_shard else a_shard
    ws, key, plan = launch_plan.find("ag", group, (a_shard, b, trace), (config, policy, comm_programs, precision),
                                     getattr(first, "device", None))
    if plan is not None:
        return _replay(plan, ws, a_shard, b, trace)
    if is_fp8_block_call(a_shard, b, precision):
        return _fp8_block(a_shard, b, group, precision, policy, trace, check_config(AllGatherMatmulConfig, config))
    config = check_config(AllGatherMatmulConfig, config)
    quantize = quantize_request("a_shard", a_shard, precision)
    ms, k, n, b_store, b_kmajor = check_operands("a_shard", a_shard, b, policy)
    ws = runtime.get_workspace(group, first.device)
    grid = runtime.num_sms(first.device)
    route = tp_route(ws.world.size, a_shard, quantize, ms, n, k, trace, policy, first.device, grid)
    check_launch(policy, comm_programs, trace, grid)
    a_in = pre_step(a_shard, route.pre)
    if route.kind == W1_MX:
        payload, scales = split_mx(a_in)
        values, c = w1_mx_call(payload, scales, b_store, b_kmajor, ws, key, grid, OP_CODE, quantize)
        return (values if quantize else a_shard), c
    if route.kind == W1_STATIC:
        return _first_call_static(a_shard, a_in, route.pre, b_store, b_kmajor, ws, key, grid, ms, n, k)
    return _first_call_fused(a_shard, a_in, route.pre, b_store, b_kmajor, ws, key, grid, ms, n, k, config,
                             policy, comm_programs, trace)


def _fp8_block(a_shard, b, group, precision, policy, trace, config):
    """precision="fp8-block" (tp_common.fp8_block_operands): at W = 1 the static GEMM's scaled mainloop
    (tp_common.fp8_block_w1; a_full is a_shard), at W > 1 this op's fused kernel -- the E4M3 rows and their
    scales gathered as MX rows are ([payload M*K | scales M*K/32 bytes] in the symmetric buffer), the SCALED
    tiles on planning.FP8_BLOCK_TILE; a_full is then an FP8BlockTensor view of the workspace. No cached plan
    yet: each call validates and launches."""
    a8, b8, dev = fp8_block_operands("a_shard", a_shard, b, precision, policy, trace)
    ws = runtime.get_workspace(group, dev)
    w, r = ws.world.size, ws.world.rank
    if w == 1:
        return a_shard, fp8_block_w1(a8, b8, ws)
    ms, k = a8.payload.shape
    n, m = b8.payload.shape[0], ms * w
    grid, cfg = runtime.num_sms(dev), planning.FP8_BLOCK_TILE
    scale_off = -(-m * k // 16) * 16
    chunks = -(-ms // cfg.BM)
    ws.ensure(scale_off + m * (k // 32), w * chunks)
    runtime.ensure_triton_allocator()
    ws.before_launch()
    gather = ws.data[:m * k].view(torch.float8_e4m3fn).view(m, k)
    gather_scales = ws.data[scale_off:scale_off + m * (k // 32)].view(torch.float32).view(m, k // 128)
    c = torch.empty((m, n), dtype=torch.bfloat16, device=dev)
    args, kw = _launch_args(a8.payload, b8.payload, True, c, gather, ws.peer_data, ws.peer_signals, ws.signals,
                            ws.heads, ws.errors, rank=r, world=w, epoch_slot=ws.epoch_slot,
                            timeout_ns=ws.timeout_ns(), grid=grid, cfg=cfg, config=config, policy=policy,
                            scale_offset=scale_off, fp8_scales=(a8.scales, gather_scales, b8.scales))
    _all_gather_matmul_kernel[(grid,)](*args, **kw)
    ws.after_launch()
    return FP8BlockTensor(gather, gather_scales, 1), c


def _replay(plan, ws, a_shard, b, trace):
    """A plan hit: the route's host step, then the first call's launch with this call's tensors."""
    info = plan.info
    c = torch.empty(info["c_shape"], dtype=torch.bfloat16, device=info["device"])
    a_in = pre_step(a_shard, info["pre"])
    payload, scales = a_in if info["mx"] else (a_in, None)
    plan.call(ws, dict(a=payload, a16=payload.view(torch.bfloat16) if info["mx"] else None, s=scales,
                       b=b.t() if info["b_kmajor"] else b, c=c, trace=trace), (c,), trace is not None)
    return _a_full(info, a_shard, a_in), c


def _a_full(info, a_shard, a_in):
    """What a call returns as ``a_full`` (info["returns"]): the caller's A ("input": W = 1, nothing gathered),
    the host step's result ("pre": A's MX values from PRE_ROUND), the workspace's MX values ("values": the op
    quantized A) or the gathered A ("gathered": W > 1)."""
    returns = info["returns"]
    if returns == "input":
        return a_shard
    if returns == "pre":
        return a_in
    return info["a_values"] if returns == "values" else info["a_full"]


def _first_call_static(a_shard, a_in, pre, b_store, b_kmajor, ws, key, grid, ms, n, k):
    """Route W1_STATIC: the static GEMM on A (or on its MX values from the host step), nothing gathered."""
    ws.ensure(0, -(-ms // planning.tile_config(ms, n, k, world=1, programs=grid).BM))  # the W = 1 sizing of FUSED
    runtime.ensure_triton_allocator()
    ws.before_launch()
    c = torch.empty((ms, n), dtype=torch.bfloat16, device=a_in.device)
    kl = w1_matmul_launch(a_in, b_store, b_kmajor, c, planning.w1_plan(ms, n, k, programs=grid), ws, grid,
                          op=OP_CODE)
    info = dict(c_shape=(ms, n), device=a_in.device, mx=False, b_kmajor=b_kmajor, a_full=None, a_values=None,
                clean=launch_plan.clean_check(ws), pre=pre, returns="pre" if pre == PRE_ROUND else "input")
    return _launch_and_keep(kl, a_shard, a_in, b_store, c, None, ws, key, info)


def _first_call_fused(a_shard, a_in, pre, b_store, b_kmajor, ws, key, grid, ms, n, k, config, policy,
                      comm_programs, trace):
    """Route FUSED: the AllGather+GEMM kernel (any W; MX operands expanded by its DEQ tasks)."""
    w, r = ws.world.size, ws.world.rank
    mx = isinstance(a_in, tuple)
    payload, scales = split_mx(a_in)
    m = ms * w
    cfg = planning.tile_config(ms, n, k, world=w, programs=grid, mx=mx)
    chunks = -(-ms // cfg.BM)  # (not triton.cdiv: a JIT function, ~7 us per host call)
    if mx:  # [gathered payload M*K | scales M*K/32 | dequantized bf16 M*K*2], each 16-byte aligned (W=1: the last)
        scale_off = -(-m * k // 16) * 16 if w > 1 else 0
        deq_off = -(-(scale_off + m * (k // 32)) // 16) * 16 if w > 1 else 0
        data_bytes = deq_off + m * k * 2
        flags = w * chunks * (1 + planning.dequant_plan(cfg, k).PARTS)
    else:
        scale_off = deq_off = 0
        data_bytes = m * k * 2 if w > 1 else 0  # at W=1 nothing is gathered: a_full is a_shard itself
        flags = w * chunks
    ws.ensure(data_bytes, flags)
    runtime.ensure_triton_allocator()
    ws.before_launch()
    if w > 1:
        gather = ws.data[:m * k * (1 if mx else 2)].view(payload.dtype).view(m, k)
        gather_scales = ws.data[scale_off:scale_off + m * (k // 32)].view(m, k // 32) if mx else None
    else:
        gather, gather_scales = payload, scales
    dequantized = ws.data[deq_off:deq_off + m * k * 2].view(torch.bfloat16).view(m, k) if mx else None
    c = torch.empty((m, n), dtype=torch.bfloat16, device=payload.device)
    args, kw = _launch_args(payload, b_store, b_kmajor, c, gather, ws.peer_data, ws.peer_signals, ws.signals,
                            ws.heads, ws.errors, rank=r, world=w, epoch_slot=ws.epoch_slot,
                            timeout_ns=ws.timeout_ns(), grid=grid, cfg=cfg, config=config, policy=policy,
                            comm_programs=comm_programs, trace=trace, a_scales=scales,
                            gather_scales=gather_scales, scale_offset=scale_off, dequantized=dequantized)
    kl = launch_plan.KernelLaunch(_all_gather_matmul_kernel, grid, args, kw)
    a_full = None if w == 1 else (MXTensor(gather, gather_scales) if mx else gather)
    returns = "values" if pre == PRE_QUANTIZE else "input" if w == 1 else "gathered"
    info = dict(c_shape=(m, n), device=payload.device, mx=mx, b_kmajor=b_kmajor, a_full=a_full,
                a_values=dequantized, clean=launch_plan.clean_check(ws), pre=pre, returns=returns)
    return _launch_and_keep(kl, a_shard, a_in, b_store, c, trace, ws, key, info)


def _launch_and_keep(kl, a_shard, a_in, b_store, c, trace, ws, key, info):
    """The first call's launch, after storing its plan under ``key`` (a later call of the signature replays it);
    returns (a_full, c)."""
    payload, scales = split_mx(a_in)
    if key is not None:
        plan = launch_plan.make_plan(kl, dict(a=payload, a16=payload.view(torch.bfloat16) if info["mx"] else None,
                                              s=scales, b=b_store, c=c, trace=trace), ws, info, views=("a16",))
        if plan is not None:
            launch_plan.store(ws, key, plan)
    kl.launch(list(kl.args), outputs=(c,), clean=info["clean"], self_check=trace is None)
    ws.after_launch()
    return _a_full(info, a_shard, a_in), c
