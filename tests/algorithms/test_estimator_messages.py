"""Refusals that offer the critic-free estimators read them from the registry: one registered
beside its definition is named with the built-in ones."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from megatron_rlhf.algorithms import (
    ADVANTAGE_ESTIMATORS,
    PPOAlgorithmConfig,
    compute_grpo_outcome_advantages,
    critic_free_estimators,
    register_advantage_estimator,
)
from megatron_rlhf.config.ppo_run import RolloutConfig, RunConfig
from megatron_rlhf.topology.placement_config import PlacementConfig

CRITIC_FREE = r"\['reinforce\+\+', 'grpo', 'rloo', 'outcome'\]"


@pytest.fixture
def outcome() -> Iterator[str]:
    register_advantage_estimator("outcome")(lambda rewards, mask, config, **_: (rewards, rewards))
    yield "outcome"
    del ADVANTAGE_ESTIMATORS["outcome"]


def test_the_critic_free_estimators_are_the_registered_ones_without_a_critic() -> None:
    assert critic_free_estimators() == ["reinforce++", "grpo", "rloo"]


def test_a_critic_without_one_offers_the_registered_critic_free_estimators(outcome: str) -> None:
    with pytest.raises(ValueError, match=rf"'gae' trains a critic: choose one of {CRITIC_FREE}, "
                                         r"or leave placement.critic alone"):
        RunConfig(placement=PlacementConfig(critic=False))
    with pytest.raises(ValueError, match=rf"or choose a critic-free advantage_estimator "
                                         rf"\(critic-free estimators: {CRITIC_FREE}\)"):
        RunConfig(placement=PlacementConfig("custom", ratios=[1, 0.5, 0.5]))


@pytest.mark.parametrize("placement, field", [
    (PlacementConfig(ac_share=True), "ac_share=true"),
    (PlacementConfig("interleaving2"), "strategy='interleaving2'"),
    (PlacementConfig("custom", ratios=[1, 1, 0.5, 0.5]), "ratios=[1, 1, 0.5, 0.5]"),
    (PlacementConfig("separation", parallel={"shadow_critic": {"tp": 1}}),
     "parallel['shadow_critic']"),
])
def test_a_critic_option_without_a_critic_names_the_critic_free_estimators(
        outcome: str, placement: PlacementConfig, field: str) -> None:
    with pytest.raises(ValueError) as refused:
        RunConfig(placement=placement, algorithm=PPOAlgorithmConfig(advantage_estimator=outcome),
                  rollout=RolloutConfig(samples_per_prompt=2))
    message = str(refused.value)
    assert message.startswith(f"placement.{field}")
    assert "its algorithm.advantage_estimator is critic-free" in message
    assert message.endswith("(critic-free estimators: ['reinforce++', 'grpo', 'rloo', 'outcome'])")


def test_a_group_estimator_without_groups_offers_the_others(outcome: str) -> None:
    with pytest.raises(ValueError, match=r"or use an advantage_estimator of "
                                         r"\['gae', 'reinforce\+\+', 'outcome'\]"):
        compute_grpo_outcome_advantages(torch.zeros(4), 1)
