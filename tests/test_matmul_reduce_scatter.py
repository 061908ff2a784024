"""GEMM+ReduceScatter (kosmos.matmul_reduce_scatter): every platform's cases, by marker (see conftest.py).

* ``interpreter`` -- W simulated ranks in one process under the Triton CPU interpreter, the ranks' phases
  ordered by hand (``COMPUTE_ONLY`` on every rank, then ``COMM_ONLY``: see test_all_gather_matmul.py); the
  self-scheduling policy at W=1, and at W=2 with the peer's compute done beforehand; a missing partial times out.
* ``gpu_optional`` / unmarked -- input checks: a ValueError before anything is launched (opcases.InputChecks).
* ``gpu`` -- W=1 on one GPU through the public op. References in fp32, TF32 off. (CUDA graphs: test_cuda_graphs.py.)
* ``ranks`` -- W = 2..8 simulated ranks on one GPU, all launches resident at once (simranks.py).
* The real multi-GPU cases (W=2) run this op interleaved with AllGather+GEMM: test_tp_ops_together.py.
"""
import pytest
import torch

import opcases
from opcases import COMM_ONLY, COMPUTE_ONLY, SELF, SHAPES, SHORT_NS, TOL, W1_SHAPES, W1_VARIANTS, WORLDS, randn, \
    run_device_epochs, run_schedule, weight
from simranks import RS

from kosmos.core import codes, runtime
from kosmos.config import MatmulReduceScatterConfig


# ==================================================================================== CPU interpreter
@pytest.mark.interpreter
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("ms,k,n", SHAPES)
def test_matmul_reduce_scatter_epochs(world, ms, k, n):
    t = RS(world, ms, k, n, seed=world * 100 + ms + 1)
    run_schedule(t, [(r, phase) for phase in (COMPUTE_ONLY, COMM_ONLY) for r in range(world)])


@pytest.mark.interpreter
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("ms,k,n", [pytest.param(21, 64, 48, id="ms21-k64-n48"),
                                    pytest.param(5, 32, 24, id="ms5-k32-n24")])
def test_matmul_reduce_scatter_mxfp8_epochs(world, ms, k, n):
    """MXFP8 a (K a multiple of 32): the partials and the reduction as in bf16, against the fp32 product of the
    dequantized values."""
    t = RS(world, ms, k, n, seed=world * 100 + ms + 9, mx=True)
    run_schedule(t, [(r, phase) for phase in (COMPUTE_ONLY, COMM_ONLY) for r in range(world)])


@pytest.mark.interpreter
@pytest.mark.parametrize("world", WORLDS)
def test_matmul_reduce_scatter_fp8_block_epochs(world):
    """fp8-block a (1x128) and weight (128x128, k-major) on the SCALED mainloop: the partials and the reduction
    as in bf16, against the fp32 product of the dequantized values (ragged rows: Ms 21 is one whole 16-row tile
    and a part; N 48 is a last tile past N; K 256 is two scale blocks)."""
    t = RS(world, 21, 256, 48, seed=world * 100 + 7, fp8=True)
    run_schedule(t, [(r, phase) for phase in (COMPUTE_ONLY, COMM_ONLY) for r in range(world)])


@pytest.mark.interpreter
@pytest.mark.parametrize("ms,k,n", SHAPES)
def test_matmul_reduce_scatter_self_policy_world1(ms, k, n):
    run_schedule(RS(1, ms, k, n, seed=17), [(0, SELF)], flags=False)


