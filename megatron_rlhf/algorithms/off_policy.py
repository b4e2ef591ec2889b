"""The registry of off-policy corrections that ``algorithm.off_policy`` names: ``none`` (the
default), ``decoupled`` and ``truncated_is``.

Three policies meet in an asynchronous step. The *behaviour* policy sampled the tokens (its
log-probs ``behaviour`` were recorded at sampling, the rollout's ``gen_logprobs``); the
*proximal* policy is the trainer's own before this step's first update (``proximal``, one
forward pass of the actor at the start of the step); the policy being trained gives
``log_prob``. Under synchronous execution behaviour and proximal are the same weights; with
the shadows one or more steps ahead they are not.

- ``none``: PPO's ratio is taken against ``old_log_prob`` (the experience pass's, today's
  behaviour recomputed by the generating model) and no weight multiplies the loss.
- ``decoupled`` (Hilton et al., 2022, "Batch size-invariance for policy optimization"; AReaL,
  Fu et al., 2025): the ratio ``exp(log_prob - proximal)`` is clipped around the proximal
  policy, and each token's loss is multiplied by ``w = exp(proximal - behaviour)``, which
  corrects for the behaviour policy having sampled the token.
- ``truncated_is`` (Yao et al., 2025, "Your efficient RL framework secretly brings you
  off-policy RL training"; verl's and NeMo-RL's TIS): the same, with ``w`` truncated at
  ``algorithm.off_policy_cap``, so a token the behaviour policy found unlikely cannot dominate
  the step.

Each is ``(old_log_prob, behaviour, proximal, response_mask, config) -> (anchor, weights)``:
the log-probs the ratio is taken against, and the per-token weights of the policy loss (None:
all 1). ``weights`` are detached: they correct the sampling distribution and carry no gradient.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_rlhf.algorithms.masked import masked_mean
from megatron_rlhf.algorithms.registry import Registry

if TYPE_CHECKING:
    from megatron_rlhf.algorithms.hyperparameters import PPOAlgorithmConfig

# As the policy losses' ratio: exp() of a garbage log-ratio overflows and poisons gradients.
_MAX_LOG_WEIGHT = 20.0


class OffPolicyFunction(Protocol):
    """The signature of a registered off-policy correction."""

    def __call__(self, old_log_prob: torch.Tensor, behaviour: torch.Tensor | None,
                 proximal: torch.Tensor | None, response_mask: torch.Tensor,
                 config: PPOAlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(anchor, weights)`` of one (micro-)batch.

        Args:
            old_log_prob: ``[batch, response_len]`` the experience pass's log-probs.
            behaviour: ``[batch, response_len]`` log-probs recorded at sampling, or None for a
                correction that does not read them.
            proximal: ``[batch, response_len]`` the trainer's log-probs before the step's first
                update, or None for a correction that does not read them.
            response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
            config: the algorithm's settings (``off_policy_cap``).

        Returns:
            The log-probs PPO's ratio is taken against, and the detached per-token weights of
            the policy loss (1 at padding), or None for none.
        """


@dataclass(frozen=True)
class OffPolicyCorrection:
    """A registered off-policy correction.

    Attributes:
        name: its ``algorithm.off_policy`` value.
        compute: the function (``OffPolicyFunction``).
        needs_proximal: the step computes the trainer's log-probs before its first update
            (one forward pass of the actor over the batch).
    """

    name: str
    compute: OffPolicyFunction
    needs_proximal: bool


OFF_POLICY_CORRECTIONS: Registry[OffPolicyCorrection] = Registry(
    "off-policy correction", lambda entry: entry.compute.__qualname__)
"""Name -> off-policy correction, filled by ``register_off_policy`` where each is defined."""


def register_off_policy(name: str, *, needs_proximal: bool
                        ) -> Callable[[OffPolicyFunction], OffPolicyFunction]:
    """Decorator that registers an ``OffPolicyFunction`` as ``algorithm.off_policy=name``.

    Raises:
        ValueError: ``name`` is already registered.
    """
    def register(compute: OffPolicyFunction) -> OffPolicyFunction:
        OFF_POLICY_CORRECTIONS.add(name, OffPolicyCorrection(name, compute, needs_proximal))
        return compute

    return register


