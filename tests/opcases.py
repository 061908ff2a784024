"""What the per-op kernel test files share (imported by them; not a test module).

One section per platform, as in the op files (test_all_gather_matmul.py, test_matmul_reduce_scatter.py,
test_moe_forward.py, test_tp_ops_together.py; the markers are described in conftest.py):

* CPU interpreter -- the fixed-role phases (``COMM_ONLY``, ``COMPUTE_ONLY``) and ``SELF`` that order the
  simulated ranks by hand, ``run_schedule``, the small shape table.
* One GPU -- bf16 inputs, the W=1 shape table, every rank's inputs for the multi-GPU rank bodies, ``spawn``.
* Simulated ranks on one GPU -- ``make``, ``policy``, ``check_call`` and ``OnRanksCases``: the cases both TP ops
  run (each op file subclasses it with its ``op``).
* Input checks -- ``InputChecks``: the TP ops' validation cases, each op file subclasses it with its ``name``.

The simulated-rank harness itself is simranks.py; process spawning is multiproc.py.
"""
from __future__ import annotations

import importlib
import re
import types

import pytest
import torch

from multiproc import spawn_gpu
from simranks import AG, RS, launch_all

# ==================================================================================== CPU interpreter
INTERP_GRID = 3
# A correct run never waits under the interpreter (phases are ordered); a broken one fails after ~5000 spins
# (one spin counts as 1000 ns) instead of hanging for minutes.
INTERP_TIMEOUT_NS = 5_000_000
SHORT_NS = 50_000  # the interpreter counts one spin as 1000 ns: ~50 spins, then the wait gives up
EPOCHS = (1, 2, 3)
# Interpreter tiles: BM = 16, BK = 16, BN = 32 here (planning.tile_config)
SHAPES = [
    pytest.param(21, 40, 48, id="ms21-k40-n48"),  # one full 16-row chunk + a ragged one; K not a multiple of BK;
                                                  # N: one full 32-column tile + a ragged one
    pytest.param(5, 16, 24, id="ms5-k16-n24"),    # less than one chunk; K exactly one BK step; one ragged N tile
]
WORLDS = [
    1,  # no peer: nothing gathered or staged, the done handshake skipped
    2,  # one peer
    3,  # the comm queues' stagger across several peers (W not a power of two)
]

COMM_ONLY = dict(policy="fixed", comm_programs=INTERP_GRID)
COMPUTE_ONLY = dict(policy="fixed", comm_programs=0)
SELF = dict(policy="self")


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


def run_device_epochs(t, schedule, calls=3):
    """Like ``run_schedule``, but the host never names an epoch: every launch runs at its rank's device epoch
    (``launch(r, None)``), as the public ops and a replayed CUDA graph do; a rank's phase launches before its last
    one of the call pass ``advance=False``. Every call re-launches the same arguments on fresh data in the same
    buffers (a simulated replay). After call i every rank's slot holds i, the done and data flags hold i, the
    heads are clean and the outputs right; a last call on unchanged inputs is bitwise the previous one."""
    last = {r: i for i, (r, _) in enumerate(schedule)}
    for call in range(1, calls + 2):
        if call <= calls:
            t.new_epoch_inputs()
        else:
            before = t.outputs()
            for c in t.cs:
                c.fill_(float("nan"))
        for i, (r, pol) in enumerate(schedule):
            t.launch(r, None, **pol, **({} if last[r] == i else {"advance": False}))
            t.rk.check_clean(r)
        assert t.rk.device_epochs() == [call] * t.world
        t.rk.check_done(call)
        t.check_flags(call)
        t.check_outputs()
    for r in range(t.world):
        assert torch.equal(t.cs[r], before[r]), f"rank {r}: a replay on the same inputs differs"


# ============================================================================================ one GPU
TOL = 1e-2
SPAWN_TIMEOUT_S = 300.0

