"""Re-planning during a run (``placement.replan``): rank the placements again from what the run
measured, record the ranking, and with ``placement.replan.move`` choose a placement to move to.

    replanner = RunReplanner(config, plan, tracer, run_dir, start)   # every rank
    replanner.begin_step()                                           # before each step
    metrics.update(replanner.after_step(step, metrics, seconds))     # after it
    target = replanner.take_target(step)                             # None, or where to move

Each rank times its stages on the run's timeline (the tracer is on while re-planning; the spans
are dropped once counted unless the run writes its timeline). After ``interval_steps`` measured
steps, one all-reduce (max over ranks) gives every rank the same stage seconds per step (the
slowest rank's; for transfers and weight sync the least waiting rank's); with the
answers' mean length (and longest, when the step metrics hold ``response_length_max``) rank 0
then runs the pure ranking (``planner.replan.rerank``), decides, appends the ranking to
``<run_dir>/plan_history.jsonl`` and broadcasts the ``replan/*`` metrics and the move target, so
every rank holds the same ones and the ranking's CPU time (a prediction per candidate) is spent
once, not once per rank on cores the ranks may share. The candidates (each one's configuration
and plan) are found at rank 0's first re-planning, not at the start. Nothing here touches the
models, the data or a random generator: training is the same with and without re-planning.

A move pays when the best placement's predicted saving over the steps ahead (the steps left in
the run, at most ``horizon_steps`` of them) exceeds ``min_gain`` of those steps' predicted
seconds at the current placement plus the cost of a move: the last move's measured seconds,
before the first one ``move_cost_s`` (set by the runner from its estimate). Rank 0 decides for
every rank.
A candidate is a move target only where the run's checkpoint loads into it (the same
Megatron-FSDP choice per trained model).

Hysteresis: a placement the run moved away from is remembered with the step time measured there,
the answers' mean length then, and what leaving it cost. Going back is priced at no less than
that measured step while the answers' mean stays within ``RETURN_LENGTH_TOLERANCE`` of it (the
planner's extrapolation cannot overrule a measurement of the same workload), and the saving
must also repay the move that left it (the round trip). A run therefore never moves back and
forth on predictions that flip within the cost model's error.

Trial (``trial_margin``): the first re-planning has measured the starting placement only. When
it predicts the best other candidate within ``trial_margin`` of the run's own step (the cost
model cannot tell the two apart), and the steps left after the trial's own measured steps
(``warmup_steps + interval_steps``) would repay, at that margin per step, two moves plus the
trial's steps at that margin's loss, the run moves there for a trial. The next re-planning then
decides as above, pricing the placement left at its measured step: the run stays or goes back.
There is one trial per run, so trials never oscillate either.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.auto_placement import (
    candidate_config,
    ranked_candidates,
    search_space,
)
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.engine.run.micro_batching import planner_rollout, token_budgets
from megatron_rlhf.planner import RolloutSpec, describe
from megatron_rlhf.planner.hardware import resolve_profiles
from megatron_rlhf.planner.local_profile import pool_profiles
from megatron_rlhf.planner.predict import EXPERIENCE, GENERATION, STAGES, SYNC, TRAINING, TRANSFER
from megatron_rlhf.planner.replan import Measured, Replan, rerank
from megatron_rlhf.planner.schedule import covered_seconds
from megatron_rlhf.runtime.device import comm_device
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.tracing import Span, Tracer
from megatron_rlhf.topology.cluster import ClusterSpec
from megatron_rlhf.topology.models import TRAINABLE_ROLES
from megatron_rlhf.topology.plan import PlacementPlan

logger = get_logger(__name__)

SPAN_STAGES = {"generate": GENERATION, "experience": EXPERIENCE, "train": TRAINING,
               "transfer": TRANSFER, "sync_weights": SYNC}
"""The planner stage of each engine span (others, such as ``advantages``, are not priced)."""

WAITING_STAGES = (TRANSFER, SYNC)
"""Stages whose spans also hold the wait for the other ranks of the collective (a shadow waits
inside the weight sync while the trainers train): measured by the rank that waited least (the
last to arrive), where the other stages are measured by the slowest rank."""

HISTORY = "plan_history.jsonl"

RETURN_LENGTH_TOLERANCE = 0.1
"""A placement left earlier is priced at no less than its measured step while the answers' mean
length is within this share of the mean measured there (the same workload)."""


@dataclass(frozen=True)
class LeftPlacement:
    """A placement the run moved away from.

    Attributes:
        step_seconds: seconds per step measured there (the window that decided the move).
        response_length: the answers' mean length then.
        move_seconds: what the move away from it took.
    """

    step_seconds: float
    response_length: float
    move_seconds: float


@dataclass(frozen=True)
class MoveTarget:
    """A placement to move the run to.

    Attributes:
        label: the candidate's label (``planner.describe``).
        config: the run's configuration with that placement (and its memory options).
        plan: its placement plan.
        forced: chosen whatever the prediction (``megatron_rlhf.testing.run_hooks``).
        trial: a trial of a placement predicted within ``trial_margin`` of the run's own.
    """

    label: str
    config: RunConfig
    plan: PlacementPlan
    forced: bool = False
    trial: bool = False


def check_replan(config: RunConfig, cluster: ClusterSpec) -> None:
    """Refuse re-planning that cannot run (no hardware profile for a pool), before any
    distributed state exists.

    Raises:
        ValueError: naming ``placement.replan.profile`` and the fix.
    """
    replan = config.placement.replan
    if not replan.enabled:
        return
    try:
        resolve_profiles(cluster, pool_profiles(cluster, replan.profile)[0])
    except ValueError as error:
        raise ValueError(f"placement.replan needs a hardware profile: {error}; set "
                         "placement.replan.profile to a shipped name or a tools/calibrate.py "
                         "JSON, or placement.replan.interval_steps=0") from None


def candidate_plans(config: RunConfig, cluster: ClusterSpec, profiles
                    ) -> list[tuple[str, RunConfig, PlacementPlan]]:
    """The placements ``--placement auto`` chooses among that fit and the engine accepts, with
    the run's configuration at each and the plan the engine would make, in the planner's order
    at the configured lengths."""
    found = []
    for candidate in ranked_candidates(config, cluster, profiles):
        if not candidate.prediction.feasible:
            continue
        chosen = candidate_config(config, candidate)
        try:
            found.append((candidate.label, chosen, make_plan(chosen, cluster)))
        except ValueError:
            continue
    return found


def loads_checkpoint_of(config: RunConfig, target: RunConfig) -> bool:
    """Whether a checkpoint of a run at ``config`` loads into one at ``target``: megatron dist
    checkpoints load at any placement, Megatron-FSDP's only into Megatron-FSDP (at its TP)."""
    return all(config.optimizer(role).fsdp == target.optimizer(role).fsdp
               and (not target.optimizer(role).fsdp
                    or config.placement.tp == target.placement.tp)
               for role in TRAINABLE_ROLES)


