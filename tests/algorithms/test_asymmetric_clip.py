"""DAPO's clip-higher: separate clip ranges below and above a policy ratio of 1."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.algorithms import PPOAlgorithmConfig, compute_policy_loss

RATIOS = [1.25, 1.35, 0.75]
ADVANTAGES = [1.0, 1.0, -1.0]


def _loss(clip_ratio: float, clip_ratio_high: float | None) -> tuple[float, float]:
    log_prob = torch.tensor([[math.log(r) for r in RATIOS]])
    loss, metrics = compute_policy_loss(log_prob, torch.zeros(1, 3), torch.tensor([ADVANTAGES]),
                                        torch.ones(1, 3), clip_ratio,
                                        clip_ratio_high=clip_ratio_high)
    return loss.item(), metrics["pg_clipfrac"].item()


def test_a_higher_upper_clip_lets_positive_advantages_grow_further() -> None:
    # Upper bound 1.28: 1.25 is not clipped (-1.25), 1.35 is (-1.28); the lower bound 0.8
    # clips 0.75 on the negative advantage (max(0.75, 0.8) = 0.8).
    assert _loss(0.2, 0.28) == (pytest.approx((-1.25 - 1.28 + 0.8) / 3), pytest.approx(2 / 3))
    # Symmetric 0.2: both positive-advantage ratios stop at 1.2.
    assert _loss(0.2, None) == (pytest.approx((-1.2 - 1.2 + 0.8) / 3), pytest.approx(1.0))
    assert _loss(0.2, 0.2) == _loss(0.2, None)


def test_the_config_resolves_and_checks_both_ranges() -> None:
    assert PPOAlgorithmConfig().clip_ratios == (0.2, 0.2)
    assert PPOAlgorithmConfig(clip_ratio=0.1).clip_ratios == (0.1, 0.1)
    assert PPOAlgorithmConfig(clip_ratio_low=0.2, clip_ratio_high=0.28).clip_ratios == (0.2, 0.28)
    assert PPOAlgorithmConfig(clip_ratio=0.3, clip_ratio_high=1.5).clip_ratios == (0.3, 1.5)
    with pytest.raises(ValueError, match=r"clip_ratio_low\(1.0\) must be in \(0, 1\)"):
        PPOAlgorithmConfig(clip_ratio_low=1.0)
    with pytest.raises(ValueError, match=r"clip_ratio_high\(0.0\) must be > 0"):
        PPOAlgorithmConfig(clip_ratio_high=0.0)
