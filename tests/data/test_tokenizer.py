"""Tokenizer: deterministic training, cache, round trips, special ids, mismatch detection."""

from __future__ import annotations

from pathlib import Path

import pytest

import megatron_rlhf.models.tokenizer as tokenizer_module
from megatron_rlhf.data.corpus import generate_corpus
from megatron_rlhf.data.synthetic import SyntheticTaskConfig, generate_records
from megatron_rlhf.models.tokenizer import (
    SHIPPED_CORPUS,
    Tokenizer,
    TokenizerConfig,
    check_same_tokenizer,
)


def test_shipped_corpus_is_committed_output_of_generator() -> None:
    text = SHIPPED_CORPUS.read_text(encoding="utf-8")
    assert text == generate_corpus(), "run: python -m megatron_rlhf.data.corpus"
    assert len(text.encode()) < 200_000
    assert text.count("\n") > 300


def test_training_twice_gives_identical_bytes_and_fingerprint(tmp_path: Path) -> None:
    copy = tmp_path / "elsewhere.txt"
    copy.write_bytes(SHIPPED_CORPUS.read_bytes())
    first = Tokenizer.train(SHIPPED_CORPUS, 512, tmp_path / "a.model")
    second = Tokenizer.train(copy, 512, tmp_path / "b.model")
    assert (tmp_path / "a.model").read_bytes() == (tmp_path / "b.model").read_bytes()
    assert first.fingerprint == second.fingerprint
    assert len(first.fingerprint) == 64
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.model", "b.model", "elsewhere.txt"]


def test_fingerprint_changes_with_vocab_and_corpus(tmp_path: Path, tokenizer: Tokenizer) -> None:
    smaller = Tokenizer.train(SHIPPED_CORPUS, 300, tmp_path / "small.model")
    assert smaller.vocab_size == 300
    assert smaller.fingerprint != tokenizer.fingerprint
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(SHIPPED_CORPUS.read_text() + "An extra line about zebras.\n")
    other = Tokenizer.train(corpus, 512, tmp_path / "other.model")
    assert other.fingerprint != tokenizer.fingerprint


def test_train_cached_trains_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = Tokenizer.train_cached(SHIPPED_CORPUS, 512, tmp_path)
    assert [p.suffix for p in tmp_path.iterdir()] == [".model"]

    def no_training(*args: object) -> bytes:
        raise AssertionError("cache miss: trained again")

    monkeypatch.setattr(tokenizer_module, "_train_model_bytes", no_training)
    second = Tokenizer.train_cached(SHIPPED_CORPUS, 512, tmp_path)
    assert second.fingerprint == first.fingerprint
    with pytest.raises(AssertionError, match="cache miss"):
        Tokenizer.train_cached(SHIPPED_CORPUS, 400, tmp_path)


