"""MoE references: routing (both modes), dispatch/fold bookkeeping of the all-to-all layer vs the local
reference, at world 1 and (over gloo, on the CPU) world 2, including empty experts and all tokens to one
expert."""
import os

import pytest
import torch
import torch.distributed as dist

from multiproc import spawn_gloo

from kosmos.models import MOE_MODELS
from kosmos.reference.moe import expert_ffn, moe_forward_a2a, moe_forward_ref_local, route


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_softmax_routing_renormalised():
    g = _gen(0)
    x, wr = torch.randn(37, 64, generator=g), torch.randn(8, 64, generator=g)
    w, e = route(x, wr, 2, "softmax")
    p = torch.softmax(x @ wr.t(), -1)
    top = p.topk(2, -1)
    assert torch.equal(e, top.indices)
    torch.testing.assert_close(w, top.values / top.values.sum(-1, keepdim=True))
    w2, _ = route(x, wr, 2, "softmax", renormalize=False)
    torch.testing.assert_close(w2, top.values)


def _grouped_topk_per_token(scores, bias, k, n_group, topk_group, scaling, renorm):
    """Token-by-token restatement of DeepSeek-V3's group-limited routing (written independently)."""
    t_count, n_exp = scores.shape
    size = n_exp // n_group
    weights, experts = [], []
    for t in range(t_count):
        choice = (scores[t] + bias).tolist()
        gscore = [sum(sorted(choice[g * size:(g + 1) * size], reverse=True)[:2]) for g in range(n_group)]
        groups = sorted(range(n_group), key=lambda g: -gscore[g])[:topk_group]
        cands = [i for g in groups for i in range(g * size, (g + 1) * size)]
        chosen = sorted(cands, key=lambda i: -choice[i])[:k]
        w = torch.tensor([scores[t, i].item() for i in chosen])
        if renorm:
            w = w / w.sum()
        weights.append(w * scaling)
        experts.append(chosen)
    return torch.stack(weights), torch.tensor(experts)


def test_sigmoid_grouped_routing_matches_per_token_rule():
    g = _gen(1)
    x, wr = torch.randn(50, 32, generator=g), torch.randn(32, 32, generator=g)
    bias = torch.randn(32, generator=g) * 0.5
    w, e = route(x, wr, 4, "sigmoid-grouped", bias=bias, n_group=8, topk_group=3, routed_scaling=2.5)
    w_ref, e_ref = _grouped_topk_per_token(torch.sigmoid(x @ wr.t()), bias, 4, 8, 3, 2.5, True)
    assert torch.equal(e, e_ref)
    torch.testing.assert_close(w, w_ref)
    # the bias steers selection only: the weights are the unbiased sigmoid scores
    s = torch.sigmoid(x @ wr.t()).gather(1, e)
    torch.testing.assert_close(w, 2.5 * s / s.sum(-1, keepdim=True))


@pytest.mark.parametrize("kw, msg", [
    (dict(routing="topk-magic"), "unknown routing"),
    (dict(top_k=9), "top_k"),
    (dict(routing="sigmoid-grouped", n_group=3), "n_group"),
    (dict(routing="sigmoid-grouped", n_group=4, topk_group=1, top_k=3), "exceeds"),
])
def test_routing_errors(kw, msg):
    x, wr = torch.randn(4, 8), torch.randn(8, 8)
    args = dict(top_k=2, routing="softmax")
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        route(x, wr, args.pop("top_k"), args.pop("routing"), **args)


def test_model_registry_has_published_moe_configs():
    ds = MOE_MODELS["deepseek-v3"]
    assert (ds.hidden, ds.expert_ffn, ds.experts, ds.top_k, ds.n_group, ds.topk_group) == (7168, 2048, 256, 8, 8, 4)
    assert MOE_MODELS["qwen3-235b"].experts == 128 and MOE_MODELS["mixtral-8x7b"].top_k == 2
    assert not MOE_MODELS["qwen2-57b"].renormalize


