"""PPO losses: clipped surrogate policy loss, KL loss term, clipped value loss, entropy bonus.

The policy and KL losses reduce their per-token values with a selectable aggregation
(``aggregation.py``; ``token_mean`` by default); the value loss and entropy bonus, and every
metric, are masked means over the response tokens of the batch given. Each loss comes with a
small dict of detached 0-dim metric tensors (no host sync). The total actor loss is
``pg_loss + entropy_loss``, plus ``kl_loss_coef * kl_loss`` when the KL is a loss term
(``kl_in="loss"``), plus ``value_loss_coef * vf_loss`` with a shared trunk (AC-Share).
"""

from __future__ import annotations

import torch

from megatron_rlhf.algorithms.aggregation import aggregate_loss
from megatron_rlhf.algorithms.kl import get_kl_estimator, kl_k3
from megatron_rlhf.algorithms.masked import masked_mean

# exp() of a stale or garbage log-ratio overflows and then turns gradients into nan; beyond
# +-20 nats the ratio is clipped anyway in any sane run.
_MAX_LOG_RATIO = 20.0


def compute_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio: float,
    dual_clip: float | None = None,
    loss_aggregation: str = "token_mean",
    clip_ratio_high: float | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate objective of PPO (Schulman et al., 2017), optionally dual-clipped.

    Per token, with ``ratio = exp(log_prob - old_log_prob)``::

        loss = max(-A * ratio, -A * clip(ratio, 1 - clip_ratio, 1 + clip_ratio_high))

    ``clip_ratio_high`` defaults to ``clip_ratio``; a larger one is DAPO's "clip-higher" (Yu et
    al., 2025): low-probability tokens with positive advantages may grow further, which keeps
    the policy's entropy from collapsing.

    and, with dual clipping (Ye et al., 2020), for ``A < 0`` the loss is further capped at
    ``-A * dual_clip`` so a huge ratio on a negative advantage cannot dominate.

    Args:
        log_prob: ``[batch, response_len]`` log-probs under the policy being trained (with grad).
        old_log_prob: ``[batch, response_len]`` log-probs under the policy that sampled.
        advantages: ``[batch, response_len]`` advantages.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        clip_ratio: Clip range ``eps`` of the ratio below 1 (and above, without
            ``clip_ratio_high``).
        dual_clip: Lower bound ``c > 1`` of the dual clip; ``None`` disables it.
        loss_aggregation: How the per-token losses become ``pg_loss``, one of
            ``LOSS_AGGREGATIONS`` (see ``aggregate_loss``); the clip metrics stay token means.
        clip_ratio_high: Clip range of the ratio above 1; ``None``: ``clip_ratio``.
        token_weights: ``[batch, response_len]`` detached weights of the per-token losses
            before aggregation (an off-policy correction, ``off_policy.py``); None: all 1.

    Returns:
        ``(pg_loss, metrics)``: the 0-dim loss and detached 0-dim metrics ``pg_loss``,
        ``pg_clipfrac`` (fraction of tokens where the ratio clip is active), ``pg_clipfrac_dual``
        (fraction where the dual clip is active) and ``ppo_kl`` (k3 estimate of
        KL(old || current), non-negative).
    """
    mask = response_mask.bool()
    # Zeroing padding before any arithmetic keeps garbage there out of the gradients (0 * nan).
    log_ratio = torch.where(mask, log_prob - old_log_prob, 0.0)
    log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    advantages = torch.where(mask, advantages, 0.0)
    high = clip_ratio if clip_ratio_high is None else clip_ratio_high
    pg_losses, clip_active, dual_active = clipped_surrogate(torch.exp(log_ratio), advantages,
                                                            clip_ratio, high, dual_clip)
    if token_weights is not None:
        pg_losses = pg_losses * token_weights
    pg_loss = aggregate_loss(pg_losses, response_mask, loss_aggregation)
    dtype = pg_losses.dtype
    metrics = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": masked_mean(clip_active.to(dtype), response_mask).detach(),
        "pg_clipfrac_dual": masked_mean(dual_active.to(dtype), response_mask).detach(),
        "ppo_kl": masked_mean(kl_k3(old_log_prob, log_prob.detach()), response_mask).detach(),
    }
    return pg_loss, metrics


def clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, clip_low: float,
                      clip_high: float, dual_clip: float | None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate loss, elementwise (per token, or per sequence for GSPO).

    Args:
        ratio: importance ratios; any shape.
        advantages: same shape as ``ratio``.
        clip_low, clip_high: the ratio is clipped to ``[1 - clip_low, 1 + clip_high]``.
        dual_clip: lower bound ``c > 1`` of the dual clip for negative advantages, or None.

    Returns:
        ``(losses, clip_active, dual_active)``: the losses and where each clip is active.
    """
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    losses = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(losses, dtype=torch.bool)
    if dual_clip is not None:
        dual_bound = -advantages * dual_clip
        dual_active = (advantages < 0) & (dual_bound < losses)
        losses = torch.where(dual_active, dual_bound, losses)
    return losses, clipped > unclipped, dual_active


