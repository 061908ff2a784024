"""The report's PNG charts, drawn with matplotlib when it is installed (the ``plot`` extra).

* ``speedup_chart`` -- the speedup per shape of a results table (``build_table``): one panel per op kind, each
  against its own baseline (TP ops vs nccl+cublas, ``moe_fwd`` vs nccl-a2a, ``moe_experts`` vs grouped-mm: never
  one axis), a panel wrapped into several rows rather than one wide strip, the baseline named on the y axis and
  drawn as the line at 1.0, and machine, models, dtype and commit in the title.
* ``loss_chart`` -- the loss per step of each implementation of a ``kosmos bench train`` table, a panel per proxy.
* ``timeline_chart`` -- the per-program timeline of a trace file (``bench --trace``): one panel per rank on one
  shared time axis, compute, communication, waiting and idle in distinct colour families, a legend of the kinds
  drawn.

Colours are fixed per name across every chart: ``IMPL_COLORS`` for implementations, ``KIND_COLORS`` for trace
kinds; a name not in them gets a colour from a deterministic hash of the name (``impl_color``, ``kind_color``).
The figures are built by ``_speedup_figure`` / ``_timeline_figure`` (matplotlib ``Figure`` objects, Agg backend,
no pyplot), which the tests inspect; the public functions only save them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd

from .load import Trace, load_trace
from .schema import (BASELINE_IMPL, BASELINE_IMPL_BY_OP, BASELINE_IMPLS, CONFIG_COLUMN, TRAIN_GROUP, ReportError,
                     format_value)
from .tables import geomean

DPI = 120
MAX_WIDTH_IN = 15.0  # 1800 px at DPI

# one colour per implementation, the same in every chart (kosmos and its expert GEMMs: blues)
IMPL_COLORS = {
    "kosmos": "#1f4e9c",
    "kosmos-expert-gemms": "#4f8fd9",
    "torch-async-tp": "#f28e2b",
    "fixed-role": "#8c6bb1",
    "fixed-role-best": "#c2a5cf",
    "deepep": "#59a14f",
    "nccl+cublas": "#595959",
    "nccl-a2a": "#595959",
    "grouped-mm": "#595959",
}
# colours for implementations not named above, picked by a hash of the name (stable across runs and machines)
_EXTRA_IMPL_COLORS = ("#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bcbd22", "#17becf",
                      "#86bcb6", "#d37295")
_CONFIG_HATCHES = ("", "//", "..", "xx", "\\\\", "oo")

OP_TITLES = {
    "ag_gemm": "AllGather+GEMM",
    "gemm_rs": "GEMM+ReduceScatter",
    "moe_fwd": "MoE layer forward",
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
    """Bar chart of the speedup per shape of every non-baseline implementation (see the module docstring);
    False when matplotlib is missing."""
    if not _has_matplotlib():
        return False
    _save(_speedup_figure(df), path)
    return True


def _baseline_of(bench, op) -> str:
    return BASELINE_IMPL_BY_OP.get(op) or BASELINE_IMPL.get(bench) or "baseline"


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


def _shape_label(row: dict, with_source: bool, with_world: bool) -> str:
    """Tick label of a shape, one short line per part: model, then layer and seq (MoE: tokens and routing)."""
    lines = [f"{row['source']}" if with_source else None, str(row.get("model") or "")]
    if row.get("bench") == "moe":
        tokens = row.get("tokens") if row.get("tokens") is not None and not pd.isna(row.get("tokens")) \
            else row.get("seq")
        lines += [f"{_int_text(tokens)} tokens", format_value("routing", row.get("routing")) or None]
    else:
        layer = format_value("layer", row.get("layer"))
        lines.append(layer or None)
        seq = _int_text(row.get("seq"))
        lines.append(f"seq {seq}" if seq else None)
        if not layer or layer == "custom" or not seq:
            lines.append(f"{row['m']}x{row['n']}x{row['k']}")
    if with_world:
        lines.append(f"W={row['world']}")
    return "\n".join(line for line in lines if line)


def _series_of(panel: pd.DataFrame) -> list[tuple[str, str | None]]:
    """The (impl, config) bar series of a panel: non-baseline implementations that have an ok speedup somewhere in
    it, kosmos first, then in the order of ``IMPL_COLORS``, then by name."""
    drawn = panel[(panel["status"] == "ok") & panel["speedup"].notna()]
    keys = list(dict.fromkeys(zip(drawn["impl"], map(_config_of, drawn[CONFIG_COLUMN]))))
    known = list(IMPL_COLORS)
    return sorted(keys, key=lambda key: (known.index(key[0]) if key[0] in known else len(known), key[0],
                                         "" if key[1] is None else str(key[1])))


def _config_of(value) -> str | None:
    return value if isinstance(value, str) and value else None


def _series_label(impl: str, config, several_configs: bool) -> str:
    return f"{impl} [{config}]" if several_configs and config is not None else impl


def _panels(df: pd.DataFrame):
    """(bench, op, rows without baselines) per op kind: the ops of ``OP_TITLES`` in that order, then the others in
    order of appearance; the rows of a panel sorted by shape (``_shape_sorted``)."""
    rows = df[~df["impl"].isin(BASELINE_IMPLS)]
    groups = list(rows.groupby(["bench", "op"], sort=False, dropna=False))
    known = list(OP_TITLES)
    groups.sort(key=lambda item: known.index(item[0][1]) if item[0][1] in known else len(known))
    for (bench, op), panel in groups:
        yield bench, op, _shape_sorted(panel)


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


def _layout(series_count: int) -> tuple[float, int]:
    """(inches per shape group, most groups in one panel row) for a panel of ``series_count`` bar series."""
    group_in = max(0.8, 0.16 * series_count + 0.3)
    usable_in = MAX_WIDTH_IN - 3.4  # y label and the legend at the right
    return group_in, max(1, int(usable_in // group_in))


def _speedup_figure(df: pd.DataFrame):
    """The speedup chart as a Figure: one panel (row of axes) per op kind and wrap; each axes carries
    ``kosmos_op`` and ``kosmos_baseline`` attributes for the tests."""
    with_source = df["source"].nunique() > 1
    plans = []  # (bench, op, panel, labels chunk, series, part, parts)
    for bench, op, panel in _panels(df):
        with_world = panel["world"].nunique() > 1
        labels = list(dict.fromkeys(_shape_label(row, with_source, with_world) for row in panel.to_dict("records")))
        series = _series_of(panel)
        _, per_row = _layout(len(series))
        rows_needed = max(1, math.ceil(len(labels) / per_row))
        per_row = math.ceil(len(labels) / rows_needed) if labels else 1
        chunks = [labels[start:start + per_row] for start in range(0, len(labels), per_row)] or [[]]
        for part, chunk in enumerate(chunks, start=1):
            plans.append((bench, op, panel, chunk, series, part, len(chunks), with_source, with_world))

    width_in = 7.0
    for plan in plans:
        group_in, _ = _layout(len(plan[4]))
        width_in = max(width_in, len(plan[3]) * group_in + 3.4)
    width_in = min(width_in, MAX_WIDTH_IN)
    panel_in = 3.3
    fig = _new_figure((width_in, panel_in * max(len(plans), 1) + 1.0))
    if not plans:
        ax = fig.add_subplot()
        ax.text(0.5, 0.5, "no rows to chart", ha="center", va="center", transform=ax.transAxes)
        ax.set_axis_off()
    else:
        axes = fig.subplots(len(plans), 1, squeeze=False)[:, 0]
        for ax, plan in zip(axes, plans):
            _draw_speedup_panel(ax, *plan)
    fig.suptitle(_wrapped(_speedup_title(df), width_in, 12), fontsize=12)
    fig.supxlabel(_wrapped("bar = baseline time / implementation time at the same shape (higher is better); dashed "
                           "line = the baseline (1.0); × = failed, n/a = unavailable", width_in, 8),
                  fontsize=8, color="#444444")
    return fig


def _wrapped(text: str, width_in: float, fontsize: float) -> str:
    """``text`` wrapped to the figure's width (an average character is about 0.55 em wide)."""
    return textwrap.fill(text, width=max(20, int(width_in * 72 / (0.55 * fontsize)) - 4), break_on_hyphens=False)


