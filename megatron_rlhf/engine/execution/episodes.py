"""Multi-turn rollouts on a generating replica: tool calls or an environment between replies.

The engine hands a generating rank's prompts (with their records) to :class:`EpisodeRollouts`,
which runs ``generation/episodes.py``'s turn loop over the rank's model
(``ModelWorker.generate``) and answers the replies: tool calls with ``rewards/tools.py``'s
:class:`Tools` (in worker processes), or every reply with one ``rewards/environments.py``
environment per episode (in this process: it keeps state). An answer is wrapped in the tool or
user message format and encoded once; those tokens are the observation the policy reads and
the tokens trained on (masked out of every loss). The episode counts and the environment's
summed reward travel with the rollout as ``[b]`` fields (:data:`STAT_FIELDS`); the reward joins
the sequence score, the counts become the step's ``rollout/*`` metrics
(:func:`episode_metrics`). With ``rollout.overlap_tools`` the tools run beside decoding
(``run_episodes_overlapped``): the replica's first TP rank submits each call as its reply
ends, and every generation call takes the episodes whose answers are back by then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_rlhf.engine.execution.workers import ModelWorker
from megatron_rlhf.generation import GenerationConfig, GenerationOutput
from megatron_rlhf.generation.episodes import (
    EPISODE_STATS,
    EpisodeConfig,
    Observation,
    run_episodes,
    run_episodes_overlapped,
)
from megatron_rlhf.models.prompting import ToolMessage, plain_tool_message
from megatron_rlhf.rewards.environments import EnvironmentError_, EnvironmentSpec, Episode
from megatron_rlhf.rewards.tools import PendingAnswer, ToolAnswer, ToolCall, ToolError, Tools

STAT_FIELDS = {name: f"episode_{name}" for name in EPISODE_STATS}
"""Episode count -> the rollout field that carries it."""

USER_MESSAGE = "\n{observation}\n"
"""The plain-text user message an environment's observation is read in."""


def _on_first_tp_rank(worker: ModelWorker, call: Callable[[], Any]) -> Any:
    """``call()`` on the first rank of ``worker``'s TP group, its result sent to the others: a
    tool or an environment answers once per replica, and every TP rank reads the same answer
    (a search tool need not answer twice alike)."""
    tp = worker.pg_collection.tp
    if tp.size() == 1:
        return call()
    box = [call() if tp.rank() == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(tp, 0), group=tp)
    return box[0]


def _raise_or_end(results: list[Any], on_error: str) -> list[Any]:
    """``results`` of environment calls (as every TP rank received them); with
    ``on_error="error"`` the first :class:`EnvironmentError_` among them is raised, on every
    rank alike, and with ``"end"`` it stays in place (its episode ends)."""
    if on_error == "error":
        for result in results:
            if isinstance(result, EnvironmentError_):
                raise result
    return results


class _ReplicaToolAnswers:
    """The tool answers of the overlapped loop (``run_episodes_overlapped``'s ``Answers``) on a
    replica: its first TP rank submits the calls and reads the answers back, and sends each
    collect's answers to the other TP ranks, so every rank of the replica takes the same rows
    into each ``generate`` call (generation runs with ``pp = 1``: the TP group is every rank
    of the replica's calls). A :class:`ToolError` (``tool_on_error=error``) is raised on every
    TP rank alike."""

    def __init__(self, worker: ModelWorker, tools: Tools,
                 records: Sequence[tuple[int, Mapping[str, Any]]],
                 observe: Callable[[ToolAnswer], Observation]) -> None:
        self.worker, self.tools, self.records, self.observe = worker, tools, records, observe
        self.pending: dict[int, PendingAnswer] = {}  # on the first TP rank only

    def submit(self, row: int, text: str) -> None:
        if self.worker.pg_collection.tp.rank() == 0:
            index, record = self.records[row]
            self.pending[row] = self.tools.submit(ToolCall(text, record, index))

    def collect(self, block: bool) -> list[tuple[int, Observation]]:
        answered = _on_first_tp_rank(self.worker, lambda: self._answered(block))
        if isinstance(answered, ToolError):
            raise answered
        return [(row, self.observe(answer)) for row, answer in answered]

    def _answered(self, block: bool) -> list[tuple[int, ToolAnswer]] | ToolError:
        if block:
            self.tools.wait(list(self.pending.values()))
        rows = sorted(row for row, pending in self.pending.items() if pending.ready())
        try:
            return [(row, self.pending.pop(row).answer(wait=False)) for row in rows]
        except ToolError as error:  # raised on every TP rank by collect()
            return error


