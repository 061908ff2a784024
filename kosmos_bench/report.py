"""Rendering of KOSMOS benchmark results (JSON lines and traces, see SCHEMA.md).

Every result row is identified by (source, bench, op, layer, model, m, n, k, world,
dtype, impl) and, for MoE rows, also (tokens, experts, top_k, routing) from `extra`.
`source` is the stem of the result file, so several files can be compared side by
side. When a file holds the same row more than once (appended runs), the last wins.

Derived metrics (computed here, never stored by the benches):

* ``speedup`` -- time_ms of the baseline implementation of the same comparison group
  divided by this row's time_ms; > 1 means faster than the baseline. The baseline is
  "nccl+cublas" for bench "tp" and "nccl-a2a" for bench "moe" -- except the MoE
  expert-GEMMs-alone rows (op "moe_experts"), whose baseline is "grouped-mm"
  (torch._grouped_mm on the same rows; same FLOPs, so speedup = TFLOP/s ratio). The
  comparison group is (source, bench, op, model, m, n, k, world, dtype), for MoE also
  routing and tokens. NaN unless both rows are "ok" with a positive time.
* ``overlap_efficiency`` -- max(t_gemm_ms, t_comm_ms) / time_ms, i.e. the time of
  perfect overlap (the slower of the GEMM alone and the collective alone) relative
  to the measured time. 1.0 is perfect overlap; lower values mean exposed
  communication or overlap overhead. NaN unless the row is "ok" and both t_gemm_ms
  and t_comm_ms are present. MoE rows: t_gemm_ms is the grouped-mm time of the same
  point and t_comm_ms nccl-a2a's all-to-alls alone; a MoE row without t_comm_ms gets
  t_gemm_ms / time_ms (the grouped-GEMM-only time over the layer's time).

MoE fields (tokens, experts, top_k, routing) are read from the row, or from its
``extra`` (older files).
* ``geomean_speedup`` / ``geomean_overlap_efficiency`` -- geometric means over the
  "ok" rows of one (source, bench, impl) that have the metric; the "Geomean per model"
  table, shown when a source holds several models, splits them by model.
* ``vs_fastest_other`` / ``vs_fixed_role_best`` (section "kosmos against the fastest other
  implementation") -- per comparison group where kosmos is ok: the fastest other ok implementation's
  time (or fixed-role-best's) divided by kosmos's; > 1 means kosmos is faster. The line under it
  counts the groups where kosmos is at most 3% slower (vs_fastest_other >= 0.97).
"""

from __future__ import annotations

import html
import importlib.util
import io
import json
import math
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd
from rich.console import Console
from rich.table import Table
from rich.text import Text

BASELINE_IMPL = {"tp": "nccl+cublas", "moe": "nccl-a2a"}
BASELINE_IMPL_BY_OP = {"moe_experts": "grouped-mm"}
BASELINE_IMPLS = (*BASELINE_IMPL.values(), *BASELINE_IMPL_BY_OP.values())
EXPERT_GEMM_BAR = ("moe_experts", "kosmos-expert-gemms", 0.8)  # op, impl, speedup vs grouped-mm to reach
REQUIRED_RESULT_KEYS = ("op", "impl", "status", "m", "n", "k", "world", "dtype")
ENV_FIELDS = ("gpu", "gpu_count", "torch", "triton", "git_commit", "knobs", "timestamp")
RENDER_FORMATS = ("md", "csv", "html", "text")

TABLE_COLUMNS = [
    "source", "bench", "op", "layer", "model", "seq", "m", "n", "k", "world", "dtype", "impl",
    "time_ms", "tflops", "speedup", "overlap_efficiency", "rel_err", "workspace_bytes",
    "status", "reason",
]
MOE_COLUMNS = ["tokens", "experts", "top_k", "routing"]
MOE_DETAIL_COLUMNS = ["peak_mem_delta_bytes"]
DETAIL_COLUMNS = ["p20_ms", "p80_ms", "t_gemm_ms", "t_comm_ms", "peak_mem_bytes", "params"]
ENV_COLUMNS = ["run_id", *ENV_FIELDS]
GEOMEAN_COLUMNS = [
    "source", "bench", "impl", "geomean_speedup", "geomean_overlap_efficiency",
    "ok", "failed", "unavailable",
]

