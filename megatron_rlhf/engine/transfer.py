"""Moving batch rows between the rank sets of different models.

Every field of a PPO batch (token ids, masks, log-probs, values, ...) is a tensor whose first
dimension is the batch. A :class:`RowLayout` says which contiguous rows each rank holds or needs:
a DP replica of a model needs its shard on all of its ranks; a model's outputs are held by the
ranks of its last pipeline stage; the trainers need every row. Moving a batch from one layout to
another is planned by the pure function :func:`plan_transfers` (every rank computes the same plan,
so no metadata is exchanged) and executed with batched asynchronous point-to-point operations by
:func:`execute_transfers`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_rlhf.runtime.device import comm_device


@dataclass(frozen=True)
class RowLayout:
    """Rows ``[start, end)`` of a batch of ``batch_size`` rows held (or needed) by each rank.

    Ranks absent from ``rows`` hold nothing.
    """

    batch_size: int
    rows: Mapping[int, tuple[int, int]]

    def __post_init__(self) -> None:
        for rank, (start, end) in self.rows.items():
            if not 0 <= start <= end <= self.batch_size:
                raise ValueError(f"rank {rank}: rows [{start}, {end}) outside a batch of "
                                 f"{self.batch_size}")

    @classmethod
    def replicated(cls, batch_size: int, ranks: list[int] | range) -> RowLayout:
        """Every listed rank holds every row."""
        return cls(batch_size, {rank: (0, batch_size) for rank in ranks})

    @classmethod
    def sharded(cls, batch_size: int, replicas: list[list[int]]) -> RowLayout:
        """Replica ``d`` (a list of ranks) holds the ``d``-th of ``len(replicas)`` equal shards.

        Raises:
            ValueError: the batch does not split evenly.
        """
        if batch_size % len(replicas):
            raise ValueError(f"batch of {batch_size} rows does not split over {len(replicas)} "
                             "data-parallel replicas; make the batch a multiple of the DP size")
        shard = batch_size // len(replicas)
        return cls(batch_size, {rank: (d * shard, (d + 1) * shard)
                                for d, ranks in enumerate(replicas) for rank in ranks})

    def held_by(self, rank: int) -> tuple[int, int] | None:
        """The row range of ``rank`` or None."""
        return self.rows.get(rank)


@dataclass(frozen=True)
class Transfer:
    """Rows ``[start, end)`` go from ``src`` to ``dst`` (``src == dst``: a local copy)."""

    src: int
    dst: int
    start: int
    end: int


def plan_transfers(source: RowLayout, target: RowLayout,
                   node_of: Callable[[int], int] = lambda rank: 0) -> list[Transfer]:
    """Plan how every rank of ``target`` obtains its rows from the holders in ``source``.

    A rank that already holds rows copies them locally; other rows come from a holder on the same
    node when there is one, else from the least loaded holder. The result is deterministic.

    Raises:
        ValueError: some needed rows are held by no rank.
    """
    if source.batch_size != target.batch_size:
        raise ValueError(f"source holds {source.batch_size} rows, target expects "
                         f"{target.batch_size}")
    load: dict[int, int] = {rank: 0 for rank in source.rows}
    plan: list[Transfer] = []
    for dst in sorted(target.rows):
        start, end = target.rows[dst]
        row = start
        while row < end:
            holders = [r for r, (s, e) in sorted(source.rows.items()) if s <= row < e]
            if not holders:
                raise ValueError(f"row {row} needed by rank {dst} is held by no rank")
            if dst in holders:
                src = dst
            else:
                src = min(holders, key=lambda r: (node_of(r) != node_of(dst), load[r], r))
            stop = min(end, source.rows[src][1])
            plan.append(Transfer(src, dst, row, stop))
            if src != dst:
                load[src] += stop - row
            row = stop
    return plan


def execute_transfers(plan: list[Transfer], source: RowLayout, target: RowLayout,
                      fields: Mapping[str, torch.Tensor] | None,
                      schema: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
                      pending_sends: list | None = None) -> dict[str, torch.Tensor] | None:
    """Run ``plan`` on this rank: send what it holds, receive what it needs.

    Every rank of the job calls this with the same plan (ranks in neither layout return at once).
    Ranks are global ranks of the default process group. Received rows land on the device the
    default group's backend communicates from (this rank's GPU under NCCL, the CPU under gloo);
    rows sent from another device are staged there first.

    Args:
        plan: from :func:`plan_transfers` for ``source`` and ``target``.
        fields: this rank's rows of each field (``source.held_by(rank)`` rows), or None.
        schema: every field's dtype and per-row shape, known to all ranks.
        pending_sends: if given, this rank's sends are left in flight and their work handles
            appended here (with the tensors they read), so the rank can go on computing; the
            caller waits on them later. Receives always complete before returning.

    Returns:
        This rank's rows of every field under ``target``, or None if it needs none.
    """
    rank = dist.get_rank()
    device = comm_device()
    mine_src, mine_dst = source.held_by(rank), target.held_by(rank)
    outputs: dict[str, torch.Tensor] | None = None
    if mine_dst is not None:
        rows = mine_dst[1] - mine_dst[0]
        outputs = {name: torch.empty((rows, *shape), dtype=dtype, device=device)
                   for name, (dtype, shape) in schema.items()}
    ops: list[dist.P2POp] = []
    sends: list[torch.Tensor] = []
    for transfer in plan:
        if transfer.src == rank and transfer.dst == rank:
            for name in schema:
                outputs[name][transfer.start - mine_dst[0]:transfer.end - mine_dst[0]] = (
                    fields[name][transfer.start - mine_src[0]:transfer.end - mine_src[0]])
        elif transfer.src == rank:
            for name in schema:
                chunk = fields[name][transfer.start - mine_src[0]:transfer.end - mine_src[0]]
                sends.append(chunk.to(device, schema[name][0]).contiguous())
                # World: plans name global ranks, which may belong to any models.
                ops.append(dist.P2POp(dist.isend, sends[-1], transfer.dst, group=dist.group.WORLD))
        elif transfer.dst == rank:
            for name in schema:
                view = outputs[name][transfer.start - mine_dst[0]:transfer.end - mine_dst[0]]
                ops.append(dist.P2POp(dist.irecv, view, transfer.src, group=dist.group.WORLD))
    if ops:
        requests = dist.batch_isend_irecv(ops)
        for op, request in zip(ops, requests, strict=True):
            if pending_sends is not None and op.op is dist.isend:
                pending_sends.append((request, op.tensor))
            else:
                request.wait()
    return outputs
