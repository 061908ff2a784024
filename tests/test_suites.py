"""Suite loading: the default suite, overrides, and clear errors for malformed files."""
import pytest

from kosmos_bench.suites import (DEFAULT_MOE_SUITE, DEFAULT_SUITE, TARGET_KEYS, MoESuite, SuiteError, TPSuite,
                                 check_targets, default_moe_suite, default_suite, load_suite)


def test_default_suite_file_loads():
    s = load_suite(DEFAULT_SUITE)
    assert s.bench == "tp" and "llama3-70b" in s.models and s.seq == (4096, 8192, 16384)
    assert set(s.fixed_sweep) >= {8, 16, 24, 32, 48, 64}
    assert default_suite() == s


def test_override_keeps_unset_fields():
    s = TPSuite().override(models=("llama3-8b",), seq=None, iters=3)
    assert s.models == ("llama3-8b",) and s.seq == TPSuite().seq and s.iters == 3


@pytest.mark.parametrize("text, needle", [
    ("models: [llama9-1t]\n", "unknown models"),
    ("seq: [4096, -1]\n", "positive integers"),
    ("impls: [kosmos, magic]\n", "unknown impls"),
    ("iters: 0\n", "iters"),
    ("colour: blue\n", "unknown key"),
    ("- just\n- a list\n", "mapping"),
    ("models: [llama3-8b\n", "not valid YAML"),
    ("dtype: fp4\n", "unknown dtype"),
    ("layers: [qkv, mlp]\n", "unknown layers"),
])
def test_malformed_suite_gives_clear_error(tmp_path, text, needle):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(SuiteError, match=needle) as e:
        load_suite(p)
    assert str(p) in str(e.value)


def test_missing_suite_file(tmp_path):
    with pytest.raises(SuiteError, match="does not exist"):
        load_suite(tmp_path / "nope.yaml")


def test_default_moe_suite_file_loads():
    s = load_suite(DEFAULT_MOE_SUITE, bench="moe")
    assert isinstance(s, MoESuite) and s.models == ("deepseek-v3", "qwen3-235b")
    assert s.tokens == (4096, 8192, 16384) and s.routing == ("uniform", "zipf:1.2")
    assert s.impls == ("kosmos", "nccl-a2a", "deepep", "fixed-role", "fixed-role-best")
    assert s.expert_gemms is True and default_moe_suite() == s
    assert load_suite(DEFAULT_MOE_SUITE, bench=None) == s


def test_moe_override_and_canonical_routing():
    s = MoESuite().override(models=("mixtral-8x7b",), routing=("ZIPF:1.50", "uniform"), ep=None, iters=3)
    assert s.models == ("mixtral-8x7b",) and s.routing == ("zipf:1.5", "uniform") and s.iters == 3
    assert s.tokens == MoESuite().tokens
    assert s.to_dict()["routing"] == ["zipf:1.5", "uniform"]


@pytest.mark.parametrize("text, needle", [
    ("models: [grok-9]\n", "unknown models"),
    ("tokens: [4096, 0]\n", "positive integers"),
    ("tokens: 4096.5\n", "must be a list"),
    ("routing: [uniform, zipf]\n", "zipf needs an exponent"),
    ("routing: [zipf:abc]\n", "not a number"),
    ("routing: ['zipf:0']\n", "> 0"),
    ("routing: [uniform, zipf: 1.2]\n", "must be a string"),
    ("routing: []\n", "must not be empty"),
    ("routing: [skewed]\n", "unknown routing"),
    ("impls: [kosmos, megablocks]\n", "unknown impls"),
    ("ep: 3\n", "do not split evenly over ep=3"),
    ("ep: 0\n", "'ep' must be a positive integer"),
    ("expert_gemms: maybe\n", "expert_gemms"),
    ("seq: [4096]\n", "unknown key"),
    ("dtype: fp4\n", "unknown dtype"),
    ("iters: 0\n", "iters"),
    ("seed: -1\n", "seed"),
    ("models: [deepseek-v3\n", "not valid YAML"),
])
def test_malformed_moe_suite_gives_clear_error(tmp_path, text, needle):
    p = tmp_path / "bad-moe.yaml"
    p.write_text("bench: moe\n" + text)
    with pytest.raises(SuiteError, match=needle) as e:
        load_suite(p, bench="moe")
    assert str(p) in str(e.value)


