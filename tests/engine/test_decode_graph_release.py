"""Kept decode graphs and the memory under them: which models keep them, what the stage-memory
prediction counts for them, and that tearing a run down (a move) frees them.

A generating model keeps its captured decode steps and their KV caches between generate calls
only when it is not trained, not offloaded and shares no device with a trained model; the
prediction then counts those caches (one per kept slot count, as long as the run's longest
call) as resident in every stage of its ranks. A move drops the old run after freeing the kept
graphs, so they go even while something else still refers to the old model.
"""

from __future__ import annotations

import dataclasses

import pytest

from megatron_rlhf.config.ppo_run import ModelsConfig, RolloutConfig, RunConfig
from megatron_rlhf.engine.run.stage_memory import (
    RoleBytes,
    decode_graph_roles,
    decode_positions,
    planner_role_bytes,
    stage_peaks,
)
from megatron_rlhf.generation import GenerationConfig
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
from megatron_rlhf.topology.placement_config import PlacementConfig
from tests.multirank import run_on_ranks

RESIDENT = dict.fromkeys(("actor", "critic", "ref", "reward", "shadow_actor", "shadow_critic"),
                         "never")


def _plan(strategy: str, max_new_tokens: int = 20, **rollout):
    from megatron_rlhf.engine.run.build import make_plan

    config = RunConfig(placement=PlacementConfig(strategy=strategy),
                       models=ModelsConfig(arch="tiny", params_dtype="bfloat16"),
                       rollout=RolloutConfig(**{"prompts_per_step": 4, "max_prompt_length": 8,
                                                "micro_batch_size": 2, **rollout}),
                       generation=GenerationConfig(max_new_tokens=max_new_tokens))
    cluster = ClusterSpec((DevicePool("local", 1, 2, memory_gib=1.0),))
    return config, make_plan(config, cluster)


def test_only_resident_inference_models_apart_from_training_keep_graphs() -> None:
    _, separation = _plan("separation")
    assert decode_graph_roles(separation, RESIDENT, graphs=True) == {"shadow_actor"}
    assert decode_graph_roles(separation, {**RESIDENT, "shadow_actor": "auto"}, True) == {
        "shadow_actor"}
    assert decode_graph_roles(separation, RESIDENT, graphs=False) == set()
    assert decode_graph_roles(separation, {**RESIDENT, "shadow_actor": "always"}, True) == set()
    _, flattening = _plan("flattening")  # the actor generates and trains
    assert decode_graph_roles(flattening, RESIDENT, graphs=True) == set()
    # a shadow on the devices of the trained models: its graphs would pin memory in training
    shared = dataclasses.replace(separation["shadow_actor"], rank_offset=0, size=2)
    colocated = dataclasses.replace(separation, models={**separation.models,
                                                        "shadow_actor": shared})
    assert decode_graph_roles(colocated, RESIDENT, graphs=True) == set()


def test_a_kept_cache_is_resident_in_every_stage() -> None:
    _, plan = _plan("separation")
    roles = {"actor": RoleBytes(1, 2, 4), "critic": RoleBytes(8, 16, 32),
             "shadow_actor": RoleBytes(64, kv_cache=128, kept_cache=384),
             "shadow_critic": RoleBytes(256), "ref": RoleBytes(512), "reward": RoleBytes(1024)}
    # rank 1: 64 + 256 + 512 + 1024 of state and the kept 384, in every stage; generating adds
    # no cache of its own (it decodes in the kept one)
    assert stage_peaks(plan, roles, ())[1] == {"generate": 2240, "experience": 2240,
                                               "sync_weights": 2240}
    offloaded = stage_peaks(plan, roles, {"ref", "reward"})[1]
    assert offloaded == {"generate": 704, "experience": 1728, "sync_weights": 704}
    assert stage_peaks(plan, roles, ())[0] == {"train": 63, "sync_weights": 63}


