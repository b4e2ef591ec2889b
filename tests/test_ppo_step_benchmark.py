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


def _by_hand():
    """The default shape's forward FLOP written out: ``forward(tokens, context, weights)`` and
    the LM and value models' weights (trunk + head)."""
    h, ffn, layers, vocab = 256, 688, 4, 512
    per_layer = h * 3 * h + h * h + 3 * h * ffn  # q, k, v (4 heads, no GQA); out; SwiGLU
    trunk = layers * per_layer

    def forward(tokens: int, context: int, weights: int) -> int:
        return tokens * (2 * weights + 4 * layers * h * context)

    return forward, trunk + h * vocab, trunk + h, h * vocab


def test_step_flops_match_a_count_by_hand() -> None:
    from megatron_rlhf.topology.models import ArchSpec

    arch = ArchSpec("b", **ppo_step.SHAPES["default"])
    forward, lm, value, _ = _by_hand()
    flops = ppo_step.step_flops(arch, batch=3, prompt=5, response=2)
    assert flops["experience/ref"] == forward(21, 7, lm)
    assert flops["experience/reward"] == forward(21, 7, value)
    assert flops["train/critic"] == 3 * forward(21, 7, value)
    assert set(flops) == {"experience/actor", "experience/critic", "experience/ref",
                          "experience/reward", "train/actor", "train/critic"}


def test_generation_flops_count_the_micro_batches_as_they_ran() -> None:
    """Two cached micro-batches of one generate call, each at its own prompt width: a prefill
    whose LM head runs at the last position only, then one-token steps at contexts Pw + 1 ..;
    and one recomputed micro-batch (every call a full forward)."""
    from megatron_rlhf.topology.models import ArchSpec

    arch = ArchSpec("b", **ppo_step.SHAPES["default"])
    forward, lm, _, head = _by_hand()
    records = [{"rows": 2, "prompt_width": 5, "forwards": 3, "kv_cache": True},
               {"rows": 1, "prompt_width": 9, "forwards": 1, "kv_cache": True},
               {"rows": 3, "prompt_width": 4, "forwards": 0, "kv_cache": True}]
    first = forward(10, 5, lm) - (10 - 2) * 2 * head + forward(2, 6, lm) + forward(2, 7, lm)
    second = forward(9, 9, lm) - (9 - 1) * 2 * head
    assert ppo_step.generation_flops(arch, records) == first + second
    recomputed = [{"rows": 2, "prompt_width": 5, "forwards": 2, "kv_cache": False}]
    assert ppo_step.generation_flops(arch, recomputed) == forward(10, 5, lm) + forward(12, 6, lm)
    # continuous batching: a prefill record, then 7 decode steps of 4 slots over 32 positions
    continuous = [{"rows": 2, "prompt_width": 5, "forwards": 1, "kv_cache": True,
                   "decode_context": 0},
                  {"rows": 4, "prompt_width": 0, "forwards": 7, "kv_cache": True,
                   "decode_context": 32}]
    assert ppo_step.generation_flops(arch, continuous) == (
        forward(10, 5, lm) - (10 - 2) * 2 * head + 7 * forward(4, 32, lm))


def test_generation_work_reads_one_tp_rank_of_each_replica_after_the_warm_up() -> None:
    def span(pid: int, ts: float, tp_rank: int, widths: list[int]) -> dict:
        work = {"tp_rank": tp_rank, "micro_batches": [
            {"rows": 2, "prompt_width": w, "forwards": 3, "kv_cache": True} for w in widths]}
        return {"ph": "X", "pid": pid, "cat": "generate", "ts": ts, "dur": 1.0,
                "args": {"model": "actor", "work": work}}

    timeline = {"traceEvents": [
        span(0, 0, 0, [32]),  # warm-up
        span(0, 10, 0, [9, 11]), span(1, 10, 1, [9, 11]),  # one replica, TP=2
        span(2, 10, 0, [7]), {"ph": "M", "pid": 0, "name": "process_name"}]}
    widths = [w["prompt_width"] for w in ppo_step.generation_work(timeline, first_step_end=5)]
    assert widths == [9, 11, 7]
    del timeline["traceEvents"][1]["args"]["work"]
    with pytest.raises(ValueError, match="no work record"):
        ppo_step.generation_work(timeline, first_step_end=5)


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
@pytest.mark.timeout(360)
def test_the_benchmark_runs_run_ppo_and_prints_one_line_per_configuration() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/ppo_step.py", "--world-sizes", "1", "--steps", "2",
         "--batch", "4", "--prompt-length", "16", "--response-length", "3", "--square", "128",
         "--layouts", "padded", "packed"],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-2000:]
    padded, result = (json.loads(line) for line in done.stdout.strip().splitlines())
    assert (padded["layout"], result["layout"]) == ("padded", "packed")
    # the same prompts and responses: the shipped task's prompts are shorter than 16 tokens
    assert 0 < padded["padded_token_share"] == result["padded_token_share"] < 1
    assert result["world_size"] == 1 and result["placement"] == "flattening"
    assert result["samples_per_s"] == pytest.approx(4 / result["step_seconds"], rel=1e-2)
    stages = result["stages"]
    assert {"generate", "experience/ref", "train/actor", "train/critic"} <= set(stages)
    assert all(stages[k]["seconds"] > 0 and stages[k]["flop"] > 0 for k in ("generate",
                                                                          "train/actor"))
    # generation as it ran under continuous batching: one prefill of the step's 4 prompts, padded
    # to its own longest prompt (the task's are shorter than --prompt-length), then one
    # stop-check interval (8) of decode steps over 4 slots of a 32-position cache, step i
    # attending the low + 1 + i positions the slots can have written (their mean, rounded up)
    from megatron_rlhf.topology.models import ArchSpec

    low, high = result["generation_prompt_widths"]
    assert result["generation_micro_batches"] == 1 and 1 <= low == high <= 16
    assert result["generation_decode_steps"] == 8
    arch = ArchSpec("b", **ppo_step.SHAPES["default"])
    assert stages["generate"]["flop"] == ppo_step.generation_flops(
        arch, [{"rows": 4, "prompt_width": low, "forwards": 1, "kv_cache": True},
               {"rows": 4, "prompt_width": 0, "forwards": 8, "kv_cache": True,
                "decode_context": -(-sum(min(low + 1 + i, 32) for i in range(8)) // 8)}])
