"""Masked reductions over response tokens.

Every tensor here is ``[batch, response_len]`` with a ``response_mask`` of the same shape that is 1
on real response tokens and 0 on padding. Padded positions are excluded with ``torch.where`` rather
than multiplied by zero, so garbage (``nan``, ``inf``) in padding cannot leak into a result.

These reduce over the tensors they are given. Under data parallelism a rank sees a shard of the
batch; to reproduce the single-process result the caller reduces ``masked_sum`` and the token count
over the data-parallel group itself.
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of ``values`` over positions where ``mask`` is 1.

    Args:
        values: ``[batch, response_len]`` tensor.
        mask: ``[batch, response_len]`` 0/1 mask (bool, int or float).
        dim: Dimension to reduce; ``None`` reduces over all elements.

    Returns:
        0-dim tensor when ``dim`` is None, else ``values`` with ``dim`` reduced.
    """
    kept = torch.where(mask.bool(), values, torch.zeros_like(values))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` over positions where ``mask`` is 1.

    A reduction over no real token returns 0 instead of ``nan`` so an all-padding row does not
    poison a batch.

    Args:
        values: ``[batch, response_len]`` tensor.
        mask: ``[batch, response_len]`` 0/1 mask.
        dim: Dimension to reduce; ``None`` reduces over all elements.

    Returns:
        0-dim tensor when ``dim`` is None, else ``values`` with ``dim`` reduced.
    """
    count = masked_sum(torch.ones_like(values), mask, dim)
    return masked_sum(values, mask, dim) / count.clamp_min(1.0)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of ``values`` over all positions where ``mask`` is 1.

    Args:
        values: ``[batch, response_len]`` tensor.
        mask: ``[batch, response_len]`` 0/1 mask.
        unbiased: Apply Bessel's correction ``n / (n - 1)`` over the ``n`` real tokens.

    Returns:
        0-dim tensor.

    Raises:
        ValueError: If ``unbiased`` and fewer than two tokens are unmasked (this reads the count
            back from the device).
    """
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean).square(), mask)
    if not unbiased:
        return var
    count = int(mask.bool().sum().item())
    if count < 2:
        raise ValueError(
            f"masked_var(unbiased=True) needs at least 2 unmasked tokens, got {count}; "
            "pass unbiased=False or a larger batch"
        )
    return var * (count / (count - 1))


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalise ``values`` to unit (unbiased) variance over the unmasked tokens.

    Args:
        values: ``[batch, response_len]`` tensor, e.g. advantages.
        mask: ``[batch, response_len]`` 0/1 mask.
        shift_mean: Subtract the mean; when False the original mean is kept (only the scale
            changes), which preserves the sign balance of the input.
        eps: Added to the variance before the square root.

    Returns:
        ``[batch, response_len]`` tensor, 0 at padded positions.

    Raises:
        ValueError: If fewer than two tokens are unmasked.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask.bool(), whitened, torch.zeros_like(whitened))
