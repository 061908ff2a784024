"""kosmos.nn.ColumnParallelLinear / RowParallelLinear: forward and backward math, on the CPU.

The fused ops need CUDA, so here they are replaced by the pure-torch references (same signatures, fp32 math,
bf16 out) -- what is tested is the autograd wiring: which op each gradient uses, with which operand layout,
and the sequence-parallel sharding of activations and weights. At world 1 in-process, at world 2 over gloo,
against a single-process fp32 computation of the whole layer. The GPU tests run the real kernels.
"""
import os

import pytest
import torch
import torch.distributed as dist

from multiproc import spawn_gloo

import kosmos.nn as knn
from kosmos import quant, reference

TOL = 2e-2


def _fake_ops(monkeypatch=None):
    def agm(a, b, group=None):
        if isinstance(a, tuple):  # MXFP8: its exact values (a_full is not used by the MX layers)
            a = quant.from_mx(a)
        a_full, c = reference.all_gather_matmul_ref(a.float(), b.float(), group, fp32=True)
        return a_full.to(a.dtype), c.to(a.dtype)

    def mrs(a, b, group=None):
        if isinstance(a, tuple):
            a = quant.from_mx(a)
        return reference.matmul_reduce_scatter_ref(a.float(), b.float(), group, fp32=True).to(a.dtype)
    if monkeypatch is not None:
        monkeypatch.setattr(knn, "all_gather_matmul", agm)
        monkeypatch.setattr(knn, "matmul_reduce_scatter", mrs)
    else:
        knn.all_gather_matmul, knn.matmul_reduce_scatter = agm, mrs


def _rel(a, b):
    return ((a.detach().float().cpu() - b.detach().float()).norm() / b.float().norm()).item()


def _layer_data(seed, s, b, d_in, d_out):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, b, d_in, generator=g)
    w = torch.randn(d_out, d_in, generator=g) / d_in ** 0.5
    dy = torch.randn(s, b, d_out, generator=g)
    return x, w, dy


# per layer: (class, seed, d_in, d_out of the full layer at W ranks, which dim each rank's shard of x, w, y
# takes): Column -- x sharded over the sequence (gathered inside), w over its output rows, y over features;
# Row -- x over features, w over its input columns, y over the sequence (reduce-scattered inside)
_LAYERS = {
    "column": (knn.ColumnParallelLinear, 1, lambda w: 24, lambda w: 16 * w, 0, 0, 2),
    "row": (knn.RowParallelLinear, 2, lambda w: 16 * w, lambda w: 24, 2, 1, 0),
}


# MXFP8: K (the layer's in, or in/W of a row layer) a multiple of 32, so MX blocks never straddle shards
_MX_LAYERS = {
    "column": (knn.ColumnParallelLinear, 3, lambda w: 64, lambda w: 16 * w, 0, 0, 2),
    "row": (knn.RowParallelLinear, 4, lambda w: 32 * w, lambda w: 24, 2, 1, 0),
}


def _mx_ste(t):
    """t's MX values (blocks along the last dim) with a straight-through gradient: the MX layers' contract."""
    q = quant.from_mx(quant.to_mx(t.detach().reshape(-1, t.shape[-1]).to(torch.bfloat16))).float()
    return t + (q.reshape(t.shape) - t).detach()


def _check_layer(kind, rank, world, group=None, device="cpu", mx=False):
    cls, seed, d_in_of, d_out_of, x_dim, w_dim, y_dim = (_MX_LAYERS if mx else _LAYERS)[kind]
    s, b, d_in, d_out = 8 * world, 2, d_in_of(world), d_out_of(world)
    x, w, dy = _layer_data(seed, s, b, d_in, d_out)
    layer = cls(d_in, d_out, group=group, device=device, dtype="mxfp8" if mx else torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(w.chunk(world, w_dim)[rank])
    xin = x.chunk(world, x_dim)[rank].to(device, torch.bfloat16).requires_grad_(True)
    y = layer(xin)
    full = [s, b, d_out]
    full[y_dim] //= world
    assert y.shape == tuple(full)
    y.backward(dy.chunk(world, y_dim)[rank].to(device, torch.bfloat16))
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    if mx:  # the reference quantizes what the layer quantizes (bf16 inputs, blocks along in)
        yr = _mx_ste(xr.to(torch.bfloat16).float()) @ _mx_ste(wr.to(torch.bfloat16).float()).t()
    else:
        yr = xr @ wr.t()
    yr.backward(dy)
    assert _rel(y, yr.chunk(world, y_dim)[rank]) < TOL
    assert _rel(xin.grad, xr.grad.chunk(world, x_dim)[rank]) < TOL
    assert _rel(layer.weight.grad, wr.grad.chunk(world, w_dim)[rank]) < TOL


def _check_column(rank, world, group=None, device="cpu"):
    _check_layer("column", rank, world, group, device)


def _check_row(rank, world, group=None, device="cpu"):
    _check_layer("row", rank, world, group, device)


def test_world1_column_and_row(monkeypatch):
    _fake_ops(monkeypatch)
    _check_column(0, 1)
    _check_row(0, 1)


def test_world1_column_and_row_mxfp8(monkeypatch):
    """dtype="mxfp8": forward on the MX values of x and W, dx = dy @ W_mx, dW = dy^T @ x_mx (straight through)."""
    _fake_ops(monkeypatch)
    _check_layer("column", 0, 1, mx=True)
    _check_layer("row", 0, 1, mx=True)


def test_mxfp8_weight_cache_follows_the_parameter(monkeypatch):
    _fake_ops(monkeypatch)
    layer = knn.ColumnParallelLinear(64, 16, dtype="mxfp8")
    first = layer._mx_weight_t()
    assert layer._mx_weight_t() is first  # cached
    with torch.no_grad():
        layer.weight.mul_(2.0)
    again = layer._mx_weight_t()
    assert again is not first and torch.equal(again, (first.float() * 2).to(torch.bfloat16))


def test_mxfp8_layer_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        knn.ColumnParallelLinear(24, 16, dtype="mxfp8")
    with pytest.raises(ValueError, match="choose torch.bfloat16"):
        knn.ColumnParallelLinear(64, 16, dtype="fp4")


def _fp8b_ste(t, block_rows):
    """t's fp8-block values (blocks along the last dim; 128x128 with block_rows 128) with a straight-through
    gradient: what the fp8-block linear multiplies."""
    q = quant.fp8_block_values(t.detach().reshape(-1, t.shape[-1]).to(torch.bfloat16), block_rows).float()
    return t + (q.reshape(t.shape) - t).detach()


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.interpreter, id="interpreter"),
                                    pytest.param("cuda", marks=pytest.mark.gpu, id="gpu")])
