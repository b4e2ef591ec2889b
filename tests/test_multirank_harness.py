"""The multi-rank harness itself: values come back, failures, crashes and hangs are reported,
not hung."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from tests.multirank import MultiRankError, run_on_ranks


def _all_reduce_rank() -> int:
    value = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(value)
    return int(value.item())


def _rank_one_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _segfault_in_native_code() -> None:
    import ctypes

    ctypes.string_at(0)


def _rank_one_crashes() -> None:
    if dist.get_rank() == 1:
        _segfault_in_native_code()
    dist.barrier()


def _rank_zero_sleeps() -> None:
    if dist.get_rank() == 0:
        time.sleep(60)


@pytest.mark.multirank
def test_values_and_failures_are_reported() -> None:
    assert run_on_ranks(_all_reduce_rank, world_size=3, timeout_s=60) == [6, 6, 6]
    with pytest.raises(MultiRankError, match="boom on rank one"):
        run_on_ranks(_rank_one_raises, world_size=2, timeout_s=30)
    with pytest.raises(MultiRankError, match=r"(?s)rank 1 .*exited with code -11 without "
                                             r"reporting; its threads when it died:.*"
                                             r"in _segfault_in_native_code.*in _rank_one_crashes"):
        run_on_ranks(_rank_one_crashes, world_size=2, timeout_s=30)
    start = time.monotonic()
    with pytest.raises(MultiRankError, match=r"ranks \[0\] still running"):
        run_on_ranks(_rank_zero_sleeps, world_size=2, timeout_s=12)
    assert time.monotonic() - start < 30
