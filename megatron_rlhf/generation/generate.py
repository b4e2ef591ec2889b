"""``generate_sequences``: batched autoregressive sampling from a Megatron-Core GPT model.

    out = generate_sequences(model, pg_collection, prompts, prompt_indices,
                             GenerationConfig(max_new_tokens=128, temperature=1.0, seed=step),
                             eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)

Layout of one batch of ``b`` prompts, longest prompt ``P``, response budget ``R``::

    input_ids       [b, P + R]   prompt left-padded to P | response right-padded to R
    attention_mask  [b, P + R]   1 on real prompt and response tokens
    prompt_mask     [b, P]       1 on real prompt tokens
    response_mask   [b, R]       1 on generated tokens (EOS included)

Two decode loops (``generation.batching``): ``continuous`` (the default, ``continuous.py``) keeps
a fixed set of slots full, prefilling a waiting prompt into the slot of one that ended, with a
decode step of fixed shape (CUDA graphs on a GPU); ``static`` (the reference) decodes
``micro_batch_size`` prompts at a time until the longest of them ends. Both draw the same tokens
for every prompt. Each static micro-batch is padded to its own longest prompt, so the output also
records what each ran (``GenerationOutput.micro_batches``: rows, prompt width, model calls),
which is what a FLOP count needs.

Parallelism: every TP rank of the model calls this with the same prompts and gets the same tokens
(the last position's logits are all-gathered over TP and sampled identically everywhere). Each DP
replica generates the prompts it is given. Sampling noise depends only on (seed, prompt index,
step), so a prompt gets the same response on any rank, replica or batch. PP > 1 is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.generation.answer_pool import AnswerPool
from megatron_rlhf.generation.continuous import ContinuousSettings, generate_continuous
from megatron_rlhf.generation.decode_step import with_graph_setting
from megatron_rlhf.generation.forward import CachedNextTokenLogits, RecomputeNextTokenLogits
from megatron_rlhf.generation.lockstep import ExpertLockstep
from megatron_rlhf.generation.output import GenerationOutput, MicroBatchWork, concat_outputs
from megatron_rlhf.generation.params import GenerationConfig
from megatron_rlhf.generation.sampling import (
    ends_with_stop_sequence,
    greedy_row_mask,
    prompt_noise_keys,
    sample_tokens,
    stop_sequence_tensors,
    uniforms_for_steps,
)
from megatron_rlhf.models.attention import CachedRopeSelfAttention
from megatron_rlhf.runtime.patches import cuda_redirect_suspended


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int,
             device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token lists into ``(input_ids, attention_mask)``, each ``[b, longest]`` int64."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _check_inputs(prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int],
                  config: GenerationConfig, eos_id: int | Sequence[int] | None, pad_id: int,
                  vocab_size: int, seq_length: int) -> None:
    """Raise ValueError for anything ``generate_sequences`` cannot honour."""
    if not prompts:
        raise ValueError("prompts is empty; pass at least one prompt")
    if len(prompt_indices) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(prompt_indices)} prompt_indices; "
                         "pass one index per prompt")
    for row, (prompt, index) in enumerate(zip(prompts, prompt_indices, strict=True)):
        if index < 0:
            raise ValueError(f"prompt_indices[{row}]={index} must be >= 0")
        if not prompt:
            raise ValueError(f"prompt {row} (index {index}) is empty; every prompt needs at "
                             "least one token (a BOS token, for example)")
        if len(prompt) > seq_length:
            raise ValueError(f"prompt {row} (index {index}) has {len(prompt)} tokens, more than "
                             f"the model's seq_length ({seq_length}); truncate it")
        if min(prompt) < 0 or max(prompt) >= vocab_size:
            raise ValueError(f"prompt {row} (index {index}) holds token ids outside "
                             f"[0, {vocab_size})")
    if not 0 <= pad_id < vocab_size:
        raise ValueError(f"pad_id={pad_id} must be a token id in [0, {vocab_size}); it is fed to "
                         "the model (masked) after a sequence stops")
    for ids in config.stop_sequences:
        if max(ids) >= vocab_size:
            raise ValueError(f"generation.stop_sequences holds {list(ids)}, with token ids "
                             f"outside [0, {vocab_size})")
    if config.stop_at_eos and eos_id is None:
        raise ValueError("generation.stop_at_eos=True needs eos_id; pass eos_id or set "
                         "stop_at_eos=False")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside wrappers such as megatron's DDP (they expose it as ``.module``)."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _check_attention_takes_padding_masks(model: torch.nn.Module) -> None:
    """Refuse Transformer Engine attention for KV-cached decoding.

    megatron-core 0.16.1 switches TE attention to ``no_mask`` for every cached decode step, so a
    new token would attend to the left padding of its prompt. Full recomputation
    (``use_kv_cache=False``) passes the explicit mask, which our layer spec makes TE apply.
    """
    for module in model.modules():
        if type(module).__name__ == "TEDotProductAttention":
            raise ValueError("KV-cached generation needs megatron's local attention (megatron "
                             "drops the padding mask of cached decode steps under Transformer "
                             "Engine); build the model with models.transformer_impl=local, or "
                             "set generation.use_kv_cache=false")


def _check_slot_attention(model: torch.nn.Module) -> None:
    """Refuse continuous batching for models whose attention cannot decode over slots."""
    if not any(isinstance(m, CachedRopeSelfAttention) for m in model.modules()):
        raise ValueError("generation.batching=continuous needs the local layer spec's "
                         "CachedRopeSelfAttention (models.transformer_impl=local); set "
                         "generation.batching=static for this model")


def _decode_model(model: torch.nn.Module, config: GenerationConfig) -> torch.nn.Module | None:
    """The compiled model that runs the one-token decode calls (None: ``model`` itself).

    The static loop's cached length grows every step (``dynamic=True``: one graph serves every
    step); continuous batching's step has one shape per call.
    """
    if not config.compile_decode:
        return None
    return torch.compile(_unwrap(model), dynamic=not config.continuous)


def _has_value_channel(model: torch.nn.Module) -> bool:
    """Whether the model's output carries a value channel; refuses models without an LM head."""
    head = getattr(model, "head_kind", "lm")
    if head == "scalar":
        raise ValueError("generation needs a model with an LM head; this one has head='scalar'")
    return head == "lm+scalar"


