"""Multi-turn episodes: the policy replies, a tool or an environment answers, the policy goes on.

    episodes = run_episodes(generate, prompts, noise_ids, EpisodeConfig(max_turns=4,
                            max_episode_tokens=96, turn_tokens=32, stop="</tool_call>"),
                            decode, respond)

Token in, token out: an episode is its prompt, then for each turn the tokens the policy sampled
(``response_mask`` 1) and the observation's tokens as ``respond`` produced them (mask 0). Nothing
is decoded and encoded again: the next turn's context is these very tokens, and so is the row
trained on. Each turn is one batched ``generate`` call over the episodes still running (their
contexts are re-prefilled); a reply ends at EOS, at ``turn_tokens``, or right after the token that
completes ``stop``: ``generate`` stops there itself when the reply's tokens end with the stop
text's own token ids (``generation.stop_sequences``), and a reply that spells the text with other
tokens is cut after it (the tokens sampled past it are dropped). With a ``stop`` text (tools), a
reply that ends at it is handed to ``respond``, whose observation is appended, and any other
reply ends its episode; without one (an environment), every reply is handed to ``respond``,
whose observation may end the episode (``done``) and carries a reward. An episode also ends,
marked truncated, when a reply's observation would not fit in ``max_episode_tokens`` with room
for one more token, when its tokens reach that bound without EOS, or when its last allowed turn
was answered without ending it.

The layout is ``generate_sequences``' (``GenerationOutput``): prompts left-padded, the episode
after them right-padded; ``response_mask`` is the loss mask (sampled tokens only) and
``attention_mask`` covers observations too, so every loss, KL and entropy term and every token
count that reads ``response_mask`` leaves observations out, while every forward reads them.
Sampling noise of turn ``t`` of a row with noise id ``i`` is keyed :func:`turn_key` ``(i, t)``:
turn 0 draws what a single reply to the prompt draws, a row's episode does not depend on the
rank, the replica or the other rows of its batch, and every turn of a row that
``generation.greedy_every`` makes greedy is greedy.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Protocol

import torch

from megatron_rlhf.generation.output import GenerationOutput, MicroBatchWork
from megatron_rlhf.generation.sampling import _splitmix64


def turn_key(noise_id: int, turn: int, greedy_every: int = 0) -> int:
    """The noise id of turn ``turn`` of the row with ``noise_id``: the row's own for turn 0;
    for later turns a 63-bit hash of both, congruent to ``noise_id`` modulo ``greedy_every``
    (which rows are greedy is read from the id modulo it). Prompt ids grow past any fixed
    stride (refill rounds add ``1 << 44`` each, times the samples per prompt), hence a hash:
    a later turn's key meets one of ``rows`` other ids with probability below
    ``rows / 2**55`` (``greedy_every`` < 128)."""
    if turn == 0:
        return noise_id
    modulus = max(greedy_every, 1)
    mixed = _splitmix64(_splitmix64(noise_id) ^ turn) >> (1 + modulus.bit_length())
    return mixed * modulus + noise_id % modulus


EPISODE_STATS = ("turns", "tool_calls", "tool_errors", "observation_tokens", "truncated",
                 "tool_seconds", "reward")
"""Per-row counts an episode batch carries (``Episodes.stats``)."""


@dataclass(frozen=True)
class EpisodeConfig:
    """Bounds of an episode.

    Attributes:
        max_turns: replies per episode, >= 1.
        max_episode_tokens: tokens after the prompt (replies and observations), >= 1.
        turn_tokens: most tokens of one reply (``generation.max_new_tokens``), >= 1.
        stop: the text that ends a reply which calls a tool; None: every reply is answered
            (an environment).
    """

    max_turns: int
    max_episode_tokens: int
    turn_tokens: int
    stop: str | None = "</tool_call>"

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_episode_tokens", "turn_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.stop == "":
            raise ValueError("stop must be a non-empty text, or None")


@dataclass(frozen=True)
class Observation:
    """What ``respond`` gives back for one reply."""

    tokens: list[int]
    """The observation as the tokenizer encoded it (appended as is, mask 0)."""
    failed: bool = False
    """The tool call failed (counted in ``tool_errors``)."""
    seconds: float = 0.0
    """How long the tool took."""
    reward: float = 0.0
    """The environment's reward for the reply (summed over the episode)."""
    done: bool = False
    """The environment ended the episode (``tokens`` are not appended)."""


