"""The MoE backward's pieces (kosmos/kernels/moe_backward.py): the per-expert weight gradient.

Markers as in conftest.py: ``interpreter`` on the CPU, ``gpu`` on one GPU."""
import pytest
import torch

from kosmos.kernels.moe_backward import expert_weight_grads, expert_weight_grads_ref

CASES = [  # counts per expert (zeros allowed), KA, KB: ragged rows, a KA/KB not a multiple of the tile
    pytest.param([5, 0, 17, 1], 24, 40, id="ragged-with-empty"),
    pytest.param([0, 0], 16, 16, id="all-empty"),
    pytest.param([33], 16, 48, id="one-expert-3-steps"),
]


def _inputs(counts, ka, kb, device, seed=0, spare=3):
    g = torch.Generator().manual_seed(seed)
    r = sum(counts) + spare  # rows past the last expert's: never read
    a = torch.randn(r, ka, generator=g).to(torch.bfloat16)
    b = torch.randn(r, kb, generator=g).to(torch.bfloat16)
    a[sum(counts):] = float("nan")
    b[sum(counts):] = float("nan")
    return a.to(device), b.to(device), torch.tensor(counts, dtype=torch.int32, device=device)


def _check(a, b, counts):
    got = expert_weight_grads(a, b, counts)
    ref = expert_weight_grads_ref(a.cpu(), b.cpu(), counts.cpu())
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert not torch.isnan(got).any()
    err = (got.cpu() - ref).abs().max().item()
    assert err <= 1e-4 * max(1.0, ref.abs().max().item()), err
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            assert torch.equal(got[e].cpu(), torch.zeros_like(ref[e])), f"expert {e} without rows is not zero"
    assert torch.equal(expert_weight_grads(a, b, counts), got)  # deterministic


@pytest.mark.interpreter
@pytest.mark.parametrize("counts,ka,kb", CASES)
def test_expert_weight_grads_interpreter(counts, ka, kb):
    _check(*_inputs(counts, ka, kb, "cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("counts,ka,kb", [([300, 0, 7, 129, 1, 0, 64, 500], 256, 200), ([4096], 2048, 512)])
def test_expert_weight_grads_gpu(no_tf32, counts, ka, kb):
    _check(*_inputs(counts, ka, kb, "cuda", seed=1))


def test_expert_weight_grads_errors():
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows but b has"):
        expert_weight_grads(a, torch.zeros(5, 8, dtype=torch.bfloat16), torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="bfloat16"):
        expert_weight_grads(a.float(), a, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="counts"):
        expert_weight_grads(a, a, torch.tensor([[4]], dtype=torch.int32))


def _dgrad2_inputs(counts, h, f, device, seed=3):
    g = torch.Generator().manual_seed(seed)
    r, e = sum(counts), len(counts)
    dy_rows = torch.randn(r, h, generator=g).to(torch.bfloat16)
    gu = torch.randn(r, 2 * f, generator=g).to(torch.bfloat16)
    w2 = (torch.randn(e, f, h, generator=g) / h ** 0.5).to(torch.bfloat16)
    w_pair = torch.rand(r, generator=g)
    cnt = torch.tensor(counts, dtype=torch.int32)
    return [t.to(device) for t in (dy_rows, gu, w2, w_pair, cnt)]


def _dgrad2_ref(dy_rows, gu, w2, w_pair, counts):
    from kosmos.moe_reference import swiglu_backward_ref
    f = w2.shape[1]
    z = torch.zeros(dy_rows.shape[0], f, dtype=torch.float64)
    start = 0
    for e, n in enumerate(counts.tolist()):
        z[start:start + n] = dy_rows[start:start + n].double() @ w2[e].double().t()
        start += n
    g, u = gu[:, :f].double(), gu[:, f:].double()
    h = g * torch.sigmoid(g) * u
    dg, du = swiglu_backward_ref(w_pair.double()[:, None] * z, g, u)
    return torch.cat([dg, du], -1), (z * h).sum(-1)


@pytest.mark.interpreter
@pytest.mark.parametrize("counts,h,f", [([5, 0, 21, 1], 32, 24), ([40], 48, 16), ([0, 3], 16, 40)])
def test_expert_dgrad2_swiglu_interpreter(counts, h, f):
    """GEMM2's data gradient with the SwiGLU backward and the gate gradient in the epilogue, against the
    references (moe_reference.swiglu_backward_ref; dw = <dy W2^T, h>); deterministic."""
    from kosmos.kernels.moe_backward import expert_dgrad2_swiglu
    args = _dgrad2_inputs(counts, h, f, "cpu")
    dgu, dw = expert_dgrad2_swiglu(*args)
    want_dgu, want_dw = _dgrad2_ref(*[a.cpu() for a in args])
    rel = lambda a, b: ((a.double() - b).norm() / b.norm().clamp(min=1e-30)).item()  # noqa: E731
    assert rel(dgu, want_dgu) < 1e-2 and rel(dw, want_dw) < 1e-5
    again = expert_dgrad2_swiglu(*args)
    assert torch.equal(again[0], dgu) and torch.equal(again[1], dw)


@pytest.mark.gpu
def test_expert_dgrad2_swiglu_gpu(no_tf32):
    from kosmos.kernels.moe_backward import expert_dgrad2_swiglu
    args = _dgrad2_inputs([300, 0, 7, 129, 1, 0, 64, 500], 256, 200, "cuda")
    dgu, dw = expert_dgrad2_swiglu(*args)
    want_dgu, want_dw = _dgrad2_ref(*[a.cpu() for a in args])
    assert ((dgu.cpu().double() - want_dgu).norm() / want_dgu.norm()).item() < 1e-2
    assert ((dw.cpu().double() - want_dw).norm() / want_dw.norm()).item() < 1e-4
