"""The MoE backward (kosmos/ops/moe_backward/): its kernels one by one, the one launch against the multi-launch
path, the simulated EP ranks, the switches of kosmos.MoEBackwardConfig (passed as configs, never as module globals).

Markers as in conftest.py: ``interpreter`` on the CPU, ``gpu`` on one GPU, ``ranks`` simulated ranks on one GPU."""
import pytest
import torch

from kosmos.config import MoEBackwardConfig
from kosmos.ops.moe_backward import api as bwd_api
from kosmos.ops.moe_backward import layout as bwd_layout
from kosmos.ops.moe_backward import multi_launch as bwd_multi
from kosmos.ops.moe_backward import one_launch as bwd_one
from kosmos.ops.moe_backward import rows as bwd_rows
from kosmos.ops.moe_backward.layout import pad_expert_rows, padded_row_offsets, padded_rows_bound
from kosmos.ops.moe_backward.multi_launch import (expert_weight_grads, expert_weight_grads_padded,
                                                  expert_weight_grads_ref)

CASES = [  # counts per expert (zeros allowed), KA, KB: ragged rows, a KA/KB not a multiple of the tile
    pytest.param([5, 0, 17, 1], 24, 40, id="ragged-with-empty"),
    pytest.param([0, 0], 16, 16, id="all-empty"),
    pytest.param([33], 16, 48, id="one-expert-3-steps"),
    pytest.param([0, 16, 0, 31, 0], 56, 8, id="empty-first-and-last-rows-at-and-past-the-step"),
    pytest.param([16, 0, 31], 12, 40, id="ka-not-a-multiple-of-8-pointer-fallback"),
    pytest.param([7, 9], 40, 20, id="kb-not-a-multiple-of-8-pointer-fallback"),
]


def _inputs(counts, ka, kb, device, seed=0, spare=3):
    g = torch.Generator().manual_seed(seed)
    r = sum(counts) + spare  # rows past the last expert's: never read
    a = torch.randn(r, ka, generator=g).to(torch.bfloat16)
    b = torch.randn(r, kb, generator=g).to(torch.bfloat16)
    a[sum(counts):] = float("nan")
    b[sum(counts):] = float("nan")
    return a.to(device), b.to(device), torch.tensor(counts, dtype=torch.int32, device=device)


def _check(a, b, counts, kernel=None):
    """fp32 out against the fp64 reference; the default bf16 out is the fp32 result rounded to nearest even, bit
    for bit (one accumulator, rounded once); experts without rows: zeros; deterministic; ``kernel`` (None: the
    default) gives the same bits as the other kernel."""
    kw = {} if kernel is None else dict(kernel=kernel)
    got = expert_weight_grads(a, b, counts, out_dtype=torch.float32, **kw)
    ref = expert_weight_grads_ref(a.cpu(), b.cpu(), counts.cpu())
    assert got.shape == ref.shape and got.dtype == torch.float32
    assert not torch.isnan(got).any()
    err = (got.cpu() - ref).abs().max().item()
    assert err <= 1e-4 * max(1.0, ref.abs().max().item()), err
    if ref.numel() and ref.norm() > 0:
        assert ((got.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            assert torch.equal(got[e].cpu(), torch.zeros_like(ref[e])), f"expert {e} without rows is not zero"
    assert torch.equal(expert_weight_grads(a, b, counts, out_dtype=torch.float32, **kw), got)  # deterministic
    bf = expert_weight_grads(a, b, counts, **kw)
    assert bf.dtype == torch.bfloat16 and torch.equal(bf.view(torch.int16), got.to(torch.bfloat16).view(torch.int16))
    assert torch.equal(expert_weight_grads(a, b, counts, **kw), bf)
    if kernel is not None:  # the persistent grid and one program per tile: the same per-tile sums, the same bits
        other = "tiles" if kernel == "persistent" else "persistent"
        assert torch.equal(expert_weight_grads(a, b, counts, out_dtype=torch.float32, kernel=other), got)


@pytest.mark.interpreter
@pytest.mark.parametrize("kernel", ["persistent", "tiles"])
@pytest.mark.parametrize("counts,ka,kb", CASES + [pytest.param([3, 0, 0, 40, 9, 0, 1], 32, 48,
                                                                id="persistent-3-programs-over-many-experts")])
def test_expert_weight_grads_interpreter(counts, ka, kb, kernel):
    _check(*_inputs(counts, ka, kb, "cpu"), kernel=kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["persistent", "tiles"])
@pytest.mark.parametrize("counts,ka,kb", [([300, 0, 7, 129, 1, 0, 64, 500], 256, 200), ([4096], 2048, 512),
                                          ([0, 250, 260, 0, 3, 512], 1536, 4096)])
def test_expert_weight_grads_gpu(no_tf32, counts, ka, kb, kernel):
    _check(*_inputs(counts, ka, kb, "cuda", seed=1), kernel=kernel)


def test_expert_weight_grads_errors():
    a = torch.zeros(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="rows but b has"):
        expert_weight_grads(a, torch.zeros(5, 8, dtype=torch.bfloat16), torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="bfloat16"):
        expert_weight_grads(a.float(), a, torch.tensor([4], dtype=torch.int32))
    with pytest.raises(ValueError, match="counts"):
        expert_weight_grads(a, a, torch.tensor([[4]], dtype=torch.int32))
    with pytest.raises(ValueError, match="out_dtype"):
        expert_weight_grads(a, a, torch.tensor([4], dtype=torch.int32), out_dtype=torch.float16)
    with pytest.raises(ValueError, match="kernel must be one of"):
        expert_weight_grads(a, a, torch.tensor([4], dtype=torch.int32), kernel="wide")


PADDED_CASES = [c for c in CASES if "pointer-fallback" not in c.id] + [
    pytest.param([3, 0, 0, 40, 9, 0, 1], 32, 48, id="3-programs-over-many-experts"),
    pytest.param([64, 0, 65, 128], 16, 24, id="at-and-one-past-the-pad")]
INTERP_BR = 16  # expert_weight_grads_padded's row step under the interpreter


def _gap_and_tail(counts, pad, padded_rows):
    """Masks over the padded rows: the gap rows (after an expert's last row, up to the next multiple of pad)
    and the rows of no expert past the last expert's padded end."""
    gap = torch.zeros(padded_rows, dtype=torch.bool)
    start = 0
    for n in counts:
        end = start + -(-n // pad) * pad
        gap[start + n:end] = True
        start = end
    tail = torch.zeros(padded_rows, dtype=torch.bool)
    tail[start:] = True
    return gap, tail


def _check_padded(a, b, counts, pad, device="cpu"):
    """(a) the padded layout: each expert's rows from a multiple of pad, all other rows zero; (b) the flat kernel
    on it gives bitwise expert_weight_grads' dW on the unpadded rows (fp32 and bf16 out; ragged counts, zeros
    included), rows of no expert never read (NaN there); (c) finite nonzero garbage in the gap rows of ONE
    operand changes no bit (the other's zeros make the partial step exact), and garbage in both does change
    the result wherever a tile has a partial step -- so (b) would catch a kernel that read past an expert's
    rows without the zeros."""
    c = torch.tensor(counts, dtype=torch.int32, device=device)
    ref32 = expert_weight_grads(a, b, c, out_dtype=torch.float32)
    ref = expert_weight_grads(a, b, c)
    po = padded_row_offsets(c, pad)
    rp = padded_rows_bound(a.shape[0], len(counts), pad)
    starts = [0]
    for n in counts[:-1]:
        starts.append(starts[-1] + -(-n // pad) * pad)
    assert po.dtype == torch.int32 and po.cpu().tolist() == starts[:len(counts)]
    assert all(s_ % pad == 0 for s_ in starts)
    ap, bp = pad_expert_rows(a, c, po, rp), pad_expert_rows(b, c, po, rp)
    assert ap.shape == (rp, a.shape[1]) and bp.shape == (rp, b.shape[1])
    exp_a = torch.zeros_like(ap)
    src = 0
    for s_, n in zip(starts, counts):
        exp_a[s_:s_ + n] = a[src:src + n]
        src += n
    assert torch.equal(ap.view(torch.int16), exp_a.view(torch.int16))
    gap, tail = _gap_and_tail(counts, pad, rp)
    gap, tail = gap.to(device), tail.to(device)
    for t in (ap, bp):  # rows of no expert: never read
        t[tail] = float("nan")

    def flat(x, y, dt=torch.float32):
        return expert_weight_grads_padded(x, y, c, po, out_dtype=dt, pad=pad)

    got32 = flat(ap, bp)
    assert torch.equal(got32.view(torch.int32), ref32.view(torch.int32))
    assert torch.equal(flat(ap, bp, torch.bfloat16).view(torch.int16), ref.view(torch.int16))
    g = torch.Generator().manual_seed(11)
    a_g, b_g = ap.clone(), bp.clone()
    for t in (a_g, b_g):  # finite, nonzero, both signs
        t[gap] = (torch.randn(int(gap.sum()), t.shape[1], generator=g) + 0.5).to(t.dtype).to(device)
    assert torch.equal(flat(a_g, bp).view(torch.int32), ref32.view(torch.int32)), "zeros in b_pad alone"
    assert torch.equal(flat(ap, b_g).view(torch.int32), ref32.view(torch.int32)), "zeros in a_pad alone"
    if any(n % INTERP_BR for n in counts) and ref32.numel():  # a partial step reads gap rows
        assert not torch.equal(flat(a_g, b_g), ref32), "the gap rows are read: garbage in both must show"


@pytest.mark.interpreter
@pytest.mark.parametrize("pad", [16, 64])
@pytest.mark.parametrize("counts,ka,kb", PADDED_CASES)
def test_expert_weight_grads_padded_interpreter(counts, ka, kb, pad):
    a, b, _ = _inputs(counts, ka, kb, "cpu")
    _check_padded(a, b, counts, pad)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [None, (128, 128, 64, 8, 3), (128, 128, 64, 4, 2), (128, 256, 64, 8, 3),
                                   (256, 128, 64, 8, 3)])
def test_expert_weight_grads_padded_gpu(no_tf32, tiles):
    """On the GPU: bitwise the default (persistent) kernel's dW on the unpadded rows, for every tile variant
    of the probe's sweep."""
    counts, ka, kb = [300, 0, 7, 129, 1, 0, 64, 500], 256, 200
    a, b, c = _inputs(counts, ka, kb, "cuda", seed=1)
    po = padded_row_offsets(c)
    rp = padded_rows_bound(a.shape[0], len(counts))
    ap, bp = pad_expert_rows(a, c, po, rp), pad_expert_rows(b, c, po, rp)
    for dt in (torch.float32, torch.bfloat16):
        ref = expert_weight_grads(a, b, c, out_dtype=dt, kernel="persistent")
        if dt == torch.float32 and tiles is not None and 256 in tiles[:2]:  # 272 KiB of shared: refused
            with pytest.raises(ValueError, match="shared memory"):
                expert_weight_grads_padded(ap, bp, c, po, out_dtype=dt, tiles=tiles)
            continue
        got = expert_weight_grads_padded(ap, bp, c, po, out_dtype=dt, tiles=tiles)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


def test_expert_weight_grads_padded_errors():
    a = torch.zeros(64, 8, dtype=torch.bfloat16)
    c = torch.tensor([4], dtype=torch.int32)
    po = padded_row_offsets(c)
    with pytest.raises(ValueError, match="rows but b_pad has"):
        expert_weight_grads_padded(a, torch.zeros(65, 8, dtype=torch.bfloat16), c, po)
    with pytest.raises(ValueError, match="multiples of 8"):
        expert_weight_grads_padded(torch.zeros(64, 12, dtype=torch.bfloat16), a, c, po)
    with pytest.raises(ValueError, match="pad_offs"):
        expert_weight_grads_padded(a, a, c, po[:0])
    with pytest.raises(ValueError, match="must divide"):
        expert_weight_grads_padded(a, a, c, po, pad=8, tiles=(128, 128, 64, 8, 2))
    assert padded_rows_bound(100, 3, 64) == 100 + 3 * 63
    assert padded_row_offsets(torch.tensor([0, 1, 64, 65, 0, 3]), 64).tolist() == [0, 0, 64, 128, 256, 256]


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
    from kosmos.reference.moe import swiglu_backward_ref
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
@pytest.mark.parametrize("mode", ["split", "whole", "unfused"],
                         ids=["split-epilogue", "whole-epilogue", "unfused-gemm-then-pass"])
@pytest.mark.parametrize("counts,h,f", [([5, 0, 21, 1], 32, 24), ([40], 48, 16), ([0, 3], 16, 40),
                                         ([17, 0, 3, 0], 20, 24), ([0, 33, 0], 48, 8), ([9, 0, 14], 32, 12)])
def test_expert_dgrad2_swiglu_interpreter(counts, h, f, mode):  # H = 20: the pointer fallback
    """GEMM2's data gradient with the SwiGLU backward and the gate gradient in the epilogue, against the
    references (moe_reference.swiglu_backward_ref; dw = <dy W2^T, h>); deterministic. ``mode``: the epilogue
    in two half-width slices (the GPU's 128 x 128 tile) or on the whole tile (F = 12: a half past F); or
    unfused (z rounded to bf16 by the GEMM, then the pass: dw at bf16 level); h bitwise swiglu_h's in each."""
    from kosmos.ops.moe_backward.multi_launch import expert_dgrad2_swiglu
    config = MoEBackwardConfig(dgrad2_split=mode == "split", dgrad2_fused=mode != "unfused")
    args = _dgrad2_inputs(counts, h, f, "cpu")
    dgu, dw = expert_dgrad2_swiglu(*args, config=config)
    want_dgu, want_dw = _dgrad2_ref(*[a.cpu() for a in args])
    rel = lambda a, b: ((a.double() - b).norm() / b.norm().clamp(min=1e-30)).item()  # noqa: E731
    assert rel(dgu, want_dgu) < 1e-2 and rel(dw, want_dw) < (1e-2 if mode == "unfused" else 1e-5)
    again = expert_dgrad2_swiglu(*args, config=config)
    assert torch.equal(again[0], dgu) and torch.equal(again[1], dw)
    dgu_h, dw_h, h_rows = expert_dgrad2_swiglu(*args, emit_h=True, config=config)
    assert torch.equal(dgu_h, dgu) and torch.equal(dw_h, dw)
    assert torch.equal(h_rows.view(torch.int16), bwd_rows.swiglu_h(args[1], f).view(torch.int16))


@pytest.mark.interpreter
def test_expert_dgrad2_swiglu_padded_ignores_unwritten_gap_rows(monkeypatch):
    """The padded layout's dgrad2: the GEMM leaves z's gap rows unwritten (here: NaN), and the SwiGLU pass reads
    them as zeros through ``valid`` -- dgu, h and the gate gradient are zero there, and the rows of the experts
    are bitwise the packed layout's."""
    counts, h, f = [5, 0, 21, 1], 32, 24
    dy_rows, gu, w2, w_pair, cnt = _dgrad2_inputs(counts, h, f, "cpu")
    pad_offs, row_of, real_of, _ = bwd_layout.padded_layout(cnt, int(cnt.sum()))
    valid, real = real_of >= 0, real_of.clamp(min=0)
    idx = torch.where(valid, real, -1)
    dy_p, gu_p = bwd_rows.gather_rows(dy_rows, idx), bwd_rows.gather_rows(gu, idx)
    w_p = torch.where(valid, w_pair[real], 0.0)
    real_dgrad1 = bwd_multi.expert_dgrad1

    def dgrad1_with_nan_gaps(*args, **kw):
        z = real_dgrad1(*args, **kw)
        return z.masked_fill(~valid[:, None], float("nan"))

    want = bwd_multi.expert_dgrad2_swiglu(dy_rows, gu, w2, w_pair, cnt, emit_h=True, fused=False)  # packed
    monkeypatch.setattr(bwd_multi, "expert_dgrad1", dgrad1_with_nan_gaps)
    dgu, dw, hh = bwd_multi.expert_dgrad2_swiglu(dy_p, gu_p, w2, w_p, cnt, emit_h=True, fused=False, offs=pad_offs,
                                          valid=valid)
    for got, ref in zip((dgu, dw, hh), want):
        assert not got[~valid].any() and torch.equal(got[row_of], ref)
    with pytest.raises(ValueError, match="come together"):
        bwd_multi.expert_dgrad2_swiglu(dy_p, gu_p, w2, w_p, cnt, fused=False, offs=pad_offs)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused-epilogue", "unfused"])
def test_expert_dgrad2_swiglu_gpu(no_tf32, fused):
    args = _dgrad2_inputs([300, 0, 7, 129, 1, 0, 64, 500], 256, 200, "cuda")
    dgu, dw, h_rows = bwd_multi.expert_dgrad2_swiglu(*args, emit_h=True, fused=fused)
    want_dgu, want_dw = _dgrad2_ref(*[a.cpu() for a in args])
    assert ((dgu.cpu().double() - want_dgu).norm() / want_dgu.norm()).item() < 1e-2
    assert ((dw.cpu().double() - want_dw).norm() / want_dw.norm()).item() < (1e-4 if fused else 1e-2)
    assert torch.equal(h_rows.view(torch.int16), bwd_rows.swiglu_h(args[1], args[2].shape[1]).view(torch.int16))
    again = bwd_multi.expert_dgrad2_swiglu(*args, emit_h=True, fused=fused)
    assert all(torch.equal(x, y) for x, y in zip(again, (dgu, dw, h_rows)))


@pytest.mark.interpreter
@pytest.mark.parametrize("counts,h,f", [([5, 0, 21, 1], 32, 24), ([0, 40], 48, 16), ([9, 0, 18], 40, 6),
                                         ([0, 33, 0], 24, 8)])
def test_expert_dgrad1_interpreter(counts, h, f):  # 2F = 12: the pointer fallback
    from kosmos.ops.moe_backward.multi_launch import expert_dgrad1
    g = torch.Generator().manual_seed(4)
    r, e = sum(counts), len(counts)
    dgu = torch.randn(r, 2 * f, generator=g).to(torch.bfloat16)
    w13 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).to(torch.bfloat16)
    cnt = torch.tensor(counts, dtype=torch.int32)
    dx = expert_dgrad1(dgu, w13, cnt)
    want, start = torch.zeros(r, h, dtype=torch.float64), 0
    for i, n in enumerate(counts):
        want[start:start + n] = dgu[start:start + n].double() @ w13[i].double().t()
        start += n
    assert ((dx.double() - want).norm() / want.norm()).item() < 1e-2


def _gu(r, f, seed=7):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(r, 2 * f, generator=g) * 4).to(torch.bfloat16)
    gu[0, :4] = torch.tensor([-100.0, -90.0, 0.0, 95.0]).to(torch.bfloat16)  # exp(-g) past fp32's range, g = 0
    return gu


def _h_torch(gu, f):  # moe_backward's torch line for h, as it was
    g, u = gu[:, :f].float(), gu[:, f:].float()
    return (g * torch.sigmoid(g) * u).to(torch.bfloat16)


@pytest.mark.interpreter
@pytest.mark.parametrize("r,f", [(5, 24), (3, 1030)])
def test_swiglu_h_interpreter(r, f):
    """h = silu(g) u in one pass: within one bf16 rounding of torch's line (the interpreter's exp is numpy's)."""
    from kosmos.ops.moe_backward.rows import swiglu_h
    gu = _gu(r, f)
    got, want = swiglu_h(gu, f), _h_torch(gu, f)
    assert got.dtype == torch.bfloat16 and got.shape == (r, f)
    assert ((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-30).all()


@pytest.mark.gpu
def test_swiglu_h_bitwise_torch_gpu():
    """On the GPU the kernel is bitwise torch's (g * sigmoid(g) * u).to(bf16): libdevice expf, IEEE division."""
    from kosmos.ops.moe_backward.rows import swiglu_h
    gu = _gu(4096, 1536).cuda()
    assert torch.equal(swiglu_h(gu, 1536).view(torch.int16), _h_torch(gu, 1536).view(torch.int16))


def _check_dgrad2_emitted_h(counts, h, f, device):
    """dgrad2's epilogue h (emit_h) is bitwise swiglu_h's and its other outputs are unchanged by emitting it."""
    from kosmos.ops.moe_backward.multi_launch import expert_dgrad2_swiglu
    from kosmos.ops.moe_backward.rows import swiglu_h
    dy_rows, gu, w2, w_pair, cnt = _dgrad2_inputs(counts, h, f, device)
    gu = _gu(gu.shape[0], f).to(device)  # exp(-g) past fp32's range, g = 0, |g| up to ~16
    dgu, dw, hb = expert_dgrad2_swiglu(dy_rows, gu, w2, w_pair, cnt, emit_h=True)
    assert hb.dtype == torch.bfloat16 and hb.shape == (gu.shape[0], f)
    assert torch.equal(hb.view(torch.int16), swiglu_h(gu, f).view(torch.int16))
    dgu0, dw0 = expert_dgrad2_swiglu(dy_rows, gu, w2, w_pair, cnt)
    assert torch.equal(dgu, dgu0) and torch.equal(dw, dw0)
    return hb, gu


@pytest.mark.interpreter
@pytest.mark.parametrize("counts,h,f", [([5, 0, 21, 1], 32, 24), ([0, 33, 0], 48, 12)])
def test_dgrad2_emitted_h_interpreter(counts, h, f):
    _check_dgrad2_emitted_h(counts, h, f, "cpu")


@pytest.mark.gpu
def test_dgrad2_emitted_h_bitwise_gpu():
    """On the GPU dgrad2's h is bitwise swiglu_h's and torch's line (if not: DGRAD2_EMITS_H = False)."""
    hb, gu = _check_dgrad2_emitted_h([300, 0, 7, 129, 1, 0, 64, 500, 2048], 256, 1536, "cuda")
    assert torch.equal(hb.view(torch.int16), _h_torch(gu, 1536).view(torch.int16))


@pytest.mark.interpreter
@pytest.mark.parametrize("counts,h", [([3, 0, 5], 24), ([0, 0, 4], 1030)])
def test_scaled_rows_and_unpermute_sum_bitwise_torch(counts, h):
    """do = w * dy[tok] and the dispatch backward's gather-sum: bitwise the torch lines they replace."""
    from kosmos.reference import moe as mr
    from kosmos.ops.moe_backward.rows import scaled_rows, sum_partials, unpermute_sum
    g = torch.Generator().manual_seed(9)
    k, t = 2, sum(counts) // 2 + 1
    p = t * k
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16)
    order = torch.randperm(p, generator=g)
    tok, w = order // k, torch.rand(p, generator=g)
    assert torch.equal(scaled_rows(dy, tok, w), (w[:, None] * dy[tok].float()).to(torch.bfloat16))
    rows = torch.randn(p, h, generator=g).to(torch.bfloat16)
    pair = torch.empty_like(rows)
    pair[order] = rows
    assert torch.equal(unpermute_sum(rows, order, k), mr.dispatch_backward_ref(pair.float(), k))
    parts = torch.randn(p, 5, generator=g)
    want = parts[:, 0].clone()
    for i in range(1, 5):
        want += parts[:, i]
    assert torch.equal(sum_partials(parts), want)


def _moe_layer(g, t, h, f, e):
    """A bf16 MoE layer's tensors from generator g, in this order: x [t, h], router [e, h], w13 [e, h, 2f],
    w2 [e, f, h], dy [t, h]."""
    x = torch.randn(t, h, generator=g).to(torch.bfloat16)
    wr = (torch.randn(e, h, generator=g) * 0.5).to(torch.bfloat16)
    w13 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, f, h, generator=g) / f ** 0.5).to(torch.bfloat16)
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16)
    return x, wr, w13, w2, dy


