"""generate_sequences on a tiny model in one process: KV cache, log-probs, seeding, edge cases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.generation import (
    GenerationConfig,
    GenerationOutput,
    MicroBatchWork,
    generate_sequences,
)
from tests.generation.helpers import MIN_MARGIN, build_tiny, decision_margin, make_prompts
from tests.helpers.models import full_forward_logprobs

EOS, PAD = 249, 0
LENGTHS = [5, 1, 12, 7, 3]


def _generate(tiny, prompts, config, indices=None, eos_id=EOS) -> GenerationOutput:
    model, pgc = tiny
    indices = list(range(len(prompts))) if indices is None else indices
    return generate_sequences(model, pgc, prompts, indices, config, eos_id=eos_id, pad_id=PAD)


def _responses(out: GenerationOutput) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(out.responses, out.response_lengths, strict=True)]


@pytest.mark.parametrize("head", ["lm", "lm+scalar"])
def test_kv_cache_greedy_equals_recomputation(tiny, head: str) -> None:
    model_and_groups = tiny if head == "lm" else build_tiny(head)
    prompts = make_prompts(LENGTHS)
    config = GenerationConfig(max_new_tokens=16, greedy=True, stop_at_eos=False)
    cached = _generate(model_and_groups, prompts, config)
    recomputed = _generate(model_and_groups, prompts,
                           GenerationConfig(max_new_tokens=16, greedy=True, stop_at_eos=False,
                                            use_kv_cache=False, batching="static"))
    # Other shapes per step (one new token against the whole sequence): equal greedy tokens
    # need every top-2 logit gap clear of rounding.
    assert decision_margin(model_and_groups, recomputed, config, list(range(5))) > MIN_MARGIN
    assert torch.equal(cached.input_ids, recomputed.input_ids)
    assert cached.input_ids.shape == (5, 12 + 16)
    assert cached.response_lengths.tolist() == [16] * 5
    torch.testing.assert_close(cached.response_policy_logprobs,
                               recomputed.response_policy_logprobs, rtol=0, atol=1e-5)


def test_layout_masks_and_padding(tiny) -> None:
    prompts = make_prompts(LENGTHS)
    out = _generate(tiny, prompts, GenerationConfig(max_new_tokens=4, greedy=True,
                                                    stop_at_eos=False))
    assert out.prompt_length == 12
    assert out.prompt_lengths.tolist() == LENGTHS
    for row, prompt in enumerate(prompts):
        pad = 12 - len(prompt)
        assert out.input_ids[row, pad:12].tolist() == prompt
        assert out.input_ids[row, :pad].tolist() == [PAD] * pad
        assert out.prompt_mask[row].tolist() == [0] * pad + [1] * len(prompt)
    assert torch.equal(out.attention_mask, torch.cat([out.prompt_mask, out.response_mask], 1))


@pytest.mark.parametrize("training", [True, False])
def test_train_eval_mode_is_restored(tiny, training: bool) -> None:
    tiny[0].train(training)
    _generate(tiny, [[1, 2, 3]], GenerationConfig(max_new_tokens=2))
    assert tiny[0].training is training


def test_logprobs_equal_one_full_forward(tiny) -> None:
    prompts = make_prompts(LENGTHS, seed=1)
    plain = _generate(tiny, prompts, GenerationConfig(max_new_tokens=20, temperature=0.7, seed=3))
    reference = full_forward_logprobs(*tiny, plain, temperature=0.7)
    torch.testing.assert_close(plain.response_policy_logprobs, reference, rtol=0, atol=1e-4)
    torch.testing.assert_close(plain.response_logprobs, reference, rtol=0, atol=1e-4)

    filtered = _generate(tiny, prompts, GenerationConfig(max_new_tokens=20, temperature=0.7,
                                                         top_k=50, top_p=0.9, seed=3))
    reference = full_forward_logprobs(*tiny, filtered, temperature=0.7)
    torch.testing.assert_close(filtered.response_policy_logprobs, reference, rtol=0, atol=1e-4)
    real = filtered.response_mask.bool()
    assert torch.all(filtered.response_logprobs[real] > reference[real])
    assert torch.all(filtered.response_logprobs[~real] == 0)


def test_same_seed_same_samples_other_seed_other_samples(tiny) -> None:
    prompts = make_prompts(LENGTHS, seed=2)
    first = _generate(tiny, prompts, GenerationConfig(max_new_tokens=12, seed=5))
    again = _generate(tiny, prompts, GenerationConfig(max_new_tokens=12, seed=5))
    other = _generate(tiny, prompts, GenerationConfig(max_new_tokens=12, seed=6))
    assert torch.equal(first.input_ids, again.input_ids)
    assert torch.equal(first.response_logprobs, again.response_logprobs)
    assert not torch.equal(first.input_ids, other.input_ids)


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_batch_split_and_order_do_not_change_samples(tiny, use_kv_cache: bool) -> None:
    prompts = make_prompts([4, 9, 2, 6, 11, 3], seed=3)
    indices = [100, 7, 42, 3, 55, 8]
    # seed 21: with seed 9 a draw sat 2.5e-6 from its token's edge, which the other batch
    # shapes' rounding could cross on another CPU
    config = GenerationConfig(max_new_tokens=10, temperature=1.0, top_p=0.95, seed=21,
                              use_kv_cache=use_kv_cache,
                              batching="continuous" if use_kv_cache else "static")
    reference = _generate(tiny, prompts, config, indices)
    assert decision_margin(tiny, reference, config, indices) > MIN_MARGIN
    whole = _responses(reference)
    first = _responses(_generate(tiny, prompts[:2], config, indices[:2]))
    rest = _responses(_generate(tiny, prompts[:1:-1], config, indices[:1:-1]))
    assert whole == first + rest[::-1]


def test_micro_batches_and_stop_checks_do_not_change_the_output(tiny) -> None:
    """Decoding in micro-batches (a bounded KV cache) and checking for the end only every few
    tokens give the same tokens and masks as one batch checked every token, and log-probs equal
    up to rounding (other batch shapes and padding widths change the reduction order); the split
    puts the widest prompt and the longest response in different micro-batches, so re-padding
    is exercised."""
    prompts = make_prompts([4, 9, 2, 6, 11, 3, 5], seed=6)
    indices = list(range(20, 27))
    base = dict(max_new_tokens=12, temperature=1.0, seed=4)
    reference = _generate(tiny, prompts, GenerationConfig(**base, stop_check_interval=1),
                          indices)
    tokens = reference.responses[0].tolist()
    eos = next(t for t in tokens[2:] if t != PAD)  # some rows stop early, others run to 12
    reference = _generate(tiny, prompts, GenerationConfig(**base, stop_check_interval=1),
                          indices, eos_id=eos)
    assert reference.response_lengths.min() < reference.response_lengths.max()
    assert decision_margin(tiny, reference, GenerationConfig(**base), indices) > MIN_MARGIN
    for micro, interval in [(2, 1), (3, 8), (7, 5), (1, 3)]:
        out = _generate(tiny, prompts, GenerationConfig(**base, micro_batch_size=micro,
                                                        stop_check_interval=interval),
                        indices, eos_id=eos)
        for name in ("input_ids", "attention_mask", "prompt_mask", "response_mask",
                     "prompt_lengths", "response_lengths"):
            assert torch.equal(getattr(out, name), getattr(reference, name)), (micro, name)
        for name in ("response_logprobs", "response_policy_logprobs"):
            torch.testing.assert_close(getattr(out, name), getattr(reference, name), rtol=0,
                                       atol=1e-5)


def test_greedy_every_decodes_the_rows_its_index_picks_greedily(tiny) -> None:
    """Rows whose prompt index is a multiple of ``greedy_every`` are the greedy decoder's
    answers (with log-prob 0 under the point mass they are drawn from, and the policy's
    log-probs); the other rows are the plain sampler's, bitwise, whatever batch they are in."""
    prompts = make_prompts([4, 9, 2, 6, 11, 3], seed=8)
    indices = [10, 7, 42, 3, 55, 8]
    base = dict(max_new_tokens=10, seed=3)
    mixed = _generate(tiny, prompts, GenerationConfig(**base, greedy_every=2), indices)
    sampled = _generate(tiny, prompts, GenerationConfig(**base), indices)
    greedy = _generate(tiny, prompts, GenerationConfig(**base, greedy=True), indices)
    picked = [index % 2 == 0 for index in indices]
    for row, is_greedy in enumerate(picked):
        reference = greedy if is_greedy else sampled
        assert _responses(mixed)[row] == _responses(reference)[row], row
    assert _responses(mixed) != _responses(sampled)
    real = mixed.response_mask.bool()
    rows = torch.tensor(picked)
    assert torch.all(mixed.response_logprobs[rows] == 0)
    assert torch.all(mixed.response_logprobs[~rows][real[~rows]] < 0)
    policy = full_forward_logprobs(*tiny, mixed, 1.0)
    torch.testing.assert_close(mixed.response_policy_logprobs, policy, rtol=0, atol=1e-5)
    # mixed against sampled and greedy: one batch, the same logits; alone: another batch shape
    assert decision_margin(tiny, mixed, GenerationConfig(**base, greedy_every=2),
                           indices) > MIN_MARGIN
    alone = _generate(tiny, prompts[2:3], GenerationConfig(**base, greedy_every=2), indices[2:3])
    assert _responses(alone) == _responses(mixed)[2:3]