def stage_seconds(spans: list[Span]) -> dict[str, float]:
    """Wall-clock seconds per planner stage covered by ``spans`` (one rank's)."""
    return {stage: covered_seconds((s.start, s.end) for s in spans
                                   if SPAN_STAGES.get(s.stage) == stage) for stage in STAGES}


class RunReplanner:
    """Measures each step, and every ``interval_steps`` measured steps ranks the placements.

    Args:
        config: the run.
        plan: the run's placement.
        tracer: this rank's tracer (enabled).
        run_dir: where rank 0 writes ``plan_history.jsonl``.
        start: the run's first step (after a resume, the checkpoint's).
    """

    def __init__(self, config: RunConfig, plan: PlacementPlan, tracer: Tracer, run_dir: Path,
                 start: int) -> None:
        self.settings = config.placement.replan
        self.config, self.steps = config, config.steps
        self.tracer, self.keep_spans = tracer, config.trace
        self.history = Path(run_dir) / HISTORY
        self.rollout = RolloutSpec.from_run_config(config, overlap=config.rollout.async_rollout)
        self.memory_options = search_space(config).memory_options
        self.profiles = pool_profiles(plan.cluster, self.settings.profile)[0]
        self.current = (describe(plan), plan)
        self.start_config = config
        self.first_measured = start + self.settings.warmup_steps
        self.max_new_tokens = config.generation.max_new_tokens
        self.move_cost_s = math.inf
        self.trial_due = self.settings.trial_margin > 0
        self.left: dict[str, LeftPlacement] = {}
        self.last_measured: Measured | None = None
        self._target: MoveTarget | None = None
        self._cursor = 0
        self._window: list[tuple[dict[str, float], float, float | None, float | None]] = []

    @cached_property
    def found(self) -> list[tuple[str, RunConfig, PlacementPlan]]:
        """The candidates (``candidate_plans`` of the run's starting configuration), found at
        first use: a ranking of every placement, which a run that never re-plans (or a rank
        that only hears rank 0's decisions) does not need."""
        return candidate_plans(self.start_config, self.current[1].cluster, self.profiles)

    @cached_property
    def candidates(self) -> list[tuple[str, PlacementPlan]]:
        """Label and plan of each candidate, in the planner's order."""
        return [(label, candidate) for label, _, candidate in self.found]

    @cached_property
    def labels(self) -> list[str]:
        """The candidates' labels."""
        return [label for label, _ in self.candidates]

    @cached_property
    def configs(self) -> dict[str, RunConfig]:
        """The run's configuration at each candidate label (the first of equal labels)."""
        configs: dict[str, RunConfig] = {}
        for label, chosen, _ in self.found:
            configs.setdefault(label, chosen)
        return configs

    def begin_step(self) -> None:
        """Leave the spans recorded so far (a held-out evaluation) out of the next step's."""
        self._take_spans()

    def _take_spans(self) -> list[Span]:
        """The spans recorded since the last call (dropped unless the run writes them)."""
        spans = self.tracer.spans[self._cursor:]
        if self.keep_spans:
            self._cursor = len(self.tracer.spans)
        else:
            self.tracer.spans.clear()
        return spans

    def after_step(self, step: int, metrics: dict[str, float], seconds: float
                   ) -> dict[str, float]:
        """Count step ``step``'s spans; at the end of an interval (a collective over the
        world, on every rank alike) rank the placements and return the ``replan/*`` metrics,
        else {}."""
        spans = self._take_spans()
        if step < self.first_measured:
            return {}
        self._window.append((stage_seconds(spans), seconds, metrics.get("response_length"),
                             metrics.get("response_length_max")))
        if len(self._window) < self.settings.interval_steps:
            return {}
        measured = self.last_measured = self._measured()
        self._window = []
        answer = [self.replan(step, measured) if dist.get_rank() == 0 else None]
        # World: every rank moves (or not) together, on rank 0's decision.
        dist.broadcast_object_list(answer, src=0, group=dist.group.WORLD)
        metrics, self._target = answer[0]
        return metrics

    def replan(self, step: int, measured: Measured
                ) -> tuple[dict[str, float], MoveTarget | None]:
        """Rank 0's ranking after step ``step``, appended to the history: the ``replan/*``
        metrics and where to move (None: stay)."""
        result = rerank(self.current, self.candidates, self.rollout, measured, self.profiles,
                        self.memory_options, self.shapes_at)
        gain = result.gain
        target, saving = self.decide(step, result)
        if self.trial_due:
            self.trial_due = False
            target = target or self.trial(step, result)
        self._append(step, measured, result, saving, target)
        metrics = {"replan/best": float(self._index(result.best.label)),
                   "replan/current_predicted_s": result.current.prediction.step_seconds,
                   "replan/best_predicted_s": result.best.prediction.step_seconds,
                   "replan/predicted_gain": gain,
                   "replan/would_move": float(gain > self.settings.min_gain)}
        if self.settings.move:
            metrics.update({"replan/predicted_saving_s": saving,
                            "replan/move_cost_s": self.move_cost_s,
                            "replan/move": float(target is not None)})
        if self.settings.trial_margin:
            metrics["replan/trial"] = float(target is not None and target.trial)
        return metrics, target

    def decide(self, step: int, result: Replan) -> tuple[MoveTarget | None, float]:
        """The best placement of ``result`` (by :meth:`expected_seconds`) if moving there after
        step ``step`` pays (see the module), else None; and the predicted seconds saved over the
        steps ahead (:meth:`steps_ahead`) there."""
        ahead = self.steps_ahead(step)
        current = result.current.prediction.step_seconds
        length = result.rollout.mean_answer_length
        seconds, label = min([(self.expected_seconds(c.label, c.prediction.step_seconds, length),
                               c.label) for c in result.ranking if c.prediction.feasible]
                             + [(current, self.current[0])])
        saving = ahead * (current - seconds)
        left = self.left.get(label)
        threshold = (self.settings.min_gain * ahead * current + self.move_cost_s
                     + (left.move_seconds if left is not None else 0.0))
        if (not self.settings.move or label == self.current[0] or saving <= threshold
                or not ahead or not self.can_move_to(label)):
            return None, saving
        return self.target(label), saving

    def trial(self, step: int, result: Replan) -> MoveTarget | None:
        """A trial move after step ``step`` to the best other candidate of ``result`` (see
        the module), or None."""
        margin = self.settings.trial_margin
        current = result.current.prediction.step_seconds
        other = next((c for c in result.ranking if c.prediction.feasible
                      and c.label != self.current[0] and self.can_move_to(c.label)), None)
        if other is None or other.prediction.step_seconds > (1 + margin) * current:
            return None
        trial_steps = self.settings.warmup_steps + self.settings.interval_steps
        after = self.steps_ahead(step) - trial_steps
        if after * margin * current <= trial_steps * margin * current + 2 * self.move_cost_s:
            return None
        return replace(self.target(other.label), trial=True)

    def can_move_to(self, label: str) -> bool:
        """Whether candidate ``label`` is a move target: the run's checkpoint loads into it."""
        return label in self.configs and loads_checkpoint_of(self.config, self.configs[label])

    def steps_ahead(self, step: int) -> int:
        """The steps a move after step ``step`` is judged over: those left in the run, at most
        ``horizon_steps`` (0: all of them). Judged on the next interval alone, a move whose
        cost takes longer than an interval to repay was never taken, however long the run."""
        left = max(0, self.steps - step - 1)
        horizon = self.settings.horizon_steps
        return min(left, horizon) if horizon else left

    def expected_seconds(self, label: str, predicted: float, length: float) -> float:
        """A candidate's step seconds for the move decision: ``predicted``, and for a placement
        the run left no less than the step measured there while the answers' mean ``length``
        is within ``RETURN_LENGTH_TOLERANCE`` of the mean then."""
        left = self.left.get(label)
        if left is None or abs(length - left.response_length) > (
                RETURN_LENGTH_TOLERANCE * left.response_length):
            return predicted
        return max(predicted, left.step_seconds)

    def take_target(self, step: int) -> MoveTarget | None:
        """Where to move after step ``step``, or None; once."""
        target, self._target = self._target, None
        return target

    def target(self, label: str) -> MoveTarget:
        """The move to candidate ``label`` (one of :attr:`labels`)."""
        return MoveTarget(label, self.configs[label], self._plan(label))

    def moved(self, target: MoveTarget, step: int, seconds: float) -> None:
        """The run moved to ``target`` after step ``step`` in ``seconds`` (the same on every
        rank): measure it afresh from there, remembering the placement left (hysteresis)."""
        if self.last_measured is not None:
            self.left[self.current[0]] = LeftPlacement(
                self.last_measured.step_seconds, self.last_measured.response_length, seconds)
        self.left.pop(target.label, None)
        self.config = target.config
        self.current = (describe(target.plan), target.plan)
        self.move_cost_s = seconds
        self.first_measured = step + 1 + self.settings.warmup_steps
        self._window = []

    def shapes_at(self, plan: PlacementPlan, shapes: RolloutSpec) -> RolloutSpec:
        """``shapes`` with the micro-batch rows the run's token budgets give at ``plan``."""
        return planner_rollout(self.config, token_budgets(self.config, plan), shapes)

    def _plan(self, label: str) -> PlacementPlan:
        return self.candidates[self.labels.index(label)][1]

    def _measured(self) -> Measured:
        """The window's means per step: stage seconds of the slowest rank (``WAITING_STAGES``:
        of the rank that ran them in the least time), step seconds of the slowest rank."""
        count = len(self._window)
        means = [sum(window[0][s] for window in self._window) / count for s in STAGES]
        step = sum(window[1] for window in self._window) / count
        # max(-x) is -min(x): one reduction gives both; ranks without the stage offer -inf.
        totals = torch.tensor([*means, step, *(-m if m > 0 else -math.inf for m in means)],
                              dtype=torch.float64, device=comm_device())
        # World: each stage runs on some ranks only; every rank needs the same figures.
        dist.all_reduce(totals, op=dist.ReduceOp.MAX, group=dist.group.WORLD)
        reduced = totals.tolist()
        slowest, least = reduced[:len(STAGES)], reduced[len(STAGES) + 1:]
        stages = {stage: (-least[i] if math.isfinite(least[i]) else 0.0)
                  if stage in WAITING_STAGES else slowest[i] for i, stage in enumerate(STAGES)}
        lengths = [window[2] for window in self._window if window[2] is not None]
        length = sum(lengths) / len(lengths) if lengths else float(self.max_new_tokens)
        longest = [window[3] for window in self._window if window[3] is not None]
        return Measured(stages, reduced[len(STAGES)], length, max(longest, default=None))

    def _index(self, label: str) -> int:
        """The position of ``label`` among the candidates (-1: the run's own placement, which
        is not one of them)."""
        return self.labels.index(label) if label in self.labels else -1

    def _append(self, step: int, measured: Measured, result: Replan, saving: float,
                target: MoveTarget | None) -> None:
        line = {"step": step, "current": result.current.label,
                "best": result.best.label, "best_index": self._index(result.best.label),
                "predicted_gain": round(result.gain, 6),
                "would_move": result.gain > self.settings.min_gain,
                "response_length_mean": round(measured.response_length, 3),
                "generation_length_priced": result.rollout.generation_length,
                "answer_lengths_priced": result.rollout.to_dict()["answer_lengths"],
                "scales": {k: round(v, 6) for k, v in result.scales.items()},
                "predicted_vs_measured": result.predicted_vs_measured,
                "ranking": [c.to_dict() for c in result.ranking]}
        if self.settings.move:
            line.update(predicted_saving_s=round(saving, 6), move_cost_s=self.move_cost_s,
                        move=target.label if target else None,
                        trial=target is not None and target.trial)
        append_history(self.history, line)
        logger.info("replan after step %d: %s %.3g s/step predicted, best %s %.3g s (gain %.1f%%)",
                    step + 1, result.current.label, result.current.prediction.step_seconds,
                    result.best.label, result.best.prediction.step_seconds, 100 * result.gain)


def append_history(path: Path, line: dict) -> None:
    """Append one line to a run's ``plan_history.jsonl`` (rank 0)."""
    with path.open("a") as handle:
        handle.write(json.dumps(line) + "\n")
