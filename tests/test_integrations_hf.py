"""kosmos.integrations.transformers: transformers' sparse MoE blocks on KOSMOS (``patch``).

CPU (skipped cleanly without transformers >= 5.13): tiny models of the five families (hidden 64, expert FFN 32, 8
experts, top-2, 2 layers), bf16. ``kosmos.moe_forward`` refuses CPU tensors, so the ``reference_kernels``
fixture stands the fp32 reference layer in for it (kosmos.reference.moe.route + apply_routing_ref, as
test_moe_forward's nn tests do) and moe_reference.moe_backward_ref in for the backward: these tests check the
integration -- which blocks, which parameters (the model's own, as views), the routing each family gets, the
shared experts, the refusals -- not the kernels. One ``interpreter`` test runs the real backward kernels under
the Triton interpreter through a patched model.

Tolerances are derived from bf16 (EPS = 2^-8, its machine epsilon): the patched bf16 model's logits within 4 EPS
of the unpatched bf16 model's, its gradients within 10 EPS; and against the unpatched model in fp32 (the same
bf16 weights upcast), within twice transformers' own bf16 error (or 4 EPS when that is smaller). A routing
decision that flips (a token whose k-th and (k+1)-th scores are closer than bf16 rounding: transformers rounds
the softmax routers' logits to bf16, KOSMOS does not) changes a token's output completely, so the inputs are
drawn until every block's decision is the same in the three runs (``_agreeing_ids``), as the MoE bench redraws
tokens near a tie.

The "kosmos" experts implementation (``register_experts``; routing given by the model's own router): on the CPU
with the same reference standing in (moe_experts_backward_ref for the backward), each family's model with it
against the eager experts and the fp32 model, its refusals, ``patch(model, experts=True)`` on PhiMoE (a router
KOSMOS does not run), and one ``interpreter`` test on the real backward kernels.

GPU (``gpu``, ``slow``): every family at real-ish block sizes through the real kernels, each block's output and
gradients against the fp32 block on the same input; a patched model trains a step and generates; the "kosmos"
experts implementation forward and backward against transformers' grouped_mm and an fp32 eager copy on one routing.
"""
import math
import subprocess
import sys
import warnings

import pytest
import torch

import kosmos.nn as knn
from kosmos.reference import moe as mr


from kosmos.integrations import transformers as kt  # imports without transformers


def _has_transformers() -> bool:
    try:
        kt.require_transformers()
    except ImportError:
        return False
    return True


HAS_HF = _has_transformers()
needs_hf = pytest.mark.skipif(not HAS_HF, reason="needs transformers >= 5.13 (pip install 'kosmos[hf]')")

EPS = 2.0 ** -8
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3")
H, F, E, K = 64, 32, 8, 2


def tiny(family: str, layers: int = 2, **over):
    """(config, model class) of a tiny ``family`` model: hidden 64, expert FFN 32, 8 experts, top-2."""
    import transformers as tf
    common = dict(hidden_size=H, num_hidden_layers=layers, num_attention_heads=4, vocab_size=128,
                  max_position_embeddings=64, hidden_act="silu", bos_token_id=0, eos_token_id=1, pad_token_id=2)
    if family == "mixtral":
        cfg, cls = tf.MixtralConfig(**common, num_key_value_heads=2, intermediate_size=F, num_local_experts=E,
                                    num_experts_per_tok=K), tf.MixtralForCausalLM
    elif family == "qwen2_moe":
        cfg, cls = tf.Qwen2MoeConfig(**common, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=F,
                                     shared_expert_intermediate_size=48, num_experts=E, num_experts_per_tok=K,
                                     norm_topk_prob=False), tf.Qwen2MoeForCausalLM
    elif family == "qwen3_moe":
        cfg, cls = tf.Qwen3MoeConfig(**common, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                     moe_intermediate_size=F, num_experts=E, num_experts_per_tok=K,
                                     norm_topk_prob=True), tf.Qwen3MoeForCausalLM
    elif family == "olmoe":
        cfg, cls = tf.OlmoeConfig(**common, num_key_value_heads=2, intermediate_size=F, num_experts=E,
                                  num_experts_per_tok=K, norm_topk_prob=False), tf.OlmoeForCausalLM
    else:
        cfg, cls = tf.DeepseekV3Config(**common, num_key_value_heads=4, intermediate_size=96,
                                       moe_intermediate_size=F, n_routed_experts=E, num_experts_per_tok=K, n_group=4,
                                       topk_group=2, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16,
                                       q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                       routed_scaling_factor=2.5), tf.DeepseekV3ForCausalLM
    for key, value in over.items():
        setattr(cfg, key, value)
    return cfg, cls


