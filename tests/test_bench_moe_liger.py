"""The MoE bench's Liger-Kernel baseline (``liger``: kosmos_bench/moe_liger.py).

On the CPU: its registration, the "unavailable" reasons (liger_kernel missing, broken, without a fused MoE; no
CUDA; EP > 1), the layout conversion against torch math, and -- where the carried wheel (.whl/liger_kernel-*.whl)
or an installed liger_kernel is at hand -- the baseline's maker with Liger's real Triton kernels under the CPU
interpreter (fp32: bf16 does not run there) against the bench's fp32 references, in a subprocess (TRITON_INTERPRET
and LIGER_FUSED_MOE_AUTOTUNE are read when Liger's kernels are defined; the wheel is never installed into the
venv: ``pip install --no-deps --target`` a temporary folder). On a GPU (``gpu``, ``slow``): the liger rows of a tiny
point in every direction, ok within the bars of the hf-* rows."""
import glob
import importlib.abc
import json
import os
import subprocess
import sys
import types

import pytest
import torch

from kosmos.models import MOE_MODELS, MoEModel
from kosmos.reference.moe import expert_ffn
from kosmos_bench import harness, moe, moe_liger, registry, timing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOT_INSTALLED = ("liger_kernel is not installed (pip install liger-kernel; on the GPU machine carry "
                 ".whl/liger_kernel-*.whl)")
TINY = {
    "tiny-liger": MoEModel("tiny-liger", hidden=64, expert_ffn=32, experts=8, top_k=2, routing="softmax",
                           renormalize=True),
    "tiny-liger-grouped": MoEModel("tiny-liger-grouped", hidden=64, expert_ffn=32, experts=16, top_k=4,
                                   routing="sigmoid-grouped", n_group=4, topk_group=2, routed_scaling=2.5),
}


@pytest.fixture
def tiny_models(monkeypatch):
    for name, m in TINY.items():
        monkeypatch.setitem(MOE_MODELS, name, m)


class _Finder(importlib.abc.MetaPathFinder):
    """Finds nothing named liger_kernel*: raises ``error(name)`` instead (as an import of a missing package does)."""

    def __init__(self, error):
        self.error = error

    def find_spec(self, name, path=None, target=None):
        if name == "liger_kernel" or name.startswith("liger_kernel."):
            raise self.error(name)
        return None


