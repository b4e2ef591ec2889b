"""Long-tailed answers in the cost model: the decode schedule of continuous and static batching
on hand-traced queues, the clipped-exponential assumption against its closed form, and
``--plan-only`` with a file of answer lengths against a hand-computed generation time."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.plan_only import answer_lengths, plan_cluster, plan_run
from megatron_rlhf.planner import AnswerLengths, RolloutSpec, load_profile
from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.planner.cost_model import DecodeSegment, decode_schedule
from megatron_rlhf.planner.workload import _clipped_exponential_rate
from megatron_rlhf.topology.models import arch_preset
from tests.scripts import REPO

TINY = REPO / "examples" / "ppo_tiny.yaml"


def _env(arch: str = "small") -> cm.ModelEnv:
    """One device, no TP/PP/DP: no collective costs, so every second is a formula's."""
    link = cm.Link(1e11, 1e-5)
    return cm.ModelEnv(arch_preset(arch), 1, 1, 1, False, load_profile("H100-80GB"),
                       link, link, link)


def test_continuous_batching_refills_slots_then_shrinks_to_the_tail() -> None:
    # Two slots, queue 5, 3, 2, 4 (an answer of L tokens decodes L - 1 steps after prefill).
    # Steps 0-1: 5 and 3 decode (ages 1, 2 each: 6). Step 2: 3 ended; 2 enters: ages 3 + 1.
    # Step 3: 2 ended; 4 enters, queue empty: ages 4 + 1. The 5 ends after step 3; the batch
    # shrinks to one slot: the 4 decodes steps 4 and 5 at ages 2 and 3.
    assert decode_schedule([5, 3, 2, 4], 2, continuous=True) == [
        DecodeSegment(2, 4, (6 + 4 + 5) / 8), DecodeSegment(1, 2, 2.5)]
    # Static rounds wait for their longest: (5, 3) takes 4 steps, (2, 4) takes 3.
    assert decode_schedule([5, 3, 2, 4], 2, continuous=False) == [
        DecodeSegment(2, 4, 2.5), DecodeSegment(2, 3, 2.0)]
    # An answer of one token ends in the prefill but holds its slot until the check after one
    # step: each 1 in turn decodes a step beside the 4 (ages 1+1, 2+1, 3+1), and the last 1
    # enters as the 4 leaves and decodes step 4 alone (age 1), its batch still 2 slots.
    assert decode_schedule([4, 1, 1, 1, 1], 2, continuous=True) == [
        DecodeSegment(2, 4, (2 + 3 + 4 + 1) / 7)]
    # Checks every 3 steps: the 5 holds its slot 6 steps (4 decode steps, seen at the check
    # after step 6), the 3, 2 and 4 three each. Steps 0-2: 5 and 3 (ages 1-3 each: 12); 3-5:
    # 5 and 2 (4-6 and 1-3: 21); 6-8: the 4 alone (1-3: 6) in the 2 slots it entered: the
    # check after step 8 ends the call.
    assert decode_schedule([5, 3, 2, 4], 2, continuous=True, check_interval=3) == [
        DecodeSegment(2, 9, (12 + 21 + 6) / 15)]


@pytest.mark.parametrize("seed", range(5))
def test_continuous_steps_lie_between_the_throughput_bound_and_the_tail(seed: int) -> None:
    """Steps >= max(total decode steps / slots, longest - 1) and <= total / slots + longest
    (list scheduling's bound), on random long-tailed queues."""
    rng = random.Random(seed)
    queue = [min(400, 1 + int(rng.expovariate(1 / 60))) for _ in range(200)]
    slots = 16
    steps = sum(s.steps for s in decode_schedule(queue, slots, continuous=True))
    work = sum(length - 1 for length in queue)
    assert max(math.ceil(work / slots), max(queue) - 1) <= steps <= work / slots + max(queue)
    static = sum(s.steps for s in decode_schedule(queue, slots, continuous=False))
    assert static >= steps


