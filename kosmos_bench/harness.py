"""The bench framework every bench shares: check -> agree across ranks -> time -> row.

For one case (a TP GEMM, a MoE point) a ``Runner`` takes each implementation named in the settings (from the
registry) in turn, on every rank in step:

  1. availability: the registry's predicate, agreed across ranks; no -> an "unavailable" row with the reason.
  2. check: make the callable, run it once, compare with the fp32 reference (relative Frobenius error, max over
     ranks; above ``TOLERANCE`` or NaN fails). A ``Reference`` carries its own tolerance and further references
     whose errors are only recorded (the TP bench's mxfp8 rows: ``rel_err_bf16``); the reference may differ per
     implementation (``Runner.run`` takes a callable impl -> reference). An exception on any rank fails it on every rank (``agree``: no
     rank is left waiting in a collective) and ``recover`` realigns them; the sweep goes on.
  3. time: ``timing.time_op`` (collective-safe, max over ranks); a ``timing.Split`` callable (the MoE backward)
     has its setup (the forward) run untimed before each timed call. With ``Settings.cuda_graph`` (``--cuda-graph``)
     one call is first captured into a CUDA graph (``timing.capture_graph``) and its replay is timed; a capture
     that fails on any rank gives a "failed" row whose reason starts "CUDA graph capture:" (a split call:
     "unavailable"), and the sweep goes on. Such rows carry ``cuda_graph: true``.
  4. the row (``result_row``; keys in SCHEMA.md): a KOSMOS kernel runs with the op's config and records it.

``Runner.host`` does 1-2 and then, instead of 3, measures the host enqueue time of an eager call
(``timing.host_enqueue_us``: back-to-back calls after a warm-up, no barrier among them; max over ranks of each
rank's median), a "host" row each (``host_row``): issue 13's bar on the host time per call.

``fixed="best"`` implementations (fixed-role-best) do 2-3 at every S of ``fixed_sweep`` and keep the fastest S
that passes (``best_fixed_split``); ``fixed="default"`` (fixed-role) runs at S = ``fixed_default``.
"""
from __future__ import annotations

import math
import re
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
import torch.distributed as dist

import kosmos
from kosmos.core import runtime
from kosmos.config import config_dict

from . import registry, timing
from .registry import Unavailable

FIXED_SWEEP = (8, 16, 24, 32, 48, 64)
DEFAULT_FIXED_PROGRAMS = 16
# mxfp8: against the fp32 product of the MX values themselves (the reference holds the MX rounding), so as tight as
# bf16; an implementation with another rounding (the TP bench's fp8-rowwise) brings its own Reference
TOLERANCE = {"bf16": 1e-2, "mxfp8": 1e-2, "fp8-block": 1e-2}  # against the reference of what each dtype multiplies


@dataclass
class Reference:
    """What one implementation's output is checked against: ``ref`` within ``tol``; ``also`` {row key: tensor}:
    references whose errors are only recorded (max over ranks), in the row under that key.

    ``parts`` (names): the output is a tuple whose first len(parts) items are checked each against the same item
    of ``ref`` (a tuple); rel_err is the largest of their errors (NaN if any is NaN) and every part's error is
    recorded in the row under ``parts_key`` ({name: error}; the MoE backward's gradients). ``ref`` may be a
    callable of the output (what it depends on, e.g. the implementation's own routing decision, travels in it);
    with ``parts`` it may return the parts' errors themselves ({name: rel_err}) instead of their references: a
    reference too large to hold whole, compared piece by piece as it is computed (kosmos.reference.FrobeniusError;
    the MoE backward's weight gradients at deepseek-v3, kosmos_bench.moe.grad_reference)."""
    ref: object
    tol: float
    also: dict = field(default_factory=dict)
    parts: tuple = ()
    parts_key: str = "rel_err_parts"

    def errors(self, out) -> tuple[float, dict]:
        """(rel_err, {part: rel_err}) of ``out``; the dict is empty without ``parts``."""
        ref = self.ref(out) if callable(self.ref) else self.ref
        if not self.parts:
            return rel_err(out, ref), {}
        if not isinstance(out, (tuple, list)) or len(out) < len(self.parts):
            raise TypeError(f"output is a {type(out).__name__}, expected a tuple of {', '.join(self.parts)}")
        errs = ref if isinstance(ref, dict) else {name: rel_err(o, r) for name, o, r in zip(self.parts, out, ref)}
        errs = {name: errs[name] for name in self.parts}
        worst = math.nan if any(math.isnan(e) for e in errs.values()) else max(errs.values())
        return worst, errs


