"""Launch plans (kosmos/launch_plan.py) through the public TP ops, on the CPU under the Triton interpreter.

The public ops need CUDA tensors and a CUDA workspace; here the device check sees a CPU tensor as cuda:0 (the
input-check suite's ``_FakeCuda``) and the workspace is a CPU one (``CPUWorkspace``: the real Workspace with
CPU buffers and no events), so the whole eager call runs: the plan is built once per call signature and reused,
a changed shape / dtype / layout / config builds another, bad inputs still raise the ops' one-line errors after
a plan exists, planned calls equal the unplanned launch bitwise, and the fast launch's self-check and fallback
(the fast path itself is off under the interpreter: a stand-in launcher is injected).
"""
import warnings

import pytest
import torch

import opcases
from kosmos.core import launch_plan, planning, runtime
from kosmos.ops import all_gather_matmul as agmod
from kosmos.ops import tp_common
from kosmos.ops import matmul_reduce_scatter as rsmod

pytestmark = pytest.mark.interpreter


class CPUWorkspace(runtime.Workspace):
    """The runtime's Workspace at W=1 with CPU buffers: no symmetric memory, no events, no synchronisation."""

    def ensure(self, data_bytes, flag_slots):
        need = runtime.FLAG_BASE + flag_slots
        if self.data is not None and self.data_bytes >= data_bytes and self.signal_slots >= need:
            return
        self.data = torch.zeros(max(data_bytes, 1 << 12), dtype=torch.uint8)
        self.signals = torch.zeros(max(need, 4096), dtype=torch.int32)
        self.peer_data = torch.tensor([self.data.data_ptr()], dtype=torch.int64)
        self.peer_signals = torch.tensor([self.signals.data_ptr()], dtype=torch.int64)
        if self.heads is None:
            self.heads = torch.zeros(runtime.NUM_HEADS, dtype=torch.int32)
            self.epoch_slot = torch.zeros(1, dtype=torch.int32)
            self.errors = torch.zeros(runtime.ERR_SLOTS, dtype=torch.int64)
        self.epoch_slot.zero_()
        self._grew()

    def before_launch(self):
        self._capturing = False

    def after_launch(self):
        pass


@pytest.fixture
def cpu_ops(monkeypatch):
    """The public TP ops runnable on CPU tensors; yields the workspace. Plan counters reset."""
    ws = CPUWorkspace(runtime.World(None, 0, 1, torch.device("cpu")))
    real_check = tp_common.check_operands

    def check(a_name, a, b, policy):  # the real checks, with the device check seeing cuda:0
        def fake(t):
            return opcases.cuda(t) if isinstance(t, torch.Tensor) else t
        rows, k, n, _, _ = real_check(a_name, tuple(map(fake, a)) if isinstance(a, tuple) else fake(a), fake(b),
                                      policy)
        return (rows, k, n) + tp_common.b_layout(b)

    monkeypatch.setattr(runtime, "get_workspace", lambda group=None, device=None: ws)
    monkeypatch.setattr(runtime, "num_sms", lambda device: opcases.INTERP_GRID)
    monkeypatch.setattr(rsmod, "check_operands", check)
    monkeypatch.setattr(agmod, "check_operands", check)
    launch_plan.reset_plan_stats()
    yield ws
    launch_plan.set_fast_launch(True)


def _inputs(seed, m=21, k=40, n=48, kmajor=False):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, k, generator=gen).to(torch.bfloat16).t() if kmajor
         else torch.randn(k, n, generator=gen).to(torch.bfloat16))
    return a, b


def _op(name):
    if name == "ag":
        return lambda a, b, **kw: agmod.all_gather_matmul(a, b, **kw)[1]
    return lambda a, b, **kw: rsmod.matmul_reduce_scatter(a, b, **kw)


def _unplanned(name, a, b):
    """The op's kernel launched the normal way on explicit buffers (no plan involved)."""
    ws = CPUWorkspace(runtime.World(None, 0, 1, torch.device("cpu")))
    ws.ensure(0, 64)
    b_store, kmajor = tp_common.b_layout(b)
    cfg = planning.tile_config(a.shape[0], b.shape[1], a.shape[1])
    c = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16)
    kw = dict(rank=0, world=1, epoch_slot=ws.epoch_slot, timeout_ns=ws.timeout_ns(), grid=opcases.INTERP_GRID,
              cfg=cfg)
    mod = agmod if name == "ag" else rsmod
    mod.launch(a, b_store, kmajor, c, a if name == "ag" else c, ws.peer_data, ws.peer_signals, ws.signals, ws.heads,
               ws.errors, **kw)
    return c


