"""Move a model's state off its device between the stages that use it, and back, bit-exactly.

    offloader = StateOffloader(model, trainer)      # trainer: None for inference-only models
    offloader.offload(WEIGHTS, GRADS, OPTIMIZER)    # device memory of those parts is released
    offloader.onload(WEIGHTS)                       # generation / experience need the weights
    offloader.resident_bytes()                      # what the parts still hold on the device

The unit moved is a tensor *storage*: megatron's DDP keeps every parameter (and every main
gradient) as a view into one contiguous buffer per dtype, and the distributed optimizer's shards
and Adam moments are views or tensors of their own. Copying a storage's bytes to a host buffer
(pinned on CUDA, so the copy can be asynchronous) and resizing the storage to zero frees the device
memory while every view, parameter object and optimizer reference stays valid; resizing it back
and copying the bytes in restores the exact values. This is how verl and NeMo-RL offload Megatron
models, done here on storages so that no module or optimizer field is replaced.

On a machine without CUDA the "device" is host memory already: the round trip runs (and is
tested to be exact) but saves no memory, because the host copy is as large as what it frees.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch.distributed.tensor import DTensor

from megatron_rlhf.models.trainer import ModelTrainer
from megatron_rlhf.runtime.device import model_device

WEIGHTS = "weights"
GRADS = "grads"
OPTIMIZER = "optimizer"
PARTS = (WEIGHTS, GRADS, OPTIMIZER)


def _tensors_of(model: torch.nn.Module, trainer: ModelTrainer | None, part: str
                ) -> Iterator[torch.Tensor]:
    if part == WEIGHTS:
        if trainer is not None:
            yield from trainer.weight_buffers()
            yield from trainer.gathered_weight_buffers()
        # Views of the buffers above when trained. A Megatron-FSDP model's sharded parameters
        # are DTensors over the optimizer's fp32 main-weight shards: the optimizer's.
        yield from (p for p in model.parameters() if not isinstance(p, DTensor))
        yield from model.buffers()
    elif part == GRADS and trainer is not None:
        yield from trainer.gradient_buffers()
    elif part == OPTIMIZER and trainer is not None:
        for inner in getattr(trainer.optimizer, "chained_optimizers", [trainer.optimizer]):
            for group in inner.optimizer.param_groups:
                # fp32 main copies (bf16 models) or the model's own
                yield from (_local(p) for p in group["params"])
            for state in inner.optimizer.state.values():
                yield from (_local(v) for v in state.values() if isinstance(v, torch.Tensor))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (Megatron-FSDP's parameters and Adam moments): a DTensor's
    own storage is an empty wrapper, not the bytes the rank holds."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class StateOffloader:
    """Offloads and onloads parts of one model's state on this rank.

    A storage belongs to the first part that lists it (weights before gradients before the
    optimizer), so an fp32 model whose optimizer updates the model's own parameters moves them
    with the weights. Parts are independent: onloading the weights leaves the optimizer state
    where it is.

    Args:
        model: this rank's part of the model.
        trainer: its trainer (DDP buffers, optimizer), or None for an inference-only model.
    """

    def __init__(self, model: torch.nn.Module, trainer: ModelTrainer | None = None) -> None:
        self.model = model
        self.trainer = trainer
        self.device = model_device(model)
        # Host buffers are kept after onloading and reused: pinned allocations are slow.
        self._host: dict[str, list[tuple[torch.UntypedStorage, torch.Tensor]]] = {}
        self._offloaded: set[str] = set()
        self._resident_cache: dict[tuple, int] = {}

    def _storages(self, part: str) -> list[torch.UntypedStorage]:
        """The storages of ``part`` not claimed by an earlier part, each once."""
        earlier = {_key(s) for p in PARTS[:PARTS.index(part)] for s in self._unique(p)}
        return [s for s in self._unique(part) if _key(s) not in earlier]

    def _unique(self, part: str) -> list[torch.UntypedStorage]:
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in _tensors_of(self.model, self.trainer, part):
            storage = tensor.untyped_storage()
            # What megatron's optimizer CPU offload keeps on the host is no device memory.
            if storage.device == self.device:
                seen.setdefault(_key(storage), storage)
        return list(seen.values())

    def is_offloaded(self, part: str) -> bool:
        """Whether ``part`` is on the host now."""
        return part in self._offloaded

    def offload(self, *parts: str) -> None:
        """Copy each part's storages to host memory and release them on the device."""
        pinned = torch.cuda.is_available()
        for part in _checked(parts):
            if part in self._offloaded:
                continue
            storages = [s for s in self._storages(part) if s.nbytes()]
            saved = self._host.get(part, [])
            if [(_key(s), s.nbytes()) for s in storages] != [(_key(s), h.numel())
                                                              for s, h in saved]:
                # new storages (Adam creates its moments at the first step): new buffers
                saved = [(s, torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pinned))
                         for s in storages]
            self._host[part] = saved
            for storage, host in saved:
                host.copy_(_bytes(storage), non_blocking=pinned)
            if pinned:
                torch.cuda.current_stream().synchronize()  # the copies finish before the frees
            for storage, _ in saved:
                storage.resize_(0)
            self._offloaded.add(part)

    def onload(self, *parts: str) -> None:
        """Give each offloaded part its device memory back, with the values it had."""
        for part in _checked(parts):
            if part not in self._offloaded:
                continue
            for storage, host in self._host[part]:
                storage.resize_(host.numel())
                _bytes(storage).copy_(host, non_blocking=host.is_pinned())
            self._offloaded.discard(part)

    def resident_bytes(self, parts: Iterable[str] = PARTS) -> int:
        """Bytes the given parts hold on the device now (storages counted once).

        The memory meter asks at every stage boundary, and walking the storages costs about a
        millisecond a model on the CPU, so the answer is kept until the offloaded parts or the
        number of optimizer states (Adam creates its moments at the first step) or the bytes of
        the weights Megatron-FSDP holds gathered change: the only ways the storages of a part
        change size."""
        parts = _checked(tuple(parts))
        key = (parts, frozenset(self._offloaded), self._optimizer_state_count(),
               self._gathered_bytes())
        if key not in self._resident_cache:
            self._resident_cache[key] = sum(storage.nbytes() for part in parts
                                            for storage in self._storages(part))
        return self._resident_cache[key]

    def _gathered_bytes(self) -> int:
        return 0 if self.trainer is None else self.trainer.gathered_weight_bytes()

    def _optimizer_state_count(self) -> int:
        if self.trainer is None:
            return 0
        optimizer = self.trainer.optimizer
        return sum(len(inner.optimizer.state)
                   for inner in getattr(optimizer, "chained_optimizers", [optimizer]))


def _key(storage: torch.UntypedStorage) -> int:
    """The identity of a storage: Python wrappers are made anew on every access and the data
    pointer is 0 once offloaded, so the address of torch's StorageImpl is the key (what torch's
    own serialization keys storages by)."""
    return storage._cdata


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


def _checked(parts: tuple[str, ...]) -> tuple[str, ...]:
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown state parts {unknown}; use {PARTS}")
    return parts
