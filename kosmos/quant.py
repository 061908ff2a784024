"""MXFP8 (OCP Microscaling v1.0): FP8 E4M3 elements with one E8M0 scale per 32 consecutive elements along K; and
block-scaled FP8 (one fp32 scale per 1x128 or 128x128 block: its own section below).

    payload, scales = kosmos.quant.quantize_mx(x)          # x [rows, K] bf16 -> [rows, K] e4m3fn, [rows, K/32] u8
    y = kosmos.quant.dequantize_mx(payload, scales)         # -> [rows, K] bf16 (or dtype=torch.float32)
    v = kosmos.quant.mx_round(x)                            # x's MX values as bf16 [rows, K] (round_to_mx on CUDA)

Also: ``MXTensor`` (the (payload, scales) pair the fused ops take), ``mx_values`` (MX values with blocks along any
axis), ``to_mx`` / ``from_mx`` (the kernel on CUDA, the reference elsewhere), ``check_mx`` (an op's MX operand).

The value of element (r, k) is ``P[r, k] * 2**(S[r, k // 32] - 127)``. Elements are OCP E4M3 ("E4M3FN"):
bias 7, largest finite 448 (S.1111.110), no infinities, NaN = S.1111.111, subnormals m/8 * 2**-6. A scale byte
is E8M0: the unsigned exponent x means 2**(x - 127) (2**-127 .. 2**127); 0xFF is NaN. The scales are stored
[rows, K/32] row-major, one byte per block, which is the layout ``tl.dot_scaled`` takes for an [M, K] operand;
an [K, N] right-hand operand is quantized from its [N, K] transpose and gives [N, K/32] scales, which is what
dot_scaled takes for its rhs. (Hopper has no MX tensor-core instructions; Triton's docs say dot_scaled then
upcasts to bf16 and runs a bf16 dot -- exact, as the last section shows.)

Scale rule: RCEIL (round the scale up)
---------------------------------------
For a block with largest magnitude ``amax`` the exponent is ``X = ceil(log2(amax / 448))``: the smallest
integer with ``amax <= 448 * 2**X``, computed exactly (it is ``E - 8``, plus 1 when amax's significand
exceeds 1.75, for ``amax = 1.f * 2**E``; no rounded division by 448 is formed), then clamped below to -127.
It is the scale rule of NVIDIA's MXFP8 recipe (cuDNN's block-scale quantize rounds amax / vmax up to a
power of two; Blackwell has cvt.rp.satfinite.ue8m0 for it). The OCP spec's own example rule is
``X = floor(log2(amax)) - 8`` (8 = E4M3's largest exponent), which puts the scaled amax in [256, 512): when
amax's significand exceeds 1.75 the scaled amax lands in (448, 512) -- at most 512/448 = 1.14x over the top,
not 2x, since 448 is 1.75 * 2**8 rather than 2**8 -- and the spec clamps it to 448.
RCEIL differs from the floor rule only in those blocks, by +1: it never saturates (the scaled amax lies in
(224, 448]) at the price of one bit of headroom in those blocks. We chose RCEIL because saturation is a
silent value change of the block's largest element, the one that matters most, and because it matches the
recipe the hardware and NVIDIA's libraries implement. X lies in [-127, 120] for finite bf16/fp32 input
(120 only when amax > 1.75 * 2**127), so the scale byte is X + 127 in [0, 247].

Elements: ``P = E4M3(v / 2**X)``, round to nearest, ties to even. With RCEIL no finite element of a block
exceeds 448 after scaling, nor after rounding (448 is on the grid), so nothing saturates: the reference clamps
at +-448 defensively, the kernels need no clamp. Division by 2**X is exact (a power of two).

Special cases (quantize_mx and quantize_mx_ref agree bit for bit on each):

* all-zero block: scale byte 0x00 (2**-127, the clamp's bottom: log2(0) = -inf), payload zeros; a -0.0 input
  keeps its sign (payload 0x80), and dequantizes to -0.0.
* amax exactly a power of two 2**k: X = k - 8 (as the floor rule), the amax element becomes 256 = 0x78.
* amax = 448 * 2**k exactly: X = k, the amax element becomes 448 = 0x7E (not saturated: it is exact).
* tiny elements beside a large one: scaled values below 2**-6 become E4M3 subnormals m * 2**-9 (ties to even,
  e.g. 3 * 2**-10 -> 2 * 2**-9), values at or below 2**-10 flush to (signed) zero, and 7.5 * 2**-9 rounds up
  to the smallest normal 2**-6.
* subnormal inputs (bf16 / fp32 subnormals, below 2**-126): handled exactly. A block whose amax is at most
  448 * 2**-127 takes the clamped scale 2**-127, so its elements are scaled by 2**127 and bf16 subnormals
  (k * 2**-133) become k * 2**-6, representable or rounded like any other value.
* NaN or +-Inf anywhere in a block: the block's scale byte is the spec's NaN, 0xFF, and its 32 payload bytes
  are E4M3 NaN (0x7F), so a reader that ignored the scale would still see NaN. No error is raised (checking
  on the host would cost a device sync); other blocks of the row are unaffected. The spec defines a NaN scale
  to make every element of its block NaN, and dequantize_mx does exactly that; a NaN payload byte under a
  finite scale is NaN too. (E4M3FN has no infinity, so an Inf input cannot survive as Inf.)
* Overflow on dequantize: the top of the range is P * 2**X up to 448 * 2**127 > bf16/fp32 max. Such values
  become +-inf (IEEE round to nearest). quantize_mx produces one such case from finite bf16 input: a block
  with amax > 1.75 * 2**127 (scale byte 247) whose element rounds up to 256 dequantizes to 2**128 = inf.

Exactness in bf16 (why dequantize-then-bf16-MMA is exact MX arithmetic)
-----------------------------------------------------------------------
An MX value ``P * 2**X`` has at most 4 significant bits (E4M3's 1 + 3) and its lowest set bit is at least
2**(X - 9). It is exactly a bf16 (8 significant bits, exponent range as fp32, subnormal grid 2**-133) iff
|value| < 2**128 and its lowest set bit is >= 2**-133. So every finite payload is exact under every scale
byte in [3, 246] (X in [-124, 119]); outside that only the values that would overflow or fall off the bf16
subnormal grid are not (dequantize_mx then rounds them to nearest even: to +-inf, or to a bf16 subnormal or
zero). For bf16 input the round trip dequantize_mx(*quantize_mx(x)) is always a bf16 exactly, except the
one overflow case above. The fp32 output is exact for every finite value below 2**128. A bf16 x bf16 product
(8 x 8 significant bits) is exact in fp32 unless it leaves fp32's range, so a bf16 MMA with fp32
accumulation over dequantized operands forms the exact MX products; only its fp32 accumulation rounds, as an
MX dot with an fp32 accumulator does.

Kernels, and what the Triton interpreter could do with fp8
----------------------------------------------------------
Three Triton kernels, one program per (BLOCK_R rows) x (BLOCK_NB MX blocks along K) tile (``_tiles``), tiles held
as [BLOCK_R, BLOCK_NB, 32] so the block amax is one reduction over the last axis; bf16 is read as int16 and E4M3
written as uint8, so the same code gives the same bits under TRITON_INTERPRET=1 and on sm_90:

* ``quantize_mx`` (``_quantize_kernel``) rounds on the floating-point path of mx_round_bf16 (``_mx_round_scaled``:
  exact fp32 adds and multiplies by powers of two; subnormal inputs are pre-scaled by 2**64 and need a GPU that
  does not flush fp32 subnormals, Triton's default, which its GPU tests check) and takes the byte from the scaled
  value's fp32 bits (exponent field and top 3 fraction bits; a subnormal m * 2**-9 through m * 2**-9 + 2**-6).
* ``dequantize_mx`` (``_dequantize_kernel``): bf16 output on a GPU through the hardware E4M3 -> fp32 conversion
  times ``mx_scale_f32`` and one rounding to bf16 (``CVT``); the integer path on the bit patterns
  (``_mx_magnitude_bits``) for the interpreter and for fp32 output. The two give the same bits.
* ``round_to_mx`` (``_round_kernel``): ``mx_round`` = dequantize(quantize(x)) in one kernel (2 bytes read and 2
  written per element), bit for bit the round trip; ``round_to_mx_rows`` (``_round_rows_kernel``) the same with
  blocks of 32 rows per column (the MoE MX backward's weight-gradient operands).
``mx_round_bf16`` (and ``mx_scale_f32``) are device functions for kernels that round (or expand) an operand in
registers: the MoE layer's GEMM1 epilogue, the TP ops' dequantize-on-arrival. Launches go through cached
``launch_plan.KernelLaunch``es keyed by ``_key`` (shape, strides, dtype, device, alignment): a hit skips the
checks and takes launch_plan's fast path after a self-checked first launch; ``quantize_plan`` /
``quantize_planned`` let a caller that validated x itself (moe_forward's plan) quantize without re-checking.
Under the interpreter no kernel converts to or from ``tl.float8e4nv``: Triton 3.9's interpreter rounds ties up,
truncates subnormal results, handles no NaN or saturation and reads 0x7F / 0xFF back as +-480 (checked on the
CPU: docs/design/quant.md), hence the bit-level paths; quantize uses them on sm_90 too, so that one code path is
tested, and dequantize's ``CVT`` (the hardware conversion) is checked bit for bit against the integer path.

Block-scaled FP8 (fp8-block: DeepSeek-V3's, TE's Float8BlockScaling's and DeepGEMM's layout on Hopper)
--------------------------------------------------------------------------------------------------------
    t = kosmos.quant.quantize_fp8_block(x)                 # x [rows, K] bf16 -> FP8BlockTensor: 1x128 blocks
    w = kosmos.quant.quantize_fp8_block(weight, 128)       # weight [N, K] -> 128x128 blocks
    y = kosmos.quant.dequantize_fp8_block(t)               # -> [rows, K] bf16 (or dtype=torch.float32)

E4M3 elements with one fp32 scale per block of 128 along K: per row (1x128, activations: scales [rows, K/128])
or per 128 rows (128x128, weights: scales [ceil(rows/128), K/128]; a last block row of fewer rows takes the amax
of the rows it has). A value is P * scale. The quantizer's scale rule is the MX rule above on the bigger block --
scale = 2**X, X = ceil(log2(amax / 448)) clamped below to -127 -- so an fp8-block value is an MX-like value with
one exponent per block: the same kernel (``_quantize_kernel`` with BK = 128, ROW_BLOCK for 128x128, the scale
written as fp32 bits), the same special cases (an all-zero block: scale 2**-127; a NaN or Inf: a NaN scale and
0x7F payload for the block; nothing saturates; ties to even), bit for bit against ``quantize_fp8_block_ref``.
Power-of-two scales (TE's default for this recipe; DeepGEMM on Hopper takes any fp32 scale) cost up to one bit
of range against amax / 448 and buy exactness: dividing by the scale and multiplying back are exact, every
finite value is a bf16, and a GEMM that applies the scales product per 128-element K step multiplies an fp32
partial sum by a power of two (exact). Consumers (``dequantize_fp8_block``, the GEMMs) take any positive finite
fp32 scales -- a checkpoint's amax / 448 -- as payload * scale rounded once to fp32.

The pure-torch references (quantize_mx_ref, dequantize_mx_ref, e4m3_round_ref) are written from the definitions
instead: the exponent from log2 with an exact correction step, rounding as ``round(|v| / quantum)`` in fp64
(torch.round ties to even), decoding by the E4M3 formula. They take bf16 or fp32 on any device; the tests
(tests/test_quant.py: the special cases, the scale rule, kernels against references bit for bit on the
interpreter and the GPU, bad inputs, the cached launches and their fast path) compare the kernels against them.
The why, the parked alternatives and the figures: docs/design/quant.md; measurements: docs/perf/quant.md.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .core import launch_plan, planning


class MXTensor(NamedTuple):
    """An MXFP8 matrix: ``payload`` float8_e4m3fn [rows, K] and ``scales`` uint8 [rows, K/32] (E8M0 bytes), the
    public layout. A plain tuple underneath: ``payload, scales = x`` works, and ``quantize_mx`` returns one.
    The fused TP ops take it wherever they take a bf16 activation."""
    payload: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self):
        return self.payload.shape

    @property
    def device(self):
        return self.payload.device

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        return dequantize_mx(self.payload, self.scales, dtype)


def check_mx(name: str, x) -> tuple[int, int]:
    """One-line ValueErrors for an MX operand of a fused op (payload e4m3fn [rows, K], K % 32 == 0, scales uint8
    [rows, K/32] on the same device, both contiguous); returns (rows, K)."""
    if not (isinstance(x, tuple) and len(x) == 2):
        raise ValueError(f"{name} must be a kosmos.quant.MXTensor (payload, scales), got {type(x).__name__}")
    payload, scales = x
    _check_mx_matrix(f"{name}.payload", payload, (torch.float8_e4m3fn,), kernel=True)
    _check_k(f"{name}.payload", payload.shape[1])
    _check_scales(payload, scales, kernel=True)
    if scales.data_ptr() % 16 or payload.data_ptr() % 16:
        raise ValueError(f"{name}'s payload and scales must start at 16-byte aligned addresses -- .clone() them")
    return tuple(payload.shape)


def to_mx(x: torch.Tensor) -> MXTensor:
    """quantize_mx on a CUDA tensor (the kernel), the torch reference elsewhere (same bits): for code that runs
    on both, e.g. kosmos.nn's layers in their CPU tests."""
    if x.is_cuda:
        return quantize_mx(x)
    return MXTensor(*quantize_mx_ref(x))


