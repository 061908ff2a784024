"""What the report's tables are made of: column names, row identities, baselines, number formats, and
``ReportError``. Shared by every other module of the report; holds no logic but ``format_value``."""

from __future__ import annotations

import pandas as pd

BASELINE_IMPL = {"tp": "nccl+cublas", "moe": "nccl-a2a"}
BASELINE_IMPL_BY_OP = {"moe_experts": "grouped-mm"}
BASELINE_IMPLS = (*BASELINE_IMPL.values(), *BASELINE_IMPL_BY_OP.values())
EXPERT_GEMM_OP, EXPERT_GEMM_IMPL = "moe_experts", "kosmos-expert-gemms"  # the MoE expert GEMMs alone
OURS = "kosmos"
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
# the op config a KOSMOS implementation ran with, as "field=value ..." text (tables.config_text); shown after impl
# where it varies
CONFIG_COLUMN = "config"
# nccl-tests' algorithm and bus bandwidth of the communication-only timing t_comm_ms, GB/s (tables.py says how)
BANDWIDTH_COLUMNS = ["comm_algbw_gbps", "comm_busbw_gbps"]
# the columns build_table (and so the csv) ends with, in the order they were added: a csv's columns are only ever
# added at the end, so a reader of an older version's columns finds them where they were
LAST_COLUMNS = [CONFIG_COLUMN, "host_ms", *BANDWIDTH_COLUMNS, "wire_bytes", "rel_err_bf16", "direction",
                "suite_baseline"]  # the suite's own baseline implementation for the speedups, where it names one
# what a row times (the MoE bench's --direction): "fwd", "bwd" (the backward alone) or "fwd+bwd"; rows without the
# field (every TP row, MoE rows of older files) are forward rows
DIRECTION, DEFAULT_DIRECTION = "direction", "fwd"
# the TP bench's mxfp8 rows: the error against the fp32 reference of the original bf16 inputs; every TP row: the
# bytes a rank sends in the op's collective (kosmos_bench/tp.py wire_bytes)
MX_DETAIL_COLUMNS = ["rel_err_bf16", "wire_bytes"]
# bytes per element of a row's dtype, for the bandwidths: mxfp8 is 1 byte per element plus one 1-byte (E8M0) scale
# per block of 32 elements
DTYPE_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0, "mxfp8": 1.0 + 1.0 / 32, "fp8-block": 1.0 + 4.0 / 128}
GEOMEAN_COLUMNS = [
    "source", "bench", "dtype", "direction", "impl", "geomean_speedup", "geomean_overlap_efficiency",
    "ok", "failed", "unavailable",
]
MODEL_GEOMEAN_COLUMNS = [
    "source", "bench", "dtype", "direction", "model", "impl", "geomean_speedup", "geomean_overlap_efficiency",
    "ok", "failed", "unavailable",
]

SHAPE_COLUMNS = ("source", "bench", "op", "layer", "model", "m", "n", "k", "world", "dtype", "direction", *MOE_COLUMNS)
ROW_IDENTITY = (*SHAPE_COLUMNS, "impl", CONFIG_COLUMN)
COMPARISON_GROUP = ("source", "bench", "op", "model", "m", "n", "k", "world", "dtype", "direction")
MOE_COMPARISON_GROUP = ("routing", "tokens")
VERSUS_SHAPE_COLUMNS = ["source", "bench", "op", "layer", "model", "seq", "world", "dtype", "direction"]
VERSUS_COLUMNS = VERSUS_SHAPE_COLUMNS + [
    CONFIG_COLUMN, "kosmos_ms", "fastest_other", "fastest_other_ms", "vs_fastest_other", "vs_fixed_role_best"]

INTEGER_COLUMNS = (
    "seq", "m", "n", "k", "world", "workspace_bytes", "peak_mem_bytes",
    "tokens", "experts", "top_k", "gpu_count", "peak_mem_delta_bytes", "wire_bytes",
)
FLOAT_COLUMNS = (
    "time_ms", "tflops", "speedup", "overlap_efficiency", "rel_err",
    "p20_ms", "p80_ms", "t_gemm_ms", "t_comm_ms", "host_ms", *BANDWIDTH_COLUMNS, "rel_err_bf16",
)
# the "mxfp8 against bf16" section (tables.dtype_table), and its fp8-block twin: per shape, kosmos at the 8-bit
# dtype against kosmos at bf16 and against cuBLAS bf16 alone (the row's t_gemm_ms); speedups (the other time / the
# 8-bit time), > 1: the 8-bit dtype faster
LOW_DTYPES = ("mxfp8", "fp8-block")  # the 8-bit dtypes, each with its section against bf16


def low_name(low: str) -> str:
    """A low dtype as a column-name part: mxfp8, fp8_block."""
    return low.replace("-", "_")


def dtype_columns(low: str = "mxfp8") -> list[str]:
    """The columns of the "<low> / bf16" section (tables.dtype_table) of the 8-bit dtype ``low``."""
    n = low_name(low)
    return ["source", "bench", "op", "layer", "model", "seq", "routing", "m", "n", "k", "world", "kosmos_bf16_ms",
            f"kosmos_{n}_ms", f"{n}_vs_bf16", "cublas_bf16_ms", f"{n}_vs_cublas_bf16"]


DTYPE_COLUMNS = dtype_columns()
# the bytes on the wire per implementation (tables.wire_table): per shape and dtype, the implementations that send
# the same bytes, in MiB, and that against the shape's bf16 bytes
WIRE_COLUMNS = ["source", "bench", "op", "layer", "model", "seq", "routing", "m", "n", "k", "world", "dtype", "impls",
                "wire_mib", "wire_vs_bf16"]
