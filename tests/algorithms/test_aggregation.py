"""Loss aggregation modes against numpy over the real tokens, and their micro-batch contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import aggregate_loss, aggregation_denominator, masked_mean
from tests.algorithms.helpers import LENGTHS, random_padded, real_tokens, response_mask

MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


def _reference(rows: list[list[float]], mode: str) -> float:
    rows = [row for row in rows if row]
    if mode == "token_mean":
        return float(np.mean(np.concatenate(rows)))
    if mode == "seq_mean_token_mean":
        return float(np.mean([np.mean(row) for row in rows]))
    return float(np.mean([np.sum(row) for row in rows]))


@pytest.mark.parametrize("mode", MODES)
def test_modes_match_numpy_and_ignore_padding(mode: str) -> None:
    lengths = LENGTHS + [0]
    loss = random_padded(np.random.default_rng(50), lengths)
    got = aggregate_loss(loss, response_mask(lengths), mode)
    assert got.item() == pytest.approx(_reference(real_tokens(loss, lengths), mode), rel=1e-12)


def test_modes_differ_on_unequal_lengths() -> None:
    loss = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = response_mask([4, 1], width=4)
    # token mean 7 / 5; per-row means 1 and 3; per-row sums 4 and 3
    assert aggregate_loss(loss, mask, "token_mean").item() == pytest.approx(1.4)
    assert aggregate_loss(loss, mask, "seq_mean_token_mean").item() == 2.0
    assert aggregate_loss(loss, mask, "seq_mean_token_sum").item() == 3.5


def test_token_mean_is_bitwise_masked_mean() -> None:
    loss = random_padded(np.random.default_rng(51), LENGTHS)
    mask = response_mask(LENGTHS)
    assert torch.equal(aggregate_loss(loss, mask, "token_mean"), masked_mean(loss, mask))


@pytest.mark.parametrize("mode", MODES)
def test_gradients_match_the_weights_of_each_mode(mode: str) -> None:
    loss = random_padded(np.random.default_rng(52), LENGTHS, pad=0.0).requires_grad_(True)
    (grad,) = torch.autograd.grad(aggregate_loss(loss, response_mask(LENGTHS), mode), loss)
    for row, length in enumerate(LENGTHS):
        weight = {
            "token_mean": 1 / sum(LENGTHS),
            "seq_mean_token_mean": 1 / (len(LENGTHS) * length),
            "seq_mean_token_sum": 1 / len(LENGTHS),
        }[mode]
        np.testing.assert_allclose(grad[row, :length].numpy(), weight, rtol=1e-12)
        assert torch.all(grad[row, length:] == 0)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_recombine_with_the_denominator(mode: str) -> None:
    lengths = LENGTHS + [0, 2]
    loss = random_padded(np.random.default_rng(53), lengths)
    mask = response_mask(lengths)
    whole = aggregate_loss(loss, mask, mode)
    parts = [slice(0, 3), slice(3, 4), slice(4, 8)]
    numerator = sum(
        aggregate_loss(loss[p], mask[p], mode) * aggregation_denominator(mask[p], mode)
        for p in parts
    )
    denominator = sum(aggregation_denominator(mask[p], mode) for p in parts)
    assert (numerator / denominator).item() == pytest.approx(whole.item(), rel=1e-12)


def test_empty_batch_is_zero_and_unknown_mode_raises() -> None:
    empty = torch.zeros(2, 3)
    for mode in MODES:
        assert aggregate_loss(torch.full((2, 3), float("nan")), empty, mode).item() == 0.0
        assert aggregation_denominator(empty, mode).item() == 0.0
    with pytest.raises(ValueError, match="'seq_sum' is unknown"):
        aggregate_loss(empty, empty, "seq_sum")
    with pytest.raises(ValueError, match="'seq_sum' is unknown"):
        aggregation_denominator(empty, "seq_sum")
