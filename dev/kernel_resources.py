"""Registers, spills and shared memory of the fused kernels as Triton compiles them for sm_90a (a developer
script; nothing runs). Works on the GPU box (Triton 3.6 there) and on a CPU-only machine (Triton's compiler and
ptxas need no GPU: a stand-in driver reports an sm_90 target):

    PYTHONPATH=. python -m dev.kernel_resources [--world 1,2,8] [--json OUT.json]

Each kernel is compiled (``JITFunction.warmup``) exactly as its ``launch`` would launch it for rank 0 of a
llama3-70b-like TP shape (AllGather+GEMM qkv, GEMM+RS attn-out) or a deepseek-v3-like MoE layer, with the
default configs, self policy; the figures are ptxas's (``cuobjdump --dump-resource-usage`` of the cubin);
``loops``: the scf.for ops in the TTGIR (a flattened loop nest is one).
Spills in the fused kernels cost GEMM speed, so check them here before timing a change.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch


def _use_stand_in_driver() -> None:
    """Let Triton compile for sm_90a where no GPU is visible (CPU tensors stand in for device ones)."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    class _Sm90:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

        def is_active(self):
            return True

    driver.set_active(_Sm90())


class _CompileOnly:
    """Stands in for a @triton.jit kernel inside a module's ``launch``: ``kernel[grid](...)`` compiles."""

    def __init__(self, fn):
        self.fn, self.compiled = fn, None

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.compiled = self.fn.warmup(*args, grid=grid, **kw)
        return run


def _resources(compiled) -> dict:
    """regs / spill bytes / stack / shared KiB, from ptxas -v on the kernel's PTX (no device needed)."""
    import triton
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    tools = [t for t in (shutil.which("ptxas"), os.path.join(bundled, "ptxas-blackwell"),
                         os.path.join(bundled, "ptxas")) if t and os.path.exists(t)]
    with tempfile.TemporaryDirectory() as d:
        ptx = os.path.join(d, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        for tool in tools:  # the first ptxas that knows this PTX version
            run = subprocess.run([tool, "-v", "-arch=sm_90a", ptx, "-o", os.path.join(d, "k.cubin")],
                                 capture_output=True, text=True)
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(f"no ptxas among {tools} assembles this PTX: {run.stderr.strip()[:200]}")
    text = run.stderr + run.stdout
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, text)) else None  # noqa: E731
    return {"regs": num(r"Used (\d+) registers"), "spill_bytes": num(r"(\d+) bytes spill stores"),
            "stack_bytes": num(r"(\d+) bytes stack frame"), "shared_kib": round(compiled.metadata.shared / 1024, 1),
            "ttgir_loops": len(re.findall(r"\bscf\.for\b", compiled.asm.get("ttgir", "")))}


def _compile(module, kernel_name: str, call) -> dict:
    original = getattr(module, kernel_name)
    stub = _CompileOnly(original)
    setattr(module, kernel_name, stub)
    try:
        call()
    finally:
        setattr(module, kernel_name, original)
    return _resources(stub.compiled)


KERNELS = ("all_gather_matmul", "matmul_reduce_scatter", "w1_matmul", "moe_forward", "moe_backward")


def _backward_modules() -> tuple:
    """The MoE backward's modules that hold kernels or launch them (kosmos/ops/moe_backward/)."""
    from kosmos.ops.moe_backward import api, multi_launch, one_launch, rows, tiles
    return (api, multi_launch, one_launch, rows, tiles)


def _compile_among(modules, kernel_name: str, call) -> dict:
    """``_compile`` where ``call`` launches several kernels of ``modules`` (a module or a tuple): every one of them
    compiles only, and each module's COMPILE_ONLY flag (where it has one) is set meanwhile."""
    import triton
    modules = modules if isinstance(modules, tuple) else (modules,)
    originals = {(m, n): v for m in modules for n, v in vars(m).items()
                 if isinstance(v, triton.runtime.JITFunction) and n.endswith("_kernel")}
    flagged = [m for m in modules if hasattr(m, "COMPILE_ONLY")]
    stubs = {key: _CompileOnly(f) for key, f in originals.items()}
    for m in flagged:
        m.COMPILE_ONLY = True
    for (m, n), st in stubs.items():
        setattr(m, n, st)
    try:
        call()
    finally:
        for m in flagged:
            m.COMPILE_ONLY = False
        for (m, n), f in originals.items():
            setattr(m, n, f)
    compiled = [st.compiled for (m, n), st in stubs.items() if n == kernel_name and st.compiled is not None]
    return _resources(compiled[0])


