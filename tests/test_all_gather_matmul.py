"""AllGather+GEMM (kosmos.all_gather_matmul): every platform's cases, by marker (see conftest.py).

* ``interpreter`` -- W simulated ranks in one process under the Triton CPU interpreter. Programs of a launch
  run one after another there, so the ranks' phases are ordered by hand with the fixed-role policy:
  ``COMM_ONLY`` (``comm_programs=grid``) or ``COMPUTE_ONLY`` (``0``), so that no program ever waits on
  something that has not been started. The self-scheduling policy runs at W=1, and at W=2 with the peer's
  part of the call done beforehand. Timeouts: a missing peer makes a bounded wait give up, no hang.
* ``gpu_optional`` / unmarked -- input checks: a ValueError before anything is launched (opcases.InputChecks).
* ``gpu`` -- W=1 on one GPU through the public op; the error mirror on a timeout. References in fp32, TF32 off.
* ``ranks`` -- W = 2..8 simulated ranks on one GPU, all launches resident at once (simranks.py).
* ``multi_gpu`` -- one process per GPU (W=2): a stalled peer. The W=2 correctness and back-to-back cases
  run this op interleaved with GEMM+RS: test_tp_ops_together.py.
"""
import re

import pytest
import torch

import opcases
from multiproc import Checks, stall_peer
from opcases import (COMM_ONLY, COMPUTE_ONLY, INTERP_GRID, SELF, SHAPES, SHORT_NS, TOL, W1_SHAPES, W1_VARIANTS,
                     WORLDS, randn, run_device_epochs, run_schedule, weight)
from simranks import AG, rand

from kosmos.core import codes, planning, runtime
from kosmos.config import AllGatherMatmulConfig
from kosmos.ops import all_gather_matmul as ag


# ==================================================================================== CPU interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("ms,k,n", SHAPES)
def test_all_gather_matmul_epochs(world, ms, k, n):
    t = AG(world, ms, k, n, seed=world * 100 + ms)
    run_schedule(t, [(r, phase) for phase in (COMM_ONLY, COMPUTE_ONLY) for r in range(world)])


