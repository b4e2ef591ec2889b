"""What the kept decode graphs hold, and when it is freed; one capture per slot count per run.

Under ``MEGATRON_RLHF_EMULATE_CUDA_GRAPHS=1`` (stand-in graphs on CPU) a model generating with
``keep_graphs`` keeps a decoder (its KV memory) and a captured step per slot count. Nothing of
that may keep the model alive: dropping the model frees all of it, ``release_decode_graphs``
frees the decoders and graphs while the model lives, and a call that does not keep them frees
them when it returns. The graphs are captured in ``thread_local`` mode, and with ``max_length``
calls of other prompt lengths replay the first call's graphs.
"""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from megatron_rlhf.generation import generate_sequences
from megatron_rlhf.generation.continuous import (
    decode_graphs,
    kept_slot_counts,
    release_decode_graphs,
)
from megatron_rlhf.generation.decode_step import CAPTURE_ERROR_MODE
from megatron_rlhf.testing.graph_standin import EMULATE_ENV, GraphCaptureError, StandInGraph
from tests.generation.helpers import (
    BASE,
    PAD,
    assert_same_samples,
    build_tiny,
    generate_tiny,
    make_prompts,
    split_work,
)

FIELDS = ("input_ids", "attention_mask", "prompt_mask", "response_mask", "response_logprobs",
          "response_policy_logprobs", "prompt_lengths", "response_lengths")
ENDS = list(range(200, 230))
"""End ids that stop rows at different steps: the slots shrink."""


@pytest.fixture
def emulate(monkeypatch) -> None:
    monkeypatch.setenv(EMULATE_ENV, "1")


def _kept_refs(model: torch.nn.Module) -> list[weakref.ref]:
    """Weak references to everything kept for ``model``: its decoders, their KV memory and
    the captured steps."""
    kept = decode_graphs(model)
    assert kept.decoders and kept.graphs, "nothing was kept"
    refs = [weakref.ref(d) for d in kept.decoders.values()]
    refs += [weakref.ref(t) for d in kept.decoders.values()
             for pair in d.context.key_value_memory_dict.values() for t in pair]
    refs += [weakref.ref(g) for g in kept.graphs.values()]
    refs += [weakref.ref(g.graph) for g in kept.graphs.values()]
    return refs


def test_a_dropped_model_frees_its_kept_graphs_and_caches(world, emulate) -> None:
    """The kept decoders refer to their model weakly: dropping the model (a move or rebuild
    dropping the old engine) leaves the model, its KV caches and graphs collectable."""
    model, pgc = build_tiny()
    generate_tiny((model, pgc), dataclasses.replace(BASE, stop_check_interval=2), ENDS)
    refs = [weakref.ref(model), *_kept_refs(model)]
    del model
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)


def test_release_frees_the_kept_graphs_while_the_model_lives(world, emulate) -> None:
    model, pgc = build_tiny()
    generate_tiny((model, pgc), BASE, ENDS)
    refs = _kept_refs(model)
    release_decode_graphs(model)
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)
    assert not decode_graphs(model).decoders


def test_a_call_that_keeps_nothing_frees_its_graphs_when_it_returns(world, emulate,
                                                                     monkeypatch) -> None:
    """``keep_graphs=False`` (a model that trains or is offloaded on its ranks): the call's
    decoders, KV memory and graphs are gone once it returns."""
    model, pgc = build_tiny()
    refs: list[weakref.ref] = []
    original = StandInGraph.__init__

    def recording(graph, step, watched, **kwargs):
        original(graph, step, watched, **kwargs)
        refs.append(weakref.ref(graph))
        refs.extend(weakref.ref(t) for name, t in watched().items() if name.startswith("kv["))

    monkeypatch.setattr(StandInGraph, "__init__", recording)
    prompts = make_prompts([4, 9, 2, 6, 11, 3, 5], seed=6)
    generate_sequences(model, pgc, prompts, list(range(len(prompts))), BASE, ENDS, PAD,
                       keep_graphs=False)
    gc.collect()
    assert refs and [ref() for ref in refs] == [None] * len(refs)
    assert weakref.ref(model)() is model


def test_the_kept_caches_are_one_per_kept_slot_count(world, emulate) -> None:
    """14 prompts in 16 slots shrink to 8: both decoders stay, each as long as ``max_length``
    asks (``engine.run.stage_memory`` predicts this memory from ``kept_slot_counts``)."""
    model, pgc = build_tiny()
    config = dataclasses.replace(BASE, stop_check_interval=2)
    prompts = make_prompts([4, 9, 2, 6, 11, 3, 5] * 2, seed=6)
    generate_sequences(model, pgc, prompts, list(range(14)), config, ENDS, PAD, max_length=40)
    kept = decode_graphs(model)
    assert sorted(kept.decoders, reverse=True) == kept_slot_counts(14, 0) == [16, 8]
    arch = model.config
    kv_bytes = 2 * arch.num_layers * arch.num_query_groups * arch.kv_channels * 4  # fp32
    assert kept.cache_bytes() == (16 + 8) * 64 * kv_bytes  # 40 positions: a 64-long bucket
    release_decode_graphs(model)


def test_capture_uses_the_thread_local_mode(tiny, emulate) -> None:
    """A global-mode capture fails when the transfer thread's NCCL allocates meanwhile: the
    decode step is captured in thread_local mode, and the stand-in refuses global."""
    captured = []
    original = StandInGraph.__init__

    def recording(graph, step, watched, **kwargs):
        original(graph, step, watched, **kwargs)
        captured.append(graph.capture_error_mode)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(StandInGraph, "__init__", recording)
        generate_sequences(*tiny, [[5, 6, 7]], [0], BASE, ENDS, PAD, keep_graphs=False)
    assert captured and set(captured) == {CAPTURE_ERROR_MODE} == {"thread_local"}
    with pytest.raises(GraphCaptureError, match="capture with 'thread_local'"):
        StandInGraph(lambda: None, dict, capture_error_mode="global")
    with pytest.raises(ValueError, match="must be one of"):
        StandInGraph(lambda: None, dict, capture_error_mode="local")


def test_calls_of_other_prompt_lengths_share_one_capture(tiny, end_ids, emulate) -> None:
    """Without ``max_length`` a call with prompts past the first length bucket captures again
    (and drops the graphs of the other length); with it (the run's longest prompt plus
    max_new_tokens) every call replays the first call's graph. The outputs do not change, and
    are the eager loop's."""
    short = make_prompts([3, 5, 4, 2], seed=1)
    long = make_prompts([30, 41, 36, 44], seed=2)  # 44 + 12 tokens: the 64-long bucket
    config = dataclasses.replace(BASE, micro_batch_size=4, stop_check_interval=2)

    def three_calls(max_length: int) -> tuple[int, list]:
        release_decode_graphs(tiny[0])
        before = StandInGraph.captures
        outs = [generate_sequences(*tiny, prompts, list(range(30, 34)), config, end_ids, PAD,
                                   max_length=max_length) for prompts in (short, long, short)]
        release_decode_graphs(tiny[0])
        return StandInGraph.captures - before, outs

    own_captures, own = three_calls(0)
    shared_captures, shared = three_calls(44 + BASE.max_new_tokens)
    assert own_captures == 3
    assert shared_captures == 1
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv(EMULATE_ENV)
        eager = [generate_sequences(*tiny, prompts, list(range(30, 34)), config, end_ids, PAD)
                 for prompts in (short, long, short)]
    for out, other, reference in zip(shared, own, eager, strict=True):
        assert_same_samples(out, other)
        assert_same_samples(out, reference)
        assert [w.rows for w in split_work(out)[1]] == [4]
