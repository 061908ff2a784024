"""The one-sentence summaries of the report: the environment of each run, the ratio convention every section
follows (``RATIO_LINE``), workspace memory, the MoE expert GEMMs against grouped-mm, the geomean targets, how often
kosmos is close to the fastest other implementation, kosmos against cuBLAS alone at world 1, the host enqueue time
per eager call against the suite's bar, and the host time per call inside the timing loop. Every bar they judge
against is a suite target (targets.py); a line whose target is unset gives the numbers only. Also the line under
the per-shape table that defines its bandwidth columns."""

from __future__ import annotations

import math

import pandas as pd

from .schema import (BANDWIDTH_COLUMNS, BASELINE_IMPL, CONFIG_COLUMN, DEFAULT_DIRECTION, DIRECTION, EXPERT_GEMM_IMPL,
                     EXPERT_GEMM_OP, MIB, OURS,
                     format_value)
from .tables import (config_varies, cublas_summary_table, geomean, geomean_by_model_table, geomean_table,
                     host_enqueue_table)
from .targets import target_of

GEOMEAN_TARGETS = ("geomean_speedup", "geomean_overlap_efficiency")  # each bounds the geomean column of its name
# the one convention of every ratio the report gives (speedup, vs_cublas, vs_fastest_other, the mxfp8 section)
RATIO_LINE = "Every ratio is a speedup: the other's time over this one's (> 1: faster, < 1: slower)."


def environment_lines(environment: pd.DataFrame, short_commit: bool = False) -> list[str]:
    """A line per run of ``environment`` (columns source and ENV_COLUMNS, one row per run): machine, versions,
    commit (its first 12 characters with ``short_commit``), developer knobs and the time it started."""
    lines = []
    for row in environment.to_dict("records"):
        cells = {key: format_value(key, row.get(key)) for key in row}
        commit = cells.get("git_commit") or "not recorded"
        commit = commit[:12] if short_commit and cells.get("git_commit") else commit
        gpu = f"{cells.get('gpu') or 'GPU not recorded'} x{cells.get('gpu_count') or '?'}"
        knobs = f" | knobs {cells['knobs']}" if cells.get("knobs") else ""
        lines.append(f"{cells.get('source')}: {gpu} | torch {cells.get('torch')} | triton {cells.get('triton')}"
                     f" | commit {commit}{knobs} | {cells.get('timestamp')}")
    return lines


def target_lines(df: pd.DataFrame) -> list[str]:
    """The verdicts on the geomeans: the expert GEMMs' share of grouped-mm (MoE), then the geomean targets."""
    expert_gemms = expert_gemm_line(df)
    return [*([expert_gemms] if expert_gemms else []), *geomean_target_lines(df)]


def workspace_line(df: pd.DataFrame) -> str:
    with_workspace = df.dropna(subset=["workspace_bytes"])
    if with_workspace.empty:
        return "Workspace memory: not reported."
    several_sources = df["source"].nunique() > 1
    keys = ["source", "impl"] if several_sources else ["impl"]
    maxima = with_workspace.groupby(keys, sort=False)["workspace_bytes"].max()
    parts = [
        f"{'/'.join(map(str, key)) if several_sources else key} {int(value) / MIB:.1f} MiB"
        for key, value in maxima.items()
    ]
    return "Workspace memory (max symmetric workspace per rank): " + ", ".join(parts) + "."


def expert_gemm_line(df: pd.DataFrame) -> str | None:
    """The MoE expert GEMMs alone, per source and direction (the forward's GEMMs; at bwd the backward's):
    kosmos-expert-gemms TFLOP/s as a share of grouped-mm's (geomean of the speedup over the points where both
    ran), against target ``expert_gemm_share``; None without such rows."""
    rows = df[(df["op"] == EXPERT_GEMM_OP) & (df["impl"] == EXPERT_GEMM_IMPL)]
    if rows.empty:
        return None
    parts = []
    directions = rows[DIRECTION].fillna(DEFAULT_DIRECTION) if DIRECTION in rows else pd.Series(
        DEFAULT_DIRECTION, index=rows.index)
    rows = rows.assign(**{DIRECTION: directions})
    for (source, bench, direction), group in rows.groupby(["source", "bench", DIRECTION], sort=False):
        ok = group["speedup"].dropna()
        share = geomean(ok)
        label = f"{source}: " if df["source"].nunique() > 1 else ""
        if rows[DIRECTION].nunique() > 1:  # the forward's GEMMs and the backward's apart
            label += f"{direction}: "
        if math.isnan(share):
            parts.append(f"{label}no point where both ran ({len(group)} rows)")
            continue
        part = f"{label}{share:.0%} of its TFLOP/s (geomean over {len(ok)} points, min {ok.min():.0%})"
        bar = target_of(df, source, bench, "expert_gemm_share")
        if bar is not None:
            part += f": {'meets' if share >= bar else 'misses'} the >= {bar:.0%} bar"
        parts.append(part)
    return f"MoE expert GEMMs alone, {EXPERT_GEMM_IMPL} vs grouped-mm (torch._grouped_mm): " + "; ".join(parts) + "."


