"""DAPO's dynamic sampling, the parts without ranks: which groups count as informative, which
rows a step trains on, the refill rounds' prompts (a pure function of step and round, so a
resume reads the same data) and the refused settings. The multi-rank behaviour under every
placement is in ``test_critic_free.py``."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.algorithms import PPOAlgorithmConfig
from megatron_rlhf.config.ppo_run import RolloutConfig, RunConfig
from megatron_rlhf.data.prompts import REFILL_ID_STRIDE, PromptStream
from megatron_rlhf.engine.execution.batch import DistBatch
from megatron_rlhf.engine.execution.transfer import RowLayout
from megatron_rlhf.engine.step.dynamic_sampling import (
    gather_groups,
    informative_groups,
    select_groups,
)


def test_groups_of_equal_scores_are_not_informative() -> None:
    scores = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.5, float("nan"), 1.0])
    assert informative_groups(scores, 2) == [False, True, False, True]
    assert informative_groups(scores, 4) == [True, True]


def test_the_first_informative_groups_are_chosen_then_the_earliest_equal_ones() -> None:
    full = select_groups([[False, True, True], [True, False, True]], wanted=3)
    assert full.chosen == [(0, 1), (0, 2), (1, 0)]
    assert full.metrics() == {"dynamic_sampling/kept_groups": 3.0,
                              "dynamic_sampling/dropped_groups": 2.0,
                              "dynamic_sampling/filled_groups": 0.0,
                              "dynamic_sampling/rounds": 2.0}
    short = select_groups([[False, True, False], [False, False, False]], wanted=3)
    assert short.chosen == [(0, 1), (0, 0), (0, 2)]
    assert (short.kept, short.dropped, short.rounds) == (1, 5, 2)


def test_gathered_rows_follow_the_chosen_groups() -> None:
    layout = RowLayout.replicated(4, [0])
    schema = {"x": (torch.float32, ())}
    rounds = [DistBatch(layout, schema, {"x": torch.tensor([0.0, 1.0, 2.0, 3.0])}),
              DistBatch(layout, schema, {"x": torch.tensor([10.0, 11.0, 12.0, 13.0])})]
    batch = gather_groups(rounds, [(1, 1), (0, 0)], samples_per_prompt=2)
    assert batch.fields["x"].tolist() == [12.0, 13.0, 0.0, 1.0]
    assert batch.layout is layout
    empty = gather_groups([DistBatch(layout, schema, None)] * 2, [(1, 1), (0, 0)], 2)
    assert empty.fields is None


def test_refill_rounds_draw_a_pure_function_of_step_and_round() -> None:
    prompts = [[i + 1] for i in range(20)]
    stream = PromptStream(prompts, 4, seed=7, records=[{"i": i} for i in range(20)])
    again = PromptStream(prompts, 4, seed=7, records=[{"i": i} for i in range(20)])
    first, first_ids = stream.batch(3)
    assert stream.batch(3, 0) == (first, first_ids)
    refill, refill_ids = stream.batch(3, 1)
    assert again.batch(3, 1) == (refill, refill_ids)
    assert refill_ids == [REFILL_ID_STRIDE + 3 * 4 + i for i in range(4)]
    assert stream.batch(3, 2) != (refill, refill_ids) and stream.batch(4, 1)[0] != refill
    assert [prompts[i] for i, _ in stream.batch_records(3, 1)] == refill
    assert [record["i"] for _, record in stream.batch_records(3, 1)] == [
        i for i, _ in stream.batch_records(3, 1)]
    every_first_round = {i for step in range(100) for i in stream.batch(step)[1]}
    assert not every_first_round & {i for step in range(100) for i in stream.batch(step, 1)[1]}


@pytest.mark.parametrize(("algorithm", "message"), [
    ({"dynamic_sampling": True}, r"algorithm.dynamic_sampling\(True\) .* "
                                 r"advantage_estimator\('gae'\)"),
    ({"advantage_estimator": "grpo", "dynamic_sampling": True, "max_refill_rounds": -1},
     r"algorithm.max_refill_rounds\(-1\) must be >= 0"),
])
def test_bad_dynamic_sampling_settings_are_refused(algorithm: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RunConfig(algorithm=PPOAlgorithmConfig(**algorithm),
                  rollout=RolloutConfig(samples_per_prompt=2))