@dataclass
class Settings:
    """What every bench's run takes (TPSettings and MoESettings add their own)."""
    impls: tuple = ()
    iters: int = 20
    warmup: int = 5
    fixed_sweep: tuple = FIXED_SWEEP
    fixed_default: int = DEFAULT_FIXED_PROGRAMS
    dtype: str = "bf16"
    direction: str = "fwd"  # the MoE bench's --direction: fwd, bwd or fwd+bwd (the TP bench: fwd)
    cuda_graph: bool = False  # --cuda-graph: time the replay of one captured call (timing.capture_graph)
    seed: int = 0
    configs: dict = field(default_factory=dict)  # {op: config} (registry.parse_config); missing op: defaults
    extra: dict = field(default_factory=dict)

    def config(self, op: str):
        """The config the KOSMOS kernels of ``op`` run with."""
        if op in self.configs:
            return self.configs[op]
        return next(types[op] for types in registry.CONFIG_TYPES.values() if op in types)()


# --------------------------------------------------------------------------- ranks


def world_info() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    got = [None] * dist.get_world_size()
    dist.all_gather_object(got, obj)
    return got


def error_reason(e: BaseException) -> str:
    """One line of at most 300 characters saying what went wrong (a row's ``reason``); running out of GPU memory
    reads "out of memory: needs X GiB more with Y GiB in use of Z GiB" (torch's message names the allocation
    that failed, and what the device holds, over several sentences)."""
    if isinstance(e, torch.cuda.OutOfMemoryError):
        want = re.search(r"Tried to allocate ([\d.]+ \w+)", str(e))
        what = f"needs {want.group(1)} more" if want else "an allocation failed"
        if torch.cuda.is_available():
            device = torch.cuda.current_device()
            used = torch.cuda.memory_allocated(device) / 2**30
            total = torch.cuda.get_device_properties(device).total_memory / 2**30
            what += f" with {used:.1f} GiB in use of {total:.1f} GiB"
        return f"out of memory: {what}"
    return f"{type(e).__name__}: {e}".splitlines()[0][:300]


def agree(ok: bool, reason: str | None) -> tuple[bool, str | None]:
    """All ranks learn whether every rank succeeded, and the first failing rank's reason."""
    if not dist.is_initialized():
        return ok, reason
    for r, (o, why) in enumerate(_gather((ok, reason))):
        if not o:
            return False, f"rank {r}: {why}"
    return True, None


def agree_available(ok: bool, reason: str | None) -> tuple[bool, str | None]:
    """Like ``agree``, for an availability verdict: a reason every rank gives is kept as it is."""
    got = _gather((ok, reason))
    bad = [(r, why) for r, (o, why) in enumerate(got) if not o]
    if not bad:
        return True, None
    if len(bad) == len(got) and len({why for _, why in bad}) == 1:
        return False, bad[0][1]
    return False, f"rank {bad[0][0]}: {bad[0][1]}"


