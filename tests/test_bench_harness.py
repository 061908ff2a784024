"""The bench framework on the CPU: the implementation registry (availability -> "unavailable" rows, unknown names),
``--config`` parsing (registry.parse_config), the check -> agree -> time -> row harness with toy
implementations, and the fixed-split sweep that fixed-role-best runs in both benches."""
from dataclasses import dataclass

import pytest
import torch

from kosmos.config import (AllGatherMatmulConfig, MatmulReduceScatterConfig, MoEBackwardConfig, MoEForwardConfig,
                           config_dict)
from kosmos_bench import harness, moe, registry, timing, tp
from kosmos_bench.harness import Result

FAMILY = "test-toy"


@pytest.fixture
def family():
    yield FAMILY
    registry._IMPLS.pop(FAMILY, None)


@pytest.fixture
def cpu_timer(monkeypatch):
    """time_op stand-in: one call; the time is the callable's ``ms`` attribute (1.0 without one)."""
    def time_op(fn, *, iters=20, warmup=5, **kw):
        fn()
        ms = getattr(fn, "ms", 1.0)
        return {"time_ms": ms, "p20_ms": ms, "p80_ms": ms, "samples": 1, "host_ms": 0.01}
    monkeypatch.setattr(timing, "time_op", time_op)


# --------------------------------------------------------------------------- registry


def test_registry_views_keep_the_names_and_order():
    assert tp.TP_IMPLS == registry.names("tp") == ("kosmos", "nccl+cublas", "torch-async-tp", "fixed-role",
                                                   "fixed-role-best", "triton-dot-scaled", "fp8-rowwise",
                                                   "cublas-fp8-block")
    assert moe.MOE_IMPLS == registry.names("moe_fwd") == ("kosmos", "nccl-a2a", "deepep", "fixed-role",
                                                          "fixed-role-best", "hf-grouped-mm", "hf-eager", "liger")
    assert moe.EXPERT_IMPLS == registry.names("moe_experts") == ("grouped-mm", "kosmos-expert-gemms")
    assert [registry.baseline(f) for f in ("tp", "moe_fwd", "moe_experts")] == ["nccl+cublas", "nccl-a2a",
                                                                                "grouped-mm"]
    for family in ("tp", "moe_fwd"):
        assert registry.get(family, "fixed-role").fixed == "default" and registry.get(family, "fixed-role").kosmos
        assert registry.get(family, "fixed-role-best").fixed == "best"
        assert not registry.get(family, registry.baseline(family)).kosmos


def test_unknown_impl_is_a_one_line_error(family):
    registry.register(family, "a")(lambda inp, params, config: None)
    registry.register(family, "b")(lambda inp, params, config: None)
    with pytest.raises(registry.UnknownImpl) as e:
        registry.get(family, "c")
    assert str(e.value) == f"unknown {family} implementation 'c'; choose from a, b"
    with pytest.raises(registry.UnknownImpl, match="choose from kosmos, nccl-a2a, deepep, fixed-role, "
                                                    "fixed-role-best"):
        registry.get("moe_fwd", "megablocks")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(family, "a")(lambda inp, params, config: None)
    with pytest.raises(ValueError, match="fixed="):
        registry.register(family, "x", fixed="sometimes")


def test_world_one_makes_fixed_role_unavailable():
    for family in ("tp", "moe_fwd"):
        assert registry.get(family, "fixed-role-best").availability(1) == (False, "no communication at world size 1")
        assert registry.get(family, "fixed-role").availability(2) == (True, None)  # the world is the argument
    assert registry.get("tp", "torch-async-tp").availability(1) == \
        (False, "torch async-TP needs a process group of >= 2 ranks")
    assert registry.get("tp", "kosmos").availability(1) == (True, None)


# --------------------------------------------------------------------------- --config


TYPES = registry.CONFIG_TYPES["tp"]


def test_parse_config_defaults_prefixed_and_unprefixed():
    assert registry.parse_config(None, TYPES) == {"ag_gemm": AllGatherMatmulConfig(),
                                                   "gemm_rs": MatmulReduceScatterConfig()}
    got = registry.parse_config(["ag_gemm.push_chunks=auto, copy_block=4096", "push_partials=true"], TYPES)
    assert got == {"ag_gemm": AllGatherMatmulConfig(push_chunks="auto", copy_block=4096),
                   "gemm_rs": MatmulReduceScatterConfig(push_partials=True)}
    assert registry.parse_config(["push_chunks=2", "push_chunks=4"], TYPES)["ag_gemm"].push_chunks == 4  # last wins
    assert registry.parse_config(["moe_fwd.copy_cols=256"], registry.CONFIG_TYPES["moe"]) == \
        {"moe_fwd": MoEForwardConfig(copy_cols=256), "moe_bwd": MoEBackwardConfig()}
    got = registry.parse_config(["one_launch=false,wgrad_kernel=tiles", "moe_bwd.swiglu_stages=1"],
                                registry.CONFIG_TYPES["moe"])
    assert got["moe_bwd"] == MoEBackwardConfig(one_launch=False, wgrad_kernel="tiles", swiglu_stages=1)
    with pytest.raises(ValueError, match="wgrad_kernel='x': choose from 'persistent', 'tiles'"):
        registry.parse_config(["wgrad_kernel=x"], registry.CONFIG_TYPES["moe"])


