"""Log-probabilities and entropy of given tokens from vocabulary-parallel logits.

Under tensor parallelism each rank holds the logits of its slice of the (padded) vocabulary. As in
megatron's ``vocab_parallel_cross_entropy``, the softmax normaliser and the target logit are
reduced across the TP group instead of gathering the whole vocabulary; the reductions are
megatron's ``reduce_from_tensor_model_parallel_region`` (all-reduce forward, identity backward), so
gradients are exact. Padded vocabulary columns are excluded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region


def _tp_sum(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    if group.size() == 1:
        return x
    return reduce_from_tensor_model_parallel_region(x, group=group)


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    targets: torch.Tensor,
    tp_group: dist.ProcessGroup,
    real_vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``targets`` (and the entropy) under ``softmax(logits / temperature)``.

    Args:
        logits: ``[..., v_local]`` this rank's vocabulary shard (rank r holds columns
            ``[r * v_local, (r + 1) * v_local)`` of the padded vocabulary).
        targets: ``[...]`` token ids in the real vocabulary.
        tp_group: the model's tensor-parallel group.
        real_vocab_size: columns at or past it are ignored: the model's ``token_vocab_size``
            (its unpadded vocabulary, cut to the tokenizer's ids when the embedding has more).
        temperature: sampling temperature the log-probs refer to.
        with_entropy: also return the entropy of the distribution.

    Returns:
        ``(logprobs, entropy)``, each ``[...]`` float32; entropy is None unless requested.
    """
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    v_local = logits.shape[-1]
    start = tp_group.rank() * v_local
    column_ids = torch.arange(start, start + v_local, device=logits.device)
    real_columns = column_ids < real_vocab_size
    logits = logits.masked_fill(~real_columns, float("-inf"))

    with torch.no_grad():
        logits_max = logits.max(dim=-1).values
        if tp_group.size() > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - logits_max.unsqueeze(-1)
    exp_shifted = torch.exp(shifted)
    sum_exp = _tp_sum(exp_shifted.sum(dim=-1), tp_group)

    local_target = targets - start
    in_shard = (local_target >= 0) & (local_target < v_local)
    gathered = torch.gather(shifted, -1, local_target.clamp(0, v_local - 1).unsqueeze(-1))
    target_logit = _tp_sum(gathered.squeeze(-1).masked_fill(~in_shard, 0.0), tp_group)
    log_sum_exp = torch.log(sum_exp)
    logprobs = target_logit - log_sum_exp

    entropy = None
    if with_entropy:
        weighted = (exp_shifted * shifted.masked_fill(~real_columns, 0.0)).sum(dim=-1)
        entropy = log_sum_exp - _tp_sum(weighted, tp_group) / sum_exp
    return logprobs, entropy


def next_token_nll(logits: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
                   tp_group: dist.ProcessGroup, real_vocab_size: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed negative log-likelihood of the tokens ``loss_mask`` marks, and their count.

    Args:
        logits: ``[b, s, v_local]`` this rank's vocabulary shard; position ``t - 1`` predicts
            the token at ``t``.
        input_ids: ``[b, s]`` the sequences.
        loss_mask: ``[b, s]`` 1 on the tokens to predict, aligned with ``input_ids``.

    Returns:
        ``(nll_sum, tokens)``: a 0-dim float tensor and a 0-dim int tensor.
    """
    logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], input_ids[:, 1:], tp_group,
                                          real_vocab_size)
    mask = loss_mask[:, 1:]
    return -(logprobs * mask).sum(), mask.sum().int()
