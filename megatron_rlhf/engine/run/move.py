"""Moving a run to another placement inside the job (``placement.replan.move``).

    mover = PlacementMover(config, run_dir, kept_groups, assemble, build_s, plan)  # every rank
    seconds = mover.move(live, target, step, saver, saved=False)                   # every rank

At the boundary after step ``step`` every rank, in the same processes:

1. saves the run's state after ``step + 1`` steps with the run's own checkpointing
   (``CheckpointSaver``): into ``checkpoint.save_dir`` when the run has one (a checkpoint like
   any other, reused when the run saved that step already); else, where the state fits twice
   in every host's available memory, with the trained models' shards kept in the processes
   (``models.memory_checkpoint``: state ``memory``) and the small files beside them in
   ``/dev/shm`` on a single node (``<run_dir>/move`` on several); else into ``<run_dir>/move``
   (state ``disk``);
2. frees the decode graphs and KV caches the generating models kept, drops the old engine,
   algorithm and evaluator and destroys every process group created since the run started
   (``runtime.distributed.destroy_groups_since``);
3. reseeds the host RNGs as a starting process does, builds the new placement (``assemble``:
   what ``run_ppo`` builds for a resumed run) and loads the checkpoint into it
   (``load_rl_checkpoint``: weights and optimizer states resharded, from the kept shards by
   one exchange between the ranks, shadows synced, experience produced ahead restored).

The run then continues exactly as a run resumed from that checkpoint at the new placement would.
A failure before the save is complete leaves the previous checkpoint as the last complete one; a
failure after it leaves this one. The seconds of each part, the largest over the ranks, go into
``plan_history.jsonl`` beside the estimate a first move is decided with
(``planner.replan.move_estimate``: every part, from the run's start-up build and state size);
their sum is ``replan/move_seconds``.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.checkpointing import CheckpointSaver, RunState, load_rl_checkpoint
from megatron_rlhf.engine.run.evaluation import HeldOutEvaluator
from megatron_rlhf.engine.run.export import HFExporter
from megatron_rlhf.engine.run.replan import HISTORY, MoveTarget, append_history
from megatron_rlhf.planner import describe
from megatron_rlhf.planner.replan import move_estimate
from megatron_rlhf.runtime.device import comm_device
from megatron_rlhf.runtime.distributed import destroy_groups_since
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.memory_meter import MemoryMeter
from megatron_rlhf.runtime.seeding import seed_everything
from megatron_rlhf.topology.models import TRAINABLE_ROLES
from megatron_rlhf.topology.plan import PlacementPlan

logger = get_logger(__name__)

CHECKPOINT_BYTES_PER_PARAM = 16
"""Bytes a trained model's checkpoint holds per parameter: fp32 weights and Adam's two moments
(12), with the bf16/fp32 model weights (4 at most)."""

MEMORY_DIR = Path("/dev/shm")
FILES_IN_MEMORY_DIR = 64 * 2**20
"""Room a move wants in ``MEMORY_DIR`` for the files beside the shards kept in memory (run
state, RNG states, experience produced ahead): a few MB for the tiny runs."""


@dataclass
class LiveRun:
    """The objects of a run that a move replaces."""

    run: RunState
    evaluator: HeldOutEvaluator | None
    exporter: HFExporter


Assemble = Callable[[RunConfig, PlacementPlan], LiveRun]
"""Builds a run at a placement as a resumed run is built (trained weights not loaded)."""


def drop_run(live: LiveRun) -> None:
    """Drop ``live``'s run, evaluator and exporter and free their device memory: the transfer
    channels drain and end their thread (nothing in flight when the groups are destroyed), and
    the decode graphs and KV caches its generating models kept go first, so they are freed
    even where something else still refers to a model. The run context's memory meter is
    replaced: the old one tracks the old models' state, and would keep it allocated while the
    new placement builds."""
    engine = live.run.engine
    engine.channels.close()
    for worker in engine.workers.values():
        worker.release_decode_graphs()
    meter = engine.context.memory
    engine.context.memory = MemoryMeter(enabled=meter.enabled, cuda=meter.cuda)
    live.run = live.evaluator = live.exporter = None
    del engine, meter
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


CGROUP_MEMORY_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                        "/sys/fs/cgroup/memory/memory.usage_in_bytes"))
"""The limit and usage files of this process's memory cgroup (v2, then v1)."""


