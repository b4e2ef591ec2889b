"""Pairwise (Bradley-Terry) training of the scalar-head reward model on preference triples.

    result = run_reward_training(load_config(RMConfig, "examples/rm_tiny.yaml"))

A sequence's score is the scalar head at its last real token, as the PPO reward stage reads it.
For a pair the loss is ``-log sigmoid(r_chosen - r_rejected)``, summed over pairs with the pair
count as its normaliser, so the update is the pair mean whatever the DP size; accuracy is the
share of pairs with ``r_chosen > r_rejected``. ``model.init_checkpoint`` may name an SFT
checkpoint: its trunk is loaded and the scalar head starts fresh. See :mod:`supervised.loop`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection

from megatron_rlhf.config.supervised_run import RMConfig
from megatron_rlhf.data import RMDataset, RMExample, collate_preferences
from megatron_rlhf.models.checkpoint import (
    load_model_checkpoint,
)
from megatron_rlhf.models.forward_backward import Batch, LossFn, split_microbatches
from megatron_rlhf.models.gpt import last_token_scores
from megatron_rlhf.models.hf_tokenizer import HFTokenizer
from megatron_rlhf.models.tokenizer import Tokenizer
from megatron_rlhf.runtime.logging import get_logger
from megatron_rlhf.runtime.metric_reduce import Mean
from megatron_rlhf.supervised.loop import (
    Objective,
    TrainingResult,
    run_supervised,
)
from megatron_rlhf.topology.models import REWARD

logger = get_logger(__name__)

_CHECKPOINT_MODEL_KEY = "model"
"""Top-level key under which ``models/checkpoint.py`` stores a model's tensors."""
_MAY_DIFFER = ("head", "seq_length", "params_dtype")
"""Description fields in which an SFT checkpoint may differ from the reward model it starts."""


def preference_microbatches(examples: Sequence[RMExample], tokenizer: Tokenizer | HFTokenizer,
                            max_length: int, micro_batch_size: int,
                            use_chat_template: bool = True) -> list[Batch]:
    """Micro-batches of ``micro_batch_size`` pairs: rows ``[chosen_0..m-1; rejected_0..m-1]``."""
    batch = collate_preferences(examples, tokenizer, max_length, use_chat_template)
    chosen, rejected = (
        split_microbatches({"input_ids": side.input_ids, "attention_mask": side.attention_mask},
                           micro_batch_size)
        for side in (batch.chosen, batch.rejected))
    return [{key: torch.cat([c[key], r[key]]) for key in c}
            for c, r in zip(chosen, rejected, strict=True)]


def pairwise_loss(tp_group: dist.ProcessGroup, real_vocab_size: int) -> LossFn:
    """Bradley-Terry loss over the pairs of a :func:`preference_microbatches` micro-batch.

    The loss function maps the scalar-head output ``[2m, s, 1]`` and the batch to
    ``(loss_sum, pairs, {"loss", "accuracy", "margin"})``, each a ``Mean`` over the pairs. The
    scalar head is replicated over TP and has no vocabulary, so both arguments are unused.
    """

    def loss_fn(output: torch.Tensor, batch: Batch) -> tuple:
        scores = last_token_scores(output[..., 0].float(), batch["attention_mask"])
        chosen, rejected = scores.chunk(2)
        margin = chosen - rejected
        loss_sum = F.softplus(-margin).sum()
        pairs = torch.tensor(margin.shape[0], dtype=torch.int, device=margin.device)
        return loss_sum, pairs, {"loss": Mean(loss_sum, pairs),
                                 "accuracy": Mean((margin > 0).sum(), pairs),
                                 "margin": Mean(margin.detach().sum(), pairs)}

    return loss_fn


def load_trunk(model: torch.nn.Module, pg_collection: ProcessGroupCollection,
               directory: str) -> None:
    """Load a checkpoint into the reward model: whole if it has a scalar head, else its trunk.

    An SFT (``lm``-head) checkpoint gives every weight but the output layer, which keeps its
    initialisation. Collective over the default group; any saved TP/PP loads.
    """
    info = load_model_checkpoint(model, pg_collection, directory, new_head=True)
    if info.model.head != model.head_kind:
        logger.info("loaded the trunk of %s (%r head); the %r head is new", directory,
                    info.model.head, model.head_kind)


RM_OBJECTIVE = Objective(name="rm", role=REWARD, head="scalar", portion="rm",
                         make_examples=RMDataset, microbatches=preference_microbatches,
                         loss_fn=pairwise_loss,
                         metrics={"loss": Mean, "accuracy": Mean, "margin": Mean},
                         load_checkpoint=load_trunk)


def run_reward_training(config: RMConfig) -> TrainingResult:
    """Train the reward model as configured; every rank calls it (see :func:`run_supervised`)."""
    return run_supervised(config, RM_OBJECTIVE)
