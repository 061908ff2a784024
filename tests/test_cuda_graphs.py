"""CUDA graphs: both TP ops and the MoE layer captured (``torch.cuda.graph``) and replayed. GPU only; what the
replays rest on -- the device epoch, read and advanced by the launch itself -- is tested on the CPU in each op's
file (``test_*_device_epoch``, ``test_*_replay_without_the_peer_waits_for_the_next_epoch``), and the capture
rules of the workspace in test_runtime.py.

* ``gpu`` -- W=1 through the public ops: one call captured after eager calls of the same shape, replayed 100
  times on inputs copied into the captured ones, every replay bitwise equal to the eager call on the same
  inputs; the device epoch advanced once per replay; a capture of a shape never run eagerly raises a one-line
  KosmosError and ends cleanly; a peer that never pushes under replay makes ``check_errors()`` raise
  ``KosmosTimeoutError`` with the replay's epoch (not the stale flags of an earlier call).
* ``ranks`` -- W = 2, 4 simulated ranks on one GPU: every rank's launch captured as one branch of one graph
  (simranks.launch_all inside the capture, its streams made beforehand), replayed 100 times with fresh inputs
  every 25; outputs, flags and done signals at the replays' epochs, bitwise equal to the eager call.
"""
import re

import pytest
import torch

import opcases
from opcases import TOL, randn
from simranks import MoERanks

from kosmos import reference
from kosmos.core import planning, runtime

REPLAYS = 100
N_INPUTS = 4  # replay i runs on input set i % N_INPUTS


@pytest.fixture(autouse=True)
def fresh_workspaces():
    """Each test on fresh workspaces, dropped after it: a workspace that a graph captured may not grow, so the
    tests after this file (other shapes) must not inherit one."""
    if torch.cuda.is_available():
        runtime.reset_workspaces()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        runtime.reset_workspaces()


