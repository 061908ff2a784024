"""`kosmos bench train --hf` (kosmos_bench/train_hf.py) on the CPU: the configs at real sizes (built on the meta
device), the shape checks, and tiny models trained unpatched and patched with the reference layer standing in for
the kernels (tests/test_integrations_hf.py's Recorder), agreement and disagreement."""
from __future__ import annotations

import json
import math

import pytest
import torch

import kosmos.nn as knn
from kosmos.models import HF_CONFIGS, MOE_MODELS
from kosmos_bench import train_hf as th
from kosmos_bench.train import TrainSettings

from test_integrations_hf import HAS_HF, Recorder, needs_hf

TINY = {  # per family: a tiny config (hidden 64, expert FFN 32, 8 experts, top-2)
    "qwen3_moe": dict(hidden_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96),
    "deepseek_v3": dict(hidden_size=64, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                        n_group=4, topk_group=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16,
                        q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                        intermediate_size=96),
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16),
}
MODEL_OF = {"qwen3_moe": "qwen3-30b-a3b", "deepseek_v3": "deepseek-v3", "mixtral": "mixtral-8x7b"}


def test_resolve_model_names_and_families():
    assert th.resolve_model("qwen3_moe") == "qwen3-30b-a3b"
    assert th.resolve_model("qwen3-moe") == "qwen3-30b-a3b"
    assert th.resolve_model("DeepSeek_V3") == "deepseek-v3"
    assert th.resolve_model("qwen3-235b") == "qwen3-235b"
    with pytest.raises(ValueError, match="give a family") as e:
        th.resolve_model("llama3-8b")
    assert "\n" not in str(e.value)
    assert set(th.FAMILY_MODELS.values()) <= set(th.hf_models())


def test_hf_shape_checks_the_expert_count():
    assert th.hf_shape("deepseek-v3").n_experts == 64
    assert th.hf_shape("deepseek-v3", experts=256).n_experts == 256
    assert th.hf_shape("mixtral").n_experts == 8
    for bad in (60, 8):  # not a multiple of the 8 groups; 1 expert a group
        with pytest.raises(ValueError, match="--experts"):
            th.hf_shape("deepseek-v3", experts=bad)
    with pytest.raises(ValueError, match="at least 2"):
        th.hf_shape("mixtral", experts=1)


@needs_hf
@pytest.mark.parametrize("model", sorted(HF_CONFIGS))
def test_config_at_real_sizes(model):
    """Every layer is a sparse MoE block of the model's sizes; patch recognises each (its refusal is None)."""
    import transformers
    from kosmos.integrations.transformers import moe_blocks
    shape = th.hf_shape(model, layers=2)
    spec = MOE_MODELS[model]
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(th.hf_config(shape), dtype=torch.bfloat16)
    blocks = moe_blocks(m)
    assert len(blocks) == 2
    for _, block in blocks:
        assert tuple(block.experts.gate_up_proj.shape) == (shape.n_experts, 2 * spec.expert_ffn, spec.hidden)
        assert tuple(block.experts.down_proj.shape) == (shape.n_experts, spec.hidden, spec.expert_ffn)
        assert block.gate.top_k == spec.top_k
    assert m.config.num_attention_heads == HF_CONFIGS[model]["num_attention_heads"]
    assert m.config.vocab_size == th.DEFAULT_VOCAB


@needs_hf
def test_deepseek_parameter_count_and_footprint():
    """deepseek-v3 at 64 experts, 2 layers: the experts' 2 x 64 x 3 x 7168 x 2048 parameters dominate; the
    footprint is 8 bytes a parameter plus the logits."""
    shape = th.hf_shape("deepseek-v3")
    cfg = th.hf_config(shape)
    n = th.parameter_count(cfg)
    experts = 2 * 64 * 3 * 7168 * 2048
    assert experts < n < experts * 1.2
    assert th.footprint_bytes(cfg, shape) == 8 * n + 8 * 4096 * th.DEFAULT_VOCAB


def test_step_batch_labels_are_the_permuted_previous_token():
    shape = th.HFTrainShape("qwen3-30b-a3b", seq=32, batch=2, vocab=50)
    ids, labels = th.step_batch(shape, 3, 0, "cpu")
    ids2, labels2 = th.step_batch(shape, 3, 0, "cpu")
    assert torch.equal(ids, ids2) and torch.equal(labels, labels2)
    assert not torch.equal(ids, th.step_batch(shape, 4, 0, "cpu")[0])
    assert (labels[:, 0] == -100).all()
    # one permutation: the same token always maps to the same label, and distinct tokens to distinct labels
    pairs = {(int(a), int(b)) for a, b in zip(ids[:, :-1].flatten(), labels[:, 1:].flatten())}
    assert len({a for a, _ in pairs}) == len(pairs) == len({b for _, b in pairs})


