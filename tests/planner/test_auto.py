"""Automatic placement: candidates, ranking, the reason the best wins."""

from __future__ import annotations

from megatron_rlhf.planner import (
    RolloutSpec,
    SearchSpace,
    auto_place,
    explain_choice,
    predict_step,
)
from megatron_rlhf.planner.hardware import homogeneous_cluster
from megatron_rlhf.planner.search import candidate_configs, describe, parallel_sizes
from megatron_rlhf.topology import ClusterSpec, DevicePool, arch_preset, plan_placement

ROLLOUT = RolloutSpec(batch=256, prompt_length=128, generation_length=128)


def test_parallel_sizes_divide_nodes_heads_and_layers() -> None:
    cluster = homogeneous_cluster("A100-80GB", 2, 8)
    tps, pps = parallel_sizes(cluster, [arch_preset("llama-33b")], SearchSpace())
    assert tps == [1, 2, 4]                  # 52 heads: no tp=8
    assert pps == [1, 2, 3, 4, 5, 6]         # divisors of 60 up to max_pp=8


def test_candidates_cover_presets_ratio_grid_and_separation_splits() -> None:
    cluster = homogeneous_cluster("A100-80GB", 4, 8)
    space = SearchSpace(tps=(2, 4), pps=(1,))
    configs = candidate_configs(cluster, arch_preset("llama-7b"), space)
    labels = {describe(plan_placement(cluster, config, "llama-7b")) for config in configs}
    for expected in ("flattening tp=4 pp=1", "interleaving2 tp=2 pp=1",
                     "custom[1, 1, 0.25, 0.25] tp=4 pp=1",
                     "separation(8/32 train) tp=4 pp=1 shadow_tp=2",
                     "separation(24/32 train) tp=2 pp=1 shadow_tp=4"):
        assert expected in labels
    assert len(configs) == 2 * (3 + 4 + 3 * 2) and not any(c.strategy.startswith("hetero")
                                                           for c in configs)


def test_a_critic_free_search_prices_three_models() -> None:
    cluster = homogeneous_cluster("A100-80GB", 4, 8)
    space = SearchSpace(tps=(4,), pps=(1,), critic=False)
    configs = candidate_configs(cluster, arch_preset("llama-7b"), space)
    assert {c.strategy for c in configs} == {"flattening", "interleaving", "custom", "separation"}
    assert [c.ratios for c in configs if c.strategy == "custom"] == [
        [1.0, 0.25, 0.25], [1.0, 0.5, 0.25], [1.0, 0.25, 0.5], [0.5, 0.25, 0.25]]
    ranked = auto_place(cluster, "llama-7b", ROLLOUT, space=space)
    assert ranked and all(set(c.plan.models) <= {"actor", "ref", "reward", "shadow_actor"}
                          for c in ranked)
    with_critic = auto_place(cluster, "llama-7b", ROLLOUT, space=SearchSpace(tps=(4,), pps=(1,)))
    best = {c.label: c.prediction.step_seconds for c in with_critic}
    flat = next(c for c in ranked if c.label == "flattening tp=4 pp=1")
    assert flat.prediction.step_seconds < best["flattening tp=4 pp=1"]


def test_auto_place_ranks_by_samples_per_second_and_explains() -> None:
    cluster = homogeneous_cluster("A100-80GB", 2, 8)
    ranked = auto_place(cluster, "llama-7b", ROLLOUT, space=SearchSpace(tps=(2, 4), pps=(1,)))
    rates = [c.prediction.samples_per_s for c in ranked]
    assert rates == sorted(rates, reverse=True) and ranked[0].rank == 1
    assert len({c.label for c in ranked}) == len(ranked)
    assert {c.config.strategy for c in ranked} >= {"flattening", "separation", "custom"}
    reason = explain_choice(ranked)
    assert reason.startswith(f"{ranked[0].label} wins") and "bottleneck" in reason
    assert ranked[0].to_dict()["placement"]["strategy"] == ranked[0].config.strategy


def test_auto_place_tries_hetero_separation_on_two_pools() -> None:
    cluster = ClusterSpec((DevicePool("A100-80GB", 1, 8, relative_speed=1.0),
                           DevicePool("V100-32GB", 2, 4, memory_gib=32, relative_speed=0.4)))
    space = SearchSpace(strategies=("hetero-separation",), tps=(2, 4), pps=(1, 2))
    ranked = auto_place(cluster, "llama-7b", ROLLOUT, space=space)
    assert ranked and all(c.config.strategy == "hetero-separation" for c in ranked)
    # Trained tp x pp x the shadows' tp: eight distinct layouts, so the choice is a real one.
    assert len({c.label for c in ranked}) == len(ranked) == 8
    # The winner, found without auto_place: plan and predict every candidate, keep the fastest.
    predicted = {}
    for config in candidate_configs(cluster, arch_preset("llama-7b"), space):
        plan = plan_placement(cluster, config, "llama-7b")
        prediction = predict_step(plan, ROLLOUT)
        if prediction.feasible:
            predicted[describe(plan)] = prediction.samples_per_s
    assert set(predicted) == {c.label for c in ranked}
    assert ranked[0].label == max(predicted, key=predicted.get)
    assert [c.label for c in ranked] == sorted(predicted, key=predicted.get, reverse=True)


def test_nothing_fits_is_explained() -> None:
    cluster = homogeneous_cluster("V100-32GB", 1, 4)
    ranked = auto_place(cluster, "llama-65b", ROLLOUT, space=SearchSpace(tps=(4,), pps=(1,)))
    assert explain_choice(ranked).startswith("no candidate")
