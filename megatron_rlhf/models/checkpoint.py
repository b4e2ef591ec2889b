"""Model checkpoints in megatron-core's distributed format, written atomically, read safely.

    save_model_checkpoint(model, pg_collection, "ckpt/actor", {"role": "actor", "step": 100})
    info = read_checkpoint_info("ckpt/actor")                  # no process group needed
    load_model_checkpoint(model, pg_collection, "ckpt/actor")  # at any TP/PP

A checkpoint is megatron's ``torch_dist`` format (tensors by global shape, so it loads at any
TP/PP) plus ``megatron_rlhf.json`` (format and megatron-core versions, :class:`ModelDescription`,
saved TP/PP, the caller's metadata, every file's size). Every rank writes into
``<dir>.tmp-<random>``; rank 0 writes the JSON last and renames the directory, so ``<dir>`` is
complete or absent. docs/models.md describes the layout.

Two megatron paths are replaced (see each class): its save strategy forks writer processes,
which hangs on CPU (:class:`InProcessSaveStrategy`); its loader unpickles ``.metadata`` and
ShardedObjects without restriction (allow-list unpickler, ``weights_only=True``).

Collectives: megatron's ``dist_checkpointing.save``/``load`` work on the default (world) group, so
every rank of the job calls these functions. Replica ids come from the model's own ``dp_cp`` group;
nothing reads megatron's global parallel state. Optimizer or RNG state joins the model under its
own top-level key through :func:`save_sharded_checkpoint` / :func:`load_sharded_checkpoint`.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed.checkpoint as dcp
from megatron.core import dist_checkpointing, package_info
from megatron.core.dist_checkpointing.core import CheckpointingException, maybe_load_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedStateDict, ShardedTensor
from megatron.core.dist_checkpointing.strategies import torch as mcore_torch
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import SaveShardedStrategy
from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint
from torch.distributed.checkpoint import CheckpointException, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from megatron_rlhf.models.background_save import ThreadedSaveStrategy
from megatron_rlhf.models.description import (  # noqa: F401  (re-exported)
    INFO_FILE,
    ModelDescription,
)
from megatron_rlhf.models.gpt import PolicyValueHead
from megatron_rlhf.models.memory_checkpoint import (
    MEMORY_BACKEND,
    MemoryLoadStrategy,
    MemorySaveStrategy,
)
from megatron_rlhf.runtime.checkpoint_store import on_rank0, publish, shared_temp_dir

FORMAT_VERSION = 2
"""2: the model's ``arch`` as ``topology.models.ArchSpec`` records it; 1 (still read): flat."""
_MODEL_KEY = "model"
_EXTRA_STATE = "._extra_state"
_T = TypeVar("_T")


@dataclass(frozen=True)
class CheckpointInfo:
    """The contents of a checkpoint's ``megatron_rlhf.json``.

    Attributes:
        model: what the weights are.
        tp_size, pp_size: the layout the checkpoint was saved with (it loads at any layout).
        metadata: the caller's metadata, stored verbatim (``role`` and anything else).
        files: size in bytes of every other file, checked before loading.
        megatron_core_version: megatron-core that wrote the shards.
        format_version: version of this layout.
    """

    model: ModelDescription
    tp_size: int
    pp_size: int
    metadata: dict[str, Any]
    files: dict[str, int] = field(default_factory=dict)
    megatron_core_version: str = package_info.__version__
    format_version: int = FORMAT_VERSION

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str) -> CheckpointInfo:
        """Parse and type-check ``megatron_rlhf.json`` read from ``source`` (named in errors)."""
        version = _field(data, "format_version", int, source)
        if version not in (1, FORMAT_VERSION):
            raise ValueError(f"{source}: format_version={version}, but this code reads versions "
                             f"1 and {FORMAT_VERSION}; use a matching release")
        values = _typed_fields(cls, data, source)
        if not isinstance(values["metadata"].get("role"), str):
            raise ValueError(f"{source}: metadata.role is missing or not a string")
        return cls(**values | {"model": ModelDescription.from_dict(
            values["model"], f"{source} (model)", version), "format_version": FORMAT_VERSION})


