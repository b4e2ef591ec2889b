"""``run_ppo.py --plan-only`` prices ``rollout.max_tokens_per_micro_batch: auto`` as the budget
the run chooses (``micro_batching.resolve_token_budget``), not as ``micro_batch_size`` rows."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.micro_batching import device_memory_bytes, resolve_token_budget
from megatron_rlhf.engine.run.plan_only import plan_run
from megatron_rlhf.topology.cluster import ClusterSpec, DevicePool
from tests.scripts import REPO

TINY = REPO / "examples" / "ppo_tiny.yaml"
ROW = 16 + 12
"""ppo_tiny's row: max_prompt_length + max_new_tokens."""


def _host_cluster(ranks: int) -> ClusterSpec:
    """One node of ``ranks`` devices, each with the memory a CPU rank of this host counts on."""
    memory = device_memory_bytes(torch.device("cpu")) / 2**30
    return ClusterSpec((DevicePool("H100-80GB", nodes=1, devices_per_node=ranks,
                                   memory_gib=memory),))


@pytest.mark.parametrize("ranks, budget", [(4, 64), (1, 448)])
def test_auto_is_priced_as_the_runs_budget(monkeypatch: pytest.MonkeyPatch, ranks: int,
                                           budget: int) -> None:
    """The tiny run logged ``tokens per micro-batch: actor 64, critic 64, ref 64`` on 4 CPU
    ranks; at one rank one micro-batch holds the whole step: 16 rows of 28 tokens, 448."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    config = load_config(RunConfig, TINY)
    run_plan = plan_run(config, _host_cluster(ranks))
    cpu = torch.device("cpu")
    for role in run_plan.plan.roles:
        logged = {resolve_token_budget(config, run_plan.plan, role, rank, cpu)
                  for rank in run_plan.plan[role].ranks}
        assert logged == {run_plan.budgets[role]} == {budget}, role
    assert run_plan.rollout.micro_batch_size == budget // ROW
    text = run_plan.format()
    assert f"tokens per micro-batch: actor {budget}, critic {budget}, ref {budget}" in text
    assert run_plan.to_dict()["tokens_per_micro_batch"]["actor"] == budget


def test_numbers_and_padded_rows_keep_their_pricing() -> None:
    cluster = _host_cluster(1)
    given = plan_run(load_config(RunConfig, TINY, ["rollout.max_tokens_per_micro_batch=112"]),
                     cluster)
    assert set(given.budgets.values()) == {112} and given.rollout.micro_batch_size == 112 // ROW
    padded = plan_run(load_config(RunConfig, TINY, ["models.packed_sequences=false"]), cluster)
    assert set(padded.budgets.values()) == {0}
    assert padded.rollout.micro_batch_size == 2, "fixed rollout.micro_batch_size rows"
    assert "actor fixed rows" in padded.format()
