"""Where each role's initial weights and architecture come from: a megatron_rlhf checkpoint or a
Hugging Face directory (``models.actor_checkpoint`` / ``models.reward_checkpoint``).

    sources = resolve_sources(config)             # pure: config.json / megatron_rlhf.json only
    archs = role_architectures(config, sources)   # for the placement planner
    decodes = role in decoding_roles(config, plan)        # pure: which models use the KV cache
    options = role_options(config, sources, role, decodes)  # ModelBuildOptions of a role's model
    load_initial_weights(models, groups, sources, config.models.hf_cache_dir)  # collective

A role without a source of its own is built like the actor's source (the critic when it does not
start from the reward model, the reward model when none is given), or from the ``models.arch``
preset when the actor has no source either. A Hugging Face source is converted once into the
cache (models/hf_import.py) and loaded at the run's TP/PP.
"""

from __future__ import annotations

import datetime
import itertools
import json
import secrets
import socket
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.models.checkpoint import (
    ModelDescription,
    load_model_checkpoint,
    read_checkpoint_info,
)
from megatron_rlhf.models.gpt import ModelBuildOptions, resolve_transformer_impl
from megatron_rlhf.models.hf_config import read_hf_config
from megatron_rlhf.models.hf_import import cached_full_state, is_hf_dir
from megatron_rlhf.models.hf_llama import check_weight_files
from megatron_rlhf.models.moe import MoEConfig
from megatron_rlhf.models.weights import load_full_state
from megatron_rlhf.planner.memory_fit import generating_roles
from megatron_rlhf.runtime.checkpoint_store import on_rank0
from megatron_rlhf.runtime.patches import default_group_store
from megatron_rlhf.topology.models import (
    ACTOR,
    CRITIC,
    REF,
    REWARD,
    SHADOW_ACTOR,
    VALUE_HEAD_ROLES,
    ArchSpec,
    ExpertSpec,
    resolve_arch,
)
from megatron_rlhf.topology.plan import PlacementPlan

_BASE_ROLES = (ACTOR, CRITIC, REF, REWARD)


@dataclass(frozen=True)
class ModelSource:
    """One initial checkpoint.

    Attributes:
        path: the directory.
        description: the model its weights describe.
        is_hf: a Hugging Face directory (converted on load), else a megatron_rlhf checkpoint.
        hf_config: the Hugging Face ``config.json`` the weights came from (the directory's own,
            or the one a megatron_rlhf checkpoint recorded as ``hf_config``), else None; the
            base of an export.
        kind: what the directory holds, for messages: its Hugging Face architecture
            (``Qwen2ForCausalLM``) or ``megatron_rlhf '<role>'``.
    """

    path: str
    description: ModelDescription
    is_hf: bool = False
    hf_config: dict[str, Any] | None = None
    kind: str = "megatron_rlhf"


def read_source(path: str) -> ModelSource:
    """Recognise and check one checkpoint directory without loading weights.

    Raises:
        FileNotFoundError, ValueError: naming the directory and what is missing or unsupported.
    """
    if is_hf_dir(path):
        description, hf_config = read_hf_config(path)
        check_weight_files(path)  # missing or truncated: named now, not after distributed setup
        architectures = hf_config.get("architectures") or [f"{hf_config['model_type']} causal-LM"]
        return ModelSource(path, description, True, hf_config, architectures[0])
    info = read_checkpoint_info(path)
    return ModelSource(path, info.model, False, info.metadata.get("hf_config"),
                       f"megatron_rlhf {info.metadata['role']!r}")


def arch_spec(description: ModelDescription, name: str) -> ArchSpec:
    """A checkpoint's architecture, named ``name`` for the planner."""
    return replace(description.arch, name=name)


def config_arch(config: RunConfig) -> ArchSpec:
    """``models.arch`` with the experts of ``models.moe`` (none when it is dense)."""
    arch = resolve_arch(config.models.arch)
    return replace(arch, experts=config.models.moe.expert_spec(arch.ffn_hidden_size))


