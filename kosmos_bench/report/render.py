"""Rendering of KOSMOS benchmark results (JSON lines and traces, see SCHEMA.md): the report as markdown, csv,
self-contained html or text, rich tables on the terminal, and ``report_main``, the entry point of
``kosmos report``. Every human-readable format shows the same sections (``_sections``) in the same order, the
headline first (the geomeans, the target and verdict lines), then the per-shape tables; csv is the
machine-readable contract: every column of ``build_table``, one row per result identity. On the terminal (and in
``--format text``) the default is the compact view of compact.py, made for 100 columns; ``wide`` gives the
sections as md and html have them."""

from __future__ import annotations

import html
import io
from pathlib import Path

import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

from .charts import speedup_chart, timeline_chart
from .compact import (COMPACT_WIDTH, WIDE_WIDTH, geomean_lines, print_compact, print_cublas_compact,
                      print_dtype_compact, print_full_width, print_host_compact, print_host_enqueue_compact,
                      print_wrapped)
from .files import make_folder, writing
from .lines import (RATIO_LINE, bandwidth_line, cublas_line, enqueue_pointer, environment_lines, host_enqueue_line,
                    host_enqueue_title, host_line, target_lines, versus_line, workspace_line)
from .load import load_records
from .schema import (
    LOW_DTYPES, low_name,
    BANDWIDTH_COLUMNS, CONFIG_COLUMN, ENV_COLUMNS, MX_DETAIL_COLUMNS, GEOMEAN_COLUMNS, MODEL_GEOMEAN_COLUMNS, MOE_COLUMNS,
    NUMERIC_DISPLAY_COLUMNS, RENDER_FORMATS, SHAPE_COLUMNS, SPEEDUP_COLUMNS, TABLE_COLUMNS, ReportError, format_value,
)
from .tables import (build_table, config_varies, cublas_summary_table, cublas_table, dtype_table,
                     geomean_by_model_table, geomean_table, host_enqueue_table, host_table, versus_table, wire_table)
from .train import train_report_main

ENVIRONMENT, RESULTS = "Environment", "Results per shape"
CUBLAS_SECTION = "kosmos against cuBLAS alone at world 1 (vs_cublas = t_gemm_ms / time_ms, the TFLOP/s ratio)"
def low_section(low: str) -> str:
    """The title of the "<low> / bf16" section of the 8-bit dtype ``low``."""
    n = low_name(low)
    return (f"{low} / bf16: kosmos at {low}, its speedup over kosmos at bf16 and over cuBLAS bf16 alone "
            f"({n}_vs_bf16 = kosmos_bf16_ms / kosmos_{n}_ms, {n}_vs_cublas_bf16 = cublas_bf16_ms / kosmos_{n}_ms)")


MX_SECTION = low_section("mxfp8")


# --------------------------------------------------------------------------- sections and formatting


def _host_section(df: pd.DataFrame) -> str:
    """The title of the section on the in-loop host time (result rows' host_ms), not the enqueue cost per eager
    call (``host_enqueue_title``'s section): each timed call follows a barrier, so the host is cold."""
    return ("Host time per call inside the timing loop, µs (host_ms of the ok rows: median over each row's timed "
            f"calls, each after a barrier, so the host is cold{enqueue_pointer(df)})")


def _verdicts(df: pd.DataFrame, cublas: bool = True) -> list[str]:
    """The verdict lines: expert GEMMs (MoE), the geomean targets, kosmos against the fastest other, kosmos against
    cuBLAS alone at world 1 (with ``cublas``), kosmos's host enqueue time per eager call against its bar."""
    versus = versus_table(df)
    lines = [versus_line(versus, df) if not versus.empty else None, cublas_line(df) if cublas else None,
             host_enqueue_line(df)]
    return [*target_lines(df), *(line for line in lines if line)]


def _headline(df: pd.DataFrame) -> list[str]:
    """The lines under the geomean tables of md, html and the wide view: the workspace, the verdict lines
    (``_verdicts``), the host time per call inside the timing loop."""
    host = host_line(df)
    return [workspace_line(df), *_verdicts(df), *([host] if host else [])]


