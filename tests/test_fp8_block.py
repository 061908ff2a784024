"""Block-scaled FP8 GEMMs (fp8-block: E4M3 A with 1x128 scales, E4M3 B with 128x128 scales of the [N, K] weight).

* ``interpreter`` -- the static W = 1 GEMM's scaled mainloop (gemm/w1_static.w1_matmul_kernel, SCALED) unsplit
  and stream-K (the K split: GPU only), ragged M and N (a last 128-row weight block of fewer rows), against the fp64
  product of the dequantized operands: within fp32-accumulation error (FP32_ACC_TOL), every element written
  (NaN-poisoned output), the same bits on a second launch; any positive fp32 scales (a checkpoint's amax / 448).
* ``gpu`` -- the same on one Hopper GPU at real sizes, on the FP8 tensor cores.

Error budget: each output element is a sum of K products of exact E4M3 values times power-of-two scales; the
tensor core (or the interpreter's fp32 dot) sums 128 of them in fp32, the promotion adds K/128 such partials in
fp32, and the result is rounded to bf16 once. Against the fp64 product that is the bf16 rounding (2**-9 relative
per element) plus fp32 sums (K * 2**-24): FP32_ACC_TOL = 2**-8 on the relative Frobenius error.
"""
import pytest
import torch

from kosmos import quant, reference
from kosmos.core import codes, planning, runtime

FP32_ACC_TOL = 2.0 ** -8


