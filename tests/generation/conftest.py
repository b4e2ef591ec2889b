"""Fixtures of the generation tests: a one-process world and a tiny model."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.generation.helpers import build_tiny


@pytest.fixture(scope="session")
def world() -> Iterator[None]:
    """A gloo world of one process (in the pytest process) with megatron's CPU compatibility."""
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.runtime.distributed import destroy_distributed

    initialize_runtime()
    yield
    destroy_distributed()


@pytest.fixture(scope="session")
def tiny(world):
    """``(model, pg_collection)`` of the shared tiny LM."""
    return build_tiny()
