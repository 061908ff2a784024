"""The MoE bench's transformers baselines (hf-grouped-mm, hf-eager: kosmos_bench/moe_hf.py), the proxies they are
compared on, and the suite suites/moe-hf.yaml (per-model tokens) -- all on the CPU. The rows that need
transformers skip cleanly without it; the rows that say it is missing run either way."""
import sys

import pytest
import torch
import yaml

from kosmos.integrations.transformers import require_transformers
from kosmos.models import MOE_MODELS, MoEModel
from kosmos_bench import moe, moe_hf, registry, timing
from kosmos_bench.suites import MoESuite, SuiteError, load_suite

try:
    require_transformers()
    HAS_HF = True
except ImportError:
    HAS_HF = False
needs_hf = pytest.mark.skipif(not HAS_HF, reason="needs transformers >= 5.13 (pip install 'kosmos[hf]')")
SUITE = moe.__file__.rsplit("/", 1)[0] + "/suite_files/moe-hf.yaml"
HF = tuple(moe_hf.HF_IMPLS)
GiB = 1 << 30

TINY = {
    "tiny-qwen3": MoEModel("tiny-qwen3", hidden=64, expert_ffn=32, experts=8, top_k=2, routing="softmax",
                           renormalize=True, hf_family="qwen3_moe"),
    "tiny-qwen2": MoEModel("tiny-qwen2", hidden=64, expert_ffn=32, experts=8, top_k=2, routing="softmax",
                           renormalize=False, hf_family="qwen2_moe"),
    "tiny-mixtral": MoEModel("tiny-mixtral", hidden=64, expert_ffn=32, experts=8, top_k=2, routing="softmax",
                             hf_family="mixtral"),
    "tiny-deepseek": MoEModel("tiny-deepseek", hidden=64, expert_ffn=32, experts=16, top_k=4,
                              routing="sigmoid-grouped", n_group=4, topk_group=2, routed_scaling=2.5,
                              hf_family="deepseek_v3"),
}


@pytest.fixture
def tiny_models(monkeypatch):
    for name, m in TINY.items():
        monkeypatch.setitem(MOE_MODELS, name, m)


def _cpu_time_op(fn, *, iters=20, warmup=5, **kw):
    """One call, wall time: the CPU tests check the flow and the checks, not the numbers."""
    import time
    if isinstance(fn, timing.Split):
        state = fn.setup()
        t0 = time.perf_counter()
        fn.run(state)
    else:
        t0 = time.perf_counter()
        fn()
    ms = (time.perf_counter() - t0) * 1e3
    return {"time_ms": ms, "p20_ms": ms, "p80_ms": ms, "samples": 1, "host_ms": ms}


def _rows(name, direction, dtype="bf16", impls=HF):
    st = moe.MoESettings(impls=impls, iters=1, warmup=0, direction=direction, dtype=dtype, expert_gemms=False)
    return {r["impl"]: r for r in moe.run_case(moe.MoECase(name, 48, "uniform"), st, device="cpu")}


# --------------------------------------------------------------------------- the proxies


