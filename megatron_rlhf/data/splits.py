"""Deterministic, stable split of preference records into SFT, RM and PPO portions.

Each record goes to a portion chosen by a salted sha256 of its PROMPT text alone, mapped to a number
in [0, 1) and compared with the cumulative fractions. Consequences, all intended:

- stable: a record's portion depends on nothing else, so adding or removing records never moves
  another record, and file order does not matter;
- leak-free: records sharing a prompt always land in the same portion;
- approximate: portion sizes follow the fractions in expectation (binomially), not exactly.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from megatron_rlhf.data.readers import PreferenceRecord, ReadSummary, read_files
from megatron_rlhf.data.schema import PORTIONS, DataConfig, SplitConfig
from megatron_rlhf.models.tokenizer import Tokenizer
from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)


def portion_of(prompt: str, config: SplitConfig) -> str:
    """Return the portion (``sft``, ``rm`` or ``ppo``) a prompt belongs to.

    Args:
        prompt: the record's prompt text.
        config: fractions and hash salt.

    Returns:
        One of :data:`megatron_rlhf.data.schema.PORTIONS`.
    """
    digest = hashlib.sha256(f"{config.seed}\x00{prompt}".encode()).digest()
    point = int.from_bytes(digest[:8], "big") / 2**64
    fractions = config.fractions()
    cumulative = 0.0
    for name in PORTIONS:
        cumulative += fractions[name]
        if point < cumulative:
            return name
    # Fractions may sum to slightly under 1; the remainder belongs to the last non-empty portion.
    return [name for name in PORTIONS if fractions[name] > 0][-1]


@dataclass
class DataSplits:
    """Records per portion, each in input order."""

    sft: list[PreferenceRecord] = field(default_factory=list)
    rm: list[PreferenceRecord] = field(default_factory=list)
    ppo: list[PreferenceRecord] = field(default_factory=list)

    def sizes(self) -> dict[str, int]:
        """Number of records per portion."""
        return {name: len(getattr(self, name)) for name in PORTIONS}


def split_records(records: list[PreferenceRecord], config: SplitConfig) -> DataSplits:
    """Assign every record to exactly one portion with :func:`portion_of`."""
    splits = DataSplits()
    for record in records:
        getattr(splits, portion_of(record.prompt, config)).append(record)
    return splits


def load_splits(
    config: DataConfig, tokenizer: Tokenizer | None = None
) -> tuple[DataSplits, list[ReadSummary]]:
    """Read every configured file and split the good records.

    Args:
        config: files, reader policy and split fractions.
        tokenizer: needed when ``config.reader.max_prompt_tokens`` is set.

    Returns:
        The splits and one read summary per file.

    Raises:
        DataError: as :func:`megatron_rlhf.data.readers.read_records`.
    """
    records, summaries = read_files(config.paths, config.reader, tokenizer)
    splits = split_records(records, config.split)
    logger.info(
        "read %d records from %d files; split %s", len(records), len(config.paths), splits.sizes()
    )
    return splits, summaries
