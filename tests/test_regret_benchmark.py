"""benchmarks/regret.py: its workload table, the command lines it builds, its reading of a run's
records and log, its regret arithmetic and its JSON line (no run starts)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import regret  # noqa: E402


def test_every_workload_exists_and_runs_only_placements_that_apply() -> None:
    for name, workload in regret.WORKLOADS.items():
        config = (ROOT / workload.config).read_text()
        assert set(workload.statics) <= set(regret.STATIC_RUNS), name
        # interleaving2 needs a critic: only the PPO (gae) workloads have one
        critic_free = "advantage_estimator: grpo" in config or "ppo_grpo" in config
        assert ("interleaving2" in workload.statics) != critic_free, name
        assert workload.interval < workload.steps <= 60, name
        assert "rollout.async_rollout=true" not in workload.overrides
        assert workload.moving_from in (None, *workload.statics), name
    defaults = [name for name, w in regret.WORKLOADS.items() if w.default]
    assert {"drifting-grpo-2", "ppo-critic-4-short", "ppo-critic-4-long"} <= set(defaults)
    assert {regret.WORKLOADS[name].ranks for name in defaults} == {2, 4}
    assert any(regret.WORKLOADS[name].moving_from for name in defaults)


def test_command_lines_of_static_and_auto_runs(tmp_path: Path) -> None:
    workload = regret.WORKLOADS["ppo-critic-4-long"]
    static = regret.run_command(workload, "interleaving2", tmp_path / "i2", [])
    assert static[static.index("--nproc-per-node") + 1] == "4"
    assert "placement.strategy=interleaving2" in static
    assert "generation.max_new_tokens=96" in static and "generation.stop_at_eos=false" in static
    assert f"run_dir={tmp_path / 'i2'}" in static and "steps=12" in static
    assert "--placement" not in static and not any("replan" in a for a in static)
    auto = regret.run_command(workload, "auto", tmp_path / "a", ["x=1"], tmp_path / "p.json")
    assert auto[auto.index("--placement") + 1] == "auto"
    assert auto[auto.index("--profile") + 1] == str(tmp_path / "p.json")
    for override in ("placement.replan.interval_steps=3", "placement.replan.warmup_steps=1",
                     "placement.replan.move=true", "placement.replan.trial_margin=0.1",
                     f"placement.replan.profile={tmp_path}/p.json",
                     "x=1"):
        assert override in auto
    assert not any(a.startswith("placement.strategy=") for a in auto)
    assert "--profile" not in regret.run_command(workload, "auto", tmp_path / "a", [])
    assert regret.run_names(workload)[-2:] == ["auto", "moves-from-flattening"]
    moving = regret.run_command(workload, "moves-from-flattening", tmp_path / "m", [])
    assert "--placement" not in moving and "placement.strategy=flattening" in moving
    assert {"placement.replan.interval_steps=3", "placement.replan.move=true"} <= set(moving)


def test_rounds_alternate_their_order() -> None:
    workload = regret.WORKLOADS["drifting-grpo-2"]
    first, second = regret.round_order(workload, 0), regret.round_order(workload, 1)
    assert first == ["flattening", "interleaving", "separation", "auto"]
    assert second == first[::-1] and regret.round_order(workload, 2) == first


def test_auto_choice_and_its_static_run() -> None:
    log = ("x\nrun_ppo: placement auto -> separation: separation(2/4 train) tp=1 pp=1 "
           "shadow_tp=1 wins with 187 samples/s, 1.01x interleaving2 tp=1 pp=1 (184); ...\n")
    label = regret.auto_choice(log)
    assert label == "separation(2/4 train) tp=1 pp=1 shadow_tp=1"
    assert regret.static_of(label) == "separation"
    assert regret.static_of("flattening tp=1 pp=1") == "flattening"
    assert regret.static_of("interleaving2 tp=1 pp=1") == "interleaving2"
    assert regret.static_of("interleaving tp=1 pp=1") == "interleaving"
    for other in ("flattening tp=2 pp=1", "separation(3/4 train) tp=1 pp=1 shadow_tp=1",
                  "separation(2/4 train) tp=1 pp=1 shadow_tp=2",
                  "custom[0.5, 0.5, 0.25, 0.25] tp=1 pp=1", None):
        assert regret.static_of(other) is None
    assert regret.auto_choice("no auto here") is None


def test_step_seconds_leave_out_the_first_step_and_count_moves() -> None:
    records = [{"step": 0, "step_seconds": 9.0, "response_length": 4},
               {"step": 1, "step_seconds": 1.0, "response_length": 4},
               {"step": 2, "step_seconds": 1.0, "response_length": 8,
                "replan/move_seconds": 1.5},
               {"step": 3, "eval/x": 1.0}]
    assert regret.step_seconds(records) == {"s_per_step": 1.75, "steps_measured": 2,
                                            "move_s": 1.5, "response_length": 6.0}


def _round(flat: float, sep: float, auto: float, moves=(), moving: float | None = None) -> dict:
    runs = {"flattening": {"s_per_step": flat, "wall_s": 10 * flat},
            "separation": {"s_per_step": sep, "wall_s": 10 * sep},
            "auto": {"s_per_step": auto, "wall_s": 10 * auto + 1,
                     "initial": "flattening tp=1 pp=1", "moves": list(moves)}}
    if moving is not None:
        runs["moves-from-flattening"] = {"s_per_step": moving, "wall_s": 10 * moving + 2,
                                         "moves": [{"after_step": 3, "to": "separation"}]}
    return runs


def test_regret_against_the_best_static_and_the_start() -> None:
    workload = regret.Workload("c.yaml", ranks=2, steps=10, interval=2,
                               statics=("flattening", "separation"))
    rounds = [_round(1.0, 0.8, 0.82, [{"after_step": 2, "to": "separation"}]),
              _round(1.2, 0.8, 0.86)]
    figures = regret.workload_figures(workload, rounds)
    assert figures["best_static"] == "separation"
    assert figures["runs"]["flattening"]["s_per_step"] == 1.1
    assert figures["runs"]["auto"]["rounds_s_per_step"] == [0.82, 0.86]
    assert figures["regret"] == 0.05  # 0.84 / 0.8 - 1
    assert figures["regret_by_round"] == [0.025, 0.075] and figures["regret_median"] == 0.05
    assert figures["runs"]["flattening"]["spread"] == 0.2 and figures["noise"] == 0.2
    assert figures["auto_start_static"] == "flattening"
    assert figures["vs_start"] == round(0.84 / 1.1 - 1, 4)
    assert figures["vs_start_by_round"] == [-0.18, round(0.86 / 1.2 - 1, 4)]
    assert figures["within_5pct"] and figures["not_worse_than_start"]
    assert figures["regret_wall"] == round(9.4 / 8.0 - 1, 4)
    assert figures["auto_moves"][0][0]["to"] == "separation" and figures["auto_moves"][1] == []
    assert "moving" not in figures
    worse = regret.workload_figures(workload, [_round(1.0, 0.8, 1.01)])
    assert not worse["within_5pct"] and not worse["not_worse_than_start"]


def test_paired_regret_takes_the_median_of_rounds_so_one_disturbed_round_does_not_count() -> None:
    """The second of three rounds ran auto under a burst of load (2x its step): the regret
    from the means is 27%, the median of the rounds' own regrets 2.5%."""
    workload = regret.Workload("c.yaml", ranks=2, steps=10, interval=2,
                               statics=("flattening", "separation"), moving_from="flattening")
    rounds = [_round(1.0, 0.8, 0.82, moving=0.9), _round(1.0, 0.8, 1.6, moving=0.88),
              _round(1.0, 0.8, 0.82, moving=1.1)]
    figures = regret.workload_figures(workload, rounds)
    assert figures["regret"] == round(1.08 / 0.8 - 1, 4)
    assert figures["regret_by_round"] == [0.025, 1.0, 0.025]
    assert figures["regret_median"] == 0.025 and figures["within_5pct"]
    moving = figures["moving"]
    assert moving["from"] == "flattening" and moving["moves"][0][0]["to"] == "separation"
    assert moving["vs_start_by_round"] == [-0.1, -0.12, 0.1]
    assert moving["vs_start_median"] == -0.1 and moving["not_worse_than_start"]
    assert moving["regret_by_round"] == [0.125, 0.1, 0.375] and moving["regret_median"] == 0.125
    assert regret.median([0.3, None, 0.1]) == 0.2 and regret.median([None]) is None


def test_dry_run_prints_one_json_line_of_commands(tmp_path: Path, capsys) -> None:
    line = regret.main(["--dry-run", "--out-dir", str(tmp_path), "--repeats", "2",
                        "--workloads", "ppo-critic-4-short", "drifting-grpo-2"])
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and json.loads(printed[0]) == line
    assert len(line["commands"]) == 2 * (5 + 4)
    assert line["workloads"] == {} and not (tmp_path / "ppo-critic-4-short").exists()
    drifting = [c for c in line["commands"] if "drifting_lengths" in c]
    assert all(f"models.actor_checkpoint={tmp_path}/sft/checkpoint" in c for c in drifting)
