"""The fused kernels at W = 2..8 on ONE GPU: W simulated ranks in this process (kosmos_bench/simranks.py).

Each rank's buffers are separate allocations on the one GPU; the peer tables hold their addresses, so every
peer store, pull and flag of the kernels takes the same code path as over NVLink. The W launches of a call
are queued on W streams before any is waited on, with SMs // W programs each, so they are all resident and
run concurrently (a launch that never overlapped its peers would time out, not hang). This is how world
sizes above the GPUs at hand get a real-GPU check of the protocol: back-to-back epochs without a host sync,
ragged shapes, both policies, the developer knobs, a stalled rank, and the MoE layer. Timings here mean
nothing (the ranks share one GPU) and none are taken. The multi-process tests on real GPUs are in
test_gpu.py and test_moe_gpu.py.
"""
import os

import re

import pytest
import torch

HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability(0)[0] >= 9
pytestmark = pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90+) GPU")

from kosmos import runtime  # noqa: E402
from simranks import AG, RS, MoERanks, launch_all  # noqa: E402

TIMEOUT_NS = 2_000_000_000  # a healthy call takes well under 10 ms here
STALL_NS = 50_000_000
EPOCHS = (1, 2, 3)
# M/W = 200 rows: one full 128-row tile and a ragged one; N = 640: two full 256-column tiles and a half
SHAPE = dict(ms=200, k=384, n=640)


@pytest.fixture(autouse=True)
def _gpu_setup():
    torch.backends.cuda.matmul.allow_tf32 = False
    runtime.ensure_triton_allocator()


def _grid(world):
    return runtime.num_sms(torch.device("cuda")) // world


def _make(op, world, seed, **kw):
    cls = AG if op == "ag" else RS
    shape = dict(SHAPE, **{k: kw.pop(k) for k in ("ms", "k", "n") if k in kw})
    return cls(world, seed=seed, device="cuda", grid=_grid(world), timeout_ns=TIMEOUT_NS, **shape, **kw)


