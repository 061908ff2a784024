"""The ``kosmos`` command line: ``kosmos bench tp``, ``kosmos bench moe``, ``kosmos report``."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from typer.core import TyperCommand, TyperGroup


class _NoFlagTypes:
    """Help without a type for flags: typer shows ``<bool>`` beside every flag (--help included), although a flag
    takes no value."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for p in params:
            if getattr(p, "is_flag", False) and p.metavar is None:
                p.metavar = ""
        return params


class _Command(_NoFlagTypes, TyperCommand):
    pass


class _Group(_NoFlagTypes, TyperGroup):
    pass


def _flowed(text: str) -> str:
    """``text`` (a docstring) with the line breaks inside each paragraph made spaces, so that the help is wrapped
    at the terminal's width (typer re-wraps only a command's first paragraph); paragraphs stay apart."""
    import inspect
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in p.splitlines()) for p in paragraphs)


def _command(group: typer.Typer, name: str, help: str | None = None):
    """``group.command(name)`` with the help re-flowed (``_flowed``; default: the function's docstring) and no
    types beside flags (``_NoFlagTypes``)."""
    def register(fn):
        return group.command(name, cls=_Command, help=_flowed(help or fn.__doc__ or ""))(fn)
    return register


app = typer.Typer(cls=_Group, add_completion=False, no_args_is_help=True, help=(
    "KOSMOS: self-scheduling fused communication+GEMM kernels for tensor/sequence and expert parallelism, "
    "and the benchmark that compares them with what you run today.\n\n"
    "  kosmos bench tp                      # default TP suite on all visible GPUs\n\n"
    "  kosmos bench tp --model llama3-70b --seq 4096,8192 --tp 2\n\n"
    "  kosmos bench moe --model deepseek-v3 --tokens 4096 --routing uniform,zipf:1.2\n\n"
    "  kosmos bench tp --shape 8192x1024x8192 --op ag_gemm --dry-run\n\n"
    "  kosmos report results/h200x2/tp-bf16.jsonl --format md\n\n"
    "  kosmos env                           # what a bug report needs"))
bench_app = typer.Typer(cls=_Group, no_args_is_help=True,
                        help="Check and time fused ops against baselines on this node's GPUs.")
app.add_typer(bench_app, name="bench")
console = Console(stderr=True)


def _version(value: bool):
    if value:
        from .envinfo import version_line
        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                       help="Print the versions of kosmos, torch and triton, and exit.")):
    pass


CAST_WORDS = {int: "an integer", float: "a number"}


def _split(values: Optional[List[str]], cast=str, option: str = ""):
    """Repeated and comma-separated option values -> a tuple (None when not given); a value ``cast`` rejects is
    a one-line error naming ``option``."""
    if not values:
        return None
    out = []
    for v in values:
        for part in str(v).split(","):
            part = part.strip()
            if part:
                try:
                    out.append(cast(part))
                except ValueError:
                    _fail(f"{option}: {part!r} is not {CAST_WORDS.get(cast, 'a valid ' + cast.__name__)}")
    return tuple(out)


def _at_least(low: int, **given) -> None:
    """Each given option (``flag=value``, the flag spelled with _ for -, e.g. ``host_calls``; None: not given, a
    tuple: every value) an integer >= ``low``, else a one-line error naming it."""
    for name, value in given.items():
        for v in value if isinstance(value, tuple) else (value,):
            if v is not None and v < low:
                _fail(f"--{name.replace('_', '-')} {v}: give an integer >= {low}")


def _check_ranks(value: Optional[int], flag: str) -> None:
    """``--tp`` / ``--ep`` as given: None, or 1 to MAX_WORLD ranks (one node, kosmos.core.runtime.MAX_WORLD);
    else a one-line error naming the option."""
    from kosmos.core.runtime import MAX_WORLD
    if value is not None and not 1 <= value <= MAX_WORLD:
        _fail(f"{flag} {value}: give 1 to {MAX_WORLD} ranks (KOSMOS runs within one node of up to {MAX_WORLD} "
              f"GPUs)")


def _dtypes(values: Optional[str], bench: str) -> tuple | None:
    """``--dtype`` (a comma list, e.g. bf16,mxfp8) -> a tuple without repeats (None when not given); a name the
    ``bench`` ("tp" or "moe") does not run is a one-line error."""
    from .suites import SUPPORTED_DTYPES
    DTYPES = SUPPORTED_DTYPES[bench]
    names = _split([values] if values else None)
    if names is None:
        return None
    if not names:
        _fail(f"--dtype: give {', '.join(DTYPES)} or a comma list of them, e.g. --dtype bf16,mxfp8")
    bad = [n for n in names if n not in DTYPES]
    if bad:
        _fail(f"--dtype: unknown {', '.join(map(repr, bad))}; choose from {', '.join(DTYPES)} (comma-separated, "
              f"e.g. --dtype bf16,mxfp8)")
    return tuple(dict.fromkeys(names))


def _directions(values: Optional[str]) -> tuple | None:
    """``--direction`` (a comma list of fwd, bwd, fwd+bwd) -> a tuple without repeats (None when not given); an
    unknown name is a one-line error."""
    from .moe import DIRECTIONS
    names = _split([values] if values else None)
    if names is None:
        return None
    bad = [n for n in names if n not in DIRECTIONS]
    if not names or bad:
        _fail(f"--direction: {'unknown ' + ', '.join(map(repr, bad)) + '; ' if bad else ''}choose from "
              f"{', '.join(DIRECTIONS)} (comma-separated, e.g. --direction fwd,bwd)")
    return tuple(dict.fromkeys(names))


def _world(asked, flag: str, dry_run: bool) -> tuple[int, str]:
    """(world size, how it was chosen). A real run needs the GPUs (one-line error otherwise); a dry run plans for
    ``asked`` ranks, else for every visible GPU, else for 1 rank, and touches no GPU."""
    from . import launcher
    if not dry_run:
        try:
            world = launcher.check_world(asked)
        except launcher.LaunchError as e:
            _fail(str(e))
        return world, f"{flag} {asked}" if asked is not None else "every visible GPU"
    if asked is not None:
        return asked, f"{flag} {asked}"
    n = launcher.visible_gpus()
    if n:
        return n, f"every visible GPU ({n})"
    return 1, f"no CUDA GPU visible here; {flag} N plans for N"


def _configs(bench: str, items):
    """``--config`` values -> {op: config} for ``bench`` (ValueError with one line naming a bad key or value)."""
    from .registry import CONFIG_TYPES, parse_config
    return parse_config(_split(items), CONFIG_TYPES[bench])


CONFIG_HELP = ("Set a field of an op's config for the KOSMOS implementations ({impls}): KEY=VALUE, repeated or "
               "comma-separated. KEY is OP.FIELD ({keys}) or FIELD alone when one op has it. Every row records "
               "the config it ran with. E.g. --config {example}")


def _fail(msg: str, code: int = 2):
    """``error: msg`` on stderr (one line: not wrapped at the terminal width), then exit ``code``."""
    from rich.markup import escape
    console.print(f"[bold red]error:[/] {escape(msg)}", soft_wrap=True)
    raise typer.Exit(code)


# the options both benches take (help texts naming the bench's own defaults)
TP_DTYPE_OPTION = typer.Option(None, "--dtype", help="bf16, mxfp8, fp8-block, or a comma list (bf16,mxfp8: every "
                               "shape runs at each, rows in one file, each with its dtype). mxfp8: the bf16 "
                               "activation is MXFP8-quantized in the timed call, the weight's MX form made once; "
                               "adds the triton-dot-scaled and fp8-rowwise baselines. fp8-block (block-scaled FP8 on "
                               "the FP8 tensor cores): the same, with 1x128 / 128x128 "
                               "fp32 scales; adds cublas-fp8-block and fp8-rowwise, nccl+cublas stays bf16. "
                               "Default bf16.")
