"""The policy-loss registry (``algorithm.policy_loss``): ``ppo`` is the token-level clipped loss
bit for bit, ``gspo`` matches a hand computation, a loss registered beside its definition is
selected by the config and used by the actor's loss, and the config refuses an unknown name and
an aggregation a loss does not take."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import (
    LOSS_AGGREGATIONS,
    POLICY_LOSSES,
    PPOAlgorithmConfig,
    aggregate_loss,
    compute_gspo_policy_loss,
    compute_policy_loss,
    get_policy_loss,
    register_policy_loss,
)
from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from tests.algorithms.helpers import (
    LENGTHS,
    actor_loss,
    logprob_loss_fn,
    random_padded,
    response_mask,
)

NAN = float("nan")


def _random_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rng = np.random.default_rng(seed)
    old = random_padded(rng, LENGTHS, loc=-1.5)
    log_prob = (old + random_padded(rng, LENGTHS, scale=0.4)).requires_grad_(True)
    return log_prob, old, random_padded(rng, LENGTHS), response_mask(LENGTHS)


def test_the_built_in_losses_are_registered_and_ppo_is_the_default() -> None:
    assert list(POLICY_LOSSES) == ["ppo", "gspo"]
    assert PPOAlgorithmConfig().policy_loss == "ppo"
    assert POLICY_LOSSES["ppo"].loss_aggregations == LOSS_AGGREGATIONS
    assert POLICY_LOSSES["gspo"].loss_aggregations == ("seq_mean_token_mean",)


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(dual_clip=1.5),
    dict(clip_ratio=0.1, loss_aggregation="seq_mean_token_mean"),
    dict(clip_ratio_low=0.2, clip_ratio_high=0.28, loss_aggregation="seq_mean_token_sum"),
], ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_the_default_loss_is_the_clipped_loss_bit_for_bit(overrides: dict) -> None:
    config = PPOAlgorithmConfig(**overrides)
    log_prob, old, advantages, mask = _random_batch(7)
    loss, metrics = get_policy_loss(config.policy_loss).compute(log_prob, old, advantages, mask,
                                                                config)
    low, high = config.clip_ratios
    want, want_metrics = compute_policy_loss(log_prob, old, advantages, mask, low,
                                             config.dual_clip, config.loss_aggregation, high)
    assert torch.equal(loss, want)
    assert torch.equal(torch.autograd.grad(loss, log_prob)[0],
                       torch.autograd.grad(want, log_prob)[0])
    assert metrics.keys() == want_metrics.keys()
    assert all(torch.equal(metrics[key], want_metrics[key]) for key in metrics)
    assert metrics["pg_clipfrac"] > 0  # the clip bites on these inputs
    engine = actor_loss(config, log_prob, {"response_mask": mask, "old_logprobs": old,
                                            "advantages": advantages})
    assert engine.item() == pytest.approx(want.item(), rel=1e-12)


GSPO_MASK = [[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
GSPO_OLD = [[-1.0, -2.0, -0.5, NAN], [-0.3, -1.2, NAN, NAN]]
GSPO_STEP = [[1.2e-3, 3e-4, 9e-4, NAN], [-5e-4, -3e-4, NAN, NAN]]
"""log_prob - old_log_prob: sequence means 8e-4 and -4e-4 (ratios ~1.0008 and ~0.9996)."""
GSPO_ADVANTAGES = [[1.5, 1.5, 1.5, NAN], [-0.4, -0.6, NAN, NAN]]
"""Sequence advantages 1.5 and -0.5 (the mean of the row's tokens)."""


@pytest.mark.parametrize("low, high, clipped", [(3e-4, 4e-4, [True, True]),
                                                (5e-4, 1e-3, [False, False]),
                                                (5e-4, 4e-4, [True, False])])
def test_gspo_matches_a_hand_computation(low: float, high: float, clipped: list[bool]) -> None:
    """Two responses of 3 and 2 tokens: one sequence ratio per response, clipped at the
    sequence level, the mean over the two responses."""
    mask, old = torch.tensor(GSPO_MASK), torch.tensor(GSPO_OLD, dtype=torch.float64)
    log_prob = (old + torch.tensor(GSPO_STEP, dtype=torch.float64)).requires_grad_(True)
    advantages = torch.tensor(GSPO_ADVANTAGES, dtype=torch.float64)
    loss, metrics = compute_gspo_policy_loss(log_prob, old, advantages, mask, low, high)
    want_losses, want_gradient = [], [[0.0] * 4 for _ in GSPO_MASK]
    for row, length in enumerate([3, 2]):
        steps = [log_prob[row, t].item() - old[row, t].item() for t in range(length)]
        ratio = math.exp(sum(steps) / length)
        advantage = sum(GSPO_ADVANTAGES[row][:length]) / length
        bounded = min(max(ratio, 1 - low), 1 + high)
        want_losses.append(-min(ratio * advantage, bounded * advantage))
        assert (bounded * advantage < ratio * advantage) == clipped[row]
        if not clipped[row]:  # d(-A s / 2 rows)/d logp_t = -A s / (2 * length)
            want_gradient[row][:length] = [-advantage * ratio / (2 * length)] * length
    assert loss.item() == pytest.approx(sum(want_losses) / 2, rel=1e-12)
    torch.testing.assert_close(torch.autograd.grad(loss, log_prob)[0],
                               torch.tensor(want_gradient, dtype=torch.float64),
                               rtol=1e-9, atol=1e-15)
    clipped_tokens = 3 * clipped[0] + 2 * clipped[1]
    assert metrics["pg_clipfrac"].item() == pytest.approx(clipped_tokens / 5)
    assert metrics["pg_clipfrac_dual"].item() == 0.0


def test_gspo_dual_clip_caps_a_negative_advantage_at_the_sequence_level() -> None:
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    old = torch.zeros(1, 3)
    log_prob = torch.tensor([[1.0, 2.0, NAN]])  # sequence ratio e^1.5 ~ 4.48
    advantages = torch.tensor([[-2.0, -2.0, NAN]])
    loss, metrics = compute_gspo_policy_loss(log_prob, old, advantages, mask, 3e-4, 4e-4,
                                             dual_clip=3.0)
    assert loss.item() == pytest.approx(2.0 * 3.0)
    assert metrics["pg_clipfrac_dual"].item() == 1.0
    loss, _ = compute_gspo_policy_loss(log_prob, old, advantages, mask, 3e-4, 4e-4)
    assert loss.item() == pytest.approx(2.0 * math.exp(1.5), rel=1e-6)


def test_gspo_through_the_actor_loss_does_not_depend_on_the_micro_batching() -> None:
    config = PPOAlgorithmConfig(policy_loss="gspo", loss_aggregation="seq_mean_token_mean",
                                gspo_clip_ratio_low=0.05, gspo_clip_ratio_high=0.05)
    log_prob, old, advantages, mask = _random_batch(11)
    want, _ = compute_gspo_policy_loss(log_prob, old, advantages, mask, 0.05, 0.05)
    batch = {"response_mask": mask, "old_logprobs": old, "advantages": advantages}
    assert actor_loss(config, log_prob, batch).item() == pytest.approx(want.item(), rel=1e-12)
    loss_fn, total, count = logprob_loss_fn(config), 0.0, 0
    for rows in (slice(0, 2), slice(2, None)):
        scaled, rows_count, _ = loss_fn(log_prob[rows], {k: v[rows] for k, v in batch.items()})
        total, count = total + scaled, count + rows_count
    assert (total / count).item() == pytest.approx(want.item(), rel=1e-12)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum"])
def test_gspo_refuses_a_token_weighted_aggregation(aggregation: str) -> None:
    with pytest.raises(ValueError, match=rf"algorithm.loss_aggregation\('{aggregation}'\) does "
                                         r"not fit policy_loss\('gspo'\), which takes "
                                         r"\['seq_mean_token_mean'\]"):
        PPOAlgorithmConfig(policy_loss="gspo", loss_aggregation=aggregation)


@pytest.mark.parametrize("field, edge, beyond", [("gspo_clip_ratio_low", 1e-9, 0.0),
                                                 ("gspo_clip_ratio_low", 1 - 1e-9, 1.0),
                                                 ("gspo_clip_ratio_high", 1e-9, 0.0)])
def test_gspo_clip_ranges_are_checked(field: str, edge: float, beyond: float) -> None:
    PPOAlgorithmConfig(**{field: edge})
    with pytest.raises(ValueError, match=rf"algorithm.{field}\({beyond}\) must be"):
        PPOAlgorithmConfig(**{field: beyond})


def test_an_unknown_loss_is_refused_with_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"algorithm.policy_loss\('grpo'\) is unknown; use one "
                                         r"of \['ppo', 'gspo'\]"):
        PPOAlgorithmConfig(policy_loss="grpo")
    with pytest.raises(ValueError, match=r"policy loss 'cispo' is unknown; registered: "
                                         r"\['ppo', 'gspo'\]"):
        get_policy_loss("cispo")
    with pytest.raises(ValueError, match="'gspo' is already registered"):
        register_policy_loss("gspo")(POLICY_LOSSES["ppo"].compute)
    with pytest.raises(ValueError, match=r"must be a non-empty subset of \['token_mean'"):
        register_policy_loss("mine", loss_aggregations=("sum",))


