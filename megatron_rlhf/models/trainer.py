"""A trainable model: megatron DDP (or the distributed optimizer, or Megatron-FSDP), LR schedule,
train steps.

    trainer = ModelTrainer(model, pg_collection, OptimizerSettings(lr=1e-5))
    metrics = trainer.train_step(microbatches, loss_fn)   # loss_fn -> (loss_sum, tokens, metrics)

Losses are summed over tokens and megatron divides the gradients by the number of loss tokens of
the whole step (all micro-batches, all DP replicas: ``calculate_per_token_loss``). A token-mean
loss therefore gives the same update whatever the DP size and micro-batch split, which is what
makes results independent of the placement.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    FullyShardedDataParallel,
    finalize_model_grads,
)
from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
    gather_and_compute_chunk_metadata,
)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_layer import TransformerLayer
from torch.distributed.tensor import DTensor, Shard

from megatron_rlhf.models.forward_backward import Batch, LossFn, run_microbatches
from megatron_rlhf.models.options import OptimizerSettings  # noqa: F401  (re-exported)
from megatron_rlhf.runtime.patches import default_group_gathers_scoped_to, megatron_fsdp_wrapping

FSDP_GATHERED_LAYERS = 2
"""Transformer layers Megatron-FSDP holds gathered at once: the one computing and the one
prefetched (``suggested_communication_unit_size``; ``planner.cost_model.FSDP_LAYERS_GATHERED``)."""
_ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")
_OPTIMIZER_CHECKPOINT_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


class ModelTrainer:
    """Owns the DDP wrapper, optimizer and LR scheduler of one model on this rank."""

    def __init__(self, model: torch.nn.Module, pg_collection: ProcessGroupCollection,
                 settings: OptimizerSettings, total_steps: int = 1) -> None:
        self.pg_collection = pg_collection
        self.settings = settings
        config = model.config
        config.calculate_per_token_loss = True
        config.finalize_model_grads_func = finalize_model_grads
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=settings.grad_reduce_dtype == "float32",
            use_distributed_optimizer=settings.distributed_optimizer,
            overlap_grad_reduce=settings.overlap_grad_reduce,
            check_for_nan_in_grad=False,
            use_megatron_fsdp=settings.fsdp,
            data_parallel_sharding_strategy="optim_grads_params" if settings.fsdp else "no_shard",
            # megatron's default prefetches up to 1e9 elements: every layer of a small model.
            suggested_communication_unit_size=(FSDP_GATHERED_LAYERS * _layer_elements(model)
                                               if settings.fsdp else None),
        )
        self.module: DistributedDataParallel | FullyShardedDataParallel
        if settings.fsdp:
            _check_fsdp_layout(pg_collection)
            with megatron_fsdp_wrapping(pg_collection):
                self.module = FullyShardedDataParallel(
                    config, ddp_config, model, pg_collection=pg_collection,
                    device=next(model.parameters()).device)
        else:
            self.module = DistributedDataParallel(config, ddp_config, model,
                                                  pg_collection=pg_collection)
        config.no_sync_func = self.module.no_sync
        if settings.overlap_grad_reduce and pg_collection.pp.size() > 1:
            # 1F1B: each bucket's reduction starts when the last micro-batch fills it
            config.grad_sync_func = self.module.start_grad_sync
        with default_group_gathers_scoped_to(pg_collection.intra_dist_opt):
            self.optimizer = self._build_optimizer(config, settings)
        decay_steps = settings.lr_decay_steps or max(1, total_steps - settings.lr_warmup_steps)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer,
            init_lr=0.0 if settings.lr_warmup_steps else settings.lr,
            max_lr=settings.lr,
            min_lr=settings.min_lr if settings.lr_schedule != "constant" else settings.lr,
            lr_warmup_steps=settings.lr_warmup_steps,
            lr_decay_steps=settings.lr_warmup_steps + decay_steps,
            lr_decay_style=settings.lr_schedule,
            start_wd=settings.weight_decay,
            end_wd=settings.weight_decay,
            wd_incr_steps=1,
            wd_incr_style="constant",
            # A resume restores the step count only: the schedule is this run's settings'
            # (a changed lr, min_lr, weight decay, warm-up or decay applies from the next step).
            use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True,
        )
        self.steps = 0

    def _build_optimizer(self, config, settings: OptimizerSettings):
        return get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=settings.lr,
                min_lr=settings.min_lr,
                weight_decay=settings.weight_decay,
                adam_beta1=settings.adam_beta1,
                adam_beta2=settings.adam_beta2,
                adam_eps=settings.adam_eps,
                clip_grad=settings.clip_grad,
                use_distributed_optimizer=settings.distributed_optimizer,
                bf16=config.bf16,
                params_dtype=config.params_dtype,
                **_cpu_offload_fields(settings.cpu_offload_fraction),
            ),
            [self.module],
            use_gloo_process_groups=False,
            pg_collection=self.pg_collection,
        )

    @property
    def model(self) -> torch.nn.Module:
        """The bare model (inside the DDP or FSDP wrapper). Under FSDP its parameters are only
        whole while the wrapper runs them: read weights through :meth:`full_weights`."""
        if self.settings.fsdp:
            return self.module.module.module
        return self.module.module

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Every parameter, whole, by its name in the bare model (TP shards stay TP shards).

        Collective over the model's DP and TP groups under FSDP (the shards are gathered).
        """
        if not self.settings.fsdp:
            return {name: param.detach().clone() for name, param in self.model.named_parameters()}
        prefix = "module."
        return {key[len(prefix):]: _full_tensor(value)
                for key, value in self.module.module.state_dict().items()
                if key.startswith(prefix) and not key.endswith("_extra_state")}

    def train_step(self, microbatches: list[Batch], loss_fn: LossFn) -> dict[str, Any]:
        """One optimizer step over ``microbatches`` (this rank's share of the step's batch).

        Args:
            microbatches: inputs for :func:`run_microbatches`.
            loss_fn: ``(output, batch) -> (loss_sum, num_loss_tokens, metrics)``.

        Returns:
            ``{"metrics": [per-micro-batch metrics on the last PP stage], "grad_norm": float,
            "lr": float, "update_successful": bool}``. NaN or Inf in any gradient of the model
            (on any of its ranks) skips the update: ``update_successful`` is False and the
            weights, optimizer state and LR schedule are left as they were.
        """
        self.module.train()
        self.module.zero_grad_buffer()
        self.optimizer.zero_grad()
        metrics = run_microbatches(self.module, self.pg_collection, microbatches, loss_fn,
                                   forward_only=False)
        lr = self.optimizer.param_groups[0]["lr"]
        if not self._gradients_finite():
            return {"metrics": metrics, "grad_norm": math.nan, "lr": lr,
                    "update_successful": False}
        update_successful, grad_norm, _ = self.optimizer.step()
        if update_successful:
            self.scheduler.step(increment=1)
            self.steps += 1
        return {
            "metrics": metrics,
            "grad_norm": float(grad_norm) if grad_norm is not None else math.nan,
            "lr": lr,
            "update_successful": bool(update_successful),
        }

    def release_gathered_weights(self) -> None:
        """Free the weights Megatron-FSDP holds gathered, leaving this rank's shards.

        After an optimizer step megatron starts gathering the next forward's first layers, and a
        pass may end with some still gathered; the engine calls this
        when a stage is done with the model, so that at rest the model holds its shards only.
        The next forward gathers what it needs again. A no-op without FSDP.
        """
        if not self.settings.fsdp:
            return
        fsdp = self.module.module
        # Finish the gathers in flight first, or megatron warns that it had to.
        for bucket_id, bwd in list(fsdp.all_gather_pipeline.param_gather_event_map):
            fsdp.all_gather_pipeline.wait_bucket_ready(bucket_id, bwd)
        fsdp.synchronize_param_gather()

    def fsdp_units(self) -> list[torch.nn.Module]:
        """The modules Megatron-FSDP gathers one at a time (its transformer layers; none
        without FSDP)."""
        if not self.settings.fsdp:
            return []
        return [m for m in self.model.modules() if isinstance(m, TransformerLayer)]

    def gathered_weight_buffers(self) -> list[torch.Tensor]:
        """The unsharded weight buckets Megatron-FSDP has allocated now (empty storages once
        released; none without FSDP)."""
        if not self.settings.fsdp:
            return []
        allocator = self.module.param_and_grad_buffer.weight_alloc
        return [bucket.data for bucket in allocator.buckets.values()]

    def gathered_weight_bytes(self) -> int:
        """Bytes of :meth:`gathered_weight_buffers` now (0 once released, and without FSDP)."""
        return sum(t.untyped_storage().nbytes() for t in self.gathered_weight_buffers())

    def _gradients_finite(self) -> bool:
        """Whether every gradient of the model is finite, agreed over the model's ranks."""
        grads = self._reduced_gradients()
        found = torch.zeros(1, device=grads[0].device)
        for grad in grads:
            if not torch.isfinite(grad).all():
                found.fill_(1.0)
        dist.all_reduce(found, op=dist.ReduceOp.MAX,
                        group=self.optimizer.get_grad_stats_parallel_group())
        return found.item() == 0

    def weight_buffers(self) -> list[torch.Tensor]:
        """The contiguous weight buffers megatron keeps on this rank (under FSDP its shard of
        the weights; the DDP wrapper keeps one only with the distributed optimizer)."""
        if self.settings.fsdp:
            return [group.model_weight_buffer.data
                    for group in self.module.param_and_grad_buffer.parameter_groups
                    if group.model_weight_buffer is not None]
        return [buffer.param_data
                for buffer in self.module.buffers + self.module.expert_parallel_buffers
                if buffer.param_data is not None]

    def gradient_buffers(self) -> list[torch.Tensor]:
        """The contiguous gradient buffers megatron keeps on this rank (under FSDP its shard of
        them, padding included)."""
        if self.settings.fsdp:
            return [group.main_grad_buffer.data
                    for group in self.module.param_and_grad_buffer.parameter_groups
                    if group.main_grad_buffer is not None]
        return [buffer.grad_data
                for buffer in self.module.buffers + self.module.expert_parallel_buffers]

    def _reduced_gradients(self) -> list[torch.Tensor]:
        """This rank's reduced gradients, without padding: Megatron-FSDP leaves the padding of
        its gradient shards uninitialised, so it may hold NaNs that belong to no parameter."""
        if not self.settings.fsdp:
            return self.gradient_buffers()
        return [buffer.get_item(buffer.param_idx[param])
                for group in self.module.param_and_grad_buffer.parameter_groups
                if (buffer := group.main_grad_buffer) is not None
                for param in buffer.params]

    def state_dict(self) -> dict[str, Any]:
        """Scheduler and step counter (optimizer state goes through sharded checkpoints)."""
        return {"scheduler": self.scheduler.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])

    def _inner_optimizers(self) -> list:
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def optimizer_sharded_state_dict(self, model_sharded_state_dict: ShardedStateDict,
                                     is_loading: bool = False) -> ShardedStateDict:
        """The optimizer state as megatron sharded tensors keyed like the model's parameters.

        The distributed optimizer uses megatron's ``fully_reshardable`` format (each parameter's
        Adam moments and fp32 copy with the parameter's own sharding, gathered over DP on save),
        so the state loads at any TP/PP/DP; megatron's default ``fully_sharded_model_space``
        needs flattened ShardedTensors, which megatron-core 0.16.1 no longer accepts.
        Collective over the model's DP group on save.

        Raises:
            NotImplementedError: the model trains under Megatron-FSDP.
        """
        self._refuse_fsdp_checkpoint()
        if is_loading:
            for inner in self._inner_optimizers():
                _init_adam_state(inner.optimizer)
        return {index: inner.sharded_state_dict(model_sharded_state_dict, is_loading=is_loading,
                                                metadata=_OPTIMIZER_CHECKPOINT_METADATA)
                for index, inner in enumerate(self._inner_optimizers())}

    def load_optimizer_state(self, state: dict[int, Any]) -> None:
        """Load what :meth:`optimizer_sharded_state_dict` described, as read from a checkpoint.

        megatron-core 0.16.1's ``load_parameter_state_from_fully_reshardable`` fails with torch's
        Adam, which keeps a per-parameter ``step`` tensor the loaded state does not carry, and its
        ``load_state_dict`` gives every parameter the same ``step`` tensor, which Adam then
        increments once per parameter. Both are worked around here: the parameter state is loaded
        with ``step`` set aside, and each parameter gets its own copy of the step.

        Raises:
            NotImplementedError: the model trains under Megatron-FSDP.
        """
        self._refuse_fsdp_checkpoint()
        built = self._group_settings()
        for index, inner in enumerate(self._inner_optimizers()):
            if not isinstance(inner, DistributedOptimizer):
                inner.load_state_dict(state[index])
                continue
            common = {k: v for k, v in state[index].items() if k != "param_state"}
            inner.load_state_dict(common)
            steps = {param: s.pop("step") for param, s in inner.optimizer.state.items()
                     if "step" in s}
            inner.load_parameter_state_from_fully_reshardable(state[index]["param_state"])
            for param, step in steps.items():
                inner.optimizer.state[param]["step"] = step.clone()
        self._settings_win(built)

    _SETTINGS_IN_GROUPS = ("max_lr", "min_lr", "betas", "eps")
    """What megatron's param groups hold of this run's settings; a checkpoint's groups carry
    the saved values, which would win over a resume's changed ones (the scheduler sets ``lr``
    and ``weight_decay`` from ``max_lr``, ``min_lr`` and its own settings at every step)."""

    def _group_settings(self) -> list[dict[str, Any]]:
        return [{key: group[key] for key in self._SETTINGS_IN_GROUPS if key in group}
                for group in self.optimizer.param_groups]

    def _settings_win(self, built: list[dict[str, Any]]) -> None:
        """Put this run's settings, as the optimizer was built with them, back into the param
        groups after loading a checkpoint's."""
        for group, settings in zip(self.optimizer.param_groups, built, strict=True):
            group.update(settings)

    def reload_main_params(self) -> None:
        """Copy the model's weights into the optimizer's main (fp32) copies, after loading
        weights without optimizer state.

        Raises:
            NotImplementedError: the model trains under Megatron-FSDP.
        """
        self._refuse_fsdp_checkpoint()
        self.optimizer.reload_model_params()

    def fsdp_state(self, with_optimizer: bool = True,
                   is_loading: bool = False) -> dict[str, dict[str, Any]]:
        """This rank's Megatron-FSDP state as DTensors by parameter name, for
        torch.distributed.checkpoint (``models.fsdp_checkpoint``), which loads into it in place.

        ``model`` holds the weights the optimizer steps: Megatron-FSDP's main copies where it
        keeps them (bf16 weights), else the weight shards themselves, from which the weights the
        layers compute with are derived. ``optimizer`` holds each parameter's Adam moments
        (DTensors) and, where this rank holds elements of the parameter, its step. torch Adam
        keeps no state for an empty shard, which never receives a gradient: there the moments
        are empty DTensors (every rank passes the same DTensors, as the collectives of
        uneven-shard metadata need) and the step is left out (the ranks that step the parameter
        write it).

        Args:
            with_optimizer: include ``optimizer``.
            is_loading: first give Adam the state its first step creates, to load into.

        Raises:
            ValueError: the model does not train under Megatron-FSDP.
        """
        if not self.settings.fsdp:
            raise ValueError("fsdp_state needs optimizer.fsdp=true; a DDP model's state goes "
                             "through optimizer_sharded_state_dict")
        params = dict(self.module.module.param_and_grad_buffer.optimizer_named_parameters)
        state: dict[str, dict[str, Any]] = {"model": params}
        if with_optimizer:
            held = [param for param in params.values() if param.to_local().numel() > 0]
            if is_loading:
                for inner in self._inner_optimizers():
                    _init_adam_state(inner.optimizer, held)
            adam = {id(param): values for inner in self._inner_optimizers()
                    for param, values in inner.optimizer.state.items()}
            state["optimizer"] = {
                name: dict(adam[id(param)]) if id(param) in adam
                else {moment: torch.zeros_like(param) for moment in _ADAM_MOMENTS}
                for name, param in params.items()}
        return state

    def load_fsdp_state(self, load: Callable[[dict[str, dict[str, Any]]], None],
                        with_optimizer: bool = True) -> None:
        """Load a Megatron-FSDP state: ``load`` fills :meth:`fsdp_state` in place (a DCP
        load, ``models.fsdp_checkpoint.load_fsdp_checkpoint``); the weights the layers compute
        with are then derived from the loaded ones, as after an optimizer step."""
        built = self._group_settings()
        load(self.fsdp_state(with_optimizer, is_loading=True))
        self.module.module.install_optimized_model_weights()
        self._settings_win(built)

    def _refuse_fsdp_checkpoint(self) -> None:
        if self.settings.fsdp:
            raise NotImplementedError(
                "optimizer.fsdp=true: a Megatron-FSDP model's state is not a megatron sharded "
                "state dict; save and load it through fsdp_state (models.fsdp_checkpoint)")


