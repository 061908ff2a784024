"""The runtime pieces around the ops, all on the CPU: error records and their decoding (kosmos.codes wait tags),
workspaces (poisoned after a timeout; under a CUDA-graph capture: what is refused, what is skipped), timeouts, the World of a group, Triton's
allocator, the TMA descriptor cache, the op configs (kosmos.config), and kosmos.models' TP GEMM shapes.

The ops' own input checks are in their test files (test_all_gather_matmul.py, test_matmul_reduce_scatter.py,
test_moe_forward.py).
"""
import pytest
import torch

from kosmos import models
from kosmos.core import codes, planning, runtime
from kosmos.config import AllGatherMatmulConfig


# ----------------------------------------------------------------------------------- errors and wait tags
def test_decode_error():
    msg = runtime.decode_error([1, 1 | codes.WAIT_AG_ROWS.value << 8, 0, 5, runtime.FLAG_BASE + 3, 2, 1, 50_000_000])
    assert msg.startswith("all_gather_matmul: rank 0 (task 5) timed out after 50.0 ms waiting for rows pushed by "
                          f"a peer (signal slot {runtime.FLAG_BASE + 3}): expected >= 2, observed 1")
    msg = runtime.decode_error([1, 2 | codes.WAIT_PEERS_DONE.value << 8, 3, -1, 1, 7, 6, 0])
    assert msg.startswith("matmul_reduce_scatter: rank 3 timed out") and "rank 1 to finish the previous call" in msg
    assert runtime.decode_error([1, 9, 0, 0, 0, 0, 0, 0]).startswith("op9:")
    assert msg.endswith("A peer stalled, crashed, or did not make the same call (at one rank: the task it waited "
                        "for never ran -- a kernel bug; please report it).")  # says what a W = 1 timeout means


@pytest.mark.parametrize("tag", sorted(codes.WAIT_TEXT))
def test_every_wait_tag_decodes_to_words(tag):
    """Every tag a kernel can record has its sentence (no bare counter numbers in an error)."""
    msg = runtime.decode_error([1, 4 | tag << 8, 1, 7, 3, 2, 1, 1_000_000])
    assert msg.startswith("moe_forward: rank 1 (task 7) timed out after 1.0 ms waiting for ")
    signal_indexed = (codes.WAIT_AG_ROWS.value, codes.WAIT_RS_PARTIAL.value, codes.WAIT_MX_ROWS.value)
    assert "signal" not in msg.split("waiting for ")[1].split(":")[0] or tag in signal_indexed


def test_every_wait_tag_used_by_a_kernel_is_named():
    """The kernels record only named tags: every ``WAIT_*`` passed to a wait is in codes.WAIT_TEXT."""
    import pathlib
    import re
    root = pathlib.Path(codes.__file__).parent
    used = set()
    for path in list(root.glob("*.py")) + list(root.glob("kernels/*.py")):
        used |= set(re.findall(r"\b(WAIT_[A-Z0-9_]+)\b", path.read_text())) - {"WAIT_TEXT", "WAIT_SHIFT"}
    assert used, "no wait tags found"
    for name in used:
        assert getattr(codes, name).value in codes.WAIT_TEXT, name


# ------------------------------------------------------------------------------------ workspaces, World
def test_poisoned_workspace_raises():
    ws = runtime.Workspace(runtime.World(None, 0, 1, torch.device("cpu")))
    ws.check_errors()  # nothing launched yet: no error
    ws.poisoned = "all_gather_matmul: rank 0 timed out"
    with pytest.raises(runtime.KosmosTimeoutError, match="reset_workspaces"):
        ws.ensure(1, 1)
    with pytest.raises(runtime.KosmosTimeoutError, match="reset_workspaces"):
        ws.before_launch()
    assert issubclass(runtime.KosmosTimeoutError, runtime.KosmosError)
    assert issubclass(runtime.KosmosError, RuntimeError)


def _fake_capture(monkeypatch, on: bool):
    monkeypatch.setitem(runtime._CUDA, "available", True)  # runtime.cuda_available()'s cached answer
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: on)


