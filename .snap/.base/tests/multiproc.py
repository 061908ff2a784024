"""Helpers for tests that run one process per rank (imported by the test modules; not a test module).

``spawn_gloo`` -- CPU ranks over gloo: ``target(rank, world, port, q, *args)`` puts (rank, result) on ``q``;
returns {rank: result}. ``Checks`` + ``spawn_gpu`` -- GPU ranks (kosmos_bench.launcher.spawn, NCCL): a rank
records failed checks and keeps going, so that all ranks make the same collective calls, then writes them to
``<tmp>/rank<r>.txt`` and raises (spawn turns that into a LaunchError carrying the rank's traceback).
``stall_peer`` -- the stalled-peer scenario every fused op's GPU tests run.
"""
import os
import socket
from pathlib import Path

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def finish_gloo():
    """The end of a gloo rank (the last statement of every rank function; its results are already on the queue):
    a barrier, so that no rank leaves while a peer still talks to it, then the process ends at once with
    os._exit -- 0 after the barrier, 1 if the barrier failed. Why not destroy_process_group and a normal exit:
    gloo's teardown aborted a rank ("terminate called without an active exception", exit -6) in CI twice, first
    with no barrier (the peer had gone), then (session 14, test_async_tp_functions_over_gloo_with_torch_fallbacks)
    with the barrier and destroy_process_group, after both ranks had put their results. A SimpleQueue's put has
    written its bytes before it returns, so nothing is lost by skipping the interpreter's shutdown."""
    import sys

    import torch.distributed as dist
    code = 1
    try:
        dist.barrier()
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def spawn_gloo(target, world, *args, timeout_s=180):
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, q, *args)) for r in range(world)]
    for p in procs:
        p.start()
    # read the results while the ranks run: a result larger than the pipe's buffer blocks its sender's put
    # until it is read (joining first would then wait for ever)
    import time
    results, deadline = {}, time.monotonic() + timeout_s
    while len(results) < world and time.monotonic() < deadline:
        if not q.empty():
            rank, value = q.get()
            results[rank] = value
        elif not any(p.is_alive() for p in procs) and q.empty():
            break
        else:
            time.sleep(0.05)
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert len(results) == world, sorted(results)
    return results


class Checks:
    def __init__(self, rank=0):
        self.rank, self.failures = rank, []

    def __call__(self, ok, what):
        if not ok:
            self.failures.append(str(what))

    def finish(self, out_dir=None):
        if out_dir:
            Path(out_dir, f"rank{self.rank}.txt").write_text("\n".join(self.failures))
        if self.failures:
            raise AssertionError(f"rank {self.rank}: {len(self.failures)} failed check(s):\n"
                                 + "\n".join(self.failures[:20]))


def spawn_gpu(fn, tmp_path, world=2, timeout_s=300.0):
    from kosmos_bench.launcher import spawn
    spawn(fn, world, str(tmp_path), timeout_s=timeout_s)
    for r in range(world):
        f = Path(tmp_path) / f"rank{r}.txt"
        assert f.exists(), f"rank {r} did not finish"
        assert f.read_text() == "", f.read_text()


def stall_peer(rank, call, op, check, on_timeout=None):
    """Warm ``call`` up (compile, workspace), then run it with a 0.5 s timeout while rank 1's GPU spins ~1.5 s
    first: rank 0 must raise KosmosTimeoutError naming ``op`` and rank 0 (then ``on_timeout()`` runs there,
    on the poisoned workspace); the stalled rank may or may not time out in turn. Ends with the ranks
    realigned and fresh workspaces."""
    import torch
    import torch.distributed as dist

    import kosmos
    call()
    kosmos.check_errors()
    torch.cuda.synchronize()
    dist.barrier()
    kosmos.set_timeout(0.5)
    if rank == 1:
        torch.cuda._sleep(int(3e9))  # ~1.5 s of GPU time before this rank's kernel starts
    call()
    if rank == 0:
        try:
            kosmos.check_errors()
            check(False, "rank 0: check_errors() did not raise after the peer stalled")
        except kosmos.KosmosTimeoutError as e:
            check(op in str(e) and "rank 0" in str(e), f"unexpected timeout message: {e}")
        if on_timeout is not None:
            on_timeout()
    else:
        try:
            kosmos.check_errors()
        except kosmos.KosmosTimeoutError:
            pass
    torch.cuda.synchronize()
    dist.barrier()
    kosmos.reset_workspaces()
