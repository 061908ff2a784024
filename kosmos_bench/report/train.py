"""The report of ``kosmos bench train`` rows (bench "train", SCHEMA.md): the same parts as the other benches'
reports, one proxy (a TRAIN_GROUP) at a time, and the training figure (charts.loss_chart).

``train_table`` -- one row per (source, model, layers, seq, batch, hidden, world, dtype, impl) (a file holding the
same row twice: the last wins), with ``speedup`` = the baseline's median step time over this row's (the baseline:
the row marked ``baseline``, nccl+cublas for the dense proxy, nccl-a2a for the MoE proxy, of the same proxy,
world and dtype; > 1: faster; NaN unless both are "ok"). Train rows carry no op/m/n/k, so they are reported on
their own: ``kosmos report`` on a file of train rows renders this report (md, csv, html, text) and, with
``--chart``, the training figure instead of the speedup chart; a train file mixed with other benches' files is an
error naming the way out.

The human-readable formats give, in order: the environment of each run, the ratio convention, the headline per
proxy (each implementation's step-time speedup over the baseline, its losses against the baseline's against the
bar ``loss_rtol``), then a table per proxy, then the notes (the reasons of rows that are not ok, wrapped). The
terminal view leaves out the rows of implementations that were unavailable (a line names them) and the columns of
one value; ``wide`` keeps every row and column. csv is the machine-readable contract: every column, numbers as
numbers (``peak_mem_bytes`` an integer), ``losses`` a JSON list.
"""
from __future__ import annotations

import html
import io
import json
from pathlib import Path

import pandas as pd
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .charts import loss_chart
from .compact import COMPACT_WIDTH, WIDE_WIDTH, print_full_width, print_wrapped
from .files import writing
from .lines import RATIO_LINE, environment_lines
from .schema import ENV_COLUMNS, TRAIN_BASELINES, TRAIN_BENCH, TRAIN_COLUMNS, TRAIN_GROUP, ReportError

CSV_COLUMNS = [*TRAIN_COLUMNS, "step_p20_ms", "step_p80_ms", "loss_rtol", "losses"]
INTEGER_COLUMNS = ("layers", "seq", "batch", "hidden", "world", "peak_mem_bytes")
FLOAT_COLUMNS = ("step_ms", "step_p20_ms", "step_p80_ms", "tokens_per_s", "final_loss", "speedup",
                 "loss_max_rel_diff", "loss_rtol")
FORMATS = {"step_ms": "{:.2f}", "step_p20_ms": "{:.2f}", "step_p80_ms": "{:.2f}", "tokens_per_s": "{:,.0f}",
           "final_loss": "{:.5f}", "speedup": "{:.3f}x", "loss_max_rel_diff": "{:.2e}", "loss_rtol": "{:.0e}"}
HEADERS = {"step_ms": "step ms", "step_p20_ms": "p20 ms", "step_p80_ms": "p80 ms", "tokens_per_s": "tok/s/GPU",
           "peak_mem_bytes": "peak GiB", "final_loss": "final loss", "loss_max_rel_diff": "max rel dloss",
           "loss_rtol": "loss bar"}
# the table's columns: the compact view's, then what --wide, md and html add
SHOWN = ["impl", "step_ms", "tokens_per_s", "peak_mem_bytes", "final_loss", "speedup", "loss_max_rel_diff"]
WIDE = ["step_p20_ms", "step_p80_ms", "loss_rtol"]
STATUS_WORDS = {"failed": "failed", "unavailable": "n/a"}


def is_train(record: dict) -> bool:
    return record.get("bench") == TRAIN_BENCH