@pytest.mark.interpreter
def test_gather_rows_and_padded_layout():
    """gather_rows: src[idx] with zero rows where idx < 0 (the kernel and its torch twin), scaled_rows likewise;
    padded_layout: every sorted row lands at its expert's padded start + its rank inside the expert, real_of is
    row_of's inverse and -1 elsewhere."""
    g = torch.Generator().manual_seed(4)
    src = torch.randn(7, 24, generator=g).to(torch.bfloat16)
    idx = torch.tensor([3, -1, 0, 6, -1, 3])
    want = src[idx.clamp(min=0)].masked_fill((idx < 0)[:, None], 0)
    assert torch.equal(bwd_rows.gather_rows(src, idx), want)
    w = torch.rand(6, generator=g)
    assert torch.equal(bwd_rows.scaled_rows(src, idx, w), (w[:, None] * want.float()).to(torch.bfloat16))
    both = bwd_rows.gather_rows_and_scaled(src, idx, w)
    assert torch.equal(both[0], want) and torch.equal(both[1], bwd_rows.scaled_rows(src, idx, w))
    counts = torch.tensor([3, 0, 70, 1, 0])
    pad_offs, row_of, real_of, end = bwd_layout.padded_layout(counts, int(counts.sum()))
    assert pad_offs.tolist() == [0, 64, 64, 192, 256] and end.tolist() == [256]
    assert bwd_layout.padded_layout(torch.tensor([3, 70, 0]), 73)[3].tolist() == [192]
    limited = bwd_rows.gather_rows(src, idx, torch.tensor([4], dtype=torch.int32))
    assert torch.equal(limited[:4], want[:4])  # rows from the limit on: not written
    assert row_of.tolist() == [0, 1, 2] + list(range(64, 134)) + [192]
    assert real_of.shape[0] == bwd_layout.padded_rows_bound(74, 5)
    assert torch.equal(real_of[row_of], torch.arange(74)) and int((real_of >= 0).sum()) == 74


@pytest.mark.interpreter
@pytest.mark.parametrize("routing,saved", [("softmax", False), ("sigmoid-grouped", True)])
def test_moe_backward_padded_rows_bitwise_packed(routing, saved):
    """moe_backward_w1 with the expert rows in the padded layout (the default: gathers into it, the flat wgrad,
    the dgrads on padded offsets) gives bitwise the packed layout's gradients: one expert without rows, one with
    more than a pad's worth; on the recomputed and on a saved g | u."""
    from kosmos.reference import moe as mr
    from kosmos.ops.moe_backward.api import moe_backward_w1
    from simranks import placed_gate_up
    g = torch.Generator().manual_seed(12)
    t, h, f, e, k = 45, 32, 16, 6, 2
    x, wr, w13, w2, dy = _moe_layer(g, t, h, f, e)
    # expert 0 in every token (45 rows: > 16, the interpreter's row step), expert 3 in none
    others = torch.tensor([1, 2, 4, 5])[torch.randint(0, 4, (t,), generator=g)]
    experts = torch.stack([torch.zeros(t, dtype=torch.long), others], 1)
    kw = dict(routing=routing) if routing == "softmax" else dict(routing=routing, routed_scaling=2.5)
    weights, _, _ = mr.routing_weights_ref(x.float() @ wr.float().t(), experts, routing,
                                           routed_scaling=kw.get("routed_scaling", 1.0))
    saved_gu = placed_gate_up(x, w13, experts, k, torch.Generator().manual_seed(1)) if saved else None
    packed = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved_gu, padded=False, **kw)
    padded = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved_gu, padded=True, one_launch=False,
                             **kw)  # the layouts compared on the multi-launch path (the one launch: its own tests)
    for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), padded, packed):
        assert torch.equal(a, b), name
    assert torch.equal(padded[2][3], torch.zeros_like(padded[2][3]))


@pytest.mark.interpreter
def test_moe_backward_padded_rows_without_tokens():
    """No tokens at all (a rank with nothing routed to it): the padded layout's gathers have nothing to read, and
    the gradients are the packed path's -- empty dx, zero weight gradients."""
    from kosmos.ops.moe_backward.api import moe_backward_w1
    x, wr, w13, w2, dy = _moe_layer(torch.Generator().manual_seed(2), 0, 32, 16, 4)
    experts, weights = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    packed = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, padded=False)
    padded = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, padded=True, one_launch=False)
    assert padded[0].shape == (0, 32) and not padded[2].any() and not padded[3].any()
    assert all(torch.equal(a, b) for a, b in zip(padded, packed))


@pytest.mark.interpreter
@pytest.mark.parametrize("routing", ["softmax", "sigmoid-grouped"])
def test_moe_backward_w1_vs_reference(routing):
    """The whole W=1 backward (the pieces + torch glue) against moe_reference.moe_backward_ref (fp32, explicit
    formulas): dx, d(router weight), dW13, dW2; one expert left without tokens; deterministic."""
    from kosmos.reference import moe as mr
    from kosmos.ops.moe_backward.api import moe_backward_w1
    g = torch.Generator().manual_seed(11)
    t, h, f, e, k = 19, 32, 24, 8, 2
    x, wr, w13, w2, dy = _moe_layer(g, t, h, f, e)
    kw = dict(routing="softmax") if routing == "softmax" else dict(routing="sigmoid-grouped", n_group=4,
                                                                   topk_group=2, routed_scaling=2.5)
    # each token's two distinct experts, never expert 5 (it gets no rows); the decision is given, not routed
    allowed = torch.tensor([0, 1, 2, 3, 4, 6, 7])
    picks = torch.stack([torch.randperm(7, generator=g)[:k] for _ in range(t)])
    experts = allowed[picks]
    rkw = {kk: v for kk, v in kw.items() if kk in ("routing", "routed_scaling")}
    logits = x.float() @ wr.float().t()
    weights, _, _ = mr.routing_weights_ref(logits, experts, kw["routing"], routed_scaling=kw.get("routed_scaling", 1.0))
    got = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, **rkw)
    want = mr.moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=experts, **kw)
    for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), got, want):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, (name, rel)
    assert torch.equal(got[2][5], torch.zeros_like(got[2][5])) and torch.equal(got[3][5], torch.zeros_like(got[3][5]))
    again = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, **rkw)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.interpreter
