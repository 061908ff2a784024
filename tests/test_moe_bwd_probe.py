"""dev.moe_bwd_probe's CPU paths: the MoE backward split into moe_backward's stages (issue 15's probe).

* ``interpreter`` -- the probe's ``--cpu-smoke`` (tiny stand-ins of both routing kinds, the backward kernels under the
  CPU interpreter): every stage row, both whole backwards, the summary; the stages' outputs composed equal
  moe_backward_w1's gradients bitwise (in the probe's own check and here, on a decision with an expert left
  without rows); the summary's arithmetic with a stand-in timer.
"""
import json

import pytest
import torch

from dev import moe_bwd_probe as probe


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _check_rows(rows):
    assert rows[0]["type"] == "env" and rows[0]["probe"] == "moe_bwd_probe" and rows[0]["cpu_smoke"]
    stages = [r for r in rows if r["type"] == "stage"]
    assert tuple(r["stage"] for r in stages) == probe.STAGE_NAMES
    assert [r["index"] for r in stages] == list(range(len(probe.STAGE_NAMES)))
    for r in stages:
        assert r["status"] == "ok", r
        if r["stage"] in probe.GEMM_STAGES:  # the torch._grouped_mm reference ran on the same rows
            assert r["flops"] > 0 and r["ref_status"] == "ok" and r["ref_out_dtype"] in ("bfloat16", "float32"), r
            if r["stage"] != "dgrad2_swiglu":
                assert r["rel_err_vs_ref"] < 2e-2, r
        else:
            assert "flops" not in r
    totals = {r["impl"]: r for r in rows if r["type"] == "total"}
    assert set(totals) == {"kosmos", "nccl-a2a"} and all(t["status"] == "ok" for t in totals.values()), totals
    summary = rows[-1]
    assert summary["type"] == "summary"
    assert summary["bitwise_equal"] == {n: True for n in probe.GRAD_NAMES}
    assert summary["composed_equals_moe_backward_w1"] is True
    assert summary["h_bitwise_swiglu_h"] is True  # dgrad2's epilogue h (the default) == swiglu_h's
    return stages, totals, summary


@pytest.mark.interpreter
def test_cpu_smoke_every_stage_and_the_composition(tmp_path, capsys, monkeypatch):
    """deepseek-v3's stand-in (sigmoid-grouped routing, routed scaling): every stage row in moe_backward's order,
    the references, both whole backwards, nothing timed; the table printed last and re-printed by --table. The
    --max-seconds deadline counts from main(), not from the module's import (in a full test run the import came
    minutes earlier and every stage was skipped: CI, session 10)."""
    import time
    monkeypatch.setattr(probe, "START", time.monotonic() - 10_000)
    out = tmp_path / "probe.jsonl"
    assert probe.main(["--cpu-smoke", "--model", "deepseek-v3", "--json", str(out)]) == 0
    rows = _rows(out)
    stages, _, _ = _check_rows(rows)
    assert rows[0]["model"] == "deepseek-v3-tiny" and rows[0]["model_fields"]["routing"] == "sigmoid-grouped"
    assert all(r["time_ms"] is None for r in stages)  # no timing claims on the CPU
    printed = capsys.readouterr().out
    assert "stages composed == moe_backward_w1 (bitwise): True" in printed
    assert probe.main(["--table", str(out)]) == 0
    assert "wgrad1" in capsys.readouterr().out


