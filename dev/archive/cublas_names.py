"""Which cuBLAS kernel torch.matmul runs on a shape, and how long it takes (a developer probe, not product code).

    PYTHONPATH=. python -m dev.archive.cublas_names [--shapes MxNxK,...] [--json OUT.jsonl]

Issue 13's grid shapes still under 0.90x of cuBLAS are few-tile ones (M <= 512, or K = 1024). cuBLAS's kernel
names say what it does there that the static W=1 GEMM does not: the tile (``tilesize128x128x64``), a thread-block
cluster (``cluster2x1x1``: TMA multicast of the shared operand, halving its L2 -> SM traffic), split-K or
stream-K (``splitK`` / ``segment_k`` / ``stream_k`` in the name, or a second reduction kernel). Per shape: each
CUDA kernel one torch.matmul launches (torch.profiler, 10 calls after warm-up, L2 not flushed), its mean device
time, and planning.w1_plan's plan for the same shape beside it.
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch

from kosmos.core import planning, runtime

# the grid shapes under 0.90x at 488c5f1 (results/h200x1/tp-grid-w1.md), and two near 0.90
DEFAULT_SHAPES = ("256x1536x1024,512x3072x2048,256x4096x4096,512x5120x5120,256x6144x8192,256x8192x2048,"
                  "4096x1536x4096,512x1536x7168,1024x3072x8192,6000x1536x1024,2048x5120x4096,2048x1536x5120")


def kernels_of(a, b, calls: int = 10):
    """[(kernel name, mean device us)] of one torch.matmul(a, b), from ``calls`` profiled calls."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(5):
        torch.matmul(a, b)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.matmul(a, b)
        torch.cuda.synchronize()
    total = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time
    return [(name, us / calls) for name, us in sorted(total.items(), key=lambda kv: -kv[1])]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    sms = runtime.num_sms(torch.device("cuda"))
    out = open(args.json, "a") if args.json else None
    for shape in args.shapes.split(","):
        m, n, k = (int(v) for v in shape.split("x"))
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        plan = planning.w1_plan(m, n, k, programs=sms)
        ks = kernels_of(a, b)
        print(f"{shape}: kosmos plan {plan.tile.BM}x{plan.width} split {plan.split} stream_k {plan.stream_k} "
              f"per_sm {plan.per_sm}")
        for name, us in ks:
            print(f"    {us:8.1f} us  {name}")
        if out:
            out.write(json.dumps(dict(shape=shape, m=m, n=n, k=k, kernels=ks, plan=repr(plan))) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
