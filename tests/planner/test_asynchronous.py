"""The rollout modes of asynchronous separation as the planner prices them
(``planner.asynchronous``): answers that go on across steps (hand-traced pool calls and their
steady state), partial rollouts, the proximal forward of an off-policy correction."""

from __future__ import annotations

import dataclasses
import random

import pytest

from megatron_rlhf.planner import AnswerLengths, RolloutSpec, homogeneous_cluster, predict_step
from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.planner.asynchronous import (
    CONTINUED,
    ONE_STEP_OFF,
    PARTIAL,
    SYNCHRONOUS,
    continued_generation_cost,
    describe_mode,
    pool_calls,
    pool_steady_state,
    slot_steps,
)
from megatron_rlhf.topology import PlacementConfig, arch_preset, plan_placement
from tests.planner.helpers import ROUND

LENGTHS = [3, 1, 5, 2, 4, 2]
"""Six answers, in queue order: slot steps 2, 1, 4, 1, 3, 1 checked every step."""
H100_1X8 = homogeneous_cluster("H100-80GB", 1, 8)
LONG_TAIL = RolloutSpec(batch=256, prompt_length=256, generation_length=1024).with_answer_lengths(
    AnswerLengths.from_mean_max(250, 1024))


def test_an_answer_holds_its_slot_up_to_the_stop_check_that_sees_it_end() -> None:
    assert [slot_steps(n, 1) for n in LENGTHS] == [2, 1, 4, 1, 3, 1]
    assert [slot_steps(n, 2) for n in LENGTHS] == [2, 2, 4, 2, 4, 2]


@pytest.mark.parametrize("group_size", [1, 2])
def test_pool_calls_follow_a_hand_traced_pool(group_size: int) -> None:
    """2 slots, 2 answers per call, checked every step. Call 1: a0 (2 steps) and a1 (1); a1
    ends at step 1 and a2 (4) takes its slot; a0 ends at step 2: 2 answers (group a0, a1), 2
    steps. Call 2: a3 (1) joins a2 and ends at step 3, a4 (3) takes its slot; a2 ends at step 5:
    2 more (group a2, a3), 3 steps. Call 3: a5 (1) joins a4; both end at step 6: 1 step. Every
    slot was busy every step: 12 slot-steps = 2 slots x 6 steps."""
    assert pool_calls(LENGTHS, slots=2, rows=2, group_size=group_size) == [2, 3, 1]


def test_pool_calls_wait_for_the_stop_check() -> None:
    """Checked every 2 steps the slot steps are 2, 2, 4, 2, 4, 2. Call 1: a0 and a1 end at the
    first check (2 steps). Call 2: a3 ends at its first check, a4 takes its slot; a2 ends at the
    second (4 steps). Call 3: a4 and a5 end at the first check (2 steps)."""
    assert pool_calls(LENGTHS, slots=2, rows=2, check_interval=2) == [2, 4, 2]


def test_finished_answers_beyond_a_call_are_the_next_calls() -> None:
    """4 slots, 1 answer per call: the first call's one step finishes all four; the next three
    calls return them without decoding."""
    assert pool_calls([2, 2, 2, 2], slots=4, rows=1) == [1, 0, 0, 0]


def test_the_steady_state_is_the_hand_traced_average() -> None:
    """Slot steps 2, 1, 4, 1, 3, 1: E[h] = 2, so 2 answers on 2 slots take 2 steps a call, the
    hand trace's (2 + 3 + 1) / 3; the mean age is sum h (h + 1) / 2 over sum h = 22 / 12."""
    segment = pool_steady_state(LENGTHS, rows=2, slots=2)
    assert (segment.slots, segment.steps) == (2, 2)
    assert segment.mean_age == pytest.approx(22 / 12)
    calls = pool_calls(LENGTHS, slots=2, rows=2)
    assert sum(calls) / len(calls) == segment.steps


def test_a_long_tailed_pool_settles_at_the_steady_state() -> None:
    """Exponential answers of mean 40 cut at 400 (3 % reach it), 16 slots, 16 answers (4 groups
    of 4) a call, checked every 4 steps: over 150 calls, the steps per call (the last calls
    left out: the queue runs dry there) average the steady state's within 3 %, while one round
    of 16 answers would last until its longest."""
    table = AnswerLengths.from_mean_max(40, 400)
    rng = random.Random(0)
    queue = [rng.choice(table.lengths) for _ in range(16 * 160)]
    calls = pool_calls(queue, slots=16, rows=16, group_size=4, check_interval=4)[:150]
    steady = pool_steady_state(table.lengths, rows=16, slots=16, check_interval=4)
    assert sum(calls) / len(calls) == pytest.approx(steady.steps, rel=0.03)
    rounds = [max(slot_steps(n, 4) for n in queue[i:i + 16]) for i in range(0, 16 * 150, 16)]
    assert sum(rounds) / len(rounds) > 2.5 * steady.steps


def _env(tp: int = 1) -> cm.ModelEnv:
    link = cm.Link(100e9, 0.0)
    return cm.ModelEnv(arch_preset("llama-7b"), tp, 1, 1, False, ROUND, link, link, link)