class EpisodeRollouts:
    """Episodes with tools or an environment on the ranks that generate.

    Args:
        config: the episode's bounds (``rollout.max_turns``, ``rollout.max_episode_tokens``,
            ``generation.max_new_tokens`` per reply); ``stop`` None with an environment.
        encode: text to token ids (the run's tokenizer, no BOS or EOS).
        decode: token ids to text.
        tools: the configured tools and their worker pool (or ``environment``).
        environment: the configured environment (or ``tools``).
        encode_prompt: an environment's first user message to prompt ids (BOS or the chat
            template, as the prompt set's prompts); default ``encode``.
        tool_message: a tool's answer to the text of the message the policy reads
            (``models.prompting.tool_message_for``); default
            ``models.prompting.plain_tool_message``.
        encode_continuation: text to the ids it has after other text
            (``Tokenizer.encode_continuation``), for the stop text; default ``encode``.
        overlap_tools: run the tools' waits beside decoding (``rollout.overlap_tools``,
            ``run_episodes_overlapped``): the same tokens, log-probs equal to rounding.

    Raises:
        ValueError: neither or both of tools and an environment, or ``overlap_tools`` with an
            environment.
    """

    def __init__(self, config: EpisodeConfig, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], tools: Tools | None = None,
                 environment: EnvironmentSpec | None = None,
                 encode_prompt: Callable[[str], list[int]] | None = None,
                 tool_message: ToolMessage = plain_tool_message,
                 encode_continuation: Callable[[str], list[int]] | None = None,
                 overlap_tools: bool = False) -> None:
        if (tools is None) == (environment is None):
            raise ValueError("give tools or an environment")
        if overlap_tools and tools is None:
            raise ValueError("overlap_tools overlaps tool calls; an environment has none")
        self.overlap_tools = overlap_tools
        self.config = config
        self.tools = tools
        self.environment = environment
        self.encode = encode
        self.decode = decode
        self.encode_prompt = encode_prompt or encode
        self.tool_message = tool_message
        self.stop_ids = (encode_continuation or encode)(config.stop) if config.stop else None
        """The tool call's end tag as token ids: the generator stops a reply there."""

    def run(self, worker: ModelWorker, prompts: Sequence[Sequence[int]],
            prompt_indices: Sequence[int], records: Sequence[tuple[int, Mapping[str, Any]]],
            generation: GenerationConfig, eos_id: int | tuple[int, ...], pad_id: int
            ) -> tuple[GenerationOutput, dict[str, torch.Tensor]]:
        """One episode per prompt on ``worker``'s model; the batch and its ``STAT_FIELDS``."""
        stops = [*generation.stop_sequences, *([self.stop_ids] if self.stop_ids else [])]

        def generate(contexts: list[list[int]], ids: list[int], max_new: int
                     ) -> GenerationOutput:
            return worker.generate(contexts, ids, replace(generation, max_new_tokens=max_new,
                                                          stop_sequences=stops),
                                   eos_id, pad_id)

        def answer_tools(calls: list[tuple[int, str]]) -> list[Observation]:
            answers = _on_first_tp_rank(worker, lambda: self.tools.call(
                [ToolCall(text, records[row][1], records[row][0]) for row, text in calls]))
            return [self._observation(answer) for answer in answers]

        if self.environment is not None:
            spec = self.environment
            envs: list[Episode | None] = []  # on the first TP rank only; None: failed

            def start() -> list[str | None | EnvironmentError_]:
                firsts = []
                for index, record in records:
                    try:
                        envs.append(spec.make(record, index))
                        firsts.append(envs[-1].reset())
                    except EnvironmentError_ as error:  # raised on every rank below
                        envs[len(firsts):] = [None]  # whether make() or reset() failed
                        firsts.append(error)
                return firsts

            firsts = _raise_or_end(_on_first_tp_rank(worker, start), spec.on_error)
            prompts = [self.encode_prompt(first) if isinstance(first, str) else list(prompt)
                       for prompt, first in zip(prompts, firsts, strict=True)]

            def step(row: int, text: str) -> tuple[str | None, float, bool] | EnvironmentError_:
                if envs[row] is None:  # its construction or reset() failed: the episode ends
                    return EnvironmentError_("its construction or reset() failed")
                try:
                    return envs[row].step(text)
                except EnvironmentError_ as error:
                    envs[row] = None
                    return error

            def answer_environment(calls: list[tuple[int, str]]) -> list[Observation]:
                observations = []
                steps = _raise_or_end(_on_first_tp_rank(
                    worker, lambda: [step(row, text) for row, text in calls]), spec.on_error)
                for result in steps:
                    if isinstance(result, EnvironmentError_):
                        observations.append(Observation([], failed=True, done=True))
                        continue
                    observation, reward, done = result
                    tokens = ([] if observation is None else
                              self.encode(USER_MESSAGE.format(observation=observation)))
                    observations.append(Observation(tokens, reward=reward,
                                                    done=done or observation is None))
                return observations

        eos_ids = list(eos_id) if isinstance(eos_id, tuple | list) else [eos_id]
        if self.overlap_tools:
            answers = _ReplicaToolAnswers(worker, self.tools, records, self._observation)
            episodes = run_episodes_overlapped(generate, prompts, prompt_indices, self.config,
                                               self.decode, answers, eos_ids, pad_id,
                                               generation.greedy_every)
        else:
            respond = answer_tools if self.environment is None else answer_environment
            episodes = run_episodes(generate, prompts, prompt_indices, self.config,
                                    self.decode, respond, eos_ids, pad_id,
                                    generation.greedy_every)
        device = episodes.output.input_ids.device
        return episodes.output, {STAT_FIELDS[name]: value.to(device)
                                 for name, value in episodes.stats.items()}

    def _observation(self, answer: ToolAnswer) -> Observation:
        """A tool's answer as the tokens of the message the policy reads."""
        return Observation(self.encode(self.tool_message(answer.text)), answer.failed,
                           answer.seconds)

    def close(self) -> None:
        """Stop the tools' worker processes."""
        if self.tools is not None:
            self.tools.close()


def episode_metrics(fields: Mapping[str, torch.Tensor], environment: bool) -> dict[str, float]:
    """The step's ``rollout/*`` metrics from the rows' episode counts (:data:`STAT_FIELDS`, in
    a run with episodes): means per episode of turns, tool calls, failed calls and observation
    tokens, the share of truncated episodes, the mean seconds of a tool call, and with an
    ``environment`` the mean of its summed step rewards."""
    stats = {name: fields[field].float() for name, field in STAT_FIELDS.items()}
    calls = float(stats["tool_calls"].sum())
    metrics = {f"rollout/{name}": float(stats[name].mean())
               for name in ("turns", "tool_calls", "tool_errors", "observation_tokens",
                            "truncated")}
    if environment:
        metrics["rollout/environment_reward"] = float(stats["reward"].mean())
    metrics["rollout/tool_latency_s"] = float(stats["tool_seconds"].sum()) / calls if calls else 0.0
    return metrics
