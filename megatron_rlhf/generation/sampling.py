"""Token sampling from full-vocabulary logits: pure tensor functions, no process groups.

Randomness is counter-based: the uniform number that picks prompt ``i``'s token at step ``t`` is a
hash of ``(seed, i, t)`` (:func:`sampling_uniforms`), so it does not depend on the rank, the
data-parallel replica, the batch the prompt sits in, or on how many tokens were drawn before. A
token is drawn by inverting the cumulative distribution (in vocabulary order) at that number, which
needs exactly one uniform per prompt and step.

The sampling distribution is ``softmax(logits / temperature)``, restricted to the ``top_k`` most
likely tokens, then to the smallest most-likely set whose (renormalised) probability reaches
``top_p``, and renormalised; the same order as Hugging Face's and vLLM's samplers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rlhf.generation.params import GenerationConfig

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One round of the SplitMix64 finaliser (Steele et al. 2014): a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sampling_uniform(seed: int, prompt_index: int, step: int) -> float:
    """The uniform number in [0, 1) that draws ``prompt_index``'s token at ``step``."""
    key = _splitmix64(_splitmix64(_splitmix64(seed) ^ prompt_index) ^ step)
    return (key >> 11) * 2.0**-53


def _as_int64(value: int) -> int:
    """The signed 64-bit integer with the bits of unsigned ``value``."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN, _MIX1, _MIX2 = (_as_int64(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                                                 0x94D049BB133111EB))


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 tensors holding unsigned 64-bit values."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix64_tensor(x: torch.Tensor) -> torch.Tensor:
    """:func:`_splitmix64` elementwise on int64 tensors (two's-complement wrap-around is the
    unsigned arithmetic mod 2**64)."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


