"""A rank that raises, dies or hangs inside a stage makes every other rank stop, within the
process-group timeout, with an error naming that rank and its stage; ranks that disagree at a
checked stage boundary get a clear error instead of a deadlock.

The workload is a loop of collectives inside stages (no models), so each case costs a few seconds;
tests/reliability/test_resume.py covers the same machinery inside real PPO runs. A disagreement
leaves the process group usable, so that case runs first in the same processes as the raise.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from tests.multirank import MultiRankError, run_on_ranks

TIMEOUT_S = 5.0
GRACE_S = 2.0
VICTIM = 2


def _collective_loops(kinds: list[str], out_dir: str) -> None:
    """Run :func:`_collective_loop` for each kind in turn."""
    from megatron_rlhf.runtime.faults import FaultConfig, install_fault_tracker

    tracker = install_fault_tracker(FaultConfig(grace_s=GRACE_S), timeout_s=TIMEOUT_S)
    for kind in kinds:
        _collective_loop(tracker, kind, out_dir)


def _collective_loop(tracker, kind: str, out_dir: str) -> None:
    """Three checked steps of collectives; rank VICTIM misbehaves in step 1. Each rank writes
    what happened to ``out_dir/<kind>-<rank>.json`` (a killed rank cannot return a value)."""
    import torch
    import torch.distributed as dist

    from megatron_rlhf.runtime.faults import RankFailure

    stage = tracker.stage

    rank = dist.get_rank()
    start = time.monotonic()
    outcome: dict = {"status": "finished"}
    try:
        for step in range(3):
            signature = (step, 99) if kind == "disagree" and rank == 1 and step == 1 else (step,)
            with stage(f"step {step}", signature=signature):
                with stage("work/inject"):
                    if rank == VICTIM and step == 1:
                        _misbehave(kind, out_dir)
                with stage("work/all_reduce"):
                    dist.all_reduce(torch.ones(8))
    except RankFailure as failure:
        outcome = {"status": "rank_failure", "message": str(failure)}
    except ValueError as error:
        outcome = {"status": "raised", "message": str(error)}
    outcome["seconds"] = time.monotonic() - start
    Path(out_dir, f"{kind}-{rank}.json").write_text(json.dumps(outcome))
    # The harness's store lives in rank 0's process (under torchrun it lives in the launcher):
    # rank 0 stays until the other survivors have read it for their diagnosis and reported.
    survivors = 4 - (kind in ("kill", "hang"))
    deadline = time.monotonic() + 30
    while (rank == 0 and len(list(Path(out_dir).glob(f"{kind}-*.json"))) < survivors
           and time.monotonic() < deadline):
        time.sleep(0.1)


def _misbehave(kind: str, out_dir: str) -> None:
    if kind == "raise":
        raise ValueError("injected failure")
    if kind == "kill":
        os.kill(os.getpid(), 9)
    if kind == "hang":  # until the other ranks have given up on this one (or 30 s)
        deadline = time.monotonic() + 30
        while len(list(Path(out_dir).glob("hang-*.json"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        os._exit(0)


def _outcomes(kinds: list[str], tmp_path: Path) -> dict[str, dict[int, dict]]:
    try:
        run_on_ranks(_collective_loops, world_size=4, args=(kinds, str(tmp_path)), timeout_s=60)
    except MultiRankError as error:
        if kinds[-1] not in ("kill", "hang"):  # only a killed or hung rank may fail to report
            raise
        assert f"rank {VICTIM}" in str(error)
    return {kind: {int(p.stem.rsplit("-", 1)[1]): json.loads(p.read_text())
                   for p in tmp_path.glob(f"{kind}-*.json")} for kind in kinds}


@pytest.fixture(scope="module")
def disagree_then_raise(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict]]:
    return _outcomes(["disagree", "raise"], tmp_path_factory.mktemp("faults"))


@pytest.mark.multirank
@pytest.mark.parametrize("kind, expected", [
    ("raise", "rank 2 raised ValueError: injected failure in stage 'work/inject'"),
    ("kill", "rank 2 stopped in stage 'work/inject'"),
    ("hang", "rank 2 stopped in stage 'work/inject'"),
])
def test_other_ranks_name_the_failed_rank_and_stage(kind: str, expected: str, tmp_path: Path,
                                                    request: pytest.FixtureRequest) -> None:
    if kind == "raise":
        outcomes = request.getfixturevalue("disagree_then_raise")[kind]
    else:
        outcomes = _outcomes([kind], tmp_path)[kind]
    for rank in (0, 1, 3):
        outcome = outcomes[rank]
        assert outcome["status"] == "rank_failure", (rank, outcome)
        assert expected in outcome["message"], (rank, outcome["message"])
        assert outcome["seconds"] < TIMEOUT_S + GRACE_S + 3, (rank, outcome)
    if kind == "kill":
        assert "is gone: killed or crashed" in outcomes[0]["message"]
    if kind == "hang":
        assert "alive but not in the collective" in outcomes[0]["message"]
    if kind == "raise":
        assert outcomes[VICTIM]["status"] == "raised"


@pytest.mark.multirank
def test_ranks_that_disagree_stop_with_the_same_clear_error(
        disagree_then_raise: dict[str, dict[int, dict]]) -> None:
    outcomes = disagree_then_raise["disagree"]
    messages = {outcomes[rank]["message"] for rank in range(4)}
    assert len(messages) == 1, messages
    message = messages.pop()
    assert "ranks disagree" in message
    assert "ranks [0, 2, 3]: stage #2 'step 1' with (1,)" in message
    assert "ranks [1]: stage #2 'step 1' with (1, 99)" in message


@pytest.mark.parametrize("error, collective", [
    (RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]"), True),
    (RuntimeError("Timed out waiting 30000ms for recv operation to complete"), True),
    ("backend:NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a "
     "network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a "
     "network error or a remote process exiting prematurely.", True),
    ("backend:Watchdog caught collective operation timeout: WorkNCCL(SeqNum=12, "
     "OpType=ALLREDUCE) ran for 600000 milliseconds before timing out.", True),
    ("backend:NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version "
     "2.21.5\nncclUnhandledCudaError: Call to CUDA function failed.\nCUDA error: out of memory",
     False),
    ("backend:NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage, NCCL version 2.21.5\n"
     "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.", False),
    (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (NCCL buffers)"), False),
    (ValueError("timeout must be positive"), False),
])
def test_collective_errors_are_told_from_causes_on_this_rank(error, collective: bool) -> None:
    """A peer that is gone or late is a collective failure; an error that names NCCL but whose
    cause is this rank's (memory, invalid usage) is reported as itself."""
    import torch.distributed as dist

    from megatron_rlhf.runtime.faults import is_collective_error

    if isinstance(error, str):
        error = dist.DistBackendError(error.removeprefix("backend:"))
    assert is_collective_error(error) is collective
    assert is_collective_error(dist.DistNetworkError("connection refused"))