_KINDS = {"int": int, "str": str, "bool": bool, "float": float, "ModelDescription": dict,
          "dict[str, Any]": dict, "dict[str, int]": dict}


def _typed_fields(cls: type, data: Mapping[str, Any], source: str) -> dict[str, Any]:
    return {spec.name: _field(data, spec.name, _KINDS[str(spec.type)], source)
            for spec in fields(cls)}


def _field(data: Mapping[str, Any], name: str, kind: type[_T], source: str) -> _T:
    if not isinstance(data, Mapping) or name not in data:
        raise ValueError(f"{source}: field {name!r} is missing")
    value = data[name]
    if kind is float and type(value) is int:
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{source}: field {name!r}={value!r} is not of type {kind.__name__}")
    return value


class InProcessSaveStrategy(SaveShardedStrategy):
    """megatron's ``torch_dist`` format, written synchronously by the calling process.

    megatron's ``TorchDistSaveShardedStrategy`` writes through ``FileSystemWriterAsync.
    write_preloaded_data_multiproc`` even for a synchronous save with ``thread_count=1``: a
    spawn-context ``multiprocessing.Manager`` (refused in daemonic test ranks; re-runs a launcher
    without a ``__main__`` guard), then writers forked after gloo and OpenMP threads exist, which
    hang on CPU. Same key mapping (main replicas only) and planner here, so the same files, written
    by torch's ``FileSystemWriter`` in this process; ``thread_count > 1`` adds threads only.
    """

    def __init__(self, thread_count: int = 1) -> None:
        super().__init__("torch_dist", 1)
        self.thread_count = thread_count

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> None:
        """Write this rank's main-replica shards; collective over the default group."""
        flat, _, _ = mcore_torch._replace_state_dict_keys_with_sharded_keys(
            sharded_state_dict, keep_only_main_replica=True)
        dcp.save(mcore_torch.mcore_to_pyt_state_dict(flat, is_loading=False),
                 storage_writer=FileSystemWriter(checkpoint_dir, thread_count=self.thread_count),
                 planner=mcore_torch.MCoreSavePlanner(flatten_state_dict=False,
                                                      can_run_decentralized_global_plan=False))


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata``, which torch's ``FileSystemReader`` reads with ``pickle.load``:
    only torch.distributed.checkpoint dataclasses and enums, ``torch.Size``, dtypes, layouts and
    paths may be named, so a crafted file cannot run code."""

    _DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner",
                    "torch.distributed.checkpoint.filesystem")
    _GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"),
                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in self._DCP_MODULES:
            obj = super().find_class(module, name)
            if hasattr(obj, "__dataclass_fields__") or (isinstance(obj, type)
                                                         and issubclass(obj, Enum)):
                return obj
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def read_dcp_metadata(directory: str | Path) -> Metadata:
    """Read a checkpoint's torch.distributed.checkpoint ``.metadata`` without running code.

    Raises:
        ValueError: the file is missing, truncated, or names a global outside the allow-list.
    """
    path = Path(directory) / ".metadata"
    try:
        with open(path, "rb") as stream:
            metadata = _MetadataUnpickler(stream).load()
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
        raise ValueError(f"checkpoint metadata {path} cannot be read safely: {exc}") from exc
    if not isinstance(metadata, Metadata):
        raise ValueError(f"{path} holds a {type(metadata).__name__}, not checkpoint Metadata")
    return metadata


class SafeMetadataReader(FileSystemReader):
    """torch's ``FileSystemReader`` reading ``.metadata`` through :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class _WeightsOnlyLoadPlanner(mcore_torch.MCoreLoadPlanner):
    """megatron's load planner on a flat state dict, unpickling ShardedObjects (``_extra_state``)
    with ``weights_only=True`` where torch's default planner passes ``weights_only=False``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(flatten_state_dict=False, **kwargs)

    def load_bytes(self, read_item: Any, value: Any) -> None:
        # set_up_planner may copy state_dict; the caller reads original_state_dict.
        self.original_state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


class _SafeLoadStrategy(mcore_torch.TorchDistLoadShardedStrategy):
    """megatron's ``TorchDistLoadShardedStrategy.load`` with the safe reader and planner
    (tensors themselves are read by torch with ``weights_only=True``)."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str | Path) -> dict:
        tensors = [t for t in nested_values(sharded_state_dict) if isinstance(t, ShardedTensor)]
        flat, flat_mapping, rename_mapping = (
            mcore_torch._replace_state_dict_keys_with_sharded_keys(sharded_state_dict))
        pyt_state_dict = mcore_torch.mcore_to_pyt_state_dict(flat, is_loading=True)
        planner = _WeightsOnlyLoadPlanner(
            shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
            allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors
                                                  if t.allow_shape_mismatch})
        dcp.load(pyt_state_dict, storage_reader=SafeMetadataReader(checkpoint_dir),
                 planner=planner)
        state = {k: mcore_torch._unwrap_pyt_sharded_tensor(v) for k, v in pyt_state_dict.items()}
        state = mcore_torch._replace_sharded_keys_with_state_dict_keys(state, flat_mapping,
                                                                       rename_mapping)
        mcore_torch._restore_dict_types(state, sharded_state_dict)
        return state