def test_equal_answers_cost_what_one_continuous_round_costs() -> None:
    """Every answer 64 tokens, one round of 32: the round runs 63 full decode steps at mean age
    32; a full pool of 32 slots finishing 32 answers does too (E[h] = 63, age 64 x 63 / 2 / 63)."""
    env, queue = _env(), [64] * 32
    round_cost = cm.answers_generation_cost(env, queue, 128, 32, continuous=True)
    assert continued_generation_cost(env, queue, 32, 128, 32) == pytest.approx(round_cost)


def test_a_continued_step_costs_its_mean_answer_not_its_longest() -> None:
    """The hand composition: the prefill of 32 prompts of 128 tokens, then rows E[h] / slots
    decode steps at 32 sequences and context 128 + mean age."""
    env = _env()
    expected = env.slot_cost(32 * 128, 64, 1, tp_collectives=2) + cm.decode_step_cost(
        env, 32, 128 + 22 / 12).scaled(2 * 32 / 32)
    assert continued_generation_cost(env, LENGTHS, 32, 128, 32) == pytest.approx(expected)


def _separation(rollout: RolloutSpec):
    plan = plan_placement(H100_1X8, PlacementConfig("separation", critic=False, reward=False),
                          "llama-7b")
    return predict_step(plan, rollout)


def _tasks(prediction) -> dict[str, dict]:
    return {task["name"]: task for task in prediction.tasks}


def test_each_mode_is_named_and_the_partial_ones_only_one_step_off() -> None:
    partial = dataclasses.replace(LONG_TAIL, partial_rollouts=True, reuse_logprobs=True)
    continued = dataclasses.replace(partial, continue_answers=True)
    assert _separation(dataclasses.replace(LONG_TAIL, overlap=False)).mode == SYNCHRONOUS
    assert _separation(LONG_TAIL).mode == ONE_STEP_OFF
    assert _separation(partial).mode == PARTIAL
    assert _separation(continued).mode == CONTINUED
    alone = _separation(dataclasses.replace(continued, overlap=False))
    assert alone.mode == SYNCHRONOUS
    assert alone.step_seconds == _separation(dataclasses.replace(partial, overlap=False)
                                             ).step_seconds
    line = describe_mode(continued, pipelined=False)
    assert "\n" not in line and "need asynchronous separation" in line
    with pytest.raises(ValueError, match="continue_answers needs partial_rollouts"):
        dataclasses.replace(LONG_TAIL, continue_answers=True)


def test_partial_rollouts_price_as_one_step_off_with_generations_log_probs() -> None:
    """The round still ends with its longest answer; what goes is the shadow's forward for the
    old log-probs, which partial rollouts take from generation."""
    off = _separation(LONG_TAIL)
    reuse = _separation(dataclasses.replace(LONG_TAIL, reuse_logprobs=True))
    partial = _separation(dataclasses.replace(LONG_TAIL, partial_rollouts=True,
                                              reuse_logprobs=True))
    assert "experience:shadow_actor" in _tasks(off)
    assert "experience:shadow_actor" not in _tasks(partial)
    assert partial.step_seconds == reuse.step_seconds
    assert partial.step_seconds == pytest.approx(
        off.step_seconds - _tasks(off)["experience:shadow_actor"]["seconds"], abs=1e-3)


def test_answers_across_steps_generate_at_the_mean_answer() -> None:
    """Answers all of one length finish together: a full pool costs what the round does. With
    the long tail the round waits for its longest answer and the pool does not."""
    def continued(rollout: RolloutSpec) -> RolloutSpec:
        return dataclasses.replace(rollout, partial_rollouts=True, continue_answers=True,
                                   reuse_logprobs=True)

    equal = RolloutSpec(batch=256, prompt_length=256, generation_length=256)
    assert _tasks(_separation(continued(equal)))["generation:shadow_actor"]["seconds"] == (
        pytest.approx(_tasks(_separation(equal))["generation:shadow_actor"]["seconds"]))
    p, off = _separation(continued(LONG_TAIL)), _separation(LONG_TAIL)
    generation = _tasks(p)["generation:shadow_actor"]["seconds"]
    assert generation < 0.5 * _tasks(off)["generation:shadow_actor"]["seconds"]
    assert p.samples_per_s > 2 * off.samples_per_s


def test_the_proximal_forward_is_one_actor_forward_before_its_update() -> None:
    """Under flattening everything runs in turn: the step grows by exactly the proximal task,
    an actor forward over its replica's share of the rows at the priced length."""
    plan = plan_placement(H100_1X8, PlacementConfig("flattening", critic=False, reward=False),
                          "llama-7b")
    rollout = dataclasses.replace(LONG_TAIL, overlap=False)
    none = predict_step(plan, rollout)
    proximal = predict_step(plan, dataclasses.replace(rollout, proximal_forward=True))
    task = _tasks(proximal)["experience:actor (proximal)"]
    assert "experience:actor (proximal)" not in _tasks(none)
    assert _tasks(proximal)["training:actor"]["start_s"] == pytest.approx(
        task["start_s"] + task["seconds"], abs=1e-3)
    assert proximal.step_seconds == pytest.approx(none.step_seconds + task["seconds"], abs=1e-3)
    assert task["seconds"] == pytest.approx(_tasks(none)["experience:actor"]["seconds"])
