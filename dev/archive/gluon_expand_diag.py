"""Isolates a failure of dev/gluon_mx_probe's MX-expand builds (s22b: "illegal instruction"; s23a: wrong values).

    PYTHONPATH=. CUDA_LAUNCH_BLOCKING=1 python -m dev.archive.gluon_expand_diag expand cvt|bits
    PYTHONPATH=. CUDA_LAUNCH_BLOCKING=1 python -m dev.archive.gluon_expand_diag gemm gluon-mx-expand|gluon-mx-expand-bits
    PYTHONPATH=. python -m dev.archive.gluon_expand_diag map cvt|bits

One check per process (a CUDA error poisons the context): the expand-only kernel against dequantize_mx (bitwise),
or the GEMM build against the fp32 reference on both check shapes (B [N, K] and [K, N]). ``map``: the expand-only
kernel on one [128, 64] tile with coded inputs, to see which payload byte and which scale byte lands where: every
scale 127 with the payload byte coding its row (then its column), and the payload 1.0 with the scale coding its
(row, block). Prints JSON lines; exit status 0 only when the checks ran and passed. A developer probe."""
import json
import sys

import torch


def _coded_map(g, expand) -> list[dict]:
    from kosmos.quant import dequantize_mx
    dev = "cuda"
    m, k = 128, 64
    codes = torch.arange(1, 127, device=dev, dtype=torch.int32)  # finite positive E4M3 bytes, distinct values
    pad = torch.cat([codes, codes[:2]]).to(torch.uint8).view(1, 128).view(torch.float8_e4m3fn)
    values = dequantize_mx(pad, torch.full((1, 4), 127, dtype=torch.uint8, device=dev), torch.float32)[0, :126]
    rows = []
    r = torch.arange(m, device=dev)[:, None].expand(m, k)
    c = torch.arange(k, device=dev)[None, :].expand(m, k)
    for what, code in (("payload row", r % 126), ("payload col", c)):
        payload = codes[code].to(torch.uint8).view(torch.float8_e4m3fn).contiguous()
        scales = torch.full((m, k // 32), 127, dtype=torch.uint8, device=dev)
        y = g.gluon_mx_expand(payload, scales, expand).float()
        got = torch.searchsorted(values.contiguous(), y.contiguous().view(-1)).view(m, k)  # index of the value
        ok = got == code
        bad = (~ok).nonzero()[:12].tolist()
        rows.append({"what": what, "mismatches": int((~ok).sum()),
                     "examples": [[i, j, int(code[i, j]), int(got[i, j])] for i, j in bad]})
    blk = c // 32
    code = 1 + (2 * r + blk) % 250
    payload = torch.full((m, k), 0x38, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    scales = (1 + (2 * torch.arange(m, device=dev)[:, None] + torch.arange(2, device=dev)[None, :]) % 250).to(
        torch.uint8)
    y = g.gluon_mx_expand(payload, scales, expand).float()
    got = torch.round(torch.log2(y)).to(torch.int64) + 127
    ok = got == code
    bad = (~ok).nonzero()[:16].tolist()
    src = lambda s: [int((s - 1) // 2), int((s - 1) % 2)]  # noqa: E731  (row, block) of a code below 251
    rows.append({"what": "scale (row, block)", "mismatches": int((~ok).sum()),
                 "examples": [[i, j, src(int(code[i, j])), src(int(got[i, j]))] for i, j in bad]})
    return [dict(kind="map", expand=expand, ok=r_["mismatches"] == 0, **r_) for r_ in rows]


def main(argv=None) -> int:
    from dev import gluon_mx_probe as g
    kind, name = (argv or sys.argv[1:])[:2]
    gen = torch.Generator(device="cuda").manual_seed(1234)
    if kind == "expand":
        rows = [g.check_expand(name, gen)]
    elif kind == "gemm":
        rows = [g.check_gemm(m, n, k, build=name, b_kmajor=bk, gen=gen)
                for (m, n, k), bk in zip(g.CHECK_SHAPES, (True, False))]
    elif kind == "map":
        rows = _coded_map(g, name)
    else:
        raise SystemExit(f"unknown kind {kind!r}: expand, gemm or map")
    for r in rows:
        print(json.dumps(r), flush=True)
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