@pytest.mark.parametrize("path", [
    "one-launch", "one-launch-router", "multi-launch", "packed", "packed-fused-dgrad2"])
def test_moe_backward_reads_transformers_layout(path):
    """The W = 1 backward on the experts' weights in transformers' layout (gate_up [E, 2F, H], down [E, H, F],
    passed as their .transpose(1, 2)) on every path: the same gradients as on the kernels' own layout (to the
    rounding of a summation order) and the reference's; dW13 / dW2 come back in the weights' layout (the
    transposes of contiguous [E, 2F, H] / [E, H, F]); an expert without rows gets zeros."""
    from kosmos.reference import moe as mr
    from kosmos.ops.moe_backward.api import moe_backward
    from kosmos.ops.moe_forward import weights_nk
    g = torch.Generator().manual_seed(31)
    t, h, f, e, k = 21, 40, 24, 8, 2  # H = 40, F = 24: ragged against the interpreter's 16-wide tiles
    x, wr, w13, w2, dy = _moe_layer(g, t, h, f, e)
    allowed = torch.tensor([0, 1, 2, 3, 4, 6, 7])  # expert 5 gets no rows
    experts = allowed[torch.stack([torch.randperm(7, generator=g)[:k] for _ in range(t)])]
    weights, _, _ = mr.routing_weights_ref(x.float() @ wr.float().t(), experts, "softmax")
    w13_nk = w13.transpose(1, 2).contiguous().transpose(1, 2)
    w2_nk = w2.transpose(1, 2).contiguous().transpose(1, 2)
    assert weights_nk(w13_nk) and weights_nk(w2_nk)
    kw = dict(one_launch=path.startswith("one-launch"), padded=not path.startswith("packed"),
              router_in_launch=path == "one-launch-router" or (False if path.startswith("one-launch") else None),
              config=MoEBackwardConfig(dgrad2_fused=path == "packed-fused-dgrad2"))
    native = moe_backward(x, wr, w13, w2, dy, weights, experts, **kw)
    nk = moe_backward(x, wr, w13_nk, w2_nk, dy, weights, experts, **kw)
    want = mr.moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=experts, routing="softmax")
    assert nk[2].shape == w13.shape and nk[3].shape == w2.shape
    assert weights_nk(nk[2]) and weights_nk(nk[3]), "the weight gradients come back in the weights' layout"
    for name, a, b, ref in zip(("dx", "d_router", "dw13", "dw2"), nk, native, want):
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-3, name
        assert ((a.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2, name
    assert not nk[2][5].any() and not nk[3][5].any()


GIVEN_PATHS = ["one-launch", "multi-launch", "packed", "one-launch-transformers-layout",
               "multi-launch-transformers-layout"]


@pytest.mark.interpreter
@pytest.mark.parametrize("path", GIVEN_PATHS)
def test_moe_backward_given_routing(path):
    """moe_backward(routing="given") -- no router -- on every W = 1 path (the one launch with the router stages left
    out, the multi-launch path padded and packed; both weight layouts): (dx = bf16(dx_e), d_weights [T, k] fp32,
    dW13, dW2) against reference.moe.moe_experts_backward_ref; the expert part is the routed backward's, bit for
    bit (dW13, dW2 equal moe_backward(routing="softmax")'s on the same decision and path); an expert without rows
    gets zeros; a token naming one expert twice is two rows; deterministic."""
    from kosmos.reference import moe as mr
    from kosmos.ops.moe_backward.api import moe_backward
    from kosmos.ops.moe_forward import weights_nk
    g = torch.Generator().manual_seed(41)
    t, h, f, e, k = 21, 40, 24, 8, 2  # ragged against the interpreter's 16-wide tiles
    x, wr, w13, w2, dy = _moe_layer(g, t, h, f, e)
    allowed = torch.tensor([0, 1, 2, 3, 4, 6, 7])  # expert 5 gets no rows
    experts = allowed[torch.stack([torch.randperm(7, generator=g)[:k] for _ in range(t)])]
    experts[3] = 2  # token 3: expert 2 in both slots
    weights = torch.rand(t, k, generator=g) + 0.1
    if path.endswith("transformers-layout"):
        w13, w2 = (w.transpose(1, 2).contiguous().transpose(1, 2) for w in (w13, w2))
    kw = dict(one_launch=path.startswith("one-launch"), padded=path != "packed")
    got = moe_backward(x, None, w13, w2, dy, weights, experts, routing="given", **kw)
    want = mr.moe_experts_backward_ref(x, w13, w2, dy, weights, experts)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == torch.float32 and got[1].shape == (t, k)
    assert weights_nk(got[2]) == weights_nk(w13) and got[2].shape == w13.shape and got[3].shape == w2.shape
    for name, a, b in zip(("dx", "d_weights", "dw13", "dw2"), got, want):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, (name, rel)
    assert not got[2][5].any() and not got[3][5].any()
    routed = moe_backward(x, wr, w13, w2, dy, weights, experts, routing="softmax", router_in_launch=False
                          if kw["one_launch"] else None, **kw)
    assert torch.equal(got[2], routed[2]) and torch.equal(got[3], routed[3])
    again = moe_backward(x, None, w13, w2, dy, weights, experts, routing="given", **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_moe_backward_given_routing_refusals():
    """routing="given" takes no router weight and no router stage in the launch; CPU ids outside [0, E) and a
    decision of another shape are refused before anything runs; an unknown routing names the kinds."""
    from kosmos.ops.moe_backward.api import moe_backward
    x, wr, w13, w2, dy = _moe_layer(torch.Generator().manual_seed(3), 6, 32, 16, 4)
    experts, weights = torch.tensor([[0, 1]] * 6), torch.full((6, 2), 0.5)
    for args, kw, match in [
        ((wr,), {}, "pass router_weight=None"),
        ((None,), dict(router_in_launch=True, one_launch=True), "router_in_launch=True"),
        ((None,), dict(experts=experts + 3), r"in \[0, 4\)"),
        ((None,), dict(weights=weights[:, :1]), "must both be"),
        ((None,), dict(routing="sinkhorn"), "choose from softmax, sigmoid-grouped, given"),
    ]:
        call = dict(weights=weights, experts=experts, routing="given")
        call.update(kw)
        w_, e_ = call.pop("weights"), call.pop("experts")
        with pytest.raises(ValueError, match=match):
            moe_backward(x, args[0], w13, w2, dy, w_, e_, **call)


def _ep_given_rank(rank, world, port, q):
    """One rank of the EP backward with the routing given: moe_backward(routing="given") over a gloo group."""
    import os
    import torch.distributed as dist
    from kosmos.ops.moe_backward.api import moe_backward
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        full = _ep_inputs("softmax", world)
        x, dy, experts, weights = (full[n][rank] for n in ("x", "dy", "experts", "weights"))
        local = full["w13"].shape[0] // world
        w13, w2 = (full[n][rank * local:(rank + 1) * local] for n in ("w13", "w2"))
        got = moe_backward(x, None, w13, w2, dy, weights, experts, group=dist.group.WORLD, routing="given")
        q.put((rank, [t.float().numpy() for t in got]))
    finally:
        from multiproc import finish_gloo
        finish_gloo()


@pytest.mark.interpreter
def test_moe_backward_given_routing_over_two_ranks_vs_reference():
    """moe_backward(routing="given") at W = 2 over gloo (the multi-launch path, all-to-alls between the kernels):
    each rank's dx and d_weights, each rank's dW13 / dW2, against moe_experts_backward_ref on every rank's tokens
    with every expert in one process; an expert without rows (expert 3) gets zeros."""
    from kosmos.reference import moe as mr
    from multiproc import spawn_gloo
    world = 2
    full = _ep_inputs("softmax", world)
    got = spawn_gloo(_ep_given_rank, world)
    want = mr.moe_experts_backward_ref(torch.cat(full["x"]), full["w13"], full["w2"], torch.cat(full["dy"]),
                                       torch.cat(full["weights"]), torch.cat(full["experts"]))
    part = lambda r, i: torch.from_numpy(got[r][i])  # noqa: E731
    for i, name in enumerate(("dx", "d_weights", "dw13", "dw2")):
        a = torch.cat([part(r, i) for r in range(world)])
        rel = ((a - want[i].float()).norm() / want[i].float().norm()).item()
        assert rel < 2e-2, (name, rel)
    assert not part(0, 2)[3].any() and not part(0, 3)[3].any()


def _ep_backward_rank(rank, world, port, q, routing, saved=False, padded=None, empty_rank=False):
    """One rank of the EP backward test: this rank's tokens, dy and decision, its experts; moe_backward over a
    gloo group (the kernels under the interpreter); ``saved``: on a stand-in of the forward's g | u."""
    import os
    import torch.distributed as dist
    from kosmos.ops.moe_backward.api import moe_backward
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        full = _ep_inputs(routing, world, empty_rank=empty_rank)
        x, dy, experts, weights = (full[n][rank] for n in ("x", "dy", "experts", "weights"))
        local = full["w13"].shape[0] // world
        w13, w2 = (full[n][rank * local:(rank + 1) * local] for n in ("w13", "w2"))
        from simranks import placed_gate_up
        saved_gu = (placed_gate_up(full["x"], full["w13"], full["experts"], full["experts"][0].shape[1],
                                   torch.Generator().manual_seed(rank), rank, world) if saved else None)
        got = moe_backward(x, full["wr"], w13, w2, dy, weights, experts, group=dist.group.WORLD,
                           saved_gu=saved_gu, padded=padded, **full["rkw"])
        again = moe_backward(x, full["wr"], w13, w2, dy, weights, experts, group=dist.group.WORLD,
                             saved_gu=saved_gu, padded=padded, **full["rkw"])
        same = all(torch.equal(a, b) for a, b in zip(got, again))
        try:  # the one launch at W > 1 needs CUDA (the symmetric workspace): refused on every rank before any
            # exchange (no rank left waiting); on CUDA: test_moe_backward_one_launch_ep_public_op_gpu
            moe_backward(x, full["wr"], w13, w2, dy, weights, experts, group=dist.group.WORLD, one_launch=True,
                         **full["rkw"])
            refused = False
        except ValueError as err:
            refused = "needs CUDA tensors" in str(err)
        try:  # the fixed-role split is of the one launch's programs: refused with the multi-launch path
            moe_backward(x, full["wr"], w13, w2, dy, weights, experts, group=dist.group.WORLD, one_launch=False,
                         policy="fixed", comm_programs=1, **full["rkw"])
            refused = False
        except ValueError as err:
            refused = refused and "needs one_launch=True" in str(err)
        # by value (numpy; bf16 exactly as fp32): a tensor on the queue would live in this process's shared memory
        q.put((rank, ([t.float().numpy() for t in got], same, refused)))
    finally:
        from multiproc import finish_gloo
        finish_gloo()


def _ep_inputs(routing, world, t=13, h=32, f=24, e=8, k=2, empty_rank=False):
    """Every rank's tokens (rank 1: none routed to expert block 0's last expert; rank 0: a token count not a
    multiple of anything) and the whole layer, from one seed. ``empty_rank``: every token to experts 0-3 only, so
    the last rank's experts receive no rows at all."""
    from kosmos.reference import moe as mr
    g = torch.Generator().manual_seed(23)
    wr = (torch.randn(e, h, generator=g) * 0.5).to(torch.bfloat16)
    w13 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, f, h, generator=g) / f ** 0.5).to(torch.bfloat16)
    kw = dict(routing="softmax") if routing == "softmax" else dict(routing="sigmoid-grouped", n_group=4,
                                                                   topk_group=2, routed_scaling=2.5)
    rkw = {kk: v for kk, v in kw.items() if kk in ("routing", "routed_scaling")}
    allowed = torch.tensor([0, 1, 2, 4, 5, 6, 7])  # expert 3 gets no rows from any rank
    if empty_rank:
        allowed = torch.arange(e // world)
    xs, dys, exps, ws = [], [], [], []
    for r in range(world):
        n = t + 5 * r
        x = torch.randn(n, h, generator=g).to(torch.bfloat16)
        experts = allowed[torch.stack([torch.randperm(len(allowed), generator=g)[:k] for _ in range(n)])]
        logits = x.float() @ wr.float().t()
        weights, _, _ = mr.routing_weights_ref(logits, experts, kw["routing"],
                                               routed_scaling=kw.get("routed_scaling", 1.0))
        xs.append(x), dys.append(torch.randn(n, h, generator=g).to(torch.bfloat16)), exps.append(experts)
        ws.append(weights)
    return dict(x=xs, dy=dys, experts=exps, weights=ws, wr=wr, w13=w13, w2=w2, kw=kw, rkw=rkw)


@pytest.mark.interpreter
@pytest.mark.parametrize("routing,saved,padded,empty_rank", [
    ("softmax", False, True, False), ("sigmoid-grouped", False, True, False), ("softmax", True, True, False),
    ("softmax", True, False, False), ("softmax", False, True, True)])
def test_moe_backward_over_two_ranks_vs_reference(routing, saved, padded, empty_rank):
    """moe_backward at W=2 over gloo (all-to-alls between the kernels) against moe_backward_ref on every rank's
    tokens with every expert in one process: dx of each rank's tokens, d(router weight) summed over the ranks,
    dW13 / dW2 of each rank's experts (an expert without rows: zeros); deterministic per rank. ``saved``: on each
    rank's g | u as the forward keeps them (rows shuffled inside each source), gathered into the backward's
    order after the exchange. ``padded``: the expert rows in the padded layout after the exchange, or packed.
    ``empty_rank``: rank 1's experts receive no rows (its weight gradients: zeros)."""
    from kosmos.reference import moe as mr
    from multiproc import spawn_gloo
    world = 2
    full = _ep_inputs(routing, world, empty_rank=empty_rank)
    got = spawn_gloo(_ep_backward_rank, world, routing, saved, padded, empty_rank)
    x_all, dy_all = torch.cat(full["x"]), torch.cat(full["dy"])
    want = mr.moe_backward_ref(x_all, full["wr"], full["w13"], full["w2"], dy_all, top_k=2,
                               experts=torch.cat(full["experts"]), **full["kw"])
    part = lambda r, i: torch.from_numpy(got[r][0][i])  # noqa: E731
    dx = torch.cat([part(r, 0) for r in range(world)])
    d_router = sum(part(r, 1) for r in range(world))
    dw13 = torch.cat([part(r, 2) for r in range(world)])
    dw2 = torch.cat([part(r, 3) for r in range(world)])
    for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), (dx, d_router, dw13, dw2), want):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 2e-2, (name, rel)
    without_rows = slice(4, 8) if empty_rank else slice(3, 4)
    assert not dw13[without_rows].any() and not dw2[without_rows].any()
    assert all(got[r][1] for r in range(world))  # bitwise the same twice
    assert all(got[r][2] for r in range(world))  # one_launch=True refused at W = 2 on the CPU; fixed, multi-launch


