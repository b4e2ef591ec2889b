"""The step's end without a world collective: under separation a rank done with its part of a
step used to wait for the trainers in a world collective (the metrics' all-gather, the
preemption check) that the process-group timeout (under NCCL, its watchdog, counting from the
post) ends. It now waits in the job's store, with no deadline.

* a 4-rank separation run (trainers on ranks 0-1) whose trainers end each step more than the
  world group's timeout after the other ranks completes its steps, with the same metrics on
  every rank. The trainers sleep after the weight sync: the shadows on ranks 2-3 wait in the
  sync (under ``runtime.transfer_timeout_s``) through slow updates, so only a slow end of the
  trainers' step reaches the step-end exchange; before the exchange this failed with gloo's
  "Timed out waiting 4000ms" in ``share_metrics``. Its held-out evaluations (before the first
  step and after the last) answer slower than the world timeout on the ranks that generate,
  while the trainers, which hold no rows, wait for their metrics: in the store too (a world
  ``all_gather_object`` there timed out the same way);
* the store exchange itself: a rank late by more than the world timeout is waited for, every
  rank gets every rank's object in rank order, the store keeps no key of a finished exchange,
  and a peer that stopped (its fault record says it raised) ends the wait with ``PeerStopped``.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.helpers.runs import separation_config
from tests.multirank import run_on_ranks

WORLD_TIMEOUT_S = 4.0
UPDATE_SLEEP_S = 1.0  # x 4 updates per step (actor and critic, 2 mini-batches)
SYNC_SLEEP_S = 6.0
EVAL_SLEEP_S = 5.0  # per evaluation, on the ranks that answer


def _slow_trainer_run(root: str) -> list[dict]:
    from megatron_rlhf.config.ppo_run import EvalConfig
    from megatron_rlhf.engine.execution.ppo_engine import PPOEngine
    from megatron_rlhf.engine.run.evaluation import HeldOutEvaluator
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm

    update, sync, step = PPOEngine.update, PPOEngine.sync_weights, PPOAlgorithm.step
    answer, evaluate = HeldOutEvaluator._answer_and_score, HeldOutEvaluator.evaluate
    steps: list[dict] = []
    stepping: list[int] = []

    def slow_update(self, *args, **kwargs):
        time.sleep(UPDATE_SLEEP_S)
        return update(self, *args, **kwargs)

    def slow_sync(self):  # the step's, not the one that ends building the engine
        sync(self)
        if stepping and set(self.workers) & {"actor", "critic"}:
            time.sleep(SYNC_SLEEP_S)

    def recorded_step(self, index):
        begin = time.monotonic()
        stepping.append(index)
        metrics = step(self, index)
        steps.append({**metrics, "seconds": time.monotonic() - begin,
                      "trains": bool(set(self.engine.workers) & {"actor", "critic"})})
        return metrics

    def slow_answer(self, mode):
        metrics = answer(self, mode)
        if metrics and mode == "sampled":  # a rank that answered and scored
            time.sleep(EVAL_SLEEP_S)
        return metrics

    def recorded_evaluation(self):
        begin = time.monotonic()
        metrics = evaluate(self)
        steps.append({**metrics, "seconds": time.monotonic() - begin, "evaluation": True})
        return metrics

    PPOEngine.update, PPOEngine.sync_weights, PPOAlgorithm.step = (slow_update, slow_sync,
                                                                   recorded_step)
    HeldOutEvaluator._answer_and_score = slow_answer
    HeldOutEvaluator.evaluate = recorded_evaluation
    config = separation_config(root, "slow", steps=2,
                               evaluation=EvalConfig(num_prompts=4, interval=0))
    config.runtime.distributed.timeout_s = WORLD_TIMEOUT_S
    run_ppo(config)
    return steps


@pytest.mark.multirank
@pytest.mark.timeout(340)
def test_ranks_that_only_score_outwait_a_trainer_slower_than_the_world_timeout(
        tmp_path: Path) -> None:
    per_rank = run_on_ranks(_slow_trainer_run, world_size=4, args=(str(tmp_path),),
                            timeout_s=300)
    evaluations = [[record for record in records if record.get("evaluation")]
                   for records in per_rank]
    ranks = [[record for record in records if not record.get("evaluation")]
             for records in per_rank]
    assert [len(steps) for steps in ranks] == [2, 2, 2, 2]
    assert [len(records) for records in evaluations] == [2, 2, 2, 2]
    held_out = [[{key: value for key, value in record.items() if key != "seconds"}
                 for record in records] for records in evaluations]
    assert "eval/sampled/rule_score" in held_out[0][0]
    for records, metrics in zip(evaluations, held_out, strict=True):
        # every rank waited for the slow answers, longer than the world timeout, and got the
        # same held-out metrics
        assert all(record["seconds"] > EVAL_SLEEP_S > WORLD_TIMEOUT_S for record in records)
        assert metrics == held_out[0]
    trainers = [rank for rank, steps in enumerate(ranks) if steps[0]["trains"]]
    assert trainers and len(trainers) < 4, trainers
    for rank, steps in enumerate(ranks):
        # every rank waited at the step's end for the trainers, longer than the world timeout
        assert all(step["seconds"] > SYNC_SLEEP_S > WORLD_TIMEOUT_S for step in steps), (
            rank, [step["seconds"] for step in steps])
    for index in range(2):
        reference = {key: value for key, value in ranks[0][index].items()
                     if key not in ("seconds", "trains")}
        assert "actor/pg_loss" in reference and "reward_mean" in reference
        for steps in ranks[1:]:
            assert {key: value for key, value in steps[index].items()
                    if key not in ("seconds", "trains")} == reference


def _exchanges(late_s: float) -> dict:
    import contextlib
    import os

    import torch.distributed as dist

    from megatron_rlhf.runtime.faults import FaultConfig, PeerStopped, install_fault_tracker
    from megatron_rlhf.runtime.patches import default_group_store
    from megatron_rlhf.runtime.store_exchange import StoreExchange

    tracker = install_fault_tracker(FaultConfig(), timeout_s=WORLD_TIMEOUT_S)
    rank = dist.get_rank()
    exchange = StoreExchange("test", stopped=tracker.stopped_ranks, poll_s=0.2)
    if rank == 2:
        time.sleep(late_s)
    begin = time.monotonic()
    first = exchange.all_gather_object({"rank": rank, "pid": os.getpid()})
    waited = time.monotonic() - begin
    second = exchange.all_gather_object(rank * 10)
    dist.barrier()
    store = default_group_store()
    leftover = [key for key in (f"megatron_rlhf/exchange/test/{round_}/{part}"
                                for round_ in (0, 1) for part in (0, 1, 2, "arrived", "count",
                                                                  "complete", "read"))
                if store.check([key])]
    stopped = ""
    if rank == 1:
        with contextlib.suppress(ValueError), tracker.stage("doomed"):
            raise ValueError("rank 1 breaks")
    else:
        try:
            exchange.all_gather_object("never complete")
        except PeerStopped as error:
            stopped = str(error)
    return {"first": [item["rank"] for item in first], "second": second, "waited": waited,
            "leftover": leftover, "stopped": stopped}


@pytest.mark.multirank
@pytest.mark.timeout(130)
def test_the_store_exchange_outwaits_the_world_timeout_and_stops_on_a_stopped_peer() -> None:
    late_s = 2 * WORLD_TIMEOUT_S
    ranks = run_on_ranks(_exchanges, world_size=3, args=(late_s,), timeout_s=90)
    for rank, result in enumerate(ranks):
        assert result["first"] == [0, 1, 2] and result["second"] == [0, 10, 20]
        assert result["leftover"] == [], "the last reader deletes the exchange's keys"
        if rank != 2:
            assert result["waited"] > late_s - 0.5, result["waited"]
    assert ranks[1]["stopped"] == ""
    for rank in (0, 2):
        assert "ranks [1] stopped before the exchange 'test' #2" in ranks[rank]["stopped"], ranks
