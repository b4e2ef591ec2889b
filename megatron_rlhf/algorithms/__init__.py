"""PPO math as pure tensor functions (torch only, no process groups).

Tensors are ``[batch, response_len]`` with a 0/1 ``response_mask``. Map of the files:

- ``hyperparameters.py``: ``PPOAlgorithmConfig`` (estimator, KL placement, loss aggregation).
- ``masked.py``: masked sum / mean / var / whitening.
- ``kl.py``: k1/k2/k3 KL estimators (the ``KL_ESTIMATORS`` registry), fixed and adaptive KL
  controllers.
- ``rewards.py``: score normalisation and clipping, token-level rewards.
- ``advantages.py``: the ``ADVANTAGE_ESTIMATORS`` registry; GAE advantages and returns;
  REINFORCE++ discounted, whitened returns.
- ``group_advantages.py``: GRPO and RLOO outcome advantages over groups of responses.
- ``aggregation.py``: per-token loss to scalar (token_mean, seq_mean_token_mean, ...).
- ``losses.py``: clipped policy loss, KL loss term, clipped value loss, entropy bonus.
- ``policy_losses.py``: the ``POLICY_LOSSES`` registry (``algorithm.policy_loss``): ppo (the
  clipped loss above) and gspo (sequence-level ratio and clip).
- ``off_policy.py``: the ``OFF_POLICY_CORRECTIONS`` registry (``algorithm.off_policy``): none,
  decoupled (clip around the proximal policy, behaviour importance weight) and truncated_is.

One experience batch, in order::

    kl = kl_penalty(log_prob, ref_log_prob, mask, cfg.kl_estimator)
    scores = normalize_scores(scores, cfg.reward_norm, running_moments)
    rewards = compute_token_level_rewards(scores, kl, mask, kl_ctl.value, cfg.reward_clip)
    kl_ctl.update(mean_sequence_kl(kl, mask).item(), n_steps=batch_size)
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask, cfg.whiten_shift_mean)

The other estimators (``cfg.advantage_estimator``, each registered in ``ADVANTAGE_ESTIMATORS``
and called as ``estimator.compute(rewards, mask, cfg, values=..., group_size=n)``) replace the
GAE lines; ``docs/algorithms.md`` has the formulas and the data-parallel contract::

    # grpo / rloo: full-batch scores [num_groups * group_size], groups contiguous
    seq_adv = compute_grpo_outcome_advantages(all_scores, n, cfg.grpo_std_normalize)
    advantages = broadcast_sequence_advantages(seq_adv[my_rows], mask)
    # reinforce++
    advantages, returns = compute_reinforce_plus_plus_advantage_return(rewards, mask, cfg.gamma)
"""

from __future__ import annotations

from megatron_rlhf.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    AdvantageEstimator,
    AdvantageFunction,
    compute_discounted_returns,
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_advantage_return,
    critic_free_estimators,
    get_advantage_estimator,
    register_advantage_estimator,
)
from megatron_rlhf.algorithms.aggregation import (
    LOSS_AGGREGATIONS,
    aggregate_loss,
    aggregation_denominator,
)
from megatron_rlhf.algorithms.group_advantages import (
    broadcast_sequence_advantages,
    compute_grpo_outcome_advantages,
    compute_rloo_outcome_advantages,
)
from megatron_rlhf.algorithms.hyperparameters import KL_PLACEMENTS, PPOAlgorithmConfig
from megatron_rlhf.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    KLEstimator,
    build_kl_controller,
    get_kl_estimator,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    mean_sequence_kl,
    register_kl_estimator,
)
from megatron_rlhf.algorithms.losses import (
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
)
from megatron_rlhf.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megatron_rlhf.algorithms.off_policy import (
    OFF_POLICY_CORRECTIONS,
    OffPolicyCorrection,
    OffPolicyFunction,
    get_off_policy,
    importance_weights,
    off_policy_metrics,
    register_off_policy,
)
from megatron_rlhf.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLoss,
    PolicyLossFunction,
    compute_gspo_policy_loss,
    get_policy_loss,
    register_policy_loss,
)
from megatron_rlhf.algorithms.rewards import (
    SCORE_NORMALIZATIONS,
    RunningMoments,
    compute_token_level_rewards,
    normalize_scores,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "KL_PLACEMENTS",
    "LOSS_AGGREGATIONS",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "SCORE_NORMALIZATIONS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "AdvantageFunction",
    "FixedKLController",
    "KLController",
    "KLEstimator",
    "OffPolicyCorrection",
    "OffPolicyFunction",
    "PPOAlgorithmConfig",
    "PolicyLoss",
    "PolicyLossFunction",
    "RunningMoments",
    "aggregate_loss",
    "aggregation_denominator",
    "broadcast_sequence_advantages",
    "build_kl_controller",
    "compute_discounted_returns",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_grpo_outcome_advantages",
    "compute_gspo_policy_loss",
    "compute_kl_loss",
    "compute_policy_loss",
    "compute_reinforce_plus_plus_advantage_return",
    "compute_rloo_outcome_advantages",
    "compute_token_level_rewards",
    "compute_value_loss",
    "critic_free_estimators",
    "entropy_from_logits",
    "get_advantage_estimator",
    "get_kl_estimator",
    "get_off_policy",
    "get_policy_loss",
    "importance_weights",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mean_sequence_kl",
    "normalize_scores",
    "off_policy_metrics",
    "register_advantage_estimator",
    "register_kl_estimator",
    "register_off_policy",
    "register_policy_loss",
]
