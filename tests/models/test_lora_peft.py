"""LoRA adapters exported as a Hugging Face PEFT adapter (``models.peft_export``).

A tiny random Llama (GQA, SwiGLU) is loaded into megatron at TP=2 on two gloo ranks, given
adapters on every target with random ``B``, and exported: ``peft.PeftModel`` over the
transformers base model gives the megatron logits within 1e-4, and so does the merged model
(``merge_adapters``) converted to a plain HF directory. The adapter file holds PEFT's names, and
read back (``read_peft_adapter``) into a model whose adapters started otherwise it gives the
exported adapters to the bit; an adapter of another rank is refused.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.models import full_logits, random_lora_b
from tests.model_fixtures import whole_world_groups
from tests.multirank import run_on_ranks
from tools.make_tiny_hf import make_hf_model

peft = pytest.importorskip("peft")

_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
_SIZES = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6, "initializer_range": 0.1, "pad_token_id": 0,
          "rope_theta": 50000.0}


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _export(base: str, out: str) -> np.ndarray:
    """Megatron logits of the adapted model; rank 0 writes the adapter and the merged model.

    Returned as a numpy array: a tensor would come back through shared memory that is gone
    once the rank has exited."""
    import torch.distributed as dist

    from megatron_rlhf.models.gpt import build_gpt_model
    from megatron_rlhf.models.hf_config import read_hf_config
    from megatron_rlhf.models.hf_llama import (
        full_state_to_hf,
        hf_to_full_state,
        load_hf_state,
        save_hf_checkpoint,
    )
    from megatron_rlhf.models.lora import LoRAConfig, apply_lora, load_full_adapters
    from megatron_rlhf.models.peft_export import (
        merge_adapters,
        read_peft_adapter,
        save_peft_adapter,
    )
    from megatron_rlhf.models.weights import gather_full_state, load_full_state
    from megatron_rlhf.runtime.bootstrap import initialize_runtime

    initialize_runtime()
    description, hf_config = read_hf_config(base)
    pgc = whole_world_groups(2, 1)
    model = build_gpt_model(description.arch, description.build_options(), pgc)
    load_full_state(model, pgc, hf_to_full_state(load_hf_state(base), description))
    config = LoRAConfig(rank=4, alpha=8.0)
    apply_lora(model, config, seed=5)
    full = random_lora_b(model, pgc)
    logits = full_logits(model, pgc, _batch())
    if dist.get_rank() == 0:
        save_peft_adapter(f"{out}/adapter", full, description, config, base=base)
        merged = full_state_to_hf(merge_adapters(full, config.scaling), description)
        save_hf_checkpoint(f"{out}/merged", description, merged, base_config=hf_config)
    dist.barrier()

    # the adapter as a starting point, into a model whose adapters start otherwise
    other = build_gpt_model(description.arch, description.build_options(), pgc)
    load_full_state(other, pgc, hf_to_full_state(load_hf_state(base), description))
    apply_lora(other, config, seed=6)
    load_full_adapters(other, pgc, read_peft_adapter(f"{out}/adapter", description.arch, config))
    again = gather_full_state(other, pgc)
    assert [k for k in full if not torch.equal(again[k], full[k])] == []
    try:
        read_peft_adapter(f"{out}/adapter", description.arch, LoRAConfig(rank=8, alpha=8.0))
    except ValueError as error:
        assert "has r=4, but models.lora.rank=8" in str(error), error
    else:
        raise AssertionError("a rank mismatch was not refused")
    return logits.numpy()


@pytest.mark.multirank
def test_peft_adapter_and_merged_model_reproduce_the_logits(tmp_path: Path) -> None:
    import transformers

    base = tmp_path / "base"
    make_hf_model(base, "LlamaConfig", "LlamaForCausalLM", 3, **_SIZES)
    logits = torch.from_numpy(run_on_ranks(_export, world_size=2, args=(str(base), str(tmp_path)),
                                           timeout_s=120)[0])

    adapter = tmp_path / "adapter"
    names = load_file(adapter / "adapter_model.safetensors")
    assert "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight" in names
    assert names["base_model.model.model.layers.0.mlp.gate_proj.lora_A.weight"].shape == (4, 64)
    assert names["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].shape == (32, 4)
    assert len(names) == 2 * 2 * 7
    assert json.loads((adapter / "adapter_config.json").read_text())["lora_alpha"] == 8.0

    hf_base = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    with torch.no_grad():
        plain = hf_base(input_ids=_batch()["input_ids"]).logits
        with_adapter = peft.PeftModel.from_pretrained(hf_base, adapter).eval()
        peft_logits = with_adapter(input_ids=_batch()["input_ids"]).logits
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged",
                                                                   dtype=torch.float32)
        merged_logits = merged(input_ids=_batch()["input_ids"]).logits
    assert (plain - logits).abs().max() > 1e-2, "the adapters change too little to be checked"
    torch.testing.assert_close(peft_logits, logits, **_TOLERANCE)
    torch.testing.assert_close(merged_logits, logits, **_TOLERANCE)
