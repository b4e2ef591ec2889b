"""The faster generation paths give bitwise the results of the paths they replace."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from megatron.core.transformer.attention import SelfAttention

from megatron_rlhf.generation import GenerationConfig, GenerationOutput, generate_sequences
from megatron_rlhf.models.attention import CachedRopeSelfAttention
from tests.generation.helpers import make_prompts

EOS, PAD = 249, 0
LENGTHS = [5, 1, 12, 7, 3, 9]
OUTPUT_FIELDS = ("input_ids", "attention_mask", "response_mask", "response_logprobs",
                 "response_policy_logprobs")


@contextmanager
def megatron_self_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model``'s attention layers as megatron's own ``SelfAttention`` (same weights)."""
    layers = [m for m in model.modules() if isinstance(m, CachedRopeSelfAttention)]
    assert layers, "the model spec should use CachedRopeSelfAttention"
    for layer in layers:
        layer.__class__ = SelfAttention
    try:
        yield
    finally:
        for layer in layers:
            layer.__class__ = CachedRopeSelfAttention


def _generate(tiny, config: GenerationConfig) -> GenerationOutput:
    model, pgc = tiny
    prompts = make_prompts(LENGTHS, seed=3)
    return generate_sequences(model, pgc, prompts, list(range(len(prompts))), config,
                              eos_id=EOS, pad_id=PAD)


def _assert_same(ours: GenerationOutput, reference: GenerationOutput) -> None:
    for name in OUTPUT_FIELDS:
        assert torch.equal(getattr(ours, name), getattr(reference, name)), name


@pytest.mark.parametrize("config", [
    GenerationConfig(max_new_tokens=20, seed=5, stop_at_eos=False),
    GenerationConfig(max_new_tokens=20, seed=6, temperature=0.7, top_k=40, top_p=0.9),
    GenerationConfig(max_new_tokens=12, greedy=True, stop_at_eos=False),
], ids=["sample", "top-k-top-p", "greedy"])
def test_rope_before_caching_equals_megatron_attention_bitwise(tiny, config) -> None:
    ours = _generate(tiny, config)
    with megatron_self_attention(tiny[0]):
        reference = _generate(tiny, config)
    _assert_same(ours, reference)
