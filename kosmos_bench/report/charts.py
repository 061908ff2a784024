"""The report's PNG charts, drawn with matplotlib when it is installed (the ``plot`` extra).

* ``speedup_chart`` -- each run's headline per shape: a panel per op, dtype and direction (the tables of the
  compact view), each against its own baseline (TP ops vs nccl+cublas, the MoE layer vs nccl-a2a, the expert
  GEMMs alone vs grouped-mm; TP rows of kosmos alone at world 1 vs cuBLAS alone, t_gemm_ms / time_ms: never one
  axis). Bars start at the baseline's 1.0 (up: faster), the y range fits the values rather than starting at 0,
  the suite's targets that apply are red lines, the legend gives each implementation's geomean, and few bars carry
  their values. A panel of many shapes wraps into several rows rather than one wide strip; narrow panels stand in
  two columns; machine, models, dtypes and commit are in the title.
* ``loss_chart`` -- the training figure of a ``kosmos bench train`` table, a row per proxy: each implementation's
  step-time speedup over the baseline (with its step time and tokens/s per GPU), and its loss minus the baseline's
  per step (two loss curves would lie on each other).
* ``timeline_chart`` -- the per-program timeline of a trace file (``bench --trace``): one panel per rank on one
  shared time axis, compute, communication, waiting and idle in distinct colour families, a legend of the kinds
  drawn.

Colours are fixed per name across every chart: ``IMPL_COLORS`` for implementations (each its own, the baselines
greys), ``KIND_COLORS`` for trace kinds; a name not in them gets a colour from a deterministic hash of the name
(``impl_color``, ``kind_color``). The figures are built by ``_speedup_figure`` / ``_loss_figure`` /
``_timeline_figure`` (matplotlib ``Figure`` objects, Agg backend, no pyplot), which the tests inspect; the public
functions only save them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from .compact import CUBLAS_ALONE, comparison_name, families
from .load import Trace, load_trace
from .schema import (BASELINE_IMPLS, CONFIG_COLUMN, DEFAULT_DIRECTION, EXPERT_GEMM_OP, TRAIN_GROUP, ReportError,
                     format_value)
from .tables import geomean
from .targets import target_of

DPI = 120
MAX_WIDTH_IN = 15.0  # 1800 px at DPI

# one colour per implementation, the same in every chart (kosmos and its expert GEMMs: blues)
# (the baselines: greys, each its own)
IMPL_COLORS = {
    "kosmos": "#1f4e9c",
    "kosmos-expert-gemms": "#4f8fd9",
    "torch-async-tp": "#f28e2b",
    "fixed-role": "#8c6bb1",
    "fixed-role-best": "#9c755f",
    "deepep": "#59a14f",
    "triton-dot-scaled": "#e15759",
    "fp8-rowwise": "#17becf",
    "nccl+cublas": "#4d4d4d",
    "nccl-a2a": "#7a7a7a",
    "grouped-mm": "#a6a6a6",
    "cuBLAS alone": "#262626",
}
# colours for implementations not named above, picked by a hash of the name (stable across runs and machines)
_EXTRA_IMPL_COLORS = ("#edc948", "#76b7b2", "#b07aa1", "#ff9da7", "#bcbd22", "#86bcb6", "#d37295", "#a0cbe8")
TARGET_COLOR = "#c0392b"  # the suite's targets
_CONFIG_HATCHES = ("", "//", "..", "xx", "\\\\", "oo")

OP_TITLES = {
    "ag_gemm": "AllGather+GEMM",
    "gemm_rs": "GEMM+ReduceScatter",
    "moe_fwd": "MoE layer",
    "moe_experts": "MoE expert GEMMs alone",
}

# trace kinds: the family decides the hue (compute: blues/teal, communication and data movement: oranges/reds,
# waiting: mid grey, idle: near-white); runtime.TRACE_KINDS names them, the MoE kernel's stages included
KIND_FAMILY = {
    "compute": "compute", "gemm1": "compute", "gemm2": "compute", "route": "compute",
    "comm": "comm", "permute": "comm", "fold": "comm",
    "wait": "wait", "idle/wait": "wait",
    "idle": "idle",
}
KIND_COLORS = {
    "compute": "#3274c2", "gemm1": "#1d4f91", "gemm2": "#6aa5e3", "route": "#2a9d8f",
    "comm": "#e8590c", "permute": "#f4a261", "fold": "#b5361f",
    "wait": "#9a9a9a", "idle/wait": "#9a9a9a",
    "idle": "#ececec",
}
FAMILY_TITLES = {"compute": "compute", "comm": "communication / data movement", "wait": "waiting", "idle": "idle"}
_FAMILY_ORDER = ("compute", "comm", "wait", "idle")
_FAMILY_EXTRA_COLORS = {
    "compute": ("#08519c", "#4292c6", "#41ab5d", "#238b45", "#9ecae1"),
    "comm": ("#d94801", "#fd8d3c", "#cb181d", "#fdae6b", "#a63603"),
    "wait": ("#9a9a9a",),
    "idle": ("#ececec",),
}
_COMM_WORDS = ("comm", "send", "recv", "push", "pull", "gather", "scatter", "reduce", "a2a", "dispatch",
               "combine", "copy")


def _has_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _stable_index(name: str, modulo: int) -> int:
    return int(hashlib.sha1(name.encode("utf-8")).hexdigest(), 16) % modulo


def impl_color(impl: str) -> str:
    """The colour of an implementation in every chart: ``IMPL_COLORS``, else one picked by a hash of the name."""
    return IMPL_COLORS.get(impl) or _EXTRA_IMPL_COLORS[_stable_index(impl, len(_EXTRA_IMPL_COLORS))]


def kind_family(name: str) -> str:
    """"compute", "comm", "wait" or "idle" for a trace kind name (unknown names by the words in them)."""
    name = name.lower()
    if name in KIND_FAMILY:
        return KIND_FAMILY[name]
    if "wait" in name:
        return "wait"
    if "idle" in name:
        return "idle"
    return "comm" if any(word in name for word in _COMM_WORDS) else "compute"


def kind_color(name: str) -> str:
    """The colour of a trace kind in every timeline: ``KIND_COLORS``, else a hashed colour of its family's hue."""
    if name.lower() in KIND_COLORS:
        return KIND_COLORS[name.lower()]
    palette = _FAMILY_EXTRA_COLORS[kind_family(name)]
    return palette[_stable_index(name.lower(), len(palette))]


