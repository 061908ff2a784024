"""kosmos_bench/train.py (the training proxies of `kosmos bench train`) and their report.

On the CPU the fused ops are replaced by the pure-torch references, as in tests/test_nn_tp.py (``_fake_ops``):
what is tested is that the kosmos proxy (kosmos.nn layers) and the nccl+cublas proxy (the bench's own
autograd Functions over kosmos.reference) build the same model from one seed and train it the same way, at
world 1 in-process and at world 2 over gloo; the row schema; a perturbed implementation recorded failed; the
report's train table and loss figure from a fixture. The GPU test runs a tiny proxy end to end on CUDA.
"""
import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from multiproc import spawn_gloo
from test_nn_tp import _fake_ops

from kosmos_bench import train as T

FIXTURE = Path(__file__).parent / "fixtures" / "train-sample.jsonl"
ROW_KEYS = {"type", "bench", "model", "kind", "layers", "seq", "batch", "hidden", "ffn", "heads", "kv_heads",
            "head_dim", "experts", "top_k", "scale", "world", "dtype", "impl", "baseline", "steps", "warmup", "status",
            "reason", "step_ms", "step_p20_ms", "step_p80_ms", "step_times_ms", "tokens_per_s", "peak_mem_bytes",
            "losses", "final_loss", "loss_rtol", "loss_max_rel_diff"}


def _tiny(world=1, model="llama3-8b", head_dim=16, **kw):
    return T.proxy_shape(model, seq=8 * world, batch=2, hidden=32 * world, head_dim=head_dim, tp=world, **kw)


def _settings(**kw):
    return T.TrainSettings(**{"steps": 3, "warmup": 0, **kw})


def test_proxy_shapes():
    full = T.proxy_shape("llama3-70b", tp=8)
    assert (full.hidden, full.ffn, full.heads, full.kv_heads, full.head_dim) == (8192, 28672, 64, 8, 128)
    small = T.proxy_shape("llama3-8b", scale=0.0625, tp=2)
    assert small.hidden == 256 and small.ffn % 64 == 0 and small.heads % small.kv_heads == 0
    assert small.kv_heads % 2 == 0
    moe = T.proxy_shape("deepseek-v3", hidden=64)
    assert moe.kind == "moe" and moe.experts == 256 and moe.route_kw["n_group"] == 8
    with pytest.raises(ValueError, match="divide by tp"):
        T.proxy_shape("llama3-8b", seq=7, tp=2)
    with pytest.raises(ValueError, match="unknown model"):
        T.proxy_shape("nope")


def test_same_initial_weights():
    sh = _tiny()
    a = T.build_proxy(sh, "kosmos", seed=3)
    b = T.build_proxy(sh, "nccl+cublas", seed=3)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    c = T.build_proxy(sh, "kosmos", seed=4)
    assert not torch.equal(a.blocks[0].qkv.weight, c.blocks[0].qkv.weight)


def _check_rows(rows, world):
    assert [r["impl"] for r in rows] == ["nccl+cublas", "kosmos"]
    for r in rows:
        assert set(r) == ROW_KEYS, set(r) ^ ROW_KEYS
        assert r["status"] == "ok", r["reason"]
        assert r["bench"] == "train" and r["world"] == world and len(r["losses"]) == 3
        assert all(math.isfinite(x) for x in r["losses"]) and r["final_loss"] == r["losses"][-1]
        assert r["step_ms"] > 0 and r["tokens_per_s"] > 0 and r["peak_mem_bytes"] == 0
    base, ours = rows[0]["losses"], rows[1]["losses"]
    assert max(abs(x - y) / y for x, y in zip(ours, base)) < 1e-2
    assert rows[1]["loss_max_rel_diff"] < 1e-2
    json.dumps(rows)  # a row is JSON


def test_world1_kosmos_matches_baseline(monkeypatch):
    _fake_ops(monkeypatch)
    rows = T.run_train(_tiny(), _settings(impls=("kosmos", "nccl+cublas")))
    _check_rows(rows, 1)
    assert rows[0]["losses"] != rows[0]["losses"][:1] * 3  # the loss moves: the model trains


def test_world1_mxfp8(monkeypatch):
    _fake_ops(monkeypatch)
    rows = T.run_train(_tiny(head_dim=32), _settings(dtype="mxfp8"))  # K of every GEMM: multiples of 32
    assert [r["status"] for r in rows] == ["ok", "ok"], [r["reason"] for r in rows]


def test_perturbed_implementation_is_failed(monkeypatch):
    _fake_ops(monkeypatch)

    def build(shape, impl, **kw):
        proxy = T.build_proxy(shape, impl, **kw)
        if impl == "kosmos":  # trains another model: a wrong weight
            with torch.no_grad():
                proxy.blocks[0].fc2.weight.mul_(3.0)
        return proxy
    got = []
    rows = T.run_train(_tiny(), _settings(), build=build, on_row=got.append)
    assert got == rows
    assert rows[0]["status"] == "ok" and rows[1]["status"] == "failed"
    assert "trains differently" in rows[1]["reason"] and "step 0" in rows[1]["reason"]
    assert rows[1]["step_ms"] is not None and rows[1]["losses"]  # its timing and losses are kept


def test_loss_disagreement():
    assert T.loss_disagreement([1.0, 2.0], [1.0, 2.01]) is None
    assert "step 1" in T.loss_disagreement([1.0, 2.2], [1.0, 2.0])
    assert "nan" in T.loss_disagreement([float("nan")], [1.0])
    assert "losses against" in T.loss_disagreement([1.0], [1.0, 2.0])


