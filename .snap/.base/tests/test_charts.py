"""Tests of the report's charts (kosmos_bench/report/charts.py): the Figure objects the internal helpers build
(panels, labels, colours, axis ranges, legends), and the size of the PNGs written. Skipped without matplotlib."""

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from kosmos_bench.report import build_table, load_results, load_trace, speedup_chart, timeline_chart  # noqa: E402
from kosmos_bench.report import charts  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
TP_SAMPLE = FIXTURES / "tp-sample.jsonl"
MOE_SAMPLE = FIXTURES / "moe-sample.jsonl"
TRACE_SAMPLE = FIXTURES / "trace-sample.json"


def table_of(*paths):
    return build_table(load_results(list(paths))[1])


def png_size(path) -> tuple[int, int]:
    data = Path(path).read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    return struct.unpack(">II", data[16:24])


def panels(fig):
    return [ax for ax in fig.axes if hasattr(ax, "kosmos_op")]


def bar_colors(ax) -> dict[str, tuple]:
    """Legend label (impl, before " (geomean") -> facecolor of its bars."""
    handles, labels = ax.get_legend_handles_labels()
    return {label.split(" (geomean")[0]: tuple(handle.patches[0].get_facecolor()) for handle, label in
            zip(handles, labels)}


def env_line(run_id="r1", bench="tp", gpu_count=2, commit="abcdef0123456789"):
    return {"type": "env", "run_id": run_id, "gpu": "NVIDIA H200", "gpu_count": gpu_count, "git_commit": commit,
            "bench": bench}


def tp_line(impl, time_ms, model="toy", layer="qkv", seq=1024, op="ag_gemm", config=None, status="ok"):
    return {"type": "result", "run_id": "r1", "bench": "tp", "op": op, "layer": layer, "model": model, "seq": seq,
            "m": seq, "n": 512, "k": 256, "world": 2, "dtype": "bf16", "impl": impl, "status": status,
            "reason": None, "time_ms": time_ms, "t_gemm_ms": None, "t_comm_ms": None, "config": config}


