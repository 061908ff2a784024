"""The MoE layer on transformers' expert-weight layout against the kernels' own, interleaved in one process (a
developer probe, not product code).

    PYTHONPATH=. python -m dev.moe_weight_layout_ab --json $OUT/layout.jsonl          # one GPU
        [--shapes qwen3-30b-a3b,mixtral-8x7b,deepseek-v3-e64] [--passes 3] [--iters 20] [--warmup 5]

Per shape, the same bf16 values twice: ``native`` (w13 [E, H, 2F], w2 [E, F, H] contiguous) and ``hf`` (the
contiguous gate_up_proj [E, 2F, H] / down_proj [E, H, F] passed as their ``.transpose(1, 2)``, read as they are
by the kernels). Each pass times both layouts' forward (``kosmos.nn.moe``) and forward+backward
(``torch.autograd.grad`` of the output against x, the router and both weights: no gradient accumulation) with
kosmos_bench.timing.time_op (L2 flushed, median of --iters). Checked first: the forward's outputs bitwise equal,
the gradients within 1e-3 relative (a summation order apart). Rows: one per (shape, layout, direction, pass);
last, a table of hf / native per shape and direction (median over the passes).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from dev.rows import Rows

# name -> (experts, hidden, expert ffn, top_k, tokens, routing keywords); transformers' own configs' sizes
SHAPES = {
    "qwen3-30b-a3b": (128, 2048, 768, 8, 8192, dict(routing="softmax", renormalize=True)),
    "mixtral-8x7b": (8, 4096, 14336, 2, 4096, dict(routing="softmax", renormalize=True)),
    # DeepSeek-V3's hidden and expert sizes with 64 of its 256 experts (its grouping: 8 groups of 8, top 4)
    "deepseek-v3-e64": (64, 7168, 2048, 8, 4096, dict(routing="sigmoid-grouped", n_group=8, topk_group=4,
                                                      routed_scaling=2.5, renormalize=True)),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def build(name: str, seed: int = 0):
    """The shape's inputs, its weights in both layouts (the same values) and its routing keywords."""
    e, h, f, k, t, rkw = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g, device="cuda") * scale).to(torch.bfloat16)  # noqa
    x, dy = rnd(t, h), rnd(t, h)
    router = rnd(e, h, scale=h ** -0.5)
    w13, w2 = rnd(e, h, 2 * f, scale=h ** -0.5), rnd(e, f, h, scale=f ** -0.5)
    kw = dict(rkw)
    bias = torch.randn(e, generator=g, device="cuda") * 0.01 if kw["routing"] == "sigmoid-grouped" else None
    native = (w13, w2)
    gate_up, down = w13.transpose(1, 2).contiguous(), w2.transpose(1, 2).contiguous()
    return x, dy, router, bias, native, (gate_up, down), k, kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    if bad := [s for s in names if s not in SHAPES]:
        raise SystemExit(f"moe_weight_layout_ab: unknown shape {bad[0]!r}; known: {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        raise SystemExit("moe_weight_layout_ab: needs a CUDA device")
    import kosmos
    from kosmos.nn import moe
    from kosmos_bench import timing
    from kosmos_bench.environment import environment
    rows = Rows(args.json)
    rows.emit(environment(sys.argv))
    summary = []
    for name in names:
        x, dy, router, bias, native, hf, k, kw = build(name)
        e, h, f = router.shape[0], x.shape[1], native[1].shape[1]
        layouts = {"native": native, "hf": (hf[0].transpose(1, 2), hf[1].transpose(1, 2))}
        params = {"native": native, "hf": hf}

        def fwd(layout):
            with torch.no_grad():
                return moe(x, router, *layouts[layout], top_k=k, bias=bias, **kw)

        def fwd_bwd(layout):
            leaves = [t.detach().requires_grad_(True) for t in (x, router, *params[layout])]
            w13, w2 = leaves[2:] if layout == "native" else (leaves[2].transpose(1, 2), leaves[3].transpose(1, 2))
            y = moe(leaves[0], leaves[1], w13, w2, top_k=k, bias=bias, **kw)
            return torch.autograd.grad(y, leaves, dy)

        y_n, y_h = fwd("native"), fwd("hf")
        g_n, g_h = fwd_bwd("native"), fwd_bwd("hf")
        g_h = [g_h[0], g_h[1], g_h[2].transpose(1, 2), g_h[3].transpose(1, 2)]  # into native's layout to compare
        checks = dict(forward_bitwise=bool(torch.equal(y_n, y_h)),
                      grad_rel={n: _rel(a, b) for n, a, b in zip(("dx", "d_router", "dw13", "dw2"), g_h, g_n)})
        kosmos.check_errors()
        ok = checks["forward_bitwise"] and all(v < 1e-3 for v in checks["grad_rel"].values())
        print(f"{name}: E {e} H {h} F {f} k {k} T {x.shape[0]}; forward bitwise {checks['forward_bitwise']}, "
              f"gradients rel {checks['grad_rel']}", flush=True)
        rows.emit({"type": "check", "shape": name, "ok": ok, **checks})
        del y_n, y_h, g_n, g_h
        flops = {"fwd": 6 * x.shape[0] * k * h * f, "fwd+bwd": 18 * x.shape[0] * k * h * f}
        times = {}
        for p in range(args.passes):
            for direction, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                for layout in ("native", "hf"):
                    r = timing.time_op(lambda: fn(layout), iters=args.iters, warmup=args.warmup)
                    times.setdefault((direction, layout), []).append(r["time_ms"])
                    rows.emit({"type": "result", "shape": name, "layout": layout, "direction": direction,
                               "pass": p, "tflops": flops[direction] / r["time_ms"] / 1e9, **r})
        for direction in ("fwd", "fwd+bwd"):
            n = statistics.median(times[(direction, "native")])
            hh = statistics.median(times[(direction, "hf")])
            summary.append((name, direction, n, hh, ok))
            rows.emit({"type": "summary", "shape": name, "direction": direction, "native_ms": n, "hf_ms": hh,
                       "hf_over_native": hh / n, "checks_ok": ok})
        del x, dy, router, native, hf, layouts, params
        torch.cuda.empty_cache()
    rows.close()
    print(f"{'shape':<16} {'direction':<8} {'native ms':>10} {'hf ms':>10} {'hf/native':>9} checks")
    for name, direction, n, hh, ok in summary:
        print(f"{name:<16} {direction:<8} {n:>10.3f} {hh:>10.3f} {hh / n:>9.3f} {'ok' if ok else 'FAILED'}")
    return 0 if all(s[4] for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