MOE_DTYPE_OPTION = typer.Option(None, "--dtype", help="bf16, mxfp8, or both comma-separated (bf16,mxfp8: every "
                                "point runs at each, rows in one file, each with its dtype). mxfp8: x is MXFP8-"
                                "quantized in the timed call, the expert weights' MX values made once; the expert "
                                "GEMMs alone (kosmos-expert-gemms vs grouped-mm) run at bf16 only.")
MOE_DIRECTION_OPTION = typer.Option(None, "--direction", help="fwd (the layer's forward, the default), bwd (its "
                                    "backward alone: an untimed forward before each timed backward) or fwd+bwd, or "
                                    "a comma list (every point runs in each, rows carry their direction). The "
                                    "backward rows: kosmos (at --ep 1 moe_backward_w1 on the forward's "
                                    "kept g | u; at --ep > 1 moe_backward, GEMM1 recomputed) and nccl-a2a "
                                    "(autograd), checked against the fp32 gradients; at --dtype mxfp8 the MX "
                                    "backward (every backward GEMM on MX operands) of both, checked against the "
                                    "MX layer's fp32 gradients.")


def _suite_default(bench: str, key: str) -> str:
    """The value of ``key`` in ``bench``'s default suite file, as the help names it ("?" if unreadable)."""
    import yaml

    from .package_data import DEFAULT_SUITE_FILES
    try:
        return str(yaml.safe_load(DEFAULT_SUITE_FILES[bench].read_text())[key])
    except Exception:
        return "?"


def _iters_option(bench: str):
    return typer.Option(None, "--iters", help=f"Timed iterations per implementation (median reported); default: "
                        f"the suite's, {_suite_default(bench, 'iters')} in {bench}-default.")


def _warmup_option(bench: str):
    return typer.Option(None, "--warmup", help=f"Untimed warm-up iterations; default: the suite's, "
                        f"{_suite_default(bench, 'warmup')} in {bench}-default.")

CUDA_GRAPH_OPTION = typer.Option(False, "--cuda-graph", help="Capture one call of each implementation (after "
                                 "warm-up) into a CUDA graph and time its replay; rows carry cuda_graph: true, and "
                                 "one whose capture fails is recorded as failed with the reason.")


def _suite_option(bench: str):
    return typer.Option(None, "--suite", help=f"YAML suite file, or the name of a packaged suite (e.g. "
                        f"{bench}-default: the default, suites/{bench}-default.yaml in a checkout).")


def _load_suite(suite: Optional[Path], bench: str):
    """The suite of ``--suite`` (a file, or a packaged suite's name: what an installed package has without the
    repository's suites/), else the bench's default suite."""
    from .package_data import SUITES_DIR
    from .suites import SuiteError, default_moe_suite, default_suite, load_suite
    if suite is None:
        return default_suite() if bench == "tp" else default_moe_suite()
    packaged = SUITES_DIR / f"{suite}.yaml"
    if not suite.exists() and suite.parent == Path(".") and not suite.suffix and packaged.is_file():
        suite = packaged
    try:
        return load_suite(suite, bench=bench)
    except SuiteError as e:
        if suite.exists():
            raise
        names = ", ".join(sorted(p.stem for p in SUITES_DIR.glob("*.yaml")))
        raise SuiteError(f"{e} (packaged suites, by name: {names})") from None


def _out_option(bench: str):
    return typer.Option(None, "--out", "-o", help=f"JSONL file to append to (default: "
                        f"results/{bench}-<dtype>-<timestamp>.jsonl).")


def _impl_option(names: str):
    return typer.Option(None, "--impl", help=f"{names} (comma-separated).")


def _config_option(impls: str, keys: str, example: str):
    return typer.Option(None, "--config", "-c", help=CONFIG_HELP.format(impls=impls, keys=keys, example=example))


DRY_RUN_OPTION = typer.Option(False, "--dry-run", help="Print the planned points and implementations (with "
                              "what can be known of their availability without a GPU) and exit: no GPU is "
                              "touched, nothing is launched or written. Works on a machine without GPUs.")


def _out_path(out: Optional[Path], bench: str, dtype: str, create: bool = True) -> Path:
    """The results file: ``out`` (``--out``), else results/BENCH-DTYPE-TIMESTAMP.jsonl; its folders are made when
    ``create`` (a dry run makes nothing). One that cannot be appended to is a one-line error naming --out, dry run
    included (``_check_writable``)."""
    out = out or Path("results") / f"{bench}-{dtype}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    _check_writable(out)
    if create:
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            _fail(f"--out {out}: cannot make its folder ({e.strerror or e})")
    return out


def _check_writable(out: Path) -> None:
    """A one-line error naming --out unless ``out`` can be appended to: an existing file is opened for appending
    (nothing written), else an unnamed temporary file is made in the nearest folder that exists (where the run
    would make the missing ones; nothing is left behind)."""
    import tempfile
    if out.is_dir():
        _fail(f"--out {out}: a folder; give a file path, e.g. {out / 'results.jsonl'}")
    folder = out.parent
    while not folder.exists():
        folder = folder.parent
    try:
        if out.exists():
            with open(out, "a"):
                return
        if not folder.is_dir():
            _fail(f"--out {out}: {folder} is a file, not a folder")
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        where = "cannot append to it" if out.exists() else f"cannot create files in {folder}"
        _fail(f"--out {out}: {where} ({e.strerror or e})")


def _planned_availability(family: str, impls, world: int, dtype: str | None = None,
                          direction: str | None = None) -> list[tuple[str, str]]:
    """[(impl, availability)] of ``impls`` of ``family`` as the registry's predicates judge them at ``world``
    ranks (a package, the torch build, the world size) and precision ``dtype`` (those without a row at it
    are left out), in this process: nothing launches. What needs the GPU itself (Hopper, memory) is not known
    here."""
    from . import moe, registry, tp  # noqa: F401 (importing the bench modules registers their implementations)
    base = registry.baseline(family)
    out = []
    for name in impls:
        if dtype is not None and not registry.get(family, name).runs_at(dtype, direction):
            continue
        try:
            ok, why = registry.get(family, name).availability(world, dtype, direction)
        except Exception as e:  # a predicate that cannot decide here
            ok, why = None, f"not known without running ({type(e).__name__}: {e})"
        word = "available" if ok else ("unavailable: " if ok is False else "") + (why or "")
        out.append((name + (" (baseline)" if name == base else ""), word))
    return out


