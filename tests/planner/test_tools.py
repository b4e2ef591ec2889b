"""tools/plan_placement.py --predict/--auto and tools/calibrate.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_rlhf.planner import load_profile
from tests.scripts import load_script


def _tool(name: str):
    return load_script(f"tools/{name}.py")


def test_predict_prints_samples_stages_memory_and_largest_batch(
        capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool("plan_placement")
    tool.main(["--nodes", "2", "--placement", "separation", "--tp", "4", "--model", "llama-13b",
               "--predict", "--batch", "512"])
    out = capsys.readouterr().out
    for text in ("samples/s", "generation", "memory per device", "KV cache room",
                 "pipelined"):
        assert text in out
    tool.main(["--nodes", "1", "--placement", "flattening", "--tp", "2", "--model", "llama-7b",
               "--predict", "--json", "--batch", "64"])
    body = json.loads(capsys.readouterr().out)
    assert set(body) == {"plan", "rollout", "prediction"}
    prediction = body["prediction"]
    assert {"samples_per_s", "stage_seconds", "memory_gib", "largest_batch",
            "bottleneck", "peak_gib_per_device", "memory_options",
            "generation_micro_batch"} <= set(prediction)
    assert prediction["memory_options"]["actor"] == {
        "sharding": "distributed_optimizer", "recompute": False, "offload": False,
        "optimizer_offload": False, "label": "distributed_optimizer"}
    assert 0 < prediction["peak_gib_per_device"] <= prediction["usable_gib_per_device"]
    tool.main(["--nodes", "1", "--placement", "flattening", "--tp", "4", "--pp", "2",
               "--model", "llama-33b", "--predict", "--json", "--memory-options", "offload"])
    assert not json.loads(capsys.readouterr().out)["prediction"]["feasible"]


def test_auto_ranks_candidates_as_text_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool("plan_placement")
    tool.main(["--nodes", "1", "--gpus-per-node", "4", "--model", "llama-7b", "--auto",
               "--batch", "64", "--top", "3"])
    out = capsys.readouterr().out
    assert out.splitlines()[1].lstrip().startswith("1 ") and "why:" in out
    tool.main(["--nodes", "1", "--gpus-per-node", "4", "--model", "llama-7b", "--auto",
               "--batch", "64", "--json"])
    body = json.loads(capsys.readouterr().out)
    assert body["best"] == body["candidates"][0] and body["reason"]
    assert body["best"]["peak_gib_per_device"] > 0
    assert set(body["best"]["memory_options"]) == {"actor", "critic", "ref", "reward"}


def test_profile_flag_and_unknown_kind(capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool("plan_placement")
    tool.main(["--nodes", "1", "--kind", "cpu-box", "--memory-gib", "64", "--tp", "2",
               "--model", "llama-7b", "--predict", "--batch", "32", "--profile", "H100-80GB"])
    assert "samples/s" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--nodes", "1", "--kind", "cpu-box", "--model", "tiny", "--predict"])
    assert exit_info.value.code == 2
    assert "has no hardware profile" in capsys.readouterr().err


def test_calibrate_writes_a_loadable_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    tool = _tool("calibrate")
    # The 2-process collective benchmark is replaced by fixed samples: 1 ms latency, 1 GB/s.
    monkeypatch.setattr(tool, "measure_collectives",
                        lambda backend: [(256, 1e-3), (2**20, 2**20 / 1e9), (2**24, 2**24 / 1e9)])
    out = tmp_path / "cpu.json"
    tool.main(["--name", "cpu-test", "--out", str(out), "--copy-mib", "4"])
    line = json.loads(capsys.readouterr().out)
    profile = load_profile(out)
    assert line["name"] == profile.name == "cpu-test"
    assert profile.collective_latency_s == 1e-3 and profile.intra_node_gbps == pytest.approx(8)
    assert profile.peak_tflops > 0 and profile.hbm_gb_per_s > 0 and profile.layer_latency_s > 0


def test_predict_prices_a_stated_mean_answer(capsys: pytest.CaptureFixture[str]) -> None:
    """--answer-mean 64 of at most 256 tokens: the rollout carries the distribution, and the
    generation costs less than every answer at 256 and more than every answer at 64."""
    tool = _tool("plan_placement")
    base = ["--nodes", "1", "--placement", "flattening", "--tp", "2", "--model", "llama-7b",
            "--predict", "--json", "--batch", "64"]

    def run(*flags: str) -> dict:
        tool.main([*base, *flags])
        return json.loads(capsys.readouterr().out)

    spread = run("--answer-mean", "64")
    lengths = spread["rollout"]["answer_lengths"]
    assert lengths["cap"] == 256 and lengths["mean"] == pytest.approx(64, rel=0.01)
    seconds = {name: body["prediction"]["stage_seconds"]["generation"] for name, body in (
        ("spread", spread), ("cap", run()), ("mean", run("--generation-length", "64")))}
    assert seconds["mean"] < seconds["spread"] < seconds["cap"]
    with pytest.raises(SystemExit):
        tool.main([*base, "--answer-max", "100"])
    assert "--answer-max needs --answer-mean" in capsys.readouterr().err


def test_predict_prices_each_asynchronous_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """--continue-answers implies partial rollouts and generation's log-probs; --off-policy
    decoupled adds the actor's proximal forward; the JSON names the mode priced."""
    tool = _tool("plan_placement")
    base = ["--placement", "separation", "--no-critic", "--no-reward", "--model", "llama-7b",
            "--predict", "--json", "--batch", "64", "--generation-length", "1024",
            "--answer-mean", "200"]

    def run(*flags: str) -> dict:
        tool.main([*base, *flags])
        body = json.loads(capsys.readouterr().out)
        return {**body["prediction"], "rollout": body["rollout"]}

    off, continued = run(), run("--continue-answers", "--off-policy", "decoupled")
    assert (off["mode"], continued["mode"]) == ("one step off", "answers across steps")
    assert continued["rollout"]["partial_rollouts"] and continued["rollout"]["reuse_logprobs"]
    names = {task["name"] for task in continued["tasks"]}
    assert "experience:actor (proximal)" in names and "experience:shadow_actor" not in names
    assert continued["samples_per_s"] > off["samples_per_s"]
    assert run("--no-overlap", "--partial-rollouts")["mode"] == "synchronous"
