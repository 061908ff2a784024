"""What each bench can run: its implementations, registered once, and the op configs ``--config`` sets.

An implementation belongs to a family -- the op family it computes: "tp" (AllGather+GEMM and GEMM+ReduceScatter,
``kosmos bench tp``), "moe_fwd" (the MoE layer) and "moe_experts" (the expert GEMMs alone, both ``kosmos bench
moe``) -- and registers its maker once, in the bench module that builds its inputs::

    @register("tp", "nccl+cublas", baseline=True)
    def _nccl_cublas(inp, params, config): ...          # -> (zero-argument callable, workspace bytes or None)

    @register("moe_fwd", "deepep", available=_deepep_available)   # (world) -> (ok, reason)
    def _deepep(inp, params, config): ...

``available`` says up front whether the implementation can run here (a package, a world size); when it says no
the row is "unavailable" with its reason, nothing is called. A maker may still raise ``Unavailable`` for what
only shows when it runs. ``kosmos=True`` marks a KOSMOS kernel: it runs with the op's config (``--config``),
and its row records that config and KOSMOS's symmetric workspace. ``fixed="default"`` / ``fixed="best"``: the
fixed-role policy at S = the settings' ``fixed_default``, or at the fastest passing S of ``fixed_sweep``
(harness.best_fixed_split); the maker gets S as ``params["comm_programs"]``. ``names(family)`` lists a family in
registration order (TP_IMPLS, MOE_IMPLS and EXPERT_IMPLS are these views); ``get`` fails with one line naming
the known ones.

``dtypes`` ({dtype: None or reason}; None: every dtype) says at which precisions a bench runs the implementation:
a dtype mapped to None runs, one mapped to a reason gives an "unavailable" row with that reason (torch-async-tp at
mxfp8), and a dtype not in the mapping is skipped -- no row (the MXFP8-only baselines at bf16); ``runs_at``.
``directions`` the same for the MoE bench's ``--direction`` (fwd, bwd, fwd+bwd): {direction: None (runs), a reason
(unavailable) or a predicate (world, dtype) -> (ok, reason)}; a direction not in it is skipped; None: every
direction.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable

from kosmos.config import (AllGatherMatmulConfig, MatmulReduceScatterConfig, MoEBackwardConfig, MoEForwardConfig,
                           config_from_strings)


class Unavailable(Exception):
    """Raised by a maker when its implementation cannot run here: recorded "unavailable" with the message."""


class UnknownImpl(ValueError):
    pass


@dataclass(frozen=True)
class Impl:
    family: str
    name: str
    make: Callable                # (inputs, params, config or None) -> (callable, workspace bytes or None)
    baseline: bool = False        # what the report's speedups are relative to
    available: Callable[[int], tuple] | None = None  # (world size) -> (ok, reason)
    kosmos: bool = False          # a KOSMOS kernel: takes the op's config, records it and the workspace
    fixed: str | None = None      # None, "default" (S = fixed_default) or "best" (best S of fixed_sweep)
    dtypes: dict | None = None    # {dtype: None (runs) or reason (unavailable)}; absent dtypes skipped; None: all
    directions: dict | None = None  # {direction: None, reason or (world, dtype) -> (ok, reason)}; None: all

    def runs_at(self, dtype: str, direction: str | None = None) -> bool:
        """Whether a bench at ``dtype`` (and ``direction``, None: not asked) has a row of this implementation (ok,
        failed or unavailable)."""
        return (self.dtypes is None or dtype in self.dtypes) and \
            (direction is None or self.directions is None or direction in self.directions)

    def availability(self, world: int, dtype: str | None = None,
                     direction: str | None = None) -> tuple[bool, str | None]:
        """(ok, reason): whether this implementation can run here (this process) at ``world`` ranks, precision
        ``dtype`` and direction ``direction`` (None: not asked); the bench asks at its own world size, a dry run at
        the planned one."""
        if dtype is not None and self.dtypes is not None and self.dtypes.get(dtype) is not None:
            return False, self.dtypes[dtype]
        rule = self.directions.get(direction) if direction is not None and self.directions is not None else None
        if callable(rule):
            ok, reason = rule(world, dtype)
            if not ok:
                return False, reason or "unavailable"
        elif rule is not None:
            return False, rule
        if self.available is None:
            return True, None
        ok, reason = self.available(world)
        return bool(ok), (None if ok else reason or "unavailable")


_IMPLS: dict[str, dict[str, Impl]] = {}


def register(family: str, name: str, *, baseline: bool = False, available=None, kosmos: bool = False,
             fixed: str | None = None, dtypes: dict | None = None, directions: dict | None = None):
    """Decorator: register ``make`` as implementation ``name`` of ``family`` (returns ``make`` unchanged, so one
    maker can be registered under several names)."""
    if fixed not in (None, "default", "best"):
        raise ValueError(f"fixed={fixed!r}: use None, 'default' or 'best'")

    def deco(make):
        impls = _IMPLS.setdefault(family, {})
        if name in impls:
            raise ValueError(f"{family} implementation {name!r} is registered twice")
        impls[name] = Impl(family, name, make, baseline, available, kosmos, fixed, dtypes, directions)
        return make
    return deco


def names(family: str) -> tuple:
    """The implementations of ``family`` in registration order."""
    return tuple(_IMPLS.get(family, {}))


def get(family: str, name: str) -> Impl:
    try:
        return _IMPLS[family][name]
    except KeyError:
        raise UnknownImpl(f"unknown {family} implementation {name!r}; choose from "
                          f"{', '.join(names(family)) or '(none registered)'}") from None


def impls_at(family: str, impls, dtype: str, direction: str | None = None) -> tuple:
    """The implementations of ``impls`` (names of ``family``) that have a row at ``dtype`` (and ``direction``;
    ``Impl.runs_at``)."""
    return tuple(name for name in impls if get(family, name).runs_at(dtype, direction))


def baseline(family: str) -> str | None:
    """The name of ``family``'s baseline implementation (None if it has none)."""
    return next((i.name for i in _IMPLS.get(family, {}).values() if i.baseline), None)


