"""Why are the tail tiles (kernels/common.tile_matmul_tail: 128 + 64 / 32 columns, two accumulators) slow on the
GPU's Triton? (a developer probe, not product code)

    PYTHONPATH=. python -m dev.archive.tail_probe [--json OUT.jsonl] [--ir-dir DIR]

s19a (flat_probe --tails, one H200, Triton 3.6): tail-192 ran at 0.53-0.66x of cuBLAS on every shape, below even
w1-128x128 (one warpgroup) -- slower per tile than two 128x128 tiles, where the wave model expected ~0.96 of
128x256's rate; tail-160 and 128 x (64 + 32) at 0.30-0.56. Local Triton 3.9's TTGIR of the product kernel has both
MMAs async with one wait of 2 pendings per K step. This probe prints the GPU's own TTGIR facts for the product
kernel (per warp_group_dot_wait: its pendings; whether the loads are async TMA copies inside the loop) and times
the tail tile flattened (the product's form) and not flattened (a plain loop per tile, this file's copy).

A fork of kosmos.gemm.tiles.tile_matmul_tail inside kosmos.gemm.w1_static.w1_matmul_kernel's tail-tile loop (as of
dfbda47, both then in kernels/common.py): _tail_matmul loads B and runs its MMA before loading B2 (the product then
loaded B and B2 first; it took this order in session 19), the K loop a tl.range over STAGES, the tile loop's
flattening a switch (FLATTEN; the product's was always flattened then), B [K, N] only, no DOT_FP32, no
device-epoch advance. The w1-* and product-tail-192 variants run the imported product kernel
(dev.flat_probe.product_w1).
"""
from __future__ import annotations

import argparse
import os
import re

import torch
import triton
import triton.language as tl

from dev.rows import Rows
from kosmos.gemm.tiles import _grouped_tile, store_tile_tma
from kosmos.core.planning import GROUP_M