def generate_sequences(model: torch.nn.Module, pg_collection: ProcessGroupCollection,
                       prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int],
                       config: GenerationConfig, eos_id: int | Sequence[int] | None,
                       pad_id: int, on_cache: Callable[[int], None] | None = None,
                       keep_graphs: bool = True, max_length: int = 0,
                       weight_updates: Callable[[], bool] | None = None) -> GenerationOutput:
    """Generate one response per prompt.

    A prompt's response stops after EOS (when ``config.stop_at_eos``), after one of
    ``config.stop_sequences``, after ``config.max_new_tokens`` tokens, or when prompt +
    response reach the model's ``seq_length``; a prompt of exactly ``seq_length`` tokens
    therefore gets an empty response. ``R`` is the longest response. The prompts are decoded
    ``config.micro_batch_size`` at a time (all at once for 0), which bounds the KV cache; the
    result does not depend on the split.

    Args:
        model: this rank's TP shard of a GPT model with an LM head (``lm`` or ``lm+scalar``),
            possibly wrapped (megatron DDP); its train/eval mode is restored on return.
        pg_collection: the model's process groups; every TP rank must pass the same prompts.
        prompts: token ids of each prompt, at least one token each.
        prompt_indices: a global, non-negative id per prompt that keys its sampling noise (give
            several samples of one prompt different ids).
        config: sampling settings.
        eos_id: the end-of-sequence token, or several (Llama-3 and Qwen end a reply with any of
            a few); None only with ``stop_at_eos=False``.
        pad_id: fills padding positions; must be a valid token id.
        on_cache: called with the bytes of each micro-batch's KV cache while it is allocated
            (memory accounting; not called without the cache).
        keep_graphs: with CUDA graphs (continuous batching), keep the decoders and captured
            decode steps on the model for the next call (their KV memory stays allocated);
            False: capture for this call only and free them at its end.
        max_length: with CUDA graphs, the most positions (prompt plus response) any call of
            the run needs: the KV cache and captured steps are sized for it, so that calls of
            other prompt lengths replay them (0: each call sizes them for its own longest
            prompt; a call that needs more also does).
        weight_updates: continuous batching only: asked at every stop check whether new
            weights were just written into ``model`` in place; the unfinished responses go on
            under them (``generate_continuous``) and the output records each token's
            ``response_versions``. None: the weights stay as they are.

    Returns:
        The batch, on the model's device.

    Raises:
        ValueError: PP > 1, an empty prompt list or prompt, a prompt longer than ``seq_length``,
            token ids outside the vocabulary, a missing ``eos_id``, a scalar-head model, a
            Transformer Engine model decoding with the KV cache, ``cuda_graphs=on`` for a model
            whose decode step cannot be captured (MoE), ``weight_updates`` without continuous
            batching.
    """
    if pg_collection.pp.size() > 1:
        raise ValueError(f"generation does not support pp>1 (got pp={pg_collection.pp.size()}); "
                         "use a shadow actor with pp=1 (separation)")
    core = _unwrap(model)
    if config.use_kv_cache:
        _check_attention_takes_padding_masks(core)
    has_value_channel = _has_value_channel(core)
    vocab_size = getattr(core, "token_vocab_size", core.vocab_size)
    seq_length = core.max_sequence_length
    _check_inputs(prompts, prompt_indices, config, eos_id, pad_id, vocab_size, seq_length)
    config = with_graph_setting(config, core)
    if weight_updates is not None and not config.continuous:
        raise ValueError("weights can change during a generate call only with continuous "
                         "batching (generation.batching=continuous and use_kv_cache=true)")
    size = config.micro_batch_size or len(prompts)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), cuda_redirect_suspended():
            lockstep = ExpertLockstep.of(model, pg_collection, pad_id)
            if config.continuous:
                _check_slot_attention(core)
                budgets = [min(config.max_new_tokens, seq_length - len(p)) for p in prompts]
                settings = ContinuousSettings(config, eos_id, pad_id, vocab_size,
                                              min(max_length, seq_length), keep_graphs,
                                              lockstep, on_cache, weight_updates)
                return generate_continuous(model, _decode_model(model, config), prompts,
                                           prompt_indices, budgets, settings)
            starts = range(0, len(prompts), size)
            idle = lockstep.most(len(starts)) - len(starts) if lockstep else 0
            outputs = [
                _generate_micro_batch(model, pg_collection, prompts[i:i + size],
                                      prompt_indices[i:i + size], config, eos_id, pad_id,
                                      vocab_size, seq_length, has_value_channel, on_cache,
                                      lockstep)
                for i in starts]
            for _ in range(idle):  # the other ranks of the expert-parallel group decode more
                lockstep.idle_decode(config.stop_check_interval)
    finally:
        model.train(was_training)
    return outputs[0] if len(outputs) == 1 else concat_outputs(outputs, pad_id)


