"""Throughput in the metrics: the model FLOPs a worker records are ``topology.flops``'s, the
planner's count (routed experts included; 2 forward equivalents, not 3, to train adapters on a
frozen base), and a run's records carry tokens per second per device and the MFU of its
training and generation stages (2 gloo ranks, token-budget micro-batches, so that path runs end
to end too)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.engine.execution.throughput import (
    WorkMeter,
    device_peak_flops,
    utilisation,
    work_flops,
)
from megatron_rlhf.engine.execution.workers import ModelWorker
from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.topology.flops import TRAINING_PASSES, sequence_flops, training_passes
from megatron_rlhf.topology.models import ArchSpec, ExpertSpec
from tests.multirank import run_on_ranks
from tests.planner.helpers import ROUND

MOE = ArchSpec("model", num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256,
               seq_length=64, ffn_hidden_size=32, gated_mlp=True, num_query_groups=2,
               head_dim=16, experts=ExpertSpec(num_experts=8, topk=2, ffn_hidden_size=32))
"""hidden 64, 2 layers, 4 heads of 16 channels over 2 KV groups, 8 SwiGLU experts of width 32
(the dense twin's MLP width), top-2, no shared expert."""
DENSE = dataclasses.replace(MOE, experts=None)


def _groups(tp: int = 1) -> SimpleNamespace:
    """The sizes a model's ``ProcessGroupCollection`` gives the builder and the worker."""
    sizes = {"tp": tp, "pp": 1, "ep": 1}
    return SimpleNamespace(**{axis: SimpleNamespace(size=lambda n=n: n)
                              for axis, n in sizes.items()})


def _model(arch: ArchSpec, head: str = "lm") -> SimpleNamespace:
    """What the FLOP count reads of a model ``build_gpt_model`` built from ``arch``: the
    architecture it keeps and its head."""
    return SimpleNamespace(arch=arch, head_kind=head)


def _mask(lengths: list[int]) -> torch.Tensor:
    """An attention mask of one row per length, padded on the right."""
    return (torch.arange(max(lengths)) < torch.tensor(lengths)[:, None]).long()


def test_the_worker_records_an_moe_models_routed_experts() -> None:
    """A worker's training work is the FLOP model's, over its TP ranks: for the MoE model, the
    dense twin's count plus, per token and layer, the router and the second expert."""
    recorded = {}
    for arch in (MOE, DENSE):
        worker = SimpleNamespace(model=_model(arch), work=WorkMeter(peak_flops=1.0),
                                 device=torch.device("cpu"), pg_collection=_groups(tp=2))
        with ModelWorker._measured(worker, "train") as rows:
            rows.append((_mask([4, 6]), TRAINING_PASSES))
        recorded[arch.experts] = worker.work.take()["throughput/train_flop"]
    # 10 tokens, 3 passes, 2 layers, over 2 TP ranks; 2 FLOPs per weight: the 64 x 8 router and
    # one more 32-wide SwiGLU MLP (3 x 64 x 32)
    expert_term = 10 * 3 * 2 * 2 * (64 * 8 + 3 * 64 * 32) / 2
    assert recorded[MOE.experts] - recorded[None] == expert_term == 399_360
    assert recorded[MOE.experts] == 3 * sequence_flops(MOE, [4, 6]) / 2


def test_training_adapters_on_a_frozen_base_counts_two_forwards() -> None:
    """With LoRA a training pass computes no weight gradient: the worker records 2 forwards'
    FLOPs (a hand count), and the planner prices the same pass with the same number."""
    frozen = training_passes(frozen_base=True)
    worker = SimpleNamespace(model=_model(DENSE), work=WorkMeter(peak_flops=1.0),
                             device=torch.device("cpu"), pg_collection=_groups(tp=2))
    with ModelWorker._measured(worker, "train") as rows:
        rows.append((_mask([4, 6]), frozen))
    # weights a token passes through: per layer attention 64 x (64 + 2 x 32) + 64 x 64 and a
    # SwiGLU MLP 3 x 64 x 32, 2 layers, the 64 x 256 vocabulary projection
    weights = 2 * (64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 32) + 64 * 256
    assert weights == 53_248
    # 10 tokens, 2 FLOPs per weight; attention 4 x 2 layers x 64 channels x (4^2 + 6^2) / 2
    forward = 10 * 2 * weights + 4 * 2 * 64 * (16 + 36) / 2
    assert worker.work.take()["throughput/train_flop"] == 2 * forward / 2 == 1_078_272
    assert (frozen, training_passes()) == (2, TRAINING_PASSES)
    assert training_passes(frozen_base=True, recomputed=True) == 3

    rows_, seq = 4, 32
    metric = work_flops(_model(DENSE), [(_mask([seq] * rows_), frozen)])
    env = cm.ModelEnv(DENSE, 1, 1, 1, False, ROUND, *[cm.Link(100e9, 0.0)] * 3,
                      adapters=1000.0)
    priced = cm.training_cost(env, rows_, seq, rows_, minibatches=1, checkpointing=False)
    assert metric == pytest.approx(priced.compute * ROUND.flops_per_s, rel=1e-12)


@pytest.mark.parametrize("arch", [MOE, DENSE], ids=["moe", "dense"])
@pytest.mark.parametrize("value_head", [False, True], ids=["lm", "value"])
def test_the_planner_and_the_metric_count_the_same_flops(arch: ArchSpec,
                                                         value_head: bool) -> None:
    rows, seq = 4, 32
    model = _model(arch, "scalar" if value_head else "lm")
    metric = work_flops(model, [(_mask([seq] * rows), TRAINING_PASSES)])
    env = cm.ModelEnv(arch, 1, 1, 1, value_head, ROUND, *[cm.Link(100e9, 0.0)] * 3)
    slot = env.slot_cost(rows * seq, seq / 2, TRAINING_PASSES, tp_collectives=4)
    assert metric == pytest.approx(slot.compute * ROUND.flops_per_s, rel=1e-12)


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
