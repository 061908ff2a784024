"""The self-scheduling policy, in one place (device side; every fused kernel's persistent loop uses it).

A fused op is one persistent launch of GRID programs (at most one per SM, so all are co-resident). Its tasks sit
in an ordered list of queues, the op's *stages*: task tables laid out by the host planner in consumer-demand
order (planning.py) or, for the MoE layer, counts known only on the device. Each stage has one atomic head in
local scratch; claiming is ``atomic_add(head, 1)``, and a claim past the stage's end means "stage exhausted".

Every program runs the same loop::

    stages = program_stages(pid, POLICY, comm_programs, ALL_STAGES, COMM_STAGES)   # the role decision
    stage = next_stage(stages, -1, NUM_STAGES)
    while stage < NUM_STAGES:
        t = claim(heads + stage)
        if t >= n_tasks(stage):
            stage = next_stage(stages, stage, NUM_STAGES)     # drained: move on
        else:
            run task t (waiting, bounded, for its inputs when it has remote ones)

(The MoE kernel steps one stage at a time with ``has_stage`` instead of ``next_stage``: the same order, and
fewer spills in that register-bound kernel.)

* **Stage order is the policy.** A program takes from the first stage of its mask that is not drained. The ops
  list their stages so that this order is the order of demand: AllGather+GEMM pushes first (peers consume
  them), then GEMM tiles, then the own-slot copies that nothing in the launch waits for; the MoE layer
  ROUTE, PERMUTE, GEMM1, GEMM2, FOLD. How many programs communicate at a moment follows from how many
  communication tasks are left: no split parameter.
* **Ready-first for owned tasks.** GEMM+ReduceScatter's reduce tasks are owned (task t by program t % GRID,
  no shared head). Before each claim of an earlier stage a program looks at its own next task of the later
  stage and runs it first if its inputs are all ready (``all_ready``); once the earlier stages are drained it
  runs its remaining owned tasks, waiting. Communication thus runs as soon as its data exists.
* **The fixed-role ablation is a role mask.** ``POLICY_FIXED``: programs ``pid < comm_programs`` take only the
  communication stages, the others only the rest; the loop is the same. (Owned tasks become a shared queue
  for the communication programs, who wait on each in order.)

Deadlock-freedom rests on the stage order: a task waits only for tasks of earlier stages (claimed by running
programs before any program moves past them, or under the fixed policy by the other role, which never waits
on it) or for peers' earlier stages; every wait is bounded (device.wait_geq). A claim is one fetch-add, never a
CAS retry loop (which many contending programs would each lose over and over).

Host side: ``policy_args`` turns (policy, comm_programs) into the kernel's (POLICY, S) (public ops: 1 <= S < grid);
``check_launch`` adds the trace buffer's shape [grid, TRACE_EVENTS, 4]. The why and the parked alternatives:
docs/design/core.md ("The scheduling policy"). Tests: the ops' self / fixed policy tests (tests/opcases.py,
test_moe_forward.py's fixed-role and determinism tests), test_planning.py (the demand order of the tables).
"""
import triton
import triton.language as tl

from . import device as dev
from .codes import TRACE_EVENTS as _TRACE_EVENTS

TRACE_EVENTS = _TRACE_EVENTS.value  # events per program of a trace buffer

POLICY_SELF: tl.constexpr = tl.constexpr(0)
POLICY_FIXED: tl.constexpr = tl.constexpr(1)
POLICIES = {"self": POLICY_SELF.value, "fixed": POLICY_FIXED.value}


@triton.jit
def program_stages(pid, POLICY: tl.constexpr, comm_programs, stages, COMM_STAGES: tl.constexpr):
    """The bitmask of stages program ``pid`` takes from: all of ``stages`` (self), or under the fixed-role
    ablation only the communication stages for ``pid < comm_programs`` and only the others for the rest."""
    if POLICY == POLICY_SELF:
        return stages
    else:
        comm = stages & COMM_STAGES
        return tl.where(pid < comm_programs, comm, stages - comm)


@triton.jit
def next_stage(stages, after, NUM_STAGES: tl.constexpr):
    """The first stage of the mask ``stages`` after stage ``after`` (-1: the first one), or NUM_STAGES when
    none is left (the program is done)."""
    nxt = after * 0 + NUM_STAGES
    for s in tl.static_range(NUM_STAGES - 1, -1, -1):
        nxt = tl.where((s > after) & (((stages >> s) & 1) != 0), s, nxt)
    return nxt


@triton.jit
def has_stage(stages, s):
    return ((stages >> s) & 1) != 0


@triton.jit
def claim(head_ptr):
    """The next task index of a stage's queue (``atomic_add(head, 1)``; past the end = drained)."""
    return tl.atomic_add(head_ptr, 1, sem="relaxed", scope="gpu")


@triton.jit
def all_ready(flag_ptr, stride, target, COUNT: tl.constexpr):
    """Whether the COUNT flags ``flag_ptr[i * stride]`` all hold >= target (uniform reads: every thread of the
    program agrees, so the program may branch on it). A readiness check, not a wait: no fence."""
    ready = 1
    for i in tl.static_range(COUNT):
        v = dev.load_uniform(flag_ptr + i * stride)
        ready = ready & (v >= target).to(tl.int32)
    return ready


# ---------------------------------------------------------------------------- host side: the launch arguments
def check_launch(policy: str, comm_programs, trace, grid: int) -> None:
    """Checks that depend on the grid (the device's SM count)."""
    policy_args(policy, comm_programs, grid)
    if trace is not None and tuple(trace.shape) != (grid, TRACE_EVENTS, 4):
        raise ValueError(f"trace buffer must be int64 [{grid}, {TRACE_EVENTS}, 4]")


def policy_args(policy: str, comm_programs, grid: int, lo: int = 1):
    """(POLICY constexpr, S). Public ops need 1 <= S < grid; CPU tests use S = 0 / grid (one role only)."""
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(POLICIES)}")
    if policy == "fixed":
        if comm_programs is None or not lo <= comm_programs <= grid - lo:
            raise ValueError(f"fixed-role policy needs {lo} <= comm_programs <= {grid - lo}, got {comm_programs}")
        return POLICIES[policy], int(comm_programs)
    return POLICIES[policy], 0