SHAPE_COLUMNS = ("source", "bench", "op", "layer", "model", "m", "n", "k", "world", "dtype", *MOE_COLUMNS)
ROW_IDENTITY = (*SHAPE_COLUMNS, "impl")
COMPARISON_GROUP = ("source", "bench", "op", "model", "m", "n", "k", "world", "dtype")
MOE_COMPARISON_GROUP = ("routing", "tokens")

INTEGER_COLUMNS = (
    "seq", "m", "n", "k", "world", "workspace_bytes", "peak_mem_bytes",
    "tokens", "experts", "top_k", "gpu_count", "peak_mem_delta_bytes",
)
FLOAT_COLUMNS = (
    "time_ms", "tflops", "speedup", "overlap_efficiency", "rel_err",
    "p20_ms", "p80_ms", "t_gemm_ms", "t_comm_ms",
)
FLOAT_FORMATS = {
    "time_ms": "{:.4f}", "p20_ms": "{:.4f}", "p80_ms": "{:.4f}",
    "t_gemm_ms": "{:.4f}", "t_comm_ms": "{:.4f}",
    "tflops": "{:.1f}", "rel_err": "{:.2e}",
    "speedup": "{:.3f}", "overlap_efficiency": "{:.3f}",
    "geomean_speedup": "{:.3f}", "geomean_overlap_efficiency": "{:.3f}",
    "kosmos_ms": "{:.4f}", "fastest_other_ms": "{:.4f}", "vs_fastest_other": "{:.3f}",
    "vs_fixed_role_best": "{:.3f}",
}
MODEL_GEOMEAN_COLUMNS = [
    "source", "bench", "model", "impl", "geomean_speedup", "geomean_overlap_efficiency",
    "ok", "failed", "unavailable",
]
OURS = "kosmos"
SLOWER_TOLERANCE = 0.03  # "no more than 3% slower than the fastest other implementation" (issue 2's bar)
VERSUS_SHAPE_COLUMNS = ["source", "bench", "op", "layer", "model", "seq", "world", "dtype"]
VERSUS_COLUMNS = VERSUS_SHAPE_COLUMNS + [
    "kosmos_ms", "fastest_other", "fastest_other_ms", "vs_fastest_other", "vs_fixed_role_best"]
SPEEDUP_COLUMNS = ("speedup", "geomean_speedup", "vs_fastest_other", "vs_fixed_role_best")
NUMERIC_DISPLAY_COLUMNS = set(INTEGER_COLUMNS) | set(FLOAT_FORMATS) | {"ok", "failed", "unavailable"}
MIB = 1024 * 1024


class ReportError(ValueError):
    """Result or trace files that cannot be reported on."""


# --------------------------------------------------------------------------- loading


def load_results(paths: list[str | Path]) -> tuple[list[dict], list[dict]]:
    """Read result files; return (env records, result records).

    Every record gets ``source`` (the file stem); result records also get the
    ENV_FIELDS of the env line with the same run_id in the same file.
    """
    if not paths:
        raise ReportError("no result files given")
    envs: list[dict] = []
    results: list[dict] = []
    for path in map(Path, paths):
        file_envs, file_results = _read_result_file(path)
        envs.extend(file_envs)
        results.extend(file_results)
    return envs, results


