"""The one-launch MoE layer under the Triton CPU interpreter, for W simulated ranks in one process.

Each rank's buffers are CPU tensors and the peer tables hold their addresses. The interpreter runs programs
one after another, so at W > 1 a rank's call is split into three launches by stage mask -- ROUTE on every
rank, then PERMUTE+GEMM1+GEMM2 on every rank, then FOLD -- so that no program waits on a rank that has not
run yet (a mistake fails fast on a bounded wait instead of hanging). At W = 1 the whole call is one launch.

Checks: the kernel's routing equals the reference router; y equals the fp32 reference given that routing;
every expert row and output is written (buffers poisoned with NaN); bitwise determinism; back-to-back
epochs with fresh inputs; scratch, counters and errors left clean; done flags published.
"""
import os

import pytest
import torch

if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU interpreter tests: need TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA)",
                allow_module_level=True)

from kosmos import moe_reference, planning  # noqa: E402
from kosmos.config import MoEForwardConfig  # noqa: E402
from kosmos.kernels import moe_forward as mf  # noqa: E402
from simranks import MoERanks, rand as _rand  # noqa: E402

GRID = 3
TIMEOUT_NS = 5_000_000
# The interpreter casts fp32 -> bf16 by truncation, not round-to-nearest (measured with Triton 3.9, also with
# fp_downcast_rounding="rtne"); h, o and y are each truncated once, ~1% in all at these tiny sizes. A row
# routed to the wrong expert or slot gives errors of order 1; the GPU tests hold 1e-2.
TOL = 2e-2
SOFTMAX = dict(routing="softmax", renormalize=True)


def _grouped(experts, n_group, topk_group, seed=7):
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(seed)) * 0.1
    return dict(routing="sigmoid-grouped", renormalize=True, n_group=n_group, topk_group=topk_group,
                routed_scaling=2.5, bias=bias)


CASES = [
    pytest.param(1, 37, 48, 40, 8, 2, SOFTMAX, id="w1-softmax"),
    pytest.param(1, 20, 32, 24, 16, 3, _grouped(16, 4, 2), id="w1-grouped"),
    pytest.param(2, 21, 40, 32, 8, 2, dict(routing="softmax", renormalize=False), id="w2-softmax-norenorm"),
    pytest.param(2, 17, 32, 16, 16, 4, _grouped(16, 4, 2), id="w2-grouped"),
    pytest.param(3, 9, 24, 16, 6, 2, SOFTMAX, id="w3-softmax"),
]


@pytest.mark.parametrize("world,tokens,hidden,ffn,experts,top_k,route_kw", CASES)
def test_moe_forward_vs_reference(world, tokens, hidden, ffn, experts, top_k, route_kw):
    m = MoERanks(world, tokens, hidden, ffn, experts, top_k, seed=world * 100 + tokens, route_kw=route_kw)
    for epoch in (1, 2):  # back to back, fresh inputs: epochs, counters and scratch must carry over cleanly
        m.new_inputs()
        m.call(epoch)
        m.check(epoch)


def test_moe_all_tokens_to_few_experts_and_empty_experts():
    """Every token of both ranks picks experts 0 and 1 (rank 0): rank 1's experts get no rows at all."""
    m = MoERanks(2, 19, 32, 24, 8, 2, seed=5, route_kw=SOFTMAX, skew=True)
    m.new_inputs()
    m.call(1)
    for r in range(2):
        assert set(m.routing(r)[1].unique().tolist()) == {0, 1}
    m.check(1)


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


@pytest.mark.parametrize("half_tail", [True, False])
def test_expert_gemms_matches_reference(half_tail):
    """Experts with no rows, a last m-tile of 1..BM/2 rows (run as a half-height tile unless
    MoEForwardConfig(half_tail=False)), exactly BM/2, more than BM/2, and whole tiles only (BM = 16 here)."""
    config = MoEForwardConfig(half_tail=half_tail)
    assert planning.moe_config(config).BM == 16 and planning.moe_config(config).half_tail == half_tail
    gen = torch.Generator().manual_seed(3)
    el, h, f = 7, 40, 24
    counts = torch.tensor([5, 0, 19, 2, 28, 24, 16], dtype=torch.int32)
    x = _rand(int(counts.sum()), h, gen=gen)
    w13 = _rand(el, h, 2 * f, gen=gen, scale=h ** -0.5)
    w2 = _rand(el, f, h, gen=gen, scale=f ** -0.5)
    y = mf.expert_gemms(x, counts, w13, w2, config=config)
    start, ref = 0, []
    for i, n in enumerate(counts.tolist()):
        ref.append(moe_reference.expert_ffn(x[start:start + n].float(), w13[i].float(), w2[i].float()))
        start += n
    ref = torch.cat(ref)
    err = ((y.float() - ref).norm() / ref.norm()).item()
    assert err < TOL, err


def test_trace_records_every_task():
    m = MoERanks(1, 37, 32, 24, 8, 2, seed=13, route_kw=SOFTMAX)
    m.new_inputs()
    trace = torch.zeros((GRID, 1024, 4), dtype=torch.int64)
    kw = {k: v for k, v in m.route_kw.items() if k != "bias"}
    mf.launch(m.xs[0], m.router, None, m.w13[0], m.w2[0], m.ys[0], m.bufs(0), rank=0, world=1, epoch=1,
              timeout_ns=TIMEOUT_NS, grid=GRID, cfg=m.cfg, top_k=2, trace=trace, **kw)
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