def _print_plan(title: str, facts: list[tuple[str, str]], header: tuple, points: list[tuple],
                impls: list[tuple[str, list[tuple[str, str]]]]) -> None:
    """The dry run's report (stdout): the facts of the run, the points as a table, each family's implementations
    with their availability; then exit 0."""
    lines = [title] + [f"  {k}: {v}" for k, v in facts]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *points)]
    lines.append(f"points ({len(points)}):")
    for row in (header, *points):
        lines.append("  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    for family, rows in impls:
        lines.append(f"implementations ({family}):")
        width = max(len(n) for n, _ in rows)
        lines += [f"  {n.ljust(width)}  {a}" for n, a in rows]
    lines.append("dry run: nothing was launched or written; GPU-side checks (Hopper, memory) happen at run time.")
    typer.echo("\n".join(lines))
    raise typer.Exit(0)


def _backward_check_memory(cases) -> str:
    """The dry run's estimate of the peak GPU memory while an EP=1 backward is checked, per (model, tokens)
    (kosmos_bench.moe.backward_check_bytes: balanced load, KOSMOS's workspace not counted)."""
    from .moe import GiB, backward_check_bytes, case_model
    peaks = {(c.model, c.tokens): backward_check_bytes(case_model(c), c.tokens)["peak"] for c in cases}
    return ", ".join(f"{m} {t}: ~{b / GiB:.0f} GiB" for (m, t), b in peaks.items()) + " (estimate, EP=1)"


def _configs_text(configs: dict) -> str:
    from kosmos.config import config_dict
    return "; ".join(f"{op} " + ", ".join(f"{k}={v}" for k, v in config_dict(c).items()) for op, c in configs.items())


def _launch(rank_fn, world: int, out: Path, *args, table: bool = True):
    """Run ``rank_fn(rank, world, *args)`` on every rank, then (rank 0) show the table of ``out`` (``table``) and
    where the results are; exit 1 with a one-line summary when a row of this run failed (``_exit_if_failed``)."""
    from . import launcher
    try:
        launcher.spawn(rank_fn, world, *args)
    except launcher.LaunchError as e:
        _fail(f"{e}\npartial results (if any) are in {out}", code=1)
    if launcher.under_torchrun() and int(os.environ["RANK"]) != 0:
        return  # under torchrun every rank runs this command; rank 0 wrote the file and shows the table
    if table:
        from .report import build_table, load_records, print_terminal
        records = load_records([out])
        print_terminal(build_table(records.results, records.hosts), console=Console())
    console.print(f"results: {out}  (render {'again ' if table else ''}with `kosmos report {out}`)")
    _exit_if_failed(out)


def _failed_rows(out: Path) -> tuple[int, list[dict]]:
    """(rows of the last run in ``out``, those of them with status "failed"): the run is the one of the file's
    last environment line (its run_id; a results file is appended to, run after run)."""
    import json
    rows, run_id = [], None
    try:
        lines = out.read_text(encoding="utf-8").splitlines()
    except OSError:
        return 0, []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if not isinstance(row, dict):
            continue
        if row.get("type") == "env":
            rows, run_id = [], row.get("run_id")
        elif row.get("type") in ("result", "host") and row.get("run_id") == run_id:
            rows.append(row)
    return len(rows), [r for r in rows if r.get("status") == "failed"]


def _exit_if_failed(out: Path) -> None:
    """Exit 1 with one line naming the implementations whose rows failed in this run of ``out`` (their reasons are
    in the rows); nothing when none failed ("unavailable" rows fail nothing)."""
    total, failed = _failed_rows(out)
    if failed:
        per_impl: dict = {}
        for r in failed:
            per_impl[r.get("impl")] = per_impl.get(r.get("impl"), 0) + 1
        _fail(f"{len(failed)} of {total} rows failed ({', '.join(f'{i}: {n}' for i, n in per_impl.items())}); "
              f"their reasons are in the rows of {out}", code=1)


SHAPE_HELP = ("A custom GEMM MxNxK instead of the models' shapes (repeated or comma-separated; needs --op ag_gemm "
              "or gemm_rs; rows get model and layer 'custom'). M, N, K as in the result rows: ag_gemm C[M,N] = "
              "allgather(A[M/W,K]) @ B[K,N], M the gathered rows, N already per rank; gemm_rs C_shard[M/W,N] = "
              "RS(A[M,K] @ B[K,N]), K already per rank. M must divide by the world size W, N and K be multiples "
              "of 8. E.g. --shape 8192x1024x8192 --op ag_gemm.")
TP_OP_LAYERS = {"ag_gemm": ("qkv", "fc1"), "gemm_rs": ("attn_out", "fc2")}
# `bench tp --host-shape / --host-calls` defaults (kosmos_bench.tp.HOST_SHAPE / HOST_CALLS; not imported from there:
# tp imports torch, and --help must stay quick)
TP_HOST_SHAPE, TP_HOST_CALLS = (128, 256, 256), 200


def _tp_layers(ops) -> tuple | None:
    """``--op`` values (ops or layer names) -> the layers of the models' shapes."""
    from kosmos.models import TP_LAYERS
    if not ops:
        return None
    layers = tuple(dict.fromkeys(l for n in ops for l in TP_OP_LAYERS.get(n, (n,))))
    bad = [l for l in layers if l not in TP_LAYERS]
    if bad:
        _fail(f"unknown --op {bad}; use ag_gemm, gemm_rs or {', '.join(TP_LAYERS)}")
    return layers


def _custom_shapes(shapes, ops, tp, **excluded) -> list[tuple[str, str, tuple]] | None:
    """``--shape`` values -> [(op, text, (M, N, K))] for every op of ``--op`` (None without --shape), checked
    before any GPU is looked for (at ``--tp``'s world size when given; _tp_cases checks M again at the real one).
    The options that pick a model's shapes (``excluded``: option -> value) cannot be combined with it."""
    from kosmos.models import TP_OPS, CustomShapeError, custom_tp_gemm, parse_shape
    texts = _split(shapes)
    if not texts:
        return None
    given = [opt for opt, v in excluded.items() if v not in (None, [], ())]
    if given:
        _fail(f"--shape gives the GEMM's M, N, K itself: drop {', '.join(given)}")
    if not ops:
        _fail(f"--shape needs --op {' or --op '.join(TP_OPS)} (the op the M, N, K belong to)")
    bad = [o for o in ops if o not in TP_OPS]
    if bad:
        _fail(f"--op {','.join(bad)}: with --shape, --op is {' or '.join(TP_OPS)} (a layer name picks a model's "
              f"shape)")
    out = []
    for text in texts:
        try:
            mnk = parse_shape(text)
            for o in dict.fromkeys(ops):
                custom_tp_gemm(o, *mnk, tp if isinstance(tp, int) and tp > 0 else 1)
                out.append((o, text, mnk))
        except CustomShapeError as e:
            _fail(f"--shape {text}: {e}")
    return out


HOST_SHAPE_HELP = ("The small GEMM MxNxK (M, N, K as in --shape) on which the host enqueue time per eager call is "
                   "measured, once per sweep for each op, dtype and implementation of the run (after its check): "
                   "--host-calls back-to-back calls after 1 s of warm-up, median (rows of type \"host\"; the "
                   "suite's target: <= 30 µs at W=1). Default: 128x256x256, one output tile.")


def _host_shape(text: Optional[str], calls: int, ops, world: int, how: str) -> tuple[int, int, int]:
    """``--host-shape`` (None: the default, TP_HOST_SHAPE) -> (M, N, K); with ``calls`` > 0 checked as a custom
    shape of every op in ``ops`` at ``world`` ranks (M divides by it, N and K multiples of 8). A bad value is a
    one-line error naming the option the user gave: --host-shape, or ``how`` the world size was chosen (e.g.
    "--tp 3") when the default shape does not fit it."""
    from kosmos.models import CustomShapeError, custom_tp_gemm, parse_shape
    shape = text or "x".join(map(str, TP_HOST_SHAPE))
    try:
        mnk = parse_shape(shape)
        for o in dict.fromkeys(ops) if calls else ():
            custom_tp_gemm(o, *mnk, world)
    except CustomShapeError as e:
        if text is not None:
            _fail(f"--host-shape {text}: {e}")
        _fail(f"{how}: the host enqueue measurement's default shape {shape} does not fit: {e}; give --host-shape, "
              f"e.g. {TP_HOST_SHAPE[0] * world}x{TP_HOST_SHAPE[1]}x{TP_HOST_SHAPE[2]}, or --host-calls 0")
    return mnk


def _suite_shapes(cfg, ops, **excluded) -> list[tuple[str, str, tuple]]:
    """The GEMMs of a suite with ``shapes`` in ``_custom_shapes``' form, those of ``--op``'s ops when given
    (ag_gemm, gemm_rs). The options that pick a model's shapes (``excluded``) cannot be combined with it."""
    from kosmos.models import TP_OPS
    given = [opt for opt, v in excluded.items() if v not in (None, [], ())]
    if given:
        _fail(f"suite {cfg.name} lists its GEMMs (shapes): drop {', '.join(given)}, or give --shape")
    bad = [o for o in ops or () if o not in TP_OPS]
    if bad:
        _fail(f"--op {','.join(bad)}: suite {cfg.name} lists its GEMMs (shapes): --op is {' or '.join(TP_OPS)}")
    out = [(o, f"{m}x{n}x{k} of suite {cfg.name}", (m, n, k)) for o, m, n, k in cfg.shapes if not ops or o in ops]
    if not out:
        _fail(f"suite {cfg.name} has no shapes of --op {','.join(ops)}")
    return out


def _tp_cases(cfg, custom, world: int, how: str) -> list:
    """The GEMMs of the run: the custom shapes, or every (model, seq, layer) of the suite; a model's shapes that do
    not fit ``world`` ranks are a one-line error naming ``how`` the world size was chosen (e.g. "--tp 3")."""
    from kosmos.models import CustomShapeError, custom_tp_gemm, tp_gemms
    if custom is not None:
        cases = []
        for o, text, (m, n, k) in custom:
            try:
                cases.append(custom_tp_gemm(o, m, n, k, world))
            except CustomShapeError as e:
                _fail(f"--shape {text}: {e}")
        return list(dict.fromkeys(cases))
    try:
        shard = cfg.shapes_tp or world
        cases = [g for m in cfg.models for s in cfg.seq for g in tp_gemms(m, s, shard, cfg.layers)]
        if shard != world:  # the sequence is split over the real world (SP), the weight over ``shard``
            bad = sorted({g.seq for g in cases if g.seq % world})
            if bad:
                raise ValueError(f"seq {bad} must divide by the world size {world}")
    except ValueError as e:
        _fail(f"{how}: {e}" if world > 1 else str(e))
    return cases


@_command(bench_app, "tp")
def bench_tp(
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="Model(s), comma-separated or repeated: "
                                              "llama3-8b, llama3-70b, llama3-405b, gpt3-175b."),
    seq: Optional[List[str]] = typer.Option(None, "--seq", "-s", help="Token counts per layer (M), e.g. 4096,8192."),
    shape: Optional[List[str]] = typer.Option(None, "--shape", help=SHAPE_HELP),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size, 1 to 8 (default: all visible GPUs)."),
    shapes_tp: Optional[int] = typer.Option(None, "--shapes-tp", help="Size the GEMMs as at TP=N (each rank's "
                                            "weight shard) whatever --tp is: `--tp 1 --shapes-tp 2` times the "
                                            "kernels with communication off on the per-rank GEMMs of a TP=2 run."),
    dtype: Optional[str] = TP_DTYPE_OPTION,
    op: Optional[List[str]] = typer.Option(None, "--op", help="ag_gemm, gemm_rs, or layer names qkv,fc1,attn_out,fc2 "
                                           "(with --shape: ag_gemm and/or gemm_rs)."),
    impl: Optional[List[str]] = _impl_option("kosmos, nccl+cublas, torch-async-tp, fixed-role, fixed-role-best; "
                                             "at mxfp8 also triton-dot-scaled, fp8-rowwise; at fp8-block "
                                             "cublas-fp8-block, fp8-rowwise"),
    suite: Optional[Path] = _suite_option("tp"),
    iters: Optional[int] = _iters_option("tp"),
    warmup: Optional[int] = _warmup_option("tp"),
    out: Optional[Path] = _out_option("tp"),
    trace: bool = typer.Option(False, "--trace", help="Record a per-program task timeline of each kosmos run "
                               "(JSON next to --out; draw with `kosmos report --timeline FILE`)."),
    cuda_graph: bool = CUDA_GRAPH_OPTION,
    config: Optional[List[str]] = _config_option(
        "kosmos, fixed-role, fixed-role-best", "ag_gemm.push_chunks (an integer >= 1 or auto), ag_gemm.copy_block, "
        "gemm_rs.push_partials (true/false)", "push_chunks=auto --config push_partials=true"),
    host_shape: Optional[str] = typer.Option(None, "--host-shape", help=HOST_SHAPE_HELP),
    host_calls: int = typer.Option(TP_HOST_CALLS, "--host-calls", help="Back-to-back eager calls of the host "
                                   "enqueue measurement (--host-shape); 0: no measurement."),
    dry_run: bool = DRY_RUN_OPTION,
):
    """Check every implementation against the fp32 reference, then time them side by side.

    Each (model, layer, seq) shape -- or each --shape -- runs every implementation on the same random inputs; a
    failing one is recorded as failed with its reason and the sweep goes on (the command then exits 1 at the end).
    Rows are appended to --out as they finish.

    Example (an A/B of a config field, one file each): kosmos bench tp --model llama3-70b --op ag_gemm
    --impl kosmos,nccl+cublas --config ag_gemm.push_chunks=auto --out results/ag-auto.jsonl

    Example (a custom point, planned only): kosmos bench tp --shape 8192x1024x8192,16384x1024x8192 --op ag_gemm
    --tp 8 --dry-run

    Example (MXFP8 against bf16, one file): kosmos bench tp --model llama3-70b --dtype bf16,mxfp8 runs every
    shape at both precisions; mxfp8 rows are checked against the fp32 product of the MX values and also record
    rel_err_bf16; `kosmos report` shows an "mxfp8 / bf16" section.
    """
    from kosmos.models import CUSTOM, TP_OPS

    from .suites import SuiteError, TPSuite

    _check_ranks(tp, "--tp")
    _at_least(1, shapes_tp=shapes_tp, iters=iters, seq=_split(seq, int, "--seq"))
    _at_least(0, warmup=warmup)
    if host_calls < 0:
        _fail(f"--host-calls {host_calls}: give a number of calls >= 0 (0: no host enqueue measurement)")
    ops = _split(op)
    custom = _custom_shapes(shape, ops, tp, **{"--model": model, "--seq": seq, "--shapes-tp": shapes_tp})
    if host_shape is not None:  # checked before any GPU is looked for (at --tp's world when given), again below
        _host_shape(host_shape, host_calls, TP_OPS, tp or 1, f"--tp {tp}")
    try:
        base = _load_suite(suite, "tp")
        cfg: TPSuite = base.override(models=_split(model), seq=_split(seq, int, "--seq"), dtype=_dtypes(dtype, "tp"),
                                     layers=None if custom else _tp_layers(ops), impls=_split(impl), iters=iters,
                                     warmup=warmup, tp=tp, shapes_tp=shapes_tp)
        configs = _configs("tp", config)
    except (SuiteError, ValueError) as e:
        _fail(str(e))
    if custom is None and cfg.shapes:  # a suite that lists its GEMMs (suites/tp-grid.yaml): as its --shapes
        custom = _suite_shapes(cfg, ops, **{"--model": model, "--seq": seq, "--shapes-tp": shapes_tp})
    from .tp import impls_at
    empty = [d for d in cfg.dtype if not impls_at(cfg.impls, d)]
    if empty:
        _fail(f"--impl {','.join(cfg.impls)}: none of them runs at {', '.join(empty)} (triton-dot-scaled is an "
              f"mxfp8 baseline, fp8-rowwise an 8-bit one, cublas-fp8-block an fp8-block one)")
    world, how = _world(cfg.tp, "--tp", dry_run)
    cases = _tp_cases(cfg, custom, world, how)
    host_mnk = _host_shape(host_shape, host_calls, [g.op for g in cases], world, how)
    for dtype, block in (("mxfp8", 32), ("fp8-block", 128)):  # scale blocks along each GEMM's K (per rank, RS)
        if dtype not in cfg.dtype:
            continue
        if host_calls and host_mnk[2] % block:
            _fail(f"--host-shape {'x'.join(map(str, host_mnk))}: --dtype {dtype} needs K to be a multiple of "
                  f"{block} (scale blocks of {block} along K); K={host_mnk[2]}")
        bad = [g for g in cases if g.k % block]
        if bad:
            _fail(f"--dtype {dtype} needs each GEMM's K to be a multiple of {block} (scale blocks of {block} along "
                  f"K); {bad[0].op} {bad[0].model} {bad[0].layer} {bad[0].m}x{bad[0].n}x{bad[0].k} has K={bad[0].k}")
    suite_dict = cfg.to_dict()
    if custom is not None:  # the suite as run: the custom shapes instead of the suite's models
        suite_dict.update(models=[CUSTOM], layers=[CUSTOM], seq=sorted({g.seq for g in cases}),
                          shapes=[{"op": g.op, "m": g.m, "n": g.n, "k": g.k} for g in cases])
    if cuda_graph:  # the suite as run (the env line) says so; bench_rank reads it
        suite_dict["cuda_graph"] = True
    suite_dict.update(host_calls=host_calls, host_shape=list(host_mnk))  # the host enqueue measurement (tp.HostCase)
    out = _out_path(out, "tp", "-".join(cfg.dtype), create=not dry_run)
    trace_dir = str(out.with_suffix("")) + "-traces" if trace else None
    n_impls = sum(len(impls_at(cfg.impls, d)) for d in cfg.dtype)
    if dry_run:
        _print_plan(
            f"kosmos bench tp --dry-run: {len(cases)} GEMMs x {n_impls} implementations"
            + (f" over {len(cfg.dtype)} dtypes" if len(cfg.dtype) > 1 else ""),
            [("world", f"{world} rank(s) ({how})"), ("dtype", ", ".join(cfg.dtype)),
             ("timing", f"{cfg.iters} iterations after {cfg.warmup} warm-up, fixed-role sweep "
                        f"{list(cfg.fixed_sweep)}" + (", CUDA graph replays" if cuda_graph else "")),
             ("host enqueue", _host_plan(host_mnk, host_calls, cases, cfg.dtype, n_impls)),
             ("config", _configs_text(configs)), ("results", f"would be appended to {out}"),
             *([("traces", trace_dir)] if trace_dir else [])],
            ("op", "model", "layer", "seq", "M", "N", "K"),
            [(g.op, g.model, g.layer, g.seq, g.m, g.n, g.k) for g in cases],
            [(f"tp, {d}", _planned_availability("tp", cfg.impls, world, d)) for d in cfg.dtype])
    shard_note = f" (GEMMs sized as at TP={cfg.shapes_tp})" if cfg.shapes_tp and cfg.shapes_tp != world else ""
    console.print(f"[bold]kosmos bench tp[/]: {len(cases)} shapes x {n_impls} implementations "
                  f"({', '.join(cfg.dtype)}) on {world} GPU(s){shard_note} -> {out}")
    from .tp import bench_rank
    _launch(bench_rank, world, out, suite_dict, [vars(c) for c in cases], str(out), trace_dir, sys.argv, configs)