Generate = Callable[[list[list[int]], list[int], int], GenerationOutput]
"""``(contexts, noise ids, max new tokens) -> one reply per context`` (``generate_sequences``)."""

Respond = Callable[[list[tuple[int, str]]], list[Observation]]
"""``[(row, reply text)]`` of the replies to answer -> their observations."""

class Answers(Protocol):
    """Where :func:`run_episodes_overlapped` sends replies and reads their observations back;
    every rank that takes part in the same ``generate`` calls must collect the same answers."""

    def submit(self, row: int, text: str) -> None:
        """Start answering row ``row``'s reply ``text``."""

    def collect(self, block: bool) -> list[tuple[int, Observation]]:
        """``(row, observation)`` of the replies answered since the last collect; with
        ``block``, at least one while some are out."""


class FutureAnswers:
    """:class:`Answers` over futures: ``start(row, text)`` returns the future of the reply's
    :class:`Observation` (a thread pool's ``submit``, for example); one process."""

    def __init__(self, start: Callable[[int, str], Future]) -> None:
        self.start = start
        self.pending: dict[Future, int] = {}

    def submit(self, row: int, text: str) -> None:
        self.pending[self.start(row, text)] = row

    def collect(self, block: bool) -> list[tuple[int, Observation]]:
        done = [future for future in self.pending if future.done()]
        if block and not done and self.pending:
            done = list(wait(list(self.pending), return_when=FIRST_COMPLETED).done)
        return [(self.pending.pop(future), future.result()) for future in done]


@dataclass
class Episodes:
    """A batch of finished episodes."""

    output: GenerationOutput
    """The rows, in ``generate_sequences``' layout (module docstring)."""
    stats: dict[str, torch.Tensor]
    """:data:`EPISODE_STATS` -> ``[b]`` float32 per row."""


@dataclass
class _Episode:
    """One row's episode while it runs."""

    prompt: list[int]
    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    policy_logprobs: list[float]
    done: bool = False

    def append(self, tokens: Sequence[int], logprobs: Sequence[float] = (),
               policy_logprobs: Sequence[float] = ()) -> None:
        """Add sampled tokens (with their log-probs) or observation tokens (without)."""
        sampled = bool(logprobs)
        self.tokens += tokens
        self.loss_mask += [int(sampled)] * len(tokens)
        self.logprobs += logprobs if sampled else [0.0] * len(tokens)
        self.policy_logprobs += policy_logprobs if sampled else [0.0] * len(tokens)


def stop_cut(tokens: Sequence[int], decode: Callable[[list[int]], str], stop: str) -> int | None:
    """The length of the shortest prefix of ``tokens`` whose text contains ``stop``; None when
    the whole text does not."""
    if stop not in decode(list(tokens)):
        return None
    return next(k for k in range(1, len(tokens) + 1) if stop in decode(list(tokens[:k])))


def run_episodes(generate: Generate, prompts: Sequence[Sequence[int]],
                 noise_ids: Sequence[int], config: EpisodeConfig,
                 decode: Callable[[list[int]], str], respond: Respond,
                 eos_ids: Sequence[int], pad_id: int, greedy_every: int = 0) -> Episodes:
    """Run one episode per prompt (module docstring).

    Args:
        generate: samples one reply per context; every rank that must agree on the tokens
            calls it with the same contexts.
        prompts: token ids of each prompt.
        noise_ids: a global, non-negative id per prompt (as ``generate_sequences``'
            ``prompt_indices``).
        config: the episode's bounds.
        decode: token ids to text (to find ``config.stop`` and to hand replies to ``respond``).
        respond: the observations of the replies that called a tool (every reply without
            ``config.stop``).
        eos_ids: the tokens that end a reply (an episode cut short without one is truncated).
        pad_id: fills padding positions.
        greedy_every: ``generation.greedy_every`` of ``generate`` (:func:`turn_key`).
    """
    episodes, stats = _start(prompts)
    work: list[MicroBatchWork] = []
    device = torch.device("cpu")
    for _ in range(config.max_turns):
        rows = [r for r, episode in enumerate(episodes) if not episode.done]
        if not rows:
            break
        out, room = _generate_turn(generate, episodes, stats, rows, noise_ids, config,
                                   greedy_every)
        work += out.micro_batches
        device = out.input_ids.device
        calling = [(r, text) for r, text in _take_replies(out, rows, room, episodes, stats,
                                                          config, decode, eos_ids)
                   if text is not None]
        for (r, _), observation in zip(calling, respond(calling) if calling else [],
                                       strict=True):
            _take_observation(episodes[r], stats, r, observation, config)
    return _finish(episodes, stats, pad_id, work, device)


