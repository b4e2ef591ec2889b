"""LoRA adapters on a built megatron-core GPTModel's column- and row-parallel linear layers.

    model = build_gpt_model(arch, options, pg_collection)   # then load the base weights
    apply_lora(model, LoRAConfig(rank=8, alpha=16), seed=1)  # freezes the base
    trainer = ModelTrainer(model, pg_collection, settings)   # optimizes the adapters alone
    with adapters_disabled(model):                           # the base model's forward
        ...

An adapted linear layer computes ``W x + (alpha / rank) * B A dropout(x)``: ``A`` (``lora_a``,
``[rank, in]``) starts uniform, ``B`` (``lora_b``, ``[out, rank]``) at zero, so the adapted model
starts equal to its base. The adapter is a child module ``adapter`` of the base layer and a
forward hook adds its output, so the base parameters keep their names and the adapter's are
``<layer>.adapter.lora_a`` and ``<layer>.adapter.lora_b``.

Tensor parallelism splits the adapter as the base layer is split:

* column-parallel (``linear_qkv``, ``linear_fc1``): ``A`` whole on every TP rank, ``B`` split
  over output rows like the base weight. Each rank's ``B`` shard sees only its share of the
  output's gradient, so the gradient of ``A x`` is summed over TP before ``A``'s (megatron's
  ``copy_to_tensor_model_parallel_region``). Under sequence parallelism ``A`` runs on this rank's
  part of the sequence and the ``rank``-wide result is gathered (the sum comes from the gather's
  reduce-scatter); ``A``'s gradient then covers this rank's tokens and is marked
  ``sequence_parallel`` for megatron's ``finalize_model_grads`` to sum over TP, as it does for
  norm weights.
* row-parallel (``linear_proj``, ``linear_fc2``): ``A`` split over input columns like the base
  weight, ``B`` whole; ``A x`` is a partial sum reduced as the base layer reduces its output
  (all-reduce, or reduce-scatter under sequence parallelism, where ``B`` is then marked
  ``sequence_parallel``).
* routed experts (``experts.linear_fc1``, ``experts.linear_fc2``): the expert layers of
  megatron's ``SequentialMLP``, with an expert TP size of 1 (the token dispatcher moves the
  tokens); the adapters take the base weight's ``allreduce`` attribute, so megatron DDP reduces
  their gradients over the expert data-parallel group as the experts'.

Only megatron's local layers (``ColumnParallelLinear``, ``RowParallelLinear``) take adapters:
Transformer Engine fuses the input norm into ``linear_qkv`` and ``linear_fc1``, whose inputs an
adapter would then not see.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from megatron_rlhf.models.options import LoRAConfig

ADAPTER = "adapter"
"""The name of the adapter module inside an adapted layer."""


class LoRAAdapter(torch.nn.Module):
    """``scaling * B A dropout(x)`` beside one megatron parallel linear layer, split over TP
    as that layer is (see the module docstring).

    Args:
        base: the layer adapted.
        rank: the adapter's rank.
        scaling: the factor on its output.
        dropout: dropout probability on its input.
    """

    def __init__(self, base: ColumnParallelLinear | RowParallelLinear, rank: int,
                 scaling: float, dropout: float) -> None:
        super().__init__()
        self.column = isinstance(base, ColumnParallelLinear)
        self.tp_group = base.tp_group
        self.tp_size = base.tp_group.size()
        # Expert layers leave their communication to the token dispatcher.
        self.expert_comm = bool(base.explicit_expert_comm)
        if self.expert_comm and self.tp_size > 1:
            raise NotImplementedError(
                f"LoRA on an expert layer with expert tensor parallelism {self.tp_size}: only "
                "expert TP size 1 is supported (drop experts.* from models.lora.target_modules)")
        self.sequence_parallel = bool(base.sequence_parallel) and not self.expert_comm
        self.scaling = scaling
        self.dropout = dropout
        self.enabled = True
        weight = base.weight
        kwargs = {"dtype": weight.dtype, "device": weight.device}
        if self.column:
            a_shape, b_shape = (rank, base.input_size), (base.output_size_per_partition, rank)
        else:
            a_shape, b_shape = (rank, base.input_size_per_partition), (base.output_size, rank)
        self.lora_a = torch.nn.Parameter(torch.zeros(a_shape, **kwargs))
        self.lora_b = torch.nn.Parameter(torch.zeros(b_shape, **kwargs))
        split = self.lora_b if self.column else self.lora_a
        set_tensor_model_parallel_attributes(split, True, 0 if self.column else 1, 1)
        local_tokens = self.lora_a if self.column else self.lora_b
        local_tokens.sequence_parallel = self.sequence_parallel
        for param in (self.lora_a, self.lora_b):
            param.allreduce = getattr(weight, "allreduce", True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's output, shaped as the base layer's ``[s, b, out]`` output."""
        if self.dropout and self.training:
            x = torch.nn.functional.dropout(x, p=self.dropout)
        # megatron's set_model_to_sequence_parallel toggles every module's attribute, experts'
        # too, whose communication the token dispatcher does whatever it says.
        sequence_parallel = self.sequence_parallel and not self.expert_comm
        h = torch.matmul(x, self.lora_a.t())
        if self.column:
            if sequence_parallel:
                h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True,
                                                         group=self.tp_group)
            elif self.tp_size > 1 and not self.expert_comm:
                h = copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        elif sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, group=self.tp_group)
        elif self.tp_size > 1 and not self.expert_comm:
            h = reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return torch.matmul(h, self.lora_b.t()) * self.scaling


