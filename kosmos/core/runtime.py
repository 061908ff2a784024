"""The world a fused op runs over, the symmetric workspace it communicates through, and the host side of the
error protocol. The why and the parked alternatives: docs/design/core.md; host-cost figures: docs/perf/<op>.md.

``World.of(group, device)``: (group, rank, size <= MAX_WORLD = 8: one NVLink node, device). ``get_workspace``
returns the one ``Workspace`` of a process group on a device, created on first use and reused by every call of
every op; ``ensure`` / ``ensure_counters`` / ``local`` size its buffers:
* ``data`` -- symmetric uint8, the same size on every rank: torch symmetric memory over an NCCL group (one GPU per
  rank); over any other group on CUDA (gloo, every rank's process on one GPU: KOSMOS_RANKS_ON_ONE_GPU) plain
  allocations mapped into the peers by CUDA IPC (``_ipc_symmetric``). Peers reach it through ``peer_data`` (int64
  [W] base addresses). Each op lays out its regions in it (AllGather+GEMM: the gathered input [W * M/W, K];
  GEMM+ReduceScatter: the staging of its partial products [M, N]; the MoE layer: receive and combine regions).
* ``signals`` -- symmetric int32 flags (``peer_signals``): [DONE_BASE, DONE_BASE + 64) hold "rank p finished call
  e" (written by p); from FLAG_BASE the current op's per-chunk / per-tile flags, written with the call's epoch.
* ``counters`` -- symmetric int32 counters (``peer_counters``): peers add, the consumer resets to 0, so they are
  zero between calls; kept apart from ``signals`` so that no op's epoch-valued flag lands in a counter.
* ``heads`` -- local int32 [NUM_HEADS]: a TP op's four stage heads and the exit counter, zeroed by the last program
  out. ``local(name, numel, dtype)``: an op's other local buffers (created zeroed).
* ``epoch_slot`` -- local int32 [1], the device epoch: calls completed since the workspace was made or last grew.
  Every program reads epoch = slot + 1 at its start, the last one out of a call stores it (device.py); the host
  never passes an epoch, so a replayed CUDA graph runs each call at the next one (``device_epoch()``: tests).
* ``errors`` -- local int64 [ERR_SLOTS], the record a timed-out wait writes (codes.py's layout); its last slot holds
  the address of a pinned host-mapped mirror, which the recording program writes too, its flag word last.
Growth is collective (every rank makes the same call with the same shapes): synchronise, barrier, reallocate (1 MiB
floor, whole MiB, >= 4096 signal slots), zero the signals, reset the epoch slot, drop the launch plans that viewed
the old buffers (``_grew``).

Errors without stalling the stream: ``before_launch`` (every op, right before its launch) reads the mirror's flag
word, a host load and never a wait; once an earlier launch (eager or replayed) has set it, the call synchronises,
decodes the record (``decode_error``: op, rank, task, counter, expected, observed, elapsed, in words) and raises
``KosmosTimeoutError``; the workspace is then poisoned until ``reset_workspaces()`` (collective).
A launch still running when the next call looks is caught by a later call or by ``check_errors()``, which
synchronises first, so every launch made before it is accounted for. ``set_timeout`` bounds
every in-kernel wait (default KOSMOS_TIMEOUT_S or 5 s; it travels as an i32 of microseconds: no recompile).

CUDA graphs: a call may be captured once one eager call of the same shapes, dtypes, config and group has run; that
call creates what a capture must not (the buffers, task tables, compiled kernel, the MoE layer's cross-rank shape
check), and a capture that would need any of them raises a one-line ``KosmosError`` (``capture_refusal``). A
capture fixes shapes, tensor addresses, policy, config and the timeout; once a call was captured the buffers may
not grow (``_may_grow``: an eager call needing more raises, so the largest shapes go first; ``reset_workspaces()``
drops the buffers and the graphs on them). At W > 1 every rank captures the same calls and replays them in the
same order; replays write the same mirror as eager launches.

Tests: tests/test_runtime.py (records, poisoning, capture refusal, no growth under graphs, the mirror, set_timeout),
test_cuda_graphs.py, test_ranks_one_gpu.py (the CUDA-IPC workspace), and each op's epoch and timeout tests.
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from functools import lru_cache

import torch
import torch.distributed as dist

from .codes import ERR_RECORD, ERR_SLOTS, OP_NAMES, TRACE_KINDS, WAIT_TEXT, op_code, wait_tag  # noqa: F401

DONE_BASE = 0
FLAG_BASE = 64
MAX_WORLD = 8
NUM_HEADS = 5  # [0, 4): one queue head per stage of a TP op (schedule.py), [4]: the exit counter
EXIT_SLOT = 4
DEFAULT_TIMEOUT_S = float(os.environ.get("KOSMOS_TIMEOUT_S", "5.0"))


class KosmosError(RuntimeError):
    """Base class of runtime errors raised by KOSMOS."""


class KosmosTimeoutError(KosmosError):
    """A bounded wait inside a kernel expired (a peer stalled, crashed, or never launched)."""


@dataclass(frozen=True)
class World:
    """The process group a fused op runs over."""
    group: object
    rank: int
    size: int
    device: torch.device

    @staticmethod
    def of(group=None, device=None) -> "World":
        if dist.is_available() and dist.is_initialized():
            g = group if group is not None else dist.group.WORLD
            rank, size = dist.get_rank(g), dist.get_world_size(g)
        else:
            if group is not None:
                raise ValueError("a process group was given but torch.distributed is not initialised")
            g, rank, size = None, 0, 1
        if size > MAX_WORLD:
            raise ValueError(f"world size {size} > {MAX_WORLD}: KOSMOS targets one NVLink node")
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return World(g, rank, size, device)


def world_size(group=None) -> int:
    """Ranks in ``group`` (1 without an initialised process group)."""
    return dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1


@lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device) -> int:
    """SM count of ``device`` (read from the device, cached): the persistent grid size."""
    return _num_sms(torch.device(device).index if torch.device(device).index is not None
                    else torch.cuda.current_device())


def decode_error(err) -> str:
    """One sentence from an error record (codes.py's layout): which op, rank and task timed out, and what it
    was waiting for, in words."""
    op = OP_NAMES.get(op_code(err), f"op{op_code(err)}")
    wait = wait_tag(err)
    task = int(err[3])
    index = int(err[4])
    what = WAIT_TEXT.get(wait, f"signal {index}").format(index=index)
    where = "" if task < 0 else f" (task {task})"
    return (f"{op}: rank {int(err[2])}{where} timed out after {int(err[7]) / 1e6:.1f} ms waiting for {what}: "
            f"expected >= {int(err[5])}, observed {int(err[6])}. "
            "A peer stalled, crashed, or did not make the same call (at one rank: the task it waited for never "
            "ran -- a kernel bug; please report it).")


def one_rank_errors(ws, device: torch.device) -> torch.Tensor:
    """The error record a launch at one rank (no peer) writes into: on CUDA the workspace's, made if needed and
    with the earlier calls' timeouts raised first (``before_launch``); elsewhere (the interpreter, a compile-only
    run) a fresh zeroed one. Pair it with ``after_one_rank_launch``."""
    if device.type == "cuda":
        ws.ensure(1, 0)
        ws.before_launch()
        return ws.errors
    return torch.zeros(ERR_SLOTS, dtype=torch.int64)


def after_one_rank_launch(ws, device: torch.device, errors: torch.Tensor) -> None:
    """After a one-rank launch: on CUDA nothing to do here (a timeout raises at the next call or
    kosmos.check_errors(), from the workspace's mirror); elsewhere the launch has run, so its record is read now
    (KosmosTimeoutError)."""
    if device.type == "cuda":
        ws.after_launch()
    elif int(errors[0]):
        raise KosmosTimeoutError(decode_error(errors.tolist()))

@dataclass
class Workspace:
    world: World
    data: torch.Tensor | None = None          # local view of the symmetric data buffer (uint8)
    signals: torch.Tensor | None = None       # int32
    peer_data: torch.Tensor | None = None     # int64 [W]
    peer_signals: torch.Tensor | None = None  # int64 [W]
    counters: torch.Tensor | None = None      # int32, symmetric, always left at zero between calls
    peer_counters: torch.Tensor | None = None  # int64 [W]
    heads: torch.Tensor | None = None
    epoch_slot: torch.Tensor | None = None    # int32 [1], local: the device epoch (module docstring)
    errors: torch.Tensor | None = None
    poisoned: str | None = None
    _handles: list = field(default_factory=list)
    _ipc: dict = field(default_factory=dict)  # role -> (this rank's buffer, peers' mapped buffers): _ipc_symmetric
    _local: dict = field(default_factory=dict)
    agreed_shapes: set = field(default_factory=set)  # call signatures every rank was checked to share
    _err_host: torch.Tensor | None = None      # pinned int64 [ERR_RECORD]: the kernels' host mirror of the record
    _capturing: bool = False  # the current call is being captured into a CUDA graph (before_launch)
    _captured: bool = False   # some call was: the buffers may no longer grow (_may_grow)
    timeout_s: float = DEFAULT_TIMEOUT_S
    _plans: dict = field(default_factory=dict)  # the ops' launch plans on these buffers (launch_plan.py)

    @property
    def data_bytes(self) -> int:
        return 0 if self.data is None else self.data.numel()

    @property
    def signal_slots(self) -> int:
        return 0 if self.signals is None else self.signals.numel()

    def ensure(self, data_bytes: int, flag_slots: int) -> None:
        """Make sure the buffers hold ``data_bytes`` and ``FLAG_BASE + flag_slots`` flags (collective when it
        grows: every rank makes the same call with the same shapes)."""
        if self.poisoned:
            raise KosmosTimeoutError(self.poisoned + " (workspace poisoned; call kosmos.reset_workspaces())")
        need_sig = FLAG_BASE + flag_slots
        if self.data is not None and self.data_bytes >= data_bytes and self.signal_slots >= need_sig:
            return
        self._may_grow(f"its symmetric workspace must grow to {data_bytes} bytes and {need_sig} signal slots")
        dev = self.world.device
        if self.data is not None:  # growing: let every peer finish with the old buffers first
            torch.cuda.synchronize(dev)
            if self.world.size > 1:
                dist.barrier(group=self.world.group)
        data_bytes = max(data_bytes, self.data_bytes, 1 << 20)
        data_bytes = (data_bytes + (1 << 20) - 1) // (1 << 20) << 20
        need_sig = max(need_sig, self.signal_slots, 4096)
        try:
            self.data, data_ptrs = self._symmetric(data_bytes, torch.uint8, "data")
            self.signals, sig_ptrs = self._symmetric(need_sig, torch.int32, "signals")
        except torch.OutOfMemoryError as e:
            raise KosmosError(f"cannot allocate a {data_bytes / 2**20:.0f} MiB symmetric workspace on "
                              f"{dev}: {e}") from e
        self.signals.zero_()
        self.peer_data = torch.tensor(data_ptrs, dtype=torch.int64, device=dev)
        self.peer_signals = torch.tensor(sig_ptrs, dtype=torch.int64, device=dev)
        if self.heads is None:
            self.heads = torch.zeros(NUM_HEADS, dtype=torch.int32, device=dev)
            self.epoch_slot = torch.zeros(1, dtype=torch.int32, device=dev)
            self._err_host = torch.zeros(ERR_RECORD, dtype=torch.int64, pin_memory=True)
            # pinned memory is mapped into the device's address space at the same address (UVA)
            self.errors = torch.tensor([0] * ERR_RECORD + [self._err_host.data_ptr()], dtype=torch.int64, device=dev)
        self.epoch_slot.zero_()  # fresh zeroed signals: epochs restart (on every rank: growth is collective)
        self._grew()
        torch.cuda.synchronize(dev)
        if self.world.size > 1:
            dist.barrier(group=self.world.group)

    def ensure_counters(self, slots: int) -> None:
        """Make sure the symmetric counter buffer holds ``slots`` int32 (collective when it grows)."""
        if self.poisoned:
            raise KosmosTimeoutError(self.poisoned + " (workspace poisoned; call kosmos.reset_workspaces())")
        have = 0 if self.counters is None else self.counters.numel()
        if have >= slots:
            return
        self._may_grow(f"its symmetric counter buffer must grow to {slots} slots")
        dev = self.world.device
        if self.counters is not None:
            torch.cuda.synchronize(dev)
            if self.world.size > 1:
                dist.barrier(group=self.world.group)
        slots = max(slots, 2 * have, 4096)
        self.counters, ptrs = self._symmetric(slots, torch.int32, "counters")
        self.counters.zero_()
        self.peer_counters = torch.tensor(ptrs, dtype=torch.int64, device=dev)
        self._grew()
        torch.cuda.synchronize(dev)
        if self.world.size > 1:
            dist.barrier(group=self.world.group)

    def local(self, name: str, numel: int, dtype, init=None) -> torch.Tensor:
        """A local device buffer of at least ``numel`` elements kept for later calls (zeroed when created, then
        ``init(t)`` if given). Growing one is safe without a barrier: only this rank's kernels touch it, in
        stream order."""
        t = self._local.get(name)
        if t is None or t.numel() < numel or t.dtype != dtype:
            self._may_grow(f"its local buffer {name!r} must grow to {numel} elements")
            t = torch.zeros(max(numel, 1), dtype=dtype, device=self.world.device)
            if init is not None:
                init(t)
            self._local[name] = t
            self._grew()
        return t

    def _grew(self) -> None:
        """A buffer was made or replaced: the launch plans that viewed the old ones are dropped (they would keep
        freed buffers alive and point the next launch at them)."""
        self._plans.clear()

    def local_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._local.values())

    def _may_grow(self, what: str) -> None:
        """Before a buffer is made or grown: not inside a capture (``capture_refusal``), and not once a CUDA graph
        holds calls on this workspace -- the graph keeps using the old buffers, which growing would free (and
        its epochs would restart under the graph)."""
        capture_refusal(what)
        if self._captured:
            raise KosmosError(f"a KOSMOS workspace cannot grow once CUDA graphs have captured calls on it ({what}): "
                              f"the graphs keep using its buffers. Make the eager call with the largest shapes "
                              f"before capturing, or call kosmos.reset_workspaces() (which invalidates those "
                              f"graphs) and capture again")

    def _symmetric(self, numel: int, dtype, role: str):
        if self.world.size == 1:
            t = torch.empty(numel, dtype=dtype, device=self.world.device)
            return t, [t.data_ptr()]
        if uses_ipc(self.world):
            return self._ipc_symmetric(numel, dtype, role)
        import torch.distributed._symmetric_memory as symm_mem
        t = symm_mem.empty(numel, dtype=dtype, device=self.world.device)
        handle = symm_mem.rendezvous(t, group=self.world.group)
        self._handles.append(handle)
        return t, list(handle.buffer_ptrs)

    def _ipc_symmetric(self, numel: int, dtype, role: str):
        """The symmetric buffer ``role`` ("data", "signals", "counters") over a group that is not NCCL's, on
        CUDA: every rank's process on one GPU over gloo (launcher.spawn_one_gpu; tests, ``kosmos bench`` with
        KOSMOS_RANKS_ON_ONE_GPU=1). Torch symmetric memory needs an NCCL group of one GPU per rank, so each rank
        allocates a plain buffer, exports it with torch's CUDA-IPC reduction (``reduce_tensor``: the caching
        allocator block's IPC handle and the offset), the handles go round with one ``all_gather_object``, and
        each rank maps its peers' buffers (``rebuild``); the pointer table then holds every rank's buffer as
        mapped in this process, and the kernels reach them with the same peer loads, stores and sys-scope
        atomics as over NVLink. A correctness mode: the ranks' kernels time-slice the GPU (no two contexts run
        at once without MPS), so a wait on a peer spins until the peer's context gets the GPU -- bounded by the
        timeout like any wait -- and timings mean nothing. Memory: this rank's buffer lives in the workspace;
        the peers' mappings of the previous buffer of the same role are dropped when it is replaced (growth
        synchronises and barriers first, so no kernel still uses them)."""
        from torch.multiprocessing.reductions import reduce_tensor
        t = torch.empty(numel, dtype=dtype, device=self.world.device)
        got = [None] * self.world.size
        dist.all_gather_object(got, reduce_tensor(t), group=self.world.group)
        ptrs, peers = [], []
        for r, (rebuild, args) in enumerate(got):
            if r == self.world.rank:  # never map one's own buffer (CUDA IPC refuses it within a process)
                ptrs.append(t.data_ptr())
                continue
            peer = rebuild(*args)
            peers.append(peer)
            ptrs.append(peer.data_ptr())
        self._ipc[role] = (t, peers)
        return t, ptrs

    def before_launch(self) -> None:
        """Every op calls this right before its launch: raise a timeout an earlier launch recorded (a look at the
        mirror's flag word, never a wait), and note whether this call is being captured into a CUDA graph. The
        epoch is not the host's business: the launch reads and advances the device slot itself."""
        self._capturing = capturing()
        if self.poisoned:
            raise KosmosTimeoutError(self.poisoned + " (workspace poisoned; call kosmos.reset_workspaces())")
        if not self._capturing and self._recorded():
            self._raise_recorded()

    def after_launch(self) -> None:
        """After the launch: a captured one means a graph now holds this workspace's buffers (they may no longer
        grow). Nothing is recorded: the next call reads the mirror (module docstring)."""
        if self._capturing:
            self._captured = True

    def _recorded(self) -> bool:
        """Whether a launch has set the mirror's flag word (a host load from pinned memory, no CUDA call)."""
        h = self._err_host
        return h is not None and ctypes.c_int64.from_address(h.data_ptr()).value != 0

    def _raise_recorded(self) -> None:
        """The flag word is set: wait for the device (the rest of the record lands before the launch ends),
        poison the workspace and raise its timeout."""
        if torch.cuda.is_available() and self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        self.poisoned = decode_error(self._err_host.tolist())
        raise KosmosTimeoutError(self.poisoned)

    def device_epoch(self) -> int:
        """The device epoch (calls completed on this workspace since it was made or last grew): a
        device-to-host copy, so a synchronisation -- for tests and error reports, never on the hot path."""
        return 0 if self.epoch_slot is None else int(self.epoch_slot.item())

    def check_errors(self, block: bool = True) -> None:
        """Raise the timeout of any launch on this workspace made before this call; ``block``: synchronise the
        device first, so every such launch is accounted for (else only what has landed). Inside a capture
        nothing can be waited for: replays are checked after it."""
        if self.poisoned:
            raise KosmosTimeoutError(self.poisoned + " (workspace poisoned; call kosmos.reset_workspaces())")
        if self._err_host is None or capturing():
            return
        if block and torch.cuda.is_available() and self.world.device.type == "cuda":
            torch.cuda.synchronize(self.world.device)
        if self._recorded():
            self._raise_recorded()

    def timeout_ns(self) -> int:
        return int(self.timeout_s * 1e9)


_WORKSPACES: dict = {}
_BY_CALL: dict = {}  # (group as passed, device as passed, dist initialised) -> workspace: get_workspace's hit path


def uses_ipc(world: World) -> bool:
    """Whether ``world``'s symmetric buffers are CUDA-IPC mappings (a group other than NCCL's on CUDA: ranks
    sharing one GPU over gloo) rather than torch symmetric memory."""
    return world.size > 1 and world.device.type == "cuda" and dist.get_backend(world.group) != "nccl"


def gloo_group(group) -> bool:
    """Whether ``group`` is a gloo process group (ranks sharing one GPU, or CPU ranks)."""
    return dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "gloo"


def host_staged(group, t: torch.Tensor) -> bool:
    """Whether a collective of ``t`` over ``group`` goes through host copies: a CUDA tensor over gloo (ranks
    sharing one GPU; not every collective has a CUDA form in gloo -- the tensor forms of all-gather and
    reduce-scatter were not checked on a GPU, so they go through the host there). Correctness runs only."""
    return t.is_cuda and gloo_group(group)


def all_gather_into(out: torch.Tensor, x: torch.Tensor, group) -> torch.Tensor:
    """``dist.all_gather_into_tensor(out, x)``, through host copies where ``host_staged``; returns ``out``."""
    if host_staged(group, x):
        host = torch.empty(out.shape, dtype=out.dtype)
        dist.all_gather_into_tensor(host, x.cpu().contiguous(), group=group)
        return out.copy_(host)
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


_CUDA = {}  # "available": torch.cuda.is_available(), asked once (it goes through NVML / device_count each time)


def cuda_available() -> bool:
    """torch.cuda.is_available(), cached for the process (the ops' hit path asks it on every call)."""
    got = _CUDA.get("available")
    if got is None:
        got = _CUDA["available"] = torch.cuda.is_available()
    return got


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph."""
    return cuda_available() and torch.cuda.is_current_stream_capturing()


def capture_refusal(what: str) -> None:
    """Raise a one-line KosmosError if the current stream is capturing a CUDA graph: a call of an op that
    still has to do ``what`` (allocate, build tables, synchronise, talk to peers) cannot be captured. Only
    the slow paths call it (a first call of a shape), so the steady state pays nothing."""
    if capturing():
        raise KosmosError(f"a KOSMOS op cannot be captured in a CUDA graph here: {what}, which a capture "
                          f"cannot do -- run one eager call with the same shapes (and config, group) first")


def get_workspace(group=None, device=None) -> Workspace:
    """The workspace of ``group`` on ``device``, created on first use (nothing is allocated until an op
    calls ``ensure``); every op takes it before it launches."""
    if device is not None:  # the ops' hit path: one dict lookup instead of World.of's process-group queries
        fast_key = (group, device, dist.is_available() and dist.is_initialized())
        ws = _BY_CALL.get(fast_key)
        if ws is not None:
            return ws
    world = World.of(group, device)
    key = (id(world.group), world.device.index)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = Workspace(world)
        _WORKSPACES[key] = ws
    if device is not None:
        _BY_CALL[fast_key] = ws
    return ws


def check_errors(group=None) -> None:
    """Wait for the last KOSMOS launch on ``group`` (after CUDA-graph replays: for the whole device) and raise
    if any bounded wait timed out."""
    for ws in list(_WORKSPACES.values()):
        if group is None or ws.world.group is group:
            ws.check_errors(block=True)


def set_timeout(seconds: float, group=None, device=None) -> None:
    """Bound every in-kernel wait of ``group``'s workspace on ``device`` (default: the current CUDA device)
    to ``seconds`` (default KOSMOS_TIMEOUT_S or 5 s)."""
    if not 0 < seconds <= 2000:
        raise ValueError(f"timeout must be positive and at most 2000 s, got {seconds}")
    if device is None and not torch.cuda.is_available():  # else torch's bare AssertionError (current_device)
        raise KosmosError("kosmos.set_timeout: no CUDA device is available (the timeout belongs to a GPU's "
                          "workspace; torch sees no GPU here)")
    get_workspace(group, torch.device(device) if device is not None else None).timeout_s = float(seconds)


def reset_workspaces() -> None:
    """Drop every workspace (after a timeout). Collective: all ranks must call it."""
    _WORKSPACES.clear()
    _BY_CALL.clear()


def workspace_bytes(group=None) -> int:
    """Bytes of this rank's symmetric workspace (data + signals + counters); the ops' local buffers, which the
    caching allocator counts, are ``get_workspace(group).local_bytes()``."""
    ws = get_workspace(group)
    ctr = 0 if ws.counters is None else 4 * ws.counters.numel()
    return ws.data_bytes + 4 * ws.signal_slots + ctr


def _triton_scratch(size: int, alignment: int, stream):
    """Triton's scratch allocator: torch-backed, on CUDA where available (``cuda_available()``, cached: this runs
    on every launch of a kernel with device-built descriptors)."""
    return torch.empty(size, device="cuda" if cuda_available() else "cpu", dtype=torch.int8)


def ensure_triton_allocator() -> None:
    """Device-side tensor descriptors need scratch memory: give Triton a torch-backed allocator. Triton keeps
    it in a context variable, which a new thread does not inherit (autograd runs backward on its own
    thread), so this is set before every launch: one context-variable write."""
    import triton
    triton.set_allocator(_triton_scratch)