def run_episodes_overlapped(generate: Generate, prompts: Sequence[Sequence[int]],
                            noise_ids: Sequence[int], config: EpisodeConfig,
                            decode: Callable[[list[int]], str], answers: Answers,
                            eos_ids: Sequence[int], pad_id: int,
                            greedy_every: int = 0) -> Episodes:
    """:func:`run_episodes` with the tools' waits overlapped: each reply goes to ``answers``,
    and the next ``generate`` call takes every episode ready at that moment (not yet started,
    or its answer arrived) while the others' tools still run, instead of one call per turn
    after every answer of the turn. An episode waiting for its tool holds no row of a decode
    batch. Each row draws the tokens :func:`run_episodes` draws (its noise is keyed by its own
    turn, its context is the same tokens); which rows share a batch depends on the tools'
    timing, so the log-probs agree with :func:`run_episodes`' to rounding only.

    Args:
        answers: takes each reply to answer (a tool call, or an environment's step) and gives
            back the observations; the ranks that call ``generate`` together read the same
            ones from each collect.
        generate, prompts, noise_ids, config, decode, eos_ids, pad_id, greedy_every: as
            :func:`run_episodes`.
    """
    episodes, stats = _start(prompts)
    work: list[MicroBatchWork] = []
    device = torch.device("cpu")
    ready, pending = list(range(len(prompts))), 0
    while ready or pending:
        answered = answers.collect(block=not ready)
        pending -= len(answered)
        for r, observation in sorted(answered, key=lambda item: item[0]):
            _take_observation(episodes[r], stats, r, observation, config)
            if not episodes[r].done:
                ready.append(r)
        rows, ready = sorted(ready), []
        if not rows:
            continue
        out, room = _generate_turn(generate, episodes, stats, rows, noise_ids, config,
                                   greedy_every)
        work += out.micro_batches
        device = out.input_ids.device
        for r, text in _take_replies(out, rows, room, episodes, stats, config, decode, eos_ids):
            if text is not None:
                answers.submit(r, text)
                pending += 1
    return _finish(episodes, stats, pad_id, work, device)


def _generate_turn(generate: Generate, episodes: Sequence[_Episode],
                   stats: dict[str, list[float]], rows: Sequence[int],
                   noise_ids: Sequence[int], config: EpisodeConfig, greedy_every: int
                   ) -> tuple[GenerationOutput, dict[int, int]]:
    """The next reply of each of ``rows`` (each at its own turn), and each row's room left."""
    room = {r: config.max_episode_tokens - len(episodes[r].tokens) for r in rows}
    out = generate([episodes[r].prompt + episodes[r].tokens for r in rows],
                   [turn_key(noise_ids[r], int(stats["turns"][r]), greedy_every) for r in rows],
                   min(config.turn_tokens, max(room.values())))
    return out, room


