"""A small sentencepiece tokenizer that the actor, critic and reward model share.

Special ids are fixed at training time: ``pad=0, unk=1, bos=2, eos=3``. Training reads the corpus
through an iterator (so the model bytes do not embed the corpus path) with one thread, no sampling
and no shuffling, which makes it deterministic: the same corpus text and options give a
byte-identical ``.model`` file and hence the same :attr:`Tokenizer.fingerprint`. Normalisation is
the identity and extra whitespace is kept, so ``decode(encode(text)) == text`` for any text made of
characters seen in the corpus (the shipped corpus covers printable ASCII).

Typical use, training once into a cache and loading afterwards::

    tokenizer = Tokenizer.from_config(TokenizerConfig(vocab_size=512))
    check_same_tokenizer(actor_tokenizer, reward_tokenizer, ("actor", "reward model"))
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import sentencepiece as spm

from megatron_rlhf.models.hf_tokenizer import HFTokenizer, checked_ids
from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)

SHIPPED_CORPUS = Path(__file__).resolve().parents[1] / "data" / "assets" / "corpus.txt"
"""The English corpus committed with the package (see ``megatron_rlhf/data/corpus.py``)."""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
_MODEL_TYPES = ("bpe", "unigram")
_NUM_SPECIAL = 4
_WORD_START = "\u2581"
"""Sentencepiece's word-start mark ``▁``, a piece of its own before a text that starts with a
user-defined symbol."""


@dataclass
class TokenizerConfig:
    """Where a tokenizer comes from: a ``.model`` file, or a corpus trained into a cache."""

    hf_dir: str | None = None
    """A Hugging Face checkpoint directory whose ``tokenizer.json``, special tokens and chat
    template are used (:class:`~megatron_rlhf.models.hf_tokenizer.HFTokenizer`); when set, the
    other fields are ignored. A run whose actor starts from a Hugging Face directory uses that
    directory's tokenizer when this is unset."""
    model_path: str | None = None
    """A trained sentencepiece ``.model`` file; when set, the training fields are ignored."""
    corpus_path: str | None = None
    """Text corpus, one sentence per line; None means the shipped English corpus."""
    vocab_size: int = 512
    """Number of pieces, the four special tokens included."""
    model_type: str = "bpe"
    """Sentencepiece algorithm: ``bpe`` or ``unigram``."""
    byte_fallback: bool = False
    """Encode characters unseen in the corpus as bytes (uses 256 pieces) instead of ``<unk>``."""
    split_digits: bool = False
    """Every digit is a piece of its own (as in Llama's tokenizer), so numbers are written digit
    by digit whatever their neighbours."""
    user_defined_symbols: list[str] = field(default_factory=list)
    """Texts that are always one piece, never split or merged with their neighbours: tool-call
    tags (``<tool_call>``), or the newline, which a one-sentence-a-line corpus cannot teach."""
    cache_dir: str = "~/.cache/megatron_rlhf/tokenizers"
    """Directory where trained models are cached by a hash of corpus and options."""

    def __post_init__(self) -> None:
        _check_options(self.vocab_size, self.model_type, self.byte_fallback,
                       self.user_defined_symbols)


def _check_options(vocab_size: int, model_type: str, byte_fallback: bool,
                   user_defined_symbols: Sequence[str] = ()) -> None:
    if vocab_size <= _NUM_SPECIAL:
        raise ValueError(
            f"vocab_size({vocab_size}) must exceed the {_NUM_SPECIAL} special tokens; use e.g. 512"
        )
    if model_type not in _MODEL_TYPES:
        raise ValueError(f"model_type({model_type!r}) must be one of {_MODEL_TYPES}")
    if byte_fallback and vocab_size < 256 + 2 * _NUM_SPECIAL:
        raise ValueError(
            f"byte_fallback needs 256 byte pieces; raise vocab_size({vocab_size}) to at least "
            f"{256 + 2 * _NUM_SPECIAL} or set byte_fallback=False"
        )
    symbols = list(user_defined_symbols)
    if any(not isinstance(symbol, str) or not symbol for symbol in symbols) or (
            len(set(symbols)) != len(symbols)):
        raise ValueError(f"user_defined_symbols={symbols!r} must be distinct non-empty strings")
    if len(symbols) + _NUM_SPECIAL >= vocab_size:
        raise ValueError(f"vocab_size({vocab_size}) leaves no room for pieces beside the "
                         f"{len(symbols)} user_defined_symbols; raise it")


