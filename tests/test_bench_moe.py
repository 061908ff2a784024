"""`kosmos bench moe` on the CPU: routing specs, the input generator (Zipf skew, well-separated routing,
determinism), the nccl-a2a baseline's bf16 path vs the local reference (world 1, and world 2 over gloo), the
DeepEP expert side, and a whole benchmark point run end to end with stand-ins for the GPU-only pieces (the
timer, the KOSMOS kernels) -- including kernels that raise, are wrong or NaN, which must be recorded as
failed -- with the config (``--config``) the KOSMOS rows ran with."""
import math
import os
import sys
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from multiproc import spawn_gloo
from simranks import placed_gate_up

from kosmos.config import MoEBackwardConfig, MoEForwardConfig, config_dict
from kosmos.models import MOE_MODELS, MoEModel, UnknownModelError
from kosmos.reference.moe import _experts_forward, moe_forward_a2a, moe_forward_ref_local, route
from kosmos_bench import moe, moe_mx, timing

TINY = {
    "tiny-softmax": MoEModel("tiny-softmax", hidden=64, expert_ffn=32, experts=8, top_k=2, routing="softmax"),
    "tiny-grouped": MoEModel("tiny-grouped", hidden=64, expert_ffn=32, experts=16, top_k=4,
                             routing="sigmoid-grouped", n_group=4, topk_group=2, routed_scaling=2.5),
}


@pytest.fixture
def tiny_models(monkeypatch):
    for name, m in TINY.items():
        monkeypatch.setitem(MOE_MODELS, name, m)


# --------------------------------------------------------------------------- routing specs, models, cases


@pytest.mark.parametrize("text, kind, s", [
    ("uniform", "uniform", None), ("zipf:1.2", "zipf", 1.2), (" ZIPF:2 ", "zipf", 2.0), ("zipf:0.5", "zipf", 0.5),
])
def test_parse_routing(text, kind, s):
    spec = moe.parse_routing(text)
    assert (spec.kind, spec.s) == (kind, s)
    assert moe.parse_routing(str(spec)) == spec


@pytest.mark.parametrize("text, needle", [
    ("zipf", "needs an exponent"), ("zipf:", "needs an exponent"), ("zipf:abc", "not a number"),
    ("zipf:0", "> 0"), ("zipf:-1.5", "> 0"), ("zipf:nan", "> 0"), ("zipf:inf", "> 0"),
    ("skewed", "unknown routing"), ("", "unknown routing"), (1.2, "must be a string"),
])
def test_bad_routing_is_a_clear_error(text, needle):
    with pytest.raises(ValueError, match=needle):
        moe.parse_routing(text)


def test_unknown_model_lists_known_ones():
    with pytest.raises(UnknownModelError, match="deepseek-v3, qwen3-235b, mixtral-8x7b, qwen2-57b"):
        moe.moe_model("grok-9")


def test_cases_and_even_expert_split():
    cases = moe.moe_cases(["qwen3-235b", "mixtral-8x7b"], [4096, 8192], ["uniform", "ZIPF:1.20"], 2)
    assert len(cases) == 8 and {c.routing for c in cases} == {"uniform", "zipf:1.2"}
    with pytest.raises(ValueError, match="mixtral-8x7b has 8 experts.*--ep 3"):
        moe.moe_cases(["mixtral-8x7b"], [4096], ["uniform"], 3)
    with pytest.raises(ValueError, match="unknown routing"):
        moe.moe_cases(["qwen3-235b"], [4096], ["random"], 2)


# --------------------------------------------------------------------------- input generator


def _share_of_top_expert(m, routing, tokens=1024, seed=0):
    x, wr, bias, _ = moe.make_router_inputs(m, tokens, routing, 0, seed)
    _, experts = route(x, wr, m.top_k, **moe.route_kwargs(m, bias))
    load = moe.expert_load(experts, m.experts)
    return load.max().item() / experts.numel(), load


@pytest.mark.parametrize("name", ["qwen3-235b", "deepseek-v3"])
def test_zipf_skew_is_present(name):
    m = MOE_MODELS[name]
    uniform, load_u = _share_of_top_expert(m, "uniform")
    skewed, load_z = _share_of_top_expert(m, "zipf:1.2")
    assert uniform < 3 / m.experts        # near 1/E: no expert stands out without skew
    assert skewed > 8 * uniform           # a popular expert takes a large share (cap: 1/top_k per token)
    # the skew is spread: the 8 most popular experts take far more than 8/E of the pairs
    top8 = load_z.topk(8).values.sum().item() / load_z.sum().item()
    assert top8 > 0.3 and top8 > 10 * 8 / m.experts
    assert (load_u > 0).sum() == m.experts  # every expert is used under uniform routing


def test_zipf_popularity_follows_the_seeded_ranks():
    m = MOE_MODELS["qwen3-235b"]
    gen = torch.Generator().manual_seed(1_000_003 * 0 + 17)
    torch.randn(m.experts, m.hidden, generator=gen)  # the generator draws the router weight first
    offsets = moe.zipf_offsets(m.experts, 1.2, gen)
    _, load = _share_of_top_expert(m, "zipf:1.2")
    assert sorted(offsets.tolist(), reverse=True)[:3] == pytest.approx([0.0, -1.2 * math.log(2), -1.2 * math.log(3)])
    most_popular = load.argmax().item()
    assert offsets[most_popular] == 0.0
    # popularity decreases with rank: correlation of log-load with the offsets is strongly positive
    ll = torch.log(load.double() + 1)
    c = torch.corrcoef(torch.stack([ll, offsets.double()]))[0, 1].item()
    assert c > 0.8


def test_zipf_feature_and_router_column():
    m = MOE_MODELS["qwen3-235b"]
    x, wr, _, _ = moe.make_router_inputs(m, 64, "zipf:1.2", 0, 0)
    assert torch.all(x[:, 0] == moe.ZIPF_FEATURE)
    assert wr[:, 0].max().item() == 0.0 and wr[:, 0].min().item() == pytest.approx(-1.2 * math.log(m.experts),
                                                                                     rel=1e-2)
    xu, wru, _, _ = moe.make_router_inputs(m, 64, "uniform", 0, 0)
    assert xu[:, 0].std() > 0.5 and (wru[:, 0] > 0).any()


def test_generator_is_deterministic_per_seed_and_rank():
    m = TINY["tiny-grouped"]
    a = moe.make_router_inputs(m, 128, "zipf:1.2", 0, 5)
    b = moe.make_router_inputs(m, 128, "zipf:1.2", 0, 5)
    for u, v in zip(a[:3], b[:3]):
        assert torch.equal(u, v)
    other_rank = moe.make_router_inputs(m, 128, "zipf:1.2", 1, 5)
    assert torch.equal(other_rank[1], a[1]) and torch.equal(other_rank[2], a[2])  # router and bias replicated
    assert not torch.equal(other_rank[0], a[0])                                   # tokens differ per rank
    other_seed = moe.make_router_inputs(m, 128, "zipf:1.2", 0, 6)
    assert not torch.equal(other_seed[0], a[0]) and not torch.equal(other_seed[1], a[1])
    w = moe.make_expert_weights(m, 2, 0, 5)
    assert torch.equal(w[0], moe.make_expert_weights(m, 2, 0, 5)[0])
    assert not torch.equal(w[0], moe.make_expert_weights(m, 2, 1, 5)[0])
    assert w[0].shape == (8, 64, 64) and w[1].shape == (8, 32, 64) and w[0].dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["tiny-softmax", "tiny-grouped", "qwen2-57b"])
@pytest.mark.parametrize("routing", ["uniform", "zipf:1.2"])
def test_generated_routing_is_well_separated(name, routing):
    m = TINY.get(name) or MOE_MODELS[name]
    x, wr, bias, redrawn = moe.make_router_inputs(m, 512, routing, 0, 0)
    assert moe.routing_margin(x, wr, m, bias).min().item() >= moe.ROUTING_MARGIN
    assert redrawn < 0.1 * 512 + 20  # a few fragile tokens, not a different distribution


def test_routing_margin_by_hand_and_on_ties():
    m = TINY["tiny-softmax"]  # top-2 of 8
    x = torch.eye(8)[:2] * 1.0
    wr = torch.diag(torch.tensor([5.0, 4.0, 3.5, 1.0, 0.0, 0.0, 0.0, 0.0]))
    # token 0: logits (5, 0, ...): k-th (2nd) = 0, next = 0 -> tie, margin 0; token 1: (0, 4, 0...) -> 0 again
    assert moe.routing_margin(x, wr, m).tolist() == [0.0, 0.0]
    x = torch.ones(1, 8)
    assert moe.routing_margin(x, wr, m).tolist() == [pytest.approx(0.5)]  # 2nd = 4.0, 3rd = 3.5
    g = TINY["tiny-grouped"]
    x = torch.zeros(1, 64)
    wr = torch.zeros(16, 64)
    assert moe.routing_margin(x, wr, g).item() == 0.0  # all scores equal: the choice is a pure tie