def reinforce_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                   response_mask: torch.Tensor, config: PPOAlgorithmConfig
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A loss none of the built-in ones is: the unclipped policy gradient ``-A * logp``."""
    mask = response_mask.bool()
    per_token = -torch.where(mask, advantages, 0.0) * torch.where(mask, log_prob, 0.0)
    loss = aggregate_loss(per_token, response_mask, config.loss_aggregation)
    return loss, {"pg_loss": loss.detach()}


@pytest.fixture
def registered() -> Iterator[str]:
    register_policy_loss("reinforce", loss_aggregations=("token_mean",))(reinforce_loss)
    yield "reinforce"
    del POLICY_LOSSES["reinforce"]


def test_a_registered_loss_is_selected_by_the_config(registered: str) -> None:
    run = load_config(RunConfig, overrides=[f"algorithm.policy_loss={registered}"])
    assert run.algorithm.policy_loss == registered
    log_prob, old, advantages, mask = _random_batch(3)
    batch = {"response_mask": mask, "old_logprobs": old, "advantages": advantages}
    want, _ = reinforce_loss(log_prob, old, advantages, mask, run.algorithm)
    assert actor_loss(run.algorithm, log_prob, batch).item() == pytest.approx(want.item(),
                                                                               rel=1e-12)
    with pytest.raises(ValueError, match=r"does not fit policy_loss\('reinforce'\)"):
        PPOAlgorithmConfig(policy_loss=registered, loss_aggregation="seq_mean_token_mean")
