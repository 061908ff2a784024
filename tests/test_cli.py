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


MOE_FIXTURE = Path(__file__).parent / "fixtures" / "moe-sample.jsonl"
SUITES = Path(__file__).parent.parent / "suites"


def test_bench_moe_help_teaches():
    r = runner.invoke(app, ["bench", "moe", "--help"])
    assert r.exit_code == 0
    for opt in ("--model", "--tokens", "--ep", "--routing", "--dtype", "--impl", "--suite", "--iters", "--warmup",
                "--out", "--expert-gemms"):
        assert opt in r.output
    text = " ".join(r.output.split())  # rich wraps at the terminal width
    for part in ("zipf:S", "nccl-a2a", "deepep", "fixed-role-best", "kosmos-expert-gemms", "Examples:",
                 "kosmos bench moe --model qwen3-235b --tokens 4096,8192 --routing uniform,zipf:1.2 --ep 2"):
        assert part in text
    r = runner.invoke(app, ["--help"])
    assert "kosmos bench moe" in r.output


@pytest.mark.parametrize("args, needle", [
    (["--model", "grok-9"], "unknown models ['grok-9']; choose from deepseek-v3, qwen3-235b, mixtral-8x7b, qwen2-57b"),
    (["--routing", "zipf"], "zipf needs an exponent"),
    (["--routing", "uniform,zipf:-2"], "must be a finite number > 0"),
    (["--routing", "hot"], "unknown routing 'hot'"),
    (["--impl", "megablocks"], "unknown impls ['megablocks']"),
    (["--tokens", "0"], "positive integers"),
    (["--model", "mixtral-8x7b", "--ep", "3"], "mixtral-8x7b has 8 experts: they do not split evenly over ep=3"),
    (["--dtype", "mxfp8"], "--dtype mxfp8 is not implemented yet"),
    (["--suite", str(SUITES / "tp-default.yaml")], "is a 'tp' suite; run it with `kosmos bench tp`"),
])
def test_bench_moe_input_errors(args, needle):
    r = runner.invoke(app, ["bench", "moe", *args])
    assert r.exit_code == 2 and needle in " ".join(r.output.split()), r.output


def test_bench_moe_tokens_not_a_number():
    r = runner.invoke(app, ["bench", "moe", "--tokens", "4k"])
    assert r.exit_code != 0


def test_bench_moe_without_gpu_says_so():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    r = runner.invoke(app, ["bench", "moe", "--model", "qwen3-235b", "--tokens", "4096"])
    assert r.exit_code == 2 and "no CUDA GPU" in r.output


def test_bench_moe_more_ranks_than_gpus(monkeypatch):
    from kosmos_bench import launcher
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 1)
    r = runner.invoke(app, ["bench", "moe", "--ep", "2"])
    assert r.exit_code == 2 and "asked for 2 GPUs but only 1 are visible" in " ".join(r.output.split())


def test_bench_moe_default_ep_must_split_experts(monkeypatch):
    from kosmos_bench import launcher
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 3)  # default EP = every visible GPU
    monkeypatch.setattr(launcher, "spawn", lambda *a, **k: pytest.fail("must not launch"))
    r = runner.invoke(app, ["bench", "moe", "--model", "qwen3-235b"])
    assert r.exit_code == 2 and "128 experts: they do not split evenly over --ep 3" in " ".join(r.output.split())


def test_bench_tp_refuses_a_moe_suite():
    r = runner.invoke(app, ["bench", "tp", "--suite", str(SUITES / "moe-default.yaml")])
    assert r.exit_code == 2 and "is a 'moe' suite; run it with `kosmos bench moe`" in " ".join(r.output.split())


def test_report_moe_csv_contract():
    r = runner.invoke(app, ["report", str(MOE_FIXTURE), "--format", "csv"])
    assert r.exit_code == 0, r.output
    lines = r.output.strip().splitlines()
    header = lines[0].split(",")
    for col in ("op,model,m,n,k,world,dtype,impl,time_ms,tflops,speedup,overlap_efficiency,status,"
                "tokens,experts,top_k,routing").split(","):
        assert col in header
    assert len(lines) == 1 + sum('"type": "result"' in x for x in MOE_FIXTURE.read_text().splitlines())


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


def test_bench_tp_shapes_tp_sizes_the_gemms_as_that_tp(monkeypatch):
    """--tp 1 --shapes-tp 2: one rank, GEMMs of a TP=2 rank (weight shard halved, all tokens local)."""
    from kosmos_bench import launcher
    seen = {}
    monkeypatch.setattr(launcher, "check_world", lambda asked: 1)
    monkeypatch.setattr(launcher, "spawn", lambda fn, world, suite, cases, *a: seen.update(cases=cases))
    monkeypatch.setattr("kosmos_bench.report.load_results", lambda files: ([], []))
    monkeypatch.setattr("kosmos_bench.report.print_terminal", lambda *a, **k: None)
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-70b", "--seq", "4096", "--tp", "1",
                            "--shapes-tp", "2", "--out", "/tmp/kosmos-shapes-tp-test.jsonl"])
    assert r.exit_code == 0, r.output
    by_layer = {c["layer"]: (c["m"], c["n"], c["k"]) for c in seen["cases"]}
    assert by_layer == {"qkv": (4096, 5120, 8192), "fc1": (4096, 28672, 8192),
                        "attn_out": (4096, 8192, 4096), "fc2": (4096, 8192, 14336)}
    r = runner.invoke(app, ["bench", "tp", "--shapes-tp", "0"])
    assert r.exit_code == 2 and "'shapes_tp' must be a positive integer" in r.output