def _host_plan(mnk, calls: int, cases, dtypes, n_impls: int) -> str:
    """The dry run's line on the host enqueue measurement (tp.HostCase) the run would make."""
    if not calls:
        return "off (--host-calls 0)"
    ops = list(dict.fromkeys(g.op for g in cases))
    return (f"{calls} back-to-back eager calls after 1 s of warm-up, at {'x'.join(map(str, mnk))} ({', '.join(ops)}),"
            f" for each (op, dtype, implementation) after its check: {len(ops) * n_impls} host rows")


MOE_HELP = "\n\n".join([
    "Check every MoE implementation against the fp32 reference, then time them side by side.",
    "A proxy of one model's MoE layer (its hidden size, expert FFN size, experts, top-k and router; experts split "
    "evenly over the EP ranks) runs with each implementation on the same inputs: kosmos (the one-launch fused "
    "layer), nccl-a2a (Megatron-style all-to-all + torch._grouped_mm, the speedup baseline), deepep (DeepEP "
    "dispatch/combine around the same GEMMs, when deep_ep is installed), fixed-role (16 programs dedicated to "
    "communication) and fixed-role-best (best split of a sweep). Each point also times the expert GEMMs alone: "
    "kosmos-expert-gemms vs grouped-mm (torch._grouped_mm) on the row counts each rank receives, in the forward "
    "and, at --direction bwd, the backward's four expert GEMMs (dgrad and wgrad of both).",
    "Routing: uniform (random inputs and router) or zipf:S (expert popularity ~ rank^-S, S > 0, made through the "
    "router itself; which experts are popular is a seeded shuffle). A failing implementation is recorded as "
    "failed with its reason and the sweep goes on (the command then exits 1 at the end); rows are appended to "
    "--out as they are measured.",
    "Examples:",
    "  kosmos bench moe                # suites/moe-default.yaml on all visible GPUs",
    "  kosmos bench moe --model qwen3-235b --tokens 4096,8192 --routing uniform,zipf:1.2 --ep 2",
    "  kosmos bench moe --model deepseek-v3 --impl kosmos,nccl-a2a --iters 50 --out results/moe.jsonl",
    "  kosmos bench moe --model deepseek-v3 --impl kosmos,nccl-a2a --config copy_cols=256,half_tail=false",
    "  kosmos bench moe --hidden 4096 --ffn 1024 --experts 64 --top-k 6 --tokens 8192 --ep 8 --dry-run",
    "  kosmos report results/moe.jsonl --format md",
    "A custom model (named 'custom' in the rows): --hidden, --ffn, --experts and --top-k together, optionally "
    "with --routing-kind sigmoid-grouped --n-group G --topk-group K, --routed-scaling and --no-renormalize; "
    "checked as kosmos.moe_forward checks its inputs (H and F multiples of 8, E <= 256 and divisible by the EP "
    "size, top_k <= min(E, 16), ...).",
])

