"""Input validation of the public ops (ValueError before anything is launched), error decoding, and
kosmos.models' TP GEMM shapes.

The ops' checks that need a CUDA tensor to get past the device check run here on a CPU-only machine with a
tensor subclass that reports ``device == cuda:0`` (on a GPU machine, with real CUDA tensors). The workspace,
the SM count and the launch are monkeypatched: the workspace is a fake whose first mutating call raises
``_Reached``, so a valid call ends there and an invalid one must raise ValueError before it.
"""
import importlib
import types

import pytest
import torch

from kosmos import models, runtime

agmod = importlib.import_module("kosmos.kernels.all_gather_matmul")
rsmod = importlib.import_module("kosmos.kernels.matmul_reduce_scatter")
GRID = 132  # SM count reported by the patched runtime.num_sms


class _FakeCuda(torch.Tensor):
    """A CPU tensor that reports itself as on cuda:0 (only metadata is ever read by the checks)."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda", 0)


def cuda(t):
    """``t`` on cuda:0 with the same shape and strides (views are taken before calling this)."""
    if torch.cuda.is_available():
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda").copy_(t)
    return torch.Tensor._make_subclass(_FakeCuda, t)


def bf16(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


class _Reached(Exception):
    """Validation passed: the op went on to touch the workspace (first step towards a launch)."""


class FakeWorkspace:
    def __init__(self, size, rank=0):
        self.world = types.SimpleNamespace(size=size, rank=rank, group=None, device=torch.device("cuda", 0))
        self.calls = []

    def _touch(self, what):
        self.calls.append(what)
        raise _Reached(what)

    def ensure(self, *a, **k):
        self._touch("ensure")

    def next_epoch(self):
        self._touch("next_epoch")

    def after_launch(self):
        self._touch("after_launch")

    def timeout_ns(self):
        self._touch("timeout_ns")


@pytest.fixture
def fake_world(monkeypatch):
    """Patch every path from the checks to a launch; returns a setter for the world size."""
    state = {"ws": FakeWorkspace(1), "get_workspace": 0, "launches": 0}

    def get_workspace(group=None, device=None):
        state["get_workspace"] += 1
        return state["ws"]

    def launch(*a, **k):
        state["launches"] += 1
        raise AssertionError("kernel launched")

    def no_alloc():
        raise AssertionError("allocator set up during validation")

    monkeypatch.setattr(runtime, "get_workspace", get_workspace)
    monkeypatch.setattr(runtime, "num_sms", lambda device: GRID)
    monkeypatch.setattr(runtime, "ensure_triton_allocator", no_alloc)
    monkeypatch.setattr(agmod, "launch", launch)
    monkeypatch.setattr(rsmod, "launch", launch)

    def set_world(size, rank=0):
        state["ws"] = FakeWorkspace(size, rank)
        return state["ws"]

    state["set_world"] = set_world
    yield state
    assert state["launches"] == 0


def _ag(a, b, **kw):
    return agmod.all_gather_matmul(a, b, **kw)


def _rs(a, b, **kw):
    return rsmod.matmul_reduce_scatter(a, b, **kw)


OPS = [pytest.param(_ag, id="all_gather_matmul"), pytest.param(_rs, id="matmul_reduce_scatter")]


def _raises_before_launch(state, fn, a, b, match, **kw):
    with pytest.raises(ValueError, match=match):
        fn(a, b, **kw)
    assert state["ws"].calls == []
    assert state["launches"] == 0


# ------------------------------------------------------------------------------------ positive controls
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kw", [{}, {"policy": "self"}, {"policy": "fixed", "comm_programs": 1},
                                {"policy": "fixed", "comm_programs": GRID - 1}])
def test_valid_inputs_pass_validation(fake_world, op, kw):
    with pytest.raises(_Reached):
        op(cuda(bf16(24, 16)), cuda(bf16(16, 32)), **kw)
    with pytest.raises(_Reached):  # transposed row-major [N, K] weight
        op(cuda(bf16(24, 16)), cuda(bf16(32, 16).t()), **kw)


def test_valid_trace_buffer_passes(fake_world):
    trace = cuda(torch.zeros(GRID, 1024, 4, dtype=torch.int64))
    with pytest.raises(_Reached):
        _ag(cuda(bf16(24, 16)), cuda(bf16(16, 32)), trace=trace)


# ------------------------------------------------------------------------ checks reachable with CPU tensors
@pytest.mark.parametrize("op", OPS)
def test_wrong_dtype(fake_world, op):
    _raises_before_launch(fake_world, op, cuda(torch.zeros(8, 16)), cuda(bf16(16, 8)), "bfloat16")
    _raises_before_launch(fake_world, op, cuda(bf16(8, 16)), cuda(torch.zeros(16, 8, dtype=torch.float16)),
                          "bfloat16")
    # the same on plain CPU tensors: the dtype check comes before the device check
    _raises_before_launch(fake_world, op, torch.zeros(8, 16), bf16(16, 8), "bfloat16")


@pytest.mark.parametrize("op", OPS)
def test_not_2d(fake_world, op):
    _raises_before_launch(fake_world, op, bf16(16), bf16(16, 8), "2-D")
    _raises_before_launch(fake_world, op, cuda(bf16(16)), cuda(bf16(16, 8)), "2-D")
    _raises_before_launch(fake_world, op, cuda(bf16(8, 16)), cuda(bf16(2, 8, 8)), "2-D")


@pytest.mark.parametrize("op", OPS)
def test_not_a_tensor(fake_world, op):
    _raises_before_launch(fake_world, op, [[1.0]], bf16(16, 8), "torch.Tensor")


@pytest.mark.parametrize("op", OPS)
def test_empty(fake_world, op):
    _raises_before_launch(fake_world, op, cuda(bf16(0, 16)), cuda(bf16(16, 8)), "empty")


@pytest.mark.parametrize("op", OPS)
def test_cpu_tensor(fake_world, op):
    _raises_before_launch(fake_world, op, bf16(8, 16), bf16(16, 8), "CUDA")
    _raises_before_launch(fake_world, op, bf16(8, 16), cuda(bf16(16, 8)), "CUDA")


def test_cpu_tensor_unpatched():
    """Without any patching the public ops reject CPU tensors (nothing CUDA is touched first)."""
    import kosmos
    with pytest.raises(ValueError, match="CUDA"):
        kosmos.all_gather_matmul(bf16(8, 16), bf16(16, 8))
    with pytest.raises(ValueError, match="CUDA"):
        kosmos.matmul_reduce_scatter(bf16(8, 16), bf16(16, 8))
    with pytest.raises(ValueError, match="bfloat16"):
        kosmos.all_gather_matmul(torch.zeros(8, 16), torch.zeros(16, 8))
    with pytest.raises(ValueError, match="2-D"):
        kosmos.matmul_reduce_scatter(bf16(8), bf16(8, 8))


# ------------------------------------------------------------------ checks past the device check (patched)
@pytest.mark.parametrize("op", OPS)
def test_b_on_other_device(fake_world, op):
    _raises_before_launch(fake_world, op, cuda(bf16(8, 16)), bf16(16, 8), "is on")


@pytest.mark.parametrize("op", OPS)
def test_a_not_contiguous(fake_world, op):
    a = cuda(bf16(8, 32)[:, :16])
    assert not a.is_contiguous()
    _raises_before_launch(fake_world, op, a, cuda(bf16(16, 8)), "contiguous")
    _raises_before_launch(fake_world, op, cuda(bf16(16, 8).t()), cuda(bf16(16, 8)), "contiguous")


@pytest.mark.parametrize("op", OPS)
def test_mismatched_k(fake_world, op):
    _raises_before_launch(fake_world, op, cuda(bf16(8, 16)), cuda(bf16(24, 8)), "K=16")
    _raises_before_launch(fake_world, op, cuda(bf16(8, 16)), cuda(bf16(8, 16)), "K=16")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("k,n,name", [(12, 16, "K=12"), (16, 12, "N=12"), (4, 8, "K=4"), (8, 1, "N=1"),
                                      (20, 36, "K=20")])
def test_k_n_multiple_of_8(fake_world, op, k, n, name):
    _raises_before_launch(fake_world, op, cuda(bf16(8, k)), cuda(bf16(k, n)), f"{name} must be a multiple of 8")
    # a transposed weight is checked the same way
    _raises_before_launch(fake_world, op, cuda(bf16(8, k)), cuda(bf16(n, k).t()), "multiple of 8")


@pytest.mark.parametrize("op", OPS)
def test_b_strided_not_transpose(fake_world, op):
    b = cuda(bf16(16, 64)[:, ::2])  # [16, 32], strides (64, 2)
    assert not b.is_contiguous() and not b.t().is_contiguous()
    _raises_before_launch(fake_world, op, cuda(bf16(8, 16)), b, "row-major")
    b2 = cuda(bf16(16, 64)[:, :32])  # [16, 32], strides (64, 1): a column slice
    _raises_before_launch(fake_world, op, cuda(bf16(8, 16)), b2, "row-major")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("policy", ["greedy", "SELF", "", "fixed-role"])
def test_unknown_policy(fake_world, op, policy):
    _raises_before_launch(fake_world, op, cuda(bf16(8, 16)), cuda(bf16(16, 8)), "unknown policy",
                          policy=policy)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("s", [None, 0, -1, GRID, GRID + 5])
def test_fixed_policy_bad_comm_programs(fake_world, op, s):
    _raises_before_launch(fake_world, op, cuda(bf16(8, 16)), cuda(bf16(16, 8)), "comm_programs",
                          policy="fixed", comm_programs=s)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("shape", [(GRID, 1024), (GRID - 1, 1024, 4), (GRID, 512, 4)])
def test_bad_trace_buffer(fake_world, op, shape):
    trace = cuda(torch.zeros(*shape, dtype=torch.int64))
    _raises_before_launch(fake_world, op, cuda(bf16(9, 16)), cuda(bf16(16, 8)), "trace", trace=trace)


@pytest.mark.parametrize("m", [8, 10, 1])
def test_reduce_scatter_m_not_divisible_by_world(fake_world, m):
    fake_world["set_world"](3)
    _raises_before_launch(fake_world, _rs, cuda(bf16(m, 16)), cuda(bf16(16, 8)), "divide by the world size 3")


def test_reduce_scatter_m_divisible_by_world_passes(fake_world):
    ws = fake_world["set_world"](3, rank=2)
    with pytest.raises(_Reached):
        _rs(cuda(bf16(9, 16)), cuda(bf16(16, 8)))
    assert ws.calls == ["ensure"]


def test_all_gather_any_shard_rows_at_world_3(fake_world):
    ws = fake_world["set_world"](3, rank=1)
    with pytest.raises(_Reached):
        _ag(cuda(bf16(7, 16)), cuda(bf16(16, 8)))
    assert ws.calls == ["ensure"]


# ------------------------------------------------------------------------------------- runtime (CPU-side)
def test_decode_error():
    from kosmos import codes
    msg = runtime.decode_error([1, 1 | codes.WAIT_AG_ROWS.value << 8, 0, 5, runtime.FLAG_BASE + 3, 2, 1, 50_000_000])
    assert msg.startswith("all_gather_matmul: rank 0 (task 5) timed out after 50.0 ms waiting for rows pushed by "
                          f"a peer (signal slot {runtime.FLAG_BASE + 3}): expected >= 2, observed 1")
    msg = runtime.decode_error([1, 2 | codes.WAIT_PEERS_DONE.value << 8, 3, -1, 1, 7, 6, 0])
    assert msg.startswith("matmul_reduce_scatter: rank 3 timed out") and "rank 1 to finish the previous call" in msg
    assert runtime.decode_error([1, 9, 0, 0, 0, 0, 0, 0]).startswith("op9:")


@pytest.mark.parametrize("tag", sorted(__import__("kosmos.codes").codes.WAIT_TEXT))
def test_every_wait_tag_decodes_to_words(tag):
    """Every tag a kernel can record has its sentence (no bare counter numbers in an error)."""
    msg = runtime.decode_error([1, 4 | tag << 8, 1, 7, 3, 2, 1, 1_000_000])
    assert msg.startswith("moe_forward: rank 1 (task 7) timed out after 1.0 ms waiting for ")
    assert "signal" not in msg.split("waiting for ")[1].split(":")[0] or tag in (2, 3)


def test_every_wait_tag_used_by_a_kernel_is_named():
    """The kernels record only named tags: every ``WAIT_*`` passed to a wait is in codes.WAIT_TEXT."""
    import pathlib
    import re
    from kosmos import codes
    root = pathlib.Path(codes.__file__).parent
    used = set()
    for path in list(root.glob("*.py")) + list(root.glob("kernels/*.py")):
        used |= set(re.findall(r"\b(WAIT_[A-Z0-9_]+)\b", path.read_text())) - {"WAIT_TEXT", "WAIT_SHIFT"}
    assert used, "no wait tags found"
    for name in used:
        assert getattr(codes, name).value in codes.WAIT_TEXT, name


def test_poisoned_workspace_raises():
    ws = runtime.Workspace(runtime.World(None, 0, 1, torch.device("cpu")))
    ws.check_errors()  # nothing launched yet: no error
    ws.poisoned = "all_gather_matmul: rank 0 timed out"
    with pytest.raises(runtime.KosmosTimeoutError, match="reset_workspaces"):
        ws.ensure(1, 1)
    with pytest.raises(runtime.KosmosTimeoutError, match="reset_workspaces"):
        ws.next_epoch()
    assert issubclass(runtime.KosmosTimeoutError, runtime.KosmosError)
    assert issubclass(runtime.KosmosError, RuntimeError)


def test_cuda_graph_capture_is_refused(monkeypatch):
    """A captured op would replay with its epoch frozen and read stale peer data: refused with a clear error
    before any workspace exists (the capture state is faked here; test_gpu.py captures for real)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(runtime.KosmosError, match="cannot be captured in a CUDA graph"):
        runtime.get_workspace(None, torch.device("cpu"))