def _new_figure(figsize: tuple[float, float], layout: str | None = "constrained"):
    """A matplotlib Figure drawn by the Agg backend (no pyplot, no global backend switch)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=DPI, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: str | Path) -> Path:
    """Write the figure as PNG at DPI, creating the folder; an unwritable path is a ReportError naming it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI)
    except OSError as error:
        raise ReportError(f"{path}: cannot write the chart ({error.strerror or error})") from error
    return path


def _unique(values) -> list:
    """The distinct non-missing values in order of appearance."""
    seen = []
    for value in values:
        if value is None or (not isinstance(value, str) and pd.isna(value)) or value == "":
            continue
        if value not in seen:
            seen.append(value)
    return seen


# --------------------------------------------------------------------------- speedup chart


def speedup_chart(df: pd.DataFrame, path: str | Path) -> bool:
    """The speedup chart of a results table (see the module docstring); False when matplotlib is missing."""
    if not _has_matplotlib():
        return False
    _save(_speedup_figure(df), path)
    return True


@dataclass
class Panel:
    """One comparison of the speedup chart: an op at one dtype and direction against its baseline; ``rows`` are
    the other implementations' rows (their ``speedup`` over the baseline), sorted by shape; ``targets`` the suite's
    bars that apply, as (value, legend label, line style)."""
    bench: str
    op: str
    baseline: str
    dtype: str
    direction: str
    rows: pd.DataFrame
    targets: list[tuple[float, str, str]]


def _panels(df: pd.DataFrame) -> list[Panel]:
    """A panel per table of the compact view (``compact.families``: per comparison, dtype and direction; kosmos
    alone at world 1 against cuBLAS alone) and op, the ops of ``OP_TITLES`` in that order."""
    panels = []
    for ((_, baseline), dtype, direction), rows in families(df).items():
        frame = pd.DataFrame(rows)
        for op, part in frame.groupby("op", sort=False):
            bars = part[part["impl"] != baseline]
            if bars.empty:
                continue
            panels.append(Panel(str(part["bench"].iloc[0]), op, baseline or "the baseline", dtype, direction,
                                _shape_sorted(bars), _targets(df, part, op, baseline, direction)))
    known = list(OP_TITLES)
    panels.sort(key=lambda panel: known.index(panel.op) if panel.op in known else len(known))
    return panels


def _targets(df: pd.DataFrame, rows: pd.DataFrame, op: str, baseline: str | None,
             direction: str) -> list[tuple[float, str, str]]:
    """The suite targets a panel is judged against (targets.py), as the report judges them: against cuBLAS alone
    the geomean bar and the floor of every shape; the expert GEMMs alone their share of grouped-mm; the TP ops and
    the MoE layer the geomean speedup of kosmos, for forward rows at world > 1 (lines.geomean_target_lines)."""
    sources = list(dict.fromkeys(zip(rows["source"], rows["bench"])))
    lines = []

    def add(key: str, label: str, style: str) -> None:
        values = {target_of(df, source, bench, key) for source, bench in sources} - {None}
        lines.extend((float(value), label.format(value), style) for value in sorted(values))

    if baseline == CUBLAS_ALONE:
        add("vs_cublas_geomean", "target: geomean >= {:.2f}", "--")
        add("vs_cublas_floor", "floor: every shape >= {:.2f}", ":")
    elif op == EXPERT_GEMM_OP:
        add("expert_gemm_share", "target: geomean >= {:.2f}", "--")
    elif direction == DEFAULT_DIRECTION and bool((pd.to_numeric(rows["world"]) > 1).any()):
        add("geomean_speedup", "target: kosmos geomean >= {:.2f}", "--")
    return lines


def _machine_text(df: pd.DataFrame) -> str:
    machines = []
    for gpu, count in df[["gpu", "gpu_count"]].drop_duplicates().itertuples(index=False):
        if gpu is None or (not isinstance(gpu, str) and pd.isna(gpu)):
            continue
        text = f"{int(count)}x {gpu}" if count is not None and not pd.isna(count) else str(gpu)
        if text not in machines:
            machines.append(text)
    return ", ".join(machines) or "GPU not recorded"


