"""``kosmos report``: tables, verdict lines and charts of KOSMOS benchmark results (JSON lines and traces, see
SCHEMA.md). The parts: schema (columns, formats, ReportError), load (result and trace files), targets (the
suite bars a report judges against), tables (per-shape table, geomeans, kosmos vs the fastest other, the
communication's bandwidths, kosmos against cuBLAS alone at world 1, the host enqueue time per eager call (host rows)
and the host time per call inside the timing loop), lines (the
sentences under the tables), compact (the default terminal view, for 100
columns), render (md/csv/html/text, terminal, ``report_main``), charts (PNGs), train (the ``bench train`` rows),
files (writing outputs). The names below are what the rest
of the project imports from ``kosmos_bench.report``."""

from .charts import loss_chart, speedup_chart, timeline_chart
from .lines import (bandwidth_line, cublas_line, expert_gemm_line, geomean_target_lines, host_enqueue_line, host_line,
                    versus_line, workspace_line)
from .load import load_records, load_results, load_trace
from .render import print_terminal, render, report_main
from .schema import (
    BANDWIDTH_COLUMNS, BASELINE_IMPL, BASELINE_IMPL_BY_OP, BASELINE_IMPLS, DETAIL_COLUMNS, DTYPE_BYTES, ENV_COLUMNS,
    ENV_FIELDS, FLOAT_FORMATS, GEOMEAN_COLUMNS, MODEL_GEOMEAN_COLUMNS, MOE_COLUMNS, RENDER_FORMATS, REQUIRED_RESULT_KEYS, TABLE_COLUMNS,
    VERSUS_COLUMNS, ReportError,
)
from .tables import (build_table, comm_bandwidth, cublas_summary_table, cublas_table, geomean, geomean_by_model_table,
                     geomean_table, host_enqueue_table, host_table, versus_table)
from .targets import default_targets, target_of
from .train import render_train, train_table

__all__ = [
    "BANDWIDTH_COLUMNS", "BASELINE_IMPL", "BASELINE_IMPL_BY_OP", "BASELINE_IMPLS", "DETAIL_COLUMNS", "DTYPE_BYTES",
    "ENV_COLUMNS", "ENV_FIELDS",
    "FLOAT_FORMATS", "GEOMEAN_COLUMNS", "MODEL_GEOMEAN_COLUMNS", "MOE_COLUMNS", "RENDER_FORMATS",
    "REQUIRED_RESULT_KEYS", "TABLE_COLUMNS", "VERSUS_COLUMNS", "ReportError",
    "bandwidth_line", "build_table", "comm_bandwidth", "cublas_line", "cublas_summary_table", "cublas_table",
    "default_targets", "expert_gemm_line", "geomean", "geomean_by_model_table", "geomean_table",
    "geomean_target_lines", "host_enqueue_line", "host_enqueue_table", "host_line", "host_table", "load_records",
    "load_results", "load_trace", "print_terminal", "render", "report_main",
    "loss_chart", "render_train", "speedup_chart", "target_of", "timeline_chart", "train_table", "versus_line", "versus_table", "workspace_line",
]
