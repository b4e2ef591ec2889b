"""Attention modules of megatron's local spec: SDPA core attention, RoPE before the KV cache.

Core attention through torch's ``scaled_dot_product_attention``, as a megatron spec module.

megatron's local ``DotProductAttention`` materialises the ``[b, heads, s, s]`` score matrix and
runs softmax as separate kernels. :class:`SDPAttention` is the same module (same constructor,
same ``[s, b, heads, dim]`` inputs and ``[s, b, hidden]`` output) whose forward hands the work to
``torch.nn.functional.scaled_dot_product_attention``, which picks the fastest kernel the device
has for the inputs (on a GPU the memory-efficient kernel, which takes our explicit masks; on CPU
a fused loop). It is put into megatron's layer spec in place of ``DotProductAttention``
(``models.gpt``), so no megatron layer is forked.

Masking follows megatron's local attention: a masked score is pushed to -10000 (``True`` in
megatron's boolean mask means masked), so a query whose keys are all masked (a padding position)
gets finite outputs that no real token reads. Dropout inside attention, learnable softmax
offsets and sliding windows are left to megatron's own implementation.

Packed sequences (megatron's ``PackedSeqParams``, THD layout, ``models.packing``) take a separate
path, :func:`packed_causal_attention`: causal attention inside each sequence, with no mask. On
CPU it runs one causal SDPA call over the sequences right-padded to the longest, or, when that
padding would more than quadruple the attention work, SDPA once per sequence (``is_causal``, no
mask, K/V groups shared through ``enable_gqa``); per sequence was measured faster than the padded
batch's masked SDPA, than one SDPA over the packed row with a block-diagonal mask, and than eager
FlexAttention, and the one right-padded call faster than per-sequence calls for many short
sequences (``docs/results/packing.md``).
On a CUDA device with half-precision inputs it is torch's FlashAttention varlen kernel when that
torch has it.

:class:`CachedRopeSelfAttention` replaces megatron's ``SelfAttention`` in the same local spec so
that KV-cached decoding rotates each key once instead of the whole cache at every step, and so
that it can decode over a :class:`~megatron_rlhf.models.slot_cache.SlotInferenceContext` (each
row at its own position, shapes fixed for every step).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache, partial
from itertools import pairwise

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    _yarn_get_concentration_factor_from_config,
)
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

from megatron_rlhf.models.slot_cache import SlotInferenceContext

_MASKED_SCORE = -10000.0  # megatron's attention_mask_func


class SDPAttention(DotProductAttention):
    """megatron's local core attention computed by torch SDPA (see the module docstring)."""

    def _sdpa_applies(self, attention_bias, packed_seq_params) -> bool:
        dropout = self.attention_dropout.p if self.training else 0.0
        return (attention_bias is None and packed_seq_params is None and dropout == 0.0
                and self.softmax_offset is None and self.scale_mask_softmax.window_size is None)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None) -> torch.Tensor:
        """``[sq, b, heads, dim]`` queries, ``[sk, b, groups, dim]`` keys and values ->
        ``[sq, b, heads * dim]``; ``attention_mask`` broadcasts to ``[b, heads, sq, sk]``.
        With ``packed_seq_params`` (THD): ``[t, heads, dim]`` and ``[t, groups, dim]`` -> ``[t,
        heads * dim]``, and no mask."""
        if packed_seq_params is not None:
            if (attention_bias is not None or self.softmax_offset is not None
                    or self.scale_mask_softmax.window_size is not None):
                raise ValueError("packed sequences need attention without bias, softmax offsets "
                                 "or sliding windows; set models.packed_sequences=false")
            dropout = self.attention_dropout.p if self.training else 0.0
            with tensor_parallel.get_cuda_rng_tracker().fork():
                return packed_causal_attention(
                    query, key, value, packed_seq_params.cu_seqlens_q,
                    packed_seq_params.max_seqlen_q, self.softmax_scale, dropout)
        if not self._sdpa_applies(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        # [s, b, n, d] -> [b, n, s, d]
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        bias = None
        causal = False
        if attention_mask is not None:
            bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
            bias.masked_fill_(attention_mask, _MASKED_SCORE)
        elif query.shape[2] > 1:
            # no padding to hide (a prefill of prompts of one length): the fused causal kernel
            if attn_mask_type != AttnMaskType.causal or query.shape[2] != key.shape[2]:
                raise ValueError("SDPAttention needs an explicit attention mask for multi-token "
                                 "queries other than a causal self-attention over their own "
                                 f"keys (got {attn_mask_type}, {query.shape[2]} queries, "
                                 f"{key.shape[2]} keys)")
            causal = True
        groups = self.num_query_groups_per_partition
        grouped = groups != self.num_attention_heads_per_partition
        if grouped and query.shape[2] == 1 and (bias is None or bias.shape[1:3] == (1, 1)):
            # A decode step: the query heads sharing a key/value head become that head's
            # queries, [b, groups, heads / groups, d], one plain SDPA call under the same key
            # mask. A masked call with enable_gqa has no memory-efficient kernel before torch
            # 2.12 and would take the math kernel; this keeps the fused one and copies nothing.
            b, heads, _, dim = query.shape
            context = F.scaled_dot_product_attention(
                query.reshape(b, groups, heads // groups, dim), key, value, attn_mask=bias,
                scale=self.softmax_scale).reshape(b, heads, 1, dim)
        else:
            # enable_gqa: each group of query heads reads its shared key/value head in place
            # (no repeat_interleave copy of K and V)
            context = F.scaled_dot_product_attention(query, key, value, attn_mask=bias,
                                                     is_causal=causal, scale=self.softmax_scale,
                                                     enable_gqa=grouped)
        # [b, n, sq, d] -> [sq, b, n * d]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            cu_seqlens: torch.Tensor, max_seqlen: int,
                            scale: float | None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention inside each packed sequence.

    Args:
        query: ``[t, heads, dim]``.
        key: ``[t, groups, dim]``; ``heads`` a multiple of ``groups``.
        value: ``[t, groups, dim]``.
        cu_seqlens: ``[n + 1]`` int32, sequence ``i`` is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``.
        max_seqlen: the longest sequence.
        scale: softmax scale (None: ``1 / sqrt(dim)``).
        dropout: attention dropout probability.

    Returns:
        ``[t, heads * dim]``.
    """
    varlen = _flash_varlen()
    if (varlen is not None and dropout == 0.0 and query.is_cuda
            and query.dtype in (torch.bfloat16, torch.float16)):
        context = varlen(query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                         scale=scale)
        return context.reshape(context.shape[0], -1)
    bounds = cu_seqlens.tolist()
    lengths = [b - a for a, b in pairwise(bounds)]
    if len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= PADDED_WORK_LIMIT * sum(
            n * n for n in lengths):
        return _right_padded_causal_attention(query, key, value, lengths, scale, dropout)
    # [t, n, d] -> [1, n, t, d], sliced per sequence along t (CPU SDPA is several times
    # slower on batch-less 3-d inputs)
    query, key, value = (x[None].transpose(1, 2) for x in (query, key, value))
    contexts = [F.scaled_dot_product_attention(query[:, :, a:b], key[:, :, a:b], value[:, :, a:b],
                                               dropout_p=dropout, is_causal=True, scale=scale,
                                               enable_gqa=True)
                for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]
    context = torch.cat(contexts, dim=2)[0].transpose(0, 1)
    return context.reshape(context.shape[0], -1)


PADDED_WORK_LIMIT = 4
"""Packed sequences go through one batched SDPA call, each right-padded to the longest, when
that does at most this many times the per-sequence calls' attention work (``n * max_len^2``
against ``sum len^2``): many short sequences cost less as one fused call than as a call each."""


def _right_padded_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                   lengths: list[int], scale: float | None,
                                   dropout: float) -> torch.Tensor:
    """:func:`packed_causal_attention` as one SDPA call over ``[n, heads, max_len, dim]``.

    Each sequence sits at the start of its row, so under the causal mask a real query never sees
    a padding key (every padding key comes after it): no key mask is needed, and the padding
    queries' outputs are dropped when the real tokens are gathered back."""
    rows = torch.repeat_interleave(torch.arange(len(lengths), device=query.device),
                                   torch.tensor(lengths, device=query.device))
    starts = torch.tensor([0] + lengths[:-1], device=query.device).cumsum(0)
    columns = torch.arange(rows.numel(), device=query.device) - starts[rows]

    def padded(x: torch.Tensor) -> torch.Tensor:  # [t, n, d] -> [rows, n, max_len, d]
        out = x.new_zeros(len(lengths), max(lengths), *x.shape[1:])
        out = out.index_put((rows, columns), x)
        return out.transpose(1, 2)

    context = F.scaled_dot_product_attention(padded(query), padded(key), padded(value),
                                             dropout_p=dropout, is_causal=True, scale=scale,
                                             enable_gqa=True)
    context = context.transpose(1, 2)[rows, columns]
    return context.reshape(context.shape[0], -1)


@cache
def _flash_varlen() -> Callable[..., torch.Tensor] | None:
    """torch's causal FlashAttention varlen call on a CUDA machine, where this torch has one
    (``torch.nn.attention.varlen``; its causal argument changed between releases)."""
    if not torch.cuda.is_available():
        return None
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_call(varlen_attn)


def varlen_call(varlen_attn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor] | None:
    """``varlen_attn`` as a causal call taking grouped keys and values, whatever its release's
    arguments: ``window_size`` or ``is_causal`` for causality; without ``enable_gqa`` (torch
    2.10-2.11) the key and value heads are repeated to the query heads, which keeps the fused
    kernel rather than falling back to a loop over the sequences (a host sync per batch and a
    kernel per sequence). None when it cannot be made causal."""
    parameters = inspect.signature(varlen_attn).parameters
    if "window_size" in parameters:
        causal = partial(varlen_attn, window_size=(-1, 0))
    elif "is_causal" in parameters:
        causal = partial(varlen_attn, is_causal=True)
    else:
        return None
    if "enable_gqa" in parameters:
        return partial(causal, enable_gqa=True)

    def repeated(query, key, value, *args, **kwargs):
        repeats = query.shape[1] // key.shape[1]
        if repeats > 1:
            key, value = (x.repeat_interleave(repeats, dim=1) for x in (key, value))
        return causal(query, key, value, *args, **kwargs)

    return repeated


class CachedRopeSelfAttention(SelfAttention):
    """megatron's ``SelfAttention`` that rotates each key once, before it enters the KV cache.

    With megatron's static inference context, ``SelfAttention`` caches keys before RoPE and
    rotates the whole cache (and recomputes cos/sin of every position) at every decode step: the
    step's cost grows with the cached length, and at small models it is most of decoding. RoPE
    at a position depends on that position alone, so rotating the new query and key first and
    caching the rotated key yields the same keys. Everything else, and every call without a
    static inference context, is megatron's own code path.
    """

    _packed_positions: torch.Tensor | None = None
    """Set for the duration of a forward over packed sequences that carry their positions."""

    def forward(self, *args, packed_seq_params=None, **kwargs):
        """megatron's forward; over packed sequences with their positions
        (:class:`~megatron_rlhf.models.packing.PackedPositionParams`), RoPE is applied at those
        positions in one call per tensor, with no host read."""
        positions = getattr(packed_seq_params, "positions", None)
        if (positions is None or kwargs.get("inference_context") is not None
                or self.pg_collection.cp.size() != 1 or self.config.flash_decode):
            return super().forward(*args, packed_seq_params=packed_seq_params, **kwargs)
        self._packed_positions = positions
        try:
            return super().forward(*args, packed_seq_params=packed_seq_params, **kwargs)
        finally:
            self._packed_positions = None

    def _adjust_key_value_for_inference(self, inference_context, query: torch.Tensor,
                                        key: torch.Tensor, value: torch.Tensor, rotary_pos_emb,
                                        rotary_pos_cos=None, rotary_pos_sin=None,
                                        rotary_pos_cos_sin=None, sequence_len_offset=None,
                                        **kwargs):
        if self._packed_positions is not None and rotary_pos_emb is not None:
            # [t, 1, heads, d] packed queries and keys, each at its own sequence's position;
            # rotary_pos_emb=None: megatron's forward then applies no RoPE of its own
            if not isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
            query, key = (self._rotate(t, freqs[self._packed_positions])
                          for t, freqs in zip((query, key), rotary_pos_emb, strict=True))
            rotary_pos_emb = None
        if isinstance(inference_context, SlotInferenceContext):
            return self._slot_key_value(inference_context, query, key, value, rotary_pos_emb)
        if not self._rotates_before_caching(inference_context, rotary_pos_emb, rotary_pos_cos):
            return super()._adjust_key_value_for_inference(
                inference_context, query, key, value, rotary_pos_emb, rotary_pos_cos,
                rotary_pos_sin, rotary_pos_cos_sin, sequence_len_offset, **kwargs)
        if not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        start = inference_context.sequence_len_offset
        positions = slice(start, start + key.shape[0])
        query, key = (self._rotate(t, freqs[positions])
                      for t, freqs in zip((query, key), rotary_pos_emb, strict=True))
        # rotary_pos_emb=None: megatron's forward then applies no RoPE of its own
        return super()._adjust_key_value_for_inference(
            inference_context, query, key, value, None, rotary_pos_cos, rotary_pos_sin,
            rotary_pos_cos_sin, sequence_len_offset, **kwargs)

    def _slot_key_value(self, context: SlotInferenceContext, query: torch.Tensor,
                        key: torch.Tensor, value: torch.Tensor, rotary_pos_emb):
        """Rotate the new queries and keys at their slots' positions, write the keys and values
        into the slots' memory and return what attention reads (module docstring of
        ``models.slot_cache``): a prefill's own keys, or a decode step's whole cache."""
        keys, values = context.layer_memory(self.layer_number, lambda: tuple(
            self._allocate_memory(context.max_sequence_length, context.max_batch_size, size,
                                  t.dtype) for size, t in ((self.key_hidden_size, key),
                                                           (self.val_hidden_size, value))))
        prefill = context.prefill_slots is not None
        if rotary_pos_emb is not None:
            if not isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
            if prefill:  # positions 0 .. s-1 of every row
                freqs = [f[: key.shape[0]] for f in rotary_pos_emb]
            else:  # [L, 1, 1, d] -> each slot's own position, [1, slots, 1, d]
                freqs = [f[:, 0, 0][context.positions][None, :, None] for f in rotary_pos_emb]
            query, key = (self._rotate(t, f) for t, f in zip((query, key), freqs, strict=True))
        if prefill:
            keys[: key.shape[0]].index_copy_(1, context.prefill_slots, key)
            values[: value.shape[0]].index_copy_(1, context.prefill_slots, value)
            # causal over the call's own keys; padding, if any, comes as the explicit mask
            return query, key, value, None, AttnMaskType.causal, None
        at = (context.positions, torch.arange(key.shape[1], device=key.device))
        keys.index_put_(at, key[0])
        values.index_put_(at, value[0])
        h = context.horizon
        return query, keys[:h], values[:h], None, AttnMaskType.no_mask, None

    def _rotates_before_caching(self, inference_context, rotary_pos_emb,
                                rotary_pos_cos) -> bool:
        return (inference_context is not None and inference_context.is_static_batching()
                and rotary_pos_emb is not None and rotary_pos_cos is None
                and not self.config.flash_decode and self.pg_collection.cp.size() == 1)

    def _rotate(self, t: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        return apply_rotary_pos_emb(t, freqs, config=self.config,
                                    mscale=_yarn_get_concentration_factor_from_config(self.config),
                                    cp_group=self.pg_collection.cp)


@contextmanager
def as_megatron_self_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model``'s attention layers as megatron's own ``SelfAttention`` (same weights) for
    the duration: the reference that :class:`CachedRopeSelfAttention` is compared against."""
    layers = [m for m in model.modules() if isinstance(m, CachedRopeSelfAttention)]
    if not layers:
        raise ValueError("the model's spec has no CachedRopeSelfAttention layer to swap")
    for layer in layers:
        layer.__class__ = SelfAttention
    try:
        yield
    finally:
        for layer in layers:
            layer.__class__ = CachedRopeSelfAttention
