"""Episodes with the tools' waits overlapped (``run_episodes_overlapped``): while one episode's
tool runs, the others go on decoding, and every row gets the tokens, masks and counts of the
turn-by-turn loop (``run_episodes``), its log-probs within rounding. One process."""

from __future__ import annotations

import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from megatron_rlhf.generation import GenerationConfig, generate_sequences
from megatron_rlhf.generation.episodes import (
    EpisodeConfig,
    FutureAnswers,
    Observation,
    run_episodes,
    run_episodes_overlapped,
)
from tests.generation.helpers import PAD, make_prompts

SLOW_ROW, SLOW_S = 0, 0.6
"""The row whose every tool call sleeps ``SLOW_S`` seconds (the others answer at once)."""


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_other_episodes_decode_while_a_tool_runs_and_rows_match_the_turn_loop(tiny,
                                                                             batching) -> None:
    model, pgc = tiny
    config = GenerationConfig(temperature=0.9, seed=3, batching=batching)
    prompts = make_prompts([4, 7, 3, 6, 5, 8], seed=2)
    first = generate_sequences(model, pgc, prompts, list(range(6)),
                               dataclasses.replace(config, max_new_tokens=10),
                               eos_id=249, pad_id=PAD)
    stop_ids = set(first.responses[:, 2].tolist())  # every row calls a tool in turn 0
    slow_answered = threading.Event()
    calls_while_slow: list[int] = []

    def generate(contexts, ids, max_new):
        if not slow_answered.is_set():
            calls_while_slow.append(len(contexts))
        return generate_sequences(model, pgc, contexts, ids,
                                  dataclasses.replace(config, max_new_tokens=max_new),
                                  eos_id=249, pad_id=PAD)

    def answer(row: int) -> Observation:
        if row == SLOW_ROW:
            time.sleep(SLOW_S)
            slow_answered.set()
        return Observation([7, 8, 9], failed=row == 3)

    bounds = EpisodeConfig(max_turns=4, max_episode_tokens=48, turn_tokens=10, stop="#")
    decode = lambda ids: "".join("#" if t in stop_ids else "." for t in ids)  # noqa: E731
    args = (prompts, list(range(6)), bounds, decode)
    waiting = run_episodes(generate, *args,
                           lambda calls: [answer(r) for r, _ in calls], eos_ids=[249],
                           pad_id=PAD)
    slow_answered.clear()
    calls_while_slow.clear()
    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = FutureAnswers(lambda row, text: pool.submit(answer, row))
        overlapped = run_episodes_overlapped(generate, *args, answers, eos_ids=[249], pad_id=PAD)
    # the other rows ran their later turns while the slow row's first call was out
    assert len(calls_while_slow) >= 3 and max(calls_while_slow[1:]) < len(prompts)
    assert int(waiting.stats["turns"][SLOW_ROW]) > 1, "the slow row needs a second turn"
    for name, value in vars(waiting.output).items():
        if isinstance(value, torch.Tensor):
            # other batch compositions: log-probs round differently
            tolerance = 1e-5 if value.is_floating_point() else 0
            torch.testing.assert_close(getattr(overlapped.output, name), value, rtol=0,
                                       atol=tolerance, msg=name)
    for name, value in waiting.stats.items():
        assert torch.equal(overlapped.stats[name], value), name
    assert waiting.stats["tool_errors"][3] >= 1
