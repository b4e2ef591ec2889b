"""LoRA adapters (``models.lora``) against their base model and a dense reference.

On 2 gloo ranks, in three layouts (TP=1 with two DP replicas and the distributed optimizer; TP=2;
TP=2 with sequence parallelism), a model with adapters is checked four ways:

* with ``B = 0`` its log-probs equal the base model's to the bit, and with adapters switched off
  (``adapters_disabled``) they still do once ``B`` is not zero. The base model compared with has
  its weights frozen too: torch's ``matmul`` of megatron's ``[s, b, h]`` activations by a weight
  picks its kernel by whether the weight requires a gradient, so a trainable copy of the same
  weights computes a few 1e-7 away (at TP=2);
* its adapters' gradients equal the chain rule applied, in plain torch, to the weight gradients of
  a dense model holding the merged weights ``W + (alpha / r) B A`` (``dL/dB = s G A^T``,
  ``dL/dA = s B^T G``), which involves none of the adapters' TP communication;
* a training step changes the adapters and leaves every base weight unchanged to the bit, with
  an optimizer (and DDP gradient buffers) holding the adapters alone;
* after that step, its log-probs with adapters off still equal a separate base model's.

A mixture-of-experts model at EP=2 with adapters on its routed and shared experts meets the first
two checks too, and a checkpoint saved at TP=2 loads at TP=1 with its adapters, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.helpers.models import random_lora_b
from tests.model_fixtures import TinyArch, whole_world_groups
from tests.models.batches import GLOBAL_BATCH, global_batch, nll_loss_fn
from tests.multirank import run_on_ranks

GRAD_RTOL = 1e-4
"""Adapter gradients against the dense chain rule: the two models compute the same function with
the adapters' product rounded differently (fp32)."""
GRAD_ATOL = 1e-7


def _config(**overrides):
    from megatron_rlhf.models.lora import LoRAConfig

    return LoRAConfig(**{"rank": 4, "alpha": 8.0, **overrides})


def test_config_validation_names_the_field():
    from megatron_rlhf.models.lora import LoRAConfig
    from megatron_rlhf.models.options import adapter_numel

    with pytest.raises(ValueError, match=r"models\.lora\.rank=-1"):
        LoRAConfig(rank=-1)
    with pytest.raises(ValueError, match=r"models\.lora\.alpha=0"):
        LoRAConfig(rank=2, alpha=0)
    with pytest.raises(ValueError, match=r"models\.lora\.dropout=1"):
        LoRAConfig(rank=2, dropout=1)
    with pytest.raises(ValueError, match=r"unknown \['q_proj'\].*linear_qkv"):
        LoRAConfig(rank=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"models\.lora\.roles=\['reward'\]"):
        LoRAConfig(rank=2, roles=["reward"])
    with pytest.raises(ValueError, match=r"init_adapter_dir=x needs models\.lora\.rank > 0"):
        LoRAConfig(init_adapter_dir="x")
    config = LoRAConfig(rank=4, alpha=8)
    attention = LoRAConfig(rank=2, target_modules=["linear_qkv", "linear_proj"])
    # TinyArch: 4 layers, hidden 64, 4 heads of 16, 2 query groups, SwiGLU of 128
    assert adapter_numel(TinyArch(), attention) == 4 * 2 * ((64 + 128) + (64 + 64))
    assert adapter_numel(TinyArch(), LoRAConfig(rank=1, target_modules=["experts.linear_fc1"]),
                         experts=(8, 32)) == 4 * 8 * (64 + 2 * 32)
    assert config.scaling == 2.0 and config.applies_to("actor") and not config.applies_to("critic")
    assert not LoRAConfig().enabled


