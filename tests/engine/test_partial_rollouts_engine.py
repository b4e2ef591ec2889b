"""Partial rollouts (``rollout.partial_rollouts``) in one-step-off separation, GRPO on 2 gloo
ranks (the actor trains on rank 0, its shadow generates on rank 1).

When every answer ends before the trainers are done (training slowed down), the run is
today's asynchronous separation bit for bit, and so it is with answers that go on across steps
(``rollout.continue_answers``), which a workload of varied lengths makes span up to 3 updates. When generation is the slow side, the shadow takes
step k's weights in the middle of generating step k + 1: those answers hold tokens of two
versions, sampled before and after the hand-over, and their staleness falls below one step. A
hand-over fixed at a stop check splits every answer where counted and repeats bit for bit.
"""

from __future__ import annotations

import pytest

from megatron_rlhf.testing.nccl_device_rule import IN_GENERATION_ENV
from tests.helpers.metrics import even_token_share
from tests.multirank import run_on_ranks

STEPS = 2


def _run(partial: bool, slow: str, handover_check: int = 0, shadow_tp: int = 1,
         continued: bool = False, steps: int = STEPS) -> list[dict]:
    import time

    import torch

    from megatron_rlhf.algorithms import PPOAlgorithmConfig
    from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from megatron_rlhf.topology.models import ACTOR, SHADOW_ACTOR
    from megatron_rlhf.topology.placement_config import PlacementConfig

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 9, (4 * steps,), generator=generator)]
    # Answers that go on across steps: lengths that vary (a stop at any of 64 tokens) so that
    # groups finish at different stop checks and the oldest ones outlive their step.
    stops = [[t] for t in range(100, 164)] if continued and slow == "none" else []
    config = RunConfig(
        placement=PlacementConfig(strategy="separation",
                                  parallel={"shadow_actor": {"tp": shadow_tp}}),
        models=ModelsConfig(arch="tiny", init_seed=9),
        rollout=RolloutConfig(prompts_per_step=4, samples_per_prompt=2, max_prompt_length=8,
                              micro_batch_size=2, num_minibatches=2, async_rollout=True,
                              reuse_generation_logprobs=True, partial_rollouts=partial,
                              partial_handover_check=handover_check,
                              continue_answers=continued, max_staleness=3 if continued else 1),
        generation=GenerationConfig(max_new_tokens=24 if stops else 12, seed=3,
                                    stop_at_eos=False, stop_check_interval=2,
                                    stop_sequences=stops),
        reward=RewardConfig(model_weight=0.0, rule="synthetic"),
        algorithm=PPOAlgorithmConfig(advantage_estimator="grpo", kl_in="loss",
                                     off_policy="decoupled"),
        steps=steps)
    config.actor_optimizer.lr = 3e-3
    engine = build_engine(config, make_plan(config, cluster_from_environment(None)), eos_id=3,
                          pad_id=0)
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=5,
                             prompts=lambda s: (prompts[4 * s:4 * (s + 1)],
                                                list(range(4 * s, 4 * (s + 1)))),
                             total_steps=steps, rule_reward=even_token_share)
    if slow == "training" and ACTOR in engine.workers:
        consume = algorithm.consume
        algorithm.consume = lambda experience: (time.sleep(1.0), consume(experience))[1]
    if slow == "generation" and SHADOW_ACTOR in engine.workers:
        engine.workers[SHADOW_ACTOR].model.register_forward_pre_hook(
            lambda *_: time.sleep(0.15))
    return [algorithm.step(s) for s in range(steps)]


def _runs() -> dict:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return {"today": _run(False, "training"), "partial": _run(True, "training"),
            "spanning": _run(True, "generation"),
            "fixed": [_run(True, "none", handover_check=2) for _ in range(2)],
            "continued": _run(True, "training", continued=True),
            "streamed": [_run(True, "none", handover_check=2, continued=True, steps=5)
                         for _ in range(2)]}


