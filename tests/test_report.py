"""Tests of kosmos_bench.report on the synthetic fixtures in tests/fixtures."""

import csv
import html
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from kosmos_bench.report import (
    ReportError,
    load_trace,
    build_table,
    comm_bandwidth,
    default_targets,
    geomean_table,
    load_results,
    print_terminal,
    render,
    report_main,
    speedup_chart,
    geomean_by_model_table,
    target_of,
    timeline_chart,
    versus_table,
)
from kosmos_bench.suites import default_moe_suite, default_suite

FIXTURES = Path(__file__).parent / "fixtures"
TP_SAMPLE = FIXTURES / "tp-sample.jsonl"
MOE_SAMPLE = FIXTURES / "moe-sample.jsonl"
TRACE_SAMPLE = FIXTURES / "trace-sample.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def table():
    _, results = load_results([TP_SAMPLE])
    return build_table(results)


def row_of(df, op, seq, impl, source="tp-sample"):
    rows = df[(df.op == op) & (df.seq == seq) & (df.impl == impl) & (df.source == source)]
    assert len(rows) == 1
    return rows.iloc[0]


def result_line(**overrides):
    line = {
        "type": "result", "run_id": "r1", "bench": "tp", "op": "ag_gemm", "layer": "qkv",
        "model": "toy", "seq": 1024, "m": 1024, "n": 512, "k": 256, "world": 2, "dtype": "bf16",
        "impl": "kosmos", "status": "ok", "reason": None, "time_ms": 1.0, "t_gemm_ms": None, "t_comm_ms": None,
    }
    return {**line, **overrides}


def write_lines(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def terminal_text(df, width, wide=False):
    """What print_terminal shows on a console ``width`` columns wide."""
    console = Console(file=io.StringIO(), width=width, color_system=None)
    print_terminal(df, console, wide=wide)
    return console.file.getvalue()


def test_load_merges_env_and_source():
    envs, results = load_results([TP_SAMPLE])
    assert len(envs) == 1 and envs[0]["note"].startswith("synthetic fixture")
    assert len(results) == 20
    assert {r["source"] for r in results} == {"tp-sample"}
    assert {(r["gpu"], r["gpu_count"]) for r in results} == {("NVIDIA H200", 2)}


def test_table_columns_and_rows(table):
    expected_prefix = [
        "source", "bench", "op", "layer", "model", "seq", "m", "n", "k", "world", "dtype", "impl",
        "time_ms", "tflops", "speedup", "overlap_efficiency", "rel_err", "workspace_bytes", "status", "reason",
    ]
    assert list(table.columns[: len(expected_prefix)]) == expected_prefix
    assert "routing" not in table  # no MoE rows in the fixture
    assert len(table) == 20
    assert set(table.layer) == {"qkv", "attn_out"}


def test_speedup_and_overlap_by_hand(table):
    kosmos = row_of(table, "ag_gemm", 8192, "kosmos")
    # fixture: nccl+cublas 1.210 ms, kosmos 1.052 ms; t_gemm 0.985 ms, t_comm 0.192 ms
    assert kosmos.speedup == pytest.approx(1.210 / 1.052)
    assert kosmos.overlap_efficiency == pytest.approx(0.985 / 1.052)
    assert row_of(table, "gemm_rs", 8192, "nccl+cublas").speedup == pytest.approx(1.0)


def test_failed_and_unavailable_rows(table):
    failed = row_of(table, "gemm_rs", 4096, "fixed-role")
    assert failed.status == "failed"
    assert failed.reason == "rel_err 3.1e-01 > 1e-02"
    assert math.isnan(failed.speedup) and math.isnan(failed.overlap_efficiency)
    unavailable = row_of(table, "gemm_rs", 4096, "torch-async-tp")
    assert unavailable.status == "unavailable" and math.isnan(unavailable.speedup)


def test_speedup_nan_when_baseline_not_ok(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [
        result_line(impl="nccl+cublas", status="failed", reason="boom", time_ms=None),
        result_line(impl="kosmos", time_ms=0.5),
    ])
    df = build_table(load_results([path])[1])
    assert df.speedup.isna().all()


def test_csv_one_row_per_shape_and_impl(table):
    text = render(table, "csv")
    reader = csv.DictReader(io.StringIO(text))
    required = "op,model,m,n,k,world,dtype,impl,time_ms,tflops,speedup,overlap_efficiency,status".split(",")
    assert set(required) <= set(reader.fieldnames)
    rows = list(reader)
    keys = [(r["op"], r["model"], r["m"], r["n"], r["k"], r["world"], r["dtype"], r["impl"]) for r in rows]
    assert len(keys) == len(set(keys)) == 20
    kosmos = next(r for r in rows if r["op"] == "ag_gemm" and r["m"] == "8192" and r["impl"] == "kosmos")
    assert kosmos["time_ms"] == "1.0520" and kosmos["speedup"] == "1.150"
    failed = next(r for r in rows if r["status"] == "failed")
    assert failed["speedup"] == "" and failed["reason"] == "rel_err 3.1e-01 > 1e-02"


def test_duplicate_rows_keep_last(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [result_line(time_ms=2.0), result_line(time_ms=1.5)])
    df = build_table(load_results([path])[1])
    assert list(df.time_ms) == [1.5]


def test_geomean_hand_checked(tmp_path):
    lines = []
    for m, baseline_ms, kosmos_ms in ((1024, 2.0, 1.0), (2048, 1.0, 2.0), (4096, 3.0, 1.0)):
        lines += [result_line(m=m, impl="nccl+cublas", time_ms=baseline_ms), result_line(m=m, time_ms=kosmos_ms)]
    lines.append(result_line(m=8192, status="failed", reason="rel_err", time_ms=None))
    lines.append(result_line(m=8192, impl="fixed-role", status="unavailable", reason="n/a", time_ms=None))
    df = build_table(load_results([write_lines(tmp_path / "g.jsonl", lines)])[1])
    geomeans = geomean_table(df).set_index("impl")
    # kosmos speedups 2, 0.5, 3 -> geomean 3 ** (1/3)
    assert geomeans.loc["kosmos", "geomean_speedup"] == pytest.approx(3 ** (1 / 3))
    assert (geomeans.loc["kosmos", "ok"], geomeans.loc["kosmos", "failed"]) == (3, 1)
    assert geomeans.loc["nccl+cublas", "geomean_speedup"] == pytest.approx(1.0)
    assert geomeans.loc["fixed-role", "unavailable"] == 1
    assert math.isnan(geomeans.loc["fixed-role", "geomean_speedup"])


def test_geomean_overlap_efficiency(tmp_path):
    lines = [
        result_line(m=1024, time_ms=1.0, t_gemm_ms=0.5, t_comm_ms=0.2),
        result_line(m=2048, time_ms=1.0, t_gemm_ms=0.1, t_comm_ms=0.8),
    ]
    df = build_table(load_results([write_lines(tmp_path / "o.jsonl", lines)])[1])
    assert geomean_table(df).geomean_overlap_efficiency.iloc[0] == pytest.approx(math.sqrt(0.5 * 0.8))


def test_markdown_has_environment_and_geomean(table):
    text = render(table, "md")
    assert "NVIDIA H200" in text and "0123abc" in text and "2025-01-01T12:00:00Z" in text
    assert "## Geomean" in text
    assert "Workspace memory" in text and "128.0 MiB" in text
    assert "rel_err 3.1e-01 > 1e-02" in text


def test_html_is_self_contained(table):
    text = render(table, "html")
    assert text.startswith("<!DOCTYPE html>") and text.rstrip().endswith("</html>")
    assert "Geomean" in text and "<style>" in text and "NVIDIA H200" in text
    assert "<script" not in text and "http" not in text


def test_unknown_format(table):
    with pytest.raises(ReportError, match="unknown format"):
        render(table, "xlsx")


def test_terminal_shows_reason(table):
    console = Console(file=io.StringIO(), width=300, color_system=None)
    print_terminal(table, console, wide=True)
    text = console.file.getvalue()
    assert "failed: rel_err 3.1e-01 > 1e-02" in text
    assert "Geomean" in text
    compact = terminal_text(table, 300)
    assert "failed [2]" in compact and "[2] fixed-role failed: rel_err 3.1e-01 > 1e-02" in compact


def test_two_sources_side_by_side(tmp_path, table):
    other = tmp_path / "tp-other.jsonl"
    shutil.copy(TP_SAMPLE, other)
    _, results = load_results([TP_SAMPLE, other])
    df = build_table(results)
    assert set(df.source) == {"tp-sample", "tp-other"}
    assert len(df) == 2 * len(table)
    assert row_of(df, "ag_gemm", 8192, "kosmos", source="tp-other").speedup == pytest.approx(1.210 / 1.052)
    assert len(geomean_table(df)) == 10
    assert "tp-other" in render(df, "md")


def test_malformed_json_names_the_line(tmp_path):
    lines = TP_SAMPLE.read_text().splitlines()
    lines[3] = lines[3][:-5]
    path = tmp_path / "broken.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"broken\.jsonl:4: invalid JSON"):
        load_results([path])


def test_missing_file():
    with pytest.raises(ReportError, match="no such result file"):
        load_results([FIXTURES / "does-not-exist.jsonl"])


def test_no_result_lines(tmp_path):
    env_line = TP_SAMPLE.read_text().splitlines()[0]
    path = tmp_path / "env-only.jsonl"
    path.write_text(env_line + "\n")
    with pytest.raises(ReportError, match="no result lines"):
        load_results([path])


def test_a_folder_or_a_trace_is_told_apart_from_a_result_file(tmp_path):
    """`kosmos report DIR/` says it is a folder and what to pass; a trace file given as results (one line, as bench
    --trace writes it, or indented) points to --timeline; a result file given to --timeline says to drop it."""
    (tmp_path / "a.jsonl").write_text(TP_SAMPLE.read_text())
    with pytest.raises(ReportError, match=r"is a folder, not a result file: pass its result files, e\.g\. "
                                          r"kosmos report .*\*\.jsonl \(1 \.jsonl file there\)"):
        load_results([tmp_path])
    one_line = tmp_path / "trace.json"
    one_line.write_text(json.dumps(json.loads(TRACE_SAMPLE.read_text())) + "\n")
    for trace in (one_line, TRACE_SAMPLE):
        with pytest.raises(ReportError, match=rf"is a trace file .*kosmos report --timeline {re.escape(str(trace))}"):
            load_results([trace])
    with pytest.raises(ReportError, match=r"is a result file, not a trace: report it without --timeline"):
        load_trace(TP_SAMPLE)
    with pytest.raises(ReportError, match=r"is a folder, not a trace file"):
        load_trace(tmp_path)
    one_line_error(run_report(tmp_path), "is a folder", "*.jsonl")
    one_line_error(run_report(TRACE_SAMPLE), "--timeline")


def test_result_missing_required_key(tmp_path):
    line = result_line()
    del line["dtype"]
    with pytest.raises(ReportError, match=r"m\.jsonl:1: .*dtype"):
        load_results([write_lines(tmp_path / "m.jsonl", [line])])


def test_moe_rows_get_extra_columns_and_nccl_a2a_baseline(tmp_path):
    def moe(impl, time_ms, routing):
        extra = {"tokens": 4096, "experts": 8, "top_k": 2, "routing": routing}
        return result_line(bench="moe", op="moe_fwd", layer="custom", impl=impl, time_ms=time_ms, extra=extra)

    lines = [moe("nccl-a2a", 2.0, "uniform"), moe("kosmos", 1.0, "uniform"),
             moe("nccl-a2a", 3.0, "skewed"), moe("kosmos", 2.0, "skewed")]
    df = build_table(load_results([write_lines(tmp_path / "moe.jsonl", lines)])[1])
    assert list(df.columns[20:24]) == ["tokens", "experts", "top_k", "routing"]
    kosmos = df[df.impl == "kosmos"].set_index("routing")
    assert kosmos.loc["uniform", "speedup"] == pytest.approx(2.0)
    assert kosmos.loc["skewed", "speedup"] == pytest.approx(1.5)


def test_suite_baseline_sets_the_moe_layers_speedups(tmp_path):
    """A suite that names its own baseline (moe-hf: hf-grouped-mm) gets the layer's speedups and titles over it,
    not over the bench's nccl-a2a; the expert GEMMs alone keep grouped-mm."""
    def moe(impl, time_ms, tokens):
        extra = {"tokens": tokens, "experts": 8, "top_k": 2, "routing": "uniform"}
        return result_line(bench="moe", op="moe_fwd", layer="moe", world=1, m=tokens, seq=tokens, impl=impl,
                           time_ms=time_ms, extra=extra)

    suite = {"name": "moe-hf", "bench": "moe", "impls": ["kosmos", "hf-grouped-mm"], "baseline": "hf-grouped-mm"}
    lines = [env_line(suite, bench="moe"), moe("hf-grouped-mm", 3.0, 4096), moe("kosmos", 2.0, 4096),
             moe("hf-grouped-mm", 5.0, 8192), moe("kosmos", 2.5, 8192)]
    df = build_table(load_results([write_lines(tmp_path / "hf.jsonl", lines)])[1])
    kosmos = df[df.impl == "kosmos"].set_index("m")
    assert kosmos.loc[4096, "speedup"] == pytest.approx(1.5) and kosmos.loc[8192, "speedup"] == pytest.approx(2.0)
    text = terminal_text(df, 100)
    assert "Geomean speedup over hf-grouped-mm" in text and "over nccl-a2a" not in text


def test_speedup_chart_writes_png(tmp_path, table):
    pytest.importorskip("matplotlib")
    path = tmp_path / "speedup.png"
    assert speedup_chart(table, path) is True
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_timeline_chart_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    timeline_chart(TRACE_SAMPLE, path)
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_timeline_chart_copes_with_many_events(tmp_path):
    pytest.importorskip("matplotlib")
    events = [[i % 132, i % 3, i, 1000 * i, 1000 * i + 800] for i in range(50_000)]
    trace = {"type": "trace", "kinds": {"0": "idle/wait", "1": "comm", "2": "compute"},
             "ranks": [{"rank": 0, "events": events}, {"rank": 1, "events": events}]}
    trace_path = tmp_path / "big.json"
    trace_path.write_text(json.dumps(trace))
    timeline_chart(trace_path, tmp_path / "big.png")
    assert (tmp_path / "big.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("trace", [
    {"type": "trace"},
    {"type": "trace", "ranks": [{"rank": 0, "events": [[0, 1, 0, 10]]}]},
    {"type": "trace", "ranks": [{"rank": 0, "events": [[0, 1, 0, 10, 5]]}]},
    {"type": "trace", "kinds": {"comm": 1}, "ranks": [{"rank": 0, "events": []}]},
])
def test_timeline_rejects_malformed_trace(tmp_path, trace):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(trace))
    with pytest.raises(ReportError):
        timeline_chart(path, tmp_path / "bad.png")


