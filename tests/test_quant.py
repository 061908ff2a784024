"""kosmos.quant (MXFP8: E4M3 elements, one E8M0 scale per 32 along K): spec vectors, properties, kernels.

* unmarked -- the torch references: hand-computed vectors (bytes written out with their arithmetic), the
  scale rule's properties, the E4M3 grid against torch's own float8 conversion, the round-trip error bound,
  exactness of MX values in bf16 (exhaustive over all 256 x 256 byte pairs).
* ``interpreter`` / ``gpu`` -- the same vectors through the Triton kernels, and kernel vs reference bit for
  bit on random shapes (rows 1, 37, 128; K 32, 96, 4096), under the CPU interpreter or on one GPU.
* ``gpu_optional`` -- bad inputs raise a one-line ValueError naming the argument (CPU stand-ins here, CUDA
  tensors on the GPU machine).

Notation in the comments: an E4M3 byte is S.EEEE.MMM, value (1 + M/8) * 2**(E - 7), subnormal (E = 0)
M/8 * 2**-6; an E8M0 byte s means 2**(s - 127); X = ceil(log2(amax / 448)), clamped below to -127.
"""
import pytest
import torch
import triton
import triton.language as tl

from kosmos.core import planning
from kosmos.quant import (dequantize_mx, dequantize_mx_ref, e4m3_round_ref, e4m3_value_ref, mx_round,
                          mx_round_bf16, quantize_mx, quantize_mx_ref, rceil_exponent_ref, round_to_mx)

PLATFORMS = [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
             pytest.param("cuda", marks=pytest.mark.gpu, id="gpu")]
IMPLS = [pytest.param(None, id="ref")] + PLATFORMS      # None: the torch reference, on the CPU
SHAPES = [(r, k) for r in (1, 37, 128) for k in (32, 96, 4096)]


def quantize(impl, x):
    """(payload bytes, scale bytes), on the CPU, from the reference (impl None) or the kernel on ``impl``."""
    p, s = quantize_mx_ref(x) if impl is None else quantize_mx(x.to(impl))
    return p.view(torch.uint8).cpu(), s.cpu()


def dequantize(impl, pbytes, scales, dtype=torch.bfloat16):
    p = pbytes.view(torch.float8_e4m3fn)
    if impl is None:
        return dequantize_mx_ref(p, scales, dtype)
    return dequantize_mx(p.to(impl), scales.to(impl), dtype).cpu()


def row(*vals, k=32, dtype=torch.bfloat16):
    """One row of ``k`` elements: ``vals`` first, zeros after; every value must be exact in ``dtype``."""
    x = torch.zeros(1, k, dtype=torch.float64)
    x[0, :len(vals)] = torch.tensor(vals, dtype=torch.float64)
    assert torch.equal(x.to(dtype).double(), x), "a hand vector value is not exact in the input dtype"
    return x.to(dtype)


def u8(*vals, k=32):
    """The expected payload row: ``vals`` first, 0x00 after."""
    return torch.tensor([list(vals) + [0] * (k - len(vals))], dtype=torch.uint8)


def same_bits(a, b):
    """a and b are the same floats bit for bit, NaNs matched by position (any NaN payload)."""
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32}[a.dtype]
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan())
    assert torch.equal(torch.where(a.isnan(), 0, a.view(ints)), torch.where(b.isnan(), 0, b.view(ints)))


def bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """bf16 tensor from 16-bit patterns held in an int tensor (0 .. 0xFFFF)."""
    return torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.bfloat16)


