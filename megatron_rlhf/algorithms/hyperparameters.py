"""Hyper-parameters of the PPO math, validated when constructed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rlhf.algorithms.kl import KL_ESTIMATORS
from megatron_rlhf.algorithms.rewards import SCORE_NORMALIZATIONS


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _positive_or_none(value: float | None) -> bool:
    return value is None or (math.isfinite(value) and value > 0)


@dataclass
class PPOAlgorithmConfig:
    """PPO hyper-parameters (advantages, KL penalty, rewards, losses)."""

    gamma: float = 1.0
    """Discount factor of GAE, in [0, 1]."""
    lam: float = 0.95
    """GAE lambda, in [0, 1]."""
    clip_ratio: float = 0.2
    """Clip range ``eps`` of the policy ratio, in (0, 1)."""
    dual_clip: float | None = None
    """Dual-clip bound ``c`` (> 1) for negative advantages; None disables it."""
    value_clip: float | None = 0.2
    """Clip range of the value change in the value loss (> 0); None disables it."""
    value_loss_coef: float = 1.0
    """Weight of the value loss when actor and critic share a trunk (AC-Share), >= 0."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus, >= 0."""
    kl_estimator: str = "k1"
    """Per-token KL estimator in the reward: one of k1, k2, k3."""
    kl_coef: float = 0.1
    """KL penalty coefficient (the starting value when ``adaptive_kl``), >= 0."""
    adaptive_kl: bool = False
    """Adapt ``kl_coef`` towards ``kl_target`` (Ziegler et al. 2019) instead of keeping it fixed."""
    kl_target: float = 6.0
    """Target KL per sequence in nats for the adaptive controller, > 0."""
    kl_horizon: int = 10000
    """Horizon in sequences of the adaptive controller, > 0."""
    reward_clip: float | None = None
    """Clip sequence scores to [-reward_clip, reward_clip] (> 0); None disables it."""
    reward_norm: str = "none"
    """Score normalisation before clipping: none, batch or running."""
    whiten_advantages: bool = True
    """Whiten advantages over the response tokens of the batch before the policy loss."""
    whiten_shift_mean: bool = True
    """When whitening, also subtract the mean (False only rescales)."""

    def __post_init__(self) -> None:
        """Checks every field.

        Raises:
            ValueError: Naming the first bad field, its value and how to fix it.
        """
        _require(0.0 <= self.gamma <= 1.0, f"gamma({self.gamma}) must be in [0, 1]; e.g. gamma=1.0")
        _require(0.0 <= self.lam <= 1.0, f"lam({self.lam}) must be in [0, 1]; e.g. lam=0.95")
        _require(
            0.0 < self.clip_ratio < 1.0,
            f"clip_ratio({self.clip_ratio}) must be in (0, 1); e.g. clip_ratio=0.2",
        )
        _require(
            self.dual_clip is None or self.dual_clip > 1.0,
            f"dual_clip({self.dual_clip}) must be > 1; e.g. dual_clip=3.0, or None to disable",
        )
        _require(
            _positive_or_none(self.value_clip),
            f"value_clip({self.value_clip}) must be > 0; e.g. value_clip=0.2, or None to disable",
        )
        for name in ("value_loss_coef", "entropy_coef", "kl_coef"):
            value = getattr(self, name)
            _require(
                math.isfinite(value) and value >= 0.0,
                f"{name}({value}) must be a finite number >= 0; use 0 to disable the term",
            )
        _require(
            self.kl_estimator in KL_ESTIMATORS,
            f"kl_estimator({self.kl_estimator!r}) is unknown; use one of {sorted(KL_ESTIMATORS)}",
        )
        _require(
            math.isfinite(self.kl_target) and self.kl_target > 0.0,
            f"kl_target({self.kl_target}) must be > 0 nats per sequence; e.g. kl_target=6.0",
        )
        _require(
            self.kl_horizon > 0, f"kl_horizon({self.kl_horizon}) must be > 0; e.g. kl_horizon=10000"
        )
        _require(
            _positive_or_none(self.reward_clip),
            f"reward_clip({self.reward_clip}) must be > 0; e.g. 10.0, or None (no clip)",
        )
        _require(
            self.reward_norm in SCORE_NORMALIZATIONS,
            f"reward_norm({self.reward_norm!r}) is unknown; use one of {SCORE_NORMALIZATIONS}",
        )