def _read_result_file(path: Path) -> tuple[list[dict], list[dict]]:
    if not path.is_file():
        raise ReportError(f"{path}: no such result file")
    source = path.stem
    envs: list[dict] = []
    raw_results: list[dict] = []
    for line_number, record in _json_lines(path):
        if record.get("type") == "env":
            envs.append({**record, "source": source})
        elif record.get("type") == "result":
            _check_required_keys(record, path, line_number)
            raw_results.append(record)
    if not raw_results:
        raise ReportError(f"{path}: no result lines")
    env_by_run = {env.get("run_id"): env for env in envs}
    results = [_with_env(record, env_by_run.get(record.get("run_id"), {}), source) for record in raw_results]
    return envs, results


def _json_lines(path: Path):
    """Yield (line number, object) for the non-blank lines of a JSON-lines file."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as error:
        raise ReportError(f"{path}: not UTF-8 text ({error})") from error
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ReportError(f"{path}:{line_number}: invalid JSON: {error.msg}") from error
        if not isinstance(record, dict):
            raise ReportError(f"{path}:{line_number}: expected a JSON object")
        yield line_number, record


def _check_required_keys(record: dict, path: Path, line_number: int) -> None:
    missing = [key for key in REQUIRED_RESULT_KEYS if record.get(key) is None]
    if missing:
        raise ReportError(f"{path}:{line_number}: result line lacks {', '.join(missing)}")


def _with_env(record: dict, env: dict, source: str) -> dict:
    env_fields = {field: env.get(field) for field in ENV_FIELDS}
    # developer knobs in effect (KOSMOS_* overrides) as one "K=V K=V" cell; "" when none or not recorded
    env_fields["knobs"] = " ".join(f"{k}={v}" for k, v in sorted((env.get("knobs") or {}).items()))
    merged = {**env_fields, **record, "source": source}
    merged["bench"] = record.get("bench") or env.get("bench") or "tp"
    return merged


# --------------------------------------------------------------------------- table


def build_table(results: list[dict]) -> pd.DataFrame:
    """One row per result identity with the derived speedup and overlap efficiency."""
    rows = _deduplicate([_flatten(record) for record in results])
    _add_speedup(rows)
    for row in rows:
        row["overlap_efficiency"] = _overlap_efficiency(row)
    has_moe = any(row["bench"] == "moe" for row in rows)
    columns = TABLE_COLUMNS + (MOE_COLUMNS if has_moe else []) + DETAIL_COLUMNS + \
        (MOE_DETAIL_COLUMNS if has_moe else []) + ENV_COLUMNS
    return _with_dtypes(pd.DataFrame(rows, columns=columns))


def _flatten(record: dict) -> dict:
    row = {key: value for key, value in record.items() if key not in ("type", "extra", "params")}
    extra = record.get("extra") or {}
    is_moe = record.get("bench") == "moe"
    for column in MOE_COLUMNS:
        row[column] = (record[column] if record.get(column) is not None else extra.get(column)) if is_moe else None
    params = record.get("params")
    row["params"] = json.dumps(params, sort_keys=True, separators=(",", ":")) if params else None
    return row


def _deduplicate(rows: list[dict]) -> list[dict]:
    """Keep the last row of each identity, at the position of its first occurrence."""
    by_identity: dict[tuple, dict] = {}
    for row in rows:
        by_identity[tuple(row.get(column) for column in ROW_IDENTITY)] = row
    return list(by_identity.values())


def _comparison_group(row: dict) -> tuple:
    group = tuple(row.get(column) for column in COMPARISON_GROUP)
    if row["bench"] == "moe":
        group += tuple(row.get(column) for column in MOE_COMPARISON_GROUP)
    return group


def _has_time(row: dict) -> bool:
    time_ms = row.get("time_ms")
    return row["status"] == "ok" and _is_number(time_ms) and time_ms > 0


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _baseline_impl(row: dict) -> str | None:
    return BASELINE_IMPL_BY_OP.get(row.get("op")) or BASELINE_IMPL.get(row["bench"])


def _add_speedup(rows: list[dict]) -> None:
    baseline_ms = {
        _comparison_group(row): row["time_ms"]
        for row in rows
        if row["impl"] == _baseline_impl(row) and _has_time(row)
    }
    for row in rows:
        baseline = baseline_ms.get(_comparison_group(row))
        row["speedup"] = baseline / row["time_ms"] if baseline is not None and _has_time(row) else math.nan


def _overlap_efficiency(row: dict) -> float:
    t_gemm, t_comm = row.get("t_gemm_ms"), row.get("t_comm_ms")
    if row["bench"] == "moe" and _is_number(t_gemm) and not _is_number(t_comm):
        t_comm = 0.0  # MoE: the grouped-GEMM-only time over the layer's time
    if not (_has_time(row) and _is_number(t_gemm) and _is_number(t_comm)):
        return math.nan
    return max(t_gemm, t_comm) / row["time_ms"]


def _with_dtypes(df: pd.DataFrame) -> pd.DataFrame:
    for column in INTEGER_COLUMNS:
        if column in df:
            try:
                df[column] = df[column].astype("Int64")
            except (TypeError, ValueError) as error:
                raise ReportError(f"column {column!r} holds non-integer values") from error
    for column in FLOAT_COLUMNS:
        try:
            df[column] = df[column].astype("float64")
        except (TypeError, ValueError) as error:
            raise ReportError(f"column {column!r} holds non-numeric values") from error
    return df


def geomean_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (source, bench, impl): geomean speedup / overlap efficiency over ok rows, row counts."""
    records = []
    for (source, bench, impl), group in df.groupby(["source", "bench", "impl"], sort=False, dropna=False):
        ok = group[group["status"] == "ok"]
        records.append({
            "source": source,
            "bench": bench,
            "impl": impl,
            "geomean_speedup": _geomean(ok["speedup"]),
            "geomean_overlap_efficiency": _geomean(ok["overlap_efficiency"]),
            "ok": len(ok),
            "failed": int((group["status"] == "failed").sum()),
            "unavailable": int((group["status"] == "unavailable").sum()),
        })
    return pd.DataFrame(records, columns=GEOMEAN_COLUMNS)