def write_jsonl(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


# --------------------------------------------------------------------------- speedup chart


def test_speedup_png_has_a_readable_size(tmp_path):
    path = tmp_path / "tp.png"
    assert speedup_chart(table_of(TP_SAMPLE), path) is True
    width, height = png_size(path)
    assert 600 <= width <= 1800 and 400 <= height <= 2000


def test_many_shapes_wrap_into_rows_instead_of_a_wide_strip(tmp_path):
    lines = [env_line()]
    for model in ("a", "b", "c", "d"):
        for layer in ("qkv", "fc1"):
            for seq in (1024, 2048, 4096, 8192):
                lines += [tp_line(impl, time_ms, model, layer, seq) for impl, time_ms in
                          (("nccl+cublas", 1.0), ("kosmos", 0.9), ("torch-async-tp", 0.95), ("fixed-role", 1.1),
                           ("fixed-role-best", 1.05), ("my-new-impl", 0.97))]
    df = table_of(write_jsonl(tmp_path / "many.jsonl", lines))
    fig = charts._speedup_figure(df)
    assert len(panels(fig)) >= 3  # 32 shapes of one op, 5 series: several rows
    assert all(ax.kosmos_op == "ag_gemm" for ax in panels(fig))
    assert sum(len(ax.get_xticks()) for ax in panels(fig)) == 32
    assert "(1/" in panels(fig)[0].get_title(loc="left")
    path = tmp_path / "many.png"
    speedup_chart(df, path)
    width, height = png_size(path)
    assert width <= 1800 and height <= 2600


def test_moe_chart_has_one_panel_per_op_kind_with_its_baseline():
    fig = charts._speedup_figure(table_of(MOE_SAMPLE))
    by_op = {ax.kosmos_op: ax for ax in panels(fig)}
    assert sorted(by_op) == ["moe_experts", "moe_fwd"] and len(panels(fig)) == 2
    assert by_op["moe_fwd"].get_ylabel() == "speedup vs nccl-a2a"
    assert by_op["moe_experts"].get_ylabel() == "speedup vs grouped-mm"
    assert set(bar_colors(by_op["moe_experts"])) == {"kosmos-expert-gemms"}
    assert "kosmos-expert-gemms" not in bar_colors(by_op["moe_fwd"])
    assert {"kosmos", "fixed-role", "fixed-role-best"} <= set(bar_colors(by_op["moe_fwd"]))
    assert "deepep" in by_op["moe_fwd"].get_xlabel()  # unavailable everywhere: said, not drawn
    labels = [tick.get_text() for tick in by_op["moe_fwd"].get_xticklabels()]
    assert labels == ["deepseek-v3\n4096 tokens\nuniform", "deepseek-v3\n4096 tokens\nzipf:1.2"]


def test_tp_chart_names_baseline_shapes_machine_dtype_and_commit():
    fig = charts._speedup_figure(table_of(TP_SAMPLE))
    assert [ax.kosmos_op for ax in panels(fig)] == ["ag_gemm", "gemm_rs"]
    for ax in panels(fig):
        assert ax.get_ylabel() == "speedup vs nccl+cublas"
        assert any(list(line.get_ydata()) == [1.0, 1.0] for line in ax.get_lines())  # the reference line
        for label in ax.get_xticklabels():
            assert label.get_text().startswith("llama3-70b\n") and "seq " in label.get_text()
    title = fig.get_suptitle()
    for part in ("llama3-70b", "2x NVIDIA H200", "bf16", "0123abc"):
        assert part in title


def test_impl_colours_are_the_same_in_every_chart(tmp_path):
    tp = {impl: color for ax in panels(charts._speedup_figure(table_of(TP_SAMPLE))) for impl, color in
          bar_colors(ax).items()}
    moe = {impl: color for ax in panels(charts._speedup_figure(table_of(MOE_SAMPLE))) for impl, color in
           bar_colors(ax).items()}
    shared = set(tp) & set(moe)
    assert {"kosmos", "fixed-role", "fixed-role-best"} <= shared
    for impl in shared:
        assert tp[impl] == moe[impl]
    from matplotlib.colors import to_rgba
    assert tp["kosmos"] == to_rgba(charts.IMPL_COLORS["kosmos"])
    assert len({charts.impl_color(impl) for impl in charts.IMPL_COLORS if impl not in charts.BASELINE_IMPLS}) == \
        len([impl for impl in charts.IMPL_COLORS if impl not in charts.BASELINE_IMPLS])


def test_unknown_impl_colour_is_a_deterministic_hash():
    color = charts.impl_color("somebody-elses-kernel")
    assert color == charts.impl_color("somebody-elses-kernel") and color in charts._EXTRA_IMPL_COLORS
    other_process = subprocess.run(
        [sys.executable, "-c", "from kosmos_bench.report.charts import impl_color; "
                               "print(impl_color('somebody-elses-kernel'))"],
        capture_output=True, text=True, check=True, env={**os.environ, "PYTHONHASHSEED": "12345"},
        cwd=Path(__file__).parent.parent)
    assert other_process.stdout.strip() == color


def test_several_configs_of_one_impl_are_labelled_impl_and_config(tmp_path):
    lines = [env_line(), tp_line("nccl+cublas", 1.0), tp_line("kosmos", 0.9, config={"push_chunks": 1}),
             tp_line("kosmos", 0.8, config={"push_chunks": 2}), tp_line("fixed-role", 1.1)]
    fig = charts._speedup_figure(table_of(write_jsonl(tmp_path / "ab.jsonl", lines)))
    colors = bar_colors(panels(fig)[0])
    assert {"kosmos [push_chunks=1]", "kosmos [push_chunks=2]", "fixed-role"} == set(colors)
    assert colors["kosmos [push_chunks=1]"] == colors["kosmos [push_chunks=2]"]  # one colour per impl, hatched


def test_one_config_per_impl_is_labelled_by_impl_alone(tmp_path):
    lines = [env_line(), tp_line("nccl+cublas", 1.0), tp_line("kosmos", 0.9, config={"push_chunks": 1})]
    fig = charts._speedup_figure(table_of(write_jsonl(tmp_path / "one.jsonl", lines)))
    assert set(bar_colors(panels(fig)[0])) == {"kosmos"}


# --------------------------------------------------------------------------- timeline


def write_trace(path, ranks, kinds=None):
    kinds = kinds or {"0": "idle", "1": "comm", "2": "compute", "3": "wait", "4": "route", "5": "permute",
                      "6": "gemm1", "7": "gemm2", "8": "fold"}
    path.write_text(json.dumps({"type": "trace", "op": "moe", "model": "toy", "tokens": 64, "routing": "uniform",
                                "world": len(ranks), "impl": "kosmos", "kinds": kinds,
                                "ranks": [{"rank": rank, "events": events} for rank, events in enumerate(ranks)]}))
    return path


def rank_axes(fig):
    return [ax for ax in fig.axes if hasattr(ax, "kosmos_rank")]


def legend_labels(fig):
    return [text.get_text() for legend in fig.legends for text in legend.get_texts()]


def test_timeline_ranks_share_one_time_axis_from_the_earliest_event():
    trace = load_trace(TRACE_SAMPLE)
    fig = charts._timeline_figure(trace, {})
    axes = rank_axes(fig)
    assert [ax.kosmos_rank for ax in axes] == [0, 1]
    origin = min(events[:, 3].min() for _, events in trace.ranks)
    end_us = max((events[:, 4].max() - origin) / 1e3 for _, events in trace.ranks)
    for ax in axes:
        low, high = ax.get_xlim()
        assert low == 0 and high == pytest.approx(end_us)
    assert "rank 1" in axes[1].get_title(loc="left") and "3.2 µs" in axes[1].get_title(loc="left")  # started late
    assert "globaltimer" in axes[-1].get_xlabel()  # the clocks of two GPUs: said, not hidden


def test_timeline_legend_lists_only_the_kinds_drawn(tmp_path):
    events = [[0, 2, 0, 0, 1000], [0, 3, 1, 1000, 1500], [1, 2, 2, 0, 1400], [1, 0, 3, 1400, 1500]]
    fig = charts._timeline_figure(load_trace(write_trace(tmp_path / "t.json", [events, events])), {})
    assert legend_labels(fig) == ["compute", "wait", "idle"]
    assert len(fig.legends) == 1


def test_timeline_kind_families_have_distinct_colours():
    compute = {charts.kind_color(name) for name in ("compute", "gemm1", "gemm2", "route")}
    comm = {charts.kind_color(name) for name in ("comm", "permute", "fold")}
    wait, idle = charts.kind_color("wait"), charts.kind_color("idle")
    assert not compute & comm and wait not in compute | comm and idle not in compute | comm | {wait}
    assert charts.kind_family("my-dispatch") == "comm" and charts.kind_family("epilogue") == "compute"
    assert charts.kind_color("my-dispatch") in charts._FAMILY_EXTRA_COLORS["comm"]


def test_timeline_legend_does_not_overlap_the_title():
    fig = charts._timeline_figure(load_trace(TRACE_SAMPLE), {})
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    title = fig._suptitle.get_window_extent(renderer)
    for legend in fig.legends:
        assert not legend.get_window_extent(renderer).overlaps(title)
        for ax in rank_axes(fig):
            assert not legend.get_window_extent(renderer).overlaps(ax.get_window_extent(renderer))


def test_timeline_late_rank_is_late_and_a_long_wait_is_compressed_and_said(tmp_path):
    """Rank 0 routes, then waits 100 ms for rank 1, which starts late (as in a committed MoE trace)."""
    rank0 = [[p, 4, p, 0, 50_000] for p in range(4)] + [[p, 3, -1, 50_000, 100_050_000] for p in range(4)] + \
            [[p, 6, p, 100_050_000, 100_900_000] for p in range(4)]
    rank1 = [[p, 4, p, 100_000_000, 100_050_000] for p in range(4)] + \
            [[p, 6, p, 100_050_000, 100_950_000] for p in range(4)]
    path = write_trace(tmp_path / "late.json", [rank0, rank1])
    fig = charts._timeline_figure(load_trace(path), charts._trace_header(path))
    assert fig.kosmos_gap_us == pytest.approx((50.0, 100_000.0))
    for ax in rank_axes(fig):
        assert ax.get_xlim() == pytest.approx((0.0, 100_950.0))
    assert "100,000.0 µs" in rank_axes(fig)[1].get_title(loc="left")
    caption = rank_axes(fig)[-1].get_xlabel()
    assert "compressed" in caption and "rank 0 waits" in caption and "rank 1 has not started" in caption
    assert legend_labels(fig) == ["route (compute)", "gemm1 (compute)", "wait"]
    assert "toy" in fig.get_suptitle() and "64 tokens" in fig.get_suptitle()
    png = tmp_path / "late.png"
    timeline_chart(path, png)
    width, height = png_size(png)
    assert width <= 1800 and height <= 1400


def test_timeline_png_size_bounds(tmp_path):
    path = timeline_chart(TRACE_SAMPLE, tmp_path / "sample.png")
    width, height = png_size(path)
    assert 1000 <= width <= 1800 and 300 <= height <= 1400


def test_timeline_of_many_ranks_stays_bounded(tmp_path):
    events = [[p, 2, p, 1000 * p, 1000 * p + 5000] for p in range(132)]
    path = write_trace(tmp_path / "w8.json", [events] * 8)
    png = timeline_chart(path, tmp_path / "w8.png")
    width, height = png_size(png)
    assert width <= 1800 and height <= 2000
    fig = charts._timeline_figure(load_trace(path), {})
    assert len(rank_axes(fig)) == 8 and len({ax.get_xlim() for ax in rank_axes(fig)}) == 1
    assert np.isclose(rank_axes(fig)[0].get_xlim()[1], (131 * 1000 + 5000) / 1e3)