def max_over_ranks(x: float, device="cuda") -> float:
    if not dist.is_initialized():
        return x
    t = torch.tensor([x], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def write_trace(buf: torch.Tensor, path: str, fields: dict) -> None:
    """The per-program task events of a traced kosmos call (``buf`` int64 [programs, events, 4]: kind, task,
    start ns, end ns; zero end = unused) gathered from every rank; rank 0 writes the trace JSON (SCHEMA.md,
    "Trace files") with ``fields`` (op, model, shape, world, config, ...) to ``path``. Collective."""
    import json
    import os
    host = buf.cpu()
    events = [[p, int(e[0]), int(e[1]), int(e[2]), int(e[3])]
              for p in range(host.shape[0]) for e in host[p] if int(e[3]) > 0]
    rank, world = world_info()
    gathered = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, events)
    else:
        gathered = [events]
    if rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        doc = {"type": "trace", **fields, "impl": "kosmos",
               "kinds": {str(k): v for k, v in runtime.TRACE_KINDS.items()},
               "ranks": [{"rank": r, "events": ev} for r, ev in enumerate(gathered)]}
        with open(path, "w") as f:
            json.dump(doc, f)


def recover(device="cuda", cleanup=()) -> None:
    """After a failure: drop KOSMOS's (possibly poisoned) workspace and whatever ``cleanup`` callables hold (e.g.
    DeepEP's buffer) on every rank, and realign the ranks."""
    sync(device)
    kosmos.reset_workspaces()
    for fn in cleanup:
        fn()
    if torch.device(device).type == "cuda":  # what a failed call (out of memory, say) left cached goes back
        torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.barrier()


def needs_peers(world: int) -> tuple[bool, str | None]:
    """Availability of the fixed-role policies: they dedicate programs to communication, so need a peer."""
    return world > 1, "no communication at world size 1"


def policy_kwargs(params: dict) -> dict:
    """The KOSMOS ops' policy arguments for ``params`` ({"comm_programs": S}: fixed-role at S; {}: self)."""
    s = params.get("comm_programs")
    return {"policy": "self", "comm_programs": None} if s is None else {"policy": "fixed", "comm_programs": s}


def register_fixed(family: str, make, directions: dict | None = None, dtypes: dict | None = None) -> None:
    """Register ``make`` (a KOSMOS maker honouring ``policy_kwargs``) as fixed-role and fixed-role-best
    (``directions``, ``dtypes``: registry.register's)."""
    registry.register(family, "fixed-role", kosmos=True, fixed="default", available=needs_peers,
                      directions=directions, dtypes=dtypes)(make)
    registry.register(family, "fixed-role-best", kosmos=True, fixed="best", available=needs_peers,
                      directions=directions, dtypes=dtypes)(make)


def kosmos_workspace_bytes(device):
    """KOSMOS's symmetric workspace per rank (torch symmetric memory: not in the caching allocator's peak).
    Grow-only, so this is the most any KOSMOS call of this process has needed so far."""
    return runtime.workspace_bytes() if torch.device(device).type == "cuda" else None


# --------------------------------------------------------------------------- check and time


@dataclass
class Result:
    """One implementation's outcome on one case."""
    status: str                       # "ok" | "failed" | "unavailable"
    reason: str | None = None
    rel_err: float | None = None
    timing: dict | None = None        # timing.time_op's dict (Runner.host: timing.host_enqueue_us's)
    workspace: int | None = None
    params: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)  # Reference.also's errors: {row key: rel_err or None}

    @property
    def time_ms(self):
        return self.timing.get("time_ms") if self.timing else None