def _commit_text(df: pd.DataFrame) -> str:
    """Short git commits of the rows' runs; a row without one names its ``source_sha`` where the table has it."""
    commits = []
    for row in df.to_dict("records"):
        commit = row.get("git_commit")
        if isinstance(commit, str) and commit:
            text = f"commit {commit[:7]}"
        elif isinstance(row.get("source_sha"), str) and row["source_sha"]:
            text = f"source {row['source_sha'][:8]}"
        else:
            text = "commit not recorded"
        if text not in commits:
            commits.append(text)
    return ", ".join(commits)


def _speedup_title(df: pd.DataFrame) -> str:
    models = ", ".join(map(str, _unique(df["model"]))) or "no model"
    dtypes = ", ".join(map(str, _unique(df["dtype"])))
    return f"KOSMOS speedup per shape — {models} · {_machine_text(df)} · {dtypes} · {_commit_text(df)}"


def _int_text(value) -> str:
    return format_value("seq", value)


def _is_custom(row: dict) -> bool:
    return row.get("model") == "custom" and row.get("layer") in ("custom", None)


def _shape_label(row: dict, with_source: bool, with_world: bool) -> str:
    """Tick label of a shape, one short line per part: model, then layer and seq (MoE: tokens and routing); a
    custom shape (a grid) is m×n×k on one line."""
    lines = [f"{row['source']}" if with_source else None]
    if _is_custom(row):
        lines.append(f"{row['m']}×{row['n']}×{row['k']}")
    elif row.get("bench") == "moe":
        tokens = row.get("tokens") if row.get("tokens") is not None and not pd.isna(row.get("tokens")) \
            else row.get("seq")
        lines += [str(row.get("model") or ""), f"{_int_text(tokens)} tokens",
                  format_value("routing", row.get("routing")) or None]
    else:
        lines.append(str(row.get("model") or ""))
        layer = format_value("layer", row.get("layer"))
        lines.append(layer or None)
        seq = _int_text(row.get("seq"))
        lines.append(f"seq {seq}" if seq else None)
        if not layer or layer == "custom" or not seq:
            lines.append(f"{row['m']}x{row['n']}x{row['k']}")
    if with_world:
        lines.append(f"W={row['world']}")
    return ("  " if _is_custom(row) else "\n").join(line for line in lines if line)


def _series_of(panel: pd.DataFrame) -> list[tuple[str, str | None]]:
    """The (impl, config) bar series of a panel: implementations that have an ok speedup somewhere in it, kosmos
    first, then in the order of ``IMPL_COLORS``, then by name."""
    drawn = panel[(panel["status"] == "ok") & panel["speedup"].notna()]
    keys = list(dict.fromkeys(zip(drawn["impl"], map(_config_of, drawn[CONFIG_COLUMN]))))
    known = list(IMPL_COLORS)
    return sorted(keys, key=lambda key: (known.index(key[0]) if key[0] in known else len(known), key[0],
                                         "" if key[1] is None else str(key[1])))


def _config_of(value) -> str | None:
    return value if isinstance(value, str) and value else None


def _series_label(impl: str, config, several_configs: bool) -> str:
    return f"{impl} [{config}]" if several_configs and config is not None else impl


def _shape_sorted(panel: pd.DataFrame) -> pd.DataFrame:
    """The rows by source, model and layer (in order of appearance), then seq / tokens, then routing: the shapes of
    one model side by side, a layer's seqs in ascending order."""
    def appearance(column):
        order = {value: index for index, value in enumerate(_unique(panel[column]))} if column in panel else {}
        return [order.get(value, -1) for value in panel[column]] if column in panel else [0] * len(panel)

    def number(column):
        return [float(value) if value is not None and not pd.isna(value) else -1.0 for value in panel[column]] \
            if column in panel else [0.0] * len(panel)

    keys = pd.DataFrame({"source": appearance("source"), "model": appearance("model"), "layer": appearance("layer"),
                         "tokens": number("tokens"), "seq": number("seq"), "routing": appearance("routing"),
                         "m": number("m"), "n": number("n"), "k": number("k"), "world": number("world")},
                        index=panel.index)
    return panel.loc[keys.sort_values(list(keys.columns), kind="stable").index]


