"""Sampling maths on hand-made distributions, and the generation config's validation."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_rlhf.generation.params import GenerationConfig
from megatron_rlhf.generation.sampling import (
    inverse_cdf_sample,
    prompt_noise_keys,
    sample_tokens,
    sampling_logprobs,
    sampling_uniform,
    sampling_uniforms,
    top_k_top_p_keep,
    uniforms_at_step,
)

# Powers of two: every sum below is exact in floating point.
PROBS = torch.tensor([0.5, 0.25, 0.125, 0.125])


@pytest.mark.parametrize("top_p, kept", [(1.0, 4), (0.875, 3), (0.76, 3), (0.75, 2), (0.6, 2),
                                         (0.5, 1), (0.1, 1)])
def test_top_p_keeps_smallest_set_reaching_p(top_p: float, kept: int) -> None:
    keep = top_k_top_p_keep(PROBS[None], top_k=0, top_p=top_p)
    assert keep[0].tolist() == [True] * kept + [False] * (4 - kept)


def test_top_k_then_top_p_renormalises_between_filters() -> None:
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    # Alone, top-p 0.5 needs two tokens (0.4 < 0.5); after top-k 2 the first holds 4/7 >= 0.5.
    assert top_k_top_p_keep(probs, top_k=0, top_p=0.5)[0].tolist() == [True, True, False, False]
    assert top_k_top_p_keep(probs, top_k=2, top_p=0.5)[0].tolist() == [True, False, False, False]
    assert top_k_top_p_keep(probs, top_k=3, top_p=1.0)[0].tolist() == [True, True, True, False]


def test_sampling_logprobs_filters_in_vocab_order_and_renormalises() -> None:
    order = torch.tensor([2, 0, 3, 1])  # vocabulary order differs from probability order
    logits = PROBS.log()[order][None]
    logprobs = sampling_logprobs(logits, temperature=1.0, top_p=0.75)
    expected = torch.tensor([-math.inf, math.log(2 / 3), -math.inf, math.log(1 / 3)])
    torch.testing.assert_close(logprobs[0], expected)
    torch.testing.assert_close(sampling_logprobs(logits, 1.0), logits.log_softmax(-1))
    tempered = sampling_logprobs(logits, temperature=0.5)
    torch.testing.assert_close(tempered, (logits / 0.5).log_softmax(-1))


def test_inverse_cdf_follows_the_distribution_and_skips_excluded_tokens() -> None:
    logprobs = torch.tensor([[math.log(0.25), -math.inf, math.log(0.75), -math.inf]])
    grid = (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000
    tokens = inverse_cdf_sample(logprobs.expand(1000, 4), grid)
    assert torch.bincount(tokens, minlength=4).tolist() == [250, 0, 750, 0]
    edges = inverse_cdf_sample(logprobs.expand(2, 4), torch.tensor([0.0, 1.0 - 2.0**-53]))
    assert edges.tolist() == [0, 2]


def test_uniforms_are_keyed_by_seed_index_and_step_only() -> None:
    assert sampling_uniform(3, 17, 5) == sampling_uniform(3, 17, 5)
    values = {sampling_uniform(s, i, t) for s in (0, 1) for i in (0, 1) for t in (0, 1)}
    assert len(values) == 8
    batch = sampling_uniforms(3, [17, 2, 40], step=5)
    assert batch.tolist() == [sampling_uniform(3, i, 5) for i in (17, 2, 40)]
    many = sampling_uniforms(0, range(20000), step=0)
    assert 0.0 <= many.min() and many.max() < 1.0
    assert abs(many.mean().item() - 0.5) < 0.01


def test_greedy_and_top_k_1_pick_the_argmax_lowest_id_on_ties() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=generator)
    logits[0, [3, 7]] = 100.0  # a tie: the lower id wins
    uniforms = torch.rand(64, generator=generator, dtype=torch.float64)
    greedy = sample_tokens(logits, uniforms, GenerationConfig(greedy=True, temperature=0.7))
    top1 = sample_tokens(logits, uniforms, GenerationConfig(top_k=1))
    assert greedy.tokens.tolist() == top1.tokens.tolist() == logits.argmax(-1).tolist()
    assert greedy.tokens[0] == 3
    assert torch.all(greedy.logprobs == 0) and torch.all(top1.logprobs == 0)
    torch.testing.assert_close(
        greedy.policy_logprobs,
        (logits / 0.7).log_softmax(-1).gather(-1, greedy.tokens[:, None]).squeeze(-1))


def test_filtered_logprobs_exceed_policy_logprobs() -> None:
    logits = torch.randn(32, 50, generator=torch.Generator().manual_seed(1))
    uniforms = sampling_uniforms(0, range(32), 0)
    plain = sample_tokens(logits, uniforms, GenerationConfig(temperature=0.8))
    torch.testing.assert_close(plain.logprobs, plain.policy_logprobs)
    filtered = sample_tokens(logits, uniforms, GenerationConfig(temperature=0.8, top_k=10,
                                                                top_p=0.8))
    assert torch.all(filtered.logprobs > filtered.policy_logprobs)
    keep = sampling_logprobs(logits, 0.8, top_k=10, top_p=0.8).isfinite()
    assert torch.all(keep.gather(-1, filtered.tokens[:, None]))


@pytest.mark.parametrize("field, value", [("max_new_tokens", -1), ("temperature", 0.0),
                                          ("temperature", math.nan), ("top_k", -2),
                                          ("top_p", 0.0), ("top_p", 1.5), ("seed", -1),
                                          ("micro_batch_size", -1),
                                          ("stop_check_interval", 0), ("greedy_every", -1)])
def test_config_rejects_bad_values_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"generation.{field}="):
        GenerationConfig(**{field: value})


def test_vectorised_uniforms_equal_the_scalar_definition_bit_for_bit() -> None:
    # Indices past 2**31 and 2**63 - 1 exercise the signed/unsigned wrap-around of the int64 hash.
    indices = [0, 1, 17, 2**31 + 3, 2**40 + 5, 2**62, 2**63 - 1]
    for seed in (0, 3, 2**31 - 1, 2**62 + 7):
        keys = prompt_noise_keys(seed, indices)
        for step in (0, 1, 5, 4096, 2**30):
            expected = [sampling_uniform(seed, i, step) for i in indices]
            assert uniforms_at_step(keys, step).tolist() == expected
