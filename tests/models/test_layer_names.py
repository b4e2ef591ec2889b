"""The name map between megatron's local layers and Transformer Engine's, on CPU (no TE here).

A local model's distributed-checkpoint keys are megatron's renaming of its parameters to TE's
names; ``local_layer_name`` must undo it on every tensor. A stand-in with TE's parameter layout
(``tests/helpers/te_layers.py``) then moves weights both ways: full states and checkpoints.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

from megatron_rlhf.models.checkpoint import (
    load_model_checkpoint,
    model_sharded_state_dict,
    save_model_checkpoint,
)
from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
from megatron_rlhf.models.layer_names import fused_norm_prefixes, local_layer_name
from megatron_rlhf.models.weights import gather_full_state, init_weights, load_full_state
from tests.helpers.te_layers import with_te_layout
from tests.model_fixtures import TinyArch, whole_world_groups

_ARCH = TinyArch(num_layers=2)
_LAYER = re.compile(r"^decoder\.layers\.(\d+\.)?")


@pytest.fixture(scope="module")
def pgc():
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return whole_world_groups(1, 1)


def _model(pgc, seed: int, qk_norm: bool = False, te: bool = False, extra: bool = False):
    model = build_gpt_model(replace(_ARCH, qk_norm=qk_norm), ModelBuildOptions(), pgc)
    init_weights(model, pgc, seed=seed)
    with torch.no_grad():  # norms away from their initial ones, so a lost norm shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(
                    seed + len(name))))
    return with_te_layout(model, extra_state=extra) if te else model


def test_the_map_is_megatrons_local_spec() -> None:
    assert fused_norm_prefixes() == {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                                     "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


@pytest.mark.parametrize("qk_norm", [False, True])
def test_megatrons_te_style_checkpoint_keys_map_back_to_local_names(pgc, qk_norm) -> None:
    model = _model(pgc, seed=1, qk_norm=qk_norm)
    sharded = model_sharded_state_dict(model, pgc)
    layer_params = [n for n, _ in model.named_parameters() if n.startswith("decoder.layers.")]
    fused = 0
    for name in layer_params:
        key = sharded[name].key  # megatron's key: TE's names, no layer index
        rest, te_rest = _LAYER.sub("", name), _LAYER.sub("", key)
        assert local_layer_name(te_rest) == rest, f"{key} maps back to another name than {name}"
        fused += te_rest != rest
        assert ("layernorm" in rest and "q_layernorm" not in rest
                and "k_layernorm" not in rest) == (te_rest != rest), name
    assert fused == 2 * _ARCH.num_layers, "two fused norms per layer"


def test_an_unmappable_fused_norm_fails_naming_the_tensor() -> None:
    assert local_layer_name("self_attention.linear_qkv.layer_norm_bias") == "input_layernorm.bias"
    assert local_layer_name("mlp.linear_fc2.weight") == "mlp.linear_fc2.weight"
    with pytest.raises(ValueError, match=r"'self_attention\.linear_proj\.layer_norm_weight' is "
                                         r"a Transformer Engine fused norm"):
        local_layer_name("self_attention.linear_proj.layer_norm_weight")


def test_a_te_layout_has_the_local_full_state(pgc) -> None:
    local, te = _model(pgc, seed=2), _model(pgc, seed=2, te=True)
    te_names = {n for n, _ in te.named_parameters()}
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te_names
    assert not any("input_layernorm" in n or "pre_mlp_layernorm" in n for n in te_names)
    expected = gather_full_state(local, pgc)
    got = gather_full_state(te, pgc)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    other = _model(pgc, seed=3, te=True)
    load_full_state(other, pgc, expected)  # a Hugging Face start reads local names
    assert all(torch.equal(t, expected[k]) for k, t in gather_full_state(other, pgc).items())


def test_te_fused_norms_are_initialised_as_the_local_norms(pgc) -> None:
    te = with_te_layout(build_gpt_model(_ARCH, ModelBuildOptions(), pgc))
    init_weights(te, pgc, seed=6)
    local = build_gpt_model(_ARCH, ModelBuildOptions(), pgc)
    init_weights(local, pgc, seed=6)
    fused = [p for n, p in te.named_parameters() if n.endswith("layer_norm_weight")]
    assert len(fused) == 2 * _ARCH.num_layers and all(torch.equal(p, torch.ones_like(p))
                                                      for p in fused)
    expected = gather_full_state(local, pgc)
    assert all(torch.equal(t, expected[k]) for k, t in gather_full_state(te, pgc).items())


def test_an_unmappable_parameter_of_a_model_fails_naming_it(pgc) -> None:
    model = _model(pgc, seed=2, te=True)
    proj = model.decoder.layers[1].self_attention.linear_proj
    proj.register_parameter("layer_norm_weight", torch.nn.Parameter(torch.ones(4)))
    with pytest.raises(ValueError, match=r"'self_attention\.linear_proj\.layer_norm_weight'"):
        gather_full_state(model, pgc)


@pytest.mark.parametrize("direction", ["local->te", "te->local"])
def test_checkpoints_move_between_the_implementations(pgc, tmp_path, direction) -> None:
    """A dense model's checkpoint stores its norms under TE's names either way; TE's extra state
    is absent from a local model's checkpoint and left as it is."""
    save_te = direction == "te->local"
    saved = _model(pgc, seed=4, te=save_te, extra=save_te)
    save_model_checkpoint(saved, pgc, str(tmp_path / "ckpt"), {"role": "actor"})
    into = _model(pgc, seed=5, te=not save_te, extra=not save_te)
    load_model_checkpoint(into, pgc, str(tmp_path / "ckpt"))
    expected = gather_full_state(saved, pgc)
    got = gather_full_state(into, pgc)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    loaded_extra = [getattr(m, "loaded_extra_state", None) for m in into.modules()]
    assert all(state is None for state in loaded_extra), "no extra state came from a local save"