@pytest.mark.interpreter
def test_matmul_reduce_scatter_self_policy_world2():
    """Rank 1 computes first; rank 0 runs self-scheduled (its reduce tasks become ready while it computes,
    and are claimed early); rank 1 reduces last."""
    run_schedule(RS(2, 21, 40, 48, seed=19), [(1, COMPUTE_ONLY), (0, SELF), (1, COMM_ONLY)])


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [
    2,  # one peer; also the self-scheduled schedule
    3,  # several source slots per owner
])
def test_matmul_reduce_scatter_push_partials(world):
    """MatmulReduceScatterConfig(push_partials=True): partials pushed into the owners' staging slots, reduced
    locally; both the phase-ordered and the self-scheduled schedules, several epochs."""
    config = MatmulReduceScatterConfig(push_partials=True)
    t = RS(world, 21, 40, 48, seed=23 + world, config=config)
    run_schedule(t, [(r, phase) for phase in (COMPUTE_ONLY, COMM_ONLY) for r in range(world)])
    if world == 2:
        run_schedule(RS(2, 21, 40, 48, seed=29, config=config), [(1, COMPUTE_ONLY), (0, SELF), (1, COMM_ONLY)])


@pytest.mark.interpreter
def test_matmul_reduce_scatter_b_kmajor():
    run_schedule(RS(2, 21, 40, 48, seed=23, b_kmajor=True),
                 [(r, phase) for phase in (COMPUTE_ONLY, COMM_ONLY) for r in range(2)])


@pytest.mark.interpreter
@pytest.mark.parametrize("world,mx,schedule", [
    pytest.param(1, False, [(0, SELF)], id="w1"),
    pytest.param(1, True, [(0, SELF)], id="w1-mxfp8"),  # the DEQ flags are local flags of the epoch
    pytest.param(2, False, [(1, COMPUTE_ONLY), (0, SELF), (1, COMM_ONLY)], id="w2-self"),
    pytest.param(3, False, [(r, COMPUTE_ONLY) for r in range(3)] + [(r, COMM_ONLY) for r in range(3)], id="w3"),
])
def test_matmul_reduce_scatter_device_epoch(world, mx, schedule):
    """No epoch from the host (opcases.run_device_epochs): the slot advances by one per call, results right."""
    t = RS(world, 21, 64 if mx else 40, 48, seed=61 + world, mx=mx)
    run_device_epochs(t, schedule)


@pytest.mark.interpreter
def test_matmul_reduce_scatter_replay_without_the_peer_waits_for_the_next_epoch():
    """Rank 0 reducing a further call alone must wait for partial flags of the new epoch, not take the last
    call's: a timeout recorded with expected 4, observed 3."""
    t = RS(2, 21, 40, 48, seed=67)
    run_device_epochs(t, [(1, COMPUTE_ONLY), (0, SELF), (1, COMM_ONLY)], calls=2)
    t.launch(0, None, timeout_ns=SHORT_NS, **COMM_ONLY)
    err = t.rk.errors[0].tolist()
    assert err[0] != 0 and codes.wait_tag(err) == codes.WAIT_RS_PARTIAL.value, runtime.decode_error(err)
    assert (err[5], err[6]) == (4, 3), runtime.decode_error(err)
    assert t.rk.heads[0].tolist() == [0] * runtime.NUM_HEADS


@pytest.mark.interpreter
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


# ======================================================================================= input checks
class TestInputChecks(opcases.InputChecks):
    name = "matmul_reduce_scatter"

    @pytest.mark.parametrize("m", [
        8,   # below a multiple of 3
        10,  # above a multiple of 3
        1,   # fewer rows than ranks
    ])
    def test_reduce_scatter_m_not_divisible_by_world(self, fake_world, m):
        fake_world["set_world"](3)
        opcases.raises_before_launch(fake_world, self.op, opcases.cuda(opcases.bf16(m, 16)),
                                     opcases.cuda(opcases.bf16(16, 8)), "divide by the world size 3")

    def test_reduce_scatter_m_divisible_by_world_passes(self, fake_world):
        ws = fake_world["set_world"](3, rank=2)
        with pytest.raises(opcases.Reached):
            self.op(opcases.cuda(opcases.bf16(9, 16)), opcases.cuda(opcases.bf16(16, 8)))
        assert ws.calls == ["ensure"]


