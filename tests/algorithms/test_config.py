"""PPOAlgorithmConfig: defaults are valid, each bad field is refused by name."""

from __future__ import annotations

import pytest

from megatron_rlhf.algorithms import PPOAlgorithmConfig


def test_defaults_are_plain_ppo() -> None:
    config = PPOAlgorithmConfig()
    assert (config.gamma, config.lam, config.clip_ratio) == (1.0, 0.95, 0.2)
    assert config.dual_clip is None and config.reward_clip is None  # no extra clipping
    assert config.kl_estimator == "k1" and not config.adaptive_kl  # fixed KL penalty
    assert config.reward_norm == "none" and config.whiten_advantages


@pytest.mark.parametrize(
    "field, edge, beyond",
    [
        ("gamma", 0.0, -1e-9),
        ("gamma", 1.0, 1.0 + 1e-9),
        ("lam", 0.0, -1e-9),
        ("lam", 1.0, 1.0 + 1e-9),
        ("clip_ratio", 1e-9, 0.0),
        ("clip_ratio", 1.0 - 1e-9, 1.0),
        ("dual_clip", 1.0 + 1e-9, 1.0),
        ("value_clip", None, 0.0),
        ("value_loss_coef", 0.0, -1e-9),
        ("entropy_coef", 0.0, -1e-9),
        ("kl_coef", 0.0, -1e-9),
        ("kl_estimator", "k3", "k4"),
        ("kl_target", 1e-9, 0.0),
        ("kl_horizon", 1, 0),
        ("reward_clip", 1e-9, 0.0),
        ("reward_norm", "running", "zscore"),
    ],
)
def test_edge_values_are_kept_and_the_next_one_is_refused(field: str, edge: object,
                                                          beyond: object) -> None:
    assert getattr(PPOAlgorithmConfig(**{field: edge}), field) == edge
    with pytest.raises(ValueError, match=rf"^{field}\("):
        PPOAlgorithmConfig(**{field: beyond})


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
    with pytest.raises(ValueError, match=rf"^{field}\(") as error:
        PPOAlgorithmConfig(**{field: value})
    assert str(value) in str(error.value)  # the message shows the refused value