def geomean_by_model_table(df: pd.DataFrame) -> pd.DataFrame:
    """``geomean_table`` split by model, for files that hold several models (a bar is often stated for one);
    empty when every source holds a single model."""
    if not (df.groupby("source")["model"].nunique() > 1).any():
        return pd.DataFrame(columns=MODEL_GEOMEAN_COLUMNS)
    parts = [geomean_table(group).assign(model=model)
             for model, group in df.groupby("model", sort=False, dropna=False)]
    table = pd.concat(parts, ignore_index=True)[MODEL_GEOMEAN_COLUMNS]
    return table.sort_values(["source", "bench", "model"], kind="stable").reset_index(drop=True)


def versus_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per comparison group where kosmos ran ok: the fastest other implementation that ran ok there, and
    kosmos's time against it and against ``fixed-role-best`` (other time / kosmos time: > 1 = kosmos faster).
    The MoE expert-GEMM rows are another comparison group (op), so they never compete with the layer."""
    rows = df.to_dict("records")
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if _has_time(row):
            groups.setdefault(_comparison_group(row), []).append(row)
    records = []
    for group in groups.values():
        ours = [row for row in group if row["impl"] == OURS]
        others = [row for row in group if row["impl"] != OURS]
        if not ours or not others:
            continue
        mine, best = ours[0], min(others, key=lambda row: row["time_ms"])
        fixed_best = [row["time_ms"] for row in others if row["impl"] == "fixed-role-best"]
        records.append({
            **{column: mine.get(column) for column in VERSUS_SHAPE_COLUMNS + MOE_COLUMNS},
            "kosmos_ms": mine["time_ms"], "fastest_other": best["impl"], "fastest_other_ms": best["time_ms"],
            "vs_fastest_other": best["time_ms"] / mine["time_ms"],
            "vs_fixed_role_best": fixed_best[0] / mine["time_ms"] if fixed_best else math.nan,
        })
    columns = VERSUS_COLUMNS if "routing" not in df else \
        VERSUS_SHAPE_COLUMNS + MOE_COLUMNS + VERSUS_COLUMNS[len(VERSUS_SHAPE_COLUMNS):]
    return pd.DataFrame(records, columns=columns)


def _versus_line(versus: pd.DataFrame) -> str | None:
    """How often kosmos is at most 3% slower than the fastest other implementation, per source."""
    if versus.empty:
        return None
    parts = []
    for source, group in versus.groupby("source", sort=False):
        close = group["vs_fastest_other"] >= 1 - SLOWER_TOLERANCE
        worst = group.loc[group["vs_fastest_other"].idxmin()]
        label = f"{source} " if versus["source"].nunique() > 1 else ""
        part = (f"{label}at {int(close.sum())} of {len(group)} shapes (worst {worst['vs_fastest_other']:.3f}, "
                f"{worst['fastest_other']} at {worst['model']} {_format_value('layer', worst['layer'])} "
                f"{_format_value('seq', worst['seq'])})")
        if group["model"].nunique() > 1:
            part += " [" + ", ".join(f"{model} {int(close[rows.index].sum())} of {len(rows)}"
                                     for model, rows in group.groupby("model", sort=False)) + "]"
        fixed = group["vs_fixed_role_best"].dropna()
        if len(fixed):
            part += (f", than fixed-role-best at {int((fixed >= 1 - SLOWER_TOLERANCE).sum())} of {len(fixed)} "
                     f"(worst {fixed.min():.3f})")
        parts.append(part)
    return (f"kosmos at most {SLOWER_TOLERANCE:.0%} slower than the fastest other implementation: "
            + "; ".join(parts) + ".")


def _single_valued(df: pd.DataFrame, columns=("source", "bench")) -> set[str]:
    """The identity columns a human-readable table can drop: one value across the whole table."""
    return {column for column in columns if df[column].nunique() <= 1}


def _versus_display(versus: pd.DataFrame) -> list[str]:
    hidden = _single_valued(versus)
    if versus["vs_fixed_role_best"].isna().all():
        hidden.add("vs_fixed_role_best")
    if "routing" in versus and versus["routing"].isna().all():
        hidden.update(MOE_COLUMNS)
    return [column for column in versus.columns if column not in hidden]


def _geomean(values: pd.Series) -> float:
    positive = values.dropna()
    positive = positive[positive > 0]
    return float(np.exp(np.log(positive).mean())) if len(positive) else math.nan


# --------------------------------------------------------------------------- formatting


def _format_value(column: str, value) -> str:
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return ""
    float_format = FLOAT_FORMATS.get(column)
    return float_format.format(value) if float_format else str(value)


def _formatted(df: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    return pd.DataFrame({column: [_format_value(column, value) for value in df[column]] for column in columns})


def _display_columns(df: pd.DataFrame) -> list[str]:
    """Columns of the human-readable per-shape tables (csv gets every column)."""
    hidden = {"workspace_bytes"} | _single_valued(df)
    columns = [column for column in TABLE_COLUMNS if column not in hidden]
    if "routing" in df:
        position = columns.index("impl")
        columns[position:position] = MOE_COLUMNS
    return columns


def _environment_table(df: pd.DataFrame) -> pd.DataFrame:
    columns = ["source", *ENV_COLUMNS]
    return _formatted(df[columns].drop_duplicates().reset_index(drop=True), columns)


def _workspace_line(df: pd.DataFrame) -> str:
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


def _expert_gemm_line(df: pd.DataFrame) -> str | None:
    """The issue's bar for the MoE expert GEMMs, per source: kosmos-expert-gemms TFLOP/s as a share of
    grouped-mm's (geomean of the speedup over the points where both ran); None without such rows."""
    op, impl, bar = EXPERT_GEMM_BAR
    rows = df[(df["op"] == op) & (df["impl"] == impl)]
    if rows.empty:
        return None
    parts = []
    for source, group in rows.groupby("source", sort=False):
        ok = group["speedup"].dropna()
        share = _geomean(ok)
        label = f"{source}: " if df["source"].nunique() > 1 else ""
        if math.isnan(share):
            parts.append(f"{label}no point where both ran ({len(group)} rows)")
        else:
            verdict = "meets" if share >= bar else "misses"
            parts.append(f"{label}{share:.0%} of its TFLOP/s (geomean over {len(ok)} points, min {ok.min():.0%}): "
                         f"{verdict} the >= {bar:.0%} bar")
    return f"MoE expert GEMMs alone, {impl} vs grouped-mm (torch._grouped_mm): " + "; ".join(parts) + "."