# GPU tiles (planning.tile_config's wave model): on these few-tile shapes mostly 64x64 or 64x128 (4 warps),
# 128x128 / 128x256 as the tiles grow; BN = N rounded up to a power of two in [64, 256]; BK = 64.
W1_ROWS = (
    1,    # one row: a tile that is almost all padding
    37,   # less than one 64-row tile
    300,  # two full 128-row tiles and a ragged one
)
W1_KN = (
    (8, 8),       # the smallest TMA-legal K and N: one K step and one N tile, mostly padding
    (136, 264),   # K not a multiple of BK; one full 256-column tile + a ragged one
    (512, 1000),  # several K steps; N: three full tiles + a ragged one
)
W1_SHAPES = [(ms, k, n) for ms in W1_ROWS for (k, n) in W1_KN]
W1_VARIANTS = [pytest.param({}, False, id="self"),  # the default policy
               pytest.param({}, True, id="self-kmajor"),  # b given as the .t() of a row-major [N, K] weight
               pytest.param({"policy": "fixed", "comm_programs": 4}, False, id="fixed")]


def randn(shape, gen, device):
    return torch.randn(*shape, generator=gen).to(torch.bfloat16).to(device)


def weight(k, n, gen, device, kmajor):
    """b [K, N]: row-major, or the transpose of a row-major [N, K] weight."""
    if kmajor:
        return randn((n, k), gen, device).t()
    return randn((k, n), gen, device)


def rank_inputs(seed, world, shape_a, shape_b, device, kmajor=False):
    """Every rank's inputs, made identically on every rank (one CPU generator), so that each rank can
    compute the reference of the whole group locally."""
    gen = torch.Generator().manual_seed(seed)
    a = [randn(shape_a, gen, device) for _ in range(world)]
    b = [weight(shape_b[0], shape_b[1], gen, device, kmajor) for _ in range(world)]
    return a, b


def spawn(fn, tmp_path):
    """``fn(rank, world, out_dir)`` on 2 GPUs, one process each (``fn`` must be module-level: pickled by
    reference)."""
    spawn_gpu(fn, tmp_path, timeout_s=SPAWN_TIMEOUT_S)


