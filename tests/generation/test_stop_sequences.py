"""Stop sequences (``generation.stop_sequences``): the generator itself ends a response right
after its sampled tokens end with one, in the static loop, with continuous batching and through
the captured decode step. The kept tokens and log-probs are exactly those of a response
generated without the stop sequence and cut after its first occurrence, and fewer decode steps
run. Episodes that stop a tool call in the generator equal those that cut it afterwards."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_rlhf.engine.execution.episodes import EpisodeRollouts
from megatron_rlhf.generation import GenerationConfig, GenerationOutput, generate_sequences
from megatron_rlhf.generation.episodes import EpisodeConfig, Observation, run_episodes
from megatron_rlhf.generation.sampling import ends_with_stop_sequence, stop_sequence_tensors
from megatron_rlhf.rewards.tools import ToolAnswer
from megatron_rlhf.testing.graph_standin import EMULATE_ENV
from tests.generation.helpers import BASE, PAD, generate_tiny, make_prompts


def _cut_at(tokens: list[int], sequences: list[list[int]]) -> int | None:
    """The length of the shortest prefix of ``tokens`` that ends with one of ``sequences``."""
    return next((k for k in range(1, len(tokens) + 1)
                 if any(k >= len(s) and tokens[k - len(s):k] == s for s in sequences)), None)


def _forwards(out: GenerationOutput) -> int:
    """Model calls the generation ran (prefills and decode steps)."""
    return sum(work.forwards for work in out.micro_batches)


def _stop_sequences(reference: GenerationOutput) -> list[list[int]]:
    """Sequences that end every response of ``reference`` by its fourth token: the longest
    one's second and third tokens, and each other's fourth token (when it has one)."""
    rows = reference.responses.tolist()
    lengths = reference.response_lengths.tolist()
    longest = max(range(len(rows)), key=lambda r: lengths[r])
    return [rows[longest][1:3]] + [[rows[r][3]] for r in range(len(rows))
                                   if r != longest and lengths[r] > 3]


@pytest.mark.parametrize("batching,slots,graphs", [
    ("static", 0, False), ("static", 3, False), ("continuous", 0, False),
    ("continuous", 3, False), ("continuous", 16, True)])
def test_the_generator_stops_where_a_cut_afterwards_would(tiny, end_ids, monkeypatch,
                                                          batching: str, slots: int,
                                                          graphs: bool) -> None:
    if graphs:
        monkeypatch.setenv(EMULATE_ENV, "1")
    config = dataclasses.replace(BASE, batching=batching, micro_batch_size=slots,
                                 stop_check_interval=1)
    reference = generate_tiny(tiny, config, end_ids)
    sequences = _stop_sequences(reference)
    out = generate_tiny(tiny, dataclasses.replace(config, stop_sequences=sequences), end_ids)
    tokens, lengths = reference.responses.tolist(), reference.response_lengths.tolist()
    refills = batching == "continuous" and 0 < slots < len(tokens)
    cut_rows = 0
    for row in range(len(tokens)):
        cut = _cut_at(tokens[row][:lengths[row]], sequences)
        n = lengths[row] if cut is None else cut
        cut_rows += cut is not None and cut < lengths[row]
        assert int(out.response_lengths[row]) == n, row
        assert out.responses[row, :n].tolist() == tokens[row][:n], row
        for name in ("response_logprobs", "response_policy_logprobs"):
            # bit-exact, except where ending earlier moves a later prompt into a slot sooner
            # (continuous batching with fewer slots than prompts): its keys then sit at other
            # cache positions among other masked keys, which rounds differently
            torch.testing.assert_close(getattr(out, name)[row, :n],
                                       getattr(reference, name)[row, :n], rtol=0,
                                       atol=1e-6 if refills else 0)
            assert not getattr(out, name)[row, n:].any()
    assert cut_rows >= 2, "the stop sequences must end some responses early"
    assert _forwards(out) < _forwards(reference)


def test_a_stop_sequence_matches_only_sampled_tokens() -> None:
    """The window never reaches before a response's first token, nor past its last."""
    config = GenerationConfig(stop_sequences=[[5, 6], [9]])
    sequences = stop_sequence_tensors(config, "cpu")
    responses = torch.tensor([[6, 1, 1, 1], [5, 6, 1, 1], [1, 5, 6, 9], [9, 0, 0, 0]])
    rows = torch.arange(4)
    assert ends_with_stop_sequence(responses, rows, torch.tensor([1, 2, 3, 1]),
                                   sequences).tolist() == [False, True, True, True]
    assert ends_with_stop_sequence(responses, rows, torch.tensor([4, 1, 2, 4]),
                                   sequences).tolist() == [False, False, False, False]
    assert ends_with_stop_sequence(responses, torch.tensor([2]), torch.tensor(4),
                                   sequences).tolist() == [True]


