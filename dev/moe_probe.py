"""Where the time of one fused MoE call goes (a developer's device script, one call per session):

    python -m dev.moe_probe --out DIR [--model deepseek-v3] [--tokens 4096] [--routing uniform]

Per rank: build the bench's inputs, warm up, time the call (median of --iters), then trace one call and print,
per task kind (route = router math, comm = the route task's row pushes and count publish, permute, gemm1,
gemm2, fold, wait), how many tasks ran, when the first started and the last ended (us from the rank's first
event; GPU clocks of two ranks are not aligned) and the busy time summed over programs (us per program).
A traced call is made (and compiled) before the timed calls, so the trace has no compile skew.
``--config KEY=V,...`` (repeatable) runs the whole probe once per ``kosmos.MoEForwardConfig`` (fields as in
``kosmos bench moe --config``, e.g. ``copy_cols=256,half_tail=false``), in one call;
``--dtype bf16,mxfp8`` runs it once per precision (mxfp8: x quantized inside the call, the experts' MX weight
values made once, as ``kosmos bench moe --dtype mxfp8`` times it), so the MX layer's extra time shows per task kind;
``--tree DIR`` (repeatable) once per source tree (e.g. a branch checked out with git archive), in a subprocess.
Writes DIR/trace-moe-<model>-<tokens>-<routing>-w<W>.json (render: ``kosmos report --timeline FILE``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def probe_configs(texts) -> list:
    """One (text, MoEForwardConfig) per --config value (the defaults when none); ValueError naming a bad key."""
    from kosmos_bench.registry import CONFIG_TYPES, parse_config
    return [(v, parse_config([v], CONFIG_TYPES["moe"])["moe_fwd"]) for v in (texts or [""])]


def trace_events(buf: torch.Tensor) -> list[list[int]]:
    """The recorded events of a trace buffer [grid, TRACE_EVENTS, 4] as [program, kind, task, t0, t1] lists."""
    host = buf.cpu()
    return [[p, int(e[0]), int(e[1]), int(e[2]), int(e[3])] for p in range(host.shape[0]) for e in host[p]
            if int(e[3]) > 0]


def kind_table(ranks_events, grid: int) -> str:
    """Per rank and task kind: how many tasks ran, when the first started and the last ended (us from the rank's
    first event) and the busy time summed over programs (us per program); a 'span' line per rank first."""
    from kosmos.core import runtime
    lines = [f"{'rank':>4} {'kind':>10} {'tasks':>6} {'first_us':>9} {'last_us':>9} {'busy_us/prog':>13}"]
    for r, evs in enumerate(ranks_events):
        t_min = min(ev[3] for ev in evs)
        lines.append(f"{r:>4} {'span':>10} {'':>6} {0.0:>9.1f} {(max(ev[4] for ev in evs) - t_min) / 1e3:>9.1f}")
        for kind in sorted({ev[1] for ev in evs}):
            sel = [ev for ev in evs if ev[1] == kind]
            busy = sum(ev[4] - ev[3] for ev in sel) / 1e3 / grid
            lines.append(f"{r:>4} {runtime.TRACE_KINDS.get(kind, kind):>10} {len(sel):>6} "
                         f"{(min(ev[3] for ev in sel) - t_min) / 1e3:>9.1f} "
                         f"{(max(ev[4] for ev in sel) - t_min) / 1e3:>9.1f} {busy:>13.1f}")
    return "\n".join(lines)


def _rank_main(rank, world, args):
    runs = [(d, c) for d in args.dtypes for c in probe_configs(args.configs)]
    for i, (dtype, (variant, config)) in enumerate(runs):
        _probe(rank, world, args, variant, config, i if len(runs) > 1 else None, dtype)


def _probe(rank, world, args, variant: str, config, index, dtype: str = "bf16"):
    import kosmos
    from kosmos.core import runtime
    from kosmos.config import config_dict
    from kosmos.core.schedule import TRACE_EVENTS

    from kosmos_bench import moe as bm
    from kosmos_bench import timing
    m = bm.moe_model(args.model)
    dev = torch.device("cuda", rank)
    x, wr, bias, _ = bm.make_router_inputs(m, args.tokens, args.routing, rank, 0, device=dev)
    w13, w2 = bm.make_expert_weights(m, world, rank, 0, device=dev)
    kw = bm.route_kwargs(m, bias)
    if dtype == "mxfp8":  # as the bench times it: x quantized in the call, the weights' MX values made once
        from kosmos_bench.moe_mx import mx_expert_weights
        w13, w2 = mx_expert_weights(w13, w2)
        kw["precision"] = "mxfp8"
    policy = dict(policy="fixed", comm_programs=args.fixed) if args.fixed else {}
    grid = runtime.num_sms(dev)
    buf = torch.zeros((grid, TRACE_EVENTS, 4), dtype=torch.int64, device=dev)

    def call(**extra):
        return kosmos.moe_forward(x, wr, w13, w2, top_k=m.top_k, **kw, **policy, config=config, **extra)
    for _ in range(3):
        call()
    call(trace=buf)  # compiles the traced variant now, so that the traced call below has no compile skew
    runtime.check_errors()
    times = []
    for _ in range(args.iters):
        timing.barrier()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(timing.HOST_HIDE_CYCLES)
        s.record()
        call()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    buf.zero_()
    timing.barrier()
    call(trace=buf)
    runtime.check_errors()
    events = trace_events(buf)
    gathered = [None] * world
    if dist.is_initialized():
        dist.all_gather_object(gathered, (events, sorted(times)[len(times) // 2]))
    else:
        gathered = [(events, sorted(times)[len(times) // 2])]
    if rank != 0:
        return
    print(f"{args.model} tokens={args.tokens} routing={args.routing} W={world} {dtype} policy={policy or 'self'} "
          f"config=[{variant or 'defaults'}]: median call {max(t for _, t in gathered):.3f} ms (max over ranks)")
    print(kind_table([evs for evs, _ in gathered], grid))
    os.makedirs(args.out, exist_ok=True)
    doc = {"type": "trace", "op": "moe", "model": args.model, "tokens": args.tokens, "routing": args.routing,
           "world": world, "impl": "kosmos", "variant": variant, "dtype": dtype,
           "config": config_dict(config),
           "kinds": {str(k): v for k, v in runtime.TRACE_KINDS.items()},
           "ranks": [{"rank": r, "events": evs} for r, (evs, _) in enumerate(gathered)]}
    suffix = f"-v{index}" if index is not None else ""
    name = f"trace-moe-{args.model}-{args.tokens}-{args.routing.replace(':', '')}-w{world}{suffix}.json"
    with open(os.path.join(args.out, name), "w") as f:
        json.dump(doc, f)


def main(argv=None):
    from kosmos_bench.launcher import check_world, spawn
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--model", default="deepseek-v3")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--routing", default="uniform")
    p.add_argument("--world", type=int, default=None)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--dtype", dest="dtypes", type=lambda v: v.split(","), default=["bf16"],
                   help="bf16, mxfp8 or bf16,mxfp8 (one run each, in this order)")
    p.add_argument("--fixed", type=int, default=0, help="fixed-role policy with this many data-moving programs")
    p.add_argument("--config", dest="configs", action="append", default=None,
                   help="a MoEForwardConfig for one run, e.g. half_tail=false,copy_cols=128 (keys as in `kosmos "
                        "bench moe --config`); repeat to compare several in one call (each compiles its own kernel "
                        "variant)")
    p.add_argument("--tree", dest="trees", action="append", default=None,
                   help="run the whole probe once per source tree (a directory holding kosmos/ and kosmos_bench/, "
                        "e.g. `git archive BRANCH kosmos kosmos_bench | tar -x -C DIR`), each in a subprocess with "
                        "that tree first on PYTHONPATH: code versions side by side in one device call; "
                        "traces go to OUT/tree<i>")
    args = p.parse_args(argv)
    try:
        probe_configs(args.configs)  # a bad key fails here, before anything spawns
    except ValueError as e:
        p.error(str(e))
    if bad := [d for d in args.dtypes if d not in ("bf16", "mxfp8")]:
        p.error(f"--dtype: {bad[0]!r} is not bf16 or mxfp8")
    if args.trees:
        return _run_trees(args, argv if argv is not None else sys.argv[1:])
    spawn(_rank_main, check_world(args.world), args, timeout_s=600)


def _strip_trees(argv: list[str]) -> list[str]:
    """argv without its --tree options (both ``--tree DIR`` and ``--tree=DIR``) and without --out."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--tree", "--out"):
            skip = True
        elif not a.startswith(("--tree=", "--out=")):
            out.append(a)
    return out


def _run_trees(args, argv: list[str]) -> int:
    import subprocess
    rest = _strip_trees(list(argv))
    worst = 0
    for i, tree in enumerate(args.trees):
        tree = os.path.abspath(tree)
        if not os.path.isdir(os.path.join(tree, "kosmos")) or not os.path.isdir(os.path.join(tree, "kosmos_bench")):
            raise SystemExit(f"--tree {tree}: needs kosmos/ and kosmos_bench/ inside")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tree] + [q for q in [os.environ.get("PYTHONPATH")] if q]))
        out = os.path.join(os.path.abspath(args.out), f"tree{i}")
        print(f"== tree {i}: {tree}", flush=True)
        rc = subprocess.run([sys.executable, "-m", "dev.moe_probe", "--out", out, *rest], env=env,
                            cwd=tree).returncode
        worst = worst or rc
    return worst


if __name__ == "__main__":
    sys.exit(main())
