"""Every configuration of the placement paper that the engine's memory options can hold fits:
LLaMA 7B-65B on 1x8, 2x8, 4x8 and 16x8 A100-80GB under flattening, interleaving, interleaving2
and separation (the table of docs/planner.md, ``benchmarks/planner_at_scale.py``)."""

from __future__ import annotations

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

# The trainers' states alone, fully sharded (18 bytes per parameter over the devices that hold a
# trainable model), exceed a device: interleaving2 gives the actor half the devices, separation
# gives actor and critic at most 3/4 of them (the largest train_fraction searched).
TOO_FEW_DEVICES = {
    ("llama-65b", 1): PAPER_STRATEGIES,
    ("llama-65b", 2): ("interleaving2", "separation"),
    ("llama-33b", 1): ("interleaving2", "separation"),
}
TRAINER_DEVICES = {"flattening": 1.0, "interleaving": 1.0, "interleaving2": 0.5,
                   "separation": 0.75}


def _cells(fitting: bool) -> list[tuple[str, int, str]]:
    return [(model, nodes, strategy) for model in PAPER_MODELS for nodes in PAPER_NODES
            for strategy in PAPER_STRATEGIES
            if (strategy in TOO_FEW_DEVICES.get((model, nodes), ())) != fitting]


def _first_feasible(model: str, nodes: int, strategy: str) -> StepPrediction | None:
    """The first candidate of ``strategy`` that fits, trying the largest TP x PP first."""
    cluster = homogeneous_cluster("A100-80GB", nodes, 8)
    configs = candidate_configs(cluster, arch_preset(model),
                                SearchSpace(strategies=(strategy,)))
    for config in sorted(configs, key=lambda c: -c.tp * c.pp):
        try:
            plan = plan_placement(cluster, config, model)
        except ValueError:
            continue
        prediction = predict_step(plan, PAPER_ROLLOUT)
        if prediction.feasible:
            return prediction
    return None


@pytest.mark.parametrize(("model", "nodes", "strategy"), _cells(fitting=True))
def test_the_planner_fits_every_configuration_the_paper_ran(model: str, nodes: int,
                                                            strategy: str) -> None:
    prediction = _first_feasible(model, nodes, strategy)
    assert prediction is not None
    memory = prediction.memory
    assert 0 < memory.peak_gib <= memory.usable_gib
    assert set(memory.options) == set(memory.roles)


@pytest.mark.parametrize(("model", "nodes", "strategy"), _cells(fitting=False))
def test_only_too_few_devices_for_the_trainers_states_leave_a_cell_empty(
        model: str, nodes: int, strategy: str) -> None:
    trainer_devices = TRAINER_DEVICES[strategy] * nodes * 8
    fully_sharded = 18 * arch_preset(model).num_params() / trainer_devices / GIB
    assert fully_sharded > 80
    assert _first_feasible(model, nodes, strategy) is None
