"""Advantage estimation: generalised advantage estimation (Schulman et al., 2016)."""

from __future__ import annotations

import torch


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