def train_table(results: list[dict]) -> pd.DataFrame:
    """The train rows of ``results`` as a table (module docstring); the ``losses`` list kept for the figure, the
    runs' environment (source and ENV_COLUMNS) in ``df.attrs["environment"]``."""
    rows, environment = {}, {}
    for r in results:
        if not is_train(r):
            continue
        row = {c: r.get(c) for c in TRAIN_COLUMNS if c != "speedup"}
        row.update(kind=r.get("kind") or "dense", baseline=bool(r.get("baseline", r.get("impl") in
                                                                    TRAIN_BASELINES.values())),
                   losses=list(r.get("losses") or []), step_p20_ms=r.get("step_p20_ms"),
                   step_p80_ms=r.get("step_p80_ms"), loss_rtol=r.get("loss_rtol"), steps=r.get("steps"),
                   ranks_on_one_gpu=bool((r.get("extra") or {}).get("ranks_on_one_gpu")),
                   hf_family=(r.get("extra") or {}).get("hf_family"), experts=r.get("experts"),
                   gpu=r.get("gpu"), gpu_count=r.get("gpu_count"), git_commit=r.get("git_commit"))
        rows[tuple(row[c] for c in TRAIN_GROUP) + (row["impl"],)] = row
        env = {c: r.get(c) for c in ("source", *ENV_COLUMNS)}
        environment[(env["source"], env["run_id"])] = env
    df = pd.DataFrame(list(rows.values()))
    if df.empty:
        df = pd.DataFrame(columns=CSV_COLUMNS + ["kind", "baseline"])
    else:
        speedups = []
        for _, row in df.iterrows():
            base = _baseline_row(_group_of(df, row))
            ok = row["status"] == "ok" and row["step_ms"] and base is not None
            speedups.append(base["step_ms"] / row["step_ms"] if ok else float("nan"))
        df["speedup"] = speedups
    for column in INTEGER_COLUMNS:
        df[column] = pd.to_numeric(df[column], errors="coerce").round().astype("Int64")
    for column in FLOAT_COLUMNS:
        df[column] = pd.to_numeric(df[column], errors="coerce").astype("float64")
    df.attrs["environment"] = list(environment.values())
    return df


def _group_of(df: pd.DataFrame, row) -> pd.DataFrame:
    """The rows of ``row``'s proxy (TRAIN_GROUP; a missing value matches a missing value)."""
    same = df
    for c in TRAIN_GROUP:
        same = same[same[c].isna()] if pd.isna(row[c]) else same[same[c] == row[c]]
    return same


def _baseline_row(group: pd.DataFrame):
    """The baseline of a proxy when it ran ok with a step time, else None."""
    base = group[group["baseline"].astype(bool) & (group["status"] == "ok") & group["step_ms"].notna()]
    return None if base.empty else base.iloc[0]


def _groups(df: pd.DataFrame) -> list[pd.DataFrame]:
    """The table split per proxy (TRAIN_GROUP), in order of first appearance."""
    if df.empty:
        return []
    return [group for _, group in df.groupby(list(TRAIN_GROUP), sort=False, dropna=False)]


def _missing(value) -> bool:
    return value is None or (not isinstance(value, (str, list)) and pd.isna(value))


def _cell(column: str, value) -> str:
    """A cell of md, html and the terminal: "" for missing, FORMATS, peak memory in GiB."""
    if _missing(value):
        return ""
    if column == "peak_mem_bytes":
        return f"{value / 2**30:.2f}"
    fmt = FORMATS.get(column)
    return fmt.format(value) if fmt and isinstance(value, (int, float)) else str(value)


def _proxy_title(group: pd.DataFrame) -> str:
    """What one proxy is, e.g. "llama3-8b training proxy: 2 layers, seq 4096, batch 1, hidden 4096 | world 1 |
    bf16", or for `bench train --hf` rows "qwen3-30b-a3b as transformers builds it (qwen3_moe, 128 experts): ..."
    (the source first where a report holds several)."""
    row = group.iloc[0]
    shape = ", ".join(f"{word} {_cell(column, row[column])}" if word else f"{_cell(column, row[column])} layers"
                      for column, word in (("layers", ""), ("seq", "seq"), ("batch", "batch"), ("hidden", "hidden"))
                      if not _missing(row[column]))
    what = "training proxy"
    if not _missing(row.get("hf_family")):  # bench train --hf: the transformers model itself
        what = f"as transformers builds it ({row['hf_family']}, {_cell('experts', row.get('experts'))} experts)"
    return f"{row['model']} {what}: {shape} | world {_cell('world', row['world'])} | {row['dtype']}"


