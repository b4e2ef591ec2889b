"""Reduction of a per-token loss to a scalar: the aggregation modes of current RLHF systems.

With ``L[b, t]`` the per-token loss, ``m[b, t]`` the response mask and ``S`` the rows holding at
least one response token:

- ``token_mean``: ``sum_{b,t} m L / sum_{b,t} m``, every token weighs the same (long responses
  weigh more). Today's PPO loss, exactly ``masked_mean``.
- ``seq_mean_token_mean``: ``mean_{b in S} (sum_t m L / sum_t m)``, every response weighs the same
  (GRPO as published).
- ``seq_mean_token_sum``: ``mean_{b in S} sum_t m L``, every token weighs the same inside a
  response but the loss scales with its length.

Rows without a response token contribute nothing and are not counted.

Data parallelism and micro-batches: each mode is ``numerator / aggregation_denominator``, where
the denominator counts tokens (``token_mean``) or non-empty rows (the ``seq_*`` modes). A caller
that splits a batch, like megatron's schedule, passes ``loss * aggregation_denominator(...)`` per
micro-batch and divides by the denominator summed over the whole step, which reproduces the
full-batch value.
"""

from __future__ import annotations

import torch

from megatron_rlhf.algorithms.masked import masked_mean, masked_sum

LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def _check_mode(mode: str) -> None:
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss aggregation {mode!r} is unknown; use one of {LOSS_AGGREGATIONS}")


def aggregation_denominator(response_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What ``aggregate_loss`` divides by: response tokens, or rows with a response token.

    Args:
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        mode: One of ``LOSS_AGGREGATIONS``.

    Returns:
        0-dim float tensor (the count, not clamped; 0 for an all-padding batch).

    Raises:
        ValueError: If ``mode`` is unknown.
    """
    _check_mode(mode)
    mask = response_mask.bool()
    if mode == "token_mean":
        return mask.sum().to(torch.get_default_dtype())
    return mask.any(dim=-1).sum().to(torch.get_default_dtype())


def aggregate_loss(
    per_token_loss: torch.Tensor, response_mask: torch.Tensor, mode: str
) -> torch.Tensor:
    """Reduces a per-token loss to a scalar (see the module docstring for the modes).

    Padded positions are excluded with ``torch.where``, so ``nan`` there cannot leak. An empty
    batch gives 0.

    Args:
        per_token_loss: ``[batch, response_len]`` loss per token.
        response_mask: ``[batch, response_len]`` 0/1 mask of real response tokens.
        mode: One of ``LOSS_AGGREGATIONS``.

    Returns:
        0-dim tensor, differentiable with respect to ``per_token_loss``.

    Raises:
        ValueError: If ``mode`` is unknown.
    """
    _check_mode(mode)
    if mode == "token_mean":
        return masked_mean(per_token_loss, response_mask)
    if mode == "seq_mean_token_mean":
        per_sequence = masked_mean(per_token_loss, response_mask, dim=-1)
    else:
        per_sequence = masked_sum(per_token_loss, response_mask, dim=-1)
    rows = response_mask.bool().any(dim=-1)
    return masked_sum(per_sequence, rows) / rows.sum().clamp_min(1).to(per_sequence.dtype)
