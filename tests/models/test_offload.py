"""Offloading a model's state between stages is exact: bit-identical weights, gradient buffers and
optimizer state after the round trip, and training that does not notice it."""

from __future__ import annotations

import pytest
import torch

from tests.model_fixtures import TinyArch, whole_world_groups
from tests.multirank import run_on_ranks


def _batches(step: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(7 + step)
    ids = torch.randint(0, 250, (4, 10), generator=generator)
    mask = torch.ones_like(ids)
    return [{"input_ids": ids[i:i + 2], "attention_mask": mask[i:i + 2]} for i in (0, 2)]


def _trainer(params_dtype: str, distributed_optimizer: bool):
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import init_weights

    pgc = whole_world_groups(1, 1)
    model = build_gpt_model(TinyArch(), ModelBuildOptions(params_dtype=params_dtype), pgc)
    init_weights(model, pgc, seed=3)
    return ModelTrainer(model, pgc, OptimizerSettings(
        lr=1e-2, distributed_optimizer=distributed_optimizer)), pgc


def _loss_fn(pgc):
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs

    def loss_fn(logits, batch):
        logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], batch["input_ids"][:, 1:], pgc.tp,
                                              TinyArch().vocab_size)
        tokens = torch.tensor(logprobs.numel(), dtype=torch.int)
        return -logprobs.float().sum(), tokens, {}
    return loss_fn


def _snapshot(trainer) -> dict[str, torch.Tensor]:
    state = {f"param/{n}": p.detach().clone() for n, p in trainer.model.named_parameters()}
    for i, buffer in enumerate(trainer.module.buffers):
        state[f"grad_buffer/{i}"] = buffer.grad_data.clone()
        if buffer.param_data is not None:
            state[f"param_buffer/{i}"] = buffer.param_data.clone()
    for k, inner in enumerate(getattr(trainer.optimizer, "chained_optimizers",
                                      [trainer.optimizer])):
        for g, group in enumerate(inner.optimizer.param_groups):
            for j, param in enumerate(group["params"]):
                state[f"main/{k}/{g}/{j}"] = param.detach().clone()
                for name, value in inner.optimizer.state[param].items():
                    state[f"adam/{k}/{g}/{j}/{name}"] = value.clone()
    return state


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _round_trip(params_dtype: str, distributed_optimizer: bool) -> None:
    from megatron_rlhf.models.offload import GRADS, OPTIMIZER, PARTS, WEIGHTS, StateOffloader
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    plain, pgc = _trainer(params_dtype, distributed_optimizer)
    offloaded, _ = _trainer(params_dtype, distributed_optimizer)
    offloader = StateOffloader(offloaded.model, offloaded)
    for step in range(3):
        expected = plain.train_step(_batches(step), _loss_fn(pgc))
        offloader.onload(*PARTS)
        got = offloaded.train_step(_batches(step), _loss_fn(pgc))
        assert got["grad_norm"] == expected["grad_norm"]
        before = _snapshot(offloaded)
        _assert_bitwise_equal(before, _snapshot(plain))
        resident = offloader.resident_bytes()
        assert resident > 0
        offloader.offload(*PARTS)
        assert offloader.resident_bytes() == 0
        assert all(p.untyped_storage().nbytes() == 0 for p in offloaded.model.parameters())
        offloader.onload(WEIGHTS)  # generation needs only the weights
        assert offloader.is_offloaded(GRADS) and offloader.is_offloaded(OPTIMIZER)
        assert 0 < offloader.resident_bytes() < resident
        offloader.onload(GRADS, OPTIMIZER)
        assert offloader.resident_bytes() == resident
        _assert_bitwise_equal(_snapshot(offloaded), before)
        offloader.offload(*PARTS)  # the next step starts offloaded


@pytest.mark.multirank
@pytest.mark.parametrize(("params_dtype", "distributed_optimizer"),
                         [("float32", False), ("bfloat16", True)])
def test_offload_round_trip_is_exact_and_training_does_not_notice(
        params_dtype: str, distributed_optimizer: bool) -> None:
    run_on_ranks(_round_trip, world_size=2, args=(params_dtype, distributed_optimizer),
                 timeout_s=200)


def test_unknown_parts_are_refused() -> None:
    from megatron_rlhf.models.offload import StateOffloader

    offloader = StateOffloader(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"unknown state parts \['activations'\]"):
        offloader.offload("activations")
    linear = offloader.model
    weight = linear.weight.detach().clone()
    offloader.offload("weights")
    assert linear.weight.untyped_storage().nbytes() == 0
    offloader.onload("weights")
    assert torch.equal(linear.weight, weight)
