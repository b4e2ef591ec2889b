"""PPOAlgorithmConfig: defaults are valid, each bad field is refused by name."""

from __future__ import annotations

import pytest

from megatron_rlhf.algorithms import FixedKLController, PPOAlgorithmConfig, build_kl_controller


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
    with pytest.raises(ValueError, match=rf"^algorithm\.{field}\("):
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
        ("advantage_estimator", "ppo"),
        ("advantage_estimator", "GRPO"),
        ("kl_in", "both"),
        ("kl_loss_coef", -0.001),
        ("kl_loss_estimator", "k4"),
        ("loss_aggregation", "seq_sum"),
    ],
)
def test_bad_field_raises_naming_it(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"^algorithm\.{field}\(") as error:
        PPOAlgorithmConfig(**{field: value})
    assert str(value) in str(error.value)  # the message shows the refused value


def test_defaults_are_todays_ppo() -> None:
    cfg = PPOAlgorithmConfig()
    assert cfg.advantage_estimator == "gae" and cfg.uses_critic
    assert cfg.kl_in == "reward" and cfg.kl_estimator == "k1"
    assert cfg.loss_aggregation == "token_mean"
    controller = build_kl_controller(cfg)
    assert isinstance(controller, FixedKLController) and controller.value == cfg.kl_coef


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++"])
def test_critic_free_estimators(estimator: str) -> None:
    # value_clip / value_loss_coef keep their defaults: unused without a critic, not an error
    cfg = PPOAlgorithmConfig(advantage_estimator=estimator, grpo_std_normalize=False)
    assert not cfg.uses_critic


def test_kl_in_loss_takes_the_kl_out_of_the_reward() -> None:
    cfg = PPOAlgorithmConfig(advantage_estimator="grpo", kl_in="loss", kl_loss_coef=0.04)
    assert cfg.kl_loss_estimator == "k3"
    controller = build_kl_controller(cfg)
    assert isinstance(controller, FixedKLController) and controller.value == 0.0


def test_adaptive_kl_with_kl_in_loss_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^algorithm.adaptive_kl\(True\) .* kl_in\('loss'\)"):
        PPOAlgorithmConfig(kl_in="loss", adaptive_kl=True)

