"""Answers staler than ``rollout.max_staleness`` in a real step (GRPO, one rank): a group with a
stale answer is counted and leaves the loss while the fresh groups train; a step whose answers are
all stale trains nothing and leaves the actor's weights as they were."""

from __future__ import annotations

import pytest

from tests.helpers.metrics import even_token_share
from tests.multirank import run_on_ranks

PROMPTS, SAMPLES = 2, 2


def _drops() -> dict:
    import torch

    from megatron_rlhf.algorithms import PPOAlgorithmConfig
    from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.engine.step.staleness import VERSION_FIELD
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from megatron_rlhf.topology.models import ACTOR

    initialize_runtime()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (5,), generator=generator).tolist() for _ in range(PROMPTS)]
    config = RunConfig(
        models=ModelsConfig(arch="tiny", init_seed=9),
        rollout=RolloutConfig(prompts_per_step=PROMPTS, samples_per_prompt=SAMPLES,
                              max_prompt_length=8, micro_batch_size=2),
        generation=GenerationConfig(max_new_tokens=6, seed=3),
        reward=RewardConfig(model_weight=0.0, rule="synthetic"),
        algorithm=PPOAlgorithmConfig(advantage_estimator="grpo", kl_in="loss"), steps=2)
    config.actor_optimizer.lr = 1e-2
    engine = build_engine(config, make_plan(config, cluster_from_environment(None)), eos_id=3,
                          pad_id=0)
    algorithm = PPOAlgorithm(engine, config.algorithm, config.rollout, config.reward, seed=5,
                             prompts=lambda s: (prompts, list(range(PROMPTS))), total_steps=2,
                             rule_reward=even_token_share)
    actor = engine.workers[ACTOR].model

    def weights() -> list:
        return [p.detach().clone() for p in actor.parameters()]

    results = {}
    for fresh_groups in (1, 0):
        # Step 1's answers, sampled by version 0: stale for a synchronous run (staleness 0).
        experience = algorithm.produce(1, version=0)
        fields = experience.batch.fields
        fresh = slice(0, fresh_groups * SAMPLES)
        fields[VERSION_FIELD][fresh] = torch.where(fields["response_mask"][fresh].bool(), 1, -1)
        before = weights()
        sums = algorithm.consume(experience)
        moved = any(not torch.equal(a, b) for a, b in zip(before, weights(), strict=True))
        results[fresh_groups] = {"dropped": experience.metrics["rollout/dropped_stale"],
                                 "staleness_max": experience.metrics["rollout/staleness_max"],
                                 "trained": bool(sums), "moved": moved,
                                 # a per-token metric's weight: the tokens trained on
                                 "tokens": float(sums["actor/ppo_kl"].weight) if sums else 0.0,
                                 "fresh_tokens": float(fields["response_mask"][fresh].sum())}
    return results


@pytest.mark.multirank
def test_stale_groups_leave_the_loss_and_an_all_stale_step_trains_nothing() -> None:
    (results,) = run_on_ranks(_drops, world_size=1, timeout_s=240)
    half = results[1]
    assert half["dropped"] == (PROMPTS - 1) * SAMPLES and half["staleness_max"] == 1.0
    assert half["trained"] and half["moved"]
    assert half["tokens"] == half["fresh_tokens"] > 0, "only the fresh group's tokens count"
    none = results[0]
    assert none["dropped"] == PROMPTS * SAMPLES
    assert not none["trained"] and not none["moved"]
