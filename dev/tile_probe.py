"""Which tile would each GEMM of the public grid want? (issue 13 part 1; a developer probe, not product code.)

    PYTHONPATH=. python -m dev.tile_probe [--shapes MxNxK,...] [--ops ag_gemm,gemm_rs] [--candidates LIST]
        [--json OUT.jsonl] [--max-seconds S] [--iters 10] [--warmup 3] [--check-only] [--cpu-smoke]
    PYTHONPATH=. python -m dev.tile_probe --table OUT.jsonl       # re-print the table of a finished run
    PYTHONPATH=. python -m dev.tile_probe --resources [--candidates LIST]   # regs / spills / shared memory of
                                                   # every candidate, compiled for sm_90a (no GPU needed)

For every GEMM of suites/tp-grid.yaml (48; or ``--shapes``), at W=1 (communication off), for both TP ops, the
kosmos kernel is launched through its low-level ``launch(...)`` (kernels/all_gather_matmul.py,
kernels/matmul_reduce_scatter.py) on explicit buffers -- as tests/simranks.py does at W=1, and as the public op
does there (AG: the gathered buffer is the shard itself; RS: the staging buffer is c) -- with each candidate
TileConfig instead of planning.tile_config's choice. Each candidate's output is first checked against the fp32
product (TF32 off; relative Frobenius error < 1e-2, output poisoned with NaN before the call; the queue heads
and the error record must be clean afterwards); then it is timed with kosmos_bench.timing.time_op (device time:
L2 flushed, ~2 ms of GPU spin before each timed call so the host's enqueue time is hidden), and torch.matmul on
the same operands is timed once per shape the same way (``t_gemm_ms``, cuBLAS alone: the grid's baseline, as
in the bench rows). A candidate that fails to compile (e.g. shared memory), faults, or is wrong is recorded
with its reason and the probe goes on (a CUDA fault ends the run: the context is lost).

Output: one JSONL row per shape x op x candidate (m, n, k, op, cand, BM, BN, BK, num_warps, num_stages, grid,
time_ms, p20_ms, p80_ms, t_gemm_ms, ratio = t_gemm_ms / time_ms, rel_err, check_s = wall time of the checked
call, compile included, status ok|wrong|failed|skipped, reason), after one ``"type": "env"`` row; then a table:
per op and candidate the geomean of the ratio over the shapes it ran on, per shape the best candidate and its
ratio, and the "best per shape" geomean -- the upper bound that a perfect rule choosing among these tiles
would reach (no split-K / stream-K: a separate question).

Candidates (``--candidates``, comma-separated; ``rule`` = planning.tile_config's choice for the shape at W=1 on
the device's SMs: 128x256x64, 8 warps, 3 stages on every grid GEMM when the probe ran in session 10; the
wave model since picks among TILE_CANDIDATES from that run). Syntax BMxBNxBK[wWARPS][sSTAGES][gPROGRAMS_PER_SM].
The kernels' constraints: BM and BN powers of two (tl.arange in store_rows and in the reduce), BN >= 16 (the
epilogue's two half-width TMA stores [BM, BN/2] need rows of >= 16 bytes), every TMA box side <= 256, BK a
multiple of 16 (bf16 wgmma K step), 4 or 8 warps (one or two warpgroups; the candidates give BM = 64 four),
and the pipeline in shared memory: num_stages x (BM x BK + BK x BN) x 2 bytes, plus [BM, BN/2] x 2 bytes of
epilogue staging in the RS kernel, <= 227 KiB. Resources measured here (``--resources``: Triton 3.9, sm_90a,
W=1, no GPU; ptxas regs / shared KiB, AG | RS; the device runs Triton 3.6, which may differ), none spills:
  rule = 128x256x64 w8 s3    192 / 144 | 202 / 176  today's tile (0.823x geomean on the grid's RS half, s9)
  128x256x128 w8 s2          195 / 192 | 199 / 224  half the K steps (short K = 1024: 8 steps instead of 16);
                                                    2 stages is all that fits
  128x128x64 w8 s4           169 / 128 | 121 / 144  2x the tiles: half-wave shapes (M=512/1024, N=1536) fill
                                                    the SMs; two warpgroups of 64x128
  128x128x64 w4 s4           200 / 128 | 200 / 144  the same tile on one warpgroup (2 x m64 wgmma per step)
  64x256x64 w4 s4            202 / 160 | 197 / 176  2x the tiles along M (M=256/512 shapes), keeping the widest
                                                    (most efficient) m64n256 wgmma
  64x128x64 w4 s4            167 / 96  | 117 / 104  4x the tiles: M=256/512 with N <= 6144 reach >= 1 wave
  64x64x64 w4 s6             168 / 96  | 80 / 100   8x the tiles: the limit of "more tiles" for the smallest
                                                    shapes (256x1536x1024: 96 tiles instead of 12)
  64x128x64 w4 s4 g2         as 64x128x64           two programs per SM (grid = 2 x SMs; both fit: <= 104 KiB
                                                    shared, 167 regs x 128 threads each), i.e. two independent
                                                    warpgroups per SM instead of one 128-row tile. Only safe at
                                                    W=1 today (at W>1 the kernels need every program resident;
                                                    two per SM is resident only while resources allow)
Not included: 256x128 (the same tile count as 128x256, not a few-tile answer), 4 stages of the rule (measured
1.000 in session 4), BK = 32 (twice the K steps).

Runtime on one H200 (estimate; the device has Triton 3.6): start-up ~20 s (torch, CUDA, Triton). Compiles:
one per op x candidate x integer specialisation -- Triton specialises Ms / N / K on divisibility by 16, and of
the grid only M=3000 is not (6000 is), so 2 x 8 x 2 = 32 compiles (the probe prints the count it expects); on
this CPU box each takes 1-5 s (Triton 3.9), say 3-8 s on the device: 1.5-4 min. The checked call's
``check_s`` shows where they fell. Timing: per time_op (iters 10, warmup 3) ~10 x 2.3 ms of flush, sync and
spin plus 13 calls of the op; the 48 GEMMs sum to ~23 ms per call of kosmos today (small tiles may be up to
~2x slower on the big shapes), so ~1.5 s per op and candidate over the 48 shapes: 2 x 8 x 1.5 = ~25 s, plus
cuBLAS (48 x ~30 ms) and the fp32 references and checks (~15 TFLOP at the fp32 rate: ~0.5 s): ~30 s. In all
~2.5-5 min; ``--max-seconds`` (dev/archive/x1_session.sh's ``tiles`` stage: 420) stops starting new work past the
deadline and keeps what is done. Work runs shape by shape (every op and candidate of a shape before the next
shape), so a deadline leaves complete comparisons for the shapes done.

CPU: ``--check-only`` runs only the correctness check (no timing: that needs CUDA); ``--cpu-smoke`` is
``--check-only`` on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, set it before Python starts),
with a 3-program grid and tiny candidates (the interpreter's rule gives 16x32x16), e.g.

    TRITON_INTERPRET=1 PYTHONPATH=. python -m dev.tile_probe --cpu-smoke --shapes 40x64x48 \\
        --candidates rule,32x16x16w4s1

(tests/test_dev_probes.py runs the same on 40x64x48 with the candidates 16x32x16w4s1 and 32x16x16w4s1: ~1 s.)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass

import torch

from dev.rows import Rows

START = time.monotonic()  # reset by main(): deadlines count from the run, not from the import
GRID_SUITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "suites", "tp-grid.yaml")
OPS = ("ag_gemm", "gemm_rs")
DEFAULT_CANDIDATES = ("rule,128x256x128w8s2,128x128x64w8s4,128x128x64w4s4,64x256x64w4s4,64x128x64w4s4,"
                      "64x64x64w4s6,64x128x64w4s4g2")
SMOKE_CANDIDATES = "rule,32x16x16w4s1"
TOL = 1e-2
SMEM_LIMIT = 227 * 1024
INTERP_GRID = 3
TIMEOUT_NS = 5_000_000_000
_SPEC = re.compile(r"^(\d+)x(\d+)x(\d+)(?:w(\d+))?(?:s(\d+))?(?:g(\d+))?$")


@dataclass(frozen=True)
class Candidate:
    name: str
    cfg: object = None  # a planning.TileConfig; None: the rule's choice for each shape
    per_sm: int = 1     # programs per SM (grid = per_sm x SMs)


def parse_candidate(spec: str) -> Candidate:
    from kosmos.core.planning import TileConfig
    spec = spec.strip()
    if spec == "rule":
        return Candidate("rule")
    m = _SPEC.match(spec)
    if not m:
        raise ValueError(f"candidate {spec!r}: not 'rule' or BMxBNxBK[wWARPS][sSTAGES][gPERSM], "
                         "e.g. 128x128x64w8s4")
    bm, bn, bk = (int(v) for v in m.group(1, 2, 3))
    warps = int(m.group(4)) if m.group(4) else (4 if bm <= 64 else 8)
    stages = int(m.group(5)) if m.group(5) else 3
    per_sm = int(m.group(6)) if m.group(6) else 1
    return Candidate(spec, TileConfig(bm, bn, bk, warps, stages), per_sm)


def parse_candidates(text: str) -> list[Candidate]:
    cands = [parse_candidate(s) for s in text.split(",") if s.strip()]
    names = [c.name for c in cands]
    if len(set(names)) != len(names):
        raise ValueError(f"candidates repeat: {names}")
    return cands


def resolve(cand: Candidate, m: int, n: int, k: int, programs: int = 132):
    from kosmos.core import planning
    return cand.cfg if cand.cfg is not None else planning.tile_config(m, n, k, programs=programs)


def static_reason(cfg) -> str | None:
    """Why the kernels cannot take ``cfg`` (None: they can, as far as can be told without compiling; shared
    memory is left to the compiler, whose out-of-resources error is recorded)."""
    pow2 = lambda v: v > 0 and v & (v - 1) == 0  # noqa: E731
    if not (pow2(cfg.BM) and pow2(cfg.BN)):
        return f"BM={cfg.BM}, BN={cfg.BN}: powers of two needed (tl.arange in the epilogue)"
    if cfg.BN < 16:
        return f"BN={cfg.BN} < 16: the half-width TMA store needs rows of >= 16 bytes"
    if max(cfg.BM, cfg.BN, cfg.BK) > 256:
        return "a TMA box side > 256"
    if cfg.BK % 16:
        return f"BK={cfg.BK}: a multiple of 16 needed (bf16 MMA K step)"
    if cfg.num_warps not in (4, 8):
        return f"num_warps={cfg.num_warps}: 4 or 8"
    if cfg.num_stages < 1:
        return "num_stages < 1"
    return None


def load_shapes(text: str | None) -> list[tuple[int, int, int]]:
    if text:
        out = []
        for s in text.split(","):
            parts = s.strip().lower().split("x")
            if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
                raise ValueError(f"shape {s!r}: not MxNxK")
            out.append(tuple(int(p) for p in parts))
    else:
        import yaml
        with open(GRID_SUITE) as f:
            suite = yaml.safe_load(f)
        out = [tuple(int(p) for p in s.split("x")) for s in suite["shapes"]["ag_gemm"]]
    for m, n, k in out:
        if n % 8 or k % 8:
            raise ValueError(f"shape {m}x{n}x{k}: N and K must be multiples of 8 (TMA)")
    return list(dict.fromkeys(out))


def spec_key(m, n, k):
    """What Triton specialises the kernels' integer arguments (Ms, N, K) on: == 1 and divisibility by 16."""
    return tuple((v == 1, v % 16 == 0) for v in (m, n, k))


