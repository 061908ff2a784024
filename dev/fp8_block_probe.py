"""First look at the block-scaled FP8 GEMM on a GPU (a developer probe, not product code):

    PYTHONPATH=. python -m dev.fp8_block_probe [--shapes MxNxK,...] [--json OUT.jsonl]

Per shape (A [M, K] bf16 activations, W [N, K] bf16 weight, both random): quantizes A (1x128) and W (128x128)
with kosmos.quant, checks gemm.w1_static.fp8_block_matmul against reference.fp8_block_matmul_ref (the fp64 product
of the dequantized operands) and reports its error against the bf16 inputs' fp32 product; then times, on the same
operands (L2 flushed, kosmos_bench.timing.time_op): ``kosmos`` (fp8_block_matmul on pre-quantized operands),
``cublas-bf16`` (torch.matmul A @ W^T in bf16), ``cublas-fp8-block`` (torch._scaled_mm with the 1x128 / 128x128
scales, where this torch accepts them: the scale layouts tried are listed in the row), and ``quantize-a``
(quant.quantize_fp8_block of A alone). Prints a table last.

PREDICTION (session 28, before any run): kosmos 0.75-0.9x the bf16 cuBLAS time at 8192^3 on an H200 (per-step
promotion costs ~10-20% of the FP8 peak; 128x128 tiles); cublas-fp8-block 0.55-0.65x; quantize-a ~3-5% of the
bf16 GEMM at K = 8192.
"""
import argparse
import json
import sys

import torch

from kosmos import quant, reference
from kosmos.gemm.w1_static import fp8_block_matmul
from kosmos_bench.timing import time_op

SHAPES = "8192x8192x8192,8192x4096x8192,4096x14336x4096,16384x8192x3584,2048x1536x8192"


def scaled_mm_blockwise(a8, sa, w8, sw):
    """torch._scaled_mm on the DeepSeek recipe, trying the scale layouts torch versions have asked for; returns
    (fn, layout name) of the first that runs, or (None, last error)."""
    err = None
    for name, sa_, sw_ in [("sa outer-major, sw^T", sa.t().contiguous().t(), sw.t()),
                           ("sa outer-major, sw^T contiguous", sa.t().contiguous().t(), sw.t().contiguous()),
                           ("sa row-major, sw^T", sa, sw.t())]:
        fn = lambda sa_=sa_, sw_=sw_: torch._scaled_mm(a8, w8.t(), scale_a=sa_, scale_b=sw_,  # noqa: E731
                                                       out_dtype=torch.bfloat16)
        try:
            fn()
            torch.cuda.synchronize()
            return fn, name
        except Exception as e:  # noqa: BLE001 -- recorded in the row
            err = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return None, err


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    out = open(args.json, "w") if args.json else None
    for spec in args.shapes.split(","):
        m, n, k = map(int, spec.split("x"))
        g = torch.Generator(device="cuda").manual_seed(m + n + k)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
        a, b = quant.quantize_fp8_block(x, 1), quant.quantize_fp8_block(w, 128)
        c = fp8_block_matmul(a, b)
        torch.cuda.synchronize()
        row = dict(shape=spec, m=m, n=n, k=k,
                   rel_err=reference.rel_err(c, reference.fp8_block_matmul_ref(a, b)),
                   rel_err_bf16=reference.rel_err(c, x.float() @ w.float().t()),
                   bitwise_repeat=bool(torch.equal(c, fp8_block_matmul(a, b))))
        flops = 2 * m * n * k
        timed = {"kosmos": lambda: fp8_block_matmul(a, b), "cublas-bf16": lambda: x @ w.t(),
                 "quantize-a": lambda: quant.quantize_fp8_block(x, 1)}
        fn, why = scaled_mm_blockwise(a.payload, a.scales, b.payload, b.scales)
        row["cublas_fp8_block_layout"] = why
        if fn is not None:
            timed["cublas-fp8-block"] = fn
            row["rel_err_cublas_fp8_block"] = reference.rel_err(fn(), reference.fp8_block_matmul_ref(a, b))
        for name, f in timed.items():
            t = time_op(f, iters=20, warmup=5)
            row[f"{name}_ms"] = t["time_ms"]
            if name != "quantize-a":
                row[f"{name}_tflops"] = flops / t["time_ms"] / 1e9
        base = row["cublas-bf16_ms"]
        row["kosmos_vs_bf16"] = row["kosmos_ms"] / base
        if "cublas-fp8-block_ms" in row:
            row["kosmos_vs_fp8_block"] = row["kosmos_ms"] / row["cublas-fp8-block_ms"]
        rows.append(row)
        if out:
            out.write(json.dumps(row) + "\n")
            out.flush()
        print(json.dumps(row), file=sys.stderr)
    print(f"{'shape':>18} {'rel_err':>8} {'err_bf16':>8} {'kosmos':>8} {'TF/s':>6} {'bf16':>8} {'fp8blk':>8} "
          f"{'k/bf16':>6} {'k/fp8b':>6} {'quantA':>7}")
    for r in rows:
        print(f"{r['shape']:>18} {r['rel_err']:8.1e} {r['rel_err_bf16']:8.1e} {r['kosmos_ms']:8.3f} "
              f"{r['kosmos_tflops']:6.0f} {r['cublas-bf16_ms']:8.3f} {r.get('cublas-fp8-block_ms', float('nan')):8.3f} "
              f"{r['kosmos_vs_bf16']:6.3f} {r.get('kosmos_vs_fp8_block', float('nan')):6.3f} {r['quantize-a_ms']:7.3f}")


if __name__ == "__main__":
    main()
