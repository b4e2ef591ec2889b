"""Whole-step predictions: overlap per strategy, memory decisions, infeasible plans."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from megatron_rlhf.planner import RoleMemory, RolloutSpec, homogeneous_cluster, predict_step
from megatron_rlhf.topology import (
    ClusterSpec,
    DevicePool,
    PlacementConfig,
    arch_preset,
    plan_placement,
)

A100_1X8 = homogeneous_cluster("A100-80GB", 1, 8)
ROLLOUT = RolloutSpec(batch=256, prompt_length=256, generation_length=256)


def _predict(strategy: str, model: str = "llama-7b", cluster: ClusterSpec = A100_1X8,
             rollout: RolloutSpec = ROLLOUT, **config):
    plan = plan_placement(cluster, PlacementConfig(strategy, **config), model)
    return predict_step(plan, rollout)


def _tasks(prediction) -> dict[str, dict]:
    return {task["name"]: task for task in prediction.tasks}


def test_flattening_runs_every_model_in_turn() -> None:
    p = _predict("flattening", tp=2)
    tasks = _tasks(p)
    assert p.feasible and not p.pipelined and p.bottleneck in ("compute", "generation")
    assert p.samples_per_s == pytest.approx(ROLLOUT.batch / p.step_seconds)
    assert tasks["experience:reward"]["start_s"] >= (
        tasks["experience:ref"]["start_s"] + tasks["experience:ref"]["seconds"])
    assert set(p.stage_seconds) == {"generation", "experience", "training", "transfer", "sync"}
    assert p.stage_seconds["sync"] == 0.0
    json.dumps(p.to_dict(), allow_nan=False)


def test_interleaving_runs_ref_and_reward_side_by_side() -> None:
    tasks = _tasks(_predict("interleaving", tp=2))
    assert tasks["experience:ref"]["start_s"] == tasks["experience:reward"]["start_s"]


def test_interleaving2_trains_actor_and_critic_side_by_side() -> None:
    tasks = _tasks(_predict("interleaving2", tp=2))
    assert tasks["training:actor"]["start_s"] == tasks["training:critic"]["start_s"]


def test_separation_overlaps_generation_with_training() -> None:
    p = _predict("separation", tp=2)
    assert p.pipelined and "sync:actor->shadow_actor" in _tasks(p)
    assert p.step_seconds < p.synchronous_step_seconds
    sync = _predict("separation", tp=2, rollout=RolloutSpec(batch=256, overlap=False))
    assert not sync.pipelined and sync.step_seconds == pytest.approx(sync.synchronous_step_seconds)


def _states_gib(role: str, tp: int, dp: int) -> float:
    """Hand count for llama-7b: bf16 weights; trainers add fp32 grads and 12 bytes of Adam state
    over dp (distributed optimizer)."""
    arch = arch_preset("llama-7b")
    params = arch.num_params(tp, value_head=role in ("critic", "reward")) / tp
    per_param = 2 + 4 + 12 / dp if role in ("actor", "critic") else 2
    return per_param * params / 2**30


def test_the_cheapest_option_that_fits_is_chosen() -> None:
    # llama-7b, flattening, tp=2 on 8 A100-80GB (72 GiB usable): all four models resident hold
    # 28.2 + 27.7 + 6.3 + 6.2 = 68.4 GiB, leaving 3.6 GiB; the actor's training needs 5.3 GiB
    # of activations (32 layers x 2 s b (4 h + (2 h + 2 kv + 3 f) / tp) + fp32 logits and their
    # gradient). Offloading the reward model, the smallest copy, frees enough.
    p = _predict("flattening", tp=2)
    states = {role: _states_gib(role, 2, 4) for role in ("actor", "critic", "ref", "reward")}
    assert 72 - sum(states.values()) == pytest.approx(3.6, abs=0.05)
    h, f, s, b = 4096, 11008, 512, 4
    activations = (32 * 2 * s * b * (4 * h + (2 * h + 2 * h + 3 * f) / 2)
                   + 2 * 4 * s * b * 32000 / 2) / 2**30
    assert p.memory.roles["actor"].activations == pytest.approx(activations)
    assert activations > 3.6 and 72 - sum(states.values()) + states["reward"] > activations
    assert {role: o.label for role, o in p.memory.options.items()} == {
        "actor": "distributed_optimizer", "critic": "distributed_optimizer",
        "ref": "replicated", "reward": "replicated+offload"}
    assert _tasks(p)["experience:reward"]["offload_s"] > 0
    assert _tasks(p)["training:actor"]["offload_s"] == 0


def test_crowded_devices_offload_and_pay_for_it() -> None:
    p = _predict("flattening", model="llama-33b", tp=4, pp=2)
    assert p.feasible and p.memory.offloaded == {"actor", "critic", "ref", "reward"}
    assert any(task["offload_s"] > 0 for task in p.tasks)
    assert p.memory.peak_gib <= p.memory.usable_gib
    assert json.loads(json.dumps(p.to_dict()))["memory_options"]["actor"]["offload"]


def test_kv_cache_bounds_the_generation_round() -> None:
    # Same plan: actor, critic and ref resident (reward offloaded) leave 72 - 62.2 GiB; a
    # sequence of 512 takes 2 (K, V) x 32 layers x 2048 (kv / tp) x 512 x 2 bytes = 128 MiB of KV
    # cache, plus the prefill's layer activations over 256 prompt tokens and 32000 fp32 logits.
    p = _predict("flattening", tp=2, rollout=RolloutSpec(batch=1024))
    free = 72 - sum(_states_gib(role, 2, 4) for role in ("actor", "critic", "ref"))
    per_sequence = (2 * 32 * 2048 * 512 * 2 + 2 * 256 * (4 * 4096 + (4 * 4096 + 3 * 11008) / 2)
                    + 4 * 32000) / 2**30
    per_round = p.memory.sequences_per_round["actor"]
    assert per_round == int(free / per_sequence) == 67
    assert p.memory.largest_batch == per_round * 4      # 4 replicas
    # 256 rows per replica in ceil(256 / 67) = 4 rounds of 64: the generation micro-batch.
    assert p.memory.generation_micro_batch == {"actor": 64}
    assert p.memory.roles["actor"].kv_cache == pytest.approx(64 * per_sequence)


def test_an_oversized_micro_batch_is_infeasible_with_the_fix() -> None:
    rollout = RolloutSpec(batch=64, prompt_length=2048, generation_length=2048,
                          micro_batch_size=64)
    p = _predict("flattening", tp=8, rollout=rollout)
    assert not p.feasible and p.samples_per_s == 0 and p.bottleneck == "memory"
    assert any("lower rollout.micro_batch_size" in problem for problem in p.problems)
    assert json.loads(json.dumps(p.to_dict(), allow_nan=False))["step_seconds"] is None


def test_hetero_separation_generates_on_both_pools_by_relative_speed() -> None:
    cluster = ClusterSpec((
        DevicePool("A100-80GB", 1, 8, memory_gib=80, relative_speed=1.0),
        DevicePool("V100-32GB", 2, 4, memory_gib=32, relative_speed=0.4),
    ))
    p = _predict("hetero-separation", cluster=cluster, tp=4)
    assert "generation:shadow_actor+actor" in _tasks(p)
    assert p.memory.sequences_per_round.keys() == {"shadow_actor", "actor"}


@pytest.mark.parametrize("slow_speed", [0.4, 0.8])
def test_hetero_separation_splits_the_rows_by_the_pools_speeds(slow_speed: float) -> None:
    """Two actor replicas on the A100 pool (speed 1) and two shadow replicas on the V100 pool:
    each replica's rows are the batch times its pool's share of the summed speeds, rounded up."""
    from megatron_rlhf.planner.memory_fit import generation_rows, pool_of_replicas

    cluster = ClusterSpec((
        DevicePool("A100-80GB", 1, 8, memory_gib=80, relative_speed=1.0),
        DevicePool("V100-32GB", 2, 4, memory_gib=32, relative_speed=slow_speed),
    ))
    plan = plan_placement(cluster, PlacementConfig("hetero-separation", tp=4), "llama-7b")
    assert pool_of_replicas(plan, "actor") == {0: 2}
    assert pool_of_replicas(plan, "shadow_actor") == {1: 2}
    rows = generation_rows(plan, ROLLOUT.batch)
    total_speed = 2 * 1.0 + 2 * slow_speed
    assert rows == {"actor": {0: math.ceil(ROLLOUT.batch / total_speed)},
                    "shadow_actor": {1: math.ceil(ROLLOUT.batch * slow_speed / total_speed)}}
    assert ROLLOUT.batch <= 2 * rows["actor"][0] + 2 * rows["shadow_actor"][1] < ROLLOUT.batch + 4


def test_ac_share_places_no_critic() -> None:
    p = _predict("flattening", tp=2, ac_share=True)
    assert not any("critic" in name for name in _tasks(p))


def test_rollout_reads_a_run_config_by_attribute() -> None:
    run = SimpleNamespace(
        rollout=SimpleNamespace(prompts_per_step=8, max_prompt_length=16, micro_batch_size=2,
                                ppo_epochs=2, num_minibatches=4),
        generation=SimpleNamespace(max_new_tokens=64))
    rollout = RolloutSpec.from_run_config(run, activation_checkpointing=True)
    assert (rollout.batch, rollout.sequence_length, rollout.ppo_epochs,
            rollout.num_minibatches) == (8, 80, 2, 4)
    with pytest.raises(ValueError, match="not a multiple of num_minibatches"):
        RolloutSpec(batch=10, num_minibatches=4)


def test_trainers_gather_every_experience_row_once() -> None:
    # Flattening: the models sit on the same ranks, but each of the 4 DP replicas scored a
    # quarter of the rows and every trainer rank needs all of them (one gather for both trainers).
    flat = _tasks(_predict("flattening", tp=2))
    assert [name for name in flat if name.startswith("transfer:")] == [
        "transfer:experience->trainers"]
    # Separation: the shadows score on their own ranks; both trainers wait for the one gather.
    separated = predict_step(plan_placement(A100_1X8, PlacementConfig("separation", tp=2),
                                            "llama-7b"), ROLLOUT)
    gather = next(t for t in separated.tasks if t["name"] == "transfer:experience->trainers")
    for trainer in ("training:actor", "training:critic"):
        task = _tasks(separated)[trainer]
        assert task["start_s"] >= gather["start_s"] + gather["seconds"]
    # One replica per model on the ranks that scored everything: nothing moves.
    single = _tasks(_predict("flattening", tp=8))
    assert not [name for name in single if name.startswith("transfer:")]


def test_an_offloaded_model_generates_with_its_weights_only() -> None:
    # weights 1, grads 2, optimizer 3, activations 4, KV cache 10 (GiB): training needs
    # 6 + 4; generating needs the KV cache next to all states (16), or next to the weights alone
    # once offloaded (11).
    assert RoleMemory(1, 2, 3, 4, 10, offloaded=False).total == 16
    assert RoleMemory(1, 2, 3, 4, 10, offloaded=True).total == 11
    assert RoleMemory(1, 2, 3, 4, 0, offloaded=True).total == 10


def test_memory_options_can_be_limited_to_what_the_engine_runs() -> None:
    # llama-33b, flattening tp=4 pp=2 on one node needs recomputation besides offloading; with
    # offloading alone (the engine today) it does not fit, and the problem names the fix left.
    plan = plan_placement(A100_1X8, PlacementConfig("flattening", tp=4, pp=2), "llama-33b")
    assert predict_step(plan, ROLLOUT).memory.options["actor"].recompute
    offload_only = predict_step(plan, ROLLOUT, memory_options=("offload",))
    assert not offload_only.feasible
    assert "lower rollout.micro_batch_size" in offload_only.problems[0]
    assert offload_only.memory.options["actor"].label == "distributed_optimizer+offload"
    with pytest.raises(ValueError, match=r"memory options \['zero3'\] are unknown"):
        predict_step(plan, ROLLOUT, memory_options=("zero3",))


def test_fsdp_is_offered_only_where_the_engine_runs_it() -> None:
    from megatron_rlhf.planner.memory_fit import engine_runs_fsdp, option_menu

    flat = plan_placement(A100_1X8, PlacementConfig("flattening", tp=2), "llama-7b")
    assert engine_runs_fsdp(flat, "actor") and not engine_runs_fsdp(flat, "ref")
    menu = option_menu(flat["actor"], ROLLOUT, fsdp=True)
    assert {o.label for o in menu if o.sharding == "fsdp"} == {"fsdp", "fsdp+recompute"}, \
        "the engine never offloads an FSDP model"
    piped = plan_placement(A100_1X8, PlacementConfig("flattening", tp=2, pp=2), "llama-7b")
    shadowed = plan_placement(A100_1X8, PlacementConfig("separation", tp=1, pp=1), "llama-7b")
    halves = plan_placement(A100_1X8, PlacementConfig("interleaving2", tp=2), "llama-7b")
    for plan in (piped, shadowed, halves):
        assert not engine_runs_fsdp(plan, "actor")
        assert all(o.sharding != "fsdp" for o in option_menu(plan["actor"], ROLLOUT, fsdp=False))
