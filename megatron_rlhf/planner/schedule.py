"""When each piece of a PPO step runs: a list schedule over blocks of ranks.

Every rank runs its tasks in program order (the engine is SPMD: a rank executes the operators of
the models it holds, one after another). A task starts when its inputs are ready and every rank
it needs is free. So models on disjoint ranks run side by side (ref || reward under interleaving,
actor training || critic training under interleaving2) and models sharing ranks run in turn
(everything under flattening), with no strategy-specific rule.

Ranks that share a host's cores (CPU ranks, ``HardwareProfile.host_cores``) slow each other
down: a task runs at ``min(1, cores / busy ranks of its host)`` of its rate, where the busy ranks
are counted over the task's time (time-weighted). A rank waiting in a gloo collective counts as
busy: on a shared CPU a collective's latency grows with the busy ranks as compute does (a
4-rank all-reduce on 2 cores takes about 4x a 2-rank one). Since slowing tasks moves the
overlaps, the schedule is recomputed a few times with the slowdowns of the previous pass.
Devices with their own compute (GPUs) pass no hosts and are scheduled once.

Two step times come out of one schedule:

- ``makespan``: the synchronous step, the end of the last task.
- ``period``: the busy time of the busiest block of ranks. It is the step time of a pipelined
  steady state in which the work of consecutive steps overlaps wherever ranks are idle, which is
  what separation allows (the shadows generate rollout k+1 while the trainers train on rollout k).
  On shared hosts every block works at once in that steady state, so the period is also at
  least the step's rank-seconds on a host over its cores.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from megatron_rlhf.planner.cost_model import Cost

CONTENTION_PASSES = 4
"""Schedules computed when hosts are shared; the slowdowns settle within a few."""


@dataclass(frozen=True)
class Task:
    """One operator of the step on one model (or one transfer between models).

    Attributes:
        name: ``stage:role`` (or ``transfer:src->dst``).
        stage: ``generation``, ``experience``, ``training``, ``transfer`` or ``sync``.
        ranges: the global ranks it occupies, as blocks of consecutive ranks.
        cost: its seconds, by limiting resource.
        deps: indices of the tasks whose outputs it needs.
    """

    name: str
    stage: str
    ranges: tuple[range, ...]
    cost: Cost
    deps: tuple[int, ...] = ()


@dataclass(frozen=True)
class Schedule:
    """The result of ``schedule``.

    Attributes:
        tasks: the tasks, in program order.
        start: start time of each task, seconds.
        end: end time of each task.
        critical: indices of the chain of tasks that sets the makespan, first to last.
        busiest: indices of the tasks on the busiest block of ranks.
        makespan: end of the last task (the synchronous step).
        period: the pipelined step: busy seconds of the busiest block of ranks with every task
            at its own rate (in the steady state the hosts' sharing is the next bound), and on
            shared hosts at least the step's rank-seconds on a host over its cores. ``busiest``
            and the times above come from the schedule slowed by sharing.
    """

    tasks: tuple[Task, ...]
    start: tuple[float, ...]
    end: tuple[float, ...]
    critical: tuple[int, ...]
    busiest: tuple[int, ...]
    makespan: float
    period: float


def _atoms(tasks: list[Task]) -> list[range]:
    """Blocks of consecutive ranks that every task either covers whole or not at all."""
    cuts = sorted({bound for task in tasks for r in task.ranges for bound in (r.start, r.stop)})
    return [range(a, b) for a, b in zip(cuts, cuts[1:], strict=False)]


@dataclass(frozen=True)
class SharedHost:
    """Ranks whose compute comes from the same ``cores`` (one CPU host)."""

    ranks: range
    cores: float


def schedule(tasks: list[Task], hosts: Sequence[SharedHost] = ()) -> Schedule:
    """Run the tasks in program order on their ranks; see the module docstring.

    Args:
        tasks: the step's tasks in program order.
        hosts: hosts whose ranks share cores; empty when every rank has its own compute.

    Raises:
        ValueError: a task depends on a later task.
    """
    result = alone = _list_schedule(tasks)
    for _ in range(CONTENTION_PASSES if hosts else 0):
        slowed = [replace(task, cost=task.cost.scaled(_slowdown(i, result, hosts)))
                  for i, task in enumerate(tasks)]
        result = _list_schedule(slowed)
    period = max([alone.period] + [_host_seconds(tasks, host) for host in hosts])
    return replace(result, period=period)


def _host_seconds(tasks: list[Task], host: SharedHost) -> float:
    """Seconds the host's cores need for one step's work: rank-seconds over cores."""
    work = sum(task.cost.total * _ranks_on(task, host) for task in tasks)
    return work / host.cores


def _slowdown(index: int, result: Schedule, hosts: Sequence[SharedHost]) -> float:
    """How much slower task ``index`` ran for the busy ranks on its hosts (>= 1)."""
    task, begin, finish = result.tasks[index], result.start[index], result.end[index]
    if finish <= begin:
        return 1.0
    factor = 1.0
    for host in hosts:
        if not _ranks_on(task, host):
            continue
        busy = 0.0
        for other, s, e in zip(result.tasks, result.start, result.end, strict=True):
            shared = min(finish, e) - max(begin, s)
            if shared > 0:
                busy += _ranks_on(other, host) * shared / (finish - begin)
        factor = max(factor, busy / host.cores)
    return factor


def covered_seconds(spans: Iterable[tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals: the wall-clock time some of them run."""
    total, reach = 0.0, -math.inf
    for begin, finish in sorted(spans):
        total += max(0.0, finish - max(begin, reach))
        reach = max(reach, finish)
    return total


def _ranks_on(task: Task, host: SharedHost) -> int:
    """Distinct ranks of ``task`` on ``host`` (a task's blocks may overlap)."""
    return len({rank for block in task.ranges for rank in block if rank in host.ranks})


def _list_schedule(tasks: list[Task]) -> Schedule:
    """One list-schedule pass with the tasks' costs as given."""
    atoms = _atoms(tasks)
    covered = [[a for a, atom in enumerate(atoms)
                if any(r.start <= atom.start and atom.stop <= r.stop for r in task.ranges)]
               for task in tasks]
    free, busy = [0.0] * len(atoms), [0.0] * len(atoms)
    last: list[int | None] = [None] * len(atoms)
    members: list[list[int]] = [[] for _ in atoms]
    start, end, blocker = [], [], []
    for i, task in enumerate(tasks):
        if any(d >= i for d in task.deps):
            raise ValueError(f"task {task.name!r} depends on a later task: order tasks by deps")
        waits = [(end[d], d) for d in task.deps]
        waits += [(free[a], last[a]) for a in covered[i]]
        begin, cause = max(waits, key=lambda w: w[0], default=(0.0, None))
        start.append(begin)
        end.append(begin + task.cost.total)
        blocker.append(cause if begin > 0 else None)
        for a in covered[i]:
            free[a], last[a] = end[i], i
            busy[a] += task.cost.total
            members[a].append(i)
    chain: list[int] = []
    node: int | None = max(range(len(tasks)), key=lambda i: end[i]) if tasks else None
    while node is not None:
        chain.append(node)
        node = blocker[node]
    busiest = max(range(len(atoms)), key=lambda a: busy[a]) if atoms else None
    return Schedule(
        tasks=tuple(tasks), start=tuple(start), end=tuple(end), critical=tuple(reversed(chain)),
        busiest=tuple(members[busiest]) if busiest is not None else (),
        makespan=max(end, default=0.0), period=max(busy, default=0.0),
    )
