"""The ``deepep`` MoE baseline (kosmos_bench/moe.py: ``deepep_callable``, ``deepep_expert_side``) at W = 2.

* CPU (unmarked): the expert side's edge cases (no rows received, empty local experts, garbage in unused slots);
  ``launcher.check_world`` with KOSMOS_RANKS_ON_ONE_GPU; and the whole callable over gloo on CPU ranks with a
  stand-in ``deep_ep`` whose Buffer has the wheel's signatures, return tuples and host-side checks (DeepEP V1,
  commit 567632d: dtypes, contiguity, sizes, the NVLink buffer's size assertion) and emulates dispatch/combine
  with all-to-alls -- the call sequence, not DeepEP's kernels. It also has what a backward uses (the training
  proxy's deepep, tests/test_bench_train.py, and the bench's bwd rows): dispatch in cached mode (``handle=``, x
  only) and combine's ``topk_weights`` (summed over the ranks, as DeepEP reduces them).
* GPU (``gpu``): the real wheel (../shared/wheels; ``dev/archive/x1_session.sh deepep`` installs it), two processes on
  cuda:0 with a gloo group (``launcher.spawn_one_gpu``); skipped without a GPU or when ``deep_ep`` does not import.

Both check every case against the fp32 reference (``moe_reference.moe_forward_ref_local``) within the bench's
bf16 tolerance (harness.TOLERANCE, 1e-2): two routers (softmax; sigmoid-grouped with a score bias and a routed
scale), both routings of the suite (uniform, zipf:1.2), a case with empty experts and one where every token goes
to rank 0's experts (rank 1 receives nothing); then one benchmark point (``moe.run_case``, nccl-a2a and deepep).

The backward (``--direction bwd`` / ``fwd+bwd``: autograd through ``moe.deepep_layer``, DeepEP's dispatch and
combine as autograd Functions) has its own tests, CPU (the stand-in) and GPU (the wheel): one point per router
through ``moe.run_case`` in both directions, nccl-a2a and deepep, every gradient (dx, d_router, dw13, dw2)
checked by the harness against the distributed fp32 reference (``moe.grad_reference`` at W = 2) within
GRAD_TOLERANCE; on the CPU also that the check sees the gate weights' gradient (with combine's ``topk_weights``
dropped, d_router is wrong).
"""
import importlib
import importlib.util
import os
import sys
import time
import types
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from multiproc import Checks, spawn_gloo

from kosmos.models import MoEModel
from kosmos.reference.moe import moe_forward_ref_local, route
from kosmos.reference import rel_err
from kosmos_bench import harness, launcher, moe, timing

WORLD = 2
TOKENS = {"cuda": 256, "cpu": 64}  # per rank (bf16 matmuls are slow on the CPU)
TOL = harness.TOLERANCE["bf16"]
MODELS = [
    MoEModel("deepep-softmax", hidden=512, expert_ffn=256, experts=8, top_k=2, routing="softmax"),
    MoEModel("deepep-grouped", hidden=1024, expert_ffn=256, experts=16, top_k=4, routing="sigmoid-grouped",
             n_group=4, topk_group=2, routed_scaling=2.5),
]
# (routing, mask): mask "empty" -- two experts (one per rank) no token chooses; "rank0" -- only rank 0's experts
CASES = [("uniform", None), ("zipf:1.2", None), ("uniform", "empty"), ("zipf:1.2", "rank0")]
OFF_LOGIT = -30.0  # router column 0 of a masked expert, with x[:, 0] = 1: its logit ~30 below the rest


# --------------------------------------------------------------------------- the expert side alone (CPU)


def _layer_weights(m, seed=0):
    return [moe.make_expert_weights(m, WORLD, r, seed) for r in range(WORLD)]