def init_(model, seed: int):
    """Every matrix ~ N(0, 1/fan_in) (router logits ~ N(0, 1): decisions that mean something, unlike the zero or
    0.02-std initialisation), DeepSeek's score-correction bias ~ N(0, 0.05^2)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model


def build(family: str, seed: int = 0, layers: int = 2, dtype=torch.bfloat16, **over):
    """A tiny ``family`` model in ``dtype``, eval mode, and its unpatched fp32 twin (the same weights upcast; a config
    of its own, so that setting one model's experts implementation leaves the other's)."""
    import copy
    cfg, cls = tiny(family, layers, **over)
    torch.manual_seed(seed)
    model = init_(cls(cfg), seed).to(dtype).eval()
    ref32 = cls(copy.deepcopy(cfg))
    ref32.load_state_dict(model.state_dict())
    return model, ref32.float().eval()


def rel(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


class Recorder:
    """The reference layer standing in for the kernels (module docstring); records each forward call's routing
    decision (experts sorted per token) and the operands it was given."""

    def __init__(self):
        self.decisions, self.calls, self.moe_calls, self.experts_calls = [], [], [], []

    def forward(self, x, router_weight, w13, w2, *, top_k, routing, bias=None, group=None, return_routing=False,
                save_gu=False, precision="bf16", weights=None, experts=None, **kw):
        if routing == "given":  # the experts implementation: the decision came with the call
            assert router_weight is None and experts.shape == (x.shape[0], top_k)
            weights, experts = weights.float(), experts.long()
        else:
            weights, experts = mr.route(x, router_weight, top_k, routing, bias=bias, **kw)
        self.decisions.append(experts.sort(-1).values)
        self.calls.append(dict(x=x, router_weight=router_weight, w13=w13, w2=w2, top_k=top_k, routing=routing,
                               bias=bias, **kw))
        y = mr.apply_routing_ref(x, weights, experts, w13, w2).to(torch.bfloat16)
        if save_gu:
            return y, weights, experts, None
        return (y, weights, experts) if return_routing else y

    @staticmethod
    def backward(x, router_weight, w13, w2, dy, weights, experts, *, group=None, routing="softmax", saved_gu=None,
                 **kw):
        if routing == "given":  # (dx, d_weights fp32, dw13, dw2)
            dx, dw, dw13, dw2 = mr.moe_experts_backward_ref(x, w13, w2, dy, weights, experts)
            return dx.to(x.dtype), dw, dw13.to(w13.dtype), dw2.to(w2.dtype)
        grads = mr.moe_backward_ref(x, router_weight, w13, w2, dy, top_k=experts.shape[1], routing=routing,
                                    experts=experts, **kw)
        return tuple(g.to(like.dtype) for g, like in zip(grads, (x, router_weight, w13, w2)))


@pytest.fixture
def reference_kernels(monkeypatch):
    """The reference layer in for the kernels (Recorder); also records what the integration passes to
    kosmos.nn.moe (``moe_calls``: its router weight, w13 and w2 arguments) and to kosmos.nn.moe_experts
    (``experts_calls``: its w13, w2, top_k_index, top_k_weights)."""
    rec = Recorder()
    monkeypatch.setattr(knn, "moe_forward", rec.forward)
    monkeypatch.setattr(knn, "moe_backward", Recorder.backward)
    moe, moe_experts = knn.moe, knn.moe_experts

    def spy(x, router_weight, w13, w2, **kw):
        rec.moe_calls.append(dict(router_weight=router_weight, w13=w13, w2=w2))
        return moe(x, router_weight, w13, w2, **kw)

    def spy_experts(x, top_k_index, top_k_weights, w13, w2, **kw):
        rec.experts_calls.append(dict(w13=w13, w2=w2, top_k_index=top_k_index, top_k_weights=top_k_weights))
        return moe_experts(x, top_k_index, top_k_weights, w13, w2, **kw)
    monkeypatch.setattr(knn, "moe", spy)
    monkeypatch.setattr(knn, "moe_experts", spy_experts)
    return rec


def hf_decisions(model, ids):
    """Each sparse block's routing decision (experts sorted per token) in an unpatched forward of ``model``."""
    out = []
    hooks = [(getattr(block, "gate", None) or block.router).register_forward_hook(  # PhiMoE: ``router``
        lambda m, a, o: out.append(o[2].sort(-1).values)) for _, block in kt.moe_blocks(model)]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return out


def _agreeing_ids(model, ref32, rec, family, tokens=6, tries=40):
    """Token ids (1 x tokens) on which every block routes every token to the same experts in the unpatched bf16
    model, the fp32 model and the patched model (module docstring: routing flips); the first such draw."""
    for seed in range(tries):
        ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(1000 + seed))
        want = hf_decisions(model, ids)
        if any(not torch.equal(a, b) for a, b in zip(want, hf_decisions(ref32, ids))):
            continue
        rec.decisions.clear()
        with kt.patch(model), torch.no_grad():
            model(ids)
        if len(rec.decisions) == len(want) and all(torch.equal(a, b) for a, b in zip(want, rec.decisions)):
            return ids
    pytest.fail(f"{family}: no draw of {tokens} tokens in {tries} without a routing tie between bf16 and fp32")


def moe_grads(model, ids) -> dict:
    """{name: fp32 gradient} of every parameter of the sparse blocks for the LM loss on ``ids``."""
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()
    names = [n for n, _ in kt.moe_blocks(model)]
    return {n: p.grad.float().clone() for n, p in model.named_parameters()
            if any(n.startswith(b + ".") for b in names) and p.grad is not None}


def close_to_fp32(got, hf, fp32, tol) -> tuple[bool, str]:
    """The integration's bar: within ``tol`` of transformers' bf16 result, and within max(2x transformers' own
    bf16 error, 4 EPS) of the fp32 result."""
    e_hf, e_ref, e_own = rel(got, hf), rel(got, fp32), rel(hf, fp32)
    ok = e_hf <= tol and e_ref <= max(2 * e_own, 4 * EPS)
    return ok, f"vs bf16 {e_hf:.2e} (tol {tol:.1e}), vs fp32 {e_ref:.2e} (transformers' bf16 vs fp32 {e_own:.2e})"


# --------------------------------------------------------------------------- no GPU, no transformers


