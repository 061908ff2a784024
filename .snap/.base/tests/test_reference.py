"""Pure-torch references (kosmos.reference) against float64 math, and rel_err."""
import math

import numpy as np
import pytest
import torch
import torch.distributed as dist

from kosmos import reference


def _bf16(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def _np64(t):
    return t.float().numpy().astype(np.float64)


@pytest.mark.parametrize("world,ms,k,n", [(1, 5, 16, 24), (2, 21, 40, 48), (3, 37, 64, 8), (8, 1, 8, 16)])
def test_all_gather_matmul_ref_local(world, ms, k, n):
    shards = [_bf16(ms, k, seed=10 + r) for r in range(world)]
    b = _bf16(k, n, seed=99)
    a_full, c = reference.all_gather_matmul_ref_local(shards, b)
    assert a_full.dtype == torch.bfloat16 and tuple(a_full.shape) == (world * ms, k)
    for r in range(world):
        assert torch.equal(a_full[r * ms:(r + 1) * ms], shards[r])
    assert c.dtype == torch.float32 and tuple(c.shape) == (world * ms, n)
    want = np.concatenate([_np64(s) for s in shards]) @ _np64(b)
    np.testing.assert_allclose(c.numpy(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("world,ms,k,n", [(1, 5, 16, 24), (2, 21, 40, 48), (3, 37, 64, 8), (4, 3, 8, 16)])
def test_matmul_reduce_scatter_ref_local(world, ms, k, n):
    m = world * ms
    a_list = [_bf16(m, k, seed=20 + r) for r in range(world)]
    b_list = [_bf16(k, n, seed=40 + r) for r in range(world)]
    shards = reference.matmul_reduce_scatter_ref_local(a_list, b_list)
    assert len(shards) == world
    total = sum(_np64(a) @ _np64(b) for a, b in zip(a_list, b_list))
    for r, s in enumerate(shards):
        assert s.dtype == torch.float32 and tuple(s.shape) == (ms, n)
        np.testing.assert_allclose(s.numpy(), total[r * ms:(r + 1) * ms], rtol=1e-5, atol=1e-3)


def test_matmul_reduce_scatter_ref_local_rank_order():
    """The partials are summed in rank order 0..W-1 in fp32 (bitwise equal to that explicit sum)."""
    a_list = [_bf16(12, 16, seed=s) for s in range(3)]
    b_list = [_bf16(16, 8, seed=s + 7) for s in range(3)]
    p = [a.float() @ b.float() for a, b in zip(a_list, b_list)]
    want = ((p[0] + p[1]) + p[2]).chunk(3)
    got = reference.matmul_reduce_scatter_ref_local(a_list, b_list)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


@pytest.mark.skipif(dist.is_available() and dist.is_initialized(), reason="needs no process group")
@pytest.mark.parametrize("fp32", [True, False])
def test_single_process_refs(fp32):
    a = _bf16(21, 40, seed=1)
    b = _bf16(40, 48, seed=2)
    want = _np64(a) @ _np64(b)
    a_full, c = reference.all_gather_matmul_ref(a, b, fp32=fp32)
    assert torch.equal(a_full, a)
    c2 = reference.matmul_reduce_scatter_ref(a, b, fp32=fp32)
    for out in (c, c2):
        assert out.dtype == (torch.float32 if fp32 else torch.bfloat16)
        assert reference.rel_err(out, torch.from_numpy(want)) < (1e-6 if fp32 else 1e-2)
    # the caller's a_full buffer is filled and returned
    buf = torch.zeros_like(a)
    a_full2, _ = reference.all_gather_matmul_ref(a, b, a_full=buf)
    assert a_full2 is buf and torch.equal(buf, a)


# ---------------------------------------------------------------------------------------------- rel_err
def test_rel_err_exact_and_known_perturbation():
    ref = torch.randn(64, 32, generator=torch.Generator().manual_seed(3))
    assert reference.rel_err(ref, ref) == 0.0
    assert reference.rel_err(ref.clone(), ref) == 0.0
    # out = ref * (1 + eps): error eps
    for eps in (1e-3, 0.25):
        assert reference.rel_err(ref * (1 + eps), ref) == pytest.approx(eps, rel=1e-4)
    # one element off by delta: error |delta| / ||ref||
    out = ref.clone()
    out[5, 7] += 2.0
    assert reference.rel_err(out, ref) == pytest.approx(2.0 / ref.double().norm().item(), rel=1e-4)
    # a hand-computed case: ref = [3, 4] (norm 5), out = [3, 5]
    assert reference.rel_err(torch.tensor([3.0, 5.0]), torch.tensor([3.0, 4.0])) == pytest.approx(0.2)
    # bf16 inputs are upcast
    assert reference.rel_err(torch.tensor([3.0, 5.0]).bfloat16(), torch.tensor([3.0, 4.0])) == pytest.approx(0.2)


def test_rel_err_zero_reference_is_absolute():
    assert reference.rel_err(torch.tensor([3.0, 4.0]), torch.zeros(2)) == pytest.approx(5.0)
    assert reference.rel_err(torch.zeros(3), torch.zeros(3)) == 0.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_rel_err_non_finite_is_inf(bad):
    ref = torch.ones(4, 4)
    out = ref.clone()
    out[2, 1] = bad
    assert reference.rel_err(out, ref) == math.inf
    assert reference.rel_err(out.bfloat16(), ref) == math.inf
    assert not reference.rel_err(out, ref) < 1e-2  # never passes a tolerance check


def test_frobenius_error_in_pieces_is_rel_err():
    """FrobeniusError: one piece is rel_err bitwise; any split of the elements the same up to the summation order
    of the pieces' squared norms; a NaN or inf in any piece gives inf."""
    g = torch.Generator().manual_seed(3)
    ref = torch.randn(7, 5, 6, generator=g)
    out = (ref + 1e-3 * torch.randn(7, 5, 6, generator=g)).bfloat16()
    whole = reference.rel_err(out, ref)
    assert reference.FrobeniusError().add(out, ref).value() == whole
    for step in (1, 2, 3, 7):
        acc = reference.FrobeniusError()
        for i in range(0, 7, step):
            acc.add(out[i:i + step], ref[i:i + step])
        assert acc.value() == pytest.approx(whole, rel=1e-6)
    bad = out.clone()
    bad[4, 1, 1] = float("nan")
    acc = reference.FrobeniusError().add(bad[:4], ref[:4]).add(bad[4:], ref[4:])
    assert acc.value() == float("inf")
    with pytest.raises(ValueError, match="shape"):
        reference.FrobeniusError().add(out[:2], ref[:3])