def operands(m, k, n, seed, device="cpu", odd_scales=False):
    """(A fp8-block 1x128 [m, k], B fp8-block 128x128 of the [n, k] weight, fp64 reference C [m, n])."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * torch.exp2(torch.randint(-4, 4, (m, 1), generator=gen).float()))
    w = torch.randn(n, k, generator=gen) / k ** 0.5
    a = quant.quantize_fp8_block_ref(x.to(torch.bfloat16), 1)
    b = quant.quantize_fp8_block_ref(w.to(torch.bfloat16), 128)
    if odd_scales:  # not powers of two: a checkpoint's amax / 448 scales
        a = a._replace(scales=a.scales * 1.37)
        b = b._replace(scales=b.scales * 0.71)
    ref = reference.fp8_block_matmul_ref(a, b)
    move = lambda t: t._replace(payload=t.payload.to(device), scales=t.scales.to(device))  # noqa: E731
    return move(a), move(b), ref


def w1_scaled(a, b, cfg, programs, split=1, stream_k=False):
    """The static W = 1 GEMM on fp8-block operands through w1_matmul_args (as the plan's launch builds it)."""
    from kosmos.gemm.w1_static import (w1_matmul_args, w1_matmul_kernel, w1_partial_elems, w1_split_grid,
                                       w1_stream_k_grid)
    m, k = a.payload.shape
    n = b.payload.shape[0]
    dev = a.payload.device
    c = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    epoch = torch.full((1,), 7, dtype=torch.int32, device=dev)
    tiles = -(-m // cfg.BM) * -(-n // cfg.BN)
    extra = {}
    if stream_k:
        grid = w1_stream_k_grid(programs, tiles, k, cfg)
        extra = dict(partials=torch.full((grid * cfg.BM * cfg.BN,), float("nan"), device=dev),
                     counters=torch.zeros(tiles, dtype=torch.int32, device=dev), stream_k=True)
    elif split > 1:
        grid = w1_split_grid(programs, tiles, split)
        extra = dict(partials=torch.full((w1_partial_elems(grid, tiles, split, cfg),), float("nan"), device=dev),
                     counters=torch.zeros(2 * (grid // split), dtype=torch.int32, device=dev), split=split)
    errors = torch.zeros(runtime.ERR_SLOTS, dtype=torch.int64, device=dev) if extra else None
    if extra:
        extra.update(errors=errors, timeout_ns=10**9, op=codes.OP_ALL_GATHER_MATMUL.value)
    g, args, kw = w1_matmul_args(a.payload, b.payload, True, c, cfg, epoch, programs, planning.GROUP_M,
                                 planning.interpreting(), scales=(a.scales, b.scales), **extra)
    w1_matmul_kernel[(g,)](*args, **kw)
    assert int(epoch[0]) == 8
    if extra:
        assert int(errors[0]) == 0 and not bool(extra["counters"].any())
    return c


@pytest.mark.interpreter
@pytest.mark.parametrize("m,k,n,schedule", [(40, 256, 160, "unsplit"), (16, 128, 32, "unsplit"),
                                            (33, 384, 136, "stream-k")])
def test_w1_fp8_block_matmul_interpreter(m, k, n, schedule):
    """(The K split's bounded waits need co-resident programs: GPU only, below.)"""
    cfg = planning.TileConfig(16, 32, 128, 4, 1)
    a, b, ref = operands(m, k, n, seed=m + k + n)
    kw = dict(stream_k=True) if schedule == "stream-k" else {}
    got = w1_scaled(a, b, cfg, programs=3, **kw)
    assert torch.isfinite(got.float()).all()
    assert reference.rel_err(got, ref) < FP32_ACC_TOL
    assert torch.equal(w1_scaled(a, b, cfg, programs=3, **kw), got)


@pytest.mark.interpreter
def test_w1_fp8_block_matmul_takes_any_fp32_scales():
    cfg = planning.TileConfig(16, 32, 128, 4, 1)
    a, b, ref = operands(24, 256, 96, seed=5, odd_scales=True)
    assert reference.rel_err(w1_scaled(a, b, cfg, programs=2), ref) < FP32_ACC_TOL


@pytest.mark.interpreter
def test_w1_fp8_block_matmul_a_wrong_scale_fails():
    """The check can fail: a scale block of B off by 2x (one 128x128 block) moves the error far past the bar."""
    cfg = planning.TileConfig(16, 32, 128, 4, 1)
    a, b, ref = operands(32, 256, 64, seed=9)
    bad = b.scales.clone()
    bad[0, 1] *= 2
    assert reference.rel_err(w1_scaled(a, b._replace(scales=bad), cfg, programs=2), ref) > 0.1


def test_w1_matmul_args_refuses_scales_without_a_kmajor_b():
    from kosmos.gemm.w1_static import w1_matmul_args
    z = torch.zeros(64, 128, dtype=torch.bfloat16)
    s = torch.ones(64, 1)
    for kw, cfg in [(dict(), planning.TileConfig(16, 16, 64, 4, 1)), (dict(tail=16), planning.TileConfig(16, 16, 128, 4, 1))]:
        with pytest.raises(ValueError, match="fp8-block scales need a k-major B, BK 128 and no tail"):
            w1_matmul_args(z, z, True, torch.zeros(64, 64, dtype=torch.bfloat16), cfg, torch.zeros(1, dtype=torch.int32),
                           4, planning.GROUP_M, True, scales=(s, s), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4096, 8192, 4096), (1000, 4096, 1536), (128, 7168, 2048)])
@pytest.mark.parametrize("schedule", ["unsplit", "split", "stream-k"])
def test_w1_fp8_block_matmul_gpu(m, k, n, schedule):
    cfg = planning.TileConfig(128, 128, 128, 8, 4)
    a, b, ref = operands(m, k, n, seed=m + n, device="cuda")
    kw = dict(split=2) if schedule == "split" else dict(stream_k=True) if schedule == "stream-k" else {}
    sms = runtime.num_sms(torch.device("cuda"))
    got = w1_scaled(a, b, cfg, sms, **kw)
    assert torch.isfinite(got.float()).all()
    assert reference.rel_err(got.cpu(), ref) < FP32_ACC_TOL
    assert torch.equal(w1_scaled(a, b, cfg, sms, **kw), got)


@pytest.mark.interpreter
def test_fp8_block_matmul_entry_interpreter():
    """gemm.w1_static.fp8_block_matmul: checks, plan, launch -- the product of the dequantized operands."""
    from kosmos.gemm.w1_static import fp8_block_matmul
    a, b, ref = operands(48, 256, 72, seed=11)
    got = fp8_block_matmul(a, b)
    assert reference.rel_err(got, ref) < FP32_ACC_TOL
    assert torch.equal(fp8_block_matmul(a, b, programs=1), got)  # another grid, the same bits


@pytest.mark.gpu_optional
def test_fp8_block_matmul_bad_inputs():
    from kosmos.gemm.w1_static import fp8_block_matmul
    dev = "cpu" if planning.interpreting() else "cuda"
    a, b, _ = operands(16, 256, 32, seed=1, device=dev)
    a128 = quant.quantize_fp8_block_ref(torch.zeros(16, 256, dtype=torch.bfloat16), 128)
    b_short = quant.quantize_fp8_block_ref(torch.zeros(32, 128, dtype=torch.bfloat16), 128)
    a12 = quant.quantize_fp8_block_ref(torch.zeros(12, 256, dtype=torch.bfloat16), 1)
    move = lambda t: t._replace(payload=t.payload.to(dev), scales=t.scales.to(dev))  # noqa: E731
    for args, msg in [((move(a128), b), "a needs 1x128 blocks and b 128x128 blocks"),
                      ((a, move(b_short)), r"a is \[16, 256\] but b is \[32, 128\]"),
                      ((move(a12), b), "M=12 and N=32 must be multiples of 8"),
                      ((a.payload, b), "a must be a kosmos.quant.FP8BlockTensor")]:
        with pytest.raises(ValueError, match=msg) as e:
            fp8_block_matmul(*args)
        assert "\n" not in str(e.value)


def test_fp8_block_plan():
    """One 128 x 128 x 128 tile on the GPU; the K split where tiles fill at most half the SMs at long K, stream-K
    where the wave model gains, else unsplit."""
    import os
    from unittest import mock
    with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}):
        small = planning.fp8_block_plan(256, 1024, 8192, programs=132)   # 16 tiles, 128 steps of 64: split
        assert small.split == 2 and small.tile == planning.FP8_BLOCK_TILE
        big = planning.fp8_block_plan(8192, 8192, 8192, programs=132)    # 4096 tiles: 31.03 waves
        assert big.split == 1 and big.tile.BK == 128 and not big.tail and big.per_sm == 1
        assert planning.fp8_block_plan(128, 128, 128, programs=1).tile == planning.FP8_BLOCK_TILE


@pytest.mark.gpu
@pytest.mark.parametrize("m,k,n", [(4096, 8192, 5120), (1000, 4096, 1536)])
def test_tp_ops_fp8_block_at_one_rank(m, k, n):
    """Both TP ops at W = 1 with precision='fp8-block': a bf16 A quantized by the op (1x128) or given as an
    FP8BlockTensor, the weight an FP8BlockTensor (128x128) or bf16 (quantized by the op) -- the same bits as
    fp8_block_matmul on the same operands, within FP32_ACC_TOL of the fp64 product, bitwise over repeats."""
    import kosmos
    from kosmos.gemm.w1_static import fp8_block_matmul
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(torch.bfloat16).cuda()
    a8, w8 = quant.quantize_fp8_block(x, 1), quant.quantize_fp8_block(w, 128)
    want = fp8_block_matmul(a8, w8)
    assert reference.rel_err(want.cpu(), reference.fp8_block_matmul_ref(
        a8._replace(payload=a8.payload.cpu(), scales=a8.scales.cpu()),
        w8._replace(payload=w8.payload.cpu(), scales=w8.scales.cpu()))) < FP32_ACC_TOL
    a_full, c = kosmos.all_gather_matmul(x, w8, precision="fp8-block")
    kosmos.check_errors()
    assert a_full is x and torch.equal(c, want)
    assert torch.equal(kosmos.all_gather_matmul(a8, w8)[1], want)
    assert torch.equal(kosmos.all_gather_matmul(x, w.t(), precision="fp8-block")[1], want)
    assert torch.equal(kosmos.matmul_reduce_scatter(x, w8, precision="fp8-block"), want)
    assert torch.equal(kosmos.matmul_reduce_scatter(a8, w8), want)


@pytest.mark.gpu
def test_tp_ops_fp8_block_refusals():
    import kosmos
    x = torch.zeros(256, 256, dtype=torch.bfloat16, device="cuda")
    w8 = quant.quantize_fp8_block(torch.zeros(128, 256, dtype=torch.bfloat16, device="cuda"), 128)
    a8 = quant.quantize_fp8_block(x, 1)
    for call, msg in [(lambda: kosmos.all_gather_matmul(a8, w8, precision="mxfp8"), "with precision='mxfp8'"),
                      (lambda: kosmos.all_gather_matmul(x, w8, precision="fp8-block", policy="fixed",
                                                        comm_programs=8), "the self policy"),
                      (lambda: kosmos.matmul_reduce_scatter(x[:, :192].contiguous(), w8, precision="fp8-block"),
                       "K=192 columns"),
                      (lambda: kosmos.all_gather_matmul(a8, a8), "a needs 1x128 blocks and b 128x128 blocks"),
                      (lambda: kosmos.all_gather_matmul(x, w8, precision="fp16"), "choose None, 'bf16', 'mxfp8' or "
                                                                                  "'fp8-block'")]:
        with pytest.raises(ValueError, match=msg) as e:
            call()
        assert "\n" not in str(e.value)


def test_fp8_block_route_decision():
    from kosmos.ops.tp_common import is_fp8_block_call
    t = quant.quantize_fp8_block_ref(torch.zeros(8, 128, dtype=torch.bfloat16))
    z = torch.zeros(8, 128, dtype=torch.bfloat16)
    assert is_fp8_block_call(z, z, "fp8-block") and is_fp8_block_call(t, z, None) and is_fp8_block_call(z, t, None)
    assert not is_fp8_block_call(z, z, "mxfp8") and not is_fp8_block_call(z, z, None)
    assert not is_fp8_block_call(quant.quantize_mx_ref(z), z, None)  # an MXTensor is a 2-tuple: the MX route
