"""Packed sequences: a micro-batch's real tokens back to back, without padding (THD layout).

A padded micro-batch ``[b, s]`` (left-padded prompts, right-padded responses, or right-padded
supervised rows) becomes one row of its real tokens, ``[1, t]``, with megatron's
``PackedSeqParams`` (``qkv_format="thd"``, cumulative sequence lengths) telling attention and
RoPE where each sequence starts: RoPE positions restart at every sequence
(``rope_utils._apply_rotary_pos_emb_thd``) and attention stays inside it
(``models.attention.packed_causal_attention``, or TE's ``thd`` kernels). The model then computes
no padding at all; :meth:`PackedRows.unpack` puts its output back at the padded positions (zeros
elsewhere, which every loss masks), so the losses and result pickers read ``[b, s, ...]`` as before.

Every micro-batch of one schedule call is packed to the same length (the call's most real tokens,
rounded up to a multiple of ``multiple``): pipeline stages exchange activations of one shape, and
sequence parallelism splits the packed row over the TP ranks. The tail past the real tokens is one
more sequence of padding whose outputs are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from megatron.core.packed_seq_params import PackedSeqParams


@dataclass
class PackedPositionParams(PackedSeqParams):
    """megatron's THD parameters with each token's position inside its own sequence, computed
    once per micro-batch: attention rotates the packed queries and keys at these positions in
    one call (:class:`~megatron_rlhf.models.attention.CachedRopeSelfAttention`) instead of
    megatron's unfused THD RoPE, which reads the sequence lengths back to the host (``tolist``
    and an ``item`` per sequence) for the queries and the keys of every layer."""

    positions: torch.Tensor | None = None
    """``[t]`` int64 positions, 0 at each sequence's first token."""


@dataclass
class PackedRows:
    """One micro-batch packed into a single row.

    Attributes:
        input_ids: ``[1, t]`` the real tokens of every row in order, then the padding tail.
        position_ids: ``[1, t]`` each token's position inside its own sequence.
        params: megatron's THD parameters (cu_seqlens over the rows with tokens, and the tail).
        index: ``[n]`` where each of the ``n`` real tokens sits in the flattened ``[b * s]``
            padded micro-batch.
        shape: ``(b, s)`` of the padded micro-batch.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    params: PackedSeqParams
    index: torch.Tensor
    shape: tuple[int, int]

    def unpack(self, output: torch.Tensor) -> torch.Tensor:
        """``[1, t, c]`` model output -> ``[b, s, c]``, zeros at the padded positions."""
        rows, seq = self.shape
        real = output[0, :self.index.numel()]
        padded = real.new_zeros(rows * seq, *real.shape[1:])
        return padded.index_copy(0, self.index, real).view(rows, seq, *real.shape[1:])


def real_tokens(attention_mask: torch.Tensor) -> int:
    """Real (unmasked) tokens of a ``[b, s]`` validity mask."""
    return int(attention_mask.count_nonzero())


def host_masks(attention_masks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Boolean host copies of a schedule call's ``[b, s]`` validity masks, in one
    device-to-host copy for all of them.

    The packing layout (:func:`packed_length`, :func:`pack_rows`) is computed from these: on the
    device each of its data-dependent shapes (lengths, ``nonzero``, boolean indexing) would be a
    host sync of its own.
    """
    flat = torch.cat([mask.reshape(-1).bool() for mask in attention_masks]).cpu()
    parts = flat.split([mask.numel() for mask in attention_masks])
    return [part.view(mask.shape) for part, mask in zip(parts, attention_masks, strict=True)]


def packed_length(attention_masks: Sequence[torch.Tensor], multiple: int = 1) -> int:
    """The one packed length of a schedule call: its micro-batches' most real tokens, rounded up
    to a multiple of ``multiple`` (the TP size under sequence parallelism). Give host masks
    (:func:`host_masks`): a device mask costs a host sync each."""
    most = max(real_tokens(mask) for mask in attention_masks)
    return -(-max(most, 1) // multiple) * multiple


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, length: int) -> PackedRows:
    """Pack the real tokens of ``[b, s]`` rows into one row of ``length`` tokens.

    A row's real tokens must be contiguous (padding only before and after them), which is how
    every batch of the project is laid out; positions then count from each row's first real
    token. RoPE depends on relative positions only, so the outputs equal the padded forward's.

    The layout (token index, positions, cu_seqlens) is computed on the host from
    ``attention_mask``, which should be a host copy (:func:`host_masks`; a device mask is copied
    here, one transfer), and then copied to ``input_ids``' device without waiting on it.

    Raises:
        ValueError: the rows hold more than ``length`` real tokens, or a row's real tokens are
            not contiguous.
    """
    valid = attention_mask.bool().cpu()
    lengths = valid.sum(dim=1)
    total = int(lengths.sum())
    if total > length:
        raise ValueError(f"{total} real tokens do not fit a packed row of {length}")
    rows, seq = valid.shape
    columns = torch.arange(seq).expand(rows, seq)
    first = torch.where(valid, columns, seq).min(dim=1).values
    last = torch.where(valid, columns, -1).max(dim=1).values
    if bool(((last - first + 1).clamp(min=0) != lengths).any()):
        raise ValueError("packed sequences need each row's real tokens contiguous (padding only "
                         "before and after them); set models.packed_sequences=false for others")
    index = valid.flatten().nonzero().squeeze(1)
    starts = torch.repeat_interleave(first, lengths)
    tail = length - total
    positions = torch.cat([columns.flatten()[index] - starts, torch.arange(tail)])
    seqlens = lengths[lengths > 0]
    if tail:
        seqlens = torch.cat([seqlens, seqlens.new_tensor([tail])])
    cu_seqlens = torch.zeros(seqlens.numel() + 1, dtype=torch.int32)
    cu_seqlens[1:] = seqlens.cumsum(0)
    max_seqlen = int(seqlens.max())
    device = input_ids.device
    index, positions, cu_seqlens = (x.to(device, non_blocking=True)
                                    for x in (index, positions, cu_seqlens))
    packed_ids = torch.cat([input_ids.flatten()[index], input_ids.new_zeros(tail)])
    params = PackedPositionParams(qkv_format="thd", cu_seqlens_q=cu_seqlens,
                                  cu_seqlens_kv=cu_seqlens, max_seqlen_q=max_seqlen,
                                  max_seqlen_kv=max_seqlen, positions=positions)
    return PackedRows(packed_ids[None], positions[None], params, index, (rows, seq))
