"""Settings of one generation call, validated when constructed."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class GenerationConfig:
    """How responses are sampled.

    The filters apply in the order temperature, top-k, top-p; ``greedy`` ignores all three when
    choosing a token (``temperature`` still sets the policy log-probs, see
    :class:`~megatron_rlhf.generation.generate.GenerationOutput`).
    """

    max_new_tokens: int = 64
    """Most response tokens per prompt, >= 0; a prompt also stops at the model's ``seq_length``."""
    temperature: float = 1.0
    """Softmax temperature, > 0: logits are divided by it before filtering and sampling."""
    top_k: int = 0
    """Keep only the ``top_k`` most likely tokens, >= 0; 0 disables the filter."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest most-likely set whose probability reaches ``top_p``,
    in (0, 1]; 1 disables the filter."""
    greedy: bool = False
    """Take the most likely token (ties: the lowest id) instead of sampling."""
    greedy_every: int = 0
    """While sampling, rows whose prompt index is a multiple of ``greedy_every`` take the argmax
    instead, >= 0 (0: none). With ``rollout.samples_per_prompt = n``, ``n`` makes the first
    response of every prompt the greedy one, so PPO also trains on (and its reward model
    scores) the answers greedy decoding gives. Their ``response_logprobs`` are 0 (a point mass);
    their policy log-probs are the policy's."""
    seed: int = 0
    """Seed of the sampling noise, >= 0; a prompt's noise depends on (seed, prompt index, step)
    only, never on the rank, the replica or the batch it is generated in."""
    stop_at_eos: bool = True
    """Stop a sequence after it emits ``eos_id`` (the EOS token is part of the response)."""
    stop_sequences: list[list[int]] = field(default_factory=list)
    """Token-id sequences that also end a response: a response stops right after its sampled
    tokens end with one of them (the sequence is part of the response), whatever
    ``stop_at_eos``. Each holds at least one id in the vocabulary. Multi-turn episodes with
    tools add the ids of the tool call's end tag (``</tool_call>``) to these, so a reply that
    calls a tool stops decoding there."""
    use_kv_cache: bool = True
    """Decode with megatron's static KV cache; False recomputes the whole sequence every step
    (the reference path, much slower)."""
    micro_batch_size: int = 0
    """Prompts decoded together, >= 0 (0: all prompts of a call at once). The KV cache holds
    ``micro_batch_size x (prompt + max_new_tokens)`` positions per layer, so this bounds
    generation memory; results do not depend on it."""
    stop_check_interval: int = 8
    """Decode steps between checks whether every sequence has stopped, >= 1. Each check makes
    the host wait for the device; up to ``stop_check_interval - 1`` steps may run after the last
    sequence stopped (they only write padding)."""
    compile_decode: bool = False
    """Run the KV-cached decode steps (one new token per row) through
    ``torch.compile(model, dynamic=True)``; the prefill and every pass outside generation stay
    eager. Fewer, fused ops per step: at ``benchmarks/ppo_step.py``'s shape on CPU 1.6x a decode
    step, 1.4x a ``generate_sequences`` call and 1.2x the generate stage of ``run_ppo``
    (docs/results/ppo-step-speed.md). The fused kernels round differently, so log-probs differ from
    the eager path at rounding level (up to 1e-6 measured) and a token can differ where a
    sampling uniform falls that close to a boundary; hence off by default. The first call
    compiles (about 7 s on a 2-core CPU with torch's compile cache warm, 25 s cold). Needs
    ``use_kv_cache``."""

    batching: str = "continuous"
    """How prompts share the decode batch. ``continuous``: ``micro_batch_size`` slots (all
    prompts, rounded up to a power of two, when 0) decode together with a step of fixed shape,
    a slot whose sequence ended takes the next waiting prompt at the next stop check, and once
    no prompt waits the slots shrink to the power-of-two bucket of those still decoding.
    ``static``: the reference loop, ``micro_batch_size`` prompts at a time, each micro-batch
    decoding until its longest sequence ends. Both give every prompt the same tokens (their
    log-probs agree to rounding). ``continuous`` needs the local layer spec; with
    ``use_kv_cache=False`` the static loop runs."""
    cuda_graphs: str = "auto"
    """``auto``: with ``batching=continuous`` on a CUDA device, capture the decode step into a
    CUDA graph for each slot count it decodes at (the slots shrink as prompts run out) and
    replay it per token, except for a model whose step cannot be captured (a mixture of experts:
    megatron's token dispatch synchronises with the host), which decodes eagerly and says so
    once in the log; ``on``: the same, but such a model is a configuration error; ``off``: run
    the step eagerly. On CPU the step runs eagerly (the tests set
    ``MEGATRON_RLHF_EMULATE_CUDA_GRAPHS=1`` to run the capture path through a checking
    stand-in graph: ``testing/graph_standin.py``)."""

    def __post_init__(self) -> None:
        """Checks every field.

        Raises:
            ValueError: naming the field, its value and what to set instead.
        """
        _require(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
                 f"generation.max_new_tokens={self.max_new_tokens!r} must be an int >= 0")
        _require(math.isfinite(self.temperature) and self.temperature > 0,
                 f"generation.temperature={self.temperature} must be > 0; "
                 "for argmax decoding set greedy=True instead")
        _require(isinstance(self.top_k, int) and self.top_k >= 0,
                 f"generation.top_k={self.top_k!r} must be an int >= 0 (0 disables it)")
        _require(0.0 < self.top_p <= 1.0,
                 f"generation.top_p={self.top_p} must be in (0, 1] (1 disables it)")
        _require(isinstance(self.greedy_every, int) and self.greedy_every >= 0,
                 f"generation.greedy_every={self.greedy_every!r} must be an int >= 0 (0: every "
                 "row samples)")
        _require(isinstance(self.seed, int) and self.seed >= 0,
                 f"generation.seed={self.seed!r} must be an int >= 0")
        _require(all(len(ids) > 0 and all(isinstance(i, int) and i >= 0 for i in ids)
                     for ids in self.stop_sequences),
                 f"generation.stop_sequences={self.stop_sequences!r} must be lists of token "
                 "ids >= 0, each holding at least one id")
        _require(isinstance(self.micro_batch_size, int) and self.micro_batch_size >= 0,
                 f"generation.micro_batch_size={self.micro_batch_size!r} must be an int >= 0 "
                 "(0 decodes all prompts of a call together)")
        _require(isinstance(self.stop_check_interval, int) and self.stop_check_interval >= 1,
                 f"generation.stop_check_interval={self.stop_check_interval!r} must be an "
                 "int >= 1")
        _require(isinstance(self.compile_decode, bool),
                 f"generation.compile_decode={self.compile_decode!r} must be true or false")
        _require(not self.compile_decode or self.use_kv_cache,
                 "generation.compile_decode=True compiles the KV-cached decode step; it needs "
                 "use_kv_cache=True (got use_kv_cache=False)")
        _require(self.batching in ("continuous", "static"),
                 f"generation.batching={self.batching!r} must be 'continuous' or 'static'")
        _require(self.cuda_graphs in ("auto", "on", "off"),
                 f"generation.cuda_graphs={self.cuda_graphs!r} must be 'auto', 'on' or 'off'")
        _require(self.cuda_graphs != "on" or self.continuous,
                 "generation.cuda_graphs=on captures the continuous loop's decode step; it needs "
                 f"batching=continuous and use_kv_cache=True (got batching={self.batching!r}, "
                 f"use_kv_cache={self.use_kv_cache})")

    @property
    def continuous(self) -> bool:
        """Whether the continuous-batching loop runs (``batching``; it decodes through the KV
        cache, so ``use_kv_cache=False`` runs the static loop)."""
        return self.batching == "continuous" and self.use_kv_cache

    @property
    def filters_distribution(self) -> bool:
        """Whether top-k or top-p changes the distribution tokens are sampled from."""
        return self.top_k > 0 or self.top_p < 1.0
