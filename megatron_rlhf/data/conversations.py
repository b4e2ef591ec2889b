"""Conversation-shaped preference records: ``messages``, ``chosen``, ``rejected`` as turn lists.

Two common layouts are read (turns are ``{"role": ..., "content": ...}``):

* ``messages``: a conversation; when it ends with an assistant turn, that turn is the reference
  response and the turns before it are the prompt, otherwise every turn is the prompt.
* ``chosen`` / ``rejected`` as conversations that end with the assistant's answer (HH-RLHF,
  UltraFeedback-binarized): the turns before the answer are the prompt and must be the same in
  both (or equal ``messages``' prompt when both are given); a plain-text ``prompt`` column may
  stand for a single user turn when the conversations hold only the answer.

Plain-text ``chosen``/``rejected``/``response`` columns may accompany a ``messages`` prompt.

An SFT response may be a tool-calling trajectory instead (``turns``, :func:`tool_turns`): the
assistant's replies and the tools' answers between them, ``{"role": "assistant" | "tool",
"content": str}``, alternating, first and last the assistant's.
"""

from __future__ import annotations

from typing import Any

Turn = dict[str, str]
Conversation = tuple[Turn, ...]


class ConversationError(ValueError):
    """A record whose turns cannot be used; ``column`` names the offending column."""

    def __init__(self, column: str, detail: str) -> None:
        super().__init__(detail)
        self.column, self.detail = column, detail


def is_conversation_row(row: dict[str, Any], columns: dict[str, str]) -> bool:
    """Whether any of the record's ``messages``/``chosen``/``rejected`` values is a list."""
    return any(isinstance(row.get(columns[name]), list)
               for name in ("messages", "chosen", "rejected"))


def _turns(value: Any, column: str) -> Conversation:
    if not isinstance(value, list) or not value:
        raise ConversationError(column, "expected a non-empty list of turns")
    turns = []
    for index, turn in enumerate(value):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str)
                and isinstance(turn.get("content"), str)):
            raise ConversationError(column, f"turn {index} is not an object with string 'role' "
                                            "and 'content'")
        turns.append({"role": turn["role"], "content": turn["content"]})
    return tuple(turns)


TURN_ROLES = ("assistant", "tool")
"""The roles of a trajectory's turns (:func:`tool_turns`)."""


def tool_turns(value: Any, column: str) -> Conversation:
    """A tool-calling trajectory checked: a non-empty list of ``role``/``content`` objects,
    roles alternating ``assistant``, ``tool``, ..., ``assistant``, contents strings.

    Raises:
        ConversationError: naming ``column`` and the first turn that is wrong.
    """
    if not isinstance(value, list | tuple) or not value:
        got = "an empty list" if isinstance(value, list | tuple) else type(value).__name__
        raise ConversationError(column, "expected a non-empty list of assistant and tool turns, "
                                        f"got {got}")
    turns = []
    for index, turn in enumerate(value):
        expected = TURN_ROLES[index % 2]
        if not isinstance(turn, dict):
            raise ConversationError(column, f"turn {index} is a {type(turn).__name__}, not an "
                                            "object with 'role' and 'content'")
        role, content = turn.get("role"), turn.get("content")
        if role not in TURN_ROLES:
            raise ConversationError(column, f"turn {index} has role {role!r}; use one of "
                                            f"{TURN_ROLES}")
        if role != expected:
            raise ConversationError(column, f"turn {index} is {role!r} where {expected!r} is "
                                            "due: turns alternate, assistant first")
        if not isinstance(content, str):
            raise ConversationError(column, f"turn {index}'s content is "
                                            f"{type(content).__name__}, not a string")
        turns.append({"role": role, "content": content})
    if turns[-1]["role"] != "assistant":
        raise ConversationError(column, f"the last turn ({len(turns) - 1}) is a tool's answer; "
                                        "a trajectory ends with the assistant's reply")
    return tuple(turns)


def _answer(value: Any, column: str) -> tuple[Conversation, str]:
    """(prompt turns, answer) of a conversation that ends with the assistant's answer."""
    turns = _turns(value, column)
    if turns[-1]["role"] != "assistant":
        raise ConversationError(column, f"the last turn is {turns[-1]['role']!r}, not the "
                                        "assistant's answer")
    return turns[:-1], turns[-1]["content"]


def split_conversation(row: dict[str, Any],
                       columns: dict[str, str]) -> tuple[Conversation, dict[str, str | None]]:
    """The prompt turns and the text of ``response``/``chosen``/``rejected`` of one record.

    Args:
        row: the record.
        columns: logical field -> column name (``prompt``, ``response``, ``chosen``,
            ``rejected``, ``messages``).

    Raises:
        ConversationError: malformed turns, a missing answer, or prompts that differ.
    """
    prompt: Conversation | None = None
    texts: dict[str, str | None] = {"response": None, "chosen": None, "rejected": None}
    if columns["messages"] in row and row[columns["messages"]] is not None:
        turns = _turns(row[columns["messages"]], columns["messages"])
        if turns[-1]["role"] == "assistant":
            prompt, texts["response"] = turns[:-1], turns[-1]["content"]
        else:
            prompt = turns
    for name in ("chosen", "rejected"):
        value = row.get(columns[name])
        if not isinstance(value, list):
            texts[name] = value if isinstance(value, str) else None
            continue
        before, texts[name] = _answer(value, columns[name])
        if prompt is None or not prompt:
            prompt = before
        elif before and before != prompt:
            raise ConversationError(columns[name], f"{name} continues another conversation "
                                                   "than the record's prompt")
    if not prompt:
        text = row.get(columns["prompt"])
        if not isinstance(text, str) or not text.strip():
            raise ConversationError(columns["messages"], "no prompt turns and no plain-text "
                                                         f"{columns['prompt']!r}")
        prompt = ({"role": "user", "content": text},)
    if texts["response"] is None and isinstance(row.get(columns["response"]), str):
        texts["response"] = row[columns["response"]]
    return prompt, texts
