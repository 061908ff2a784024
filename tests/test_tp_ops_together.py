"""AllGather+GEMM and GEMM+RS in the same test: both TP ops alternating on one workspace (see conftest.py for
the markers). Each op's own cases are in test_all_gather_matmul.py and test_matmul_reduce_scatter.py.

* ``gpu`` -- W=1: random shapes through both ops in turn; neither op grows the symmetric data buffer.
* ``multi_gpu`` -- W=2, one process per GPU (kosmos_bench.launcher.spawn; the rank functions are
  module-level, pickled by reference): every shape and policy through AG then RS on one workspace (it grows
  and shrinks its needs from call to call); bitwise determinism and 100 back-to-back calls interleaving the
  two ops without a host sync; both ops captured in one CUDA graph and replayed 50 times. A rank records
  failed checks and keeps going, so that both ranks make the same sequence of collective calls
  (multiproc.Checks). References in fp32 with TF32 off.
"""
import pytest
import torch

import opcases
from multiproc import Checks
from opcases import TOL, randn, rank_inputs


# ============================================================================================ one GPU
@pytest.mark.gpu
def test_w1_random_shapes(no_tf32):
    import kosmos
    from kosmos import reference
    gen = torch.Generator().manual_seed(1234)
    for _ in range(6):
        ms = int(torch.randint(1, 400, (1,), generator=gen))
        k = 8 * int(torch.randint(1, 160, (1,), generator=gen))
        n = 8 * int(torch.randint(1, 160, (1,), generator=gen))
        a = randn((ms, k), gen, "cuda")
        b = randn((k, n), gen, "cuda")
        _, c = kosmos.all_gather_matmul(a, b)
        c2 = kosmos.matmul_reduce_scatter(a, b)
        kosmos.check_errors()
        ref = a.float() @ b.float()
        assert reference.rel_err(c, ref) < TOL, (ms, k, n)
        assert reference.rel_err(c2, ref) < TOL, (ms, k, n)


@pytest.mark.gpu
def test_w1_takes_no_data_workspace():
    """At W=1 nothing is gathered and nothing is staged: both ops leave the symmetric data buffer at its 1 MiB
    floor (before session 6 it grew to one gathered input / one partial output: 8 and 16 MiB here, 256 MiB at
    the llama3-70b fc1 16k shape)."""
    import kosmos
    from kosmos import reference
    from kosmos.core import runtime
    runtime.reset_workspaces()
    gen = torch.Generator().manual_seed(11)
    a, b = randn((4096, 1024), gen, "cuda"), randn((1024, 2048), gen, "cuda")
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


# ========================================================================================= multi-GPU
# (ms, k, n) per rank; GPU tiles: BM = 64 up to 64 rows, else 128; BN = N rounded up to a power of 2 in
# [64, 256]; BK = 64
W2_SHAPES = [
    (1, 64, 72),        # one row per rank; K exactly one BK step; one ragged N tile
    (37, 136, 264),     # less than one tile of rows; K not a multiple of BK; N one full tile + a ragged one
    (300, 520, 1000),   # two full 128-row tiles + a ragged one; K not a multiple of BK; N ragged
    (129, 1024, 2048),  # one full 128-row tile + a single row; 16 K steps; N in whole tiles
    (64, 8, 8),         # exactly one 64-row tile; the smallest TMA-legal K and N
]
W2_VARIANTS = [
    ({"policy": "self"}, False),
    ({"policy": "self"}, True),  # b given as the .t() of a row-major [N, K] weight
    ({"policy": "fixed", "comm_programs": 16}, False),
    ({"policy": "fixed", "comm_programs": 16}, True),
]


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
            shards, bs = rank_inputs(1000 * si + vi, world, (ms, k), (k, n), dev, kmajor)
            a_full, c = kosmos.all_gather_matmul(shards[rank], bs[rank], **pol)
            full, ref = reference.all_gather_matmul_ref_local(shards, bs[rank])
            check(torch.equal(a_full, full), f"AG a_full differs: {tag}")
            err = reference.rel_err(c, ref)
            check(err < TOL, f"AG rel err {err}: {tag}")
            # GEMM+ReduceScatter: a [2*ms, k] per rank, b [k, n] per rank
            a_list, b_list = rank_inputs(1000 * si + vi + 500, world, (world * ms, k), (k, n), dev, kmajor)
            c_shard = kosmos.matmul_reduce_scatter(a_list[rank], b_list[rank], **pol)
            ref_rs = reference.matmul_reduce_scatter_ref_local(a_list, b_list)[rank]
            err = reference.rel_err(c_shard, ref_rs)
            check(tuple(c_shard.shape) == (ms, n), f"RS shape {tuple(c_shard.shape)}: {tag}")
            check(err < TOL, f"RS rel err {err}: {tag}")
    kosmos.check_errors()
    # the NCCL + cuBLAS baseline agrees with the local reference (both sides of the comparison are sound)
    shards, bs = rank_inputs(7, world, (37, 136), (136, 264), dev)
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
    shards, bs = rank_inputs(1, world, (ms, k), (k, n), dev)
    a_list, b_list = rank_inputs(2, world, (world * ms, k), (k, n), dev)

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


@pytest.mark.multi_gpu
def test_w2_correctness_both_ops_both_policies(tmp_path):
    opcases.spawn(_w2_correctness, tmp_path)


@pytest.mark.multi_gpu
def test_w2_determinism_and_back_to_back(tmp_path):
    opcases.spawn(_w2_determinism_back_to_back, tmp_path)


def _w2_cuda_graph_replays(rank, world, out_dir):
    """Real W=2: one AG and one RS call captured together in one graph on each rank after eager calls, replayed
    50 times with the inputs rotating; every replay bitwise equal to the eager calls on the same inputs, the
    device epochs of both ranks advanced in lockstep, no timeout."""
    import kosmos
    from kosmos.core import runtime
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", rank)
    check = Checks(rank)
    ms, k, n = 300, 520, 1000
    shards, bs = rank_inputs(5, world, (ms, k), (k, n), dev)
    a_list, b_list = rank_inputs(6, world, (world * ms, k), (k, n), dev)
    scales = (1.0, 2.0, -0.5, 4.0)
    ag_in, rs_in = shards[rank].clone(), a_list[rank].clone()

    def set_inputs(j):
        ag_in.copy_(shards[rank] * scales[j])
        rs_in.copy_(a_list[rank] * scales[j])

    def call():
        return kosmos.all_gather_matmul(ag_in, bs[rank])[1], kosmos.matmul_reduce_scatter(rs_in, b_list[rank])
    eager = []
    for j in range(len(scales)):
        set_inputs(j)
        eager.append(tuple(t.clone() for t in call()))
    kosmos.check_errors()
    ws = runtime.get_workspace(None, dev)
    e0 = ws.device_epoch()
    set_inputs(0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for i in range(50):
        j = i % len(scales)
        set_inputs(j)
        graph.replay()
        check(torch.equal(out[0], eager[j][0]) and torch.equal(out[1], eager[j][1]), f"replay {i} differs")
    kosmos.check_errors()
    check(ws.device_epoch() == e0 + 100, f"device epoch {ws.device_epoch()}, expected {e0 + 100}")
    check.finish(out_dir)


@pytest.mark.multi_gpu
def test_w2_cuda_graph_replays(tmp_path):
    opcases.spawn(_w2_cuda_graph_replays, tmp_path)
