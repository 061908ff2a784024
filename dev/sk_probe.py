"""Where does the static W=1 GEMM's stream-K phase lose its ~16 us? (a developer probe, not product code)

    PYTHONPATH=. python -m dev.sk_probe [--shapes MxNxK,...] [--json OUT.jsonl] [--max-seconds S]

A fork of kosmos.gemm.w1_static.w1_matmul_kernel's STREAM_K path (as of 2f697f5, then kernels/common.py; the path
is unchanged since): _sk_matmul is that path with VARIANT switches (the fix-up cut back: gpu-fence, store, pieces,
dp-only; the sigma order of _sk_tile_order; the partials stored by TMA and counted by _count_partial_in, at once or
late), B [K, N] only, its bounded wait tagged op 0 / wait 0 (the product's: the TP op, WAIT_SPLIT_K), no
device-epoch advance. ``unsplit`` and ``product`` run the imported product kernel (dev.flat_probe.product_w1).

Session 18's probe (results/h200x1/s18/s18a) put kernels/common.w1_matmul_kernel's STREAM_K schedule (data-
parallel waves, then K-synchronised stream-K runs) 15-20 us over its ideal time on every shape, ~16 us over
the unsplit kernel's own fixed cost, whatever the shape. This probe takes the stream-K part apart: a copy of
that schedule with the fix-up cut back step by step (the variants below are timing-only except ``full``;
``pieces`` and ``store`` leave the tile sums incomplete and are not checked against torch):
  unsplit       the product kernel, no stream-K (common.w1_matmul_kernel, SPLIT 1)
  product       the product kernel's stream-K (checked against torch)
  full          this copy with the product's fix-up (checked: it must match ``product``'s figure)
  gpu-fence     the fix-up with a gpu-scope acquire and no proxy fence (timing only: unsafe for TMA reads)
  store         partials stored and counted, the owner neither waits nor adds them
  pieces        the pieces alone: nothing stored but the owner's own sum (the pipeline drains, the schedule)
  dp-only       the data-parallel waves alone (the stream-K tiles skipped): the floor of the schedule
  full-sigma    ``full`` with the streamed tiles in _sk_tile_order's order (concurrent tiles adjacent)
  pieces-sigma  ``pieces`` in that order
  full-tma      ``full`` with the partials stored by TMA (no layout conversion; completion waited for, then counted)
  full-tma-late ``full-tma`` counting the partial in only when the program reaches its run's last piece (the
                store's completion hidden behind the pieces between; every count still precedes every wait)
Output: JSONL rows and a table of time and its excess over ``dp-only`` per variant.
PREDICTION (session 18, before the run, s18d): full-tma 1-3 us under full (no layout conversion: the store's
share), full-tma-late another 1-3 us (the completion wait off the critical path): 1024x3072x8192 83 -> ~78 us,
6000x3072x5120 252 -> ~247.
PREDICTION (session 18, before the run, s18c): under two waves (no data-parallel wave) the sigma order brings
the pieces to within ~5 us of the ideal time (512x14336x2880: pieces 67 -> ~57 us; full-sigma under unsplit's
69), since the concurrent tiles then share their B panels; with a data-parallel wave before them, no change.
PREDICTION (session 18, before the run, s18b): pieces ~ +4-6 us over the ideal (two pipeline fills per run), store
+2-3 us more, the fix-up's waits and loads the rest; gpu-fence within 1 us of full.
MEASURED (one H200, Triton 3.6, 128x256 tiles; results/h200x1/s18/s18b, s18c):
* s18b, six shapes: with a data-parallel wave before them the pieces alone run at the ideal time
  (6000x3072x5120: dp-only 171.9 us for 3 waves, pieces +72.5 us for 1.27 waves); the partial stores add
  2.5-8.3 us (store - pieces), the fix-up 2.5-4.6 us more (full - store); gpu-fence = full within 1.4 us (the
  system-scope acquire is not the cost). Under two waves the pieces alone lose (512x14336x2880: 71.0 us, unsplit
  68.9, ideal ~57 with the launch).
* s18c, the sigma order under two waves (8 shapes x 2 tiles): where B panels are shared across concurrent tiles
  it is the L2 effect predicted -- 256x28672x5120 pieces 143.4 -> 125.8 us, full 157.3 -> 138.9 --, elsewhere
  within +-3 us (512x14336x2880 pieces 71.0 -> 68.3, full 82.6 -> 80.1: predicted ~57 / < 69, missed); no shape's
  full-sigma beats the best of unsplit / product. Not taken into the product kernel: under two waves the fix-up
  (store + wait + loads: 10-14 us there) and the pieces' pipeline fills, not the order, keep stream-K behind.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
import triton
import triton.language as tl

from dev.rows import Rows
from kosmos.core import device as dev
from kosmos.gemm.tiles import _grouped_tile, store_tile_tma, tile_matmul, tile_matmul_cyclic
from kosmos.core.planning import GROUP_M

# the variants whose output is the whole product (the others leave tile sums incomplete: timing only)
CHECKED = ("unsplit", "product", "full", "full-sigma", "full-tma", "full-tma-late")
VARIANT_CODES = {"full": 0, "gpu-fence": 1, "store": 2, "pieces": 3, "dp-only": 4, "full-sigma": 5,
                 "pieces-sigma": 6, "full-tma": 7, "full-tma-late": 8}


@triton.jit
def _sk_tile_order(u, k_steps, work, grid):
    """sigma: the streamed tiles in the order their runs reach them together -- the tiles holding a run's
    start (worked on at once by every program at the phase's beginning) first, by program, then the others:
    concurrent tiles then sit next to each other in the grouped order and share A / B panels in L2. A
    bijection when runs are at least a tile long (each tile holds at most one start); else the identity."""
    us = u * k_steps
    p_min = (us * grid + work - 1) // work              # the first run starting at or after the tile's start
    has_start = (p_min < grid) & ((p_min * work) // grid < us + k_steps)
    sigma = tl.where(has_start, p_min, grid + (u - p_min))
    return tl.where(work >= grid * k_steps, sigma, u)


@triton.jit
def _sk_matmul(a_desc, b_desc, c_desc, p_desc, M, N, K, part_ptr, cnt_ptr, err_ptr, timeout_ns,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
               VARIANT: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    if dev.INTERPRET:  # as the product kernel: the interpreter runs programs in order, owners last
        pid = grid - 1 - pid
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN)
    k_steps = tl.cdiv(K, BK)
    n_tiles = n_m * n_n
    dp_tiles = tl.maximum(n_tiles // grid - 1, 0) * grid
    t_out = pid - grid
    for t in tl.range(pid, dp_tiles, grid, flatten=True, num_stages=STAGES):
        tm, tn = _grouped_tile(t, n_m, n_n, GROUP_M)
        acc = tile_matmul(a_desc, b_desc, tm * BM, tn * BN, K, BM, BN, BK, False, dev.INTERPRET)
        t_out += grid
        om, on = _grouped_tile(t_out, n_m, n_n, GROUP_M)
        store_tile_tma(c_desc, acc, om * BM, on * BN, BM, BN)
    SIGMA: tl.constexpr = (VARIANT == 5) | (VARIANT == 6)
    FIXUP: tl.constexpr = (VARIANT <= 1) | (VARIANT == 5) | (VARIANT >= 7)
    STORE: tl.constexpr = FIXUP | (VARIANT == 2)
    TMA_STORE: tl.constexpr = VARIANT >= 7
    LATE: tl.constexpr = VARIANT == 8
    if VARIANT != 4:
        work = tl.cast(n_tiles - dp_tiles, tl.int64) * k_steps
        start = (pid * work) // grid
        end = ((pid + 1) * work) // grid
        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        pos = start
        pending = -1  # LATE: the tile whose partial this program stored and has not yet counted in
        while pos < end:
            u = pos // k_steps
            i0 = (pos - u * k_steps).to(tl.int32)
            i1 = tl.minimum(k_steps, end - u * k_steps).to(tl.int32)
            first = k_steps - i1
            if i1 - i0 == k_steps:
                first = ((pos - start) % k_steps).to(tl.int32)
            t = (dp_tiles + u).to(tl.int32)
            if SIGMA:
                tg = (dp_tiles + _sk_tile_order(u, k_steps, work, grid)).to(tl.int32)
            else:
                tg = t
            tm, tn = _grouped_tile(tg, n_m, n_n, GROUP_M)
            acc = tile_matmul_cyclic(a_desc, b_desc, tm * BM, tn * BN, first, i1 - i0, k_steps, BM, BN, BK, False,
                                     dev.INTERPRET)
            if i0 == 0:
                if LATE:
                    if pending >= 0:
                        _count_partial_in(cnt_ptr + pending)
                        pending = -1
                last = ((u * k_steps + k_steps) * grid + work - 1) // work - 1
                others = (last - pid).to(tl.int32)
                if (others > 0) & FIXUP:
                    dev.wait_geq(cnt_ptr + t, others, timeout_ns, err_ptr, 0, 0, 0, t, t, VARIANT == 1)
                    acc3 = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
                    lo, hi = tl.split(acc3)
                    for j in range(1, others + 1):
                        lo += p_desc.load([(pid + j) * BM, 0])
                    c_desc.store([tm * BM, tn * BN], lo.to(tl.bfloat16))
                    for j in range(1, others + 1):
                        hi += p_desc.load([(pid + j) * BM, BN // 2])
                    c_desc.store([tm * BM, tn * BN + BN // 2], hi.to(tl.bfloat16))
                    tl.store(cnt_ptr + t, 0)
                else:
                    store_tile_tma(c_desc, acc, tm * BM, tn * BN, BM, BN)
                    if VARIANT == 2:
                        tl.store(cnt_ptr + t, 0)
            elif STORE:
                if TMA_STORE:
                    acc3 = tl.permute(tl.reshape(acc, (BM, 2, BN // 2)), (0, 2, 1))
                    lo, hi = tl.split(acc3)
                    p_desc.store([pid * BM, 0], lo)
                    p_desc.store([pid * BM, BN // 2], hi)
                    if LATE:
                        pending = t
                    else:
                        _count_partial_in(cnt_ptr + t)
                else:
                    tl.store(part_ptr + tl.cast(pid, tl.int64) * (BM * BN) + (offs_m[:, None] * BN + offs_n[None, :]),
                             acc)
                    tl.debug_barrier()
                    tl.atomic_add(cnt_ptr + t, 1, sem="release", scope="gpu")
            pos = u * k_steps + i1
        if LATE:
            if pending >= 0:
                _count_partial_in(cnt_ptr + pending)


@triton.jit
def _count_partial_in(cnt_ptr):
    """After this program's TMA stores of a partial: wait for them to complete (not only to have read shared
    memory), order them before generic accesses, then count the partial in (release)."""
    if not dev.INTERPRET:
        tl.inline_asm_elementwise("cp.async.bulk.wait_group 0; fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")


def sk_matmul(a, b, cfg, programs, variant: str):
    from kosmos.core import runtime
    from kosmos.core.descriptors import tma_descriptor
    m, k = a.shape
    n = b.shape[1]
    tiles = triton.cdiv(m, cfg.BM) * triton.cdiv(n, cfg.BN)
    grid = min(programs, tiles)
    c = torch.empty((m, n), device=a.device, dtype=torch.bfloat16)
    parts = torch.empty((grid * cfg.BM, cfg.BN), device=a.device, dtype=torch.float32)
    counters = torch.zeros(tiles, dtype=torch.int32, device=a.device)
    ws = runtime.get_workspace(None, a.device)
    ws.ensure(0, 0)
    ad, bd = tma_descriptor(a, [cfg.BM, cfg.BK]), tma_descriptor(b, [cfg.BK, cfg.BN])
    cd, pd = tma_descriptor(c, [cfg.BM, cfg.BN // 2]), tma_descriptor(parts, [cfg.BM, cfg.BN // 2])

    def fn():
        if variant == "store":  # nobody consumes the counts: start every launch from zero as the product does
            counters.zero_()
        _sk_matmul[(grid,)](ad, bd, cd, pd, m, n, k, parts, counters, ws.errors, ws.timeout_ns(), BM=cfg.BM,
                            BN=cfg.BN, BK=cfg.BK, GROUP_M=GROUP_M, STAGES=cfg.num_stages,
                            VARIANT=VARIANT_CODES[variant], num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        return c
    return fn


DEFAULT_SHAPES = "8192x8192x4096,6000x3072x5120,3000x3072x7168,6000x1536x1024,512x14336x2880,2048x5120x4096"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--json", default=None)
    ap.add_argument("--max-seconds", type=float, default=150.0)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--variants", default=",".join(["unsplit", "product"] + list(VARIANT_CODES)),
                    help="which variants (comma-separated)")
    ap.add_argument("--tiles", default="128x256", help="BMxBN tiles to run each shape at (128x256: 8 warps, "
                    "3 stages; 128x128: 4 warps, 4 stages)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sk_probe: needs a CUDA GPU")
    import kosmos
    from kosmos.core import planning, runtime
    from kosmos_bench import timing
    from kosmos_bench.environment import environment
    from dev.flat_probe import check_and_time, product_w1
    torch.backends.cuda.matmul.allow_tf32 = False
    runtime.ensure_triton_allocator()
    dev_ = torch.device("cuda", torch.cuda.current_device())
    programs = runtime.num_sms(dev_)
    rows = Rows(args.json)
    rows.emit(environment(argv=["python", "-m", "dev.sk_probe"] + list(argv or []), bench="tp",
                          suite={"probe": "sk_probe", **vars(args)}))
    tile_cfgs = {"128x256": planning.TileConfig(128, 256, 64, 8, 3),
                 "128x128": planning.TileConfig(128, 128, 64, 4, 4)}
    t_end = time.monotonic() + args.max_seconds
    table = []
    for shape, tile in [(s, t) for s in args.shapes.split(",") if s.strip() for t in args.tiles.split(",")]:
        cfg = tile_cfgs[tile]
        m, n, k = (int(p) for p in shape.split("x"))
        if time.monotonic() > t_end:
            print(f"stopped at {shape}: --max-seconds", flush=True)
            break
        g = torch.Generator(device=dev_).manual_seed(m * 7 + n * 13 + k)
        a = torch.randn(m, k, device=dev_, generator=g).to(torch.bfloat16)
        b = torch.randn(k, n, device=dev_, generator=g).to(torch.bfloat16)
        ref = a.float() @ b.float()
        t_gemm = timing.time_op(lambda: a @ b, iters=args.iters, warmup=args.warmup)["time_ms"]
        wanted = args.variants.split(",")
        variants = {"unsplit": product_w1(a, b, cfg, 1, programs),
                    "product": product_w1(a, b, cfg, 1, programs, stream_k=True)}
        variants.update({v: sk_matmul(a, b, cfg, programs, v) for v in VARIANT_CODES})
        variants = {v: fn for v, fn in variants.items() if v in wanted}
        times = {}
        for name, fn in variants.items():
            row = {"type": "result", "m": m, "n": n, "k": k, "tile": tile, "variant": name, "t_gemm_ms": t_gemm}
            check_and_time(fn, ref, t_gemm, row, args.iters, args.warmup, check=name in CHECKED)
            if row["status"] == "ok":
                times[name] = row["time_ms"] * 1e3
            rows.emit(row)
            print(f"{shape} {tile} {name:<12} {row['status']:<6} {times.get(name, float('nan')):8.1f} us "
                  f"(cuBLAS {t_gemm * 1e3:.1f}) {row.get('reason', '')}", flush=True)
        table.append((f"{shape} {tile}", times))
        del a, b, ref
    kosmos.check_errors()
    names = [v for v in ["unsplit", "product"] + list(VARIANT_CODES) if v in args.variants.split(",")]
    print(f"\n{'shape':<25}" + "".join(f"{v:>13}" for v in names) + "   (us; excess over dp-only below)")
    for shape, times in table:
        print(f"{shape:<25}" + "".join(f"{times.get(v, math.nan):13.1f}" for v in names))
        base = times.get("dp-only", math.nan)
        print(f"{'':<25}" + "".join(f"{times.get(v, math.nan) - base:13.1f}" for v in names))
    rows.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
