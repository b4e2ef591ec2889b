"""The reward-function registry: the built-in verifiers are named without their module, an
unknown name is refused with the registered ones listed, and a function registered where it is
defined is accepted by the run's configuration and scored by the reward workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from megatron_rlhf.rewards import (
    REWARD_FUNCTIONS,
    RewardFunctions,
    RewardFunctionSpec,
    math_reward,
    parse_reward_functions,
    register_reward_function,
)

BUILT_IN = ["exact_reward", "format_reward", "math_reward", "regex_reward"]


def shouted(prompt: str, response: str, record: dict, *, bonus: float = 0.0) -> float:
    """A function none of the built-in ones is: 1 + bonus for an upper-case response."""
    return float(response.isupper()) + bonus


@pytest.fixture
def registered() -> Iterator[str]:
    register_reward_function("shouted")(shouted)
    yield "shouted"
    del REWARD_FUNCTIONS["shouted"]


def test_the_built_in_verifiers_are_registered_under_their_names() -> None:
    assert sorted(REWARD_FUNCTIONS) == BUILT_IN
    assert REWARD_FUNCTIONS["math_reward"] is math_reward
    by_name = parse_reward_functions([{"name": "math_reward", "weight": 0.5}])
    by_path = parse_reward_functions([{"name": "megatron_rlhf.rewards.verifiers:math_reward",
                                       "weight": 0.5}])
    assert by_name == by_path
    assert by_name[0].metric == "reward/math_reward"


def test_an_unknown_name_lists_the_registered_ones() -> None:
    with pytest.raises(ValueError, match=r"reward.functions\[1\].name='math' is no registered "
                                         r"reward function \(\['exact_reward', 'format_reward', "
                                         r"'math_reward', 'regex_reward'\]\)"):
        parse_reward_functions([{"name": "format_reward"}, {"name": "math"}])


def test_a_name_is_registered_once_and_must_be_importable() -> None:
    with pytest.raises(ValueError, match="'math_reward' is already registered"):
        register_reward_function("math_reward")(shouted)
    register_reward_function("local")(lambda prompt, response, record: 1.0)
    try:
        with pytest.raises(ValueError, match=r"name='local': the registered .*<lambda> is not "
                                             "importable by that path"):
            parse_reward_functions([{"name": "local"}])
    finally:
        del REWARD_FUNCTIONS["local"]


def test_a_new_function_passes_the_run_configuration_and_is_scored(registered: str) -> None:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    config = load_config(RunConfig, None, [
        "reward.model_weight=0", f"reward.functions=[{{name: {registered}, bonus: 0.5}}]"])
    target = f"{__name__}:shouted"
    assert config.reward.specs == [RewardFunctionSpec(target, 1.0, {"bonus": 0.5})]
    with pytest.raises(ValueError, match=r"\['bonsu'\] is not a keyword parameter"):
        parse_reward_functions([{"name": registered, "bonsu": 0.5}])
    functions = RewardFunctions(config.reward.specs)
    try:
        scores = functions.score(["p", "p"], ["LOUD", "quiet"], [(0, {}), (1, {})])
    finally:
        functions.close()
    assert scores.scores == [[1.5], [0.5]] and scores.errors == [0, 0]
