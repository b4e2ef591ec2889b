"""Moving a run to another placement inside the job (``placement.replan.move``), on 2 gloo ranks.

A run moves from flattening to separation after step 0 and back after step 1 (forced by the
test hook ``testing.run_hooks.forcing_moves``; its trained shards are handed over in memory).
Its metrics equal, bit for bit, those of runs resumed at the new placement from checkpoints of
the same steps, and those of the same run whose moves go through files (no host memory, as
where the state does not fit); no step is lost; the history records each move with its
seconds. A run saving into a save dir, SIGKILLed while its second move builds the new placement
(its checkpoint complete), resumes from that checkpoint with the same results. PPO (with a
critic) and GRPO. An asynchronous run rebuilt in place keeps the experience produced ahead, and
its old models are freed (no reference keeps them) before the new placement builds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.planner import HardwareProfile
from tests.multirank import MultiRankError, run_on_ranks

SEPARATION = "separation"
FLATTENING = "flattening tp=1 pp=1"
TIMING = ("step_seconds", "samples_per_s")
"""Wall-clock measurements: they differ between any two runs."""


def _profile(root: Path) -> str:
    """A profile for the local pool (a slow CPU-like device)."""
    profile = HardwareProfile(name="local", peak_tflops=0.05, hbm_gb_per_s=10.0, memory_gib=8.0,
                              intra_node_gbps=10.0, inter_node_gbps=10.0, host_gb_per_s=5.0,
                              host_cores=2)
    path = root / "local.json"
    path.write_text(json.dumps(profile.to_dict()))
    return str(path)


def _config(root: str, name: str, steps: int, algorithm: str, overrides: list[str]):
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    example = "ppo_grpo_tiny.yaml" if algorithm == "grpo" else "ppo_tiny.yaml"
    return load_config(RunConfig, Path("examples") / example, [
        f"run_dir={root}/{name}", f"steps={steps}", "rollout.ppo_epochs=1",
        "generation.max_new_tokens=6", "runtime.distributed.timeout_s=60", *overrides])


def _records(root: str, name: str) -> list[dict]:
    path = Path(root) / name / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def _results(record: dict) -> dict:
    """A record without measurements of time, re-planning and checkpoint timings."""
    return {key: value for key, value in record.items() if key not in TIMING
            and not key.startswith(("throughput/", "replan/", "checkpoint/"))}


def _strategy(label: str) -> str:
    """``separation`` from ``separation(1/2 train) tp=1 ...``."""
    return label.split("(")[0].split()[0]


def _moving_runs(root: str, algorithm: str, profile: str) -> dict:
    """P: plain flattening run saving each step; M: the moving run; D: M finding no host
    memory, so its moves go through files; R1: P's step 1 resumed at separation (saving step
    2); R2: R1's step 2 resumed at flattening."""
    import torch.distributed as dist

    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.testing.run_hooks import forcing_moves, without_host_memory

    replan = ["placement.replan.interval_steps=1", "placement.replan.warmup_steps=0",
              f"placement.replan.profile={profile}", "placement.replan.move=true"]
    run_ppo(_config(root, "P", 2, algorithm, [f"checkpoint.save_dir={root}/ckpt-P",
                                               "checkpoint.save_interval=1"]))
    with forcing_moves({0: SEPARATION, 1: FLATTENING}):
        run_ppo(_config(root, "M", 3, algorithm, replan))
    with forcing_moves({0: SEPARATION, 1: FLATTENING}), without_host_memory():
        run_ppo(_config(root, "D", 3, algorithm, replan))
    run_ppo(_config(root, "R1", 2, algorithm, [
        "placement.strategy=separation", f"checkpoint.resume_from={root}/ckpt-P/step_00000001",
        f"checkpoint.save_dir={root}/ckpt-P", "checkpoint.save_interval=1"]))
    run_ppo(_config(root, "R2", 3, algorithm, [
        f"checkpoint.resume_from={root}/ckpt-P/step_00000002",
        f"checkpoint.save_dir={root}/ckpt-P"]))
    if dist.get_rank() != 0:
        return {}
    history, on_disk = ([json.loads(line) for line in
                         (Path(root) / name / "plan_history.jsonl").read_text().splitlines()]
                        for name in ("M", "D"))
    return {name: _records(root, name) for name in ("P", "M", "D", "R1", "R2")} | {
        "history": history, "on_disk": [line["moved"] for line in on_disk if "moved" in line],
        "plan": json.loads((Path(root) / "M" / "plan.json").read_text())}


