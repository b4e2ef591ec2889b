"""Critic-free outcome advantages from groups of responses to the same prompt: GRPO and RLOO.

Layout contract. A batch holds ``num_groups`` prompts with ``group_size`` responses each, and the
rows of one group are contiguous: rows ``[g * group_size, (g + 1) * group_size)`` answer prompt
``g``. ``scores`` is ``[num_groups * group_size]``, one scalar per response.

Data parallelism. A group's baseline needs every score of the group, and a data-parallel rank may
hold only part of a group. These functions take the *full* batch's scores (the caller all-gathers
the scalar scores over the data-parallel group, in global row order) and return one advantage per
row of the full batch; each rank then keeps its own rows (``advantages[rows]``) and broadcasts them
to its tokens with ``broadcast_sequence_advantages``. Every rank computes the same scalars, so no
second collective is needed.

Estimators, with ``s_i`` the score of response ``i`` in a group of ``n``:

- GRPO (Shao et al., 2024): ``A_i = (s_i - mean(s)) / (std(s) + eps)`` with the unbiased std of
  the group, or ``A_i = s_i - mean(s)`` without the std division (Liu et al., 2025, "Dr. GRPO").
- RLOO (Ahmadian et al., 2024): ``A_i = s_i - mean_{j != i} s_j = n / (n - 1) * (s_i - mean(s))``.

Both need ``group_size >= 2``: with one response per prompt there is no baseline, every
advantage would be 0 (or undefined for the std), and the run would silently not learn. They raise
instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_rlhf.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    register_advantage_estimator,
)
from megatron_rlhf.algorithms.masked import masked_sum

if TYPE_CHECKING:
    from megatron_rlhf.algorithms.hyperparameters import PPOAlgorithmConfig


def _grouped(scores: torch.Tensor, group_size: int, estimator: str) -> torch.Tensor:
    """``scores`` reshaped to ``[num_groups, group_size]``, after checking the layout."""
    if scores.dim() != 1:
        raise ValueError(
            f"{estimator} scores must be 1-D [num_groups * group_size], got shape "
            f"{tuple(scores.shape)}; pass one scalar score per response"
        )
    if group_size < 2:
        ungrouped = [name for name, entry in ADVANTAGE_ESTIMATORS.items() if not entry.needs_groups]
        raise ValueError(
            f"{estimator} needs group_size >= 2 responses per prompt, got {group_size}; set "
            f"rollout.samples_per_prompt >= 2, or use an advantage_estimator of {ungrouped}"
        )
    if scores.numel() % group_size != 0:
        raise ValueError(
            f"{estimator} scores has {scores.numel()} rows, not a multiple of "
            f"group_size({group_size}); pass the full batch's scores (all-gathered over "
            "data-parallel ranks), whole groups only"
        )
    return scores.reshape(-1, group_size)


def _centred(grouped: torch.Tensor) -> torch.Tensor:
    """Scores minus their group mean, in float64, exactly 0 in a group of equal scores.

    The mean of equal scores is not always exactly that score (``sum / n`` rounds), and dividing
    that residue by the group's tiny std gives O(1) advantages: in float32 a group of eight 0.7
    scores otherwise gets advantages of +-0.06, and eight scores of 1e5 +-0.9.
    """
    grouped = grouped.to(torch.float64)
    centred = grouped - grouped.mean(dim=-1, keepdim=True)
    flat = grouped.amax(dim=-1, keepdim=True) == grouped.amin(dim=-1, keepdim=True)
    return torch.where(flat, torch.zeros_like(centred), centred)


@torch.no_grad()
def compute_grpo_outcome_advantages(
    scores: torch.Tensor, group_size: int, std_normalize: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO advantages: each score minus its group's mean, optionally over the group's std.

    Args:
        scores: ``[num_groups * group_size]`` sequence scores of the full batch, groups contiguous
            (see the module docstring).
        group_size: Responses per prompt, ``>= 2``.
        std_normalize: Divide by ``std + eps`` (unbiased std of the group); False keeps only the
            mean subtraction.
        eps: Added to the std, so a group of equal scores gives 0, not ``nan``.

    Returns:
        ``[num_groups * group_size]`` per-sequence advantages, detached, same dtype as ``scores``
        (computed in float64); exactly 0 for a group whose scores are all equal.

    Raises:
        ValueError: If ``scores`` is not 1-D, ``group_size < 2``, or the rows are not whole groups.
    """
    grouped = _grouped(scores, group_size, "grpo")
    advantages = _centred(grouped)
    if std_normalize:
        std = grouped.to(torch.float64).std(dim=-1, unbiased=True, keepdim=True)
        advantages = advantages / (std + eps)
    return advantages.reshape(-1).to(scores.dtype)


@torch.no_grad()
def compute_rloo_outcome_advantages(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO advantages: each score minus the mean score of the other responses of its group.

    Args:
        scores: ``[num_groups * group_size]`` sequence scores of the full batch, groups contiguous.
        group_size: Responses per prompt, ``>= 2``.

    Returns:
        ``[num_groups * group_size]`` per-sequence advantages, detached, same dtype as ``scores``
        (computed in float64); exactly 0 for a group whose scores are all equal.

    Raises:
        ValueError: If ``scores`` is not 1-D, ``group_size < 2``, or the rows are not whole groups.
    """
    grouped = _grouped(scores, group_size, "rloo")
    # s_i - (sum - s_i) / (n - 1) rearranged as n / (n - 1) * (s_i - mean), so that equal scores
    # give exactly 0, as in GRPO, instead of a rounding residue of the sum.
    advantages = _centred(grouped) * (group_size / (group_size - 1))
    return advantages.reshape(-1).to(scores.dtype)


def broadcast_sequence_advantages(
    sequence_advantages: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Gives every response token of a row its sequence's advantage.

    Args:
        sequence_advantages: ``[batch]`` advantages of the rows this caller holds.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.

    Returns:
        ``[batch, response_len]`` advantages, 0 at padded positions.
    """
    expanded = sequence_advantages.unsqueeze(-1).expand(response_mask.shape)
    return torch.where(response_mask.bool(), expanded, torch.zeros_like(expanded))


@register_advantage_estimator("grpo", needs_groups=True)
def grpo_advantages(rewards: torch.Tensor, response_mask: torch.Tensor,
                    config: PPOAlgorithmConfig, *, values: torch.Tensor | None,
                    group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO on each row's summed token rewards, on every response token; ``returns`` are the
    advantages (no critic learns from them)."""
    sequence_advantages = compute_grpo_outcome_advantages(
        masked_sum(rewards, response_mask, dim=-1), group_size, config.grpo_std_normalize)
    advantages = broadcast_sequence_advantages(sequence_advantages, response_mask)
    return advantages, advantages


@register_advantage_estimator("rloo", needs_groups=True)
def rloo_advantages(rewards: torch.Tensor, response_mask: torch.Tensor,
                    config: PPOAlgorithmConfig, *, values: torch.Tensor | None,
                    group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO on each row's summed token rewards, as ``grpo_advantages``."""
    sequence_advantages = compute_rloo_outcome_advantages(
        masked_sum(rewards, response_mask, dim=-1), group_size)
    advantages = broadcast_sequence_advantages(sequence_advantages, response_mask)
    return advantages, advantages