@pytest.mark.parametrize("items, message", [
    (["push_chunk=2"], "--config: unknown key 'push_chunk'; known: ag_gemm.push_chunks, ag_gemm.copy_block, "
                       "gemm_rs.push_partials"),
    (["moe_fwd.copy_cols=256"], "--config: unknown key 'moe_fwd.copy_cols'; known: ag_gemm.push_chunks"),
    (["ag_gemm.push_partials=1"], "--config: unknown key 'ag_gemm.push_partials'; known:"),
    (["push_chunks=-1"], "--config ag_gemm.push_chunks=-1: push_chunks=-1 must be an integer >= 1 or 'auto'"),
    (["copy_block=1000"], "--config ag_gemm.copy_block=1000: copy_block=1000 must be a power of two >= 256"),
    (["push_partials=2"], "--config gemm_rs.push_partials=2: push_partials='2' must be true or false"),
    (["push_chunks"], "--config 'push_chunks': expected key=value"),
    (["=3"], "--config '=3': expected key=value"),
])
def test_parse_config_errors_name_the_key(items, message):
    with pytest.raises(ValueError) as e:
        registry.parse_config(items, TYPES)
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def test_parse_config_ambiguous_field_needs_the_op():
    @dataclass(frozen=True)
    class A:
        chunks: int = 1
        only_a: bool = False

    @dataclass(frozen=True)
    class B:
        chunks: int = 2
    types = {"op_a": A, "op_b": B}
    with pytest.raises(ValueError) as e:
        registry.parse_config(["chunks=3"], types)
    assert str(e.value) == "--config: key 'chunks' is ambiguous (a field of op_a, op_b); write op_a.chunks or " \
                           "op_b.chunks"
    assert registry.parse_config(["op_b.chunks=3", "only_a=yes"], types) == {"op_a": A(1, True), "op_b": B(3)}


def test_settings_config_defaults_per_op():
    st = harness.Settings(configs={"ag_gemm": AllGatherMatmulConfig(push_chunks=4)})
    assert st.config("ag_gemm") == AllGatherMatmulConfig(push_chunks=4)
    assert st.config("gemm_rs") == MatmulReduceScatterConfig() and st.config("moe_fwd") == MoEForwardConfig()


# --------------------------------------------------------------------------- the fixed-split sweep


def _measure(outcomes, calls):
    """measure() of best_fixed_split from {S: ("ok", ms) | ("failed", reason) | ("unavailable", reason)}."""
    def measure(params):
        s = params["comm_programs"]
        calls.append(s)
        status, v = outcomes[s]
        if status == "ok":
            return Result("ok", None, 1e-3, {"time_ms": v}, params=params)
        return Result(status, v, params=params)
    return measure


def test_fixed_sweep_keeps_the_fastest_passing_split():
    calls = []
    outcomes = {8: ("failed", "rel_err 5.0e-01 > 1e-02"), 16: ("ok", 2.0), 24: ("ok", 1.5), 32: ("ok", 1.7),
                132: ("ok", 0.1)}
    res = harness.best_fixed_split(_measure(outcomes, calls), (8, 16, 24, 32, 132), grid=132)
    assert res.status == "ok" and res.time_ms == 1.5
    assert res.params == {"comm_programs": 24, "sweep": [8, 16, 24, 32, 132]}
    assert calls == [8, 16, 24, 32]  # S = 132 leaves no program for the GEMMs: skipped


def test_fixed_sweep_without_a_passing_split_is_failed():
    calls = []
    outcomes = {8: ("failed", "rank 1: KosmosTimeoutError: stalled"), 16: ("failed", "rel_err nan > 1e-02")}
    res = harness.best_fixed_split(_measure(outcomes, calls), (8, 16))
    assert (res.status, res.reason, res.params, res.time_ms) == \
        ("failed", "no fixed split passed (S=8: rank 1: KosmosTimeoutError: stalled)", {"sweep": [8, 16]}, None)
    assert calls == [8, 16]
    empty = harness.best_fixed_split(_measure({}, []), (200,), grid=132)
    assert (empty.status, empty.reason) == ("failed", "no fixed split passed (empty sweep)")


def test_fixed_sweep_stops_at_an_unavailable_split():
    calls = []
    res = harness.best_fixed_split(_measure({8: ("unavailable", "needs 2 ranks"), 16: ("ok", 1.0)}, calls), (8, 16))
    assert (res.status, res.reason, calls) == ("unavailable", "needs 2 ranks", [8])


# --------------------------------------------------------------------------- check -> agree -> time -> row


def _toy(family):
    """A toy family: y = 2x. Registered: a baseline, a KOSMOS kernel taking a config, a wrong one, one that
    raises, one that finds at run time it cannot run, one a predicate rules out, and a fixed-role-best whose
    time depends on S (fastest at 16; wrong at 8)."""
    made = []

    def ok(inp, params, config):
        return (lambda: 2 * inp), 0

    @registry.register(family, "kernel", kosmos=True)
    def kernel(inp, params, config):
        made.append(("kernel", config))
        return (lambda: 2 * inp), None

    registry.register(family, "base", baseline=True)(ok)

    @registry.register(family, "wrong")
    def wrong(inp, params, config):
        return (lambda: 3 * inp), None

    @registry.register(family, "raises")
    def raises(inp, params, config):
        def fn():
            raise RuntimeError("boom\nmore")
        return fn, None

    @registry.register(family, "late")
    def late(inp, params, config):
        raise registry.Unavailable("found at run time")

    @registry.register(family, "ruled-out", available=lambda world: (False, "needs a thing"))
    def ruled_out(inp, params, config):
        made.append("ruled-out")
        return (lambda: 2 * inp), None

    @registry.register(family, "best", kosmos=True, fixed="best")
    def best(inp, params, config):
        s = params["comm_programs"]
        fn = (lambda: (3 if s == 8 else 2) * inp)
        fn.ms = {8: 0.5, 16: 1.0, 24: 2.0}[s]
        return fn, None
    return made


