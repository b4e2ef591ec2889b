"""Gathering a sharded model's full state onto its first rank only (export at scale) gives what
the all-ranks gather gives, on the host, in the parameters' dtype, and nothing elsewhere."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.model_fixtures import TINY_ARCH, whole_world_groups
from tests.multirank import run_on_ranks


def _gather(tp: int, pp: int) -> dict:
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import (
        gather_full_state,
        gather_full_state_to_first_rank,
        init_weights,
    )
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    pgc = whole_world_groups(tp, pp)
    model = build_gpt_model(TINY_ARCH, ModelBuildOptions(head="lm+scalar"), pgc)
    init_weights(model, pgc, seed=5)
    everywhere = gather_full_state(model, pgc)
    first = gather_full_state_to_first_rank(model, pgc)
    result = {"rank": dist.get_rank(), "first": first is not None,
              "coords": (pgc.tp.rank(), pgc.pp.rank(), pgc.dp.rank())}
    if first is not None:
        result["same_names"] = sorted(first) == sorted(everywhere)
        result["equal"] = all(torch.equal(first[name].float(), everywhere[name])
                              for name in everywhere)
        params = {p.dtype for p in model.parameters()}
        result["dtypes_ok"] = {t.dtype for t in first.values()} <= params
        result["on_host"] = all(t.device.type == "cpu" for t in first.values())
        for tensor in first.values():
            tensor.add_(1.0)  # a copy: the model's parameters must not move
    after = gather_full_state(model, pgc)
    result["no_alias"] = all(torch.equal(after[name], everywhere[name]) for name in after)
    return result


@pytest.mark.multirank
@pytest.mark.parametrize("tp, pp", [(2, 2), (2, 1), (1, 2)])
def test_the_first_rank_gets_the_full_state_and_no_other_rank_does(tp: int, pp: int) -> None:
    results = run_on_ranks(_gather, world_size=4, args=(tp, pp), timeout_s=120)
    holders = [r for r in results if r["first"]]
    # One holder per DP replica: TP rank 0 of its first pipeline stage.
    assert [r["coords"][:2] for r in holders] == [(0, 0)] * (4 // (tp * pp))
    assert all(r["same_names"] and r["equal"] and r["dtypes_ok"] and r["on_host"]
               for r in holders)
    assert all(r["no_alias"] for r in results)
    # without TP too, the padded vocabulary rows (250 real of 256) are dropped, as exporters
    # expect (a Hugging Face export read the embedding's 256 rows against config.json's 250)
