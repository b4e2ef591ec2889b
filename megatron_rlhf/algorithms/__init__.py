"""PPO math as pure tensor functions (torch only, no process groups).

Tensors are ``[batch, response_len]`` with a 0/1 ``response_mask``. Map of the files:

- ``hyperparameters.py``: ``PPOAlgorithmConfig``.
- ``masked.py``: masked sum / mean / var / whitening.
- ``kl.py``: k1/k2/k3 KL estimators (``KL_ESTIMATORS``), fixed and adaptive KL controllers.
- ``rewards.py``: score normalisation and clipping, token-level rewards.
- ``advantages.py``: GAE advantages and returns.
- ``losses.py``: clipped policy loss, clipped value loss, entropy bonus.

One experience batch, in order::

    kl = kl_penalty(log_prob, ref_log_prob, mask, cfg.kl_estimator)
    scores = normalize_scores(scores, cfg.reward_norm, running_moments)
    rewards = compute_token_level_rewards(scores, kl, mask, kl_ctl.value, cfg.reward_clip)
    kl_ctl.update(mean_sequence_kl(kl, mask).item(), n_steps=batch_size)
    advantages, returns = compute_gae_advantage_return(rewards, values, mask, cfg.gamma, cfg.lam)
    if cfg.whiten_advantages:
        advantages = masked_whiten(advantages, mask, cfg.whiten_shift_mean)
"""

from __future__ import annotations

from megatron_rlhf.algorithms.advantages import compute_gae_advantage_return
from megatron_rlhf.algorithms.hyperparameters import PPOAlgorithmConfig
from megatron_rlhf.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    build_kl_controller,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_penalty,
    mean_sequence_kl,
)
from megatron_rlhf.algorithms.losses import (
    compute_entropy_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
)
from megatron_rlhf.algorithms.masked import masked_mean, masked_sum, masked_var, masked_whiten
from megatron_rlhf.algorithms.rewards import (
    SCORE_NORMALIZATIONS,
    RunningMoments,
    compute_token_level_rewards,
    normalize_scores,
)

__all__ = [
    "KL_ESTIMATORS",
    "SCORE_NORMALIZATIONS",
    "AdaptiveKLController",
    "FixedKLController",
    "KLController",
    "PPOAlgorithmConfig",
    "RunningMoments",
    "build_kl_controller",
    "compute_entropy_loss",
    "compute_gae_advantage_return",
    "compute_policy_loss",
    "compute_token_level_rewards",
    "compute_value_loss",
    "entropy_from_logits",
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
]