def headline_lines(df: pd.DataFrame) -> list[str]:
    """Per proxy: each implementation's speedup over the baseline (its median step time over theirs) with both step
    times, then how far its losses are from the baseline's against ``loss_rtol``; unavailable implementations
    left out, failed ones said, ranks that shared one GPU said (their step times are not measurements). Where a
    report holds several proxies, each line starts with what tells its proxy apart (e.g. the dtype)."""
    varying = [c for c in TRAIN_GROUP if df[c].nunique(dropna=False) > 1]
    lines = []
    for group in _groups(df):
        row0 = group.iloc[0]
        label = " ".join(f"{c if c not in ('source', 'model', 'dtype') else ''}{_cell(c, row0[c])}".strip()
                         for c in varying)
        label = f"{label}: " if label else ""
        base = _baseline_row(group)
        others = group[~group["baseline"].astype(bool) & (group["status"] != "unavailable")]
        named = group[group["baseline"].astype(bool)]["impl"]
        name = named.iloc[0] if len(named) else TRAIN_BASELINES.get(row0["kind"], "the baseline")
        if base is None:
            lines.append(f"{label}no step-time speedup: {name} has no ok row")
        else:
            parts = [f"{row['impl']} {row['speedup']:.3f}x ({row['step_ms']:.2f} ms)" if not pd.isna(row["speedup"])
                     else f"{row['impl']} {row['status']}" for _, row in others.iterrows()]
            shared = " (the ranks shared one GPU: step times are not measurements)" \
                if group["ranks_on_one_gpu"].any() else ""
            lines.append(f"{label}Step-time speedup over {name} ({base['step_ms']:.2f} ms per step){shared}: "
                         + (", ".join(parts) or "no other implementation ran"))
        losses = [row for _, row in others.iterrows() if not pd.isna(row["loss_max_rel_diff"])]
        if losses:
            steps = group["steps"].dropna()
            over = f" over the {int(steps.iloc[0])} steps" if len(steps) else ""
            verdicts = []
            for row in losses:
                rtol = row["loss_rtol"]
                within = "within" if row["loss_max_rel_diff"] <= rtol else "over"
                verdict = "" if pd.isna(rtol) else f", {within} the bar {rtol:.0e}"
                verdicts.append(f"{row['impl']} {row['loss_max_rel_diff']:.2e}{verdict}")
            lines.append(f"{label}Loss against {name}'s, largest relative difference{over}: " + "; ".join(verdicts))
    return lines


def _notes(df: pd.DataFrame) -> dict[tuple, int]:
    """The reasons of the rows that are not ok, numbered: {(impl, status, reason): number}."""
    notes: dict[tuple, int] = {}
    for _, row in df[df["status"] != "ok"].iterrows():
        notes.setdefault((row["impl"], row["status"], row["reason"] or "no reason recorded"), len(notes) + 1)
    return notes


def _note_lines(notes: dict[tuple, int]) -> list[str]:
    return [f"[{number}] {impl} {status}: {reason}" for (impl, status, reason), number in notes.items()]


def _columns(group: pd.DataFrame, wide: bool) -> list[str]:
    """The table's columns: SHOWN (wide: and WIDE), without those that are empty in every row, a status column
    where some row is not ok."""
    columns = SHOWN + (WIDE if wide else [])
    columns = [c for c in columns if c == "impl" or group[c].notna().any()]
    return columns + (["status"] if (group["status"] != "ok").any() else [])


def _rows(group: pd.DataFrame, wide: bool) -> tuple[pd.DataFrame, list[str]]:
    """The rows a table shows (without ``wide``: not those of unavailable implementations) and the names left
    out."""
    if wide:
        return group, []
    unavailable = group["status"] == "unavailable"
    return group[~unavailable], list(group[unavailable]["impl"])


def _status_cell(row, notes: dict[tuple, int]) -> str:
    if row["status"] == "ok":
        return "ok"
    number = notes[(row["impl"], row["status"], row["reason"] or "no reason recorded")]
    return f"{STATUS_WORDS.get(row['status'], row['status'])} [{number}]"


def _cells(group: pd.DataFrame, columns: list[str], notes: dict[tuple, int]) -> list[list[str]]:
    return [[_status_cell(row, notes) if c == "status" else _cell(c, row[c]) for c in columns]
            for _, row in group.iterrows()]


def _environment(df: pd.DataFrame) -> pd.DataFrame:
    return pd.DataFrame(df.attrs.get("environment", []), columns=["source", *ENV_COLUMNS])


