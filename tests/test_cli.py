"""The CLI through typer's test runner: help, input errors, and report rendering from the fixture."""
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kosmos_bench.cli import app
from kosmos_bench.report.load import Records

FIXTURE = Path(__file__).parent / "fixtures" / "tp-sample.jsonl"
runner = CliRunner()


def test_help_teaches():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "bench" in r.output and "report" in r.output
    r = runner.invoke(app, ["bench", "tp", "--help"])
    assert r.exit_code == 0
    for opt in ("--model", "--seq", "--tp", "--dtype", "--op", "--impl", "--suite", "--iters", "--warmup",
                "--out", "--trace", "--host-shape", "--host-calls"):
        assert opt in r.output


def test_bench_unknown_model_is_a_clear_error():
    r = runner.invoke(app, ["bench", "tp", "--model", "llama9-1t"])
    assert r.exit_code == 2 and "unknown models" in r.output


@pytest.mark.parametrize("value, dtypes", [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("bf16,mxfp8", "bf16, mxfp8"),
                                           ("mxfp8,bf16,mxfp8", "mxfp8, bf16")])
def test_bench_tp_dtype_list_parses(value, dtypes):
    r = runner.invoke(app, ["bench", "tp", "--shape", "256x256x256", "--op", "ag_gemm", "--tp", "1", "--dtype", value,
                            "--dry-run"])
    assert r.exit_code == 0, r.output
    assert f"dtype: {dtypes}" in r.output
    for d in dtypes.split(", "):
        assert f"implementations (tp, {d}):" in r.output


@pytest.mark.parametrize("value, needle", [
    ("fp4", "--dtype: unknown 'fp4'; choose from bf16, mxfp8, fp8-block"),
    ("bf16,int8", "--dtype: unknown 'int8'"),
    (",", "--dtype: give bf16, mxfp8, fp8-block or a comma list"),
])
def test_bench_tp_bad_dtype_is_one_line(value, needle):
    r = runner.invoke(app, ["bench", "tp", "--dtype", value, "--dry-run"])
    assert r.exit_code == 2 and needle in r.output and len(r.output.strip().splitlines()) == 1, r.output


def test_bench_tp_dry_run_lists_implementations_per_dtype():
    r = runner.invoke(app, ["bench", "tp", "--shape", "256x256x256", "--op", "ag_gemm,gemm_rs", "--tp", "2",
                            "--dtype", "bf16,mxfp8", "--dry-run"])
    assert r.exit_code == 0, r.output
    bf16, mx = r.output.split("implementations (tp, bf16):")[1].split("implementations (tp, mxfp8):")
    assert "triton-dot-scaled" not in bf16 and "fp8-rowwise" not in bf16  # mxfp8-only baselines: no bf16 rows
    for name in ("kosmos", "nccl+cublas (baseline)", "fixed-role-best", "triton-dot-scaled", "fp8-rowwise"):
        assert name in mx
    assert "torch-async-tp          unavailable: no MXFP8 path in torch async-TP" in mx
    assert "over 2 dtypes" in r.output and "tp-bf16-mxfp8-" in r.output


def test_bench_tp_impls_without_a_row_at_a_dtype():
    r = runner.invoke(app, ["bench", "tp", "--dtype", "bf16", "--impl", "fp8-rowwise", "--dry-run"])
    assert r.exit_code == 2 and "none of them runs at bf16" in r.output


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
    (["--tokens", "0"], "--tokens 0: give an integer >= 1"),
    (["--model", "mixtral-8x7b", "--ep", "3"], "mixtral-8x7b has 8 experts: they do not split evenly over ep=3"),
    (["--dtype", "fp8"], "--dtype: unknown 'fp8'; choose from bf16, mxfp8"),
    (["--suite", str(SUITES / "tp-default.yaml")], "is a 'tp' suite; run it with `kosmos bench tp`"),
])
def test_bench_moe_input_errors(args, needle):
    r = runner.invoke(app, ["bench", "moe", *args])
    assert r.exit_code == 2 and needle in " ".join(r.output.split()), r.output


MOE_TINY = ["bench", "moe", "--hidden", "256", "--ffn", "128", "--experts", "8", "--top-k", "2", "--tokens", "256"]


@pytest.mark.parametrize("value, dtypes", [("bf16", "bf16"), ("mxfp8", "mxfp8"), ("bf16,mxfp8", "bf16, mxfp8"),
                                           ("mxfp8,bf16,mxfp8", "mxfp8, bf16")])
def test_bench_moe_dtype_list_parses(value, dtypes):
    r = runner.invoke(app, [*MOE_TINY, "--ep", "1", "--dtype", value, "--dry-run"])
    assert r.exit_code == 0, r.output
    assert f"dtype: {dtypes}" in r.output and f"moe-{dtypes.replace(', ', '-')}-" in r.output


def test_bench_moe_dry_run_lists_implementations_per_dtype():
    r = runner.invoke(app, [*MOE_TINY, "--ep", "2", "--dtype", "bf16,mxfp8", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "over 2 dtypes" in r.output
    bf16, mx = r.output.split("implementations (moe_fwd, bf16):")[1].split("implementations (moe_fwd, mxfp8):")
    assert "implementations (moe_experts, bf16):" in r.output  # the expert GEMMs alone: bf16 only
    assert "implementations (moe_experts, mxfp8)" not in r.output and "kosmos-expert-gemms" not in mx
    for name in ("kosmos", "nccl-a2a (baseline)", "fixed-role", "fixed-role-best"):
        assert name in mx
    assert "deepep" in bf16 and "unavailable: no MXFP8 path in the deepep baseline yet" in mx
    r = runner.invoke(app, [*MOE_TINY, "--ep", "1", "--dtype", "mxfp8", "--no-expert-gemms", "--dry-run"])
    assert r.exit_code == 0 and "implementations (moe_fwd):" in r.output and "moe_experts" not in r.output, r.output


def test_bench_moe_suite_dtype_list(tmp_path):
    path = tmp_path / "moe-mx.yaml"
    path.write_text("bench: moe\nmodels: [mixtral-8x7b]\ntokens: [128]\nrouting: [uniform]\ndtype: [bf16, mxfp8]\n")
    r = runner.invoke(app, ["bench", "moe", "--suite", str(path), "--ep", "1", "--dry-run"])
    assert r.exit_code == 0 and "dtype: bf16, mxfp8" in r.output, r.output
    r = runner.invoke(app, ["bench", "moe", "--suite", str(path), "--ep", "1", "--dtype", "mxfp8", "--dry-run"])
    assert r.exit_code == 0 and "dtype: mxfp8" in r.output, r.output


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
    monkeypatch.setattr("kosmos_bench.report.load_records", lambda files: Records([], [], []))
    monkeypatch.setattr("kosmos_bench.report.print_terminal", lambda *a, **k: None)
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-70b", "--seq", "4096", "--tp", "1",
                            "--shapes-tp", "2", "--out", "/tmp/kosmos-shapes-tp-test.jsonl"])
    assert r.exit_code == 0, r.output
    by_layer = {c["layer"]: (c["m"], c["n"], c["k"]) for c in seen["cases"]}
    assert by_layer == {"qkv": (4096, 5120, 8192), "fc1": (4096, 28672, 8192),
                        "attn_out": (4096, 8192, 4096), "fc2": (4096, 8192, 14336)}
    r = runner.invoke(app, ["bench", "tp", "--shapes-tp", "0"])
    assert r.exit_code == 2 and "--shapes-tp 0: give an integer >= 1" in r.output


