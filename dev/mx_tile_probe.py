"""The W = 1 MXFP8 GEMM off the llama3 shapes: which tile, or which path, per shape? (session 24: the Gluon kernel
of kernels/w1_mx_matmul.py had one tile, 128 x 256, and shapes of few tiles left SMs idle.)

    PYTHONPATH=. python -m dev.mx_tile_probe [--shapes grid|MxNxK,...] [--rounds 2] [--json OUT.jsonl]

Per shape (default: the 48 GEMMs of suites/tp-grid.yaml), interleaved for R rounds (kosmos_bench.timing.time_op: L2
flushed, host hidden), A bf16 [M, K] rounded to MX inside each call (except ``bf16 op``), the weight's MX values
[N, K] (the gluon variants launch w1_mx_matmul's kernel directly, bound once):
  cublas bf16       torch.matmul on the bf16 operands (the bar's reference, the bench's t_gemm_ms)
  cublas mx         torch.matmul on the MX values (the data effect: session 23's dev/archive/mx_data_probe)
  gluon-256         w1_mx_matmul, 128 x 256 tiles (the op before this session)
  gluon-128         w1_mx_matmul, 128 x 128 tiles, 6 stages
  round+bf16        quant.mx_round(A), then the bf16 op (the static W = 1 GEMM with planning.w1_plan's split /
                    stream-K / tail / short-K schedules); mx_round was two kernels (quantize_mx, dequantize_mx)
                    in s24a / s24b, one (quant.round_to_mx) since
  round alone       quant.mx_round(A) alone (its vs_cublas column: cuBLAS time / rounding time)
  bf16 op           that bf16 op alone on A's MX values (rounded before the timing): what that path would cost
                    with a free rounding pass
Prints one table: ms per variant (median of the rounds' medians), each over cublas bf16, and which tile
w1_mx_matmul.tile_width picks. A developer probe."""
import argparse
import statistics

import torch


def grid_shapes():
    import yaml
    with open("suites/tp-grid.yaml") as f:
        return [tuple(int(v) for v in s.split("x")) for s in yaml.safe_load(f)["shapes"]["ag_gemm"]]


def main(argv=None):
    import kosmos
    from kosmos import quant
    from kosmos.core import codes, planning, runtime
    from kosmos.gemm import w1_mx as w1mx
    from kosmos_bench.timing import time_op
    from dev.rows import Rows
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="grid")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    shapes = grid_shapes() if args.shapes == "grid" else [tuple(map(int, s.split("x"))) for s in args.shapes.split(",")]
    dev = torch.device("cuda", 0)
    sms = runtime.num_sms(dev)
    ws = runtime.get_workspace(None, dev)
    gen = torch.Generator(device="cuda").manual_seed(24)
    rows = Rows(args.json)  # each row written as it is ready
    for m, n, k in shapes:
        a = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
        w = (torch.randn(n, k, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
        a_mx, w_mx = quant.mx_round(a), quant.mx_round(w)
        ref = a_mx.float() @ w_mx.float().t()

        def gluon(bn):
            """The kernel's launch, bound once (as the op's cached plan does; a w1_mx_call per call would build
            descriptors and self-check a fresh launch every time), the row pass rounding A in every launch."""
            ws.ensure(m * k * 2, 0)
            values = ws.data[:m * k * 2].view(torch.bfloat16).view(m, k)
            c = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
            runtime.ensure_triton_allocator()
            kl = w1mx.w1_mx_matmul_launch(a, None, w_mx, True, c, values, ws, sms, codes.OP_ALL_GATHER_MATMUL.value,
                                          bn)

            def call():
                kl.kernel[kl.grid](*kl.args, **kl.kw)
                return c
            return call
        calls = {
            "cublas bf16": lambda: torch.matmul(a, w.t()),
            "cublas mx": lambda: torch.matmul(a_mx, w_mx.t()),
            "gluon-256": gluon(256),
            "gluon-128": gluon(128),
            "round+bf16": lambda: kosmos.all_gather_matmul(quant.mx_round(a), w_mx.t())[1],
            "bf16 op": lambda: kosmos.all_gather_matmul(a_mx, w_mx.t())[1],
            "round alone": lambda: quant.mx_round(a),
        }
        errs = {}
        for v, fn in calls.items():  # each checked once against the fp32 product of the MX values
            c = fn()
            torch.cuda.synchronize()
            if v == "round alone":
                errs[v] = float(not torch.equal(c.view(torch.int16), a_mx.view(torch.int16)))
                continue
            errs[v] = float((c.float() - ref).norm() / ref.norm())
        ws.check_errors()
        times = {v: [] for v in calls}
        for _ in range(args.rounds):
            for v, fn in calls.items():
                times[v].append(time_op(fn, iters=20, warmup=5)["time_ms"])
        base = statistics.median(times["cublas bf16"])
        plan = planning.w1_plan(m, n, k, programs=sms)
        for v in calls:
            t = statistics.median(times[v])
            r = dict(shape=f"{m}x{n}x{k}", variant=v, time_ms=t, vs_cublas=base / t, rel_err=errs[v],
                     rounds=times[v], rule_bn=w1mx.tile_width(m, n, sms),
                     w1_plan=f"{plan.tile.BM}x{plan.width} split{plan.split} sk{int(plan.stream_k)} x{plan.per_sm}")
            rows.emit(r)
        del a, w, a_mx, w_mx, ref
        torch.cuda.empty_cache()
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    print(f"{'shape':<18} {'rule':>4} " + " ".join(f"{v:>11}" for v in variants) + "   (cuBLAS bf16 time / time)")
    for s in dict.fromkeys(r["shape"] for r in rows):
        rs = {r["variant"]: r for r in rows if r["shape"] == s}
        print(f"{s:<18} {rs[variants[0]]['rule_bn']:>4} " + " ".join(f"{rs[v]['vs_cublas']:>11.3f}" for v in variants))
    for v in variants:
        g = statistics.geometric_mean([r["vs_cublas"] for r in rows if r["variant"] == v])
        print(f"geomean {v}: {g:.3f}; max rel_err {max(r['rel_err'] for r in rows if r['variant'] == v):.2e}")


if __name__ == "__main__":
    main()