def w1_trace_records_every_compute_task(op):
    """One call of ``op`` ("ag" or "rs") at W=1 with a trace buffer: every compute tile traced once, t1 >= t0."""
    import kosmos
    from kosmos.core import planning, runtime
    ms, k, n = 300, 256, 1000
    gen = torch.Generator().manual_seed(5)
    a = randn((ms, k), gen, "cuda")
    b = randn((k, n), gen, "cuda")
    grid = runtime.num_sms(a.device)
    trace = torch.zeros(grid, 1024, 4, dtype=torch.int64, device="cuda")
    if op == "ag":
        kosmos.all_gather_matmul(a, b, trace=trace)
    else:
        kosmos.matmul_reduce_scatter(a, b, trace=trace)
    kosmos.check_errors()
    cfg = planning.tile_config(ms, n, k, programs=grid)  # the op's own choice at W=1
    n_tiles = -(-ms // cfg.BM) * -(-n // cfg.BN)
    ev = trace.view(-1, 4).cpu()
    compute = ev[ev[:, 0] == 2]
    assert sorted(compute[:, 1].tolist()) == list(range(n_tiles))
    assert bool((compute[:, 3] >= compute[:, 2]).all())


# ============================================================================ simulated ranks, one GPU
RANKS_TIMEOUT_NS = 2_000_000_000  # a healthy call takes well under 10 ms here
STALL_NS = 50_000_000
# M/W = 200 rows: one full 128-row tile and a ragged one; N = 640: two full 256-column tiles and a half
RANKS_SHAPE = dict(ms=200, k=384, n=640)


def grid(world):
    """Programs per simulated rank: the GPU's SMs shared out, so that all W launches are resident at once."""
    from kosmos.core import runtime
    return runtime.num_sms(torch.device("cuda")) // world


def make(op, world, seed, **kw):
    cls = AG if op == "ag" else RS
    shape = dict(RANKS_SHAPE, **{k: kw.pop(k) for k in ("ms", "k", "n") if k in kw})
    return cls(world, seed=seed, device="cuda", grid=grid(world), timeout_ns=RANKS_TIMEOUT_NS, **shape, **kw)


def policy_kw(name, world):
    """The launch kwargs of policy ``name`` ("self" or "fixed": a quarter of the rank's programs communicate)."""
    return dict(policy="self") if name == "self" else dict(policy="fixed", comm_programs=max(1, grid(world) // 4))


def check_call(t, epoch):
    torch.cuda.synchronize()
    for r in range(t.world):
        t.rk.check_clean(r)
    t.rk.check_done(epoch)
    t.check_flags(epoch)
    t.check_outputs()


RANKS_WORLDS = [
    (2, "self"),   # one peer
    (3, "self"),   # W not a power of two
    (4, "self"),
    (8, "self"),   # the most ranks NVLink gives one host; 16 programs each on one H200
    (2, "fixed"),  # the fixed-role policy (16 comm programs per rank on one H200)
    (8, "fixed"),  # fixed roles with 4 comm programs per rank
]


@pytest.mark.ranks
@pytest.mark.usefixtures("ranks_setup")
class OnRanksCases:
    """The simulated-rank cases both TP ops share; ``op`` ("ag" or "rs") is set by the subclass."""
    op = None

    @pytest.mark.parametrize("world,policy", RANKS_WORLDS)
    def test_tp_op_at_world(self, world, policy):
        """Fresh random inputs each epoch, outputs and staging poisoned with NaN; every output, every gathered
        row (AG), every staged partial (RS), every flag and done signal checked after each call."""
        t = make(self.op, world, seed=world * 10 + len(policy))
        for epoch in EPOCHS:
            t.new_epoch_inputs()
            t.launch_all(epoch, **policy_kw(policy, world))
            check_call(t, epoch)

    @pytest.mark.parametrize("world,policy", [(1, "self"), (2, "self"), (3, "self"), (4, "self"), (8, "self"),
                                              (2, "fixed")])
    def test_tp_op_mxfp8_at_world(self, world, policy):
        """MXFP8 operand (K = 384: 12 MX blocks): the payload and scales arrive bit for bit (AG), every slot's
        rows are dequantized exactly, the output matches the fp32 product of the dequantized values; fresh
        inputs and poisoned buffers each epoch."""
        t = make(self.op, world, seed=world * 10 + len(policy) + 3, mx=True)
        for epoch in EPOCHS:
            t.new_epoch_inputs()
            t.launch_all(epoch, **policy_kw(policy, world))
            check_call(t, epoch)

    def test_tp_op_mxfp8_back_to_back_bitwise(self):
        """MXFP8 at W = 2: 10 calls back to back give bitwise the same output."""
        t = make(self.op, 2, seed=77, mx=True)
        t.new_epoch_inputs()
        outs = []
        for epoch in range(1, 11):
            t.launch_all(epoch)
            if epoch % 5 == 0:
                outs.append(t.outputs())
        check_call(t, 10)
        for r in range(2):
            assert torch.equal(outs[1][r], outs[0][r]), f"rank {r}: output differs between back-to-back calls"

    def test_tp_op_transposed_weight(self):
        """b given as the .t() of a row-major [N, K] weight (k-major B tiles) at W = 3."""
        t = make(self.op, 3, seed=30, b_kmajor=True)
        for epoch in EPOCHS[:2]:
            t.new_epoch_inputs()
            t.launch_all(epoch)
            check_call(t, epoch)

    @pytest.mark.parametrize("world", [2, 4])
    def test_tp_op_back_to_back_bitwise(self, world):
        """20 calls back to back on the same inputs, no host synchronisation between them: every call's output is
        bitwise the same (RS sums the partials in fixed rank order; AG's dot products do not depend on the
        schedule), and the last call leaves clean heads, flags and done signals."""
        t = make(self.op, world, seed=40 + world)
        t.new_epoch_inputs()
        outs = []
        for epoch in range(1, 21):
            t.launch_all(epoch)
            if epoch % 5 == 0:
                outs.append(t.outputs())  # a device-side copy, ordered after the call: no host sync
        check_call(t, 20)
        for snap in outs[1:]:
            for r in range(world):
                assert torch.equal(snap[r], outs[0][r]), f"rank {r}: output differs between back-to-back calls"

    def test_tp_op_stalled_rank_times_out(self):
        """W = 4 with rank 3 never launching: ranks 0..2 wait for its rows (AG) or partials (RS), time out, record
        which counter they waited on, and their launches end with clean heads: no hang."""
        from kosmos.core import runtime
        t = make(self.op, 4, seed=70)
        t.new_epoch_inputs()
        launch_all(3, lambda r: t.launch(r, 1, timeout_ns=STALL_NS))
        torch.cuda.synchronize()
        for r in range(3):
            err = t.rk.errors[r].tolist()
            assert err[0] != 0, f"rank {r} did not time out"
            assert err[2] == r and err[5] == 1, runtime.decode_error(err)
            assert t.rk.heads[r].tolist() == [0] * runtime.NUM_HEADS
            name = "all_gather_matmul" if self.op == "ag" else "matmul_reduce_scatter"
            assert re.match(rf"{name}: rank {r}( \(task \d+\))? timed out", runtime.decode_error(err))


# ======================================================================================= input checks
# The ops' checks that need a CUDA tensor to get past the device check run on a CPU-only machine with a tensor
# subclass that reports ``device == cuda:0`` (on a GPU machine, with real CUDA tensors). The workspace, the SM
# count and the launch are monkeypatched: the workspace is a fake whose first mutating call raises
# ``Reached``, so a valid call ends there and an invalid one must raise ValueError before it.
agmod = importlib.import_module("kosmos.ops.all_gather_matmul")
rsmod = importlib.import_module("kosmos.ops.matmul_reduce_scatter")
SMS = 132  # SM count reported by the patched runtime.num_sms


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports itself as on cuda:0 (only metadata is ever read by the checks)."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda", 0)


def cuda(t):
    """``t`` on cuda:0 with the same shape and strides (views are taken before calling this)."""
    if torch.cuda.is_available():
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda").copy_(t)
    return torch.Tensor._make_subclass(_FakeCuda, t)


def bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


class Reached(Exception):
    """Validation passed: the op went on to touch the workspace (first step towards a launch)."""


class FakeWorkspace:
    def __init__(self, size, rank=0):
        self.world = types.SimpleNamespace(size=size, rank=rank, group=None, device=torch.device("cuda", 0))
        self.calls = []

    def _touch(self, what):
        self.calls.append(what)
        raise Reached(what)

    def ensure(self, *a, **k):
        self._touch("ensure")

    def before_launch(self):
        self._touch("before_launch")

    def after_launch(self):
        self._touch("after_launch")

    def timeout_ns(self):
        self._touch("timeout_ns")


def raises_before_launch(state, fn, a, b, match, **kw):
    with pytest.raises(ValueError, match=match):
        fn(a, b, **kw)
    assert state["ws"].calls == []
    assert state["launches"] == 0


@pytest.mark.gpu_optional
class InputChecks:
    """The input checks both TP ops share: a ValueError before anything is launched. ``name`` (the op's
    function and module in kosmos.kernels) is set by the subclass."""
    name = None

    def op(self, a, b, **kw):
        return getattr(agmod if self.name == "all_gather_matmul" else rsmod, self.name)(a, b, **kw)

    @pytest.fixture
    def fake_world(self, monkeypatch):
        """Patch every path from the checks to a launch; returns a setter for the world size."""
        from kosmos.core import runtime
        state = {"ws": FakeWorkspace(1), "get_workspace": 0, "launches": 0}

        def get_workspace(group=None, device=None):
            state["get_workspace"] += 1
            return state["ws"]

        def launch(*a, **k):
            state["launches"] += 1
            raise AssertionError("kernel launched")

        def no_alloc():
            raise AssertionError("allocator set up during validation")

        monkeypatch.setattr(runtime, "get_workspace", get_workspace)
        monkeypatch.setattr(runtime, "num_sms", lambda device: SMS)
        monkeypatch.setattr(runtime, "ensure_triton_allocator", no_alloc)
        monkeypatch.setattr(agmod, "launch", launch)
        monkeypatch.setattr(rsmod, "launch", launch)

        def set_world(size, rank=0):
            state["ws"] = FakeWorkspace(size, rank)
            return state["ws"]

        state["set_world"] = set_world
        yield state
        assert state["launches"] == 0

    # -------------------------------------------------------------------------------- positive controls
    @pytest.mark.parametrize("kw", [{}, {"policy": "self"}, {"policy": "fixed", "comm_programs": 1},
                                    {"policy": "fixed", "comm_programs": SMS - 1}])
    def test_valid_inputs_pass_validation(self, fake_world, kw):
        with pytest.raises(Reached):
            self.op(cuda(bf16(24, 16)), cuda(bf16(16, 32)), **kw)
        with pytest.raises(Reached):  # transposed row-major [N, K] weight
            self.op(cuda(bf16(24, 16)), cuda(bf16(32, 16).t()), **kw)

    # -------------------------------------------------------------------- checks reachable with CPU tensors
    def test_wrong_dtype(self, fake_world):
        raises_before_launch(fake_world, self.op, cuda(torch.zeros(8, 16)), cuda(bf16(16, 8)), "bfloat16")
        raises_before_launch(fake_world, self.op, cuda(bf16(8, 16)), cuda(torch.zeros(16, 8, dtype=torch.float16)),
                             "bfloat16")
        # the same on plain CPU tensors: the dtype check comes before the device check
        raises_before_launch(fake_world, self.op, torch.zeros(8, 16), bf16(16, 8), "bfloat16")

    def test_not_2d(self, fake_world):
        raises_before_launch(fake_world, self.op, bf16(16), bf16(16, 8), "2-D")
        raises_before_launch(fake_world, self.op, cuda(bf16(16)), cuda(bf16(16, 8)), "2-D")
        raises_before_launch(fake_world, self.op, cuda(bf16(8, 16)), cuda(bf16(2, 8, 8)), "2-D")

    def test_not_a_tensor(self, fake_world):
        raises_before_launch(fake_world, self.op, [[1.0]], bf16(16, 8), "torch.Tensor")

    def test_empty(self, fake_world):
        raises_before_launch(fake_world, self.op, cuda(bf16(0, 16)), cuda(bf16(16, 8)), "empty")

    def test_cpu_tensor(self, fake_world):
        raises_before_launch(fake_world, self.op, bf16(8, 16), bf16(16, 8), "CUDA")
        raises_before_launch(fake_world, self.op, bf16(8, 16), cuda(bf16(16, 8)), "CUDA")

    # -------------------------------------------------------------- checks past the device check (patched)
    def test_b_on_other_device(self, fake_world):
        raises_before_launch(fake_world, self.op, cuda(bf16(8, 16)), bf16(16, 8), "is on")

    def test_a_not_contiguous(self, fake_world):
        a = cuda(bf16(8, 32)[:, :16])
        assert not a.is_contiguous()
        raises_before_launch(fake_world, self.op, a, cuda(bf16(16, 8)), "contiguous")
        raises_before_launch(fake_world, self.op, cuda(bf16(16, 8).t()), cuda(bf16(16, 8)), "contiguous")

    def test_mismatched_k(self, fake_world):
        raises_before_launch(fake_world, self.op, cuda(bf16(8, 16)), cuda(bf16(24, 8)), "K=16")
        raises_before_launch(fake_world, self.op, cuda(bf16(8, 16)), cuda(bf16(8, 16)), "K=16")

    @pytest.mark.parametrize("k,n,name", [
        (12, 16, "K=12"),  # K not a multiple of 8
        (16, 12, "N=12"),  # N not a multiple of 8
        (4, 8, "K=4"),     # K below 8
        (8, 1, "N=1"),     # a single column
        (20, 36, "K=20"),  # both wrong: K is reported first
    ])
    def test_k_n_multiple_of_8(self, fake_world, k, n, name):
        raises_before_launch(fake_world, self.op, cuda(bf16(8, k)), cuda(bf16(k, n)),
                             f"{name} must be a multiple of 8")
        # a transposed weight is checked the same way
        raises_before_launch(fake_world, self.op, cuda(bf16(8, k)), cuda(bf16(n, k).t()), "multiple of 8")

    def test_b_strided_not_transpose(self, fake_world):
        b = cuda(bf16(16, 64)[:, ::2])  # [16, 32], strides (64, 2)
        assert not b.is_contiguous() and not b.t().is_contiguous()
        raises_before_launch(fake_world, self.op, cuda(bf16(8, 16)), b, "row-major")
        b2 = cuda(bf16(16, 64)[:, :32])  # [16, 32], strides (64, 1): a column slice
        raises_before_launch(fake_world, self.op, cuda(bf16(8, 16)), b2, "row-major")

    @pytest.mark.parametrize("precision", ["fp8", "MXFP8", "bfloat16", 8])
    def test_unknown_precision(self, fake_world, precision):
        raises_before_launch(fake_world, self.op, bf16(8, 32), bf16(32, 8), "precision=", precision=precision)

    def test_mxfp8_precision_checks(self, fake_world):
        """precision="mxfp8" quantizes a bf16 a: K must hold whole MX blocks, a must be bf16; an MXTensor is not
        bf16."""
        from kosmos.quant import MXTensor
        raises_before_launch(fake_world, self.op, bf16(8, 16), bf16(16, 8), "multiple of 32", precision="mxfp8")
        raises_before_launch(fake_world, self.op, torch.zeros(8, 32), bf16(32, 8), "bf16", precision="mxfp8")
        mx = MXTensor(torch.zeros(8, 32, dtype=torch.float8_e4m3fn), torch.zeros(8, 1, dtype=torch.uint8))
        raises_before_launch(fake_world, self.op, mx, bf16(32, 8), "precision='bf16'", precision="bf16")

    @pytest.mark.parametrize("policy", ["greedy", "SELF", "", "fixed-role"])
    def test_unknown_policy(self, fake_world, policy):
        raises_before_launch(fake_world, self.op, cuda(bf16(8, 16)), cuda(bf16(16, 8)), "unknown policy",
                             policy=policy)

    @pytest.mark.parametrize("s", [
        None,      # fixed roles without a count
        0,         # no comm program
        -1,
        SMS,       # no compute program left
        SMS + 5,   # more than the grid
    ])
    def test_fixed_policy_bad_comm_programs(self, fake_world, s):
        raises_before_launch(fake_world, self.op, cuda(bf16(8, 16)), cuda(bf16(16, 8)), "comm_programs",
                             policy="fixed", comm_programs=s)

    @pytest.mark.parametrize("shape", [
        (SMS, 1024),         # not 3-D
        (SMS - 1, 1024, 4),  # one row fewer than the grid
        (SMS, 512, 4),       # fewer events per program than TRACE_EVENTS
    ])
    def test_bad_trace_buffer(self, fake_world, shape):
        trace = cuda(torch.zeros(*shape, dtype=torch.int64))
        raises_before_launch(fake_world, self.op, cuda(bf16(9, 16)), cuda(bf16(16, 8)), "trace", trace=trace)

    def test_misaligned_base_pointer_rejected(self, fake_world):
        if torch.cuda.is_available():  # cuda() would copy into a fresh (aligned) allocation
            a = bf16(8 * 16 + 1).cuda()[1:].view(8, 16)
        else:
            a = cuda(bf16(8 * 16 + 1)[1:].view(8, 16))
        assert a.is_contiguous() and a.data_ptr() % 16 != 0
        raises_before_launch(fake_world, self.op, a, cuda(bf16(16, 8)), "align")
