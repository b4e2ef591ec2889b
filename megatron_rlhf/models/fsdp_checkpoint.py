"""Checkpoints of a Megatron-FSDP model: its DTensor shards through torch.distributed.checkpoint.

    write_fsdp_checkpoint(trainer.fsdp_state(), temp / "actor", info)  # every rank; in a save
    trainer.load_fsdp_state(lambda state: load_fsdp_checkpoint(state, path / "actor"))

megatron-core 0.16.1 saves Megatron-FSDP state only in its ``fsdp_dtensor`` format through
Megatron-LM's training loop; here the same DTensors (the weights the optimizer steps, Adam
moments and steps, keyed by parameter name) are written by DCP with
the uneven-shard chunk metadata Megatron-FSDP needs, next to ``megatron_rlhf.json``
(``models.checkpoint``'s info, ``metadata.fsdp`` true). DCP stores each tensor by global shape, so
the state loads at another DP size; the TP layout must be the saved one (a TP shard of SwiGLU's
``linear_fc1`` holds [gate; up] of that shard). Loading reads ``.metadata`` with
``models.checkpoint``'s allow-list unpickler and only tensors, so no pickled code runs.

Collective over the default group (Megatron-FSDP meshes the whole world).
"""

from __future__ import annotations

import pickle
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
    preprocess_state_dict_for_uneven_dtensor,
)
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter

from megatron_rlhf.models.checkpoint import (
    CheckpointInfo,
    SafeMetadataReader,
    read_dcp_metadata,
    write_info,
)
from megatron_rlhf.runtime.checkpoint_store import on_rank0

FSDP_METADATA_KEY = "fsdp"
"""``CheckpointInfo.metadata`` key that marks a Megatron-FSDP checkpoint."""


def write_fsdp_checkpoint(state: dict[str, Any], directory: Path,
                          info: CheckpointInfo) -> CheckpointInfo:
    """Write ``state`` (``ModelTrainer.fsdp_state()``) and ``megatron_rlhf.json`` into
    ``directory``, inside a save the caller publishes; return the info as written.

    Collective over the default group.
    """
    on_rank0(lambda: directory.mkdir(parents=True, exist_ok=True))
    dcp.save(preprocess_state_dict_for_uneven_dtensor(state),
             storage_writer=FileSystemWriter(directory, thread_count=1))
    info = replace(info, metadata={**info.metadata, FSDP_METADATA_KEY: True})
    return replace(info, files=on_rank0(lambda: write_info(directory, info)))


def is_fsdp_checkpoint(info: CheckpointInfo) -> bool:
    """Whether a checkpoint holds a Megatron-FSDP model's DTensor state."""
    return bool(info.metadata.get(FSDP_METADATA_KEY, False))


def load_fsdp_checkpoint(state: dict[str, Any], directory: Path) -> None:
    """Load a checkpoint into ``state`` (``ModelTrainer.fsdp_state(is_loading=True)``) in place;
    ``ModelTrainer.load_fsdp_state`` calls it.

    Collective over the default group.

    Raises:
        ValueError: an entry ``state`` needs is missing, or the files cannot be read.
    """
    flat = _flat_keys(state)
    stored = read_dcp_metadata(directory).state_dict_metadata
    missing = sorted(flat - stored.keys())
    if missing:
        raise ValueError(f"checkpoint {directory} has no entries {missing[:4]} "
                         f"({len(missing)} in all) that the model needs; it holds "
                         f"{len(stored)} entries such as {sorted(stored)[:4]}")
    try:
        dcp.load(preprocess_state_dict_for_uneven_dtensor(state),
                 storage_reader=SafeMetadataReader(directory))
    except (CheckpointException, pickle.UnpicklingError, EOFError) as exc:
        raise ValueError(f"checkpoint {directory} could not be read: {exc}") from exc


def _flat_keys(tree: dict[str, Any], prefix: str = "") -> set[str]:
    """DCP's flattened keys of a nested dict (``a.b.c``)."""
    keys: set[str] = set()
    for key, value in tree.items():
        if isinstance(value, dict):
            keys |= _flat_keys(value, f"{prefix}{key}.")
        else:
            keys.add(f"{prefix}{key}")
    return keys