def render_train(df: pd.DataFrame, fmt: str, wide: bool = False) -> str:
    """The training report as "md", "csv" (every column, numbers as numbers, losses as a JSON list), "html" or
    "text" (the terminal view at 100 columns, ``wide`` every row and column at 250)."""
    if fmt == "csv":
        return _render_csv(df)
    notes = _notes(df)
    if fmt == "md":
        env = _environment(df)
        lines = ["# KOSMOS training proxy report", "", "## Environment", "",
                 "| " + " | ".join(env.columns) + " |", "| " + " | ".join("---" for _ in env.columns) + " |"]
        lines += ["| " + " | ".join(_cell(c, v) for c, v in row.items()) + " |" for _, row in env.iterrows()]
        lines += ["", RATIO_LINE, ""]
        for line in headline_lines(df):
            lines += [line, ""]
        for group in _groups(df):
            columns = _columns(group, wide=True)
            lines += [f"## {_proxy_title(group)}", "", "| " + " | ".join(HEADERS.get(c, c) for c in columns) + " |",
                      "| " + " | ".join("---" for _ in columns) + " |"]
            lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |"
                      for row in _cells(group, columns, notes)]
            lines.append("")
        lines += [f"{line}  " for line in _note_lines(notes)]
        return "\n".join(lines).rstrip() + "\n"
    if fmt == "html":
        parts = ['<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>KOSMOS training proxy report'
                 '</title></head><body>', "<h1>KOSMOS training proxy report</h1>"]
        parts += [f"<p>{html.escape(line)}</p>" for line in [*environment_lines(_environment(df)), RATIO_LINE,
                                                             *headline_lines(df)]]
        for group in _groups(df):
            columns = _columns(group, wide=True)
            head = "".join(f"<th>{html.escape(HEADERS.get(c, c))}</th>" for c in columns)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>"
                           for row in _cells(group, columns, notes))
            parts += [f"<h2>{html.escape(_proxy_title(group))}</h2>",
                      f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"]
        parts += [f"<p>{html.escape(line)}</p>" for line in _note_lines(notes)]
        return "\n".join([*parts, "</body></html>", ""])
    if fmt == "text":
        buffer = io.StringIO()
        print_train(df, Console(file=buffer, width=WIDE_WIDTH if wide else COMPACT_WIDTH, color_system=None,
                                force_terminal=False), wide=wide)
        return buffer.getvalue()
    raise ReportError(f"unknown format {fmt!r}")


def _render_csv(df: pd.DataFrame) -> str:
    out = pd.DataFrame({c: df[c] if c in df else None for c in CSV_COLUMNS})
    out["losses"] = [json.dumps(list(v)) if isinstance(v, list) else "" for v in out["losses"]]
    return out.to_csv(index=False, lineterminator="\n")


def print_train(df: pd.DataFrame, console: Console, wide: bool = False) -> None:
    """The training report on a rich console: the environment, the ratio convention, the headline lines, a table
    per proxy, the notes, wrapped at the console's width. Without ``wide`` the table leaves out the rows of
    unavailable implementations (a line names them) and fits the console; with ``wide`` it has every row and
    column, as wide as its cells need."""
    for line in [*environment_lines(_environment(df), short_commit=not wide), RATIO_LINE]:
        print_wrapped(console, line)
    for line in headline_lines(df):
        print_wrapped(console, line, style="bold")
    notes = _notes(df)
    for group in _groups(df):
        print_wrapped(console, _proxy_title(group), style="bold")
        shown, left_out = _rows(group, wide)
        columns = _columns(shown, wide)
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
        for c in columns:
            table.add_column(HEADERS.get(c, c), justify="left" if c in ("impl", "status") else "right",
                             overflow="fold")
        for cells, (_, row) in zip(_cells(shown, columns, notes), shown.iterrows()):
            style = "red" if row["status"] == "failed" else "yellow" if row["status"] != "ok" else ""
            table.add_row(*cells, style=style)
        if wide:
            print_full_width(console, table)
        else:
            console.print(table)
        if left_out:
            numbers = [notes[(row["impl"], row["status"], row["reason"] or "no reason recorded")]
                       for _, row in group[group["impl"].isin(left_out)].iterrows()]
            print_wrapped(console, "unavailable, no row: " + ", ".join(f"{impl} [{number}]" for impl, number
                                                                      in zip(left_out, numbers)))
    for line in _note_lines(notes):
        print_wrapped(console, line)
    if not wide:
        console.print(Text("Every row and column: kosmos report FILE --wide (or --format md, html, csv)",
                           style="dim"))


def train_report_main(results: list[dict], fmt: str, out, chart, console, say, wide: bool = False) -> int:
    """``kosmos report`` on train rows (render.report_main hands them here): the report, and the training figure
    to ``chart``."""
    if not all(is_train(r) for r in results):
        raise ReportError("train rows (kosmos bench train) are reported on their own: pass the train results file "
                          "without other benches' files")
    df = train_table(results)
    if out is not None:
        text = render_train(df, fmt, wide=wide)
        writing(Path(out), lambda: Path(out).write_text(text, encoding="utf-8"))
        say(f"{fmt} report written to {out}")
    elif fmt == "text":
        print_train(df, console, wide=wide)
    else:
        console.out(render_train(df, fmt, wide=wide), highlight=False, end="")
    if chart is not None:
        written = writing(Path(chart), lambda: loss_chart(df, chart))
        say(f"training figure written to {chart}" if written else "matplotlib missing: no training figure")
    return 0