def continue_sequences(model: torch.nn.Module, pg_collection: ProcessGroupCollection,
                       pool: AnswerPool, prompts: Sequence[Sequence[int]],
                       prompt_indices: Sequence[int], groups: int, version: int,
                       config: GenerationConfig, eos_id: int | Sequence[int] | None,
                       pad_id: int, on_cache: Callable[[int], None] | None = None,
                       max_length: int = 0,
                       weight_updates: Callable[[], bool] | None = None) -> GenerationOutput:
    """Add ``prompts`` (whole groups; may be none) to ``pool`` and go on decoding its
    answers until ``groups`` whole groups are done (``generation/answer_pool.py``): those groups,
    oldest first, with each token's version as an offset from ``version``, the weights'
    version as the call starts. Checks and arguments as :func:`generate_sequences`'s, with
    continuous batching only; ``max_length`` must fit every prompt plus its answer."""
    if pg_collection.pp.size() > 1:
        raise ValueError(f"generation does not support pp>1 (got pp={pg_collection.pp.size()}); "
                         "use a shadow actor with pp=1 (separation)")
    core = _unwrap(model)
    _check_attention_takes_padding_masks(core)
    vocab_size = getattr(core, "token_vocab_size", core.vocab_size)
    seq_length = core.max_sequence_length
    if prompts:
        _check_inputs(prompts, prompt_indices, config, eos_id, pad_id, vocab_size, seq_length)
    config = with_graph_setting(config, core)
    if not config.continuous:
        raise ValueError("answers go on across calls only with continuous batching "
                         "(generation.batching=continuous and use_kv_cache=true)")
    pool.add(prompts, prompt_indices,
                [min(config.max_new_tokens, seq_length - len(p)) for p in prompts])
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad(), cuda_redirect_suspended():
            _check_slot_attention(core)
            settings = ContinuousSettings(
                config, eos_id, pad_id, vocab_size, min(max_length, seq_length), False,
                ExpertLockstep.of(model, pg_collection, pad_id), on_cache, weight_updates)
            decode_model = (pool.decode_model if pool.batch is not None
                            else _decode_model(model, config))
            return pool.run(model, decode_model, groups, version, settings)
    finally:
        model.train(was_training)


