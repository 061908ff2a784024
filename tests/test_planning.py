"""Host-side planners (kosmos.planning): tile shapes and the task tables of both fused ops."""
import math

import pytest
import torch

from kosmos.core import planning
from kosmos.config import AllGatherMatmulConfig
from kosmos.core.planning import COPY, GROUP_M, PUSH, TileConfig

# Small tiles (as under the interpreter) and the GPU rule's big tiles, plus one with many m-tiles per slot so
# that GROUP_M grouping (more than one group) is exercised.
CFGS = [TileConfig(16, 32, 16, 4, 1), TileConfig(128, 256, 64, 8, 3), TileConfig(4, 16, 16, 4, 1)]
SHAPES = [(1, 8), (5, 24), (16, 32), (37, 48), (37, 1000), (300, 256), (129, 520)]  # (ms, n), ragged included


def _cases():
    out = []
    for world in range(1, 9):
        ranks = sorted({0, world // 2, world - 1})
        for rank in ranks:
            for i, (ms, n) in enumerate(SHAPES):
                cfg = CFGS[(world + rank + i) % len(CFGS)]
                out.append((rank, world, ms, n, cfg))
    return out


CASES = _cases()
IDS = [f"r{r}w{w}-ms{ms}-n{n}-bm{c.BM}bn{c.BN}" for r, w, ms, n, c in CASES]


def _rows(t):
    assert t.dtype == torch.int32
    assert t.dim() == 2 and t.shape[1] == 4
    return [tuple(int(v) for v in row) for row in t.tolist()]


def _grouped_ref(m_tiles, n_tiles):
    """Independent statement of the grouped order: groups of GROUP_M m-tiles; inside a group, n-tiles
    ascending and for each n-tile the group's m-tiles ascending."""
    order = []
    for g in range(math.ceil(m_tiles / GROUP_M)):
        ms_ = [m for m in range(m_tiles) if m // GROUP_M == g]
        for n in range(n_tiles):
            order += [(m, n) for m in ms_]
    return order


# ------------------------------------------------------------------------------------------- AllGather+GEMM
@pytest.mark.parametrize("rank,world,ms,n,cfg", CASES, ids=IDS)
def test_ag_compute_table(rank, world, ms, n, cfg):
    comm, comp, flag_slots = planning.plan_all_gather_matmul(rank, world, ms, n, cfg, "cpu")
    rows = _rows(comp)
    mt, nt = math.ceil(ms / cfg.BM), math.ceil(n / cfg.BN)
    # every (slot, m, n) of the grid exactly once
    assert len(rows) == world * mt * nt
    assert len(set(rows)) == len(rows)
    assert {r[:3] for r in rows} == {(s, m, j) for s in range(world) for m in range(mt) for j in range(nt)}
    assert all(r[3] == 0 for r in rows)
    # own slot first, then rank-1, rank-2, ... (slots in contiguous blocks)
    per_slot = mt * nt
    for d in range(world):
        block = rows[d * per_slot:(d + 1) * per_slot]
        assert {r[0] for r in block} == {(rank - d) % world}
        # inside a slot: GROUP_M-grouped order
        assert [(r[1], r[2]) for r in block] == _grouped_ref(mt, nt)
    assert rows[0][0] == rank
    assert flag_slots == world * mt


@pytest.mark.parametrize("rank,world,ms,n,cfg", CASES, ids=IDS)
def test_ag_comm_table(rank, world, ms, n, cfg):
    comm, _, _ = planning.plan_all_gather_matmul(rank, world, ms, n, cfg, "cpu")
    rows = _rows(comm)
    chunks = math.ceil(ms / cfg.BM)
    if world == 1:
        assert rows == []
        return
    pushes = [r for r in rows if r[0] == PUSH]
    copies = [r for r in rows if r[0] == COPY]
    assert len(pushes) + len(copies) == len(rows)
    assert all(r[3] == 1 for r in rows)  # one chunk per task (the default)
    # each peer (never self) gets each chunk exactly once
    assert len(pushes) == (world - 1) * chunks
    assert sorted((p, c) for _, p, c, _ in pushes) == sorted(
        (p, c) for p in range(world) if p != rank for c in range(chunks))
    # staggered: peers rank+1, rank+2, ... in blocks, chunks ascending inside a block (the peer's order)
    assert [(p, c) for _, p, c, _ in pushes] == [((rank + d) % world, c) for d in range(1, world)
                                                 for c in range(chunks)]
    assert pushes[0][1] == (rank + 1) % world
    # COPY of own rows into own slot, after every push
    assert copies == [(COPY, rank, c, 1) for c in range(chunks)]
    assert rows[-len(copies):] == copies
    assert rows[:len(pushes)] == pushes


@pytest.mark.parametrize("chunks,per_task", [(1, 1), (7, 2), (8, 4), (32, 4), (5, 8), (9, 3)])
def test_ag_comm_tasks_of_several_chunks(chunks, per_task):
    """push_chunks: every chunk goes to every peer exactly once, tasks hold at most per_task chunks,
    and task i moves chunks i, i + stride, ... so the first wave of tasks lands the lowest chunks first."""
    cfg = CFGS[0]
    world, rank = 3, 1
    ms = chunks * cfg.BM - 3
    stride = planning.ag_comm_stride(ms, cfg.BM, per_task)
    assert stride == math.ceil(chunks / per_task)
    comm, _, _ = planning.plan_all_gather_matmul(rank, world, ms, 48, cfg, "cpu", per_task)
    rows = _rows(comm)
    moved = {}
    for kind, peer, first, count in rows:
        assert 1 <= count <= per_task and first < stride
        for j in range(count):
            moved.setdefault((kind, peer), []).append(first + j * stride)
    for peer in range(world):
        kind = COPY if peer == rank else PUSH
        assert sorted(moved[(kind, peer)]) == list(range(chunks))
    assert len(rows) == world * stride
    first_wave = [first for kind, peer, first, _ in rows if kind == PUSH and peer == (rank + 1) % world]
    assert first_wave == list(range(stride))


@pytest.mark.parametrize("world,ms,expect", [(2, 4096 // 2, 1), (2, 8192 // 2, 2), (2, 16384 // 2, 4),
                                             (8, 16384 // 8, 7), (2, 100, 1)])
def test_ag_push_chunks_auto(world, ms, expect):
    """push_chunks="auto": chunks per push task so that about 16 push tasks cover all peers' chunks
    (16 / 32 / 64 chunks of 128 rows at seq 4k / 8k / 16k, TP=2)."""
    per_task, _ = planning.ag_comm_config(world, ms, 128, AllGatherMatmulConfig(push_chunks="auto"))
    assert per_task == expect
    assert planning.ag_push_tasks(world, ms, 128, per_task) <= planning.AG_TARGET_PUSHERS + world - 1


def test_ag_stagger_no_two_ranks_push_same_peer():
    """At every step of the comm queues, the W ranks target W distinct peers."""
    cfg = CFGS[0]
    for world in range(2, 9):
        tables = [_rows(planning.plan_all_gather_matmul(r, world, 37, 48, cfg, "cpu")[0]) for r in range(world)]
        n_push = (world - 1) * math.ceil(37 / cfg.BM)
        for i in range(n_push):
            targets = [tables[r][i][1] for r in range(world)]
            assert sorted(targets) == list(range(world))


# --------------------------------------------------------------------------------------- GEMM+ReduceScatter
@pytest.mark.parametrize("rank,world,ms,n,cfg", CASES, ids=IDS)
def test_rs_tables(rank, world, ms, n, cfg):
    comp, red, flag_slots = planning.plan_matmul_reduce_scatter(rank, world, ms, n, cfg, "cpu")
    rows = _rows(comp)
    mt, nt = math.ceil(ms / cfg.BM), math.ceil(n / cfg.BN)
    tiles = mt * nt
    # every (owner, m, n) exactly once
    assert len(rows) == world * tiles
    assert len(set(rows)) == len(rows)
    assert {r[:3] for r in rows} == {(o, m, j) for o in range(world) for m in range(mt) for j in range(nt)}
    assert all(r[3] == 0 for r in rows)
    # tile i for every owner before tile i+1; owners staggered rank+1, ..., rank (own last)
    tile_order = _grouped_ref(mt, nt)
    for i, (m, j) in enumerate(tile_order):
        block = rows[i * world:(i + 1) * world]
        assert [(r[1], r[2]) for r in block] == [(m, j)] * world
        assert [r[0] for r in block] == [(rank + d) % world for d in range(1, world + 1)]
        assert block[-1][0] == rank
    # reduce table: own tiles exactly once, same tile order as compute; empty at W=1
    red_rows = _rows(red)
    if world == 1:
        assert red_rows == []
    else:
        assert red_rows == [(m, j, 0, 0) for (m, j) in tile_order]
        own_in_compute = [(r[1], r[2], 0, 0) for r in rows if r[0] == rank]
        assert red_rows == own_in_compute
    assert flag_slots == world * tiles


def test_rs_stagger_owners_distinct_per_step():
    cfg = CFGS[0]
    for world in range(1, 9):
        tables = [_rows(planning.plan_matmul_reduce_scatter(r, world, 37, 48, cfg, "cpu")[0])
                  for r in range(world)]
        for i in range(len(tables[0])):
            owners = [tables[r][i][0] for r in range(world)]
            assert sorted(owners) == list(range(world))


# ----------------------------------------------------------------------------------- flag slots, shapes
@pytest.mark.parametrize("world,ms,n,bm,bn,ag_slots,rs_slots", [
    (1, 16, 32, 16, 32, 1, 1),
    (2, 21, 48, 16, 32, 4, 8),
    (3, 5, 24, 16, 32, 3, 3),
    (8, 300, 1000, 128, 256, 24, 8 * 3 * 4),
    (4, 128, 256, 128, 256, 4, 4),
])
def test_flag_slots(world, ms, n, bm, bn, ag_slots, rs_slots):
    cfg = TileConfig(bm, bn, 16, 4, 1)
    assert planning.plan_all_gather_matmul(0, world, ms, n, cfg, "cpu")[2] == ag_slots
    assert planning.plan_matmul_reduce_scatter(world - 1, world, ms, n, cfg, "cpu")[2] == rs_slots


def test_empty_tables_keep_shape():
    comm, _, _ = planning.plan_all_gather_matmul(0, 1, 37, 48, CFGS[0], "cpu")
    _, red, _ = planning.plan_matmul_reduce_scatter(0, 1, 37, 48, CFGS[0], "cpu")
    for t in (comm, red):
        assert tuple(t.shape) == (0, 4) and t.dtype == torch.int32


# -------------------------------------------------------------------------------------------- tile_config
def test_tile_config_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert planning.interpreting()
    for rows, n, k in [(1, 8, 8), (21, 48, 40), (5, 24, 16), (4096, 8192, 8192)]:
        cfg = planning.tile_config(rows, n, k)
        assert cfg.BM == 16 and cfg.BK == 16
        assert cfg.BN in (16, 32)
        assert cfg.BN == (16 if n <= 16 else 32)
        assert (cfg.num_warps, cfg.num_stages) == (4, 1)


@pytest.mark.parametrize("env", ["0", None])
def test_tile_config_gpu(monkeypatch, env):
    """Many waves of tiles: 128x256x64, 8 warps, 3 stages, BN shrunk to N's power of two (>= 64)."""
    if env is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", env)
    assert not planning.interpreting()
    for rows, n in [(4096, 8192), (16384, 14336), (8192, 28672)]:
        cfg = planning.tile_config(rows, n, 8192)
        assert (cfg.BM, cfg.BN, cfg.BK, cfg.num_warps, cfg.num_stages) == (128, 256, 64, 8, 3), (rows, n)
    for rows, n, bn in [(32768, 128, 128), (65536, 72, 128), (65536, 64, 64), (65536, 8, 64), (65536, 40, 64)]:
        cfg = planning.tile_config(rows, n, 8192)
        assert (cfg.BM, cfg.BN) == (128, bn), (rows, n)
        assert cfg.BN & (cfg.BN - 1) == 0 and 64 <= cfg.BN <= 256


@pytest.mark.parametrize("rows,n,world,programs,want", [
    # the session-10 probe's winners on one H200 (132 programs), W=1
    (256, 1536, 1, 132, (64, 64, 4, 6)),       # 12 tiles of 128x256: 96 of 64x64 fill the SMs
    (512, 1536, 1, 132, (64, 128, 4, 4)),      # 24 -> 96 tiles
    (256, 8192, 1, 132, (128, 128, 4, 4)),     # 64 -> 128 tiles
    (4096, 1536, 1, 132, (128, 128, 4, 4)),    # 1.45 waves -> 2.9
    (2048, 5120, 1, 132, (128, 128, 4, 4)),    # 2.42 waves -> 4.85
    (1024, 4096, 1, 132, (128, 256, 8, 3)),    # 0.97 waves: one full wave already
    (8192, 1536, 1, 132, (128, 256, 8, 3)),    # 2.91 waves
    (512, 5120, 1, 132, (128, 256, 8, 3)),     # 0.61 waves: 2 waves of 128x128 would cost more
    # the llama3-70b TP=2 per-rank GEMMs of the default suite keep 128x256
    (4096, 5120, 1, 132, (128, 256, 8, 3)), (4096, 14336, 1, 132, (128, 256, 8, 3)),
    (4096, 8192, 1, 132, (128, 256, 8, 3)),
    # W > 1: every rank computes all rows*world rows, so the same shard grows into more waves
    (128, 1536, 2, 132, (64, 64, 4, 6)), (2048, 1536, 2, 132, (128, 128, 4, 4)),
    (2048, 8192, 2, 132, (128, 256, 8, 3)),
    # fewer programs: the same shape has more waves
    (256, 8192, 1, 16, (128, 256, 8, 3)),
])
def test_tile_config_wave_model(monkeypatch, rows, n, world, programs, want):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = planning.tile_config(rows, n, 4096, world=world, programs=programs)
    assert (cfg.BM, cfg.BN, cfg.num_warps, cfg.num_stages) == want
    assert cfg.BK == 64


def test_tile_config_mx_keeps_the_measured_tile(monkeypatch):
    """MXFP8 keeps 128x256 (64 rows at <= 64 rows) whatever the waves: its DEQ plan was measured only there."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for rows, bm in [(256, 128), (37, 64), (4096, 128)]:
        cfg = planning.tile_config(rows, 1536, 4096, mx=True)
        assert (cfg.BM, cfg.BN, cfg.num_warps, cfg.num_stages) == (bm, 256, 8, 3)


def test_tile_config_picks_the_cheapest_candidate(monkeypatch):
    """The rule is the argmin of the wave model over TILE_CANDIDATES (ties within 1% to the larger tile), on
    every grid GEMM of suites/tp-grid.yaml."""
    import math
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ms = [256, 512, 1024, 2048, 3000, 4096, 6000, 8192, 16384]
    ns = [1536, 3072, 4096, 5120, 6144, 6912, 8192, 14336, 28672]
    for m in ms:
        for n in ns:
            cfg = planning.tile_config(m, n, 4096)
            costs = []
            for bm, bn, w, s, thr in planning.TILE_CANDIDATES:
                tiles = math.ceil(m / bm) * math.ceil(n / bn)
                costs.append((math.ceil(tiles / 132) * bm * bn / (128 * 256) / thr, (bm, bn, w, s)))
            cheapest = min(c for c, _ in costs)
            first_within = next(t for c, t in costs if c < cheapest / 0.99 + 1e-12)
            assert (cfg.BM, cfg.BN, cfg.num_warps, cfg.num_stages) == first_within, (m, n)


def test_cached_tables_builds_once():
    calls = []

    def build():
        calls.append(1)
        return planning.plan_all_gather_matmul(0, 2, 21, 48, CFGS[0], "cpu")

    key = ("test_planning", object())
    first = planning.cached_tables(key, build)
    second = planning.cached_tables(key, build)
    assert first is second and len(calls) == 1
    planning._DEVICE_TABLES.pop(key, None)


# ------------------------------------------------------------------------------------------ MXFP8 DEQ tasks
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kosmos.ops.tp_dequant import deq_needed


@triton.jit
def _deq_needed_kernel(out, n_comp, n_chunks, n_tn, WORLD: tl.constexpr, PARTS: tl.constexpr, GROUP: tl.constexpr,
                       RS: tl.constexpr):
    p = tl.program_id(0) + 1
    tl.store(out + p - 1, deq_needed(p, n_comp, n_chunks, n_tn, WORLD, PARTS, GROUP, RS))


DEQ_CASES = [  # (rank, world, ms, n, BM, BN, parts)
    (0, 1, 300, 700, 128, 256, 4), (1, 2, 1000, 512, 128, 256, 4), (2, 3, 77, 96, 16, 32, 2),
    (3, 4, 4096, 5120, 128, 256, 4), (5, 8, 200, 640, 128, 256, 4), (0, 2, 16, 32, 16, 32, 2),
]


@pytest.mark.interpreter
@pytest.mark.parametrize("op", ["ag", "rs"])
@pytest.mark.parametrize("rank,world,ms,n,bm,bn,parts", DEQ_CASES)
def test_deq_needed_covers_every_tile(op, rank, world, ms, n, bm, bn, parts):
    """The kernels' deq_needed(p) (run under the interpreter) against the planners' tables: the first p tiles
    of the compute table need exactly DEQ tasks [0, deq_needed(p)) -- never fewer (a tile would wait for a DEQ
    task nobody claims ahead of it; the help loop claims only below it) and no more than the band needs."""
    cfg = TileConfig(bm, bn, 64, 8, 3)
    dq = planning.DequantPlan(bm // parts, parts, 1)
    if op == "ag":
        _, comp, _ = planning.plan_all_gather_matmul(rank, world, ms, n, cfg, "cpu")
    else:
        comp, _, _ = planning.plan_matmul_reduce_scatter(rank, world, ms, n, cfg, "cpu")
    deq = planning.plan_dequant(rank, world, ms, cfg, dq, op, "cpu").tolist()
    n_comp, chunks, n_tn = comp.shape[0], math.ceil(ms / bm), math.ceil(n / bn)

    got = torch.zeros(n_comp, dtype=torch.int32)
    _deq_needed_kernel[(n_comp,)](got, n_comp, chunks, n_tn, WORLD=world, PARTS=parts, GROUP=GROUP_M, RS=op == "rs")
    position = {(slot, chunk, part): i for i, (slot, chunk, part, _) in enumerate(deq)}
    seen = -1
    for t, (slot, mt, _, _) in enumerate(comp.tolist()):
        seen = max(seen, max(position[(slot, mt, p)] for p in range(parts)))
        assert got[t] >= seen + 1, (t, got[t].item(), seen)
        assert got[t] <= len(deq)
    assert got[-1] == len(deq)


@pytest.mark.parametrize("m,n,k,expect", [
    (512, 1536, 7168, "split"), (256, 4096, 4096, "split"),           # under a wave even in 128x128 tiles, long K
    (3000, 3072, 7168, "stream-k"), (6000, 3072, 5120, "stream-k"),   # 2.18 / 4.27 waves of 128x256
    (512, 5120, 5120, "tail"), (1024, 3072, 8192, "tail"),            # 80 / 96 tiles of 128x256: 108 / 128 of 128x192
    (4096, 1536, 4096, "unsplit"),                                    # 128x128's 2.9 waves of tiles
    (6000, 1536, 1024, "two-per-sm"), (4096, 14336, 1024, "two-per-sm"),  # K = 1024: 16 steps a tile
    (512, 6912, 1024, "two-per-sm"),
    (16384, 28672, 1024, "unsplit"),                                  # K = 1024, but 108 waves of 128x256
    (8192, 28672, 4096, "unsplit"),                                   # many waves: the last one costs < 5%
    (100, 256, 128, "unsplit"), (256, 1536, 1024, "unsplit"),         # a few tiles, short K: nothing to split
])
def test_w1_plan_splits_or_streams_only_badly_filled_waves(monkeypatch, m, n, k, expect):
    """planning.w1_plan: a K split where even 128x128 tiles leave half the SMs idle and K is long; stream-K
    where at least one wave of tiles runs and the wave model predicts >= STREAM_K_MIN_GAIN from the last partial
    wave (at least one data-parallel wave: tiles >= 2 * programs, not a whole number of waves); else tile_config's tile
    unsplit; at K <= 1024 with the SMs filled once by 128x128 tiles and at most 16 waves of 128x256, two
    programs per SM at 128x128; a tail tile (160 or 192 columns) where its waves are predicted TAIL_MIN_GAIN
    faster. A split keeps >= SPLIT_MIN_STEPS K steps per tile and whole groups on the SMs."""
    from kosmos.gemm.w1_static import w1_split_grid
    monkeypatch.setattr(planning, "interpreting", lambda: False)
    plan = planning.w1_plan(m, n, k, programs=132)
    cfg, split = plan.tile, plan.split
    got = ("split" if split > 1 else "stream-k" if plan.stream_k else "two-per-sm" if plan.per_sm == 2
           else "tail" if plan.tail else "unsplit")
    assert got == expect, plan
    tiles = -(-m // cfg.BM) * -(-n // cfg.BN)
    if got == "unsplit":
        assert cfg == planning.tile_config(m, n, k, world=1, programs=132)
    elif got == "tail":
        assert cfg == planning.TAIL_TILE and plan.tail in dict(planning.TAIL_TILES)
        assert plan.width == cfg.BN + plan.tail
    elif got == "two-per-sm":
        assert cfg == planning.SHORT_K_TILE and -(-k // 64) <= planning.SHORT_K_STEPS
    elif got == "split":
        assert -(-k // 64) >= planning.SPLIT_MIN_STEPS
        grid = w1_split_grid(132, tiles, split)
        assert grid % split == 0 and grid <= 132
    else:
        assert tiles >= 2 * 132 and tiles % 132, (tiles, plan)


def test_w1_plan_tail_tiles_where_the_wave_model_says(monkeypatch):
    """w1_plan takes 128x192 (planning.TAIL_TILES) where its waves fill the SMs better than every other plan by
    TAIL_MIN_GAIN (96 tiles of 128x256 -> 128 of 128x192), not on many-wave shapes, and never with TAIL_TILES
    empty."""
    monkeypatch.setattr(planning, "interpreting", lambda: False)
    monkeypatch.setattr(planning, "TAIL_TILES", ())
    assert planning.w1_plan(1024, 3072, 8192, programs=132).tail == 0
    monkeypatch.setattr(planning, "TAIL_TILES", ((64, 0.88),))
    for m, n, k in ((1024, 3072, 8192), (2048, 1536, 5120), (512, 5120, 5120)):
        plan = planning.w1_plan(m, n, k, programs=132)
        assert plan.tail == 64 and plan.tile == planning.TAIL_TILE and plan.width == 192, (m, n, k, plan)
    for m, n, k in ((8192, 8192, 4096), (4096, 1536, 4096), (16384, 28672, 1024)):
        assert planning.w1_plan(m, n, k, programs=132).tail == 0, (m, n, k)
