"""SFT on tool-calling demonstrations (``turns``): a demonstration's row is, token for token, the
row a multi-turn episode builds from the same replies and tool answers (run through the engine's
``EpisodeRollouts`` with a scripted policy), the loss leaves out exactly the prompt and the tool
messages, and malformed turns are refused naming their column."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.data import (
    DataError,
    FieldNames,
    ReaderConfig,
    SFTDataset,
    SFTExample,
    collate_sft,
    read_records,
)
from megatron_rlhf.data.demonstrations import DemonstrationStream
from megatron_rlhf.models.tokenizer import Tokenizer

PROMPT = "Multiply 12 by 3, then add 4."
REPLIES = ('<tool_call>{"name": "calculator", "arguments": {"a": 12, "b": 3, "op": "*"}}'
           "</tool_call>",
           'Now the sum.<tool_call>{"name": "calculator", "arguments": {"a": 36, "b": 4, '
           '"op": "+"}}</tool_call>',
           "The result is 40.")
ANSWERS = ("36", "40")
TURNS = (({"role": "assistant", "content": REPLIES[0]}, {"role": "tool", "content": ANSWERS[0]},
          {"role": "assistant", "content": REPLIES[1]}, {"role": "tool", "content": ANSWERS[1]},
          {"role": "assistant", "content": REPLIES[2]}))

PLAIN = "\n<tool_response>\n{}\n</tool_response>\n"
QWEN = "<|im_end|>\n<|im_start|>tool\n{}<|im_end|>\n<|im_start|>assistant\n"
"""The tool messages as the policy reads them: plain text, and the Qwen template's tool turn."""


class _Answer:
    def __init__(self, text: str) -> None:
        self.text, self.failed, self.seconds = text, False, 0.0


class _ScriptedTools:
    """Answers the i-th call of an episode with ``ANSWERS[i]`` (one episode)."""

    def __init__(self) -> None:
        self.calls = 0

    def call(self, calls: list) -> list[_Answer]:
        answers = [_Answer(ANSWERS[self.calls + i]) for i in range(len(calls))]
        self.calls += len(calls)
        return answers

    def close(self) -> None:
        pass


class _ScriptedPolicy:
    """A worker whose t-th reply is ``encode(REPLIES[t])``, EOS after the last."""

    class _Solo:
        def size(self) -> int:
            return 1

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.turn = 0
        self.pg_collection = SimpleNamespace(tp=self._Solo())

    def generate(self, contexts, ids, generation, eos_id, pad_id):
        from megatron_rlhf.generation import GenerationOutput

        (context,) = contexts
        reply = self.tokenizer.encode(REPLIES[self.turn])
        reply += [self.tokenizer.eos_id] if self.turn == len(REPLIES) - 1 else []
        self.turn += 1
        n, width = len(reply), len(context)
        input_ids = torch.tensor([context + reply])
        mask = torch.ones_like(input_ids)
        logprobs = -torch.ones(1, n)
        return GenerationOutput(input_ids, mask, mask[:, :width],
                                torch.ones(1, n, dtype=torch.long), logprobs, logprobs,
                                torch.tensor([width]), torch.tensor([n]))


def _episode_row(tokenizer, chat_template: bool) -> tuple[list[int], list[int]]:
    """The tokens and loss mask of the episode the engine runs for :data:`PROMPT` (prompt
    encoded as a PPO prompt, tool message chosen as ``runner.episode_rollouts_for`` does)."""
    from megatron_rlhf.engine.execution.episodes import EpisodeRollouts
    from megatron_rlhf.generation import GenerationConfig
    from megatron_rlhf.generation.episodes import EpisodeConfig
    from megatron_rlhf.models.prompting import encode_prompt, tool_message_for

    rollouts = EpisodeRollouts(EpisodeConfig(max_turns=5, max_episode_tokens=1000,
                                             turn_tokens=200),
                               tokenizer.encode, tokenizer.decode, tools=_ScriptedTools(),
                               tool_message=tool_message_for(tokenizer, chat_template))
    prompt = encode_prompt(tokenizer, PROMPT, None, chat_template)
    out, stats = rollouts.run(_ScriptedPolicy(tokenizer), [prompt], [0], [(0, {})],
                              GenerationConfig(), tokenizer.eos_id, tokenizer.pad_id)
    assert stats["episode_tool_calls"].tolist() == [2.0]
    real = out.attention_mask[0].bool()
    span = int(out.response_lengths[0])
    return (out.input_ids[0][real].tolist(),
            [0] * len(prompt) + out.response_mask[0, :span].tolist())


