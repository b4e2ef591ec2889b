"""Readers for local JSONL and Parquet preference files: prompt/response/chosen/rejected as text,
or conversation-shaped (``messages``, or ``chosen``/``rejected`` as lists of turns; see
``data/conversations.py``); an SFT response may be a tool-calling trajectory (``turns``).

A ``.json`` file may also hold one JSON array of record objects (what ``json.dump(records, f)``
writes): it is read whole, and its records are numbered 1, 2, ... in the array.

Every record is checked; a bad one is classified by one of :data:`BAD_REASONS` and, by the
``on_bad_record`` policy, either counted and skipped or refused with a :class:`DataError` that names
file, line (JSONL) or row (Parquet), field and reason. Problems with a whole file (missing, not
Parquet, unknown extension, a JSON array that does not parse) always raise :class:`DataError`. Whitespace-only JSONL lines are
ignored, not counted.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_rlhf.data.conversations import (
    Conversation,
    ConversationError,
    is_conversation_row,
    split_conversation,
    tool_turns,
)
from megatron_rlhf.data.schema import RECORD_FIELDS, ReaderConfig
from megatron_rlhf.models.hf_tokenizer import HFTokenizer
from megatron_rlhf.models.tokenizer import Tokenizer
from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)

BAD_REASONS = (
    "invalid_utf8",
    "invalid_json",
    "not_an_object",
    "missing_field",
    "not_a_string",
    "empty_text",
    "prompt_too_long",
    "bad_conversation",
)
"""Why a record can be refused, in the order the checks run."""

_JSONL_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet", ".pq")
_PARQUET_BATCH_ROWS = 4096


class DataError(ValueError):
    """A data file or record that cannot be used; the message says where and how to fix it."""


@dataclass(frozen=True)
class PreferenceRecord:
    """One checked record; fields not in ``ReaderConfig.required`` may be None."""

    prompt: str
    response: str | None = None
    chosen: str | None = None
    rejected: str | None = None
    messages: Conversation | None = None
    """The prompt's turns for a conversation-shaped record (``prompt`` then joins their text)."""
    turns: Conversation | None = None
    """The SFT response as a tool-calling trajectory (``FieldNames.turns``), when the record has
    one."""
    row: dict[str, Any] | None = field(default=None, compare=False, repr=False)
    """The whole record as read (every field, ``answer`` or ``tests`` included): what reward
    functions receive (docs/rewards.md)."""


@dataclass(frozen=True)
class BadRecord:
    """Where a bad record is and why it was refused."""

    reason: str
    """One of :data:`BAD_REASONS`."""
    path: str
    """The file."""
    line: int
    """1-based line (JSONL), record (a JSON array's element) or row (Parquet) number."""
    unit: str
    """``line``, ``record`` or ``row``."""
    field: str | None
    """The offending column, when one is to blame."""
    detail: str
    """A short human-readable explanation."""

    def describe(self) -> str:
        """One line: ``file line N, field 'x': reason (detail)``."""
        where = f"{self.path} {self.unit} {self.line}"
        if self.field is not None:
            where += f", field {self.field!r}"
        return f"{where}: {self.reason} ({self.detail})"


@dataclass
class ReadSummary:
    """What reading one file produced: record counts, bad counts per reason, first examples."""

    path: str
    num_read: int = 0
    """Records seen (bad ones included, blank lines excluded)."""
    num_kept: int = 0
    """Records that passed every check."""
    counts: dict[str, int] = field(default_factory=dict)
    """Bad records per reason."""
    examples: list[BadRecord] = field(default_factory=list)
    """The first ``max_examples`` bad records of each reason."""

    @property
    def num_bad(self) -> int:
        """Bad records of every reason."""
        return sum(self.counts.values())

    def format(self) -> str:
        """A multi-line report for logs."""
        lines = [f"{self.path}: kept {self.num_kept} of {self.num_read} records"]
        lines += [f"  {reason}: {count}" for reason, count in sorted(self.counts.items())]
        lines += [f"  e.g. {bad.describe()}" for bad in self.examples]
        return "\n".join(lines)


def _text_fields(config: ReaderConfig) -> dict[str, str]:
    return {name: getattr(config.fields, name) for name in RECORD_FIELDS}


def _columns(config: ReaderConfig) -> dict[str, str]:
    return _text_fields(config) | {"messages": config.fields.messages}


def prompt_tokens(prompt: str, messages: Conversation | None,
                  tokenizer: Tokenizer | HFTokenizer) -> int:
    """The length ``ReaderConfig.max_prompt_tokens`` limits: the prompt's text without BOS, or a
    conversation through the chat template with the generation prompt (as the rollout encodes
    it)."""
    if messages is not None and isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template:
        return len(tokenizer.encode_chat(messages))
    return len(tokenizer.encode(prompt))


