"""DAPO's overlong penalty on generated token counts (``reward.overlong_buffer``): the batch
penalty equals the scalar formula row by row, it enters the sequence score and the group
advantages, and bad settings are refused naming the field."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.algorithms import PPOAlgorithmConfig, RunningMoments, build_kl_controller
from megatron_rlhf.config.ppo_run import RewardConfig, RunConfig
from megatron_rlhf.engine.execution.experience_fields import ExperienceFeatures
from megatron_rlhf.engine.step.experience import compute_advantages
from megatron_rlhf.generation import GenerationConfig
from megatron_rlhf.rewards import RewardFunctionSpec
from megatron_rlhf.rewards.overlong import OverlongPenalty
from megatron_rlhf.rewards.verifiers import overlong_penalty

RM = ExperienceFeatures(reward_model=True)
"""A reward model's score, no critic (the batches below)."""


def _response_mask(lengths: list[int], width: int) -> torch.Tensor:
    return (torch.arange(width) < torch.tensor(lengths).unsqueeze(-1)).long()


def test_the_batch_penalty_counts_generated_tokens_row_by_row() -> None:
    lengths = [0, 5, 6, 7, 8, 3]
    penalty = OverlongPenalty(max_length=8, buffer_length=2, penalty_factor=0.5)
    got = penalty(_response_mask(lengths, 8))
    # 6 tokens are free, 7 cost half the buffer, 8 (the whole budget: cut off) the full factor.
    torch.testing.assert_close(got, torch.tensor([0.0, 0.0, 0.0, -0.25, -0.5, 0.0]))
    assert got.tolist() == [overlong_penalty(n, 8, 2, 0.5) for n in lengths]


def test_the_penalty_enters_the_score_and_the_group_advantages() -> None:
    mask = _response_mask([2, 4, 4, 3], 4)
    logprobs = -torch.ones(4, 4)
    fields = {"old_logprobs": logprobs, "ref_logprobs": logprobs.clone(), "response_mask": mask,
              "rm_scores": torch.zeros(4), "rule_scores": torch.tensor([1.0, 1.0, 0.0, 0.0])}
    config = PPOAlgorithmConfig(advantage_estimator="grpo", kl_in="loss",
                                grpo_std_normalize=False)
    out, metrics = compute_advantages(fields, config, build_kl_controller(config),
                                      RunningMoments(), 1.0, 1.0, samples_per_prompt=2,
                                      overlong=OverlongPenalty(4, 2), features=RM)
    # penalties 0, -1, -1, -0.5: scores 1, 0, -1, -0.5
    assert metrics["reward/overlong"] == pytest.approx(-0.625)
    assert metrics["reward_mean"] == pytest.approx(-0.125)
    torch.testing.assert_close(out["advantages"][:, 0], torch.tensor([0.5, -0.5, -0.25, 0.25]))
    plain, plain_metrics = compute_advantages(fields, config, build_kl_controller(config),
                                              RunningMoments(), 1.0, 1.0, samples_per_prompt=2,
                                              features=RM)
    assert "reward/overlong" not in plain_metrics
    torch.testing.assert_close(plain["advantages"][:, 0], torch.tensor([0.0, 0.0, 0.0, 0.0]))


def test_the_run_builds_the_penalty_from_max_new_tokens() -> None:
    reward = RewardConfig(overlong_buffer=4, overlong_penalty=0.5)
    assert reward.overlong(16) == OverlongPenalty(16, 4, 0.5)
    assert RewardConfig().overlong(16) is None


@pytest.mark.parametrize(("changes", "message"), [
    ({"overlong_buffer": -1}, r"reward.overlong_buffer=-1 must be >= 0"),
    ({"overlong_buffer": 2, "overlong_penalty": 0.0}, r"reward.overlong_penalty=0.0 must be"),
])
def test_bad_overlong_settings_are_refused_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RewardConfig(**changes)


def test_a_buffer_longer_than_the_token_budget_is_refused() -> None:
    with pytest.raises(ValueError, match=r"reward.overlong_buffer=9 exceeds "
                                         r"generation.max_new_tokens=8"):
        RunConfig(reward=RewardConfig(overlong_buffer=9),
                  generation=GenerationConfig(max_new_tokens=8))


def test_the_penalty_is_logged_beside_the_reward_functions_metrics() -> None:
    """The DAPO recipe sets both: each function's metric and ``reward/overlong`` are logged."""
    mask = _response_mask([2, 4, 4, 3], 4)
    logprobs = -torch.ones(4, 4)
    fields = {"old_logprobs": logprobs, "ref_logprobs": logprobs.clone(), "response_mask": mask,
              "rm_scores": torch.zeros(4), "rule_scores": torch.zeros(4),
              "function_scores": torch.tensor([[1.0], [0.0], [1.0], [0.0]]),
              "reward_errors": torch.zeros(4)}
    config = PPOAlgorithmConfig(advantage_estimator="grpo", kl_in="loss")
    _, metrics = compute_advantages(fields, config, build_kl_controller(config),
                                    RunningMoments(), 1.0, 1.0, samples_per_prompt=2,
                                    functions=[RewardFunctionSpec("m:correct")],
                                    overlong=OverlongPenalty(4, 2),
                                    features=ExperienceFeatures(reward_model=True, functions=True))
    assert metrics["reward/overlong"] == pytest.approx(-0.625)
    assert metrics["reward/correct"] == pytest.approx(0.5)
    assert metrics["reward/errors"] == 0.0
