"""Reward functions: checked when the config is built, called in worker processes, and every
kind of bad function (raises, hangs, returns NaN, a string or a dict without a score) either
named with its record or, with ``on_error="zero"``, scored 0 and counted.

The pool's workers are real spawned processes; each test closes its pool, and the last one
checks that no worker outlives ``close``.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rlhf.rewards import (
    RewardFunctionError,
    RewardFunctions,
    RewardFunctionSpec,
    parse_reward_functions,
)
from megatron_rlhf.rewards.pool import raised_at

USER = "tests.rewards.user_functions"


def _functions(*names: str, **kwargs) -> RewardFunctions:
    return RewardFunctions(parse_reward_functions([{"name": f"{USER}:{n}"} for n in names]),
                           **kwargs)


def test_entries_become_specs_with_weights_and_keyword_arguments() -> None:
    specs = parse_reward_functions([
        {"name": f"{USER}:answer_in_response", "weight": 2, "bonus": 0.5},
        {"name": "megatron_rlhf.rewards.verifiers:math_reward"}])
    assert specs == [RewardFunctionSpec(f"{USER}:answer_in_response", 2.0, {"bonus": 0.5}),
                     RewardFunctionSpec("megatron_rlhf.rewards.verifiers:math_reward", 1.0, {})]
    assert [spec.metric for spec in specs] == ["reward/answer_in_response", "reward/math_reward"]


@pytest.mark.parametrize(("entry", "message"), [
    ({"weight": 1.0}, r"reward.functions\[0\]=.* must be a mapping with a 'name'"),
    ({"name": "no_colon"}, r"reward.functions\[0\].name='no_colon' is no registered reward "
                           r"function \(\['exact_reward', 'format_reward', 'math_reward', 'rege"),
    ({"name": "tests.rewards.missing:f"}, r"module 'tests.rewards.missing' does not import"),
    ({"name": f"{USER}:absent"}, r"has no callable 'absent'"),
    ({"name": f"{USER}:NOT_CALLABLE"}, r"has no callable 'NOT_CALLABLE'"),
    ({"name": f"{USER}:graded", "weight": float("nan")}, r"weight=nan must be a finite number"),
    ({"name": f"{USER}:graded", "weight": "1"}, r"weight='1' must be a finite number"),
    ({"name": f"{USER}:answer_in_response", "bonsu": 1.0},
     r"reward.functions\[0\] = tests.rewards.user_functions:answer_in_response\(prompt, "
     r"response, record, bonus=0.0\): \['bonsu'\] "
     r"is not a keyword parameter of tests.rewards.user_functions:answer_in_response; an "
     r"entry's keys other than 'name' and 'weight' are passed to the function as keyword "
     r"arguments: rename it to one of \['bonus'\], remove it, or add it"),
    ({"name": f"{USER}:wrong_signature"},
     r"reward.functions\[0\] = tests.rewards.user_functions:wrong_signature\(response, "
     r"answer\) cannot be called as wrong_signature\(prompt, response, record\) "
     r"\(too many positional arguments\): a reward function takes the prompt text, the "
     r"response text and the prompt's record \(a dict\) as its first three positional "
     r"parameters; define it as `def wrong_signature\(prompt, response, record\): \.\.\.`"),
    ({"name": f"{USER}:needs_threshold"},
     r"tests.rewards.user_functions:needs_threshold requires \['threshold'\], which the entry "
     r"does not give: add threshold: <value> to reward.functions\[0\]"),
])
def test_bad_entries_are_refused_naming_the_entry(entry: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_reward_functions([entry])


def test_two_functions_logged_under_one_name_are_refused() -> None:
    with pytest.raises(ValueError, match=r"functions\[1\].*also logged as 'reward/graded'"):
        parse_reward_functions([{"name": f"{USER}:graded"}, {"name": f"{USER}:graded"}])


def test_scores_per_row_and_function_with_the_record_and_dict_results() -> None:
    functions = RewardFunctions(parse_reward_functions([
        {"name": f"{USER}:answer_in_response", "bonus": 0.5}, {"name": f"{USER}:graded"}]))
    try:
        scores = functions.score(["p0", "p0", "p1"], ["it is 12", "it is 3", "abc"],
                                 [(0, {"answer": "12"}), (0, {"answer": "12"}),
                                  (5, {"answer": "x"})])
    finally:
        functions.close()
    assert scores.scores == [[1.5, 0.5], [0.0, 0.5], [0.0, 0.5]]
    assert scores.errors == [0, 0, 0]
    assert scores.extras == {"reward/graded/length": [8.0, 7.0, 3.0]}


BAD = [("explodes", "raised ZeroDivisionError: the grader divided by zero"),
       ("hangs", "ran past its timeout of 1.0 s (reward.timeout_s)"),
       ("not_a_number", "returned nan, not a finite number"),
       ("a_string", "returned str '1.0', not a number"),
       ("no_score_key", "returned a dict without a 'score' key: ['correct']")]


@pytest.mark.parametrize(("name", "what"), BAD)
def test_a_bad_call_is_named_with_its_record(name: str, what: str) -> None:
    functions = _functions(name, timeout_s=1.0)
    record = {"prompt": "What is 6 * 7? " + "x" * 200, "answer": "42"}
    try:
        with pytest.raises(RewardFunctionError) as raised:
            functions.score(["p"], ["42"], [(17, record)])
    finally:
        functions.close()
    message = str(raised.value)
    assert message.startswith(f"reward function '{USER}:{name}' {what} on prompt record #17 "
                              '({"prompt": "What is 6 * 7? xxx')
    where = "; raised at tests/rewards/user_functions.py:23" if name == "explodes" else ""
    assert f"...){where}; fix the function, or set reward.on_error=zero" in message


def test_with_on_error_zero_bad_calls_score_zero_and_are_counted() -> None:
    functions = RewardFunctions(parse_reward_functions(
        [{"name": f"{USER}:answer_in_response"}] + [{"name": f"{USER}:{name}"}
                                                    for name, _ in BAD]),
        on_error="zero", timeout_s=2.0, workers=4)
    try:
        functions.score(["p"], ["42"], [(0, {"answer": "42"})])  # start the workers
        start = time.monotonic()
        scores = functions.score(["p", "p"], ["42", "41"],
                                 [(0, {"answer": "42"}), (0, {"answer": "42"})])
        seconds = time.monotonic() - start
    finally:
        functions.close()
    assert scores.scores == [[1.0, 0, 0, 0, 0, 0], [0.0, 0, 0, 0, 0, 0]]
    assert scores.errors == [5, 5]
    # The two hanging calls run side by side on four workers: one timeout (2 s), not two.
    assert seconds < 3.5


def test_the_pool_outlives_a_failed_batch_and_close_leaves_no_process() -> None:
    functions = _functions("answer_in_response", "explodes", on_error="zero", workers=2)
    try:
        first = functions.score(["p"], ["12"], [(0, {"answer": "12"})])
        workers = list(functions._pool._pool)
        second = functions.score(["p"], ["12"], [(0, {})])   # answer_in_response raises too
    finally:
        functions.close()
    assert (first.scores, first.errors, second.scores, second.errors) == (
        [[1.0, 0.0]], [1], [[0.0, 0.0]], [2])
    assert functions._pool is None
    assert not any(process.is_alive() for process in workers)
    assert mp.active_children() == []


def test_workers_ignore_the_jobs_sigterm_and_close_never_waits_on_a_dead_one() -> None:
    """The SIGTERM a launcher sends its process group is the rank's to act on; a worker killed
    while it held the pool's queue lock used to hang ``close`` (``Pool.terminate``) for good."""
    import signal
    import threading

    functions = _functions("graded", workers=2)
    try:
        functions.score(["p"], ["r"], [(0, {})])
        workers = list(functions._pool._pool)
        assert all(os.getpgid(w.pid) == w.pid != os.getpgid(0) for w in workers)
        for worker in workers:
            os.kill(worker.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert all(worker.is_alive() for worker in workers)
        assert functions.score(["p"], ["r"], [(0, {})]).scores == [[0.5]]
        for worker in workers:  # an idle worker waits for its next call holding the lock
            os.kill(worker.pid, signal.SIGKILL)
    finally:
        closer = threading.Thread(target=functions.close, daemon=True)
        closer.start()
        closer.join(20)
    assert not closer.is_alive(), "close() hung on a dead worker's lock"
    assert functions._pool is None and mp.active_children() == []


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"reward.on_error='skip': use one of \('error', 'zero'"):
        RewardFunctions([], on_error="skip")
    with pytest.raises(ValueError, match=r"reward.timeout_s=0 must be > 0"):
        RewardFunctions([], timeout_s=0)
    with pytest.raises(ValueError, match=r"reward.workers=0 must be >= 1"):
        RewardFunctions([], workers=0)


