"""Per-token KL penalty against the reference policy, and the KL coefficient controllers.

The estimators follow Schulman, "Approximating KL divergence" (2020). With tokens sampled from the
current policy and ``log_ratio = log_prob - ref_log_prob``:

- ``k1 = log_ratio``: unbiased, high variance, can be negative per token.
- ``k2 = 0.5 * log_ratio ** 2``: biased, low variance, non-negative.
- ``k3 = exp(-log_ratio) + log_ratio - 1``: unbiased, low variance, non-negative.

The adaptive controller is the one of Ziegler et al., "Fine-Tuning Language Models from Human
Preferences" (2019), whose target is a KL per *sequence* in nats; ``mean_sequence_kl`` gives the
quantity to feed it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from megatron_rlhf.algorithms.masked import masked_sum
from megatron_rlhf.algorithms.registry import Registry

if TYPE_CHECKING:
    from megatron_rlhf.algorithms.hyperparameters import PPOAlgorithmConfig

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(log_prob, ref_log_prob) -> per-token KL estimate``, ``[batch, response_len]`` each."""

KL_ESTIMATORS: Registry[KLEstimator] = Registry("kl estimator",
                                                lambda estimator: estimator.__qualname__)
"""Name -> estimator (``algorithm.kl_estimator``, ``algorithm.kl_loss_estimator``), filled by
``register_kl_estimator`` where each is defined."""


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    """Decorator that registers a ``KLEstimator`` under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def register(estimator: KLEstimator) -> KLEstimator:
        KL_ESTIMATORS.add(name, estimator)
        return estimator

    return register


def get_kl_estimator(name: str) -> KLEstimator:
    """The estimator registered as ``name``.

    Raises:
        ValueError: no estimator has that name; the message lists the registered ones.
    """
    return KL_ESTIMATORS.lookup(name)


@register_kl_estimator("k1")
def kl_k1(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k1 estimator ``log_prob - ref_log_prob``; shapes ``[batch, response_len]`` in and out."""
    return log_prob - ref_log_prob


@register_kl_estimator("k2")
def kl_k2(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k2 estimator ``0.5 * (log_prob - ref_log_prob) ** 2``; ``[batch, response_len]``."""
    return 0.5 * (log_prob - ref_log_prob).square()


@register_kl_estimator("k3")
def kl_k3(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """k3 estimator ``exp(ref - logp) - (ref - logp) - 1``; ``[batch, response_len]``."""
    log_ratio = ref_log_prob - log_prob
    # expm1 keeps precision when the policies are close, where exp(x) - 1 cancels.
    return torch.expm1(log_ratio) - log_ratio


def kl_penalty(
    log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = "k1",
) -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    Args:
        log_prob: ``[batch, response_len]`` log-probs of the sampled tokens under the policy.
        ref_log_prob: ``[batch, response_len]`` log-probs of the same tokens under the reference.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        estimator: A name in ``KL_ESTIMATORS`` (``k1``, ``k2``, ``k3``).

    Returns:
        ``[batch, response_len]`` KL estimate, 0 at padded positions.

    Raises:
        ValueError: If ``estimator`` is unknown.
    """
    kl = get_kl_estimator(estimator)(log_prob, ref_log_prob)
    return torch.where(response_mask.bool(), kl, torch.zeros_like(kl))


def mean_sequence_kl(kl: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """KL summed over each response's tokens, averaged over the batch.

    Args:
        kl: ``[batch, response_len]`` per-token KL estimate.
        response_mask: ``[batch, response_len]`` 0/1 mask.

    Returns:
        0-dim tensor, the value ``AdaptiveKLController.update`` expects.
    """
    return masked_sum(kl, response_mask, dim=-1).mean()


class _CoefficientState:
    """Checkpoint state shared by the controllers: the coefficient (the rest is config)."""

    value: float

    def state_dict(self) -> dict[str, float]:
        """Returns the coefficient, for checkpoints."""
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restores the coefficient saved by ``state_dict``.

        Args:
            state: A dict with key ``value``.
        """
        self.value = float(state["value"])


class FixedKLController(_CoefficientState):
    """A KL coefficient that never changes.

    Args:
        kl_coef: The coefficient.
    """

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient; present so that both controllers share one interface.

        Args:
            current_kl: Observed mean KL per sequence (unused).
            n_steps: Number of sequences in the batch (unused).
        """


class AdaptiveKLController(_CoefficientState):
    """Proportional controller that drives the observed KL towards a target (Ziegler et al.).

    Each update multiplies the coefficient by ``1 + e * n_steps / horizon`` where
    ``e = clip(current_kl / target - 1, -0.2, 0.2)``.

    Args:
        init_kl_coef: Starting coefficient.
        target: Target KL per sequence, in nats.
        horizon: Number of sequences over which the error is corrected.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int) -> None:
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Moves the coefficient after one batch.

        Args:
            current_kl: Observed mean KL per sequence (see ``mean_sequence_kl``).
            n_steps: Number of sequences in the batch.
        """
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


KLController = FixedKLController | AdaptiveKLController


def build_kl_controller(config: PPOAlgorithmConfig) -> KLController:
    """Builds the controller that ``config`` asks for.

    Args:
        config: Algorithm config; ``adaptive_kl`` selects the adaptive controller.

    Returns:
        A controller whose ``value`` starts at ``config.kl_coef``; with ``kl_in="loss"`` a fixed
        controller at 0, so the reward carries no KL (the loss term does).
    """
    if config.kl_in == "loss":
        return FixedKLController(0.0)
    if config.adaptive_kl:
        return AdaptiveKLController(config.kl_coef, config.kl_target, config.kl_horizon)
    return FixedKLController(config.kl_coef)
