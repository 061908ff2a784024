"""Time a TP kernel's W-rank protocol on ONE GPU (a developer's device script; simulated ranks, see simranks).

    PYTHONPATH=. python -m dev.sim_probe --op ag --world 2 --ms 4096 --k 8192 --n 5120

W simulated ranks share the GPU (SMs // W programs each) and "NVLink" is local HBM, so the times are not
those of W GPUs and must never be reported as such. What they are good for: an A/B of a kernel change that
affects the SM-side cost of the W > 1 code path (per-tile work, waits, claims) when no multi-GPU machine is
at hand -- run the same command from two source trees in one device call and compare. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=["ag", "rs"], default="ag")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--ms", type=int, default=4096, help="rows per rank (M / W)")
    ap.add_argument("--k", type=int, default=8192)
    ap.add_argument("--n", type=int, default=5120)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--policy", default="self")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU")
    from kosmos.core import runtime
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from simranks import AG, RS  # the tests' simulated-rank harness
    runtime.ensure_triton_allocator()
    torch.backends.cuda.matmul.allow_tf32 = False
    grid = runtime.num_sms(torch.device("cuda")) // args.world
    cls = AG if args.op == "ag" else RS
    t = cls(args.world, args.ms, args.k, args.n, seed=1, device="cuda", grid=grid, timeout_ns=5_000_000_000)
    t.new_epoch_inputs()
    pol = dict(policy=args.policy) if args.policy == "self" else dict(policy="fixed", comm_programs=grid // 4)
    epoch = 0
    for _ in range(3):  # compile + warm up
        epoch += 1
        t.launch_all(epoch, **pol)
    torch.cuda.synchronize()
    times = []
    for _ in range(args.iters):
        epoch += 1
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t.launch_all(epoch, **pol)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    for r in range(args.world):
        t.rk.check_clean(r)
    t.check_outputs()
    times.sort()
    print(json.dumps({"op": args.op, "world": args.world, "ms": args.ms, "k": args.k, "n": args.n, "grid": grid,
                      "policy": args.policy, "median_ms": times[len(times) // 2], "min_ms": times[0],
                      "simulated": True}))


if __name__ == "__main__":
    main()
