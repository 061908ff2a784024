"""The developer probes' CPU paths (dev/): what can be checked without a GPU before a device call spends time.

* ``interpreter`` -- dev.tile_probe's check-only mode (``--cpu-smoke``) on tiny shapes under the CPU interpreter:
  every candidate tile checked against the fp32 product, through the kernels' own ``launch``.
* dev.ab_compare refuses an A/B whose two sides ran the same code (the sessions 7-9 mistake).
* dev.sk_probe's checked variants (the stream-K schedule with its fix-up) compute the product (interpreter).
* dev.gluon_mx_probe's MX expansions, emulated on the CPU, are dequantize_mx bit for bit.
* dev/gpu_check.sh (the GPU suite in one command) refuses bad arguments, and a machine without a GPU, in one line.
"""
import json

import pytest
import torch

from dev import ab_compare, tile_probe


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.interpreter
def test_tile_probe_check_only_two_candidates(tmp_path, capsys):
    """One ragged shape (M = 40: two full 16-row tiles and a half one; K = 48: three BK steps), both ops, two tiny
    candidates: every row checked and correct, the JSONL and the table written."""
    out = tmp_path / "probe.jsonl"
    rc = tile_probe.main(["--cpu-smoke", "--shapes", "40x64x48", "--candidates", "16x32x16w4s1,32x16x16w4s1",
                          "--json", str(out)])
    assert rc == 0
    rows = _rows(out)
    assert rows[0]["type"] == "env" and rows[0]["check_only"]
    res = [r for r in rows if r["type"] == "result"]
    assert [(r["op"], r["cand"]) for r in res] == [(op, c) for op in ("ag_gemm", "gemm_rs")
                                                    for c in ("16x32x16w4s1", "32x16x16w4s1")]
    for r in res:
        assert r["status"] == "ok", r
        assert r["rel_err"] < tile_probe.TOL
        assert (r["m"], r["n"], r["k"], r["grid"]) == (40, 64, 48, tile_probe.INTERP_GRID)
    assert (res[1]["BM"], res[1]["BN"], res[1]["BK"]) == (32, 16, 16)
    assert "passed 1/1" in capsys.readouterr().out


@pytest.mark.interpreter
def test_tile_probe_records_wrong_and_skipped(tmp_path, monkeypatch):
    """A launch that writes the wrong values is recorded as wrong (the check runs before anything is timed), a
    tile the kernels cannot take (BN not a power of two) as skipped, and the probe goes on."""
    def broken(op, a, b, c, cfg, grid, bufs):
        return lambda: c.fill_(1.0)

    monkeypatch.setattr(tile_probe, "make_launch", broken)
    out = tmp_path / "probe.jsonl"
    rc = tile_probe.main(["--cpu-smoke", "--shapes", "16x32x16", "--ops", "gemm_rs", "--candidates",
                          "16x24x16w4s1,16x32x16w4s1", "--json", str(out)])
    assert rc == 1  # nothing ran correctly
    res = [r for r in _rows(out) if r["type"] == "result"]
    assert [(r["cand"], r["status"]) for r in res] == [("16x24x16w4s1", "skipped"), ("16x32x16w4s1", "wrong")]
    assert "power" in res[0]["reason"] and "rel err" in res[1]["reason"]


def test_tile_probe_candidates_parse():
    cands = tile_probe.parse_candidates(tile_probe.DEFAULT_CANDIDATES)
    assert 5 <= len(cands) <= 8 and cands[0].name == "rule" and cands[0].cfg is None
    c = tile_probe.parse_candidate("64x128x64w4s4g2")
    assert (c.cfg.BM, c.cfg.BN, c.cfg.BK, c.cfg.num_warps, c.cfg.num_stages, c.per_sm) == (64, 128, 64, 4, 4, 2)
    for cand in cands[1:]:  # every default candidate passes the kernels' static constraints
        assert tile_probe.static_reason(cand.cfg) is None, cand
    assert len(tile_probe.load_shapes(None)) == 48
    with pytest.raises(ValueError):
        tile_probe.parse_candidate("128x128")