def _atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write through a temporary file in the same directory, so readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _train_model_bytes(
    corpus_path: Path, vocab_size: int, model_type: str, byte_fallback: bool,
    split_digits: bool = False, user_defined_symbols: Sequence[str] = (),
) -> bytes:
    lines = [line for line in corpus_path.read_text(encoding="utf-8").splitlines() if line]
    if not lines:
        raise ValueError(
            f"corpus {corpus_path} is empty; give a text file with one sentence a line"
        )
    writer = io.BytesIO()
    try:
        with open(os.devnull, "w") as devnull:
            spm.SentencePieceTrainer.Train(
                logstream=devnull,
                sentence_iterator=iter(lines),
                model_writer=writer,
                vocab_size=vocab_size,
                model_type=model_type,
                byte_fallback=byte_fallback,
                split_digits=split_digits,
                user_defined_symbols=list(user_defined_symbols),
                pad_id=PAD_ID,
                unk_id=UNK_ID,
                bos_id=BOS_ID,
                eos_id=EOS_ID,
                num_threads=1,
                input_sentence_size=0,
                shuffle_input_sentence=False,
                character_coverage=1.0,
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
            )
    except RuntimeError as err:
        raise ValueError(
            f"cannot train a {vocab_size}-piece {model_type} tokenizer on {corpus_path}: {err}. "
            "Lower vocab_size or give a larger corpus."
        ) from err
    return writer.getvalue()


class Tokenizer:
    """A loaded sentencepiece model with explicit BOS/EOS/PAD handling.

    Args:
        model_bytes: the serialized sentencepiece model (the content of a ``.model`` file).
        source: where the model came from, used in messages.

    Raises:
        ValueError: if the bytes are not a sentencepiece model, or it lacks distinct pad, bos and
            eos ids.
    """

    def __init__(self, model_bytes: bytes, source: str = "<bytes>") -> None:
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.LoadFromSerializedProto(model_bytes)
        except RuntimeError as err:
            raise ValueError(f"{source} is not a sentencepiece model: {err}") from err
        specials = {"pad": self._sp.pad_id(), "bos": self._sp.bos_id(), "eos": self._sp.eos_id()}
        if min(specials.values()) < 0 or len(set(specials.values())) != len(specials):
            raise ValueError(
                f"{source} needs distinct pad, bos and eos ids, got {specials}; "
                "retrain it with Tokenizer.train"
            )
        self.source = source
        self._fingerprint = hashlib.sha256(model_bytes).hexdigest()

    @classmethod
    def train(
        cls,
        corpus_path: str | os.PathLike[str],
        vocab_size: int,
        out_path: str | os.PathLike[str],
        *,
        model_type: str = "bpe",
        byte_fallback: bool = False,
        split_digits: bool = False,
        user_defined_symbols: Sequence[str] = (),
    ) -> Tokenizer:
        """Train deterministically on a corpus and write the model atomically to ``out_path``.

        Args:
            corpus_path: UTF-8 text, one sentence per line (empty lines are ignored).
            vocab_size: number of pieces, special tokens included.
            out_path: the ``.model`` file to write.
            model_type: ``bpe`` or ``unigram``.
            byte_fallback: encode unseen characters as bytes instead of ``<unk>``.
            split_digits: every digit a piece of its own.
            user_defined_symbols: texts that are always one piece.

        Returns:
            The trained tokenizer.

        Raises:
            ValueError: for invalid options, an empty corpus, or a corpus too small for the vocab.
        """
        _check_options(vocab_size, model_type, byte_fallback, user_defined_symbols)
        corpus, out = Path(corpus_path), Path(out_path)
        model_bytes = _train_model_bytes(corpus, vocab_size, model_type, byte_fallback,
                                         split_digits, user_defined_symbols)
        _atomic_write_bytes(out, model_bytes)
        logger.info(
            "trained a %d-piece %s tokenizer on %s into %s", vocab_size, model_type, corpus, out
        )
        return cls(model_bytes, source=str(out))

    @classmethod
    def train_cached(
        cls,
        corpus_path: str | os.PathLike[str],
        vocab_size: int,
        cache_dir: str | os.PathLike[str],
        *,
        model_type: str = "bpe",
        byte_fallback: bool = False,
        split_digits: bool = False,
        user_defined_symbols: Sequence[str] = (),
    ) -> Tokenizer:
        """Load the cached model for this corpus and these options, training it on a miss.

        The cache key hashes the corpus bytes, the options and the sentencepiece version, so a
        changed corpus trains a new model; concurrent ranks writing the same key are safe because
        each writes identical bytes atomically.

        Args:
            corpus_path: UTF-8 text, one sentence per line.
            vocab_size: number of pieces, special tokens included.
            cache_dir: directory of cached ``.model`` files (``~`` is expanded).
            model_type: ``bpe`` or ``unigram``.
            byte_fallback: encode unseen characters as bytes instead of ``<unk>``.
            split_digits: every digit a piece of its own.
            user_defined_symbols: texts that are always one piece.

        Returns:
            The cached or freshly trained tokenizer.
        """
        corpus = Path(corpus_path)
        options = {
            "vocab_size": vocab_size,
            "model_type": model_type,
            "byte_fallback": byte_fallback,
            "split_digits": split_digits,
            "user_defined_symbols": list(user_defined_symbols),
            "sentencepiece": spm.__version__,
        }
        digest = hashlib.sha256(corpus.read_bytes())
        digest.update(json.dumps(options, sort_keys=True).encode())
        path = (
            Path(cache_dir).expanduser()
            / f"spm-{model_type}-{vocab_size}-{digest.hexdigest()[:16]}.model"
        )
        if path.is_file():
            logger.info("using cached tokenizer %s", path)
            return cls.load(path)
        return cls.train(
            corpus, vocab_size, path, model_type=model_type, byte_fallback=byte_fallback,
            split_digits=split_digits, user_defined_symbols=user_defined_symbols,
        )

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a sentencepiece ``.model`` file.

        Raises:
            FileNotFoundError: if the file does not exist.
            ValueError: if it is not a usable sentencepiece model.
        """
        model_path = Path(path)
        if not model_path.is_file():
            raise FileNotFoundError(
                f"tokenizer model {model_path} not found; train one with Tokenizer.train"
            )
        return cls(model_path.read_bytes(), source=str(model_path))

    @classmethod
    def from_config(cls, config: TokenizerConfig) -> Tokenizer:
        """Load ``config.model_path``, or train (cached) on the configured or shipped corpus."""
        if config.model_path is not None:
            return cls.load(config.model_path)
        corpus = Path(config.corpus_path) if config.corpus_path is not None else SHIPPED_CORPUS
        return cls.train_cached(
            corpus,
            config.vocab_size,
            config.cache_dir,
            model_type=config.model_type,
            byte_fallback=config.byte_fallback,
            split_digits=config.split_digits,
            user_defined_symbols=config.user_defined_symbols,
        )

    @property
    def fingerprint(self) -> str:
        """sha256 of the model bytes: equal fingerprints mean identical tokenizers."""
        return self._fingerprint

    @property
    def vocab_size(self) -> int:
        """Number of pieces, special tokens included."""
        return self._sp.vocab_size()

    @property
    def pad_id(self) -> int:
        """Id used to pad batches; never produced by :meth:`encode`."""
        return self._sp.pad_id()

    @property
    def unk_id(self) -> int:
        """Id of characters the model has not seen."""
        return self._sp.unk_id()

    @property
    def bos_id(self) -> int:
        """Beginning-of-sequence id."""
        return self._sp.bos_id()

    @property
    def eos_id(self) -> int:
        """End-of-sequence id."""
        return self._sp.eos_id()

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Encode text to ids, optionally framed by BOS and/or EOS."""
        ids = self._sp.encode(text)
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def encode_continuation(self, text: str) -> list[int]:
        """The ids of ``text`` where it follows other text, as a stop sequence is matched against
        sampled tokens: :meth:`encode` without the lone word-start piece sentencepiece puts
        before every encoded text (``"</tool_call>"`` is ``[▁, </tool_call>]`` alone, but only
        ``[</tool_call>]`` after a reply's last token)."""
        ids = self._sp.encode(text)
        return ids[1:] if len(ids) > 1 and self._sp.id_to_piece(ids[0]) == _WORD_START else ids

    def decode(self, ids: Sequence[int]) -> str:
        """Decode ids to text; PAD, BOS and EOS decode to nothing.

        Raises:
            ValueError: if an id is outside ``[0, vocab_size)``.
        """
        return self._sp.decode(checked_ids(ids, self.vocab_size))

    def __repr__(self) -> str:
        return (
            f"Tokenizer(source={self.source!r}, vocab_size={self.vocab_size}, "
            f"fingerprint={self.fingerprint[:12]})"
        )


