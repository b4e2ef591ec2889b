"""Hooks into a PPO run for the tests and the GPU check: what the run does not choose itself.

    with forcing_moves({0: "separation", 1: "flattening tp=1"}):
        run_ppo(config)          # moves after steps 0 and 1, whatever the prediction
    with without_host_memory():
        run_ppo(config)          # a move's state goes through files, as where it does not fit

It replaces one function of the run's modules for as long as its ``with`` block lasts, in
this process only (a multi-rank test enters it on every rank).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from megatron_rlhf.engine.run import move
from megatron_rlhf.engine.run.replan import MoveTarget, RunReplanner


@contextmanager
def forcing_moves(moves: Mapping[int, str]) -> Iterator[None]:
    """Runs inside move after step ``s`` to the first candidate placement whose label starts
    with ``moves[s]``, whatever the re-planner predicts (``MoveTarget.forced``); each run's
    re-planner takes the moves afresh.

    Args:
        moves: step -> the start of a candidate placement's label.

    Raises:
        ValueError: (at the run's first step) a run without ``placement.replan.move=true``, or
            a prefix that no candidate's label starts with.
    """
    take_target = RunReplanner.take_target
    left: weakref.WeakKeyDictionary[RunReplanner, dict[int, str]] = weakref.WeakKeyDictionary()

    def forced_target(replanner: RunReplanner, step: int) -> MoveTarget | None:
        target = take_target(replanner, step)
        if moves and not replanner.settings.move:
            raise ValueError("forced moves need placement.replan.move=true")
        prefix = left.setdefault(replanner, dict(moves)).pop(step, None)
        if prefix is None:
            return target
        label = next((label for label in replanner.labels if label.startswith(prefix)), None)
        if label is None:
            raise ValueError(f"no candidate placement starts with {prefix!r}: "
                             f"{replanner.labels}")
        return dataclasses.replace(replanner.target(label), forced=True)

    RunReplanner.take_target = forced_target
    try:
        yield
    finally:
        RunReplanner.take_target = take_target


@contextmanager
def without_host_memory() -> Iterator[None]:
    """Moves find no host memory available (``engine.run.move.available_host_bytes``), so they
    hand the state over through files (state ``disk``), as where it does not fit twice."""
    available = move.available_host_bytes
    move.available_host_bytes = lambda: 0
    try:
        yield
    finally:
        move.available_host_bytes = available
