"""Layout-independent weights: full (unsharded) tensors <-> this rank's TP/PP shards.

A model's *full state* maps global parameter names (``decoder.layers.<global index>...``, in the
local layers' names whichever implementation holds them: ``models.layer_names``) to the tensors a
TP=1, PP=1 model would hold, with the vocabulary unpadded. Three operations use it:

* :func:`init_weights` draws each full tensor from a generator seeded by (seed, name) and keeps
  this rank's slice, so the initial model is the same whatever the TP/PP layout;
* :func:`load_full_state` and :func:`gather_full_state` scatter a full state into a sharded model
  and gather it back (conversion, tests, small-model refit).

Sharding rules follow megatron's parameter attributes (``tensor_model_parallel``,
``partition_dim``); SwiGLU's ``linear_fc1`` holds [gate; up] *per TP shard*, so it is split in two
before concatenating shards.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from megatron_rlhf.models.layer_names import local_layer_name
from megatron_rlhf.runtime.device import comm_device

if TYPE_CHECKING:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_VOCAB_PARALLEL = ("embedding.word_embeddings.weight", "output_layer.weight",
                   "output_layer.lm_head.weight")
_SCALED_INIT = ("self_attention.linear_proj.weight", "linear_fc2.weight")
_LOCAL_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.")
_GLU_ROWS = ("linear_fc1.weight", "linear_fc1.adapter.lora_b")
"""SwiGLU's fc1 weight and its LoRA ``B`` (``models.lora``): [gate; up] rows per TP shard."""


@dataclass(frozen=True)
class ShardRule:
    """Where one local parameter sits inside its full tensor."""

    global_name: str
    partition_dim: int | None  # None: replicated across TP
    glu_halves: bool  # SwiGLU fc1: shard = [gate_shard; up_shard]
    vocab_rows: int | None  # vocab-parallel: real (unpadded) vocabulary rows


def _global_name(model: GPTModel, local_name: str) -> str:
    if local_name == "output_layer.weight" and model.share_embeddings_and_output_weights:
        # With PP > 1 the last stage keeps its own copy of the tied embedding.
        return "embedding.word_embeddings.weight"
    if local_name == "output_layer.lm_head.weight":
        # AC-Share's LM head is the same tensor as a plain actor's: same name, same init.
        return "output_layer.weight"
    match = _LAYER_RE.match(local_name)
    if match is None:
        return local_name
    layer = model.decoder.layers[int(match.group(1))]
    rest = local_layer_name(local_name[match.end():])  # a TE model's fused norms, renamed
    expert = _LOCAL_EXPERT_RE.match(rest)
    if expert is not None:  # an MoE layer's experts are named by their global index
        index = layer.mlp.local_expert_indices[int(expert.group(1))]
        rest = f"mlp.experts.local_experts.{index}." + rest[expert.end():]
    return f"decoder.layers.{layer.layer_number - 1}." + rest


def shard_rules(model: GPTModel) -> Iterator[tuple[str, torch.nn.Parameter, ShardRule]]:
    """Yield ``(local name, parameter, rule)`` for every parameter of this rank's model part."""
    for name, param in model.named_parameters():
        is_tp = bool(getattr(param, "tensor_model_parallel", False))
        yield name, param, ShardRule(
            global_name=_global_name(model, name),
            partition_dim=int(param.partition_dim) if is_tp else None,
            glu_halves=is_tp and name.endswith(_GLU_ROWS) and model.config.gated_linear_unit,
            vocab_rows=model.real_vocab_size if is_tp and name in _VOCAB_PARALLEL else None,
        )


def _full_shape(local: torch.Size, rule: ShardRule, tp_size: int) -> list[int]:
    shape = list(local)
    if rule.partition_dim is not None:
        shape[rule.partition_dim] *= tp_size
    if rule.vocab_rows is not None:
        shape[0] = rule.vocab_rows
    return shape


