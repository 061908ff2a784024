"""The compact terminal view of a results table, the default of ``kosmos report`` and of the table ``kosmos bench``
prints at the end: made to read at 100 columns. One table per comparison, dtype and direction (the TP ops against
nccl+cublas, the MoE layer forward, backward or both against nccl-a2a, the MoE expert GEMMs alone against
grouped-mm; TP rows of kosmos alone at world 1 against cuBLAS alone, their ``t_gemm_ms``), one line per shape, a
column per implementation holding its time in ms and its speedup over the baseline (the baseline's column: its
time), the fastest time of a line in bold; under each table the geomeans of each column. What is the same on every
line of a table (model, world, dtype, op) is said once in its title. ``geomean_lines`` gives the same geomeans as
one headline line per table.

A failed or unavailable cell says ``failed[N]`` / ``n/a[N]``; note N under the tables gives the reason, wrapped to
the console's width. An implementation unavailable at every shape of a table gets no column there, a line under the
table names it and its note (``--wide`` shows every column). Where an implementation ran with several configs in
one op (an A/B appended to one file), each config gets its own column, ``kosmos #1``, ``kosmos #2``, and a legend
line says which is which.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field

import pandas as pd
from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.segment import Segments
from rich.table import Table
from rich.text import Text

from .lines import enqueue_pointer, host_enqueue_title
from .schema import (BASELINE_IMPL, BASELINE_IMPL_BY_OP, CONFIG_COLUMN, DEFAULT_DIRECTION, LOW_DTYPES, OURS,
                     SHAPE_COLUMNS, format_value, low_name)
from .tables import (config_varies, cublas_summary_table, dtype_table, geomean, host_enqueue_table, host_table,
                     wire_table)
from .targets import target_of

WHAT = {"tp": "TP ops", "moe_fwd": "MoE layer", "moe_experts": "MoE expert GEMMs alone"}
DIRECTION_WORDS = {"fwd": "forward", "bwd": "backward", "fwd+bwd": "forward+backward"}
CUBLAS_ALONE = "cuBLAS alone"  # the baseline column of TP tables of kosmos alone at world 1 (the rows' t_gemm_ms)
CONTEXT_FIELDS = ("model", "world", "dtype")  # said in the title when one value across a table
STATUS_WORDS = {"failed": "failed", "unavailable": "n/a"}
GAP = 2  # the columns between two of a table's columns (collapsed padding and the box's blank rule)
COMPACT_WIDTH, WIDE_WIDTH = 100, 250  # the widths of --format text, compact and --wide


def family_of(row: dict) -> tuple[str, str | None]:
    """The comparison a row belongs to: (bench or MoE op, baseline impl)."""
    by_op = BASELINE_IMPL_BY_OP.get(row["op"])
    if by_op:
        return row["op"], by_op
    return ("moe_fwd" if row["bench"] == "moe" else row["bench"]), (row.get("suite_baseline")
                                                                     or BASELINE_IMPL.get(row["bench"]))


@dataclass
class Notes:
    """The reasons of failed / unavailable cells, numbered in order of first use; one number per
    (impl, status, reason)."""
    numbers: dict[tuple, int] = field(default_factory=dict)
    shapes: dict[tuple, int] = field(default_factory=dict)

    def number(self, impl: str, status: str, reason: str) -> int:
        key = (impl, status, reason)
        self.numbers.setdefault(key, len(self.numbers) + 1)
        self.shapes[key] = self.shapes.get(key, 0) + 1
        return self.numbers[key]

    def lines(self) -> list[str]:
        out = []
        for (impl, status, reason), number in self.numbers.items():
            count = self.shapes[(impl, status, reason)]
            where = f" ({count} shapes)" if count > 1 else ""
            out.append(f"[{number}] {impl} {status}{where}: {reason or 'no reason recorded'}")
        return out


def families(df: pd.DataFrame) -> dict[tuple, list[dict]]:
    """The rows of each table of the compact view: {((name, baseline), dtype, direction): rows}; the TP ops, the
    MoE layer, its expert GEMMs alone (``WHAT``'s order), each forward, backward, forward+backward, dtypes in order
    of first appearance (mxfp8 rows have baselines of their own). A TP table without its baseline's rows whose
    kosmos rows ran at world 1 with a cuBLAS-alone time (``t_gemm_ms``) gets that as its baseline
    (``_with_cublas_baseline``)."""
    out: dict[tuple, list[dict]] = {}
    for row in df.to_dict("records"):
        direction = row.get("direction")
        direction = DEFAULT_DIRECTION if direction is None or pd.isna(direction) else direction
        out.setdefault((family_of(row), row.get("dtype"), direction), []).append(row)
    tables = {}
    for ((name, baseline), dtype, direction), rows in out.items():
        with_cublas = None
        if name == "tp" and not any(row["impl"] == baseline for row in rows):
            with_cublas = _with_cublas_baseline(rows)
        if with_cublas is None:
            tables[((name, baseline), dtype, direction)] = rows
        else:
            tables[((name, CUBLAS_ALONE), dtype, direction)] = with_cublas
    names, directions = list(WHAT), list(DIRECTION_WORDS)

    def order(key: tuple) -> tuple:
        (name, _), _, direction = key
        return (names.index(name) if name in names else len(names),
                directions.index(direction) if direction in directions else len(directions))

    return dict(sorted(tables.items(), key=lambda item: order(item[0])))


def _with_cublas_baseline(rows: list[dict]) -> list[dict] | None:
    """The rows of a TP table without its baseline, with a "cuBLAS alone" row per shape (time: the first kosmos
    row's ``t_gemm_ms``, torch.matmul on the same operands) and each kosmos row's speedup over it (t_gemm_ms /
    time_ms, as the section "kosmos against cuBLAS alone" has it); None unless some kosmos row ran ok at world 1
    with a positive ``t_gemm_ms``."""
    out, seen = [], set()
    for row in rows:
        cublas = row.get("t_gemm_ms")
        usable = (row["impl"] == OURS and row["status"] == "ok" and row.get("world") == 1 and cublas is not None
                  and not pd.isna(cublas) and cublas > 0 and _time(row) is not None)
        if not usable:
            out.append(row)
            continue
        shape = tuple(str(row.get(column)) for column in SHAPE_COLUMNS)
        if shape not in seen:
            seen.add(shape)
            out.append({**row, "impl": CUBLAS_ALONE, CONFIG_COLUMN: None, "time_ms": cublas, "speedup": math.nan,
                        "overlap_efficiency": math.nan})
        out.append({**row, "speedup": cublas / row["time_ms"]})
    return out if seen else None


def comparison_name(name: str, direction: str | None) -> str:
    """What a table compares, in words: "TP ops", "MoE layer forward", "MoE expert GEMMs alone, backward"."""
    what = WHAT.get(name, name)
    if name == "tp":
        return what
    word = DIRECTION_WORDS.get(direction or DEFAULT_DIRECTION, direction)
    return f"{what}, {word}" if name == "moe_experts" else f"{what} {word}"


def print_compact(df: pd.DataFrame, console: Console) -> None:
    """The per-shape part of the compact view: a table per comparison, dtype and direction (``families``), the
    config legend, the implementations left out, then the notes, wrapped."""
    notes = Notes()
    several_sources = df["source"].nunique() > 1
    for (family, _, direction), rows in families(df).items():
        title, table, legend = _family_table(family, rows, several_sources, notes, console.width, direction)
        print_wrapped(console, title, style="bold")
        console.print(table)
        for line in legend:
            print_wrapped(console, line)
    for line in notes.lines():
        print_wrapped(console, line)


def print_wrapped(console: Console, line: str, style: str = "") -> None:
    """``line`` wrapped at the console's width, the lines after the first indented."""
    for part in textwrap.wrap(" ".join(line.split()), width=console.width, subsequent_indent="    ",
                              break_on_hyphens=False) or [""]:
        console.print(Text(part, style=style), no_wrap=True, crop=False)


def print_full_width(console: Console, table: Table) -> None:
    """``table`` at the width its cells need, at least the console's (wider than the console rather than cutting
    or folding cells: the --wide views)."""
    width = max(console.width, Measurement.get(console, console.options.update(width=10**6), table).maximum)
    lines = console.render_lines(table, console.options.update(width=width), pad=False, new_lines=True)
    console.print(Segments([segment for line in lines for segment in line]), crop=False, end="")


def geomean_lines(df: pd.DataFrame) -> list[str]:
    """The headline of the compact view: a line per table with a baseline (``families``), each implementation's
    geomean speedup over the baseline across its ok shapes, e.g. "Geomean speedup over nccl+cublas, TP ops |
    world 2 | bf16 (24 shapes): kosmos 1.060x, torch-async-tp 1.124x"; an implementation that failed everywhere
    says so, one unavailable everywhere is left out, one ok at some shapes says at how many."""
    lines = []
    several_sources = df["source"].nunique() > 1
    for ((name, baseline), _, direction), rows in families(df).items():
        if not baseline:
            continue
        frame = pd.DataFrame(rows)
        context = [column for column in CONTEXT_FIELDS if column in frame and frame[column].nunique(dropna=False) <= 1]
        configs = _configs_by_op_impl(rows)
        columns, _ = _impl_columns(rows, configs, baseline)
        parts = []
        for source in dict.fromkeys(row["source"] for row in rows):
            mine = [row for row in rows if row["source"] == source]
            shapes = len(_shapes(mine, False))
            values = []
            for column in columns:
                if column[0] == baseline:
                    continue
                cells = [row for row in mine if _column_of(row, columns, configs) == column]
                ok = [row["speedup"] for row in cells if _time(row) is not None and not pd.isna(row["speedup"])]
                header = column[0] + (f" #{column[1]}" if column[1] else "")
                if ok:
                    some = f" ({len(ok)} of {shapes} shapes)" if len(ok) < shapes else ""
                    values.append(f"{header} {geomean(pd.Series(ok, dtype='float64')):.3f}x{some}")
                elif cells and any(row["status"] != "unavailable" for row in cells):  # n/a everywhere: not said
                    values.append(f"{header} failed")
            if values:
                label = f"{source} ({shapes} shapes): " if several_sources else ""
                parts.append(label + ", ".join(values))
        if not parts:
            continue
        where = " | ".join(_context_text(column, rows[0]) for column in context)
        count = "" if several_sources else f" ({len(_shapes(rows, False))} shapes)"
        lines.append(f"Geomean speedup over {baseline}, {comparison_name(name, direction)}"
                     f"{' | ' + where if where else ''}{count}: " + "; ".join(parts))
    return lines


def print_dtype_compact(df: pd.DataFrame, console: Console) -> None:
    """The "<8-bit dtype> / bf16" parts of the compact view (mxfp8, fp8-block): a line per shape with kosmos's time
    at that dtype and its speedup over kosmos at bf16 and over cuBLAS bf16 alone, for the shapes kosmos also ran at
    bf16 (the others' ratio to cuBLAS alone is in the section on it), and the bytes on the wire per implementation
    (MiB, ratio to bf16) where some are sent (at world 1 none are: no section)."""
    wires = wire_table(df)
    if not wires.empty and not (wires["wire_mib"] > 0).any():
        wires = wires.iloc[0:0]
    several_sources = df["source"].nunique() > 1
    for low in LOW_DTYPES:
        ratios = dtype_table(df, low)
        ratios = ratios[ratios["kosmos_bf16_ms"].notna()]  # no bf16 run of the shape: its cuBLAS ratio is elsewhere
        if ratios.empty:
            continue
        n = low_name(low)
        print_wrapped(console, f"{low} / bf16: kosmos's time at {low}, its speedup over kosmos at bf16 and "
                               "over cuBLAS bf16 alone (t_gemm_ms)", style="bold")
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
        labels = (["source"] if several_sources else []) + ["op", "layer", "seq"] + \
            (["routing"] if ratios["routing"].notna().any() else []) + \
            (["model"] if ratios["model"].nunique() > 1 else []) + (["world"] if ratios["world"].nunique() > 1 else [])
        for column in labels:
            table.add_column(column, justify="right" if column == "seq" else "left")
        for header in ("bf16 ms", f"{low} ms", "over bf16", "cuBLAS bf16", "over cuBLAS"):
            table.add_column(header, justify="right")
        for row in ratios.to_dict("records"):
            cells = [_label_cell(column, row) for column in labels]
            cells += [_num(row["kosmos_bf16_ms"], _ms), _ms(row[f"kosmos_{n}_ms"]),
                      _num(row[f"{n}_vs_bf16"], "{:.3f}x".format), _num(row["cublas_bf16_ms"], _ms),
                      _num(row[f"{n}_vs_cublas_bf16"], "{:.3f}x".format)]
            table.add_row(*cells)
        console.print(table)
    if not wires.empty:
        print_wrapped(console, "Bytes on the wire per rank (MiB; in brackets: the bytes over bf16's)", style="bold")
        shape_columns = ["source", "op", "layer", "model", "seq", "routing", "m", "n", "k", "world"]
        for _, group in wires.groupby(shape_columns, sort=False, dropna=False):
            first = group.iloc[0]
            routing = "" if first["routing"] is None or pd.isna(first["routing"]) else f" {first['routing']}"
            label = f"{first['source'] + ' ' if several_sources else ''}{first['op']} {first['layer']} " \
                    f"{first['seq']}{routing} W{first['world']}:"
            parts = []
            for row in group.to_dict("records"):
                ratio = "" if pd.isna(row["wire_vs_bf16"]) or row["dtype"] == "bf16" else \
                    f" ({row['wire_vs_bf16']:.3f}x)"
                parts.append(f"{row['dtype']} {row['impls']} {row['wire_mib']:.2f}{ratio}")
            print_wrapped(console, f"{label} " + "; ".join(parts))


def _small_table(frame: pd.DataFrame, labels: list[str], cells: list[tuple[str, object]]) -> Table:
    """A compact table: the label columns (left), then a right-aligned column per (header, row -> text)."""
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    for column in labels:
        table.add_column(column, justify="left")
    for header, _ in cells:
        table.add_column(header, justify="right")
    for row in frame.to_dict("records"):
        table.add_row(*[format_value(column, row.get(column)) for column in labels], *[cell(row) for _, cell in cells])
    return table


def _varying(frame: pd.DataFrame, columns) -> list[str]:
    """The ``columns`` of ``frame`` that vary (the config: where some op ran with several, ``config_varies``)."""
    return [column for column in columns if column in frame and (
        config_varies(frame) if column == CONFIG_COLUMN else frame[column].nunique(dropna=False) > 1)]


def _cell(column: str, fmt):
    return lambda row: _num(row[column], fmt)


def print_cublas_compact(df: pd.DataFrame, console: Console) -> None:
    """kosmos against cuBLAS alone at world 1, a line per (source, op, dtype, config): the shapes, the geomean and
    lowest of t_gemm_ms / time_ms, the shape of the lowest, with the suite's vs_cublas_floor the shapes under it,
    with its vs_cublas_geomean the geomean's verdict (the compact view's form of ``lines.cublas_line``)."""
    summary = cublas_summary_table(df)
    if summary.empty:
        return
    print_wrapped(console, "kosmos against cuBLAS alone at world 1, per op (t_gemm_ms / time_ms, the TFLOP/s ratio)",
                  style="bold")
    labels = _varying(summary, ("source",)) + ["op"] + _varying(summary, ("dtype", CONFIG_COLUMN))
    cells = [("shapes", _cell("shapes", str)), ("geomean", _cell("geomean_vs_cublas", "{:.3f}x".format)),
             ("lowest", _cell("min_vs_cublas", "{:.3f}x".format)), ("at m x n x k", lambda row: row["worst_shape"])]
    if summary["below_floor"].notna().any():
        cells.append(("under floor", lambda row: "" if pd.isna(row["below_floor"]) else
                      f"{int(row['below_floor'])} < {row['floor']:.2f}"))

    def bar(row) -> str:
        target = target_of(df, row["source"], row["bench"], "vs_cublas_geomean")
        return "" if target is None else \
            f"{'meets' if row['geomean_vs_cublas'] >= target else 'misses'} >= {target:.2f}"

    if any(bar(row) for row in summary.to_dict("records")):
        cells.append(("geomean bar", bar))
    console.print(_small_table(summary, labels, cells))


def print_host_enqueue_compact(df: pd.DataFrame, console: Console) -> None:
    """The host enqueue time per eager call (the host rows of ``bench tp --host-calls``): a line per (source, op,
    dtype, world, impl, config, shape) with the median and p20 / p80 in microseconds, or the status; the reasons of
    the rows that did not run under the table, one line each."""
    table = host_enqueue_table(df)
    if table.empty:
        return
    print_wrapped(console, host_enqueue_title(table), style="bold")
    labels = _varying(table, ("source",)) + ["impl", "op", "dtype"] + _varying(table, ("world", CONFIG_COLUMN,
                                                                                          "shape", "calls"))
    console.print(_small_table(table, labels, [
        ("median", lambda row: _num(row["host_us"], "{:.1f}".format) if row["status"] == "ok" else
         STATUS_WORDS.get(row["status"], row["status"])),
        ("p20", _cell("p20_us", "{:.1f}".format)), ("p80", _cell("p80_us", "{:.1f}".format))]))
    for row in table[table["status"] != "ok"].to_dict("records"):
        print_wrapped(console, f"{row['impl']} {row['op']} {row['dtype']} {row['status']}: "
                               f"{format_value('reason', row['reason']) or 'no reason recorded'}")


def print_host_compact(df: pd.DataFrame, console: Console) -> None:
    """The host time per call inside the timing loop: a line per (source, op, dtype, direction, impl, config) with
    the median, min and max over its ok rows of host_ms, in microseconds (each call after a barrier: a cold host;
    not the enqueue cost per eager call, ``print_host_enqueue_compact``)."""
    hosts = host_table(df)
    if hosts.empty:
        return
    print_wrapped(console, "Host time per call inside the timing loop, µs (each call after a barrier: host cold; per "
                           f"row the median over its timed calls{enqueue_pointer(df)})", style="bold")
    labels = _varying(hosts, ("source",)) + ["impl", "op"] + _varying(hosts, ("dtype", "direction", CONFIG_COLUMN))
    console.print(_small_table(hosts, labels, [
        ("rows", _cell("rows", str)), ("median", _cell("host_us_median", "{:.1f}".format)),
        ("min", _cell("host_us_min", "{:.1f}".format)), ("max", _cell("host_us_max", "{:.1f}".format))]))


def _num(value, fmt) -> str:
    return "" if value is None or pd.isna(value) else fmt(value)


def _family_table(family: tuple, rows: list[dict], several_sources: bool, notes: Notes,
                  width: int, direction: str | None = None) -> tuple[str, Table, list[str]]:
    """The title and table of one comparison for a console ``width`` columns wide, and the lines under it (the
    config legend, the implementations unavailable at every shape, which get no column). The label columns keep
    their width (rich narrows the implementations' columns, whose cells wrap between time and speedup); the
    implementations' names break after '-' or '+' where the table would not fit otherwise."""
    name, baseline = family
    frame = pd.DataFrame(rows)
    context = [column for column in CONTEXT_FIELDS if column in frame and frame[column].nunique(dropna=False) <= 1]
    if name == "tp" and frame["op"].nunique() <= 1:
        context.insert(0, "op")
    labels = _label_columns(frame, name, context, several_sources)
    configs = _configs_by_op_impl(rows)
    columns, legend = _impl_columns(rows, configs, baseline)
    shapes = _shapes(rows, several_sources)
    columns, left_out = _without_unavailable(columns, rows, configs, baseline, notes)
    if left_out:
        legend.append("unavailable at every shape, no column: " + ", ".join(left_out))

    title = f"{comparison_name(name, direction)}: time in ms"
    if baseline:
        title += f" and speedup over {baseline}"
    title = " | ".join([title, *(_context_text(column, rows[0]) for column in context)])
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    cells = []
    for shape in shapes:
        cells.append([Text(_label_cell(column, shape[0])) for column in labels] +
                     _impl_cells(shape, columns, configs, baseline, notes))
    footer = _geomean_rows(rows, labels, columns, configs, several_sources, baseline)
    widths = [max(cell.cell_len for cell in column_cells) for column_cells in zip(*(cells + footer))] or \
        [0] * (len(labels) + len(columns))
    label_widths = [max(widths[index], len(_label_header(column))) for index, column in enumerate(labels)]
    impl_widths = widths[len(labels):]
    headers = _impl_headers(columns, impl_widths, width - sum(label_widths) - GAP * len(labels))
    for column, label_width in zip(labels, label_widths):
        table.add_column(_label_header(column), justify="right" if column in ("seq", "tokens") else "left",
                         width=label_width, overflow="fold")
    for header in headers:
        table.add_column(header, justify="right", overflow="fold")
    for index, row_cells in enumerate(cells):
        table.add_row(*row_cells, end_section=index == len(cells) - 1 and bool(footer))
    for row_cells in footer:
        table.add_row(*row_cells)
    return title, table, legend


def _without_unavailable(columns: list[tuple[str, int]], rows: list[dict], configs: dict, baseline: str | None,
                         notes: Notes) -> tuple[list[tuple[str, int]], list[str]]:
    """``columns`` without those of implementations unavailable at every shape (never the baseline's), and for
    each left out its name and note numbers, e.g. "deepep [1]"."""
    kept, left_out = [], []
    for column in columns:
        mine = [row for row in rows if _column_of(row, columns, configs) == column]
        if column[0] == baseline or not mine or any(row["status"] != "unavailable" for row in mine):
            kept.append(column)
            continue
        numbers = dict.fromkeys(notes.number(row["impl"], row["status"], format_value("reason", row.get("reason")))
                                for row in mine)
        left_out.append(column[0] + (f" #{column[1]}" if column[1] else "") + " " +
                        " ".join(f"[{number}]" for number in numbers))
    return kept, left_out


def _context_text(column: str, row: dict) -> str:
    value = format_value(column, row.get(column))
    return {"world": f"world {value}", "op": f"op {value}"}.get(column, value)


def _label_columns(frame: pd.DataFrame, name: str, context: list[str], several_sources: bool) -> list[str]:
    """The columns that tell a table's shapes apart: source (several files), model, op (TP), layer and seq (TP) or
    tokens and routing (MoE), world and dtype where they vary, and m x n x k where those do not tell every shape
    apart or a shape is a custom one (a table of custom shapes alone: m x n x k instead of layer and seq)."""
    columns = (["source"] if several_sources else []) + [c for c in ("model", "op") if c not in context]
    if name != "tp":
        columns = [c for c in columns if c != "op"]  # one op per MoE table: its title names it
    custom = name == "tp" and bool((frame["model"] == "custom").all()) and bool((frame["layer"] == "custom").all())
    columns += [] if custom else ["layer", "seq"] if name == "tp" else ["tokens", "routing"]
    columns += [c for c in ("world", "dtype") if c not in context and c in frame]
    shape_ids = frame[[c for c in SHAPE_COLUMNS if c in frame]].astype(str).drop_duplicates()
    labelled = frame[columns].astype(str).drop_duplicates()
    if len(labelled) < len(shape_ids) or (frame["model"] == "custom").any():
        columns.append("mnk")
    return columns


def _label_header(column: str) -> str:
    return {"mnk": "m x n x k"}.get(column, column)


def _label_cell(column: str, row: dict) -> str:
    if column == "mnk":
        return f"{row['m']}x{row['n']}x{row['k']}"
    if column == "world":
        return f"W{row['world']}"
    return format_value(column, row.get(column))


def _configs_by_op_impl(rows: list[dict]) -> dict[tuple, list]:
    """(op, impl) -> the configs it ran with, in order of first appearance."""
    configs: dict[tuple, list] = {}
    for row in rows:
        seen = configs.setdefault((row["op"], row["impl"]), [])
        if row.get(CONFIG_COLUMN) not in seen:
            seen.append(row.get(CONFIG_COLUMN))
    return configs


def _impl_columns(rows: list[dict], configs: dict, baseline: str | None) -> tuple[list[tuple[str, int]], list[str]]:
    """(impl, variant) per column, the baseline first, and the legend lines of the variants. Variant 0: the impl ran
    with one config in every op; else the number of its config among those it ran with in an op."""
    with_variants = {impl for (_, impl), seen in configs.items() if len(seen) > 1}
    impls = list(dict.fromkeys(row["impl"] for row in rows))
    if baseline in impls:
        impls.remove(baseline)
        impls.insert(0, baseline)
    columns, legend = [], []
    for impl in impls:
        if impl not in with_variants:
            columns.append((impl, 0))
            continue
        count = max(len(seen) for (_, name), seen in configs.items() if name == impl)
        for variant in range(1, count + 1):
            columns.append((impl, variant))
            parts = [f"{op} {seen[variant - 1] or 'no config'}" for (op, name), seen in configs.items()
                     if name == impl and len(seen) >= variant]
            legend.append(f"{impl} #{variant}: " + "; ".join(parts))
    return columns, legend


def _shapes(rows: list[dict], several_sources: bool) -> list[list[dict]]:
    """The rows of each shape, shapes in order of first appearance; with several sources, a shape's lines of each
    source one after the other."""
    by_shape: dict[tuple, list[dict]] = {}
    for row in rows:
        by_shape.setdefault(tuple(str(row.get(c)) for c in SHAPE_COLUMNS), []).append(row)
    shapes = list(by_shape.values())
    if several_sources:
        first = {}
        for index, shape in enumerate(shapes):
            first.setdefault(tuple(str(shape[0].get(c)) for c in SHAPE_COLUMNS if c != "source"), index)
        shapes.sort(key=lambda shape: first[tuple(str(shape[0].get(c)) for c in SHAPE_COLUMNS if c != "source")])
    return shapes


def _column_of(row: dict, columns: list[tuple[str, int]], configs: dict) -> tuple[str, int]:
    """The (impl, variant) column of ``row``."""
    if (row["impl"], 0) in columns:
        return row["impl"], 0
    return row["impl"], configs[(row["op"], row["impl"])].index(row.get(CONFIG_COLUMN)) + 1


def _impl_cells(shape: list[dict], columns: list[tuple[str, int]], configs: dict, baseline: str | None,
                notes: Notes) -> list[Text]:
    by_column = {_column_of(row, columns, configs): row for row in shape}
    times = [row["time_ms"] for row in shape if _time(row) is not None]
    fastest = min(times) if len(times) > 1 else None
    cells = []
    for impl, variant in columns:
        row = by_column.get((impl, variant))
        cells.append(Text("") if row is None else _impl_cell(row, impl == baseline, fastest, notes))
    return cells


def _time(row: dict) -> float | None:
    value = row.get("time_ms")
    ok = row["status"] == "ok" and value is not None and not pd.isna(value) and value > 0
    return value if ok else None


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def _impl_cell(row: dict, is_baseline: bool, fastest: float | None, notes: Notes) -> Text:
    time_ms = _time(row)
    if time_ms is None:
        status = row["status"] if row["status"] in STATUS_WORDS else "failed"
        reason = format_value("reason", row.get("reason"))
        number = notes.number(row["impl"], row["status"], reason)
        return Text(f"{STATUS_WORDS[status]} [{number}]", style="red" if status == "failed" else "yellow")
    cell = Text(_ms(time_ms), style="bold" if time_ms == fastest else "")
    speedup = row.get("speedup")
    if not is_baseline and speedup is not None and not pd.isna(speedup):
        cell.append(" ")
        cell.append(f"{speedup:.3f}x", style="green" if speedup > 1 else "red" if speedup < 1 else "")
    return cell


def _impl_headers(columns: list[tuple[str, int]], cells_widths: list[int], room: int) -> list[str]:
    """The headers of the implementations' columns for ``room`` columns of console (their cells', their padding's
    and rules' share): the names whole where they fit; else broken over lines (``_impl_header``) one at a time,
    those that widen their column most first; else broken at every '-' and '+'."""
    headers = [impl + (f" #{variant}" if variant else "") for impl, variant in columns]

    def needed() -> int:
        return sum(max(width, *map(len, header.split("\n"))) for width, header in zip(cells_widths, headers)) + \
            GAP * (len(headers) - 1)

    by_excess = sorted(range(len(headers)), key=lambda index: len(headers[index]) - cells_widths[index], reverse=True)
    for index in by_excess:
        if needed() <= room or len(headers[index]) <= cells_widths[index]:
            break
        headers[index] = _impl_header(*columns[index], cells_widths[index])
    if needed() > room:
        headers = [_impl_header(impl, variant, 0) for impl, variant in columns]
    return headers


def _impl_header(impl: str, variant: int, width: int) -> str:
    """The impl's name, broken after '-' or '+' into lines no wider than ``width`` (the column's cells, at least
    6), so that long names do not widen a column: "fixed-role-best" over "1.071 1.130x" is "fixed-role-" / "best";
    ``width`` 0 breaks at every '-' and '+'."""
    name = impl + (f" #{variant}" if variant else "")
    limit = max(width, 6) if width else 0
    if len(name) <= limit:
        return name
    pieces, piece = [], ""
    for char in name:
        piece += char
        if char in "-+ ":
            pieces.append(piece)
            piece = ""
    pieces.append(piece)
    lines = [""]
    for piece in pieces:
        if lines[-1] and len(lines[-1]) + len(piece.rstrip()) > limit:
            lines.append("")
        lines[-1] += piece
    return "\n".join(line.strip() for line in lines)


def _geomean_rows(rows: list[dict], labels: list[str], columns: list[tuple[str, int]], configs: dict,
                  several_sources: bool, family_baseline: str | None) -> list[list[Text]]:
    """The footer: per source, the geomean speedup and overlap efficiency over each column's ok rows; no overlap
    line for TP rows all at world 1 (no communication to overlap: it would repeat the speedup over cuBLAS)."""
    sources = list(dict.fromkeys(row["source"] for row in rows))
    metrics = [("speedup", "speedup", "{:.3f}x"), ("overlap_efficiency", "overlap", "{:.3f}")]
    if all(row["bench"] == "tp" and row.get("world") == 1 for row in rows):
        metrics = metrics[:1]
    out = []
    for source in sources:
        mine = [row for row in rows if row["source"] == source and row["status"] == "ok"]
        for metric, word, fmt in metrics:
            values = []
            for column in columns:
                if metric == "speedup" and column[0] == family_baseline:
                    values.append("")  # 1 by definition
                    continue
                value = geomean(pd.Series([row[metric] for row in mine if _column_of(row, columns, configs) == column],
                                          dtype="float64"))
                values.append("" if math.isnan(value) else fmt.format(value))
            if not any(values):
                continue
            label = _footer_labels(labels, source if several_sources else None, word)
            out.append([Text(text, style="italic") for text in label] + [Text(value) for value in values])
    return out


def _footer_labels(labels: list[str], source: str | None, word: str) -> list[str]:
    """The label cells of a geomean line: the source (several files), then "geomean" and the metric, spread over
    the label columns so that no label column widens much."""
    cells = [""] * len(labels)
    start = 0
    if source is not None:
        cells[0], start = source, 1
    free = len(labels) - start
    if free >= 2:
        cells[start], cells[start + 1] = "geomean", word
    elif free == 1:
        cells[start] = f"geomean {word}"
    return cells
