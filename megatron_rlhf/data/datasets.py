"""Map-style datasets over checked records: SFT pairs, RM triples and PPO prompts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch.utils.data import Dataset

from megatron_rlhf.data.conversations import Conversation
from megatron_rlhf.data.readers import PreferenceRecord


@dataclass(frozen=True)
class SFTExample:
    """A prompt and the response to imitate."""

    prompt: str
    response: str
    messages: Conversation | None = None
    """The prompt's turns when the record is a conversation (``prompt`` is then their text)."""


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
    """(prompt, response) pairs for supervised fine-tuning.

    Raises:
        ValueError: if a record has no response.
    """

    def __init__(self, records: Sequence[PreferenceRecord]) -> None:
        _require(records, ("response",), "SFTDataset")
        self.examples = [SFTExample(r.prompt, r.response, r.messages) for r in records]

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
