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


def _stages_through_the_host() -> dict:
    import torch.utils._pytree as pytree

    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import (
        gather_full_state,
        gather_full_state_to_first_rank,
        init_weights,
        shard_rules,
    )
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    pgc = whole_world_groups(1, 2)
    model = build_gpt_model(TINY_ARCH, ModelBuildOptions(head="lm+scalar"), pgc)
    init_weights(model, pgc, seed=5)
    everywhere = gather_full_state(model, pgc)
    objects, received = [], []
    gather_object, recv = dist.gather_object, dist.recv

    def seen_gather_object(obj, *args, **kwargs):
        objects.append(obj)
        return gather_object(obj, *args, **kwargs)

    def seen_recv(tensor, *args, **kwargs):
        received.append(tensor.numel())
        return recv(tensor, *args, **kwargs)

    dist.gather_object, dist.recv = seen_gather_object, seen_recv
    try:
        first = gather_full_state_to_first_rank(model, pgc)
    finally:
        dist.gather_object, dist.recv = gather_object, recv
    own = {rule.global_name for _, _, rule in shard_rules(model)}
    result = {"stage": pgc.pp.rank(), "objects_hold_tensors": any(
        isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(objects)),
        "received": received, "own": len(own)}
    if first is not None:
        result["equal"] = sorted(first) == sorted(everywhere) and all(
            torch.equal(first[name].float(), everywhere[name]) for name in everywhere)
        result["sizes"] = {name: t.numel() for name, t in everywhere.items() if name not in own}
    return result


@pytest.mark.multirank
def test_pipeline_stages_reach_the_first_rank_one_tensor_at_a_time() -> None:
    """Under NCCL ``gather_object`` stages every pickled stage in one buffer on the
    destination's GPU (pp times a stage's bytes); only the names, shapes and dtypes go as objects
    now, and the other stage's tensors arrive one receive each (one tensor's bytes on the GPU)."""
    first, last = run_on_ranks(_stages_through_the_host, world_size=2, timeout_s=120)
    assert first["equal"], "the gathered state is the all-ranks gather's, bit for bit"
    assert not first["objects_hold_tensors"] and not last["objects_hold_tensors"]
    assert last["received"] == []
    assert sorted(first["received"]) == sorted(first["sizes"].values()) and first["sizes"]