def test_expert_side_with_nothing_received():
    m = MODELS[0]
    local = m.experts // WORLD
    w13, w2 = _layer_weights(m)[0]
    x = torch.zeros(0, m.hidden, dtype=torch.bfloat16)
    idx = torch.zeros(0, m.top_k, dtype=torch.int64)
    y = moe.deepep_expert_side(x, idx, torch.zeros(0, m.top_k), [0] * local, w13, w2, local)
    assert y.shape == (0, m.hidden) and y.dtype == torch.bfloat16


def test_expert_side_with_empty_experts_and_garbage_slots():
    """Experts 0 and 2 of 4 receive nothing; unused slots (-1) carry NaN weights: the partial must equal the fp32
    sum over valid slots of w * expert(x)."""
    m = MODELS[0]
    local = m.experts // WORLD
    w13, w2 = _layer_weights(m)[0]
    g = torch.Generator().manual_seed(3)
    n = 40
    x = torch.randn(n, m.hidden, generator=g).to(torch.bfloat16)
    idx = torch.full((n, m.top_k), -1, dtype=torch.int64)
    idx[:, 0] = torch.where(torch.arange(n) % 2 == 0, 1, 3)
    idx[::3, 1] = torch.where(idx[::3, 0] == 1, 3, 1)  # some tokens use both experts 1 and 3
    w = torch.rand(n, m.top_k, generator=g)
    w[idx < 0] = float("nan")
    counts = [int((idx == i).sum()) for i in range(local)]
    assert counts[0] == counts[2] == 0 and counts[1] and counts[3]
    y = moe.deepep_expert_side(x, idx, w, counts, w13, w2, local)
    ref = torch.zeros(n, m.hidden)
    for t in range(n):
        for j in range(m.top_k):
            e = int(idx[t, j])
            if e >= 0:
                h = x[t].float() @ w13[e].float()
                f = m.expert_ffn
                ref[t] += w[t, j] * ((torch.nn.functional.silu(h[:f]) * h[f:]) @ w2[e].float())
    assert y.dtype == torch.bfloat16 and rel_err(y, ref) < TOL


def test_deepep_shape_problems():
    assert moe.deepep_shape_problem(MODELS[1], 2) is None
    assert moe.deepep_shape_problem(moe.moe_model("deepseek-v3"), 2) is None  # 128 experts a rank, hidden 7168
    assert moe.deepep_shape_problem(moe.moe_model("qwen3-235b"), 2) is None
    assert "hidden % 16" in moe.deepep_shape_problem(MoEModel("h", 520, 64, 8, 2, "softmax"), 2)
    assert "hidden <= 8176" in moe.deepep_shape_problem(MoEModel("h", 8192, 64, 8, 2, "softmax"), 2)
    assert "experts per rank" in moe.deepep_shape_problem(MoEModel("e", 512, 64, 512, 2, "softmax"), 2)


def test_check_world_ranks_on_one_gpu(monkeypatch):
    monkeypatch.setattr(launcher, "visible_gpus", lambda: 1)
    monkeypatch.delenv(launcher.ONE_GPU_ENV, raising=False)
    with pytest.raises(launcher.LaunchError, match="only 1 are visible"):
        launcher.check_world(2)
    monkeypatch.setenv(launcher.ONE_GPU_ENV, "1")
    assert launcher.ranks_on_one_gpu() and launcher.check_world(2) == 2 and launcher.check_world(None) == 1
    monkeypatch.setenv(launcher.ONE_GPU_ENV, "0")
    assert not launcher.ranks_on_one_gpu()


# --------------------------------------------------------------------------- a stand-in deep_ep (CPU ranks)


