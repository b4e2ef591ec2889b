"""Every preset on 1x8, 2x8, 4x8, 16x8 and a heterogeneous cluster; exact layouts; CPU sizes."""

from __future__ import annotations

import json
import random

import pytest

from megatron_rlhf.topology import (
    ClusterSpec,
    DevicePool,
    ParallelOverride,
    PlacementConfig,
    plan_placement,
)
from tests.topology.helpers import CLUSTERS, HETERO, check_invariants

PRESETS = ("flattening", "interleaving", "interleaving2", "separation", "hetero-separation")


def _ranges(plan) -> dict[str, tuple[int, int]]:
    return {role: (m.ranks.start, m.ranks.stop) for role, m in plan.models.items()}


@pytest.mark.parametrize("ac_share", [False, True], ids=["ac-nonshare", "ac-share"])
@pytest.mark.parametrize("strategy", PRESETS)
@pytest.mark.parametrize("cluster_name", sorted(CLUSTERS))
def test_every_preset_on_every_cluster(cluster_name: str, strategy: str, ac_share: bool) -> None:
    cluster = CLUSTERS[cluster_name]
    config = PlacementConfig(strategy, tp=4, ac_share=ac_share)
    if strategy == "hetero-separation" and not cluster.is_heterogeneous:
        with pytest.raises(ValueError, match="needs a cluster of at least 2 pools"):
            plan_placement(cluster, config, "llama-7b")
        return
    plan = plan_placement(cluster, config, "llama-7b")
    check_invariants(plan)
    expected = {"actor", "ref", "reward"} | (set() if ac_share else {"critic"})
    if config.separated:
        expected |= {"shadow_actor"} | (set() if ac_share else {"shadow_critic"})
    assert set(plan.roles) == expected
    assert json.loads(json.dumps(plan.to_dict())) == plan.to_dict()
    again = plan_placement(cluster, PlacementConfig(strategy, tp=4, ac_share=ac_share), "llama-7b")
    assert again.to_dict() == plan.to_dict()  # deterministic


def test_exact_layouts_on_16x8() -> None:
    cluster = CLUSTERS["16x8"]
    full, low, high = (0, 128), (0, 64), (64, 128)
    plans = {s: _ranges(plan_placement(cluster, PlacementConfig(s, tp=8), "llama-13b"))
             for s in PRESETS[:4]}
    assert plans["flattening"] == dict(actor=full, critic=full, ref=full, reward=full)
    assert plans["interleaving"] == dict(actor=full, critic=full, ref=low, reward=high)
    assert plans["interleaving2"] == dict(actor=low, critic=high, ref=low, reward=high)
    assert plans["separation"] == dict(actor=low, critic=low, ref=high, reward=high,
                                       shadow_actor=high, shadow_critic=high)


def test_hetero_separation_puts_inference_on_the_slow_pool() -> None:
    plan = plan_placement(HETERO, PlacementConfig("hetero-separation", tp=4), "llama-7b")
    assert _ranges(plan) == dict(actor=(0, 8), critic=(0, 8), ref=(8, 16), reward=(8, 16),
                                 shadow_actor=(8, 16), shadow_critic=(8, 16))
    assert plan.pools_of("shadow_actor") == (1,) and plan.pools_of("actor") == (0,)
    assert plan.to_dict()["models"]["ref"]["pools"] == ["V100-32GB"]
    named = PlacementConfig("hetero-separation", tp=4, train_pool="V100-32GB",
                            inference_pool="A100-80GB")
    assert _ranges(plan_placement(HETERO, named, "llama-7b"))["actor"] == (8, 16)


