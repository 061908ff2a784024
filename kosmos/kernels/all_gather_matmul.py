"""AllGather+GEMM in one self-scheduling persistent launch.

Math (rank r of W, shard rows Ms = M/W):
    a_full = allgather(a_shard)          a_shard [Ms, K] bf16, a_full [M, K] bf16 (slot s = rank s's rows)
    c      = a_full @ b                  b [K, N] bf16 (this rank's column shard of the weight), c [M, N] bf16
fp32 accumulation; each output element is one dot product over K, so the result does not depend on the
schedule (bitwise deterministic).

Tasks (planning.plan_all_gather_matmul):
  PUSH(peer, chunk)  copy rows [chunk*BM, +BM) of a_shard (one contiguous run) into the peer's gathered
                     buffer, slot r, with pointer stores over NVLink, then notify(peer flag[r, chunk] = epoch).
                     (A task may move several chunks, each flagged as it lands: planning.ag_comm_config.)
  COPY(r, chunk)     same rows into this rank's own slot (only so that ``a_full`` is complete).
  TILE(slot, m, n)   C tile of gathered rows slot*Ms + m*BM; for slot != r it first waits flag[slot, m] >= epoch.
                     Own-slot tiles read a_shard directly and never wait.

Synchronisation contract (signals of rank q; see runtime.py):
  epoch                      the workspace's device slot + 1, read by every program at its start; the last
                             program out stores it back (device.exit_program), so no epoch is a launch
                             argument and a CUDA-graph replay runs at the next one.
  FLAG_BASE + s*chunks + j   written by rank s (release, sys) after pushing chunk j to q; waited by q's tiles.
  DONE_BASE + p              written by rank p's last program when p's launch ends; a rank's first push of a
                             call waits for done[p] >= epoch-1 so it never overwrites rows p is still reading.

Policy (schedule.py's loop; stages in demand order, one queue head each):
  STAGE_PUSH, STAGE_TILE, STAGE_COPY. self -- every program takes a PUSH task while any is unclaimed (they are
            always ready, and the peer consumes them first), then the next compute tile; once the tiles are
            drained it takes the COPY tasks: nothing in the launch waits for them, so they fill the programs
            that run out of tiles while the last tiles finish (wave-quantisation idle time) instead of
            delaying tiles at the start. How many programs communicate at a given moment follows from how
            many comm tasks are left: no split parameter. At W = 1 there are no PUSH or COPY stages, and a
            bf16, untraced call launches common.w1_matmul_kernel instead (the same tiles, mainloop and
            epilogue -- the same bits -- in a static order with the tile x K loop flattened; why and what it
            measured: planning.tile_config's docstring); MXFP8, traced and fixed-role calls keep this kernel.
  fixed  -- programs pid < S take only PUSH then COPY, the others only TILE: the fixed-role baseline.

Deadlock-freedom: a tile waits only on a push of a peer; pushes are claimed before any compute by every
program (self) or by dedicated programs (fixed) and wait only on the previous call's completion; COPY tasks
never wait. The grid is at most the SM count with one program per SM. Every wait is bounded (device.wait_geq).
After a timeout: a wait also gives up at once when any program of the launch has recorded one, and a program
whose wait gave up leaves the loop. Nothing polls the error flag between tasks (that cost one system-scope
atomic per tile), so a program that never waits finishes its tiles; the launch still ends.

MXFP8 at W = 1 (untraced, self policy, Hopper with Triton 3.6): kernels/w1_mx_matmul.py -- a Gluon GEMM whose
  row-pass partition makes A's MX values once (rounded from a bf16 a_shard under ``precision="mxfp8"``, or
  expanded from an MXTensor) while its MMA warps run; 0.943-1.019x of torch.matmul bf16 (its docstring). On
  shapes of few tiles (common.w1_mx_pass_first) one pass makes the values first and the bf16 static GEMM
  (planning.w1_plan) multiplies them. What follows is the path everywhere else (W > 1, traces, fixed roles,
  other GPUs).
MXFP8 (a_shard a kosmos.quant.MXTensor; b the bf16 expansion of an MX weight, quant.mx_round):
    a_full = allgather(payload, scales)  payload [Ms, K] e4m3, scales [Ms, K/32] E8M0: 1 + 1/32 bytes per
                                         element on the wire (0.52x of bf16)
    c      = dequant(a_full) @ b         exact MX products (a dequantized MX value is a bf16), fp32 accumulation
  Dequantize on arrival: PUSH/COPY move payload and scales (the payload's bytes as bf16 pairs, then the scale
  bytes; one flag after both). DEQ(slot, chunk, part) tasks expand 32-row runs into a local bf16 buffer
  [M, K] (for a peer's slot after waiting for its flag) and set a local flag DEQ_BASE + (slot*chunks +
  chunk)*4 + part; a tile waits for its chunk's 4 flags, then runs the bf16 mainloop unchanged (own slot too).
  DEQ is a queue, not a stage of the masks: a TILE program takes a DEQ task instead of a tile while the DEQ
  head is behind what the claimed tiles plus one more wave need (common.deq_lagging), and a tile waiting for
  its rows runs the DEQ tasks it needs itself (common.deq_should_help). Deadlock-free: a DEQ task waits only
  for a peer's push, which waits for nothing in this launch.
  Why this path (one H200, W=1, Triton 3.6, session 8; dev/mx_probe.py, results/h200x1/s8/mx-probe*.jsonl;
  times over the 8 llama3-70b TP=2 per-rank GEMMs at seq 4k/8k, geomean of time / torch.matmul bf16):
    kosmos bf16 1.02-1.03; MX here (dequantize on arrival, MX input) 1.152 (qkv-4k 1.21, fc1-8k 1.09);
    from bf16 input (quantize_mx first) 1.24; dequantize_mx then the bf16 op 1.14-1.15; Triton tl.dot_scaled
    (both operands MX, best of 6 tiles, 128x128x64) 4.2-4.3; cuBLAS FP8 rowwise (torch._scaled_mm, a different
    scaling) 0.61. The bar (<= 1.05) is missed: the expansion runs at ~1.4 TB/s (mx_dequant_rows' record).
  Tried and parked (same probe): the MX tile expanded in the GEMM's load path (E4M3 TMA tile -> bf16 in
  registers -> bf16 MMA): per-element scale bytes 2.5x cuBLAS time (and wrong results in some runs), per-block
  scales broadcast 1.36x, BK = 32 with one scale per tile row 1.73x (correct) -- Triton 3.6 feeds the MMA from
  registers without overlapping it; DEQ tasks all before the first tile (a serial pass): 1.152, the same as
  the lag policy at this expansion rate. FP8 wgmma with per-32 promotion: not built -- a 128x256x32 FP8 MMA
  takes ~280 cycles per SM and rescaling the fp32 partial ~256, so per-32 promotion lands at about bf16 speed.
  Tried and reverted (session 9): DEQ tasks of 8 rows x 64 blocks per step instead of 32 x 16 (bf8b522: all
  programs share the first band's rows; predicted 1.12x of cuBLAS from 1.16x) and, on top, DEQ through TMA
  (f4cf053: 4-D [slots, rows, K/32, 32] boxes, 3-stage tl.range, TMA stores; 45 vs 27 GB/s per program alone
  in dev/deq_probe.py; predicted ~1.09x). Session 9's A/B of them (0.999 each) was void: all its sides ran the
  rows8 + TMA tree (see dev/ab_compare.py). Session 10 (one H200, Triton 3.6, mxfp8 kosmos rows, the 12
  llama3-70b TP=2 per-rank GEMMs at W=1, results/h200x1/s10/a/): that tree (d24f136) takes 1.184x the time of
  the committed kernel (66a569a); HEAD (the reverts) 1.002x of 66a569a, 1.16x torch.matmul bf16. So the two
  changes together made DEQ slower (the TMA variant also failed to compile at bf16 on Triton 3.6: the DEQ call
  sits under a runtime branch); 8-row tasks alone were never measured.

Measured (dated; detail and every earlier figure: docs/archive/session-diary-1-6.md, the session named):
  W=1 (communication off), 1x H200, 909b6c9, Triton 3.6, 2026-12-01 (session 6), against torch.matmul alone
  (the rows' t_gemm_ms / time_ms; results/h200x1/tp-bf16-w1-shard2.jsonl): llama3-70b TP=2 per-rank GEMMs qkv
  0.971 / 0.975 / 0.903 (seq 4k / 8k / 16k), fc1 0.984-1.000; llama3-8b qkv 0.951-0.960, fc1 0.954-0.970;
  unsharded TP=1 (tp-bf16-w1.jsonl) qkv 0.967-0.981, fc1 0.978-1.015. (Session 6 reported qkv 1.044-1.068
  "vs cuBLAS": that was against the nccl+cublas row, which at W=1 still copies for the all-gather. The
  AG rows' cuBLAS time multiplied an uninitialised buffer (fixed in session 7, 1e83152; not re-measured).) W=1 takes no data workspace since 909b6c9 (1 MiB floor; was 256 MiB).
  Two GPUs, last run: 2x H200, 75b681f, Triton 3.6, 2026-11-29 (session 3, results/h200x2/tp-bf16.jsonl):
  AG shapes vs nccl+cublas, geomean llama3-70b 1.050 (0.966-1.152; torch-async-tp 1.110, fixed-role-best
  1.039), llama3-8b 1.095. Everything below from session 4 on is unmeasured at W=2.
  Where W=2 time went (qkv-70b-8k trace, session-3 code; re-read in session 5): compute 87%, comm 9.2%, waits
  0.6%, idle at the end 2.4% of programs x span; 32 PUSH tasks 7.4 ms and 32 own-slot COPY tasks 5.1 ms of
  SM time. Since then (1x H200, session 4): COPY tasks after the tiles (004227d), copy step 4096 -> 16384
  elements (one program 36 -> 89 GB/s); predicted qkv-70b-8k 1.030 -> ~0.99 ms at W=2.
  Host-built TMA descriptors (82006a1, 1x H200, session 5): W=1 AG shapes 1.2-3.2% faster, one-tile call
  11.3 -> 8.8 us. At W>1 each tile picks one of two host descriptors (6378aee): simulated ranks only, 2.37 /
  2.20 ms vs 2.74 / 2.37 median (not a two-GPU timing).
  Registers (Triton 3.6, sm_90): 190 at W=2, 197 at W=8, no spills, 144 KiB shared memory (6378aee; 181 at
  session 4's code). Simulated ranks W = 2, 3, 4, 8 pass on 1x H200 (sessions 5-6).
Tried and parked:
  A device-built A descriptor per tile (the v0.1-v0.4 design): cost AG shapes 1.2-3.2% at W=1 (session 5).
  Two GEMM loops (own slot, gathered) instead of one descriptor: 295 KB shared memory > 227 KB (v0.1).
  Pushes as 128x64 tiles: 254 regs + 176 B spills; flat 4096-element runs: 196, none (v0.2).
  int32 pointer advance in copy_flat: same speed, 14-30 more registers; back to int64 indices (session 4).
  TMA [R, 256] load->store copies: 30 / 45 / 62 GB/s at R = 32 / 64 / 128, no better (session 4).
  Claim-ahead (next tile claimed during the mainloop): AG shapes 0.3-0.9% slower at W=1, 192 -> 203 regs
  (session 6). Queued for two GPUs, unmeasured: push_chunks 1 / auto / 4 (NOTES.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import device as dev
from .. import launch_plan, planning, runtime
from .. import schedule as sched
from ..codes import EV_COMM, EV_COMPUTE, EV_WAIT, OP_ALL_GATHER_MATMUL, WAIT_AG_ROWS, WAIT_MX_ROWS
from ..config import AllGatherMatmulConfig, check_config
from ..quant import MXTensor, quantize_mx
from .common import (check_launch, check_operands, copy_flat, deq_lagging, deq_needed, deq_should_help,
                     host_descriptors, load_task, mx_dequant_rows, policy_args, quantize_request, store_tile,
                     tile_matmul, tma_descriptor, w1_matmul_launch, w1_mx_gluon, w1_mx_pass_first,
                     mx_values_first, wait_rows_dequantized)
from .w1_mx_matmul import w1_mx_call

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
        peer_data, peer_sig, sig_ptr,
        comm_table, n_comm, n_push, comp_table, n_comp,
        heads_ptr, err_ptr, trace_ptr,
        Ms, N, K, rank, epoch_ptr, timeout_us, fixed_comm, comm_stride,
        WORLD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GRID: tl.constexpr,
        POLICY: tl.constexpr, B_KMAJOR: tl.constexpr, TRACE: tl.constexpr, DOT_FP32: tl.constexpr,
        COPY_BLOCK: tl.constexpr, FLAG_BASE: tl.constexpr, DONE_BASE: tl.constexpr, NUM_HEADS: tl.constexpr,
        EXIT_SLOT: tl.constexpr, ADVANCE: tl.constexpr, A_MX: tl.constexpr, DEQ_ROWS: tl.constexpr,
        DEQ_PARTS: tl.constexpr,
        DEQ_NB: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    # the timeout travels in microseconds: always an i32 argument, so set_timeout never triggers a
    # recompile (with ns, 5 s was i64 and 0.5 s i32: the recompile's host time once hid a stalled peer)
    timeout_ns = tl.cast(timeout_us, tl.int64) * 1000
    epoch = dev.call_epoch(epoch_ptr)  # this call's epoch, from the device slot (runtime.py: Epochs)
    n_chunks = tl.cdiv(Ms, BM)
    if A_MX:  # rows move as E4M3 payload (a_ptr / gather_ptr are its bytes read as bf16 pairs) + E8M0 scales
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
                # buffers), fed by one of two host-built descriptors picked per tile (device-built ones
                # cost every tile ~1-3% at W=1: session 5). Rows past a remote slot read the next
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
                        if A_MX:
                            s_off = (rank * Ms + chunk * BM).to(tl.int64) * (K // 32)
                            copy_flat(a_scales + chunk.to(tl.int64) * BM * (K // 32),
                                      dev.peer_ptr(peer_data, peer, tl.uint8) + scale_off + s_off,
                                      rows * (K // 32), COPY_BLOCK)
                        sig = dev.peer_ptr(peer_sig, peer, tl.int32)
                        dev.notify(sig + FLAG_BASE + rank * n_chunks + chunk, epoch)
                    else:
                        copy_flat(src, gather_ptr + dst_row, rows * row_elems, COPY_BLOCK)
                        if A_MX:
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
           a_scales=None, gather_scales=None, scale_offset=0, dequantized=None, advance=True):
    """The kernel's runtime arguments and constexpr / option keywords of ``launch`` (also a plan's template).
    Launch on explicit buffers (the public op builds them from the workspace; CPU tests build their own).
    Here a fixed split may be 0 or grid (one role only), which CPU tests use to order ranks' phases.
    ``epoch_slot`` (int32 [1], local): the device epoch; the launch runs at slot + 1 and advances it
    (``advance=False``: not -- a CPU test's first launch of a call split in two, like its fixed-role phases).
    MXFP8: a_shard / gather are E4M3 payloads, a_scales / gather_scales their E8M0 bytes, a peer's gathered
    scales start ``scale_offset`` bytes into its data buffer (after the [M, K] payload), and ``dequantized``
    (bf16 [M, K], local) receives every slot's expanded rows, which the tiles multiply."""
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
    else:
        dq = planning.DequantPlan(1, 1, 1)
        a_desc, b_desc, c_desc = host_descriptors(a_shard, b_store, b_kmajor, c, cfg)
        gather_desc = tma_descriptor(gather, [cfg.BM, cfg.BK])
        a_rows, g_rows = a_shard, gather
        mx_args = (a_shard, gather, a_shard, gather, 0, gather, comp_t, 0)
    args = (
        a_rows, a_desc, gather_desc, b_desc, c_desc, c, g_rows, *mx_args,
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
        GROUP_M=planning.GROUP_M,
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
    view, as above). At W = 1 on Hopper the quantization runs inside the launch (kernels/w1_mx_matmul.py, which
    also takes every W = 1 MXTensor call), except on the shapes of common.w1_mx_pass_first, where one pass makes
    A's MX values (``a_full``, a new tensor) and the bf16 static GEMM multiplies them; elsewhere
    quant.quantize_mx runs first, then the MX path.
    """
    # the plan of this call signature (kosmos/launch_plan.py); a miss validates and builds it
    first = a_shard[0] if isinstance(a_shard, tuple) and a_shard else a_shard
    ws, key, plan = launch_plan.find("ag", group, (a_shard, b, trace), (config, policy, comm_programs, precision),
                                     getattr(first, "device", None))
    if plan is not None:
        info = plan.info
        c = torch.empty(info["c_shape"], dtype=torch.bfloat16, device=info["device"])
        pre = info["quantize"]
        if pre == "first":
            a_in = quantize_mx(a_shard)
        elif pre in ("round", "expand"):  # w1_mx_pass_first's path: A's MX values, then the bf16 static GEMM
            a_in = mx_values_first(a_shard, pre == "round")
        else:
            a_in = a_shard
        payload, scales = a_in if info["mx"] else (a_in, None)
        plan.call(ws, dict(a=payload, a16=payload.view(torch.bfloat16) if info["mx"] else None, s=scales,
                           b=b.t() if info["b_kmajor"] else b, c=c, trace=trace), (c,), trace is not None)
        if pre in ("round", "expand"):
            return (a_in if pre == "round" else a_shard), c
        if pre:
            return info["a_values"], c
        return (a_in if info["a_full"] is None else info["a_full"]), c
    config = check_config(AllGatherMatmulConfig, config)
    quantize = quantize_request("a_shard", a_shard, precision)
    ms, k, n, b_store, b_kmajor = check_operands("a_shard", a_shard, b, policy)
    device = first.device
    ws = runtime.get_workspace(group, device)
    w, r = ws.world.size, ws.world.rank
    gluon = (quantize or isinstance(a_shard, tuple)) and w1_mx_gluon(w, trace, policy, device)
    grid = runtime.num_sms(device)
    pre, mx_input = None, a_shard
    if gluon and w1_mx_pass_first(ms, n, k, grid):  # A's MX values by one pass, then the bf16 static GEMM
        pre = "round" if quantize else "expand"
        a_shard = mx_values_first(a_shard, quantize)
        gluon = quantize = False
    if quantize and not gluon:  # quantized first, then the MX path (the values: its dequantized rows)
        a_shard = quantize_mx(a_shard)
    mx = isinstance(a_shard, tuple)
    payload, scales = a_shard if mx else (a_shard, None)
    m = ms * w
    cfg = planning.tile_config(ms, n, k, world=w, programs=grid, mx=mx)
    check_launch(policy, comm_programs, trace, grid)
    chunks = -(-ms // cfg.BM)  # (not triton.cdiv: a JIT function, ~7 us per host call)
    if gluon:
        values, c = w1_mx_call(payload, scales, b_store, b_kmajor, ws, key, grid, OP_ALL_GATHER_MATMUL.value,
                               quantize)
        return (values if quantize else a_shard), c
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
    c = torch.empty((m, n), dtype=torch.bfloat16, device=device)
    if w == 1 and not mx and trace is None and policy == "self":  # nothing to gather or wait for: the static GEMM
        w1 = planning.w1_plan(ms, n, k, programs=grid)
        kl = w1_matmul_launch(payload, b_store, b_kmajor, c, w1, ws, grid, op=OP_ALL_GATHER_MATMUL.value)
    else:
        args, kw = _launch_args(payload, b_store, b_kmajor, c, gather, ws.peer_data, ws.peer_signals, ws.signals,
                                ws.heads, ws.errors, rank=r, world=w, epoch_slot=ws.epoch_slot,
                                timeout_ns=ws.timeout_ns(), grid=grid, cfg=cfg, config=config, policy=policy,
                                comm_programs=comm_programs, trace=trace, a_scales=scales,
                                gather_scales=gather_scales, scale_offset=scale_off, dequantized=dequantized)
        kl = launch_plan.KernelLaunch(_all_gather_matmul_kernel, grid, args, kw)
    a_full = None if w == 1 else (MXTensor(gather, gather_scales) if mx else gather)
    info = dict(c_shape=(m, n), device=device, mx=mx, b_kmajor=b_kmajor, a_full=a_full,
                clean=launch_plan.clean_check(ws), quantize="first" if quantize else pre, a_values=dequantized)
    if key is not None:
        plan = launch_plan.make_plan(kl, dict(a=payload, a16=payload.view(torch.bfloat16) if mx else None,
                                              s=scales, b=b_store, c=c, trace=trace), ws, info, views=("a16",))
        if plan is not None:
            launch_plan.store(ws, key, plan)
    kl.launch(list(kl.args), outputs=(c,), clean=info["clean"], self_check=trace is None)
    ws.after_launch()
    if quantize:
        return dequantized, c
    if w == 1:
        return (mx_input if pre == "expand" else a_shard), c
    return (MXTensor(gather, gather_scales) if mx else gather), c

