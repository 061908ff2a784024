"""The MoE backward's variants (expert-row layouts, the one launch), A/B in one process (issue 15; a developer
probe, not product code).

    PYTHONPATH=. python -m dev.moe_bwd_layout_ab --model deepseek-v3 --json $OUT/layout-ab.jsonl   # one H200
        [--tokens 4096] [--routing uniform] [--passes 3] [--iters 20] [--warmup 5] [--host-profile N]
        [--variants packed,padded]      # or padded,one-launch: the one launch against the launches it replaces
        [--trace DIR]                   # then one traced call of the one launch: per-stage table, timeline JSON

``moe_backward_w1(padded=False)`` (the rows packed by expert, the persistent wgrad kernel) against
``padded=True`` (each expert's rows from a multiple of 64, zero gap rows, the flat wgrad loop) on one point of
the MoE bench (dev.moe_bwd_probe.build_point: the bench's inputs, the kosmos forward's decision and its saved
g | u), interleaved ``--passes`` times, each call timed as the bench times the backward (kosmos_bench.timing,
L2 flushed, median of --iters). The two layouts' gradients are compared bit for bit once, one tensor at a time
(deepseek-v3's dW13 is 15 GB). The same tree and process for both: the layout is a call argument. ``--variants`` names what is compared, the
first being the base of the bitwise check and of the ratios: ``packed``, ``padded``, ``one-launch`` (the padded
layout with the expert part in one persistent launch, ``one_launch=True``, the router backward inside it too by
default: dx and d_router then fp32-level, not bitwise, against the others) or ``one-launch-torch-router`` (the
router backward after the launch as torch ops: bitwise ``padded``).
``--trace DIR``: after the passes, one call of the one launch with its trace buffer (expert_backward_one_launch's
``trace=``): per task kind (dgrad2, swiglu-bwd, dgrad1, wgrad2, wgrad1, unpermute, wait) the task count, first
start, last end and busy time per program, printed and kept as a row; the timeline JSON goes to DIR (draw it
with ``kosmos report --timeline FILE``).
``--host-profile N``: then cProfile over N back-to-back calls of the default layout (where the ~3-5 ms of host
time per backward call go), the top functions by own time printed and kept as a row.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from dev.rows import Rows

# each variant: moe_backward_w1's keywords and kosmos.MoEBackwardConfig fields (``config``)
VARIANTS = {"packed": dict(padded=False), "padded": dict(padded=True),
            "one-launch": dict(padded=True, one_launch=True),
            # the one launch with the router backward after it (torch ops; the default puts it inside the launch)
            "one-launch-torch-router": dict(padded=True, one_launch=True, router_in_launch=False),
            # the one launch without its WGRAD1 rendezvous (session 20)
            "one-launch-nosync": dict(padded=True, one_launch=True, config=dict(wgrad1_sync=False)),
            # the one launch with 4/16 of each wgrad loop's tiles claimed in runs (s20h: 1/16)
            "one-launch-dyn4": dict(padded=True, one_launch=True, config=dict(wgrad_dynamic_16ths=4)),
            # ... and those runs 16 tiles long (default 8): half the flat-loop restarts
            "one-launch-dyn4-run16": dict(padded=True, one_launch=True,
                                          config=dict(wgrad_dynamic_16ths=4, wgrad_dynamic=16)),
            # the one launch's DGRAD1 with session 20's per-task wait and release
            "one-launch-strict": dict(padded=True, one_launch=True, config=dict(dgrad1_lean=False)),
            # the one launch's SWIGLU pass as the nested loops, unpipelined
            "one-launch-swiglu-nested": dict(padded=True, one_launch=True, config=dict(swiglu_stages=1))}


def parse_variants(text: str) -> list[str]:
    """--variants: two or more names of VARIANTS, comma-separated, no repeats; SystemExit naming a bad one."""
    names = [v.strip() for v in text.split(",") if v.strip()]
    if bad := [v for v in names if v not in VARIANTS]:
        raise SystemExit(f"moe_bwd_layout_ab: unknown variant {bad[0]!r}; known: {', '.join(VARIANTS)}")
    if len(names) < 2 or len(set(names)) != len(names):
        raise SystemExit(f"moe_bwd_layout_ab: --variants needs two or more different names, got {text!r}")
    return names


def traced_one_launch(call, model: str, args, rows) -> None:
    """One call of the one launch with a trace buffer (expert_backward_one_launch(trace=) through a wrapper: the
    public call has no trace argument); its per-kind table printed and emitted, its timeline JSON written."""
    import json
    import os
    from dev.moe_probe import kind_table, trace_events
    from kosmos.core import runtime
    from kosmos.core.codes import TRACE_EVENTS
    from kosmos.ops.moe_backward import one_launch as bwd_one
    grid = runtime.num_sms(torch.device("cuda", torch.cuda.current_device()))
    buf = torch.zeros((grid, TRACE_EVENTS.value, 4), dtype=torch.int64, device="cuda")
    real = bwd_one.expert_backward_one_launch
    bwd_one.expert_backward_one_launch = lambda *a, **k: real(*a, **k, trace=buf)
    try:
        call("one-launch")  # compiles the traced variant
        buf.zero_()
        torch.cuda.synchronize()
        call("one-launch")
        torch.cuda.synchronize()
        runtime.check_errors()
    finally:
        bwd_one.expert_backward_one_launch = real
    events = trace_events(buf)
    text = kind_table([events], grid)
    print(f"{model} {args.tokens} {args.routing}: the one launch traced ({len(events)} events)\n{text}", flush=True)
    rows.emit({"type": "trace_table", "model": model, "tokens": args.tokens, "routing": args.routing, "table": text})
    os.makedirs(args.trace, exist_ok=True)
    doc = {"type": "trace", "op": "moe_bwd", "model": model, "tokens": args.tokens, "routing": args.routing,
           "world": 1, "impl": "kosmos-one-launch", "kinds": {str(k): v for k, v in runtime.TRACE_KINDS.items()},
           "ranks": [{"rank": 0, "events": events}]}
    name = f"trace-moe-bwd-one-launch-{model}-{args.tokens}-{args.routing.replace(':', '')}.json"
    with open(os.path.join(args.trace, name), "w") as f:
        json.dump(doc, f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-235b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--routing", default="uniform")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--host-profile", type=int, default=0, metavar="N")
    ap.add_argument("--trace", default=None, metavar="DIR")
    ap.add_argument("--variants", default="packed,padded", help=f"comma-separated, the first the base: {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    variants = parse_variants(args.variants)
    if not torch.cuda.is_available():
        raise SystemExit("moe_bwd_layout_ab: needs a CUDA device")
    from dev.moe_bwd_probe import GRAD_NAMES, build_point, point_model
    from kosmos.core import runtime
    from kosmos.ops.moe_backward.api import moe_backward_w1
    from kosmos_bench import timing
    from kosmos_bench.environment import environment
    torch.backends.cuda.matmul.allow_tf32 = False
    runtime.ensure_triton_allocator()
    rows = Rows(args.json)
    m = point_model(args.model)
    pt = build_point(m, args.tokens, args.routing, device="cuda", decision="kosmos")
    inp = pt.inp
    env = environment(argv=["python", "-m", "dev.moe_bwd_layout_ab"] + list(sys.argv[1:] if argv is None else argv),
                      bench="moe", suite={"probe": "moe_bwd_layout_ab", **vars(args)})
    env.update(probe="moe_bwd_layout_ab", model=m.name, tokens=args.tokens, routing=args.routing,
               rows=int(pt.experts.numel()), gu_saved=pt.saved is not None)
    rows.emit(env)

    from kosmos.config import MoEBackwardConfig

    def call(variant):
        kw = dict(VARIANTS[variant])
        kw_all = dict(inp.backward_kw(), config=MoEBackwardConfig(**kw.pop("config", {})))
        return moe_backward_w1(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy, pt.weights, pt.experts,
                               saved_gu=pt.saved, **kw, **kw_all)

    # bitwise against the base, one gradient at a time (each call recomputes all four; one pair is kept)
    base = variants[0]
    for other in variants[1:]:
        same = {}
        for i, name in enumerate(GRAD_NAMES):
            a = call(base)[i]
            b = call(other)[i]
            same[name] = bool(torch.equal(a, b))
            del a, b
            torch.cuda.empty_cache()
        rows.emit({"type": "bitwise", "model": m.name, "tokens": args.tokens, "routing": args.routing,
                   "base": base, "variant": other, **same})
        print(f"{m.name} {args.tokens} {args.routing}: {other} bitwise {base}: {same}", flush=True)
    times = {lay: [] for lay in variants}
    for p in range(args.passes):
        for lay in variants:
            t0 = time.monotonic()
            tm = timing.time_op(lambda: call(lay), iters=args.iters, warmup=args.warmup)
            torch.cuda.empty_cache()
            peak = torch.cuda.max_memory_allocated() / 2 ** 30
            rows.emit({"type": "time", "model": m.name, "tokens": args.tokens, "routing": args.routing, "pass": p,
                       "variant": lay, **tm, "peak_gib": round(peak, 1), "wall_s": round(time.monotonic() - t0, 1)})
            times[lay].append(tm["time_ms"])
            print(f"  pass {p} {lay:<10} {tm['time_ms']:.3f} ms (p20 {tm['p20_ms']:.3f}, p80 {tm['p80_ms']:.3f}, "
                  f"host {tm['host_ms']:.2f})", flush=True)
    med = {lay: statistics.median(v) for lay, v in times.items()} if args.passes else {}  # (2 passes: the mean)
    if med:
        print(f"{m.name} {args.tokens} {args.routing}, median of {args.passes} passes: "
              + ", ".join(f"{v} {med[v]:.3f} ms ({med[v] / med[base]:.3f}x {base})" for v in variants), flush=True)
    if args.trace:
        traced_one_launch(call, m.name, args, rows)
    if args.host_profile:
        import cProfile
        import io
        import pstats
        moe_backward_w1(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy, pt.weights, pt.experts,
                        saved_gu=pt.saved, **inp.backward_kw())
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for _ in range(args.host_profile):
            moe_backward_w1(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy, pt.weights, pt.experts,
                            saved_gu=pt.saved, **inp.backward_kw())
        prof.disable()
        host_ms = (time.perf_counter() - t0) * 1e3 / args.host_profile
        torch.cuda.synchronize()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        rows.emit({"type": "host_profile", "model": m.name, "tokens": args.tokens, "calls": args.host_profile,
                   "host_ms_per_call_profiled": host_ms, "top_by_tottime": text.getvalue()[-12000:]})
        print(f"host profile ({args.host_profile} calls, {host_ms:.2f} ms each under cProfile):", flush=True)
        print("\n".join(text.getvalue().splitlines()[:45]), flush=True)
    rows.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
