"""A pytest plugin of scripts/gpu_check.sh: ``-p gpu_check_shard --gpu-shard I/N`` keeps the
collected tests at positions I, I + N, I + 2N, ... (after ``-m`` has deselected), so N pytest
processes side by side run each test once (scripts/ must be on ``PYTHONPATH``)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--gpu-shard", default="0/1", help="I/N: run every N-th test from the I-th")


def shard_of(items: list, shard: str) -> tuple[list, list]:
    """``(kept, dropped)``: the items at positions ``I, I + N, ...`` of ``shard`` = ``"I/N"``."""
    index, count = (int(part) for part in shard.split("/"))
    if not 0 <= index < count:
        raise pytest.UsageError(f"--gpu-shard {shard}: need 0 <= I < N")
    kept = [item for position, item in enumerate(items) if position % count == index]
    return kept, [item for position, item in enumerate(items) if position % count != index]


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    kept, dropped = shard_of(items, config.getoption("gpu_shard"))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept
