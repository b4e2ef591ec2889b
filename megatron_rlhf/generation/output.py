"""What ``generate_sequences`` returns: the batch (``GenerationOutput``) and the model calls it ran
(``MicroBatchWork``), and how outputs of consecutive batches are stacked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatchWork:
    """The model calls one micro-batch of ``generate_sequences`` ran.

    With the KV cache: one prefill over ``rows x prompt_width`` positions (its logits give the
    first token), then ``forwards - 1`` one-token steps whose context is ``prompt_width + t``
    positions, ``t = 1 .. forwards - 1``. Without it: ``forwards`` full forwards over
    ``prompt_width + t`` positions, ``t = 0 .. forwards - 1``. Every call runs all ``rows``, also
    those that have stopped.
    """

    rows: int
    prompt_width: int
    """The micro-batch's padded prompt width: its longest prompt."""
    forwards: int
    """Calls of the model (the decode loop's iterations that ran)."""
    kv_cache: bool
    """Whether the calls went through the KV cache."""
    decode_context: int = 0
    """Non-zero for the decode steps of continuous batching (``generation.batching=continuous``):
    ``forwards`` one-token calls over ``rows`` slots, attending ``decode_context`` cache
    positions on average (rounded up; masked ones included), and no prefill (each prefill is a
    record of its own with ``forwards=1``). One record per slot count: the slots shrink to
    smaller buckets once no prompt waits."""


@dataclass
class GenerationOutput:
    """Prompts and responses of one batch, in the order of the prompts given.

    Padding positions hold ``pad_id`` in ``input_ids`` and 0 in the masks and log-probs.
    """

    input_ids: torch.Tensor
    """``[b, P + R]`` int64: left-padded prompt, then right-padded response."""
    attention_mask: torch.Tensor
    """``[b, P + R]`` int64: 1 on real (prompt or response) tokens."""
    prompt_mask: torch.Tensor
    """``[b, P]`` int64: 1 on real prompt tokens."""
    response_mask: torch.Tensor
    """``[b, R]`` int64: 1 on generated tokens, EOS included."""
    response_logprobs: torch.Tensor
    """``[b, R]`` float32: log-probability of each generated token under the distribution it was
    actually drawn from (temperature, then top-k, then top-p, renormalised); 0 for greedy (a point
    mass)."""
    response_policy_logprobs: torch.Tensor
    """``[b, R]`` float32: log-probability under ``softmax(logits / temperature)`` over the real
    vocabulary, without top-k/top-p; what a full forward at that temperature (PPO's old
    log-probs) computes, up to rounding. Equal to ``response_logprobs`` when nothing filters."""
    prompt_lengths: torch.Tensor
    """``[b]`` int64: real prompt tokens."""
    response_lengths: torch.Tensor
    """``[b]`` int64: generated tokens."""
    micro_batches: tuple[MicroBatchWork, ...] = ()
    """What each micro-batch ran, in order (``generate_sequences`` fills it)."""
    response_versions: torch.Tensor | None = None
    """``[b, R]`` int64: how many weight updates during the call preceded each generated token
    (0 under the weights the call began with; 0 at padding); None when the call took no
    ``weight_updates``."""

    @property
    def prompt_length(self) -> int:
        """``P``, the padded prompt width."""
        return self.prompt_mask.shape[1]

    @property
    def responses(self) -> torch.Tensor:
        """``[b, R]`` the response part of ``input_ids``."""
        return self.input_ids[:, self.prompt_length:]


def concat_outputs(outputs: Sequence[GenerationOutput], pad_id: int) -> GenerationOutput:
    """Stack the outputs of consecutive prompt batches into one, re-padded to the widest prompt
    (on the left) and the longest response (on the right)."""
    prompt_width = max(out.prompt_length for out in outputs)
    steps = max(out.response_mask.shape[1] for out in outputs)

    def pad(tensor: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(tensor, (left, right), value=value)

    parts = {name: [] for name in ("input_ids", "attention_mask", "prompt_mask", "response_mask",
                                   "response_logprobs", "response_policy_logprobs")}
    for out in outputs:
        left, right = prompt_width - out.prompt_length, steps - out.response_mask.shape[1]
        parts["input_ids"].append(pad(out.input_ids, left, right, pad_id))
        parts["attention_mask"].append(pad(out.attention_mask, left, right, 0))
        parts["prompt_mask"].append(pad(out.prompt_mask, left, 0, 0))
        for name in ("response_mask", "response_logprobs", "response_policy_logprobs"):
            parts[name].append(pad(getattr(out, name), 0, right, 0))
    return GenerationOutput(
        **{name: torch.cat(tensors) for name, tensors in parts.items()},
        prompt_lengths=torch.cat([out.prompt_lengths for out in outputs]),
        response_lengths=torch.cat([out.response_lengths for out in outputs]),
        micro_batches=tuple(work for out in outputs for work in out.micro_batches))
