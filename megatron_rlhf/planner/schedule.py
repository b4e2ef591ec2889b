"""When each piece of a PPO step runs: a list schedule over blocks of ranks.

Every rank runs its tasks in program order (the engine is SPMD: a rank executes the operators of
the models it holds, one after another). A task starts when its inputs are ready and every rank
it needs is free. So models on disjoint ranks run side by side (ref || reward under interleaving,
actor training || critic training under interleaving2) and models sharing ranks run in turn
(everything under flattening), with no strategy-specific rule.

Two step times come out of one schedule:

- ``makespan``: the synchronous step, the end of the last task.
- ``period``: the busy time of the busiest block of ranks. It is the step time of a pipelined
  steady state in which the work of consecutive steps overlaps wherever ranks are idle, which is
  what separation allows (the shadows generate rollout k+1 while the trainers train on rollout k).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rlhf.planner.cost_model import Cost


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
        period: busy seconds of the busiest block of ranks (the pipelined step).
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


def schedule(tasks: list[Task]) -> Schedule:
    """Run the tasks in program order on their ranks; see the module docstring.

    Raises:
        ValueError: a task depends on a later task.
    """
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
