"""Typed configs of the data layer: file schema, bad-record policy, and the SFT/RM/PPO split."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

RECORD_FIELDS = ("prompt", "response", "chosen", "rejected")
"""Logical fields of a preference record (the Dahoas/rm-static schema)."""

BAD_RECORD_POLICIES = ("skip", "error")
PORTIONS = ("sft", "rm", "ppo")

_FRACTION_TOLERANCE = 1e-6


@dataclass
class FieldNames:
    """Column (JSON key) names in the files for each logical field."""

    prompt: str = "prompt"
    """Column holding the prompt."""
    response: str = "response"
    """Column holding the reference (SFT) response."""
    chosen: str = "chosen"
    """Column holding the preferred response."""
    rejected: str = "rejected"
    """Column holding the dispreferred response."""
    messages: str = "messages"
    """Column holding a conversation (a list of ``role``/``content`` turns), read when present
    (see ``data/conversations.py``)."""
    turns: str = "turns"
    """Column holding an SFT response as a tool-calling trajectory, read when present: a list of
    ``{"role": "assistant" | "tool", "content": str}`` turns, alternating, first and last the
    assistant's. It stands for the ``response`` (SFT trains on the assistant's turns only)."""

    def __post_init__(self) -> None:
        for name in (*RECORD_FIELDS, "messages", "turns"):
            if not getattr(self, name):
                raise ValueError(f"fields.{name} is empty; give the column name of the {name}")


@dataclass
class ReaderConfig:
    """How records are read and checked."""

    WHERE: ClassVar[str] = "reader"
    """The config path that errors name (``prompts.reader`` in a PPO run)."""

    fields: FieldNames = field(default_factory=FieldNames)
    """Column names in the files."""
    required: list[str] = field(default_factory=lambda: list(RECORD_FIELDS))
    """Logical fields every record must have as non-empty text; others are read when present.
    A record with ``turns`` has its ``response``. Any other name is a column every record must
    have (not null, not empty text), e.g. the ``answer`` a reward function reads: checked for
    every record when the files are read."""
    on_bad_record: str = "skip"
    """``skip``: count and drop bad records; ``error``: stop at the first with a DataError."""
    max_prompt_tokens: int | None = None
    """Records whose prompt encodes to more tokens than this are bad; None: no limit."""
    max_examples: int = 5
    """Bad records kept as examples in the summary, per reason."""

    def __post_init__(self) -> None:
        where = self.WHERE
        blank = [name for name in self.required if not isinstance(name, str) or not name.strip()]
        if blank:
            raise ValueError(f"{where}.required={list(self.required)} holds {blank}: give field "
                             f"names, {list(RECORD_FIELDS)} or a column of the records")
        if "messages" in self.required:
            raise ValueError(f"{where}.required: 'messages' cannot be required (a record is a "
                             "conversation when it has one); require 'prompt'")
        if "prompt" not in self.required:
            raise ValueError(f"{where}.required={list(self.required)} must include 'prompt'")
        if self.on_bad_record not in BAD_RECORD_POLICIES:
            raise ValueError(f"{where}.on_bad_record={self.on_bad_record!r} must be one of "
                             f"{BAD_RECORD_POLICIES}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"{where}.max_prompt_tokens={self.max_prompt_tokens} must be >= 1, "
                             "or null for no limit")
        if self.max_examples < 0:
            raise ValueError(f"{where}.max_examples={self.max_examples} must be >= 0")

    @property
    def extra_required(self) -> list[str]:
        """Required columns beyond the built-in fields (what reward functions read)."""
        return [name for name in self.required if name not in RECORD_FIELDS]


@dataclass
class SplitConfig:
    """Fractions of prompts that go to SFT, reward-model and PPO training."""

    sft: float = 0.4
    """Fraction for supervised fine-tuning (prompt, response)."""
    rm: float = 0.3
    """Fraction for reward-model training (prompt, chosen, rejected)."""
    ppo: float = 0.3
    """Fraction for PPO rollouts (prompt only)."""
    seed: int = 0
    """Salt of the hash; a different seed gives a different, equally stable split."""

    def __post_init__(self) -> None:
        fractions = self.fractions()
        negative = {name: value for name, value in fractions.items() if value < 0}
        if negative:
            raise ValueError(f"split fractions must be >= 0, got {negative}")
        total = sum(fractions.values())
        if abs(total - 1.0) > _FRACTION_TOLERANCE:
            raise ValueError(
                f"split fractions sft({self.sft}) + rm({self.rm}) + ppo({self.ppo}) = {total:g}; "
                "they must sum to 1"
            )

    def fractions(self) -> dict[str, float]:
        """The fractions by portion name, in the order of :data:`PORTIONS`."""
        return {"sft": self.sft, "rm": self.rm, "ppo": self.ppo}


@dataclass
class DataConfig:
    """The preference files to read and how to split them."""

    paths: list[str] = field(default_factory=list)
    """JSONL (``.jsonl``/``.json``) or Parquet (``.parquet``) files, read in order."""
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    """Schema and bad-record policy."""
    split: SplitConfig = field(default_factory=SplitConfig)
    """SFT / RM / PPO fractions."""

    def __post_init__(self) -> None:
        if not self.paths:
            raise ValueError("paths is empty; list at least one .jsonl or .parquet file")