MX_SHAPES = [  # K a multiple of 32 (MX blocks); interpreter BK = 16, so a block spans two K steps
    pytest.param(21, 64, 48, id="ms21-k64-n48"),
    pytest.param(5, 32, 24, id="ms5-k32-n24"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("ms,k,n", MX_SHAPES)
def test_all_gather_matmul_mxfp8_epochs(world, ms, k, n):
    """MXFP8 shards: the payload and scales arrive bit for bit, c matches the fp32 product of the dequantized
    values (gathered buffers poisoned with 0xFF bytes -- NaN payload and NaN scales -- each epoch)."""
    t = AG(world, ms, k, n, seed=world * 100 + ms + 5, mx=True)
    run_schedule(t, [(r, phase) for phase in (COMM_ONLY, COMPUTE_ONLY) for r in range(world)])


@pytest.mark.interpreter
@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_matmul_fp8_block_epochs(world):
    """fp8-block shards (1x128, K 256: two scale blocks) and weight (128x128, k-major): the payload and the fp32
    scales' bytes arrive bit for bit, c matches the fp32 product of the dequantized values on the SCALED
    mainloop (no DEQ task; gathered buffers poisoned with 0xFF bytes each epoch)."""
    t = AG(world, 21, 256, 48, seed=world * 100 + 8, fp8=True)
    run_schedule(t, [(r, phase) for phase in (COMM_ONLY, COMPUTE_ONLY) for r in range(world)])


@pytest.mark.interpreter
def test_all_gather_matmul_fp8_block_self_policy_world2():
    run_schedule(AG(2, 21, 256, 48, seed=13, fp8=True), [(1, COMM_ONLY), (0, SELF), (1, COMPUTE_ONLY)])


@pytest.mark.interpreter
def test_all_gather_matmul_mxfp8_self_policy_world2():
    run_schedule(AG(2, 21, 64, 48, seed=12, mx=True), [(1, COMM_ONLY), (0, SELF), (1, COMPUTE_ONLY)])


@pytest.mark.interpreter
@pytest.mark.parametrize("ms,k,n", SHAPES)
def test_all_gather_matmul_self_policy_world1(ms, k, n):
    run_schedule(AG(1, ms, k, n, seed=7), [(0, SELF)], flags=False)


@pytest.mark.interpreter
def test_all_gather_matmul_self_policy_world2():
    """Rank 1 pushes first (comm only); rank 0 then runs the whole call self-scheduled (its pushes, its own
    slot, rank 1's slot); rank 1 computes last."""
    run_schedule(AG(2, 21, 40, 48, seed=11), [(1, COMM_ONLY), (0, SELF), (1, COMPUTE_ONLY)])


@pytest.mark.interpreter
def test_all_gather_matmul_self_policy_copies_after_compute():
    """Self policy: the pushes come before any compute tile, the own-slot COPY tasks after the last one is
    claimed. Under the interpreter program 0 runs first and takes every task, so its trace is the order."""
    from kosmos.core.schedule import TRACE_EVENTS
    t = AG(2, 75, 40, 48, seed=23)
    t.new_epoch_inputs()
    t.launch(1, 1, **COMM_ONLY)
    trace = torch.zeros(INTERP_GRID, TRACE_EVENTS, 4, dtype=torch.int64)
    t.launch(0, 1, trace=trace, policy="self")
    t.launch(1, 1, **COMPUTE_ONLY)
    t.check_outputs()
    n_push = planning.ag_push_tasks(2, 75, t.cfg.BM, 1)
    chunks = -(-75 // t.cfg.BM)
    ev = [tuple(e) for e in trace[0].tolist() if e[0]]  # (kind, task, t0, t1); unused rows are zeros
    kinds = [("push" if task < n_push else "copy") if kind == 1 else "tile" for kind, task, _, _ in ev if kind != 3]
    n_tiles = 2 * chunks * -(-48 // t.cfg.BN)
    assert kinds == ["push"] * n_push + ["tile"] * n_tiles + ["copy"] * chunks, kinds
    assert trace[1:].abs().sum() == 0  # the other programs found every queue empty


@pytest.mark.interpreter
@pytest.mark.parametrize("per_task,block", [
    (2, 256),   # 2 chunks per task (a peer's 5 chunks as 2 + 2 + 1); copy steps of 256 elements, < a chunk
    (8, 1024),  # more chunks per task than a shard has: one task moves all 5
])
def test_all_gather_matmul_comm_tasks_of_several_chunks(per_task, block):
    """AllGatherMatmulConfig(push_chunks, copy_block): tasks moving several strided chunks (each flagged as it
    lands), copy steps smaller than a chunk; 5 chunks of 16 rows, the last one ragged."""
    config = AllGatherMatmulConfig(push_chunks=per_task, copy_block=block)
    run_schedule(AG(3, 75, 40, 48, seed=17, config=config),
                 [(r, phase) for phase in (COMM_ONLY, COMPUTE_ONLY) for r in range(3)])
    run_schedule(AG(2, 75, 40, 48, seed=19, config=config), [(1, COMM_ONLY), (0, SELF), (1, COMPUTE_ONLY)])


@pytest.mark.interpreter
def test_all_gather_matmul_b_kmajor():
    run_schedule(AG(2, 21, 40, 48, seed=13, b_kmajor=True),
                 [(r, phase) for phase in (COMM_ONLY, COMPUTE_ONLY) for r in range(2)])


# ----------------------------------------------------------------------------------- the device epoch
@pytest.mark.interpreter
@pytest.mark.parametrize("world,mx,schedule", [
    pytest.param(1, False, [(0, SELF)], id="w1"),
    pytest.param(1, True, [(0, SELF)], id="w1-mxfp8"),  # the DEQ flags are local flags of the epoch
    pytest.param(2, False, [(1, COMM_ONLY), (0, SELF), (1, COMPUTE_ONLY)], id="w2-self"),
    pytest.param(3, False, [(r, COMM_ONLY) for r in range(3)] + [(r, COMPUTE_ONLY) for r in range(3)], id="w3"),
])
def test_all_gather_matmul_device_epoch(world, mx, schedule):
    """No epoch from the host: each launch reads its rank's slot and the last one of a call advances it by one;
    the same launch arguments again and again (a replay) give right results on fresh data every call."""
    t = AG(world, 21, 64 if mx else 40, 48, seed=53 + world, mx=mx)
    run_device_epochs(t, schedule)


@pytest.mark.interpreter
def test_all_gather_matmul_replay_without_the_peer_waits_for_the_next_epoch():
    """After 2 calls rank 1's flags hold 2; rank 0 launching a third time alone (a replay its peer did not
    make) must not take those flags for this call's rows: it waits for 3, times out, records it, still ends."""
    t = AG(2, 21, 40, 48, seed=59)
    run_device_epochs(t, [(1, COMM_ONLY), (0, SELF), (1, COMPUTE_ONLY)], calls=2)
    t.launch(0, None, timeout_ns=SHORT_NS, **COMPUTE_ONLY)
    err = t.rk.errors[0].tolist()
    assert err[0] != 0 and codes.wait_tag(err) == codes.WAIT_AG_ROWS.value, runtime.decode_error(err)
    assert (err[5], err[6]) == (4, 3), runtime.decode_error(err)  # expected this call's epoch, observed the last
    assert t.rk.heads[0].tolist() == [0] * runtime.NUM_HEADS
    assert t.rk.device_epochs() == [4, 3]


# ------------------------------------------------------------------------------------ interpreter timeouts
@pytest.mark.interpreter
def test_all_gather_matmul_timeout_peer_never_pushed():
    t = AG(2, 21, 40, 48, seed=29)
    t.new_epoch_inputs()
    mirror = torch.zeros(codes.ERR_RECORD, dtype=torch.int64)  # the host mirror: the recording program writes it too
    t.rk.errors[0][codes.ERR_MIRROR.value] = mirror.data_ptr()
    t.launch(0, 1, timeout_ns=SHORT_NS, **COMPUTE_ONLY)  # returns: no hang
    err = t.rk.errors[0].tolist()
    assert err[0] != 0
    msg = runtime.decode_error(err)
    assert "all_gather_matmul" in msg and "rank 0" in msg
    chunks = -(-21 // t.cfg.BM)
    assert codes.op_code(err) == ag.OP_CODE and err[2] == 0
    assert err[3] >= 0  # a compute task, not the handshake
    assert err[4] == runtime.FLAG_BASE + 1 * chunks + 0  # rank 1's first chunk
    assert codes.wait_tag(err) == codes.WAIT_AG_ROWS.value and "rows pushed by a peer" in msg
    assert err[5] == 1 and err[6] == 0  # expected epoch 1, observed nothing
    assert t.rk.heads[0].tolist() == [0] * runtime.NUM_HEADS  # the launch still ended cleanly
    assert mirror.tolist() == err[:codes.ERR_RECORD]
    assert t.rk.errors[1].tolist() == [0] * runtime.ERR_SLOTS


@pytest.mark.interpreter
def test_handshake_timeout_when_peer_did_not_finish_previous_call():
    """A rank's first push of call e waits for every peer's done >= e-1: a peer that never ran call 1 makes
    rank 0's call 2 time out on the handshake (task -1)."""
    t = AG(2, 21, 40, 48, seed=37)
    t.new_epoch_inputs()
    t.launch(0, 1, **COMM_ONLY)  # rank 0 pushes call 1's rows; rank 1 never runs call 1
    t.rk.check_clean(0)
    t.launch(0, 2, timeout_ns=SHORT_NS, **COMM_ONLY)
    err = t.rk.errors[0].tolist()
    assert err[0] != 0 and err[3] == -1
    assert err[4] == 1 and err[5] == 1 and err[6] == 0  # peer 1's done flag
    assert codes.wait_tag(err) == codes.WAIT_PEERS_DONE.value
    msg = runtime.decode_error(err)
    assert "all_gather_matmul: rank 0 timed out" in msg and "rank 1 to finish the previous call" in msg
    assert t.rk.heads[0].tolist() == [0] * runtime.NUM_HEADS


@pytest.mark.interpreter
def test_handshake_timeout_does_not_overwrite_peer_rows():
    t = AG(2, 21, 40, 48, seed=41)
    t.new_epoch_inputs()
    t.launch(0, 1, **COMM_ONLY)  # rank 1 never finishes call 1
    before = t.rk.data[1].clone()
    t.shards[0].copy_(rand(21, 40, gen=t.gen))  # call 2's rows differ from call 1's
    t.launch(0, 2, timeout_ns=SHORT_NS, **COMM_ONLY)
    assert t.rk.errors[0][0] != 0
    # bit patterns: the buffer holds NaN poison, and NaN != NaN
    assert torch.equal(t.rk.data[1].view(torch.int16), before.view(torch.int16)), \
        "rank 0 overwrote rank 1's gathered rows after the timeout"


# ======================================================================================= input checks
class TestInputChecks(opcases.InputChecks):
    name = "all_gather_matmul"

    def test_valid_trace_buffer_passes(self, fake_world):
        trace = opcases.cuda(torch.zeros(opcases.SMS, 1024, 4, dtype=torch.int64))
        with pytest.raises(opcases.Reached):
            self.op(opcases.cuda(opcases.bf16(24, 16)), opcases.cuda(opcases.bf16(16, 32)), trace=trace)

    def test_all_gather_any_shard_rows_at_world_3(self, fake_world):
        ws = fake_world["set_world"](3, rank=1)
        with pytest.raises(opcases.Reached):
            self.op(opcases.cuda(opcases.bf16(7, 16)), opcases.cuda(opcases.bf16(16, 8)))
        assert ws.calls == ["ensure"]


def test_cpu_tensor_unpatched():
    """Without any patching the public op rejects CPU tensors (nothing CUDA is touched first)."""
    import kosmos
    bf16 = opcases.bf16
    with pytest.raises(ValueError, match="CUDA"):
        kosmos.all_gather_matmul(bf16(8, 16), bf16(16, 8))
    with pytest.raises(ValueError, match="bfloat16"):
        kosmos.all_gather_matmul(torch.zeros(8, 16), torch.zeros(16, 8))


# ============================================================================================ one GPU
@pytest.mark.gpu
def test_w1_timeout_reaches_the_host_through_the_error_mirror():
    """One GPU, a launch told it has a peer (world 2) that never pushes: its bounded waits time out, the
    program that records the error writes it into the pinned host mirror too, and the workspace raises a
    KosmosTimeoutError naming the op, the rank and the awaited counter -- no hang, no device-to-host copy."""
    import triton
    dev = torch.device("cuda", 0)
    runtime.reset_workspaces()
    ws = runtime.get_workspace(None, dev)
    ms, k, n = 256, 128, 256
    cfg = planning.tile_config(ms, n, k, programs=runtime.num_sms(dev))
    ws.ensure(2 * ms * k * 2, 2 * triton.cdiv(ms, cfg.BM))
    runtime.ensure_triton_allocator()
    gen = torch.Generator().manual_seed(5)
    a, b = randn((ms, k), gen, dev), randn((k, n), gen, dev)
    c = torch.empty(2 * ms, n, dtype=torch.bfloat16, device=dev)
    gather = ws.data[: 2 * ms * k * 2].view(torch.bfloat16).view(2 * ms, k)
    fake_peers = lambda t: torch.tensor([t.data_ptr()] * 2, dtype=torch.int64, device=dev)  # noqa: E731
    ws.before_launch()
    ag.launch(a, b, False, c, gather, fake_peers(ws.data), fake_peers(ws.signals), ws.signals, ws.heads,
              ws.errors, rank=0, world=2, epoch_slot=ws.epoch_slot, timeout_ns=2_000_000,
              grid=runtime.num_sms(dev), cfg=cfg, policy="fixed", comm_programs=0)  # compute only: never pushed
    ws.after_launch()
    try:
        with pytest.raises(runtime.KosmosTimeoutError, match=r"all_gather_matmul: rank 0 \(task \d+\) timed out") as e:
            ws.check_errors()
        chunks = triton.cdiv(ms, cfg.BM)  # whichever program timed out first: a flag of the fake peer's chunks
        counter = int(re.search(r"signal slot (\d+)", str(e.value)).group(1))
        assert runtime.FLAG_BASE + chunks <= counter < runtime.FLAG_BASE + 2 * chunks, e.value
        assert ws.errors[:runtime.ERR_RECORD].tolist() == ws._err_host.tolist()  # the mirror holds the device record
    finally:
        runtime.reset_workspaces()


@pytest.mark.gpu
@pytest.mark.parametrize("ms,k,n", W1_SHAPES)
@pytest.mark.parametrize("pol,kmajor", W1_VARIANTS)
def test_w1_all_gather_matmul(no_tf32, ms, k, n, pol, kmajor):
    import kosmos
    from kosmos import reference
    gen = torch.Generator().manual_seed(ms * 7919 + k * 31 + n)
    a = randn((ms, k), gen, "cuda")
    b = weight(k, n, gen, "cuda", kmajor)
    a_full, c = kosmos.all_gather_matmul(a, b, **pol)
    kosmos.check_errors()
    assert c.dtype == torch.bfloat16 and tuple(c.shape) == (ms, n)
    assert torch.equal(a_full, a)
    _, ref = reference.all_gather_matmul_ref_local([a], b)
    assert reference.rel_err(c, ref) < TOL


@pytest.mark.gpu
def test_w1_trace_records_every_compute_task():
    opcases.w1_trace_records_every_compute_task("ag")


# ============================================================================ simulated ranks, one GPU
class TestOnRanks(opcases.OnRanksCases):
    op = "ag"

    @pytest.mark.parametrize("world", [2, 4, 8])
    def test_ag_fp8_block(self, world):
        """fp8-block shards and weight (K = 384: three scale blocks), all ranks resident: payload and scale bytes
        gathered bit for bit, outputs against the fp32 product of the dequantized values, each epoch fresh."""
        t = opcases.make("ag", world, seed=80 + world, k=384, fp8=True)
        for epoch in opcases.EPOCHS:
            t.new_epoch_inputs()
            t.launch_all(epoch)
            opcases.check_call(t, epoch)

    @pytest.mark.parametrize("world", [2, 4])
    @pytest.mark.parametrize("per_task,ms", [
        (4, 600),       # 5 chunks of 128 rows per shard, the last ragged: tasks of 4 chunks and of 1
        ("auto", 2600),  # 21 chunks per shard: "auto" gives 2 per task at W=2, 4 at W=4
    ])
    def test_ag_several_chunks_per_comm_task(self, world, per_task, ms):
        """AllGatherMatmulConfig(push_chunks, copy_block): comm tasks moving 4 strided chunks each (5 chunks of
        128 rows per shard, the last ragged), or as many as ``auto`` gives (21 chunks per shard: 2 per task at
        W=2, 4 at W=4), with copy steps smaller than a chunk."""
        config = AllGatherMatmulConfig(push_chunks=per_task, copy_block=1024)
        if per_task == "auto":
            assert planning.ag_comm_config(world, ms, 128, config)[0] == {2: 2, 4: 4}[world]
        t = opcases.make("ag", world, seed=50 + world, ms=ms, config=config)
        for epoch in opcases.EPOCHS:
            t.new_epoch_inputs()
            t.launch_all(epoch)
            opcases.check_call(t, epoch)


# ========================================================================================= multi-GPU
def _w2_stalled_peer(rank, world, out_dir):
    import kosmos
    from kosmos import reference
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", rank)
    check = Checks(rank)
    shards, bs = opcases.rank_inputs(3, world, (256, 512), (512, 768), dev)

    def poisoned_workspace_raises():  # a further call raises at once, before launching anything
        try:
            kosmos.all_gather_matmul(shards[rank], bs[rank])
            check(False, "a call on the poisoned workspace did not raise")
        except kosmos.KosmosTimeoutError:
            pass
    stall_peer(rank, lambda: kosmos.all_gather_matmul(shards[rank], bs[rank]), "all_gather_matmul", check,
               on_timeout=poisoned_workspace_raises)

    # recovered: a fresh workspace gives correct results again
    a_full, c = kosmos.all_gather_matmul(shards[rank], bs[rank])
    kosmos.check_errors()
    full, ref = reference.all_gather_matmul_ref_local(shards, bs[rank])
    check(torch.equal(a_full, full) and reference.rel_err(c, ref) < TOL, "wrong result after reset_workspaces()")
    check.finish(out_dir)


@pytest.mark.multi_gpu
def test_w2_stalled_peer_times_out(tmp_path):
    opcases.spawn(_w2_stalled_peer, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("ms,k,n", [(1000, 512, 640), (256, 8192, 1024), (64, 96, 256)])
def test_w1_all_gather_matmul_mxfp8(no_tf32, ms, k, n):
    """The public op on an MXTensor at W=1: c against the fp32 product of the dequantized values (and against
    the bf16 input, within the MX bound); a_full is the input itself; repeated calls bitwise equal."""
    import kosmos
    from kosmos import quant, reference
    gen = torch.Generator().manual_seed(ms + k + n)
    x = randn((ms, k), gen, "cuda")
    b = weight(k, n, gen, "cuda", False)
    mx = quant.quantize_mx(x)
    a_full, c = kosmos.all_gather_matmul(mx, b)
    kosmos.check_errors()
    assert a_full is mx
    ref = mx.dequantize(torch.float32) @ b.float()
    assert reference.rel_err(c, ref) < TOL
    assert reference.rel_err(c, x.float() @ b.float()) < 0.1  # MX rounding of x: ~2**-4 relative per element
    assert torch.equal(kosmos.all_gather_matmul(mx, b)[1], c)


@pytest.mark.gpu
@pytest.mark.parametrize("ms,k,n", [(1000, 512, 640), (256, 8192, 1024), (64, 96, 256), (300, 1056, 264)])
def test_w1_all_gather_matmul_quantizes_inside(no_tf32, ms, k, n):
    """precision="mxfp8" on a bf16 a_shard at W=1 (on an H200: the Gluon kernel, kernels/w1_mx_matmul.py, rounding
    A in its row pass): a_full is quant.mx_round(a) bit for bit, c is bitwise the op on quantize_mx(a) (the same
    kernel expanding the MXTensor: the MMA sees the same values) and within TOL of the fp32 product of the MX
    values; repeated calls are bitwise equal."""
    import kosmos
    from kosmos import quant, reference
    from kosmos.gemm.w1_mx import unavailable
    assert unavailable(torch.device("cuda")) is None or torch.cuda.get_device_capability() != (9, 0)
    gen = torch.Generator().manual_seed(ms + k + n + 7)
    x = randn((ms, k), gen, "cuda")
    b = weight(k, n, gen, "cuda", False)
    values, c = kosmos.all_gather_matmul(x, b, precision="mxfp8")
    kosmos.check_errors()
    assert torch.equal(values.view(torch.int16), quant.mx_round(x).view(torch.int16))
    c_mx = kosmos.all_gather_matmul(quant.quantize_mx(x), b)[1]
    assert torch.equal(c, c_mx)
    assert reference.rel_err(c, quant.mx_round(x).float() @ b.float()) < TOL
    assert torch.equal(kosmos.all_gather_matmul(x, b, precision="mxfp8")[1], c)


def test_w1_mx_tile_width_rule():
    """kernels/w1_mx_matmul.tile_width: 128 x 256 where its waves fill the SMs as well as 128 x 128's would (the
    llama3 per-rank shapes keep it), 128 x 128 where 128 x 256 leaves a thin last wave (1.45 waves at 1024 x
    6144 on 132 SMs: 2 waves against 3 half-size ones at MX_TILE128_RATE) or both make under one."""
    from kosmos.gemm.w1_mx import tile_width
    for m, n in [(4096, 5120), (8192, 28672), (16384, 8192), (4096, 8192), (1024, 3072), (2048, 5120)]:
        assert tile_width(m, n, 132) == 256, (m, n)
    assert tile_width(1024, 6144, 132) == 128  # 2 waves of 128 x 256 against 3 of 128 x 128 (2.9)
    assert tile_width(256, 1536, 132) == 128  # under a wave either way: the smaller tile halves the time


LLAMA70B_TP2_RANK_GEMMS = [(s, n, k) for s in (4096, 8192, 16384)
                           for n, k in ((5120, 8192), (28672, 8192), (8192, 4096), (8192, 14336))]


def test_tp_route_is_one_decision_for_both_ops(monkeypatch):
    """ops.tp_common.tp_route, the one route decision of both TP ops: W = 1 bf16 self untraced -> the static GEMM;
    W = 1 MXFP8 where the Gluon kernel runs -> that kernel, or (w1_mx_pass_first's shapes) the host pass then the
    static GEMM; MXFP8 elsewhere -> the fused kernel, quantizing a bf16 A first; W > 1, traces, the fixed policy
    -> the fused kernel."""
    from kosmos.gemm import w1_mx
    from kosmos.ops import tp_common as tc
    bf16 = torch.empty(1, dtype=torch.bfloat16)
    mx = (torch.empty(1), torch.empty(1))  # an MXTensor is a (payload, scales) tuple
    trace = torch.empty(1)
    small, passy = (4096, 5120, 8192), (2048, 1536, 5120)  # a llama3 GEMM (Gluon) and an N = 1536 one (the pass)
    for gluon in (True, False):
        monkeypatch.setattr(w1_mx, "unavailable", lambda device, g=gluon: None if g else "no Gluon here")
        route = lambda w, a, q, shape, tr=None, pol="self": tc.tp_route(w, a, q, *shape, tr, pol, "dev", 132)  # noqa
        assert route(1, bf16, False, small) == (tc.W1_STATIC, None)
        assert route(1, bf16, False, small, tr=trace) == (tc.FUSED, None)
        assert route(1, bf16, False, small, pol="fixed") == (tc.FUSED, None)
        assert route(2, bf16, False, small) == (tc.FUSED, None)
        assert route(2, bf16, True, small) == (tc.FUSED, tc.PRE_QUANTIZE)
        assert route(2, mx, False, small) == (tc.FUSED, None)
        assert route(1, bf16, True, small, tr=trace) == (tc.FUSED, tc.PRE_QUANTIZE)
        if gluon:
            assert route(1, bf16, True, small) == (tc.W1_MX, None)
            assert route(1, mx, False, small) == (tc.W1_MX, None)
            assert route(1, bf16, True, passy) == (tc.W1_STATIC, tc.PRE_ROUND)
            assert route(1, mx, False, passy) == (tc.W1_STATIC, tc.PRE_EXPAND)
        else:
            assert route(1, bf16, True, small) == (tc.FUSED, tc.PRE_QUANTIZE)
            assert route(1, mx, False, passy) == (tc.FUSED, None)


def test_w1_mx_pass_first_rule():
    """tp_common.w1_mx_pass_first: the llama3-70b TP=2 per-rank GEMMs and launch-bound shapes stay on the Gluon kernel;
    N <= 1536 and badly filled Gluon waves at M >= 1024 take the pass + bf16 static GEMM."""
    from kosmos.ops.tp_common import w1_mx_pass_first
    for m, n, k in LLAMA70B_TP2_RANK_GEMMS + [(128, 256, 256), (256, 1536, 512), (256, 6144, 8192)]:
        assert not w1_mx_pass_first(m, n, k, 132), (m, n, k)
    for m, n, k in [(2048, 1536, 5120), (512, 1536, 7168), (6000, 5120, 14336), (3000, 3072, 7168)]:
        assert w1_mx_pass_first(m, n, k, 132), (m, n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("kmajor", [False, True])
def test_w1_mx_pass_first_path(no_tf32, kmajor):
    """A shape of common.w1_mx_pass_first's (N = 1536): from bf16, a_full is quant.mx_round(x) bit for bit and c is
    bitwise the bf16 op on those values (the same static GEMM); from the MXTensor, a_full is that MXTensor and c
    the same; GEMM+RS likewise; the plan's replays (second calls) give the same bits."""
    import kosmos
    from kosmos import quant, reference
    from kosmos.gemm import w1_mx as w1mx
    from kosmos.ops.tp_common import PRE_ROUND, W1_STATIC, TPRoute, tp_route, w1_mx_pass_first
    dev = torch.device("cuda", 0)
    ms, k, n = 2048, 1024, 1536
    if w1mx.unavailable(dev) is not None:
        pytest.skip("no W = 1 Gluon MX path on this GPU / Triton")
    assert w1_mx_pass_first(ms, n, k, runtime.num_sms(dev))
    assert tp_route(1, torch.empty(1), True, ms, n, k, None, "self", dev, runtime.num_sms(dev)) == TPRoute(
        W1_STATIC, PRE_ROUND)
    gen = torch.Generator().manual_seed(24)
    x = randn((ms, k), gen, "cuda")
    b = weight(k, n, gen, "cuda", kmajor)
    want_values = quant.mx_round(x)
    want_c = kosmos.all_gather_matmul(want_values, b)[1]
    assert reference.rel_err(want_c, want_values.float() @ b.float()) < TOL
    mx = quant.quantize_mx(x)
    for _ in range(2):
        values, c = kosmos.all_gather_matmul(x, b, precision="mxfp8")
        assert torch.equal(values.view(torch.int16), want_values.view(torch.int16))
        assert torch.equal(c, want_c)
        a_full, c_mx = kosmos.all_gather_matmul(mx, b)
        assert a_full is mx and torch.equal(c_mx, want_c)
        want_rs = kosmos.matmul_reduce_scatter(want_values, b)
        assert torch.equal(kosmos.matmul_reduce_scatter(x, b, precision="mxfp8"), want_rs)
        assert torch.equal(kosmos.matmul_reduce_scatter(mx, b), want_rs)
    kosmos.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("bn", [128, 256])
@pytest.mark.parametrize("ms,k,n,kmajor", [(1000, 512, 640, False), (300, 1056, 264, True), (2048, 2048, 1536, True)])
def test_w1_mx_kernel_each_tile_width(no_tf32, bn, ms, k, n, kmajor):
    """kernels/w1_mx_matmul at each tile width, ragged edges, both B layouts, rounding a bf16 A and expanding an
    MXTensor (outputs poisoned first): the values are quant.mx_round(a) bit for bit, c within TOL of the fp32
    product of the MX values, and both passes give the same c bitwise."""
    from kosmos import quant, reference
    from kosmos.gemm import w1_mx as w1mx
    dev = torch.device("cuda", 0)
    if w1mx.unavailable(dev) is not None:
        pytest.skip(w1mx.unavailable(dev))
    gen = torch.Generator().manual_seed(ms + k + n + bn)
    x = randn((ms, k), gen, "cuda")
    b = weight(k, n, gen, "cuda", kmajor)
    b_store = b.t() if kmajor else b  # the op's storage view: the weight [N, K] when kmajor
    ws = runtime.get_workspace(None, dev)
    outs = []
    for a, scales in [(x, None), tuple(quant.quantize_mx(x))]:
        ws.ensure(ms * k * 2, 0)
        ws.data[:ms * k * 2].fill_(0xFF)
        values, c = w1mx.w1_mx_call(a, scales, b_store, kmajor, ws, None, runtime.num_sms(dev),
                                    codes.OP_ALL_GATHER_MATMUL.value, scales is None, bn=bn)
        ws.check_errors()
        assert torch.equal(values.view(torch.int16), quant.mx_round(x).view(torch.int16))
        assert reference.rel_err(c, quant.mx_round(x).float() @ b.float()) < TOL
        outs.append(c)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
def test_w1_mx_kernel_timeout_reaches_the_host():
    """kernels/w1_mx_matmul's bounded wait: row block 0's counts poisoned (the row pass's releases can never reach
    them), a 2 ms timeout: the launch returns, the error record names the op, the chunk and the row pass, and the
    last program out still zeroes the counts."""
    from kosmos.gemm import w1_mx as w1mx
    dev = torch.device("cuda", 0)
    if w1mx.unavailable(dev) is not None:
        pytest.skip(w1mx.unavailable(dev))
    runtime.reset_workspaces()
    ws = runtime.get_workspace(None, dev)
    ms, k, n = 512, 1024, 512
    gen = torch.Generator().manual_seed(22)
    a, b = randn((ms, k), gen, dev), randn((k, n), gen, dev)
    ws.ensure(ms * k * 2, 0)
    values = ws.data[:ms * k * 2].view(torch.bfloat16).view(ms, k)
    c = torch.empty(ms, n, dtype=torch.bfloat16, device=dev)
    ws.ensure_counters(w1mx.counter_slots(ms, k))
    kcs = k // w1mx.KC
    ws.counters[1] = -(1 << 30)        # (row block 0, chunk 0)
    ws.counters[1 + kcs] = -(1 << 30)  # row block 0's total
    ws.timeout_s = 2e-3
    runtime.ensure_triton_allocator()
    try:
        ws.before_launch()
        kl = w1mx.w1_mx_matmul_launch(a, None, b, False, c, values, ws, runtime.num_sms(dev),
                                      codes.OP_ALL_GATHER_MATMUL.value)
        kl.kernel[kl.grid](*kl.args, **kl.kw)
        ws.after_launch()
        with pytest.raises(runtime.KosmosTimeoutError,
                           match=r"all_gather_matmul: rank 0 \(task \d+\) timed out .* column chunk 0 from the row "
                                 r"pass"):
            ws.check_errors()
        assert int(ws.counters.abs().sum()) == 0
    finally:
        runtime.reset_workspaces()


@pytest.mark.gpu
def test_w1_all_gather_matmul_quantizes_nonfinite_blocks():
    """A block holding a NaN or an Inf: quant.mx_round's 0x7FC0 in each of its elements, the other blocks exact."""
    import kosmos
    from kosmos import quant
    x = torch.randn(200, 1024, device="cuda").to(torch.bfloat16)
    x[3, 40] = float("nan")
    x[150, 999] = float("inf")
    x[199, 0] = -float("inf")
    b = torch.randn(1024, 256, device="cuda").to(torch.bfloat16)
    values, c = kosmos.all_gather_matmul(x, b, precision="mxfp8")
    kosmos.check_errors()
    assert torch.equal(values.view(torch.int16), quant.mx_round(x).view(torch.int16))
    assert torch.isnan(c[3]).all() and not torch.isnan(c[4]).any()


@pytest.mark.gpu
def test_mxfp8_bad_operands_raise():
    import kosmos
    from kosmos import quant
    x = torch.randn(128, 256, device="cuda").to(torch.bfloat16)
    b = torch.randn(256, 128, device="cuda").to(torch.bfloat16)
    mx = quant.quantize_mx(x)
    with pytest.raises(ValueError, match="scales"):
        kosmos.all_gather_matmul(quant.MXTensor(mx.payload, mx.scales[:, :4].contiguous()), b)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        kosmos.all_gather_matmul(quant.MXTensor(x, mx.scales), b)
    with pytest.raises(ValueError, match="multiple of 32"):
        p = torch.zeros(128, 48, device="cuda", dtype=torch.float8_e4m3fn)
        kosmos.all_gather_matmul(quant.MXTensor(p, torch.zeros(128, 1, device="cuda", dtype=torch.uint8)),
                                 b[:48])