def test_cpu_tensor_unpatched():
    """Without any patching the public op rejects CPU tensors (nothing CUDA is touched first)."""
    import kosmos
    bf16 = opcases.bf16
    with pytest.raises(ValueError, match="CUDA"):
        kosmos.matmul_reduce_scatter(bf16(8, 16), bf16(16, 8))
    with pytest.raises(ValueError, match="2-D"):
        kosmos.matmul_reduce_scatter(bf16(8), bf16(8, 8))


# ============================================================================================ one GPU
@pytest.mark.gpu
@pytest.mark.parametrize("ms,k,n", W1_SHAPES)
@pytest.mark.parametrize("pol,kmajor", W1_VARIANTS)
def test_w1_matmul_reduce_scatter(no_tf32, ms, k, n, pol, kmajor):
    import kosmos
    from kosmos import reference
    gen = torch.Generator().manual_seed(ms * 7919 + k * 31 + n + 1)
    a = randn((ms, k), gen, "cuda")
    b = weight(k, n, gen, "cuda", kmajor)
    c = kosmos.matmul_reduce_scatter(a, b, **pol)
    kosmos.check_errors()
    assert c.dtype == torch.bfloat16 and tuple(c.shape) == (ms, n)
    (ref,) = reference.matmul_reduce_scatter_ref_local([a], [b])
    assert reference.rel_err(c, ref) < TOL


@pytest.mark.gpu
def test_w1_trace_records_every_compute_task():
    opcases.w1_trace_records_every_compute_task("rs")


# ============================================================================ simulated ranks, one GPU
class TestOnRanks(opcases.OnRanksCases):
    op = "rs"

    @pytest.mark.parametrize("world", [2, 4, 8])
    def test_rs_fp8_block(self, world):
        """fp8-block a and weight (K = 384: three scale blocks) on the SCALED mainloop, all ranks resident: the
        staged partials and outputs against the fp32 product of the dequantized values; fresh inputs and
        poisoned buffers each epoch."""
        t = opcases.make("rs", world, seed=70 + world, k=384, fp8=True)
        for epoch in opcases.EPOCHS:
            t.new_epoch_inputs()
            t.launch_all(epoch)
            opcases.check_call(t, epoch)

    @pytest.mark.parametrize("world", [2, 4])
    def test_rs_push_partials(self, world):
        """MatmulReduceScatterConfig(push_partials=True): partial tiles stored into the owners' staging slots over
        the peer mapping, reduced from local memory."""
        t = opcases.make("rs", world, seed=60 + world, config=MatmulReduceScatterConfig(push_partials=True))
        for epoch in opcases.EPOCHS:
            t.new_epoch_inputs()
            t.launch_all(epoch)
            opcases.check_call(t, epoch)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1000, 512, 640), (256, 8192, 1024), (64, 96, 256)])
def test_w1_matmul_reduce_scatter_mxfp8(no_tf32, m, k, n):
    """The public op on an MXTensor at W=1 against the fp32 product of the dequantized values; bitwise repeat."""
    import kosmos
    from kosmos import quant, reference
    gen = torch.Generator().manual_seed(m + k + n + 1)
    x = randn((m, k), gen, "cuda")
    b = weight(k, n, gen, "cuda", False)
    mx = quant.quantize_mx(x)
    c = kosmos.matmul_reduce_scatter(mx, b)
    kosmos.check_errors()
    assert reference.rel_err(c, mx.dequantize(torch.float32) @ b.float()) < TOL
    assert torch.equal(kosmos.matmul_reduce_scatter(mx, b), c)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1000, 512, 640), (256, 8192, 1024), (300, 1056, 264)])