# the section "kosmos against cuBLAS alone at world 1" (tables.cublas_table): per TP shape where kosmos ran ok at
# world 1, kosmos's time against cuBLAS alone (the row's t_gemm_ms); vs_cublas = t_gemm_ms / time_ms, the TFLOP/s
# ratio (> 1: kosmos faster); loop_host_us the kosmos row's host_ms (inside the timing loop) in microseconds. The summary (cublas_summary_table):
# per (source, op, dtype, config) the geomean, the worst shape (m x n x k) and the shapes under the suite's
# vs_cublas_floor target (empty without the target)
CUBLAS_COLUMNS = ["source", "bench", "op", "layer", "model", "seq", "m", "n", "k", "dtype", CONFIG_COLUMN,
                  "kosmos_ms", "cublas_ms", "vs_cublas", "loop_host_us"]
CUBLAS_SUMMARY_COLUMNS = ["source", "bench", "op", "dtype", CONFIG_COLUMN, "shapes", "geomean_vs_cublas",
                          "min_vs_cublas", "worst_shape", "below_floor", "floor"]
# the section "Host time per call inside the timing loop" (tables.host_table): per (source, bench, op, dtype,
# direction, impl, config), over the ok rows with host_ms: each row's host_ms (the median over its timed calls of
# the host time inside the implementation's call, each after a barrier: a cold host, timing.py) in microseconds, the
# median, min and max over the rows. Not the enqueue cost per eager call: HOST_ENQUEUE_COLUMNS
HOST_COLUMNS = ["source", "bench", "op", "dtype", "direction", "impl", CONFIG_COLUMN, "rows", "host_us_median",
                "host_us_min", "host_us_max"]
# the section "Host enqueue time per eager call" (tables.host_enqueue_table): the host rows of `bench tp --host-calls`
# (SCHEMA.md, type "host"), one per (source, bench, op, dtype, world, impl, config, shape): host_us the median of
# `calls` back-to-back eager calls, p20_us / p80_us its percentiles, µs (max over ranks)
HOST_ENQUEUE_COLUMNS = ["source", "bench", "op", "dtype", "world", "impl", CONFIG_COLUMN, "shape", "calls", "host_us",
                        "p20_us", "p80_us", "status", "reason"]
HOST_REQUIRED_KEYS = ("op", "impl", "status", "world", "dtype")
FLOAT_FORMATS = {
    "time_ms": "{:.4f}", "p20_ms": "{:.4f}", "p80_ms": "{:.4f}",
    "t_gemm_ms": "{:.4f}", "t_comm_ms": "{:.4f}", "host_ms": "{:.4f}",
    "comm_algbw_gbps": "{:.1f}", "comm_busbw_gbps": "{:.1f}",
    "tflops": "{:.1f}", "rel_err": "{:.2e}", "rel_err_bf16": "{:.2e}",
    "kosmos_bf16_ms": "{:.4f}", "kosmos_mxfp8_ms": "{:.4f}", "cublas_bf16_ms": "{:.4f}", "mxfp8_vs_bf16": "{:.3f}",
    "mxfp8_vs_cublas_bf16": "{:.3f}", "kosmos_fp8_block_ms": "{:.4f}", "fp8_block_vs_bf16": "{:.3f}",
    "fp8_block_vs_cublas_bf16": "{:.3f}", "wire_mib": "{:.2f}", "wire_vs_bf16": "{:.3f}",
    "speedup": "{:.3f}", "overlap_efficiency": "{:.3f}",
    "geomean_speedup": "{:.3f}", "geomean_overlap_efficiency": "{:.3f}",
    "kosmos_ms": "{:.4f}", "fastest_other_ms": "{:.4f}", "vs_fastest_other": "{:.3f}",
    "vs_fixed_role_best": "{:.3f}",
    "cublas_ms": "{:.4f}", "vs_cublas": "{:.3f}", "geomean_vs_cublas": "{:.3f}", "min_vs_cublas": "{:.3f}",
    "floor": "{:.2f}", "host_us": "{:.1f}", "loop_host_us": "{:.1f}", "host_us_median": "{:.1f}", "host_us_min": "{:.1f}",
    "host_us_max": "{:.1f}", "p20_us": "{:.1f}", "p80_us": "{:.1f}",
}
SPEEDUP_COLUMNS = ("speedup", "geomean_speedup", "vs_fastest_other", "vs_fixed_role_best", "vs_cublas",
                   "geomean_vs_cublas", "min_vs_cublas")
NUMERIC_DISPLAY_COLUMNS = set(INTEGER_COLUMNS) | set(FLOAT_FORMATS) | {"ok", "failed", "unavailable", "shapes",
                                                                        "below_floor", "rows", "calls"}
MIB = 1024 * 1024

# bench train rows (report/train.py): one row per (TRAIN_GROUP, impl); the baseline per proxy kind
TRAIN_BENCH = "train"
TRAIN_BASELINES = {"dense": "nccl+cublas", "moe": "nccl-a2a"}
TRAIN_GROUP = ("source", "model", "layers", "seq", "batch", "hidden", "world", "dtype")
TRAIN_COLUMNS = [*TRAIN_GROUP, "impl", "step_ms", "tokens_per_s", "peak_mem_bytes", "final_loss", "speedup",
                 "loss_max_rel_diff", "status", "reason"]


class ReportError(ValueError):
    """Result or trace files that cannot be reported on."""


def format_value(column: str, value) -> str:
    """A cell as the human-readable tables and the csv show it: "" for missing, FLOAT_FORMATS for floats."""
    if value is None or (not isinstance(value, str) and pd.isna(value)):
        return ""
    float_format = FLOAT_FORMATS.get(column)
    return float_format.format(value) if float_format else str(value)