@pytest.mark.parametrize("name", ["ag", "rs"])
def test_plan_built_once_reused_and_bitwise(cpu_ops, name):
    """Three calls of one signature (two input sets): one plan, two hits; every call bitwise equal to the
    unplanned launch on the same inputs; the heads left clean."""
    op = _op(name)
    x, y = _inputs(1), _inputs(2)
    c1 = op(*x)
    c2 = op(*y)
    c3 = op(*x)
    s = launch_plan.plan_stats()
    assert (s["builds"], s["hits"], s["misses"]) == (1, 2, 1)
    assert len(cpu_ops._plans) == 1
    assert torch.equal(c1, _unplanned(name, *x)) and torch.equal(c3, c1)
    assert torch.equal(c2, _unplanned(name, *y))
    assert cpu_ops.heads.tolist() == [0] * runtime.NUM_HEADS
    assert s["fast_launches"] == 0  # the interpreter: normal launches only


def test_new_signature_new_plan(cpu_ops):
    """A changed shape, dtype layout (k-major weight), config or policy builds a new plan; the old ones stay."""
    from kosmos import MatmulReduceScatterConfig
    op = _op("rs")
    a, b = _inputs(3)
    op(a, b)
    op(*_inputs(3, m=5, k=16, n=24))
    a2, b2 = _inputs(4, kmajor=True)
    c = op(a2, b2)
    assert torch.equal(c, _unplanned("rs", a2, b2))
    op(a, b, config=MatmulReduceScatterConfig(push_partials=True))
    op(a, b, policy="fixed", comm_programs=1)
    assert launch_plan.plan_stats()["builds"] == 5
    op(a, b)
    assert launch_plan.plan_stats()["builds"] == 5 and launch_plan.plan_stats()["hits"] == 1


def test_workspace_growth_drops_plans(cpu_ops):
    op = _op("rs")
    op(*_inputs(5))
    assert len(cpu_ops._plans) == 1
    cpu_ops.ensure(1 << 20, 64)
    assert len(cpu_ops._plans) == 0
    op(*_inputs(5))
    assert launch_plan.plan_stats()["builds"] == 2


