"""Tokenise and pad batches: left-padded prompts for generation, right-padded SFT and RM sequences.

Conventions: ids and masks are ``torch.long`` tensors of shape ``[batch, length]``; an attention
mask is 1 on real tokens and 0 on padding; padding uses ``tokenizer.pad_id``. Prompts start with
BOS; SFT and RM sequences are ``BOS prompt response EOS``. With a tokenizer that has a chat
template (a Hugging Face checkpoint's), the prompt part of SFT and RM sequences is encoded the
way PPO prompts are (``models.prompting.encode_prompt``): a conversation through the template,
a plain-text prompt as one user turn unless ``use_chat_template`` is False. Use with a DataLoader
through ``functools.partial(collate_sft, tokenizer=tok, max_length=256)``.

An SFT response given as tool-calling ``turns`` is tokenised as a multi-turn episode builds its
row (``generation/episodes.py``): each assistant turn encoded alone (loss 1), each tool answer as
``tokenizer.encode(tool_message(answer))`` (loss 0) with the run's tool message
(``models.prompting.tool_message_for``), EOS after the last assistant turn (loss 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rlhf.data.conversations import Conversation
from megatron_rlhf.data.datasets import RMExample, SFTExample
from megatron_rlhf.models.hf_tokenizer import HFTokenizer
from megatron_rlhf.models.prompting import ToolMessage, encode_prompt, tool_message_for
from megatron_rlhf.models.tokenizer import Tokenizer


@dataclass
class PromptBatch:
    """Left-padded prompts, so every prompt ends at the last column where generation starts."""

    input_ids: torch.Tensor
    """``[batch, length]`` BOS + prompt ids, padding on the left."""
    attention_mask: torch.Tensor
    """``[batch, length]`` 1 on prompt tokens, 0 on padding."""


@dataclass
class SFTBatch:
    """Right-padded prompt+response sequences."""

    input_ids: torch.Tensor
    """``[batch, length]`` BOS + prompt + response + EOS, padding on the right."""
    attention_mask: torch.Tensor
    """``[batch, length]`` 1 on real tokens, 0 on padding."""
    loss_mask: torch.Tensor
    """``[batch, length]`` 1 on response tokens and their EOS (the tokens to predict), else 0
    (a tool's answer inside a response is 0). Aligned with ``input_ids``: the logits at
    position ``t - 1`` predict the token at ``t``."""


@dataclass
class PreferenceBatch:
    """Chosen and rejected sequences of the same prompts, padded to one common length."""

    chosen: SFTBatch
    rejected: SFTBatch


def collate_prompts(
    prompts: Sequence[str], tokenizer: Tokenizer, max_prompt_tokens: int | None = None
) -> PromptBatch:
    """Tokenise prompts with BOS and left-pad them.

    Args:
        prompts: prompt texts.
        tokenizer: the shared tokenizer.
        max_prompt_tokens: refuse prompts longer than this (BOS not counted); None: no limit.

    Returns:
        The padded ids and attention mask.

    Raises:
        ValueError: for an empty batch or a prompt over ``max_prompt_tokens``.
    """
    if not prompts:
        raise ValueError("collate_prompts got an empty batch")
    sequences = []
    for index, prompt in enumerate(prompts):
        ids = tokenizer.encode(prompt)
        if max_prompt_tokens is not None and len(ids) > max_prompt_tokens:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens > max_prompt_tokens({max_prompt_tokens}); "
                "set reader.max_prompt_tokens to drop such records when reading"
            )
        sequences.append(([tokenizer.bos_id] if tokenizer.bos_id is not None else []) + ids)
    length = max(len(ids) for ids in sequences)
    input_ids = torch.full((len(sequences), length), tokenizer.pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, ids in enumerate(sequences):
        input_ids[row, length - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, length - len(ids) :] = 1
    return PromptBatch(input_ids=input_ids, attention_mask=attention_mask)


def sft_sequence(
    prompt: str, messages: Conversation | None, response: str | Conversation,
    tokenizer: Tokenizer | HFTokenizer, max_length: int, use_chat_template: bool,
    tool_message: ToolMessage | None = None
) -> tuple[list[int], list[int]]:
    """Return ``BOS prompt response EOS`` cut to ``max_length`` and its loss mask (1 on the
    response's tokens and EOS, 0 on the prompt and on tool answers).

    Args:
        response: a text, or tool-calling turns (module docstring).
        tool_message: the tool message of turns; default
            ``tool_message_for(tokenizer, use_chat_template)``.

    Raises:
        ValueError: the prompt alone fills ``max_length``.
    """
    prompt_ids = encode_prompt(tokenizer, prompt, messages, use_chat_template)
    if len(prompt_ids) >= max_length:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens (BOS included) leaves no room for a response in "
            f"max_length({max_length}); raise max_length or lower reader.max_prompt_tokens"
        )
    ids, mask = list(prompt_ids), [0] * len(prompt_ids)
    if isinstance(response, str):
        response = ({"role": "assistant", "content": response},)
    elif tool_message is None:
        tool_message = tool_message_for(tokenizer, use_chat_template)
    for turn in response:
        reply = turn["role"] == "assistant"
        part = tokenizer.encode(turn["content"] if reply else tool_message(turn["content"]))
        ids += part
        mask += [int(reply)] * len(part)
    ids.append(tokenizer.eos_id)
    mask.append(1)
    # Long responses lose their tail (and EOS): the prompt is what conditions the response.
    return ids[:max_length], mask[:max_length]


def right_pad_sft(
    sequences: list[tuple[list[int], list[int]]], pad_id: int, length: int | None = None
) -> SFTBatch:
    """Right-pad :func:`sft_sequence` results (ids, loss mask) to ``length`` (default: the
    longest of them)."""
    length = length if length is not None else max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    loss_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, (ids, mask) in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
        loss_mask[row, : len(ids)] = torch.tensor(mask, dtype=torch.long)
    return SFTBatch(input_ids=input_ids, attention_mask=attention_mask, loss_mask=loss_mask)


def collate_sft(examples: Sequence[SFTExample], tokenizer: Tokenizer | HFTokenizer,
                max_length: int, use_chat_template: bool = True) -> SFTBatch:
    """Tokenise (prompt, response) pairs and right-pad them, masking the loss to the response
    (to its assistant turns when it is tool-calling turns).

    Args:
        examples: SFT pairs.
        tokenizer: the shared tokenizer.
        max_length: longest sequence; longer responses are cut at the end.
        use_chat_template: wrap plain-text prompts as one user turn when the tokenizer has a
            chat template (conversations always go through it).

    Returns:
        Ids, attention mask and loss mask.

    Raises:
        ValueError: for an empty batch, or a prompt that fills ``max_length`` by itself.
    """
    if not examples:
        raise ValueError("collate_sft got an empty batch")
    return right_pad_sft(sft_sequences(examples, tokenizer, max_length, use_chat_template),
                         tokenizer.pad_id)


def sft_sequences(examples: Sequence[SFTExample], tokenizer: Tokenizer | HFTokenizer,
                  max_length: int, use_chat_template: bool) -> list[tuple[list[int], list[int]]]:
    """:func:`sft_sequence` of each example, its response text or turns."""
    tool_message = (tool_message_for(tokenizer, use_chat_template)
                    if any(e.turns is not None for e in examples) else None)
    return [sft_sequence(e.prompt, e.messages, e.response if e.turns is None else e.turns,
                         tokenizer, max_length, use_chat_template, tool_message)
            for e in examples]


def collate_preferences(
    examples: Sequence[RMExample], tokenizer: Tokenizer | HFTokenizer, max_length: int,
    use_chat_template: bool = True
) -> PreferenceBatch:
    """Tokenise (prompt, chosen, rejected) triples into two right-padded batches of equal length.

    Args:
        examples: RM triples.
        tokenizer: the shared tokenizer.
        max_length: longest sequence; longer responses are cut at the end.
        use_chat_template: as in :func:`collate_sft`.

    Returns:
        The chosen and the rejected batch; row ``i`` of each holds example ``i``.

    Raises:
        ValueError: for an empty batch, or a prompt that fills ``max_length`` by itself.
    """
    if not examples:
        raise ValueError("collate_preferences got an empty batch")
    chosen, rejected = ([sft_sequence(e.prompt, e.messages, getattr(e, side), tokenizer,
                                      max_length, use_chat_template) for e in examples]
                        for side in ("chosen", "rejected"))
    length = max(len(ids) for ids, _ in chosen + rejected)
    return PreferenceBatch(
        chosen=right_pad_sft(chosen, tokenizer.pad_id, length),
        rejected=right_pad_sft(rejected, tokenizer.pad_id, length),
    )
