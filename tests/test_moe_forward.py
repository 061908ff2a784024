"""The one-launch MoE layer (kosmos.moe_forward): every platform's cases, by marker (see conftest.py).

* ``interpreter`` -- W simulated ranks in one process under the Triton CPU interpreter (simranks.MoERanks).
  The interpreter runs programs one after another, so at W > 1 a rank's call is split into three launches
  by stage mask -- ROUTE on every rank, then PERMUTE+GEMM1+GEMM2 on every rank, then FOLD -- so that no
  program waits on a rank that has not run yet (a mistake fails fast on a bounded wait instead of hanging).
  At W = 1 the whole call is one launch. Checks: the kernel's routing equals the reference router (routing
  given: the given decision, loaded, not routed; y bitwise the routed launch's on the router's decision); y equals
  the fp32 reference given that routing; every expert row and output is written (buffers poisoned with NaN);
  bitwise determinism; back-to-back epochs with fresh inputs; scratch, counters and errors left clean; done
  flags published.
* unmarked -- input checks (moe_forward / expert_gemms): a clear ValueError before anything launches. They
  need no GPU: the checks run before any device work; CPU tensors themselves are the last error they report.
  Every rank's verdict on the shapes, over gloo.
* ``gpu`` -- W=1 on one GPU through the public op. The expert math is checked against the fp32 reference
  *given the kernel's own routing* (tensor-core logits and the fp32 reference router may order near-tied
  experts differently); the router is checked separately: every token whose k-th and (k+1)-th reference
  scores are apart by more than 1e-3 must get exactly the reference's experts, in order.
* ``ranks`` -- W simulated ranks on one GPU, every rank's launch at once.
* ``multi_gpu`` -- W=2, one process per GPU: correctness, determinism and back-to-back calls, a stalled peer.
"""
import pytest
import torch

import opcases
from multiproc import Checks, spawn_gloo, stall_peer
from opcases import INTERP_GRID, INTERP_TIMEOUT_NS, TOL
import simranks
from simranks import MoERanks, rand

from kosmos.core import planning
from kosmos.reference import moe as moe_reference
from kosmos.config import MoEForwardConfig
from kosmos.ops import moe_forward as mf

# The interpreter casts fp32 -> bf16 by truncation, not round-to-nearest (measured with Triton 3.9, also with
# fp_downcast_rounding="rtne"); h, o and y are each truncated once, ~1% in all at these tiny sizes. A row
# routed to the wrong expert or slot gives errors of order 1; the GPU tests hold TOL = 1e-2.
INTERP_TOL = 2e-2
SOFTMAX = dict(routing="softmax", renormalize=True)


def grouped(experts, n_group, topk_group, seed, bias_scale, **kw):
    """sigmoid-grouped routing kwargs (routed_scaling 2.5) with a random per-expert bias."""
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(seed)) * bias_scale
    return dict(routing="sigmoid-grouped", n_group=n_group, topk_group=topk_group, routed_scaling=2.5, bias=bias,
                **kw)


def _interp_grouped(experts, n_group, topk_group):
    return grouped(experts, n_group, topk_group, seed=7, bias_scale=0.1, renormalize=True)


def _gpu_grouped(experts, n_group, topk_group):
    return grouped(experts, n_group, topk_group, seed=1, bias_scale=0.05)


# ==================================================================================== CPU interpreter
INTERP_CASES = [  # (world, tokens, hidden, ffn, experts, top_k, routing); interpreter tiles are 16 rows/cols
    pytest.param(1, 37, 48, 40, 8, 2, SOFTMAX, id="w1-softmax"),  # one launch; ragged token blocks and H, F
    pytest.param(1, 20, 32, 24, 16, 3, _interp_grouped(16, 4, 2), id="w1-grouped"),  # grouped routing, odd k
    pytest.param(2, 21, 40, 32, 8, 2, dict(routing="softmax", renormalize=False),
                 id="w2-softmax-norenorm"),  # weights not renormalised; rows cross to the peer
    pytest.param(2, 17, 32, 16, 16, 4, _interp_grouped(16, 4, 2), id="w2-grouped"),  # grouped across 2 ranks
    pytest.param(3, 9, 24, 16, 6, 2, SOFTMAX, id="w3-softmax"),  # W=3, 2 experts per rank, fewer tokens than a block
]


@pytest.mark.interpreter
@pytest.mark.parametrize("world,tokens,hidden,ffn,experts,top_k,route_kw", INTERP_CASES)
def test_moe_forward_vs_reference(world, tokens, hidden, ffn, experts, top_k, route_kw):
    m = MoERanks(world, tokens, hidden, ffn, experts, top_k, seed=world * 100 + tokens, route_kw=route_kw)
    for epoch in (1, 2):  # back to back, fresh inputs: epochs, counters and scratch must carry over cleanly
        m.new_inputs()
        m.call(epoch)
        m.check(epoch)


