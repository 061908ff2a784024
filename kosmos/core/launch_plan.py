"""Launch plans: what an eager call of a fused op computes once per call signature, and the fast launch.

What a plan caches (one per call signature, in the workspace: ``Workspace._plans``, at most MAX_PLANS). The key
(``find``, ``input_key``) is the op, every input's (shape, strides, dtype, device, 16-byte alignment) -- from which
every input check's outcome follows -- the op's config, policy, comm_programs, precision and routing arguments,
whether a trace buffer is given, and the workspace (every growth of its buffers, which frees the buffers the plans
view, drops them: ``Workspace._grew``). A plan holds the validated shapes, the tile config, the grid, the task
tables (planning.cached_tables), the workspace buffers and views the launch uses and their descriptors, templates
of the caller tensors' descriptors, the kernel's argument list with every call-invariant argument bound
(``KernelLaunch``), its constexprs, and after its first launch the compiled kernel and its launcher (none where a
caller tensor would be ambiguous: two sharing an address, or one inside the workspace's buffers).

What a hit does (``Plan.call``): the key (a dict lookup; a miss, or an input that is not a tensor, takes the full
validation path, so a bad input raises the same one-line ValueError), ``before_launch`` (the mirror's flag word,
the capture flag), the new outputs, fresh descriptors of the caller's tensors (a template copy; the plan keeps no
caller tensor alive), the timeout in force, the launch, ``after_launch``.

The fast launch. After a plan's first normal launch (``kernel[grid](...)``, which binds and specialises every
argument on every call) it calls the compiled kernel's launcher directly -- a plan's arguments have one
specialisation by construction::

    compiled.run(grid_x, grid_y, grid_z, stream, compiled.function, compiled.packed_metadata,
                 launch_metadata, launch_enter_hook, launch_exit_hook, *every_argument_constexprs_included)

the call ``JITFunction.run`` ends with in Triton 3.6.0 and 3.9.0 (read from the wheels' sources: ``VERIFIED_TRITON``);
``DirectLaunch`` goes one step further, to Triton's C launcher (``DIRECT_TRITON``: 3.6). Safety: only for those
versions, never under TRITON_INTERPRET=1, never while a launch hook is set (``hooks_active``) or another device is
current (``UseNormalLaunch``). The first launch that could use it is a self-check (``KernelLaunch._self_check``):
a normal launch, its outputs copied and poisoned, the same arguments through the fast path, a synchronisation,
then the outputs compared bitwise and the error record, queue heads and counters checked clean (``clean_check``);
any mismatch or exception turns the fast path off for that plan with one warning (the call's outputs are the
normal launch's). No self-check for a traced call (a second launch would overwrite its trace buffer in part) or
inside a CUDA-graph capture. Every rank makes the self-check at the same call (the plans of all ranks are built by
the same sequence of calls), so the epochs stay in lockstep. A fast launch that raises later falls back to the
normal launch (the launcher parses its arguments before
it launches) and turns the fast path off. ``set_fast_launch(False)`` is the developer switch; ``plan_stats()``
counts builds, hits, misses and launches of each kind.

Why, and the parked alternatives: docs/design/core.md ("Launch plans and the fast launch"); host time per call:
docs/perf/<op>.md. Tests: tests/test_launch_plan.py (reuse, bitwise outputs, growth, bad inputs after a plan, the
self-check and its fallbacks, hooks, traced calls, DirectLaunch), the plan tests of test_quant / test_moe_forward.
"""
from __future__ import annotations

import warnings

import torch

from . import runtime
from .descriptors import DESCRIPTOR_TYPES, tma_descriptor
from .planning import interpreting

VERIFIED_TRITON = ("3.6", "3.9")  # major.minor whose CompiledKernel.run convention was read (docstring)
MAX_PLANS = 512  # per workspace; beyond it the plans start over (one-off shapes must not grow memory)

_STATE = {"fast": True}
STATS = dict(builds=0, hits=0, misses=0, fast_launches=0, normal_launches=0, self_checks=0, fast_disabled=0,
             direct_built=0)


class UseNormalLaunch(Exception):
    """Raised by a fast launcher for a call it cannot take (a launch hook is set, another device is current):
    the normal launch runs, the plan keeps its fast path."""


def set_fast_launch(enabled: bool) -> None:
    """Developer switch: use (True, the default) or bypass the plans' fast launch path."""
    _STATE["fast"] = bool(enabled)