# a custom MoE model's options: CustomShapeError field -> option
MOE_CUSTOM_OPTIONS = {"hidden": "--hidden", "ffn": "--ffn", "experts": "--experts", "top_k": "--top-k",
                      "routing": "--routing-kind", "n_group": "--n-group", "topk_group": "--topk-group",
                      "routed_scaling": "--routed-scaling", "renormalize": "--renormalize", "ep": "--ep"}
MOE_CUSTOM_REQUIRED = ("hidden", "ffn", "experts", "top_k")


def _custom_moe(model, ep, given: dict):
    """The custom MoEModel of the options in ``given`` (field -> value or None), None when none is given; a
    missing or bad value is a one-line error naming its option."""
    from kosmos.models import CustomShapeError, custom_moe_model
    set_ = [f for f, v in given.items() if v is not None]
    if not set_:
        return None
    shape = [f for f in set_ if f in MOE_CUSTOM_REQUIRED]
    opts = "/".join(MOE_CUSTOM_OPTIONS[f] for f in MOE_CUSTOM_REQUIRED)
    if not shape:
        _fail(f"{', '.join(MOE_CUSTOM_OPTIONS[f] for f in set_)}: router options of a custom model ({opts})")
    missing = [MOE_CUSTOM_OPTIONS[f] for f in MOE_CUSTOM_REQUIRED if given[f] is None]
    if missing:
        _fail(f"a custom model needs {', '.join(MOE_CUSTOM_OPTIONS[f] for f in MOE_CUSTOM_REQUIRED)} together; "
              f"missing {', '.join(missing)}")
    if model:
        _fail(f"--model and a custom model ({opts}) exclude each other: give one")
    kw = {f: v for f, v in given.items() if v is not None}
    kw["routing"] = kw.pop("routing", "softmax")
    try:
        return custom_moe_model(**kw, ep=ep)
    except CustomShapeError as e:
        _fail(f"{MOE_CUSTOM_OPTIONS.get(e.field, e.field)}: {e}")


