"""Device-side primitives shared by every KOSMOS kernel: everything a kernel needs to talk to other ranks, and to
other programs of its launch, lives here. The why and the parked alternatives: docs/design/core.md.

* ``peer_ptr`` / ``peer_region`` -- a rank index (and a byte offset) -> that rank's symmetric buffer, through the
  workspace's int64 pointer table; the rank may be a tensor (one peer per row).
* ``notify`` -- publish a flag value (the call's epoch) to a local or remote signal slot: a CTA barrier, then
  ``atomic_xchg(sem="release", scope="sys")``, so every store the whole program made before it is visible to
  whoever acquires the flag.
* ``load_uniform`` -- read shared state so that all threads of a program agree (one broadcast atomic); every
  branch on a flag, counter or queue head uses it.
* ``wait_geq(flag, target, timeout_ns, err, OP, WAIT, rank, task, index)`` -- a bounded spin until ``*flag >=
  target``: each thread polls with volatile loads, one uniform read decides for the program, then the acquire
  (``fence.acq_rel.sys`` and a generic -> async proxy fence: the guarded data is read next by TMA; GPU_ONLY /
  GPU_TMA: the data comes from this GPU's programs, a gpu-scope fence, plus the proxy fence for TMA). It returns
  1, or 0 on timeout or abort, and never hangs: the first program to time out records (op | wait tag, rank, task,
  index, expected, observed, elapsed) through the ``noinline`` recorder, which also writes the host-mapped mirror
  (flag word last), and raises the abort flag; every other wait of the launch then gives up at once.
* ``reached`` -- the same decision without the spin (the fence only if satisfied): a program skips its later waits
  on a stage once it has seen the whole stage done. ``aborted`` -- whether some program of the launch timed out
  (the MoE loop checks it between tasks and drains).
* ``call_epoch`` / ``exit_program`` / ``exit_program_zeroing`` -- the device epoch: every program reads
  ``slot + 1`` once at its start; the last program out zeroes the queue heads (or the op's whole scratch),
  publishes done = epoch to every peer (W > 1 only) and stores the slot (``_advance_epoch``: why no program of the
  launch can read the new value). ``wait_peers_done`` -- a call's first write into shared buffers waits for every
  peer's done >= epoch - 1 (W > 1 only).
* ``soft_barrier`` -- a performance rendezvous, not a synchronisation (no error, no ordering, ``max_ns`` at most).
* ``trace`` -- one (kind, task, t_start, t_end) event for the timeline; compiled out when off. ``now_ns`` the global
  timer; ``program_id_fresh`` the program id re-read where it is used (not kept live in a register).
Queue claims and the role decision are the scheduling policy's: schedule.py.

Under ``TRITON_INTERPRET=1`` (CPU tests) inline PTX cannot run: the timer becomes a spin counter (1 spin counts as
1 us) and the fences become a relaxed no-op / an acquire atomic; ordering does not matter there because the
interpreter runs programs one after another. Tests: every op's timeout, stalled-peer and handshake tests (the
record and its words: tests/test_runtime.py), the device-epoch tests of test_all_gather_matmul.py and
test_moe_forward.py, tests/test_cuda_graphs.py.
"""
import os

import triton
import triton.language as tl

INTERPRET = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")

# the error record's layout, wait tags, op codes and trace kinds are named in codes.py (host and device)
from .codes import (ERR_COUNTER, ERR_ELAPSED, ERR_EXPECTED, ERR_FLAG, ERR_MIRROR, ERR_OBSERVED, ERR_OP,  # noqa: E402
                    ERR_RANK, ERR_TASK, TRACE_EVENTS, WAIT_PEERS_DONE, WAIT_SHIFT)


@triton.jit
def program_id_fresh():
    """tl.program_id(0), read again where it is used (%ctaid.x through inline PTX, which is not merged with the
    kernel's own pid), so that a value derived from it (a role predicate, say) need not stay live in a register
    through a register-bound launch; tl.program_id(0) under the interpreter."""
    if INTERPRET:
        return tl.program_id(0)
    else:
        return tl.inline_asm_elementwise("mov.u32 $0, %ctaid.x;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def now_ns():
    """GPU global timer in ns (0 under the interpreter)."""
    if INTERPRET:
        return tl.full([], 0, tl.int64)
    else:
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                         pack=1)


