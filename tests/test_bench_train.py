"""kosmos_bench/train.py (the training proxies of `kosmos bench train`) and their report.

On the CPU the fused ops are replaced by the pure-torch references, as in tests/test_nn_tp.py (``_fake_ops``):
what is tested is that the kosmos proxy (kosmos.nn layers) and the nccl+cublas proxy (the bench's own
autograd Functions over kosmos.reference) build the same model from one seed and train it the same way, at
world 1 in-process and at world 2 over gloo; the row schema; a perturbed implementation recorded failed; the
report's train table and loss figure from a fixture. The GPU test runs a tiny proxy end to end on CUDA.

The baselines swapped in (issue 16), on CPU ranks over gloo: nccl-a2a's differentiable all-to-all and deepep's
autograd Functions (tests/test_deepep.py's stand-in deep_ep, with cached-mode dispatch and combine's
topk_weights) -- forward (nccl-a2a: bitwise the bench's moe_forward_a2a) and every gradient against fp32 autograd
in one process holding all ranks' tokens and experts; the MoE proxy at W = 2 (data-parallel attention) trained
by both, matching each other and the same proxy at W = 1; torch-async-tp's Functions with torch's own fallbacks
of the fused ops (their math, not the kernels), and its availability (W = 1, CPU, gloo, mxfp8); the default
--impl lists with their unavailable rows; the one-GPU (KOSMOS_RANKS_ON_ONE_GPU) launch and dry run. A GPU test
runs the MoE proxy with both ranks on one GPU.
"""
import dataclasses
import importlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from multiproc import spawn_gloo, finish_gloo
from test_nn_tp import _fake_ops

from kosmos.models import MoEModel
from kosmos_bench import moe
from kosmos_bench import train as T

FIXTURE = Path(__file__).parent / "fixtures" / "train-sample.jsonl"
ROW_KEYS = {"type", "bench", "model", "kind", "layers", "seq", "batch", "hidden", "ffn", "heads", "kv_heads",
            "head_dim", "experts", "top_k", "scale", "world", "dtype", "impl", "baseline", "steps", "warmup", "status",
            "reason", "step_ms", "step_p20_ms", "step_p80_ms", "step_times_ms", "tokens_per_s", "peak_mem_bytes",
            "losses", "final_loss", "loss_rtol", "loss_max_rel_diff", "extra"}
PAIR = ("nccl+cublas", "kosmos")


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
    with pytest.raises(ValueError, match="divide by the TP size 2"):
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
    assert [r["impl"] for r in rows] == list(PAIR)
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
    assert [r["impl"] for r in rows] == list(T.DENSE_IMPLS)  # the default: every implementation
    assert [r["status"] for r in rows] == ["ok", "unavailable", "ok"], [r["reason"] for r in rows]
    assert "nothing to overlap" in rows[1]["reason"]  # torch-async-tp at W = 1


def test_perturbed_implementation_is_failed(monkeypatch):
    _fake_ops(monkeypatch)

    def build(shape, impl, **kw):
        proxy = T.build_proxy(shape, impl, **kw)
        if impl == "kosmos":  # trains another model: a wrong weight
            with torch.no_grad():
                proxy.blocks[0].fc2.weight.mul_(3.0)
        return proxy
    got = []
    rows = T.run_train(_tiny(), _settings(impls=PAIR), build=build, on_row=got.append)
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
    rows = T.run_train(_tiny(), _settings(impls=PAIR), build=build)
    assert rows[1]["status"] == "failed" and rows[1]["reason"] == "RuntimeError: boom"


def test_moe_proxy_world1_baseline_and_kosmos_unavailable_paths():
    sh = _tiny(model="qwen3-235b")
    rows = T.run_train(sh, _settings(impls=("nccl-a2a",)))
    assert rows[0]["status"] == "ok" and rows[0]["kind"] == "moe" and rows[0]["experts"] == 128
    rows = T.run_train(_tiny(model="qwen3-235b", head_dim=32), _settings(impls=("nccl-a2a", "deepep"),
                                                                         dtype="mxfp8", steps=1))
    assert rows[0]["status"] == "ok", rows[0]["reason"]  # the MX layer with the MX backward (moe_mx)
    assert rows[1]["status"] == "unavailable" and "MXFP8" in rows[1]["reason"]