def prompt_noise_keys(seed: int, prompt_indices: Sequence[int] | torch.Tensor,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """Per-prompt keys ``[b]`` (int64) from which :func:`uniforms_at_step` draws each step."""
    indices = torch.as_tensor(prompt_indices, dtype=torch.int64, device=device)
    return _splitmix64_tensor(indices ^ _as_int64(_splitmix64(seed)))


def uniforms_at_step(keys: torch.Tensor, step: int) -> torch.Tensor:
    """The ``[b]`` float64 uniforms of step ``step`` for prompts with :func:`prompt_noise_keys`.

    Computed on the keys' device with no host work beyond launching the kernels, so a decode
    loop does not copy anything to the device per token.
    """
    return _shift_right(_splitmix64_tensor(keys ^ step), 11).double() * 2.0**-53


def uniforms_for_steps(keys: torch.Tensor, steps: int) -> torch.Tensor:
    """``[steps, b]`` float64: row ``t`` is :func:`uniforms_at_step` ``(keys, t)``, bitwise.

    One batch of integer kernels for a whole decode instead of a dozen tiny ones per token.
    """
    counters = torch.arange(steps, dtype=torch.int64, device=keys.device).unsqueeze(-1)
    return _shift_right(_splitmix64_tensor(keys ^ counters), 11).double() * 2.0**-53


def sampling_uniforms(seed: int, prompt_indices: Sequence[int], step: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """:func:`sampling_uniform` for every prompt of a batch, as a ``[b]`` float64 tensor."""
    return uniforms_at_step(prompt_noise_keys(seed, prompt_indices, device), step)


def top_k_top_p_keep(sorted_probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Which tokens of a descending-sorted distribution survive top-k, then top-p.

    Top-p keeps the smallest prefix whose probability (renormalised after top-k) is at least
    ``top_p``: a token stays when the mass strictly before it is below ``top_p``. The most likely
    token always stays.

    Args:
        sorted_probs: ``[..., v]`` probabilities sorted in descending order along the last dim.
        top_k: keep the first ``top_k`` (0: no limit).
        top_p: nucleus mass in (0, 1] (1: no limit).

    Returns:
        ``[..., v]`` bool, True where the token is kept.
    """
    positions = torch.arange(sorted_probs.shape[-1], device=sorted_probs.device)
    keep = torch.ones_like(sorted_probs, dtype=torch.bool)
    if top_k > 0:
        keep = keep & (positions < top_k)
    if top_p < 1.0:
        probs = sorted_probs.masked_fill(~keep, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
        mass_before = probs.cumsum(dim=-1) - probs
        keep = keep & (mass_before < top_p)
    return keep


def sampling_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0,
                      top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities of the distribution tokens are sampled from (``-inf`` where filtered).

    Args:
        logits: ``[b, v]`` logits over the real vocabulary.
        temperature: divides the logits first.
        top_k: see :func:`top_k_top_p_keep`.
        top_p: see :func:`top_k_top_p_keep`.

    Returns:
        ``[b, v]`` float32, log-softmax of the filtered, renormalised distribution.
    """
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    if top_k <= 0 and top_p >= 1.0:
        return logprobs
    # A stable sort breaks ties by token id, so top_k=1 keeps exactly the argmax.
    sorted_logprobs, order = logprobs.sort(dim=-1, descending=True, stable=True)
    keep_sorted = top_k_top_p_keep(sorted_logprobs.exp(), top_k, top_p)
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    filtered = logprobs.masked_fill(~keep, float("-inf"))
    return filtered - torch.logsumexp(filtered, dim=-1, keepdim=True)


def inverse_cdf_sample(logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Draw one token per row: the first token whose cumulative probability exceeds ``u``.

    Args:
        logprobs: ``[b, v]`` log-probabilities (``-inf`` for excluded tokens).
        uniforms: ``[b]`` numbers in [0, 1).

    Returns:
        ``[b]`` int64 token ids, never an excluded token.
    """
    cdf = logprobs.double().exp().cumsum(dim=-1)
    total = cdf[:, -1:]
    target = uniforms.to(cdf.device, torch.float64).unsqueeze(-1) * total
    tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total can round up to total; the last token with non-zero probability is the bound.
    last_positive = (cdf < total).sum(dim=-1)
    return torch.minimum(tokens, last_positive)


@dataclass
class SampledTokens:
    """One step's tokens and their log-probabilities, each ``[b]``."""

    tokens: torch.Tensor
    """Sampled token ids (int64)."""
    logprobs: torch.Tensor
    """Log-probability under the sampling distribution actually used (0 for greedy)."""
    policy_logprobs: torch.Tensor
    """Log-probability under ``softmax(logits / temperature)``, without top-k/top-p."""


def sample_tokens(logits: torch.Tensor, uniforms: torch.Tensor, config: GenerationConfig,
                  greedy_rows: torch.Tensor | None = None) -> SampledTokens:
    """Pick the next token of every row of ``logits`` as ``config`` says.

    Args:
        logits: ``[b, v]`` logits over the real vocabulary (no padded columns), identical on
            every rank that must agree on the tokens.
        uniforms: ``[b]`` float64 in [0, 1), one per row (ignored when greedy).
        config: temperature, top-k, top-p, greedy.
        greedy_rows: ``[b]`` bool, rows that take the argmax although ``config`` samples
            (:func:`greedy_row_mask`); None: none.

    Returns:
        The tokens with both kinds of log-probabilities.
    """
    policy = torch.log_softmax(logits.float() / config.temperature, dim=-1)
    if config.greedy:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.zeros(tokens.shape, dtype=torch.float32, device=logits.device)
    else:
        dist = policy
        if config.filters_distribution:
            dist = sampling_logprobs(logits, config.temperature, config.top_k, config.top_p)
        tokens = inverse_cdf_sample(dist, uniforms)
        if greedy_rows is not None:
            tokens = torch.where(greedy_rows, logits.argmax(dim=-1), tokens)
        logprobs = dist.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        if greedy_rows is not None:
            logprobs = logprobs.masked_fill(greedy_rows, 0.0)
        elif dist is policy:
            return SampledTokens(tokens=tokens, logprobs=logprobs, policy_logprobs=logprobs)
    policy_logprobs = policy.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return SampledTokens(tokens=tokens, logprobs=logprobs, policy_logprobs=policy_logprobs)


def greedy_row_mask(prompt_indices: Sequence[int], config: GenerationConfig,
                    device: torch.device | str = "cpu") -> torch.Tensor | None:
    """``[b]`` bool: the rows ``config.greedy_every`` decodes greedily (None when it is 0).

    Keyed by the prompt index, like the sampling noise, so a row is greedy or not whatever rank,
    replica or batch generates it.
    """
    if config.greedy or not config.greedy_every:
        return None
    indices = torch.as_tensor(prompt_indices, dtype=torch.int64, device=device)
    return indices % config.greedy_every == 0


def stop_sequence_tensors(config: GenerationConfig, device: torch.device | str
                          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``config.stop_sequences`` on ``device``, each as ``(ids [L], offsets [L] = 0 .. L-1)``
    for :func:`ends_with_stop_sequence` (made once, outside a decode step)."""
    return [(torch.tensor(list(ids), dtype=torch.long, device=device),
             torch.arange(len(ids), dtype=torch.long, device=device))
            for ids in config.stop_sequences]


def ends_with_stop_sequence(responses: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor,
                            sequences: Sequence[tuple[torch.Tensor, torch.Tensor]]
                            ) -> torch.Tensor:
    """``[b]`` bool: whether each row's response, of ``lengths`` tokens so far, ends with one of
    ``sequences`` (:func:`stop_sequence_tensors`). Fixed shapes and no host reads, so a captured
    decode step can run it.

    Args:
        responses: ``[n, W]`` response tokens, a row's first at column 0.
        rows: ``[b]`` the rows of ``responses`` to check.
        lengths: ``[b]`` (or a scalar) tokens each of those rows holds, the last one included.
        sequences: the stop sequences; a sequence longer than a response does not match it.
    """
    ends = torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
    for ids, offsets in sequences:
        start = lengths - len(ids)
        columns = (start.reshape(-1, 1) + offsets).clamp(min=0)
        window = responses[rows.reshape(-1, 1), columns]
        ends = ends | ((window == ids).all(dim=1) & (start >= 0))
    return ends
