"""Episodes against an environment (``rollout.environment``): every reply is answered, the
observation is encoded once and appended unmasked from attention but masked from the loss, the
step rewards are summed per episode, ``done`` ends it, and a failing environment stops the run
naming the record. One process, the tiny model."""

from __future__ import annotations

import signal
import time

import pytest

from megatron_rlhf.engine.execution.episodes import USER_MESSAGE, EpisodeRollouts, episode_metrics
from megatron_rlhf.generation import GenerationConfig, generate_sequences
from megatron_rlhf.generation.episodes import EpisodeConfig
from megatron_rlhf.rewards.environments import EnvironmentError_, _within, parse_environment
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


def _run(tiny, kwargs: dict, records, max_turns: int = 3, name: str = "Countdown",
         **settings):
    rollouts = EpisodeRollouts(EpisodeConfig(max_turns, 60, 5, stop=None), _encode, _decode,
                               environment=parse_environment({"name": f"{E}:{name}",
                                                              "kwargs": kwargs, **settings}),
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
    metrics = episode_metrics(stats, environment=True)
    assert metrics["rollout/environment_reward"] == 1.0 and metrics["rollout/truncated"] == 0.0
    # tool episodes carry the same (zero) reward field; without an environment it is no metric
    assert "rollout/environment_reward" not in episode_metrics(stats, environment=False)


def test_the_last_turn_truncates_and_an_opening_replaces_the_prompt(tiny) -> None:
    out, stats = _run(tiny, {"replies": 5, "opening": "hi"}, [(0, {}), (1, {})], max_turns=2)
    assert stats["episode_truncated"].tolist() == [1.0, 1.0]
    assert stats["episode_turns"].tolist() == [2.0, 2.0]
    prompt = out.input_ids[0, :out.prompt_length][out.prompt_mask[0].bool()].tolist()
    assert prompt == [2, *_encode("hi")]


def test_a_failing_environment_names_the_record(tiny) -> None:
    with pytest.raises(EnvironmentError_, match=r"rollout.environment 'tests.rewards.user_envs:"
                       r"Countdown' on prompt record #7: step\(\) raised RuntimeError: the "
                       r"board caught fire \(\{\"explode\": true\}\); raised at "
                       r"tests/rewards/user_envs.py:26$"):
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
    with pytest.raises(ValueError, match=r"rollout.environment.timeout_s=0 must be a number"):
        parse_environment({"name": f"{E}:Countdown", "timeout_s": 0})
    with pytest.raises(ValueError, match=r"rollout.environment.on_error='observe': use one"):
        parse_environment({"name": f"{E}:Countdown", "on_error": "observe"})
    spec = parse_environment({"name": f"{E}:Countdown", "timeout_s": 2, "on_error": "end"})
    assert (spec.timeout_s, spec.on_error) == (2.0, "end")


def test_a_hanging_step_stops_the_run_naming_the_environment_and_the_record(tiny) -> None:
    start = time.monotonic()
    with pytest.raises(EnvironmentError_, match=r"rollout.environment 'tests.rewards.user_envs:"
                       r"Sleepy' on prompt record #7: step\(\) ran past its timeout of 0.3 s "
                       r"\(rollout.environment.timeout_s\)"):
        _run(tiny, {}, [(3, {}), (7, {"hang": True})], name="Sleepy", timeout_s=0.3)
    assert time.monotonic() - start < 10, "the alarm must interrupt the 30 s sleep"


@pytest.mark.parametrize("record", [{"hang": True}, {"hang_reset": True}, {"explode": True}],
                         ids=["step-hangs", "reset-hangs", "step-raises"])
def test_with_on_error_end_a_failing_environment_ends_its_episode(tiny, record) -> None:
    start = time.monotonic()
    out, stats = _run(tiny, {"replies": 2}, [(0, {}), (1, record)], name="Sleepy",
                      timeout_s=0.3, on_error="end")
    assert time.monotonic() - start < 10
    # the healthy row runs its two turns; the failing one ends after its first reply, counted
    assert stats["episode_turns"].tolist() == [2.0, 1.0]
    assert stats["episode_tool_errors"].tolist() == [0.0, 1.0]
    assert stats["episode_observation_tokens"][1] == 0
    assert stats["episode_reward"].tolist() == [1.0, 0.0]
    assert episode_metrics(stats, environment=True)["rollout/tool_errors"] == 0.5


def test_an_alarm_already_set_is_put_back_with_the_time_it_has_left() -> None:
    """pytest-timeout (signal method) arms SIGALRM around a test: an environment call must not
    disarm it."""
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *_: fired.append(True))
    signal.setitimer(signal.ITIMER_REAL, 50.0)
    try:
        assert _within(lambda: 4, 1.0) == 4
        left, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 45 < left <= 50
        assert signal.getsignal(signal.SIGALRM) is not signal.SIG_DFL and not fired
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_off_the_main_thread_a_late_call_is_abandoned() -> None:
    import threading

    outcome = []

    def run() -> None:
        try:
            _within(lambda: time.sleep(5), 0.2)
        except BaseException as error:  # noqa: BLE001 - the test records what came out
            outcome.append(type(error).__name__)
        outcome.append(_within(lambda: 3, 1.0))

    start = time.monotonic()
    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert outcome == ["_Timeout", 3] and time.monotonic() - start < 4