def _add_adapter_output(module: torch.nn.Module, args: tuple, kwargs: dict, output):
    adapter: LoRAAdapter = getattr(module, ADAPTER)
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    out, bias = output
    return out + adapter(x), bias


def _sharded_with_adapter(base_sharded_state_dict, adapter: LoRAAdapter, glu: bool,
                          prefix: str = "", sharded_offsets: tuple = (),
                          metadata: dict | None = None) -> dict:
    """An adapted layer's megatron sharded state: the base layer's, whose own method would
    store the adapter's tensors as replicated, with the adapter's split as its base weight is
    (and, for a SwiGLU ``linear_fc1``, ``B``'s [gate; up] rows resharded as megatron reshards
    the weight's), so a checkpoint loads at any TP."""
    state = base_sharded_state_dict(prefix, sharded_offsets, metadata)
    axis = {"lora_b": 0} if adapter.column else {"lora_a": 1}
    own = make_sharded_tensors_for_checkpoint(
        adapter.state_dict(prefix="", keep_vars=True), f"{prefix}{ADAPTER}.", axis,
        sharded_offsets, tp_group=adapter.tp_group, dp_cp_group=(metadata or {})["dp_cp_group"])
    if glu:
        key = f"{prefix}{ADAPTER}.lora_b"
        own[key] = apply_swiglu_sharded_factory(
            own[key], sharded_offsets, (metadata or {}).get("singleton_local_shards", False))
    state.update(own)
    return state


def _targets_of(name: str, module: torch.nn.Module) -> str | None:
    """Which of :data:`LORA_TARGETS` the module named ``name`` is, if any."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf not in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
        return None
    if ".experts.local_experts." in f".{name}":
        return f"experts.{leaf}"
    return leaf


def apply_lora(model: torch.nn.Module, config: LoRAConfig, seed: int | None = None,
               trainable: tuple[str, ...] = ()) -> list[str]:
    """Add adapters to ``model``'s target layers and freeze every other parameter.

    Call it on the bare model (not a DDP wrapper) after its base weights are loaded and before
    its trainer is built: megatron DDP and the optimizer take the parameters that require
    gradients when they are built.

    Args:
        model: this rank's part of a megatron GPTModel built with the local layers.
        config: the adapters (``config.rank > 0``).
        seed: seed of ``A``'s initialisation (default ``config.init_seed``): the same full ``A``
            under any TP/PP layout.
        trainable: name prefixes of other parameters that stay trainable (a critic's new value
            head: ``output_layer``).

    Returns:
        The names of the adapted layers on this rank.

    Raises:
        ValueError: adapters are already applied, or a target layer is not one of megatron's
            local parallel linear layers (Transformer Engine's).
    """
    if not config.enabled:
        raise ValueError("apply_lora needs models.lora.rank > 0")
    if any(isinstance(m, LoRAAdapter) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters")
    adapted = []
    for name, module in list(model.named_modules()):
        target = _targets_of(name, module)
        if target is None or target not in config.target_modules:
            continue
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            raise ValueError(
                f"LoRA on {name}: a {type(module).__name__} (Transformer Engine's layers fuse "
                "the input norm into linear_qkv and linear_fc1); build the model with "
                "models.transformer_impl=local")
        adapter = LoRAAdapter(module, config.rank, config.scaling, config.dropout)
        module.add_module(ADAPTER, adapter)
        module.register_forward_hook(_add_adapter_output, with_kwargs=True)
        glu = target.endswith("linear_fc1") and module.config.gated_linear_unit
        module.sharded_state_dict = partial(_sharded_with_adapter, module.sharded_state_dict,
                                            adapter, glu)
        adapted.append(name)
    if not adapted:
        raise ValueError(f"models.lora.target_modules={config.target_modules} match no layer "
                         "of the model (experts.* needs an MoE model)")
    for name, param in model.named_parameters():
        param.requires_grad_(trained_with_adapters(name, trainable))
    init_lora_weights(model, config.init_seed if seed is None else seed)
    return adapted


def trained_with_adapters(name: str, trainable: tuple[str, ...] = ()) -> bool:
    """Whether a parameter trains in a model with adapters: an adapter's, or one under a
    ``trainable`` prefix (as given to :func:`apply_lora`); what a weight sync copies after the
    first."""
    return is_adapter_param(name) or name.startswith(trainable)


def is_adapter_param(name: str) -> bool:
    """Whether a parameter name (in the bare model or a full state) is an adapter's."""
    return f".{ADAPTER}.lora_" in name


def lora_adapters(model: torch.nn.Module) -> list[LoRAAdapter]:
    """The model's adapters (none when it has none)."""
    return [m for m in model.modules() if isinstance(m, LoRAAdapter)]


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the model inside its DDP wrappers) carries adapters."""
    return bool(lora_adapters(model))


@contextmanager
def adapters_disabled(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` as its base: every adapter's output is left out (the reference forward).

    The adapters' parameters are untouched; a model without adapters runs unchanged.
    """
    adapters = lora_adapters(model)
    states = [a.enabled for a in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states, strict=True):
            adapter.enabled = state