def test_imports_without_transformers_and_patch_says_what_is_missing(monkeypatch):
    """The module imports with transformers absent; patch() then raises one line naming the extra."""
    code = ("import sys; sys.modules['transformers'] = None\n"
            "import kosmos.integrations.transformers as kt\n"
            "try:\n    kt.patch(object())\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip()
    assert line.startswith("ERR ") and "\n" not in line and "kosmos[hf]" in line and "transformers >= 5.13" in line


# --------------------------------------------------------------------------- the routers


@needs_hf
@pytest.mark.parametrize("family", FAMILIES)
def test_router_math_is_kosmos_route(family):
    """Each family's router (fp32 model, random x) chooses the experts kosmos.reference.moe.route chooses with the
    arguments patch passes (route_kwargs), with the same weights: the routing KOSMOS runs for that block."""
    model, _ = build(family, layers=1, dtype=torch.float32)
    (_, block), = kt.moe_blocks(model)
    fam = kt.family_of(block)
    assert fam is not None and fam.name == family
    x = torch.randn(64, H, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, w_hf, e_hf = block.gate(x)
        kw = kt.route_kwargs(fam, block.gate)
        w_k, e_k = mr.route(x, block.gate.weight, kw.pop("top_k"), kw.pop("routing"), **kw)
    order_hf, order_k = e_hf.argsort(-1), e_k.argsort(-1)
    assert torch.equal(e_hf.gather(1, order_hf), e_k.gather(1, order_k))
    torch.testing.assert_close(w_hf.float().gather(1, order_hf), w_k.gather(1, order_k), rtol=1e-6, atol=1e-7)


# --------------------------------------------------------------------------- the five families, patched


@needs_hf
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_matches_unpatched(family, reference_kernels):
    """Every sparse block is patched; the patched model's logits and its blocks' gradients (router weight, expert
    parameters, shared experts) match the unpatched model's (module docstring: the tolerances); KOSMOS got the
    model's own parameters as views, the family's routing, and the shared experts ran as the model's modules."""
    model, ref32 = build(family)
    rec = reference_kernels
    ids = _agreeing_ids(model, ref32, rec, family)
    with torch.no_grad():
        want, want32 = model(ids).logits, ref32(ids).logits
    grads_hf, grads_32 = moe_grads(model.train(), ids), moe_grads(ref32.train(), ids)

    patched = kt.patch(model)
    blocks = dict(kt.moe_blocks(model))
    assert set(patched.blocks) == set(blocks) and len(blocks) == 2 and not patched.refused
    rec.calls.clear()
    rec.moe_calls.clear()
    with torch.no_grad():
        got = model.eval()(ids).logits
    ok, why = close_to_fp32(got, want, want32, 4 * EPS)
    assert ok, f"{family} logits: {why}"
    assert len(rec.moe_calls) == len(rec.calls) == 2
    for passed, call, block in zip(rec.moe_calls, rec.calls, blocks.values()):
        # the model's own tensors, as views (kosmos.nn.moe itself lays the transposed views out for the kernels)
        assert passed["router_weight"] is block.gate.weight
        assert passed["w13"]._base is block.experts.gate_up_proj and passed["w2"]._base is block.experts.down_proj
        assert passed["w13"].data_ptr() == block.experts.gate_up_proj.data_ptr()
        assert passed["w2"].data_ptr() == block.experts.down_proj.data_ptr()
        assert passed["w13"].shape == (E, H, 2 * F) and passed["w2"].shape == (E, F, H)
        assert call["top_k"] == K and call["renormalize"] == (family in ("mixtral", "qwen3_moe", "deepseek_v3"))
        if family == "deepseek_v3":
            assert call["routing"] == "sigmoid-grouped" and call["routed_scaling"] == 2.5
            assert (call["n_group"], call["topk_group"]) == (4, 2)
            assert torch.equal(call["bias"], block.gate.e_score_correction_bias.float())
    grads = moe_grads(model.train(), ids)
    assert set(grads) == set(grads_hf)
    assert any("shared_expert" in n for n in grads) == (family in ("qwen2_moe", "deepseek_v3"))
    for name in grads:
        ok, why = close_to_fp32(grads[name], grads_hf[name], grads_32[name], 10 * EPS)
        assert ok, f"{family} {name}: {why}"


@needs_hf
def test_parameters_stay_the_models_own(reference_kernels, tmp_path):
    """Patching copies and registers nothing: the same parameter objects and storage, the same state_dict keys and
    tensors; a save / load round trip of the patched model is the unpatched one's; an optimizer step moves the
    model's own expert parameters and router weight, and the next patched forward computes with the new values;
    gradients of two micro-batches accumulate into .grad."""
    model, _ = build("qwen3_moe")
    before = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    patched = kt.patch(model)
    assert len(patched.blocks) == 2
    assert {n: (p, p.data_ptr()) for n, p in model.named_parameters()} == before
    assert list(model.state_dict()) == keys
    torch.save(model.state_dict(), tmp_path / "sd.pt")
    fresh, _ = build("qwen3_moe", seed=1)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt"))
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))

    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))
    model.train()
    model(ids[:1], labels=ids[:1]).loss.backward()
    one = {n: p.grad.clone() for n, p in model.named_parameters() if ".mlp." in n}
    model(ids[1:], labels=ids[1:]).loss.backward()  # accumulates
    block = patched.blocks["model.layers.0.mlp"]
    for p in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj):
        assert p.grad is not None and p.grad.abs().sum() > 0
    assert any(not torch.equal(one[n], p.grad) for n, p in model.named_parameters() if n in one)
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    for p, name in ((block.gate.weight, "gate.weight"), (block.experts.gate_up_proj, "experts.gate_up_proj"),
                    (block.experts.down_proj, "experts.down_proj")):
        assert not torch.equal(p.detach(), old[f"model.layers.0.mlp.{name}"]), name
    reference_kernels.calls.clear()
    with torch.no_grad():
        model.eval()(ids)
    assert torch.equal(reference_kernels.calls[0]["w13"], block.experts.gate_up_proj.detach().transpose(1, 2))
    assert torch.equal(reference_kernels.calls[0]["router_weight"], block.gate.weight.detach())


@needs_hf
def test_unpatch_restores_and_patch_is_a_context(reference_kernels):
    """unpatch() gives every block its own forward back (the same output, bit for bit, as before patching);
    ``with patch(model):`` unpatches at its end; patching a patched model refuses every block as already patched."""
    model, _ = build("mixtral")
    ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model(ids).logits
    patched = kt.patch(model)
    with pytest.warns(kt.RefusedBlockWarning, match="already patched by kosmos"):
        again = kt.patch(model)
    assert not again.blocks and len(again.refused) == 2
    patched.unpatch()
    patched.unpatch()  # repeatable
    assert all("forward" not in b.__dict__ for _, b in kt.moe_blocks(model))
    reference_kernels.calls.clear()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert not reference_kernels.calls
    with kt.patch(model) as p, torch.no_grad():
        assert len(p.blocks) == 2
        model(ids)
    assert len(reference_kernels.calls) == 2
    assert all("forward" not in b.__dict__ for _, b in kt.moe_blocks(model))


@needs_hf
def test_inference_modes_and_generate(reference_kernels):
    """A patched model runs under torch.no_grad and torch.inference_mode (no autograd Function: the forward op
    directly) and in model.generate, whose decoding steps give the blocks one token per sequence."""
    model, _ = build("deepseek_v3")
    kt.patch(model)
    ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a = model(ids).logits
    with torch.inference_mode():
        b = model(ids).logits
    assert torch.equal(a, b) and a.grad_fn is None
    reference_kernels.calls.clear()
    out = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert out.shape == (2, 8)
    rows = [c["x"].shape[0] for c in reference_kernels.calls]
    assert rows[:2] == [10, 10] and rows[2:] == [2] * 4  # prefill (2 x 5 tokens, 2 layers), then 1 token a step


