"""Every shipped PPO configuration loads, and its placement plans on the cluster it is meant for."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.build import make_plan
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# (config, nodes, devices per node) each PPO example is written for.
PPO_EXAMPLES = [("ppo_tiny.yaml", 1, 4), ("ppo_pipeline.yaml", 1, 4),
                ("ppo_hf_tiny.yaml", 1, 2), ("ppo_grpo_tiny.yaml", 1, 4),
                ("ppo_gsm8k_tiny.yaml", 1, 4), ("ppo_moe_tiny.yaml", 1, 4)]
"""The GPU recipes under examples/recipes/ are tested by tests/test_recipes.py."""


def test_every_ppo_example_is_listed() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("ppo_*.yaml")) == sorted(
        name for name, _, _ in PPO_EXAMPLES)


@pytest.mark.parametrize("name, nodes, devices", PPO_EXAMPLES)
def test_ppo_example_loads_and_plans(name: str, nodes: int, devices: int) -> None:
    config = load_config(RunConfig, EXAMPLES / name)
    cluster = ClusterSpec((DevicePool("A100-80GB", nodes=nodes, devices_per_node=devices),))
    plan = make_plan(config, cluster)
    assert {r for role in plan.roles for r in plan[role].ranks} == set(range(nodes * devices)), \
        "every device holds a model"


DATA_KEYS = ("prompts.paths", "evaluation.paths", "ptx.paths", "data.paths", "data.eval_paths",
             "tokenizer.corpus_path", "tokenizer.model_path")
"""Inputs an example ships with (checkpoints and tokenizers a pipeline writes first are not)."""


MADE_ELSEWHERE = {"ppo_hf_tiny.yaml": "tools/make_tiny_hf.py writes its model and prompts"}
"""Examples whose inputs a tool or the user provides; every other example's must ship."""


@pytest.mark.parametrize("path", sorted(p for p in EXAMPLES.glob("*.yaml")
                                        if p.name not in MADE_ELSEWHERE), ids=lambda p: p.name)
def test_every_data_file_an_example_names_exists(path: Path) -> None:
    from megatron_rlhf.config.supervised_run import RMConfig, SFTConfig

    schema = {"sft": SFTConfig, "rm": RMConfig}.get(path.name.split("_")[0], RunConfig)
    config = load_config(schema, path)
    named = []
    for key in DATA_KEYS:
        section, _, name = key.partition(".")
        value = getattr(getattr(config, section, None), name, None)
        named += [value] if isinstance(value, str) else list(value or ())
    missing = [file for file in named if file and not Path(file).is_file()]
    assert not missing, f"{path.name} names files that do not exist: {missing}"
