"""The registry of Hugging Face model families: an unknown ``model_type`` is refused with the
registered ones listed, and a family registered with ``register_hf_family`` is read from its
``config.json`` and written back under its own names."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_rlhf.models.hf_config import (
    FAMILIES,
    HFFamily,
    hf_config,
    read_hf_config,
    register_hf_family,
)
from megatron_rlhf.topology.models import ExpertSpec

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
         "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 128,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "bos_token_id": 1, "eos_token_id": 2}
MISTRAL = HFFamily("mistral", "MistralForCausalLM", "MistralForSequenceClassification",
                   qkv_bias=False, qk_norm=False, config_fields={"sliding_window": None})
"""Llama's layers under Mistral's names (a Mistral checkpoint without a sliding window)."""


def _read(directory: Path, config: dict) -> tuple:
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return read_hf_config(directory)


@pytest.fixture
def mistral() -> Iterator[HFFamily]:
    register_hf_family(MISTRAL)
    yield MISTRAL
    del FAMILIES["mistral"]


def test_the_built_in_families_are_registered() -> None:
    assert list(FAMILIES) == ["llama", "qwen2", "qwen3", "qwen3_moe", "mixtral"]
    assert [f.model_type for f in FAMILIES.values() if f.qkv_bias] == ["qwen2"]
    assert [f.model_type for f in FAMILIES.values() if f.qk_norm] == ["qwen3", "qwen3_moe"]
    assert [f.model_type for f in FAMILIES.values() if f.experts] == ["qwen3_moe", "mixtral"]


def test_an_unknown_model_type_lists_the_registered_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model_type='mistral' is not supported; convertible "
                                         r"\(registered\): \['llama', 'mixtral', 'qwen2', 'qwen3', "
                                         r"'qwen3_moe'\]"):
        _read(tmp_path, LLAMA | {"model_type": "mistral"})
    with pytest.raises(ValueError, match="'llama' is already registered"):
        register_hf_family(replace(MISTRAL, model_type="llama"))


def test_a_registered_family_converts_both_ways(tmp_path: Path, mistral: HFFamily) -> None:
    llama, _ = _read(tmp_path / "llama", LLAMA)
    description, config = _read(tmp_path / "mistral", LLAMA | {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"]})
    assert description == llama  # the same layers
    exported = hf_config(description, base_config=config)
    assert exported["model_type"] == "mistral"
    assert exported["architectures"] == ["MistralForCausalLM"]
    assert exported["sliding_window"] is None and "attention_bias" not in exported
    assert exported["eos_token_id"] == 2 and exported["num_key_value_heads"] == 2
    critic = hf_config(replace(description, head="scalar"), base_config=config)
    assert critic["architectures"] == ["MistralForSequenceClassification"]
    # without the original config the first registered family with these layers is written
    assert hf_config(description)["model_type"] == "llama"


def test_the_built_in_families_export_their_own_fields(tmp_path: Path) -> None:
    llama, config = _read(tmp_path, LLAMA)
    exported = hf_config(llama, base_config=config)
    assert exported["attention_bias"] is False and "layer_types" not in exported
    qwen2 = hf_config(replace(llama, arch=replace(llama.arch, qkv_bias=True)))
    assert qwen2["model_type"] == "qwen2" and "head_dim" not in qwen2
    assert qwen2["layer_types"] == ["full_attention"] * 2 and "attention_bias" not in qwen2
    qwen3 = hf_config(replace(llama, arch=replace(llama.arch, qk_norm=True)))
    assert qwen3["model_type"] == "qwen3" and qwen3["head_dim"] == 16
    assert qwen3["attention_bias"] is False and qwen3["sliding_window"] is None


def test_a_dense_description_exports_dense_and_an_moe_one_its_experts(tmp_path: Path) -> None:
    llama, _ = _read(tmp_path, LLAMA)
    assert "num_local_experts" not in hf_config(llama)
    moe = replace(llama, arch=replace(llama.arch, experts=ExpertSpec(4, 2, 32)))
    mixtral = hf_config(moe)
    assert (mixtral["model_type"], mixtral["num_local_experts"], mixtral["intermediate_size"],
            mixtral["router_jitter_noise"]) == ("mixtral", 4, 32, 0.0)
    qwen = hf_config(replace(moe, arch=replace(moe.arch, qk_norm=True, experts=ExpertSpec(
                         4, 2, 32, renormalize_topk=False))),
                     base_config={"model_type": "qwen3_moe", "num_local_experts": 9})
    assert (qwen["num_experts"], qwen["moe_intermediate_size"], qwen["intermediate_size"],
            qwen["norm_topk_prob"], qwen["decoder_sparse_step"]) == (4, 32, 128, False, 1)
    assert "num_local_experts" not in qwen  # one spelling of the count, not a stale second
