"""Parameter names of megatron's two layer implementations, and the map between them.

Transformer Engine fuses the norm before attention and the norm before a dense MLP into the
linear layer that follows, so the same weight has two names inside a transformer layer:

    local (megatron's modules)     Transformer Engine
    input_layernorm.weight         self_attention.linear_qkv.layer_norm_weight
    pre_mlp_layernorm.weight       mlp.linear_fc1.layer_norm_weight     (dense MLP only)

Every other parameter has one name in both. The map is megatron's own: the local layer spec's
``sharded_state_dict_keys_map`` (``get_gpt_layer_local_spec``), which renames the local norms to
TE's keys in distributed checkpoints. An MoE layer keeps ``pre_mlp_layernorm`` under TE too (the
router reads the normalised input), so only the input norm is fused there; megatron's local spec
still renames its ``pre_mlp_layernorm`` in checkpoints (docs/models.md says what follows).

The rest of the package names tensors the local way (full states, refit plans, Hugging Face
conversion): :func:`local_layer_name` turns a TE model's layer parameter name into it.
"""

from __future__ import annotations

import functools

FUSED_NORM_MARK = "layer_norm_"
"""What TE's fused-norm parameters have in their name (``layer_norm_weight``, ``layer_norm_bias``)
and no local parameter has (the local norms are ``*_layernorm``)."""


@functools.cache
def fused_norm_prefixes() -> dict[str, str]:
    """Local norm prefix -> TE fused-norm prefix inside a transformer layer, from megatron's local
    layer spec: ``{"input_layernorm.": "self_attention.linear_qkv.layer_norm_", ...}``."""
    # Imported here: refit's planning and a configuration's checks reach this module and need no
    # megatron-core until a model's names are mapped.
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return dict(get_gpt_layer_local_spec().submodules.sharded_state_dict_keys_map)


def local_layer_name(name: str) -> str:
    """The local layers' name of a transformer-layer parameter of either implementation.

    Args:
        name: the name inside one layer (after ``decoder.layers.<i>.``), e.g.
            ``self_attention.linear_qkv.layer_norm_weight``; a local name is returned unchanged.

    Raises:
        ValueError: a TE fused-norm parameter that megatron's map does not name (a fused norm in
            another module), which no local parameter matches.
    """
    for local, fused in fused_norm_prefixes().items():
        if name.startswith(fused):
            return local + name[len(fused):]
    if FUSED_NORM_MARK in name:
        raise ValueError(
            f"parameter {name!r} is a Transformer Engine fused norm with no local-layer name "
            f"(megatron's local spec maps only {sorted(fused_norm_prefixes().values())}); build "
            "this model with models.transformer_impl=local")
    return name
