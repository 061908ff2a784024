"""Host-side planners: tile shapes, the static W=1 GEMM's schedules, and the demand-ordered task tables of each
fused op.

A task table is an int32 ``[n, 4]`` tensor; a launch claims its rows in order with one atomic head. The
order is the whole scheduling policy's input: the kernel never reorders, it only decides *which queue* to
take from next. Tables are built once per shape and kept on the device (``cached_tables``; building one is a
host-to-device copy, refused inside a CUDA-graph capture).

AllGather+GEMM (rank r, world W, shard rows Ms = M/W, chunks of BM rows):
  comm table     rows (PUSH, peer, chunk, 1) for peers r+1, r+2, ... (staggered, so no two ranks push to the
                 same peer at once), chunks ascending -- the order in which that peer consumes them; then
                 (COPY, r, chunk, 1): this rank's own rows into its slot of the gathered buffer (only needed
                 for the returned ``a_full``, so last; the self policy runs them after the compute tiles,
                 see ops/all_gather_matmul.py). With p chunks per task (``push_chunks``) a row is (kind, peer, i,
                 count): chunks i, i + stride, ... with stride = ceil(chunks / p).
  compute table  rows (slot, m_tile, n_tile, 0): own slot first (ready at once), then slots r-1, r-2, ...
                 in the order their pushes arrive; inside a slot, GROUP_M m-tiles share each n-tile (L2).
GEMM+ReduceScatter (rank r): the output rows of owner p are rows [p*Ms, (p+1)*Ms) of A @ B.
  compute table  rows (owner, m_tile, n_tile, 0): tile i of every owner before tile i+1, owners staggered
                 r+1, r+2, ..., r, so each owner receives tile i from all ranks at about the same time.
  reduce table   rows (m_tile, n_tile, 0, 0) of this rank's own tiles, in the same tile order: reduce tile i
                 becomes ready once every rank has produced its partial of tile i.
MXFP8 DEQ tasks (``dequant_plan`` / ``plan_dequant``): (slot, chunk, part, 0), ROWS rows each, in the order the
op's compute table needs the rows.

Tiles: ``tile_config`` is the one tile rule of both TP ops (no autotuning, no per-shape table): the candidate of
TILE_CANDIDATES whose grid of tiles finishes first on the persistent programs, by a wave model. ``w1_plan`` picks
the static W=1 GEMM's schedule (unsplit, K split, stream-K, two programs per SM at short K, tail tiles) by the
same model; ``moe_config`` gives the MoE layer's block sizes (its task lists are built on the device).

The why, the parked alternatives and the figures the constants come from: docs/design/gemm.md (tile rule, W=1
schedules), docs/design/all_gather_matmul.md and matmul_reduce_scatter.md (tables, DEQ tasks); measurements:
docs/perf/all_gather_matmul.md. Tests: tests/test_planning.py (tables, staggering, flag slots, the tile rule and
wave model, w1_plan's splits, stream-K and tail tiles, cached_tables, the DEQ order).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch

from ..config import AllGatherMatmulConfig, MoEForwardConfig, check_config
from .runtime import capture_refusal

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
# each tile's TFLOP/s relative to 128x256 when the grid has many waves of tiles, as the tile probe measured it
# on one H200 (the geomean over the grid GEMMs of suites/tp-grid.yaml with >= 5 waves, both TP ops at W=1;
# figures: docs/design/gemm.md, "The tile rule").
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
    predicted time is the product; the smallest wins, a larger tile on a tie within 1%. BN is capped at the
    next power of two of n (64..256). What it does: shapes with many waves keep 128x256x64 (8 warps, 3 stages);
    a grid under half a wave takes smaller tiles until it fills the SMs (256x1536x1024: 12 tiles of 128x256 ->
    96 of 64x64); a wave count just over an integer (192 tiles = 1.45 waves) takes 128x128 (384 tiles, 2.9
    waves, less idle tail). K does not enter (no BK other than 64 won anywhere). The rows <= 64 case falls out of
    the model (a 128-row tile costs its full time however few rows it holds). At W > 1 the same rule applies and
    the communication chunks are BM rows. ``mx``: the MXFP8 DEQ paths keep the 128x256 tile their DEQ plan was
    measured with (64 rows for rows <= 64, BN capped as above). Tiny tiles under the CPU interpreter. Figures:
    docs/design/gemm.md ("The tile rule")."""
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
# Stream-K (w1_plan): its cost over the even share of K steps, in K steps of a 128x256 tile, fitted to the
# stream-K probe (docs/design/gemm.md)
STREAM_K_OVERHEAD_STEPS = 26
STREAM_K_MIN_GAIN = 1.02
STREAM_K_TILES = (TileConfig(128, 256, 64, 8, 3), TileConfig(128, 128, 64, 4, 4))
# Short K (w1_plan): two programs per SM of 128x128 tiles, one warpgroup, 3 stages (112 KiB of shared memory
# each, two fit an SM), where a tile is at most SHORT_K_STEPS K steps, the 128x128 tiles fill the SMs once and
# 128x256 tiles make at most SHORT_K_MAX_WAVES waves (the many-wave shapes lost: docs/design/gemm.md)
SHORT_K_TILE = TileConfig(128, 128, 64, 4, 3)
SHORT_K_STEPS = 16
SHORT_K_MAX_WAVES = 16
# Tail tiles (w1_plan): 128 rows x (128 + tail) columns, two accumulators (gemm/tiles.tile_matmul_tail),
# 8 warps, 4 stages, the tile loop not flattened. (tail, throughput relative to 128x256 on many waves, as
# TILE_CANDIDATES' column, from dev/archive/tail_probe: docs/design/gemm.md); 128x160 is not a candidate
TAIL_TILE = TileConfig(128, 128, 64, 8, 4)
TAIL_TILES: tuple = ((64, 0.88),)
TAIL_MIN_GAIN = 1.03  # a tail tile only where the wave model predicts it this much faster than the other plans


