"""Grouped-query attention through SDPA's ``enable_gqa`` gives the outputs of repeating K and V
per query head (the copy it replaces), for prefill masks and one-token decode queries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rlhf.models.attention import SDPAttention


def _repeated_reference(query, key, value, mask, scale) -> torch.Tensor:
    """Attention with K and V copied once per query head (what SDPAttention did before)."""
    repeats = query.shape[2] // key.shape[2]
    key, value = (t.repeat_interleave(repeats, dim=2) for t in (key, value))
    query, key, value = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    bias = torch.zeros(mask.shape).masked_fill_(mask, -10000.0)
    context = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, scale=scale)
    context = context.permute(2, 0, 1, 3)
    return context.reshape(*context.shape[:2], -1)


def _bare_attention(heads: int, groups: int, dim: int) -> SDPAttention:
    attention = SDPAttention.__new__(SDPAttention)
    torch.nn.Module.__init__(attention)
    attention.num_attention_heads_per_partition = heads
    attention.num_query_groups_per_partition = groups
    attention.hidden_size_per_partition = heads * dim
    attention.softmax_scale = dim ** -0.5
    attention._sdpa_applies = lambda *args: True
    return attention


@pytest.mark.parametrize("sq,sk", [(7, 7), (1, 11)], ids=["prefill", "decode"])
@pytest.mark.parametrize("heads,groups", [(4, 2), (6, 1), (4, 4)])
def test_sdpa_gqa_equals_repeated_keys_and_values(sq: int, sk: int, heads: int,
                                                  groups: int) -> None:
    generator = torch.Generator().manual_seed(heads * 10 + groups)
    b, dim = 3, 8
    query = torch.randn(sq, b, heads, dim, generator=generator)
    key, value = (torch.randn(sk, b, groups, dim, generator=generator) for _ in range(2))
    padding = torch.tensor([[True] * 2 + [False] * (sk - 2), [False] * sk,
                            [True] + [False] * (sk - 1)])[:, None, None, :]
    causal = torch.ones(sq, sk, dtype=torch.bool).triu(sk - sq + 1)
    mask = padding | causal
    ours = _bare_attention(heads, groups, dim).forward(query, key, value, mask)
    reference = _repeated_reference(query, key, value, mask, dim ** -0.5)
    assert ours.shape == (sq, b, heads * dim)
    torch.testing.assert_close(ours, reference, rtol=1e-6, atol=1e-6)


def test_an_unpadded_prefill_without_a_mask_is_the_causal_masked_one() -> None:
    """A prefill of prompts of one length passes no mask: the fused causal kernel gives what
    the explicit causal mask gave; anything but causal self-attention over its own keys is
    refused rather than attended unmasked."""
    from megatron.core.transformer.enums import AttnMaskType

    generator = torch.Generator().manual_seed(3)
    s, b, heads, groups, dim = 6, 2, 4, 2, 8
    query = torch.randn(s, b, heads, dim, generator=generator)
    key, value = (torch.randn(s, b, groups, dim, generator=generator) for _ in range(2))
    attention = _bare_attention(heads, groups, dim)
    causal_mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None]
    fused = attention.forward(query, key, value, None, AttnMaskType.causal)
    torch.testing.assert_close(fused, attention.forward(query, key, value, causal_mask),
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="explicit attention mask"):
        attention.forward(query, key, value, None, AttnMaskType.no_mask)
    with pytest.raises(ValueError, match="explicit attention mask"):
        attention.forward(query[:3], key, value, None, AttnMaskType.causal)
