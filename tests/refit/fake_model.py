"""Shard descriptions of a small GPT under any layout, and an in-memory run of a refit plan.

``describe`` writes what ``shard_rules`` reports for megatron's GPTModel (vocabulary-parallel
embedding and LM head padded to ``PAD * tp`` rows, column-parallel QKV and SwiGLU fc1, row-parallel
projections, replicated norms; norms under TE's fused names with ``te``), so the planner can be
tested without megatron models or process groups. ``simulate`` executes a plan on tensors cut
from one random full state.
"""

from __future__ import annotations

import math

import torch

from megatron_rlhf.models.layer_names import fused_norm_prefixes, local_layer_name
from megatron_rlhf.models.weights import ShardRule, _shard_of_full
from megatron_rlhf.refit import ModelLayout, ParamShard, RankShards, RefitPlan
from megatron_rlhf.refit.layout import box_slices

HIDDEN, QKV, FFN, VOCAB, PAD = 8, 16, 12, 10, 4


def _rule(name: str, dim: int | None = None, glu: bool = False,
          vocab: bool = False) -> ShardRule:
    return ShardRule(name, dim, glu, VOCAB if vocab else None)


def _te_name(name: str) -> str:
    """Transformer Engine's name of a local layer parameter (its fused norms)."""
    for local, fused in fused_norm_prefixes().items():
        if name.startswith(local):
            return fused + name[len(local):]
    return name


def _stage_params(layout: ModelLayout, pp_rank: int, num_layers: int, tied: bool,
                  te: bool) -> list[tuple[str, ShardRule, tuple[int, ...]]]:
    tp = layout.tp
    rows = math.ceil(VOCAB / (PAD * tp)) * PAD * tp // tp
    per_stage = num_layers // layout.pp
    params = []
    if pp_rank == 0:
        params.append(("embedding.word_embeddings.weight",
                       _rule("embedding.word_embeddings.weight", 0, vocab=True), (rows, HIDDEN)))
    for local in range(per_stage):
        prefix, glob = f"decoder.layers.{local}.", f"decoder.layers.{pp_rank * per_stage + local}."
        for name, dim, glu, shape in (
            ("input_layernorm.weight", None, False, (HIDDEN,)),
            ("self_attention.linear_qkv.weight", 0, False, (QKV // tp, HIDDEN)),
            ("self_attention.linear_proj.weight", 1, False, (HIDDEN, QKV // tp)),
            ("mlp.linear_fc1.weight", 0, True, (2 * FFN // tp, HIDDEN)),
            ("pre_mlp_layernorm.weight", None, False, (HIDDEN,)),
            ("mlp.linear_fc2.weight", 1, False, (HIDDEN, FFN // tp)),
        ):
            if te:  # named as TE's layers name it; the global name is what shard_rules gives
                name = _te_name(name)
            params.append((prefix + name, _rule(glob + local_layer_name(name), dim, glu), shape))
    if pp_rank == layout.pp - 1:
        params.append(("decoder.final_layernorm.weight",
                       _rule("decoder.final_layernorm.weight"), (HIDDEN,)))
        if not tied or layout.pp > 1:
            head = "embedding.word_embeddings.weight" if tied else "output_layer.weight"
            params.append(("output_layer.weight", _rule(head, 0, vocab=True), (rows, HIDDEN)))
    return params


def describe(layout: ModelLayout, num_layers: int = 4, tied: bool = False,
             dtype: torch.dtype = torch.float32, te: bool = False) -> list[RankShards]:
    """Every rank's ``RankShards`` of the small GPT placed on ``layout``, built with megatron's
    local layers or (``te``) Transformer Engine's."""
    shards = []
    for rank in layout.ranks:
        c = layout.coords(rank)
        params = tuple(ParamShard(name, rule, shape, dtype)
                       for name, rule, shape in _stage_params(layout, c.pp, num_layers, tied, te))
        shards.append(RankShards(rank, c.tp, layout.tp, c.pp, c.dp, params))
    return shards


def full_state(shards: list[RankShards], seed: int = 0) -> dict[str, torch.Tensor]:
    """A random full (TP1, unpadded) tensor for every parameter the ranks describe."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for rank_shards in shards:
        for p in rank_shards.params:
            shape = list(p.shape)
            if p.rule.partition_dim is not None:
                shape[p.rule.partition_dim] *= rank_shards.tp_size
            if p.rule.vocab_rows is not None:
                shape[0] = p.rule.vocab_rows
            state.setdefault(p.rule.global_name, torch.randn(shape, generator=generator))
    return state


def _cut(shards: list[RankShards], state: dict[str, torch.Tensor]
         ) -> dict[tuple[int, str], torch.Tensor]:
    return {(r.rank, p.local_name): _shard_of_full(state[p.rule.global_name], p.rule,
                                                   torch.Size(p.shape), r.tp_rank, r.tp_size)
            for r in shards for p in r.params}


def simulate(plan: RefitPlan, src: list[RankShards], dst: list[RankShards]) -> None:
    """Run ``plan`` on tensors in memory; assert the destination equals the source's state.

    Destination tensors start as NaN, so a region no transfer or zero fill reaches fails.
    """
    state = full_state(src)
    src_tensors = _cut(src, state)
    dst_tensors = {(r.rank, p.local_name): torch.full(p.shape, math.nan)
                   for r in dst for p in r.params}
    for t in plan.transfers:
        dst_tensors[(t.dst_rank, t.dst_name)][box_slices(t.dst_box)] = (
            src_tensors[(t.src_rank, t.src_name)][box_slices(t.src_box)])
    for fill in plan.zero_fills:
        dst_tensors[(fill.rank, fill.local_name)][box_slices(fill.box)] = 0.0
    expected = _cut(dst, state)
    for key, tensor in dst_tensors.items():
        assert torch.equal(tensor, expected[key]), f"destination {key} differs"
