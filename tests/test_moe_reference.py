"""MoE references: routing (both modes), dispatch/fold bookkeeping of the all-to-all layer vs the local
reference, at world 1 and (over gloo, on the CPU) world 2, including empty experts and all tokens to one
expert."""
import os

import pytest
import torch
import torch.distributed as dist

from multiproc import spawn_gloo

from kosmos.models import MOE_MODELS
from kosmos.moe_reference import expert_ffn, moe_forward_a2a, moe_forward_ref_local, route


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
