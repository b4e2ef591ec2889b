"""The GPU check and its benchmark run on CPU too, so a slip in them cannot waste GPU time."""

from __future__ import annotations

import json
import os
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
    result = _run(["bash", "scripts/gpu_check.sh"], tmp_path, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["cuda"] is False and summary["passed"] is True
    assert "no CUDA device" in summary["skipped"]
    assert summary["gpu_tests"]["skipped"] >= 5 and "passed" not in summary["gpu_tests"]
    assert list(summary["parts"]) == ["gpu_tests"]


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


def test_the_summary_compares_the_nccl_placements_step_by_step(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from gpu_check_summary import _placement_agreement
    finally:
        sys.path.pop(0)
    assert _placement_agreement(tmp_path) == {}
    for placement, shift in (("flattening", 0.0), ("separation", 0.004)):
        (tmp_path / f"nccl_{placement}").mkdir()
        records = [{"step": step, "reward_mean": 0.1 * step, "kl": 0.01 + shift * step,
                    "policy_loss": -0.2, "step_seconds": 1.0} for step in range(3)]
        records.append({"step": 3, "eval/greedy/rule_score": 0.5})
        (tmp_path / f"nccl_{placement}" / "metrics.jsonl").write_text(
            "".join(json.dumps(record) + "\n" for record in records))
    result = _placement_agreement(tmp_path)
    assert result["max_abs_diff"] == pytest.approx(0.008)
    assert result["separation"] == {"step": 2, "reward_mean": 0.2, "kl": pytest.approx(0.018),
                                    "policy_loss": -0.2, "step_seconds": 1.0}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU dry run")
@pytest.mark.timeout(330)
def test_rollouts_gpu_check_runs_at_tiny_shapes_on_cpu_and_says_what_it_skipped(
        tmp_path: Path) -> None:
    result = _run([sys.executable, "benchmarks/rollouts.py", "--gpu-check"], tmp_path,
                  timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    assert figures["device"] == "cpu" and any("cuda graphs" in s for s in figures["skipped"])
    assert sorted(figures["1.1b"]) == ["batch2_graphs_off", "batch2_graphs_on",
                                       "batch4_graphs_off", "batch4_graphs_on"]
    for name, case in figures["1.1b"].items():
        batch = int(name[5])
        assert case["tokens_per_s"] == pytest.approx(batch / case["step_ms"] * 1e3, rel=1e-2)
    uneven = figures["1.1b_uneven"]  # the benchmark itself raises if the loops' tokens differ
    assert uneven["static"]["tokens"] == uneven["continuous"]["tokens"] > 0
    assert uneven["slot_counts"][0] == 4 and uneven["speedup"] == pytest.approx(
        uneven["continuous"]["tokens_per_s"] / uneven["static"]["tokens_per_s"], abs=0.01)
    assert figures["profile"]["kernels_per_step"] == 0 and figures["profile"]["host_ms_per_step"] > 0
    assert (figures["7b"]["batch"], figures["7b"]["new_tokens"]) == (2, 8)


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