def _check_conversation(row: dict[str, Any], config: ReaderConfig, required: list[str],
                        with_turns: bool) -> PreferenceRecord | tuple[str, str, str]:
    try:
        turns, texts = split_conversation(row, _columns(config))
    except ConversationError as err:
        return "bad_conversation", err.column, err.detail
    messages = row.get(config.fields.messages)
    if with_turns and messages and messages[-1]["role"] == "assistant":
        return ("bad_conversation", config.fields.messages,
                f"the last turn is the assistant's, but the response is {config.fields.turns!r}: "
                f"with {config.fields.turns!r}, {config.fields.messages!r} holds the prompt only")
    for name in required:
        if name in texts and name != "prompt" and (texts[name] is None
                                                    or not texts[name].strip()):
            column = getattr(config.fields, name)
            alternative = f" and no {config.fields.turns!r}" if name == "response" else ""
            return ("missing_field", column,
                    f"no {name} text in the record's turns or {column!r}{alternative}")
    prompt = "\n\n".join(turn["content"] for turn in turns)
    return PreferenceRecord(prompt=prompt, messages=turns, **texts)


def _check_row(
    row: dict[str, Any], config: ReaderConfig, tokenizer: Tokenizer | HFTokenizer | None
) -> PreferenceRecord | tuple[str, str, str]:
    """Return the record, or ``(reason, column, detail)`` for the first failed check. A record
    with ``turns`` (a tool-calling trajectory) needs no ``response``."""
    for column in config.extra_required:
        value = row.get(column)
        if value is None:
            return ("missing_field", column,
                    f"no {column!r}: key absent or null ({config.WHERE}.required)")
        if isinstance(value, str) and not value.strip():
            return ("empty_text", column,
                    f"the {column!r} is empty or whitespace ({config.WHERE}.required)")
    turns = row.get(config.fields.turns)
    if turns is not None:
        try:
            turns = tool_turns(turns, config.fields.turns)
        except ConversationError as err:
            return "bad_conversation", err.column, err.detail
    required = [name for name in config.required if turns is None or name != "response"]
    if is_conversation_row(row, _columns(config)):
        record = _check_conversation(row, config, required, turns is not None)
        if isinstance(record, tuple):
            return record
        return _check_length(replace(record, turns=turns), config, tokenizer)
    values: dict[str, str | None] = {}
    for name, column in _text_fields(config).items():
        value = row.get(column)
        if name not in required:
            values[name] = value if isinstance(value, str) and value.strip() else None
        elif value is None:
            alternative = f" and no {config.fields.turns!r}" if name == "response" else ""
            return ("missing_field", column,
                    f"no {name}: key {column!r} absent or null{alternative}")
        elif not isinstance(value, str):
            return "not_a_string", column, f"expected text, got {type(value).__name__}"
        elif not value.strip():
            return "empty_text", column, f"the {name} is empty or whitespace"
        else:
            values[name] = value
    return _check_length(PreferenceRecord(**values, turns=turns), config, tokenizer)


def _check_length(record: PreferenceRecord, config: ReaderConfig,
                  tokenizer: Tokenizer | HFTokenizer | None
                  ) -> PreferenceRecord | tuple[str, str, str]:
    if config.max_prompt_tokens is not None and tokenizer is not None:
        num_tokens = prompt_tokens(record.prompt, record.messages, tokenizer)
        if num_tokens > config.max_prompt_tokens:
            column = config.fields.prompt if record.messages is None else config.fields.messages
            return (
                "prompt_too_long",
                column,
                f"{num_tokens} tokens > max_prompt_tokens({config.max_prompt_tokens})",
            )
    return record


def _jsonl_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | tuple[str, str]]]:
    """Yield ``(line, row)`` or ``(line, (reason, detail))`` for every non-blank line."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                yield number, ("invalid_utf8", f"byte {err.start}: {err.reason}")
                continue
            if not text.strip():
                continue
            try:
                # Without its line ending, a truncated line's error points into the line.
                value = json.loads(text.rstrip("\r\n"))
            except json.JSONDecodeError as err:
                yield number, ("invalid_json", f"column {err.colno}: {err.msg}")
                continue
            yield number, _object_or_reason(value)


def _object_or_reason(value: Any) -> dict[str, Any] | tuple[str, str]:
    if isinstance(value, dict):
        return value
    return "not_an_object", f"a JSON {type(value).__name__}, not an object"


def _is_json_array(path: Path) -> bool:
    """Whether a ``.json`` file's first non-blank character opens an array."""
    with path.open("rb") as handle:
        for raw in handle:
            text = raw.lstrip(b"\xef\xbb\xbf \t\r\n")
            if text:
                return text.startswith(b"[")
    return False


