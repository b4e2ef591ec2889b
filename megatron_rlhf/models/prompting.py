"""Prompt text or conversation -> prompt ids, through the tokenizer's chat template when it has one.

    ids = encode_prompt(tokenizer, "Name a colour.", None, use_chat_template=True)
    ids = encode_prompt(tokenizer, "", [{"role": "user", "content": "Hi"}], True)
"""

from __future__ import annotations

from collections.abc import Sequence
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
