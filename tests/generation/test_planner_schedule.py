"""The planner's decode schedule (``planner.cost_model.decode_schedule``) is the one continuous
batching runs: for the same answers, in the same queue order, the engine's decode calls per batch
size are the planner's segments, step for step."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlhf.planner.cost_model import decode_schedule
from tests.generation.helpers import BASE, generate_tiny, split_work


@pytest.mark.parametrize(("slots", "interval"), [(5, 1), (4, 3)])
def test_the_planners_decode_schedule_is_the_engines(tiny, slots: int, interval: int) -> None:
    """14 answers whose lengths the 30 end ids spread from 1 to 12 tokens; 5 slots checked
    every step (a batch that is not a power of two, shrinking through 4, 2 and 1) and 4 slots
    checked every 3 steps (ended answers wait for the check)."""
    config = dataclasses.replace(BASE, micro_batch_size=slots, stop_check_interval=interval)
    out = generate_tiny(tiny, config, list(range(200, 230)))
    lengths = out.response_lengths.tolist()  # in prompt order: the engine's queue order
    assert max(lengths) - min(lengths) >= 6
    _, decodes = split_work(out)
    engine = [(w.rows, w.forwards) for w in decodes]
    planner = [(s.slots, s.steps) for s in decode_schedule(lengths, slots, True, interval)]
    assert len(engine) > 1 and engine == planner


def test_static_rounds_last_as_the_planner_prices_them(tiny) -> None:
    """The static loop (``generation.batching=static``) runs rounds of 4 prompts, each its
    prefill and decode steps up to the stop check after its longest answer: the planner's
    rounds, the prefill counted as one forward."""
    config = dataclasses.replace(BASE, micro_batch_size=4, stop_check_interval=3,
                                 batching="static")
    out = generate_tiny(tiny, config, list(range(200, 230)))
    lengths = out.response_lengths.tolist()
    engine = [(w.rows, w.forwards) for w in out.micro_batches]
    planner = [(s.slots, s.steps + 1) for s in decode_schedule(lengths, 4, False, 3)]
    assert len(engine) == 4 and engine == planner
