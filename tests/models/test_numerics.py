"""Device, dtype and layer-implementation choices of the model builder (single process, CPU).

What a GPU changes is only the device; the dtype rules (every parameter in ``params_dtype``, fp32
values and scores) are the same on CPU, where bf16 runs too, so they are checked here.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rlhf.config.ppo_run import ModelsConfig
from megatron_rlhf.models import gpt
from megatron_rlhf.models.forward_backward import model_inputs
from megatron_rlhf.models.gpt import (
    ModelBuildOptions,
    build_gpt_model,
    resolve_params_dtype,
    resolve_transformer_impl,
    with_explicit_attention_masks,
)
from megatron_rlhf.models.weights import _init_full_tensor, init_weights
from tests.model_fixtures import TinyArch, whole_world_groups


@pytest.fixture(scope="module")
def groups():
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    return whole_world_groups(1, 1)


def test_params_dtype_auto_is_bf16_with_cuda_and_fp32_without(monkeypatch) -> None:
    assert resolve_params_dtype("auto") == "float32"
    assert ModelsConfig().params_dtype == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_params_dtype("auto") == "bfloat16"
    assert ModelsConfig().params_dtype == "bfloat16", "resolved when the config is built"
    assert ModelsConfig(params_dtype="float32").params_dtype == "float32"
    with pytest.raises(ValueError, match="params_dtype='fp16'"):
        resolve_params_dtype("fp16")


def test_transformer_impl_auto_takes_te_only_where_it_is_correct(monkeypatch) -> None:
    assert resolve_transformer_impl("auto", needs_kv_cache=False) == "local", "no CUDA here"
    with pytest.raises(ValueError, match="needs CUDA and an importable transformer_engine"):
        resolve_transformer_impl("transformer_engine", needs_kv_cache=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpt, "transformer_engine_importable", lambda: True)
    assert resolve_transformer_impl("auto", needs_kv_cache=False) == "transformer_engine"
    assert resolve_transformer_impl("auto", needs_kv_cache=True) == "local"
    with pytest.raises(ValueError, match="generation.use_kv_cache=false"):
        resolve_transformer_impl("transformer_engine", needs_kv_cache=True)
    with pytest.raises(ValueError, match="models.transformer_impl='te'"):
        resolve_transformer_impl("te", needs_kv_cache=False)
    with pytest.raises(ValueError, match="models.transformer_impl='fused'"):
        ModelsConfig(transformer_impl="fused")


@pytest.mark.parametrize("head", ["lm", "scalar", "lm+scalar"])
def test_bf16_models_hold_every_parameter_in_bf16_and_give_fp32_values(groups, head) -> None:
    model = build_gpt_model(TinyArch(), ModelBuildOptions(head=head, params_dtype="bfloat16"),
                            groups)
    init_weights(model, groups, seed=3)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert set(dtypes.values()) == {torch.bfloat16}, dtypes
    assert any("layernorm" in name for name in dtypes), "norms are included"
    batch = {"input_ids": torch.randint(0, 250, (2, 6)),
             "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    output = model(*model_inputs(batch))
    if head == "lm":
        assert output.dtype == torch.bfloat16
        return
    assert output.dtype == torch.float32, "the value channel is not rounded to bf16"
    reference = build_gpt_model(TinyArch(), ModelBuildOptions(head=head, params_dtype="float32"),
                                groups)
    init_weights(reference, groups, seed=3)
    values = output[..., -1]
    torch.testing.assert_close(values, reference(*model_inputs(batch))[..., -1], rtol=0.05,
                               atol=0.05)


def test_explicit_masks_make_attention_apply_the_given_mask(groups) -> None:
    """The spec change that TE needs leaves megatron's local attention exactly as it was."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType

    spec = with_explicit_attention_masks(get_gpt_layer_local_spec(normalization="RMSNorm"))
    assert spec.submodules.self_attention.params["attn_mask_type"] is AttnMaskType.arbitrary
    model = build_gpt_model(TinyArch(), ModelBuildOptions(params_dtype="float32"), groups)
    init_weights(model, groups, seed=4)
    ids = torch.randint(0, 250, (1, 7))
    left_padded = {"input_ids": torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1),
                   "attention_mask": torch.tensor([[0, 0, 0] + [1] * 7])}
    plain = {"input_ids": ids, "attention_mask": torch.ones(1, 7, dtype=torch.long)}
    with torch.no_grad():
        torch.testing.assert_close(model(*model_inputs(left_padded))[:, 3:],
                                   model(*model_inputs(plain)), rtol=1e-5, atol=1e-5)


def test_norm_weights_start_at_one_and_others_random() -> None:
    for name in ("decoder.layers.0.input_layernorm.weight",
                 "decoder.layers.0.pre_mlp_layernorm.weight", "decoder.final_layernorm.weight"):
        assert torch.equal(_init_full_tensor(name, [8], seed=1, std=0.02, num_layers=2),
                           torch.ones(8))
    weight = _init_full_tensor("decoder.layers.0.mlp.linear_fc1.weight", [8, 4], seed=1,
                               std=0.02, num_layers=2)
    assert 0 < weight.std() < 0.1


def test_sdpa_attention_equals_megatrons_on_real_tokens_with_gradients(groups) -> None:
    """torch SDPA in megatron's spec gives megatron's local attention's outputs and gradients on
    every real token of a left-padded GQA batch (padding rows are free to differ)."""
    arch = TinyArch(num_attention_heads=4, num_query_groups=2)
    batch = {"input_ids": torch.randint(0, 250, (3, 9), generator=torch.Generator().manual_seed(2)),
             "attention_mask": torch.tensor([[0, 0, 0] + [1] * 6, [1] * 9, [0] + [1] * 8])}
    real = batch["attention_mask"].bool()
    results = {}
    for backend in ("megatron", "sdpa"):
        model = build_gpt_model(arch, ModelBuildOptions(params_dtype="float32",
                                                        attention_backend=backend,
                                                        packed_sequences=False), groups)
        init_weights(model, groups, seed=5)
        output = model(*model_inputs(batch))
        output[real].square().mean().backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        results[backend] = (output[real].detach(), grads)
    torch.testing.assert_close(results["sdpa"][0], results["megatron"][0], rtol=1e-5, atol=1e-5)
    for name, grad in results["megatron"][1].items():
        torch.testing.assert_close(results["sdpa"][1][name], grad, rtol=1e-4, atol=1e-6,
                                   msg=lambda m, name=name: f"{name}: {m}")
    with pytest.raises(ValueError, match="attention_backend='flash'"):
        ModelBuildOptions(attention_backend="flash")