def check_output(out, shape) -> None:
    """TypeError unless ``out`` is a tensor, ValueError unless of ``shape`` (an output checked piece by piece is
    checked whole first)."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"output is a {type(out).__name__}, expected a tensor")
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"output shape {tuple(out.shape)}, expected {tuple(shape)}")


def rel_err(out, ref) -> float:
    from kosmos.reference import rel_err as _rel_err
    check_output(out, ref.shape)
    return _rel_err(out, ref)


def agreed_call(fn):
    """``fn()`` on every rank in step -> (ok, reason, value): ok only if it returned on every rank (``agree``;
    the reason is the first failing rank's). A failure is printed with its traceback, except a
    ``registry.Unavailable``, whose reason starts "unavailable: "."""
    try:
        value, ok, why = fn(), True, None
    except Unavailable as e:
        value, ok, why = None, False, "unavailable: " + str(e)
    except Exception as e:  # recorded, the sweep goes on
        value, ok, why = None, False, error_reason(e)
        traceback.print_exc()
    ok, why = agree(ok, why)
    return ok, why, value


def check_and_time(make, ref, st: Settings, device, recover: Callable, measure: Callable | None = None) -> Result:
    """Steps 2-3 of one implementation: ``make()`` -> (callable, workspace bytes or None). Every rank calls this
    in step. A ``registry.Unavailable`` raised on the way makes the result "unavailable". ``ref``: a tensor
    (tolerance ``TOLERANCE[st.dtype]``) or a ``Reference``. ``measure(fn)`` -> the result's ``timing`` dict, run
    once the check passed (default: ``timing.time_op`` at ``st.iters`` / ``st.warmup``)."""
    if not isinstance(ref, Reference):
        ref = Reference(ref, TOLERANCE[st.dtype])
    made, also, parts = [], {}, {}

    def check():
        fn, ws = make()
        made[:] = [fn, ws]
        out = fn()
        runtime.check_errors()
        sync(device)
        also.update({key: rel_err(out, other) for key, other in ref.also.items()})
        err, errs = ref.errors(out)
        parts.update(errs)
        return err

    ok, why, err = agreed_call(check)
    ws = made[1] if made else None
    errors = {key: None for key in ref.also}
    if ref.parts:
        errors[ref.parts_key] = None
    if not ok:
        recover()
        status = "unavailable" if "unavailable: " in why else "failed"
        return Result(status, why.replace("unavailable: ", ""), workspace=ws, errors=errors)
    err = max_over_ranks(err, device)
    errors = {key: max_over_ranks(also[key], device) for key in ref.also}
    if ref.parts:
        errors[ref.parts_key] = {name: max_over_ranks(parts[name], device) for name in ref.parts}
    tol = ref.tol
    if not err <= tol:  # NaN fails too
        return Result("failed", f"rel_err {err:.2e} > {tol:.0e}", err, workspace=ws, errors=errors)

    fn = made[0]
    if st.cuda_graph:
        if isinstance(fn, timing.Split):
            return Result("unavailable", "a split call (untimed setup, timed run) is not captured in a CUDA graph",
                          err, workspace=ws, errors=errors)

        def capture():
            replay = timing.capture_graph(fn, warmup=st.warmup)
            runtime.check_errors()
            return replay
        ok, why, fn = agreed_call(capture)
        if not ok:
            recover()
            return Result("failed", f"CUDA graph capture: {why}", err, workspace=ws, errors=errors)

    def time_it():
        t = measure(fn) if measure is not None else timing.time_op(fn, iters=st.iters, warmup=st.warmup)
        runtime.check_errors()
        return t

    ok, why, t = agreed_call(time_it)
    if st.cuda_graph:  # the graph holds KOSMOS's workspace buffers, which may then no longer grow: drop both
        # (every rank in step), so that the next implementation or a larger case starts afresh
        if ws is None and ok:
            ws = kosmos_workspace_bytes(device)
        fn = None
        made.clear()
        recover()
    if not ok:
        if not st.cuda_graph:
            recover()
        return Result("failed", why, err, workspace=ws, errors=errors)
    return Result("ok", None, err, t, ws, errors=errors)


def best_fixed_split(measure: Callable, sweep, grid: int | None = None) -> Result:
    """fixed-role-best: ``measure({"comm_programs": S})`` -> Result at every S of ``sweep`` with 1 <= S < grid;
    the fastest "ok" one, its params recording the sweep. None passes: "failed", the reason naming the first
    failure; a split "unavailable": that result (no other split can run either)."""
    best, first_failure = None, None
    for s in sweep:
        if grid is not None and not 1 <= s < grid:
            continue
        res = measure({"comm_programs": s})
        if res.status == "unavailable":
            return Result("unavailable", res.reason, params={"sweep": list(sweep)})
        if res.status == "ok" and (best is None or res.time_ms < best.time_ms):
            best = res
        elif res.status != "ok" and first_failure is None:
            first_failure = f"S={s}: {res.reason}"
    if best is None:
        return Result("failed", f"no fixed split passed ({first_failure or 'empty sweep'})",
                      params={"sweep": list(sweep)})
    best.params = {**best.params, "sweep": list(sweep)}
    return best


def run_impl(impl: registry.Impl, inputs, ref, st: Settings, device, recover: Callable, config=None,
             grid: int | None = None, measure: Callable | None = None) -> Result:
    """Steps 1-3 of one implementation (every rank in step); ``config``: the op's, for KOSMOS kernels;
    ``measure``: check_and_time's. With a ``measure`` of its own, fixed-role-best runs at ``st.fixed_default``
    alone, as fixed-role: its sweep picks the split by device time, which such a measure does not give."""
    sweep = impl.fixed == "best" and measure is None
    params = {"comm_programs": st.fixed_default} if impl.fixed and not sweep else {}
    ok, why = agree_available(*impl.availability(world_info()[1], st.dtype, st.direction))
    if not ok:
        return Result("unavailable", why, params=params)
    cfg = config if impl.kosmos else None

    def one(p):
        res = check_and_time(lambda: impl.make(inputs, p, cfg), ref, st, device, recover, measure)
        res.params = p
        return res

    res = best_fixed_split(one, st.fixed_sweep, grid) if sweep else one(params)
    if impl.kosmos and res.status == "ok" and not st.cuda_graph:  # (with graphs: measured before the release)
        res.workspace = kosmos_workspace_bytes(device)
    return res


# --------------------------------------------------------------------------- rows


class Memory:
    """Peak GPU memory (caching allocator) of one implementation: absolute and above what was resident, max over
    ranks (None on the CPU)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.base = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)

    def peak(self) -> tuple:
        if self.base is None:
            return None, None
        p = torch.cuda.max_memory_allocated(self.device)
        return int(max_over_ranks(p, self.device)), int(max_over_ranks(p - self.base, self.device))