def _sections(df: pd.DataFrame):
    """The report's parts in order: (title, table, columns) for a table, (None, sentence, None) for a line. The
    environment and the ratio convention, the headline (geomeans, verdict lines), then the long per-shape
    tables."""
    environment = ["source", *ENV_COLUMNS]
    yield ENVIRONMENT, df[environment].drop_duplicates().reset_index(drop=True), environment
    yield None, RATIO_LINE, None
    # the direction column where a file has other than forward rows (MoE --direction bwd / fwd+bwd)
    forward_only = "direction" not in df or bool((df["direction"].fillna("fwd") == "fwd").all())
    yield "Geomean over ok rows", geomean_table(df), [c for c in GEOMEAN_COLUMNS if c != "direction" or not forward_only]
    by_model = geomean_by_model_table(df)
    if not by_model.empty:
        yield "Geomean per model", by_model, [c for c in MODEL_GEOMEAN_COLUMNS if c != "direction" or not forward_only]
    for line in _headline(df):
        yield None, line, None
    yield RESULTS, df, _display_columns(df)
    line = bandwidth_line(df)
    if line:
        yield None, line, None
    versus = versus_table(df)
    if not versus.empty:
        yield "kosmos against the fastest other implementation", versus, _versus_display(versus)
    per_shape = cublas_table(df)
    if not per_shape.empty:
        summary = cublas_summary_table(df, per_shape)
        yield CUBLAS_SECTION + ": per op", summary, _summary_display(summary)
        yield CUBLAS_SECTION + ": per shape", per_shape, _summary_display(per_shape)
    enqueue = host_enqueue_table(df)
    if not enqueue.empty:
        yield host_enqueue_title(enqueue), enqueue, _host_enqueue_display(enqueue)
    hosts = host_table(df)
    if not hosts.empty:
        yield _host_section(df), hosts, _summary_display(hosts)
    for low in LOW_DTYPES:
        ratios = dtype_table(df, low)
        if not ratios.empty:
            yield low_section(low), ratios, [c for c in ratios.columns if c not in _single_valued(ratios)]
    wires = wire_table(df)
    if not wires.empty:
        yield "Bytes on the wire per implementation (per rank)", wires, \
            [c for c in wires.columns if c not in _single_valued(wires)]