def _ab_file(path, source_sha, time_ms, mx_ms=None):
    rows = [{"type": "env", "source_sha": source_sha},
            {"type": "result", "status": "ok", "op": "ag_gemm", "model": "m", "layer": "qkv", "seq": 4096,
             "impl": "kosmos", "time_ms": time_ms, "t_gemm_ms": 1.0}]
    if mx_ms is not None:  # the same point at mxfp8 (a bench --dtype bf16,mxfp8 file)
        rows.append(dict(rows[1], dtype="mxfp8", time_ms=mx_ms))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_ab_compare_refuses_a_tree_against_itself(tmp_path, capsys):
    """Same source_sha on both sides: exit 2 and the reason; different sources: the ratio new/base is printed."""
    old = _ab_file(tmp_path / "old.jsonl", "a" * 40, 2.0)
    same = _ab_file(tmp_path / "same.jsonl", "a" * 40, 1.0)
    assert ab_compare.main([old, "--vs", same]) == 2
    assert "same code" in capsys.readouterr().err
    new = _ab_file(tmp_path / "new.jsonl", "b" * 40, 1.0)
    assert ab_compare.main([old, "--vs", new]) == 0
    out = capsys.readouterr().out
    assert "geomean new/base over 1 shapes: 0.500" in out
    mixed = [old, _ab_file(tmp_path / "old2.jsonl", "c" * 40, 2.0)]
    assert ab_compare.main(mixed + ["--vs", new]) == 2
    capsys.readouterr()
    # one point at two precisions: two rows, each its own ratio (not one median over both dtypes)
    both_old = _ab_file(tmp_path / "both-old.jsonl", "a" * 40, 2.0, mx_ms=4.0)
    both_new = _ab_file(tmp_path / "both-new.jsonl", "b" * 40, 2.0, mx_ms=3.0)
    assert ab_compare.main([both_old, "--vs", both_new]) == 0
    out = capsys.readouterr().out
    assert "qkv/mxfp8" in out and "0.750" in out and "1.000" in out


def test_moe_bwd_layout_ab_variants():
    """moe_bwd_layout_ab --variants: known names only, two or more, no repeats; each maps to moe_backward_w1's
    keyword arguments (the one launch is the padded layout with one_launch=True)."""
    from dev import moe_bwd_layout_ab as ab
    assert ab.parse_variants("packed,padded") == ["packed", "padded"]
    assert ab.parse_variants("padded, one-launch") == ["padded", "one-launch"]
    assert ab.VARIANTS["one-launch"] == dict(padded=True, one_launch=True)
    for bad, msg in (("padded,fused", "unknown variant 'fused'"), ("padded", "two or more"),
                     ("padded,padded", "two or more")):
        with pytest.raises(SystemExit, match=msg):
            ab.parse_variants(bad)


def test_trace_table_from_a_trace_buffer():
    """dev.moe_probe.trace_events / kind_table (moe_probe's and moe_bwd_layout_ab --trace's per-kind table):
    only recorded events (t1 > 0) count; tasks, first start, last end and busy us per program per kind."""
    import torch
    from dev.moe_probe import kind_table, trace_events
    from kosmos.core.codes import EV_BWD_DGRAD1, EV_BWD_DGRAD2, TRACE_EVENTS
    buf = torch.zeros((2, TRACE_EVENTS.value, 4), dtype=torch.int64)
    buf[0, 0] = torch.tensor([EV_BWD_DGRAD2.value, 0, 1_000, 3_000])
    buf[0, 1] = torch.tensor([EV_BWD_DGRAD1.value, 5, 3_000, 9_000])
    buf[1, 0] = torch.tensor([EV_BWD_DGRAD2.value, 1, 2_000, 4_000])
    events = trace_events(buf)
    assert events == [[0, EV_BWD_DGRAD2.value, 0, 1000, 3000], [0, EV_BWD_DGRAD1.value, 5, 3000, 9000],
                      [1, EV_BWD_DGRAD2.value, 1, 2000, 4000]]
    lines = kind_table([events], grid=2).splitlines()
    assert lines[1].split() == ["0", "span", "0.0", "8.0"]
    assert lines[2].split() == ["0", "dgrad2", "2", "0.0", "3.0", "2.0"]   # (2 + 2) us over 2 programs
    assert lines[3].split() == ["0", "dgrad1", "1", "2.0", "8.0", "3.0"]