def _layer_elements(model: torch.nn.Module) -> int:
    """Parameters of this rank's largest transformer layer (Megatron-FSDP's unit)."""
    return max((sum(p.numel() for p in layer.parameters()) for layer in model.modules()
                if isinstance(layer, TransformerLayer)), default=1)


def _check_fsdp_layout(pg_collection: ProcessGroupCollection) -> None:
    """Refuse a layout megatron-core 0.16.1's FSDP adapter cannot mesh: it arranges
    ``range(world_size)`` as DP x TP, so the model must span every rank without PP."""
    tp, pp, dp = pg_collection.tp.size(), pg_collection.pp.size(), pg_collection.dp_cp.size()
    world = dist.get_world_size()
    if pp != 1 or tp * dp != world:
        raise ValueError(f"optimizer.fsdp=true needs the model on every rank with pp=1 "
                         f"(megatron-core 0.16.1's FSDP adapter meshes the whole world as DP x "
                         f"TP); this model has tp={tp} pp={pp} dp={dp} on a world of {world} "
                         "ranks: use optimizer.fsdp=false or such a layout")


def _full_tensor(dtensor: DTensor) -> torch.Tensor:
    """This rank's TP shard, whole over DP, of one of Megatron-FSDP's weights.

    megatron's own ``gather_uneven_dtensor_to_full_tensor`` all-gathers chunks of different
    sizes, which gloo refuses; each rank instead writes its chunk into zeros at its offset and
    the ranks of each sharded mesh dimension sum them (the chunks are disjoint). Collective over
    the weight's mesh: the model's DP group, and its TP group for a TP-sharded weight.
    """
    local = dtensor.to_local()
    mesh = dtensor.device_mesh
    # Always gathered, never read from the chunk list megatron may have attached to the local
    # tensor: whether that attribute is still there can differ between ranks, and a rank that
    # skipped the gather would pair its next collective with another rank's gather.
    chunk = gather_and_compute_chunk_metadata(dtensor)
    full = torch.zeros(dtensor.shape, dtype=local.dtype, device=local.device)
    region = zip(chunk.offsets, local.shape, strict=True)
    full[tuple(slice(start, start + size) for start, size in region)] = local
    sharded = [(dim, name, placement) for dim, (name, placement)
               in enumerate(zip(mesh.mesh_dim_names, dtensor.placements, strict=True))
               if isinstance(placement, Shard)]
    for dim, _, _ in sharded:
        dist.all_reduce(full, group=mesh.get_group(dim))
    for dim, name, placement in sharded:
        if name == "tp":
            full = full.chunk(mesh.size(dim), dim=placement.dim)[mesh.get_coordinate()[dim]]
    return full.contiguous()


