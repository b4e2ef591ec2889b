"""A batch spread over ranks: which rows each rank holds, and the rows themselves.

``DistBatch`` is what flows between operators. Every rank holds a ``DistBatch`` for every batch of
the step (with ``fields=None`` where it holds no rows), so every rank can take part in moving it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlhf.engine.execution.transfer import (
    RowLayout,
    TransferChannels,
    execute_transfers,
    plan_transfers,
)
from megatron_rlhf.topology.plan import ModelPlacement

Schema = Mapping[str, tuple[torch.dtype, tuple[int, ...]]]


@dataclass
class DistBatch:
    """Rows of named fields laid out over ranks.

    Attributes:
        layout: which rows each global rank holds.
        schema: every field's dtype and per-row shape (identical on all ranks).
        fields: this rank's rows of every field, or None if it holds none.
    """

    layout: RowLayout
    schema: Schema
    fields: dict[str, torch.Tensor] | None

    @property
    def batch_size(self) -> int:
        """Rows of the whole batch."""
        return self.layout.batch_size

    def rows(self) -> tuple[int, int] | None:
        """This rank's row range, or None."""
        return self.layout.held_by(dist.get_rank())

    def moved_to(self, target: RowLayout, node_of=lambda rank: 0,
                  channels: TransferChannels | None = None) -> DistBatch:
        """The same batch under ``target`` (every rank of the job calls it).

        With ``channels`` the rows move on their pair's channel and this rank's sends stay in
        flight there (see ``execute_transfers``).
        """
        plan = plan_transfers(self.layout, target, node_of)
        fields = execute_transfers(plan, self.layout, target, self.fields, self.schema,
                                   channels)
        return DistBatch(target, self.schema, fields)

    def select(self, names: list[str]) -> DistBatch:
        """A batch with only the named fields (no communication)."""
        missing = [n for n in names if n not in self.schema]
        if missing:
            raise KeyError(f"batch has no fields {missing}; it has {sorted(self.schema)}")
        fields = None if self.fields is None else {n: self.fields[n] for n in names}
        return DistBatch(self.layout, {n: self.schema[n] for n in names}, fields)


def merge(batches: list[DistBatch], target: RowLayout, node_of=lambda rank: 0,
          channels: TransferChannels | None = None) -> DistBatch:
    """Move several batches of the same rows to ``target`` and join their fields."""
    schema: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    fields: dict[str, torch.Tensor] | None = None
    for batch in batches:
        moved = batch.moved_to(target, node_of, channels)
        schema.update(moved.schema)
        if moved.fields is not None:
            fields = {**(fields or {}), **moved.fields}
    return DistBatch(target, schema, fields)


def concat(parts: list[DistBatch]) -> DistBatch:
    """Stack batches that hold consecutive row chunks under the same replicated layout."""
    ranks = sorted(parts[0].layout.rows)
    rows = sum(part.batch_size for part in parts)
    fields = None
    if parts[0].fields is not None:
        fields = {name: torch.cat([part.fields[name] for part in parts])
                  for name in parts[0].schema}
    return DistBatch(RowLayout.replicated(rows, ranks), parts[0].schema, fields)


def replica_input_layout(model: ModelPlacement, batch_size: int) -> RowLayout:
    """Replica ``d`` of ``model`` needs shard ``d`` on all of its ranks (every TP and PP rank)."""
    return RowLayout.sharded(batch_size, [model.replica_ranks(d) for d in range(model.dp)])


def replica_output_layout(model: ModelPlacement, batch_size: int) -> RowLayout:
    """Replica ``d``'s results sit on the TP ranks of its last pipeline stage."""
    return RowLayout.sharded(batch_size, output_ranks(model))


def output_ranks(model: ModelPlacement) -> list[list[int]]:
    """The TP ranks of each replica's last pipeline stage, in DP order."""
    last = model.pp - 1
    return [[model.global_rank(tp, d, last) for tp in range(model.tp)] for d in range(model.dp)]
