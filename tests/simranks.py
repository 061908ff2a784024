"""W simulated ranks in one process (used by the kernel tests and by `kosmos_bench.sim_probe`).

Every rank's buffers live on one device -- the CPU under the Triton interpreter, or one GPU -- and the peer
pointer tables hold their addresses, so the kernels' peer loads, stores and flags reach the other simulated
ranks' memory exactly as they reach other GPUs' over NVLink (same code path, ``scope="sys"`` atomics).

* CPU: programs of a launch run one after another, so the tests order the ranks' phases by hand (fixed-role
  policy with ``comm_programs=grid`` or ``0``).
* One GPU: ``launch_all`` queues every rank's launch on its own stream before waiting on any, with a grid of
  ``SMs // W`` programs each, so all W launches are resident at once and really run concurrently -- W = 2..8
  on a machine with a single GPU. (Timings there mean nothing: the ranks share one GPU's SMs and HBM.) The
  same ``launch_all`` inside ``torch.cuda.graph`` (streams made beforehand) captures every rank's launch as
  one branch of a graph, which replays them concurrently.

Epochs: each rank has its own device epoch slot (``Ranks.epochs``). ``launch(r, epoch)`` with an int sets it to
``epoch - 1`` first (a host write in stream order), so a test can name the epoch of every launch -- the CPU
tests run one call as several phase launches; with ``epoch=None`` the launch runs at whatever the device slot
holds, as the public ops do (a CPU phase launch that is not the rank's last of the call then passes
``advance=False``; the MoE layer's stage-split launches advance only in the one with FOLD).
"""
from __future__ import annotations

import torch

from kosmos import quant, reference
from kosmos.core import planning, runtime
from kosmos.reference import moe as moe_reference
from kosmos.ops import all_gather_matmul as ag
from kosmos.ops import matmul_reduce_scatter as rs
from kosmos.ops import moe_forward as mf
from kosmos.ops.moe_backward import api as bwd_api
from kosmos.ops.moe_backward import layout as bwd_layout
from kosmos.ops.moe_backward import one_launch as bwd_one
from kosmos.ops.moe_backward import router as bwd_router

NAN = float("nan")
TOL = 1e-2
ROUTE_ONLY = 1 << mf.ROUTE
MIDDLE = (1 << mf.PERMUTE) | (1 << mf.GEMM1) | (1 << mf.GEMM2)
FOLD_ONLY = 1 << mf.FOLD


def rand(*shape, gen, device="cpu", scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).to(device)


def launch_all(world, launch, streams=None):
    """Run ``launch(r)`` for every rank, each on its own CUDA stream, queued before any is waited on; the
    current stream then waits for all of them (no host synchronisation)."""
    cur = torch.cuda.current_stream()
    streams = streams or [torch.cuda.Stream() for _ in range(world)]
    for s in streams:
        s.wait_stream(cur)
    for r in range(world):
        with torch.cuda.stream(streams[r]):
            launch(r)
    for s in streams:
        cur.wait_stream(s)
    return streams


class Ranks:
    """The per-rank symmetric buffers of W simulated ranks, plus each rank's local heads and error record."""

    def __init__(self, world, data_rows, data_cols, device="cpu", n_sig=4096):
        self.world = world
        self.data = [torch.full((data_rows, data_cols), NAN, dtype=torch.bfloat16, device=device)
                     for _ in range(world)]
        self.sigs = [torch.zeros(n_sig, dtype=torch.int32, device=device) for _ in range(world)]
        self.peer_data = torch.tensor([d.data_ptr() for d in self.data], dtype=torch.int64, device=device)
        self.peer_sig = torch.tensor([s.data_ptr() for s in self.sigs], dtype=torch.int64, device=device)
        self.heads = [torch.zeros(runtime.NUM_HEADS, dtype=torch.int32, device=device) for _ in range(world)]
        self.epochs = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(world)]
        self.errors = [torch.zeros(runtime.ERR_SLOTS, dtype=torch.int64, device=device) for _ in range(world)]

    def poison(self):
        for d in self.data:
            d.fill_(NAN)

    def check_clean(self, r):
        assert self.heads[r].tolist() == [0] * runtime.NUM_HEADS, f"rank {r}: heads not reset"
        err = self.errors[r].tolist()
        assert err == [0] * runtime.ERR_SLOTS, f"rank {r}: {runtime.decode_error(err)}"

    def set_epoch(self, r, epoch):
        """Before a launch of rank r: run it at ``epoch`` (the slot holds the last completed one); None: leave
        the device epoch alone."""
        if epoch is not None:
            self.epochs[r].fill_(epoch - 1)

    def device_epochs(self):
        return [int(e.item()) for e in self.epochs]

    def check_done(self, epoch):
        want = [epoch if self.world > 1 else 0] * self.world  # at W=1 there is no peer to tell
        for q in range(self.world):
            done = self.sigs[q][runtime.DONE_BASE:runtime.DONE_BASE + self.world].tolist()
            assert done == want, f"rank {q}: done flags {done}, epoch {epoch}"