def test_suite_of_the_wrong_bench(tmp_path):
    with pytest.raises(SuiteError, match="is a 'tp' suite"):
        load_suite(DEFAULT_SUITE, bench="moe")
    with pytest.raises(SuiteError, match="is a 'moe' suite"):
        load_suite(DEFAULT_MOE_SUITE)  # the default is a TP suite (as `kosmos bench tp` loads it)
    p = tmp_path / "other.yaml"
    p.write_text("bench: pp\n")
    with pytest.raises(SuiteError, match="unknown bench 'pp'"):
        load_suite(p, bench=None)


def test_default_suites_carry_their_targets():
    """The project's bars are suite data; they travel with the suite into every results file's env line."""
    tp, moe = default_suite(), default_moe_suite()
    # the default suite's bars are those of communication overlap; the world-1 cuBLAS bars are the grid suite's
    assert set(tp.targets) == set(TARGET_KEYS["tp"]) - {"vs_cublas_geomean", "vs_cublas_floor"}
    assert tp.targets["slower_tolerance"] == 0.03
    assert set(moe.targets) == {"slower_tolerance", "expert_gemm_share"} and moe.targets["expert_gemm_share"] == 0.8
    assert tp.to_dict()["targets"] == tp.targets and moe.override(iters=3).targets == moe.targets
    assert TPSuite().targets == {} and MoESuite().targets == {}


@pytest.mark.parametrize("bench, text, needle", [
    ("tp", "targets: {fast: 1.2}\n", "unknown target 'fast' in 'targets'"),
    ("tp", "targets: {expert_gemm_share: 0.8}\n", "unknown target 'expert_gemm_share'"),
    ("tp", "targets: {geomean_speedup: fast}\n", "'targets.geomean_speedup' must be a number"),
    ("tp", "targets: {slower_tolerance: '3%'}\n", "'targets.slower_tolerance' must be a number"),
    ("tp", "targets: {slower_tolerance: true}\n", "'targets.slower_tolerance' must be a number"),
    ("tp", "targets: {geomean_speedup: [1.15]}\n", "'targets.geomean_speedup' must be a number"),
    ("tp", "targets: {geomean_speedup: .nan}\n", "'targets.geomean_speedup' must be a number"),
    ("tp", "targets: {geomean_overlap_efficiency: -0.9}\n", "'targets.geomean_overlap_efficiency'"),
    ("tp", "targets: [slower_tolerance, 0.03]\n", "'targets' must be a mapping"),
    ("moe", "targets: {expert_gemm_share: 80%}\n", "'targets.expert_gemm_share' must be a number"),
    ("moe", "targets:\n  slower_tolerance: 0.03\n  bar: 2\n", "unknown target 'bar'"),
])
def test_malformed_targets_give_a_one_line_error(tmp_path, bench, text, needle):
    p = tmp_path / "targets.yaml"
    p.write_text(f"bench: {bench}\n" + text)
    with pytest.raises(SuiteError, match=needle) as e:
        load_suite(p, bench=bench)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_targets_are_checked_on_construction():
    with pytest.raises(SuiteError, match="'targets.slower_tolerance' must be a number"):
        TPSuite(targets={"slower_tolerance": "3%"})
    with pytest.raises(SuiteError, match="unknown target 'geomean'"):
        MoESuite().override(targets={"geomean": 1.6})
    assert MoESuite(targets={"geomean_speedup": 1.6}).targets == {"geomean_speedup": 1.6}


def test_targets_read_from_a_suite_file_alone(tmp_path):
    """The report reads a suite file's targets without building the suite (no torch): the same mapping and the same
    check as load_suite's."""
    from kosmos_bench.report import suite_targets

    assert suite_targets.suite_file_targets(DEFAULT_SUITE, "tp") == default_suite().targets
    assert suite_targets.suite_file_targets(DEFAULT_MOE_SUITE, "moe") == default_moe_suite().targets
    assert TARGET_KEYS is suite_targets.TARGET_KEYS
    assert suite_targets.suite_file_targets(tmp_path / "none.yaml", "tp") == {} == TPSuite().targets
    p = tmp_path / "bare.yaml"
    p.write_text("name: bare\n")
    assert suite_targets.suite_file_targets(p, "tp") == {} == load_suite(p).targets
    for text, needle in (("targets: {fast: 1.2}\n", "unknown target 'fast'"), ("- a\n", "mapping"),
                         ("targets: {x: [1\n", "not valid YAML"), ("bench: moe\n", "is a 'moe' suite")):
        p.write_text(text)
        with pytest.raises(suite_targets.TargetsError, match=needle) as e:
            suite_targets.suite_file_targets(p, "tp")
        assert str(p) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SuiteError, match="unknown target 'fast'"):  # suites' check is the same, as a SuiteError
        check_targets("tp", {"fast": 1.2})