@pytest.mark.interpreter
def test_summary_arithmetic_with_a_stand_in_timer(tmp_path, monkeypatch):
    """The GPU run's numbers (TFLOP/s, kosmos/torch ratios, the sum of stages, the speedup over nccl-a2a) from a
    timer that returns 1, 2, 3, ... ms: each figure follows from the rows' times."""
    calls = []

    def fake_timed(self, fn, smoke_call=True):
        if smoke_call:
            fn()
        calls.append(len(calls) + 1.0)
        return {"time_ms": calls[-1], "p20_ms": calls[-1], "p80_ms": calls[-1], "host_ms": 0.1, "samples": 1}

    monkeypatch.setattr(probe.Probe, "timed", fake_timed)
    out = tmp_path / "probe.jsonl"
    from kosmos.ops.moe_backward import multi_launch as bwd_multi
    default = bwd_multi.WGRAD_TILES
    assert probe.main(["--cpu-smoke", "--model", "qwen3-235b", "--routing", "zipf:1.2", "--wgrad-kernel", "tiles",
                       "--wgrad-tiles", "128,256,64,8,2", "--json", str(out)]) == 0
    assert bwd_multi.WGRAD_TILES == default  # the options reach the run as arguments, not module globals
    rows = _rows(out)
    assert rows[0]["wgrad_kernel"] == "tiles" and rows[0]["wgrad_tiles"] == [128, 256, 64, 8, 2]
    assert rows[0]["bwd_config"]["wgrad_kernel"] == "tiles"
    stages, totals, summary = _check_rows(rows)
    assert summary["sum_stages_ms"] == pytest.approx(sum(r["time_ms"] for r in stages))
    assert summary["speedup_vs_a2a"] == pytest.approx(totals["nccl-a2a"]["time_ms"] / totals["kosmos"]["time_ms"])
    assert summary["sum_over_whole"] == pytest.approx(summary["sum_stages_ms"] / totals["kosmos"]["time_ms"])
    for r in stages:
        if r["stage"] in probe.GEMM_STAGES:
            assert r["tflops"] == pytest.approx(r["flops"] / (r["time_ms"] * 1e-3) / 1e12)
            assert r["ratio_tflops"] == pytest.approx(r["ref_time_ms"] / r["time_ms"])
            assert summary["gemm_ratio_tflops"][r["stage"]] == pytest.approx(r["ratio_tflops"])
    assert summary["gemm_ratio_min"] == pytest.approx(min(v for k, v in summary["gemm_ratio_tflops"].items()
                                                          if k != "gemm1_recompute"))
    with_torch = sum(r["ref_time_ms"] if r["stage"] in probe.GEMM_STAGES else r["time_ms"] for r in stages)
    assert summary["sum_stages_at_torch_gemms_ms"] == pytest.approx(with_torch)


@pytest.mark.interpreter
def test_stages_compose_to_moe_backward_w1_bitwise():
    """The probe's stages run in order equal moe_backward_w1's four gradients bit for bit, on a decision that leaves
    one expert without rows; every stage reads only what the point or an earlier stage provides."""
    from kosmos.reference import moe as mr
    from kosmos.ops.moe_backward.api import moe_backward_w1
    m = probe.point_model("qwen3-235b", smoke=True)
    pt = probe.build_point(m, 24, "uniform", seed=3)
    g = torch.Generator().manual_seed(5)
    allowed = torch.tensor([e for e in range(m.experts) if e != 5])  # expert 5 gets no rows
    pt.experts = allowed[torch.stack([torch.randperm(len(allowed), generator=g)[:m.top_k] for _ in range(24)])]
    logits = pt.inp.x.float() @ pt.inp.router_weight.float().t()
    pt.weights, _, _ = mr.routing_weights_ref(logits, pt.experts, m.routing)
    state = probe.initial_state(pt)
    for st in probe.make_stages(pt):
        assert set(st.needs) <= set(state), (st.name, set(st.needs) - set(state))
        state.update(st.fn(state))
    got = tuple(state[n] for n in probe.GRAD_NAMES)
    assert all(torch.equal(a, b) for a, b in zip(got, probe.compose(pt)))  # deterministic
    inp = pt.inp
    want = moe_backward_w1(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy, pt.weights, pt.experts,
                           one_launch=False, **inp.backward_kw())  # the launches the stages are
    for name, a, b in zip(probe.GRAD_NAMES, got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert torch.equal(got[2][5], torch.zeros_like(got[2][5]))


def test_point_model_shrinks_experts_and_picks_smoke_stand_ins():
    m = probe.point_model("deepseek-v3", experts_scale=2)
    assert (m.experts, m.n_group, m.topk_group, m.top_k, m.hidden) == (128, 8, 4, 8, 7168)
    with pytest.raises(ValueError, match="experts-scale 3"):
        probe.point_model("deepseek-v3", experts_scale=3)
    for name in ("qwen3-235b", "deepseek-v3"):
        tiny = probe.point_model(name, smoke=True)
        assert tiny.routing == probe.point_model(name).routing and tiny.hidden == 32


@pytest.mark.interpreter
def test_cpu_smoke_one_launch_whole_call(tmp_path, monkeypatch):
    """--one-launch: the whole call runs moe_backward's expert part in one launch, the stages stay the launches it
    replaces, and the summary's bitwise check holds between the two (qwen3's stand-in: softmax routing)."""
    from kosmos.ops.moe_backward import api as bwd_api, one_launch as bwd_one
    calls = []
    real = bwd_one.expert_backward_one_launch
    monkeypatch.setattr(bwd_api, "expert_backward_one_launch", lambda *a, **k: calls.append(k.get("config")) or real(
        *a, **k))
    out = tmp_path / "probe.jsonl"
    assert probe.main(["--cpu-smoke", "--one-launch", "--json", str(out)]) == 0
    rows = _rows(out)
    _check_rows(rows)
    assert rows[0]["one_launch"] is True and rows[0]["bwd_config"]["router_in_launch"] is False
    assert calls and all(c.one_launch and not c.router_in_launch for c in calls)  # the whole call took the launch
