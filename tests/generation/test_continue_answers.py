"""Answers that go on across generate calls (``generation/answer_pool.py``, ``rollout.continue_answers``).

A pool call that finishes every answer it admits is ``generate_sequences``' call, bit for bit,
weight updates included. Across calls, an answer that outlives several calls records the version
of every token, counted by hand from the schedule of calls, stop checks and updates; each call
returns the oldest finished groups; and a pool that restarted its decoding answers for a
checkpoint continues exactly as one loaded from that checkpoint.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlhf.generation import GenerationOutput
from tests.generation.helpers import (
    BASE,
    PAD,
    SAMPLES,
    build_refit_models,
    make_prompts,
)

INTERVAL, SLOTS = 3, 4
CONFIG = dataclasses.replace(BASE, micro_batch_size=SLOTS, stop_check_interval=INTERVAL,
                             stop_at_eos=False, max_new_tokens=20)


@pytest.fixture(scope="module")
def models(world):
    """A model to generate with and two others to refit it from (other initial weights)."""
    return build_refit_models()


@pytest.fixture
def restored(models):
    """Puts the generating model's weights back after the test."""
    (model, _), *_ = models
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    yield
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(before[name])


def _updates(models, checks: set[int]):
    """``weight_updates`` that refits the model at the ``checks``-th poll, from the other
    models in turn; and a function that refits it now (an update between two calls)."""
    from megatron_rlhf.refit import ModelLayout, build_weight_sync

    (model, pgc), *sources = models
    syncs = [build_weight_sync(source, pgc, ModelLayout(0), model, pgc, ModelLayout(0))
             for source, _ in sources]
    count = {"polls": 0, "syncs": 0}

    def now() -> None:
        syncs[count["syncs"] % len(syncs)].sync()
        count["syncs"] += 1

    def poll() -> bool:
        count["polls"] += 1
        if count["polls"] in checks:
            now()
            return True
        return False

    return poll, now


def test_a_call_that_finishes_its_answers_is_generate_sequences(models, restored) -> None:
    """16 prompts of 20 tokens through 4 slots, the next step's 16 waiting behind them, and a
    hand-over at the 3rd stop check: the pool call is the plain call, bit for bit."""
    from megatron_rlhf.generation import AnswerPool, continue_sequences, generate_sequences

    (model, pgc), *_ = models
    prompts = [p for p in make_prompts([4, 9, 2, 6, 11, 3, 5, 7], seed=6) for _ in range(SAMPLES)]
    ids = list(range(30, 30 + len(prompts)))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    plain = generate_sequences(model, pgc, prompts, ids, CONFIG, eos_id=None, pad_id=PAD,
                               weight_updates=_updates(models, {3})[0])
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(before[name])
    pool = AnswerPool(SAMPLES)
    pool.add(prompts, ids, [20] * len(ids))
    # the next step's prompts wait behind this step's: the call ends before they enter
    out = continue_sequences(model, pgc, pool, prompts[::-1], [i + 100 for i in ids],
                             len(prompts) // SAMPLES, 7, CONFIG, None, PAD,
                             weight_updates=_updates(models, {3})[0])
    assert out.micro_batches == plain.micro_batches
    for field in dataclasses.fields(GenerationOutput):
        if field.name != "micro_batches":
            assert torch.equal(getattr(out, field.name), getattr(plain, field.name)), field.name
    assert out.response_versions.max() == 1, "versions are offsets from the call's (7)"
    assert pool.taken_ids == ids
    assert len(pool.waiting) == len(ids) and pool.in_flight == 0


def _run(pool, model, groups: int, version: int, poll) -> GenerationOutput:
    from megatron_rlhf.generation.continuous import ContinuousSettings

    settings = ContinuousSettings(CONFIG, None, PAD, 250, 64, keep_graphs=False,
                                  weight_updates=poll)
    model.eval()
    with torch.no_grad():
        return pool.run(model, None, groups, version, settings)


BUDGETS = [20, 20] + [7, 7] * 4
"""Group 0 answers 20 tokens, groups 1-4 answer 7: each of those ends at a call's 2nd stop
check (1 + 2 x 3 tokens), while group 0 goes on through four calls."""


def _pool():
    from megatron_rlhf.generation import AnswerPool

    pool = AnswerPool(SAMPLES, slots=SLOTS)
    prompts = make_prompts([5, 8, 3, 6, 4, 9, 2, 7, 5, 6], seed=2)
    pool.add(prompts, list(range(50, 60)), BUDGETS)
    return pool


def test_an_answer_over_four_calls_records_every_tokens_version(models, restored) -> None:
    """Call 1 (version 0) ends when group 1 does, group 0 at 7 tokens; an update before call 2
    (version 1), one at its 1st stop check (2) and at the 1st of call 3 (4, after one between
    calls: 3); call 4 finds group 0 done after 20 tokens. Each call returns one group, the
    oldest finished, and group 0's tokens carry every version from 0 to 4."""
    (model, _), *_ = models
    poll, now = _updates(models, {1, 2})  # the 1st stop checks of calls 2 and 3
    pool = _pool()
    taken, versions = [], []
    for call, version in enumerate((0, 1, 3, 4)):
        if call in (1, 2):
            now()
        out = _run(pool, model, 1, version, poll if call else None)
        taken.append(pool.taken_ids)
        versions.append(out.response_versions + version)
    assert taken == [[52, 53], [54, 55], [56, 57], [50, 51]], "oldest finished first"
    assert pool.in_flight == 2  # group 4 decodes on
    assert versions[0].tolist() == [[0] * 7] * 2
    assert versions[1].tolist() == [[1] * 4 + [2] * 3] * 2
    assert versions[2].tolist() == [[3] * 4 + [4] * 3] * 2
    spanning = [0] * 7 + [1] * 3 + [2] * 3 + [3] * 3 + [4] * 4
    assert versions[3].tolist() == [spanning] * 2


def test_a_checkpointed_pool_continues_as_the_loaded_one(models, restored) -> None:
    """After call 2, :meth:`state_dict` restarts group 0 (its prompt waits again, first) and the
    pool and a new one loaded from that state give the same calls, bit for bit."""
    from megatron_rlhf.generation import AnswerPool

    (model, _), *_ = models
    pool = _pool()
    for version in (0, 1):
        _run(pool, model, 1, version, None)
    state = pool.state_dict()
    assert state["waiting"][:2] == [0, 1] and not pool.in_flight
    loaded = AnswerPool(SAMPLES, slots=SLOTS)
    loaded.load_state_dict(state, torch.device("cpu"))
    for version in (2, 3, 4):
        mine, theirs = (_run(s, model, 1, version, None) for s in (pool, loaded))
        assert pool.taken_ids == loaded.taken_ids
        for field in dataclasses.fields(GenerationOutput):
            if field.name != "micro_batches":
                assert torch.equal(getattr(mine, field.name), getattr(theirs, field.name)), \
                    field.name
