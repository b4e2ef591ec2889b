"""A megatron dist checkpoint whose shards stay in the saving processes' memory, resharded to
the loading layout through the collectives: an in-job move's hand-over of trained state.

    write_sharded_checkpoint(state, temp, info, kept_as=directory)  # every rank: keeps shards
    ...                                                             # old models dropped
    load_sharded_checkpoint(state, directory)                       # every rank: exchanges

The directory holds what megatron writes beside the shards (``common.pt``, ``metadata.json``
naming the ``in_memory`` backend, so a load picks :class:`MemoryLoadStrategy` from it) and
``megatron_rlhf.json``; each rank keeps the main replicas of its ShardedTensors (a host copy)
and ShardedObjects, under the directory's name, until a load of that directory in the same
processes takes them. The load gathers every rank's kept and wanted pieces (keys, offsets,
shapes), intersects them per key as boxes of the global tensor, and moves every intersection
in ``all_to_all_single`` rounds of bytes over the default group, so each wanted piece holds
exactly the saved values (cast to its dtype where they differ, as megatron's loader does); a
piece marked ``allow_shape_mismatch`` keeps zeros where nothing was saved, as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.base import (
    LoadShardedStrategy,
    SaveShardedStrategy,
)

from megatron_rlhf.runtime.device import comm_device

MEMORY_BACKEND = "in_memory"


@dataclass(frozen=True)
class Piece:
    """Where a local tensor lies in its global tensor (megatron's prepended axes as size 1)."""

    key: str
    offset: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    partial: bool
    """A wanted piece that may be covered in part (``allow_shape_mismatch``)."""

    @classmethod
    def of(cls, tensor: ShardedTensor) -> Piece:
        """Where ``tensor``'s local data lies.

        Raises:
            NotImplementedError: a flattened range (megatron's older optimizer formats; the
                trainer saves ``fully_reshardable``, which has none).
        """
        if tensor.flattened_range is not None:
            raise NotImplementedError(f"{tensor.key}: flattened ShardedTensors are not kept in "
                                      "memory; save the state to files")
        return cls(tensor.key, tuple(tensor.global_offset),
                   (1,) * tensor.prepend_axis_num + tuple(tensor.local_shape), tensor.dtype,
                   tensor.allow_shape_mismatch)

    def overlap(self, other: Piece) -> tuple[slice, ...] | None:
        """The global box both pieces cover, as slices of the global tensor; None if empty."""
        box = []
        for mine, size, theirs, their_size in zip(self.offset, self.shape, other.offset,
                                                  other.shape, strict=True):
            start, stop = max(mine, theirs), min(mine + size, theirs + their_size)
            if start >= stop:
                return None
            box.append(slice(start, stop))
        return tuple(box)

    def local(self, box: tuple[slice, ...]) -> tuple[slice, ...]:
        """``box`` as slices of this piece's tensor."""
        return tuple(slice(s.start - o, s.stop - o) for s, o in zip(box, self.offset, strict=True))


@dataclass
class Kept:
    """One rank's part of a checkpoint kept in memory."""

    pieces: list[Piece] = field(default_factory=list)
    tensors: list[torch.Tensor] = field(default_factory=list)
    objects: dict[str, Any] = field(default_factory=dict)


_KEPT: dict[str, Kept] = {}
"""This process's kept parts, by checkpoint directory."""


class MemorySaveStrategy(SaveShardedStrategy):
    """Keeps this rank's main replicas in this process (no collective, no shard files) under
    ``kept_as``: the directory a load will name, once the save is published under its final
    name."""

    def __init__(self, kept_as: Path) -> None:
        super().__init__(MEMORY_BACKEND, 1)
        self.kept_as = kept_as

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        kept = Kept()
        for value in nested_values(sharded_state_dict):
            if not is_main_replica(value.replica_id):
                continue
            if isinstance(value, ShardedObject):
                kept.objects[value.unique_key] = value.data
                continue
            piece = Piece.of(value)
            kept.pieces.append(piece)
            # a host copy: the old models' device memory is freed before the new ones build
            kept.tensors.append(value.data.detach().to("cpu", copy=True).reshape(piece.shape))
        _KEPT[str(Path(self.kept_as).absolute())] = kept


class MemoryLoadStrategy(LoadShardedStrategy):
    """Fills a sharded state dict from the parts every rank kept; collective over the default
    group, once per checkpoint (the parts are released)."""

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != MEMORY_BACKEND:
            raise ValueError(f"backend {loaded_backend!r} is not {MEMORY_BACKEND!r}")

    def check_version_compatibility(self, loaded_version: int) -> None:
        pass

    def load_tensors_metadata(self, checkpoint_dir: str | Path) -> dict:
        raise NotImplementedError("a checkpoint kept in memory has no metadata to read alone")

    def load(self, sharded_state_dict: ShardedStateDict,
             checkpoint_dir: str | Path) -> ShardedStateDict:
        kept = _KEPT.pop(str(Path(checkpoint_dir).absolute()), Kept())
        wanted = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor)]
        targets = [_target(tensor) for tensor in wanted]
        world = [None] * dist.get_world_size()
        # World: every rank may hold a piece that any other rank needs.
        dist.all_gather_object(world, (kept.pieces, [Piece.of(t) for t in wanted], kept.objects),
                               group=dist.group.WORLD)
        _exchange(kept, world, targets)
        objects = {key: data for _, _, held in world for key, data in held.items()}
        filled = {id(tensor): target for tensor, target in zip(wanted, targets, strict=True)}

        def fill(value: Any) -> Any:
            if isinstance(value, ShardedTensor):
                return filled[id(value)]
            if isinstance(value, ShardedObject):
                if value.unique_key not in objects:
                    raise ValueError(f"checkpoint {checkpoint_dir} kept no {value.unique_key}")
                return objects[value.unique_key]
            return value

        return dict_list_map_inplace(fill, sharded_state_dict)