def fast_launch_enabled() -> bool:
    return _STATE["fast"]


def triton_version() -> str:
    import triton
    return ".".join(triton.__version__.split(".")[:2])


def fast_launch_supported() -> bool:
    """Whether this Triton's launcher convention was verified (and the kernels run on a GPU)."""
    return not interpreting() and triton_version() in VERIFIED_TRITON


def plan_stats() -> dict:
    """Counters since the last ``reset_plan_stats()``, with the plan-cache hit rate."""
    s = dict(STATS)
    calls = s["hits"] + s["misses"]
    s["hit_rate"] = s["hits"] / calls if calls else 0.0
    return s


def reset_plan_stats() -> None:
    for k in STATS:
        STATS[k] = 0


class Unkeyable(Exception):
    """An input the plan key cannot describe (not a tensor): the op takes its full validation path."""


def input_key(x):
    """The properties of an input that every check and the kernel's specialisation depend on (an MX pair: both
    tensors'; None: None); ``Unkeyable`` for anything else."""
    if isinstance(x, torch.Tensor):
        return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() % 16 == 0)
    if isinstance(x, tuple) and len(x) == 2:  # an MXTensor (payload, scales); no generator: a hot path
        p, s = x
        return input_key(p), input_key(s)
    if x is None:
        return None
    raise Unkeyable


def find(op: str, group, tensors, others, device):
    """The three ops' plan lookup: (workspace, key, plan) of a call of ``op`` whose key is ``op``, the
    input_key of each of ``tensors`` (tensors, MX pairs or None) and the hashable ``others`` (config, policy,
    routing arguments...), on the workspace of ``group`` on ``device``; plan None on a miss. (None, None, None)
    when the call cannot key a plan (an input that is not a tensor, an unhashable config): the op then runs
    its full checks, which say what is wrong. (On the hot path: ``map``, no generator, no function-level import.)"""
    try:
        key = (op, *map(input_key, tensors), *others)
        hash(key)
    except (Unkeyable, TypeError):
        return None, None, None
    ws = runtime.get_workspace(group, device)
    return ws, key, (lookup(ws, key) if hasattr(ws, "_plans") else None)


def lookup(ws, key):
    """The plan of ``key`` in workspace ``ws``, or None (counted as a hit or a miss)."""
    plan = ws._plans.get(key)
    if plan is None:
        STATS["misses"] += 1
    else:
        STATS["hits"] += 1
    return plan


def store(ws, key, plan):
    if len(ws._plans) >= MAX_PLANS:
        ws._plans.clear()
    ws._plans[key] = plan
    STATS["builds"] += 1
    return plan


def descriptor_template(t, block_shape):
    """(class, fields) of the host TMA descriptor of ``t``'s layout (validated once, core/descriptors.py)."""
    d = tma_descriptor(t, block_shape)
    fields = dict(d.__dict__)
    fields["base"] = None
    return type(d), fields


def descriptor(tmpl, t):
    """A descriptor of ``t`` from a template: the cost of one object copy."""
    cls, fields = tmpl
    d = object.__new__(cls)
    d.__dict__.update(fields)
    d.base = t
    return d


def _same(t, s) -> bool:
    return t is s or (t.data_ptr() == s.data_ptr() and t.dtype == s.dtype and t.shape == s.shape
                      and t.stride() == s.stride())


def _overlaps(t, buffers) -> bool:
    lo, hi = t.data_ptr(), t.data_ptr() + max(1, t.numel()) * t.element_size()
    for b in buffers:
        if b is not None and lo < b.data_ptr() + b.numel() * b.element_size() and b.data_ptr() < hi:
            return True
    return False


