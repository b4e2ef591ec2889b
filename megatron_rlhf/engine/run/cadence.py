"""What a run does between its steps, each by its own cadence: held-out evaluations, checkpoint
saves and Hugging Face exports, and re-planning's moves.

The run loop (``runner._train``) asks each object at the same point of every step; each reads the
run's current objects from the :class:`LiveRun` it is handed, so a move, which replaces them,
changes nothing the loop holds.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.checkpointing import CheckpointSaver
from megatron_rlhf.engine.run.evaluation import hacking_report
from megatron_rlhf.engine.run.move import LiveRun, PlacementMover
from megatron_rlhf.engine.run.replan import RunReplanner
from megatron_rlhf.runtime.context import RunContext
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.metrics import MetricsWriter

logger = get_logger(__name__)


class HeldOutCadence:
    """Held-out evaluations before the steps ``evaluation`` names and after the last step, each
    checked for reward hacking against the run's first evaluation.

    Args:
        config: the run.
        first: the first evaluation of the run being resumed (empty for a fresh run).
    """

    def __init__(self, config: RunConfig, first: dict[str, float]) -> None:
        self.config = config
        self.first = first

    def before_step(self, live: LiveRun, step: int, start: int) -> dict[str, float]:
        """The evaluation due before step ``step`` of a run started at ``start``, or {}."""
        if live.evaluator is None or not self.config.evaluation.due(step, start):
            return {}
        with live.run.engine.context.stage(f"evaluate {step}"):
            held_out = live.evaluator.evaluate()
        self.first = self.first or held_out
        self._warn_on_hacking(held_out, step)
        return held_out

    def after_run(self, live: LiveRun, writer: MetricsWriter) -> None:
        """Evaluate the trained policy; its record is numbered ``config.steps``."""
        if live.evaluator is None:
            return
        with live.run.engine.context.stage("evaluate final"):
            held_out = live.evaluator.evaluate()
        self.first = self.first or held_out
        self._warn_on_hacking(held_out, self.config.steps)
        writer.write(self.config.steps, held_out)

    def _warn_on_hacking(self, current: dict[str, float], steps_done: int) -> None:
        evaluation = self.config.evaluation
        for line in hacking_report(self.first, current, evaluation.hacking_tolerance,
                                   evaluation.hacking_rm_rise):
            logger.warning("reward hacking suspected after step %d on held-out prompts: %s",
                           steps_done, line)


class SaveCadence:
    """Checkpoints every ``checkpoint.save_interval`` steps, after the last step and on a stop;
    Hugging Face exports (``models.export_hf``) at the same steps when saving, else at the end.

    A run that exports without ``checkpoint.save_dir`` saves into ``run_dir/checkpoint`` before
    its export, which is then its only copy of the trained weights: an export that fails loses
    nothing.
    """

    def __init__(self, config: RunConfig, run_dir: Path) -> None:
        self.config = config
        self.run_dir = run_dir
        self.saver = CheckpointSaver(config.checkpoint)

    def _at_interval(self, steps_done: int) -> bool:
        interval = self.config.checkpoint.save_interval
        return bool(interval and steps_done % interval == 0)

    def saves(self, steps_done: int, last: bool) -> bool:
        """Whether a checkpoint is saved into ``checkpoint.save_dir`` after ``steps_done``."""
        return bool(self.config.checkpoint.save_dir) and (last or self._at_interval(steps_done))

    def exports(self, steps_done: int, last: bool) -> bool:
        """Whether the models are exported after ``steps_done`` steps."""
        return self.config.models.export_hf and (
            last or (bool(self.config.checkpoint.save_dir) and self._at_interval(steps_done)))

    def commit(self, context: RunContext) -> None:
        """Complete a save written in the background, if one is."""
        if self.saver.pending:
            with context.stage("checkpoint/commit"):
                self.saver.commit()

    def report(self) -> dict[str, float]:
        """The last save's seconds, for the next step's record."""
        return self.saver.report()

    def after_step(self, live: LiveRun, steps_done: int, last: bool) -> bool:
        """Save and export as due after ``steps_done`` steps; returns whether a checkpoint was
        saved into ``checkpoint.save_dir``."""
        run = live.run
        context = run.engine.context
        saved = self.saves(steps_done, last)
        if saved:
            with context.stage("checkpoint/save"), run.engine.resident():
                self.saver.save(run, steps_done)
            if last:
                self.commit(context)
        if self.config.models.export_hf and last and not self.config.checkpoint.save_dir:
            copy = replace(self.config.checkpoint, save_dir=str(self.run_dir / "checkpoint"),
                           async_save=False, keep_last=1)
            with context.stage("checkpoint/save"), run.engine.resident():
                CheckpointSaver(copy).save(run, steps_done)
        if self.exports(steps_done, last):
            with context.stage("export/hf"), run.engine.resident():
                live.exporter.export(run.engine, self.run_dir / "hf" / f"step_{steps_done:08d}")
        return saved


class PlacementCadence:
    """Re-planning (``placement.replan``): each step measured, the placements ranked every
    ``interval_steps``, and with a ``mover`` the run moved after a step where a move pays.

    Args:
        replanner: the run's replanner; None when re-planning is off (every call is then a no-op).
        mover: moves the run; None when re-planning only reports.
    """

    def __init__(self, replanner: RunReplanner | None, mover: PlacementMover | None) -> None:
        self.replanner = replanner
        self.mover = mover
        if replanner is not None and mover is not None:
            replanner.move_cost_s = mover.estimate_s

    def begin_step(self) -> None:
        if self.replanner is not None:
            self.replanner.begin_step()

    def after_step(self, step: int, metrics: dict[str, float], seconds: float
                   ) -> dict[str, float]:
        """Re-planning's figures for step ``step``'s record."""
        if self.replanner is None:
            return {}
        return self.replanner.after_step(step, metrics, seconds)

    def move_if_due(self, live: LiveRun, step: int, saver: CheckpointSaver, saved: bool,
                    last: bool) -> dict[str, float]:
        """Move ``live`` after step ``step`` if re-planning chose another placement (never after
        the last step); returns the move's seconds for the next step's record, or {}."""
        if self.replanner is None:
            return {}
        target = self.replanner.take_target(step)
        if target is None or self.mover is None or last:
            return {}
        seconds = self.mover.move(live, target, step, saver, saved)
        self.replanner.moved(target, step, seconds)
        return {"replan/move_seconds": seconds}