def _shard_of_full(full: torch.Tensor, rule: ShardRule, local_shape: torch.Size,
                   tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's slice of a full tensor (padding the vocabulary with zero rows).

    ``full`` is only indexed with tuples of slices and asked for its ``shape``, so a lazily read
    tensor (a safetensors slice) is read for this rank's part alone, not whole.
    """
    if rule.partition_dim is None:
        if rule.vocab_rows is None:
            return _along(full, 0, 0, full.shape[0])
        return _rows(full, 0, rule.vocab_rows, local_shape[0], rule.vocab_rows)
    dim, size = rule.partition_dim, local_shape[rule.partition_dim]
    start = tp_rank * size
    if rule.vocab_rows is not None and dim == 0:
        return _rows(full, start, start + size, size, rule.vocab_rows)
    if rule.glu_halves:
        half = size // 2  # the local [gate; up] rows: half of each full half
        gate_start, up_start = tp_rank * half, full.shape[0] // 2 + tp_rank * half
        return torch.cat([_along(full, 0, gate_start, gate_start + half),
                          _along(full, 0, up_start, up_start + half)])
    return _along(full, dim, start, start + size)


def _along(full: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
    index = [slice(None)] * len(full.shape)
    index[dim] = slice(start, stop)
    return full[tuple(index)]


def _rows(full: torch.Tensor, start: int, stop: int, count: int, real_rows: int
          ) -> torch.Tensor:
    """Rows ``[start, stop)`` of the vocabulary padded with zero rows past ``real_rows``."""
    real = _along(full, 0, min(start, real_rows), min(stop, real_rows))
    return torch.cat([real, real.new_zeros(count - real.shape[0], *real.shape[1:])])


def _full_of_shards(shards: list[torch.Tensor], rule: ShardRule) -> torch.Tensor:
    if rule.partition_dim is None:
        full = shards[0]
    elif rule.glu_halves:
        halves = [shard.chunk(2, dim=0) for shard in shards]
        full = torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    else:
        full = torch.cat(shards, dim=rule.partition_dim)
    return full[: rule.vocab_rows] if rule.vocab_rows is not None else full


def _init_full_tensor(name: str, shape: list[int], seed: int, std: float,
                      num_layers: int) -> torch.Tensor:
    # ``name`` is in the local layers' spelling: TE's fused norms arrive as ``*_layernorm``.
    if "layernorm" in name or name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if name.endswith(_SCALED_INIT):
        std = std / (2.0 * num_layers) ** 0.5
    return torch.randn(shape, generator=generator) * std


@torch.no_grad()
def init_weights(model: GPTModel, pg_collection: ProcessGroupCollection, seed: int,
                 std: float = 0.02) -> None:
    """Fill every parameter so that the model is identical under any TP/PP layout.

    Norm weights are ones, biases (Qwen2's QKV bias) zeros; other weights are normal(0, std), with
    megatron's scaled init (std / sqrt(2 * layers)) for the attention and MLP output projections.
    Padded vocabulary rows are zero.
    """
    tp_rank, tp_size = pg_collection.tp.rank(), pg_collection.tp.size()
    for _, param, rule in shard_rules(model):
        full = _init_full_tensor(rule.global_name, _full_shape(param.shape, rule, tp_size),
                                 seed, std, model.config.num_layers)
        param.copy_(_shard_of_full(full, rule, param.shape, tp_rank, tp_size))


@torch.no_grad()
def load_full_state(model: GPTModel, pg_collection: ProcessGroupCollection,
                    full_state: Mapping[str, torch.Tensor], new_head: bool = False) -> None:
    """Copy this rank's shards out of a full state.

    Args:
        new_head: the model's output head may differ from the state's (an LM into a critic, a
            reward model into a critic, an LM into an AC-Share actor): output-layer tensors the
            state lacks or holds in another shape keep their initialisation.

    Raises:
        KeyError: a parameter of the model is missing from ``full_state``.
        ValueError: a full tensor has the wrong shape.
    """
    tp_rank, tp_size = pg_collection.tp.rank(), pg_collection.tp.size()
    for local_name, param, rule in shard_rules(model):
        name = rule.global_name
        expected = _full_shape(param.shape, rule, tp_size)
        full = full_state.get(name)
        if full is None and name == "output_layer.weight":
            # A tied source into an untied model (an AC-Share actor): the LM head starts as the
            # embedding it was tied to.
            full = full_state.get("embedding.word_embeddings.weight")
        shape = None if full is None else list(full.shape)
        if new_head and local_name.startswith("output_layer.") and shape != expected:
            continue
        if full is None:
            raise KeyError(f"full state has no tensor {name!r}; it has {sorted(full_state)[:8]}...")
        if shape != expected:
            raise ValueError(f"{name}: full state holds shape {shape}, "
                             f"the model expects {expected}")
        param.copy_(_shard_of_full(full, rule, param.shape, tp_rank, tp_size))


@torch.no_grad()
def gather_full_state(model: GPTModel, pg_collection: ProcessGroupCollection,
                      use_grads: bool = False,
                      weights: Mapping[str, torch.Tensor] | None = None
                      ) -> dict[str, torch.Tensor]:
    """Gather the full state (or the full gradients) onto every rank of the model.

    Collective over the model's TP and PP groups; meant for small models, tests and conversion.

    Args:
        use_grads: gather ``param.main_grad`` (megatron DDP) or ``param.grad`` instead of weights.
        weights: this rank's TP shards by local parameter name, to gather instead of the
            parameters (a Megatron-FSDP model's, whole over DP: ``ModelTrainer.full_weights``).
    """
    tp_group, pp_group = pg_collection.tp, pg_collection.pp
    stage_state: dict[str, torch.Tensor] = {}
    for name, param, rule in shard_rules(model):
        tensor = param if weights is None else weights[name]
        if use_grads:
            tensor = getattr(param, "main_grad", None)
            tensor = param.grad if tensor is None else tensor
            if tensor is None:
                tensor = torch.zeros_like(param)
        # A copy: replicated tensors would otherwise alias the live parameters.
        tensor = tensor.detach().float().clone()
        shards = [tensor]
        if rule.partition_dim is not None and tp_group.size() > 1:
            shards = [torch.empty_like(tensor) for _ in range(tp_group.size())]
            dist.all_gather(shards, tensor, group=tp_group)
        stage_state[rule.global_name] = _full_of_shards(shards, rule)
    _gather_experts(stage_state, pg_collection)
    if pp_group.size() == 1:
        return stage_state
    stages: list[dict[str, torch.Tensor] | None] = [None] * pp_group.size()
    dist.all_gather_object(stages, stage_state, group=pp_group)
    full: dict[str, torch.Tensor] = {}
    for stage in stages:
        full.update(stage or {})
    return full


def _gather_experts(stage_state: dict[str, torch.Tensor],
                    pg_collection: ProcessGroupCollection) -> None:
    """Add the experts the other expert-parallel ranks hold to ``stage_state`` (in place)."""
    ep_group = getattr(pg_collection, "ep", None)
    if ep_group is None or ep_group.size() == 1:
        return
    mine = {name: tensor for name, tensor in stage_state.items() if ".local_experts." in name}
    others: list[dict[str, torch.Tensor] | None] = [None] * ep_group.size()
    dist.all_gather_object(others, {name: t.cpu() for name, t in mine.items()}, group=ep_group)
    device = next(iter(stage_state.values())).device
    for other in others:
        stage_state.update({name: t.to(device) for name, t in (other or {}).items()})


@torch.no_grad()
def gather_full_state_to_first_rank(model: GPTModel, pg_collection: ProcessGroupCollection,
                                    weights: Mapping[str, torch.Tensor] | None = None
                                    ) -> dict[str, torch.Tensor] | None:
    """Gather the full state onto the first rank of the model's TP and PP groups only, in the
    parameters' dtype and on the CPU, one tensor at a time (for export at scale: no rank holds
    more than one full fp32 copy, and no GPU more than one full tensor).

    Collective over the model's TP and PP groups (a DP replica's own); every rank of the replica
    calls it.

    Args:
        weights: this rank's TP shards by local parameter name, to gather instead of the
            parameters (a Megatron-FSDP model's: ``ModelTrainer.full_weights``).

    Returns:
        The full state on TP rank 0 of PP stage 0, None on every other rank.
    """
    tp_group, pp_group = pg_collection.tp, pg_collection.pp
    first = tp_group.rank() == 0
    stage_state: dict[str, torch.Tensor] = {}
    for name, param, rule in shard_rules(model):
        tensor = (param if weights is None else weights[name]).detach().contiguous()
        if rule.partition_dim is not None and tp_group.size() > 1:
            shards = [torch.empty_like(tensor) for _ in range(tp_group.size())] if first else None
            dist.gather(tensor, shards, dst=dist.get_global_rank(tp_group, 0), group=tp_group)
            if first:
                stage_state[rule.global_name] = _full_of_shards(shards, rule).cpu()
        elif first:  # without TP: still drop the padded vocabulary rows
            stage_state[rule.global_name] = _full_of_shards([tensor], rule).cpu().clone()
    if not first:
        return None
    if pp_group.size() == 1:
        return stage_state
    return _stages_to_first(stage_state, pp_group)


def _stages_to_first(stage_state: dict[str, torch.Tensor], pp_group: dist.ProcessGroup
                     ) -> dict[str, torch.Tensor] | None:
    """Every pipeline stage's host state onto stage 0's host, one tensor at a time.

    Only the tensors' names, shapes and dtypes are gathered as objects; the tensors go one by one
    over the backend's device and back to the host: ``gather_object`` under NCCL stages every
    stage's pickled state in one buffer on the destination's GPU (pp times a stage's bytes).
    """
    device = comm_device(pp_group)
    first = dist.get_global_rank(pp_group, 0)
    layout = [(name, tuple(t.shape), t.dtype) for name, t in stage_state.items()]
    layouts: list | None = [None] * pp_group.size() if pp_group.rank() == 0 else None
    dist.gather_object(layout, layouts, dst=first, group=pp_group)
    if layouts is None:
        for tensor in stage_state.values():
            dist.send(tensor.to(device), dst=first, group=pp_group)
        return None
    full = dict(stage_state)
    for stage, stage_layout in enumerate(layouts[1:], start=1):
        for name, shape, dtype in stage_layout:
            buffer = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(buffer, src=dist.get_global_rank(pp_group, stage), group=pp_group)
            full[name] = buffer.cpu()
    return full