def test_set_timeout_rejects_non_positive():
    for s in (0, -1.0):
        with pytest.raises(ValueError, match="positive"):
            runtime.set_timeout(s)


def test_world_of_group_without_dist():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        pytest.skip("needs no process group")
    w = runtime.World.of(None, torch.device("cpu"))
    assert (w.rank, w.size, w.group) == (0, 1, None)
    with pytest.raises(ValueError, match="not initialised"):
        runtime.World.of(object(), torch.device("cpu"))


# ------------------------------------------------------------------------------------------------ models
def test_tp_gemms_llama3_70b_tp2():
    g = {x.layer: x for x in models.tp_gemms("llama3-70b", 4096, 2)}
    assert list(g) == list(models.TP_LAYERS)
    assert (g["qkv"].op, g["qkv"].n, g["qkv"].k) == ("ag_gemm", 5120, 8192)
    assert (g["fc1"].op, g["fc1"].n, g["fc1"].k) == ("ag_gemm", 28672, 8192)
    assert (g["attn_out"].op, g["attn_out"].k, g["attn_out"].n) == ("gemm_rs", 4096, 8192)
    assert (g["fc2"].op, g["fc2"].k, g["fc2"].n) == ("gemm_rs", 14336, 8192)
    for x in g.values():
        assert x.model == "llama3-70b" and x.seq == 4096 and x.m == 4096