def _draw_speedup_panel(ax, bench, op, panel, labels, series, part, parts, with_source, with_world) -> None:
    baseline = _baseline_of(bench, op)
    ax.kosmos_op, ax.kosmos_baseline = op, baseline
    worlds = _unique(panel["world"])
    title = f"{op} · {OP_TITLES.get(op, op)} — vs {baseline}"
    if len(worlds) == 1:
        title += f" · W={worlds[0]}"
    if parts > 1:
        title += f"  ({part}/{parts})"
    ax.set_title(title, loc="left", fontsize=10)
    ax.set_ylabel(f"speedup vs {baseline}")
    ax.axhline(1.0, color="black", linewidth=0.9, linestyle="--", zorder=3)
    ax.grid(axis="y", color="#dddddd", linewidth=0.6)
    ax.set_axisbelow(True)

    records = panel.to_dict("records")
    label_of = [(_shape_label(row, with_source, with_world), row) for row in records]
    positions = np.arange(len(labels))
    configs_per_impl = {impl: sum(1 for key in series if key[0] == impl) for impl, _ in series}
    width = min(0.8 / max(len(series), 1), 0.45)
    top = 1.0
    for index, (impl, config) in enumerate(series):
        rows = {label: row for label, row in label_of if row["impl"] == impl and _config_of(row[CONFIG_COLUMN]) == config}
        offsets = positions + (index - (len(series) - 1) / 2) * width
        heights = [rows[label]["speedup"] if label in rows and rows[label]["status"] == "ok" else math.nan
                   for label in labels]
        config_index = [key[1] for key in series if key[0] == impl].index(config)
        ok_speedups = pd.Series([row["speedup"] for row in rows.values() if row["status"] == "ok"], dtype=float)
        label = _series_label(impl, config, configs_per_impl[impl] > 1)
        ax.bar(offsets, heights, width, color=impl_color(impl), edgecolor="white", linewidth=0.4,
               hatch=_CONFIG_HATCHES[config_index % len(_CONFIG_HATCHES)],
               label=f"{label} (geomean {geomean(ok_speedups):.3f})", zorder=2)
        top = max(top, np.nanmax(heights) if not np.isnan(heights).all() else top)
        for offset, name in zip(offsets, labels):
            row = rows.get(name)
            if row is not None and row["status"] != "ok":
                ax.text(offset, 0.02, "×" if row["status"] == "failed" else "n/a", ha="center", va="bottom",
                        fontsize=9 if row["status"] == "failed" else 7, color=impl_color(impl), zorder=4)
    group_of = {label: (row["source"], row.get("model")) for label, row in label_of}
    for index in range(1, len(labels)):
        if group_of[labels[index]] != group_of[labels[index - 1]]:  # a line between models (sources)
            ax.axvline(index - 0.5, color="#999999", linewidth=0.8, zorder=1)
    ax.set_xticks(positions, labels, fontsize=8)
    ax.set_xlim(-0.6, max(len(labels), 1) - 0.4)
    ax.set_ylim(0, top * 1.12)
    ax.set_xlabel(_wrapped(_not_drawn_note(panel, series), ax.figure.get_figwidth() - 3.0, 8), fontsize=8,
                  color="#444444", loc="left")
    if series:
        ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False,
                  title="implementation", title_fontsize=8)
    else:
        ax.text(0.5, 0.5, "no ok rows with a speedup", ha="center", va="center", transform=ax.transAxes)