@_command(bench_app, "moe", help=MOE_HELP)
def bench_moe(
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="MoE model(s), comma-separated or "
                                              "repeated: deepseek-v3, qwen3-235b, mixtral-8x7b, qwen2-57b."),
    tokens: Optional[List[str]] = typer.Option(None, "--tokens", "-t", help="Tokens per rank, e.g. 4096,8192."),
    ep: Optional[int] = typer.Option(None, "--ep", help="Expert-parallel size, 1 to 8 (default: all visible GPUs)."),
    routing: Optional[List[str]] = typer.Option(None, "--routing", "-r", help="uniform and/or zipf:S (S > 0), "
                                                "e.g. uniform,zipf:1.2."),
    dtype: Optional[str] = MOE_DTYPE_OPTION,
    direction: Optional[str] = MOE_DIRECTION_OPTION,
    impl: Optional[List[str]] = _impl_option("kosmos, nccl-a2a, deepep, fixed-role, fixed-role-best"),
    suite: Optional[Path] = _suite_option("moe"),
    iters: Optional[int] = _iters_option("moe"),
    warmup: Optional[int] = _warmup_option("moe"),
    out: Optional[Path] = _out_option("moe"),
    trace: bool = typer.Option(False, "--trace", help="Record a per-program task timeline of one kosmos forward "
                               "per point (bf16; JSON next to --out; draw with `kosmos report --timeline FILE`)."),
    expert_gemms: Optional[bool] = typer.Option(None, "--expert-gemms/--no-expert-gemms", help="Also time the "
                                                "expert GEMMs alone (kosmos-expert-gemms vs grouped-mm); default on."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the inputs, weights and popularity shuffle; "
                                     f"default: the suite's, {_suite_default('moe', 'seed')} in moe-default."),
    cuda_graph: bool = CUDA_GRAPH_OPTION,
    config: Optional[List[str]] = _config_option(
        "kosmos, fixed-role, fixed-role-best, kosmos-expert-gemms", "moe_fwd.copy_cols (a power of two >= 16), "
        "moe_fwd.half_tail (true/false); at --direction bwd and fwd+bwd also moe_bwd.FIELD, any field of the "
        "backward's config (kosmos.config's MoEBackwardConfig lists them), e.g. one_launch=false",
        "copy_cols=256 --config half_tail=false"),
    hidden: Optional[int] = typer.Option(None, "--hidden", help="Custom model: hidden size H (a multiple of 8)."),
    ffn: Optional[int] = typer.Option(None, "--ffn", help="Custom model: expert FFN size F (a multiple of 8)."),
    experts: Optional[int] = typer.Option(None, "--experts", help="Custom model: routed experts E (<= 256, "
                                          "divisible by the EP size)."),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="Custom model: experts per token (<= min(E, 16))."),
    routing_kind: Optional[str] = typer.Option(None, "--routing-kind", help="Custom model's router: softmax "
                                               "(default) or sigmoid-grouped (DeepSeek-V3 style, with --n-group "
                                               "and --topk-group)."),
    n_group: Optional[int] = typer.Option(None, "--n-group", help="Custom model, sigmoid-grouped: expert groups "
                                          "(E divisible by it)."),
    topk_group: Optional[int] = typer.Option(None, "--topk-group", help="Custom model, sigmoid-grouped: groups "
                                             "kept per token (<= --n-group)."),
    routed_scaling: Optional[float] = typer.Option(None, "--routed-scaling", help="Custom model: factor on the "
                                                   "routed experts' output (default 1)."),
    renormalize: Optional[bool] = typer.Option(None, "--renormalize/--no-renormalize", help="Custom model: "
                                               "renormalise the top-k gate weights (default on)."),
    dry_run: bool = DRY_RUN_OPTION,
):
    from .moe import EXPERT_IMPLS, case_model, moe_cases
    from .suites import MoESuite, SuiteError

    _check_ranks(ep, "--ep")
    _at_least(1, iters=iters, tokens=_split(tokens, int, "--tokens"))
    _at_least(0, warmup=warmup, seed=seed)
    try:
        base = _load_suite(suite, "moe")
    except SuiteError as e:
        _fail(str(e))
    custom = _custom_moe(model, ep if ep is not None else base.ep, dict(
        hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, routing=routing_kind, n_group=n_group,
        topk_group=topk_group, routed_scaling=routed_scaling, renormalize=renormalize))
    try:
        # a custom model's EP is checked against its own experts (the suite checks its models')
        cfg: MoESuite = base.override(models=_split(model), tokens=_split(tokens, int, "--tokens"),
                                      routing=_split(routing), dtype=_dtypes(dtype, "moe"),
                                      direction=_directions(direction), impls=_split(impl), iters=iters,
                                      warmup=warmup, ep=None if custom else ep, expert_gemms=expert_gemms, seed=seed)
        configs = _configs("moe", config)
    except (SuiteError, ValueError) as e:
        _fail(str(e))
    world, how = _world(ep if custom and ep is not None else cfg.ep, "--ep", dry_run)
    try:
        cases = moe_cases([custom] if custom else cfg.models, cfg.tokens, cfg.routing, world)
    except ValueError as e:
        _fail(str(e))
    if "mxfp8" in cfg.dtype:
        for c in cases:
            m = case_model(c)
            if m.hidden % 32 or m.expert_ffn % 32:
                _fail(f"--dtype mxfp8 needs hidden and ffn to be multiples of 32 (MX blocks); {m.name} has "
                      f"hidden={m.hidden}, ffn={m.expert_ffn}")
    suite_dict = cfg.to_dict()
    if custom:  # the suite as run: the custom model instead of the suite's models
        from dataclasses import asdict
        suite_dict.update(models=[custom.name], custom_model=asdict(custom), ep=world)
    if cuda_graph:
        suite_dict["cuda_graph"] = True
    out = _out_path(out, "moe", "-".join(cfg.dtype), create=not dry_run)
    trace_dir = str(out.with_suffix("")) + "-traces" if trace else None
    from .registry import impls_at
    # per (dtype, direction): (family, its implementations with a row there); the expert GEMMs alone run at bf16
    # and fwd only
    plan = [(d, g, f, impls_at(f, names, d, g)) for d in cfg.dtype for g in cfg.direction
            for f, names in ([("moe_experts", EXPERT_IMPLS)] if cfg.expert_gemms else []) + [("moe_fwd", cfg.impls)]]
    plan = [p for p in plan if p[3]]
    n_impls = sum(len(i) for _, _, f, i in plan if f == "moe_fwd")
    several = [what for what, values in (("dtype", cfg.dtype), ("direction", cfg.direction)) if len(values) > 1]
    if dry_run:
        ops = " + ".join(dict.fromkeys(f for _, _, f, _ in plan))
        points = []
        for c in cases:
            m = case_model(c)
            router = m.routing + (f" {m.n_group}/{m.topk_group} groups" if m.routing == "sigmoid-grouped" else "")
            points.append((m.name, c.tokens, c.routing, m.experts, m.experts // world, m.top_k, m.hidden,
                           m.expert_ffn, router))
        _print_plan(
            f"kosmos bench moe --dry-run: {len(cases)} points ({ops}) x "
            f"{sum(len(i) for _, _, _, i in plan)} implementations"
            + (f" over {len(cfg.dtype)} dtypes" if len(cfg.dtype) > 1 else "")
            + (f" over {len(cfg.direction)} directions" if len(cfg.direction) > 1 else ""),
            [("world", f"EP={world} rank(s) ({how})"), ("dtype", ", ".join(cfg.dtype)),
             ("direction", ", ".join(cfg.direction)),
             ("timing", f"{cfg.iters} iterations after {cfg.warmup} warm-up, fixed-role sweep "
                        f"{list(cfg.fixed_sweep)}" + (", CUDA graph replays" if cuda_graph else "")),
             ("seed", str(cfg.seed)),
             ("config", _configs_text(configs)), ("results", f"would be appended to {out}"),
             *([("traces", trace_dir)] if trace_dir else []),
             *([("backward check memory", _backward_check_memory(cases))]
               if world == 1 and set(cfg.direction) - {"fwd"} else [])],
            ("model", "tokens/rank", "routing", "E", "E/rank", "top_k", "H", "F", "router"), points,
            [(", ".join([f] + [{"dtype": d, "direction": g}[w] for w in several]),
              _planned_availability(f, i, world, d, g)) for d, g, f, i in plan])
    console.print(f"[bold]kosmos bench moe[/]: {len(cases)} points x {n_impls} implementations "
                  f"({', '.join(cfg.dtype)}; {', '.join(cfg.direction)}) on {world} GPU(s) (EP={world}) -> {out}")
    from .moe import bench_rank
    _launch(bench_rank, world, out, suite_dict, [vars(c) for c in cases], str(out), sys.argv, configs, trace_dir)