def test_proxies_of_the_hf_suite():
    """qwen3-30b-a3b and mixtral-8x7b beside deepseek-v3, with the transformers family the hf-* baselines build."""
    q, x, d = (MOE_MODELS[n] for n in ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3"))
    assert (q.hidden, q.expert_ffn, q.experts, q.top_k, q.routing, q.renormalize) == (2048, 768, 128, 8, "softmax",
                                                                                      True)
    assert (x.hidden, x.expert_ffn, x.experts, x.top_k, x.routing, x.renormalize) == (4096, 14336, 8, 2, "softmax",
                                                                                      True)
    assert (d.routing, d.n_group, d.topk_group, d.routed_scaling) == ("sigmoid-grouped", 8, 4, 2.5)
    assert [moe_hf.hf_family(m).name for m in (q, x, d)] == ["qwen3_moe", "mixtral", "deepseek_v3"]
    assert moe_hf.hf_family(MoEModel("custom", 64, 32, 8, 2, "softmax")).name == "qwen3_moe"


# --------------------------------------------------------------------------- registry entries, unavailable rows


def test_registered_with_their_availability(monkeypatch):
    """Both are moe_fwd implementations, not the baseline; bf16 only (mxfp8: unavailable, with the reason), every
    direction; EP = 1 only; without transformers unavailable, naming the extra."""
    assert set(HF) <= set(moe.MOE_IMPLS) and registry.baseline("moe_fwd") == "nccl-a2a"
    for name in HF:
        impl = registry.get("moe_fwd", name)
        assert impl.runs_at("bf16") and impl.runs_at("mxfp8") and not impl.kosmos
        assert impl.availability(1, "mxfp8", "fwd") == (False, "transformers' experts have no MXFP8 path")
        ok, why = impl.availability(2, "bf16", "fwd+bwd")
        assert not ok and ("EP = 1 only" in why if HAS_HF else "kosmos[hf]" in why)
        if HAS_HF:
            assert impl.availability(1, "bf16", "fwd+bwd") == (True, None)
        with monkeypatch.context() as mp:
            mp.setitem(sys.modules, "transformers", None)
            ok, why = impl.availability(1, "bf16", "fwd")
        assert not ok and "needs transformers >= 5.13 (pip install 'kosmos[hf]')" in why and "\n" not in why


def test_rows_unavailable_without_transformers_and_at_mxfp8(monkeypatch, tiny_models):
    """A point whose hf-* rows cannot run gives "unavailable" rows with the reason (the sweep goes on)."""
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    rows = _rows("tiny-qwen3", "fwd", dtype="mxfp8")
    assert {r["status"] for r in rows.values()} == {"unavailable"}
    assert all(r["reason"] == "transformers' experts have no MXFP8 path" for r in rows.values())
    monkeypatch.setitem(sys.modules, "transformers", None)
    rows = _rows("tiny-qwen3", "fwd+bwd")
    assert {r["status"] for r in rows.values()} == {"unavailable"}
    assert all("kosmos[hf]" in r["reason"] for r in rows.values())


def test_memory_estimate_at_deepseek_v3():
    """deepseek-v3, 8192 tokens, fwd+bwd at EP = 1: kosmos's check ~48 GiB, hf-grouped-mm ~71 GiB (both weight
    layouts), hf-eager ~85 GiB (a dense gate_up-sized gradient per expert): on an 80 GB H100 (about 79 GiB) hf-eager
    is unavailable with its estimate, hf-grouped-mm fits; an H200 (about 140 GiB) fits both; every fwd row fits."""
    m = MOE_MODELS["deepseek-v3"]
    peak = {impl: moe.hf_check_bytes(m, 8192, "fwd+bwd", impl)["peak"] / GiB for impl in HF}
    assert 68 < peak["hf-grouped-mm"] < 75 and 82 < peak["hf-eager"] < 90
    assert moe.backward_check_bytes(m, 8192)["peak"] / GiB < 50
    h100, h200 = int(79.2 * GiB), int(139.8 * GiB)
    assert moe.hf_memory_problem(m, 8192, "fwd+bwd", "hf-grouped-mm", h100) is None
    why = moe.hf_memory_problem(m, 8192, "fwd+bwd", "hf-eager", h100)
    assert why.startswith("needs ~85 GiB at deepseek-v3 8192 tokens fwd+bwd") and "dense per-expert" in why
    assert all(moe.hf_memory_problem(m, 8192, d, impl, h200) is None for d in ("fwd", "fwd+bwd") for impl in HF)
    assert all(moe.hf_memory_problem(m, 8192, "fwd", impl, h100) is None for impl in HF)
    for name, tokens in (("qwen3-30b-a3b", 8192), ("mixtral-8x7b", 4096)):
        assert all(moe.hf_memory_problem(MOE_MODELS[name], tokens, "fwd+bwd", impl, h100) is None for impl in HF)


# --------------------------------------------------------------------------- the layer and its rows


@needs_hf
@pytest.mark.parametrize("name", list(TINY))
def test_hf_layer_is_transformers_on_the_same_weights(tiny_models, name):
    """hf_layer builds the family's router and experts on the bench's tensors: the router weight itself (shared
    storage), the experts in transformers' layout (w13 / w2 transposed), the DeepSeek bias; its output is
    transformers' own block math (the family's sparse block on the same parameters, shared experts dropped)."""
    import importlib

    m = TINY[name]
    x, wr, bias, _ = moe.make_router_inputs(m, 24, "uniform", 0, 0)
    w13, w2 = moe.make_expert_weights(m, 1, 0, 0)
    layer, (router_w, gate_up, down) = moe_hf.hf_layer(m, wr, bias, w13, w2, "eager", requires_grad=False)
    assert router_w.data_ptr() == wr.data_ptr()
    assert torch.equal(gate_up, w13.transpose(1, 2)) and torch.equal(down, w2.transpose(1, 2))
    y, chosen = layer(x)
    fam, cfg = moe_hf.hf_config(m, "eager")
    block_cls = getattr(importlib.import_module(fam.module), fam.block)
    if fam.shared == "gated":
        cfg.shared_expert_intermediate_size = 8
    block = block_cls(cfg).to(torch.bfloat16)
    with torch.no_grad():
        block.gate.weight.copy_(wr)
        block.experts.gate_up_proj.copy_(gate_up)
        block.experts.down_proj.copy_(down)
        if bias is not None:
            block.gate.e_score_correction_bias.copy_(bias)
        shared = 0
        if fam.shared == "gated":
            shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        elif fam.shared == "plain":
            shared = block.shared_experts(x)
        want = block(x[None])[0] - shared
    assert chosen.shape == (24, m.top_k)
    assert ((y.float() - want.float()).norm() / want.float().norm()).item() < 1e-2


@needs_hf
def test_hf_layer_refuses_a_routing_its_router_does_not_run():
    m = MoEModel("mixtral-norenorm", hidden=64, expert_ffn=32, experts=8, top_k=2, routing="softmax",
                 renormalize=False, hf_family="mixtral")
    x, wr, bias, _ = moe.make_router_inputs(m, 8, "uniform", 0, 0)
    w13, w2 = moe.make_expert_weights(m, 1, 0, 0)
    with pytest.raises(ValueError, match="MixtralTopKRouter routes with .*'renormalize': True"):
        moe_hf.hf_layer(m, wr, bias, w13, w2, "grouped_mm", requires_grad=False)


@needs_hf
@pytest.mark.parametrize("direction", ["fwd", "bwd", "fwd+bwd"])
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-mixtral", "tiny-deepseek"])
def test_hf_rows_end_to_end(monkeypatch, tiny_models, name, direction):
    """The rows of both baselines on the CPU: ok, checked against the fp32 reference for their own routing decision
    (fwd: y, within the bf16 tolerance; bwd and fwd+bwd: dx, d_router, dw13 and dw2, each within GRAD_TOLERANCE),
    with the note of what ran."""
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    rows = _rows(name, direction)
    assert list(rows) == list(HF)
    for impl, r in rows.items():
        assert r["status"] == "ok" and r["direction"] == direction, r
        assert f"experts_implementation='{moe_hf.HF_IMPLS[impl]}'" in r["note"] and "transformers 5." in r["note"]
        if direction == "fwd":
            assert r["rel_err_parts"] == {"y": r["rel_err"]} and 0 < r["rel_err"] < 1e-2
        else:
            assert set(r["rel_err_grads"]) == set(moe.GRADS) and 0 < r["rel_err"] < moe.GRAD_TOLERANCE, r
        flops = moe.DIRECTION_FLOPS[direction] * 6 * 48 * TINY[name].top_k * 64 * 32
        assert r["tflops"] == pytest.approx(flops / (r["time_ms"] * 1e-3) / 1e12)


@needs_hf
@pytest.mark.parametrize("direction", ["fwd", "fwd+bwd"])
def test_hf_rows_fail_when_wrong(monkeypatch, tiny_models, direction):
    """The check is not a formality: a layer 5% off fails its row with the error."""
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    build = moe_hf.hf_layer

    def off(*a, **kw):
        layer, params = build(*a, **kw)
        return (lambda x: (lambda y, e: (y * 1.05, e))(*layer(x))), params
    monkeypatch.setattr(moe_hf, "hf_layer", off)
    for r in _rows("tiny-qwen3", direction).values():
        assert r["status"] == "failed" and r["reason"].startswith("rel_err") and r["rel_err"] > 4e-2, r


# --------------------------------------------------------------------------- the suite


def test_moe_hf_suite_file():
    s = load_suite(SUITE, bench="moe")
    assert s.name == "moe-hf" and s.models == ("qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
    assert s.tokens == {"qwen3-30b-a3b": (8192,), "mixtral-8x7b": (4096,), "deepseek-v3": (8192,)}
    assert s.direction == ("fwd", "fwd+bwd") and s.dtype == ("bf16",) and s.routing == ("uniform",)
    assert s.impls == ("kosmos", "hf-grouped-mm", "hf-eager") and s.ep == 1 and not s.expert_gemms
    cases = moe.moe_cases(s.models, s.tokens, s.routing, 1)
    assert [(c.model, c.tokens, c.routing) for c in cases] == [
        ("qwen3-30b-a3b", 8192, "uniform"), ("mixtral-8x7b", 4096, "uniform"), ("deepseek-v3", 8192, "uniform")]


def test_per_model_tokens_round_trip_and_overrides(tmp_path):
    """A suite recorded with to_dict (a results file's env line) loads back the same; --model can pick some of
    the models (the mapping keeps theirs), --tokens gives every model one list; a model the mapping lacks is a
    one-line error from moe_cases."""
    s = load_suite(SUITE, bench="moe")
    path = tmp_path / "again.yaml"
    path.write_text(yaml.safe_dump(s.to_dict()))
    assert load_suite(path, bench="moe") == s
    one = s.override(models=["mixtral-8x7b"])
    assert one.tokens == {"mixtral-8x7b": (4096,)}
    assert s.override(tokens=[128, 256]).tokens == (128, 256)
    with pytest.raises(SuiteError, match=r"gives none for \['qwen3-235b'\]"):
        s.override(models=["qwen3-235b"])
    with pytest.raises(ValueError, match="no tokens for qwen3-235b"):
        moe.moe_cases(["qwen3-235b"], {"deepseek-v3": (64,)}, ["uniform"], 1)


@pytest.mark.parametrize("tokens, needle", [
    ("{qwen3-30b-a3b: [8192], grok-9: [64]}", "'tokens' names unknown models ['grok-9']"),
    ("{qwen3-30b-a3b: [8192]}", "gives none for ['mixtral-8x7b']"),
    ("{qwen3-30b-a3b: [8192], mixtral-8x7b: [0]}", "'tokens.mixtral-8x7b' must be a non-empty list of positive"),
    ("{qwen3-30b-a3b: [8192], mixtral-8x7b: 4096.5}", "'tokens.mixtral-8x7b' must be a list"),
])
def test_malformed_per_model_tokens(tmp_path, tokens, needle):
    path = tmp_path / "bad.yaml"
    path.write_text(f"bench: moe\nmodels: [qwen3-30b-a3b, mixtral-8x7b]\ntokens: {tokens}\n")
    with pytest.raises(SuiteError) as e:
        load_suite(path, bench="moe")
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_dry_run_lists_the_hf_suite():
    """`kosmos bench moe --suite suites/moe-hf.yaml --dry-run` on a CPU box: the three points at their own tokens,
    kosmos and the two baselines in both directions (available where transformers is installed, unavailable with
    the reason where not)."""
    from typer.testing import CliRunner

    from kosmos_bench.cli import app
    r = CliRunner().invoke(app, ["bench", "moe", "--suite", SUITE, "--dry-run"])
    assert r.exit_code == 0, r.output
    out = " ".join(r.output.split())
    assert "3 points (moe_fwd) x 6 implementations over 2 directions" in out
    for point in ("qwen3-30b-a3b 8192 uniform 128 128 8 2048 768 softmax",
                  "mixtral-8x7b 4096 uniform 8 8 2 4096 14336 softmax",
                  "deepseek-v3 8192 uniform 256 256 8 7168 2048 sigmoid-grouped 8/4 groups"):
        assert point in out
    for direction in ("fwd", "fwd+bwd"):
        assert f"implementations (moe_fwd, {direction}): kosmos available" in out
    word = "available" if HAS_HF else "unavailable: kosmos.integrations.transformers needs transformers"
    assert out.count(f"hf-grouped-mm {word}") == 2 and out.count(f"hf-eager {word}") == 2