class _WeightsOnlyCommonLoadStrategy(TorchCommonLoadStrategy):
    """``common.pt`` with ``weights_only=True`` said explicitly (megatron relies on the default)."""

    def load_common(self, checkpoint_dir: str | Path) -> dict:
        return torch.load(Path(checkpoint_dir) / "common.pt", map_location="cpu",
                          weights_only=True)


def model_sharded_state_dict(model: GPTModel,
                             pg_collection: ProcessGroupCollection) -> ShardedStateDict:
    """megatron's sharded state dict of this rank's model part, with groups passed explicitly.

    Two paths of megatron-core 0.16.1's ``LanguageModule.sharded_state_dict`` are taken over:
    the AC-Share head (``lm+scalar``) wraps the LM head where megatron expects ``output_layer``
    itself, so the LM head is saved under megatron's usual key ``output_layer.weight`` and the
    value head, replicated, under ``output_layer.value_head.weight``; and the last pipeline
    stage's copy of a tied embedding reads its DP rank from megatron's global parallel state, so
    that replica is built here from the model's ``dp_cp`` group.
    """
    metadata = {"dp_cp_group": pg_collection.dp_cp}
    head = model.output_layer if model.post_process else None
    policy_value = head if isinstance(head, PolicyValueHead) else None
    tied = model.share_embeddings_and_output_weights
    tied_copy = tied and model.post_process and not model.pre_process
    if policy_value is not None:
        model.output_layer = policy_value.lm_head
    model.share_embeddings_and_output_weights = tied and not tied_copy
    try:
        sharded = model.sharded_state_dict(metadata=metadata)
    finally:
        model.share_embeddings_and_output_weights = tied
        if policy_value is not None:
            model.output_layer = policy_value
    if tied_copy:
        sharded["output_layer.weight"] = make_tp_sharded_tensor_for_checkpoint(
            tensor=model.output_layer.weight, key="embedding.word_embeddings.weight",
            replica_id=(1, 0, pg_collection.dp_cp.rank()), allow_shape_mismatch=True,
            tp_group=pg_collection.tp, dp_cp_group=pg_collection.dp_cp)
    if policy_value is not None:
        sharded["output_layer.lm_head.weight"] = sharded.pop("output_layer.weight")
        sharded.update(make_sharded_tensors_for_checkpoint(
            policy_value.value_head.state_dict(keep_vars=True), "output_layer.value_head.",
            tp_group=pg_collection.tp, dp_cp_group=pg_collection.dp_cp))
    return sharded


