"""Tools (``rewards/tools.py``): checked when the config is built, run in worker processes with a
timeout; every way a call can go wrong is a one-line answer to the policy under
``tool_on_error=observe`` and a :class:`ToolError` naming the call under ``error``."""

from __future__ import annotations

import json

import pytest

from megatron_rlhf.rewards.tools import ToolCall, ToolError, Tools, parse_call, parse_tools

T = "tests.rewards.user_tools"


def _call(name: str, **arguments) -> str:
    return f'Let me compute. <tool_call>{json.dumps({"name": name, "arguments": arguments})}' \
           "</tool_call>"


def test_parse_call_reads_the_last_call() -> None:
    text = _call("calculator", a=1) + " and " + _call("hangs")
    assert parse_call(text) == ("hangs", {})
    with pytest.raises(ValueError, match="not JSON"):
        parse_call("<tool_call>{name: calculator}</tool_call>")
    with pytest.raises(ValueError, match='must be {"name"'):
        parse_call('<tool_call>{"name": "c", "arguments": [1]}</tool_call>')
    with pytest.raises(ValueError, match="no <tool_call>"):
        parse_call("</tool_call>")


def test_tools_are_checked_when_parsed() -> None:
    specs = parse_tools([{"name": f"{T}:calculator", "kwargs": {"digits": 1}}])
    assert specs[0].name == "calculator" and specs[0].kwargs == {"digits": 1}
    with pytest.raises(ValueError, match=r"rollout.tools\[0\].name='nowhere:f': module "):
        parse_tools([{"name": "nowhere:f"}])
    with pytest.raises(ValueError, match=r"rollout.tools\[0\].name=.*two_arguments.* cannot be "
                       r"called as tool\(arguments, record\)"):
        parse_tools([{"name": f"{T}:two_arguments"}])
    with pytest.raises(ValueError, match=r"cannot be called as tool\(arguments, record, "
                       r"base=...\)"):
        parse_tools([{"name": f"{T}:calculator", "kwargs": {"base": 2}}])
    with pytest.raises(ValueError, match=r"rollout.tools\[1\].*also called 'calculator'"):
        parse_tools([{"name": f"{T}:calculator"}, {"name": f"{T}:calculator"}])
    with pytest.raises(ValueError, match=r"rollout.tools\[0\]=.*must be a mapping"):
        parse_tools([{"name": f"{T}:calculator", "digits": 1}])


def test_every_failure_is_an_answer_and_good_calls_are_answered() -> None:
    tools = Tools(parse_tools([{"name": f"{T}:{name}"} for name in
                               ("calculator", "hangs", "not_text", "record_answer")]),
                  on_error="observe", timeout_s=1.0, workers=2)
    record = {"answer": 7}
    try:
        answers = tools.call([ToolCall(text, record, 3) for text in (
            _call("calculator", a=12, b=3, op="*"),
            _call("calculator", a=1),                    # wrong arguments: KeyError
            _call("hangs"),
            _call("not_text"),
            _call("search", q="x"),
            "<tool_call>{oops</tool_call>",
            _call("record_answer"),
        )])
    finally:
        tools.close()
    texts = [answer.text for answer in answers]
    assert texts[0] == "36" and texts[6] == "7"
    assert texts[1] == "error: tool 'calculator' raised KeyError: 'b'"
    assert texts[2] == ("error: tool 'hangs' ran past its timeout of 1.0 s "
                        "(rollout.tool_timeout_s)")
    assert texts[3] == "error: tool 'not_text' returned int 42, not a string"
    assert texts[4].startswith("error: unknown tool 'search'; the tools are ['calculator',")
    assert texts[5].startswith("error: the tool call is not JSON")
    assert [answer.failed for answer in answers] == [False, True, True, True, True, True, False]


def test_on_error_error_stops_naming_the_tool_and_the_record() -> None:
    tools = Tools(parse_tools([{"name": f"{T}:calculator"}]), on_error="error", timeout_s=5.0,
                  workers=1)
    try:
        with pytest.raises(ToolError, match=r"tool 'calculator' raised KeyError: 'b' on prompt "
                           r"record #4 \(\{\"answer\": 7\}\); call: .*; raised at "
                           r"tests/rewards/user_tools.py:11; fix the tool"):
            tools.call([ToolCall(_call("calculator", a=1), {"answer": 7}, 4)])
    finally:
        tools.close()
    with pytest.raises(ValueError, match="rollout.tool_on_error='zero'"):
        Tools([], on_error="zero")


def test_rollout_config_checks_tools_and_episode_bounds() -> None:
    from megatron_rlhf.config.ppo_run import RolloutConfig

    tools = [{"name": f"{T}:calculator"}]
    config = RolloutConfig(tools=tools, max_turns=3, max_episode_tokens=64)
    assert [spec.name for spec in config.tool_specs] == ["calculator"]
    with pytest.raises(ValueError, match=r"rollout.max_turns=0 must be >= 1"):
        RolloutConfig(tools=tools, max_turns=0, max_episode_tokens=64)
    with pytest.raises(ValueError, match=r"rollout.max_turns=3 bound "
                       r"episodes with tools or an environment; set rollout.tools"):
        RolloutConfig(max_turns=3)
    with pytest.raises(ValueError, match=r"rollout.max_episode_tokens=0: with rollout.tools"):
        RolloutConfig(tools=tools, max_episode_tokens=0)
    with pytest.raises(ValueError, match=r"rollout.tools\[0\].name='nowhere:calculator': "
                       r"module 'nowhere' does not import"):
        RolloutConfig(tools=[{"name": "nowhere:calculator"}], max_episode_tokens=64)
    with pytest.raises(ValueError, match=r"rollout.tool_on_error='zero'"):
        RolloutConfig(tools=tools, max_episode_tokens=64, tool_on_error="zero")


def test_a_turns_calls_run_concurrently_in_the_pool() -> None:
    """Four calls that each sleep 0.6 s on four workers take about 0.6 s, not 2.4 s: an episode
    waiting for its tool waits beside the others of its turn."""
    import time

    tools = Tools(parse_tools([{"name": f"{T}:naps"}]), timeout_s=10.0, workers=4)
    try:
        tools.call([ToolCall(_call("naps", s=0), {})] * 4)  # the workers start and import
        start = time.perf_counter()
        answers = tools.call([ToolCall(_call("naps", s=0.6), {})] * 4)
        seconds = time.perf_counter() - start
    finally:
        tools.close()
    assert [answer.text for answer in answers] == ["rested"] * 4
    assert 0.6 <= seconds < 1.5, seconds
    assert all(0.1 < answer.seconds < 0.6 for answer in answers), "the wall time shared out"
