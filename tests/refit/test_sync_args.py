"""build_weight_sync's per-rank argument checks, without a process group."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.refit import ModelLayout
from megatron_rlhf.refit.sync import _local_shards


def _group(rank: int, size: int) -> SimpleNamespace:
    return SimpleNamespace(rank=lambda: rank, size=lambda: size)


def _pgc(tp: tuple[int, int], pp: tuple[int, int] = (0, 1), dp: tuple[int, int] = (0, 1)):
    return SimpleNamespace(tp=_group(*tp), pp=_group(*pp), dp=_group(*dp))


MODEL = torch.nn.Linear(2, 2)


def test_rank_outside_the_layout_contributes_nothing() -> None:
    assert _local_shards("src", None, None, ModelLayout(0, tp=2), rank=3, world_size=4) is None


@pytest.mark.parametrize("model,pgc,rank,message", [
    (None, None, 1, "rank 1 holds a part of the src model .* but src_model is None"),
    (MODEL, _pgc((0, 1)), 2, "rank 2 does not hold a part of the src model"),
    (MODEL, None, 0, "src_model and src_pg_collection must both be given"),
    (MODEL, _pgc((0, 1)), 1, r"src_pg_collection.tp has rank 0 of 1 on rank 1, src_layout says 1"),
    (MODEL, _pgc((1, 2), dp=(0, 2)), 1, r"src_pg_collection.dp has rank 0 of 2"),
])
def test_arguments_that_contradict_the_layout_are_refused(model, pgc, rank, message) -> None:
    with pytest.raises(ValueError, match=message):
        _local_shards("src", model, pgc, ModelLayout(0, tp=2), rank=rank, world_size=4)


def test_layout_beyond_the_world_is_refused() -> None:
    with pytest.raises(ValueError, match="covers ranks 2..5 but the world has 4 ranks"):
        _local_shards("dst", None, None, ModelLayout(2, tp=4), rank=0, world_size=4)