def _not_drawn_note(panel: pd.DataFrame, series: list) -> str:
    """Which rows of the panel have no bar: implementations without an ok row, and failed/unavailable counts."""
    drawn = {impl for impl, _ in series}
    notes = []
    for impl, rows in panel.groupby("impl", sort=False):
        counts = rows["status"].value_counts()
        shapes = len(rows)
        bad = ", ".join(f"{status} at every shape ({shapes})" if counts[status] == shapes and shapes > 1 else
                        f"{status} at {counts[status]} shape{'s' if counts[status] > 1 else ''}"
                        for status in ("failed", "unavailable") if status in counts)
        if impl not in drawn:
            notes.append(f"{impl}: no bars ({bad or 'no speedup'})")
        elif bad:
            notes.append(f"{impl}: {bad}")
    return "not drawn — " + "; ".join(notes) if notes else ""


# --------------------------------------------------------------------------- loss curves (bench train)


def loss_chart(df: pd.DataFrame, path: str | Path) -> bool:
    """The loss per step of every implementation of a train table (``report.train.train_table``); False when
    matplotlib is missing."""
    if not _has_matplotlib():
        return False
    _save(_loss_figure(df), path)
    return True


def _loss_figure(df: pd.DataFrame):
    """One panel per proxy (model, layers, seq, batch, hidden, world, dtype): the loss of each implementation over
    the recorded steps in its ``impl_color`` (the baseline dashed), a failed one marked "failed" in its label."""
    keys = [c for c in TRAIN_GROUP if c in df]
    groups = list(df.groupby(keys, dropna=False, sort=False)) if not df.empty else []
    fig = _new_figure((min(MAX_WIDTH_IN, 6.0 * max(1, len(groups))), 4.2))
    axes = fig.subplots(1, max(1, len(groups)), squeeze=False)[0]
    for ax, (key, panel) in zip(axes, groups):
        key = key if isinstance(key, tuple) else (key,)
        for _, row in panel.iterrows():
            losses = row.get("losses") or []
            if not losses:
                continue
            label = row["impl"] + ("" if row["status"] == "ok" else f" ({row['status']})")
            ax.plot(range(len(losses)), losses, label=label, color=impl_color(row["impl"]), linewidth=1.6,
                    linestyle="--" if row.get("baseline") else "-", marker="o", markersize=2.5)
        ax.set_xlabel("step (after warm-up)")
        ax.set_ylabel("loss")
        ax.grid(color="#dddddd", linewidth=0.6)
        title = " ".join(f"{c}={format_value(c, v)}" for c, v in zip(keys, key))
        ax.set_title("\n".join(textwrap.wrap(title, 60)), fontsize=8, loc="left")
        if ax.get_lines():
            ax.legend(fontsize=8)
    fig.suptitle("Training proxy: loss per step", fontsize=10)
    return fig


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