@_command(bench_app, "train")
def bench_train(
    model: str = typer.Option("llama3-8b", "--model", "-m", help="Dense (llama3-*) or MoE (deepseek-v3, "
                              "qwen3-235b) model."),
    layers: int = typer.Option(2, "--layers", help="Transformer blocks."),
    seq: int = typer.Option(4096, "--seq", "-s", help="Tokens per sequence (all ranks)."),
    batch: int = typer.Option(1, "--batch", "-b", help="Sequences per step (MoE: per rank)."),
    steps: int = typer.Option(20, "--steps", help="Recorded (timed) steps."),
    warmup: int = typer.Option(3, "--warmup", help="Unrecorded warm-up steps."),
    dtype: str = typer.Option("bf16", "--dtype", help="bf16 or mxfp8."),
    impl: Optional[str] = typer.Option(None, "--impl", help="Dense: nccl+cublas (the baseline), torch-async-tp, "
                                       "kosmos; MoE: nccl-a2a (the baseline), deepep, kosmos (comma-separated). "
                                       "Default: all of the model's kind (unavailable ones get a row saying why)."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Ranks, 1 to 8: the TP size (dense) or the EP size (MoE, "
                                     "attention data-parallel); default: all visible GPUs (MoE 1). "
                                     "KOSMOS_RANKS_ON_ONE_GPU=1 puts every rank on one GPU (gloo; a correctness "
                                     "run, not a timing)."),
    out: Optional[Path] = _out_option("train"),
    dry_run: bool = DRY_RUN_OPTION,
    hidden: Optional[int] = typer.Option(None, "--hidden", help="Scale the model to this hidden size."),
    scale: Optional[float] = typer.Option(None, "--scale", help="Scale hidden/ffn/heads, e.g. 0.0625."),
    head_dim: Optional[int] = typer.Option(None, "--head-dim", help="Override head_dim."),
    seed: int = typer.Option(0, "--seed", help="Seed of the weights and data."),
    hf: Optional[str] = typer.Option(None, "--hf", metavar="FAMILY", help="Train a real transformers model "
                                     "instead of the proxy: a family (qwen3_moe, mixtral, deepseek_v3, qwen2_moe) "
                                     "or a model (qwen3-30b-a3b, mixtral-8x7b, deepseek-v3, qwen3-235b, qwen2-57b) "
                                     "at its real hidden and expert sizes, --layers decoder layers, as transformers "
                                     "builds it (impl hf, the baseline), patched onto KOSMOS (impl kosmos: router "
                                     "and experts in one launch) and with KOSMOS as its experts implementation "
                                     "(impl kosmos-experts: transformers' router, routing given to KOSMOS). "
                                     "Needs transformers (pip install 'kosmos[hf]')."),
    experts: Optional[int] = typer.Option(None, "--experts", help="With --hf: the expert count (default the "
                                          "model's; deepseek-v3: 64 of its 256, for memory)."),
):
    """Train the end-to-end proxy with each implementation: step time, tokens/s per GPU, peak memory and
    every step's loss, which must agree with the baseline's within 2e-2 (kosmos_bench/train.py).
    With --hf, a real transformers MoE model instead, unpatched and patched (kosmos_bench/train_hf.py).

    Each implementation trains the same model on the same data: forward, backward and AdamW per step. One that
    cannot run here gets an "unavailable" row with the reason and fails nothing; one that raises or trains
    differently is recorded as failed with its reason, the others still run, and the command exits 1 at the end.
    Rows are appended to --out as they finish. With KOSMOS_RANKS_ON_ONE_GPU=1 more ranks than GPUs run, every
    rank on cuda:0 over gloo (loss agreement only; rows marked extra.ranks_on_one_gpu).

    Example: kosmos bench train --model llama3-8b --layers 2 --seq 4096 --tp 1 --steps 20
             kosmos bench train --hf qwen3_moe --layers 2 --seq 4096 --steps 10
    """
    from dataclasses import asdict

    from . import launcher
    if hf is not None:
        given = {"--model": model != "llama3-8b", "--scale": scale is not None, "--hidden": hidden is not None,
                 "--head-dim": head_dim is not None}
        return _bench_train_hf(hf, layers=layers, seq=seq, batch=batch, steps=steps, warmup=warmup, dtype=dtype,
                               impl=impl, tp=tp, out=out, dry_run=dry_run, seed=seed, experts=experts,
                               not_with_hf=[k for k, v in given.items() if v])
    if experts is not None:
        _fail("--experts goes with --hf (the proxies take the model's expert count)")
    from .train import BASELINE, DENSE_IMPLS, DTYPES, MOE_IMPLS, MOE_MODELS, proxy_shape, train_rank, \
        unavailable_reason

    if dtype not in DTYPES:
        _fail(f"--dtype {dtype!r}: choose from {', '.join(DTYPES)}")
    kind = "moe" if model in MOE_MODELS else "dense"
    known = MOE_IMPLS if kind == "moe" else DENSE_IMPLS
    impls = _split([impl] if impl else None) or known
    unknown = [n for n in impls if n not in known]
    if unknown:
        _fail(f"--impl {','.join(unknown)}: the {kind} proxy has {', '.join(known)}")
    _check_ranks(tp, "--tp")
    _at_least(1, steps=steps, layers=layers, seq=seq, batch=batch)
    _at_least(0, warmup=warmup)
    shape_kw = dict(model=model, layers=layers, seq=seq, batch=batch, scale=scale, hidden=hidden, head_dim=head_dim)
    try:  # what does not depend on the world size first
        proxy_shape(**shape_kw)
    except ValueError as e:
        _fail(str(e))
    world, how = _world(1 if tp is None and kind == "moe" else tp, "--tp", dry_run)
    if tp is None and kind == "moe":
        how = "the MoE proxy's default"
    try:
        shape = proxy_shape(**shape_kw, tp=world)
    except ValueError as e:
        _fail(f"{how}: {e}")
    out = _out_path(out, "train", dtype, create=not dry_run)
    gpus = launcher.visible_gpus()
    one_gpu = world > 1 and launcher.ranks_on_one_gpu()
    if dry_run:
        lines = ["kosmos bench train --dry-run"]
        lines += [f"  {k}: {v}" for k, v in asdict(shape).items() if v not in (None, {})]
        lines += [f"  world: {world} ({how})" + (" (EP; attention data-parallel, batch per rank)" if kind == "moe"
                                                  else ""),
                  f"  dtype: {dtype}", f"  steps: {steps} (+{warmup} warm-up)",
                  f"  results: would be appended to {out}"]
        if one_gpu:
            lines.append(f"  ranks: every rank on cuda:0 over gloo ({launcher.ONE_GPU_ENV}=1): loss agreement only, "
                         "the times are no measurement (rows: extra.ranks_on_one_gpu)")
        lines.append("implementations:")
        backend = None if world == 1 else ("gloo" if one_gpu or gpus == 0 else "nccl")
        for n in sorted(impls, key=lambda n: n != BASELINE[kind]):
            note = " (baseline)" if n == BASELINE[kind] else ""
            why = unavailable_reason(shape, n, world, dtype, device="cuda" if gpus else "cpu", backend=backend)
            if why:
                note += f" unavailable: {why}"
            lines.append(f"  {n}{note}")
        lines.append("dry run: nothing was launched or written; GPU-side checks (memory) happen at run time.")
        typer.echo("\n".join(lines))
        raise typer.Exit(0)
    st_kw = dict(impls=impls, steps=steps, warmup=warmup, dtype=dtype, seed=seed)
    console.print(f"[bold]kosmos bench train[/]: {model} proxy ({shape.layers} layers, hidden {shape.hidden}), "
                  f"{len(impls)} implementations ({dtype}) on {world} rank(s) -> {out}")
    _launch(train_rank, world, out, shape_kw, st_kw, str(out), list(sys.argv), table=False)


def _bench_train_hf(name: str, *, layers, seq, batch, steps, warmup, dtype, impl, tp, out, dry_run, seed, experts,
                    not_with_hf):
    """`bench train --hf`: the checks, the dry run, one process on one GPU (train_hf.train_hf_rank)."""
    from . import launcher
    from .train_hf import HF_BASELINE, HF_IMPLS, hf_shape

    if not_with_hf:
        _fail(f"{', '.join(not_with_hf)} and --hf: --hf trains the model at its real sizes (--layers, --seq, "
              f"--batch and --experts shape it)")
    if dtype != "bf16":
        _fail(f"--dtype {dtype} with --hf: the patched model trains in bf16 (kosmos.nn.MoE's backward is bf16)")
    if tp not in (None, 1):
        _fail(f"--tp {tp} with --hf: the transformers model trains on one GPU (the patch runs every expert on the "
              f"block's device)")
    impls = _split([impl] if impl else None) or list(HF_IMPLS)
    unknown = [n for n in impls if n not in HF_IMPLS]
    if unknown:
        _fail(f"--impl {','.join(unknown)}: --hf has {', '.join(HF_IMPLS)}")
    _at_least(1, steps=steps, layers=layers, seq=seq, batch=batch, experts=experts)
    _at_least(0, warmup=warmup)
    shape_kw = dict(model=name, layers=layers, seq=seq, batch=batch, experts=experts)
    try:
        shape = hf_shape(**shape_kw)
    except ValueError as e:
        _fail(str(e))
    out = out or Path("results") / f"train-hf-{shape.model}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out = _out_path(out, "train", dtype, create=not dry_run)
    if dry_run:
        lines = ["kosmos bench train --hf --dry-run",
                 f"  model: {shape.model} (transformers family {shape.family}), {shape.layers} decoder layers, "
                 f"{shape.n_experts} experts of {shape.spec.experts}, vocab {shape.vocab}",
                 f"  tokens: {shape.batch} x {shape.seq} a step; steps: {steps} (+{warmup} warm-up)",
                 f"  results: would be appended to {out}", "implementations:"]
        lines += [f"  {n}" + (" (baseline)" if n == HF_BASELINE else "") for n in
                  sorted(impls, key=lambda n: n != HF_BASELINE)]
        lines.append("dry run: nothing was built or written; transformers, the GPU and its memory are checked at "
                     "run time.")
        typer.echo("\n".join(lines))
        raise typer.Exit(0)
    if launcher.visible_gpus() == 0:
        _fail("--hf trains on a CUDA GPU; none is visible here (try --dry-run)")
    from .train_hf import train_hf_rank
    st_kw = dict(impls=tuple(impls), steps=steps, warmup=warmup, dtype=dtype, seed=seed)
    console.print(f"[bold]kosmos bench train --hf[/]: {shape.model} ({shape.family}, {shape.layers} layers, "
                  f"{shape.n_experts} experts), {len(impls)} implementations -> {out}")
    _launch(train_hf_rank, 1, out, shape_kw, st_kw, str(out), list(sys.argv), table=False)


@_command(app, "env")
def env():
    """Print what a bug report needs (versions, GPUs, topology).

    kosmos (version, git commit), Python, torch, CUDA, triton, NCCL, the driver, every GPU (name, memory, SMs),
    their peer access and `nvidia-smi topo -m`, and the NCCL_/KOSMOS_/... environment variables that are set.
    Without a GPU it says "no CUDA GPU" and exits 0.
    """
    from .envinfo import env_report
    typer.echo(env_report())


@_command(app, "report")
def report(
    files: List[Path] = typer.Argument(..., metavar="FILES", help="Result JSONL file(s); several are shown side by "
                                       "side. With --timeline: one trace JSON file."),
    format: str = typer.Option("text", "--format", "-f", help="text (terminal tables), md, csv or html."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write to this file instead of the terminal."),
    chart: Optional[Path] = typer.Option(None, "--chart", help="Also draw a speedup bar chart (PNG; needs "
                                         "matplotlib)."),
    timeline: bool = typer.Option(False, "--timeline", help="FILES is a trace from `bench --trace`: draw the "
                                  "per-program roles over time as a PNG Gantt chart, to --out (default: the "
                                  "trace's name with .png, in the current directory)."),
    wide: bool = typer.Option(False, "--wide", help="Text format: every column, the full reasons and every "
                              "section, as md and html have them (default: a compact view for 100 columns)."),
):
    """Render benchmark results anywhere, GPU or not.

    The headline first: the geometric means per implementation, the suite's targets judged, kosmos against
    the fastest other implementation. On the terminal (compact view) a line per shape: each implementation's
    time in ms and speedup over the baseline (nccl+cublas; MoE nccl-a2a, the expert GEMMs grouped-mm).
    --wide, md and html: per shape also TFLOP/s (per GPU), overlap efficiency (max(t_gemm, t_comm) / t),
    the NCCL collective's algorithm and bus bandwidth (nccl-tests' definitions), relative error and status.
    `--format csv` is the machine-readable contract: one row per (op, model, shape, impl). Folders of
    --out and --chart are created; messages go to stderr.
    """
    from .report import RENDER_FORMATS, ReportError, report_main
    if format not in RENDER_FORMATS:
        _fail(f"unknown --format {format!r}; choose from {', '.join(RENDER_FORMATS)}")
    try:
        if timeline:
            if len(files) != 1:
                _fail("--timeline takes exactly one trace file")
            png = out or Path.cwd() / files[0].with_suffix(".png").name  # never beside a committed trace
            code = report_main([str(files[0])], fmt=format, out=str(png), timeline=str(files[0]), status=console)
        else:
            code = report_main([str(f) for f in files], fmt=format, out=str(out) if out else None,
                               chart=str(chart) if chart else None, wide=wide, status=console)
    except ReportError as e:
        _fail(str(e))
    raise typer.Exit(code)


def main():  # console-script entry point
    app()


if __name__ == "__main__":
    main()