def geomean_target_lines(df: pd.DataFrame) -> list[str]:
    """A line per geomean target set for some source: kosmos's geomean (per model when the source holds several)
    against it, e.g. "Target geomean_speedup of kosmos over nccl+cublas >= 1.15: a 1.051 misses, b 1.203 meets.".
    Over the rows at world > 1 only: the bars are for communication overlapped with the GEMM, and at world 1
    (communication off) the speedup over the baseline and the overlap efficiency say nothing about that. A source
    without such rows gets no verdict; one that also holds world-1 rows says "at world > 1"."""
    multi_gpu = df[(df["world"] > 1).fillna(False).astype(bool)]
    if "direction" in multi_gpu:  # the bars are the forward's (MoE --direction bwd rows have their own geomeans)
        multi_gpu = multi_gpu[multi_gpu["direction"].fillna("fwd") == "fwd"]
    geomeans, by_model = geomean_table(multi_gpu), geomean_by_model_table(multi_gpu)
    several_sources = df["source"].nunique() > 1
    lines = []
    for key in GEOMEAN_TARGETS:
        parts = []
        for (source, bench), group in df.groupby(["source", "bench"], sort=False):
            bar = target_of(df, source, bench, key)
            ours = _ours(by_model, source, bench)
            per_model = ours["model"].nunique() > 1
            ours = ours if per_model else _ours(geomeans, source, bench)
            if bar is None or ours.empty:
                continue
            per_dtype = ours["dtype"].nunique() > 1  # e.g. bf16 and mxfp8 rows in one file: each its own
            values = ", ".join(f"{row['model'] + ' ' if per_model else ''}{row['dtype'] + ' ' if per_dtype else ''}"
                               f"{_verdict(row[key], bar)}" for row in ours.to_dict("records"))
            subject = f"{source} " if several_sources else ""
            over = f"over {BASELINE_IMPL.get(bench, 'the baseline')} " if key == "geomean_speedup" else ""
            where = "at world > 1 " if (group["world"] <= 1).any() else ""
            parts.append(f"{subject}{over}{where}>= {bar:.2f}: {values}")
        if parts:
            lines.append(f"Target {key} of kosmos{': ' if several_sources else ' '}" + "; ".join(parts) + ".")
    return lines


def _ours(geomeans: pd.DataFrame, source: str, bench: str) -> pd.DataFrame:
    return geomeans[(geomeans["source"] == source) & (geomeans["bench"] == bench) & (geomeans["impl"] == OURS)]


def _verdict(value: float, bar: float) -> str:
    return "no ok rows" if math.isnan(value) else f"{value:.3f} {'meets' if value >= bar else 'misses'}"


def versus_line(versus: pd.DataFrame, df: pd.DataFrame) -> str | None:
    """How often kosmos is at most target ``slower_tolerance`` slower than the fastest other implementation (and
    than fixed-role-best), per source; ``versus`` is ``versus_table(df)``. None without rows or target."""
    tolerance = pd.Series([target_of(df, row.source, row.bench, "slower_tolerance")
                           for row in versus.itertuples(index=False)], index=versus.index, dtype="float64")
    versus = versus[tolerance.notna()]
    if versus.empty:
        return None
    floor = 1 - tolerance[versus.index]  # kosmos is close where vs_fastest_other >= floor
    tolerances = sorted(set(tolerance.dropna()))
    parts = []
    for source, group in versus.groupby("source", sort=False):
        close = group["vs_fastest_other"] >= floor[group.index]
        worst = group.loc[group["vs_fastest_other"].idxmin()]
        label = f"{source} " if versus["source"].nunique() > 1 else ""
        if len(tolerances) > 1:
            label += f"(at most {tolerance[group.index].max():.0%} slower) "
        part = f"{label}at {int(close.sum())} of {len(group)} shapes ({_lowest(worst)})"
        if group["model"].nunique() > 1:
            part += " [" + ", ".join(f"{model} {int(close[rows.index].sum())} of {len(rows)}"
                                     for model, rows in group.groupby("model", sort=False)) + "]"
        fixed = group["vs_fixed_role_best"].dropna()
        if len(fixed):
            lowest = f"smallest margin {fixed.min():.3f}" if fixed.min() >= 1 else f"lowest {fixed.min():.3f}"
            part += f", than fixed-role-best at {int((fixed >= floor[fixed.index]).sum())} of {len(fixed)} ({lowest})"
        parts.append(part)
    within = f"{tolerances[0]:.0%}" if len(tolerances) == 1 else "its suite's slower_tolerance"
    return f"kosmos at most {within} slower than the fastest other implementation: " + "; ".join(parts) + "."


