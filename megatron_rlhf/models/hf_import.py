"""A Hugging Face directory as a run's starting weights: recognised, fingerprinted, converted once
into a cache, and loaded into a model at any TP/PP.

    if is_hf_dir(path):
        entry = cached_full_state(path, "~/.cache/megatron_rlhf/converted")  # rank 0, barrier
        load_full_state(model, pg_collection, load_file(entry), new_head=...)  # any layout

A run's expert settings come from its Hugging Face source as its dense architecture does:

    moe = checkpoint_moe(config.models.moe, path, "models.actor_checkpoint")  # MoEConfig

The cache holds the *full state* (megatron names, TP=1/PP=1 layout, see ``weights.py``) as one
safetensors file under ``<cache>/<fingerprint>/``; the fingerprint is the sha256 of config.json
and of every weight file's bytes, so a changed checkpoint converts again. Each entry is written to
a temporary file and renamed, so a reader sees a complete file or none; the entry's own sha256,
written next to it first, is checked on every hit, and an entry that differs is converted again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

from safetensors.torch import save_file

from megatron_rlhf.models.description import INFO_FILE
from megatron_rlhf.models.hf_config import CONFIG_FILE, read_hf_config
from megatron_rlhf.models.hf_llama import (
    file_sha256,
    hf_to_full_state,
    load_hf_state,
    weight_files,
)
from megatron_rlhf.models.moe import MoEConfig
from megatron_rlhf.runtime.logging import get_logger

FULL_STATE_FILE = "full_state.safetensors"
MOE_SETTINGS = ("num_experts", "topk", "ffn_hidden_size", "shared_expert_ffn_size",
                "renormalize_topk")
"""The fields of :class:`MoEConfig` a checkpoint's ``config.json`` determines."""
_CHUNK = 1 << 24
logger = get_logger(__name__)


def is_hf_dir(path: str | Path) -> bool:
    """A directory with ``config.json`` and no ``megatron_rlhf.json``: a Hugging Face one."""
    return (Path(path) / CONFIG_FILE).is_file() and not (Path(path) / INFO_FILE).is_file()


def _sha256_file(entry: Path) -> Path:
    return entry.with_name(entry.name + ".sha256")


def _cache_problem(entry: Path) -> str | None:
    """Why a cache entry cannot be used as it is, or None when its bytes are those written."""
    recorded = _sha256_file(entry)
    if not recorded.is_file():
        return "has no recorded sha256 (written by an earlier version)"
    if recorded.read_text().strip() != file_sha256(entry):
        return "is corrupt (its sha256 differs from the one recorded when it was written)"
    return None


def hf_fingerprint(hf_dir: str | Path) -> str:
    """sha256 of ``config.json`` and of every weight file, in name order (reads every byte)."""
    root = Path(hf_dir)
    digest = hashlib.sha256()
    for name in [CONFIG_FILE, *weight_files(root)]:
        digest.update(name.encode())
        with open(root / name, "rb") as stream:
            while chunk := stream.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


def cached_full_state(hf_dir: str | Path, cache_dir: str | Path) -> Path:
    """The converted full state of ``hf_dir`` in the cache, converting it on a miss.

    Returns:
        The path of the cached safetensors file.

    Raises:
        FileNotFoundError, ValueError: from reading and converting the checkpoint (named).
    """
    description, _ = read_hf_config(hf_dir)
    entry = Path(cache_dir).expanduser() / hf_fingerprint(hf_dir)[:32] / FULL_STATE_FILE
    if entry.is_file():
        problem = _cache_problem(entry)
        if problem is None:
            return entry
        logger.warning("%s %s; converting again", entry, problem)
    full_state = hf_to_full_state(load_hf_state(hf_dir), description, str(hf_dir))
    entry.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"source": str(Path(hf_dir).resolve()),
                "description": json.dumps(asdict(description))}
    fd, temp = tempfile.mkstemp(dir=entry.parent, prefix=".full_state.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({name: t.contiguous() for name, t in full_state.items()}, temp,
                  metadata=metadata)
        # The checksum lands first: a crash before the rename leaves a mismatch, not a gap.
        Path(temp + ".sha256").write_text(file_sha256(Path(temp)))
        os.replace(temp + ".sha256", _sha256_file(entry))
        os.replace(temp, entry)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        Path(temp + ".sha256").unlink(missing_ok=True)
        raise
    return entry


def _setting(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def checkpoint_moe(moe: MoEConfig, hf_dir: str | Path, field: str,
                   moe_field: str = "models.moe") -> MoEConfig:
    """``moe`` with the experts of the Hugging Face checkpoint ``hf_dir``, as its dense
    architecture is read from it.

    Each of :data:`MOE_SETTINGS` left at its default takes the checkpoint's value; one set to
    another value must equal it (a dense checkpoint: only ``num_experts``, which is 0). The
    other settings (load balancing, dispatcher, routing replay) stay ``moe``'s.

    Args:
        moe: the configured settings.
        hf_dir: a Hugging Face directory (:func:`is_hf_dir`).
        field, moe_field: the config fields of the directory and of ``moe``, for messages.

    Raises:
        ValueError: a setting conflicts with the checkpoint, naming the field and both values;
            from :func:`read_hf_config`, a ``config.json`` that does not convert.
    """
    description, config = read_hf_config(hf_dir)
    theirs, default = description.moe or MoEConfig(), MoEConfig()
    names = MOE_SETTINGS if description.arch.experts else ("num_experts",)
    kind = (config.get("architectures") or [config["model_type"]])[0]
    for name in names:
        ours, value = getattr(moe, name), getattr(theirs, name)
        if ours not in (value, getattr(default, name)):
            raise ValueError(
                f"{moe_field}.{name}={_setting(ours)} conflicts with {field}={hf_dir}: its "
                f"{kind} config.json gives {name}={_setting(value)}; drop {moe_field}.{name} "
                f"(it is read from the checkpoint) or set it to {_setting(value)}")
    return replace(moe, **{name: getattr(theirs, name) for name in names})
