"""A CPU stand-in for a Transformer Engine model's parameter layout (TE is not installed here).

    model = build_gpt_model(arch, ModelBuildOptions(), pgc)   # megatron's local layers
    with_te_layout(model, extra_state=True)                   # now named and nested as TE's

TE's ``LayerNormColumnParallelLinear`` holds the norm before it as ``layer_norm_weight``; this
moves each local norm that megatron's map fuses (``models.layer_names.fused_norm_prefixes``) into
the linear layer after it under that name. It can also give ``_extra_state`` (TE's FP8 metadata)
to the modules that are TE modules in a TE model but plain torch modules without extra state in
the local one: the final norm and each layer's core attention (megatron's local linear layers
already save an empty extra state for TE's sake). Names, nesting, shard attributes and checkpoint
keys are then TE's; the model is for weight movement (full states, refit, checkpoints), not for
forward passes.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel

from megatron_rlhf.models.layer_names import fused_norm_prefixes


def _with_extra_state(module: torch.nn.Module) -> None:
    """Give ``module`` a TE-like extra state: a tensor saved with it, recorded when loaded."""

    class WithExtraState(type(module)):
        def get_extra_state(self) -> torch.Tensor:
            return torch.tensor([7.0])

        def set_extra_state(self, state: torch.Tensor) -> None:
            self.loaded_extra_state = state

    module.__class__ = WithExtraState


def with_te_layout(model: GPTModel, extra_state: bool = False) -> GPTModel:
    """Rename ``model``'s fused norms the way Transformer Engine names them (in place).

    Args:
        extra_state: also give the final norm and the core attentions an ``_extra_state``.
    """
    for layer in model.decoder.layers:
        for local, fused in fused_norm_prefixes().items():
            owner_path, param_prefix = fused.rsplit(".", 1)
            norm = getattr(layer, local.rstrip("."))
            owner = layer.get_submodule(owner_path)
            for name, param in list(norm.named_parameters()):
                owner.register_parameter(param_prefix + name, param)
            setattr(layer, local.rstrip("."), torch.nn.Identity())
        if extra_state:
            _with_extra_state(layer.self_attention.core_attention)
    if extra_state and model.post_process:
        _with_extra_state(model.decoder.final_layernorm)
    return model