def initial_checkpoints(config: RunConfig) -> dict[str, str]:
    """Role -> checkpoint directory its initial weights come from (roles absent: fresh init)."""
    models = config.models
    sources = {}
    if models.actor_checkpoint:
        sources.update({ACTOR: models.actor_checkpoint, REF: models.actor_checkpoint})
    if models.reward_checkpoint:
        sources[REWARD] = models.reward_checkpoint
        if models.critic_from_reward and config.placement.places_critic:
            sources[CRITIC] = models.reward_checkpoint
    return sources


def resolve_sources(config: RunConfig) -> dict[str, ModelSource]:
    """Read every configured initial checkpoint once (before any process group).

    Raises:
        FileNotFoundError, ValueError: a directory is missing, incomplete or unsupported.
    """
    read: dict[str, ModelSource] = {}
    sources = {}
    for role, path in initial_checkpoints(config).items():
        if path not in read:
            read[path] = read_source(path)
        sources[role] = read[path]
    _check_heads(sources)
    _check_experts(config, sources)
    return sources


# Role -> (its field, heads whose weights it can use, what it needs): anything else would be
# loaded with a new, random head (a reward model that scores noise, a policy that samples it).
_HEAD_NEEDS = {
    ACTOR: ("models.actor_checkpoint", ("lm", "lm+scalar"),
            "an LM head: a ...ForCausalLM directory or an SFT checkpoint (tools/train_sft.py)"),
    REWARD: ("models.reward_checkpoint", ("scalar",),
             "a trained scalar head: a ...ForSequenceClassification directory with num_labels=1 "
             "or a reward-model checkpoint (tools/train_reward_model.py)"),
}


def _check_heads(sources: dict[str, ModelSource]) -> None:
    """Refuse a source whose head its role cannot use (the critic shares the reward model's).

    Raises:
        ValueError: naming the field, what the directory holds and what the role needs.
    """
    for role, (field, heads, needs) in _HEAD_NEEDS.items():
        source = sources.get(role)
        if source is not None and source.description.head not in heads:
            name = "reward model" if role == REWARD else role
            raise ValueError(f"{field}={source.path} is a {source.kind} checkpoint (head "
                             f"{source.description.head!r}); the {name} needs {needs}")


def _experts(experts: ExpertSpec | None, moe_field: str) -> str:
    if experts is None:
        return f"{moe_field}.num_experts=0"
    return (f"{moe_field}.num_experts={experts.num_experts} {moe_field}.topk={experts.topk} "
            f"{moe_field}.ffn_hidden_size={experts.ffn_hidden_size} "
            f"{moe_field}.shared_expert_ffn_size={experts.shared_ffn_size} "
            f"{moe_field}.renormalize_topk={str(experts.renormalize_topk).lower()}")


def _check_experts(config: RunConfig, sources: dict[str, ModelSource]) -> None:
    """Refuse a source whose experts are not those of ``models.moe``, with which every model of
    the run is built (:func:`check_source_experts`)."""
    for role, (field, _, _) in _HEAD_NEEDS.items():
        if role in sources:
            check_source_experts(config.models.moe, sources[role], field)


def check_source_experts(moe: MoEConfig, source: ModelSource, field: str,
                         moe_field: str = "models.moe") -> None:
    """Refuse a source (given as ``field``) whose experts are not those of ``moe`` (configured
    as ``moe_field``), with which its model is built (a dense source with ``num_experts=0``).

    Raises:
        ValueError: naming the field, the source's experts and the settings that match them.
    """
    arch = source.description.arch
    ours = moe.expert_spec(arch.ffn_hidden_size)
    if ours != arch.experts:
        kind = f"a mixture-of-experts {source.kind}" if arch.experts else (
            f"a dense {source.kind}")
        raise ValueError(f"{field}={source.path} is {kind} checkpoint, but {moe_field} builds "
                         f"every model with {_experts(ours, moe_field)}: set "
                         f"{_experts(arch.experts, moe_field)}")


def fresh_heads(config: RunConfig, sources: dict[str, ModelSource]) -> list[str]:
    """One line per role whose model has a head its source lacks (the AC-Share value head on an
    SFT policy): that head starts from ``models.init_seed`` on the loaded trunk."""
    notes = []
    fields = {ACTOR: "models.actor_checkpoint", REF: "models.actor_checkpoint",
              CRITIC: "models.reward_checkpoint", REWARD: "models.reward_checkpoint"}
    for role, source in sources.items():
        missing = (set(role_head(role, config.placement.ac_share).split("+"))
                   - set(source.description.head.split("+")))
        if missing:
            head = "value" if missing == {"scalar"} else "LM"
            notes.append(f"{role}: the {head} head is new (drawn from models.init_seed="
                         f"{config.models.init_seed}); the rest comes from {fields[role]}="
                         f"{source.path}")
    return notes


def role_head(role: str, ac_share: bool) -> str:
    """The output head a role's model carries."""
    if role in VALUE_HEAD_ROLES:
        return "scalar"
    return "lm+scalar" if ac_share and role in (ACTOR, SHADOW_ACTOR) else "lm"


def _description(config: RunConfig, sources: dict[str, ModelSource],
                 role: str) -> ModelDescription | None:
    source = sources.get(role) or sources.get(ACTOR)
    if source is None:
        return None
    head = role_head(role, config.placement.ac_share)
    return replace(source.description, head=head,
                   tie_embeddings=source.description.tie_embeddings and head == "lm")


def role_architectures(config: RunConfig,
                       sources: dict[str, ModelSource]) -> str | dict[str, ArchSpec]:
    """The architecture of each base role for the planner (the preset name without sources).

    A role with neither a source of its own nor an actor source to share (a policy started from
    ``models.init_seed`` next to a trained reward model) has the ``models.arch`` preset, with
    the experts of ``models.moe`` (:func:`config_arch`).
    """
    if not sources:
        return config_arch(config)
    architectures = {}
    for role in _BASE_ROLES:
        description = _description(config, sources, role)
        source = sources.get(role) or sources.get(ACTOR)
        architectures[role] = (config_arch(config) if description is None
                               else arch_spec(description, f"{role}:{source.path}"))
    return architectures


def decoding_roles(config: RunConfig, plan: PlacementPlan) -> frozenset[str]:
    """The placed roles that decode with the KV cache: the models that generate (the shadow
    actor, or the actor where none is placed; under hetero-separation also an actor with pp=1)
    when ``generation.use_kv_cache`` is on, else none."""
    return frozenset(generating_roles(plan) if config.generation.use_kv_cache else ())


def role_options(config: RunConfig, sources: dict[str, ModelSource], role: str,
                 decodes: bool = True) -> ModelBuildOptions:
    """How a role's model is built (its architecture is the plan's): the run's head, dtype,
    dropout, layer implementation and MoE training settings.

    The implementation is chosen per model (``resolve_transformer_impl``): one that decodes
    with the KV cache keeps megatron's local layers, the others take Transformer Engine under
    ``models.transformer_impl: auto`` where it is importable on CUDA. Weight sync and loading
    match parameters by their local-layer names (``models.layer_names``), so a TE trainer
    refits a local shadow.

    Args:
        role: a base role (a shadow is built as the model it copies).
        decodes: the model decodes with the KV cache (:func:`decoding_roles`); the default is
            the safe one, the local layers.
    """
    description = _description(config, sources, role)
    head = role_head(role, config.placement.ac_share)
    base = description.build_options() if description is not None else ModelBuildOptions()
    transformer_impl = resolve_transformer_impl(
        config.models.transformer_impl, needs_kv_cache=decodes and config.generation.use_kv_cache)
    return replace(base, head=head, params_dtype=config.models.params_dtype,
                   dropout=config.models.dropout, transformer_impl=transformer_impl,
                   attention_backend=config.models.attention_backend,
                   packed_sequences=config.models.packed_sequences,
                   sequence_parallel=(config.models.sequence_parallel
                                      and config.models.packed_sequences),
                   moe=config.models.moe.routing() if config.models.moe.enabled else None)


HF_CONVERSION_WAIT_S = 6 * 3600.0
"""How long the other ranks wait for rank 0's conversion of Hugging Face sources: hashing and
converting a large checkpoint takes far longer than a collective's timeout."""
_conversions = itertools.count()  # the same on every rank: each calls load_initial_weights alike