def _killed_while_building(root: str, algorithm: str, profile: str) -> None:
    """A run saving into a save dir every 2 steps that moves to separation after step 0 (saving
    step 1 itself) and back after step 1 (reusing the run's save of step 2), SIGKILLed while the
    second move builds the new placement."""
    import os
    import signal

    from megatron_rlhf.engine.run import runner
    from megatron_rlhf.testing.run_hooks import forcing_moves

    build, calls = runner.build_engine, []

    def die_on_third_build(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return build(*args, **kwargs)

    runner.build_engine = die_on_third_build
    with forcing_moves({0: SEPARATION, 1: FLATTENING}):
        runner.run_ppo(_config(root, "K", 3, algorithm, [
            "placement.replan.interval_steps=1", f"placement.replan.profile={profile}",
            "placement.replan.move=true", f"checkpoint.save_dir={root}/ckpt-K",
            "checkpoint.save_interval=2"]))


def _resume_killed(root: str, algorithm: str) -> dict | None:
    import torch.distributed as dist

    from megatron_rlhf.engine.run.runner import run_ppo

    history = (Path(root) / "K" / "plan_history.jsonl").read_text().splitlines()
    run_ppo(_config(root, "K", 3, algorithm, [f"checkpoint.save_dir={root}/ckpt-K",
                                               "checkpoint.resume=latest"]))
    if dist.get_rank() != 0:
        return None
    return {"records": _records(root, "K"),
            "moves": [json.loads(line)["moved"] for line in history if '"moved"' in line]}


@pytest.mark.multirank
@pytest.mark.timeout(540)
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_a_moved_run_equals_runs_resumed_at_each_placement(tmp_path: Path,
                                                            algorithm: str) -> None:
    root, profile = str(tmp_path), _profile(tmp_path)
    out = run_on_ranks(_moving_runs, world_size=2, args=(root, algorithm, profile),
                       timeout_s=240)[0]
    moving, plain = out["M"], out["P"]
    assert [record["step"] for record in moving] == [0, 1, 2], "a step was lost or repeated"
    assert _results(moving[0]) == _results(plain[0])
    assert _results(moving[1]) == _results(out["R1"][-1]), "after the move to separation"
    assert _results(moving[2]) == _results(out["R2"][-1]), "after the move back"
    assert "replan/move_seconds" not in moving[0]
    for record in moving[1:]:
        assert record["replan/move_seconds"] > 0
    moves = [line["moved"] for line in out["history"] if "moved" in line]
    assert [(_strategy(m["from"]), _strategy(m["to"])) for m in moves] == [
        ("flattening", "separation"), ("separation", "flattening")]
    for move, record in zip(moves, moving[1:], strict=True):
        assert move["state"] == "memory" and move["forced"]
        assert move["move_seconds"] == pytest.approx(record["replan/move_seconds"], rel=1e-5)
        assert move["move_seconds"] == pytest.approx(
            sum(move[k] for k in ("save_s", "teardown_s", "build_s", "load_s")), rel=1e-5)
        assert move["groups_destroyed"] > 0
        assert not Path(move["path"]).exists(), "the in-memory state was not removed"
    assert [m["state"] for m in out["on_disk"]] == ["disk", "disk"]
    assert [_results(r) for r in out["D"]] == [_results(r) for r in moving], "through files"
    final = out["plan"]["models"]  # plan.json: back at flattening, no shadows
    assert final["actor"]["size"] == 2 and "shadow_actor" not in final

    with pytest.raises(MultiRankError, match="code -9"):
        run_on_ranks(_killed_while_building, world_size=2, args=(root, algorithm, profile),
                     timeout_s=120)
    for step in (1, 2):
        assert (tmp_path / "ckpt-K" / f"step_{step:08d}" / "manifest.json").is_file()
    resumed = run_on_ranks(_resume_killed, world_size=2, args=(root, algorithm),
                           timeout_s=120)[0]
    first_move = resumed["moves"]
    assert len(first_move) == 1 and first_move[0]["state"] == "checkpoint"
    assert first_move[0]["path"].endswith("ckpt-K/step_00000001")
    records = resumed["records"]
    assert [record["step"] for record in records] == [0, 1, 2]
    assert _results(records[1]) == _results(moving[1]), "the first move's checkpoint differs"
    assert _results(records[2]) == _results(moving[2]), "resumed at flattening from step 2"


def _async_runs(root: str, profile: str) -> dict:
    """An asynchronous separation run, plain and rebuilt in place after step 1 (while the
    shadows hold step 2's experience, produced with the weights before step 1's update). At
    the rebuild's teardown, before the new placement builds, no reference may keep this rank's
    old models (with their parameters, optimizer state and KV memory) alive."""
    import gc
    import weakref

    import torch.distributed as dist

    from megatron_rlhf.engine.run import move
    from megatron_rlhf.engine.run.runner import run_ppo
    from megatron_rlhf.testing.run_hooks import forcing_moves

    held: list[list[str]] = []
    drop_run = move.drop_run

    def recording_drop(live) -> None:
        models = {role: weakref.ref(worker.model)
                  for role, worker in live.run.engine.workers.items()}
        drop_run(live)
        gc.collect()
        held.append(sorted(role for role, model in models.items() if model() is not None))

    base = ["placement.strategy=separation", "rollout.async_rollout=true",
            "rollout.max_staleness=1"]
    run_ppo(_config(root, "A", 4, "ppo", base))
    move.drop_run = recording_drop
    with forcing_moves({1: SEPARATION}):
        run_ppo(_config(root, "B", 4, "ppo", [
            *base, "placement.replan.interval_steps=1", f"placement.replan.profile={profile}",
            "placement.replan.move=true"]))
    move.drop_run = drop_run
    if dist.get_rank() != 0:
        return {"held": held}
    history = (Path(root) / "B" / "plan_history.jsonl").read_text().splitlines()
    return {"A": _records(root, "A"), "B": _records(root, "B"), "held": held,
            "moves": [json.loads(line)["moved"] for line in history if '"moved"' in line]}


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_move_keeps_the_experience_produced_ahead(tmp_path: Path) -> None:
    per_rank = run_on_ranks(_async_runs, world_size=2, args=(str(tmp_path),
                                                             _profile(tmp_path)), timeout_s=180)
    # the old models were freed before the new placement built, on every rank
    assert [rank["held"] for rank in per_rank] == [[[]], [[]]]
    out = per_rank[0]
    assert len(out["moves"]) == 1 and out["moves"][0]["state"] == "memory"
    assert [record["step"] for record in out["B"]] == [0, 1, 2, 3]
    for plain, moved in zip(out["A"], out["B"], strict=True):
        assert _results(moved) == _results(plain), f"step {plain['step']}"


def _predicted_move(root: str, profile: str, strategy: str = "separation", steps: int = 3,
                    overrides: tuple[str, ...] = ()) -> dict:
    """A ``strategy`` run that re-plans every step, with the first move's estimated cost set to
    0 (the tiny models save far less per step than a move costs)."""
    import torch.distributed as dist

    from megatron_rlhf.engine.run import move
    from megatron_rlhf.engine.run.runner import run_ppo

    init = move.PlacementMover.__init__
    movers = []

    def free_first_move(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.estimate_s = 0.0
        movers.append(self)

    move.PlacementMover.__init__ = free_first_move
    run_ppo(_config(root, "S", steps, "ppo", [
        f"placement.strategy={strategy}", "placement.replan.interval_steps=1",
        "placement.replan.warmup_steps=0", f"placement.replan.profile={profile}",
        "placement.replan.move=true", *overrides]))
    dist.barrier()
    if dist.get_rank() != 0:
        return {}
    history = (Path(root) / "S" / "plan_history.jsonl").read_text().splitlines()
    return {"records": _records(root, "S"), "history": [json.loads(line) for line in history],
            "state_dirs_left": [str(directory) for mover in movers
                                if (directory := mover._state_dir()).exists()]}


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_run_moves_when_the_prediction_pays(tmp_path: Path) -> None:
    out = run_on_ranks(_predicted_move, world_size=2, args=(str(tmp_path), _profile(tmp_path)),
                       timeout_s=180)[0]
    records, history = out["records"], out["history"]
    assert [record["step"] for record in records] == [0, 1, 2]
    assert out["state_dirs_left"] == []  # the move's state (in /dev/shm here) is removed whole
    ranked = [line for line in history if "ranking" in line]
    moves = [line["moved"] for line in history if "moved" in line]
    assert ranked[0]["move"] is not None and ranked[0]["move_cost_s"] == 0.0
    assert len(moves) == 1 and not moves[0]["forced"] and moves[0]["to"] == ranked[0]["move"]
    assert _strategy(moves[0]["from"]) == "separation"
    assert records[0]["replan/move"] == 1.0 and "replan/move_seconds" in records[1]
    # later intervals price a move at its measured cost, which the tiny models never repay
    assert ranked[1]["current"] == moves[0]["to"]
    assert ranked[1]["move_cost_s"] == pytest.approx(moves[0]["move_seconds"], rel=1e-5)
    assert all(line["move"] is None for line in ranked[1:])


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_a_run_tries_a_close_runner_up_once(tmp_path: Path) -> None:
    """Flattening on 2 ranks, a runner-up within trial_margin (0.9) and a free first move:
    after step 0 every rank moves there for a trial, and none after. A move by prediction
    needs a 50% gain (min_gain), which no candidate reaches, so the move is the trial whichever
    candidate the measured times rank first."""
    out = run_on_ranks(_predicted_move, world_size=2,
                       args=(str(tmp_path), _profile(tmp_path), "flattening", 4,
                             ("placement.replan.trial_margin=0.9",
                              "placement.replan.min_gain=0.5")), timeout_s=180)[0]
    records, history = out["records"], out["history"]
    assert [record["step"] for record in records] == [0, 1, 2, 3]
    ranked = [line for line in history if "ranking" in line]
    moves = [line["moved"] for line in history if "moved" in line]
    assert _strategy(ranked[0]["current"]) == "flattening" and ranked[0]["trial"]
    assert records[0]["replan/trial"] == 1.0 and moves[0]["to"] == ranked[0]["move"]
    assert not any(line["trial"] for line in ranked[1:])
    assert all(record["replan/trial"] == 0.0 for record in records[1:3])


def _replanner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *overrides: str):
    """A 2-rank separation run's re-planner (no process group needed to build one)."""
    from megatron_rlhf.engine.run.build import make_plan
    from megatron_rlhf.engine.run.replan import RunReplanner
    from megatron_rlhf.runtime.tracing import Tracer
    from megatron_rlhf.topology.cluster import cluster_from_environment

    monkeypatch.setenv("WORLD_SIZE", "2")
    config = _config(str(tmp_path), "D", 10, "ppo", [
        "placement.strategy=separation", "placement.replan.interval_steps=2",
        f"placement.replan.profile={_profile(tmp_path)}", *overrides])
    plan = make_plan(config, cluster_from_environment(config.cluster.pools))
    return RunReplanner(config, plan, Tracer(), tmp_path, 0)


def _as_predicted(replanner):
    """The ranking after steps that took the time predicted for them: on 2 ranks flattening
    beats separation (the trainers get both ranks)."""
    from megatron_rlhf.planner import predict_step
    from megatron_rlhf.planner.replan import Measured, rerank

    label, plan = replanner.current
    predicted = predict_step(plan, replanner.shapes_at(plan, replanner.rollout),
                             replanner.profiles, replanner.memory_options)
    measured = Measured(predicted.stage_seconds, predicted.step_seconds, 6.0)
    return rerank(replanner.current, replanner.candidates, replanner.rollout, measured,
                  replanner.profiles, replanner.memory_options, replanner.shapes_at)


def test_a_move_is_chosen_only_when_its_saving_pays_for_it(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rlhf.testing.run_hooks import forcing_moves

    replanner = _replanner(tmp_path, monkeypatch, "placement.replan.move=true")
    result = _as_predicted(replanner)
    assert _strategy(result.best.label) == "flattening" and result.gain > 0.05
    current = result.current.prediction.step_seconds
    per_step = current - result.best.prediction.step_seconds
    # After step 0 of 10, the 9 steps left save 9 * per_step; min_gain (0.05) of them is
    # 0.45 * current.
    pays = 9 * per_step - 0.45 * current
    replanner.move_cost_s = pays - 1e-9
    target, saving = replanner.decide(0, result)
    assert saving == pytest.approx(9 * per_step)
    assert target is not None and target.label == result.best.label and not target.forced
    assert target.plan is dict(replanner.candidates)[target.label]
    assert target.config.placement == target.plan.config

    replanner.move_cost_s = pays + 1e-9  # a move costing more than it saves above min_gain
    assert replanner.decide(0, result)[0] is None
    replanner.move_cost_s = 0.0
    target, saving = replanner.decide(8, result)  # one step left
    assert saving == pytest.approx(per_step) and target is not None
    assert replanner.decide(9, result) == (None, 0.0)  # the last step: nothing to save

    with forcing_moves({3: "flattening tp=2", 4: "nowhere"}):
        assert replanner.take_target(2) is None
        forced = replanner.take_target(3)
        assert forced.forced and forced.label.startswith("flattening tp=2")
        assert forced.plan["actor"].tp == 2 and "shadow_actor" not in forced.plan.models
        with pytest.raises(ValueError, match="'nowhere'"):
            replanner.take_target(4)
    assert replanner.take_target(3) is None  # the hook is gone with its block


def test_the_candidates_are_found_at_the_first_replanning_not_at_the_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding the candidates ranks every placement: a run pays for it when it first re-plans
    (on rank 0 alone), not before its first step, and once."""
    from megatron_rlhf.engine.run import replan

    calls = []
    found = replan.candidate_plans

    def counted(*args):
        calls.append(args)
        return found(*args)

    monkeypatch.setattr(replan, "candidate_plans", counted)
    replanner = _replanner(tmp_path, monkeypatch, "placement.replan.move=true")
    assert calls == []
    result = _as_predicted(replanner)
    assert len(calls) == 1
    assert {c.label for c in result.ranking} == set(replanner.labels)
    replanner.move_cost_s = 0.0
    assert replanner.decide(0, result)[0].config is replanner.configs[result.best.label]
    assert len(calls) == 1


def test_a_move_is_judged_over_the_steps_left_up_to_the_horizon(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A move that the next 2 steps do not repay but the 9 left do is taken at the first
    re-planning; with ``horizon_steps=2`` the same move is judged over 2 steps and refused."""
    (tmp_path / "whole").mkdir()
    (tmp_path / "capped").mkdir()
    whole = _replanner(tmp_path / "whole", monkeypatch, "placement.replan.move=true")
    capped = _replanner(tmp_path / "capped", monkeypatch, "placement.replan.move=true",
                        "placement.replan.horizon_steps=2")
    result = _as_predicted(whole)
    current = result.current.prediction.step_seconds
    per_step = current - result.best.prediction.step_seconds
    # Over 2 steps a move pays below 2 * per_step - 0.1 * current; over 9, below
    # 9 * per_step - 0.45 * current: a cost between the two.
    cost = (2 * per_step - 0.1 * current + 9 * per_step - 0.45 * current) / 2
    whole.move_cost_s = capped.move_cost_s = cost
    target, saving = whole.decide(0, result)
    assert target is not None and saving == pytest.approx(9 * per_step)
    target, saving = capped.decide(0, result)
    assert target is None and saving == pytest.approx(2 * per_step)
    assert capped.steps_ahead(8) == 1 and whole.steps_ahead(8) == 1
    assert capped.steps_ahead(3) == 2 and whole.steps_ahead(3) == 6


@pytest.mark.parametrize("overrides", [[], ["placement.replan.min_gain=0.99"]])
def test_no_move_without_the_switch_or_below_min_gain(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      overrides: list[str]) -> None:
    move = [] if not overrides else ["placement.replan.move=true"]
    replanner = _replanner(tmp_path, monkeypatch, *move, *overrides)
    replanner.move_cost_s = 0.0
    result = _as_predicted(replanner)
    assert result.gain > 0.05
    assert replanner.decide(0, result)[0] is None


def test_move_must_be_a_boolean() -> None:
    from megatron_rlhf.topology.placement_config import ReplanConfig

    with pytest.raises(ValueError, match="placement.replan.move='yes'"):
        ReplanConfig(interval_steps=1, move="yes")
    with pytest.raises(ValueError, match="placement.replan.interval_steps above 0"):
        ReplanConfig(move=True)
    assert ReplanConfig(interval_steps=1, move=True).move


def test_a_move_is_logged_with_the_steps_the_progress_line_counts() -> None:
    """A move at the boundary after ``step 3/8`` (index 2) used to be logged after step 2; the
    mover now passes the steps done (index + 1)."""
    from megatron_rlhf.engine.run.move import moved_message

    assert moved_message(3, "flattening", "separation", {"save_s": 1.0, "load_s": 0.5}) == (
        "moved after step 3 from flattening to separation in 1.50 s (save_s 1.00, load_s 0.50)")


def test_a_move_back_must_beat_what_was_measured_there_and_repay_the_round_trip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """From separation the run moves to flattening (predicted faster). Back at flattening the
    predictions flip (separation priced 0.6 s against flattening's 0.9 s), but separation was
    measured at 1.0 s a step on the same answers: no move back, whatever the move costs. Once
    the answers have changed, the measurement no longer stands for separation, and going back
    must also repay the 0.8 s the move away from it took."""
    from dataclasses import replace

    from megatron_rlhf.planner.replan import Measured, Priced, Replan

    replanner = _replanner(tmp_path, monkeypatch, "placement.replan.move=true",
                           "placement.replan.horizon_steps=2")
    result = _as_predicted(replanner)
    separation = replanner.current
    replanner.move_cost_s = 0.0
    target, _ = replanner.decide(0, result)
    assert _strategy(target.label) == "flattening"
    replanner.last_measured = Measured({}, step_seconds=1.0, response_length=6.0)
    replanner.moved(target, 0, seconds=0.8)
    assert replanner.current[0] == target.label and replanner.move_cost_s == 0.8
    other = next(label for label in replanner.labels
                 if label not in (target.label, separation[0]))
    flat_prediction = next(c.prediction for c in result.ranking if c.label == target.label)

    def flipped(length: int, seconds: float, label: str = separation[0]) -> Replan:
        """At flattening (0.9 s calibrated), ``label`` priced ``seconds`` a step."""
        mine = Priced(target.label, target.plan, replace(flat_prediction, step_seconds=0.9))
        plan = dict(replanner.candidates).get(label, separation[1])
        priced = Priced(label, plan, replace(flat_prediction, step_seconds=seconds))
        shapes = replace(replanner.rollout, generation_length=length)
        return Replan((priced,), mine, priced, 1 - seconds / 0.9, {}, {}, shapes)

    # The same answers (6 tokens): separation counts at its measured 1.0 s, slower than 0.9.
    assert replanner.decide(2, flipped(6, 0.01)) == (None, 0.0)
    # Answers of 12 tokens: 2 steps ahead save 2 x 0.5 = 1.0 s, short of min_gain's 0.09 plus
    # this move's 0.8 plus the round trip's 0.8; a placement never left would have moved.
    target_back, saving = replanner.decide(2, flipped(12, 0.4))
    assert target_back is None and saving == pytest.approx(1.0)
    assert replanner.decide(2, flipped(12, 0.4, other))[0].label == other
    # A saving of 2 x 0.89 = 1.78 s repays the round trip (1.69 s): the run goes back.
    assert replanner.decide(2, flipped(12, 0.01))[0].label == separation[0]


def _priced(replanner, current_s: float, others: dict[str, float], length: int = 6):
    """A ranking by hand: the run's placement calibrated at ``current_s`` seconds a step, each
    candidate of ``others`` (label -> seconds) priced so, answers of ``length`` tokens."""
    from dataclasses import replace

    from megatron_rlhf.planner.replan import Priced, Replan

    base = _as_predicted(replanner).current.prediction
    label, plan = replanner.current
    mine = Priced(label, plan, replace(base, step_seconds=current_s))
    plans = dict(replanner.candidates)
    ranking = sorted((Priced(other, plans[other], replace(base, step_seconds=seconds))
                      for other, seconds in others.items()),
                     key=lambda c: c.prediction.step_seconds)
    best = ranking[0] if ranking[0].prediction.step_seconds < current_s else mine
    shapes = replace(replanner.rollout, generation_length=length)
    return Replan(tuple(ranking), mine, best, 1 - best.prediction.step_seconds / current_s, {},
                  {}, shapes)


def test_a_trial_needs_a_close_runner_up_and_steps_left_that_repay_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """At separation (1.0 s a step), flattening priced 1.05 s is within trial_margin (0.1);
    the trial measures 3 steps (warmup 1 + interval 2). After step 0 of 10, the 6 steps after
    it repay, at 0.1 s a step, 0.6 s: more than the trial's 3 x 0.1 s plus two moves while a
    move costs under 0.15 s."""
    replanner = _replanner(tmp_path, monkeypatch, "placement.replan.move=true",
                           "placement.replan.trial_margin=0.1")
    flattening = next(label for label in replanner.labels if label == FLATTENING)
    close = _priced(replanner, 1.0, {flattening: 1.05})
    replanner.move_cost_s = 0.15 - 1e-9
    assert replanner.decide(0, close)[0] is None  # slower as predicted: no move
    trial = replanner.trial(0, close)
    assert trial is not None and trial.trial and trial.label == flattening
    replanner.move_cost_s = 0.15 + 1e-9
    assert replanner.trial(0, close) is None
    replanner.move_cost_s = 0.0
    assert replanner.trial(5, close) is None  # 4 steps left: 1 after the trial's 3
    assert replanner.trial(0, _priced(replanner, 1.0, {flattening: 1.11})) is None
    assert replanner.trial(0, _priced(replanner, 1.0, {flattening: 0.95})).label == flattening


def test_a_trial_happens_once_and_its_measurement_decides_without_oscillating(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run tries flattening after its first re-planning; flattening measures 1.2 s against
    separation's 1.0 s, so the next re-planning goes back (predicted 0.9 s, counted at the 1.0
    s measured). Back at separation, flattening counts at its measured 1.2 s whatever it is
    predicted, and no second trial comes."""
    from megatron_rlhf.engine.run import replan
    from megatron_rlhf.planner.replan import Measured

    replanner = _replanner(tmp_path, monkeypatch, "placement.replan.move=true",
                           "placement.replan.trial_margin=0.1")
    separation = replanner.current
    flattening = next(label for label in replanner.labels if label == FLATTENING)
    replanner.move_cost_s = 0.1

    def replanned(step: int, result) -> dict:
        monkeypatch.setattr(replan, "rerank", lambda *args, **kwargs: result)
        replanner.last_measured = Measured({}, result.current.prediction.step_seconds, 6.0)
        metrics, target = replanner.replan(step, replanner.last_measured)
        if target is not None:
            replanner.moved(target, step, seconds=0.1)
        return metrics

    assert replanned(0, _priced(replanner, 1.0, {flattening: 1.05}))["replan/trial"] == 1.0
    assert replanner.current[0] == flattening
    # At flattening, measured 1.2 s: separation predicted 0.9 s counts at its measured 1.0 s;
    # 6 steps x 0.2 s = 1.2 s repay min_gain's 0.36 s, this move's 0.1 s and the trial's 0.1 s.
    metrics = replanned(3, _priced(replanner, 1.2, {separation[0]: 0.9}))
    assert metrics["replan/move"] == 1.0 and metrics["replan/trial"] == 0.0
    assert replanner.current[0] == separation[0]
    for step in (6, 8):
        metrics = replanned(step, _priced(replanner, 1.0, {flattening: 0.9}))
        assert metrics["replan/move"] == 0.0 and metrics["replan/trial"] == 0.0
    history = [json.loads(line) for line in (tmp_path / "plan_history.jsonl").read_text()
               .splitlines()]
    assert [line["trial"] for line in history] == [True, False, False, False]


def test_a_trial_needs_moves_and_a_margin_below_one() -> None:
    from megatron_rlhf.topology.placement_config import ReplanConfig

    with pytest.raises(ValueError, match=r"trial_margin=0.1 .* placement\.replan\.move=true"):
        ReplanConfig(interval_steps=2, trial_margin=0.1)
    with pytest.raises(ValueError, match=r"placement\.replan\.trial_margin=1\.0"):
        ReplanConfig(interval_steps=2, move=True, trial_margin=1.0)
    assert ReplanConfig(interval_steps=2, move=True, trial_margin=0.1).trial_margin == 0.1