def from_mx(x, dtype=torch.bfloat16) -> torch.Tensor:
    """dequantize_mx (CUDA) or its reference (elsewhere)."""
    payload, scales = x
    if payload.is_cuda:
        return dequantize_mx(payload, scales, dtype)
    return dequantize_mx_ref(payload, scales, dtype)


def mx_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` (bf16 [rows, K]) rounded to its MXFP8 values along K, as bf16: ``dequantize_mx(*quantize_mx(x))``.
    Exact MX values in bf16 (the module docstring's exactness section). This is how the fused ops hold an MX
    *weight*: Hopper has no MX tensor cores and a TP weight never travels, so the GEMM reads the bf16 expansion
    of the MX weight (2 bytes per element where MX takes 1.03) -- the same values an MX MMA would multiply.
    For a [K, N] right operand pass ``mx_round(w).t()`` of the [N, K] weight (blocks along K).
    On CUDA one kernel (round_to_mx), elsewhere the torch reference (same bits)."""
    if x.is_cuda:
        return round_to_mx(x)
    return dequantize_mx_ref(*quantize_mx_ref(x))

MX_BLOCK = 32                # elements per scale (OCP MX: k = 32)
E4M3_MAX = 448.0
E8M0_BIAS = 127
E8M0_NAN = 0xFF
E4M3_NAN = 0x7F              # S.1111.111 with S = 0
_X_MIN = -127                # the smallest E8M0 exponent (byte 0x00)

_F32_INF = tl.constexpr(0x7F800000)   # fp32 bits of +inf; finite magnitudes are below it
_F32_QNAN = tl.constexpr(0x7FC00000)
_BF16_QNAN = tl.constexpr(0x7FC0)
_E4M3_MAXENC = tl.constexpr(0x7E)     # 448 = 1.75 * 2**8


# ============================================================================================ torch reference
def mx_values(t: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The MX values of ``t`` (bf16, any rank) with blocks of 32 along ``dim``, as bf16 -- mx_round for an
    axis other than the last (e.g. an expert weight [E, K, N] with blocks along K: dim=1)."""
    moved = t.movedim(dim, -1)
    flat = moved.reshape(-1, moved.shape[-1]).contiguous()
    return from_mx(to_mx(flat)).reshape(moved.shape).movedim(-1, dim).contiguous()


def _check_mx_matrix(name, t, dtypes, *, kernel: bool) -> None:
    """One-line ValueErrors naming ``name``. The kernels also need a contiguous tensor on their device: CUDA,
    or the CPU under TRITON_INTERPRET=1."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, K], got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if not kernel:
        return
    want = "cpu" if planning.interpreting() else "cuda"
    if t.device.type != want:
        where = "a CPU tensor under TRITON_INTERPRET=1" if want == "cpu" else "a CUDA tensor"
        raise ValueError(f"{name} must be {where}, got {t.device}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def _check_k(name: str, k: int) -> None:
    if k % MX_BLOCK:
        raise ValueError(f"{name} has K={k} columns; MX blocks need K to be a multiple of {MX_BLOCK}")


def _check_scales(payload, scales, *, kernel: bool) -> None:
    _check_mx_matrix("scales", scales, (torch.uint8,), kernel=kernel)
    rows, k = payload.shape
    if tuple(scales.shape) != (rows, k // MX_BLOCK):
        raise ValueError(f"scales is {list(scales.shape)} but payload [{rows}, {k}] needs [{rows}, {k // MX_BLOCK}]")
    if scales.device != payload.device:
        raise ValueError(f"scales is on {scales.device} but payload is on {payload.device}")


def _check_out_dtype(dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")


def rceil_exponent_ref(amax: torch.Tensor) -> torch.Tensor:
    """X = ceil(log2(amax / 448)) clamped to [-127, 127], from the definition: the smallest integer X with
    amax <= 448 * 2**X. log2 gives the estimate; the comparisons (exact in fp64) settle it. amax >= 0, fp64."""
    x = torch.ceil(torch.log2(amax / E4M3_MAX)).clamp(_X_MIN, E8M0_BIAS)   # amax = 0: -inf -> -127
    x = torch.where(E4M3_MAX * torch.exp2(x) < amax, x + 1, x)
    x = torch.where((x > _X_MIN) & (E4M3_MAX * torch.exp2(x - 1) >= amax), x - 1, x)
    return x


def e4m3_round_ref(v: torch.Tensor) -> torch.Tensor:
    """v (fp64) rounded to the E4M3 grid: nearest, ties to even, saturating at +-448; sign of zero kept.

    E4M3 normals have exponents -6..8 and 3 fraction bits, so a value in binade 2**e (e >= -6) sits on a grid
    of spacing 2**(e - 3); the subnormals continue binade -6's spacing 2**-9 down to 0."""
    mag = v.abs()
    _, ex = torch.frexp(mag)                          # mag = f * 2**ex, f in [0.5, 1): floor(log2 mag) = ex - 1
    binade = torch.clamp(ex - 1, min=-6)
    quantum = torch.exp2((binade - 3).to(torch.float64))
    r = torch.clamp(torch.round(mag / quantum) * quantum, max=E4M3_MAX)
    return torch.copysign(r, v)


def e4m3_value_ref(bits: torch.Tensor) -> torch.Tensor:
    """fp64 value of E4M3FN bytes (uint8), by the format's formula: exponent field e, fraction m:
    (1 + m/8) * 2**(e - 7) for e > 0, m/8 * 2**-6 for e = 0; S.1111.111 is NaN."""
    b = bits.to(torch.int64)
    e = ((b >> 3) & 15).to(torch.float64)
    m = (b & 7).to(torch.float64)
    mag = torch.where(e > 0, (1 + m / 8) * torch.exp2(e - 7), m / 8 * 2.0 ** -6)
    val = torch.where((b >> 7) == 1, -mag, mag)
    return torch.where((b & 0x7F) == E4M3_NAN, torch.full_like(val, float("nan")), val)


def quantize_mx_ref(x: torch.Tensor):
    """The reference quantizer (bf16 or fp32 [rows, K], any device): returns (payload float8_e4m3fn [rows, K],
    scales uint8 [rows, K/32]) by the rules in the module docstring, computed in fp64."""
    _check_mx_matrix("x", x, (torch.bfloat16, torch.float32), kernel=False)
    rows, k = x.shape
    _check_k("x", k)
    v = x.to(torch.float64).reshape(rows, k // MX_BLOCK, MX_BLOCK)
    finite = torch.isfinite(v).all(dim=-1)
    amax = torch.where(finite, v.abs().amax(dim=-1), torch.ones_like(finite, dtype=torch.float64))
    xexp = rceil_exponent_ref(amax)
    p = e4m3_round_ref(v / torch.exp2(xexp)[..., None])
    pbits = p.to(torch.float8_e4m3fn).view(torch.uint8)      # exact: p is on the E4M3 grid and within +-448
    pbits = torch.where(finite[..., None], pbits, torch.full_like(pbits, E4M3_NAN))
    scales = torch.where(finite, xexp + E8M0_BIAS, torch.full_like(xexp, E8M0_NAN)).to(torch.uint8)
    return pbits.reshape(rows, k).view(torch.float8_e4m3fn), scales


def dequantize_mx_ref(payload: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """The reference dequantizer: P * 2**(S - 127) in fp64 (exact: 4 significant bits, exponents -136..135),
    NaN for a NaN payload byte or a 0xFF scale, then to ``dtype`` (bf16 or fp32) by round to nearest even.
    Going through fp32 on the way to bf16 rounds once only: the fp64 value is exactly an fp32 (or overflows
    to inf there, as it would in bf16)."""
    _check_mx_matrix("payload", payload, (torch.float8_e4m3fn,), kernel=False)
    _check_k("payload", payload.shape[1])
    _check_scales(payload, scales, kernel=False)
    _check_out_dtype(dtype)
    rows, k = payload.shape
    p = e4m3_value_ref(payload.view(torch.uint8)).reshape(rows, k // MX_BLOCK, MX_BLOCK)
    s = scales.to(torch.float64)
    scale = torch.where(s == E8M0_NAN, torch.full_like(s, float("nan")), torch.exp2(s - E8M0_BIAS))
    return (p * scale[..., None]).reshape(rows, k).to(torch.float32).to(dtype)


# ============================================================================================ Triton kernels
@triton.jit
def _rceil_exponent(amax):
    """X = ceil(log2(amax / 448)), clamped below to -127, from amax's fp32 bits (int32, non-negative, finite):
    for amax = 1.f * 2**E, X = E - 8, plus 1 when 1.f > 1.75 (fraction field above 0x600000)."""
    x = (amax >> 23) - 135 + ((amax & 0x7FFFFF) > 0x600000).to(tl.int32)
    return tl.maximum(x, -127)


@triton.jit
def _tile_offsets(rows, nb, BLOCK_R: tl.constexpr, BLOCK_NB: tl.constexpr, BK: tl.constexpr = 32):
    """This program's element offsets [BLOCK_R, BLOCK_NB, BK] and scale offsets [BLOCK_R, BLOCK_NB] in
    row-major [rows, nb * BK] / [rows, nb] tensors, with their masks (BK: elements per block along K)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1) * BLOCK_NB + tl.arange(0, BLOCK_NB)
    j = tl.arange(0, BK)
    smask = (r < rows)[:, None] & (b < nb)[None, :]
    soffs = r.to(tl.int64)[:, None] * nb + b[None, :]
    offs = soffs[:, :, None] * BK + j[None, None, :]
    return offs, smask[:, :, None], soffs, smask


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, rows, nb, BLOCK_R: tl.constexpr, BLOCK_NB: tl.constexpr,
                     BK: tl.constexpr = 32, ROW_BLOCK: tl.constexpr = False, SCALE_F32: tl.constexpr = False):
    """x: bf16 bits as int16 [rows, nb * BK]; q: E4M3 bytes (uint8) of the same shape; s: the scales [rows, nb]
    (E8M0 bytes; SCALE_F32: fp32 bits 2**X as int32, fp8-block's). ROW_BLOCK (fp8-block's 128x128 blocks): the
    BLOCK_R rows of this program are one block row, one scale per (block row, block) at s[program_id(0), b]."""
    offs, mask, soffs, smask = _tile_offsets(rows, nb, BLOCK_R, BLOCK_NB, BK)
    h = tl.load(x_ptr + offs, mask=mask, other=0).to(tl.int32)
    sign = (h >> 15) & 1
    a = (h & 0x7FFF) << 16                     # fp32 bits of |x|: for non-negative floats, int order = value order
    amax = tl.max(a, axis=2)
    if ROW_BLOCK:                              # one amax per column of blocks, broadcast back over the rows
        amax = tl.zeros_like(amax) + tl.max(amax, axis=0)[None, :]
    nonfinite = amax >= _F32_INF               # some element is NaN or +-Inf
    xexp = _rceil_exponent(amax)
    r, shift = _mx_round_scaled(a, xexp)
    # |v| / 2**X on the E4M3 grid (0 or [2**-9, 448]), exact: r times a normal power of two
    p = r * ((127 - xexp - shift) << 23).to(tl.float32, bitcast=True)[:, :, None]
    # its byte from its fp32 bits: exponent field e - 120 and the top 3 fraction bits for a normal (p >= 2**-6);
    # a subnormal m * 2**-9 plus 2**-6 is the normal (1 + m/8) * 2**-6, whose fields give m
    sub = p < 0.015625
    pb = tl.where(sub, p + 0.015625, p).to(tl.int32, bitcast=True)
    byte = ((pb >> 20) - tl.where(sub, 968, 960)) | (sign << 7)
    byte = tl.where(nonfinite[:, :, None], 0x7F, byte)
    tl.store(q_ptr + offs, byte.to(tl.uint8), mask=mask)
    sbyte = tl.where(nonfinite, 255, xexp + 127)
    if SCALE_F32:  # 2**X as fp32 bits: the E8M0 byte is the exponent field, 2**-127 the subnormal 0x00400000
        sval = tl.where(sbyte == 255, _F32_QNAN, tl.where(sbyte == 0, 0x00400000, sbyte << 23))
    else:
        sval = sbyte.to(tl.uint8)
    if ROW_BLOCK:
        b = tl.program_id(1) * BLOCK_NB + tl.arange(0, BLOCK_NB)
        tl.store(s_ptr + tl.program_id(0).to(tl.int64) * nb + b, tl.max(sval, axis=0), mask=b < nb)
    else:
        tl.store(s_ptr + soffs, sval, mask=smask)


@triton.jit
def _mx_magnitude_bits(enc, x):
    """fp32 bits of |E4M3(enc)| * 2**x (enc the byte without its sign, finite; x in [-127, 127]): exact, or
    +inf when it reaches 2**128."""
    ef = enc >> 3
    sig = tl.where(ef > 0, (enc & 7) | 8, enc & 7)       # value = sig * 2**(e - 10)
    e = tl.maximum(ef, 1)
    for _ in tl.static_range(3):                         # renormalise a subnormal to sig in [8, 16)
        low = (sig < 8) & (sig > 0)
        sig = tl.where(low, sig << 1, sig)
        e = tl.where(low, e - 1, e)
    be = e + x + 120                                     # the result's fp32 exponent field
    normal = (be << 23) | ((sig - 8) << 20)
    subnormal = (sig << 20) >> tl.maximum(1 - be, 0)     # be >= -9, so at most 10 zero bits shift out
    bits = tl.where(be >= 1, normal, subnormal)
    bits = tl.where(be >= 255, _F32_INF, bits)
    return tl.where(enc == 0, 0, bits)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, out_ptr, rows, nb, OUT_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                       BLOCK_NB: tl.constexpr, CVT: tl.constexpr):
    """q: E4M3 bytes (uint8) [rows, nb * 32]; s: E8M0 bytes [rows, nb]; out: bf16 bits as int16, or fp32 bits
    as int32, of the same shape as q. ``CVT`` (bf16 out, on a GPU): the hardware's E4M3 -> fp32 conversion times
    mx_scale_f32 (exact, as ops/tp_dequant.mx_dequant_rows), one fp32 -> bf16 rounding (nearest even, subnormals
    kept), NaN as _BF16_QNAN; else the integer path (_mx_magnitude_bits: what the interpreter runs, whose float
    casts truncate). CVT is bit for bit the integer path (test_quant's GPU tests) and the faster one on a GPU."""
    offs, mask, soffs, smask = _tile_offsets(rows, nb, BLOCK_R, BLOCK_NB)
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    sb = tl.load(s_ptr + soffs, mask=smask, other=127).to(tl.int32)[:, :, None]
    enc = q & 0x7F
    sign = q >> 7
    nan = (enc == 0x7F) | (sb == 255)
    if CVT:
        v = q.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32) * mx_scale_f32(sb)
        r = v.to(tl.bfloat16).to(tl.int16, bitcast=True)
        tl.store(out_ptr + offs, tl.where(nan, _BF16_QNAN, r), mask=mask)
        return
    mag = _mx_magnitude_bits(enc, sb - 127)
    if OUT_BF16:
        r = (mag + 0x7FFF + ((mag >> 16) & 1)) >> 16    # fp32 -> bf16, nearest even (subnormals and inf too)
        r = tl.where(nan, _BF16_QNAN, r | (sign << 15))
        tl.store(out_ptr + offs, tl.where(r >= 32768, r - 65536, r).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, tl.where(nan, _F32_QNAN, mag | (sign << 31)), mask=mask)


@triton.jit
def mx_scale_f32(sb):
    """The fp32 value 2**(S - 127) of E8M0 scale bytes ``sb`` (int32), built from its bits: S = 0 is the fp32
    subnormal 2**-127, 0xFF the spec's NaN. Times an E4M3 element converted to fp32, an exact MX value: the
    dequantize-on-arrival paths of the fused ops use it (their integer-path twin is _mx_magnitude_bits)."""
    bits = tl.where(sb == 0, 0x00400000, sb << 23)
    return tl.where(sb == 255, _F32_QNAN, bits).to(tl.float32, bitcast=True)


@triton.jit
def _mx_round_scaled(a, xexp):
    """The rounding step of the floating-point path (mx_round_bf16's docstring): ``a`` the fp32 bits of |v|
    (int32 [R, NB, 32], finite or not), ``xexp`` the blocks' exponents X [R, NB]. Returns (r, shift): r (fp32)
    the MX magnitude of |v| times 2**shift, exact, where shift [R, NB] is 64 for blocks with X < -90, -64 for
    X > 90 and 0 otherwise (so that the rounding constant C stays a normal fp32)."""
    shift = tl.where(xexp < -90, 64, tl.where(xexp > 90, -64, 0))
    m = a.to(tl.float32, bitcast=True) * ((127 + shift) << 23).to(tl.float32, bitcast=True)[:, :, None]
    ef = m.to(tl.int32, bitcast=True) >> 23                           # its biased exponent (0: zero, subnormal)
    cb = tl.maximum(ef, (xexp + shift + 121)[:, :, None]) + 20        # C's biased exponent field, in [78, 254]
    c = (cb << 23).to(tl.float32, bitcast=True)
    return (m + c) - c, shift


@triton.jit
def mx_round_bf16(h):
    """The MX values of a tile of bf16 values, bit for bit as dequantize_mx(*quantize_mx(.)) gives them: ``h``
    is a bf16 [R, NB, 32] tile whose last axis is one MX block; returns its MX values (bf16; a block with a NaN
    or Inf: NaN). For kernels that round an operand to MX in registers (the MoE layer's SwiGLU output).

    The floating-point path: scaling by the block's 2**X changes no significand, so the MX value of an element
    is the element rounded (nearest even) to the quantum 2**(max(floor(log2 |v|), X - 6) - 3) -- 3 fraction
    bits in E4M3's normal binades, the subnormals' fixed spacing 2**(X - 9) below them; RCEIL keeps the
    result <= 448 * 2**X, so nothing saturates. One fp32 add of C = 2**(quantum exponent + 23) and its
    subtraction round to that quantum exactly (|v| < C, and |v| + C lies in [C, 2C), whose ulp is the quantum;
    round to nearest even is the IEEE default on the GPU and in numpy). Blocks with X beyond +-90 are scaled by
    2**-+64 first (exact: a power of two) so that C stays a normal fp32, and back after. ~15 operations per
    element (an integer rounding takes ~60: docs/design/quant.md). Subnormal inputs (bf16 subnormals only occur
    in blocks with X < -90, where they matter) rely on the GPU not flushing fp32 subnormals (Triton's default: no
    ftz; tests/test_quant.py's GPU test checks it); the bf16 conversions at both ends are integer (the
    interpreter's casts truncate, and lose bf16 subnormals)."""
    bits = h.to(tl.int16, bitcast=True).to(tl.int32) << 16            # fp32 bits of h (the interpreter's bf16
    a = bits & 0x7FFFFFFF                                             # -> fp32 cast loses subnormals)
    amax = tl.max(a, axis=2)
    nonfinite = (amax >= _F32_INF)[:, :, None]
    r, shift = _mx_round_scaled(a, _rceil_exponent(amax))
    q = r * ((127 - shift) << 23).to(tl.float32, bitcast=True)[:, :, None]   # the exact MX magnitude (fp32)
    qb = q.to(tl.int32, bitcast=True)
    r = (qb + 0x7FFF + ((qb >> 16) & 1)) >> 16                        # to bf16, nearest even (only subnormals move)
    r = tl.where(nonfinite, _BF16_QNAN, r | ((bits >> 31) & 1) << 15)
    return tl.where(r >= 32768, r - 65536, r).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _round_kernel(x_ptr, out_ptr, rows, nb, BLOCK_R: tl.constexpr, BLOCK_NB: tl.constexpr):
    """x, out: bf16 [rows, nb * 32]; out = the MX values of x (mx_round_bf16), one read and one write."""
    offs, mask, _, _ = _tile_offsets(rows, nb, BLOCK_R, BLOCK_NB)
    h = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, mx_round_bf16(h), mask=mask)


@triton.jit
def _round_rows_kernel(x_ptr, out_ptr, rows, cols, BLOCK_RB: tl.constexpr, BLOCK_C: tl.constexpr):
    """x, out: bf16 [rows, cols]; out = the MX values of x with blocks of 32 consecutive rows per column (row block
    b: rows [32 b, 32 b + 32)), rows past ``rows`` read as zeros: a [BLOCK_RB, BLOCK_C, 32] tile whose last axis
    is one block (mx_round_bf16's), one read and one write."""
    b = tl.program_id(0) * BLOCK_RB + tl.arange(0, BLOCK_RB)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r = b[:, None, None] * 32 + tl.arange(0, 32)[None, None, :]
    offs = r.to(tl.int64) * cols + c[None, :, None]
    mask = (r < rows) & (c < cols)[None, :, None]
    h = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, mx_round_bf16(h), mask=mask)


# ============================================================================================ host wrappers
def _tiles(rows: int, nb: int):
    """(BLOCK_R, BLOCK_NB, num_warps): 8 rows x 8 MX blocks (2048 elements) per 4-warp program on the GPU (the
    tile barely matters there: docs/design/quant.md); larger tiles under the interpreter, where each program
    costs a fixed Python overhead."""
    cap_r, cap_b = (16, 16) if planning.interpreting() else (8, 8)
    return min(cap_r, triton.next_power_of_2(rows)), min(cap_b, triton.next_power_of_2(nb)), 4


_PLANS: dict = {}  # _key -> launch_plan.KernelLaunch of that call signature (cleared beyond MAX_PLANS)


def _key(kernel, t, *extra):
    """The plan key of a call on ``t``: every property the checks, the tile choice and Triton's specialisation
    read (shape, strides, dtype, device, 16-byte alignment), or None for a non-tensor (a miss: the checks say why)."""
    if not isinstance(t, torch.Tensor):
        return None
    return (kernel, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0, *extra)


def _launch(kernel, key, ref: torch.Tensor, args: list, outputs, kl=None, **constexprs) -> None:
    """Launch ``kernel`` on ``args`` (its runtime arguments, tensors first, then rows and nb) through the cached
    KernelLaunch of ``key`` (launch_plan.py: after a self-checked first launch, Triton's launcher is called
    directly where launch_plan supports it; the normal ``kernel[grid](...)`` elsewhere, e.g. the interpreter).
    The tile choice, the grid and the device context run only when a plan is made or launches normally. ``kl``:
    the plan of ``key`` if the caller has looked it up already."""
    if kl is None and key is not None:
        kl = _PLANS.get(key)
    if kl is None:
        rows, nb = args[-2], args[-1]
        br, bnb, warps = _tiles(rows, nb)
        grid = (-(-rows // br), -(-nb // bnb))  # (not triton.cdiv: a JIT function, microseconds per host call)
        kl = launch_plan.KernelLaunch(kernel, grid, args, dict(BLOCK_R=br, BLOCK_NB=bnb, num_warps=warps,
                                                                **constexprs),
                                      device=ref.device if ref.device.type == "cuda" else None)
        kl.varying = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]  # the rest is in the key
        if key is not None:
            if len(_PLANS) >= launch_plan.MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = kl
    kl.launch(args, outputs=outputs)


def quantize_mx(x: torch.Tensor):
    """MXFP8-quantize x (bf16 [rows, K], contiguous, CUDA; K a multiple of 32) along K with the Triton kernel.
    Returns (payload float8_e4m3fn [rows, K], scales uint8 [rows, K/32] E8M0 bytes). Rules: module docstring;
    bit-identical to quantize_mx_ref (interpreter and sm_90). A call whose signature (``_key``) has a plan skips
    the checks (the key holds what they read; CPU plans re-check, the interpreter switch being read there) and
    launches through it (``_launch``)."""
    key = _key(_quantize_kernel, x)
    kl = _PLANS.get(key) if key is not None else None
    if kl is None or kl.device is None:
        _check_mx_matrix("x", x, (torch.bfloat16,), kernel=True)
        _check_k("x", x.shape[1])
    return quantize_planned(x, key, kl)


def quantize_plan(x: torch.Tensor):
    """The key of quantize_mx(x)'s plan once it exists (a caller that has validated x itself, e.g. moe_forward's
    plan, passes it to ``quantize_planned``), else None."""
    key = _key(_quantize_kernel, x)
    return key if key is not None and key in _PLANS else None


def quantize_planned(x: torch.Tensor, key, kl=None) -> MXTensor:
    """quantize_mx(x) without its checks, for an ``x`` that passed them; ``key``: x's plan key (or None), ``kl``
    its plan if looked up."""
    rows, k = x.shape
    payload = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((rows, k // MX_BLOCK), dtype=torch.uint8, device=x.device)
    if rows and k:
        p8 = payload.view(torch.uint8)
        _launch(_quantize_kernel, key, x, [x.view(torch.int16), p8, scales, rows, k // MX_BLOCK], (p8, scales), kl)
    return MXTensor(payload, scales)


def dequantize_mx(payload: torch.Tensor, scales: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """payload (float8_e4m3fn [rows, K]) times 2**(scales - 127) per 32-element block, as ``dtype`` (bf16 or
    fp32) [rows, K], with the Triton kernel: exact wherever the value is representable (module docstring),
    NaN for a NaN payload byte or a 0xFF scale. Bit-identical to dequantize_mx_ref (interpreter and sm_90)."""
    _check_mx_matrix("payload", payload, (torch.float8_e4m3fn,), kernel=True)
    _check_k("payload", payload.shape[1])
    _check_scales(payload, scales, kernel=True)
    _check_out_dtype(dtype)
    rows, k = payload.shape
    out = torch.empty((rows, k), dtype=dtype, device=payload.device)
    if out.numel():
        bits = out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        key = _key(_dequantize_kernel, payload, scales.data_ptr() % 16 == 0, dtype)
        _launch(_dequantize_kernel, key, payload, [payload.view(torch.uint8), scales, bits, rows, k // MX_BLOCK],
                (bits,), OUT_BF16=dtype == torch.bfloat16,
                CVT=dtype == torch.bfloat16 and not planning.interpreting())
    return out


def round_to_mx(x: torch.Tensor) -> torch.Tensor:
    """mx_round with one Triton kernel: x (bf16 [rows, K], contiguous, CUDA; K a multiple of 32) -> its MX values
    (bf16 [rows, K]), bit for bit dequantize_mx(*quantize_mx(x)) (mx_round_bf16: interpreter and sm_90), reading
    2 and writing 2 bytes per element (the two kernels: 2 + 1.03 + 1.03 + 2), on _tiles' blocks; a plan hit
    skips the checks, as in quantize_mx."""
    key = _key(_round_kernel, x)
    kl = _PLANS.get(key) if key is not None else None
    if kl is None or kl.device is None:
        _check_mx_matrix("x", x, (torch.bfloat16,), kernel=True)
        _check_k("x", x.shape[1])
    rows, k = x.shape
    out = torch.empty_like(x)
    if out.numel():
        _launch(_round_kernel, key, x, [x, out, rows, k // MX_BLOCK], (out,), kl)
    return out


def round_to_mx_rows(x: torch.Tensor) -> torch.Tensor:
    """x (bf16 [rows, K], contiguous; CUDA, or the CPU under TRITON_INTERPRET=1) -> its MX values with blocks of 32
    consecutive rows per column, counted from row 0 (bf16 [rows, K]): the rounding of an operand whose GEMM sums
    over the rows (a weight gradient's). A last block of fewer than 32 rows is rounded as if zero rows completed
    it (zeros change no block's scale): bit for bit ``mx_values`` along dim 0 of x with zero rows appended up to
    a multiple of 32, cut back (mx_round_bf16; the MoE MX backward's reference.moe.mx_rows_ref). Any K; one
    kernel, launched directly (no cached plan)."""
    _check_mx_matrix("x", x, (torch.bfloat16,), kernel=True)
    rows, k = x.shape
    out = torch.empty_like(x)
    if out.numel():
        brb, bc = (4, 64) if planning.interpreting() else (2, 32)
        _round_rows_kernel[(-(-rows // (32 * brb)), -(-k // bc))](x, out, rows, k, BLOCK_RB=brb, BLOCK_C=bc,
                                                                 num_warps=4)
    return out


# ============================================================================================ block-scaled FP8
FP8_BLOCK = 128              # elements per scale along K; a weight block is FP8_BLOCK x FP8_BLOCK
FP8_BLOCK_ROWS = (1, FP8_BLOCK)


class FP8BlockTensor(NamedTuple):
    """A block-scaled FP8 matrix: ``payload`` float8_e4m3fn [rows, K] and ``scales`` fp32, one per ``block_rows``
    x 128 block: [rows, K/128] for block_rows = 1 (activations, 1x128), [ceil(rows/128), K/128] for 128 (weights,
    128x128), row-major. A value is payload * scale. ``quantize_fp8_block`` makes power-of-two scales; the GEMMs
    and ``dequantize_fp8_block`` take any positive finite fp32 scales (e.g. a checkpoint's amax / 448)."""
    payload: torch.Tensor
    scales: torch.Tensor
    block_rows: int = 1

    @property
    def shape(self):
        return self.payload.shape

    @property
    def device(self):
        return self.payload.device

    def dequantize(self, dtype=torch.bfloat16) -> torch.Tensor:
        return from_fp8_block(self, dtype)


def fp8_block_scale_shape(rows: int, k: int, block_rows: int) -> tuple[int, int]:
    return (-(-rows // block_rows), k // FP8_BLOCK)


def _check_block_rows(block_rows) -> None:
    if block_rows not in FP8_BLOCK_ROWS:
        raise ValueError(f"block_rows must be 1 (1x128 blocks, activations) or 128 (128x128 blocks, weights), "
                         f"got {block_rows!r}")


def _check_fp8_block_k(name: str, k: int) -> None:
    if k % FP8_BLOCK:
        raise ValueError(f"{name} has K={k} columns; fp8-block needs K to be a multiple of {FP8_BLOCK}")


def check_fp8_block(name: str, t, *, kernel: bool = True) -> tuple[int, int]:
    """One-line ValueErrors for a block-scaled FP8 operand ``t`` (an FP8BlockTensor: payload e4m3fn [rows, K],
    K % 128 == 0, scales fp32 of fp8_block_scale_shape on the same device, both contiguous); returns (rows, K)."""
    if not (isinstance(t, tuple) and len(t) == 3):
        raise ValueError(f"{name} must be a kosmos.quant.FP8BlockTensor (payload, scales, block_rows), "
                         f"got {type(t).__name__}")
    payload, scales, block_rows = t
    _check_block_rows(block_rows)
    _check_mx_matrix(f"{name}.payload", payload, (torch.float8_e4m3fn,), kernel=kernel)
    _check_fp8_block_k(f"{name}.payload", payload.shape[1])
    _check_mx_matrix(f"{name}.scales", scales, (torch.float32,), kernel=kernel)
    want = fp8_block_scale_shape(*payload.shape, block_rows)
    if tuple(scales.shape) != want:
        raise ValueError(f"{name}.scales is {list(scales.shape)} but payload {list(payload.shape)} with "
                         f"{block_rows}x{FP8_BLOCK} blocks needs {list(want)}")
    if scales.device != payload.device:
        raise ValueError(f"{name}.scales is on {scales.device} but its payload is on {payload.device}")
    return tuple(payload.shape)


def quantize_fp8_block_ref(x: torch.Tensor, block_rows: int = 1) -> FP8BlockTensor:
    """The reference quantizer (bf16 or fp32 [rows, K], any device; K % 128 == 0): the rules of the module
    docstring's fp8-block section, computed in fp64. block_rows 1: one scale per row and 128 columns; 128: one per
    128 rows (the last block row may be shorter) and 128 columns."""
    _check_block_rows(block_rows)
    _check_mx_matrix("x", x, (torch.bfloat16, torch.float32), kernel=False)
    rows, k = x.shape
    _check_fp8_block_k("x", k)
    nr, nb = fp8_block_scale_shape(rows, k, block_rows)
    v = x.to(torch.float64)
    padded = torch.zeros(nr * block_rows, k, dtype=torch.float64, device=x.device)
    padded[:rows] = v
    blocks = padded.reshape(nr, block_rows, nb, FP8_BLOCK)
    finite = torch.isfinite(blocks).all(dim=3).all(dim=1)                                  # [nr, nb]
    amax = torch.where(finite, blocks.abs().amax(dim=(1, 3)), torch.ones_like(finite, dtype=torch.float64))
    xexp = rceil_exponent_ref(amax)
    p = e4m3_round_ref(blocks / torch.exp2(xexp)[:, None, :, None])
    pbits = p.to(torch.float8_e4m3fn).view(torch.uint8)
    pbits = torch.where(finite[:, None, :, None], pbits, torch.full_like(pbits, E4M3_NAN))
    scales = torch.where(finite, torch.exp2(xexp), torch.full_like(xexp, float("nan"))).to(torch.float32)
    payload = pbits.reshape(nr * block_rows, k)[:rows].contiguous().view(torch.float8_e4m3fn)
    return FP8BlockTensor(payload, scales, block_rows)


def dequantize_fp8_block_ref(t: FP8BlockTensor, dtype=torch.bfloat16) -> torch.Tensor:
    """The reference dequantizer: fl32(E4M3(P) * scale) -- the product rounded once to fp32 (exact for power-of-two
    scales unless it leaves fp32's range), NaN for a NaN payload byte or scale -- then to ``dtype`` (bf16 or fp32),
    round to nearest even."""
    rows, k = check_fp8_block("t", t, kernel=False)
    _check_out_dtype(dtype)
    payload, scales, block_rows = t
    p = e4m3_value_ref(payload.view(torch.uint8)).to(torch.float32)                # exact in fp32
    s = scales.repeat_interleave(block_rows, dim=0)[:rows].repeat_interleave(FP8_BLOCK, dim=1)
    return (p * s).to(dtype)


def fp8_block_values(x: torch.Tensor, block_rows: int = 1) -> torch.Tensor:
    """x's block-scaled FP8 values (bf16 [rows, K]): dequantize(quantize(x)), the kernels on CUDA, the reference
    elsewhere. Exact bf16 values, as mx_round's (power-of-two scales)."""
    return from_fp8_block(to_fp8_block(x, block_rows))


def to_fp8_block(x: torch.Tensor, block_rows: int = 1) -> FP8BlockTensor:
    """quantize_fp8_block on a CUDA tensor (the kernel), the reference elsewhere (same bits)."""
    return quantize_fp8_block(x, block_rows) if x.is_cuda else quantize_fp8_block_ref(x, block_rows)


def from_fp8_block(t: FP8BlockTensor, dtype=torch.bfloat16) -> torch.Tensor:
    """dequantize_fp8_block (CUDA) or its reference (elsewhere)."""
    return dequantize_fp8_block(t, dtype) if t.payload.is_cuda else dequantize_fp8_block_ref(t, dtype)


@triton.jit
def _dequantize_fp8_block_kernel(q_ptr, s_ptr, out_ptr, rows, nb, OUT_BF16: tl.constexpr, BLOCK_R: tl.constexpr,
                                 BLOCK_NB: tl.constexpr, BK: tl.constexpr, ROWS_PER_SCALE: tl.constexpr):
    """q: E4M3 bytes (uint8) [rows, nb * BK]; s: fp32 scales [ceil(rows / ROWS_PER_SCALE), nb]; out: bf16 bits as
    int16 or fp32 bits as int32, q's shape. The element's exact fp32 value (the integer path, _mx_magnitude_bits)
    times its scale, one IEEE fp32 multiply; to bf16 by an integer rounding (the interpreter's casts truncate)."""
    offs, mask, _, smask = _tile_offsets(rows, nb, BLOCK_R, BLOCK_NB, BK)
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    b = tl.program_id(1) * BLOCK_NB + tl.arange(0, BLOCK_NB)
    scale = tl.load(s_ptr + (r // ROWS_PER_SCALE).to(tl.int64)[:, None] * nb + b[None, :], mask=smask,
                    other=1.0)[:, :, None]
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    enc = q & 0x7F
    mag = _mx_magnitude_bits(enc, 0).to(tl.float32, bitcast=True)
    v = tl.where((q >> 7) == 1, -mag, mag) * scale
    bits = v.to(tl.int32, bitcast=True)
    nan = (enc == 0x7F) | (scale != scale)
    if OUT_BF16:
        m = bits & 0x7FFFFFFF
        rb = (m + 0x7FFF + ((m >> 16) & 1)) >> 16 | (((bits >> 31) & 1) << 15)
        rb = tl.where(nan, _BF16_QNAN, rb)
        tl.store(out_ptr + offs, tl.where(rb >= 32768, rb - 65536, rb).to(tl.int16), mask=mask)
    else:
        tl.store(out_ptr + offs, tl.where(nan, _F32_QNAN, bits), mask=mask)


def _fp8_block_tiles(rows: int, nb: int, block_rows: int):
    """(BLOCK_R, BLOCK_NB, num_warps) of the fp8-block kernels: 128x128 blocks take one block a program (8 warps);
    1x128 blocks 16 rows x 1 block on the GPU (2048 elements, as _tiles), more under the interpreter."""
    if block_rows == FP8_BLOCK:
        return FP8_BLOCK, 1, 8
    cap_r, cap_b = (32, 4) if planning.interpreting() else (16, 1)
    return min(cap_r, triton.next_power_of_2(rows)), min(cap_b, triton.next_power_of_2(nb)), 4


def quantize_fp8_block(x: torch.Tensor, block_rows: int = 1) -> FP8BlockTensor:
    """Block-scaled FP8 quantization of x (bf16 [rows, K], contiguous; CUDA, or the CPU under TRITON_INTERPRET=1;
    K % 128 == 0) with the MX quantizer's kernel on 128-element blocks (power-of-two scales, RCEIL: module
    docstring). block_rows 1 gives 1x128 blocks, 128 gives 128x128. Bit-identical to quantize_fp8_block_ref."""
    _check_block_rows(block_rows)
    _check_mx_matrix("x", x, (torch.bfloat16,), kernel=True)
    rows, k = x.shape
    _check_fp8_block_k("x", k)
    payload = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(fp8_block_scale_shape(rows, k, block_rows), dtype=torch.float32, device=x.device)
    if rows and k:
        nb = k // FP8_BLOCK
        br, bnb, warps = _fp8_block_tiles(rows, nb, block_rows)
        _quantize_kernel[(-(-rows // br), -(-nb // bnb))](
            x.view(torch.int16), payload.view(torch.uint8), scales.view(torch.int32), rows, nb, BLOCK_R=br,
            BLOCK_NB=bnb, BK=FP8_BLOCK, ROW_BLOCK=block_rows == FP8_BLOCK, SCALE_F32=True, num_warps=warps)
    return FP8BlockTensor(payload, scales, block_rows)


def dequantize_fp8_block(t: FP8BlockTensor, dtype=torch.bfloat16) -> torch.Tensor:
    """payload * scale per block as ``dtype`` (bf16 or fp32) [rows, K], with one Triton kernel; bit-identical to
    dequantize_fp8_block_ref (interpreter and sm_90)."""
    rows, k = check_fp8_block("t", t)
    _check_out_dtype(dtype)
    payload, scales, block_rows = t
    out = torch.empty((rows, k), dtype=dtype, device=payload.device)
    if out.numel():
        nb = k // FP8_BLOCK
        br, bnb, warps = _fp8_block_tiles(rows, nb, block_rows)
        bits = out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        _dequantize_fp8_block_kernel[(-(-rows // br), -(-nb // bnb))](
            payload.view(torch.uint8), scales, bits, rows, nb, OUT_BF16=dtype == torch.bfloat16, BLOCK_R=br,
            BLOCK_NB=bnb, BK=FP8_BLOCK, ROWS_PER_SCALE=block_rows, num_warps=warps)
    return out
