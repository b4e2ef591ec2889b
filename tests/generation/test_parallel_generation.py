"""Generation under TP=2 and across DP replicas matches one process generating everything.

One 2-rank gloo job holds the same tiny model (layout-independent init) twice: at TP=1 (two DP
replicas) and at TP=2. The TP=1 model generating the whole batch with the static loop
(``batching=static``) is the reference; TP=2 continuous batching (also with fewer slots than
prompts, so a slot is refilled) and the static loop give its tokens.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from tests.generation.helpers import MIN_MARGIN, build_tiny, decision_margin, make_prompts
from tests.helpers.models import full_forward_logprobs
from tests.multirank import run_on_ranks

EOS, PAD = 249, 0
INDICES = [10, 11, 12, 13]


def _responses(out) -> list[list[int]]:
    return [row[:n].tolist() for row, n in zip(out.responses, out.response_lengths, strict=True)]


def _check_parallel_generation() -> dict[str, float]:
    from megatron_rlhf.generation import GenerationConfig, generate_sequences
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    rank = dist.get_rank()
    prompts = make_prompts([5, 1, 9, 4], seed=21)
    greedy = GenerationConfig(max_new_tokens=12, greedy=True, stop_at_eos=False)
    # seed 14: with seed 4 a draw sat 1.3e-6 from its token's edge, within reach of the
    # rounding TP=2's split reductions add on some CPU
    sampled = GenerationConfig(max_new_tokens=12, temperature=0.9, top_p=0.9, seed=14)
    uncached = GenerationConfig(max_new_tokens=12, greedy=True, stop_at_eos=False,
                                use_kv_cache=False, batching="static")
    compiled = dataclasses.replace(sampled, compile_decode=True)
    refilled = dataclasses.replace(sampled, micro_batch_size=3, stop_check_interval=1)
    static = dataclasses.replace(sampled, batching="static")

    tp1, pgc1 = build_tiny(tp=1)
    ref_greedy = generate_sequences(tp1, pgc1, prompts, INDICES,
                                    dataclasses.replace(greedy, batching="static"), EOS, PAD)
    ref_sampled = generate_sequences(tp1, pgc1, prompts, INDICES, static, EOS, PAD)
    # Each DP replica generates its half of the prompts.
    half = slice(2 * rank, 2 * rank + 2)
    share = generate_sequences(tp1, pgc1, prompts[half], INDICES[half], sampled, EOS, PAD)
    assert _responses(share) == _responses(ref_sampled)[half]

    tp2, pgc2 = build_tiny(tp=2)
    worst = 0.0
    for config, ref in [(greedy, ref_greedy), (uncached, ref_greedy), (sampled, ref_sampled),
                        (refilled, ref_sampled), (static, ref_sampled), (compiled, ref_sampled)]:
        out = generate_sequences(tp2, pgc2, prompts, INDICES, config, EOS, PAD)
        assert _responses(out) == _responses(ref), f"TP=2 differs from TP=1 with {config}"
        torch.testing.assert_close(out.response_policy_logprobs, ref.response_policy_logprobs,
                                   rtol=0, atol=1e-4)
        worst = max(worst, (out.response_policy_logprobs - ref.response_policy_logprobs)
                    .abs().max().item())
        tokens = [torch.empty_like(out.input_ids) for _ in range(2)]
        dist.all_gather(tokens, out.input_ids, group=pgc2.tp)
        assert torch.equal(tokens[0], tokens[1]), "TP ranks sampled different tokens"
    # after the compiled decode: a forward through the schedule before it breaks its compile
    for config, ref in ((greedy, ref_greedy), (sampled, ref_sampled)):
        assert decision_margin((tp1, pgc1), ref, config, INDICES) > MIN_MARGIN, config
    reference = full_forward_logprobs(tp2, pgc2, out, sampled.temperature)
    torch.testing.assert_close(out.response_policy_logprobs, reference, rtol=0, atol=1e-4)
    return {"max_logprob_diff_tp2_vs_tp1": worst}


@pytest.mark.multirank
@pytest.mark.timeout(270)
def test_tp2_and_dp_replicas_match_single_process_generation() -> None:
    results = run_on_ranks(_check_parallel_generation, world_size=2, timeout_s=240)
    assert all(r["max_logprob_diff_tp2_vs_tp1"] < 1e-4 for r in results)