def _sft_row(tokenizer, chat_template: bool, max_length: int = 1000
             ) -> tuple[list[int], list[int]]:
    batch = collate_sft([SFTExample(PROMPT, None, turns=TURNS)], tokenizer, max_length,
                        chat_template)
    real = batch.attention_mask[0].bool()
    return batch.input_ids[0][real].tolist(), batch.loss_mask[0][real].tolist()


def _independent_mask(tokenizer, chat_template: bool, message: str) -> list[int]:
    """0 on the prompt and on each tool message, from the parts encoded one by one."""
    from megatron_rlhf.models.prompting import encode_prompt

    mask = [0] * len(encode_prompt(tokenizer, PROMPT, None, chat_template))
    for turn in TURNS:
        if turn["role"] == "assistant":
            mask += [1] * len(tokenizer.encode(turn["content"]))
        else:
            mask += [0] * len(tokenizer.encode(message.format(turn["content"])))
    return mask + [1]


def test_a_demonstration_is_the_episode_row_with_the_builtin_tokenizer(
        tokenizer: Tokenizer) -> None:
    ids, mask = _sft_row(tokenizer, True)
    assert (ids, mask) == _episode_row(tokenizer, True)
    assert mask == _independent_mask(tokenizer, True, PLAIN)
    assert ids[0] == tokenizer.bos_id and ids[-1] == tokenizer.eos_id
    assert 0 < sum(mask) < len(mask) - len(tokenizer.encode(PROMPT)) - 1


@pytest.mark.parametrize("chat_template", [True, False])
def test_a_demonstration_is_the_episode_row_with_a_chat_template(tmp_path: Path,
                                                                 chat_template: bool) -> None:
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer
    from tools.make_tiny_hf import make_hf_tokenizer

    make_hf_tokenizer(tmp_path, "qwen")
    hf = HFTokenizer.load(tmp_path)
    ids, mask = _sft_row(hf, chat_template)
    assert (ids, mask) == _episode_row(hf, chat_template)
    assert mask == _independent_mask(hf, chat_template, QWEN if chat_template else PLAIN)
    if chat_template:  # the template's tool turn, with the reply's own end marker, is masked
        first_tool = mask.index(0, mask.index(1))
        assert hf.decode(ids[first_tool:mask.index(1, first_tool)]).startswith("\ntool\n36")


def test_a_cut_demonstration_keeps_ids_and_mask_aligned(tokenizer: Tokenizer) -> None:
    whole_ids, whole_mask = _sft_row(tokenizer, True)
    cut = len(whole_ids) - len(tokenizer.encode(REPLIES[2])) - 3  # inside the last tool message
    ids, mask = _sft_row(tokenizer, True, max_length=cut)
    assert (ids, mask) == (whole_ids[:cut], whole_mask[:cut])
    assert mask[-1] == 0


def test_plain_responses_keep_their_rows(tokenizer: Tokenizer) -> None:
    """A response text is one assistant turn: BOS prompt response EOS, the loss on the last
    two parts, as before turns existed."""
    batch = collate_sft([SFTExample(PROMPT, REPLIES[2]),
                         SFTExample(PROMPT, None, turns=TURNS[-1:])], tokenizer, 1000)
    assert torch.equal(batch.input_ids[0], batch.input_ids[1])
    assert torch.equal(batch.loss_mask[0], batch.loss_mask[1])
    prompt = tokenizer.encode(PROMPT, add_bos=True)
    response = tokenizer.encode(REPLIES[2], add_eos=True)
    assert batch.input_ids[0].tolist() == prompt + response
    assert batch.loss_mask[0].tolist() == [0] * len(prompt) + [1] * len(response)


def test_demonstration_stream_rows_are_the_sft_rows(tokenizer: Tokenizer) -> None:
    """PPO-ptx rows of a demonstration with turns: the SFT row, padded to the PPO length."""
    example, length = SFTExample(PROMPT, None, turns=TURNS), 400
    rows = DemonstrationStream([example], tokenizer, length, rows=1, seed=0).batch(0)
    ids, mask = _sft_row(tokenizer, True)
    pad = length - len(ids)
    assert rows["input_ids"][0].tolist() == ids + [tokenizer.pad_id] * pad
    assert rows["loss_mask"][0].tolist() == mask + [0] * pad


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