def load_tokenizer(config: TokenizerConfig) -> Tokenizer | HFTokenizer:
    """The configured tokenizer: a Hugging Face checkpoint's, or a sentencepiece model."""
    if config.hf_dir is not None:
        return HFTokenizer.load(config.hf_dir)
    return Tokenizer.from_config(config)


def check_same_tokenizer(
    a: Tokenizer | HFTokenizer, b: Tokenizer | HFTokenizer,
    names: tuple[str, str] = ("actor", "reward model"),
) -> None:
    """Refuse to pair two models whose tokenizers differ (ids would mean different text).

    Args:
        a: the first model's tokenizer.
        b: the second model's tokenizer.
        names: the two models' names, for the message.

    Raises:
        ValueError: naming both models, their tokenizers and the fix, if fingerprints differ.
    """
    if a.fingerprint == b.fingerprint:
        return
    raise ValueError(
        f"tokenizer mismatch: {names[0]} uses {a.source} (vocab {a.vocab_size}, sha256 "
        f"{a.fingerprint[:12]}) but {names[1]} uses {b.source} (vocab {b.vocab_size}, sha256 "
        f"{b.fingerprint[:12]}). Point both {names[0]} and {names[1]} at the same tokenizer "
        f".model file, or retrain the {names[1]} with the {names[0]}'s tokenizer."
    )

