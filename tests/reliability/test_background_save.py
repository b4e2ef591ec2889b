"""Checkpoints written in the background (``checkpoint.async_save``) on 2 gloo ranks (separation:
trainers on rank 0, shadows, reference and reward on rank 1), with dropout so that the RNG
streams matter.

* Job 1 saves after each of 2 steps in the background and every rank is SIGKILLed while its
  thread writes the second checkpoint's shards: step_1 is complete, step_2 only a ``.tmp-``
  directory.
* Job 2, in one set of processes: a run saving synchronously (A) and one saving in the background
  (B) have equal metrics and weights; B's background writes are held back until the next step has
  trained (so the files could only hold the saved step's state if the save copied it first), and
  B's records carry the save's seconds. Resuming B's step_1 and job 1's save dir (its unfinished
  save skipped) each end with A's metrics and weights, bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.metrics import run_metrics
from tests.helpers.runs import (
    capture_engine,
    run_killed_while_saving_step_2,
    separation_config,
    trained_weights,
)
from tests.multirank import run_on_ranks

STEPS = 2


def _config(root: str, name: str, **checkpoint):
    config = separation_config(root, name, STEPS, 0.1, checkpoint)
    config.actor_optimizer.lr = config.critic_optimizer.lr = 1e-3
    # megatron's plain optimizer: the critic's weights and Adam moments are tensors of their own
    # (not views of the distributed optimizer's buffers, which megatron's writer copies anyway).
    config.critic_optimizer.distributed_optimizer = False
    return config


def _equal_on_every_rank(a: dict, b: dict) -> bool:
    import torch
    import torch.distributed as dist

    same = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, same)
    return all(gathered)


def _killed_run(root: str) -> None:
    import os
    import signal

    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.models.background_save import ThreadedWriter

    write = ThreadedWriter.write_buckets_now

    def die_while_writing_step_2(self, rank, buckets, unused):
        if "step_00000002" in str(self.checkpoint_dir):
            os.kill(os.getpid(), signal.SIGKILL)
        return write(self, rank, buckets, unused)

    ThreadedWriter.write_buckets_now = die_while_writing_step_2
    run_ppo(_config(root, "killed", save_dir=f"{root}/ckpt", save_interval=1))


def _hold_back_writes() -> list[str]:
    """Make each background write wait until the next step has trained, or until the run
    commits the save (after its last step); returns, per write, what released it."""
    import threading

    from megatron_rlhf.engine.run.checkpointing import CheckpointSaver
    from megatron_rlhf.engine.step.ppo import PPOAlgorithm
    from megatron_rlhf.models.background_save import ThreadedWriter

    state = {"steps": 0, "commits": 0}
    changed = threading.Condition()
    released: list[str] = []
    prepare, write = ThreadedWriter.prepare_write_data, ThreadedWriter.write_buckets_now
    step, commit = PPOAlgorithm.step, CheckpointSaver.commit

    def count(key: str) -> None:
        with changed:
            state[key] += 1
            changed.notify_all()

    def planned(self, plan, planner):  # by the main thread, during the save
        self.counts_at_save = dict(state)
        return prepare(self, plan, planner)

    def after_next_step(self, rank, buckets, unused):
        start = self.counts_at_save
        with changed:
            changed.wait_for(lambda: state != start, timeout=120)
            released.append("step" if state["steps"] > start["steps"] else "commit")
        return write(self, rank, buckets, unused)

    def counted_step(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        count("steps")
        return result

    def counted_commit(self):
        count("commits")
        return commit(self)

    ThreadedWriter.prepare_write_data = planned
    ThreadedWriter.write_buckets_now = after_next_step
    PPOAlgorithm.step = counted_step
    CheckpointSaver.commit = counted_commit
    return released


def _runs(root: str) -> dict:
    import torch.distributed as dist

    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.runtime.checkpoint_store import complete_checkpoints, verify_checkpoint

    captured = capture_engine()
    run_ppo(_config(root, "A", save_dir=f"{root}/ckpt-A", save_interval=1, async_save=False))
    weights_a = trained_weights(captured["engine"])
    released = _hold_back_writes()
    runs = {"B": {"save_dir": f"{root}/ckpt-B", "save_interval": 1},
            "resumed-B1": {"resume_from": f"{root}/ckpt-B/step_00000001"},
            "resumed-killed": {"save_dir": f"{root}/ckpt", "resume": "latest"}}
    out: dict = {"released": released}
    for name, checkpoint in runs.items():
        run_ppo(_config(root, name, **checkpoint))
        out[f"{name}_weights_equal"] = _equal_on_every_rank(trained_weights(captured["engine"]),
                                                            weights_a)
        out[f"{name}_released"] = list(released)
        released.clear()
    if dist.get_rank() == 0:
        out["metrics"] = {name: run_metrics(f"{root}/{name}") for name in ("A", *runs)}
        out["records"] = {name: [json.loads(line) for line in
                                 Path(root, name, "metrics.jsonl").read_text().splitlines()]
                          for name in ("A", "B")}
        out["B_checkpoints"] = {p.name: verify_checkpoint(p)
                                for p in complete_checkpoints(f"{root}/ckpt-B")}
    return out


@pytest.mark.multirank
@pytest.mark.timeout(600)
def test_background_saves_equal_synchronous_ones_and_a_kill_mid_write_loses_nothing(
        tmp_path: Path) -> None:
    root = str(tmp_path)
    run_killed_while_saving_step_2(_killed_run, 2, tmp_path, timeout_s=180)

    results = run_on_ranks(_runs, world_size=2, args=(root,), timeout_s=360)
    first = results[0]
    # Rank 0 holds the actor and critic: one write each per save. The first save's writes ran
    # after the next step had trained; the last save's were released by its commit.
    assert first["B_released"] == ["step", "step", "commit", "commit"], first["B_released"]
    metrics = first["metrics"]
    assert [m["step"] for m in metrics["A"]] == list(range(STEPS))
    # The resumed runs write their records from step 1 on, into run directories of their own.
    for name, start in (("B", 0), ("resumed-B1", 1), ("resumed-killed", 1)):
        assert metrics[name] == metrics["A"][start:], f"{name}'s metrics differ from A's"
        assert first[f"{name}_weights_equal"], f"{name}'s weights differ from A's"
    assert first["B_checkpoints"] == {"step_00000001": [], "step_00000002": []}

    sync, background = first["records"]["A"][1], first["records"]["B"][1]
    assert set(sync) & {"checkpoint/write_s", "checkpoint/commit_s"} == set()
    assert sync["checkpoint/save_s"] > 0
    assert background["checkpoint/save_s"] > 0 and background["checkpoint/commit_s"] > 0
    assert background["checkpoint/write_s"] > 0
    assert "checkpoint/save_s" not in first["records"]["B"][0]