def _config_field(impl: registry.Impl, config) -> dict:
    return {"config": config_dict(config) if impl.kosmos and config is not None else None}


def result_row(identity: dict, impl: registry.Impl, res: Result, *, flops: float, config=None,
               peak=(None, None), mem_delta: bool = False, extra=None, **fields) -> dict:
    """A result row: the case's ``identity`` keys, then the outcome; ``fields`` (t_gemm_ms, t_comm_ms) go
    between rel_err and host_ms, after the result's recorded errors (``Result.errors``, e.g. rel_err_bf16).
    ``mem_delta``: also peak_mem_delta_bytes."""
    t, tm = res.timing or {}, res.time_ms
    row = dict(identity)
    row.update({
        "impl": impl.name, "status": res.status, "reason": res.reason, "time_ms": tm, "p20_ms": t.get("p20_ms"),
        "p80_ms": t.get("p80_ms"), "tflops": flops / (tm * 1e-3) / 1e12 if tm else None, "rel_err": res.rel_err,
        **res.errors, **fields, "host_ms": t.get("host_ms"), "workspace_bytes": res.workspace, "peak_mem_bytes": peak[0],
    })
    if mem_delta:
        row["peak_mem_delta_bytes"] = peak[1]
    row.update(params=res.params, **_config_field(impl, config), extra=dict(extra or {}))
    return row


HOST_STATS = ("host_us", "p20_us", "p80_us")  # timing.host_enqueue_us's figures a host row carries


