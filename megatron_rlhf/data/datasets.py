"""Map-style datasets over checked records: SFT pairs, RM triples and PPO prompts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.utils.data import Dataset

from megatron_rlhf.data.conversations import Conversation, tool_turns
from megatron_rlhf.data.readers import PreferenceRecord


@dataclass(frozen=True)
class SFTExample:
    """A prompt and the response to imitate: a text, or a tool-calling trajectory (``turns``).

    Raises:
        ValueError: neither or both of ``response`` and ``turns``, or malformed ``turns``.
    """

    prompt: str
    response: str | None
    messages: Conversation | None = None
    """The prompt's turns when the record is a conversation (``prompt`` is then their text)."""
    turns: Conversation | None = None
    """The response as the assistant's replies and the tools' answers between them
    (``data.conversations.tool_turns``); the loss reads the replies only."""

    def __post_init__(self) -> None:
        if (self.response is None) == (self.turns is None):
            raise ValueError("an SFT example has a response text or turns, not "
                             f"{'both' if self.turns is not None else 'neither'}")
        if self.turns is not None:
            object.__setattr__(self, "turns", tool_turns(self.turns, "turns"))


def sft_example(record: PreferenceRecord) -> SFTExample:
    """The SFT example of a record that has a response or turns (turns win over a response)."""
    if record.turns is not None:
        return SFTExample(record.prompt, None, record.messages, record.turns)
    return SFTExample(record.prompt, record.response, record.messages)


@dataclass(frozen=True)
class RMExample:
    """A prompt with a preferred and a dispreferred response."""

    prompt: str
    chosen: str
    rejected: str
    messages: Conversation | None = None
    """The prompt's turns when the record is a conversation (``prompt`` is then their text)."""


def _require(records: Sequence[PreferenceRecord], names: tuple[str, ...], dataset: str) -> None:
    for index, record in enumerate(records):
        for name in names:
            if getattr(record, name) is None:
                raise ValueError(
                    f"{dataset}: record {index} has no {name!r}; add {name!r} to "
                    "reader.required so records without it are counted as bad"
                )


class SFTDataset(Dataset):
    """(prompt, response) pairs for supervised fine-tuning; a response may be turns.

    Raises:
        ValueError: if a record has neither a response nor turns.
    """

    def __init__(self, records: Sequence[PreferenceRecord]) -> None:
        for index, record in enumerate(records):
            if record.response is None and record.turns is None:
                raise ValueError(f"SFTDataset: record {index} has no 'response' and no 'turns'; "
                                 "add 'response' to reader.required so records without either "
                                 "are counted as bad")
        self.examples = [sft_example(r) for r in records]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> SFTExample:
        return self.examples[index]


class RMDataset(Dataset):
    """(prompt, chosen, rejected) triples for reward-model training.

    Raises:
        ValueError: if a record has no chosen or rejected response.
    """

    def __init__(self, records: Sequence[PreferenceRecord]) -> None:
        _require(records, ("chosen", "rejected"), "RMDataset")
        self.examples = [RMExample(r.prompt, r.chosen, r.rejected, r.messages) for r in records]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> RMExample:
        return self.examples[index]


class PromptDataset(Dataset):
    """Prompts for PPO rollouts."""

    def __init__(self, records: Sequence[PreferenceRecord]) -> None:
        self.prompts = [record.prompt for record in records]

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, index: int) -> str:
        return self.prompts[index]
