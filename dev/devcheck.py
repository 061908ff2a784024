"""One device-session script: checks and times many variants in one call (for developers on a lent GPU box).

    python -m dev.devcheck --out DIR [--world W] [--models llama3-70b] [--seq 8192] [--skip-stall]

Per rank: signal round trip; fused ops vs fp32 reference on odd shapes (self and fixed policies); bitwise
determinism over 5 runs; 100 back-to-back calls without host sync; a timed comparison on model shapes
(rows appended to DIR/devcheck.jsonl, traces in DIR); a deliberately stalled peer must raise
KosmosTimeoutError. Prints a short table last.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def log(rank, *msg):
    if rank == 0:
        print(*msg, flush=True)


def _rank_main(rank, world, args):
    import kosmos
    from kosmos import reference
    from kosmos.core import runtime
    from dev.signal_pingpong import signal_round_trip_us
    from kosmos.models import TPGemm, tp_gemms

    from kosmos_bench import tp
    from kosmos_bench.environment import environment
    from kosmos_bench.harness import agree, max_over_ranks, recover

    import faulthandler
    import sys
    faulthandler.dump_traceback_later(args.hang_dump_s, exit=False, file=sys.stderr)
    torch.backends.cuda.matmul.allow_tf32 = False
    kosmos.set_timeout(args.timeout)
    summary = []
    out_rows = open(os.path.join(args.out, "devcheck.jsonl"), "a") if rank == 0 else None

    def note(kind, **kw):
        rec = {"check": kind, "world": world, **kw}
        if "error" in kw and rank != 0:
            print(f"[rank {rank}]", json.dumps(rec), flush=True)
        summary.append(rec)
        if out_rows:
            out_rows.write(json.dumps(rec) + "\n")
            out_rows.flush()
        log(rank, json.dumps(rec))

    if world >= 2 and not args.skip_pingpong:
        signal_round_trip_us(200)
        us = [signal_round_trip_us(2000) for _ in range(3)]
        note("signal_round_trip_us", values=us)

    gen_seed = 1234
    shapes_ag = [(37, 128, 72), (300, 264, 520), (1024, 1024, 1024), (129, 4096, 2048)]
    shapes_rs = [(37 * world, 128, 72), (300 * world, 264, 520), (1024 * world, 1024, 1024), (129 * world, 512, 4096)]
    for policy, s in (() if args.skip_correct else (("self", None), ("fixed", 8))):
        for (ms, k, n) in shapes_ag:
            g = TPGemm("custom", "custom", "ag_gemm", ms * world, ms * world, n, k)
            a, b = tp.make_inputs(g, world, rank, gen_seed)
            ref = reference.all_gather_matmul_ref(a, b)[1]
            try:
                a_full, c = kosmos.all_gather_matmul(a, b, policy=policy, comm_programs=s)
                runtime.check_errors()
                e = reference.rel_err(c, ref)
                ga = reference.all_gather_matmul_ref(a, b, fp32=False)[0]
                exact = bool(torch.equal(a_full, ga))
                bt = kosmos.all_gather_matmul(a, b.t().contiguous().t(), policy=policy, comm_programs=s)[1]
                runtime.check_errors()
                e_t = reference.rel_err(bt, ref)
                note("ag_correct", policy=policy, shape=[ms, k, n], rel_err=max_over_ranks(e),
                     rel_err_bT=max_over_ranks(e_t), a_full_exact=exact)
            except Exception as ex:  # keep going: report
                note("ag_correct", policy=policy, shape=[ms, k, n], error=repr(ex)[:400])
                failed = True
            else:
                failed = False
            if not agree(not failed, "failed")[0]:
                recover()
        for (m, k, n) in shapes_rs:
            g = TPGemm("custom", "custom", "gemm_rs", m, m, n, k)
            a, b = tp.make_inputs(g, world, rank, gen_seed)
            ref = reference.matmul_reduce_scatter_ref(a, b)
            try:
                c = kosmos.matmul_reduce_scatter(a, b, policy=policy, comm_programs=s)
                runtime.check_errors()
                e = reference.rel_err(c, ref)
                nccl = reference.rel_err(reference.matmul_reduce_scatter_ref(a, b, fp32=False), ref)
                note("rs_correct", policy=policy, shape=[m, k, n], rel_err=max_over_ranks(e),
                     nccl_rel_err=max_over_ranks(nccl))
            except Exception as ex:
                note("rs_correct", policy=policy, shape=[m, k, n], error=repr(ex)[:400])
                failed = True
            else:
                failed = False
            if not agree(not failed, "failed")[0]:
                recover()

    # determinism + back-to-back
    for op in ("ag_gemm", "gemm_rs"):
        g = TPGemm("custom", "custom", op, 2048, 2048, 1536, 1024)
        a, b = tp.make_inputs(g, world, rank, 99)
        f = (lambda: kosmos.all_gather_matmul(a, b)[1]) if op == "ag_gemm" else (
            lambda: kosmos.matmul_reduce_scatter(a, b))
        try:
            outs = [f() for _ in range(5)]
            runtime.check_errors()
            same = all(torch.equal(outs[0], o) for o in outs[1:])
            last = None
            t0 = time.perf_counter()
            for _ in range(100):
                last = f()
            t_host = time.perf_counter() - t0
            runtime.check_errors()
            b2b = bool(torch.equal(last, outs[0]))
            note("determinism_b2b", op=op, bitwise_5_runs=same, back_to_back_100_equal=b2b,
                 host_enqueue_ms_per_call=t_host * 10)
        except Exception as ex:
            note("determinism_b2b", op=op, error=repr(ex)[:400])
            ok = False
        else:
            ok = True
        ok, why = agree(ok, "failed")
        if not ok:
            recover()

    if args.host_profile and rank == 0:
        # where a call's host (enqueue) time goes: cProfile over 50 back-to-back calls of each op
        import cProfile
        import io
        import pstats
        for op in ("ag_gemm", "gemm_rs"):
            g = TPGemm("custom", "custom", op, 8192, 8192, 5120 if op == "ag_gemm" else 8192,
                       8192 if op == "ag_gemm" else 4096)
            a, b = tp.make_inputs(g, world, rank, 7)
            f = (lambda: kosmos.all_gather_matmul(a, b)) if op == "ag_gemm" else (
                lambda: kosmos.matmul_reduce_scatter(a, b))
            if world == 1:
                f()
                torch.cuda.synchronize()
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(50):
                    f()
                prof.disable()
                torch.cuda.synchronize()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(25)
                with open(os.path.join(args.out, f"host-profile-{op}.txt"), "w") as fh:
                    fh.write(out.getvalue())
                print(out.getvalue()[:3000], flush=True)

    # timings on model shapes
    st = tp.TPSettings(impls=tuple(args.impls.split(",")), iters=args.iters, warmup=3,
                       fixed_sweep=tuple(int(x) for x in args.sweep.split(",")), trace_dir=args.out)
    if rank == 0:
        with open(os.path.join(args.out, "tp-rows.jsonl"), "a") as f:
            env = environment(argv=["python", "-m", "dev.devcheck"] + list(args.argv), bench="tp",
                              suite={"models": args.models.split(","), "seq": args.seq, "impls": args.impls,
                                     "iters": args.iters, "fixed_sweep": args.sweep})
            f.write(json.dumps(env) + "\n")
    for model in args.models.split(","):
        for seq in [int(s) for s in args.seq.split(",")]:
            for g in tp_gemms(model, seq, world):
                for r_ in (rows := tp.run_case(g, st)):
                    r_["run_id"] = env["run_id"] if rank == 0 else None
                if rank == 0:
                    with open(os.path.join(args.out, "tp-rows.jsonl"), "a") as f:
                        for r in rows:
                            f.write(json.dumps(r) + "\n")
                for r in rows:
                    summary.append({"check": "time", "layer": g.layer, "seq": seq, "impl": r["impl"],
                                    "status": r["status"], "ms": r["time_ms"], "tflops": r["tflops"],
                                    "err": r["rel_err"], "gemm": r["t_gemm_ms"], "comm": r["t_comm_ms"],
                                    "params": r["params"], "reason": r["reason"]})

    if world >= 2 and not args.skip_stall:
        g = TPGemm("custom", "custom", "ag_gemm", 4096, 4096, 1024, 1024)
        a, b = tp.make_inputs(g, world, rank, 5)
        kosmos.set_timeout(0.5)
        torch.cuda.synchronize()
        dist.barrier()
        if rank == 1:
            torch.cuda._sleep(int(3e9))  # ~1.5-2 s of GPU spinning before this rank's kernel starts
        t0 = time.perf_counter()
        kosmos.all_gather_matmul(a, b)
        try:
            runtime.check_errors()
            note("stalled_peer", rank=rank, raised=False)
        except kosmos.KosmosTimeoutError as ex:
            if rank == 0:
                print("stalled rank 0 error:", ex, flush=True)
            summary.append({"check": "stalled_peer", "rank": rank, "raised": True,
                            "seconds": time.perf_counter() - t0, "msg": str(ex)[:300]})
        torch.cuda.synchronize()
        dist.barrier()
        kosmos.reset_workspaces()
        flags = [None] * world
        dist.all_gather_object(flags, [s for s in summary if s["check"] == "stalled_peer"])
        if rank == 0:
            note("stalled_peer_all", per_rank=flags)

    if rank == 0:
        print("\n==== summary ====")
        for s in summary:
            if s["check"] == "time":
                ms = f"{s['ms']:.3f}" if s["ms"] else "-"
                tf = f"{s['tflops']:.0f}" if s["tflops"] else "-"
                print(f"{s['layer']:>9} {s['seq']:>6} {s['impl']:>16} {s['status']:>7} {ms:>8} ms {tf:>5} TF "
                      f"gemm {s['gemm']:.3f} comm {s['comm']:.3f} {s['params']} {s['reason'] or ''}")
            else:
                print({k: v for k, v in s.items() if k != "world"})


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--world", type=int, default=None)
    p.add_argument("--models", default="llama3-70b")
    p.add_argument("--seq", default="8192")
    p.add_argument("--impls", default="kosmos,nccl+cublas,torch-async-tp,fixed-role")
    p.add_argument("--sweep", default="8,16,32,64")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--skip-stall", action="store_true")
    p.add_argument("--skip-pingpong", action="store_true")
    p.add_argument("--skip-correct", action="store_true")
    p.add_argument("--timeout", type=float, default=2.0)
    p.add_argument("--hang-dump-s", type=float, default=300.0)
    p.add_argument("--host-profile", action="store_true", help="cProfile the host side of 50 calls (world 1)")
    args = p.parse_args()
    import sys
    args.argv = sys.argv[1:]
    from kosmos_bench.launcher import check_world, spawn
    world = check_world(args.world)
    os.makedirs(args.out, exist_ok=True)
    spawn(_rank_main, world, args, timeout_s=560)


if __name__ == "__main__":
    main()