def _speedup_style(value) -> str | None:
    if value is None or pd.isna(value) or value == 1:
        return None
    return "green" if value > 1 else "red"


def _shape_key(row: dict) -> tuple[str, ...]:
    """Formatted identity of a row's shape (strings, so missing values compare equal)."""
    return tuple(_format_value(column, row.get(column)) for column in SHAPE_COLUMNS)


# --------------------------------------------------------------------------- renderers


def render(df: pd.DataFrame, fmt: str) -> str:
    """Render the table as "md", "csv", "html" or "text"."""
    renderers = {"md": _render_markdown, "csv": _render_csv, "html": _render_html, "text": _render_text}
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
    geomeans = geomean_table(df)
    sections = [
        "# KOSMOS benchmark report",
        "## Environment",
        _markdown_table(_environment_table(df)),
        "## Results per shape",
        _markdown_table(_formatted(df, _display_columns(df))),
        "## Geomean over ok rows",
        _markdown_table(_formatted(geomeans, GEOMEAN_COLUMNS)),
    ]
    by_model = geomean_by_model_table(df)
    if not by_model.empty:
        sections += ["## Geomean per model", _markdown_table(_formatted(by_model, MODEL_GEOMEAN_COLUMNS))]
    sections += [
        _workspace_line(df),
    ]
    if _expert_gemm_line(df):
        sections.append(_expert_gemm_line(df))
    versus = versus_table(df)
    if not versus.empty:
        sections += ["## kosmos against the fastest other implementation",
                     _markdown_table(_formatted(versus, _versus_display(versus))), _versus_line(versus)]
    return "\n\n".join(sections) + "\n"


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
    return f"<td{class_attribute}>{html.escape(_format_value(column, value))}</td>"


