"""Masked reductions against numpy over the real tokens only."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import masked_mean, masked_sum, masked_var, masked_whiten
from tests.algorithms.helpers import LENGTHS, random_padded, real_tokens, response_mask


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    rng = np.random.default_rng(0)
    values = random_padded(rng, LENGTHS, loc=0.7, scale=2.0)
    flat = np.concatenate([np.array(row) for row in real_tokens(values, LENGTHS)])
    return values, response_mask(LENGTHS), flat


def test_sum_and_mean_ignore_padding(batch) -> None:
    values, mask, flat = batch
    assert masked_sum(values, mask).item() == pytest.approx(flat.sum(), rel=1e-12)
    assert masked_mean(values, mask).item() == pytest.approx(flat.mean(), rel=1e-12)
    assert masked_mean(values, mask.bool()).item() == pytest.approx(flat.mean(), rel=1e-12)


def test_mean_per_row(batch) -> None:
    values, mask, _ = batch
    expected = [np.mean(row) for row in real_tokens(values, LENGTHS)]
    np.testing.assert_allclose(masked_mean(values, mask, dim=-1).numpy(), expected, rtol=1e-12)


def test_mean_of_empty_row_is_zero() -> None:
    values = torch.tensor([[1.0, 2.0], [float("nan"), 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1], [0, 0]])
    np.testing.assert_allclose(masked_mean(values, mask, dim=-1).numpy(), [1.5, 0.0])


@pytest.mark.parametrize("unbiased, ddof", [(True, 1), (False, 0)])
def test_var(batch, unbiased: bool, ddof: int) -> None:
    values, mask, flat = batch
    got = masked_var(values, mask, unbiased=unbiased).item()
    assert got == pytest.approx(np.var(flat, ddof=ddof), rel=1e-12)


def test_unbiased_var_of_one_token_raises() -> None:
    values = torch.tensor([[3.0, float("nan")]], dtype=torch.float64)
    with pytest.raises(ValueError, match="at least 2 unmasked tokens, got 1"):
        masked_var(values, torch.tensor([[1, 0]]))


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten(batch, shift_mean: bool) -> None:
    values, mask, flat = batch
    eps = 1e-8
    got = masked_whiten(values, mask, shift_mean=shift_mean, eps=eps)
    mean, std = flat.mean(), np.sqrt(np.var(flat, ddof=1) + eps)
    for row, length in enumerate(LENGTHS):
        expected = (values[row, :length].numpy() - mean) / std + (0.0 if shift_mean else mean)
        np.testing.assert_allclose(got[row, :length].numpy(), expected, rtol=1e-10)
        assert torch.all(got[row, length:] == 0)
    whitened_real = got[mask.bool()]
    assert whitened_real.std().item() == pytest.approx(1.0, rel=1e-6)
    assert whitened_real.mean().item() == pytest.approx(0.0 if shift_mean else mean, abs=1e-10)
