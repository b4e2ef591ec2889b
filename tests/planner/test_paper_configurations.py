"""Every configuration of the placement paper that the engine's memory options can hold fits:
LLaMA 7B-65B on 1x8, 2x8, 4x8 and 16x8 A100-80GB under flattening, interleaving, interleaving2
and separation (the table of docs/results/planner-accuracy.md,
``benchmarks/planner_at_scale.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from megatron_rlhf.planner import (
    SearchSpace,
    StepPrediction,
    candidate_configs,
    homogeneous_cluster,
    predict_step,
)
from megatron_rlhf.planner.paper import (
    PAPER_MODELS,
    PAPER_NODES,
    PAPER_ROLLOUT,
    PAPER_STRATEGIES,
)
from megatron_rlhf.topology import arch_preset, plan_placement

GIB = 1024**3

# The cells no candidate fits. Every trainable model's optimizer may go to the host (6 bytes per
# parameter stay on the device: bf16 weights, fp32 gradients), but on one node llama-65b's two
# trainers cannot both keep those between stages (2 x 6 N / 8 devices = 91 GiB > 72 usable), so
# the host holds both trainers' 6 N and their host optimizers' 16 N (fp32 master weights,
# moments and pinned gradients): 22 (N_actor + N_critic) = 2670 GiB, more than a DGX A100
# node's 2 TiB x 0.9. interleaving2 gives the actor half the devices (6 N / 4 = 91 GiB), and
# separation's trainers have 4 or 6 devices, where no TP x PP of the model fits; on 2 nodes
# separation's trainers share node 0 and meet the same host bound.
REFUSED = {("llama-65b", 1): PAPER_STRATEGIES, ("llama-65b", 2): ("separation",)}


def _cells(fitting: bool) -> list[tuple[str, int, str]]:
    return [(model, nodes, strategy) for model in PAPER_MODELS for nodes in PAPER_NODES
            for strategy in PAPER_STRATEGIES
            if (strategy in REFUSED.get((model, nodes), ())) != fitting]


def _predictions(model: str, nodes: int, strategy: str) -> Iterator[StepPrediction | str]:
    """Each candidate of ``strategy``, largest TP x PP first: its prediction, or why the
    placement refuses it."""
    cluster = homogeneous_cluster("A100-80GB", nodes, 8)
    configs = candidate_configs(cluster, arch_preset(model),
                                SearchSpace(strategies=(strategy,)))
    for config in sorted(configs, key=lambda c: -c.tp * c.pp):
        try:
            plan = plan_placement(cluster, config, model)
        except ValueError as error:
            yield str(error)
            continue
        yield predict_step(plan, PAPER_ROLLOUT)


@pytest.mark.parametrize(("model", "nodes", "strategy"), _cells(fitting=True))
def test_the_planner_fits_every_configuration_the_paper_ran(model: str, nodes: int,
                                                            strategy: str) -> None:
    prediction = next(p for p in _predictions(model, nodes, strategy)
                      if not isinstance(p, str) and p.feasible)
    memory = prediction.memory
    assert 0 < memory.peak_gib <= memory.usable_gib
    assert memory.host_gib <= 2048 * 0.9
    assert set(memory.options) == set(memory.roles)


@pytest.mark.parametrize(("model", "nodes", "strategy"), _cells(fitting=False))
def test_only_the_devices_or_the_host_memory_leave_a_cell_empty(
        model: str, nodes: int, strategy: str) -> None:
    spec = {role: arch_preset(model).num_params(8, role == "critic")
            for role in ("actor", "critic")}
    assert 2 * 6 * spec["actor"] / 8 / GIB > 72
    assert 22 * (spec["actor"] + spec["critic"]) / GIB == pytest.approx(2670.5, abs=0.1)
    for result in _predictions(model, nodes, strategy):
        if isinstance(result, str):
            continue  # the placement's reasons: device memory, or TP x PP on its devices
        assert not result.feasible
        assert any("more than the 1843 GiB usable of its host memory" in problem
                   for problem in result.problems)
