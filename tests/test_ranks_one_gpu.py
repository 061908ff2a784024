"""KOSMOS's own W > 1 ops with every rank's process on ONE GPU over gloo (kosmos_bench.launcher.spawn_one_gpu).

Over a gloo group the workspace's symmetric buffers are plain allocations mapped into the peers by CUDA IPC
(runtime.Workspace._ipc_symmetric), so the real kernels run with the real cross-rank protocol (peer stores,
sys-scope flags, epochs, done flags) while the ranks' contexts time-slice the GPU. Checked against the fp32
references over the same group (their collectives through host copies: runtime.host_staged): both TP ops in
bf16, MXFP8 and fp8-block and the MoE layer, three calls in a row bitwise equal (epochs advance), inputs fresh per rank.
GPU only (skipped elsewhere); timings on one GPU mean nothing and none are taken.
"""
import pytest
import torch

from multiproc import Checks

WORLD = 2


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def _tp_rank(rank, world, out_dir):
    import torch.distributed as dist

    import kosmos
    from kosmos import quant, reference
    from kosmos.core import runtime
    check = Checks(rank)
    try:
        check(runtime.uses_ipc(runtime.get_workspace().world), "the workspace should map its peers by CUDA IPC")
        torch.backends.cuda.matmul.allow_tf32 = False
        gen = torch.Generator(device="cuda").manual_seed(100 + rank)
        ms, k, n = 384, 512, 768  # per-rank shard rows, K, N
        for dtype in ("bf16", "mxfp8", "fp8-block"):
            a = (torch.randn(ms, k, generator=gen, device="cuda")).to(torch.bfloat16)
            b = (torch.randn(k, n, generator=gen, device="cuda") / k ** 0.5).to(torch.bfloat16)
            b_op = b
            if dtype == "mxfp8":
                a_in, a_ref, b = quant.quantize_mx(a), quant.mx_round(a), quant.mx_round(b.t().contiguous()).t()
                b_op = b
            elif dtype == "fp8-block":  # the op takes the weight's FP8BlockTensor; the references its values
                a_in, a_ref = quant.quantize_fp8_block(a), quant.fp8_block_values(a)
                b_op = quant.quantize_fp8_block(b.t().contiguous(), 128)
                b = quant.from_fp8_block(b_op).t()
            else:
                a_in, a_ref = a, a
            full_ref, c_ref = reference.all_gather_matmul_ref(a_ref, b, fp32=True)
            outs = []
            for _ in range(3):
                a_full, c = kosmos.all_gather_matmul(a_in, b_op)
                full = quant.from_mx(a_full) if dtype == "mxfp8" else \
                    quant.from_fp8_block(a_full) if dtype == "fp8-block" else a_full
                check(torch.equal(full, full_ref.to(full.dtype)), f"{dtype} AG: a_full is not every rank's shard")
                check(_rel(c, c_ref) < 1e-2, f"{dtype} AG: rel err {_rel(c, c_ref):.2e}")
                outs.append(c.clone())
            check(all(torch.equal(o, outs[0]) for o in outs), f"{dtype} AG: repeated calls differ")
            m = ms * world
            a2 = torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)
            a2_in = quant.quantize_mx(a2) if dtype == "mxfp8" else quant.quantize_fp8_block(a2) \
                if dtype == "fp8-block" else a2
            a2_ref = quant.mx_round(a2) if dtype == "mxfp8" else quant.fp8_block_values(a2) \
                if dtype == "fp8-block" else a2
            rs_ref = reference.matmul_reduce_scatter_ref(a2_ref, b, fp32=True)
            outs = []
            for _ in range(3):
                c = kosmos.matmul_reduce_scatter(a2_in, b_op)
                check(tuple(c.shape) == (ms, n), f"{dtype} RS: shape {tuple(c.shape)}")
                check(_rel(c, rs_ref) < 1e-2, f"{dtype} RS: rel err {_rel(c, rs_ref):.2e}")
                outs.append(c.clone())
            check(all(torch.equal(o, outs[0]) for o in outs), f"{dtype} RS: repeated calls differ")
        kosmos.check_errors()
        dist.barrier()
    finally:
        check.finish(out_dir)


