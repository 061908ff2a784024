"""Why MX rows expand at ~1.4 TB/s inside the TP ops (a developer probe; not product code).

    PYTHONPATH=. python -m dev.archive.deq_probe

Times ``kernels.common.mx_dequant_rows`` alone in a persistent launch (each program takes 32-row runs of an
MX [8192, 8192] matrix in turn, as the DEQ tasks do) for several (ROWS, NB, warps, programs), plus the
standalone ``quant.dequantize_mx`` and a plain bf16 copy of the same output bytes (HBM reference). Prints
TB/s of traffic (payload + scales read, bf16 written) and checks the bits against dequantize_mx.

A fork of kosmos.ops.tp_dequant.mx_dequant_rows (as of 490b226, then kernels/common.py; its loop is unchanged
since): _expand is its expansion expression; _dequant_rows_x2 / _dequant_rows_pipelined / _dequant_rows_int /
_dequant_rows_tma are its loop with two steps' loads issued before either step's stores, the loop as a tl.range
over 3 stages, the integer E4M3 expansion (_expand_int) instead of the conversion, and TMA boxes pipelined over
STAGES with TMA stores. Variant 0 runs the product's function itself (imported).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kosmos import quant
from kosmos.quant import mx_scale_f32
from kosmos.ops.tp_dequant import mx_dequant_rows
from kosmos_bench.timing import time_op


@triton.jit
def _expand(q, sb):
    return (q.to(tl.float32) * mx_scale_f32(sb)[:, :, None]).to(tl.bfloat16)


@triton.jit
def _expand_int(q, sb):
    """Candidate (session 9): E4M3 -> fp32 by integer ops instead of conversion instructions. The payload byte's
    low 7 bits shifted to bit 20 are the fp32 bits of |q| * 2**-120 for normal and subnormal E4M3 alike (the
    fp32 subnormal case needs IEEE denormals in the multiply); the scale 2**(S-127) is applied as
    2**(min(S,134)-7) then 2**(max(S,134)-134) (each a normal fp32, the first product exact); NaN payloads
    (0x7F) and the NaN scale (0xFF) give NaN."""
    qb = q.to(tl.uint8, bitcast=True).to(tl.int32)
    f = (((qb & 0x7F) << 20) | ((qb & 0x80) << 24)).to(tl.float32, bitcast=True)
    a = ((tl.minimum(sb, 134) + 120) << 23).to(tl.float32, bitcast=True)
    b = tl.where(sb == 255, float("nan"), ((tl.maximum(sb, 134) - 7) << 23).to(tl.float32, bitcast=True))
    v = f * a[:, :, None] * b[:, :, None]
    return tl.where((qb & 0x7F) == 0x7F, float("nan"), v).to(tl.bfloat16)


@triton.jit
def _dequant_rows_int(q_ptr, s_ptr, out_ptr, rows, K, ROWS: tl.constexpr, NB: tl.constexpr):
    """Candidate: the product's single-step loop with the integer expansion."""
    KB = K // 32
    r = tl.arange(0, ROWS)
    b = tl.arange(0, NB)
    j = tl.arange(0, 32)
    soffs = r[:, None] * KB + b[None, :]
    offs = soffs[:, :, None] * 32 + j[None, None, :]
    rmask = (r < rows)[:, None]
    for b0 in range(0, KB, NB):
        smask = rmask & (b[None, :] < KB - b0)
        sb = tl.load(s_ptr + b0 + soffs, mask=smask, other=127).to(tl.int32)
        q = tl.load(q_ptr + b0 * 32 + offs, mask=smask[:, :, None], other=0.0)
        tl.store(out_ptr + b0 * 32 + offs, _expand_int(q, sb), mask=smask[:, :, None])