def test_report_main_writes_outputs(tmp_path):
    console = Console(file=io.StringIO(), width=200, color_system=None)
    status = Console(file=io.StringIO(), width=200, color_system=None)
    md_path, chart_path = tmp_path / "report.md", tmp_path / "chart.png"
    assert report_main([TP_SAMPLE], fmt="md", out=md_path, chart=chart_path, console=console, status=status) == 0
    assert "## Geomean" in md_path.read_text()
    assert chart_path.exists() or "matplotlib missing" in status.file.getvalue()
    assert console.file.getvalue() == ""  # the messages are status, not output
    assert f"md report written to {md_path}" in status.file.getvalue()


def test_report_main_prints_csv_unwrapped(tmp_path):
    console = Console(file=io.StringIO(), width=40, color_system=None)
    assert report_main([TP_SAMPLE], fmt="csv", console=console) == 0
    assert len(console.file.getvalue().splitlines()) == 21


def test_report_main_timeline_default_output(tmp_path):
    pytest.importorskip("matplotlib")
    trace_path = tmp_path / "trace.json"
    shutil.copy(TRACE_SAMPLE, trace_path)
    console = Console(file=io.StringIO(), width=200, color_system=None)
    status = Console(file=io.StringIO(), width=200, color_system=None)
    assert report_main([], timeline=trace_path, console=console, status=status) == 0
    assert (tmp_path / "trace.png").read_bytes().startswith(PNG_MAGIC)
    assert "timeline written to" in status.file.getvalue() and console.file.getvalue() == ""


# --------------------------------------------------------------------------- MoE rows (moe-sample.jsonl)


@pytest.fixture
def moe_table():
    _, results = load_results([MOE_SAMPLE])
    return build_table(results)


def moe_row(df, routing, impl):
    rows = df[(df.routing == routing) & (df.impl == impl)]
    assert len(rows) == 1
    return rows.iloc[0]


def test_moe_fixture_loads_with_moe_columns(moe_table):
    assert len(moe_table) == 14 and set(moe_table.bench) == {"moe"}
    assert list(moe_table.columns[20:24]) == ["tokens", "experts", "top_k", "routing"]
    row = moe_row(moe_table, "uniform", "kosmos")
    assert (row.tokens, row.experts, row.top_k, row.m, row.n, row.k, row.world) == (4096, 256, 8, 4096, 7168, 2048, 2)
    assert row.peak_mem_delta_bytes == 3 << 30


def test_moe_speedup_and_overlap_by_hand(moe_table):
    # fixture: nccl-a2a 14.0 ms (uniform) / 15.5 ms (zipf:1.2); kosmos 9.0 / 10.0; grouped-mm 4.9 / 6.2,
    # t_comm 3.1 / 3.3; kosmos-expert-gemms 5.4 / 6.9
    kosmos = moe_row(moe_table, "uniform", "kosmos")
    assert kosmos.speedup == pytest.approx(14.0 / 9.0)
    assert kosmos.overlap_efficiency == pytest.approx(4.9 / 9.0)
    assert moe_row(moe_table, "zipf:1.2", "kosmos").speedup == pytest.approx(15.5 / 10.0)
    assert moe_row(moe_table, "zipf:1.2", "nccl-a2a").speedup == pytest.approx(1.0)
    # expert GEMMs alone: compared with grouped-mm, not with the layer
    gemms = moe_row(moe_table, "uniform", "kosmos-expert-gemms")
    assert gemms.speedup == pytest.approx(4.9 / 5.4)
    assert gemms.speedup == pytest.approx(gemms.tflops / moe_row(moe_table, "uniform", "grouped-mm").tflops, rel=1e-3)
    assert math.isnan(gemms.overlap_efficiency)
    assert moe_row(moe_table, "zipf:1.2", "fixed-role").status == "failed"
    assert math.isnan(moe_row(moe_table, "zipf:1.2", "fixed-role").speedup)
    assert moe_row(moe_table, "uniform", "deepep").status == "unavailable"


def test_moe_geomean_per_impl(moe_table):
    g = geomean_table(moe_table).set_index("impl")
    assert g.loc["kosmos", "geomean_speedup"] == pytest.approx(math.sqrt(14.0 / 9.0 * 15.5 / 10.0))
    assert g.loc["kosmos-expert-gemms", "geomean_speedup"] == pytest.approx(math.sqrt(4.9 / 5.4 * 6.2 / 6.9))
    assert (g.loc["fixed-role", "ok"], g.loc["fixed-role", "failed"]) == (1, 1)
    assert g.loc["deepep", "unavailable"] == 2


def test_moe_csv_one_row_per_point_and_impl(moe_table):
    reader = csv.DictReader(io.StringIO(render(moe_table, "csv")))
    rows = list(reader)
    keys = [(r["op"], r["model"], r["m"], r["n"], r["k"], r["world"], r["dtype"], r["routing"], r["impl"])
            for r in rows]
    assert len(keys) == len(set(keys)) == 14
    kosmos = next(r for r in rows if r["routing"] == "uniform" and r["impl"] == "kosmos")
    assert (kosmos["op"], kosmos["m"], kosmos["n"], kosmos["k"]) == ("moe_fwd", "4096", "7168", "2048")
    assert kosmos["speedup"] == "1.556" and kosmos["overlap_efficiency"] == "0.544"
    gemms = next(r for r in rows if r["routing"] == "uniform" and r["impl"] == "kosmos-expert-gemms")
    assert gemms["op"] == "moe_experts" and gemms["overlap_efficiency"] == ""


def test_moe_expert_gemm_bar_line(moe_table):
    md = render(moe_table, "md")
    assert "MoE expert GEMMs alone, kosmos-expert-gemms vs grouped-mm" in md
    assert "90% of its TFLOP/s (geomean over 2 points, min 90%): meets the >= 80% bar" in md
    assert "meets the &gt;= 80% bar" in render(moe_table, "html") and "meets the >= 80% bar" in render(moe_table, "text")
    assert "| routing |" in md and "zipf:1.2" in md
    assert "MoE expert GEMMs" not in render(build_table(load_results([TP_SAMPLE])[1]), "md")


def test_moe_expert_gemm_bar_can_be_missed(tmp_path):
    lines = [json.loads(x) for x in MOE_SAMPLE.read_text().splitlines()]
    for line in lines:
        if line.get("impl") == "kosmos-expert-gemms":
            line["time_ms"] *= 2
    df = build_table(load_results([write_lines(tmp_path / "slow.jsonl", lines)])[1])
    assert "misses the >= 80% bar" in render(df, "md")


def test_moe_fields_read_from_extra_too(tmp_path):
    """Older rows keep tokens/experts/top_k/routing only in extra; newer ones at the top level."""
    top = result_line(bench="moe", op="moe_fwd", impl="nccl-a2a", tokens=8, experts=4, top_k=2, routing="zipf:2",
                      extra={})
    df = build_table(load_results([write_lines(tmp_path / "t.jsonl", [top])])[1])
    assert (df.tokens[0], df.routing[0]) == (8, "zipf:2")


def test_moe_and_tp_side_by_side(table):
    _, results = load_results([TP_SAMPLE, MOE_SAMPLE])
    df = build_table(results)
    assert len(df) == len(table) + 14
    assert row_of(df, "ag_gemm", 8192, "kosmos").speedup == pytest.approx(1.210 / 1.052)
    assert moe_row(df, "uniform", "kosmos").speedup == pytest.approx(14.0 / 9.0)
    assert df[df.bench == "tp"].routing.isna().all()
    text = render(df, "md")
    assert "| bench |" in text and "| routing |" in text


def test_moe_speedup_chart(tmp_path, moe_table):
    pytest.importorskip("matplotlib")
    path = tmp_path / "moe.png"
    assert speedup_chart(moe_table, path) is True
    assert path.read_bytes().startswith(PNG_MAGIC)


def test_developer_knobs_of_a_run_are_shown(tmp_path):
    """A run made under a KOSMOS_* override says so: the env record's knobs reach every row and the report."""
    env = {"type": "env", "run_id": "r1", "gpu": "G", "gpu_count": 2, "git_commit": "a" * 40,
           "knobs": {"KOSMOS_MOE_BH": "512", "KOSMOS_MOE_HALF_TAIL": "0"}}
    path = tmp_path / "k.jsonl"
    path.write_text(json.dumps(env) + "\n" + json.dumps(result_line(run_id="r1")) + "\n")
    df = build_table(load_results([path])[1])
    assert set(df.knobs) == {"KOSMOS_MOE_BH=512 KOSMOS_MOE_HALF_TAIL=0"}
    out = tmp_path / "k.md"
    report_main([path], fmt="md", out=out)
    assert "KOSMOS_MOE_BH=512 KOSMOS_MOE_HALF_TAIL=0" in out.read_text()


def test_trace_breakdown_shares_by_hand():
    """Two programs over a 100 ns span: p0 computes 0-40 and 50-100 (a 10 ns gap), p1 communicates 0-30, waits
    30-35 and computes 35-80 (20 ns idle at the end). Shares of 2 x 100 ns."""
    from dev.trace_breakdown import breakdown
    ev = [(0, 2, 0, 0, 40), (0, 2, 1, 50, 100), (1, 1, 0, 0, 30), (1, 3, 2, 30, 35), (1, 2, 2, 35, 80)]
    b = breakdown(ev)
    assert b["span_us"] == pytest.approx(0.1) and b["programs"] == 2
    s = b["share"]
    assert s["compute"] == pytest.approx(135 / 200) and s["comm"] == pytest.approx(30 / 200)
    assert s["wait"] == pytest.approx(5 / 200) and s["gaps"] == pytest.approx(10 / 200)
    assert s["tail"] == pytest.approx(20 / 200) and s["head"] == 0
    assert sum(s.values()) == pytest.approx(1.0)
    assert b["tasks"] == {"compute": 3, "comm": 1, "wait": 1}