def get_off_policy(name: str) -> OffPolicyCorrection:
    """The off-policy correction registered as ``name``.

    Raises:
        ValueError: none has that name; the message lists the registered ones.
    """
    return OFF_POLICY_CORRECTIONS.lookup(name)


def importance_weights(behaviour: torch.Tensor, proximal: torch.Tensor,
                       response_mask: torch.Tensor) -> torch.Tensor:
    """``exp(proximal - behaviour)`` per token, 1 at padding, detached.

    Args:
        behaviour: ``[batch, response_len]`` log-probs recorded at sampling.
        proximal: ``[batch, response_len]`` the trainer's log-probs before the update.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
    """
    log_weight = torch.where(response_mask.bool(), proximal - behaviour, 0.0)
    return torch.exp(log_weight.clamp(-_MAX_LOG_WEIGHT, _MAX_LOG_WEIGHT)).detach()


def _require_both(name: str, behaviour: torch.Tensor | None,
                  proximal: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    if behaviour is None or proximal is None:
        raise ValueError(f"algorithm.off_policy={name!r} needs the behaviour log-probs "
                         "(gen_logprobs) and the proximal ones (proximal_logprobs) in the "
                         "batch; the step computes the latter when needs_proximal is set")
    return behaviour, proximal


@register_off_policy("none", needs_proximal=False)
def no_correction(old_log_prob: torch.Tensor, behaviour: torch.Tensor | None,
                  proximal: torch.Tensor | None, response_mask: torch.Tensor,
                  config: PPOAlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PPO as on-policy: the ratio against ``old_log_prob``, no weights."""
    return old_log_prob, None


@register_off_policy("decoupled", needs_proximal=True)
def decoupled_correction(old_log_prob: torch.Tensor, behaviour: torch.Tensor | None,
                         proximal: torch.Tensor | None, response_mask: torch.Tensor,
                         config: PPOAlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decoupled PPO: clip around the proximal policy, weight ``exp(proximal - behaviour)``."""
    behaviour, proximal = _require_both("decoupled", behaviour, proximal)
    return proximal, importance_weights(behaviour, proximal, response_mask)


@register_off_policy("truncated_is", needs_proximal=True)
def truncated_is_correction(old_log_prob: torch.Tensor, behaviour: torch.Tensor | None,
                            proximal: torch.Tensor | None, response_mask: torch.Tensor,
                            config: PPOAlgorithmConfig
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Truncated importance sampling: as ``decoupled`` with ``w`` capped at
    ``config.off_policy_cap``."""
    behaviour, proximal = _require_both("truncated_is", behaviour, proximal)
    weights = importance_weights(behaviour, proximal, response_mask)
    return proximal, weights.clamp(max=config.off_policy_cap)


def off_policy_metrics(behaviour: torch.Tensor, proximal: torch.Tensor,
                       response_mask: torch.Tensor, cap: float | None) -> dict[str, float]:
    """What the correction did to a step's batch, over its response tokens.

    Args:
        behaviour: ``[batch, response_len]`` log-probs recorded at sampling.
        proximal: ``[batch, response_len]`` the trainer's log-probs before the update.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        cap: the truncation of ``truncated_is``; None: no truncation.

    Returns:
        ``off_policy/weight_mean`` and ``_max`` of ``exp(proximal - behaviour)`` before any
        truncation, ``off_policy/weight_clipfrac`` (the fraction of tokens above ``cap``; 0
        without one) and ``off_policy/logprob_gap`` (the mean ``|proximal - behaviour|``: how
        far the trainer has moved from the weights that sampled).
    """
    mask = response_mask.bool()
    weights = importance_weights(behaviour, proximal, response_mask)
    clipped = (weights > cap) & mask if cap is not None else torch.zeros_like(mask)
    gap = torch.where(mask, proximal - behaviour, 0.0).abs()
    return {
        "off_policy/weight_mean": masked_mean(weights, response_mask).item(),
        "off_policy/weight_max": weights[mask].max().item() if mask.any() else 1.0,
        "off_policy/weight_clipfrac": masked_mean(clipped.to(weights.dtype),
                                                  response_mask).item(),
        "off_policy/logprob_gap": masked_mean(gap, response_mask).item(),
    }