def _no_liger(monkeypatch, error=lambda name: ModuleNotFoundError(f"No module named {name!r}", name=name)):
    """liger_kernel not importable, whatever this machine has: its modules dropped (for this test) and a finder in
    front of sys.meta_path raising ``error(name)`` for them."""
    for name in [n for n in sys.modules if n == "liger_kernel" or n.startswith("liger_kernel.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_Finder(error), *sys.meta_path])


def _fake_liger(monkeypatch, fused_moe=None):
    """A stand-in liger_kernel (no kernels: for the availability rules only); ``fused_moe``: the attributes of its
    ``ops.fused_moe`` module (None: no such module)."""
    _no_liger(monkeypatch)
    pkg, ops = types.ModuleType("liger_kernel"), types.ModuleType("liger_kernel.ops")
    pkg.__version__, pkg.ops = "0.0-test", ops
    monkeypatch.setitem(sys.modules, "liger_kernel", pkg)
    monkeypatch.setitem(sys.modules, "liger_kernel.ops", ops)
    if fused_moe is not None:
        mod = types.ModuleType("liger_kernel.ops.fused_moe")
        for key, value in fused_moe.items():
            setattr(mod, key, value)
        ops.fused_moe = mod
        monkeypatch.setitem(sys.modules, "liger_kernel.ops.fused_moe", mod)


def _cpu_time_op(fn, *, iters=20, warmup=5, **kw):
    import time
    t0 = time.perf_counter()
    fn() if not isinstance(fn, timing.Split) else fn.run(fn.setup())
    ms = (time.perf_counter() - t0) * 1e3
    return {"time_ms": ms, "p20_ms": ms, "p80_ms": ms, "samples": 1, "host_ms": ms}


# --------------------------------------------------------------------------- registration, availability


def test_liger_is_registered_after_the_hf_baselines():
    assert moe.MOE_IMPLS[-3:] == ("hf-grouped-mm", "hf-eager", "liger")
    impl = registry.get("moe_fwd", "liger")
    assert not impl.kosmos and not impl.baseline and impl.fixed is None
    for direction in moe.DIRECTIONS:
        assert impl.runs_at("bf16", direction)
    assert impl.availability(1, "mxfp8", "fwd") == (False, "Liger's fused MoE has no MXFP8 path")


def test_unavailable_without_liger(monkeypatch, tiny_models):
    """Without liger_kernel: the one-line reason, and the bench's row says it (the other rows run on)."""
    _no_liger(monkeypatch)
    assert moe_liger.liger_available(1) == (False, NOT_INSTALLED)
    assert registry.get("moe_fwd", "liger").availability(1, "bf16", "fwd+bwd") == (False, NOT_INSTALLED)
    monkeypatch.setattr(timing, "time_op", _cpu_time_op)
    for direction in ("fwd", "bwd"):
        st = moe.MoESettings(impls=("nccl-a2a", "liger"), iters=1, warmup=0, direction=direction,
                             expert_gemms=False)
        rows = {r["impl"]: r for r in moe.run_case(moe.MoECase("tiny-liger", 32, "uniform"), st, device="cpu")}
        assert rows["nccl-a2a"]["status"] == "ok", rows["nccl-a2a"]
        r = rows["liger"]
        assert (r["status"], r["reason"], r["direction"], r["time_ms"]) == ("unavailable", NOT_INSTALLED, direction,
                                                                             None)
        assert r["note"].startswith("liger_kernel (not importable): LigerFusedMoEFunction")
    # at mxfp8 the dtype's reason comes first
    st = moe.MoESettings(impls=("liger",), dtype="mxfp8", expert_gemms=False)
    (r,) = moe.run_case(moe.MoECase("tiny-liger", 32, "uniform"), st, device="cpu")
    assert (r["status"], r["reason"]) == ("unavailable", "Liger's fused MoE has no MXFP8 path") and "note" not in r


def test_unavailable_reasons(monkeypatch):
    """A broken liger_kernel, one without the fused MoE, no CUDA, EP > 1: each its own one-line reason."""
    _no_liger(monkeypatch, lambda name: RuntimeError("triton 9.9 is not supported\nsecond line"))
    assert moe_liger.liger_available(1) == (
        False, "liger_kernel is not importable (RuntimeError: triton 9.9 is not supported)")

    _fake_liger(monkeypatch)  # no ops.fused_moe module
    no_moe = (f"liger_kernel {moe_liger.liger_version()} has no fused MoE (liger_kernel.ops.fused_moe."
              f"LigerFusedMoEFunction; this baseline is written against 0.8.5)")
    assert moe_liger.liger_available(1) == (False, no_moe)
    _fake_liger(monkeypatch, fused_moe={})  # the module without the Function
    assert moe_liger.liger_available(1) == (False, no_moe)

    _fake_liger(monkeypatch, fused_moe={"LigerFusedMoEFunction": object()})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert moe_liger.liger_available(1) == (False, "Liger's fused MoE is Triton GPU kernels: no CUDA device here")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert moe_liger.liger_available(1) == (True, None)
    ok, reason = moe_liger.liger_available(2)
    assert not ok and "EP = 1 only, not 2 ranks" in reason
    assert "\n" not in reason


def test_memory_estimate_against_hf_grouped_mm():
    """Liger's estimate keeps hf-grouped-mm's resident items and has the smaller working set (no fp32 row
    tensors): deepseek-v3 8192 tokens fwd+bwd fits an 80 GB GPU; a far larger point does not, with the estimate."""
    m = MOE_MODELS["deepseek-v3"]
    for direction in moe.DIRECTIONS:
        mine, hf = moe.liger_check_bytes(m, 8192, direction), moe.hf_check_bytes(m, 8192, direction,
                                                                                       "hf-grouped-mm")
        assert mine["peak"] <= hf["peak"] and len(mine) == len(hf)
        assert mine["implementation's working set"] < hf["implementation's working set"]
    h100 = 80 * 10**9
    assert moe.liger_memory_problem(m, 8192, "fwd+bwd", h100) is None
    why = moe.liger_memory_problem(m, 1 << 20, "fwd+bwd", h100)
    assert why.startswith("needs ~") and "liger_check_bytes" in why


# --------------------------------------------------------------------------- the layout, in torch


def test_layout_conversion_against_torch_math():
    """liger_weights: gate_up_proj [E, 2F, H] (gate rows, then up rows) and down_proj [E, H, F], contiguous copies
    (not views of the point's weights); Liger's per-expert math on them (x @ W1[:F]^T, x @ W1[F:]^T, SwiGLU, @ W2^T)
    is KOSMOS's expert_ffn on w13 / w2; kosmos_grads gives gradients in Liger's layout back as views of w13's /
    w2's layout."""
    g = torch.Generator().manual_seed(0)
    e, h, f = 3, 16, 8
    w13, w2 = torch.randn(e, h, 2 * f, generator=g), torch.randn(e, f, h, generator=g)
    gate_up, down = moe_liger.liger_weights(w13, w2)
    assert gate_up.shape == (e, 2 * f, h) and down.shape == (e, h, f)
    assert gate_up.is_contiguous() and down.is_contiguous()
    assert gate_up.data_ptr() != w13.data_ptr() and down.data_ptr() != w2.data_ptr()
    x = torch.randn(5, h, generator=g)
    for i in range(e):
        gate, up = x @ gate_up[i, :f].t(), x @ gate_up[i, f:].t()
        torch.testing.assert_close((torch.nn.functional.silu(gate) * up) @ down[i].t(), expert_ffn(x, w13[i], w2[i]))
    dx, dr = torch.ones(2), torch.ones(3)
    out = moe_liger.kosmos_grads((dx, dr, gate_up, down))
    assert out[0] is dx and out[1] is dr and torch.equal(out[2], w13) and torch.equal(out[3], w2)
    assert out[2].data_ptr() == gate_up.data_ptr()  # a view, no copy


# --------------------------------------------------------------------------- Liger's kernels, CPU interpreter


@pytest.fixture(scope="module")
def liger_site(tmp_path_factory):
    """A folder to put on PYTHONPATH so that liger_kernel imports: "" when it imports already, else the carried wheel
    (.whl/liger_kernel-*.whl) installed with --no-deps into a temporary --target; skip when there is neither."""
    probe = "import liger_kernel.ops.fused_moe"
    if subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0:
        return ""
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "liger_kernel-*.whl")))
    if not wheels:
        pytest.skip("liger_kernel is not installed and no .whl/liger_kernel-*.whl was carried")
    site = tmp_path_factory.mktemp("liger-site")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                        str(site), wheels[-1]], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"installing {os.path.basename(wheels[-1])} failed: {r.stderr.strip().splitlines()[-1:]}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT]))
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env)
    if r.returncode != 0:
        pytest.skip(f"liger_kernel does not import here: {r.stderr.strip().splitlines()[-1:]}")
    return str(site)