@needs_hf
def test_router_logits_for_the_aux_loss(reference_kernels):
    """With output_router_logits the patched model records the router logits the unpatched one records (the
    model's own router module runs for its recorder; the first layer's bit for bit), and the auxiliary loss
    trains the router weight."""
    model, ref32 = build("qwen3_moe")
    ids = _agreeing_ids(model, ref32, reference_kernels, "qwen3_moe")
    with torch.no_grad():
        want = model(ids, output_router_logits=True)
    kt.patch(model)
    reference_kernels.calls.clear()
    with torch.no_grad():
        got = model(ids, output_router_logits=True)
    assert len(got.router_logits) == 2 and len(reference_kernels.calls) == 2
    assert torch.equal(got.router_logits[0], want.router_logits[0])
    assert rel(got.router_logits[1], want.router_logits[1]) < 4 * EPS
    assert rel(got.aux_loss, want.aux_loss) < 4 * EPS
    block = dict(kt.moe_blocks(model))["model.layers.0.mlp"]
    model.train()
    model(ids, output_router_logits=True).aux_loss.backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0


# --------------------------------------------------------------------------- refusals


def _refused_one(model, expect: str, name="model.layers.0.mlp"):
    """patch(model) with one refused block ``name``: a RefusedBlockWarning naming it with ``expect``, the reason
    in .refused, the block left as it was; the other block patched (partial support does not raise)."""
    with pytest.warns(kt.RefusedBlockWarning) as caught:
        patched = kt.patch(model)
    msgs = [str(w.message) for w in caught if issubclass(w.category, kt.RefusedBlockWarning)]
    assert len(msgs) == 1 and name in msgs[0] and expect in msgs[0], msgs
    assert list(patched.refused) == [name] and expect in patched.refused[name]
    assert "forward" not in dict(kt.moe_blocks(model))[name].__dict__
    assert list(patched.blocks) == ["model.layers.1.mlp"]
    patched.unpatch()
    with pytest.raises(ValueError, match=f"1 of 2 .*{name}.*{expect.split()[0]}"):
        kt.patch(model, strict=True)
    assert all("forward" not in b.__dict__ for _, b in kt.moe_blocks(model))  # strict patches nothing


@needs_hf
def test_refuses_expert_biases():
    model, _ = build("qwen3_moe")
    experts = dict(kt.moe_blocks(model))["model.layers.0.mlp"].experts
    experts.gate_up_proj_bias = torch.nn.Parameter(torch.zeros(E, 2 * F, dtype=torch.bfloat16))
    _refused_one(model, "expert biases")


@needs_hf
def test_refuses_an_activation_other_than_silu():
    from transformers.activations import ACT2FN
    model, _ = build("mixtral")
    dict(kt.moe_blocks(model))["model.layers.0.mlp"].experts.act_fn = ACT2FN["gelu"]
    _refused_one(model, "is not SiLU")
    gelu, _ = build("olmoe", hidden_act="gelu")  # the whole model in gelu: both blocks refused
    with pytest.warns(kt.RefusedBlockWarning, match="hidden_act 'gelu' is not SiLU"):
        patched = kt.patch(gelu)
    assert not patched.blocks and len(patched.refused) == 2


@needs_hf
def test_refuses_interleaved_gate_up():
    model, _ = build("deepseek_v3")
    dict(kt.moe_blocks(model))["model.layers.0.mlp"].experts.is_concatenated = False
    _refused_one(model, "interleaved gate/up")


@needs_hf
def test_router_jitter_in_training(reference_kernels):
    """Mixtral's router jitter: refused in training mode; patched in eval mode, where such a block runs its own
    forward (with one warning) whenever it is put into training mode."""
    model, _ = build("mixtral", router_jitter_noise=0.1)
    model.train()
    with pytest.warns(kt.RefusedBlockWarning, match="router_jitter_noise=0.1 in training mode"):
        patched = kt.patch(model)
    assert not patched.blocks and len(patched.refused) == 2
    model.eval()
    patched = kt.patch(model)
    assert len(patched.blocks) == 2
    ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(6))
    reference_kernels.calls.clear()
    model.train()
    with pytest.warns(kt.RefusedBlockWarning, match="runs its own forward"):
        model(ids)
    assert not reference_kernels.calls
    model.eval()
    with torch.no_grad():
        model(ids)
    assert len(reference_kernels.calls) == 2


