"""Shared test fixtures: a tiny architecture and one model's process groups over the whole world."""

from __future__ import annotations

import dataclasses

from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.topology.groups import build_model_process_groups
from megatron_rlhf.topology.models import ArchSpec, ModelSpec

TINY_ARCH = ArchSpec("test-tiny", num_layers=4, hidden_size=64, num_attention_heads=4,
                     vocab_size=250, seq_length=64, ffn_hidden_size=128, gated_mlp=True,
                     num_query_groups=2)
"""A 4-layer GQA model; the vocabulary is not a multiple of 128*tp, to exercise padding."""


def TinyArch(**overrides) -> ArchSpec:  # noqa: N802 - reads like the dataclass it builds
    """The tiny test architecture, with any field overridden."""
    return dataclasses.replace(TINY_ARCH, **overrides)


def whole_world_groups(tp: int, pp: int, ep: int = 1) -> ProcessGroupCollection:
    """Process groups of one model spread over every rank (collective), built as a run builds
    them: with ``ep > 1`` a mixture-of-experts model's expert groups too."""
    return build_model_process_groups(ModelSpec("actor", TINY_ARCH, trainable=True, tp=tp, pp=pp,
                                                ep=ep))