def _generate_micro_batch(model: torch.nn.Module, pg_collection: ProcessGroupCollection,
                          prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int],
                          config: GenerationConfig, eos_id: int | Sequence[int] | None,
                          pad_id: int, vocab_size: int, seq_length: int,
                          has_value_channel: bool,
                          on_cache: Callable[[int], None] | None,
                          lockstep: ExpertLockstep | None = None) -> GenerationOutput:
    device = next(model.parameters()).device
    input_ids, attention_mask = left_pad(prompts, pad_id, device)
    budget_list = [min(config.max_new_tokens, seq_length - len(p)) for p in prompts]
    budgets = torch.tensor(budget_list, device=device)
    max_new = max(budget_list)
    if config.use_kv_cache:
        next_logits = CachedNextTokenLogits(model, len(prompts), input_ids.shape[1] + max_new,
                                            vocab_size, _decode_model(model, config))
    else:
        next_logits = RecomputeNextTokenLogits(model, pg_collection, vocab_size, has_value_channel)
    noise_keys = prompt_noise_keys(config.seed, prompt_indices, device)
    output = _decode_loop(next_logits, input_ids, attention_mask, budgets, max_new, noise_keys,
                          greedy_row_mask(prompt_indices, config, device), config, eos_id, pad_id,
                          lockstep)
    if on_cache is not None and config.use_kv_cache:
        on_cache(next_logits.cache_bytes())
    return output


def _decode_loop(next_logits: CachedNextTokenLogits | RecomputeNextTokenLogits,
                 prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, budgets: torch.Tensor,
                 max_new: int, noise_keys: torch.Tensor, greedy_rows: torch.Tensor | None,
                 config: GenerationConfig, eos_id: int | Sequence[int] | None, pad_id: int,
                 lockstep: ExpertLockstep | None = None) -> GenerationOutput:
    """Sample up to ``max_new`` tokens per row and assemble the output.

    Shapes stay fixed: the sequence buffers are allocated once at their final width and the
    model reads growing views of them. The host learns whether every row has stopped only every
    ``config.stop_check_interval`` tokens (one device sync each), so a GPU is not stalled per
    token; steps run after the last row stopped write padding and are cut off at the end.

    With ``lockstep`` (an MoE model with ``ep > 1``) the ranks of the expert-parallel group loop
    as far as the longest of them and stop together; a rank whose rows have all stopped runs
    idle forwards meanwhile (:mod:`megatron_rlhf.generation.lockstep`).
    """
    b, prompt_width = prompt_ids.shape
    device = prompt_ids.device
    width = prompt_width + max_new
    input_ids = torch.full((b, width), pad_id, dtype=torch.long, device=device)
    attention_mask = torch.zeros(b, width, dtype=torch.long, device=device)
    input_ids[:, :prompt_width] = prompt_ids
    attention_mask[:, :prompt_width] = prompt_mask
    if config.stop_at_eos:
        eos_ids = torch.as_tensor(eos_id, device=device)
    stop_sequences = stop_sequence_tensors(config, device)
    logprobs = torch.zeros(b, max_new, dtype=torch.float32, device=device)
    policy_logprobs = torch.zeros_like(logprobs)
    stopped = budgets <= 0
    uniforms = uniforms_for_steps(noise_keys, max_new)
    forwards = 0
    for step in range(lockstep.most(max_new) if lockstep else max_new):
        if lockstep is None:
            if step % config.stop_check_interval == 0 and bool(stopped.all()):
                break
        else:
            done = bool(stopped.all())  # past this rank's own max_new every row has stopped
            if step % config.stop_check_interval == 0 and lockstep.all_done(done):
                break
            if done:
                lockstep.idle_forward()
                continue
        forwards += 1
        end = prompt_width + step
        logits = next_logits(input_ids[:, :end], attention_mask[:, :end])
        sampled = sample_tokens(logits, uniforms[step], config, greedy_rows)
        active = ~stopped
        token = torch.where(active, sampled.tokens, pad_id)
        logprobs[:, step] = torch.where(active, sampled.logprobs, 0.0)
        policy_logprobs[:, step] = torch.where(active, sampled.policy_logprobs, 0.0)
        input_ids[:, end] = token
        attention_mask[:, end] = active.long()
        stopped = stopped | (budgets <= step + 1)
        if config.stop_at_eos:
            stopped = stopped | (active & torch.isin(token, eos_ids))
        if stop_sequences:
            stopped = stopped | (active & ends_with_stop_sequence(
                input_ids[:, prompt_width:], torch.arange(b, device=device),
                torch.tensor(step + 1, device=device), stop_sequences))
    response_mask = attention_mask[:, prompt_width:]
    response_lengths = response_mask.sum(dim=1)
    steps = int(response_lengths.max()) if b else 0  # R: the longest response
    return GenerationOutput(
        input_ids=input_ids[:, :prompt_width + steps],
        attention_mask=attention_mask[:, :prompt_width + steps],
        prompt_mask=prompt_mask,
        response_mask=response_mask[:, :steps],
        response_logprobs=logprobs[:, :steps],
        response_policy_logprobs=policy_logprobs[:, :steps],
        prompt_lengths=prompt_mask.sum(dim=1),
        response_lengths=response_lengths,
        micro_batches=(MicroBatchWork(b, prompt_width, forwards, config.use_kv_cache),),
    )