def test_w1_matmul_reduce_scatter_quantizes_inside(no_tf32, m, k, n):
    """precision="mxfp8" on a bf16 a at W=1: bitwise the op on quantize_mx(a), within TOL of the fp32 product of
    the MX values, bitwise over repeats."""
    import kosmos
    from kosmos import quant, reference
    gen = torch.Generator().manual_seed(m + k + n + 3)
    x = randn((m, k), gen, "cuda")
    b = weight(k, n, gen, "cuda", True)
    c = kosmos.matmul_reduce_scatter(x, b, precision="mxfp8")
    kosmos.check_errors()
    assert torch.equal(c, kosmos.matmul_reduce_scatter(quant.quantize_mx(x), b))
    assert reference.rel_err(c, quant.mx_round(x).float() @ b.float()) < TOL
    assert torch.equal(kosmos.matmul_reduce_scatter(x, b, precision="mxfp8"), c)


# ================================================================== the static GEMM of W = 1 (common.w1_matmul_kernel)
def _w1_static(a, b_store, kmajor, grid, cfg=None, tail=0):
    from kosmos.core import planning
    from kosmos.gemm.w1_static import w1_matmul_args, w1_matmul_kernel
    m, k = a.shape
    n = b_store.shape[0] if kmajor else b_store.shape[1]
    cfg = cfg or planning.tile_config(m, n, k, world=1, programs=grid)
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=a.device)
    epoch = torch.full((1,), 7, dtype=torch.int32, device=a.device)
    g, args, kw = w1_matmul_args(a, b_store, kmajor, c, cfg, epoch, grid, planning.GROUP_M, planning.interpreting(),
                                 tail=tail)
    w1_matmul_kernel[(g,)](*args, **kw)
    assert int(epoch[0]) == 8  # one launch, one epoch
    return c, g


@pytest.mark.interpreter
@pytest.mark.parametrize("ms,k,n", SHAPES + [pytest.param(40, 48, 80, id="ms40-k48-n80")])
@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("grid", [1, 2, 5])
def test_w1_static_matmul_is_the_self_scheduled_kernel_bitwise(ms, k, n, kmajor, grid):
    """The static W=1 GEMM (what a bf16 untraced call at one rank launches) gives bitwise the self-scheduled
    kernel's output at the same tiles -- ragged M, N and K, b k-major, fewer and more programs than tiles --
    and every element is written (NaN-poisoned output)."""
    t = RS(1, ms, k, n, seed=ms * 3 + k + n + grid, b_kmajor=kmajor, grid=grid)
    t.new_epoch_inputs()
    t.launch(0, 1)
    t.rk.check_clean(0)
    want = t.outputs()[0]
    got, programs = _w1_static(t.As[0], t.b_store[0], kmajor, grid, t.cfg)
    assert torch.isfinite(got.float()).all(), programs
    assert torch.equal(got, want), (programs, (got.float() - want.float()).abs().max())


@pytest.mark.interpreter
@pytest.mark.parametrize("ms,k,n", [(40, 48, 80), (33, 40, 72), (16, 16, 48)])
@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("grid", [1, 3])
def test_w1_static_matmul_tail_tiles(ms, k, n, kmajor, grid):
    """Tiles BN + a tail wide (two accumulators): ragged M, N (a last tile whose tail lies wholly past N at
    n = 80 and 48) and K, b k-major, fewer programs than tiles -- every element written (NaN-poisoned) and
    within TOL of the fp32 product; the same bits on a second launch."""
    from kosmos import reference
    from kosmos.core import planning
    gen = torch.Generator().manual_seed(ms + k + n + grid)
    a = randn((ms, k), gen, "cpu")
    b = opcases.weight(k, n, gen, "cpu", kmajor)
    b_store = b.t() if kmajor else b
    cfg = planning.TileConfig(16, 16, 16, 4, 1)
    got, programs = _w1_static(a, b_store, kmajor, grid, cfg, tail=16)
    assert programs == min(grid, -(-ms // 16) * -(-n // 32))
    assert torch.isfinite(got.float()).all()
    assert reference.rel_err(got, a.float() @ b.float()) < TOL
    again, _ = _w1_static(a, b_store, kmajor, grid, cfg, tail=16)
    assert torch.equal(again, got)


def test_w1_tail_tiles_run_unsplit_only():
    from kosmos.core import planning
    from kosmos.gemm.w1_static import w1_matmul_args
    a, b, c = torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16), torch.zeros(
        64, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unsplit only"):
        w1_matmul_args(a, b, False, c, planning.TileConfig(16, 16, 16, 4, 1), torch.zeros(1, dtype=torch.int32), 4,
                       planning.GROUP_M, True, split=2, tail=16)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(1024, 8192, 3072), (512, 5120, 5120), (3000, 2880, 6912), (100, 256, 200)])
