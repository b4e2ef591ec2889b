"""The token batches the trainer tests step on: the same global batch for every layout."""

from __future__ import annotations

import torch

GLOBAL_BATCH = 8


def global_batch(step: int) -> dict[str, torch.Tensor]:
    """``GLOBAL_BATCH`` rows of 12 tokens with 3-12 real ones, fixed by ``step``."""
    generator = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, 250, (GLOBAL_BATCH, 12), generator=generator)
    lengths = torch.randint(3, 13, (GLOBAL_BATCH,), generator=generator)
    mask = (torch.arange(12)[None] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask}


def nll_loss_fn(pgc, vocab: int):
    """A loss function for ``run_microbatches``/``train_step``: the summed next-token NLL of a
    batch's real tokens under TP-sharded logits over ``vocab`` real columns."""
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs

    def loss_fn(logits, batch):
        logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], batch["input_ids"][:, 1:], pgc.tp,
                                              vocab)
        mask = batch["attention_mask"][:, 1:].float()
        nll = -(logprobs * mask).sum()
        return nll, mask.sum().int(), {"nll_sum": nll.detach()}

    return loss_fn
