"""Fixtures of the generation tests: a one-process world and a tiny model."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from megatron_rlhf.generation import GenerationOutput
from tests.generation.helpers import (
    BASE,
    MIN_MARGIN,
    build_tiny,
    decision_margin,
    generate_tiny,
)


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


@pytest.fixture(scope="session")
def end_ids(tiny) -> tuple[int, int]:
    """Two end ids that the static loop emits early in some rows and late or never in others."""
    free = generate_tiny(tiny, dataclasses.replace(BASE, batching="static", stop_at_eos=False), None)
    # Every test that compares two decode paths of the BASE prompts makes a subset of these
    # decisions: none may sit on a near-tie that another CPU's rounding could flip.
    margin = decision_margin(tiny, free, BASE, list(range(30, 30 + free.input_ids.shape[0])))
    assert margin > MIN_MARGIN, f"BASE.seed={BASE.seed}: a decision {margin:.1e} from a tie"
    responses = free.responses.tolist()
    return responses[0][2], responses[5][6]


@pytest.fixture(scope="session")
def static_reference(tiny, end_ids) -> GenerationOutput:
    out = generate_tiny(tiny, dataclasses.replace(BASE, batching="static", stop_check_interval=1),
                    end_ids)
    lengths = out.response_lengths
    assert lengths.min() < 7 and lengths.max() == BASE.max_new_tokens, "lengths must vary"
    return out
