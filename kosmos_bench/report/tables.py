"""The report's pandas tables, built from the records of ``load_results``: the per-shape table with the derived
metrics, the geomeans (per implementation and per model) and kosmos against the fastest other implementation.

Every result row is identified by (source, bench, op, layer, model, m, n, k, world,
dtype, impl, config) and, for MoE rows, also (tokens, experts, top_k, routing) from `extra`.
`source` is the stem of the result file, so several files can be compared side by
side. When a file holds the same row more than once (appended runs), the last wins;
rows that differ only by ``config`` (an A/B of two configs appended to one file) are two rows.

``config`` is the op config a KOSMOS implementation ran with (null for the baselines), as the
text ``config_text`` makes of it: every field as ``field=value``, sorted by field, values as
``--config`` takes them (e.g. "copy_block=16384 push_chunks=1"). All fields rather than those
off the defaults: the defaults are ``kosmos.config``'s, which the report cannot import without
torch, and they change between versions while a file's rows stay as run.

Derived metrics (computed here, never stored by the benches):

* ``speedup`` -- time_ms of the baseline implementation of the same comparison group
  divided by this row's time_ms; > 1 means faster than the baseline. The baseline is
  "nccl+cublas" for bench "tp" and "nccl-a2a" for bench "moe" -- except the MoE
  expert-GEMMs-alone rows (op "moe_experts"), whose baseline is "grouped-mm"
  (torch._grouped_mm on the same rows; same FLOPs, so speedup = TFLOP/s ratio). The
  comparison group is (source, bench, op, model, m, n, k, world, dtype, direction), for MoE
  also routing and tokens. ``direction`` (MoE ``--direction``: fwd, bwd, fwd+bwd) is "fwd" for rows without it
  (TP rows, older files); the dtype sections below compare forward rows only. NaN unless both rows are "ok" with a positive time.
* ``overlap_efficiency`` -- max(t_gemm_ms, t_comm_ms) / time_ms, i.e. the time of
  perfect overlap (the slower of the GEMM alone and the collective alone) relative
  to the measured time. 1.0 is perfect overlap; lower values mean exposed
  communication or overlap overhead. NaN unless the row is "ok" and both t_gemm_ms
  and t_comm_ms are present. MoE rows: t_gemm_ms is the grouped-mm time of the same
  point and t_comm_ms nccl-a2a's all-to-alls alone; a MoE row without t_comm_ms gets
  t_gemm_ms / time_ms (the grouped-GEMM-only time over the layer's time).

* ``comm_algbw_gbps`` / ``comm_busbw_gbps`` -- nccl-tests' algorithm and bus bandwidth of the
  communication-only timing ``t_comm_ms`` (the collective alone on this shape, measured once per shape and
  recorded on each of its rows), in GB/s (1e9 bytes/s): ``algbw = S / t_comm``, ``busbw = algbw * (W-1)/W``
  (nccl-tests' factor for all-gather, reduce-scatter and all-to-all), W = ``world``. S as nccl-tests defines
  it per collective: ag_gemm (all_gather_into_tensor of A[m/W, k] into A[m, k]) S = the gathered output,
  m*k elements; gemm_rs (reduce_scatter_tensor of the [m, n] partial) S = the input per rank, m*n elements;
  moe_fwd (nccl-a2a's two all_to_all_single alone: the dispatch sends each of a rank's tokens*top_k (token,
  expert) rows of n = hidden elements to the rank of its expert, the combine sends the rows a rank received
  back) S = the bytes a rank sends over both, 2*tokens*top_k*hidden elements: exact for the dispatch; the
  combine returns every dispatched row, so that is also exact as the mean over ranks, while under skewed
  routing the rank that received the most rows sends more in the combine (``extra.rows_per_rank``). Bytes
  per element from ``dtype``: bf16 2, mxfp8 1 + 1/32 (an E8M0 scale per 32 elements) -- except gemm_rs, whose
  reduce-scatter moves the bf16 partials at every dtype (2). NaN unless t_comm_ms
  > 0 (world 1 times no communication) and the dtype's size is known; moe_experts rows have no t_comm_ms.

MoE fields (tokens, experts, top_k, routing) are read from the row, or from its
``extra`` (older files).
* ``geomean_speedup`` / ``geomean_overlap_efficiency`` -- geometric means over the
  "ok" rows of one (source, bench, dtype, direction, impl) that have the metric (an mxfp8 row's speedup is over the
  baseline at mxfp8: nccl+cublas on the same MX inputs); the "Geomean per model"
  table, shown when a source holds several models, splits them by model.
* ``vs_fastest_other`` / ``vs_fixed_role_best`` (section "kosmos against the fastest other
  implementation") -- per comparison group where kosmos is ok: the fastest other ok implementation's
  time (or fixed-role-best's) divided by kosmos's; > 1 means kosmos is faster. The line under it
  (lines.py) counts the groups where kosmos is at most the suite's ``slower_tolerance`` slower. A group
  where kosmos ran with several configs gets a row per config.

* ``dtype_table`` (section "mxfp8 / bf16", and "fp8-block / bf16" with columns named fp8_block_*) -- per shape
  (TP; MoE: per moe_fwd point, routing included) where kosmos ran ok at mxfp8: kosmos's speedup at mxfp8 over
  its bf16 time (``mxfp8_vs_bf16`` = bf16 time / mxfp8 time, when the bf16 row is ok too) and over cuBLAS bf16
  alone on the shape, the mxfp8 row's ``t_gemm_ms`` (``mxfp8_vs_cublas_bf16``; for MoE rows grouped-mm at bf16 on
  the same rows); > 1 means mxfp8 is faster, as every ratio of the report. ``wire_table``: per shape and
  dtype, the bytes a rank sends in the collective (``wire_bytes``) in MiB, the implementations that send the same
  bytes on one line, and that against the shape's bf16 bytes.

* ``cublas_table`` (section "kosmos against cuBLAS alone at world 1") -- per TP shape where kosmos ran ok at world
  1 with a ``t_gemm_ms`` (torch.matmul on the same operands, no collective: "cuBLAS" in this project -- not
  nccl+cublas, whose world-1 row still pays a size-1 all-gather copy): ``vs_cublas`` = t_gemm_ms / time_ms, the
  ratio of kosmos's TFLOP/s to cuBLAS's (> 1: kosmos faster; at mxfp8 against cuBLAS bf16). ``cublas_summary_table``
  per (source, bench, op, dtype, config): the shapes, their geomean and minimum, the worst shape ("MxNxK") and,
  when the suite sets target ``vs_cublas_floor``, how many shapes fall under it (``below_floor``).
* ``host_table`` (section "Host time per call inside the timing loop") -- per (source, bench, op, dtype, direction,
  impl, config) over the ok rows with ``host_ms`` (the median over a row's timed calls of the CPU time spent inside
  the implementation's call, from entering it to its return, no synchronisation in between: timing.py; each call
  follows a barrier, so the host is cold): the rows and the median, min and max of host_ms in microseconds.
* ``host_enqueue_table`` (section "Host enqueue time per eager call") -- the host rows (``"type": "host"``, `bench
  tp --host-calls`): per (source, bench, op, dtype, world, impl, config, shape) the median (``host_us``) and
  p20 / p80 of N back-to-back eager calls after a warm-up (timing.host_enqueue_us), status and reason. The suite
  target ``host_enqueue_us`` bounds kosmos's at world 1 (lines.host_enqueue_line).

``build_table`` also keeps the suite targets of each (source, bench) in ``df.attrs["targets"]`` (targets.py).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd

from .schema import (
    BASELINE_IMPL, BASELINE_IMPL_BY_OP, COMPARISON_GROUP, CONFIG_COLUMN, DEFAULT_DIRECTION, DETAIL_COLUMNS, DIRECTION,
    DTYPE_BYTES, ENV_COLUMNS,
    FLOAT_COLUMNS, GEOMEAN_COLUMNS, INTEGER_COLUMNS, LAST_COLUMNS, MODEL_GEOMEAN_COLUMNS, MOE_COLUMNS,
    MOE_COMPARISON_GROUP, MOE_DETAIL_COLUMNS, OURS, ROW_IDENTITY, TABLE_COLUMNS, VERSUS_COLUMNS, VERSUS_SHAPE_COLUMNS,
    WIRE_COLUMNS, DTYPE_COLUMNS, LOW_DTYPES, dtype_columns, low_name, CUBLAS_COLUMNS, CUBLAS_SUMMARY_COLUMNS, HOST_COLUMNS, HOST_ENQUEUE_COLUMNS,
    ReportError,
)
from .targets import table_targets, target_of


def build_table(results: list[dict], hosts: list[dict] = ()) -> pd.DataFrame:
    """One row per result identity with the derived speedup and overlap efficiency; the host records
    (``load_records``) ride along in ``df.attrs["host_enqueue"]`` (``host_enqueue_table``)."""
    rows = _deduplicate([_flatten(record) for record in results])
    _add_speedup(rows)
    for row in rows:
        row["overlap_efficiency"] = _overlap_efficiency(row)
        row["comm_algbw_gbps"], row["comm_busbw_gbps"] = comm_bandwidth(row)
    has_moe = any(row["bench"] == "moe" for row in rows)
    columns = TABLE_COLUMNS + (MOE_COLUMNS if has_moe else []) + DETAIL_COLUMNS + \
        (MOE_DETAIL_COLUMNS if has_moe else []) + ENV_COLUMNS + LAST_COLUMNS
    df = _with_dtypes(pd.DataFrame(rows, columns=columns))
    host_rows = _host_enqueue_rows(hosts)
    df.attrs["targets"] = table_targets([*host_rows, *rows])
    df.attrs["host_enqueue"] = host_rows
    return df


def _host_enqueue_rows(hosts: list[dict]) -> list[dict]:
    """The host records as the section's rows (HOST_ENQUEUE_COLUMNS and suite_targets), the last of each identity
    (source, bench, op, dtype, world, impl, config, shape) at the position of its first occurrence."""
    by_identity: dict[tuple, dict] = {}
    for record in hosts:
        row = {column: record.get(column) for column in HOST_ENQUEUE_COLUMNS}
        row["bench"] = record.get("bench") or "tp"
        row[CONFIG_COLUMN] = config_text(record.get("config"))
        row["shape"] = "x".join(str(record.get(key)) for key in ("m", "n", "k"))
        row["suite_targets"] = record.get("suite_targets")
        by_identity[tuple(row[column] for column in HOST_ENQUEUE_COLUMNS[:HOST_ENQUEUE_COLUMNS.index("calls")])] = row
    return list(by_identity.values())


def host_enqueue_table(df: pd.DataFrame) -> pd.DataFrame:
    """Section "Host enqueue time per eager call": the host rows of the files ``df`` was built from (``bench tp
    --host-calls``; ``build_table``'s ``hosts``), one per (source, bench, op, dtype, world, impl, config, shape), in
    the order written; empty when there are none (older files)."""
    table = pd.DataFrame(df.attrs.get("host_enqueue", []), columns=HOST_ENQUEUE_COLUMNS)
    for column in ("host_us", "p20_us", "p80_us"):
        table[column] = pd.to_numeric(table[column], errors="coerce").astype("float64")
    table["world"] = table["world"].astype("Int64")
    table["calls"] = pd.to_numeric(table["calls"], errors="coerce").astype("Int64")
    return table


def _flatten(record: dict) -> dict:
    row = {key: value for key, value in record.items() if key not in ("type", "extra", "params")}
    extra = record.get("extra") or {}
    is_moe = record.get("bench") == "moe"
    for column in MOE_COLUMNS:
        row[column] = (record[column] if record.get(column) is not None else extra.get(column)) if is_moe else None
    row[DIRECTION] = record.get(DIRECTION) or DEFAULT_DIRECTION  # older files, TP rows: the forward
    params = record.get("params")
    row["params"] = json.dumps(params, sort_keys=True, separators=(",", ":")) if params else None
    row[CONFIG_COLUMN] = config_text(record.get("config"))
    return row


def config_text(config: dict | None) -> str | None:
    """A row's config as one cell: "field=value" for every field, sorted by field, separated by spaces; a value as
    ``--config`` takes it (strings as they are, others as JSON: true, 16384). None for no config."""
    if not config:
        return None
    return " ".join(f"{key}={value if isinstance(value, str) else json.dumps(value)}"
                    for key, value in sorted(config.items()))


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
    return (BASELINE_IMPL_BY_OP.get(row.get("op")) or row.get("suite_baseline")
            or BASELINE_IMPL.get(row["bench"]))


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


def comm_bytes(row: dict) -> float:
    """S of nccl-tests for the communication-only timing of ``row`` (see the module docstring); NaN when the op
    or dtype is not one it is known for."""
    element = DTYPE_BYTES.get(row.get("dtype"), math.nan)
    op = row.get("op")
    if op == "gemm_rs" and row.get("dtype") in DTYPE_BYTES:
        element = DTYPE_BYTES["bf16"]  # the reduce-scatter moves the bf16 partials at every input dtype
    if op == "ag_gemm":
        elements = row["m"] * row["k"]
    elif op == "gemm_rs":
        elements = row["m"] * row["n"]
    elif op == "moe_fwd" and _is_number(row.get("tokens")) and _is_number(row.get("top_k")):
        elements = 2 * row["tokens"] * row["top_k"] * row["n"]
    else:
        return math.nan
    return float(elements) * element


def comm_bandwidth(row: dict) -> tuple[float, float]:
    """(algbw, busbw) in GB/s of the row's t_comm_ms; NaNs unless t_comm_ms > 0 and S is known."""
    t_comm = row.get("t_comm_ms")
    world = row.get("world")
    if not (_is_number(t_comm) and t_comm > 0 and _is_number(world) and world >= 1):
        return math.nan, math.nan
    algbw = comm_bytes(row) / (t_comm * 1e-3) / 1e9
    return algbw, algbw * (world - 1) / world


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


def geomean(values: pd.Series) -> float:
    """Geometric mean of the positive values; NaN when there are none."""
    positive = values.dropna()
    positive = positive[positive > 0]
    return float(np.exp(np.log(positive).mean())) if len(positive) else math.nan


def geomean_table(df: pd.DataFrame) -> pd.DataFrame:
    """Per (source, bench, dtype, direction, impl): geomean speedup / overlap efficiency over ok rows, row counts."""
    records = []
    for (source, bench, dtype, direction, impl), group in df.groupby(["source", "bench", "dtype", DIRECTION, "impl"],
                                                                     sort=False, dropna=False):
        ok = group[group["status"] == "ok"]
        records.append({
            "source": source,
            "bench": bench,
            "dtype": dtype,
            "direction": direction,
            "impl": impl,
            "geomean_speedup": geomean(ok["speedup"]),
            "geomean_overlap_efficiency": geomean(ok["overlap_efficiency"]),
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
    return table.sort_values(["source", "bench", "dtype", "model"], kind="stable").reset_index(drop=True)


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
        best = min(others, key=lambda row: row["time_ms"])
        fixed_best = [row["time_ms"] for row in others if row["impl"] == "fixed-role-best"]
        records += [{
            **{column: mine.get(column) for column in VERSUS_SHAPE_COLUMNS + MOE_COLUMNS + [CONFIG_COLUMN]},
            "kosmos_ms": mine["time_ms"], "fastest_other": best["impl"], "fastest_other_ms": best["time_ms"],
            "vs_fastest_other": best["time_ms"] / mine["time_ms"],
            "vs_fixed_role_best": fixed_best[0] / mine["time_ms"] if fixed_best else math.nan,
        } for mine in ours]
    columns = VERSUS_COLUMNS if "routing" not in df else \
        VERSUS_SHAPE_COLUMNS + MOE_COLUMNS + VERSUS_COLUMNS[len(VERSUS_SHAPE_COLUMNS):]
    return pd.DataFrame(records, columns=columns)


MX, BF16 = "mxfp8", "bf16"
# MoE points also differ by routing (None for TP rows)
_DTYPE_SHAPE = ["source", "bench", "op", "layer", "model", "seq", "routing", "m", "n", "k", "world"]


def _shape_key(row: dict) -> tuple:
    """The shape of ``row`` for the dtype sections (a missing value, NaN from a mixed frame, is None)."""
    return tuple(None if (v := row.get(c)) is None or (isinstance(v, float) and math.isnan(v)) else v
                 for c in _DTYPE_SHAPE)


def _forward_rows(df: pd.DataFrame) -> list[dict]:
    """The rows of the forward direction (the dtype sections compare forward passes)."""
    return [row for row in df.to_dict("records") if row.get(DIRECTION, DEFAULT_DIRECTION) == DEFAULT_DIRECTION]


def dtype_table(df: pd.DataFrame, low: str = MX) -> pd.DataFrame:
    """Section "<low> / bf16" (module docstring) of the 8-bit dtype ``low`` (mxfp8 or fp8-block): a row per shape
    where kosmos ran ok at ``low`` (forward rows); columns schema.dtype_columns(low)."""
    rows = [row for row in _forward_rows(df) if row["impl"] == OURS and _has_time(row)]
    bf16 = {_shape_key(row): row for row in rows if row["dtype"] == BF16}
    n = low_name(low)
    records = []
    for mx in (row for row in rows if row["dtype"] == low):
        base = bf16.get(_shape_key(mx))
        cublas = mx.get("t_gemm_ms")
        cublas = cublas if _is_number(cublas) and cublas > 0 else math.nan
        records.append({
            **dict(zip(_DTYPE_SHAPE, _shape_key(mx))),
            "kosmos_bf16_ms": base["time_ms"] if base else math.nan, f"kosmos_{n}_ms": mx["time_ms"],
            f"{n}_vs_bf16": base["time_ms"] / mx["time_ms"] if base else math.nan,
            "cublas_bf16_ms": cublas, f"{n}_vs_cublas_bf16": cublas / mx["time_ms"],
        })
    return pd.DataFrame(records, columns=dtype_columns(low))


def wire_table(df: pd.DataFrame) -> pd.DataFrame:
    """The bytes on the wire per implementation (module docstring), for files that hold mxfp8 or fp8-block rows
    with ``wire_bytes``; empty otherwise."""
    if "wire_bytes" not in df or not (df["dtype"].isin(LOW_DTYPES) & df["wire_bytes"].notna()).any():
        return pd.DataFrame(columns=WIRE_COLUMNS)
    groups: dict[tuple, list[str]] = {}
    for row in _forward_rows(df):
        wire = row.get("wire_bytes")
        if wire is None or pd.isna(wire) or row["status"] != "ok":  # what ran
            continue
        key = (*_shape_key(row), row["dtype"], int(wire))
        groups.setdefault(key, [])
        if row["impl"] not in groups[key]:
            groups[key].append(row["impl"])
    bf16 = {key[:len(_DTYPE_SHAPE)]: key[-1] for key in groups if key[-2] == BF16}
    records = []
    for key, impls in groups.items():
        shape, wire = key[:len(_DTYPE_SHAPE)], key[-1]
        base = bf16.get(shape)
        records.append({**dict(zip(_DTYPE_SHAPE, shape)), "dtype": key[-2], "impls": ", ".join(impls),
                        "wire_mib": wire / 2**20, "wire_vs_bf16": wire / base if base else math.nan})
    return pd.DataFrame(records, columns=WIRE_COLUMNS)


def config_varies(df: pd.DataFrame) -> bool:
    """Whether some op of ``df`` holds rows of more than one config (an A/B appended to one file, or files run
    with other configs side by side): each op has its own fields and the baselines none, so a run of one config
    per op shows none."""
    configs = df.dropna(subset=[CONFIG_COLUMN])
    return bool((configs.groupby("op")[CONFIG_COLUMN].nunique() > 1).any())


def _number_or_nan(value) -> float:
    return float(value) if _is_number(value) else math.nan


def cublas_table(df: pd.DataFrame) -> pd.DataFrame:
    """Section "kosmos against cuBLAS alone at world 1" (module docstring): a row per TP kosmos row that ran ok at
    world 1 with a positive t_gemm_ms (forward rows)."""
    records, identity = [], CUBLAS_COLUMNS[:CUBLAS_COLUMNS.index("kosmos_ms")]
    for row in _forward_rows(df):
        cublas, world = row.get("t_gemm_ms"), row.get("world")
        if not (row["bench"] == "tp" and row["impl"] == OURS and not pd.isna(world) and int(world) == 1
                and _has_time(row) and _is_number(cublas) and cublas > 0):
            continue
        host = _number_or_nan(row.get("host_ms"))
        records.append({**{column: row.get(column) for column in identity},
                        "kosmos_ms": row["time_ms"], "cublas_ms": cublas, "vs_cublas": cublas / row["time_ms"],
                        "loop_host_us": host * 1e3})
    return pd.DataFrame(records, columns=CUBLAS_COLUMNS)


def cublas_summary_table(df: pd.DataFrame, per_shape: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per (source, bench, op, dtype, config) of ``cublas_table(df)`` (or ``per_shape``): the shapes, the geomean
    and minimum of vs_cublas, the worst shape, and the shapes under the suite's ``vs_cublas_floor`` (with it)."""
    per_shape = cublas_table(df) if per_shape is None else per_shape
    records = []
    keys = ["source", "bench", "op", "dtype", CONFIG_COLUMN]
    for key, group in per_shape.groupby(keys, sort=False, dropna=False):
        source, bench = key[0], key[1]
        worst = group.loc[group["vs_cublas"].idxmin()]
        floor = target_of(df, source, bench, "vs_cublas_floor")
        records.append({**dict(zip(keys, key)), "shapes": len(group), "geomean_vs_cublas": geomean(group["vs_cublas"]),
                        "min_vs_cublas": float(worst["vs_cublas"]),
                        "worst_shape": f"{worst['m']}x{worst['n']}x{worst['k']}",
                        "below_floor": None if floor is None else int((group["vs_cublas"] < floor).sum()),
                        "floor": math.nan if floor is None else float(floor)})
    table = pd.DataFrame(records, columns=CUBLAS_SUMMARY_COLUMNS)
    table["below_floor"] = table["below_floor"].astype("Int64")
    table["floor"] = table["floor"].astype("float64")
    return table


def host_table(df: pd.DataFrame) -> pd.DataFrame:
    """Section "Host time per call inside the timing loop" (module docstring): per (source, bench, op, dtype, direction, impl,
    config), over its ok rows with host_ms, the median, min and max of host_ms in microseconds."""
    keys = ["source", "bench", "op", "dtype", DIRECTION, "impl", CONFIG_COLUMN]
    ok = df[(df["status"] == "ok") & df["host_ms"].notna()]
    records = []
    for key, group in ok.groupby(keys, sort=False, dropna=False):
        host_us = group["host_ms"].astype("float64") * 1e3
        records.append({**dict(zip(keys, key)), "rows": len(group), "host_us_median": float(host_us.median()),
                        "host_us_min": float(host_us.min()), "host_us_max": float(host_us.max())})
    impls = list(dict.fromkeys(record["impl"] for record in records))  # an implementation's lines together
    records.sort(key=lambda record: impls.index(record["impl"]))
    return pd.DataFrame(records, columns=HOST_COLUMNS)
