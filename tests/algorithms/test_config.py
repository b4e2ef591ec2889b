"""PPOAlgorithmConfig: defaults are valid, each bad field is refused by name."""

from __future__ import annotations

import pytest

from megatron_rlhf.algorithms import PPOAlgorithmConfig


def test_defaults_and_edge_values_are_valid() -> None:
    PPOAlgorithmConfig()
    PPOAlgorithmConfig(
        gamma=0.0,
        lam=1.0,
        dual_clip=3.0,
        value_clip=None,
        kl_estimator="k3",
        kl_coef=0.0,
        adaptive_kl=True,
        reward_clip=5.0,
        reward_norm="running",
    )


@pytest.mark.parametrize(
    "field, value",
    [
        ("gamma", 1.5),
        ("gamma", float("nan")),
        ("lam", -0.1),
        ("clip_ratio", 0.0),
        ("clip_ratio", 1.0),
        ("dual_clip", 1.0),
        ("value_clip", 0.0),
        ("value_clip", float("inf")),
        ("value_loss_coef", -1.0),
        ("entropy_coef", -0.01),
        ("kl_coef", float("nan")),
        ("kl_estimator", "k4"),
        ("kl_target", 0.0),
        ("kl_horizon", 0),
        ("reward_clip", -1.0),
        ("reward_norm", "zscore"),
    ],
)
def test_bad_field_raises_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\("):
        PPOAlgorithmConfig(**{field: value})
