"""Isolates a failure of dev/gluon_mx_probe's MX-expand builds (s22b: "illegal instruction" in the first check).

    PYTHONPATH=. CUDA_LAUNCH_BLOCKING=1 python -m dev.gluon_expand_diag expand cvt|bits
    PYTHONPATH=. CUDA_LAUNCH_BLOCKING=1 python -m dev.gluon_expand_diag gemm gluon-mx-expand|gluon-mx-expand-bits

One check per process (a CUDA error poisons the context): the expand-only kernel against dequantize_mx (bitwise),
or the GEMM build against the fp32 reference on both check shapes (B [N, K] and [K, N]). Prints one JSON line;
exit status 0 only when the check ran and passed. A developer probe, not product code."""
import json
import sys

import torch


def main(argv=None) -> int:
    from dev import gluon_mx_probe as g
    kind, name = (argv or sys.argv[1:])[:2]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    if kind == "expand":
        rows = [g.check_expand(name, gen)]
    elif kind == "gemm":
        rows = [g.check_gemm(m, n, k, build=name, b_kmajor=bk, gen=gen)
                for (m, n, k), bk in zip(g.CHECK_SHAPES, (True, False))]
    else:
        raise SystemExit(f"unknown kind {kind!r}: expand or gemm")
    for r in rows:
        print(json.dumps(r), flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