def _render_html(df: pd.DataFrame) -> str:
    environment = df[["source", *ENV_COLUMNS]].drop_duplicates()
    geomeans = geomean_table(df)
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>KOSMOS benchmark report</title>',
        f"<style>{HTML_STYLE}</style></head><body>",
        "<h1>KOSMOS benchmark report</h1>",
        "<h2>Environment</h2>",
        _html_table(environment, list(environment.columns)),
        "<h2>Results per shape</h2>",
        _html_table(df, _display_columns(df)),
        "<h2>Geomean over ok rows</h2>",
        _html_table(geomeans, GEOMEAN_COLUMNS),
        *_by_model_html(geomean_by_model_table(df)),
        f"<p>{html.escape(_workspace_line(df))}</p>",
        *([f"<p>{html.escape(_expert_gemm_line(df))}</p>"] if _expert_gemm_line(df) else []),
        *_versus_html(versus_table(df)),
        "</body></html>",
        "",
    ])


def _by_model_html(by_model: pd.DataFrame) -> list[str]:
    if by_model.empty:
        return []
    return ["<h2>Geomean per model</h2>", _html_table(by_model, MODEL_GEOMEAN_COLUMNS)]


def _versus_html(versus: pd.DataFrame) -> list[str]:
    if versus.empty:
        return []
    return ["<h2>kosmos against the fastest other implementation</h2>",
            _html_table(versus, _versus_display(versus)), f"<p>{html.escape(_versus_line(versus))}</p>"]