NK_CASES = [  # (world, tokens, hidden, ffn, experts, top_k, routing, mx)
    pytest.param(1, 37, 48, 40, 8, 2, SOFTMAX, False, id="w1-softmax"),  # ragged token blocks, H and F
    pytest.param(2, 17, 32, 16, 16, 4, _interp_grouped(16, 4, 2), False, id="w2-grouped"),
    pytest.param(2, 17, 64, 32, 8, 2, SOFTMAX, True, id="w2-mxfp8"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("world,tokens,hidden,ffn,experts,top_k,route_kw,mx", NK_CASES)
def test_moe_forward_reads_transformers_layout(world, tokens, hidden, ffn, experts, top_k, route_kw, mx):
    """Weights in transformers' layout (gate_up [El, 2F, H], down [El, H, F], passed transposed) give y bitwise
    equal to the same values in the kernels' own layout, and the reference's y."""
    seed = world * 100 + tokens + (7 if mx else 0)  # the seeds of the native-layout tests above
    native = MoERanks(world, tokens, hidden, ffn, experts, top_k, seed=seed, route_kw=route_kw, mx=mx)
    nk = MoERanks(world, tokens, hidden, ffn, experts, top_k, seed=seed, route_kw=route_kw, mx=mx, nk=True)
    assert mf.weights_nk(nk.w13[0]) and mf.weights_nk(nk.w2[0]) and not mf.weights_nk(native.w13[0])
    for m in (native, nk):
        m.new_inputs()
        m.call(1)
        m.check(1)
    for r in range(world):
        assert torch.equal(native.ys[r], nk.ys[r])


MX_INTERP_CASES = [  # H and F multiples of 32 (MX blocks); interpreter tiles BNH = 32
    pytest.param(1, 21, 64, 32, 4, 2, SOFTMAX, id="w1-softmax"),
    pytest.param(2, 17, 64, 32, 8, 2, SOFTMAX, id="w2-softmax"),
    pytest.param(2, 13, 64, 64, 16, 4, _interp_grouped(16, 4, 2), id="w2-grouped"),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("world,tokens,hidden,ffn,experts,top_k,route_kw", MX_INTERP_CASES)
def test_moe_forward_mxfp8_vs_reference(world, tokens, hidden, ffn, experts, top_k, route_kw):
    """MXFP8: x dispatched as payload + scales and dequantized in PERMUTE, h rounded to MX in GEMM1's epilogue;
    against the MX reference math (moe_reference.expert_ffn_mx) on the kernel's own routing."""
    m = MoERanks(world, tokens, hidden, ffn, experts, top_k, seed=world * 100 + tokens + 7, route_kw=route_kw,
                 mx=True)
    for epoch in (1, 2):
        m.new_inputs()
        m.call(epoch)
        m.check(epoch)


GIVEN = dict(routing="given")
GIVEN_CASES = [  # (world, tokens, hidden, ffn, experts, top_k, nk)
    pytest.param(1, 37, 48, 40, 8, 2, False, id="w1"),  # ragged token blocks, H and F
    pytest.param(1, 20, 32, 24, 16, 3, True, id="w1-transformers-layout"),
    pytest.param(2, 17, 32, 16, 16, 4, False, id="w2"),  # given global ids, rows cross to the peer
]


@pytest.mark.interpreter
@pytest.mark.parametrize("world,tokens,hidden,ffn,experts,top_k,nk", GIVEN_CASES)
def test_moe_forward_given_routing_vs_reference(world, tokens, hidden, ffn, experts, top_k, nk):
    """routing="given" (no router; the decision put into the routing buffers, ROUTE only loads it): y equals the
    fp32 reference on that decision (apply_routing_ref), the routing buffers still hold it after the launch (the
    kernel stores nothing there), every output row written, scratch / counters / flags clean; two calls back to
    back with fresh decisions."""
    m = MoERanks(world, tokens, hidden, ffn, experts, top_k, seed=world * 100 + tokens + 3, route_kw=GIVEN, nk=nk)
    if nk:
        assert mf.weights_nk(m.w13[0]) and mf.weights_nk(m.w2[0])
    for epoch in (1, 2):
        m.new_inputs()
        m.call(epoch)
        m.check(epoch)
        for r in range(world):
            w, e = m.routing(r)
            assert torch.equal(w, m.given[r][0]) and torch.equal(e, m.given[r][1])


@pytest.mark.interpreter
@pytest.mark.parametrize("world,tokens,hidden,ffn,experts,top_k,route_kw", [
    pytest.param(1, 37, 48, 40, 8, 2, SOFTMAX, id="w1-softmax"),
    pytest.param(2, 17, 32, 16, 16, 4, _interp_grouped(16, 4, 2), id="w2-grouped"),
])
def test_moe_forward_given_routing_is_the_routed_layer(world, tokens, hidden, ffn, experts, top_k, route_kw):
    """Given the decision the kernel's own router took (weights and experts from a routed launch), the launch with
    routing="given" computes bitwise the routed launch's y: the same rows, weights and fold."""
    seed = world * 100 + tokens
    routed = MoERanks(world, tokens, hidden, ffn, experts, top_k, seed=seed, route_kw=route_kw)
    given = MoERanks(world, tokens, hidden, ffn, experts, top_k, seed=seed, route_kw=GIVEN)
    assert torch.equal(routed.w13[0], given.w13[0]) and torch.equal(routed.w2[-1], given.w2[-1])
    routed.new_inputs()
    routed.call(1)
    routed.check(1)
    given.new_inputs()
    for r in range(world):
        given.xs[r].copy_(routed.xs[r])
        given.given[r] = tuple(t.clone() for t in routed.routing(r))
    given.call(1)
    given.check(1)
    for r in range(world):
        assert torch.equal(given.ys[r], routed.ys[r]), f"rank {r}"


@pytest.mark.interpreter
def test_moe_forward_mxfp8_rounds_h_in_column_halves(monkeypatch):
    """GEMM1's MX rounding of h one column half at a time (BNH >= 64, the GPU's path; the interpreter's own
    tiles have BNH = 32): forced here with BNH = 64 and F = 96 (the second tile's upper half past F). y is
    bitwise the whole-block path's (BNH = 32: every element the same dot product and the same MX blocks), and
    within the MX reference's tolerance (3e-2 here: the interpreter truncates to bf16, 0.0205 on this draw)."""
    import dataclasses
    whole = MoERanks(1, 19, 64, 96, 4, 2, seed=77, route_kw=SOFTMAX, mx=True, tol=3e-2)
    whole.new_inputs()
    whole.call(1)
    real = planning.moe_config
    monkeypatch.setattr(planning, "moe_config", lambda config=None, mx=False: dataclasses.replace(
        real(config, mx=mx), BNH=64) if mx else real(config, mx=mx))
    halves = MoERanks(1, 19, 64, 96, 4, 2, seed=77, route_kw=SOFTMAX, mx=True, tol=3e-2)
    assert halves.cfg.BNH == 64 and whole.cfg.BNH == 32
    halves.new_inputs()
    halves.call(1)
    halves.check(1)
    assert torch.equal(halves.ys[0], whole.ys[0])


@pytest.mark.interpreter
def test_expert_gemms_timeout_is_raised(monkeypatch):
    """expert_gemms (the bench's GEMMs-alone row) reports a timed-out wait instead of returning garbage: with
    GEMM1 left out of the launch, GEMM2's waits on its tiles time out and the call raises KosmosTimeoutError
    naming the wait (it kept a private error buffer nobody read before session 14)."""
    from kosmos.core import runtime
    real = mf.launch
    monkeypatch.setattr(mf, "launch", lambda *a, **k: real(*a, **dict(k, stages=1 << mf.GEMM2, timeout_ns=50_000)))
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([5, 19], dtype=torch.int32)
    x = rand(24, 40, gen=gen)
    with pytest.raises(runtime.KosmosTimeoutError, match="moe_forward: rank 0"):
        mf.expert_gemms(x, counts, rand(2, 40, 48, gen=gen), rand(2, 24, 40, gen=gen))


@pytest.mark.interpreter
@pytest.mark.parametrize("world", [1, 2])
def test_moe_forward_device_epoch(world):
    """No epoch from the host: every launch reads its rank's slot; at W = 2 the three stage launches of a call
    see the same epoch and only the FOLD one advances it. The same arguments launched call after call (a
    simulated replay) give right results on fresh inputs, and bitwise the same y on unchanged ones."""
    m = MoERanks(world, 21, 32, 24, 8, 2, seed=71 + world, route_kw=SOFTMAX)
    for call in (1, 2, 3):
        m.new_inputs()
        m.call(None)
        m.check(call)
        assert [int(e.item()) for e in m.epochs] == [call] * world
    before = [y.clone() for y in m.ys]
    for y in m.ys:
        y.fill_(float("nan"))
    m.call(None)
    m.check(4)
    for r in range(world):
        assert torch.equal(m.ys[r], before[r]), f"rank {r}: a replay on the same inputs differs"


@pytest.mark.interpreter
def test_moe_forward_replay_without_the_peer_waits_for_the_next_epoch():
    """After 2 calls, rank 0 running a third alone must wait for rank 1's dispatch of epoch 3 (not take its
    flag of epoch 2): a timeout recorded, the launch still ends with its scratch reset and the slot advanced."""
    from kosmos.core import codes, runtime
    m = MoERanks(2, 21, 32, 24, 8, 2, seed=79, route_kw=SOFTMAX, timeout_ns=50_000)
    for call in (1, 2):
        m.new_inputs()
        m.call(None)
        m.check(call)
    m.launch(0, None)
    err = m.local[0]["errors"].tolist()
    assert err[0] != 0 and codes.wait_tag(err) == codes.WAIT_MOE_DISPATCH.value, runtime.decode_error(err)
    assert (err[4], err[5], err[6]) == (1, 3, 2), runtime.decode_error(err)  # rank 1's flag: expected 3, saw 2
    assert m.local[0]["scratch"].abs().sum().item() == 0
    assert [int(e.item()) for e in m.epochs] == [3, 2]


@pytest.mark.interpreter
def test_moe_all_tokens_to_few_experts_and_empty_experts():
    """Every token of both ranks picks experts 0 and 1 (rank 0): rank 1's experts get no rows at all."""
    m = MoERanks(2, 19, 32, 24, 8, 2, seed=5, route_kw=SOFTMAX, skew=True)
    m.new_inputs()
    m.call(1)
    for r in range(2):
        assert set(m.routing(r)[1].unique().tolist()) == {0, 1}
    m.check(1)


@pytest.mark.interpreter
def test_moe_fixed_role_policy_and_determinism():
    m = MoERanks(2, 21, 32, 24, 8, 2, seed=11, route_kw=SOFTMAX)
    m.new_inputs()
    m.call(1, policy="fixed", comm_programs=1)
    m.check(1)
    first = [y.clone() for y in m.ys]
    for r in range(2):
        m.ys[r].fill_(float("nan"))
    m.call(2)  # self-scheduling, same inputs: bitwise the same output
    m.check(2)
    for r in range(2):
        assert torch.equal(first[r], m.ys[r]), f"rank {r}: fixed-role and self-scheduling outputs differ"


@pytest.mark.interpreter
@pytest.mark.parametrize("world,tokens,hidden,ffn,experts,top_k", [
    pytest.param(1, 21, 32, 24, 6, 2, id="w1"),   # F = 24: g's last column tile overhangs into u's columns
    pytest.param(2, 13, 32, 24, 8, 3, id="w2"),   # rows from both sources inside each expert
])
def test_saved_gate_up_in_backward_order(world, tokens, hidden, ffn, experts, top_k):
    """moe_forward's save_gu: GEMM1's epilogue stores g | u beside h (SAVE_GU), and SavedGateUp puts the rows
    into the backward's order (local expert, then source rank, then p = token*k + slot) -- compared with
    x_source[token] @ W13[expert] in fp32 for every row, in that order (poisoned buffer: no row unwritten)."""
    m = MoERanks(world, tokens, hidden, ffn, experts, top_k, seed=5 + world)
    gus = [torch.full((m.lay.max_rows, 2 * ffn), float("nan"), dtype=torch.bfloat16) for _ in range(world)]
    m.new_inputs()
    for stages in ((mf.ALL_STAGES,) if world == 1 else (simranks.ROUTE_ONLY, simranks.MIDDLE, simranks.FOLD_ONLY)):
        for r in range(world):
            m.launch(r, 1, stages, gu=gus[r])
    m.check(1)
    decisions = [m.routing(r)[1] for r in range(world)]
    for r in range(world):
        rows, counts = [], torch.zeros(m.el, dtype=torch.int64)
        for le in range(m.el):
            for s in range(world):
                e_s = decisions[s].reshape(-1)
                for p in (e_s == r * m.el + le).nonzero(as_tuple=True)[0].tolist():
                    rows.append(m.xs[s][p // top_k].float() @ m.w13[r][le].float())
                    counts[le] += 1
        want = torch.stack(rows)
        saved = mf.SavedGateUp(gus[r], m.local[r]["xe_meta"].view(-1, 3).clone(), tokens, top_k, world)
        got = saved.in_backward_order(counts, len(rows))
        assert not torch.isnan(got).any(), f"rank {r}: rows of g | u left unwritten"
        err = ((got.float() - want).norm() / want.norm()).item()
        assert err < INTERP_TOL, (r, err)


@pytest.mark.interpreter
@pytest.mark.parametrize("half_tail", [
    True,   # last m-tiles of <= BM/2 rows run as half-height tiles
    False,  # every m-tile full height
])
def test_expert_gemms_matches_reference(half_tail):
    """Experts with no rows, a last m-tile of 1..BM/2 rows (run as a half-height tile unless
    MoEForwardConfig(half_tail=False)), exactly BM/2, more than BM/2, and whole tiles only (BM = 16 here)."""
    config = MoEForwardConfig(half_tail=half_tail)
    assert planning.moe_config(config).BM == 16 and planning.moe_config(config).half_tail == half_tail
    gen = torch.Generator().manual_seed(3)
    el, h, f = 7, 40, 24
    counts = torch.tensor([5, 0, 19, 2, 28, 24, 16], dtype=torch.int32)
    x = rand(int(counts.sum()), h, gen=gen)
    w13 = rand(el, h, 2 * f, gen=gen, scale=h ** -0.5)
    w2 = rand(el, f, h, gen=gen, scale=f ** -0.5)
    y = mf.expert_gemms(x, counts, w13, w2, config=config)
    start, ref = 0, []
    for i, n in enumerate(counts.tolist()):
        ref.append(moe_reference.expert_ffn(x[start:start + n].float(), w13[i].float(), w2[i].float()))
        start += n
    ref = torch.cat(ref)
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < INTERP_TOL, err


@pytest.mark.interpreter
def test_trace_records_every_task():
    m = MoERanks(1, 37, 32, 24, 8, 2, seed=13, route_kw=SOFTMAX)
    m.new_inputs()
    trace = torch.zeros((INTERP_GRID, 1024, 4), dtype=torch.int64)
    kw = {k: v for k, v in m.route_kw.items() if k != "bias"}
    mf.launch(m.xs[0], m.router, None, m.w13[0], m.w2[0], m.ys[0], m.bufs(0), rank=0, world=1,
              epoch_slot=m.epochs[0], timeout_ns=INTERP_TIMEOUT_NS, grid=INTERP_GRID, cfg=m.cfg, top_k=2, trace=trace, **kw)
    m.check(1)
    ev = trace.view(-1, 4)
    cfg = m.cfg
    plan = m.local[0]["plan"]
    mtiles = int(plan[2 * m.el])
    route = -(-37 // cfg.RB)
    expect = {1: route, 4: route, 5: -(-37 // cfg.PB), 6: mtiles * -(-24 // cfg.BNH), 7: mtiles * -(-32 // cfg.BN),
              8: -(-37 // cfg.FB)}
    for kind, n in expect.items():
        ids = sorted(ev[ev[:, 0] == kind][:, 1].tolist())
        assert ids == list(range(n)), (kind, ids)


# ======================================================================================= input checks
def _inputs(t=16, h=64, f=32, e=8, el=8, dtype=torch.bfloat16):
    return (torch.zeros(t, h, dtype=dtype), torch.zeros(e, h, dtype=dtype), torch.zeros(el, h, 2 * f, dtype=dtype),
            torch.zeros(el, f, h, dtype=dtype))


def _check(*args, top_k=2, routing="softmax", bias=None, n_group=1, topk_group=1, world=1):
    return mf.check_moe_inputs(*args, top_k, routing, bias, n_group, topk_group, world)


def test_valid_inputs_pass_the_shape_checks():
    x, r, w13, w2 = _inputs()
    with pytest.raises(ValueError, match="CUDA"):  # everything else is fine; only the device is wrong here
        _check(x, r, w13, w2)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: (a[0].float(), *a[1:]), "x must be torch.bfloat16"),
    (lambda a: (a[0][None], *a[1:]), "x must be 2-D"),
    (lambda a: (a[0], a[1][:, :32].contiguous(), *a[2:]), "hidden sizes disagree"),
    (lambda a: (a[0], a[1], a[2][:, :, :-8].contiguous(), a[3]), "must be \\[E/W, H, 2F\\]"),
    (lambda a: (a[0], a[1], a[2][:4].contiguous(), a[3][:4].contiguous()), "E must equal world"),
    (lambda a: (a[0].t(), *a[1:]), "hidden sizes disagree|contiguous"),
    (lambda a: (a[0][:0], *a[1:]), "empty"),
    (lambda a: ("x", *a[1:]), "torch.Tensor"),
])
def test_bad_tensors(mutate, match):
    with pytest.raises(ValueError, match=match):
        _check(*mutate(_inputs()))


def test_bad_routing_arguments():
    a = _inputs()
    with pytest.raises(ValueError, match="top_k"):
        _check(*a, top_k=9)
    with pytest.raises(ValueError, match="top_k"):
        _check(*a, top_k=0)
    with pytest.raises(ValueError, match="unknown routing"):
        _check(*a, routing="sinkhorn")
    with pytest.raises(ValueError, match="belong to routing='sigmoid-grouped'"):
        _check(*a, bias=torch.zeros(8))
    with pytest.raises(ValueError, match="n_group"):
        _check(*a, routing="sigmoid-grouped", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="exceeds"):
        _check(*a, top_k=5, routing="sigmoid-grouped", n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="bias"):
        _check(*a, routing="sigmoid-grouped", n_group=4, topk_group=2, bias=torch.zeros(7))


def _given(t=16, k=2, e=8, ids=None, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    experts = ids if ids is not None else torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=g).to(dtype), experts


def test_given_routing_arguments():
    """routing="given": no router weight, the decision [T, top_k] (weights floating point, experts integer ids in
    [0, E) -- read on CPU tensors only), none of the routers' arguments; a decision with another routing refused;
    a valid call stops only at the device (CUDA)."""
    x, r, w13, w2 = _inputs()
    w, e = _given()
    given = dict(top_k=2, routing="given", bias=None, n_group=1, topk_group=1, world=1)

    def check(router=None, weights=w, experts=e, scale=1.0, **kw):
        args = {**given, **kw}
        return mf.check_moe_inputs(x, router, w13, w2, args["top_k"], args["routing"], args["bias"],
                                   args["n_group"], args["topk_group"], args["world"], weights, experts, scale)
    with pytest.raises(ValueError, match="CUDA"):  # a valid call: only the device is wrong
        check()
    with pytest.raises(ValueError, match="CUDA"):  # bf16 weights, int32 ids: fine too
        check(weights=w.to(torch.bfloat16), experts=e.int())
    for bad, match in [
        (dict(router=r), "pass router_weight=None"),
        (dict(weights=None), "weights must be a 2-D tensor"),
        (dict(weights=w[:, :1]), r"must both be \[T=16, k\]"),
        (dict(weights=w[:8], experts=e[:8]), r"must both be \[T=16, k\]"),
        (dict(experts=e.float()), "integer expert ids"),
        (dict(weights=e), "floating point"),
        (dict(top_k=3), "k=2 slots per token but top_k=3"),
        (dict(experts=_given(ids=torch.full((16, 2), 8))[1]), r"in \[0, 8\)"),
        (dict(experts=_given(ids=torch.full((16, 2), -1))[1]), r"in \[0, 8\)"),
        (dict(bias=torch.zeros(8)), "belong to routing='sigmoid-grouped'"),
        (dict(scale=2.5), "scale them before the call"),
    ]:
        with pytest.raises(ValueError, match=match):
            check(**bad)
    with pytest.raises(ValueError, match="decision of routing='given'"):
        check(router=r, routing="softmax")
    with pytest.raises(ValueError, match="E=512 experts > 256: the dispatch"):
        a = _inputs(e=512, el=512)
        mf.check_moe_inputs(a[0], None, a[2], a[3], 2, "given", None, 1, 1, 1, *_given(e=512))
    import kosmos
    with pytest.raises(ValueError, match="CUDA"):
        kosmos.moe_forward(x, None, w13, w2, top_k=2, routing="given", weights=w, experts=e)


def test_hidden_and_ffn_must_suit_tma():
    with pytest.raises(ValueError, match="multiples of 8"):
        _check(*_inputs(h=60))


def test_too_many_experts():
    with pytest.raises(ValueError, match="E=512"):
        _check(*_inputs(e=512, el=512))


def test_public_op_rejects_cpu_tensors_before_touching_a_gpu():
    import kosmos
    x, r, w13, w2 = _inputs()
    with pytest.raises(ValueError, match="CUDA"):
        kosmos.moe_forward(x, r, w13, w2, top_k=2)
    with pytest.raises(ValueError, match="policy"):
        kosmos.moe_forward(x, r, w13, w2, top_k=2, policy="greedy")


@pytest.mark.interpreter
def test_nn_moe_mxfp8_trains_at_one_rank(monkeypatch):
    """nn.MoE(dtype="mxfp8") trains at W = 1: the forward (here the reference MX layer standing in for
    moe_forward(precision="mxfp8"), on the MX values the module passes) and the MX backward
    (moe_backward(precision="mxfp8") on the kernels, under the interpreter) give the gradients of
    moe_backward_ref(mx=True) (3e-2); g | u is not saved at mxfp8; an SGD step changes the parameters and the
    module's MX weights follow them; kosmos.nn.moe with precision="mxfp8" on the same parameters (MX copies
    rounded per call) gives bitwise the module's gradients; without a gradient the forward runs on the cached
    MX values."""
    import kosmos.nn as knn
    from kosmos import quant
    from kosmos.reference import moe as mr
    calls = []

    def fake_forward(x, router_weight, w13, w2, *, top_k, routing, bias=None, group=None, return_routing=False,
                     save_gu=False, precision="bf16", **kw):
        calls.append(dict(precision=precision, save_gu=save_gu, w13=w13, w2=w2))
        weights, experts = mr.route(x, router_weight, top_k, routing, bias=bias, **kw)
        y = mr.apply_routing_ref(x, weights, experts, w13, w2, mx=precision == "mxfp8").to(torch.bfloat16)
        return (y, weights, experts) if return_routing else y
    monkeypatch.setattr(knn, "moe_forward", fake_forward)
    g = torch.Generator().manual_seed(8)
    m = knn.MoE(64, 32, 8, 2, dtype="mxfp8")
    with torch.no_grad():
        for p in (m.router_weight, m.w13, m.w2):
            p.copy_(torch.randn(p.shape, generator=g) * p.float().std())
    x = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    dy = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    m(xg).backward(dy)
    assert calls[-1]["precision"] == "mxfp8" and calls[-1]["save_gu"] is False
    assert torch.equal(calls[-1]["w13"], quant.mx_values(m.w13.detach(), dim=1))
    assert torch.equal(calls[-1]["w2"], quant.mx_values(m.w2.detach(), dim=1))
    params = [p.detach().clone() for p in (m.router_weight, m.w13, m.w2)]
    ref = mr.moe_backward_ref(x, *params, dy, top_k=2, mx=True)
    got = (xg.grad, m.router_weight.grad, m.w13.grad, m.w2.grad)
    for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), got, ref):
        rel = ((a.float() - b).norm() / b.norm()).item()
        assert rel < 3e-2, (name, rel)
    leaves = [x.clone().requires_grad_(True)] + [p.clone().requires_grad_(True) for p in params]
    knn.moe(*leaves, top_k=2, precision="mxfp8").backward(dy)
    assert all(torch.equal(a.grad, b) for a, b in zip(leaves, got))
    torch.optim.SGD(m.parameters(), lr=0.1).step()
    assert not torch.equal(m.w13.detach(), params[1])
    with torch.no_grad():
        m(x)
    assert calls[-1]["precision"] == "mxfp8"
    assert torch.equal(calls[-1]["w13"], quant.mx_values(m.w13.detach(), dim=1))
    assert torch.equal(calls[-1]["w2"], quant.mx_values(m.w2.detach(), dim=1))


def test_nn_moe_mxfp8_refuses_unknown_precision():
    import kosmos.nn as knn
    x, w13, w2 = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(8, 64, 64, dtype=torch.bfloat16), \
        torch.zeros(8, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="choose one of bf16, mxfp8"):
        knn.moe(x, torch.zeros(8, 64, dtype=torch.bfloat16), w13, w2, top_k=2, precision="fp8")


@pytest.mark.interpreter
def test_nn_moe_trains_at_one_rank(monkeypatch):
    """nn.MoE's autograd at W=1: the forward (here the reference layer, returning its routing as moe_forward
    does) and the backward (moe_backward_w1 on the kernels, under the interpreter) give the gradients of
    moe_reference.moe_backward_ref; two micro-batches accumulate into .grad."""
    import kosmos.nn as knn
    from kosmos.reference import moe as mr

    saves = []

    def fake_forward(x, router_weight, w13, w2, *, top_k, routing, bias=None, group=None, return_routing=False,
                     save_gu=False, **kw):
        weights, experts = mr.route(x, router_weight, top_k, routing, bias=bias, **kw)
        y = mr.apply_routing_ref(x, weights, experts, w13, w2).to(torch.bfloat16)
        if not save_gu:
            return (y, weights, experts) if return_routing else y
        saves.append(1)
        return y, weights, experts, simranks.placed_gate_up(x, w13, experts, top_k, g)
    monkeypatch.setattr(knn, "moe_forward", fake_forward)
    g = torch.Generator().manual_seed(2)
    m = knn.MoE(32, 16, 8, 2)
    xs = [torch.randn(13, 32, generator=g).to(torch.bfloat16) for _ in range(2)]
    dys = [torch.randn(13, 32, generator=g).to(torch.bfloat16) for _ in range(2)]
    want = [torch.zeros(p.shape) for p in (m.router_weight, m.w13, m.w2)]
    for x, dy in zip(xs, dys):
        xg = x.clone().requires_grad_(True)
        m(xg).backward(dy)
        ref = mr.moe_backward_ref(x, m.router_weight.detach(), m.w13.detach(), m.w2.detach(), dy, top_k=2)
        assert ((xg.grad.float() - ref[0]).norm() / ref[0].norm()).item() < 3e-2
        for acc, r in zip(want, ref[1:]):
            acc += r
    for p, r in zip((m.router_weight, m.w13, m.w2), want):
        assert ((p.grad.float() - r).norm() / r.norm()).item() < 3e-2
    assert m.save_gate_up and len(saves) == 2  # W = 1: the backward ran on the forward's g | u


@pytest.mark.interpreter
def test_nn_moe_function_takes_transformers_layout(monkeypatch):
    """kosmos.nn.moe with transformers' expert parameters (gate_up [E, 2F, H], down [E, H, F]) passed as their
    transposes gives the output and gradients of the kernels' own layout, and the gradients land on those
    parameters (in their own layout: the backward returns the weight gradients in the weights' layout)."""
    import kosmos.nn as knn
    from kosmos.reference import moe as mr

    def fake_forward(x, router_weight, w13, w2, *, top_k, routing, bias=None, group=None, return_routing=False,
                     save_gu=False, precision="bf16", **kw):
        assert mf.weights_nk(w13) == mf.weights_nk(w2)
        weights, experts = mr.route(x, router_weight, top_k, routing, bias=bias, **kw)
        y = mr.apply_routing_ref(x, weights, experts, w13, w2).to(torch.bfloat16)
        return (y, weights, experts) if return_routing else y
    monkeypatch.setattr(knn, "moe_forward", fake_forward)
    g = torch.Generator().manual_seed(5)
    e, h, f, t = 8, 32, 16, 11
    router = torch.randn(e, h, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(e, h, 2 * f, generator=g) / 6).to(torch.bfloat16)
    w2 = (torch.randn(e, f, h, generator=g) / 4).to(torch.bfloat16)
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16)
    native = [p.clone().requires_grad_(True) for p in (router, w13, w2)]
    hf = [router.clone().requires_grad_(True), w13.transpose(1, 2).contiguous().requires_grad_(True),
          w2.transpose(1, 2).contiguous().requires_grad_(True)]
    y_native = knn.moe(x, *native, top_k=2, save_gate_up=False)
    y_native.backward(dy)
    y_hf = knn.moe(x, hf[0], hf[1].transpose(1, 2), hf[2].transpose(1, 2), top_k=2, save_gate_up=False)
    y_hf.backward(dy)
    assert torch.equal(y_native, y_hf)
    assert torch.equal(native[0].grad, hf[0].grad)
    assert hf[1].grad.shape == (e, 2 * f, h) and hf[2].grad.shape == (e, h, f)
    assert torch.equal(native[1].grad.transpose(1, 2), hf[1].grad)
    assert torch.equal(native[2].grad.transpose(1, 2), hf[2].grad)
    with torch.no_grad():  # inference: the same output without autograd
        assert torch.equal(knn.moe(x, hf[0], hf[1].transpose(1, 2), hf[2].transpose(1, 2), top_k=2), y_hf)


def _given_forward(calls):
    """The fp32 reference layer standing in for moe_forward(routing="given") (g | u as save_gu keeps it)."""
    from kosmos.reference import moe as mr

    def forward(x, router_weight, w13, w2, *, top_k, routing, group=None, return_routing=False, save_gu=False,
                weights=None, experts=None, **kw):
        assert router_weight is None and routing == "given" and experts.shape == (x.shape[0], top_k)
        calls.append(dict(weights=weights, experts=experts, save_gu=save_gu))
        y = mr.apply_routing_ref(x, weights, experts, w13, w2).to(torch.bfloat16)
        out = (y, weights.float(), experts.long())
        if save_gu:
            return out + (simranks.placed_gate_up(x, w13, experts.long(), top_k, torch.Generator().manual_seed(1)),)
        return out if return_routing else y
    return forward


@pytest.mark.interpreter
@pytest.mark.parametrize("nk,save", [(False, None), (True, None), (True, False)],
                         ids=["native-saved-gu", "transformers-layout-saved-gu", "transformers-layout-recompute"])
def test_nn_moe_experts_autograd(monkeypatch, nk, save):
    """kosmos.nn.moe_experts (routing given) under autograd: the forward stood in by the reference layer, the
    backward moe_backward(routing="given") on the kernels (interpreter): dx, d(top_k_weights) (in their dtype,
    bf16 here), dW13, dW2 (in the weights' layout) against moe_experts_backward_ref; top_k_index gets none; the
    g | u kept at one rank by default; without a gradient the plain forward runs."""
    import kosmos.nn as knn
    from kosmos.reference import moe as mr
    calls, ran = [], []
    monkeypatch.setattr(knn, "moe_forward", _given_forward(calls))
    backward = knn.moe_backward
    monkeypatch.setattr(knn, "moe_backward", lambda *a, **kw: ran.append(kw) or backward(*a, **kw))
    g = torch.Generator().manual_seed(9)
    t, h, f, e, k = 23, 40, 24, 8, 3  # ragged against the interpreter's 16-wide tiles
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, f, h, generator=g) / f ** 0.5).to(torch.bfloat16)
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])  # expert 7 gets no rows
    wts = torch.rand(t, k, generator=g).to(torch.bfloat16)
    params = [w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()] if nk else [w13.clone(), w2.clone()]
    leaves = [x.clone().requires_grad_(True), wts.clone().requires_grad_(True)] + \
        [p.requires_grad_(True) for p in params]
    ws = [p.transpose(1, 2) for p in leaves[2:]] if nk else leaves[2:]
    y = knn.moe_experts(leaves[0], ids, leaves[1], *ws, save_gate_up=save)
    y.backward(dy)
    assert len(calls) == 1 and calls[0]["save_gu"] == (save is None) and len(ran) == 1
    assert ran[0]["routing"] == "given" and (ran[0]["saved_gu"] is not None) == (save is None)
    want = mr.moe_experts_backward_ref(x, w13, w2, dy, wts, ids)
    got = [leaves[0].grad, leaves[1].grad] + ([p.grad.transpose(1, 2) for p in leaves[2:]] if nk else
                                               [p.grad for p in leaves[2:]])
    assert leaves[1].grad.dtype == torch.bfloat16 and leaves[2].grad.shape == params[0].shape
    for name, a, b in zip(("dx", "d_weights", "dw13", "dw2"), got, want):
        rel = ((a.float() - b).norm() / b.norm()).item()
        assert rel < 2e-2, (name, rel)
    assert not got[2][7].any() and not got[3][7].any()
    with torch.no_grad():
        assert torch.equal(knn.moe_experts(x, ids, wts, *ws), y)
    assert len(calls) == 2 and calls[1]["save_gu"] is False