@needs_hf
def test_refuses_a_model_not_in_bf16():
    """An fp32 model: every block refused, saying to cast the model to bf16; strict=True raises that in one line."""
    model, _ = build("qwen2_moe", dtype=torch.float32)
    with pytest.warns(kt.RefusedBlockWarning, match="cast the model to bf16"):
        patched = kt.patch(model)
    assert not patched.blocks and set(patched.refused) == {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert all("torch.float32" in why for why in patched.refused.values())
    with pytest.raises(ValueError) as e:
        kt.patch(model, strict=True)
    assert "\n" not in str(e.value) and "2 of 2" in str(e.value)


@needs_hf
def test_an_fp32_router_weight_runs_rounded_to_bf16(reference_kernels):
    """transformers 5.25 keeps DeepSeek-V3's router weight fp32 in a bf16 model: the block is patched, the launch
    gets that weight rounded to bf16 (the output is the bf16-router model's, bit for bit), and the gradient lands
    on the fp32 parameter as the bf16-router model's gradient upcast."""
    import copy
    model, _ = build("deepseek_v3")
    model32r = copy.deepcopy(model)
    for _, block in kt.moe_blocks(model32r):
        block.gate.weight = torch.nn.Parameter(block.gate.weight.detach().float())
    patched32r = kt.patch(model32r, strict=True)
    assert len(kt.patch(model, strict=True).blocks) == len(patched32r.blocks) == 2
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(5))
    losses = [m.train()(ids, labels=ids).loss for m in (model, model32r)]
    assert torch.equal(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    for (_, a), (_, b) in zip(kt.moe_blocks(model), kt.moe_blocks(model32r)):
        assert b.gate.weight.grad.dtype == torch.float32 and a.gate.weight.grad.abs().sum() > 0
        assert torch.equal(b.gate.weight.grad, a.gate.weight.grad.float())
    patched32r.unpatch()
    for _, block in kt.moe_blocks(model32r):  # expert parameters in fp32 are still refused
        block.experts.down_proj = torch.nn.Parameter(block.experts.down_proj.detach().float())
        assert "torch.float32 (down_proj)" in kt.refusal(block)


@needs_hf
@pytest.mark.parametrize("over, expect", [
    (dict(num_local_experts=264), "E=264 experts > 256"),
    (dict(num_local_experts=24, num_experts_per_tok=17), "top_k=17 is not in [1, 16]"),
    (dict(intermediate_size=20), "multiples of 8"),
])
def test_refuses_shapes_kosmos_does_not_run(over, expect):
    model, _ = build("mixtral", layers=1, **over)
    with pytest.warns(kt.RefusedBlockWarning, match=expect.replace("[", r"\[").replace("]", r"\]")):
        patched = kt.patch(model)
    assert not patched.blocks and list(patched.refused) == ["model.layers.0.mlp"]


@needs_hf
def test_refuses_unknown_blocks_and_hooks():
    """A block class KOSMOS has not verified (a subclass of a known one), and hooks on the experts module (which
    the patched forward would skip) are refused; a model without sparse blocks patches nothing."""
    model, _ = build("qwen3_moe")
    blocks = dict(kt.moe_blocks(model))
    sub = type("MyQwen3MoeBlock", (type(blocks["model.layers.0.mlp"]),), {})
    blocks["model.layers.0.mlp"].__class__ = sub
    _refused_one(model, "is not a block KOSMOS runs")
    blocks["model.layers.0.mlp"].__class__ = sub.__mro__[1]
    handle = blocks["model.layers.0.mlp"].experts.register_forward_hook(lambda *a: None)
    _refused_one(model, "hooks on its experts module")
    handle.remove()
    with pytest.warns(kt.RefusedBlockWarning, match="no sparse MoE block"):
        assert not kt.patch(torch.nn.Linear(4, 4)).blocks
    with pytest.raises(ValueError, match="no sparse MoE block"):
        kt.patch(torch.nn.Linear(4, 4), strict=True)


# --------------------------------------------------------------------------- the "kosmos" experts implementation


def _impl(model, impl: str):
    model.set_experts_implementation(impl)
    return model


def _agreeing_experts_ids(model, ref32, family, tokens=6, tries=40):
    """Token ids on which every block routes every token alike in the bf16 model (its own router, whatever the
    experts implementation) and the fp32 model (module docstring: routing flips)."""
    for seed in range(tries):
        ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(2000 + seed))
        _impl(model, "eager")
        want = hf_decisions(model, ids)
        _impl(model, "kosmos")
        got = hf_decisions(model, ids)
        if all(torch.equal(a, b) for a, b in zip(want, hf_decisions(ref32, ids))) and \
                all(torch.equal(a, b) for a, b in zip(want, got)):
            return ids
    pytest.fail(f"{family}: no draw of {tokens} tokens in {tries} without a routing tie between bf16 and fp32")