def _model_call_widths(tiny, prompts, config, eos_id=EOS) -> tuple[GenerationOutput, list]:
    """Generate, and record the ``[rows, tokens]`` shape of every call of the model."""
    model = tiny[0]
    shapes = []
    hook = model.register_forward_pre_hook(lambda module, args: shapes.append(
        tuple(args[0].shape)))
    try:
        out = _generate(tiny, prompts, config, eos_id=eos_id)
    finally:
        hook.remove()
    return out, shapes


@pytest.mark.parametrize("use_kv_cache", [True, False])
def test_micro_batch_work_is_what_the_model_ran(tiny, use_kv_cache: bool) -> None:
    """The static loop (``batching=static``): each micro-batch is padded to its own longest prompt, and the record says so: rows,
    prompt width and model calls equal a count from the prompts, and the shapes of the calls
    the model saw (a prefill of the prompt width then one token per call with the cache; the
    whole sequence so far without it)."""
    lengths, micro, new_tokens = [4, 9, 2, 6, 11, 3, 5], 3, 4
    config = GenerationConfig(max_new_tokens=new_tokens, temperature=1.0, seed=2,
                              stop_at_eos=False, micro_batch_size=micro,
                              use_kv_cache=use_kv_cache, batching="static")
    out, shapes = _model_call_widths(tiny, make_prompts(lengths, seed=8), config)

    by_hand = [MicroBatchWork(rows=len(lengths[i:i + micro]),
                              prompt_width=max(lengths[i:i + micro]), forwards=new_tokens,
                              kv_cache=use_kv_cache)
               for i in range(0, len(lengths), micro)]
    assert [(w.rows, w.prompt_width) for w in by_hand] == [(3, 9), (3, 11), (1, 5)]
    assert list(out.micro_batches) == by_hand
    expected_calls = []
    for work in by_hand:
        if use_kv_cache:
            expected_calls += [(work.rows, work.prompt_width)] + [(work.rows, 1)] * (new_tokens - 1)
        else:
            expected_calls += [(work.rows, work.prompt_width + t) for t in range(new_tokens)]
    assert shapes == expected_calls