@pytest.mark.multirank
@pytest.mark.timeout(340)
def test_partial_rollouts_equal_today_without_spanning_and_hand_over_inside_a_round() -> None:
    per_rank = run_on_ranks(_runs, world_size=2, timeout_s=280)
    results = per_rank[0]
    assert per_rank[1] == results, "metrics must be identical on every rank"
    # Every answer ended before the hand-over: the run is today's, bit for bit.
    assert results["partial"] == results["today"]
    assert all(m["rollout/partial_fraction"] == 0.0 for m in results["partial"])

    spanning = results["spanning"]
    assert spanning[0]["rollout/staleness_max"] == 0.0  # produced synchronously
    for step in range(1, STEPS):
        got = spanning[step]
        assert got["rollout/partial_fraction"] > 0.0, (step, got)
        assert 1.0 < got["rollout/versions_per_answer"] <= 2.0
        assert got["rollout/staleness_max"] == 1.0 and got["rollout/staleness_mean"] < 1.0
        assert got["rollout/dropped_stale"] == 0.0

    # Handed over at the 2nd stop check (2 decode steps each): every answer has its prefill's
    # token and 4 decoded ones under step k's sampler, its 7 others under k + 1's; twice alike.
    fixed, again = results["fixed"]
    assert fixed == again, "a fixed hand-over is reproducible bit for bit"
    assert fixed[1]["rollout/staleness_mean"] == pytest.approx(5 / 12)
    assert fixed[1]["rollout/partial_fraction"] == 1.0

    # Answers that go on across steps, every one ending within its step: partial rollouts'.
    # Exact on any CPU: every answer runs its full 12 tokens, so the pool and the plain call
    # decode the same rows in the same slot counts (same kernels, same shapes).
    assert results["continued"] == results["partial"]
    # With lengths that vary, the oldest answers outlive their step and are trained later (a
    # token 3 versions older than its step), none dropped under max_staleness 3; a fixed
    # hand-over repeats bit for bit (tests/generation/test_continue_answers.py counts the
    # versions token by token).
    streamed, again = results["streamed"]
    assert streamed == again, "a fixed hand-over is reproducible bit for bit"
    assert [m["rollout/staleness_max"] for m in streamed] == [0.0, 1.0, 2.0, 2.0, 3.0]
    assert max(m["rollout/versions_per_answer"] for m in streamed) > 1.5
    assert all(m["rollout/dropped_stale"] == 0.0 for m in streamed)


def _spanning_at_tp2() -> list[dict]:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return _run(True, "generation", shadow_tp=2)


@pytest.mark.multirank
@pytest.mark.timeout(200)
def test_a_tensor_parallel_shadow_takes_the_weights_at_one_stop_check() -> None:
    """The shadow's TP ranks agree on the stop check that takes the weights (a collective on
    its TP group): their decode steps stay in step and every rank reports the same metrics.
    The check runs inside generation, where NCCL's device rule marks host tensors only on
    request: a flag made in host memory there fails the run, as NCCL would."""
    per_rank = run_on_ranks(_spanning_at_tp2, world_size=4, timeout_s=160,
                            env={IN_GENERATION_ENV: "1"})
    assert all(metrics == per_rank[0] for metrics in per_rank[1:])
    assert per_rank[0][1]["rollout/partial_fraction"] > 0.0


@pytest.mark.parametrize("changes,match", [
    ({}, r"needs rollout\.async_rollout=true"),
    ({"async_rollout": True}, r"needs rollout\.reuse_generation_logprobs=true"),
    ({"async_rollout": True, "reuse_generation_logprobs": True, "pipeline_chunks": 2},
     r"needs rollout\.pipeline_chunks=1"),
    ({"partial_rollouts": False, "continue_answers": True},
     r"continue_answers=true needs rollout\.partial_rollouts=true"),
    ({"async_rollout": True, "reuse_generation_logprobs": True, "continue_answers": True},
     r"continue_answers=true needs rollout\.max_staleness >= 2 \(got 1\)"),
])
def test_partial_rollouts_refuse_what_they_cannot_hand_over_in(changes: dict, match: str) -> None:
    from megatron_rlhf.config.ppo_run import RolloutConfig

    with pytest.raises(ValueError, match=match):
        RolloutConfig(**{"partial_rollouts": True, "prompts_per_step": 4, **changes})


@pytest.mark.parametrize("section,match", [
    ("algorithm.dynamic_sampling=true", "dynamic_sampling"),
    ("generation.batching=static", "continuous batching"),
    ("rollout.partial_handover_check=-1", r"partial_handover_check=-1 must be >= 0"),
    ("models.offload.actor=auto", r"models\.offload\.actor='auto'"),
    ("placement.replan.move=true", r"continue_answers=true cannot move.*replan\.move=true"),
    ("reward.functions=[{name: exact_reward}]",
     r"continue_answers=true cannot score with reward\.functions"),
])
def test_partial_rollouts_refuse_refills_and_the_static_loop(section: str, match: str) -> None:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    overrides = ["placement.strategy=separation", "rollout.async_rollout=true",
                 "rollout.reuse_generation_logprobs=true", "rollout.partial_rollouts=true",
                 "rollout.samples_per_prompt=2", "algorithm.advantage_estimator=grpo", section]
    if "continue_answers" in match:
        overrides += ["rollout.continue_answers=true", "rollout.max_staleness=3",
                      "placement.replan.interval_steps=2"]
    with pytest.raises(ValueError, match=match):
        load_config(RunConfig, None, overrides)