@pytest.mark.gpu
@pytest.mark.slow
def test_moe_backward_on_the_forwards_gate_up_gpu():
    """moe_forward(save_gu=True) on the GPU: y unchanged by saving; g | u in the backward's order against torch's
    GEMM1 recompute; moe_backward_w1 on it against the fp32 reference (and the recompute path); a second forward
    (other atomics, other row placement) gives bitwise the same gradients."""
    import kosmos
    from kosmos.reference import moe as mr
    from kosmos.ops.moe_backward.api import _expert_gemm1, moe_backward_w1
    g = torch.Generator().manual_seed(31)
    t, h, f, e, k = 777, 256, 192, 16, 4  # F = 192: g's second column tile overhangs into u's columns
    dev = "cuda"
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    wr = (torch.randn(e, h, generator=g) * 0.5).to(torch.bfloat16).to(dev)
    w13 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).to(torch.bfloat16).to(dev)
    w2 = (torch.randn(e, f, h, generator=g) / f ** 0.5).to(torch.bfloat16).to(dev)
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16).to(dev)
    y, weights, experts, saved = kosmos.moe_forward(x, wr, w13, w2, top_k=k, return_routing=True, save_gu=True)
    y_plain, w_plain, e_plain = kosmos.moe_forward(x, wr, w13, w2, top_k=k, return_routing=True)
    assert torch.equal(y, y_plain) and torch.equal(experts, e_plain)
    flat = experts.reshape(-1)
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=e)
    gu = saved.in_backward_order(counts, t * k)
    want = _expert_gemm1(x[order // k].contiguous(), w13, counts)
    assert not torch.isnan(gu).any()
    assert ((gu.float() - want.float()).norm() / want.float().norm()).item() < 5e-3
    got = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved)
    recomputed = moe_backward_w1(x, wr, w13, w2, dy, weights, experts)
    ref = mr.moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=experts)
    for name, a, b, r in zip(("dx", "d_router", "dw13", "dw2"), got, recomputed, ref):
        assert ((a.float() - r.float()).norm() / r.float().norm()).item() < 2e-2, name
        assert ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-2, name
    _, w_again, e_again, saved_again = kosmos.moe_forward(x, wr, w13, w2, top_k=k, return_routing=True, save_gu=True)
    again = moe_backward_w1(x, wr, w13, w2, dy, w_again, e_again, saved_gu=saved_again)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


@pytest.mark.parametrize("n_experts", [1, 5, 64])
def test_expert_counts_equals_bincount(n_experts):
    """expert_counts (a sync-free scatter-add) counts exactly what torch.bincount does, empty experts included."""
    from kosmos.ops.moe_backward.layout import expert_counts
    g = torch.Generator().manual_seed(n_experts)
    flat = torch.randint(0, max(1, n_experts - 1), (3, 7), generator=g)  # the last expert never drawn
    got = expert_counts(flat, n_experts)
    assert got.dtype == torch.int64 and torch.equal(got, torch.bincount(flat.reshape(-1), minlength=n_experts))
    assert torch.equal(expert_counts(flat[:0], n_experts), torch.zeros(n_experts, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.parametrize("saved,one_launch", [(False, False), (True, False), (False, True)])
def test_moe_backward_w1_never_syncs_gpu(saved, one_launch):
    """The W = 1 backward enqueues everything without waiting for the GPU (a host sync there would stall the
    training loop's run-ahead and cost the backward's host time in the GPU's idle gaps): no synchronising call
    under torch.cuda.set_sync_debug_mode("error"), on the forward's g | u and on the recompute, and in the one
    launch with the router backward inside it."""
    import kosmos
    from kosmos.ops.moe_backward.api import moe_backward_w1
    g = torch.Generator().manual_seed(5)
    t, h, f, e, k = 300, 256, 128, 16, 4
    x = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
    wr = (torch.randn(e, h, generator=g) * 0.5).to(torch.bfloat16).cuda()
    w13 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, f, h, generator=g) / f ** 0.5).to(torch.bfloat16).cuda()
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
    out = kosmos.moe_forward(x, wr, w13, w2, top_k=k, return_routing=True, save_gu=saved)
    weights, experts, saved_gu = out[1], out[2], (out[3] if saved else None)
    moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved_gu, one_launch=one_launch)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grads = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved_gu, one_launch=one_launch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.isfinite(t_.float()).all() for t_ in grads)


def _gpu_skewed_layer(t, h, f, e, k, saved, *, push, pull):
    """A CUDA layer (x, router, w13, w2, dy) and the kosmos forward's routing on it, skewed through one feature
    every token has (x[:, 0] = 4): router column 0 pushes expert 3 out (``push``: it must never be chosen, checked)
    and pulls expert 0 in (``pull``). Returns the layer, dy, weights, experts and the saved g | u (or None)."""
    import kosmos
    g = torch.Generator().manual_seed(8)
    x = torch.randn(t, h, generator=g)
    x[:, 0] = 4.0
    x = x.to(torch.bfloat16).cuda()
    wr = torch.randn(e, h, generator=g) * 0.5
    wr[3, 0], wr[0, 0] = push, pull
    wr = wr.to(torch.bfloat16).cuda()
    w13 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).to(torch.bfloat16).cuda()
    w2 = (torch.randn(e, f, h, generator=g) / f ** 0.5).to(torch.bfloat16).cuda()
    dy = torch.randn(t, h, generator=g).to(torch.bfloat16).cuda()
    out = kosmos.moe_forward(x, wr, w13, w2, top_k=k, return_routing=True, save_gu=saved)
    weights, experts, saved_gu = out[1], out[2], (out[3] if saved else None)
    assert not (experts == 3).any()
    return x, wr, w13, w2, dy, weights, experts, saved_gu


@pytest.mark.gpu
@pytest.mark.parametrize("saved", [False, True])
def test_moe_backward_padded_rows_bitwise_packed_gpu(no_tf32, saved):
    """On the GPU: the padded layout's backward (the default) gives bitwise the packed layout's gradients, on a
    skewed routing with an empty expert and T not a multiple of any tile, bf16 and fp32 weight gradients."""
    from kosmos.ops.moe_backward.api import moe_backward_w1
    # expert 3's logit ~ -40 +- 8: never among the top k; expert 0: most tokens
    x, wr, w13, w2, dy, weights, experts, saved_gu = _gpu_skewed_layer(1001, 256, 192, 16, 4, saved, push=-10.0,
                                                                       pull=1.0)
    for wdt in (None, torch.float32):
        packed = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved_gu, padded=False,
                                 wgrad_dtype=wdt)
        padded = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved_gu, padded=True,
                                 wgrad_dtype=wdt, one_launch=False)
        for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), padded, packed):
            assert torch.isfinite(a.float()).all() and torch.equal(a, b), (name, wdt)


@pytest.mark.gpu
def test_router_gemms_on_tensor_cores_are_fp32_level_gpu():
    """The router's GEMMs of moe_backward on bf16 tensor cores (bf16_mm_fp32: bf16 values, fp32 accumulation;
    router_gemm_backward: fp32 dl split into hi + lo bf16) against fp64: fp32-level, far below bf16's 4e-3
    (session 12 call c, H200: the logits at K = 2048 2.1e-6 -- the tensor cores' fp32 accumulation is not
    IEEE's round-to-nearest at each add -- hence 1e-5; the hi + lo products 5e-5)."""
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(4096, 2048, generator=g, device="cuda").to(torch.bfloat16)
    wr = (torch.randn(64, 2048, generator=g, device="cuda") / 45).to(torch.bfloat16)
    dl = torch.randn(4096, 64, generator=g, device="cuda") * 1e-3
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()  # noqa: E731
    ref_logits = x.double() @ wr.double().t()
    ref_dwr, ref_dx = dl.double().t() @ x.double(), dl.double() @ wr.double()
    logits = bwd_api.bf16_mm_fp32(x, wr.t())
    d_router, dx_r = bwd_api.router_gemm_backward(dl, x, wr)
    assert logits.dtype == d_router.dtype == dx_r.dtype == torch.float32
    errs = dict(logits=rel(logits, ref_logits), d_router=rel(d_router, ref_dwr), dx_r=rel(dx_r, ref_dx))
    print("router GEMM errors vs fp64:", errs)
    assert errs["logits"] < 1e-5 and errs["d_router"] < 5e-5 and errs["dx_r"] < 5e-5, errs


def test_router_gemms_cpu_are_the_fp32_reference():
    """Off CUDA the router GEMMs are the fp32 reference's formulas (moe_reference.router_gemm_backward_ref)."""
    from kosmos.reference.moe import router_gemm_backward_ref
    g = torch.Generator().manual_seed(6)
    x = torch.randn(32, 16, generator=g).to(torch.bfloat16)
    wr = torch.randn(8, 16, generator=g).to(torch.bfloat16)
    dl = torch.randn(32, 8, generator=g)
    assert torch.equal(bwd_api.bf16_mm_fp32(x, wr.t()), x.float() @ wr.float().t())
    want = router_gemm_backward_ref(dl, x.float(), wr.float())
    got = bwd_api.router_gemm_backward(dl, x, wr)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


# ------------------------------------------------------------------ the expert part in one launch (W = 1)
def _poisoned_empty(real_empty):
    """torch.empty whose floating tensors come back NaN (integers: their largest value, bool: True): an output
    element the one launch leaves unwritten (or a gap row it reads as data) shows in the gradients."""
    def empty(*shape, **kw):
        t = real_empty(*shape, **kw)
        if t.is_floating_point():
            return t.fill_(float("nan"))
        return t.fill_(True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)
    return empty


def _one_launch_case(case, seed=12):
    """(layer tensors, weights, experts, routing kwargs) of an interpreter case: ``skewed`` -- expert 0 in every token
    (45 rows: three of the interpreter's 16-row m-tiles), expert 3 in none, T = 45; ``one-expert`` -- top-1, every
    token to expert 2 of 4 (37 rows; three experts without rows); ``sigmoid`` -- sigmoid-grouped routing with a
    routed scaling, top-4 of 7 distinct experts (expert 5 in none; 4 slots: the dispatch backward's slot order
    shows in fp32), T = 19."""
    from kosmos.reference import moe as mr
    g = torch.Generator().manual_seed(seed)
    if case == "skewed":
        t, h, f, e, k = 45, 32, 16, 6, 2
        x, wr, w13, w2, dy = _moe_layer(g, t, h, f, e)
        others = torch.tensor([1, 2, 4, 5])[torch.randint(0, 4, (t,), generator=g)]
        experts = torch.stack([torch.zeros(t, dtype=torch.long), others], 1)
        kw = dict(routing="softmax")
    elif case == "one-expert":
        t, h, f, e = 37, 48, 24, 4
        x, wr, w13, w2, dy = _moe_layer(g, t, h, f, e)
        experts = torch.full((t, 1), 2, dtype=torch.long)
        kw = dict(routing="softmax")
    else:
        t, h, f, e, k = 19, 32, 24, 8, 4
        x, wr, w13, w2, dy = _moe_layer(g, t, h, f, e)
        allowed = torch.tensor([0, 1, 2, 3, 4, 6, 7])
        experts = allowed[torch.stack([torch.randperm(7, generator=g)[:k] for _ in range(t)])]
        kw = dict(routing="sigmoid-grouped", routed_scaling=2.5)
    weights, _, _ = mr.routing_weights_ref(x.float() @ wr.float().t(), experts, kw["routing"],
                                           routed_scaling=kw.get("routed_scaling", 1.0))
    return (x, wr, w13, w2, dy), weights, experts, kw


@pytest.mark.interpreter
@pytest.mark.parametrize("case,programs,saved,wgrad_dtype,on_completion", [
    ("skewed", 3, False, None, True), ("skewed", 2, True, None, False), ("one-expert", 4, False, None, True),
    ("one-expert", 2, False, None, False), ("sigmoid", 2, False, None, True),
    ("sigmoid", 4, True, torch.float32, False)])
def test_moe_backward_one_launch_bitwise_default(case, programs, saved, wgrad_dtype, on_completion, monkeypatch):
    """moe_backward_w1(one_launch=True) -- dgrad2, the SwiGLU backward, dgrad1, both flat wgrad loops and the
    dispatch backward as stages of one persistent launch of 2-4 programs -- gives bitwise the default multi-launch
    path's dx, d_router, dw13 and dw2, with every buffer the launch allocates poisoned (NaN / the largest integer):
    an empty expert, one expert with all tokens, T not a multiple of any tile, softmax and sigmoid-grouped
    routing, the recomputed and a saved g | u, bf16 and fp32 weight gradients, SWIGLU run by each m-tile's last
    dgrad2 tile or as its own queue (MoEBackwardConfig.swiglu_on_completion); deterministic. The router backward after the
    launch (router_in_launch=False); inside it: test_moe_backward_one_launch_router_in_launch."""
    from simranks import placed_gate_up
    layer, weights, experts, kw = _one_launch_case(case)
    saved_gu = placed_gate_up(layer[0], layer[2], experts, experts.shape[1],
                              torch.Generator().manual_seed(1)) if saved else None
    kw.update(saved_gu=saved_gu, wgrad_dtype=wgrad_dtype,
              config=MoEBackwardConfig(swiglu_on_completion=on_completion))
    want = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=False, **kw)  # the multi-launch path
    calls = []
    real = bwd_one.expert_backward_one_launch

    def poisoned(*a, **k):
        calls.append(k.get("programs"))
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", _poisoned_empty(torch.empty))
            return real(*a, **k)

    monkeypatch.setattr(bwd_api, "expert_backward_one_launch", poisoned)
    kw.update(router_in_launch=False)  # the router backward after the launch (torch ops): the multi-launch bits
    got = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, programs=programs, **kw)
    assert calls == [programs]
    for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for e in set(range(layer[2].shape[0])) - set(experts.unique().tolist()):  # experts without rows: zeros
        assert not got[2][e].any() and not got[3][e].any()
    again = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, programs=programs, **kw)
    assert all(torch.equal(a, b) for a, b in zip(again, got))


