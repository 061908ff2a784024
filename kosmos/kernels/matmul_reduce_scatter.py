"""GEMM+ReduceScatter in one self-scheduling persistent launch.

Math (rank r of W, M rows, Ms = M/W rows per owner):
    P_r     = a_r @ b_r                           a [M, K/W] bf16, b [K/W, N] bf16 (this rank's row shard)
    c_shard = sum_{s=0..W-1} P_s[r*Ms:(r+1)*Ms]   [Ms, N] bf16
Each partial tile is rounded to bf16 once (as NCCL's bf16 reduce-scatter does) and the W partials are summed
in fp32 in rank order 0..W-1, so two runs give bitwise-identical results and no float atomics are used.

Tasks (planning.plan_matmul_reduce_scatter):
  TILE(owner, m, n)  partial tile of the owner's rows, stored (bf16, pointer stores, local HBM) into this
                     rank's staging buffer (the symmetric workspace viewed as [M, N]) and published with
                     notify(owner flag[r, tile] = epoch) -- a single remote atomic, no bulk remote stores.
  REDUCE(m, n)       one of this rank's own tiles: wait flag[s, tile] >= epoch for every s, then read the W
                     partials straight from the ranks' staging buffers over NVLink (pull), sum in rank order,
                     store c_shard. Owners are staggered (rank r makes tile i for r+1, r+2, ..., r), so the W
                     partials of a tile appear at about the same time on every rank.
  ``MatmulReduceScatterConfig(push_partials=True)``: TILE stores into slot r of the owner's staging (viewed as
  [W, Ms, N]; remote stores, then the same notify) and REDUCE reads its W slots from local memory.

Synchronisation contract (signals of rank q; the epoch is the workspace's device slot + 1, read by every
program at its start and advanced by the last one out: runtime.py, Epochs):
  FLAG_BASE + s*T + t   written by rank s when its partial of q's tile t is in s's staging; waited by q.
  DONE_BASE + p         rank p's launch has ended; the first staging write of a call waits for every
                        done[p] >= epoch-1, because p may still be pulling last call's partials.

MXFP8 (a a kosmos.quant.MXTensor [M, K/W]; b the bf16 expansion of an MX weight): the partials and the
reduction are bf16/fp32 as below; nothing MX travels. a's rows are expanded to bf16 by DEQ tasks (32 rows
each, local flags after the partial flags), taken by the TILE programs ahead of demand and while a tile waits
for its rows -- the same policy as AllGather+GEMM's (its docstring has the measurements: W=1, one H200, the MX
op at 1.15x of torch.matmul bf16 geomean over the 8 per-rank GEMMs of seq 4k/8k). At W = 1 (untraced, self policy,
Hopper with Triton 3.6) an MX call -- an MXTensor, or a bf16 ``a`` with ``precision="mxfp8"`` -- runs
kernels/w1_mx_matmul.py instead (nothing to reduce: c = mx(a) @ b; 0.943-1.019x of torch.matmul bf16, session 23).

Policy (schedule.py: stages STAGE_TILE then STAGE_REDUCE, the reduce tasks owned, ready-first):
  self   -- reduce task t belongs to program t % GRID (no shared reduce head, no CAS). Before each compute
            tile a program looks at its own next reduce task; if that task's inputs are all ready it runs
            it, else it computes (compute tiles come from the shared fetch-add queue, so programs that
            reduce more compute less). When the compute queue is empty it runs its remaining reduce tasks,
            waiting for each. Communication (the pulls) therefore runs as soon as its data exists and the
            program owning it reaches a tile boundary -- no split parameter. (v0.2 claimed the shared head
            with one CAS and fell behind; v0.3 retried the CAS while the head was ready: ~130 programs
            spun on one word after every compute wave and compute ran at half rate: "v0.3 measured" in
            docs/archive/session-diary-1-6.md.)
  fixed  -- programs pid < S only reduce (in queue order, waiting), the others only compute.

Deadlock-freedom: compute tiles never wait (except on the previous call's completion); a reduce task is
run early only when its inputs are already there, so every waiting program waits on compute tiles that
running programs (or peers) have claimed or will claim. After a timeout: every wait gives up at once once
any program of the launch has recorded one, and a program whose wait gave up leaves the loop; nothing polls
the error flag between tasks (one system-scope atomic per tile), so a program that never waits just
finishes its compute tiles.

W = 1: the compute tiles store straight into c_shard; there are no reduce tasks. A bf16, untraced,
self-policy call at W = 1 launches common.w1_matmul_kernel instead (the same tiles, mainloop and epilogue --
the same bits -- in a static order with the tile x K loop flattened; planning.tile_config's docstring has why
and what it measured); MXFP8, traced and fixed-role calls keep this kernel.

Measured (dated; detail and every earlier figure: docs/archive/session-diary-1-6.md, the session named):
  W=1 (communication off), 1x H200, 909b6c9, Triton 3.6, 2026-12-01 (session 6), against torch.matmul alone
  (t_gemm_ms / time_ms; results/h200x1/tp-bf16-w1-shard2.jsonl): llama3-70b TP=2 per-rank attn_out 0.952 /
  0.982 / 0.992 (seq 4k / 8k / 16k; 4k in five runs 0.9496-0.9523 against nccl+cublas: on the 95% line), fc2
  0.977 / 0.996 / 1.025; llama3-8b attn_out (K=2048) 0.919-0.944, fc2 0.958-0.982; TP=1 (tp-bf16-w1.jsonl)
  attn_out 0.977-1.005, fc2 0.981-1.019.
  Reduce path compiled out at W=1 (3667b58): 255 regs + 24 B spills -> 208, none; 12 RS GEMMs geomean 0.995 of
  before. W=1 takes no data workspace since 909b6c9. Host time at W=1, 4096x2048x4096: 99.7 us per call (GPU 105).
  Two GPUs, last run: 2x H200, 75b681f, Triton 3.6, 2026-11-29 (session 3, results/h200x2/tp-bf16.jsonl):
  RS shapes vs nccl+cublas, geomean llama3-70b 1.052 (0.998-1.122; torch-async-tp 1.112, fixed-role-best
  1.030), llama3-8b 1.043. Sessions 4-6's changes (host descriptors, no per-task error atomic, reduce tile
  loaded once) are unmeasured at W=2. attn_out-70b-8k trace at that code (v0.4): span 888 / 916 us (rank 0 /
  1), reduce 15.1-15.6 us median, gap between tiles 1.9 us; compute 78.6 / 76.9%, comm 13.8 / 14.2%, gaps
  4.4%, idle at the end 3.2 / 4.5% of programs x span.
  Registers (Triton 3.6): W=2 253-254, no spills; W=8 239, none (86d5acd; was 255 + 238 B); W=1 208, none.
Tried and parked:
  v0.1-v0.2 shared reduce head (readiness peek + one CAS): reduces bunched at the end, ~150 us tail at
  attn_out-70b-8k. v0.3 CAS retried while the head was ready: every RS shape 1.1-2.2x slower
  (attn_out-70b-8k 0.982 -> 1.805 ms). A volatile-load peek (v0.1): threads diverged and hung.
  all_geq readiness in one parallel read (9f74e11, reverted in 725c67f; simulated ranks on 1x H200): W=2
  2.8-3.0% slower with 18 B spills, W=4 0 / -3.6%, W=8 -3.4 / -2.7% (may pay at W >= 4).
  Claim-ahead (session 6): RS shapes 1.1-4.2% slower at W=1, spills 24 -> 34 B.
  64-row reduce steps (2x H200, session 3): attn_out -1.4 / +1.7 / -2.1%, fc2 -1.0 / -1.3 / +1.4%: noise;
  255 regs + 176 B spills (128 rows: 2.6 KB). Software-pipelined reduce steps (tl.range num_stages=2):
  Triton 3.9 emits the same code (no tl.dot consumer), CPU compile only (session 6).
  Reduce bookkeeping under a runtime `if WORLD > 1:` (session 5, CPU compile, Triton 3.9): stack 784 -> 536 B,
  shared memory 144 -> 176 KiB; the constexpr W=1 branch replaced it. Queued for two GPUs, unmeasured:
  push_partials (predicted attn_out-70b-8k -6%, fc2 -2%; a cruder push design in DESIGN.md measured 1.072 ms
  there against this pull's 0.949 at attn_out-70b-8k in the 75b681f run).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import device as dev
from .. import launch_plan, planning, runtime
from .. import schedule as sched
from ..codes import EV_COMM, EV_COMPUTE, EV_WAIT, OP_MATMUL_REDUCE_SCATTER, WAIT_MX_ROWS, WAIT_RS_PARTIAL
from ..config import MatmulReduceScatterConfig, check_config, default_config
from ..quant import quantize_mx
from .common import (check_launch, check_operands, deq_lagging, deq_needed, deq_should_help, host_descriptors,
                     load_task, mx_dequant_rows, policy_args, quantize_request, store_rows, store_tile,
                     tile_matmul, w1_matmul_launch, w1_mx_gluon, w1_mx_pass_first, mx_values_first,
                     wait_rows_dequantized)
from .w1_mx_matmul import w1_mx_call

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
        GROUP_M: tl.constexpr):
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
        if WORLD == 1:  # no reduce tasks: with this branch gone, t_red stays the literal -1 and the whole
            pass        # reduce path compiles out: 255 registers + 24 B spills -> 208, none; W=1 RS -0.5%
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
    (BN * W) (a power of two) keeps the bytes in flight -- and the registers -- the same at every world size:
    32 rows at W=2 and BN 256 (245 registers, no spills, Triton 3.6). A fixed 32 rows spilled 238 B at W=8
    (the 8 loads of a step are all issued before the adds). 64 rows at W=2 (255 registers, 176 B spills)
    measured within noise of 32 on 2x H200 (NOTES.md, moe v0.3 table)."""
    rows = max(1, 16384 // (cfg.BN * max(1, world)))
    return max(1, min(cfg.BM, 1 << (rows.bit_length() - 1)))


def _launch_args(a, b_store, b_kmajor, c, stage, peer_data, peer_sig, signals, heads, errors, *, rank, world, epoch_slot,
           timeout_ns, grid, cfg, config=None, policy="self", comm_programs=None, trace=None, a_scales=None,
           dequantized=None, advance=True):
    """The kernel's runtime arguments and constexpr / option keywords of ``launch`` (also a plan's template).
    Launch on explicit buffers (the public op builds them from the workspace; CPU tests build their own).
    Here a fixed split may be 0 or grid (one role only), which CPU tests use to order ranks' phases.
    ``epoch_slot`` (int32 [1], local): the device epoch; the launch runs at slot + 1 and advances it
    (``advance=False``: not -- a CPU test's first launch of a call split in two, like its fixed-role phases).
    MXFP8: ``a`` is the E4M3 payload, ``a_scales`` its E8M0 bytes and ``dequantized`` (bf16 [M, K], local)
    receives its expanded rows, which the tiles multiply."""
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
    args = (
        a_desc, b_desc, c_desc, c, stage, *mx_args, peer_data, peer_sig, signals,
        comp_t, comp_t.shape[0], red_t, red_t.shape[0], heads, errors, trace_buf,
        ms, n, k, rank, epoch_slot, max(1, timeout_ns // 1000), fixed)
    kw = dict(
        WORLD=world, BM=cfg.BM, BN=cfg.BN, BK=cfg.BK, GRID=grid, POLICY=pol, B_KMAJOR=b_kmajor,
        TRACE=trace is not None, DOT_FP32=planning.interpreting(), RED_ROWS=_red_rows(cfg, world), PUSH=config.push_partials,
        FLAG_BASE=runtime.FLAG_BASE, DONE_BASE=runtime.DONE_BASE, NUM_HEADS=runtime.NUM_HEADS,
        EXIT_SLOT=runtime.EXIT_SLOT, ADVANCE=bool(advance), A_MX=mx, DEQ_ROWS=dq.ROWS, DEQ_PARTS=dq.PARTS,
        DEQ_NB=dq.NB, GROUP_M=planning.GROUP_M,
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
    the GEMM expands it in its load path; the partials and the reduction stay bf16 / fp32); b [K/W, N] bf16
    CUDA (row-major, or the ``.t()`` of a row-major [N, K/W] weight; for MX semantics ``quant.mx_round`` of
    it). K/W and N must be multiples of 8. Returns a new [M/W, N] bf16 tensor.
    ``config`` (``kosmos.MatmulReduceScatterConfig``, default: its defaults) holds the op's knobs.
    ``policy="fixed"`` with ``comm_programs=S`` runs the fixed-role ablation; ``trace`` as in
    ``all_gather_matmul``. ``precision="mxfp8"`` with a bf16 ``a``: the op quantizes it to MXFP8 itself and
    multiplies its MX values -- inside the launch at W = 1 on Hopper (kernels/w1_mx_matmul.py, which also takes
    every W = 1 MXTensor call; on common.w1_mx_pass_first's shapes one pass makes the values first, then the bf16
    static GEMM), else quant.quantize_mx first.
    """
    # the plan of this call signature (kosmos/launch_plan.py); a miss validates and builds it
    first = a[0] if isinstance(a, tuple) and a else a
    ws, key, plan = launch_plan.find("rs", group, (a, b, trace), (config, policy, comm_programs, precision),
                                     getattr(first, "device", None))
    if plan is not None:
        info = plan.info
        c = torch.empty(info["c_shape"], dtype=torch.bfloat16, device=info["device"])
        if info["quantize"] == "first":
            a = quantize_mx(a)
        elif info["quantize"] in ("round", "expand"):  # w1_mx_pass_first's path
            a = mx_values_first(a, info["quantize"] == "round")
        payload, scales = a if info["mx"] else (a, None)
        plan.call(ws, dict(a=payload, s=scales, b=b.t() if info["b_kmajor"] else b, c=c, trace=trace), (c,),
                  trace is not None)
        return c
    config = check_config(MatmulReduceScatterConfig, config)
    quantize = quantize_request("a", a, precision)
    m, k, n, b_store, b_kmajor = check_operands("a", a, b, policy)
    ws = runtime.get_workspace(group, first.device)
    w, r = ws.world.size, ws.world.rank
    if m % w:
        raise ValueError(f"M={m} rows of a must divide by the world size {w}")
    gluon = (quantize or isinstance(a, tuple)) and w1_mx_gluon(w, trace, policy, first.device)
    grid = runtime.num_sms(first.device)
    pre = None
    if gluon and w1_mx_pass_first(m, n, k, grid):  # A's MX values by one pass, then the bf16 static GEMM
        pre = "round" if quantize else "expand"
        a = mx_values_first(a, quantize)
        gluon = quantize = False
    if quantize and not gluon:  # quantized first, then the MX path
        a = quantize_mx(a)
    a, a_scales = a if isinstance(a, tuple) else (a, None)
    ms = m // w
    if gluon:  # at W = 1 there is nothing to reduce: c = mx(a) @ b
        return w1_mx_call(a, a_scales, b_store, b_kmajor, ws, key, grid, OP_MATMUL_REDUCE_SCATTER.value,
                          quantize)[1]
    cfg = planning.tile_config(ms, n, k, world=w, programs=grid, mx=a_scales is not None)
    check_launch(policy, comm_programs, trace, grid)
    stage_bytes = m * n * 2 if w > 1 else 0  # at W=1 the tiles go straight into c_shard: no staging
    flags = w * -(-ms // cfg.BM) * -(-n // cfg.BN)  # (triton.cdiv costs ~7 us per host call)
    if a_scales is not None:  # MXFP8: a's dequantized rows after the staging; one flag per DEQ task
        flags += w * -(-ms // cfg.BM) * planning.dequant_plan(cfg, k).PARTS
    deq_off = -(-stage_bytes // 16) * 16
    ws.ensure(deq_off + (m * k * 2 if a_scales is not None else 0), flags)
    runtime.ensure_triton_allocator()
    ws.before_launch()
    c = torch.empty((ms, n), dtype=torch.bfloat16, device=a.device)
    stage = ws.data[:stage_bytes].view(torch.bfloat16).view(m, n) if w > 1 else c
    dequantized = (ws.data[deq_off:deq_off + m * k * 2].view(torch.bfloat16).view(m, k)
                   if a_scales is not None else None)
    if w == 1 and a_scales is None and trace is None and policy == "self":  # nothing to wait for: the static GEMM
        w1 = planning.w1_plan(ms, n, k, programs=grid)
        kl = w1_matmul_launch(a, b_store, b_kmajor, c, w1, ws, grid, op=OP_MATMUL_REDUCE_SCATTER.value)
    else:
        args, kw = _launch_args(a, b_store, b_kmajor, c, stage, ws.peer_data, ws.peer_signals, ws.signals,
                                ws.heads, ws.errors, rank=r, world=w, epoch_slot=ws.epoch_slot,
                                timeout_ns=ws.timeout_ns(), grid=grid, cfg=cfg, config=config, policy=policy,
                                comm_programs=comm_programs, trace=trace, a_scales=a_scales, dequantized=dequantized)
        kl = launch_plan.KernelLaunch(_matmul_reduce_scatter_kernel, grid, args, kw)
    info = dict(c_shape=(ms, n), device=a.device, mx=a_scales is not None, b_kmajor=b_kmajor,
                clean=launch_plan.clean_check(ws), quantize="first" if quantize else pre)
    if key is not None:
        plan = launch_plan.make_plan(kl, dict(a=a, s=a_scales, b=b_store, c=c, trace=trace), ws, info)
        if plan is not None:
            launch_plan.store(ws, key, plan)
    kl.launch(list(kl.args), outputs=(c,), clean=info["clean"], self_check=trace is None)
    ws.after_launch()
    return c

