"""Batched, KV-cached sampling from Megatron-Core GPT models under tensor parallelism.

Map of the files (details in docs/generation.md):

- ``params.py``: ``GenerationConfig``.
- ``sampling.py``: counter-based noise keyed by (seed, prompt index, step), temperature / top-k /
  top-p filtering, inverse-CDF sampling; pure tensor functions.
- ``forward.py``: next-token logits with megatron's ``StaticInferenceContext`` (KV cache) or by
  full recomputation.
- ``decode_step.py``: ``SlotDecoder``, the decode step of fixed shape over slots (buffers
  allocated once per bucket, updated in place), and ``DecodeGraph``, its CUDA graph.
- ``continuous.py``: continuous batching inside one call (finished slots take waiting prompts).
- ``lockstep.py``: ``ExpertLockstep``, the ranks of an MoE model's expert-parallel group at equal
  forward counts (idle forwards where a rank has nothing left to decode).
- ``output.py``: ``GenerationOutput`` and the ``MicroBatchWork`` a call ran.
- ``generate.py``: ``generate_sequences``, with the static loop (``batching=static``) as the
  reference.
- ``episodes.py``: ``run_episodes``, multi-turn episodes over a ``generate`` call per turn
  (tool calls, environments), token in, token out; ``run_episodes_overlapped``, the same rows
  with the tools' waits overlapped with other episodes' decoding.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megatron_rlhf.generation.output import GenerationOutput, MicroBatchWork, concat_outputs
from megatron_rlhf.generation.params import GenerationConfig
from megatron_rlhf.generation.sampling import (
    SampledTokens,
    inverse_cdf_sample,
    prompt_noise_keys,
    sample_tokens,
    sampling_logprobs,
    sampling_uniform,
    sampling_uniforms,
    top_k_top_p_keep,
    uniforms_at_step,
    uniforms_for_steps,
)

if TYPE_CHECKING:
    from megatron_rlhf.generation.answer_pool import AnswerPool
    from megatron_rlhf.generation.forward import CachedNextTokenLogits, RecomputeNextTokenLogits
    from megatron_rlhf.generation.generate import continue_sequences, generate_sequences, left_pad

_LAZY = {"CachedNextTokenLogits": "forward", "RecomputeNextTokenLogits": "forward",
         "generate_sequences": "generate", "left_pad": "generate",
         "continue_sequences": "generate", "AnswerPool": "answer_pool"}
"""Names whose modules import megatron-core, imported at their first use: a module that needs
only ``GenerationConfig`` or the sampling functions (the run's configuration) does not pay
for it."""


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


__all__ = [
    "AnswerPool",
    "CachedNextTokenLogits",
    "GenerationConfig",
    "GenerationOutput",
    "MicroBatchWork",
    "RecomputeNextTokenLogits",
    "SampledTokens",
    "concat_outputs",
    "continue_sequences",
    "generate_sequences",
    "inverse_cdf_sample",
    "left_pad",
    "prompt_noise_keys",
    "sample_tokens",
    "sampling_logprobs",
    "sampling_uniform",
    "sampling_uniforms",
    "top_k_top_p_keep",
    "uniforms_at_step",
    "uniforms_for_steps",
]