def test_nn_moe_experts_refusals():
    """moe_experts checks the decision before anything runs: integer ids, [T, k] both, ids in [0, E) (CPU)."""
    import kosmos.nn as knn
    x = torch.zeros(16, 64, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(8, 64, 64, dtype=torch.bfloat16), torch.zeros(8, 32, 64, dtype=torch.bfloat16)
    w, e = _given()
    for ids, wts, match in [(e.float(), w, "integer expert ids"), (e[:4], w[:4], "T=16"),
                            (e + 6, w, r"in \[0, 8\)"), (e, w[:, :1], "must both be")]:
        with pytest.raises(ValueError, match=match):
            knn.moe_experts(x, ids, wts, w13, w2)
    with pytest.raises(ValueError, match="CUDA"):
        knn.moe_experts(x, e, w, w13, w2)


def _shape_rank(rank, world, port, q, tokens):
    import os
    from types import SimpleNamespace

    import torch.distributed as dist

    from kosmos.core.runtime import World
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ws = SimpleNamespace(world=World(dist.group.WORLD, rank, world, torch.device("cpu")), agreed_shapes=set())
        try:
            mf._check_same_shape_on_every_rank(ws, (tokens[rank], 64, 32, 8, 2, 0))
            q.put((rank, ("ok", len(ws.agreed_shapes))))
        except ValueError as e:
            q.put((rank, (str(e), len(ws.agreed_shapes))))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tokens", [
    (16, 16),  # the same T on both ranks: agreed, and remembered
    (16, 24),  # a peer with a different T: the same error on both ranks
])
def test_ranks_must_agree_on_shapes(tokens):
    """Every rank gets the same verdict (no rank left waiting): agreed shapes are remembered, a different T on
    a peer is a clear error naming it."""
    got = spawn_gloo(_shape_rank, 2, tokens)
    if tokens[0] == tokens[1]:
        assert got == {0: ("ok", 1), 1: ("ok", 1)}
    else:
        for r in range(2):
            msg, n = got[r]
            assert "T (tokens per rank)" in msg and n == 0, got