def _json_array_rows(path: Path) -> Iterator[tuple[int, dict[str, Any] | tuple[str, str]]]:
    """Yield ``(index, row)`` (1-based) for every element of a file holding one JSON array."""
    try:
        values = json.loads(path.read_bytes().decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise DataError(f"{path} holds a JSON array that is not valid UTF-8 (byte {err.start}: "
                        f"{err.reason})") from err
    except json.JSONDecodeError as err:
        raise DataError(f"{path} holds a JSON array that does not parse: line {err.lineno} "
                        f"column {err.colno}: {err.msg}. Fix the file, or write it as JSON "
                        "Lines (.jsonl, one object per line) so that bad records can be "
                        "skipped") from err
    for number, value in enumerate(values, start=1):
        yield number, _object_or_reason(value)


def _parquet_rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(row, values)`` with every column (reward functions see the whole record)."""
    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path} is not a readable Parquet file: {err}") from err
    batches = parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS)
    number = 0
    while True:
        try:
            batch = next(batches, None)
        except pa.ArrowException as err:
            raise DataError(f"{path}: cannot read rows after row {number}: {err}") from err
        if batch is None:
            return
        for values in batch.to_pylist():
            number += 1
            yield number, values


class _Tally:
    """Applies the bad-record policy and fills the summary."""

    def __init__(self, path: Path, config: ReaderConfig) -> None:
        self.config = config
        self.summary = ReadSummary(path=str(path))

    def bad(self, bad: BadRecord) -> None:
        if self.config.on_bad_record == "error":
            raise DataError(
                f"bad record at {bad.describe()}. Fix the file, or set "
                f"{self.config.WHERE}.on_bad_record=skip to drop such records"
            )
        count = self.summary.counts.get(bad.reason, 0)
        self.summary.counts[bad.reason] = count + 1
        if count < self.config.max_examples:
            self.summary.examples.append(bad)


def read_records(
    path: str | os.PathLike[str], config: ReaderConfig,
    tokenizer: Tokenizer | HFTokenizer | None = None,
) -> tuple[list[PreferenceRecord], ReadSummary]:
    """Read and check one JSONL or Parquet file.

    Args:
        path: a ``.jsonl``/``.json`` (one JSON object per line), a ``.json`` holding one
            array of objects, or a ``.parquet`` file.
        config: column names, required fields, bad-record policy and prompt token limit.
        tokenizer: encodes prompts for the ``max_prompt_tokens`` check; required when it is set.

    Returns:
        The good records in file order, and the summary of what was read and refused.

    Raises:
        DataError: for an unusable file, or for the first bad record when
            ``on_bad_record == "error"``.
        ValueError: if ``max_prompt_tokens`` is set without a tokenizer.
    """
    file = Path(path)
    if config.max_prompt_tokens is not None and tokenizer is None:
        raise ValueError(
            f"max_prompt_tokens({config.max_prompt_tokens}) needs a tokenizer; pass tokenizer= "
            "or set max_prompt_tokens=None"
        )
    if not file.is_file():
        raise DataError(f"data file {file} does not exist")
    suffix = file.suffix.lower()
    if suffix == ".json" and _is_json_array(file):
        rows, unit = _json_array_rows(file), "record"
    elif suffix in _JSONL_SUFFIXES:
        rows, unit = _jsonl_rows(file), "line"
    elif suffix in _PARQUET_SUFFIXES:
        rows, unit = _parquet_rows(file), "row"
    else:
        raise DataError(
            f"{file}: unknown extension {suffix!r}; use {_JSONL_SUFFIXES + _PARQUET_SUFFIXES}"
        )
    tally = _Tally(file, config)
    records = []
    for number, row in rows:
        tally.summary.num_read += 1
        if isinstance(row, tuple):
            reason, detail = row
            tally.bad(BadRecord(reason, str(file), number, unit, None, detail))
            continue
        checked = _check_row(row, config, tokenizer)
        if isinstance(checked, tuple):
            reason, column, detail = checked
            tally.bad(BadRecord(reason, str(file), number, unit, column, detail))
            continue
        records.append(replace(checked, row=row))
    tally.summary.num_kept = len(records)
    if tally.summary.num_bad:
        logger.warning("skipped %d bad records\n%s", tally.summary.num_bad, tally.summary.format())
    return records, tally.summary


def read_files(
    paths: list[str], config: ReaderConfig, tokenizer: Tokenizer | HFTokenizer | None = None
) -> tuple[list[PreferenceRecord], list[ReadSummary]]:
    """Read several files with :func:`read_records`, concatenating records in order."""
    records: list[PreferenceRecord] = []
    summaries = []
    for path in paths:
        file_records, summary = read_records(path, config, tokenizer)
        records.extend(file_records)
        summaries.append(summary)
    return records, summaries
