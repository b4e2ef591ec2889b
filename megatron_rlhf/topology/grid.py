"""Rank arithmetic of one model's (tp, cp, dp, pp) grid, as pure functions.

A model occupies the contiguous global ranks ``[offset, offset + tp * cp * dp * pp)``, laid out
as Megatron's ``HyperCommGrid(shape, ["tp", "cp", "dp", "pp"], rank_offset=offset)`` lays them
out: the first dimension varies fastest,

    rank = offset + tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))

so a TP group is a run of ``tp`` consecutive ranks (it stays inside a node when the model starts
on a node boundary and ``tp`` divides the node) and the pipeline stages are the slowest axis.
``grid_rank_enum`` returns exactly the enumeration ``HyperCommGrid.get_rank_enum`` returns, without
torch or a process group, so every rank can compute any group's membership.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import product

DIM_NAMES = ("tp", "cp", "dp", "pp")
"""Grid dimensions, fastest first (Megatron's tp-cp-ep-dp-pp order, with ep = 1)."""


@dataclass(frozen=True)
class GridCoords:
    """Coordinates of one rank in a model's grid."""

    tp: int
    cp: int
    dp: int
    pp: int


def grid_size(shape: Sequence[int]) -> int:
    """Number of ranks in a grid of ``shape`` (one size per ``DIM_NAMES`` entry)."""
    _check_shape(shape)
    size = 1
    for extent in shape:
        size *= extent
    return size


def grid_rank(offset: int, shape: Sequence[int], coords: GridCoords) -> int:
    """Global rank at ``coords`` in the grid of ``shape`` starting at ``offset``.

    Raises:
        ValueError: a coordinate is outside the grid.
    """
    _check_shape(shape)
    rank = 0
    for name, extent in reversed(list(zip(DIM_NAMES, shape, strict=True))):
        value = getattr(coords, name)
        if not 0 <= value < extent:
            raise ValueError(f"{name} coordinate {value} is outside [0, {extent})")
        rank = rank * extent + value
    return offset + rank


def grid_coords(offset: int, shape: Sequence[int], rank: int) -> GridCoords:
    """Coordinates of global ``rank`` in the grid of ``shape`` starting at ``offset``.

    Raises:
        ValueError: the rank is not in the grid.
    """
    size = grid_size(shape)
    if not offset <= rank < offset + size:
        raise ValueError(f"rank {rank} is not in the grid's ranks [{offset}, {offset + size})")
    local = rank - offset
    values = {}
    for name, extent in zip(DIM_NAMES, shape, strict=True):
        local, values[name] = divmod(local, extent)
    return GridCoords(**values)


def grid_rank_enum(offset: int, shape: Sequence[int], dims: str | Sequence[str]) -> list[list[int]]:
    """Members of every group spanning ``dims``, in ``HyperCommGrid.get_rank_enum`` order.

    Args:
        offset: first global rank of the grid.
        shape: one size per ``DIM_NAMES`` entry.
        dims: a dimension name or several; the group varies these and fixes the others.

    Returns:
        One rank list per group; each list is increasing.

    Raises:
        ValueError: an unknown dimension name.
    """
    _check_shape(shape)
    dims = [dims] if isinstance(dims, str) else list(dims)
    unknown = [d for d in dims if d not in DIM_NAMES]
    if unknown:
        raise ValueError(f"unknown grid dimensions {unknown}: use names from {DIM_NAMES}")
    extents = dict(zip(DIM_NAMES, shape, strict=True))
    strides = dict(zip(DIM_NAMES, _strides(shape), strict=True))
    slow_first = DIM_NAMES[::-1]
    fixed = [d for d in slow_first if d not in dims]
    varied = [d for d in slow_first if d in dims]
    inner = _offsets(varied, extents, strides)
    return [[offset + base + step for step in inner]
            for base in _offsets(fixed, extents, strides)]


def _strides(shape: Sequence[int]) -> list[int]:
    strides, stride = [], 1
    for extent in shape:
        strides.append(stride)
        stride *= extent
    return strides


def _offsets(dims: list[str], extents: dict[str, int], strides: dict[str, int]) -> list[int]:
    """Rank offsets of every combination of ``dims``, the last one varying fastest."""
    return [sum(i * strides[d] for d, i in zip(dims, index, strict=True))
            for index in product(*(range(extents[d]) for d in dims))]


def _check_shape(shape: Sequence[int]) -> None:
    if len(shape) != len(DIM_NAMES) or any(extent < 1 for extent in shape):
        raise ValueError(f"grid shape {list(shape)} must give one size >= 1 per {DIM_NAMES}")