# ============================================================================================ one GPU
def make_case(seed, world, tokens, hidden, ffn, experts, top_k, skew=False):
    """Every rank's inputs, made identically on every rank from one CPU generator."""
    gen = torch.Generator().manual_seed(seed)
    el = experts // world
    xs = [torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16) for _ in range(world)]
    router = (torch.randn(experts, hidden, generator=gen) * hidden ** -0.5).to(torch.bfloat16)
    if skew:  # feature 0 is 1 on every token and only experts 0..k-1 like it: they win every token
        for x in xs:
            x[:, 0] = 1.0
        router[:, 0] = -8.0
        for j in range(top_k):
            router[j, 0] = 8.0 - j
    w13 = [(torch.randn(el, hidden, 2 * ffn, generator=gen) * hidden ** -0.5).to(torch.bfloat16) for _ in range(world)]
    w2 = [(torch.randn(el, ffn, hidden, generator=gen) * ffn ** -0.5).to(torch.bfloat16) for _ in range(world)]
    return xs, router, w13, w2


def check_rank(check, r, x, router, w13_all, w2_all, top_k, route_kw, y, w_k, e_k):
    kw = dict(route_kw)
    w_ref, e_ref = moe_reference.route(x.cpu(), router.cpu(), top_k, **{k: v for k, v in kw.items()})
    # tokens with a clear margin must route exactly like the reference
    logits = x.cpu().float() @ router.cpu().float().t()
    scores = torch.softmax(logits, -1) if kw.get("routing", "softmax") == "softmax" else torch.sigmoid(logits)
    if kw.get("routing", "softmax") == "softmax":
        srt = torch.cat([scores, torch.full_like(scores[:, :1], -1.0)], 1).sort(-1, descending=True).values
        clear = (srt[:, top_k - 1] - srt[:, top_k]) > 1e-3
        same = (e_k.cpu() == e_ref).all(-1)
        check(bool(same[clear].all()), f"rank {r}: {int((~same[clear]).sum())} clear tokens routed differently")
    else:  # grouped: near-ties hide in group scores too; demand (almost) every token
        same = (e_k.cpu() == e_ref).all(-1)
        check(same.float().mean().item() >= 0.97, f"rank {r}: only {same.float().mean().item():.3f} routed alike")
    check(bool(torch.allclose(w_k.cpu()[same], w_ref[same], rtol=1e-3, atol=1e-5)), f"rank {r}: routing weights")
    ref = moe_reference.apply_routing_ref(x.cpu(), w_k.cpu(), e_k.cpu(), w13_all, w2_all)
    got = y.cpu().float()
    check(not bool(torch.isnan(got).any()), f"rank {r}: NaN in y (rows left unwritten?)")
    err = ((got - ref).norm() / ref.norm()).item()
    check(err < TOL, f"rank {r}: rel err {err:.3e}")


