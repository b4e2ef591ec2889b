"""The off-policy corrections (``algorithm.off_policy``): ``decoupled`` with the behaviour equal
to the proximal policy is ``none`` bit for bit, ``decoupled`` and ``truncated_is`` match a hand
computation token by token, through the actor's loss too, their metrics match one, and bad
configs and missing log-probs are refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import (
    LOSS_AGGREGATIONS,
    OFF_POLICY_CORRECTIONS,
    PPOAlgorithmConfig,
    get_off_policy,
    get_policy_loss,
    off_policy_metrics,
)
from tests.algorithms.helpers import (
    LENGTHS,
    actor_loss,
    random_padded,
    real_tokens,
    response_mask,
)


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """Log-probs of the trained, proximal and behaviour policies a little apart, advantages."""
    rng = np.random.default_rng(seed)
    behaviour = random_padded(rng, LENGTHS, loc=-1.5)
    proximal = behaviour + random_padded(rng, LENGTHS, scale=0.5)
    log_prob = (proximal + random_padded(rng, LENGTHS, scale=0.3)).requires_grad_(True)
    return {"log_prob": log_prob, "gen_logprobs": behaviour, "proximal_logprobs": proximal,
            "old_logprobs": proximal + random_padded(rng, LENGTHS, scale=0.1),
            "advantages": random_padded(rng, LENGTHS), "response_mask": response_mask(LENGTHS)}


def _loss(config: PPOAlgorithmConfig, batch: dict[str, torch.Tensor]
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    anchor, weights = get_off_policy(config.off_policy).compute(
        batch["old_logprobs"], batch["gen_logprobs"], batch["proximal_logprobs"],
        batch["response_mask"], config)
    return get_policy_loss(config.policy_loss).compute(
        batch["log_prob"], anchor, batch["advantages"], batch["response_mask"], config,
        token_weights=weights)


def test_the_corrections_are_registered_and_none_is_the_default() -> None:
    assert list(OFF_POLICY_CORRECTIONS) == ["none", "decoupled", "truncated_is"]
    assert PPOAlgorithmConfig().off_policy == "none"
    assert [entry.needs_proximal for entry in OFF_POLICY_CORRECTIONS.values()] == [
        False, True, True]


@pytest.mark.parametrize("policy_loss,aggregation", [
    *(("ppo", mode) for mode in LOSS_AGGREGATIONS), ("gspo", "seq_mean_token_mean")])
def test_decoupled_with_behaviour_equal_to_proximal_is_none_bit_for_bit(
        policy_loss: str, aggregation: str) -> None:
    batch = _batch(0)
    batch["gen_logprobs"] = batch["proximal_logprobs"] = batch["old_logprobs"]
    results = {}
    for name in ("none", "decoupled", "truncated_is"):
        batch["log_prob"].grad = None
        config = PPOAlgorithmConfig(off_policy=name, policy_loss=policy_loss,
                                    loss_aggregation=aggregation, dual_clip=3.0)
        loss, metrics = _loss(config, batch)
        loss.backward()
        results[name] = (loss.detach(), metrics, batch["log_prob"].grad.clone())
    for name in ("decoupled", "truncated_is"):
        loss, metrics, grad = results[name]
        assert torch.equal(loss, results["none"][0])
        assert torch.equal(torch.nan_to_num(grad), torch.nan_to_num(results["none"][2]))
        assert all(torch.equal(value, results["none"][1][key]) for key, value in metrics.items())


def _by_hand(batch: dict[str, torch.Tensor], cap: float | None, clip: float = 0.2
             ) -> tuple[float, list[float]]:
    """Token-mean decoupled loss and the token weights, one float at a time."""
    losses, weights = [], []
    rows = zip(*(real_tokens(batch[key].detach(), LENGTHS) for key in (
        "log_prob", "proximal_logprobs", "gen_logprobs", "advantages")), strict=True)
    for log_prob, proximal, behaviour, advantages in rows:
        for lp, prox, beh, adv in zip(log_prob, proximal, behaviour, advantages, strict=True):
            ratio = math.exp(lp - prox)
            weight = math.exp(prox - beh)
            weight = min(weight, cap) if cap is not None else weight
            clipped = min(max(ratio, 1 - clip), 1 + clip)
            losses.append(weight * max(-adv * ratio, -adv * clipped))
            weights.append(weight)
    return sum(losses) / len(losses), weights


@pytest.mark.parametrize("name,cap", [("decoupled", None), ("truncated_is", 1.3)])
def test_the_corrected_loss_matches_a_hand_computation(name: str, cap: float | None) -> None:
    batch = _batch(1)
    config = PPOAlgorithmConfig(off_policy=name, off_policy_cap=cap or 2.0)
    expected, weights = _by_hand(batch, cap)
    if cap is not None:
        assert any(weight == cap for weight in weights), "the cap must bind somewhere"
    loss, _ = _loss(config, batch)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # The actor's loss reads the same fields from the batch and gives the same number.
    fields = {key: value for key, value in batch.items() if key != "log_prob"}
    assert actor_loss(config, batch["log_prob"], fields).item() == pytest.approx(expected,
                                                                                 rel=1e-12)


def test_the_weight_carries_no_gradient_and_scales_each_tokens_one() -> None:
    batch = _batch(2)
    grads = {}
    for name in ("none", "decoupled"):
        batch["log_prob"].grad = None
        # "none" against the proximal policy: the two differ by the weight alone.
        config = PPOAlgorithmConfig(off_policy=name, loss_aggregation="seq_mean_token_sum")
        fields = {**batch, "old_logprobs": batch["proximal_logprobs"]}
        _loss(config, fields)[0].backward()
        grads[name] = batch["log_prob"].grad.clone()
    mask = batch["response_mask"].bool()
    weights = torch.exp(batch["proximal_logprobs"] - batch["gen_logprobs"])
    torch.testing.assert_close(grads["decoupled"][mask], (weights * grads["none"])[mask],
                               rtol=1e-12, atol=0)


def test_the_metrics_match_a_hand_computation() -> None:
    batch = _batch(3)
    _, weights = _by_hand(batch, None)
    gaps = [abs(prox - beh) for proximal, behaviour in zip(
        real_tokens(batch["proximal_logprobs"], LENGTHS),
        real_tokens(batch["gen_logprobs"], LENGTHS), strict=True)
        for prox, beh in zip(proximal, behaviour, strict=True)]
    metrics = off_policy_metrics(batch["gen_logprobs"], batch["proximal_logprobs"],
                                 batch["response_mask"], cap=1.2)
    assert metrics["off_policy/weight_mean"] == pytest.approx(sum(weights) / len(weights))
    assert metrics["off_policy/weight_max"] == pytest.approx(max(weights))
    assert metrics["off_policy/weight_clipfrac"] == pytest.approx(
        sum(weight > 1.2 for weight in weights) / len(weights))
    assert metrics["off_policy/logprob_gap"] == pytest.approx(sum(gaps) / len(gaps))
    uncapped = off_policy_metrics(batch["gen_logprobs"], batch["proximal_logprobs"],
                                  batch["response_mask"], cap=None)
    assert uncapped["off_policy/weight_clipfrac"] == 0.0


def test_bad_settings_and_missing_log_probs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"algorithm\.off_policy\('tis'\) is unknown.*"
                                         r"truncated_is"):
        PPOAlgorithmConfig(off_policy="tis")
    with pytest.raises(ValueError, match=r"off_policy_cap\(0\.5\) must be a finite number >= 1"):
        PPOAlgorithmConfig(off_policy="truncated_is", off_policy_cap=0.5)
    batch = _batch(4)
    with pytest.raises(ValueError, match="proximal_logprobs"):
        get_off_policy("decoupled").compute(batch["old_logprobs"], batch["gen_logprobs"], None,
                                            batch["response_mask"], PPOAlgorithmConfig())
