"""The ``kosmos`` command line: ``kosmos bench tp``, ``kosmos bench moe``, ``kosmos report``."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console

app = typer.Typer(add_completion=False, no_args_is_help=True, help=(
    "KOSMOS: self-scheduling fused communication+GEMM kernels for tensor/sequence and expert parallelism, "
    "and the benchmark that compares them with what you run today.\n\n"
    "  kosmos bench tp                      # default TP suite on all visible GPUs\n\n"
    "  kosmos bench tp --model llama3-70b --seq 4096,8192 --tp 2\n\n"
    "  kosmos bench moe --model deepseek-v3 --tokens 4096 --routing uniform,zipf:1.2\n\n"
    "  kosmos report results/h200x2/tp-bf16.jsonl --format md"))
bench_app = typer.Typer(no_args_is_help=True, help="Check and time fused ops against baselines on this node's GPUs.")
app.add_typer(bench_app, name="bench")
console = Console(stderr=True)


def _split(values: Optional[List[str]], cast=str):
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
                    raise typer.BadParameter(f"{part!r} is not a valid {cast.__name__}") from None
    return tuple(out)


def _dtype_and_world(dtype: str, asked):
    """Exit with a clear message for a dtype not implemented yet or a world the machine cannot give."""
    from . import launcher
    from .suites import SUPPORTED_DTYPES
    if dtype not in SUPPORTED_DTYPES:
        _fail(f"--dtype {dtype} is not implemented yet (MXFP8 kernels are planned); use --dtype bf16")
    try:
        return launcher.check_world(asked)
    except launcher.LaunchError as e:
        _fail(str(e))


def _configs(bench: str, items):
    """``--config`` values -> {op: config} for ``bench`` (ValueError with one line naming a bad key or value)."""
    from .registry import CONFIG_TYPES, parse_config
    return parse_config(_split(items), CONFIG_TYPES[bench])


CONFIG_HELP = ("Set a field of an op's config for the KOSMOS implementations ({impls}): KEY=VALUE, repeated or "
               "comma-separated. KEY is OP.FIELD ({keys}) or FIELD alone when one op has it. Every row records "
               "the config it ran with. E.g. --config {example}")


def _fail(msg: str, code: int = 2):
    console.print(f"[bold red]error:[/] {msg}")
    raise typer.Exit(code)


# the options both benches take (help texts naming the bench's own defaults)
DTYPE_OPTION = typer.Option(None, "--dtype", help="bf16 (mxfp8 is planned).")
ITERS_OPTION = typer.Option(None, "--iters", help="Timed iterations per implementation (median reported).")
WARMUP_OPTION = typer.Option(None, "--warmup", help="Untimed warm-up iterations.")


def _suite_option(bench: str):
    return typer.Option(None, "--suite", help=f"YAML suite file (default: suites/{bench}-default.yaml).")


def _out_option(bench: str):
    return typer.Option(None, "--out", "-o", help=f"JSONL file to append to (default: "
                        f"results/{bench}-<dtype>-<timestamp>.jsonl).")


def _impl_option(names: str):
    return typer.Option(None, "--impl", help=f"{names} (comma-separated).")


def _config_option(impls: str, keys: str, example: str):
    return typer.Option(None, "--config", "-c", help=CONFIG_HELP.format(impls=impls, keys=keys, example=example))


def _out_path(out: Optional[Path], bench: str, dtype: str) -> Path:
    out = out or Path("results") / f"{bench}-{dtype}-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


def _launch(rank_fn, world: int, out: Path, *args):
    """Run ``rank_fn(rank, world, *args)`` on every rank, then show the table of ``out`` (rank 0)."""
    from . import launcher
    try:
        launcher.spawn(rank_fn, world, *args)
    except launcher.LaunchError as e:
        _fail(f"{e}\npartial results (if any) are in {out}", code=1)
    if launcher.under_torchrun() and int(os.environ["RANK"]) != 0:
        return  # under torchrun every rank runs this command; rank 0 wrote the file and shows the table
    from .report import build_table, load_results, print_terminal
    print_terminal(build_table(load_results([out])[1]), console=Console())
    console.print(f"results: {out}  (render again with `kosmos report {out}`)")


@bench_app.command("tp")
def bench_tp(
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="Model(s), comma-separated or repeated: "
                                              "llama3-8b, llama3-70b, llama3-405b, gpt3-175b."),
    seq: Optional[List[str]] = typer.Option(None, "--seq", "-s", help="Token counts per layer (M), e.g. 4096,8192."),
    tp: Optional[int] = typer.Option(None, "--tp", help="Tensor-parallel size (default: all visible GPUs)."),
    shapes_tp: Optional[int] = typer.Option(None, "--shapes-tp", help="Size the GEMMs as at TP=N (each rank's "
                                            "weight shard) whatever --tp is: `--tp 1 --shapes-tp 2` times the "
                                            "kernels with communication off on the per-rank GEMMs of a TP=2 run."),
    dtype: Optional[str] = DTYPE_OPTION,
    op: Optional[List[str]] = typer.Option(None, "--op", help="ag_gemm, gemm_rs, or layer names qkv,fc1,attn_out,fc2."),
    impl: Optional[List[str]] = _impl_option("kosmos, nccl+cublas, torch-async-tp, fixed-role, fixed-role-best"),
    suite: Optional[Path] = _suite_option("tp"),
    iters: Optional[int] = ITERS_OPTION,
    warmup: Optional[int] = WARMUP_OPTION,
    out: Optional[Path] = _out_option("tp"),
    trace: bool = typer.Option(False, "--trace", help="Record a per-program task timeline of each kosmos run "
                               "(JSON next to --out; draw with `kosmos report --timeline FILE`)."),
    config: Optional[List[str]] = _config_option(
        "kosmos, fixed-role, fixed-role-best", "ag_gemm.push_chunks (an integer >= 1 or auto), ag_gemm.copy_block, "
        "gemm_rs.push_partials (true/false)", "push_chunks=auto --config push_partials=true"),
):
    """Check every implementation against the fp32 reference, then time them side by side.

    Each (model, layer, seq) shape runs every implementation on the same random inputs; a failing one is
    recorded as failed with its reason and the sweep goes on. Rows are appended to --out as they finish.

    Example (an A/B of a config field, one file each): kosmos bench tp --model llama3-70b --op ag_gemm
    --impl kosmos,nccl+cublas --config ag_gemm.push_chunks=auto --out results/ag-auto.jsonl
    """
    from kosmos.models import TP_LAYERS

    from .suites import SuiteError, TPSuite, default_suite, load_suite

    try:
        base = load_suite(suite) if suite else default_suite()
        layers = None
        if op:
            names = _split(op)
            by_op = {"ag_gemm": ("qkv", "fc1"), "gemm_rs": ("attn_out", "fc2")}
            layers = tuple(dict.fromkeys(l for n in names for l in by_op.get(n, (n,))))
            bad = [l for l in layers if l not in TP_LAYERS]
            if bad:
                raise SuiteError(f"unknown --op {bad}; use ag_gemm, gemm_rs or {', '.join(TP_LAYERS)}")
        cfg: TPSuite = base.override(models=_split(model), seq=_split(seq, int), dtype=dtype, layers=layers,
                                     impls=_split(impl), iters=iters, warmup=warmup, tp=tp,
                                     shapes_tp=shapes_tp)
        configs = _configs("tp", config)
    except (SuiteError, ValueError) as e:
        _fail(str(e))
    world = _dtype_and_world(cfg.dtype, cfg.tp)
    from kosmos.models import tp_gemms
    try:
        shard = cfg.shapes_tp or world
        cases = [g for m in cfg.models for s in cfg.seq for g in tp_gemms(m, s, shard, cfg.layers)]
        if shard != world:  # the sequence is split over the real world (SP), the weight over ``shard``
            bad = sorted({g.seq for g in cases if g.seq % world})
            if bad:
                raise ValueError(f"seq {bad} must divide by the world size {world}")
    except ValueError as e:
        _fail(str(e))
    out = _out_path(out, "tp", cfg.dtype)
    trace_dir = str(out.with_suffix("")) + "-traces" if trace else None
    shard_note = f" (GEMMs sized as at TP={cfg.shapes_tp})" if cfg.shapes_tp and cfg.shapes_tp != world else ""
    console.print(f"[bold]kosmos bench tp[/]: {len(cases)} shapes x {len(cfg.impls)} implementations on "
                  f"{world} GPU(s){shard_note} -> {out}")
    from .tp import bench_rank
    _launch(bench_rank, world, out, cfg.to_dict(), [vars(c) for c in cases], str(out), trace_dir, sys.argv, configs)


MOE_HELP = "\n\n".join([
    "Check every MoE implementation against the fp32 reference, then time them side by side.",
    "A proxy of one model's MoE layer (its hidden size, expert FFN size, experts, top-k and router; experts split "
    "evenly over the EP ranks) runs with each implementation on the same inputs: kosmos (the one-launch fused "
    "layer), nccl-a2a (Megatron-style all-to-all + torch._grouped_mm, the speedup baseline), deepep (DeepEP "
    "dispatch/combine around the same GEMMs, when deep_ep is installed), fixed-role (16 programs dedicated to "
    "communication) and fixed-role-best (best split of a sweep). Each point also times the expert GEMMs alone: "
    "kosmos-expert-gemms vs grouped-mm (torch._grouped_mm) on the row counts each rank receives.",
    "Routing: uniform (random inputs and router) or zipf:S (expert popularity ~ rank^-S, S > 0, made through the "
    "router itself; which experts are popular is a seeded shuffle). A failing implementation is recorded as "
    "failed with its reason and the sweep goes on; rows are appended to --out as they are measured.",
    "Examples:",
    "  kosmos bench moe                # suites/moe-default.yaml on all visible GPUs",
    "  kosmos bench moe --model qwen3-235b --tokens 4096,8192 --routing uniform,zipf:1.2 --ep 2",
    "  kosmos bench moe --model deepseek-v3 --impl kosmos,nccl-a2a --iters 50 --out results/moe.jsonl",
    "  kosmos bench moe --model deepseek-v3 --impl kosmos,nccl-a2a --config copy_cols=256,half_tail=false",
    "  kosmos report results/moe.jsonl --format md",
])


@bench_app.command("moe", help=MOE_HELP)
def bench_moe(
    model: Optional[List[str]] = typer.Option(None, "--model", "-m", help="MoE model(s), comma-separated or "
                                              "repeated: deepseek-v3, qwen3-235b, mixtral-8x7b, qwen2-57b."),
    tokens: Optional[List[str]] = typer.Option(None, "--tokens", "-t", help="Tokens per rank, e.g. 4096,8192."),
    ep: Optional[int] = typer.Option(None, "--ep", help="Expert-parallel size (default: all visible GPUs)."),
    routing: Optional[List[str]] = typer.Option(None, "--routing", "-r", help="uniform and/or zipf:S (S > 0), "
                                                "e.g. uniform,zipf:1.2."),
    dtype: Optional[str] = DTYPE_OPTION,
    impl: Optional[List[str]] = _impl_option("kosmos, nccl-a2a, deepep, fixed-role, fixed-role-best"),
    suite: Optional[Path] = _suite_option("moe"),
    iters: Optional[int] = ITERS_OPTION,
    warmup: Optional[int] = WARMUP_OPTION,
    out: Optional[Path] = _out_option("moe"),
    expert_gemms: Optional[bool] = typer.Option(None, "--expert-gemms/--no-expert-gemms", help="Also time the "
                                                "expert GEMMs alone (kosmos-expert-gemms vs grouped-mm); default on."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the inputs, weights and popularity shuffle."),
    config: Optional[List[str]] = _config_option(
        "kosmos, fixed-role, fixed-role-best, kosmos-expert-gemms", "moe_fwd.copy_cols (a power of two >= 16), "
        "moe_fwd.half_tail (true/false)", "copy_cols=256 --config half_tail=false"),
):
    from .moe import moe_cases
    from .suites import MoESuite, SuiteError, default_moe_suite, load_suite

    try:
        base = load_suite(suite, bench="moe") if suite else default_moe_suite()
        cfg: MoESuite = base.override(models=_split(model), tokens=_split(tokens, int), routing=_split(routing),
                                      dtype=dtype, impls=_split(impl), iters=iters, warmup=warmup, ep=ep,
                                      expert_gemms=expert_gemms, seed=seed)
        configs = _configs("moe", config)
    except (SuiteError, ValueError) as e:
        _fail(str(e))
    world = _dtype_and_world(cfg.dtype, cfg.ep)
    try:
        cases = moe_cases(cfg.models, cfg.tokens, cfg.routing, world)
    except ValueError as e:
        _fail(str(e))
    out = _out_path(out, "moe", cfg.dtype)
    console.print(f"[bold]kosmos bench moe[/]: {len(cases)} points x {len(cfg.impls)} implementations on "
                  f"{world} GPU(s) (EP={world}) -> {out}")
    from .moe import bench_rank
    _launch(bench_rank, world, out, cfg.to_dict(), [vars(c) for c in cases], str(out), sys.argv, configs)


@app.command("report")
def report(
    files: List[Path] = typer.Argument(..., help="Result JSONL file(s); several are shown side by side. With "
                                       "--timeline: one trace JSON file."),
    format: str = typer.Option("text", "--format", "-f", help="text (terminal tables), md, csv or html."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write to this file instead of the terminal."),
    chart: Optional[Path] = typer.Option(None, "--chart", help="Also draw a speedup bar chart (PNG; needs "
                                         "matplotlib)."),
    timeline: bool = typer.Option(False, "--timeline", help="FILES is a trace from `bench --trace`: draw the "
                                  "per-program roles over time as a PNG Gantt chart (to --out)."),
):
    """Render benchmark results anywhere, GPU or not.

    Per shape: time, TFLOP/s (per GPU), speedup vs nccl+cublas, overlap efficiency
    (max(t_gemm, t_comm) / t), relative error and status; then the geometric mean per implementation,
    the workspace memory, and kosmos against the fastest other implementation of each shape (its time /
    kosmos's: > 1 = kosmos faster). `--format csv` is the machine-readable contract: one row per
    (op, model, shape, impl).
    """
    from .report import RENDER_FORMATS, ReportError, report_main
    if format not in RENDER_FORMATS:
        _fail(f"unknown --format {format!r}; choose from {', '.join(RENDER_FORMATS)}")
    try:
        if timeline:
            if len(files) != 1:
                _fail("--timeline takes exactly one trace file")
            code = report_main([str(files[0])], fmt=format, out=str(out) if out else None,
                               timeline=str(files[0]))
        else:
            code = report_main([str(f) for f in files], fmt=format, out=str(out) if out else None,
                               chart=str(chart) if chart else None)
    except ReportError as e:
        _fail(str(e))
    raise typer.Exit(code)


def main():  # console-script entry point
    app()


if __name__ == "__main__":
    main()
