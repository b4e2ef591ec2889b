"""Token weight versions and staleness (``engine/step/staleness.py``), as pure functions: the
metrics of answers that span 1, 2 and 3 versions against a hand count, and the answers (whole
groups) dropped as too stale."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.engine.step.staleness import (
    drop_answers,
    stale_answers,
    staleness_metrics,
    token_versions,
)

NO = -1  # padding


def _versions() -> tuple[torch.Tensor, torch.Tensor]:
    """Four answers trained at step 5: one version; spanning 2 updates (3 -> 4); spanning 3
    (2 -> 3 -> 4); and an empty one."""
    versions = torch.tensor([[4, 4, 4, NO, NO],
                             [3, 3, 4, 4, 4],
                             [2, 3, 3, 4, NO],
                             [NO, NO, NO, NO, NO]])
    return versions, (versions != NO).long()


def test_every_token_of_an_answer_records_the_version_that_sampled_it() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert token_versions(mask, 7).tolist() == [[7, 7, NO], [7, 7, 7]]


def test_the_metrics_of_answers_spanning_two_and_three_updates() -> None:
    versions, mask = _versions()
    metrics = staleness_metrics(versions, mask, step=5, dropped=2)
    # Staleness per token: 1,1,1 | 2,2,1,1,1 | 3,2,2,1: 12 tokens, sum 18.
    assert metrics["rollout/staleness_mean"] == pytest.approx(18 / 12)
    assert metrics["rollout/staleness_max"] == 3.0
    # Versions per answer with a response: 1, 2, 3.
    assert metrics["rollout/versions_per_answer"] == pytest.approx(2.0)
    assert metrics["rollout/partial_fraction"] == pytest.approx(2 / 3)
    assert metrics["rollout/dropped_stale"] == 2.0


def test_synchronous_tokens_are_never_stale() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    metrics = staleness_metrics(token_versions(mask, 4), mask, step=4)
    assert metrics == {"rollout/staleness_mean": 0.0, "rollout/staleness_max": 0.0,
                       "rollout/versions_per_answer": 1.0, "rollout/partial_fraction": 0.0,
                       "rollout/dropped_stale": 0.0}
    assert not stale_answers(token_versions(mask, 4), mask, 4, 0, 1).any()


def test_answers_staler_than_allowed_are_dropped_with_their_group() -> None:
    versions, mask = _versions()
    # Oldest token per answer: staleness 1, 2, 3, none.
    assert stale_answers(versions, mask, 5, 1, 1).tolist() == [False, True, True, False]
    assert stale_answers(versions, mask, 5, 2, 1).tolist() == [False, False, True, False]
    assert stale_answers(versions, mask, 5, 3, 1).tolist() == [False] * 4
    # Groups of 2: (0, 1) and (2, 3); one stale answer drops its group.
    assert stale_answers(versions, mask, 5, 2, 2).tolist() == [False, False, True, True]
    assert stale_answers(versions, mask, 5, 1, 2).tolist() == [True] * 4
    with pytest.raises(ValueError, match=r"group_size\(3\) does not divide the 4 answers"):
        stale_answers(versions, mask, 5, 1, 3)


def test_a_dropped_answer_keeps_its_row_and_loses_its_tokens() -> None:
    versions, mask = _versions()
    fields = {"response_mask": mask, "advantages": torch.ones(4, 5)}
    dropped = torch.tensor([False, True, False, False])
    kept = drop_answers(fields, dropped)
    assert kept["response_mask"].tolist() == [[1, 1, 1, 0, 0], [0] * 5, [1, 1, 1, 1, 0], [0] * 5]
    assert kept["advantages"] is fields["advantages"]
    assert fields["response_mask"] is mask and mask[1].sum() == 5, "the input is not changed"
