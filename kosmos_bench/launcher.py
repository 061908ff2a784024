"""Run a function on one process per GPU with an NCCL process group.

Under ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK in the environment) the function runs in this process.
Otherwise ``spawn(fn, world, *args)`` starts ``world`` processes (each inheriting this environment, so NCCL /
symmetric-memory settings such as NCCL_NVLS_ENABLE=0 carry over), waits for them with a timeout and raises
if any rank failed, with that rank's traceback.
"""
from __future__ import annotations

import os
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class LaunchError(RuntimeError):
    pass


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_world(world: int | None) -> int:
    n = visible_gpus()
    if n == 0:
        raise LaunchError("no CUDA GPU is visible: KOSMOS benchmarks need NVIDIA GPUs (Hopper: H100/H200)")
    world = n if world is None else world
    if world < 1:
        raise LaunchError(f"world size must be >= 1, got {world}")
    if world > n:
        raise LaunchError(f"asked for {world} GPUs but only {n} are visible (CUDA_VISIBLE_DEVICES?)")
    return world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int) -> None:
    torch.cuda.set_device(rank)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))


def _worker(rank, world, port, fn, args, errq):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    try:
        init_rank(rank, world)
        fn(rank, world, *args)
    except BaseException:  # report every failure to the parent, including KeyboardInterrupt
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def spawn(fn, world: int, *args, timeout_s: float = 3600.0) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` GPUs."""
    if under_torchrun():
        rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
        init_rank(rank, world)
        fn(rank, world, *args)
        return
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, errq)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    errors = []
    # Poll: stop as soon as every rank is done, or a rank reported a failure (its peers are then usually
    # stuck in a collective: give them a few seconds to report their own error, then stop them).
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        while not errq.empty():
            errors.append(errq.get())
        if errors:
            grace = time.monotonic() + 5.0
            while any(p.is_alive() for p in procs) and time.monotonic() < grace:
                time.sleep(0.1)
            break
        time.sleep(0.05)
    alive = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in alive:
        procs[r].terminate()
    for r in alive:
        procs[r].join(10)
    while not errq.empty():
        errors.append(errq.get())
    if errors:
        rank, tb = sorted(errors)[0]
        raise LaunchError(f"rank {rank} failed:\n{tb}")
    if alive and time.monotonic() >= deadline:
        raise LaunchError(f"rank(s) {alive} still running after {timeout_s:.0f} s; terminated")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode != 0]
    if bad:
        raise LaunchError(f"rank(s) exited abnormally: {bad}")
