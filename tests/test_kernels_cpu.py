"""Both fused kernels under the Triton CPU interpreter, for W simulated ranks in one process.

Each rank's buffers are CPU tensors; the peer pointer tables hold their data_ptr()s. Programs of a launch
run one after another under the interpreter, so the ranks' phases are ordered by hand with the fixed-role
policy: ``comm_programs=grid`` (communicate only) or ``0`` (compute only), so that no program ever waits on
something that has not been started. The self-scheduling policy runs at W=1, and at W=2 with the peer's
part of the call done beforehand.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: need TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)",
                allow_module_level=True)

from kosmos import codes, planning, runtime  # noqa: E402
from kosmos.config import AllGatherMatmulConfig, MatmulReduceScatterConfig  # noqa: E402
from kosmos.kernels import all_gather_matmul as ag  # noqa: E402
from simranks import AG, RS, rand  # noqa: E402

GRID = 3
# A correct run never waits under the interpreter (phases are ordered); a broken one fails after ~5000 spins
# (one spin counts as 1000 ns) instead of hanging for minutes.
TIMEOUT_NS = 5_000_000
EPOCHS = (1, 2, 3)
SHAPES = [pytest.param(21, 40, 48, id="ms21-k40-n48"), pytest.param(5, 16, 24, id="ms5-k16-n24")]
WORLDS = [1, 2, 3]


COMM_ONLY = dict(policy="fixed", comm_programs=GRID)
COMPUTE_ONLY = dict(policy="fixed", comm_programs=0)
SELF = dict(policy="self")


# ------------------------------------------------------------------------------------------- AllGather+GEMM
def run_schedule(t, schedule, flags=True):
    """Run every epoch of EPOCHS with ``schedule`` = [(rank, policy kwargs), ...] in order, then check that
    every launch left its queue heads at zero, the done flags, the data flags and the outputs."""
    for epoch in EPOCHS:
        t.new_epoch_inputs()
        for r, pol in schedule:
            t.launch(r, epoch, **pol)
            t.rk.check_clean(r)
        t.rk.check_done(epoch)
        if flags:
            t.check_flags(epoch)
        t.check_outputs()


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("ms,k,n", SHAPES)
def test_all_gather_matmul_epochs(world, ms, k, n):
    t = AG(world, ms, k, n, seed=world * 100 + ms)
    run_schedule(t, [(r, phase) for phase in (COMM_ONLY, COMPUTE_ONLY) for r in range(world)])


@pytest.mark.parametrize("ms,k,n", SHAPES)
def test_all_gather_matmul_self_policy_world1(ms, k, n):
    run_schedule(AG(1, ms, k, n, seed=7), [(0, SELF)], flags=False)


def test_all_gather_matmul_self_policy_world2():
    """Rank 1 pushes first (comm only); rank 0 then runs the whole call self-scheduled (its pushes, its own
    slot, rank 1's slot); rank 1 computes last."""
    run_schedule(AG(2, 21, 40, 48, seed=11), [(1, COMM_ONLY), (0, SELF), (1, COMPUTE_ONLY)])


def test_all_gather_matmul_self_policy_copies_after_compute():
    """Self policy: the pushes come before any compute tile, the own-slot COPY tasks after the last one is
    claimed. Under the interpreter program 0 runs first and takes every task, so its trace is the order."""
    from kosmos.kernels.common import TRACE_EVENTS
    t = AG(2, 75, 40, 48, seed=23)
    t.new_epoch_inputs()
    t.launch(1, 1, **COMM_ONLY)
    trace = torch.zeros(GRID, TRACE_EVENTS, 4, dtype=torch.int64)
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


@pytest.mark.parametrize("per_task,block", [(2, 256), (8, 1024)])
def test_all_gather_matmul_comm_tasks_of_several_chunks(per_task, block):
    """AllGatherMatmulConfig(push_chunks, copy_block): tasks moving several strided chunks (each flagged as it
    lands), copy steps smaller than a chunk; 5 chunks of 16 rows, the last one ragged."""
    config = AllGatherMatmulConfig(push_chunks=per_task, copy_block=block)
    run_schedule(AG(3, 75, 40, 48, seed=17, config=config),
                 [(r, phase) for phase in (COMM_ONLY, COMPUTE_ONLY) for r in range(3)])
    run_schedule(AG(2, 75, 40, 48, seed=19, config=config), [(1, COMM_ONLY), (0, SELF), (1, COMPUTE_ONLY)])


def test_all_gather_matmul_b_kmajor():
    run_schedule(AG(2, 21, 40, 48, seed=13, b_kmajor=True),
                 [(r, phase) for phase in (COMM_ONLY, COMPUTE_ONLY) for r in range(2)])


# --------------------------------------------------------------------------------------- GEMM+ReduceScatter
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("ms,k,n", SHAPES)
def test_matmul_reduce_scatter_epochs(world, ms, k, n):
    t = RS(world, ms, k, n, seed=world * 100 + ms + 1)
    run_schedule(t, [(r, phase) for phase in (COMPUTE_ONLY, COMM_ONLY) for r in range(world)])


@pytest.mark.parametrize("ms,k,n", SHAPES)
def test_matmul_reduce_scatter_self_policy_world1(ms, k, n):
    run_schedule(RS(1, ms, k, n, seed=17), [(0, SELF)], flags=False)


def test_matmul_reduce_scatter_self_policy_world2():
    """Rank 1 computes first; rank 0 runs self-scheduled (its reduce tasks become ready while it computes,
    and are claimed early); rank 1 reduces last."""
    run_schedule(RS(2, 21, 40, 48, seed=19), [(1, COMPUTE_ONLY), (0, SELF), (1, COMM_ONLY)])


@pytest.mark.parametrize("world", [2, 3])
def test_matmul_reduce_scatter_push_partials(world):
    """MatmulReduceScatterConfig(push_partials=True): partials pushed into the owners' staging slots, reduced
    locally; both the phase-ordered and the self-scheduled schedules, several epochs."""
    config = MatmulReduceScatterConfig(push_partials=True)
    t = RS(world, 21, 40, 48, seed=23 + world, config=config)
    run_schedule(t, [(r, phase) for phase in (COMPUTE_ONLY, COMM_ONLY) for r in range(world)])
    if world == 2:
        run_schedule(RS(2, 21, 40, 48, seed=29, config=config), [(1, COMPUTE_ONLY), (0, SELF), (1, COMM_ONLY)])


def test_matmul_reduce_scatter_b_kmajor():
    run_schedule(RS(2, 21, 40, 48, seed=23, b_kmajor=True),
                 [(r, phase) for phase in (COMPUTE_ONLY, COMM_ONLY) for r in range(2)])


# ------------------------------------------------------------------------------------------------ timeouts
SHORT_NS = 50_000  # the interpreter counts one spin as 1000 ns: ~50 spins, then the wait gives up


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


def test_matmul_reduce_scatter_timeout_partials_missing():
    t = RS(2, 5, 16, 24, seed=31)
    t.new_epoch_inputs()
    t.launch(0, 1, timeout_ns=SHORT_NS, **COMM_ONLY)
    err = t.rk.errors[0].tolist()
    assert err[0] != 0
    msg = runtime.decode_error(err)
    assert "matmul_reduce_scatter" in msg and "rank 0" in msg and "a peer's partial tile" in msg
    assert codes.wait_tag(err) == codes.WAIT_RS_PARTIAL.value
    assert err[5] == 1 and err[6] == 0
    assert t.rk.heads[0].tolist() == [0] * runtime.NUM_HEADS


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
