"""Transformer Engine's core attention taking packed sequences as well as explicit masks.

Our TE layers are built with ``attn_mask_type=arbitrary`` (``gpt.with_explicit_attention_masks``)
so that the padded forwards of generation apply their causal + padding mask. A packed forward
(``models.packing``) has no mask but sequence boundaries, for which TE's fused ``thd`` kernels
take ``padding_causal``; the subclass below switches the mask type per call. Built on first use:
TE is importable on CUDA machines only.
"""

from __future__ import annotations

from functools import cache

from megatron.core.transformer.enums import AttnMaskType


@cache
def packed_te_core_attention() -> type:
    """megatron's ``TEDotProductAttention`` whose packed calls run causal within each sequence."""
    from megatron.core.extensions.transformer_engine import TEDotProductAttention

    class TEPackedDotProductAttention(TEDotProductAttention):
        def forward(self, query, key, value, attention_mask, attn_mask_type,
                    attention_bias=None, packed_seq_params=None, num_splits=None):
            if packed_seq_params is not None and attn_mask_type == AttnMaskType.arbitrary:
                attn_mask_type, attention_mask = AttnMaskType.padding_causal, None
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params, num_splits)

    return TEPackedDotProductAttention