def w1_matmul_kernels(dev, m: int = 1024, n: int = 3072, k: int = 8192) -> list:
    """(name, resources) of kernels/common.w1_matmul_kernel as planning.w1_plan's schedules launch it:
    unsplit (128x256), the K split (128x128, 2 parts), stream-K (128x256 and 128x128) and the tail tiles
    (128 + 64 and 128 + 32 columns), on one shape; and its fp8-block (SCALED) mainloop unsplit, split in 2 and
    stream-K on planning.fp8_block_plan's tile."""
    from kosmos.core import planning
    from kosmos.gemm import w1_static
    bf = dict(dtype=torch.bfloat16, device=dev)
    a, b, c = torch.empty(m, k, **bf), torch.empty(k, n, **bf), torch.empty(m, n, **bf)
    small = lambda n_, dt: torch.zeros(n_, dtype=dt, device=dev)  # noqa: E731
    parts = torch.empty(132 * 128 * 256, dtype=torch.float32, device=dev)
    out = []
    t128 = planning.TileConfig(128, 128, 64, 8, 4)
    for name, cfg, split, sk, tail in (("w1_matmul unsplit", planning.TileConfig(128, 256, 64, 8, 3), 1, False, 0),
                                       ("w1_matmul split 2", planning.SPLIT_TILE, 2, False, 0),
                                       ("w1_matmul stream-k", planning.TileConfig(128, 256, 64, 8, 3), 1, True, 0),
                                       ("w1_matmul stream-k 128", planning.TileConfig(128, 128, 64, 4, 4), 1, True, 0),
                                       ("w1_matmul tail 192", t128, 1, False, 64),
                                       ("w1_matmul tail 160", t128, 1, False, 32)):
        grid, args, kw = w1_static.w1_matmul_args(a, b, False, c, cfg, small(4, torch.int32), 132, planning.GROUP_M, False,
                                           split=split, partials=parts, counters=small(4096, torch.int32),
                                           errors=small(16, torch.int64), timeout_ns=10**9, stream_k=sk, tail=tail)
        out.append((name, _resources(w1_static.w1_matmul_kernel.warmup(*args, grid=(grid,), **kw))))
    if not hasattr(planning, "FP8_BLOCK_TILE"):  # an older tree (dev/regs_variants.py): no fp8-block mainloop
        return out
    # fp8-block (SCALED): E4M3 A and k-major B [N, K], fp32 scales, planning.FP8_BLOCK_TILE
    a8, b8 = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=dev), torch.empty(n, k, dtype=torch.float8_e4m3fn,
                                                                                    device=dev)
    scales = (torch.empty(m, k // 128, dtype=torch.float32, device=dev),
              torch.empty(-(-n // 128), k // 128, dtype=torch.float32, device=dev))
    for name, split, sk in (("w1_matmul fp8-block", 1, False), ("w1_matmul fp8-block split 2", 2, False),
                            ("w1_matmul fp8-block stream-k", 1, True)):
        grid, args, kw = w1_static.w1_matmul_args(a8, b8, True, c, planning.FP8_BLOCK_TILE, small(4, torch.int32), 132,
                                                  planning.GROUP_M, False, split=split, partials=parts,
                                                  counters=small(4096, torch.int32), errors=small(16, torch.int64),
                                                  timeout_ns=10**9, stream_k=sk, scales=scales)
        out.append((name, _resources(w1_static.w1_matmul_kernel.warmup(*args, grid=(grid,), **kw))))
    return out


def moe_backward_ep_kernels(dev, world: int, h: int = 4096, f: int = 1536, e: int = 128, tokens: int = 1024) -> list:
    """(name, resources) of the one launch at W > 1 (moe_backward.expert_backward_ep_launch: the exchanges as its
    stages) on a qwen3-235b-like layer (E / W local experts, top-8), bf16 and fp32 weight gradients, with the router
    backward in the launch (softmax) and without; rank 0; each also in its fixed-role build (policy "fixed", S = 16
    of the 132 programs: the bench's fixed-role default)."""
    from kosmos.ops.moe_backward import layout as bwd_layout, multi_launch as bwd_multi, one_launch as bwd_one, router as bwd_router, rows as bwd_rows, tiles as bwd_tiles
    bf = dict(dtype=torch.bfloat16, device=dev)
    el, k = e // world, 8
    lay = bwd_layout.ep_layout(world, tokens, h, f, k, el)
    alloc = lambda name, n, dt: torch.empty(max(n, 1), dtype=dt, device=dev)  # noqa: E731
    bufs = bwd_layout.ep_local_buffers(alloc, lay, h, f, k, tokens, el, world)
    i64 = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
    bufs.update(layout=lay, data=torch.empty(lay.data_bytes, dtype=torch.uint8, device=dev),
                sig=torch.zeros(4096, dtype=torch.int32, device=dev),
                ctr=torch.zeros(4096, dtype=torch.int32, device=dev),
                peer_data=i64(world), peer_sig=i64(world), peer_ctr=i64(world), errors=i64(16),
                scratch=torch.zeros(1 << 20, dtype=torch.int32, device=dev))
    x, dy = torch.empty(tokens, h, **bf), torch.empty(tokens, h, **bf)
    experts = (torch.arange(tokens * k, device=dev) % e).view(tokens, k)
    weights = torch.empty(tokens, k, dtype=torch.float32, device=dev)
    w13, w2 = torch.empty(el, h, 2 * f, **bf), torch.empty(el, f, h, **bf)
    router = bwd_router.RouterBackward(x, torch.empty(e, h, **bf), torch.empty(tokens, e, dtype=torch.float32, device=dev),
                               experts, "softmax", True, 1.0)
    out = []
    for pol, pkw in (("", {}), ("fixed ", dict(policy="fixed", comm_programs=16))):
        for name, dt, rt in (("bf16", torch.bfloat16, None), ("fp32", torch.float32, None),
                             ("+router softmax", torch.bfloat16, router)):
            out.append((f"moe_bwd one_launch ep {pol}{name}", _compile_among(
                _backward_modules(), "_moe_backward_experts_kernel", lambda dt=dt, rt=rt, pkw=pkw: bwd_one.expert_backward_ep_launch(
                    x, dy, weights, experts, w13, w2, bufs, rank=0, world=world,
                    epoch_slot=torch.zeros(1, dtype=torch.int32, device=dev), timeout_ns=10**9, grid=132,
                    out_dtype=dt, router=rt, **pkw))))
    w13_nk, w2_nk = torch.empty(el, 2 * f, h, **bf).transpose(1, 2), torch.empty(el, h, f, **bf).transpose(1, 2)
    out.append(("moe_bwd one_launch ep nk +router softmax", _compile_among(
        _backward_modules(), "_moe_backward_experts_kernel", lambda: bwd_one.expert_backward_ep_launch(
            x, dy, weights, experts, w13_nk, w2_nk, bufs, rank=0, world=world,
            epoch_slot=torch.zeros(1, dtype=torch.int32, device=dev), timeout_ns=10**9, grid=132,
            out_dtype=torch.bfloat16, router=router))))
    return out


def moe_backward_kernels(dev, h: int = 4096, f: int = 1536, e: int = 128, rows: int = 32768) -> list:
    """(name, resources) of the W=1 MoE backward's Triton kernels (kosmos/kernels/moe_backward.py) at their GPU
    tiles, on a qwen3-235b-like layer (H 4096, F 1536, 128 experts, 4096 tokens x top-8 rows), each compiled as
    its launcher launches it."""
    from kosmos.ops.moe_backward import layout as bwd_layout, multi_launch as bwd_multi, one_launch as bwd_one, router as bwd_router, rows as bwd_rows, tiles as bwd_tiles
    bf = dict(dtype=torch.bfloat16, device=dev)
    counts = torch.full((e,), rows // e, dtype=torch.int32, device=dev)
    x_rows, dy_rows, gu = torch.empty(rows, h, **bf), torch.empty(rows, h, **bf), torch.empty(rows, 2 * f, **bf)
    w13, w2 = torch.empty(e, h, 2 * f, **bf), torch.empty(e, f, h, **bf)
    w_pair = torch.empty(rows, dtype=torch.float32, device=dev)
    rows_pad = bwd_layout.padded_rows_bound(rows, e)  # the flat wgrad's padded row layout (expert_weight_grads_padded)
    x_pad, gu_pad = torch.empty(rows_pad, h, **bf), torch.empty(rows_pad, 2 * f, **bf)
    pad_offs = bwd_layout.padded_row_offsets(counts)
    out = [("moe_bwd wgrad bf16", _compile_among(_backward_modules(), "_expert_wgrad_kernel",
                                           lambda: bwd_multi.expert_weight_grads(x_rows, gu, counts, kernel="tiles"))),
           ("moe_bwd wgrad fp32", _compile_among(_backward_modules(), "_expert_wgrad_kernel", lambda: bwd_multi.expert_weight_grads(
               x_rows, gu, counts, out_dtype=torch.float32, kernel="tiles"))),
           ("moe_bwd wgrad-pers bf16", _compile_among(_backward_modules(), "_expert_wgrad_persistent_kernel", lambda: (
               bwd_multi.expert_weight_grads(x_rows, gu, counts, kernel="persistent")))),
           ("moe_bwd wgrad-pers fp32", _compile_among(_backward_modules(), "_expert_wgrad_persistent_kernel", lambda: (
               bwd_multi.expert_weight_grads(x_rows, gu, counts, out_dtype=torch.float32, kernel="persistent")))),
           ("moe_bwd wgrad-pers few-rows", _compile_among(_backward_modules(), "_expert_wgrad_persistent_kernel", lambda: (
               bwd_multi.expert_weight_grads(x_rows, gu, counts, kernel="persistent", tiles=bwd_multi.WGRAD2_FEW_ROWS_TILES)))),
           *[(f"moe_bwd wgrad-flat {name}", _compile_among(_backward_modules(), "_expert_wgrad_flat_kernel", lambda t=t, dt=dt: (
               bwd_multi.expert_weight_grads_padded(x_pad, gu_pad, counts, pad_offs, out_dtype=dt, tiles=t))))
             for name, t, dt in (("bf16", None, torch.bfloat16), ("fp32", None, torch.float32),
                                 ("s3", (128, 128, 64, 8, 3), torch.bfloat16),
                                 ("4w s2", (128, 128, 64, 4, 2), torch.bfloat16),
                                 ("128x128 s2", (128, 128, 64, 8, 2), torch.bfloat16),
                                 ("256x128 s3", bwd_tiles.WGRAD_FLAT_TILES_TALL, torch.bfloat16))],
           ("moe_bwd dgrad2_swiglu", _compile_among(_backward_modules(), "_dgrad2_swiglu_kernel",
                                              lambda: bwd_multi.expert_dgrad2_swiglu(dy_rows, gu, w2, w_pair, counts,
                                                                              fused=True))),
           ("moe_bwd dgrad2_swiglu+h", _compile_among(_backward_modules(), "_dgrad2_swiglu_kernel", lambda: bwd_multi.expert_dgrad2_swiglu(
               dy_rows, gu, w2, w_pair, counts, emit_h=True, fused=True))),
           ("moe_bwd dgrad1", _compile_among(_backward_modules(), "_dgrad1_kernel", lambda: bwd_multi.expert_dgrad1(gu, w13, counts))),
           ("moe_bwd swiglu_backward+h", _compile_among(_backward_modules(), "_swiglu_backward_kernel", lambda: bwd_multi.expert_dgrad2_swiglu(
               dy_rows, gu, w2, w_pair, counts, emit_h=True, fused=False))),
           ("moe_bwd swiglu_backward padded", _compile_among(_backward_modules(), "_swiglu_backward_kernel", lambda: (
               bwd_multi.expert_dgrad2_swiglu(x_pad, gu_pad, w2, torch.empty(rows_pad, device=dev), counts, emit_h=True,
                                       fused=False, offs=pad_offs,
                                       valid=torch.ones(rows_pad, dtype=torch.bool, device=dev)))))]
    w13_nk, w2_nk = torch.empty(e, 2 * f, h, **bf).transpose(1, 2), torch.empty(e, h, f, **bf).transpose(1, 2)
    out += [("moe_bwd dgrad2_swiglu nk", _compile_among(_backward_modules(), "_dgrad2_swiglu_kernel",
                                                      lambda: bwd_multi.expert_dgrad2_swiglu(dy_rows, gu, w2_nk, w_pair,
                                                                                             counts, fused=True))),
            ("moe_bwd dgrad1 nk", _compile_among(_backward_modules(), "_dgrad1_kernel",
                                               lambda: bwd_multi.expert_dgrad1(gu, w13_nk, counts)))]
    tok = torch.zeros(rows, dtype=torch.int64, device=dev)
    out += [("moe_bwd sum_partials", _compile_among(_backward_modules(), "_sum_partials_kernel", lambda: bwd_rows.sum_partials(
                torch.empty(rows, f // 64, dtype=torch.float32, device=dev)))),
            ("moe_bwd scaled_rows", _compile_among(_backward_modules(), "_gather_rows_kernel",
                                             lambda: bwd_rows.scaled_rows(dy_rows[:rows // 8], tok, w_pair))),
            ("moe_bwd gather_rows", _compile_among(_backward_modules(), "_gather_rows_kernel",
                                             lambda: bwd_rows.gather_rows(dy_rows[:rows // 8], tok))),
            ("moe_bwd gather+scaled", _compile_among(_backward_modules(), "_gather_rows_kernel",
                                               lambda: bwd_rows.gather_rows_and_scaled(dy_rows[:rows // 8], tok, w_pair))),
            ("moe_bwd gather+scaled limit", _compile_among(_backward_modules(), "_gather_rows_kernel", lambda: (
                bwd_rows.gather_rows_and_scaled(dy_rows[:rows // 8], tok, w_pair,
                                          torch.zeros(1, dtype=torch.int32, device=dev))))),
            ("moe_bwd swiglu_h", _compile_among(_backward_modules(), "_swiglu_h_kernel", lambda: bwd_rows.swiglu_h(gu, f))),
            ("moe_bwd unpermute_sum", _compile_among(_backward_modules(), "_unpermute_sum_kernel",
                                               lambda: bwd_rows.unpermute_sum(x_rows, torch.arange(rows, device=dev), 8)))]
    # the one launch (expert_backward_one_launch): every stage in one kernel, on the padded rows, bf16 and fp32 wgrad
    dy_pad, w_pad = torch.empty(rows_pad, h, **bf), torch.empty(rows_pad, dtype=torch.float32, device=dev)
    valid = torch.ones(rows_pad, dtype=torch.bool, device=dev)
    inv = torch.zeros(rows, dtype=torch.int64, device=dev)
    from kosmos.config import MoEBackwardConfig
    on_completion = MoEBackwardConfig().swiglu_on_completion
    n_tok = rows // 8

    def router(routing):  # the router backward in the launch too (moe_backward(one_launch=True)'s default)
        return bwd_router.RouterBackward(x=torch.empty(n_tok, h, **bf), router_weight=torch.empty(e, h, **bf),
                                 logits=torch.empty(n_tok, e, dtype=torch.float32, device=dev),
                                 experts=torch.zeros(n_tok, 8, dtype=torch.int32, device=dev), routing=routing,
                                 renormalize=True, routed_scaling=2.5)
    traced = lambda: torch.zeros((132, 1024, 4), dtype=torch.int64, device=dev)  # noqa: E731
    for name, dt, swiglu_on_completion, trace, rt in (
            ("bf16", torch.bfloat16, on_completion, None, None), ("fp32", torch.float32, on_completion, None, None),
            ("queued-swiglu", torch.bfloat16, not on_completion, None, None),
            ("traced", torch.bfloat16, on_completion, traced(), None),
            ("+router softmax", torch.bfloat16, on_completion, None, "softmax"),
            ("+router sigmoid", torch.bfloat16, on_completion, None, "sigmoid-grouped"),
            ("+router fp32", torch.float32, on_completion, None, "softmax"),
            ("+router traced", torch.bfloat16, on_completion, traced(), "softmax")):
        config = MoEBackwardConfig(swiglu_on_completion=swiglu_on_completion)
        out.append((f"moe_bwd one_launch {name}", _compile_among(
            _backward_modules(), "_moe_backward_experts_kernel",
            lambda dt=dt, trace=trace, rt=rt, config=config: bwd_one.expert_backward_one_launch(
                dy_pad, dy_pad, x_pad, gu_pad, w_pad, valid, w13, w2, counts, pad_offs, inv, n_tok, 8, dt,
                programs=132, trace=trace, router=router(rt) if rt else None, config=config))))
    out.append(("moe_bwd one_launch nk +router softmax", _compile_among(
        _backward_modules(), "_moe_backward_experts_kernel", lambda: bwd_one.expert_backward_one_launch(
            dy_pad, dy_pad, x_pad, gu_pad, w_pad, valid, w13_nk, w2_nk, counts, pad_offs, inv, n_tok, 8,
            torch.bfloat16, programs=132, router=router("softmax"), config=MoEBackwardConfig()))))
    return out


def kernels(world: int, dev, grid: int = 132, ms: int = 4096, k: int = 8192, n: int = 5120, only=KERNELS,
            mx: bool = False, tile=None):
    """(name, resources) of the fused kernels in ``only`` at ``world`` (rank 0, self policy, default configs);
    ``mx``: their MXFP8 variants (MX activation, dequantize on arrival; the MoE layer's MX dispatch); ``tile``
    (a planning.TileConfig): the TP kernels with that tile instead of tile_config's choice for the shape."""
    from kosmos.core import planning, runtime
    from kosmos.ops import all_gather_matmul as ag
    from kosmos.ops import matmul_reduce_scatter as rs
    from kosmos.ops import moe_forward as mf
    runtime.ensure_triton_allocator()
    bf = dict(dtype=torch.bfloat16, device=dev)
    peers = torch.zeros(world, dtype=torch.int64, device=dev)
    sig = torch.zeros(runtime.FLAG_BASE + 4096, dtype=torch.int32, device=dev)
    heads = torch.zeros(runtime.NUM_HEADS, dtype=torch.int32, device=dev)
    errs = torch.zeros(runtime.ERR_SLOTS, dtype=torch.int64, device=dev)
    common = dict(rank=0, world=world, epoch_slot=torch.zeros(1, dtype=torch.int32, device=dev), timeout_ns=10**9,
                  grid=grid)
    a_shard, b = torch.empty(ms, k, **bf), torch.empty(k, n, **bf)
    gather, c = torch.empty(ms * world, k, **bf), torch.empty(ms * world, n, **bf)
    cfg = tile or planning.tile_config(ms, n, k, world=world, programs=grid, mx=mx)
    out = []
    f8 = dict(dtype=torch.float8_e4m3fn, device=dev)
    u8 = dict(dtype=torch.uint8, device=dev)
    if "all_gather_matmul" in only and mx:
        out.append(("all_gather_matmul mx", _compile(ag, "_all_gather_matmul_kernel", lambda: ag.launch(
            torch.empty(ms, k, **f8), b, False, c, torch.empty(ms * world, k, **f8), peers, peers, sig, heads, errs,
            cfg=cfg, a_scales=torch.empty(ms, k // 32, **u8), gather_scales=torch.empty(ms * world, k // 32, **u8),
            scale_offset=ms * world * k, dequantized=gather, **common))))
    elif "all_gather_matmul" in only:
        out.append(("all_gather_matmul", _compile(ag, "_all_gather_matmul_kernel", lambda: ag.launch(
            a_shard, b, False, c, gather, peers, peers, sig, heads, errs, cfg=cfg, **common))))
        if hasattr(planning, "FP8_BLOCK_TILE") and world > 1:  # fp8-block: rows + scales moved, SCALED tiles
            f32 = dict(dtype=torch.float32, device=dev)
            scales = (torch.empty(ms, k // 128, **f32), torch.empty(ms * world, k // 128, **f32),
                      torch.empty(n // 128, k // 128, **f32))
            out.append(("all_gather_matmul fp8-block", _compile(ag, "_all_gather_matmul_kernel", lambda: ag.launch(
                torch.empty(ms, k, **f8), torch.empty(n, k, **f8), True, c, torch.empty(ms * world, k, **f8), peers,
                peers, sig, heads, errs, cfg=planning.FP8_BLOCK_TILE, scale_offset=ms * world * k,
                fp8_scales=scales, **common))))
    k_rs, n_rs = 8192 // world, 8192  # attention-out: K = heads*head_dim / W
    a_rs, b_rs = torch.empty(ms * world, k_rs, **bf), torch.empty(k_rs, n_rs, **bf)
    stage, c_rs = torch.empty(ms * world, n_rs, **bf), torch.empty(ms, n_rs, **bf)
    cfg = tile or planning.tile_config(ms, n_rs, k_rs, world=world, programs=grid, mx=mx)
    if "matmul_reduce_scatter" in only and mx:
        out.append(("matmul_reduce_scatter mx", _compile(rs, "_matmul_reduce_scatter_kernel", lambda: rs.launch(
            torch.empty(ms * world, k_rs, **f8), b_rs, False, c_rs, stage, peers, peers, sig, heads, errs, cfg=cfg,
            a_scales=torch.empty(ms * world, k_rs // 32, **u8), dequantized=a_rs, **common))))
    elif "matmul_reduce_scatter" in only:
        out.append(("matmul_reduce_scatter", _compile(rs, "_matmul_reduce_scatter_kernel", lambda: rs.launch(
            a_rs, b_rs, False, c_rs, stage, peers, peers, sig, heads, errs, cfg=cfg, **common))))
        if hasattr(planning, "FP8_BLOCK_TILE") and world > 1:  # fp8-block: the SCALED mainloop (W > 1 route)
            f32 = dict(dtype=torch.float32, device=dev)
            scales = (torch.empty(ms * world, k_rs // 128, **f32), torch.empty(n_rs // 128, k_rs // 128, **f32))
            out.append(("matmul_reduce_scatter fp8-block", _compile(rs, "_matmul_reduce_scatter_kernel",
                lambda: rs.launch(torch.empty(ms * world, k_rs, **f8), torch.empty(n_rs, k_rs, **f8), True, c_rs,
                                  stage, peers, peers, sig, heads, errs, cfg=planning.FP8_BLOCK_TILE,
                                  fp8_scales=scales, **common))))
    if "w1_matmul" in only and world == 1:  # the static W=1 GEMM (no world size): unsplit, split, stream-K
        out += w1_matmul_kernels(dev)
    if "moe_backward" in only:  # the same kernels at every EP size, on E / W local experts (ELP2 follows E / W)
        out += moe_backward_kernels(dev, e=128 // world)
        if world > 1:  # the one launch with its exchanges (its W > 1 build)
            out += moe_backward_ep_kernels(dev, world)
    if "moe_forward" not in only:
        return out
    # deepseek-v3-like MoE layer: H 7168, F 2048, 256 experts, top-8, sigmoid-grouped routing
    t_, h, f, e, top_k = 256, 7168, 2048, 256, 8
    el = e // world
    mcfg = planning.moe_config(mx=mx)
    lay = mf.Layout(world, t_, h, f, top_k, el, mcfg)
    small = lambda n_, dt=torch.int32: torch.zeros(max(1, n_), dtype=dt, device=dev)  # noqa: E731
    bufs = dict(data=small(lay.data_bytes if mx else 1024, torch.uint8), sig=sig, ctr=small(4096), peer_data=peers, peer_sig=peers,
                peer_ctr=peers, topk_w=small(16, torch.float32), topk_e=small(16), xe=torch.empty(128, h, **bf),
                xe_meta=small(16), hb=torch.empty(128, f, **bf), plan=small(lay.plan_n),
                scratch=small(lay.scratch_n), errors=errs, layout=lay)
    x, wr = torch.empty(t_, h, **bf), torch.empty(e, h, **bf)
    w13, w2, y = torch.empty(el, h, 2 * f, **bf), torch.empty(el, f, h, **bf), torch.empty(t_, h, **bf)
    bias = torch.zeros(e, dtype=torch.float32, device=dev)
    from kosmos.quant import MXTensor
    x_mx = MXTensor(torch.empty(t_, h, **f8), torch.empty(t_, h // 32, **u8)) if mx else None
    out.append(("moe_forward" + (" mx" if mx else ""), _compile(mf, "_moe_forward_kernel", lambda: mf.launch(
        x, wr, bias, w13, w2, y, bufs, cfg=mcfg, top_k=top_k, routing="sigmoid-grouped", n_group=8,
        topk_group=4, routed_scaling=2.5, x_mx=x_mx, **common))))
    if not mx:  # the training forward: g | u stored for the backward too (moe_forward's save_gu)
        gu = torch.empty(128, 2 * f, **bf)
        out.append(("moe_forward save_gu", _compile(mf, "_moe_forward_kernel", lambda: mf.launch(
            x, wr, bias, w13, w2, y, bufs, cfg=mcfg, top_k=top_k, routing="sigmoid-grouped", n_group=8,
            topk_group=4, routed_scaling=2.5, gu=gu, **common))))
        # transformers' expert layout (gate_up [El, 2F, H], down [El, H, F] as .transpose(1, 2) views)
        w13_nk, w2_nk = (torch.empty(el, 2 * f, h, **bf).transpose(1, 2), torch.empty(el, h, f, **bf).transpose(1, 2))
        out.append(("moe_forward nk", _compile(mf, "_moe_forward_kernel", lambda: mf.launch(
            x, wr, bias, w13_nk, w2_nk, y, bufs, cfg=mcfg, top_k=top_k, routing="sigmoid-grouped", n_group=8,
            topk_group=4, routed_scaling=2.5, **common))))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", default="1,2,8", help="world sizes the kernels are compiled for (comma-separated)")
    ap.add_argument("--json", default=None, help="also write the table as JSON here")
    ap.add_argument("--kernels", default=",".join(KERNELS), help="which kernels (comma-separated)")
    ap.add_argument("--mx", action="store_true", help="the MXFP8 variants instead of the bf16 ones")
    ap.add_argument("--tiles", action="store_true", help="the TP kernels once per tile of planning.TILE_CANDIDATES "
                    "(what tile_config may pick on some shape) instead of the one picked for the default shape")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    if torch.cuda.is_available():
        dev, grid = torch.device("cuda"), torch.cuda.get_device_properties(0).multi_processor_count
    else:
        _use_stand_in_driver()
        dev, grid = torch.device("cpu"), 132
    import triton
    rows = []
    print(f"triton {triton.__version__}, sm_90a, grid {grid}")
    print(f"{'kernel':<24} {'W':>2} {'regs':>5} {'spill B':>8} {'stack B':>8} {'shared KiB':>11} {'loops':>5}")
    from kosmos.core import planning
    tiles = [None]
    if args.tiles:
        tiles = [planning.TileConfig(bm, bn, 64, w, s) for bm, bn, w, s, _ in planning.TILE_CANDIDATES]
    only = args.kernels.split(",")
    if args.tiles:
        only = [k for k in only if k != "moe_forward"]
    for world in [int(w) for w in args.world.split(",")]:
        for tile in tiles:
            for name, r in kernels(world, dev, grid, only=only, mx=args.mx, tile=tile):
                if tile is not None:
                    name = f"{name} {tile.BM}x{tile.BN}w{tile.num_warps}s{tile.num_stages}"
                rows.append(dict(kernel=name, world=world, triton=triton.__version__, **r))
                print(f"{name:<26} {world:>2} {r['regs']:>5} {str(r['spill_bytes']):>8} {r['stack_bytes']:>8} "
                      f"{r['shared_kib']:>11} {r['ttgir_loops']:>5}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