@pytest.mark.parametrize("tail", [64, 32])
@pytest.mark.parametrize("kmajor", [False, True])
def test_w1_static_matmul_tail_tiles_gpu(no_tf32, m, k, n, tail, kmajor):
    """The tail tiles (128 + 64 = 192 or 128 + 32 = 160 columns) at their real sizes on the GPU: every element
    written (NaN-poisoned), within TOL of the fp32 product, bitwise the same on a second launch."""
    from kosmos import reference
    from kosmos.core import planning
    gen = torch.Generator().manual_seed(m + k + n + tail)
    a = randn((m, k), gen, "cuda")
    b = opcases.weight(k, n, gen, "cuda", kmajor)
    b_store = b.t() if kmajor else b
    cfg = planning.TileConfig(128, 128, 64, 8, 4)
    sms = runtime.num_sms(a.device)
    got, _ = _w1_static(a, b_store, kmajor, sms, cfg, tail=tail)
    assert torch.isfinite(got.float()).all()
    assert reference.rel_err(got, a.float() @ b.float()) < TOL
    again, _ = _w1_static(a, b_store, kmajor, sms, cfg, tail=tail)
    assert torch.equal(again, got)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(512, 7168, 1536), (6000, 1024, 1536), (3000, 2880, 6912), (100, 256, 128),
                                   (4096, 4096, 4096), (1000, 1000, 8192)])  # K = 1024: two per SM, ragged
@pytest.mark.parametrize("kmajor", [False, True])
def test_w1_static_matmul_gpu_bitwise_and_taken(no_tf32, m, k, n, kmajor):
    """On the GPU at the rule's real tiles: the public op at W=1 (bf16, untraced, policy self) launches the static
    GEMM -- its plan's kernel is w1_matmul_kernel -- and its output is bitwise the self-scheduled kernel's
    (policy="fixed" with no communication programs keeps that kernel) and within TOL of the fp32 product;
    repeated calls (the plan's fast path) are bitwise the first."""
    import kosmos
    from kosmos import reference
    from kosmos.core import planning
    from kosmos.gemm.w1_static import w1_matmul_kernel
    gen = torch.Generator().manual_seed(m + k + n)
    a = randn((m, k), gen, "cuda")
    b = opcases.weight(k, n, gen, "cuda", kmajor)
    runtime.reset_workspaces()
    try:
        c = kosmos.matmul_reduce_scatter(a, b)
        again = [kosmos.matmul_reduce_scatter(a, b) for _ in range(3)]
        _, c_ag = kosmos.all_gather_matmul(a, b)
        old = kosmos.matmul_reduce_scatter(a, b, policy="fixed", comm_programs=1)
        kosmos.check_errors()
        ws = runtime.get_workspace(None, a.device)
        kernels = {p.launch.kernel for p in ws._plans.values()}
        assert w1_matmul_kernel in kernels, kernels
        sms = runtime.num_sms(a.device)
        w1 = planning.w1_plan(m, n, k, programs=sms)
        # a K split / stream-K sums in another order than old; another tile (two per SM at short K) may too
        same_sum = (w1.split == 1 and not w1.stream_k and not w1.tail
                    and w1.tile == planning.tile_config(m, n, k, world=1, programs=sms))
        for x in again + [c_ag] + ([old] if same_sum else []):
            assert torch.equal(x, c)
        (ref,) = reference.matmul_reduce_scatter_ref_local([a], [b])
        assert reference.rel_err(c, ref) < TOL
        assert reference.rel_err(old, ref) < TOL
    finally:
        runtime.reset_workspaces()