def _formatted(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({column: [format_value(column, value) for value in df[column]] for column in columns})


def _single_valued(df: pd.DataFrame, columns=("source", "bench")) -> set[str]:
    """The identity columns a human-readable table can drop: one value across the whole table."""
    return {column for column in columns if df[column].nunique() <= 1}


def _config_varies(df: pd.DataFrame) -> bool:
    """Whether a human-readable table shows ``config``: when some op holds rows of more than one config (an A/B
    appended to one file, or files run with other configs side by side). The rule of ``_single_valued`` applied
    per op rather than across the table: each op has its own fields and the baselines none, so a run of one
    config per op would otherwise always show it."""
    return config_varies(df)


def _display_columns(df: pd.DataFrame) -> list[str]:
    """Columns of the human-readable per-shape tables (csv gets every column)."""
    hidden = {"workspace_bytes"} | _single_valued(df)
    columns = [column for column in TABLE_COLUMNS if column not in hidden]
    bandwidths = [column for column in BANDWIDTH_COLUMNS if df[column].notna().any()]
    columns[columns.index("status"):columns.index("status")] = bandwidths
    mx = [column for column in MX_DETAIL_COLUMNS if column in df and df[column].notna().any()]
    columns[columns.index("rel_err") + 1:columns.index("rel_err") + 1] = mx  # mxfp8 rows: rel_err_bf16, wire
    if "routing" in df:
        position = columns.index("impl")
        columns[position:position] = MOE_COLUMNS
    if "direction" in df and (df["direction"].fillna("fwd") != "fwd").any():  # MoE --direction bwd / fwd+bwd rows
        columns.insert(columns.index("dtype") + 1, "direction")
    if _config_varies(df):
        columns.insert(columns.index("impl") + 1, CONFIG_COLUMN)
    return columns


def _versus_display(versus: pd.DataFrame) -> list[str]:
    hidden = _single_valued(versus)
    if not _config_varies(versus):
        hidden.add(CONFIG_COLUMN)
    if versus["vs_fixed_role_best"].isna().all():
        hidden.add("vs_fixed_role_best")
    if "routing" in versus and versus["routing"].isna().all():
        hidden.update(MOE_COLUMNS)
    return [column for column in versus.columns if column not in hidden]


def _summary_display(table: pd.DataFrame) -> list[str]:
    """The columns of the cuBLAS and host sections a human-readable table shows: without the source and bench when
    single-valued, the config where it does not vary, the direction of forward-only tables, the floor columns
    without a floor target."""
    hidden = _single_valued(table)
    if CONFIG_COLUMN in table and not _config_varies(table):
        hidden.add(CONFIG_COLUMN)
    if "direction" in table and (table["direction"].fillna("fwd") == "fwd").all():
        hidden.add("direction")
    for column in ("below_floor", "floor"):
        if column in table and table[column].isna().all():
            hidden.add(column)
    return [column for column in table.columns if column not in hidden]


def _host_enqueue_display(table: pd.DataFrame) -> list[str]:
    """The columns of the host enqueue section a human-readable table shows: without what one value across it says
    (source, bench, the shape and calls of its title), the config where it does not vary, the reason when every row
    is ok."""
    hidden = _single_valued(table, ("source", "bench", "shape", "calls"))
    if not _config_varies(table):
        hidden.add(CONFIG_COLUMN)
    if table["reason"].isna().all():
        hidden.add("reason")
    return [column for column in table.columns if column not in hidden]


def _speedup_style(value) -> str | None:
    if value is None or pd.isna(value) or value == 1:
        return None
    return "green" if value > 1 else "red"


def _shape_key(row: dict) -> tuple[str, ...]:
    """Formatted identity of a row's shape (strings, so missing values compare equal)."""
    return tuple(format_value(column, row.get(column)) for column in SHAPE_COLUMNS)


# --------------------------------------------------------------------------- renderers


def render(df: pd.DataFrame, fmt: str, wide: bool = False) -> str:
    """Render the table as "md", "csv", "html" or "text" (the terminal view: compact at 100 columns, or with
    ``wide`` every section at 250)."""
    renderers = {"md": _render_markdown, "csv": _render_csv, "html": _render_html}
    if fmt == "text":
        return _render_text(df, wide)
    if fmt not in renderers:
        raise ReportError(f"unknown format {fmt!r}; expected one of {', '.join(RENDER_FORMATS)}")
    return renderers[fmt](df)


def _render_csv(df: pd.DataFrame) -> str:
    return _formatted(df, list(df.columns)).to_csv(index=False, lineterminator="\n")


def _markdown_table(frame: pd.DataFrame) -> str:
    def cells(values) -> str:
        return "| " + " | ".join(str(value).replace("|", "\\|") for value in values) + " |"

    lines = [cells(frame.columns), cells("---" for _ in frame.columns)]
    lines += [cells(row) for row in frame.itertuples(index=False)]
    return "\n".join(lines)


def _render_markdown(df: pd.DataFrame) -> str:
    parts = ["# KOSMOS benchmark report"]
    for title, body, columns in _sections(df):
        parts += [body] if title is None else [f"## {title}", _markdown_table(_formatted(body, columns))]
    return "\n\n".join(parts) + "\n"


HTML_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; }
table { border-collapse: collapse; margin-bottom: 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; }
th { background: #f0f0f0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.faster { color: #067d17; font-weight: bold; }
td.slower { color: #b00020; font-weight: bold; }
tr.failed td, tr.unavailable td { background: #fff3f3; color: #777; }
"""


def _html_table(df: pd.DataFrame, columns: list[str]) -> str:
    header = "".join(f"<th>{html.escape(column)}</th>" for column in columns)
    body = []
    for _, row in df.iterrows():
        cells = "".join(_html_cell(column, row[column]) for column in columns)
        status = row.get("status")
        row_class = f' class="{html.escape(status)}"' if status in ("failed", "unavailable") else ""
        body.append(f"<tr{row_class}>{cells}</tr>")
    return f"<table><thead><tr>{header}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _html_cell(column: str, value) -> str:
    classes = []
    if column in NUMERIC_DISPLAY_COLUMNS:
        classes.append("num")
    if column in SPEEDUP_COLUMNS:
        style = _speedup_style(value)
        classes.append({"green": "faster", "red": "slower"}.get(style, ""))
    class_attribute = f' class="{" ".join(filter(None, classes))}"' if any(classes) else ""
    return f"<td{class_attribute}>{html.escape(format_value(column, value))}</td>"


def _render_html(df: pd.DataFrame) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>KOSMOS benchmark report</title>',
        f"<style>{HTML_STYLE}</style></head><body>",
        "<h1>KOSMOS benchmark report</h1>",
    ]
    for title, body, columns in _sections(df):
        parts += [f"<p>{html.escape(body)}</p>"] if title is None else \
            [f"<h2>{html.escape(title)}</h2>", _html_table(body, columns)]
    return "\n".join([*parts, "</body></html>", ""])


def _render_text(df: pd.DataFrame, wide: bool) -> str:
    buffer = io.StringIO()
    print_terminal(df, Console(file=buffer, width=WIDE_WIDTH if wide else COMPACT_WIDTH, color_system=None,
                               force_terminal=False), wide=wide)
    return buffer.getvalue()


# --------------------------------------------------------------------------- terminal


def print_terminal(df: pd.DataFrame, console: Console | None = None, wide: bool = False) -> None:
    """The report on a rich console. By default the compact view (compact.py), the headline first: the
    environment, the ratio convention, a geomean line per table (``geomean_lines``), kosmos against cuBLAS alone at
    world 1, the verdict lines; then a table per comparison with a line per shape (each implementation's time and
    speedup), the notes, the mxfp8 section, the host time tables, the workspace. Columns of implementations
    unavailable at every shape and sections without content (bytes on the wire at world 1) are left out. With
    ``wide``, every section of md and html (headline first) as rich tables, each as wide as its cells need (wider
    than the console rather than cutting cells: ``| less -S`` on a narrow terminal)."""
    console = console or Console()
    if not wide:
        environment = df[["source", *ENV_COLUMNS]].drop_duplicates()
        for line in [*environment_lines(environment, short_commit=True), RATIO_LINE]:
            print_wrapped(console, line)
        for line in geomean_lines(df):
            print_wrapped(console, line, style="bold")
        print_cublas_compact(df, console)
        for line in _verdicts(df, cublas=False):  # print_cublas_compact has the cuBLAS verdicts
            print_wrapped(console, line)
        print_compact(df, console)
        print_dtype_compact(df, console)
        print_host_enqueue_compact(df, console)
        print_host_compact(df, console)  # host_line says what its table does
        print_wrapped(console, workspace_line(df))
        console.print(Text("Every column, implementation and section: kosmos report FILE --wide (or --format md, "
                           "html, csv)", style="dim"))
        return
    for title, body, columns in _sections(df):
        if title is None:
            console.print(Text(body))
        elif title == ENVIRONMENT:
            for line in environment_lines(body):
                console.print(Text(line))
        elif title == RESULTS:  # the reason is in the status cell; a rule under each shape
            print_full_width(console, _rich_table(body, [column for column in columns if column != "reason"], title,
                                                   shape_sections=True))
        else:
            print_full_width(console, _rich_table(body, columns, title))


def _rich_table(frame: pd.DataFrame, columns: list[str], title: str, shape_sections: bool = False) -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column in NUMERIC_DISPLAY_COLUMNS else "left")
    records = frame.to_dict("records")
    for index, row in enumerate(records):
        is_last_of_shape = shape_sections and (
            index + 1 == len(records) or _shape_key(records[index + 1]) != _shape_key(row))
        table.add_row(*(_rich_cell(column, row) for column in columns), end_section=is_last_of_shape)
    return table


def _rich_cell(column: str, row: dict) -> Text:
    if column == "status":
        return _rich_status(row)
    value = row[column]
    style = _speedup_style(value) if column in SPEEDUP_COLUMNS else None
    return Text(format_value(column, value), style=style or "")


def _rich_status(row: dict) -> Text:
    status = row["status"]
    if status == "ok":
        return Text("ok")
    reason = format_value("reason", row.get("reason"))
    label = f"{status}: {reason}" if reason else status
    return Text(label, style="red" if status == "failed" else "yellow")


# --------------------------------------------------------------------------- CLI glue


def report_main(
    files: list[str | Path],
    fmt: str = "text",
    out: str | Path | None = None,
    chart: str | Path | None = None,
    timeline: str | Path | None = None,
    console: Console | None = None,
    wide: bool = False,
    status: Console | None = None,
) -> int:
    """Entry point of `kosmos report`: the report on ``console`` (stdout) or to ``out``; status messages ("...
    written to ...") and warnings (a results file's last line cut short) on ``status`` (stderr), so that stdout
    holds the report alone (``--format csv > out.csv``). The folders of ``out``, ``chart`` and the timeline's PNG
    are created. Raises ReportError (one line, naming the file) for unusable inputs and unwritable outputs."""
    console = console or Console()
    status = status or Console(stderr=True)

    def say(message: str, style: str = "") -> None:
        status.print(Text(message, style=style), soft_wrap=True)

    if timeline is not None:
        png_path = Path(out) if out is not None else Path(timeline).with_suffix(".png")
        written = writing(png_path, lambda: timeline_chart(timeline, png_path))
        say(f"timeline written to {written}")
        return 0
    if fmt not in RENDER_FORMATS:
        raise ReportError(f"unknown format {fmt!r}; expected one of {', '.join(RENDER_FORMATS)}")
    _, results, hosts = load_records(files, warn=lambda message: say(f"warning: {message}", "yellow"))
    if any(record.get("bench") == "train" for record in results):  # bench train: its own table and figure
        return train_report_main(results, fmt, out, chart, console, say, wide=wide)
    df = build_table(results, hosts)
    if chart is not None:
        make_folder(Path(chart))  # before the report is shown: a bad path fails first
    if out is not None:
        text = render(df, fmt, wide=wide)
        writing(Path(out), lambda: Path(out).write_text(text, encoding="utf-8"))
        say(f"{fmt} report written to {out}")
    elif fmt == "text":
        print_terminal(df, console, wide=wide)
    else:
        console.out(render(df, fmt), highlight=False, end="")
    if chart is not None:
        written = writing(Path(chart), lambda: speedup_chart(df, chart))
        say(f"speedup chart written to {chart}" if written else "matplotlib missing: no speedup chart")
    return 0
