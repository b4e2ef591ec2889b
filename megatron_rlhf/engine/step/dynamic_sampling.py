"""DAPO's dynamic sampling: train only on groups whose responses were scored differently.

A group (the ``samples_per_prompt`` responses to one prompt) whose sequence scores are all equal
has a zero group-relative advantage, so it only dilutes the batch. With
``algorithm.dynamic_sampling`` such groups are dropped and further prompts are generated and
scored in refill rounds, at most ``algorithm.max_refill_rounds`` of them, until the step has
``prompts_per_step`` informative groups. The batch keeps its fixed shape: the first
``prompts_per_step`` informative groups in generation order, topped up with dropped groups
(earliest first) when the bound is reached, so every placement, asynchronous rollouts and
checkpoints see the same rows per step.

Which groups are kept is decided from the scores on the trainer ranks (they hold every row) and
broadcast to every rank, because the generating ranks must agree on whether another round runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlhf.engine.execution.batch import DistBatch


def informative_groups(scores: torch.Tensor, samples_per_prompt: int) -> list[bool]:
    """Per group of ``samples_per_prompt`` contiguous rows: whether its scores are not all equal.

    A group holding a NaN counts as informative, so the non-finite checks downstream see it.
    """
    groups = scores.reshape(-1, samples_per_prompt)
    return (~(groups == groups[:, :1]).all(dim=1)).tolist()


def shared_decision(batch: DistBatch, decide) -> list[bool]:
    """``decide(batch.fields)`` computed by the lowest rank holding the rows, on every rank.

    Collective over all ranks (WORLD): every rank calls it at the same point of the step.
    """
    source = min(batch.layout.rows)
    decision = [decide(batch.fields) if dist.get_rank() == source else None]
    dist.broadcast_object_list(decision, src=source, group=dist.group.WORLD)
    return decision[0]


@dataclass
class GroupSelection:
    """Which ``(round, group)`` pairs make a step's batch, and the counts the metrics report."""

    chosen: list[tuple[int, int]]
    kept: int
    dropped: int
    rounds: int

    def metrics(self) -> dict[str, float]:
        """``dynamic_sampling/*``: informative groups trained on, all-equal groups generated,
        all-equal groups trained on because the refill bound was reached, generation rounds."""
        return {"dynamic_sampling/kept_groups": float(self.kept),
                "dynamic_sampling/dropped_groups": float(self.dropped),
                "dynamic_sampling/filled_groups": float(len(self.chosen) - self.kept),
                "dynamic_sampling/rounds": float(self.rounds)}


def select_groups(informative: list[list[bool]], wanted: int) -> GroupSelection:
    """The first ``wanted`` informative groups over the rounds (``informative[round][group]``),
    topped up with the earliest all-equal ones when there are too few."""
    pairs = [(r, g) for r, flags in enumerate(informative) for g in range(len(flags))]
    good = [(r, g) for r, g in pairs if informative[r][g]]
    bad = [(r, g) for r, g in pairs if not informative[r][g]]
    kept = good[:wanted]
    return GroupSelection(kept + bad[:wanted - len(kept)], len(kept), len(bad), len(informative))


def gather_groups(batches: list[DistBatch], chosen: list[tuple[int, int]],
                  samples_per_prompt: int) -> DistBatch:
    """The rows of the ``chosen`` groups, in that order, under the first batch's layout."""
    first = batches[0]
    fields = None
    if first.fields is not None:
        n = samples_per_prompt
        fields = {name: torch.cat([batches[r].fields[name][g * n:(g + 1) * n]
                                   for r, g in chosen])
                  for name in first.schema}
    return DistBatch(first.layout, first.schema, fields)
