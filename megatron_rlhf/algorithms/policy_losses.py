"""The registry of policy losses that ``algorithm.policy_loss`` names: PPO's clipped surrogate
(``ppo``, the default) and GSPO's sequence-level one (``gspo``).

A policy loss is one function registered where it is defined, with the loss aggregations it
makes sense under; the config's allowed values and its aggregation check read the registry::

    @register_policy_loss("my_loss", loss_aggregations=("token_mean",))
    def my_loss(log_prob, old_log_prob, advantages, response_mask, config, token_weights=None):
        ...  # [batch, response_len] each in; (0-dim pg_loss, metrics) out
        return pg_loss, {"pg_loss": pg_loss.detach(), ...}

GSPO (Zheng et al., 2025, "Group Sequence Policy Optimization") clips one importance ratio per
response, the geometric mean of its token ratios,
``s_i = exp(mean_t (log_prob - old_log_prob))``, in ``[1 - eps_low, 1 + eps_high]`` with the
response's advantage ``A_i``; its objective is the mean over responses of
``min(s_i A_i, clip(s_i) A_i)``. Its clip ranges are a few 1e-4 (the paper: 3e-4 and 4e-4), as a
length-normalised ratio moves far less than a token's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_rlhf.algorithms.aggregation import LOSS_AGGREGATIONS, aggregate_loss
from megatron_rlhf.algorithms.kl import kl_k3
from megatron_rlhf.algorithms.losses import (
    _MAX_LOG_RATIO,
    clipped_surrogate,
    compute_policy_loss,
)
from megatron_rlhf.algorithms.masked import masked_mean
from megatron_rlhf.algorithms.registry import Registry

if TYPE_CHECKING:
    from megatron_rlhf.algorithms.hyperparameters import PPOAlgorithmConfig


class PolicyLossFunction(Protocol):
    """The signature of a registered policy loss."""

    def __call__(self, log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                 advantages: torch.Tensor, response_mask: torch.Tensor,
                 config: PPOAlgorithmConfig, token_weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(pg_loss, metrics)`` of one (micro-)batch.

        Args:
            log_prob: ``[batch, response_len]`` log-probs under the policy being trained (with
                grad).
            old_log_prob: ``[batch, response_len]`` log-probs under the policy that sampled.
            advantages: ``[batch, response_len]`` advantages.
            response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
            config: the algorithm's settings (clip ranges, ``loss_aggregation``, ...).
            token_weights: ``[batch, response_len]`` detached weights of the per-token losses
                (``algorithm.off_policy``, ``off_policy.py``); None: all 1.

        Returns:
            The 0-dim loss, reduced with ``config.loss_aggregation``, and detached 0-dim metrics
            ``pg_loss``, ``pg_clipfrac``, ``pg_clipfrac_dual`` and ``ppo_kl``.
        """


@dataclass(frozen=True)
class PolicyLoss:
    """A registered policy loss.

    Attributes:
        name: its ``algorithm.policy_loss`` value.
        compute: the function (``PolicyLossFunction``).
        loss_aggregations: the ``algorithm.loss_aggregation`` values it accepts.
    """

    name: str
    compute: PolicyLossFunction
    loss_aggregations: tuple[str, ...]


POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss",
                                               lambda loss: loss.compute.__qualname__)
"""Name -> policy loss, filled by ``register_policy_loss`` where each is defined."""


