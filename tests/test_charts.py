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
    """Legend label (impl, before " (geomean") -> facecolor of its bars (the target lines left out)."""
    handles, labels = ax.get_legend_handles_labels()
    return {label.split(" (geomean")[0]: tuple(handle.patches[0].get_facecolor()) for handle, label in
            zip(handles, labels) if hasattr(handle, "patches")}


def bar_values(ax) -> dict[str, list[float]]:
    """Legend label (impl, before " (geomean") -> the values its bars show (drawn from 1.0: bottom + height),
    NaN where no bar."""
    handles, labels = ax.get_legend_handles_labels()
    return {label.split(" (geomean")[0]: [patch.get_y() + patch.get_height() for patch in handle.patches]
            for handle, label in zip(handles, labels) if hasattr(handle, "patches")}


def target_lines(ax) -> dict[str, float]:
    """Label -> y of the suite's target lines of a panel."""
    return {line.get_label(): line.get_ydata()[0] for line in ax.get_lines() if line.get_label().startswith(
        ("target", "floor"))}


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


def test_each_direction_is_its_own_panel_titled_by_it():
    """MoE rows of three directions: a panel per direction, titled by it, each drawing its own direction's
    speedups (not the last direction's over the others)."""
    fig = charts._speedup_figure(table_of(FIXTURES / "moe-direction-sample.jsonl"))
    by_direction = {ax.kosmos_direction: ax for ax in panels(fig)}
    assert sorted(by_direction) == ["bwd", "fwd", "fwd+bwd"] and len(panels(fig)) == 3
    expected = {"fwd": ("MoE layer forward ", 2.0), "bwd": ("MoE layer backward ", 1.5),
                "fwd+bwd": ("MoE layer forward+backward ", 2.0)}
    for direction, (title, speedup) in expected.items():
        ax = by_direction[direction]
        assert ax.get_title(loc="left").startswith(title)
        assert bar_values(ax)["kosmos"] == [pytest.approx(speedup)]


def test_each_dtype_is_its_own_panel():
    """bf16 and mxfp8 rows of one op: a panel each, named by its dtype, each against the baseline at its dtype."""
    fig = charts._speedup_figure(table_of(FIXTURES / "tp-mx-sample.jsonl"))
    keys = [(ax.kosmos_op, ax.kosmos_dtype) for ax in panels(fig)]
    assert keys == [("ag_gemm", "bf16"), ("ag_gemm", "mxfp8"), ("gemm_rs", "bf16"), ("gemm_rs", "mxfp8")]
    ag_mx = panels(fig)[1]
    assert "mxfp8" in ag_mx.get_title(loc="left")
    values = bar_values(ag_mx)
    assert values["kosmos"] == [pytest.approx(1.4 / 1.1)] and values["fp8-rowwise"] == [pytest.approx(1.4 / 0.7)]
    assert values["triton-dot-scaled"] == [pytest.approx(1.4 / 4.2)]
    assert bar_values(panels(fig)[0])["kosmos"] == [pytest.approx(1.21 / 1.05)]


def test_kosmos_alone_at_world_1_is_drawn_against_cublas_alone(tmp_path):
    """A grid run (kosmos alone at world 1): bars of t_gemm_ms / time_ms, the suite's geomean bar and floor as
    lines, the one-line shape labels; no empty panel."""
    suite = {"name": "grid", "bench": "tp", "targets": {"vs_cublas_geomean": 0.97, "vs_cublas_floor": 0.9}}
    lines = [{**env_line(gpu_count=1), "suite": suite}]
    for m, time_ms, t_gemm in ((256, 1.0, 0.8), (512, 1.0, 0.95), (1024, 1.0, 1.02)):
        lines.append({**tp_line("kosmos", time_ms, model="custom", layer="custom", seq=m), "world": 1,
                      "t_gemm_ms": t_gemm, "t_comm_ms": 0.0})
    fig = charts._speedup_figure(table_of(write_jsonl(tmp_path / "grid.jsonl", lines)))
    ax, = panels(fig)
    assert ax.kosmos_baseline == "cuBLAS alone" and ax.get_ylabel() == "speedup vs cuBLAS alone"
    assert bar_values(ax)["kosmos"] == pytest.approx([0.8, 0.95, 1.02])
    assert target_lines(ax) == {"target: geomean >= 0.97": 0.97, "floor: every shape >= 0.90": 0.9}
    assert [label.get_text() for label in ax.get_xticklabels()] == ["256×512×256", "512×512×256", "1024×512×256"]
    low, high = ax.get_ylim()
    assert 0.7 < low < 0.8 and 1.02 < high < 1.1  # the range of the values, not from 0