def test_bench_help_teaches_config():
    """Both benches' --help teach --config with an example and every key the registry knows."""
    from kosmos_bench.registry import CONFIG_TYPES, config_keys
    for bench, example in (("tp", "--config push_chunks=auto --config push_partials=true"),
                           ("moe", "--config copy_cols=256 --config half_tail=false")):
        r = runner.invoke(app, ["bench", bench, "--help"])
        text = " ".join(r.output.replace("│", " ").split())  # rich boxes and wraps the option table
        assert r.exit_code == 0 and f"E.g. {example}" in text, text
        for key in config_keys(CONFIG_TYPES[bench]):
            assert key in text, (bench, key)


@pytest.mark.parametrize("bench, args, needle", [
    ("tp", ["--config", "push_chunk=2"],
     "--config: unknown key 'push_chunk'; known: ag_gemm.push_chunks, ag_gemm.copy_block, gemm_rs.push_partials"),
    ("tp", ["--config", "gemm_rs.push_chunks=2"], "unknown key 'gemm_rs.push_chunks'; known: ag_gemm.push_chunks"),
    ("tp", ["--config", "copy_cols=256"], "unknown key 'copy_cols'"),  # a MoE field is no TP op's
    ("tp", ["--config", "push_chunks=0"], "--config ag_gemm.push_chunks=0: push_chunks=0 must be an integer >= 1"),
    ("tp", ["--config", "push_partials=maybe"], "--config gemm_rs.push_partials=maybe: push_partials='maybe' must"),
    ("tp", ["--config", "push_chunks"], "--config 'push_chunks': expected key=value"),
    ("moe", ["--config", "moe_fwd.copy_cols=100"], "--config moe_fwd.copy_cols=100: copy_cols=100 must be a power"),
    ("moe", ["-c", "KOSMOS_MOE_BH=128"], "unknown key 'KOSMOS_MOE_BH'; known: moe_fwd.copy_cols, moe_fwd.half_tail"),
])
def test_bench_config_errors(monkeypatch, bench, args, needle):
    """A bad --config is a one-line error (exit 2) before anything launches, whatever the machine."""
    from kosmos_bench import launcher
    monkeypatch.setattr(launcher, "check_world", lambda asked: 1)
    monkeypatch.setattr(launcher, "spawn", lambda *a, **k: pytest.fail("must not launch"))
    r = runner.invoke(app, ["bench", bench, *args])
    text = " ".join(r.output.split())
    assert r.exit_code == 2 and needle in text, text


def _capture_spawn(monkeypatch):
    from kosmos_bench import launcher
    seen = {}
    monkeypatch.setattr(launcher, "check_world", lambda asked: 1)
    monkeypatch.setattr(launcher, "spawn", lambda fn, world, *a: seen.update(fn=fn, args=a))
    monkeypatch.setattr("kosmos_bench.report.load_results", lambda files: ([], []))
    monkeypatch.setattr("kosmos_bench.report.print_terminal", lambda *a, **k: None)
    return seen


def test_bench_tp_config_reaches_the_ranks(monkeypatch, tmp_path):
    """Prefixed and unprefixed keys, repeated and comma-separated: the ranks get every op's full config."""
    from kosmos import AllGatherMatmulConfig, MatmulReduceScatterConfig
    from kosmos_bench import tp
    seen = _capture_spawn(monkeypatch)
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", "--out", str(tmp_path / "r.jsonl"),
                            "--config", "ag_gemm.push_chunks=auto,copy_block=4096", "--config", "push_partials=on"])
    assert r.exit_code == 0, r.output
    assert seen["fn"] is tp.bench_rank
    assert seen["args"][-1] == {"ag_gemm": AllGatherMatmulConfig(push_chunks="auto", copy_block=4096),
                                "gemm_rs": MatmulReduceScatterConfig(push_partials=True)}
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--out", str(tmp_path / "d.jsonl")])
    assert r.exit_code == 0 and seen["args"][-1] == {"ag_gemm": AllGatherMatmulConfig(),
                                                     "gemm_rs": MatmulReduceScatterConfig()}


def test_bench_moe_config_reaches_the_ranks(monkeypatch, tmp_path):
    from kosmos import MoEForwardConfig
    from kosmos_bench import moe
    seen = _capture_spawn(monkeypatch)
    r = runner.invoke(app, ["bench", "moe", "--model", "qwen3-235b", "--tokens", "64", "--out",
                            str(tmp_path / "r.jsonl"), "--config", "copy_cols=256,moe_fwd.half_tail=false"])
    assert r.exit_code == 0, r.output
    assert seen["fn"] is moe.bench_rank and seen["args"][-1] == {"moe_fwd": MoEForwardConfig(256, False)}
