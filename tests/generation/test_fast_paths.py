"""The faster generation paths give bitwise the results of the paths they replace (the compiled
decode step: the same tokens, log-probs within rounding)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlhf.generation import (
    GenerationConfig,
    GenerationOutput,
    SampledTokens,
    generate_sequences,
    inverse_cdf_sample,
    prompt_noise_keys,
    sample_tokens,
    sampling_logprobs,
    uniforms_at_step,
    uniforms_for_steps,
)
from megatron_rlhf.models.attention import as_megatron_self_attention
from tests.generation.helpers import MIN_MARGIN, decision_margin, make_prompts

EOS, PAD = 249, 0
LENGTHS = [5, 1, 12, 7, 3, 9]
OUTPUT_FIELDS = ("input_ids", "attention_mask", "response_mask", "response_logprobs",
                 "response_policy_logprobs")


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
    config = dataclasses.replace(config, batching="static")  # megatron's own attention has no slots
    ours = _generate(tiny, config)
    with as_megatron_self_attention(tiny[0]):
        reference = _generate(tiny, config)
    _assert_same(ours, reference)


def test_uniforms_for_steps_equal_uniforms_at_step_bitwise() -> None:
    keys = prompt_noise_keys(7, [0, 3, 2**40, 5])
    table = uniforms_for_steps(keys, 9)
    assert table.shape == (9, 4)
    for step in range(9):
        assert torch.equal(table[step], uniforms_at_step(keys, step))


def _reference_sample(logits: torch.Tensor, uniforms: torch.Tensor,
                      config: GenerationConfig) -> SampledTokens:
    """The sampler before its shortcuts: filtered distribution, draw, then two gathers."""
    policy = torch.log_softmax(logits.float() / config.temperature, dim=-1)
    dist = sampling_logprobs(logits, config.temperature, config.top_k, config.top_p)
    tokens = inverse_cdf_sample(dist, uniforms)
    pick = tokens.unsqueeze(-1)
    return SampledTokens(tokens=tokens, logprobs=dist.gather(-1, pick).squeeze(-1),
                         policy_logprobs=policy.gather(-1, pick).squeeze(-1))


@pytest.mark.parametrize("config", [
    GenerationConfig(),
    GenerationConfig(temperature=0.6),
    GenerationConfig(temperature=1.3, top_p=0.8),
    GenerationConfig(top_k=5),
], ids=["plain", "temperature", "top-p", "top-k"])
def test_sample_tokens_equals_reference_sampler_bitwise(config: GenerationConfig) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 300, generator=generator) * 3
    uniforms = uniforms_at_step(prompt_noise_keys(1, list(range(64))), 4)
    fast, reference = sample_tokens(logits, uniforms, config), _reference_sample(
        logits, uniforms, config)
    for name in ("tokens", "logprobs", "policy_logprobs"):
        assert torch.equal(getattr(fast, name), getattr(reference, name)), name


@pytest.mark.parametrize("batching", ["continuous", "static"])
def test_compiled_decode_gives_the_eager_tokens_and_log_probs_within_rounding(
        tiny, batching: str) -> None:
    config = GenerationConfig(max_new_tokens=20, seed=5, stop_at_eos=False, batching=batching)
    reference = _generate(tiny, config)
    compiled = _generate(tiny, dataclasses.replace(config, compile_decode=True))
    # Compiled kernels round differently: equal tokens hold because no draw is near a tie.
    assert decision_margin(tiny, reference, config, list(range(len(LENGTHS)))) > MIN_MARGIN
    for name in ("input_ids", "attention_mask", "response_mask"):
        assert torch.equal(getattr(compiled, name), getattr(reference, name)), name
    for name in ("response_logprobs", "response_policy_logprobs"):
        torch.testing.assert_close(getattr(compiled, name), getattr(reference, name),
                                   rtol=0, atol=1e-5)


def test_compile_decode_needs_the_kv_cache() -> None:
    with pytest.raises(ValueError, match="compile_decode=True .* use_kv_cache=False"):
        GenerationConfig(compile_decode=True, use_kv_cache=False)
