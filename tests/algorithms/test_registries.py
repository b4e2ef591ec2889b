"""The advantage-estimator and KL-estimator registries: an unknown name is refused with the
registered ones listed, and an estimator registered beside its definition is accepted by the
configuration (its own and the run's) and used by the experience step and the KL terms."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import (
    ADVANTAGE_ESTIMATORS,
    KL_ESTIMATORS,
    FixedKLController,
    PPOAlgorithmConfig,
    RunningMoments,
    compute_kl_loss,
    get_advantage_estimator,
    get_kl_estimator,
    kl_penalty,
    register_advantage_estimator,
    register_kl_estimator,
)
from megatron_rlhf.config.ppo_run import RolloutConfig, RunConfig
from megatron_rlhf.engine.execution.experience_fields import ExperienceFeatures
from megatron_rlhf.engine.step.experience import compute_advantages
from tests.algorithms.helpers import LENGTHS, random_padded, response_mask


def reward_to_go(rewards: torch.Tensor, response_mask: torch.Tensor, config: PPOAlgorithmConfig,
                 *, values: torch.Tensor | None, group_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """An estimator none of the built-in ones is: the undiscounted reward-to-go, unwhitened."""
    masked = torch.where(response_mask.bool(), rewards, 0.0)
    returns = masked.flip(-1).cumsum(-1).flip(-1) * response_mask
    return returns, returns


@pytest.fixture
def registered() -> Iterator[str]:
    register_advantage_estimator("reward_to_go", needs_groups=True)(reward_to_go)
    register_kl_estimator("abs")(lambda log_prob, ref_log_prob: (log_prob - ref_log_prob).abs())
    yield "reward_to_go"
    del ADVANTAGE_ESTIMATORS["reward_to_go"], KL_ESTIMATORS["abs"]


def test_the_built_in_estimators_are_registered() -> None:
    assert list(ADVANTAGE_ESTIMATORS) == ["gae", "reinforce++", "grpo", "rloo"]
    assert [name for name, e in ADVANTAGE_ESTIMATORS.items() if e.uses_critic] == ["gae"]
    assert [name for name, e in ADVANTAGE_ESTIMATORS.items() if e.needs_groups] == ["grpo",
                                                                                   "rloo"]
    assert sorted(KL_ESTIMATORS) == ["k1", "k2", "k3"]


def test_an_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"'ppo' is unknown; registered: \['gae', 'reinforce"):
        get_advantage_estimator("ppo")
    with pytest.raises(ValueError, match=r"'k4' is unknown; registered: \['k1', 'k2', 'k3'\]"):
        get_kl_estimator("k4")
    with pytest.raises(ValueError, match=r"algorithm.advantage_estimator\('ppo'\) is unknown; "
                                         r"use one of \['gae', 'reinforce\+\+', 'grpo', 'rloo'\]"):
        PPOAlgorithmConfig(advantage_estimator="ppo")


def test_a_name_is_registered_once() -> None:
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        register_advantage_estimator("grpo")(reward_to_go)
    with pytest.raises(ValueError, match="'k3' is already registered"):
        register_kl_estimator("k3")(torch.sub)
    assert ADVANTAGE_ESTIMATORS["grpo"].compute is not reward_to_go


def test_a_new_estimator_passes_the_configuration_checks(registered: str) -> None:
    config = PPOAlgorithmConfig(advantage_estimator=registered, kl_estimator="abs",
                                kl_loss_estimator="abs", dynamic_sampling=True)
    assert not config.uses_critic and config.needs_groups
    run = RunConfig(algorithm=config, rollout=RolloutConfig(samples_per_prompt=2))
    assert not run.placement.critic  # no critic is placed for it
    with pytest.raises(ValueError, match=r"samples_per_prompt\(1\) must be >= 2 .*'reward_to_go'"):
        RunConfig(algorithm=config, rollout=RolloutConfig(samples_per_prompt=1))


def test_the_experience_step_uses_a_new_estimator(registered: str) -> None:
    rng = np.random.default_rng(5)
    mask = response_mask(LENGTHS)
    old, ref = (random_padded(rng, LENGTHS, pad=0.0) for _ in range(2))
    scores = torch.from_numpy(rng.normal(size=len(LENGTHS)))
    fields = {"old_logprobs": old, "ref_logprobs": ref, "response_mask": mask,
              "rm_scores": scores, "rule_scores": torch.zeros_like(scores)}
    config = PPOAlgorithmConfig(advantage_estimator=registered, kl_estimator="abs", kl_coef=0.5)
    out, _ = compute_advantages(fields, config, FixedKLController(0.5), RunningMoments(),
                                reward_model_weight=1.0, rule_weight=0.0, samples_per_prompt=2,
                                features=ExperienceFeatures(reward_model=True))
    for row, length in enumerate(LENGTHS):  # score on the last token, -0.5 |old - ref| on each
        penalty = [-0.5 * abs(old[row, t].item() - ref[row, t].item()) for t in range(length)]
        expected = [sum(penalty[t:]) + scores[row].item() for t in range(length)]
        assert out["advantages"][row, :length].tolist() == pytest.approx(expected, rel=1e-12)
        assert out["kl"][row, :length].tolist() == pytest.approx([-p / 0.5 for p in penalty])
    assert torch.equal(out["returns"], out["advantages"])


def test_the_kl_terms_use_a_new_kl_estimator(registered: str) -> None:
    rng = np.random.default_rng(6)
    mask = response_mask(LENGTHS)
    log_prob, ref = (random_padded(rng, LENGTHS) for _ in range(2))
    distance = torch.where(mask.bool(), (log_prob - ref).abs(), 0.0)
    assert torch.equal(kl_penalty(log_prob, ref, mask, "abs"), distance)
    loss, _ = compute_kl_loss(log_prob, ref, mask, "abs")
    assert loss.item() == pytest.approx((distance.sum() / mask.sum()).item(), rel=1e-12)
