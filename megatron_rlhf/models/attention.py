"""Core attention through torch's ``scaled_dot_product_attention``, as a megatron spec module.

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
offsets, sliding windows and packed sequences are left to megatron's own implementation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

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
        ``[sq, b, heads * dim]``; ``attention_mask`` broadcasts to ``[b, heads, sq, sk]``."""
        if not self._sdpa_applies(attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        repeats = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if repeats > 1:
            key = key.repeat_interleave(repeats, dim=2)
            value = value.repeat_interleave(repeats, dim=2)
        # [s, b, n, d] -> [b, n, s, d]
        query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        bias = None
        if attention_mask is not None:
            bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
            bias.masked_fill_(attention_mask, _MASKED_SCORE)
        elif query.shape[2] > 1:
            raise ValueError("SDPAttention needs an explicit attention mask for multi-token "
                             "queries (megatron_rlhf always passes causal + padding masks)")
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=bias,
                                                 scale=self.softmax_scale)
        # [b, n, sq, d] -> [sq, b, n * d]
        context = context.permute(2, 0, 1, 3).contiguous()
        return context.view(*context.shape[:2], self.hidden_size_per_partition)