def save_sharded_checkpoint(sharded_state_dict: ShardedStateDict, directory: str | Path,
                            info: CheckpointInfo) -> CheckpointInfo:
    """Write a sharded state dict as a new checkpoint directory, atomically (through
    ``runtime.checkpoint_store``: a temporary directory, a manifest of checksums, a rename); return
    ``info`` with the written files' sizes. Collective over every rank of the job.

    Raises:
        OSError: ``directory`` already exists (FileExistsError) or cannot be written.
    """
    final = Path(directory).absolute()
    temp = shared_temp_dir(final, exist_ok=False)
    written = write_sharded_checkpoint(sharded_state_dict, temp, info)
    publish(temp, final)
    return written


def write_sharded_checkpoint(sharded_state_dict: ShardedStateDict, directory: Path,
                             info: CheckpointInfo, kept_as: Path | None = None
                             ) -> CheckpointInfo:
    """Write a sharded state dict and ``megatron_rlhf.json`` (rank 0's ``info`` with the files'
    sizes) into ``directory``, inside a save that the caller publishes. Collective over every
    rank of the job.

    Args:
        kept_as: keep the shards in these processes for one load by them of ``kept_as``, the
            directory once published (``models.memory_checkpoint``), without megatron's check
            that every shard has one main replica: the state dicts are those a save to files
            checks.
    """
    on_rank0(lambda: directory.mkdir(parents=True, exist_ok=True))
    dist_checkpointing.save(sharded_state_dict, str(directory),
                            sharded_strategy=(InProcessSaveStrategy() if kept_as is None
                                              else MemorySaveStrategy(kept_as)),
                            validate_access_integrity=kept_as is None)
    return replace(info, files=on_rank0(lambda: write_info(directory, info)))


def start_sharded_checkpoint(sharded_state_dict: ShardedStateDict, directory: Path,
                             info: CheckpointInfo) -> tuple[AsyncRequest, ThreadedSaveStrategy]:
    """:func:`write_sharded_checkpoint` whose shard files are written in the background: plans
    and stages this rank's shards now (collective over every rank of the job) and returns
    megatron's request, to schedule on a ``models.background_save.BackgroundSaveQueue``; its
    finalisation (collective) writes the metadata and ``megatron_rlhf.json``. The strategy
    reports the write's seconds."""
    on_rank0(lambda: directory.mkdir(parents=True, exist_ok=True))
    strategy = ThreadedSaveStrategy()
    request = dist_checkpointing.save(sharded_state_dict, str(directory),
                                      sharded_strategy=strategy, async_sharded_save=True)
    request.add_finalize_fn(lambda: on_rank0(lambda: write_info(directory, info)))
    return request, strategy


def write_info(directory: Path, info: CheckpointInfo) -> dict[str, int]:
    """Write ``megatron_rlhf.json``, ``info`` with the size of every file already in
    ``directory``, last; return those sizes. One rank calls it."""
    files = {str(p.relative_to(directory)): p.stat().st_size
             for p in sorted(directory.rglob("*")) if p.is_file()}
    (directory / INFO_FILE).write_text(
        json.dumps(asdict(replace(info, files=files)), indent=2, sort_keys=True))
    return files


def save_model_checkpoint(model: GPTModel, pg_collection: ProcessGroupCollection,
                          directory: str | Path, metadata: Mapping[str, Any]) -> CheckpointInfo:
    """Save this model (every rank its part) as a checkpoint loadable at any TP/PP.

    Collective over the default group: every rank of the job calls it with the same arguments.

    Args:
        model: this rank's part of the model.
        pg_collection: the model's process groups.
        directory: the checkpoint directory to create; it must not exist.
        metadata: JSON-serialisable facts stored verbatim; must hold ``role`` (a string).

    Returns:
        The checkpoint's info, as written to ``megatron_rlhf.json``.

    Raises:
        ValueError: ``metadata`` has no string ``role`` or is not JSON-serialisable.
        OSError: the directory exists or cannot be written.
    """
    try:
        json.dumps(dict(metadata))
    except TypeError as exc:
        raise ValueError(f"checkpoint metadata must be JSON-serialisable: {exc}") from exc
    if not isinstance(metadata.get("role"), str):
        raise ValueError(f"checkpoint metadata needs a string 'role', got {dict(metadata)!r}")
    info = CheckpointInfo(model=ModelDescription.from_model(model), tp_size=pg_collection.tp.size(),
                          pp_size=pg_collection.pp.size(), metadata=dict(metadata))
    return save_sharded_checkpoint(
        {_MODEL_KEY: model_sharded_state_dict(model, pg_collection)}, directory, info)