def _mx_reference_moe_forward(x, router_weight, w13, w2, *, top_k, routing, bias=None, group=None,
                              return_routing=False, save_gu=False, precision="bf16", **kw):
    """kosmos.moe_forward on the CPU (the op needs CUDA): the reference layer (MX at precision "mxfp8", on the MX
    values nn.MoE passes), its routing decision returned as the kernel returns it."""
    from kosmos.reference import moe as mr
    weights, experts = mr.route(x, router_weight, top_k, routing, bias=bias, **kw)
    y = mr.apply_routing_ref(x, weights, experts, w13, w2, mx=precision == "mxfp8").to(torch.bfloat16)
    return (y, weights, experts) if return_routing else y


@pytest.mark.interpreter
def test_moe_proxy_world1_mxfp8_kosmos_matches_baseline(monkeypatch):
    """The MoE proxy at mxfp8, W = 1: kosmos.nn.MoE(dtype="mxfp8") -- its forward stood in by the MX reference
    layer, its MX backward on the kernels under the interpreter -- and the nccl-a2a baseline's MX layer
    (moe_mx.moe_forward_a2a_mx_train) train the same model: every step's loss within LOSS_RTOL (measured: 1.4e-3
    over three steps; the bf16 baseline's losses 2e-3 from the MX ones), and the losses move."""
    import kosmos.nn as knn
    from kosmos.models import MOE_MODELS
    _fake_ops(monkeypatch)
    monkeypatch.setattr(knn, "moe_forward", _mx_reference_moe_forward)
    monkeypatch.setitem(MOE_MODELS, "tiny-moe", MoEModel("tiny-moe", hidden=64, expert_ffn=32, experts=8, top_k=2,
                                                          routing="softmax"))
    sh = T.proxy_shape("tiny-moe", seq=8, batch=2, hidden=64, head_dim=32, layers=1)
    rows = T.run_train(sh, _settings(impls=("nccl-a2a", "kosmos"), dtype="mxfp8", steps=2))
    assert [r["status"] for r in rows] == ["ok", "ok"], [r["reason"] for r in rows]
    assert rows[1]["loss_max_rel_diff"] < T.LOSS_RTOL, rows[1]
    assert rows[0]["losses"][1] != rows[0]["losses"][0]


def test_train_rank_writes_env_and_rows(tmp_path, monkeypatch):
    _fake_ops(monkeypatch)
    out = tmp_path / "train.jsonl"
    T.train_rank(0, 1, dict(model="llama3-8b", seq=8, batch=2, hidden=32, head_dim=16),
                 dict(steps=2, warmup=1), str(out), ["kosmos", "bench", "train"], cpu=True)
    lines = [json.loads(l) for l in out.read_text().splitlines()]
    assert lines[0]["type"] == "env" and lines[0]["bench"] == "train"
    assert [l["impl"] for l in lines[1:]] == ["nccl+cublas", "torch-async-tp", "kosmos"]
    assert [l["status"] for l in lines[1:]] == ["ok", "unavailable", "ok"]  # an unavailable row fails nothing
    assert all(l["extra"] == {} for l in lines[1:])  # on the CPU: no ranks_on_one_gpu
    assert all(l["run_id"] == lines[0]["run_id"] for l in lines[1:])
    from kosmos_bench.report import load_results
    _, results = load_results([out])
    assert len(results) == 3


def _train_cli(*args, **kw):
    from typer.testing import CliRunner

    from kosmos_bench.cli import app
    return CliRunner().invoke(app, ["bench", "train", *map(str, args)], **kw)


def test_bench_train_dry_run(tmp_path):
    r = _train_cli("--model", "llama3-8b", "--scale", "0.0625", "--tp", "2", "--out", tmp_path / "t.jsonl",
                   "--dry-run")
    assert r.exit_code == 0, r.output
    assert "nccl+cublas (baseline)" in r.stdout and "hidden: 256" in r.stdout and "world: 2 (--tp 2)" in r.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written
    r = _train_cli("--impl", "nccl-a2a", "--dry-run")
    assert r.exit_code == 2 and r.stderr.strip() == "error: --impl nccl-a2a: the dense proxy has nccl+cublas, " \
        "torch-async-tp, kosmos", r.output


def _one_line_error(r, needle):
    lines = r.stderr.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.output