def test_one_length_for_every_answer_is_the_full_length_price() -> None:
    """With every answer G tokens, the distribution's price is ``generation_cost``'s."""
    env = _env()
    for rows, slots in ((8, 8), (24, 8)):
        fixed = cm.generation_cost(env, rows, 64, 32, slots)
        for continuous in (True, False):
            spread = cm.answers_generation_cost(env, [32] * rows, 64, slots, continuous)
            assert spread.total == pytest.approx(fixed.total, rel=1e-12)


def test_clipped_exponential_matches_its_closed_form() -> None:
    lengths = AnswerLengths.from_mean_max(1019, 3840)
    # The rate solves (1 - exp(-lam cap)) / lam = mean; the share cut at the cap is exp(-lam cap).
    lam = _clipped_exponential_rate(1019, 3840)
    assert (1 - math.exp(-lam * 3840)) / lam == pytest.approx(1019, rel=1e-9)
    at_cap = sum(1 for x in lengths.lengths if x == 3840) / len(lengths.lengths)
    assert at_cap == pytest.approx(math.exp(-lam * 3840), abs=2 / len(lengths.lengths))
    assert lengths.mean == pytest.approx(1019, rel=2e-3)
    # Far from the cap it is the plain exponential: median mean ln 2, p90 mean ln 10.
    far = AnswerLengths.from_mean_max(100, 100_000)
    assert far.quantile(0.5) == round(100 * math.log(2))
    assert far.quantile(0.9) == pytest.approx(100 * math.log(10), abs=1)
    assert AnswerLengths.from_mean_max(50, 40).lengths == (40,) * len(far.lengths)


def test_the_slowest_replica_holds_the_longest_answer() -> None:
    table = AnswerLengths.from_samples(range(1, 9), cap=8)
    assert table.batch(8) == list(range(1, 9))
    # 8 answers over 4 replicas: the slowest gets the longest and the one 4 below it.
    assert sorted(table.replica_queue(2, 8)) == [4, 8]
    with pytest.raises(ValueError, match="cut at 8 tokens but generation_length is 12"):
        RolloutSpec(batch=8, generation_length=12, answer_lengths=table)


def test_plan_only_prices_a_file_of_answer_lengths_by_hand(tmp_path: Path) -> None:
    """ppo_tiny (16 rows, 16-token prompts, at most 12 new tokens) on one H100, all 16 answers
    in one round. Lengths 1 x4, 2 x4, 3 x4, 4 x3, 12: the twelve answers longer than one token
    decode at once in 16 slots for 1 step (ages 1); the four 2s end and 8 slots run 1 step (ages
    2); the 3s end, 4 slots 1 step (ages 3); the 4s end and the 12 alone decodes 8 more steps at
    ages 4..11 (mean 7.5): 11 steps, the longest answer's; with a stop check every step. With
    checks every 8 steps (the default), the fifteen short answers hold 16 slots for 8 steps
    (ages 1..8) and the 12 holds one for 8 more (ages 9..16)."""
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, [1] * 4 + [2] * 4 + [3] * 4 + [4] * 3 + [12])) + "\n")
    config = load_config(RunConfig, TINY, ["generation.stop_check_interval=1"])
    cluster = plan_cluster(config, 1, 1, "H100-80GB")
    lengths = answer_lengths(config, path=str(path))
    run_plan = plan_run(config, cluster, lengths=lengths)
    assert run_plan.prediction.memory.sequences_per_round["actor"] >= 16  # one round
    prompt, env = 16, _env("tiny")
    by_hand = env.slot_cost(16 * prompt, prompt / 2, cm.FORWARD_PASSES, tp_collectives=2)
    for slots, steps, age in ((16, 1, 1.0), (8, 1, 2.0), (4, 1, 3.0), (1, 8, 7.5)):
        by_hand += cm.decode_step_cost(env, slots, prompt + age).scaled(steps)
    generation = run_plan.prediction.stage_seconds["generation"]
    assert generation == pytest.approx(by_hand.total, rel=1e-3)  # stage seconds are rounded
    every_8 = plan_run(load_config(RunConfig, TINY), cluster, lengths=lengths)
    by_hand_8 = env.slot_cost(16 * prompt, prompt / 2, cm.FORWARD_PASSES, tp_collectives=2)
    for slots, steps, age in ((16, 8, 4.5), (1, 8, 12.5)):
        by_hand_8 += cm.decode_step_cost(env, slots, prompt + age).scaled(steps)
    assert every_8.prediction.stage_seconds["generation"] == pytest.approx(by_hand_8.total,
                                                                         rel=1e-3)
    # The other stages are priced at the mean answer: (4 + 8 + 12 + 12 + 12) / 16 = 3 tokens.
    assert run_plan.rollout.priced_sequence_length == prompt + 3
    text = run_plan.format()
    assert f"answer lengths: answer lengths of {path}: mean 3, median 2" in text
    assert run_plan.to_dict()["rollout"]["answer_lengths"]["max"] == 12
    # Static batching computes all 16 slots for the 11 steps; every answer at the cap as well.
    static = plan_run(replace(config, generation=replace(config.generation, batching="static")),
                      cluster, lengths=lengths).prediction.stage_seconds["generation"]
    full = plan_run(config, cluster).prediction.stage_seconds["generation"]
    assert generation < static <= full
    assert "every answer 12 tokens" in plan_run(config, cluster).format()


