"""Benchmark suites: YAML files under suites/ (a link to the packaged kosmos_bench/suite_files/) naming models,
sequence lengths (TP) or tokens and routings (MoE), precisions and implementations, and the report's bars for
their results (``targets``). ``load_suite`` validates everything up front and names the offending key on error;
the file's ``bench`` key (default "tp") picks TPSuite or MoESuite.

A TP suite may list its GEMMs itself instead of models (``shapes``, e.g. suites/tp-grid.yaml): a mapping of op
(ag_gemm, gemm_rs) to "MxNxK" strings -- the convention of ``kosmos bench tp --shape``: M, N, K as in the result
rows -- or a list of {op, m, n, k} mappings (the form a results file's env line records, so a recorded suite
loads back). Such a suite runs exactly as the same ``--shape``s with ``--op`` would (rows with model and layer
"custom"); it cannot also name models, seq, layers or shapes_tp.

A MoE suite's ``tokens`` is a list (every model at each) or a mapping of each of its models to its own list
(e.g. suites/moe-hf.yaml: ``tokens: {qwen3-30b-a3b: [8192], mixtral-8x7b: [4096]}``); ``--tokens`` replaces either
with one list for every model."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from kosmos.core.runtime import MAX_WORLD
from kosmos.models import DENSE_MODELS, MOE_MODELS, TP_LAYERS, TP_OPS, CustomShapeError, custom_tp_gemm, parse_shape

from .harness import FIXED_SWEEP
from .moe import DIRECTIONS, MOE_IMPLS, parse_routing
from .package_data import DEFAULT_SUITE_FILES  # the packaged default suites (suites/ links to them)
from .report.suite_targets import TARGET_KEYS, TargetsError  # noqa: F401 (TARGET_KEYS re-exported)
from .report.suite_targets import check_targets as _check_targets
from .tp import TP_IMPLS

DTYPES = ("bf16", "mxfp8", "fp8-block")
SUPPORTED_DTYPES = {"tp": ("bf16", "mxfp8", "fp8-block"), "moe": ("bf16", "mxfp8")}  # what each bench implements
DEFAULT_SUITE = DEFAULT_SUITE_FILES["tp"]
DEFAULT_MOE_SUITE = DEFAULT_SUITE_FILES["moe"]


class SuiteError(ValueError):
    pass


# TARGET_KEYS: the bars a report judges a suite's results against (`targets:` in the suite file; suites/*.yaml say
# what each means). They and their check live in report/suite_targets.py (stdlib and yaml only), so that the report
# reads the default suites' targets without importing this module, which imports torch through the bench modules.


def check_targets(bench: str, targets) -> None:
    """A suite's ``targets``: a mapping of the known target names of ``bench`` (TARGET_KEYS) to finite numbers >= 0."""
    try:
        _check_targets(bench, targets)
    except TargetsError as e:
        raise SuiteError(str(e)) from None


@dataclass(frozen=True)
class _Suite:
    """What every suite has: its name and bench, the models, precision and implementations, the timing loop, the
    fixed-role sweep, the report's targets (TARGET_KEYS) and free-form extras."""
    name: str = ""
    bench: str = ""
    models: tuple = ()
    dtype: str = "bf16"
    impls: tuple = ()
    iters: int = 20
    warmup: int = 5
    fixed_sweep: tuple = FIXED_SWEEP
    targets: dict = field(default_factory=dict)  # the report's bars for this suite's results (TARGET_KEYS)
    # the implementation the report's speedups are over (None: the bench's, nccl+cublas / nccl-a2a); one of impls
    baseline: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items()}

    def override(self, **kw):
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


@dataclass(frozen=True)
class TPSuite(_Suite):
    """``dtype``: one precision or a list (every point runs at each); held as a tuple, e.g. ("bf16", "mxfp8")."""
    name: str = "tp-default"
    bench: str = "tp"
    dtype: tuple = ("bf16",)
    models: tuple = ("llama3-70b", "llama3-8b")
    impls: tuple = TP_IMPLS
    seq: tuple = (4096, 8192, 16384)
    layers: tuple = TP_LAYERS
    tp: int | None = None
    shapes_tp: int | None = None  # size the GEMMs as at TP=shapes_tp (per-rank shards), whatever the world
    # the GEMMs themselves instead of the models' (module docstring): held as ((op, m, n, k), ...) in file order,
    # repeats dropped; () = the models' shapes
    shapes: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "dtype", _dtypes(self.dtype))
        object.__setattr__(self, "shapes", parse_shapes(self.shapes))
        _check(self)

    def to_dict(self) -> dict:
        """As _Suite's; ``shapes`` as a results file records them, [{op, m, n, k}, ...], and only when given."""
        d = super().to_dict()
        if self.shapes:
            d["shapes"] = [dict(zip(("op", "m", "n", "k"), s)) for s in self.shapes]
        else:
            d.pop("shapes")
        return d


