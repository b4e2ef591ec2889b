"""Episodes against an environment (``rollout.environment``): every reply is answered, the
observation is encoded once and appended unmasked from attention but masked from the loss, the
step rewards are summed per episode, ``done`` ends it, and a failing environment stops the run
naming the record. One process, the tiny model."""

from __future__ import annotations

import pytest

from megatron_rlhf.engine.execution.episodes import USER_MESSAGE, EpisodeRollouts, episode_metrics
from megatron_rlhf.generation import GenerationConfig, generate_sequences
from megatron_rlhf.generation.episodes import EpisodeConfig
from megatron_rlhf.rewards.environments import EnvironmentError_, parse_environment
from tests.generation.helpers import PAD, make_prompts

E = "tests.rewards.user_envs"


def _encode(text: str) -> list[int]:
    return [10 + ord(c) % 200 for c in text]


def _decode(ids: list[int]) -> str:
    return "".join(chr(97 + t % 26) for t in ids)


class _Worker:
    def __init__(self, tiny) -> None:
        self.model, self.pg_collection = tiny

    def generate(self, prompts, ids, config, eos_id, pad_id):
        return generate_sequences(self.model, self.pg_collection, prompts, ids, config, eos_id,
                                  pad_id)


def _run(tiny, kwargs: dict, records, max_turns: int = 3):
    rollouts = EpisodeRollouts(EpisodeConfig(max_turns, 60, 5, stop=None), _encode, _decode,
                               environment=parse_environment({"name": f"{E}:Countdown",
                                                              "kwargs": kwargs}),
                               encode_prompt=lambda text: [2, *_encode(text)])
    prompts = make_prompts([4, 6], seed=1)
    return rollouts.run(_Worker(tiny), prompts, [0, 1], records,
                        GenerationConfig(seed=2, temperature=1.0), 249, PAD)


def test_every_reply_is_answered_until_done_and_rewards_add_up(tiny) -> None:
    out, stats = _run(tiny, {"replies": 2, "reward": 0.5}, [(0, {}), (1, {})])
    assert stats["episode_turns"].tolist() == [2.0, 2.0]
    assert stats["episode_reward"].tolist() == [1.0, 1.0]
    assert stats["episode_tool_calls"].tolist() == [0.0, 0.0]
    observation = _encode(USER_MESSAGE.format(observation="left 1"))
    width = out.prompt_length
    for row in range(2):
        span = out.input_ids[row, width:][out.attention_mask[row, width:].bool()].tolist()
        mask = out.response_mask[row, :len(span)].tolist()
        first = mask.index(0)
        assert span[first:first + len(observation)] == observation
        assert mask == [1] * first + [0] * len(observation) + [1] * (
            len(span) - first - len(observation))
    assert stats["episode_observation_tokens"].tolist() == [len(observation)] * 2
    metrics = episode_metrics(stats)
    assert metrics["rollout/environment_reward"] == 1.0 and metrics["rollout/truncated"] == 0.0


def test_the_last_turn_truncates_and_an_opening_replaces_the_prompt(tiny) -> None:
    out, stats = _run(tiny, {"replies": 5, "opening": "hi"}, [(0, {}), (1, {})], max_turns=2)
    assert stats["episode_truncated"].tolist() == [1.0, 1.0]
    assert stats["episode_turns"].tolist() == [2.0, 2.0]
    prompt = out.input_ids[0, :out.prompt_length][out.prompt_mask[0].bool()].tolist()
    assert prompt == [2, *_encode("hi")]


def test_a_failing_environment_names_the_record(tiny) -> None:
    with pytest.raises(EnvironmentError_, match=r"rollout.environment 'tests.rewards.user_envs:"
                       r"Countdown' on prompt record #7: step\(\) raised RuntimeError: the "
                       r"board caught fire"):
        _run(tiny, {}, [(3, {}), (7, {"explode": True})])


def test_environment_config_is_checked() -> None:
    from megatron_rlhf.config.ppo_run import RolloutConfig

    config = RolloutConfig(environment={"name": f"{E}:Countdown", "kwargs": {"replies": 3}},
                           max_turns=3, max_episode_tokens=32)
    assert config.multi_turn and config.environment_spec.kwargs == {"replies": 3}
    with pytest.raises(ValueError, match=r"has no method \['step'\]"):
        RolloutConfig(environment={"name": f"{E}:NoStep"}, max_episode_tokens=32)
    with pytest.raises(ValueError, match="rollout.tools and rollout.environment are both set"):
        RolloutConfig(environment={"name": f"{E}:Countdown"}, max_episode_tokens=32,
                      tools=[{"name": "tests.rewards.user_tools:calculator"}])