class _Config:
    """deep_ep.Config(num_sms, nvl send, nvl recv, rdma send, rdma recv) with its checks and NVLink size hint
    (config.hpp; the wheel has no NVSHMEM, so no source-meta bytes and no RDMA hint)."""

    def __init__(self, num_sms=20, nvl_send=6, nvl_recv=256, rdma_send=6, rdma_recv=256):
        assert num_sms >= 0 and 0 < nvl_send < nvl_recv and 0 < rdma_send
        self._sms, self._recv = num_sms, nvl_recv

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        assert num_ranks < 8 or num_ranks % 8 == 0
        n = (self._sms // 2) * min(num_ranks, 8)
        size = n * 5 * 4 + n * self._recv * (hidden_bytes + 128 * 8 + 128 * 4 + 128 * 4)
        return (size + 127) // 128 * 128

    def get_rdma_buffer_size_hint(self, hidden_bytes, num_ranks):
        raise RuntimeError("NVSHMEM is disable during compilation")


class _Event:
    def current_stream_wait(self):
        pass


def _a2a(rows, send_counts, recv_counts):
    out = rows.new_empty((sum(recv_counts), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_counts, send_counts)
    return out


class _Buffer:
    """deep_ep.Buffer's intranode API (buffer.py at 567632d): the same arguments and return tuples, the checks its
    C++ side makes on the host, dispatch/combine emulated with gloo all-to-alls."""
    num_sms = 20
    log = []
    reduce_topk_weights = True  # False: combine returns zeros for topk_weights (the control, _gate_gradient_control)

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                 allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                 explicitly_destroy=False, enable_shrink=False, comm=None):
        assert group is not None and num_nvl_bytes % 128 == 0 and num_nvl_bytes > 0
        assert num_rdma_bytes == 0 and not low_latency_mode, "intranode only (no NVSHMEM in the wheel)"
        self.rank, self.group, self.group_size = group.rank(), group, group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.explicitly_destroy, self._destroyed = explicitly_destroy, False
        dist.barrier(group)  # the constructor's handle exchange is collective
        _Buffer.log.append(("init", num_nvl_bytes))

    def destroy(self):
        assert self.explicitly_destroy and not self._destroyed
        dist.barrier(self.group)  # the runtime's destroy() is a barrier between the ranks
        self._destroyed = True
        _Buffer.log.append(("destroy", self.num_nvl_bytes))

    @staticmethod
    def set_num_sms(n):
        assert n % 2 == 0
        _Buffer.num_sms = n

    @staticmethod
    def get_dispatch_config(num_ranks):
        return {2: _Config(_Buffer.num_sms, 24, 256, 6, 128), 4: _Config(_Buffer.num_sms, 6, 256, 6, 128),
                8: _Config(_Buffer.num_sms, 6, 256, 6, 128)}[num_ranks]

    @staticmethod
    def get_combine_config(num_ranks):
        return {2: _Config(_Buffer.num_sms, 10, 256, 6, 128), 4: _Config(_Buffer.num_sms, 9, 256, 6, 128),
                8: _Config(_Buffer.num_sms, 4, 256, 6, 128)}[num_ranks]

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False,
                            allocate_on_comm_stream=False):
        assert not self._destroyed
        assert topk_idx.dim() == 2 and topk_idx.is_contiguous() and topk_idx.dtype == torch.int64
        w, local = self.group_size, num_experts // self.group_size
        dest = torch.where(topk_idx >= 0, topk_idx // local, -1)
        in_rank = torch.stack([(dest == r).any(1) for r in range(w)], 1).contiguous()
        per_rank = in_rank.sum(0).to(torch.int32)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).to(torch.int32)
        return per_rank, None, per_expert, in_rank, _Event()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment=1, num_worst_tokens=0, config=None, previous_event=None, async_finish=False,
                 allocate_on_comm_stream=False):
        assert num_worst_tokens == 0 and expert_alignment == 1 and isinstance(config, _Config)
        assert num_tokens_per_rdma_rank is None  # intranode
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16
        n, hidden = x.shape
        assert (hidden * x.element_size()) % 16 == 0 and hidden % 16 == 0 and hidden <= 8176  # host + TMA asserts
        if handle is not None:  # cached mode: the layout of an earlier dispatch, x only (a combine's backward)
            assert topk_idx is None and topk_weights is None
            send_counts, _, recv_counts, recv_src, in_rank, tok = handle
            assert in_rank.shape[0] == n
            _Buffer.log.append(("cached", n))
            return _a2a(x[tok], send_counts, recv_counts), None, None, None, None, _Event()
        assert is_token_in_rank.dtype == torch.bool and is_token_in_rank.is_contiguous()
        w = self.group_size
        assert is_token_in_rank.shape == (n, w)
        assert num_tokens_per_rank.dtype == num_tokens_per_expert.dtype == torch.int32
        assert num_tokens_per_rank.shape == (w,) and num_tokens_per_expert.numel() % w == 0
        local = num_tokens_per_expert.numel() // w
        assert local <= 128
        assert topk_idx.is_contiguous() and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32
        k = topk_idx.shape[1]
        assert topk_idx.shape == topk_weights.shape == (n, k) and k <= 32
        chunks = config._sms // 2 * w * config._recv
        need = (w * w * 4 + 4 * (config._sms // 2) * w * 4
                + chunks * (hidden * x.element_size() + 4 + k * 8 + k * 4))
        assert need <= self.num_nvl_bytes, f"DeepEP's dispatch buffer assertion: {need} > {self.num_nvl_bytes}"
        send_tok, send_idx, send_w = [], [], []
        for r in range(w):
            tok = is_token_in_rank[:, r].nonzero(as_tuple=True)[0]
            on_r = (topk_idx[tok] >= r * local) & (topk_idx[tok] < (r + 1) * local)
            send_tok.append(tok)
            send_idx.append(torch.where(on_r, topk_idx[tok] - r * local, -1))
            send_w.append(torch.where(on_r, topk_weights[tok], 0.0))
        send_counts = [len(t) for t in send_tok]
        recv_counts = torch.empty(w, dtype=torch.int64)
        dist.all_to_all_single(recv_counts, torch.tensor(send_counts, dtype=torch.int64))
        recv_counts = recv_counts.tolist()
        tok = torch.cat(send_tok)
        recv_x = _a2a(x[tok], send_counts, recv_counts)
        recv_idx = _a2a(torch.cat(send_idx), send_counts, recv_counts)
        recv_w = _a2a(torch.cat(send_w), send_counts, recv_counts)
        recv_src = _a2a(tok, send_counts, recv_counts)
        per_expert = [int((recv_idx == i).sum()) for i in range(local)]
        handle = (send_counts, None, recv_counts, recv_src.to(torch.int32), is_token_in_rank, tok)
        return recv_x, recv_idx, recv_w, per_expert, handle, _Event()

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, previous_event=None,
                async_finish=False, allocate_on_comm_stream=False):
        assert isinstance(config, _Config) and bias is None
        send_counts, _, recv_counts, recv_src, in_rank, tok = handle
        assert x.dim() == 2 and x.is_contiguous() and x.dtype == torch.bfloat16 and x.shape[0] == len(recv_src)
        back = _a2a(x, recv_counts, send_counts)  # every partial back to its token's rank, in the sent order
        y = torch.zeros(in_rank.shape[0], x.shape[1], dtype=torch.float32)
        y.index_add_(0, tok, back.float())        # DeepEP's combine: a sum in fp32, bf16 out
        w = None
        if topk_weights is not None:  # reduced too: summed over the ranks the token went to (fp32)
            assert topk_weights.dim() == 2 and topk_weights.is_contiguous() and topk_weights.dtype == torch.float32
            assert topk_weights.shape[0] == x.shape[0]
            w = torch.zeros(in_rank.shape[0], topk_weights.shape[1], dtype=torch.float32)
            if _Buffer.reduce_topk_weights:
                w.index_add_(0, tok, _a2a(topk_weights, recv_counts, send_counts))
        return y.to(torch.bfloat16), w, _Event()