@pytest.mark.parametrize("cls", [knn.ColumnParallelLinear, knn.RowParallelLinear])
def test_world1_fp8_block_linear(cls, device):
    """dtype="fp8-block" at W=1 through the real kernels under the interpreter (fp8_block_matmul): the forward on
    x's 1x128 and W's 128x128 values; dx on dy's 1x128 values (along out) and W's blocks; dW on dy^T's 1x128 values
    along the tokens and x^T's 128x128 blocks (the tokens, 10, padded with zero rows) -- each against the same
    quantization in fp32 autograd terms; and against the bf16 layer within the fp8 error (5e-2)."""
    s, b, d_in, d_out = 5, 2, 256, 128
    x, w, dy = _layer_data(7, s, b, d_in, d_out)
    layer = cls(d_in, d_out, dtype="fp8-block", device=device)
    with torch.no_grad():
        layer.weight.copy_(w)
    xin = x.to(device, torch.bfloat16).requires_grad_(True)
    y = layer(xin)
    assert y.shape == (s, b, d_out)
    y.backward(dy.to(device, torch.bfloat16))
    xb, wb, dyb = x.to(torch.bfloat16).float(), w.to(torch.bfloat16).float(), dy.to(torch.bfloat16).float()
    y_ref = _fp8b_ste(xb, 1) @ _fp8b_ste(wb, 128).t()
    dx_ref = _fp8b_ste(dyb, 1) @ _fp8b_ste(wb, 128)
    x2, dy2 = xb.reshape(-1, d_in), dyb.reshape(-1, d_out)
    pad = lambda t: torch.cat([t, t.new_zeros(128 - t.shape[0], t.shape[1])])  # noqa: E731
    dw_ref = (_fp8b_ste(pad(dy2).t().contiguous(), 1) @ _fp8b_ste(pad(x2).t().contiguous(), 128).t())
    assert _rel(y, y_ref) < 5e-3 and _rel(xin.grad, dx_ref) < 5e-3 and _rel(layer.weight.grad, dw_ref) < 5e-3
    ref_bf16 = (xb.requires_grad_(True) @ wb.requires_grad_(True).t())
    ref_bf16.backward(dyb)
    assert _rel(y, ref_bf16) < 5e-2 and _rel(xin.grad, xb.grad) < 5e-2 and _rel(layer.weight.grad, wb.grad) < 5e-2
    first = layer._fp8_block_weight()
    assert layer._fp8_block_weight() is first  # cached until the parameter changes


def test_fp8_block_layer_errors():
    with pytest.raises(ValueError, match="multiples of 128"):
        knn.ColumnParallelLinear(192, 128, dtype="fp8-block")
    with pytest.raises(ValueError, match="choose torch.bfloat16 or one of bf16, mxfp8, fp8-block"):
        knn.ColumnParallelLinear(128, 128, dtype="fp16")
    with pytest.raises(ValueError, match="choose torch.bfloat16 or one of bf16, mxfp8$"):
        knn.MoE(128, 128, 8, 2, dtype="fp8-block")


def test_shape_errors():
    with pytest.raises(ValueError, match="expected input"):
        knn.ColumnParallelLinear(24, 16)(torch.zeros(4, 23, dtype=torch.bfloat16))


def _gloo_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _fake_ops()
        _check_column(rank, world)
        _check_row(rank, world)
        _check_layer("column", rank, world, mx=True)
        _check_layer("row", rank, world, mx=True)
        q.put((rank, "ok"))
    except BaseException as e:  # noqa: BLE001 -- reported to the parent
        q.put((rank, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


def test_world2_over_gloo():
    got = spawn_gloo(_gloo_rank, 2)
    assert got == {0: "ok", 1: "ok"}, got


# ---------------------------------------------------------- real kernels (GPU only: markers in conftest.py)
@pytest.mark.gpu
def test_gpu_world1_column_and_row():
    _check_column(0, 1, device="cuda")
    _check_row(0, 1, device="cuda")


@pytest.mark.gpu
def test_gpu_world1_column_and_row_mxfp8():
    _check_layer("column", 0, 1, device="cuda", mx=True)
    _check_layer("row", 0, 1, device="cuda", mx=True)


def _gpu_rank(rank, world, out_dir):
    _check_column(rank, world, device=torch.device("cuda", rank))
    _check_row(rank, world, device=torch.device("cuda", rank))
    _check_layer("column", rank, world, device=torch.device("cuda", rank), mx=True)
    _check_layer("row", rank, world, device=torch.device("cuda", rank), mx=True)


@pytest.mark.multi_gpu
def test_gpu_world2(tmp_path):
    from kosmos_bench.launcher import spawn
    spawn(_gpu_rank, 2, str(tmp_path), timeout_s=300)
