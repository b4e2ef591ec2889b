"""--placement auto: the planner's best placement that the engine accepts (no process group)."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlhf.config.ppo_run import RolloutConfig, RunConfig
from megatron_rlhf.engine.run.auto_placement import choose_placement
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
from megatron_rlhf.topology.placement_config import PlacementConfig


def _config() -> RunConfig:
    return RunConfig(placement=PlacementConfig(ac_share=True),
                     rollout=RolloutConfig(prompts_per_step=16, micro_batch_size=2))


def test_auto_picks_a_placement_the_engine_accepts() -> None:
    cluster = ClusterSpec((DevicePool("A100-80GB", nodes=1, devices_per_node=4),))
    chosen, reason = choose_placement(_config(), cluster)
    plan = make_plan(chosen, cluster)
    assert chosen.placement.ac_share and "critic" not in plan.roles
    assert chosen.placement.strategy in reason or "custom" in reason
    assert "samples/s" in reason


def test_auto_picks_the_fastest_predicted_placement_the_engine_accepts() -> None:
    """The winner is the feasible candidate of highest predicted samples/s among those the
    engine can build, priced as the run steps (synchronously here: no overlap of consecutive
    steps), and there was a choice to make."""
    from megatron_rlhf.engine.run.auto_placement import ENGINE_MEMORY_OPTIONS, with_memory_options
    from megatron_rlhf.planner import RolloutSpec, SearchSpace, auto_place
    from megatron_rlhf.topology.models import resolve_arch

    cluster = ClusterSpec((DevicePool("A100-80GB", nodes=1, devices_per_node=4),))
    config = _config()
    assert not config.rollout.async_rollout
    chosen, _ = choose_placement(config, cluster)
    ranked = auto_place(cluster, resolve_arch(config.models.arch),
                        RolloutSpec.from_run_config(config, overlap=False), None,
                        SearchSpace(critic=config.placement.critic,
                                    memory_options=ENGINE_MEMORY_OPTIONS))
    accepted = []
    for candidate in ranked:
        if not candidate.prediction.feasible:
            continue
        placement = dataclasses.replace(candidate.config, ac_share=True)
        try:
            make_plan(with_memory_options(dataclasses.replace(config, placement=placement),
                                          candidate.prediction.memory.options), cluster)
        except ValueError:
            continue
        accepted.append((placement, candidate.prediction.samples_per_s))
    speeds = [speed for _, speed in accepted]
    assert len(set(speeds)) > 1, "candidates of different speeds to choose from"
    assert max(speed for placement, speed in accepted if placement == chosen.placement) == max(
        speeds)


def test_auto_skips_candidates_whose_batches_do_not_split() -> None:
    cluster = ClusterSpec((DevicePool("A100-80GB", nodes=1, devices_per_node=4),))
    # 4 prompts split over DP=4 x micro-batch 2 nowhere: every candidate with dp > 2 is refused.
    small = RunConfig(rollout=RolloutConfig(prompts_per_step=4, micro_batch_size=2))
    chosen, _ = choose_placement(small, cluster)
    plan = make_plan(chosen, cluster)
    assert all(model.dp <= 2 for model in plan.models.values())


def test_a_pool_without_a_profile_is_refused_with_the_fix() -> None:
    cluster = ClusterSpec((DevicePool("MI300X", nodes=1, devices_per_node=4),))
    with pytest.raises(ValueError, match=r"pool 'MI300X' has no hardware profile: .*--profile "
                                         r"NAME\|PATH.*calibrate"):
        choose_placement(_config(), cluster)


def test_memory_options_fill_only_the_roles_the_config_leaves_unset() -> None:
    from megatron_rlhf.config.ppo_run import ModelsConfig
    from megatron_rlhf.engine.run.auto_placement import with_memory_options
    from megatron_rlhf.planner import MemoryOptions

    options = {"actor": MemoryOptions("distributed_optimizer", recompute=True, offload=True),
               "critic": MemoryOptions("fsdp", recompute=False, offload=False),
               "ref": MemoryOptions(offload=True),
               "shadow_actor": MemoryOptions(offload=True)}
    config = with_memory_options(RunConfig(models=ModelsConfig(offload={"ref": "never"})), options)
    assert config.models.offload == {"actor": "always", "ref": "never"}
    assert config.models.recompute == {"actor": "full"}
    assert config.models.offload_policy("shadow_actor") == "always"  # follows the actor
    assert (config.actor_optimizer.fsdp, config.critic_optimizer.fsdp) == (False, True)


def test_the_planners_host_optimizer_becomes_cpu_offload_fraction() -> None:
    from megatron_rlhf.engine.run.auto_placement import with_memory_options
    from megatron_rlhf.planner import MemoryOptions

    hosted = MemoryOptions("distributed_optimizer", offload=True, optimizer_offload=True)
    config = with_memory_options(RunConfig(), {"actor": hosted,
                                               "critic": MemoryOptions("distributed_optimizer"),
                                               "ref": MemoryOptions(offload=True)})
    assert config.actor_optimizer.cpu_offload_fraction == 1.0
    assert config.critic_optimizer.cpu_offload_fraction == 0.0
    assert config.models.offload == {"actor": "always", "ref": "always"}


def test_auto_runs_a_33b_model_on_one_node_with_the_options_the_planner_needed() -> None:
    # LLaMA-33B PPO on 8 A100-80GB fits only with offloading (docs/planner.md's table).
    from megatron_rlhf.planner import RolloutSpec, load_profile, plan_memory
    from megatron_rlhf.planner.memory_fit import base_options

    cluster = ClusterSpec((DevicePool("A100-80GB", nodes=1, devices_per_node=8),))
    config = RunConfig(rollout=RolloutConfig(prompts_per_step=64, micro_batch_size=2))
    config = dataclasses.replace(
        config, models=dataclasses.replace(config.models, arch="llama-33b"))
    chosen, _ = choose_placement(config, cluster)
    plan = make_plan(chosen, cluster)
    assert any(chosen.models.offload_policy(role) == "always" for role in plan.roles)
    assert set(chosen.models.recompute) <= {"actor", "critic"}
    # The engine is given what the planner needed: the plan with exactly these options fits,
    # and without them it does not.
    rollout = RolloutSpec.from_run_config(chosen)
    given = {role: dataclasses.replace(
        base_options(plan[role], rollout),
        offload=chosen.models.offload_policy(role) == "always",
        recompute=chosen.models.recompute_of(role) == "full") for role in plan.roles}
    assert all(options.sharding != "fsdp" for options in given.values())
    profiles = (load_profile("A100-80GB"),)
    assert not plan_memory(plan, rollout, profiles, given).problems
    assert plan_memory(plan, rollout, profiles).problems