def compute_kl_loss(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k3",
    loss_aggregation: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """KL to the reference policy as a loss term (GRPO, Shao et al. 2024), not a reward penalty.

    The per-token estimate of ``kl_penalty`` (k3 by default:
    ``exp(ref - logp) - (ref - logp) - 1``, non-negative and unbiased), computed on the log-probs
    of the policy being trained so the gradient flows, then aggregated like the policy loss. The
    caller adds ``kl_loss_coef * kl_loss`` to the actor loss.

    Args:
        log_prob: ``[batch, response_len]`` log-probs under the policy being trained (with grad).
        ref_log_prob: ``[batch, response_len]`` log-probs of the same tokens under the reference.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        estimator: A name in ``KL_ESTIMATORS`` (``k1``, ``k2``, ``k3``).
        loss_aggregation: One of ``LOSS_AGGREGATIONS``.

    Returns:
        ``(kl_loss, metrics)``: the 0-dim loss and the detached 0-dim metric ``kl_loss``.

    Raises:
        ValueError: If ``estimator`` or ``loss_aggregation`` is unknown.
    """
    kl_estimate = get_kl_estimator(estimator)
    mask = response_mask.bool()
    # Zeroing padding before any arithmetic keeps garbage there out of the gradients (0 * nan).
    log_prob = torch.where(mask, log_prob, 0.0)
    ref_log_prob = torch.where(mask, ref_log_prob, 0.0)
    per_token = kl_estimate(log_prob, ref_log_prob)
    kl_loss = aggregate_loss(per_token, response_mask, loss_aggregation)
    return kl_loss, {"kl_loss": kl_loss.detach()}


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    value_clip: float | None = None,
    loss_aggregation: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)``.

    ``V_clip = old_values + clip(values - old_values, -value_clip, value_clip)`` keeps the new
    value estimate near the one used to compute the advantages.

    Args:
        values: ``[batch, response_len]`` values from the critic being trained (with grad).
        old_values: ``[batch, response_len]`` values recorded in the experience.
        returns: ``[batch, response_len]`` return targets.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        value_clip: Clip range of the value change; ``None`` gives the plain squared error.
        loss_aggregation: How the per-token losses reduce (``aggregation``); the metrics are
            token means whatever it is.

    Returns:
        ``(vf_loss, metrics)``: the 0-dim loss and detached 0-dim metrics ``vf_loss``,
        ``vf_clipfrac`` (fraction of tokens where the clipped term is selected) and ``vpred_mean``.
    """
    mask = response_mask.bool()
    # Zeroing padding before any arithmetic keeps garbage there out of the gradients (0 * nan).
    values = torch.where(mask, values, 0.0)
    old_values = torch.where(mask, old_values, 0.0)
    returns = torch.where(mask, returns, 0.0)
    unclipped = (values - returns).square()
    if value_clip is None:
        vf_losses = unclipped
        clip_active = torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        values_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped = (values_clipped - returns).square()
        vf_losses = torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    vf_loss = 0.5 * aggregate_loss(vf_losses, response_mask, loss_aggregation)
    metrics = {
        "vf_loss": 0.5 * masked_mean(vf_losses, response_mask).detach(),
        "vf_clipfrac": masked_mean(clip_active.to(vf_losses.dtype), response_mask).detach(),
        "vpred_mean": masked_mean(values, response_mask).detach(),
    }
    return vf_loss, metrics


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the categorical distribution given by ``logits``.

    Args:
        logits: ``[batch, response_len, vocab]`` unnormalised log-probabilities.

    Returns:
        ``[batch, response_len]`` entropy in nats.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(dim=-1)


def compute_entropy_loss(
    entropy: torch.Tensor, response_mask: torch.Tensor, entropy_coef: float,
    loss_aggregation: str = "token_mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Entropy bonus as a loss term, ``-entropy_coef * mean entropy``.

    Args:
        entropy: ``[batch, response_len]`` per-token entropy (see ``entropy_from_logits``).
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        entropy_coef: Weight of the bonus; minimising the loss raises the entropy.
        loss_aggregation: How the per-token entropies reduce in the loss (``aggregation``), so
            that the bonus splits over micro-batches as the policy loss does.

    Returns:
        ``(entropy_loss, metrics)``: the 0-dim loss and the detached 0-dim metric ``entropy``
        (the token mean).
    """
    loss = -entropy_coef * aggregate_loss(entropy, response_mask, loss_aggregation)
    return loss, {"entropy": masked_mean(entropy, response_mask).detach()}