def test_unreadable_suite_files_give_a_one_line_error_with_the_path(tmp_path):
    """A binary file names its path (not a bare codec error); YAML's multi-line messages are folded to one line."""
    p = tmp_path / "binary.yaml"
    p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    with pytest.raises(SuiteError, match="not a text .UTF-8. YAML file") as e:
        load_suite(p)
    assert str(e.value).startswith(str(p)) and "\n" not in str(e.value)
    p.write_text("models: [llama3-8b\nseq: 4096\n")
    with pytest.raises(SuiteError, match="not valid YAML") as e:
        load_suite(p)
    assert str(p) in str(e.value) and "\n" not in str(e.value)


def test_default_suites_are_package_data():
    """The default suites live inside the package (an installed wheel has them); the repository's suites/ is a link
    to that folder, so `--suite suites/tp-default.yaml` keeps working from a checkout."""
    from pathlib import Path

    import kosmos_bench
    from kosmos_bench.package_data import DEFAULT_SUITE_FILES, SUITES_DIR
    package = Path(kosmos_bench.__file__).resolve().parent
    assert SUITES_DIR == package / "suite_files" and DEFAULT_SUITE == DEFAULT_SUITE_FILES["tp"]
    assert DEFAULT_SUITE.is_file() and DEFAULT_MOE_SUITE.is_file() and DEFAULT_SUITE.parent == SUITES_DIR
    repo_suites = package.parent / "suites"
    if repo_suites.exists():  # a checkout (not an installed package)
        assert repo_suites.is_symlink() and repo_suites.resolve() == SUITES_DIR
        assert load_suite(repo_suites / "tp-default.yaml") == default_suite()


def test_tp_suite_dtype_may_be_a_list(tmp_path):
    from kosmos_bench.suites import TPSuite, load_suite
    path = tmp_path / "mx.yaml"
    path.write_text("bench: tp\ndtype: [bf16, mxfp8, bf16]\n")
    assert load_suite(path).dtype == ("bf16", "mxfp8")
    path.write_text("bench: tp\ndtype: mxfp8\n")
    assert load_suite(path).dtype == ("mxfp8",) and TPSuite().dtype == ("bf16",)
    assert TPSuite().override(dtype=("mxfp8", "bf16")).to_dict()["dtype"] == ["mxfp8", "bf16"]
    path.write_text("bench: tp\ndtype: [bf16, fp4]\n")
    with pytest.raises(SuiteError, match=r"unknown dtype \['fp4'\]"):
        load_suite(path)


def test_moe_suite_direction_list(tmp_path):
    from kosmos_bench.suites import MoESuite
    assert MoESuite().direction == ("fwd",)
    path = tmp_path / "d.yaml"
    path.write_text("bench: moe\nmodels: [mixtral-8x7b]\ndirection: [fwd, bwd, fwd+bwd, bwd]\n")
    assert load_suite(path, bench="moe").direction == ("fwd", "bwd", "fwd+bwd")
    path.write_text("bench: moe\nmodels: [mixtral-8x7b]\ndirection: bwd\n")
    assert load_suite(path, bench="moe").direction == ("bwd",)
    path.write_text("bench: moe\nmodels: [mixtral-8x7b]\ndirection: [fwd, backwards]\n")
    with pytest.raises(SuiteError, match="unknown direction"):
        load_suite(path, bench="moe")
    path.write_text("bench: moe\nmodels: [mixtral-8x7b]\ndirection: 3\n")
    with pytest.raises(SuiteError, match="'direction' must be a name or a list"):
        load_suite(path, bench="moe")


# --------------------------------------------------------------------------- suites that list their GEMMs (shapes)

GRID_SUITE = DEFAULT_SUITE.parent / "tp-grid.yaml"
# issue 13's public grid: the sets its GEMMs are drawn from
GRID_M = (256, 512, 1024, 2048, 3000, 4096, 6000, 8192, 16384)
GRID_K = (1024, 2048, 2880, 4096, 5120, 7168, 8192, 14336)
GRID_N = (1536, 3072, 4096, 5120, 6144, 6912, 8192, 14336, 28672)