def _lowest(row: dict) -> str:
    """The shape where kosmos does least well against the fastest other (a ``versus_table`` row), worded for what
    the ratio says: the smallest margin where kosmos is faster, else how far it is behind."""
    where = " ".join(part for part in (
        row["model"], format_value("layer", row["layer"]), format_value("seq", row["seq"]),
        format_value("routing", row.get("routing")), "" if row.get(DIRECTION) in (None, DEFAULT_DIRECTION)
        else format_value(DIRECTION, row.get(DIRECTION))) if part)
    value = row["vs_fastest_other"]
    if value >= 1:
        return f"faster at every shape; smallest margin {value:.3f}, over {row['fastest_other']} at {where}"
    return f"lowest {value:.3f}: {row['fastest_other']} faster at {where}"


BANDWIDTH_S = {  # S of nccl-tests per op (tables.comm_bytes)
    "ag_gemm": "ag_gemm the all-gather's output, m*k elements",
    "gemm_rs": "gemm_rs the reduce-scatter's input per rank, m*n",
    "moe_fwd": "moe_fwd what a rank sends over the dispatch and combine all-to-alls, 2*tokens*top_k*n "
               "(mean over ranks)",
}


def bandwidth_line(df: pd.DataFrame) -> str | None:
    """The definitions of the bandwidth columns, for the ops of the rows that have them; None when none has."""
    with_bandwidth = df[df[BANDWIDTH_COLUMNS[0]].notna()]
    if with_bandwidth.empty:
        return None
    ops = [BANDWIDTH_S[op] for op in dict.fromkeys(with_bandwidth["op"]) if op in BANDWIDTH_S]
    return ("comm_algbw_gbps, comm_busbw_gbps: nccl-tests' algorithm and bus bandwidth of t_comm_ms (the collective "
            "alone) in GB/s (1e9 B/s): algbw = S / t_comm_ms, busbw = algbw * (world-1)/world; S = "
            + "; ".join(ops) + "; bytes per element: bf16 2, mxfp8 1 + 1/32.")


def cublas_line(df: pd.DataFrame, summary: pd.DataFrame | None = None) -> str | None:
    """kosmos against cuBLAS alone at world 1 (``summary``: ``cublas_summary_table(df)``), per source, op, dtype and
    config: the geomean of t_gemm_ms / time_ms against target ``vs_cublas_geomean``, the worst shape, and the
    shapes under target ``vs_cublas_floor``; None without such rows."""
    summary = cublas_summary_table(df) if summary is None else summary
    if summary.empty:
        return None
    several = {column: summary[column].nunique(dropna=False) > 1 for column in ("source", "dtype")}
    several[CONFIG_COLUMN] = config_varies(summary)
    parts = []
    for row in summary.to_dict("records"):
        label = " ".join([*([row["source"]] if several["source"] else []), row["op"],
                          *([row["dtype"]] if several["dtype"] else [])])
        part = f"{label} geomean {row['geomean_vs_cublas']:.3f}"
        bar = target_of(df, row["source"], row["bench"], "vs_cublas_geomean")
        if bar is not None:
            part += f" {'meets' if row['geomean_vs_cublas'] >= bar else 'misses'} the >= {bar:.2f} bar"
        part += f", min {row['min_vs_cublas']:.3f} at {row['worst_shape']}"
        if not pd.isna(row["below_floor"]):
            part += f", {int(row['below_floor'])} of {row['shapes']} shapes under {row['floor']:.2f}"
        else:
            part += f" ({row['shapes']} shapes)"
        if several[CONFIG_COLUMN]:
            part += f" [{row[CONFIG_COLUMN] or 'no config'}]"
        parts.append(part)
    return ("kosmos against cuBLAS alone at world 1 (t_gemm_ms / time_ms, the TFLOP/s ratio; torch.matmul with no "
            "collective, not nccl+cublas): " + "; ".join(parts) + ".")


HOST_ENQUEUE_TARGET = "host_enqueue_us"  # the suite target on kosmos's enqueue time per eager call (suite_targets.py)