def _render_text(df: pd.DataFrame) -> str:
    buffer = io.StringIO()
    print_terminal(df, Console(file=buffer, width=250, color_system=None, force_terminal=False))
    return buffer.getvalue()


# --------------------------------------------------------------------------- terminal


def print_terminal(df: pd.DataFrame, console: Console | None = None) -> None:
    """Rich tables: environment, per-shape results, geomeans and workspace memory."""
    console = console or Console()
    for line in _environment_lines(df):
        console.print(Text(line))
    console.print(_results_rich_table(df))
    console.print(_geomean_rich_table(geomean_table(df)))
    by_model = geomean_by_model_table(df)
    if not by_model.empty:
        console.print(_geomean_rich_table(by_model, MODEL_GEOMEAN_COLUMNS, "Geomean per model"))
    console.print(Text(_workspace_line(df)))
    if _expert_gemm_line(df):
        console.print(Text(_expert_gemm_line(df)))
    versus = versus_table(df)
    if not versus.empty:
        table = Table(title="kosmos against the fastest other implementation")
        columns = _versus_display(versus)
        for column in columns:
            table.add_column(column, justify="right" if column in NUMERIC_DISPLAY_COLUMNS else "left")
        for row in versus.to_dict("records"):
            table.add_row(*(_rich_cell(column, row) for column in columns))
        console.print(table)
        console.print(Text(_versus_line(versus)))


def _environment_lines(df: pd.DataFrame) -> list[str]:
    environment = _environment_table(df)
    return [
        f"{row.source}: {row.gpu} x{row.gpu_count} | torch {row.torch} | triton {row.triton}"
        f" | commit {row.git_commit}{' | knobs ' + row.knobs if row.knobs else ''} | {row.timestamp}"
        for row in environment.itertuples(index=False)
    ]


def _results_rich_table(df: pd.DataFrame) -> Table:
    columns = [column for column in _display_columns(df) if column != "reason"]
    table = Table(title="Results per shape")
    for column in columns:
        table.add_column(column, justify="right" if column in NUMERIC_DISPLAY_COLUMNS else "left")
    records = df.to_dict("records")
    for index, row in enumerate(records):
        is_last_of_shape = index + 1 == len(records) or _shape_key(records[index + 1]) != _shape_key(row)
        table.add_row(*(_rich_cell(column, row) for column in columns), end_section=is_last_of_shape)
    return table


def _rich_cell(column: str, row: dict) -> Text:
    if column == "status":
        return _rich_status(row)
    value = row[column]
    style = _speedup_style(value) if column in SPEEDUP_COLUMNS else None
    return Text(_format_value(column, value), style=style or "")


def _rich_status(row: dict) -> Text:
    status = row["status"]
    if status == "ok":
        return Text("ok")
    reason = _format_value("reason", row.get("reason"))
    label = f"{status}: {reason}" if reason else status
    return Text(label, style="red" if status == "failed" else "yellow")


def _geomean_rich_table(geomeans: pd.DataFrame, columns=GEOMEAN_COLUMNS,
                        title: str = "Geomean over ok rows") -> Table:
    table = Table(title=title)
    for column in columns:
        table.add_column(column, justify="right" if column in NUMERIC_DISPLAY_COLUMNS else "left")
    for row in geomeans.to_dict("records"):
        table.add_row(*(_rich_cell(column, row) for column in columns))
    return table


# --------------------------------------------------------------------------- charts


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
    label = f"{row['op']}/{_format_value('layer', row['layer'])} {row['m']}x{row['n']}x{row['k']} W{row['world']}"
    routing = _format_value("routing", row.get("routing"))
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


class _Trace(NamedTuple):
    title: str
    kind_names: dict[int, str]
    ranks: list[tuple[int, np.ndarray]]  # (rank, events of shape [E, 5])


