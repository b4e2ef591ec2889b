"""Weights that change during one continuous-batching call (partial rollouts): a call whose
``weight_updates`` never updates is the call without it, bit for bit; answers that span one and
two updates record the version of every token, counted by hand from the stop-check schedule; their
tokens before the first update are the unchanged model's, and answers that start after the last
update are the new model's own."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlhf.generation import GenerationOutput
from tests.generation.helpers import BASE, build_refit_models, generate_tiny

INTERVAL, SLOTS, TOKENS = 3, 4, 20
CONFIG = dataclasses.replace(BASE, micro_batch_size=SLOTS, stop_check_interval=INTERVAL,
                             stop_at_eos=False, max_new_tokens=TOKENS)
"""14 prompts through 4 slots, every answer 20 tokens: the first 4 decode together from the
start, and stop check ``c`` finds each of them with ``1 + 3c`` tokens (the prefill's and one per
decode step)."""


def _generate(model, pgc, schedule: dict[int, torch.nn.Module] | None,
              calls: list[int] | None = None) -> GenerationOutput:
    """Generate with ``model``, refitting it from ``schedule[c]`` at stop check ``c``."""
    from megatron_rlhf.generation import generate_sequences
    from megatron_rlhf.refit import ModelLayout, build_weight_sync
    from tests.generation.helpers import PAD, SAMPLES, make_prompts

    syncs = {check: build_weight_sync(source, pgc, ModelLayout(0), model, pgc, ModelLayout(0))
             for check, source in (schedule or {}).items()}
    count = 0

    def weight_updates() -> bool:
        nonlocal count
        count += 1
        if calls is not None:
            calls.append(count)
        if count in syncs:
            syncs[count].sync()
            return True
        return False

    prompts = [p for p in make_prompts([4, 9, 2, 6, 11, 3, 5], seed=6) for _ in range(SAMPLES)]
    return generate_sequences(model, pgc, prompts, list(range(30, 30 + len(prompts))), CONFIG,
                              eos_id=None, pad_id=PAD,
                              weight_updates=weight_updates if schedule is not None else None)


@pytest.fixture(scope="module")
def models(world):
    """A model to generate with and two others to refit it from (other initial weights)."""
    return build_refit_models()


def test_no_update_is_the_call_without_updates_bit_for_bit(models) -> None:
    (model, pgc), *_ = models
    calls: list[int] = []
    plain = _generate(model, pgc, None)
    asked = _generate(model, pgc, {}, calls)
    assert plain.response_versions is None
    assert calls, "asked at the stop checks"
    assert asked.micro_batches == plain.micro_batches
    for field in dataclasses.fields(GenerationOutput):
        if field.name not in ("response_versions", "micro_batches"):
            assert torch.equal(getattr(asked, field.name), getattr(plain, field.name)), field.name
    assert torch.equal(asked.response_versions, torch.zeros_like(plain.response_mask))


@pytest.mark.parametrize("checks", [(2,), (2, 4)], ids=["spans-2-versions", "spans-3-versions"])
def test_every_token_records_the_updates_before_it(models, checks: tuple[int, ...]) -> None:
    (model, pgc), first, second = models
    sources = dict(zip(checks, (first[0], second[0]), strict=False))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        unchanged = _generate(model, pgc, None)
        out = _generate(model, pgc, sources)
    finally:
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(before[name])
    # The first wave: versions change where check c finds 1 + 3c tokens.
    expected = torch.zeros(TOKENS, dtype=torch.long)
    for check in checks:
        expected[1 + INTERVAL * check:] += 1
    for row in range(SLOTS):
        assert out.response_versions[row].tolist() == expected.tolist(), row
        first_update = 1 + INTERVAL * checks[0]
        assert torch.equal(out.responses[row, :first_update],
                           unchanged.responses[row, :first_update])
    assert len(set(expected.tolist())) == len(checks) + 1
    assert not torch.equal(out.responses[:SLOTS], unchanged.responses[:SLOTS])
    # Later waves start after the last update: every token under the last weights, and the
    # tokens and log-probs of a call with those weights from the start.
    later = slice(SLOTS, None)
    assert (out.response_versions[later] == len(checks)).all()
    last, last_pgc = (first if len(checks) == 1 else second)
    reference = generate_tiny((last, last_pgc), CONFIG, None)
    for name in ("input_ids", "response_mask"):
        assert torch.equal(getattr(out, name)[later], getattr(reference, name)[later]), name
    torch.testing.assert_close(out.response_policy_logprobs[later],
                               reference.response_policy_logprobs[later], rtol=0, atol=1e-5)


def test_updates_are_refused_without_continuous_batching(models) -> None:
    from megatron_rlhf.generation import generate_sequences

    (model, pgc), *_ = models
    static = dataclasses.replace(CONFIG, batching="static")
    with pytest.raises(ValueError, match="only with continuous batching"):
        generate_sequences(model, pgc, [[5, 6]], [0], static, eos_id=None, pad_id=0,
                           weight_updates=lambda: False)