def test_runner_rows(family, cpu_timer):
    made = _toy(family)
    x = torch.randn(8, 4)
    st = harness.Settings(fixed_sweep=(8, 16, 24))
    recovered = []
    seen = []
    runner = harness.Runner(st, torch.device("cpu"), lambda: recovered.append(1), seen.append, extra={"e": 1})
    config = AllGatherMatmulConfig(push_chunks="auto")
    names = ("kernel", "base", "wrong", "raises", "late", "ruled-out", "best")
    results = runner.run(family, names, inputs=x, ref=2 * x, identity={"type": "result", "op": "toy"}, flops=2e9,
                         config=config, t_gemm_ms=0.5, t_comm_ms=None)
    assert runner.rows == seen and [r["impl"] for r in seen] == list(names) and set(results) == set(names)
    by = {r["impl"]: r for r in seen}
    assert (by["kernel"]["status"], by["kernel"]["time_ms"], by["kernel"]["tflops"]) == ("ok", 1.0, 2.0)
    assert by["kernel"]["config"] == config_dict(config) == {"push_chunks": "auto", "copy_block": 16384}
    assert made[0] == ("kernel", config)
    assert by["base"]["status"] == "ok" and by["base"]["config"] is None and by["base"]["workspace_bytes"] == 0
    assert by["wrong"]["status"] == "failed" and by["wrong"]["reason"].startswith("rel_err 5.0")
    assert by["raises"]["status"] == "failed" and by["raises"]["reason"] == "RuntimeError: boom"
    assert (by["late"]["status"], by["late"]["reason"]) == ("unavailable", "found at run time")
    assert (by["ruled-out"]["status"], by["ruled-out"]["reason"]) == ("unavailable", "needs a thing")
    assert "ruled-out" not in made  # a predicate that says no: the maker is never called
    assert by["best"]["status"] == "ok" and by["best"]["params"] == {"comm_programs": 16, "sweep": [8, 16, 24]}
    assert by["best"]["config"] == config_dict(config) and by["best"]["time_ms"] == 1.0
    assert len(recovered) == 2  # raises and late; never for a wrong result or a predicate's no
    for r in seen:
        assert r["op"] == "toy" and r["extra"] == {"e": 1} and r["t_gemm_ms"] == 0.5 and "peak_mem_bytes" in r
        assert "peak_mem_delta_bytes" not in r
    with pytest.raises(registry.UnknownImpl, match="unknown test-toy implementation 'nope'"):
        runner.run(family, ("nope",), inputs=x, ref=2 * x, identity={}, flops=1.0)


def test_failed_row_records_the_config():
    cfg = MatmulReduceScatterConfig(push_partials=True)
    ident = {"type": "result", "bench": "tp", "op": "gemm_rs"}
    row = harness.failed_row(ident, "tp", "fixed-role", "OutOfMemoryError: x", cfg)
    assert row == {**ident, "impl": "fixed-role", "status": "failed", "reason": "OutOfMemoryError: x",
                   "time_ms": None, "tflops": None, "config": {"push_partials": True}}
    assert harness.failed_row(ident, "tp", "nccl+cublas", "x", cfg)["config"] is None


def test_tp_failed_rows_use_each_ops_config():
    from kosmos.models import TPGemm
    st = tp.TPSettings(impls=("kosmos", "nccl+cublas"), configs={"ag_gemm": AllGatherMatmulConfig(push_chunks=2)})
    g = TPGemm("llama3-8b", "qkv", "ag_gemm", 4096, 4096, 6144, 4096)
    rows = tp.failed_rows(g, 2, st, "boom")
    assert [(r["impl"], r["config"]) for r in rows] == [("kosmos", {"push_chunks": 2, "copy_block": 16384}),
                                                        ("nccl+cublas", None)]
    assert all(r["world"] == 2 and r["m"] == 4096 and r["reason"] == "boom" for r in rows)


def test_git_commit_only_from_a_checkout_of_its_own(monkeypatch, tmp_path):
    """Outside a checkout of its own (an installed package, maybe inside another repository) the env record names
    no commit and no dirty flag rather than the surrounding repository's; KOSMOS_GIT_COMMIT still wins."""
    from kosmos_bench import environment
    monkeypatch.delenv("KOSMOS_GIT_COMMIT", raising=False)
    monkeypatch.setattr(environment, "SOURCE_ROOT", str(tmp_path))
    assert not environment.in_checkout()
    assert environment.git_commit() is None and environment.git_dirty() is None
    monkeypatch.setenv("KOSMOS_GIT_COMMIT", "a" * 40)
    assert environment.git_commit() == "a" * 40


# --------------------------------------------------------------------------- mxfp8 (TP)


