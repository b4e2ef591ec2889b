"""PPO losses against per-token Python references, and their gradients with autograd."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import (
    compute_entropy_loss,
    compute_kl_loss,
    compute_policy_loss,
    compute_value_loss,
    entropy_from_logits,
)
from tests.algorithms.helpers import LENGTHS, random_padded, response_mask

EPS = 0.2
DUAL = 1.5
VALUE_CLIP = 0.3


def _policy_batch(seed: int):
    rng = np.random.default_rng(seed)
    old = random_padded(rng, LENGTHS, loc=-1.5)
    log_prob = (old + random_padded(rng, LENGTHS, scale=0.6)).requires_grad_(True)
    advantages = random_padded(rng, LENGTHS)
    return log_prob, old, advantages


def _reference_policy(log_prob, old, advantages, dual_clip):
    """PPO objective min(r A, clip(r) A) per token, negated; case analysis for the clip flags."""
    losses, clipped, dual, kls = [], [], [], []
    for row, length in enumerate(LENGTHS):
        for t in range(length):
            ratio = math.exp(log_prob[row, t] - old[row, t])
            adv = advantages[row, t]
            loss = -min(ratio * adv, min(max(ratio, 1 - EPS), 1 + EPS) * adv)
            dual_active = dual_clip is not None and adv < 0 and ratio > dual_clip
            losses.append(-dual_clip * adv if dual_active else loss)
            clipped.append((adv > 0 and ratio > 1 + EPS) or (adv < 0 and ratio < 1 - EPS))
            dual.append(dual_active)
            kls.append(ratio - 1 - math.log(ratio))
    return np.mean(losses), np.mean(clipped), np.mean(dual), np.mean(kls), clipped, dual


@pytest.mark.parametrize("dual_clip", [None, DUAL])
def test_policy_loss_matches_reference(dual_clip: float | None) -> None:
    log_prob, old, advantages = _policy_batch(10)
    loss, metrics = compute_policy_loss(
        log_prob, old, advantages, response_mask(LENGTHS), EPS, dual_clip
    )
    lp = log_prob.detach().numpy()
    exp_loss, exp_clip, exp_dual, exp_kl, clipped, dual = _reference_policy(
        lp, old.numpy(), advantages.numpy(), dual_clip
    )
    assert any(clipped) and not all(clipped)
    assert (dual_clip is None) or any(dual)
    assert loss.item() == pytest.approx(exp_loss, rel=1e-12)
    assert metrics["pg_loss"].item() == pytest.approx(exp_loss, rel=1e-12)
    assert metrics["pg_clipfrac"].item() == pytest.approx(exp_clip, rel=1e-12)
    assert metrics["pg_clipfrac_dual"].item() == pytest.approx(exp_dual, abs=1e-12)
    assert metrics["ppo_kl"].item() == pytest.approx(exp_kl, rel=1e-10)
    assert all(value.dim() == 0 and not value.requires_grad for value in metrics.values())


@pytest.mark.parametrize("dual_clip", [None, DUAL])
def test_policy_gradient_is_zero_where_clipped(dual_clip: float | None) -> None:
    log_prob, old, advantages = _policy_batch(11)
    loss, _ = compute_policy_loss(log_prob, old, advantages, response_mask(LENGTHS), EPS, dual_clip)
    (grad,) = torch.autograd.grad(loss, log_prob)
    n_tokens = sum(LENGTHS)
    lp, ref_old, adv = log_prob.detach().numpy(), old.numpy(), advantages.numpy()
    *_, clipped, dual = _reference_policy(lp, ref_old, adv, dual_clip)
    index = 0
    for row, length in enumerate(LENGTHS):
        for t in range(length):
            ratio = math.exp(lp[row, t] - ref_old[row, t])
            if clipped[index] or dual[index]:
                assert grad[row, t].item() == 0.0
            else:
                # d/dlogp of -A * exp(logp - old), averaged over the real tokens.
                expected = -adv[row, t] * ratio / n_tokens
                assert grad[row, t].item() == pytest.approx(expected, rel=1e-10)
            index += 1
        assert torch.all(grad[row, length:] == 0)


def _value_batch(seed: int):
    rng = np.random.default_rng(seed)
    old_values = random_padded(rng, LENGTHS)
    values = (old_values + random_padded(rng, LENGTHS, scale=0.5)).requires_grad_(True)
    returns = random_padded(rng, LENGTHS)
    return values, old_values, returns


def test_value_loss_and_gradient_match_reference() -> None:
    values, old_values, returns = _value_batch(12)
    loss, metrics = compute_value_loss(
        values, old_values, returns, response_mask(LENGTHS), VALUE_CLIP
    )
    (grad,) = torch.autograd.grad(loss, values)
    v, old, ret = values.detach().numpy(), old_values.numpy(), returns.numpy()
    n_tokens = sum(LENGTHS)
    losses, clip_flags = [], []
    for row, length in enumerate(LENGTHS):
        for t in range(length):
            v_clip = old[row, t] + min(max(v[row, t] - old[row, t], -VALUE_CLIP), VALUE_CLIP)
            plain, clipped = (v[row, t] - ret[row, t]) ** 2, (v_clip - ret[row, t]) ** 2
            losses.append(0.5 * max(plain, clipped))
            clip_flags.append(clipped > plain)
            expected_grad = 0.0 if clipped > plain else (v[row, t] - ret[row, t]) / n_tokens
            assert grad[row, t].item() == pytest.approx(expected_grad, rel=1e-10, abs=1e-15)
        assert torch.all(grad[row, length:] == 0)
    assert any(clip_flags) and not all(clip_flags)
    assert loss.item() == pytest.approx(np.mean(losses), rel=1e-12)
    assert metrics["vf_clipfrac"].item() == pytest.approx(np.mean(clip_flags), rel=1e-12)
    assert metrics["vpred_mean"].item() == pytest.approx(
        np.mean([v[r, t] for r, n in enumerate(LENGTHS) for t in range(n)]), rel=1e-12
    )


def test_value_loss_without_clip_is_half_mse() -> None:
    values, old_values, returns = _value_batch(13)
    loss, metrics = compute_value_loss(values, old_values, returns, response_mask(LENGTHS), None)
    errors = [
        (values[row, t].item() - returns[row, t].item()) ** 2
        for row, length in enumerate(LENGTHS)
        for t in range(length)
    ]
    assert loss.item() == pytest.approx(0.5 * np.mean(errors), rel=1e-12)
    assert metrics["vf_clipfrac"].item() == 0.0


def test_entropy_from_logits_and_bonus() -> None:
    rng = np.random.default_rng(14)
    logits = torch.from_numpy(rng.normal(0.0, 3.0, size=(len(LENGTHS), 7, 11)))
    entropy = entropy_from_logits(logits)
    probs = np.exp(logits.numpy()) / np.exp(logits.numpy()).sum(-1, keepdims=True)
    np.testing.assert_allclose(entropy.numpy(), -(probs * np.log(probs)).sum(-1), rtol=1e-10)

    entropy = entropy.masked_fill(response_mask(LENGTHS) == 0, float("nan"))
    loss, metrics = compute_entropy_loss(entropy, response_mask(LENGTHS), entropy_coef=0.01)
    real = [entropy[row, t].item() for row, length in enumerate(LENGTHS) for t in range(length)]
    assert metrics["entropy"].item() == pytest.approx(np.mean(real), rel=1e-12)
    assert loss.item() == pytest.approx(-0.01 * np.mean(real), rel=1e-12)


def test_entropy_gradient_matches_analytic() -> None:
    rng = np.random.default_rng(15)
    logits = torch.from_numpy(rng.normal(0.0, 2.0, size=(2, 3, 5))).requires_grad_(True)
    (grad,) = torch.autograd.grad(entropy_from_logits(logits).sum(), logits)
    probs = torch.softmax(logits.detach(), dim=-1).numpy()
    entropy = -(probs * np.log(probs)).sum(-1, keepdims=True)
    # dH/dz_j = -p_j * (log p_j + H)
    np.testing.assert_allclose(grad.numpy(), -probs * (np.log(probs) + entropy), rtol=1e-9)


@pytest.mark.parametrize("aggregation", ["seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("dual_clip", [None, DUAL])
def test_policy_loss_sequence_aggregation(aggregation: str, dual_clip: float | None) -> None:
    log_prob, old, advantages = _policy_batch(17)
    mask = response_mask(LENGTHS)
    loss, metrics = compute_policy_loss(
        log_prob, old, advantages, mask, EPS, dual_clip, loss_aggregation=aggregation
    )
    _, token_metrics = compute_policy_loss(log_prob, old, advantages, mask, EPS, dual_clip)
    lp, ref_old, adv = log_prob.detach().numpy(), old.numpy(), advantages.numpy()
    per_row = []
    for row, length in enumerate(LENGTHS):
        row_losses = []
        for t in range(length):
            ratio = math.exp(lp[row, t] - ref_old[row, t])
            a = adv[row, t]
            token = -min(ratio * a, min(max(ratio, 1 - EPS), 1 + EPS) * a)
            if dual_clip is not None and a < 0:
                token = min(token, -dual_clip * a)
            row_losses.append(token)
        reduce = np.mean if aggregation == "seq_mean_token_mean" else np.sum
        per_row.append(reduce(row_losses))
    assert loss.item() == pytest.approx(np.mean(per_row), rel=1e-12)
    assert metrics["pg_loss"].item() == pytest.approx(np.mean(per_row), rel=1e-12)
    # the clip statistics stay token means whatever the loss aggregation
    assert metrics["pg_clipfrac"].item() == token_metrics["pg_clipfrac"].item()


def test_policy_loss_default_is_token_mean_bitwise() -> None:
    log_prob, old, advantages = _policy_batch(18)
    mask = response_mask(LENGTHS)
    default, _ = compute_policy_loss(log_prob, old, advantages, mask, EPS, DUAL)
    explicit, _ = compute_policy_loss(log_prob, old, advantages, mask, EPS, DUAL, "token_mean")
    assert torch.equal(default, explicit)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean"])
def test_kl_loss_value_and_gradient(estimator: str, aggregation: str) -> None:
    rng = np.random.default_rng(19)
    ref = random_padded(rng, LENGTHS, loc=-1.5)
    log_prob = (ref + random_padded(rng, LENGTHS, scale=0.5)).requires_grad_(True)
    loss, metrics = compute_kl_loss(
        log_prob, ref, response_mask(LENGTHS), estimator, loss_aggregation=aggregation
    )
    (grad,) = torch.autograd.grad(loss, log_prob)
    lp, rf = log_prob.detach().numpy(), ref.numpy()
    # value and d/dlogp of each estimator, written out by hand with x = logp - ref
    value = {
        "k1": lambda x: x,
        "k2": lambda x: 0.5 * x * x,
        "k3": lambda x: math.exp(-x) + x - 1.0,
    }[estimator]
    slope = {"k1": lambda x: 1.0, "k2": lambda x: x, "k3": lambda x: 1.0 - math.exp(-x)}[estimator]
    per_row, n_tokens = [], sum(LENGTHS)
    for row, length in enumerate(LENGTHS):
        xs = [lp[row, t] - rf[row, t] for t in range(length)]
        per_row.append([value(x) for x in xs])
        for t, x in enumerate(xs):
            weight = 1 / n_tokens if aggregation == "token_mean" else 1 / (len(LENGTHS) * length)
            assert grad[row, t].item() == pytest.approx(weight * slope(x), rel=1e-9, abs=1e-15)
        assert torch.all(grad[row, length:] == 0)
    if aggregation == "token_mean":
        expected = np.mean([v for row in per_row for v in row])
    else:
        expected = np.mean([np.mean(row) for row in per_row])
    assert loss.item() == pytest.approx(expected, rel=1e-10)
    assert metrics["kl_loss"].item() == loss.item() and not metrics["kl_loss"].requires_grad


def test_kl_loss_is_zero_on_the_reference_and_rejects_unknown_estimator() -> None:
    log_prob = random_padded(np.random.default_rng(20), LENGTHS)
    loss, _ = compute_kl_loss(log_prob, log_prob.clone(), response_mask(LENGTHS))
    assert loss.item() == 0.0
    with pytest.raises(ValueError, match="'k4' is unknown"):
        compute_kl_loss(log_prob, log_prob, response_mask(LENGTHS), "k4")
