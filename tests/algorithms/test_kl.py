"""KL estimators against their formulas and the exact KL; controllers against hand computation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    PPOAlgorithmConfig,
    build_kl_controller,
    kl_penalty,
    mean_sequence_kl,
)
from tests.algorithms.helpers import LENGTHS, WIDTH, random_padded, response_mask

REFERENCE = {
    "k1": lambda lp, ref: lp - ref,
    "k2": lambda lp, ref: 0.5 * (lp - ref) ** 2,
    "k3": lambda lp, ref: math.exp(ref - lp) - (ref - lp) - 1.0,
}


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_estimators_per_token(estimator: str) -> None:
    rng = np.random.default_rng(1)
    log_prob = random_padded(rng, LENGTHS, loc=-2.0)
    ref_log_prob = random_padded(rng, LENGTHS, loc=-2.0)
    kl = kl_penalty(log_prob, ref_log_prob, response_mask(LENGTHS), estimator)
    for row, length in enumerate(LENGTHS):
        for t in range(WIDTH):
            if t < length:
                expected = REFERENCE[estimator](
                    log_prob[row, t].item(), ref_log_prob[row, t].item()
                )
                assert kl[row, t].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)
            else:
                assert kl[row, t].item() == 0.0


def test_k3_is_accurate_for_close_policies() -> None:
    log_prob = torch.tensor([[-1.0]], dtype=torch.float32)
    kl = kl_penalty(log_prob, log_prob + 1e-4, torch.ones(1, 1), "k3")
    # exp(x) - x - 1 = x^2 / 2 + O(x^3): float32 exp(x) - 1 would cancel to noise here.
    assert kl.item() == pytest.approx(0.5e-8, rel=1e-3)


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_unbiased_estimators_against_exact_kl(estimator: str) -> None:
    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.ones(6))
    q = 0.7 * p + 0.3 * rng.dirichlet(np.ones(6))
    exact = float(np.sum(p * np.log(p / q)))
    samples = rng.choice(6, size=400_000, p=p)
    log_prob = torch.from_numpy(np.log(p)[samples]).unsqueeze(0)
    ref_log_prob = torch.from_numpy(np.log(q)[samples]).unsqueeze(0)
    estimate = kl_penalty(log_prob, ref_log_prob, torch.ones_like(log_prob), estimator).mean()
    assert estimate.item() == pytest.approx(exact, rel=0.03)


def test_unknown_estimator_raises() -> None:
    with pytest.raises(ValueError, match="'k4' is unknown"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), "k4")


def test_mean_sequence_kl() -> None:
    rng = np.random.default_rng(3)
    kl = random_padded(rng, LENGTHS)
    expected = np.mean([sum(kl[row, :length].tolist()) for row, length in enumerate(LENGTHS)])
    got = mean_sequence_kl(kl, response_mask(LENGTHS))
    assert got.item() == pytest.approx(expected, rel=1e-12)


def test_adaptive_controller_by_hand() -> None:
    controller = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # 9 / 6 - 1 = 0.5, clipped to 0.2: 0.1 * (1 + 0.2 * 256 / 10000) = 0.100512
    controller.update(current_kl=9.0, n_steps=256)
    assert controller.value == pytest.approx(0.100512, rel=1e-12)
    # 5.4 / 6 - 1 = -0.1: 0.100512 * (1 - 0.1 * 256 / 10000) = 0.10025468928
    controller.update(current_kl=5.4, n_steps=256)
    assert controller.value == pytest.approx(0.10025468928, rel=1e-12)
    controller.update(current_kl=6.0, n_steps=256)
    assert controller.value == pytest.approx(0.10025468928, rel=1e-12)
    # 0 / 6 - 1 = -1, clipped to -0.2: * (1 - 0.2 * 5000 / 10000) = * 0.9
    controller.update(current_kl=0.0, n_steps=5000)
    assert controller.value == pytest.approx(0.090229220352, rel=1e-12)


def test_controller_state_round_trip() -> None:
    trained = AdaptiveKLController(0.2, target=1.0, horizon=100)
    trained.update(current_kl=3.0, n_steps=10)
    restored = AdaptiveKLController(0.2, target=1.0, horizon=100)
    restored.load_state_dict(trained.state_dict())
    assert restored.value == pytest.approx(0.2 * 1.02)
    trained.update(current_kl=0.5, n_steps=10)
    restored.update(current_kl=0.5, n_steps=10)
    assert restored.value == trained.value

    fixed = FixedKLController(0.3)
    fixed.update(current_kl=100.0, n_steps=1000)
    assert fixed.value == 0.3
    other = FixedKLController(0.0)
    other.load_state_dict(fixed.state_dict())
    assert other.value == 0.3


def test_build_kl_controller() -> None:
    fixed = build_kl_controller(PPOAlgorithmConfig(kl_coef=0.05))
    assert isinstance(fixed, FixedKLController) and fixed.value == 0.05
    adaptive = build_kl_controller(
        PPOAlgorithmConfig(kl_coef=0.05, adaptive_kl=True, kl_target=3.0, kl_horizon=500)
    )
    assert isinstance(adaptive, AdaptiveKLController)
    assert (adaptive.value, adaptive.target, adaptive.horizon) == (0.05, 3.0, 500)