def test_versus_fastest_other_by_hand(tmp_path):
    """Per shape: the fastest other ok implementation and kosmos's time against it and fixed-role-best; the
    line counts shapes where kosmos is at most 3% slower. A shape where kosmos failed gets no row."""
    lines = [result_line(m=1024, impl=impl, time_ms=t) for impl, t in
             (("kosmos", 1.0), ("nccl+cublas", 1.2), ("torch-async-tp", 0.95), ("fixed-role-best", 1.1))]
    lines += [result_line(m=2048, impl=impl, time_ms=t) for impl, t in
              (("kosmos", 2.0), ("nccl+cublas", 3.0), ("fixed-role-best", 1.98))]
    lines.append(result_line(m=2048, impl="torch-async-tp", status="failed", reason="x", time_ms=None))
    lines += [result_line(m=4096, status="failed", reason="rel_err", time_ms=None),
              result_line(m=4096, impl="nccl+cublas", time_ms=1.0)]
    df = build_table(load_results([write_lines(tmp_path / "v.jsonl", lines)])[1])
    versus = versus_table(df)
    assert len(versus) == 2
    first, second = versus.iloc[0], versus.iloc[1]
    assert (first.fastest_other, first.vs_fastest_other) == ("torch-async-tp", pytest.approx(0.95))
    assert first.vs_fixed_role_best == pytest.approx(1.1)
    assert (second.fastest_other, second.vs_fastest_other) == ("fixed-role-best", pytest.approx(0.99))
    text = render(df, "md")
    assert "## kosmos against the fastest other implementation" in text
    assert "at 1 of 2 shapes (lowest 0.950: torch-async-tp faster at toy qkv 1024)" in text
    assert "than fixed-role-best at 2 of 2 (lowest 0.990)" in text  # kosmos behind: not a "margin"
    assert "kosmos against the fastest other implementation" in render(df, "html")
    assert "at 1 of 2 shapes" in render(df, "text")


def test_versus_section_absent_without_kosmos_or_baselines(tmp_path):
    only_kosmos = write_lines(tmp_path / "k.jsonl", [result_line()])
    df = build_table(load_results([only_kosmos])[1])
    assert versus_table(df).empty
    assert "fastest other" not in render(df, "md")


def test_geomean_per_model_by_hand(tmp_path):
    """A file of two models gets a per-model geomean table (a bar is often stated for one model)."""
    lines = []
    for model, m, base, ours in (("a", 1024, 2.0, 1.0), ("a", 2048, 1.0, 2.0), ("b", 1024, 3.0, 1.0)):
        lines += [result_line(model=model, m=m, impl="nccl+cublas", time_ms=base),
                  result_line(model=model, m=m, time_ms=ours)]
    df = build_table(load_results([write_lines(tmp_path / "two.jsonl", lines)])[1])
    by_model = geomean_by_model_table(df).set_index(["model", "impl"])
    assert by_model.loc[("a", "kosmos"), "geomean_speedup"] == pytest.approx(1.0)  # 2 and 0.5
    assert by_model.loc[("b", "kosmos"), "geomean_speedup"] == pytest.approx(3.0)
    assert by_model.loc[("a", "kosmos"), "ok"] == 2
    assert "## Geomean per model" in render(df, "md")
    assert "[a 1 of 2, b 1 of 1]" in render(df, "md")  # the versus line, split by model
    assert "Geomean per model" in render(df, "html") and "Geomean per model" in render(df, "text", wide=True)
    assert "[a 1 of 2, b 1 of 1]" in render(df, "text")  # the compact view: the verdict lines, no per-model table


def test_geomean_per_model_absent_for_one_model(table):
    assert geomean_by_model_table(table).empty
    assert "Geomean per model" not in render(table, "md")


def env_line(suite, run_id="r1", bench="tp"):
    return {"type": "env", "run_id": run_id, "bench": bench, "gpu": "G", "gpu_count": 2, "suite": suite}


def versus_lines():
    """kosmos 2% slower than torch-async-tp at m=1024, 5% slower at m=2048; nccl+cublas the baseline."""
    return [result_line(m=m, impl=impl, time_ms=t) for m, ours, other in ((1024, 1.0, 0.98), (2048, 1.0, 0.95))
            for impl, t in (("kosmos", ours), ("nccl+cublas", 1.25), ("torch-async-tp", other))]


def test_targets_read_from_the_results_files_env_suite(tmp_path):
    """The bars are the recorded suite's targets; a key the suite leaves out falls back to the default suite's."""
    suite = {"name": "mine", "bench": "tp", "targets": {"slower_tolerance": 0.06, "geomean_speedup": 1.3}}
    path = write_lines(tmp_path / "mine.jsonl", [env_line(suite), *versus_lines()])
    df = build_table(load_results([path])[1])
    assert df.attrs["targets"][("mine", "tp")] == {**default_suite().targets, **suite["targets"]}
    assert target_of(df, "mine", "tp", "geomean_speedup") == 1.3
    md = render(df, "md")
    assert "kosmos at most 6% slower than the fastest other implementation: at 2 of 2 shapes" in md
    assert "Target geomean_speedup of kosmos over nccl+cublas >= 1.30: 1.250 misses." in md
    assert "Target geomean_speedup of kosmos over nccl+cublas >= 1.30: 1.250 misses." in render(df, "text")
    moe_lines = [json.loads(x) for x in MOE_SAMPLE.read_text().splitlines()]
    moe_lines[0]["suite"] = {"bench": "moe", "targets": {"expert_gemm_share": 0.95}}
    moe_df = build_table(load_results([write_lines(tmp_path / "moe.jsonl", moe_lines)])[1])
    assert "90% of its TFLOP/s (geomean over 2 points, min 90%): misses the >= 95% bar" in render(moe_df, "md")


def test_targets_fall_back_to_the_default_suite(tmp_path, table):
    """Files whose recorded suite has no targets (all files before suites had them) and tables built from
    records without a file are judged against the default suite file of their bench."""
    for key, value in default_suite().targets.items():
        assert target_of(table, "tp-sample", "tp", key) == value
    assert default_targets("moe") == default_moe_suite().targets
    md = render(table, "md")
    tolerance = default_suite().targets["slower_tolerance"]
    assert f"kosmos at most {tolerance:.0%} slower than the fastest other implementation" in md
    bar = default_suite().targets["geomean_speedup"]
    assert f"Target geomean_speedup of kosmos over nccl+cublas >= {bar:.2f}: 1.239 " in md
    no_env = build_table([result_line(m=m, impl=impl, time_ms=t, source="hand") for m, impl, t in
                          ((1024, "kosmos", 1.0), (1024, "nccl+cublas", 2.0))])
    assert no_env.attrs["targets"] == {} and target_of(no_env, "hand", "tp", "slower_tolerance") == tolerance
    two = write_lines(tmp_path / "two.jsonl", [env_line({"bench": "tp"}), *versus_lines()])
    assert "kosmos at most 3% slower than the fastest other implementation: at 1 of 2 shapes" in \
        render(build_table(load_results([two])[1]), "md")


def test_two_sources_with_other_tolerances(tmp_path):
    loose = write_lines(tmp_path / "loose.jsonl",
                        [env_line({"targets": {"slower_tolerance": 0.1}}), *versus_lines()])
    tight = write_lines(tmp_path / "tight.jsonl",
                        [env_line({"targets": {"slower_tolerance": 0.01}}), *versus_lines()])
    md = render(build_table(load_results([loose, tight])[1]), "md")
    assert ("kosmos at most its suite's slower_tolerance slower than the fastest other implementation: "
            "loose (at most 10% slower) at 2 of 2 shapes") in md
    assert "tight (at most 1% slower) at 0 of 2 shapes" in md


