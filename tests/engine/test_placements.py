"""The PPO math does not change with the placement.

With the same seed and synchronous execution, flattening, interleaving, interleaving2,
separation and heterogeneous separation (generation split between pools by speed) give the same
per-step rewards, KL and losses on 4 gloo ranks, for AC-NonShare and AC-Share, and on 2. Each strategy
moves data differently (separation also resyncs shadows every step), so any routing or sync
mistake shows up as a metric mismatch. Every placement generates with continuous batching over
packed sequences (the defaults); ``flattening/reference`` generates through the static loop and
trains on padded rows, the paths those defaults must reproduce.
"""

from __future__ import annotations

import pytest

from tests.helpers.metrics import assert_metrics_match, even_token_share
from tests.multirank import run_on_ranks

STRATEGIES = ("flattening", "interleaving", "interleaving2", "separation", "hetero-separation",
              "flattening/reference")
"""Placements with the default generation and training paths; ``/reference``: with the static
generation loop (``generation.batching=static``) and padded rows
(``models.packed_sequences=false``)."""
COMPARED = ("reward_mean", "rm_score", "rule_score", "kl", "policy_loss", "value_loss",
            "response_length", "actor/pg_clipfrac", "actor/grad_norm")


def _run_strategies(ac_share: bool, steps: int, strategies: tuple[str, ...] = STRATEGIES,
                    offload: str = "never") -> dict[str, list[dict[str, float]]]:
    import torch

    from megatron_rlhf.config.ppo_run import (
        ModelsConfig,
        RewardConfig,
        RolloutConfig,
        RunConfig,
    )
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import DevicePool, cluster_from_environment
    from megatron_rlhf.topology.placement_config import PlacementConfig

    # Two pools of half the ranks; the slower one holds the inference models, and the actor on
    # the fast pool generates twice the rows of each shadow replica.
    half = torch.distributed.get_world_size() // 2
    hetero_pools = [DevicePool("fast", 1, half, relative_speed=1.0),
                    DevicePool("slow", 1, half, relative_speed=0.5)]

    initialize_runtime()
    prompts_gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (int(n),), generator=prompts_gen).tolist()
               for n in torch.randint(2, 9, (16 * steps,), generator=prompts_gen)]
    results = {}
    for strategy in strategies:
        placement, _, variant = strategy.partition("/")
        reference = variant == "reference"
        config = RunConfig(
            placement=PlacementConfig(strategy=placement, ac_share=ac_share),
            models=ModelsConfig(arch="tiny", init_seed=9, offload=dict.fromkeys(
                ("actor", "critic", "ref", "reward"), offload),
                packed_sequences=not reference),
            rollout=RolloutConfig(prompts_per_step=16, max_prompt_length=8, micro_batch_size=2,
                                  ppo_epochs=2, num_minibatches=2),
            generation=GenerationConfig(max_new_tokens=6, seed=3,
                                        batching="static" if reference else "continuous"),
            reward=RewardConfig(model_weight=0.5, rule="none", rule_weight=1.0),
            steps=steps)
        config.algorithm.entropy_coef = 0.01
        config.actor_optimizer.lr = 1e-3
        config.critic_optimizer.lr = 1e-3
        pools = hetero_pools if placement == "hetero-separation" else None
        plan = make_plan(config, cluster_from_environment(pools))
        engine = build_engine(config, plan, eos_id=3, pad_id=0)
        algorithm = PPOAlgorithm(
            engine, config.algorithm, config.rollout, config.reward, seed=5,
            prompts=lambda s: (prompts[16 * s:16 * (s + 1)], list(range(16 * s, 16 * (s + 1)))),
            total_steps=steps, rule_reward=even_token_share)
        results[strategy] = [algorithm.step(s) for s in range(steps)]
    return results


def _check_same_metrics(results: dict[str, list[dict[str, float]]]) -> None:
    reference = results["flattening"]
    for strategy, steps in results.items():
        for step, (metrics, ref) in enumerate(zip(steps, reference, strict=True)):
            assert_metrics_match(metrics, ref, COMPARED, f"{strategy} step {step} vs flattening")
    for strategy, steps in results.items():  # generation's log-probs are the trainer's
        for metrics in steps:
            assert metrics["rollout/logprob_diff_max"] < 2e-5, (strategy, metrics)
    first = reference[0]
    assert first["response_length"] > 1 and first["kl"] == pytest.approx(0.0, abs=1e-5)
    assert abs(reference[1]["kl"]) > 1e-4, "the policy moved: step 2 must show a KL to the reference"


@pytest.mark.multirank
@pytest.mark.parametrize("ac_share", [False, True], ids=["ac-nonshare", "ac-share"])
@pytest.mark.timeout(480)
def test_every_placement_gives_the_same_ppo_metrics(ac_share: bool) -> None:
    per_rank = run_on_ranks(_run_strategies, world_size=4, args=(ac_share, 2), timeout_s=420)
    assert all(r == per_rank[0] for r in per_rank), "metrics must be identical on every rank"
    _check_same_metrics(per_rank[0])


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_every_placement_gives_the_same_ppo_metrics_on_two_ranks() -> None:
    per_rank = run_on_ranks(_run_strategies, world_size=2, args=(False, 2), timeout_s=240)
    assert per_rank[0] == per_rank[1], "metrics must be identical on every rank"
    _check_same_metrics(per_rank[0])


def _offload_changes_nothing() -> dict[str, tuple[list, list]]:
    strategies = ("flattening", "separation")
    resident = _run_strategies(False, 2, strategies)
    offloaded = _run_strategies(False, 2, strategies, offload="always")
    return {s: (resident[s], offloaded[s]) for s in strategies}


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_offloading_every_model_between_stages_changes_no_metric() -> None:
    per_rank = run_on_ranks(_offload_changes_nothing, world_size=4, timeout_s=540)
    for strategy, (resident, offloaded) in per_rank[0].items():
        assert offloaded == resident, f"{strategy}: offload=always differs from never"
        assert resident[1]["actor/grad_norm"] > 0