def register_policy_loss(name: str, *, loss_aggregations: tuple[str, ...] = LOSS_AGGREGATIONS
                         ) -> Callable[[PolicyLossFunction], PolicyLossFunction]:
    """Decorator that registers a ``PolicyLossFunction`` as ``algorithm.policy_loss=name``.

    Args:
        name: the config value that selects it.
        loss_aggregations: the ``LOSS_AGGREGATIONS`` it makes sense under (all by default).

    Raises:
        ValueError: ``name`` is already registered, or an aggregation is unknown.
    """
    unknown = [mode for mode in loss_aggregations if mode not in LOSS_AGGREGATIONS]
    if unknown or not loss_aggregations:
        raise ValueError(f"policy loss {name!r}: loss_aggregations {list(loss_aggregations)} "
                         f"must be a non-empty subset of {list(LOSS_AGGREGATIONS)}")

    def register(compute: PolicyLossFunction) -> PolicyLossFunction:
        POLICY_LOSSES.add(name, PolicyLoss(name, compute, tuple(loss_aggregations)))
        return compute

    return register


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``.

    Raises:
        ValueError: no policy loss has that name; the message lists the registered ones.
    """
    return POLICY_LOSSES.lookup(name)


def compute_gspo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip: float | None = None,
    loss_aggregation: str = "seq_mean_token_mean",
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's clipped surrogate objective with one importance ratio per response.

    Per response ``i``, with ``s_i = exp(mean over its response tokens of (log_prob -
    old_log_prob))`` and ``A_i`` the mean of its tokens' advantages (exactly the advantage of
    the outcome estimators, which give every token of a response the same one)::

        loss_i = max(-A_i * s_i, -A_i * clip(s_i, 1 - clip_ratio_low, 1 + clip_ratio_high))

    capped at ``-A_i * dual_clip`` for ``A_i < 0`` with dual clipping, as the token-level loss.
    ``loss_i`` stands on each of the response's tokens before ``aggregate_loss``, so
    ``seq_mean_token_mean`` gives the paper's mean over responses.

    Args:
        log_prob: ``[batch, response_len]`` log-probs under the policy being trained (with grad).
        old_log_prob: ``[batch, response_len]`` log-probs under the policy that sampled.
        advantages: ``[batch, response_len]`` advantages.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        clip_ratio_low: clip range of the sequence ratio below 1 (the paper: 3e-4).
        clip_ratio_high: clip range of the sequence ratio above 1 (the paper: 4e-4).
        dual_clip: Lower bound ``c > 1`` of the dual clip; ``None`` disables it.
        loss_aggregation: one of ``LOSS_AGGREGATIONS``; GSPO is registered for
            ``seq_mean_token_mean`` only.
        token_weights: ``[batch, response_len]`` detached weights of the per-token losses
            after the response's loss stands on each token (an off-policy correction); None:
            all 1.

    Returns:
        ``(pg_loss, metrics)``: the 0-dim loss and detached 0-dim metrics ``pg_loss``,
        ``pg_clipfrac`` and ``pg_clipfrac_dual`` (fractions of the response tokens whose response
        is clipped) and ``ppo_kl`` (token-level k3 estimate of KL(old || current)).
    """
    mask = response_mask.bool()
    # Zeroing padding before any arithmetic keeps garbage there out of the gradients (0 * nan).
    token_log_ratio = torch.where(mask, log_prob - old_log_prob, 0.0)
    seq_log_ratio = masked_mean(token_log_ratio, response_mask, dim=-1)
    seq_log_ratio = seq_log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    seq_advantages = masked_mean(torch.where(mask, advantages, 0.0), response_mask, dim=-1)
    seq_losses, clip_active, dual_active = clipped_surrogate(
        torch.exp(seq_log_ratio), seq_advantages, clip_ratio_low, clip_ratio_high, dual_clip)
    pg_losses = seq_losses[:, None].expand_as(token_log_ratio)
    if token_weights is not None:
        pg_losses = pg_losses * token_weights
    pg_loss = aggregate_loss(pg_losses, response_mask, loss_aggregation)
    dtype = pg_losses.dtype

    def token_fraction(per_sequence: torch.Tensor) -> torch.Tensor:
        return masked_mean(per_sequence[:, None].to(dtype).expand_as(pg_losses), response_mask)

    metrics = {
        "pg_loss": pg_loss.detach(),
        "pg_clipfrac": token_fraction(clip_active).detach(),
        "pg_clipfrac_dual": token_fraction(dual_active).detach(),
        "ppo_kl": masked_mean(kl_k3(old_log_prob, log_prob.detach()), response_mask).detach(),
    }
    return pg_loss, metrics


@register_policy_loss("ppo")
def ppo_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                    advantages: torch.Tensor, response_mask: torch.Tensor,
                    config: PPOAlgorithmConfig, token_weights: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's token-level clipped surrogate (``compute_policy_loss``) with ``clip_ratio_low`` /
    ``clip_ratio_high`` and ``dual_clip``; under every aggregation."""
    low, high = config.clip_ratios
    return compute_policy_loss(log_prob, old_log_prob, advantages, response_mask, low,
                               config.dual_clip, config.loss_aggregation, high, token_weights)


@register_policy_loss("gspo", loss_aggregations=("seq_mean_token_mean",))
def gspo_policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                     advantages: torch.Tensor, response_mask: torch.Tensor,
                     config: PPOAlgorithmConfig, token_weights: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO's sequence-level clipped surrogate (``compute_gspo_policy_loss``) with
    ``gspo_clip_ratio_low`` / ``gspo_clip_ratio_high`` and ``dual_clip``; its loss is one per
    response, so only ``seq_mean_token_mean`` (each response weighs the same) applies."""
    return compute_gspo_policy_loss(log_prob, old_log_prob, advantages, response_mask,
                                    config.gspo_clip_ratio_low, config.gspo_clip_ratio_high,
                                    config.dual_clip, config.loss_aggregation, token_weights)
