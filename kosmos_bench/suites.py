"""Benchmark suites: YAML files under suites/ naming models, sequence lengths, layers, precisions and
implementations. ``load_suite`` validates everything up front and names the offending key on error."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from kosmos.models import DENSE_MODELS, TP_LAYERS

from .tp import FIXED_SWEEP, TP_IMPLS

DTYPES = ("bf16", "mxfp8")
SUPPORTED_DTYPES = ("bf16",)
DEFAULT_SUITE = Path(__file__).resolve().parent.parent / "suites" / "tp-default.yaml"


class SuiteError(ValueError):
    pass


@dataclass(frozen=True)
class TPSuite:
    name: str = "tp-default"
    bench: str = "tp"
    models: tuple = ("llama3-70b", "llama3-8b")
    seq: tuple = (4096, 8192, 16384)
    layers: tuple = TP_LAYERS
    dtype: str = "bf16"
    impls: tuple = TP_IMPLS
    iters: int = 20
    warmup: int = 5
    fixed_sweep: tuple = FIXED_SWEEP
    tp: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        _check(self)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    def override(self, **kw) -> "TPSuite":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


def _positive_ints(key, values):
    if not values or any(not isinstance(v, int) or isinstance(v, bool) or v <= 0 for v in values):
        raise SuiteError(f"'{key}' must be a non-empty list of positive integers, got {list(values)!r}")


def _subset(key, values, allowed):
    if not values:
        raise SuiteError(f"'{key}' must not be empty")
    bad = [v for v in values if v not in allowed]
    if bad:
        raise SuiteError(f"unknown {key} {bad}; choose from {', '.join(allowed)}")


def _check(s: TPSuite) -> None:
    if s.bench != "tp":
        raise SuiteError(f"'bench' must be 'tp' for a TP suite, got {s.bench!r}")
    _subset("models", s.models, list(DENSE_MODELS))
    _subset("layers", s.layers, list(TP_LAYERS))
    _subset("impls", s.impls, list(TP_IMPLS))
    _positive_ints("seq", s.seq)
    _positive_ints("fixed_sweep", s.fixed_sweep)
    if s.dtype not in DTYPES:
        raise SuiteError(f"unknown dtype {s.dtype!r}; choose from {', '.join(DTYPES)}")
    for key in ("iters", "warmup"):
        v = getattr(s, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "iters" else 0):
            raise SuiteError(f"'{key}' must be an integer >= {1 if key == 'iters' else 0}, got {v!r}")
    if s.tp is not None and (not isinstance(s.tp, int) or s.tp < 1):
        raise SuiteError(f"'tp' must be a positive integer, got {s.tp!r}")


def _as_tuple(key, v):
    if isinstance(v, (str, int)):
        return (v,)
    if isinstance(v, list):
        return tuple(v)
    raise SuiteError(f"'{key}' must be a list, got {type(v).__name__}")


def load_suite(path) -> TPSuite:
    path = Path(path)
    if not path.is_file():
        raise SuiteError(f"suite file {path} does not exist")
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise SuiteError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(doc, dict):
        raise SuiteError(f"{path}: a suite must be a YAML mapping of keys (name, models, seq, ...)")
    known = set(TPSuite.__dataclass_fields__)
    unknown = sorted(set(doc) - known)
    if unknown:
        raise SuiteError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    kw = dict(doc)
    for key in ("models", "seq", "layers", "impls", "fixed_sweep"):
        if key in kw:
            kw[key] = _as_tuple(key, kw[key])
    try:
        return TPSuite(**kw)
    except SuiteError as e:
        raise SuiteError(f"{path}: {e}") from None


def default_suite() -> TPSuite:
    return load_suite(DEFAULT_SUITE) if DEFAULT_SUITE.is_file() else TPSuite()