@triton.jit
def _dequant_rows_x2(q_ptr, s_ptr, out_ptr, rows, K, ROWS: tl.constexpr, NB: tl.constexpr):
    """Candidate for mx_dequant_rows: two steps' loads issued before either step's stores (twice the bytes in
    flight per program; the same arithmetic)."""
    KB = K // 32
    r = tl.arange(0, ROWS)
    b = tl.arange(0, NB)
    j = tl.arange(0, 32)
    soffs = r[:, None] * KB + b[None, :]
    offs = soffs[:, :, None] * 32 + j[None, None, :]
    rmask = (r < rows)[:, None]
    for b0 in range(0, KB, 2 * NB):
        m0 = rmask & (b[None, :] < KB - b0)
        m1 = rmask & (b[None, :] < KB - b0 - NB)
        s0 = tl.load(s_ptr + b0 + soffs, mask=m0, other=127).to(tl.int32)
        s1 = tl.load(s_ptr + b0 + NB + soffs, mask=m1, other=127).to(tl.int32)
        q0 = tl.load(q_ptr + b0 * 32 + offs, mask=m0[:, :, None], other=0.0)
        q1 = tl.load(q_ptr + (b0 + NB) * 32 + offs, mask=m1[:, :, None], other=0.0)
        tl.store(out_ptr + b0 * 32 + offs, _expand(q0, s0), mask=m0[:, :, None])
        tl.store(out_ptr + (b0 + NB) * 32 + offs, _expand(q1, s1), mask=m1[:, :, None])


@triton.jit
def _dequant_rows_pipelined(q_ptr, s_ptr, out_ptr, rows, K, ROWS: tl.constexpr, NB: tl.constexpr):
    """Candidate: the single-step loop as a tl.range with num_stages=3 (Triton's pipeliner may then issue the
    next steps' loads early as asynchronous copies)."""
    KB = K // 32
    r = tl.arange(0, ROWS)
    b = tl.arange(0, NB)
    j = tl.arange(0, 32)
    soffs = r[:, None] * KB + b[None, :]
    offs = soffs[:, :, None] * 32 + j[None, None, :]
    rmask = (r < rows)[:, None]
    for b0 in tl.range(0, KB, NB, num_stages=3):
        smask = rmask & (b[None, :] < KB - b0)
        sb = tl.load(s_ptr + b0 + soffs, mask=smask, other=127).to(tl.int32)
        q = tl.load(q_ptr + b0 * 32 + offs, mask=smask[:, :, None], other=0.0)
        tl.store(out_ptr + b0 * 32 + offs, _expand(q, sb), mask=smask[:, :, None])


@triton.jit
def _dequant_rows_tma(q_desc, s_ptr, o_desc, r0, rows, K, ROWS: tl.constexpr, NB: tl.constexpr,
                      STAGES: tl.constexpr, INT: tl.constexpr):
    """Candidate (session 9): TMA loads of [ROWS, NB, 32] payload boxes (3-D descriptor over [rows, K/32, 32])
    pipelined over STAGES by tl.range, bf16 written by TMA stores: bytes in flight without registers."""
    KB = K // 32
    r = tl.arange(0, ROWS)
    b = tl.arange(0, NB)
    soffs = r[:, None] * KB + b[None, :]
    rmask = (r < rows)[:, None]
    for b0 in tl.range(0, KB, NB, num_stages=STAGES):
        q = q_desc.load([r0, b0, 0])
        smask = rmask & (b[None, :] < KB - b0)
        sb = tl.load(s_ptr + b0 + soffs, mask=smask, other=127).to(tl.int32)
        if INT:
            o_desc.store([r0, b0, 0], _expand_int(q, sb))
        else:
            o_desc.store([r0, b0, 0], (q.to(tl.float32) * mx_scale_f32(sb)[:, :, None]).to(tl.bfloat16))