SFT_READER = ReaderConfig(required=["prompt", "response"], on_bad_record="error")
"""``SFTConfig``'s reader, refusing the first bad record."""


def test_records_with_turns_need_no_response(tmp_path: Path) -> None:
    path = _write(tmp_path / "turns.jsonl", [
        {"prompt": PROMPT, "turns": list(TURNS)},
        {"prompt": PROMPT, "response": REPLIES[2]},
        {"question": PROMPT, "trajectory": list(TURNS)}])
    (with_turns, plain), summary = read_records(
        path, ReaderConfig(required=["prompt", "response"]))
    assert summary.counts == {"missing_field": 1}
    assert with_turns.turns == TURNS and with_turns.response is None
    assert plain.turns is None
    examples = SFTDataset([with_turns, plain]).examples
    assert (examples[0].turns, examples[0].response) == (TURNS, None)
    assert (examples[1].turns, examples[1].response) == (None, REPLIES[2])
    (renamed,), _ = read_records(path, ReaderConfig(
        fields=FieldNames(prompt="question", turns="trajectory"),
        required=["prompt", "response"], on_bad_record="skip"))
    assert renamed.turns == TURNS
    conversation = {"messages": [{"role": "user", "content": PROMPT}], "turns": list(TURNS)}
    (record,), _ = read_records(_write(tmp_path / "chat.jsonl", [conversation]), SFT_READER)
    assert (record.messages, record.turns) == (({"role": "user", "content": PROMPT},), TURNS)


def test_a_record_without_response_or_turns_is_named(tmp_path: Path) -> None:
    path = _write(tmp_path / "none.jsonl", [{"prompt": PROMPT, "turns": list(TURNS)},
                                            {"prompt": PROMPT}])
    with pytest.raises(DataError, match=r"line 2, field 'response': missing_field \(no "
                                        r"response: key 'response' absent or null and no "
                                        r"'turns'\)"):
        read_records(path, SFT_READER)
    conversation = _write(tmp_path / "chat.jsonl", [{"messages": [_turn("user", PROMPT)]}])
    with pytest.raises(DataError, match=r"line 1, field 'response': missing_field \(no response "
                                        r"text .* and no 'turns'\)"):
        read_records(conversation, SFT_READER)
    with pytest.raises(ValueError, match="response text or turns, not neither"):
        SFTExample(PROMPT, None)
    with pytest.raises(ValueError, match="not both"):
        SFTExample(PROMPT, "x", turns=TURNS)


def _turn(role, content="x") -> dict:
    return {"role": role, "content": content}


MALFORMED = [
    ([_turn("assistant"), _turn("assistant")], r"turn 1 is 'assistant' where 'tool' is due"),
    ([_turn("tool"), _turn("assistant")], r"turn 0 is 'tool' where 'assistant' is due"),
    ([_turn("assistant"), _turn("user"), _turn("assistant")], r"turn 1 has role 'user'"),
    ([_turn("assistant"), _turn("tool", 5), _turn("assistant")],
     r"turn 1's content is int, not a string"),
    ([_turn("assistant"), _turn("tool")], r"the last turn \(1\) is a tool's answer"),
    ([], r"non-empty list of assistant and tool turns, got an empty list"),
    ("a text", r"non-empty list of assistant and tool turns, got str"),
    (["a text"], r"turn 0 is a str, not an object"),
]


@pytest.mark.parametrize(("turns", "detail"), MALFORMED)
def test_malformed_turns_are_refused_naming_the_column(tmp_path: Path, turns, detail) -> None:
    path = _write(tmp_path / "bad.jsonl", [{"prompt": PROMPT, "steps": turns}])
    config = ReaderConfig(fields=FieldNames(turns="steps"), required=["prompt", "response"],
                          on_bad_record="error")
    with pytest.raises(DataError, match=rf"line 1, field 'steps': bad_conversation \(.*{detail}"):
        read_records(path, config)
    with pytest.raises(ValueError, match=detail):
        SFTExample(PROMPT, None, turns=turns)


def test_with_turns_the_messages_are_the_prompt_only(tmp_path: Path) -> None:
    row = {"messages": [_turn("user", PROMPT), _turn("assistant", "Sure.")],
           "turns": list(TURNS)}
    with pytest.raises(DataError, match=r"field 'messages': bad_conversation \(the last turn "
                                        r"is the assistant's"):
        read_records(_write(tmp_path / "both.jsonl", [row]), SFT_READER)
