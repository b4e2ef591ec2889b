"""What ``run_ppo.py --plan-only`` prints says what each figure is: the placement table's memory
is the models' states per device and the memory table's total adds activations and the KV cache;
the generation lines count sequences per replica and the KV cache's room, never a rollout batch
other than the configured one."""

from __future__ import annotations

import re

import pytest
import torch

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.plan_only import plan_cluster, plan_run
from tests.helpers.launch import run_tool
from tests.scripts import REPO

RECIPE = REPO / "examples" / "recipes" / "llama3.1-70b-ppo-offload-16x8.yaml"


def test_plan_only_labels_each_memory_figure_and_counts_generation_in_sequences() -> None:
    config = load_config(RunConfig, RECIPE)
    run_plan = plan_run(config, plan_cluster(config, 16, 8, "H100-80GB"))
    text = run_plan.format()
    memory, plan = run_plan.prediction.memory, run_plan.plan
    header = next(line for line in text.splitlines() if line.startswith("role "))
    assert header.split()[-3:] == ["states", "GiB", "pools"]
    actor = next(line for line in text.splitlines() if line.startswith("actor   "))
    states = memory.roles["actor"]
    assert f"{states.weights + states.grads + states.optimizer:.1f}" in actor.split()
    assert ("states GiB (placement table) = weights + grads + optim; total adds activ and kv"
            in text)
    rows = config.rollout.rows_per_step
    assert f"rollout: {rows} rows" in text
    (role,) = memory.sequences_per_round
    per_replica = rows // plan[role].dp
    assert f"generation micro-batch: {role} {per_replica} sequences per replica" in text
    room = memory.sequences_per_round[role]
    assert (f"KV cache room: {role} {room} sequences per replica, {room * plan[role].dp} over all "
            "generating replicas in one round") in text
    assert not re.search(r"rollout batch\D*\d", text)


def test_plan_only_names_the_rollout_mode_it_priced() -> None:
    """One line says which schedule the step is priced as (planner.asynchronous)."""
    config = load_config(RunConfig, RECIPE)
    assert config.rollout.async_rollout and not config.rollout.partial_rollouts
    run_plan = plan_run(config, plan_cluster(config, 16, 8, "H100-80GB"))
    (line,) = [line for line in run_plan.format().splitlines() if line.startswith("schedule: ")]
    assert run_plan.prediction.mode == "one step off"
    assert line.startswith("schedule: one step off: the shadows generate step k+1 while")


def test_plan_only_names_the_optimizer_on_the_host() -> None:
    # Priced on any machine: only a run needs CUDA and Transformer Engine to offload.
    config = load_config(RunConfig, RECIPE, ["actor_optimizer.cpu_offload_fraction=1.0"])
    run_plan = plan_run(config, plan_cluster(config, 16, 8, "H100-80GB"))
    memory = run_plan.prediction.memory
    assert memory.options["actor"].optimizer_offload
    assert not memory.options["critic"].optimizer_offload
    assert memory.roles["actor"].optimizer == 0.0 < memory.roles["critic"].optimizer
    lines = run_plan.format().splitlines()
    actor = next(line for line in lines if line.startswith("actor ") and "GiB" not in line
                 and line.split()[-1].startswith(memory.options["actor"].sharding))
    assert actor.split()[-1].endswith("+optimizer_offload")
    assert f"host per node: {memory.host_gib:.1f} GiB of offloaded states and host optimizers" in (
        lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_run_ppo_plans_an_offloaded_optimizer_here_and_refuses_to_run_it() -> None:
    offload = "actor_optimizer.cpu_offload_fraction=1.0"
    planned = run_tool("run_ppo.py", ["--config", str(RECIPE), "--plan-only", offload],
                       timeout=120)
    assert planned.returncode == 0, planned.stderr
    assert "+optimizer_offload" in planned.stdout
    tiny = str(REPO / "examples" / "ppo_tiny.yaml")
    refused = run_tool("run_ppo.py", ["--config", tiny, offload], timeout=120)
    assert refused.returncode == 2
    assert ("run_ppo: bad configuration: actor_optimizer.cpu_offload_fraction=1.0 moves "
            "optimizer state from a CUDA device to the host and needs CUDA") in refused.stderr
