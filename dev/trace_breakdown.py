"""Where the program time of a traced kosmos call went (a developer script; reads `bench ... --trace` JSON).

    python -m dev.trace_breakdown TRACE.json [TRACE2.json ...]

Per rank: the span (first task start to last task end), and the share of (programs x span) spent in each
task kind (compute, comm, wait, ...), in gaps between a program's tasks (claims, table loads, readiness
checks), before its first task and after its last (the wave-quantisation tail).
"""
from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from kosmos.core.runtime import TRACE_KINDS


def breakdown(events):
    """events: [(program, kind, task, t0_ns, t1_ns)] of one rank -> dict of shares and medians."""
    start, end = min(e[3] for e in events), max(e[4] for e in events)
    span = end - start
    per_prog = defaultdict(list)
    for p, kind, task, t0, t1 in events:
        per_prog[p].append((t0, t1, kind))
    busy = defaultdict(float)
    durations = defaultdict(list)
    gaps = head = tail = 0.0
    for evs in per_prog.values():
        evs.sort()
        for t0, t1, kind in evs:
            busy[TRACE_KINDS.get(kind, str(kind))] += t1 - t0
            durations[TRACE_KINDS.get(kind, str(kind))].append((t1 - t0) / 1e3)
        gaps += sum(max(0, b[0] - a[1]) for a, b in zip(evs, evs[1:]))
        head += evs[0][0] - start
        tail += end - evs[-1][1]
    total = len(per_prog) * span
    share = {k: v / total for k, v in busy.items()}
    share.update(gaps=gaps / total, head=head / total, tail=tail / total)
    return {"span_us": span / 1e3, "programs": len(per_prog), "share": share,
            "median_us": {k: statistics.median(v) for k, v in durations.items()},
            "tasks": {k: len(v) for k, v in durations.items()}}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("traces", nargs="+")
    args = ap.parse_args(argv)
    for path in args.traces:
        d = json.load(open(path))
        print(f"{path}: {d.get('model')} {d.get('layer')} seq {d.get('seq')} W={d.get('world')}")
        for rk in d["ranks"]:
            b = breakdown(rk["events"])
            shares = ", ".join(f"{k} {v:.1%}" for k, v in sorted(b["share"].items(), key=lambda kv: -kv[1]))
            tasks = ", ".join(f"{b['tasks'][k]} {k} (median {b['median_us'][k]:.1f} us)" for k in b["tasks"])
            print(f"  rank {rk['rank']}: span {b['span_us']:.0f} us, {b['programs']} programs: {shares}")
            print(f"    {tasks}")


if __name__ == "__main__":
    main()