def _capture(call):
    """``call()`` captured into a new CUDA graph -> (graph, what the captured call returned)."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def _replays_match_eager(call, set_inputs):
    """Eager ``call()`` on each input set (``set_inputs(i)`` copies set i into the static inputs), then one call
    captured and replayed REPLAYS times: every replay's output bitwise the eager one; the workspace's device
    epoch advanced by one per call and replay."""
    import kosmos
    ws = runtime.get_workspace(None, torch.device("cuda", torch.cuda.current_device()))
    eager = []
    for i in range(N_INPUTS):
        set_inputs(i)
        eager.append(call().clone())
    kosmos.check_errors()
    e0 = ws.device_epoch()
    set_inputs(0)
    graph, out = _capture(call)
    assert ws.device_epoch() == e0, "the capture ran the kernel"
    bad = []
    for i in range(REPLAYS):
        set_inputs(i % N_INPUTS)
        graph.replay()
        if not torch.equal(out, eager[i % N_INPUTS]):
            bad.append(i)
    kosmos.check_errors()
    assert not bad, f"replays {bad[:10]} differ from the eager calls"
    assert ws.device_epoch() == e0 + REPLAYS
    set_inputs(1)  # and eager calls go on after the replays, on the same epoch counter
    assert torch.equal(call(), eager[1])
    kosmos.check_errors()
    assert ws.device_epoch() == e0 + REPLAYS + 1


def _input_sets(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    sets = [[randn(s, gen, "cuda") for s in shapes] for _ in range(N_INPUTS)]
    static = [t.clone() for t in sets[0]]

    def set_inputs(i):
        for dst, src in zip(static, sets[i]):
            dst.copy_(src)
    return static, set_inputs


# ============================================================================================ one GPU
@pytest.mark.gpu
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("mx", [False, True, "inside"], ids=["bf16", "mxfp8", "mxfp8-inside"])
@pytest.mark.parametrize("ms,k,n", [(300, 512, 1000), (37, 136, 264),
                                    pytest.param(3000, 7168, 3072, id="stream-k"),  # planning.w1_plan's stream-K
                                    pytest.param(1024, 8192, 3072, id="tail"),  # its 128x192 tail tiles
                                    pytest.param(512, 7168, 1536, id="split")])  # its K split
def test_w1_tp_op_replays_bitwise_equal_eager(no_tf32, op, mx, ms, k, n):
    import kosmos
    from kosmos import quant
    if mx and k % 32:
        pytest.skip("MX blocks need K % 32 == 0")
    (a, b), set_inputs = _input_sets([(ms, k), (k, n)], seed=ms + k + n + bool(mx))
    fn = kosmos.all_gather_matmul if op == "ag" else kosmos.matmul_reduce_scatter
    plan = planning.w1_plan(ms, n, k, programs=runtime.num_sms(a.device))
    if ms == 3000:  # the params named stream-k / tail / split must still take that schedule (the bf16 ops' static
        assert plan.stream_k  # GEMM; the MX paths keep the self-scheduled kernel)
    if ms == 1024:
        assert plan.tail
    if ms == 512:
        assert plan.split > 1

    def call():  # quantize_mx: a launch of its own, captured too; "inside": the op quantizes (precision="mxfp8")
        out = fn(a, b, precision="mxfp8") if mx == "inside" else fn(quant.quantize_mx(a) if mx else a, b)
        return out[1] if op == "ag" else out
    _replays_match_eager(call, set_inputs)
    ref = (quant.quantize_mx(a).dequantize(torch.float32) if mx else a.float()) @ b.float()
    assert reference.rel_err(call(), ref) < TOL  # and the replayed output was right, not just repeatable


@pytest.mark.gpu
@pytest.mark.parametrize("route", ["softmax", "grouped"])
def test_w1_moe_forward_replays_bitwise_equal_eager(route):
    import kosmos
    tokens, hidden, ffn, experts, top_k = 300, 256, 136, 16, 4
    (x,), set_inputs = _input_sets([(tokens, hidden)], seed=17)
    gen = torch.Generator().manual_seed(3)
    router = (torch.randn(experts, hidden, generator=gen) * hidden ** -0.5).to(torch.bfloat16).cuda()
    w13 = (torch.randn(experts, hidden, 2 * ffn, generator=gen) * hidden ** -0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(experts, ffn, hidden, generator=gen) * ffn ** -0.5).to(torch.bfloat16).cuda()
    kw = dict(routing="softmax") if route == "softmax" else dict(
        routing="sigmoid-grouped", n_group=4, topk_group=2, routed_scaling=2.5,
        bias=(torch.randn(experts, generator=gen) * 0.05).cuda())
    _replays_match_eager(lambda: kosmos.moe_forward(x, router, w13, w2, top_k=top_k, **kw), set_inputs)


@pytest.mark.gpu
def test_capture_of_a_first_call_is_refused_and_ends_cleanly():
    """A capture that would have to grow the workspace, build the task tables of a new shape (the self-scheduled
    kernel: here policy "fixed"), or plan the static W=1 GEMM of a new shape (the default at W=1), raises a
    one-line KosmosError telling the user to make one eager call first; the capture ends cleanly and the eager
    call (then a capture of it) works."""
    import kosmos
    gen = torch.Generator().manual_seed(12)
    a, b = randn((256, 128), gen, "cuda"), randn((128, 248), gen, "cuda")
    for kw, second in (({}, "static W=1 GEMM"), ({"policy": "fixed", "comm_programs": 1}, "task tables")):
        runtime.reset_workspaces()
        try:
            for why in ("symmetric workspace must grow", second):
                with pytest.raises(runtime.KosmosError, match=f"{why}.*run one eager call") as e:
                    _capture(lambda: kosmos.matmul_reduce_scatter(a, b, **kw))
                assert "\n" not in str(e.value)
                if why != second:  # now the workspace exists, the shape's tables / plan do not
                    ws = runtime.get_workspace(None, a.device)
                    ws.ensure(0, 1)
            c = kosmos.matmul_reduce_scatter(a, b, **kw)
            graph, c2 = _capture(lambda: kosmos.matmul_reduce_scatter(a, b, **kw))
            graph.replay()
            kosmos.check_errors()
            assert torch.equal(c, c2)
        finally:
            torch.cuda.synchronize()
            runtime.reset_workspaces()


@pytest.mark.gpu
def test_stalled_peer_under_replay_raises_at_check_errors():
    """One GPU, a launch told it has a peer (world 2, the peer tables pointing at itself) that only ever
    published epoch 1 (its flags set by hand): the eager call at epoch 1 passes; the captured call's replay
    runs at epoch 2, waits for flags >= 2 instead of reading the stale rows, times out, writes the pinned mirror,
    and ``check_errors()`` after the replay raises KosmosTimeoutError naming the op, rank and awaited flag."""
    import triton
    from kosmos.ops import all_gather_matmul as ag
    dev = torch.device("cuda", 0)
    runtime.reset_workspaces()
    ws = runtime.get_workspace(None, dev)
    ms, k, n = 256, 128, 256
    cfg = planning.tile_config(ms, n, k, programs=runtime.num_sms(dev))
    chunks = triton.cdiv(ms, cfg.BM)
    ws.ensure(2 * ms * k * 2, 2 * chunks)
    runtime.ensure_triton_allocator()
    gen = torch.Generator().manual_seed(5)
    a, b = randn((ms, k), gen, dev), randn((k, n), gen, dev)
    c = torch.empty(2 * ms, n, dtype=torch.bfloat16, device=dev)
    gather = ws.data[: 2 * ms * k * 2].view(torch.bfloat16).view(2 * ms, k)
    peers = lambda t: torch.tensor([t.data_ptr()] * 2, dtype=torch.int64, device=dev)  # noqa: E731
    peer_data, peer_sig = peers(ws.data), peers(ws.signals)
    ws.signals[runtime.FLAG_BASE + chunks:runtime.FLAG_BASE + 2 * chunks].fill_(1)  # the peer's rows of epoch 1

    def call():
        ws.before_launch()
        ag.launch(a, b, False, c, gather, peer_data, peer_sig, ws.signals, ws.heads, ws.errors, rank=0, world=2,
                  epoch_slot=ws.epoch_slot, timeout_ns=20_000_000, grid=runtime.num_sms(dev), cfg=cfg,
                  policy="fixed", comm_programs=0)  # compute only: this rank never pushes either
        ws.after_launch()
    try:
        call()  # epoch 1: the flags are there
        ws.check_errors()
        assert ws.device_epoch() == 1
        graph, _ = _capture(call)
        graph.replay()  # epoch 2: nobody published it
        with pytest.raises(runtime.KosmosTimeoutError,
                           match=r"all_gather_matmul: rank 0 \(task \d+\) timed out .*expected >= 2, observed 1") as e:
            ws.check_errors()
        counter = int(re.search(r"signal slot (\d+)", str(e.value)).group(1))
        assert runtime.FLAG_BASE + chunks <= counter < runtime.FLAG_BASE + 2 * chunks, e.value
        assert ws.errors[:runtime.ERR_RECORD].tolist() == ws._err_host.tolist()
        assert ws.device_epoch() == 2 and ws.heads.tolist() == [0] * runtime.NUM_HEADS  # the replay still ended
        with pytest.raises(runtime.KosmosTimeoutError, match="reset_workspaces"):
            ws.before_launch()
    finally:
        torch.cuda.synchronize()
        runtime.reset_workspaces()


# ============================================================================ simulated ranks, one GPU
def _replay_on_ranks(t, run, outputs, check, world):
    """``run(streams)`` (one call on every rank) eagerly, then captured and replayed REPLAYS times, with fresh
    inputs every 25 replays (``t.new_epoch_inputs`` / ``new_inputs`` copy into the same buffers): after each
    batch ``check(epoch)`` and the replay bitwise equal to an eager call on the same inputs."""
    streams = [torch.cuda.Stream() for _ in range(world)]
    fresh = getattr(t, "new_epoch_inputs", None) or t.new_inputs
    fresh()
    run(streams)
    torch.cuda.synchronize()
    check(1)
    eager = outputs()
    graph, _ = _capture(lambda: run(streams))
    epoch = 1
    for i in range(REPLAYS):
        if i and i % 25 == 0:
            fresh()
            run(streams)  # an eager call between the replays, on the same device epochs
            epoch += 1
            torch.cuda.synchronize()
            check(epoch)
            eager = outputs()
        graph.replay()
        epoch += 1
        if i % 25 == 24:
            torch.cuda.synchronize()
            check(epoch)
            got = outputs()
            for r in range(world):
                assert torch.equal(got[r], eager[r]), f"replay {i}, rank {r}: differs from the eager call"
    return epoch


@pytest.mark.ranks
@pytest.mark.usefixtures("ranks_setup")
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("world", [2, 4])
def test_tp_op_replays_on_ranks(op, world):
    t = opcases.make(op, world, seed=90 + world)
    epoch = _replay_on_ranks(t, lambda streams: t.launch_all(None, streams=streams), t.outputs,
                             lambda e: opcases.check_call(t, e), world)
    assert t.rk.device_epochs() == [epoch] * world


@pytest.mark.ranks
@pytest.mark.usefixtures("ranks_setup")
@pytest.mark.parametrize("world", [2, 4])
def test_moe_forward_replays_on_ranks(world):
    m = MoERanks(world, 256, 512, 256, 8, 2, seed=95 + world, route_kw=dict(routing="softmax", renormalize=True),
                 device="cuda", grid=opcases.grid(world), timeout_ns=opcases.RANKS_TIMEOUT_NS, tol=1e-2)

    def run(streams):
        m.call(None, streams=streams)
    epoch = _replay_on_ranks(m, run, lambda: [y.clone() for y in m.ys], m.check, world)
    assert [int(e.item()) for e in m.epochs] == [epoch] * world
