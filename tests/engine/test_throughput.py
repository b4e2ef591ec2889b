"""Throughput in the metrics: model FLOPs counted by hand, and a run's records carry tokens per
second per device and the MFU of its training and generation stages (2 gloo ranks, token-budget
micro-batches, so that path runs end to end too)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.engine.execution.throughput import (
    WorkMeter,
    device_peak_flops,
    forward_flops,
    matmul_weights,
    utilisation,
)
from tests.multirank import run_on_ranks


def test_forward_flops_count_matmuls_and_the_attention_square() -> None:
    config = SimpleNamespace(num_layers=2, hidden_size=64, num_attention_heads=4,
                             num_query_groups=2, kv_channels=16, ffn_hidden_size=128,
                             gated_linear_unit=True)
    # as benchmarks/gpu_throughput.py: attention 64x16x(4+2*2) + 4x16x64, MLP 3x64x128, head
    weights = 2 * (64 * 16 * 8 + 4 * 16 * 64 + 3 * 64 * 128) + 256 * 64
    assert matmul_weights(config, 256) == weights
    flops = forward_flops(config, 256, torch.tensor([3, 5]))
    assert flops == 2 * weights * 8 + 4 * 2 * 64 * (9 + 25)


def test_measuring_the_matmul_rate_leaves_the_default_generator_alone() -> None:
    """The first run of a process measures it: a draw from the default generator would shift
    that run's dropout masks and make it differ from a resumed or repeated run."""
    device_peak_flops.cache_clear()
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    assert device_peak_flops(torch.device("cpu"), torch.float32) > 0
    assert torch.equal(torch.rand(4), expected)


def test_utilisation_is_flops_over_capacity_summed_over_ranks() -> None:
    ranks = [WorkMeter(peak_flops=100.0), WorkMeter(peak_flops=50.0)]
    ranks[0].record("train", flops=300.0, seconds=6.0)
    ranks[1].record("train", flops=100.0, seconds=4.0)
    ranks[1].record("generate", flops=20.0, seconds=2.0)
    totals: dict[str, float] = {}
    for meter in ranks:
        for key, value in meter.take().items():
            totals[key] = totals.get(key, 0.0) + value
    assert utilisation(totals) == {"throughput/train_mfu": 400.0 / (600.0 + 200.0),
                                   "throughput/generate_mfu": 20.0 / 100.0}
    assert ranks[0].take() == {}, "take resets"


def _run(root: str) -> list[dict]:
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig
    from megatron_rlhf.engine.run.runner import run_ppo

    config = load_config(RunConfig, Path("examples/ppo_tiny.yaml"), [
        f"run_dir={root}/run", "steps=2", "rollout.prompts_per_step=8",
        "rollout.max_tokens_per_micro_batch=48"])
    run_dir = run_ppo(config)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_run_records_tokens_per_device_and_stage_mfu(tmp_path: Path) -> None:
    records = run_on_ranks(_run, world_size=2, args=(str(tmp_path),), timeout_s=240)[0]
    assert len(records) == 2
    for record in records:
        tokens = 8 * (record["prompt_length"] + record["response_length"])
        assert record["throughput/tokens_per_s_per_device"] == pytest.approx(
            tokens / record["step_seconds"] / 2)
        for stage in ("train", "generate"):
            assert 0.0 < record[f"throughput/{stage}_mfu"] < 1.0, record