def test_underflowing_softmax_is_fragile():
    m = TINY["tiny-softmax"]  # top-2: the 2nd choice 90 below the 1st has fp32 probability 0, like the 3rd
    x = torch.ones(1, 8)
    wr = torch.diag(torch.tensor([0.0, -90.0, -95.0, -99.0, -99.0, -99.0, -99.0, -99.0]))
    assert moe.routing_margin(x, wr, m).item() == 0.0
    wr = torch.diag(torch.tensor([0.0, -50.0, -95.0, -99.0, -99.0, -99.0, -99.0, -99.0]))
    assert moe.routing_margin(x, wr, m).item() == 45.0


def test_saturated_router_is_refused_not_hung():
    # zipf:400 pushes every unpopular expert's fp32 softmax probability to 0: no token's top-2 is decidable
    with pytest.raises(ValueError, match="smaller S"):
        moe.make_router_inputs(TINY["tiny-softmax"], 64, "zipf:400", 0, 0)
    # the grouped router stays decidable there: its bias separates the saturated scores
    x, wr, bias, _ = moe.make_router_inputs(TINY["tiny-grouped"], 64, "zipf:400", 0, 0)
    assert moe.routing_margin(x, wr, TINY["tiny-grouped"], bias).min() >= moe.ROUTING_MARGIN


# --------------------------------------------------------------------------- nccl-a2a baseline (CPU)


def _bf16_layer(m, world, tokens, seed=0, routing="zipf:1.2"):
    xs, wr, bias = [], None, None
    for r in range(world):
        x, wr, bias, _ = moe.make_router_inputs(m, tokens, routing, r, seed)
        xs.append(x)
    ws = [moe.make_expert_weights(m, world, r, seed) for r in range(world)]
    return xs, wr, bias, [w[0] for w in ws], [w[1] for w in ws]


@pytest.mark.parametrize("name", ["tiny-softmax", "tiny-grouped"])
def test_a2a_bf16_world1_matches_local_reference(name):
    m = TINY[name]
    xs, wr, bias, w13, w2 = _bf16_layer(m, 1, 97)
    kw = moe.route_kwargs(m, bias)
    y = moe_forward_a2a(xs[0], wr, w13[0], w2[0], top_k=m.top_k, fp32=False, **kw)
    assert y.dtype == torch.bfloat16 and y.shape == xs[0].shape
    ref = moe_forward_ref_local(xs, wr, w13, w2, top_k=m.top_k, **kw)[0]
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert 0 < err < 1e-2  # bf16 rounding, not exact
    y32 = moe_forward_a2a(xs[0], wr, w13[0], w2[0], top_k=m.top_k, fp32=True, **kw)
    torch.testing.assert_close(y32, ref, rtol=1e-5, atol=1e-5)


