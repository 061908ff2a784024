"""Tiles of kosmos/quant.py's streaming kernels (quantize, dequantize, round): elements per program and warps.
(session 24: round_to_mx at 16 x 16 blocks per 8-warp program ran ~3.3 TB/s, while the quantize -> dequantize
pair at quant._tiles' 8 x 8 blocks per 4-warp program -- "a first, unmeasured choice" -- ran ~1.5-1.7 TB/s.)

    PYTHONPATH=. python -m dev.archive.quant_tiles_probe [--json OUT.jsonl]

Each kernel launched directly (``kernel[grid](...)``: the same launches as quant._launch's normal path, bound once
per tile), timed with kosmos_bench.timing.time_op (L2 flushed, host hidden), interleaved over the tiles, on bf16
[rows, K] inputs of 0.5-256 MB, outputs checked bit for bit against the default tile's. Prints the effective
bandwidth (bytes read + written / time) per kernel, size and tile. A developer probe."""
import argparse
import statistics

import torch

TILES = [(8, 8, 4), (16, 16, 8), (16, 16, 4), (8, 32, 4), (32, 8, 8), (16, 32, 8)]
SIZES = [(256, 2048), (1024, 4096), (4096, 8192), (16384, 8192)]


def main(argv=None):
    from kosmos import quant
    from kosmos_bench.timing import time_op
    from dev.rows import Rows
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows_out = Rows(args.json)  # each row written as it is ready
    for rows, k in SIZES:
        nb = k // 32
        x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
        p, s = quant.quantize_mx(x)
        p8 = p.view(torch.uint8)
        outs = {"quantize": (torch.empty_like(p8), torch.empty_like(s)), "dequantize": torch.empty_like(x),
                "dequantize-cvt": torch.empty_like(x), "round": torch.empty_like(x)}
        moved = {"quantize": rows * k * (2 + 1 + 1 / 32), "dequantize": rows * k * (1 + 1 / 32 + 2),
                 "dequantize-cvt": rows * k * (1 + 1 / 32 + 2), "round": rows * k * 4}

        def launch(kind, tile):
            br, bnb, warps = tile
            grid = (-(-rows // br), -(-nb // bnb))
            if kind == "quantize":
                q, sc = outs[kind]
                return lambda: quant._quantize_kernel[grid](x.view(torch.int16), q, sc, rows, nb, BLOCK_R=br,
                                                            BLOCK_NB=bnb, num_warps=warps)
            if kind.startswith("dequantize"):
                o = outs[kind].view(torch.int16)
                return lambda: quant._dequantize_kernel[grid](p8, s, o, rows, nb, OUT_BF16=True, BLOCK_R=br,
                                                              BLOCK_NB=bnb, num_warps=warps, CVT=kind.endswith("cvt"))
            return lambda: quant._round_kernel[grid](x, outs[kind], rows, nb, BLOCK_R=br, BLOCK_NB=bnb,
                                                     num_warps=warps)
        for kind in outs:
            ref = None
            if kind == "dequantize-cvt":  # the integer path's bits (its own first tile) are the reference
                ref = torch.cat([outs["dequantize"].reshape(-1).view(torch.uint8)]).clone()
            for tile in TILES:  # bitwise against the first tile's output (dequantize-cvt: the integer path's)
                launch(kind, tile)()
                torch.cuda.synchronize()
                o = outs[kind]
                got = torch.cat([t.reshape(-1).view(torch.uint8) for t in (o if isinstance(o, tuple) else (o, ))])
                if ref is None:
                    ref = got.clone()
                assert torch.equal(got, ref), (kind, rows, k, tile)
            times = {t: [] for t in TILES}
            for _ in range(args.rounds):
                for tile in TILES:
                    times[tile].append(time_op(launch(kind, tile), iters=20, warmup=5)["time_ms"])
            for tile in TILES:
                t = statistics.median(times[tile])
                r = dict(kernel=kind, rows=rows, k=k, tile=list(tile), time_us=t * 1e3,
                         tb_per_s=moved[kind] / (t * 1e-3) / 1e12)
                rows_out.emit(r)
        del x, p, s, outs
        torch.cuda.empty_cache()
    print(f"{'kernel':<11} {'size':<12} " + " ".join(f"{'x'.join(map(str, t)):>9}" for t in TILES) + "   (TB/s)")
    for kind in ("quantize", "dequantize", "dequantize-cvt", "round"):
        for rows, k in SIZES:
            rs = [r for r in rows_out if r["kernel"] == kind and r["rows"] == rows and r["k"] == k]
            print(f"{kind:<11} {f'{rows}x{k}':<12} " + " ".join(f"{r['tb_per_s']:9.2f}" for r in rs))


if __name__ == "__main__":
    main()
