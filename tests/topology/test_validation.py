"""Every invalid request is refused before any process group, naming the field and a fix."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlhf.topology import (
    ClusterSpec,
    ParallelOverride,
    PlacementConfig,
    PlacementPlan,
    plan_placement,
    validate_plan,
)
from tests.topology.helpers import CLUSTERS, HETERO

ONE_BY_FOUR = ClusterSpec.homogeneous(1, 4)


@pytest.mark.parametrize("kwargs,message", [
    (dict(strategy="zigzag"), "placement.strategy='zigzag' is unknown: choose one of"),
    (dict(strategy="interleaving", ratios=[1, 1, 1, 1]), "set strategy='custom' or drop"),
    (dict(strategy="custom"), r"must give 4 ratios for \['actor', 'critic', 'ref', 'reward'\]"),
    (dict(strategy="custom", ratios=[1, 1, 0, 1]), r"ref ratio 0 must be in \(0, 1\]"),
    (dict(strategy="custom", ratios=[1.5, 1, 1, 1]), r"actor ratio 1.5 must be in \(0, 1\]"),
    (dict(train_fraction=1.0), r"placement.train_fraction=1.0 must be in \(0, 1\)"),
    (dict(tp=0), "placement.tp=0 must be an integer >= 1"),
    (dict(parallel={"judge": ParallelOverride(tp=2)}), r"unknown roles \['judge'\]"),
    (dict(parallel={"ref": {"dp": 2}}), r"placement.parallel\['ref'\] has unknown keys \['dp'\]"),
    (dict(inference_pool="V100-32GB"), "only apply to strategy='hetero-separation'"),
])
def test_config_refusals(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        PlacementConfig(**kwargs)


@pytest.mark.parametrize("cluster,config,models,message", [
    (CLUSTERS["1x8"], PlacementConfig("custom", ratios=[1, 1, 0.1, 0.5]), "tiny",
     r"placement.ratios gives ref ratio 0.1 of the 8 devices of region 'cluster', which rounds "
     r"to zero devices: raise the ratio to at least 0.125"),
    (ClusterSpec.homogeneous(1, 1), PlacementConfig("interleaving"), "tiny",
     r"placement.strategy='interleaving' places ref on 0.5 of the devices, which rounds to zero "
     r"on this cluster's 1: interleaving needs at least 2 devices; add ranks or use "
     r"placement.strategy='flattening'"),
    (ONE_BY_FOUR, PlacementConfig(tp=4, pp=2), "tiny",
     r"actor needs tp\*pp = 4\*2 = 8 devices but the cluster has 4: lower actor.tp or actor.pp"),
    (CLUSTERS["16x8"], PlacementConfig(tp=16), "llama-65b",
     r"actor.tp\(16\) does not divide devices_per_node\(8\) of pool 'A100-80GB': choose tp in "
     r"\{1,2,4,8\}"),
    (ClusterSpec.homogeneous(2, 6), PlacementConfig(tp=4), "tiny",
     r"actor.tp\(4\) does not divide devices_per_node\(6\) .*choose tp in \{1,2,3,6\}"),
    (HETERO, PlacementConfig(tp=8), "llama-7b",
     r"actor.tp\(8\) does not divide devices_per_node\(4\) of pool 'V100-32GB'"),
    (CLUSTERS["1x8"], PlacementConfig(tp=8), "tiny",
     r"actor.tp\(8\) does not divide num_attention_heads\(4\) of 'tiny': choose tp in \{1,2,4\}"),
    (CLUSTERS["1x8"], PlacementConfig(pp=3), "small",
     r"actor.pp\(3\) does not divide num_layers\(4\) of 'small': choose pp in \{1,2,4\}"),
    (ONE_BY_FOUR, PlacementConfig("interleaving", tp=4), "tiny",
     r"ref is placed on 2 devices \(ratio 0.5 of placement.strategy='interleaving'\), not a "
     r"multiple of tp\*pp = 4\*1 = 4: .* or choose another placement.strategy"),
    (ClusterSpec.homogeneous(1, 1), PlacementConfig("separation"), "tiny",
     "'separation' needs at least 2 devices"),
    (CLUSTERS["2x8"], PlacementConfig("hetero-separation"), "tiny",
     "needs a cluster of at least 2 pools, this one has only 'A100-80GB'"),
    (HETERO, PlacementConfig("hetero-separation", train_pool="A100-80GB",
                             inference_pool="A100-80GB"), "tiny",
     "train_pool and inference_pool are both 'A100-80GB'"),
    (HETERO, PlacementConfig("hetero-separation", inference_pool="H100"), "tiny",
     "no pool of kind 'H100'"),
    (CLUSTERS["1x8"], PlacementConfig(), {"actor": "tiny", "ref": "tiny", "reward": "tiny"},
     r"lacks an architecture for \['critic'\].*ac_share=True"),
    (CLUSTERS["1x8"], PlacementConfig(), {"actor": "tiny", "critic": "tiny", "ref": "tiny",
                                          "reward": "tiny", "shadow_actor": "tiny"},
     r"unknown roles \['shadow_actor'\]"),
])
def test_plan_refusals(cluster: ClusterSpec, config: PlacementConfig, models: object,
                       message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_placement(cluster, config, models)


def test_memory_refusals_name_the_pool() -> None:
    # Without the distributed optimizer nothing moves to the host: 18 bytes per parameter over
    # 8 devices, 18 * 65.30e9 / 8 bytes = 136.8 GiB.
    with pytest.raises(ValueError, match=r"actor needs ~136.8 GiB per device \(weights, grads "
                                         r"and Adam state, fully sharded over dp of 65.\d+B "
                                         r"params .*pool 'A100-80GB' has 80 GiB: give it more "
                                         r"devices"):
        plan_placement(CLUSTERS["1x8"], PlacementConfig(tp=8, distributed_optimizer=False),
                       "llama-65b")
    # With it, the optimizer may go to the host, leaving 6 bytes per parameter on the device:
    # 6 * 65.30e9 / 8 bytes = 45.6 GiB fit on one node, 91.2 GiB over 4 devices do not.
    assert plan_placement(CLUSTERS["1x8"], PlacementConfig(tp=8), "llama-65b")["actor"].dp == 1
    with pytest.raises(ValueError, match=r"actor needs ~91.2 GiB per device \(weights, grads "
                                         r"and Adam state, fully sharded over dp, or weights "
                                         r"and grads with the optimizer on the host of 65"):
        plan_placement(ONE_BY_FOUR, PlacementConfig(tp=4), "llama-65b")
    # Over 16 devices fully sharded it needs 68.4 GiB: the placement leaves the choice of
    # sharding (and whether it fits next to the other models) to the planner.
    no_zero = PlacementConfig(tp=8, distributed_optimizer=False)
    assert plan_placement(CLUSTERS["2x8"], no_zero, "llama-65b")["actor"].dp == 2
    big_reward = PlacementConfig("hetero-separation", tp=4, ac_share=True,
                                 parallel={"reward": ParallelOverride(tp=2)})
    models = {"actor": "llama-7b", "ref": "llama-7b", "reward": "llama-65b"}
    with pytest.raises(ValueError, match=r"reward needs ~\d+\.\d GiB per device \(weights of "
                                         r".*pool 'V100-32GB' has 32 GiB"):
        plan_placement(HETERO, big_reward, models)
    big_reward.parallel.clear()
    plan = plan_placement(HETERO, big_reward, models)  # tp=4 fits a 32 GiB V100
    assert plan["reward"].spec.gib_per_device(plan["reward"].dp) < 32


def _moved(plan: PlacementPlan, role: str, **changes: int) -> PlacementPlan:
    models = dict(plan.models)
    models[role] = dataclasses.replace(models[role], **changes)
    return dataclasses.replace(plan, models=models)


def test_hand_built_plans_are_checked_too() -> None:
    plan = plan_placement(CLUSTERS["2x8"], PlacementConfig("interleaving", tp=2), "tiny")
    validate_plan(plan)
    with pytest.raises(ValueError, match=r"placement 'interleaving' runs ref and reward side by "
                                         r"side, but ref ranks \[0, 8\) and reward ranks \[4, 8\) "
                                         r"overlap"):
        validate_plan(_moved(plan, "reward", rank_offset=4, size=4))
    with pytest.raises(ValueError, match=r"reward ranks \[4, 12\) straddle nodes 0..1"):
        validate_plan(_moved(plan, "reward", rank_offset=4))
    with pytest.raises(ValueError, match=r"ref ranks \[12, 20\) ask for devices outside the "
                                         r"cluster's \[0, 16\)"):
        validate_plan(_moved(plan, "ref", rank_offset=12))
    with pytest.raises(ValueError, match=r"plan places .* with ac_share=False places"):
        validate_plan(dataclasses.replace(plan, models={"actor": plan["actor"]}))
    separated = plan_placement(CLUSTERS["2x8"], PlacementConfig("separation", tp=2), "tiny")
    with pytest.raises(ValueError, match="runs actor and ref side by side"):
        validate_plan(_moved(separated, "ref", rank_offset=0))