def _layer(seed, world, tokens, hidden=32, ffn=16, experts=8):
    g = _gen(seed)
    xs = [torch.randn(tokens, hidden, generator=g) for _ in range(world)]
    wr = torch.randn(experts, hidden, generator=g)
    w13 = [torch.randn(experts // world, hidden, 2 * ffn, generator=g) / hidden ** 0.5 for _ in range(world)]
    w2 = [torch.randn(experts // world, ffn, hidden, generator=g) / ffn ** 0.5 for _ in range(world)]
    return xs, wr, w13, w2


def test_local_reference_against_dense_loop():
    xs, wr, w13, w2 = _layer(2, 1, 11)
    y = moe_forward_ref_local(xs, wr, w13, w2, top_k=3)[0]
    w, e = route(xs[0], wr, 3)
    for t in range(11):
        want = sum(w[t, j] * expert_ffn(xs[0][t:t + 1], w13[0][e[t, j]], w2[0][e[t, j]])[0] for j in range(3))
        torch.testing.assert_close(y[t], want, rtol=1e-5, atol=1e-5)


def test_a2a_world1_matches_local_reference_with_skew():
    xs, wr, w13, w2 = _layer(3, 1, 40)
    wr[5] += 50 * xs[0].mean(0)  # most tokens pick expert 5; others stay empty
    y = moe_forward_a2a(xs[0], wr, w13[0], w2[0], top_k=2)
    torch.testing.assert_close(y, moe_forward_ref_local(xs, wr, w13, w2, top_k=2)[0], rtol=1e-5, atol=1e-5)


def _gloo_rank(rank, world, port, q, case):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        xs, wr, w13, w2 = _layer(4, world, 24)
        kw = {}
        if case == "all-to-one":
            wr = torch.full_like(wr, -1.0)
            wr[1] = 1.0  # everything to expert 1 (rank 0), top_k=1: rank 1's experts get nothing
            xs = [x.abs() for x in xs]
        if case == "grouped":
            kw = dict(routing="sigmoid-grouped", n_group=4, topk_group=2, routed_scaling=2.0,
                      bias=torch.linspace(-0.5, 0.5, 8))
        top_k = 1 if case == "all-to-one" else 3
        y = moe_forward_a2a(xs[rank], wr, w13[rank], w2[rank], top_k=top_k, **kw)
        ref = moe_forward_ref_local(xs, wr, w13, w2, top_k=top_k, **kw)[rank]
        q.put((rank, float((y - ref).norm() / ref.norm())))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", ["uniform", "all-to-one", "grouped"])
def test_a2a_world2_over_gloo_matches_local_reference(case):
    errs = spawn_gloo(_gloo_rank, 2, case)
    assert max(errs.values()) < 1e-5, errs


# ---- the backward reference (issue 15): moe_backward_ref against autograd ---------------------------------------

from kosmos.reference.moe import (_pairs_by_expert, apply_routing_ref, backward_saved_bytes,  # noqa: E402
                                  gate_grad_from_h_ref, moe_backward_ref)

F64 = torch.float64


def _forward64(x, wr, w13, w2, experts, routing="softmax", renormalize=True, routed_scaling=1.0, **_):
    """A differentiable fp64 forward written from the module's formulas (route's weights given the decision,
    expert SwiGLU per (token, slot) pair, fold). Returns y and the intermediates to differentiate against."""
    k, f = experts.shape[1], w2.shape[1]
    logits = x @ wr.t()
    full = torch.softmax(logits, -1) if routing == "softmax" else torch.sigmoid(logits)
    q = full.gather(1, experts)
    w = (q / (q.sum(-1, keepdim=True) + 1e-20) if renormalize else q) * routed_scaling
    xp = x.unsqueeze(1).expand(-1, k, -1)                              # the dispatched rows [T, k, H]
    a = torch.einsum("tkh,tkhf->tkf", xp, w13[experts])
    g, u = a[..., :f], a[..., f:]
    h = torch.nn.functional.silu(g) * u
    o = torch.einsum("tkf,tkfh->tkh", h, w2[experts])
    y = (w.unsqueeze(-1) * o).sum(1)
    return y, dict(logits=logits, weights=w, xp=xp, g=g, u=u, h=h, o=o)


def _bwd_inputs(seed, tokens=37, hidden=24, ffn=10, experts=8, dtype=F64):
    g = _gen(seed)
    x = torch.randn(tokens, hidden, generator=g, dtype=dtype)
    wr = torch.randn(experts, hidden, generator=g, dtype=dtype) / hidden ** 0.5
    w13 = torch.randn(experts, hidden, 2 * ffn, generator=g, dtype=dtype) / hidden ** 0.5
    w2 = torch.randn(experts, ffn, hidden, generator=g, dtype=dtype) / ffn ** 0.5
    dy = torch.randn(tokens, hidden, generator=g, dtype=dtype)
    return x, wr, w13, w2, dy


def _rel_ok(got, want, tol=1e-10, floor=1e-3):
    """||got - want|| <= tol * max(||want||, floor): relative, with a floor for gradients that vanish."""
    err = float((got - want).norm())
    assert got.shape == want.shape and err <= tol * max(float(want.norm()), floor), (err, float(want.norm()))


def _check_vs_autograd(x, wr, w13, w2, dy, k, kw, experts=None):
    """Every gradient and every stage tensor of moe_backward_ref vs autograd through _forward64, in fp64."""
    dx, dwr, dw13, dw2, st = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=experts, return_stages=True,
                                              **kw)
    e = st["experts"]
    if experts is None:
        assert torch.equal(e, route(x, wr, k, **kw)[1])  # recomputed = the forward reference's decision
    leaves = [t.clone().requires_grad_() for t in (x, wr, w13, w2)]
    y, mid = _forward64(*leaves, e, **kw)
    names = ["weights", "logits", "o", "h", "g", "u", "xp"]
    grads = torch.autograd.grad(y, leaves + [mid[n] for n in names], dy, allow_unused=True)
    want = dict(zip(["dx", "dwr", "dw13", "dw2"] + names, grads))
    for got, name in [(dx, "dx"), (dwr, "dwr"), (dw13, "dw13"), (dw2, "dw2")]:
        assert got.dtype == F64
        _rel_ok(got, want[name])
    _rel_ok(st["dweights"], want["weights"])
    _rel_ok(st["dlogits"], want["logits"])
    for stage, name in [("do", "o"), ("dh", "h"), ("dg", "g"), ("du", "u"), ("dx_pair", "xp")]:
        _rel_ok(st[stage].view(want[name].shape), want[name])
    _rel_ok(st["weights"], mid["weights"].detach())
    # the o-free gate gradient (GEMM2-dgrad epilogue form) is the same number
    groups = _pairs_by_expert(e, wr.shape[0])
    _rel_ok(gate_grad_from_h_ref(dy, st["h"], e, w2, groups), st["dweights"], tol=1e-12)
    return dx, dwr, dw13, dw2, st


_BIAS = torch.linspace(-0.3, 0.4, 8, dtype=F64)
BWD_ROUTINGS = {
    "softmax-renorm": (3, dict(routing="softmax")),
    "softmax-plain-scaled": (3, dict(routing="softmax", renormalize=False, routed_scaling=1.5)),
    "sigmoid-grouped": (3, dict(routing="sigmoid-grouped", bias=_BIAS, n_group=4, topk_group=2,
                                routed_scaling=2.5)),
    "sigmoid-grouped-plain": (4, dict(routing="sigmoid-grouped", bias=_BIAS, n_group=2, topk_group=1,
                                      renormalize=False, routed_scaling=0.7)),
}


@pytest.mark.parametrize("case", list(BWD_ROUTINGS))
def test_backward_random_routing_matches_autograd(case):
    k, kw = BWD_ROUTINGS[case]
    _check_vs_autograd(*_bwd_inputs(10), k, kw)


@pytest.mark.parametrize("case", ["softmax-renorm", "sigmoid-grouped"])
def test_backward_skewed_routing_matches_autograd(case):
    k, kw = BWD_ROUTINGS[case]
    x, wr, w13, w2, dy = _bwd_inputs(11)
    x = x + 1.0
    wr[5] += 0.3  # logit 5 gains 0.3 * sum(x_t) ~ 7: (nearly) every token's first choice
    *_, st = _check_vs_autograd(x, wr, w13, w2, dy, k, kw)
    assert (st["experts"] == 5).any(1).float().mean() > 0.9


@pytest.mark.parametrize("case", ["softmax-plain-scaled", "sigmoid-grouped"])
def test_backward_empty_experts(case):
    k, kw = BWD_ROUTINGS[case]
    kw = dict(kw, bias=torch.zeros(16, dtype=F64)) if "bias" in kw else kw
    x, wr, w13, w2, dy = _bwd_inputs(12, tokens=3, experts=16)
    _, _, dw13, dw2, st = _check_vs_autograd(x, wr, w13, w2, dy, 2, kw)
    empty = torch.bincount(st["experts"].reshape(-1), minlength=16) == 0
    assert empty.sum() >= 10
    assert not dw13[empty].any() and not dw2[empty].any()  # exactly zero, not just small


@pytest.mark.parametrize("kw", [dict(routing="softmax", renormalize=False), dict(routing="softmax"),
                                dict(routing="sigmoid-grouped", routed_scaling=2.5)], ids=str)
def test_backward_all_tokens_to_one_expert(kw):
    x, wr, w13, w2, dy = _bwd_inputs(13, tokens=29)
    x = x.abs() + 0.1
    wr = torch.full_like(wr, -0.1)
    wr[2] = 0.1
    dx, dwr, dw13, dw2, st = _check_vs_autograd(x, wr, w13, w2, dy, 1, kw)
    assert (st["experts"] == 2).all()
    others = torch.arange(8) != 2
    assert not dw13[others].any() and not dw2[others].any()
    if kw.get("renormalize", True) and kw["routing"] == "softmax":
        assert float(dwr.norm()) < 1e-12  # k = 1 renormalised: w = 1 whatever the logits


@pytest.mark.parametrize("tokens", [1, 0])
def test_backward_tiny_token_counts(tokens):
    k, kw = BWD_ROUTINGS["sigmoid-grouped"]
    _check_vs_autograd(*_bwd_inputs(14, tokens=tokens), k, kw)


@pytest.mark.parametrize("tokens", [37, 1, 0])
def test_experts_backward_given_routing_matches_autograd(tokens):
    """moe_experts_backward_ref (routing given: no router) against fp64 autograd of y[t] = sum_j w[t, j]
    expert_{e[t, j]}(x[t]): dx, d_weights, dW13, dW2; a token naming one expert twice, an expert without rows
    (zeros); ids outside [0, E) refused."""
    from kosmos.reference.moe import moe_experts_backward_ref
    x, _, w13, w2, dy = _bwd_inputs(15, tokens=tokens)
    g = _gen(16)
    e = torch.stack([torch.randperm(7, generator=g)[:3] for _ in range(tokens)] or  # no expert 7
                    [torch.zeros(0, 3, dtype=torch.long)]).reshape(tokens, 3)
    if tokens > 1:
        e[1, 2] = e[1, 0]
    w = torch.rand(tokens, 3, generator=g, dtype=F64)
    leaves = [t.clone().requires_grad_(True) for t in (x, w, w13, w2)]
    y = torch.zeros_like(x)
    for j in range(3):
        for t in range(tokens):
            ffn = expert_ffn(leaves[0][t:t + 1], leaves[2][e[t, j]], leaves[3][e[t, j]])[0]
            y[t] = y[t] + leaves[1][t, j] * ffn
    want = torch.autograd.grad(y, leaves, dy) if tokens else [torch.zeros_like(t) for t in leaves]
    got = moe_experts_backward_ref(x, w13, w2, dy, w, e)
    for a, b in zip(got, want):
        _rel_ok(a, torch.zeros_like(a) if b is None else b)
    assert not got[2][7].any() and not got[3][7].any()
    if tokens:
        with pytest.raises(ValueError, match=r"in \[0, 8\)"):
            moe_experts_backward_ref(x, w13, w2, dy, w, e + 8)


def test_backward_passed_routing_equals_recomputed_and_is_deterministic():
    k, kw = BWD_ROUTINGS["sigmoid-grouped"]
    x, wr, w13, w2, dy = _bwd_inputs(15)
    _, e = route(x, wr, k, **kw)
    a = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, **kw)
    b = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=e, **kw)
    c = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=e, **kw)
    assert all(torch.equal(p, q) and torch.equal(q, r) for p, q, r in zip(a, b, c))