@needs_hf
def test_register_experts_is_idempotent():
    """register_experts puts experts_forward into transformers' ExpertsInterface as "kosmos" (once, however often
    called); a model then selects it by name, and from_config takes it as experts_implementation."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    assert kt.register_experts() == kt.register_experts() == "kosmos" == kt.EXPERTS_IMPLEMENTATION
    assert ALL_EXPERTS_FUNCTIONS["kosmos"] is kt.experts_forward and list(ALL_EXPERTS_FUNCTIONS).count("kosmos") == 1
    model, _ = build("mixtral", layers=1)
    model.set_experts_implementation("kosmos")
    assert model.config._experts_implementation == "kosmos" and model.get_experts_implementation() == {"": "kosmos"}
    cfg, cls = tiny("qwen3_moe", layers=1)
    assert cls._from_config(cfg, experts_implementation="kosmos").config._experts_implementation == "kosmos"
    (_, block), = kt.moe_blocks(model)
    assert kt.uses_experts_interface(block.experts) and kt.experts_refusal(block.experts) is None
    assert not kt.uses_experts_interface(block.gate) and not kt.uses_experts_interface(None)


@needs_hf
@pytest.mark.parametrize("family", FAMILIES)
def test_kosmos_experts_matches_eager(family, reference_kernels):
    """The model with experts_implementation "kosmos" (the reference standing in for the kernels): its logits and
    its blocks' gradients (router weight -- through the given weights' gradient --, gate_up_proj, down_proj, shared
    experts) match the same bf16 model with transformers' eager experts and the fp32 model (module docstring: the
    tolerances); kosmos.nn.moe_experts got the experts' own parameters as views and the router's decision as it
    is, once per block."""
    kt.register_experts()
    model, ref32 = build(family)
    _impl(ref32, "eager")
    rec = reference_kernels
    ids = _agreeing_experts_ids(model, ref32, family)
    _impl(model, "eager")
    with torch.no_grad():
        want, want32 = model(ids).logits, ref32(ids).logits
    grads_hf, grads_32 = moe_grads(model.train(), ids), moe_grads(ref32.train(), ids)
    _impl(model.eval(), "kosmos")
    rec.experts_calls.clear()
    with torch.no_grad():
        got = model(ids).logits
    ok, why = close_to_fp32(got, want, want32, 4 * EPS)
    assert ok, f"{family} logits: {why}"
    blocks = dict(kt.moe_blocks(model))
    assert len(rec.experts_calls) == 2 and not rec.moe_calls
    for passed, block in zip(rec.experts_calls, blocks.values()):
        assert passed["w13"]._base is block.experts.gate_up_proj and passed["w2"]._base is block.experts.down_proj
        assert passed["w13"].shape == (E, H, 2 * F) and passed["w2"].shape == (E, F, H)
        assert passed["top_k_index"].shape == (ids.numel(), K) and not passed["top_k_index"].is_floating_point()
    grads = moe_grads(model.train(), ids)
    assert set(grads) == set(grads_hf) and any(n.endswith("gate.weight") for n in grads)
    for name in grads:
        ok, why = close_to_fp32(grads[name], grads_hf[name], grads_32[name], 10 * EPS)
        assert ok, f"{family} {name}: {why}"


@needs_hf
def test_kosmos_experts_refusals():
    """experts_forward raises one ValueError line naming the experts module and the reason for what it cannot run:
    biases, no gate, interleaved or transposed layouts, another activation, a custom _apply_gate, fp32 parameters or
    hidden states, a tensor- or expert-parallel plan (transformers' EP sentinels), more than 16 slots; through a
    model too."""
    from transformers.activations import ACT2FN
    kt.register_experts()

    def fresh():
        model, _ = build("qwen3_moe", layers=1)
        return model, dict(kt.moe_blocks(model))["model.layers.0.mlp"].experts
    x = torch.randn(5, H).to(torch.bfloat16)
    idx, wts = torch.tensor([[0, 1]] * 5), torch.full((5, 2), 0.5, dtype=torch.bfloat16)
    cases = [
        (lambda m, ex: setattr(ex, "gate_up_proj_bias", torch.nn.Parameter(torch.zeros(E, 2 * F))), "expert biases"),
        (lambda m, ex: setattr(ex, "has_gate", False), "experts without a gate"),
        (lambda m, ex: setattr(ex, "is_concatenated", False), "interleaved gate/up"),
        (lambda m, ex: setattr(ex, "is_transposed", True), "is_transposed=True"),
        (lambda m, ex: setattr(ex, "has_post_expert_norm", True), "has_post_expert_norm=True"),
        (lambda m, ex: setattr(ex, "_is_expert_parallel", True), "expert parallelism"),
        (lambda m, ex: setattr(ex, "act_fn", ACT2FN["gelu"]), "is not SiLU"),
        (lambda m, ex: setattr(ex, "__class__", type("Gated", (type(ex),), {"_apply_gate": lambda s, t: t})),
         "custom gating"),
        (lambda m, ex: m.float(), "parameters in torch.float32"),
        (lambda m, ex: setattr(ex, "_is_hooked", True), "tensor- or expert-parallel plan"),
        (lambda m, ex: setattr(ex, "num_experts", E // 2), "tensor- or expert-parallel plan"),
    ]
    for mutate, match in cases:
        model, experts = fresh()
        mutate(model, experts)
        with pytest.raises(ValueError, match=match) as err:
            kt.experts_forward(experts, x, idx, wts)
        assert "\n" not in str(err.value) and str(err.value).startswith("kosmos experts implementation: ")
    model, experts = fresh()
    with pytest.raises(ValueError, match="hidden states in torch.float32"):
        kt.experts_forward(experts, x.float(), idx, wts)
    with pytest.raises(ValueError, match="is not \\[T, k\\] with 1 <= k <= 16"):
        kt.experts_forward(experts, x, torch.zeros(5, 17, dtype=torch.long), torch.zeros(5, 17))
    with pytest.raises(ValueError, match="CUDA"):  # everything else runs: the kernels need CUDA
        kt.experts_forward(experts, x, idx, wts)
    experts.act_fn = ACT2FN["gelu"]
    model.set_experts_implementation("kosmos")
    with pytest.raises(ValueError, match="Qwen3MoeExperts: its act_fn GELUActivation is not SiLU"):
        model(torch.randint(3, 128, (1, 4)))


def tiny_phimoe(layers: int = 2):
    """A tiny PhiMoE model (bf16, eval) and its fp32 twin: a router KOSMOS does not run (sparsemixer), experts that
    dispatch through the ExpertsInterface."""
    import copy
    import transformers as tf
    cfg = tf.PhimoeConfig(hidden_size=H, num_hidden_layers=layers, num_attention_heads=4, vocab_size=128,
                          max_position_embeddings=64, hidden_act="silu", bos_token_id=0, eos_token_id=1,
                          pad_token_id=2, num_key_value_heads=2, intermediate_size=F, num_local_experts=E,
                          num_experts_per_tok=K)
    torch.manual_seed(0)
    model = init_(tf.PhimoeForCausalLM(cfg), 0).to(torch.bfloat16).eval()
    ref32 = tf.PhimoeForCausalLM(copy.deepcopy(cfg))
    ref32.load_state_dict(model.state_dict())
    return model, ref32.float().eval()


@needs_hf
def test_patch_experts_serves_blocks_with_other_routers(reference_kernels):
    """patch(model, experts=True) on PhiMoE (its sparsemixer router is not one KOSMOS runs): no block patched or
    refused, both blocks' experts on the "kosmos" experts implementation (model-wide), the router the model's; its
    logits match the eager experts' and the fp32 model's; gradients reach the experts; unpatch
    restores the implementation before. Without experts=True both blocks are refused; a model in fp32 gets the
    experts' reason too and nothing changes; a model of verified blocks keeps its implementation."""
    model, ref32 = tiny_phimoe()
    with pytest.warns(kt.RefusedBlockWarning, match="is not a block KOSMOS runs"):
        assert len(kt.patch(model).refused) == 2
    ids = _agreeing_experts_ids(model, _impl(ref32, "eager"), "phimoe")
    _impl(model, "grouped_mm")
    with torch.no_grad():
        want, want32 = model(ids).logits, ref32(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error", kt.RefusedBlockWarning)
        patched = kt.patch(model, experts=True, strict=True)
    assert not patched.blocks and not patched.refused and set(patched.experts) == {"model.layers.0.mlp",
                                                                                  "model.layers.1.mlp"}
    assert patched.experts_before == {"": "grouped_mm"} and model.config._experts_implementation == "kosmos"
    assert "2 on the kosmos experts implementation, 0 refused" in str(patched)
    reference_kernels.experts_calls.clear()
    with torch.no_grad():
        got = model(ids).logits
    assert len(reference_kernels.experts_calls) == 2
    ok, why = close_to_fp32(got, want, want32, 4 * EPS)
    assert ok, f"phimoe logits: {why}"
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids).loss.backward()  # eval mode: sparsemixer's deterministic path
    experts = patched.experts["model.layers.0.mlp"]
    assert experts.gate_up_proj.grad.abs().sum() > 0 and experts.down_proj.grad.abs().sum() > 0
    patched.unpatch()
    patched.unpatch()
    assert model.config._experts_implementation == "grouped_mm"
    fp32, _ = tiny_phimoe(layers=1)
    with pytest.warns(kt.RefusedBlockWarning, match="nor can its experts run the kosmos experts implementation: "
                                                    "parameters in torch.float32"):
        p32 = kt.patch(fp32.float(), experts=True)
    assert not p32.experts and p32.experts_before is None and fp32.config._experts_implementation == "grouped_mm"
    verified, _ = build("qwen3_moe")
    p = kt.patch(verified, experts=True)
    assert len(p.blocks) == 2 and not p.experts and verified.config._experts_implementation == "grouped_mm"


@needs_hf
@pytest.mark.interpreter
def test_kosmos_experts_trains_on_the_backward_kernels(monkeypatch):
    """The "kosmos" experts implementation on a one-layer Qwen3-MoE: the forward stood in (its g | u saved as
    moe_forward(save_gu=True) keeps it), the backward moe_backward(routing="given") on KOSMOS's kernels under the
    interpreter; the block's gradients (router weight through the given weights, both expert parameters) as in
    test_kosmos_experts_matches_eager."""
    import simranks
    rec = Recorder()

    def forward(x, router_weight, w13, w2, *, save_gu=False, **kw):
        out = rec.forward(x, router_weight, w13, w2, save_gu=False, **kw)
        if not save_gu:
            return out
        return (*out, simranks.placed_gate_up(x, w13, kw["experts"].long(), kw["top_k"],
                                              torch.Generator().manual_seed(0)))
    monkeypatch.setattr(knn, "moe_forward", forward)
    backward, ran = knn.moe_backward, []
    monkeypatch.setattr(knn, "moe_backward", lambda *a, **kw: ran.append(kw) or backward(*a, **kw))
    kt.register_experts()
    model, ref32 = build("qwen3_moe", layers=1)
    _impl(ref32, "eager")
    ids = _agreeing_experts_ids(model, ref32, "qwen3_moe", tokens=5)
    _impl(model, "eager")
    grads_hf, grads_32 = moe_grads(model.train(), ids), moe_grads(ref32.train(), ids)
    _impl(model, "kosmos")
    grads = moe_grads(model, ids)
    assert len(ran) == 1 and ran[0]["saved_gu"] is not None and ran[0]["routing"] == "given"
    assert set(grads) == set(grads_hf)
    for name in grads:
        ok, why = close_to_fp32(grads[name], grads_hf[name], grads_32[name], 10 * EPS)
        assert ok, f"{name}: {why}"


# --------------------------------------------------------------------------- the real backward (interpreter)


@needs_hf
@pytest.mark.interpreter
def test_patched_deepseek_trains_on_the_backward_kernels(monkeypatch):
    """A patched one-layer DeepSeek-V3 (sigmoid-grouped routing, score-correction bias, routed scaling, a shared
    expert): the forward stood in (its g | u saved as moe_forward(save_gu=True) keeps it), the backward on
    KOSMOS's kernels under the interpreter; the block's gradients as in test_patched_model_matches_unpatched."""
    import simranks
    rec = Recorder()

    def forward(x, router_weight, w13, w2, *, save_gu=False, **kw):
        out = rec.forward(x, router_weight, w13, w2, save_gu=False, **kw)
        if not save_gu:
            return out
        experts = mr.route(x, router_weight, kw["top_k"], kw["routing"], bias=kw.get("bias"),
                           **{k: v for k, v in kw.items() if k in ("renormalize", "n_group", "topk_group",
                                                                   "routed_scaling")})[1]
        return (*out, simranks.placed_gate_up(x, w13, experts, kw["top_k"], torch.Generator().manual_seed(0)))
    monkeypatch.setattr(knn, "moe_forward", forward)
    backward, ran = knn.moe_backward, []
    monkeypatch.setattr(knn, "moe_backward", lambda *a, **kw: ran.append(kw) or backward(*a, **kw))
    model, ref32 = build("deepseek_v3", layers=1)
    ids = _agreeing_ids(model, ref32, rec, "deepseek_v3", tokens=5)
    grads_hf, grads_32 = moe_grads(model.train(), ids), moe_grads(ref32.train(), ids)
    kt.patch(model)
    grads = moe_grads(model, ids)
    assert len(ran) == 1 and ran[0]["saved_gu"] is not None and ran[0]["routed_scaling"] == 2.5
    assert set(grads) == set(grads_hf)
    for name in grads:
        ok, why = close_to_fp32(grads[name], grads_hf[name], grads_32[name], 10 * EPS)
        assert ok, f"{name}: {why}"


# --------------------------------------------------------------------------- GPU: the real kernels

# real-ish block sizes: each family's real expert count and top-k (Mixtral-8x7B, Qwen1.5-MoE-A2.7B, Qwen3-30B-A3B,
# OLMoE-1B-7B, DeepSeek-V3), hidden 1024 and expert FFNs at or near the real ones
GPU_SIZES = {
    "mixtral": dict(intermediate_size=3584, num_local_experts=8, num_experts_per_tok=2),
    "qwen2_moe": dict(moe_intermediate_size=1408, shared_expert_intermediate_size=2816, num_experts=60,
                      num_experts_per_tok=4),
    "qwen3_moe": dict(moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
    "olmoe": dict(intermediate_size=1024, num_experts=64, num_experts_per_tok=8),
    "deepseek_v3": dict(moe_intermediate_size=512, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                        topk_group=4),
}
GPU_HIDDEN = 1024
GPU_DEVICE = "cuda"
FWD_TOL, GRAD_TOL = 1e-2, 3e-2  # the MoE bench's bars (kosmos_bench.moe: bf16 forward, GRAD_TOLERANCE)


def gpu_model(family: str, layers: int, seed: int = 0, device=None):
    """A ``family`` model at GPU_SIZES with hidden 1024 on ``device`` in bf16 (train mode), weights as ``init_``
    draws them (there)."""
    cfg, cls = tiny(family, layers, hidden_size=GPU_HIDDEN, vocab_size=512, **GPU_SIZES[family])
    if family == "qwen2_moe":
        cfg.intermediate_size = 2816
    torch.manual_seed(seed)
    device = device or GPU_DEVICE
    with torch.device(device):
        model = cls(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, device=device) / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g, device=device) * 0.05)
    return model.to(torch.bfloat16)