INTERPRETED = r"""
import json, sys
import torch
from kosmos.models import MoEModel
from kosmos.reference.moe import moe_forward_a2a
from kosmos_bench import moe, moe_liger, timing

out = {}
for spec, directions in json.loads(sys.argv[1]):
    m = MoEModel(**spec)
    x, wr, bias, _ = moe.make_router_inputs(m, 40, "uniform", 0, 3)
    w13, w2 = moe.make_expert_weights(m, 1, 0, 3)
    x, wr, w13, w2 = (t.float() for t in (x, wr, w13, w2))  # fp32: the interpreter runs no bf16 GEMMs
    dy = torch.randn(40, m.hidden, generator=torch.Generator().manual_seed(4))
    errs = {}
    for direction in directions:
        inp = moe.MoEInputs(m, x, wr, bias, w13, w2, direction=direction, dy=None if direction == "fwd" else dy)
        fn, ws = moe.liger_maker(inp, {}, None)
        got = fn()
        if direction == "fwd":
            ref = moe_forward_a2a(x, wr, w13, w2, top_k=m.top_k, fp32=True, **inp.route_kw())
            errs[direction] = {"y": moe.harness.rel_err(got, ref)}
        else:
            assert isinstance(fn, timing.Split) == (direction == "bwd")
            errs[direction] = moe.grad_reference(inp).errors(got)[1]
            assert got[2].shape == w13.shape and got[3].shape == w2.shape
        assert ws == 0
    if "fwd" in directions:  # the check is not a formality: gate and up swapped in Liger's layout fails it
        right = moe_liger.liger_weights
        moe_liger.liger_weights = lambda w13, w2: (lambda gu, d: (gu.roll(m.expert_ffn, 1), d))(*right(w13, w2))
        inp = moe.MoEInputs(m, x, wr, bias, w13, w2)
        ref = moe_forward_a2a(x, wr, w13, w2, top_k=m.top_k, fp32=True, **inp.route_kw())
        errs["swapped"] = {"y": moe.harness.rel_err(moe.liger_maker(inp, {}, None)[0](), ref)}
        moe_liger.liger_weights = right
    out[m.name] = errs
print("RESULT " + json.dumps(out))
"""