SHAPE_KEYS = ("op", "m", "n", "k")
# what a suite with ``shapes`` cannot also give (its GEMMs are the shapes, not a model's)
MODEL_SHAPE_KEYS = ("models", "seq", "layers", "shapes_tp")


def parse_shapes(value) -> tuple:
    """A suite's ``shapes`` -> ((op, m, n, k), ...) in order, repeats dropped. ``value``: a mapping of op to a list
    of "MxNxK" strings, a list of {op, m, n, k} mappings, or that tuple already. A malformed entry is a one-line
    SuiteError naming it (e.g. "'shapes.ag_gemm[3]': '512x1024': not MxNxK ..."). N and K must be multiples of
    8 (TMA); M's divisibility by the world size is checked when the world is known (the CLI)."""
    if value is None or (isinstance(value, (tuple, list, dict)) and not value):
        return ()
    entries = []  # (where, op, (m, n, k))
    if isinstance(value, dict):
        for op, texts in value.items():
            if op not in TP_OPS:
                raise SuiteError(f"'shapes': unknown op {op!r}; choose from {', '.join(TP_OPS)}")
            if not isinstance(texts, list) or not texts:
                raise SuiteError(f"'shapes.{op}' must be a non-empty list of \"MxNxK\" strings, got {texts!r}")
            for i, text in enumerate(texts):
                if not isinstance(text, str):
                    raise SuiteError(f"'shapes.{op}[{i}]': {text!r} is not a string \"MxNxK\" (e.g. "
                                     f"\"8192x1024x8192\"; quote it)")
                try:
                    mnk = parse_shape(text)
                except CustomShapeError as e:
                    raise SuiteError(f"'shapes.{op}[{i}]': {text!r}: {e}") from None
                entries.append((f"shapes.{op}[{i}] ({text})", op, mnk))
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            where = f"shapes[{i}]"
            if isinstance(item, (list, tuple)) and len(item) == 4:  # the held form
                item = dict(zip(SHAPE_KEYS, item))
            if not isinstance(item, dict) or set(item) != set(SHAPE_KEYS):
                raise SuiteError(f"'{where}': {item!r} must be a mapping with keys op, m, n, k (or give 'shapes' "
                                 f"as a mapping of op to \"MxNxK\" strings)")
            entries.append((where, item["op"], (item["m"], item["n"], item["k"])))
    else:
        raise SuiteError(f"'shapes' must be a mapping of op ({', '.join(TP_OPS)}) to lists of \"MxNxK\" strings, "
                         f"got {type(value).__name__}")
    out = []
    for where, op, (m, n, k) in entries:
        if op not in TP_OPS:
            raise SuiteError(f"'{where}': unknown op {op!r}; choose from {', '.join(TP_OPS)}")
        try:
            custom_tp_gemm(op, m, n, k, 1)  # the --shape checks (positive ints, N and K multiples of 8)
        except CustomShapeError as e:
            raise SuiteError(f"'{where}': {e}") from None
        out.append((op, m, n, k))
    return tuple(dict.fromkeys(out))


