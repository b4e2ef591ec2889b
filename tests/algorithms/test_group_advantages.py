"""GRPO and RLOO against numpy references on hand-made groups, and the data-parallel contract."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_rlhf.algorithms import (
    broadcast_sequence_advantages,
    compute_grpo_outcome_advantages,
    compute_rloo_outcome_advantages,
)
from tests.algorithms.helpers import response_mask


def _reference_grpo(scores: np.ndarray, n: int, std_normalize: bool, eps: float = 1e-6):
    out = np.empty_like(scores)
    for start in range(0, len(scores), n):
        group = scores[start : start + n]
        centred = group - group.mean()
        out[start : start + n] = (
            centred / (np.std(group, ddof=1) + eps) if std_normalize else centred
        )
    return out


def _reference_rloo(scores: np.ndarray, n: int):
    out = np.empty_like(scores)
    for i in range(len(scores)):
        start = i // n * n
        others = [scores[j] for j in range(start, start + n) if j != i]
        out[i] = scores[i] - sum(others) / len(others)
    return out


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


@pytest.mark.parametrize("std_normalize", [True, False])
def test_equal_rewards_give_zero_advantage(std_normalize: bool) -> None:
    scores = _t([0.7] * 4 + [-2.0] * 4)
    grpo = compute_grpo_outcome_advantages(scores, 4, std_normalize)
    assert grpo.tolist() == [0.0] * 8
    assert compute_rloo_outcome_advantages(scores, 4).tolist() == [0.0] * 8


@pytest.mark.parametrize("value", [0.7, 1e5 + 0.1])
def test_equal_float32_rewards_give_exactly_zero(value: float) -> None:
    # sum / n of equal float32 scores rounds; over the group's ~0 std that residue used to become
    # an O(1) advantage (+-0.06 for eight 0.7s, +-0.9 for eight 1e5s).
    scores = torch.full((8,), value, dtype=torch.float32)
    grpo = compute_grpo_outcome_advantages(scores, 8)
    assert grpo.dtype == torch.float32 and grpo.tolist() == [0.0] * 8
    assert compute_rloo_outcome_advantages(scores, 8).tolist() == [0.0] * 8


def test_one_outlier_by_hand() -> None:
    scores = _t([0.0, 0.0, 0.0, 1.0])
    # mean 0.25, unbiased std sqrt(0.75 / 3) = 0.5
    grpo = compute_grpo_outcome_advantages(scores, 4, std_normalize=True, eps=0.0)
    np.testing.assert_allclose(grpo.numpy(), [-0.5, -0.5, -0.5, 1.5], rtol=1e-12)
    no_std = compute_grpo_outcome_advantages(scores, 4, std_normalize=False)
    np.testing.assert_allclose(no_std.numpy(), [-0.25, -0.25, -0.25, 0.75], rtol=1e-12)
    # leave-one-out: 0 - 1/3 for the zeros, 1 - 0 for the outlier
    rloo = compute_rloo_outcome_advantages(scores, 4)
    np.testing.assert_allclose(rloo.numpy(), [-1 / 3, -1 / 3, -1 / 3, 1.0], rtol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("std_normalize", [True, False])
def test_grpo_random_groups_match_numpy(n: int, std_normalize: bool) -> None:
    scores = np.random.default_rng(20 + n).normal(1.0, 2.0, size=4 * n)
    got = compute_grpo_outcome_advantages(torch.from_numpy(scores), n, std_normalize)
    np.testing.assert_allclose(got.numpy(), _reference_grpo(scores, n, std_normalize), rtol=1e-12)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_rloo_random_groups_match_numpy(n: int) -> None:
    scores = np.random.default_rng(30 + n).normal(size=3 * n)
    got = compute_rloo_outcome_advantages(torch.from_numpy(scores), n)
    np.testing.assert_allclose(got.numpy(), _reference_rloo(scores, n), rtol=1e-12, atol=1e-14)


def test_rloo_of_two_is_the_score_difference() -> None:
    got = compute_rloo_outcome_advantages(_t([3.0, 1.0, -1.0, 4.0]), 2)
    assert got.tolist() == [2.0, -2.0, -5.0, 5.0]


@pytest.mark.parametrize(
    "scores, n, match",
    [
        ([1.0, 2.0], 1, r"group_size >= 2 .* got 1"),
        ([1.0, 2.0, 3.0], 2, r"3 rows, not a multiple of group_size\(2\)"),
        ([[1.0, 2.0]], 2, "must be 1-D"),
    ],
)
def test_bad_layouts_raise(scores, n: int, match: str) -> None:
    for fn in (compute_rloo_outcome_advantages, compute_grpo_outcome_advantages):
        with pytest.raises(ValueError, match=match):
            fn(_t(scores), n)


def test_broadcast_to_tokens_ignores_padding_and_length_one() -> None:
    mask = response_mask([1, 4, 0], width=4)
    got = broadcast_sequence_advantages(_t([1.5, -0.5, 9.0]), mask)
    expected = np.zeros((3, 4))
    expected[0, :1], expected[1, :4] = 1.5, -0.5
    np.testing.assert_array_equal(got.numpy(), expected)
    # a mask with holes: only real tokens carry the advantage
    holes = torch.tensor([[0, 1, 0, 1]])
    assert broadcast_sequence_advantages(_t([2.0]), holes).tolist() == [[0.0, 2.0, 0.0, 2.0]]


def test_padding_and_response_length_do_not_change_advantages() -> None:
    # Outcome advantages depend on the scores only: the same scores give the same per-token value
    # whatever the lengths, and nan in padded log-probs or rewards is never read.
    scores = _t([1.0, 0.0, 2.0, 5.0])
    seq = compute_grpo_outcome_advantages(scores, 2)
    short = broadcast_sequence_advantages(seq, response_mask([1, 1, 1, 1], width=3))
    long = broadcast_sequence_advantages(seq, response_mask([3, 2, 1, 3], width=3))
    assert torch.equal(short[:, 0], long[:, 0])
    assert torch.equal(short[:, 0], seq)


def test_data_parallel_shards_index_the_full_batch_result() -> None:
    scores = torch.from_numpy(np.random.default_rng(40).normal(size=12))
    full = compute_grpo_outcome_advantages(scores, 4)
    reference = _reference_grpo(scores.numpy(), 4, True)
    # dp=3 with contiguous shards of 4 rows: a shard that splits a group (rows 4..7 are a group,
    # rows 2..5 are not) must index the full result, which is what the engine is asked to do.
    for rows in (slice(0, 4), slice(2, 6), torch.tensor([11, 0, 5])):
        mask = torch.ones(len(full[rows]), 3)
        shard = broadcast_sequence_advantages(full[rows], mask)
        index = rows if isinstance(rows, slice) else rows.numpy()
        np.testing.assert_allclose(shard[:, 0].numpy(), reference[index], rtol=1e-12)
    assert not full.requires_grad