def _run_case(rank, world, case, route_kw, check, dev, policy="self", comm_programs=None):
    import kosmos
    seed, tokens, hidden, ffn, experts, top_k, skew = case
    xs, router, w13, w2 = make_case(seed, world, tokens, hidden, ffn, experts, top_k, skew)
    kw = dict(route_kw)
    if "bias" in kw:
        kw["bias"] = kw["bias"].to(dev)
    y, w_k, e_k = kosmos.moe_forward(xs[rank].to(dev), router.to(dev), w13[rank].to(dev), w2[rank].to(dev),
                                     top_k=top_k, return_routing=True, policy=policy, comm_programs=comm_programs,
                                     **kw)
    kosmos.check_errors()
    check_rank(check, rank, xs[rank], router, torch.cat(w13), torch.cat(w2), top_k, route_kw, y, w_k, e_k)
    if skew:
        check(set(e_k.unique().tolist()) <= set(range(top_k)), f"rank {rank}: skewed routing not as built")


# GPU tiles: 128-row m-tiles, 64-deep K steps, 32-token blocks for the data movers
GPU_CASES = [  # (seed, tokens, hidden, ffn, experts, top_k, skew)
    (1, 1, 64, 64, 8, 2, False),        # one token: most experts get no rows
    (2, 37, 200, 72, 8, 2, False),      # ragged token block; H and F not multiples of the tiles
    (3, 300, 512, 256, 64, 6, False),   # many experts, k = 6: several token blocks, ragged m-tiles per expert
    (4, 129, 256, 136, 16, 4, True),    # all tokens to experts 0..3: the other experts get no rows
]