def _moe_rank(rank, world, out_dir):
    import torch.distributed as dist

    import kosmos
    from kosmos.reference import moe as mr
    check = Checks(rank)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        gen = torch.Generator(device="cuda").manual_seed(7 + rank)
        t, h, f, e, top_k = 301, 256, 192, 8, 2
        shared = torch.Generator(device="cuda").manual_seed(3)  # the router: the same on every rank
        router = (torch.randn(e, h, generator=shared, device="cuda") / h ** 0.5).to(torch.bfloat16)
        x = torch.randn(t, h, generator=gen, device="cuda").to(torch.bfloat16)
        w13 = (torch.randn(e // world, h, 2 * f, generator=gen, device="cuda") / h ** 0.5).to(torch.bfloat16)
        w2 = (torch.randn(e // world, f, h, generator=gen, device="cuda") / f ** 0.5).to(torch.bfloat16)
        ref = mr.moe_forward_a2a(x, router, w13, w2, top_k=top_k, fp32=True)
        outs = []
        for _ in range(3):
            y = kosmos.moe_forward(x, router, w13, w2, top_k=top_k)
            check(bool(torch.isfinite(y.float()).all()), "MoE: non-finite output")
            check(_rel(y, ref) < 2e-2, f"MoE: rel err {_rel(y, ref):.2e}")
            outs.append(y.clone())
        check(all(torch.equal(o, outs[0]) for o in outs), "MoE: repeated calls differ")
        kosmos.check_errors()
        dist.barrier()
    finally:
        check.finish(out_dir)


def _moe_bwd_rank(rank, world, out_dir):
    """moe_backward(one_launch=True) at W = 2 through the public op (the group's workspace: IPC-mapped symmetric
    buffers, its epoch slot and done flags), after a forward on the same workspace: against the fp32 reference of
    every rank's tokens with every expert (rebuilt on each rank from shared seeds), three calls bitwise the same
    (no host synchronisation between them), with the router backward in the launch and without; and the default
    call (no one_launch) bitwise the one launch's (ONE_LAUNCH_EP)."""
    import torch.distributed as dist

    import kosmos
    from kosmos.reference import moe as mr
    from kosmos.ops.moe_backward.api import moe_backward
    check = Checks(rank)
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        t, h, f, e, k = 301, 256, 192, 8, 2
        g = torch.Generator().manual_seed(5)
        router = (torch.randn(e, h, generator=g) / h ** 0.5).to(torch.bfloat16).cuda()
        w13 = (torch.randn(e, h, 2 * f, generator=g) / h ** 0.5).to(torch.bfloat16).cuda()
        w2 = (torch.randn(e, f, h, generator=g) / f ** 0.5).to(torch.bfloat16).cuda()
        xs = [torch.randn(t, h, generator=g).to(torch.bfloat16).cuda() for _ in range(world)]
        dys = [torch.randn(t, h, generator=g).to(torch.bfloat16).cuda() for _ in range(world)]
        el = e // world
        mine = (w13[rank * el:(rank + 1) * el].contiguous(), w2[rank * el:(rank + 1) * el].contiguous())
        y, wts, exps = kosmos.moe_forward(xs[rank], router, *mine, top_k=k, return_routing=True)
        all_e = [None] * world
        dist.all_gather_object(all_e, exps.cpu())
        want = mr.moe_backward_ref(torch.cat(xs).cpu(), router.cpu(), w13.cpu(), w2.cpu(), torch.cat(dys).cpu(),
                                   top_k=k, experts=torch.cat(all_e))
        for in_launch in (True, False):
            outs = []
            for _ in range(3):
                got = moe_backward(xs[rank], router, *mine, dys[rank], wts, exps, group=dist.group.WORLD,
                                   one_launch=True, router_in_launch=in_launch)
                outs.append([o.clone() for o in got])
            kosmos.check_errors()
            mine_ref = (want[0][rank * t:(rank + 1) * t], None, want[2][rank * el:(rank + 1) * el],
                        want[3][rank * el:(rank + 1) * el])
            for name, a, b in zip(("dx", "d_router", "dw13", "dw2"), outs[0], mine_ref):
                if b is not None:
                    check(_rel(a.cpu(), b) < 2e-2, f"one launch W=2 {name}: rel err {_rel(a.cpu(), b):.2e}")
            d_router = outs[0][1].clone()
            dist.all_reduce(d_router)
            check(_rel(d_router.cpu(), want[1]) < 2e-2, f"one launch W=2 d_router: {_rel(d_router.cpu(), want[1]):.2e}")
            check(all(torch.equal(a, b) for o in outs[1:] for a, b in zip(o, outs[0])), "repeated calls differ")
        # the default at W > 1 on CUDA without saved g | u (ONE_LAUNCH_EP): the one launch, its bits
        default = moe_backward(xs[rank], router, *mine, dys[rank], wts, exps, group=dist.group.WORLD)
        explicit = moe_backward(xs[rank], router, *mine, dys[rank], wts, exps, group=dist.group.WORLD, one_launch=True)
        kosmos.check_errors()
        check(all(torch.equal(a, b) for a, b in zip(default, explicit)), "the W = 2 default is not the one launch")
        dist.barrier()
    finally:
        check.finish(out_dir)


def _run(fn, tmp_path):
    from kosmos_bench import launcher
    launcher.spawn_one_gpu(fn, WORLD, str(tmp_path), timeout_s=600)
    for r in range(WORLD):
        f = tmp_path / f"rank{r}.txt"
        assert f.exists() and f.read_text() == "", f.read_text() if f.exists() else f"rank {r} did not finish"


@pytest.mark.gpu
def test_tp_ops_two_ranks_on_one_gpu(tmp_path):
    _run(_tp_rank, tmp_path)


@pytest.mark.gpu
def test_moe_forward_two_ranks_on_one_gpu(tmp_path):
    _run(_moe_rank, tmp_path)


@pytest.mark.gpu
@pytest.mark.slow
def test_moe_backward_one_launch_two_ranks_on_one_gpu(tmp_path):
    _run(_moe_bwd_rank, tmp_path)


def test_ipc_only_for_cuda_groups_other_than_nccl(monkeypatch):
    """runtime.uses_ipc: CUDA-IPC buffers for a gloo (any non-NCCL) group of CUDA ranks, torch symmetric memory
    for NCCL, neither at W = 1 or on the CPU; runtime.host_staged: host copies for CUDA tensors over gloo only."""
    import torch.distributed as dist

    from kosmos.core import runtime
    backend = {"b": "gloo"}
    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend["b"])
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert runtime.uses_ipc(runtime.World(None, 0, 2, cuda))
    assert not runtime.uses_ipc(runtime.World(None, 0, 1, cuda))
    assert not runtime.uses_ipc(runtime.World(None, 0, 2, cpu))
    backend["b"] = "nccl"
    assert not runtime.uses_ipc(runtime.World(None, 0, 2, cuda))
    assert not runtime.host_staged(None, torch.zeros(2))  # a CPU tensor: gloo serves it as it is
