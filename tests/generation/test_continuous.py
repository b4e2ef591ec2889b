"""Continuous batching (``generation.batching=continuous``) against the static loop it replaces.

Every prompt gets the static loop's tokens whatever the number of slots, the stop-check interval,
the end ids or the number of samples per prompt; a finished slot really takes the next waiting
prompt; every decode call has one shape; weights refitted in place are the ones decoded with.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlhf.generation import GenerationConfig, GenerationOutput, generate_sequences
from megatron_rlhf.generation.decode_step import batch_bucket, graphs_enabled, length_bucket
from tests.generation.helpers import (
    BASE,
    INIT_SEED,
    MIN_MARGIN,
    PAD,
    SAMPLES,
    assert_same_samples,
    build_tiny,
    decision_margin,
    generate_tiny,
    make_prompts,
    split_work,
)


@pytest.mark.parametrize("slots,interval", [(0, 1), (1, 3), (3, 1), (3, 8), (4, 5), (16, 2)])
def test_continuous_batching_gives_the_static_loops_tokens(tiny, end_ids, static_reference,
                                                           slots: int, interval: int) -> None:
    config = dataclasses.replace(BASE, micro_batch_size=slots, stop_check_interval=interval)
    assert_same_samples(generate_tiny(tiny, config, end_ids), static_reference)


@pytest.mark.parametrize("config", [
    GenerationConfig(max_new_tokens=10, greedy=True, micro_batch_size=2),
    GenerationConfig(max_new_tokens=10, temperature=0.7, top_k=20, seed=11, micro_batch_size=3,
                     stop_check_interval=2),
], ids=["greedy", "top-k"])
def test_continuous_batching_equals_static_with_other_samplers(tiny, end_ids, config) -> None:
    reference = generate_tiny(tiny, dataclasses.replace(config, batching="static"), end_ids[0])
    # seed 11: seed 8 had a draw 5e-6 from its token's edge, near another CPU's rounding
    assert decision_margin(tiny, reference, config, list(range(30, 44))) > MIN_MARGIN
    assert_same_samples(generate_tiny(tiny, config, end_ids[0]), reference)


def _call_shapes(tiny, config, eos_id) -> tuple[GenerationOutput, list[tuple[int, int]]]:
    shapes = []
    hook = tiny[0].register_forward_pre_hook(
        lambda module, args: shapes.append(tuple(args[0].shape)))
    try:
        return generate_tiny(tiny, config, eos_id), shapes
    finally:
        hook.remove()


def test_a_finished_slot_takes_the_next_prompt_and_decode_calls_keep_one_shape(tiny) -> None:
    """With 4 slots for 14 prompts whose lengths vary widely (30 end ids, about one token in
    eight ends a reply), prompts enter as others end (several prefills, each into the slots
    that ended), every decode call feeds [4, 1] until the queue drains and then the bucket of
    the slots still decoding ([2, 1], [1, 1]), each attending over fewer positions than the
    32 of the cache, and the decode calls run fewer row steps than the static loop's
    micro-batches of 4, which decode until their longest row ends."""
    config = dataclasses.replace(BASE, micro_batch_size=4, stop_check_interval=1)
    end_ids = list(range(200, 230))
    out, shapes = _call_shapes(tiny, config, end_ids)
    assert out.response_lengths.max() - out.response_lengths.min() >= 6
    prefills, decodes = split_work(out)
    assert len(prefills) > 14 // 4 and sum(w.rows for w in prefills) == 14
    assert prefills[0].rows == 4 and all(1 <= w.rows <= 4 for w in prefills)
    assert decodes[0].rows == 4 and len(decodes) > 1
    assert all(later.rows < earlier.rows for earlier, later in zip(decodes, decodes[1:], strict=False))
    # eager steps attend only up to the furthest position a decoding slot may have written
    assert all(w.rows in (1, 2, 4) and w.prompt_width == 0 and 11 < w.decode_context < 32
               for w in decodes)
    assert [s for s in shapes if s[1] == 1] == [(w.rows, 1) for w in decodes
                                                for _ in range(w.forwards)]
    assert sorted(s for s in shapes if s[1] != 1) == sorted(
        (w.rows, w.prompt_width) for w in prefills)
    static = generate_tiny(tiny, dataclasses.replace(config, batching="static"), end_ids)
    static_row_steps = sum(w.rows * (w.forwards - 1) for w in static.micro_batches)
    assert sum(w.rows * w.forwards for w in decodes) < static_row_steps
    assert sum(out.response_lengths) == sum(static.response_lengths)


def test_with_every_prompt_in_one_batch_the_decode_batch_shrinks_as_rows_end(tiny) -> None:
    """Nothing waits for a slot (micro_batch_size=0): the 16 slots of 14 prompts become 8, 4,
    ... as rows end, each shape the bucket of the rows still decoding, so the decode steps
    compute fewer rows than the static batch, which runs all 14 until its longest row ends."""
    config = dataclasses.replace(BASE, stop_check_interval=2)
    end_ids = list(range(200, 230))
    model, pgc = tiny
    prompts = [p for p in make_prompts([4, 9, 2, 6, 11, 3, 5], seed=6) for _ in range(SAMPLES)]
    caches = []
    out = generate_sequences(model, pgc, prompts, list(range(30, 30 + len(prompts))), config,
                             eos_id=end_ids, pad_id=PAD, on_cache=caches.append)
    prefills, decodes = split_work(out)
    assert [w.rows for w in prefills] == [14]
    assert decodes[0].rows == 16 and decodes[-1].rows < 16
    assert all(w.forwards % 2 == 0 for w in decodes[:-1])  # shrinking happens at stop checks
    # the memory accounting sees the cache of all 16 slots, not the one it shrank to
    arch = model.config
    head_dim = arch.kv_channels
    assert caches == [2 * arch.num_layers * 16 * 32 * arch.num_query_groups * head_dim * 4]
    static = generate_tiny(tiny, dataclasses.replace(config, batching="static"), end_ids)
    (work,) = static.micro_batches
    assert sum(w.rows * w.forwards for w in decodes) < work.rows * (work.forwards - 1)
    assert_same_samples(out, static)


@pytest.mark.parametrize("compile_decode", [False, True])
def test_an_eager_step_attends_up_to_the_written_positions_a_fixed_shape_one_all(
        tiny, compile_decode: bool) -> None:
    from megatron_rlhf.generation.decode_step import DecodeSettings, SlotDecoder, SlotPrompt

    model = tiny[0].eval()
    config = dataclasses.replace(BASE, compile_decode=compile_decode)
    decoder = SlotDecoder(model, 2, DecodeSettings(config, 249, PAD, model.vocab_size, 32))
    with torch.no_grad():
        decoder.prefill([0, 1], [SlotPrompt([5, 6, 7], 1, 8, False), SlotPrompt([9], 2, 8, False)])
        horizons = []
        for _ in range(3):
            decoder.step()
            horizons.append(decoder.context.horizon)
    # the prefill wrote positions 0-2 (left-padded to 3); step i writes position 3 + i
    assert horizons == ([32] * 3 if compile_decode else [4, 5, 6])
    assert decoder.attended_positions == (0 if compile_decode else 15)
    from megatron_rlhf.generation.continuous import _decode_work

    # what the FLOP count reads: the whole bucket, or the mean attended (15 / 3)
    assert _decode_work(2, 3, decoder, 0).decode_context == (32 if compile_decode else 5)


def test_refit_weights_copied_in_place_are_the_ones_decoded_with(world) -> None:
    """A refit writes new weights into the parameters' own storage (megatron's resharding copies
    into views of them): no parameter moves, which is what a captured CUDA graph relies on, and
    the next generate call decodes with the new weights: the tokens of a model built with them."""
    from megatron_rlhf.models.weights import init_weights
    from megatron_rlhf.refit import ModelLayout, build_weight_sync

    target, pgc = build_tiny()
    source, _ = build_tiny()
    init_weights(source, pgc, seed=INIT_SEED + 1)
    config = dataclasses.replace(BASE, micro_batch_size=3, stop_at_eos=False)
    before = generate_tiny((target, pgc), config, None)
    addresses = [p.data_ptr() for p in target.parameters()]

    build_weight_sync(source, pgc, ModelLayout(0), target, pgc, ModelLayout(0)).sync()

    assert [p.data_ptr() for p in target.parameters()] == addresses
    after = generate_tiny((target, pgc), config, None)
    assert_same_samples(after, generate_tiny((source, pgc), config, None))
    assert not torch.equal(after.input_ids, before.input_ids)


def test_without_the_kv_cache_the_static_loop_runs() -> None:
    assert BASE.continuous and not dataclasses.replace(BASE, use_kv_cache=False).continuous


def test_buckets_and_graph_switch() -> None:
    assert [batch_bucket(n, 0) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert [batch_bucket(n, 6) for n in (1, 3, 5, 100)] == [1, 4, 6, 6]
    assert [length_bucket(n) for n in (1, 32, 33, 100)] == [32, 32, 64, 128]
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not graphs_enabled(BASE, cpu) and graphs_enabled(BASE, cuda)
    assert not graphs_enabled(dataclasses.replace(BASE, cuda_graphs="off"), cuda)
    assert not graphs_enabled(dataclasses.replace(BASE, batching="static"), cuda)
    assert graphs_enabled(dataclasses.replace(BASE, cuda_graphs="on"), cuda)


@pytest.mark.parametrize("fields,match", [
    ({"batching": "dynamic"}, "generation.batching='dynamic' must be 'continuous' or 'static'"),
    ({"cuda_graphs": "always"},
     "generation.cuda_graphs='always' must be 'auto', 'on' or 'off'"),
    ({"cuda_graphs": "on", "batching": "static"},
     "generation.cuda_graphs=on captures the continuous loop's decode step; it needs "
     "batching=continuous"),
])
def test_bad_batching_settings_are_refused(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**fields)


def test_models_without_slot_attention_are_refused(tiny) -> None:
    from megatron_rlhf.models.attention import as_megatron_self_attention

    with as_megatron_self_attention(tiny[0]), pytest.raises(
            ValueError, match="batching=continuous needs .*CachedRopeSelfAttention"):
        generate_tiny(tiny, BASE, 249)


class _ScalarReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts reads of one tensor element into Python (``int(t)``, ``t.item()``): on a GPU each
    is a device synchronisation."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_stop_check_reads_the_slots_in_one_transfer_not_one_per_slot(tiny, end_ids) -> None:
    """The host learns which slots ended and their lengths from one read per stop check; a
    per-slot ``int()`` was a device synchronisation for every finished prompt."""
    config = dataclasses.replace(BASE, micro_batch_size=4, stop_check_interval=2)
    with _ScalarReads() as reads:
        out = generate_tiny(tiny, config, end_ids)
    assert out.response_lengths.min() < out.response_lengths.max()  # slots ended at many checks
    assert reads.count == 0