def test_backward_bias_gets_no_gradient():
    _, kw = BWD_ROUTINGS["sigmoid-grouped"]
    x, wr, w13, w2, dy = (t.float() for t in _bwd_inputs(16))
    bias = kw["bias"].float().requires_grad_()
    kw = dict(kw, bias=bias)
    x_leaf = x.clone().requires_grad_()
    w, e = route(x_leaf, wr, 3, **kw)
    y = apply_routing_ref(x_leaf, w, e, w13, w2)
    assert torch.autograd.grad((y * dy).sum(), [x_leaf, bias], allow_unused=True)[1] is None
    # a bias change too small to change the choice changes nothing, forward or backward
    nudged = dict(kw, bias=bias.detach() + 1e-6)
    w_n, e_n = route(x, wr, 3, **nudged)
    assert torch.equal(e_n, e) and torch.equal(w_n, w.detach())
    base = moe_backward_ref(x, wr, w13, w2, dy, top_k=3, **dict(kw, bias=bias.detach()))
    assert all(torch.equal(p, q) for p, q in zip(base, moe_backward_ref(x, wr, w13, w2, dy, top_k=3, **nudged)))


@pytest.mark.parametrize("case", ["softmax-renorm", "sigmoid-grouped"])
def test_backward_fp32_matches_autograd_through_the_forward_reference(case):
    """fp32: the existing route + apply_routing_ref are differentiable; the reference agrees at fp32 level, and
    bf16 inputs are upcast (the same numbers as passing their fp32 values)."""
    k, kw = BWD_ROUTINGS[case]
    kw = dict(kw, bias=kw["bias"].float()) if "bias" in kw else kw
    x, wr, w13, w2, dy = (t.float() for t in _bwd_inputs(17))
    leaves = [t.clone().requires_grad_() for t in (x, wr, w13, w2)]
    w, e = route(leaves[0], leaves[1], k, **kw)
    y = apply_routing_ref(leaves[0], w, e, leaves[2], leaves[3])
    want = torch.autograd.grad(y, leaves, dy)
    got = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, **kw)
    for g_, w_ in zip(got, want):
        assert g_.dtype == torch.float32
        _rel_ok(g_, w_, tol=1e-5)
    low = [t.bfloat16() for t in (x, wr, w13, w2, dy)]
    got_low = moe_backward_ref(*low, top_k=k, **kw)
    got_up = moe_backward_ref(*(t.float() for t in low), top_k=k, **kw)
    assert all(p.dtype == torch.float32 and torch.equal(p, q) for p, q in zip(got_low, got_up))


