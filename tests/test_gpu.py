"""The fused ops on real GPUs (skipped without CUDA; the multi-GPU tests need 2 GPUs).

W=1 tests run in this process. W=2 tests spawn one process per GPU with kosmos_bench.launcher.spawn; the
rank functions are module-level (they are pickled by reference). A rank records failed checks and keeps
going, so that both ranks make the same sequence of collective calls, then writes them to
``<tmp>/rank<r>.txt`` and raises (spawn turns that into a LaunchError carrying the rank's traceback).
References run in fp32 with TF32 off.
"""
import os
import re

import pytest
import torch

from multiproc import Checks, spawn_gpu, stall_peer

HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
N_GPUS = torch.cuda.device_count() if HAS_CUDA else 0
IS_HOPPER = HAS_CUDA and torch.cuda.get_device_capability(0)[0] >= 9

requires_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
requires_hopper = pytest.mark.skipif(not IS_HOPPER, reason="needs a Hopper (sm_90+) GPU: TMA descriptors")
requires_2gpus = pytest.mark.skipif(N_GPUS < 2, reason="needs 2 CUDA GPUs")
pytestmark = [requires_gpu, requires_hopper]

TOL = 1e-2
SPAWN_TIMEOUT_S = 300.0


def _randn(shape, gen, device):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)


def _weight(k, n, gen, device, kmajor):
    """b [K, N]: row-major, or the transpose of a row-major [N, K] weight."""
    if kmajor:
        return _randn((n, k), gen, device).t()
    return _randn((k, n), gen, device)


@pytest.fixture
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