@triton.jit
def _deq_all(q_ptr, s_ptr, out_ptr, q_desc, o_desc, rows, K, ROWS: tl.constexpr, NB: tl.constexpr,
             X2: tl.constexpr):
    n_runs = tl.cdiv(rows, ROWS)
    for run in range(tl.program_id(0), n_runs, tl.num_programs(0)):
        r0 = run * ROWS
        row = r0.to(tl.int64)
        if X2 == 5:  # the integer expansion, plain loads
            _dequant_rows_int(q_ptr + row * K, s_ptr + row * (K // 32), out_ptr + row * K,
                              tl.minimum(rows - r0, ROWS), K, ROWS, NB)
        elif X2 >= 3:  # 3: TMA, 3 stages; 4: TMA, 4 stages; 6: TMA, 3 stages, integer expansion
            _dequant_rows_tma(q_desc, s_ptr + row * (K // 32), o_desc, r0, tl.minimum(rows - r0, ROWS), K,
                              ROWS, NB, 3 if X2 == 6 else X2, X2 == 6)
        elif X2 == 2:
            _dequant_rows_pipelined(q_ptr + row * K, s_ptr + row * (K // 32), out_ptr + row * K,
                                    tl.minimum(rows - r0, ROWS), K, ROWS, NB)
        elif X2 == 1:
            _dequant_rows_x2(q_ptr + row * K, s_ptr + row * (K // 32), out_ptr + row * K,
                             tl.minimum(rows - r0, ROWS), K, ROWS, NB)
        else:
            mx_dequant_rows(q_ptr + row * K, s_ptr + row * (K // 32), out_ptr + row * K,
                            tl.minimum(rows - r0, ROWS), K, ROWS, NB)


def main():
    rows, k = 8192, 8192
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    mx = quant.quantize_mx(x)
    want = mx.dequantize()
    traffic = rows * k * (1 + 1 / 32 + 2)
    out = torch.empty_like(want)
    res = []
    # session 8 (04ee27a, results/h200x1/s8/deq-probe.log): the single-step kernel 2.4 TB/s at 132 programs,
    # ~3.0 at 264, 0.8 at 32 (~25 GB/s per program): the per-program rate is the limit inside the TP ops
    # x2: 0 the product's mx_dequant_rows, 1 two steps in flight, 2 a tl.range pipelined over 3 stages
    # x2 3 / 4: TMA boxes [ROWS, NB, 32] pipelined over 3 / 4 stages (session 9)
    from triton.tools.tensor_descriptor import TensorDescriptor
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    q3, o3 = mx.payload.view(rows, k // 32, 32), out.view(rows, k // 32, 32)
    # session 9 (bddcc85, results/h200x1/s9/deq-probe.log): per program at 8 programs 27 GB/s (v0 nb16) -> 45
    # (TMA nb32, 3 stages); 2-4 steps in flight barely help: the conversion instructions, not memory, limit it?
    # 5 / 6: the integer expansion (plain loads / TMA)
    for rows_per, nb, warps, x2 in ((32, 16, 8, 0), (32, 32, 8, 3), (32, 16, 8, 5), (32, 32, 8, 5), (32, 64, 8, 5),
                                    (32, 16, 8, 6), (32, 32, 8, 6)):
        qd = TensorDescriptor.from_tensor(q3, [rows_per, nb, 32])
        od = TensorDescriptor.from_tensor(o3, [rows_per, nb, 32])
        for progs in (132, 32, 8):
            fn = lambda: _deq_all[(progs,)](mx.payload, mx.scales, out, qd, od, rows, k, ROWS=rows_per,  # noqa
                                            NB=nb, X2=x2, num_warps=warps)
            try:
                out.fill_(float("nan"))  # poisoned: a variant that skips rows fails the bit check
                fn()
                torch.cuda.synchronize()
                ok = torch.equal(out.view(torch.int16), want.view(torch.int16))
                ms = time_op(fn, iters=10, warmup=2)["time_ms"]
                res.append((f"rows{rows_per} nb{nb} w{warps} v{x2} p{progs}", ms,
                            traffic / ms / 1e9, ok))
            except Exception as e:  # noqa: BLE001
                res.append((f"rows{rows_per} nb{nb} w{warps} x2={x2} p{progs}", None, str(e).splitlines()[0][:80],
                            False))
    ms = time_op(lambda: mx.dequantize(), iters=10, warmup=2)["time_ms"]
    res.append(("quant.dequantize_mx", ms, traffic / ms / 1e9, True))
    y = torch.empty_like(want)
    ms = time_op(lambda: y.copy_(want), iters=10, warmup=2)["time_ms"]
    res.append(("bf16 copy (4 B/elem)", ms, rows * k * 4 / ms / 1e9, True))
    for name, ms, tbs, ok in res:
        print(f"{name:28s} {ms if ms is None else round(ms, 4)!s:>8} ms  "
              f"{tbs if isinstance(tbs, str) else round(tbs, 2)!s:>8} TB/s  exact={ok}")


if __name__ == "__main__":
    main()