@triton.jit
def _tail_matmul(a_desc, b_desc, b2_desc, c_desc, c2_desc, M, N, K, BM: tl.constexpr, BN: tl.constexpr,
                 BN_TAIL: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, STAGES: tl.constexpr,
                 FLATTEN: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    n_m = tl.cdiv(M, BM)
    n_n = tl.cdiv(N, BN + BN_TAIL)
    t_out = pid - grid
    for t in tl.range(pid, n_m * n_n, grid, flatten=FLATTEN, num_stages=STAGES):
        tm, tn = _grouped_tile(t, n_m, n_n, GROUP_M)
        col = tn * (BN + BN_TAIL)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        acc2 = tl.zeros((BM, BN_TAIL), dtype=tl.float32)
        for kk in tl.range(0, tl.cdiv(K, BK), num_stages=STAGES):
            a = a_desc.load([tm * BM, kk * BK])
            acc = tl.dot(a, b_desc.load([kk * BK, col]), acc)
            acc2 = tl.dot(a, b2_desc.load([kk * BK, col + BN]), acc2)
        t_out += grid
        om, on = _grouped_tile(t_out, n_m, n_n, GROUP_M)
        store_tile_tma(c_desc, acc, om * BM, on * (BN + BN_TAIL), BM, BN)
        c2_desc.store([om * BM, on * (BN + BN_TAIL) + BN], acc2.to(tl.bfloat16))


def ir_facts(ttgir: str) -> dict:
    waits = [int(x) for x in re.findall(r"warp_group_dot_wait.*?pendings = (\d+)", ttgir)]
    return {"dots": len(re.findall(r"ttng\.warp_group_dot ", ttgir)), "async_dots": ttgir.count("isAsync = true"),
            "dot_wait_pendings": waits, "tma_loads": ttgir.count("async_tma_copy_global_to_local"),
            "sync_descriptor_loads": ttgir.count("tt.descriptor_load"), "loops": ttgir.count("scf.for")}


def main(argv=None) -> int:
    from triton.tools.tensor_descriptor import TensorDescriptor
    from dev.flat_probe import check_and_time, product_w1
    from kosmos.core import planning, runtime
    from kosmos_bench import timing
    from kosmos_bench.environment import environment
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    ap.add_argument("--ir-dir", default=None)
    ap.add_argument("--shapes", default="1024x3072x8192,4096x1536x4096,8192x6144x4096")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    runtime.ensure_triton_allocator()
    dev = torch.device("cuda", torch.cuda.current_device())
    programs = runtime.num_sms(dev)
    rows = Rows(args.json)
    rows.emit(environment(argv=["python", "-m", "dev.archive.tail_probe"] + list(argv or []), bench="tp",
                          suite={"probe": "tail_probe", **vars(args)}))
    from kosmos.gemm.w1_static import w1_matmul_args, w1_matmul_kernel
    for s in args.shapes.split(","):
        m, n, k = (int(x) for x in s.split("x"))
        a = torch.randn(m, k, device=dev).to(torch.bfloat16)
        b = torch.randn(k, n, device=dev).to(torch.bfloat16)
        ref = a.float() @ b.float()
        t_gemm = timing.time_op(lambda: a @ b, iters=20, warmup=5)["time_ms"]
        variants = {"w1-128x256": product_w1(a, b, planning.TileConfig(128, 256, 64, 8, 3), 1, programs),
                    "w1-128x128w4": product_w1(a, b, planning.TileConfig(128, 128, 64, 4, 4), 1, programs),
                    "w1-128x128w8": product_w1(a, b, planning.TileConfig(128, 128, 64, 8, 4), 1, programs),
                    "product-tail-192": product_w1(a, b, planning.TileConfig(128, 128, 64, 8, 4), 1, programs,
                                                   tail=64)}
        for tail, flatten in ((64, True), (64, False), (32, False)):
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            ds = (TensorDescriptor.from_tensor(a, [128, 64]), TensorDescriptor.from_tensor(b, [64, 128]),
                  TensorDescriptor.from_tensor(b, [64, tail]), TensorDescriptor.from_tensor(c, [128, 64]),
                  TensorDescriptor.from_tensor(c, [128, tail]))
            grid = min(programs, triton.cdiv(m, 128) * triton.cdiv(n, 128 + tail))

            def fn(ds=ds, c=c, tail=tail, flatten=flatten, grid=grid):
                _tail_matmul[(grid,)](*ds, m, n, k, BM=128, BN=128, BN_TAIL=tail, BK=64, GROUP_M=GROUP_M, STAGES=4,
                                      FLATTEN=flatten, num_warps=8, num_stages=4)
                return c
            variants[f"probe-tail-{128 + tail}-{'flat' if flatten else 'loop'}"] = fn
        for name, fn in variants.items():
            row = {"type": "result", "m": m, "n": n, "k": k, "variant": name, "t_gemm_ms": t_gemm}
            check_and_time(fn, ref, t_gemm, row, 20, 5)
            rows.emit(row)
            print(f"{s} {name:<24} {row['status']:<6} {row.get('ratio', float('nan')):.3f}x cuBLAS", flush=True)
    # the product kernel's TTGIR on this GPU's Triton, tail 64 and none
    for tail, cfg in ((64, planning.TileConfig(128, 128, 64, 8, 4)), (0, planning.TileConfig(128, 256, 64, 8, 3))):
        for kern_name in ("product",):
            m, n, k = 1024, 3072, 8192
            a = torch.empty(m, k, device=dev, dtype=torch.bfloat16)
            b = torch.empty(k, n, device=dev, dtype=torch.bfloat16)
            c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            epoch = torch.zeros(1, dtype=torch.int32, device=dev)
            g, wargs, kw = w1_matmul_args(a, b, False, c, cfg, epoch, programs, GROUP_M, False, tail=tail)
            comp = w1_matmul_kernel.warmup(*wargs, grid=(g,), **kw)
            facts = ir_facts(comp.asm["ttgir"])
            print(f"{kern_name} tail {tail}: {facts}", flush=True)
            rows.emit({"type": "ir", "kernel": kern_name, "tail": tail, **facts})
            if args.ir_dir:
                os.makedirs(args.ir_dir, exist_ok=True)
                with open(os.path.join(args.ir_dir, f"{kern_name}-tail{tail}.ttgir"), "w") as f:
                    f.write(comp.asm["ttgir"])
    rows.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