class Plan:
    """One call signature's launch: ``launch`` (a KernelLaunch with the first call's arguments), ``slots``
    ((position, source name, descriptor template or None) of every argument that comes from the caller's
    tensors), the timeout's position, and whatever the op keeps (``info``)."""

    def __init__(self, kl, slots, info):
        self.launch = kl
        self.slots = slots
        self.timeout_slot = kl.slot("timeout_us", None)  # None: a kernel without bounded waits (W=1's GEMM)
        self.info = info

    def call(self, ws, sources: dict, outputs, traced: bool) -> None:
        """A hit's launch, the same for every op: the error check of the last call (``before_launch``), the
        launch with this call's tensors (``sources``) and ``outputs``, the error event. A traced call never
        self-checks (a second launch would overwrite its trace buffer in part)."""
        runtime.ensure_triton_allocator()
        ws.before_launch()
        self.launch.launch(self.args(sources, ws.timeout_ns()), outputs=outputs, clean=self.info["clean"],
                           self_check=not traced)
        ws.after_launch()

    def args(self, sources: dict, timeout_ns: int) -> list:
        """The runtime arguments of this call: the bound ones, the caller's tensors (and fresh descriptors of
        them) from ``sources``, the timeout."""
        args = list(self.launch.args)
        for i, name, tmpl in self.slots:
            t = sources[name]
            args[i] = t if tmpl is None else descriptor(tmpl, t)
        if self.timeout_slot is not None:
            args[self.timeout_slot] = max(1, timeout_ns // 1000)
        return args


def clean_check(ws):
    """The self-check's look at a workspace after its launches: None, or what is not clean."""
    def clean():
        if int(ws.errors[0]) != 0:
            return "the error record is set"
        if ws.heads is not None and bool(ws.heads.any()):
            return f"the queue heads are not zero: {ws.heads.tolist()}"
        if ws.counters is not None and bool(ws.counters.any()):
            return "the counters are not zero"
        return None
    return clean


def make_plan(kl, sources: dict, ws, info, views=()):
    """A Plan from the first call's arguments (``kl.args``) and the caller's tensors (``sources``: name ->
    tensor; None entries ignored): every argument that is one of them -- the tensor itself, a view of the same
    memory and layout, or a descriptor of it -- becomes a per-call slot. None (do not cache: launch normally)
    where that could be ambiguous: two sources share an address, or a source lies inside the workspace's
    buffers (a view the workspace returned, e.g. AllGather+GEMM's a_full, passed back in). ``views``: names of
    sources that are by construction views of another source (left out of the address check)."""
    desc_types = DESCRIPTOR_TYPES
    src = [(n, t) for n, t in sources.items() if t is not None]
    ptrs = [t.data_ptr() for n, t in src if n not in views]
    if len(set(ptrs)) != len(ptrs):
        return None
    owned = [ws.data, ws.signals, ws.counters, *ws._local.values()]
    if any(_overlaps(t, owned) for _, t in src):
        return None
    slots = []
    for i, v in enumerate(kl.args):
        base = v.base if isinstance(v, desc_types) else v
        if not isinstance(base, torch.Tensor):
            continue
        name = next((n for n, t in src if base is t), None) or next((n for n, t in src if _same(base, t)), None)
        if name is None:
            continue
        if isinstance(v, desc_types):  # Triton's host descriptor or Gluon's (gemm/w1_mx.py)
            fields = dict(v.__dict__)
            fields["base"] = None
            slots.append((i, name, (type(v), fields)))
        else:
            slots.append((i, name, None))
    plan = Plan(kl, slots, info)
    kl.varying = [i for i, _, _ in slots] + ([plan.timeout_slot] if plan.timeout_slot is not None else [])
    return plan


class KernelLaunch:
    """One kernel's launch with its call-invariant arguments bound: ``args`` (the runtime arguments in the
    kernel's order; ``slot(name)`` gives a per-call argument's position), ``kw`` (constexprs and options).
    ``grid``: an int or a tuple of up to 3 (quant.py's 2-D grid). ``device``: a CUDA device made current around
    a normal launch and its self-check (None: the current one)."""

    def __init__(self, kernel, grid, args, kw: dict, device=None):
        self.kernel = kernel
        self.grid = tuple(grid) if isinstance(grid, tuple) else (grid,)
        self.device = device  # a CUDA device made current around a normal launch (quant.py); None: the current one
        self.args = list(args)
        self.kw = dict(kw)
        self._index = {name: i for i, name in enumerate(kernel.arg_names[:len(self.args)])}
        self.state = "new"  # new -> verified (fast path on) | off (normal launches only)
        self.varying = None  # positions a plan changes per call (make_plan): enables DirectLaunch
        self.fast = None
        self.reason = None

    def slot(self, name: str, *default):
        """The position of runtime argument ``name``; ``default`` (if given) where the kernel has none."""
        return self._index.get(name, *default) if default else self._index[name]

    def launch(self, args, outputs=(), clean=None, self_check=True):
        """Launch with ``args`` (a full runtime argument list). ``outputs``: the tensors the launch writes that
        the self-check compares; ``clean()``: after a synchronisation, None or what is wrong with the error
        record / queue heads. ``self_check=False``: no self-check, so the plan keeps the normal launch -- the
        ops pass it for a traced call, whose trace buffer a second launch of the self-check would overwrite
        only in part. With ``self.device`` set, the normal launch and its self-check run with that device
        current."""
        if self.state == "verified" and _STATE["fast"]:
            try:
                self.fast(args)
                STATS["fast_launches"] += 1
                return
            except UseNormalLaunch:
                pass
            except Exception as e:  # noqa: BLE001 -- any failure: the normal launch, fast path off
                self._disable(f"the fast launch raised {type(e).__name__}: {e}")
        if self.device is None:
            self._normal(args, outputs, clean, self_check)
        else:  # the self-check inside too: the fast launcher is bound to the device current when it is made
            with torch.cuda.device(self.device):
                self._normal(args, outputs, clean, self_check)

    def _normal(self, args, outputs, clean, self_check) -> None:
        compiled = self.kernel[self.grid](*args, **self.kw)
        STATS["normal_launches"] += 1
        if (self.state == "new" and self_check and outputs and _STATE["fast"] and fast_launch_supported()
                and not _capturing() and not hooks_active()):
            self._self_check(compiled, args, outputs, clean)

    def _disable(self, why: str) -> None:
        self.state = "off"
        self.reason = why
        STATS["fast_disabled"] += 1
        warnings.warn(f"kosmos: fast launch of {self.kernel.__name__} turned off for this call signature: {why}",
                      RuntimeWarning, stacklevel=4)

    def _self_check(self, compiled, args, outputs, clean) -> None:
        STATS["self_checks"] += 1
        snap = [o.clone() for o in outputs]
        try:
            self.fast = make_fast_launcher(self.kernel, compiled, len(args), self.kw,
                                           self.grid[0] if len(self.grid) == 1 else self.grid,
                                           varying=self.varying)
            if self.fast is None:
                self.state = "off"
                self.reason = "the kernel's arguments do not fit the fast path"
                return
            for o in outputs:
                o.view(torch.uint8).fill_(0xFF)  # poison: a fast launch that wrote nothing cannot pass
            self.fast(args)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            bad = [i for i, (o, s) in enumerate(zip(outputs, snap))
                   if not torch.equal(o.view(torch.uint8), s.view(torch.uint8))]
            why = f"output(s) {bad} differ bitwise from the normal launch's" if bad else (clean() if clean else None)
        except UseNormalLaunch:
            why = None
            self.state = "new"  # decide on a later call
            for o, s in zip(outputs, snap):
                o.copy_(s)
            return
        except Exception as e:  # noqa: BLE001
            why = f"the self-check's fast launch raised {type(e).__name__}: {e}"
        if why:
            for o, s in zip(outputs, snap):  # the call's result is the normal launch's
                o.copy_(s)
            self._disable(why)
        else:
            self.state = "verified"


def hooks_active(runtime_knobs=None) -> bool:
    """Whether a Triton launch hook is set (a profiler's). Triton 3.6 and 3.9 keep them in ``knobs.runtime`` as
    HookChain objects that are never None -- empty means no hook -- so ``is not None`` is always true there.
    Anything without ``calls`` counts as set unless it is None."""
    if runtime_knobs is None:
        from triton import knobs
        runtime_knobs = knobs.runtime
    for hook in (runtime_knobs.launch_enter_hook, runtime_knobs.launch_exit_hook):
        if hook is None:
            continue
        calls = getattr(hook, "calls", None)
        if calls is None or len(calls) > 0:
            return True
    return False


def _capturing() -> bool:
    return runtime.capturing()


def _grid3(grid) -> tuple:
    """(x, y, z) of an int or tuple grid."""
    return (*grid, 1, 1)[:3] if isinstance(grid, tuple) else (grid, 1, 1)


def make_fast_launcher(kernel, compiled, n_args: int, kw: dict, grid, varying=None):
    """A callable ``fast(args)`` launching ``compiled`` (what ``kernel[grid](*args, **kw)`` returned) with the
    runtime arguments ``args``, as JITFunction.run's last line does (module docstring); None where the kernel's
    parameters do not have every constexpr after the runtime arguments. ``varying``: the positions of the
    arguments that may change between calls (a plan's caller slots and the timeout); given, the launch goes
    straight to Triton's C launcher where this Triton's convention was read (``DirectLaunch``). ``grid``: an int
    or a tuple of up to 3.

    The convention, read from the wheels' sources: in Triton 3.6.0 ``JITFunction.run`` (python/triton/runtime/
    jit.py, the ``if not warmup:`` block) ends with this call, and ``CudaLauncher.__call__(gridX, gridY, gridZ,
    stream, function, *args)``'s generated C launcher parses constexpr arguments as objects and skips them; 3.9.0
    has the same block, with the explicit metadata / hook parameters, and its arg annotations skip the
    constexprs. ``launch_metadata`` is None when no enter hook is set (the fast path never runs with one)."""
    if not fast_launch_supported() or compiled is None:
        return None
    if hasattr(compiled, "result"):  # a future (Triton's asynchronous compile mode)
        compiled = compiled.result()
    params = kernel.params
    if any(p.is_constexpr for p in params[:n_args]) or not all(p.is_constexpr for p in params[n_args:]):
        return None
    tail_names = [p.name for p in params[n_args:]]
    if any(n not in kw for n in tail_names):
        return None
    tail = tuple(kw[n] for n in tail_names)
    from triton import knobs
    from triton.runtime.driver import driver
    run = compiled.run  # the driver's launcher (initialises the module handles on first use)
    function, meta = compiled.function, compiled.packed_metadata
    get_device, get_stream = driver.active.get_current_device, driver.active.get_current_stream
    device0 = get_device()
    hooks = knobs.runtime
    gx, gy, gz = _grid3(grid)
    direct = [None, varying is not None]  # the DirectLaunch, built from the first call's arguments; still to try

    def fast(args):
        enter, leave = hooks.launch_enter_hook, hooks.launch_exit_hook  # hooks_active, inlined (hot path)
        if (enter is not None and getattr(enter, "calls", True)) or (leave is not None and getattr(leave, "calls", True)):
            raise UseNormalLaunch  # the normal launch passes the hooks (and their metadata) to the launcher
        device = get_device()
        if device != device0:
            raise UseNormalLaunch
        if direct[1]:
            direct[0], direct[1] = DirectLaunch.build(compiled, args, tail, varying, grid), False
        if direct[0] is not None:
            direct[0](args, get_stream(device))
        else:
            run(gx, gy, gz, get_stream(device), function, meta, None, None, None, *args, *tail)

    fast.direct = direct
    return fast


DIRECT_TRITON = ("3.6",)  # whose launcher internals DirectLaunch replicates (read from the 3.6.0 wheel)
DIRECT_REFUSED: list = []  # (kernel, why) of every DirectLaunch.build that fell back to compiled.run


class DirectLaunch:
    """A plan's launch straight through Triton's C launcher, its argument list expanded once.

    ``compiled.run`` spends most of its time before the C launcher: asking for scratch buffers and, in its
    descriptor wrapper, looking at every argument and encoding each host TensorDescriptor into a CUtensorMap. What
    this replicates (triton/backends/nvidia/driver.py, 3.6.0): ``CudaLauncher.__call__(gridX, gridY, gridZ, stream,
    function, *rest)`` calls ``self.launch(gridX, gridY, gridZ, stream, function, launch_cooperative_grid,
    launch_pdl, global_scratch, profile_scratch, *rest)``, the scratch buffers None when their sizes are 0;
    ``self.launch`` is the C ``launch`` or, with descriptor arguments, ``inner``, which keeps the first
    ``_BASE_ARGS_FORMAT_LEN`` (13: the nine above and the packed metadata, launch metadata and two hooks) and
    replaces kernel argument i (constexprs counted) by ``make_tensordesc_arg(arg, tensordesc_meta[j])`` --
    [CUtensorMap, *shape, *strides] -- for i in ``tensordesc_indices``; a kernel with global scratch (device-built
    descriptors) gets ``_allocation._allocator.get()(grid * num_ctas * global_scratch_size, global_scratch_align,
    stream)`` per call, as __call__ allocates it. Here that expansion is made once from the first call's arguments;
    per call only the ``varying`` positions are replaced, a descriptor's expansion cached by its tensor's address (a
    plan fixes shape, strides, dtype and block: the address is all that can change; at most 16 per slot). ``grid``:
    an int or a tuple of up to 3 (scratch sized for their product, as __call__ does). The global scratch is kept per
    (allocator, stream) -- a launch on a stream starts after the previous one there ended, so they cannot overlap --
    except under PDL or a CUDA-graph capture (then one per call). Taken only for the Triton versions in
    ``DIRECT_TRITON``, with no profile scratch and the wrapper's closure exactly as read (its free variables
    ``launcher``, ``tensordesc_indices``, ``tensordesc_meta``); else None (``compiled.run``). The plan's self-check
    runs it against the normal launch (bitwise outputs) before any call relies on it."""

    def __init__(self, raw, indices, metas, expand, head, args, tail, varying, grid, scratch=None):
        self.raw, self.expand, self.grid = raw, expand, _grid3(grid)
        self.function, self.coop, self.pdl, self.packed = head
        self.scratch = scratch  # None, or (allocator context variable, bytes, alignment): global scratch per call
        self._scratch = {}  # (allocator, stream) -> the global scratch reused by launches on that stream
        self.flat, where, j = [], [], 0
        for i, a in enumerate([*args, *tail]):
            if i in indices:
                piece = list(expand(a, metas[j]))
                where.append((len(self.flat), len(piece), metas[j]))
                j += 1
                self.flat.extend(piece)
            else:
                where.append((len(self.flat), 1, None))
                self.flat.append(a)
        varying = sorted(set(varying))
        self.plain = [(i, where[i][0]) for i in varying if where[i][2] is None]
        self.descs = [(i, where[i][0], where[i][1], where[i][2], {}) for i in varying if where[i][2] is not None]
        for i, off in self.plain:
            self.flat[off] = None  # the template keeps no caller tensor alive

    @classmethod
    def build(cls, compiled, args, tail, varying, grid):
        """The DirectLaunch of ``compiled`` for these arguments, or None (why: ``DIRECT_REFUSED``) where this
        Triton's launcher is not the one read."""
        from triton.backends.nvidia import driver as nvd
        from triton.runtime import _allocation
        run = compiled.run
        why = None
        if triton_version() not in DIRECT_TRITON:
            why = f"Triton {triton_version()}"
        elif getattr(nvd, "_BASE_ARGS_FORMAT_LEN", None) != 13:
            why = "the launcher's base arguments are not the 13 read"
        elif getattr(run, "profile_scratch_size", 1) != 0:
            why = "the kernel asks for profile scratch"
        launch = getattr(run, "launch", None)
        code = getattr(launch, "__code__", None)
        if why is None and code is None:  # the C launcher itself: the kernel has no descriptor arguments
            raw, indices, metas = launch, frozenset(), []
        elif why is None:
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in (launch.__closure__ or ()))))
            if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
                why = f"the descriptor wrapper's closure is {sorted(cells)}"
            else:
                raw, indices, metas = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
        if why is not None:
            DIRECT_REFUSED.append((getattr(getattr(compiled, "src", None), "name", "?"), why))
            return None
        size = getattr(run, "global_scratch_size", 0)
        gx, gy, gz = _grid3(grid)
        scratch = (_allocation._allocator, gx * gy * gz * getattr(run, "num_ctas", 1) * size,
                   run.global_scratch_align) if size else None
        head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, compiled.packed_metadata)
        STATS["direct_built"] += 1
        return cls(raw, indices, metas, nvd.make_tensordesc_arg, head, args, tail, varying, grid, scratch)

    def __call__(self, args, stream) -> None:
        flat = self.flat.copy()
        for i, off in self.plain:
            flat[off] = args[i]
        for i, off, n, meta, cache in self.descs:
            d = args[i]
            ptr = d.base.data_ptr()
            piece = cache.get(ptr)
            if piece is None:
                if len(cache) >= 16:
                    cache.clear()
                piece = cache[ptr] = list(self.expand(d, meta))
            flat[off:off + n] = piece
        scratch = None
        if self.scratch is not None:  # as CudaLauncher.__call__'s allocate_scratch: the allocator set for this call
            var, size, align = self.scratch
            alloc = var.get()
            if self.pdl or runtime.capturing():  # launches may overlap / a graph keeps its own: one per call
                scratch = alloc(size, align, stream)
            else:  # reused: a launch on this stream starts after the last one on it has ended
                key = (alloc, stream)
                scratch = self._scratch.get(key)
                if scratch is None:
                    if len(self._scratch) >= 8:
                        self._scratch.clear()
                    scratch = self._scratch[key] = alloc(size, align, stream)
        self.raw(*self.grid, stream, self.function, self.coop, self.pdl, scratch, None, self.packed, None, None,
                 None, *flat)
