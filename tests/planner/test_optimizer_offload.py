"""Optimizer CPU offload: the Adam state leaves the device for the host, where the node's host
memory bounds it, and each optimizer step pays the PCIe copies and the host's Adam."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlhf.planner import (
    MemoryOptions,
    RolloutSpec,
    SearchSpace,
    auto_place,
    homogeneous_cluster,
    load_profile,
    predict_step,
)
from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.planner.memory_fit import (
    engine_runs_optimizer_offload,
    option_menu,
    plan_memory,
)
from megatron_rlhf.planner.paper import PAPER_ROLLOUT
from megatron_rlhf.topology import PlacementConfig, arch_preset, plan_placement
from tests.planner.helpers import ROUND

GIB = 1024**3
A100 = load_profile("A100-80GB")
BIG_HOST = dataclasses.replace(A100, host_memory_gib=4096.0)
ROLLOUT = RolloutSpec(batch=256, prompt_length=256, generation_length=256)
# llama-65b at tp=8: the actor's and ref's parameters, and the critic's and reward's (a value
# head instead of the output layer).
POLICY, VALUE = 65_300_865_024, 65_032_437_760


def _plan_65b():
    return plan_placement(homogeneous_cluster("A100-80GB", 1, 8), PlacementConfig(tp=8),
                          "llama-65b")


def test_the_adam_state_moves_to_the_host_and_the_host_bounds_it() -> None:
    plan = _plan_65b()
    assert (plan["actor"].spec.num_params(), plan["critic"].spec.num_params()) == (POLICY, VALUE)
    trainer = MemoryOptions(cm.DISTRIBUTED_OPTIMIZER, offload=True, optimizer_offload=True)
    options = {"actor": trainer, "critic": trainer, "ref": MemoryOptions(offload=True),
               "reward": MemoryOptions(offload=True)}
    report = plan_memory(plan, ROLLOUT, (BIG_HOST,), options)
    assert not report.problems
    actor = report.roles["actor"]
    # On the device: bf16 weights (2 N / 8 = 15.20 GiB), fp32 gradients (30.41 GiB), no Adam.
    assert (actor.weights, actor.grads, actor.optimizer) == pytest.approx((15.204, 30.408, 0.0),
                                                                          abs=1e-3)
    # On the host, per device: the offloaded trainers' 6 N / 8 and their optimizers' 16 N / 8
    # (master weights, moments, pinned gradients), ref's and reward's 2 N / 8; 8 devices:
    # 24 (65.30e9 + 65.03e9) bytes = 2913.1 GiB.
    assert report.host_gib == pytest.approx(24 * (POLICY + VALUE) / GIB)
    assert report.host_gib == pytest.approx(2913.1, abs=0.1)
    tight = plan_memory(plan, ROLLOUT, (A100,), options)
    assert tight.problems == ["node 0: the states offloaded to its host need 2913 GiB, more "
                              "than the 1843 GiB usable of its host memory: give the models "
                              "more nodes"]


def test_an_optimizer_step_on_the_host_pays_the_copies_and_the_host_adam() -> None:
    # 1e9 parameters: 4 + 2 bytes each over 10 GB/s of PCIe, then 1e9 updates at 1e9/s.
    assert cm.optimizer_offload_seconds(1e9, ROUND) == pytest.approx(0.6 + 1.0)
    arch = arch_preset("llama-7b")
    link = cm.Link(100e9, 0.0)
    env = cm.ModelEnv(arch, 1, 1, 1, False, ROUND, link, link, link)
    hosted = dataclasses.replace(env, optimizer_offload=True)
    plain = cm.training_cost(env, 64, 512, 4, 1, False)
    moved = cm.training_cost(hosted, 64, 512, 4, 1, False)
    params = env.params
    # The device's Adam update (32 bytes per parameter at 1 TB/s) leaves, the host's comes in.
    assert plain.memory == pytest.approx(32 * params / 1e12)
    assert (moved.memory, moved.offload) == pytest.approx((0.0, 1.6 * params / 1e9))
    assert (moved.compute, moved.comm) == (plain.compute, plain.comm)


def test_the_training_stage_prices_the_host_optimizer() -> None:
    plan = _plan_65b()
    prediction = predict_step(plan, ROLLOUT, BIG_HOST)
    assert prediction.feasible
    assert prediction.memory.options["actor"].label == (
        "distributed_optimizer+offload+optimizer_offload")
    task = {t["name"]: t for t in prediction.tasks}["training:actor"]
    shard = POLICY / 8
    # 1 PPO epoch, 1 mini-batch: one optimizer step, 6 * 8.16e9 bytes over 32 GB/s x 0.7 and
    # 8.16e9 updates at 1e9/s (10.35 s), and the 6 N / 8 device states copied in and out
    # (4.37 s): 14.72 s.
    step = 6 * shard / 22.4e9 + shard / 1e9
    assert step == pytest.approx(10.349, abs=1e-3)
    assert task["offload_s"] == pytest.approx(step + 2 * 6 * shard / 22.4e9, rel=1e-3)
    assert task["offload_s"] == pytest.approx(14.722, abs=1e-3)


def test_it_is_offered_only_where_the_engine_runs_it() -> None:
    plan = _plan_65b()
    assert engine_runs_optimizer_offload(plan, "actor", (A100,))
    assert not engine_runs_optimizer_offload(plan, "ref", (A100,))
    unknown_host = dataclasses.replace(A100, host_memory_gib=0.0)
    assert not engine_runs_optimizer_offload(plan, "actor", (unknown_host,))
    ddp = plan_placement(homogeneous_cluster("A100-80GB", 2, 8),
                         PlacementConfig(tp=8, distributed_optimizer=False), "llama-65b")
    assert not engine_runs_optimizer_offload(ddp, "actor", (A100,))
    menu = option_menu(plan["actor"], ROLLOUT, fsdp=True, optimizer_offload=True)
    hosted = [o for o in menu if o.optimizer_offload]
    assert len(hosted) == 4 and {o.sharding for o in hosted} == {cm.DISTRIBUTED_OPTIMIZER}
    assert menu[-1] == MemoryOptions(cm.FULLY_SHARDED, recompute=True)
    assert hosted[-1] == MemoryOptions(cm.DISTRIBUTED_OPTIMIZER, True, True, True)


def test_a_placement_needing_a_host_optimizer_ranks_after_those_that_fit_without() -> None:
    # llama-13b, interleaving2 on one node: tp=2 fits only with the trainers' optimizers on the
    # host, and is predicted faster than tp=4, which fits without; tp=4 still wins.
    ranked = auto_place(homogeneous_cluster("A100-80GB", 1, 8), "llama-13b", PAPER_ROLLOUT,
                        space=SearchSpace(strategies=("interleaving2",)))
    feasible = [c for c in ranked if c.prediction.feasible]
    hosted = [c for c in feasible
              if any(o.optimizer_offload for o in c.prediction.memory.options.values())]
    assert hosted and feasible[-len(hosted):] == hosted
    assert feasible[0].label == "interleaving2 tp=4 pp=1"
    assert hosted[0].label == "interleaving2 tp=2 pp=1"
    assert hosted[0].prediction.samples_per_s > feasible[0].prediction.samples_per_s
