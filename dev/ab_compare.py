"""Compare bench JSONL files of two code variants run interleaved in one device call (a developer script).

    python -m dev.ab_compare BASE.jsonl [BASE2.jsonl ...] --vs NEW.jsonl [NEW2.jsonl ...] [--impl kosmos]

Per shape: the median time of --impl over the files of each side, their ratio (new / base), and each side's
ratio to the same run's nccl+cublas (the run-to-run noise shows in how much that baseline moves between the
files). Prints a table and the geomean of new / base.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections import defaultdict


def _load(paths):
    rows = defaultdict(list)  # (op, model, layer, seq + routing for MoE points, impl) -> [time_ms]
    for p in paths:
        if not os.path.exists(p):
            raise SystemExit(f"ab_compare: {p}: no such file (did that run fail?)")
        for line in open(p):
            r = json.loads(line)
            if r.get("type") == "result" and r.get("status") == "ok":
                seq = r["seq"] if r.get("routing") is None else f"{r['seq']}/{r['routing']}"
                rows[(r["op"], r["model"], r["layer"], seq, r["impl"])].append(r["time_ms"])
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base", nargs="+")
    ap.add_argument("--vs", nargs="+", required=True)
    ap.add_argument("--impl", default="kosmos")
    ap.add_argument("--baseline", default="nccl+cublas")
    args = ap.parse_args(argv)
    base, new = _load(args.base), _load(args.vs)
    keys = sorted({k[:4] for k in base if k[4] == args.impl} & {k[:4] for k in new if k[4] == args.impl})
    print(f"{'model':<11} {'layer':<9} {'seq':>6} {'base ms':>9} {'new ms':>9} {'new/base':>9} "
          f"{'base/cublas':>12} {'new/cublas':>11}")
    logs = []
    for k in keys:
        b, n = statistics.median(base[k + (args.impl,)]), statistics.median(new[k + (args.impl,)])
        cb = base.get(k + (args.baseline,)) or [float("nan")]
        cn = new.get(k + (args.baseline,)) or [float("nan")]
        logs.append(math.log(n / b))
        print(f"{k[1]:<11} {k[2]:<9} {k[3]:>6} {b:>9.4f} {n:>9.4f} {n / b:>9.3f} "
              f"{b / statistics.median(cb):>12.3f} {n / statistics.median(cn):>11.3f}")
    if logs:
        print(f"geomean new/base over {len(logs)} shapes: {math.exp(sum(logs) / len(logs)):.3f}")


if __name__ == "__main__":
    main()
