"""A tiny GPTModel gives the same loss and gradients at TP1/PP1, TP2, PP2 (1F1B) and TP2xPP2.

All four layouts run inside one 4-rank gloo job; every layout sees the same two micro-batches
(left- and right-padded sequences), so the layouts differ only in how the model is split. The
reference is the padded forward at TP1/PP1; every layout runs packed sequences (the default),
so packing is checked under TP and across pipeline stages too, and so is sequence parallelism
(TP2 and TP2xPP2 with SP against the padded TP1 reference).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from tests.model_fixtures import TinyArch, whole_world_groups
from tests.multirank import run_on_ranks


def _microbatches() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(2):
        ids = torch.randint(0, 250, (3, 16), generator=generator)
        mask = torch.ones(3, 16, dtype=torch.long)
        mask[0, :5] = 0  # left padding (a prompt)
        mask[1, 12:] = 0  # right padding (a short response)
        batches.append({"input_ids": ids, "attention_mask": mask})
    return batches


def _layout_loss_and_grads(tp: int, pp: int, packed: bool = True, sp: bool = False
                           ) -> tuple[float, dict[str, torch.Tensor]]:
    from megatron_rlhf.models.forward_backward import run_microbatches
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs
    from megatron_rlhf.models.weights import gather_full_state, init_weights

    pgc = whole_world_groups(tp, pp)
    arch = TinyArch()
    model = build_gpt_model(arch, ModelBuildOptions(packed_sequences=packed, sequence_parallel=sp),
                            pgc)
    init_weights(model, pgc, seed=11)

    def loss_fn(logits, batch):
        logprobs, _ = vocab_parallel_logprobs(
            logits[:, :-1], batch["input_ids"][:, 1:], pgc.tp, arch.vocab_size)
        mask = batch["attention_mask"][:, 1:].float() * batch["attention_mask"][:, :-1].float()
        loss = -(logprobs * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    metrics = run_microbatches(model, pgc, _microbatches(), loss_fn, forward_only=False)
    if sp:  # what megatron's finalize_model_grads does under DDP: norms saw a sequence chunk
        for param in model.parameters():
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(param.grad, group=pgc.tp)
    loss = torch.tensor(sum(m["loss"].item() for m in metrics) / 2 if metrics else 0.0)
    # Only the last pipeline stage computes the loss; share it with the whole model.
    dist.all_reduce(loss, op=dist.ReduceOp.MAX if loss.item() >= 0 else dist.ReduceOp.MIN)
    return loss.item(), gather_full_state(model, pgc, use_grads=True)


def _compare_layouts() -> dict[str, float]:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    ref_loss, ref_grads = _layout_loss_and_grads(1, 1, packed=False)
    worst: dict[str, float] = {}
    for tp, pp, sp in [(1, 1, False), (2, 1, False), (1, 2, False), (2, 2, False),
                       (2, 1, True), (2, 2, True)]:
        loss, grads = _layout_loss_and_grads(tp, pp, sp=sp)
        assert abs(loss - ref_loss) < 1e-5, f"tp{tp} pp{pp}: loss {loss} != {ref_loss}"
        assert grads.keys() == ref_grads.keys(), f"tp{tp} pp{pp}: {grads.keys() ^ ref_grads.keys()}"
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, n=f"tp{tp} pp{pp} {name}": f"{n}: {m}")
        worst[f"tp{tp}pp{pp}" + ("sp" if sp else "")] = max((g - ref_grads[n]).abs().max().item()
                                     for n, g in grads.items())
    # A model at init spreads its probability nearly evenly over 250 tokens: loss near log(250).
    assert abs(ref_loss - math.log(250)) < 0.1, ref_loss
    assert all(g.abs().sum() > 0 for g in ref_grads.values())
    return worst


@pytest.mark.multirank
def test_loss_and_grads_match_across_tp_pp_layouts() -> None:
    results = run_on_ranks(_compare_layouts, world_size=4, timeout_s=240)
    assert all(r.keys() == {"tp1pp1", "tp2pp1", "tp1pp2", "tp2pp2", "tp2pp1sp", "tp2pp2sp"}
               for r in results)
