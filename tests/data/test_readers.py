"""Readers: good JSONL/Parquet files, every bad-record reason under both policies."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_rlhf.data import (
    BAD_REASONS,
    DataError,
    FieldNames,
    ReaderConfig,
    SFTDataset,
    SyntheticTaskConfig,
    generate_records,
    read_files,
    read_records,
    write_task_jsonl,
)
from megatron_rlhf.models.tokenizer import Tokenizer

GOOD = {
    "prompt": "Write about the ocean:",
    "response": "wave tide.",
    "chosen": "wave tide.",
    "rejected": "pan oven.",
}


def _write_jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _json(record: dict[str, object]) -> bytes:
    return json.dumps(record).encode()


BAD_LINES = {
    "invalid_utf8": (b'{"prompt": "caf\xe9", "response": "x"}', None),
    "invalid_json": (b'{"prompt": "unterminated', None),
    "not_an_object": (b'["prompt", "response"]', None),
    "missing_field": (_json({k: v for k, v in GOOD.items() if k != "chosen"}), "chosen"),
    "not_a_string": (_json({**GOOD, "rejected": 42}), "rejected"),
    "empty_text": (_json({**GOOD, "response": "  \t "}), "response"),
    "prompt_too_long": (_json({**GOOD, "prompt": "word " * 80}), "prompt"),
    "bad_conversation": (_json({**GOOD, "chosen": [{"role": "assistant"}]}), "chosen"),
}


def test_every_reason_has_a_case() -> None:
    assert set(BAD_LINES) == set(BAD_REASONS)


def test_good_synthetic_file_reads_completely(tmp_path: Path) -> None:
    config = SyntheticTaskConfig(seed=1, num_train=40, num_test=5)
    paths = write_task_jsonl(tmp_path, config)
    records, summary = read_records(paths["train"], ReaderConfig())
    expected = generate_records(config, "train")
    assert [r.prompt for r in records] == [e["prompt"] for e in expected]
    assert [r.rejected for r in records] == [e["rejected"] for e in expected]
    assert (summary.num_read, summary.num_kept, summary.num_bad) == (40, 40, 0)
    all_records, summaries = read_files([str(p) for p in paths.values()], ReaderConfig())
    assert len(all_records) == 45 and [s.num_kept for s in summaries] == [40, 5]


@pytest.mark.parametrize("reason", BAD_REASONS)
def test_bad_record_is_skipped_and_counted(
    tmp_path: Path, tokenizer: Tokenizer, reason: str
) -> None:
    line, field = BAD_LINES[reason]
    path = _write_jsonl(tmp_path / "data.jsonl", [_json(GOOD), line, b"", _json(GOOD)])
    config = ReaderConfig(max_prompt_tokens=32)
    records, summary = read_records(path, config, tokenizer)
    assert len(records) == 2 and records[0].prompt == GOOD["prompt"]
    assert summary.counts == {reason: 1}
    assert (summary.num_read, summary.num_kept) == (3, 2)
    (example,) = summary.examples
    assert (example.reason, example.line, example.field) == (reason, 2, field)
    assert f"{path} line 2" in summary.format()


@pytest.mark.parametrize("reason", BAD_REASONS)
def test_bad_record_is_refused_with_file_line_and_field(
    tmp_path: Path, tokenizer: Tokenizer, reason: str
) -> None:
    line, field = BAD_LINES[reason]
    path = _write_jsonl(tmp_path / "data.jsonl", [_json(GOOD), _json(GOOD), line])
    config = ReaderConfig(on_bad_record="error", max_prompt_tokens=32)
    with pytest.raises(DataError) as err:
        read_records(path, config, tokenizer)
    message = str(err.value)
    assert f"{path} line 3" in message and reason in message
    assert "on_bad_record=skip" in message
    if field is not None:
        assert f"field {field!r}" in message


def test_counts_and_examples_per_reason(tmp_path: Path) -> None:
    lines = [_json(GOOD)] + [b"{oops"] * 7 + [_json({"prompt": 1})] * 2
    path = _write_jsonl(tmp_path / "data.jsonl", lines)
    records, summary = read_records(path, ReaderConfig(max_examples=3))
    assert len(records) == 1
    assert summary.counts == {"invalid_json": 7, "not_a_string": 2}
    assert [(e.reason, e.line) for e in summary.examples] == [
        ("invalid_json", 2),
        ("invalid_json", 3),
        ("invalid_json", 4),
        ("not_a_string", 9),
        ("not_a_string", 10),
    ]


def test_configurable_field_names_and_optional_fields(tmp_path: Path) -> None:
    record = {"question": "Tell me something about the farm.", "good": "cow hay.", "bad": "sun."}
    path = _write_jsonl(tmp_path / "renamed.jsonl", [_json(record)])
    config = ReaderConfig(
        fields=FieldNames(prompt="question", chosen="good", rejected="bad"),
        required=["prompt", "chosen", "rejected"],
    )
    (read,), summary = read_records(path, config)
    assert (read.prompt, read.chosen, read.rejected, read.response) == (
        record["question"],
        "cow hay.",
        "sun.",
        None,
    )
    with pytest.raises(ValueError, match="add 'response' to reader.required"):
        SFTDataset([read])
    _, strict = read_records(path, ReaderConfig(fields=FieldNames(prompt="question")))
    assert strict.counts == {"missing_field": 1}


def test_parquet_good_and_bad_rows(tmp_path: Path) -> None:
    table = pa.table(
        {
            "prompt": [
                "Write about the city:",
                None,
                "Topic: farm. Answer:",
                "Topic: space. Answer:",
            ],
            "response": ["bus road.", "x.", "", "moon star."],
            "chosen": ["bus road.", "x.", "cow.", "moon star."],
            "rejected": ["fish.", "y.", "sun.", "pan."],
        }
    )
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    records, summary = read_records(path, ReaderConfig())
    assert [r.prompt for r in records] == ["Write about the city:", "Topic: space. Answer:"]
    assert summary.counts == {"missing_field": 1, "empty_text": 1}
    assert [(e.line, e.unit, e.field) for e in summary.examples] == [
        (2, "row", "prompt"),
        (3, "row", "response"),
    ]
    with pytest.raises(DataError, match=r"data\.parquet row 2, field 'prompt': missing_field"):
        read_records(path, ReaderConfig(on_bad_record="error"))


def test_parquet_wrong_types_and_missing_column(tmp_path: Path) -> None:
    path = tmp_path / "typed.parquet"
    pq.write_table(pa.table({"prompt": [1, 2], "chosen": ["a", "b"]}), path)
    _, summary = read_records(path, ReaderConfig(required=["prompt", "chosen"]))
    assert summary.counts == {"not_a_string": 2}
    _, summary = read_records(path, ReaderConfig())
    assert summary.counts == {"not_a_string": 2}
    pq.write_table(pa.table({"prompt": ["p"]}), path)
    _, summary = read_records(path, ReaderConfig())
    assert summary.counts == {"missing_field": 1}
    assert summary.examples[0].field == "response"


def test_unusable_files_always_raise(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl", ReaderConfig())
    fake = tmp_path / "fake.parquet"
    fake.write_bytes(b"this is not parquet")
    with pytest.raises(DataError, match="not a readable Parquet file"):
        read_records(fake, ReaderConfig())
    csv = tmp_path / "data.csv"
    csv.write_text("prompt,response\n")
    with pytest.raises(DataError, match="unknown extension '.csv'"):
        read_records(csv, ReaderConfig())


def test_prompt_limit_needs_a_tokenizer(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [_json(GOOD)])
    with pytest.raises(ValueError, match="needs a tokenizer"):
        read_records(path, ReaderConfig(max_prompt_tokens=8))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"on_bad_record": "ignore"}, "on_bad_record"),
        ({"required": ["response"]}, "prompt"),
        ({"required": ["prompt", "messages"]}, "'messages' cannot be required"),
        ({"required": ["prompt", " "]}, r"reader.required=\['prompt', ' '\] holds"),
        ({"max_prompt_tokens": 0}, "max_prompt_tokens"),
        ({"max_examples": -1}, "max_examples"),
    ],
)
def test_reader_config_validation(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        ReaderConfig(**kwargs)


def _turn(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CONVERSATION_RECORDS = [
    # HH-RLHF style: two whole conversations sharing their prompt turns.
    {"chosen": [_turn("user", "Hi"), _turn("assistant", "Hello!"), _turn("user", "Sea?"),
                _turn("assistant", "wave tide.")],
     "rejected": [_turn("user", "Hi"), _turn("assistant", "Hello!"), _turn("user", "Sea?"),
                  _turn("assistant", "pan oven.")], "response": "tide."},
    # UltraFeedback-binarized style: a text prompt, the answers as [user, assistant] turns.
    {"prompt": "Sea?", "chosen": [_turn("user", "Sea?"), _turn("assistant", "wave tide.")],
     "rejected": [_turn("user", "Sea?"), _turn("assistant", "pan oven.")], "response": "tide."},
    # A messages conversation ending with the reference answer; text preferences.
    {"messages": [_turn("system", "Be brief."), _turn("user", "Sea?"),
                  _turn("assistant", "tide.")], "chosen": "wave tide.", "rejected": "pan oven."},
]


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_conversation_records_give_prompt_turns_and_answers(tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"conv{suffix}"
    bad = {"chosen": [_turn("user", "Hi"), _turn("assistant", "a")],
           "rejected": [_turn("user", "Bye"), _turn("assistant", "b")], "response": "c"}
    records = [*CONVERSATION_RECORDS, bad]
    if suffix == ".jsonl":
        _write_jsonl(path, [_json(r) for r in records])
    else:  # one schema for every row: text columns as strings, turns as JSON strings
        pq.write_table(pa.Table.from_pylist([{k: v for k, v in r.items()} for r in records[:2]]),
                       path)
    read, summary = read_records(path, ReaderConfig())
    first, second = read[0], read[1]
    assert first.messages == (_turn("user", "Hi"), _turn("assistant", "Hello!"),
                              _turn("user", "Sea?"))
    assert (first.chosen, first.rejected, first.response) == ("wave tide.", "pan oven.", "tide.")
    assert first.prompt == "Hi\n\nHello!\n\nSea?"
    assert second.messages == (_turn("user", "Sea?"),) and second.chosen == "wave tide."
    if suffix == ".jsonl":
        third = read[2]
        assert third.messages == (_turn("system", "Be brief."), _turn("user", "Sea?"))
        assert (third.response, third.chosen) == ("tide.", "wave tide.")
        assert summary.counts == {"bad_conversation": 1}
        assert "continues another conversation" in summary.examples[0].detail


def test_bad_conversations_are_refused_by_the_policy(tmp_path: Path) -> None:
    ends_with_user = {"chosen": [_turn("user", "Hi")], "rejected": [_turn("user", "Hi")],
                      "response": "x", "prompt": "Hi"}
    path = _write_jsonl(tmp_path / "bad.jsonl", [_json(ends_with_user)])
    with pytest.raises(DataError, match=r"bad.jsonl line 1, field 'chosen': bad_conversation "
                                        r"\(the last turn is 'user', not the assistant's answer"):
        read_records(path, ReaderConfig(on_bad_record="error"))
    no_response = {"messages": [_turn("user", "Sea?")], "chosen": "a", "rejected": "b"}
    path = _write_jsonl(tmp_path / "nr.jsonl", [_json(no_response)])
    records, summary = read_records(path, ReaderConfig())
    assert not records and summary.examples[0].reason == "missing_field"
    assert summary.examples[0].field == "response"
    records, _ = read_records(path, ReaderConfig(required=["prompt", "chosen", "rejected"]))
    assert records[0].messages == (_turn("user", "Sea?"),) and records[0].response is None


def test_prompt_limit_counts_the_chat_template_of_conversations(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer
    from tools.make_tiny_hf import make_hf_tokenizer

    make_hf_tokenizer(tmp_path / "tok", "qwen")
    tokenizer = HFTokenizer.load(tmp_path / "tok")
    turns = [_turn("user", "Sea?")]
    templated = len(tokenizer.encode_chat(turns))
    assert templated > 20 > len(tokenizer.encode("Sea?"))  # Qwen's template adds a system turn
    path = _write_jsonl(tmp_path / "p.jsonl", [_json({"messages": turns}),
                                               _json({"prompt": "Sea?"})])
    records, summary = read_records(path, ReaderConfig(required=["prompt"], max_prompt_tokens=20),
                                    tokenizer)
    assert [r.prompt for r in records] == ["Sea?"] and records[0].messages is None
    assert summary.examples[0].reason == "prompt_too_long"
    assert summary.examples[0].field == "messages"
    assert summary.examples[0].detail == f"{templated} tokens > max_prompt_tokens(20)"


def test_a_json_file_holding_an_array_of_records_is_read_as_records(tmp_path: Path) -> None:
    path = tmp_path / "prefs.json"
    path.write_text(json.dumps([GOOD, {**GOOD, "chosen": 3}, "text", GOOD], indent=2))
    records, summary = read_records(path, ReaderConfig())
    assert len(records) == 2 and records[0].prompt == GOOD["prompt"]
    assert summary.counts == {"not_a_string": 1, "not_an_object": 1}
    assert [bad.describe() for bad in summary.examples] == [
        f"{path} record 2, field 'chosen': not_a_string (expected text, got int)",
        f"{path} record 3: not_an_object (a JSON str, not an object)"]


def test_a_json_array_that_does_not_parse_names_its_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "prefs.json"
    path.write_text('[\n  {"prompt": "a"},\n  {"prompt": "b",}\n]\n')
    with pytest.raises(DataError, match=r"prefs.json holds a JSON array that does not parse: "
                       r"line 3 column 18: Expecting property name"):
        read_records(path, ReaderConfig(required=["prompt"]))


def test_a_json_lines_error_names_the_column_where_the_line_breaks(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [b'{"prompt": "a", "response": "b"',
                                                  b'{"prompt": "a",, "response": "b"}'])
    _, summary = read_records(path, ReaderConfig(required=["prompt"]))
    assert [bad.detail for bad in summary.examples] == [
        "column 32: Expecting ',' delimiter", "column 16: Expecting property name enclosed in "
        "double quotes"]
