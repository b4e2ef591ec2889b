"""Shards kept in memory and loaded at another layout (``models.memory_checkpoint``), on 2 gloo
ranks: the same values as the same state written to files and read back, for row shards read
as column shards, a replicated tensor, stacked layers swapped between the ranks, a tensor read
larger than saved (``allow_shape_mismatch``) and an object; a wanted tensor nobody kept is
refused on every rank; an exchange in bounded rounds loads the same values."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.multirank import run_on_ranks


def _saved(rank: int) -> dict:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    weight = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    stack = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4) + 100
    return {
        "w": ShardedTensor.from_rank_offsets("w", weight[2 * rank:2 * rank + 2].clone(),
                                             (0, rank, 2)),
        "b": ShardedTensor.from_rank_offsets("b", torch.arange(6.0) - 50, replica_id=rank),
        "stack": ShardedTensor.from_rank_offsets("stack", stack[rank].clone(), (0, rank, 2),
                                                 prepend_axis_num=1),
        "emb": ShardedTensor.from_rank_offsets("emb", torch.arange(10.0).reshape(5, 2) + 7,
                                               replica_id=rank),
        "obj": ShardedObject("obj", {"saved": 3}, (1,), (0,), replica_id=rank),
    }


def _wanted(rank: int) -> dict:
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    other = 1 - rank
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((4, 3), -1.0), (1, rank, 2)),
        "b": ShardedTensor.from_rank_offsets("b", torch.full((6,), -1.0), replica_id=rank),
        "stack": ShardedTensor.from_rank_offsets("stack", torch.full((3, 4), -1.0),
                                                 (0, other, 2), prepend_axis_num=1),
        "emb": ShardedTensor.from_rank_offsets("emb", torch.full((4, 2), -1.0), (0, rank, 2),
                                               allow_shape_mismatch=True),
        "obj": ShardedObject("obj", None, (1,), (0,), replica_id=rank),
    }


def _both_ways(root: str) -> dict:
    import torch
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_rlhf.models import memory_checkpoint
    from megatron_rlhf.models.checkpoint import (
        InProcessSaveStrategy,
        kept_in_memory,
        load_sharded_checkpoint,
    )
    from megatron_rlhf.models.memory_checkpoint import MemorySaveStrategy

    rank = dist.get_rank()
    files, memory = Path(root) / "files", Path(root) / "memory"
    rounds = Path(root) / "rounds"
    for directory, strategy in ((files, InProcessSaveStrategy()),
                                (memory, MemorySaveStrategy(memory)),
                                (rounds, MemorySaveStrategy(rounds))):
        if rank == 0:
            directory.mkdir()
        dist.barrier()
        dist_checkpointing.save(_saved(rank), str(directory), sharded_strategy=strategy)
    from_files = load_sharded_checkpoint(_wanted(rank), files)
    exchanges = []
    all_to_all = dist.all_to_all_single
    dist.all_to_all_single = lambda *args, **kwargs: (exchanges.append(args[0].numel()),
                                                      all_to_all(*args, **kwargs))[1]
    try:
        from_memory = load_sharded_checkpoint(_wanted(rank), memory)
        whole = len(exchanges)
        memory_checkpoint.EXCHANGE_ROUND_BYTES = 16  # four fp32 values a rank a round,
        # or one larger intersection alone
        in_rounds = load_sharded_checkpoint(_wanted(rank), rounds)
    finally:
        dist.all_to_all_single = all_to_all
    equal = {key: (torch.equal(from_files[key], from_memory[key])
                   and torch.equal(from_files[key], in_rounds[key])
                   if isinstance(from_memory[key], torch.Tensor)
                   else from_files[key] == from_memory[key] == in_rounds[key])
             for key in from_memory}
    missing = {"gone": ShardedTensor.from_rank_offsets("gone", torch.zeros(2))}
    with pytest.raises(ValueError, match=r"covers 0 of 2 elements of gone .*rank 0"):
        load_sharded_checkpoint(missing, memory)
    values = {key: value.tolist() if isinstance(value, torch.Tensor) else value
              for key, value in from_memory.items()}  # tensors do not outlive the rank
    return {"equal": equal, "memory": values, "kinds": (kept_in_memory(files),
                                                         kept_in_memory(memory)),
            "exchanges": (exchanges[:whole], exchanges[whole:])}


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_shards_kept_in_memory_load_as_from_files(tmp_path: Path) -> None:
    import torch

    out = run_on_ranks(_both_ways, world_size=2, args=(str(tmp_path),), timeout_s=90)
    for rank, result in enumerate(out):
        assert result["kinds"] == (False, True)
        whole, rounds = result["exchanges"]  # bytes this rank received per exchange
        assert len(whole) == 1 and len(rounds) > 1 and sum(rounds) == whole[0], whole + rounds
        assert max(rounds) < whole[0]
        assert result["equal"] == dict.fromkeys(("w", "b", "stack", "emb", "obj"), True)
        loaded = result["memory"]
        weight = torch.arange(24.0).reshape(4, 6)
        assert loaded["w"] == weight[:, 3 * rank:3 * rank + 3].tolist()
        assert loaded["b"] == (torch.arange(6.0) - 50).tolist()
        assert loaded["stack"] == (torch.arange(24.0).reshape(2, 3, 4)[1 - rank] + 100).tolist()
        emb = torch.cat([torch.arange(10.0).reshape(5, 2) + 7, torch.zeros(3, 2)])
        assert loaded["emb"] == emb[4 * rank:4 * rank + 4].tolist()
        assert loaded["obj"] == {"saved": 3}


def test_rounds_bound_what_each_rank_sends_and_receives() -> None:
    from megatron_rlhf.models.memory_checkpoint import Transfer, _rounds

    def moved(source: int, destination: int, nbytes: int) -> Transfer:
        return Transfer(source, 0, destination, 0, (), nbytes)

    a, b, c, d = moved(0, 1, 6), moved(1, 0, 6), moved(0, 1, 5), moved(1, 1, 20)
    # a and b share no rank's budget of 10; c would make rank 0 send 11 and rank 1 receive 11;
    # d is larger than a round and goes alone.
    assert _rounds([a, b, c, d], 2, 10) == [[a, b], [c], [d]]
    assert _rounds([a, b, c, d], 2, 100) == [[a, b, c, d]]
    assert _rounds([], 2, 10) == []
