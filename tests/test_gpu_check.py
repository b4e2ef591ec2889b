"""The GPU check and its benchmark run on CPU too, so a slip in them cannot waste GPU time."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import REPO

TINY = ["--layers", "2", "--hidden", "64", "--heads", "4", "--query-groups", "2", "--ffn", "128",
        "--vocab", "256", "--seq", "32", "--micro-batch", "2", "--micro-batches", "2",
        "--train-steps", "1", "--decode-batch", "4", "--prompt", "8", "--new-tokens", "8",
        "--attention", "packed,sdpa,megatron"]


_RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
               "MASTER_PORT")


def _run(args: list[str], tmp_path: Path, timeout: float) -> subprocess.CompletedProcess:
    # Without the rendezvous variables a world of one set up in this pytest process leaves:
    # the child would try to serve the same port.
    env = {key: value for key, value in os.environ.items() if key not in _RENDEZVOUS}
    env.update(PYTHON=sys.executable, LOG_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    return subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU behaviour")
def test_gpu_check_skips_its_gpu_parts_on_cpu_and_says_so(tmp_path: Path) -> None:
    # --out names the output directory, before the environment's LOG_DIR
    result = _run(["bash", "scripts/gpu_check.sh", "--out", str(tmp_path)], tmp_path / "env",
                  timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (tmp_path / "env").exists()
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["cuda"] is False and summary["passed"] is True
    assert "no CUDA device" in summary["skipped"]
    assert summary["gpu_tests"]["skipped"] >= 5 and "passed" not in summary["gpu_tests"]
    assert list(summary["parts"]) == ["gpu_tests"]
    assert summary["parts"]["gpu_tests"]["limit_s"] == summary["limits_s_total"] > 0
    # what comes back from a device command: a few files, no run directories
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.log", "parts.txt",
                                                        "summary.json"]
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert "##### gpu_check: logs/gpu_tests.0.log #####" in (tmp_path / "gpu_check.log").read_text()
    assert not summary["run_dir"].startswith(str(tmp_path))


def test_gpu_check_takes_out_dir_and_refuses_an_empty_one_or_another_argument(
        tmp_path: Path) -> None:
    """A cluster user's flags: ``--out DIR``; ``--help`` prints the header; a mistake exits 2
    before anything runs."""
    usage = _run(["bash", "scripts/gpu_check.sh", "--help"], tmp_path, timeout=30)
    assert usage.returncode == 0 and "--out DIR" in usage.stdout
    assert not usage.stdout.startswith("#") and "set -uo" not in usage.stdout
    for args, said in [(["--out", ""], "--out needs a directory"), (["--out="], "--out needs"),
                       (["--outdir", "x"], "unknown argument --outdir")]:
        done = _run(["bash", "scripts/gpu_check.sh", *args], tmp_path / "env", timeout=30)
        assert done.returncode == 2 and said in done.stderr, (args, done.stderr)
    assert not (tmp_path / "env").exists()


SCRIPT = REPO / "scripts" / "gpu_check.sh"
DEVICE_COMMAND_S = 600
"""One device command's limit; the parts' limits must leave room for set-up and the summary."""


PART = re.compile(r"^\s*(run_part|start_part)\s+(\S+)\s+(\S+)\s|^\s*(wait_parts)\b",
                  flags=re.MULTILINE)
ONE_GPU_S = 365
"""The parts' limits on one GPU: a machine start, the check and a rerun of the parts that failed
fit 15 minutes of device time."""


def _part_groups() -> list[dict[str, int]]:
    """The script's parts as they run, after its functions (``export -f``): each ``run_part NAME
    LIMIT`` alone, the ``start_part`` calls before a ``wait_parts`` side by side (such a group
    takes as long as its largest limit). A part named twice (the CPU branch repeats
    ``gpu_tests``) counts once, with its larger limit."""
    text = SCRIPT.read_text()
    calls = text[text.index("\nexport -f "):]
    groups: list[dict[str, int]] = []
    together: dict[str, int] = {}
    for kind, name, limit, wait in PART.findall(calls):
        if wait:
            groups.append(together)
            together = {}
            continue
        assert limit.isdigit(), (name, limit)  # literal limits only
        if kind == "start_part":
            together[name] = int(limit)
        else:
            groups.append({name: int(limit)})
    assert not together, f"start_part without wait_parts: {together}"
    assert sum(map(len, groups)) == len(re.findall(r"^\s*(?:run_part|start_part)\s", calls,
                                                  flags=re.MULTILINE))
    merged: dict[frozenset, dict[str, int]] = {}
    for group in groups:
        kept = merged.setdefault(frozenset(group), {})
        for name, limit in group.items():
            kept[name] = max(kept.get(name, 0), limit)
    return list(merged.values())


def test_gpu_check_fits_one_device_command() -> None:
    """The parts' time limits, the NCCL parts of a machine with several GPUs included, add up to
    540 s at most (a 600 s command with set-up, the summary and timeout's grace periods); on one
    GPU to ``ONE_GPU_S``. The short world-size-1 runs go side by side, before the rest."""
    groups = _part_groups()
    limits = {name: limit for group in groups for name, limit in group.items()}
    assert {"run_ppo", "moe_ep1", "multi_turn", "te", "replan", "throughput", "stage_memory",
            "rollouts", "gpu_tests", "nccl_flattening", "nccl_interleaving",
            "nccl_interleaving2", "nccl_separation", "nccl_async_separation"} <= set(limits)
    assert set(groups[0]) == {"run_ppo", "moe_ep1", "multi_turn", "te"}, groups
    assert all(len(group) == 1 for group in groups[1:]), groups
    seconds = [max(group.values()) for group in groups]
    assert sum(seconds) <= 540, groups
    assert sum(max(group.values()) for group in groups
               if not any(name.startswith("nccl_") for name in group)) <= ONE_GPU_S, groups
    grace = re.search(r"timeout --kill-after=(\d+)", SCRIPT.read_text())
    assert grace and sum(seconds) + len(groups) * int(grace[1]) <= DEVICE_COMMAND_S - 20


def test_gpu_check_keeps_run_directories_out_of_what_comes_back() -> None:
    """At most 8 files come back from $OUT: run directories go elsewhere, and $LOG_DIR gets only
    the summary, the parts' table and the one concatenated log."""
    text = SCRIPT.read_text()
    run_dir = re.search(r"^RUN_DIR=(.*)$", text, flags=re.MULTILINE)
    assert run_dir and "LOG_DIR" not in run_dir[1] and "OUT" not in run_dir[1], run_dir
    run_dirs = re.findall(r"--run-dir\s+(\S+)", text)
    assert len(run_dirs) >= 2 and all(d.startswith('"$RUN_DIR/') for d in run_dirs), run_dirs
    written = set(re.findall(r'"\$LOG_DIR/([^"]+)"', text))
    assert written <= {"parts.txt", "summary.json", "gpu_check.log"}, written


def test_gpu_test_shards_split_the_tests_between_them() -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from gpu_check_shard import shard_of
    finally:
        sys.path.pop(0)
    items = list(range(8))
    shards = [shard_of(items, f"{i}/3") for i in range(3)]
    assert [kept for kept, _ in shards] == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert all(sorted(kept + dropped) == items for kept, dropped in shards)
    with pytest.raises(pytest.UsageError):
        shard_of(items, "3/3")


def test_the_summary_reads_cut_off_shards_and_still_prints_on_bad_logs(tmp_path: Path) -> None:
    """Test counts come from the per-test lines of ``pytest -v`` (a shard killed by its time
    limit still counts what it finished); limits and time-outs come from parts.txt; a log that
    cannot be read is named, the rest summarised."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from gpu_check_summary import summarize
    finally:
        sys.path.pop(0)
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "gpu_tests.0.log").write_text(
        "tests/gpu/test_gpu.py::test_a PASSED [ 33%]\n"
        "tests/gpu/test_gpu.py::test_b[ac-share] FAILED [ 66%]\n"
        "tests/gpu/test_gpu.py::test_c SKIPPED (needs TE) [100%]\n"
        "FAILED tests/gpu/test_gpu.py::test_b[ac-share] - AssertionError\n"
        "=== 1 failed, 1 passed, 1 skipped in 9.0s ===\n")
    (logs / "gpu_tests.1.log").write_text("tests/gpu/test_gpu.py::test_d PASSED [ 50%]\n"
                                          "tests/gpu/test_gpu.py::test_e ")  # cut off here
    (logs / "rollouts.log").write_text('{"benchmark": "rollouts_gpu_check", "errors": ["7b"]}\n'
                                       "{not json\n")
    (tmp_path / "parts.txt").write_text("rollouts 124 85 80\ngpu_tests 1 40 85\n")
    summary, passed = summarize(tmp_path, tmp_path / "run")
    assert summary["gpu_tests"] == {"passed": 2, "failed": 1, "skipped": 1}
    assert summary["parts"]["rollouts"] == {"exit": 124, "seconds": 85, "limit_s": 80,
                                            "timed_out": True}
    assert summary["limits_s_total"] == 165
    assert summary["rollouts"]["errors"] == ["7b"] and passed is False
    json.dumps(summary)


def test_throughput_benchmark_figures_are_consistent(tmp_path: Path) -> None:
    result = _run([sys.executable, "benchmarks/gpu_throughput.py", *TINY], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(figures["attention"]) == ["megatron", "packed", "sdpa"]
    train, decode = figures["attention"]["sdpa"]["train"], figures["attention"]["sdpa"]["decode"]
    assert figures["attention"]["packed"]["train"]["tokens_per_step"] == 2 * 2 * 32
    assert train["tokens_per_step"] == 2 * 2 * 32
    assert train["tokens_per_s"] * train["step_s"] == pytest.approx(train["tokens_per_step"])
    # 2 layers x (attention 64x16x(4+2*2) + 4x16x64 + MLP 3x64x128) + LM head 256x64
    assert figures["matmul_params"] == 2 * (64 * 16 * 8 + 4 * 16 * 64 + 3 * 64 * 128) + 256 * 64
    flop = 3 * 128 * (2 * figures["matmul_params"] + 4 * 2 * 32 * 64)
    assert train["tflops"] == pytest.approx(flop / train["step_s"] / 1e12)
    assert decode["tokens_per_s"] == pytest.approx(4 * 8 / decode["seconds"])


def _script_module(name: str):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        return __import__(name)
    finally:
        sys.path.pop(0)


def _write_metrics(run_dir: Path, records: list[dict]) -> None:
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_run_part_fails_when_a_step_lacks_its_throughput(tmp_path: Path) -> None:
    """A run that crashed at the end of step 1, or whose step dropped the throughput metric (the
    all-reduce on the world), fails its part; the last evaluation's record is not a step."""
    problems = _script_module("gpu_check_metrics").problems
    key = "throughput/tokens_per_s_per_device"
    assert problems(tmp_path / "none", 2) == [f"{tmp_path / 'none' / 'metrics.jsonl'}: missing "
                                              "(the run wrote no step)"]
    _write_metrics(tmp_path / "ok", [{"step": 0, key: 10.0}, {"step": 1, key: 12.5},
                                     {"step": 2, "eval/greedy/rule_score": 0.5}])
    assert problems(tmp_path / "ok", 2) == []
    assert problems(tmp_path / "ok", 3) == [f"step 2: {key}=None (a finite number expected)"]
    _write_metrics(tmp_path / "crashed", [{"step": 0, key: 10.0}])
    assert problems(tmp_path / "crashed", 2) == ["step 1: no record"]
    _write_metrics(tmp_path / "dropped", [{"step": 0, key: float("nan")}, {"step": 1}])
    assert problems(tmp_path / "dropped", 2, (key, "replan/predicted_gain")) == [
        f"step 0: {key}=nan (a finite number expected)",
        "step 0: replan/predicted_gain=None (a finite number expected)",
        f"step 1: {key}=None (a finite number expected)",
        "step 1: replan/predicted_gain=None (a finite number expected)"]


def test_the_move_part_parses_its_forced_moves() -> None:
    forced_moves = _script_module("gpu_check_move").forced_moves
    assert forced_moves(["0=separation", "1=flattening tp=1"]) == {0: "separation",
                                                                   1: "flattening tp=1"}
    for bad in ("separation", "-1=flattening", "0="):
        with pytest.raises(ValueError, match="STEP=PREFIX"):
            forced_moves([bad])


def test_the_summary_reports_the_new_parts(tmp_path: Path) -> None:
    """Each world-size-1 run's last step with its throughput, MoE's line about CUDA graphs,
    the multi-turn counts, the re-planning's moves, and TE skipped without it."""
    summarize = _script_module("gpu_check_summary").summarize
    run, key = tmp_path / "run", "throughput/tokens_per_s_per_device"
    logs = run / "logs"
    for name in ("ppo_float32", "ppo_bfloat16", "moe_ep1", "multi_turn", "replan"):
        _write_metrics(run / name, [{"step": 0, key: 5.0, "throughput/train_mfu": 0.1,
                                     "reward_mean": 0.5, "rollout/turns": 2.0}])
    logs.mkdir()
    (logs / "moe_ep1.log").write_text(
        "[22:07:42 rank0 WARNING megatron_rlhf.generation.decode_step] generation.cuda_graphs="
        "auto: decoding without CUDA graphs: megatron's MoE token dispatch\nppo: step 1/1\n")
    (logs / "te.log").write_text("skipped: transformer_engine not installed\n")
    (run / "replan" / "plan_history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in (
        {"step": 0, "current": "flattening tp=1 pp=1", "best": "interleaving2 tp=1 pp=1",
         "predicted_gain": 0.3, "would_move": True, "ranking": []},
        {"step": 0, "moved": {"from": "flattening tp=1 pp=1", "to": "separation(1/2 train)",
                              "forced": True, "state": "memory", "move_seconds": 4.5}})))
    names = ("run_ppo", "moe_ep1", "multi_turn", "te", "replan")
    (tmp_path / "parts.txt").write_text("".join(f"{name} 0 20 {50 + i} side_by_side:1\n"
                                                for i, name in enumerate(names[:4]))
                                        + "replan 0 20 45\n")
    summary, passed = summarize(tmp_path, run)
    assert list(summary["parts"]) == list(names) and passed
    assert summary["parts"]["te"] == {"exit": 0, "seconds": 20, "limit_s": 53, "side_by_side": 1}
    assert summary["limits_s_total"] == 53 + 45  # the group takes its largest limit
    assert summary["run_ppo_bfloat16"][key] == 5.0
    assert summary["run_ppo_float32"]["throughput/train_mfu"] == 0.1
    assert summary["moe_ep1"]["cuda_graphs"] == [
        "generation.cuda_graphs=auto: decoding without CUDA graphs: megatron's MoE token dispatch"]
    assert summary["multi_turn"]["rollout/turns"] == 2.0
    assert summary["te"] == {"skipped": "transformer_engine not installed"}
    assert summary["replan"]["moves"] == [{"after_step": 0, "from": "flattening tp=1 pp=1",
                                           "to": "separation(1/2 train)", "forced": True,
                                           "state": "memory", "move_seconds": 4.5}]
    assert summary["replan"]["replans"] == 1 and summary["replan"]["last_ranking"]["would_move"]
    assert "summary_errors" not in summary
    json.dumps(summary)
    (logs / "te.log").write_text("[0 rank0 INFO megatron_rlhf.engine.run.build] layers: actor "
                                 "local, critic transformer_engine, ref transformer_engine\n")
    _write_metrics(run / "te", [{"step": 0, key: 4.0}])
    te = summarize(tmp_path, run)[0]["te"]
    assert te["layers"] == "actor local, critic transformer_engine, ref transformer_engine"
    assert te[key] == 4.0


