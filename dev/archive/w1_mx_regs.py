"""Registers, spills, shared memory and a PTX digest of kernels/w1_mx_matmul.py's builds for sm_90a (a developer
script; nothing runs, no GPU needed: dev/kernel_resources' stand-in driver). Needs Triton 3.6 (the kernel's Gluon
API), e.g. a CPU venv with triton==3.6.0:

    PYTHONPATH=. python -m dev.archive.w1_mx_regs [--json OUT.jsonl]

One row per build: the row pass's job (round a bf16 A / expand an MXTensor) x B's layout x the tile width
(w1_mx_matmul.TILES). ``ptx sha`` is a digest of the PTX's code (debug sections and line records left out):
equal digests before and after a change mean the GPU
figures of the old tree hold for the new one.
"""
from __future__ import annotations

import argparse
import hashlib
import re

import torch


def builds():
    from kosmos.gemm import w1_mx as w1mx
    for bn in getattr(w1mx, "TILES", (256, )):
        for quantize in (True, False):
            for b_kmajor in (True, False):
                yield bn, quantize, b_kmajor


def compile_build(bn: int, quantize: bool, b_kmajor: bool, m=4096, n=5120, k=8192) -> dict:
    from dev.kernel_resources import _resources
    from kosmos.gemm import w1_mx as w1mx

    class _Ws:  # what w1_mx_matmul_launch reads of a workspace
        counters = torch.zeros(w1mx.counter_slots(m, k), dtype=torch.int32)
        errors = torch.zeros(16, dtype=torch.int64)
        epoch_slot = torch.zeros(1, dtype=torch.int64)

        def ensure_counters(self, n):
            pass

        def timeout_ns(self):
            return 10 ** 9
    a = torch.empty(m, k, dtype=torch.bfloat16) if quantize else torch.empty(m, k, dtype=torch.float8_e4m3fn)
    scales = None if quantize else torch.empty(m, k // 32, dtype=torch.uint8)
    b = torch.empty((n, k) if b_kmajor else (k, n), dtype=torch.bfloat16)
    c = torch.empty(m, n, dtype=torch.bfloat16)
    values = torch.empty(m, k, dtype=torch.bfloat16)
    extra = (bn, ) if hasattr(w1mx, "TILES") else ()  # (a tree before the tile widths: 256 only)
    kl = w1mx.w1_mx_matmul_launch(a, scales, b, b_kmajor, c, values, _Ws(), 132, 1, *extra)
    compiled = kl.kernel.warmup(*kl.args, grid=kl.grid, **kl.kw)
    ptx = compiled.asm["ptx"]
    return {"build": f"{'round' if quantize else 'expand'} B {'[N, K]' if b_kmajor else '[K, N]'} BN {bn}",
            "bn": bn, "quantize": quantize, "b_kmajor": b_kmajor, **_resources(compiled),
            "setmaxnreg": re.findall(r"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+(\d+)", ptx),
            "ptx_sha": hashlib.sha256(_code_of(ptx).encode()).hexdigest()[:12]}


def _code_of(ptx: str) -> str:
    """The PTX without its debug sections and .loc / .file lines (they carry source paths and line numbers)."""
    code = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(line for line in code.splitlines() if not line.lstrip().startswith((".loc", ".file")))


def main(argv=None):
    import triton
    from dev.kernel_resources import _use_stand_in_driver
    from dev.rows import Rows
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        _use_stand_in_driver()
    rows = Rows(args.json)
    for b in builds():
        rows.emit(compile_build(*b))
    print(f"kosmos.kernels.w1_mx_matmul, Triton {triton.__version__}, sm_90a (ptxas -v)")
    print(f"{'build':<28} {'regs':>4} {'spill B':>7} {'smem KiB':>8}  {'ptx sha':<12}  setmaxnreg")
    for r in rows:
        regs = " ".join(d + v for d, v in r["setmaxnreg"])
        print(f"{r['build']:<28} {r['regs']:>4} {r['spill_bytes'] or 0:>7} {r['shared_kib']:>8}  {r['ptx_sha']:<12}  "
              f"{regs}")


if __name__ == "__main__":
    main()