def _fake_deep_ep():
    mod = types.ModuleType("deep_ep")
    mod.Buffer, mod.Config, mod.EventOverlap, mod.topk_idx_t = _Buffer, _Config, _Event, torch.int64
    return mod


# --------------------------------------------------------------------------- the checks every rank runs


def _case_inputs(m, routing, mask, device, tokens, seed=0):
    """Every rank's x (one process makes all: the generator is deterministic per rank), the router weight and
    bias, every rank's (w13, w2). Masked experts: x[:, 0] = 1 and their router column 0 = OFF_LOGIT."""
    xs, wr, bias = [], None, None
    for r in range(WORLD):
        x, wr, bias, _ = moe.make_router_inputs(m, tokens, routing, r, seed, device)
        xs.append(x)
    if mask:
        local = m.experts // WORLD
        off = [1, m.experts - 2] if mask == "empty" else list(range(local, m.experts))
        for x in xs:
            x[:, 0] = 1.0
        wr = wr.clone()
        wr[off, 0] = OFF_LOGIT
    ws = [moe.make_expert_weights(m, WORLD, r, seed, device) for r in range(WORLD)]
    return xs, wr, bias, ws


def _check_callable(rank, device, check):
    for m in MODELS:
        local = m.experts // WORLD
        for routing, mask in CASES:
            what = f"{m.name} {routing} {mask or ''}"
            xs, wr, bias, ws = _case_inputs(m, routing, mask, device, TOKENS[device.type])
            kw = moe.route_kwargs(m, bias)
            load = sum(moe.expert_load(route(x, wr, m.top_k, **kw)[1], m.experts) for x in xs)
            if mask == "empty":
                check(load[1] == 0 and load[m.experts - 2] == 0, f"{what}: load {load.tolist()}")
            if mask == "rank0":
                check(load[local:].sum() == 0, f"{what}: rank 1's experts got {load[local:].tolist()}")
            inp = moe.MoEInputs(m, xs[rank], wr, bias, *ws[rank])
            try:
                fn, nvl = moe.deepep_callable(inp)
                outs = [fn() for _ in range(2 if device.type == "cuda" else 1)]  # GPU: again, same Buffer
                if device.type == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # recorded; the peer may be stuck in DeepEP, so stop here
                check(False, f"{what}: {type(e).__name__}: {e}")
                return False
            ref = moe_forward_ref_local(xs, wr, [w[0] for w in ws], [w[1] for w in ws], top_k=m.top_k, **kw)[rank]
            for i, y in enumerate(outs):
                check(y.dtype == torch.bfloat16 and tuple(y.shape) == tuple(xs[rank].shape),
                      f"{what}: call {i} gave {y.dtype} {tuple(y.shape)}")
                err = rel_err(y, ref)
                check(err < TOL, f"{what}: call {i} rel_err {err:.3e} >= {TOL:g}")
            check(nvl > 0 and nvl % 128 == 0, f"{what}: NVLink buffer {nvl} bytes")
    return True


