"""A decode step of fixed shape over slots, and its CUDA graph.

:class:`SlotDecoder` allocates, once per (slots, length) bucket, every tensor a decode step reads
or writes: the KV cache (:class:`~megatron_rlhf.models.slot_cache.SlotInferenceContext`), each
slot's position, key mask, last token, response step, budget, noise key, greedy flag, active
flag and its outputs (tokens, both log-probs); a slot ends at its budget, at an end id or when
its response ends with a stop sequence. :meth:`SlotDecoder.step` is a function of those
tensors alone, updated in place, with no host branch on their values: the same kernels run at
every token, so on CUDA the step is captured once into a graph (:class:`DecodeGraph`) and
replayed per token; on CPU it runs eagerly (with ``MEGATRON_RLHF_EMULATE_CUDA_GRAPHS=1``, for
tests, it is captured into the checking stand-in of ``testing/graph_standin.py``). An eager step attends
only over the cache positions that some decoding slot may have written (a bound the host keeps
from the prefill widths and the steps since), not the whole bucket: fewer masked keys, the same
tokens.

:meth:`SlotDecoder.prefill` puts new prompts into free slots (an ordinary, variable-shape
forward); its logits give each prompt's first token, sampled with the step's own rule. The
sampling noise of a slot's token is a hash of (noise key, response step), computed inside the
step, so a prompt draws the same numbers whatever slot, batch or order it decodes in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_rlhf.generation.params import GenerationConfig
from megatron_rlhf.generation.sampling import (
    SampledTokens,
    ends_with_stop_sequence,
    sample_tokens,
    stop_sequence_tensors,
    uniforms_at_step,
)
from megatron_rlhf.models.forward_backward import causal_padding_mask
from megatron_rlhf.models.slot_cache import SlotInferenceContext
from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)

EMULATE_GRAPHS_ENV = "MEGATRON_RLHF_EMULATE_CUDA_GRAPHS"
"""Set to ``1`` (tests only) to capture the continuous decode step on CPU into the checking
stand-in graph of :mod:`megatron_rlhf.testing.graph_standin`; production on CPU stays eager."""

LENGTH_BUCKET = 32
"""Cache lengths are rounded up to a multiple of this, so calls of similar lengths share a
bucket (and, on CUDA, the shapes a graph was captured at)."""


GRAPH_MIN_SLOTS = 8
"""With CUDA graphs the decode batch shrinks no further than this many slots: each slot count
is a capture (two eager steps, a device sync, the capture), and a memory-bound decode step at
fewer slots costs about what it costs at this many. Graphs per call: at most
1 + log2(slots / GRAPH_MIN_SLOTS)."""


CAPTURE_ERROR_MODE = "thread_local"
"""``torch.cuda.graph``'s ``capture_error_mode`` for the decode step. Under torch's default,
``global``, a CUDA call that capture deems unsafe made by any thread breaks the capture: the
transfer thread's first send to a new peer makes NCCL allocate. ``thread_local`` checks the
capturing thread only (as megatron captures)."""

MOE_GRAPH_REFUSAL = ("megatron's MoE token dispatch synchronises with the host (the all-to-all "
                     "dispatcher copies token counts to the host, SequentialMLP calls tolist(), "
                     "the permutation uses masked_select), which CUDA graph capture forbids")
"""Why an MoE model's decode step is not captured, at any expert parallelism."""


def batch_bucket(rows: int, limit: int) -> int:
    """Slots for ``rows`` prompts: the next power of two, at most ``limit`` (0: no limit)."""
    bucket = 1 << max(rows - 1, 0).bit_length()
    return min(bucket, limit) if limit else bucket


