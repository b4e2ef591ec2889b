"""Weight versions of sampled tokens, how stale they are when trained on, and the answers too
stale to train on.

The weights after ``v`` training steps are version ``v``: step ``k`` trains version ``k`` into
``k + 1``, and the shadows hold version ``k`` while they generate during step ``k`` (they
receive ``k + 1`` at its end). Each response token records the version that sampled it, in the
experience's ``weight_version`` field (``[B, R]``, -1 at padding); the step that trains on it
reads its staleness as ``step - version``. Synchronously every token has staleness 0; under
asynchronous separation ``rollout.max_staleness`` at most. An answer is *partial* when its
tokens come from more than one version (partial rollouts), and is dropped, with the rest of its
group, when one of its tokens is staler than ``rollout.max_staleness``: it then keeps its rows
(the batch's shape does not change) but none of its tokens is trained on.
"""

from __future__ import annotations

import torch

from megatron_rlhf.engine.execution.experience_fields import VERSION_FIELD as VERSION_FIELD

NO_TOKEN = -1
"""``weight_version`` at padding."""


def token_versions(response_mask: torch.Tensor, version: int) -> torch.Tensor:
    """Every response token sampled under ``version``: ``[B, R]`` int64, -1 at padding."""
    return torch.where(response_mask.bool(), version, NO_TOKEN).long()


def staleness_metrics(versions: torch.Tensor, response_mask: torch.Tensor, step: int,
                      dropped: int = 0) -> dict[str, float]:
    """What step ``step`` trains on, by the versions of its tokens.

    Args:
        versions: ``[B, R]`` each token's weight version (``token_versions``).
        response_mask: ``[B, R]`` 0/1 mask of real response tokens.
        step: the training step, i.e. the version of the trainer's weights.
        dropped: answers dropped as too stale (``stale_answers``).

    Returns:
        ``rollout/staleness_mean`` (over tokens) and ``_max``, ``rollout/versions_per_answer``
        (distinct versions per answer with a response, mean), ``rollout/partial_fraction`` (the
        fraction of those answers with more than one) and ``rollout/dropped_stale``.
    """
    mask = response_mask.bool()
    staleness = (step - versions)[mask].double()
    answers = mask.any(dim=1)
    counts = [len(set(row[row_mask].tolist())) for row, row_mask, real
              in zip(versions, mask, answers, strict=True) if real]
    return {
        "rollout/staleness_mean": staleness.mean().item() if staleness.numel() else 0.0,
        "rollout/staleness_max": staleness.max().item() if staleness.numel() else 0.0,
        "rollout/versions_per_answer": sum(counts) / len(counts) if counts else 0.0,
        "rollout/partial_fraction": (sum(count > 1 for count in counts) / len(counts)
                                     if counts else 0.0),
        "rollout/dropped_stale": float(dropped),
    }


def stale_answers(versions: torch.Tensor, response_mask: torch.Tensor, step: int,
                  max_staleness: int, group_size: int) -> torch.Tensor:
    """``[B]`` bool: the answers step ``step`` must not train on, whole groups at a time.

    An answer is stale when one of its tokens was sampled more than ``max_staleness`` versions
    before ``step``; a group (``group_size`` contiguous rows, the responses to one prompt) is
    dropped with any stale answer in it, as a group baseline needs all of its answers.

    Raises:
        ValueError: ``group_size`` does not divide the rows.
    """
    rows = versions.shape[0]
    if rows % group_size:
        raise ValueError(f"group_size({group_size}) does not divide the {rows} answers")
    mask = response_mask.bool()
    oldest = torch.where(mask, versions, step).min(dim=1).values
    stale = step - oldest > max_staleness
    return stale.view(-1, group_size).any(dim=1).repeat_interleave(group_size)


def drop_answers(fields: dict[str, torch.Tensor], dropped: torch.Tensor
                 ) -> dict[str, torch.Tensor]:
    """``fields`` with no response token left in the ``dropped`` rows: their ``response_mask``
    is zero, so no loss or metric of the training stage counts them."""
    keep = (~dropped).to(fields["response_mask"].dtype)[:, None]
    return {**fields, "response_mask": fields["response_mask"] * keep}
