"""Submitted tool calls (``Tools.submit``): each pending answer is what ``Tools.call`` answers
for the same call, good or failed, under ``tool_on_error=observe`` and ``error``; a call stuck
past its timeout is lost (its workers stopped) and the calls after it still answer."""

from __future__ import annotations

import json
import time

import pytest

from megatron_rlhf.rewards.tools import ToolCall, ToolError, Tools, parse_tools

T = "tests.rewards.user_tools"


def _call(name: str, **arguments) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


CALLS = (
    _call("calculator", a=12, b=3, op="*"),
    _call("calculator", a=1),                    # wrong arguments: KeyError
    _call("hangs"),                              # past its timeout, stopped by the timer
    _call("not_text"),
    _call("search", q="x"),                      # no such tool
    "<tool_call>{oops</tool_call>",              # not JSON
    _call("record_answer"),
)


def _tools(on_error: str = "observe", workers: int = 2) -> Tools:
    return Tools(parse_tools([{"name": f"{T}:{name}"} for name in
                              ("calculator", "hangs", "not_text", "record_answer", "naps",
                               "stuck")]),
                 on_error=on_error, timeout_s=1.0, workers=workers)


def test_submitted_calls_answer_as_call_does() -> None:
    calls = [ToolCall(text, {"answer": 7}, 3) for text in CALLS]
    tools = _tools()
    try:
        batch = tools.call(calls)
        pending = [tools.submit(call) for call in calls]
        assert pending[4].ready() and pending[5].ready(), "answered without the pool"
        tools.wait(pending)
        submitted = [p.answer(wait=True) for p in pending]
    finally:
        tools.close()
    assert [(a.text, a.failed) for a in submitted] == [(a.text, a.failed) for a in batch]
    assert submitted[0].text == "36" and submitted[2].failed and not submitted[6].failed
    assert submitted[2].seconds >= 1.0 and submitted[4].seconds == 0.0


def test_on_error_error_raises_the_same_error_from_the_answer() -> None:
    calls = [ToolCall(text, {"answer": 7}, 4) for text in CALLS[1:6]]
    tools = _tools("error")
    try:
        for call in calls:
            with pytest.raises(ToolError) as batch:
                tools.call([call])
            pending = tools.submit(call)  # returns; the error comes with the answer
            with pytest.raises(ToolError) as submitted:
                pending.answer(wait=True)
            assert str(submitted.value) == str(batch.value)
    finally:
        tools.close()


def test_an_answer_is_timed_as_it_came_back_and_read_only_once_back() -> None:
    tools = _tools()
    try:
        pending = tools.submit(ToolCall(_call("naps", s=0.5), {}))
        assert not pending.ready()
        with pytest.raises(RuntimeError, match="not back yet"):
            pending.answer(wait=False)
        answer = pending.answer(wait=True)
        late = tools.submit(ToolCall(_call("naps", s=0.2), {}))
        time.sleep(1.0)  # as if the rank were decoding: read late, timed as it came back
        read_late = late.answer(wait=False)
    finally:
        tools.close()
    assert (answer.text, answer.failed) == ("rested", False) and answer.seconds >= 0.5
    assert (read_late.text, read_late.failed) == ("rested", False)
    assert 0.2 <= read_late.seconds < 0.8, read_late.seconds


def test_a_stuck_call_is_lost_and_the_calls_after_it_answer(monkeypatch) -> None:
    monkeypatch.setattr("megatron_rlhf.rewards.pool._GRACE_S", 0.5)
    tools = _tools(workers=1)  # the calls after it wait behind it, then start on a new worker
    try:
        tools.call([ToolCall(_call("naps", s=0), {})])  # the workers start and import
        stuck = tools.submit(ToolCall(_call("stuck"), {}))
        after = [tools.submit(ToolCall(_call("naps", s=0.1), {})) for _ in range(3)]
        start = time.monotonic()
        lost = stuck.answer(wait=True)
        waited = time.monotonic() - start
        answers = [p.answer(wait=True) for p in after]
    finally:
        tools.close()
    assert lost.failed and lost.text == (
        "error: tool 'stuck' ran past its timeout of 1.0 s (rollout.tool_timeout_s) and could "
        "not be interrupted; its worker was stopped")
    assert 1.4 <= waited < 5.0, waited
    assert [(a.text, a.failed) for a in answers] == [("rested", False)] * 3