def _load_trace(path: Path) -> _Trace:
    if not path.is_file():
        raise ReportError(f"{path}: no such trace file")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ReportError(f"{path}: invalid trace JSON ({error})") from error
    if not isinstance(data, dict) or not isinstance(data.get("ranks"), list) or not data["ranks"]:
        raise ReportError(f"{path}: a trace needs a non-empty 'ranks' list")
    title = " ".join(
        f"{key}={data[key]}" if key in ("m", "n", "k", "world") else str(data[key])
        for key in ("op", "model", "impl", "m", "n", "k", "world") if key in data
    )
    return _Trace(title, _trace_kind_names(data.get("kinds", {}), path),
                  [_trace_rank(rank, index, path) for index, rank in enumerate(data["ranks"])])


def _trace_kind_names(kinds, path: Path) -> dict[int, str]:
    if not isinstance(kinds, dict):
        raise ReportError(f"{path}: 'kinds' must map kind ids to names")
    try:
        return {int(kind): str(name) for kind, name in kinds.items()}
    except ValueError as error:
        raise ReportError(f"{path}: kind ids must be integers ({error})") from error


def _trace_rank(rank: dict, index: int, path: Path) -> tuple[int, np.ndarray]:
    if not isinstance(rank, dict) or not isinstance(rank.get("events"), list):
        raise ReportError(f"{path}: ranks[{index}] needs an 'events' list")
    try:
        events = np.asarray(rank["events"], dtype=np.float64).reshape(-1, 5) if rank["events"] else np.empty((0, 5))
    except (TypeError, ValueError) as error:
        raise ReportError(
            f"{path}: ranks[{index}] events must be [program, kind, task_id, t_start_ns, t_end_ns]"
        ) from error
    if len(events) != len(rank["events"]) or not np.isfinite(events).all():
        raise ReportError(f"{path}: ranks[{index}] events must be lists of 5 finite numbers")
    if (events[:, 4] < events[:, 3]).any():
        raise ReportError(f"{path}: ranks[{index}] has events that end before they start")
    rank_id = rank.get("rank", index)
    if not isinstance(rank_id, int):
        raise ReportError(f"{path}: ranks[{index}].rank must be an integer")
    return rank_id, events


def timeline_chart(trace_path: str | Path, png_path: str | Path) -> Path:
    """Gantt chart of a trace: one panel per rank, y = program, x = µs since the rank's first start."""
    trace = _load_trace(Path(trace_path))
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


def _kind_name(trace: _Trace, kind: int) -> str:
    return trace.kind_names.get(kind, f"kind {kind}")


def _kind_colors(trace: _Trace) -> dict[int, tuple]:
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


# --------------------------------------------------------------------------- CLI glue


def report_main(
    files: list[str | Path],
    fmt: str = "text",
    out: str | Path | None = None,
    chart: str | Path | None = None,
    timeline: str | Path | None = None,
    console: Console | None = None,
) -> int:
    """Entry point of `kosmos report`; raises ReportError for unusable inputs."""
    console = console or Console()
    if timeline is not None:
        png_path = Path(out) if out is not None else Path(timeline).with_suffix(".png")
        console.print(Text(f"timeline written to {timeline_chart(timeline, png_path)}"))
        return 0
    if fmt not in RENDER_FORMATS:
        raise ReportError(f"unknown format {fmt!r}; expected one of {', '.join(RENDER_FORMATS)}")
    _, results = load_results(files)
    df = build_table(results)
    if out is not None:
        Path(out).write_text(render(df, fmt), encoding="utf-8")
        console.print(Text(f"{fmt} report written to {out}"))
    elif fmt == "text":
        print_terminal(df, console)
    else:
        console.out(render(df, fmt), highlight=False, end="")
    if chart is not None:
        written = speedup_chart(df, chart)
        console.print(Text(f"speedup chart written to {chart}" if written else "matplotlib missing: no speedup chart"))
    return 0
