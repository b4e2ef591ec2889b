"""The checkpoint's own tokenizer: ids, special tokens, chat template and decoding equal
``transformers``' AutoTokenizer on a test corpus (Llama-3 and Qwen styles); bad directories are
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tools.make_tiny_hf import CONVERSATIONS, SENTENCES, make_hf_tokenizer

_TEXTS = [*SENTENCES, "unseen words: zebra, quixotic", "é ü ß 中文", ""]


def _ids(encoded) -> list[int]:
    """apply_chat_template returns ids or a BatchEncoding depending on the version."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


@pytest.mark.parametrize("style", ["llama3", "qwen"])
def test_ids_specials_and_chat_template_equal_transformers(tmp_path: Path, style: str) -> None:
    from transformers import AutoTokenizer

    from megatron_rlhf.models.hf_tokenizer import HFTokenizer

    make_hf_tokenizer(tmp_path, style)
    ours, theirs = HFTokenizer.load(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    for text in _TEXTS:
        plain = ours.encode(text)
        assert plain == theirs(text, add_special_tokens=False).input_ids, text
        # transformers' default framing: Llama-3's post-processor adds BOS, Qwen adds nothing.
        assert ours.encode(text, add_bos=True) == theirs(text).input_ids, text
        assert ours.decode(plain) == theirs.decode(plain, skip_special_tokens=True)
    for messages in CONVERSATIONS:
        for prompt in (True, False):
            rendered = theirs.apply_chat_template(messages, add_generation_prompt=prompt,
                                                  tokenize=False)
            assert ours.render_chat(messages, prompt) == rendered
            assert ours.encode_chat(messages, prompt) == _ids(theirs.apply_chat_template(
                messages, add_generation_prompt=prompt, tokenize=True))
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (
        theirs.bos_token_id, theirs.eos_token_id,
        theirs.pad_token_id if theirs.pad_token_id is not None else theirs.eos_token_id)
    assert ours.vocab_size == len(theirs)
    generation = json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"]
    assert ours.eos_ids == tuple(generation) and len(ours.eos_ids) == 2


def test_fingerprint_follows_vocabulary_and_template(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer

    for name in ("a", "b", "c"):
        make_hf_tokenizer(tmp_path / name, "qwen", vocab_size=300 if name != "c" else 290)
    config = json.loads((tmp_path / "b" / "tokenizer_config.json").read_text())
    (tmp_path / "b" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "b" / "tokenizer_config.json").write_text(json.dumps(config))
    a, b, c = (HFTokenizer.load(tmp_path / name) for name in ("a", "b", "c"))
    assert a.fingerprint == HFTokenizer.load(tmp_path / "a").fingerprint
    assert len({a.fingerprint, b.fingerprint, c.fingerprint}) == 3


def test_bad_tokenizer_directories_are_refused_by_name(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer

    with pytest.raises(FileNotFoundError, match="tokenizer.json does not exist"):
        HFTokenizer.load(tmp_path)
    make_hf_tokenizer(tmp_path, "llama3")
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | {"eos_token": "<eos>"}))
    with pytest.raises(ValueError, match="eos_token='<eos>'.*not in tokenizer.json"):
        HFTokenizer.load(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="chat template does not parse"):
        HFTokenizer.load(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    plain = HFTokenizer.load(tmp_path)
    assert not plain.has_chat_template
    with pytest.raises(ValueError, match="has no chat template"):
        plain.render_chat(CONVERSATIONS[0])
    make_hf_tokenizer(tmp_path / "t", "llama3")
    with pytest.raises(ValueError, match="chat template refused the messages.*unknown role"):
        HFTokenizer.load(tmp_path / "t").render_chat([{"role": "robot", "content": "hi"}])