def test_tp_gemms_layer_subset_and_other_models():
    (fc2,) = models.tp_gemms("llama3-8b", 1024, 8, layers=("fc2",))
    assert (fc2.k, fc2.n) == (14336 // 8, 4096)
    gpt = {x.layer: x for x in models.tp_gemms("gpt3-175b", 512, 4)}
    assert gpt["fc1"].n == 49152 // 4  # not gated
    assert gpt["qkv"].n == 3 * 12288 // 4
    with pytest.raises(ValueError, match="unknown layer"):
        models.tp_gemms("llama3-8b", 1024, 8, layers=("qkv", "lm_head"))


def test_unknown_model():
    with pytest.raises(models.UnknownModelError) as e:
        models.tp_gemms("llama9-1t", 4096, 2)
    assert isinstance(e.value, ValueError)
    for name in models.DENSE_MODELS:
        assert name in str(e.value)
    assert "llama9-1t" in str(e.value)


@pytest.mark.parametrize("seq,tp", [(4097, 2), (100, 8), (10, 3)])
def test_seq_not_divisible_by_tp(seq, tp):
    with pytest.raises(ValueError, match="divide by tp"):
        models.tp_gemms("llama3-70b", seq, tp)


def test_width_not_divisible_by_tp():
    with pytest.raises(ValueError, match="does not divide"):
        models.tp_gemms("llama3-70b", 4096 * 3, 3)


@pytest.mark.parametrize("op", OPS)
def test_misaligned_base_pointer_rejected(fake_world, op):
    if torch.cuda.is_available():  # cuda() would copy into a fresh (aligned) allocation
        a = bf16(8 * 16 + 1).cuda()[1:].view(8, 16)
    else:
        a = cuda(bf16(8 * 16 + 1)[1:].view(8, 16))
    assert a.is_contiguous() and a.data_ptr() % 16 != 0
    _raises_before_launch(fake_world, op, a, cuda(bf16(16, 8)), "align")


def test_tma_descriptor_template_matches_a_fresh_descriptor():
    """kernels.common.tma_descriptor copies a per-layout template: every field equals what Triton's own
    TensorDescriptor.from_tensor gives, base is the tensor passed, and the cached template keeps no tensor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kosmos.kernels import common
    x, y = torch.zeros(256, 192, dtype=torch.bfloat16), torch.ones(256, 192, dtype=torch.bfloat16)
    dx, dy = common.tma_descriptor(x, [128, 64]), common.tma_descriptor(y, [128, 64])
    ref = TensorDescriptor.from_tensor(y, [128, 64])
    assert isinstance(dy, TensorDescriptor) and dy.base is y and dx.base is x
    assert {k: v for k, v in vars(dy).items() if k != "base"} == {k: v for k, v in vars(ref).items() if k != "base"}
    key = ((256, 192), (192, 1), torch.bfloat16, (128, 64))
    assert common._DESCRIPTOR_TEMPLATES[key].base is None
    other = common.tma_descriptor(torch.zeros(256, 192, dtype=torch.bfloat16)[:, :128], [128, 64])  # new layout
    assert tuple(other.strides) == (192, 1) and tuple(other.shape) == (256, 128)