def tie_free_rows(block, rows: int, seed: int):
    """x [rows, H] bf16 ~ N(0, 1) on the block's device, every token's routing margin (kosmos_bench.moe.routing_margin, the MoE
    bench's rule) >= its ROUTING_MARGIN: the kernels' tensor-core logits and the fp32 block's choose alike."""
    from kosmos.models import MoEModel
    from kosmos_bench.moe import ROUTING_MARGIN, routing_margin
    kw = kt.route_kwargs(kt.family_of(block), block.gate)
    e, h = block.gate.weight.shape
    m = MoEModel("block", hidden=h, expert_ffn=block.experts.down_proj.shape[2], experts=e, top_k=kw["top_k"],
                 routing=kw["routing"], renormalize=kw["renormalize"], n_group=kw.get("n_group", 1),
                 topk_group=kw.get("topk_group", 1), routed_scaling=kw.get("routed_scaling", 1.0))
    dev = block.gate.weight.device
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(rows, h, generator=g, device=dev, dtype=torch.bfloat16)
    for _ in range(30):
        bad = (routing_margin(x, block.gate.weight.detach(), m, kw.get("bias")) < ROUTING_MARGIN).nonzero()[:, 0]
        if bad.numel() == 0:
            return x
        x[bad] = torch.randn(bad.numel(), h, generator=g, device=dev, dtype=torch.bfloat16)
    pytest.fail("could not draw tie-free tokens")


