"""The report's PNG charts, drawn with matplotlib when it is installed (the ``plot`` extra): the speedup per
shape of a results table, and the per-program timeline of a trace file (one panel per rank)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import numpy as np
import pandas as pd

from .load import Trace, load_trace
from .schema import BASELINE_IMPLS, ReportError, format_value


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _new_figure(figsize: tuple[float, float]):
    """A matplotlib Figure drawn by the Agg backend (no pyplot, no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig


def _shape_label(row: dict, with_source: bool) -> str:
    label = f"{row['op']}/{format_value('layer', row['layer'])} {row['m']}x{row['n']}x{row['k']} W{row['world']}"
    routing = format_value("routing", row.get("routing"))
    if routing:
        label += f" {routing}"
    return f"{row['source']}: {label}" if with_source else label


def speedup_chart(df: pd.DataFrame, path: str | Path) -> bool:
    """Bar chart of speedup per shape per non-baseline impl; False when matplotlib is missing."""
    if not _has_matplotlib():
        return False
    with_source = df["source"].nunique() > 1
    bars = df[(df["status"] == "ok") & df["speedup"].notna() & ~df["impl"].isin(BASELINE_IMPLS)]
    labels = list(dict.fromkeys(_shape_label(row, with_source) for row in bars.to_dict("records")))
    impls = list(dict.fromkeys(bars["impl"]))

    fig = _new_figure((max(6.0, 0.35 * len(labels) * max(len(impls), 1) + 2), 5))
    ax = fig.add_subplot()
    if impls:
        _draw_speedup_bars(ax, bars, labels, impls, with_source)
    else:
        ax.text(0.5, 0.5, "no ok rows with a speedup", ha="center", va="center", transform=ax.transAxes)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_ylabel("speedup vs baseline (higher is better)")
    ax.set_title("Speedup per shape")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def _draw_speedup_bars(ax, bars: pd.DataFrame, labels: list[str], impls: list[str], with_source: bool) -> None:
    positions = np.arange(len(labels))
    width = 0.8 / len(impls)
    for index, impl in enumerate(impls):
        speedup_by_label = {
            _shape_label(row, with_source): row["speedup"] for row in bars[bars["impl"] == impl].to_dict("records")
        }
        heights = [speedup_by_label.get(label, math.nan) for label in labels]
        ax.bar(positions + (index - (len(impls) - 1) / 2) * width, heights, width, label=impl)
    ax.set_xticks(positions, labels, rotation=30, ha="right", fontsize=8)
    ax.margins(y=0.15)
    ax.legend(fontsize=8, loc="upper left", ncols=min(len(impls), 4))


def timeline_chart(trace_path: str | Path, png_path: str | Path) -> Path:
    """Gantt chart of a trace: one panel per rank, y = program, x = µs since the rank's first start."""
    trace = load_trace(Path(trace_path))
    if not _has_matplotlib():
        raise ReportError("timeline charts need matplotlib")
    from matplotlib.patches import Patch

    colors = _kind_colors(trace)
    heights = [_panel_height(events) for _, events in trace.ranks]
    fig = _new_figure((12, sum(heights) + 1.2))
    axes = fig.subplots(len(trace.ranks), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (rank, events) in zip(axes, trace.ranks):
        _draw_rank_timeline(ax, rank, events, colors)
    axes[-1].set_xlabel("time since the rank's first start (µs)")
    handles = [Patch(color=color, label=_kind_name(trace, kind)) for kind, color in colors.items()]
    fig.legend(handles=handles, loc="upper right", ncols=len(handles))
    fig.suptitle(trace.title, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.96))
    fig.savefig(png_path, dpi=120)
    return Path(png_path)


def _kind_name(trace: Trace, kind: int) -> str:
    return trace.kind_names.get(kind, f"kind {kind}")


def _kind_colors(trace: Trace) -> dict[int, tuple]:
    """A colour per kind: light grey for idle/wait kinds, tab10 colours for the others."""
    from matplotlib import colormaps

    used = {int(kind) for _, events in trace.ranks for kind in np.unique(events[:, 1])}
    palette = colormaps["tab10"]
    colors, busy_kinds = {}, 0
    for kind in sorted(set(trace.kind_names) | used):
        name = _kind_name(trace, kind).lower()
        if "idle" in name or "wait" in name:
            colors[kind] = (0.8, 0.8, 0.8, 1.0)
        else:
            colors[kind] = palette(busy_kinds % palette.N)
            busy_kinds += 1
    return colors


def _panel_height(events: np.ndarray) -> float:
    programs = len(np.unique(events[:, 0])) if len(events) else 1
    return min(6.0, max(1.5, 0.15 * programs + 0.8))


def _draw_rank_timeline(ax, rank: int, events: np.ndarray, colors: dict[int, tuple]) -> None:
    from matplotlib.collections import PolyCollection
    from matplotlib.ticker import MaxNLocator

    ax.set_ylabel(f"rank {rank}\nprogram")
    if not len(events):
        ax.text(0.5, 0.5, "no events", ha="center", va="center", transform=ax.transAxes)
        return
    origin = events[:, 3].min()
    starts_us = (events[:, 3] - origin) / 1e3
    ends_us = (events[:, 4] - origin) / 1e3
    programs = events[:, 0]
    for kind in np.unique(events[:, 1]).astype(int):
        selected = events[:, 1] == kind
        ax.add_collection(PolyCollection(
            _bar_vertices(starts_us[selected], ends_us[selected], programs[selected]),
            facecolors=colors[kind], edgecolors="none", linewidths=0,
        ))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(0, max(ends_us.max(), 1e-3))
    ax.set_ylim(programs.max() + 0.6, programs.min() - 0.6)


def _bar_vertices(starts: np.ndarray, ends: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rectangles [start, end] x [row - 0.4, row + 0.4] as an array of shape [E, 4, 2]."""
    bottom, top = rows - 0.4, rows + 0.4
    corners = [(starts, bottom), (ends, bottom), (ends, top), (starts, top)]
    return np.stack([np.column_stack(corner) for corner in corners], axis=1)