@pytest.mark.interpreter
def test_moe_backward_one_launch_without_tokens():
    """No tokens at all: nothing to claim in any queue, the flat wgrad stores zeros, dx is empty."""
    from kosmos.ops.moe_backward.api import moe_backward_w1
    x, wr, w13, w2, dy = _moe_layer(torch.Generator().manual_seed(2), 0, 32, 16, 4)
    experts, weights = torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2)
    got = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, one_launch=True, programs=2)
    want = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, one_launch=False)
    assert got[0].shape == (0, 32) and not got[2].any() and not got[3].any()
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.interpreter
@pytest.mark.parametrize("left_out,on_completion,waits_for", [
    ("DGRAD2", False, "the dgrad2 column tiles of expert m-tile 0"),
    ("DGRAD2", True, "the SwiGLU backward of expert m-tile 0"),  # no dgrad2 tile: nobody runs SWIGLU
    ("SWIGLU", False, "the SwiGLU backward of expert m-tile 0"),
    ("SWIGLU", True, "the SwiGLU backward of expert m-tile 0"),
    ("DGRAD1", True, "every dgrad1 tile"),
    # the router stages: ROUTER_DW's (and ROUTER_DX's) wait on every dlogits block; ROUTER_DX's on its token
    # block's dispatch backward
    ("ROUTER_DL", True, "every router dlogits block (the gate gradients through the routing) of the launch"),
    ("UNPERMUTE", True, "the dispatch backward (dx_e) of token block 0")])
def test_moe_backward_one_launch_bounded_waits(left_out, on_completion, waits_for, monkeypatch):
    """A stage left out of the launch (the ``stages`` mask): its consumers' bounded waits time out instead of
    hanging, the first one's record names the op and what it waited for, and the launch still ends (every program
    drains); KosmosTimeoutError on the CPU right after the launch. The router stages' waits too (the router in
    the launch is the default)."""
    from kosmos.core import runtime
    layer, weights, experts, kw = _one_launch_case("skewed")
    kw.update(config=MoEBackwardConfig(swiglu_on_completion=on_completion))
    real = bwd_one.expert_backward_one_launch
    stage = getattr(bwd_layout, f"BWD_{left_out}")
    monkeypatch.setattr(bwd_api, "expert_backward_one_launch", lambda *a, **k: real(
        *a, **k, stages=bwd_layout.BWD_ALL_STAGES & ~(1 << stage), timeout_ns=50_000))
    with pytest.raises(runtime.KosmosTimeoutError) as err:
        bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, programs=3, **kw)
    msg = str(err.value)
    assert msg.startswith("moe_backward: rank 0") and waits_for in msg, msg


def test_moe_backward_one_launch_refuses_the_packed_layout():
    """one_launch=True where it is not built: a one-line ValueError, no silent fallback (W > 1: the two-rank test)."""
    from kosmos.ops.moe_backward.api import moe_backward_w1
    layer, weights, experts, kw = _one_launch_case("skewed")
    with pytest.raises(ValueError, match="padded row layout"):
        moe_backward_w1(*layer, weights, experts, one_launch=True, padded=False, **kw)
    with pytest.raises(ValueError, match="needs the one launch"):  # the router stages without the launch
        moe_backward_w1(*layer, weights, experts, one_launch=False, router_in_launch=True, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("saved", [False, True])
@pytest.mark.parametrize("programs", [None, 7])
def test_moe_backward_one_launch_bitwise_default_gpu(no_tf32, saved, programs, monkeypatch):
    """On the GPU, at the real tiles (dgrad 128x256x64, the flat wgrad's 128x256 / 256x128, 8 warps): the one
    launch (every buffer it allocates poisoned) gives bitwise the default multi-launch path's gradients, on a
    skewed routing with an empty expert, T not a multiple of any tile, bf16 and fp32 weight gradients, on all SMs
    and on 7 programs; twice the same. The router backward after the launch (router_in_launch=False); inside
    it: test_moe_backward_one_launch_router_in_launch_gpu."""
    import kosmos
    from kosmos.ops.moe_backward.api import moe_backward_w1
    # expert 3's logit ~ -160 +- 16 (the other logits ~ 0 +- 16): never among the top 8; expert 0 pulled in
    x, wr, w13, w2, dy, weights, experts, saved_gu = _gpu_skewed_layer(3001, 1024, 768, 32, 8, saved, push=-40.0,
                                                                       pull=4.0)
    real = bwd_one.expert_backward_one_launch

    def poisoned(*a, **kw):
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", _poisoned_empty(torch.empty))
            return real(*a, **kw)

    monkeypatch.setattr(bwd_api, "expert_backward_one_launch", poisoned)
    for wdt in (None, torch.float32):
        want = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved_gu, wgrad_dtype=wdt,
                               one_launch=False)
        got = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved_gu, wgrad_dtype=wdt,
                              one_launch=True, programs=programs, router_in_launch=False)
        again = moe_backward_w1(x, wr, w13, w2, dy, weights, experts, saved_gu=saved_gu, wgrad_dtype=wdt,
                                one_launch=True, programs=programs, router_in_launch=False)
        kosmos.check_errors()
        for name, a, b, c in zip(("dx", "d_router", "dw13", "dw2"), got, want, again):
            assert torch.isfinite(a.float()).all() and torch.equal(a, b) and torch.equal(a, c), (name, wdt)


@pytest.mark.gpu
@pytest.mark.parametrize("on_completion,waits_for", [
    (True, "the SwiGLU backward of expert m-tile"),
    (False, "the dgrad2 column tiles of expert m-tile|the SwiGLU backward of expert m-tile")])
def test_moe_backward_one_launch_bounded_wait_gpu(on_completion, waits_for, monkeypatch):
    """On the GPU: with DGRAD2 left out, the waits on it (the queued SWIGLU's) or on what it would have triggered
    (SWIGLU on completion: DGRAD1's) time out, bounded; the launch ends, and the next check_errors() raises
    KosmosTimeoutError naming the wait; the workspace is reset afterwards. The record is the first timed-out
    wait's: with the SWIGLU queue, WGRAD's wait on every m-tile's SwiGLU (index -1) and DGRAD1's on its m-tile's
    time out at about the same time as the SWIGLU tasks' own waits (session 15's GPU run recorded WGRAD's,
    session 21's DGRAD1's), so any of them is the left-out stage's."""
    import kosmos
    from kosmos.core import runtime
    from kosmos.reference import moe as mr
    g = torch.Generator().manual_seed(14)
    t, h, f, e, k = 301, 256, 192, 8, 2  # GPU-sized, as the other GPU tests' layers
    layer = [t_.cuda() for t_ in _moe_layer(g, t, h, f, e)]
    experts = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    weights, _, _ = mr.routing_weights_ref(layer[0].cpu().float() @ layer[1].cpu().float().t(), experts, "softmax")
    kw = dict(routing="softmax", config=MoEBackwardConfig(swiglu_on_completion=on_completion))
    real = bwd_one.expert_backward_one_launch
    monkeypatch.setattr(bwd_api, "expert_backward_one_launch", lambda *a, **kw_: real(
        *a, **kw_, stages=bwd_layout.BWD_ALL_STAGES & ~(1 << bwd_layout.BWD_DGRAD2), timeout_ns=20_000_000))
    try:
        bwd_api.moe_backward_w1(*layer, weights.cuda(), experts.cuda(), one_launch=True, **kw)
        with pytest.raises(runtime.KosmosTimeoutError, match=waits_for):
            kosmos.check_errors()
    finally:
        kosmos.reset_workspaces()


@pytest.mark.interpreter
@pytest.mark.parametrize("on_completion,router", [(True, True), (False, True), (True, False)])
def test_moe_backward_one_launch_trace_records_every_task_once(on_completion, router, monkeypatch):
    """The trace of the one launch: every DGRAD2, SWIGLU, DGRAD1, UNPERMUTE and (router in the launch) ROUTER_DL,
    ROUTER_DW and ROUTER_DX task exactly once over the programs (the shared heads hand each out once; SWIGLU by
    each m-tile's last dgrad2 tile or from its own queue), one WGRAD2 and one WGRAD1 run per program, the waits
    before the tasks; the gradients unchanged by tracing."""
    from kosmos.core import codes
    layer, weights, experts, kw = _one_launch_case("skewed")
    kw.update(router_in_launch=router, config=MoEBackwardConfig(swiglu_on_completion=on_completion))
    programs = 3
    trace = torch.zeros((programs, codes.TRACE_EVENTS.value, 4), dtype=torch.int64)
    real = bwd_one.expert_backward_one_launch
    monkeypatch.setattr(bwd_api, "expert_backward_one_launch", lambda *a, **k: real(*a, **k, trace=trace))
    got = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, programs=programs, **kw)
    monkeypatch.setattr(bwd_api, "expert_backward_one_launch", real)
    untraced = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, programs=programs, **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, untraced))
    counts = torch.bincount(experts.reshape(-1), minlength=layer[2].shape[0])
    bm = 16  # the interpreter's m-tile (and the router GEMMs' tiles)
    n_mt = int(((counts + bm - 1) // bm).sum())
    t, h, f = layer[0].shape[0], layer[0].shape[1], layer[3].shape[1]
    n_r = layer[1].shape[0]
    want = {codes.EV_BWD_DGRAD2.value: n_mt * -(-f // bm), codes.EV_BWD_SWIGLU.value: n_mt,
            codes.EV_BWD_DGRAD1.value: n_mt * -(-h // bm), codes.EV_BWD_UNPERMUTE.value: -(-t // 2),
            codes.EV_BWD_ROUTER_DL.value: -(-t // 4) if router else 0,  # the interpreter's 4-token blocks
            codes.EV_BWD_ROUTER_DW.value: -(-n_r // bm) * -(-h // bm) if router else 0,
            codes.EV_BWD_ROUTER_DX.value: -(-t // bm) * -(-h // bm) if router else 0}
    ev = trace.view(-1, 4)
    ev = ev[ev[:, 0] != 0]
    for kind, n in want.items():
        assert sorted(ev[ev[:, 0] == kind][:, 1].tolist()) == list(range(n)), codes.TRACE_KINDS[kind]
    for kind in (codes.EV_BWD_WGRAD2.value, codes.EV_BWD_WGRAD1.value):
        assert [int((trace[p, :, 0] == kind).sum()) for p in range(programs)] == [1] * programs
    # a wait before each DGRAD1 task (and each queued SWIGLU task), one before each program's WGRAD (task -1) and
    # (MoEBackwardConfig.wgrad1_sync) its WGRAD1 rendezvous (task -2), one per program in UNPERMUTE, ROUTER_DL and ROUTER_DW, one
    # before each ROUTER_DX task
    waits = ev[ev[:, 0] == codes.EV_WAIT.value][:, 1]
    per_program = sum(int((trace[p, :, 0] == kind.value).any()) for p in range(programs)
                      for kind in (codes.EV_BWD_UNPERMUTE, codes.EV_BWD_ROUTER_DL, codes.EV_BWD_ROUTER_DW))
    rendezvous = programs if MoEBackwardConfig().wgrad1_sync else 0
    assert int((waits == -1).sum()) == programs and int((waits == -2).sum()) == rendezvous
    assert waits.numel() == ((0 if on_completion else n_mt) + n_mt * -(-h // bm) + programs + rendezvous
                             + per_program + want[codes.EV_BWD_ROUTER_DX.value])
    with pytest.raises(ValueError, match="trace must be"):
        bwd_one.expert_backward_one_launch(
            layer[3].new_zeros(64, h), layer[3].new_zeros(64, h), layer[3].new_zeros(64, h),
            layer[3].new_zeros(64, 2 * f), torch.zeros(64), torch.zeros(64, dtype=torch.bool), layer[2], layer[3],
            torch.zeros(layer[2].shape[0], dtype=torch.int32), torch.zeros(layer[2].shape[0], dtype=torch.int32),
            torch.zeros(0, dtype=torch.long), 0, 2, programs=2, trace=torch.zeros(1, dtype=torch.int64))


# --------------------------------------------- the router backward inside the one launch (ROUTER_DL / _DW / _DX)
def _capture_one_launch(monkeypatch, poison=False):
    """Wrap expert_backward_one_launch: each call's pair rows (inv), router inputs and outputs appended to the
    returned list; ``poison``: every buffer the launch allocates starts NaN (_poisoned_empty)."""
    calls = []
    real = bwd_one.expert_backward_one_launch

    def wrapped(*a, **k):
        if poison:
            with monkeypatch.context() as m:
                m.setattr(torch, "empty", _poisoned_empty(torch.empty))
                out = real(*a, **k)
        else:
            out = real(*a, **k)
        calls.append(dict(inv=a[10], router=k.get("router"), out=out))
        return out

    monkeypatch.setattr(bwd_api, "expert_backward_one_launch", wrapped)
    return calls


def _router_ref64(x, wr, logits, experts, dweights, routing, renormalize, c):
    """The router backward in fp64 from the launch's own inputs (its fp32 logits, the gate gradients it summed):
    (d_router [E, H], dx_r [T, H], dl [T, E]) -- moe_reference's formulas, the stage's exact target."""
    from kosmos.reference import moe as mr
    w, full, denom = mr.routing_weights_ref(logits.double(), experts.long(), routing, renormalize=renormalize,
                                            routed_scaling=c)
    dq = mr.router_weights_backward_ref(dweights.double(), w, denom, routed_scaling=c)
    dl = mr.router_logits_backward_ref(dq, full, experts.long(), routing)
    return dl.t() @ x.double(), dl @ wr.double(), dl


def _bf16_ulp(v):
    """One bf16 unit in the last place at |v| (fp64)."""
    _, e = torch.frexp(v.double())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float64), e - 8)


def _check_router_in_launch(layer, weights, experts, kw, programs, other_programs, monkeypatch, *, dr_tol,
                            ref_kw=None):
    """moe_backward_w1(one_launch=True) with the router backward in the launch (the default) against (a) the same
    launch without it (router_in_launch=False: bitwise the multi-launch path, checked) -- dw13 and dw2 bitwise,
    (b) the fp64 router backward on the launch's own logits and gate gradients -- d_router to ``dr_tol`` relative,
    dx within one bf16 ulp of bf16(dx_e + dx_r) everywhere and equal to it almost everywhere (dx_e: the expert
    part's fp32 dispatch backward, from (a)), (c) the multi-launch path's d_router (fp32 torch ops) to dr_tol and
    (ref_kw) moe_reference.moe_backward_ref; every launch buffer poisoned; bitwise the same on ``other_programs``
    programs and on a repeat. Returns (got, fraction of dx's elements the router part moved)."""
    from kosmos.reference import moe as mr
    x, wr = layer[0], layer[1]
    want = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=False, **kw)  # the multi-launch path
    calls = _capture_one_launch(monkeypatch, poison=True)
    off = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, router_in_launch=False, programs=programs,
                             **kw)
    got = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, programs=programs, **kw)
    again = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, programs=other_programs, **kw)
    twice = bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, programs=programs, **kw)
    assert [c["router"] is None for c in calls] == [True, False, False, False]
    for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), off, want):  # the router off: the old bits
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name, a, b, c in zip(("dx", "d_router", "dw13", "dw2"), got, again, twice):
        assert torch.isfinite(a.float()).all() and torch.equal(a, b) and torch.equal(a, c), name
        assert a.dtype == want[("dx", "d_router", "dw13", "dw2").index(name)].dtype, name
    assert torch.equal(got[2], want[2]) and torch.equal(got[3], want[3])
    dx_e = calls[0]["out"][0]
    dx_rows = calls[1]
    router = dx_rows["router"]
    dweights = dx_rows["out"][1][dx_rows["inv"]].view(experts.shape)  # the gate gradients in pair order
    assert torch.equal(dweights, calls[0]["out"][1][calls[0]["inv"]].view(experts.shape))
    dr64, dxr64, dl64 = _router_ref64(x, wr.to(torch.bfloat16), router.logits, router.experts, dweights,
                                      router.routing, router.renormalize, router.routed_scaling)
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    errs = dict(d_router_vs_fp64=rel(got[1], dr64), d_router_vs_multi_launch=rel(got[1], want[1]))
    want_dx = dx_e.double() + dxr64
    off_by = (got[0].double() - want_dx).abs()
    exact = (got[0] == want_dx.float().to(torch.bfloat16)).double().mean().item()
    moved = (got[0] != dx_e.to(torch.bfloat16)).double().mean().item()
    print("router in the launch:", errs, "dx exact", exact, "moved by the router", moved)
    assert errs["d_router_vs_fp64"] < dr_tol and errs["d_router_vs_multi_launch"] < dr_tol, errs
    # one bf16 rounding of the sum, plus dx_r's fp32 error: hi + lo leaves 2^-17 of each |dl| |Wr| term (and the
    # fp32 accumulation a few 2^-24): 2^-15 of sum_e |dl| |Wr| bounds it
    bound = _bf16_ulp(want_dx) + 2.0 ** -15 * (dl64.abs() @ wr.double().abs()) + 2.0 ** -22 * dx_e.double().abs()
    assert bool((off_by <= bound).all()) and exact > 0.99, ((off_by / bound).max().item(), exact)
    if ref_kw is not None:
        ref = mr.moe_backward_ref(*layer, top_k=experts.shape[1], experts=experts, **ref_kw)
        for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), got, ref):
            assert rel(a, b) < 2e-2, (name, rel(a, b))
    return got, moved