def _check_point(device, check):
    """One benchmark point through the bench's harness: deepep and nccl-a2a rows ok, deepep's note and buffer."""
    m = MODELS[1]
    st = moe.MoESettings(impls=("nccl-a2a", "deepep"), iters=3, warmup=1, expert_gemms=False)
    rows = moe.run_case(moe.MoECase(m.name, TOKENS[device.type], "zipf:1.2", asdict(m)), st, device=device)
    by = {r["impl"]: r for r in rows if r["op"] == "moe_fwd"}
    for name in ("nccl-a2a", "deepep"):
        r = by.get(name, {})
        check(r.get("status") == "ok" and r.get("rel_err") is not None and r["rel_err"] < TOL,
              f"run_case {name}: {r.get('status')} {r.get('reason')} rel_err {r.get('rel_err')}")
    note = by.get("deepep", {}).get("note") or ""
    check(note.startswith("DeepEP intranode: Buffer.get_dispatch_config(2)"), f"deepep note {note!r}")
    check((by.get("deepep", {}).get("workspace_bytes") or 0) > 0, "deepep row without its NVLink buffer size")


def _check_backward(device, check):
    """The backward through the bench's harness: one point per router (MODELS) in bwd and fwd+bwd, nccl-a2a and
    deepep rows ok with each of the four gradients' errors against the distributed fp32 reference below
    GRAD_TOLERANCE, deepep's note and NVLink buffer recorded. Collective (every rank in step)."""
    for m in MODELS:
        for direction in (moe.BWD, moe.FWD_BWD):
            st = moe.MoESettings(impls=("nccl-a2a", "deepep"), iters=2, warmup=1, expert_gemms=False,
                                 direction=direction)
            rows = moe.run_case(moe.MoECase(m.name, TOKENS[device.type], "zipf:1.2", asdict(m)), st, device=device)
            by = {r["impl"]: r for r in rows if r["op"] == "moe_fwd"}
            for name in ("nccl-a2a", "deepep"):
                r = by.get(name, {})
                grads = r.get("rel_err_grads") or {}
                check(r.get("status") == "ok" and r.get("direction") == direction and set(grads) == set(moe.GRADS)
                      and all(0 < e < moe.GRAD_TOLERANCE for e in grads.values()),
                      f"{m.name} {direction} {name}: {r.get('status')} {r.get('reason')} rel_err_grads {grads}")
            deepep = by.get("deepep", {})
            check((deepep.get("note") or "").startswith("DeepEP intranode:") and
                  (deepep.get("workspace_bytes") or 0) > 0, f"{m.name} {direction} deepep note / buffer: {deepep}")


