"""A KV cache of fixed shape whose rows (slots) each hold one sequence at its own position.

megatron's ``StaticInferenceContext`` keeps one ``sequence_len_offset`` for the whole batch, so
every row is at the same position and a step's keys grow by one each token. A
:class:`SlotInferenceContext` instead gives every slot its own write position (``positions``, a
``[slots]`` tensor updated in place), so a slot can be refilled with a new prompt while the
others decode, and a decode step has the same shapes at every token: it writes each slot's new
key at that slot's position and attends over the whole ``[max_length]`` cache under a key mask.
:class:`~megatron_rlhf.models.attention.CachedRopeSelfAttention` implements the attention side
(``_slot_key_value``); megatron's own forward runs unchanged around it.

Two kinds of call:

* prefill (:meth:`SlotInferenceContext.start_prefill`): ``[n, w]`` left-padded prompts written to
  positions ``0 .. w-1`` of the slots ``slots``; attention reads the call's own keys under the
  causal + padding mask the caller passes (as megatron's prefill does).
* decode (:meth:`SlotInferenceContext.start_decode`): one token per slot, ``[slots, 1]``, written
  at ``positions``; attention reads the first ``horizon`` positions of the cache (all of them
  unless the caller trims it) under the ``[slots, 1, 1, horizon]`` mask the caller passes.
"""

from __future__ import annotations

import torch
from megatron.core.inference.contexts import StaticInferenceContext


class SlotInferenceContext(StaticInferenceContext):
    """Per-slot positions over a ``[max_length, slots, groups, dim]`` KV memory per layer."""

    def __init__(self, slots: int, max_length: int, device: torch.device) -> None:
        """Allocate the positions; each layer allocates its keys and values at its first call.

        Args:
            slots: rows of the cache (the decode batch).
            max_length: positions per slot (prompt + response), also the RoPE table length.
            device: where the positions live (the model's device).
        """
        super().__init__(slots, max_length)
        self.positions = torch.zeros(slots, dtype=torch.long, device=device)
        """``[slots]``: the position the next decode token of each slot is written at."""
        self.prefill_slots: torch.Tensor | None = None
        self.horizon = max_length
        """Cache positions a decode step attends over (``0 .. horizon - 1``): the whole cache
        for a step of fixed shape; fewer when the caller knows no slot has written past them."""

    def start_prefill(self, slots: torch.Tensor) -> None:
        """The next model call writes prompts (left-padded, positions ``0 ..``) into ``slots``."""
        self.prefill_slots = slots
        self.enable_prefill_mode()

    def start_decode(self) -> None:
        """The next model calls feed one token per slot at ``positions``."""
        self.prefill_slots = None
        self.enable_decode_mode()

    def layer_memory(self, layer_number: int, allocate) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(keys, values)`` memory of a layer, allocated by ``allocate()`` the first time.

        Zeroed once: a decode step reads every position, and the positions no slot has written
        are masked by adding -10000 to their scores, which hides finite keys only.
        """
        if layer_number not in self.key_value_memory_dict:
            self.key_value_memory_dict[layer_number] = tuple(t.zero_() for t in allocate())
        return self.key_value_memory_dict[layer_number]

    def keep_slots(self, slots: torch.Tensor) -> None:
        """Keep only ``slots`` (in that order) as slots ``0 .. len(slots) - 1``.

        Layer by layer, so that the memory held at any moment exceeds the old cache by one
        layer's new keys and values only.
        """
        for layer_number, pair in self.key_value_memory_dict.items():
            self.key_value_memory_dict[layer_number] = tuple(
                t.index_select(1, slots) for t in pair)
        self.positions = self.positions[slots]
        self.max_batch_size = len(slots)

    def cache_bytes(self) -> int:
        """Bytes of the keys and values allocated so far."""
        return sum(t.untyped_storage().nbytes()
                   for pair in self.key_value_memory_dict.values() for t in pair)