def random_bf16(rows, k, seed):
    """Random bf16 [rows, k]: odd rows are raw random bit patterns (NaN / Inf / subnormals / zeros included);
    even rows give each 32-block a top exponent field (0..254) and elements 0..14 binades below it, so that
    scales cover their whole range and blocks hold E4M3 subnormals, flushes, ties (1 in 16 mantissas end
    in 1000) and bf16 subnormals."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 65536, (rows, k), generator=g)
    top = torch.randint(0, 255, (rows, k // 32, 1), generator=g)
    exp = (top - torch.randint(0, 15, (rows, k // 32, 32), generator=g)).clamp(min=0).reshape(rows, k)
    structured = (raw & 0x807F) | (exp << 7)
    bits = torch.where(torch.arange(rows)[:, None] % 2 == 1, raw, structured)
    return bf16_from_bits(bits)


# ==================================================================================== hand-computed vectors
@pytest.mark.parametrize("impl", IMPLS)
def test_block_of_ones(impl):
    # amax 1: X = ceil(log2(1/448)) = ceil(-8.807) = -8 -> scale byte 127 - 8 = 119 = 0x77.
    # 1 / 2**-8 = 256 = 1.0 * 2**8: E = 8 + 7 = 15 = 1111, M = 000 -> 0.1111.000 = 0x78.
    p, s = quantize(impl, torch.ones(2, 64, dtype=torch.bfloat16))
    assert torch.equal(s, torch.full((2, 2), 0x77, dtype=torch.uint8))
    assert torch.equal(p, torch.full((2, 64), 0x78, dtype=torch.uint8))
    assert torch.equal(dequantize(impl, p, s), torch.ones(2, 64, dtype=torch.bfloat16))


@pytest.mark.parametrize("impl", IMPLS)
def test_amax_a_power_of_two(impl):
    # amax 4 = 2**2: X = ceil(2 - 8.807) = -6 (OCP's floor(log2 4) - 8 = -6 too) -> 121 = 0x79; scaled by 64:
    #   4 -> 256 = 2**8: 0.1111.000 = 0x78      2 -> 128 = 2**7: 0.1110.000 = 0x70
    #   1 -> 64 = 2**6:  0.1101.000 = 0x68      0.5 -> 32 = 2**5: 0.1100.000 = 0x60
    #   3 -> 192 = 1.5 * 2**7: 0.1110.100 = 0x74   -4 -> -256: 1.1111.000 = 0xF8
    x = row(4, 2, 1, 0.5, 3, -4)
    p, s = quantize(impl, x)
    assert s.tolist() == [[0x79]]
    assert torch.equal(p, u8(0x78, 0x70, 0x68, 0x60, 0x74, 0xF8))
    assert torch.equal(dequantize(impl, p, s), x)


@pytest.mark.parametrize("impl", IMPLS)
def test_amax_448_and_just_above(impl):
    # block 0, amax 448: X = ceil(log2(1)) = 0 -> 127 = 0x7F. 448 = 1.75 * 2**8: 0.1111.110 = 0x7E (exact, not
    #   saturated); -448 -> 0xFE; 1 = 2**0: E = 7: 0.0111.000 = 0x38.
    # block 1, amax 450 = 1.7578 * 2**8 (significand > 1.75): X = ceil(log2(450/448)) = 1 -> 128 = 0x80;
    #   450 / 2 = 225 lies in [128, 256) (spacing 16): 224 = 1.75 * 2**7 -> 0.1110.110 = 0x76. (OCP's floor rule
    #   keeps X = 0 and saturates 450 to 448 instead.)
    # block 2, amax 448 * 2**-20: X = -20 -> 107 = 0x6B, the element 448 again: 0x7E.
    x = torch.cat([row(448, -448, 1), row(450), row(448 * 2.0 ** -20)], dim=1)
    p, s = quantize(impl, x)
    assert s.tolist() == [[0x7F, 0x80, 0x6B]]
    assert torch.equal(p, torch.cat([u8(0x7E, 0xFE, 0x38), u8(0x76), u8(0x7E)], dim=1))
    assert dequantize(impl, p, s).double()[0, [0, 1, 2, 32, 64]].tolist() == [448, -448, 1, 448, 448 * 2.0 ** -20]


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_round_to_even(impl):
    # 448 makes X = 0, so the others are rounded as they are:
    #   17 in [16, 32), spacing 2: tie of 16 (M=000) and 18 (M=001) -> 16: E = 4 + 7 = 11: 0.1011.000 = 0x58
    #   19: tie of 18 (001) and 20 (010) -> 20: 0x5A           17.5: not a tie, nearest 18: 0x59
    #   1.0625 in [1, 2), spacing 1/8: tie of 1.0 (000) and 1.125 (001) -> 1.0: 0.0111.000 = 0x38
    #   1.1875: tie of 1.125 (001) and 1.25 (010) -> 1.25: 0x3A
    #   432 in [256, 512), spacing 32: tie of 416 (101) and 448 (110) -> 448: 0x7E
    #   400: tie of 384 (100) and 416 (101) -> 384: 0.1111.100 = 0x7C       -17 -> -16: 1.1011.000 = 0xD8
    x = row(448, 17, 19, 17.5, 1.0625, 1.1875, 432, 400, -17)
    p, s = quantize(impl, x)
    assert s.tolist() == [[0x7F]]
    assert torch.equal(p, u8(0x7E, 0x58, 0x5A, 0x59, 0x38, 0x3A, 0x7E, 0x7C, 0xD8))


@pytest.mark.parametrize("impl", IMPLS)
def test_one_large_many_tiny(impl):
    # 448 makes X = 0; the tiny ones fall on E4M3's subnormal grid m * 2**-9 (0.0000.mmm) or flush to zero:
    #   2**-9 -> m=1: 0x01      2**-7 = 4 * 2**-9 -> 0x04     7 * 2**-9 -> 0x07
    #   2**-6, the smallest normal: 0.0001.000 = 0x08
    #   2**-11 -> 0x00          -2**-11 -> -0: 1.0000.000 = 0x80
    #   2**-10 = half of 2**-9: tie of 0 and m=1 -> 0 (even): 0x00
    #   1.5 * 2**-10 = 0.75 * 2**-9: nearest m=1: 0x01
    #   3 * 2**-10 = 1.5 * 2**-9: tie of m=1 and m=2 -> 2: 0x02     5 * 2**-10 = 2.5 * 2**-9 -> 2: 0x02
    #   15 * 2**-10 = 7.5 * 2**-9: tie of m=7 and 8 * 2**-9 = 2**-6 -> even 8, the smallest normal: 0x08
    t = 2.0 ** -10
    x = row(448, 2 * t, 8 * t, 14 * t, 16 * t, t / 2, -t / 2, t, 1.5 * t, 3 * t, 5 * t, 15 * t)
    p, s = quantize(impl, x)
    assert s.tolist() == [[0x7F]]
    assert torch.equal(p, u8(0x7E, 0x01, 0x04, 0x07, 0x08, 0x00, 0x80, 0x00, 0x01, 0x02, 0x02, 0x08))
    y = dequantize(impl, p, s).double()[0, :12]
    assert y.tolist() == [448, 2 * t, 8 * t, 14 * t, 16 * t, 0, 0, 0, 2 * t, 4 * t, 4 * t, 16 * t]
    assert torch.signbit(y[6])


@pytest.mark.parametrize("impl", IMPLS)
def test_all_zero_block(impl):
    # amax 0: log2(0) = -inf, clamped to -127 -> scale byte 0x00 (2**-127); payload zeros, -0.0 keeps its sign
    # (0x80), and dequantizes to -0.0.
    x = torch.cat([row(), -torch.zeros(1, 32, dtype=torch.bfloat16)], dim=1)
    p, s = quantize(impl, x)
    assert s.tolist() == [[0x00, 0x00]]
    assert torch.equal(p, torch.cat([u8(), torch.full((1, 32), 0x80, dtype=torch.uint8)], dim=1))
    y = dequantize(impl, p, s)
    assert torch.equal(y, torch.zeros(1, 64, dtype=torch.bfloat16))
    assert torch.signbit(y[0, 32:]).all() and not torch.signbit(y[0, :32]).any()


@pytest.mark.parametrize("impl", IMPLS)
def test_negative_values(impl):
    # block 0, all -1: as the block of ones (0x77) with the sign bit: 1.1111.000 = 0xF8.
    # block 1, amax 3: X = ceil(log2(3/448)) = ceil(-7.22) = -7 -> 120 = 0x78; scaled by 128:
    #   -3 -> -384 = -1.5 * 2**8: 1.1111.100 = 0xFC      -0.75 -> -96 = -1.5 * 2**6: 1.1101.100 = 0xEC
    #   2 -> 256: 0x78
    x = torch.cat([-torch.ones(1, 32, dtype=torch.bfloat16), row(-3, -0.75, 2)], dim=1)
    p, s = quantize(impl, x)
    assert s.tolist() == [[0x77, 0x78]]
    assert torch.equal(p, torch.cat([torch.full((1, 32), 0xF8, dtype=torch.uint8), u8(0xFC, 0xEC, 0x78)], dim=1))
    assert torch.equal(dequantize(impl, p, s), x)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_and_inf_make_the_block_nan(impl):
    # a NaN or +-Inf anywhere in a block: scale byte 0xFF (E8M0 NaN) and the whole block's payload 0x7F (E4M3
    # NaN); the other blocks of the row are quantized as usual (ones: 0x77 / 0x78). No error is raised.
    x = torch.ones(2, 96, dtype=torch.bfloat16)
    x[0, 7] = float("nan")
    x[0, 95] = float("-inf")
    x[1, 40] = float("inf")
    p, s = quantize(impl, x)
    assert s.tolist() == [[0xFF, 0x77, 0xFF], [0x77, 0xFF, 0x77]]
    nan_block = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.bool).repeat_interleave(32, dim=1)
    assert torch.equal(p, torch.where(nan_block, 0x7F, 0x78).to(torch.uint8))
    y = dequantize(impl, p, s)
    assert torch.equal(y.isnan(), nan_block) and (y[~nan_block] == 1).all()


@pytest.mark.parametrize("impl", IMPLS)
def test_bf16_subnormal_inputs(impl):
    # block 0, all 2**-133 (bf16's smallest subnormal, bits 0x0001): X = ceil(-133 - 8.807) = -141, clamped to
    #   -127 -> 0x00; 2**-133 * 2**127 = 2**-6: 0.0001.000 = 0x08; dequantizes back to 2**-133 exactly.
    # block 1, all 127 * 2**-133 (bits 0x007F): X = -127 -> 0x00; 127 * 2**-6 = 1.984 in [1, 2), spacing 1/8:
    #   15.875 eighths -> 16 -> 2.0 = 2**1: E = 8: 0.1000.000 = 0x40; dequantizes to 2**-126.
    # block 2, [2**-100, 2**-133]: X = ceil(-100 - 8.807) = -108 -> 19 = 0x13; 2**-100 -> 256: 0x78;
    #   2**-133 -> 2**-25: flushes to 0x00.
    # block 3, [2**-120, 3 * 2**-133]: X = ceil(-128.8) = -128, clamped to -127 -> 0x00; 2**-120 -> 2**7:
    #   0.1110.000 = 0x70; 3 * 2**-133 -> 3 * 2**-6 = 1.5 * 2**-5: E = 2: 0.0010.100 = 0x14.
    tiny = 2.0 ** -133
    x = torch.cat([torch.full((1, 32), tiny, dtype=torch.bfloat16),
                   torch.full((1, 32), 127 * tiny, dtype=torch.bfloat16),
                   row(2.0 ** -100, tiny), row(2.0 ** -120, 3 * tiny)], dim=1)
    assert x.view(torch.int16)[0, 0].item() == 1 and x.view(torch.int16)[0, 32].item() == 0x7F
    p, s = quantize(impl, x)
    assert s.tolist() == [[0x00, 0x00, 0x13, 0x00]]
    assert torch.equal(p, torch.cat([torch.full((1, 32), 0x08, dtype=torch.uint8),
                                     torch.full((1, 32), 0x40, dtype=torch.uint8), u8(0x78), u8(0x70, 0x14)], dim=1))
    y = dequantize(impl, p, s).double()[0]
    assert (y[:32] == tiny).all() and (y[32:64] == 2.0 ** -126).all()
    assert y[[64, 65, 96, 97]].tolist() == [2.0 ** -100, 0, 2.0 ** -120, 3 * tiny]


@pytest.mark.parametrize("impl", IMPLS)
def test_top_of_the_bf16_range(impl):
    # block 0, 1.75 * 2**127 (bf16 0x7F60): X = 127 - 8 = 119 -> 246 = 0xF6; scaled: 448 -> 0x7E; exact back.
    # block 1, bf16 max (2 - 2**-7) * 2**127 (0x7F7F): significand > 1.75, X = 120 -> 247 = 0xF7; scaled:
    #   1.9921875 * 2**7 = 255 in [128, 256), spacing 16 -> 256 = 2**8: 0x78. Dequantized: 2**8 * 2**120 = 2**128,
    #   above bf16's and fp32's max: +inf (the one overflow the quantizer can produce from finite bf16).
    x = torch.cat([bf16_from_bits(torch.tensor([[0x7F60]])), torch.zeros(1, 31, dtype=torch.bfloat16),
                   bf16_from_bits(torch.tensor([[0x7F7F]])), torch.zeros(1, 31, dtype=torch.bfloat16)], dim=1)
    p, s = quantize(impl, x)
    assert s.tolist() == [[0xF6, 0xF7]]
    assert torch.equal(p, torch.cat([u8(0x7E), u8(0x78)], dim=1))
    for dtype in (torch.bfloat16, torch.float32):
        y = dequantize(impl, p, s, dtype)
        assert y[0, 0].item() == 1.75 * 2.0 ** 127 and y[0, 32].item() == float("inf")


def test_fp32_inputs_to_the_reference():
    # fp32 only: 448 -> X = 0. 1 + 2**-20 -> 1.0 (0x38); 1 + 2**-4 + 2**-20, just above the 1.0/1.125 tie ->
    # 1.125 (0x39). A block of fp32 subnormals 2**-149: X clamped to -127 (0x00), 2**-149 * 2**127 = 2**-22
    # flushes to 0x00.
    x = torch.cat([row(448, 1 + 2.0 ** -20, 1 + 2.0 ** -4 + 2.0 ** -20, dtype=torch.float32),
                   torch.full((1, 32), 2.0 ** -149, dtype=torch.float32)], dim=1)
    p, s = quantize(None, x)
    assert s.tolist() == [[0x7F, 0x00]]
    assert torch.equal(p, torch.cat([u8(0x7E, 0x38, 0x39), u8()], dim=1))


# ==================================================================================== properties (reference)
def test_scale_rule():
    """RCEIL puts a finite block's scaled amax in (224, 448] (unless X is clamped at -127: then <= 448), and
    exceeds OCP's floor(log2 amax) - 8 by exactly 1 where amax's significand is above 1.75, else equals it."""
    x = random_bf16(64, 4096, seed=1).double().reshape(64, -1, 32)
    amax = x.abs().amax(-1)
    fin = torch.isfinite(amax) & (amax > 0)
    amax = amax[fin]
    xr = rceil_exponent_ref(amax)
    scaled = amax / torch.exp2(xr)
    assert (scaled <= 448).all() and ((scaled > 224) | (xr == -127)).all()
    frac, ex = torch.frexp(amax)                    # amax = frac * 2**ex, frac in [0.5, 1)
    floor_rule = torch.clamp(ex - 1 - 8, min=-127).double()
    assert torch.equal(xr - floor_rule, ((2 * frac > 1.75) & (xr > -127)).double())


def test_e4m3_grid_against_torch():
    """The references' E4M3 decoding and rounding against torch's own float8_e4m3fn conversions: all 256 bytes
    decode alike, and rounding (clamped to +-448 first: torch's cast of larger values is not ours to rely on)
    agrees on random fp32 values spanning the whole E4M3 range, ties included."""
    allb = torch.arange(256, dtype=torch.uint8)
    same_bits(e4m3_value_ref(allb).float(), allb.view(torch.float8_e4m3fn).float())
    g = torch.Generator().manual_seed(2)
    mant = torch.randint(0, 1 << 8, (200_000,), generator=g).double() / (1 << 8)   # 4 + 4 bits: ties often
    v = ((1 + mant) * torch.exp2(torch.randint(-14, 10, (200_000,), generator=g).double())).float()
    v = torch.where(torch.rand(200_000, generator=g) < 0.5, -v, v)
    ours = e4m3_round_ref(v.double()).to(torch.float8_e4m3fn).view(torch.uint8)
    theirs = v.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(ours, theirs)
    assert e4m3_round_ref(torch.tensor([449.0, 464.0, 1e30, -500.0], dtype=torch.float64)).tolist() == \
        [448, 448, 448, -448]


def test_round_trip_error_bound():
    """|dequantize(quantize(x)) - x| <= max(|x| / 16, 2**(X - 10)) for every element x of a finite block.

    Derivation: with the block exponent X, v = x / 2**X has |v| <= 448 (RCEIL: nothing saturates). If
    |v| >= 2**-6 it lies in a binade [2**e, 2**(e+1)) with -6 <= e <= 8, where E4M3's spacing is 2**(e-3), so
    round-to-nearest errs by at most half of it, 2**(e-4) <= |v| * 2**-4. Below 2**-6 the subnormal spacing is
    2**-9, an error of at most 2**-10. Dequantizing multiplies by 2**X exactly (fp32 output, no overflow here),
    so |error| <= 2**X * max(|v| / 16, 2**-10). The bound is nearly attained (ratio above 0.9)."""
    x = random_bf16(64, 2048, seed=3)
    x = torch.where(x.abs() > 2.0 ** 127, 0.0, x).to(torch.bfloat16)     # keep clear of the 2**128 overflow
    p, s = quantize_mx_ref(x)
    y = dequantize_mx_ref(p, s, torch.float32).double()
    xd = x.double()
    fin = torch.isfinite(xd.reshape(64, -1, 32)).all(-1).repeat_interleave(32, dim=1)
    xexp = (s.double() - 127).repeat_interleave(32, dim=1)
    bound = torch.maximum(xd.abs() / 16, torch.exp2(xexp - 10))
    err = (y - xd).abs()
    assert torch.isfinite(y[fin]).all()
    assert (err[fin] <= bound[fin]).all()
    assert (err[fin] / bound[fin]).max() > 0.9


def test_mx_values_exact_in_bf16():
    """Exhaustive over (payload byte, scale byte): P * 2**X is exactly a bf16 iff it is below 2**128 and its
    lowest set bit is >= 2**-133 (bf16's subnormal spacing), so every finite payload is exact for scale bytes
    3..246; fp32 holds every value below 2**128. dequantize_mx_ref's bf16 output equals the exact value there,
    and is the nearest-even rounding of it elsewhere."""
    pay = torch.arange(256, dtype=torch.uint8).repeat(256, 1)              # [scale byte, payload byte]
    sc = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 8)
    exact = e4m3_value_ref(pay) * torch.exp2(torch.arange(256).double() - 127)[:, None]
    ok = torch.isfinite(exact) & (torch.arange(256) < 255)[:, None]        # drop NaN payloads, the NaN scale
    predicted = (exact.abs() < 2.0 ** 128) & (torch.fmod(exact * 2.0 ** 133, 1) == 0)
    bf = dequantize_mx_ref(pay.view(torch.float8_e4m3fn), sc, torch.bfloat16).double()
    assert torch.equal((bf == exact)[ok], predicted[ok])
    assert predicted[3:247][ok[3:247]].all()
    rounded = torch.tensor(exact[ok].tolist(), dtype=torch.float32).to(torch.bfloat16).double()  # one rounding
    assert torch.equal(bf[ok], rounded)
    f32 = dequantize_mx_ref(pay.view(torch.float8_e4m3fn), sc, torch.float32).double()
    assert torch.equal((f32 == exact)[ok], (exact.abs() < 2.0 ** 128)[ok])
    assert dequantize_mx_ref(pay.view(torch.float8_e4m3fn), sc)[255].isnan().all()   # the NaN scale


def test_round_trip_is_a_bf16():
    """For bf16 input the dequantized values are bf16 exactly (bf16 output == fp32 output), the one exception
    being the values that reach 2**128 (inf in both)."""
    x = random_bf16(64, 1024, seed=4)
    p, s = quantize_mx_ref(x)
    same_bits(dequantize_mx_ref(p, s, torch.bfloat16).float(), dequantize_mx_ref(p, s, torch.float32))


# ==================================================================================== kernels vs reference
@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("rows,k", SHAPES)
def test_quantize_kernel_matches_reference(device, rows, k):
    x = random_bf16(rows, k, seed=rows * 10_000 + k)
    p, s = quantize_mx(x.to(device))
    pr, sr = quantize_mx_ref(x)
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(p.view(torch.uint8).cpu(), pr.view(torch.uint8))


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("rows,k", SHAPES)
def test_dequantize_kernel_matches_reference(device, rows, k):
    """Random payload bytes (NaNs, zeros and subnormals among them) under random scale bytes 0..255."""
    g = torch.Generator().manual_seed(rows * 10_000 + k)
    p = torch.randint(0, 256, (rows, k), generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    s = torch.randint(0, 256, (rows, k // 32), generator=g, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        same_bits(dequantize_mx(p.to(device), s.to(device), dtype).cpu(), dequantize_mx_ref(p, s, dtype))


@triton.jit
def _mx_round_tile(x_ptr, out_ptr, R: tl.constexpr, K: tl.constexpr):
    offs = tl.arange(0, R)[:, None] * K + tl.arange(0, K)[None, :]
    h = tl.reshape(tl.load(x_ptr + offs), (R, K // 32, 32))
    tl.store(out_ptr + offs, tl.reshape(mx_round_bf16(h), (R, K)))


@pytest.mark.parametrize("device", PLATFORMS)
def test_in_register_mx_rounding_is_the_round_trip(device):
    """mx_round_bf16 (the in-register rounding GEMM1's epilogue applies to h) is bit for bit
    dequantize_mx_ref(*quantize_mx_ref(x)): random blocks over the whole scale range (bf16 subnormals, E4M3
    subnormals, flushes, ties, raw bit patterns with NaN / Inf), the hand vectors of the subnormal and
    top-of-range tests (tiny blocks scaled by 2**127, the 2**128 overflow to inf), zeros and -0."""
    tiny = 2.0 ** -133
    hand = torch.cat([torch.full((1, 32), tiny, dtype=torch.bfloat16),
                      torch.full((1, 32), -127 * tiny, dtype=torch.bfloat16),
                      row(2.0 ** -100, tiny), row(2.0 ** -120, 3 * tiny, -tiny, 5 * tiny),
                      bf16_from_bits(torch.tensor([[0x7F60, 0x7F7F] + [0x8000] * 30])),
                      row(448, 452, 464, 17, 19, 1.0625, -2.0 ** -10 * 448, 3 * 2.0 ** -10 * 448),
                      row(2.0 ** 100, 2.0 ** 91, 2.0 ** 90, 1.0), row(2.0 ** -80, 2.0 ** -89, 2.0 ** -93, tiny)], dim=1)
    x = torch.cat([random_bf16(15, 256, seed=11), torch.nn.functional.pad(hand, (0, 0))[:, :256]], dim=0)
    assert x.shape == (16, 256)
    out = torch.empty_like(x, device=device)
    _mx_round_tile[(1,)](x.to(device), out, R=16, K=256)
    want = dequantize_mx_ref(*quantize_mx_ref(x))
    same_bits(out.cpu(), want)
    assert want.isnan().any() and (want == float("inf")).any() and (want.view(torch.int16) == -32768).any()


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("rows,k", SHAPES)
def test_round_to_mx_is_the_round_trip(device, rows, k):
    """round_to_mx (mx_round's one-kernel form on CUDA) is bit for bit dequantize_mx_ref(*quantize_mx_ref(x)) on
    random blocks over the whole range (NaN / Inf blocks, subnormals, ties), the output poisoned first; a second
    call (the cached launch) gives the same bits; mx_round on the CPU is the reference."""
    x = random_bf16(rows, k, seed=rows * 31 + k)
    want = dequantize_mx_ref(*quantize_mx_ref(x))
    for _ in range(2):
        same_bits(round_to_mx(x.to(device)).cpu(), want)
    same_bits(mx_round(x), want)


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("rows,k", [(1, 32), (37, 96), (64, 8), (129, 200)])
def test_round_to_mx_rows_is_the_round_trip_along_rows(device, rows, k):
    """round_to_mx_rows: blocks of 32 rows per column, bit for bit the reference round trip of the transpose with
    zero rows completing the last block (cut back) -- random blocks over the whole range (the transpose of
    random_bf16: NaN / Inf blocks, subnormals, ties); any K, any row count."""
    from kosmos.quant import round_to_mx_rows
    x = random_bf16(k, -(-rows // 32) * 32, seed=rows * 7 + k).t().contiguous()
    x[rows:] = 0
    want = dequantize_mx_ref(*quantize_mx_ref(x.t().contiguous())).t()[:rows]
    same_bits(round_to_mx_rows(x[:rows].contiguous().to(device)).cpu(), want.contiguous())


@pytest.mark.gpu_optional
def test_round_to_mx_bad_inputs():
    dev = _kernel_device()
    with pytest.raises(ValueError, match="x must be torch.bfloat16"):
        round_to_mx(torch.zeros(4, 64, device=dev))
    with pytest.raises(ValueError, match="x has K=48 columns"):
        round_to_mx(torch.zeros(4, 48, dtype=torch.bfloat16, device=dev))
    with pytest.raises(ValueError, match="x must be contiguous"):
        round_to_mx(torch.zeros(64, 32, dtype=torch.bfloat16, device=dev).t())


@pytest.mark.parametrize("device", PLATFORMS)
def test_empty_inputs(device):
    p, s = quantize_mx(torch.zeros(0, 64, dtype=torch.bfloat16, device=device))
    assert p.shape == (0, 64) and s.shape == (0, 2)
    assert dequantize_mx(p, s).shape == (0, 64)


# ==================================================================================== bad inputs
def _kernel_device():
    return "cpu" if planning.interpreting() else "cuda"


def _other_device():
    return "meta" if planning.interpreting() else "cpu"


@pytest.mark.gpu_optional
def test_quantize_bad_inputs():
    dev = _kernel_device()
    good = torch.zeros(4, 64, dtype=torch.bfloat16, device=dev)
    cases = [([[1.0]], "x must be a torch.Tensor"),
             (good[0], "x must be 2-D"),
             (good.float(), "x must be torch.bfloat16"),
             (good.to(_other_device()), "x must be a"),
             (torch.zeros(64, 32, dtype=torch.bfloat16, device=dev).t(), "x must be contiguous"),
             (good[:, :48].contiguous(), "x has K=48 columns; MX blocks need K to be a multiple of 32")]
    for bad, msg in cases:
        with pytest.raises(ValueError, match=msg):
            quantize_mx(bad)
    with pytest.raises(ValueError, match="x has K=40"):
        quantize_mx_ref(torch.zeros(2, 40))
    with pytest.raises(ValueError, match="x must be torch.bfloat16 or torch.float32"):
        quantize_mx_ref(torch.zeros(2, 32, dtype=torch.float16))


@pytest.mark.gpu_optional
def test_dequantize_bad_inputs():
    dev = _kernel_device()
    p = torch.zeros(4, 64, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    s = torch.zeros(4, 2, dtype=torch.uint8, device=dev)
    cases = [((p.view(torch.uint8), s), {}, "payload must be torch.float8_e4m3fn"),
             ((p[:, :48].contiguous(), s), {}, "payload has K=48"),
             ((p, s[:, :1].contiguous()), {}, r"scales is \[4, 1\] but payload \[4, 64\] needs \[4, 2\]"),
             ((p, s.to(torch.int8)), {}, "scales must be torch.uint8"),
             ((p, s.to(_other_device())), {}, "scales must be a"),
             ((p, s[None]), {}, "scales must be 2-D"),
             ((p, s), {"dtype": torch.float16}, "dtype must be torch.bfloat16 or torch.float32")]
    for args, kw, msg in cases:
        with pytest.raises(ValueError, match=msg):
            dequantize_mx(*args, **kw)
    with pytest.raises(ValueError, match="scales is"):
        dequantize_mx_ref(p.cpu(), torch.zeros(4, 3, dtype=torch.uint8))


# ==================================================================================== cached launches
def _qbytes(x):
    p, s = quantize_mx(x)
    return p.view(torch.uint8).cpu(), s.cpu()


def _unaligned(x):
    """A contiguous copy of x whose address is 2 bytes past a 16-byte boundary."""
    base = torch.empty(x.numel() + 8, dtype=x.dtype, device=x.device)
    y = base[1:1 + x.numel()].view(x.shape)
    y.copy_(x)
    assert y.is_contiguous() and y.data_ptr() % 16 == 2
    return y


def _quant_plan_sequence(device):
    """quantize_mx / dequantize_mx over signatures that must each get their own plan (a new shape, an input
    2 bytes off a 16-byte boundary, another output dtype) interleaved with repeats of earlier ones (a hit with
    new tensors), every result bitwise against the references. Returns the plans built."""
    from kosmos import quant
    quant._PLANS.clear()
    xs = [random_bf16(37, 96, seed=1), random_bf16(37, 96, seed=2), random_bf16(5, 64, seed=3),
          random_bf16(37, 96, seed=4), random_bf16(128, 4096, seed=5)]
    keys = []
    for i, x in enumerate(xs):
        xd = x.to(device)
        if i == 3:
            xd = _unaligned(xd)
        p, s = _qbytes(xd)
        pr, sr = quantize_mx_ref(x)
        assert torch.equal(p, pr.view(torch.uint8)) and torch.equal(s, sr), f"input {i}"
        keys.append(quant._key(quant._quantize_kernel, xd))
        for dtype in (torch.bfloat16, torch.float32, torch.bfloat16):
            got = dequantize_mx(p.view(torch.float8_e4m3fn).to(device), s.to(device), dtype).cpu()
            same_bits(got, dequantize_mx_ref(pr, sr, dtype))
    assert keys[0] == keys[1] and len(set(keys)) == 4  # the repeat hit; shape, alignment, shape: new plans
    q = [kl for k, kl in quant._PLANS.items() if k[0] is quant._quantize_kernel]
    d = [kl for k, kl in quant._PLANS.items() if k[0] is quant._dequantize_kernel]
    assert len(q) == 4 and len(d) == 3 * 2  # dequantize: 3 payload shapes (fresh payloads: aligned) x 2 dtypes
    return q + d


@pytest.mark.interpreter
def test_cached_launches_replan_and_match_the_reference():
    """The cached launch (normal launches under the interpreter): a hit reuses the plan with this call's
    tensors, every other signature plans anew; all bitwise equal to the references."""
    _quant_plan_sequence("cpu")


@pytest.mark.interpreter
def test_cached_launches_fast_path_stand_in(monkeypatch):
    """With the fast path pretended supported (a stand-in launcher that launches normally on the plan's 2-D
    grid): each plan self-checks once, then every hit goes through the stand-in with this call's tensors."""
    from kosmos.core import launch_plan
    seen = []

    def make(kernel, compiled, n_args, kw, grid, varying=None):
        assert isinstance(grid, tuple) and len(grid) == 2 and varying == [0, 1, 2]

        def fast(args):
            seen.append(grid)
            kernel[grid](*args, **kw)
        return fast

    monkeypatch.setattr(launch_plan, "fast_launch_supported", lambda: True)
    monkeypatch.setattr(launch_plan, "make_fast_launcher", make)
    launch_plan.reset_plan_stats()
    plans = _quant_plan_sequence("cpu")
    assert all(kl.state == "verified" for kl in plans)
    s = launch_plan.plan_stats()
    assert s["self_checks"] == len(plans) and s["fast_disabled"] == 0
    assert s["fast_launches"] == len(seen) - len(plans) > 0  # the self-checks' own launches, then the hits


@pytest.mark.gpu_optional
def test_bad_inputs_raise_after_a_plan():
    """A plan for a good [64, 64] input does not let a same-shape bad one through: the key holds what the
    checks read (dtype, strides, device)."""
    dev = _kernel_device()
    good = torch.zeros(64, 64, dtype=torch.bfloat16, device=dev)
    quantize_mx(good)
    quantize_mx(good)
    for bad, msg in [(good.float(), "torch.bfloat16"), (good.t(), "contiguous"),
                     (good.to(_other_device()), "x must be a")]:
        with pytest.raises(ValueError, match=msg):
            quantize_mx(bad)


@pytest.mark.gpu
def test_fast_path_bitwise_and_plan_hit():
    """On the GPU: the first call of a signature self-checks the fast launch; from then on calls take it (a hit,
    no new plan) and give the normal launch's bytes, which are the reference's."""
    from kosmos import quant
    from kosmos.core import launch_plan
    quant._PLANS.clear()
    for rows, k in ((128, 256), (37, 4096)):
        x = random_bf16(rows, k, seed=rows + k).cuda()
        pr, sr = quantize_mx_ref(x.cpu())
        launch_plan.set_fast_launch(False)
        try:
            normal = _qbytes(x)
        finally:
            launch_plan.set_fast_launch(True)
        launch_plan.reset_plan_stats()
        n_plans = len(quant._PLANS)
        for _ in range(4):
            p, s = _qbytes(x)
            assert torch.equal(p, normal[0]) and torch.equal(s, normal[1])
            assert torch.equal(p, pr.view(torch.uint8)) and torch.equal(s, sr)
        kl = quant._PLANS[quant._key(quant._quantize_kernel, x)]
        assert len(quant._PLANS) == n_plans  # every call a hit
        if launch_plan.fast_launch_supported():
            assert kl.state == "verified", kl.reason
            assert launch_plan.plan_stats()["fast_launches"] >= 3
            if launch_plan.triton_version() in launch_plan.DIRECT_TRITON:
                assert kl.fast.direct[0] is not None
        y = dequantize_mx(p.view(torch.float8_e4m3fn).cuda(), s.cuda())
        same_bits(y.cpu(), dequantize_mx_ref(pr, sr))


# ==================================================================================== block-scaled FP8 (fp8-block)
# The same element and scale rules on 128-element blocks (1x128) or 128 x 128 blocks, the scale an fp32 2**X.
from kosmos.quant import (FP8BlockTensor, dequantize_fp8_block, dequantize_fp8_block_ref, fp8_block_values,  # noqa: E402
                          quantize_fp8_block, quantize_fp8_block_ref)


def fp8_quantize(impl, x, block_rows=1):
    """(payload bytes, fp32 scales) on the CPU, from the reference (impl None) or the kernel on ``impl``."""
    t = quantize_fp8_block_ref(x, block_rows) if impl is None else quantize_fp8_block(x.to(impl), block_rows)
    return t.payload.view(torch.uint8).cpu(), t.scales.cpu()


def fp8_dequantize(impl, pbytes, scales, block_rows=1, dtype=torch.bfloat16):
    t = FP8BlockTensor(pbytes.view(torch.float8_e4m3fn), scales, block_rows)
    if impl is None:
        return dequantize_fp8_block_ref(t, dtype)
    return dequantize_fp8_block(FP8BlockTensor(t.payload.to(impl), scales.to(impl), block_rows), dtype).cpu()


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_block_hand_vectors(impl):
    # block 0 (columns 0..127): ones -> amax 1, X = ceil(log2(1/448)) = -8, scale 2**-8; 1 * 2**8 = 256 = 0x78.
    # block 1: 448 and 450 (450 = 1.7578 * 2**8, the bf16 above 448) -> X = ceil(log2(450/448)) = 1, scale 2;
    #   450 / 2 = 225 -> the E4M3 grid in [128, 256) has spacing 16: 224 = 1.75 * 2**7 = 0.1110.110 = 0x76;
    #   448 / 2 = 224 exactly = 0x76; -3 / 2 = -1.5 = 1.0111.100 = 0xBC.
    # block 2: all zero -> scale 2**-127 (the clamp), payload zeros.
    x = torch.zeros(1, 384, dtype=torch.bfloat16)
    x[0, :128] = 1.0
    x[0, 128:131] = torch.tensor([448.0, 450.0, -3.0])
    p, s = fp8_quantize(impl, x)
    assert torch.equal(s, torch.tensor([[2.0 ** -8, 2.0, 2.0 ** -127]]))
    assert torch.equal(p[0, :128], torch.full((128,), 0x78, dtype=torch.uint8))
    assert p[0, 128:131].tolist() == [0x76, 0x76, 0xBC] and not p[0, 131:].any()
    want = x.clone()
    want[0, 129] = 448.0  # 450 came back as 224 * 2
    assert torch.equal(fp8_dequantize(impl, p, s), want)


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_block_128x128_takes_the_amax_of_all_its_rows(impl):
    # one block of 130 rows x 128 columns is two block rows: rows 0..127 and 128..129.
    # block row 0: amax 4 (row 100) -> X = ceil(log2(4/448)) = -6, scale 2**-6: 1 -> 64 = 0.1101.000 = 0x68,
    #   4 -> 256 = 0x78. block row 1 (rows 128, 129): amax 0.5 -> X = ceil(log2(0.5/448)) = -9: 0.5 -> 256 = 0x78.
    x = torch.zeros(130, 128, dtype=torch.bfloat16)
    x[0, 0], x[100, 7], x[129, 1] = 1.0, 4.0, 0.5
    p, s = fp8_quantize(impl, x, block_rows=128)
    assert torch.equal(s, torch.tensor([[2.0 ** -6], [2.0 ** -9]]))
    assert (p[0, 0], p[100, 7], p[129, 1]) == (0x68, 0x78, 0x78) and int((p != 0).sum()) == 3
    assert torch.equal(fp8_dequantize(impl, p, s, block_rows=128), x)


@pytest.mark.parametrize("impl", IMPLS)
def test_fp8_block_nan_and_inf_make_the_block_nan(impl):
    # a NaN (row 0, block 0) or an Inf (row 1, block 1) makes its block's scale NaN and payload 0x7F; the other
    # blocks are unaffected. 128x128: the Inf poisons the whole block column of its block row.
    x = torch.ones(2, 256, dtype=torch.bfloat16)
    x[0, 5], x[1, 130] = float("nan"), float("-inf")
    p, s = fp8_quantize(impl, x)
    assert s.isnan().tolist() == [[True, False], [False, True]]
    assert (p[0, :128] == 0x7F).all() and (p[1, 128:] == 0x7F).all() and (p[0, 128:] == 0x78).all()
    out = fp8_dequantize(impl, p, s)
    assert out[0, :128].isnan().all() and out[1, 128:].isnan().all() and (out[0, 128:] == 1).all()
    p, s = fp8_quantize(impl, x, block_rows=128)
    assert s.isnan().tolist() == [[True, True]] and (p == 0x7F).all()


def test_fp8_block_nothing_saturates_and_the_error_bound():
    # RCEIL: every block's scaled amax lies in (224, 448], so no element is clamped; each element's error is at
    # most half an E4M3 quantum of its binade (relative 2**-4), or half the subnormal spacing 2**-10 of the scale.
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(64, 512, generator=g) * torch.exp2(torch.randint(-30, 30, (64, 1), generator=g).float()))
    x = x.to(torch.bfloat16)
    for block_rows in (1, 128):
        t = quantize_fp8_block_ref(x, block_rows)
        p = e4m3_value_ref(t.payload.view(torch.uint8))
        s = t.scales.double().repeat_interleave(block_rows, 0)[:64].repeat_interleave(128, 1)
        assert p.abs().max() <= 448
        scaled_amax = (x.double().abs() / s).reshape(64, 4, 128).amax(-1)
        if block_rows == 1:
            assert ((scaled_amax > 224) & (scaled_amax <= 448)).all()
        err = (p * s - x.double()).abs()
        assert (err <= torch.maximum(x.double().abs() * 2.0 ** -4, s * 2.0 ** -10)).all()


@pytest.mark.parametrize("device", PLATFORMS)
@pytest.mark.parametrize("rows,k,block_rows", [(1, 128, 1), (37, 384, 1), (16, 4096, 1), (128, 256, 128),
                                               (200, 384, 128), (3, 128, 128)])
def test_fp8_block_kernels_match_the_reference(device, rows, k, block_rows):
    x = random_bf16(rows, k, seed=rows * 7 + k)
    pr, sr = fp8_quantize(None, x, block_rows)
    pk, sk = fp8_quantize(device, x, block_rows)
    assert torch.equal(pk, pr)
    same_bits(sk, sr)
    for dtype in (torch.bfloat16, torch.float32):
        same_bits(fp8_dequantize(device, pr, sr, block_rows, dtype), fp8_dequantize(None, pr, sr, block_rows, dtype))
    # any positive fp32 scales (a checkpoint's amax / 448): one rounding of payload * scale
    odd = sr.nan_to_num(1.0) * 1.37
    same_bits(fp8_dequantize(device, pr, odd, block_rows, torch.float32),
              fp8_dequantize(None, pr, odd, block_rows, torch.float32))


def test_fp8_block_values_are_exact_in_bf16():
    """With power-of-two scales every finite fp8-block value is a bf16 (as MX values are): fp8_block_values (bf16)
    is the fp32 dequantization exactly, element for element, wherever that is finite."""
    x = random_bf16(8, 256, seed=3)
    v32 = dequantize_fp8_block_ref(quantize_fp8_block_ref(x), torch.float32)
    v = fp8_block_values(x)
    finite = v32.isfinite()
    assert finite.float().mean() > 0.3
    assert torch.equal(v.float()[finite], v32[finite])
    assert torch.equal(v.isnan(), v32.isnan())


@pytest.mark.gpu_optional
def test_fp8_block_bad_inputs():
    dev = _kernel_device()
    good = torch.zeros(4, 256, dtype=torch.bfloat16, device=dev)
    for bad, kw, msg in [(good[:, :192].contiguous(), {}, "x has K=192 columns; fp8-block needs K to be a multiple "
                                                          "of 128"),
                         (good, {"block_rows": 32}, "block_rows must be 1 .* or 128"),
                         (good.float(), {}, "x must be torch.bfloat16")]:
        with pytest.raises(ValueError, match=msg) as e:
            quantize_fp8_block(bad, **kw)
        assert "\n" not in str(e.value)
    t = quantize_fp8_block(good)
    for bad, msg in [(FP8BlockTensor(t.payload, t.scales[:, :1].contiguous(), 1),
                      r"t.scales is \[4, 1\] but payload \[4, 256\] with 1x128 blocks needs \[4, 2\]"),
                     (FP8BlockTensor(t.payload, t.scales, 128), r"needs \[1, 2\]"),
                     (FP8BlockTensor(t.payload, t.scales.to(torch.float16), 1), "t.scales must be torch.float32"),
                     ((t.payload, t.scales), "must be a kosmos.quant.FP8BlockTensor")]:
        with pytest.raises(ValueError, match=msg):
            dequantize_fp8_block(bad)