def _policy(name, world):
    return dict(policy="self") if name == "self" else dict(policy="fixed", comm_programs=max(1, _grid(world) // 4))


def _check_call(t, epoch):
    torch.cuda.synchronize()
    for r in range(t.world):
        t.rk.check_clean(r)
    t.rk.check_done(epoch)
    t.check_flags(epoch)
    t.check_outputs()


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("world,policy", [(2, "self"), (3, "self"), (4, "self"), (8, "self"), (2, "fixed"),
                                          (8, "fixed")])
def test_tp_op_at_world(op, world, policy):
    """Fresh random inputs each epoch, outputs and staging poisoned with NaN; every output, every gathered
    row (AG), every staged partial (RS), every flag and done signal checked after each call."""
    t = _make(op, world, seed=world * 10 + len(policy))
    for epoch in EPOCHS:
        t.new_epoch_inputs()
        t.launch_all(epoch, **_policy(policy, world))
        _check_call(t, epoch)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_tp_op_transposed_weight(op):
    """b given as the .t() of a row-major [N, K] weight (k-major B tiles) at W = 3."""
    t = _make(op, 3, seed=30, b_kmajor=True)
    for epoch in EPOCHS[:2]:
        t.new_epoch_inputs()
        t.launch_all(epoch)
        _check_call(t, epoch)


@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("world", [2, 4])
def test_tp_op_back_to_back_bitwise(op, world):
    """20 calls back to back on the same inputs, no host synchronisation between them: every call's output is
    bitwise the same (RS sums the partials in fixed rank order; AG's dot products do not depend on the
    schedule), and the last call leaves clean heads, flags and done signals."""
    t = _make(op, world, seed=40 + world)
    t.new_epoch_inputs()
    outs = []
    for epoch in range(1, 21):
        t.launch_all(epoch)
        if epoch % 5 == 0:
            outs.append(t.outputs())  # a device-side copy, ordered after the call: no host sync
    _check_call(t, 20)
    for snap in outs[1:]:
        for r in range(world):
            assert torch.equal(snap[r], outs[0][r]), f"rank {r}: output differs between back-to-back calls"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("per_task,ms", [(4, 600), ("auto", 2600)])
def test_ag_several_chunks_per_comm_task(world, per_task, ms):
    """AllGatherMatmulConfig(push_chunks, copy_block): comm tasks moving 4 strided chunks each (5 chunks of
    128 rows per shard, the last ragged), or as many as ``auto`` gives (21 chunks per shard: 2 per task at
    W=2, 4 at W=4), with copy steps smaller than a chunk."""
    from kosmos import planning
    from kosmos.config import AllGatherMatmulConfig
    config = AllGatherMatmulConfig(push_chunks=per_task, copy_block=1024)
    if per_task == "auto":
        assert planning.ag_comm_config(world, ms, 128, config)[0] == {2: 2, 4: 4}[world]
    t = _make("ag", world, seed=50 + world, ms=ms, config=config)
    for epoch in EPOCHS:
        t.new_epoch_inputs()
        t.launch_all(epoch)
        _check_call(t, epoch)


@pytest.mark.parametrize("world", [2, 4])
def test_rs_push_partials(world):
    """MatmulReduceScatterConfig(push_partials=True): partial tiles stored into the owners' staging slots over
    the peer mapping, reduced from local memory."""
    from kosmos.config import MatmulReduceScatterConfig
    t = _make("rs", world, seed=60 + world, config=MatmulReduceScatterConfig(push_partials=True))
    for epoch in EPOCHS:
        t.new_epoch_inputs()
        t.launch_all(epoch)
        _check_call(t, epoch)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_tp_op_stalled_rank_times_out(op):
    """W = 4 with rank 3 never launching: ranks 0..2 wait for its rows (AG) or partials (RS), time out, record
    which counter they waited on, and their launches end with clean heads: no hang."""
    t = _make(op, 4, seed=70)
    t.new_epoch_inputs()
    launch_all(3, lambda r: t.launch(r, 1, timeout_ns=STALL_NS))
    torch.cuda.synchronize()
    for r in range(3):
        err = t.rk.errors[r].tolist()
        assert err[0] != 0, f"rank {r} did not time out"
        assert err[2] == r and err[5] == 1, runtime.decode_error(err)
        assert t.rk.heads[r].tolist() == [0] * runtime.NUM_HEADS
        name = "all_gather_matmul" if op == "ag" else "matmul_reduce_scatter"
        assert re.match(rf"{name}: rank {r}( \(task \d+\))? timed out", runtime.decode_error(err))


MOE = dict(tokens=256, hidden=512, ffn=256, experts=8, top_k=2)


@pytest.mark.parametrize("world,policy", [(2, "self"), (4, "self"), (2, "fixed")])
def test_moe_forward_at_world(world, policy):
    """The one-launch MoE layer at W simulated ranks: routing equals the reference router, y the fp32
    reference, every row written (NaN-poisoned buffers), scratch and counters left clean, two epochs; then
    a third call on the same inputs is bitwise the same."""
    m = MoERanks(world, seed=80 + world, route_kw=dict(routing="softmax", renormalize=True), device="cuda",
                 grid=_grid(world), timeout_ns=TIMEOUT_NS, tol=1e-2, **MOE)
    pol = _policy(policy, world)
    for epoch in (1, 2):
        m.new_inputs()
        m.call(epoch, **pol)
        torch.cuda.synchronize()
        m.check(epoch)
    first = [y.clone() for y in m.ys]
    for y in m.ys:
        y.fill_(float("nan"))
    m.call(3, **pol)
    torch.cuda.synchronize()
    m.check(3)
    for r in range(world):
        assert torch.equal(first[r], m.ys[r]), f"rank {r}: repeated call differs"
