"""Shared helpers of the generation tests: prompts and tiny models with fixed weights."""

from __future__ import annotations

import torch

from tests.model_fixtures import TinyArch

INIT_SEED = 11


def make_prompts(lengths: list[int], seed: int = 0, vocab_size: int = 250) -> list[list[int]]:
    """Random prompts of the given lengths."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def build_tiny(head: str = "lm", tp: int = 1):
    """A TinyArch model over the whole world (DP = world / tp) with layout-independent weights.

    Returns:
        ``(model, pg_collection)``.
    """
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights
    from tests.model_fixtures import whole_world_groups

    pgc = whole_world_groups(tp, 1)
    model = build_gpt_model(TinyArch(), ModelBuildOptions(head=head), pgc)
    init_weights(model, pgc, seed=INIT_SEED)
    return model, pgc
