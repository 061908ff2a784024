"""Host-side planners: tile shapes and the demand-ordered task tables of each fused op.

A task table is an int32 ``[n, 4]`` tensor; a launch claims its rows in order with one atomic head. The
order is the whole scheduling policy's input: the kernel never reorders, it only decides *which queue* to
take from next.

AllGather+GEMM (rank r, world W, shard rows Ms = M/W, chunks of BM rows):
  comm table     rows (PUSH, peer, chunk, 1) for peers r+1, r+2, ... (staggered, so no two ranks push to the
                 same peer at once), chunks ascending -- the order in which that peer consumes them; then
                 (COPY, r, chunk, 1): this rank's own rows into its slot of the gathered buffer (only needed
                 for the returned ``a_full``, so last; the self policy runs them after the compute tiles,
                 see the kernel's docstring). With p chunks per task (developer knob) a row is (kind, peer, i,
                 count): chunks i, i + stride, ... with stride = ceil(chunks / p).
  compute table  rows (slot, m_tile, n_tile, 0): own slot first (ready at once), then slots r-1, r-2, ...
                 in the order their pushes arrive; inside a slot, GROUP_M m-tiles share each n-tile (L2).

GEMM+ReduceScatter (rank r): the output rows of owner p are rows [p*Ms, (p+1)*Ms) of A @ B.
  compute table  rows (owner, m_tile, n_tile, 0): tile i of every owner before tile i+1, owners staggered
                 r+1, r+2, ..., r, so each owner receives tile i from all ranks at about the same time.
  reduce table   rows (m_tile, n_tile, 0, 0) of this rank's own tiles, in the same tile order: reduce tile i
                 becomes ready once every rank has produced its partial of tile i.

Measured (dated) -- the GEMM core both TP ops share: the tile rule (tile_config) and the TMA mainloop
(kernels/common.tile_matmul); detail: docs/archive/session-diary-1-6.md, the session named:
  Rule 128x256x64, 3 stages, 8 warps, one program per SM. Its original "86-102% of cuBLAS" predates the diary
  (DESIGN.md, not in this checkout). W=1 kosmos / cuBLAS TFLOP/s since, on one GPU of the 2x H200 machine:
  v0.1 (6ccc827) 0.88-1.01, v0.2 (c47c5e6, seq 8k/16k) 0.92-1.05, geomean 0.99; on 1x H200 at 909b6c9
  (session 6, Triton 3.6), against torch.matmul alone (t_gemm_ms / time_ms): llama3-70b TP=2 per-rank GEMMs
  0.903-1.025 (geomean 0.979; 11 of 12 at >= 0.95, qkv-16k 0.903), TP=1 0.967-1.019 (0.993), llama3-8b
  per-rank 0.919-0.982 (short-K attn_out lowest). (Session 6 stated 0.952-1.046, geomean 1.005, against the
  nccl+cublas row, which at W=1 still copies for the all-gather; the AG rows' cuBLAS time multiplied an uninitialised buffer (fixed in session 7, 1e83152; not re-measured).)
  Inside a tile it is at full rate (attn_out-70b-4k: 43.6 us per tile, 811 TFLOP/s against cuBLAS's 790 for
  the shape; llama3-8b attn_out 4k: 23.8 us per 128x256x2048 tile, 745 TFLOP/s over 132 SMs). The loss is at
  the edges: the gap between two tiles (0.99 us session 4, 0.83 us session 5, 0.9% of program time after
  3667b58), the last partial wave (3.1% at attn_out-70b-4k, 7.76 tiles per program: half or quarter tiles round
  up the same way, only a stream-K split of K would help), and ~9 us of launch, prologue and exit per call
  (one-tile call 9.4 us with host descriptors, 82006a1; torch.matmul 4.8, an empty launch 2.9).
  cuBLAS moved 2-3% between machines of one kind, and ~6% run to run at fc1-16k (ratio 1.063 vs 0.999):
  compare ratios inside one run.
Tried and parked (W=1, 1x H200, session 4, the 12 llama3-70b TP=2 per-rank GEMMs, geomean time vs default):
  4 stages (192 KiB shared memory, no spills; predicted 2-4% faster at long K): 1.000, knob removed.
  Warp-specialised K loop (tl.range(..., warp_specialize=True)): 1.002, removed.
  One full-width [128, 256] epilogue store instead of two halves: 0.999, removed.
  Claim-ahead of the next tile (session 6): 1.012 over the 24 per-rank GEMMs (the ops' records). No error-flag
  atomic between tasks (86d5acd, session 5): 1.001, kept as simpler.
  128x128 / 256x128 tiles for few-wave shapes (proposed at v0.1) and a pointer-load mainloop: not measured in
  sessions 1-6.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from .config import AllGatherMatmulConfig, MoEForwardConfig, check_config

PUSH, COPY = 0, 1
GROUP_M = 8


@dataclass(frozen=True)
class TileConfig:
    BM: int
    BN: int
    BK: int
    num_warps: int
    num_stages: int


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2_at_least(x: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << max(0, math.ceil(math.log2(max(1, x))))))


# The tile candidates of tile_config, largest first: (BM, BN, num_warps, num_stages, throughput). Throughput is
# each tile's TFLOP/s relative to 128x256 when the grid has many waves of tiles: the geomean over the 20
# GEMMs of suites/tp-grid.yaml with >= 5 waves of 128x256 tiles, both TP ops at W=1, in the session-10 tile
# probe on one H200 (results/h200x1/s10/b/tile-probe.jsonl, Triton 3.6): against cuBLAS 128x256 0.93x,
# 128x128 (one warpgroup, 4 stages) 0.84x, 64x128 0.53x, 64x64 0.40x; relative 1, 0.896, 0.566, 0.426.
TILE_CANDIDATES = (
    (128, 256, 8, 3, 1.00),
    (128, 128, 4, 4, 0.90),
    (64, 128, 4, 4, 0.57),
    (64, 64, 4, 6, 0.43),
)


def tile_config(rows: int, n: int, k: int, *, world: int = 1, programs: int = 132,
                mx: bool = False) -> TileConfig:
    """The one tile rule (no autotuning, no per-shape table): the candidate of TILE_CANDIDATES whose grid of
    tiles finishes first on ``programs`` persistent programs, by a wave model.

    Each rank computes the whole [rows * world, n] output in tiles (AG: the gathered rows; RS: all rows before
    the reduction), so a candidate (BM, BN) makes T = ceil(rows*world / BM) * ceil(n / BN) tiles, run in
    ceil(T / programs) waves; one tile of it takes (BM*BN)/(128*256) / throughput of a 128x256 tile's time. The
    predicted time is the product; the smallest wins, a larger tile on a tie within 1%. What it does: shapes
    with many waves keep 128x256x64 (8 warps, 3 stages: 86-102% of cuBLAS on H200 with TMA); a grid under half
    a wave takes smaller tiles until it fills the SMs (256x1536x1024: 12 tiles of 128x256 -> 96 of 64x64); a
    wave count just over an integer (192 tiles = 1.45 waves) takes 128x128 (384 tiles, 2.9 waves, less idle
    tail). K does not enter: the probe found no K where another BK won (128x256x128 lost everywhere, 0.70x of
    the rule).

    Measured (session 10, one H200, W=1, both TP ops, the 48 GEMMs of suites/tp-grid.yaml, t_gemm/time):
    the rule picks the fastest of the probe's 8 candidates on 91 of the 96 (shape, op) points and is within
    1.2% of it on the other 5 (the 8-warp 128x128 or a 64x256 tile won there by a hair); predicted geomean
    0.875x (RS) / 0.869x (AG) of cuBLAS against 0.825x / 0.819x for 128x256 everywhere; worst shape
    512x1536x7168 0.35x -> 0.59x. That was in-sample (the throughputs come from the same probe); the grid
    bench with the rule (results/h200x1/history/s10-tp-grid-w1-3922e32.*, same session) measured 0.865x (AG) / 0.871x
    (RS) geomean, worst 0.588x / 0.589x at 512x1536x7168, 24 / 25 of 48 shapes under 0.90x (issue 13's bar:
    0.97x, none under 0.90x); the llama3-70b TP=2 per-rank GEMMs keep 128x256 (0.985x of cuBLAS, min 0.949).
    Left for split-K / stream-K: shapes under a wave even in 64x64 tiles, and
    the per-tile overhead that holds short-K shapes (K = 1024: 0.84-0.90x) below cuBLAS.
    Tried and lost (session 11, branch ``split-k``, ca6252c, not merged): split-K at W=1 for both ops, S tasks
    per output tile with fp32 partials summed in order by the last split, chosen by this wave model extended to
    split tasks (it split 3 grid shapes). Measured on one H200 against this rule (results/h200x1/s11/a):
    512x1536x7168 0.584 -> 0.659x of cuBLAS (predicted ~1.15x), 256x4096x4096 0.714 -> 0.768x (predicted
    ~1.15x), 512x5120x5120 0.712 -> 0.553x (predicted ~0.84x); the other 93 points unchanged (1.001). The model's
    per-SM rate for a split tile is wrong by ~2x: these few-tile shapes are held by something a K split does not
    remove (the per-tile fixed cost, the last split's serial sum, or both -- not yet traced).

    The static W=1 GEMM (session 16; kernels/common.w1_matmul_kernel, what a bf16 untraced W=1 call of either
    TP op launches): at W=1 nothing waits, so the self-scheduled loop's claim, task table and exit protocol buy
    nothing, and its dynamic loop drains the K pipeline at every tile. dev/flat_probe (one H200, Triton 3.6,
    20 grid shapes, results/h200x1/s16/d): against cuBLAS alone, today's op 0.806 geomean; a static order with
    the same tiles 0.852 (the claim / exit cost: 256x1536x1024 0.719 -> 0.881); that order with the tile x K
    loop flattened (tl.range(..., flatten=True): the next tile's loads during this tile's epilogue) 0.873 --
    short K gains most (6000x1536x1024 0.768 -> 0.880, 8192x6144x1024 0.897 -> 0.965); 128x256 or 128x128
    everywhere instead of the rule 0.753 / 0.770. PREDICTED before the run: +5-15% at K = 1024, ~0 on the
    few-tile long-K shapes, geomean 0.87 -> ~0.89 on the grid. MEASURED on the whole grid (suites/tp-grid.yaml,
    results/h200x1/tp-grid-w1.*, f986b19): ag_gemm 0.865 -> 0.923, gemm_rs 0.871 -> 0.924 geomean (1.062-1.067x the
    session-10 run, no shape slower by > 1%), worst 0.621 / 0.625 at 512x1536x7168, 14 / 14 of 48 under 0.90.
    Left: the few-tile long-K shapes (512x1536x7168, 512x5120x5120, 256x4096x4096: 0.62-0.78x), where a K
    split would have to keep its partial sums' reduction off one program (session 11's split-K lost that way).
    ``mx``: the MXFP8 paths keep 128x256 (their DEQ plan was measured only with it; the small tiles are not
    yet compiled or timed there). The rows <= 64 case falls out of the model (a 128-row tile costs its full
    time however few rows it holds). At W > 1 the same rule applies and the communication chunks are BM rows.
    Tiny tiles under the CPU interpreter."""
    if interpreting():
        return TileConfig(16, _pow2_at_least(n, 16, 32), 16, 4, 1)
    bn_cap = _pow2_at_least(n, 64, 256)
    if mx:
        return TileConfig(128 if rows > 64 else 64, bn_cap, 64, 8, 3)
    m_total = rows * max(1, world)
    best = None
    for bm, bn, warps, stages, throughput in TILE_CANDIDATES:
        bn = min(bn, bn_cap)
        tiles = -(-m_total // bm) * -(-n // bn)
        cost = -(-tiles // max(1, programs)) * (bm * bn) / (128 * 256) / throughput
        if best is None or cost < best[0] * 0.99:
            best = (cost, TileConfig(bm, bn, 64, warps, stages))
    return best[1]


# The K split of the static W=1 GEMM (w1_plan): 128x128 tiles (one warpgroup, 4 stages), 2 parts.
SPLIT_TILE = TileConfig(128, 128, 64, 4, 4)
SPLIT_PARTS = 2
SPLIT_MIN_STEPS = 64  # K steps (of 64) a tile must have for its split to pay for the partials' round trip
# Stream-K (w1_plan): its cost over the even share of K steps, in K steps of a 128x256 tile (~0.68 us each):
# fitted to session 18's probe (s18a: 15-20 us over the ideal time on every shape, ~16 us over the unsplit
# kernel's own fixed cost)
STREAM_K_OVERHEAD_STEPS = 26
STREAM_K_MIN_GAIN = 1.02
STREAM_K_TILES = (TileConfig(128, 256, 64, 8, 3), TileConfig(128, 128, 64, 4, 4))
# Short K (w1_plan): two programs per SM of 128x128 tiles, one warpgroup, 3 stages (112 KiB of shared memory
# each, two fit an SM), where a tile is at most SHORT_K_STEPS K steps, the 128x128 tiles fill the SMs once and
# 128x256 tiles make at most SHORT_K_MAX_WAVES waves (session 18, s18e: the many-wave ones lost)
SHORT_K_TILE = TileConfig(128, 128, 64, 4, 3)
SHORT_K_STEPS = 16
SHORT_K_MAX_WAVES = 16
# Tail tiles (w1_plan): 128 rows x (128 + tail) columns, two accumulators (kernels/common.tile_matmul_tail),
# 8 warps, 4 stages, the tile loop not flattened. (tail, throughput relative to 128x256 on many waves, as
# TILE_CANDIDATES' column): session 19, dev/tail_probe (results/h200x1/s19/s19c): 128x192 0.860 / 0.981 of
# cuBLAS at 8192x6144x4096 (0.88); 128x160 0.48-0.76x of cuBLAS wherever timed: not a candidate
# (w1_plan's docstring has the figures: the product's loop had to take dev/tail_probe's load order first.)
TAIL_TILE = TileConfig(128, 128, 64, 8, 4)
TAIL_TILES: tuple = ((64, 0.88),)
TAIL_MIN_GAIN = 1.03  # a tail tile only where the wave model predicts it this much faster than the other plans


@dataclass(frozen=True)
class W1Plan:
    """How the static W=1 GEMM runs a shape: its tile, a K split in ``split`` parts or stream-K, and its
    programs per SM (``per_sm`` x the SMs in the grid: two co-resident programs, each one's epilogue under the
    other's mainloop); ``tail``: tiles tile.BN + tail columns wide, unsplit (a 64- or 32-column second
    accumulator: kernels/common.tile_matmul_tail)."""
    tile: TileConfig
    split: int = 1
    stream_k: bool = False
    per_sm: int = 1
    tail: int = 0

    @property
    def width(self) -> int:
        """Columns per tile."""
        return self.tile.BN + self.tail


def w1_plan(rows: int, n: int, k: int, *, programs: int = 132) -> W1Plan:
    """(tile, K split, stream-K) of the static W=1 GEMM (kernels/common.w1_matmul_kernel) for C [rows, n] = A @ B:
    tile_config's tile unsplit, except where even 128x128 tiles fill at most half the SMs and K is long
    (>= SPLIT_MIN_STEPS steps of 64): there each 128x128 tile's K steps are cut in two halves, two programs
    per tile, and their fp32 partials summed by both (one round: at most ``programs`` programs); stream-K
    where a badly filled last wave follows at least one full one (below); and at short K (<= SHORT_K_STEPS
    steps) two programs per SM of 128x128 tiles (SHORT_K_TILE), where those tiles fill the SMs once and 128x256
    tiles make at most SHORT_K_MAX_WAVES waves.

    Short K (session 18, one H200, Triton 3.6, dev/flat_probe --occupancy, results/h200x1/s18/s18e; in-sample:
    the rule was drawn from these 15 shapes): at K = 1024 a tile is 16 K steps and its epilogue and pipeline
    fill (~1-2 us) are ~10% of it; two co-resident programs put one's epilogue under the other's mainloop:
    against w1-unsplit 3000x5120x1024 0.923 -> 0.949, 1024x8192x1024 0.956 -> 0.987, 512x6912x1024 0.976 ->
    1.017, 6000x1536x1024 0.872 -> 0.882, 4096x14336x1024 0.951 -> 0.960, 8192x6144x1024 0.959 -> 0.960;
    lost at 16384x28672x1024 (0.980 -> 0.968: many waves, 128x256's rate) and 256x1536x1024 (0.840 -> 0.576:
    24 tiles), and at every K >= 2048 shape timed (4096x1536x4096 0.897 -> 0.753, 512x3072x2048 0.814 ->
    0.675). 8 warps per 128x128 program lost to 4 everywhere (0.817 geomean against 0.843); the flattened loop
    warp-specialised (tl.range(..., warp_specialize=True)) compiled and lost or tied (0.812 / 0.794 at
    128x256 / 128x128 against 0.897).

    Measured (session 17, one H200, Triton 3.6, dev/flat_probe --splits on its 20 grid shapes; results/h200x1/
    s17/s17b): a split task costs ~12-20 us more than its share of the tile's K steps -- the fp32 partial
    stored and read back, the group's wait, the sum's store -- so only the few-tile long-K shapes gain:
    512x1536x7168 0.620 -> 0.792x of cuBLAS (128x128, 2 parts; 128x256 in 4 / 5 parts 0.753 / 0.776, in 6
    parts two rounds 0.493), 256x4096x4096 0.786 -> 0.813. Every shape with more tiles lost to its unsplit
    tile: 512x5120x5120 0.747 -> <= 0.648, 1024x3072x8192 0.793 -> <= 0.677, 256x6144x8192 0.859 -> <= 0.820,
    2048x1536x5120 0.797 -> <= 0.606, 3000x3072x7168 0.827 -> <= 0.713 (split rounds pay the cost per round).
    The first rule of that session (tile_config's wave model extended to splits, 8 steps of overhead per part)
    split 5 grid shapes and made the grid's geomean 0.923 -> 0.916: the model's overhead was ~3x too small.

    Stream-K (kernels/common.w1_matmul_kernel's STREAM_K): data-parallel waves, then the last wave and a half
    of tiles in ``programs`` equal runs of K steps, so no SM idles in a last partial wave. Taken where at least
    one data-parallel wave runs (T >= 2 * programs) and tile_config's wave model -- a stream-K schedule costing
    T / programs tiles plus STREAM_K_OVERHEAD_STEPS K steps of a 128x256 tile -- predicts a gain of at least
    STREAM_K_MIN_GAIN over the unsplit rule (128x256 or 128x128, whichever it predicts faster).
    Session 17's first form (every tile streamed, pieces reading K in position order; b3e3bc9,
    results/h200x1/s17/s17d) was correct but slow: flat_probe geomean 0.61 against 0.87 unsplit, the grid
    0.84, worst 0.495 at 6000x5120x14336 -- its runs' clocks sat at K offsets spread over the whole K range,
    so the SMs read distinct K slices and nothing was reused in L2 (the kernel's docstring).
    Session 18 (fa506da: the pieces in step, data-parallel waves first; one H200, Triton 3.6; results/h200x1/
    s18/s18a, flat_probe --splits on 18 shapes, t_gemm / time): sk-128x256 against the unsplit rule
    3000x3072x7168 0.821 -> 0.937, 2048x6912x8192 0.888 -> 0.981, 6000x5120x14336 0.913 -> 0.992,
    6000x3072x5120 0.916 -> 0.995, 3000x6144x5120 0.914 -> 0.965, 4096x6912x7168 0.972 -> 0.996; but
    every shape under two waves lost or tied (512x14336x2880 0.958 -> 0.801, 256x28672x5120 0.960 -> 0.769,
    4096x1536x4096 0.899 -> 0.834, 2048x1536x5120 0.798 -> 0.779; 1024x3072x8192 gained, 0.794 -> 0.830) and
    so did K = 1024 (6000x1536x1024 0.864 -> 0.713). dev/sk_probe (s18b) took the stream-K phase apart:
    its pieces alone run at the ideal time where a data-parallel wave precedes them (6000x3072x5120: +72.5 us
    for 1.27 waves of 57 us), the partial stores add 3-8 us and the fix-up (wait, TMA loads, adds) 2.5-4.6 us;
    under two waves the pieces alone lose (512x14336x2880: 67 us for an ideal 53, before any partial).
    Hence the fitted overhead (26 K steps, ~18 us with the kernel's fixed cost) and the data-parallel wave
    required. The grid with this rule (2f697f5, results/h200x1/s18/s18b): ag_gemm 0.927 -> 0.942,
    gemm_rs 0.928 -> 0.941 geomean, 13 -> 10 of 48 under 0.90, worst 0.749 / 0.743 at 512x5120x5120; with the
    short-K rule too (2a1a472, results/h200x1/history/s18-tp-grid-w1-2a1a472.*): 0.941 / 0.942, 11 / 12 under 0.90 (the
    two-per-SM points +0.3-3.8%, the rest -0.3% run to run: two shapes at ~0.90 fell under it). The llama3
    per-rank suite (results/h200x1/tp-bf16-w1-shard2.*, 2a1a472; four of its shapes streamed): 0.998 / 1.001
    geomean of cuBLAS, min 0.981 / 0.980 (session 17: 0.994 / 0.998, min 0.976).
    Tail tiles (session 19; kernels/common.tile_matmul_tail, TAIL_TILE / TAIL_TILES): Triton's blocks are powers
    of two, so a tile 128 + 64 = 192 columns wide is two accumulators (two MMAs per K step on one A tile, B's
    last 64 columns through a second descriptor). Its point is the wave count: 1024x3072x8192 makes 96 tiles of
    128x256 on 132 SMs (0.73 of a wave, 36 SMs idle) but 128 of 128x192. Taken where tile_config's wave model,
    at 0.88 of 128x256's rate, predicts it TAIL_MIN_GAIN faster than every other plan (the grid: 512x5120x5120,
    1024x3072x8192, 2048x1536x5120; no llama3 per-rank shape). Measured (one H200, Triton 3.6, results/h200x1/
    s19): flattened like the other schedules it ran at 0.53-0.66x of cuBLAS everywhere (s19a, flat_probe
    --tails); as a plain tile loop 0.86-0.89x (dev/tail_probe's copy, s19c; 0.88 of 128x256's rate at
    8192x6144x4096, hence the 0.88), but in the product only 0.71-0.75x (s19d / s19e: the grid 0.941 -> 0.936)
    until its loop took the probe's load order -- B2's load after the first MMA, so B2 gets a barrier of its
    own instead of one barrier for A, B and B2 -- then the same as the probe (s19f: 0.896 / 0.869 / 0.863 against
    the probe's 0.894 / 0.871 / 0.864). 128 + 32 = 160 columns: 0.33-0.76x wherever timed, and 128 x (64 + 32)
    0.29-0.34x: not candidates. The grid with the tail tiles (488c5f1, results/h200x1/tp-grid-w1.*, s19g):
    512x5120x5120 0.750 / 0.753 -> 0.861 / 0.854 (AG / RS), 1024x3072x8192 0.791 / 0.785 -> 0.883 / 0.894,
    2048x1536x5120 0.799 / 0.805 -> 0.905 / 0.921 (predicted ~0.83 / ~0.88 / ~0.89); the other 45 shapes 1.000x
    the s18 run; geomean 0.941 / 0.942 -> 0.948 / 0.949, worst 0.787 / 0.797 at 512x1536x7168, 10 / 11 under 0.90
    (bar: 0.97, none under 0.90 -- missed).
    Left: the shapes under two waves (every shape now under 0.90 is one, or K = 1024). A run order whose
    concurrent tiles share panels (dev/sk_probe's sigma, s18c) fixes their L2 reuse (256x28672x5120: 157 ->
    139 us) but beats unsplit nowhere; what keeps them behind is the fix-up (10-14 us: the partial store
    through a layout conversion, the wait, the TMA loads) and the unflattened pieces' pipeline fills.
    What cuBLAS runs there (session 20, dev/cublas_names, torch 2.11 on one H200, results/h200x1/s20): nvjet
    kernels that cut every few-tile grid shape into exactly 128 or 256 tiles (one or two waves on 132 SMs) with
    widths between Triton's powers of two, in 2-CTA clusters (TMA multicast: one operand's tile loaded once for two
    SMs, half its L2 -> SM traffic), and never split K: 64x96 tiles at 512x1536x7168, 128x96 at 256x6144x8192 and
    512x3072x2048, 64x128 at 256x4096x4096, 64x320 at 512x5120x5120, 128x128 at 256x8192x2048, 128x192 at
    1024x3072x8192 / 2048x1536x5120 / 4096x1536x4096, 192x192 at 6000x1536x1024 (names give N x M: cuBLAS is
    column-major). Our tail tiles at the same tile counts, plain loop, session 19's load order (dev/flat_probe
    --odd, s20b, 11 shapes): 128 x (64 + 32) 0.649 geomean of cuBLAS, 64 x (128 + 64) 0.683, 64 x (256 + 64)
    0.557, 64x256 0.740, against this rule's 0.858 -- every one lost on every shape except 64x256 at
    4096x1536x4096 (0.913 vs 0.903, within the spread); where our tiling already equals cuBLAS's (1024x3072x8192,
    2048x1536x5120, 256x8192x2048) we run 0.88-0.91x. So the gap under two waves is per-tile speed at equal
    tile counts -- what the clusters' multicast buys -- not the tiling. Triton 3.6's tl language has no cluster
    launch nor multicast TMA on sm_90; its Gluon dialect gained TMA multicast upstream (triton-lang/triton#9005,
    2025-12; in 3.9's gluon/nvidia/hopper/tma.py, not in 3.6.0's): a multicast mainloop for the few-tile shapes
    is the next candidate once the GPU machine's Triton has it, not more tile shapes."""
    cfg = tile_config(rows, n, k, world=1, programs=programs)
    steps = -(-k // 64)
    if interpreting() or programs < 2:
        return W1Plan(cfg)
    split_tiles = -(-rows // SPLIT_TILE.BM) * -(-n // SPLIT_TILE.BN)
    if steps >= SPLIT_MIN_STEPS and split_tiles * SPLIT_PARTS <= programs:
        return W1Plan(SPLIT_TILE, SPLIT_PARTS)
    wide_tiles = -(-rows // 128) * -(-n // 256)
    if steps <= SHORT_K_STEPS and split_tiles >= programs and wide_tiles <= SHORT_K_MAX_WAVES * programs:
        return W1Plan(SHORT_K_TILE, per_sm=2)
    unsplit = _w1_cost(rows, n, k, cfg, programs, False)
    best = (unsplit, W1Plan(cfg))
    streamed = []
    for tile in STREAM_K_TILES:
        tile = TileConfig(tile.BM, min(tile.BN, _pow2_at_least(n, 64, 256)), tile.BK, tile.num_warps,
                          tile.num_stages)
        cost = _w1_cost(rows, n, k, tile, programs, True)
        if cost is not None:
            streamed.append((cost, tile))
    if streamed:
        cost, tile = min(streamed, key=lambda c: c[0])
        if cost * STREAM_K_MIN_GAIN < unsplit:
            best = (cost, W1Plan(tile, stream_k=True))
    if n > 256 and TAIL_TILES:  # a tail tile: 192 columns, where its waves fill the SMs better
        cost, tail = min((_w1_tail_cost(rows, n, tail, thr, programs), tail) for tail, thr in TAIL_TILES)
        if cost * TAIL_MIN_GAIN < best[0]:
            best = (cost, W1Plan(TAIL_TILE, tail=tail))
    return best[1]


def _w1_tail_cost(rows: int, n: int, tail: int, throughput: float, programs: int) -> float:
    """_w1_cost of a tail tile (TAIL_TILE.BN + tail columns) unsplit, in 128x256-tile times."""
    width = TAIL_TILE.BN + tail
    tiles = -(-rows // TAIL_TILE.BM) * -(-n // width)
    return -(-tiles // programs) * (TAIL_TILE.BM * width) / (128 * 256) / throughput


def _w1_cost(rows: int, n: int, k: int, tile: TileConfig, programs: int, stream_k: bool):
    """tile_config's wave model for one schedule of the static W=1 GEMM, in 128x256-tile times: unsplit,
    ceil(T / programs) waves of tiles; stream-K (only where T >= 2 * programs: at least one data-parallel wave),
    T / programs tiles' time plus STREAM_K_OVERHEAD_STEPS K steps of a 128x256 tile."""
    cap = _pow2_at_least(n, 64, 256)  # tile_config's cap on BN: a candidate's tile as it picks it
    throughput = next(thr for bm, bn, _, _, thr in TILE_CANDIDATES if bm == tile.BM and min(bn, cap) == tile.BN)
    tiles = -(-rows // tile.BM) * -(-n // tile.BN)
    per_tile = (tile.BM * tile.BN) / (128 * 256) / throughput
    if not stream_k:
        return -(-tiles // programs) * per_tile
    if tiles < 2 * programs or tiles % programs == 0:
        return None
    return tiles / programs * per_tile + STREAM_K_OVERHEAD_STEPS / -(-k // 64)


def _grouped(m_tiles: int, n_tiles: int):
    """(m, n) pairs of a grid in GROUP_M-grouped order."""
    order = []
    for m0 in range(0, m_tiles, GROUP_M):
        group = range(m0, min(m0 + GROUP_M, m_tiles))
        for n in range(n_tiles):
            for m in group:
                order.append((m, n))
    return order


def _table(rows, device) -> torch.Tensor:
    t = torch.tensor(rows if rows else [[0, 0, 0, 0]], dtype=torch.int32)
    if not rows:
        t = t[:0]
    return t.to(device)


AG_TARGET_PUSHERS = 16  # push_chunks="auto": about this many push tasks per rank (all peers)


def ag_comm_config(world: int, ms: int, bm: int, config=None) -> tuple[int, int]:
    """(chunks per comm task, elements per copy step) of AllGather+GEMM for a shard of ``ms`` rows in chunks of
    ``bm``, from ``config`` (a ``kosmos.AllGatherMatmulConfig``; None = defaults 1 and 16384). One program
    copies 2.5x faster with 16384 bf16 in flight per step than with 4096 (one H200, `dev.copy_probe`), and the
    kernel stays spill-free (Triton 3.6, sm_90: 181 registers; `dev.kernel_resources`). push_chunks="auto":
    about AG_TARGET_PUSHERS push tasks in all, however long the shard (fewer, larger comm tasks would take the
    same NVLink bandwidth from fewer SMs; its two-GPU A/B is still to run)."""
    config = check_config(AllGatherMatmulConfig, config)  # an isinstance check; None: the default instance
    if config.push_chunks == "auto":
        chunks = math.ceil(ms / bm) * max(1, world - 1)
        per_task = max(1, math.ceil(chunks / AG_TARGET_PUSHERS))
    else:
        per_task = config.push_chunks
    return per_task, config.copy_block


def ag_comm_stride(ms: int, bm: int, per_task: int) -> int:
    """Comm tasks per destination; task i moves chunks i, i + stride, i + 2*stride, ... (so the first chunks
    of every task land first: the peer consumes chunks in ascending order)."""
    return math.ceil(math.ceil(ms / bm) / per_task)


def ag_push_tasks(world: int, ms: int, bm: int, per_task: int) -> int:
    """Number of PUSH rows at the front of the comm table (the COPY rows follow)."""
    return (world - 1) * ag_comm_stride(ms, bm, per_task)


@lru_cache(maxsize=256)
def _ag_rows(rank: int, world: int, ms: int, n: int, bm: int, bn: int, per_task: int = 1):
    chunks = math.ceil(ms / bm)
    stride = ag_comm_stride(ms, bm, per_task)
    groups = [(i, len(range(i, chunks, stride))) for i in range(stride)]
    comm = [(PUSH, (rank + d) % world, i, cnt) for d in range(1, world) for i, cnt in groups]
    if world > 1:
        comm += [(COPY, rank, i, cnt) for i, cnt in groups]
    tiles = _grouped(chunks, math.ceil(n / bn))
    compute = [((rank - d) % world, m, nt, 0) for d in range(world) for (m, nt) in tiles]
    return tuple(comm), tuple(compute)


def plan_all_gather_matmul(rank: int, world: int, ms: int, n: int, cfg: TileConfig, device, per_task: int = 1):
    """Returns (comm_table, compute_table, flag_slots) for one rank; flags are (src, chunk). A comm row is
    (PUSH or COPY, peer, first chunk, chunks): ``per_task`` chunks per task, strided by ``ag_comm_stride``."""
    comm, compute = _ag_rows(rank, world, ms, n, cfg.BM, cfg.BN, per_task)
    flag_slots = world * math.ceil(ms / cfg.BM)
    return _table(list(comm), device), _table(list(compute), device), flag_slots


@lru_cache(maxsize=256)
def _rs_rows(rank: int, world: int, ms: int, n: int, bm: int, bn: int):
    tiles = _grouped(math.ceil(ms / bm), math.ceil(n / bn))
    compute = [((rank + d) % world, m, nt, 0) for (m, nt) in tiles for d in range(1, world + 1)]
    reduce_ = [(m, nt, 0, 0) for (m, nt) in tiles] if world > 1 else []
    return tuple(compute), tuple(reduce_)


def plan_matmul_reduce_scatter(rank: int, world: int, ms: int, n: int, cfg: TileConfig, device):
    """Returns (compute_table, reduce_table, flag_slots) for one rank; flags are (src, tile-of-owner)."""
    compute, reduce_ = _rs_rows(rank, world, ms, n, cfg.BM, cfg.BN)
    tiles_per_owner = math.ceil(ms / cfg.BM) * math.ceil(n / cfg.BN)
    return _table(list(compute), device), _table(list(reduce_), device), world * tiles_per_owner


_DEVICE_TABLES: dict = {}


def cached_tables(key, build):
    """Keep device copies of task tables so that steady-state calls allocate and copy nothing (and a CUDA-graph
    capture finds them: building one is a host-to-device copy, refused while capturing)."""
    t = _DEVICE_TABLES.get(key)
    if t is None:
        from .runtime import capture_refusal
        capture_refusal(f"its task tables for {key[0]} at this shape are not built yet")
        t = build()
        _DEVICE_TABLES[key] = t
    return t


# ----------------------------------------------------------------------------------------------- MXFP8
@dataclass(frozen=True)
class DequantPlan:
    """MXFP8 dequantize-on-arrival tasks of a TP op: each DEQ task expands ROWS rows of one BM-row chunk
    (PARTS = BM / ROWS tasks per chunk, one flag each), NB MX blocks (32 elements) per step of its row loop."""
    ROWS: int
    PARTS: int
    NB: int


def dequant_plan(cfg: TileConfig, k: int) -> DequantPlan:
    """32 rows per DEQ task (4 per 128-row chunk: ~1 MB of traffic at K = 8192, so the first chunks -- which
    the first tiles wait for -- are spread over 4 programs), 16 MX blocks (512 columns) per step: 16 KB of
    payload in flight per program. Tiny under the CPU interpreter."""
    rows = max(1, cfg.BM // 4) if not interpreting() else max(1, cfg.BM // 2)
    nb_cap = 16 if not interpreting() else 2
    return DequantPlan(rows, cfg.BM // rows, min(nb_cap, _pow2_at_least(k // 32, 1, nb_cap)))


@lru_cache(maxsize=256)
def _deq_rows(rank: int, world: int, ms: int, bm: int, parts: int, op: str):
    chunks = math.ceil(ms / bm)
    if op == "ag":  # the compute table's slot order: own slot first, then slots r-1, r-2, ... as they arrive
        order = [((rank - d) % world, m) for d in range(world) for m in range(chunks)]
    else:  # gemm_rs: m-tile major, owners staggered r+1, ..., r (the compute table's order)
        order = [((rank + d) % world, m) for m in range(chunks) for d in range(1, world + 1)]
    return tuple((slot, m, p, 0) for slot, m in order for p in range(parts))


def plan_dequant(rank: int, world: int, ms: int, cfg: TileConfig, plan: DequantPlan, op: str, device):
    """The DEQ task table (slot, chunk, part, 0) in the order the op's tiles need the rows."""
    return _table(list(_deq_rows(rank, world, ms, cfg.BM, plan.PARTS, op)), device)


# ------------------------------------------------------------------------------------------------------ MoE
@dataclass(frozen=True)
class MoETiles:
    """Block sizes of the one-launch MoE layer (kernels/moe_forward.py). Its task lists are built on the
    device (the per-expert row counts exist only there), so this is the whole host-side plan."""
    RB: int    # tokens per router/dispatch task
    PB: int    # received rows per permute task
    FB: int    # tokens per fold task
    BH: int    # columns per copy step (dispatch, permute, fold)
    BM: int    # expert GEMM tile rows
    BK: int
    BNH: int   # GEMM1 tile: BNH gate columns + the matching BNH up columns
    BN: int    # GEMM2 tile columns
    num_warps: int
    num_stages: int
    half_tail: bool = True     # an expert's last m-tile with <= BM/2 rows runs as a BM/2-row tile


def moe_config(config=None, mx: bool = False) -> MoETiles:
    """The one rule: GEMM tiles as the TP kernels (128 rows, 64-deep K steps, 3 stages, 8 warps; GEMM1 computes
    128 gate + 128 up columns so that SwiGLU fuses into its epilogue); 32-token blocks for the data movers so
    that a 4k-token batch makes ~one task per SM; the copy step and the half-height tail tile from ``config``
    (a ``kosmos.MoEForwardConfig``, whose docstring has the measurements). Tiny blocks under the CPU interpreter (the copy step capped at 32)."""
    config = check_config(MoEForwardConfig, config)  # an isinstance check; None: the default instance
    if interpreting():  # (MXFP8: GEMM1's epilogue rounds whole 32-column MX blocks, so BNH >= 32)
        return MoETiles(RB=16, PB=16, FB=16, BH=min(32, config.copy_cols), BM=16, BK=16, BNH=32 if mx else 16,
                         BN=32, num_warps=4, num_stages=1, half_tail=config.half_tail)
    return MoETiles(RB=32, PB=32, FB=32, BH=config.copy_cols, BM=128, BK=64, BNH=128, BN=256, num_warps=8,
                     num_stages=3, half_tail=config.half_tail)
