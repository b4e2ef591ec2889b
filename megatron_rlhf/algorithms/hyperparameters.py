"""Hyper-parameters of the PPO math, validated when constructed."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rlhf.algorithms.advantages import ADVANTAGE_ESTIMATORS, get_advantage_estimator
from megatron_rlhf.algorithms.aggregation import LOSS_AGGREGATIONS
from megatron_rlhf.algorithms.kl import KL_ESTIMATORS
from megatron_rlhf.algorithms.off_policy import OFF_POLICY_CORRECTIONS
from megatron_rlhf.algorithms.policy_losses import POLICY_LOSSES, get_policy_loss
from megatron_rlhf.algorithms.rewards import SCORE_NORMALIZATIONS


def _require(ok: bool, message: str) -> None:
    """Refuse with ``message``, named as a run's configuration spells the field
    (``algorithm.<field>``)."""
    if not ok:
        raise ValueError(f"algorithm.{message}")


def _positive_or_none(value: float | None) -> bool:
    return value is None or (math.isfinite(value) and value > 0)


KL_PLACEMENTS = ("reward", "loss")


@dataclass
class PPOAlgorithmConfig:
    """PPO hyper-parameters (advantages, KL penalty, rewards, losses).

    The defaults are PPO with a critic (GAE), the KL as a reward penalty and token-mean losses.
    ``docs/algorithms.md`` gives the formulas of each estimator and the fields that select them.
    """

    advantage_estimator: str = "gae"
    """A name in ``ADVANTAGE_ESTIMATORS``: gae (PPO with a critic), grpo, rloo (group-relative,
    need several responses per prompt), reinforce++ (batch-whitened discounted returns); only gae
    trains a critic."""
    grpo_std_normalize: bool = True
    """GRPO only: divide by the group's std (False: mean subtraction only, as in Dr. GRPO)."""
    gamma: float = 1.0
    """Discount factor of GAE and of the REINFORCE++ returns, in [0, 1]."""
    lam: float = 0.95
    """GAE lambda, in [0, 1]."""
    clip_ratio: float = 0.2
    """Clip range ``eps`` of the policy ratio, in (0, 1)."""
    clip_ratio_low: float | None = None
    """Clip range below 1 (the ratio is clipped at ``1 - clip_ratio_low``), in (0, 1); None:
    ``clip_ratio``."""
    clip_ratio_high: float | None = None
    """Clip range above 1 (at ``1 + clip_ratio_high``), > 0; None: ``clip_ratio``. DAPO's
    clip-higher uses ``clip_ratio_low=0.2, clip_ratio_high=0.28``."""
    policy_loss: str = "ppo"
    """A name in ``POLICY_LOSSES``: ppo (PPO's token-level clipped surrogate, with the
    ``clip_ratio*`` fields) or gspo (GSPO's sequence-level one, with the ``gspo_clip_ratio_*``
    fields; needs ``loss_aggregation=seq_mean_token_mean``)."""
    gspo_clip_ratio_low: float = 3e-4
    """GSPO only: clip range of the sequence ratio below 1, in (0, 1) (the paper: 3e-4)."""
    gspo_clip_ratio_high: float = 4e-4
    """GSPO only: clip range of the sequence ratio above 1, > 0 (the paper: 4e-4)."""
    off_policy: str = "none"
    """A name in ``OFF_POLICY_CORRECTIONS``: none (PPO's ratio against the experience's old
    log-probs), decoupled (the ratio clipped around the trainer's log-probs before the step's
    update, each token weighted by ``exp(proximal - behaviour)``) or truncated_is (that weight
    capped at ``off_policy_cap``); see ``algorithms/off_policy.py``."""
    off_policy_cap: float = 2.0
    """truncated_is only: the importance weight of a token is capped at this, >= 1."""
    dual_clip: float | None = None
    """Dual-clip bound ``c`` (> 1) for negative advantages; None disables it."""
    value_clip: float | None = 0.2
    """Clip range of the value change in the value loss (> 0); None disables it."""
    value_loss_coef: float = 1.0
    """Weight of the value loss when actor and critic share a trunk (AC-Share), >= 0."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus, >= 0."""
    kl_in: str = "reward"
    """Where the KL to the reference goes: reward (a per-token penalty ``-kl_coef * kl``) or loss
    (``kl_loss_coef * kl_loss`` added to the policy loss, GRPO style; the reward gets none)."""
    kl_estimator: str = "k1"
    """Per-token KL estimator in the reward (``kl_in="reward"``): a name in ``KL_ESTIMATORS``
    (k1, k2, k3)."""
    kl_coef: float = 0.1
    """KL penalty coefficient in the reward (the starting value when ``adaptive_kl``), >= 0."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss term when ``kl_in="loss"``, >= 0."""
    kl_loss_estimator: str = "k3"
    """Per-token KL estimator of the loss term (``kl_in="loss"``): a name in ``KL_ESTIMATORS``
    (k1, k2, k3)."""
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
    """GAE only: whiten advantages over the response tokens of the batch before the policy loss
    (grpo and rloo are already normalised per group; reinforce++ always whitens its returns)."""
    whiten_shift_mean: bool = True
    """When whitening, also subtract the mean (False only rescales)."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling (grpo, rloo): drop groups whose responses all scored the same and
    refill the step from further prompts (``engine/step/dynamic_sampling.py``)."""
    max_refill_rounds: int = 2
    """With ``dynamic_sampling``: generation rounds after the first that may refill a step,
    >= 0; past them the batch is topped up with all-equal groups."""
    loss_aggregation: str = "token_mean"
    """Reduction of the per-token policy (and KL) loss: token_mean, seq_mean_token_mean or
    seq_mean_token_sum (see ``aggregate_loss``)."""

    @property
    def clip_ratios(self) -> tuple[float, float]:
        """``(low, high)``: the policy ratio is clipped to ``[1 - low, 1 + high]``."""
        return (self.clip_ratio if self.clip_ratio_low is None else self.clip_ratio_low,
                self.clip_ratio if self.clip_ratio_high is None else self.clip_ratio_high)

    @property
    def uses_critic(self) -> bool:
        """Whether the estimator needs a value model (of the built-in ones, only gae)."""
        return get_advantage_estimator(self.advantage_estimator).uses_critic

    @property
    def needs_groups(self) -> bool:
        """Whether the estimator compares the responses to one prompt (grpo, rloo), so a run
        needs ``rollout.samples_per_prompt >= 2``."""
        return get_advantage_estimator(self.advantage_estimator).needs_groups

    def __post_init__(self) -> None:
        """Checks every field.

        ``value_clip`` and ``value_loss_coef`` are accepted but unused without a critic, so one
        YAML can switch estimators by a single line.

        Raises:
            ValueError: Naming the first bad field, its value and how to fix it.
        """
        _require(
            self.advantage_estimator in ADVANTAGE_ESTIMATORS,
            f"advantage_estimator({self.advantage_estimator!r}) is unknown; use one of "
            f"{list(ADVANTAGE_ESTIMATORS)}",
        )
        _require(
            self.kl_in in KL_PLACEMENTS,
            f"kl_in({self.kl_in!r}) is unknown; use one of {KL_PLACEMENTS}",
        )
        _require(
            self.loss_aggregation in LOSS_AGGREGATIONS,
            f"loss_aggregation({self.loss_aggregation!r}) is unknown; use one of "
            f"{LOSS_AGGREGATIONS}",
        )
        self._check_policy_loss()
        _require(
            self.off_policy in OFF_POLICY_CORRECTIONS,
            f"off_policy({self.off_policy!r}) is unknown; use one of "
            f"{list(OFF_POLICY_CORRECTIONS)}",
        )
        _require(
            math.isfinite(self.off_policy_cap) and self.off_policy_cap >= 1.0,
            f"off_policy_cap({self.off_policy_cap}) must be a finite number >= 1; e.g. "
            "off_policy_cap=2.0",
        )
        _require(0.0 <= self.gamma <= 1.0, f"gamma({self.gamma}) must be in [0, 1]; e.g. gamma=1.0")
        _require(0.0 <= self.lam <= 1.0, f"lam({self.lam}) must be in [0, 1]; e.g. lam=0.95")
        _require(
            0.0 < self.clip_ratio < 1.0,
            f"clip_ratio({self.clip_ratio}) must be in (0, 1); e.g. clip_ratio=0.2",
        )
        _require(
            self.clip_ratio_low is None or 0.0 < self.clip_ratio_low < 1.0,
            f"clip_ratio_low({self.clip_ratio_low}) must be in (0, 1); e.g. clip_ratio_low=0.2, "
            "or None for clip_ratio",
        )
        _require(
            _positive_or_none(self.clip_ratio_high),
            f"clip_ratio_high({self.clip_ratio_high}) must be > 0; e.g. clip_ratio_high=0.28, "
            "or None for clip_ratio",
        )
        _require(
            self.dual_clip is None or self.dual_clip > 1.0,
            f"dual_clip({self.dual_clip}) must be > 1; e.g. dual_clip=3.0, or None to disable",
        )
        _require(
            _positive_or_none(self.value_clip),
            f"value_clip({self.value_clip}) must be > 0; e.g. value_clip=0.2, or None to disable",
        )
        for name in ("value_loss_coef", "entropy_coef", "kl_coef", "kl_loss_coef"):
            value = getattr(self, name)
            _require(
                math.isfinite(value) and value >= 0.0,
                f"{name}({value}) must be a finite number >= 0; use 0 to disable the term",
            )
        for name in ("kl_estimator", "kl_loss_estimator"):
            value = getattr(self, name)
            _require(
                value in KL_ESTIMATORS,
                f"{name}({value!r}) is unknown; use one of {sorted(KL_ESTIMATORS)}",
            )
        _require(
            not (self.adaptive_kl and self.kl_in == "loss"),
            "adaptive_kl(True) adapts the reward's kl_coef, but kl_in('loss') puts no KL in the "
            "reward; set adaptive_kl=False, or kl_in='reward'",
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
        groups = [name for name, estimator in ADVANTAGE_ESTIMATORS.items()
                  if estimator.needs_groups]
        _require(
            not self.dynamic_sampling or self.needs_groups,
            f"dynamic_sampling(True) drops groups of equal scores, which only the group "
            f"estimators {groups} form; advantage_estimator({self.advantage_estimator!r}) "
            f"has none: set advantage_estimator={groups[0]!r} or dynamic_sampling=False",
        )
        _require(
            self.max_refill_rounds >= 0,
            f"max_refill_rounds({self.max_refill_rounds}) must be >= 0; e.g. max_refill_rounds=2",
        )
        _require(
            self.reward_norm in SCORE_NORMALIZATIONS,
            f"reward_norm({self.reward_norm!r}) is unknown; use one of {SCORE_NORMALIZATIONS}",
        )

    def _check_policy_loss(self) -> None:
        """The policy loss is registered, accepts the loss aggregation, and its clip ranges are
        in range."""
        _require(
            self.policy_loss in POLICY_LOSSES,
            f"policy_loss({self.policy_loss!r}) is unknown; use one of {list(POLICY_LOSSES)}",
        )
        accepted = get_policy_loss(self.policy_loss).loss_aggregations
        _require(
            self.loss_aggregation in accepted,
            f"loss_aggregation({self.loss_aggregation!r}) does not fit policy_loss"
            f"({self.policy_loss!r}), which takes {list(accepted)}; e.g. "
            f"loss_aggregation={accepted[0]!r}",
        )
        _require(
            0.0 < self.gspo_clip_ratio_low < 1.0,
            f"gspo_clip_ratio_low({self.gspo_clip_ratio_low}) must be in (0, 1); e.g. "
            "gspo_clip_ratio_low=3e-4",
        )
        _require(
            math.isfinite(self.gspo_clip_ratio_high) and self.gspo_clip_ratio_high > 0.0,
            f"gspo_clip_ratio_high({self.gspo_clip_ratio_high}) must be > 0; e.g. "
            "gspo_clip_ratio_high=4e-4",
        )
