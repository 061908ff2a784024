"""The CLI through typer's test runner: help, input errors, and report rendering from the fixture."""
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kosmos_bench.cli import app

FIXTURE = Path(__file__).parent / "fixtures" / "tp-sample.jsonl"
runner = CliRunner()


def test_help_teaches():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "bench" in r.output and "report" in r.output
    r = runner.invoke(app, ["bench", "tp", "--help"])
    assert r.exit_code == 0
    for opt in ("--model", "--seq", "--tp", "--dtype", "--op", "--impl", "--suite", "--iters", "--warmup",
                "--out", "--trace"):
        assert opt in r.output


def test_bench_unknown_model_is_a_clear_error():
    r = runner.invoke(app, ["bench", "tp", "--model", "llama9-1t"])
    assert r.exit_code == 2 and "unknown models" in r.output


def test_bench_mxfp8_not_yet():
    r = runner.invoke(app, ["bench", "tp", "--dtype", "mxfp8"])
    assert r.exit_code == 2 and "not implemented yet" in r.output


def test_bench_bad_op_and_seq():
    r = runner.invoke(app, ["bench", "tp", "--op", "conv"])
    assert r.exit_code == 2 and "unknown --op" in r.output
    r = runner.invoke(app, ["bench", "tp", "--seq", "abc"])
    assert r.exit_code != 0


def test_bench_without_gpu_says_so(monkeypatch):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096"])
    assert r.exit_code == 2 and "no CUDA GPU" in r.output


def test_bench_moe_not_yet():
    r = runner.invoke(app, ["bench", "moe"])
    assert r.exit_code == 2 and "not implemented yet" in r.output


def test_report_csv_contract():
    r = runner.invoke(app, ["report", str(FIXTURE), "--format", "csv"])
    assert r.exit_code == 0, r.output
    header = r.output.splitlines()[0].split(",")
    for col in "op,model,m,n,k,world,dtype,impl,time_ms,tflops,speedup,overlap_efficiency,status".split(","):
        assert col in header


@pytest.mark.parametrize("fmt", ["md", "html", "text"])
def test_report_formats_to_file(tmp_path, fmt):
    out = tmp_path / f"r.{fmt}"
    r = runner.invoke(app, ["report", str(FIXTURE), "--format", fmt, "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert out.read_text().strip()


def test_report_errors():
    r = runner.invoke(app, ["report", "no-such-file.jsonl"])
    assert r.exit_code == 2
    r = runner.invoke(app, ["report", str(FIXTURE), "--format", "pdf"])
    assert r.exit_code == 2 and "unknown --format" in r.output


def test_report_committed_results_render():
    """The committed H200 results must stay renderable by the current report code."""
    results = Path(__file__).parent.parent / "results" / "h200x2" / "tp-bf16.jsonl"
    r = runner.invoke(app, ["report", str(results), "--format", "csv"])
    assert r.exit_code == 0, r.output
    n_results = sum('"type": "result"' in line for line in results.read_text().splitlines())
    assert n_results > 0 and len(r.output.strip().splitlines()) == 1 + n_results