class _Op:
    """What AG and RS share: the simulated ranks, their grid, timeout and launch arguments."""

    def __init__(self, world, ms, k, n, seed, b_kmajor, device, grid, timeout_ns, config, fp8=False):
        self.world, self.ms, self.k, self.n = world, ms, k, n
        self.config = config  # the op's kosmos config (None: its defaults)
        self.device, self.grid, self.timeout_ns = device, grid, timeout_ns
        self.gen = torch.Generator().manual_seed(seed)
        self.cfg = planning.tile_config(ms, n, k, world=world, programs=grid)  # as the public op picks it
        # fp8: fp8-block A (1x128) and weight (128x128, k-major), the SCALED mainloop on the fp8-block tile
        self.fp8, self.b_kmajor = fp8, b_kmajor or fp8
        if fp8:
            self.cfg = planning.TileConfig(16, 32, 128, 4, 1) if device == "cpu" else planning.FP8_BLOCK_TILE

    def _kw(self, r, epoch, timeout_ns, pol):
        self.rk.set_epoch(r, epoch)
        return dict(rank=r, world=self.world, epoch_slot=self.rk.epochs[r], grid=self.grid, cfg=self.cfg,
                    config=self.config, timeout_ns=self.timeout_ns if timeout_ns is None else timeout_ns, **pol)

    def launch_all(self, epoch, streams=None, **pol):
        """Every rank's launch of ``epoch`` (None: the device epoch) concurrently (one GPU only)."""
        return launch_all(self.world, lambda r: self.launch(r, epoch, **pol), streams)


def mx_inputs(x):
    """(payload, scales, the exact bf16 values) of x quantized to MXFP8 (the torch reference's bits)."""
    payload, scales = quant.quantize_mx_ref(x)
    return payload, scales, quant.dequantize_mx_ref(payload, scales)


