"""A model that embeds more rows than its tokenizer has ids (Hugging Face checkpoints pad the
embedding: Qwen2.5's has hundreds of rows no tokenizer id reaches): the logits past the tokenizer
are never sampled and take no part in any log-probability, so generation's and training's
log-probs are over the same support. One process."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.generation import GenerationConfig, generate_sequences
from megatron_rlhf.models.forward_backward import model_inputs
from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
from megatron_rlhf.models.logprobs import vocab_parallel_logprobs
from megatron_rlhf.models.weights import init_weights
from tests.generation.helpers import INIT_SEED, make_prompts
from tests.model_fixtures import TinyArch, whole_world_groups

TOKENS = 200
"""Ids the tokenizer has; TinyArch embeds 250 rows."""


@pytest.fixture(scope="module")
def padded(world):
    """A tiny LM whose 50 rows past the tokenizer are scaled copies of others, so that they
    hold the largest logits almost everywhere."""
    pgc = whole_world_groups(1, 1)
    model = build_gpt_model(TinyArch(), ModelBuildOptions(token_vocab_size=TOKENS), pgc)
    init_weights(model, pgc, seed=INIT_SEED)
    with torch.no_grad():
        weight = model.output_layer.weight
        weight[TOKENS:250] = 4 * weight[:250 - TOKENS]
    return model, pgc


def _reference_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                        prompt_length: int, temperature: float) -> torch.Tensor:
    """``[b, R]``: log-softmax over the tokenizer's ids of one full forward's logits."""
    with torch.no_grad():
        logits = model(*model_inputs({"input_ids": input_ids, "attention_mask": attention_mask}))
    logprobs = torch.log_softmax(logits[..., :TOKENS].float() / temperature, dim=-1)
    targets = input_ids[:, prompt_length:]
    return logprobs[:, prompt_length - 1:-1].gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def test_rows_past_the_tokenizer_are_never_sampled(padded) -> None:
    model, pgc = padded
    prompts = make_prompts([5, 9, 3, 7], vocab_size=TOKENS)
    config = GenerationConfig(max_new_tokens=12, temperature=0.8, stop_at_eos=False, seed=5)
    out = generate_sequences(model, pgc, prompts, list(range(4)), config, eos_id=None, pad_id=0)
    with torch.no_grad():
        logits = model(*model_inputs({"input_ids": out.input_ids,
                                      "attention_mask": out.attention_mask}))
    assert (logits[:, out.prompt_length - 1:-1, :250].argmax(-1) >= TOKENS).float().mean() > 0.9
    assert int(out.responses.max()) < TOKENS
    assert model.token_vocab_size == TOKENS and model.real_vocab_size == 250

    reference = _reference_logprobs(model, out.input_ids, out.attention_mask,
                                    out.prompt_length, 0.8)
    torch.testing.assert_close(out.response_logprobs, reference, rtol=0, atol=1e-5)
    training, _ = vocab_parallel_logprobs(logits[:, out.prompt_length - 1:-1], out.responses,
                                          pgc.tp, model.token_vocab_size, 0.8)
    torch.testing.assert_close(training, reference, rtol=0, atol=1e-5)


def test_a_tokenizer_larger_than_the_embedding_is_refused(world) -> None:
    pgc = whole_world_groups(1, 1)
    with pytest.raises(ValueError, match=r"model.token_vocab_size=251 exceeds the 250 rows the "
                       r"architecture embeds"):
        build_gpt_model(TinyArch(), ModelBuildOptions(token_vocab_size=251), pgc)
