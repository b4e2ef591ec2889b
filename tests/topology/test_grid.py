"""Pure rank arithmetic agrees with Megatron's HyperCommGrid, without a process group."""

from __future__ import annotations

import pytest

from megatron_rlhf.topology.grid import GridCoords, grid_coords, grid_rank, grid_rank_enum

DIM_SETS = (["tp"], ["cp"], ["dp"], ["pp"], ["tp", "pp"], ["tp", "cp"], ["cp", "dp"],
            ["tp", "cp", "dp"], ["tp", "cp", "dp", "pp"])


def test_rank_and_coords_are_inverse() -> None:
    shape = (2, 1, 3, 2)
    for rank in range(5, 17):
        coords = grid_coords(5, shape, rank)
        assert grid_rank(5, shape, coords) == rank
    assert grid_coords(5, shape, 5 + 2 * 3 + 1) == GridCoords(tp=1, cp=0, dp=0, pp=1)
    with pytest.raises(ValueError, match=r"rank 17 is not in the grid's ranks \[5, 17\)"):
        grid_coords(5, shape, 17)
    with pytest.raises(ValueError, match="unknown grid dimensions"):
        grid_rank_enum(0, shape, ["ep"])


@pytest.mark.parametrize("shape,offset", [((2, 1, 2, 2), 4), ((8, 1, 4, 2), 0), ((1, 1, 3, 1), 5),
                                          ((4, 1, 1, 4), 16)])
def test_enumeration_matches_hyper_comm_grid(shape: tuple[int, ...], offset: int,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.hyper_comm_grid import HyperCommGrid

    monkeypatch.setenv("WORLD_SIZE", "128")  # HyperCommGrid reads it instead of a process group
    grid = HyperCommGrid(list(shape), ["tp", "cp", "dp", "pp"], rank_offset=offset)
    for dims in DIM_SETS:
        assert grid_rank_enum(offset, shape, dims) == grid.get_rank_enum(dims), dims