@pytest.mark.parametrize("devices,tp", [(4, 2), (4, 1), (2, 1)])
def test_cpu_sized_worlds(devices: int, tp: int) -> None:
    cluster = ClusterSpec.homogeneous(1, devices)
    half_a, half_b, full = (0, devices // 2), (devices // 2, devices), (0, devices)
    interleaving = plan_placement(cluster, PlacementConfig("interleaving", tp=tp), "tiny")
    assert _ranges(interleaving) == dict(actor=full, critic=full, ref=half_a, reward=half_b)
    separation = plan_placement(cluster, PlacementConfig("separation", tp=tp), "tiny")
    assert _ranges(separation) == dict(actor=half_a, critic=half_a, ref=half_b, reward=half_b,
                                       shadow_actor=half_b, shadow_critic=half_b)
    for plan in (interleaving, separation):
        check_invariants(plan)


def test_rounding_is_downwards_and_node_aware() -> None:
    three = plan_placement(ClusterSpec.homogeneous(3, 8), PlacementConfig("interleaving"), "tiny")
    assert _ranges(three)["ref"] == (0, 8) and _ranges(three)["reward"] == (8, 16)
    custom = PlacementConfig("custom", ratios=[1, 0.75, 0.25, 0.25])
    small = _ranges(plan_placement(ClusterSpec.homogeneous(1, 8), custom, "tiny"))
    # 6 devices do not divide an 8-device node: the critic gets the largest divisor, 4.
    assert small == dict(actor=(0, 8), critic=(0, 4), ref=(4, 6), reward=(6, 8))
    quarter = PlacementConfig("separation", train_fraction=0.25)
    assert _ranges(plan_placement(CLUSTERS["4x8"], quarter, "tiny"))["actor"] == (0, 8)
    wraps = PlacementConfig("custom", ratios=[1, 1, 0.5, 0.75])
    assert _ranges(plan_placement(CLUSTERS["4x8"], wraps, "tiny"))["reward"] == (0, 24)


def test_parallelism_defaults_and_overrides() -> None:
    config = PlacementConfig("separation", tp=4, pp=2,
                             parallel={"shadow_actor": ParallelOverride(tp=8),
                                       "critic": {"distributed_optimizer": False}})
    models = {"actor": "llama-13b", "critic": "llama-7b", "ref": "llama-13b",
              "reward": "llama-7b"}
    plan = plan_placement(CLUSTERS["4x8"], config, models)
    shadow, shadow_critic, actor = plan["shadow_actor"], plan["shadow_critic"], plan["actor"]
    assert (shadow.tp, shadow.pp, shadow.dp, shadow.spec.arch.name) == (8, 1, 2, "llama-13b")
    assert (shadow_critic.tp, shadow_critic.pp, shadow_critic.spec.arch.name) == (4, 1,
                                                                                  "llama-7b")
    assert (actor.tp, actor.pp, actor.dp, actor.spec.trainable) == (4, 2, 2, True)
    assert not plan["critic"].spec.distributed_optimizer and not plan["ref"].spec.trainable


def test_replica_and_leader_ranks_for_data_movement() -> None:
    plan = plan_placement(CLUSTERS["2x8"], PlacementConfig(tp=2, pp=2), "tiny")
    actor = plan["actor"]
    assert actor.dp == 4
    assert actor.replica_ranks(0) == [0, 1, 8, 9]
    assert actor.replica_ranks(3) == [6, 7, 14, 15]
    assert actor.leader_ranks("first") == [0, 2, 4, 6]
    assert actor.leader_ranks("last") == [8, 10, 12, 14]
    assert actor.embedding_ranks()[:3] == [[0, 8], [1, 9], [2, 10]]
    assert actor.position_embedding_ranks()[:3] == [[0], [1], [2]]
    assert plan.roles_on(9) == ("actor", "critic", "ref", "reward")
    with pytest.raises(ValueError, match=r"dp_rank 4 is outside \[0, 4\)"):
        actor.replica_ranks(4)


@pytest.mark.parametrize("strategy, expected", [
    ("flattening", {"actor": (0, 1024, 64), "critic": (0, 1024, 64), "ref": (0, 1024, 64),
                    "reward": (0, 1024, 64)}),
    ("interleaving", {"actor": (0, 1024, 64), "critic": (0, 1024, 64), "ref": (0, 512, 32),
                      "reward": (512, 1024, 32)}),
    ("interleaving2", {"actor": (0, 512, 32), "critic": (512, 1024, 32), "ref": (0, 512, 32),
                       "reward": (512, 1024, 32)}),
    ("separation", {"actor": (0, 512, 32), "critic": (0, 512, 32), "ref": (512, 1024, 32),
                    "reward": (512, 1024, 32), "shadow_actor": (512, 1024, 64),
                    "shadow_critic": (512, 1024, 64)}),
])
def test_planning_128x8_gives_exact_layouts(strategy: str, expected: dict) -> None:
    """1,024 ranks, tp=8 pp=2: each model's ranks and DP size (ranks / (tp x pp); the shadows
    generate with pp=1), and the invariants of every plan."""
    cluster = ClusterSpec.homogeneous(128, 8)
    plan = plan_placement(cluster, PlacementConfig(strategy, tp=8, pp=2), "llama-65b")
    assert {role: (m.ranks.start, m.ranks.stop, m.dp) for role, m in plan.models.items()} == (
        expected)
    for role, (start, stop, dp) in expected.items():
        pp = 1 if role.startswith("shadow") else 2
        assert (plan[role].tp, plan[role].pp, dp * 8 * pp) == (8, pp, stop - start)
    check_invariants(plan)


def test_random_requests_are_either_refused_or_sound() -> None:
    rng = random.Random(0)
    planned = 0
    for _ in range(400):
        pools = [DevicePool(f"kind{i}", rng.randint(1, 4), rng.choice([1, 2, 4, 6, 8]), 80,
                            rng.choice([0.5, 1.0])) for i in range(rng.choice([1, 1, 2]))]
        strategy = rng.choice(PRESETS + ("custom",))
        ratios = [rng.choice([1, 0.75, 0.5, 0.3, 0.25]) for _ in range(4)]
        config = PlacementConfig(strategy, ratios=ratios if strategy == "custom" else None,
                                 tp=rng.choice([1, 2, 4]), pp=rng.choice([1, 2]),
                                 ac_share=rng.random() < 0.3,
                                 train_fraction=rng.choice([0.25, 0.5, 0.75]))
        try:
            plan = plan_placement(ClusterSpec(pools), config, "small")
        except ValueError:
            continue
        check_invariants(plan)
        planned += 1
    assert planned > 100
