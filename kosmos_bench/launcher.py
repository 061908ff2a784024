"""Run a function on one process per GPU with an NCCL process group.

Under ``torchrun`` (RANK/WORLD_SIZE/LOCAL_RANK in the environment) the function runs in this process.
Otherwise ``spawn(fn, world, *args)`` starts ``world`` processes (each inheriting this environment, so NCCL /
symmetric-memory settings such as NCCL_NVLS_ENABLE=0 carry over), waits for them with a timeout and raises
if any rank failed, with that rank's traceback.

Ranks on one GPU (``spawn_one_gpu``, or ``spawn`` with KOSMOS_RANKS_ON_ONE_GPU=1 in the environment, which is how
``kosmos bench`` gets it): every rank's process on cuda:0 with a gloo process group (NCCL refuses two ranks on one
GPU). For correctness runs of process-based baselines (DeepEP's intranode Buffer: two processes on one GPU, the
IPC handles exchanged over gloo) and of KOSMOS's own W > 1 ops (their symmetric buffers mapped by CUDA IPC:
runtime.Workspace._ipc_symmetric); the ranks share the GPU, so their times are no measurement. Their kernels take
turns on the GPU (the driver time-slices the processes' contexts), so a wait for a peer lasts time slices, not
microseconds: unless KOSMOS_TIMEOUT_S is set, the ranks get a bound of ONE_GPU_TIMEOUT_S seconds on every
in-kernel wait instead of the default 5 s (seen on one H100: with six more test processes on the GPU,
the MoE backward's one launch at EP = 2 timed out at 5 s with 29 of 64 rows arrived).
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


ONE_GPU_ENV = "KOSMOS_RANKS_ON_ONE_GPU"
ONE_GPU_TIMEOUT_S = 60.0  # the in-kernel wait bound of ranks that share one GPU (module docstring)


def ranks_on_one_gpu() -> bool:
    """Whether KOSMOS_RANKS_ON_ONE_GPU asks for every rank on cuda:0 over gloo (module docstring)."""
    return os.environ.get(ONE_GPU_ENV, "0").strip() not in ("", "0")


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_world(world: int | None) -> int:
    """The world size of a real run: ``world`` ranks (default: one per visible GPU). LaunchError (one line) without
    a GPU, below 1 rank, or with more ranks than GPUs unless KOSMOS_RANKS_ON_ONE_GPU=1."""
    n = visible_gpus()
    if n == 0:
        raise LaunchError("no CUDA GPU is visible: KOSMOS benchmarks need NVIDIA GPUs (Hopper: H100/H200); "
                          "--dry-run shows the plan without one")
    world = n if world is None else world
    if world < 1:
        raise LaunchError(f"world size must be >= 1, got {world}")
    if world > n and not ranks_on_one_gpu():
        raise LaunchError(f"asked for {world} GPUs but only {n} are visible (CUDA_VISIBLE_DEVICES?; or "
                          f"{ONE_GPU_ENV}=1: every rank on cuda:0 over gloo, a correctness run, not a timing)")
    return world


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_rank(rank: int, world: int, one_gpu: bool = False) -> None:
    """This process's GPU and process group: cuda:rank and NCCL; ``one_gpu``: cuda:0 and gloo."""
    torch.cuda.set_device(0 if one_gpu else rank)
    if world > 1 and not dist.is_initialized():
        if one_gpu:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        else:
            dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))


def _worker(rank, world, port, fn, args, errq, one_gpu=False):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    if one_gpu:  # so that code reading the environment (a nested spawn, bench_rank's row extra) sees it too
        os.environ[ONE_GPU_ENV] = "1"
    try:
        init_rank(rank, world, one_gpu)
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


def spawn(fn, world: int, *args, timeout_s: float = 3600.0, one_gpu: bool | None = None) -> None:
    """Run ``fn(rank, world, *args)`` on ``world`` GPUs; ``one_gpu`` (default: KOSMOS_RANKS_ON_ONE_GPU): every rank
    on cuda:0 over gloo (module docstring)."""
    one_gpu = ranks_on_one_gpu() if one_gpu is None else one_gpu
    if under_torchrun():
        rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
        init_rank(rank, world, one_gpu)
        fn(rank, world, *args)
        return
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, errq, one_gpu)) for r in range(world)]
    # the children read KOSMOS_TIMEOUT_S when they import kosmos, before _worker runs: set it in the environment
    # they inherit, for the time of their start
    bound = one_gpu and "KOSMOS_TIMEOUT_S" not in os.environ
    if bound:
        os.environ["KOSMOS_TIMEOUT_S"] = str(ONE_GPU_TIMEOUT_S)
    try:
        for p in procs:
            p.start()
    finally:
        if bound:
            del os.environ["KOSMOS_TIMEOUT_S"]
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


def spawn_one_gpu(fn, world: int, *args, timeout_s: float = 3600.0) -> None:
    """``spawn`` with every rank's process on cuda:0 and a gloo process group (module docstring)."""
    spawn(fn, world, *args, timeout_s=timeout_s, one_gpu=True)