@needs_hf
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_patched_block_against_fp32(family):
    """A patched block of each family on the real kernels (2 x 128 tokens): its output and every gradient (x, the
    router weight, gate_up_proj, down_proj, the shared experts') against the same block in fp32 on the same input
    (transformers' own code: the unpatched forward) -- relative Frobenius errors within the MoE bench's bars;
    transformers' bf16 block's errors are in the message for comparison."""
    import copy
    model = gpu_model(family, layers=1)
    (name, block), = kt.moe_blocks(model)
    ref32 = copy.deepcopy(block).float()
    own = copy.deepcopy(block)
    patched = kt.patch(model, strict=True)
    assert list(patched.blocks) == [name]
    x = tie_free_rows(block, 256, seed=1).view(2, 128, GPU_HIDDEN)
    dy = torch.randn(x.shape, device=GPU_DEVICE, dtype=torch.bfloat16,
                     generator=torch.Generator(device=GPU_DEVICE).manual_seed(2))
    outs = {}
    for key, mod, dtype in (("kosmos", block, torch.bfloat16), ("fp32", ref32, torch.float32),
                            ("hf-bf16", own, torch.bfloat16)):
        xi = x.detach().to(dtype).requires_grad_(True)
        y = mod(xi)
        y.backward(dy.to(dtype))
        outs[key] = {"y": y.detach(), "dx": xi.grad, **{n: p.grad for n, p in mod.named_parameters()}}
    assert set(outs["kosmos"]) == set(outs["fp32"]) and all(v is not None for v in outs["kosmos"].values())
    for key, tol in [("y", FWD_TOL)] + [(k, GRAD_TOL) for k in outs["kosmos"] if k != "y"]:
        err = rel(outs["kosmos"][key], outs["fp32"][key])
        assert err <= tol, (f"{family} {key}: {err:.2e} > {tol:.0e} (transformers' bf16 block: "
                            f"{rel(outs['hf-bf16'][key], outs['fp32'][key]):.2e})")


@needs_hf
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_patched_model_trains_and_generates(family):
    """A patched two-layer model of each family on the real kernels: one training step (the loss within 2e-2 of
    the unpatched bf16 model's -- both bf16, routing flips included; gradients on every block's expert
    parameters; an optimizer step moves them), then model.generate (one token a step through the kernels)."""
    model = gpu_model(family, layers=2).train()
    ids = torch.randint(3, 512, (2, 64), device=GPU_DEVICE,
                        generator=torch.Generator(device=GPU_DEVICE).manual_seed(3))
    want = model(ids, labels=ids).loss.item()
    model.zero_grad(set_to_none=True)
    patched = kt.patch(model, strict=True)
    assert len(patched.blocks) == 2
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert math.isfinite(loss.item()) and abs(loss.item() - want) <= 2e-2 * abs(want), (loss.item(), want)
    experts = [b.experts for b in patched.blocks.values()]
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for e in experts for p in (e.gate_up_proj, e.down_proj))
    old = experts[0].gate_up_proj.detach().clone()
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    assert not torch.equal(old, experts[0].gate_up_proj.detach())
    model.eval()
    out = model.generate(ids[:, :8], max_new_tokens=4, min_new_tokens=4, do_sample=False)
    assert out.shape == (2, 12) and bool((out[:, :8] == ids[:, :8]).all())


@needs_hf
@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_kosmos_experts_against_grouped_mm(family, no_tf32):
    """The "kosmos" experts implementation on the real kernels, forward and backward through transformers'
    ExpertsInterface, against its "grouped_mm" on the same bf16 experts module and "eager" on an fp32 copy, all
    three given the same routing (the bf16 block's router on 256 tie-free tokens: top_k_index and top_k_weights):
    the output and the gradients of hidden_states, top_k_weights, gate_up_proj and down_proj within the MoE bench's
    bars of the fp32 experts, and of grouped_mm's within those bars plus grouped_mm's own error (one routing for
    all three: a mismatch would be of order 1)."""
    import copy
    kt.register_experts()
    model = gpu_model(family, layers=1)
    (_, block), = kt.moe_blocks(model)
    x = tie_free_rows(block, 256, seed=1)
    with torch.no_grad():
        _, weights, index = block.gate(x)
    dy = torch.randn(x.shape, device=GPU_DEVICE, dtype=torch.bfloat16,
                     generator=torch.Generator(device=GPU_DEVICE).manual_seed(2))
    outs = {}
    for impl, dtype in (("kosmos", torch.bfloat16), ("grouped_mm", torch.bfloat16), ("eager", torch.float32)):
        experts = copy.deepcopy(block.experts).to(dtype)  # a config of its own: the implementation per copy
        experts.config._experts_implementation = impl
        xi = x.detach().to(dtype).requires_grad_(True)
        wi = weights.detach().to(dtype if impl == "eager" else weights.dtype).requires_grad_(True)
        y = experts(xi, index, wi)
        assert y.shape == x.shape and y.dtype == dtype
        y.backward(dy.to(dtype))
        outs[impl] = {"y": y.detach(), "dx": xi.grad, "d_weights": wi.grad,
                      **{n: p.grad for n, p in experts.named_parameters()}}
    assert set(outs["kosmos"]) == set(outs["eager"]) == {"y", "dx", "d_weights", "gate_up_proj", "down_proj"}
    assert outs["kosmos"]["d_weights"].dtype == weights.dtype
    for key, tol in [("y", FWD_TOL)] + [(k, GRAD_TOL) for k in outs["kosmos"] if k != "y"]:
        err = rel(outs["kosmos"][key], outs["eager"][key])
        err_hf = rel(outs["grouped_mm"][key], outs["eager"][key])
        assert err <= tol, f"{family} {key}: {err:.2e} > {tol:.0e} (transformers' grouped_mm: {err_hf:.2e})"
        assert rel(outs["kosmos"][key], outs["grouped_mm"][key]) <= tol + err_hf, (family, key, err, err_hf)