def _router_case(case, seed=21):
    """Interpreter cases of the router backward in the launch: (layer, weights, experts, moe_backward kwargs,
    moe_backward_ref kwargs). ``softmax-skewed``: _one_launch_case's skewed layer (T = 45, an empty expert);
    ``softmax-top1-plain``: every token to expert 2 of 4, top-1, no renormalisation, routed scaling 1.5 (with
    renormalisation top-1 has no router gradient at all); ``sigmoid-bias``: DeepSeek-V3's router -- the decision of
    mr.route with a bias, 4 groups, 2 kept, top-4 of 8, routed scaling 2.5 (T = 23); ``sigmoid-plain``: the same
    without renormalisation."""
    from kosmos.reference import moe as mr
    if case == "softmax-skewed":
        layer, weights, experts, kw = _one_launch_case("skewed")
        return layer, weights, experts, kw, dict(routing="softmax")
    g = torch.Generator().manual_seed(seed)
    if case == "softmax-top1-plain":
        layer, _, experts, _ = _one_launch_case("one-expert")
        kw = dict(routing="softmax", renormalize=False, routed_scaling=1.5)
        weights, _, _ = mr.routing_weights_ref(layer[0].float() @ layer[1].float().t(), experts, "softmax",
                                               renormalize=False, routed_scaling=1.5)
        return layer, weights, experts, kw, dict(kw)
    t, h, f, e, k = 23, 32, 24, 8, 4
    layer = _moe_layer(g, t, h, f, e)
    renorm = case == "sigmoid-bias"
    bias = torch.randn(e, generator=g) * 0.5
    route_kw = dict(routing="sigmoid-grouped", renormalize=renorm, bias=bias, n_group=4, topk_group=2,
                    routed_scaling=2.5)
    weights, experts = mr.route(layer[0], layer[1], k, **route_kw)
    kw = dict(routing="sigmoid-grouped", renormalize=renorm, routed_scaling=2.5)
    return layer, weights, experts, kw, route_kw


@pytest.mark.interpreter
@pytest.mark.parametrize("case,programs,other", [("softmax-skewed", 3, 2), ("softmax-top1-plain", 2, 4),
                                                 ("sigmoid-bias", 4, 3), ("sigmoid-plain", 2, 3)])
def test_moe_backward_one_launch_router_in_launch(case, programs, other, monkeypatch):
    """The router backward as stages of the one launch (ROUTER_DL: the gate gradients through softmax top-k with
    or without renormalisation or through DeepSeek-V3's sigmoid group-limited top-k with a bias and a routed
    scaling, dl split hi | lo; ROUTER_DW: dWr = dl^T x; ROUTER_DX: dx = bf16(dx_e + dl Wr)): fp32-level against the
    fp64 router backward and the multi-launch path, dx rounded once, the expert gradients bitwise unchanged,
    bitwise the same on another program count and on a repeat, with every launch buffer poisoned; skewed routing
    with an empty expert, T not a multiple of any tile (45, 37, 23 tokens; the interpreter's 16-token tiles and
    4-token dlogits blocks)."""
    layer, weights, experts, kw, ref_kw = _router_case(case)
    got, moved = _check_router_in_launch(layer, weights, experts, kw, programs, other, monkeypatch, dr_tol=1e-5,
                                         ref_kw=ref_kw)
    assert moved > 0.05, moved  # the router's part is visible in dx: a wrong dx_r could not pass
    assert got[1].abs().sum() > 0


def _gpu_router_case(case):
    """GPU layers at real router shapes: ``deepseek-v3`` -- H 7168, E 256, top-8, sigmoid-grouped with a bias (8
    groups, 4 kept), routed scaling 2.5, renormalised, 512 tokens (expert FFN 256: the expert part small);
    ``qwen3`` -- H 4096, E 128, top-8 softmax renormalised, 1000 tokens (not a multiple of any tile), FFN 192;
    ``softmax-plain`` -- H 1024, E 60 (not a multiple of 8: dl's halves padded to 64 columns), top-4 softmax
    without renormalisation, routed scaling 1.5, 777 tokens. The decision by moe_reference.route (fp32 logits)."""
    from kosmos.reference import moe as mr
    t, h, f, e, k, route_kw = {
        "deepseek-v3": (512, 7168, 256, 256, 8, dict(routing="sigmoid-grouped", n_group=8, topk_group=4,
                                                     routed_scaling=2.5)),
        "qwen3": (1000, 4096, 192, 128, 8, dict(routing="softmax")),
        "softmax-plain": (777, 1024, 128, 60, 4, dict(routing="softmax", renormalize=False, routed_scaling=1.5)),
    }[case]
    g = torch.Generator(device="cuda").manual_seed(41)
    x = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
    wr = (torch.randn(e, h, generator=g, device="cuda") / h ** 0.5).to(torch.bfloat16)
    w13 = (torch.randn(e, h, 2 * f, generator=g, device="cuda") / h ** 0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, f, h, generator=g, device="cuda") / f ** 0.5).to(torch.bfloat16)
    dy = torch.randn(t, h, generator=g, device="cuda").to(torch.bfloat16)
    if route_kw["routing"] == "sigmoid-grouped":
        route_kw["bias"] = torch.randn(e, generator=g, device="cuda") * 0.1
    weights, experts = mr.route(x, wr, k, **route_kw)
    kw = {kk: v for kk, v in route_kw.items() if kk in ("routing", "renormalize", "routed_scaling")}
    return (x, wr, w13, w2, dy), weights, experts, kw


@pytest.mark.gpu
@pytest.mark.parametrize("case", [pytest.param("deepseek-v3", marks=pytest.mark.slow),
                                  pytest.param("qwen3", marks=pytest.mark.slow), "softmax-plain"])
def test_moe_backward_one_launch_router_in_launch_gpu(no_tf32, case, monkeypatch):
    """On the GPU at real router shapes, at the real tiles (dlogits blocks of 8 tokens, dx_r 128x128x64 and dWr
    128x128x64 on tensor cores, 8 warps): the router backward in the one launch against the fp64 router backward
    on the launch's own logits and gate gradients (d_router to 5e-5: bf16 hi + lo products, fp32 accumulation;
    dx within one bf16 ulp of bf16(dx_e + dx_r), equal almost everywhere) and the multi-launch path's (cuBLAS hi /
    lo GEMMs); dw13 and dw2 bitwise the multi-launch path's; bitwise the same on all SMs and on 7 programs and on a
    repeat, every launch buffer poisoned."""
    import kosmos
    layer, weights, experts, kw = _gpu_router_case(case)
    got, moved = _check_router_in_launch(layer, weights, experts, kw, None, 7, monkeypatch, dr_tol=5e-5)
    kosmos.check_errors()
    assert moved > 0.01, moved


@pytest.mark.gpu
def test_moe_backward_one_launch_router_bounded_wait_gpu(monkeypatch):
    """On the GPU: with ROUTER_DL left out, ROUTER_DW's and ROUTER_DX's waits on every dlogits block time out
    (bounded), the launch ends, and the next check_errors() raises KosmosTimeoutError naming that wait; the
    workspace is reset afterwards."""
    import kosmos
    from kosmos.core import runtime
    layer, weights, experts, kw = _gpu_router_case("softmax-plain")
    real = bwd_one.expert_backward_one_launch
    monkeypatch.setattr(bwd_api, "expert_backward_one_launch", lambda *a, **kw_: real(
        *a, **kw_, stages=bwd_layout.BWD_ALL_STAGES & ~(1 << bwd_layout.BWD_ROUTER_DL), timeout_ns=20_000_000))
    try:
        bwd_api.moe_backward_w1(*layer, weights, experts, one_launch=True, **kw)
        with pytest.raises(runtime.KosmosTimeoutError, match="every router dlogits block"):
            kosmos.check_errors()
    finally:
        kosmos.reset_workspaces()


# ------------------------------------------------- the one launch at W > 1 (simulated ranks: simranks.MoEBwdRanks)
def _rel(a, b):
    a, b = a.double().cpu(), b.double().cpu()  # the reference lives on the CPU
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check_ep_vs_reference(m, tol=2e-2):
    """Every rank's launch error-free and clean (scratch and counters zero, done flags at the epoch), and its
    gradients against moe_reference.moe_backward_ref over all ranks' tokens: dx per rank, d_router summed over
    the ranks, dw13 / dw2 per rank (an expert without rows: exactly zero). Returns the gradients."""
    from kosmos.core import runtime
    epoch = int(m.epochs[0].item())
    for r in range(m.world):
        assert m.errors[r].abs().sum() == 0, f"rank {r}: {runtime.decode_error(m.errors[r].tolist())}"
        assert m.local[r]["scratch"].abs().sum() == 0 and m.ctr[r].abs().sum() == 0, f"rank {r}: not reset"
        assert m.sig[r][runtime.DONE_BASE:runtime.DONE_BASE + m.world].tolist() == [epoch] * m.world
    got, _ = m.gradients()
    dx, dr, dw13, dw2 = m.reference()
    for r in range(m.world):
        assert torch.isfinite(got[r][0].float()).all(), f"rank {r}: dx not finite"
        for name, a, b in (("dx", got[r][0], dx[r]), ("dw13", got[r][2], dw13[r]), ("dw2", got[r][3], dw2[r])):
            if b.abs().sum() == 0:
                assert not a.float().any(), (r, name, "an expert without rows: zeros")
            else:
                assert _rel(a, b) < tol, (r, name, _rel(a, b))
        for e in range(m.el):  # experts without rows from any rank: exact zeros
            if not any(bool((ex == r * m.el + e).any()) for ex in m.experts):
                assert not got[r][2][e].float().any() and not got[r][3][e].float().any(), (r, e)
    if m.router:
        assert _rel(sum(g[1] for g in got), dr) < tol, _rel(sum(g[1] for g in got), dr)
    return got


EP_CASES = {  # (world, tokens, hidden, ffn, experts, top_k, kwargs): T = 13 / 11 is no multiple of any tile
    "w2-random": (2, 13, 32, 24, 8, 2, dict(routing="softmax")),
    "w2-skewed": (2, 13, 32, 24, 8, 2, dict(routing="softmax", skew=True)),  # rank 1's experts: no rows
    "w2-empty-expert-sigmoid": (2, 11, 32, 24, 8, 4, dict(routing="sigmoid-grouped", empty_expert=5)),
    "w4-random": (4, 13, 32, 24, 8, 2, dict(routing="softmax")),
    "w8-random": (8, 13, 32, 24, 16, 2, dict(routing="softmax")),  # two experts per rank
}


@pytest.mark.interpreter
@pytest.mark.parametrize("case", list(EP_CASES))
def test_moe_backward_one_launch_ep_vs_reference(case):
    """The one launch at W > 1 (COMBINE-BWD, PERMUTE-BWD, GU, the expert part, DISPATCH-BWD, UNPERMUTE, the router
    stages; the interpreter's three phases per call, every rank's launch of a phase before the next phase) against
    the fp32 reference of the whole layer: dx, d_router, dw13, dw2 at W = 2, 4 and 8 on random and skewed routing
    (all tokens to rank 0's experts), an expert without rows, T not a multiple of any tile, softmax and
    sigmoid-grouped routing, every local buffer and the symmetric bytes poisoned; a second call (the next epoch,
    re-poisoned) bitwise the same, with the scratch, counters and done flags clean after each."""
    from simranks import MoEBwdRanks
    world, t, h, f, e, k, kw = EP_CASES[case]
    m = MoEBwdRanks(world, t, h, f, e, k, seed=31 + world, **kw)
    m.call(1)
    first = [tuple(x.clone() for x in g if x is not None) for g in _check_ep_vs_reference(m)]
    m.poison()
    m.call(2)
    again = _check_ep_vs_reference(m)
    for r in range(world):
        assert all(torch.equal(a, b) for a, b in zip(first[r], [x for x in again[r] if x is not None])), r


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["w2-random", "w2-empty-expert-sigmoid"])
def test_moe_backward_one_launch_ep_reads_transformers_layout(case):
    """The one launch at W = 2 on transformers' expert layout: against the fp32 reference, the weight gradients
    in the weights' layout, and the same gradients as on the kernels' own layout to the rounding of a summation
    order."""
    from kosmos.ops.moe_forward import weights_nk
    from simranks import MoEBwdRanks
    world, t, h, f, e, k, kw = EP_CASES[case]
    grads = []
    for nk in (False, True):
        m = MoEBwdRanks(world, t, h, f, e, k, seed=31 + world, nk=nk, **kw)
        m.call(1)
        grads.append(_check_ep_vs_reference(m))
    for r in range(world):
        assert weights_nk(grads[1][r][2]) and weights_nk(grads[1][r][3])
        for a, b in zip(grads[1][r], grads[0][r]):
            if b is not None and b.float().any():
                assert _rel(a, b) < 1e-3, r