def test_answer_flags_are_checked_with_the_fix(tmp_path: Path) -> None:
    config = load_config(RunConfig, TINY)
    assert answer_lengths(config) is None
    stated = answer_lengths(config, mean=4, maximum=10)
    assert stated.cap == 12 and stated.lengths[-1] == 10
    with pytest.raises(ValueError, match=r"--answer-max 20 must be in \[1, "
                                         r"generation.max_new_tokens=12\]"):
        answer_lengths(config, mean=4, maximum=20)
    with pytest.raises(ValueError, match="--answer-max needs --answer-mean"):
        answer_lengths(config, maximum=8)
    bad = tmp_path / "bad.txt"
    bad.write_text("3\nlong\n")
    with pytest.raises(ValueError, match="bad.txt line 2: 'long' is not a token count"):
        answer_lengths(config, path=str(bad))


def test_reference_answers_are_counted_in_the_runs_tokens(tmp_path: Path) -> None:
    """A prompt set's reference answers (``response`` or ``answer`` text) count as many tokens
    as the run's tokenizer gives them; numbers and ``tokens`` fields mix in."""
    from megatron_rlhf.builder.sources import resolve_sources
    from megatron_rlhf.engine.run.runner import run_tokenizer

    config = load_config(RunConfig, TINY)
    texts = ["101919", "What is 641 * 159? It is 101919.", "7"]
    path = tmp_path / "answers.jsonl"
    path.write_text("\n".join([json.dumps({"question": "q", "response": texts[0]}),
                               json.dumps({"answer": texts[1]}), json.dumps({"answer": texts[2]}),
                               json.dumps({"tokens": 5}), "3"]) + "\n")
    lengths = answer_lengths(config, path=str(path))
    tokenizer = run_tokenizer(config, resolve_sources(config))
    counts = [len(tokenizer.encode(text)) for text in texts]
    assert lengths.lengths == tuple(sorted(min(12, c) for c in counts + [5, 3]))
    assert lengths.source == f"reference answers of {path}"


def test_a_token_budget_fills_micro_batches_with_answers_of_the_mean_length() -> None:
    """112 tokens per micro-batch: 112 // (16 + 12) = 4 full-length rows, or 112 // (16 + 3)
    = 5 rows of answers averaging 3 tokens, whose activations are sized at 19 tokens a row."""
    from megatron_rlhf.engine.run.auto_placement import answered_rollout
    from megatron_rlhf.engine.run.micro_batching import planner_rollout

    config = load_config(RunConfig, TINY, ["rollout.max_tokens_per_micro_batch=112"])
    lengths = AnswerLengths.from_samples([1] * 4 + [2] * 4 + [3] * 4 + [4] * 3 + [12], cap=12)
    full = planner_rollout(config, None, answered_rollout(config, None))
    spread = planner_rollout(config, None, answered_rollout(config, lengths))
    assert (full.micro_batch_size, full.activation_sequence_length) == (4, 28)
    assert (spread.micro_batch_size, spread.activation_sequence_length) == (5, 19)
    assert spread.packed and replace(spread, packed=False).activation_sequence_length == 28