def test_bench_help_teaches_config():
    """Both benches' --help teach --config with an example and every key the registry knows."""
    from kosmos_bench.registry import CONFIG_TYPES, config_keys
    for bench, example in (("tp", "--config push_chunks=auto --config push_partials=true"),
                           ("moe", "--config copy_cols=256 --config half_tail=false")):
        r = runner.invoke(app, ["bench", bench, "--help"])
        text = " ".join(r.output.replace("│", " ").split())  # rich boxes and wraps the option table
        assert r.exit_code == 0 and f"E.g. {example}" in text, text
        for key in config_keys(CONFIG_TYPES[bench]):
            if key.startswith("moe_bwd."):  # 16 fields: named by their config class, not one by one
                assert "moe_bwd.FIELD" in text and "MoEBackwardConfig" in text, text
            else:
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
    monkeypatch.setattr("kosmos_bench.report.load_records", lambda files: Records([], [], []))
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
    from kosmos import MoEBackwardConfig, MoEForwardConfig
    from kosmos_bench import moe
    seen = _capture_spawn(monkeypatch)
    r = runner.invoke(app, ["bench", "moe", "--model", "qwen3-235b", "--tokens", "64", "--out",
                            str(tmp_path / "r.jsonl"), "--config", "copy_cols=256,moe_fwd.half_tail=false"])
    assert r.exit_code == 0, r.output
    assert seen["fn"] is moe.bench_rank and seen["args"][-2] == {"moe_fwd": MoEForwardConfig(256, False),
                                                                 "moe_bwd": MoEBackwardConfig()}
    assert seen["args"][-1] is None  # no --trace


# --------------------------------------------------------------------------- one-line errors, stderr, --version, env


def _one_line_error(r, needle):
    """exit 2 and ``error: ...needle...`` as the one line on stderr."""
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.output


@pytest.mark.parametrize("bench, args, needle", [
    ("tp", ["--seq", "abc"], "--seq: 'abc' is not an integer"),
    ("tp", ["--seq", "4096,8k"], "--seq: '8k' is not an integer"),
    ("moe", ["--tokens", "4k"], "--tokens: '4k' is not an integer"),
])
def test_not_a_number_names_the_option(bench, args, needle):
    _one_line_error(runner.invoke(app, ["bench", bench, *args]), needle)


@pytest.mark.parametrize("bench", ["tp", "moe"])
def test_binary_suite_file_is_a_one_line_error_with_its_path(tmp_path, bench):
    p = tmp_path / "suite.yaml"
    p.write_bytes(b"\x80\x81\xff\xfe\x00binary")
    r = runner.invoke(app, ["bench", bench, "--suite", str(p)])
    _one_line_error(r, f"{p}: not a text (UTF-8) YAML file")


def test_missing_suite_lists_the_packaged_ones_and_a_name_finds_one(tmp_path):
    r = runner.invoke(app, ["bench", "tp", "--suite", str(tmp_path / "nope.yaml"), "--dry-run"])
    _one_line_error(r, "does not exist (packaged suites, by name: moe-default, moe-hf, tp-default, tp-grid)")
    r = runner.invoke(app, ["bench", "moe", "--suite", "moe-default", "--dry-run"])
    assert r.exit_code == 0 and "deepseek-v3" in r.stdout, r.output


def test_long_errors_stay_on_one_line():
    """rich would wrap at the terminal width (80 under the test runner): errors are printed unwrapped."""
    r = runner.invoke(app, ["bench", "moe", "--model", "mixtral-8x7b", "--ep", "3", "--tokens", "4096",
                            "--routing", "uniform", "--impl", "kosmos,nccl-a2a,deepep,fixed-role,fixed-role-best"])
    _one_line_error(r, "mixtral-8x7b has 8 experts: they do not split evenly over ep=3")


def test_bench_status_goes_to_stderr(monkeypatch, tmp_path):
    """The status line and the results path are stderr; stdout holds only the final table (stubbed here)."""
    _capture_spawn(monkeypatch)
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", "--out", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 0, r.output
    assert r.stdout == "" and "kosmos bench tp" in r.stderr and "results:" in r.stderr


def test_set_timeout_without_a_gpu_is_a_kosmos_error(monkeypatch):
    import torch

    import kosmos
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(kosmos.KosmosError, match="no CUDA device is available"):
        kosmos.set_timeout(3.0)
    with pytest.raises(ValueError, match="positive"):  # the value is still checked first
        kosmos.set_timeout(0)


def test_version():
    import torch
    import triton

    import kosmos
    r = runner.invoke(app, ["--version"])
    assert r.exit_code == 0
    assert r.stdout.strip() == f"kosmos {kosmos.__version__}  torch {torch.__version__}  triton {triton.__version__}"