def test_malformed_recorded_targets_name_the_file(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", [env_line({"targets": {"slower_tolerance": "3%"}}), result_line()])
    with pytest.raises(ReportError, match="bad.jsonl: the suite of run r1 has malformed targets: "
                                          "'targets.slower_tolerance' must be a number") as error:
        load_results([path])
    assert "\n" not in str(error.value)


# --------------------------------------------------------------------------- op configs (rows' `config`)

AG_16K = {"push_chunks": 1, "copy_block": 16384}
AG_8K = {"push_chunks": 1, "copy_block": 8192}
RS_PULL = {"push_partials": False}


def config_lines(ag_configs=(AG_16K,), world=2):
    """One ag_gemm and one gemm_rs shape: nccl+cublas (no config) and kosmos once per ag_gemm config."""
    lines = [result_line(impl="nccl+cublas", time_ms=1.2, world=world, config=None),
             result_line(op="gemm_rs", layer="attn_out", impl="nccl+cublas", time_ms=1.2, world=world, config=None),
             result_line(op="gemm_rs", layer="attn_out", time_ms=1.0, world=world, config=RS_PULL)]
    lines += [result_line(time_ms=1.0 - 0.1 * index, world=world, config=config)
              for index, config in enumerate(ag_configs)]
    return lines


def md_table(md, title):
    """The rows (lists of cells) of the markdown table under ``## title``, header first."""
    block = md.split(f"## {title}\n\n", 1)[1].split("\n\n", 1)[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in block.splitlines() if "---" not in line]


def test_rows_that_differ_only_by_config_are_two_rows(tmp_path):
    """An A/B of two configs appended to one file: both rows stay, and every human-readable format says which
    config each ran with (all its fields, sorted, as --config takes them)."""
    path = write_lines(tmp_path / "ab.jsonl", config_lines((AG_16K, AG_8K)))
    df = build_table(load_results([path])[1])
    kosmos = df[(df.op == "ag_gemm") & (df.impl == "kosmos")]
    assert list(kosmos.config) == ["copy_block=16384 push_chunks=1", "copy_block=8192 push_chunks=1"]
    assert list(kosmos.speedup) == [pytest.approx(1.2), pytest.approx(1.2 / 0.9)]
    assert df[df.impl == "nccl+cublas"].config.isna().all()
    rows = md_table(render(df, "md"), "Results per shape")
    header = rows[0]
    assert header[header.index("impl") + 1] == "config"
    cells = [(row[header.index("impl")], row[header.index("config")]) for row in rows[1:]]
    assert cells == [("nccl+cublas", ""), ("nccl+cublas", ""), ("kosmos", "push_partials=false"),
                     ("kosmos", "copy_block=16384 push_chunks=1"), ("kosmos", "copy_block=8192 push_chunks=1")]
    assert "<th>config</th>" in render(df, "html") and "copy_block=8192 push_chunks=1" in render(df, "html")
    wide = render(df, "text", wide=True)
    assert "config" in wide and "copy_block=8192 push_chunks=1" in wide
    compact = render(df, "text")  # a column per config, and a legend
    assert "kosmos #1" in compact and "kosmos #2" in compact
    assert "kosmos #1: gemm_rs push_partials=false; ag_gemm copy_block=16384 push_chunks=1" in compact
    assert "kosmos #2: ag_gemm copy_block=8192 push_chunks=1" in compact
    versus = versus_table(df)  # a row per config of kosmos
    assert list(versus[versus.op == "ag_gemm"].vs_fastest_other) == [pytest.approx(1.2), pytest.approx(1.2 / 0.9)]
    versus_rows = md_table(render(df, "md"), "kosmos against the fastest other implementation")
    configs = [row[versus_rows[0].index("config")] for row in versus_rows[1:]]
    assert configs == ["copy_block=16384 push_chunks=1", "copy_block=8192 push_chunks=1", "push_partials=false"]


def test_the_same_row_with_the_same_config_keeps_the_last(tmp_path):
    path = write_lines(tmp_path / "r.jsonl", [result_line(time_ms=2.0, config=AG_16K),
                                              result_line(time_ms=1.5, config=dict(reversed(AG_16K.items())))])
    assert list(build_table(load_results([path])[1]).time_ms) == [1.5]


def test_config_column_hidden_with_one_config_per_op(tmp_path, table):
    """Each op has its own fields and the baselines none: one config per op is no reason for a column."""
    df = build_table(load_results([write_lines(tmp_path / "one.jsonl", config_lines())])[1])
    assert set(df.config.dropna()) == {"copy_block=16384 push_chunks=1", "push_partials=false"}
    for fmt in ("md", "text"):
        assert "config" not in render(df, fmt)
    assert "<th>config</th>" not in render(df, "html")
    assert "config" not in render(table, "md")  # rows without a config (older files)
    other = write_lines(tmp_path / "other.jsonl", config_lines((AG_8K,)))  # files of other configs side by side
    assert "| config |" in render(build_table(load_results([tmp_path / "one.jsonl", other])[1]), "md")


def test_csv_columns_only_grow_at_the_end(tmp_path, table):
    """The csv contract: the columns of earlier versions keep their names, order and values; config, then host_ms
    and the bandwidths come last."""
    before = ("source,bench,op,layer,model,seq,m,n,k,world,dtype,impl,time_ms,tflops,speedup,overlap_efficiency,"
              "rel_err,workspace_bytes,status,reason,p20_ms,p80_ms,t_gemm_ms,t_comm_ms,peak_mem_bytes,params,"
              "run_id,gpu,gpu_count,torch,triton,git_commit,knobs,timestamp").split(",")
    assert next(csv.reader(io.StringIO(render(table, "csv")))) == \
        before + ["config", "host_ms", "comm_algbw_gbps", "comm_busbw_gbps", "wire_bytes", "rel_err_bf16", "direction",
                  "suite_baseline"]
    df = build_table(load_results([write_lines(tmp_path / "ab.jsonl", config_lines((AG_16K, AG_8K)))])[1])
    rows = list(csv.DictReader(io.StringIO(render(df, "csv"))))
    assert [row["config"] for row in rows] == ["", "", "push_partials=false", "copy_block=16384 push_chunks=1",
                                               "copy_block=8192 push_chunks=1"]
    assert [row["time_ms"] for row in rows] == ["1.2000", "1.2000", "1.0000", "1.0000", "0.9000"]


def test_old_files_with_knobs_render_as_before(tmp_path):
    env = {"type": "env", "run_id": "r1", "gpu": "G", "gpu_count": 2, "knobs": {"KOSMOS_MOE_BH": "512"}}
    path = write_lines(tmp_path / "old.jsonl", [env, result_line(), result_line(impl="nccl+cublas")])
    md = render(build_table(load_results([path])[1]), "md")
    assert "| knobs |" in md and "KOSMOS_MOE_BH=512" in md and "config" not in md


def test_malformed_config_names_the_line(tmp_path):
    path = write_lines(tmp_path / "c.jsonl", [result_line(), result_line(m=2048, config="copy_block=8192")])
    with pytest.raises(ReportError, match=r"c\.jsonl:2: a result's config must be an object or null"):
        load_results([path])


# --------------------------------------------------------------------------- geomean targets: world > 1 only


def test_geomean_targets_say_nothing_at_world_1(tmp_path):
    """Rows at world 1 (communication off): no geomean verdict; the versus line stays."""
    md = render(build_table(load_results([write_lines(tmp_path / "w1.jsonl", config_lines(world=1))])[1]), "md")
    assert "Target geomean" not in md
    assert "kosmos at most 3% slower than the fastest other implementation: at 2 of 2 shapes" in md


def test_geomean_targets_over_the_rows_at_world_above_1(tmp_path):
    """A file of world-1 and world-2 rows: the verdict is over the world-2 rows alone, and says so."""
    lines = config_lines(world=2) + [result_line(m=m, world=1, impl=impl, time_ms=t) for m, impl, t in
                                     ((4096, "nccl+cublas", 1.0), (4096, "kosmos", 2.0))]
    md = render(build_table(load_results([write_lines(tmp_path / "mixed.jsonl", lines)])[1]), "md")
    bar = default_targets("tp")["geomean_speedup"]
    assert f"Target geomean_speedup of kosmos over nccl+cublas at world > 1 >= {bar:.2f}: 1.200 meets." in md
    two = write_lines(tmp_path / "w2.jsonl", config_lines(world=2))
    assert f"Target geomean_speedup of kosmos over nccl+cublas >= {bar:.2f}: 1.200 meets." in \
        render(build_table(load_results([two])[1]), "md")
    w1 = write_lines(tmp_path / "w1.jsonl", config_lines(world=1))
    both = render(build_table(load_results([two, w1])[1]), "md")
    assert f"Target geomean_speedup of kosmos: w2 over nccl+cublas >= {bar:.2f}: 1.200 meets." in both


# --------------------------------------------------------------------------- import cost


def test_report_reads_the_default_targets_without_torch():
    """`kosmos report` stays fast: the default suites' targets are read from their YAML, not through
    kosmos_bench.suites (which imports torch through the bench modules)."""
    code = ("import sys\n"
            "from kosmos_bench.report import build_table, load_results, render\n"
            f"render(build_table(load_results([{str(TP_SAMPLE)!r}])[1]), 'md')\n"
            "leaked = sorted(m for m in ('torch', 'kosmos', 'kosmos_bench.suites') if m in sys.modules)\n"
            "assert not leaked, leaked\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parent.parent)


# --------------------------------------------------------------------------- the compact terminal view


# the titles of the compact view's summary tables after the per-shape ones (kosmos vs cuBLAS at world 1, host time)
SUMMARY_TITLES = ("kosmos against cuBLAS alone", "Host enqueue time", "Host time per call inside", "mxfp8 / bf16")


def compact_tables(text):
    """The per-shape tables of a compact view: per table, (header lines, body lines), the body up to the next blank
    line after the geomean lines (the summary tables after them are not per-shape tables)."""
    lines = text.splitlines()
    tables = []
    for index, line in enumerate(lines):
        if line.strip() and set(line.strip()) == {"─"}:
            start = index
            while start > 0 and "time in ms" not in lines[start - 1]:
                start -= 1
            if any(header.startswith(SUMMARY_TITLES) for header in lines[start:index]):
                continue
            body = []
            for body_line in lines[index + 1:]:
                if body_line.startswith(("[", "Workspace", "unavailable at every shape", *SUMMARY_TITLES)) or \
                        "time in ms" in body_line:
                    break
                body.append(body_line)
            tables.append((lines[start:index], body))
    return tables


def header_names(header_lines):
    """The implementations' column names of a compact table: the header is right-justified over its column, a name
    broken over lines ends at the same place on each."""
    names = {}
    for line in header_lines:
        for match in re.finditer(r"\S+", line):
            names[match.end()] = names.get(match.end(), "") + match.group()
    return set(names.values())


@pytest.mark.parametrize("width", [100, 80])
@pytest.mark.parametrize("sample, impls, shapes", [
    (TP_SAMPLE, {"nccl+cublas", "kosmos", "torch-async-tp", "fixed-role", "fixed-role-best"}, [4]),
    (MOE_SAMPLE, {"nccl-a2a", "kosmos", "fixed-role", "fixed-role-best"}, [2, 2]),
])
def test_compact_view_cuts_no_cell(sample, impls, shapes, width):
    """At 100 and 80 columns: no cell ends in an ellipsis, every time and speedup is there whole, fixed-role and
    fixed-role-best are two columns; the reason of an unavailable cell is a note, wrapped, not cut; an
    implementation unavailable at every shape (deepep in the MoE sample) has no column but a line naming it."""
    df = build_table(load_results([sample])[1])
    text = terminal_text(df, width)
    assert max(map(len, text.splitlines())) <= width
    tables = compact_tables(text)
    assert len(tables) == len(shapes)
    table_lines = [line for header, body in tables for line in header + body]
    assert not any("…" in line for line in table_lines)
    names = set().union(*(header_names(header) for header, _ in tables))
    assert impls <= names
    words = " ".join(table_lines).split()
    for row in df[df.status == "ok"].to_dict("records"):
        time_ms = row["time_ms"]
        assert (f"{time_ms:.3f}" if time_ms < 10 else f"{time_ms:.2f}") in words, row["impl"]
        if row["impl"] not in ("nccl+cublas", "nccl-a2a", "grouped-mm"):
            assert f"{row['speedup']:.3f}x" in words, row["impl"]
    notes = [line for line in text.splitlines() if re.match(r"\[\d+\] ", line)]
    unavailable = df[df.status == "unavailable"]
    reasons = set(unavailable.reason)
    assert len([line for line in notes if " unavailable" in line]) == len(reasons)  # one note per reason
    assert "…" not in text
    flat = " ".join(text.split())
    for reason in reasons:
        assert reason in flat  # whole, wrapped over lines
    left_out = {impl for impl, rows in df.groupby("impl") if (rows.status == "unavailable").all()}
    assert not left_out & names
    for impl in left_out:
        assert re.search(rf"unavailable at every shape, no column: .*{impl} \[\d+\]", text)
    wide = terminal_text(df, width, wide=True)
    for reason in reasons:
        assert reason in wide  # the full reason
    if width == 100:  # a line per shape, its cells on that line
        for (_, body), count in zip(tables, shapes):
            assert len(shape_lines(body)) == count


def shape_lines(body):
    return [line for line in body if line.strip() and not line.startswith("geomean")]


def test_compact_view_of_the_committed_runs_fits_100_columns():
    """The committed H200 runs (two models, five implementations): a line per shape at 100 columns."""
    root = Path(__file__).parent.parent / "results" / "h200x2"
    for name, shapes in (("tp-bf16.jsonl", 24), ("moe-bf16.jsonl", 24)):
        df = build_table(load_results([root / name])[1])
        text = terminal_text(df, 100)
        tables = compact_tables(text)
        assert sum(len(shape_lines(table_body)) for _, table_body in tables) == shapes, name
        assert not any("…" in line for header, table_body in tables for line in header + table_body)


def test_compact_view_layout_by_hand():
    """The TP fixture at 100 columns: the environment, the ratio convention, the geomean headline and the verdicts
    first; then the table, its title saying what every line shares, a line per shape with the baseline's time and
    each other implementation's time and speedup, the geomeans under it."""
    df = build_table(load_results([TP_SAMPLE])[1])
    text = terminal_text(df, 100)
    lines = text.splitlines()
    assert lines[0].startswith("tp-sample: NVIDIA H200 x2 | torch 2.6.0 | triton 3.2.0 | commit 0123abc")
    assert lines[1].startswith("Every ratio is a speedup")
    assert " ".join(" ".join(lines[2:4]).split()).startswith(  # wrapped over two lines
        "Geomean speedup over nccl+cublas, TP ops | llama3-70b | world 2 | bf16 (4 shapes): kosmos 1.239x, "
        "torch-async-tp 1.122x (3 of 4 shapes)")
    title = lines.index("TP ops: time in ms and speedup over nccl+cublas | llama3-70b | world 2 | bf16")
    assert lines.index("Target geomean_speedup of kosmos over nccl+cublas >= 1.15: 1.239 meets.") < title
    first = next(line for line in lines if line.startswith("ag_gemm  qkv       8192"))
    assert first.split()[3:] == ["1.210", "1.052", "1.150x", "1.118", "1.082x", "1.097", "1.103x", "1.071", "1.130x"]
    unavailable = next(line for line in lines if line.startswith("gemm_rs  attn_out  4096"))
    assert "n/a [1]" in unavailable and "failed [2]" in unavailable
    speedups = next(line for line in lines if line.startswith("geomean  speedup"))
    assert speedups.split()[2:] == ["1.239x", "1.122x", "1.159x", "1.211x"]  # the baseline's 1 left out
    assert lines.index(speedups) > title
    assert "(> 1 is faster)" not in text and text.count("> 1: faster") == 1  # the convention, said once
    assert lines[-1].startswith("Every column, implementation and section: kosmos report FILE --wide")


def test_committed_tp_report_has_the_geomean_in_its_first_8_lines():
    """`kosmos report results/h200x2/tp-bf16.jsonl` at 100 columns, as a user runs it: the geomean speedup of every
    implementation and the verdicts on the suite's targets come before the per-shape table."""
    path = Path(__file__).parent.parent / "results" / "h200x2" / "tp-bf16.jsonl"
    import os
    run = subprocess.run([sys.executable, "-m", "kosmos_bench.cli", "report", str(path)], capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "100"}, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert max(map(len, lines)) <= 100
    head = " ".join(" ".join(lines[:8]).split())
    assert "Geomean speedup over nccl+cublas, TP ops | world 2 | bf16 (24 shapes): kosmos 1.060x" in head, head
    assert "fixed-role-best 1.036x" in head and "Target geomean_speedup" in head
    table = next(index for index, line in enumerate(lines) if "time in ms" in line)
    assert table > 8


def test_compact_view_leaves_out_empty_sections_and_unavailable_columns():
    """A committed world-1 run with bf16 and mxfp8 rows: the bytes on the wire (all 0 at W = 1) and the columns of
    implementations unavailable at every shape are left out of the compact view, so its lines fit 100 columns;
    --wide keeps both."""
    path = Path(__file__).parent.parent / "results" / "h200x1" / "tp-mxfp8-w1-shard2.jsonl"
    df = build_table(load_results([path])[1])
    assert (df[df.impl == "torch-async-tp"].status == "unavailable").all() and (df.wire_bytes.fillna(0) == 0).all()
    text = terminal_text(df, 100)
    assert max(map(len, text.splitlines())) <= 100
    assert "Bytes on the wire" not in text
    headers = set().union(*(header_names(header) for header, _ in compact_tables(text)))
    assert {"kosmos", "nccl+cublas", "triton-dot-scaled", "fp8-rowwise"} <= headers
    assert not {"torch-async-tp", "fixed-role", "fixed-role-best"} & headers
    assert "unavailable at every shape, no column: torch-async-tp [1], fixed-role [2], fixed-role-best [3]" in text
    wide = terminal_text(df, 100, wide=True)
    assert "Bytes on the wire" in wide and "torch-async-tp" in wide


def test_kosmos_alone_at_world_1_is_compared_with_cublas_alone(tmp_path):
    """TP rows of kosmos alone at world 1 (a grid run): the table's baseline is cuBLAS alone (the rows'
    t_gemm_ms), each kosmos cell gives t_gemm_ms / time_ms, and the headline gives its geomean."""
    rows = [result_line(layer="custom", model="custom", seq=m, m=m, world=1, impl="kosmos", time_ms=t,
                        t_gemm_ms=g, t_comm_ms=0.0) for m, t, g in ((256, 2.0, 1.0), (1024, 1.0, 1.1))]
    df = build_table(load_results([write_lines(tmp_path / "grid.jsonl", [env_line({"name": "g"}), *rows])])[1])
    text = terminal_text(df, 100)
    assert "Geomean speedup over cuBLAS alone, TP ops | custom | world 1 | bf16 (2 shapes): kosmos " \
        f"{math.sqrt(0.5 * 1.1):.3f}x" in text
    assert "TP ops: time in ms and speedup over cuBLAS alone | op ag_gemm | custom | world 1 | bf16" in text
    line = next(line for line in text.splitlines() if line.startswith("256x512x256"))
    assert line.split()[1:] == ["1.000", "2.000", "0.500x"]
    assert "geomean  overlap" not in text  # no communication at world 1


def test_compact_view_names_the_source_and_custom_shapes(tmp_path):
    """Two files side by side: a source column, a shape's lines one after the other; a custom shape shows m x n x k."""
    other = tmp_path / "tp-other.jsonl"
    shutil.copy(TP_SAMPLE, other)
    text = terminal_text(build_table(load_results([TP_SAMPLE, other])[1]), 100)
    lines = [line for line in text.splitlines() if line.startswith(("tp-sample ", "tp-other "))]
    assert [line.split()[0] for line in lines[:2]] == ["tp-sample", "tp-other"]
    custom = [result_line(model="custom", layer="custom", m=m, impl=impl, time_ms=t)
              for m, impl, t in ((8192, "nccl+cublas", 2.0), (8192, "kosmos", 1.0), (4096, "kosmos", 0.5))]
    text = terminal_text(build_table(load_results([write_lines(tmp_path / "c.jsonl", custom)])[1]), 100)
    assert "m x n x k" in text and "8192x512x256" in text and "4096x512x256" in text


# --------------------------------------------------------------------------- headline first


def test_headline_comes_first_in_every_format(table):
    """Every format: the geomeans and the verdict lines before the per-shape tables (the compact view: a geomean
    line per table, the tables' footers repeat them)."""
    md = render(table, "md")
    assert md.index("## Geomean over ok rows") < md.index("Target geomean_speedup") < \
        md.index("kosmos at most 3% slower") < md.index("## Results per shape") < \
        md.index("## kosmos against the fastest other implementation")
    html_text = render(table, "html")
    assert html_text.index("<h2>Geomean over ok rows</h2>") < html_text.index("Target geomean_speedup") < \
        html_text.index("<h2>Results per shape</h2>")
    wide = render(table, "text", wide=True)
    assert wide.index("Geomean over ok rows") < wide.index("Target geomean_speedup") < wide.index("Results per shape")
    compact = render(table, "text")
    assert compact.index("Geomean speedup over") < compact.index("Target geomean_speedup") < \
        compact.index("time in ms") < compact.index("geomean  speedup")
    assert max(map(len, compact.splitlines())) <= 100


# --------------------------------------------------------------------------- failures and messages


def test_truncated_last_line_is_skipped_with_a_warning(tmp_path):
    """A run killed while writing its last line: the rows before it are reported, one warning names file and line."""
    lines = TP_SAMPLE.read_text().splitlines()
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join(lines[:-1] + [lines[-1][:57]]))  # no newline at the end either
    warnings = []
    _, results = load_results([path], warn=warnings.append)
    assert len(results) == 19
    assert len(warnings) == 1 and warnings[0].startswith(f"{path}:21: the last line is not valid JSON")
    assert "\n" not in warnings[0]
    path.write_text("\n".join(lines[:-1] + [lines[-1][:57], "", ""]))  # blank lines after it: still the last
    assert len(load_results([path], warn=warnings.append)[1]) == 19


def test_truncated_last_line_warns_on_stderr(tmp_path, capsys):
    lines = TP_SAMPLE.read_text().splitlines()
    path = tmp_path / "cut.jsonl"
    path.write_text("\n".join(lines[:-1] + [lines[-1][:10]]))
    assert len(load_results([path])[1]) == 19
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"warning: {path}:21: the last line is not valid JSON")


