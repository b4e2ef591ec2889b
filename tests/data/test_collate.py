"""Collation: left-padded prompts, right-padded SFT with response-only loss mask, RM pairs."""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch.utils.data import DataLoader

from megatron_rlhf.data import (
    PreferenceRecord,
    PromptDataset,
    RMDataset,
    RMExample,
    SFTDataset,
    SFTExample,
    collate_preferences,
    collate_prompts,
    collate_sft,
)
from megatron_rlhf.models.tokenizer import Tokenizer

PROMPTS = ["Topic: farm. Answer:", "List words about the music, like drum and song:", "Hi"]


def test_prompts_are_left_padded(tokenizer: Tokenizer) -> None:
    batch = collate_prompts(PROMPTS, tokenizer)
    lengths = [len(tokenizer.encode(p)) + 1 for p in PROMPTS]
    assert batch.input_ids.shape == batch.attention_mask.shape == (3, max(lengths))
    assert batch.input_ids.dtype == batch.attention_mask.dtype == torch.long
    for row, (prompt, length) in enumerate(zip(PROMPTS, lengths, strict=True)):
        ids, mask = batch.input_ids[row], batch.attention_mask[row]
        assert mask.tolist() == [0] * (ids.numel() - length) + [1] * length
        assert (ids[mask == 0] == tokenizer.pad_id).all()
        real = ids[mask == 1].tolist()
        assert real[0] == tokenizer.bos_id and tokenizer.decode(real) == prompt
    assert (batch.attention_mask[:, -1] == 1).all()


def test_prompt_limit_is_enforced(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"prompt 1 has \d+ tokens > max_prompt_tokens\(3\)"):
        collate_prompts(["Hi", PROMPTS[1]], tokenizer, max_prompt_tokens=3)
    with pytest.raises(ValueError, match="empty batch"):
        collate_prompts([], tokenizer)


def test_sft_loss_mask_covers_exactly_the_response(tokenizer: Tokenizer) -> None:
    examples = [
        SFTExample("Topic: farm. Answer:", "cow hay barn."),
        SFTExample("Write about the space:", "moon."),
    ]
    batch = collate_sft(examples, tokenizer, max_length=64)
    for row, example in enumerate(examples):
        ids = batch.input_ids[row]
        prompt_ids = tokenizer.encode(example.prompt, add_bos=True)
        response_ids = tokenizer.encode(example.response, add_eos=True)
        length = len(prompt_ids) + len(response_ids)
        assert ids[:length].tolist() == prompt_ids + response_ids
        assert batch.attention_mask[row].tolist() == [1] * length + [0] * (ids.numel() - length)
        assert (ids[length:] == tokenizer.pad_id).all()
        assert ids[batch.loss_mask[row] == 1].tolist() == response_ids
        assert tokenizer.decode(ids[batch.loss_mask[row] == 1].tolist()) == example.response
    assert not (batch.loss_mask.bool() & ~batch.attention_mask.bool()).any()


def test_sft_truncates_the_response_and_refuses_overlong_prompts(tokenizer: Tokenizer) -> None:
    example = SFTExample("Topic: farm. Answer:", " ".join(["cow"] * 40))
    prompt_length = len(tokenizer.encode(example.prompt, add_bos=True))
    batch = collate_sft([example], tokenizer, max_length=prompt_length + 5)
    assert batch.input_ids.shape == (1, prompt_length + 5)
    assert int(batch.loss_mask.sum()) == 5
    assert tokenizer.eos_id not in batch.input_ids[0].tolist()
    with pytest.raises(ValueError, match="leaves no room for a response"):
        collate_sft([example], tokenizer, max_length=prompt_length)


def test_preference_batches_share_length(tokenizer: Tokenizer) -> None:
    examples = [
        RMExample("Topic: city. Answer:", "bus road tower train.", "pan."),
        RMExample("Write about the ocean:", "wave.", "comet star moon orbit sun probe."),
    ]
    batch = collate_preferences(examples, tokenizer, max_length=64)
    assert batch.chosen.input_ids.shape == batch.rejected.input_ids.shape
    chosen = batch.chosen.input_ids[0][batch.chosen.loss_mask[0] == 1].tolist()
    rejected = batch.rejected.input_ids[1][batch.rejected.loss_mask[1] == 1].tolist()
    assert tokenizer.decode(chosen) == "bus road tower train."
    assert tokenizer.decode(rejected) == "comet star moon orbit sun probe."


def test_datasets_feed_a_dataloader(tokenizer: Tokenizer) -> None:
    records = [
        PreferenceRecord(p, response="wave.", chosen="wave.", rejected="pan.") for p in PROMPTS
    ]
    assert [SFTDataset(records)[i].response for i in range(3)] == ["wave."] * 3
    loader = DataLoader(
        RMDataset(records),
        batch_size=2,
        collate_fn=partial(collate_preferences, tokenizer=tokenizer, max_length=32),
    )
    assert [b.chosen.input_ids.shape[0] for b in loader] == [2, 1]
    loader = DataLoader(
        PromptDataset(records),
        batch_size=3,
        collate_fn=partial(collate_prompts, tokenizer=tokenizer),
    )
    (batch,) = list(loader)
    assert batch.input_ids.shape[0] == 3
    with pytest.raises(ValueError, match="has no 'chosen'"):
        RMDataset([PreferenceRecord("p", response="r")])


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_sft_and_rm_prompts_go_through_the_chat_template_like_ppo_prompts(tmp_path, style) -> None:
    """With a checkpoint's tokenizer, the prompt part of an SFT or RM sequence is exactly what
    transformers' apply_chat_template gives (and what PPO prompts the policy with); the loss
    starts right after it."""
    from transformers import AutoTokenizer

    from megatron_rlhf.data.datasets import RMExample, SFTExample
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer
    from tools.make_tiny_hf import CONVERSATIONS, make_hf_tokenizer

    make_hf_tokenizer(tmp_path, style)
    ours, theirs = HFTokenizer.load(tmp_path), AutoTokenizer.from_pretrained(tmp_path)

    def template(messages) -> list[int]:
        encoded = theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)

    conversation = tuple(CONVERSATIONS[1])
    cases = [(SFTExample("", "The sea is wide.", conversation), template(conversation), True),
             (SFTExample("Name a colour.", "Blue."),
              template([{"role": "user", "content": "Name a colour."}]), True),
             (SFTExample("Name a colour.", "Blue."), ours.encode("Name a colour.", add_bos=True),
              False)]
    for example, prompt_ids, use_template in cases:
        batch = collate_sft([example], ours, max_length=256, use_chat_template=use_template)
        response = ours.encode(example.response, add_eos=True)
        assert batch.input_ids[0].tolist() == prompt_ids + response
        assert batch.loss_mask[0].tolist() == [0] * len(prompt_ids) + [1] * len(response)
    pair = collate_preferences([RMExample("", "Yes.", "No, never.", conversation)], ours, 256)
    for side, text in ((pair.chosen, "Yes."), (pair.rejected, "No, never.")):
        length = int(side.attention_mask[0].sum())
        assert side.input_ids[0, :length].tolist() == template(conversation) + ours.encode(
            text, add_eos=True)