def test_experts_forward_bf16_matches_fp32():
    m = TINY["tiny-softmax"]
    w13, w2 = moe.make_expert_weights(m, 1, 0, 0)
    counts = torch.tensor([5, 0, 17, 1, 0, 0, 9, 3], dtype=torch.int32)
    x = torch.randn(int(counts.sum()), m.hidden, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    ref = _experts_forward(x, counts, w13, w2, fp32=True)
    out = _experts_forward(x, counts, w13, w2, fp32=False)
    assert out.dtype == torch.bfloat16 and ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


def _spawn(target, world, *args):
    return spawn_gloo(target, world, *args)


def _a2a_bf16_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        MOE_MODELS.update(TINY)
        res = {}
        for name, m in TINY.items():
            xs, wr, bias, w13, w2 = _bf16_layer(m, world, 53)
            kw = moe.route_kwargs(m, bias)
            y = moe_forward_a2a(xs[rank], wr, w13[rank], w2[rank], top_k=m.top_k, fp32=False, **kw)
            ref = moe_forward_ref_local(xs, wr, w13, w2, top_k=m.top_k, **kw)[rank]
            res[name] = (str(y.dtype), float((y.float() - ref).norm() / ref.norm()))
        q.put((rank, res))
    finally:
        dist.destroy_process_group()


def test_a2a_bf16_world2_over_gloo_matches_local_reference():
    got = _spawn(_a2a_bf16_rank, 2)
    for res in got.values():
        assert set(res) == set(TINY)
        for dtype, err in res.values():
            assert dtype == "torch.bfloat16" and 0 < err < 1e-2, got


def _bwd_w2_rank(rank, world, port, q):
    """One rank of the W=2 backward check: the bench's distributed fp32 reference (grad_reference at W > 1), the
    nccl-a2a baseline's backward and kosmos's moe_backward (kernels under the interpreter), both checked through
    it; and the reference's own gradients, for the test to compare with one process's moe_backward_ref."""
    from kosmos.ops.moe_backward.api import moe_backward
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        MOE_MODELS.update(TINY)
        res = {}
        for name, m in TINY.items():
            xs, wr, bias, w13, w2 = _bf16_layer(m, world, 29 + 6 * rank, routing="uniform")
            g = torch.Generator().manual_seed(700 + rank)
            dy = torch.randn(xs[rank].shape, generator=g).to(torch.bfloat16)
            inp = moe.MoEInputs(m, xs[rank], wr, bias, w13[rank], w2[rank], direction=moe.BWD, dy=dy)
            ref = moe.grad_reference(inp, world)
            weights, decision = route(inp.x, wr, m.top_k, **inp.route_kw())
            ref_grads = ref.ref((None,) * 4 + (decision,))
            a2a_err, a2a_parts = ref.errors(moe.a2a_backward(inp)())
            kos = moe_backward(inp.x, wr, inp.w13, inp.w2, dy, weights, decision, group=dist.group.WORLD,
                               **inp.backward_kw())
            kos_err, _ = ref.errors((*kos, decision))
            try:
                ref.errors((*kos, decision.flip(-1) if m.top_k > 1 else (decision + 1) % m.experts))
                wrong = "accepted"
            except ValueError as e:
                wrong = str(e)
            res[name] = dict(grads=[t.float().numpy() for t in ref_grads], a2a=a2a_err, kos=kos_err, wrong=wrong,
                             tokens=xs[rank].shape[0])
        q.put((rank, res))
    finally:
        from multiproc import finish_gloo
        finish_gloo()


@pytest.mark.interpreter
def test_backward_check_at_world2_over_gloo():
    """`bench moe --direction bwd` at W=2 (issue 19's two-GPU run needs it): the distributed fp32 reference
    equals one process's moe_backward_ref on every rank's tokens and every expert (dx per rank, d_router from
    this rank's tokens, dw13 / dw2 of this rank's experts); nccl-a2a's autograd and kosmos's moe_backward pass
    the check at bf16 level; a decision other than route's is refused with a reason."""
    from kosmos.reference.moe import moe_backward_ref
    world = 2
    got = _spawn(_bwd_w2_rank, world)
    for name, m in TINY.items():
        local = m.experts // world
        xs, wr, bias, w13, w2 = [], None, None, [], []
        for r in range(world):  # the ranks' inputs again (29 + 6r tokens on rank r)
            x_r, wr, bias, w13_r, w2_r = _bf16_layer(m, world, 29 + 6 * r, routing="uniform")
            xs.append(x_r[r]), w13.append(w13_r[r]), w2.append(w2_r[r])
        dys = [torch.randn(xs[r].shape, generator=torch.Generator().manual_seed(700 + r)).to(torch.bfloat16)
               for r in range(world)]
        kw = moe.route_kwargs(m, bias)
        w13_all, w2_all = torch.cat(w13), torch.cat(w2)
        whole = moe_backward_ref(torch.cat(xs), wr, w13_all, w2_all, torch.cat(dys), top_k=m.top_k, **kw)
        start = 0
        for r in range(world):
            res = got[r][name]
            n = res["tokens"]
            mine = moe_backward_ref(xs[r], wr, w13_all, w2_all, dys[r], top_k=m.top_k, **kw)
            want = (whole[0][start:start + n], mine[1], whole[2][r * local:(r + 1) * local],
                    whole[3][r * local:(r + 1) * local])
            start += n
            for part, a, b in zip(moe.GRADS, res["grads"], want):
                torch.testing.assert_close(torch.from_numpy(a), b.float(), rtol=1e-4, atol=1e-5, msg=f"{name} {part}")
            assert 0 < res["a2a"] < moe.GRAD_TOLERANCE and 0 < res["kos"] < moe.GRAD_TOLERANCE, (name, res["a2a"], res["kos"])
            assert "routing decision differs" in res["wrong"], res["wrong"]


def _bwd_w2_mx_rank(rank, world, port, q):
    """One rank of the W=2 mxfp8 backward check (tiny-softmax): the distributed MX reference (grad_reference at
    W > 1: autograd through moe_forward_a2a_mx_train(fp32=True)), nccl-a2a's MX autograd and kosmos's
    moe_backward(precision="mxfp8") checked through it; the reference's gradients for the test."""
    from kosmos.ops.moe_backward import moe_mx_weights
    from kosmos.ops.moe_backward.api import moe_backward
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        MOE_MODELS.update(TINY)
        m = TINY["tiny-softmax"]
        xs, wr, bias, w13, w2 = _bf16_layer(m, world, 29 + 6 * rank, routing="uniform")
        dy = torch.randn(xs[rank].shape, generator=torch.Generator().manual_seed(700 + rank)).to(torch.bfloat16)
        mxw = moe_mx_weights(w13[rank], w2[rank])
        inp = moe.MoEInputs(m, xs[rank], wr, bias, w13[rank], w2[rank], "mxfp8", mxw.w13, mxw.w2, direction=moe.BWD,
                            dy=dy, mx_weights=mxw)
        ref = moe.grad_reference(inp, world)
        weights, decision = route(inp.x, wr, m.top_k, **inp.route_kw())
        ref_grads = ref.ref((None,) * 4 + (decision,))
        a2a_err, _ = ref.errors(moe.a2a_backward(inp)())
        kos = moe_backward(inp.x, wr, inp.w13, inp.w2, dy, weights, decision, group=dist.group.WORLD,
                           precision="mxfp8", mx_weights=mxw, **inp.backward_kw())
        kos_err, _ = ref.errors((*kos, decision))
        q.put((rank, dict(grads=[t.float().numpy() for t in ref_grads], a2a=a2a_err, kos=kos_err,
                          tokens=xs[rank].shape[0])))
    finally:
        from multiproc import finish_gloo
        finish_gloo()


@pytest.mark.interpreter
def test_mx_backward_check_at_world2_over_gloo():
    """`bench moe --dtype mxfp8 --direction bwd` at W=2: the distributed MX reference equals one process's
    moe_backward_ref(mx=True) on every rank's tokens and every expert (relative 1e-4: fp32 sums in other orders);
    nccl-a2a's MX autograd and kosmos's MX backward pass the check (GRAD_TOLERANCE_MX)."""
    from kosmos.reference.moe import moe_backward_ref
    world, m = 2, TINY["tiny-softmax"]
    got = _spawn(_bwd_w2_mx_rank, world)
    local = m.experts // world
    xs, w13, w2 = [], [], []
    for r in range(world):
        x_r, wr, bias, w13_r, w2_r = _bf16_layer(m, world, 29 + 6 * r, routing="uniform")
        xs.append(x_r[r]), w13.append(w13_r[r]), w2.append(w2_r[r])
    dys = [torch.randn(xs[r].shape, generator=torch.Generator().manual_seed(700 + r)).to(torch.bfloat16)
           for r in range(world)]
    kw = moe.route_kwargs(m, bias)
    w13_all, w2_all = torch.cat(w13), torch.cat(w2)
    whole = moe_backward_ref(torch.cat(xs), wr, w13_all, w2_all, torch.cat(dys), top_k=m.top_k, mx=True, **kw)
    start = 0
    for r in range(world):
        res = got[r]
        n = res["tokens"]
        mine = moe_backward_ref(xs[r], wr, w13_all, w2_all, dys[r], top_k=m.top_k, mx=True, **kw)
        want = (whole[0][start:start + n], mine[1], whole[2][r * local:(r + 1) * local],
                whole[3][r * local:(r + 1) * local])
        start += n
        for part, a, b in zip(moe.GRADS, res["grads"], want):
            rel = ((torch.from_numpy(a) - b.float()).norm() / b.float().norm()).item()
            assert rel < 1e-4, (part, rel)
        assert 0 < res["a2a"] < moe.GRAD_TOLERANCE_MX and 0 < res["kos"] < moe.GRAD_TOLERANCE_MX, res


# --------------------------------------------------------------------------- the MXFP8 nccl-a2a baseline (CPU)


def _mx_errors(xs, wr, w13, w2, m, rank, kw):
    """(baseline vs the MX reference, distributed fp32 MX reference vs the local one, baseline dtype)."""
    from kosmos_bench import moe_mx
    ref = moe_forward_ref_local(xs, wr, w13, w2, top_k=m.top_k, mx=True, **kw)[rank]
    w_mx = moe_mx.mx_expert_weights(w13[rank], w2[rank])
    y = moe_mx.moe_forward_a2a_mx(xs[rank], wr, *w_mx, top_k=m.top_k, fp32=False, **kw)
    y32 = moe_mx.moe_forward_a2a_mx(xs[rank], wr, w13[rank], w2[rank], top_k=m.top_k, fp32=True, **kw)
    y32b = moe_mx.moe_forward_a2a_mx(xs[rank], wr, w13[rank], w2[rank], top_k=m.top_k, fp32=True, gemm1_bf16=True,
                                     **kw)
    bf16 = moe_forward_ref_local(xs, wr, w13, w2, top_k=m.top_k, **kw)[rank]
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    return rel(y, y32b), rel(y32, ref), str(y.dtype), rel(ref, bf16), rel(y, ref)


@pytest.mark.parametrize("name", ["tiny-softmax", "tiny-grouped"])
def test_a2a_mx_world1_matches_local_mx_reference(name):
    m = TINY[name]
    xs, wr, bias, w13, w2 = _bf16_layer(m, 1, 97)
    err, err32, dtype, mx_vs_bf16, vs_mx = _mx_errors(xs, wr, w13, w2, m, 0, moe.route_kwargs(m, bias))
    # against the MX layer with its bf16 GEMM1 output (what it is checked against): bf16 GEMM outputs, not exact
    assert dtype == "torch.bfloat16" and 0 < err < 5e-3
    assert vs_mx < 3e-2  # against the MX layer itself (moe_mx's docstring: ~1.7e-2 from h's extra roundings)
    assert err32 < 1e-6  # the distributed reference is the local one's math
    assert 1e-2 < mx_vs_bf16 < 1e-1  # and MX is not bf16: the check would see a bf16 layer passed off as MX


def test_mx_wire_bytes_formula():
    from kosmos_bench import moe_mx
    assert moe_mx.wire_bytes("mxfp8", 100, 64, 1) == 0
    assert moe_mx.wire_bytes("bf16", 100, 64, 2) == 100 * (64 * 2 + 64 * 2) // 2
    assert moe_mx.wire_bytes("mxfp8", 100, 64, 2) == 100 * (64 + 2 + 64 * 2) // 2


def _a2a_mx_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        res = {}
        for name, m in TINY.items():
            xs, wr, bias, w13, w2 = _bf16_layer(m, world, 53)
            res[name] = _mx_errors(xs, wr, w13, w2, m, rank, moe.route_kwargs(m, bias))
        q.put((rank, res))
    finally:
        dist.destroy_process_group()


def test_a2a_mx_world2_over_gloo_matches_local_mx_reference():
    got = _spawn(_a2a_mx_rank, 2)
    for res in got.values():
        assert set(res) == set(TINY)
        for err, err32, dtype, _, _ in res.values():
            assert dtype == "torch.bfloat16" and 0 < err < 5e-3 and err32 < 1e-6, got


# --------------------------------------------------------------------------- DeepEP expert side (CPU)


def test_deepep_expert_side_matches_reference():
    """Emulate DeepEP's dispatch/combine by hand (each token once per rank that holds any of its experts,
    top-k indices local to that rank or -1) around ``deepep_expert_side``; the sum over ranks must be the
    layer."""
    m, world = TINY["tiny-grouped"], 2
    local = m.experts // world
    xs, wr, bias, w13, w2 = _bf16_layer(m, world, 40)
    kw = moe.route_kwargs(m, bias)
    for src in range(world):
        weights, experts = route(xs[src], wr, m.top_k, **kw)
        y = torch.zeros(xs[src].shape)
        for dst in range(world):
            on_dst = (experts // local) == dst
            sent = on_dst.any(1).nonzero(as_tuple=True)[0]
            recv_idx = torch.where(on_dst[sent], experts[sent] % local, -1)
            recv_w = weights[sent].clone()
            recv_w[recv_idx < 0] = float("nan")  # garbage in unused slots must not leak into the result
            counts = [(recv_idx == i).sum().item() for i in range(local)]
            part = moe.deepep_expert_side(xs[src][sent], recv_idx, recv_w, counts, w13[dst], w2[dst], local)
            y[sent] += part.float()
        ref = moe_forward_ref_local(xs, wr, w13, w2, top_k=m.top_k, **kw)[src]
        assert ((y - ref).norm() / ref.norm()).item() < 1e-2


def test_deepep_unavailable_without_the_package(monkeypatch, tiny_models):
    monkeypatch.setitem(sys.modules, "deep_ep", None)  # import deep_ep -> ImportError
    ok, reason = moe.deepep_available(2)
    assert not ok and reason.startswith("deep_ep is not importable (")


# --------------------------------------------------------------------------- a whole point, end to end


def _cpu_time_op(fn, *, iters=20, warmup=5, **kw):
    """Stand-in for the CUDA-event timer: one call, wall time (CPU tests check the flow, not the numbers),
    max over ranks like the real timer -- otherwise two ranks may pick different fixed-role-best splits
    (seen once in CI on a loaded 2-core machine)."""
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    if dist.is_initialized():
        t = torch.tensor([ms], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ms = t.item()
    return {"time_ms": ms, "p20_ms": ms, "p80_ms": ms, "samples": 1, "host_ms": ms}


def _fake_moe_forward(mode, seen=None):
    """A stand-in for kosmos.moe_forward with its signature: the nccl-a2a math (correct), or wrong / NaN / raising.
    ``seen``: a list the configs it is called with are appended to."""
    def fn(x, router_weight, w13, w2, *, top_k, routing, renormalize, bias, n_group, topk_group, routed_scaling,
           group, config, policy, comm_programs):
        assert group is None and policy in ("self", "fixed") and (comm_programs is None) == (policy == "self")
        assert isinstance(config, MoEForwardConfig)
        if seen is not None:
            seen.append(config)
        if mode == "raise":
            raise RuntimeError("kernel exploded\nsecond line")
        y = moe_forward_a2a(x, router_weight, w13, w2, top_k=top_k, fp32=False, routing=routing,
                            renormalize=renormalize, bias=bias, n_group=n_group, topk_group=topk_group,
                            routed_scaling=routed_scaling)
        if mode == "wrong":
            y = y * 1.05
        if mode == "nan":
            y[3, 5] = float("nan")
        return y
    return fn


def _fake_expert_gemms(x_sorted, counts, w13, w2, *, config):
    assert counts.dtype == torch.int32 and counts.shape == (w13.shape[0],) and isinstance(config, MoEForwardConfig)
    return _experts_forward(x_sorted, counts, w13, w2, fp32=False)


def _raising_expert_gemms(*a, **kw):
    raise ValueError("no such tile")


def _rows_by_impl(rows):
    return {(r["op"], r["impl"]): r for r in rows}


@pytest.mark.parametrize("name", ["tiny-softmax", "tiny-grouped"])
def test_point_end_to_end_world1(monkeypatch, tiny_models, name):
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    monkeypatch.setattr(moe, "moe_forward", _fake_moe_forward("ok"))
    monkeypatch.setattr(moe, "expert_gemms", _fake_expert_gemms)
    seen = []
    case = moe.MoECase(name, 96, "zipf:1.2")
    rows = moe.run_case(case, moe.MoESettings(), on_row=seen.append, device="cpu")
    assert rows == seen
    by = _rows_by_impl(rows)
    assert list(by) == [("moe_experts", "grouped-mm"), ("moe_experts", "kosmos-expert-gemms"),
                        *[("moe_fwd", n) for n in moe.MOE_IMPLS]]
    m = TINY[name]
    for r in rows:
        assert r["type"] == "result" and r["bench"] == "moe"
        assert (r["tokens"], r["experts"], r["top_k"], r["routing"], r["hidden"], r["expert_ffn"], r["ep"]) == \
            (96, m.experts, m.top_k, "zipf:1.2", m.hidden, m.expert_ffn, 1)
        assert (r["m"], r["n"], r["k"], r["world"]) == (96, m.hidden, m.expert_ffn, 1)
    for key in [("moe_experts", "grouped-mm"), ("moe_experts", "kosmos-expert-gemms"), ("moe_fwd", "kosmos"),
                ("moe_fwd", "nccl-a2a")]:
        r = by[key]
        assert r["status"] == "ok" and 0 < r["rel_err"] < 1e-2, r
    fwd = by[("moe_fwd", "nccl-a2a")]
    assert fwd["tflops"] == pytest.approx(6 * 96 * m.top_k * m.hidden * m.expert_ffn / (fwd["time_ms"] * 1e-3) / 1e12)
    assert fwd["t_gemm_ms"] == by[("moe_experts", "grouped-mm")]["time_ms"] and fwd["t_comm_ms"] == 0.0
    rows_recv = fwd["extra"]["rows_per_rank"]
    assert rows_recv == [96 * m.top_k]
    ex = by[("moe_experts", "kosmos-expert-gemms")]
    assert ex["tflops"] == pytest.approx(6 * rows_recv[0] * m.hidden * m.expert_ffn / (ex["time_ms"] * 1e-3) / 1e12)
    assert by[("moe_fwd", "deepep")]["status"] == "unavailable"
    assert by[("moe_fwd", "fixed-role")]["status"] == "unavailable"
    assert by[("moe_fwd", "fixed-role-best")]["reason"] == "no communication at world size 1"
    assert fwd["extra"]["top_expert_share"] > 1.5 / m.experts  # zipf skew visible in the row
    # the KOSMOS rows record the config they ran with (the defaults here), the others none
    for key, r in by.items():
        kosmos_impl = key[1] in ("kosmos", "fixed-role", "fixed-role-best", "kosmos-expert-gemms")
        assert r["config"] == (config_dict(MoEForwardConfig()) if kosmos_impl else None), key


def _fake_mx_moe_forward(x, router_weight, w13, w2, *, top_k, group, config, policy, comm_programs, precision,
                         **route_kw):
    """kosmos.moe_forward(..., precision="mxfp8") as the bench calls it: w13 / w2 the MX values, x bf16."""
    from kosmos_bench import moe_mx
    assert precision == "mxfp8" and x.dtype == torch.bfloat16
    assert torch.equal(w13, moe_mx.mx_expert_weights(w13, w2)[0])  # already MX values (idempotent)
    return moe_mx.moe_forward_a2a_mx(x, router_weight, w13, w2, top_k=top_k, fp32=True, **route_kw).bfloat16()


@pytest.mark.parametrize("name", ["tiny-softmax", "tiny-grouped"])
def test_point_end_to_end_mxfp8_world1(monkeypatch, tiny_models, name):
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    monkeypatch.setattr(moe, "moe_forward", _fake_mx_moe_forward)
    monkeypatch.setattr(moe, "expert_gemms", _raising_expert_gemms)  # never called at mxfp8
    rows = moe.run_case(moe.MoECase(name, 96, "zipf:1.2"), moe.MoESettings(dtype="mxfp8"), device="cpu")
    by = _rows_by_impl(rows)
    assert list(by) == [("moe_fwd", n) for n in moe.MOE_IMPLS]  # no expert-GEMM rows at mxfp8
    assert all(r["dtype"] == "mxfp8" and r["wire_bytes"] == 0 for r in rows)
    for impl in ("kosmos", "nccl-a2a"):
        r = by[("moe_fwd", impl)]
        assert r["status"] == "ok" and 0 < r["rel_err"] < 1e-2 and 1e-2 < r["rel_err_bf16"] < 1e-1, r
        assert r["t_gemm_ms"] > 0  # grouped-mm at bf16, timed without a row
    assert by[("moe_fwd", "nccl-a2a")]["note"].startswith("GEMM1's output rounded to bf16")
    assert by[("moe_fwd", "deepep")]["status"] == "unavailable"
    assert by[("moe_fwd", "deepep")]["reason"] == "no MXFP8 path in the deepep baseline yet"
    assert by[("moe_fwd", "fixed-role")]["reason"] == "no communication at world size 1"
    failed = moe.failed_rows(moe.MoECase(name, 96, "uniform"), 1, moe.MoESettings(dtype="mxfp8"), "boom")
    assert [r["impl"] for r in failed] == list(moe.MOE_IMPLS) and {r["dtype"] for r in failed} == {"mxfp8"}


def test_kosmos_without_the_precision_kwarg_is_recorded_failed(monkeypatch, tiny_models):
    """Until the MXFP8 kernel lands, kosmos.moe_forward has no ``precision``: the row says so, the sweep goes on."""
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    monkeypatch.setattr(moe, "moe_forward", _fake_moe_forward("ok"))
    st = moe.MoESettings(impls=("kosmos", "nccl-a2a"), dtype="mxfp8")
    by = _rows_by_impl(moe.run_case(moe.MoECase("tiny-softmax", 32, "uniform"), st, device="cpu"))
    k = by[("moe_fwd", "kosmos")]
    assert k["status"] == "failed" and k["reason"].startswith("TypeError") and "precision" in k["reason"], k
    assert k["rel_err_bf16"] is None and by[("moe_fwd", "nccl-a2a")]["status"] == "ok"


def test_config_reaches_the_kernels_and_the_rows(monkeypatch, tiny_models):
    """MoESettings.configs (what `--config` builds): kosmos.moe_forward and expert_gemms get that config, and
    every KOSMOS row records it in full."""
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    seen = []
    monkeypatch.setattr(moe, "moe_forward", _fake_moe_forward("ok", seen))
    got = []
    monkeypatch.setattr(moe, "expert_gemms", lambda *a, config, **kw: got.append(config) or _fake_expert_gemms(
        *a, config=config, **kw))
    cfg = MoEForwardConfig(copy_cols=128, half_tail=False)
    st = moe.MoESettings(impls=("kosmos", "nccl-a2a"), configs={"moe_fwd": cfg})
    by = _rows_by_impl(moe.run_case(moe.MoECase("tiny-softmax", 32, "uniform"), st, device="cpu"))
    assert seen and all(c == cfg for c in seen) and got and all(c == cfg for c in got)
    want = {"copy_cols": 128, "half_tail": False}
    assert by[("moe_fwd", "kosmos")]["config"] == want and by[("moe_experts", "kosmos-expert-gemms")]["config"] == want
    assert by[("moe_fwd", "nccl-a2a")]["config"] is None and by[("moe_experts", "grouped-mm")]["config"] is None


@pytest.mark.parametrize("mode, needle", [("wrong", "rel_err"), ("nan", "rel_err inf")])
def test_wrong_or_nan_kernel_is_recorded_failed(monkeypatch, tiny_models, mode, needle):
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    monkeypatch.setattr(moe, "moe_forward", _fake_moe_forward(mode))
    st = moe.MoESettings(impls=("kosmos", "nccl-a2a"), expert_gemms=False)
    by = _rows_by_impl(moe.run_case(moe.MoECase("tiny-grouped", 64, "uniform"), st, device="cpu"))
    assert set(by) == {("moe_fwd", "kosmos"), ("moe_fwd", "nccl-a2a")}
    assert by[("moe_fwd", "kosmos")]["status"] == "failed" and needle in by[("moe_fwd", "kosmos")]["reason"]
    assert by[("moe_fwd", "kosmos")]["time_ms"] is None
    assert by[("moe_fwd", "nccl-a2a")]["status"] == "ok"  # the sweep went on


def test_raising_kernel_is_recorded_failed_with_reason(monkeypatch, tiny_models):
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    monkeypatch.setattr(moe, "moe_forward", _fake_moe_forward("raise"))
    monkeypatch.setattr(moe, "expert_gemms", _raising_expert_gemms)
    st = moe.MoESettings(impls=("kosmos", "nccl-a2a"))
    by = _rows_by_impl(moe.run_case(moe.MoECase("tiny-softmax", 32, "uniform"), st, device="cpu"))
    for key, what in ((("moe_fwd", "kosmos"), "RuntimeError: kernel exploded"),
                      (("moe_experts", "kosmos-expert-gemms"), "ValueError: no such tile")):
        assert by[key]["status"] == "failed" and by[key]["reason"] == what, by[key]
    assert by[("moe_fwd", "nccl-a2a")]["status"] == "ok" and by[("moe_experts", "grouped-mm")]["status"] == "ok"


def test_failed_rows_cover_every_impl():
    st = moe.MoESettings()
    rows = moe.failed_rows(moe.MoECase("qwen3-235b", 4096, "uniform"), 2, st, "OutOfMemoryError: boom")
    assert [(r["op"], r["impl"]) for r in rows] == [("moe_experts", n) for n in moe.EXPERT_IMPLS] + \
        [("moe_fwd", n) for n in moe.MOE_IMPLS]
    assert all(r["status"] == "failed" and r["reason"] == "OutOfMemoryError: boom" and r["experts"] == 128
               for r in rows)
    configs = {r["impl"]: r["config"] for r in rows}
    assert configs["kosmos"] == configs["kosmos-expert-gemms"] == config_dict(MoEForwardConfig())
    assert configs["nccl-a2a"] is None and configs["grouped-mm"] is None


def _point_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        MOE_MODELS.update(TINY)
        timing.time_op = _cpu_time_op
        ok, wrong = _fake_moe_forward("ok"), _fake_moe_forward("wrong")
        # the fixed policy is wrong at S = 8 only: fixed-role-best must pick another split
        moe.moe_forward = lambda *a, **kw: (wrong if kw["comm_programs"] == 8 else ok)(*a, **kw)
        moe.expert_gemms = _fake_expert_gemms
        st = moe.MoESettings(impls=("kosmos", "nccl-a2a", "deepep", "fixed-role", "fixed-role-best"),
                             fixed_sweep=(8, 16, 24))
        rows = moe.run_case(moe.MoECase("tiny-grouped", 48, "zipf:1.2"), st, device="cpu")
        out = [(r["op"], r["impl"], r["status"], r["rel_err"], r["reason"], r["t_comm_ms"] is not None,
                r["extra"]["rows_per_rank"], r["params"]) for r in rows]
        calls = []

        def raising(*a, comm_programs, **kw):
            calls.append(comm_programs)
            raise RuntimeError(f"no kernel at S={comm_programs}")
        moe.moe_forward = raising
        st = moe.MoESettings(impls=("fixed-role-best",), expert_gemms=False, fixed_sweep=(8, 16, 24))
        rows = moe.run_case(moe.MoECase("tiny-softmax", 16, "uniform"), st, device="cpu")
        q.put((rank, (out, [(r["status"], r["reason"], r["params"]) for r in rows], calls)))
    finally:
        dist.destroy_process_group()


def test_point_end_to_end_world2_over_gloo():
    got = _spawn(_point_rank, 2)
    assert got[0] == got[1]  # every rank agrees on every row
    rows, failing_rows, failing_calls = got[0]
    by = {(op, impl): rest for op, impl, *rest in rows}
    for key in [("moe_experts", "grouped-mm"), ("moe_experts", "kosmos-expert-gemms"), ("moe_fwd", "kosmos"),
                ("moe_fwd", "nccl-a2a"), ("moe_fwd", "fixed-role"), ("moe_fwd", "fixed-role-best")]:
        status, err, reason, has_comm, _, _ = by[key]
        assert status == "ok" and 0 < err < 1e-2, (key, by[key])
    assert by[("moe_fwd", "nccl-a2a")][3]  # t_comm measured at world 2
    assert by[("moe_fwd", "deepep")][0] == "unavailable"
    assert by[("moe_fwd", "fixed-role-best")][5]["comm_programs"] in (16, 24)
    assert by[("moe_fwd", "fixed-role-best")][5]["sweep"] == [8, 16, 24]
    rows_per_rank = by[("moe_fwd", "nccl-a2a")][4]
    assert len(rows_per_rank) == 2 and sum(rows_per_rank) == 2 * 48 * TINY["tiny-grouped"].top_k
    # no split passes: every split was tried, the row is failed and names the first failure
    assert failing_calls == [8, 16, 24]
    assert failing_rows == [("failed", "no fixed split passed (S=8: rank 0: RuntimeError: no kernel at S=8)",
                             {"sweep": [8, 16, 24]})]


def test_moe_probe_trees_options(tmp_path):
    """moe_probe --tree: each tree's probe gets the same options but --tree/--out; a tree without the
    packages is refused before anything runs."""
    from dev import moe_probe
    argv = ["--out", "o", "--tree", "a", "--model", "qwen3-235b", "--tree=b", "--config", "copy_cols=256",
            "--out=x"]
    assert moe_probe._strip_trees(argv) == ["--model", "qwen3-235b", "--config", "copy_cols=256"]
    with pytest.raises(SystemExit, match="needs kosmos/ and kosmos_bench/"):
        moe_probe.main(["--out", str(tmp_path), "--tree", str(tmp_path)])


def test_moe_probe_configs(capsys):
    """moe_probe --config: one MoEForwardConfig per value (defaults without any); a bad key is refused before
    anything runs, naming the known keys."""
    from dev import moe_probe
    got = moe_probe.probe_configs(["copy_cols=256,half_tail=false", "moe_fwd.half_tail=0"])
    assert got == [("copy_cols=256,half_tail=false", MoEForwardConfig(copy_cols=256, half_tail=False)),
                   ("moe_fwd.half_tail=0", MoEForwardConfig(half_tail=False))]
    assert moe_probe.probe_configs(None) == [("", MoEForwardConfig())]
    with pytest.raises(SystemExit):
        moe_probe.main(["--out", "o", "--config", "KOSMOS_MOE_BH=128"])
    assert "unknown key 'KOSMOS_MOE_BH'; known: moe_fwd.copy_cols, moe_fwd.half_tail" in capsys.readouterr().err


def test_moe_probe_runs_each_tree_in_a_subprocess(tmp_path, monkeypatch):
    import subprocess
    import sys

    from dev import moe_probe
    trees = []
    for name in ("main", "branch"):
        (tmp_path / name / "kosmos").mkdir(parents=True)
        (tmp_path / name / "kosmos_bench").mkdir()
        trees.append(str(tmp_path / name))
    calls = []

    def fake_run(cmd, env, cwd):
        calls.append((cmd, env["PYTHONPATH"].split(os.pathsep)[0], cwd))
        return subprocess.CompletedProcess(cmd, 0)
    monkeypatch.setattr(subprocess, "run", fake_run)
    out = tmp_path / "out"
    rc = moe_probe.main(["--out", str(out), "--tree", trees[0], "--tree", trees[1], "--tokens", "8192"])
    assert rc == 0 and len(calls) == 2
    for i, (cmd, path0, cwd) in enumerate(calls):
        assert path0 == trees[i] and cwd == trees[i]
        assert cmd == [sys.executable, "-m", "dev.moe_probe", "--out", str(out / f"tree{i}"),
                       "--tokens", "8192"]


# --------------------------------------------------------------------------- --direction bwd, fwd+bwd


def _fake_moe_forward_routing(x, router_weight, w13, w2, *, top_k, routing, renormalize, bias, n_group, topk_group,
                              routed_scaling, group, config, policy, comm_programs, return_routing=False,
                              save_gu=False):
    """kosmos.moe_forward's return_routing on the CPU (the op needs CUDA): the reference's routing decision, and
    with save_gu (the bench's W = 1 backward) g | u placed as the kernel would (simranks.placed_gate_up)."""
    assert return_routing and policy == "self"
    weights, experts = route(x, router_weight, top_k, routing, renormalize=renormalize, bias=bias, n_group=n_group,
                             topk_group=topk_group, routed_scaling=routed_scaling)
    if save_gu:
        return None, weights, experts, placed_gate_up(x, w13, experts, top_k)
    return None, weights, experts


@pytest.mark.interpreter
@pytest.mark.parametrize("direction", ["bwd", "fwd+bwd"])
@pytest.mark.parametrize("name", ["tiny-softmax", "tiny-grouped"])
def test_point_backward_world1(monkeypatch, tiny_models, name, direction):
    """bwd / fwd+bwd rows at W=1 on the CPU: kosmos (moe_backward_w1's kernels under the interpreter, on the
    decision of a stand-in forward) and nccl-a2a (autograd through moe_forward_a2a) checked gradient by gradient
    against moe_backward_ref; at bwd (not fwd+bwd) the backward's expert GEMMs alone too (grouped-mm's autograd,
    kosmos's expert_backward_gemms) against fp32 formulas, grouped-mm's time the layer rows' t_gemm_ms; the others
    unavailable with their reasons."""
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    monkeypatch.setattr(moe, "moe_forward", _fake_moe_forward_routing)
    rows = moe.run_case(moe.MoECase(name, 64, "uniform"), moe.MoESettings(iters=1, warmup=0, direction=direction),
                        device="cpu")
    by = _rows_by_impl(rows)
    experts = [("moe_experts", n) for n in moe.EXPERT_IMPLS] if direction == "bwd" else []
    assert list(by) == experts + [("moe_fwd", n) for n in moe.MOE_IMPLS]
    m = TINY[name]
    for op, impl in experts:
        r = by[(op, impl)]
        assert r["status"] == "ok" and r["direction"] == "bwd", r
        assert set(r["rel_err_grads"]) == set(moe.EXPERT_GRADS)
        assert r["rel_err"] == max(r["rel_err_grads"].values()) and 0 < r["rel_err"] < moe.GRAD_TOLERANCE, r
        rows_max = max(r["extra"]["rows_per_rank"])
        assert r["tflops"] == pytest.approx(12 * rows_max * m.hidden * m.expert_ffn / (r["time_ms"] * 1e-3) / 1e12)
    for impl in ("kosmos", "nccl-a2a"):
        r = by[("moe_fwd", impl)]
        assert r["status"] == "ok" and r["direction"] == direction, r
        assert set(r["rel_err_grads"]) == set(moe.GRADS)
        assert r["rel_err"] == max(r["rel_err_grads"].values()) and 0 < r["rel_err"] < moe.GRAD_TOLERANCE, r
        flops = moe.DIRECTION_FLOPS[direction] * 6 * 64 * m.top_k * m.hidden * m.expert_ffn
        assert r["tflops"] == pytest.approx(flops / (r["time_ms"] * 1e-3) / 1e12)
        assert r["t_comm_ms"] is None
        assert r["t_gemm_ms"] == (by[("moe_experts", "grouped-mm")]["time_ms"] if experts else None)
    assert by[("moe_fwd", "deepep")]["status"] == "unavailable"
    assert by[("moe_fwd", "fixed-role")]["reason"] == "no communication at world size 1"
    # the kosmos backward's switches ride on its row (SCHEMA.md, bwd_config); the baselines have none
    assert by[("moe_fwd", "kosmos")]["bwd_config"] == config_dict(MoEBackwardConfig())
    assert "bwd_config" not in by[("moe_fwd", "nccl-a2a")]


def _fake_mx_moe_forward_routing(x, router_weight, w13, w2, *, top_k, routing, renormalize, bias, n_group,
                                 topk_group, routed_scaling, group, config, policy, comm_programs, precision,
                                 return_routing=False, save_gu=False):
    """kosmos.moe_forward(precision="mxfp8", return_routing=True) on the CPU: the reference's routing decision on
    the bf16 x (the MX layer routes on it); w13 / w2 the forward's MX copies; no g | u saved at mxfp8."""
    assert return_routing and precision == "mxfp8" and not save_gu and policy == "self"
    assert torch.equal(w13, moe_mx.mx_expert_weights(w13, w2)[0])  # MX values (idempotent)
    weights, experts = route(x, router_weight, top_k, routing, renormalize=renormalize, bias=bias, n_group=n_group,
                             topk_group=topk_group, routed_scaling=routed_scaling)
    return None, weights, experts


@pytest.mark.interpreter
@pytest.mark.parametrize("direction", ["bwd", "fwd+bwd"])
def test_point_backward_mxfp8_world1(monkeypatch, tiny_models, direction):
    """mxfp8 bwd / fwd+bwd rows at W = 1 on the CPU: kosmos (moe_backward(precision="mxfp8") under the interpreter,
    on a stand-in forward's decision) and nccl-a2a (autograd through moe_mx.moe_forward_a2a_mx_train) checked
    gradient by gradient against moe_backward_ref(mx=True) within GRAD_TOLERANCE_MX; no expert-GEMM rows; the
    fixed-role rows unavailable (no communication at W = 1)."""
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    monkeypatch.setattr(moe, "moe_forward", _fake_mx_moe_forward_routing)
    st = moe.MoESettings(impls=("kosmos", "nccl-a2a", "fixed-role"), iters=1, warmup=0, direction=direction,
                         dtype="mxfp8")
    rows = moe.run_case(moe.MoECase("tiny-softmax", 64, "uniform"), st, device="cpu")
    by = _rows_by_impl(rows)
    assert list(by) == [("moe_fwd", n) for n in ("kosmos", "nccl-a2a", "fixed-role")]
    for impl in ("kosmos", "nccl-a2a"):
        r = by[("moe_fwd", impl)]
        assert r["status"] == "ok" and r["dtype"] == "mxfp8" and r["direction"] == direction, r
        assert set(r["rel_err_grads"]) == set(moe.GRADS)
        assert r["rel_err"] == max(r["rel_err_grads"].values()) and 0 < r["rel_err"] < moe.GRAD_TOLERANCE_MX, r
    assert by[("moe_fwd", "fixed-role")]["status"] == "unavailable"


def test_mx_training_layer_is_the_mx_backward_reference():
    """moe_mx.moe_forward_a2a_mx_train at W = 1: autograd through its fp32 form gives moe_backward_ref(mx=True)'s
    gradients (the same rules as autograd Functions: 1e-5), its forward the MX layer's; the baseline form (bf16,
    grouped GEMMs; its row rounding the kernel under the interpreter, the torch reference on a CPU without it)
    within GRAD_TOLERANCE_MX of it."""
    from kosmos.ops.moe_backward import moe_mx_weights
    from kosmos.reference.moe import moe_backward_ref
    m = TINY["tiny-grouped"]
    x, wr, bias, _ = moe.make_router_inputs(m, 48, moe.parse_routing("uniform"), 0, 3)
    w13, w2 = moe.make_expert_weights(m, 1, 0, 3)
    dy = torch.randn(48, m.hidden, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    kw = moe.route_kwargs(m, bias)
    mxw = moe_mx_weights(w13, w2)
    _, experts = route(x, wr, m.top_k, **kw)
    want = moe_backward_ref(x, wr, w13, w2, dy, top_k=m.top_k, experts=experts, mx=True, **kw)
    y_ref = moe_forward_ref_local([x], wr, [w13], [w2], top_k=m.top_k, mx=True, **kw)[0]
    for fp32, tol in ((True, 1e-5), (False, moe.GRAD_TOLERANCE_MX)):
        leaves = [t.detach().clone().float() if fp32 else t.detach().clone() for t in (x, wr, w13, w2)]
        leaves = [t.requires_grad_(True) for t in leaves]
        y = moe_mx.moe_forward_a2a_mx_train(*leaves, mxw, top_k=m.top_k, fp32=fp32, **kw)
        assert ((y.detach().float() - y_ref).norm() / y_ref.norm()).item() < (1e-5 if fp32 else 3e-2)
        got = torch.autograd.grad(y, leaves, dy.float() if fp32 else dy)
        for name, a, b in zip(moe.GRADS, got, want):
            rel = ((a.float() - b).norm() / b.norm()).item()
            assert rel < tol, (fp32, name, rel)


@pytest.mark.interpreter
def test_backward_config_reaches_the_kosmos_call_and_its_row(monkeypatch, tiny_models):
    """--config moe_bwd.one_launch=false: moe_backward_w1 runs with that kosmos.MoEBackwardConfig (the multi-launch
    path) and the kosmos row records it."""
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    monkeypatch.setattr(moe, "moe_forward", _fake_moe_forward_routing)
    seen, real = [], moe.moe_backward_w1
    monkeypatch.setattr(moe, "moe_backward_w1", lambda *a, **kw: seen.append(kw["config"]) or real(*a, **kw))
    config = MoEBackwardConfig(one_launch=False)
    st = moe.MoESettings(impls=("kosmos",), expert_gemms=False, iters=1, warmup=0, direction="bwd",
                         configs={"moe_bwd": config})
    rows = moe.run_case(moe.MoECase("tiny-softmax", 32, "uniform"), st, device="cpu")
    row = _rows_by_impl(rows)[("moe_fwd", "kosmos")]
    assert row["status"] == "ok" and row["bwd_config"] == config_dict(config), row
    assert seen and all(c == config for c in seen)


def test_backward_availability_by_world_and_dtype():
    from kosmos_bench import registry
    kosmos = registry.get("moe_fwd", "kosmos")
    assert kosmos.availability(1, "bf16", "bwd") == (True, None)
    assert kosmos.availability(2, "bf16", "bwd") == (True, None)  # checked by the distributed reference
    assert kosmos.availability(1, "mxfp8", "fwd+bwd") == (True, None)  # the MX backward (multi-launch path)
    assert kosmos.availability(2, "mxfp8", "bwd") == (True, None)
    assert registry.get("moe_fwd", "nccl-a2a").availability(2, "bf16", "bwd") == (True, None)
    assert registry.get("moe_fwd", "nccl-a2a").availability(2, "mxfp8", "bwd") == (True, None)
    assert registry.impls_at("moe_experts", moe.EXPERT_IMPLS, "bf16", "bwd") == moe.EXPERT_IMPLS
    assert registry.impls_at("moe_experts", moe.EXPERT_IMPLS, "bf16", "fwd+bwd") == ()
    assert registry.impls_at("moe_experts", moe.EXPERT_IMPLS, "mxfp8", "bwd") == ()
    assert registry.impls_at("moe_fwd", moe.MOE_IMPLS, "bf16", "bwd") == moe.MOE_IMPLS
    for name in ("fixed-role", "fixed-role-best"):  # no communication at W = 1; the one launch's split at W > 1
        fixed = registry.get("moe_fwd", name)
        for direction in ("bwd", "fwd+bwd"):
            assert fixed.availability(1, "bf16", direction) == (False, "no communication at world size 1")
            assert fixed.availability(2, "bf16", direction) == (True, None)
            assert fixed.availability(8, "bf16", direction) == (True, None)
            assert fixed.availability(2, "mxfp8", direction) == (
                False, "the MXFP8 backward runs on the multi-launch path: no fixed-role split")
        assert fixed.availability(2, "bf16", "fwd") == (True, None)
    deepep = registry.get("moe_fwd", "deepep")  # the backward as the forward: DeepEP's worlds, bf16
    assert deepep.availability(2, "mxfp8", "bwd") == (False, "no MXFP8 path in the deepep baseline yet")
    assert deepep.availability(2, "bf16", "bwd") == deepep.availability(2, "bf16", "fwd")
    assert deepep.availability(2, "bf16", "fwd+bwd") == deepep.availability(2, "bf16", "fwd")


@pytest.mark.parametrize("direction", ["bwd", "fwd+bwd"])
def test_fixed_role_backward_runs_the_one_launch_split(monkeypatch, tiny_models, direction):
    """fixed-role / fixed-role-best at bwd and fwd+bwd at W > 1 (W = 2 faked; stand-ins for both ops): the forward
    at policy "fixed" and S, then moe_backward over the default group with one_launch=True, policy "fixed" and the
    same S, on the forward's decision; kosmos's backward stays the multi-launch one (no one_launch, self policy)."""
    from kosmos_bench import registry
    calls = []
    w_, e_ = torch.ones(4, 2), torch.zeros(4, 2, dtype=torch.long)

    def forward(*a, policy, comm_programs, return_routing, save_gu, **kw):
        calls.append(("fwd", policy, comm_programs, save_gu))
        return None, w_, e_

    def backward(*a, group=None, saved_gu=None, **kw):
        assert a[5] is w_ and a[6] is e_ and saved_gu is None and group is None
        calls.append(("bwd", kw.get("one_launch"), kw.get("policy"), kw.get("comm_programs")))
        return "dx", "d_router", "dw13", "dw2"

    monkeypatch.setattr(moe, "moe_forward", forward)
    monkeypatch.setattr(moe, "moe_backward", backward)
    monkeypatch.setattr(moe.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(moe.dist, "get_world_size", lambda *a: 2)
    inp = replace(_grad_inputs(), direction=direction)
    for name, params in (("fixed-role", {"comm_programs": 16}), ("fixed-role-best", {"comm_programs": 24}),
                         ("kosmos", {})):
        calls.clear()
        fn, _ = registry.get("moe_fwd", name).make(inp, params, None)
        if direction == "bwd":
            assert isinstance(fn, timing.Split)
        assert fn() == ("dx", "d_router", "dw13", "dw2", e_)
        s = params.get("comm_programs")
        want_bwd = ("bwd", True, "fixed", s) if s else ("bwd", None, None, None)
        assert calls == [("fwd", "fixed" if s else "self", s, False), want_bwd], (name, calls)


def _expert_backward_inputs(rows_per_expert=(5, 0, 9, 3), hidden=32, ffn=16, seed=3):
    g = torch.Generator().manual_seed(seed)
    n = sum(rows_per_expert)
    bf = dict(generator=g, dtype=torch.float32)
    x, dy = (torch.randn(n, hidden, **bf).to(torch.bfloat16) for _ in range(2))
    w13 = (torch.randn(len(rows_per_expert), hidden, 2 * ffn, **bf) / hidden ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(len(rows_per_expert), ffn, hidden, **bf) / ffn ** 0.5).to(torch.bfloat16)
    counts = torch.tensor(rows_per_expert, dtype=torch.int32)
    return moe.ExpertInputs(x, counts, w13, w2, moe.BWD, dy, torch.rand(n, generator=g))


@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_expert_backward_reference_passes_grouped_mm_and_catches_errors(chunk):
    """The backward's expert-GEMM check: grouped-mm's autograd (bf16) passes at every chunk size (an empty
    expert included); a gradient with one expert's block scaled, dx rows out of order, or a NaN fails."""
    from kosmos_bench import registry
    inp = _expert_backward_inputs()
    fn, _ = registry.get("moe_experts", "grouped-mm").make(inp, {}, None)
    out = fn()
    ref = moe.expert_backward_reference(inp, chunk)
    err, errs = ref.errors(out)
    assert set(errs) == set(moe.EXPERT_GRADS) and 0 < err < 1e-2, errs
    dx, dw13, dw2, row_of = out
    bad = dw2.clone()
    bad[2] *= 1.1
    assert ref.errors((dx, dw13, bad, row_of))[1]["dw2"] > 5e-2
    assert ref.errors((dx.flip(0), dw13, dw2, row_of))[1]["dx"] > 0.5
    nan = dw13.clone()
    nan[0, 0, 0] = float("nan")
    assert not ref.errors((dx, nan, dw2, row_of))[0] <= moe.GRAD_TOLERANCE
    perm = torch.randperm(dx.shape[0])  # a layout of the implementation's own: row_of maps the packed rows into it
    moved = torch.empty_like(dx)
    moved[perm] = dx
    assert ref.errors((moved, dw13, dw2, perm))[0] == pytest.approx(err)


@pytest.mark.interpreter
def test_kosmos_expert_backward_matches_moe_backward_stages():
    """kosmos-expert-gemms at bwd (expert_backward_operands + expert_backward_gemms, the interpreter) passes the
    fp32 check, on its padded layout where Triton runs."""
    from kosmos_bench import registry
    inp = _expert_backward_inputs()
    fn, _ = registry.get("moe_experts", "kosmos-expert-gemms").make(inp, {}, None)
    out = fn()
    err, errs = moe.expert_backward_reference(inp, 2).errors(out)
    assert 0 < err < 1e-2, errs
    assert out[3] is not None and out[0].shape[0] > inp.x_sorted.shape[0]  # the padded layout, mapped back


def test_split_is_timed_without_its_setup(monkeypatch):
    calls = []
    split = timing.Split(lambda: calls.append("setup") or 3, lambda s: calls.append(("run", s)) or s + 1)
    assert split() == 4 and calls == ["setup", ("run", 3)]


def test_reference_parts_record_each_error():
    from kosmos_bench.harness import Reference
    ref = (torch.ones(4), torch.ones(3))
    r = Reference(lambda out: ref, 1e-2, parts=("a", "b"), parts_key="errs")
    err, errs = r.errors((torch.ones(4), torch.full((3,), 1.1), "decision"))
    assert errs["a"] == 0 and errs["b"] == pytest.approx(0.1, rel=1e-3) and err == errs["b"]
    err, _ = r.errors((torch.full((4,), float("nan")), torch.ones(3)))
    assert not err <= 1e-2  # NaN (or inf) never passes


@pytest.mark.gpu
@pytest.mark.slow
def test_bench_moe_directions_end_to_end(tmp_path):
    """`kosmos bench moe ... --direction fwd,bwd,fwd+bwd` on one GPU: kosmos and nccl-a2a rows ok in every
    direction, the backward rows with their four gradient errors; the expert GEMMs alone ok at fwd and bwd."""
    import json
    import subprocess
    out = tmp_path / "moe-dir.jsonl"
    cmd = [sys.executable, "-m", "kosmos_bench.cli", "bench", "moe", "--hidden", "256", "--ffn", "128", "--experts",
           "8", "--top-k", "2", "--ep", "1", "--tokens", "256", "--direction", "fwd,bwd,fwd+bwd", "--iters", "2",
           "--out", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    experts = [row for row in rows if row["type"] == "result" and row["op"] == "moe_experts"]
    assert {(row["direction"], row["impl"]) for row in experts} == {
        (d, impl) for d in ("fwd", "bwd") for impl in moe.EXPERT_IMPLS}  # one row per routing of each
    assert all(row["status"] == "ok" for row in experts), [(r["direction"], r["impl"], r["reason"]) for r in experts]
    rows = [row for row in rows if row["type"] == "result" and row["op"] == "moe_fwd"]
    for direction in ("fwd", "bwd", "fwd+bwd"):
        for impl in ("kosmos", "nccl-a2a"):
            got = [row for row in rows if row["direction"] == direction and row["impl"] == impl]
            assert got and all(row["status"] == "ok" for row in got), (direction, impl, got)
            if direction != "fwd":
                assert all(set(row["rel_err_grads"]) == set(moe.GRADS) for row in got)


def test_trace_of_one_kosmos_forward(monkeypatch, tmp_path, tiny_models):
    """--trace: after a point whose kosmos row is ok, one traced kosmos forward (the trace buffer passed to
    moe_forward) is written as a trace JSON with the point's identity and every event the buffer holds."""
    import json
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    fake = _fake_moe_forward("ok")
    traced = []

    def forward(*a, trace=None, **kw):
        if trace is not None:  # two events of program 1: (kind, task, start, end)
            trace[1, 0] = torch.tensor([2, 7, 100, 250])
            trace[1, 1] = torch.tensor([3, 8, 260, 400])
            traced.append(trace.shape)
        return fake(*a, **{"policy": "self", "comm_programs": None, **kw})

    monkeypatch.setattr(moe, "moe_forward", forward)
    monkeypatch.setattr(moe, "expert_gemms", _fake_expert_gemms)
    st = moe.MoESettings(impls=("kosmos", "nccl-a2a"), expert_gemms=False, trace_dir=str(tmp_path / "tr"))
    rows = moe.run_case(moe.MoECase("tiny-softmax", 32, "zipf:1.2"), st, device="cpu")
    assert _rows_by_impl(rows)[("moe_fwd", "kosmos")]["status"] == "ok" and len(traced) == 1
    files = list((tmp_path / "tr").glob("*.json"))
    assert [f.name for f in files] == ["trace-tiny-softmax-32-zipf1.2-w1.json"]
    doc = json.loads(files[0].read_text())
    assert doc["type"] == "trace" and doc["op"] == "moe_fwd" and doc["tokens"] == 32 and doc["world"] == 1
    assert doc["ranks"] == [{"rank": 0, "events": [[1, 2, 7, 100, 250], [1, 3, 8, 260, 400]]}]
    # at mxfp8 (or without --trace) nothing is traced
    st_mx = moe.MoESettings(impls=("nccl-a2a",), expert_gemms=False, trace_dir=str(tmp_path / "tr2"))
    moe.run_case(moe.MoECase("tiny-softmax", 32, "uniform"), st_mx, device="cpu")
    assert not (tmp_path / "tr2").exists()


# --------------------------------------------------------------------------- the W=1 gradient check, chunked


def _grad_inputs(name="tiny-grouped", tokens=64):
    m = TINY[name]
    x, wr, bias, _ = moe.make_router_inputs(m, tokens, "uniform", 0, 0)
    w13, w2 = moe.make_expert_weights(m, 1, 0, 0)
    dy = torch.randn(tokens, m.hidden, generator=torch.Generator().manual_seed(5), dtype=torch.bfloat16)
    return moe.MoEInputs(m, x, wr, bias, w13, w2, direction="bwd", dy=dy)


def _whole_errors(inp, out):
    """The unchunked check: moe_backward_ref's whole fp32 gradients, each compared whole (harness.rel_err)."""
    from kosmos.reference.moe import moe_backward_ref
    from kosmos_bench import harness
    ref = moe_backward_ref(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy, top_k=inp.model.top_k,
                           **inp.route_kw(), experts=out[len(moe.GRADS)])
    return {name: harness.rel_err(o, r) for name, o, r in zip(moe.GRADS, out, ref)}


def test_grad_reference_chunked_equals_whole(monkeypatch, tiny_models):
    """grad_reference at W=1 compares the weight gradients a chunk of experts at a time (3 here: 16 experts in
    6 chunks, the last short) and gives every gradient's rel_err of the whole-tensor comparison within 1e-6,
    for nccl-a2a's bf16 autograd gradients; deepseek-v3's chunk is 6 experts (1 GiB of fp32 dw13 + dw2)."""
    assert moe.grad_reference_chunk(MOE_MODELS["deepseek-v3"]) == 6
    inp = _grad_inputs()
    m = inp.model
    monkeypatch.setattr(moe, "GRAD_REF_CHUNK_BYTES", 3 * (3 * m.hidden * m.expert_ffn * 4))
    assert moe.grad_reference_chunk(m) == 3
    out = moe.a2a_backward(inp)()
    chunks = []
    real = moe.moe_backward_ref
    monkeypatch.setattr(moe, "moe_backward_ref", lambda *a, **kw: chunks.append(kw["expert_chunk"]) or real(*a, **kw))
    err, errs = moe.grad_reference(inp).errors(out)
    whole = _whole_errors(inp, out)
    assert chunks == [3]
    assert set(errs) == set(moe.GRADS) and err == max(errs.values())
    for name in moe.GRADS:
        assert 0 < errs[name] < moe.GRAD_TOLERANCE and errs[name] == pytest.approx(whole[name], rel=1e-6), name


def test_grad_reference_chunked_catches_corruption(monkeypatch, tiny_models):
    """The chunked check sees a wrong expert in any chunk: with the fp32 reference itself as the output every
    error is 0; one expert's dw2 (in the last, short chunk) scaled by 1.01 gives exactly that expert's share
    (0.01 ||dw2[e]|| / ||dw2||), by 1.5 it fails the tolerance, and one NaN in dw13 gives inf (never passes)."""
    inp = _grad_inputs()
    m = inp.model
    monkeypatch.setattr(moe, "GRAD_REF_CHUNK_BYTES", 3 * (3 * m.hidden * m.expert_ffn * 4))
    _, experts = route(inp.x, inp.router_weight, m.top_k, **inp.route_kw())
    ref = moe.grad_reference(inp)
    want = moe.moe_backward_ref(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy, top_k=m.top_k,
                                **inp.route_kw(), experts=experts)
    exact = (*want, experts)
    err, errs = ref.errors(exact)
    assert err == 0 and all(e == 0 for e in errs.values())
    e = 13 + int(torch.bincount(experts.reshape(-1), minlength=m.experts)[13:].argmax())  # experts 12-15: last chunk
    for scale, fails in ((1.01, False), (1.5, True)):
        dw2 = want[3].clone()
        dw2[e] *= scale
        err, errs = ref.errors((*want[:3], dw2, experts))
        share = (scale - 1) * want[3][e].norm().item() / want[3].norm().item()
        assert errs["dw2"] == pytest.approx(share, rel=1e-5) and errs["dw13"] == 0 and err == errs["dw2"]
        assert (not err <= moe.GRAD_TOLERANCE) == fails
    dw13 = want[2].clone()
    dw13[e, 1, 2] = float("nan")
    err, errs = ref.errors((want[0], want[1], dw13, want[3], experts))
    assert math.isinf(errs["dw13"]) and not err <= moe.GRAD_TOLERANCE


def test_backward_check_fits_an_h200_at_deepseek_v3():
    """backward_check_bytes at EP=1: deepseek-v3 at 4k and 8k tokens peaks well under ~130 GiB, the reference's
    own part a few GiB (no whole fp32 weight gradients)."""
    m = MOE_MODELS["deepseek-v3"]
    for tokens in (4096, 8192):
        b = moe.backward_check_bytes(m, tokens)
        ref = sum(v for k, v in b.items() if k.startswith("reference"))
        assert b["peak"] < 60 * moe.GiB and ref < 8 * moe.GiB, (tokens, b)
        assert b["weights (w13, w2 bf16)"] == 256 * 3 * 7168 * 2048 * 2


def test_out_of_memory_reason_is_one_line():
    from kosmos_bench.harness import error_reason
    e = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 28.00 GiB. GPU 0 has a total capacity "
                                    "of 139.80 GiB of which 3.1 GiB is free.\nOf the allocated memory ...")
    reason = error_reason(e)
    assert reason.startswith("out of memory: needs 28.00 GiB more") and "\n" not in reason


def test_moe_probe_dtype_refused_before_anything_runs(capsys):
    """moe_probe --dtype: bf16 and/or mxfp8; anything else is refused by name before a rank spawns."""
    from dev import moe_probe
    with pytest.raises(SystemExit):
        moe_probe.main(["--out", "o", "--dtype", "bf16,fp4"])
    assert "--dtype: 'fp4' is not bf16 or mxfp8" in capsys.readouterr().err