def _ep_multi_launch_rank(rank, world, port, q, case):
    """One rank of the multi-launch path (moe_backward over gloo, all-to-alls between the kernels) on
    MoEBwdRanks' inputs of ``case``; the router backward in torch (both with and without the launch's router)."""
    import os
    import torch.distributed as dist
    from kosmos.ops.moe_backward.api import moe_backward
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from simranks import MoEBwdRanks
        w_, t, h, f, e, k, kw = EP_CASES[case]
        m = MoEBwdRanks(world, t, h, f, e, k, seed=31 + world, **kw)
        got = moe_backward(m.xs[rank], m.wr, m.w13[rank], m.w2[rank], m.dys[rank], m.weights[rank], m.experts[rank],
                           group=dist.group.WORLD, **m.rkw)
        q.put((rank, [g.float().numpy() for g in got]))
    finally:
        from multiproc import finish_gloo
        finish_gloo()


@pytest.mark.interpreter
@pytest.mark.parametrize("case", ["w2-random", "w2-empty-expert-sigmoid"])
def test_moe_backward_one_launch_ep_vs_multi_launch(case):
    """The one launch at W = 2 against the multi-launch path at W = 2 (moe_backward over gloo): the same rows in the
    same order per expert ((source rank, pair) -- the one launch places them by the sources' prefix counts, the
    multi-launch path by its stable sorts), so dw13 and dw2 agree to rounding (g | u recomputed by the launch's
    own GEMM1 tile vs torch's: the bf16 roundings of g | u may differ by an ulp) -- and dx, d_router likewise."""
    from multiproc import spawn_gloo
    from simranks import MoEBwdRanks
    world, t, h, f, e, k, kw = EP_CASES[case]
    multi = spawn_gloo(_ep_multi_launch_rank, world, case)
    m = MoEBwdRanks(world, t, h, f, e, k, seed=31 + world, **kw)
    m.call(1)
    got = _check_ep_vs_reference(m)
    d_router = sum(torch.from_numpy(multi[r][1]) for r in range(world))
    assert _rel(sum(g[1] for g in got), d_router) < 5e-3
    for r in range(world):
        for i, name in ((0, "dx"), (2, "dw13"), (3, "dw2")):
            want = torch.from_numpy(multi[r][i])
            if want.abs().sum() == 0:
                assert not got[r][i].float().any(), (r, name)
            else:
                assert _rel(got[r][i], want) < 5e-3, (r, name, _rel(got[r][i], want))


@pytest.mark.interpreter
def test_moe_backward_one_launch_ep_without_router_gives_dx_e_and_gate_gradients():
    """router=False: the launch returns the dispatch backward's fp32 dx_e and the pairs' gate gradients (the
    torch router backward's inputs): dx_e + the router part (moe_backward's torch ops) matches the reference."""
    from kosmos.reference import moe as mr
    from simranks import MoEBwdRanks
    m = MoEBwdRanks(2, 13, 32, 24, 8, 2, seed=33, router=False)
    m.call(1)
    got, dws = m.gradients()
    ref_dx = m.reference()[0]
    for r in range(2):
        logits = bwd_api.bf16_mm_fp32(m.xs[r], m.wr.t())
        w_re, full, denom = mr.routing_weights_ref(logits, m.experts[r], "softmax")
        dq = mr.router_weights_backward_ref(dws[r], w_re, denom)
        dl = mr.router_logits_backward_ref(dq, full, m.experts[r], "softmax")
        _, dx_r = bwd_api.router_gemm_backward(dl, m.xs[r], m.wr)
        assert got[r][0].dtype == torch.float32 and _rel(got[r][0] + dx_r, ref_dx[r]) < 2e-2


@pytest.mark.interpreter
@pytest.mark.parametrize("stall,waits_for", [
    ("rank", "rank 1's output-gradient rows, gate weights and counts"),   # rank 1's launches never run
    ("DISPATCH", "the expert rows' dx and gate gradients of token block 0"),  # the rows never come back
    ("PERMUTE", "the received rows of local expert 0 to be placed"),
    ("GU", "the recomputed g | u (GEMM1) column tiles of expert m-tile 0"),
])
def test_moe_backward_one_launch_ep_stalled_peer_times_out(stall, waits_for):
    """A stalled peer (rank 1's launches not run) or a stage left out of every rank's launches: the waits on it
    time out (bounded), the first record names what was awaited, and every launch still ends -- rank 0's scratch
    is reset and its epoch advanced; never a hang."""
    from kosmos.core import runtime
    from simranks import MoEBwdRanks
    m = MoEBwdRanks(2, 13, 32, 24, 8, 2, seed=35, timeout_ns=50_000)
    if stall == "rank":
        m.call(1, skip=(1,))
    else:
        m.call(1, leave_out=getattr(bwd_layout, f"BWD_{stall}"))
    err = m.errors[0].tolist()
    assert err[0] != 0, "no timeout recorded"
    msg = runtime.decode_error(err)
    assert msg.startswith("moe_backward: rank 0") and waits_for in msg, msg
    assert m.local[0]["scratch"].abs().sum() == 0 and int(m.epochs[0].item()) == 1


def test_moe_backward_one_launch_ep_layout_refuses_other_shapes():
    """expert_backward_ep_launch on buffers made for another shape: a one-line ValueError before any launch."""
    from simranks import MoEBwdRanks
    m = MoEBwdRanks(2, 13, 32, 24, 8, 2, seed=1)
    b = m.bufs(0)
    with pytest.raises(ValueError, match="another shape"):
        bwd_one.expert_backward_ep_launch(m.xs[0][:7], m.dys[0][:7], m.weights[0][:7], m.experts[0][:7], m.w13[0],
                                     m.w2[0], b, rank=0, world=2, epoch_slot=m.epochs[0], timeout_ns=10**6, grid=2)


FIXED_CASES = [("w2-random", 1), ("w2-random", 2), ("w2-empty-expert-sigmoid", 1), ("w4-random", 2)]


@pytest.mark.interpreter
@pytest.mark.parametrize("case,comm_programs", FIXED_CASES)
def test_moe_backward_one_launch_ep_fixed_policy_bitwise_self(case, comm_programs):
    """The fixed-role ablation of the one launch at W > 1 (policy "fixed", comm_programs=S of the interpreter's 3
    programs: S = 1 -- one communication program, two compute --, S = 2 -- the other way round): every rank's
    launch clean and against the fp32 reference as the self policy's, and its gradients bitwise the self policy's
    (the same tile arithmetic and row order; only which program runs a task changes), two calls. Phases: the
    fixed policy's four (EP_PHASES_FIXED: DISPATCH-BWD alone, after the compute programs' DGRAD1)."""
    from simranks import MoEBwdRanks
    world, t, h, f, e, k, kw = EP_CASES[case]
    want = MoEBwdRanks(world, t, h, f, e, k, seed=31 + world, **kw)
    want.call(1)
    want = [tuple(x.clone() for x in g if x is not None) for g in _check_ep_vs_reference(want)]
    m = MoEBwdRanks(world, t, h, f, e, k, seed=31 + world, policy="fixed", comm_programs=comm_programs, **kw)
    for epoch in (1, 2):
        m.poison()
        m.call(epoch)
        got = _check_ep_vs_reference(m)
        for r in range(world):
            got_r = [x for x in got[r] if x is not None]
            assert all(torch.equal(a, b) for a, b in zip(want[r], got_r)), (epoch, r)


@pytest.mark.interpreter
def test_moe_backward_one_launch_ep_fixed_policy_without_router():
    """The fixed policy without the router in the launch (dx_e and the gate gradients out; the router stages off):
    bitwise the self policy's."""
    from simranks import MoEBwdRanks
    got = []
    for pol in (dict(), dict(policy="fixed", comm_programs=1)):
        m = MoEBwdRanks(2, 13, 32, 24, 8, 2, seed=33, router=False, **pol)
        m.call(1)
        grads, dws = m.gradients()
        got.append([(g[0], g[2], g[3], dw) for g, dw in zip(grads, dws)])
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(got[0][r], got[1][r])), r


@pytest.mark.parametrize("policy,comm_programs,match", [
    ("fixed", None, "comm_programs"), ("fixed", 0, "comm_programs"), ("fixed", 3, "comm_programs"),
    ("both", 1, "unknown policy")])
def test_moe_backward_one_launch_ep_fixed_policy_refuses_bad_splits(policy, comm_programs, match):
    """expert_backward_ep_launch(policy="fixed") needs 1 <= S < grid (S = 0 leaves COMBINE-BWD to no one, S = grid
    the GEMMs): a one-line ValueError before any launch; an unknown policy likewise; and at W = 1 (no
    communication)."""
    from simranks import MoEBwdRanks
    m = MoEBwdRanks(2, 13, 32, 24, 8, 2, seed=1)
    a = (m.xs[0], m.dys[0], m.weights[0], m.experts[0], m.w13[0], m.w2[0], m.bufs(0))
    with pytest.raises(ValueError, match=match):
        bwd_one.expert_backward_ep_launch(*a, rank=0, world=2, epoch_slot=m.epochs[0], timeout_ns=10**6, grid=3,
                                     policy=policy, comm_programs=comm_programs)
    with pytest.raises(ValueError, match="no communication at world size 1"):
        bwd_one.expert_backward_ep_launch(*a, rank=0, world=1, epoch_slot=m.epochs[0], timeout_ns=10**6, grid=3,
                                     policy="fixed", comm_programs=1)
    assert m.errors[0].abs().sum() == 0 and m.local[0]["scratch"].abs().sum() == 0  # nothing ran


@pytest.mark.parametrize("one_launch", [True, False, None])
def test_moe_backward_fixed_policy_refused_at_w1_and_multi_launch(one_launch):
    """moe_backward(policy="fixed") is the one launch's ablation at W > 1: at W = 1 (no communication) a one-line
    ValueError before anything runs, whatever one_launch says (the multi-launch refusal at W > 1: the gloo
    ranks of test_moe_backward_over_two_ranks_vs_reference); an unknown policy too."""
    match = "no communication at world size 1"
    from kosmos.ops.moe_backward.api import moe_backward
    layer, weights, experts, kw = _one_launch_case("skewed")
    with pytest.raises(ValueError, match=match):
        moe_backward(*layer, weights, experts, one_launch=one_launch, policy="fixed", comm_programs=1, **kw)
    with pytest.raises(ValueError, match="unknown policy"):
        moe_backward(*layer, weights, experts, one_launch=True, policy="fxd", **kw)


@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.usefixtures("ranks_setup")
@pytest.mark.parametrize("world,routing,skew,policy", [
    (2, "softmax", False, "self"), (2, "sigmoid-grouped", True, "self"), (4, "softmax", False, "self"),
    (8, "softmax", False, "self"), (2, "softmax", False, "fixed"), (2, "sigmoid-grouped", True, "fixed"),
    (8, "softmax", False, "fixed")])
