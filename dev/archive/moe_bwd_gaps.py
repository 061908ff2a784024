"""Where the MoE backward's GPU idles between its kernels (issue 15; a developer probe, not product code).

    PYTHONPATH=. python -m dev.archive.moe_bwd_gaps --model deepseek-v3 --tokens 4096 --routing zipf:1.2

Session 20: the one launch's kernel spans 18.9 ms at deepseek-v3 4k zipf:1.2 (its trace) and the torch ops before it
~1.2 ms, yet a call times 20.4 ms with the host hidden; at 8k 28.7 + ~2.0 against 32.3. This profiles one call of
each variant (torch.profiler, CUDA kernels and copies/memsets, after warm-up, the host kept ahead by a spin as the
bench does) and prints every kernel in order with its start, duration and the idle gap before it, the gaps over
``--gap-us`` first, then the sums: kernel time, idle time, first start to last end.
"""
from __future__ import annotations

import argparse

import torch


def profile_call(fn, spin_cycles: int):
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(spin_cycles)  # the host enqueues the call while the GPU spins (timing.time_op's way)
        fn()
        torch.cuda.synchronize()
    evs = sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda x: x[0])
    return [e for e in evs if "sleep" not in e[2].lower()]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--routing", default="zipf:1.2")
    ap.add_argument("--variants", default="padded,one-launch")
    ap.add_argument("--gap-us", type=float, default=30.0)
    args = ap.parse_args()
    from dev.moe_bwd_layout_ab import VARIANTS
    from dev.moe_bwd_probe import build_point, point_model
    from kosmos.core import runtime
    from kosmos.ops.moe_backward.api import moe_backward_w1
    torch.backends.cuda.matmul.allow_tf32 = False
    runtime.ensure_triton_allocator()
    pt = build_point(point_model(args.model), args.tokens, args.routing, device="cuda", decision="kosmos")
    inp = pt.inp
    for variant in args.variants.split(","):
        def fn():
            return moe_backward_w1(inp.x, inp.router_weight, inp.w13, inp.w2, inp.dy, pt.weights, pt.experts,
                                   saved_gu=pt.saved, **VARIANTS[variant], **inp.backward_kw())
        evs = profile_call(fn, 20_000_000)  # ~10 ms of spin: more than any variant's host time
        t0 = evs[0][0]
        busy = sum(e - s for s, e, _ in evs)
        gaps, prev_end = [], t0
        print(f"\n== {variant}: {len(evs)} kernels, first start to last end {(evs[-1][1] - t0) / 1e3:.3f} ms, "
              f"kernel time {busy / 1e3:.3f} ms")
        for s, e, name in evs:
            gap = s - prev_end
            gaps.append(max(gap, 0))
            if gap > args.gap_us:
                print(f"  gap {gap:8.1f} us before {name[:90]} (at {(s - t0) / 1e3:.3f} ms)")
            prev_end = max(prev_end, e)
        print(f"  idle {sum(gaps) / 1e3:.3f} ms in {sum(g > 0 for g in gaps)} gaps")
        for s, e, name in sorted(evs, key=lambda x: x[0] - x[1])[:12]:
            print(f"  {(e - s) / 1e3:8.3f} ms at {(s - t0) / 1e3:7.3f}  {name[:90]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
