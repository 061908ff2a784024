"""The MoE layer's backward in ONE persistent launch (``_moe_backward_experts_kernel``): at EP = 1 the expert part
and the router backward (``expert_backward_one_launch``); over an EP group of W > 1 ranks the whole backward but the
logits GEMM, its exchanges included (``expert_backward_ep_launch``). ``moe_backward`` (api.py) takes this path by
default (``MoEBackwardConfig.one_launch`` / ``one_launch_ep``); the multi-launch path (multi_launch.py) is its twin.

What it computes. Expert rows in the padded layout (layout.py: expert e's rows from pad_offs[e], a multiple of 64,
the gap rows up to the next multiple zero), R_pad rows, E experts on this rank, T tokens, top-k:
  in       dy_rows, do_rows = bf16(w * dy_rows), x_rows [R_pad, H] bf16; gu = [g | u] [R_pad, 2F] bf16 (W = 1:
           the forward's or recomputed before the launch; W > 1: the GU stage); w_pair [R_pad] fp32, valid [R_pad];
           w13 [E, H, 2F], w2 [E, F, H] bf16; inv [T*k]: each pair p = t*k + j's row. (W > 1: x, dy [T, H] and
           the decision instead: COMBINE-BWD and PERMUTE-BWD build the rows.)
  between  z = dy_rows W2[e]^T [R_pad, F], [dg | du] [R_pad, 2F], h = silu(g) u [R_pad, F], dx_rows [R_pad, H]
           bf16; dw_rows [R_pad] fp32 (the rows' gate gradients <z, h>), all in HBM.
  out      dW2[e] = h^T do, dW13[e] = x_rows^T [dg | du] (bf16 or fp32: fp32 accumulation rounded once);
           dx_e [T, H] fp32 (each token's k dx rows summed in slot order); with the router (router.RouterBackward)
           dx = bf16(dx_e + dl Wr) [T, H] and d_router = dl^T x [router experts, H] fp32 instead of dx_e.

Stages, in drain order (the code's order). Each is a queue of tasks claimed from one atomic head (schedule.claim)
in local scratch, except WGRAD; each task runs the standalone kernels' tile function (tiles.py) at their tiles.
"waits" are device.wait_geq on int32 counters (bounded); "raises" are atomic adds with release semantics.
  COMBINE-BWD(b)    W > 1 (exchange.py): this rank's tokens [b*XB, +XB) to every rank holding one of their experts:
                    metadata, gate weights, x and dy rows at the receiver's row [rank * T + t]. Waits once per
                    program for every peer's done flag >= epoch - 1 (the previous call's reads are over). The last
                    task publishes this rank's pair counts and raises the receiver's flag FLAG_BASE + rank = epoch.
  plan              W > 1: waits for every source's flag = epoch; one CAS-elected program builds counts, pad_offs,
                    first_mtile and base[s, e] (rows of e from sources < s); the others wait for it (WAIT_BWD_PLAN).
  PERMUTE-BWD(p)    W > 1: expert p's gap rows zeroed (p < E), else received rows placed at pad_offs[e] + base[s, e]
                    + place (x, dy, do, w, valid, (source, pair)); raises placed[e] per row and per gap task.
  GU(gm, n)         W > 1: [g | u] = x_rows W13[e] (_dgrad1_tile, B_KN); waits placed[e] = counts[e] + 1; raises
                    gu_done[gm].
  DGRAD2(gm, n)     z for global m-tile gm, F-tile n (task gm * ceil(F/BN) + n: m-tile-major); W > 1 waits placed[e];
                    raises dgrad2_done[gm] (acq_rel).
  SWIGLU(gm)        _bwd_swiglu_mtile: [dg | du], h and dw_rows over the m-tile's rows up to its expert's padded end
                    (gap rows get zeros; z's unwritten gap rows read as zeros through valid).
                    config.swiglu_on_completion: run inside the DGRAD2 task whose atomic saw the m-tile's last tile
                    (no wait but the acquire); else its own queue, waiting dgrad2_done[gm] = ceil(F/BN). W > 1 also
                    waits gu_done[gm] = ceil(2F/BN). Raises swiglu_done[gm] and the SwiGLU count SCB_SWIGLU_DONE.
  DGRAD1(gm, n)     dx_rows = [dg | du] W13[e]^T; waits swiglu_done[gm] (config.dgrad1_lean at W = 1: only until the
                    SwiGLU count is seen complete, gpu-scope acquire). Raises the DGRAD1 count SCB_DGRAD1_DONE (lean:
                    once per program, after its last tile) or, at W > 1, dg1_done[gm].
  DISPATCH-BWD(gm)  W > 1: waits dg1_done[gm] = ceil(H/BN); each row's dx (bf16) and gate gradient (fp32) into its
                    token's rank's combine rows [t*k + j]; raises that rank's counter of the token's UNPERMUTE block
                    (release, system scope).
  ROUTER_DL(b)      W = 1 here (router.py): waits once per program for the SwiGLU count = every m-tile; dl of tokens
                    [b*RUT, +RUT), stored as bf16 hi | lo; raises the dlogits count SCB_ROUTER_DL_DONE.
  WGRAD             no queue: waits once for the SwiGLU count, then each program's share of the flat loop for dW2,
                    then for dW13 (tile g is program g % GRID's; the last config.wgrad_dynamic_16ths / 16 claimed in
                    runs of config.wgrad_dynamic tiles from SCB_WGRAD2_HEAD / SCB_WGRAD1_HEAD). config.wgrad1_sync:
                    between the loops a rendezvous (device.soft_barrier, at most BWD_WGRAD1_SYNC_NS, no error, a
                    no-op under the interpreter) so that the programs share dW13's panels in L2. Raises nothing.
  ROUTER_DW(i, j)   W = 1 here: waits once per program for the dlogits count = ceil(T/RUT); a dWr tile. Raises nothing.
  UNPERMUTE(b)      tokens [b*UT, +UT): each token's k rows summed in slot order in fp32 into dx_e. W = 1: waits once
                    per program for the DGRAD1 count = every DGRAD1 tile; W > 1: for its block counter = k * the
                    block's tokens (every rank's rows), then resets it (the consumer's reset). With the router raises
                    the token-block count of its router dx m-tile.
  ROUTER_DL, _DW    W > 1 here, after UNPERMUTE: ROUTER_DL(b) waits for its token block's UNPERMUTE count (the gate
                    gradients come back with the rows, comb_dw); ROUTER_DW as at W = 1.
  ROUTER_DX(m, n)   waits once per program for the dlogits count, per task for its token block's UNPERMUTE count;
                    dx = bf16(dx_e + hi Wr + lo Wr).
  exit (FINAL)      the last program out (device.exit_program_zeroing) zeroes the scratch (heads, counts, flags,
                    plan state), at W > 1 sets done[rank] = epoch on every peer, and advances the epoch.
Scratch (layout.py's SCB_* slots, then [max m-tiles] dgrad2_done and swiglu_done and the router's token-block
counts; at W > 1 from ``xs_base`` the exchange heads, plan state, placed[E], gu_done, dg1_done) is zeroed by the
last program out, so no call needs a reset launch or a host synchronisation. Epochs: W = 1 its own slot; W > 1 the
workspace's, shared with the forward and the TP ops, as the done flags are; the UNPERMUTE block counters are the
workspace's symmetric counters (peers add to them), reset by their consumer.

Deadlock-freedom. Every wait is for tasks of a strictly earlier stage: this rank's, or a peer's (the plan for the
peers' COMBINE-BWD, UNPERMUTE for the peers' DISPATCH-BWD), and a peer's COMBINE-BWD waits for nothing of this call
(the done flags of the previous one, set when that launch ended). A program leaves a stage only when its head is
drained, i.e. every task of it is claimed by a running program; by induction over the stage order every claimed
task completes. SWIGLU on completion runs inside a claimed DGRAD2 task and waits only for tiles its own atomic saw
complete (and, W > 1, for GU: earlier). WGRAD is statically owned, but nothing waits on it; its rendezvous is
bounded and no dependency. So no wait needs the programs to be co-resident, only each rank's launch to run.
Fixed-role policy (W > 1, ``policy="fixed", comm_programs=S``, 1 <= S < GRID): programs pid < S take only the
communication stages (layout.BWD_COMM_STAGES: COMBINE-BWD, PERMUTE-BWD, DISPATCH-BWD, UNPERMUTE), the others the
rest (_takes); WGRAD's shares and rendezvous count the GRID - S compute programs. The roles wait on each other
both ways but never on a stage at or after the waiting one, and each role has a program, so the induction holds.

Determinism. No float atomics (atomics only on int32 heads and counters); no row's place depends on an atomic
(W = 1: the stable expert sort; W > 1: (source rank, pair) order from ep_pair_places and base[s, e]); every
output tile or row is computed by one task in a fixed order (wgrad: rows ascending, BR per step; dgrads: K
ascending; the gate gradient: column steps left to right; UNPERMUTE: slot order; router: tokens or experts
ascending, hi then lo). So the results are bitwise the same on every run and grid; at W = 1 bitwise the
multi-launch path's, but for dx and d_router with the router inside, which agree with the torch router to fp32
level (its GEMMs are cuBLAS's); at W > 1 the recomputed g | u is a Triton tile's, not torch's: bf16-level.

Where it runs. CUDA sm_90 (TMA descriptors, wgmma): one 8-warp program per SM (``programs=`` for tests), at
ptxas's 255-register cap without spills -- re-check after any change (dev/kernel_resources). The CPU under
TRITON_INTERPRET=1: small tiles, fp32 dots, 3 programs run one after another, every wait satisfied at once (a
spinning wait is a bug, bounded at BWD_INTERP_TIMEOUT_NS); at W > 1 each rank's call as phase launches
(layout.EP_PHASES, EP_PHASES_FIXED under the fixed policy), every rank's launch of a phase before any rank's next,
only the FINAL one ending the call. A timed-out wait fills the error record (op, codes.WAIT_BWD_*, rank, task,
index): KosmosTimeoutError at the next KOSMOS call or kosmos.check_errors() on CUDA, at once on the CPU.
``trace=`` records every task and wait (codes.EV_BWD_*; compiled out without it).

Tests: tests/test_moe_backward.py ``-k one_launch`` (interpreter: bitwise the multi-launch path with every buffer
poisoned on 2-4 programs, bounded waits with a stage left out, the trace, the router in the launch, W = 2 and 4 on
simulated ranks (tests/simranks.MoEBwdRanks) vs the reference and the multi-launch path, the stalled peer, the
fixed policy; ``*_gpu`` twins), tests/test_ranks_one_gpu.py::test_moe_backward_one_launch_two_ranks_on_one_gpu,
tests/test_moe_bwd_probe.py::test_cpu_smoke_one_launch_whole_call, tests/test_bench_moe.py::
test_fixed_role_backward_runs_the_one_launch_split. Why this design and the alternatives tried:
docs/design/moe_backward.md; figures: docs/perf/moe_backward.md."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...core import runtime
from ...config import MoEBackwardConfig, check_config
from ...core import device as dev
from ...core import planning
from ...core import schedule as sched
from ...core.codes import (EV_BWD_DGRAD1, EV_BWD_DGRAD2, EV_BWD_ROUTER_DL, EV_BWD_ROUTER_DX, EV_BWD_SWIGLU,
                           EV_BWD_UNPERMUTE, EV_BWD_WGRAD1, EV_BWD_WGRAD2, EV_COMM, EV_GEMM1, EV_PERMUTE, EV_WAIT,
                           OP_MOE_BACKWARD, TRACE_EVENTS, WAIT_BWD_DGRAD1, WAIT_BWD_DGRAD1_MTILE, WAIT_BWD_DGRAD2,
                           WAIT_BWD_DISPATCH, WAIT_BWD_GU, WAIT_BWD_PERMUTE, WAIT_BWD_ROUTER_DL, WAIT_BWD_SWIGLU,
                           WAIT_BWD_UNPERMUTE)
from ...core.schedule import policy_args
from .tiles import (_bwd_tiles, _dgrad1_tile, _mtile_expert, _n_mtiles, _swiglu_backward_cols, _swiglu_backward_rows,
                    _trace_clock, _unpermute_sum_cols, _wgrad_flat_run)
from .layout import (BWD_ALL_STAGES, BWD_COMM_STAGES, BWD_ROUTER_DL, BWD_ROUTER_DW, BWD_ROUTER_DX, BWD_ZERO_BLOCK,
                     EPLayout, EP_PLAN_STAGES, SCB_DGRAD1_DONE, SCB_EXIT, SCB_MTILES, SCB_ROUTER_DL_DONE,
                     SCB_SWIGLU_DONE, SCB_WGRAD1_HEAD, SCB_WGRAD2_HEAD, STAGE_BWD_COMBINE, STAGE_BWD_DGRAD1,
                     STAGE_BWD_DGRAD2, STAGE_BWD_DISPATCH, STAGE_BWD_GU, STAGE_BWD_PERMUTE, STAGE_BWD_ROUTER_DL,
                     STAGE_BWD_ROUTER_DW, STAGE_BWD_ROUTER_DX, STAGE_BWD_SWIGLU, STAGE_BWD_UNPERMUTE, STAGE_BWD_WGRAD,
                     WGRAD_PAD_ROWS, _mtile_plan, ep_pair_places, ep_tiles)
from .router import RouterBackward, _router_dlogits_block, _router_dw_stage, _router_dx_tile, _router_tiles
from .exchange import _ep_combine_block, _ep_dispatch_mtile, _ep_ensure_plan, _ep_permute_task, _ep_publish
from ..moe_forward import weights_nk


BWD_INTERP_PROGRAMS = 3  # the CPU interpreter's default grid (programs run one after another there)
BWD_INTERP_TIMEOUT_NS = 1_000_000  # its waits' bound: 1000 spins (each wait is satisfied at once there, or a bug)

# the bound of the rendezvous before WGRAD1 (MoEBackwardConfig.wgrad1_sync: device.soft_barrier, no error past it)
BWD_WGRAD1_SYNC_NS: tl.constexpr = tl.constexpr(5_000_000)


@triton.jit
def _bwd_swiglu_mtile(gm, x, first_mtile_ptr, pad_offs_ptr, counts_ptr, z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr,
                      valid_ptr, swiglu_ctr, swiglu_done_ptr, F, BM: tl.constexpr, PAD: tl.constexpr,
                      SW_BR: tl.constexpr, SW_BF: tl.constexpr, INTERP: tl.constexpr, SW_STAGES: tl.constexpr = 1):
    """The one launch's SWIGLU task of m-tile gm (its dgrad2 tiles stored and acquired): _swiglu_backward_rows over
    the m-tile's rows in SW_BR-row blocks up to the expert's padded end -- its gap rows get zeros (the flat wgrad
    reads them), the next expert's rows are another m-tile's --, then swiglu_done[gm] and the count (release).
    SW_STAGES > 1 (config.swiglu_stages): the (row block, column step) nest as ONE loop software-pipelined over
    SW_STAGES stages (tl.range: the next steps' z, g, u loads in flight while this step computes and stores), the
    same steps in the same order -- the gate gradient's column sum restarts at each block's first step and is
    stored at its last: the same bits."""
    e = tl.sum((tl.load(first_mtile_ptr + x) <= gm).to(tl.int32), 0) - 1
    lm0 = (gm - tl.load(first_mtile_ptr + e)) * BM
    row0 = tl.load(pad_offs_ptr + e) + lm0
    n_rows = tl.minimum(tl.cdiv(tl.load(counts_ptr + e), PAD) * PAD - lm0, BM)
    if SW_STAGES > 1:
        n_col = tl.cdiv(F, SW_BF)
        dw = tl.zeros([SW_BR], dtype=tl.float32)
        for it in tl.range(0, tl.cdiv(n_rows, SW_BR) * n_col, num_stages=SW_STAGES):
            cs = it % n_col
            r = (it // n_col) * SW_BR + tl.arange(0, SW_BR)
            rm = r < n_rows
            i = row0 + r
            i64 = i.to(tl.int64)
            zm = rm & (tl.load(valid_ptr + i, mask=rm, other=0) != 0)
            wp = tl.load(wp_ptr + i, mask=rm, other=0.0)
            part = _swiglu_backward_cols(i64, rm, zm, wp, cs * SW_BF + tl.arange(0, SW_BF), z_ptr, gu_ptr, dgu_ptr,
                                         h_ptr, F, True, INTERP)
            dw = tl.where(cs == 0, 0.0, dw) + part  # 0 + s == s: the nested loop's first add
            if cs == n_col - 1:
                tl.store(dw_ptr + i, dw, mask=rm)
    else:
        for r0 in range(0, n_rows, SW_BR):
            r = r0 + tl.arange(0, SW_BR)
            _swiglu_backward_rows(row0 + r, r < n_rows, z_ptr, gu_ptr, wp_ptr, dgu_ptr, h_ptr, dw_ptr, valid_ptr, F,
                                  SW_BF, True, INTERP, True)
    tl.debug_barrier()
    tl.atomic_add(swiglu_ctr + gm, 1, sem="release", scope="gpu")
    tl.atomic_add(swiglu_done_ptr, 1, sem="release", scope="gpu")


@triton.jit
def _takes(stages, s: tl.constexpr, fixed_comm, POLICY: tl.constexpr):
    """Whether this program takes stage ``s``: in the mask ``stages`` and, under the fixed policy, of its role (s a
    communication stage -- BWD_COMM_STAGES -- for programs < fixed_comm, any other for the rest):
    schedule.program_stages' role mask, asked one stage at a time with the program id read afresh
    (device.program_id_fresh). Why not the mask, or the role as one predicate, computed once: either lives in a
    register through the whole launch (the kernel argument ``stages`` is read from the constant bank), and at
    ptxas's 255 cap that made it spill the program id, 12 B, in the fixed build with the router (local Triton
    3.9, W = 2). The self build is has_stage(stages, s)."""
    take = sched.has_stage(stages, s)
    if POLICY == sched.POLICY_FIXED:
        if ((BWD_COMM_STAGES >> s) & 1) != 0:
            take = take & (dev.program_id_fresh() < fixed_comm)
        else:
            take = take & (dev.program_id_fresh() >= fixed_comm)
    return take


@triton.jit(do_not_specialize=["T", "R_PAD", "scratch_n", "max_mtiles", "timeout_us", "stages", "off_rx", "off_rdy",
                               "off_meta", "off_w", "off_cnt", "off_cx", "off_cdw", "xs_base", "rank",
                               "fixed_comm"])
def _moe_backward_experts_kernel(
        dy_rows_ptr, do_rows_ptr, x_rows_ptr, gu_ptr, wp_ptr, valid_ptr, w13_ptr, w2_ptr,
        pad_offs_ptr, counts_ptr, first_mtile_ptr, inv_ptr,
        z_ptr, dgu_ptr, h_ptr, dw_rows_ptr, dx_rows_ptr, dw13_ptr, dw2_ptr, dx_e_ptr,
        x_ptr, wr_ptr, logits_ptr, experts_ptr, dlhl_ptr, dx_ptr, dwr_ptr, ER, EP, routed_scaling,
        scratch_ptr, scratch_n, max_mtiles, err_ptr, epoch_ptr, timeout_us, stages, trace_ptr,
        T, H, F, E, R_PAD,
        dyt_ptr, wt_ptr, pidx_ptr, send_cnt_ptr, recv_x_ptr, recv_dy_ptr, recv_meta_ptr, recv_w_ptr, cnt_ptr,
        comb_x_ptr, comb_dw_ptr, peer_data, peer_sig, peer_ctr, sig_ptr, ctr_ptr, off_rx, off_rdy, off_meta, off_w,
        off_cnt, off_cx, off_cdw, row_meta_ptr, base_ptr, xs_base, rank, fixed_comm,
        TOPK: tl.constexpr, ELP2: tl.constexpr, PAD: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GEMM_STAGES: tl.constexpr,
        TMA2: tl.constexpr, TMA1: tl.constexpr, SW_BR: tl.constexpr, SW_BF: tl.constexpr,
        W2_BI: tl.constexpr, W2_BJ: tl.constexpr, W1_BI: tl.constexpr, W1_BJ: tl.constexpr, W_BR: tl.constexpr,
        W2_STAGES: tl.constexpr, W1_STAGES: tl.constexpr, UT: tl.constexpr, UBH: tl.constexpr, GRID: tl.constexpr,
        SWIGLU_ON_COMPLETION: tl.constexpr, DOT_FP32: tl.constexpr, TRACE: tl.constexpr,
        WGRAD1_SYNC: tl.constexpr = False, WGRAD_DYNAMIC: tl.constexpr = 0, WGRAD_DYNAMIC_16THS: tl.constexpr = 1,
        LEAN_DGRAD1: tl.constexpr = False, SW_STAGES: tl.constexpr = 1,
        ROUTER: tl.constexpr = False,
        SOFTMAX: tl.constexpr = True,
        RENORM: tl.constexpr = True, ERP2: tl.constexpr = 1, RUT: tl.constexpr = 1,
        RX_BM: tl.constexpr = 16, RX_BN: tl.constexpr = 16, RX_BK: tl.constexpr = 16,
        RW_BI: tl.constexpr = 16, RW_BJ: tl.constexpr = 16, RW_BR: tl.constexpr = 16, R_STAGES: tl.constexpr = 1,
        WORLD: tl.constexpr = 1, WP2: tl.constexpr = 1, KP2: tl.constexpr = 1, XB: tl.constexpr = 1,
        XBH: tl.constexpr = 16, TMA_GU: tl.constexpr = False, FINAL: tl.constexpr = True,
        FLAG_BASE: tl.constexpr = 64, DONE_BASE: tl.constexpr = 0, POLICY: tl.constexpr = 0,
        W_NK: tl.constexpr = False):
    """The backward in one persistent launch of GRID programs (the stages, their counters and waits, the deadlock
    argument: this module's docstring): DGRAD2, SWIGLU (SWIGLU_ON_COMPLETION: run inside the DGRAD2 task that
    completes the m-tile; else its own queue), DGRAD1 (shared atomic heads), WGRAD (each program's own share of
    both flat wgrad loops), UNPERMUTE (shared head), each task's arithmetic the standalone kernel's tile function.
    ROUTER: the router backward too -- ROUTER_DL after DGRAD1, ROUTER_DW after WGRAD, ROUTER_DX after UNPERMUTE
    (shared heads), dx (bf16) and dWr (fp32) its outputs; without it x_ptr .. dwr_ptr are unused (at W > 1 x_ptr
    and experts_ptr are the token rows and decisions for COMBINE-BWD either way).
    WORLD > 1: COMBINE-BWD first, the plan, PERMUTE-BWD and GU (g | u recomputed) before DGRAD2, DISPATCH-BWD
    after DGRAD1, UNPERMUTE from the combine rows, the router's ROUTER_DL and ROUTER_DW after UNPERMUTE; the plan
    arrays (counts, pad_offs, first_mtile, base) are the launch's own output, the expert-row buffers sized for
    the worst case (R_PAD); the W = 1 build compiles none of it. FINAL: this launch ends the call (zeroes the
    scratch, signals done, advances the epoch; the CPU tests' phase launches but the last do not).
    ``stages``: a bitmask of the stages to run (tests: a stage left out makes its consumers' waits time out;
    at W > 1 the CPU tests' phases).
    POLICY (schedule.POLICY_SELF / POLICY_FIXED; fixed at W > 1 only): under the fixed-role ablation programs
    pid < fixed_comm take only the communication stages (BWD_COMM_STAGES) of ``stages``, the others only the rest,
    and WGRAD's static shares and rendezvous count the GRID - fixed_comm compute programs. The self build
    compiles none of it (fixed_comm unused).
    TRACE: every task and wait as a (kind, task, t0, t1) event of trace_ptr [GRID, TRACE_EVENTS, 4] (codes.EV_*;
    WGRAD one event per flat loop, task -1)."""
    pid = tl.program_id(0)
    timeout_ns = tl.cast(timeout_us, tl.int64) * 1000
    x = tl.arange(0, ELP2)
    n_f = tl.cdiv(F, BN)
    n_h = tl.cdiv(H, BN)
    dgrad2_ctr = scratch_ptr + SCB_MTILES
    swiglu_ctr = dgrad2_ctr + max_mtiles  # then (router in the launch) UNPERMUTE tasks done per RX_BM-token block
    ok = 1
    n_ev = 0
    if WORLD > 1:  # the exchange's stages and the plan
        xs = scratch_ptr + xs_base  # [0, 4) heads of COMBINE, PERMUTE, GU, DISPATCH; 4 combined; 5 plan state;
        placed = xs + 6             # then rows placed per local expert [E], GU and DGRAD1 tiles done per m-tile
        gu_ctr = placed + E
        dg1_ctr = gu_ctr + max_mtiles
        n_g = tl.cdiv(2 * F, BN)
        if _takes(stages, STAGE_BWD_COMBINE, fixed_comm, POLICY):  # dy (and x) rows once per destination rank
            n_cb = tl.cdiv(T, XB)
            t = sched.claim(xs + 0)
            handshake = 0
            while (t < n_cb) & (ok != 0):
                t0 = _trace_clock(TRACE)
                epoch = dev.call_epoch(epoch_ptr)
                if handshake == 0:  # a peer may still be reading last call's rows from its receive buffers
                    ok = dev.wait_peers_done(sig_ptr, DONE_BASE, WORLD, epoch, timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                             rank)
                    handshake = 1
                if ok != 0:
                    _ep_combine_block(t, x_ptr, dyt_ptr, experts_ptr, wt_ptr, pidx_ptr, peer_data, off_rx, off_rdy,
                                      off_meta, off_w, T, H, E, rank, WORLD, TOPK, KP2, XB, XBH)
                    tl.debug_barrier()
                    if tl.atomic_add(xs + 4, 1, sem="acq_rel", scope="sys") == n_cb - 1:
                        _ep_publish(send_cnt_ptr, peer_data, peer_sig, off_cnt, E, rank, epoch, WORLD, ELP2,
                                    FLAG_BASE)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMM, t, t0, _trace_clock(TRACE), TRACE)
                t = sched.claim(xs + 0)
        # every stage from PERMUTE to WGRAD reads the plan (the fixed policy: those of this program's role -- the
        # role decision, schedule.program_stages; elsewhere asked stage by stage, _takes)
        if ((sched.program_stages(pid, POLICY, fixed_comm, stages, BWD_COMM_STAGES) & EP_PLAN_STAGES) != 0) & (ok != 0):
            t0 = _trace_clock(TRACE)
            ok = _ep_ensure_plan(sig_ptr, cnt_ptr, counts_ptr, pad_offs_ptr, first_mtile_ptr, base_ptr, xs + 5, E, rank,
                                 dev.call_epoch(epoch_ptr), timeout_ns, err_ptr, WORLD, WP2, ELP2, BM, PAD, FLAG_BASE)
            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, -1, t0, _trace_clock(TRACE), TRACE)
        if _takes(stages, STAGE_BWD_PERMUTE, fixed_comm, POLICY) & (ok != 0):  # gap rows, then received rows, own first
            t = sched.claim(xs + 1)
            while t < E + WORLD * tl.cdiv(T, XB):
                t0 = _trace_clock(TRACE)
                _ep_permute_task(t, recv_x_ptr, recv_dy_ptr, recv_meta_ptr, recv_w_ptr, counts_ptr, pad_offs_ptr,
                                 base_ptr, x_rows_ptr, dy_rows_ptr, do_rows_ptr, gu_ptr, wp_ptr, valid_ptr,
                                 row_meta_ptr, placed, T, H, F, E, rank, WORLD, TOPK, KP2, XB, XBH, PAD, DOT_FP32)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_PERMUTE, t, t0, _trace_clock(TRACE), TRACE)
                t = sched.claim(xs + 1)
        if _takes(stages, STAGE_BWD_GU, fixed_comm, POLICY) & (ok != 0):  # [g | u] = x_rows W13[e] per (m-, 2F-tile)
            t = sched.claim(xs + 2)
            while (t < _n_mtiles(counts_ptr, E, ELP2, BM) * n_g) & (ok != 0):
                t0 = _trace_clock(TRACE)
                gm = t // n_g
                e = _mtile_expert(first_mtile_ptr, gm, ELP2)
                ok = dev.wait_geq(placed + e, tl.load(counts_ptr + e) + 1, timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                  WAIT_BWD_PERMUTE, rank, t, e)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    _dgrad1_tile(gm, t % n_g, x_rows_ptr, w13_ptr, pad_offs_ptr, counts_ptr, first_mtile_ptr, gu_ptr,
                                 2 * F, H, ELP2, BM, BN, BK, DOT_FP32, TMA_GU, GEMM_STAGES, W_NK == 0, True)
                    tl.debug_barrier()
                    tl.atomic_add(gu_ctr + gm, 1, sem="release", scope="gpu")
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_GEMM1, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(xs + 2)
    n_mt = _n_mtiles(counts_ptr, E, ELP2, BM)  # the m-tiles of all experts (recomputed after DGRAD1: see WGRAD)
    if _takes(stages, STAGE_BWD_DGRAD2, fixed_comm, POLICY) & (ok != 0):  # z = dy_rows W2[e]^T per (m-tile, F-tile)
        t = sched.claim(scratch_ptr + STAGE_BWD_DGRAD2)
        while (t < n_mt * n_f) & (ok != 0):
            t0 = _trace_clock(TRACE)
            gm = t // n_f
            if WORLD > 1:  # the m-tile's rows placed (its expert's every row and gap)
                e = _mtile_expert(first_mtile_ptr, gm, ELP2)
                ok = dev.wait_geq(placed + e, tl.load(counts_ptr + e) + 1, timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                  WAIT_BWD_PERMUTE, rank, t, e)
            if ok != 0:
                _dgrad1_tile(gm, t % n_f, dy_rows_ptr, w2_ptr, pad_offs_ptr, counts_ptr, first_mtile_ptr, z_ptr, F,
                             H, ELP2, BM, BN, BK, DOT_FP32, TMA2, GEMM_STAGES, W_NK)
                tl.debug_barrier()
                done = tl.atomic_add(dgrad2_ctr + gm, 1, sem="acq_rel", scope="gpu")
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_DGRAD2, t, t0, t1, TRACE)
                if SWIGLU_ON_COMPLETION:
                    # the m-tile's last dgrad2 tile: its SwiGLU pass here, beside the other programs' GEMMs (the
                    # wait is satisfied at once: it is the acquire -- and proxy -- fence of every thread)
                    if (done == n_f - 1) & _takes(stages, STAGE_BWD_SWIGLU, fixed_comm, POLICY):
                        dev.wait_geq(dgrad2_ctr + gm, n_f, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_DGRAD2, 0,
                                     t, gm)
                        if WORLD > 1:  # and its recomputed g | u
                            ok = dev.wait_geq(gu_ctr + gm, n_g, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_GU,
                                              rank, t, gm)
                        if ok != 0:
                            _bwd_swiglu_mtile(gm, x, first_mtile_ptr, pad_offs_ptr, counts_ptr, z_ptr, gu_ptr, wp_ptr,
                                              dgu_ptr, h_ptr, dw_rows_ptr, valid_ptr, swiglu_ctr,
                                              scratch_ptr + SCB_SWIGLU_DONE, F, BM, PAD, SW_BR, SW_BF, DOT_FP32,
                                              SW_STAGES)
                            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_SWIGLU, gm, t1, _trace_clock(TRACE), TRACE)
            t = sched.claim(scratch_ptr + STAGE_BWD_DGRAD2)
    if not SWIGLU_ON_COMPLETION:  # SWIGLU as its own queue: per m-tile, waiting for its dgrad2 tiles
        if _takes(stages, STAGE_BWD_SWIGLU, fixed_comm, POLICY):  # (asked before the claim: else a task is lost)
            t = sched.claim(scratch_ptr + STAGE_BWD_SWIGLU)
            while (t < n_mt) & (ok != 0):
                t0 = _trace_clock(TRACE)
                ok = dev.wait_geq(dgrad2_ctr + t, n_f, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_DGRAD2, 0, t, t)
                if WORLD > 1:
                    if ok != 0:
                        ok = dev.wait_geq(gu_ctr + t, n_g, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_GU, rank, t,
                                          t)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    _bwd_swiglu_mtile(t, x, first_mtile_ptr, pad_offs_ptr, counts_ptr, z_ptr, gu_ptr, wp_ptr, dgu_ptr,
                                      h_ptr, dw_rows_ptr, valid_ptr, swiglu_ctr, scratch_ptr + SCB_SWIGLU_DONE, F, BM,
                                      PAD, SW_BR, SW_BF, DOT_FP32, SW_STAGES)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_SWIGLU, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(scratch_ptr + STAGE_BWD_SWIGLU)
    if _takes(stages, STAGE_BWD_DGRAD1, fixed_comm, POLICY) & (ok != 0):  # dx_rows = [dg | du] W13[e]^T per (m, H-tile)
        # LEAN_DGRAD1 (W = 1; config.dgrad1_lean): no per-task wait once this program has seen every SwiGLU pass done,
        # and its finished tiles counted into SCB_DGRAD1_DONE once, after its last (UNPERMUTE waits for the total)
        lean = LEAN_DGRAD1 & (WORLD == 1)
        sw_all = 0
        n_done = 0
        t = sched.claim(scratch_ptr + STAGE_BWD_DGRAD1)
        while (t < n_mt * n_h) & (ok != 0):
            t0 = _trace_clock(TRACE)
            gm = t // n_h
            if lean:
                if sw_all == 0:
                    sw_all = dev.reached(scratch_ptr + SCB_SWIGLU_DONE, n_mt, GPU_TMA=True).to(tl.int32)
                    if sw_all == 0:
                        ok = dev.wait_geq(swiglu_ctr + gm, 1, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_SWIGLU, 0,
                                          t, gm, GPU_TMA=True)
            else:
                ok = dev.wait_geq(swiglu_ctr + gm, 1, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_SWIGLU, 0, t, gm)
            t1 = _trace_clock(TRACE)
            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
            if ok != 0:
                _dgrad1_tile(gm, t % n_h, dgu_ptr, w13_ptr, pad_offs_ptr, counts_ptr, first_mtile_ptr, dx_rows_ptr,
                             H, 2 * F, ELP2, BM, BN, BK, DOT_FP32, TMA1, GEMM_STAGES, W_NK)
                if WORLD > 1:  # per m-tile: its DISPATCH-BWD task waits for it
                    tl.debug_barrier()
                    tl.atomic_add(dg1_ctr + gm, 1, sem="release", scope="gpu")
                elif lean:
                    n_done += 1
                else:
                    tl.debug_barrier()
                    tl.atomic_add(scratch_ptr + SCB_DGRAD1_DONE, 1, sem="release", scope="gpu")
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_DGRAD1, t, t1, _trace_clock(TRACE), TRACE)
            t = sched.claim(scratch_ptr + STAGE_BWD_DGRAD1)
        if lean:  # this program's tiles, released once (its stores before it: the barrier, then the release)
            if n_done > 0:
                tl.debug_barrier()
                tl.atomic_add(scratch_ptr + SCB_DGRAD1_DONE, n_done, sem="release", scope="gpu")
    if WORLD > 1:  # each m-tile's rows back to their tokens' ranks (dx rows and gate gradients)
        if _takes(stages, STAGE_BWD_DISPATCH, fixed_comm, POLICY) & (ok != 0):
            t = sched.claim(xs + 3)
            while (t < n_mt) & (ok != 0):
                t0 = _trace_clock(TRACE)
                ok = dev.wait_geq(dg1_ctr + t, n_h, timeout_ns, err_ptr, OP_MOE_BACKWARD, WAIT_BWD_DGRAD1_MTILE,
                                  rank, t, t, True)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    _ep_dispatch_mtile(t, first_mtile_ptr, pad_offs_ptr, counts_ptr, dx_rows_ptr, dw_rows_ptr,
                                       row_meta_ptr, peer_data, peer_ctr, off_cx, off_cdw, H, TOPK, ELP2, BM, XB, XBH,
                                       UT)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_COMM, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(xs + 3)
    if (WORLD == 1) & ROUTER:  # the gate gradients through the routing: dl per token block, split hi | lo
        if _takes(stages, STAGE_BWD_ROUTER_DL, fixed_comm, POLICY) & (ok != 0):
            t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DL)
            waited = 0
            while (t < tl.cdiv(T, RUT)) & (ok != 0):
                t0 = _trace_clock(TRACE)
                if waited == 0:  # once per program: every m-tile's SwiGLU pass (the rows' gate gradients)
                    ok = dev.wait_geq(scratch_ptr + SCB_SWIGLU_DONE, _n_mtiles(counts_ptr, E, ELP2, BM), timeout_ns,
                                      err_ptr, OP_MOE_BACKWARD, WAIT_BWD_SWIGLU, 0, t, -1)
                    waited = 1
                    t1 = _trace_clock(TRACE)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                    t0 = t1
                if ok != 0:
                    _router_dlogits_block(t, logits_ptr, experts_ptr, inv_ptr, dw_rows_ptr, dlhl_ptr, T, ER, EP,
                                          routed_scaling, TOPK, ERP2, RUT, SOFTMAX, RENORM, DOT_FP32)
                    tl.debug_barrier()
                    tl.atomic_add(scratch_ptr + SCB_ROUTER_DL_DONE, 1, sem="release", scope="gpu")
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_ROUTER_DL, t, t0, _trace_clock(TRACE), TRACE)
                t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DL)
    if _takes(stages, STAGE_BWD_WGRAD, fixed_comm, POLICY) & (ok != 0):  # this program's share of both flat loops
        t0 = _trace_clock(TRACE)
        # n_mt recomputed (a few loads of counts): kept in a register across WGRAD, ptxas spilled it (with the
        # router stages and fp32 weight gradients)
        ok = dev.wait_geq(scratch_ptr + SCB_SWIGLU_DONE, _n_mtiles(counts_ptr, E, ELP2, BM), timeout_ns, err_ptr,
                          OP_MOE_BACKWARD, WAIT_BWD_SWIGLU, 0, -1, -1)
        t1 = _trace_clock(TRACE)
        n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, -1, t0, t1, TRACE)
        # the programs sharing WGRAD's static shares: all of them (self: constexprs), or under the
        # fixed policy the compute programs (program pid - S of GRID - S)
        w_pid = pid
        w_grid = GRID
        if POLICY == sched.POLICY_FIXED:
            w_pid = pid - fixed_comm
            w_grid = GRID - fixed_comm
        if ok != 0:
            if W_NK:  # dW2 [H, F] per expert = do^T h (transformers' down_proj layout)
                _wgrad_flat_run(w_pid, do_rows_ptr, h_ptr, pad_offs_ptr, counts_ptr, dw2_ptr, H, F, E, R_PAD, W2_BI,
                                W2_BJ, W_BR, w_grid, ELP2, DOT_FP32, W2_STAGES, scratch_ptr + SCB_WGRAD2_HEAD,
                                WGRAD_DYNAMIC, WGRAD_DYNAMIC_16THS)
            else:
                _wgrad_flat_run(w_pid, h_ptr, do_rows_ptr, pad_offs_ptr, counts_ptr, dw2_ptr, F, H, E, R_PAD, W2_BI,
                                W2_BJ, W_BR, w_grid, ELP2, DOT_FP32, W2_STAGES, scratch_ptr + SCB_WGRAD2_HEAD,
                                WGRAD_DYNAMIC, WGRAD_DYNAMIC_16THS)
            t0 = _trace_clock(TRACE)
            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_WGRAD2, -1, t1, t0, TRACE)
            if WGRAD1_SYNC:  # every program starts WGRAD1 together (config.wgrad1_sync; WGRAD's head slot counts them)
                tl.atomic_add(scratch_ptr + STAGE_BWD_WGRAD, 1, sem="relaxed", scope="gpu")
                dev.soft_barrier(scratch_ptr + STAGE_BWD_WGRAD, w_grid, BWD_WGRAD1_SYNC_NS)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, -2, t0, t1, TRACE)
                t0 = t1
            if W_NK:  # dW13 [2F, H] per expert = [dg | du]^T x_rows (transformers' gate_up_proj layout)
                _wgrad_flat_run(w_pid, dgu_ptr, x_rows_ptr, pad_offs_ptr, counts_ptr, dw13_ptr, 2 * F, H, E, R_PAD,
                                W1_BI, W1_BJ, W_BR, w_grid, ELP2, DOT_FP32, W1_STAGES,
                                scratch_ptr + SCB_WGRAD1_HEAD, WGRAD_DYNAMIC, WGRAD_DYNAMIC_16THS)
            else:
                _wgrad_flat_run(w_pid, x_rows_ptr, dgu_ptr, pad_offs_ptr, counts_ptr, dw13_ptr, H, 2 * F, E, R_PAD,
                                W1_BI, W1_BJ, W_BR, w_grid, ELP2, DOT_FP32, W1_STAGES,
                                scratch_ptr + SCB_WGRAD1_HEAD, WGRAD_DYNAMIC, WGRAD_DYNAMIC_16THS)
            n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_WGRAD1, -1, t0, _trace_clock(TRACE), TRACE)
    if (WORLD == 1) & ROUTER:  # the long compute-bound dWr tiles first (beside UNPERMUTE's memory-bound blocks)
        ok, n_ev = _router_dw_stage(scratch_ptr, _takes(stages, STAGE_BWD_ROUTER_DW, fixed_comm, POLICY), ok,
                                    n_ev, pid, dlhl_ptr, x_ptr, dwr_ptr, T, H, ER, EP,
                                    timeout_ns, err_ptr, trace_ptr, RUT, RW_BI, RW_BJ, RW_BR, DOT_FP32, R_STAGES, TRACE)
    if _takes(stages, STAGE_BWD_UNPERMUTE, fixed_comm, POLICY) & (ok != 0):  # each token's k rows summed in slot order
        t = sched.claim(scratch_ptr + STAGE_BWD_UNPERMUTE)
        waited = 0
        while (t < tl.cdiv(T, UT)) & (ok != 0):
            t0 = _trace_clock(TRACE)
            if WORLD > 1:  # the block's rows from every rank (k per token), in the combine rows [t*k + j]
                ok = dev.wait_geq(ctr_ptr + t, tl.minimum(T - t * UT, UT) * TOPK, timeout_ns, err_ptr,
                                  OP_MOE_BACKWARD, WAIT_BWD_DISPATCH, rank, t, t)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                t0 = t1
            elif waited == 0:  # one wait per program: the counter only grows, the acquire covers what follows
                ok = dev.wait_geq(scratch_ptr + SCB_DGRAD1_DONE, _n_mtiles(counts_ptr, E, ELP2, BM) * n_h,
                                  timeout_ns, err_ptr, OP_MOE_BACKWARD,
                                  WAIT_BWD_DGRAD1, 0, t, -1)
                waited = 1
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                t0 = t1
            if ok != 0:
                tok = t * UT + tl.arange(0, UT)
                tm = tok < T
                tok = tl.minimum(tok, T - 1)[:, None]  # past T: a valid index, nothing stored
                for c0 in range(0, H, UBH):
                    c = c0 + tl.arange(0, UBH)
                    if WORLD > 1:  # inv: the identity (the combine rows are in pair order)
                        _unpermute_sum_cols(tok, c[None, :], tm[:, None] & (c < H)[None, :], comb_x_ptr, inv_ptr,
                                            dx_e_ptr, H, TOPK, True)
                    else:
                        _unpermute_sum_cols(tok, c[None, :], tm[:, None] & (c < H)[None, :], dx_rows_ptr, inv_ptr,
                                            dx_e_ptr, H, TOPK, True)
                if WORLD > 1:  # consumer reset: peers add to it again only after this rank's next COMBINE-BWD
                    tl.debug_barrier()
                    tl.store(ctr_ptr + t, 0)
                if ROUTER:  # +1 on the token block's count (the router's dx tiles of those tokens wait for it)
                    tl.debug_barrier()
                    tl.atomic_add(scratch_ptr + SCB_MTILES + 2 * max_mtiles + (t * UT) // RX_BM, 1, sem="release",
                                  scope="gpu")
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_UNPERMUTE, t, t0, _trace_clock(TRACE), TRACE)
            t = sched.claim(scratch_ptr + STAGE_BWD_UNPERMUTE)
    if (WORLD > 1) & ROUTER:  # the gate gradients came back with the rows: ROUTER_DL per token block, then dWr
        if _takes(stages, STAGE_BWD_ROUTER_DL, fixed_comm, POLICY) & (ok != 0):
            t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DL)
            while (t < tl.cdiv(T, RUT)) & (ok != 0):
                t0 = _trace_clock(TRACE)
                m = (t * RUT) // RX_BM  # its tokens' UNPERMUTE tasks (they acquired the combine rows' gate gradients)
                ok = dev.wait_geq(scratch_ptr + SCB_MTILES + 2 * max_mtiles + m,
                                  tl.cdiv(tl.minimum(T - m * RX_BM, RX_BM), UT), timeout_ns, err_ptr,
                                  OP_MOE_BACKWARD, WAIT_BWD_UNPERMUTE, rank, t, m)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    _router_dlogits_block(t, logits_ptr, experts_ptr, inv_ptr, comb_dw_ptr, dlhl_ptr, T, ER, EP,
                                          routed_scaling, TOPK, ERP2, RUT, SOFTMAX, RENORM, DOT_FP32)
                    tl.debug_barrier()
                    tl.atomic_add(scratch_ptr + SCB_ROUTER_DL_DONE, 1, sem="release", scope="gpu")
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_ROUTER_DL, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DL)
        ok, n_ev = _router_dw_stage(scratch_ptr, _takes(stages, STAGE_BWD_ROUTER_DW, fixed_comm, POLICY), ok,
                                    n_ev, pid, dlhl_ptr, x_ptr, dwr_ptr, T, H, ER, EP,
                                    timeout_ns, err_ptr, trace_ptr, RUT, RW_BI, RW_BJ, RW_BR, DOT_FP32, R_STAGES, TRACE)
    if ROUTER:
        if _takes(stages, STAGE_BWD_ROUTER_DX, fixed_comm, POLICY) & (ok != 0):  # dx = bf16(dx_e + dl Wr) per tile
            t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DX)
            n_xn = tl.cdiv(H, RX_BN)
            waited = 0
            while (t < tl.cdiv(T, RX_BM) * n_xn) & (ok != 0):
                t0 = _trace_clock(TRACE)
                m = t // n_xn
                if waited == 0:  # once per program: every dlogits block (in practice long done: before WGRAD)
                    ok = dev.wait_geq(scratch_ptr + SCB_ROUTER_DL_DONE, tl.cdiv(T, RUT), timeout_ns, err_ptr,
                                      OP_MOE_BACKWARD, WAIT_BWD_ROUTER_DL, 0, t, -1)
                    waited = 1
                if ok != 0:  # the token block's dispatch backward (its UNPERMUTE tasks)
                    ok = dev.wait_geq(scratch_ptr + SCB_MTILES + 2 * max_mtiles + m,
                                      tl.cdiv(tl.minimum(T - m * RX_BM, RX_BM), UT), timeout_ns, err_ptr,
                                      OP_MOE_BACKWARD, WAIT_BWD_UNPERMUTE, 0, t, m)
                t1 = _trace_clock(TRACE)
                n_ev = dev.trace(trace_ptr, pid, n_ev, EV_WAIT, t, t0, t1, TRACE)
                if ok != 0:
                    hi_x = tl.make_tensor_descriptor(dlhl_ptr, shape=[T, ER], strides=[2 * EP, 1],
                                                     block_shape=[RX_BM, RX_BK])
                    lo_x = tl.make_tensor_descriptor(dlhl_ptr + EP, shape=[T, ER], strides=[2 * EP, 1],
                                                     block_shape=[RX_BM, RX_BK])
                    wr_x = tl.make_tensor_descriptor(wr_ptr, shape=[ER, H], strides=[H, 1],
                                                     block_shape=[RX_BK, RX_BN])
                    _router_dx_tile(m, t % n_xn, hi_x, lo_x, wr_x, dx_e_ptr, dx_ptr, T, H, ER, RX_BM, RX_BN, RX_BK,
                                    DOT_FP32, R_STAGES)
                    n_ev = dev.trace(trace_ptr, pid, n_ev, EV_BWD_ROUTER_DX, t, t1, _trace_clock(TRACE), TRACE)
                t = sched.claim(scratch_ptr + STAGE_BWD_ROUTER_DX)
    # the epoch read here, not at the start: still before this program's exit atomic (device.py's argument: the last
    # program out stores it only after every program's exit atomic), and no register held across the whole launch
    # for it (with the router stages, ptxas spilled it across WGRAD: 4 B with fp32 weight gradients)
    if FINAL:
        epoch = dev.call_epoch(epoch_ptr)
        if WORLD > 1:  # done[rank] = epoch on every peer: they may write into this rank's buffers again
            dev.exit_program_zeroing(scratch_ptr, scratch_n, SCB_EXIT, GRID, peer_sig, DONE_BASE, rank, WORLD, epoch,
                                     epoch_ptr, BWD_ZERO_BLOCK)
        else:
            dev.exit_program_zeroing(scratch_ptr, scratch_n, SCB_EXIT, GRID, err_ptr, 0, 0, 1, epoch, epoch_ptr,
                                     BWD_ZERO_BLOCK)


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """t bf16, contiguous and 16-byte aligned (a copy only where it is not)."""
    t = t.to(torch.bfloat16).contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def _tma_weight(w: torch.Tensor) -> bool:
    """Whether the kernel reads expert weight w [E, K, N] through TMA: its stored rows (N long, or K long in
    transformers' layout) 16-byte multiples, its start 16-byte aligned."""
    row = w.shape[1] if weights_nk(w) else w.shape[2]
    return row % 8 == 0 and (w.is_contiguous() or weights_nk(w)) and w.data_ptr() % 16 == 0


def _weight_grads_like(w13: torch.Tensor, w2: torch.Tensor, out_dtype: torch.dtype):
    """Empty dW13, dW2 in the weights' own layout: [E, H, 2F] / [E, F, H] contiguous, or for transformers'
    layout the .transpose(1, 2) views of contiguous [E, 2F, H] / [E, H, F] (what the kernel then writes)."""
    def like(w):
        e, k, n = w.shape
        if weights_nk(w):
            return torch.empty((e, n, k), dtype=out_dtype, device=w.device).transpose(1, 2)
        return torch.empty((e, k, n), dtype=out_dtype, device=w.device)
    return like(w13), like(w2)


def _no_ep_args(stand_in: torch.Tensor) -> tuple:
    """The kernel's W > 1 arguments at W = 1 (unused there: typed stand-ins and zeros; fixed_comm last)."""
    return (stand_in,) * 16 + (0,) * 7 + (stand_in,) * 2 + (0, 0, 0)


def expert_backward_one_launch(dy_rows, do_rows, x_rows, gu, w_pair, valid, w13, w2, counts, pad_offs, inv,
                               n_tok: int, top_k: int, out_dtype: torch.dtype = torch.bfloat16, *,
                               programs: int | None = None, stages: int = BWD_ALL_STAGES, timeout_ns=None,
                               trace: torch.Tensor | None = None, router: RouterBackward | None = None,
                               config: MoEBackwardConfig | None = None):
    """moe_backward's expert part at W = 1 in ONE launch (_moe_backward_experts_kernel) on rows in the padded
    layout: dy_rows, do_rows (= w * dy_rows), x_rows [R_pad, H], gu [R_pad, 2F] bf16, w_pair [R_pad] fp32, valid
    [R_pad] bool (padded_layout's real_of >= 0; gap rows zero in dy_rows, do_rows, x_rows, gu, w_pair), w13
    [E, H, 2F], w2 [E, F, H] bf16, counts [E], pad_offs [E] (padded_row_offsets), inv [T*k] (each pair's padded
    row, _pair_rows). Returns (dx_e [T, H] fp32: the dispatch backward's rows summed in slot order, dw_rows
    [R_pad] fp32: the gate gradients <dy_t, o_p> of the rows -- gap rows unspecified --, dw13, dw2 in
    ``out_dtype``), bitwise what the multi-launch path computes (the same tile functions, tiles and orders).
    ``programs``: the grid (None: one per SM; the interpreter: BWD_INTERP_PROGRAMS). ``stages`` and ``timeout_ns``
    (None: the workspace's) for tests. ``trace`` (int64 [grid, codes.TRACE_EVENTS, 4], zeroed): each program's
    tasks and waits as (kind, task, t0, t1) events (runtime.TRACE_KINDS), for the timeline. On CUDA a timed-out
    wait raises KosmosTimeoutError at the next KOSMOS call or kosmos.check_errors() (the workspace's error record);
    on the CPU right away. CUDA, or the CPU under TRITON_INTERPRET=1.

    ``router`` (a RouterBackward): the router backward in the launch too (the stages ROUTER_DL, ROUTER_DW,
    ROUTER_DX; router.py), and the return value is then (dx [T, H] bf16 = bf16(dx_e + dl Wr) -- moe_backward's
    dx --, dw_rows, dw13, dw2, d_router [E, H] fp32 = dl^T x)."""
    config = check_config(MoEBackwardConfig, config)
    r_pad, h = dy_rows.shape
    n_exp, f, _ = w2.shape
    nk = weights_nk(w13)
    (bm, bn, bk, gemm_stages), (sw_br, sw_bf), w2t, w1t, (ut, ubh), warps = _bwd_tiles(out_dtype, h, f, nk)
    rut, (rx_bm, rx_bn, rx_bk), (rw_bi, rw_bj, rw_br), r_stages = _router_tiles()
    dev_ = dy_rows.device
    if router is not None:
        if router.routing not in ("softmax", "sigmoid-grouped"):
            raise ValueError(f"unknown routing {router.routing!r}; choose from softmax, sigmoid-grouped")
        n_r = router.router_weight.shape[0]
        if router.x.shape != (n_tok, h) or router.router_weight.shape != (n_r, h) or \
                router.logits.shape != (n_tok, n_r) or router.experts.shape != (n_tok, top_k):
            raise ValueError(f"router tensors disagree with T={n_tok}, H={h}, k={top_k}: x {tuple(router.x.shape)}, "
                             f"router_weight {tuple(router.router_weight.shape)}, logits "
                             f"{tuple(router.logits.shape)}, experts {tuple(router.experts.shape)}")
        if rx_bm % ut:
            raise ValueError(f"the router's dx m-tile {rx_bm} must be a multiple of the UNPERMUTE block {ut}")
        ep = -(-n_r // 8) * 8  # dl's hi | lo halves: each row 2 * EP bf16 (16-byte aligned halves for TMA)
        r_x, r_wr = _tma_ready(router.x), _tma_ready(router.router_weight)
        r_logits = router.logits.float().contiguous()
        r_experts = router.experts.to(torch.int32).contiguous()
        dlhl = torch.empty((max(n_tok, 1), 2 * ep), dtype=torch.bfloat16, device=dev_)
        dx = torch.empty((n_tok, h), dtype=torch.bfloat16, device=dev_)
        d_router = torch.empty((n_r, h), dtype=torch.float32, device=dev_)
        if n_tok == 0:  # no token: dWr = 0 (an empty sum), nothing else to compute (no zero-row descriptor)
            d_router.zero_()
            stages &= ~((1 << BWD_ROUTER_DL) | (1 << BWD_ROUTER_DW) | (1 << BWD_ROUTER_DX))
        n_tb = -(-n_tok // rx_bm)
    if WGRAD_PAD_ROWS % w2t[2] or bm % w2t[2]:
        raise ValueError(f"the wgrad row step {w2t[2]} must divide the pad {WGRAD_PAD_ROWS} and the m-tile {bm}")
    counts32, offs, first_mtile, elp2, max_mt = _mtile_plan(counts, r_pad, bm, pad_offs)
    bf = dict(dtype=torch.bfloat16, device=dev_)
    z, dgu, hb, dx_rows = (torch.empty((r_pad, n), **bf) for n in (f, 2 * f, f, h))
    dw_rows = torch.empty((r_pad,), dtype=torch.float32, device=dev_)
    dw13, dw2 = _weight_grads_like(w13, w2, out_dtype)
    dx_e = torch.empty((n_tok, h), dtype=torch.float32, device=dev_)
    scratch_n = int(SCB_MTILES.value) + 2 * max_mt + (n_tb if router is not None else 0)
    ws = runtime.get_workspace(None, dev_) if dev_.type == "cuda" else None
    errors = runtime.one_rank_errors(ws, dev_)  # (at W = 1 no peer: the workspace is a plain 1 MiB buffer)
    if dev_.type == "cuda":
        scratch = ws.local("moe_bwd.scratch", scratch_n, torch.int32)
        epoch_slot = ws.local("moe_bwd.epoch", 1, torch.int32)  # its own: nothing else keeps step with it
        grid = programs or runtime.num_sms(dev_)
        timeout_ns = ws.timeout_ns() if timeout_ns is None else timeout_ns
    else:  # the interpreter (or dev/kernel_resources' compile-only run): fresh buffers
        scratch = torch.zeros(scratch_n, dtype=torch.int32)
        epoch_slot = torch.zeros(1, dtype=torch.int32)
        grid = programs or (BWD_INTERP_PROGRAMS if planning.interpreting() else 132)
        if timeout_ns is None:  # the interpreter runs programs one after another: a correct launch never spins
            timeout_ns = BWD_INTERP_TIMEOUT_NS if planning.interpreting() else int(runtime.DEFAULT_TIMEOUT_S * 1e9)
    if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != (grid, TRACE_EVENTS.value, 4)
                              or trace.device != dev_):
        raise ValueError(f"trace must be an int64 [{grid}, {TRACE_EVENTS.value}, 4] tensor on {dev_}, got "
                         f"{trace.dtype} {tuple(trace.shape)} on {trace.device}")
    runtime.ensure_triton_allocator()
    _moe_backward_experts_kernel[(grid,)](
        dy_rows, do_rows, x_rows, gu.contiguous(), w_pair.float().contiguous(), valid.contiguous().view(torch.uint8),
        w13, w2, offs, counts32, first_mtile, inv,
        z, dgu, hb, dw_rows, dx_rows, dw13, dw2, dx_e,
        *((r_x, r_wr, r_logits, r_experts, dlhl, dx, d_router, n_r, ep, float(router.routed_scaling))
          if router is not None else (errors,) * 7 + (0, 0, 1.0)),
        scratch, scratch_n, max_mt, errors, epoch_slot, max(1, timeout_ns // 1000), stages,
        errors if trace is None else trace, n_tok, h, f, n_exp, r_pad, *_no_ep_args(errors),
        TOPK=top_k, ELP2=elp2, PAD=WGRAD_PAD_ROWS, BM=bm, BN=bn, BK=bk, GEMM_STAGES=gemm_stages,
        TMA2=_tma_weight(w2) and dy_rows.data_ptr() % 16 == 0, TMA1=_tma_weight(w13) and dgu.data_ptr() % 16 == 0,
        SW_BR=sw_br, SW_BF=sw_bf, W2_BI=w2t[0], W2_BJ=w2t[1], W1_BI=w1t[0], W1_BJ=w1t[1], W_BR=w2t[2],
        W2_STAGES=w2t[3], W1_STAGES=w1t[3], UT=ut, UBH=ubh, GRID=grid, DOT_FP32=planning.interpreting(),
        SWIGLU_ON_COMPLETION=config.swiglu_on_completion, TRACE=trace is not None, WGRAD1_SYNC=config.wgrad1_sync,
        WGRAD_DYNAMIC=config.wgrad_dynamic, WGRAD_DYNAMIC_16THS=config.wgrad_dynamic_16ths,
        LEAN_DGRAD1=config.dgrad1_lean, SW_STAGES=config.swiglu_stages, W_NK=nk,
        **(dict(ROUTER=True, SOFTMAX=router.routing == "softmax", RENORM=bool(router.renormalize),
                ERP2=triton.next_power_of_2(n_r), RUT=rut, RX_BM=rx_bm,
                RX_BN=rx_bn, RX_BK=rx_bk, RW_BI=rw_bi, RW_BJ=rw_bj, RW_BR=rw_br, R_STAGES=r_stages)
           if router is not None else {}),
        num_warps=warps, num_stages=gemm_stages)
    runtime.after_one_rank_launch(ws, dev_, errors)
    if router is not None:
        return dx, dw_rows, dw13, dw2, d_router
    return dx_e, dw_rows, dw13, dw2


def expert_backward_ep_launch(x, dy, weights, experts, w13, w2, bufs: dict, *, rank: int, world: int, epoch_slot,
                              timeout_ns: int, grid: int, out_dtype: torch.dtype = torch.bfloat16,
                              router: RouterBackward | None = None, stages: int = BWD_ALL_STAGES, final: bool = True,
                              outs: dict | None = None, trace: torch.Tensor | None = None, policy: str = "self",
                              comm_programs: int | None = None, config: MoEBackwardConfig | None = None):
    """moe_backward at W > 1 (all of it but the logits GEMM) in ONE launch with its exchanges (this module's
    docstring) on explicit buffers: x, dy [T, H] bf16 (this rank's tokens), weights [T, k] fp32 and experts [T, k]
    (global ids) of the forward's decision, w13 [E/W, H, 2F] / w2 [E/W, F, H] this rank's experts. ``bufs``:
    ``layout`` (EPLayout), ``data`` (this rank's symmetric bytes), ``sig`` / ``ctr`` (its signals, counters),
    ``peer_data`` / ``peer_sig`` / ``peer_ctr`` (int64 address tables), ``errors``, ``scratch`` (int32, zeroed
    once), and ep_local_buffers' entries. ``epoch_slot``: the rank's device epoch (the workspace's: shared with
    every op on it, as the done flags are). ``stages`` / ``final``: the CPU tests' phases (EP_PHASES; only the
    launch with ``final`` ends the call) and a stage left out; ``outs``: the outputs of an earlier phase launch
    of the same call (returned by this one). Returns (dx_e [T, H] fp32 -- or, with ``router``, dx [T, H] bf16 --,
    dweights [T, k] fp32 (the pairs' gate gradients, a copy), dw13, dw2 in ``out_dtype``[, d_router [E, H] fp32])
    and the outs dict as the last element. ``policy="fixed"`` with ``comm_programs=S`` (1 <= S < grid): the
    fixed-role ablation -- programs pid < S run only the communication stages (BWD_COMM_STAGES), the others only
    the rest; the same arithmetic and row order, so the same bits as the self policy. On the CPU its phases are
    EP_PHASES_FIXED (DISPATCH-BWD alone), not EP_PHASES."""
    config = check_config(MoEBackwardConfig, config)
    pol, fixed_comm = policy_args(policy, comm_programs, grid)  # 1 <= S < grid: both roles need a program
    if policy == "fixed" and world < 2:
        raise ValueError("policy='fixed': no communication at world size 1 (the fixed-role split needs W > 1)")
    lay: EPLayout = bufs["layout"]
    n_tok, h = x.shape
    k = experts.shape[1]
    el, f, _ = w2.shape
    dev_ = x.device
    nk = weights_nk(w13)
    (bm, bn, bk, gemm_stages), (sw_br, sw_bf), w2t, w1t, (ut, ubh), warps = _bwd_tiles(out_dtype, h, f, nk)
    rut, (rx_bm, rx_bn, rx_bk), (rw_bi, rw_bj, rw_br), r_stages = _router_tiles()
    xb, xbh = ep_tiles()
    if n_tok == 0:
        raise ValueError("the one launch at W > 1 needs T >= 1 tokens per rank (its COMBINE-BWD publishes the counts)")
    if lay.fold_blocks != -(-n_tok // ut) or lay.max_rows != world * n_tok * min(k, el):
        raise ValueError(f"bufs['layout'] was made for another shape than T={n_tok}, k={k}, E/W={el}, W={world}")
    if router is not None and rx_bm % ut or rx_bm % rut:
        raise ValueError(f"the router's dx m-tile {rx_bm} must be a multiple of the UNPERMUTE block {ut} and the "
                         f"dlogits block {rut}")
    recv_x, recv_dy, meta, wts, cnt, comb_x, comb_dw = lay.regions(bufs["data"], world, n_tok, h, k, el)
    exp32 = experts.to(torch.int32).contiguous()
    x_b = _tma_ready(x)
    if outs is None:  # this call's first launch: the pairs' places, the outputs
        place, per = ep_pair_places(experts, el * world)
        dw13, dw2 = _weight_grads_like(w13, w2, out_dtype)
        outs = dict(place=place, per=per, dw13=dw13, dw2=dw2,
                    dx_e=torch.empty((n_tok, h), dtype=torch.float32, device=dev_))
        bufs["iota"].copy_(torch.arange(n_tok * k, dtype=torch.int32, device=dev_))
        if router is not None:
            n_r = router.router_weight.shape[0]
            ep = -(-n_r // 8) * 8
            outs.update(dlhl=torch.empty((n_tok, 2 * ep), dtype=torch.bfloat16, device=dev_),
                        dx=torch.empty((n_tok, h), dtype=torch.bfloat16, device=dev_),
                        d_router=torch.empty((n_r, h), dtype=torch.float32, device=dev_))
    if router is not None:
        if router.routing not in ("softmax", "sigmoid-grouped"):
            raise ValueError(f"unknown routing {router.routing!r}; choose from softmax, sigmoid-grouped")
        n_r = router.router_weight.shape[0]
        ep = -(-n_r // 8) * 8
        r_args = (x_b, _tma_ready(router.router_weight), router.logits.float().contiguous(), exp32, outs["dlhl"],
                  outs["dx"], outs["d_router"], n_r, ep, float(router.routed_scaling))
        n_tb = -(-n_tok // rx_bm)
    else:
        r_args = (x_b, bufs["errors"], bufs["errors"], exp32, bufs["errors"], bufs["errors"], bufs["errors"], 0, 0,
                  1.0)
        n_tb = 0
    xs_base = int(SCB_MTILES.value) + 2 * lay.max_mtiles + n_tb
    scratch_n = xs_base + 6 + el + 2 * lay.max_mtiles
    if bufs["scratch"].numel() < scratch_n:
        raise ValueError(f"bufs['scratch'] holds {bufs['scratch'].numel()} int32, the launch needs {scratch_n}")
    if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != (grid, TRACE_EVENTS.value, 4)):
        raise ValueError(f"trace must be an int64 [{grid}, {TRACE_EVENTS.value}, 4] tensor")
    b = bufs
    runtime.ensure_triton_allocator()
    _moe_backward_experts_kernel[(grid,)](
        b["dy_rows"], b["do_rows"], b["x_rows"], b["gu"], b["w_pair"], b["valid"], w13, w2,
        b["pad_offs"], b["counts"], b["first_mtile"], b["iota"],
        b["z"], b["dgu"], b["h"], b["dw_rows"], b["dx_rows"], outs["dw13"], outs["dw2"], outs["dx_e"],
        *r_args, b["scratch"], scratch_n, lay.max_mtiles, b["errors"], epoch_slot, max(1, timeout_ns // 1000), stages,
        b["errors"] if trace is None else trace, n_tok, h, f, el, lay.r_pad,
        dy.to(torch.bfloat16).contiguous(), weights.float().contiguous(), outs["place"], outs["per"], recv_x, recv_dy,
        meta, wts, cnt, comb_x, comb_dw, b["peer_data"], b["peer_sig"], b["peer_ctr"], b["sig"], b["ctr"],
        lay.off_recv_x, lay.off_recv_dy, lay.off_meta, lay.off_w, lay.off_cnt, lay.off_comb_x, lay.off_comb_dw,
        b["row_meta"], b["base"], xs_base, rank, fixed_comm,
        TOPK=k, ELP2=triton.next_power_of_2(max(el, 1)), PAD=WGRAD_PAD_ROWS, BM=bm, BN=bn, BK=bk,
        GEMM_STAGES=gemm_stages, TMA2=_tma_weight(w2), TMA1=_tma_weight(w13), SW_BR=sw_br, SW_BF=sw_bf,
        W2_BI=w2t[0], W2_BJ=w2t[1], W1_BI=w1t[0], W1_BJ=w1t[1], W_BR=w2t[2], W2_STAGES=w2t[3], W1_STAGES=w1t[3],
        UT=ut, UBH=ubh, GRID=grid, SWIGLU_ON_COMPLETION=config.swiglu_on_completion, WGRAD1_SYNC=config.wgrad1_sync,
        WGRAD_DYNAMIC=config.wgrad_dynamic, WGRAD_DYNAMIC_16THS=config.wgrad_dynamic_16ths,
        DOT_FP32=planning.interpreting(),
        TRACE=trace is not None,
        **(dict(ROUTER=True, SOFTMAX=router.routing == "softmax", RENORM=bool(router.renormalize),
                ERP2=triton.next_power_of_2(router.router_weight.shape[0]), RUT=rut, RX_BM=rx_bm, RX_BN=rx_bn,
                RX_BK=rx_bk, RW_BI=rw_bi, RW_BJ=rw_bj, RW_BR=rw_br, R_STAGES=r_stages) if router is not None else {}),
        WORLD=world, WP2=triton.next_power_of_2(world), KP2=triton.next_power_of_2(k), XB=xb, XBH=xbh,
        TMA_GU=_tma_weight(w13) and h % 8 == 0 and 2 * f % 8 == 0, FINAL=final, FLAG_BASE=runtime.FLAG_BASE,
        DONE_BASE=runtime.DONE_BASE, POLICY=pol, W_NK=nk, num_warps=warps, num_stages=gemm_stages)
    dweights = comb_dw.view(n_tok, k).clone()  # the workspace's rows: the next call overwrites them
    first = outs["dx"] if router is not None else outs["dx_e"]
    res = (first, dweights, outs["dw13"], outs["dw2"]) + ((outs["d_router"],) if router is not None else ())
    return res + (outs,)