def _gpu_case_param(c):
    name = f"t{c[1]}-h{c[2]}-f{c[3]}-e{c[4]}-k{c[5]}" + ("-skew" if c[6] else "")
    return pytest.param(c, id=name, marks=[pytest.mark.slow] if c[4] >= 64 else [])  # the 64-expert case: ~1 min


@pytest.mark.gpu
@pytest.mark.parametrize("case", [_gpu_case_param(c) for c in GPU_CASES])
@pytest.mark.parametrize("route", ["softmax", "grouped"])
def test_w1_moe_forward(case, route):
    experts = case[4]
    kw = dict(routing="softmax") if route == "softmax" else _gpu_grouped(experts, 4, 2)
    if route == "grouped" and case[5] > 2 * experts // 4:
        pytest.skip("top_k exceeds the kept groups")
    check = Checks()
    _run_case(0, 1, case, kw, check, torch.device("cuda", 0))
    check.finish()


@pytest.mark.gpu
def test_w1_fixed_role_and_determinism():
    import kosmos
    xs, router, w13, w2 = make_case(9, 1, 513, 256, 128, 16, 4)
    args = [t.cuda() for t in (xs[0], router, w13[0], w2[0])]
    first = kosmos.moe_forward(*args, top_k=4)
    for _ in range(4):
        assert torch.equal(kosmos.moe_forward(*args, top_k=4), first)
    assert torch.equal(kosmos.moe_forward(*args, top_k=4, policy="fixed", comm_programs=8), first)
    kosmos.check_errors()


@pytest.mark.gpu
def test_w1_expert_gemms_vs_grouped_mm():
    gen = torch.Generator().manual_seed(5)
    counts = torch.tensor([300, 0, 7, 129, 1, 0, 64, 500], dtype=torch.int32)
    h, f = 256, 200
    x = torch.randn(int(counts.sum()), h, generator=gen).to(torch.bfloat16)
    w13 = (torch.randn(8, h, 2 * f, generator=gen) * h ** -0.5).to(torch.bfloat16)
    w2 = (torch.randn(8, f, h, generator=gen) * f ** -0.5).to(torch.bfloat16)
    y = mf.expert_gemms(x.cuda(), counts.cuda(), w13.cuda(), w2.cuda()).cpu().float()
    ref, start = [], 0
    for i, n in enumerate(counts.tolist()):
        ref.append(moe_reference.expert_ffn(x[start:start + n].float(), w13[i].float(), w2[i].float()))
        start += n
    ref = torch.cat(ref)
    assert ((y - ref).norm() / ref.norm()).item() < TOL


# ============================================================================ simulated ranks, one GPU
RANKS_MOE = dict(tokens=256, hidden=512, ffn=256, experts=8, top_k=2)


@pytest.mark.ranks
@pytest.mark.usefixtures("ranks_setup")
@pytest.mark.parametrize("world,policy", [
    (2, "self"),   # one peer
    (4, "self"),   # 2 experts per rank
    (2, "fixed"),  # the fixed-role policy
])
def test_moe_forward_at_world(world, policy):
    """The one-launch MoE layer at W simulated ranks: routing equals the reference router, y the fp32
    reference, every row written (NaN-poisoned buffers), scratch and counters left clean, two epochs; then
    a third call on the same inputs is bitwise the same."""
    m = MoERanks(world, seed=80 + world, route_kw=dict(routing="softmax", renormalize=True), device="cuda",
                 grid=opcases.grid(world), timeout_ns=opcases.RANKS_TIMEOUT_NS, tol=1e-2, **RANKS_MOE)
    pol = opcases.policy_kw(policy, world)
    for epoch in (1, 2):
        m.new_inputs()
        m.call(epoch, **pol)
        torch.cuda.synchronize()
        m.check(epoch)
    first = [y.clone() for y in m.ys]
    for y in m.ys:
        y.fill_(float("nan"))
    m.call(3, **pol)
    torch.cuda.synchronize()
    m.check(3)
    for r in range(world):
        assert torch.equal(first[r], m.ys[r]), f"rank {r}: repeated call differs"


