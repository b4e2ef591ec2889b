"""The run loop's cadences, each on its own: which steps evaluate, save, export and move, with
stand-ins for the engine, evaluator, saver, exporter, replanner and mover."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_rlhf.config.ppo_run import CheckpointConfig, EvalConfig, ModelsConfig, RunConfig
from megatron_rlhf.engine.run import cadence
from megatron_rlhf.engine.run.cadence import HeldOutCadence, PlacementCadence, SaveCadence


class _Context:
    def __init__(self) -> None:
        self.stages: list[str] = []

    def stage(self, name: str, **_):
        self.stages.append(name)
        return nullcontext()


def _live(evaluator=None, exporter=None):
    engine = SimpleNamespace(context=_Context(), resident=nullcontext)
    return SimpleNamespace(run=SimpleNamespace(engine=engine), evaluator=evaluator,
                           exporter=exporter)


class _Saver:
    def __init__(self, config: CheckpointConfig) -> None:
        self.config, self.saved, self.commits, self.pending = config, [], 0, False

    def save(self, run, step: int) -> None:
        self.saved.append((self.config.save_dir, step))
        self.pending = self.config.async_save

    def commit(self) -> None:
        self.commits += 1
        self.pending = False

    def report(self) -> dict[str, float]:
        return {}


def _config(save_dir: str = "", interval: int = 0, export: bool = False,
            steps: int = 6) -> RunConfig:
    return replace(RunConfig(), steps=steps,
                   checkpoint=CheckpointConfig(save_dir=save_dir, save_interval=interval),
                   models=replace(ModelsConfig(), export_hf=export))


@pytest.mark.parametrize(("save_dir", "interval", "export", "saves", "exports"), [
    ("", 0, False, [], []),
    ("ckpt", 0, False, [6], []),
    ("ckpt", 2, False, [2, 4, 6], []),
    ("ckpt", 4, True, [4, 6], [4, 6]),
    ("", 0, True, [], [6]),  # no save_dir: exported once, at the end
])
def test_saves_and_exports_follow_the_interval_and_the_end(save_dir, interval, export, saves,
                                                           exports) -> None:
    cadence_ = SaveCadence(_config(save_dir, interval, export), Path("run"))
    done = range(1, 7)
    assert [k for k in done if cadence_.saves(k, last=k == 6)] == saves
    assert [k for k in done if cadence_.exports(k, last=k == 6)] == exports
    # a stop makes the step the last one: it saves and exports whatever the interval
    assert cadence_.saves(3, last=True) == bool(save_dir)
    assert cadence_.exports(3, last=True) == export


def test_an_export_without_a_save_dir_saves_first_into_the_run_directory(monkeypatch,
                                                                         tmp_path: Path) -> None:
    made: list[_Saver] = []

    def saver(config):
        made.append(_Saver(config))
        return made[-1]

    monkeypatch.setattr(cadence, "CheckpointSaver", saver)
    exported = []
    exporter = SimpleNamespace(export=lambda engine, path: exported.append(path))
    live = _live(exporter=exporter)
    saves = SaveCadence(_config(export=True, steps=2), tmp_path)
    assert not saves.after_step(live, 1, last=False)
    assert saves.after_step(live, 2, last=True) is False  # nothing in checkpoint.save_dir
    assert made[0].saved == []
    assert made[1].saved == [(str(tmp_path / "checkpoint"), 2)]
    assert made[1].config.keep_last == 1 and not made[1].config.async_save
    assert exported == [tmp_path / "hf" / "step_00000002"]
    stages = live.run.engine.context.stages
    assert stages.index("checkpoint/save") < stages.index("export/hf")


def test_the_last_background_save_is_committed_before_the_run_ends(monkeypatch) -> None:
    monkeypatch.setattr(cadence, "CheckpointSaver", _Saver)
    config = replace(_config("ckpt", 1, steps=3),
                     checkpoint=CheckpointConfig(save_dir="ckpt", save_interval=1,
                                                 async_save=True))
    saves, live = SaveCadence(config, Path("run")), _live()
    assert saves.after_step(live, 1, last=False)
    assert saves.saver.pending and saves.saver.commits == 0
    saves.commit(live.run.engine.context)  # the loop commits after the next step
    assert not saves.saver.pending and saves.saver.commits == 1
    assert saves.after_step(live, 2, last=True)
    assert not saves.saver.pending and saves.saver.commits == 2
    assert saves.saver.saved == [("ckpt", 1), ("ckpt", 2)]


def _evaluation(rule: float, rm: float) -> dict[str, float]:
    return {"eval/greedy/rule_score": rule, "eval/greedy/rm_score": rm,
            "eval/greedy/rm_score_std": 1.0, "eval/greedy/answers": 100.0}


def test_evaluations_run_at_the_start_every_interval_and_after_the_last_step(caplog) -> None:
    answers = iter([_evaluation(0.5, 0.0), _evaluation(0.5, 0.1), _evaluation(0.2, 5.0)])
    evaluator = SimpleNamespace(evaluate=lambda: next(answers))
    config = replace(_config(steps=6), evaluation=EvalConfig(num_prompts=4, interval=4))
    held_out, live = HeldOutCadence(config, first={}), _live(evaluator=evaluator)
    evaluated = [step for step in range(6) if held_out.before_step(live, step, start=0)]
    assert evaluated == [0, 4]
    written = []
    with caplog.at_level(logging.WARNING, logger=cadence.logger.name):
        held_out.after_run(live, SimpleNamespace(write=lambda step, m: written.append(step)))
    assert written == [6]
    # the final evaluation's reward-model score rose 5 standard errors while the rule fell 0.3
    # against the run's first evaluation (step 0), not against the one before it
    assert [r.message for r in caplog.records] == [
        "reward hacking suspected after step 6 on held-out prompts: greedy answers: "
        "reward-model score 0.000 -> 5.000 while the rule score fell 0.500 -> 0.200"]


def test_a_resumed_run_compares_with_the_first_evaluation_of_the_run(caplog) -> None:
    evaluator = SimpleNamespace(evaluate=lambda: _evaluation(0.2, 5.0))
    config = replace(_config(steps=6), evaluation=EvalConfig(num_prompts=4, interval=0))
    held_out = HeldOutCadence(config, first=_evaluation(0.5, 0.0))
    with caplog.at_level(logging.WARNING, logger=cadence.logger.name):
        assert held_out.before_step(_live(evaluator=evaluator), 3, start=3)
        assert not held_out.before_step(_live(evaluator=evaluator), 4, start=3)
    assert len(caplog.records) == 1 and "after step 3" in caplog.records[0].message


class _Replanner:
    def __init__(self, targets: dict[int, str]) -> None:
        self.targets, self.moves, self.move_cost_s = targets, [], None

    def take_target(self, step: int) -> str | None:
        return self.targets.get(step)

    def moved(self, target: str, step: int, seconds: float) -> None:
        self.moves.append((target, step, seconds))


def test_a_move_happens_after_a_step_with_a_target_but_never_after_the_last() -> None:
    calls = []
    mover = SimpleNamespace(estimate_s=0.3, move=lambda live, target, step, saver, saved:
                            calls.append((target, step, saved)) or 1.5)
    replanner = _Replanner({1: "separation", 5: "interleaving"})
    placement = PlacementCadence(replanner, mover)
    assert replanner.move_cost_s == 0.3
    records = [placement.move_if_due(_live(), step, saver=None, saved=step == 1,
                                     last=step == 5) for step in range(6)]
    assert records == [{}, {"replan/move_seconds": 1.5}, {}, {}, {}, {}]
    assert calls == [("separation", 1, True)]
    assert replanner.moves == [("separation", 1, 1.5)]


def test_without_re_planning_or_a_mover_nothing_moves() -> None:
    off = PlacementCadence(None, None)
    off.begin_step()
    assert off.after_step(0, {}, 1.0) == {} and off.move_if_due(_live(), 0, None, False,
                                                                 False) == {}
    report_only = PlacementCadence(_Replanner({0: "separation"}), None)
    assert report_only.move_if_due(_live(), 0, None, False, False) == {}
