"""Does a statically scheduled persistent GEMM with a flattened tile x K loop close issue 13's grid gap at W=1?
(a developer probe, not product code)

    PYTHONPATH=. python -m dev.flat_probe [--shapes MxNxK,...] [--json OUT.jsonl] [--max-seconds S]

A fork of kosmos.gemm.w1_static.w1_matmul_kernel (as of 4637098, then kernels/common.py; the product kernel was
made from this probe's loop in that commit): _static_matmul is that kernel (today its unsplit path: SPLIT 1, no
tail) with the grid a constexpr (PROGRAMS), the flattening and warp specialisation as switches (FLATTEN, WS), the K
loop written out instead of tile_matmul (tl.dot of the two TMA loads: B [K, N] only, no DOT_FP32), every tile
stored by TMA (store_tile_tma, as the product does since session 16) and no device-epoch advance (the product
advances it since). The product's own variants (w1-*, split-*, sk-*, tail-*) run the imported kernel (product_w1).

At W=1 the TP ops have nothing to wait for, yet they run the self-scheduled loop: a task claimed from an atomic
queue, then its whole K loop (a 3-stage TMA pipeline that drains at the end of every tile: nothing is prefetched
across tiles in a dynamic loop), the epilogue, the next claim. planning.tile_config's docstring puts the loss
at the edges -- ~1 us between two tiles, the last partial wave, ~9 us of launch / prologue / exit -- and the
grid's worst shapes are the few-tile and short-K ones (K = 1024: a tile is 16 K steps, its fill and drain a
large share). Triton's persistent-matmul pattern (``tl.range(pid, tiles, PROGRAMS, flatten=True)`` around the K
loop) lets the software pipeliner run one loop over (tile, k) pairs, so the next tile's first loads are in
flight during this tile's epilogue; the tile order is static (program p takes tiles p, p + P, ...), so there is
no claim, no table and no exit protocol.

Variants, each on the same operands (A [M, K], B [K, N] bf16, row-major, as the TP ops take them), checked
against torch.matmul in fp32 (relative Frobenius error < 1e-2, output poisoned first), then timed with
kosmos_bench.timing.time_op (L2 flushed, host hidden), as the grid bench times (t_gemm_ms = torch.matmul):
  kosmos          kosmos.matmul_reduce_scatter(a, b) at W=1 (today's op: planning.tile_config's tile)
  flat-rule       the flattened loop at the rule's tile (and warps / stages)
  flat-128x256    the flattened loop at 128x256x64, 8 warps, 3 stages
  flat-128x128    the flattened loop at 128x128x64, 8 warps, 4 stages
  loop-rule       the rule's tile, static schedule, NOT flattened (separates the flattening from the claim)
Output: one JSONL row per shape x variant (ratio = t_gemm_ms / time_ms), then a table: per variant the geomean
ratio over the shapes, its minimum, the shapes under 0.90x; per shape the best variant.
PREDICTION (session 16, before any run): flat-rule >= kosmos on every shape; +5-15% on the K = 1024 shapes
(6000x1536x1024 0.705x -> ~0.80x), ~0 on the few-tile long-K ones (512x1536x7168 stays ~0.59x: 96 tiles of
64x128, one wave, nothing to overlap across tiles), ~+1-2% on the big ones; geomean 0.87 -> ~0.89.
--splits (session 17): the product kernel (w1-unsplit: the rule's tile, no split) against its K split
(split-128x128-2: 2 programs per tile, the partial sums reduced by both) and its stream-K schedule
(sk-128x256, sk-128x128). The first form of this mode (s17b/s17c) timed splits of 2-6 parts at 128x256 and
128x128 too; their figures are in planning.w1_plan's docstring. PREDICTION before the run, best split
against w1-unsplit: 512x1536x7168 0.62x -> ~0.80x of cuBLAS (128x256, S = 5), 256x4096x4096 0.78 -> ~0.88,
512x5120x5120 0.74 -> ~0.80, 256x6144x8192 0.87 -> ~0.92, 1024x3072x8192 ~+3%; no gain (a loss) at K <= 2048
and on the many-wave shapes.
Session 18: sk-128x256 / sk-128x128 time the stream-K v2 schedule (data-parallel waves, then runs reading K in
step; kernels/common.w1_matmul_kernel), at the shapes of ``--shapes`` (s18a: the 18 where w1_plan first
streamed; figures in planning.w1_plan's docstring).
--tails (session 19): tiles between Triton's powers of two -- 128 + 64 = 192 or 128 + 32 = 160 columns, two
accumulators per tile (kernels/common.tile_matmul_tail) -- so that a last wave of tiles is fuller:
1024x3072x8192 makes 96 tiles of 128x256 on 132 SMs (0.73 of a wave) but 128 of 128x192; 512x5120x5120 80
of 128x256, 128 of 128x160. PREDICTION (before the run, s19a): where the wave model puts 192 or 160 ahead
(1024x3072x8192, 2048x1536x5120, 4096x1536x4096, 1024x6144x7168, 512x5120x5120, 2048x5120x4096), +10-25% over
w1-plan; on many-wave shapes 128x192 at ~0.95-0.97 of 128x256's rate, 128x160 ~0.90-0.93. 128 x (64 + 32)
(4 warps) for the few-tile shapes (512x3072x2048: 128 tiles of it, 96 of 128x128): ~+5% there.
MEASURED (s19a): every tail variant lost everywhere -- tail-192 0.53-0.66x of cuBLAS, tail-160 0.33-0.60,
128 x (64 + 32) 0.29-0.34 -- the product kernel then flattened the tail tile loop (dev/archive/tail_probe and
planning.w1_plan's docstring: the plain loop in the right load order runs 0.86-0.90x).
--odd (session 20): dev/archive/cublas_names found cuBLAS (nvjet kernels) tiling every few-tile grid shape into exactly
128 or 256 tiles with widths between powers of two (64x96 at 512x1536x7168, 128x96 at 256x6144x8192 and
512x3072x2048, 64x320 at 512x5120x5120, 128x192 at 1024x3072x8192 / 4096x1536x4096) and 2-CTA clusters (TMA
multicast of one operand), never split-K. This mode times our tail tiles at those tile counts (plain tile loop,
the load order of session 19's fix): 128 x (64 + 32), 64 x (128 + 64), 64 x (256 + 64), 64 x 256, against the
plan and 128x128. PREDICTION (before s20b): where the 64- or 96-wide tiles make ~128 tiles instead of 96 or 64
(512x3072x2048, 256x6144x8192, 512x1536x7168) one of them beats w1-plan by 3-8%; 4096x1536x4096 at 128x192 (256
tiles) within +-3% of 128x128; no 64-row tile reaches cuBLAS without the multicast (each reads B twice as often).
--occupancy (session 18): what hides a tile's epilogue and prologue at short K -- two programs per SM of the
product kernel at 128x128 (3 stages, 4 or 8 warps: each program's epilogue under the other's mainloop), and the
flattened loop warp-specialised (tl.range(..., warp_specialize=True)) at 128x256 / 128x128. PREDICTION (before
the run, s18e): at K = 1024 two programs per SM +5-10% over w1-unsplit (6000x1536x1024 0.86 -> ~0.93), the
warp-specialised loop compiles on Triton 3.6 for Hopper and gains ~3% there; at K >= 4096 neither gains.
MEASURED (s18e, 15 shapes): two programs per SM (4 warps) +0.1-4.2% at K = 1024 where the 128x128 tiles fill
the SMs and 128x256 makes <= 16 waves (6000x1536x1024 0.872 -> 0.882: less than predicted), lost at 108
waves and at 24 tiles, and at every K >= 2048 shape; 8 warps lost to 4; warp specialisation lost or tied.
planning.w1_plan took the 4-warp two-per-SM schedule for K <= 1024 (figures in its docstring).
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import triton
import triton.language as tl

from dev.rows import Rows
from kosmos.gemm.tiles import _grouped_tile, store_tile_tma
from kosmos.core.planning import GROUP_M


@triton.jit
def _static_matmul(a_desc, b_desc, c_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                   GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr, STAGES: tl.constexpr,
                   WS: tl.constexpr = False):
    """C = A @ B, program p taking tiles p, p + PROGRAMS, ...; FLATTEN: one software-pipelined loop over the
    (tile, k) pairs (the epilogue's tile id recomputed, as the pipeliner needs it not carried across). The
    probe's form of kernels/common.w1_matmul_kernel, which it became (session 16), with the grid a constexpr
    and the flattening a switch."""
    pid = tl.program_id(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    tiles = n_m * n_n
    t_out = pid - PROGRAMS
    for t in tl.range(pid, tiles, PROGRAMS, flatten=FLATTEN, num_stages=STAGES, warp_specialize=WS):
        tm, tn = _grouped_tile(t, n_m, n_n, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in range(k_steps):
            acc = tl.dot(a_desc.load([tm * BM, kk * BK]), b_desc.load([kk * BK, tn * BN]), acc)
        t_out += PROGRAMS
        om, on = _grouped_tile(t_out, n_m, n_n, GROUP_M)
        store_tile_tma(c_desc, acc, om * BM, on * BN, BM, BN)


def product_w1(a, b, cfg, split, programs, rb=None, stream_k=False, tail=0):
    """The product kernel (kernels/common.w1_matmul_kernel) at tile ``cfg`` and K split ``split``, launched
    directly (its own partial buffer and counters); ``rb``: the rows per block of the split's sum instead of
    common.w1_reduce_rows'; ``stream_k``: the stream-K schedule (``split`` 1); ``tail``: tiles cfg.BN + tail
    wide (unsplit)."""
    from kosmos.core import codes, planning, runtime
    from kosmos.gemm.w1_static import w1_matmul_args, w1_matmul_kernel, w1_partial_elems, w1_split_grid, w1_stream_k_grid
    m, k = a.shape
    n = b.shape[1]
    tiles = triton.cdiv(m, cfg.BM) * triton.cdiv(n, cfg.BN)
    c = torch.empty((m, n), device=a.device, dtype=torch.bfloat16)
    epoch = torch.zeros(1, dtype=torch.int32, device=a.device)
    extra = {}
    if stream_k:
        grid = w1_stream_k_grid(programs, tiles, k, cfg)
        ws = runtime.get_workspace(None, a.device)
        ws.ensure(0, 0)
        extra = dict(partials=torch.empty(2 * grid * cfg.BM * cfg.BN, device=a.device),
                     counters=torch.zeros(tiles, dtype=torch.int32, device=a.device),
                     errors=ws.errors, timeout_ns=ws.timeout_ns(), stream_k=True)
    elif split > 1:
        grid = w1_split_grid(programs, tiles, split)
        ws = runtime.get_workspace(None, a.device)
        ws.ensure(0, 0)
        extra = dict(partials=torch.empty(w1_partial_elems(grid, tiles, split, cfg), device=a.device),
                     counters=torch.zeros(2 * (grid // split), dtype=torch.int32, device=a.device),
                     errors=ws.errors, timeout_ns=ws.timeout_ns())
    g, args, kw = w1_matmul_args(a, b, False, c, cfg, epoch, programs, GROUP_M, False, split=split,
                                 op=codes.OP_MATMUL_REDUCE_SCATTER.value, tail=tail, **extra)
    if rb is not None:
        kw["RB"] = rb

    def fn():
        w1_matmul_kernel[(g,)](*args, **kw)
        return c
    return fn


def static_matmul(a, b, bm, bn, bk, warps, stages, flatten, programs, ws=False):
    from triton.tools.tensor_descriptor import TensorDescriptor
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty((m, n), device=a.device, dtype=torch.bfloat16)
    ad = TensorDescriptor.from_tensor(a, [bm, bk])
    bd = TensorDescriptor.from_tensor(b, [bk, bn])
    cd = TensorDescriptor.from_tensor(c, [bm, bn // 2])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = min(programs, tiles)

    def fn():
        _static_matmul[(grid,)](ad, bd, cd, m, n, k, BM=bm, BN=bn, BK=bk, GROUP_M=GROUP_M, PROGRAMS=grid,
                                FLATTEN=flatten, STAGES=stages, WS=ws, num_warps=warps, num_stages=stages)
        return c
    return fn


def check_and_time(fn, ref, t_gemm: float, row: dict, iters: int, warmup: int, check: bool = True) -> None:
    """One variant into ``row``: its output poisoned, recomputed and (``check``) held to 1e-2 relative error
    against ``ref`` (status "wrong" otherwise, not timed), then timed as the bench times (time_ms, ratio to
    ``t_gemm``: torch.matmul alone); an exception is recorded as "failed" and the probe goes on."""
    from kosmos_bench import timing
    try:
        out = fn()
        out.fill_(float("nan"))
        out = fn()
        torch.cuda.synchronize()
        if check:
            row["rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
            if not row["rel_err"] < 1e-2:
                row.update(status="wrong")
                return
        tm = timing.time_op(fn, iters=iters, warmup=warmup)
        row.update(status="ok", time_ms=tm["time_ms"], ratio=t_gemm / tm["time_ms"])
    except Exception as e:  # noqa: BLE001 -- recorded, the probe goes on
        row.update(status="failed", reason=f"{type(e).__name__}: {str(e)[:200]}")


DEFAULT_SHAPES = ("512x1536x7168,256x4096x4096,256x1536x1024,512x5120x5120,6000x1536x1024,512x3072x2048,"
                  "1024x3072x8192,2048x1536x5120,256x8192x2048,256x6144x8192,3000x3072x7168,3000x5120x1024,"
                  "1024x8192x1024,4096x1536x4096,4096x14336x1024,8192x6144x1024,4096x8192x8192,8192x28672x4096,"
                  "16384x5120x2048,3000x6912x2880")


def geomean(v):
    v = [x for x in v if x and x > 0]
    return math.exp(sum(map(math.log, v)) / len(v)) if v else float("nan")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--splits", action="store_true",
                    help="time the product kernel unsplit, K-split and stream-K instead")
    ap.add_argument("--occupancy", action="store_true",
                    help="time two programs per SM (128x128, 3 stages) and warp-specialised loops instead")
    ap.add_argument("--odd", action="store_true",
                    help="session 20: cuBLAS's tile counts (dev/archive/cublas_names) with our tiles -- 128x96, 64x192, "
                         "64x320 as tail tiles (plain loop), 64x256 -- on the few-tile shapes")
    ap.add_argument("--tails", action="store_true",
                    help="time tiles 128 + a 64- or 32-column tail wide (192, 160) against 128x256 / 128x128")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("flat_probe: needs a CUDA GPU")
    import kosmos
    from kosmos.core import planning, runtime
    from kosmos_bench import timing
    from kosmos_bench.environment import environment
    torch.backends.cuda.matmul.allow_tf32 = False
    runtime.ensure_triton_allocator()
    dev = torch.device("cuda", torch.cuda.current_device())
    programs = runtime.num_sms(dev)
    rows = Rows(args.json)
    rows.emit(environment(argv=["python", "-m", "dev.flat_probe"] + list(argv or []), bench="tp",
                          suite={"probe": "flat_probe", **vars(args)}))
    shapes = [tuple(int(p) for p in s.split("x")) for s in args.shapes.split(",") if s.strip()]
    t_end = time.monotonic() + args.max_seconds
    for m, n, k in shapes:
        if time.monotonic() > t_end:
            print(f"stopped at {m}x{n}x{k}: --max-seconds", flush=True)
            break
        g = torch.Generator(device=dev).manual_seed(m * 7 + n * 13 + k)
        a = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
        b = torch.randn(k, n, device=dev, generator=g).to(torch.bfloat16)
        ref = a.float() @ b.float()
        t_gemm = timing.time_op(lambda: a @ b, iters=args.iters, warmup=args.warmup)["time_ms"]
        rule = planning.tile_config(m, n, k, world=1, programs=programs)
        if args.splits:
            w1 = planning.w1_plan(m, n, k, programs=programs)
            t128 = planning.TileConfig(128, 128, 64, 4, 4)
            variants = {"kosmos": lambda: kosmos.matmul_reduce_scatter(a, b),
                        "w1-unsplit": product_w1(a, b, rule, 1, programs),
                        "sk-128x256": product_w1(a, b, planning.TileConfig(128, 256, 64, 8, 3), 1, programs,
                                                 stream_k=True),
                        "sk-128x128": product_w1(a, b, t128, 1, programs, stream_k=True)}
            if triton.cdiv(k, 64) >= 16:
                variants["split-128x128-2"] = product_w1(a, b, t128, 2, programs)
            print(f"{m}x{n}x{k}: w1_plan {w1}", flush=True)
        elif args.tails:
            w1 = planning.w1_plan(m, n, k, programs=programs)
            t128w8 = lambda stages: planning.TileConfig(128, 128, 64, 8, stages)  # noqa: E731
            variants = {"w1-plan": lambda: kosmos.matmul_reduce_scatter(a, b),
                        "w1-128x256": product_w1(a, b, planning.TileConfig(128, 256, 64, 8, 3), 1, programs),
                        "w1-128x128": product_w1(a, b, planning.TileConfig(128, 128, 64, 4, 4), 1, programs),
                        "tail-192s3": product_w1(a, b, t128w8(3), 1, programs, tail=64),
                        "tail-192s4": product_w1(a, b, t128w8(4), 1, programs, tail=64),
                        "tail-160s4": product_w1(a, b, t128w8(4), 1, programs, tail=32),
                        "tail-96s4": product_w1(a, b, planning.TileConfig(128, 64, 64, 4, 4), 1, programs, tail=32)}
            print(f"{m}x{n}x{k}: w1_plan {w1}", flush=True)
        elif args.odd:
            w1 = planning.w1_plan(m, n, k, programs=programs)
            tc = planning.TileConfig
            variants = {"w1-plan": lambda: kosmos.matmul_reduce_scatter(a, b),
                        "w1-128x128": product_w1(a, b, tc(128, 128, 64, 4, 4), 1, programs),
                        "tail-192s4": product_w1(a, b, tc(128, 128, 64, 8, 4), 1, programs, tail=64),
                        "tail-96s4": product_w1(a, b, tc(128, 64, 64, 4, 4), 1, programs, tail=32),
                        "tail64-192s4": product_w1(a, b, tc(64, 128, 64, 4, 4), 1, programs, tail=64),
                        "tail64-320s3": product_w1(a, b, tc(64, 256, 64, 4, 3), 1, programs, tail=64),
                        "w1-64x256s4": product_w1(a, b, tc(64, 256, 64, 4, 4), 1, programs)}
            print(f"{m}x{n}x{k}: w1_plan {w1}", flush=True)
        elif args.occupancy:
            variants = {"kosmos": lambda: kosmos.matmul_reduce_scatter(a, b),
                        "w1-unsplit": product_w1(a, b, rule, 1, programs),
                        "2cta-128x128w4": product_w1(a, b, planning.TileConfig(128, 128, 64, 4, 3), 1, 2 * programs),
                        "2cta-128x128w8": product_w1(a, b, planning.TileConfig(128, 128, 64, 8, 3), 1, 2 * programs),
                        "ws-128x256": static_matmul(a, b, 128, 256, 64, 8, 3, True, programs, ws=True),
                        "ws-128x128": static_matmul(a, b, 128, 128, 64, 8, 4, True, programs, ws=True)}
        else:
            variants = {
                "kosmos": lambda: kosmos.matmul_reduce_scatter(a, b),
                "flat-rule": static_matmul(a, b, rule.BM, rule.BN, rule.BK, rule.num_warps, rule.num_stages, True,
                                           programs),
                "flat-128x256": static_matmul(a, b, 128, 256, 64, 8, 3, True, programs),
                "flat-128x128": static_matmul(a, b, 128, 128, 64, 8, 4, True, programs),
                "loop-rule": static_matmul(a, b, rule.BM, rule.BN, rule.BK, rule.num_warps, rule.num_stages, False,
                                           programs),
            }
        for name, fn in variants.items():
            row = {"type": "result", "m": m, "n": n, "k": k, "variant": name, "t_gemm_ms": t_gemm,
                   "rule": f"{rule.BM}x{rule.BN}x{rule.BK}w{rule.num_warps}s{rule.num_stages}"}
            check_and_time(fn, ref, t_gemm, row, args.iters, args.warmup)
            rows.emit(row)
            print(f"{m}x{n}x{k} {name:<13} {row['status']:<6} "
                  f"{row.get('ratio', float('nan')):.3f}x cuBLAS ({row.get('time_ms', float('nan')) * 1e3:.1f} "
                  f"vs {t_gemm * 1e3:.1f} us) {row.get('reason', '')}", flush=True)
        del a, b, ref
    kosmos.check_errors()
    ok = [r for r in rows if r.get("status") == "ok"]
    names = list(dict.fromkeys(r["variant"] for r in ok))
    print(f"\n{'variant':<14} {'geomean':>8} {'min':>7} {'<0.90':>6} {'shapes':>7}")
    for v in names:
        rs = [r["ratio"] for r in ok if r["variant"] == v]
        print(f"{v:<14} {geomean(rs):8.3f} {min(rs):7.3f} {sum(x < 0.9 for x in rs):6d} {len(rs):7d}")
    best = {}
    for r in ok:
        key = (r["m"], r["n"], r["k"])
        if key not in best or r["ratio"] > best[key]["ratio"]:
            best[key] = r
    print("best per shape:", ", ".join(f"{m}x{n}x{k} {r['variant']} {r['ratio']:.3f}" for (m, n, k), r in best.items()))
    rows.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