def read_checkpoint_info(directory: str | Path) -> CheckpointInfo:
    """Read and check a checkpoint's ``megatron_rlhf.json`` and file sizes; no process group.

    Raises:
        FileNotFoundError: the directory does not exist (an unfinished save is mentioned).
        ValueError: the info file is missing or malformed, or a file is missing or truncated.
    """
    path = Path(directory)
    if not path.is_dir():
        unfinished = sorted(path.parent.glob(f"{path.name}.tmp-*")) if path.parent.is_dir() else []
        hint = f"; {unfinished[0]} is an unfinished save" if unfinished else ""
        raise FileNotFoundError(f"checkpoint directory {path} does not exist{hint}")
    info_path = path / INFO_FILE
    if not info_path.is_file():
        models = sorted(sub.name for sub in path.iterdir() if (sub / INFO_FILE).is_file())
        if models:
            raise ValueError(
                f"{path} is a checkpoint of a whole PPO run, not of one model: its models are "
                f"in {models}; name one of them (e.g. models.actor_checkpoint={path / models[0]})"
                f" to start a new run from it, or continue that run with "
                f"checkpoint.resume_from={path}")
        raise ValueError(f"{path} is not a complete megatron_rlhf checkpoint: {INFO_FILE} is "
                         "missing (it is written last; the save did not finish)")
    try:
        info = CheckpointInfo.from_dict(json.loads(info_path.read_text()), str(info_path))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{info_path} is not JSON ({exc}); the checkpoint is corrupted") from exc
    for name, size in info.files.items():
        found = (path / name).stat().st_size if (path / name).is_file() else None
        if found != size:
            raise ValueError(f"checkpoint {path} is corrupted: {name} has "
                             f"{'no file' if found is None else f'{found} bytes'}, "
                             f"the save wrote {size} bytes")
    return info


def _check_keys(sharded_state_dict: ShardedStateDict, path: Path) -> None:
    stored = read_dcp_metadata(path).state_dict_metadata
    for item in nested_values(sharded_state_dict):
        key = _stored_key(item)
        if key is not None and key not in stored:
            raise ValueError(f"checkpoint {path} has no entry {key!r} that the model needs; it "
                             f"holds {len(stored)} entries such as {sorted(stored)[:4]}")


def load_sharded_checkpoint(sharded_state_dict: ShardedStateDict,
                            directory: str | Path) -> dict[str, Any]:
    """Load the parts of a checkpoint that ``sharded_state_dict`` asks for, at its layout.

    Collective over the default group. Entries not asked for are ignored (a model can be read
    out of a checkpoint that also holds optimizer state).

    Raises:
        ValueError: an entry is missing, or the files cannot be read (corruption).
    """
    path = Path(directory)
    if kept_in_memory(path):
        return dist_checkpointing.load(sharded_state_dict, str(path),
                                       sharded_strategy=MemoryLoadStrategy(),
                                       common_strategy=_WeightsOnlyCommonLoadStrategy(),
                                       validate_access_integrity=False)
    _check_keys(sharded_state_dict, path)
    try:
        return dist_checkpointing.load(sharded_state_dict, str(path),
                                       sharded_strategy=_SafeLoadStrategy(),
                                       common_strategy=_WeightsOnlyCommonLoadStrategy())
    except (CheckpointingException, CheckpointException, pickle.UnpicklingError,
            EOFError) as exc:
        raise ValueError(f"checkpoint {path} could not be read: {exc}") from exc


def kept_in_memory(directory: Path) -> bool:
    """Whether the shards of the checkpoint in ``directory`` were kept in memory."""
    config = maybe_load_config(str(directory))
    return config is not None and config.sharded_backend == MEMORY_BACKEND


