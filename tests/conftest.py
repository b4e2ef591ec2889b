"""Shared pytest set-up: one thread per test process on these 2-core machines; every gloo rank
the tests start (in-process, forked or launched by torchrun) answers with NCCL's semantics
(``testing/nccl_semantics.py``; ``MEGATRON_RLHF_NCCL_SEMANTICS=0`` turns it off); GPU tests
skip without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

from megatron_rlhf.testing.nccl_semantics import ENV as NCCL_SEMANTICS

torch.set_num_threads(1)
os.environ.setdefault(NCCL_SEMANTICS, "1")


def pytest_collection_modifyitems(config, items) -> None:
    """Skip ``gpu``-marked tests, with the reason, on a machine without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run scripts/gpu_check.sh on a GPU)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
