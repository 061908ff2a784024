"""The report of ``kosmos bench train`` rows (bench "train", SCHEMA.md): a table per training proxy and the
loss-curve figure (charts.loss_chart).

``train_table`` -- one row per (source, model, layers, seq, batch, hidden, world, dtype, impl) (a file holding the
same row twice: the last wins), with ``speedup`` = the baseline's median step time over this row's (the baseline:
the row marked ``baseline``, nccl+cublas for the dense proxy, nccl-a2a for the MoE proxy, of the same proxy,
world and dtype; > 1: faster; NaN unless both are "ok"). Train rows carry no op/m/n/k, so they are reported on
their own: ``kosmos report`` on a file of train rows renders this table (md, csv, html, text) and, with
``--chart``, the loss figure instead of the speedup chart; a train file mixed with other benches' files is an
error naming the way out.
"""
from __future__ import annotations

import html
import io
import json
from pathlib import Path

import pandas as pd

from .charts import loss_chart
from .files import writing
from .schema import TRAIN_BASELINES, TRAIN_BENCH, TRAIN_COLUMNS, TRAIN_GROUP, ReportError

TRAIN_FORMATS = {"step_ms": "{:.2f}", "tokens_per_s": "{:.0f}", "final_loss": "{:.5f}", "speedup": "{:.3f}",
                 "loss_max_rel_diff": "{:.2e}"}
SHORT = {"step_ms": "step ms", "tokens_per_s": "tok/s/GPU", "peak_mem_bytes": "peak mem", "final_loss": "final loss",
         "loss_max_rel_diff": "max rel dloss"}  # the terminal's column headers
TITLE = "Training proxy: step time, tokens/s per GPU, peak memory, final loss (speedup: baseline step / step)"


def is_train(record: dict) -> bool:
    return record.get("bench") == TRAIN_BENCH


def train_table(results: list[dict]) -> pd.DataFrame:
    """The train rows of ``results`` as a table (module docstring); the ``losses`` list kept for the figure."""
    rows = {}
    for r in results:
        if not is_train(r):
            continue
        row = {c: r.get(c) for c in TRAIN_COLUMNS if c != "speedup"}
        row.update(kind=r.get("kind") or "dense", baseline=bool(r.get("baseline", r.get("impl") in
                                                                    TRAIN_BASELINES.values())),
                   losses=list(r.get("losses") or []), step_p20_ms=r.get("step_p20_ms"),
                   step_p80_ms=r.get("step_p80_ms"), gpu=r.get("gpu"), git_commit=r.get("git_commit"))
        rows[tuple(row[c] for c in TRAIN_GROUP) + (row["impl"],)] = row
    df = pd.DataFrame(list(rows.values()))
    if df.empty:
        return pd.DataFrame(columns=TRAIN_COLUMNS + ["kind", "baseline", "losses"])
    speedups = []
    for _, row in df.iterrows():
        same = df
        for c in TRAIN_GROUP:
            same = same[same[c].isna()] if pd.isna(row[c]) else same[same[c] == row[c]]
        base = same[same["baseline"] & (same["status"] == "ok")]
        ok = row["status"] == "ok" and row["step_ms"] and not base.empty and base.iloc[0]["step_ms"]
        speedups.append(base.iloc[0]["step_ms"] / row["step_ms"] if ok else float("nan"))
    df["speedup"] = speedups
    return df


def _cell(column: str, value) -> str:
    if isinstance(value, list):
        return json.dumps(value)
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return ""
    if column == "peak_mem_bytes":
        return f"{value / 2**30:.2f} GiB" if value else "0"
    fmt = TRAIN_FORMATS.get(column)
    return fmt.format(value) if fmt and isinstance(value, (int, float)) else str(value)


def _columns(df: pd.DataFrame) -> list[str]:
    """The display columns: those of one value across the table (source, model ...) shown in the title instead."""
    return [c for c in TRAIN_COLUMNS if c in ("impl", "status", "step_ms", "speedup", "final_loss")
            or df[c].nunique(dropna=False) > 1 or c in ("tokens_per_s", "peak_mem_bytes")]


def _title(df: pd.DataFrame) -> str:
    fixed = [f"{c}={_cell(c, df[c].iloc[0])}" for c in TRAIN_GROUP if df[c].nunique(dropna=False) == 1]
    return f"{TITLE}; {' '.join(fixed)}" if fixed else TITLE


def render_train(df: pd.DataFrame, fmt: str) -> str:
    """The train table as "md", "csv" (every column, losses as a JSON list), "html" or "text"."""
    if fmt == "csv":
        cols = [*TRAIN_COLUMNS, "step_p20_ms", "step_p80_ms", "losses"]
        return pd.DataFrame({c: [_cell(c, v) for v in df[c]] for c in cols}).to_csv(index=False, lineterminator="\n")
    cols = _columns(df)
    cells = [[_cell(c, row[c]) for c in cols] for _, row in df.iterrows()]
    if fmt == "md":
        lines = ["# KOSMOS training proxy report", "", f"## {_title(df)}", "",
                 "| " + " | ".join(cols) + " |", "| " + " | ".join("---" for _ in cols) + " |"]
        lines += ["| " + " | ".join(v.replace("|", "\\|") for v in row) + " |" for row in cells]
        return "\n".join(lines) + "\n"
    if fmt == "html":
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(v)}</td>" for v in row) + "</tr>" for row in cells)
        return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"><title>KOSMOS training proxy "
                f"report</title></head><body>\n<h1>KOSMOS training proxy report</h1>\n<h2>{html.escape(_title(df))}"
                f"</h2>\n<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>\n</body></html>\n")
    if fmt == "text":
        buffer = io.StringIO()
        from rich.console import Console
        print_train(df, Console(file=buffer, width=160, color_system=None, force_terminal=False))
        return buffer.getvalue()
    raise ReportError(f"unknown format {fmt!r}")


def print_train(df: pd.DataFrame, console) -> None:
    """The table on a rich console, the reasons as lines under it (so that the cells stay readable)."""
    from rich.table import Table
    from rich.text import Text
    cols = [c for c in _columns(df) if c != "reason"]
    table = Table(title=_title(df))
    for c in cols:
        table.add_column(SHORT.get(c, c), justify="left" if c in ("impl", "status", "reason", "source", "model", "dtype")
                         else "right")
    for _, row in df.iterrows():
        table.add_row(*(_cell(c, row[c]) for c in cols),
                      style="red" if row["status"] == "failed" else ("yellow" if row["status"] != "ok" else ""))
    console.print(table)
    for _, row in df.iterrows():
        if isinstance(row.get("reason"), str) and row["reason"]:
            console.print(Text(f"{row['impl']} {row['dtype']}: {row['status']}: {row['reason']}"), soft_wrap=True)


def train_report_main(results: list[dict], fmt: str, out, chart, console, say) -> int:
    """``kosmos report`` on train rows (render.report_main hands them here): the table, and the loss figure
    to ``chart``."""
    if not all(is_train(r) for r in results):
        raise ReportError("train rows (kosmos bench train) are reported on their own: pass the train results file "
                          "without other benches' files")
    df = train_table(results)
    if out is not None:
        text = render_train(df, fmt)
        writing(Path(out), lambda: Path(out).write_text(text, encoding="utf-8"))
        say(f"{fmt} report written to {out}")
    elif fmt == "text":
        print_train(df, console)
    else:
        console.out(render_train(df, fmt), highlight=False, end="")
    if chart is not None:
        written = writing(Path(chart), lambda: loss_chart(df, chart))
        say(f"loss figure written to {chart}" if written else "matplotlib missing: no loss figure")
    return 0