def _logprobs(model, pgc, batch) -> torch.Tensor:
    from megatron_rlhf.models.forward_backward import run_microbatches
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs

    def loss_fn(logits, mb):
        logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], mb["input_ids"][:, 1:], pgc.tp,
                                              model.real_vocab_size)
        logprobs = logprobs * mb["attention_mask"][:, 1:]
        return logprobs.sum(), mb["attention_mask"].sum().int(), {"logprobs": logprobs}

    with torch.no_grad():
        metrics = run_microbatches(model, pgc, [batch], loss_fn, forward_only=True)
    return metrics[0]["logprobs"]




def _my_microbatches(pgc, step: int):
    per_replica = GLOBAL_BATCH // pgc.dp.size()
    start = pgc.dp.rank() * per_replica
    mine = {k: v[start:start + per_replica] for k, v in global_batch(step).items()}
    return [{k: v[i:i + 2] for k, v in mine.items()} for i in range(0, per_replica, 2)]


def _build(pgc, sequence_parallel: bool):
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.weights import init_weights

    model = build_gpt_model(TinyArch(), ModelBuildOptions(sequence_parallel=sequence_parallel),
                            pgc)
    init_weights(model, pgc, seed=7)
    return model


def _merged(full: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The dense full state ``W + scaling * B A`` of a full state with adapters."""
    from megatron_rlhf.models.lora import is_adapter_param

    merged = {k: v.clone() for k, v in full.items() if not is_adapter_param(k)}
    for name in full:
        if name.endswith(".adapter.lora_a"):
            layer = name[:-len(".adapter.lora_a")]
            delta = full[f"{layer}.adapter.lora_b"] @ full[name]
            merged[f"{layer}.weight"] += scaling * delta
    return merged


def _check_layout(tp: int, sequence_parallel: bool, distributed_optimizer: bool) -> None:
    from megatron_rlhf.models.gpt import ModelBuildOptions, build_gpt_model
    from megatron_rlhf.models.lora import adapters_disabled, apply_lora, is_adapter_param
    from megatron_rlhf.models.options import adapter_numel
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import gather_full_state, load_full_state

    pgc = whole_world_groups(tp, 1)
    config = _config()
    base = _build(pgc, sequence_parallel)
    probe = global_batch(3)
    trainable_base_logprobs = _logprobs(base, pgc, probe)
    base.requires_grad_(False)
    base_logprobs = _logprobs(base, pgc, probe)
    torch.testing.assert_close(base_logprobs, trainable_base_logprobs, rtol=0, atol=1e-5)

    model = _build(pgc, sequence_parallel)
    adapted = apply_lora(model, config, seed=3)
    assert len(adapted) == 4 * TinyArch().num_layers
    whole = sum(p.numel() * (pgc.tp.size() if getattr(p, "tensor_model_parallel", False) else 1)
                for n, p in model.named_parameters() if is_adapter_param(n))
    assert whole == adapter_numel(TinyArch(), config)
    assert torch.equal(_logprobs(model, pgc, probe), base_logprobs), "zero B changes the model"
    assert all(p.requires_grad == is_adapter_param(n) for n, p in model.named_parameters())

    full = random_lora_b(model, pgc)
    assert not torch.equal(_logprobs(model, pgc, probe), base_logprobs)
    with adapters_disabled(model):
        assert torch.equal(_logprobs(model, pgc, probe), base_logprobs)

    dense = build_gpt_model(TinyArch(), ModelBuildOptions(sequence_parallel=sequence_parallel),
                            pgc)
    load_full_state(dense, pgc, _merged(full, config.scaling))
    settings = OptimizerSettings(lr=1e-2, clip_grad=0.0,
                                 distributed_optimizer=distributed_optimizer)
    trainer = ModelTrainer(model, pgc, settings)
    dense_trainer = ModelTrainer(dense, pgc, OptimizerSettings(lr=1e-2, clip_grad=0.0))
    adapter_numel = sum(p.numel() for n, p in model.named_parameters() if is_adapter_param(n))
    held = torch.tensor(float(sum(p.numel() for g in trainer.optimizer.param_groups
                                  for p in g["params"])))
    if distributed_optimizer:
        dist.all_reduce(held, group=pgc.dp)
    assert held.item() == adapter_numel, "the optimizer holds more than the adapters"
    assert sum(b.numel() for b in trainer.gradient_buffers()) < 2 * adapter_numel

    microbatches = _my_microbatches(pgc, 0)
    assert trainer.train_step(microbatches, nll_loss_fn(pgc, model.real_vocab_size))["update_successful"]
    dense_trainer.train_step(microbatches, nll_loss_fn(pgc, dense.real_vocab_size))

    grads = gather_full_state(model, pgc, use_grads=True)
    dense_grads = gather_full_state(dense, pgc, use_grads=True)
    for name in full:
        if not name.endswith(".adapter.lora_a"):
            continue
        layer = name[:-len(".adapter.lora_a")]
        weight_grad = dense_grads[f"{layer}.weight"]
        lora_a, lora_b = full[name], full[f"{layer}.adapter.lora_b"]
        torch.testing.assert_close(grads[f"{layer}.adapter.lora_b"],
                                   config.scaling * weight_grad @ lora_a.t(),
                                   rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"{layer} B")
        torch.testing.assert_close(grads[name], config.scaling * lora_b.t() @ weight_grad,
                                   rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"{layer} A")

    after = gather_full_state(model, pgc)
    changed = [k for k in full if not torch.equal(after[k], full[k])]
    assert changed and all(is_adapter_param(k) for k in changed), changed
    assert len(changed) == sum(1 for k in full if is_adapter_param(k))
    with adapters_disabled(model):
        assert torch.equal(_logprobs(model, pgc, probe), base_logprobs)


def _all_layouts() -> None:
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    _check_layout(tp=1, sequence_parallel=False, distributed_optimizer=True)
    _check_layout(tp=2, sequence_parallel=False, distributed_optimizer=False)
    _check_layout(tp=2, sequence_parallel=True, distributed_optimizer=False)


@pytest.mark.multirank
def test_lora_matches_base_and_dense_reference():
    run_on_ranks(_all_layouts, world_size=2, timeout_s=180)


def _checkpoint_round_trip(directory: str) -> None:
    """Save a TP=2 model with adapters (random ``B``), load it at TP=1 into one whose adapters
    start otherwise: the same full state, adapters included, to the bit."""
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, save_model_checkpoint
    from megatron_rlhf.models.lora import apply_lora
    from megatron_rlhf.models.weights import gather_full_state
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    pgc = whole_world_groups(2, 1)
    model = _build(pgc, sequence_parallel=False)
    apply_lora(model, _config(), seed=3)
    saved = random_lora_b(model, pgc)
    save_model_checkpoint(model, pgc, directory, {"role": "actor"})

    single = whole_world_groups(1, 1)
    other = _build(single, sequence_parallel=False)
    apply_lora(other, _config(), seed=4)
    load_model_checkpoint(other, single, directory)
    loaded = gather_full_state(other, single)
    assert loaded.keys() == saved.keys()
    different = [k for k in saved if not torch.equal(loaded[k], saved[k])]
    assert not different, different


@pytest.mark.multirank
def test_a_checkpoint_with_adapters_loads_at_another_tp(tmp_path):
    run_on_ranks(_checkpoint_round_trip, world_size=2, args=(str(tmp_path / "ckpt"),),
                 timeout_s=120)


def _moe_model(pgc, frozen: bool = False):
    from dataclasses import replace

    from megatron_rlhf.builder.networks import build_model
    from megatron_rlhf.models.gpt import ModelBuildOptions
    from megatron_rlhf.models.moe import MoEConfig

    moe = MoEConfig(num_experts=4, topk=2, ffn_hidden_size=48, shared_expert_ffn_size=32)
    arch = replace(TinyArch(num_layers=2), experts=moe.expert_spec(TinyArch().ffn_hidden_size))
    model = build_model(arch, ModelBuildOptions(), pgc, runtime_seed=5, init_seed=9)
    return model.requires_grad_(not frozen)


def _expert_adapters() -> None:
    """Adapters on routed experts (EP=2: two experts on each rank), the shared expert and
    attention: zero ``B`` gives the frozen base's log-probs to the bit, and every adapter's
    gradient is the dense chain rule's."""
    from megatron_rlhf.models.lora import apply_lora
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.models.weights import gather_full_state, load_full_state
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    pgc = whole_world_groups(1, 1, ep=2)
    probe = global_batch(3)
    base_logprobs = _logprobs(_moe_model(pgc, frozen=True), pgc, probe)
    model = _moe_model(pgc)
    config = _config(target_modules=["linear_qkv", "linear_fc1", "linear_fc2",
                                     "experts.linear_fc1", "experts.linear_fc2"])
    adapted = apply_lora(model, config, seed=3)
    assert sum(".local_experts." in name for name in adapted) == 2 * 2 * 2  # 2 layers, 2 here
    assert torch.equal(_logprobs(model, pgc, probe), base_logprobs)
    full = random_lora_b(model, pgc)
    assert sum(name.endswith("lora_b") and ".local_experts." in name for name in full) == 16

    dense = _moe_model(pgc)
    load_full_state(dense, pgc, _merged(full, config.scaling))
    trainers = [ModelTrainer(m, pgc, OptimizerSettings(lr=1e-2, clip_grad=0.0))
                for m in (model, dense)]
    for trainer in trainers:
        trainer.train_step(_my_microbatches(pgc, 0), nll_loss_fn(pgc, model.real_vocab_size))
    grads, dense_grads = (gather_full_state(m, pgc, use_grads=True) for m in (model, dense))
    for name in full:
        if name.endswith(".adapter.lora_a"):
            layer = name[:-len(".adapter.lora_a")]
            weight_grad = dense_grads[f"{layer}.weight"]
            torch.testing.assert_close(
                grads[f"{layer}.adapter.lora_b"], config.scaling * weight_grad @ full[name].t(),
                rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"{layer} B")
            torch.testing.assert_close(
                grads[name], config.scaling * full[f"{layer}.adapter.lora_b"].t() @ weight_grad,
                rtol=GRAD_RTOL, atol=GRAD_ATOL, msg=f"{layer} A")


@pytest.mark.multirank
def test_expert_adapters_match_the_dense_reference():
    run_on_ranks(_expert_adapters, world_size=2, timeout_s=120)


def _replicas_after_dropout() -> list[str]:
    """Names of replicated adapter tensors that differ between the two TP ranks after a step
    with adapter dropout (``A`` of column-parallel layers, ``B`` of row-parallel ones)."""
    from megatron_rlhf.models.lora import apply_lora
    from megatron_rlhf.models.trainer import ModelTrainer, OptimizerSettings
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    pgc = whole_world_groups(2, 1)
    model = _build(pgc, sequence_parallel=False)
    apply_lora(model, _config(dropout=0.3), seed=3)
    random_lora_b(model, pgc)
    trainer = ModelTrainer(model, pgc, OptimizerSettings(lr=1e-2, clip_grad=0.0))
    trainer.train_step(_my_microbatches(pgc, 0), nll_loss_fn(pgc, model.real_vocab_size))
    differ = []
    for name, param in model.named_parameters():
        if name.endswith(("lora_a", "lora_b")) and not getattr(param, "tensor_model_parallel",
                                                               False):
            copies = [torch.empty_like(param) for _ in range(2)]
            dist.all_gather(copies, param.detach().contiguous(), group=pgc.tp)
            if not torch.equal(copies[0], copies[1]):
                differ.append(name)
    return differ


@pytest.mark.multirank
def test_dropout_keeps_the_replicated_adapters_equal_over_tp():
    """With dropout, the TP ranks drop the same elements of a replicated input, so the adapter
    tensors every TP rank holds whole stay equal after a step."""
    assert run_on_ranks(_replicas_after_dropout, world_size=2, timeout_s=120) == [[], []]