def test_a_call_the_timer_cannot_stop_is_caught_and_the_rest_run_on_new_workers() -> None:
    functions = _functions("stuck_if_flagged", on_error="zero", timeout_s=0.5, workers=1)
    try:
        functions.score(["p"], ["r"], [(0, {})])  # start the worker
        stuck_worker = functions._pool._pool[0].pid
        start = time.monotonic()
        scores = functions.score(["p"] * 3, ["r"] * 3,
                                 [(0, {"stuck": True}), (1, {}), (2, {})])
        seconds = time.monotonic() - start
    finally:
        functions.close()
    assert (scores.scores, scores.errors) == ([[0.0], [1.0], [1.0]], [1, 0, 0])
    # One deadline (0.5 s + 5 s slack) and a restart, not one deadline per later call.
    assert seconds < 0.5 + 5.0 + 4.0
    assert not _running(stuck_worker)
    assert mp.active_children() == []


def test_a_stuck_call_is_named_with_on_error_error() -> None:
    functions = _functions("stuck_if_flagged", timeout_s=0.5, workers=1)
    try:
        with pytest.raises(RewardFunctionError, match=r"'tests.rewards.user_functions:stuck_if_"
                                                      r"flagged' ran past its timeout of 0.5 s "
                                                      r"\(reward.timeout_s\) and could not be "
                                                      r"interrupted; its worker was stopped on "
                                                      r"prompt record #4"):
            functions.score(["p"], ["r"], [(4, {"stuck": True})])
    finally:
        functions.close()


