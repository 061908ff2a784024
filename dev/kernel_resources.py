"""Registers, spills and shared memory of the TP kernels as this GPU's Triton compiles them (a developer's
device script: no second GPU needed, nothing runs).

    PYTHONPATH=. python -m dev.kernel_resources [--world 2] [--variant KOSMOS_AG_COPY_BLOCK=16384 ...]

Each fused kernel is compiled (``JITFunction.warmup``) exactly as its ``launch`` would launch it at world size
--world for rank 0 of a llama3-70b-like shape, once per --variant (developer knobs K=V,..., set while that
variant compiles), and its ptxas figures are printed. Spills in the fused kernels cost GEMM speed, so check
them here before timing a change.
"""
from __future__ import annotations

import argparse

import torch


class _CompileOnly:
    """Stands in for a @triton.jit kernel inside a module's ``launch``: ``kernel[grid](...)`` compiles."""

    def __init__(self, fn):
        self.fn, self.compiled = fn, None

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.compiled = self.fn.warmup(*args, grid=grid, **kw)
        return run


def _compile(module, kernel_name: str, call):
    original = getattr(module, kernel_name)
    stub = _CompileOnly(original)
    setattr(module, kernel_name, stub)
    try:
        call()
    finally:
        setattr(module, kernel_name, original)
    k = stub.compiled
    k._init_handles()  # loads the binary: n_regs / n_spills are known from here on
    return {"regs": k.n_regs, "spills": k.n_spills, "shared_kib": round(k.metadata.shared / 1024, 1)}


def tp_kernels(world: int, ms: int = 4096, k: int = 8192, n: int = 5120):
    """(name, resources) of the AllGather+GEMM and GEMM+RS kernels at ``world`` (rank 0, self policy)."""
    from kosmos import planning, runtime
    from kosmos.kernels import all_gather_matmul as ag
    from kosmos.kernels import matmul_reduce_scatter as rs
    dev = torch.device("cuda")
    runtime.ensure_triton_allocator()
    bf = dict(dtype=torch.bfloat16, device=dev)
    peers = torch.zeros(world, dtype=torch.int64, device=dev)
    sig = torch.zeros(runtime.FLAG_BASE + 4096, dtype=torch.int32, device=dev)
    heads = torch.zeros(runtime.NUM_HEADS, dtype=torch.int32, device=dev)
    errs = torch.zeros(runtime.ERR_SLOTS, dtype=torch.int64, device=dev)
    grid = runtime.num_sms(dev)
    common = dict(rank=0, world=world, epoch=1, timeout_ns=10**9, grid=grid)
    a_shard, b = torch.empty(ms, k, **bf), torch.empty(k, n, **bf)
    gather, c = torch.empty(ms * world, k, **bf), torch.empty(ms * world, n, **bf)
    cfg = planning.tile_config(ms, n, k)
    out = [("all_gather_matmul", _compile(ag, "_all_gather_matmul_kernel", lambda: ag.launch(
        a_shard, b, False, c, gather, peers, peers, sig, heads, errs, cfg=cfg, **common)))]
    a_rs, b_rs = torch.empty(ms * world, k // world, **bf), torch.empty(k // world, n, **bf)
    stage, c_rs = torch.empty(ms * world, n, **bf), torch.empty(ms, n, **bf)
    cfg = planning.tile_config(ms * world, n, k // world)
    out.append(("matmul_reduce_scatter", _compile(rs, "_matmul_reduce_scatter_kernel", lambda: rs.launch(
        a_rs, b_rs, False, c_rs, stage, peers, peers, sig, heads, errs, cfg=cfg, **common))))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="world size the kernels are compiled for")
    ap.add_argument("--variant", action="append", default=None,
                    help="developer knobs K=V,... set while compiling (repeatable; default: the defaults)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (the kernels are compiled for the GPU that is there)")
    print(f"{'variant':<40} {'kernel':<24} {'regs':>5} {'spills':>7} {'shared KiB':>11}")
    from kosmos_bench.launcher import knobs
    for variant in args.variant or [""]:
        try:
            with knobs(variant):
                for name, r in tp_kernels(args.world):
                    print(f"{variant or '(defaults)':<40} {name:<24} {r['regs']:>5} {r['spills']:>7} "
                          f"{r['shared_kib']:>11}", flush=True)
        except Exception as e:  # a variant that does not compile is reported, the others still run
            print(f"{variant or '(defaults)':<40} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")

if __name__ == "__main__":
    main()