@pytest.mark.parametrize("bad, msg", [(lambda e: e[:, :2], "shape"), (lambda e: e.clamp(max=0), "distinct"),
                                      (lambda e: e + 8, r"\[0, 8\)")])
def test_backward_rejects_bad_routing(bad, msg):
    x, wr, w13, w2, dy = _bwd_inputs(18, tokens=5)
    _, e = route(x, wr, 3)
    with pytest.raises(ValueError, match=msg):
        moe_backward_ref(x, wr, w13, w2, dy, top_k=3, experts=bad(e))


def test_backward_saved_tensor_figures_deepseek_v3():
    m = MOE_MODELS["deepseek-v3"]
    b = backward_saved_bytes(4096, m.hidden, m.expert_ffn, m.top_k, m.experts)
    mib = {name: v / 2 ** 20 for name, v in b.items()}
    assert mib == dict(weights=0.125, experts=0.125, denom=0.015625, probs=4.0, x=56.0, x_rows=448.0,
                       gate_up=256.0, h=128.0, o=448.0)
    doc = moe_backward_ref.__doc__
    for figure in ("128 KiB", "16 KiB", "4 MiB", "56 MiB", "448 MiB", "256 MiB", "128 MiB", "~704 MiB"):
        assert figure in doc


def test_mxfp8_reference_against_explicit_quantization():
    """moe_forward_ref_local(mx=True): each expert multiplies MX values (x and W13 blocks along H, h rounded to
    bf16 then to MX along F, W2 blocks along F), checked against a hand-written loop; and it stays within the MX
    rounding bound of the bf16 reference."""
    import torch.nn.functional as F

    from kosmos import quant
    g = torch.Generator().manual_seed(3)
    t, h, f, e, k = 24, 64, 32, 4, 2
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    wr = torch.randn(e, h, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, f, h, generator=g) / f ** 0.5).to(torch.bfloat16)
    y_mx = moe_forward_ref_local([x], wr, [w13], [w2], top_k=k, mx=True)[0]
    y_bf = moe_forward_ref_local([x], wr, [w13], [w2], top_k=k)[0]
    weights, experts = route(x, wr, k)

    def mx_rows(a):  # blocks along the last dim
        return quant.dequantize_mx_ref(*quant.quantize_mx_ref(a.to(torch.bfloat16))).float()

    want = torch.zeros(t, h)
    for i in range(t):
        for j in range(k):
            ei = experts[i, j].item()
            hh = mx_rows(x[i:i + 1]) @ mx_rows(w13[ei].t()).t()
            hh = (F.silu(hh[:, :f]) * hh[:, f:]).to(torch.bfloat16)
            want[i] += weights[i, j] * (mx_rows(hh) @ mx_rows(w2[ei].t()).t())[0]
    assert torch.allclose(y_mx, want, rtol=1e-4, atol=1e-5)
    rel = ((y_mx - y_bf).norm() / y_bf.norm()).item()
    assert 1e-4 < rel < 0.1, rel  # MX rounding is visible, and bounded (~2**-4 per element, averaged)