def test_cuda_graph_capture_of_a_first_call_is_refused(monkeypatch):
    """The workspace may be taken while capturing (the epoch lives on the device: nothing to refuse), but what a
    capture cannot do -- grow the symmetric workspace or counters, make a local buffer, build task tables -- is
    refused with one line telling the user to run one eager call of the shape first (the capture state is
    faked here; test_matmul_reduce_scatter.py's GPU tests capture for real)."""
    _fake_capture(monkeypatch, True)
    try:
        runtime.get_workspace(None, torch.device("cpu"))
    finally:
        runtime.reset_workspaces()
    ws = runtime.Workspace(runtime.World(None, 0, 1, torch.device("cpu")))
    for grow in (lambda: ws.ensure(1, 1), lambda: ws.ensure_counters(8), lambda: ws.local("x", 4, torch.int32),
                 lambda: planning.cached_tables(("capture-test",), lambda: 1 / 0)):
        with pytest.raises(runtime.KosmosError, match="run one eager call with the same shapes") as e:
            grow()
        assert "\n" not in str(e.value) and "cannot be captured in a CUDA graph" in str(e.value)
    assert ws.data is None and not ws._local and ("capture-test",) not in planning._DEVICE_TABLES


def test_workspace_does_not_grow_under_captured_graphs(monkeypatch):
    """Once a call was captured (after_launch under capture), an eager call that would grow a buffer the graph
    holds raises instead of freeing it; what already fits passes."""
    ws = runtime.Workspace(runtime.World(None, 0, 1, torch.device("cpu")))
    ws.local("x", 8, torch.int32)
    _fake_capture(monkeypatch, True)
    ws.before_launch()
    ws.after_launch()
    _fake_capture(monkeypatch, False)
    assert ws.local("x", 8, torch.int32).numel() == 8  # fits: the same buffer
    for grow in (lambda: ws.ensure(1, 1), lambda: ws.ensure_counters(8), lambda: ws.local("x", 9, torch.int32)):
        with pytest.raises(runtime.KosmosError, match="cannot grow once CUDA graphs have captured") as e:
            grow()
        assert "\n" not in str(e.value) and "reset_workspaces" in str(e.value)


def test_error_mirror_is_read_without_events_and_check_errors_waits(monkeypatch):
    """No CUDA event per launch: a call reads the pinned mirror's flag word (a host load) and, once it is set,
    raises the decoded record; while capturing nothing is read or waited for; check_errors() synchronises the
    device first (eager launches and replays alike), then reads the mirror; a raised timeout poisons."""
    ws = runtime.Workspace(runtime.World(None, 0, 1, torch.device("cuda", 0)))
    ws._err_host = torch.zeros(codes.ERR_RECORD, dtype=torch.int64)  # a host tensor stands in for the pinned one
    synced = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))
    _fake_capture(monkeypatch, True)
    ws.before_launch()
    ws.after_launch()
    ws.check_errors()  # inside the capture: nothing to wait for
    assert synced == [] and ws._captured
    _fake_capture(monkeypatch, False)
    ws.before_launch()  # a clean word: no wait, no raise
    assert synced == []
    ws.check_errors()
    assert synced == [ws.world.device]
    record = [1, 1 | codes.WAIT_AG_ROWS.value << 8, 0, 5, runtime.FLAG_BASE + 3, 9, 8, 50_000_000]
    ws._err_host.copy_(torch.tensor(record))  # what a timed-out kernel (eager or replayed) writes
    with pytest.raises(runtime.KosmosTimeoutError, match="expected >= 9, observed 8"):
        ws.before_launch()  # the next call sees it without check_errors(), after waiting for the record
    assert synced == [ws.world.device] * 2
    with pytest.raises(runtime.KosmosTimeoutError, match="reset_workspaces"):  # poisoned
        ws.before_launch()
    with pytest.raises(runtime.KosmosTimeoutError, match="reset_workspaces"):
        ws.check_errors()
    fresh = runtime.Workspace(runtime.World(None, 0, 1, torch.device("cuda", 0)))
    fresh._err_host = torch.tensor(record)
    with pytest.raises(runtime.KosmosTimeoutError, match="rank 0 .task 5. timed out"):
        fresh.check_errors()


def test_cuda_available_is_asked_once(monkeypatch):
    calls = []
    monkeypatch.setattr(runtime, "_CUDA", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or False)
    assert not runtime.cuda_available() and not runtime.cuda_available() and not runtime.capturing()
    assert calls == [1]


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