def length_bucket(length: int) -> int:
    """Positions per slot for sequences of up to ``length`` tokens."""
    return -(-length // LENGTH_BUCKET) * LENGTH_BUCKET


@dataclass(frozen=True)
class DecodeSettings:
    """What the decoders of a call share, besides their slot count: what a captured step bakes in
    other than its buffers' addresses."""

    config: GenerationConfig
    """Sampling and stopping."""
    eos_id: int | tuple[int, ...] | None
    """The end token(s), used when ``config.stop_at_eos`` (a sequence is kept as a tuple)."""
    pad_id: int
    """The token a finished slot writes."""
    vocab_size: int
    """Logits columns at or past it are dropped."""
    max_length: int
    """Positions per slot (a :func:`length_bucket`)."""

    def __post_init__(self) -> None:
        if isinstance(self.eos_id, Sequence):
            object.__setattr__(self, "eos_id", tuple(self.eos_id))

    def capture_key(self) -> DecodeSettings:
        """These settings as far as a captured step depends on them: the seed only picks the
        noise keys and the budgets are a buffer, so the turns of an episode, each with its own
        ``max_new_tokens``, share the captured steps."""
        return dataclasses.replace(self, config=dataclasses.replace(self.config, seed=0,
                                                                    max_new_tokens=0))


@dataclass(frozen=True)
class SlotPrompt:
    """A prompt entering a slot."""

    tokens: Sequence[int]
    noise_key: int
    """Its :func:`~megatron_rlhf.generation.sampling.prompt_noise_keys` entry."""
    budget: int
    """Most response tokens, >= 1."""
    greedy: bool
    """Takes the argmax although the config samples (``greedy_every``)."""


class SlotDecoder:
    """Fixed-shape decoding state of ``slots`` rows of up to ``max_length`` positions."""

    _SLOT_BUFFERS = ("tokens", "key_valid", "steps", "budgets", "noise_keys", "greedy", "active",
                     "out_tokens", "out_logprobs", "out_policy_logprobs")
    """The attributes with one row per slot (``greedy`` may be None)."""

    def __init__(self, model: torch.nn.Module, slots: int, settings: DecodeSettings,
                 decode_model: torch.nn.Module | None = None) -> None:
        """Allocate the buffers (the KV memory is allocated by the first prefill).

        Args:
            model: this rank's shard of the GPT model (local spec), in eval mode.
            slots: rows decoded together.
            settings: sampling, stopping, the special tokens and the positions per slot.
            decode_model: runs the decode steps (``model`` when None; a compiled ``model``).
        """
        config, eos_id, pad_id = settings.config, settings.eos_id, settings.pad_id
        max_length = settings.max_length
        device = next(model.parameters()).device
        # weak: a decoder kept across calls (``continuous.DecodeGraphs``) must not keep its
        # model, and with it the model's memory, alive after the model is dropped (nor the
        # call's compiled model, which holds the model; the call holds it while it decodes)
        self._model = weakref.ref(model)
        self._decode_model = _weak(decode_model)
        self.settings = settings
        self.vocab_size = settings.vocab_size
        self.config = config
        self.pad_id = pad_id
        self.max_length = max_length
        self.context = SlotInferenceContext(slots, max_length, device)
        self.eos_ids = (torch.as_tensor(eos_id, device=device).reshape(-1)
                        if config.stop_at_eos else None)
        self.stop_sequences = stop_sequence_tensors(config, device)
        self.tokens = torch.full((slots,), pad_id, dtype=torch.long, device=device)
        self.key_valid = torch.zeros(slots, max_length, dtype=torch.bool, device=device)
        self.steps = torch.zeros(slots, dtype=torch.long, device=device)
        self.budgets = torch.zeros(slots, dtype=torch.long, device=device)
        self.noise_keys = torch.zeros(slots, dtype=torch.long, device=device)
        self.greedy = (torch.zeros(slots, dtype=torch.bool, device=device)
                       if config.greedy_every and not config.greedy else None)
        self.active = torch.zeros(slots, dtype=torch.bool, device=device)
        self.out_tokens = torch.full((slots, max_length), pad_id, dtype=torch.long,
                                     device=device)
        self.out_logprobs = torch.zeros(slots, max_length, dtype=torch.float32, device=device)
        self.out_policy_logprobs = torch.zeros_like(self.out_logprobs)
        self.all_slots = torch.arange(slots, device=device)
        # compiled or captured steps keep one shape: they attend over the whole cache
        self.fixed_context = config.compile_decode or graphs_enabled(config, device)
        self._write_bound = [0] * slots
        """Per slot, a host-side bound on the position its next decode token is written at."""
        self.attended_positions = 0
        """Cache positions attended per slot, summed over the eager decode steps run so far
        (a fixed-context step attends ``max_length``)."""

    @property
    def slots(self) -> int:
        return self.tokens.shape[0]

    @property
    def model(self) -> torch.nn.Module:
        """The model the decoder prefills with (held weakly)."""
        model = self._model()
        if model is None:
            raise RuntimeError("the decoder's model was released; make a new decoder")
        return model

    @property
    def decode_model(self) -> torch.nn.Module:
        """What runs the decode steps: the call's compiled model (held weakly), else
        :attr:`model`."""
        if self._decode_model is None:
            return self.model
        decode_model = self._decode_model()
        if decode_model is None:
            raise RuntimeError("the decoder's compiled model was released; reset() the decoder "
                               "with the next call's")
        return decode_model

    @property
    def positions(self) -> torch.Tensor:
        """``[slots]``: where each slot's next fed token is written."""
        return self.context.positions

    def prefill(self, slots: Sequence[int], prompts: Sequence[SlotPrompt]) -> None:
        """Encode ``prompts`` (left-padded together) into ``slots`` and sample their first token.

        Overwrites whatever the slots held; the positions past the new prompts are masked.
        """
        device = self.tokens.device
        width = max(len(p.tokens) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        real = torch.zeros(len(prompts), width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt.tokens):] = torch.tensor(list(prompt.tokens))
            real[row, width - len(prompt.tokens):] = True
        # every per-prompt value in one host-to-device copy
        per_prompt = torch.tensor([[slot, p.budget, p.noise_key, p.greedy]
                                   for slot, p in zip(slots, prompts, strict=True)],
                                  dtype=torch.long).to(device)
        ids, real = ids.to(device), real.to(device)
        rows = per_prompt[:, 0]
        self.key_valid[rows] = False
        self.key_valid[rows, :width] = real
        self.positions[rows] = width - 1  # the last prompt token's; _record advances it
        self.steps[rows] = 0
        self.active[rows] = True
        self.budgets[rows] = per_prompt[:, 1]
        self.noise_keys[rows] = per_prompt[:, 2]
        if self.greedy is not None:
            self.greedy[rows] = per_prompt[:, 3].bool()
        for slot in slots:
            self._write_bound[slot] = width
        self.context.start_prefill(rows)
        positions = torch.arange(width, device=device).expand(len(prompts), width)
        # prompts of one length (a refill of one, often) need no mask: the fused causal kernel
        padded = any(len(p.tokens) != width for p in prompts)
        logits = self._logits(self.model, ids, positions,
                              causal_padding_mask(real) if padded else None)
        self._record(rows, self._sample(logits, rows))

    def keep_slots(self, slots: Sequence[int]) -> None:
        """Keep only ``slots`` (in that order) as slots ``0 .. len(slots) - 1``: a smaller decode
        batch once no prompt waits for the slots that ended. Every buffer, the KV cache
        included, is replaced by its kept rows; a captured graph of the old shape is stale."""
        rows = torch.tensor(list(slots), dtype=torch.long, device=self.tokens.device)
        for name in self._SLOT_BUFFERS:
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])
        self.context.keep_slots(rows)
        self.all_slots = torch.arange(len(rows), device=rows.device)
        self._write_bound = [self._write_bound[s] for s in slots]

    def reset(self, decode_model: torch.nn.Module | None = None) -> None:
        """Empty every slot in place, for another generate call: every buffer, the KV memory
        included, stays where a captured graph reads it. The KV memory keeps the last call's
        keys and values; a step reads them only under the key mask, which gives finite keys a
        weight of exactly zero, so the outputs are those of a new decoder."""
        self._decode_model = _weak(decode_model)
        self.tokens.fill_(self.pad_id)
        self.out_tokens.fill_(self.pad_id)
        for name in ("key_valid", "steps", "budgets", "noise_keys", "greedy", "active",
                     "out_logprobs", "out_policy_logprobs"):
            if getattr(self, name) is not None:
                getattr(self, name).zero_()
        self.positions.zero_()
        self.context.prefill_slots, self.context.horizon = None, self.max_length
        self.context.reset()
        self._write_bound = [0] * self.slots
        self.attended_positions = 0

    def take_rows(self, source: SlotDecoder, slots: Sequence[int]) -> SlotDecoder:
        """Copy ``slots`` of ``source`` (in that order) into this decoder's slots, in place:
        :meth:`keep_slots` into a decoder of the smaller shape whose buffers (and graph) are
        kept across calls. ``source`` must have this decoder's length and settings.

        Returns:
            This decoder.
        """
        rows = torch.tensor(list(slots), dtype=torch.long, device=self.tokens.device)
        for name in self._SLOT_BUFFERS:
            if getattr(self, name) is not None:
                getattr(self, name).copy_(getattr(source, name)[rows])
        self.positions.copy_(source.positions[rows])
        memory = self.context.key_value_memory_dict
        for layer, pair in source.context.key_value_memory_dict.items():
            if layer in memory:
                for mine, theirs in zip(memory[layer], pair, strict=True):
                    torch.index_select(theirs, 1, rows, out=mine)
            else:
                memory[layer] = tuple(t.index_select(1, rows) for t in pair)
        self.context.prefill_slots = None
        self.context.decode_mode = source.context.decode_mode
        self._write_bound = [source._write_bound[s] for s in slots]
        self.attended_positions = source.attended_positions
        return self

    def step(self) -> None:
        """Feed every slot's last token and sample its next one, all in place.

        Slots that are not active compute too (fixed shape) but change nothing that is read
        back: their position, step and outputs stay where they ended.
        """
        horizon = self.max_length
        if not self.fixed_context:  # no slot has a valid key past its write bound
            horizon = min(max(self._write_bound) + 1, self.max_length)
            self._write_bound = [min(b + 1, self.max_length - 1) for b in self._write_bound]
            self.attended_positions += horizon
        self.context.horizon = horizon
        self.key_valid.scatter_(1, self.positions[:, None], True)
        self.context.start_decode()
        logits = self._logits(self.decode_model, self.tokens[:, None], self.positions[:, None],
                              ~self.key_valid[:, None, None, :horizon])
        self._record(self.all_slots, self._sample(logits, self.all_slots))

    def forget_ended(self, active: Sequence[bool]) -> None:
        """Tell the decoder which slots are still decoding (read at a stop check): an ended
        slot's keys are no longer needed, so its write bound stops widening the horizon."""
        self._write_bound = [b if a else 0 for b, a in zip(self._write_bound, active,
                                                           strict=True)]

    def _logits(self, model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        output = model(ids, positions, mask, inference_context=self.context,
                       runtime_gather_output=True)
        # materialize_only_last_token_logits: [rows, 1, padded vocab (+ value channel)]
        return output[:, -1, : self.vocab_size].float()

    def _sample(self, logits: torch.Tensor, rows: torch.Tensor) -> SampledTokens:
        uniforms = uniforms_at_step(self.noise_keys[rows], self.steps[rows])
        greedy = None if self.greedy is None else self.greedy[rows]
        return sample_tokens(logits, uniforms, self.config, greedy)

    def _record(self, rows: torch.Tensor, sampled: SampledTokens) -> None:
        """Write the sampled tokens of active ``rows`` at their step and advance those rows."""
        active, steps = self.active[rows], self.steps[rows]
        token = torch.where(active, sampled.tokens, self.pad_id)
        at = (rows, steps)
        self.out_tokens.index_put_(at, token)
        self.out_logprobs.index_put_(at, torch.where(active, sampled.logprobs, 0.0))
        self.out_policy_logprobs.index_put_(at, torch.where(active, sampled.policy_logprobs, 0.0))
        ended = steps + 1 >= self.budgets[rows]
        if self.eos_ids is not None:
            ended = ended | torch.isin(token, self.eos_ids)
        if self.stop_sequences:  # the response so far is out_tokens[row, :step + 1]
            ended = ended | ends_with_stop_sequence(self.out_tokens, rows, steps + 1,
                                                    self.stop_sequences)
        continues = active & ~ended
        self.tokens.index_put_((rows,), token)
        # an ended slot keeps its position (it may be the last one of the cache)
        self.positions.index_put_((rows,), self.positions[rows] + continues.long())
        self.steps.index_put_((rows,), steps + active.long())
        self.active.index_put_((rows,), continues)

    def cache_bytes(self) -> int:
        """Bytes of the KV memory allocated so far."""
        return self.context.cache_bytes()

    def undo_steps(self) -> Callable[[], None]:
        """A function that puts the decoding state back as it is now, undoing the decode steps
        run in between (those of a graph's warm-up) as long as they ran at these positions:
        the counters, the key flags, and the keys, values and outputs a step writes at each
        slot's current position and step. Afterwards the decoder is exactly as if they never
        ran (tested), so warming up neither consumes a token nor leaves a key marked valid."""
        rows, steps, positions = self.all_slots, self.steps.clone(), self.positions.clone()
        whole = [(t, t.clone()) for t in (self.tokens, self.positions, self.steps, self.active,
                                          self.key_valid)]
        entries = [(t, (rows, steps)) for t in (self.out_tokens, self.out_logprobs,
                                                self.out_policy_logprobs)]
        entries += [(t, (positions, rows)) for pair in self.context.key_value_memory_dict.values()
                    for t in pair]
        entries = [(t, at, t[at]) for t, at in entries]
        mode = (self.context.prefill_slots, self.context.decode_mode)

        def undo() -> None:
            for tensor, value in whole:
                tensor.copy_(value)
            for tensor, at, value in entries:
                tensor.index_put_(at, value)
            self.context.prefill_slots, self.context.decode_mode = mode

        return undo

    def graph_buffers(self) -> dict[str, torch.Tensor]:
        """Every tensor a decode step reads or writes, by name: the slot buffers, the positions,
        the KV memory, the end ids and the decode model's parameters and buffers (what a
        captured graph holds the addresses of)."""
        named = {name: getattr(self, name) for name in self._SLOT_BUFFERS
                 if getattr(self, name) is not None}
        named.update(all_slots=self.all_slots, positions=self.positions)
        if self.eos_ids is not None:
            named["eos_ids"] = self.eos_ids
        for i, pair in enumerate(self.stop_sequences):
            named.update({f"stop_sequences[{i}].{kind}": t
                          for kind, t in zip(("ids", "offsets"), pair, strict=True)})
        for layer, pair in self.context.key_value_memory_dict.items():
            named.update({f"kv[{layer}].{kind}": t for kind, t in zip(("keys", "values"), pair,
                                                                       strict=True)})
        named.update({f"model.{name}": t for name, t in self.model.named_parameters()})
        named.update({f"model.{name}": t for name, t in self.model.named_buffers()})
        return named


def _weak(model: torch.nn.Module | None) -> weakref.ref | None:
    return None if model is None else weakref.ref(model)


class DecodeGraph:
    """:meth:`SlotDecoder.step` captured into one CUDA graph and replayed per token.

    The graph holds the addresses of the decoder's buffers and of the model's parameters: it is
    valid while they stay where they are. Continuous batching keeps it, with its decoder, across
    ``generate_sequences`` calls (``continuous.DecodeGraphs``): a refit that copies new weights
    into the parameters' storage is read by the next replay; parameters that moved (offloaded
    and reloaded, reallocated) make it capture again.
    """

    WARMUP_STEPS = 2

    def __init__(self, decoder: SlotDecoder) -> None:
        """Warm up on a side stream and capture (kernels are launched once for warm-up, and the
        state they advanced is restored, so capturing does not consume a token). On CPU (only
        with :data:`EMULATE_GRAPHS_ENV` set) the step is captured into a checking
        :class:`~megatron_rlhf.testing.graph_standin.StandInGraph`.

        Raises:
            RuntimeError: a CPU decoder without :data:`EMULATE_GRAPHS_ENV` set.
        """
        self.decoder = decoder
        cuda = decoder.tokens.device.type == "cuda"
        undo = decoder.undo_steps()
        stream = torch.cuda.Stream() if cuda else None
        if cuda:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            for _ in range(self.WARMUP_STEPS):
                decoder.step()
                undo()
        if cuda:
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, capture_error_mode=CAPTURE_ERROR_MODE):
                decoder.step()
        elif emulating_graphs():  # the stand-in runs the step once to check it, and undoes it
            from megatron_rlhf.testing.graph_standin import StandInGraph

            self.graph = StandInGraph(decoder.step, decoder.graph_buffers,
                                      capture_error_mode=CAPTURE_ERROR_MODE)
        else:
            raise RuntimeError(f"no graph of a decode step on {decoder.tokens.device}: on CPU "
                               f"only stand-in graphs, with {EMULATE_GRAPHS_ENV}=1")
        undo()  # capturing ran nothing on CUDA; this puts the context's mode back

    def step(self) -> None:
        """One decode step (replays the captured kernels)."""
        self.graph.replay()


