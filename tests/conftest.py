"""Shared pytest set-up: one thread per test process on these 2-core machines; every gloo rank
the tests start (in-process, forked or launched by torchrun) answers with NCCL's semantics
(``testing/nccl_semantics.py``; ``MEGATRON_RLHF_NCCL_SEMANTICS=0`` turns it off); GPU tests
skip without CUDA; the quickstart's main command runs once for the tests that read it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from megatron_rlhf.testing.nccl_semantics import ENV as NCCL_SEMANTICS
from tests.helpers.quickstart import MainJob, make_workdir, run_main_job

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


@pytest.fixture(scope="session")
def quickstart_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The scratch directory docs/quickstart.md's commands run in (tests/helpers/quickstart.py)."""
    return make_workdir(tmp_path_factory.mktemp("quickstart"))


@pytest.fixture(scope="session")
def quickstart_main_job(quickstart_workdir: Path) -> MainJob:
    """docs/quickstart.md's main command (the chained SFT -> reward model -> PPO job of
    ``tools/run_pipeline.py``, tiny flags added), run once for tests/test_quickstart.py and
    tests/engine/test_pipeline.py: both check the same job, whose start-up under torchrun
    dominates its time."""
    return run_main_job(quickstart_workdir)
