"""Model FLOPs: the one count that the planner's stage times and the engine's MFU metrics share.

    forward_flops(arch, tokens, mean_context)   # tokens that each attend mean_context positions
    sequence_flops(arch, [l1, l2, ...])         # whole causal sequences of these lengths

A matrix product of ``[m, k]`` by ``[k, n]`` costs ``2 m n k`` FLOPs, so a forward pass costs 2
FLOPs per token for every weight of a matrix product the token passes through
(:func:`matmul_weights`):

- attention: the QKV projection ``h x (q + 2 kv)`` (grouped-query attention: ``kv`` is
  ``num_query_groups x head_dim``, ``q`` is ``heads x head_dim``) and the output projection
  ``q x h``;
- the MLP (``ArchSpec.mlp_params(active=True)``): the dense MLP (2 matrices ``h x ffn``, 3 for
  SwiGLU), or of a mixture-of-experts layer the router ``h x num_experts``, the ``topk`` routed
  experts of width ``ffn_e`` and the shared expert; the experts a token skips cost nothing;
- the output layer: the vocabulary projection ``h x V`` over the model's own vocabulary (not
  Megatron's padding), or a scalar value head ``h x 1``.

Per layer and token, the attention scores ``Q K^T`` and their weighting of ``V`` cost ``2 q c``
each over the ``c`` positions the token attends. Attention is causal: a whole sequence of ``l``
tokens attends ``l^2 / 2`` positions (mean context ``l / 2``, FlashAttention's convention), a
decoded token its context. Not counted: the embedding lookup (no product), norms, softmax, RoPE
and the element-wise ops.

A backward pass costs twice its forward: a training pass is :data:`TRAINING_PASSES` forward
equivalents (:data:`FROZEN_BASE_TRAINING_PASSES` when LoRA leaves the weights' gradients out);
full recomputation adds one forward (:data:`RECOMPUTED_TRAINING_PASSES`), which the
planner's times count and the model FLOPs of an MFU do not. :func:`training_passes` says which,
for the planner and the MFU metrics alike.
"""

from __future__ import annotations

from collections.abc import Iterable

from megatron_rlhf.topology.models import ArchSpec

FORWARD_PASSES = 1
"""Forward equivalents of a forward-only pass (log-probs, values, rewards, generation)."""
TRAINING_PASSES = 3
"""Forward equivalents of a training pass: the forward, and a backward of twice its FLOPs (the
gradients of the activations and of the weights)."""
RECOMPUTED_TRAINING_PASSES = 4
"""A training pass under full activation recomputation: each layer's forward runs again."""
FROZEN_BASE_TRAINING_PASSES = 2
"""Forward equivalents of a training pass of a frozen base with LoRA adapters (``models.lora``):
the forward and the gradients of the activations, no weight gradient; the adapters' own products
(``rank`` wide) are left out. Full recomputation adds one forward as above."""


def training_passes(frozen_base: bool = False, recomputed: bool = False) -> int:
    """Forward equivalents of a training pass: :data:`TRAINING_PASSES`, or
    :data:`FROZEN_BASE_TRAINING_PASSES` when the model trains LoRA adapters on a frozen base
    (a value head trained in full beside them is left in the frozen count: ``h`` weights); one
    forward more under full recomputation (``recomputed``), which the planner's times count and
    the model FLOPs of an MFU do not."""
    passes = FROZEN_BASE_TRAINING_PASSES if frozen_base else TRAINING_PASSES
    return passes + (RECOMPUTED_TRAINING_PASSES - TRAINING_PASSES if recomputed else 0)


def attention_weights(arch: ArchSpec) -> int:
    """Weights of one layer's attention projections: ``h (q + 2 kv) + q h``."""
    h, q, kv = arch.hidden_size, arch.query_width, arch.kv_width
    return h * (q + 2 * kv) + q * h


def output_weights(arch: ArchSpec, value_head: bool = False) -> int:
    """Weights of the output layer: ``h V`` for the vocabulary projection, ``h`` for a scalar
    value head (critic, reward)."""
    return arch.hidden_size * (1 if value_head else arch.vocab_size)


def matmul_weights(arch: ArchSpec, value_head: bool = False) -> int:
    """Weights of every matrix product one token passes through: attention and the MLP of each
    layer (of a mixture-of-experts layer the router, ``topk`` routed experts and the shared
    expert), and the output layer."""
    per_layer = attention_weights(arch) + arch.mlp_params(active=True)
    return arch.num_layers * per_layer + output_weights(arch, value_head)


def forward_flops(arch: ArchSpec, tokens: float, mean_context: float,
                  value_head: bool = False) -> float:
    """FLOPs of a forward pass over ``tokens`` tokens that each attend ``mean_context`` tokens.

    ``tokens * (2 * matmul_weights + 4 * layers * q * mean_context)``; for whole causal sequences
    of length ``s`` the mean context is ``s / 2`` (:func:`sequence_flops`).
    """
    attention = 4 * arch.num_layers * arch.query_width * mean_context
    return tokens * (2 * matmul_weights(arch, value_head) + attention)


def sequence_flops(arch: ArchSpec, lengths: Iterable[float], value_head: bool = False) -> float:
    """FLOPs of a forward pass over whole causal sequences of ``lengths`` real tokens each.

    The ``sum(l)`` tokens attend ``sum(l^2) / 2`` positions in all, so their mean context is
    ``sum(l^2) / (2 sum(l))``: ``s / 2`` when every sequence has ``s`` tokens.
    """
    lengths = [float(length) for length in lengths]
    tokens = sum(lengths)
    if tokens == 0:
        return 0.0
    mean_context = sum(length * length for length in lengths) / (2 * tokens)
    return forward_flops(arch, tokens, mean_context, value_head)
