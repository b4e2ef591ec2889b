"""Prompt text or conversation -> prompt ids, through the tokenizer's chat template when it has one;
the message a tool's answer is read in.

    ids = encode_prompt(tokenizer, "Name a colour.", None, use_chat_template=True)
    ids = encode_prompt(tokenizer, "", [{"role": "user", "content": "Hi"}], True)
    observation = tokenizer.encode(tool_message_for(tokenizer, True)("5535"))

Multi-turn rollouts (``engine/execution/episodes.py``) and SFT on tool-calling demonstrations
(``data/collate.py``) both encode a tool's answer through :func:`tool_message_for`, so a
demonstration's row is the row an episode with the same replies and answers builds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from megatron_rlhf.models.hf_tokenizer import HFTokenizer
from megatron_rlhf.models.tokenizer import Tokenizer


def encode_prompt(tokenizer: Tokenizer | HFTokenizer, text: str,
                  messages: Sequence[dict[str, Any]] | None, use_chat_template: bool) -> list[int]:
    """The ids a policy is prompted with.

    Args:
        tokenizer: the run's tokenizer.
        text: a plain-text prompt (ignored when ``messages`` is given).
        messages: a conversation (``role``/``content`` turns) to continue, or None.
        use_chat_template: wrap a plain-text prompt as one user turn when the tokenizer has a
            chat template; otherwise it is encoded as is, after BOS.

    Raises:
        ValueError: a conversation with a tokenizer that has no chat template.
    """
    templated = isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template
    if messages is not None:
        if not templated:
            raise ValueError(f"conversation prompts need a tokenizer with a chat template; "
                             f"{tokenizer.source} has none (set tokenizer.hf_dir to a Hugging "
                             "Face checkpoint that ships one)")
        return tokenizer.encode_chat(messages, add_generation_prompt=True)
    if use_chat_template and templated:
        return tokenizer.encode_chat([{"role": "user", "content": text}],
                                     add_generation_prompt=True)
    return tokenizer.encode(text, add_bos=True)


ToolMessage = Callable[[str], str]
"""A tool's answer -> the text of the message the policy reads it in."""

TOOL_MESSAGE = "\n<tool_response>\n{answer}\n</tool_response>\n"
"""The plain-text tool message (Qwen2.5's ``tool_response`` tags) a tool's answer is read in
without a chat template."""

_REPLY = "\x00reply\x00"
"""Stands for the policy's reply when a chat template renders a tool turn after it."""


def plain_tool_message(answer: str) -> str:
    """:data:`TOOL_MESSAGE` around ``answer``."""
    return TOOL_MESSAGE.format(answer=answer)


def chat_tool_message(render_chat: Callable[[list[dict[str, str]], bool], str]
                      ) -> ToolMessage | None:
    """The chat template's own tool turn: what it renders after an assistant reply for a
    ``tool`` message, up to the next assistant turn's opening (the reply's end marker, the tool
    turn, the generation prompt); None when the template refuses a ``tool`` message.

    Args:
        render_chat: ``HFTokenizer.render_chat``.
    """
    def message(answer: str) -> str:
        conversation = [{"role": "user", "content": "?"},
                        {"role": "assistant", "content": _REPLY},
                        {"role": "tool", "content": answer}]
        text = render_chat(conversation, True)
        return text[text.index(_REPLY) + len(_REPLY):]

    try:
        message("")
    except ValueError:
        return None
    return message


def tool_message_for(tokenizer: Tokenizer | HFTokenizer, use_chat_template: bool) -> ToolMessage:
    """The tool message of a run: the chat template's own tool turn when the tokenizer has a
    template that renders one and ``use_chat_template`` (``prompts.chat_template``) is on,
    :func:`plain_tool_message` otherwise."""
    if isinstance(tokenizer, HFTokenizer) and tokenizer.has_chat_template and use_chat_template:
        message = chat_tool_message(tokenizer.render_chat)
        if message is not None:
            return message
    return plain_tool_message
