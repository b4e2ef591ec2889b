"""GAE and REINFORCE++ against per-sequence Python loops over the real tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import (
    compute_discounted_returns,
    compute_gae_advantage_return,
    compute_reinforce_plus_plus_advantage_return,
    compute_token_level_rewards,
    kl_penalty,
)
from tests.algorithms.helpers import LENGTHS, random_padded, real_tokens, response_mask


def _reference_gae(rewards: list[float], values: list[float], gamma: float, lam: float):
    """Textbook GAE for one episode: the value after the last step is 0."""
    n = len(rewards)
    deltas = [
        rewards[t] + gamma * (values[t + 1] if t + 1 < n else 0.0) - values[t] for t in range(n)
    ]
    advantages = []
    for t in range(n):
        advantages.append(sum((gamma * lam) ** k * deltas[t + k] for k in range(n - t)))
    return advantages, [a + v for a, v in zip(advantages, values, strict=True)]


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.7), (0.99, 1.0), (0.5, 0.0)])
def test_gae_right_padded(gamma: float, lam: float) -> None:
    rng = np.random.default_rng(8)
    rewards, values = random_padded(rng, LENGTHS), random_padded(rng, LENGTHS)
    advantages, returns = compute_gae_advantage_return(
        rewards, values, response_mask(LENGTHS), gamma, lam
    )
    for row, length in enumerate(LENGTHS):
        exp_adv, exp_ret = _reference_gae(
            rewards[row, :length].tolist(), values[row, :length].tolist(), gamma, lam
        )
        np.testing.assert_allclose(advantages[row, :length].numpy(), exp_adv, rtol=1e-10)
        np.testing.assert_allclose(returns[row, :length].numpy(), exp_ret, rtol=1e-10)
        assert torch.all(advantages[row, length:] == 0) and torch.all(returns[row, length:] == 0)


def test_length_one_response_is_reward_minus_value() -> None:
    rewards = torch.tensor([[2.0, float("nan")]], dtype=torch.float64)
    values = torch.tensor([[0.5, float("nan")]], dtype=torch.float64)
    advantages, returns = compute_gae_advantage_return(
        rewards, values, torch.tensor([[1, 0]]), gamma=0.9, lam=0.8
    )
    assert advantages.tolist() == [[1.5, 0.0]]
    assert returns.tolist() == [[2.0, 0.0]]


def test_monte_carlo_limit_by_hand() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.25, 0.75]])
    advantages, returns = compute_gae_advantage_return(rewards, values, torch.ones(1, 3), 1.0, 1.0)
    # gamma = lam = 1: A_t = sum of future rewards - V_t, returns = 1 everywhere.
    assert advantages.tolist() == [[0.5, 0.75, 0.25]]
    assert returns.tolist() == [[1.0, 1.0, 1.0]]


def test_mask_with_holes_skips_masked_tokens() -> None:
    rng = np.random.default_rng(9)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [0, 1, 0, 1, 0, 1, 1]])
    rewards = torch.from_numpy(rng.normal(size=(2, 7)))
    values = torch.from_numpy(rng.normal(size=(2, 7)))
    advantages, _ = compute_gae_advantage_return(rewards, values, mask, gamma=0.95, lam=0.9)
    for row in range(2):
        real = mask[row].nonzero().flatten().tolist()
        exp_adv, _ = _reference_gae(
            rewards[row, real].tolist(), values[row, real].tolist(), 0.95, 0.9
        )
        np.testing.assert_allclose(advantages[row, real].numpy(), exp_adv, rtol=1e-10)
        assert torch.all(advantages[row][mask[row] == 0] == 0)


def test_outputs_are_detached() -> None:
    values = torch.randn(2, 3, requires_grad=True)
    advantages, returns = compute_gae_advantage_return(
        torch.randn(2, 3), values, torch.ones(2, 3), 1.0, 0.95
    )
    assert not advantages.requires_grad and not returns.requires_grad


def _reference_reinforce_pp(scores, kl, lengths, kl_coef, gamma, eps=1e-8):
    """Per-token rewards, returns by a backward loop per row, whitened over all real tokens."""
    returns = []
    for score, row_kl, length in zip(scores, kl, lengths, strict=True):
        rewards = [-kl_coef * row_kl[t] for t in range(length)]
        rewards[-1] += score
        row, running = [0.0] * length, 0.0
        for t in reversed(range(length)):
            running = rewards[t] + gamma * running
            row[t] = running
        returns.append(row)
    flat = np.concatenate(returns)
    mean, std = flat.mean(), np.sqrt(flat.var(ddof=1) + eps)
    return [[(g - mean) / std for g in row] for row in returns], returns


@pytest.mark.parametrize("gamma, kl_coef", [(1.0, 0.0), (0.9, 0.05), (0.5, 0.3)])
def test_reinforce_plus_plus_matches_numpy_loop(gamma: float, kl_coef: float) -> None:
    rng = np.random.default_rng(60)
    log_prob = random_padded(rng, LENGTHS, loc=-2.0)
    ref_log_prob = random_padded(rng, LENGTHS, loc=-2.0)
    scores = torch.from_numpy(rng.normal(size=len(LENGTHS)))
    mask = response_mask(LENGTHS)
    kl = kl_penalty(log_prob, ref_log_prob, mask, "k1")
    rewards = compute_token_level_rewards(scores, kl, mask, kl_coef)
    advantages, returns = compute_reinforce_plus_plus_advantage_return(rewards, mask, gamma)
    exp_adv, exp_ret = _reference_reinforce_pp(
        scores.tolist(), real_tokens(kl, LENGTHS), LENGTHS, kl_coef, gamma
    )
    for row, length in enumerate(LENGTHS):
        np.testing.assert_allclose(returns[row, :length].numpy(), exp_ret[row], rtol=1e-10)
        np.testing.assert_allclose(advantages[row, :length].numpy(), exp_adv[row], rtol=1e-9)
        assert torch.all(advantages[row, length:] == 0) and torch.all(returns[row, length:] == 0)


def test_discounted_returns_by_hand_with_length_one_and_holes() -> None:
    rewards = torch.tensor([[1.0, 2.0, 4.0], [3.0, 7.0, 7.0], [1.0, 9.0, 2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 1]])
    got = compute_discounted_returns(rewards, mask, gamma=0.5)
    # row 0: 4, 2 + 2, 1 + 2; row 1: one token; row 2: the hole is skipped, 1 + 0.5 * 2
    assert got.tolist() == [[3.0, 4.0, 4.0], [3.0, 0.0, 0.0], [2.0, 0.0, 2.0]]


def test_reinforce_plus_plus_equal_scores_no_kl_gamma_one_is_zero() -> None:
    # Every token's return is the shared score: the batch-whitened advantage is 0 everywhere.
    mask = response_mask(LENGTHS)
    rewards = compute_token_level_rewards(
        torch.full((len(LENGTHS),), 0.5, dtype=torch.float64), torch.zeros_like(mask), mask, 0.0
    )
    advantages, returns = compute_reinforce_plus_plus_advantage_return(rewards, mask, gamma=1.0)
    assert torch.all(advantages == 0)
    assert torch.all(returns[mask.bool()] == 0.5)


def test_reinforce_plus_plus_needs_two_tokens() -> None:
    with pytest.raises(ValueError, match="at least 2 unmasked tokens, got 1"):
        compute_reinforce_plus_plus_advantage_return(
            torch.tensor([[1.0, 0.0]]), torch.tensor([[1, 0]]), gamma=1.0
        )
