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
    DecodeSettings,
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
        self.settings: DecodeSettings | None = None
        self.decoders: dict[int, SlotDecoder] = {}
        self.graphs: dict[int, DecodeGraph] = {}
        self.weights: dict[str, int] = {}

    def decoder(self, model: torch.nn.Module, decode_model: torch.nn.Module | None, slots: int,
                settings: DecodeSettings) -> SlotDecoder:
        """An empty decoder of ``slots`` slots: the kept one, or a new one."""
        key = settings.capture_key()
        if key != self.settings:
            self.release()
            self.settings = key
        decoder = self.decoders.get(slots)
        if decoder is None:
            decoder = self.decoders[slots] = SlotDecoder(model, slots, settings, decode_model)
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


@dataclasses.dataclass(frozen=True)
class ContinuousSettings:
    """How one continuous-batching call runs, besides its prompts (``generate_sequences`` makes
    it from its own arguments)."""

    config: GenerationConfig
    eos_id: int | Sequence[int] | None
    pad_id: int
    vocab_size: int
    """Logits columns at or past it are dropped."""
    max_length: int = 0
    """Positions (prompt plus response) every call of the run fits in: the cache length, so that
    every call shares the captured steps (0, or a call that needs more: its longest prompt plus
    its largest budget)."""
    keep_graphs: bool = True
    """With graphs, keep the decoders and captured steps on the model for the next call
    (:class:`DecodeGraphs`); False: capture for this call only (the slots shrink by
    reallocation)."""
    lockstep: ExpertLockstep | None = None
    """An MoE model's expert-parallel group (``ep > 1``): every prefill and decode step is a
    forward on each of its ranks, idle where this rank has none to run, and the ranks stop
    together (:mod:`megatron_rlhf.generation.lockstep`)."""
    on_cache: Callable[[int], None] | None = None
    """Called once with the bytes of the KV cache (its largest, before the slots shrank)."""
    weight_updates: Callable[[], bool] | None = None
    """Asked at every stop check while slots still decode: True when it has just written new
    weights into the model in place (every rank of the model's TP group must answer alike);
    None: the weights do not change during the call."""

    def __post_init__(self) -> None:
        if self.weight_updates is not None and self.lockstep is not None:
            raise ValueError("weights cannot change during a call under an expert-parallel "
                             "lockstep (ep > 1): its ranks stop checking at different steps")


def generate_continuous(model: torch.nn.Module, decode_model: torch.nn.Module | None,
                        prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int],
                        budgets: Sequence[int], settings: ContinuousSettings
                        ) -> GenerationOutput:
    """Generate one response per prompt with continuous batching (module docstring).

    Args:
        model: this rank's shard of the GPT model (local spec), in eval mode, under no_grad.
        decode_model: runs the decode steps (``model`` when None).
        prompts: token ids per prompt.
        prompt_indices: noise ids per prompt.
        budgets: most response tokens per prompt (0: an empty response, nothing runs).
        settings: how the call runs.
    """
    config, lockstep = settings.config, settings.lockstep
    waiting = deque(i for i, budget in enumerate(budgets) if budget > 0)
    device = next(model.parameters()).device
    if not waiting:
        if lockstep is not None:  # nothing to decode here, while the group's others may
            lockstep.idle_rounds(config.stop_check_interval)
        return _assemble(prompts, {}, settings.pad_id, device, (),
                         {} if settings.weight_updates is not None else None)
    batch = _SlotBatch(model, decode_model, prompts, prompt_indices, budgets, settings, waiting)
    finished = False  # every prompt of this rank done (others of a lockstep may not be)
    while True:
        free, entering = batch.take_waiting(waiting)
        if lockstep is not None and lockstep.most(int(bool(entering))) and not entering:
            lockstep.idle_forward()  # another rank of the expert-parallel group prefills
        if finished:
            for _ in range(config.stop_check_interval):
                lockstep.idle_forward()
            if lockstep.all_done(True):
                break
            continue
        batch.prefill(free, entering)
        steps = batch.decode_until_stop_check()
        finished = not waiting and batch.empty
        if lockstep.all_done(finished) if lockstep is not None else finished:
            break
        if settings.weight_updates is not None and settings.weight_updates():
            batch.record_update(steps)
        if not finished and not waiting:
            batch.shrink()
    return batch.output()


