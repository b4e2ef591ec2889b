"""Which layers each placed model is built with: Transformer Engine for the models that never
decode with the KV cache, megatron's local layers for the ones that do (pure, no process group).

TE is not installed here; CUDA and an importable TE are stood in for where a case needs them.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.builder.sources import decoding_roles, role_options
from megatron_rlhf.config.ppo_run import GenerationConfig, ModelsConfig, RunConfig
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.models import gpt
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
from megatron_rlhf.topology.models import SHADOW_OF
from megatron_rlhf.topology.placement_config import PlacementConfig

TE, LOCAL = "transformer_engine", "local"
ONE_POOL = ClusterSpec.homogeneous(1, 4)
TWO_POOLS = ClusterSpec((DevicePool("fast", nodes=1, devices_per_node=2, relative_speed=1.0),
                         DevicePool("slow", nodes=1, devices_per_node=2, relative_speed=0.5)))
INFERENCE = {"ref": TE, "reward": TE}
CASES = {
    "flattening": (PlacementConfig(strategy="flattening"), ONE_POOL,
                   {"actor": LOCAL, "critic": TE, **INFERENCE}),
    "interleaving": (PlacementConfig(strategy="interleaving"), ONE_POOL,
                     {"actor": LOCAL, "critic": TE, **INFERENCE}),
    "separation": (PlacementConfig(strategy="separation"), ONE_POOL,
                   {"actor": TE, "shadow_actor": LOCAL, "critic": TE, "shadow_critic": TE,
                    **INFERENCE}),
    # the trainable actor generates too when it has no pipeline (as the engine does)
    "hetero-separation": (PlacementConfig(strategy="hetero-separation"), TWO_POOLS,
                          {"actor": LOCAL, "shadow_actor": LOCAL, "critic": TE,
                           "shadow_critic": TE, **INFERENCE}),
    "hetero-separation, actor pp=2": (
        PlacementConfig(strategy="hetero-separation", parallel={"actor": {"pp": 2}}), TWO_POOLS,
        {"actor": TE, "shadow_actor": LOCAL, "critic": TE, "shadow_critic": TE, **INFERENCE}),
}


def _layers(config: RunConfig, cluster: ClusterSpec) -> dict[str, str]:
    plan = make_plan(config, cluster)
    decoding = decoding_roles(config, plan)
    return {role: role_options(config, {}, SHADOW_OF.get(role, role),
                               decodes=role in decoding).transformer_impl
            for role in plan.models}


def _config(placement: PlacementConfig, impl: str = "auto", kv_cache: bool = True) -> RunConfig:
    return RunConfig(placement=placement, models=ModelsConfig(arch="tiny", transformer_impl=impl),
                     generation=GenerationConfig(use_kv_cache=kv_cache))


@pytest.fixture
def te_on_cuda(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt, "transformer_engine_importable", lambda: True)


@pytest.mark.parametrize("case", list(CASES))
def test_only_the_decoding_models_keep_the_local_layers(case: str, te_on_cuda) -> None:
    placement, cluster, expected = CASES[case]
    config = _config(placement)
    assert _layers(config, cluster) == expected
    assert set(_layers(_config(placement, kv_cache=False), cluster).values()) == {TE}
    assert set(_layers(_config(placement, impl=LOCAL), cluster).values()) == {LOCAL}


@pytest.mark.parametrize("case", list(CASES))
def test_without_te_on_cuda_every_model_is_local(case: str) -> None:
    placement, cluster, _ = CASES[case]
    assert set(_layers(_config(placement), cluster).values()) == {LOCAL}


def test_te_asked_for_a_decoding_model_is_refused_naming_the_fix(te_on_cuda) -> None:
    config = _config(PlacementConfig(strategy="separation"), impl=TE)
    plan = make_plan(config, ONE_POOL)
    assert role_options(config, {}, "actor", decodes=False).transformer_impl == TE
    assert "shadow_actor" in decoding_roles(config, plan)
    with pytest.raises(ValueError, match=r"cannot decode with the KV cache.*"
                                         r"models.transformer_impl=auto"):
        role_options(config, {}, "actor", decodes=True)