@pytest.mark.parametrize("case", ["softmax-renorm", "sigmoid-grouped"])
def test_backward_in_expert_chunks(case):
    """moe_backward_ref a chunk of experts at a time (expert_chunk 1, 3: the last short) gives the gradients and
    the stage tensors of all experts at once (fp64: to rounding; the CPU's elementwise ops round a vector lane
    and the scalar tail apart); ``on_weight_grads`` gets each chunk's dw13 / dw2 once, in expert order, and the
    call returns None for them."""
    k, kw = BWD_ROUTINGS[case]
    x, wr, w13, w2, dy = _bwd_inputs(13)
    *whole, st = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, return_stages=True, **kw)
    for chunk in (1, 3):
        *got, st_c = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, return_stages=True, expert_chunk=chunk, **kw)
        for a, b in zip(got, whole):
            _rel_ok(a, b, tol=1e-13)
        assert set(st_c) == set(st)
        for name in st:
            if st[name] is not None:
                _rel_ok(st_c[name].double(), st[name].double(), tol=1e-13)
        seen = []
        dx, dwr, dw13, dw2 = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, expert_chunk=chunk,
                                              on_weight_grads=lambda e0, a, b: seen.append((e0, a, b)), **kw)
        assert dw13 is None and dw2 is None
        assert [e0 for e0, _, _ in seen] == list(range(0, 8, chunk))
        _rel_ok(torch.cat([a for _, a, _ in seen]), whole[2], tol=1e-13)
        _rel_ok(torch.cat([b for _, _, b in seen]), whole[3], tol=1e-13)
        _rel_ok(dx, whole[0], tol=1e-13)
    with pytest.raises(ValueError, match="expert_chunk"):
        moe_backward_ref(x, wr, w13, w2, dy, top_k=k, expert_chunk=0, **kw)


