"""Continuous batching inside one ``generate_sequences`` call.

The prompts wait in a queue (in the order given). ``slots`` of them decode together through a
:class:`~megatron_rlhf.generation.decode_step.SlotDecoder`; every ``stop_check_interval`` steps
the host reads which slots have ended, keeps their responses and prefills the next waiting
prompts into those slots, so the decode batch stays full until the queue drains. From then on,
whenever the slots still decoding fit a smaller power-of-two bucket, the decoder keeps only
those rows (KV cache included): the tail of a call, where a static batch computes every ended
row until its longest one stops, runs at the size of what is left. A prompt's
tokens depend only on its own noise key, budget and logits, so they are the tokens the static
loop (``generation.batching=static``) draws for it; the log-probs agree to rounding (the
prompt's keys sit at other absolute positions and are read among more masked keys).

With graphs (CUDA, or the CPU stand-in) the slots never go below ``GRAPH_MIN_SLOTS`` (nor below
it at the start of a small call, within ``micro_batch_size``), and each slot count's decoder and
captured step are kept on the model across calls (:class:`DecodeGraphs`): a call captures only
the slot counts no earlier call captured, and shrinking copies the kept rows into the smaller
decoder's buffers instead of allocating new ones. The cache length is that of the longest
sequence the run allows (``max_length``: the longest prompt plus the most response or episode
tokens), not of each call's longest prompt, so the calls of a run (the turns of multi-turn
episodes, too) share one length and one capture per slot count. The kept decoders hold their
model weakly: dropping the model frees them, and :func:`release_decode_graphs` frees them
while the model lives (before training on the same devices, say).

Weights may change between the decode steps of one call (partial rollouts): at every stop
check ``weight_updates`` is asked whether it wrote new weights into the model (in place, as a
refit does). The slots still decoding keep their tokens and KV cache (the keys and values of
their earlier tokens stay those of the older weights) and sample on under the new ones; prompts
prefilled later start under them. The output then records, per response token, how many
updates preceded it (``response_versions``).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import deque
from collections.abc import Callable, Sequence

import torch

from megatron_rlhf.generation.decode_step import (
    GRAPH_MIN_SLOTS,
    DecodeGraph,
    SlotDecoder,
    SlotPrompt,
    batch_bucket,
    graphs_enabled,
    length_bucket,
)
from megatron_rlhf.generation.lockstep import ExpertLockstep
from megatron_rlhf.generation.output import GenerationOutput, MicroBatchWork
from megatron_rlhf.generation.params import GenerationConfig
from megatron_rlhf.generation.sampling import prompt_noise_keys


class DecodeGraphs:
    """The decoders and captured decode steps of one model, by slot count, kept across calls.

    A captured step holds the addresses of its decoder's buffers and of the model's parameters,
    and the Python values of the step's settings. So the entries serve the next call while the
    decoder's length and the step's settings are the same (another length or setting drops
    them all) and the parameters are where they were (a refit that copies in place keeps them;
    parameters that moved drop the captured steps, which capture again). The KV memory of every
    slot count used stays allocated between calls: :func:`release_decode_graphs` frees it, and
    so does dropping the model (nothing here refers to it strongly).
    """

    def __init__(self) -> None:
        self.settings: tuple | None = None
        self.decoders: dict[int, SlotDecoder] = {}
        self.graphs: dict[int, DecodeGraph] = {}
        self.weights: dict[str, int] = {}

    def decoder(self, model: torch.nn.Module, decode_model: torch.nn.Module | None, slots: int,
                length: int, vocab_size: int, config: GenerationConfig,
                eos_id: int | Sequence[int] | None, pad_id: int) -> SlotDecoder:
        """An empty decoder of ``slots`` slots: the kept one, or a new one."""
        # what a captured step bakes in; the seed only picks the noise keys and the budgets are
        # a buffer: the turns of an episode, each with its own max_new_tokens, share the steps
        settings = (length, vocab_size, dataclasses.replace(config, seed=0, max_new_tokens=0),
                    tuple(eos_id) if isinstance(eos_id, Sequence) else eos_id, pad_id)
        if settings != self.settings:
            self.release()
            self.settings = settings
        decoder = self.decoders.get(slots)
        if decoder is None:
            decoder = self.decoders[slots] = SlotDecoder(model, slots, length, vocab_size,
                                                         config, eos_id, pad_id, decode_model)
        else:
            decoder.reset(decode_model)
        return decoder

    def graph(self, decoder: SlotDecoder) -> DecodeGraph:
        """The captured step of ``decoder`` (one of :meth:`decoder`'s), captured if needed."""
        weights = {name: t.untyped_storage().data_ptr()
                   for name, t in [*decoder.model.named_parameters(),
                                   *decoder.model.named_buffers()]}
        if weights != self.weights:  # moved (offloaded and reloaded, or reallocated)
            self.graphs.clear()
            self.weights = weights
        if decoder.slots not in self.graphs:
            self.graphs[decoder.slots] = DecodeGraph(decoder)
        return self.graphs[decoder.slots]

    def cache_bytes(self) -> int:
        """Bytes of the KV memory of every kept decoder."""
        return sum(decoder.cache_bytes() for decoder in self.decoders.values())

    def release(self) -> None:
        """Drop every decoder and captured step (their memory is freed with them)."""
        self.settings = None
        self.decoders.clear()
        self.graphs.clear()
        self.weights = {}


def kept_slot_counts(rows: int, limit: int) -> list[int]:
    """The slot counts a model keeps decoders (and captured steps) for when its calls decode up
    to ``rows`` prompts with ``micro_batch_size=limit``: the first slot count of a call of
    ``rows`` prompts and every power of two from ``GRAPH_MIN_SLOTS`` below it (what the slots
    shrink to, and where calls of fewer prompts start), largest first."""
    top = max(batch_bucket(rows, limit), min(GRAPH_MIN_SLOTS, limit or GRAPH_MIN_SLOTS))
    return [top] + [1 << k for k in range(top.bit_length() - 1, -1, -1)
                    if GRAPH_MIN_SLOTS <= 1 << k < top]


_KEPT: weakref.WeakKeyDictionary[torch.nn.Module, DecodeGraphs] = weakref.WeakKeyDictionary()


def decode_graphs(model: torch.nn.Module) -> DecodeGraphs:
    """The :class:`DecodeGraphs` kept for ``model`` (made empty the first time)."""
    if model not in _KEPT:
        _KEPT[model] = DecodeGraphs()
    return _KEPT[model]


def release_decode_graphs(model: torch.nn.Module) -> None:
    """Free the decoders and captured steps kept for ``model`` (its KV memory and the graphs'
    memory); the next call with graphs captures again."""
    kept = _KEPT.pop(model, None)
    if kept is not None:
        kept.release()


def generate_continuous(model: torch.nn.Module, decode_model: torch.nn.Module | None,
                        prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int],
                        budgets: Sequence[int], config: GenerationConfig,
                        eos_id: int | Sequence[int] | None, pad_id: int, vocab_size: int,
                        on_cache: Callable[[int], None] | None,
                        lockstep: ExpertLockstep | None = None,
                        keep_graphs: bool = True, max_length: int = 0,
                        weight_updates: Callable[[], bool] | None = None) -> GenerationOutput:
    """Generate one response per prompt with continuous batching (module docstring).

    Args:
        model: this rank's shard of the GPT model (local spec), in eval mode, under no_grad.
        decode_model: runs the decode steps (``model`` when None).
        prompts: token ids per prompt.
        prompt_indices: noise ids per prompt.
        budgets: most response tokens per prompt (0: an empty response, nothing runs).
        config, eos_id, pad_id: as ``generate_sequences``.
        vocab_size: logits columns at or past it are dropped.
        on_cache: called once with the bytes of the KV cache (its largest, before the slots
            shrank).
        lockstep: an MoE model's expert-parallel group (``ep > 1``): every prefill and decode
            step is a forward on each of its ranks, idle where this rank has none to run, and
            the ranks stop together (:mod:`megatron_rlhf.generation.lockstep`).
        keep_graphs: with graphs, keep the decoders and captured steps on ``model`` for the
            next call (:class:`DecodeGraphs`); False: capture for this call only (the slots
            shrink by reallocation).
        max_length: positions (prompt plus response) every call of the run fits in: the cache
            length, so that every call shares the captured steps (0, or a call that needs
            more: its longest prompt plus its largest budget).
        weight_updates: asked at every stop check while slots still decode: True when it has
            just written new weights into ``model`` in place (every rank of the model's TP
            group must answer alike); None: the weights do not change during the call.

    Raises:
        ValueError: ``weight_updates`` under an expert-parallel lockstep.
    """
    if weight_updates is not None and lockstep is not None:
        raise ValueError("weights cannot change during a call under an expert-parallel "
                         "lockstep (ep > 1): its ranks stop checking at different steps")
    device = next(model.parameters()).device
    greedy_every = config.greedy_every if not config.greedy else 0
    keys = prompt_noise_keys(config.seed, prompt_indices).tolist()
    waiting = deque(i for i, budget in enumerate(budgets) if budget > 0)
    slots = batch_bucket(len(waiting), config.micro_batch_size) if waiting else 0
    # with graphs, each slot count is a capture; below the floor a step costs about the same
    # (a graph's capture runs extra forwards: none under an expert-parallel lockstep)
    floor = GRAPH_MIN_SLOTS if graphs_enabled(config, device) and lockstep is None else 1
    kept = decode_graphs(model) if floor > 1 and keep_graphs else None
    if floor > 1:
        slots = max(slots, min(floor, config.micro_batch_size or floor))
    work: list[MicroBatchWork] = []
    responses: dict[int, tuple[torch.Tensor, ...]] = {}
    # per prompt: the updates before its prefill, then its token count at each later update
    versions: dict[int, list[int]] | None = {} if weight_updates is not None else None
    updates = 0
    if waiting:
        # a prefill left-pads its prompts to the longest of them, so a short prompt's response
        # starts past its own length: bound by the longest prompt plus the largest budget
        length = length_bucket(max(max_length, max(len(prompts[i]) for i in waiting)
                                   + max(budgets[i] for i in waiting)))
        settings = (length, vocab_size, config, eos_id, pad_id)
        decoder = (kept.decoder(model, decode_model, slots, *settings) if kept is not None else
                   SlotDecoder(model, slots, *settings, decode_model))
        occupant: list[int | None] = [None] * slots
        graph = None
        decode_calls = attended = 0  # steps and attended positions at the current slot count
        cache_bytes = 0
        finished = False  # every prompt of this rank done (others of a lockstep may not be)
        while True:
            free = [s for s, prompt in enumerate(occupant) if prompt is None][:len(waiting)]
            entering = [waiting.popleft() for _ in free]
            prefills = lockstep.most(int(bool(entering))) if lockstep is not None else 0
            if not entering and prefills:
                lockstep.idle_forward()  # another rank of the expert-parallel group prefills
            if finished:
                for _ in range(config.stop_check_interval):
                    lockstep.idle_forward()
                if lockstep.all_done(True):
                    break
                continue
            if entering:
                decoder.prefill(free, [
                    SlotPrompt(prompts[i], keys[i], budgets[i],
                               bool(greedy_every) and prompt_indices[i] % greedy_every == 0)
                    for i in entering])
                work.append(MicroBatchWork(len(entering), max(len(prompts[i]) for i in entering),
                                           1, True))
                for slot, prompt in zip(free, entering, strict=True):
                    occupant[slot] = prompt
                    if versions is not None:
                        versions[prompt] = [updates]
            if graph is None and floor > 1:
                graph = kept.graph(decoder) if kept is not None else DecodeGraph(decoder)
            run = graph or decoder
            for _ in range(config.stop_check_interval):
                run.step()
            decode_calls += config.stop_check_interval
            # one device-to-host read per stop check: which slots ended, and their lengths
            active, steps = torch.stack([decoder.active.long(), decoder.steps]).tolist()
            decoder.forget_ended(active)
            for slot, prompt in enumerate(occupant):
                if prompt is not None and not active[slot]:
                    responses[prompt] = _take(decoder, slot, steps[slot])
                    occupant[slot] = None
            finished = not waiting and all(prompt is None for prompt in occupant)
            if lockstep.all_done(finished) if lockstep is not None else finished:
                break
            if versions is not None and weight_updates():
                updates += 1
                for slot, prompt in enumerate(occupant):
                    if prompt is not None:
                        versions[prompt].append(steps[slot])
            if finished:
                continue
            fewer = _fewer_slots(occupant, config.micro_batch_size, floor) if not waiting else None
            if fewer is not None:
                work.append(_decode_work(slots, decode_calls, decoder, attended))
                attended = decoder.attended_positions
                cache_bytes = max(cache_bytes, decoder.cache_bytes())
                if kept is not None:
                    decoder = kept.decoder(model, decode_model, len(fewer), *settings
                                           ).take_rows(decoder, fewer)
                else:
                    decoder.keep_slots(fewer)
                occupant = [occupant[s] for s in fewer]
                slots, graph, decode_calls = len(fewer), None, 0
        work.append(_decode_work(slots, decode_calls, decoder, attended))
        if on_cache is not None:  # the largest cache of the call: before the slots shrank
            on_cache(kept.cache_bytes() if kept is not None  # every slot count's, kept
                     else max(cache_bytes, decoder.cache_bytes()))
    elif lockstep is not None:  # nothing to decode here, while the group's others may
        lockstep.idle_rounds(config.stop_check_interval)
    return _assemble(prompts, responses, pad_id, device, tuple(work), versions)


