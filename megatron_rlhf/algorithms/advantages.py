"""Token-level advantage estimation: GAE (Schulman et al., 2016) and REINFORCE++ (Hu, 2025), and
the registry of advantage estimators that ``algorithm.advantage_estimator`` names.

The group-relative outcome estimators (GRPO, RLOO) are in ``group_advantages.py``.

An estimator is one function registered where it is defined; the config's allowed values, the
critic's placement and the group checks all read the registry::

    @register_advantage_estimator("my_estimator", uses_critic=False, needs_groups=False)
    def my_estimator(rewards, response_mask, config, *, values, group_size):
        ...  # [batch, response_len] each in; (advantages, returns) out
        return advantages, returns
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from megatron_rlhf.algorithms.masked import masked_whiten
from megatron_rlhf.algorithms.registry import Registry

if TYPE_CHECKING:
    from megatron_rlhf.algorithms.hyperparameters import PPOAlgorithmConfig


class AdvantageFunction(Protocol):
    """The signature of a registered estimator."""

    def __call__(self, rewards: torch.Tensor, response_mask: torch.Tensor,
                 config: PPOAlgorithmConfig, *, values: torch.Tensor | None,
                 group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(advantages, returns)`` ``[batch, response_len]`` of the whole experience batch.

        Args:
            rewards: ``[batch, response_len]`` token rewards (the score on the last response
                token, minus the KL penalty when ``kl_in="reward"``).
            response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
            config: the algorithm's settings (``gamma``, ``lam``, ...).
            values: ``[batch, response_len]`` critic values when the estimator ``uses_critic``,
                else None.
            group_size: responses per prompt; the rows of a prompt are contiguous.
        """


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered advantage estimator.

    Attributes:
        name: its ``algorithm.advantage_estimator`` value.
        compute: the function (``AdvantageFunction``).
        uses_critic: it reads the critic's ``values``: a run with it places and trains a critic.
        needs_groups: it compares the responses to one prompt: it needs
            ``rollout.samples_per_prompt >= 2`` and is the kind DAPO's dynamic sampling filters.
    """

    name: str
    compute: AdvantageFunction
    uses_critic: bool
    needs_groups: bool


ADVANTAGE_ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", lambda estimator: estimator.compute.__qualname__)
"""Name -> estimator, filled by ``register_advantage_estimator`` where each is defined."""


def register_advantage_estimator(name: str, *, uses_critic: bool = False,
                                 needs_groups: bool = False
                                 ) -> Callable[[AdvantageFunction], AdvantageFunction]:
    """Decorator that registers an ``AdvantageFunction`` as ``algorithm.advantage_estimator=name``.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def register(compute: AdvantageFunction) -> AdvantageFunction:
        ADVANTAGE_ESTIMATORS.add(name, AdvantageEstimator(name, compute, uses_critic,
                                                          needs_groups))
        return compute

    return register


def critic_free_estimators() -> list[str]:
    """The registered estimators that train no critic (``uses_critic=False``), in registration
    order: what a refusal offers a run without a critic."""
    return [name for name, estimator in ADVANTAGE_ESTIMATORS.items() if not estimator.uses_critic]


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``.

    Raises:
        ValueError: no estimator has that name; the message lists the registered ones.
    """
    return ADVANTAGE_ESTIMATORS.lookup(name)


@torch.no_grad()
def compute_gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns over response tokens.

    With ``delta_t = r_t + gamma * V_{t+1} - V_t`` and ``A_t = delta_t + gamma * lam * A_{t+1}``,
    and the value after the last response token taken as 0 (the episode ends there).
    Positions with mask 0 are skipped: the recursion carries ``V`` and ``A`` of the next real token
    across them. For right-padded responses that is the usual end-of-sequence bootstrap; for masks
    with holes (e.g. tool output inside a response) the tokens on both sides are treated as
    consecutive steps.

    Args:
        token_level_rewards: ``[batch, response_len]`` rewards (see
            ``compute_token_level_rewards``).
        values: ``[batch, response_len]`` critic values of the response tokens.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        gamma: Discount factor.
        lam: GAE lambda.

    Returns:
        ``(advantages, returns)``, both ``[batch, response_len]``, detached, 0 at padded positions;
        ``returns = advantages + values``.
    """
    mask = response_mask.bool()
    zero = torch.zeros_like(values[:, 0])
    next_value, next_advantage = zero, zero
    advantages_reversed = []
    for t in reversed(range(values.shape[-1])):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        next_value = torch.where(mask[:, t], values[:, t], next_value)
        next_advantage = torch.where(mask[:, t], advantage, next_advantage)
        advantages_reversed.append(torch.where(mask[:, t], advantage, zero))
    advantages = torch.stack(advantages_reversed[::-1], dim=-1)
    returns = torch.where(mask, advantages + values, torch.zeros_like(values))
    return advantages, returns


