"""The message a tool's answer is read in: a chat template's own tool turn when the template
renders one (Qwen style), the plain-text ``<tool_response>`` message otherwise (a template that
refuses a ``tool`` role, as the Llama-3-style test template does, or no template)."""

from __future__ import annotations

from pathlib import Path

from megatron_rlhf.models.prompting import chat_tool_message, plain_tool_message
from tools.make_tiny_hf import make_hf_tokenizer


def test_a_template_that_renders_tool_turns_gives_its_own_message(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer

    make_hf_tokenizer(tmp_path, "qwen")
    tokenizer = HFTokenizer.load(tmp_path)
    message = chat_tool_message(tokenizer.render_chat)
    assert message is not None
    assert message("5535") == ("<|im_end|>\n<|im_start|>tool\n5535<|im_end|>\n"
                               "<|im_start|>assistant\n")
    # the reply, its tool turn and the next reply read as the template renders the conversation
    reply = '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>'
    rendered = tokenizer.render_chat([{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": reply},
                                      {"role": "tool", "content": "5535"}], True)
    assert rendered.endswith(reply + message("5535"))


def test_a_template_without_tool_turns_falls_back_to_plain_text(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer

    make_hf_tokenizer(tmp_path, "llama3")
    assert chat_tool_message(HFTokenizer.load(tmp_path).render_chat) is None
    assert plain_tool_message("7") == "\n<tool_response>\n7\n</tool_response>\n"


def test_a_run_reads_the_template_tool_turn_only_with_chat_template_on(tmp_path: Path) -> None:
    """``tool_message_for`` picks what a run (episodes, SFT) encodes a tool's answer as."""
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer
    from megatron_rlhf.models.prompting import tool_message_for

    for style in ("qwen", "llama3"):
        make_hf_tokenizer(tmp_path / style, style)
    qwen, llama3 = (HFTokenizer.load(tmp_path / style) for style in ("qwen", "llama3"))
    assert tool_message_for(qwen, True)("5") == chat_tool_message(qwen.render_chat)("5")
    assert tool_message_for(qwen, False) is plain_tool_message
    assert tool_message_for(llama3, True) is plain_tool_message