def test_malformed_line_in_the_middle_is_still_an_error(tmp_path):
    lines = TP_SAMPLE.read_text().splitlines()
    lines[5] = lines[5][:40]
    path = tmp_path / "mid.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReportError, match=r"mid\.jsonl:6: invalid JSON"):
        load_results([path], warn=lambda message: pytest.fail(message))


def test_report_main_output_errors_are_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    quiet = Console(file=io.StringIO(), color_system=None)
    for kwargs in ({"fmt": "md", "out": tmp_path / "file" / "x.md"},
                   {"fmt": "md", "out": tmp_path / "file" / "sub" / "x.md"},
                   {"fmt": "md", "out": tmp_path},  # a folder
                   {"chart": tmp_path / "file" / "c.png"}):
        with pytest.raises(ReportError) as error:
            report_main([TP_SAMPLE], console=quiet, status=quiet, **kwargs)
        message = str(error.value)
        target = kwargs.get("out", kwargs.get("chart"))
        assert message.startswith(f"cannot write {target}") and "\n" not in message, message
    out = tmp_path / "new" / "sub" / "x.md"
    assert report_main([TP_SAMPLE], fmt="md", out=out, console=quiet, status=quiet) == 0
    assert out.read_text().startswith("# KOSMOS benchmark report")


# --------------------------------------------------------------------------- host_ms and bandwidths in the table


def test_host_ms_is_in_the_csv(moe_table, table):
    rows = list(csv.DictReader(io.StringIO(render(moe_table, "csv"))))
    kosmos = next(r for r in rows if r["routing"] == "uniform" and r["impl"] == "kosmos")
    assert kosmos["host_ms"] == "0.2000"
    assert {r["host_ms"] for r in csv.DictReader(io.StringIO(render(table, "csv")))} == {""}  # not in the fixture


def test_bandwidths_by_hand(table, moe_table):
    """nccl-tests: algbw = S / t, busbw = algbw (W-1)/W; S = gathered output (ag_gemm), input per rank (gemm_rs),
    what a rank sends over both all-to-alls (moe_fwd); bf16 2 bytes; GB/s = 1e9 B/s."""
    ag = row_of(table, "ag_gemm", 8192, "kosmos")  # m 8192, k 8192, t_comm 0.192 ms
    assert ag.comm_algbw_gbps == pytest.approx(8192 * 8192 * 2 / 0.192e-3 / 1e9)
    assert ag.comm_busbw_gbps == pytest.approx(ag.comm_algbw_gbps / 2)
    rs = row_of(table, "gemm_rs", 8192, "nccl+cublas")
    assert rs.comm_algbw_gbps == pytest.approx(rs.m * rs.n * 2 / (rs.t_comm_ms * 1e-3) / 1e9)
    assert (rs.m, rs.n) == (8192, 8192)
    moe = moe_row(moe_table, "uniform", "kosmos")  # tokens 4096, top_k 8, hidden 7168, t_comm 3.1 ms
    assert moe.comm_algbw_gbps == pytest.approx(2 * 4096 * 8 * 7168 * 2 / 3.1e-3 / 1e9)
    assert moe.comm_busbw_gbps == pytest.approx(moe.comm_algbw_gbps / 2)
    assert math.isnan(moe_row(moe_table, "uniform", "kosmos-expert-gemms").comm_busbw_gbps)  # no t_comm_ms


def test_bandwidth_edge_cases():
    row = {"op": "ag_gemm", "m": 4096, "n": 1024, "k": 2048, "world": 4, "dtype": "mxfp8", "t_comm_ms": 0.5}
    algbw, busbw = comm_bandwidth(row)
    assert algbw == pytest.approx(4096 * 2048 * (1 + 1 / 32) / 0.5e-3 / 1e9)
    assert busbw == pytest.approx(algbw * 3 / 4)
    for change in ({"t_comm_ms": 0.0}, {"t_comm_ms": None}, {"dtype": "int4"}, {"op": "other"}):
        assert all(math.isnan(value) for value in comm_bandwidth({**row, **change})), change


def test_bandwidths_in_every_format(table, moe_table):
    header = next(csv.reader(io.StringIO(render(table, "csv"))))
    assert header[-6:-4] == ["comm_algbw_gbps", "comm_busbw_gbps"]
    kosmos = next(r for r in csv.DictReader(io.StringIO(render(table, "csv")))
                  if r["op"] == "ag_gemm" and r["m"] == "8192" and r["impl"] == "kosmos")
    assert (kosmos["comm_algbw_gbps"], kosmos["comm_busbw_gbps"]) == ("699.1", "349.5")
    md = render(table, "md")
    results = md_table(md, "Results per shape")
    assert "comm_algbw_gbps" in results[0] and "comm_busbw_gbps" in results[0]
    definition = "comm_algbw_gbps, comm_busbw_gbps: nccl-tests' algorithm and bus bandwidth of t_comm_ms"
    assert md.index("## Results per shape") < md.index(definition) < md.index("## kosmos against")
    assert "ag_gemm the all-gather's output, m*k elements" in md and "moe_fwd" not in md.split(definition)[1][:400]
    assert "2*tokens*top_k*n" in render(moe_table, "md")
    assert "comm_busbw_gbps" in render(table, "html") and html.escape(definition) in render(table, "html")
    assert definition in render(table, "text", wide=True)


def test_no_bandwidth_columns_without_communication(tmp_path):
    """World 1 (t_comm_ms 0): the columns stay in the csv, empty, and leave the human-readable tables."""
    df = build_table(load_results([write_lines(tmp_path / "w1.jsonl", config_lines(world=1))])[1])
    assert "comm_busbw_gbps" not in render(df, "md") and "nccl-tests" not in render(df, "md")
    assert {r["comm_busbw_gbps"] for r in csv.DictReader(io.StringIO(render(df, "csv")))} == {""}


# --------------------------------------------------------------------------- `kosmos report` on the command line


def run_report(*args):
    from typer.testing import CliRunner

    from kosmos_bench.cli import app
    return CliRunner().invoke(app, ["report", *map(str, args)])


