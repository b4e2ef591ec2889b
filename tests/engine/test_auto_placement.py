"""--placement auto: the planner's best placement that the engine accepts (no process group)."""

from __future__ import annotations

import pytest

from megatron_rlhf.config.ppo_run import RolloutConfig, RunConfig
from megatron_rlhf.engine.auto_placement import choose_placement
from megatron_rlhf.engine.build import make_plan
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


def test_auto_skips_candidates_whose_batches_do_not_split() -> None:
    cluster = ClusterSpec((DevicePool("A100-80GB", nodes=1, devices_per_node=4),))
    # 4 prompts split over DP=4 x micro-batch 2 nowhere: every candidate with dp > 2 is refused.
    small = RunConfig(rollout=RolloutConfig(prompts_per_step=4, micro_batch_size=2))
    chosen, _ = choose_placement(small, cluster)
    plan = make_plan(chosen, cluster)
    assert all(model.dp <= 2 for model in plan.models.values())


def test_a_pool_without_a_profile_is_refused_with_the_fix() -> None:
    cluster = ClusterSpec((DevicePool("local", nodes=1, devices_per_node=4),))
    with pytest.raises(ValueError, match="calibrate"):
        choose_placement(_config(), cluster)