@triton.jit
def soft_barrier(counter_ptr, target, max_ns):
    """A performance rendezvous, not a synchronisation: spin (volatile loads) until ``*counter_ptr >= target`` or
    ``max_ns`` have passed, whichever comes first; no error, no memory ordering. For programs that gain from
    starting a phase together (e.g. sharing its operands in L2) and whose correctness does not depend on it: a
    program that never arrives (not resident, timed out) costs the others ``max_ns`` at most. Returns at once
    under the interpreter (programs run one after another there)."""
    if not INTERPRET:
        t0 = now_ns()
        seen = tl.load(counter_ptr, volatile=True)
        while (seen < target) & (now_ns() - t0 <= max_ns):
            seen = tl.load(counter_ptr, volatile=True)


@triton.jit
def _acquire_fence(flag_ptr, GPU_ONLY: tl.constexpr = False, GPU_TMA: tl.constexpr = False):
    if INTERPRET:
        tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    elif GPU_ONLY:  # data from programs of this GPU, read by plain (not TMA) loads: no system scope, no proxy fence
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r", [], dtype=tl.int32, is_pure=False,
                                  pack=1)
    elif GPU_TMA:  # data from programs of this GPU, read next by TMA: gpu scope, then the generic -> async proxy fence
        tl.inline_asm_elementwise("fence.acq_rel.gpu; fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)
    else:
        # acquire for the generic proxy, then make the acquired data visible to TMA (async proxy) loads.
        tl.inline_asm_elementwise("fence.acq_rel.sys; fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def peer_ptr(table_ptr, rank, DTYPE: tl.constexpr):
    """Base pointer of ``rank``'s symmetric buffer, typed as DTYPE (table holds int64 addresses)."""
    addr = tl.load(table_ptr + rank)
    return addr.to(tl.pointer_type(DTYPE), bitcast=True)


@triton.jit
def peer_region(table_ptr, rank, byte_offset, DTYPE: tl.constexpr):
    """Pointer to ``byte_offset`` inside ``rank``'s symmetric buffer, typed as DTYPE. ``rank`` may be a tensor
    (one peer per row, e.g. the combine epilogue scattering rows back to their tokens' ranks)."""
    addr = tl.load(table_ptr + rank) + byte_offset
    return addr.to(tl.pointer_type(DTYPE), bitcast=True)


@triton.jit
def notify(flag_ptr, value):
    """Release-publish ``value`` at ``flag_ptr`` (local or peer memory) after all prior stores of the program."""
    tl.debug_barrier()
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def load_uniform(ptr):
    """Read a flag/counter so that every thread of the program gets the same value (one atomic, whose
    result Triton broadcasts). Every *decision* taken on shared state must use this: a plain volatile load
    is executed by each thread separately, threads may see different values, branch apart, and then meet
    different barriers -- a hang (docs/design/core.md, parked alternatives)."""
    return tl.atomic_add(ptr, tl.zeros([], ptr.dtype.element_ty), sem="relaxed", scope="sys")


@triton.jit
def aborted(err_ptr):
    return load_uniform(err_ptr + ERR_FLAG) != 0


@triton.jit
def wait_geq(flag_ptr, target, timeout_ns, err_ptr, OP: tl.constexpr, WAIT: tl.constexpr, rank, task, index,
             GPU_ONLY: tl.constexpr = False, GPU_TMA: tl.constexpr = False):
    """Spin until ``*flag_ptr >= target`` (bounded). Returns 1 if satisfied, 0 on timeout/abort. OP and WAIT
    (codes.OP_*, codes.WAIT_*) and ``index`` say in the error record what was awaited. GPU_ONLY: the awaited
    data comes from this GPU's programs and is read by plain loads (a gpu-scope acquire suffices). GPU_TMA: it
    comes from this GPU's programs and is read by TMA (a gpu-scope acquire and the proxy fence).

    Each thread polls with volatile loads (cheap; no barrier inside the loop, so threads may leave it at
    different times), then one uniform read decides for the whole program."""
    v = load_uniform(flag_ptr)
    ok = 1
    if v < target:
        t0 = now_ns()
        spins = 0
        seen = tl.load(flag_ptr, volatile=True)
        elapsed = tl.zeros([], tl.int64)
        while (seen < target) & (elapsed <= timeout_ns):
            seen = tl.load(flag_ptr, volatile=True)
            spins += 1
            if INTERPRET:
                elapsed = tl.cast(spins, tl.int64) * 1000
            else:
                elapsed = now_ns() - t0
            if tl.load(err_ptr + ERR_FLAG, volatile=True) != 0:  # someone else timed out: drain
                elapsed = tl.cast(timeout_ns, tl.int64) + 1
        v = load_uniform(flag_ptr)
        if v < target:
            ok = 0
            # first program to time out records the details; the others just drain.
            if tl.atomic_cas(err_ptr + ERR_FLAG, tl.cast(0, tl.int64), tl.cast(1, tl.int64), sem="relaxed",
                             scope="gpu") == 0:
                _record_error(err_ptr, OP, WAIT, rank, task, index, target, v, now_ns() - t0)
    _acquire_fence(flag_ptr, GPU_ONLY, GPU_TMA)
    return ok


@triton.jit
def reached(flag_ptr, target, GPU_ONLY: tl.constexpr = False, GPU_TMA: tl.constexpr = False):
    """Whether ``*flag_ptr >= target`` now (one uniform read, no spin); if so, the acquire fence wait_geq issues,
    so the data the flag guards may be read next. A readiness check for a program that can skip its waits once
    a whole stage is known complete."""
    ok = load_uniform(flag_ptr) >= target
    if ok:
        _acquire_fence(flag_ptr, GPU_ONLY, GPU_TMA)
    return ok


@triton.jit
def _store_record(ptr, OP: tl.constexpr, WAIT: tl.constexpr, rank, task, index, target, observed, elapsed):
    tl.store(ptr + ERR_OP, OP | (WAIT << WAIT_SHIFT))  # one constant: the tag costs no store of its own
    tl.store(ptr + ERR_RANK, tl.cast(rank, tl.int64))
    tl.store(ptr + ERR_TASK, tl.cast(task, tl.int64))
    tl.store(ptr + ERR_COUNTER, tl.cast(index, tl.int64))
    tl.store(ptr + ERR_EXPECTED, tl.cast(target, tl.int64))
    tl.store(ptr + ERR_OBSERVED, tl.cast(observed, tl.int64))
    tl.store(ptr + ERR_ELAPSED, elapsed)


# The cold path as a call: inlined at every wait it costs the register-bound kernels spills (docs/design/core.md).
@triton.jit(noinline=True)
def _record_error(err_ptr, OP: tl.constexpr, WAIT: tl.constexpr, rank, task, index, target, observed, elapsed):
    """Fill slots 1..ERR_ELAPSED of the record (the caller has set the flag) and write the whole record to the
    host-mapped mirror whose address is slot 8, if any: the host reads the mirror once the launch has ended,
    so a healthy call moves nothing and no program has to look at the record on its way out."""
    _store_record(err_ptr, OP, WAIT, rank, task, index, target, observed, elapsed)
    addr = tl.load(err_ptr + ERR_MIRROR)
    if addr != 0:
        mirror = addr.to(tl.pointer_type(tl.int64), bitcast=True)
        _store_record(mirror, OP, WAIT, rank, task, index, target, observed, elapsed)
        tl.store(mirror + ERR_FLAG, tl.cast(1, tl.int64))


@triton.jit
def call_epoch(epoch_ptr):
    """This launch's epoch: ``*epoch_ptr + 1`` (the slot holds the last completed call's epoch). One uniform
    read per program, at its start, kept in a register for the whole launch; ``exit_program`` of the last
    program out stores the new value (why no program can read the bumped value: there)."""
    return load_uniform(epoch_ptr) + 1


@triton.jit
def _signal_done(peer_sig_table, DONE_BASE: tl.constexpr, rank, WORLD: tl.constexpr, epoch):
    """done[rank] = epoch on every rank. At W = 1 nobody reads it (``wait_peers_done`` returns at once), so its
    system-scope releases are skipped."""
    if WORLD > 1:
        for p in tl.static_range(WORLD):
            sig = peer_ptr(peer_sig_table, p, tl.int32)
            tl.atomic_xchg(sig + DONE_BASE + rank, epoch, sem="release", scope="sys")


# Advancing the device epoch (``_advance_epoch``, run by the last program out of a launch).
# Every program reads the slot once, in ``call_epoch`` at its start: one thread's atomic, broadcast to the
# others through shared memory behind a CTA barrier, so the read precedes, in that program, everything after
# it -- in particular its exit ``atomic_add`` on the exit counter (acq_rel). The last program out is the one
# whose exit atomic returned GRID - 1: every other program's exit atomic came before it in the counter's
# modification order, and acquiring it makes each of those programs' earlier actions -- their slot reads among
# them -- happen before the last program's store to the slot. A read that happens before a write cannot see it
# (read-write coherence), so every program of the launch saw the same, old value; and the launch cannot have a
# program still to start, since all GRID have already counted themselves out. The next launch on the stream
# (or the next replay) starts after this one has ended and reads the new value. Launches that are not the
# last of their call -- the CPU tests' phase launches: the MoE layer's with FINAL off, the TP ops' with
# ADVANCE off -- do not advance it.
@triton.jit
def _advance_epoch(epoch_ptr, epoch):
    tl.store(epoch_ptr, epoch)


@triton.jit
def exit_program(heads_ptr, EXIT_SLOT: tl.constexpr, NUM_HEADS: tl.constexpr, GRID: tl.constexpr,
                 peer_sig_table, DONE_BASE: tl.constexpr, rank, WORLD: tl.constexpr, epoch, epoch_ptr,
                 ADVANCE: tl.constexpr):
    """Last program out resets the queue heads (so the next launch starts at 0 without a reset kernel), tells
    every peer that this rank is done with the call's buffers (flag DONE_BASE + rank = epoch) and, with
    ADVANCE (always, but in the CPU tests' launches that are a first part of one call), advances the device
    epoch (slot = epoch: the next launch runs at epoch + 1; see the comment above)."""
    n_out = tl.atomic_add(heads_ptr + EXIT_SLOT, 1, sem="acq_rel", scope="gpu")
    if n_out == GRID - 1:
        for h in tl.static_range(NUM_HEADS):
            tl.store(heads_ptr + h, 0)
        _signal_done(peer_sig_table, DONE_BASE, rank, WORLD, epoch)
        if ADVANCE:
            _advance_epoch(epoch_ptr, epoch)


@triton.jit
def exit_program_zeroing(scratch_ptr, n_zero, EXIT_SLOT: tl.constexpr, GRID: tl.constexpr, peer_sig_table,
                         DONE_BASE: tl.constexpr, rank, WORLD: tl.constexpr, epoch, epoch_ptr, BLOCK: tl.constexpr):
    """``exit_program`` for kernels whose local scratch (heads, exit counter, readiness counters) is one int32
    array: the last program out zeroes its first ``n_zero`` entries, signals done to every peer and advances
    the device epoch."""
    n_out = tl.atomic_add(scratch_ptr + EXIT_SLOT, 1, sem="acq_rel", scope="gpu")
    if n_out == GRID - 1:
        offs = tl.arange(0, BLOCK)
        for start in range(0, n_zero, BLOCK):
            tl.store(scratch_ptr + start + offs, tl.zeros([BLOCK], tl.int32), mask=start + offs < n_zero)
        tl.debug_barrier()
        _signal_done(peer_sig_table, DONE_BASE, rank, WORLD, epoch)
        _advance_epoch(epoch_ptr, epoch)


@triton.jit
def wait_peers_done(sig_ptr, DONE_BASE: tl.constexpr, WORLD: tl.constexpr, epoch, timeout_ns, err_ptr,
                    OP: tl.constexpr, rank):
    """Wait until every peer finished the previous call (its reads of / writes into our shared buffers). At
    W = 1 there is no peer: this rank's own previous launch ended before this one started (stream order)."""
    ok = 1
    if WORLD > 1:
        for p in tl.static_range(WORLD):
            ok = ok & wait_geq(sig_ptr + DONE_BASE + p, epoch - 1, timeout_ns, err_ptr, OP, WAIT_PEERS_DONE, rank,
                               -1, p)
    return ok


@triton.jit
def trace(trace_ptr, pid, n_events, kind, task, t0, t1, TRACE: tl.constexpr):
    """Append one event (kind: codes.EV_*) to this program's row of the trace buffer [grid, TRACE_EVENTS, 4];
    returns the new event count."""
    if TRACE:
        if n_events < TRACE_EVENTS:
            base = trace_ptr + (pid * TRACE_EVENTS + n_events) * 4
            tl.store(base + 0, tl.cast(kind, tl.int64))
            tl.store(base + 1, tl.cast(task, tl.int64))
            tl.store(base + 2, t0)
            tl.store(base + 3, t1)
        n_events += 1
    return n_events