def one_line_error(result, *needles):
    assert result.exit_code != 0
    assert result.exception is None or isinstance(result.exception, SystemExit)  # no traceback
    assert "error:" not in result.stdout
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_cli_report_wide_and_compact():
    compact, wide = run_report(TP_SAMPLE), run_report(TP_SAMPLE, "--wide")
    assert compact.exit_code == 0 and wide.exit_code == 0
    assert "fixed-role-best" in compact.stdout and "Results per shape" not in compact.stdout
    assert "unavailable: torch.distributed._symmetric_memory not available" in wide.stdout
    assert "comm_busbw_gbps" in wide.stdout


def test_cli_report_out_creates_folders(tmp_path):
    out = tmp_path / "newdir" / "sub" / "x.md"
    result = run_report(TP_SAMPLE, "--format", "md", "--out", out)
    assert result.exit_code == 0, result.output
    assert out.read_text().startswith("# KOSMOS benchmark report")
    assert result.stdout == "" and f"md report written to {out}" in result.stderr


def test_cli_report_unwritable_outputs_are_one_line_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    one_line_error(run_report(TP_SAMPLE, "--format", "md", "--out", blocker / "sub" / "x.md"),
                   str(blocker / "sub" / "x.md"), f"{blocker} is not a folder")
    one_line_error(run_report(TP_SAMPLE, "--format", "md", "--out", "/proc/x"), "/proc/x")
    one_line_error(run_report(TP_SAMPLE, "--chart", blocker / "c.png"), str(blocker / "c.png"))
    one_line_error(run_report("--timeline", TRACE_SAMPLE, "--out", blocker / "t.png"), str(blocker / "t.png"))


def test_cli_report_csv_stays_pure_with_a_chart(tmp_path):
    """`--format csv --chart c.png > out.csv`: stdout is the csv alone, the message goes to stderr."""
    chart = tmp_path / "charts" / "c.png"
    result = run_report(TP_SAMPLE, "--format", "csv", "--chart", chart)
    assert result.exit_code == 0, result.output
    rows = list(csv.reader(io.StringIO(result.stdout)))
    assert len(rows) == 21 and rows[0][0] == "source" and {len(row) for row in rows} == {len(rows[0])}
    assert "chart" not in result.stdout
    assert "speedup chart written to" in result.stderr or "matplotlib missing" in result.stderr


def test_cli_report_truncated_last_line(tmp_path):
    lines = TP_SAMPLE.read_text().splitlines()
    path = tmp_path / "killed.jsonl"
    path.write_text("\n".join(lines[:-1] + [lines[-1][:100]]))
    result = run_report(path, "--format", "csv")
    assert result.exit_code == 0, result.output
    assert len(result.stdout.strip().splitlines()) == 1 + 19
    warning = result.stderr.strip().splitlines()
    assert len(warning) == 1 and warning[0].startswith(f"warning: {path}:21: the last line is not valid JSON")
    lines[3] = lines[3][:50]
    path.write_text("\n".join(lines))
    one_line_error(run_report(path), f"{path}:4: invalid JSON")


def test_default_targets_come_from_the_packaged_suites():
    """An installed wheel has no suites/ beside the package: the report reads the packaged copies."""
    from kosmos_bench.package_data import DEFAULT_SUITE_FILES
    from kosmos_bench.report import suite_targets
    assert suite_targets.DEFAULT_SUITE_FILES == DEFAULT_SUITE_FILES
    for bench, path in DEFAULT_SUITE_FILES.items():
        assert path.is_file() and "kosmos_bench" in path.parts
        assert default_targets(bench) == suite_targets.suite_file_targets(path, bench) != {}


# --------------------------------------------------------------------------- bf16 and mxfp8 rows in one file

MX_FIXTURE = Path(__file__).parent / "fixtures" / "tp-mx-sample.jsonl"


def _mx_table():
    return build_table(load_results([MX_FIXTURE])[1])


def test_geomeans_per_dtype_and_impl():
    g = geomean_table(_mx_table())
    assert list(g.columns[:5]) == ["source", "bench", "dtype", "direction", "impl"]
    by = g.set_index(["dtype", "impl"])
    assert by.loc[("bf16", "kosmos"), "geomean_speedup"] == pytest.approx(math.sqrt(1.21 / 1.05 * 1.95 / 1.70))
    assert by.loc[("mxfp8", "kosmos"), "geomean_speedup"] == pytest.approx(math.sqrt(1.40 / 1.10 * 2.20 / 1.80))
    assert by.loc[("mxfp8", "torch-async-tp"), "unavailable"] == 2 and ("bf16", "fp8-rowwise") not in by.index


def test_dtype_and_wire_tables():
    from kosmos_bench.report.tables import dtype_table, wire_table
    ratios = dtype_table(_mx_table()).set_index("op")
    assert ratios.loc["ag_gemm", "mxfp8_vs_bf16"] == pytest.approx(1.05 / 1.10)  # speedups: bf16 time / mxfp8's
    assert ratios.loc["ag_gemm", "mxfp8_vs_cublas_bf16"] == pytest.approx(0.985 / 1.10)
    assert ratios.loc["gemm_rs", "kosmos_bf16_ms"] == 1.70 and ratios.loc["gemm_rs", "cublas_bf16_ms"] == 1.62
    wires = wire_table(_mx_table())
    ag = wires[wires["op"] == "ag_gemm"].set_index("impls")
    assert ag.loc["kosmos, nccl+cublas, triton-dot-scaled", "wire_vs_bf16"] == pytest.approx(33 / 64)
    assert ag.loc["fp8-rowwise", "wire_mib"] == pytest.approx((8192 * 8192 + 8192 * 4) / 2 / 2**20)
    assert "torch-async-tp" not in " ".join(wires[wires["dtype"] == "mxfp8"]["impls"])  # unavailable: sends nothing
    rs = wires[(wires["op"] == "gemm_rs") & (wires["dtype"] == "mxfp8")]
    assert len(rs) == 1 and rs["wire_vs_bf16"].iloc[0] == 1.0  # the partials are bf16 at every dtype
    single = build_table(load_results([FIXTURES / "tp-sample.jsonl"])[1])  # bf16 only: no such sections
    assert dtype_table(single).empty and wire_table(single).empty


def test_mx_report_sections_in_every_format():
    table = _mx_table()
    text = render(table, "text")
    assert all(len(line) <= 100 for line in text.splitlines())
    assert "| bf16" in text and "| mxfp8" in text  # a table per dtype, named in its title
    assert "mxfp8 / bf16" in text and "Bytes on the wire per rank" in text and "(0.516x)" in text
    assert "bf16 1.150" in text and "mxfp8 1.247" in text  # the targets judged per dtype
    md = render(table, "md")
    assert "## mxfp8 / bf16" in md and "## Bytes on the wire per implementation" in md
    assert "| rel_err_bf16 | wire_bytes |" in md
    assert "mxfp8 / bf16" in render(table, "html")
    assert "mxfp8 / bf16" not in render(_mx_table_bf16_only(), "md")
    header = next(csv.reader(io.StringIO(render(table, "csv"))))
    assert header[-4:] == ["wire_bytes", "rel_err_bf16", "direction", "suite_baseline"]


def _mx_table_bf16_only():
    return build_table(load_results([FIXTURES / "tp-sample.jsonl"])[1])


def test_gemm_rs_bandwidth_counts_bf16_partials_at_mxfp8():
    row = {"op": "gemm_rs", "m": 4096, "n": 1024, "k": 2048, "world": 2, "dtype": "mxfp8", "t_comm_ms": 0.5}
    assert comm_bandwidth(row)[0] == pytest.approx(4096 * 1024 * 2 / 0.5e-3 / 1e9)


MOE_MX_FIXTURE = Path(__file__).parent / "fixtures" / "moe-mx-sample.jsonl"


def test_moe_bf16_and_mxfp8_rows_render():
    """A MoE file with bf16 and mxfp8 rows: a table per dtype, the "mxfp8 / bf16" ratios per (tokens, routing)
    point, the bytes on the wire (mxfp8 dispatch payload + scales, bf16 combine), every format."""
    from kosmos_bench.report.tables import dtype_table, wire_table
    df = build_table(load_results([MOE_MX_FIXTURE])[1])
    ratios = dtype_table(df).set_index("routing")
    assert list(ratios.index) == ["uniform", "zipf:1.2"]  # two points at one token count: not merged
    assert ratios.loc["uniform", "mxfp8_vs_bf16"] == pytest.approx(9.0 / 8.1)
    assert ratios.loc["zipf:1.2", "mxfp8_vs_bf16"] == pytest.approx(12.0 / 10.8)
    assert ratios.loc["zipf:1.2", "mxfp8_vs_cublas_bf16"] == pytest.approx(6.1 / 10.8)
    wires = wire_table(df)
    mx = wires[(wires["dtype"] == "mxfp8") & (wires["routing"] == "uniform")]
    assert len(mx) == 1 and mx["wire_vs_bf16"].iloc[0] == pytest.approx((1 + 1 / 32 + 2) / 4)
    assert "deepep" not in " ".join(wires["impls"])
    g = geomean_table(df).set_index(["dtype", "impl"])
    assert g.loc[("mxfp8", "kosmos"), "geomean_speedup"] == pytest.approx(math.sqrt(10.5 / 8.1 * 13.2 / 10.8))
    assert ("mxfp8", "grouped-mm") not in g.index
    r = run_report(MOE_MX_FIXTURE)
    assert r.exit_code == 0, r.output
    text = r.output
    assert "mxfp8 / bf16" in text and "no MXFP8 path in the deepep baseline yet" in text
    assert "zipf:1.2" in text.split("mxfp8 / bf16")[1]
    for fmt in ("md", "csv", "html"):
        r = run_report(MOE_MX_FIXTURE, "--format", fmt)
        assert r.exit_code == 0, (fmt, r.output)
    assert "mxfp8 / bf16" in run_report(MOE_MX_FIXTURE, "--format", "md").output


MOE_DIRECTION_SAMPLE = Path(__file__).parent / "fixtures" / "moe-direction-sample.jsonl"


def test_report_directions_fwd_and_bwd():
    """MoE rows of several directions (the fwd rows without the field, as in older files): speedups and geomeans
    per (dtype, direction, impl), a compact table per direction."""
    df = build_table(load_results([MOE_DIRECTION_SAMPLE])[1])
    assert set(df["direction"]) == {"fwd", "bwd", "fwd+bwd"}  # the missing field reads as fwd
    speed = {(r["direction"], r["impl"]): r["speedup"] for r in df.to_dict("records")}
    assert speed[("fwd", "kosmos")] == pytest.approx(2.0) and speed[("bwd", "kosmos")] == pytest.approx(1.5)
    assert speed[("fwd+bwd", "kosmos")] == pytest.approx(2.0)
    g = geomean_table(df)
    by = {(r["direction"], r["impl"]): r for r in g.to_dict("records")}
    assert by[("bwd", "kosmos")]["geomean_speedup"] == pytest.approx(1.5)
    assert by[("bwd", "deepep")]["unavailable"] == 1 and ("fwd", "deepep") not in by
    text = render(df, "text")
    assert all(len(line) <= 100 for line in text.splitlines())
    flat = " ".join(text.split())  # a long title wraps
    assert "moe_fwd" not in flat.split("Geomean speedup")[1].split("Host time")[0]  # titles name the direction
    titles = ("MoE layer forward: time in ms", "MoE layer backward: time in ms",
              "MoE layer forward+backward: time in ms")
    assert all(flat.count(title) == 1 for title in titles)
    assert flat.index(titles[0]) < flat.index(titles[1]) < flat.index(titles[2])
    headline = ("Geomean speedup over nccl-a2a, MoE layer forward", "Geomean speedup over nccl-a2a, MoE layer "
                "backward", "Geomean speedup over nccl-a2a, MoE layer forward+backward")
    assert all(flat.index(line) < flat.index(titles[0]) for line in headline)  # the headline first
    assert "no backward in the deepep baseline yet" in text
    md = render(df, "md")
    assert "| direction |" in md
    versus = versus_table(df)
    assert sorted(versus["direction"]) == ["bwd", "fwd", "fwd+bwd"]