@dataclass(frozen=True)
class W1Plan:
    """How the static W=1 GEMM runs a shape: its tile, a K split in ``split`` parts or stream-K, and its
    programs per SM (``per_sm`` x the SMs in the grid: two co-resident programs, each one's epilogue under the
    other's mainloop); ``tail``: tiles tile.BN + tail columns wide, unsplit (a 64- or 32-column second
    accumulator: gemm/tiles.tile_matmul_tail)."""
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
    """The schedule (a W1Plan) of the static W=1 GEMM (gemm/w1_static.w1_matmul_kernel) for C [rows, n] = A @ B:
    the first rule that applies, else the cheapest by tile_config's wave model (``_w1_cost``, ``_w1_tail_cost``):

    * K split: where even 128x128 tiles (SPLIT_TILE) fill at most half the SMs (tiles * SPLIT_PARTS <= programs)
      and K is long (>= SPLIT_MIN_STEPS steps of 64): each tile's K steps cut in SPLIT_PARTS halves, two programs
      per tile, their fp32 partials summed by both (one round: at most ``programs`` programs);
    * short K: where a tile is at most SHORT_K_STEPS steps, 128x128 tiles fill the SMs at least once and 128x256
      tiles make at most SHORT_K_MAX_WAVES waves: two programs per SM of SHORT_K_TILE, one's epilogue under the
      other's mainloop;
    * otherwise tile_config's tile unsplit, unless stream-K (a STREAM_K_TILES tile: data-parallel waves, then the
      last wave and a half of tiles in ``programs`` equal runs of K steps) is predicted STREAM_K_MIN_GAIN faster --
      only where at least one data-parallel wave runs (T >= 2 * programs, T not a multiple of programs), costed as
      T / programs tiles plus STREAM_K_OVERHEAD_STEPS K steps of a 128x256 tile -- and unless a tail tile
      (TAIL_TILE plus a 64-column second accumulator, n > 256, at TAIL_TILES' rate) is predicted TAIL_MIN_GAIN
      faster than the best of those.
    Under the interpreter or with fewer than 2 programs: tile_config's tile unsplit. The why, the parked alternatives
    (other splits, stream-K's first forms, other tails, cuBLAS's tilings) and the figures behind every constant:
    docs/design/gemm.md ("The W = 1 static GEMM", "Where the grid stands"); tests/test_planning.py."""
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


FP8_BLOCK_TILE = TileConfig(128, 128, 128, 8, 4)  # BK = one scale block; two warpgroups of 64 x 128 (acc + step)


def fp8_block_plan(rows: int, n: int, k: int, *, programs: int = 132) -> W1Plan:
    """The static W=1 GEMM's schedule for a block-scaled FP8 product (gemm/w1_static's SCALED mainloop): one tile,
    FP8_BLOCK_TILE -- BK is a scale block (128), and 128 x 128 keeps the step's fresh accumulator beside the
    running one in two warpgroups' registers -- with w1_plan's K split where its tiles fill at most half the SMs
    and K is long, else stream-K where the wave model predicts STREAM_K_MIN_GAIN, else unsplit. No tail tile,
    no two programs per SM. Not yet measured on a GPU (docs/design/gemm.md: fp8-block); under the interpreter a
    16 x 32 x 128 tile."""
    if interpreting() or programs < 2:
        return W1Plan(TileConfig(16, 32, 128, 4, 1) if interpreting() else FP8_BLOCK_TILE)
    cfg = FP8_BLOCK_TILE
    tiles = -(-rows // cfg.BM) * -(-n // cfg.BN)
    if -(-k // 64) >= SPLIT_MIN_STEPS and tiles * SPLIT_PARTS <= programs:
        return W1Plan(cfg, SPLIT_PARTS)
    unsplit = _w1_cost(rows, n, k, cfg, programs, False)
    streamed = _w1_cost(rows, n, k, cfg, programs, True)
    if streamed is not None and streamed * STREAM_K_MIN_GAIN < unsplit:
        return W1Plan(cfg, stream_k=True)
    return W1Plan(cfg)


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
    ``bm``, from ``config`` (a ``kosmos.AllGatherMatmulConfig``; None = defaults 1 and 16384: its docstring says
    why). push_chunks="auto": about AG_TARGET_PUSHERS push tasks in all, however long the shard (fewer, larger
    comm tasks take the same NVLink bandwidth from fewer SMs)."""
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
    """Block sizes of the one-launch MoE layer (ops/moe_forward.py). Its task lists are built on the
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
    (a ``kosmos.MoEForwardConfig``, whose docstring says why). Tiny blocks under the CPU interpreter (the copy
    step capped at 32)."""
    config = check_config(MoEForwardConfig, config)  # an isinstance check; None: the default instance
    if interpreting():  # (MXFP8: GEMM1's epilogue rounds whole 32-column MX blocks, so BNH >= 32)
        return MoETiles(RB=16, PB=16, FB=16, BH=min(32, config.copy_cols), BM=16, BK=16, BNH=32 if mx else 16,
                         BN=32, num_warps=4, num_stages=1, half_tail=config.half_tail)
    return MoETiles(RB=32, PB=32, FB=32, BH=config.copy_cols, BM=128, BK=64, BNH=128, BN=256, num_warps=8,
                     num_stages=3, half_tail=config.half_tail)