def test_from_config_uses_model_path_or_shipped_corpus(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    cached = Tokenizer.from_config(TokenizerConfig(cache_dir=str(tmp_path)))
    assert cached.fingerprint == tokenizer.fingerprint
    loaded = Tokenizer.from_config(TokenizerConfig(model_path=tokenizer.source))
    assert loaded.fingerprint == tokenizer.fingerprint


@pytest.mark.parametrize(
    "text",
    [
        "The old man walked to the river yesterday.",
        "Spaces  twice, and a tab\tinside; numbers 1234 and symbols #$%&*!",
        " leading and trailing spaces ",
        "Zebra QUIZ xylophone: {braces} [brackets] <angles> ~tilde~ `tick` \\ |",
        "",
    ],
)
def test_encode_decode_round_trip(tokenizer: Tokenizer, text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.unk_id not in tokenizer.encode(text)


def test_task_text_round_trips_compactly(tokenizer: Tokenizer) -> None:
    num_tokens = num_words = 0
    for record in generate_records(SyntheticTaskConfig(seed=3, num_train=50)):
        for text in (record["prompt"], record["chosen"]):
            ids = tokenizer.encode(text)
            assert tokenizer.decode(ids) == text
            num_tokens += len(ids)
            num_words += len(text.split())
    assert num_tokens / num_words < 1.3, "task words should mostly be single pieces"


def test_special_ids(tokenizer: Tokenizer) -> None:
    assert (tokenizer.pad_id, tokenizer.unk_id, tokenizer.bos_id, tokenizer.eos_id) == (0, 1, 2, 3)
    assert tokenizer.vocab_size == 512
    plain = tokenizer.encode("Write about the ocean:")
    assert not {tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id} & set(plain)
    framed = tokenizer.encode("Write about the ocean:", add_bos=True, add_eos=True)
    assert framed == [tokenizer.bos_id] + plain + [tokenizer.eos_id]
    padded = [tokenizer.pad_id, tokenizer.pad_id] + framed
    assert tokenizer.decode(padded) == "Write about the ocean:"


def test_unseen_characters_map_to_unk(tokenizer: Tokenizer) -> None:
    assert tokenizer.unk_id in tokenizer.encode("caf\u00e9 \u2211")


def test_decode_rejects_out_of_range_ids(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 512\)"):
        tokenizer.decode([5, 512])


def test_same_tokenizer_passes_and_mismatch_names_both(
    tmp_path: Path, tokenizer: Tokenizer
) -> None:
    check_same_tokenizer(tokenizer, Tokenizer.load(tokenizer.source), ("actor", "reward model"))
    other = Tokenizer.train(SHIPPED_CORPUS, 300, tmp_path / "rm.model")
    with pytest.raises(ValueError) as err:
        check_same_tokenizer(tokenizer, other, ("actor", "reward model"))
    message = str(err.value)
    assert "actor" in message and "reward model" in message
    assert tokenizer.fingerprint[:12] in message and other.fingerprint[:12] in message
    assert "same tokenizer" in message


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Tokenizer.train"):
        Tokenizer.load(tmp_path / "missing.model")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        Tokenizer.load(garbage)


def test_corpus_too_small_for_vocab(tmp_path: Path) -> None:
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("a b c\nabc cab\n")
    with pytest.raises(ValueError, match="Lower vocab_size"):
        Tokenizer.train(corpus, 512, tmp_path / "tiny.model")
    assert not (tmp_path / "tiny.model").exists()
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="is empty"):
        Tokenizer.train(empty, 64, tmp_path / "empty.model")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"vocab_size": 4}, "vocab_size"),
        ({"model_type": "wordpiece"}, "model_type"),
        ({"vocab_size": 100, "byte_fallback": True}, "byte_fallback"),
        ({"user_defined_symbols": ["<a>", "<a>"]}, "user_defined_symbols"),
        ({"user_defined_symbols": [""]}, "user_defined_symbols"),
        ({"vocab_size": 6, "user_defined_symbols": ["<a>", "<b>"]}, "user_defined_symbols"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        TokenizerConfig(**kwargs)


def test_user_defined_symbols_and_split_digits_shape_the_pieces(tmp_path: Path) -> None:
    corpus = tmp_path / "calls.txt"
    corpus.write_text("".join(f"<tool_call>{{\"a\": {a}, \"b\": {a * 7}}}</tool_call> 12 {a}\n"
                              for a in range(100, 400)))
    tags = ["<tool_call>", "</tool_call>", "\n"]
    plain = Tokenizer.train(corpus, 80, tmp_path / "plain.model")
    shaped = Tokenizer.from_config(TokenizerConfig(
        corpus_path=str(corpus), vocab_size=28, split_digits=True, user_defined_symbols=tags,
        cache_dir=str(tmp_path / "cache")))
    pieces = [shaped._sp.id_to_piece(i) for i in range(shaped.vocab_size)]
    assert not any(sum(c.isdigit() for c in piece) > 1 for piece in pieces)
    assert any(sum(c.isdigit() for c in piece) > 1
               for piece in (plain._sp.id_to_piece(i) for i in range(plain.vocab_size)))
    # each tag is one piece, wherever it stands, and "\n" (absent from a line corpus) is no <unk>
    text = '<tool_call>{"a": 123}</tool_call>\n12'
    for tag in tags:
        assert shaped.encode_continuation(tag) == [pieces.index(tag)]
        assert pieces.index(tag) in shaped.encode(text)
    assert shaped.unk_id not in shaped.encode(text)
    assert shaped.decode(shaped.encode(text)) == text
    # the continuation ids are what the tag is inside a longer text (a stop sequence's match)
    assert shaped.encode(text)[-4:-2] == shaped.encode_continuation("</tool_call>\n")
    assert shaped.encode("</tool_call>")[1:] == shaped.encode_continuation("</tool_call>")
    assert plain.encode_continuation("12 100") == plain.encode("12 100")  # no lone word start