def available_host_bytes() -> int:
    """The memory this host can give new allocations (``MemAvailable``; free pages where there
    is no ``/proc/meminfo``), and no more than the memory cgroup's limit less its usage: in a
    container ``MemAvailable`` is the whole machine's."""
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    headroom = cgroup_headroom_bytes()
    return available if headroom is None else min(available, headroom)


def cgroup_headroom_bytes(files: tuple[tuple[str, str], ...] = CGROUP_MEMORY_FILES
                          ) -> int | None:
    """The memory cgroup's limit less its usage, or None where no limit is set."""
    for limit_file, usage_file in files:
        try:
            limit = Path(limit_file).read_text().strip()
            usage = Path(usage_file).read_text().strip()
        except OSError:
            continue
        if limit.isdigit() and usage.isdigit():
            return max(0, int(limit) - int(usage))
    return None


def checkpoint_bytes(plan: PlacementPlan) -> float:
    """Rough size of a checkpoint of the trained models of ``plan``."""
    return sum(plan[role].spec.num_params() * CHECKPOINT_BYTES_PER_PARAM
               for role in TRAINABLE_ROLES if role in plan.models)


class PlacementMover:
    """Moves a run between placements; collective (every rank calls each method alike).

    Args:
        config: the run.
        run_dir: where rank 0 appends the move to ``plan_history.jsonl``.
        kept_groups: the process groups that existed before the run built its first engine
            (``runtime.distributed.live_groups``); every later one is destroyed by a move.
        assemble: builds the run at a placement.
        build_seconds: how long this rank took to build the run at its start.
        plan: the run's placement at its start.
    """

    def __init__(self, config: RunConfig, run_dir: Path, kept_groups: frozenset,
                 assemble: Assemble, build_seconds: float, plan: PlacementPlan) -> None:
        self.config, self.run_dir = config, Path(run_dir)
        self.kept_groups, self.assemble = kept_groups, assemble
        size = checkpoint_bytes(plan)
        one_node = sum(p.nodes for p in plan.cluster.pools) == 1
        flags = [available_host_bytes() <= 2 * size,
                 not (one_node and MEMORY_DIR.is_dir()
                      and shutil.disk_usage(MEMORY_DIR).free > FILES_IN_MEMORY_DIR)]
        # World: every rank must choose the same way and estimate.
        agreed = torch.tensor([build_seconds, *map(float, flags)], dtype=torch.float64,
                              device=comm_device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        self.estimate = move_estimate(agreed[0].item(), size)
        self.estimate_s = sum(self.estimate.values())
        self.kind = ("checkpoint" if config.checkpoint.save_dir else
                     "memory" if agreed[1].item() == 0.0 else "disk")
        self.files_in_memory_dir = agreed[2].item() == 0.0

    def _state_dir(self) -> Path:
        if self.kind == "checkpoint":
            return Path(self.config.checkpoint.save_dir)
        if self.kind == "memory" and self.files_in_memory_dir:
            digest = hashlib.sha256(str(self.run_dir.absolute()).encode()).hexdigest()[:12]
            return MEMORY_DIR / f"megatron_rlhf-move-{digest}"
        return self.run_dir / "move"

    def move(self, live: LiveRun, target: MoveTarget, step: int, saver: CheckpointSaver,
             saved: bool) -> float:
        """Move ``live`` to ``target`` after step ``step`` (its fields are replaced); returns
        the move's seconds, the largest over the ranks.

        Args:
            saver: the run's saver (a background save is completed first).
            saved: the run saved the state after ``step + 1`` steps into ``checkpoint.save_dir``
                at this boundary already.
        """
        context = live.run.engine.context
        source = describe(live.run.engine.plan)
        seconds: dict[str, float] = {}
        begin = time.perf_counter()
        with context.stage("move/save"):
            path = self._save(live, step + 1, saver, saved)
        seconds["save_s"] = time.perf_counter() - begin
        begin = time.perf_counter()
        with context.stage("move/teardown"):
            drop_run(live)
            destroyed = destroy_groups_since(self.kept_groups)
        seconds["teardown_s"] = time.perf_counter() - begin
        begin = time.perf_counter()
        with context.stage("move/build"):
            seed_everything(target.config.runtime.seed)  # as a resumed process starts
            rebuilt = self.assemble(target.config, target.plan)
        seconds["build_s"] = time.perf_counter() - begin
        begin = time.perf_counter()
        with context.stage("move/load"), rebuilt.run.engine.resident():
            loaded = load_rl_checkpoint(rebuilt.run, path)
        seconds["load_s"] = time.perf_counter() - begin
        if loaded != step + 1:
            raise RuntimeError(f"the move's checkpoint {path} holds step {loaded}, not "
                               f"{step + 1}")
        live.run, live.evaluator, live.exporter = rebuilt.run, rebuilt.evaluator, rebuilt.exporter
        if self.kind != "checkpoint":
            dist.barrier(group=dist.group.WORLD)  # every rank has read it
            if dist.get_rank() == 0:  # the move's own store, with nothing else in it
                shutil.rmtree(path.parent, ignore_errors=True)
        return self._record(step, source, target, path, seconds, destroyed)

    def _save(self, live: LiveRun, steps_done: int, saver: CheckpointSaver, saved: bool) -> Path:
        """The state after ``steps_done`` steps, saved (or found saved) in the checkpoint store."""
        saver.commit()
        directory = self._state_dir()
        if self.kind != "checkpoint":
            saver = CheckpointSaver(replace(self.config.checkpoint, save_dir=str(directory),
                                            async_save=False, keep_last=1),
                                    shards_in_memory=self.kind == "memory")
        if not saved:
            with live.run.engine.resident():
                saver.save(live.run, steps_done)
            saver.commit()
        return directory.absolute() / f"step_{steps_done:08d}"

    def _record(self, step: int, source: str, target: MoveTarget, path: Path,
                seconds: dict[str, float], destroyed: int) -> float:
        """The seconds of each part, largest over the ranks, logged and appended to the
        history; returns their sum."""
        parts = torch.tensor(list(seconds.values()), dtype=torch.float64, device=comm_device())
        dist.all_reduce(parts, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        seconds = dict(zip(seconds, parts.tolist(), strict=True))
        total = sum(seconds.values())
        if dist.get_rank() == 0:
            append_history(self.run_dir / HISTORY, {
                "step": step, "moved": {
                    "from": source, "to": target.label, "forced": target.forced,
                    "state": self.kind, "path": str(path), "move_seconds": round(total, 6),
                    **{key: round(value, 6) for key, value in seconds.items()},
                    "first_move_estimate": {key: round(value, 6)
                                            for key, value in self.estimate.items()},
                    "groups_destroyed": destroyed,
                    "placement": asdict(target.config.placement)}})
            (self.run_dir / "plan.json").write_text(_plan_json(target.plan))
        logger.info("%s", moved_message(step + 1, source, target.label, seconds))
        return total


def moved_message(steps_done: int, source: str, target: str, seconds: dict[str, float]) -> str:
    """The log line of a move after ``steps_done`` steps (the progress line's ``step k/N``)."""
    parts = ", ".join(f"{key} {value:.2f}" for key, value in seconds.items())
    return (f"moved after step {steps_done} from {source} to {target} in "
            f"{sum(seconds.values()):.2f} s ({parts})")


def _plan_json(plan: PlacementPlan) -> str:
    return json.dumps(plan.to_dict(), indent=1)