def test_reward_config_checks_its_functions_before_any_process_group() -> None:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RewardConfig, RunConfig

    config = load_config(RunConfig, None, [
        "reward.model_weight=0", "reward.on_error=zero",
        f"reward.functions=[{{name: '{USER}:answer_in_response', weight: 0.5, bonus: 1.0}}]"])
    assert config.reward.specs == [
        RewardFunctionSpec(f"{USER}:answer_in_response", 0.5, {"bonus": 1.0})]
    with pytest.raises(ValueError, match=r"reward.functions\[0\].name='tests.rewards.nope:f': "
                                         "module 'tests.rewards.nope' does not import"):
        RewardConfig(functions=[{"name": "tests.rewards.nope:f"}])
    with pytest.raises(ValueError, match=r"reward.functions\[0\].weight=inf must be a finite"):
        RewardConfig(functions=[{"name": f"{USER}:graded", "weight": float("inf")}])
    with pytest.raises(ValueError, match=r"reward.functions\[0\] = tests.rewards.user_functions"
                                         r":graded\(.*\['answer_key'\] is not a keyword "
                                         r"parameter of tests.rewards.user_functions:graded; .*"
                                         r"graded takes none: remove it"):
        RewardConfig(functions=[{"name": f"{USER}:graded", "answer_key": "x"}])
    with pytest.raises(ValueError, match=r"reward.on_error='skip': use one of"):
        RewardConfig(on_error="skip")
    with pytest.raises(ValueError, match=r"reward.timeout_s=-1 must be > 0"):
        RewardConfig(timeout_s=-1)


