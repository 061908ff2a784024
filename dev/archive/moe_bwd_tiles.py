"""Tile variants of the MoE backward's expert GEMM kernels, and the forward with and without save_gu, timed on
one GPU in one process (a developer probe; issue 15).

    python -m dev.archive.moe_bwd_tiles [--model qwen3-235b] [--tokens 4096] [--json OUT.jsonl] [--only dgrad2,wgrad1]

The rows are a uniform top-k assignment of ``--tokens`` tokens (each token's k experts drawn without
replacement), the operands N(0, 1) bf16 (weights scaled by 1/sqrt(fan-in)), fresh per run; every variant is
timed with kosmos_bench.timing.time_op (L2 flushed, median of --iters) and checked against the default variant's
output (relative Frobenius error; the default itself against torch._grouped_mm on the same rows). Kernels:

  dgrad2   expert_dgrad2_swiglu(dy_rows, gu, W2, w, counts, emit_h=True)    vs grouped_mm(dy_rows, W2^T)
  wgrad2   expert_weight_grads(h, do, counts)                               vs grouped_mm(h^T, do)
  wgrad1   expert_weight_grads(x_rows, dgu, counts)                         vs grouped_mm(x_rows^T, dgu)
           (their "flat" variants: expert_weight_grads_padded on the operands padded once, untimed; the
           "wgrad2-pad" / "wgrad1-pad" rows time that padding copy alone)
  dgrad1   expert_dgrad1(dgu, W13, counts)                                  vs grouped_mm(dgu, W13^T)
  forward  kosmos.moe_forward(return_routing=True) with save_gu False / True (the training forward's cost)

A variant that fails to compile or run is a row with its error; the sweep goes on. Prints a table last.
"""
from __future__ import annotations

import argparse
import math
import time

import torch

from dev.rows import Rows

# dgrad2: (mode, tiles). "fused": expert_dgrad2_swiglu's epilogue kernel; "unfused": the dgrad1 GEMM kernel for
# z (bf16) then the SwiGLU-backward pass; "gemm-only": that GEMM alone (what the fused epilogue costs on top)
# Session 12 call b (qwen3 4k): fused 1.244 ms, gemm-only 128x256 s4 0.797 (1.04x torch), unfused 128x256 s4
# 0.947 (kept: DGRAD2_FUSED = False), s3 0.972, unfused 128x128 1.211
DGRAD2 = [("unfused", (128, 256, 64, 8, 4)), ("unfused", (64, 256, 64, 4, 4)), ("gemm-only", (64, 256, 64, 4, 4)),
          ("fused", (128, 128, 64, 8, 4))]
# wgrad: (kernel, tiles[, programs per SM]). Session 12 call b (qwen3 4k): TMA stores lost at 2 and 3 stages
# (wgrad2 1.33 / 1.50 ms vs 1.24; removed since), 128x256 with them 1.29; now: more, smaller programs per SM so that
# one's tile store overlaps the others' MMAs (few rows per expert: the store is as long as the MMA work)
WGRAD = [("persistent", (128, 128, 64, 8, 3)), ("flat", (128, 256, 64, 8, 3)), ("flat", (256, 128, 64, 8, 3)),
         # session 13 call j: a TMA-store epilogue on the flat loop lost (the kernel docstring), removed
         ("persistent", (128, 128, 64, 4, 2, 2)),
         ("persistent", (128, 128, 64, 4, 3, 2)), ("persistent", (128, 128, 32, 8, 4, 2)),
         ("persistent", (128, 128, 64, 8, 2, 2)),
         # the flat loop on the padded row layout (expert_weight_grads_padded; session 12, not timed yet): the
         # operands padded once outside the timed call (pad_expert_rows; its cost is the "<kernel>-pad" row)
         ("flat", (128, 128, 64, 8, 2)), ("flat", (128, 128, 64, 8, 3)),
         ("flat", (128, 128, 64, 4, 2)),
         # session 13: deepseek-v3 8k zipf:1.2's wgrad2 at 0.82x torch on 128x256 s3 (call f): the transposed tile
         # (now second and third, beside 128x256), fewer stages, a shorter row step with more
         ("flat", (128, 256, 64, 8, 2)), ("flat", (128, 256, 32, 8, 4))]
