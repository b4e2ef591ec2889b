"""Build an actor and its shadow on blocks of ranks, for the multi-rank refit tests.

    models = build_pair(ModelLayout(0, tp=2), ModelLayout(2, tp=1, dp=2), world_size=4)
    models.src_model      # None on ranks 2-3

Groups come from ``topology.groups.build_process_groups`` over a hand-made placement plan, so the
models get Megatron ``HyperCommGrid`` sub-grids with a ``rank_offset``, as in a real run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.models.forward_backward import run_microbatches
from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
from megatron_rlhf.models.weights import gather_full_state, init_weights
from megatron_rlhf.refit import ModelLayout
from megatron_rlhf.topology import (
    ArchSpec,
    ClusterSpec,
    ModelPlacement,
    ModelSpec,
    PlacementConfig,
    PlacementPlan,
)
from megatron_rlhf.topology.groups import build_process_groups
from tests.model_fixtures import TinyArch

_ARCH = TinyArch()
VOCAB_SIZE = _ARCH.vocab_size
ARCH_SPEC = ArchSpec("tiny-test", _ARCH.num_layers, _ARCH.hidden_size, _ARCH.num_attention_heads,
                      _ARCH.vocab_size, _ARCH.seq_length, _ARCH.ffn_hidden_size, gated_mlp=True)


@dataclass
class ModelPair:
    """This rank's parts of the source (actor) and destination (shadow); None where absent."""

    src_model: GPTModel | None
    src_pgc: ProcessGroupCollection | None
    dst_model: GPTModel | None
    dst_pgc: ProcessGroupCollection | None


def _placement(role: str, layout: ModelLayout, trainable: bool) -> ModelPlacement:
    spec = ModelSpec(role, ARCH_SPEC, trainable=trainable, tp=layout.tp, pp=layout.pp)
    return ModelPlacement(spec, rank_offset=layout.rank_offset, size=layout.size, ratio=1.0)


def build_pair(src: ModelLayout, dst: ModelLayout, world_size: int,
               arch: TinyArch | None = None) -> ModelPair:
    """Build both models' groups (collective) and this rank's model parts, initialised apart.

    The source gets ``init_weights(seed=1)`` plus a perturbation (so it is not an initialisation
    the destination could reproduce); the destination ``init_weights(seed=2)``.

    Args:
        arch: defaults to ``TinyArch()``; its 2 query groups cap TP at 2 (megatron's attention
            falls back to global parallel state when TP exceeds the query groups).
    """
    plan = PlacementPlan(
        cluster=ClusterSpec.homogeneous(1, world_size),
        config=PlacementConfig(strategy="separation"),
        models={"actor": _placement("actor", src, True),
                "shadow_actor": _placement("shadow_actor", dst, False)},
    )
    groups = build_process_groups(plan)
    arch = arch or _ARCH
    pair = ModelPair(None, groups["actor"], None, groups["shadow_actor"])
    if pair.src_pgc is not None:
        pair.src_model = build_gpt_model(arch, ModelBuildOptions(), pair.src_pgc)
        init_weights(pair.src_model, pair.src_pgc, seed=1)
        perturb(pair.src_model, pair.src_pgc, step=0)
    if pair.dst_pgc is not None:
        pair.dst_model = build_gpt_model(arch, ModelBuildOptions(), pair.dst_pgc)
        init_weights(pair.dst_model, pair.dst_pgc, seed=2)
    return pair


@torch.no_grad()
def perturb(model: GPTModel, pgc: ProcessGroupCollection, step: int) -> None:
    """A fake update: noise identical across DP replicas (and across TP for replicated tensors)."""
    for index, (name, param) in enumerate(model.named_parameters()):
        tp_rank = pgc.tp.rank() if getattr(param, "tensor_model_parallel", False) else 0
        seed = ((step * 100 + index) * 100 + tp_rank) * 100 + pgc.pp.rank()
        noise = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed)) * 0.01
        if "word_embeddings" in name or "output_layer" in name:
            first_pad = max(0, _ARCH.vocab_size - param.shape[0] * pgc.tp.rank())
            noise[first_pad:] = 0.0  # padded vocabulary rows stay zero
        param.add_(noise.to(param.dtype))


def batch() -> dict[str, torch.Tensor]:
    """One fixed batch of token ids with some left padding."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, _ARCH.vocab_size, (2, 12), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    return {"input_ids": ids, "attention_mask": mask}


def logits(model: GPTModel, pgc: ProcessGroupCollection) -> torch.Tensor | None:
    """Full-vocabulary logits ``[b, s, vocab]`` on the model's last stage, None elsewhere."""
    captured: list[torch.Tensor] = []

    def loss_fn(output: torch.Tensor, _batch: dict) -> tuple[torch.Tensor, dict]:
        shards = [torch.empty_like(output) for _ in range(pgc.tp.size())]
        dist.all_gather(shards, output.contiguous(), group=pgc.tp)
        captured.append(torch.cat(shards, dim=-1)[..., :_ARCH.vocab_size].detach())
        return output.sum() * 0.0, {}

    with torch.no_grad():
        run_microbatches(model, pgc, [batch()], loss_fn, forward_only=True)
    return captured[0] if captured else None


def snapshot(model: GPTModel | None, pgc: ProcessGroupCollection | None
             ) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
    """``(full state, logits)`` of one model on this rank; Nones where the rank holds no part."""
    if model is None or pgc is None:
        return None, None
    return gather_full_state(model, pgc), logits(model, pgc)