def test_tp_impls_per_dtype():
    assert tp.impls_at(tp.TP_IMPLS, "bf16") == ("kosmos", "nccl+cublas", "torch-async-tp", "fixed-role",
                                                "fixed-role-best")
    assert tp.impls_at(tp.TP_IMPLS, "mxfp8") == tp.TP_IMPLS[:-1]
    assert tp.impls_at(tp.TP_IMPLS, "fp8-block") == ("kosmos", "nccl+cublas", "fixed-role", "fixed-role-best",
                                                     "fp8-rowwise", "cublas-fp8-block")
    assert registry.get("tp", "fixed-role").availability(2, "fp8-block")[0] is False
    assert registry.get("tp", "torch-async-tp").availability(2, "mxfp8") == (False, "no MXFP8 path in torch async-TP")
    assert registry.get("tp", "fixed-role").availability(2, "mxfp8") == (True, None)  # the kosmos maker, MX too
    assert registry.get("tp", "kosmos").runs_at("mxfp8") and not registry.get("tp", "fp8-rowwise").runs_at("bf16")
    assert harness.TOLERANCE["mxfp8"] == harness.TOLERANCE["bf16"] == 1e-2


def test_wire_bytes():
    m, n, k = 4096, 1024, 2048
    for impl in ("kosmos", "nccl+cublas", "torch-async-tp", "fixed-role"):
        assert tp.wire_bytes("ag_gemm", impl, "bf16", m, n, k, 4) == m * k * 2 * 3 // 4
    for impl in ("kosmos", "nccl+cublas", "triton-dot-scaled", "fixed-role-best"):
        assert tp.wire_bytes("ag_gemm", impl, "mxfp8", m, n, k, 4) == m * k * (1 + 1 / 32) * 3 / 4
    assert tp.wire_bytes("ag_gemm", "fp8-rowwise", "mxfp8", m, n, k, 4) == (m * k + m * 4) * 3 // 4
    for impl, dtype in (("kosmos", "bf16"), ("kosmos", "mxfp8"), ("fp8-rowwise", "mxfp8")):
        assert tp.wire_bytes("gemm_rs", impl, dtype, m, n, k, 8) == m * n * 2 * 7 // 8
        assert tp.wire_bytes("gemm_rs", impl, dtype, m, n, k, 1) == tp.wire_bytes("ag_gemm", impl, dtype, m, n, k,
                                                                                   1) == 0
    assert isinstance(tp.wire_bytes("ag_gemm", "kosmos", "mxfp8", m, n, k, 8), int)


def test_runner_reference_per_impl_and_impl_fields(family, cpu_timer):
    registry.register(family, "exact")(lambda inp, params, config: ((lambda: 2 * inp), 0))
    registry.register(family, "rough")(lambda inp, params, config: ((lambda: 2.03 * inp), 0))
    x = torch.randn(8, 4)
    loose = harness.Reference(2 * x, 5e-2, {"rel_err_other": 2.03 * x})
    st = harness.Settings(dtype="mxfp8")
    runner = harness.Runner(st, torch.device("cpu"), lambda: None)
    runner.run(family, ("exact", "rough"), inputs=x, ref=lambda name: loose if name == "rough" else 2 * x,
               identity={"type": "result"}, flops=1.0, impl_fields=lambda name: {"wire_bytes": len(name)},
               t_gemm_ms=0.5)
    exact, rough = runner.rows
    assert exact["status"] == "ok" and "rel_err_other" not in exact and exact["wire_bytes"] == 5
    assert rough["status"] == "ok" and rough["rel_err"] == pytest.approx(0.015, rel=1e-4) and rough["wire_bytes"] == 5
    assert rough["rel_err_other"] == pytest.approx(0.0, abs=1e-7)
    keys = list(rough)
    assert keys.index("rel_err") + 1 == keys.index("rel_err_other") < keys.index("t_gemm_ms") < keys.index("wire_bytes")
    runner.rows.clear()  # the tolerance is the Reference's: 1.5% fails against the dtype's 1e-2
    runner.run(family, ("rough",), inputs=x, ref=2 * x, identity={}, flops=1.0)
    assert runner.rows[0]["status"] == "failed" and runner.rows[0]["reason"].startswith("rel_err 1.50e-02 > 1e-02")


MX_BASELINES_SCRIPT = """
import math, torch
from kosmos_bench import tp, registry
from kosmos.models import TPGemm
from kosmos.reference import rel_err
for op in ("ag_gemm", "gemm_rs"):
    g = TPGemm("custom", "custom", op, 64, 96, 64, 128)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(g.m, g.k, generator=gen).to(torch.bfloat16)
    b = (torch.randn(g.k, g.n, generator=gen) / math.sqrt(g.k)).to(torch.bfloat16)
    b_mx = tp.mx_weight(b)
    refs = tp.references(g, a, b, "mxfp8", b_mx)
    inp = tp.TPInputs(g, a, b, "mxfp8", b_mx)
    for name in ("nccl+cublas", "triton-dot-scaled", "fp8-rowwise"):
        fn, _ = registry.get("tp", name).make(inp, {}, None)
        out, ref = fn(), refs(name)
        err, err_bf16 = rel_err(out, ref.ref), rel_err(out, ref.also["rel_err_bf16"])
        assert tuple(out.shape) == (g.m, g.n) and out.dtype == torch.bfloat16, (op, name, out.shape)
        assert err <= ref.tol and 1e-3 < err_bf16 < 5e-2, (op, name, err, err_bf16)
        if name != "fp8-rowwise":
            assert ref.tol == 1e-2 and err < 5e-3, (op, name, err)
    print("ok", op)
"""