def _w1_split(a, b_store, kmajor, programs, cfg, split, ws, stream_k=False):
    from kosmos.core import planning
    from kosmos.gemm.w1_static import w1_matmul_args, w1_matmul_kernel, w1_partial_elems, w1_split_grid, w1_stream_k_grid
    m, k = a.shape
    n = b_store.shape[0] if kmajor else b_store.shape[1]
    tiles = -(-m // cfg.BM) * -(-n // cfg.BN)
    if stream_k:
        grid = w1_stream_k_grid(programs, tiles, k, cfg)
        ws.ensure_counters(tiles)
        parts = torch.full((2 * grid * cfg.BM * cfg.BN,), float("nan"), device=a.device)
    else:
        grid = w1_split_grid(programs, tiles, split)
        ws.ensure_counters(2 * (grid // split))
        parts = torch.full((w1_partial_elems(grid, tiles, split, cfg),), float("nan"), device=a.device)
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=a.device)
    epoch = torch.full((1,), 7, dtype=torch.int32, device=a.device)
    g, args, kw = w1_matmul_args(a, b_store, kmajor, c, cfg, epoch, programs, planning.GROUP_M, False,
                                 split=1 if stream_k else split, partials=parts, counters=ws.counters, errors=ws.errors,
                                 timeout_ns=ws.timeout_ns(), op=codes.OP_MATMUL_REDUCE_SCATTER.value,
                                 stream_k=stream_k)
    assert g == grid
    w1_matmul_kernel[(g,)](*args, **kw)
    torch.cuda.synchronize()
    assert int(epoch[0]) == 8  # one launch, one epoch
    assert int(ws.errors[0]) == 0 and not bool(ws.counters.any())  # no timeout; every group reset its counters
    return c


@pytest.mark.interpreter
@pytest.mark.parametrize("m,k,n,programs", [
    (80, 96, 96, 3),    # 15 tiles on 3 programs: 4 data-parallel waves, then 3 tiles' steps in 3 runs (no split)
    (80, 112, 96, 4),   # 15 tiles on 4: 2 waves data-parallel, then 7 tiles of 7 steps in runs of 12.25
    (40, 160, 40, 7),   # 6 tiles on 7 programs (ragged M, N): runs shorter than a tile, tiles in 2-3 pieces
    (33, 72, 56, 5),    # ragged M / N / K (K steps of 16: 5, the last one partial)
])
@pytest.mark.parametrize("kmajor", [False, True])
def test_w1_stream_k_schedule(m, k, n, programs, kmajor):
    """The static GEMM's stream-K schedule (data-parallel waves, then the rest in equal runs of K steps) under
    the interpreter, with 16x32x16 tiles: within TOL of the fp32 product, every element written (NaN-poisoned
    output and partials), the same bits on a second launch, the tile counters back at zero, one epoch."""
    from kosmos import reference
    from kosmos.core import planning
    from kosmos.gemm.w1_static import w1_matmul_args, w1_matmul_kernel, w1_stream_k_grid
    cfg = planning.TileConfig(16, 32, 16, 4, 1)
    gen = torch.Generator().manual_seed(m + k + n + programs)
    a = randn((m, k), gen, "cpu")
    b = opcases.weight(k, n, gen, "cpu", kmajor)
    b_store = b.t() if kmajor else b
    tiles = -(-m // cfg.BM) * -(-n // cfg.BN)
    outs = []
    for _ in range(2):
        grid = w1_stream_k_grid(programs, tiles, k, cfg)
        parts = torch.full((grid * cfg.BM * cfg.BN,), float("nan"))
        counters = torch.zeros(tiles, dtype=torch.int32)
        errors = runtime.one_rank_errors(None, torch.device("cpu"))
        c = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        epoch = torch.full((1,), 7, dtype=torch.int32)
        g, args, kw = w1_matmul_args(a, b_store, kmajor, c, cfg, epoch, programs, planning.GROUP_M, True,
                                     partials=parts, counters=counters, errors=errors, timeout_ns=10**6,
                                     op=codes.OP_MATMUL_REDUCE_SCATTER.value, stream_k=True)
        assert g == grid == min(programs, tiles * -(-k // 16))
        w1_matmul_kernel[(g,)](*args, **kw)
        assert int(epoch[0]) == 8 and int(errors[0]) == 0 and not bool(counters.any())
        outs.append(c)
    (ref,) = reference.matmul_reduce_scatter_ref_local([a], [b])
    assert torch.isfinite(outs[0].float()).all()
    assert reference.rel_err(outs[0], ref) < TOL
    assert torch.equal(outs[0], outs[1])


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n,tile,split,programs", [
    (512, 7168, 1536, (128, 256, 8, 3), 5, 132),   # one round: 24 tiles, 26 groups
    (100, 4096, 4096, (128, 128, 4, 4), 2, 132),   # ragged M (one 128-row tile holds 100 rows)
    (1000, 3000, 712, (128, 256, 8, 3), 3, 132),   # ragged M, N and K (K steps 47 into 3 uneven parts)
    (512, 5120, 5120, (128, 256, 8, 3), 3, 132),   # two rounds (80 tiles, 44 groups): the parity halves
    (640, 2048, 1024, (64, 128, 4, 4), 4, 12),     # many rounds on 3 groups
    (512, 7168, 1536, (128, 128, 4, 4), 2, 132),   # w1_plan's split (one block per member's share)
    (1000, 3000, 712, (128, 256, 8, 3), 2, 132),   # 64-row shares of a 128x256 tile, ragged
    (3000, 3072, 7168, (128, 128, 4, 4), 2, 132),  # stream-K: 4 waves data-parallel, then 180 tiles in 132 runs
])
@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("stream_k", [False, True], ids=["split", "stream-k"])
def test_w1_split_k_gpu(no_tf32, m, k, n, tile, split, programs, kmajor, stream_k):
    """The static GEMM's K split (SPLIT programs per tile, fp32 partials summed by the whole group): within TOL
    of the fp32 product, every element written (NaN-poisoned output and partials), bitwise the same on a second
    launch (a fixed summation order), the counters back at zero, one epoch per launch -- one round, two
    (round-parity halves), many (3 groups, 12 programs), ragged M / N / K, b k-major. ``stream_k``: the same
    shapes and tiles under the stream-K schedule (``split`` unused) -- data-parallel waves then runs (3000 rows;
    640 rows on 12 programs), runs crossing 2 or more tiles, tiles in 3+ pieces (fewer tiles than programs),
    owners with and without other pieces."""
    from kosmos import reference
    from kosmos.core import planning
    bm, bn, warps, stages = tile
    cfg = planning.TileConfig(bm, bn, 64, warps, stages)
    gen = torch.Generator().manual_seed(m + k + n + split)
    a = randn((m, k), gen, "cuda")
    b = opcases.weight(k, n, gen, "cuda", kmajor)
    runtime.reset_workspaces()
    try:
        ws = runtime.get_workspace(None, a.device)
        ws.ensure(0, 0)
        b_store = b.t() if kmajor else b
        c = _w1_split(a, b_store, kmajor, programs, cfg, split, ws, stream_k)
        again = _w1_split(a, b_store, kmajor, programs, cfg, split, ws, stream_k)
        (ref,) = reference.matmul_reduce_scatter_ref_local([a], [b])
        assert torch.isfinite(c.float()).all()
        assert reference.rel_err(c, ref) < TOL
        assert torch.equal(again, c)
    finally:
        runtime.reset_workspaces()
