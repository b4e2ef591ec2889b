"""Forward and backward passes of one model through megatron's pipeline schedules.

Every pass that touches a model (a training step, the log-probs of the experience stage) goes
through :func:`run_microbatches`, which hands megatron's ``get_forward_backward_func()`` the model's
own process groups. With PP=1 that is the no-pipelining loop, with PP>1 the 1F1B schedule.

A model built with ``packed_sequences`` runs each micro-batch packed (``models.packing``): the
loss function still receives the padded ``[b, s, ...]`` output, so it is the same either way.

A mixture-of-experts model with routing replay (``models.moe.routes_of_batch``) records each
micro-batch's routes into its ``moe_routes`` field for the loss function to read, or, when the
micro-batch brings that field, routes its tokens as recorded.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from itertools import pairwise
from typing import Any

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.utils import get_model_config

from megatron_rlhf.models.moe import routes_of_batch
from megatron_rlhf.models.packing import PackedRows, host_masks, pack_rows, packed_length
from megatron_rlhf.runtime.metric_reduce import METRIC_TYPES, detached

Batch = dict[str, torch.Tensor]
# (output, batch) -> (loss, metrics), or (loss_sum, num_tokens, metrics) when the model's config
# has calculate_per_token_loss=True (megatron then divides gradients by the global token count).
LossFn = Callable[[torch.Tensor, Batch], tuple]


def causal_padding_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """megatron's boolean attention mask (True = masked) from a ``[b, s]`` validity mask.

    A query attends to earlier real tokens only; padding (left or right) is never attended.
    Rotary embeddings are shift-invariant, so left padding does not change real tokens' outputs.

    Returns:
        ``[b, 1, s, s]`` bool.
    """
    seq = attention_mask.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=attention_mask.device).triu(1)
    key_is_pad = ~attention_mask.bool()[:, None, None, :]
    return causal[None, None] | key_is_pad


def model_inputs(batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids, position_ids, attention_mask)`` for a GPTModel call on ``batch``."""
    input_ids = batch["input_ids"]
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return input_ids, positions, causal_padding_mask(batch["attention_mask"])


def _loss_with_safe_metrics(loss_fn: LossFn, output: torch.Tensor, batch: Batch,
                            packed: PackedRows | None = None):
    if packed is not None:
        output = packed.unpack(output)
    *losses, metrics = loss_fn(output, batch)
    # megatron scales the returned loss *in place*; metrics that alias it would silently change.
    return *losses, {k: v.detach().clone() if isinstance(v, torch.Tensor)
                     else detached(v) if isinstance(v, METRIC_TYPES) else v
                     for k, v in metrics.items()}


def _forward_step(loss_fn: LossFn, length: int | None, data_iterator, model):
    if length is None:
        batch = next(data_iterator)
        with routes_of_batch(model, batch, None, 0):
            output = model(*model_inputs(batch))
        return output, partial(_loss_with_safe_metrics, loss_fn, batch=batch)
    batch, host_mask = next(data_iterator)
    packed = pack_rows(batch["input_ids"], host_mask, length)
    with routes_of_batch(model, batch, packed.index, length):
        output = model(packed.input_ids, packed.position_ids, None,
                       packed_seq_params=packed.params)
    return output, partial(_loss_with_safe_metrics, loss_fn, batch=batch, packed=packed)


def packs_sequences(model: torch.nn.Module) -> bool:
    """Whether ``model`` (or the GPTModel inside its wrappers) was built to pack sequences."""
    while not hasattr(model, "packed_sequences") and hasattr(model, "module"):
        model = model.module
    return bool(getattr(model, "packed_sequences", False))