@torch.no_grad()
def init_lora_weights(model: torch.nn.Module, seed: int) -> None:
    """``B = 0`` and ``A`` uniform in ``±1/sqrt(in_features)`` (PEFT's default, Kaiming's with
    ``a=sqrt(5)``), drawn whole from a generator seeded by ``seed`` and the layer's global name,
    then sliced: the same adapters under any TP/PP layout."""
    from megatron_rlhf.models.weights import shard_rules

    global_names = {name: rule.global_name for name, _, rule in shard_rules(model)
                    if is_adapter_param(name)}
    for name, adapter in model.named_modules():
        if not isinstance(adapter, LoRAAdapter):
            continue
        adapter.lora_b.zero_()
        lora_a = adapter.lora_a
        split = 1 if adapter.column else adapter.tp_size
        in_features = lora_a.shape[1] * split
        generator = torch.Generator().manual_seed(
            seed * 1_000_003 + zlib.crc32(global_names[f"{name}.lora_a"].encode()))
        bound = 1.0 / math.sqrt(in_features)
        full = (torch.rand(lora_a.shape[0], in_features, generator=generator) * 2 - 1) * bound
        if split > 1:
            start = adapter.tp_group.rank() * lora_a.shape[1]
            full = full[:, start:start + lora_a.shape[1]]
        lora_a.copy_(full)


def check_no_adapters(directory: str, field_name: str) -> None:
    """Refuse a megatron_rlhf checkpoint that holds adapters as a run's starting point: its base
    would load and its adapters be left out (a plain model's state names none), and a run that
    trains new adapters would take the pre-adapter base as its reference.

    Raises:
        ValueError: the checkpoint holds adapter tensors; naming ``field_name`` and the fix.
    """
    from megatron_rlhf.models.checkpoint import read_dcp_metadata

    stored = [key for key in read_dcp_metadata(directory).state_dict_metadata
              if is_adapter_param(key)]
    if stored:
        raise ValueError(
            f"{field_name}={directory} holds LoRA adapters ({len(stored)} tensors, e.g. "
            f"{stored[0]}), which a starting point does not load: merge them into the base "
            "first (models.peft_export.merge_adapters) and start from the merged checkpoint")


def load_full_adapters(model: torch.nn.Module, pg_collection,
                       adapters: dict[str, torch.Tensor]) -> None:
    """Set the model's adapters from full-state tensors (``peft_export.read_peft_adapter``).

    Collective over the model's TP and PP groups; the model's full state is gathered and loaded
    back with the adapters replaced, which is meant for models that fit one rank's memory.

    Raises:
        ValueError: ``adapters`` lacks some of the model's adapters or names others.
    """
    from megatron_rlhf.models.weights import gather_full_state, load_full_state

    full = gather_full_state(model, pg_collection)
    ours = {k for k in full if is_adapter_param(k)}
    missing, extra = sorted(ours - set(adapters)), sorted(set(adapters) - ours)
    if missing or extra:
        raise ValueError(f"the adapters do not match the model's: missing {missing[:3]}, "
                         f"unexpected {extra[:3]}")
    full.update(adapters)
    load_full_state(model, pg_collection, full)