def _reward_timeout_in_a_stage() -> dict:
    """Rank 1 scores a row with a reward function that runs past its timeout, inside a stage;
    rank 0 waits for it in an all-reduce. Each returns what it raised."""
    import torch
    import torch.distributed as dist

    from megatron_rlhf.rewards import RewardFunctions, parse_reward_functions
    from megatron_rlhf.runtime.faults import FaultConfig, install_fault_tracker

    tracker = install_fault_tracker(FaultConfig(grace_s=GRACE_S), timeout_s=TIMEOUT_S)
    try:
        with tracker.stage("step 0", signature=(0,)):
            if dist.get_rank() == 1:
                with tracker.stage("experience/reward"):
                    functions = RewardFunctions(parse_reward_functions(
                        [{"name": "tests.rewards.user_functions:hangs"}]), timeout_s=0.5,
                        workers=1)
                    try:
                        functions.score(["p"], ["r"], [(7, {"answer": "42"})])
                    finally:
                        functions.close()
            dist.all_reduce(torch.ones(1))
    except Exception as error:  # noqa: BLE001 - the test reads what each rank raised
        return {"type": type(error).__name__, "message": str(error)}
    return {"type": None}


@pytest.mark.multirank
def test_a_reward_function_past_its_timeout_is_its_ranks_own_failure() -> None:
    """The rank whose function timed out raises that error, in full, not a collective failure
    ("no other rank reported a failure of its own"); the waiting rank names it."""
    outcomes = run_on_ranks(_reward_timeout_in_a_stage, world_size=2, timeout_s=60)
    own = outcomes[1]
    assert own["type"] == "RewardFunctionError", own
    assert own["message"].startswith("reward function 'tests.rewards.user_functions:hangs' ran "
                                     "past its timeout of 0.5 s (reward.timeout_s) on prompt "
                                     'record #7 ({"answer": "42"}); fix the function'), own
    assert "no other rank reported" not in own["message"]
    other = outcomes[0]
    assert other["type"] == "RankFailure", other
    assert ("rank 1 raised RewardFunctionError: reward function "
            "'tests.rewards.user_functions:hangs' ran past its timeout") in other["message"]