def _take_replies(out: GenerationOutput, rows: Sequence[int], room: dict[int, int],
                  episodes: Sequence[_Episode], stats: dict[str, list[float]],
                  config: EpisodeConfig, decode: Callable[[list[int]], str],
                  eos_ids: Sequence[int]) -> list[tuple[int, str | None]]:
    """Append each row's reply (cut after ``config.stop``); ``(row, text to answer)``, the text
    None where the episode ended with the reply."""
    lengths = out.response_lengths.tolist()
    replies, logprobs, policy = (t.cpu().tolist() for t in (
        out.responses, out.response_logprobs, out.response_policy_logprobs))
    taken = []
    for i, r in enumerate(rows):
        n = min(lengths[i], room[r])
        cut = stop_cut(replies[i][:n], decode, config.stop) if config.stop else None
        n = cut if cut is not None else n
        episode = episodes[r]
        episode.append(replies[i][:n], logprobs[i][:n], policy[i][:n])
        stats["turns"][r] += 1
        # the episode ran out of room before the reply ended by itself
        full = n == room[r] and cut is None and replies[i][n - 1] not in eos_ids
        stats["truncated"][r] = float(full)
        answered = cut is not None or config.stop is None
        taken.append((r, decode(replies[i][:n]) if answered else None))
        episode.done = cut is None
    return taken


def _take_observation(episode: _Episode, stats: dict[str, list[float]], r: int,
                      observation: Observation, config: EpisodeConfig) -> None:
    """Count ``observation`` (the answer to row ``r``'s last reply) and append it, or end the
    episode: the environment ended it, it was truncated, its last turn was answered, or the
    observation would leave no room for another token."""
    stats["tool_calls"][r] += float(config.stop is not None)
    stats["tool_errors"][r] += float(observation.failed)
    stats["tool_seconds"][r] += observation.seconds
    stats["reward"][r] += observation.reward
    if observation.done or stats["truncated"][r]:
        episode.done = True
        return
    if (stats["turns"][r] == config.max_turns or len(episode.tokens) + len(observation.tokens)
            >= config.max_episode_tokens):
        episode.done = True
        stats["truncated"][r] = 1.0
        return
    episode.done = False
    episode.append(observation.tokens)
    stats["observation_tokens"][r] += len(observation.tokens)


def _start(prompts: Sequence[Sequence[int]]
           ) -> tuple[list[_Episode], dict[str, list[float]]]:
    """An empty episode per prompt, and their statistics at zero."""
    return ([_Episode(list(p), [], [], [], []) for p in prompts],
            {name: [0.0] * len(prompts) for name in EPISODE_STATS})


def _finish(episodes: Sequence[_Episode], stats: dict[str, list[float]], pad_id: int,
            work: list[MicroBatchWork], device: torch.device) -> Episodes:
    """The episodes as one batch, with their statistics as tensors."""
    return Episodes(_assemble(episodes, pad_id, tuple(work), device),
                    {name: torch.tensor(values, dtype=torch.float32)
                     for name, values in stats.items()})


def _assemble(episodes: Sequence[_Episode], pad_id: int, work: tuple[MicroBatchWork, ...],
              device: torch.device) -> GenerationOutput:
    """The batch layout of ``generate_sequences`` from each row's episode."""
    b = len(episodes)
    width = max(len(e.prompt) for e in episodes)
    steps = max(len(e.tokens) for e in episodes)
    input_ids = torch.full((b, width + steps), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(b, width + steps, dtype=torch.long)
    response_mask = torch.zeros(b, steps, dtype=torch.long)
    logprobs = torch.zeros(b, steps, dtype=torch.float32)
    policy_logprobs = torch.zeros(b, steps, dtype=torch.float32)
    for row, e in enumerate(episodes):
        p, n = len(e.prompt), len(e.tokens)
        input_ids[row, width - p:width + n] = torch.tensor(e.prompt + e.tokens, dtype=torch.long)
        attention_mask[row, width - p:width + n] = 1
        response_mask[row, :n] = torch.tensor(e.loss_mask, dtype=torch.long)
        logprobs[row, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
        policy_logprobs[row, :n] = torch.tensor(e.policy_logprobs, dtype=torch.float32)
    input_ids, attention_mask, response_mask, logprobs, policy_logprobs = (
        t.to(device) for t in (input_ids, attention_mask, response_mask, logprobs,
                               policy_logprobs))
    prompt_mask = attention_mask[:, :width].clone()
    return GenerationOutput(
        input_ids=input_ids, attention_mask=attention_mask, prompt_mask=prompt_mask,
        response_mask=response_mask, response_logprobs=logprobs,
        response_policy_logprobs=policy_logprobs, prompt_lengths=prompt_mask.sum(dim=1),
        response_lengths=attention_mask[:, width:].sum(dim=1), micro_batches=work)
