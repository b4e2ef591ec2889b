"""How asynchronous separation's rollout modes change a step's price.

    mode = rollout_mode(rollout, pipelined=True)     # "one step off", "partial rollouts", ...
    segment = pool_steady_state(lengths.lengths, rows=64, slots=64, check_interval=4)
    cost = continued_generation_cost(env, lengths.lengths, rows, prompt, max_sequences, 4)

Four schedules, as the engine runs them (docs/asynchronous.md):

- ``synchronous``: every step generates, scores, trains and syncs in turn; a step's generation
  lasts until its longest answer (``cost_model.decode_schedule``).
- ``one step off`` (``rollout.async_rollout``): the shadows generate step k + 1 while the
  trainers train step k; the step is the busier side plus the weight sync
  (``Schedule.period``). Generation still lasts until the round's longest answer.
- ``partial rollouts``: one step off, and the shadows take the trained weights at the first stop
  check after the trainers are done instead of after their round. The sync then pauses decoding
  instead of following it, so each side is busy as long as one step off's: the step still needs
  its round's longest answer before the trainers can go on, and the price is one step off's.
  What differs is what the trainers get (answers spanning two versions) and that the old
  log-probs are generation's (``reuse_generation_logprobs``, which partial rollouts need): the
  shadow actor's experience forward is gone.
- ``answers across steps`` (``rollout.continue_answers``): each generating replica keeps its
  slots full from step to step (prompts of the next step wait behind the answers still
  decoding), and a step ends once its ``rows`` answers have finished. In the steady state a
  replica finishes ``slots / E[h]`` answers per decode step, ``h`` the steps an answer holds its
  slot, so a step's generation is ``rows E[h] / slots`` decode steps at the full batch
  (:func:`pool_steady_state`): the mean answer's length, not the longest.

With an off-policy correction that needs the proximal policy (``algorithm.off_policy:
decoupled|truncated_is``) the actor runs one more forward over the step's rows before its first
update (``PPOEngine.compute_proximal_logprobs``), in any mode; ``predict`` adds it as a task.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_rlhf.planner import cost_model as cm
from megatron_rlhf.planner.workload import RolloutSpec
from megatron_rlhf.topology.flops import FORWARD_PASSES

SYNCHRONOUS, ONE_STEP_OFF, PARTIAL, CONTINUED = (
    "synchronous", "one step off", "partial rollouts", "answers across steps")
MODES = (SYNCHRONOUS, ONE_STEP_OFF, PARTIAL, CONTINUED)


def rollout_mode(rollout: RolloutSpec, pipelined: bool) -> str:
    """The schedule a step of ``rollout`` is priced as (one of ``MODES``): the partial modes
    only one step off (``pipelined``: a separation placement with ``rollout.overlap``)."""
    if not pipelined:
        return SYNCHRONOUS
    if rollout.continue_answers:
        return CONTINUED
    return PARTIAL if rollout.partial_rollouts else ONE_STEP_OFF


def describe_mode(rollout: RolloutSpec, pipelined: bool) -> str:
    """One line: the schedule priced and the extra passes, for ``--plan-only``."""
    mode = rollout_mode(rollout, pipelined)
    what = {
        SYNCHRONOUS: "each step generates, scores, trains and syncs in turn; generation waits "
                     "for its longest answer",
        ONE_STEP_OFF: "the shadows generate step k+1 while the trainers train step k; "
                      "generation waits for its round's longest answer",
        PARTIAL: "one step off, the shadows taking the weights mid-round (priced as one step "
                 "off: the round still ends with its longest answer)",
        CONTINUED: "one step off, each generating replica's slots kept full across steps: a "
                   "step's generation is rows x mean answer slot-steps, not its longest answer",
    }[mode]
    if not pipelined and (rollout.partial_rollouts or rollout.continue_answers):
        what += " (partial rollouts and answers across steps need asynchronous separation)"
    extras = [*(["old log-probs from generation (no policy forward)"]
                if rollout.reuse_logprobs else []),
              *(["one proximal forward of the actor (algorithm.off_policy)"]
                if rollout.proximal_forward else [])]
    return f"{mode}: {what}" + "".join(f"; {extra}" for extra in extras)


def slot_steps(length: int, check_interval: int) -> int:
    """Decode steps an answer of ``length`` tokens holds its slot: its ``length - 1`` decode
    steps (the prefill samples the first token), at least one, up to the stop check that sees it
    ended (``cost_model.decode_schedule``)."""
    return check_interval * math.ceil(max(length - 1, 1) / check_interval)


def pool_steady_state(lengths: Sequence[int], rows: int, slots: int,
                      check_interval: int = 1) -> cm.DecodeSegment:
    """The decode steps of one step of answers that go on across steps, on one replica whose
    ``slots`` stay full (``rollout.continue_answers`` in its steady state).

    Each answer of the distribution ``lengths`` holds its slot ``h = slot_steps(L)`` steps; with
    every slot always busy the replica finishes ``slots / E[h]`` answers per step, so ``rows``
    answers take ``rows E[h] / slots`` steps (rounded up), each computing ``slots`` sequences.
    An answer at its j-th step has generated j tokens, so the slots' mean age over time is
    ``E[h (h + 1) / 2] / E[h]`` (the long answers hold their slots longer and weigh more).
    """
    holds = [slot_steps(length, check_interval) for length in lengths]
    mean_hold = sum(holds) / len(holds)
    age = sum(h * (h + 1) / 2 for h in holds) / sum(holds)
    return cm.DecodeSegment(slots, math.ceil(rows * mean_hold / slots), age)


def continued_generation_cost(env: cm.ModelEnv, lengths: Sequence[int], rows: int, prompt: int,
                              max_sequences: int, check_interval: int = 1) -> cm.Cost:
    """One step's generation of ``rows`` answers on one replica whose answers go on across steps:
    the prefills of ``rows`` new prompts, priced as ``cost_model.answers_generation_cost`` prices
    them (``ceil(rows / max_sequences)`` rounds' worth of ``slots = ceil(rows / rounds)``), and
    :func:`pool_steady_state`'s decode steps at ``slots`` sequences and context ``prompt +
    mean age``."""
    if rows == 0:
        return cm.Cost()
    rounds = math.ceil(rows / max_sequences)
    slots = math.ceil(rows / rounds)
    prefill = env.slot_cost(slots * prompt, prompt / 2, FORWARD_PASSES, tp_collectives=2)
    segment = pool_steady_state(lengths, rows, slots, check_interval)
    decode = cm.decode_step_cost(env, segment.slots, prompt + segment.mean_age)
    return prefill.scaled(env.pp * rounds) + env.gathers(1) + decode.scaled(segment.steps)


def pool_calls(queue: Sequence[int], slots: int, rows: int, group_size: int = 1,
               check_interval: int = 1) -> list[int]:
    """Decode steps of each call of one replica's answer pool (``generation/answer_pool.py``)
    over the answers ``queue`` (lengths, in the order the prompts are added), ``rows`` answers
    returned per call, until fewer than ``rows`` are left: the trace that
    :func:`pool_steady_state` takes the average of.

    As the pool runs it: a call first admits waiting prompts into free slots, then decodes
    ``check_interval`` steps at a time; at each stop check the answers whose slot time
    (:func:`slot_steps`) is up finish, and the call ends at the first check where ``rows /
    group_size`` whole groups (``group_size`` consecutive answers) have finished and not been
    returned, returning the oldest of them. A call that finds enough finished groups decodes 0
    steps. Every prompt is queued from the start (the engine feeds a step ahead: a pool whose
    slots outnumber its waiting prompts runs emptier than this).
    """
    if rows % group_size:
        raise ValueError(f"rows({rows}) must be whole groups of {group_size}")
    waiting = list(range(len(queue)))[::-1]
    remaining: dict[int, int] = {}  # answer -> decode steps left in its slot
    finished: set[int] = set()
    returned = 0
    calls: list[int] = []
    groups = len(queue) // group_size
    while groups - returned >= rows // group_size:
        steps = 0
        while len(_done_groups(finished, group_size, groups)) - returned < rows // group_size:
            while waiting and len(remaining) < slots:
                answer = waiting.pop()
                remaining[answer] = slot_steps(queue[answer], check_interval)
            steps += check_interval
            for answer in list(remaining):
                remaining[answer] -= check_interval
                if remaining[answer] <= 0:
                    del remaining[answer]
                    finished.add(answer)
        returned += rows // group_size
        calls.append(steps)
    return calls


def _done_groups(finished: set[int], group_size: int, groups: int) -> list[int]:
    return [g for g in range(groups)
            if all(g * group_size + j in finished for j in range(group_size))]
