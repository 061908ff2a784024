"""Does the GEMM's speed depend on its operands' bits? (session 23: kosmos's W = 1 MXFP8 op measured 0.94-0.96x
of cuBLAS bf16 at fc1, below the bf16 GEMM itself.)

    PYTHONPATH=. python -m dev.archive.mx_data_probe [--json OUT.jsonl]

At each llama3-70b TP=2 per-rank shape, interleaved for R rounds (kosmos_bench.timing.time_op: L2 flushed, host
hidden): torch.matmul on the bf16 operands (randn, the bench's make_inputs scale); torch.matmul on their MX values
(quant.mx_round of A and of the weight along K: 3 mantissa bits each, the operands kosmos's MX op multiplies);
kosmos's bf16 op on those MX values; kosmos's op with precision="mxfp8" from bf16 A and the MX weight. The first two
separate the data effect (tensor-core power with fewer toggling bits -> clocks) from the op's own cost; the last
two the row pass. Prints one table (median of the rounds' medians, ms and ratios). A developer probe."""
import argparse
import statistics

import torch

SHAPES = {"qkv-4k": (4096, 5120, 8192), "fc1-8k": (8192, 28672, 8192), "attn_out-8k": (8192, 8192, 4096),
          "fc2-16k": (16384, 8192, 14336)}


def main(argv=None):
    import kosmos
    from kosmos import quant
    from kosmos_bench.timing import time_op
    from dev.rows import Rows
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(23)
    rows = Rows(args.json)  # each row written as it is ready
    for name, (m, n, k) in SHAPES.items():
        a = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
        a_mx, w_mx = quant.mx_round(a), quant.mx_round(w)
        calls = {
            "cublas bf16 operands": lambda: torch.matmul(a, w.t()),
            "cublas MX values": lambda: torch.matmul(a_mx, w_mx.t()),
            "kosmos bf16 op on MX values": lambda: kosmos.all_gather_matmul(a_mx, w_mx.t())[1],
            "kosmos mxfp8 op (from bf16 A)": lambda: kosmos.all_gather_matmul(a, w_mx.t(), precision="mxfp8")[1],
        }
        times = {v: [] for v in calls}
        for _ in range(args.rounds):
            for v, fn in calls.items():
                times[v].append(time_op(fn, iters=20, warmup=5)["time_ms"])
        base = statistics.median(times["cublas bf16 operands"])
        for v in calls:
            t = statistics.median(times[v])
            rows.emit(dict(shape=name, variant=v, time_ms=t, ratio=t / base, rounds=times[v]))
        del a, w, a_mx, w_mx
        torch.cuda.empty_cache()
    print(f"{'shape':<12} {'variant':<32} {'ms':>8} {'/ cuBLAS bf16':>14}")
    for r in rows:
        print(f"{r['shape']:<12} {r['variant']:<32} {r['time_ms']:8.3f} {r['ratio']:14.3f}")


if __name__ == "__main__":
    main()