def expected_compiles(shapes, ops, cands) -> int:
    keys = set()
    for m, n, k in shapes:
        for op in ops:
            for c in cands:
                cfg = resolve(c, m, n, k)
                if static_reason(cfg) is None:
                    keys.add((op, cfg, c.per_sm, spec_key(m, n, k)))
    return len(keys)


# ------------------------------------------------------------------------------------------------- launching
class Buffers:
    """The W=1 launch's side buffers, shared by every launch (each launch leaves the heads at zero)."""

    def __init__(self, device):
        from kosmos.core import runtime
        self.peers = torch.zeros(1, dtype=torch.int64, device=device)
        self.sig = torch.zeros(runtime.FLAG_BASE + (1 << 16), dtype=torch.int32, device=device)
        self.heads = torch.zeros(runtime.NUM_HEADS, dtype=torch.int32, device=device)
        self.errors = torch.zeros(runtime.ERR_SLOTS, dtype=torch.int64, device=device)
        self.epoch_slot = torch.zeros(1, dtype=torch.int32, device=device)  # the device-resident epoch

    def clean(self) -> str | None:
        from kosmos.core import runtime
        if self.heads.tolist() != [0] * runtime.NUM_HEADS:
            return f"queue heads not reset: {self.heads.tolist()}"
        err = self.errors.tolist()
        if err != [0] * runtime.ERR_SLOTS:
            return runtime.decode_error(err)
        return None