def _layout(series_count: int, rotated: bool) -> tuple[float, int]:
    """(inches per shape group, most groups in one panel row) for a panel of ``series_count`` bar series; the
    one-line labels of custom shapes stand upright, so their groups can be narrow."""
    group_in = max(0.24, 0.16 * series_count + 0.08) if rotated else max(0.8, 0.16 * series_count + 0.3)
    usable_in = MAX_WIDTH_IN - 3.4  # y label and the legend at the right
    return group_in, max(1, int(usable_in // group_in))


def _speedup_figure(df: pd.DataFrame):
    """The speedup chart as a Figure: a panel (axes) per comparison (``_panels``) and wrap; two columns of panels
    where they are narrow. Each axes carries ``kosmos_op``, ``kosmos_baseline``, ``kosmos_dtype``,
    ``kosmos_direction`` and ``kosmos_targets`` for the tests."""
    with_source = df["source"].nunique() > 1
    plans = []  # (panel, labels chunk, series, part, parts, with_world, rotated)
    for panel in _panels(df):
        with_world = panel.rows["world"].nunique() > 1
        records = panel.rows.to_dict("records")
        rotated = all(_is_custom(row) for row in records)
        labels = list(dict.fromkeys(_shape_label(row, with_source, with_world) for row in records))
        series = _series_of(panel.rows)
        _, per_row = _layout(len(series), rotated)
        rows_needed = max(1, math.ceil(len(labels) / per_row))
        per_row = math.ceil(len(labels) / rows_needed) if labels else 1
        chunks = [labels[start:start + per_row] for start in range(0, len(labels), per_row)] or [[]]
        for part, chunk in enumerate(chunks, start=1):
            plans.append((panel, chunk, series, part, len(chunks), with_source, with_world, rotated))

    panel_width = 7.0
    for plan in plans:
        group_in, _ = _layout(len(plan[2]), plan[7])
        panel_width = max(panel_width, len(plan[1]) * group_in + 3.4)
    panel_width = min(panel_width, MAX_WIDTH_IN)
    columns = 2 if len(plans) >= 3 and 2 * panel_width <= MAX_WIDTH_IN else 1
    rows = max(1, math.ceil(len(plans) / columns))
    panel_in = 3.3 + (1.0 if any(plan[7] for plan in plans) else 0.0)
    width_in = panel_width * columns
    fig = _new_figure((width_in, panel_in * rows + 1.2))
    if not plans:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no rows to chart", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        axes = fig.subplots(rows, columns, squeeze=False).flatten()
        for ax, plan in zip(axes, plans):
            _draw_speedup_panel(ax, *plan)
        for ax in axes[len(plans):]:
            ax.set_axis_off()
    fig.suptitle(_wrapped(_speedup_title(df), width_in, 12), fontsize=12)
    cublas = "; cuBLAS alone = torch.matmul on the same operands, no collective (the rows' t_gemm_ms)" \
        if any(plan[0].baseline == CUBLAS_ALONE for plan in plans) else ""
    fig.supxlabel(_wrapped("bar = the baseline's time / the implementation's time at the same shape, drawn from the "
                           "baseline's 1.0 (dashed): up is faster, down slower; red lines: the suite's targets; "
                           f"× = failed, n/a = unavailable{cublas}", width_in, 8), fontsize=8, color="#444444")
    return fig


def _wrapped(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped to the figure's width (an average character is about 0.55 em wide)."""
    return textwrap.fill(text, width=max(20, int(width_in * 72 / (0.55 * fontsize)) - 4), break_on_hyphens=False)


def _panel_name(panel: Panel) -> str:
    """What a panel compares: "ag_gemm · AllGather+GEMM", "MoE layer backward", "MoE expert GEMMs alone, forward"."""
    if panel.bench == "tp" or panel.op not in ("moe_fwd", EXPERT_GEMM_OP):
        return f"{panel.op} · {OP_TITLES.get(panel.op, panel.op)}"
    return comparison_name("moe_fwd" if panel.op == "moe_fwd" else EXPERT_GEMM_OP, panel.direction)


def _baseline_text(panel: Panel) -> str:
    """The baseline as the y axis names it; cuBLAS alone is cuBLAS at bf16 for the other dtypes' rows."""
    if panel.baseline == CUBLAS_ALONE and panel.dtype != "bf16":
        return "cuBLAS bf16 alone"
    return panel.baseline


def _draw_speedup_panel(ax, panel: Panel, labels, series, part, parts, with_source, with_world, rotated) -> None:
    baseline = _baseline_text(panel)
    ax.kosmos_op, ax.kosmos_baseline = panel.op, panel.baseline
    ax.kosmos_dtype, ax.kosmos_direction, ax.kosmos_targets = panel.dtype, panel.direction, panel.targets
    worlds = _unique(panel.rows["world"])
    title = f"{_panel_name(panel)} · {panel.dtype} — vs {baseline}"
    if len(worlds) == 1:
        title += f" · W={worlds[0]}"
    if parts > 1:
        title += f"  ({part}/{parts})"
    ax.set_title(title, loc="left", fontsize=10)
    ax.set_ylabel(f"speedup vs {baseline}")
    ax.axhline(1.0, color="black", linewidth=0.9, linestyle="--", zorder=3)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)

    records = panel.rows.to_dict("records")
    label_of = [(_shape_label(row, with_source, with_world), row) for row in records]
    positions = np.arange(len(labels))
    configs_per_impl = {impl: sum(1 for key in series if key[0] == impl) for impl, _ in series}
    width = min(0.8 / max(len(series), 1), 0.45)
    drawn, bars = [1.0], 0
    for index, (impl, config) in enumerate(series):
        rows = {label: row for label, row in label_of if row["impl"] == impl and _config_of(row[CONFIG_COLUMN]) == config}
        offsets = positions + (index - (len(series) - 1) / 2) * width
        heights = np.array([rows[label]["speedup"] if label in rows and rows[label]["status"] == "ok" else math.nan
                            for label in labels], dtype=float)
        config_index = [key[1] for key in series if key[0] == impl].index(config)
        ok_speedups = pd.Series([row["speedup"] for row in rows.values() if row["status"] == "ok"], dtype=float)
        label = _series_label(impl, config, configs_per_impl[impl] > 1)
        ax.bar(offsets, heights - 1.0, width, bottom=1.0, color=impl_color(impl), edgecolor="white", linewidth=0.4,
               hatch=_CONFIG_HATCHES[config_index % len(_CONFIG_HATCHES)],
               label=f"{label} (geomean {geomean(ok_speedups):.3f})", zorder=2)
        drawn += [value for value in heights if not math.isnan(value)]
        bars += int((~np.isnan(heights)).sum())
        for offset, name, height in zip(offsets, labels, heights):
            row = rows.get(name)
            if row is not None and row["status"] != "ok":
                ax.text(offset, 1.0, "×" if row["status"] == "failed" else "n/a", ha="center", va="center",
                        fontsize=9 if row["status"] == "failed" else 7, color=impl_color(impl), zorder=4)
        ax.kosmos_bar_values = getattr(ax, "kosmos_bar_values", []) + [value for value in heights
                                                                        if not math.isnan(value)]
    for value, label, style in panel.targets:
        ax.axhline(value, color=TARGET_COLOR, linewidth=1.3, linestyle=style, label=label, zorder=3)
    limits = [*drawn, *(value for value, _, _ in panel.targets)]
    low, high = min(limits), max(limits)
    pad = max(0.08 * (high - low), 0.015)
    ax.set_ylim(low - pad, high + pad)
    if bars <= 24:  # few bars: each one's value on it
        for container in ax.containers:
            values = [1.0 + patch.get_height() for patch in container.patches]
            ax.bar_label(container, labels=["" if math.isnan(v) else f"{v:.3f}" for v in values], fontsize=7,
                         padding=1.5, color="#333333")
    group_of = {label: (row["source"], row.get("model")) for label, row in label_of}
    for index in range(1, len(labels)):
        if group_of[labels[index]] != group_of[labels[index - 1]]:  # a line between models (sources)
            ax.axvline(index - 0.5, color="#999999", linewidth=0.8, zorder=1)
    if rotated:
        ax.set_xticks(positions, labels, fontsize=7, rotation=90)
    else:
        ax.set_xticks(positions, labels, fontsize=8)
    ax.set_xlim(-0.6, max(len(labels), 1) - 0.4)
    note = _not_drawn_note(panel.rows, series)
    if not panel.targets:
        note = "; ".join(filter(None, [note, "no suite target for this comparison"]))
    ax.set_xlabel(_wrapped(note, ax.figure.get_figwidth() / (2 if ax.get_gridspec().ncols > 1 else 1) - 3.0, 8),
                  fontsize=8, color="#444444", loc="left")
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
                  title="implementation", title_fontsize=8)
    else:
        ax.text(0.5, 0.5, "no ok rows with a speedup", ha="center", va="center", transform=ax.transAxes)


def _not_drawn_note(panel: pd.DataFrame, series: list) -> str:
    """Which rows of the panel have no bar: implementations without an ok row (those of the same reason named
    together, e.g. "no bars, unavailable at every shape (6): torch-async-tp, fixed-role"), and the failed /
    unavailable counts of the others."""
    drawn = {impl for impl, _ in series}
    missing: dict[str, list[str]] = {}
    notes = []
    for impl, rows in panel.groupby("impl", sort=False):
        counts = rows["status"].value_counts()
        shapes = len(rows)
        bad = ", ".join(f"{status} at every shape ({shapes})" if counts[status] == shapes and shapes > 1 else
                        f"{status} at {counts[status]} shape{'s' if counts[status] > 1 else ''}"
                        for status in ("failed", "unavailable") if status in counts)
        if impl not in drawn:
            missing.setdefault(bad or "no speedup", []).append(impl)
        elif bad:
            notes.append(f"{impl}: {bad}")
    notes = [f"no bars, {why}: {', '.join(impls)}" for why, impls in missing.items()] + notes
    return "not drawn — " + "; ".join(notes) if notes else ""


# --------------------------------------------------------------------------- the training figure (bench train)


def loss_chart(df: pd.DataFrame, path: str | Path) -> bool:
    """The training figure of a train table (``report.train.train_table``, ``_loss_figure``); False when
    matplotlib is missing."""
    if not _has_matplotlib():
        return False
    _save(_loss_figure(df), path)
    return True


def _loss_figure(df: pd.DataFrame):
    """A row of two panels per proxy (TRAIN_GROUP). Left: each implementation's step-time speedup over the
    baseline (its median step time over theirs, a point; the whisker: over its p20 / p80 step times), with its
    step time and tokens/s per GPU beside it, on a y range that shows the differences; unavailable and failed
    ones named at 1.0. Right: each implementation's loss minus the baseline's per step, relative to the
    baseline's, against 0 (the curves themselves lie on each other), with the final losses."""
    keys = [c for c in TRAIN_GROUP if c in df]
    groups = list(df.groupby(keys, dropna=False, sort=False)) if not df.empty else []
    fig = _new_figure((12.0, 4.6 * max(1, len(groups)) + 0.4))
    axes = fig.subplots(max(1, len(groups)), 2, squeeze=False)
    for (speed_ax, loss_ax), (key, group) in zip(axes, groups):
        key = key if isinstance(key, tuple) else (key,)
        named = group[group["baseline"].astype(bool)]
        base = named[(named["status"] == "ok") & named["step_ms"].notna()]
        baseline = named["impl"].iloc[0] if len(named) else "the baseline"
        _draw_step_panel(speed_ax, group, base.iloc[0] if len(base) else None, baseline)
        _draw_loss_difference(loss_ax, group, base.iloc[0] if len(base) else None, baseline)
        what = " ".join(f"{c}={format_value(c, v)}" for c, v in zip(keys, key) if c != "source")
        speed_ax.set_title(_wrapped(f"{what}\nstep-time speedup over {baseline}", 5.6, 9), fontsize=9, loc="left")
    if not groups:
        axes[0][0].text(0.5, 0.5, "no train rows", ha="center", va="center", transform=axes[0][0].transAxes)
    machine = _machine_text(df) if {"gpu", "gpu_count"} <= set(df.columns) else ""
    fig.suptitle(f"KOSMOS training proxy — {machine} · {_commit_text(df)}".replace(" ·  · ", " · "), fontsize=11)
    return fig


def _draw_step_panel(ax, group: pd.DataFrame, base, baseline: str) -> None:
    """The step-time speedups of one proxy (``_loss_figure``)."""
    ax.axhline(1.0, color="black", linewidth=0.9, linestyle="--", zorder=1)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_ylabel(f"speedup vs {baseline} (baseline step / step)")
    rows = group.to_dict("records")
    values = [1.0]
    for x, row in enumerate(rows):
        color = impl_color(row["impl"])
        if base is None or row["status"] != "ok" or pd.isna(row.get("step_ms")):
            ax.text(x, 1.0, row["status"] if row["status"] != "ok" else "no baseline", ha="center", va="center",
                    fontsize=8, color=color, backgroundcolor="white", zorder=3)
            continue
        speedup = base["step_ms"] / row["step_ms"]
        low, high = (base["step_ms"] / row[c] if not pd.isna(row.get(c)) and row[c] else speedup
                     for c in ("step_p80_ms", "step_p20_ms"))
        ax.plot([x, x], [low, high], color=color, linewidth=2.0, label=row["impl"], zorder=2)
        ax.plot([x], [speedup], marker="o", markersize=8, color=color, zorder=3)
        tokens = "" if pd.isna(row.get("tokens_per_s")) else f"\n{row['tokens_per_s']:,.0f} tok/s/GPU"
        ax.annotate(f"{speedup:.3f}x\n{row['step_ms']:.2f} ms/step{tokens}", (x, speedup), xytext=(10, 0),
                    textcoords="offset points", va="center", fontsize=8, color="#222222",
                    bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.85, "pad": 1.0})
        values += [low, high]
    low, high = min(values), max(values)
    pad = max(0.25 * (high - low), 0.01)
    ax.set_ylim(low - pad, high + pad)
    ax.set_xticks(range(len(rows)), [row["impl"] for row in rows], fontsize=8)
    ax.set_xlim(-0.5, len(rows) - 0.2)
    if group["ranks_on_one_gpu"].any() if "ranks_on_one_gpu" in group else False:
        ax.set_xlabel("the ranks shared one GPU: step times are not measurements", fontsize=8, color="#b00020")


