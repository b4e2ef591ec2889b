"""With LoRA on the actor its base is the reference: no reference model is placed or built.

``RunConfig`` sets ``placement.reference=false`` from ``models.lora``, as it sets
``placement.reward`` from ``reward.model_weight``; every placement then plans the other models
alone (the multi-rank runs in ``test_lora_ppo.py`` show that nothing builds a reference model and
that the metrics stay those of a run that builds one), and a ratio list keeps its length with its
ref entry unused.
"""

from __future__ import annotations

import pytest

from megatron_rlhf.algorithms import PPOAlgorithmConfig
from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.models.options import LoRAConfig
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
from megatron_rlhf.topology.placement_config import PlacementConfig

HETERO = ClusterSpec((DevicePool("fast", nodes=1, devices_per_node=2, relative_speed=1.0),
                      DevicePool("slow", nodes=1, devices_per_node=2, relative_speed=0.5)))


def _run_config(estimator: str = "gae", lora: LoRAConfig | None = None,
                model_weight: float = 1.0, **changes) -> RunConfig:
    return RunConfig(algorithm=PPOAlgorithmConfig(advantage_estimator=estimator),
                     rollout=changes.pop("rollout", RolloutConfig(samples_per_prompt=2)),
                     reward=RewardConfig(model_weight=model_weight, rule="synthetic"),
                     models=ModelsConfig(lora=LoRAConfig(rank=4) if lora is None else lora),
                     **changes)


@pytest.mark.parametrize("estimator, trained", [("gae", ["actor", "critic"]), ("grpo", ["actor"])])
@pytest.mark.parametrize("strategy", ["flattening", "interleaving", "interleaving2", "separation",
                                      "async-separation", "hetero-separation"])
@pytest.mark.parametrize("model_weight", [1.0, 0.0])
def test_every_placement_plans_no_reference_model(strategy: str, estimator: str,
                                                  trained: list[str], model_weight: float) -> None:
    if strategy == "interleaving2" and estimator == "grpo":
        pytest.skip("interleaving2 trains actor || critic: refused without a critic")
    config = _run_config(estimator, model_weight=model_weight, placement=PlacementConfig(
        "separation" if strategy == "async-separation" else strategy),
        rollout=RolloutConfig(samples_per_prompt=2,
                              async_rollout=strategy == "async-separation"))
    assert not config.placement.reference
    cluster = HETERO if strategy == "hetero-separation" else ClusterSpec.homogeneous(1, 4)
    plan = make_plan(config, cluster)
    shadows = [f"shadow_{role}" for role in trained] if config.placement.separated else []
    reward = ["reward"] if model_weight else []
    assert sorted(plan.models) == sorted([*trained, *reward, *shadows])
    assert plan.to_dict()["placement"]["reference"] is False
    full = make_plan(_run_config(estimator, lora=LoRAConfig(), model_weight=model_weight,
                                 placement=PlacementConfig(config.placement.strategy),
                                 rollout=config.rollout), cluster)
    assert set(full.models) - set(plan.models) == {"ref"}


def test_a_critic_with_adapters_keeps_the_reference_model() -> None:
    config = _run_config(lora=LoRAConfig(rank=4, roles=["critic"]))
    assert config.placement.reference
    assert "ref" in make_plan(config, ClusterSpec.homogeneous(1, 2)).models


def test_a_ratio_list_keeps_its_length_and_its_ref_entry_is_unused() -> None:
    cluster = ClusterSpec.homogeneous(1, 4)
    ppo = make_plan(_run_config(placement=PlacementConfig("custom", ratios=[1, 1, 0.5, 0.5])),
                    cluster)
    grpo = make_plan(_run_config("grpo", model_weight=0.0,
                                 placement=PlacementConfig("custom", ratios=[0.5, 0.25, 0.25])),
                     cluster)
    ranges = {role: (m.ranks.start, m.ranks.stop) for role, m in ppo.models.items()}
    assert ranges == {"actor": (0, 4), "critic": (0, 4), "reward": (0, 2)}
    assert {role: m.size for role, m in grpo.models.items()} == {"actor": 2}


@pytest.mark.parametrize("changes, message", [
    ({"placement": PlacementConfig(parallel={"ref": {"tp": 1}})},
     r"placement.parallel\['ref'\] is set, but this run places no reference model .*drop it"),
    ({"placement": PlacementConfig(reference=False), "lora": LoRAConfig()},
     r"placement.reference=false places no reference model, which only LoRA on the actor can "
     r"spare .* set models.lora.rank > 0"),
])
def test_reference_model_options_without_one_are_refused(changes: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _run_config(**changes)