def make_launch(op, a, b, c, cfg, grid, bufs):
    """fn() = one W=1 call of ``op`` on explicit buffers with tile ``cfg`` (the launch advances the device-resident
    epoch in ``bufs.epoch_slot`` itself, as the public op's workspace does)."""
    from kosmos.ops import all_gather_matmul as ag
    from kosmos.ops import matmul_reduce_scatter as rs
    mod = ag if op == "ag_gemm" else rs

    def fn():
        # AG at W=1: the gathered buffer is the shard itself; RS at W=1: the tiles store straight into c
        mod.launch(a, b, False, c, a if op == "ag_gemm" else c, bufs.peers, bufs.peers, bufs.sig, bufs.heads,
                   bufs.errors, rank=0, world=1, epoch_slot=bufs.epoch_slot, timeout_ns=TIMEOUT_NS, grid=grid,
                   cfg=cfg)
    return fn


def _fault(e: Exception) -> bool:
    """A CUDA fault: the context is gone, nothing after it can run."""
    text = str(e).lower()
    return any(s in text for s in ("illegal memory access", "illegal instruction", "unspecified launch failure",
                                   "misaligned address", "device-side assert", "cuda error"))


def _short(e: Exception) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1][:300] if lines else ''}"


def geomean(vals):
    vals = [v for v in vals if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


# --------------------------------------------------------------------------------------------------- the run
def run(args) -> list[dict]:
    from kosmos import reference
    from kosmos.core import runtime
    cands = parse_candidates(args.candidates)
    shapes = load_shapes(args.shapes)
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    for o in ops:
        if o not in OPS:
            raise ValueError(f"unknown op {o!r}; choose from {', '.join(OPS)}")
    cpu = args.cpu_smoke
    if cpu and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--cpu-smoke needs TRITON_INTERPRET=1 in the environment before Python starts")
    if not cpu and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --cpu-smoke (under TRITON_INTERPRET=1) for the check-only CPU run")
    check_only = args.check_only or cpu
    device = torch.device("cpu") if cpu else torch.device("cuda", torch.cuda.current_device())
    sms = INTERP_GRID if cpu else runtime.num_sms(device)
    if not cpu:
        torch.backends.cuda.matmul.allow_tf32 = False
        runtime.ensure_triton_allocator()
    timing = None
    if not check_only:
        from kosmos_bench import timing
    bufs = Buffers(device)
    rows = Rows(args.json)
    emit = rows.emit

    n_items = len(shapes) * len(ops) * len(cands)
    import triton
    env = {"type": "env", "device": torch.cuda.get_device_name(device) if not cpu else "cpu (interpreter)",
           "sm_count": sms, "torch": torch.__version__, "triton": triton.__version__,
           "git_commit": os.environ.get("KOSMOS_GIT_COMMIT"), "check_only": check_only, "iters": args.iters,
           "warmup": args.warmup, "candidates": [c.name for c in cands], "ops": ops, "shapes": len(shapes),
           "expected_compiles": expected_compiles(shapes, ops, cands), "max_seconds": args.max_seconds}
    emit(env)
    print(f"tile probe: {len(shapes)} shapes x {len(ops)} ops x {len(cands)} candidates = {n_items} items, "
          f"~{env['expected_compiles']} compiles expected, grid {sms} programs (x g), "
          f"{'check only' if check_only else f'iters {args.iters} warmup {args.warmup}'}", flush=True)
    done = 0
    stopped = fatal = None
    for si, (m, n, k) in enumerate(shapes):
        if args.max_seconds and time.monotonic() - START > args.max_seconds:
            stopped = f"deadline ({args.max_seconds} s) before shape {si + 1} of {len(shapes)}"
            break
        gen = torch.Generator(device=device).manual_seed(1000003 * m + 7919 * n + k)
        a = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
        b = (torch.randn(k, n, device=device, generator=gen) / math.sqrt(k)).to(torch.bfloat16)
        ref = a.float() @ b.float()
        c = torch.empty(m, n, dtype=torch.bfloat16, device=device)
        t_gemm = None
        if not check_only:
            t_gemm = timing.time_op(lambda: torch.matmul(a, b), iters=args.iters, warmup=args.warmup)["time_ms"]
        for op in ops:
            for cand in cands:
                if args.max_seconds and time.monotonic() - START > args.max_seconds:
                    stopped = f"deadline ({args.max_seconds} s) inside shape {m}x{n}x{k}"
                    break
                cfg = resolve(cand, m, n, k, programs=sms)
                grid = sms * cand.per_sm
                row = {"type": "result", "m": m, "n": n, "k": k, "op": op, "cand": cand.name, "BM": cfg.BM,
                       "BN": cfg.BN, "BK": cfg.BK, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                       "grid": grid, "time_ms": None, "p20_ms": None, "p80_ms": None, "t_gemm_ms": t_gemm,
                       "ratio": None, "rel_err": None, "check_s": None, "status": None, "reason": None}
                reason = static_reason(cfg)
                if reason:
                    row.update(status="skipped", reason=reason)
                    emit(row)
                    done += 1
                    continue
                fn = make_launch(op, a, b, c, cfg, grid, bufs)
                try:
                    c.fill_(float("nan"))
                    t0 = time.monotonic()
                    fn()
                    dirty = bufs.clean()  # (a host read: synchronises)
                    row["check_s"] = round(time.monotonic() - t0, 3)
                    err = reference.rel_err(c, ref)
                    row["rel_err"] = err
                    if dirty:
                        row.update(status="wrong", reason=dirty)
                    elif not err < TOL:
                        row.update(status="wrong", reason=f"rel err {err:.3g} >= {TOL}")
                    elif check_only:
                        row["status"] = "ok"
                    else:
                        t = timing.time_op(fn, iters=args.iters, warmup=args.warmup)
                        dirty = bufs.clean()
                        row.update(time_ms=t["time_ms"], p20_ms=t["p20_ms"], p80_ms=t["p80_ms"],
                                   ratio=t_gemm / t["time_ms"], status="wrong" if dirty else "ok", reason=dirty)
                except Exception as e:  # noqa: BLE001 -- a compile error, out of resources, a fault: recorded
                    row.update(status="failed", reason=_short(e))
                    if not cpu and _fault(e):
                        fatal = f"CUDA fault at {m}x{n}x{k} {op} {cand.name}: {_short(e)}"
                emit(row)
                done += 1
                r = row
                print(f"  {m}x{n}x{k} {op} {cand.name:<18} {r['status']:<7} "
                      + (f"{r['time_ms']:.4f} ms ratio {r['ratio']:.3f} " if r["time_ms"] else "")
                      + (f"err {r['rel_err']:.1e} " if r["rel_err"] is not None else "")
                      + (f"check {r['check_s']:.1f} s " if r["check_s"] is not None else "")
                      + (r["reason"] or ""), flush=True)
                if fatal:
                    break
            if stopped or fatal:
                break
        del a, b, ref, c
        if stopped or fatal:
            break
    rows.close()
    slow = [r["check_s"] for r in rows if (r.get("check_s") or 0) > 1.0]
    print(f"checked calls over 1 s (compiles, mostly): {len(slow)}, {sum(slow):.0f} s in all", flush=True)
    print(f"done {done} of {n_items} items in {time.monotonic() - START:.0f} s"
          + (f"; stopped: {stopped}" if stopped else "") + (f"; {fatal}" if fatal else ""), flush=True)
    return rows


# ------------------------------------------------------------------------------------------------- the table
def table(rows) -> str:
    res = [r for r in rows if r.get("type") == "result"]
    lines = []
    for op in dict.fromkeys(r["op"] for r in res):
        rs = [r for r in res if r["op"] == op]
        cands = list(dict.fromkeys(r["cand"] for r in rs))
        shapes = list(dict.fromkeys((r["m"], r["n"], r["k"]) for r in rs))
        by = {((r["m"], r["n"], r["k"]), r["cand"]): r for r in rs}
        timed = any(r.get("ratio") for r in rs)
        lines.append(f"== {op}: {len(shapes)} shapes")
        if not timed:  # check-only
            for c in cands:
                cr = [by[s, c] for s in shapes if (s, c) in by]
                ok = [r for r in cr if r["status"] == "ok"]
                errs = [r["rel_err"] for r in cr if r.get("rel_err") is not None]
                bad = "; ".join(f"{r['m']}x{r['n']}x{r['k']} {r['status']}: {r['reason']}" for r in cr
                                if r["status"] != "ok")[:300]
                lines.append(f"  {c:<20} passed {len(ok)}/{len(cr)}  max rel err "
                             f"{max(errs):.2e}" if errs else f"  {c:<20} passed {len(ok)}/{len(cr)}")
                if bad:
                    lines.append(f"    {bad}")
            continue
        lines.append(f"  {'candidate':<20} {'geomean t_gemm/time':>20} {'shapes ok':>10} {'vs rule, same shapes':>21}")
        for c in cands:
            ok = [s for s in shapes if (s, c) in by and by[s, c].get("ratio")]
            g = geomean([by[s, c]["ratio"] for s in ok])
            both = [s for s in ok if (s, "rule") in by and by[s, "rule"].get("ratio")]
            rel = geomean([by[s, c]["ratio"] / by[s, "rule"]["ratio"] for s in both]) if both else None
            lines.append(f"  {c:<20} {g if g is None else f'{g:.3f}':>20} {f'{len(ok)}/{len(shapes)}':>10} "
                         f"{'-' if rel is None else f'{rel:.3f}':>21}")
        for c in cands:
            bad = [r for r in rs if r["cand"] == c and r["status"] != "ok"]
            if bad:
                r = bad[0]
                lines.append(f"  {c}: {len(bad)} not ok, e.g. {r['m']}x{r['n']}x{r['k']} {r['status']}: "
                             f"{(r.get('reason') or '')[:160]}")
        lines.append(f"  {'shape':<20} {'rule':>7} {'best':>20} {'ratio':>7}")
        best_r, rule_r = [], []
        for s in shapes:
            cand_r = [(by[s, c]["ratio"], c) for c in cands if (s, c) in by and by[s, c].get("ratio")]
            if not cand_r:
                lines.append(f"  {'x'.join(map(str, s)):<20} {'-':>7} {'(none ok)':>20}")
                continue
            r, c = max(cand_r)
            rr = by[s, "rule"]["ratio"] if (s, "rule") in by and by[s, "rule"].get("ratio") else None
            best_r.append(r)
            if rr:
                rule_r.append(rr)
            lines.append(f"  {'x'.join(map(str, s)):<20} {'-' if rr is None else f'{rr:.3f}':>7} {c:>20} {r:>7.3f}")
        gb, gr = geomean(best_r), geomean(rule_r)
        if gb is not None:
            lines.append(f"  best per shape: geomean {gb:.3f} over {len(best_r)} shapes, min {min(best_r):.3f}, "
                         f"{sum(r < 0.90 for r in best_r)} under 0.90"
                         + (f"; rule {gr:.3f} over {len(rule_r)}" if gr else ""))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------- --resources
def resources(cands, world: int = 1, m: int = 4096, n: int = 4096, k: int = 4096) -> list[dict]:
    """Compile every candidate for sm_90a at W=1 (no GPU: dev.kernel_resources' stand-in driver when there is
    none) and read ptxas's registers / spills and the shared memory."""
    from dev import kernel_resources as kr
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the interpreter compiles nothing")
    if torch.cuda.is_available():
        dev, sms = torch.device("cuda"), torch.cuda.get_device_properties(0).multi_processor_count
    else:
        kr._use_stand_in_driver()
        dev, sms = torch.device("cpu"), 132
    from kosmos.core import runtime
    from kosmos.ops import all_gather_matmul as ag
    from kosmos.ops import matmul_reduce_scatter as rs
    runtime.ensure_triton_allocator()
    bufs = Buffers(dev)
    a = torch.empty(m, k, dtype=torch.bfloat16, device=dev)
    b = torch.empty(k, n, dtype=torch.bfloat16, device=dev)
    c = torch.empty(m, n, dtype=torch.bfloat16, device=dev)
    out = []
    for cand in cands:
        cfg = resolve(cand, m, n, k)
        for op, mod, kname in (("ag_gemm", ag, "_all_gather_matmul_kernel"),
                               ("gemm_rs", rs, "_matmul_reduce_scatter_kernel")):
            row = {"cand": cand.name, "op": op, "cfg": str(cfg)}
            t0 = time.monotonic()
            try:
                row.update(kr._compile(mod, kname, make_launch(op, a, b, c, cfg, sms * cand.per_sm, bufs)))
            except Exception as e:  # noqa: BLE001
                row["error"] = _short(e)
            row["compile_s"] = round(time.monotonic() - t0, 1)
            print(f"  {cand.name:<20} {op:<8} " + (row.get("error") or
                  f"regs {row['regs']} spill {row['spill_bytes']} B shared {row['shared_kib']} KiB "
                  f"({row['compile_s']} s)"), flush=True)
            out.append(row)
    return out


def main(argv=None) -> int:
    global START
    START = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=None, help="MxNxK,... (default: the 48 GEMMs of suites/tp-grid.yaml)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--candidates", default=None, help=f"default: {DEFAULT_CANDIDATES} "
                    f"(--cpu-smoke: {SMOKE_CANDIDATES})")
    ap.add_argument("--json", default=None, help="write the JSONL rows here (one per line as each is done)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--max-seconds", type=float, default=None, help="start no new work past this many seconds "
                    "after start-up (the rows done so far are kept)")
    ap.add_argument("--check-only", action="store_true", help="only the correctness check of each candidate")
    ap.add_argument("--cpu-smoke", action="store_true", help="--check-only on the CPU under TRITON_INTERPRET=1")
    ap.add_argument("--table", default=None, metavar="JSONL", help="only print the table of a finished run")
    ap.add_argument("--resources", action="store_true", help="only compile the candidates for sm_90a and print "
                    "registers / spills / shared memory (works without a GPU)")
    args = ap.parse_args(argv)
    if args.table:
        with open(args.table) as f:
            print(table([json.loads(line) for line in f if line.strip()]))
        return 0
    if args.candidates is None:
        args.candidates = SMOKE_CANDIDATES if args.cpu_smoke else DEFAULT_CANDIDATES
    if args.resources:
        resources(parse_candidates(args.candidates))
        return 0
    rows = run(args)
    print(table(rows), flush=True)
    # 0 when some candidate ran correctly (a candidate failing is a result, not an error of the probe)
    return 0 if any(r.get("status") == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
