"""Token-level advantage estimation: GAE (Schulman et al., 2016) and REINFORCE++ (Hu, 2025).

The group-relative outcome estimators (GRPO, RLOO) are in ``group_advantages.py``.
"""

from __future__ import annotations

import torch

from megatron_rlhf.algorithms.masked import masked_whiten


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