def _decode_work(slots: int, calls: int, decoder: SlotDecoder,
                 attended_before: int) -> MicroBatchWork:
    """The record of ``calls`` decode steps over ``slots`` slots, with the mean number of cache
    positions they attended (rounded up)."""
    context = decoder.max_length
    if calls and not decoder.fixed_context:
        context = -(-(decoder.attended_positions - attended_before) // calls)
    return MicroBatchWork(slots, 0, calls, True, decode_context=context)


def _fewer_slots(occupant: Sequence[int | None], limit: int, floor: int = 1
                 ) -> list[int] | None:
    """The slots to keep once no prompt waits: those still decoding, topped up with ended ones
    to the smaller batch bucket they fit, at least ``floor`` (a bounded set of shapes, each a
    CUDA graph); None while they still need every slot."""
    decoding = [s for s, prompt in enumerate(occupant) if prompt is not None]
    bucket = max(batch_bucket(len(decoding), limit), floor)
    if bucket >= len(occupant):
        return None
    ended = [s for s, prompt in enumerate(occupant) if prompt is None]
    return sorted(decoding + ended[:bucket - len(decoding)])


def _take(decoder: SlotDecoder, slot: int, n: int) -> tuple[torch.Tensor, ...]:
    """A finished slot's ``n``-token response: ``(tokens, logprobs, policy_logprobs)``."""
    return tuple(buffer[slot, :n].clone() for buffer in
                 (decoder.out_tokens, decoder.out_logprobs, decoder.out_policy_logprobs))


def _assemble(prompts: Sequence[Sequence[int]], responses: dict[int, tuple[torch.Tensor, ...]],
              pad_id: int, device: torch.device, work: tuple[MicroBatchWork, ...],
              versions: dict[int, list[int]] | None = None) -> GenerationOutput:
    """The batch layout of ``generate_sequences`` (prompts left-padded to the longest, responses
    right-padded to the longest) from each prompt's response; with ``versions`` (per prompt:
    the updates before its prefill, then its token count at each later update) the updates
    before each response token."""
    b = len(prompts)
    width = max(len(p) for p in prompts)
    steps = max((len(r[0]) for r in responses.values()), default=0)
    # the prompts (host lists) are laid out on the host and copied once
    input_ids = torch.full((b, width + steps), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, width + steps, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):width] = torch.tensor(list(prompt), dtype=torch.long)
        attention_mask[row, width - len(prompt):width] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    logprobs = torch.zeros(b, steps, dtype=torch.float32, device=device)
    policy_logprobs = torch.zeros_like(logprobs)
    for row in range(b):
        if row in responses:
            tokens, lp, policy = responses[row]
            n = len(tokens)
            input_ids[row, width:width + n] = tokens
            attention_mask[row, width:width + n] = 1
            logprobs[row, :n] = lp
            policy_logprobs[row, :n] = policy
    prompt_mask = attention_mask[:, :width].clone()
    response_mask = attention_mask[:, width:].clone()
    response_versions = None
    if versions is not None:
        response_versions = torch.zeros(b, steps, dtype=torch.long)
        for row in responses:
            start, *changes = versions[row]
            response_versions[row, :len(responses[row][0])] = start
            for count in changes:
                response_versions[row, count:len(responses[row][0])] += 1
        response_versions = response_versions.to(device)
    return GenerationOutput(
        input_ids=input_ids, attention_mask=attention_mask, prompt_mask=prompt_mask,
        response_mask=response_mask, response_logprobs=logprobs,
        response_policy_logprobs=policy_logprobs, prompt_lengths=prompt_mask.sum(dim=1),
        response_lengths=response_mask.sum(dim=1), micro_batches=work,
        response_versions=response_versions)