def test_y_range_shows_the_differences_and_the_target_is_a_line():
    """The TP sample at world 2: the y axis spans the speedups, the baseline's 1.0 and the suite's geomean bar
    (1.15), not 0 to the top; the bars start at 1.0; the bar is a red line in the legend."""
    fig = charts._speedup_figure(table_of(TP_SAMPLE))
    for ax in panels(fig):
        values = [value for bars in bar_values(ax).values() for value in bars if not np.isnan(value)]
        low, high = ax.get_ylim()
        assert low > 0.9 and low < min(values + [1.0]) and high > max(values + [1.15])
        assert target_lines(ax) == {"target: kosmos geomean >= 1.15": 1.15}
        assert all(patch.get_y() == 1.0 for container in ax.containers for patch in container.patches)
        assert any(label.startswith("target") for label in ax.get_legend_handles_labels()[1])


def test_every_implementation_and_baseline_has_its_own_colour():
    colours = [charts.impl_color(impl) for impl in charts.IMPL_COLORS]
    assert len(set(colours)) == len(colours)
    assert not set(charts._EXTRA_IMPL_COLORS) & set(charts.IMPL_COLORS.values())
    fig = charts._speedup_figure(table_of(TP_SAMPLE))
    drawn = bar_colors(panels(fig)[0])
    assert len(set(drawn.values())) == len(drawn) == 4  # kosmos, torch-async-tp, fixed-role, fixed-role-best


# --------------------------------------------------------------------------- the training figure


def test_training_figure_shows_speedups_and_the_loss_difference(tmp_path):
    """The training figure: the step-time speedup of each implementation over the baseline (a point, its p20-p80
    whisker) on a range that shows the difference, and the loss difference per step relative to the baseline's,
    not the two loss curves."""
    from kosmos_bench.report.train import train_table
    table = train_table(load_results([FIXTURES / "train-sample.jsonl"])[1])
    fig = charts._loss_figure(table)
    speed, loss = fig.axes[0], fig.axes[1]
    points = {line.get_label(): line.get_ydata() for line in speed.get_lines() if not line.get_label().startswith("_")}
    assert list(points["kosmos"]) == pytest.approx([120.0 / 103.0, 120.0 / 98.0])  # the whisker: p80, p20
    assert list(points["nccl+cublas"]) == pytest.approx([120.0 / 123.6, 120.0 / 117.6])
    low, high = speed.get_ylim()
    assert low > 0.9 and high > 120.0 / 98.0
    base = np.array(table[table.impl == "nccl+cublas"].losses.iloc[0])
    ours = np.array(table[(table.impl == "kosmos") & (table.dtype == "bf16")].losses.iloc[0])
    drawn = [line for line in loss.get_lines() if line.get_label().startswith("kosmos")]
    assert len(drawn) == 1 and list(drawn[0].get_ydata()) == pytest.approx(list((ours - base) / base))
    assert not any(list(line.get_ydata()) == pytest.approx(list(base)) for line in loss.get_lines())
    assert "final loss: nccl+cublas 0.95000, kosmos 0.95000" in " ".join(loss.get_title(loc="left").split())
    png = tmp_path / "train.png"
    assert charts.loss_chart(table, png)
    width, height = png_size(png)
    assert width <= 1800 and height <= 1400


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