# Session 12 call c: at deepseek-v3 4k (~128 rows per expert) wgrad2 128x128x64 with 4 warps, 2 stages, 2 per SM
# 3.76 ms vs 4.09 (8 warps, 3 stages); 128x64 / 64x128 at 3-4 per SM 4.41-4.72; at qwen3 4k (~256 rows) the
# 4-warp tile ties on wgrad2 (1.237) and loses on wgrad1 (2.44 vs 2.10); 128x128x32 s4 wins wgrad2 (1.203),
# loses wgrad1 (2.23). Smaller tiles lose everywhere.
DGRAD1 = [(128, 256, 64, 8, 4), (64, 256, 64, 4, 4), (64, 256, 64, 4, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 4)]
# dgrad1 at ~128 rows per expert: a 128-row m-tile of an expert with 129-161 rows is mostly empty; 64 rows waste less
KERNELS = ("dgrad2", "wgrad2", "wgrad1", "dgrad1", "forward")


def rel(a, b, chunk: int = 1 << 26) -> float:
    """||a - b|| / ||b|| in fp64 sums over fp32 chunks (deepseek-v3's dW13 is 15 GB in bf16: no fp32 copy)."""
    a, b = a.reshape(-1), b.reshape(-1)
    num = den = 0.0
    for i in range(0, a.numel(), chunk):
        x, y = a[i:i + chunk].float(), b[i:i + chunk].float()
        num += (x - y).double().square().sum().item()
        den += y.double().square().sum().item()
    return (num / max(den, 1e-60)) ** 0.5


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-235b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--routing", default=None, help="the bench's routing (uniform | zipf:S) through the model's "
                    "router (moe_reference.route on the bench's inputs); default: a random top-k per token")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--only", default=",".join(KERNELS), help="comma-separated subset of " + ", ".join(KERNELS))
    ap.add_argument("--max-seconds", type=float, default=240.0, help="start no new variant past this")
    args = ap.parse_args(argv)
    start = time.monotonic()
    if not torch.cuda.is_available():
        raise SystemExit("moe_bwd_tiles times GPU kernels: no CUDA device here")
    import kosmos
    from kosmos.ops.moe_backward import layout as bwd_layout, multi_launch as bwd_multi
    from kosmos.models import MOE_MODELS
    from kosmos_bench import timing
    only = set(args.only.split(","))
    m = MOE_MODELS[args.model]
    t, h, f, e, k = args.tokens, m.hidden, m.expert_ffn, m.experts, m.top_k
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    rn = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device=dev) * scale).to(torch.bfloat16)  # noqa: E731
    if args.routing:  # the bench's decision for this point (its router inputs and weights, then dropped)
        from dev.moe_bwd_probe import build_point, point_model
        experts = build_point(point_model(args.model), t, args.routing, device=dev, decision="route").experts
        torch.cuda.empty_cache()
    else:
        experts = torch.rand(t, e, generator=g, device=dev).topk(k, dim=1).indices
    counts = torch.bincount(experts.reshape(-1), minlength=e)
    r = t * k
    offs = torch.cumsum(counts.to(torch.int32), 0, dtype=torch.int32)
    w13, w2 = rn(e, h, 2 * f, scale=h ** -0.5), rn(e, f, h, scale=f ** -0.5)
    x_rows, dy_rows, gu, dgu, hh, do = rn(r, h), rn(r, h), rn(r, 2 * f), rn(r, 2 * f), rn(r, f), rn(r, h)
    w_pair = torch.rand(r, generator=g, device=dev)
    rows = Rows(args.json)

    def emit(row):
        rows.emit(row)
        print(f"  {row['kernel']:<8} {row['variant']:<28} {row['status']:<7} "
              f"{row.get('time_ms') or float('nan'):8.4f} ms  {row.get('tflops') or float('nan'):5.0f} TF/s  "
              f"vs torch {row.get('vs_torch') or float('nan'):5.3f}  "
              f"err {float('nan') if row.get('rel_err') is None else row['rel_err']:.1e}"
              + ("" if row.get("bitwise_default") is None else f"  bitwise {row['bitwise_default']}")
              + (f"  {row.get('reason')}" if row.get("reason") else ""), flush=True)

    def sweep(kernel, variants, fn, ref_fn, flops, pick=lambda o: o, comparable=True):
        if kernel not in only:
            return
        ref_t = timing.time_op(ref_fn, iters=args.iters, warmup=args.warmup)["time_ms"]
        ref_out = ref_fn()
        default_out = None
        for i, v in enumerate(variants):
            row = dict(type="variant", kernel=kernel, variant=str(v), default=i == 0, model=m.name, tokens=t,
                       rows=r, status="ok", torch_ms=ref_t)
            if time.monotonic() - start > args.max_seconds:
                row.update(status="skipped", reason="deadline")
                emit(row)
                continue
            try:
                o = pick(fn(v))
                torch.cuda.synchronize()
                if default_out is not None and o.shape == default_out.shape:
                    row["rel_err"], row["rel_err_vs"] = rel(o, default_out), "default variant"
                    if o.dtype == default_out.dtype and o.element_size() == 2:
                        row["bitwise_default"] = bool(torch.equal(o.view(torch.int16), default_out.view(torch.int16)))
                elif ref_out is not None and (comparable or default_out is not None) and o.shape == ref_out.shape:
                    # dgrad2's outputs are its epilogue's, not the GEMM's; its gemm-only rows are the GEMM's
                    row["rel_err"], row["rel_err_vs"] = rel(o, ref_out), "torch"
                if default_out is None:
                    default_out = o
                    if o.numel() * o.element_size() > 2 ** 32:  # deepseek-v3's dW13 (15 GB): compare the rest
                        ref_out = None                          # with the default only, or it runs out of memory
                if not all(torch.isfinite(c.float()).all() for c in o.reshape(-1).split(1 << 28)):
                    row.update(status="failed", reason="non-finite output")
                tm = timing.time_op(lambda: fn(v), iters=args.iters, warmup=args.warmup)
                row.update(time_ms=tm["time_ms"], p20_ms=tm["p20_ms"], p80_ms=tm["p80_ms"])
                row["tflops"] = flops / (tm["time_ms"] * 1e-3) / 1e12
                row["vs_torch"] = ref_t / tm["time_ms"]
            except Exception as err:  # noqa: BLE001 -- a variant that does not compile is a finding
                row.update(status="failed", reason=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}")
            o = None  # before the next variant's output is allocated
            emit(row)
        del ref_out, default_out
        torch.cuda.empty_cache()

    gm = torch._grouped_mm
    print(f"moe_bwd_tiles: {m.name} {args.routing or 'random top-k'} T={t} H={h} F={f} E={e} k={k} rows={r} "
          f"(per expert {int(counts.min())}.."
          f"{int(counts.max())})", flush=True)
    def dgrad2(v):
        mode, tiles = v
        if mode == "gemm-only":  # z alone, returned as a 1-tuple: compared with nothing (its own kind of output)
            return (bwd_multi.expert_dgrad1(dy_rows, w2, counts, tiles=tiles),)
        return bwd_multi.expert_dgrad2_swiglu(dy_rows, gu, w2, w_pair, counts, emit_h=True, tiles=tiles,
                                       fused=mode == "fused")

    sweep("dgrad2", DGRAD2, dgrad2, lambda: gm(dy_rows, w2.transpose(1, 2), offs=offs), 2 * r * h * f,
          pick=lambda o: o[0], comparable=False)
    pad_offs = bwd_layout.padded_row_offsets(counts)
    r_pad = bwd_layout.padded_rows_bound(r, e)
    padded = {}

    def wgrad(kernel, a, b, v):
        """One wgrad variant; "flat" on a, b padded once per sweep (the copy outside the timed call)."""
        if v[0] != "flat":
            return bwd_multi.expert_weight_grads(a, b, counts, kernel=v[0], tiles=v[1])
        if kernel not in padded:
            padded.clear()
            padded[kernel] = pad_ab(a, b)
            torch.cuda.synchronize()
        return bwd_multi.expert_weight_grads_padded(*padded[kernel], counts, pad_offs, tiles=v[1])

    def pad_ab(a, b):
        return bwd_layout.pad_expert_rows(a, counts, pad_offs, r_pad), bwd_layout.pad_expert_rows(b, counts, pad_offs, r_pad)

    def pad_row(kernel, a, b):
        """What the padding copy costs (pad_expert_rows on both operands: torch gathers, not a fused kernel)."""
        if kernel not in only or time.monotonic() - start > args.max_seconds:
            return
        row = dict(type="pad", kernel=f"{kernel}-pad", variant="pad_expert_rows(a), (b)", model=m.name, tokens=t,
                   rows=r, padded_rows=r_pad, status="ok")
        try:
            tm = timing.time_op(lambda: pad_ab(a, b), iters=args.iters, warmup=args.warmup)
            row.update(time_ms=tm["time_ms"], p20_ms=tm["p20_ms"], p80_ms=tm["p80_ms"])
        except Exception as err:  # noqa: BLE001
            row.update(status="failed", reason=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}")
        emit(row)
        padded.clear()
        torch.cuda.empty_cache()

    sweep("wgrad2", WGRAD, lambda v: wgrad("wgrad2", hh, do, v), lambda: gm(hh.t(), do, offs=offs), 2 * r * h * f)
    pad_row("wgrad2", hh, do)
    sweep("wgrad1", WGRAD, lambda v: wgrad("wgrad1", x_rows, dgu, v), lambda: gm(x_rows.t(), dgu, offs=offs),
          4 * r * h * f)
    pad_row("wgrad1", x_rows, dgu)
    sweep("dgrad1", DGRAD1, lambda v: bwd_multi.expert_dgrad1(dgu, w13, counts, tiles=v),
          lambda: gm(dgu, w13.transpose(1, 2), offs=offs), 4 * r * h * f)
    if "forward" in only:
        x, wr = rn(t, h), rn(e, h, scale=h ** -0.5)
        for save in (False, True, False, True):  # interleaved twice
            row = dict(type="variant", kernel="forward", variant=f"save_gu={save}", model=m.name, tokens=t, rows=r,
                       status="ok")
            try:
                call = lambda: kosmos.moe_forward(x, wr, w13, w2, top_k=k, return_routing=True,  # noqa: E731
                                                  save_gu=save)
                call()
                tm = timing.time_op(call, iters=args.iters, warmup=args.warmup)
                row.update(time_ms=tm["time_ms"], p20_ms=tm["p20_ms"], p80_ms=tm["p80_ms"],
                           tflops=6 * r * h * f / (tm["time_ms"] * 1e-3) / 1e12)
            except Exception as err:  # noqa: BLE001
                row.update(status="failed", reason=f"{type(err).__name__}: {str(err).strip().splitlines()[0][:200]}")
            emit(row)
    rows.close()
    print("\n== best per kernel (time_ms; the default first)")
    for kern in KERNELS:
        ok = [x for x in rows if x["kernel"] == kern and x["status"] == "ok" and x.get("time_ms")]
        if ok:
            best = min(ok, key=lambda x: x["time_ms"])
            print(f"  {kern:<8} default {ok[0]['time_ms']:.4f}  best {best['time_ms']:.4f} {best['variant']}"
                  f"  torch {ok[0].get('torch_ms') or float('nan'):.4f}  geo-check {math.isfinite(best['time_ms'])}")
    return rows


if __name__ == "__main__":
    main()