@pytest.fixture
def reference_kernels(monkeypatch):
    """The reference layer in for the kernels, and the kosmos implementation allowed on the CPU."""
    rec = Recorder()
    monkeypatch.setattr(knn, "moe_forward", rec.forward)
    monkeypatch.setattr(knn, "moe_backward", Recorder.backward)
    monkeypatch.setattr(th, "kosmos_problem", lambda device: None)
    return rec


def _run(family, steps=4):
    """Tiny ``family`` model, 2 layers, 4 x 64 tokens of a 32-token vocabulary a step: the map is learnt within a
    few steps (the loss falls ~4% a step), so a wrong gradient shows within the bar's 2e-2."""
    shape = th.HFTrainShape(MODEL_OF[family], layers=2, seq=64, batch=4, vocab=32)
    rows = []
    th.run_train_hf(shape, TrainSettings(steps=steps, warmup=0, seed=3), "cpu", on_row=rows.append,
                    overrides=TINY[family])
    return rows


@needs_hf
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_patched_trains_like_transformers(reference_kernels, family):
    rows = _run(family)
    assert [r["impl"] for r in rows] == ["hf", "kosmos", "kosmos-experts"]
    base, k, ke = rows
    assert ke["status"] == "ok", ke["reason"]
    assert ke["extra"]["hf_experts_implementation"] == "kosmos"
    assert any(c["routing"] == "given" for c in reference_kernels.calls)
    assert ke["loss_max_rel_diff"] < 2e-2 and ke["extra"]["init_checksum"] == base["extra"]["init_checksum"]
    assert base["status"] == "ok" and base["baseline"] and base["extra"]["hf_experts_implementation"]
    assert k["status"] == "ok", k["reason"]
    assert k["extra"]["patched_blocks"] == 2 and len(reference_kernels.calls) > 0
    assert k["extra"]["init_checksum"] == base["extra"]["init_checksum"]
    assert len(k["losses"]) == 4 and all(math.isfinite(x) for x in k["losses"])
    assert k["loss_max_rel_diff"] < 2e-2
    assert base["losses"][-1] < base["losses"][0]  # it learns
    assert k["extra"]["config_overrides"] == TINY[family]
    json.dumps(rows)  # rows are JSON


@needs_hf
def test_a_wrong_gradient_fails_the_row(reference_kernels, monkeypatch):
    """The layer's gradients negated in the stand-in backward (AdamW does not see a scale): both KOSMOS paths train
    differently and their rows fail naming a step."""
    def wrong(*a, **kw):
        return tuple(-g for g in Recorder.backward(*a, **kw))
    monkeypatch.setattr(knn, "moe_backward", wrong)
    rows = _run("qwen3_moe", steps=10)
    for row in rows[1:]:
        assert row["status"] == "failed" and "trains differently" in row["reason"], row


def test_kosmos_unavailable_on_the_cpu():
    assert th.kosmos_problem("cpu") and th.kosmos_problem("cuda") is None
    if HAS_HF:
        rows = []
        th.run_train_hf(th.HFTrainShape("qwen3-30b-a3b", layers=1, seq=8, vocab=64), TrainSettings(steps=1, warmup=0),
                        "cpu", on_row=rows.append, overrides=TINY["qwen3_moe"])
        assert [r["status"] for r in rows] == ["ok", "unavailable", "unavailable"]
        assert all("CUDA" in r["reason"] for r in rows[1:])


def test_cli_refusals(tmp_path):
    from typer.testing import CliRunner
    from kosmos_bench.cli import app
    run = lambda *a: CliRunner().invoke(app, ["bench", "train", *a])  # noqa: E731
    for args, words in ((["--hf", "nope", "--dry-run"], "give a family"),
                        (["--hf", "mixtral", "--tp", "2", "--dry-run"], "one GPU"),
                        (["--hf", "mixtral", "--scale", "0.5", "--dry-run"], "real sizes"),
                        (["--hf", "mixtral", "--dtype", "mxfp8", "--dry-run"], "bf16"),
                        (["--hf", "mixtral", "--impl", "deepep", "--dry-run"], "hf, kosmos, kosmos-experts"),
                        (["--hf", "deepseek-v3", "--experts", "12", "--dry-run"], "multiple of 8"),
                        (["--experts", "8", "--dry-run"], "goes with --hf")):
        r = run(*args)
        assert r.exit_code == 2 and words in r.output, (args, r.output)
    r = run("--hf", "qwen3_moe", "--dry-run", "--out", str(tmp_path / "x.jsonl"))
    assert r.exit_code == 0 and "qwen3-30b-a3b" in r.output and "hf (baseline)" in r.output
    assert not (tmp_path / "x.jsonl").exists()
