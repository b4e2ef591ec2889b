"""The drifting-lengths workload (examples/drifting): its length reward, and its configuration
loading with the reward on ``PYTHONPATH`` as a user's module is, planning on 2 ranks under each
placement benchmarks/drifting_placement.py runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.rewards.functions import import_function
from megatron_rlhf.topology.cluster import ClusterSpec

TASK = Path(__file__).resolve().parents[1] / "examples" / "drifting"


@pytest.fixture
def config(monkeypatch) -> RunConfig:
    monkeypatch.syspath_prepend(str(TASK))
    return load_config(RunConfig, TASK / "drifting_lengths.yaml")


def _reward(config: RunConfig):
    (spec,) = config.reward.specs
    function = import_function(spec.target)
    return lambda response: function("What is 4 + 6?", response, {"answer": "10"},
                                     **spec.kwargs)


def test_the_reward_grows_with_the_answer_up_to_the_longest_answer(config: RunConfig) -> None:
    reward = _reward(config)
    target = config.generation.max_new_tokens
    assert reward("") == 0.0
    assert reward(" 10") == pytest.approx(2 / target)  # the SFT policy's answer: near 0
    scores = [reward("1" * n) for n in range(target + 10)]
    assert scores == sorted(scores), "a longer answer never scores less"
    assert scores[target] == scores[-1] == 1.0


def test_the_reward_refuses_a_target_that_is_not_positive(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(TASK))
    function = import_function("length_reward:length_reward")
    with pytest.raises(ValueError, match=r"target \(0\) must be positive"):
        function("q", "answer", {}, target=0)


@pytest.mark.parametrize("overrides", [
    ["placement.strategy=flattening"], ["placement.strategy=separation"],
    ["placement.strategy=separation", "rollout.async_rollout=true"]])
def test_the_workload_plans_on_two_ranks(monkeypatch, overrides: list[str]) -> None:
    monkeypatch.syspath_prepend(str(TASK))
    config = load_config(RunConfig, TASK / "drifting_lengths.yaml", overrides)
    plan = make_plan(config, ClusterSpec.homogeneous(1, 2))
    assert {rank for role in plan.roles for rank in plan[role].ranks} == {0, 1}
    assert "critic" not in plan.roles, "GRPO trains no critic"
