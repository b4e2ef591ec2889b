"""Token-level rewards and score normalisation against Python loops and numpy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import RunningMoments, compute_token_level_rewards, normalize_scores
from tests.algorithms.helpers import LENGTHS, WIDTH, random_padded, response_mask


def _reference_rewards(scores, kl, mask, kl_coef, reward_clip):
    rewards = np.zeros(mask.shape)
    for row in range(mask.shape[0]):
        real = [t for t in range(mask.shape[1]) if mask[row, t] == 1]
        for t in real:
            rewards[row, t] = -kl_coef * kl[row, t]
        if real:
            score = scores[row]
            if reward_clip is not None:
                score = min(max(score, -reward_clip), reward_clip)
            rewards[row, real[-1]] += score
    return rewards


@pytest.mark.parametrize("reward_clip", [None, 0.5])
def test_token_level_rewards_right_padded(reward_clip: float | None) -> None:
    rng = np.random.default_rng(4)
    kl = random_padded(rng, LENGTHS)
    scores = torch.from_numpy(rng.normal(0.0, 2.0, size=len(LENGTHS)))
    mask = response_mask(LENGTHS)
    got = compute_token_level_rewards(scores, kl, mask, kl_coef=0.3, reward_clip=reward_clip)
    expected = _reference_rewards(scores.numpy(), kl.numpy(), mask.numpy(), 0.3, reward_clip)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-15)
    if reward_clip is not None:
        assert np.any(np.abs(scores.numpy()) > reward_clip)


def test_token_level_rewards_mask_with_holes_and_empty_row() -> None:
    mask = torch.tensor([[1, 0, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 1]])
    kl = torch.from_numpy(np.random.default_rng(5).normal(size=(3, 6)))
    scores = torch.tensor([1.0, 2.0, -3.0], dtype=torch.float64)
    got = compute_token_level_rewards(scores, kl, mask, kl_coef=0.1)
    expected = _reference_rewards(scores.numpy(), kl.numpy(), mask.numpy(), 0.1, None)
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12)
    assert got[2, 5].item() == pytest.approx(-3.0 - 0.1 * kl[2, 5].item())
    assert torch.all(got[1] == 0)


def test_score_only_on_last_token_with_zero_kl_coef() -> None:
    kl = torch.ones(len(LENGTHS), WIDTH, dtype=torch.float64)
    scores = torch.arange(1.0, len(LENGTHS) + 1, dtype=torch.float64)
    got = compute_token_level_rewards(scores, kl, response_mask(LENGTHS), kl_coef=0.0)
    for row, length in enumerate(LENGTHS):
        expected = [0.0] * WIDTH
        expected[length - 1] = row + 1.0
        assert got[row].tolist() == expected


def test_normalize_none_and_batch() -> None:
    scores = torch.tensor([1.0, 4.0, -2.0, 0.5], dtype=torch.float64)
    assert normalize_scores(scores, "none") is scores
    raw = scores.numpy()
    expected = (raw - raw.mean()) / np.sqrt(raw.var() + 1e-8)
    np.testing.assert_allclose(normalize_scores(scores, "batch").numpy(), expected, rtol=1e-12)
    single = normalize_scores(torch.tensor([3.0]), "batch")
    assert single.item() == 0.0


def test_running_normalisation_matches_numpy_over_history() -> None:
    rng = np.random.default_rng(6)
    batches = [rng.normal(3.0, 2.0, size=n) for n in (1, 7, 4, 16)]
    running = RunningMoments()
    for step, batch in enumerate(batches):
        got = normalize_scores(torch.from_numpy(batch), "running", running)
        history = np.concatenate(batches[: step + 1])
        expected = (batch - history.mean()) / np.sqrt(history.var() + 1e-8)
        np.testing.assert_allclose(got.numpy(), expected, rtol=1e-9, atol=1e-12)
        assert running.count == history.size
        assert running.std == pytest.approx(history.std(), rel=1e-9)


def test_running_moments_resume_from_state_dict() -> None:
    rng = np.random.default_rng(7)
    first, second = torch.from_numpy(rng.normal(size=5)), torch.from_numpy(rng.normal(size=9))
    uninterrupted = RunningMoments()
    uninterrupted.update(first)
    resumed = RunningMoments()
    resumed.load_state_dict(dict(uninterrupted.state_dict()))
    uninterrupted.update(second)
    resumed.update(second)
    assert resumed.state_dict() == uninterrupted.state_dict()


def test_normalize_errors() -> None:
    with pytest.raises(ValueError, match="needs a RunningMoments"):
        normalize_scores(torch.zeros(2), "running")
    with pytest.raises(ValueError, match="'zscore' is unknown"):
        normalize_scores(torch.zeros(2), "zscore")
