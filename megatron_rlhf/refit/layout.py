"""What the refit planner knows about a model: its rank grid and each rank's parameter shards.

Pure data, identical on every rank once gathered; no process group is needed to build or plan it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_rlhf.models.weights import ShardRule
from megatron_rlhf.topology.grid import GridCoords, grid_coords

Box = tuple[tuple[int, int], ...]
"""A rectangular region of a tensor: ``(start, stop)`` per dimension."""


def box_slices(box: Box) -> tuple[slice, ...]:
    """The index of ``box`` (``tensor[box_slices(box)]``)."""
    return tuple(slice(start, stop) for start, stop in box)


def box_numel(box: Box) -> int:
    """Number of elements in ``box``."""
    numel = 1
    for start, stop in box:
        numel *= stop - start
    return numel


class LayoutLike(Protocol):
    """Anything with a model's rank block and grid sizes (``topology.ModelPlacement`` is one)."""

    rank_offset: int
    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class ModelLayout:
    """One model's contiguous block of global ranks and its (tp, dp, pp) grid.

    Ranks are laid out as Megatron's ``HyperCommGrid([tp, 1, dp, pp], rank_offset)``: TP fastest,
    PP slowest (see ``topology/grid.py``).

    Attributes:
        rank_offset: the model's first global rank.
        tp: tensor-parallel size.
        pp: pipeline-parallel size.
        dp: data-parallel size (number of replicas).
    """

    rank_offset: int
    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if self.rank_offset < 0:
            raise ValueError(f"layout.rank_offset={self.rank_offset} must be >= 0")
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"layout.{name}={value!r} must be an integer >= 1")

    @classmethod
    def of(cls, layout: LayoutLike) -> ModelLayout:
        """The layout of a ``ModelPlacement`` (or of anything shaped like one)."""
        return cls(layout.rank_offset, tp=layout.tp, pp=layout.pp, dp=layout.dp)

    @property
    def size(self) -> int:
        """Number of ranks: ``tp * dp * pp``."""
        return self.tp * self.dp * self.pp

    @property
    def ranks(self) -> range:
        """The model's global ranks."""
        return range(self.rank_offset, self.rank_offset + self.size)

    def holds(self, rank: int) -> bool:
        """Whether global ``rank`` holds a part of the model."""
        return rank in self.ranks

    def coords(self, rank: int) -> GridCoords:
        """Grid coordinates of global ``rank``."""
        return grid_coords(self.rank_offset, (self.tp, 1, self.dp, self.pp), rank)


@dataclass(frozen=True)
class ParamShard:
    """One local parameter: its local name, where it sits in the full tensor, shape and dtype."""

    local_name: str
    rule: ShardRule
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class RankShards:
    """Every parameter one rank holds of one model, with the rank's grid position.

    Attributes:
        rank: global rank.
        tp_rank: position in the TP group.
        tp_size: TP group size.
        pp_rank: pipeline stage.
        dp_rank: data-parallel replica.
        params: the rank's parameters in ``named_parameters`` order.
    """

    rank: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    dp_rank: int
    params: tuple[ParamShard, ...]


@dataclass(frozen=True)
class Piece:
    """A region of a local shard and the region of the full (unpadded) tensor it holds."""

    local: Box
    full: Box


def shard_pieces(shard: ParamShard, tp_rank: int, tp_size: int) -> tuple[list[Piece], list[Box]]:
    """Map a local shard onto its full tensor.

    The shard is cut along one dimension into segments: one for a TP-sharded or replicated
    tensor, two for SwiGLU's ``[gate; up]`` fc1 shard. Vocabulary rows at or beyond the real
    vocabulary are padding, which belongs to no full-tensor region.

    Returns:
        ``(pieces, padding)``: the pieces holding real values and the local boxes of padding.

    Raises:
        ValueError: the rule cannot describe this shape (odd GLU rows, vocabulary on dim > 0).
    """
    rule, shape = shard.rule, shard.shape
    dim = 0 if rule.partition_dim is None else rule.partition_dim
    if rule.vocab_rows is not None and dim != 0:
        raise ValueError(f"{rule.global_name}: vocabulary rows must be dim 0, the rule "
                         f"partitions dim {dim}; fix its ShardRule")
    rows = shape[dim]
    if rule.partition_dim is None:
        segments = [(0, 0, rows)]
    elif rule.glu_halves:
        if rows % 2:
            raise ValueError(f"{rule.global_name}: a SwiGLU fc1 shard needs an even number of "
                             f"rows, got {rows}")
        half = rows // 2
        segments = [(0, tp_rank * half, half), (half, (tp_size + tp_rank) * half, half)]
    else:
        segments = [(0, tp_rank * rows, rows)]
    pieces: list[Piece] = []
    padding: list[Box] = []
    limit = rule.vocab_rows
    for local_start, full_start, length in segments:
        real = length if limit is None else max(0, min(length, limit - full_start))
        if real > 0:
            pieces.append(Piece(_with_dim(shape, dim, local_start, real),
                                _with_dim(shape, dim, full_start, real)))
        if real < length:
            padding.append(_with_dim(shape, dim, local_start + real, length - real))
    return pieces, padding


def full_shape(shard: ParamShard, tp_size: int) -> tuple[int, ...]:
    """Shape of the full (TP1, unpadded) tensor a shard belongs to."""
    shape = list(shard.shape)
    if shard.rule.partition_dim is not None:
        shape[shard.rule.partition_dim] *= tp_size
    if shard.rule.vocab_rows is not None:
        shape[0] = shard.rule.vocab_rows
    return tuple(shape)


def _with_dim(shape: tuple[int, ...], dim: int, start: int, length: int) -> Box:
    return tuple((start, start + length) if d == dim else (0, extent)
                 for d, extent in enumerate(shape))
