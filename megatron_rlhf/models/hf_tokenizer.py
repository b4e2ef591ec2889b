"""The tokenizer that ships with a Hugging Face checkpoint: special tokens and chat template.

    tokenizer = HFTokenizer.load("Qwen2.5-0.5B-Instruct")
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hi"}])  # generation prompt appended
    tokenizer.eos_ids   # every id that ends a reply (Llama-3: <|end_of_text|>, <|eot_id|>, ...)

``tokenizer.json`` is read with the ``tokenizers`` library; BOS/EOS/PAD come from
``tokenizer_config.json`` (``special_tokens_map.json`` fills gaps), further end-of-reply ids from
``generation_config.json`` and ``config.json``'s ``eos_token_id``; the chat template from
``chat_template.jinja`` or ``tokenizer_config.json``. Templates are rendered as ``transformers``
renders them (a sandboxed jinja2 environment with ``trim_blocks``/``lstrip_blocks``, its
``raise_exception``, ``strftime_now`` and ``tojson``), and the rendered text is encoded without
added special tokens, so ids equal ``AutoTokenizer.apply_chat_template(..., tokenize=True)``'s.
The interface is :class:`~megatron_rlhf.models.tokenizer.Tokenizer`'s (``encode``, ``decode``,
``pad_id``, ``bos_id``, ``eos_id``, ``vocab_size``, ``fingerprint``), so either can drive a run.
A checkpoint without a pad token pads with its EOS id (padding is masked everywhere).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as RustTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "tokenizer.model", "generation_config.json")
"""Files copied next to an exported model so that ``from_pretrained`` finds its tokenizer."""

Message = dict[str, Any]


def is_hf_tokenizer_dir(directory: str | Path) -> bool:
    """Whether a checkpoint directory ships a ``tokenizer.json``."""
    return (Path(directory) / "tokenizer.json").is_file()


def checkpoint_tokenizer(directory: str | Path, field: str) -> HFTokenizer:
    """The tokenizer a Hugging Face checkpoint named by ``field`` ships with.

    Without ``tokenizer.json`` the checkpoint's token ids are unknown, and another tokenizer whose
    vocabulary happens to fit would train with the wrong ids.

    Raises:
        FileNotFoundError: naming the field, the missing file and how to write it.
    """
    root = Path(directory)
    if not is_hf_tokenizer_dir(root):
        source = (f"'{root}'" if (root / "tokenizer.model").is_file()
                  else "<the model's hub name or directory>")
        raise FileNotFoundError(
            f"{field}={root} has no tokenizer.json, so its token ids are unknown: write it with "
            f"AutoTokenizer.from_pretrained({source}).save_pretrained('{root}') (transformers) or "
            f"Tokenizer.save('{root / 'tokenizer.json'}') (tokenizers), or name the tokenizer "
            "with tokenizer.hf_dir")
    return HFTokenizer.load(root)


def checked_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """``ids`` as ints, refusing any outside ``[0, vocab_size)`` (the tokenizers' decode check).

    Raises:
        ValueError: naming the first offending ids.
    """
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"ids {bad[:5]} are outside the vocabulary [0, {vocab_size})")
    return ids


def read_json_object(path: Path, missing_ok: bool = False) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object (``{}`` for a missing optional one).

    Raises:
        FileNotFoundError: the file is missing and not optional.
        ValueError: it is not JSON, or not an object.
    """
    if not path.is_file():
        if missing_ok:
            return {}
        raise FileNotFoundError(f"{path} does not exist: pass the directory save_pretrained wrote")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path} holds a JSON {type(value).__name__}, not an object")
    return value


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string or an AddedToken dict."""
    return value.get("content") if isinstance(value, dict) else value


def _ids(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    if (root / "chat_template.jinja").is_file():
        return (root / "chat_template.jinja").read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


def _compile(template: str, source: Path) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals |= {"raise_exception": raise_exception,
                    "strftime_now": lambda fmt: datetime.now().strftime(fmt)}
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"{source}: the chat template does not parse: {exc}") from exc


class HFTokenizer:
    """A Hugging Face checkpoint's tokenizer (see the module docstring).

    Args:
        directory: the checkpoint directory (``tokenizer.json`` and its configs).

    Raises:
        FileNotFoundError: ``tokenizer.json`` is missing (the message says how to write it).
        ValueError: a config is malformed, or a named special token is not in the vocabulary.
    """

    def __init__(self, directory: str | Path) -> None:
        root = Path(directory)
        path = root / "tokenizer.json"
        if not path.is_file():
            hint = (" (only a sentencepiece tokenizer.model: write tokenizer.json with "
                    "AutoTokenizer.from_pretrained(dir).save_pretrained(dir))"
                    if (root / "tokenizer.model").is_file() else "")
            raise FileNotFoundError(f"{path} does not exist{hint}")
        self.source = str(root)
        self._tok = RustTokenizer.from_file(str(path))
        config = read_json_object(root / "tokenizer_config.json", missing_ok=True)
        specials = read_json_object(root / "special_tokens_map.json", missing_ok=True) | {
            k: v for k, v in config.items() if k.endswith("_token") and v is not None}
        self.special_tokens = {k: _token_text(v) for k, v in specials.items()
                               if k in ("bos_token", "eos_token", "pad_token", "unk_token")
                               and _token_text(v) is not None}
        ids = {k: self._id_of(text, k, root) for k, text in self.special_tokens.items()}
        self.bos_id: int | None = ids.get("bos_token")
        """Beginning-of-sequence id, or None (Qwen has none)."""
        eos = ids.get("eos_token")
        extra = [i for name in ("generation_config.json", "config.json")
                 for i in _ids(read_json_object(root / name, missing_ok=True).get("eos_token_id"))]
        self.eos_ids: tuple[int, ...] = tuple(dict.fromkeys(([eos] if eos is not None else [])
                                                           + extra))
        """Every id that ends a reply, the tokenizer's EOS first."""
        if not self.eos_ids:
            raise ValueError(f"{root}: no eos_token in tokenizer_config.json and no eos_token_id "
                             "in generation_config.json or config.json")
        self.pad_id: int = ids.get("pad_token", self.eos_ids[0])
        """Id used to pad batches (the EOS id when the checkpoint names no pad token)."""
        self.unk_id: int | None = ids.get("unk_token")
        template = _chat_template(root, config)
        self._template = _compile(template, root) if template is not None else None
        digest = hashlib.sha256(path.read_bytes())
        digest.update(json.dumps([self.special_tokens, self.eos_ids, template]).encode())
        self._fingerprint = digest.hexdigest()

    @classmethod
    def load(cls, directory: str | Path) -> HFTokenizer:
        """Load the tokenizer of a checkpoint directory (see the class)."""
        return cls(directory)

    def _id_of(self, text: str, name: str, root: Path) -> int:
        token_id = self._tok.token_to_id(text)
        if token_id is None:
            raise ValueError(f"{root}: {name}={text!r} (tokenizer_config.json) is not in "
                             "tokenizer.json's vocabulary")
        return token_id

    @property
    def eos_id(self) -> int:
        """The tokenizer's own end-of-sequence id (see :attr:`eos_ids` for all of them)."""
        return self.eos_ids[0]

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def fingerprint(self) -> str:
        """sha256 of tokenizer.json, the special tokens and the chat template."""
        return self._fingerprint

    @property
    def has_chat_template(self) -> bool:
        """Whether the checkpoint ships a chat template."""
        return self._template is not None

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Encode text without the post-processor's special tokens, optionally framed by BOS
        (when the tokenizer has one) and EOS."""
        ids = self._tok.encode(text, add_special_tokens=False).ids
        bos = [self.bos_id] if add_bos and self.bos_id is not None else []
        return bos + ids + ([self.eos_id] if add_eos else [])

    def encode_continuation(self, text: str) -> list[int]:
        """The ids of ``text`` where it follows other text: :meth:`encode`'s (a byte-level
        tokenizer adds no word-start piece)."""
        return self.encode(text)

    def render_chat(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The chat template applied to ``messages`` (dicts with ``role`` and ``content``).

        Raises:
            ValueError: the checkpoint has no chat template, or the template refuses the messages.
        """
        if self._template is None:
            raise ValueError(f"{self.source} has no chat template (chat_template.jinja or "
                             "tokenizer_config.json's chat_template); use plain-text prompts")
        try:
            return self._template.render(messages=list(messages),
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except jinja2.exceptions.TemplateError as exc:
            raise ValueError(f"{self.source}: the chat template refused the messages: {exc}") \
                from exc

    def encode_chat(self, messages: Sequence[Message],
                    add_generation_prompt: bool = True) -> list[int]:
        """Ids of the rendered conversation (the template places BOS itself)."""
        return self.encode(self.render_chat(messages, add_generation_prompt))

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text, special tokens skipped.

        Raises:
            ValueError: if an id is outside ``[0, vocab_size)``.
        """
        return self._tok.decode(checked_ids(ids, self.vocab_size), skip_special_tokens=True)

    def __repr__(self) -> str:
        return (f"HFTokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
                f"eos_ids={self.eos_ids}, fingerprint={self.fingerprint[:12]})")
