"""Multi-turn episodes (``generation/episodes.py``): the tokens trained on are the tokens sampled
and the observations as encoded, the policy's log-probs after an observation are those of one
forward over the whole episode, and the bounds end episodes as documented. One process."""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.generation import GenerationConfig, GenerationOutput, generate_sequences
from megatron_rlhf.generation.episodes import (
    EpisodeConfig,
    Observation,
    run_episodes,
    stop_cut,
    turn_key,
)
from megatron_rlhf.models.forward_backward import model_inputs
from megatron_rlhf.models.logprobs import vocab_parallel_logprobs
from tests.generation.helpers import PAD, make_prompts

OBSERVATION = [7, 8, 9, 10, 11]
"""What every tool call reads back."""


def _decode_with_stop(stop_id: int):
    """A decode that writes ``stop_id`` as ``#`` and every other token as ``.``."""
    return lambda ids: "".join("#" if t == stop_id else "." for t in ids)


def _model_generate(tiny, config: GenerationConfig, eos: int):
    model, pgc = tiny

    def generate(contexts, ids, max_new):
        return generate_sequences(model, pgc, contexts, ids,
                                  GenerationConfig(**{**config.__dict__,
                                                      "max_new_tokens": max_new}),
                                  eos_id=eos, pad_id=PAD)
    return generate


def test_stop_cut_keeps_the_shortest_prefix_holding_the_stop_text() -> None:
    decode = lambda ids: "".join(chr(ord("a") + t) for t in ids)  # noqa: E731
    assert stop_cut([0, 1, 2, 3, 1, 2], decode, "bc") == 3
    assert stop_cut([0, 1, 3], decode, "bc") is None


def test_episode_tokens_and_logprobs_match_one_forward_over_the_episode(tiny) -> None:
    config = GenerationConfig(temperature=0.9, seed=3, stop_at_eos=True)
    prompts = make_prompts([4, 7, 3, 6], seed=2)
    first = generate_sequences(*tiny, prompts, [0, 1, 2, 3],
                               GenerationConfig(**{**config.__dict__, "max_new_tokens": 10}),
                               eos_id=249, pad_id=PAD)
    stop_id = first.responses[0, 2].item()  # row 0 calls the tool at this token's first draw
    cut = first.responses[0].tolist().index(stop_id) + 1
    episodes = run_episodes(
        _model_generate(tiny, config, 249), prompts, [0, 1, 2, 3],
        EpisodeConfig(max_turns=3, max_episode_tokens=40, turn_tokens=10, stop="#"),
        _decode_with_stop(stop_id),
        lambda calls: [Observation(list(OBSERVATION), failed=r == 0) for r, _ in calls],
        eos_ids=[249], pad_id=PAD)
    out, stats = episodes.output, episodes.stats
    # turn 0 draws what one reply to the prompt draws, cut after the call
    width = out.prompt_length
    assert out.input_ids[0, width:width + cut].tolist() == first.responses[0, :cut].tolist()
    assert out.input_ids[0, width + cut:width + cut + 5].tolist() == OBSERVATION
    assert out.response_mask[0, :cut + 5].tolist() == [1] * cut + [0] * 5
    assert stats["tool_calls"][0] >= 1 and stats["tool_errors"][0] == stats["tool_calls"][0]
    assert stats["tool_errors"][1:].sum() == 0
    assert torch.equal(stats["observation_tokens"] % len(OBSERVATION), torch.zeros(4))
    assert int(stats["turns"].sum()) > len(prompts), "some episode needs a second turn"
    # every row: sampled plus observation tokens are the episode; the loss mask counts only
    # the sampled ones
    span = out.attention_mask[:, width:].sum(dim=1)
    assert torch.equal(span - out.response_mask.sum(dim=1),
                       stats["observation_tokens"].long())
    # teacher-forced: one forward over the whole episode gives the policy's log-probs of its
    # own tokens, after observations too
    model, pgc = tiny
    with torch.no_grad():
        logits = model(*model_inputs({"input_ids": out.input_ids,
                                      "attention_mask": out.attention_mask}))
    forward, _ = vocab_parallel_logprobs(logits[:, width - 1:-1], out.responses, pgc.tp,
                                         model.token_vocab_size, config.temperature)
    mask = out.response_mask.bool()
    after = mask.clone()
    for row in range(mask.shape[0]):
        observed = (~mask[row] & out.attention_mask[row, width:].bool()).nonzero()
        after[row, : (int(observed[0]) if len(observed) else mask.shape[1])] = False
    assert after.any(), "some sampled tokens come after an observation"
    torch.testing.assert_close(torch.where(mask, forward, 0.0), out.response_policy_logprobs,
                               rtol=0, atol=1e-5)