def load_initial_weights(models: dict[str, Any], groups: Any, placed: Collection[str],
                         sources: dict[str, ModelSource], cache_dir: str) -> None:
    """Load every placed role's source into its model; collective over the world.

    Hugging Face sources are converted by rank 0 into ``cache_dir``, which every rank must see
    (checked: with several nodes it must be on a shared filesystem); the other ranks wait for it
    in the job's store, up to :data:`HF_CONVERSION_WAIT_S`, not in a collective. Each rank then
    reads from the converted file only the tensors of its own model part, one at a time.

    Args:
        models: this rank's models (roles placed elsewhere are absent).
        groups: the run's process groups, indexed by role.
        placed: the roles of the plan.
        sources: from :func:`resolve_sources`.
        cache_dir: where Hugging Face sources are converted to (by rank 0, once).

    Raises:
        ValueError: the conversion failed on rank 0, or some ranks do not see ``cache_dir``.
    """
    hf_paths = sorted({s.path for s in sources.values() if s.is_hf})
    cached = _converted_by_rank0(hf_paths, cache_dir) if hf_paths else {}
    for role, source in sources.items():
        model = models.get(role)
        if role not in placed:
            continue
        if source.is_hf:
            if model is not None:
                with safe_open(cached[source.path], framework="pt") as converted:
                    load_full_state(model, groups[role], SafetensorsState(converted),
                                    new_head=True)
        else:
            # megatron's dist_checkpointing is collective: every rank takes part in each load.
            load_model_checkpoint(model, groups[role], source.path, new_head=True)


def _converted_by_rank0(hf_paths: list[str], cache_dir: str) -> dict[str, str]:
    """Rank 0 converts (or finds in the cache) every Hugging Face source; every rank gets the
    converted files' paths through the job's store."""
    check_shared_directory(Path(cache_dir).expanduser(), "models.hf_cache_dir")
    store = default_group_store()
    key = f"megatron_rlhf/hf_conversion/{next(_conversions)}"
    if dist.get_rank() == 0:
        try:
            result = {"cached": {path: str(cached_full_state(path, cache_dir))
                                 for path in hf_paths}}
        except (OSError, ValueError) as exc:  # every rank must hear of it, not wait
            result = {"error": f"{type(exc).__name__}: {exc}"}
        store.set(key, json.dumps(result))
    else:
        store.wait([key], datetime.timedelta(seconds=HF_CONVERSION_WAIT_S))
        result = json.loads(store.get(key))
    if "error" in result:
        raise ValueError(f"converting a Hugging Face checkpoint failed on rank 0: "
                         f"{result['error']}")
    return result["cached"]


def check_shared_directory(directory: Path, field: str) -> None:
    """Refuse a directory that some ranks do not see as rank 0 does (a node-local path, such as
    the default under ``~/.cache``, in a job over several nodes); collective over the world.

    Raises:
        ValueError: naming the hosts that do not see it, the field and the fixes.
    """
    def probe() -> str:
        directory.mkdir(parents=True, exist_ok=True)
        name = f".shared-probe-{secrets.token_hex(8)}"
        (directory / name).write_bytes(b"")
        return name

    name = on_rank0(probe)
    seen: list = [None] * dist.get_world_size()
    # World: every rank reports whether it sees the file rank 0 wrote.
    dist.all_gather_object(seen, (socket.gethostname(), (directory / name).is_file()),
                           group=dist.group.WORLD)
    on_rank0(lambda: (directory / name).unlink())
    blind = [f"{rank} ({host})" for rank, (host, sees) in enumerate(seen) if not sees]
    if blind:
        raise ValueError(
            f"{field}={directory} is not shared: ranks {', '.join(blind)} do not see the files "
            "rank 0 writes there, so they could not read its conversion; set "
            f"{field} to a directory on a filesystem every node mounts, or convert ahead of "
            "time with tools/convert_hf_to_megatron.py and give its output as the checkpoint")


class SafetensorsState(Mapping[str, torch.Tensor]):
    """A full state in an open safetensors file, each tensor read only where it is indexed: a
    rank reads its own model part's tensors, one at a time, and of a TP-sharded tensor only its
    own slice."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self._names = sorted(handle.keys())

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        return LazyTensor(self._handle.get_slice(name))

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class LazyTensor:
    """One tensor of an open safetensors file: its ``shape``, and the part a tuple of slices
    selects, read when indexed."""

    def __init__(self, piece: Any) -> None:
        self._slice = piece
        self.shape = torch.Size(piece.get_shape())

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self._slice[index]