def test_grid_suite_is_issue_13s_grid():
    """>= 40 GEMMs, every one from the issue's sets, each as both TP ops, drawn as the file's header says (five
    cyclic rounds and three corners), the hard cases in it, and its bars against cuBLAS alone."""
    s = load_suite(GRID_SUITE)
    assert s.name == "tp-grid" and s.dtype == ("bf16",) and "kosmos" in s.impls
    by_op = {op: [(m, n, k) for o, m, n, k in s.shapes if o == op] for op in ("ag_gemm", "gemm_rs")}
    assert by_op["ag_gemm"] == by_op["gemm_rs"] and len(s.shapes) == 2 * len(by_op["ag_gemm"])
    grid = by_op["ag_gemm"]
    assert len(grid) >= 40 and len(set(grid)) == len(grid)
    assert all(m in GRID_M and n in GRID_N and k in GRID_K for m, n, k in grid)
    drawn = [(GRID_M[j], GRID_N[(j + 2 * r) % 9], GRID_K[(j + 3 * r) % 8]) for r in range(5) for j in range(9)]
    assert grid == drawn + [(512, 6912, 1024), (3000, 6912, 2880), (6000, 1536, 1024)]
    assert {m for m, _, _ in grid} == set(GRID_M) and {n for _, n, _ in grid} == set(GRID_N)
    assert {k for _, _, k in grid} == set(GRID_K)
    assert any(m in (256, 512) and k == 1024 for m, _, k in grid)  # small M with short K
    assert (3000, 6912, 2880) in grid  # ragged in M, N and K
    assert s.targets == {"vs_cublas_geomean": 0.97, "vs_cublas_floor": 0.90}
    assert s.iters >= 20 and s.warmup >= 5  # the default suite's timing, comparable medians


def test_grid_suite_plans_its_shapes_as_custom_gemms(monkeypatch, tmp_path):
    """`kosmos bench tp --suite suites/tp-grid.yaml --tp 1`: the ranks get the suite's GEMMs as custom points
    (as --shape would give them), the suite as run records them and its targets; --op picks one op."""
    from typer.testing import CliRunner

    from kosmos_bench import launcher
    from kosmos_bench.cli import app
    seen = {}
    monkeypatch.setattr(launcher, "check_world", lambda asked: 1)
    monkeypatch.setattr(launcher, "spawn", lambda fn, world, *a: seen.update(args=a))
    from kosmos_bench.report.load import Records
    monkeypatch.setattr("kosmos_bench.report.load_records", lambda files: Records([], [], []))
    monkeypatch.setattr("kosmos_bench.report.print_terminal", lambda *a, **k: None)
    runner = CliRunner()
    out = str(tmp_path / "grid.jsonl")
    r = runner.invoke(app, ["bench", "tp", "--tp", "1", "--suite", str(GRID_SUITE), "--impl", "kosmos", "--out", out])
    assert r.exit_code == 0, r.output
    suite, cases = seen["args"][0], seen["args"][1]
    s = load_suite(GRID_SUITE)
    assert [(c["op"], c["m"], c["n"], c["k"]) for c in cases] == list(s.shapes)
    assert all(c["model"] == c["layer"] == "custom" and c["seq"] == c["m"] for c in cases)
    assert suite["impls"] == ["kosmos"] and suite["targets"] == s.targets and suite["models"] == ["custom"]
    assert suite["shapes"] == [{"op": o, "m": m, "n": n, "k": k} for o, m, n, k in s.shapes]
    r = runner.invoke(app, ["bench", "tp", "--tp", "1", "--suite", "tp-grid", "--op", "gemm_rs", "--out", out])
    assert r.exit_code == 0, r.output
    assert {c["op"] for c in seen["args"][1]} == {"gemm_rs"} and len(seen["args"][1]) == len(s.shapes) // 2
    for args, needle in ((["--model", "llama3-8b"], "suite tp-grid lists its GEMMs (shapes): drop --model"),
                         (["--op", "qkv"], "--op qkv: suite tp-grid lists its GEMMs (shapes)")):
        r = runner.invoke(app, ["bench", "tp", "--tp", "1", "--suite", "tp-grid", "--dry-run", *args])
        assert r.exit_code == 2 and needle in " ".join(r.output.split()), r.output
    r = runner.invoke(app, ["bench", "tp", "--tp", "1", "--suite", "tp-grid", "--shape", "8192x1024x8192", "--op",
                            "ag_gemm", "--out", out])  # --shape still wins over the suite's shapes
    assert r.exit_code == 0 and len(seen["args"][1]) == 1


