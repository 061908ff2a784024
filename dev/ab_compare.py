"""Compare bench JSONL files of two code variants run interleaved in one device call (a developer script).

    python -m dev.ab_compare BASE.jsonl [BASE2.jsonl ...] --vs NEW.jsonl [NEW2.jsonl ...] [--impl kosmos]

Per shape: the median time of --impl over the files of each side, their ratio (new / base), and each side's
time against the same rows' ``t_gemm_ms`` -- the local GEMM alone (torch.matmul / cuBLAS; for MoE rows the
grouped GEMMs alone) timed in the same run, so the run-to-run noise shows in how much that reference moves
between the files. (Not against an ``nccl+cublas`` row: at W=1 that still copies for a size-1 all-gather.)
Prints a table and the geomeans of new / base and of each side against the GEMM alone.

Refuses (exit 2) when both sides ran the same code: each file's env header carries ``source_sha`` (the hash of the
kosmos / kosmos_bench sources that ran), and an A/B whose sides share one compares a tree with itself. Session 10
found that every interleaved A/B of sessions 7-9 had done exactly that: ``PYTHONPATH=.base python -m
kosmos_bench.cli`` imports the package of the working directory (``-m`` puts it first on sys.path), so "old" was
the new tree again. Run each tree from its own directory instead (dev/archive/arch_session.sh ``bench_in``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
from collections import defaultdict


def _load(paths):
    """(rows, source_shas): the ok rows by point and the set of env headers' source_sha over the files."""
    # (op, model, layer [/dtype][/direction], seq + routing for MoE points, M x N x K, impl) -> [(time_ms,
    # t_gemm_ms)]: a custom grid's
    # shapes share model and layer ("custom") and often M, so the GEMM shape is part of the key
    rows = defaultdict(list)
    shas = set()
    for p in paths:
        if not os.path.exists(p):
            raise SystemExit(f"ab_compare: {p}: no such file (did that run fail?)")
        for line in open(p):
            r = json.loads(line)
            if r.get("type") == "env":
                shas.add(r.get("source_sha"))
            if r.get("type") == "result" and r.get("status") == "ok":
                seq = r["seq"] if r.get("routing") is None else f"{r['seq']}/{r['routing']}"
                shape = "x".join(str(r.get(d, "-")) for d in ("m", "n", "k"))
                # rows of one point at another precision or direction are other points (bench --dtype bf16,mxfp8)
                layer = "/".join([r["layer"]] + [v for v in (r.get("dtype"), r.get("direction"))
                                                 if v not in (None, "bf16", "fwd")])
                rows[(r["op"], r["model"], layer, seq, shape, r["impl"])].append(
                    (r["time_ms"], r.get("t_gemm_ms") or float("nan")))
    return rows, shas


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", nargs="+")
    ap.add_argument("--vs", nargs="+", required=True)
    ap.add_argument("--impl", default="kosmos")
    args = ap.parse_args(argv)
    (base, base_src), (new, new_src) = _load(args.base), _load(args.vs)
    if None in base_src | new_src:
        print("ab_compare: a file has no env header with source_sha: cannot tell which code ran", file=sys.stderr)
        return 2
    if base_src & new_src:
        print(f"ab_compare: both sides ran the same code (source_sha {sorted(base_src & new_src)[0][:12]}): "
              "this is not an A/B (run each tree from its own directory)", file=sys.stderr)
        return 2
    if len(base_src) > 1 or len(new_src) > 1:
        print(f"ab_compare: one side mixes several sources (base {len(base_src)}, new {len(new_src)})",
              file=sys.stderr)
        return 2
    print(f"base source {min(base_src)[:12]}, new source {min(new_src)[:12]}")
    keys = sorted({k[:5] for k in base if k[5] == args.impl} & {k[:5] for k in new if k[5] == args.impl})
    print(f"{'op':<8} {'model':<11} {'layer':<15} {'seq':>6} {'MxNxK':>17} {'base ms':>9} {'new ms':>9} {'new/base':>9} "
          f"{'gemm/base':>10} {'gemm/new':>9}")
    logs = {"new/base": [], "gemm/base": [], "gemm/new": []}
    for k in keys:
        b = statistics.median(t for t, _ in base[k + (args.impl,)])
        n = statistics.median(t for t, _ in new[k + (args.impl,)])
        gb = statistics.median(g for _, g in base[k + (args.impl,)])  # > 1: faster than the GEMM alone
        gn = statistics.median(g for _, g in new[k + (args.impl,)])
        for name, v in (("new/base", n / b), ("gemm/base", gb / b), ("gemm/new", gn / n)):
            if v == v:
                logs[name].append(math.log(v))
        print(f"{k[0]:<8} {k[1]:<11} {k[2]:<15} {k[3]:>6} {k[4]:>17} {b:>9.4f} {n:>9.4f} {n / b:>9.3f} {gb / b:>10.3f} {gn / n:>9.3f}")
    for name, vals in logs.items():
        if vals:
            print(f"geomean {name} over {len(vals)} shapes: {math.exp(sum(vals) / len(vals)):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