@pytest.mark.interpreter
@pytest.mark.parametrize("m,n,k,programs", [(80, 96, 112, 4), (64, 128, 96, 5), (48, 96, 64, 7)])
def test_sk_probe_checked_variants_are_the_product(m, n, k, programs):
    """dev/sk_probe's variants that keep the tile sums whole (full, full-sigma, full-tma, full-tma-late) compute
    C = A @ B under the interpreter (16x32x16 tiles: data-parallel waves then runs, runs shorter than a tile, the
    sigma order), with every tile counter back at zero and no wait timed out."""
    from dev import sk_probe
    from kosmos.core.descriptors import tma_descriptor
    gen = torch.Generator().manual_seed(m + n + k)
    a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    b = torch.randn(k, n, generator=gen).to(torch.bfloat16)
    ref = a.float() @ b.float()
    bm, bn, bk = 16, 32, 16
    tiles = -(-m // bm) * -(-n // bn)
    for variant in ("full", "full-sigma", "full-tma", "full-tma-late"):
        c = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        parts = torch.full((programs * bm, bn), float("nan"))
        counters = torch.zeros(tiles, dtype=torch.int32)
        errors = torch.zeros(16, dtype=torch.int64)
        descs = (tma_descriptor(a, [bm, bk]), tma_descriptor(b, [bk, bn]), tma_descriptor(c, [bm, bn // 2]),
                 tma_descriptor(parts, [bm, bn // 2]))
        sk_probe._sk_matmul[(programs,)](*descs, m, n, k, parts, counters, errors, 10**6, BM=bm, BN=bn, BK=bk,
                                         GROUP_M=8, STAGES=1, VARIANT=sk_probe.VARIANT_CODES[variant])
        err = ((c.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (variant, err)
        assert not bool(counters.any()) and int(errors[0]) == 0, variant


def test_gluon_mx_probe_expansion_emulated_is_dequantize_mx():
    """dev.gluon_mx_probe's MX expansions (the arithmetic of the gluon-mx-expand builds, "cvt" and "bits"),
    emulated instruction by instruction on the CPU, give kosmos.quant's dequantize_mx bit for bit on every payload
    byte under every scale byte (NaN as the kernel's 0x7FC0; the sample holds NaN, +-inf, bf16 subnormal and
    zero results); the scale boxes' TMA needs the k-major scales [K/32, M] with M % 16 == 0 and the probe says
    so."""
    g = pytest.importorskip("dev.gluon_mx_probe")  # Triton's Gluon (3.6 on the GPU box, 3.9 here)
    for expand in g.EXPANDS:
        r = g.emulate_expand(expand)
        assert r["ok"], r
        assert min(r["nan_results"], r["inf_results"], r["subnormal_results"], r["zero_results"]) > 0, r
    for payload, scales_t in (((128, 256), (128, 8)),     # the public [M, K/32] layout, not mx_a's
                              ((120, 256), (8, 120))):    # M bytes of row stride, not a multiple of 16
        with pytest.raises(ValueError, match="M % 16"):
            g.mx_descs(torch.empty(*payload, dtype=torch.float8_e4m3fn), torch.empty(*scales_t, dtype=torch.uint8))
    p, s = g.mx_a((torch.empty(256, 512, dtype=torch.float8_e4m3fn), torch.arange(256 * 16).to(torch.uint8)
                   .view(256, 16)))
    assert s.shape == (16, 256) and s.is_contiguous() and int(s[3, 5]) == (5 * 16 + 3) % 256


def _gpu_check(*args):
    import subprocess
    from pathlib import Path
    script = Path(__file__).resolve().parent.parent / "dev" / "gpu_check.sh"
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=60)


def test_gpu_check_script_refuses_bad_arguments_with_one_line():
    """dev/gpu_check.sh (the GPU suite in one command): --help teaches, bad arguments are refused with exit 2."""
    r = _gpu_check("--help")
    assert r.returncode == 0 and "--quick" in r.stdout and "--workers" in r.stdout, r.stdout + r.stderr
    for args, said in ((["--workers", "x"], "positive whole number"), (["--workers", "0"], "positive whole number"),
                       (["--nope"], "unknown argument '--nope'")):
        r = _gpu_check(*args)
        assert r.returncode == 2 and said in r.stderr and r.stdout == "", (args, r.stdout, r.stderr)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_gpu_check_script_without_a_gpu_says_so_and_fails():
    r = _gpu_check("--quick")
    assert r.returncode == 2 and "no CUDA GPU here" in r.stderr and "python -m pytest -q" in r.stderr, r.stderr