# --------------------------------------------------------------------------- op configs (--config)

# the configs each bench's ops take, by op (the moe_experts op's kosmos kernel takes the moe_fwd config)
CONFIG_TYPES = {
    "tp": {"ag_gemm": AllGatherMatmulConfig, "gemm_rs": MatmulReduceScatterConfig},
    "moe": {"moe_fwd": MoEForwardConfig, "moe_bwd": MoEBackwardConfig},
}


def config_keys(types: dict) -> list[str]:
    """Every ``op.field`` of ``types`` ({op: config class})."""
    return [f"{op}.{f.name}" for op, cls in types.items() for f in dataclasses.fields(cls)]


def _resolve(key: str, types: dict) -> tuple[str, str]:
    """(op, field) of ``--config`` key ``key`` ("op.field" or a field only one op's config has)."""
    known = f"known: {', '.join(config_keys(types))}"
    op, dot, name = key.rpartition(".")
    if dot:
        if op not in types or name not in {f.name for f in dataclasses.fields(types[op])}:
            raise ValueError(f"--config: unknown key {key!r}; {known}")
        return op, name
    owners = [o for o, cls in types.items() if name in {f.name for f in dataclasses.fields(cls)}]
    if not owners:
        raise ValueError(f"--config: unknown key {key!r}; {known}")
    if len(owners) > 1:
        raise ValueError(f"--config: key {key!r} is ambiguous (a field of {', '.join(owners)}); write "
                         f"{' or '.join(f'{o}.{name}' for o in owners)}")
    return owners[0], name


def parse_config(items: Iterable[str] | None, types: dict) -> dict:
    """``--config`` values (each "key=value[,key=value...]"; key "op.field" or "field") -> {op: config} for
    every op of ``types`` (defaults where nothing was given; a key given twice: the last wins). A bad key or
    value is a one-line ValueError naming it (and, for a key, the known ones)."""
    pairs: dict[str, dict[str, str]] = {op: {} for op in types}
    for item in items or ():
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            key, eq, value = part.partition("=")
            if not eq or not key.strip():
                raise ValueError(f"--config {part!r}: expected key=value, e.g. push_chunks=auto; known keys: "
                                 f"{', '.join(config_keys(types))}")
            op, name = _resolve(key.strip(), types)
            try:
                config_from_strings(types[op], {name: value})
            except ValueError as e:
                raise ValueError(f"--config {op}.{name}={value.strip()}: {e}") from None
            pairs[op][name] = value
    out = {}
    for op, cls in types.items():
        try:
            out[op] = config_from_strings(cls, pairs[op])
        except ValueError as e:  # a rule across fields
            raise ValueError(f"--config {op}: {e}") from None
    return out
