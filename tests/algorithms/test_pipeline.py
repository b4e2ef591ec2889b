"""The experience-to-loss flow of the package docstring, end to end on one padded batch."""

from __future__ import annotations

import numpy as np
import torch

from megatron_rlhf.algorithms import (
    PPOAlgorithmConfig,
    RunningMoments,
    broadcast_sequence_advantages,
    build_kl_controller,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantages,
    compute_kl_loss,
    compute_policy_loss,
    compute_token_level_rewards,
    compute_value_loss,
    kl_penalty,
    masked_whiten,
    mean_sequence_kl,
    normalize_scores,
)
from tests.algorithms.helpers import LENGTHS, random_padded, response_mask


def test_flow_gives_finite_losses_and_gradients() -> None:
    cfg = PPOAlgorithmConfig(
        kl_estimator="k3", adaptive_kl=True, reward_norm="running", reward_clip=2.0, dual_clip=3.0
    )
    rng = np.random.default_rng(16)
    mask = response_mask(LENGTHS)
    log_prob = random_padded(rng, LENGTHS, loc=-2.0).requires_grad_(True)
    old_log_prob = log_prob.detach() + random_padded(rng, LENGTHS, scale=0.1)
    ref_log_prob = old_log_prob + random_padded(rng, LENGTHS, scale=0.3)
    values = random_padded(rng, LENGTHS).requires_grad_(True)
    old_values = values.detach()
    scores = torch.from_numpy(rng.normal(size=len(LENGTHS)))
    kl_ctl = build_kl_controller(cfg)

    kl = kl_penalty(old_log_prob, ref_log_prob, mask, cfg.kl_estimator)
    scores = normalize_scores(scores, cfg.reward_norm, RunningMoments())
    rewards = compute_token_level_rewards(scores, kl, mask, kl_ctl.value, cfg.reward_clip)
    kl_ctl.update(mean_sequence_kl(kl, mask).item(), n_steps=len(LENGTHS))
    advantages, returns = compute_gae_advantage_return(
        rewards, old_values, mask, cfg.gamma, cfg.lam
    )
    advantages = masked_whiten(advantages, mask, cfg.whiten_shift_mean)
    pg_loss, _ = compute_policy_loss(
        log_prob, old_log_prob, advantages, mask, cfg.clip_ratio, cfg.dual_clip
    )
    vf_loss, _ = compute_value_loss(values, old_values, returns, mask, cfg.value_clip)
    (pg_loss + cfg.value_loss_coef * vf_loss).backward()

    assert torch.isfinite(pg_loss) and torch.isfinite(vf_loss)
    assert torch.isfinite(log_prob.grad).all() and torch.isfinite(values.grad).all()
    assert kl_ctl.value != cfg.kl_coef


def test_grpo_flow_with_kl_loss_gives_finite_loss_and_gradient() -> None:
    cfg = PPOAlgorithmConfig(
        advantage_estimator="grpo", kl_in="loss", loss_aggregation="seq_mean_token_mean"
    )
    group_size, lengths = 3, LENGTHS  # two prompts, three responses each
    rng = np.random.default_rng(17)
    mask = response_mask(lengths)
    log_prob = random_padded(rng, lengths, loc=-2.0).requires_grad_(True)
    old_log_prob = log_prob.detach() + random_padded(rng, lengths, scale=0.1)
    ref_log_prob = old_log_prob + random_padded(rng, lengths, scale=0.3)
    scores = torch.from_numpy(rng.normal(size=len(lengths)))

    assert not cfg.uses_critic and build_kl_controller(cfg).value == 0.0
    sequence_advantages = compute_grpo_outcome_advantages(
        scores, group_size, cfg.grpo_std_normalize
    )
    advantages = broadcast_sequence_advantages(sequence_advantages, mask)
    pg_loss, _ = compute_policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        mask,
        cfg.clip_ratio,
        cfg.dual_clip,
        cfg.loss_aggregation,
    )
    kl_loss, _ = compute_kl_loss(
        log_prob, ref_log_prob, mask, cfg.kl_loss_estimator, cfg.loss_aggregation
    )
    (pg_loss + cfg.kl_loss_coef * kl_loss).backward()
    assert torch.isfinite(pg_loss) and torch.isfinite(kl_loss) and kl_loss > 0
    assert torch.isfinite(log_prob.grad).all()