def test_failing_implementation_is_recorded(monkeypatch):
    _fake_ops(monkeypatch)

    def build(shape, impl, **kw):
        if impl == "kosmos":
            raise RuntimeError("boom")
        return T.build_proxy(shape, impl, **kw)
    rows = T.run_train(_tiny(), _settings(), build=build)
    assert rows[1]["status"] == "failed" and rows[1]["reason"] == "RuntimeError: boom"


def test_moe_proxy_world1_baseline_and_kosmos_unavailable_paths():
    sh = _tiny(model="qwen3-235b")
    rows = T.run_train(sh, _settings(impls=("nccl-a2a",)))
    assert rows[0]["status"] == "ok" and rows[0]["kind"] == "moe" and rows[0]["experts"] == 128
    rows = T.run_train(sh, _settings(impls=("nccl-a2a",), dtype="mxfp8"))
    assert rows[0]["status"] == "unavailable" and "bf16 only" in rows[0]["reason"]


def test_train_rank_writes_env_and_rows(tmp_path, monkeypatch):
    _fake_ops(monkeypatch)
    out = tmp_path / "train.jsonl"
    T.train_rank(0, 1, dict(model="llama3-8b", seq=8, batch=2, hidden=32, head_dim=16),
                 dict(steps=2, warmup=1), str(out), ["kosmos", "bench", "train"], cpu=True)
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert lines[0]["type"] == "env" and lines[0]["bench"] == "train"
    assert [l["impl"] for l in lines[1:]] == ["nccl+cublas", "kosmos"]
    assert all(l["run_id"] == lines[0]["run_id"] for l in lines[1:])
    from kosmos_bench.report import load_results
    _, results = load_results([out])
    assert len(results) == 2


def test_bench_train_dry_run(capsys):
    import typer
    with pytest.raises(typer.Exit) as e:
        T.bench_train(model="llama3-8b", scale=0.0625, tp=2, dry_run=True)
    assert e.value.exit_code == 0
    text = capsys.readouterr().out
    assert "nccl+cublas (baseline)" in text and "hidden: 256" in text
    with pytest.raises(typer.Exit) as e:
        T.bench_train(impl="nccl-a2a", dry_run=True)
    assert e.value.exit_code == 2


# ------------------------------------------------------------------ world 2 over gloo


def _gloo_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _fake_ops()
        rows = T.run_train(_tiny(world), _settings())
        _check_rows(rows, world)
        q.put((rank, ("ok", rows[0]["losses"])))
    except BaseException as e:  # noqa: BLE001 -- reported to the parent
        q.put((rank, (f"{type(e).__name__}: {e}", None)))
    finally:
        dist.destroy_process_group()


def test_world2_over_gloo(monkeypatch):
    got = spawn_gloo(_gloo_rank, 2)
    assert got[0][0] == "ok" and got[1][0] == "ok", got
    assert got[0][1] == got[1][1]  # every rank reports the same (summed) losses
    # the same model at world 1 (one process holding every shard) trains the same way
    _fake_ops(monkeypatch)
    single = T.run_train(_tiny(2), _settings(impls=("nccl+cublas",)))[0]["losses"]
    assert max(abs(a - b) / b for a, b in zip(got[0][1], single)) < 1e-2


# ------------------------------------------------------------------ report


def test_report_train_table_and_loss_figure(tmp_path):
    from kosmos_bench.report import load_results, report_main, train_table
    from kosmos_bench.report.charts import _loss_figure, loss_chart
    _, results = load_results([FIXTURE])
    table = train_table(results)
    assert list(table["impl"]) == ["nccl+cublas", "kosmos", "kosmos"]
    ok = table[table["status"] == "ok"]
    kos = ok[ok["impl"] == "kosmos"].iloc[0]
    assert kos["speedup"] == pytest.approx(120.0 / 100.0)
    assert kos["final_loss"] == pytest.approx(0.95)
    failed = table[table["status"] == "failed"].iloc[0]
    assert math.isnan(failed["speedup"]) and "trains differently" in failed["reason"]
    fig = _loss_figure(table)
    ax = fig.axes[0]
    labels = [line.get_label() for line in ax.get_lines()]
    assert any("kosmos" in l for l in labels) and any("nccl+cublas" in l for l in labels)
    png = tmp_path / "loss.png"
    assert loss_chart(table, png) and png.stat().st_size > 0
    # kosmos report on the file: the table rendered in every format, the figure beside --chart
    for fmt in ("md", "csv", "html", "text"):
        out = tmp_path / f"r.{fmt}"
        assert report_main([FIXTURE], fmt=fmt, out=out, chart=tmp_path / "c.png") == 0
        text = out.read_text()
        assert "nccl+cublas" in text and "kosmos" in text and "train" in text.lower()
    assert (tmp_path / "c.png").exists()


# ------------------------------------------------------------------ GPU


@pytest.mark.gpu
def test_gpu_tiny_proxy_end_to_end():
    sh = T.proxy_shape("llama3-8b", seq=256, batch=2, hidden=256, head_dim=64)
    rows = T.run_train(sh, T.TrainSettings(steps=5, warmup=2), "cuda")
    assert [r["status"] for r in rows] == ["ok", "ok"], [r["reason"] for r in rows]
    assert all(r["peak_mem_bytes"] > 0 and r["step_ms"] > 0 for r in rows)
    assert rows[1]["loss_max_rel_diff"] < T.LOSS_RTOL
