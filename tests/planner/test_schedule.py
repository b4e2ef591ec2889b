"""The list schedule: side by side on disjoint ranks, in turn on shared ones."""

from __future__ import annotations

import pytest

from megatron_rlhf.planner.cost_model import Cost
from megatron_rlhf.planner.schedule import SharedHost, Task, schedule


def test_disjoint_tasks_overlap_and_the_critical_chain_is_found() -> None:
    tasks = [
        Task("a", "experience", (range(0, 4),), Cost(compute=1.0)),
        Task("b", "experience", (range(4, 8),), Cost(compute=2.0)),
        Task("c", "training", (range(0, 8),), Cost(compute=1.0), deps=(0, 1)),
    ]
    result = schedule(tasks)
    assert result.start == (0.0, 0.0, 2.0)
    assert result.makespan == 3.0
    assert result.critical == (1, 2)
    assert result.period == 3.0 and set(result.busiest) == {1, 2}


def test_period_is_the_busiest_block_when_steps_may_overlap() -> None:
    tasks = [
        Task("generate", "generation", (range(4, 8),), Cost(memory=3.0)),
        Task("train", "training", (range(0, 4),), Cost(compute=2.0), deps=(0,)),
        Task("sync", "sync", (range(0, 4), range(4, 8)), Cost(comm=0.5), deps=(1,)),
    ]
    result = schedule(tasks)
    assert result.makespan == pytest.approx(5.5)
    assert result.period == pytest.approx(3.5)  # the generating block: 3 + 0.5


def test_a_dependency_on_a_later_task_is_refused() -> None:
    with pytest.raises(ValueError, match="depends on a later task"):
        schedule([Task("a", "sync", (range(0, 1),), Cost(), deps=(0,))])


def test_ranks_sharing_cores_slow_each_other_only_while_busy_together() -> None:
    # 4 ranks on a 2-core host: actor and critic train side by side on ranks 0-1 and 2-3 (4 busy
    # ranks on 2 cores: each runs at half speed), then a lone sync on ranks 0-1 (full speed).
    host = [SharedHost(range(0, 4), cores=2.0)]
    tasks = [Task("training:actor", "training", (range(0, 2),), Cost(compute=1.0)),
             Task("training:critic", "training", (range(2, 4),), Cost(compute=1.0)),
             Task("sync:actor", "sync", (range(0, 2),), Cost(comm=0.5), deps=(0, 1))]
    result = schedule(tasks, host)
    assert result.end[0] == pytest.approx(2.0) and result.end[1] == pytest.approx(2.0)
    assert result.end[2] - result.start[2] == pytest.approx(0.5)
    assert result.makespan == pytest.approx(2.5)
    # With a core per rank nothing slows down.
    assert schedule(tasks, [SharedHost(range(0, 4), cores=4.0)]).makespan == pytest.approx(1.5)
    assert schedule(tasks).makespan == pytest.approx(1.5)


def test_pipelined_steps_on_a_shared_host_are_bound_by_its_cores() -> None:
    # Separation on one 2-core host of 4 ranks: shadows generate on 2-3 while trainers train on
    # 0-1. With a core per rank the pipelined step is the busier block (2 s); with 2 cores both
    # blocks' work (2 ranks x 1.5 s + 2 ranks x 2 s = 7 rank-seconds) needs 3.5 s of the cores.
    tasks = [Task("generation", "generation", (range(2, 4),), Cost(compute=1.5)),
             Task("training", "training", (range(0, 2),), Cost(compute=2.0), deps=(0,))]
    assert schedule(tasks).period == pytest.approx(2.0)
    assert schedule(tasks, [SharedHost(range(0, 4), cores=4.0)]).period == pytest.approx(2.0)
    shared = schedule(tasks, [SharedHost(range(0, 4), cores=2.0)])
    assert shared.period == pytest.approx(3.5)
    assert shared.makespan == pytest.approx(3.5)  # in turn, each block alone on 2 cores


def test_a_task_over_overlapping_blocks_counts_each_rank_once() -> None:
    # A gather lists its source blocks and its target block; here they are the same 2 ranks
    # three times. On a 2-core host those are 2 busy ranks, not 6: no slowdown.
    host = [SharedHost(range(0, 4), cores=2.0)]
    gather = Task("transfer", "transfer", (range(0, 2), range(0, 2), range(0, 2)), Cost(comm=1.0))
    result = schedule([gather], host)
    assert result.makespan == pytest.approx(1.0)
    assert result.period == pytest.approx(1.0)  # 2 rank-seconds over 2 cores