def test_reward_config_imports_its_functions_once_not_at_every_read(monkeypatch) -> None:
    """``reward.specs`` is read in the step loop: the entries are parsed (their modules
    imported) when the config is built, and no later read imports again."""
    import dataclasses
    import importlib

    from megatron_rlhf.config.ppo_run import RewardConfig

    imported: list[str] = []
    real = importlib.import_module

    def counting(name: str, package: str | None = None):
        imported.append(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", counting)
    config = RewardConfig(functions=[{"name": f"{USER}:graded"}, {"name": "math_reward"}])
    assert set(imported) == {USER, "megatron_rlhf.rewards.verifiers"}, imported
    built = len(imported)
    first = config.specs
    for _ in range(5):
        assert config.specs is first
    assert len(imported) == built, imported
    assert [spec.target for spec in first] == [f"{USER}:graded",
                                                "megatron_rlhf.rewards.verifiers:math_reward"]
    changed = dataclasses.replace(config, functions=[{"name": f"{USER}:graded", "weight": 2}])
    assert imported[built:] == [USER] and changed.specs[0].weight == 2.0
    assert config.specs is first


def test_a_bad_reward_function_is_still_refused_when_the_config_is_built() -> None:
    from megatron_rlhf.config.ppo_run import RewardConfig

    for _ in range(2):  # a refusal is not cached: each build refuses it the same way
        with pytest.raises(ValueError) as refused:
            RewardConfig(functions=[{"name": "tests.rewards.nope:f"}])
        assert str(refused.value) == (
            "reward.functions[0].name='tests.rewards.nope:f': module 'tests.rewards.nope' does "
            "not import (ModuleNotFoundError: No module named 'tests.rewards.nope'); check the "
            "name and that it is on PYTHONPATH")


def _grpo(*overrides: str):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    return load_config(RunConfig, Path("examples/ppo_grpo_tiny.yaml"), [
        "reward.model_weight=0", "reward.rule=none", *overrides])


def test_an_environment_is_a_reward_source_and_nothing_else_is_refused() -> None:
    config = _grpo("rollout.environment={name: 'tests.rewards.user_envs:Countdown'}",
                   "rollout.max_turns=3", "rollout.max_episode_tokens=32")
    assert config.rollout.environment_spec is not None and not config.placement.reward
    with pytest.raises(ValueError, match=r"leaves no reward; set a rule, reward.functions, "
                                         r"rollout.environment or a non-zero model_weight"):
        _grpo()
    assert _grpo(f"reward.functions=[{{name: '{USER}:graded'}}]").reward.specs


_KILLED_RANK = """
import sys
from megatron_rlhf.rewards import RewardFunctions, parse_reward_functions

if __name__ == "__main__":
    functions = RewardFunctions(parse_reward_functions(
        [{"name": "tests.rewards.user_functions:hangs"},
         {"name": "tests.rewards.user_functions:graded"}]), on_error="zero", timeout_s=2.0)
    functions.score(["p"], ["r"], [(0, {})])
    print(*(process.pid for process in functions._pool._pool), flush=True)
    while True:
        functions.score(["p"], ["r"], [(0, {})])
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_workers_of_a_killed_rank_exit_by_themselves_within_the_timeout(tmp_path: Path) -> None:
    """A rank killed with SIGKILL runs no ``finally``: its workers see their pipe close, and one
    busy in a hanging call follows when the call's timer fires."""
    script = tmp_path / "rank.py"
    script.write_text(_KILLED_RANK)
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    try:
        workers = [int(pid) for pid in rank.stdout.readline().split()]
        assert len(workers) == 2 and all(_running(pid) for pid in workers)
    finally:
        rank.kill()
        rank.wait()
    deadline = time.monotonic() + 2.0 + 3.0
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_running(pid) for pid in workers)


def test_workers_that_do_not_start_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rlhf.rewards import pool

    monkeypatch.setattr(pool, "_START_S", 0.001)  # no spawned process starts that fast
    functions = _functions("graded")
    with pytest.raises(RewardFunctionError, match=r"workers did not start within 0 s; a worker "
                                                  r"imports the run's entry script again"):
        functions.score(["p"], ["r"], [(0, {})])
    assert functions._pool is None and mp.active_children() == []


def test_the_place_that_raised_is_the_users_line_not_the_librarys() -> None:
    def users_function() -> None:
        json.loads("{")  # raises inside the standard library's json/decoder.py

    with pytest.raises(ValueError) as raised:
        users_function()
    line = users_function.__code__.co_firstlineno + 1
    assert raised_at(raised.value) == f"tests/rewards/test_reward_functions.py:{line}"
