"""What a run reads before it builds anything: its PPO prompts, held-out prompts and PPO-ptx
demonstrations, tokenised and checked against ``rollout.max_prompt_length`` (over-long prompts are
refused with the settings that would keep or drop them)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.data import (
    DataConfig,
    SFTExample,
    generate_records,
    load_splits,
    read_files,
)
from megatron_rlhf.data.datasets import sft_example
from megatron_rlhf.data.demonstrations import DemonstrationStream
from megatron_rlhf.data.prompts import PromptStream
from megatron_rlhf.data.readers import prompt_tokens
from megatron_rlhf.models.hf_tokenizer import HFTokenizer
from megatron_rlhf.models.prompting import encode_prompt
from megatron_rlhf.models.tokenizer import Tokenizer
from megatron_rlhf.runtime.logging import get_logger

logger = get_logger(__name__)


def load_prompts(config: RunConfig, tokenizer: Tokenizer | HFTokenizer) -> PromptStream:
    """Tokenised PPO prompts from the configured files, or the synthetic task."""
    origin = ""
    if config.prompts.paths:
        data = DataConfig(list(config.prompts.paths), config.prompts.reader, config.prompts.split)
        splits, summaries = load_splits(data, tokenizer)
        for summary in summaries:
            logger.info("%s", summary.format())
        records = [(record.prompt, record.messages) for record in splits.ppo]
        rows = [record.row or {} for record in splits.ppo]
        origin = _split_origin(splits.sizes(), config.prompts.split.ppo)
    else:
        rows = generate_records(config.prompts.synthetic)
        records = [(record["prompt"], None) for record in rows]
    prompts = _encode(records, config, tokenizer, "prompts", bool(config.prompts.paths))
    return PromptStream(prompts, config.rollout.prompts_per_step, config.runtime.seed, rows,
                        origin)


def _split_origin(sizes: dict[str, int], ppo_share: float) -> str:
    """Which share of the files PPO reads, with the split's counts, for the prompt refusals."""
    if ppo_share >= 1:
        return "the good records of prompts.paths"
    counts = ", ".join(f"{name} {count}" for name, count in sizes.items())
    return (f"PPO uses only the ppo share of prompts.paths, prompts.split.ppo={ppo_share:g}: "
            f"{sizes['ppo']} of the {sum(sizes.values())} good records ({counts}); raise "
            "prompts.split.ppo to use more of them")


def load_eval_set(config: RunConfig, tokenizer: Tokenizer | HFTokenizer
                  ) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Tokenised held-out prompts and their whole records (for the reward functions), or
    ``([], [])`` when the run has none."""
    evaluation = config.evaluation
    if not evaluation.num_prompts:
        return [], []
    if evaluation.paths:
        read, summaries = read_files(list(evaluation.paths), config.prompts.reader, tokenizer)
        if not read:
            raise ValueError("\n".join([
                f"evaluation.paths={list(evaluation.paths)} hold no usable prompt (read with "
                "prompts.reader); fix the files or set evaluation.num_prompts=0 to run without "
                "held-out evaluation", *(summary.format() for summary in summaries)]))
        records = [(record.prompt, record.messages) for record in read]
        rows = [record.row or {} for record in read]
    elif not config.prompts.paths:
        rows = generate_records(config.prompts.synthetic, "test")
        records = [(record["prompt"], None) for record in rows]
    else:
        logger.info("no held-out evaluation: the prompts come from files and evaluation.paths "
                    "is empty")
        return [], []
    count = evaluation.num_prompts
    return (_encode(records[:count], config, tokenizer, "held-out prompts",
                    bool(evaluation.paths)), rows[:count])


def load_demonstrations(config: RunConfig, tokenizer: Tokenizer | HFTokenizer
                        ) -> DemonstrationStream | None:
    """PPO-ptx's supervised rows (``ptx``), or None when it is off."""
    if not config.ptx.enabled:
        return None
    if config.ptx.paths or config.prompts.paths:
        examples = _read_demonstrations(config, tokenizer)
    else:
        examples = [SFTExample(record["prompt"], record["response"])
                    for record in generate_records(config.prompts.synthetic)]
    length = config.rollout.max_prompt_length + config.generation.max_new_tokens
    return DemonstrationStream(examples, tokenizer, length, config.ptx_rows, config.runtime.seed,
                               config.prompts.chat_template)


