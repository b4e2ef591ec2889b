"""A CPU run's ``local`` pool gets this machine's profile with no profile named: measured once
(monkeypatched here to be fast and exact), cached under the profile cache, read back by the
next resolution without measuring; ``--placement auto`` plans with it, in a unit and in a real
2-rank run; a GPU pool of unknown kind is still refused, naming ``--profile``."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_rlhf.planner import local_profile
from megatron_rlhf.planner.hardware import resolve_profiles
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
from tests.multirank import run_on_ranks

MEASURED = local_profile.CPUMeasurement(flops_per_s=4e10, copy_bytes_per_s=8e9,
                                        memory_bytes=16 * 2**30, seconds=0.01)


def _fake_measure(calls: list) -> Callable[[], local_profile.CPUMeasurement]:
    def measure() -> local_profile.CPUMeasurement:
        calls.append(1)
        return MEASURED
    return measure


def test_a_local_cpu_pool_is_measured_once_then_read_from_the_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    calls: list = []
    monkeypatch.setattr(local_profile, "measure_cpu", _fake_measure(calls))
    cluster = ClusterSpec((DevicePool("local", nodes=1, devices_per_node=2),))
    with caplog.at_level(logging.INFO, logger="megatron_rlhf"):
        (first,) = resolve_profiles(cluster, local_profile.pool_profiles(cluster, None, tmp_path)[0])
    assert calls == [1]
    assert (first.peak_tflops, first.hbm_gb_per_s, first.memory_gib) == (0.04, 8.0, 8.0)
    (cached,) = tmp_path.glob("*.json")
    assert json.loads(cached.read_text()) == first.to_dict()
    assert "pool 'local': measured CPU profile" in caplog.text and str(cached) in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="megatron_rlhf"):
        (second,) = resolve_profiles(cluster, local_profile.pool_profiles(cluster, None, tmp_path)[0])
    assert calls == [1], "the second resolution read the cache"
    assert second == first and "pool 'local': using cached CPU profile" in caplog.text


def test_auto_placement_plans_a_cpu_run_without_a_profile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RolloutConfig, RunConfig
    from megatron_rlhf.engine.run.auto_placement import choose_placement
    from megatron_rlhf.engine.run.build import make_plan
    from megatron_rlhf.engine.run.replan import check_replan

    calls: list = []
    monkeypatch.setattr(local_profile, "measure_cpu", _fake_measure(calls))
    monkeypatch.setattr(local_profile, "PROFILE_CACHE_DIR", str(tmp_path))
    cluster = ClusterSpec((DevicePool("local", nodes=1, devices_per_node=4),))
    config = RunConfig(rollout=RolloutConfig(prompts_per_step=16, micro_batch_size=2))
    chosen, reason = choose_placement(config, cluster)
    make_plan(chosen, cluster)
    assert "samples/s" in reason and calls == [1]
    assert f"pool 'local': measured CPU profile (40.0 GFLOP/s, 8.0 GB/s, 4.0 GiB per rank) " \
           f"cached at {tmp_path}" in reason
    replanned = load_config(RunConfig, None, ["placement.replan.interval_steps=2"])
    check_replan(replanned, cluster)  # re-planning resolves the same cached profile
    assert calls == [1]
    # several nodes could measure different numbers: refused, naming the fix
    with pytest.raises(ValueError, match=r"pool 'local' has no hardware profile.*--profile"):
        choose_placement(config, ClusterSpec((DevicePool("local", nodes=2,
                                                         devices_per_node=2),)))


def _auto_run(root: str) -> tuple[list[str], str]:
    import contextlib
    import io

    from tools import run_ppo as run_ppo_tool

    local_profile.PROFILE_CACHE_DIR = f"{root}/profiles"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        code = run_ppo_tool.main([
            "--placement", "auto", "--steps", "1", "--run-dir", f"{root}/run",
            "rollout.prompts_per_step=4", "rollout.ppo_epochs=1", "rollout.num_minibatches=1",
            "generation.max_new_tokens=4"])
    assert code == 0, (code, stderr.getvalue())
    return sorted(path.name for path in Path(f"{root}/profiles").glob("*.json")), stderr.getvalue()


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_two_rank_cpu_run_places_itself_with_a_measured_profile(tmp_path: Path) -> None:
    (cached, said), (_, _) = run_on_ranks(_auto_run, world_size=2, args=(str(tmp_path),),
                                          timeout_s=240)
    assert len(cached) == 1, cached  # one measurement for both ranks
    assert "run_ppo: placement auto -> " in said and "CPU profile" in said, said
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 1 and "kl" in json.loads(metrics[0])