@pytest.mark.skipif(not hasattr(torch, "_scaled_mm"), reason="torch without _scaled_mm")
def test_tp_mx_baselines_at_world_one_in_the_interpreter():
    """The mxfp8 baselines' timed calls at W=1 (no collectives) on the CPU under TRITON_INTERPRET=1 (quantize_mx,
    dequantize_mx and tl.dot_scaled interpreted; torch._scaled_mm on the CPU), against the bench's references."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", MX_BASELINES_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    if r.returncode and "_scaled_mm" in r.stderr and "not implemented" in r.stderr.lower():
        pytest.skip("torch._scaled_mm has no CPU kernel here")
    assert r.returncode == 0 and r.stdout.split() == ["ok", "ag_gemm", "ok", "gemm_rs"], r.stderr[-3000:]


FP8B_BASELINES_SCRIPT = """
import math, torch
from kosmos import quant
from kosmos.gemm.w1_static import fp8_block_matmul
from kosmos_bench import tp, registry
from kosmos_bench.registry import Unavailable
from kosmos.models import TPGemm
from kosmos.reference import rel_err
for op in ("ag_gemm", "gemm_rs"):
    g = TPGemm("custom", "custom", op, 64, 96, 64, 256)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(g.m, g.k, generator=gen).to(torch.bfloat16)
    b = (torch.randn(g.k, g.n, generator=gen) / math.sqrt(g.k)).to(torch.bfloat16)
    b8 = quant.quantize_fp8_block(b.t().contiguous(), 128)
    refs = tp.references(g, a, b, "fp8-block", b8)
    # what the kosmos row runs at W = 1 (the op's GEMM on the op's quantization of a) meets the kosmos reference
    out = fp8_block_matmul(quant.quantize_fp8_block(a), b8)
    ref = refs("kosmos")
    assert rel_err(out, ref.ref) < 5e-3 and ref.tol == 1e-2, rel_err(out, ref.ref)
    assert 1e-3 < rel_err(out, ref.also["rel_err_bf16"]) < 5e-2
    inp = tp.TPInputs(g, a, b, "fp8-block", None, b8)
    base = registry.get("tp", "nccl+cublas").make(inp, {}, None)[0]()
    assert rel_err(base, refs("nccl+cublas")) < 5e-3  # bf16 at fp8-block, against the fp32 reference
    try:
        fn, _ = registry.get("tp", "cublas-fp8-block").make(inp, {}, None)
        assert rel_err(fn(), ref.ref) < 5e-3
        print("cublas-fp8-block ran")
    except Unavailable as e:
        assert str(e).startswith("torch._scaled_mm refuses block-wise scales here"), e
    print("ok", op)
"""


def test_tp_fp8_block_references_and_baselines_in_the_interpreter():
    """fp8-block at W=1 on the CPU under TRITON_INTERPRET=1: the kosmos row's GEMM (fp8_block_matmul on the op's
    quantization) meets the bench's fp8-block reference; nccl+cublas is bf16 and meets the fp32 reference;
    cublas-fp8-block meets the reference or is unavailable with torch's reason (no block-wise _scaled_mm here)."""
    import os
    import subprocess
    import sys
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", FP8B_BASELINES_SCRIPT], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and [w for w in r.stdout.split() if w in ("ok", "ag_gemm", "gemm_rs")] == [
        "ok", "ag_gemm", "ok", "gemm_rs"], r.stderr[-3000:]


