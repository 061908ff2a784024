"""moe_forward / expert_gemms input checks: a clear ValueError before anything launches (CPU, no GPU needed:
the checks run before any device work; CPU tensors themselves are the last error they report)."""
import pytest
import torch

from multiproc import spawn_gloo

from kosmos.kernels import moe_forward as mf


def _inputs(t=16, h=64, f=32, e=8, el=8, dtype=torch.bfloat16):
    return (torch.zeros(t, h, dtype=dtype), torch.zeros(e, h, dtype=dtype), torch.zeros(el, h, 2 * f, dtype=dtype),
            torch.zeros(el, f, h, dtype=dtype))


def _check(*args, top_k=2, routing="softmax", bias=None, n_group=1, topk_group=1, world=1):
    return mf.check_moe_inputs(*args, top_k, routing, bias, n_group, topk_group, world)


def test_valid_inputs_pass_the_shape_checks():
    x, r, w13, w2 = _inputs()
    with pytest.raises(ValueError, match="CUDA"):  # everything else is fine; only the device is wrong here
        _check(x, r, w13, w2)


@pytest.mark.parametrize("mutate,match", [
    (lambda a: (a[0].float(), *a[1:]), "x must be torch.bfloat16"),
    (lambda a: (a[0][None], *a[1:]), "x must be 2-D"),
    (lambda a: (a[0], a[1][:, :32].contiguous(), *a[2:]), "hidden sizes disagree"),
    (lambda a: (a[0], a[1], a[2][:, :, :-8].contiguous(), a[3]), "must be \\[E/W, H, 2F\\]"),
    (lambda a: (a[0], a[1], a[2][:4].contiguous(), a[3][:4].contiguous()), "E must equal world"),
    (lambda a: (a[0].t(), *a[1:]), "hidden sizes disagree|contiguous"),
    (lambda a: (a[0][:0], *a[1:]), "empty"),
    (lambda a: ("x", *a[1:]), "torch.Tensor"),
])
def test_bad_tensors(mutate, match):
    with pytest.raises(ValueError, match=match):
        _check(*mutate(_inputs()))


def test_bad_routing_arguments():
    a = _inputs()
    with pytest.raises(ValueError, match="top_k"):
        _check(*a, top_k=9)
    with pytest.raises(ValueError, match="top_k"):
        _check(*a, top_k=0)
    with pytest.raises(ValueError, match="unknown routing"):
        _check(*a, routing="sinkhorn")
    with pytest.raises(ValueError, match="belong to routing='sigmoid-grouped'"):
        _check(*a, bias=torch.zeros(8))
    with pytest.raises(ValueError, match="n_group"):
        _check(*a, routing="sigmoid-grouped", n_group=3, topk_group=1)
    with pytest.raises(ValueError, match="exceeds"):
        _check(*a, top_k=5, routing="sigmoid-grouped", n_group=4, topk_group=2)
    with pytest.raises(ValueError, match="bias"):
        _check(*a, routing="sigmoid-grouped", n_group=4, topk_group=2, bias=torch.zeros(7))


def test_hidden_and_ffn_must_suit_tma():
    with pytest.raises(ValueError, match="multiples of 8"):
        _check(*_inputs(h=60))


def test_too_many_experts():
    with pytest.raises(ValueError, match="E=512"):
        _check(*_inputs(e=512, el=512))


def test_public_op_rejects_cpu_tensors_before_touching_a_gpu():
    import kosmos
    x, r, w13, w2 = _inputs()
    with pytest.raises(ValueError, match="CUDA"):
        kosmos.moe_forward(x, r, w13, w2, top_k=2)
    with pytest.raises(ValueError, match="policy"):
        kosmos.moe_forward(x, r, w13, w2, top_k=2, policy="greedy")


def test_nn_module_refuses_autograd():
    import kosmos
    m = kosmos.nn.MoE(64, 32, 8, 2)
    with pytest.raises(RuntimeError, match="no backward"):
        m(torch.zeros(4, 64, dtype=torch.bfloat16))


def _shape_rank(rank, world, port, q, tokens):
    import os
    from types import SimpleNamespace

    import torch.distributed as dist

    from kosmos.runtime import World
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ws = SimpleNamespace(world=World(dist.group.WORLD, rank, world, torch.device("cpu")), agreed_shapes=set())
        try:
            mf._check_same_shape_on_every_rank(ws, (tokens[rank], 64, 32, 8, 2, 0))
            q.put((rank, ("ok", len(ws.agreed_shapes))))
        except ValueError as e:
            q.put((rank, (str(e), len(ws.agreed_shapes))))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tokens", [(16, 16), (16, 24)])
def test_ranks_must_agree_on_shapes(tokens):
    """Every rank gets the same verdict (no rank left waiting): agreed shapes are remembered, a different T on
    a peer is a clear error naming it."""
    got = spawn_gloo(_shape_rank, 2, tokens)
    if tokens[0] == tokens[1]:
        assert got == {0: ("ok", 1), 1: ("ok", 1)}
    else:
        for r in range(2):
            msg, n = got[r]
            assert "T (tokens per rank)" in msg and n == 0, got
