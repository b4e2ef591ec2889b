"""Shared pytest set-up: one thread per test process on these 2-core machines; GPU tests skip
without CUDA."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items) -> None:
    """Skip ``gpu``-marked tests, with the reason, on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_check.sh on a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
