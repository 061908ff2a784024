"""Why does the host enqueue time per eager call swing between ~22 and ~40 us from one measurement to the next?
(session 24, dev/fixed_cost --plans --fast-only: both an old tree and this one, and torch.matmul alone 13-21 us,
bimodal across rounds of one process.)

    PYTHONPATH=. python -m dev.host_noise [--rounds 6]

Each round measures kosmos_bench.timing.host_enqueue_us (200 back-to-back calls after 1 s of warm-up) of
torch.matmul and of kosmos.all_gather_matmul (bf16, W=1, a plan hit) on a [128, 256] @ [256, 256] GEMM, in four
modes, interleaved: as the bench runs it; the process pinned to the CPU it is on (os.sched_setaffinity); pinned
with the garbage collector off; and with the warm-up calls synchronised every 64 calls (the launch queue never
fills during warm-up). Prints one line per round and the median and spread per mode. A developer probe."""
import argparse
import gc
import os
import statistics

import torch


def main(argv=None):
    import kosmos
    from kosmos_bench import timing
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args(argv)
    a = torch.randn(128, 256, device="cuda").to(torch.bfloat16)
    b = torch.randn(256, 256, device="cuda").to(torch.bfloat16)
    calls = {"torch.matmul": lambda: a @ b, "kosmos ag bf16": lambda: kosmos.all_gather_matmul(a, b)}
    all_cpus = os.sched_getaffinity(0)

    def plain(fn):
        return timing.host_enqueue_us(fn)["host_us"]

    def current_cpu():
        with open("/proc/self/stat") as f:  # field 39: the CPU this process last ran on
            return int(f.read().rsplit(")", 1)[1].split()[36])

    def pinned(fn):
        os.sched_setaffinity(0, {current_cpu()})
        try:
            return timing.host_enqueue_us(fn)["host_us"]
        finally:
            os.sched_setaffinity(0, all_cpus)

    def pinned_nogc(fn):
        gc.disable()
        try:
            return pinned(fn)
        finally:
            gc.enable()

    def synced_warmup(fn):
        n = [0]

        def warm():
            fn()
            n[0] += 1
            if n[0] % 64 == 0:
                torch.cuda.synchronize()
        for _ in range(2000):  # ~1 s of warm-up calls, the queue drained every 64
            warm()
        return timing.host_enqueue_us(fn, warm_s=0.0)["host_us"]
    modes = {"bench": plain, "pinned": pinned, "pinned+nogc": pinned_nogc, "synced warm-up": synced_warmup}
    seen = {}
    for r in range(args.rounds):
        line = []
        for mode, how in modes.items():
            for name, fn in calls.items():
                us = how(fn)
                seen.setdefault((mode, name), []).append(us)
                line.append(f"{mode}/{name} {us:5.1f}")
        print(f"round {r}: cpu {current_cpu()}: " + "  ".join(line), flush=True)
    print(f"{'mode':<16} {'call':<16} {'median':>7} {'min':>6} {'max':>6}")
    for (mode, name), v in seen.items():
        print(f"{mode:<16} {name:<16} {statistics.median(v):7.1f} {min(v):6.1f} {max(v):6.1f}")
    print("cpus:", len(all_cpus), "loadavg:", os.getloadavg())


if __name__ == "__main__":
    main()