def _draw_loss_difference(ax, group: pd.DataFrame, base, baseline: str) -> None:
    """Each implementation's (loss - baseline's loss) / baseline's loss per recorded step (``_loss_figure``)."""
    from matplotlib.ticker import MaxNLocator

    ax.axhline(0.0, color="black", linewidth=0.9, linestyle="--", zorder=1)
    ax.grid(color="#dddddd", linewidth=0.6)
    ax.set_xlabel("step (after warm-up)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(f"(loss - {baseline}'s) / {baseline}'s")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    base_losses = np.asarray(base["losses"], dtype=float) if base is not None and base["losses"] else None
    finals = [] if base is None or pd.isna(base.get("final_loss")) else [f"{baseline} {base['final_loss']:.5f}"]
    drawn = 0
    for row in group.to_dict("records"):
        if row.get("baseline") or not row.get("losses") or base_losses is None:
            continue
        losses = np.asarray(row["losses"], dtype=float)
        steps = min(len(losses), len(base_losses))
        difference = (losses[:steps] - base_losses[:steps]) / base_losses[:steps]
        status = "" if row["status"] == "ok" else f" ({row['status']})"
        ax.plot(range(steps), difference, color=impl_color(row["impl"]), linewidth=1.6, marker="o", markersize=3,
                label=f"{row['impl']} - {baseline}{status}: largest {np.abs(difference).max():.2e}")
        if not pd.isna(row.get("final_loss")):
            finals.append(f"{row['impl']} {row['final_loss']:.5f}")
        drawn += 1
    ax.set_title(_wrapped("loss against the baseline's, relative, per step; final loss: " + ", ".join(finals),
                          5.6, 9), fontsize=9, loc="left")
    if drawn:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, f"no losses of {baseline} to compare with", ha="center", va="center",
                transform=ax.transAxes)


# --------------------------------------------------------------------------- timeline


def timeline_chart(trace_path: str | Path, png_path: str | Path) -> Path:
    """Gantt chart of a trace: one panel per rank (y = program) on one shared time axis, µs since the earliest
    event of any rank."""
    trace = load_trace(Path(trace_path))
    if not _has_matplotlib():
        raise ReportError("timeline charts need matplotlib")
    return _save(_timeline_figure(trace, _trace_header(Path(trace_path))), png_path)


def _trace_header(path: Path) -> dict:
    """The trace's top-level fields other than its events (layer, seq, tokens, routing... for the title)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return {key: value for key, value in data.items() if key != "ranks"} if isinstance(data, dict) else {}


def _timeline_title(trace: Trace, header: dict) -> str:
    if not header:
        return f"Timeline — {trace.title}"
    shape = [str(header["model"])] if header.get("model") else []
    if header.get("layer"):
        shape.append(str(header["layer"]))
    if header.get("seq") is not None:
        shape.append(f"seq {header['seq']}")
    if header.get("tokens") is not None:
        shape.append(f"{header['tokens']} tokens")
    if header.get("routing"):
        shape.append(f"{header['routing']} routing")
    parts = [str(header.get("op", "trace")), ", ".join(shape)]
    if all(header.get(key) is not None for key in ("m", "n", "k")):
        parts[-1] += f" (m={header['m']} n={header['n']} k={header['k']})"
    if header.get("impl"):
        parts.append(str(header["impl"]) + (f" {header['variant']}" if header.get("variant") else ""))
    if header.get("world") is not None:
        parts.append(f"W={header['world']}")
    return "Timeline — " + " · ".join(part for part in parts if part)


def _kind_name(trace: Trace, kind: int) -> str:
    return trace.kind_names.get(kind, f"kind {kind}")


def _drawn_kinds(trace: Trace) -> list[int]:
    """The kinds that occur in some rank's events, compute first, then communication, waiting, idle."""
    used = {int(kind) for _, events in trace.ranks for kind in np.unique(events[:, 1])}
    return sorted(used, key=lambda kind: (_FAMILY_ORDER.index(kind_family(_kind_name(trace, kind))), kind))


def _active_gap(trace: Trace, origin: float, end_us: float) -> tuple[float, float] | None:
    """The longest stretch (µs from origin) in which no rank computes or communicates (only waits, idles or has not
    started), when it is over half of the time axis: the chart compresses it."""
    intervals = []
    for _, events in trace.ranks:
        if not len(events):
            continue
        families = np.array([kind_family(_kind_name(trace, int(kind))) for kind in events[:, 1]])
        busy = events[np.isin(families, ("compute", "comm"))]
        intervals += list(zip((busy[:, 3] - origin) / 1e3, (busy[:, 4] - origin) / 1e3))
    if not intervals or end_us <= 0:
        return None
    intervals.sort()
    best, covered = (0.0, intervals[0][0]), intervals[0][1]  # from the axis start to the first busy event
    for start, stop in intervals[1:]:
        if start - covered > best[1] - best[0]:
            best = (covered, start)
        covered = max(covered, stop)
    if end_us - covered > best[1] - best[0]:
        best = (covered, end_us)
    return best if best[1] - best[0] > 0.5 * end_us else None


def _gap_functions(gap_start: float, gap_end: float, shown: float):
    """forward/inverse of a piecewise linear x scale drawing [gap_start, gap_end] ``shown`` µs wide."""
    removed = (gap_end - gap_start) - shown
    slope = shown / (gap_end - gap_start)

    def forward(x):
        x = np.asarray(x, dtype=float)
        return np.where(x <= gap_start, x, np.where(x >= gap_end, x - removed, gap_start + (x - gap_start) * slope))

    def inverse(y):
        y = np.asarray(y, dtype=float)
        return np.where(y <= gap_start, y, np.where(y >= gap_start + shown, y + removed,
                                                     gap_start + (y - gap_start) / slope))

    return forward, inverse


def _gap_ticks(gap: tuple[float, float], end_us: float) -> list[float]:
    from matplotlib.ticker import MaxNLocator

    left = [t for t in MaxNLocator(nbins=2).tick_values(0, gap[0]) if 0 <= t <= gap[0]] if gap[0] > 0 else [0.0]
    right = [t for t in MaxNLocator(nbins=8).tick_values(gap[1], end_us) if gap[1] <= t <= end_us]
    return sorted(set(left + right))


def _who_waits(trace: Trace, origin: float, gap: tuple[float, float]) -> str:
    """Which ranks wait through the compressed stretch and which have not started yet."""
    waiting, not_started = [], []
    for rank, events in trace.ranks:
        if not len(events) or (events[:, 3].min() - origin) / 1e3 >= gap[1] - 1e-6 * max(gap[1], 1):
            not_started.append(rank)
        else:
            waiting.append(rank)
    parts = []
    if waiting:
        parts.append(f"rank{'s' if len(waiting) > 1 else ''} {', '.join(map(str, waiting))} "
                     f"wait{'' if len(waiting) > 1 else 's'}")
    if not_started:
        parts.append(f"rank{'s' if len(not_started) > 1 else ''} {', '.join(map(str, not_started))} "
                     f"{'have' if len(not_started) > 1 else 'has'} not started")
    return ", ".join(parts)


def _timeline_figure(trace: Trace, header: dict | None = None):
    """The timeline as a Figure: one axes per rank, x shared (µs since the earliest event of any rank; a stretch
    over half the axis where no rank computes or communicates is drawn compressed and said so), a figure legend of
    the kinds drawn. Each axes carries ``kosmos_rank``; the figure ``kosmos_end_us`` and ``kosmos_gap_us``."""
    from matplotlib.patches import Patch

    header = header or {}
    nonempty = [events for _, events in trace.ranks if len(events)]
    origin = min(events[:, 3].min() for events in nonempty) if nonempty else 0.0
    end_us = max((events[:, 4].max() - origin) / 1e3 for events in nonempty) if nonempty else 1.0
    end_us = max(end_us, 1e-3)
    gap = _active_gap(trace, origin, end_us)

    heights = [_panel_height(events) for _, events in trace.ranks]
    scale = min(1.0, 13.0 / sum(heights))
    heights = [height * scale for height in heights]
    fig = _new_figure((MAX_WIDTH_IN, sum(heights) + 2.0))
    fig.kosmos_end_us, fig.kosmos_gap_us = end_us, gap
    axes = fig.subplots(len(trace.ranks), 1, squeeze=False, sharex=True,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    kinds = _drawn_kinds(trace)
    colors = {kind: kind_color(_kind_name(trace, kind)) for kind in kinds}
    for ax, (rank, events) in zip(axes, trace.ranks):
        _draw_rank_timeline(ax, rank, events, colors, origin)
    if gap is not None:
        shown = 0.04 * (end_us - (gap[1] - gap[0])) / 0.96
        for ax in axes:
            ax.set_xscale("function", functions=_gap_functions(gap[0], gap[1], shown))
            for edge in gap:
                ax.axvline(edge, color="black", linewidth=0.8, linestyle=":", zorder=3)
        axes[-1].set_xticks(_gap_ticks(gap, end_us))
    axes[-1].set_xlim(0, end_us)
    axes[-1].xaxis.set_major_formatter(_thousands)
    axes[-1].set_xlabel(_timeline_caption(trace, origin, gap), fontsize=9)
    handles = [Patch(facecolor=colors[kind], edgecolor="#777777" if kind_family(_kind_name(trace, kind)) == "idle"
                     else colors[kind], label=_legend_label(_kind_name(trace, kind))) for kind in kinds]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 9), fontsize=9,
                   frameon=False)
    fig.suptitle(_timeline_title(trace, header), fontsize=12)
    return fig