@pytest.mark.parametrize("name", ["ag", "rs"])
def test_bad_inputs_still_raise_after_a_plan(cpu_ops, name):
    op = _op(name)
    a, b = _inputs(6)
    op(a, b)
    cases = [
        ((a.float(), b), "must be torch.bfloat16"),
        ((a, b.float()), "must be torch.bfloat16"),
        ((a[:, :-8], b), "must be contiguous|K=32 rows"),
        ((torch.cat([a.flatten(), a.flatten()])[1:1 + 21 * 40].view(21, 40), b), "16-byte aligned"),
        ((a, b[:-8]), "K=40 rows"),
        ((a.unsqueeze(0), b), "2-D"),
        (("x", b), "torch.Tensor"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            op(*args)
    with pytest.raises(ValueError, match="unknown policy"):
        op(a, b, policy="nope")
    with pytest.raises(ValueError, match="fixed-role policy"):
        op(a, b, policy="fixed")
    with pytest.raises((TypeError, ValueError)):
        op(a, b, config={"push": 1})
    assert launch_plan.plan_stats()["builds"] == 1


def _fake_fast(monkeypatch, behaviour):
    """Pretend the fast path is supported and give every plan a stand-in launcher: "normal" launches the
    kernel the normal way, "raise" raises, "nothing" launches nothing."""
    made = []

    def make(kernel, compiled, n_args, kw, grid, varying=None):
        def fast(args):
            made.append(behaviour)
            if behaviour == "raise":
                raise RuntimeError("launcher convention changed")
            if behaviour == "normal":
                kernel[(grid,)](*args, **kw)
        return fast

    monkeypatch.setattr(launch_plan, "fast_launch_supported", lambda: True)
    monkeypatch.setattr(launch_plan, "make_fast_launcher", make)
    return made


@pytest.mark.parametrize("behaviour", ["normal", "raise", "nothing"])
def test_fast_path_self_check_and_fallback(cpu_ops, monkeypatch, behaviour):
    """The first planned launch self-checks the fast launcher: a correct one is used from then on; one that
    raises or writes nothing is turned off with one warning, and every call's output is still the normal
    launch's, bitwise."""
    made = _fake_fast(monkeypatch, behaviour)
    op = _op("rs")
    x, y = _inputs(7), _inputs(8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c1 = op(*x)
        c2 = op(*y)
        c3 = op(*x)
    s = launch_plan.plan_stats()
    assert torch.equal(c1, _unplanned("rs", *x)) and torch.equal(c3, c1) and torch.equal(c2, _unplanned("rs", *y))
    assert s["self_checks"] == 1
    plan = next(iter(cpu_ops._plans.values()))
    msgs = [str(w.message) for w in caught if "fast launch" in str(w.message)]
    if behaviour == "normal":
        assert plan.launch.state == "verified" and s["fast_launches"] == 2 and not msgs
        assert made == ["normal"] * 3
    else:
        assert plan.launch.state == "off" and s["fast_launches"] == 0 and s["fast_disabled"] == 1
        assert len(msgs) == 1 and "\n" not in msgs[0]
        assert made == [behaviour]  # never tried again


def test_fast_launch_raising_later_falls_back(cpu_ops, monkeypatch):
    """A verified fast launcher that raises on a later call: that call launches normally (right output), the
    fast path is off for the plan."""
    _fake_fast(monkeypatch, "normal")
    op = _op("rs")
    x = _inputs(9)
    ref = op(*x)
    plan = next(iter(cpu_ops._plans.values()))
    assert plan.launch.state == "verified"

    def broken(args):
        raise TypeError("bad argument")
    plan.launch.fast = broken
    with pytest.warns(RuntimeWarning, match="fast launch"):
        c = op(*x)
    assert torch.equal(c, ref) and plan.launch.state == "off"


def test_fast_launch_switch(cpu_ops, monkeypatch):
    """set_fast_launch(False): no self-check, normal launches only."""
    made = _fake_fast(monkeypatch, "normal")
    launch_plan.set_fast_launch(False)
    op = _op("ag")
    for _ in range(3):
        op(*_inputs(10))
    assert made == [] and launch_plan.plan_stats()["self_checks"] == 0
    assert launch_plan.plan_stats()["hit_rate"] == pytest.approx(2 / 3)


def test_hooks_active_reads_triton_hook_chains():
    """Triton 3.6 / 3.9 keep launch hooks as HookChains, never None: an empty chain is no hook (the fast path's
    check once read any chain as a hook and so never took the fast path on the GPU)."""
    from types import SimpleNamespace
    from triton.knobs import HookChain
    from kosmos.core import launch_plan
    knobs = SimpleNamespace(launch_enter_hook=HookChain(), launch_exit_hook=HookChain(reversed=True))
    assert not launch_plan.hooks_active(knobs)
    knobs.launch_enter_hook.add(print)
    assert launch_plan.hooks_active(knobs)
    assert not launch_plan.hooks_active(SimpleNamespace(launch_enter_hook=None, launch_exit_hook=None))
    assert launch_plan.hooks_active(SimpleNamespace(launch_enter_hook=None, launch_exit_hook=print))
    assert not launch_plan.hooks_active()  # this process: nothing set


@pytest.mark.parametrize("name", ["ag", "rs"])
def test_traced_calls_never_self_check(cpu_ops, monkeypatch, name):
    """A call with a trace buffer launches once, the normal way, first call or not (the self-check's second
    launch would overwrite the trace only in part: the GPU trace tests failed so in session 10), and every
    compute tile is traced exactly once."""
    from kosmos.core.schedule import TRACE_EVENTS
    made = _fake_fast(monkeypatch, "normal")
    op = _op(name)
    x = _inputs(11)
    for _ in range(2):
        trace = torch.zeros(opcases.INTERP_GRID, TRACE_EVENTS, 4, dtype=torch.int64)
        if name == "ag":
            out = agmod.all_gather_matmul(*x, trace=trace)[1]
        else:
            out = rsmod.matmul_reduce_scatter(*x, trace=trace)
        ev = trace.view(-1, 4)
        tiles = sorted(ev[ev[:, 0] == 2][:, 1].tolist())
        assert tiles == list(range(len(tiles))) and len(tiles) > 0
    s = launch_plan.plan_stats()
    assert s["self_checks"] == 0 and s["fast_launches"] == 0 and made == []
    assert torch.equal(out, op(*x))  # the untraced call (its own plan) gives the same product


class _Desc:
    """Stands in for a host TensorDescriptor: only ``base`` is read by DirectLaunch."""
    def __init__(self, base):
        self.base = base


def test_direct_launch_expands_once_and_replaces_only_what_varies():
    """DirectLaunch (Triton 3.6's C launcher called with the argument list its descriptor wrapper would build):
    the first call's arguments are expanded once -- descriptor i becomes expand(desc, meta) in place, constexprs
    included -- and a later call replaces only the varying positions: a plain argument as is, a descriptor by
    its cached expansion when its tensor's address is unchanged, a fresh one otherwise; the template keeps no
    caller tensor."""
    encoded = []

    def expand(d, meta):
        encoded.append(d.base.data_ptr())
        return [("map", d.base.data_ptr(), meta), 64, 1]

    got = []
    x, y, w, t0 = torch.zeros(4), torch.zeros(4), torch.zeros(8), torch.zeros(2)
    args = [_Desc(x), w, _Desc(w), t0, 5000]  # caller desc, workspace tensor, workspace desc, caller tensor, timeout
    d = launch_plan.DirectLaunch(lambda *a: got.append(a), {0, 2}, ["mA", "mW"], expand, ("f", "coop", "pdl", "meta"),
                                 args, ("CONST",), varying=[0, 3, 4], grid=7)
    assert d.flat[:3] == [("map", x.data_ptr(), "mA"), 64, 1] and d.flat[-1] == "CONST"
    assert d.flat[7] is None and d.flat[8] is None  # caller tensor and timeout: blanked in the template
    assert len(encoded) == 2
    d(args, stream=11)
    call = got[-1]
    assert call[:13] == (7, 1, 1, 11, "f", "coop", "pdl", None, None, "meta", None, None, None)
    got[:] = [c[7:] for c in got]  # from here on: offsets as before the 13 base arguments' last 6
    call = got[-1]
    assert list(call[6:]) == [("map", x.data_ptr(), "mA"), 64, 1, w, ("map", w.data_ptr(), "mW"), 64, 1, t0, 5000,
                              "CONST"]
    assert len(encoded) == 3  # the first call's caller descriptor: encoded again once (cached from now on)
    t1 = torch.zeros(2)
    d([_Desc(x), w, _Desc(w), t1, 6000], stream=12)
    got[-1] = got[-1][7:]
    assert len(encoded) == 3 and got[-1][6 + 7] is t1 and got[-1][6 + 8] == 6000
    d([_Desc(y), w, _Desc(w), t1, 6000], stream=12)
    got[-1] = got[-1][7:]
    assert len(encoded) == 4 and got[-1][6] == ("map", y.data_ptr(), "mA")
    assert got[-1][6 + 4] == ("map", w.data_ptr(), "mW")  # the workspace's descriptor: never re-encoded


def test_direct_launch_only_where_the_launcher_was_read(monkeypatch):
    """DirectLaunch.build: None for a Triton other than the one whose launcher it replicates, or a launcher that
    needs scratch memory, or a wrapper whose closure is not the one read."""
    from types import SimpleNamespace
    run = SimpleNamespace(global_scratch_size=0, profile_scratch_size=0, launch=print, launch_cooperative_grid=False,
                          launch_pdl=False)
    compiled = SimpleNamespace(run=run, function=1, packed_metadata=(4, 1, 0))
    monkeypatch.setattr(launch_plan, "triton_version", lambda: "3.9")
    assert launch_plan.DirectLaunch.build(compiled, [], (), [], 1) is None
    monkeypatch.setattr(launch_plan, "triton_version", lambda: "3.6")
    from triton.backends.nvidia import driver as nvd
    monkeypatch.setattr(nvd, "_BASE_ARGS_FORMAT_LEN", 13, raising=False)
    assert isinstance(launch_plan.DirectLaunch.build(compiled, [], (), [], 1), launch_plan.DirectLaunch)
    run.global_scratch_size, run.global_scratch_align, run.num_ctas = 64, 128, 1  # device descriptors' scratch
    d = launch_plan.DirectLaunch.build(compiled, [], (), [], 3)
    asked = []
    from triton.runtime import _allocation
    token = _allocation._allocator.set(lambda size, align, stream: asked.append((size, align, stream)) or "buf")
    try:
        got = []
        d.raw = lambda *a: got.append(a)
        d([], stream=9)
    finally:
        _allocation._allocator.reset(token)
    assert asked == [(3 * 64, 128, 9)] and got[0][7] == "buf"  # per call, as CudaLauncher.__call__ allocates it
    run.profile_scratch_size = 32
    assert launch_plan.DirectLaunch.build(compiled, [], (), [], 1) is None
    assert "profile scratch" in launch_plan.DIRECT_REFUSED[-1][1]
    run.profile_scratch_size = 0
    unknown = 3

    def inner(*a):
        return unknown
    run.launch = inner
    assert launch_plan.DirectLaunch.build(compiled, [], (), [], 1) is None


def test_direct_launch_2d_grid(monkeypatch):
    """A 2-D grid (quant.py's kernels): DirectLaunch passes (x, y, 1) to the launcher and sizes global scratch
    for x * y programs, as CudaLauncher.__call__ does; make_fast_launcher's int grids stay (g, 1, 1)."""
    from types import SimpleNamespace
    assert launch_plan._grid3(5) == (5, 1, 1) and launch_plan._grid3((3, 2)) == (3, 2, 1)
    run = SimpleNamespace(global_scratch_size=64, global_scratch_align=128, num_ctas=1, profile_scratch_size=0,
                          launch=print, launch_cooperative_grid=False, launch_pdl=False)
    compiled = SimpleNamespace(run=run, function=1, packed_metadata=(4, 1, 0))
    monkeypatch.setattr(launch_plan, "triton_version", lambda: "3.6")
    from triton.backends.nvidia import driver as nvd
    monkeypatch.setattr(nvd, "_BASE_ARGS_FORMAT_LEN", 13, raising=False)
    d = launch_plan.DirectLaunch.build(compiled, [], (), [], (3, 2))
    asked, got = [], []
    from triton.runtime import _allocation
    token = _allocation._allocator.set(lambda size, align, stream: asked.append(size) or "buf")
    try:
        d.raw = lambda *a: got.append(a)
        d([], stream=9)
    finally:
        _allocation._allocator.reset(token)
    assert asked == [6 * 64] and got[0][:4] == (3, 2, 1, 9)


def test_direct_launch_scratch_per_stream(monkeypatch):
    """The global scratch of a DirectLaunch: one allocation per (allocator, stream), reused by later launches on
    that stream (they cannot overlap there); a fresh one per call under PDL or while a CUDA graph is captured."""
    from types import SimpleNamespace
    run = SimpleNamespace(global_scratch_size=64, global_scratch_align=128, num_ctas=1, profile_scratch_size=0,
                          launch=print, launch_cooperative_grid=False, launch_pdl=False)
    compiled = SimpleNamespace(run=run, function=1, packed_metadata=(4, 1, 0))
    monkeypatch.setattr(launch_plan, "triton_version", lambda: "3.6")
    from triton.backends.nvidia import driver as nvd
    monkeypatch.setattr(nvd, "_BASE_ARGS_FORMAT_LEN", 13, raising=False)
    d = launch_plan.DirectLaunch.build(compiled, [], (), [], 2)
    asked, got = [], []
    d.raw = lambda *a: got.append(a[7])
    from triton.runtime import _allocation

    def alloc(size, align, stream):
        asked.append(stream)
        return f"buf{len(asked)}"
    token = _allocation._allocator.set(alloc)
    try:
        for stream in (9, 9, 10, 9, 10):
            d([], stream=stream)
        assert asked == [9, 10] and got == ["buf1", "buf1", "buf2", "buf1", "buf2"]
        monkeypatch.setattr(runtime, "capturing", lambda: True)
        d([], stream=9)
        d([], stream=9)
        assert asked == [9, 10, 9, 9] and got[-2:] == ["buf3", "buf4"]  # a graph's scratch: its own, per call
        monkeypatch.setattr(runtime, "capturing", lambda: False)
        d.pdl = True
        d([], stream=9)
        assert asked[-1] == 9 and got[-1] == "buf5"
    finally:
        _allocation._allocator.reset(token)