@pytest.mark.parametrize(("rows", "slot_counts"), [(4, [8]), (32, [32, 16, 8]),
                                                   (48, [64, 32, 16, 8])])
def test_the_kept_cache_by_hand(rows: int, slot_counts: list[int]) -> None:
    """tiny: 2 layers, 64 key and 64 value channels, bf16, at the run's longest call: 8 + 20
    positions, a 32-long bucket; one cache per slot count the calls decode at (the first
    call's, rounded up to a power of two, and each smaller one down to 8)."""
    config, plan = _plan("separation", prompts_per_step=rows)
    assert decode_positions(config) == 28
    kept = planner_role_bytes(plan, config, {"shadow_actor"})["shadow_actor"].kept_cache
    assert kept == sum(slot_counts) * 2 * 2 * 64 * 32 * 2
    assert planner_role_bytes(plan, config)["shadow_actor"].kept_cache == 0


def test_an_episode_run_keeps_caches_as_long_as_its_episodes() -> None:
    config, _ = _plan("separation", tools=[{"name": "operator:add"}], max_turns=3, max_episode_tokens=100)
    assert decode_positions(config) == 108


def _release_job() -> dict:
    import gc
    import os
    import weakref
    from types import SimpleNamespace

    from megatron_rlhf.engine.execution.workers import ModelWorker
    from megatron_rlhf.engine.run.move import LiveRun, drop_run
    from megatron_rlhf.generation.continuous import decode_graphs
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.runtime.context import RunContext
    from megatron_rlhf.testing.graph_standin import EMULATE_ENV
    from tests.generation.helpers import build_tiny

    initialize_runtime()
    os.environ[EMULATE_ENV] = "1"
    config = GenerationConfig(max_new_tokens=8, stop_at_eos=False, seed=2)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    model, pgc = build_tiny()
    trained = ModelWorker("actor", build_tiny()[0], pgc, None, micro_batch_size=1)
    trained.generate(prompts, [0, 1, 2], config, eos_id=3, pad_id=0)
    kept_by_default = bool(decode_graphs(trained.model).decoders)
    worker = ModelWorker("shadow_actor", model, pgc, None, micro_batch_size=1,
                         keep_graphs=True, generation_length=30)
    worker.generate(prompts, [0, 1, 2], config, eos_id=3, pad_id=0)
    kept = decode_graphs(model)
    lengths = {decoder.max_length for decoder in kept.decoders.values()}
    refs = [weakref.ref(t) for d in kept.decoders.values()
            for pair in d.context.key_value_memory_dict.values() for t in pair]
    refs += [weakref.ref(g.graph) for g in kept.graphs.values()]
    model_ref = weakref.ref(model)
    closed = []  # one rank: no transfer channel, only their closing to see
    engine = SimpleNamespace(workers={"shadow_actor": worker},
                             channels=SimpleNamespace(close=lambda: closed.append(True)),
                             context=RunContext())
    live = LiveRun(SimpleNamespace(engine=engine), None, None)
    held = model  # the old model is still referred to elsewhere
    del model, worker, kept, engine
    drop_run(live)
    freed = [ref() is None for ref in refs]
    alive = model_ref() is held
    del held
    gc.collect()
    return {"kept_by_default": kept_by_default, "lengths": sorted(lengths), "freed": freed,
            "alive_while_held": alive, "model_freed": model_ref() is None,
            "channels_closed": closed == [True]}


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_a_move_frees_the_kept_graphs_and_the_old_model() -> None:
    (result,) = run_on_ranks(_release_job, world_size=1, timeout_s=150)
    assert not result["kept_by_default"]  # a worker keeps nothing unless told to
    assert result["lengths"] == [32]  # generation_length 30: one 32-long bucket
    assert result["freed"] and all(result["freed"])  # freed although the model is still held
    assert result["alive_while_held"] and result["model_freed"]
    assert result["channels_closed"]  # drained, their thread ended, before the groups go
