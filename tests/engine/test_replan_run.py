"""Re-planning during a 2-rank run: a history line and ``replan/*`` metrics per interval, and
every other result equal to the same run without re-planning (bit-exact on CPU)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.engine.run.replan import stage_seconds
from megatron_rlhf.planner import HardwareProfile
from megatron_rlhf.runtime.tracing import Span
from tests.multirank import run_on_ranks

STEPS = 3
REPLAN_KEYS = {"replan/best", "replan/current_predicted_s", "replan/best_predicted_s",
               "replan/predicted_gain", "replan/would_move"}
MEASURED = ("step_seconds", "samples_per_s")
"""Wall-clock measurements: they differ between any two runs."""


def _run(root: str, overrides: list[str]) -> list[dict]:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.runner import run_ppo

    config = load_config(RunConfig, Path("examples/ppo_tiny.yaml"), [
        f"run_dir={root}", f"steps={STEPS}", "rollout.prompts_per_step=8", *overrides])
    run_dir = run_ppo(config)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _results(record: dict) -> dict:
    """The record without measurements of time (and without the re-planning's own)."""
    return {key: value for key, value in record.items()
            if key not in MEASURED and not key.startswith(("throughput/", "replan/"))}


def test_spans_count_once_per_planner_stage_where_they_overlap() -> None:
    spans = [Span("generate", "actor", 0, 0.0, 2.0), Span("generate", "actor", 1, 1.0, 3.0),
             Span("train", "actor", -1, 3.0, 4.5), Span("train", "critic", -1, 4.0, 5.0),
             Span("advantages", "", -1, 5.0, 9.0), Span("sync_weights", "", -1, 5.0, 5.25)]
    assert stage_seconds(spans) == {"generation": 3.0, "experience": 0.0, "training": 2.0,
                                    "transfer": 0.0, "sync": 0.25}


@pytest.mark.multirank
@pytest.mark.timeout(400)
def test_replanning_records_its_ranking_and_changes_no_result(tmp_path: Path) -> None:
    # The local pool is named "local": a profile of that name (a slow CPU-like device).
    profile = HardwareProfile(name="local", peak_tflops=0.05, hbm_gb_per_s=10.0, memory_gib=8.0,
                              intra_node_gbps=10.0, inter_node_gbps=10.0, host_gb_per_s=5.0,
                              host_cores=2)
    path = tmp_path / "local.json"
    path.write_text(json.dumps(profile.to_dict()))
    replan = ["placement.replan.interval_steps=1", "placement.replan.warmup_steps=0",
              f"placement.replan.profile={path}"]
    plain = run_on_ranks(_run, world_size=2, args=(str(tmp_path / "plain"), []),
                         timeout_s=180)[0]
    replanned = run_on_ranks(_run, world_size=2, args=(str(tmp_path / "replan"), replan),
                             timeout_s=180)[0]
    assert len(plain) == len(replanned) == STEPS
    for before, after in zip(plain, replanned, strict=True):
        assert REPLAN_KEYS <= set(after) and not REPLAN_KEYS & set(before)
        assert _results(after) == _results(before)
        gain = after["replan/predicted_gain"]
        assert gain == pytest.approx(1 - after["replan/best_predicted_s"]
                                     / after["replan/current_predicted_s"])
        assert after["replan/would_move"] == float(gain > 0.05)
    lines = [json.loads(line) for line in
             (tmp_path / "replan" / "plan_history.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(STEPS))
    for line, record in zip(lines, replanned, strict=True):
        assert line["current"].startswith("flattening")
        assert line["predicted_gain"] == pytest.approx(record["replan/predicted_gain"], abs=1e-6)
        ranking = [entry["step_seconds"] for entry in line["ranking"] if entry["feasible"]]
        assert ranking == sorted(ranking) and len(ranking) >= 2
        assert line["ranking"][0]["label"] == line["best"] or line["predicted_gain"] == 0
        versus = line["predicted_vs_measured"]
        assert {"generation", "training", "step"} <= set(versus)
        # the calibrated prediction of the run's own placement takes the measured stage times
        for stage in ("generation", "training"):
            assert versus[stage]["predicted_after"] == pytest.approx(
                versus[stage]["measured"], rel=0.05)