# ---- the MXFP8 backward reference: moe_backward_ref(mx=True) ---------------------------------------------------

class _MXGemm(torch.autograd.Function):
    """c = Q_K(a) @ Q_K(b) for a [n, K], b [K, N] (MX values, blocks of 32 along K), differentiated straight through
    the quantizers with MX operands along each backward GEMM's own K: da = Q_N(dc) @ Q_N(b)^T, db = Q_R(a)^T @
    Q_R(dc) (Q_R: blocks of 32 rows, mx_rows_ref)."""

    @staticmethod
    def forward(ctx, a, b):
        from kosmos.reference.moe import mx_along
        ctx.save_for_backward(a, b)
        return mx_along(a, 1) @ mx_along(b, 0)

    @staticmethod
    def backward(ctx, dc):
        from kosmos.reference.moe import mx_along, mx_rows_ref
        a, b = ctx.saved_tensors
        return mx_along(dc, 1) @ mx_along(b, 1).t(), mx_rows_ref(a).t() @ mx_rows_ref(dc)


class _MXGatedGemm(torch.autograd.Function):
    """c = w[:, None] * (Q_F(h) @ Q_F(W2)) -- GEMM2 with its rows' gate weights, as the fold sums it (y[t] = sum of
    its pairs' c) -- differentiated as the MX backward's GEMM2 is defined: its dgrad's operand is the incoming
    gradient itself (dc = the token's dy), z = Q_H(dc) @ Q_H(W2)^T, dh = w z; dW2 = Q_R(h)^T @ Q_R(w dc); dw =
    <z, h>."""

    @staticmethod
    def forward(ctx, h, w2, w):
        from kosmos.reference.moe import mx_along
        ctx.save_for_backward(h, w2, w)
        return w[:, None] * (mx_along(h, 1) @ mx_along(w2, 0))

    @staticmethod
    def backward(ctx, dc):
        from kosmos.reference.moe import mx_along, mx_rows_ref
        h, w2, w = ctx.saved_tensors
        z = mx_along(dc, 1) @ mx_along(w2, 1).t()
        return w[:, None] * z, mx_rows_ref(h).t() @ mx_rows_ref(w[:, None] * dc), (z * h).sum(-1)