# ---------------------------------------------------------------------------------------------------- W=1
def test_w1_timeout_reaches_the_host_through_the_error_mirror():
    """One GPU, a launch told it has a peer (world 2) that never pushes: its bounded waits time out, the
    program that records the error writes it into the pinned host mirror too, and the workspace raises a
    KosmosTimeoutError naming the op, the rank and the awaited counter -- no hang, no device-to-host copy."""
    import triton
    from kosmos import planning, runtime
    from kosmos.kernels import all_gather_matmul as ag
    dev = torch.device("cuda", 0)
    runtime.reset_workspaces()
    ws = runtime.get_workspace(None, dev)
    ms, k, n = 256, 128, 256
    cfg = planning.tile_config(ms, n, k)
    ws.ensure(2 * ms * k * 2, 2 * triton.cdiv(ms, cfg.BM))
    runtime.ensure_triton_allocator()
    gen = torch.Generator().manual_seed(5)
    a, b = _randn((ms, k), gen, dev), _randn((k, n), gen, dev)
    c = torch.empty(2 * ms, n, dtype=torch.bfloat16, device=dev)
    gather = ws.data[: 2 * ms * k * 2].view(torch.bfloat16).view(2 * ms, k)
    fake_peers = lambda t: torch.tensor([t.data_ptr()] * 2, dtype=torch.int64, device=dev)  # noqa: E731
    ag.launch(a, b, False, c, gather, fake_peers(ws.data), fake_peers(ws.signals), ws.signals, ws.heads,
              ws.errors, rank=0, world=2, epoch=ws.next_epoch(), timeout_ns=2_000_000,
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


W1_SHAPES = [(ms, k, n) for ms in (1, 37, 300) for (k, n) in ((8, 8), (136, 264), (512, 1000))]
W1_VARIANTS = [pytest.param({}, False, id="self"), pytest.param({}, True, id="self-kmajor"),
               pytest.param({"policy": "fixed", "comm_programs": 4}, False, id="fixed")]


@pytest.mark.parametrize("ms,k,n", W1_SHAPES)
@pytest.mark.parametrize("pol,kmajor", W1_VARIANTS)
def test_w1_all_gather_matmul(no_tf32, ms, k, n, pol, kmajor):
    import kosmos
    from kosmos import reference
    gen = torch.Generator().manual_seed(ms * 7919 + k * 31 + n)
    a = _randn((ms, k), gen, "cuda")
    b = _weight(k, n, gen, "cuda", kmajor)
    a_full, c = kosmos.all_gather_matmul(a, b, **pol)
    kosmos.check_errors()
    assert c.dtype == torch.bfloat16 and tuple(c.shape) == (ms, n)
    assert torch.equal(a_full, a)
    _, ref = reference.all_gather_matmul_ref_local([a], b)
    assert reference.rel_err(c, ref) < TOL


@pytest.mark.parametrize("ms,k,n", W1_SHAPES)
@pytest.mark.parametrize("pol,kmajor", W1_VARIANTS)
def test_w1_matmul_reduce_scatter(no_tf32, ms, k, n, pol, kmajor):
    import kosmos
    from kosmos import reference
    gen = torch.Generator().manual_seed(ms * 7919 + k * 31 + n + 1)
    a = _randn((ms, k), gen, "cuda")
    b = _weight(k, n, gen, "cuda", kmajor)
    c = kosmos.matmul_reduce_scatter(a, b, **pol)
    kosmos.check_errors()
    assert c.dtype == torch.bfloat16 and tuple(c.shape) == (ms, n)
    (ref,) = reference.matmul_reduce_scatter_ref_local([a], [b])
    assert reference.rel_err(c, ref) < TOL


def test_w1_random_shapes(no_tf32):
    import kosmos
    from kosmos import reference
    gen = torch.Generator().manual_seed(1234)
    for _ in range(6):
        ms = int(torch.randint(1, 400, (1,), generator=gen))
        k = 8 * int(torch.randint(1, 160, (1,), generator=gen))
        n = 8 * int(torch.randint(1, 160, (1,), generator=gen))
        a = _randn((ms, k), gen, "cuda")
        b = _randn((k, n), gen, "cuda")
        _, c = kosmos.all_gather_matmul(a, b)
        c2 = kosmos.matmul_reduce_scatter(a, b)
        kosmos.check_errors()
        ref = a.float() @ b.float()
        assert reference.rel_err(c, ref) < TOL, (ms, k, n)
        assert reference.rel_err(c2, ref) < TOL, (ms, k, n)


def test_w1_takes_no_data_workspace():
    """At W=1 nothing is gathered and nothing is staged: both ops leave the symmetric data buffer at its 1 MiB
    floor (before session 6 it grew to one gathered input / one partial output: 8 and 16 MiB here, 256 MiB at
    the llama3-70b fc1 16k shape)."""
    import kosmos
    from kosmos import reference, runtime
    runtime.reset_workspaces()
    gen = torch.Generator().manual_seed(11)
    a, b = _randn((4096, 1024), gen, "cuda"), _randn((1024, 2048), gen, "cuda")
    try:
        a_full, c = kosmos.all_gather_matmul(a, b)
        c2 = kosmos.matmul_reduce_scatter(a, b)
        kosmos.check_errors()
        assert a_full.data_ptr() == a.data_ptr()
        ref = a.float() @ b.float()
        assert reference.rel_err(c, ref) < TOL and reference.rel_err(c2, ref) < TOL
        assert runtime.get_workspace(None, a.device).data_bytes == 1 << 20
    finally:
        runtime.reset_workspaces()


def test_w1_cuda_graph_capture_is_refused():
    """Capturing an op in a CUDA graph raises a KosmosError (a replay would reuse the call's epoch) and the
    capture can be ended cleanly; the op works again afterwards."""
    import kosmos
    from kosmos import runtime
    gen = torch.Generator().manual_seed(12)
    a, b = _randn((256, 128), gen, "cuda"), _randn((128, 256), gen, "cuda")
    kosmos.matmul_reduce_scatter(a, b)
    torch.cuda.synchronize()
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with pytest.raises(runtime.KosmosError, match="cannot be captured in a CUDA graph"):
            with torch.cuda.graph(graph, stream=stream):
                kosmos.matmul_reduce_scatter(a, b)
    c = kosmos.matmul_reduce_scatter(a, b)
    kosmos.check_errors()
    assert torch.allclose(c.float(), a.float() @ b.float(), rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_w1_trace_records_every_compute_task(op):
    import kosmos
    from kosmos import planning, runtime
    ms, k, n = 300, 256, 1000
    gen = torch.Generator().manual_seed(5)
    a = _randn((ms, k), gen, "cuda")
    b = _randn((k, n), gen, "cuda")
    grid = runtime.num_sms(a.device)
    trace = torch.zeros(grid, 1024, 4, dtype=torch.int64, device="cuda")
    if op == "ag":
        kosmos.all_gather_matmul(a, b, trace=trace)
    else:
        kosmos.matmul_reduce_scatter(a, b, trace=trace)
    kosmos.check_errors()
    cfg = planning.tile_config(ms, n, k)
    n_tiles = -(-ms // cfg.BM) * -(-n // cfg.BN)
    ev = trace.view(-1, 4).cpu()
    compute = ev[ev[:, 0] == 2]
    assert sorted(compute[:, 1].tolist()) == list(range(n_tiles))
    assert bool((compute[:, 3] >= compute[:, 2]).all())


# ------------------------------------------------------------------------------------ multi-GPU rank bodies
def _rank_inputs(seed, world, shape_a, shape_b, device, kmajor=False):
    """Every rank's inputs, made identically on every rank (one CPU generator), so that each rank can
    compute the reference of the whole group locally."""
    gen = torch.Generator().manual_seed(seed)
    a = [_randn(shape_a, gen, device) for _ in range(world)]
    b = [_weight(shape_b[0], shape_b[1], gen, device, kmajor) for _ in range(world)]
    return a, b


W2_SHAPES = [(1, 64, 72), (37, 136, 264), (300, 520, 1000), (129, 1024, 2048), (64, 8, 8)]
W2_VARIANTS = [({"policy": "self"}, False), ({"policy": "self"}, True),
               ({"policy": "fixed", "comm_programs": 16}, False), ({"policy": "fixed", "comm_programs": 16}, True)]


def _w2_correctness(rank, world, out_dir):
    import kosmos
    from kosmos import reference
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", rank)
    check = Checks(rank)
    shapes = list(W2_SHAPES)
    gen = torch.Generator().manual_seed(99)  # random ragged shapes, the same on every rank
    for _ in range(3):
        ms = int(torch.randint(1, 300, (1,), generator=gen))
        k, n = (8 * int(torch.randint(1, 100, (1,), generator=gen)) for _ in range(2))
        shapes.append((ms, k, n))
    for si, (ms, k, n) in enumerate(shapes):
        for vi, (pol, kmajor) in enumerate(W2_VARIANTS):
            tag = f"ms={ms} k={k} n={n} {pol} kmajor={kmajor}"
            # AllGather+GEMM: a_shard [ms, k] per rank, b [k, n] per rank (its column shard)
            shards, bs = _rank_inputs(1000 * si + vi, world, (ms, k), (k, n), dev, kmajor)
            a_full, c = kosmos.all_gather_matmul(shards[rank], bs[rank], **pol)
            full, ref = reference.all_gather_matmul_ref_local(shards, bs[rank])
            check(torch.equal(a_full, full), f"AG a_full differs: {tag}")
            err = reference.rel_err(c, ref)
            check(err < TOL, f"AG rel err {err}: {tag}")
            # GEMM+ReduceScatter: a [2*ms, k] per rank, b [k, n] per rank
            a_list, b_list = _rank_inputs(1000 * si + vi + 500, world, (world * ms, k), (k, n), dev, kmajor)
            c_shard = kosmos.matmul_reduce_scatter(a_list[rank], b_list[rank], **pol)
            ref_rs = reference.matmul_reduce_scatter_ref_local(a_list, b_list)[rank]
            err = reference.rel_err(c_shard, ref_rs)
            check(tuple(c_shard.shape) == (ms, n), f"RS shape {tuple(c_shard.shape)}: {tag}")
            check(err < TOL, f"RS rel err {err}: {tag}")
    kosmos.check_errors()
    # the NCCL + cuBLAS baseline agrees with the local reference (both sides of the comparison are sound)
    shards, bs = _rank_inputs(7, world, (37, 136), (136, 264), dev)
    _, ref_nccl = reference.all_gather_matmul_ref(shards[rank], bs[rank])
    _, ref_local = reference.all_gather_matmul_ref_local(shards, bs[rank])
    check(reference.rel_err(ref_nccl, ref_local) < 1e-5, "all_gather_matmul_ref (NCCL) != local reference")
    check.finish(out_dir)


def _w2_determinism_back_to_back(rank, world, out_dir):
    import kosmos
    from kosmos import reference
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", rank)
    check = Checks(rank)
    ms, k, n = 300, 1024, 1536
    shards, bs = _rank_inputs(1, world, (ms, k), (k, n), dev)
    a_list, b_list = _rank_inputs(2, world, (world * ms, k), (k, n), dev)

    # bitwise determinism over 5 runs, both policies
    for pol in ({"policy": "self"}, {"policy": "fixed", "comm_programs": 16}):
        ag_out = [kosmos.all_gather_matmul(shards[rank], bs[rank], **pol)[1] for _ in range(5)]
        rs_out = [kosmos.matmul_reduce_scatter(a_list[rank], b_list[rank], **pol) for _ in range(5)]
        kosmos.check_errors()
        for i in range(1, 5):
            check(torch.equal(ag_out[i], ag_out[0]), f"AG run {i} differs from run 0 ({pol})")
            check(torch.equal(rs_out[i], rs_out[0]), f"RS run {i} differs from run 0 ({pol})")
        check(reference.rel_err(ag_out[0], reference.all_gather_matmul_ref_local(shards, bs[rank])[1]) < TOL,
              f"AG wrong ({pol})")
        check(reference.rel_err(rs_out[0], reference.matmul_reduce_scatter_ref_local(a_list, b_list)[rank]) < TOL,
              f"RS wrong ({pol})")

    # 100 back-to-back calls, AG and RS interleaved on one workspace, inputs changing, no host sync
    scales = (1.0, 2.0, -0.5, 4.0)  # powers of two: every variant's inputs are exact in bf16
    ag_in = [shards[rank] * s for s in scales]
    rs_in = [a_list[rank] * s for s in scales]
    torch.cuda.synchronize()
    results = []
    for i in range(100):
        j = (i // 2) % len(scales)
        if i % 2 == 0:
            a_full, c = kosmos.all_gather_matmul(ag_in[j], bs[rank])
            results.append(("ag", j, a_full.clone(), c))  # a_full is only valid until the next call
        else:
            results.append(("rs", j, None, kosmos.matmul_reduce_scatter(rs_in[j], b_list[rank])))
    torch.cuda.synchronize()
    kosmos.check_errors()
    fresh = {}
    for j in range(len(scales)):
        fresh[("ag", j)] = tuple(t.clone() for t in kosmos.all_gather_matmul(ag_in[j], bs[rank]))
        torch.cuda.synchronize()
        fresh[("rs", j)] = (None, kosmos.matmul_reduce_scatter(rs_in[j], b_list[rank]))
        torch.cuda.synchronize()
    kosmos.check_errors()
    for i, (op, j, a_full, c) in enumerate(results):
        f_full, f_c = fresh[(op, j)]
        check(torch.equal(c, f_c), f"back-to-back call {i} ({op}, input {j}) != a fresh call")
        if op == "ag":
            check(torch.equal(a_full, f_full), f"back-to-back call {i}: a_full != a fresh call")
    full = [torch.cat([x * scales[j] for x in shards]) for j in range(len(scales))]
    for j in range(len(scales)):
        _, ref = reference.all_gather_matmul_ref_local([x * scales[j] for x in shards], bs[rank])
        check(reference.rel_err(fresh[("ag", j)][1], ref) < TOL, f"fresh AG {j} wrong")
        check(torch.equal(fresh[("ag", j)][0], full[j]), f"fresh AG {j}: a_full wrong")
        ref = reference.matmul_reduce_scatter_ref_local([x * scales[j] for x in a_list], b_list)[rank]
        check(reference.rel_err(fresh[("rs", j)][1], ref) < TOL, f"fresh RS {j} wrong")
    check.finish(out_dir)


def _w2_stalled_peer(rank, world, out_dir):
    import kosmos
    from kosmos import reference
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", rank)
    check = Checks(rank)
    shards, bs = _rank_inputs(3, world, (256, 512), (512, 768), dev)

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


def _spawn(fn, tmp_path):
    spawn_gpu(fn, tmp_path, timeout_s=SPAWN_TIMEOUT_S)


@requires_2gpus
def test_w2_correctness_both_ops_both_policies(tmp_path):
    _spawn(_w2_correctness, tmp_path)


@requires_2gpus
def test_w2_determinism_and_back_to_back(tmp_path):
    _spawn(_w2_determinism_back_to_back, tmp_path)


@requires_2gpus
def test_w2_stalled_peer_times_out(tmp_path):
    _spawn(_w2_stalled_peer, tmp_path)