@pytest.mark.parametrize("fields,match", [
    ({"stop_sequences": [[]]}, "stop_sequences"),
    ({"stop_sequences": [[3, -1]]}, "stop_sequences"),
])
def test_bad_stop_sequences_are_refused(fields, match) -> None:
    with pytest.raises(ValueError, match=match):
        GenerationConfig(**fields)


def test_stop_ids_outside_the_vocabulary_are_refused(tiny) -> None:
    with pytest.raises(ValueError, match=r"stop_sequences holds \[3, 100000\]"):
        generate_tiny(tiny, dataclasses.replace(BASE, stop_sequences=[[3, 100000]]), None)


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_episodes_stopped_in_the_generator_equal_those_cut_afterwards(tiny, batching) -> None:
    model, pgc = tiny
    config = GenerationConfig(temperature=0.9, seed=3, batching=batching, stop_check_interval=1)
    prompts = make_prompts([4, 7, 3, 6, 5, 8], seed=2)
    first = generate_sequences(model, pgc, prompts, list(range(6)),
                               dataclasses.replace(config, max_new_tokens=10),
                               eos_id=249, pad_id=PAD)
    stop_ids = set(first.responses[:, 2].tolist())  # every row calls a tool in turn 0
    forwards = []

    def run(stop_sequences: list[list[int]]):
        def generate(contexts, ids, max_new):
            out = generate_sequences(model, pgc, contexts, ids, dataclasses.replace(
                config, max_new_tokens=max_new, stop_sequences=stop_sequences),
                eos_id=249, pad_id=PAD)
            forwards.append(_forwards(out))
            return out
        return run_episodes(generate, prompts, list(range(6)),
                            EpisodeConfig(max_turns=3, max_episode_tokens=40, turn_tokens=10,
                                          stop="#"),
                            lambda ids: "".join("#" if t in stop_ids else "." for t in ids),
                            lambda calls: [Observation([7, 8, 9]) for _ in calls],
                            eos_ids=[249], pad_id=PAD)

    cut_afterwards = run([])
    calls_before = sum(forwards)
    stopped = run([[i] for i in sorted(stop_ids)])
    assert stopped.output.input_ids.shape == cut_afterwards.output.input_ids.shape
    for name, value in vars(cut_afterwards.output).items():
        if isinstance(value, torch.Tensor):
            # continuous batching shrinks the decode batch sooner when replies stop sooner:
            # other batch shapes, log-probs that round differently
            tolerance = 1e-6 if batching == "continuous" and value.is_floating_point() else 0
            torch.testing.assert_close(getattr(stopped.output, name), value, rtol=0,
                                       atol=tolerance, msg=name)
    for name, value in cut_afterwards.stats.items():
        assert torch.equal(stopped.stats[name], value), name
    assert cut_afterwards.stats["tool_calls"].sum() >= len(prompts)
    assert sum(forwards) - calls_before < calls_before


class _Tools:
    """Answers every call with ``"4"`` (the wiring test needs no worker pool)."""

    def __init__(self) -> None:
        self.calls = 0

    def call(self, calls) -> list[ToolAnswer]:
        self.calls += len(calls)
        return [ToolAnswer("4", False, 0.0) for _ in calls]


def test_tool_episodes_stop_the_generator_at_the_end_tags_ids(tiny) -> None:
    """``EpisodeRollouts`` hands the generator the end tag's token ids (the tiny tokenizer
    spells each character as one id), next to the configured stop sequences."""
    model, pgc = tiny
    encode = lambda text: [10 + ord(c) % 200 for c in text]  # noqa: E731
    tag = encode("</tool_call>")
    # a reply's fourth token decodes as the whole tag (a stand-in for a tag of one token)
    configs, fourth = [], {}

    class Worker:
        pg_collection = pgc

        def generate(self, prompts, ids, config, eos_id, pad_id):
            configs.append(config)
            out = generate_sequences(model, pgc, prompts, ids, config, eos_id, pad_id)
            fourth.setdefault("id", out.responses[0, 3].item())
            return out

    def decode(ids: list[int]) -> str:
        return "".join("<tool_call>{}</tool_call>" if t == fourth["id"] else "." for t in ids)

    tools = _Tools()
    rollouts = EpisodeRollouts(EpisodeConfig(2, 30, 8), encode, decode, tools=tools)
    rollouts.run(Worker(), make_prompts([4, 6], seed=1), [0, 1], [(0, {}), (1, {})],
                 GenerationConfig(seed=2, stop_sequences=[[5, 6]]), 249, PAD)
    assert [c.stop_sequences for c in configs] == [[[5, 6], tag]] * len(configs)
    assert tools.calls >= 1