@pytest.mark.parametrize("args, needle", [
    (["--tp", "16"], "--tp 16: give 1 to 8 ranks"),
    (["--tp", "0"], "--tp 0: give 1 to 8 ranks"),
    (["--tp", "3"], "--tp 3: --seq 4096 must divide by the TP size 3"),
    (["--model", "deepseek-v3", "--tp", "3"], "--tp 3: deepseek-v3: its 256 experts do not split evenly over 3"),
    (["--scale", "2"], "--scale 2.0: give a factor in (0, 1]"),
    (["--hidden", "99999"], "--hidden 99999: give a size from 1 to the model's 4096"),
    (["--steps", "0"], "--steps 0: give an integer >= 1"),
    (["--warmup", "-1"], "--warmup -1: give an integer >= 0"),
    (["--dtype", "fp8"], "--dtype 'fp8': choose from bf16, mxfp8"),
    (["--out", "/proc/nope/x.jsonl"], "--out /proc/nope/x.jsonl: cannot create files in /proc"),
])
def test_bench_train_input_errors_name_the_option(args, needle):
    """One line naming the option the user gave, in a dry run too (the world size, --out's folder)."""
    _one_line_error(_train_cli(*args, "--dry-run"), needle)


def test_bench_train_without_a_gpu_refuses_at_once(tmp_path):
    """No GPU: one line and exit 2 before anything trains or is written (a subprocess: the real import path)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, "-m", "kosmos_bench.cli", "bench", "train"], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stdout == "", r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == ["error: no CUDA GPU is visible: KOSMOS benchmarks need NVIDIA GPUs "
                                             "(Hopper: H100/H200); --dry-run shows the plan without one"], r.stderr
    assert list(tmp_path.iterdir()) == []  # no results/ folder, no file


def test_bench_train_failed_implementation_fails_the_run(monkeypatch, tmp_path):
    """An implementation that raises (kosmos's ops on CPU tensors) is recorded as failed with its reason, the
    others still run, and the command exits 1 with a one-line summary. The launch runs the real rank function in
    this process on the CPU."""
    from kosmos_bench import launcher
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 1)
    monkeypatch.setattr(launcher, "spawn", lambda fn, world, *args: fn(0, world, *args, cpu=True))
    out = tmp_path / "t.jsonl"
    r = _train_cli("--hidden", "64", "--head-dim", "16", "--seq", "16", "--steps", "2", "--warmup", "1",
                   "--tp", "1", "--out", out)
    rows = [json.loads(line) for line in out.read_text().splitlines()][1:]
    assert [(x["impl"], x["status"]) for x in rows] == [("nccl+cublas", "ok"), ("torch-async-tp", "unavailable"),
                                                         ("kosmos", "failed")]
    assert rows[2]["reason"] == "ValueError: a_shard must be a CUDA tensor, got cpu"
    assert r.exit_code == 1, r.output
    assert r.stderr.strip().splitlines()[-1] == f"error: 1 of 3 rows failed (kosmos: 1); their reasons are in " \
        f"the rows of {out}", r.stderr


# ------------------------------------------------------------------ world 2 over gloo


def _gloo_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _fake_ops()
        rows = T.run_train(_tiny(world), _settings(impls=PAIR + ("torch-async-tp",)))
        async_tp = rows.pop()  # on CPU ranks over gloo: no symmetric memory
        assert async_tp["status"] == "unavailable" and "NCCL" in async_tp["reason"], async_tp["reason"]
        _check_rows(rows, world)
        q.put((rank, ("ok", rows[0]["losses"])))
    except BaseException as e:  # noqa: BLE001 -- reported to the parent
        q.put((rank, (f"{type(e).__name__}: {e}", None)))
    finally:
        finish_gloo()


def test_world2_over_gloo(monkeypatch):
    got = spawn_gloo(_gloo_rank, 2)
    assert got[0][0] == "ok" and got[1][0] == "ok", got
    assert got[0][1] == got[1][1]  # every rank reports the same (summed) losses
    # the same model at world 1 (one process holding every shard) trains the same way
    _fake_ops(monkeypatch)
    single = T.run_train(_tiny(2), _settings(impls=("nccl+cublas",)))[0]["losses"]
    assert max(abs(a - b) / b for a, b in zip(got[0][1], single)) < 1e-2


# ------------------------------------------------------------------ the baselines swapped in (issue 16)


def test_moe_shape_does_not_depend_on_the_ep_size():
    """The MoE proxy's attention is data-parallel: its sizes are the same at any W (only the experts split)."""
    one, two = (T.proxy_shape("deepseek-v3", seq=1024, scale=0.125, tp=w) for w in (1, 2))
    assert one == two and one.hidden == 896 and one.experts == 256
    with pytest.raises(ValueError, match="experts do not split"):
        T.proxy_shape("qwen3-235b", hidden=64, tp=3)


def test_async_tp_availability():
    sh = _tiny()
    assert "nothing to overlap" in T.async_tp_problem(1)
    assert "MXFP8" in T.async_tp_problem(2, "mxfp8", "cuda", "nccl")
    assert "the CPU" in T.async_tp_problem(2, "bf16", "cpu", "gloo")
    assert "a gloo group" in T.async_tp_problem(2, "bf16", "cuda", "gloo")  # every rank on one GPU
    assert T.async_tp_problem(2, "bf16", "cuda", "nccl") is None  # this torch has the fused ops
    assert T.unavailable_reason(sh, "torch-async-tp", 1) == T.async_tp_problem(1)
    # every rank on one GPU over gloo: KOSMOS through CUDA IPC, the baselines as they are; async-TP cannot
    assert T.unavailable_reason(sh, "kosmos", 2, device="cuda", backend="gloo") is None
    assert T.unavailable_reason(sh, "nccl+cublas", 2, device="cuda", backend="gloo") is None
    assert "gloo" in T.unavailable_reason(sh, "torch-async-tp", 2, device="cuda", backend="gloo")
    moe = T.proxy_shape("deepseek-v3", seq=16, batch=1, scale=0.125, tp=2)
    assert T.unavailable_reason(moe, "kosmos", 2, device="cuda", backend="gloo") is None
    assert "CPU ranks" in T.unavailable_reason(moe, "kosmos", 2, device="cpu", backend="gloo")
    assert T.unavailable_reason(sh, "kosmos", 2, device="cpu", backend="gloo") is None  # CPU tests: fake ops


def test_w1_unavailable_rows_never_fail_the_run(monkeypatch):
    import test_deepep
    _fake_ops(monkeypatch)
    monkeypatch.setitem(sys.modules, "deep_ep", test_deepep._fake_deep_ep())
    rows = T.run_train(_tiny(model="qwen3-235b"), _settings(steps=2))  # the default: every MoE implementation
    assert [r["impl"] for r in rows] == list(T.MOE_IMPLS) == ["nccl-a2a", "deepep", "kosmos"]
    # kosmos.nn.MoE's kernel runs on CUDA only: a failed row on the CPU, which fails nothing either
    assert [r["status"] for r in rows] == ["ok", "unavailable", "failed"], [r["reason"] for r in rows]
    assert "2, 4 or 8 ranks, not 1" in rows[1]["reason"] and "CUDA" in rows[2]["reason"]
    monkeypatch.delitem(sys.modules, "deep_ep")
    monkeypatch.setattr(importlib, "import_module", _no_deep_ep(importlib.import_module))
    assert "deep_ep is not importable" in T.unavailable_reason(_tiny(model="qwen3-235b"), "deepep", 2)


def _no_deep_ep(real):
    def import_module(name, *a, **kw):
        if name == "deep_ep":
            raise ImportError("No module named 'deep_ep'")
        return real(name, *a, **kw)
    return import_module


def test_a2a_module_forward_is_the_bench_nccl_a2a_w1():
    """The proxy's nccl-a2a module (A2AMoE) is the bench's nccl-a2a layer on its parameters, bit for bit."""
    from kosmos.reference.moe import moe_forward_a2a
    m = GRAD_MODELS[1]
    x, wr, bias, _ = moe.make_router_inputs(m, 48, "uniform", 0, 0)
    w13, w2 = moe.make_expert_weights(m, 1, 0, 0)
    kw = moe.route_kwargs(m, bias)
    kw.pop("routing")
    ref = moe_forward_a2a(x, wr, w13, w2, top_k=m.top_k, routing=m.routing, fp32=False, **kw)
    route_kw = {k: v for k, v in kw.items() if k != "bias"}
    layer = T.A2AMoE(m.hidden, m.expert_ffn, m.experts, m.top_k, routing=m.routing, **route_kw)
    with torch.no_grad():
        layer.router_weight.copy_(wr), layer.w13.copy_(w13), layer.w2.copy_(w2)
        if layer.bias is not None:
            layer.bias.copy_(bias)
    assert torch.equal(layer(x), ref)


def test_bench_train_dry_run_ranks_on_one_gpu(monkeypatch):
    """The lead's one-GPU command (KOSMOS_RANKS_ON_ONE_GPU=1, --tp 2), as a dry run."""
    from kosmos_bench import launcher
    monkeypatch.setenv(launcher.ONE_GPU_ENV, "1")
    r = _train_cli("--model", "deepseek-v3", "--layers", "2", "--seq", "1024", "--scale", "0.125", "--tp", "2",
                   "--steps", "10", "--impl", "nccl-a2a,deepep,kosmos", "--dry-run")
    assert r.exit_code == 0, r.output
    text = r.stdout
    assert "world: 2 (--tp 2) (EP" in text and "hidden: 896" in text and "every rank on cuda:0 over gloo" in text
    assert "  nccl-a2a (baseline)\n" in text  # available
    if torch.cuda.is_available():  # CUDA ranks on one GPU: KOSMOS through CUDA IPC (runtime.py)
        assert "  kosmos\n" in text and "kosmos unavailable" not in text
    else:  # this machine's ranks would be CPU ones: the one-launch MoE forward cannot run there
        assert "kosmos unavailable: kosmos.nn.MoE at W > 1 needs CUDA ranks" in text
    assert "deepep" in text


def test_bench_train_more_ranks_than_gpus(monkeypatch, tmp_path):
    from kosmos_bench import launcher
    launched = []
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 1)
    monkeypatch.setattr(launcher, "spawn", lambda fn, world, *args: launched.append((fn, world, args)))
    monkeypatch.delenv(launcher.ONE_GPU_ENV, raising=False)
    args = ("--model", "deepseek-v3", "--seq", "64", "--hidden", "64", "--tp", "2", "--impl", "nccl-a2a", "--out",
            tmp_path / "t.jsonl")
    r = _train_cli(*args)
    _one_line_error(r, "asked for 2 GPUs but only 1 are visible")
    assert not launched
    monkeypatch.setenv(launcher.ONE_GPU_ENV, "1")
    r = _train_cli(*args)
    assert r.exit_code == 0, r.output
    assert launched and launched[0][0] is T.train_rank and launched[0][1] == 2


