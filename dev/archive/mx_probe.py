"""MXFP8 on one H200: which compute path, and what the pieces cost (a developer probe; not product code).

    PYTHONPATH=. python -m dev.archive.mx_probe [--seqs 4096,8192] [--json OUT.jsonl]
    PYTHONPATH=. python -m dev.archive.mx_probe --quantize-only [--json OUT.jsonl]   # quantize_mx alone, a quick A/B

Per llama3-70b TP=2 per-rank GEMM at W=1 (device time, L2 flushed, kosmos_bench.timing): torch.matmul bf16,
the kosmos bf16 op, the kosmos op with an MX A operand expanded in the GEMM's load path (scale bytes loaded
per element, or per block and broadcast), dequantize-then-bf16-kosmos, quantize_mx / dequantize_mx alone,
Triton's tl.dot_scaled at each candidate tile, and cuBLAS FP8 rowwise (torch._scaled_mm). Every output is
checked against the fp32 product of the dequantized MX values; registers/spills of the MX kernels printed.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import triton
import triton.language as tl

import kosmos
from kosmos import quant, reference
from kosmos.models import tp_gemms
from kosmos_bench.dot_scaled import DOT_SCALED_CANDIDATES, dot_scaled_matmul
from kosmos_bench.timing import time_op

def rowwise_fp8(x):
    """(fp8 e4m3 payload, fp32 per-row scale [rows, 1]) with amax / 448 per row."""
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scale = amax / 448.0
    return (x.float() / scale).to(torch.float8_e4m3fn), scale


def quant_tiles(x, a_mx):
    """quantize / dequantize kernels at other (BLOCK_R, BLOCK_NB, warps) tiles: ms."""
    rows, k = x.shape
    nb = k // 32
    res = {}
    for br, bnb, warps in ((8, 8, 4), (16, 16, 4), (32, 8, 4), (8, 32, 4), (32, 16, 8), (64, 8, 8)):
        grid = (triton.cdiv(rows, br), triton.cdiv(nb, bnb))
        p = torch.empty_like(a_mx.payload)
        s = torch.empty_like(a_mx.scales)
        out = torch.empty_like(x)
        q = lambda: quant._quantize_kernel[grid](x.view(torch.int16), p.view(torch.uint8), s, rows, nb,  # noqa
                                                  BLOCK_R=br, BLOCK_NB=bnb, num_warps=warps)
        d = lambda: quant._dequantize_kernel[grid](a_mx.payload.view(torch.uint8), a_mx.scales,  # noqa
                                                    out.view(torch.int16), rows, nb, OUT_BF16=True, BLOCK_R=br,
                                                    BLOCK_NB=bnb, num_warps=warps)
        res[f"q{br}x{bnb}w{warps}"] = time_op(q, iters=10, warmup=2)["time_ms"]
        res[f"d{br}x{bnb}w{warps}"] = time_op(d, iters=10, warmup=2)["time_ms"]
    return res


QUANTIZE_SHAPES = ((4096, 8192), (8192, 8192), (4096, 4096), (8192, 7168), (4096, 28672))


def quantize_only(args) -> int:
    """quantize_mx's device time (L2 flushed) per shape, its traffic rate, and a bitwise check of its output."""
    out = open(args.json, "a") if args.json else None
    for rows, k in QUANTIZE_SHAPES:
        gen = torch.Generator(device="cuda").manual_seed(rows + k)
        x = (torch.randn(rows, k, device="cuda", generator=gen) * 3).to(torch.bfloat16)
        p, s = quant.quantize_mx(x)
        rp, rs = quant.quantize_mx_ref(x)
        same = torch.equal(p.view(torch.uint8), rp.view(torch.uint8).cuda()) and torch.equal(s, rs.cuda())
        ms = time_op(lambda: quant.quantize_mx(x), iters=args.iters, warmup=3)["time_ms"]
        tbs = rows * k * (2 + 1 + 1 / 32) / ms / 1e9
        print(f"quantize_mx [{rows}, {k}]: {ms:.4f} ms, {tbs:.2f} TB/s, bitwise the reference: {same}")
        if out:
            out.write(json.dumps({"probe": "quantize_mx", "rows": rows, "k": k, "time_ms": ms, "tb_s": tbs,
                                  "bitwise": same}) + "\n")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json", default=None)
    ap.add_argument("--quantize-only", action="store_true",
                    help="time quantize_mx alone on the llama3-70b and MoE activation shapes (checked bit for bit "
                         "against quantize_mx_ref) and stop")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    if args.quantize_only:
        return quantize_only(args)
    rows = []
    out = open(args.json, "a") if args.json else None
    for seq in [int(s) for s in args.seqs.split(",")]:
        for g in tp_gemms("llama3-70b", seq, 2):
            m, n, k = g.m, g.n, g.k
            gen = torch.Generator(device="cuda").manual_seed(m + n + k)
            x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
            w = (torch.randn(n, k, device="cuda", generator=gen) / math.sqrt(k)).to(torch.bfloat16)
            a_mx = quant.quantize_mx(x)
            w_mx = quant.quantize_mx(w)
            b = quant.mx_round(w).t().contiguous()  # [K, N] row-major, the MX weight's exact values
            ref = a_mx.dequantize(torch.float32) @ b.float()
            t = lambda fn: time_op(fn, iters=args.iters, warmup=3)["time_ms"]  # noqa: E731
            res = {"shape": f"{g.layer}-{seq}", "m": m, "n": n, "k": k}
            x_deq = a_mx.dequantize()
            res["cublas_bf16"] = t(lambda: x_deq @ b)
            bf16_op = (lambda: kosmos.all_gather_matmul(x_deq, b)[1]) if g.op == "ag_gemm" else \
                (lambda: kosmos.matmul_reduce_scatter(x_deq, b))
            res["kosmos_bf16"] = t(bf16_op)
            errs = {}
            op = (lambda a: kosmos.all_gather_matmul(a, b)[1]) if g.op == "ag_gemm" else \
                (lambda a: kosmos.matmul_reduce_scatter(a, b))
            c = op(a_mx)
            torch.cuda.synchronize()
            errs["kosmos_mx"] = reference.rel_err(c, ref)
            res["kosmos_mx"] = t(lambda: op(a_mx))
            res["kosmos_mx_from_bf16"] = t(lambda: op(quant.quantize_mx(x)))
            res["deq_then_bf16"] = t(lambda: (kosmos.all_gather_matmul(a_mx.dequantize(), b)[1]
                                              if g.op == "ag_gemm" else
                                              kosmos.matmul_reduce_scatter(a_mx.dequantize(), b)))
            res["quantize"] = t(lambda: quant.quantize_mx(x))
            res["dequantize"] = t(lambda: a_mx.dequantize())
            best = None
            for tile in DOT_SCALED_CANDIDATES:
                try:
                    c = dot_scaled_matmul(a_mx, w_mx, tile)
                    torch.cuda.synchronize()
                    e = reference.rel_err(c, ref)
                    tt = t(lambda: dot_scaled_matmul(a_mx, w_mx, tile))
                    res[f"dot_scaled_{'x'.join(map(str, tile))}"] = tt
                    errs[f"dot_scaled_{tile}"] = e
                    best = tt if best is None else min(best, tt)
                except Exception as e:  # noqa: BLE001
                    errs[f"dot_scaled_{tile}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            res["dot_scaled_best"] = best
            print("errs", errs, flush=True)
            xa, sa = rowwise_fp8(x)
            wb, sb = rowwise_fp8(w)
            res["fp8_rowwise"] = t(lambda: torch._scaled_mm(xa, wb.t(), scale_a=sa, scale_b=sb.t(),
                                                              out_dtype=torch.bfloat16))
            res["fp8_rowwise_rowquant"] = t(lambda: rowwise_fp8(x))
            if g.layer == "qkv":
                res.update(quant_tiles(x, a_mx))
            res["errs"] = errs
            rows.append(res)
            if out:
                out.write(json.dumps(res) + "\n")
                out.flush()
            print(json.dumps(res), flush=True)
    from kosmos.ops import all_gather_matmul as ag, matmul_reduce_scatter as rs
    try:  # Triton internals: a probe may read them
        for kern in (ag._all_gather_matmul_kernel, rs._matmul_reduce_scatter_kernel):
            for cache in kern.device_caches.values():
                for key, ck in cache[0].items():
                    print("regs", kern.fn.__name__, str(key)[-60:], ck.n_regs, "spills", ck.n_spills)
    except Exception as e:  # noqa: BLE001
        print("regs: not read", e)
    cols = ["cublas_bf16", "kosmos_bf16", "kosmos_mx", "kosmos_mx_from_bf16", "deq_then_bf16", "quantize", "dequantize",
            "dot_scaled_best", "fp8_rowwise"]
    print("shape".ljust(16) + "".join(c[:12].rjust(13) for c in cols))
    for r in rows:
        print(r["shape"].ljust(16) + "".join(
            (f"{r[c]:.4f}" if isinstance(r.get(c), float) else "-").rjust(13) for c in cols))
    print("ratios to cublas_bf16 (time): " + ", ".join(
        f"{c} {math.exp(sum(math.log(r[c] / r['cublas_bf16']) for r in rows) / len(rows)):.3f}"
        for c in cols[1:] if all(isinstance(r.get(c), float) for r in rows)))


if __name__ == "__main__":
    main()
