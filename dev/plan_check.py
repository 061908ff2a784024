"""Why a bench row's host time may miss the launch plans' fast path (a developer probe, session 10).

    PYTHONPATH=. python -m dev.plan_check

For two GEMMs (a one-wave and a many-wave one), both TP ops at W=1: the host time per call and the plan
counters (kosmos.launch_plan.plan_stats) over (1) 200 back-to-back calls and (2) the bench's own timing loop
(kosmos_bench.timing.time_op: L2 flush, barrier, GPU spin, then the call), plus each plan's state and the
reason when its fast path is off.
"""
import statistics
import time

import torch

import kosmos
from kosmos.core import launch_plan, runtime
from kosmos_bench import timing


def _plans():
    out = []
    for ws in runtime._WORKSPACES.values():
        for key, plan in getattr(ws, "_plans", {}).items():
            kl = getattr(plan, "launch", None)
            out.append((key[0] if isinstance(key, tuple) else key, getattr(kl, "state", None),
                        getattr(kl, "reason", None)))
    return out


def main():
    torch.backends.cuda.matmul.allow_tf32 = False
    for m, n, k in [(512, 1536, 7168), (4096, 4096, 4096)]:
        a = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        b = (torch.randn(k, n, device="cuda") / k ** 0.5).to(torch.bfloat16)
        for name, fn in [("ag", lambda: kosmos.all_gather_matmul(a, b)[1]),
                         ("rs", lambda: kosmos.matmul_reduce_scatter(a, b))]:
            kosmos.reset_workspaces()
            launch_plan.reset_plan_stats()
            fn()
            torch.cuda.synchronize()
            hs = []
            for _ in range(200):
                t0 = time.perf_counter()
                fn()
                hs.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize()
            s1 = dict(launch_plan.plan_stats())
            t = timing.time_op(fn, iters=20, warmup=5)
            s2 = dict(launch_plan.plan_stats())
            print(f"{name} {m}x{n}x{k}: back-to-back {statistics.median(hs):.1f} us, time_op host "
                  f"{t['host_ms'] * 1e3:.1f} us, device {t['time_ms']:.4f} ms; stats after loop {s1}; "
                  f"after time_op {s2}; plans {_plans()}", flush=True)


if __name__ == "__main__":
    main()