def _gate_gradient_control(rank, check):
    """With combine's reduced ``topk_weights`` zeroed (the stand-in's switch), the gate weights get no gradient in
    the dispatch backward: the check must then fail on d_router (the router weight's only path there) while the
    expert weights' gradients still pass, and pass again with them."""
    m = MODELS[1]
    xs, wr, bias, ws = _case_inputs(m, "uniform", None, torch.device("cpu"), TOKENS["cpu"])
    dy = torch.randn(xs[rank].shape, generator=torch.Generator().manual_seed(50 + rank)).to(torch.bfloat16)
    inp = moe.MoEInputs(m, xs[rank], wr, bias, *ws[rank], direction=moe.BWD, dy=dy)
    ref = moe.grad_reference(inp, WORLD)  # collective
    fn, _ = moe.deepep_callable(inp)
    errs = {}
    for reduce in (False, True):
        _Buffer.reduce_topk_weights = reduce
        errs[reduce] = ref.errors(fn())[1]
    _Buffer.reduce_topk_weights = True
    check(errs[False]["d_router"] > 0.5 and errs[False]["dw13"] < moe.GRAD_TOLERANCE,
          f"without the weights' gradient: {errs[False]}")
    check(max(errs[True].values()) < moe.GRAD_TOLERANCE, f"with the weights' gradient: {errs[True]}")


def _check_all(rank, device, check):
    if _check_callable(rank, device, check):
        _check_point(device, check)
        moe.deepep_release()  # collective: both ranks got here
        check(not moe._DEEPEP, "deepep_release left state behind")


# --------------------------------------------------------------------------- CPU ranks, stand-in deep_ep