def _mx_forward64(x, wr, w13, w2, experts, routing="softmax", renormalize=True, routed_scaling=1.0, **_):
    """The MXFP8 layer as an fp64 autograd graph: the routing weights and the SwiGLU by autograd, each expert's
    GEMMs by _MXGemm / _MXGatedGemm on its rows in ascending p, the dispatch as row indexing and the fold as an
    index_add (their backward by autograd)."""
    k, f = experts.shape[1], w2.shape[1]
    logits = x @ wr.t()
    full = torch.softmax(logits, -1) if routing == "softmax" else torch.sigmoid(logits)
    q = full.gather(1, experts)
    w = ((q / (q.sum(-1, keepdim=True) + 1e-20) if renormalize else q) * routed_scaling).reshape(-1)
    y = torch.zeros_like(x)
    for e, p in _pairs_by_expert(experts, wr.shape[0]):
        a = _MXGemm.apply(x[p // k], w13[e])
        h = torch.nn.functional.silu(a[:, :f]) * a[:, f:]
        y = y.index_add(0, p // k, _MXGatedGemm.apply(h, w2[e], w[p]))
    return y


@pytest.mark.parametrize("case,skew", [("softmax-renorm", False), ("sigmoid-grouped", False),
                                       ("softmax-plain-scaled", True)])
def test_mx_backward_reference_matches_autograd_of_the_rounded_math(case, skew):
    """moe_backward_ref(mx=True) -- explicit stage formulas -- against fp64 autograd through _mx_forward64, in which
    only the GEMMs are custom (the MX rounding rule of each, straight-through): dx, d(router weight), dW13, dW2.
    ``skew``: one expert gets > 64 rows (row blocks of 32, the last partial), one expert none (zero gradients)."""
    k, kw = BWD_ROUTINGS[case]
    x, wr, w13, w2, dy = _bwd_inputs(21, tokens=70 if skew else 50, hidden=64, ffn=32)
    _, e = route(x, wr, k, **kw)
    if skew:  # the decision given: expert 2 in every token's first slot, expert 6 in none
        g = _gen(22)
        others = torch.tensor([0, 1, 3, 4, 5, 7])
        e = torch.cat([torch.full((70, 1), 2), torch.stack([others[torch.randperm(6, generator=g)[:k - 1]]
                                                            for _ in range(70)])], 1)
    counts = torch.bincount(e.reshape(-1), minlength=8)
    if skew:
        assert counts[2] == 70 and counts[6] == 0
    got = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=e, mx=True, **kw)
    leaves = [t.clone().requires_grad_() for t in (x, wr, w13, w2)]
    want = torch.autograd.grad(_mx_forward64(*leaves, e, **kw), leaves, dy)
    for a, b in zip(got, want):
        assert a.dtype == F64
        _rel_ok(a, b)
    for i in (counts == 0).nonzero().flatten().tolist():
        assert not got[2][i].any() and not got[3][i].any()
    # and the MX rounding is visible: not the bf16 backward, but within the MX tolerance of it
    plain = moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=e, **kw)
    for a, b in zip(got, plain):
        rel = float((a - b).norm() / b.norm())
        assert 1e-3 < rel < 0.1, rel


def test_mx_rows_ref_blocks_and_zero_completion():
    """mx_rows_ref: blocks of 32 rows per column from row 0 (the MX values of the transpose), a partial last block
    as if completed by zero rows (bitwise the zero-padded rounding, cut); to bf16 first."""
    from kosmos import quant
    from kosmos.reference.moe import mx_rows_ref
    g = _gen(5)
    t = torch.randn(70, 48, generator=g, dtype=F64) * torch.logspace(-3, 3, 70, dtype=F64)[:, None]
    got = mx_rows_ref(t)
    padded = torch.cat([t.to(torch.bfloat16), torch.zeros(26, 48, dtype=torch.bfloat16)])
    want = quant.dequantize_mx_ref(*quant.quantize_mx_ref(padded.t().contiguous())).t()[:70]
    assert got.dtype == F64 and torch.equal(got, want.double())
    assert torch.equal(mx_rows_ref(t[:32]), got[:32]) and not torch.equal(got, t)
    with pytest.raises(ValueError, match="multiples of 32"):
        moe_backward_ref(*_bwd_inputs(1, hidden=48, ffn=32), top_k=2, mx=True)
