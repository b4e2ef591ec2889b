"""Grouped-query attention through SDPA (``enable_gqa``, or a decode step's query heads folded
into their key head's queries) gives the outputs of repeating K and V
per query head (the copy it replaces), for prefill masks and one-token decode queries."""

from __future__ import annotations

import inspect

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


def _fake_varlen(**flags):
    """A stand-in for torch's ``varlen_attn`` of one release: its arguments are ``flags``'
    names; like the real kernel without ``enable_gqa`` it refuses fewer key than query heads."""

    def attend(query, key, value, cu_q, cu_k, max_q, max_k, scale=None, **kwargs):
        assert set(kwargs) <= set(flags), kwargs
        assert kwargs.get("window_size", (-1, 0)) == (-1, 0) and kwargs.get("is_causal", True)
        if not kwargs.get("enable_gqa"):
            assert key.shape[1] == query.shape[1], "this release needs as many key heads"
        from megatron_rlhf.models.attention import packed_causal_attention

        return packed_causal_attention(query, key, value, cu_q, max_q, scale).view(
            query.shape)

    names = ["query", "key", "value", "cu_q", "cu_k", "max_q", "max_k"]
    attend.__signature__ = inspect.Signature(
        [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in names]
        + [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None)
           for name in ("scale", *flags)])
    return attend


@pytest.mark.parametrize("flags", [("window_size", "enable_gqa"), ("is_causal", "enable_gqa"),
                                   ("window_size",), ("is_causal",)],
                         ids=["window+gqa", "causal+gqa", "window", "causal"])
def test_every_varlen_release_stays_fused_for_grouped_queries(flags) -> None:
    from megatron_rlhf.models.attention import packed_causal_attention, varlen_call

    generator = torch.Generator().manual_seed(7)
    query = torch.randn(9, 4, 8, generator=generator)
    key, value = (torch.randn(9, 2, 8, generator=generator) for _ in range(2))
    cu_seqlens = torch.tensor([0, 4, 9], dtype=torch.int32)
    call = varlen_call(_fake_varlen(**dict.fromkeys(flags)))
    got = call(query, key, value, cu_seqlens, cu_seqlens, 5, 5, scale=None)
    expected = packed_causal_attention(query, key, value, cu_seqlens, 5, None)
    torch.testing.assert_close(got.reshape(9, -1), expected, rtol=0, atol=1e-6)
    assert varlen_call(_fake_varlen(enable_gqa=None)) is None  # no way to ask for causality