def graphs_enabled(config: GenerationConfig, device: torch.device) -> bool:
    """Whether ``config.cuda_graphs`` asks for graphs on ``device`` (``auto`` or ``on``: on CUDA;
    on CPU only stand-in graphs, with :data:`EMULATE_GRAPHS_ENV` set)."""
    return (config.continuous and config.cuda_graphs != "off"
            and (device.type == "cuda" or (device.type == "cpu" and emulating_graphs())))


def emulating_graphs() -> bool:
    """Whether :data:`EMULATE_GRAPHS_ENV` asks for stand-in graphs on CPU."""
    return os.environ.get(EMULATE_GRAPHS_ENV, "") == "1"


def graph_refusal(model: torch.nn.Module) -> str | None:
    """Why ``model``'s decode step cannot be captured into a CUDA graph (None: it can)."""
    if getattr(model.config, "num_moe_experts", None):
        return MOE_GRAPH_REFUSAL
    return None


_REFUSALS_LOGGED: set[str] = set()
"""The refusals logged so far: one line per reason and process, not one per call."""


def with_graph_setting(config: GenerationConfig, model: torch.nn.Module) -> GenerationConfig:
    """``config`` with ``cuda_graphs`` as ``model`` can honour it: ``auto`` runs a model whose
    decode step cannot be captured (:func:`graph_refusal`) eagerly, saying why once.

    Raises:
        ValueError: ``cuda_graphs=on`` for such a model.
    """
    why = graph_refusal(model) if config.continuous and config.cuda_graphs != "off" else None
    if why is None:
        return config
    if config.cuda_graphs == "on":
        raise ValueError(f"generation.cuda_graphs=on, but {why}; set generation.cuda_graphs="
                         "auto (decodes this model eagerly) or off")
    if why not in _REFUSALS_LOGGED:
        _REFUSALS_LOGGED.add(why)
        logger.warning("generation.cuda_graphs=auto: decoding without CUDA graphs: %s", why)
    return dataclasses.replace(config, cuda_graphs="off")