def test_micro_batch_work_counts_the_calls_of_an_early_stop(tiny) -> None:
    """Rows that all stop early end the loop at the next stop check: the record counts the
    calls that ran, not the budget."""
    prompt = make_prompts([6], seed=5)[0]
    free = _generate(tiny, [prompt] * 2, GenerationConfig(max_new_tokens=10, greedy=True,
                                                          stop_at_eos=False))
    tokens = free.responses[0].tolist()
    step = next(t for t in range(2, 10) if tokens[t] not in tokens[:t])
    out, shapes = _model_call_widths(
        tiny, [prompt] * 2, GenerationConfig(max_new_tokens=10, greedy=True, batching="static",
                                             stop_check_interval=1), eos_id=tokens[step])
    assert out.micro_batches == (MicroBatchWork(2, 6, step + 1, True),)
    assert len(shapes) == step + 1 < 10


def test_top_k_1_equals_greedy(tiny) -> None:
    prompts = make_prompts(LENGTHS, seed=4)
    greedy = _generate(tiny, prompts, GenerationConfig(max_new_tokens=8, greedy=True))
    top1 = _generate(tiny, prompts, GenerationConfig(max_new_tokens=8, top_k=1, seed=1))
    assert torch.equal(greedy.input_ids, top1.input_ids)


