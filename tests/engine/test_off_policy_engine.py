"""Off-policy corrections (``algorithm.off_policy``) in the engine, GRPO on 2 gloo ranks.

Synchronously the trainer's log-probs before the update (proximal) are the sampling policy's up
to rounding, so ``decoupled`` trains as ``none`` does and its importance weights are 1. Under
asynchronous separation the shadows sample step 1 with step 0's weights while the trainer has
already moved: the weights move away from 1, and ``truncated_is`` with a cap of 1 clips every
token whose weight is above it, changing the loss only from that step on. Every token records
the weight version that sampled it: staleness 0 synchronously, then 1 from step 1 on.
"""

from __future__ import annotations

import pytest

from tests.helpers.metrics import assert_metrics_match, even_token_share
from tests.multirank import run_on_ranks

PROMPTS, SAMPLES, STEPS = 4, 2, 2
COMPARED = ("reward_mean", "kl", "policy_loss", "actor/pg_clipfrac", "actor/grad_norm",
            "actor/kl_loss")


def _run(off_policy: str, asynchronous: bool, cap: float = 2.0) -> dict:
    import torch

    from megatron_rlhf.algorithms import PPOAlgorithmConfig
    from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from megatron_rlhf.topology.models import ACTOR
    from megatron_rlhf.topology.placement_config import PlacementConfig

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 9, (PROMPTS * STEPS,), generator=generator)]
    config = RunConfig(
        placement=PlacementConfig(strategy="separation"),
        models=ModelsConfig(arch="tiny", init_seed=9),
        rollout=RolloutConfig(prompts_per_step=PROMPTS, samples_per_prompt=SAMPLES,
                              max_prompt_length=8, micro_batch_size=2, num_minibatches=2,
                              async_rollout=asynchronous),
        generation=GenerationConfig(max_new_tokens=6, seed=3),
        reward=RewardConfig(model_weight=0.0, rule="synthetic", rule_weight=1.0),
        algorithm=PPOAlgorithmConfig(advantage_estimator="grpo", kl_in="loss",
                                     kl_loss_coef=0.05, off_policy=off_policy,
                                     off_policy_cap=cap),
        steps=STEPS)
    config.actor_optimizer.lr = 3e-3
    engine = build_engine(config, make_plan(config, cluster_from_environment(None)), eos_id=3,
                          pad_id=0)
    passes = []
    if ACTOR in engine.workers:
        compute_log_prob = engine.workers[ACTOR].compute_log_prob
        engine.workers[ACTOR].compute_log_prob = lambda *a: (
            passes.append(1), compute_log_prob(*a))[1]
    algorithm = PPOAlgorithm(
        engine, config.algorithm, config.rollout, config.reward, seed=5,
        prompts=lambda s: (prompts[PROMPTS * s:PROMPTS * (s + 1)],
                           list(range(PROMPTS * s, PROMPTS * (s + 1)))),
        total_steps=STEPS, rule_reward=even_token_share)
    return {"metrics": [algorithm.step(s) for s in range(STEPS)], "actor_passes": len(passes)}


def _runs() -> dict:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return {"sync_none": _run("none", False), "sync_decoupled": _run("decoupled", False),
            "async_decoupled": _run("decoupled", True),
            "async_truncated": _run("truncated_is", True, cap=1.0)}


@pytest.mark.multirank
@pytest.mark.timeout(340)
def test_off_policy_corrections_in_synchronous_and_asynchronous_separation() -> None:
    per_rank = run_on_ranks(_runs, world_size=2, timeout_s=280)
    results = per_rank[0]
    assert all(rank["sync_decoupled"]["metrics"] == results["sync_decoupled"]["metrics"]
               for rank in per_rank), "metrics must be identical on every rank"
    # One proximal pass per step on the trainer's actor, none without a correction.
    assert results["sync_none"]["actor_passes"] == 0
    assert results["sync_decoupled"]["actor_passes"] == STEPS

    synchronous = results["sync_decoupled"]["metrics"]
    for step, (got, want) in enumerate(zip(synchronous, results["sync_none"]["metrics"],
                                           strict=True)):
        assert "off_policy/weight_mean" not in want
        assert got["off_policy/logprob_gap"] < 1e-5, (step, got)
        assert got["off_policy/weight_max"] == pytest.approx(1.0, abs=1e-4)
        assert_metrics_match(got, want, COMPARED, f"sync decoupled step {step}", rel=1e-4)

    for step, got in enumerate(synchronous):
        assert (got["rollout/staleness_mean"], got["rollout/staleness_max"]) == (0.0, 0.0)
        assert (got["rollout/versions_per_answer"], got["rollout/partial_fraction"],
                got["rollout/dropped_stale"]) == (1.0, 0.0, 0.0), (step, got)

    asynchronous = results["async_decoupled"]["metrics"]
    assert [m["rollout/staleness_max"] for m in asynchronous] == [0.0, *[1.0] * (STEPS - 1)]
    assert [m["rollout/staleness_mean"] for m in asynchronous] == [0.0, *[1.0] * (STEPS - 1)]
    assert all(m["rollout/dropped_stale"] == 0.0 for m in asynchronous)
    truncated = results["async_truncated"]["metrics"]
    # Step 0 trains on what the current weights sampled; later steps on one step older tokens.
    assert asynchronous[0]["off_policy/logprob_gap"] < 1e-5
    assert truncated[0]["off_policy/weight_clipfrac"] < 0.5
    assert_metrics_match(truncated[0], asynchronous[0], COMPARED, "async step 0", rel=1e-4)
    for step in range(1, STEPS):
        got = asynchronous[step]
        assert got["off_policy/logprob_gap"] > 1e-3, (step, got)
        assert got["off_policy/weight_max"] > 1.0 + 1e-3
        assert got["off_policy/weight_clipfrac"] == 0.0  # decoupled does not truncate
        assert truncated[step]["off_policy/weight_clipfrac"] > 0.0
    assert truncated[1]["policy_loss"] != pytest.approx(asynchronous[1]["policy_loss"],
                                                        rel=1e-4)
