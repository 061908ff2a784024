"""Why MX rows expand at ~1.4 TB/s inside the TP ops (a developer probe; not product code).

    PYTHONPATH=. python -m dev.deq_probe

Times ``kernels.common.mx_dequant_rows`` alone in a persistent launch (each program takes 32-row runs of an
MX [8192, 8192] matrix in turn, as the DEQ tasks do) for several (ROWS, NB, warps, programs), plus the
standalone ``quant.dequantize_mx`` and a plain bf16 copy of the same output bytes (HBM reference). Prints
TB/s of traffic (payload + scales read, bf16 written) and checks the bits against dequantize_mx.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kosmos import quant
from kosmos.kernels.common import mx_dequant_rows
from kosmos_bench.timing import time_op


@triton.jit
def _deq_all(q_ptr, s_ptr, out_ptr, rows, K, ROWS: tl.constexpr, NB: tl.constexpr):
    n_runs = tl.cdiv(rows, ROWS)
    for run in range(tl.program_id(0), n_runs, tl.num_programs(0)):
        r0 = run * ROWS
        row = r0.to(tl.int64)
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
    for rows_per, nb, warps in ((32, 16, 8), (32, 16, 4), (16, 16, 4), (8, 32, 4), (32, 8, 8), (64, 8, 8),
                                (16, 32, 8), (4, 64, 4)):
        for progs in (132, 264, 32):
            fn = lambda: _deq_all[(progs,)](mx.payload, mx.scales, out, rows, k, ROWS=rows_per, NB=nb,  # noqa
                                            num_warps=warps)
            try:
                fn()
                torch.cuda.synchronize()
                ok = torch.equal(out.view(torch.int16), want.view(torch.int16))
                ms = time_op(fn, iters=10, warmup=2)["time_ms"]
                res.append((f"rows{rows_per} nb{nb} w{warps} p{progs}", ms, traffic / ms / 1e9, ok))
            except Exception as e:  # noqa: BLE001
                res.append((f"rows{rows_per} nb{nb} w{warps} p{progs}", None, str(e).splitlines()[0][:80], False))
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