class _SlotBatch:
    """The slots of one call as prompts enter them, decode, end and leave, and as the decode
    batch shrinks once no prompt waits."""

    def __init__(self, model: torch.nn.Module, decode_model: torch.nn.Module | None,
                 prompts: Sequence[Sequence[int]], prompt_indices: Sequence[int],
                 budgets: Sequence[int], settings: ContinuousSettings, waiting: deque[int],
                 slots: int = 0) -> None:
        config = settings.config
        self.model, self.decode_model = model, decode_model
        self.prompts, self.prompt_indices, self.budgets = prompts, prompt_indices, budgets
        self.settings = settings
        self.device = next(model.parameters()).device
        self.greedy_every = config.greedy_every if not config.greedy else 0
        slots = slots or batch_bucket(len(waiting), config.micro_batch_size)
        # with graphs, each slot count is a capture; below the floor a step costs about the same
        # (a graph's capture runs extra forwards: none under an expert-parallel lockstep)
        graphs = graphs_enabled(config, self.device) and settings.lockstep is None
        self.floor = GRAPH_MIN_SLOTS if graphs else 1
        self.kept = decode_graphs(model) if graphs and settings.keep_graphs else None
        if graphs:
            slots = max(slots, min(self.floor, config.micro_batch_size or self.floor))
        # a prefill left-pads its prompts to the longest of them, so a short prompt's response
        # starts past its own length: bound by the longest prompt plus the largest budget
        length = length_bucket(max(settings.max_length, max(len(prompts[i]) for i in waiting)
                                   + max(budgets[i] for i in waiting)))
        self.decode_settings = DecodeSettings(config, settings.eos_id, settings.pad_id,
                                              settings.vocab_size, length)
        self.decoder = self._decoder(slots)
        self.occupant: list[int | None] = [None] * slots
        self.graph: DecodeGraph | None = None
        self.decode_calls = self.attended = 0  # steps and attended positions at this slot count
        self.cache_bytes = 0
        self.work: list[MicroBatchWork] = []
        self.responses: dict[int, tuple[torch.Tensor, ...]] = {}
        # per prompt: the updates before its prefill, then its token count at each later update
        self.versions: dict[int, list[int]] | None = (
            {} if settings.weight_updates is not None else None)
        self.updates = 0

    def _decoder(self, slots: int) -> SlotDecoder:
        if self.kept is not None:
            return self.kept.decoder(self.model, self.decode_model, slots, self.decode_settings)
        return SlotDecoder(self.model, slots, self.decode_settings, self.decode_model)

    @property
    def empty(self) -> bool:
        """No slot decodes."""
        return all(prompt is None for prompt in self.occupant)

    def take_waiting(self, waiting: deque[int]) -> tuple[list[int], list[int]]:
        """Free slots, and as many waiting prompts (taken off ``waiting``) to enter them."""
        free = [s for s, prompt in enumerate(self.occupant) if prompt is None][:len(waiting)]
        return free, [waiting.popleft() for _ in free]

    def prefill(self, free: Sequence[int], entering: Sequence[int]) -> None:
        """Prefill the ``entering`` prompts into the ``free`` slots (nothing when none)."""
        if not entering:
            return
        indices = [self.prompt_indices[i] for i in entering]
        keys = prompt_noise_keys(self.settings.config.seed, indices).tolist()
        self.decoder.prefill(free, [
            SlotPrompt(self.prompts[i], key, self.budgets[i],
                       bool(self.greedy_every) and index % self.greedy_every == 0)
            for i, key, index in zip(entering, keys, indices, strict=True)])
        self.work.append(MicroBatchWork(len(entering),
                                        max(len(self.prompts[i]) for i in entering), 1, True))
        for slot, prompt in zip(free, entering, strict=True):
            self.occupant[slot] = prompt
            if self.versions is not None:
                self.versions[prompt] = [self.updates]

    def decode_until_stop_check(self) -> list[int]:
        """Decode ``stop_check_interval`` steps, then keep the responses of the slots that
        ended; returns every slot's response length."""
        if self.graph is None and self.floor > 1:
            self.graph = (self.kept.graph(self.decoder) if self.kept is not None
                          else DecodeGraph(self.decoder))
        run = self.graph or self.decoder
        interval = self.settings.config.stop_check_interval
        for _ in range(interval):
            run.step()
        self.decode_calls += interval
        decoder = self.decoder
        # one device-to-host read per stop check: which slots ended, and their lengths
        active, steps = torch.stack([decoder.active.long(), decoder.steps]).tolist()
        decoder.forget_ended(active)
        for slot, prompt in enumerate(self.occupant):
            if prompt is not None and not active[slot]:
                self.responses[prompt] = _take(decoder, slot, steps[slot])
                self.occupant[slot] = None
        return steps

    def record_update(self, steps: Sequence[int]) -> None:
        """New weights arrived after the slots' ``steps`` response tokens."""
        self.updates += 1
        for slot, prompt in enumerate(self.occupant):
            if prompt is not None:
                self.versions[prompt].append(steps[slot])

    def shrink(self) -> None:
        """Keep only the slots still decoding, in the smallest batch bucket they fit (no prompt
        waits)."""
        fewer = _fewer_slots(self.occupant, self.settings.config.micro_batch_size, self.floor)
        if fewer is None:
            return
        self.work.append(_decode_work(len(self.occupant), self.decode_calls, self.decoder,
                                      self.attended))
        self.attended = self.decoder.attended_positions
        self.cache_bytes = max(self.cache_bytes, self.decoder.cache_bytes())
        if self.kept is not None:
            self.decoder = self._decoder(len(fewer)).take_rows(self.decoder, fewer)
        else:
            self.decoder.keep_slots(fewer)
        self.occupant = [self.occupant[s] for s in fewer]
        self.graph, self.decode_calls = None, 0

    def output(self) -> GenerationOutput:
        """The call's output, once every prompt is done."""
        return _assemble(self.prompts, self.responses, self.settings.pad_id, self.device,
                         self.close_work(), self.versions)

    def close_work(self) -> tuple[MicroBatchWork, ...]:
        """The call's work records, its last decode steps' included (and ``on_cache`` told
        the largest cache); the next steps count from here."""
        self.work.append(_decode_work(len(self.occupant), self.decode_calls, self.decoder,
                                      self.attended))
        if self.settings.on_cache is not None:  # the call's largest cache: before shrinking
            self.settings.on_cache(self.kept.cache_bytes() if self.kept is not None  # all kept
                                   else max(self.cache_bytes, self.decoder.cache_bytes()))
        self.decode_calls, self.attended = 0, self.decoder.attended_positions
        return tuple(self.work)


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
