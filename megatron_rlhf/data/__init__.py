"""Preference data: readers, stable SFT/RM/PPO splits, datasets, collation, the synthetic task.

Map of the files:

- ``schema.py``: ``FieldNames``, ``ReaderConfig`` (bad-record policy), ``SplitConfig``, ``DataConfig``.
- ``readers.py``: JSONL/Parquet readers with per-reason bad-record counts (``read_records``).
- ``splits.py``: hash-of-prompt split into SFT / RM / PPO portions (``split_records``).
- ``datasets.py``: ``SFTDataset``, ``RMDataset``, ``PromptDataset``.
- ``collate.py``: left-padded prompt batches, right-padded SFT and preference batches.
- ``synthetic.py``: the shipped "stay on topic" task, its rule and a JSONL writer.
- ``corpus.py`` and ``assets/corpus.txt``: the English corpus the tiny tokenizer is trained on.

See ``docs/data.md``.
"""

from __future__ import annotations

from megatron_rlhf.data.collate import (
    PreferenceBatch,
    PromptBatch,
    SFTBatch,
    collate_preferences,
    collate_prompts,
    collate_sft,
)
from megatron_rlhf.data.datasets import PromptDataset, RMDataset, RMExample, SFTDataset, SFTExample
from megatron_rlhf.data.readers import (
    BAD_REASONS,
    BadRecord,
    DataError,
    PreferenceRecord,
    ReadSummary,
    read_files,
    read_records,
)
from megatron_rlhf.data.schema import DataConfig, FieldNames, ReaderConfig, SplitConfig
from megatron_rlhf.data.splits import DataSplits, load_splits, portion_of, split_records
from megatron_rlhf.data.synthetic import (
    SyntheticTaskConfig,
    generate_records,
    rule_score,
    write_task_jsonl,
)

__all__ = [
    "BAD_REASONS",
    "BadRecord",
    "DataConfig",
    "DataError",
    "DataSplits",
    "FieldNames",
    "PreferenceBatch",
    "PreferenceRecord",
    "PromptBatch",
    "PromptDataset",
    "RMDataset",
    "RMExample",
    "ReadSummary",
    "ReaderConfig",
    "SFTBatch",
    "SFTDataset",
    "SFTExample",
    "SplitConfig",
    "SyntheticTaskConfig",
    "collate_preferences",
    "collate_prompts",
    "collate_sft",
    "generate_records",
    "load_splits",
    "portion_of",
    "read_files",
    "read_records",
    "rule_score",
    "split_records",
    "write_task_jsonl",
]