def test_moe_backward_one_launch_ep_at_world_gpu(world, routing, skew, policy):
    """The one launch at W simulated ranks on one GPU, all W launches resident at once (simranks.launch_all, SMs / W
    programs each), at the real tiles: against the fp32 reference (dx, d_router, dw13, dw2), buffers poisoned,
    scratch / counters / done flags clean, five calls (epochs 1-5; no host synchronisation between them) bitwise
    the same. ``policy="fixed"``: the fixed-role ablation at S = a quarter of each rank's programs (at least 1),
    its gradients also bitwise the self policy's (the same inputs, the same call's bits)."""
    import opcases
    from simranks import MoEBwdRanks
    grid = opcases.grid(world)
    pol = dict(policy="fixed", comm_programs=max(1, grid // 4)) if policy == "fixed" else {}
    make = lambda **p: MoEBwdRanks(world, 777, 512, 256, 16, 4, seed=50 + world, device="cuda", grid=grid,  # noqa
                                   timeout_ns=opcases.RANKS_TIMEOUT_NS, routing=routing, skew=skew, **p)
    m = make(**pol)
    outs = []
    for epoch in range(1, 6):
        m.poison()
        m.call(epoch)
        torch.cuda.synchronize()
        outs.append([tuple(x.clone() for x in g if x is not None) for g in _check_ep_vs_reference(m)])
    for r in range(world):
        for later in outs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(outs[0][r], later[r])), r
    if pol:  # the self policy on the same inputs: the same bits
        s = make()
        s.call(1)
        torch.cuda.synchronize()
        want = [tuple(x.clone() for x in g if x is not None) for g in _check_ep_vs_reference(s)]
        for r in range(world):
            assert all(torch.equal(a, b) for a, b in zip(want[r], outs[0][r])), r


@pytest.mark.ranks
@pytest.mark.usefixtures("ranks_setup")
def test_moe_backward_one_launch_ep_transformers_layout_gpu():
    """The one launch at W = 2 simulated ranks on one GPU with each rank's experts in transformers' layout:
    against the fp32 reference, the weight gradients in the weights' layout."""
    import opcases
    from kosmos.ops.moe_forward import weights_nk
    from simranks import MoEBwdRanks
    m = MoEBwdRanks(2, 300, 256, 136, 8, 2, seed=61, device="cuda", grid=opcases.grid(2),
                    timeout_ns=opcases.RANKS_TIMEOUT_NS, nk=True)
    m.call(1)
    torch.cuda.synchronize()
    got = _check_ep_vs_reference(m)
    assert all(weights_nk(g[2]) and weights_nk(g[3]) for g in got)


@pytest.mark.ranks
@pytest.mark.usefixtures("ranks_setup")
def test_moe_backward_one_launch_ep_stalled_peer_gpu():
    """On one GPU at W = 2: rank 1's launch left out -- rank 0's launch ends with the timeout recorded (its plan's
    wait on rank 1's rows), not a hang."""
    import opcases
    from kosmos.core import runtime
    from simranks import MoEBwdRanks
    m = MoEBwdRanks(2, 300, 256, 128, 8, 2, seed=57, device="cuda", grid=opcases.grid(2),
                    timeout_ns=opcases.STALL_NS)
    m.call(1, skip=(1,))
    torch.cuda.synchronize()
    msg = runtime.decode_error(m.errors[0].tolist())
    assert m.errors[0][0] != 0 and "rank 1's output-gradient rows" in msg, msg


# ---- MXFP8: moe_backward(precision="mxfp8") (ops/moe_backward/mx.py) -------------------------------------------

# The MX backward against the bf16 backward: every backward GEMM rounds both operands to MX (~2**-4 per element at
# worst), through two GEMMs and the recomputed GEMM1 -- 5-10% relative (Frobenius) at these sizes (measured
# 0.05-0.095 on the reference); the stated bar is MX_BWD_TOL.
MX_BWD_TOL = 0.12


def _mx_mirror(dy_rows, do_rows, x_rows, gu, w_pair, w13, w2, counts):
    """The MX expert part in torch on packed rows, each step as mx.expert_backward_gemms_mx takes it (bf16 z, dgu,
    h between the steps; fp32 sums): (dx_rows, dw_rows, dw13, dw2) in fp32. z is truncated to bf16 as the
    interpreter's dgrad kernel stores it (its fp32 -> bf16 cast truncates; the GPU rounds to nearest)."""
    from kosmos import quant
    from kosmos.reference.moe import mx_along, mx_rows_ref
    f = w2.shape[1]
    w2h, w13f = quant.mx_values(w2, dim=2).float(), quant.mx_values(w13, dim=2).float()
    dx, dw = torch.zeros(x_rows.shape), torch.zeros(x_rows.shape[0])
    dw13, dw2 = torch.zeros(w13.shape), torch.zeros(w2.shape)
    start = 0
    for e, n in enumerate(counts.tolist()):
        r = slice(start, start + n)
        start += n
        if not n:
            continue
        z = ((mx_along(dy_rows[r], 1).float() @ w2h[e].t()).view(torch.int32) & -65536).view(torch.float32)
        g, u = gu[r, :f].float(), gu[r, f:].float()
        s = torch.sigmoid(g)
        h = g * s * u
        dh = w_pair[r, None] * z
        dgu = torch.cat([dh * u * (s + g * s * (1 - s)), dh * g * s], 1).to(torch.bfloat16)
        dw[r] = (z * h).sum(1)
        dw2[e] = mx_rows_ref(h.to(torch.bfloat16)).float().t() @ mx_rows_ref(do_rows[r]).float()
        dx[r] = mx_along(dgu, 1).float() @ w13f[e].t()
        dw13[e] = mx_rows_ref(x_rows[r]).float().t() @ mx_rows_ref(dgu).float()
    return dx, dw, dw13, dw2


@pytest.mark.interpreter
@pytest.mark.parametrize("nk", [False, True], ids=["native", "transformers-layout"])
def test_expert_backward_gemms_mx_vs_torch_mirror(nk):
    """mx.expert_backward_gemms_mx on the padded layout (an expert over two pads -- three row blocks, the last
    partial --, one without rows, one of 5 rows) against _mx_mirror, its steps in torch: the same values up to the
    summation orders and the rare MX-rounding flip they cause (<= 5e-3); the weights in either layout (the weight
    gradients come back in it); rows outside every expert never read (NaN there)."""
    from kosmos.ops.moe_backward import mx as bwd_mx
    from kosmos.ops.moe_forward import weights_nk
    g = torch.Generator().manual_seed(71)
    counts = torch.tensor([70, 0, 5, 33])
    r, h, f, e = int(counts.sum()), 64, 32, 4
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale).to(torch.bfloat16)  # noqa: E731
    x_rows, dy_rows = rnd(r, h), rnd(r, h)
    gu = rnd(r, 2 * f, scale=2.0)
    w_pair = torch.rand(r, generator=g) + 0.1
    do_rows = (w_pair[:, None] * dy_rows.float()).to(torch.bfloat16)
    w13, w2 = rnd(e, h, 2 * f, scale=h ** -0.5), rnd(e, f, h, scale=f ** -0.5)
    pad_offs, row_of, real_of, end = bwd_layout.padded_layout(counts, r)
    valid = real_of >= 0
    into = lambda t: bwd_rows.gather_rows(torch.cat([t, torch.full_like(t[:1], float("nan"))]),  # noqa: E731
                                          torch.where(valid, real_of, r))  # rows of no expert: NaN
    gap = lambda t: t.masked_fill(~valid[:, None], 0)  # noqa: E731  (gap rows zero, past the end NaN)
    tail = torch.arange(real_of.shape[0]) >= int(end)
    padded = [gap(into(t)).masked_fill(tail[:, None], float("nan")) for t in (dy_rows, do_rows, x_rows, gu)]
    wp = torch.where(valid, w_pair[real_of.clamp(min=0)], 0.0)
    ws = (w13.transpose(1, 2).contiguous().transpose(1, 2), w2.transpose(1, 2).contiguous().transpose(1, 2)) if nk \
        else (w13, w2)
    mxw = bwd_mx.moe_mx_weights(*ws)
    assert all(weights_nk(t) == nk for t in mxw)
    got = bwd_mx.expert_backward_gemms_mx(*padded, wp, mxw, counts, torch.float32, pad_offs=pad_offs, valid=valid,
                                          nk=nk)
    assert weights_nk(got[2]) == nk and got[2].shape == w13.shape and got[3].shape == w2.shape
    want = _mx_mirror(dy_rows, do_rows, x_rows, gu, w_pair, w13, w2, counts)
    for name, a, b in zip(("dx_rows", "dw_rows", "dw13", "dw2"), (got[0][row_of], got[1][row_of], got[2], got[3]),
                          want):
        rel = ((a.float() - b).norm() / b.norm()).item()
        assert rel < 5e-3, (name, rel)
    assert not got[2][1].any() and not got[3][1].any()


def _mx_case(seed, t=70, h=64, f=32, e=8, k=2):
    """A bf16 layer with H, F multiples of 32; each token's first expert 0 (t rows: more than a pad, three row
    blocks), its second from the others but 5 (no rows)."""
    g = torch.Generator().manual_seed(seed)
    x, wr, w13, w2, dy = _moe_layer(g, t, h, f, e)
    others = torch.tensor([1, 2, 3, 4, 6, 7])
    experts = torch.stack([torch.zeros(t, dtype=torch.long), others[torch.randint(0, 6, (t,), generator=g)]], 1)
    return x, wr, w13, w2, dy, experts


@pytest.mark.interpreter
@pytest.mark.parametrize("routing", ["softmax", "sigmoid-grouped", "given"])
def test_moe_backward_mx_vs_reference(routing):
    """moe_backward(precision="mxfp8") at W = 1 (the multi-launch path, padded layout, rounding passes) against
    reference.moe.moe_backward_ref(mx=True) (routing given: moe_experts_backward_ref(mx=True)): dx, d(router
    weight) or d(weights), dW13, dW2 within 3e-2 (the bf16 path's 2e-2 plus the MX flips the bf16 intermediates
    cause); against the bf16 backward within the MX tolerance MX_BWD_TOL and visibly apart; an expert without rows
    gets zeros; bitwise the same twice; the MX weights passed in give the same bits as rounded in the call."""
    from kosmos.reference import moe as mr
    from kosmos.ops.moe_backward import moe_mx_weights
    x, wr, w13, w2, dy, experts = _mx_case(81)
    kw = dict(routing=routing) if routing != "sigmoid-grouped" else dict(routing=routing, routed_scaling=2.5)
    weights, _, _ = mr.routing_weights_ref(x.float() @ wr.float().t(), experts, "softmax" if routing == "given"
                                           else routing, routed_scaling=kw.get("routed_scaling", 1.0))
    router = None if routing == "given" else wr
    got = bwd_api.moe_backward(x, router, w13, w2, dy, weights, experts, precision="mxfp8", **kw)
    if routing == "given":
        want = mr.moe_experts_backward_ref(x, w13, w2, dy, weights, experts, mx=True)
        plain = mr.moe_experts_backward_ref(x, w13, w2, dy, weights, experts)
    else:
        want = mr.moe_backward_ref(x, wr, w13, w2, dy, top_k=2, experts=experts, mx=True, **kw)
        plain = mr.moe_backward_ref(x, wr, w13, w2, dy, top_k=2, experts=experts, **kw)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.bfloat16
    for name, a, b, c in zip(("dx", "d_router", "dw13", "dw2"), got, want, plain):
        rel = ((a.float() - b.float()).norm() / b.float().norm()).item()
        assert rel < 3e-2, (name, rel)
        rel_bf16 = ((a.float() - c.float()).norm() / c.float().norm()).item()
        assert 1e-2 < rel_bf16 < MX_BWD_TOL, (name, rel_bf16)
    assert not got[2][5].any() and not got[3][5].any()
    again = bwd_api.moe_backward(x, router, w13, w2, dy, weights, experts, precision="mxfp8",
                                 mx_weights=moe_mx_weights(w13, w2), **kw)
    assert all(torch.equal(a, b) for a, b in zip(got, again))


def test_moe_backward_mx_refusals():
    """What precision="mxfp8" does not cover is refused in one line before anything runs: the one launch and the
    router in it, the packed layout, a saved g | u, H or F not multiples of 32, wrong MX weights; an unknown
    precision names the choices."""
    from kosmos.ops.moe_backward import moe_mx_weights
    x, wr, w13, w2, dy, experts = _mx_case(3, t=6)
    weights = torch.full((6, 2), 0.5)
    x40, wr40, w13_40, w2_40, dy40 = _moe_layer(torch.Generator().manual_seed(1), 6, 40, 32, 8)
    for args, kw, match in [
        ((), dict(precision="fp8"), "choose 'bf16' or 'mxfp8'"),
        ((), dict(one_launch=True), "multi-launch path"),
        ((), dict(router_in_launch=True), "multi-launch path"),
        ((), dict(padded=False), "padded row layout"),
        ((), dict(saved_gu=object()), "saved_gu=None"),
        ((), dict(mx_weights=moe_mx_weights(w13, w2)[:2]), "MoEMXWeights"),
        ((), dict(mx_weights=moe_mx_weights(w13[:4], w2[:4])), "shape"),
        ((x40, wr40, w13_40, w2_40, dy40), {}, "multiples of 32"),
    ]:
        call = dict(precision="mxfp8")
        call.update(kw)
        tensors = args or (x, wr, w13, w2, dy)
        with pytest.raises(ValueError, match=match):
            bwd_api.moe_backward(*tensors, weights, experts, **call)


def _ep_mx_rank(rank, world, port, q):
    """One rank of the MX backward over gloo (the multi-launch path at W = 2: bf16 rows exchanged, rounded on the
    experts' rank)."""
    import os
    import torch.distributed as dist
    from kosmos.ops.moe_backward.api import moe_backward
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        full = _ep_inputs("softmax", world, f=32)
        x, dy, experts, weights = (full[n][rank] for n in ("x", "dy", "experts", "weights"))
        local = full["w13"].shape[0] // world
        w13, w2 = (full[n][rank * local:(rank + 1) * local] for n in ("w13", "w2"))
        got = moe_backward(x, full["wr"], w13, w2, dy, weights, experts, group=dist.group.WORLD, precision="mxfp8",
                           **full["rkw"])
        q.put((rank, [t.float().numpy() for t in got]))
    finally:
        from multiproc import finish_gloo
        finish_gloo()


@pytest.mark.interpreter
def test_moe_backward_mx_over_two_ranks_vs_reference():
    """moe_backward(precision="mxfp8") at W = 2 over gloo against moe_backward_ref(mx=True) on every rank's tokens
    with every expert in one process (row blocks in the order the exchange gives: source rank, then pair order --
    the reference's ascending p over the concatenated tokens); an expert without rows gets zeros."""
    from kosmos.reference import moe as mr
    from multiproc import spawn_gloo
    world = 2
    full = _ep_inputs("softmax", world, f=32)
    got = spawn_gloo(_ep_mx_rank, world)
    want = mr.moe_backward_ref(torch.cat(full["x"]), full["wr"], full["w13"], full["w2"], torch.cat(full["dy"]),
                               top_k=2, experts=torch.cat(full["experts"]), mx=True, **full["kw"])
    part = lambda r, i: torch.from_numpy(got[r][i])  # noqa: E731
    grads = (torch.cat([part(r, 0) for r in range(world)]), sum(part(r, 1) for r in range(world)),
             torch.cat([part(r, 2) for r in range(world)]), torch.cat([part(r, 3) for r in range(world)]))
    for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), grads, want):
        rel = ((a - b.float()).norm() / b.float().norm()).item()
        assert rel < 3e-2, (name, rel)
    assert not grads[2][3].any() and not grads[3][3].any()


@pytest.mark.gpu
@pytest.mark.parametrize("routing", ["softmax", "sigmoid-grouped"])
def test_moe_backward_mx_gpu(no_tf32, routing):
    """moe_backward(precision="mxfp8") on one GPU (the multi-launch path; the rounding kernels, the bf16 kernels on
    MX operands) against moe_backward_ref(mx=True) within 3e-2 and the bf16 backward within MX_BWD_TOL; an expert
    without rows gets zeros; bitwise the same twice; the transformers layout gives the same gradients (1e-3)."""
    from kosmos.reference import moe as mr
    g = torch.Generator().manual_seed(91)
    t, h, f, e, k = 300, 256, 128, 16, 4
    x, wr, w13, w2, dy = _moe_layer(g, t, h, f, e)
    allowed = torch.tensor([i for i in range(e) if i != 9])
    experts = allowed[torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])]
    kw = dict(routing=routing) if routing == "softmax" else dict(routing=routing, routed_scaling=2.5)
    weights, _, _ = mr.routing_weights_ref(x.float() @ wr.float().t(), experts, routing,
                                           routed_scaling=kw.get("routed_scaling", 1.0))
    cu = [t_.cuda() for t_ in (x, wr, w13, w2, dy, weights, experts)]
    got = bwd_api.moe_backward(*cu, precision="mxfp8", **kw)
    want = mr.moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=experts, mx=True, **kw)
    plain = mr.moe_backward_ref(x, wr, w13, w2, dy, top_k=k, experts=experts, **kw)
    for name, a, b, c in zip(("dx", "d_router", "dw13", "dw2"), got, want, plain):
        assert ((a.float().cpu() - b).norm() / b.norm()).item() < 3e-2, name
        assert ((a.float().cpu() - c).norm() / c.norm()).item() < MX_BWD_TOL, name
    assert not got[2][9].any() and not got[3][9].any()
    assert all(torch.equal(a, b) for a, b in zip(got, bwd_api.moe_backward(*cu, precision="mxfp8", **kw)))
    nk = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in cu[2:4]]
    got_nk = bwd_api.moe_backward(cu[0], cu[1], *nk, *cu[4:], precision="mxfp8", **kw)
    for a, b in zip(got_nk, got):
        assert a.shape == b.shape and ((a.float() - b.float()).norm() / b.float().norm()).item() < 1e-3