# ========================================================================================= multi-GPU
def _w2_correctness(rank, world, out_dir):
    dev = torch.device("cuda", rank)
    check = Checks(rank)
    # every kernel variant (E, k, routing) costs a compile: a few cases cover one token, ragged H/F, empty
    # experts, everything to one rank, both routings and both policies
    for case in (GPU_CASES[0], GPU_CASES[1], GPU_CASES[3]):
        _run_case(rank, world, case, dict(routing="softmax"), check, dev)
    _run_case(rank, world, GPU_CASES[1], dict(routing="softmax"), check, dev, policy="fixed", comm_programs=16)
    _run_case(rank, world, GPU_CASES[2], _gpu_grouped(GPU_CASES[2][4], 4, 2), check, dev)
    check.finish(out_dir)


def _w2_determinism_back_to_back(rank, world, out_dir):
    import kosmos
    dev = torch.device("cuda", rank)
    check = Checks(rank)
    xs, router, w13, w2 = make_case(21, world, 700, 512, 256, 32, 8)
    args = [t.to(dev) for t in (xs[rank], router, w13[rank], w2[rank])]
    first = kosmos.moe_forward(*args, top_k=8)
    kosmos.check_errors()
    outs = [kosmos.moe_forward(*args, top_k=8) for _ in range(50)]  # no host sync in between
    kosmos.check_errors()
    check(all(torch.equal(o, first) for o in outs), "back-to-back outputs differ from the first call")
    check_rank(check, rank, xs[rank], router, torch.cat(w13), torch.cat(w2), 8, dict(routing="softmax"), first,
               *[t for t in kosmos.moe_forward(*args, top_k=8, return_routing=True)[1:]])
    check.finish(out_dir)


def _w2_stalled_peer(rank, world, out_dir):
    import kosmos
    dev = torch.device("cuda", rank)
    check = Checks(rank)
    xs, router, w13, w2 = make_case(31, world, 256, 256, 128, 8, 2)
    args = [t.to(dev) for t in (xs[rank], router, w13[rank], w2[rank])]
    stall_peer(rank, lambda: kosmos.moe_forward(*args, top_k=2), "moe_forward", check)
    check.finish(out_dir)


@pytest.mark.multi_gpu
def test_w2_moe_correctness(tmp_path):
    opcases.spawn(_w2_correctness, tmp_path)


@pytest.mark.multi_gpu
def test_w2_moe_determinism_and_back_to_back(tmp_path):
    opcases.spawn(_w2_determinism_back_to_back, tmp_path)


@pytest.mark.multi_gpu
def test_w2_moe_stalled_peer_times_out(tmp_path):
    opcases.spawn(_w2_stalled_peer, tmp_path)


@pytest.mark.ranks
@pytest.mark.usefixtures("ranks_setup")
@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.slow)])
def test_moe_forward_mxfp8_at_world(world):
    """MXFP8 at W simulated ranks (W=1: one launch): against the MX reference math on the kernel's routing,
    two epochs, then bitwise the same on a third call."""
    m = MoERanks(world, seed=90 + world, route_kw=dict(routing="softmax", renormalize=True), device="cuda",
                 grid=opcases.grid(world), timeout_ns=opcases.RANKS_TIMEOUT_NS, tol=1e-2, mx=True, **RANKS_MOE)
    for epoch in (1, 2):
        m.new_inputs()
        m.call(epoch)
        torch.cuda.synchronize()
        m.check(epoch)
    first = [y.clone() for y in m.ys]
    m.call(3)
    torch.cuda.synchronize()
    for r in range(world):
        assert torch.equal(first[r], m.ys[r]), f"rank {r}: repeated call differs"


@pytest.mark.gpu
@pytest.mark.slow
def test_w1_moe_forward_mxfp8_public_op():
    """kosmos.moe_forward(precision="mxfp8") with the weights' MX values: the MX reference math, bitwise
    repeatable; bad shapes and precisions raise one-line errors."""
    import kosmos
    from kosmos import quant
    xs, router, w13, w2 = make_case(21, 1, 300, 256, 128, 8, 2)
    x, router = xs[0].cuda(), router.cuda()
    w13m, w2m = quant.mx_values(w13[0].cuda(), dim=1), quant.mx_values(w2[0].cuda(), dim=1)
    y = kosmos.moe_forward(x, router, w13m, w2m, top_k=2, precision="mxfp8")
    kosmos.check_errors()
    ref = moe_reference.moe_forward_ref_local([x], router, [w13m], [w2m], top_k=2, mx=True)[0]
    assert ((y.float() - ref).norm() / ref.norm()).item() < 1e-2
    assert torch.equal(kosmos.moe_forward(x, router, w13m, w2m, top_k=2, precision="mxfp8"), y)
    with pytest.raises(ValueError, match="precision"):
        kosmos.moe_forward(x, router, w13m, w2m, top_k=2, precision="fp4")


@pytest.mark.gpu
def test_w1_moe_forward_mxfp8_hit_quantizes_this_calls_x():
    """A plan hit quantizes this call's x (quant.quantize_planned, no checks): new values through a hit give
    the bytes a miss (plans dropped: the full path, normal launches) gives, and the reference math."""
    import kosmos
    from kosmos import quant
    from kosmos.core import launch_plan, runtime
    xs, router, w13, w2 = make_case(22, 1, 256, 256, 128, 8, 2)
    xs2 = make_case(23, 1, 256, 256, 128, 8, 2)[0]
    x, x2, router = xs[0].cuda(), xs2[0].cuda(), router.cuda()
    w13m, w2m = quant.mx_values(w13[0].cuda(), dim=1), quant.mx_values(w2[0].cuda(), dim=1)
    kosmos.moe_forward(x, router, w13m, w2m, top_k=2, precision="mxfp8")
    launch_plan.reset_plan_stats()
    y_hit = kosmos.moe_forward(x2, router, w13m, w2m, top_k=2, precision="mxfp8")
    assert launch_plan.plan_stats()["hits"] == 1
    runtime.get_workspace(None, x.device)._plans.clear()
    y_miss = kosmos.moe_forward(x2, router, w13m, w2m, top_k=2, precision="mxfp8")
    kosmos.check_errors()
    assert torch.equal(y_hit, y_miss)
    ref = moe_reference.moe_forward_ref_local([x2], router, [w13m], [w2m], top_k=2, mx=True)[0]
    assert ((y_hit.float() - ref).norm() / ref.norm()).item() < 1e-2


def test_nn_moe_mxfp8_arguments():
    import kosmos.nn as knn
    with pytest.raises(ValueError, match="multiples of 32"):
        knn.MoE(hidden=48, expert_ffn=32, experts=4, top_k=2, dtype="mxfp8")
    with pytest.raises(ValueError, match="choose torch.bfloat16"):
        knn.MoE(hidden=64, expert_ffn=32, experts=4, top_k=2, dtype="fp4")
    assert knn.MoE(hidden=64, expert_ffn=32, experts=4, top_k=2, dtype="mxfp8").precision == "mxfp8"