def test_env_without_a_gpu(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    r = runner.invoke(app, ["env"])
    assert r.exit_code == 0, r.output
    for part in ("kosmos:", "git commit:", "python:", "torch:", "triton:", "NCCL:", "driver:",
                 "GPUs:        no CUDA GPU", "nvidia-smi topo -m", "environment:"):
        assert part in r.stdout, (part, r.stdout)


def test_env_lists_gpus_and_peer_access(monkeypatch):
    """With GPUs (faked here): name, memory, SMs per GPU and the peer-access matrix."""
    from types import SimpleNamespace

    import torch
    props = SimpleNamespace(name="NVIDIA H200", total_memory=140 * 2**30, multi_processor_count=132, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props)
    monkeypatch.setattr(torch.cuda, "can_device_access_peer", lambda i, j: True)
    out = runner.invoke(app, ["env"]).stdout
    assert "GPUs:        2 visible" in out and "  1: NVIDIA H200, 140.0 GiB, 132 SMs, sm_90" in out
    assert "peer access (row -> column):" in out and "    0    -  yes\n    1  yes    -" in out


# --------------------------------------------------------------------------- custom points


def test_custom_tp_gemm_follows_the_schema():
    from kosmos.models import CustomShapeError, custom_tp_gemm, parse_shape
    assert parse_shape("8192x1024x8192") == (8192, 1024, 8192) and parse_shape(" 16X8x8 ") == (16, 8, 8)
    g = custom_tp_gemm("gemm_rs", 8192, 4096, 1024, 8)
    assert (g.model, g.layer, g.op, g.seq, g.m, g.n, g.k) == ("custom", "custom", "gemm_rs", 8192, 8192, 4096, 1024)
    for args, needle in [(("ag_gemm", 100, 8, 8, 8), "M=100 must divide by the world size 8"),
                         (("ag_gemm", 64, 12, 8, 1), "N=12 must be a multiple of 8"),
                         (("gemm_rs", 64, 8, 0, 1), "K=0 must be a positive integer"),
                         (("qkv", 64, 8, 8, 1), "a custom shape is an ag_gemm or a gemm_rs")]:
        with pytest.raises(CustomShapeError, match=needle):
            custom_tp_gemm(*args)
    for text in ("8192x1024", "8192x1024x8192x1", "axbxc", "-8x8x8", "8x8x0"):
        with pytest.raises(CustomShapeError):
            parse_shape(text)


def test_bench_tp_custom_shapes_reach_the_ranks(monkeypatch, tmp_path):
    """--shape (repeated and comma-separated) x --op: custom rows' GEMMs, the suite as run records them."""
    from kosmos.models import TPGemm
    seen = _capture_spawn(monkeypatch)
    monkeypatch.setattr("kosmos_bench.launcher.check_world", lambda asked: 2)
    r = runner.invoke(app, ["bench", "tp", "--shape", "8192x1024x8192,4096x2048x1024", "--shape", "8192x1024x8192",
                            "--op", "ag_gemm,gemm_rs", "--out", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 0, r.output
    suite, cases = seen["args"][0], seen["args"][1]
    got = [(c["op"], c["m"], c["n"], c["k"]) for c in cases]
    assert got == [("ag_gemm", 8192, 1024, 8192), ("gemm_rs", 8192, 1024, 8192), ("ag_gemm", 4096, 2048, 1024),
                   ("gemm_rs", 4096, 2048, 1024)]  # the repeated shape once
    assert all(TPGemm(**c).model == "custom" and c["layer"] == "custom" and c["seq"] == c["m"] for c in cases)
    assert suite["models"] == ["custom"] and suite["seq"] == [4096, 8192] and len(suite["shapes"]) == 4


@pytest.mark.parametrize("args, needle", [
    (["--shape", "8192x1024x8192"], "--shape needs --op ag_gemm or --op gemm_rs"),
    (["--shape", "8192x1024x8192", "--op", "fc1"], "--op fc1: with --shape, --op is ag_gemm or gemm_rs"),
    (["--shape", "8192x1024", "--op", "ag_gemm"], "--shape 8192x1024: not MxNxK"),
    (["--shape", "8192x0x8192", "--op", "ag_gemm"], "--shape 8192x0x8192: N=0 must be positive"),
    (["--shape", "100x1024x8192", "--op", "ag_gemm", "--tp", "8"], "--shape 100x1024x8192: M=100 must divide by "
                                                                    "the world size 8"),
    (["--shape", "8192x1020x8192", "--op", "gemm_rs", "--tp", "1"], "N=1020 must be a multiple of 8"),
    (["--shape", "8192x1024x8190", "--op", "gemm_rs", "--tp", "1"], "K=8190 must be a multiple of 8"),
    (["--shape", "8192x1024x8192", "--op", "ag_gemm", "--model", "llama3-8b"], "drop --model"),
    (["--shape", "8192x1024x8192", "--op", "ag_gemm", "--seq", "4096", "--shapes-tp", "2"], "drop --seq, --shapes-tp"),
])
def test_bench_tp_custom_shape_errors(monkeypatch, args, needle):
    """One line naming --shape / --op, before anything launches, with or without --dry-run, whatever the machine."""
    from kosmos_bench import launcher
    monkeypatch.setattr(launcher, "spawn", lambda *a, **k: pytest.fail("must not launch"))
    for dry in ([], ["--dry-run"]):
        _one_line_error(runner.invoke(app, ["bench", "tp", *args, *dry]), needle)


def test_custom_moe_model_checks():
    from kosmos.models import CustomShapeError, MoEModel, custom_moe_model
    m = custom_moe_model(2048, 512, 64, 6, "sigmoid-grouped", n_group=8, topk_group=2, routed_scaling=2, ep=8)
    assert m == MoEModel("custom", hidden=2048, expert_ffn=512, experts=64, top_k=6, routing="sigmoid-grouped",
                         renormalize=True, n_group=8, topk_group=2, routed_scaling=2.0)
    for kw, field in [(dict(hidden=100), "hidden"), (dict(ffn=0), "ffn"), (dict(experts=300), "experts"),
                      (dict(experts=96, ep=5), "experts"), (dict(top_k=17, experts=64), "top_k"),
                      (dict(top_k=9, experts=8), "top_k"), (dict(routing="topk"), "routing"),
                      (dict(n_group=2), "n_group"), (dict(routed_scaling=float("nan")), "routed_scaling"),
                      (dict(routing="sigmoid-grouped", n_group=5), "n_group"),
                      (dict(routing="sigmoid-grouped", n_group=8, topk_group=9), "topk_group"),
                      (dict(routing="sigmoid-grouped", n_group=8, topk_group=1, top_k=9), "top_k")]:
        args = dict(hidden=2048, ffn=512, experts=64, top_k=6) | kw
        with pytest.raises(CustomShapeError) as e:
            custom_moe_model(**args)
        assert e.value.field == field, (kw, e.value)


def test_bench_moe_custom_model_reaches_the_ranks(monkeypatch, tmp_path):
    from kosmos.models import MoEModel
    from kosmos_bench import moe
    seen = _capture_spawn(monkeypatch)
    monkeypatch.setattr("kosmos_bench.launcher.check_world", lambda asked: 4)
    r = runner.invoke(app, ["bench", "moe", "--hidden", "2048", "--ffn", "512", "--experts", "64", "--top-k", "6",
                            "--routing-kind", "sigmoid-grouped", "--n-group", "8", "--topk-group", "2",
                            "--tokens", "128", "--routing", "zipf:1.2", "--out", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 0, r.output
    suite, cases = seen["args"][0], seen["args"][1]
    assert suite["models"] == ["custom"] and suite["custom_model"]["experts"] == 64 and suite["ep"] == 4
    case = moe.MoECase(**cases[0])
    want = MoEModel("custom", 2048, 512, 64, 6, "sigmoid-grouped", True, 8, 2, 1.0)
    assert moe.case_model(case) == want and (case.tokens, case.routing) == (128, "zipf:1.2")
    row = moe.base_row(case, 4, "bf16")
    assert (row["model"], row["experts"], row["top_k"], row["hidden"], row["expert_ffn"], row["n"], row["k"]) == \
        ("custom", 64, 6, 2048, 512, 2048, 512)


@pytest.mark.parametrize("args, needle", [
    (["--hidden", "2048"], "a custom model needs --hidden, --ffn, --experts, --top-k together; missing --ffn, "
                           "--experts, --top-k"),
    (["--routing-kind", "sigmoid-grouped"], "--routing-kind: router options of a custom model"),
    (["--model", "qwen3-235b", "--hidden", "2048", "--ffn", "512", "--experts", "64", "--top-k", "6"],
     "--model and a custom model (--hidden/--ffn/--experts/--top-k) exclude each other"),
    (["--hidden", "2050", "--ffn", "512", "--experts", "64", "--top-k", "6"], "--hidden: hidden=2050 must be a "
                                                                              "multiple of 8"),
    (["--hidden", "2048", "--ffn", "512", "--experts", "96", "--top-k", "6", "--ep", "5"],
     "--experts: 96 experts do not split evenly over EP=5 ranks"),
    (["--hidden", "2048", "--ffn", "512", "--experts", "8", "--top-k", "9"], "--top-k: top_k=9 must be at most the "
                                                                             "8 experts"),
    (["--hidden", "2048", "--ffn", "512", "--experts", "64", "--top-k", "6", "--routing-kind", "sigmoid-grouped",
      "--n-group", "8", "--topk-group", "9"], "--topk-group: topk_group=9 must be at most n_group=8"),
    (["--hidden", "2048", "--ffn", "512", "--experts", "64", "--top-k", "6", "--n-group", "8"],
     "--n-group: n_group=8: groups belong to routing kind 'sigmoid-grouped'"),
    (["--hidden", "2048", "--ffn", "512", "--experts", "64", "--top-k", "6", "--ep", "3"],
     "--experts: 64 experts do not split evenly over EP=3 ranks"),
])
def test_bench_moe_custom_model_errors(monkeypatch, args, needle):
    from kosmos_bench import launcher
    monkeypatch.setattr(launcher, "spawn", lambda *a, **k: pytest.fail("must not launch"))
    for dry in ([], ["--dry-run"]):
        _one_line_error(runner.invoke(app, ["bench", "moe", *args, *dry]), needle)


def test_bench_moe_custom_default_ep_must_split_its_experts(monkeypatch):
    from kosmos_bench import launcher
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 3)
    monkeypatch.setattr(launcher, "spawn", lambda *a, **k: pytest.fail("must not launch"))
    r = runner.invoke(app, ["bench", "moe", "--hidden", "2048", "--ffn", "512", "--experts", "64", "--top-k", "6"])
    _one_line_error(r, "custom has 64 experts: they do not split evenly over --ep 3")


# --------------------------------------------------------------------------- --dry-run


def _no_gpu_no_launch(monkeypatch, gpus=0):
    """A machine with ``gpus`` GPUs, where a dry run must neither check the world, nor spawn, nor write."""
    from kosmos_bench import launcher
    monkeypatch.setattr(launcher, "visible_gpus", lambda: gpus)
    monkeypatch.setattr(launcher, "check_world", lambda asked: pytest.fail("a dry run checks no GPU"))
    monkeypatch.setattr(launcher, "spawn", lambda *a, **k: pytest.fail("a dry run launches nothing"))


def test_bench_tp_dry_run_without_a_gpu(monkeypatch, tmp_path):
    _no_gpu_no_launch(monkeypatch)
    out = tmp_path / "sub" / "r.jsonl"
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", "--op", "ag_gemm", "--dry-run",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert "2 GEMMs x 5 implementations" in text and "1 rank(s) (no CUDA GPU visible here; --tp N plans for N)" in text
    assert "ag_gemm  llama3-8b  qkv    4096  4096  6144   4096" in text and "fc1" in text and "fc2" not in text
    assert "nccl+cublas (baseline)  available" in text
    assert "fixed-role              unavailable: no communication at world size 1" in text
    assert f"would be appended to {out}" in text and "nothing was launched or written" in text
    assert not out.parent.exists()


def test_bench_tp_dry_run_plans_for_the_asked_world(monkeypatch):
    """--tp 8 on a machine without GPUs: the points and availability of an 8-rank run."""
    _no_gpu_no_launch(monkeypatch)
    r = runner.invoke(app, ["bench", "tp", "--shape", "16384x1024x8192", "--op", "gemm_rs", "--tp", "8",
                            "--impl", "kosmos,fixed-role", "--config", "push_partials=true", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "8 rank(s) (--tp 8)" in r.stdout and "gemm_rs  custom  custom  16384  16384  1024  8192" in r.stdout
    assert "fixed-role  available" in r.stdout and "gemm_rs push_partials=True" in r.stdout


def test_bench_tp_dry_run_with_gpus_plans_for_all_of_them(monkeypatch):
    _no_gpu_no_launch(monkeypatch, gpus=4)
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-70b", "--seq", "8192", "--dry-run"])
    assert r.exit_code == 0 and "4 rank(s) (every visible GPU (4))" in r.stdout, r.output
    assert "qkv       8192  8192  2560   8192" in r.stdout  # N = 10240 / 4


def test_bench_moe_dry_run_shows_availability(monkeypatch, tmp_path):
    import importlib.util
    _no_gpu_no_launch(monkeypatch)
    out = tmp_path / "new" / "m.jsonl"
    r = runner.invoke(app, ["bench", "moe", "--model", "qwen3-235b", "--tokens", "4096,8192", "--routing", "uniform",
                            "--ep", "8", "--dry-run", "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert "2 points (moe_experts + moe_fwd) x 7 implementations" in text and "EP=8 rank(s) (--ep 8)" in text
    assert "qwen3-235b  4096         uniform  128  16      8      4096  1536  softmax" in text
    assert "implementations (moe_experts):" in text and "grouped-mm (baseline)  available" in text
    deepep = [line for line in text.splitlines() if line.strip().startswith("deepep ")]
    if importlib.util.find_spec("deep_ep") is None:
        assert deepep and "unavailable: deep_ep is not importable" in deepep[0]
    assert not out.parent.exists()


def test_bench_moe_dry_run_custom_model(monkeypatch):
    _no_gpu_no_launch(monkeypatch)
    r = runner.invoke(app, ["bench", "moe", "--hidden", "2048", "--ffn", "512", "--experts", "64", "--top-k", "6",
                            "--routing-kind", "sigmoid-grouped", "--n-group", "8", "--topk-group", "2", "--ep", "2",
                            "--tokens", "256", "--no-expert-gemms", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "2 points (moe_fwd) x 5 implementations" in r.stdout
    assert "custom  256          uniform   64  32      6      2048  512  sigmoid-grouped 8/2 groups" in r.stdout


def test_custom_moe_point_runs_on_the_rank_side(monkeypatch):
    """A custom case, as the ranks get it (a dict), through moe.run_case on CPU (kernels stood in for by the
    reference math): every row carries the custom model's numbers."""
    from dataclasses import asdict

    from kosmos.models import custom_moe_model
    from kosmos.reference.moe import _experts_forward, moe_forward_a2a
    from kosmos_bench import moe, timing

    def layer(x, wr, w13, w2, *, top_k, group, config, policy, comm_programs, **route):
        return moe_forward_a2a(x, wr, w13, w2, top_k=top_k, fp32=False, **route)

    def time_op(fn, **kw):
        fn()
        return dict(time_ms=1.0, p20_ms=1.0, p80_ms=1.0, samples=1, host_ms=0.1)

    monkeypatch.setattr(timing, "time_op", time_op)
    monkeypatch.setattr(moe, "moe_forward", layer)
    monkeypatch.setattr(moe, "expert_gemms", lambda x, c, w13, w2, *, config: _experts_forward(x, c, w13, w2,
                                                                                               fp32=False))
    m = custom_moe_model(64, 32, 8, 2, "sigmoid-grouped", n_group=4, topk_group=2, routed_scaling=2.5, ep=1)
    (case,) = moe.moe_cases([m], [48], ["uniform"], 1)
    case = moe.MoECase(**vars(case))  # the trip through launcher.spawn
    rows = moe.run_case(case, moe.MoESettings(impls=("kosmos", "nccl-a2a")), device="cpu")
    assert [(r["op"], r["impl"], r["status"]) for r in rows] == [
        ("moe_experts", "grouped-mm", "ok"), ("moe_experts", "kosmos-expert-gemms", "ok"),
        ("moe_fwd", "kosmos", "ok"), ("moe_fwd", "nccl-a2a", "ok")]
    for r in rows:
        assert (r["model"], r["hidden"], r["expert_ffn"], r["experts"], r["top_k"]) == ("custom", 64, 32, 8, 2)
        assert (r["extra"]["router"], r["extra"]["n_group"], r["extra"]["routed_scaling"]) == \
            ("sigmoid-grouped", 4, 2.5)
    assert case.custom == asdict(m)


@pytest.mark.gpu
@pytest.mark.slow
def test_bench_tp_bf16_and_mxfp8_end_to_end(tmp_path):
    """`bench tp --dtype bf16,mxfp8` at W=1 on one GPU: every row ok (unavailable only where a world of 1 or the
    dtype rules the implementation out), both dtypes in one file, the mxfp8 fields recorded."""
    import json
    out = tmp_path / "mx.jsonl"
    r = runner.invoke(app, ["bench", "tp", "--shape", "256x256x256", "--op", "ag_gemm,gemm_rs", "--tp", "1",
                            "--dtype", "bf16,mxfp8", "--iters", "2", "--warmup", "1", "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines() if '"result"' in line]
    rows = [row for row in rows if row["type"] == "result"]
    ran = [row for row in rows if row["status"] != "unavailable"]
    assert {row["dtype"] for row in rows} == {"bf16", "mxfp8"}
    assert all(row["status"] == "ok" for row in ran), [(r["impl"], r["dtype"], r["reason"]) for r in ran
                                                       if r["status"] != "ok"]
    for op in ("ag_gemm", "gemm_rs"):
        mx = {row["impl"] for row in ran if row["dtype"] == "mxfp8" and row["op"] == op}
        assert mx == {"kosmos", "nccl+cublas", "triton-dot-scaled", "fp8-rowwise"}, mx
        assert {row["impl"] for row in ran if row["dtype"] == "bf16" and row["op"] == op} == {"kosmos", "nccl+cublas"}
    for row in ran:
        assert row["wire_bytes"] == 0 and row["t_gemm_ms"] > 0
        if row["dtype"] == "mxfp8":
            assert 0 < row["rel_err_bf16"] < 5e-2
    rep = runner.invoke(app, ["report", str(out)])
    assert rep.exit_code == 0 and "mxfp8 / bf16" in rep.output, rep.output


@pytest.mark.gpu
@pytest.mark.slow
def test_bench_moe_bf16_and_mxfp8_end_to_end(tmp_path):
    """`bench moe --dtype bf16,mxfp8` at EP=1 on one GPU: every kosmos and nccl-a2a row ok at both dtypes, the
    expert GEMMs alone at bf16 only, the mxfp8 fields recorded, the report's "mxfp8 / bf16" section."""
    import json
    out = tmp_path / "moe-mx.jsonl"
    r = runner.invoke(app, [*MOE_TINY, "--ep", "1", "--dtype", "bf16,mxfp8", "--iters", "2", "--warmup", "1",
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    rows = [row for row in rows if row["type"] == "result"]
    assert {row["dtype"] for row in rows} == {"bf16", "mxfp8"}
    routings = {row["routing"] for row in rows if row["op"] == "moe_fwd"}
    assert routings  # a custom layer runs at every routing of the suite (uniform and zipf: one row each)
    for dtype in ("bf16", "mxfp8"):
        for impl in ("kosmos", "nccl-a2a"):
            for routing in routings:
                row, = [x for x in rows if x["op"] == "moe_fwd" and x["impl"] == impl and x["dtype"] == dtype
                        and x["routing"] == routing]
                assert row["status"] == "ok", (impl, dtype, routing, row["reason"])
                assert row["wire_bytes"] == 0 and row["t_gemm_ms"] > 0
                if dtype == "mxfp8":  # three MX roundings (x, the weights, h): 0.066 for both implementations
                    assert 1e-2 < row["rel_err_bf16"] < 1e-1  # at every point of the MoE suite (one H200)
    assert {row["dtype"] for row in rows if row["op"] == "moe_experts"} == {"bf16"}
    rep = runner.invoke(app, ["report", str(out)])
    assert rep.exit_code == 0 and "mxfp8 / bf16" in rep.output, rep.output


def test_mxfp8_needs_k_and_moe_sizes_in_mx_blocks():
    """--dtype mxfp8 on a shape whose K (or an MoE layer whose hidden / ffn) is not a multiple of 32: one line,
    exit 2, before anything runs."""
    r = runner.invoke(app, ["bench", "tp", "--shape", "256x256x48", "--op", "ag_gemm", "--tp", "1", "--dtype",
                            "bf16,mxfp8", "--dry-run"])
    assert r.exit_code == 2 and "K=48" in r.output and "multiple of 32" in r.output
    r = runner.invoke(app, ["bench", "moe", "--hidden", "48", "--ffn", "32", "--experts", "4", "--top-k", "2",
                            "--ep", "1", "--tokens", "64", "--dtype", "mxfp8", "--dry-run"])
    assert r.exit_code == 2 and "hidden=48" in r.output
    r = runner.invoke(app, ["bench", "tp", "--shape", "256x256x64", "--op", "ag_gemm", "--tp", "1", "--dtype",
                            "mxfp8", "--dry-run"])
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("value", ["sideways", "fwd,back", ","])
def test_bench_moe_bad_direction_is_one_line(value):
    r = runner.invoke(app, [*MOE_TINY, "--ep", "1", "--direction", value, "--dry-run"])
    assert r.exit_code == 2, r.output
    assert "--direction" in r.output and "fwd, bwd, fwd+bwd" in r.output
    assert len([line for line in r.output.splitlines() if line.strip()]) == 1, r.output


def test_bench_moe_dry_run_lists_implementations_per_direction():
    import importlib.util
    r = runner.invoke(app, [*MOE_TINY, "--ep", "1", "--direction", "fwd,bwd,fwd+bwd", "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "direction: fwd, bwd, fwd+bwd" in r.output and "over 3 directions" in r.output
    assert "implementations (moe_experts, fwd):" in r.output and "implementations (moe_experts, bwd):" in r.output
    assert "(moe_experts, fwd+bwd)" not in r.output  # the backward's expert GEMMs alone: at bwd only
    fwd, rest = r.output.split("implementations (moe_fwd, fwd):")[1].split("implementations (moe_fwd, bwd):")
    bwd, both = rest.split("implementations (moe_fwd, fwd+bwd):")
    for part in (bwd, both):
        assert "kosmos               available" in part and "nccl-a2a (baseline)  available" in part
        deepep = [line for line in part.splitlines() if line.strip().startswith("deepep ")]
        if importlib.util.find_spec("deep_ep") is None:  # the backward's reasons are the forward's (EP = 1 here)
            assert deepep and "unavailable: deep_ep is not importable" in deepep[0], part
        assert "fixed-role" in part and "unavailable: no communication at world size 1" in part, part
    r = runner.invoke(app, [*MOE_TINY, "--ep", "2", "--direction", "bwd", "--dry-run"])
    assert r.exit_code == 0, r.output  # W > 1: checked by the distributed fp32 reference
    assert "kosmos               available" in r.output and "nccl-a2a (baseline)  available" in r.output, r.output
    assert "implementations (moe_fwd):" in r.output  # one dtype, one direction: the family alone
    r = runner.invoke(app, [*MOE_TINY, "--ep", "1", "--direction", "bwd", "--dtype", "bf16,mxfp8", "--dry-run"])
    assert r.exit_code == 0 and "no MXFP8 backward" not in r.output, r.output  # the MX backward exists
    assert "no MXFP8 path in the deepep baseline" in r.output, r.output


def test_bench_moe_suite_direction_list(tmp_path):
    path = tmp_path / "moe-dir.yaml"
    path.write_text("bench: moe\nmodels: [mixtral-8x7b]\ntokens: [128]\nrouting: [uniform]\ndirection: [fwd, bwd]\n")
    r = runner.invoke(app, ["bench", "moe", "--suite", str(path), "--ep", "1", "--dry-run"])
    assert r.exit_code == 0 and "direction: fwd, bwd" in r.output, r.output
    r = runner.invoke(app, ["bench", "moe", "--suite", str(path), "--ep", "1", "--direction", "fwd+bwd", "--dry-run"])
    assert r.exit_code == 0 and "direction: fwd+bwd" in r.output, r.output


def test_bench_cuda_graph_reaches_the_ranks_and_the_plan(monkeypatch, tmp_path):
    """--cuda-graph: the suite the ranks get (and the env line records) says cuda_graph; the dry run says so."""
    from kosmos_bench import moe, tp
    seen = _capture_spawn(monkeypatch)
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", "--cuda-graph", "--out",
                            str(tmp_path / "r.jsonl")])
    assert r.exit_code == 0, r.output
    assert seen["fn"] is tp.bench_rank and seen["args"][0]["cuda_graph"] is True
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", "--out", str(tmp_path / "s.jsonl")])
    assert r.exit_code == 0 and "cuda_graph" not in seen["args"][0]
    r = runner.invoke(app, ["bench", "moe", "--model", "qwen3-235b", "--tokens", "64", "--cuda-graph", "--out",
                            str(tmp_path / "m.jsonl")])
    assert r.exit_code == 0, r.output
    assert seen["fn"] is moe.bench_rank and seen["args"][0]["cuda_graph"] is True
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", "--cuda-graph", "--dry-run"])
    assert r.exit_code == 0 and "CUDA graph replays" in " ".join(r.output.split()), r.output


# --------------------------------------------------------------------------- the host enqueue measurement


@pytest.mark.parametrize("args, needle", [
    (["--host-calls", "-1"], "--host-calls -1: give a number of calls >= 0"),
    (["--host-shape", "128x256"], "--host-shape 128x256: not MxNxK"),
    (["--host-shape", "axbxc"], "--host-shape axbxc: not MxNxK"),
    (["--host-shape", "128x250x256"], "--host-shape 128x250x256: N=250 must be a multiple of 8"),
    (["--host-shape", "100x256x256", "--tp", "8"], "--host-shape 100x256x256: M=100 must divide by the world size 8"),
    (["--host-shape", "128x256x200", "--dtype", "mxfp8", "--tp", "1"], "--dtype mxfp8 needs K to be a multiple of 32"),
])
def test_bench_tp_host_option_errors(monkeypatch, args, needle):
    """One line naming the option, before anything launches, with or without --dry-run."""
    from kosmos_bench import launcher
    monkeypatch.setattr(launcher, "check_world", lambda asked: asked or 1)
    monkeypatch.setattr(launcher, "spawn", lambda *a, **k: pytest.fail("must not launch"))
    for dry in ([], ["--dry-run"]):
        _one_line_error(runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", *args, *dry]),
                        needle)


def test_bench_tp_host_options_reach_the_ranks_and_the_plan(monkeypatch, tmp_path):
    """The suite the ranks get (and the env line records) holds host_calls and host_shape (defaults: 200 calls at
    the one-tile 128x256x256, tp.HOST_SHAPE); the dry run says what the measurement will do, or that it is off."""
    from kosmos_bench import cli, tp
    assert (cli.TP_HOST_SHAPE, cli.TP_HOST_CALLS) == (tp.HOST_SHAPE, tp.HOST_CALLS)
    seen = _capture_spawn(monkeypatch)
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", "--out", str(tmp_path / "r.jsonl")])
    assert r.exit_code == 0, r.output
    assert (seen["args"][0]["host_calls"], seen["args"][0]["host_shape"]) == (200, [128, 256, 256])
    r = runner.invoke(app, ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", "--host-shape", "256x512x512",
                            "--host-calls", "50", "--out", str(tmp_path / "s.jsonl")])
    assert r.exit_code == 0 and (seen["args"][0]["host_calls"], seen["args"][0]["host_shape"]) == (50, [256, 512, 512])
    r = runner.invoke(app, ["bench", "tp", "--shape", "256x256x256", "--op", "ag_gemm,gemm_rs", "--tp", "1",
                            "--impl", "kosmos,nccl+cublas", "--dry-run"])
    text = " ".join(r.output.split())
    assert r.exit_code == 0 and "host enqueue: 200 back-to-back eager calls after 1 s of warm-up, at 128x256x256 " \
        "(ag_gemm, gemm_rs)" in text and ": 4 host rows" in text, text
    r = runner.invoke(app, ["bench", "tp", "--tp", "1", "--host-calls", "0", "--dry-run"])
    assert r.exit_code == 0 and "host enqueue: off (--host-calls 0)" in r.output


# --------------------------------------------------------------------------- world sizes, --out, failed rows, help


@pytest.mark.parametrize("args, needle", [
    (["tp", "--tp", "16"], "--tp 16: give 1 to 8 ranks"),
    (["tp", "--tp", "9", "--shape", "9216x1024x1024", "--op", "ag_gemm"], "--tp 9: give 1 to 8 ranks"),
    (["tp", "--tp", "0"], "--tp 0: give 1 to 8 ranks"),
    (["moe", "--ep", "16"], "--ep 16: give 1 to 8 ranks"),
    (["moe", "--ep", "16", "--hidden", "256", "--ffn", "128", "--experts", "32", "--top-k", "2"],
     "--ep 16: give 1 to 8 ranks"),
])
def test_world_sizes_above_one_node_are_refused(monkeypatch, args, needle):
    """More than one node's 8 ranks: one line naming the option, dry run included."""
    _no_gpu_no_launch(monkeypatch)
    for dry in (["--dry-run"], []):
        _one_line_error(runner.invoke(app, ["bench", *args, *dry]), needle)


def test_suite_world_size_above_one_node_is_refused(tmp_path):
    from kosmos_bench.suites import SuiteError, TPSuite
    with pytest.raises(SuiteError, match="'tp' must be 1 to 8 ranks"):
        TPSuite(tp=16)


@pytest.mark.parametrize("bench", ["tp", "moe", "train"])
def test_out_is_checked_in_a_dry_run(monkeypatch, tmp_path, bench):
    """--out that cannot be written: one line naming --out in a dry run too; a writable one is left untouched."""
    _no_gpu_no_launch(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for out, needle in [("/proc/nope/x.jsonl", "--out /proc/nope/x.jsonl: cannot create files in /proc"),
                        (str(tmp_path), f"--out {tmp_path}: a folder; give a file path"),
                        (str(blocker / "x.jsonl"), f"--out {blocker / 'x.jsonl'}: {blocker} is a file, not a folder")]:
        _one_line_error(runner.invoke(app, ["bench", bench, "--out", out, "--dry-run"]), needle)
    r = runner.invoke(app, ["bench", bench, "--out", str(tmp_path / "new" / "r.jsonl"), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and blocker.read_text() == "x"


def test_bench_tp_world_size_errors_name_the_option_given(monkeypatch):
    """--tp 3 is answered about --tp (the models' shapes, or the default host shape), never about --host-shape,
    which the user did not give."""
    _no_gpu_no_launch(monkeypatch)
    _one_line_error(runner.invoke(app, ["bench", "tp", "--tp", "3", "--dry-run"]),
                    "--tp 3: seq=4096 must divide by tp=3")
    r = runner.invoke(app, ["bench", "tp", "--tp", "6", "--shape", "768x1024x1024", "--op", "ag_gemm", "--dry-run"])
    _one_line_error(r, "--tp 6: the host enqueue measurement's default shape 128x256x256 does not fit")
    assert "give --host-shape, e.g. 768x256x256, or --host-calls 0" in r.stderr
    r = runner.invoke(app, ["bench", "tp", "--tp", "6", "--shape", "768x1024x1024", "--op", "ag_gemm",
                            "--host-calls", "0", "--dry-run"])
    assert r.exit_code == 0 and "host enqueue: off" in r.stdout, r.output


def _fake_run(monkeypatch, rows_of_runs):
    """A launch that appends, for each run of ``rows_of_runs`` in turn, an env line and those rows to --out."""
    import json
    from kosmos_bench import launcher
    runs = iter(rows_of_runs)

    def spawn(fn, world, suite, cases, out, *rest):
        run_id = f"run-{id(suite)}"
        with open(out, "a") as f:
            f.write(json.dumps({"type": "env", "run_id": run_id}) + "\n")
            for row in next(runs):
                f.write(json.dumps({"type": "result", "run_id": run_id, **row}) + "\n")
    monkeypatch.setattr(launcher, "check_world", lambda asked: 1)
    monkeypatch.setattr(launcher, "spawn", spawn)
    monkeypatch.setattr("kosmos_bench.report.load_records", lambda files: Records([], [], []))
    monkeypatch.setattr("kosmos_bench.report.print_terminal", lambda *a, **k: None)


def test_failed_rows_fail_the_run_with_a_one_line_summary(monkeypatch, tmp_path):
    """A run whose rows include failed ones exits 1 with one line naming the implementations, after the table;
    unavailable rows fail nothing, and only this run's rows count (the file is appended to)."""
    failed = [{"impl": "kosmos", "status": "failed", "reason": "rel_err 1.0e+00 > 1e-02"},
              {"impl": "kosmos", "status": "failed", "reason": "RuntimeError: boom"},
              {"impl": "nccl+cublas", "status": "ok"}, {"impl": "torch-async-tp", "status": "unavailable"}]
    clean = [{"impl": "kosmos", "status": "ok"}, {"impl": "fixed-role", "status": "unavailable"}]
    _fake_run(monkeypatch, [failed, clean])
    out = tmp_path / "r.jsonl"
    args = ["bench", "tp", "--model", "llama3-8b", "--seq", "4096", "--tp", "1", "--out", str(out)]
    r = runner.invoke(app, args)
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().splitlines()[-1] == (f"error: 2 of 4 rows failed (kosmos: 2); their reasons are in the "
                                                 f"rows of {out}"), r.stderr
    r = runner.invoke(app, args)  # appended to the same file: the earlier run's failures are not this run's
    assert r.exit_code == 0, r.output


def test_help_has_no_bool_metavars_and_reflowed_text():
    """No `<bool>` beside flags; --iters/--warmup say their default; each command's help paragraphs hold no hard
    line breaks (typer would keep them: ragged lines), and the help fits 100 columns."""
    import typer.main
    root = typer.main.get_command(app)
    commands = [(["bench", name], cmd) for name, cmd in root.commands["bench"].commands.items()]
    commands += [([name], cmd) for name, cmd in root.commands.items() if name != "bench"]
    assert {" ".join(p) for p, _ in commands} == {"bench tp", "bench moe", "bench train", "report", "env"}

    def help_of(path):
        r = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "100"})
        assert r.exit_code == 0 and "<bool>" not in r.output, r.output
        assert max(len(line) for line in r.output.splitlines()) == 100, r.output
        return r.output
    for path, cmd in commands:
        assert all("\n" not in p for p in (cmd.help or "").split("\n\n")), (path, cmd.help)
        # the text above the option tables: a line followed by more of its paragraph fills the width (not ragged)
        lines = [line.rstrip() for line in help_of(path).split("╭")[0].splitlines()]
        short = [a for a, b in zip(lines, lines[1:]) if a and b and len(a) < 60]
        assert not short, (path, short)
    for path in ([], ["bench"]):
        help_of(path)
    for bench in ("tp", "moe"):
        text = " ".join(help_of(["bench", bench]).replace("│", " ").split())
        assert f"default: the suite's, 20 in {bench}-default" in text and f"the suite's, 5 in {bench}-default" in text


def test_report_timeline_without_out_writes_in_the_current_folder(monkeypatch, tmp_path):
    """`report --timeline TRACE` without --out: the PNG goes to the current folder (and says so), never beside the
    trace (the committed results/)."""
    pytest.importorskip("matplotlib")
    import shutil
    traces = tmp_path / "results" / "traces"
    traces.mkdir(parents=True)
    trace = traces / "trace-sample.json"
    shutil.copy(Path(__file__).parent / "fixtures" / "trace-sample.json", trace)
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    r = runner.invoke(app, ["report", "--timeline", str(trace)])
    assert r.exit_code == 0, r.output
    assert [p.name for p in traces.iterdir()] == ["trace-sample.json"]
    assert [p.name for p in here.iterdir()] == ["trace-sample.png"]
    assert f"timeline written to {here / 'trace-sample.png'}" in " ".join(r.stderr.split())