def _scripted(replies: dict[int, list[list[int]]]):
    """A generate that answers noise id ``turn_key(i, t)`` with ``replies[i][t]`` (log-prob -1
    per token), cut to the budget."""
    keys = {turn_key(i, t): (i, t) for i, turns in replies.items() for t in range(len(turns))}

    def generate(contexts, ids, max_new):
        rows = [replies[keys[i][0]][keys[i][1]][:max_new] for i in ids]
        steps = max(len(r) for r in rows)
        width = max(len(c) for c in contexts)
        b = len(rows)
        ids_t = torch.zeros(b, width + steps, dtype=torch.long)
        mask = torch.zeros(b, width + steps, dtype=torch.long)
        response_mask = torch.zeros(b, steps, dtype=torch.long)
        for row, (context, reply) in enumerate(zip(contexts, rows, strict=True)):
            ids_t[row, width - len(context):width + len(reply)] = torch.tensor(context + reply)
            mask[row, width - len(context):width + len(reply)] = 1
            response_mask[row, :len(reply)] = 1
        logprobs = -response_mask.float()
        return GenerationOutput(ids_t, mask, mask[:, :width], response_mask, logprobs, logprobs,
                                mask[:, :width].sum(1), response_mask.sum(1))
    return generate


STOP, EOS = 99, 3


def test_bounds_end_episodes_and_mark_them_truncated() -> None:
    replies = {
        0: [[5, 5, STOP, 5], [6, EOS]],             # a call, then an answer ending at EOS
        1: [[5, STOP], [5, STOP]],                  # calls on its last allowed turn
        2: [[5, 5, 5, 5, 5, 5, 5, 5]],              # cut by the turn's tokens: not truncated
        3: [[5, STOP], [5, 5, 5, 5, 5, 5, 5, 5]],   # its second reply fills the episode
        4: [[5, 5, 5, EOS]],                        # answers at once
    }
    seen = []

    def respond(calls):
        seen.extend(calls)
        return [Observation([40, 41], seconds=0.5) for _ in calls]

    decode = lambda ids: "".join("</>" if t == STOP else "x" for t in ids)  # noqa: E731
    episodes = run_episodes(_scripted(replies), [[1, 2]] * 5, list(range(5)),
                            EpisodeConfig(max_turns=2, max_episode_tokens=8, turn_tokens=6,
                                          stop="</>"),
                            decode, respond, eos_ids=[EOS], pad_id=PAD)
    out, stats = episodes.output, episodes.stats
    width = out.prompt_length
    assert out.input_ids[0, width:].tolist()[:7] == [5, 5, STOP, 40, 41, 6, EOS]
    assert out.response_mask[0].tolist()[:7] == [1, 1, 1, 0, 0, 1, 1]
    assert stats["turns"].tolist() == [2, 2, 1, 2, 1]
    assert stats["tool_calls"].tolist() == [1, 2, 0, 1, 0]
    assert stats["truncated"].tolist() == [0, 1, 0, 1, 0]
    assert stats["observation_tokens"].tolist() == [2, 2, 0, 2, 0]
    assert stats["tool_seconds"].tolist() == [0.5, 1.0, 0, 0.5, 0]
    assert out.attention_mask[:, width:].sum(1).tolist() == [7, 6, 6, 8, 4]
    assert out.input_ids[3, width:].tolist() == [5, STOP, 40, 41, 5, 5, 5, 5]
    assert out.response_mask[3].tolist() == [1, 1, 0, 0, 1, 1, 1, 1]
    assert [row for row, _ in seen] == [0, 1, 3, 1]
    assert seen[0][1] == "xx</>"


def test_episode_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="max_turns=0 must be >= 1"):
        EpisodeConfig(max_turns=0, max_episode_tokens=8, turn_tokens=4)


def test_a_greedy_row_is_greedy_in_every_turn(tiny) -> None:
    """``greedy_every=2``: rows 0 and 2 take the argmax in every turn (their sampling log-probs
    are 0, a point mass), rows 1 and 3 sample."""
    config = GenerationConfig(temperature=1.0, seed=5, greedy_every=2)
    prompts = make_prompts([4, 7, 3, 6], seed=4)
    first = generate_sequences(*tiny, prompts, [0, 1, 2, 3],
                               GenerationConfig(**{**config.__dict__, "max_new_tokens": 8}),
                               eos_id=249, pad_id=PAD)
    stop_id = first.responses[0, 2].item()  # greedy row 0 calls the tool at its third token
    episodes = run_episodes(
        _model_generate(tiny, config, 249), prompts, [0, 1, 2, 3],
        EpisodeConfig(max_turns=3, max_episode_tokens=40, turn_tokens=8, stop="#"),
        _decode_with_stop(stop_id), lambda calls: [Observation([7, 8]) for _ in calls],
        eos_ids=[249], pad_id=PAD, greedy_every=2)
    out, stats = episodes.output, episodes.stats
    assert stats["turns"][0] > 1, "the greedy row replies again after the tool's answer"
    sampled = out.response_mask.bool()
    for row in range(4):
        logprobs = out.response_logprobs[row][sampled[row]]
        assert bool((logprobs == 0).all()) == (row % 2 == 0), row


def test_turn_keys_keep_the_row_and_its_greedy_residue() -> None:
    """Turn 0 is the row's own id; later turns differ from it and from each other, stay in
    [0, 2**63) for ids of refill rounds, and keep the id modulo greedy_every."""
    ids = [0, 1, 7, 5 * (1 << 44) * 16 + 3]
    for i in ids:
        assert turn_key(i, 0, 16) == i
        keys = [turn_key(i, t, 16) for t in range(1, 6)]
        assert len(set(keys) | {i}) == 6
        assert all(0 <= k < 1 << 63 and k % 16 == i % 16 for k in keys)