def host_row(identity: dict, impl: registry.Impl, res: Result, *, calls: int, warm_s: float, config=None) -> dict:
    """A host row (``"type": "host"``): the case's ``identity`` keys, the outcome of the check, and the host
    enqueue time per eager call of ``calls`` back-to-back calls after ``warm_s`` s of warm-up (``res.timing``:
    timing.host_enqueue_us's, each figure the max over ranks; None when not measured)."""
    t = res.timing or {}
    row = {**identity, "type": "host", "impl": impl.name, "status": res.status, "reason": res.reason,
           "calls": calls, "warm_s": warm_s, **{key: t.get(key) for key in HOST_STATS},
           "warmup_calls": t.get("warmup_calls"), "rel_err": res.rel_err, "params": res.params}
    row.update(_config_field(impl, config))
    return row


def failed_row(identity: dict, family: str, name: str, reason: str, config=None) -> dict:
    """The row of implementation ``name`` of ``family`` in a case that failed as a whole (sweep.run_sweep)."""
    return {**identity, "impl": name, "status": "failed", "reason": reason, "time_ms": None, "tflops": None,
            **_config_field(registry.get(family, name), config)}


@dataclass
class Runner:
    """What the implementations of one case share: the settings, the device, ``recover``, the rows (passed to
    ``on_row`` as each is ready) and the case's ``extra``."""
    st: Settings
    device: torch.device
    recover: Callable
    on_row: Callable | None = None
    extra: dict = field(default_factory=dict)
    mem_delta: bool = False
    rows: list = field(default_factory=list)

    def run(self, family: str, names, *, inputs, ref, identity: dict, flops: float, config=None,
            impl_fields: Callable | None = None, **fields) -> dict:
        """Check, time and write a row for each implementation ``names`` of ``family`` on ``inputs``;
        {name: Result}. ``ref``: a tensor or ``Reference``, or a callable impl name -> one of those;
        ``impl_fields(name)``: row fields of that implementation alone (after ``fields``)."""
        grid = runtime.num_sms(self.device) if self.device.type == "cuda" else None
        results = {}
        for name in names:
            impl = registry.get(family, name)
            mem = Memory(self.device)
            impl_ref = ref(name) if callable(ref) else ref
            res = results[name] = run_impl(impl, inputs, impl_ref, self.st, self.device, self.recover, config, grid)
            row = result_row(identity, impl, res, flops=flops, config=config, peak=mem.peak(),
                             mem_delta=self.mem_delta, extra=self.extra,
                             **fields, **(impl_fields(name) if impl_fields else {}),
                             **({"cuda_graph": True} if self.st.cuda_graph else {}))
            self.rows.append(row)
            if self.on_row:
                self.on_row(row)
        return results

    def host(self, family: str, names, *, inputs, ref, identity: dict, calls: int, warm_s: float,
             config=None) -> dict:
        """The host enqueue time per eager call (timing.host_enqueue_us) of each implementation ``names`` of
        ``family`` on ``inputs``, after its availability and check (steps 1-2, as ``run``; eager even under
        ``--cuda-graph``: the bar is per eager call), and a host row each (``host_row``); {name: Result}. Every
        rank makes the same number of calls (``even_out``: a call may hold a collective); each figure of the row
        is the max over ranks of the rank's own."""
        st = replace(self.st, cuda_graph=False)
        device = self.device

        def measure(fn):
            return timing.host_enqueue_us(fn, calls, warm_s, sync=lambda: sync(device),
                                          even_out=lambda n: max_over_ranks(n, device))
        grid = runtime.num_sms(device) if device.type == "cuda" else None
        results = {}
        for name in names:
            impl = registry.get(family, name)
            res = results[name] = run_impl(impl, inputs, ref(name) if callable(ref) else ref, st, device,
                                           self.recover, config, grid, measure=measure)
            if res.status == "ok":  # agreed on every rank, so every rank reduces
                res.timing = {**res.timing, **{key: max_over_ranks(res.timing[key], device) for key in HOST_STATS}}
            row = host_row(identity, impl, res, calls=calls, warm_s=warm_s, config=config)
            self.rows.append(row)
            if self.on_row:
                self.on_row(row)
        return results