def test_the_summary_compares_the_nccl_placements_step_by_step(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from gpu_check_summary import _placement_agreement
    finally:
        sys.path.pop(0)
    assert _placement_agreement(tmp_path) == {}
    shifts = (("flattening", 0.0), ("interleaving", 0.001), ("separation", 0.004),
              ("async_separation", 0.5))
    for placement, shift in shifts:
        (tmp_path / f"nccl_{placement}").mkdir()
        records = [{"step": step, "reward_mean": 0.1 * step, "kl": 0.01 + shift * step,
                    "policy_loss": -0.2, "step_seconds": 1.0} for step in range(3)]
        records.append({"step": 3, "eval/greedy/rule_score": 0.5})
        (tmp_path / f"nccl_{placement}" / "metrics.jsonl").write_text(
            "".join(json.dumps(record) + "\n" for record in records))
    result = _placement_agreement(tmp_path)
    # asynchronous separation trains on older rollouts: reported, not compared
    assert result["max_abs_diff_from_flattening"] == {"interleaving": pytest.approx(0.002),
                                                      "separation": pytest.approx(0.008)}
    assert result["max_abs_diff"] == pytest.approx(0.008)
    assert result["separation"] == {"step": 2, "reward_mean": 0.2, "kl": pytest.approx(0.018),
                                    "policy_loss": -0.2, "step_seconds": 1.0,
                                    "rollout/logprob_diff_max": None}
    assert result["async_separation"]["kl"] == pytest.approx(1.01)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU dry run")
@pytest.mark.timeout(330)
def test_rollouts_gpu_check_runs_at_tiny_shapes_on_cpu_and_says_what_it_skipped(
        tmp_path: Path) -> None:
    result = _run([sys.executable, "benchmarks/rollouts.py", "--gpu-check"], tmp_path,
                  timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["device"] == "cpu" and any("cuda graphs" in s for s in figures["skipped"])
    assert "errors" not in figures and figures["copy_GBps"] > 0
    assert sorted(figures["1.1b"]) == ["batch2_graphs_off", "batch2_graphs_on",
                                       "batch4_graphs_off", "batch4_graphs_on"]
    for name, case in figures["1.1b"].items():
        batch = int(name[5])
        assert case["batch"] == batch and case["timed_steps"] == case["new_tokens"] - 1 == 7
        # the decode steps themselves are timed: a step takes real time (it was ~0 when T(1)
        # ran as many steps as T(128))
        assert case["step_ms"] > 0.05
        assert case["tokens_per_s"] == pytest.approx(batch / case["step_ms"] * 1e3, rel=1e-2)
    uneven = figures["1.1b_uneven"]
    assert uneven["slot_counts"][0] == 4 and uneven["speedup"] == pytest.approx(
        uneven["continuous"]["tokens_per_s"] / uneven["static"]["tokens_per_s"], abs=0.01)
    assert uneven["match"]["token_match_fraction"] == 1.0  # fp32 on CPU: the same tokens
    loops = figures["loops_fp32"]
    assert loops["tokens"]["static"] == loops["tokens"]["continuous"] > 0
    assert loops["token_match_fraction"] == loops["rows_equal_fraction"] == 1.0
    assert loops["max_logprob_diff"] < 1e-4
    for mode in ("graphs_on", "graphs_off"):
        profile = figures["profile"][mode]
        assert profile["kernels_per_step"] == 0 and profile["host_ms_per_step"] > 0
    assert (figures["7b"]["batch"], figures["7b"]["new_tokens"]) == (2, 8)


def test_rollouts_match_figures_compare_the_common_prefix() -> None:
    """``token_match_fraction``: per row the responses' common prefix over the longer one;
    ``max_logprob_diff`` only where both drew the same tokens so far."""
    import torch

    from benchmarks.rollouts import _match
    from megatron_rlhf.generation.output import GenerationOutput

    def output(responses: list[list[int]], logprobs: list[list[float]]) -> GenerationOutput:
        width = max(len(r) for r in responses)
        ids = torch.tensor([[5, 6] + r + [0] * (width - len(r)) for r in responses])
        lps = torch.tensor([lp + [0.0] * (width - len(lp)) for lp in logprobs])
        mask = (torch.arange(width)[None] < torch.tensor([len(r) for r in responses])[:, None])
        return GenerationOutput(
            input_ids=ids, attention_mask=torch.ones_like(ids), prompt_mask=torch.ones(2, 2),
            response_mask=mask.long(), response_logprobs=lps, response_policy_logprobs=lps,
            prompt_lengths=torch.tensor([2, 2]), response_lengths=mask.sum(1))

    a = output([[1, 2, 3], [7, 8]], [[-1.0, -2.0, -3.0], [-0.5, -0.25]])
    b = output([[1, 2, 4, 9], [7, 8]], [[-1.0, -2.5, -9.0, -1.0], [-0.5, -0.25]])
    assert _match(a, b) == {"token_match_fraction": round(4 / 6, 4), "rows_equal_fraction": 0.5,
                            "max_logprob_diff": 0.5}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU dry run")
def test_stage_memory_benchmark_meets_the_prediction_on_cpu(tmp_path: Path) -> None:
    """On the CPU the meter counts what the prediction counts (state and KV cache): the GPU
    check's comparison at 1B must then differ only by what the GPU allocator adds."""
    result = _run([sys.executable, "benchmarks/stage_memory.py", "--layers", "2", "--hidden",
                   "64", "--heads", "4", "--groups", "2", "--ffn", "128", "--vocab", "256",
                   "--prompts", "4", "--prompt-length", "8", "--new-tokens", "4",
                   "--micro-batch", "2"], tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["device"] == "cpu"
    assert {"generate", "experience", "train"} <= set(figures["stages"])
    for stage, entry in figures["stages"].items():
        assert entry["recorded_over_predicted"] == pytest.approx(1.0, abs=0.05), stage