def test_suite_shapes_forms_and_the_recorded_form_loads_back(tmp_path):
    p = tmp_path / "shapes.yaml"
    p.write_text("shapes:\n  gemm_rs: [4096x8192x1024, 4096x8192x1024]\n  ag_gemm: ['256x1536x2880']\n")
    s = load_suite(p)
    assert s.shapes == (("gemm_rs", 4096, 8192, 1024), ("ag_gemm", 256, 1536, 2880))  # file order, repeats once
    recorded = s.to_dict()
    assert recorded["shapes"] == [{"op": "gemm_rs", "m": 4096, "n": 8192, "k": 1024},
                                  {"op": "ag_gemm", "m": 256, "n": 1536, "k": 2880}]
    assert TPSuite(shapes=recorded["shapes"]).shapes == s.shapes  # a results file's suite loads back
    assert s.override(iters=3).shapes == s.shapes
    assert "shapes" not in default_suite().to_dict() and TPSuite().shapes == ()  # model suites record as before


@pytest.mark.parametrize("text, needle", [
    ("shapes:\n  ag_gemm: [8192x1024]\n", r"'shapes.ag_gemm\[0\]': '8192x1024': not MxNxK"),
    ("shapes:\n  ag_gemm: [8192x1024x8192, 8192x0x8192]\n", r"'shapes.ag_gemm\[1\]': '8192x0x8192': N=0"),
    ("shapes:\n  ag_gemm: [8192x1020x8192]\n", "N=1020 must be a multiple of 8"),
    ("shapes:\n  ag_gemm: [8192]\n", r"'shapes.ag_gemm\[0\]': 8192 is not a string"),
    ("shapes:\n  fc1: [8192x1024x8192]\n", "'shapes': unknown op 'fc1'; choose from ag_gemm, gemm_rs"),
    ("shapes:\n  ag_gemm: 8192x1024x8192\n", "'shapes.ag_gemm' must be a non-empty list"),
    ("shapes:\n  ag_gemm: []\n", "'shapes.ag_gemm' must be a non-empty list"),
    ("shapes: 8192x1024x8192\n", "'shapes' must be a mapping of op"),
    ("shapes:\n  - {op: ag_gemm, m: 8192, n: 1024}\n", r"'shapes\[0\]': .* must be a mapping with keys op, m, n, k"),
    ("shapes:\n  - {op: rs, m: 8192, n: 1024, k: 64}\n", r"'shapes\[0\]': unknown op 'rs'"),
    ("shapes:\n  - {op: ag_gemm, m: -1, n: 1024, k: 64}\n", r"'shapes\[0\]': M=-1 must be a positive integer"),
    ("models: [llama3-8b]\nshapes:\n  ag_gemm: [8192x1024x8192]\n", "'shapes' gives the GEMMs themselves: drop "
                                                                    "'models'"),
    ("seq: [4096]\nlayers: [qkv]\nshapes:\n  ag_gemm: [8192x1024x8192]\n", "drop 'seq', 'layers'"),
])
def test_malformed_suite_shapes_give_a_one_line_error(tmp_path, text, needle):
    p = tmp_path / "bad-shapes.yaml"
    p.write_text(text)
    with pytest.raises(SuiteError, match=needle) as e:
        load_suite(p)
    assert str(e.value).startswith(str(p)) and "\n" not in str(e.value)


def test_suite_baseline_must_be_one_of_its_impls(tmp_path):
    """A suite's ``baseline`` (the implementation the report's speedups are over) is one of its impls."""
    f = tmp_path / "s.yaml"
    f.write_text("bench: moe\nmodels: [qwen3-235b]\nimpls: [kosmos, nccl-a2a]\nbaseline: hf-grouped-mm\n")
    with pytest.raises(SuiteError, match="'baseline' 'hf-grouped-mm' must be one of the suite's impls"):
        load_suite(f, bench="moe")
    assert load_suite("suites/moe-hf.yaml", bench="moe").baseline == "hf-grouped-mm"