def _cpu_time_op(fn, *, iters=20, warmup=5, **kw):
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    t = torch.tensor([ms], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ms = t.item()
    return {"time_ms": ms, "p20_ms": ms, "p80_ms": ms, "samples": 1, "host_ms": ms}


def _cpu_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # two ranks on a small CI machine
    try:
        sys.modules["deep_ep"] = _fake_deep_ep()
        timing.time_op = _cpu_time_op
        check = Checks(rank)
        _check_all(rank, torch.device("cpu"), check)
        q.put((rank, (check.failures, list(_Buffer.log))))
    finally:
        dist.destroy_process_group()


def _cpu_bwd_rank(rank, world, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        sys.modules["deep_ep"] = _fake_deep_ep()
        timing.time_op = _cpu_time_op
        check = Checks(rank)
        _check_backward(torch.device("cpu"), check)
        _gate_gradient_control(rank, check)
        moe.deepep_release()
        q.put((rank, (check.failures, list(_Buffer.log))))
    finally:
        dist.destroy_process_group()


def test_deepep_backward_over_gloo_with_a_stand_in_buffer():
    """deepep's bwd / fwd+bwd rows at W = 2 (CPU ranks, the stand-in Buffer): gradients checked by the harness,
    the gate weights' gradient through combine's topk_weights; cached-mode dispatches ran (combine's backward)."""
    got = spawn_gloo(_cpu_bwd_rank, WORLD, timeout_s=300)
    for rank, (failures, log) in got.items():
        assert failures == [], (rank, failures)
        assert any(kind == "cached" for kind, _ in log), log


def test_deepep_callable_over_gloo_with_a_stand_in_buffer():
    got = spawn_gloo(_cpu_rank, WORLD, timeout_s=300)
    for rank, (failures, log) in got.items():
        assert failures == [], (rank, failures)
        # one Buffer for the first model, destroyed and made again larger for the second (hidden 1024), then
        # freed by deepep_release
        kinds = [k for k, _ in log]
        assert kinds == ["init", "destroy", "init", "destroy"], log
        assert log[2][1] > log[0][1]


# --------------------------------------------------------------------------- GPU: the real wheel, one GPU


def _deepep_import_problem():
    if importlib.util.find_spec("deep_ep") is None:
        return "deep_ep is not installed (README: DeepEP baseline; dev/archive/x1_session.sh deepep installs the wheel)"
    try:
        importlib.import_module("deep_ep")
    except Exception as e:  # a build for another torch / CUDA fails here
        return f"deep_ep does not import ({type(e).__name__}: {e})"
    return None


def _gpu_rank(rank, world, out_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    check = Checks(rank)
    try:
        _check_all(rank, torch.device("cuda", torch.cuda.current_device()), check)
    finally:
        check.finish(out_dir)


def _two_ranks_on_one_gpu(rank_fn, tmp_path, timeout_s: int) -> None:
    """``rank_fn`` on WORLD processes on cuda:0 over gloo (skipped without the wheel); every rank must finish and
    report no failed check."""
    problem = _deepep_import_problem()
    if problem:
        pytest.skip(problem)
    launcher.spawn_one_gpu(rank_fn, WORLD, str(tmp_path), timeout_s=timeout_s)
    for r in range(WORLD):
        f = Path(tmp_path) / f"rank{r}.txt"
        assert f.exists(), f"rank {r} did not finish"
        assert f.read_text() == "", f.read_text()


@pytest.mark.gpu
def test_deepep_two_ranks_on_one_gpu(tmp_path):
    _two_ranks_on_one_gpu(_gpu_rank, tmp_path, 240)


def _gpu_bwd_rank(rank, world, out_dir):
    torch.backends.cuda.matmul.allow_tf32 = False
    check = Checks(rank)
    try:
        _check_backward(torch.device("cuda", torch.cuda.current_device()), check)
        moe.deepep_release()  # collective: both ranks got here
    finally:
        check.finish(out_dir)


@pytest.mark.gpu
def test_deepep_backward_two_ranks_on_one_gpu(tmp_path):
    """The bwd and fwd+bwd directions of the deepep baseline end to end on the real wheel (two processes on
    cuda:0 over gloo): rows ok, every gradient within GRAD_TOLERANCE of the distributed fp32 reference."""
    _two_ranks_on_one_gpu(_gpu_bwd_rank, tmp_path, 300)
