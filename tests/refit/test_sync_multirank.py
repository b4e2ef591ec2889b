"""Weight sync between real megatron GPTModels on 4 gloo ranks: disjoint, overlapping and PP.

Each case builds an actor (trained-looking weights) and a shadow (other weights) on their own
rank blocks, syncs, fakes a training update and syncs again. After every sync the shadow's full
state equals the actor's, its logits match, its padded vocabulary rows are zero and the actor is
untouched. Ranks return numpy arrays (tensors would travel through shared memory that dies with
the rank).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron_rlhf.refit import ModelLayout
from tests.multirank import run_on_ranks

L = ModelLayout
_PADDED_NAMES = ("embedding.word_embeddings.weight", "output_layer.weight")


def _numpy(snapshot: tuple) -> tuple:
    # Copies: gather_full_state returns replicated tensors as views of the live parameters.
    state, logits = snapshot
    return ({k: v.numpy().copy() for k, v in state.items()} if state is not None else None,
            logits.numpy() if logits is not None else None)


@torch.no_grad()
def _fill_padding(model, pgc, value: float | None) -> bool:
    """Set the padded vocabulary rows to ``value``, or (None) check that they are zero."""
    from tests.refit.helpers import VOCAB_SIZE

    ok = True
    for name, param in model.named_parameters():
        if name in _PADDED_NAMES:
            rows = param.data[max(0, VOCAB_SIZE - param.shape[0] * pgc.tp.rank()):]
            if value is None:
                ok &= bool((rows == 0).all())
            else:
                rows.fill_(value)
    return ok


def _sync_case(src: ModelLayout, dst: ModelLayout, copy_service: str,
               query_groups: int) -> list[dict[str, Any]]:
    from megatron_rlhf.refit import build_weight_sync
    from tests.model_fixtures import TinyArch
    from tests.refit.helpers import build_pair, perturb, snapshot

    pair = build_pair(src, dst, world_size=dist.get_world_size(),
                      arch=TinyArch(num_query_groups=query_groups))
    sync = build_weight_sync(pair.src_model, pair.src_pgc, src, pair.dst_model, pair.dst_pgc,
                             dst, copy_service=copy_service)
    rounds = []
    for step in (1, 2):
        src_before = _numpy(snapshot(pair.src_model, pair.src_pgc))[0]
        if pair.dst_model is not None:
            _fill_padding(pair.dst_model, pair.dst_pgc, 7.0)
        sync.sync()
        rounds.append({
            "src_before": src_before,
            "src": _numpy(snapshot(pair.src_model, pair.src_pgc)),
            "dst": _numpy(snapshot(pair.dst_model, pair.dst_pgc)),
            "padding_zero": pair.dst_model is None or _fill_padding(pair.dst_model,
                                                                     pair.dst_pgc, None),
        })
        if pair.src_model is not None:
            perturb(pair.src_model, pair.src_pgc, step=step)
    return rounds


def _run_cases(cases: list[tuple[ModelLayout, ModelLayout, str, int]]) -> list[list[dict]]:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return [_sync_case(*case) for case in cases]


def _check(per_rank: list[list[dict]], case: int) -> None:
    rounds = len(per_rank[0][case])
    for i in range(rounds):
        got = [ranks[case][i] for ranks in per_rank]
        assert all(r["padding_zero"] for r in got), f"round {i}: padded rows not zero"
        src_states = [r["src"][0] for r in got if r["src"][0] is not None]
        src_logits = [r["src"][1] for r in got if r["src"][1] is not None]
        dst_states = [r["dst"][0] for r in got if r["dst"][0] is not None]
        dst_logits = [r["dst"][1] for r in got if r["dst"][1] is not None]
        reference = src_states[0]
        for r in got:
            if r["src_before"] is not None:
                assert all(np.array_equal(r["src_before"][k], v) for k, v in reference.items())
        for state in dst_states:
            assert state.keys() == reference.keys()
            for name, value in reference.items():
                assert np.array_equal(state[name], value), f"round {i}: {name} differs"
        assert src_logits and dst_logits
        for logits in dst_logits:
            np.testing.assert_allclose(logits, src_logits[0], rtol=0, atol=1e-5)
    first, second = per_rank[0][case][0]["src"][0], per_rank[0][case][1]["src"][0]
    if first is not None:  # the update between rounds changed the actor
        assert not np.array_equal(first["decoder.layers.0.mlp.linear_fc1.weight"],
                                  second["decoder.layers.0.mlp.linear_fc1.weight"])


@pytest.mark.multirank
def test_disjoint_and_pipelined_sources() -> None:
    cases = [
        (L(0, tp=2), L(2, tp=1, dp=2), "nccl", 2),  # (a) disjoint, TP2 -> TP1 x DP2
        (L(0, tp=1, pp=2), L(2, tp=2), "nccl", 2),  # (c) PP source, TP1 PP2 -> TP2
    ]
    results = run_on_ranks(_run_cases, world_size=4, args=(cases,), timeout_s=150)
    for case in range(len(cases)):
        _check(results, case)


@pytest.mark.multirank
def test_overlapping_layouts() -> None:
    cases = [
        # (b) same ranks, TP2 x DP2 -> TP4: the vocabulary padding grows from 256 to 512 rows
        # (megatron's own planner refuses this); 4 query groups so that TP4 runs without
        # megatron's global parallel state.
        (L(0, tp=2, dp=2), L(0, tp=4), "gloo", 4),
        (L(0, tp=2, dp=2), L(0, tp=1, dp=4), "nccl", 2),
    ]
    results = run_on_ranks(_run_cases, world_size=4, args=(cases,), timeout_s=150)
    for case in range(len(cases)):
        _check(results, case)


def _pair_service_groups(cases: list[tuple[ModelLayout, ModelLayout, str, int]]) -> dict:
    """The cases' results, the ranks of the group of every point-to-point operation, and the
    barriers run during the syncs."""
    batch, barrier, groups, barriers = dist.batch_isend_irecv, dist.barrier, [], []

    def recorded(ops):
        groups.extend("world" if op.group in (None, dist.group.WORLD)
                      else dist.get_process_group_ranks(op.group) for op in ops)
        return batch(ops)

    def recorded_barrier(*args, **kwargs):
        barriers.append(kwargs.get("group", args[0] if args else None))
        return barrier(*args, **kwargs)

    dist.batch_isend_irecv = recorded
    dist.barrier = recorded_barrier
    try:
        return {"rounds": _run_cases(cases), "groups": groups, "barriers": len(barriers)}
    finally:
        dist.batch_isend_irecv = batch
        dist.barrier = barrier


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_the_pair_service_syncs_on_the_two_models_own_group() -> None:
    """The default service: every send and receive on a group of the source's and destination's
    ranks (here 0-2 of 4), none on the world group, and no barrier (megatron's executor ends
    with one on the world, where a rank with nothing to receive would wait under the world's
    timeout through the trainer's stage); the shadow still equals the actor."""
    cases = [(L(0, tp=2), L(2, tp=1), "pair", 2)]
    results = run_on_ranks(_pair_service_groups, world_size=4, args=(cases,), timeout_s=150)
    _check([result["rounds"] for result in results], 0)
    assert results[2]["groups"], "the destination received nothing"
    for result in results:
        assert all(group == [0, 1, 2] for group in result["groups"]), result["groups"]
        assert result["barriers"] == 0


def _verified(corrupt: bool) -> dict:
    """A TP2 -> TP1 pair sync checked after every round; with ``corrupt``, rank 2's copy of one
    tensor is changed after the copy and before the check, as a mis-planned region would be."""
    import megatron_rlhf.refit.sync as sync_module
    from megatron_rlhf.refit import build_weight_sync
    from megatron_rlhf.refit.verify import RefitMismatch
    from megatron_rlhf.runtime.bootstrap import initialize_runtime
    from tests.model_fixtures import TinyArch
    from tests.refit.helpers import build_pair

    initialize_runtime()
    src, dst = L(0, tp=2), L(2, tp=1)
    pair = build_pair(src, dst, world_size=dist.get_world_size(), arch=TinyArch())
    sync = build_weight_sync(pair.src_model, pair.src_pgc, src, pair.dst_model, pair.dst_pgc,
                             dst, verify="every")
    execute = sync_module.execute

    def corrupting(plan, fills, src_model, dst_model, service):
        execute(plan, fills, src_model, dst_model, service)
        if dst_model is not None and corrupt:
            with torch.no_grad():
                dst_model.decoder.layers[1].mlp.linear_fc2.weight[0, :2].add_(1e-3)

    sync_module.execute = corrupting
    try:
        for _ in range(1 if corrupt else 2):  # the receiver stops at the first mismatch
            sync.sync()
        return {"error": None, "syncs": sync.syncs}
    except RefitMismatch as error:
        return {"error": str(error), "syncs": sync.syncs}
    finally:
        sync_module.execute = execute


@pytest.mark.multirank
@pytest.mark.timeout(180)
def test_a_region_received_differently_from_what_was_sent_stops_the_sync() -> None:
    clean = run_on_ranks(_verified, world_size=4, args=(False,), timeout_s=70)
    assert [r["error"] for r in clean] == [None] * 4 and clean[2]["syncs"] == 2
    corrupted = run_on_ranks(_verified, world_size=4, args=(True,), timeout_s=70)
    message = corrupted[2]["error"]
    assert message.startswith("weight sync: decoder.layers.1.mlp.linear_fc2.weight"), message
    assert "on rank 2 differs from what rank 0 sent" in message
    assert [r["error"] for r in corrupted[:2]] == [None, None]  # the senders' part was right