@torch.no_grad()
def compute_discounted_returns(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> torch.Tensor:
    """Discounted reward-to-go ``G_t = r_t + gamma * G_{t+1}`` over response tokens.

    ``G`` after the last response token is 0. As in ``compute_gae_advantage_return``, masked
    positions are skipped: the return of the next real token is carried across them.

    Args:
        token_level_rewards: ``[batch, response_len]`` rewards (see
            ``compute_token_level_rewards``: the score on the last token, ``-kl_coef * kl`` on
            every token).
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        gamma: Discount factor.

    Returns:
        ``[batch, response_len]`` returns, detached, 0 at padded positions.
    """
    mask = response_mask.bool()
    zero = torch.zeros_like(token_level_rewards[:, 0])
    next_return = zero
    returns_reversed = []
    for t in reversed(range(token_level_rewards.shape[-1])):
        value = token_level_rewards[:, t] + gamma * next_return
        next_return = torch.where(mask[:, t], value, next_return)
        returns_reversed.append(torch.where(mask[:, t], value, zero))
    return torch.stack(returns_reversed[::-1], dim=-1)


@torch.no_grad()
def compute_reinforce_plus_plus_advantage_return(
    token_level_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: discounted returns, whitened over the response tokens of the batch.

    ``A = (G - mean(G)) / sqrt(var(G) + eps)`` with the mean and unbiased variance taken over every
    real response token of the batch given (``masked_whiten``). No critic: ``returns`` is ``G``.

    Data parallelism: the whitening statistics are those of the tensors given. To reproduce the
    single-process result the caller passes the full batch, or calls
    ``compute_discounted_returns`` on its shard and whitens with the masked sum, sum of squares and
    token count all-reduced over the data-parallel group.

    Args:
        token_level_rewards: ``[batch, response_len]`` rewards with the per-token KL penalty
            (``compute_token_level_rewards``; ``kl_coef = 0`` when the KL is a loss term).
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        gamma: Discount factor.

    Returns:
        ``(advantages, returns)``, both ``[batch, response_len]``, detached, 0 at padded positions.

    Raises:
        ValueError: If the batch has fewer than two response tokens (no variance).
    """
    returns = compute_discounted_returns(token_level_rewards, response_mask, gamma)
    return masked_whiten(returns, response_mask, shift_mean=True), returns


@register_advantage_estimator("gae", uses_critic=True)
def gae_advantages(rewards: torch.Tensor, response_mask: torch.Tensor,
                   config: PPOAlgorithmConfig, *, values: torch.Tensor | None,
                   group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's estimator: GAE with the critic's values, whitened when ``whiten_advantages``."""
    advantages, returns = compute_gae_advantage_return(rewards, values, response_mask,
                                                       config.gamma, config.lam)
    if config.whiten_advantages:
        advantages = masked_whiten(advantages, response_mask, config.whiten_shift_mean)
    return advantages, returns


@register_advantage_estimator("reinforce++")
def reinforce_plus_plus_advantages(rewards: torch.Tensor, response_mask: torch.Tensor,
                                   config: PPOAlgorithmConfig, *, values: torch.Tensor | None,
                                   group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++: batch-whitened discounted returns (``compute_reinforce_plus_plus_...``)."""
    return compute_reinforce_plus_plus_advantage_return(rewards, response_mask, config.gamma)