def _dtypes(value, key: str = "dtype", allowed=DTYPES) -> tuple:
    """A suite's dtype(s) (or, with ``key`` "direction", direction(s)): a name, a comma list or a list -> a tuple
    without repeats (order kept)."""
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise SuiteError(f"'{key}' must be a name or a list of names ({', '.join(allowed)}), got {value!r}")
    return tuple(dict.fromkeys(v.strip() for v in value if v.strip()))


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
    _subset("dtype", s.dtype, list(SUPPORTED_DTYPES["tp"]))
    for key in ("iters", "warmup"):
        v = getattr(s, key)
        if not isinstance(v, int) or isinstance(v, bool) or v < (1 if key == "iters" else 0):
            raise SuiteError(f"'{key}' must be an integer >= {1 if key == 'iters' else 0}, got {v!r}")
    for key in ("tp", "shapes_tp"):
        v = getattr(s, key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
            raise SuiteError(f"'{key}' must be a positive integer, got {v!r}")
    _one_node("tp", s.tp)
    check_targets("tp", s.targets)
    _check_baseline(s)


def _check_baseline(s: _Suite) -> None:
    if s.baseline is not None and s.baseline not in s.impls:
        raise SuiteError(f"'baseline' {s.baseline!r} must be one of the suite's impls ({', '.join(s.impls)})")


def _one_node(key: str, ranks: int | None) -> None:
    """A suite's ``tp`` / ``ep``: at most MAX_WORLD ranks (one node; kosmos.core.runtime)."""
    if ranks is not None and ranks > MAX_WORLD:
        raise SuiteError(f"'{key}' must be 1 to {MAX_WORLD} ranks (KOSMOS runs within one node), got {ranks}")


def _as_tuple(key, v):
    if isinstance(v, (str, int)):
        return (v,)
    if isinstance(v, list):
        return tuple(v)
    raise SuiteError(f"'{key}' must be a list, got {type(v).__name__}")


@dataclass(frozen=True)
class MoESuite(_Suite):
    """A ``kosmos bench moe`` sweep: every (model, tokens per rank, routing) point runs every impl at each
    ``dtype`` (one precision or a list, held as a tuple like TPSuite's), in each ``direction`` (fwd, bwd, fwd+bwd:
    one or a list, the same way). ``tokens``: a tuple (every model at each), or {model: tuple} giving every model
    of ``models`` its own (``parse_tokens``)."""
    name: str = "moe-default"
    bench: str = "moe"
    dtype: tuple = ("bf16",)
    direction: tuple = ("fwd",)
    models: tuple = ("deepseek-v3", "qwen3-235b")
    impls: tuple = MOE_IMPLS
    tokens: tuple = (4096, 8192, 16384)
    routing: tuple = ("uniform", "zipf:1.2")
    ep: int | None = None
    expert_gemms: bool = True
    seed: int = 0

    def __post_init__(self):
        object.__setattr__(self, "dtype", _dtypes(self.dtype))
        object.__setattr__(self, "direction", _dtypes(self.direction, "direction", DIRECTIONS))
        object.__setattr__(self, "tokens", parse_tokens(self.tokens, self.models))
        _check_moe(self)
        # canonical routing strings ("ZIPF:1.20" -> "zipf:1.2"), so rows of one point always match
        object.__setattr__(self, "routing", tuple(str(parse_routing(r)) for r in self.routing))

    def to_dict(self) -> dict:
        """As _Suite's, with a per-model ``tokens`` mapping's lists as lists."""
        d = super().to_dict()
        if isinstance(self.tokens, dict):
            d["tokens"] = {name: list(t) for name, t in self.tokens.items()}
        return d


def parse_tokens(value, models) -> tuple | dict:
    """A MoE suite's ``tokens``: a list of positive integers (every model at each) -> a tuple, or a mapping of
    MoE model name -> such a list, one for every model of ``models`` -> {model: tuple} in ``models``' order (the
    mapping's other known models are dropped, so that ``--model`` can pick some of a suite's models). A malformed
    value is a one-line SuiteError naming it."""
    def as_tuple(key, v):
        return v if isinstance(v, tuple) else _as_tuple(key, v)
    if not isinstance(value, dict):
        value = as_tuple("tokens", value)
        _positive_ints("tokens", value)
        return value
    unknown = [name for name in value if name not in MOE_MODELS]
    if unknown:
        raise SuiteError(f"'tokens' names unknown models {unknown}; choose from {', '.join(MOE_MODELS)}")
    missing = [name for name in models if name not in value]
    if missing:
        raise SuiteError(f"'tokens' is a mapping of model -> tokens but gives none for {missing}")
    out = {}
    for name in models:
        out[name] = as_tuple(f"tokens.{name}", value[name])
        _positive_ints(f"tokens.{name}", out[name])
    return out


def _check_moe(s: MoESuite) -> None:
    if s.bench != "moe":
        raise SuiteError(f"'bench' must be 'moe' for a MoE suite, got {s.bench!r}")
    _subset("models", s.models, list(MOE_MODELS))
    _subset("impls", s.impls, list(MOE_IMPLS))
    _check_baseline(s)
    _positive_ints("fixed_sweep", s.fixed_sweep)
    if not s.routing:
        raise SuiteError("'routing' must not be empty")
    for r in s.routing:
        try:
            parse_routing(r)
        except ValueError as e:
            raise SuiteError(f"'routing': {e}") from None
    _subset("dtype", s.dtype, list(SUPPORTED_DTYPES["moe"]))
    _subset("direction", s.direction, list(DIRECTIONS))
    for key in ("iters", "warmup", "seed"):
        v = getattr(s, key)
        low = 1 if key == "iters" else 0
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            raise SuiteError(f"'{key}' must be an integer >= {low}, got {v!r}")
    if s.ep is not None and (not isinstance(s.ep, int) or isinstance(s.ep, bool) or s.ep < 1):
        raise SuiteError(f"'ep' must be a positive integer, got {s.ep!r}")
    _one_node("ep", s.ep)
    if not isinstance(s.expert_gemms, bool):
        raise SuiteError(f"'expert_gemms' must be true or false, got {s.expert_gemms!r}")
    check_targets("moe", s.targets)
    if s.ep is not None:
        for name in s.models:
            if MOE_MODELS[name].experts % s.ep:
                raise SuiteError(f"{name} has {MOE_MODELS[name].experts} experts: they do not split evenly over "
                                 f"ep={s.ep}")


SUITE_TYPES = {"tp": TPSuite, "moe": MoESuite}
LIST_KEYS = {"tp": ("models", "seq", "layers", "impls", "fixed_sweep"),
             "moe": ("models", "tokens", "routing", "impls", "fixed_sweep")}


def load_suite(path, bench: str | None = "tp"):
    """The suite in YAML file ``path``: a TPSuite or a MoESuite, by the file's ``bench`` key (default "tp").
    A suite of another bench than ``bench`` is an error; ``bench=None`` accepts either."""
    path = Path(path)
    if not path.is_file():
        raise SuiteError(f"suite file {path} does not exist")
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:  # a binary file: one line with the path, not a bare codec error
        raise SuiteError(f"{path}: not a text (UTF-8) YAML file: byte {e.start} is {e.object[e.start:e.start + 1]!r}"
                         ) from None
    except OSError as e:
        raise SuiteError(f"{path}: cannot read the suite file: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise SuiteError(f"{path}: not valid YAML: {' '.join(str(e).split())}") from None
    if not isinstance(doc, dict):
        raise SuiteError(f"{path}: a suite must be a YAML mapping of keys (name, models, seq, ...)")
    kind = doc.get("bench", "tp")
    if kind not in SUITE_TYPES:
        raise SuiteError(f"{path}: unknown bench {kind!r}; a suite's 'bench' is 'tp' or 'moe'")
    if bench is not None and kind != bench:
        raise SuiteError(f"{path} is a '{kind}' suite; run it with `kosmos bench {kind}`")
    cls = SUITE_TYPES[kind]
    known = set(cls.__dataclass_fields__)
    unknown = sorted(set(doc) - known)
    if unknown:
        raise SuiteError(f"{path}: unknown key(s) {unknown}; allowed: {sorted(known)}")
    both = [key for key in MODEL_SHAPE_KEYS if key in doc] if doc.get("shapes") else []
    if both:
        raise SuiteError(f"{path}: 'shapes' gives the GEMMs themselves: drop {', '.join(map(repr, both))}")
    kw = dict(doc)
    try:
        for key in LIST_KEYS[kind]:
            if key in kw and not (key == "tokens" and isinstance(kw[key], dict)):  # MoE tokens: a list or a mapping
                kw[key] = _as_tuple(key, kw[key])
        return cls(**kw)
    except SuiteError as e:
        raise SuiteError(f"{path}: {e}") from None
    except TypeError as e:  # e.g. a key given twice under different spellings
        raise SuiteError(f"{path}: {e}") from None


def default_suite() -> TPSuite:
    return load_suite(DEFAULT_SUITE) if DEFAULT_SUITE.is_file() else TPSuite()


def default_moe_suite() -> MoESuite:
    return load_suite(DEFAULT_MOE_SUITE, bench="moe") if DEFAULT_MOE_SUITE.is_file() else MoESuite()