def test_triton_allocator_is_set_in_other_threads():
    """Autograd runs a CUDA backward on its own thread, where Triton's allocator (a context variable) is
    unset; the fused ops set it before every launch (found on the GPU: backward of the nn layers failed
    with 'no allocator was set')."""
    import threading

    from triton.runtime import _allocation

    runtime.ensure_triton_allocator()
    seen = []

    def worker():
        before = _allocation._allocator.get()
        runtime.ensure_triton_allocator()
        seen.append((before, _allocation._allocator.get()))
    th = threading.Thread(target=worker)
    th.start()
    th.join()
    before, after = seen[0]
    assert isinstance(before, _allocation.NullAllocator)  # what made the GPU backward fail
    assert after is runtime._triton_scratch


def test_tma_descriptor_template_matches_a_fresh_descriptor():
    """kernels.descriptors.tma_descriptor copies a per-layout template: every field equals what Triton's own
    TensorDescriptor.from_tensor gives, base is the tensor passed, and the cached template keeps no tensor."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from kosmos.core import descriptors
    x, y = torch.zeros(256, 192, dtype=torch.bfloat16), torch.ones(256, 192, dtype=torch.bfloat16)
    dx, dy = descriptors.tma_descriptor(x, [128, 64]), descriptors.tma_descriptor(y, [128, 64])
    ref = TensorDescriptor.from_tensor(y, [128, 64])
    assert isinstance(dy, TensorDescriptor) and dy.base is y and dx.base is x
    assert {k: v for k, v in vars(dy).items() if k != "base"} == {k: v for k, v in vars(ref).items() if k != "base"}
    key = ((256, 192), (192, 1), torch.bfloat16, (128, 64))
    assert descriptors._DESCRIPTOR_TEMPLATES[key].base is None
    other = descriptors.tma_descriptor(torch.zeros(256, 192, dtype=torch.bfloat16)[:, :128], [128, 64])  # new layout
    assert tuple(other.strides) == (192, 1) and tuple(other.shape) == (256, 128)


# ------------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("field,value", [
    ("push_chunks", 0),      # not positive
    ("push_chunks", "two"),  # a string other than "auto"
    ("push_chunks", True),   # a bool is not an int here
    ("copy_block", 1000),    # not a power of two
    ("copy_block", 128),     # below the smallest copy step (256)
])
def test_ag_config_rejects_bad_fields(field, value):
    with pytest.raises(ValueError, match=field):
        AllGatherMatmulConfig(**{field: value})


def test_configs_from_strings_and_back():
    """The bench's --config key=value path: values parsed by field type, unknown keys named."""
    from kosmos.config import MatmulReduceScatterConfig, MoEForwardConfig, config_dict, config_from_strings
    assert config_from_strings(AllGatherMatmulConfig, {"push_chunks": "auto"}).push_chunks == "auto"
    assert config_from_strings(AllGatherMatmulConfig, {"push_chunks": "4"}).push_chunks == 4
    assert config_from_strings(MatmulReduceScatterConfig, {"push_partials": "true"}).push_partials is True
    assert config_dict(MoEForwardConfig(copy_cols=256)) == {"copy_cols": 256, "half_tail": True}
    with pytest.raises(ValueError, match="known: push_chunks, copy_block"):
        config_from_strings(AllGatherMatmulConfig, {"push_chunk": "4"})
    with pytest.raises(ValueError, match="half_tail"):
        config_from_strings(MoEForwardConfig, {"half_tail": "maybe"})
    with pytest.raises(ValueError, match="must be a kosmos.MoEForwardConfig"):
        planning.moe_config(AllGatherMatmulConfig())


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


@pytest.mark.parametrize("seq,tp", [
    (4097, 2),  # odd sequence
    (100, 8),   # 100 = 12 * 8 + 4
    (10, 3),    # TP not a power of two
])
def test_seq_not_divisible_by_tp(seq, tp):
    with pytest.raises(ValueError, match="divide by tp"):
        models.tp_gemms("llama3-70b", seq, tp)


def test_width_not_divisible_by_tp():
    with pytest.raises(ValueError, match="does not divide"):
        models.tp_gemms("llama3-70b", 4096 * 3, 3)