def host_enqueue_title(table: pd.DataFrame) -> str:
    """The heading of section "Host enqueue time per eager call" (``table``: ``host_enqueue_table``), naming the
    calls and the shape where the rows share them."""
    calls, shapes = table["calls"].dropna().unique(), table["shape"].unique()
    what = f"{int(calls[0])} back-to-back calls" if len(calls) == 1 else "back-to-back calls (calls)"
    where = f"at {shapes[0]}" if len(shapes) == 1 else "at each row's shape"
    return f"Host enqueue time per eager call, µs (median of {what} {where})"


def host_enqueue_line(df: pd.DataFrame) -> str | None:
    """kosmos's host enqueue time per eager call (the host rows, ``host_enqueue_table``) against the suite's
    ``host_enqueue_us`` bar (at world 1), per (source, op, dtype, config), e.g. "kosmos ag_gemm
    bf16 19.3 µs: meets <= 30"; rows at world > 1 are given without a verdict, failed ones with their reason. None
    without kosmos host rows."""
    table = host_enqueue_table(df)
    ours = table[table["impl"] == OURS]
    if ours.empty:
        return None
    several_sources = table["source"].nunique() > 1
    several_configs = config_varies(ours)
    bars, parts = set(), []
    for row in ours.to_dict("records"):
        world = int(row["world"])
        label = " ".join([*([row["source"]] if several_sources else []), OURS, row["op"], row["dtype"],
                          *([f"W={world}"] if world != 1 else []),
                          *([f"[{row[CONFIG_COLUMN] or 'no config'}]"] if several_configs else [])])
        if row["status"] != "ok" or pd.isna(row["host_us"]):
            parts.append(f"{label} {row['status']}: {format_value('reason', row['reason']) or 'no reason recorded'}")
            continue
        part = f"{label} {row['host_us']:.1f} µs"
        bar = target_of(df, row["source"], row["bench"], HOST_ENQUEUE_TARGET)
        if bar is not None and world == 1:
            bars.add(bar)
            part += f": {'meets' if row['host_us'] <= bar else 'misses'} <= {bar:g}"
        elif bar is not None:
            part += " (the bar is at W=1)"
        parts.append(part)
    bar = f"; the bar: <= {bars.pop():g} µs at W=1" if len(bars) == 1 else ""
    return (f"Host enqueue time per eager call of kosmos (median of back-to-back calls{bar}): "
            + "; ".join(parts) + ".")


def host_line(df: pd.DataFrame) -> str | None:
    """The host time per call inside the timing loop of each implementation (per source, and dtype where several):
    the median over its ok rows of each row's host_ms (itself the median over the row's timed calls, each after a
    barrier: a cold host), and the largest, in microseconds; None when no row has host_ms. Not the enqueue cost per
    eager call (``host_enqueue_line``)."""
    ok = df[(df["status"] == "ok") & df["host_ms"].notna()]
    if ok.empty:
        return None
    ok = ok.assign(**{DIRECTION: ok[DIRECTION].fillna(DEFAULT_DIRECTION)}) if DIRECTION in ok else \
        ok.assign(**{DIRECTION: DEFAULT_DIRECTION})
    several = {column: ok[column].nunique() > 1 for column in ("source", "dtype", DIRECTION)}
    parts = []
    for (source, dtype, direction, impl), group in ok.groupby(["source", "dtype", DIRECTION, "impl"], sort=False,
                                                              dropna=False):
        host_us = group["host_ms"].astype("float64") * 1e3
        label = " ".join([*([source] if several["source"] else []), impl, *([dtype] if several["dtype"] else []),
                          *([direction] if several[DIRECTION] else [])])
        parts.append(f"{label} {host_us.median():.0f} (max {host_us.max():.0f})")
    return ("Host time per call inside the timing loop, µs (per row the median over its timed calls of the CPU "
            "time inside the call, each after a barrier, so the host is cold; here the median over an "
            f"implementation's rows and the largest{enqueue_pointer(df)}): " + ", ".join(parts) + ".")


def enqueue_pointer(df: pd.DataFrame) -> str:
    """Where the enqueue cost per eager call is, for the text on the in-loop host time: the section of that name
    where the files have host rows, ``bench tp --host-calls`` for files of TP rows without them, else nothing
    (the MoE bench does not measure it)."""
    if not host_enqueue_table(df).empty:
        return "; the enqueue cost per eager call: section \"Host enqueue time per eager call\""
    if (df["bench"] == "tp").any():
        return "; the enqueue cost per eager call: bench tp --host-calls"
    return ""