def test_row_extra_from_the_settings():
    rows = T.run_train(_tiny(model="qwen3-235b"), _settings(impls=("nccl-a2a",), steps=1,
                                                             extra={"ranks_on_one_gpu": True}))
    assert rows[0]["extra"] == {"ranks_on_one_gpu": True}


GRAD_MODELS = [
    MoEModel("grad-softmax", hidden=64, expert_ffn=32, experts=8, top_k=2, routing="softmax"),
    MoEModel("grad-grouped", hidden=64, expert_ffn=32, experts=16, top_k=4, routing="sigmoid-grouped", n_group=4,
             topk_group=2, routed_scaling=2.5),
]
GRAD_TOL = 3e-2  # moe.GRAD_TOLERANCE: bf16 gradients through several GEMMs


def _moe_grads_vs_single_process(rank, world, cls, check):
    """``cls`` (A2AMoE / DeepEPMoE) at W ranks: forward (nccl-a2a: bitwise the bench's moe_forward_a2a) and every
    gradient against fp32 autograd through moe_forward_ref_local on every rank's tokens and experts in this one
    process (the router's gradient summed over the ranks, as the proxy's all-reduce does)."""
    from kosmos.reference.moe import moe_forward_a2a, moe_forward_ref_local
    from kosmos.reference import rel_err
    for m, mask in [(m, mask) for m in GRAD_MODELS for mask in (None, "rank0")]:
        xs, bias = [], None
        for r in range(world):
            x, wr, bias, _ = moe.make_router_inputs(m, 24, "uniform", r, 1)
            xs.append(x)
        if mask:  # every token to rank 0's experts: rank 1 receives nothing (and must still join the backward)
            for x in xs:
                x[:, 0] = 1.0
            wr = wr.clone()
            wr[m.experts // world:, 0] = -30.0
        ws = [moe.make_expert_weights(m, world, r, 1) for r in range(world)]
        dys = [torch.randn(24, m.hidden, generator=torch.Generator().manual_seed(99 + r)).to(torch.bfloat16)
               for r in range(world)]
        kw = dict(renormalize=m.renormalize, routed_scaling=m.routed_scaling)
        if m.routing == "sigmoid-grouped":
            kw.update(n_group=m.n_group, topk_group=m.topk_group)
        layer = cls(m.hidden, m.expert_ffn, m.experts, m.top_k, routing=m.routing, **kw)
        with torch.no_grad():
            layer.router_weight.copy_(wr)
            layer.w13.copy_(ws[rank][0])
            layer.w2.copy_(ws[rank][1])
            if bias is not None:
                layer.bias.copy_(bias)
        x = xs[rank].clone().requires_grad_(True)
        y = layer(x)
        y.backward(dys[rank])
        if cls is T.A2AMoE:
            same = moe_forward_a2a(xs[rank], wr, *ws[rank], top_k=m.top_k, routing=m.routing, fp32=False,
                                   **({"bias": bias} if bias is not None else {}), **kw)
            check(torch.equal(y.detach(), same), f"{m.name}: the forward is not moe_forward_a2a(fp32=False)'s")
        d_router = layer.router_weight.grad.float()
        dist.all_reduce(d_router)
        leaves = [t.float().requires_grad_(True) for t in xs + [wr] + [w for pair in ws for w in pair]]
        xs_f, wr_f, w13s_f, w2s_f = leaves[:world], leaves[world], leaves[world + 1::2], leaves[world + 2::2]
        refs = moe_forward_ref_local(xs_f, wr_f, w13s_f, w2s_f, top_k=m.top_k, routing=m.routing,
                                     **({"bias": bias} if bias is not None else {}), **kw)
        check(rel_err(y, refs[rank]) < 1e-2, f"{m.name}: forward rel_err {rel_err(y, refs[rank]):.2e}")
        sum((r * d.float()).sum() for r, d in zip(refs, dys)).backward()
        for what, got, ref in (("dx", x.grad, xs_f[rank].grad), ("d_router", d_router, wr_f.grad),
                               ("dw13", layer.w13.grad, w13s_f[rank].grad), ("dw2", layer.w2.grad, w2s_f[rank].grad)):
            if mask and rank == 1 and what in ("dw13", "dw2"):  # no rows: no gradient (None or zeros)
                check(got is None or not got.any(), f"{cls.__name__} {m.name} {what}: nonzero without rows")
                check(not ref.any(), f"{m.name} {what}: the reference's is nonzero")
                continue
            err = rel_err(got, ref)
            check(err < GRAD_TOL, f"{cls.__name__} {m.name} {mask} {what}: rel_err {err:.2e} >= {GRAD_TOL}")


def _moe_gloo_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        import test_deepep
        sys.modules["deep_ep"] = test_deepep._fake_deep_ep()
        failures = []
        check = lambda ok, what: ok or failures.append(what)  # noqa: E731
        for cls in (T.A2AMoE, T.DeepEPMoE):
            _moe_grads_vs_single_process(rank, world, cls, check)
        moe.deepep_release()
        test_deepep._Buffer.log.clear()
        rows = T.run_train(_moe_tiny(), _settings(impls=T.MOE_IMPLS))
        log = [k for k, _ in test_deepep._Buffer.log]
        q.put((rank, ("ok", failures, [(r["impl"], r["status"], r["reason"], r["losses"], r["world"])
                                        for r in rows], log)))
    except BaseException as e:  # noqa: BLE001 -- reported to the parent
        import traceback
        q.put((rank, (f"{type(e).__name__}: {e}\n{traceback.format_exc()}", None, None, None)))
    finally:
        finish_gloo()


def _moe_tiny(batch=2):
    return T.proxy_shape("deepseek-v3", seq=8, batch=batch, hidden=64, head_dim=16, tp=2)


def test_moe_world2_nccl_a2a_and_deepep_over_gloo():
    """At W = 2 over gloo (CPU ranks, the stand-in deep_ep of tests/test_deepep.py): nccl-a2a's and deepep's
    forward and gradients against one process holding everything; the MoE proxy (data-parallel attention, EP
    experts) trains with nccl-a2a, deepep agrees with it, kosmos is unavailable; nccl-a2a at W = 2 trains as
    the same proxy at W = 1 (every rank's sequences in one batch)."""
    got = spawn_gloo(_moe_gloo_rank, 2, timeout_s=600)
    for rank in (0, 1):
        status, failures, rows, log = got[rank]
        assert status == "ok", status
        assert failures == [], (rank, failures)
        assert [(i, s) for i, s, *_ in rows] == [("nccl-a2a", "ok"), ("deepep", "ok"), ("kosmos", "unavailable")], rows
        assert "needs CUDA ranks" in rows[2][2] and all(r[4] == 2 for r in rows)
        assert "cached" in log and log[-1] == "destroy"  # the combine's backward: DeepEP's cached dispatch; freed
    a2a, deepep = got[0][2][0][3], got[0][2][1][3]
    assert a2a == got[1][2][0][3]  # every rank reports the same (summed) losses
    assert max(abs(a - b) / b for a, b in zip(deepep, a2a)) < T.LOSS_RTOL
    assert a2a[0] != a2a[-1]  # it trains
    single = T.run_train(dataclasses.replace(_moe_tiny(), batch=4), _settings(impls=("nccl-a2a",)))[0]
    assert single["status"] == "ok" and single["world"] == 1
    assert max(abs(a - b) / b for a, b in zip(a2a, single["losses"])) < T.LOSS_RTOL


def _async_tp_gloo_rank(rank, world, port, q):
    """torch-async-tp's autograd Functions on CPU ranks over gloo, its fused ops replaced by torch's own fallbacks
    (the ops' Meta implementations: funcol all-gather / reduce-scatter + matmul): the math of the backward, not
    the fused kernels."""
    import types
    import torch.distributed._symmetric_memory as symm_mem
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fallback = types.SimpleNamespace(fused_all_gather_matmul=symm_mem._fused_all_gather_matmul_fallback,
                                         fused_matmul_reduce_scatter=symm_mem._fused_matmul_reduce_scatter_fallback)
        T._symm_ops = lambda: fallback
        T.async_tp_problem = lambda *a, **kw: None
        errs = []  # each Function's output and gradients against the nccl+cublas one's (same math, same rounding)
        g = torch.Generator().manual_seed(5 + rank)
        for ours, ref, rows_in in ((T._AGMatmulAsyncTP, T._AGMatmulRef, 8), (T._MatmulRSAsyncTP, T._MatmulRSRef, 16)):
            a0 = torch.randn(rows_in, 32, generator=g).to(torch.bfloat16)
            w0 = (torch.randn(24, 32, generator=torch.Generator().manual_seed(3)) / 6).to(torch.bfloat16)
            dy = torch.randn(16 if ours is T._AGMatmulAsyncTP else 8, 24, generator=g).to(torch.bfloat16)
            outs = []
            for fn in (ours, ref):
                a, w = a0.clone().requires_grad_(True), w0.clone().requires_grad_(True)
                y = fn.apply(a, w.t(), None)
                y.backward(dy)
                outs.append((y.detach(), a.grad, w.grad))
            errs += [(ours.__name__, i, (p.float() - r.float()).norm().item() / r.float().norm().item())
                     for i, (p, r) in enumerate(zip(*outs))]
        rows = T.run_train(_tiny(world), _settings(impls=("nccl+cublas", "torch-async-tp")))
        q.put((rank, [(r["status"], r["reason"], r["losses"], r["loss_max_rel_diff"]) for r in rows] + [errs]))
    except BaseException as e:  # noqa: BLE001
        q.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        finish_gloo()


def test_async_tp_functions_over_gloo_with_torch_fallbacks():
    got = spawn_gloo(_async_tp_gloo_rank, 2)
    for rank in (0, 1):
        assert isinstance(got[rank], list), got[rank]
        (s0, r0, base, _), (s1, r1, ours, diff), errs = got[rank]
        assert all(e < 1e-2 for *_, e in errs), errs  # y, da, dW of the column (AG) and row (RS) Functions
        assert s0 == "ok" and s1 == "ok", (r0, r1)
        assert diff < 1e-2 and base[0] != base[-1]


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
@pytest.mark.slow
def test_gpu_tiny_proxy_end_to_end():
    sh = T.proxy_shape("llama3-8b", seq=256, batch=2, hidden=256, head_dim=64)
    rows = T.run_train(sh, T.TrainSettings(steps=5, warmup=2), "cuda")
    by = {r["impl"]: r for r in rows}
    assert [r["impl"] for r in rows] == ["nccl+cublas", "torch-async-tp", "kosmos"], [r["impl"] for r in rows]
    # torch's async-TP fused ops need a TP group of >= 2 ranks: at W = 1 the row says so instead of timing
    assert by["torch-async-tp"]["status"] == "unavailable", by["torch-async-tp"]
    assert by["torch-async-tp"]["reason"], by["torch-async-tp"]
    timed = [by["nccl+cublas"], by["kosmos"]]
    assert [r["status"] for r in timed] == ["ok", "ok"], [r["reason"] for r in timed]
    assert all(r["peak_mem_bytes"] > 0 and r["step_ms"] > 0 for r in timed)
    assert by["kosmos"]["loss_max_rel_diff"] < T.LOSS_RTOL


def _gpu_moe_rank(rank, world, out_dir):
    from multiproc import Checks
    import test_deepep
    check = Checks(rank)
    try:
        sh = T.proxy_shape("deepseek-v3", seq=256, batch=1, scale=0.125, tp=world)
        rows = T.run_train(sh, T.TrainSettings(impls=T.MOE_IMPLS, steps=5, warmup=1), "cuda")
        by = {r["impl"]: r for r in rows}
        check(by["nccl-a2a"]["status"] == "ok", f"nccl-a2a: {by['nccl-a2a']['reason']}")
        if test_deepep._deepep_import_problem() is None:
            check(by["deepep"]["status"] == "ok", f"deepep: {by['deepep']['reason']}")
        else:
            check(by["deepep"]["status"] == "unavailable", f"deepep: {by['deepep']['status']}")
        k = by["kosmos"]
        check(k["status"] == "ok", f"kosmos: {k['status']} {k['reason']}")
        check(k["status"] != "ok" or k["loss_max_rel_diff"] < T.LOSS_RTOL, f"kosmos losses: {k['losses']}")
    finally:
        check.finish(out_dir)


def _gpu_llama_rank(rank, world, out_dir):
    from multiproc import Checks
    check = Checks(rank)
    try:
        sh = T.proxy_shape("llama3-8b", seq=256 * world, batch=2, hidden=256 * world, head_dim=64, tp=world)
        rows = T.run_train(sh, T.TrainSettings(steps=5, warmup=1), "cuda")
        by = {r["impl"]: r for r in rows}
        check(by["nccl+cublas"]["status"] == "ok", f"nccl+cublas: {by['nccl+cublas']['reason']}")
        k = by["kosmos"]
        check(k["status"] == "ok", f"kosmos: {k['status']} {k['reason']}")
        check(k["status"] != "ok" or k["loss_max_rel_diff"] < T.LOSS_RTOL, f"kosmos losses: {k['losses']}")
        a = by.get("torch-async-tp")
        check(a is None or a["status"] == "unavailable", f"torch-async-tp over gloo: {a and a['status']}")
    finally:
        check.finish(out_dir)


def _two_ranks_on_one_gpu(fn, tmp_path):
    from kosmos_bench import launcher
    launcher.spawn_one_gpu(fn, 2, str(tmp_path), timeout_s=600)
    for r in range(2):
        f = tmp_path / f"rank{r}.txt"
        assert f.exists() and f.read_text() == "", f.read_text() if f.exists() else f"rank {r} did not finish"


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_moe_two_ranks_on_one_gpu(tmp_path):
    """The MoE proxy at W = 2 with both ranks on one GPU over gloo (launcher.spawn_one_gpu): nccl-a2a trains,
    deepep (when deep_ep imports) and kosmos (its kernels' symmetric buffers mapped by CUDA IPC) agree with it."""
    _two_ranks_on_one_gpu(_gpu_moe_rank, tmp_path)


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_llama_two_ranks_on_one_gpu(tmp_path):
    """The llama3 proxy at TP = 2 with both ranks on one GPU over gloo: kosmos (CUDA IPC) trains as nccl+cublas
    (whose collectives go through host copies over gloo); torch async-TP is unavailable there."""
    _two_ranks_on_one_gpu(_gpu_llama_rank, tmp_path)
