"""Supervised fine-tuning of the actor on (prompt, response) pairs.

    result = run_sft(load_config(SFTConfig, "examples/sft_tiny.yaml"))

The loss is the negative log-likelihood of the response tokens and their EOS only (the prompt is
context), summed with the token count as its normaliser: the trainer divides by the step's global
token count, so it is a token mean that does not depend on the DP size or micro-batch split. The
result is an ``lm``-head checkpoint for the ``actor`` role. ``model.init_checkpoint`` (e.g. a
converted Hugging Face model) is loaded whole. See :mod:`supervised.loop` for the loop and data.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_rlhf.config.supervised_run import SFTConfig
from megatron_rlhf.data import SFTDataset, SFTExample, collate_sft
from megatron_rlhf.models.checkpoint import load_model_checkpoint
from megatron_rlhf.models.forward_backward import Batch, LossFn, split_microbatches
from megatron_rlhf.models.hf_tokenizer import HFTokenizer
from megatron_rlhf.models.logprobs import next_token_nll
from megatron_rlhf.models.tokenizer import Tokenizer
from megatron_rlhf.runtime.metric_reduce import Mean
from megatron_rlhf.supervised.loop import (
    Objective,
    TrainingResult,
    run_supervised,
)
from megatron_rlhf.topology.models import ACTOR


def sft_microbatches(examples: Sequence[SFTExample], tokenizer: Tokenizer | HFTokenizer,
                     max_length: int, micro_batch_size: int,
                     use_chat_template: bool = True) -> list[Batch]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``loss_mask`` micro-batches."""
    batch = collate_sft(examples, tokenizer, max_length, use_chat_template)
    return split_microbatches({"input_ids": batch.input_ids,
                               "attention_mask": batch.attention_mask,
                               "loss_mask": batch.loss_mask}, micro_batch_size)


def sft_loss(tp_group: dist.ProcessGroup, real_vocab_size: int) -> LossFn:
    """Summed response-token NLL with its token count, from vocabulary-parallel logits.

    The loss function maps logits ``[b, s, v_local]`` and a batch to ``(nll_sum, tokens,
    {"loss": Mean(nll_sum, tokens)})``; position ``t - 1`` predicts the token at ``t``.
    """

    def loss_fn(logits: torch.Tensor, batch: Batch) -> tuple:
        nll_sum, tokens = next_token_nll(logits, batch["input_ids"], batch["loss_mask"],
                                         tp_group, real_vocab_size)
        return nll_sum, tokens, {"loss": Mean(nll_sum, tokens)}

    return loss_fn


SFT_OBJECTIVE = Objective(name="sft", role=ACTOR, head="lm", portion="sft",
                          make_examples=SFTDataset, microbatches=sft_microbatches,
                          loss_fn=sft_loss, metrics={"loss": Mean},
                          load_checkpoint=load_model_checkpoint)


def run_sft(config: SFTConfig) -> TrainingResult:
    """Fine-tune the actor as configured; every rank calls it (see :func:`run_supervised`)."""
    return run_supervised(config, SFT_OBJECTIVE)