def test_wire_bytes_fp8_block():
    m, n, k = 4096, 1024, 2048
    for impl in ("kosmos", "cublas-fp8-block"):
        assert tp.wire_bytes("ag_gemm", impl, "fp8-block", m, n, k, 4) == (m * k + m * (k // 128) * 4) * 3 // 4
    assert tp.wire_bytes("ag_gemm", "nccl+cublas", "fp8-block", m, n, k, 4) == m * k * 2 * 3 // 4  # bf16 there
    assert tp.wire_bytes("gemm_rs", "kosmos", "fp8-block", m, n, k, 4) == m * n * 2 * 3 // 4


# --------------------------------------------------------------------------- host enqueue time (host_ms)


class _FakeCuda:
    """torch.cuda as timing.time_op uses it, on a fake clock: events read the clock when recorded, and every
    call lands in ``log`` (what ran in which order)."""

    def __init__(self, clock, log):
        self.clock, self.log = clock, log
        cuda = self

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                cuda.log.append("record")
                self.t = cuda.clock[0]

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

            def synchronize(self):
                pass

        self.Event = Event
        self.sleeps = []  # the cycles of every spin

    def current_device(self):
        return 0

    def _sleep(self, cycles):
        self.log.append("sleep")
        self.sleeps.append(cycles)
        self.clock[0] += cycles / 2e9  # a 2 GHz clock: HOST_HIDE_CYCLES is 2 ms

    def synchronize(self, *args):
        self.log.append("sync")


def _fake_timing(monkeypatch):
    from types import SimpleNamespace
    clock, log = [0.0], []
    fake_torch = SimpleNamespace(cuda=_FakeCuda(clock, log), tensor=lambda data, device=None: torch.tensor(data))
    monkeypatch.setattr(timing, "torch", fake_torch)
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(timing, "flush_l2", lambda device: log.append("flush"))
    monkeypatch.setattr(timing, "_CYCLES_PER_MS", {})  # calibrated on the fake clock, forgotten after the test
    return clock, log


def test_time_op_host_ms_is_the_median_time_inside_the_timed_calls(monkeypatch):
    """The real timing loop on a fake clock: host_ms is the median over the timed calls (not the warm-up) of the
    time from entering the call to its return, taken inside the device timing (between the two events' records)
    with no synchronisation there, so measuring it leaves the device timing as it was."""
    clock, log = _fake_timing(monkeypatch)
    costs = iter([5.0, 5.0] + [1e-4, 3e-4, 2e-4, 9e-4, 2e-4])  # seconds: two warm-ups, five timed calls

    def fn():
        log.append("call")
        clock[0] += next(costs)

    t = timing.time_op(fn, iters=5, warmup=2)
    assert t["host_ms"] == pytest.approx(0.2) and t["samples"] == 5
    assert t["time_ms"] == pytest.approx(0.2)  # the fake device time is the call's clock time too
    timed = log[log.index("sync"):]  # after the warm-ups' barrier
    for i in range(5):  # each timed call: flush, barrier (sync), spin, start event, the call, end event
        at = [j for j, what in enumerate(timed) if what == "call"][i]
        assert timed[at - 3:at + 2] == ["sync", "sleep", "record", "call", "record"]


def test_time_op_spin_covers_a_long_host_time(monkeypatch):
    """A call whose warm-up host time is longer than the fixed ~2 ms spin gets a spin of HOST_HIDE_MARGIN x its
    median warm-up host time + 0.5 ms (the first warm-up call, which may compile, left out), so its host time
    cannot leak into its device time; a fast call keeps HOST_HIDE_CYCLES. The spin is reported as hidden_ms."""
    for host_s, compile_s, want_ms in ((4e-3, 3.0, timing.HOST_HIDE_MARGIN * 4.0 + 0.5), (1e-4, 0.0, 2.0)):
        clock, log = _fake_timing(monkeypatch)
        costs = iter([compile_s + host_s] + [host_s] * 20)

        def fn():
            clock[0] += next(costs)

        t = timing.time_op(fn, iters=3, warmup=3)
        sleeps = timing.torch.cuda.sleeps
        assert sleeps[0] == timing.HOST_HIDE_CYCLES  # the calibration spin
        assert sleeps[1:] == [sleeps[1]] * 3  # one spin length for every timed call
        assert sleeps[1] / 2e6 == pytest.approx(want_ms)  # cycles at the fake 2 GHz clock -> ms
        assert t["hidden_ms"] == pytest.approx(want_ms)
        assert t["time_ms"] == pytest.approx(host_s * 1e3)  # the spin is before the start event


def test_host_warm_up_as_the_cli_says():
    """The CLI's help and dry-run texts say "1 s of warm-up" without importing torch: keep them in step."""
    assert timing.HOST_WARM_S == 1.0


def test_hide_ms_rules():
    assert timing.hide_ms([]) == 0.0
    assert timing.hide_ms([900.0, 2.0, 4.0, 3.0]) == pytest.approx(timing.HOST_HIDE_MARGIN * 3.0 + 0.5)
    assert timing.hide_ms([7.0]) == pytest.approx(timing.HOST_HIDE_MARGIN * 7.0 + 0.5)  # one call: its own
    assert timing.hide_ms([1.0, 1e4]) == timing.HOST_HIDE_MAX_MS


def test_time_op_host_ms_of_a_split_is_its_run_alone(monkeypatch):
    clock, log = _fake_timing(monkeypatch)

    def setup():
        clock[0] += 1.0  # untimed: neither device nor host time
        return 2e-4

    def run(cost):
        clock[0] += cost

    t = timing.time_op(timing.Split(setup, run), iters=3, warmup=1)
    assert t["host_ms"] == pytest.approx(0.2) and t["time_ms"] == pytest.approx(0.2)


def test_host_enqueue_us_is_the_median_of_back_to_back_calls(monkeypatch):
    """timing.host_enqueue_us on a fake clock: warm-up calls for warm_s (at least one), one sync, then ``calls``
    timed calls with no sync among them, one sync after; the median / p20 / p80 are of the timed calls alone."""
    from types import SimpleNamespace
    clock, log = [0.0], []
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    costs = iter([0.05] * 4 + [10e-6, 30e-6, 20e-6, 90e-6, 20e-6])  # seconds: 4 warm-up calls fill 0.2 s

    def fn():
        log.append("call")
        clock[0] += next(costs)

    got = timing.host_enqueue_us(fn, calls=5, warm_s=0.2, sync=lambda: log.append("sync"))
    assert got["host_us"] == pytest.approx(20.0) and got["calls"] == 5 and got["warmup_calls"] == 4
    assert got["p20_us"] <= got["host_us"] <= got["p80_us"] <= 90.0
    assert log == ["call"] * 4 + ["sync"] + ["call"] * 5 + ["sync"]  # calls counted: warm-up + N


def test_host_enqueue_us_of_a_sleeping_callable_and_even_ranks():
    """A real CPU callable that sleeps ~1 ms: the median is within bounds; ``even_out`` tops the warm-up up to
    the count every rank reaches (a collective's calls must match across ranks); bad ``calls`` is refused."""
    import time
    calls, syncs = [], []

    def fn():
        calls.append(1)
        time.sleep(1e-3)

    got = timing.host_enqueue_us(fn, calls=20, warm_s=0.01, sync=lambda: syncs.append(1))
    assert 900 <= got["host_us"] <= 20_000 and len(calls) == got["warmup_calls"] + 20 and len(syncs) == 2
    calls.clear()
    got = timing.host_enqueue_us(fn, calls=3, warm_s=0.0, sync=lambda: None, even_out=lambda n: n + 7)
    assert got["warmup_calls"] == 8 and len(calls) == 11
    with pytest.raises(ValueError, match="calls=0"):
        timing.host_enqueue_us(fn, calls=0, sync=lambda: None)


def test_runner_host_rows_check_first_and_reduce_over_ranks(family, monkeypatch):
    """Runner.host: availability and the check as for a result row (a wrong, raising or unavailable one gets its
    host row with the reason, the sweep goes on), then timing.host_enqueue_us of the checked callable, eager under
    --cuda-graph too; every figure the max over ranks (here a slower second rank: twice each figure), the warm-up
    evened out over ranks; fixed-role-best at the default split alone; type "host" rows with calls and warm_s."""
    _toy(family)
    measured = []

    def host_enqueue_us(fn, calls, warm_s, sync=None, even_out=None):
        fn()
        measured.append((calls, warm_s, even_out(3)))
        return {"host_us": 20.0, "p20_us": 18.0, "p80_us": 25.0, "calls": calls, "warmup_calls": 3}
    monkeypatch.setattr(timing, "host_enqueue_us", host_enqueue_us)
    monkeypatch.setattr(timing, "capture_graph", lambda *a, **k: pytest.fail("host rows are of eager calls"))
    monkeypatch.setattr(harness, "max_over_ranks", lambda x, device="cuda": 2 * x)  # the other rank: twice
    x = torch.randn(8, 4)
    seen = []
    runner = harness.Runner(harness.Settings(cuda_graph=True, fixed_sweep=(8, 16, 24)), torch.device("cpu"),
                            lambda: None, seen.append)
    names = ("kernel", "base", "wrong", "raises", "ruled-out", "best")
    config = AllGatherMatmulConfig()
    runner.host(family, names, inputs=x, ref=2 * x, identity={"type": "result", "op": "toy", "world": 2},
                calls=7, warm_s=0.1, config=config)
    by = {r["impl"]: r for r in seen}
    assert list(by) == list(names) and all(r["type"] == "host" and r["calls"] == 7 and r["warm_s"] == 0.1
                                           for r in seen)
    assert (by["kernel"]["status"], by["kernel"]["host_us"], by["kernel"]["p20_us"], by["kernel"]["p80_us"]) == \
        ("ok", 40.0, 36.0, 50.0)
    assert by["kernel"]["config"] == config_dict(config) and by["base"]["config"] is None
    assert by["wrong"]["status"] == "failed" and by["wrong"]["reason"].startswith("rel_err 1.0")  # 0.5, doubled
    assert by["wrong"]["host_us"] is None
    assert (by["raises"]["status"], by["raises"]["reason"]) == ("failed", "RuntimeError: boom")
    assert (by["ruled-out"]["status"], by["ruled-out"]["reason"]) == ("unavailable", "needs a thing")
    assert by["best"]["status"] == "ok" and by["best"]["params"] == {"comm_programs": 16}  # no sweep
    assert measured == [(7, 0.1, 6)] * 3  # kernel, base, best: the warm-up topped up to the max over ranks
    assert "cuda_graph" not in by["kernel"]


def test_rows_carry_the_host_time_of_their_timing(family, cpu_timer):
    """Every timed row has the timing's host_ms; a row that was not timed has None."""
    _toy(family)
    x = torch.randn(8, 4)
    runner = harness.Runner(harness.Settings(), torch.device("cpu"), lambda: None)
    runner.run(family, ("kernel", "base", "wrong", "ruled-out"), inputs=x, ref=2 * x,
               identity={"type": "result", "op": "toy"}, flops=1.0)
    by = {r["impl"]: r for r in runner.rows}
    assert by["kernel"]["host_ms"] == by["base"]["host_ms"] == 0.01
    assert by["wrong"]["host_ms"] is None and by["ruled-out"]["host_ms"] is None
    keys = list(by["kernel"])
    assert keys.index("rel_err") < keys.index("host_ms") < keys.index("workspace_bytes")


def test_cuda_graph_times_the_replay_and_records_a_failed_capture(family, cpu_timer, monkeypatch):
    """Settings.cuda_graph: after the check, each implementation's call is captured (timing.capture_graph) and
    its replay is what time_op times; a capture that raises gives a "failed" row with the reason and the sweep
    goes on; a split call is "unavailable"; every row says cuda_graph."""
    calls = []

    def capture_graph(fn, warmup=3):
        if getattr(fn, "no_capture", False):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        calls.append("captured")

        def replay():
            calls.append("replay")
            return fn()
        return replay
    monkeypatch.setattr(timing, "capture_graph", capture_graph)

    @registry.register(family, "graphable")
    def graphable(inp, params, config):
        return (lambda: 2 * inp), None

    @registry.register(family, "ungraphable")
    def ungraphable(inp, params, config):
        fn = (lambda: 2 * inp)
        fn.no_capture = True
        return fn, None

    @registry.register(family, "split")
    def split(inp, params, config):
        return timing.Split(lambda: inp, lambda x: 2 * x), None
    x = torch.randn(4, 4)
    recovered = []
    runner = harness.Runner(harness.Settings(cuda_graph=True), torch.device("cpu"), lambda: recovered.append(1))
    runner.run(family, ("graphable", "ungraphable", "split"), inputs=x, ref=2 * x, identity={"op": "toy"},
               flops=1.0)
    by = {r["impl"]: r for r in runner.rows}
    assert by["graphable"]["status"] == "ok" and calls == ["captured", "replay"]  # the replay was timed
    assert by["ungraphable"]["status"] == "failed"
    assert by["ungraphable"]["reason"] == "CUDA graph capture: RuntimeError: operation not permitted when stream " \
                                          "is capturing"
    assert by["split"]["status"] == "unavailable" and "CUDA graph" in by["split"]["reason"]
    # recovered after the failed capture, and after the timed graph (its workspace released for the next one)
    assert all(r["cuda_graph"] is True for r in runner.rows) and len(recovered) == 2
    plain = harness.Runner(harness.Settings(), torch.device("cpu"), lambda: None)
    plain.run(family, ("graphable",), inputs=x, ref=2 * x, identity={"op": "toy"}, flops=1.0)
    assert "cuda_graph" not in plain.rows[0]


def test_env_header_counts_gpus_not_ranks(monkeypatch):
    """gpu_count is the GPUs the ranks use: the world size with one GPU per rank, 1 with every rank on one GPU
    (KOSMOS_RANKS_ON_ONE_GPU; the W = 2 train rows of session 15 were headed "gpu_count": 2)."""
    from kosmos_bench import environment, launcher
    monkeypatch.setattr(harness, "world_info", lambda: (0, 2))
    monkeypatch.delenv(launcher.ONE_GPU_ENV, raising=False)
    assert environment._gpus_used() == 2
    monkeypatch.setenv(launcher.ONE_GPU_ENV, "1")
    assert environment._gpus_used() == 1


def test_tp_host_cases_and_rows_on_the_cpu(monkeypatch):
    """bench tp's host measurement: a HostCase per (op of the sweep, dtype) on the small custom GEMM (none with 0
    calls); run_host_case checks each implementation on it and measures nccl+cublas's eager calls for real (W=1,
    CPU, a no-op sync), torch-async-tp unavailable at W=1 with its reason; the rows name the shape."""
    from kosmos.models import TPGemm
    cases = [vars(TPGemm("llama3-8b", layer, op, 4096, 4096, 6144, 4096))
             for layer, op in (("qkv", "ag_gemm"), ("fc1", "ag_gemm"), ("fc2", "gemm_rs"))]
    hosts = tp.host_cases(cases, ("bf16", "mxfp8"), (128, 256, 256), 200, 2)
    assert [(h.g.op, h.dtype, h.g.m, h.g.n, h.g.k, h.g.model) for h in hosts] == [
        (op, d, 128, 256, 256, "custom") for op in ("ag_gemm", "gemm_rs") for d in ("bf16", "mxfp8")]
    assert tp.host_cases(cases, ("bf16",), (128, 256, 256), 0, 1) == []
    assert tp.describe(hosts[0]) == "host enqueue ag_gemm [128x256x256] bf16, 200 calls"

    def make_inputs(g, world, rank, seed):  # the bench's inputs, on the CPU
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn(g.m, g.k, generator=gen).to(torch.bfloat16),
                (torch.randn(g.k, g.n, generator=gen) / 16).to(torch.bfloat16))
    monkeypatch.setattr(tp, "make_inputs", make_inputs)
    (hc,) = tp.host_cases([cases[2]], ("bf16",), (64, 32, 64), 10, 1)
    hc = tp.HostCase(hc.g, hc.dtype, hc.calls, warm_s=0.01)
    rows = tp.run_host_case(hc, tp.TPSettings(impls=("nccl+cublas", "torch-async-tp")), device="cpu")
    assert [(r["type"], r["impl"], r["status"]) for r in rows] == [("host", "nccl+cublas", "ok"),
                                                                    ("host", "torch-async-tp", "unavailable")]
    base, async_tp = rows
    assert (base["op"], base["m"], base["n"], base["k"], base["world"], base["dtype"], base["calls"]) == \
        ("gemm_rs", 64, 32, 64, 1, "bf16", 10)
    assert 0 < base["p20_us"] <= base["host_us"] <= base["p80_us"] and base["warmup_calls"] >= 1
    assert base["rel_err"] < 1e-2 and async_tp["host_us"] is None and "2 ranks" in async_tp["reason"]
    failed = tp.failed_host_rows(hc, 1, tp.TPSettings(impls=("kosmos", "nccl+cublas")), "RuntimeError: x")
    assert [(r["type"], r["impl"], r["status"], r["reason"], r["host_us"]) for r in failed] == [
        ("host", "kosmos", "failed", "RuntimeError: x", None), ("host", "nccl+cublas", "failed", "RuntimeError: x", None)]
    assert failed[0]["config"] == {"push_partials": False}