def run_microbatches(
    model: torch.nn.Module,
    pg_collection: ProcessGroupCollection,
    microbatches: list[Batch],
    loss_fn: LossFn,
    forward_only: bool,
) -> list[dict[str, Any]]:
    """Run ``microbatches`` through ``model`` with megatron's schedule for its PP size.

    Every rank of the model passes the same micro-batches (non-first pipeline stages ignore the
    token ids and take activations from the previous stage; the last stage evaluates ``loss_fn``).

    Args:
        model: this rank's stage of the model (a GPTModel or megatron DDP wrapper).
        pg_collection: the model's process groups.
        microbatches: each with ``input_ids`` and ``attention_mask`` ``[b, s]`` and whatever
            ``loss_fn`` reads; of one shape unless the model packs sequences.
        loss_fn: ``(output, batch) -> (loss, metrics)``, megatron scaling the loss by
            ``1 / len(microbatches)`` before the backward pass; or, for models built with
            ``calculate_per_token_loss``, ``(loss_sum, num_tokens, metrics)``.
        forward_only: skip the backward pass.

    Returns:
        The ``metrics`` dict of every micro-batch on the last pipeline stage; ``[]`` elsewhere.
    """
    if not microbatches:
        raise ValueError("run_microbatches needs at least one micro-batch")
    pp_size = pg_collection.pp.size()
    config = get_model_config(model)
    length, data = None, iter(microbatches)
    if packs_sequences(model):
        multiple = pg_collection.tp.size() if config.sequence_parallel else 1
        # the packing layout comes from host copies of the masks: one transfer for the call
        masks = host_masks([mb["attention_mask"] for mb in microbatches])
        length = packed_length(masks, multiple)
        seq_length, micro_batch_size = length, 1
        data = zip(microbatches, masks, strict=True)
    else:
        shapes = {tuple(mb["input_ids"].shape) for mb in microbatches}
        if len(shapes) > 1:
            # Pipeline stages exchange activations of one fixed shape per call.
            raise ValueError(f"micro-batches of one call must share a shape, got {sorted(shapes)}")
        seq_length, micro_batch_size = microbatches[0]["input_ids"].shape[::-1]
    schedule = get_forward_backward_func(pp_size=pp_size, vp_size=None)
    kwargs: dict[str, Any] = {}
    if pp_size > 1:
        kwargs["p2p_communicator"] = P2PCommunicator(pp_group=pg_collection.pp, config=config)
    results = schedule(
        forward_step_func=partial(_forward_step, loss_fn, length),
        data_iterator=data,
        model=[model],
        num_microbatches=len(microbatches),
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
        pg_collection=pg_collection,
        **kwargs,
    )
    return list(results) if results else []


def split_microbatches(fields: Batch, micro_batch_size: int) -> list[Batch]:
    """Consecutive micro-batches of at most ``micro_batch_size`` rows (the last may be smaller
    only if the rows do not divide; callers keep them divisible so shapes match)."""
    rows = next(iter(fields.values())).shape[0]
    return [{k: v[i:i + micro_batch_size] for k, v in fields.items()}
            for i in range(0, rows, micro_batch_size)]


def token_budget_microbatches(fields: Batch, max_tokens: int) -> list[Batch]:
    """Consecutive rows grouped into micro-batches of at most ``max_tokens`` real tokens
    (``attention_mask``); a row longer than the budget forms its own. Row order is kept, so
    results concatenate back in order."""
    tokens = fields["attention_mask"].sum(dim=1).tolist()
    bounds, total = [0], 0
    for row, count in enumerate(tokens):
        if total and total + count > max_tokens:
            bounds.append(row)
            total = 0
        total += count
    bounds.append(len(tokens))
    return [{k: v[a:b] for k, v in fields.items()} for a, b in pairwise(bounds)]


def split_into_microbatches(fields: Batch, max_tokens: int, count: int) -> list[Batch]:
    """:func:`token_budget_microbatches`, then the micro-batch with the most real tokens split
    at its token midpoint until there are ``count`` (at most the rows): the same number on every
    rank of a group whose passes run a collective per micro-batch (Megatron-FSDP's gathers)."""
    tokens = fields["attention_mask"].sum(dim=1).tolist()
    if count > len(tokens):
        raise ValueError(f"{count} micro-batches asked of {len(tokens)} rows")
    bounds = [0]
    for part in token_budget_microbatches({"attention_mask": fields["attention_mask"]},
                                          max_tokens):
        bounds.append(bounds[-1] + part["attention_mask"].shape[0])
    while len(bounds) - 1 < count:
        splittable = [i for i in range(len(bounds) - 1) if bounds[i + 1] - bounds[i] > 1]
        i = max(splittable, key=lambda j: sum(tokens[bounds[j]:bounds[j + 1]]))
        a, b = bounds[i], bounds[i + 1]
        half, run, cut = sum(tokens[a:b]) / 2, 0, a + 1
        for row in range(a, b - 1):
            run += tokens[row]
            cut = row + 1
            if run >= half:
                break
        bounds.insert(i + 1, cut)
    return [{k: v[a:b] for k, v in fields.items()} for a, b in pairwise(bounds)]

