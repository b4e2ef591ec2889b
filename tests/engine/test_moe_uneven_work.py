"""Model workers of a tiny mixture-of-experts model at expert parallelism 2 on 2 gloo ranks given
uneven work: 3 rows against 1, then 2 rows against none (a replica left without rows or prompts
by an uneven split). Every forward is a collective over the expert-parallel group, so the rank
with less work repeats a micro-batch (its results dropped) or runs idle forwards; each rank's
results are those of the same model at EP 1, where no rank waits for another."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.models.moe import MoEConfig
from tests.generation.helpers import MIN_MARGIN, decision_margin
from tests.model_fixtures import TinyArch
from tests.multirank import run_on_ranks


def _worker(ep: int):
    from megatron_rlhf.builder.networks import build_model
    from megatron_rlhf.engine.execution.workers import ModelWorker
    from megatron_rlhf.models.gpt import ModelBuildOptions
    from tests.model_fixtures import whole_world_groups

    pgc = whole_world_groups(1, 1, ep=ep)
    experts = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=48).expert_spec(0)
    model = build_model(TinyArch(num_layers=2, experts=experts), ModelBuildOptions(), pgc,
                        runtime_seed=5, init_seed=9)
    return ModelWorker("ref", model, pgc, None, micro_batch_size=1)


def _rows(count: int, seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(count, 10, dtype=torch.long)
    mask[:, :2] = 0  # left padding of the prompts
    return {"input_ids": torch.randint(4, 250, (count, 10), generator=generator),
            "attention_mask": mask}


def _passes(ep: int) -> dict:
    from megatron_rlhf.generation.params import GenerationConfig

    worker, rank = _worker(ep), dist.get_rank()
    results = {"uneven": worker.compute_log_prob(_rows(3 if rank == 0 else 1, rank), 6, 1.0)}
    if rank == 0:
        results["alone"] = worker.compute_log_prob(_rows(2, 7), 6, 1.0)
    else:
        worker.forward_nothing()
    config = GenerationConfig(max_new_tokens=6, micro_batch_size=1, stop_at_eos=False, seed=2)
    if rank == 0:
        out = worker.generate([[5, 6, 7], [8, 9]], [0, 1], config, eos_id=3, pad_id=1)
        results["generated"] = out.input_ids[:, -out.response_mask.shape[1]:]
        if ep == 1:  # the reference's draws, recomputed alone: EP 1 needs no other rank
            results["margin"] = decision_margin((worker.model, worker.pg_collection), out,
                                                config, [0, 1])
    else:
        worker.generate_nothing(config, pad_id=1)
    return results


def _job() -> dict:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return {ep: _passes(ep) for ep in (1, 2)}


@pytest.mark.multirank
@pytest.mark.timeout(240)
def test_workers_with_less_work_keep_the_expert_parallel_group_going() -> None:
    for rank, result in enumerate(run_on_ranks(_job, world_size=2, timeout_s=200)):
        ep1, ep2 = result[1], result[2]
        margin = ep1.pop("margin", None)
        assert sorted(ep2) == sorted(ep1) == (["alone", "generated", "uneven"] if rank == 0
                                              else ["uneven"])
        assert ep2["uneven"].shape == ((3, 4) if rank == 0 else (1, 4))
        torch.testing.assert_close(ep2["uneven"], ep1["uneven"], rtol=0, atol=1e-5)
        if rank == 0:
            torch.testing.assert_close(ep2["alone"], ep1["alone"], rtol=0, atol=1e-5)
            # EP 2 reduces in another order: equal tokens hold because no draw is near a tie.
            assert margin > MIN_MARGIN
            assert torch.equal(ep2["generated"], ep1["generated"])