def _cpu_offload_fields(fraction: float) -> dict[str, Any]:
    """megatron ``OptimizerConfig`` fields that put ``fraction`` of the optimizer on the host."""
    if not fraction:
        return {}
    # Megatron-LM's arguments require the precision-aware optimizer with CPU offload (the hybrid
    # optimizer reuses its code path): the distributed optimizer then keeps no fp32 main shards
    # and the hybrid optimizer holds them, on the host for the offloaded fraction.
    return {"optimizer_cpu_offload": True, "optimizer_offload_fraction": fraction,
            "use_precision_aware_optimizer": True}


def _init_adam_state(optimizer: torch.optim.Optimizer,
                     only: Iterable[torch.Tensor] | None = None) -> None:
    """Give torch Adam's parameters (those in ``only``, if given) the state its first step
    creates (step 0, zero moments).

    megatron's distributed optimizer reads a per-parameter ``step`` when it builds the state dict
    to load into, which a torch Adam that never stepped (a fresh run being resumed) lacks; a
    checkpoint loader needs tensors to load into.
    """
    if not isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        return
    wanted = None if only is None else {id(param) for param in only}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if wanted is not None and id(param) not in wanted:
                continue
            state = optimizer.state[param]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param,
                                                       memory_format=torch.preserve_format)