def test_liger_layer_on_the_interpreter(liger_site):
    """The maker with Liger's own kernels (TRITON_INTERPRET=1, LIGER_FUSED_MOE_AUTOTUNE=0: one config, no
    benchmarking on the CPU), in fp32: softmax routing in every direction, sigmoid-grouped at fwd+bwd (the
    interpreter is slow); y against the point's fp32 reference, dx, d_router, dw13 and dw2 against grad_reference
    (moe_backward_ref for route's decision) -- the layout copies, the router wiring, the int32 experts and the
    gradients' layout all right."""
    from dataclasses import asdict
    env = dict(os.environ, TRITON_INTERPRET="1", LIGER_FUSED_MOE_AUTOTUNE="0",
               PYTHONPATH=os.pathsep.join(p for p in [liger_site, ROOT, os.environ.get("PYTHONPATH", "")] if p))
    want = {"tiny-liger": list(moe.DIRECTIONS), "tiny-liger-grouped": ["fwd+bwd"]}
    specs = json.dumps([(asdict(TINY[name]), directions) for name, directions in want.items()])
    r = subprocess.run([sys.executable, "-c", INTERPRETED, specs], capture_output=True, text=True, env=env,
                       timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    result = json.loads(r.stdout.split("RESULT ", 1)[1])
    assert set(result) == set(want)
    for name, errs in result.items():
        swapped = errs.pop("swapped", None)
        assert list(errs) == want[name] and (swapped is None) == ("fwd" not in errs)
        if swapped:
            assert swapped["y"] > 0.1, swapped
        for direction, parts in errs.items():
            assert set(parts) == ({"y"} if direction == "fwd" else set(moe.GRADS))
            for part, err in parts.items():
                assert 0 <= err < 1e-4, (name, direction, part, err)  # fp32 throughout


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("name", list(TINY))
def test_liger_rows_on_a_gpu(monkeypatch, tiny_models, liger_site, name):
    """The liger rows of a tiny point (256 tokens, bf16, EP = 1) in every direction beside nccl-a2a's: ok, within
    the bars of the hf-* rows (fwd: the bf16 tolerance against the point's fp32 reference; bwd, fwd+bwd: each of
    dx, d_router, dw13, dw2 within GRAD_TOLERANCE), the note naming Liger's version and the torch router."""
    if liger_site:
        monkeypatch.syspath_prepend(liger_site)
    assert moe_liger.liger_available(1) == (True, None)
    for direction in moe.DIRECTIONS:
        st = moe.MoESettings(impls=("nccl-a2a", "liger"), iters=3, warmup=1, direction=direction,
                             expert_gemms=False)
        rows = {r["impl"]: r for r in moe.run_case(moe.MoECase(name, 256, "uniform"), st)}
        r = rows["liger"]
        assert r["status"] == "ok" and rows["nccl-a2a"]["status"] == "ok", (direction, r, rows["nccl-a2a"])
        assert r["note"].startswith(f"liger_kernel {moe_liger.liger_version()}: LigerFusedMoEFunction")
        assert r["time_ms"] > 0 and r["peak_mem_bytes"] > 0
        if direction == "fwd":
            assert 0 < r["rel_err"] < harness.TOLERANCE["bf16"], r
        else:
            assert set(r["rel_err_grads"]) == set(moe.GRADS) and 0 < r["rel_err"] < moe.GRAD_TOLERANCE, r