def _thousands(value, _position=None) -> str:
    return f"{value:,.0f}" if abs(value) >= 10 or value == 0 else f"{value:.2g}"


def _legend_label(name: str) -> str:
    family = kind_family(name)
    return name if name.lower() == family else f"{name} ({FAMILY_TITLES[family]})"


def _timeline_caption(trace: Trace, origin: float, gap) -> str:
    since = "the earliest event of any rank" if len(trace.ranks) > 1 else "the first event"
    lines = [f"time (µs) since {since}; blank = no event recorded"]
    if gap is not None:
        lines.append(f"axis compressed between the dotted lines: {gap[0]:,.0f}–{gap[1]:,.0f} µs "
                     f"({gap[1] - gap[0]:,.0f} µs): no rank computes or communicates ({_who_waits(trace, origin, gap)})")
    if len(trace.ranks) > 1:
        lines.append("each rank's times are its own GPU's %globaltimer: the GPUs' clocks are not synchronised, "
                     "so an offset between ranks is start skew plus an unknown clock offset")
    return "\n".join(lines)


def _panel_height(events: np.ndarray) -> float:
    programs = len(np.unique(events[:, 0])) if len(events) else 1
    return min(4.0, max(1.4, 0.022 * programs + 0.9))


def _draw_rank_timeline(ax, rank: int, events: np.ndarray, colors: dict[int, str], origin: float) -> None:
    from matplotlib.collections import PolyCollection
    from matplotlib.ticker import MaxNLocator

    ax.kosmos_rank = rank
    ax.set_ylabel(f"rank {rank}\nprogram")
    if not len(events):
        ax.set_title(f"rank {rank} · no events", loc="left", fontsize=9)
        ax.text(0.5, 0.5, "no events", ha="center", va="center", transform=ax.transAxes)
        return
    starts_us = (events[:, 3] - origin) / 1e3
    ends_us = (events[:, 4] - origin) / 1e3
    programs = events[:, 0]
    for kind in np.unique(events[:, 1]).astype(int):
        selected = events[:, 1] == kind
        ax.add_collection(PolyCollection(
            _bar_vertices(starts_us[selected], ends_us[selected], programs[selected]),
            facecolors=colors[kind], edgecolors="none", linewidths=0, closed=True,
        ))
    ax.set_title(f"rank {rank} · {len(np.unique(programs))} programs · first event at {starts_us.min():,.1f} µs, "
                 f"last ends at {ends_us.max():,.1f} µs", loc="left", fontsize=9)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(programs.max() + 0.6, programs.min() - 0.6)


def _bar_vertices(starts: np.ndarray, ends: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Rectangles [start, end] x [row - 0.4, row + 0.4] as an array of shape [E, 4, 2]."""
    bottom, top = rows - 0.4, rows + 0.4
    corners = [(starts, bottom), (ends, bottom), (ends, top), (starts, top)]
    return np.stack([np.column_stack(corner) for corner in corners], axis=1)