def test_report_forward_only_files_do_not_say_direction():
    text = render(build_table(load_results([MOE_SAMPLE])[1]), "text")
    assert "direction" not in text


# --------------------------------------------------------------------------- kosmos vs cuBLAS alone at world 1, host time

GRID_TARGETS = {"vs_cublas_geomean": 0.97, "vs_cublas_floor": 0.90}


def cublas_lines(targets=GRID_TARGETS):
    """World-1 rows of a suite with the cuBLAS bars: kosmos ag_gemm at 0.5x, 0.95x and 1.02x of cuBLAS alone
    (t_gemm_ms / time_ms), gemm_rs at 1.0x; nccl+cublas rows, a world-2 kosmos row and a failed one (not counted)."""
    suite = {"name": "grid", "bench": "tp", **({"targets": targets} if targets else {})}
    rows = []
    for op, m, time_ms, t_gemm, host in (("ag_gemm", 256, 2.0, 1.0, 0.150), ("ag_gemm", 1024, 1.0, 0.95, 0.100),
                                         ("ag_gemm", 2048, 1.0, 1.02, 0.125), ("gemm_rs", 4096, 0.5, 0.5, 0.080)):
        shape = dict(op=op, layer="custom", model="custom", seq=m, m=m, world=1, t_gemm_ms=t_gemm, t_comm_ms=0.0)
        rows += [result_line(**shape, impl="kosmos", time_ms=time_ms, host_ms=host),
                 result_line(**shape, impl="nccl+cublas", time_ms=t_gemm * 1.01, host_ms=0.030)]
    rows.append(result_line(op="ag_gemm", m=8192, seq=8192, world=2, impl="kosmos", time_ms=1.0, t_gemm_ms=2.0,
                            host_ms=0.2))
    rows.append(result_line(op="gemm_rs", m=512, seq=512, world=1, impl="kosmos", status="failed", time_ms=None,
                            t_gemm_ms=0.1, reason="boom"))
    return [env_line(suite, bench="tp"), *rows]


def test_cublas_tables_by_hand(tmp_path):
    from kosmos_bench.report import cublas_summary_table, cublas_table
    df = build_table(load_results([write_lines(tmp_path / "grid-w1.jsonl", cublas_lines())])[1])
    per_shape = cublas_table(df)
    assert list(zip(per_shape.op, per_shape.m)) == [("ag_gemm", 256), ("ag_gemm", 1024), ("ag_gemm", 2048),
                                                    ("gemm_rs", 4096)]  # kosmos, world 1, ok
    assert list(per_shape.vs_cublas) == pytest.approx([0.5, 0.95, 1.02, 1.0])
    assert list(per_shape.loop_host_us) == pytest.approx([150.0, 100.0, 125.0, 80.0])
    summary = cublas_summary_table(df).set_index("op")
    assert summary.loc["ag_gemm", "geomean_vs_cublas"] == pytest.approx((0.5 * 0.95 * 1.02) ** (1 / 3))
    assert summary.loc["ag_gemm", "min_vs_cublas"] == 0.5 and summary.loc["ag_gemm", "worst_shape"] == "256x512x256"
    assert summary.loc["ag_gemm", "below_floor"] == 1 and summary.loc["gemm_rs", "below_floor"] == 0
    assert list(summary.shapes) == [3, 1]
    no_bars = build_table(load_results([write_lines(tmp_path / "plain.jsonl", cublas_lines(targets=None))])[1])
    assert cublas_summary_table(no_bars)["below_floor"].isna().all()  # the default suite sets no floor
    world_2 = build_table(load_results([write_lines(tmp_path / "w2.jsonl", versus_lines())])[1])
    assert not world_2.empty and cublas_table(world_2).empty  # world 2: no cuBLAS-alone section


def test_cublas_line_judges_the_suites_bars(tmp_path):
    from kosmos_bench.report import cublas_line
    df = build_table(load_results([write_lines(tmp_path / "grid-w1.jsonl", cublas_lines())])[1])
    line = cublas_line(df)
    assert line.startswith("kosmos against cuBLAS alone at world 1 (t_gemm_ms / time_ms")
    assert "ag_gemm geomean 0.785 misses the >= 0.97 bar, min 0.500 at 256x512x256, 1 of 3 shapes under 0.90" in line
    assert "gemm_rs geomean 1.000 meets the >= 0.97 bar, min 1.000 at 4096x512x256, 0 of 1 shapes under 0.90" in line
    plain = build_table(load_results([write_lines(tmp_path / "plain.jsonl", cublas_lines(targets=None))])[1])
    assert "ag_gemm geomean 0.785, min 0.500 at 256x512x256 (3 shapes)" in cublas_line(plain)
    assert cublas_line(build_table(load_results([TP_SAMPLE])[1])) is None  # world 2 only


def test_host_table_and_line_by_hand(tmp_path):
    from kosmos_bench.report import host_line, host_table
    df = build_table(load_results([write_lines(tmp_path / "grid-w1.jsonl", cublas_lines())])[1])
    hosts = host_table(df)
    assert list(zip(hosts.impl, hosts.op, hosts.rows)) == [("kosmos", "ag_gemm", 4), ("kosmos", "gemm_rs", 1),
                                                           ("nccl+cublas", "ag_gemm", 3),
                                                           ("nccl+cublas", "gemm_rs", 1)]
    kosmos_ag = hosts.iloc[0]  # 150, 100, 125 at world 1 and 200 at world 2; the failed row has none
    assert (kosmos_ag.host_us_median, kosmos_ag.host_us_min, kosmos_ag.host_us_max) == pytest.approx((137.5, 100, 200))
    line = host_line(df)
    assert line.startswith("Host time per call inside the timing loop, µs (per row the median over its timed calls of "
                           "the CPU time inside the call, each after a barrier, so the host is cold")
    assert "the enqueue cost per eager call: bench tp --host-calls" in line  # a TP file without host rows
    assert line.endswith(": kosmos 125 (max 200), nccl+cublas 30 (max 30).")
    moe = host_line(build_table(load_results([MOE_DIRECTION_SAMPLE])[1]))
    assert moe is None or "bench tp" not in moe  # the MoE bench has no enqueue measurement to point to
    assert host_table(build_table(load_results([TP_SAMPLE])[1])).empty  # the fixture has no host_ms
    assert host_line(build_table(load_results([TP_SAMPLE])[1])) is None


def test_cublas_and_host_sections_in_every_format(tmp_path):
    df = build_table(load_results([write_lines(tmp_path / "grid-w1.jsonl", cublas_lines())])[1])
    md = render(df, "md")
    assert "## kosmos against cuBLAS alone at world 1 (vs_cublas = t_gemm_ms / time_ms" in md
    per_op = md_table(md, "kosmos against cuBLAS alone at world 1 (vs_cublas = t_gemm_ms / time_ms, the TFLOP/s "
                          "ratio): per op")
    assert per_op[0] == ["op", "dtype", "shapes", "geomean_vs_cublas", "min_vs_cublas", "worst_shape",
                         "below_floor", "floor"]
    assert per_op[1] == ["ag_gemm", "bf16", "3", "0.785", "0.500", "256x512x256", "1", "0.90"]
    assert "## Host time per call inside the timing loop, µs (host_ms of the ok rows: median over each row's timed " \
        "calls, each after a barrier, so the host is cold; the enqueue cost per eager call: bench tp --host-calls)" \
        in md and "| kosmos | 4 | 137.5 | 100.0 | 200.0 |" in md
    assert "Host enqueue time per eager call, µs (median" not in md  # no host rows in this file: no such section
    assert "kosmos against cuBLAS alone at world 1" in render(df, "html")
    text = terminal_text(df, 100)
    assert max(map(len, text.splitlines())) <= 100
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("kosmos against cuBLAS alone at world 1, per op"))
    assert lines[at + 3].split() == ["ag_gemm", "3", "0.785x", "0.500x", "256x512x256", "1", "<", "0.90", "misses",
                                     ">=", "0.97"]
    assert lines[at + 4].split()[-3:] == ["meets", ">=", "0.97"]
    assert any(line.split()[:3] == ["kosmos", "ag_gemm", "4"] for line in lines)  # the host table
    assert text.index("kosmos against cuBLAS alone") < text.index("Host time per call inside") < \
        text.index("Workspace")


def test_expert_gemm_line_per_direction(tmp_path):
    """The expert-GEMMs-alone line gives the forward's and the backward's shares apart (bwd rows of
    `bench moe --direction bwd`), each its own geomean; one direction alone: no label."""
    from kosmos_bench.report.lines import expert_gemm_line

    def experts(impl, time_ms, direction):
        return result_line(bench="moe", op="moe_experts", layer="experts", impl=impl, time_ms=time_ms,
                           direction=direction, tokens=4096, routing="uniform", world=1)

    lines = [experts("grouped-mm", 2.0, "fwd"), experts("kosmos-expert-gemms", 1.6, "fwd"),
             experts("grouped-mm", 3.0, "bwd"), experts("kosmos-expert-gemms", 4.0, "bwd")]
    df = build_table(load_results([write_lines(tmp_path / "e.jsonl", lines)])[1])
    text = expert_gemm_line(df)
    assert "fwd: 125% of its TFLOP/s" in text and "bwd: 75% of its TFLOP/s" in text, text
    df = build_table(load_results([write_lines(tmp_path / "f.jsonl", lines[:2])])[1])
    assert "fwd:" not in expert_gemm_line(df) and "125%" in expert_gemm_line(df)


# --------------------------------------------------------------------------- host enqueue time per eager call (host rows)


def host_record(op="ag_gemm", impl="kosmos", host_us=19.3, world=1, status="ok", reason=None, **overrides):
    """A host line of `bench tp --host-calls` (SCHEMA.md, type "host") on the one-tile 128x256x256."""
    line = {"type": "host", "run_id": "r1", "bench": "tp", "op": op, "layer": "custom", "model": "custom", "seq": 128,
            "m": 128, "n": 256, "k": 256, "world": world, "dtype": "bf16", "impl": impl, "status": status,
            "reason": reason, "calls": 200, "warm_s": 0.2, "host_us": host_us,
            "p20_us": None if host_us is None else host_us - 1, "p80_us": None if host_us is None else host_us + 2,
            "warmup_calls": 9000, "rel_err": 1e-3, "params": {},
            "config": {"push_chunks": 1} if impl == "kosmos" else None}
    return {**line, **overrides}


def host_lines():
    """A W=1 run's result rows (in-loop host_ms ~100 µs) and its host rows: kosmos ag_gemm 19 µs (meets the 30 µs
    bar), gemm_rs 45 µs (misses it), nccl+cublas 12 µs and a failed one with its reason."""
    suite = {"name": "tp-default", "bench": "tp", "host_calls": 200, "host_shape": [128, 256, 256]}
    rows = [result_line(world=1, impl=impl, time_ms=t, host_ms=host) for impl, t, host in
            (("kosmos", 0.5, 0.100), ("nccl+cublas", 0.55, 0.096))]
    return [env_line(suite), *rows, host_record("ag_gemm", "kosmos", 19.0), host_record("ag_gemm", "nccl+cublas", 12.0),
            host_record("gemm_rs", "kosmos", 45.0),
            host_record("gemm_rs", "nccl+cublas", None, status="failed", reason="RuntimeError: boom")]


HOST_TITLE = "Host enqueue time per eager call, µs (median of 200 back-to-back calls at 128x256x256)"
HOST_VERDICT = "kosmos ag_gemm bf16 19.0 µs: meets <= 30; kosmos gemm_rs bf16 45.0 µs: misses <= 30"


