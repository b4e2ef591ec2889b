"""Multi-turn rollouts with a user's tool module outside the package, on 2 gloo ranks.

The tool (a ``calculator`` in a module written to ``tmp_path``) runs in the worker pool of each
generating rank. A stand-in codec makes every token id divisible by 5 decode as a whole
calculator call, so the tiny random policy calls the tool often: episodes take several turns,
observations are appended and some episodes are truncated. GRPO, RLOO and PPO (GAE over the
episode, tool answers skipped) give the same metrics, the episode counts included, under
flattening, interleaving and separation (shadows generate, trainers train, weights resynced
every step); asynchronous separation runs too.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.metrics import assert_metrics_match, even_token_share
from tests.multirank import run_on_ranks

CALL = ('<tool_call>{"name": "calculator", "arguments": {"a": 12, "b": 3, "op": "*"}}'
        "</tool_call>")

USER_MODULE = '''
def calculator(arguments, record, scale=1, log=""):
    if log:
        with open(log, "a") as out:
            out.write("call\\n")
    a, b, op = int(arguments["a"]), int(arguments["b"]), arguments["op"]
    return str({"+": a + b, "-": a - b, "*": a * b}[op] * scale)
'''

COMPARED = ("reward_mean", "kl", "policy_loss", "response_length", "actor/grad_norm",
            "rollout/turns", "rollout/tool_calls", "rollout/tool_errors",
            "rollout/observation_tokens", "rollout/truncated")


def _decode(ids: list[int]) -> str:
    return "".join(CALL if t % 5 == 0 else "x" for t in ids)


def _encode(text: str) -> list[int]:
    return [10 + ord(c) % 200 for c in text]


RUNS = tuple(f"{estimator}/{strategy}" for estimator in ("grpo", "rloo", "gae")
             for strategy in ("flattening", "interleaving", "separation")) + (
                 "grpo/async", "grpo/flattening-tp2")
"""``estimator/placement`` of every run; ``async``: separation with the shadows a step ahead;
``-tp2``: both ranks one TP group, whose first rank alone calls the tool (each call is logged
to ``calls.log``)."""


def _run(module_dir: str) -> dict[str, list[dict[str, float]]]:
    import sys

    import torch

    sys.path.insert(0, module_dir)
    from megatron_rlhf.algorithms import PPOAlgorithmConfig
    from megatron_rlhf.config.ppo_run import ModelsConfig, RewardConfig, RolloutConfig, RunConfig
    from megatron_rlhf.engine.execution.episodes import EpisodeRollouts
    from megatron_rlhf.engine.run.build import build_engine, make_plan
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.generation.episodes import EpisodeConfig
    from megatron_rlhf.rewards.tools import Tools
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from megatron_rlhf.topology.cluster import cluster_from_environment
    from megatron_rlhf.topology.placement_config import PlacementConfig

    initialize_runtime()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 500, (int(n),), generator=generator).tolist()
               for n in torch.randint(2, 9, (8,), generator=generator)]
    records = [(i, {"id": i}) for i in range(8)]
    results = {}
    for run in RUNS:
        estimator, strategy = run.split("/")
        strategy, _, variant = strategy.partition("-")
        asynchronous = strategy == "async"
        tool = {"name": "agent_tools:calculator", "kwargs": {"scale": 2}}
        if variant == "tp2":
            tool["kwargs"]["log"] = f"{module_dir}/calls.log"
        config = RunConfig(
            placement=PlacementConfig(strategy="separation" if asynchronous else strategy,
                                      tp=2 if variant == "tp2" else 1),
            models=ModelsConfig(arch="tiny", init_seed=9),
            rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2, max_prompt_length=8,
                                  micro_batch_size=2, tools=[tool],
                                  max_turns=3, max_episode_tokens=64, tool_workers=1,
                                  async_rollout=asynchronous),
            generation=GenerationConfig(max_new_tokens=6, seed=3),
            reward=RewardConfig(model_weight=0.5, rule="none", rule_weight=1.0),
            algorithm=PPOAlgorithmConfig(advantage_estimator=estimator), steps=2)
        config.actor_optimizer.lr = 1e-3
        rollout = config.rollout
        episodes = EpisodeRollouts(
            EpisodeConfig(rollout.max_turns, rollout.max_episode_tokens, 6), _encode, _decode,
            tools=Tools(rollout.tool_specs, timeout_s=30.0, workers=1))
        engine = build_engine(config, make_plan(config, cluster_from_environment(None)),
                              eos_id=3, pad_id=0, episodes=episodes)
        algorithm = PPOAlgorithm(
            engine, config.algorithm, config.rollout, config.reward, seed=5,
            prompts=lambda s: (prompts[2 * s:2 * s + 2], [2 * s, 2 * s + 1]),
            total_steps=2, rule_reward=even_token_share,
            records=lambda s: records[2 * s:2 * s + 2])
        try:
            results[run] = [algorithm.step(s) for s in range(2)]
        finally:
            episodes.close()
    return results


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_tool_episodes_give_the_same_metrics_on_every_placement(tmp_path: Path) -> None:
    (tmp_path / "agent_tools.py").write_text(USER_MODULE)
    per_rank = run_on_ranks(_run, world_size=2, args=(str(tmp_path),), timeout_s=340,
                            env={"PYTHONPATH": str(tmp_path)})
    assert per_rank[0] == per_rank[1], "metrics must be identical on every rank"
    results = per_rank[0]
    for run, steps in results.items():
        estimator = run.split("/")[0]
        reference = results[f"{estimator}/flattening"]
        if not run.endswith("async"):  # tp2 too: within rounding
            for step, (metrics, ref) in enumerate(zip(steps, reference, strict=True)):
                assert_metrics_match(metrics, ref, COMPARED + (("value_loss",) if estimator ==
                                                              "gae" else ()),
                                     f"{run} step {step} vs flattening")
        for metrics in steps:
            assert metrics["rollout/turns"] > 1 and metrics["rollout/tool_calls"] > 0, run
            assert metrics["rollout/tool_errors"] == 0
            assert metrics["rollout/observation_tokens"] > 0
            assert metrics["rollout/tool_latency_s"] > 0
            # generation's log-probs of the policy's own tokens, after tool answers too, are
            # the trainer's forward over the whole episode
            assert metrics["rollout/logprob_diff_max"] < 2e-5, json.dumps(metrics)
    rows = 4  # two prompts, two samples each
    calls = sum(m["rollout/tool_calls"] * rows for m in results["grpo/flattening-tp2"])
    assert (tmp_path / "calls.log").read_text().count("call") == calls, "one call per call"
    # the shadows' first step is the synchronous one; the second is generated a step ahead
    assert_metrics_match(results["grpo/async"][0], results["grpo/separation"][0], COMPARED,
                         "async step 0")