class AG(_Op):
    """AllGather+GEMM: rank r holds shard [Ms, K] and its own column shard of the weight [K, N]. mx: the shard
    travels as MXFP8 (payload + scales; the gathered buffer holds the payload, then the scales at
    ``scale_off``), the reference multiplies the dequantized values; fp8: the same with fp8-block rows (the fp32
    scales as their bytes) and weight, no dequantized rows (the SCALED mainloop)."""

    def __init__(self, world, ms, k, n, seed=0, b_kmajor=False, device="cpu", grid=3, timeout_ns=5_000_000,
                 config=None, mx=False, fp8=False):
        super().__init__(world, ms, k, n, seed, b_kmajor, device, grid, timeout_ns, config, fp8)
        b_kmajor = self.b_kmajor
        self.mx = mx
        m = world * ms
        self.scale_off = -(-m * k // 16) * 16
        if mx or fp8:  # bytes, as bf16 pairs (the simulated symmetric buffer is a bf16 tensor)
            self.rk = Ranks(world, 1, -(-(self.scale_off + m * (k // 32)) // 2), device)
            self.payloads = [torch.empty(ms, k, dtype=torch.float8_e4m3fn, device=device) for _ in range(world)]
            self.scales = [torch.empty(ms, k // 32, dtype=torch.uint8, device=device) for _ in range(world)]
            self.dequantized = [torch.empty(m, k, dtype=torch.bfloat16, device=device) for _ in range(world)]
        else:
            self.rk = Ranks(world, m, k, device)
        self.shards = [torch.empty(ms, k, dtype=torch.bfloat16, device=device) for _ in range(world)]
        self.bs = [rand(k, n, gen=self.gen, device=device) for _ in range(world)]
        self.w8 = []
        if fp8:  # the weight's fp8-block values: what the reference multiplies
            for b in self.bs:
                w8 = quant.quantize_fp8_block_ref(b.t().contiguous().cpu(), 128)
                self.w8.append((w8.payload.to(device), w8.scales.to(device)))
                b.copy_(quant.dequantize_fp8_block_ref(w8).t())
        self.b_store = [b.t().contiguous() if b_kmajor else b for b in self.bs]  # [N, K] weight for kmajor
        self.cs = [torch.empty(world * ms, n, dtype=torch.bfloat16, device=device) for _ in range(world)]

    def new_epoch_inputs(self):
        """Fresh data in the same buffers; outputs and the gathered buffers poisoned (NaN; 0xFF bytes for MX:
        an E4M3 NaN and the E8M0 NaN scale)."""
        for r, s in enumerate(self.shards):
            s.copy_(rand(self.ms, self.k, gen=self.gen))
            if self.mx:
                p, sc, vals = mx_inputs(s)
                self.payloads[r].copy_(p)
                self.scales[r].copy_(sc)
                s.copy_(vals)  # the shard's exact MX values: what the reference multiplies
            if self.fp8:  # fp32 scales [Ms, K/128] held as their bytes [Ms, K/32]
                t = quant.quantize_fp8_block_ref(s.cpu(), 1)
                self.payloads[r].copy_(t.payload)
                self.scales[r].copy_(t.scales.view(torch.uint8))
                s.copy_(quant.dequantize_fp8_block_ref(t))
        for c in self.cs:
            c.fill_(NAN)
        self.rk.poison()
        if self.mx or self.fp8:
            for d in self.rk.data:
                d.view(torch.uint8).fill_(0xFF)
            for d in self.dequantized:
                d.fill_(NAN)

    def gathered(self, r):
        """Rank r's gathered buffer: bf16 [M, K], or (payload [M, K], scales [M, K/32]) for MX."""
        m, k = self.world * self.ms, self.k
        if not (self.mx or self.fp8):
            return self.rk.data[r]
        raw = self.rk.data[r].view(-1).view(torch.uint8)
        return (raw[:m * k].view(torch.float8_e4m3fn).view(m, k),
                raw[self.scale_off:self.scale_off + m * (k // 32)].view(m, k // 32))

    def launch(self, r, epoch, timeout_ns=None, **pol):
        rk = self.rk
        kw = self._kw(r, epoch, timeout_ns, pol)
        if self.fp8:
            g_payload, g_scales = self.gathered(r) if self.world > 1 else (self.payloads[r], self.scales[r])
            sa, sg = self.scales[r].view(torch.float32), g_scales.view(torch.float32)
            ag.launch(self.payloads[r], self.w8[r][0], True, self.cs[r], g_payload, rk.peer_data, rk.peer_sig,
                      rk.sigs[r], rk.heads[r], rk.errors[r], scale_offset=self.scale_off,
                      fp8_scales=(sa, sg, self.w8[r][1]), **kw)
        elif self.mx:
            g_payload, g_scales = self.gathered(r) if self.world > 1 else (self.payloads[r], self.scales[r])
            ag.launch(self.payloads[r], self.b_store[r], self.b_kmajor, self.cs[r], g_payload, rk.peer_data,
                      rk.peer_sig, rk.sigs[r], rk.heads[r], rk.errors[r], a_scales=self.scales[r],
                      gather_scales=g_scales, scale_offset=self.scale_off, dequantized=self.dequantized[r], **kw)
        else:
            ag.launch(self.shards[r], self.b_store[r], self.b_kmajor, self.cs[r], rk.data[r], rk.peer_data,
                      rk.peer_sig, rk.sigs[r], rk.heads[r], rk.errors[r], **kw)

    def check_outputs(self, ranks=None, tol=TOL):
        full = torch.cat(self.shards)
        for r in (range(self.world) if ranks is None else ranks):
            _, ref = reference.all_gather_matmul_ref_local(self.shards, self.bs[r])
            err = reference.rel_err(self.cs[r], ref)
            assert err < tol, f"rank {r}: rel err {err}"
            if self.mx:  # every slot's rows expanded exactly
                assert torch.equal(self.dequantized[r], full), f"rank {r}: dequantized rows differ"
            if self.world > 1 and (self.mx or self.fp8):  # the payload and scale bytes arrive unchanged
                g_payload, g_scales = self.gathered(r)
                assert torch.equal(g_payload.view(torch.uint8), torch.cat(self.payloads).view(torch.uint8)), \
                    f"rank {r}: gathered payload differs"
                assert torch.equal(g_scales, torch.cat(self.scales)), f"rank {r}: gathered scales differ"
            elif self.world > 1:  # at W=1 the gathered buffer is unused (the op returns a_shard)
                assert torch.equal(self.rk.data[r], full), f"rank {r}: gathered rows differ"

    def check_flags(self, epoch):
        chunks = -(-self.ms // self.cfg.BM)
        for q in range(self.world):
            for s in range(self.world):
                got = self.rk.sigs[q][runtime.FLAG_BASE + s * chunks:runtime.FLAG_BASE + (s + 1) * chunks].tolist()
                assert got == [0 if s == q else epoch] * chunks, (q, s, got)

    def outputs(self):
        return [c.clone() for c in self.cs]


class RS(_Op):
    """GEMM+ReduceScatter: rank r holds a [M, K] and b [K, N] (its K shard); c_shard [Ms, N]. mx: a is MXFP8
    (the reference multiplies its dequantized values); fp8: a and the weight are fp8-block (the same)."""

    def __init__(self, world, ms, k, n, seed=0, b_kmajor=False, device="cpu", grid=3, timeout_ns=5_000_000,
                 config=None, mx=False, fp8=False):
        super().__init__(world, ms, k, n, seed, b_kmajor, device, grid, timeout_ns, config, fp8)
        self.mx = mx
        self.m = world * ms
        self.dequantized = [torch.empty(self.m, k, dtype=torch.bfloat16, device=device) for _ in range(world)]
        self.rk = Ranks(world, self.m, n, device)
        self.As = [torch.empty(self.m, k, dtype=torch.bfloat16, device=device) for _ in range(world)]
        self.Bs = [torch.empty(k, n, dtype=torch.bfloat16, device=device) for _ in range(world)]
        self.b_store = ([torch.empty(n, k, dtype=torch.bfloat16, device=device) for _ in range(world)]
                        if self.b_kmajor else self.Bs)
        self.cs = [torch.empty(ms, n, dtype=torch.bfloat16, device=device) for _ in range(world)]

    def new_epoch_inputs(self):
        self.mx_As, self.fp8_Bs = [], []
        for r in range(self.world):
            self.As[r].copy_(rand(self.m, self.k, gen=self.gen))
            if self.mx:
                p, sc, vals = mx_inputs(self.As[r])
                self.mx_As.append((p.to(self.device), sc.to(self.device)))
                self.As[r].copy_(vals)
            if self.fp8:  # the references multiply the dequantized values (exact in bf16)
                a8 = quant.quantize_fp8_block_ref(self.As[r].cpu(), 1)
                self.mx_As.append((a8.payload.to(self.device), a8.scales.to(self.device)))
                self.As[r].copy_(quant.dequantize_fp8_block_ref(a8))
            self.Bs[r].copy_(rand(self.k, self.n, gen=self.gen))
            if self.fp8:
                w8 = quant.quantize_fp8_block_ref(self.Bs[r].t().contiguous().cpu(), 128)
                self.fp8_Bs.append((w8.payload.to(self.device), w8.scales.to(self.device)))
                self.Bs[r].copy_(quant.dequantize_fp8_block_ref(w8).t())
            if self.b_kmajor:
                self.b_store[r].copy_(self.Bs[r].t())
            self.cs[r].fill_(NAN)
            self.dequantized[r].fill_(NAN)
        self.rk.poison()

    def launch(self, r, epoch, timeout_ns=None, **pol):
        rk = self.rk
        if self.fp8:
            (a, sa), (b, sb) = self.mx_As[r], self.fp8_Bs[r]
            rs.launch(a, b, True, self.cs[r], rk.data[r], rk.peer_data, rk.peer_sig, rk.sigs[r], rk.heads[r],
                      rk.errors[r], fp8_scales=(sa, sb), **self._kw(r, epoch, timeout_ns, pol))
            return
        a, a_scales = self.mx_As[r] if self.mx else (self.As[r], None)
        rs.launch(a, self.b_store[r], self.b_kmajor, self.cs[r], rk.data[r], rk.peer_data, rk.peer_sig,
                  rk.sigs[r], rk.heads[r], rk.errors[r], a_scales=a_scales,
                  dequantized=self.dequantized[r] if self.mx else None, **self._kw(r, epoch, timeout_ns, pol))

    def check_outputs(self, tol=TOL):
        if self.mx:  # a's rows expanded exactly
            for r in range(self.world):
                assert torch.equal(self.dequantized[r], self.As[r]), f"rank {r}: dequantized rows differ"
        refs = reference.matmul_reduce_scatter_ref_local(self.As, self.Bs)
        for r in range(self.world):
            err = reference.rel_err(self.cs[r], refs[r])
            assert err < tol, f"rank {r}: rel err {err}"
        if self.world > 1 and self.config is not None and self.config.push_partials:  # slot s of rank q's staging: source s's partial of q's rows
            for q in range(self.world):
                for s in range(self.world):
                    part = (self.As[s].float() @ self.Bs[s].float())[q * self.ms:(q + 1) * self.ms]
                    got = self.rk.data[q][s * self.ms:(s + 1) * self.ms]
                    assert reference.rel_err(got, part) < tol, (q, s)
        elif self.world > 1:  # each rank's staging holds its own bf16 partial products
            for r in range(self.world):
                part = (self.As[r].float() @ self.Bs[r].float())
                assert reference.rel_err(self.rk.data[r], part) < tol

    def check_flags(self, epoch):
        if self.world == 1:
            return
        tiles = -(-self.ms // self.cfg.BM) * -(-self.n // self.cfg.BN)
        for q in range(self.world):
            got = self.rk.sigs[q][runtime.FLAG_BASE:runtime.FLAG_BASE + self.world * tiles].tolist()
            assert got == [epoch] * (self.world * tiles), (q, got)

    def outputs(self):
        return [c.clone() for c in self.cs]


class MoERanks:
    """The one-launch MoE layer on W simulated ranks: rank r holds T tokens and experts [r*El, (r+1)*El)."""

    def __init__(self, world, tokens, hidden, ffn, experts, top_k, seed=0, route_kw=None, skew=False,
                 device="cpu", grid=3, timeout_ns=5_000_000, tol=2e-2, config=None, mx=False, nk=False):
        """``nk``: the experts' weights in transformers' layout (gate_up [El, 2F, H], down [El, H, F]), passed
        as their .transpose(1, 2) views; the same values as with nk=False for the same seed. ``route_kw``
        routing="given": no router -- ``new_inputs`` also draws each rank's decision (``given[r]``: weights [T, k]
        fp32 in (0.1, 1), k distinct experts per token), which ``launch`` puts into the routing buffers (a test
        may set ``given`` itself after new_inputs)."""
        self.world, self.t, self.h, self.f, self.e, self.k = world, tokens, hidden, ffn, experts, top_k
        self.mx = mx  # MXFP8: weights hold their MX values, x is quantized per call, the reference is MX math
        self.device, self.grid, self.timeout_ns, self.tol = device, grid, timeout_ns, tol
        self.el = experts // world
        self.route_kw = dict(route_kw or {})
        self.cfg = planning.moe_config(config, mx=mx)
        self.lay = mf.Layout(world, tokens, hidden, ffn, top_k, self.el, self.cfg)
        self.gen = torch.Generator().manual_seed(seed)
        self.skew = skew
        router = rand(experts, hidden, gen=self.gen, scale=0.5)
        if skew:  # feature 0 of every token is 1: experts 0..k-1 win every token
            router[:, 0] = -8.0
            for j in range(top_k):
                router[j, 0] = 8.0 - j
        self.router = router.to(device)
        self.w13 = [rand(self.el, hidden, 2 * ffn, gen=self.gen, device=device, scale=hidden ** -0.5)
                    for _ in range(world)]
        self.w2 = [rand(self.el, ffn, hidden, gen=self.gen, device=device, scale=ffn ** -0.5) for _ in range(world)]
        if mx:
            self.w13 = [quant.mx_values(w, dim=1) for w in self.w13]
            self.w2 = [quant.mx_values(w, dim=1) for w in self.w2]
        if nk:
            self.w13 = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in self.w13]
            self.w2 = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in self.w2]
        bias = self.route_kw.get("bias")
        if bias is not None:
            self.route_kw["bias"] = bias.to(device)
        self.bias32 = self.route_kw["bias"].float().contiguous() if bias is not None else None
        self.data = [torch.empty(self.lay.data_bytes, dtype=torch.uint8, device=device) for _ in range(world)]
        self.epochs = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(world)]
        self.sig = [torch.zeros(4096, dtype=torch.int32, device=device) for _ in range(world)]
        self.ctr = [torch.zeros(max(64, self.lay.fold_blocks), dtype=torch.int32, device=device)
                    for _ in range(world)]
        tbl = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)  # noqa: E731
        self.peer_data, self.peer_sig, self.peer_ctr = tbl(self.data), tbl(self.sig), tbl(self.ctr)
        self.local = [dict(
            topk_w=torch.zeros(tokens * top_k, dtype=torch.float32, device=device),
            topk_e=torch.zeros(tokens * top_k, dtype=torch.int32, device=device),
            xe=torch.empty(self.lay.max_rows * hidden, dtype=torch.bfloat16, device=device),
            xe_meta=torch.zeros(self.lay.max_rows * 3, dtype=torch.int32, device=device),
            hb=torch.empty(self.lay.max_rows * ffn, dtype=torch.bfloat16, device=device),
            plan=torch.zeros(self.lay.plan_n, dtype=torch.int32, device=device),
            scratch=torch.zeros(self.lay.scratch_n, dtype=torch.int32, device=device),
            errors=torch.zeros(runtime.ERR_SLOTS, dtype=torch.int64, device=device)) for _ in range(world)]
        self.xs = [None] * world
        self.ys = [torch.empty(tokens, hidden, dtype=torch.bfloat16, device=device) for _ in range(world)]
        self.given = [None] * world

    def new_inputs(self):
        for r in range(self.world):
            x = rand(self.t, self.h, gen=self.gen)
            if self.skew:
                x[:, 0] = 1.0
            if self.xs[r] is None:
                self.xs[r] = x.to(self.device)
            else:  # into the same buffer: a captured CUDA graph keeps reading it
                self.xs[r].copy_(x)
            self.ys[r].fill_(float("nan"))
            if self.route_kw.get("routing") == moe_reference.GIVEN:
                ex = torch.stack([torch.randperm(self.e, generator=self.gen)[:self.k] for _ in range(self.t)])
                w = torch.rand(self.t, self.k, generator=self.gen) * 0.9 + 0.1
                self.given[r] = (w.to(self.device), ex.to(self.device))
                self.local[r]["topk_w"].fill_(float("nan"))  # the launch must load this call's decision
                self.local[r]["topk_e"].fill_(-1)
            self.data[r].fill_(0xFF)  # bf16 NaN / int32 -1 everywhere
            self.local[r]["xe"].fill_(float("nan"))
            self.local[r]["hb"].fill_(float("nan"))

    def bufs(self, r):
        b = dict(self.local[r])
        b.update(data=self.data[r], sig=self.sig[r], ctr=self.ctr[r], peer_data=self.peer_data,
                 peer_sig=self.peer_sig, peer_ctr=self.peer_ctr, layout=self.lay)
        return b

    def launch(self, r, epoch, stages=mf.ALL_STAGES, **pol):
        """Rank r's launch (of ``stages``) at ``epoch`` (the slot set to epoch - 1 first; None: the device
        epoch)."""
        kw = {k: v for k, v in self.route_kw.items() if k != "bias"}
        if epoch is not None:
            self.epochs[r].fill_(epoch - 1)
        given = kw.get("routing") == moe_reference.GIVEN
        if given and stages & ROUTE_ONLY:  # as moe_forward does: the decision into the routing buffers
            mf._put_given(self.local[r], *self.given[r])
        mf.launch(self.xs[r], None if given else self.router, self.bias32, self.w13[r], self.w2[r], self.ys[r],
                  self.bufs(r), rank=r, world=self.world, epoch_slot=self.epochs[r], timeout_ns=self.timeout_ns,
                  grid=self.grid, cfg=self.cfg, top_k=self.k, stages=stages,
                  x_mx=quant.to_mx(self.xs[r]) if self.mx else None, **kw, **pol)

    def call(self, epoch, streams=None, **pol):
        """One call on every rank (``epoch`` None: at the device epochs): CPU -- at W > 1 split into three
        launches per rank by stage mask (ROUTE on every rank, then PERMUTE..GEMM2, then FOLD), so that no
        sequential program waits on an unstarted rank; GPU -- every rank's whole launch at once
        (``launch_all``)."""
        if self.world == 1:
            self.launch(0, epoch, **pol)
        elif torch.device(self.device).type == "cuda":
            return launch_all(self.world, lambda r: self.launch(r, epoch, **pol), streams)
        else:
            for stages in (ROUTE_ONLY, MIDDLE, FOLD_ONLY):
                for r in range(self.world):
                    self.launch(r, epoch, stages, **pol)

    def routing(self, r):
        w = self.local[r]["topk_w"].view(self.t, self.k)
        e = self.local[r]["topk_e"].view(self.t, self.k).long()
        return w, e

    def reference_routing(self, r):
        """The decision the kernel must have used on rank r: the reference router's, or the given one."""
        if self.route_kw.get("routing") == moe_reference.GIVEN:
            w, e = self.given[r]
            return w.float(), e.long()
        return moe_reference.route(self.xs[r], self.router, self.k, **self.route_kw)

    def check(self, epoch):
        w13 = torch.cat([w.float() for w in self.w13])
        w2 = torch.cat([w.float() for w in self.w2])
        for r in range(self.world):
            errs = self.local[r]["errors"].tolist()
            assert errs == [0] * runtime.ERR_SLOTS, f"rank {r}: {runtime.decode_error(errs)}"
            w_k, e_k = self.routing(r)
            w_ref, e_ref = self.reference_routing(r)
            assert torch.equal(e_k, e_ref), f"rank {r}: experts differ from the reference router"
            assert torch.allclose(w_k, w_ref, rtol=1e-4, atol=1e-6), f"rank {r}: weights differ"
            if self.mx:
                y_ref = torch.zeros(self.t, self.h, device=self.xs[r].device)
                for j in range(self.k):
                    for ex in e_k[:, j].unique().tolist():
                        sel = (e_k[:, j] == ex).nonzero(as_tuple=True)[0]
                        y_ref[sel] += w_k[sel, j, None] * moe_reference.expert_ffn_mx(
                            self.xs[r][sel], self.w13[ex // self.el][ex % self.el], self.w2[ex // self.el][ex % self.el])
            else:
                y_ref = moe_reference.apply_routing_ref(self.xs[r], w_k, e_k, w13, w2)
            assert not torch.isnan(self.ys[r]).any(), f"rank {r}: output rows left unwritten"
            err = ((self.ys[r].float() - y_ref).norm() / y_ref.norm()).item()
            assert err < self.tol, f"rank {r}: rel err {err}"
            assert self.local[r]["scratch"].abs().sum().item() == 0, f"rank {r}: scratch not reset"
            assert self.ctr[r].abs().sum().item() == 0, f"rank {r}: fold counters not reset"
            done = self.sig[r][runtime.DONE_BASE:runtime.DONE_BASE + self.world].tolist()
            assert done == [epoch if self.world > 1 else 0] * self.world, f"rank {r}: done flags {done}"


def placed_gate_up(xs, w13, experts, top_k, gen=None, rank=0, world=1):
    """A stand-in forward's g | u as ``moe_forward(save_gu=True)`` keeps it on ``rank`` (for CPU tests that fake
    the forward): for each of the rank's local experts, every source rank's rows in rank order, shuffled inside a
    source as the kernel's atomics may place them, in fp32 then rounded to bf16 once; a moe_forward.SavedGateUp.
    ``xs`` / ``experts``: every rank's tokens and decisions (a tensor each at W = 1); ``w13`` all E experts; the
    token stride is the largest rank's token count."""
    xs, experts = ([xs], [experts]) if world == 1 and torch.is_tensor(xs) else (xs, experts)
    local = w13.shape[0] // world
    rows, meta = [], []
    for ex in range(rank * local, (rank + 1) * local):
        for s in range(world):
            pairs = (experts[s].reshape(-1) == ex).nonzero(as_tuple=True)[0]
            for p in pairs[torch.randperm(pairs.numel(), generator=gen)].tolist():
                rows.append(xs[s][p // top_k].float() @ w13[ex].float())
                meta.append((s, p // top_k, p % top_k))
    gu = torch.stack(rows).to(torch.bfloat16) if rows else torch.zeros((0, w13.shape[2]), dtype=torch.bfloat16)
    return mf.SavedGateUp(gu, torch.tensor(meta, dtype=torch.int32).reshape(-1, 3), max(x.shape[0] for x in xs),
                          top_k, world)


class MoEBwdRanks:
    """The MoE layer's backward in one launch at W simulated ranks (moe_backward.expert_backward_ep_launch): rank
    r holds T tokens with their output gradient and routing decision, and experts [r*El, (r+1)*El). Every rank's
    symmetric bytes, signals and counters live on one device, reached through the peer tables; the local buffers
    start poisoned (NaN / -1: a row the launch reads without writing it this call shows). ``policy`` /
    ``comm_programs``: the launch's (the fixed-role ablation: "fixed", S)."""

    def __init__(self, world, tokens, hidden, ffn, experts, top_k, seed=0, device="cpu", grid=3,
                 timeout_ns=5_000_000, routing="softmax", skew=False, empty_expert=None, router=True,
                 wgrad_dtype=torch.bfloat16, policy="self", comm_programs=None, nk=False):
        """``nk``: each rank's expert weights in transformers' layout (passed as .transpose(1, 2) views of
        contiguous [El, 2F, H] / [El, H, F]), the same values as with nk=False."""
        self.policy, self.comm_programs = policy, comm_programs
        self.world, self.t, self.h, self.f, self.e, self.k = world, tokens, hidden, ffn, experts, top_k
        self.el = experts // world
        self.device, self.grid, self.timeout_ns, self.routing = device, grid, timeout_ns, routing
        self.router, self.wgrad_dtype = router, wgrad_dtype
        gen = torch.Generator().manual_seed(seed)
        self.wr = rand(experts, hidden, gen=gen, scale=0.5).to(device)
        self.w13_all = rand(experts, hidden, 2 * ffn, gen=gen, scale=hidden ** -0.5).to(device)
        self.w2_all = rand(experts, ffn, hidden, gen=gen, scale=ffn ** -0.5).to(device)
        self.w13 = [self.w13_all[r * self.el:(r + 1) * self.el].contiguous() for r in range(world)]
        self.w2 = [self.w2_all[r * self.el:(r + 1) * self.el].contiguous() for r in range(world)]
        if nk:
            self.w13 = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in self.w13]
            self.w2 = [w.transpose(1, 2).contiguous().transpose(1, 2) for w in self.w2]
        allowed = torch.tensor([x for x in range(experts) if x != empty_expert])
        self.xs, self.dys, self.experts, self.weights = [], [], [], []
        for _ in range(world):
            x = rand(tokens, hidden, gen=gen)
            if skew:  # every token to the first k experts (rank 0's): the other experts get no rows
                ex = torch.arange(top_k).repeat(tokens, 1)
            else:
                ex = allowed[torch.stack([torch.randperm(len(allowed), generator=gen)[:top_k] for _ in range(tokens)])]
            w, _, _ = moe_reference.routing_weights_ref(x.float() @ self.wr.float().cpu().t(), ex, routing,
                                                        routed_scaling=2.5 if routing != "softmax" else 1.0)
            self.xs.append(x.to(device))
            self.dys.append(rand(tokens, hidden, gen=gen).to(device))
            self.experts.append(ex.to(device))
            self.weights.append(w.to(device))
        self.rkw = dict(routing=routing, routed_scaling=2.5 if routing != "softmax" else 1.0)
        self.lay = bwd_layout.ep_layout(world, tokens, hidden, ffn, top_k, self.el, wgrad_dtype)
        self.data = [torch.empty(self.lay.data_bytes, dtype=torch.uint8, device=device) for _ in range(world)]
        self.sig = [torch.zeros(4096, dtype=torch.int32, device=device) for _ in range(world)]
        self.ctr = [torch.zeros(max(64, self.lay.fold_blocks), dtype=torch.int32, device=device) for _ in range(world)]
        self.epochs = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(world)]
        self.errors = [torch.zeros(runtime.ERR_SLOTS, dtype=torch.int64, device=device) for _ in range(world)]
        tbl = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)  # noqa: E731
        self.peer_data, self.peer_sig, self.peer_ctr = tbl(self.data), tbl(self.sig), tbl(self.ctr)
        alloc = lambda name, n, dtype: torch.empty(max(n, 1), dtype=dtype, device=device)  # noqa: E731
        self.local = [bwd_layout.ep_local_buffers(alloc, self.lay, hidden, ffn, top_k, tokens, self.el, world)
                      for _ in range(world)]
        for b in self.local:
            b["scratch"] = torch.zeros(int(bwd_layout.SCB_MTILES.value) + 4 * self.lay.max_mtiles + 64 + self.el + tokens,
                                       dtype=torch.int32, device=device)
        self.outs = [None] * world
        self.poison()

    def poison(self):
        """NaN / -1 in every rank's symmetric bytes and local buffers (not the scratch: the launch keeps it zero)."""
        for r in range(self.world):
            self.data[r].fill_(0xFF)
            for name, t in self.local[r].items():
                if name != "scratch":
                    t.fill_(float("nan") if t.is_floating_point() else -1)

    def bufs(self, r):
        b = dict(self.local[r])
        b.update(layout=self.lay, data=self.data[r], sig=self.sig[r], ctr=self.ctr[r], peer_data=self.peer_data,
                 peer_sig=self.peer_sig, peer_ctr=self.peer_ctr, errors=self.errors[r])
        return b

    def router_inputs(self, r):
        return bwd_router.RouterBackward(self.xs[r], self.wr, bwd_api.bf16_mm_fp32(self.xs[r], self.wr.t()),
                                         self.experts[r], self.routing, True,
                                         self.rkw["routed_scaling"]) if self.router else None

    def launch(self, r, epoch, stages=None, final=True, timeout_ns=None):
        """Rank r's launch of ``stages`` (None: all) at ``epoch`` (the slot set to epoch - 1 first; None: the device
        epoch); ``final``: it ends the call."""
        if epoch is not None:
            self.epochs[r].fill_(epoch - 1)
        first = stages is None or (stages & (1 << bwd_layout.BWD_COMBINE)) != 0 or self.outs[r] is None  # a call's first
        outs = None if first else self.outs[r]
        got = bwd_one.expert_backward_ep_launch(
            self.xs[r], self.dys[r], self.weights[r], self.experts[r], self.w13[r], self.w2[r], self.bufs(r), rank=r,
            world=self.world, epoch_slot=self.epochs[r],
            timeout_ns=self.timeout_ns if timeout_ns is None else timeout_ns, grid=self.grid,
            out_dtype=self.wgrad_dtype, router=self.router_inputs(r),
            stages=bwd_layout.BWD_ALL_STAGES if stages is None else stages, final=final, outs=outs, policy=self.policy,
            comm_programs=self.comm_programs)
        self.outs[r] = got[-1]
        self.results = getattr(self, "results", [None] * self.world)
        self.results[r] = got[:-1]

    def call(self, epoch, streams=None, skip=(), leave_out=None):
        """One call on every rank: CPU -- the three phases (bwd_layout.EP_PHASES; the fixed policy's four,
        bwd_layout.EP_PHASES_FIXED), every rank's launch of a phase before any rank's next one, only the last one final;
        GPU -- every rank's whole launch at once (launch_all). ``skip``: ranks whose launches are left out (a
        stalled peer); ``leave_out``: a stage (moe_backward.layout.BWD_*) left out of every launch."""
        drop = ~(1 << leave_out) if leave_out is not None else -1
        if torch.device(self.device).type == "cuda":
            return launch_all(self.world, lambda r: None if r in skip else self.launch(
                r, epoch, bwd_layout.BWD_ALL_STAGES & drop), streams)
        phases = bwd_layout.EP_PHASES_FIXED if self.policy == "fixed" else bwd_layout.EP_PHASES
        for i, stages in enumerate(phases):
            for r in range(self.world):
                if r not in skip:
                    self.launch(r, epoch, stages & drop, final=i == len(phases) - 1)

    def gradients(self):
        """Per rank (dx, d_router, dw13, dw2) -- dx_e and the gate gradients without the router in the launch --
        and the dweights [T, k]."""
        return [(res[0], res[4] if self.router else None, res[2], res[3]) for res in self.results], \
            [res[1] for res in self.results]

    def reference(self):
        """moe_reference.moe_backward_ref over every rank's tokens with every expert in one process: (dx per rank,
        d_router summed, dw13 and dw2 per rank)."""
        x = torch.cat([t.cpu() for t in self.xs])
        dy = torch.cat([t.cpu() for t in self.dys])
        ex = torch.cat([t.cpu() for t in self.experts])
        kw = dict(routing=self.routing) if self.routing == "softmax" else dict(routing=self.routing,
                                                                               routed_scaling=2.5)
        dx, dr, dw13, dw2 = moe_reference.moe_backward_ref(x, self.wr.cpu(), self.w13_all.cpu(), self.w2_all.cpu(),
                                                           dy, top_k=self.k, experts=ex, **kw)
        t, el = self.t, self.el
        ranks = range(self.world)
        return ([dx[r * t:(r + 1) * t] for r in ranks], dr, [dw13[r * el:(r + 1) * el] for r in ranks],
                [dw2[r * el:(r + 1) * el] for r in ranks])