def test_host_enqueue_table_and_line(tmp_path):
    from kosmos_bench.report import host_enqueue_line, host_enqueue_table, load_records
    records = load_records([write_lines(tmp_path / "w1.jsonl", host_lines())])
    assert len(records.results) == 2 and [r["impl"] for r in records.hosts] == ["kosmos", "nccl+cublas"] * 2
    df = build_table(records.results, records.hosts)
    table = host_enqueue_table(df)
    assert list(zip(table.op, table.impl, table.host_us.fillna(-1), table.status)) == [
        ("ag_gemm", "kosmos", 19.0, "ok"), ("ag_gemm", "nccl+cublas", 12.0, "ok"), ("gemm_rs", "kosmos", 45.0, "ok"),
        ("gemm_rs", "nccl+cublas", -1, "failed")]
    assert set(table["shape"]) == {"128x256x256"} and list(table.p80_us[:1]) == [21.0]
    line = host_enqueue_line(df)
    assert line == ("Host enqueue time per eager call of kosmos (median of back-to-back calls; the bar: "
                    f"<= 30 µs at W=1): {HOST_VERDICT}.")
    # a suite's own bar; a row at W > 1 is given without a verdict; a failed kosmos row with its reason
    suite = {"name": "mine", "bench": "tp", "targets": {"host_enqueue_us": 50}}
    lines = [env_line(suite), result_line(), host_record("ag_gemm", world=2, host_us=60.0),
             host_record("gemm_rs", host_us=45.0), host_record("ag_gemm", host_us=None, status="failed",
                                                                 reason="RuntimeError: boom")]
    records = load_records([write_lines(tmp_path / "mine.jsonl", lines)])
    line = host_enqueue_line(build_table(records.results, records.hosts))
    assert "kosmos ag_gemm bf16 W=2 60.0 µs (the bar is at W=1); kosmos gemm_rs bf16 45.0 µs: meets <= 50; " \
        "kosmos ag_gemm bf16 failed: RuntimeError: boom." in line, line
    # the same identity written twice (a rerun appended): the last wins
    records = load_records([write_lines(tmp_path / "twice.jsonl", [*host_lines(), host_record(host_us=25.0)])])
    again = host_enqueue_table(build_table(records.results, records.hosts))
    assert len(again) == 4 and again.host_us.iloc[0] == 25.0


def test_host_enqueue_section_in_every_format(tmp_path):
    """md, html, the compact text and --wide: the section with its rows and the verdict line; the in-loop section
    keeps its numbers under its new heading."""
    path = write_lines(tmp_path / "w1.jsonl", host_lines())
    md = report_text(path, "md")
    table = md_table(md, HOST_TITLE)
    assert table[0] == ["op", "dtype", "world", "impl", "host_us", "p20_us", "p80_us", "status", "reason"]
    assert table[1] == ["ag_gemm", "bf16", "1", "kosmos", "19.0", "18.0", "21.0", "ok", ""]
    assert table[4] == ["gemm_rs", "bf16", "1", "nccl+cublas", "", "", "", "failed", "RuntimeError: boom"]
    assert HOST_VERDICT in md and md.index(HOST_TITLE) < md.index("## Host time per call inside the timing loop")
    assert html.escape(HOST_VERDICT) in report_text(path, "html") and html.escape(HOST_TITLE) in report_text(path, "html")
    for wide in (False, True):
        text = " ".join(report_text(path, "text", wide=wide).split())
        assert HOST_TITLE in text and HOST_VERDICT in text, text
        assert "Host time per call inside the timing loop" in text
    compact = report_text(path, "text")
    assert max(map(len, compact.splitlines())) <= 100
    lines = compact.splitlines()
    assert any(line.split() == ["kosmos", "gemm_rs", "bf16", "45.0", "44.0", "47.0"] for line in lines), compact
    assert any(line.split() == ["nccl+cublas", "gemm_rs", "bf16", "failed"] for line in lines), compact
    assert "nccl+cublas gemm_rs bf16 failed: RuntimeError: boom" in compact


def test_old_files_without_host_rows_render_without_the_section(tmp_path):
    """A file written before host rows (the fixture; the in-loop host_ms only): no host enqueue section, no verdict,
    in any format; a malformed host line is a one-line error naming the file and line."""
    from kosmos_bench.report import host_enqueue_line, host_enqueue_table, load_records
    records = load_records([TP_SAMPLE])
    assert records.hosts == []
    df = build_table(records.results, records.hosts)
    assert host_enqueue_table(df).empty and host_enqueue_line(df) is None
    for fmt in ("md", "html", "text"):
        assert "Host enqueue time per eager call" not in report_text(TP_SAMPLE, fmt)
    bad = write_lines(tmp_path / "bad.jsonl", [result_line(), {"type": "host", "op": "ag_gemm"}])
    with pytest.raises(ReportError, match=r"bad.jsonl:2: host line lacks impl, status, world, dtype"):
        load_records([bad])


def report_text(path, fmt, wide=False):
    """`kosmos report PATH --format FMT` as report_main writes it to a file (in a folder of its own: ``path`` may be
    a committed fixture)."""
    import tempfile
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "report.txt"
        assert report_main([str(path)], fmt=fmt, out=str(out), wide=wide, status=Console(file=io.StringIO())) == 0
        return out.read_text(encoding="utf-8")


# --------------------------------------------------------------------------- training reports (bench train rows)

TRAIN_SAMPLE = FIXTURES / "train-sample.jsonl"
TRAIN_RUNS = sorted((Path(__file__).parent.parent / "results" / "h200x1").glob("train-*.jsonl"))


@pytest.mark.parametrize("path", [TRAIN_SAMPLE, *TRAIN_RUNS], ids=lambda path: path.stem)
def test_training_report_at_100_columns(path):
    """`kosmos report TRAIN.jsonl` at 100 columns, as a user runs it: no line over 100, the environment line with
    the commit first, the step-time speedup and the loss verdict before the table, no cell cut, every reason whole
    (wrapped), the rows of unavailable implementations named but not drawn."""
    import os
    run = subprocess.run([sys.executable, "-m", "kosmos_bench.cli", "report", str(path)], capture_output=True,
                         text=True, env={**os.environ, "COLUMNS": "100"}, cwd=Path(__file__).parent.parent)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert max(map(len, lines)) <= 100, max(lines, key=len)
    assert "…" not in run.stdout
    records = [json.loads(line) for line in path.read_text().splitlines()]
    env = next(record for record in records if record["type"] == "env")
    assert lines[0].startswith(f"{path.stem}: {env['gpu']} x{env['gpu_count']} | torch {env['torch']}")
    flat = " ".join(run.stdout.split())
    assert f"commit {env['git_commit'][:12]}" in flat
    table = next(index for index, line in enumerate(lines) if line.startswith("impl "))
    assert any(line.startswith(("Step-time speedup over", "bf16: Step-time speedup over")) for line in lines[:table])
    for record in records:
        if record["type"] != "result":
            continue
        if record["reason"]:
            assert " ".join(record["reason"].split()) in flat
        if record["status"] == "unavailable":
            assert any(line.startswith("unavailable, no row:") and record["impl"] in line for line in lines[table:])
            assert not any(line.split()[:1] == [record["impl"]] for line in lines[table:])
        else:
            assert any(line.split()[:1] == [record["impl"]] for line in lines[table:])


def test_training_report_wide_has_every_row_and_column():
    """--wide: the unavailable rows, the p20 / p80 step times and the loss bar, the full commit; the compact view
    has none of them."""
    path = Path(__file__).parent.parent / "results" / "h200x1" / "train-llama3-8b-w1.jsonl"
    compact, wide = (run_report(path, *flags) for flags in ((), ("--wide",)))
    assert compact.exit_code == 0 and wide.exit_code == 0
    rows = {line.split()[0] for line in wide.stdout.splitlines() if line.strip()}
    assert {"nccl+cublas", "torch-async-tp", "kosmos"} <= rows
    assert "p20 ms" in wide.stdout and "loss bar" in wide.stdout
    assert "cf580d680f28ab86e872aa781e7e98604d779024" in " ".join(wide.stdout.split()).replace(" ", "")
    assert not any(line.startswith("torch-async-tp") for line in compact.stdout.splitlines())
    assert "unavailable, no row: torch-async-tp [1]" in compact.stdout and "p20 ms" not in compact.stdout


def test_training_csv_numbers_are_numbers(tmp_path):
    """The training csv: peak_mem_bytes an integer, step_ms and the speedup plain floats (no units), losses a JSON
    list; md and the text keep the human units."""
    path = Path(__file__).parent.parent / "results" / "h200x1" / "train-llama3-8b-w1.jsonl"
    run = run_report(path, "--format", "csv")
    assert run.exit_code == 0, run.output
    rows = list(csv.DictReader(io.StringIO(run.stdout)))
    by_impl = {row["impl"]: row for row in rows}
    assert int(by_impl["nccl+cublas"]["peak_mem_bytes"]) == 4682059264
    assert int(by_impl["kosmos"]["peak_mem_bytes"]) == 5824092160
    assert float(by_impl["kosmos"]["step_ms"]) == pytest.approx(28.20702362060547)
    assert float(by_impl["kosmos"]["speedup"]) == pytest.approx(27.636240005493164 / 28.20702362060547)
    assert len(json.loads(by_impl["kosmos"]["losses"])) == 20
    assert by_impl["torch-async-tp"]["peak_mem_bytes"] == "" and by_impl["torch-async-tp"]["status"] == "unavailable"
    md = run_report(path, "--format", "md").stdout
    assert "| kosmos | 28.21 | 145,212 | 5.42 |" in md and "Step-time speedup over nccl+cublas" in md


def test_training_report_says_shared_gpu_step_times_are_not_measurements():
    """A run whose ranks shared one GPU (extra.ranks_on_one_gpu): its headline says the step times are not
    measurements."""
    path = Path(__file__).parent.parent / "results" / "h200x1" / "train-llama3-8b-w2-onegpu.jsonl"
    flat = " ".join(run_report(path).stdout.split())
    assert "the ranks shared one GPU: step times are not measurements" in flat


def test_fp8_block_rows_get_their_own_dtype_section(tmp_path):
    """A W=1 file with bf16 and fp8-block rows: the "fp8-block / bf16" section (columns fp8_block_*: kosmos at
    fp8-block against kosmos at bf16 and against cuBLAS bf16 alone), no mxfp8 section, every format renders."""
    import json as _json
    from kosmos_bench.report.tables import dtype_table
    env = {"type": "env", "run_id": "r-fp8b", "timestamp": "2026-12-08T00:00:00Z", "gpu": "NVIDIA H200",
           "gpu_count": 1, "torch": "2.11.0", "triton": "3.6.0", "kosmos": "0.1.0", "git_commit": "abc",
           "argv": ["kosmos", "bench", "tp", "--dtype", "bf16,fp8-block"], "bench": "tp",
           "suite": {"name": "tp-default", "bench": "tp", "dtype": ["bf16", "fp8-block"]},
           "note": "synthetic fixture, not a measurement"}
    rows = [env]
    for dtype, impl, ms in [("bf16", "kosmos", 1.00), ("bf16", "nccl+cublas", 1.01), ("fp8-block", "kosmos", 0.62),
                            ("fp8-block", "nccl+cublas", 1.01), ("fp8-block", "cublas-fp8-block", 0.60)]:
        rows.append({"type": "result", "run_id": "r-fp8b", "bench": "tp", "op": "ag_gemm", "layer": "fc1",
                     "model": "llama3-70b", "seq": 8192, "m": 8192, "n": 14336, "k": 8192, "world": 1,
                     "dtype": dtype, "impl": impl, "status": "ok", "reason": None, "time_ms": ms,
                     "tflops": 2 * 8192 * 14336 * 8192 / ms / 1e9, "rel_err": 3e-3, "t_gemm_ms": 0.99,
                     "t_comm_ms": 0.0, "wire_bytes": 0, "params": {}, "config": {}, "extra": {}})
    path = tmp_path / "fp8b.jsonl"
    path.write_text("\n".join(_json.dumps(r) for r in rows) + "\n")
    table = build_table(load_results([path])[1])
    ratios = dtype_table(table, "fp8-block")
    assert len(ratios) == 1 and dtype_table(table).empty  # no mxfp8 rows
    assert ratios["fp8_block_vs_bf16"].iloc[0] == pytest.approx(1.00 / 0.62)
    assert ratios["fp8_block_vs_cublas_bf16"].iloc[0] == pytest.approx(0.99 / 0.62)
    md = render(table, "md")
    assert "## fp8-block / bf16" in md and "mxfp8 / bf16" not in md and "fp8_block_vs_cublas_bf16" in md
    text = render(table, "text")
    assert "fp8-block / bf16" in text and "1.613x" in text
    for fmt in ("html", "csv"):
        assert render(table, fmt)