@pytest.mark.gpu
def test_w1_nn_moe_mxfp8():
    """nn.MoE(dtype="mxfp8") = moe_forward(precision="mxfp8") on the parameters' MX values; the cache follows
    the parameters."""
    import kosmos
    import kosmos.nn as knn
    from kosmos import quant
    layer = knn.MoE(hidden=256, expert_ffn=128, experts=8, top_k=2, dtype="mxfp8").cuda()
    x = torch.randn(200, 256, device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        y = layer(x)
        want = kosmos.moe_forward(x, layer.router_weight, quant.mx_values(layer.w13, dim=1),
                                  quant.mx_values(layer.w2, dim=1), top_k=2, precision="mxfp8")
        assert torch.equal(y, want)
        layer.w2.mul_(2.0)
        assert not torch.equal(layer(x), y)


@pytest.mark.gpu
def test_w1_nn_moe_mxfp8_trains_gpu(no_tf32):
    """nn.MoE(dtype="mxfp8") at one rank on the GPU: loss.backward() (moe_forward(precision="mxfp8"), then the MX
    backward on the kernels) gives moe_backward_ref(mx=True)'s gradients for the kernel's own routing decision
    (3e-2); bitwise the same twice."""
    import kosmos
    import kosmos.nn as knn
    from kosmos import quant
    from kosmos.reference import moe as mr
    m = knn.MoE(256, 128, 16, 4, dtype="mxfp8").cuda()
    x = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    dy = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
    grads = []
    for _ in range(2):
        m.zero_grad()
        xg = x.clone().requires_grad_(True)
        m(xg).backward(dy)
        grads.append([t.grad.clone() for t in (xg, m.router_weight, m.w13, m.w2)])
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    _, _, experts = kosmos.moe_forward(x, m.router_weight.detach(), quant.mx_values(m.w13.detach(), dim=1),
                                       quant.mx_values(m.w2.detach(), dim=1), top_k=4, precision="mxfp8",
                                       return_routing=True)
    ref = mr.moe_backward_ref(x.cpu(), m.router_weight.detach().cpu(), m.w13.detach().cpu(), m.w2.detach().cpu(),
                              dy.cpu(), top_k=4, experts=experts.cpu(), mx=True)
    for name, got, want in zip(("dx", "d_router", "dw13", "dw2"), grads[0], ref):
        assert ((got.float().cpu() - want).norm() / want.norm()).item() < 3e-2, name


@pytest.mark.gpu
@pytest.mark.slow
def test_w1_nn_moe_backward_gpu(no_tf32):
    """nn.MoE at one rank on the GPU: loss.backward() gives moe_reference.moe_backward_ref's gradients for the
    kernel's own routing decision (both routings)."""
    import kosmos
    import kosmos.nn as knn
    from kosmos.reference import moe as mr
    for kw in (dict(routing="softmax"), dict(routing="sigmoid-grouped", n_group=4, topk_group=2, routed_scaling=2.5)):
        m = knn.MoE(256, 128, 16, 4, **kw).cuda()
        x = torch.randn(300, 256, device="cuda").to(torch.bfloat16).requires_grad_(True)
        dy = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
        m(x).backward(dy)
        kernel_kw = {k: v for k, v in kw.items() if k != "routing"}
        _, _, experts = kosmos.moe_forward(x.detach(), m.router_weight.detach(), m.w13.detach(), m.w2.detach(),
                                           top_k=4, routing=kw["routing"], bias=m.bias, return_routing=True,
                                           **kernel_kw)
        ref = mr.moe_backward_ref(x.detach().cpu(), m.router_weight.detach().cpu(), m.w13.detach().cpu(),
                                  m.w2.detach().cpu(), dy.cpu(), top_k=4, experts=experts.cpu(),
                                  **{k: v for k, v in kw.items() if k != "n_group" and k != "topk_group"})
        for got, want in zip((x.grad, m.router_weight.grad, m.w13.grad, m.w2.grad), ref):
            assert ((got.float().cpu() - want).norm() / want.norm()).item() < 3e-2


@pytest.mark.gpu
def test_w1_moe_transformers_layout_gpu(no_tf32):
    """kosmos.nn.moe on one GPU with the experts in transformers' layout (gate_up [E, 2F, H], down [E, H, F] as
    their transposes): the forward bitwise the kernels'-own-layout forward on the same values, the gradients
    (x, router, both weights, in the parameters' own layout) within 1e-3 of it and within 3e-2 of the fp32
    reference on the kernel's routing; F = 200: ragged against every tile."""
    import kosmos
    from kosmos.nn import moe
    from kosmos.reference import moe as mr
    g = torch.Generator(device="cuda").manual_seed(3)
    t, h, f, e, k = 300, 256, 200, 16, 4
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(torch.bfloat16)  # noqa
    x, dy, router = rnd(t, h), rnd(t, h), rnd(e, h, scale=0.5)
    w13, w2 = rnd(e, h, 2 * f, scale=h ** -0.5), rnd(e, f, h, scale=f ** -0.5)
    gate_up, down = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    with torch.no_grad():
        y_native = moe(x, router, w13, w2, top_k=k)
        y_hf = moe(x, router, gate_up.transpose(1, 2), down.transpose(1, 2), top_k=k)
    assert torch.equal(y_native, y_hf)
    grads = []
    for params in ((w13, w2), (gate_up, down)):
        leaves = [p.detach().requires_grad_(True) for p in (x, router, *params)]
        ws = leaves[2:] if params[0] is w13 else [w.transpose(1, 2) for w in leaves[2:]]
        y = moe(leaves[0], leaves[1], *ws, top_k=k)
        grads.append(torch.autograd.grad(y, leaves, dy))
    assert grads[1][2].shape == gate_up.shape and grads[1][3].shape == down.shape
    hf = [grads[1][0], grads[1][1], grads[1][2].transpose(1, 2), grads[1][3].transpose(1, 2)]
    _, _, experts = kosmos.moe_forward(x, router, w13, w2, top_k=k, return_routing=True)
    ref = mr.moe_backward_ref(x.cpu(), router.cpu(), w13.cpu(), w2.cpu(), dy.cpu(), top_k=k, experts=experts.cpu())
    for name, a, b, want in zip(("dx", "d_router", "dw13", "dw2"), hf, grads[0], ref):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-3, name
        assert ((a.float().cpu() - want).norm() / want.norm()).item() < 3e-2, name


@pytest.mark.gpu
def test_w1_moe_forward_given_routing_gpu(no_tf32):
    """moe_forward(routing="given") on one GPU through the public op: fed the decision its router took
    (return_routing), y is bitwise the routed call's -- in both weight layouts, on a plan's first call and on a hit,
    with int64 or int32 ids --; kosmos.nn.moe_experts' gradients (x, the given weights, w13, w2; F = 200 ragged
    against every tile) within 3e-2 of moe_experts_backward_ref on that decision."""
    import kosmos
    import kosmos.nn as knn
    from kosmos.reference import moe as mr
    g = torch.Generator(device="cuda").manual_seed(4)
    t, h, f, e, k = 300, 256, 200, 16, 4
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(torch.bfloat16)  # noqa
    x, dy, router = rnd(t, h), rnd(t, h), rnd(e, h, scale=0.5)
    w13, w2 = rnd(e, h, 2 * f, scale=h ** -0.5), rnd(e, f, h, scale=f ** -0.5)
    y, w, ex = kosmos.moe_forward(x, router, w13, w2, top_k=k, return_routing=True)
    nk = (w13.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2))
    for ww13, ww2 in ((w13, w2), nk):
        for ids in (ex, ex, ex.int()):  # a plan's first call, a hit, another key
            got = kosmos.moe_forward(x, None, ww13, ww2, top_k=k, routing="given", weights=w, experts=ids)
            assert torch.equal(got, y)
    wts = w.clone().requires_grad_(True)
    leaves = [p.detach().clone().requires_grad_(True) for p in (x, w13, w2)]
    out = knn.moe_experts(leaves[0], ex, wts, leaves[1], leaves[2])
    assert torch.equal(out, y)
    out.backward(dy)
    want = mr.moe_experts_backward_ref(x.cpu(), w13.cpu(), w2.cpu(), dy.cpu(), w.cpu(), ex.cpu())
    for name, a, b in zip(("dx", "d_weights", "dw13", "dw2"), (leaves[0].grad, wts.grad, leaves[1].grad,
                                                               leaves[2].grad), want):
        assert ((a.float().cpu() - b).norm() / b.norm()).item() < 3e-2, name


def test_saved_gate_up_in_the_backwards_pair_order():
    """SavedGateUp.in_backward_order at W = 1, rows shuffled inside each expert as the kernel's atomics may place
    them: x[token] @ W13[expert] in the backward's pair order (its stable sort by expert)."""
    g = torch.Generator().manual_seed(0)
    t, h, f, e, k = 37, 16, 8, 6, 3
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    w13 = torch.randn(e, h, 2 * f, generator=g).to(torch.bfloat16)
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    saved = simranks.placed_gate_up(x, w13, experts, k, g)
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=e)
    by_sort = saved.in_backward_order(counts, t * k)
    want = torch.stack([x[p // k].float() @ w13[flat[p]].float() for p in order.tolist()]).to(torch.bfloat16)
    assert torch.equal(by_sort, want)
