"""Gradient reduction settings a large run turns on change no gradient: megatron DDP's
``overlap_grad_reduce`` (bucket reductions during the backward pass) gives the same reduced
gradients as reducing after it, with plain DDP and with the distributed optimizer; and
``grad_reduce_dtype=bfloat16`` keeps the gradient buffers in bf16 with sums close to fp32's.
2 gloo ranks, DP=2, packed sequences of varied lengths so the ranks' token counts differ."""

from __future__ import annotations

import pytest
import torch

from tests.model_fixtures import TinyArch, whole_world_groups
from tests.multirank import run_on_ranks


def _grads(dtype: str, overlap: bool, distributed: bool, reduce_dtype: str = "float32"):
    import torch.distributed as dist

    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.logprobs import next_token_nll
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import init_weights

    pgc = whole_world_groups(1, 1)
    model = build_gpt_model(TinyArch(), ModelBuildOptions(params_dtype=dtype), pgc)
    init_weights(model, pgc, seed=3)
    settings = OptimizerSettings(lr=1e-4, overlap_grad_reduce=overlap,
                                 distributed_optimizer=distributed,
                                 grad_reduce_dtype=reduce_dtype)
    trainer = ModelTrainer(model, pgc, settings)
    generator = torch.Generator().manual_seed(dist.get_rank())
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 250, (2, 12), generator=generator)
        mask = torch.ones(2, 12, dtype=torch.long)
        mask[0, :int(torch.randint(0, 6, (1,), generator=generator))] = 0
        batches.append({"input_ids": ids, "attention_mask": mask, "loss_mask": mask})

    def loss_fn(output, batch):
        nll, tokens = next_token_nll(output, batch["input_ids"], batch["loss_mask"], pgc.tp, 250)
        return nll, tokens, {}

    result = trainer.train_step(batches, loss_fn)
    grads = {name: param.main_grad.detach().float().clone()
             for name, param in trainer.module.named_parameters()}
    dtypes = {param.main_grad.dtype for param in trainer.module.parameters()}
    return result["grad_norm"], grads, dtypes


def _compare() -> dict:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    for distributed in (False, True):
        norm, reference, _ = _grads("float32", overlap=False, distributed=distributed)
        overlap_norm, overlapped, _ = _grads("float32", overlap=True, distributed=distributed)
        assert overlap_norm == pytest.approx(norm, rel=1e-6), distributed
        for name, grad in reference.items():
            torch.testing.assert_close(overlapped[name], grad, rtol=1e-6, atol=1e-8,
                                       msg=lambda m, n=name: f"{n}: {m}")
    fp32_norm, fp32_grads, fp32_dtypes = _grads("bfloat16", overlap=True, distributed=True)
    bf16_norm, bf16_grads, bf16_dtypes = _grads("bfloat16", overlap=True, distributed=True,
                                                reduce_dtype="bfloat16")
    assert (fp32_dtypes, bf16_dtypes) == ({torch.float32}, {torch.bfloat16})
    assert bf16_norm == pytest.approx(fp32_norm, rel=2e-2)
    return {"norm": fp32_norm}


@pytest.mark.multirank
@pytest.mark.timeout(210)
def test_overlapped_and_bf16_gradient_reduction() -> None:
    results = run_on_ranks(_compare, world_size=2, timeout_s=180)
    assert results[0] == results[1]
    with pytest.raises(ValueError, match="grad_reduce_dtype='fp16'"):
        from megatron_rlhf.models.trainer import OptimizerSettings

        OptimizerSettings(grad_reduce_dtype="fp16")
