"""Next-token logits of a batch of left-padded sequences, with or without megatron's KV cache.

Both paths take the whole sequence so far (``input_ids`` and its 0/1 ``attention_mask``, ``[b, s]``)
and return the full-vocabulary logits of the last position, ``[b, real_vocab_size]`` float32,
identical on every TP rank of the model.

* :class:`CachedNextTokenLogits` runs the model directly with megatron's
  ``StaticInferenceContext``, the way megatron's text-generation controller and GPT inference
  wrapper do: one prefill forward over the prompts, then one forward per new token, advancing
  ``sequence_len_offset`` by the number of tokens fed after each call (``batch_size_offset`` stays
  0: the whole batch is one micro-batch). megatron's own controller right-pads prompts and feeds
  one shared causal mask; it cannot express per-sequence left padding, so an explicit boolean mask
  is passed instead: ``[b, 1, s, s]`` causal + key padding for the prefill, ``[b, 1, 1, kv_len]``
  key padding for a decode step (the new token attends to every earlier real token). megatron's
  static-batching attention applies a given mask unchanged, so the cached and the recomputed
  paths see the same keys. With an inference context megatron requires
  ``runtime_gather_output=True`` and then all-gathers the last position's logits over TP.
* :class:`RecomputeNextTokenLogits` runs a full forward over the whole sequence every step (the
  reference), and all-gathers the last position's vocabulary shards with megatron's
  ``gather_from_tensor_model_parallel_region``.

RoPE positions are ``0..s-1`` of the padded row (megatron's local layer spec ignores
``position_ids``); rotary attention depends on relative positions only, so left padding does not
change a real token's output.
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

from megatron_rlhf.models.forward_backward import causal_padding_mask


def _positions(start: int, length: int, batch_size: int, device: torch.device) -> torch.Tensor:
    return torch.arange(start, start + length, device=device).expand(batch_size, length)


class RecomputeNextTokenLogits:
    """Full recomputation of the sequence at every step (no cache)."""

    def __init__(self, model: torch.nn.Module, pg_collection: ProcessGroupCollection,
                 real_vocab_size: int, has_value_channel: bool) -> None:
        """Prepare the reference path.

        Args:
            model: this rank's (TP shard of the) GPT model, in eval mode.
            pg_collection: the model's process groups.
            real_vocab_size: columns at or past it are dropped (vocabulary padding, and
                embedding rows past the tokenizer: ``model.token_vocab_size``).
            has_value_channel: the model's output carries an AC-Share value channel last.
        """
        self.model = model
        self.tp_group = pg_collection.tp
        self.real_vocab_size = real_vocab_size
        self.has_value_channel = has_value_channel

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[b, real_vocab_size]`` of the last position of ``input_ids`` ``[b, s]``."""
        b, s = input_ids.shape
        output = self.model(input_ids, _positions(0, s, b, input_ids.device),
                            causal_padding_mask(attention_mask))
        last = output[:, -1]
        if self.has_value_channel:
            last = last[:, :-1]
        if self.tp_group.size() > 1:
            last = gather_from_tensor_model_parallel_region(last.contiguous(), group=self.tp_group)
        return last[:, : self.real_vocab_size].float()


class CachedNextTokenLogits:
    """Prefill once, then feed one token per call through megatron's static KV cache."""

    def __init__(self, model: torch.nn.Module, batch_size: int, max_length: int,
                 real_vocab_size: int, decode_model: torch.nn.Module | None = None) -> None:
        """Allocate the inference context (megatron allocates the KV memory at the first call).

        Args:
            model: this rank's (TP shard of the) GPT model, in eval mode.
            batch_size: rows of every call.
            max_length: longest sequence (prompt + response) the cache must hold.
            real_vocab_size: columns at or past it are dropped (vocabulary padding, and
                embedding rows past the tokenizer: ``model.token_vocab_size``).
            decode_model: runs the one-token calls after the prefill (``model`` itself when
                None; a compiled ``model`` under ``GenerationConfig.compile_decode``).
        """
        self.model = model
        self.decode_model = model if decode_model is None else decode_model
        self.context = StaticInferenceContext(batch_size, max_length)
        self.real_vocab_size = real_vocab_size

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Logits ``[b, real_vocab_size]`` of the last position of ``input_ids`` ``[b, s]``.

        The first call encodes the whole ``input_ids``; each later call must extend the previous
        one by exactly one token and encodes only that token.

        Raises:
            ValueError: a later call does not add exactly one token.
        """
        b, s = input_ids.shape
        offset = self.context.sequence_len_offset
        if offset == 0:
            tokens, mask = input_ids, causal_padding_mask(attention_mask)
        elif s == offset + 1:
            tokens, mask = input_ids[:, -1:], ~attention_mask.bool()[:, None, None, :]
        else:
            raise ValueError(f"the KV cache holds {offset} positions; the next call must pass "
                             f"{offset + 1} tokens, not {s}")
        model = self.model if offset == 0 else self.decode_model
        output = model(tokens, _positions(offset, tokens.shape[1], b, input_ids.device), mask,
                       inference_context=self.context, runtime_gather_output=True)
        self.context.increment_sequence_len_offset(tokens.shape[1])
        self.context.enable_decode_mode()
        # materialize_only_last_token_logits: megatron returns [b, 1, padded vocab (+ value)].
        return output[:, -1, : self.real_vocab_size].float()

    def cache_bytes(self) -> int:
        """Bytes of the keys and values megatron has allocated for this context."""
        return sum(tensor.untyped_storage().nbytes()
                   for pair in self.context.key_value_memory_dict.values() for tensor in pair)