def _target(tensor: ShardedTensor) -> torch.Tensor:
    """The tensor a wanted piece is loaded into: its own data where it has some (as megatron's
    loader does), zeroed where parts may be absent."""
    if tensor.data is None:
        tensor.init_data("cpu", torch.zeros if tensor.allow_shape_mismatch else torch.empty)
    target = tensor.data.detach()
    if tensor.allow_shape_mismatch:
        target.zero_()
    return target


@dataclass(frozen=True)
class Transfer:
    """One intersection of a kept and a wanted piece: from rank ``source``'s kept piece
    ``index`` to rank ``destination``'s wanted piece ``want_index``."""

    source: int
    index: int
    destination: int
    want_index: int
    box: tuple[slice, ...]
    nbytes: int


def _exchange(kept: Kept, world: list, targets: list[torch.Tensor]) -> None:
    """Copy every intersection of a kept and a wanted piece from its keeper into ``targets``
    (this rank's wanted pieces), in rounds of one ``all_to_all_single`` each
    (:func:`_rounds`).

    Raises:
        ValueError: a wanted piece (not marked ``allow_shape_mismatch``) of any rank is not
            covered whole (on every rank alike, before the exchange).
    """
    by_key: dict[str, list[tuple[int, int, Piece]]] = {}
    for source, (pieces, _, _) in enumerate(world):
        for index, piece in enumerate(pieces):
            by_key.setdefault(piece.key, []).append((source, index, piece))
    transfers = []
    for destination, (_, wants, _) in enumerate(world):
        for want_index, want in enumerate(wants):
            covered = 0
            for source, index, piece in by_key.get(want.key, []):
                box = piece.overlap(want)
                if box is None:
                    continue
                covered += _numel(box)
                transfers.append(Transfer(source, index, destination, want_index, box,
                                          _numel(box) * piece.dtype.itemsize))
            if covered != math.prod(want.shape) and not want.partial:
                raise ValueError(f"the kept state covers {covered} of {math.prod(want.shape)} "
                                 f"elements of {want.key} at offset {want.offset} (rank "
                                 f"{destination})")
    for batch in _rounds(transfers, len(world), EXCHANGE_ROUND_BYTES):
        _exchange_round(batch, kept, world, targets)


EXCHANGE_ROUND_BYTES = 256 * 2**20
"""Bytes any rank sends, or receives, in one round of the exchange at most (a larger
intersection goes alone): the exchange's buffers sit on the communication device beside the new
placement's models, so they are bounded, not the whole state."""


def _rounds(transfers: list[Transfer], ranks: int, round_bytes: int) -> list[list[Transfer]]:
    """``transfers`` in order, cut into rounds in which no rank sends or receives more than
    ``round_bytes``; the same on every rank (every rank holds the same transfers)."""
    rounds: list[list[Transfer]] = [[]]
    sent, received = [0] * ranks, [0] * ranks
    for transfer in transfers:
        if rounds[-1] and max(sent[transfer.source],
                              received[transfer.destination]) + transfer.nbytes > round_bytes:
            rounds.append([])
            sent, received = [0] * ranks, [0] * ranks
        rounds[-1].append(transfer)
        sent[transfer.source] += transfer.nbytes
        received[transfer.destination] += transfer.nbytes
    return [batch for batch in rounds if batch]


def _exchange_round(transfers: list[Transfer], kept: Kept, world: list,
                    targets: list[torch.Tensor]) -> None:
    """One ``all_to_all_single`` of ``transfers``' bytes over the default group, copied into
    this rank's ``targets``."""
    rank, size = dist.get_rank(), len(world)
    sends: list[list[torch.Tensor]] = [[] for _ in range(size)]
    receives: list[list[Transfer]] = [[] for _ in range(size)]
    for transfer in transfers:
        if transfer.source == rank:
            piece = world[rank][0][transfer.index]
            part = kept.tensors[transfer.index][piece.local(transfer.box)]
            sends[transfer.destination].append(part.contiguous().reshape(-1).view(torch.uint8))
        if transfer.destination == rank:
            receives[transfer.source].append(transfer)
    device = comm_device(dist.group.WORLD)
    send_sizes = [sum(part.numel() for part in parts) for parts in sends]
    receive_sizes = [sum(transfer.nbytes for transfer in parts) for parts in receives]
    outgoing = torch.cat([part for parts in sends for part in parts]
                         or [torch.empty(0, dtype=torch.uint8)]).to(device)
    incoming = torch.empty(sum(receive_sizes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(incoming, outgoing, receive_sizes, send_sizes, group=dist.group.WORLD)
    start = 0
    for parts in receives:
        for transfer in parts:
            piece = world[transfer.source][0][transfer.index]
            values = incoming[start:start + transfer.nbytes].view(piece.dtype)
            want = world[rank][1][transfer.want_index]
            region = targets[transfer.want_index].view(want.shape)[want.local(transfer.box)]
            region.copy_(values.reshape(region.shape))
            start += transfer.nbytes


def _numel(box: tuple[slice, ...]) -> int:
    return math.prod(s.stop - s.start for s in box)
