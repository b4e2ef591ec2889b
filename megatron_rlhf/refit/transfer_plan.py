"""Pure refit planning: which source rank sends which region of which parameter to whom.

    plan = plan_refit(src_shards, dst_shards)     # lists of RankShards, one per rank
    plan.transfers                                # Transfer(src_rank, dst_rank, name, boxes)
    plan.zero_fills                               # padded vocabulary rows of the destination

Both sides are described by ``RankShards`` (grid position plus each local parameter's
``ShardRule`` and shape), so the planner runs without a process group and every rank computes
the same plan. For every destination shard it picks ONE source copy (the TP shards of one
data-parallel replica's pipeline stage holding the parameter, see ``CopyKey``): the copy that leaves the fewest elements to send over the
network (a shard already on the destination rank is a local copy), then the one whose busiest
sender is least loaded so far, then the lowest (dp, pp, tp) key.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_rlhf.refit.layout import (
    Box,
    ParamShard,
    Piece,
    RankShards,
    box_numel,
    full_shape,
    shard_pieces,
)

CopyKey = tuple[int, int, int]
"""A whole source copy of a parameter: (dp replica, pipeline stage, tp rank).

A TP-sharded parameter's copy is the stage's whole TP group (tp rank 0 in the key); a
TP-replicated one (norms) is whole on every TP rank, so each TP rank is a copy of its own.
"""


@dataclass(frozen=True)
class Transfer:
    """Copy one region of a source parameter into a region of a destination parameter.

    Attributes:
        task_id: index in the plan; the send and the receive share it (megatron's ``task_id``).
        src_rank: global rank that holds the source parameter.
        dst_rank: global rank that holds the destination parameter.
        global_name: the parameter's name in the full (TP1/PP1) model.
        src_name: local parameter name in the source model on ``src_rank``.
        dst_name: local parameter name in the destination model on ``dst_rank``.
        src_box: region of the source parameter.
        dst_box: region of the destination parameter (same extents as ``src_box``).
    """

    task_id: int
    src_rank: int
    dst_rank: int
    global_name: str
    src_name: str
    dst_name: str
    src_box: Box
    dst_box: Box

    @property
    def numel(self) -> int:
        """Elements copied."""
        return box_numel(self.dst_box)

    @property
    def is_local(self) -> bool:
        """Source and destination are on the same rank (no communication)."""
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class ZeroFill:
    """A region of a destination parameter with no source: padded vocabulary rows."""

    rank: int
    local_name: str
    box: Box


@dataclass
class RefitPlan:
    """Every transfer and zero fill of one source -> destination synchronisation."""

    transfers: list[Transfer] = field(default_factory=list)
    zero_fills: list[ZeroFill] = field(default_factory=list)

    def sends(self, rank: int) -> list[Transfer]:
        """Transfers whose source is ``rank`` (local copies included)."""
        return [t for t in self.transfers if t.src_rank == rank]

    def receives(self, rank: int) -> list[Transfer]:
        """Transfers whose destination is ``rank`` (local copies included)."""
        return [t for t in self.transfers if t.dst_rank == rank]

    def zero_fills_on(self, rank: int) -> list[ZeroFill]:
        """Padding regions of ``rank``'s destination parameters."""
        return [z for z in self.zero_fills if z.rank == rank]

    def remote_elements_sent(self) -> dict[int, int]:
        """Elements each source rank sends over the network (local copies excluded)."""
        sent: dict[int, int] = defaultdict(int)
        for transfer in self.transfers:
            if not transfer.is_local:
                sent[transfer.src_rank] += transfer.numel
        return dict(sent)


@dataclass(frozen=True)
class _Held:
    """One source rank's shard of a parameter."""

    rank: int
    local_name: str
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class _Move:
    src_rank: int
    src_name: str
    src_box: Box
    dst_box: Box


@dataclass
class _SourceParam:
    """Every source copy of one global parameter."""

    full_shape: tuple[int, ...]
    dtype: torch.dtype
    copies: dict[CopyKey, list[_Held]] = field(default_factory=dict)


def plan_refit(src: Sequence[RankShards], dst: Sequence[RankShards]) -> RefitPlan:
    """Plan the copy of every destination parameter from the source model.

    Args:
        src: the source model's ranks (any order).
        dst: the destination model's ranks (any order; may share ranks with ``src``).

    Returns:
        The plan; transfers are ordered by destination rank, then parameter, then region.

    Raises:
        ValueError: a destination parameter has no source, a different full shape or dtype, or
            a source copy that does not cover it.
    """
    sources = _index_sources(src)
    load: dict[int, int] = defaultdict(int)
    plan = RefitPlan()
    for rank_shards in sorted(dst, key=lambda r: r.rank):
        for shard in rank_shards.params:
            pieces, padding = shard_pieces(shard, rank_shards.tp_rank, rank_shards.tp_size)
            plan.zero_fills.extend(ZeroFill(rank_shards.rank, shard.local_name, box)
                                   for box in padding)
            source = _matching_source(sources, shard, rank_shards)
            moves = _choose_copy(source, pieces, rank_shards.rank, load, shard)
            for move in moves:
                transfer = Transfer(len(plan.transfers), move.src_rank, rank_shards.rank,
                                    shard.rule.global_name, move.src_name, shard.local_name,
                                    move.src_box, move.dst_box)
                plan.transfers.append(transfer)
                if not transfer.is_local:
                    load[transfer.src_rank] += transfer.numel
    return plan


def _index_sources(src: Iterable[RankShards]) -> dict[str, _SourceParam]:
    sources: dict[str, _SourceParam] = {}
    for rank_shards in sorted(src, key=lambda r: r.rank):
        for shard in rank_shards.params:
            name = shard.rule.global_name
            tp_key = rank_shards.tp_rank if shard.rule.partition_dim is None else 0
            key = (rank_shards.dp_rank, rank_shards.pp_rank, tp_key)
            shape = full_shape(shard, rank_shards.tp_size)
            source = sources.setdefault(name, _SourceParam(shape, shard.dtype))
            if (source.full_shape, source.dtype) != (shape, shard.dtype):
                raise ValueError(
                    f"source parameter {name!r} is {shape} {shard.dtype} on rank "
                    f"{rank_shards.rank} but {source.full_shape} {source.dtype} elsewhere: every "
                    "source rank must hold the same model")
            pieces, _ = shard_pieces(shard, rank_shards.tp_rank, rank_shards.tp_size)
            source.copies.setdefault(key, []).append(
                _Held(rank_shards.rank, shard.local_name, tuple(pieces)))
    return sources


def _matching_source(sources: dict[str, _SourceParam], shard: ParamShard,
                     rank_shards: RankShards) -> _SourceParam:
    name = shard.rule.global_name
    source = sources.get(name)
    where = f"destination parameter {name!r} ({shard.local_name} on rank {rank_shards.rank})"
    if source is None:
        raise ValueError(f"{where} has no source: build source and destination with the same "
                         f"architecture and head (source has {sorted(sources)[:6]}...)")
    shape = full_shape(shard, rank_shards.tp_size)
    if shape != source.full_shape:
        raise ValueError(f"{where}: full shape {shape} differs from the source's "
                         f"{source.full_shape}; build both models with the same architecture")
    if shard.dtype != source.dtype:
        raise ValueError(f"{where}: dtype {shard.dtype} differs from the source's "
                         f"{source.dtype}; build both models with the same params_dtype")
    return source


def _choose_copy(source: _SourceParam, pieces: list[Piece], dst_rank: int,
                 load: dict[int, int], shard: ParamShard) -> list[_Move]:
    """The moves from the best source copy (see the module docstring for the order)."""
    needed = sum(box_numel(piece.local) for piece in pieces)
    options: list[tuple[tuple[int, int, CopyKey], list[_Move]]] = []
    for key in sorted(source.copies):
        moves = _moves(source.copies[key], pieces)
        covered = sum(box_numel(move.dst_box) for move in moves)
        if covered != needed:
            raise ValueError(
                f"source copy (dp={key[0]}, pp={key[1]}, tp={key[2]}) of {shard.rule.global_name!r} covers "
                f"{covered} of the {needed} elements rank {dst_rank} needs: a TP rank of that "
                "copy is missing from the source description")
        remote: dict[int, int] = defaultdict(int)
        for move in moves:
            if move.src_rank != dst_rank:
                remote[move.src_rank] += box_numel(move.dst_box)
        busiest = max((load[rank] + numel for rank, numel in remote.items()), default=0)
        options.append(((sum(remote.values()), busiest, key), moves))
    return min(options, key=lambda option: option[0])[1]


def _moves(held: list[_Held], pieces: list[Piece]) -> list[_Move]:
    """Every overlap of a source copy's pieces with the destination's, ordered by destination."""
    moves = []
    for dst_piece in pieces:
        for source in held:
            for src_piece in source.pieces:
                overlap = _intersect(src_piece.full, dst_piece.full)
                if overlap is not None:
                    moves.append(_Move(source.rank, source.local_name,
                                       _to_local(overlap, src_piece), _to_local(overlap, dst_piece)))
    moves.sort(key=lambda move: move.dst_box)
    return moves


def _intersect(left: Box, right: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(left, right, strict=True))
    return box if all(start < stop for start, stop in box) else None


def _to_local(full_region: Box, piece: Piece) -> Box:
    return tuple((start - f0 + l0, stop - f0 + l0) for (start, stop), (f0, _), (l0, _)
                 in zip(full_region, piece.full, piece.local, strict=True))
