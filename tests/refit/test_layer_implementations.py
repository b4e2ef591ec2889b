"""Refit between a Transformer Engine trainer and a shadow on megatron's local layers.

The two name the fused norms differently (``models.layer_names``); the planner pairs tensors by
their local-layer names. TE is not installed here: a TE model is described (``fake_model``) or
stood in for by a local model with TE's parameter layout (``tests/helpers/te_layers.py``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
from megatron_rlhf.models.weights import gather_full_state, init_weights
from megatron_rlhf.refit import ModelLayout, build_weight_sync, plan_refit
from tests.helpers.te_layers import with_te_layout
from tests.model_fixtures import TinyArch, whole_world_groups
from tests.refit.fake_model import describe, simulate

L = ModelLayout
PAIRS = {
    "te tp2 -> local tp1xdp2": (L(0, tp=2), True, L(2, tp=1, dp=2), False),
    "te tp2pp2 -> local tp4": (L(0, tp=2, pp=2), True, L(4, tp=4), False),
    "te tp2xdp2 -> local tp4 same ranks": (L(0, tp=2, dp=2), True, L(0, tp=4), False),
    "local tp1 -> te tp2": (L(0, tp=1), False, L(1, tp=2), True),
}


@pytest.mark.parametrize("name", list(PAIRS))
def test_a_te_layout_and_a_local_one_pair_every_tensor(name: str) -> None:
    src_layout, src_te, dst_layout, dst_te = PAIRS[name]
    src, dst = describe(src_layout, te=src_te), describe(dst_layout, te=dst_te)
    plan = plan_refit(src, dst)
    simulate(plan, src, dst)  # every destination element received from the source's tensor
    fused = [t for t in plan.transfers if "layer_norm_" in (t.src_name if src_te else t.dst_name)]
    assert fused, "the fused norms are among the transfers"
    for t in fused:
        assert t.global_name.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight"))


def test_a_norm_left_under_its_te_name_has_no_source_and_is_named() -> None:
    """A TE description whose fused norm was not mapped: the plan fails on that tensor."""
    src = describe(L(0, tp=2), te=True)
    unmapped = []
    for rank_shards in src:
        params = tuple(dataclasses.replace(p, rule=dataclasses.replace(
            p.rule, global_name=p.rule.global_name.replace(
                "input_layernorm.", "self_attention.linear_qkv.layer_norm_")))
            for p in rank_shards.params)
        unmapped.append(dataclasses.replace(rank_shards, params=params))
    with pytest.raises(ValueError, match=r"destination parameter 'decoder\.layers\.0\."
                                         r"input_layernorm\.weight' .* has no source"):
        plan_refit(unmapped, describe(L(2, tp=1)))


@pytest.fixture(scope="module")
def pgc():
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return whole_world_groups(1, 1)


def test_a_te_trainer_refits_a_local_shadow(pgc) -> None:
    """The real sync (plan, megatron's executor, checks) from a TE-named model into a local one
    on one rank; every tensor, norms included, arrives."""
    arch = TinyArch(num_layers=2)
    trainer = with_te_layout(build_gpt_model(arch, ModelBuildOptions(), pgc))
    init_weights(trainer, pgc, seed=1)
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(torch.rand(param.shape, generator=torch.Generator().manual_seed(3)))
    shadow = build_gpt_model(arch, ModelBuildOptions(), pgc)
    init_weights(shadow, pgc, seed=2)
    sync = build_weight_sync(trainer, pgc, L(0), shadow, pgc, L(0), verify="every")
    assert any(t.src_name.endswith("linear_qkv.layer_norm_weight")
               and t.dst_name.endswith("input_layernorm.weight") for t in sync.plan.transfers)
    sync.sync()
    expected, got = gather_full_state(trainer, pgc), gather_full_state(shadow, pgc)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)
