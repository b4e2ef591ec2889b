"""Pipelined and asynchronous stage schedules, and the timelines that show them.

- chunked (pipelined) production of experience gives exactly the metrics of the sequential one;
- asynchronous separation trains step k on experience generated one step earlier (checked
  against a synchronous run whose policy never changes, which generates what stale shadows do),
  and its timeline shows the shadows generating step 1 before the actor has trained on step 0;
- spans land on the ranks that hold each model.
"""

from __future__ import annotations

import pytest

from tests.helpers.metrics import metrics_match
from tests.multirank import run_on_ranks

COMPARED = ("reward_mean", "rm_score", "kl", "policy_loss", "value_loss", "response_length")


def _run(strategy: str, steps: int, chunks: int = 1, asynchronous: bool = False,
         actor_lr: float = 1e-3, trace: bool = False):
    import torch

    from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.context import RunContext
    from megatron_rlhf.runtime.tracing import Tracer
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from megatron_rlhf.topology.placement_config import PlacementConfig

    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(4, 500, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 9, (16 * 4,), generator=generator)]
    config = RunConfig(
        placement=PlacementConfig(strategy=strategy),
        models=ModelsConfig(arch="tiny", init_seed=4),
        rollout=RolloutConfig(prompts_per_step=16, max_prompt_length=8, micro_batch_size=2,
                              num_minibatches=2, pipeline_chunks=chunks,
                              async_rollout=asynchronous),
        generation=GenerationConfig(max_new_tokens=6, seed=2),
        reward=RewardConfig(model_weight=1.0), steps=steps)
    config.actor_optimizer.lr = actor_lr
    config.critic_optimizer.lr = 1e-3
    tracer = Tracer(enabled=trace)
    engine = build_engine(config, make_plan(config, cluster_from_environment()), 3, 0,
                          context=RunContext(tracer))
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=3,
                         prompts=lambda s: (prompts[16 * s:16 * (s + 1)],
                                            list(range(16 * s, 16 * (s + 1)))),
                         total_steps=steps)
    metrics = [algorithm.step(s) for s in range(steps)]
    return metrics, [(s.stage, s.model, s.start, s.end) for s in tracer.spans]


def _schedules() -> dict:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return {
        "flat": _run("flattening", 2)[0],
        "flat_chunks": _run("flattening", 2, chunks=2)[0],
        "sep": _run("separation", 2)[0],
        "sep_chunks": _run("separation", 2, chunks=4)[0],
        "frozen_sync": _run("separation", 2, actor_lr=1e-12)[0],
        "async": _run("separation", 3, asynchronous=True, trace=True),
    }


def _same(a: dict, b: dict) -> bool:
    return metrics_match(a, b, COMPARED)


@pytest.mark.multirank
@pytest.mark.timeout(660)
def test_pipelined_and_asynchronous_schedules() -> None:
    per_rank = run_on_ranks(_schedules, world_size=4, timeout_s=600)
    results = per_rank[0]
    for sequential, chunked in (("flat", "flat_chunks"), ("sep", "sep_chunks")):
        for step, (a, b) in enumerate(zip(results[sequential], results[chunked], strict=True)):
            assert _same(a, b), f"{chunked} step {step} differs from {sequential}: {a} vs {b}"

    async_metrics, _ = results["async"]
    # Step 0 trains on fresh experience, exactly as the synchronous run does.
    assert _same(async_metrics[0], results["sep"][0]), (async_metrics[0], results["sep"][0])
    # Step 1's experience was generated before step 0's update reached the shadows: its
    # rewards are those of the initial policy, i.e. of a run whose policy never moves.
    frozen, moving = results["frozen_sync"][1], results["sep"][1]
    assert async_metrics[1]["reward_mean"] == pytest.approx(frozen["reward_mean"], rel=1e-5)
    assert async_metrics[1]["reward_mean"] != pytest.approx(moving["reward_mean"], rel=1e-3)

    # Separation on 4 ranks: actor and critic train on ranks 0-1, the shadows generate on 2-3.
    spans = {rank: per_rank[rank]["async"][1] for rank in range(4)}
    assert all(stage != "generate" for rank in (0, 1) for stage, *_ in spans[rank])
    assert all(stage != "train" for rank in (2, 3) for stage, *_ in spans[rank])
    # An order, not a duration (the 2-core test machine stretches every span): the shadows
    # start generating step 1's experience before the actor has finished training on step 0's.
    generation_starts = [start for stage, model, start, _ in spans[2]
                         if stage == "generate" and model == "shadow_actor"]
    first_sync = next(i for i, (stage, *_) in enumerate(spans[0]) if stage == "sync_weights")
    step0_training = [end for stage, _, _, end in spans[0][:first_sync] if stage == "train"]
    assert len(generation_starts) == 3 and step0_training, (generation_starts, spans[0])
    assert generation_starts[1] < max(step0_training), (
        "asynchronous separation must generate step 1 while the actor trains on step 0")