def _read_demonstrations(config: RunConfig, tokenizer: Tokenizer | HFTokenizer
                         ) -> list[SFTExample]:
    """``ptx.paths`` whole, or else the ``sft`` portion of ``prompts.paths``."""
    reader = replace(config.prompts.reader, required=["prompt", "response"])
    if config.ptx.paths:
        source = f"ptx.paths={list(config.ptx.paths)}"
        records, summaries = read_files(list(config.ptx.paths), reader, tokenizer)
    else:
        source = f"the sft portion of prompts.paths={list(config.prompts.paths)}"
        splits, summaries = load_splits(
            DataConfig(list(config.prompts.paths), reader, config.prompts.split), tokenizer)
        records = splits.sft
    for summary in summaries:
        logger.info("ptx: %s", summary.format())
    if not records and not config.ptx.paths and not config.prompts.split.sft:
        raise ValueError(f"ptx.coef={config.ptx.coef} but the sft portion of prompts.paths is "
                         "empty (prompts.split.sft=0, the default: PPO reads every record): name "
                         "demonstrations in ptx.paths, or give the sft portion a share, e.g. "
                         "prompts.split.sft=0.4 prompts.split.ppo=0.6")
    if not records:
        raise ValueError(f"ptx.coef={config.ptx.coef} but {source} holds no (prompt, response) "
                         "record; name demonstrations in ptx.paths or set ptx.coef=0")
    return [sft_example(record) for record in records]


def _encode(records: list[tuple[str, list | None]], config: RunConfig,
            tokenizer: Tokenizer | HFTokenizer, what: str, from_files: bool) -> list[list[int]]:
    """Token ids of ``(text, messages)`` prompts, through the chat template where it applies.

    Raises:
        ValueError: a prompt longer than ``rollout.max_prompt_length``; the message gives the
            exact values that fix it (``from_files``: the records were read with
            ``prompts.reader``, whose limit can drop them).
    """
    limit = config.rollout.max_prompt_length
    prompts = [encode_prompt(tokenizer, text, messages, config.prompts.chat_template)
               for text, messages in records]
    too_long = [i for i, p in enumerate(prompts) if len(p) > limit]
    if too_long:
        raise ValueError(_too_long_message(records, prompts, too_long, limit, tokenizer, what,
                                           from_files))
    return prompts


def _too_long_message(records: list[tuple[str, list | None]], prompts: list[list[int]],
                      too_long: list[int], limit: int, tokenizer: Tokenizer | HFTokenizer,
                      what: str, from_files: bool) -> str:
    """The refusal of over-long prompts, with the settings that would accept or drop them.

    ``prompts.reader.max_prompt_tokens`` counts the prompt's own tokens (a conversation's through
    the chat template, as the rollout encodes it), the rollout limit also BOS and the chat
    template of a plain prompt; the reader's value is the limit less the largest such overhead,
    suggested only when it keeps some prompts.
    """
    first = too_long[0]
    message = (f"{len(too_long)} {what} are longer than rollout.max_prompt_length={limit} "
               f"tokens (first: #{first}, {len(prompts[first])} tokens with BOS and chat "
               f"template); set rollout.max_prompt_length={max(map(len, prompts))} to keep them")
    if not from_files:
        return message
    counted = [prompt_tokens(text, messages, tokenizer) for text, messages in records]
    overhead = max(len(ids) - count for ids, count in zip(prompts, counted, strict=True))
    reader_limit = limit - overhead
    kept = sum(count <= reader_limit for count in counted)
    if reader_limit < 1 or not kept:  # a limit that drops every prompt is no advice
        return message
    chat = any(messages is not None for _, messages in records)
    counts = (f"it counts a conversation through the chat template, its generation prompt "
              f"included; the rollout adds up to {overhead} more" if chat else
              f"it counts the prompt's text alone; BOS and the chat template add up to "
              f"{overhead}")
    return (f"{message}, or prompts.reader.max_prompt_tokens={reader_limit} to drop them "
            f"when reading, which keeps {kept} of {len(records)} ({counts})")
