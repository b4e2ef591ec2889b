"""A rank reads only its TP shard of each tensor of a converted safetensors file."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rlhf.builder.sources import LazyTensor, SafetensorsState
from megatron_rlhf.models.weights import ShardRule, _shard_of_full

RULES = {
    "column": (ShardRule("q", 0, False, None), (12, 4)),
    "row": (ShardRule("o", 1, False, None), (4, 12)),
    "swiglu": (ShardRule("fc1", 0, True, None), (16, 4)),
    "vocab": (ShardRule("embedding.word_embeddings.weight", 0, False, 10), (10, 4)),
    "replicated": (ShardRule("norm", None, False, None), (4,)),
}


class CountingTensor(LazyTensor):
    read = 0

    def __getitem__(self, index):
        part = super().__getitem__(index)
        CountingTensor.read += part.numel()
        return part


@pytest.mark.parametrize("kind", sorted(RULES))
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_a_lazily_read_shard_equals_the_slice_of_the_whole_tensor_and_reads_only_it(
        tmp_path, kind: str, tp_size: int) -> None:
    rule, shape = RULES[kind]
    full = torch.randn(shape, generator=torch.Generator().manual_seed(tp_size))
    save_file({rule.global_name: full}, tmp_path / "state.safetensors")
    local = list(shape)
    if rule.vocab_rows is not None:
        local[0] = -(-rule.vocab_rows // (4 * tp_size)) * 4  # padded to a multiple of 4 per rank
    elif rule.partition_dim is not None:
        local[rule.partition_dim] //= tp_size
    shards = []
    with safe_open(tmp_path / "state.safetensors", framework="pt") as handle:
        state = SafetensorsState(handle)
        assert isinstance(state[rule.global_name], LazyTensor)
        for tp_rank in range(tp_size):
            CountingTensor.read = 0
            lazy = CountingTensor(handle.get_slice(rule.global_name))
            shard = _shard_of_full(lazy, rule, torch.Size(local), tp_rank, tp_size)
            assert torch.equal(shard, _shard_of_full(full, rule, torch.Size(local), tp_rank,
                                                     tp_size))
            assert list(shard.shape) == local
            real = shard.numel() if rule.vocab_rows is None else (
                min(rule.vocab_rows, (tp_rank + 1) * local[0]) - min(rule.vocab_rows,
                                                                     tp_rank * local[0])) * local[1]
            assert CountingTensor.read == real  # this rank's part, not the whole tensor
            shards.append(shard)
    # the shards put back together are the full tensor (and zero padding rows)
    if rule.partition_dim is None:
        assert all(torch.equal(shard, full) for shard in shards)
    elif rule.glu_halves:
        gates = torch.cat([shard.chunk(2)[0] for shard in shards])
        ups = torch.cat([shard.chunk(2)[1] for shard in shards])
        assert torch.equal(torch.cat([gates, ups]), full)
    else:
        whole = torch.cat(shards, dim=rule.partition_dim)
        assert torch.equal(whole[: full.shape[0]] if rule.vocab_rows else whole, full)
        if rule.vocab_rows:
            assert not whole[rule.vocab_rows:].any()
