"""benchmarks/ppo_step.py: its FLOP count against a count written out by hand, its timeline
reading, and one real run through tools/run_ppo.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ppo_step  # noqa: E402


def test_step_flops_match_a_count_by_hand() -> None:
    from megatron_rlhf.topology.models import ArchSpec

    arch = ArchSpec("b", **ppo_step.SHAPES["default"])
    h, ffn, layers, vocab = 256, 688, 4, 512
    per_layer = h * 3 * h + h * h + 3 * h * ffn  # q, k, v (4 heads, no GQA); out; SwiGLU
    lm, value = layers * per_layer + h * vocab, layers * per_layer + h

    def forward(tokens: int, context: int, weights: int) -> int:
        return tokens * (2 * weights + 4 * layers * h * context)

    flops = ppo_step.step_flops(arch, batch=3, prompt=5, response=2)
    assert flops["generate"] == forward(15, 5, lm) + forward(3, 5, lm) + forward(3, 6, lm)
    assert flops["experience/ref"] == forward(21, 7, lm)
    assert flops["experience/reward"] == forward(21, 7, value)
    assert flops["train/critic"] == 3 * forward(21, 7, value)
    assert set(flops) == {"generate", "experience/actor", "experience/critic", "experience/ref",
                          "experience/reward", "train/actor", "train/critic"}


def test_stage_seconds_average_the_ranks_that_ran_a_stage() -> None:
    def span(pid: int, cat: str, model: str, ts: float, seconds: float) -> dict:
        return {"ph": "X", "pid": pid, "cat": cat, "ts": ts, "dur": seconds * 1e6,
                "args": {"model": model}}

    timeline = {"traceEvents": [
        span(0, "generate", "actor", 0, 9.0),  # warm-up, before the cut
        span(0, "generate", "actor", 10, 2.0), span(1, "generate", "shadow_actor", 10, 4.0),
        span(0, "experience", "shadow_critic", 20, 1.0), span(0, "train", "actor", 30, 0.5),
        span(0, "train", "actor", 40, 0.5), {"ph": "M", "pid": 0, "name": "process_name"}]}
    assert ppo_step.stage_seconds(timeline, first_step_end=5) == {
        "generate": 3.0, "experience/critic": 1.0, "train/actor": 1.0}


@pytest.mark.multirank
def test_the_benchmark_runs_run_ppo_and_prints_one_line_per_configuration() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/ppo_step.py", "--world-sizes", "1", "--steps", "2",
         "--batch", "4", "--prompt-length", "16", "--response-length", "3", "--square", "128"],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    (line,) = done.stdout.strip().splitlines()
    result = json.loads(line)
    assert result["world_size"] == 1 and result["placement"] == "flattening"
    assert result["samples_per_s"] == pytest.approx(4 / result["step_seconds"], rel=1e-2)
    stages = result["stages"]
    assert {"generate", "experience/ref", "train/actor", "train/critic"} <= set(stages)
    assert all(stages[k]["seconds"] > 0 and stages[k]["flop"] > 0 for k in ("generate",
                                                                          "train/actor"))