def _check_same_model(saved: ModelDescription, model: ModelDescription, directory: str,
                      new_head: bool = False) -> None:
    # seq_length only bounds the positions used; the dtype is converted on load
    differ = model.mismatches(saved, ("seq_length", "params_dtype", *(("head",) if new_head
                                                                       else ())))
    if differ:
        theirs = ", ".join(f"{name}={value!r}" for name, value, _ in differ)
        ours = ", ".join(f"{name}={value!r}" for name, _, value in differ)
        raise ValueError(f"checkpoint {directory} holds a model with {theirs} but the model to "
                         f"load into has {ours}; build it from read_checkpoint_info(...).model")


def without_absent_extra_state(model_state: ShardedStateDict,
                               directory: str | Path) -> ShardedStateDict:
    """A model's sharded state without the modules' extra state that the checkpoint lacks.

    Transformer Engine modules carry extra state (FP8 scaling) where megatron's local layers
    have none (its local linear layers save an empty one for TE's sake); a TE model reading a
    checkpoint of the local layers keeps its own. Weights are never left out: the local layers
    store their norms under TE's fused names (``models.layer_names``), so a dense model's
    tensors are found under either implementation.
    """
    if kept_in_memory(Path(directory)):  # kept by the same layers in the same job
        return model_state
    stored = read_dcp_metadata(Path(directory)).state_dict_metadata
    return {key: value for key, value in model_state.items()
            if not key.endswith(_EXTRA_STATE) or _stored_key(value) in stored}


def missing_weights(missing: Iterable[str]) -> list[str]:
    """The keys ``load_state_dict`` reports missing, less extra state (see
    :func:`without_absent_extra_state`; megatron's TE attention never saves its own)."""
    return [key for key in missing if not key.endswith(_EXTRA_STATE)]


def load_model_checkpoint(model: GPTModel | None, pg_collection: ProcessGroupCollection | None,
                          directory: str | Path, new_head: bool = False) -> CheckpointInfo:
    """Load a model checkpoint into this rank's part of ``model``, whatever TP/PP it was saved at.

    Collective over the default group: ranks that hold no part of the model (a placement where
    it lives on other ranks) call it with ``model=None`` and only take part in the collectives.

    Args:
        model: this rank's part, or None.
        pg_collection: the model's groups (None with ``model=None``).
        directory: the checkpoint.
        new_head: the model may carry another head than the checkpoint (an LM checkpoint into a
            critic, a reward model or an AC-Share actor): every trunk weight is loaded, output
            weights the checkpoint has under the same name too (the LM head of AC-Share), and
            the rest of the head keeps its initialisation.

    Returns:
        The checkpoint's info (role, caller metadata, saved layout).

    Raises:
        FileNotFoundError: the directory does not exist.
        ValueError: the checkpoint is incomplete or corrupted, or describes another model (or
            another trunk, with ``new_head``).
    """
    info = read_checkpoint_info(directory)
    if model is None:
        load_sharded_checkpoint({}, directory)
        return info
    _check_same_model(info.model, ModelDescription.from_model(model), str(directory), new_head)
    wanted = model_sharded_state_dict(model, pg_collection)
    wanted = without_absent_extra_state(wanted, directory)
    if new_head and info.model.head != model.head_kind:
        stored = read_dcp_metadata(Path(directory)).state_dict_metadata
        wanted = {key: value for key, value in wanted.items()
                  if not key.startswith("output_layer.") or _stored_key(value) in stored}
    loaded = load_sharded_checkpoint({_MODEL_KEY: wanted}, directory)
    missing, unexpected = model.load_state_dict(loaded[_MODEL_KEY], strict=False)
    not_loaded = [k for k in missing_weights(missing)
                  if not (new_head and k.startswith("output_layer."))]
    if not_loaded or unexpected:
        raise ValueError(f"checkpoint {directory} does not fill the model: missing "
                         f"{not_loaded[:4]}, unexpected {unexpected[:4]}")
    return info


def _stored_key(item: Any) -> str | None:
    return item.unique_key if isinstance(item, ShardedObject) else getattr(item, "key", None)