def test_all_sequences_stop_at_once_and_early_stops_are_padded(tiny) -> None:
    prompt = make_prompts([6], seed=5)[0]
    free = _generate(tiny, [prompt] * 3, GenerationConfig(max_new_tokens=10, greedy=True,
                                                          stop_at_eos=False))
    tokens = free.responses[0].tolist()
    step = next(t for t in range(2, 10) if tokens[t] not in tokens[:t])
    stopped = _generate(tiny, [prompt] * 3, GenerationConfig(max_new_tokens=10, greedy=True),
                        eos_id=tokens[step])
    assert stopped.responses.shape == (3, step + 1)
    assert stopped.response_lengths.tolist() == [step + 1] * 3
    assert stopped.responses[0].tolist() == tokens[: step + 1]

    # Several end-of-reply ids (Llama-3, Qwen): any of them stops, whichever comes first.
    several = _generate(tiny, [prompt], GenerationConfig(max_new_tokens=10, greedy=True),
                        eos_id=(PAD + 1000, tokens[step]))
    assert several.responses[0].tolist() == tokens[: step + 1]

    mixed = _generate(tiny, [prompt, make_prompts([6], seed=6)[0]],
                      GenerationConfig(max_new_tokens=10, greedy=True), eos_id=tokens[step])
    # batches of 3, 1 and 2 rows and two loops decode the prompt: greedy gaps clear of rounding
    assert decision_margin(tiny, free, GenerationConfig(greedy=True), [0, 1, 2]) > MIN_MARGIN
    length = mixed.response_lengths[0].item()
    assert length == step + 1 and mixed.response_lengths[1] > length
    assert torch.all(mixed.responses[0, length:] == PAD)
    assert torch.all(mixed.response_mask[0, length:] == 0)
    assert torch.all(mixed.response_policy_logprobs[0, length:] == 0)


def test_prompt_at_seq_length_gets_empty_response(tiny) -> None:
    seq_length = tiny[0].max_sequence_length
    prompts = make_prompts([seq_length, seq_length - 3, 4], seed=7)
    out = _generate(tiny, prompts, GenerationConfig(max_new_tokens=5, greedy=True,
                                                    stop_at_eos=False))
    assert out.response_lengths.tolist() == [0, 3, 5]
    assert out.input_ids.shape == (3, seq_length + 5)
    alone = _generate(tiny, prompts[:1], GenerationConfig(max_new_tokens=5, stop_at_eos=False))
    assert alone.responses.shape == (1, 0)
    with pytest.raises(ValueError, match="more than the model's seq_length"):
        _generate(tiny, make_prompts([seq_length + 1]), GenerationConfig())


def test_max_new_tokens_zero_gives_empty_responses(tiny) -> None:
    out = _generate(tiny, make_prompts(LENGTHS), GenerationConfig(max_new_tokens=0))
    assert out.input_ids.shape == (5, 12)
    assert out.response_mask.shape == out.response_logprobs.shape == (5, 0)
    assert out.response_lengths.tolist() == [0] * 5


@pytest.mark.parametrize("prompts, indices, match", [
    ([], [], "prompts is empty"),
    ([[1, 2], []], [0, 1], "prompt 1 \\(index 1\\) is empty"),
    ([[1, 2]], [0, 1], "one index per prompt"),
    ([[1, 2]], [-1], "prompt_indices\\[0\\]=-1"),
    ([[1, 250]], [0], "outside \\[0, 250\\)"),
])
def test_bad_inputs_are_refused(tiny, prompts, indices, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _generate(tiny, prompts, GenerationConfig(), indices)


def test_missing_eos_and_pipeline_parallelism_are_refused(tiny) -> None:
    with pytest.raises(ValueError, match="stop_at_eos=True needs eos_id"):
        _generate(tiny, [[1, 2]], GenerationConfig(), eos_id=None)
    two_stages = SimpleNamespace(pp=SimpleNamespace(size=lambda: 2))
    with pytest.raises(ValueError, match="does not support pp>1.*shadow actor with pp=1"):
        generate_sequences(tiny[0], two_stages, [[1]], [0], GenerationConfig(), EOS, PAD)


def test_transformer_engine_attention_is_refused(tiny) -> None:
    class TEDotProductAttention(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="transformer_impl=local"):
        generate_sequences(torch.nn.Sequential(TEDotProductAttention()), tiny[1], [[1]], [0],
                           GenerationConfig(), EOS, PAD)
