"""Model outputs gathered whole, the reference side of the tests that compare models."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist


def full_logits(model, pg_collection, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The model output over the real vocabulary (plus the value channel for ``lm+scalar``),
    gathered across TP; None on pipeline stages other than the last."""
    from megatron_rlhf.models.forward_backward import run_microbatches
    from megatron_rlhf.models.gpt import split_policy_value

    outputs: list[torch.Tensor] = []

    def keep_output(output: torch.Tensor, _batch) -> tuple[torch.Tensor, dict]:
        outputs.append(output.detach())
        return output.sum() * 0.0, {}

    run_microbatches(model, pg_collection, [batch], keep_output, forward_only=True)
    if not outputs:
        return None
    output, values = outputs[0], None
    if model.head_kind == "scalar":
        return output
    if model.head_kind == "lm+scalar":
        output, values = split_policy_value(output)
    tp_group = pg_collection.tp
    shards = [torch.empty_like(output) for _ in range(tp_group.size())]
    dist.all_gather(shards, output.contiguous(), group=tp_group)
    logits = torch.cat(shards, dim=-1)[..., : model.real_vocab_size]
    return logits if values is None else torch.cat([logits, values[..., None]], dim=-1)


def full_forward_logprobs(model, pg_collection, out, temperature: float) -> torch.Tensor:
    """``[b, R]`` log-probs of a generation's response tokens from one forward over prompt +
    response (``out`` a ``GenerationOutput``), 0 on padding: what generation must reproduce."""
    from megatron_rlhf.models.forward_backward import model_inputs
    from megatron_rlhf.models.logprobs import vocab_parallel_logprobs

    with torch.no_grad():
        logits = model(*model_inputs({"input_ids": out.input_ids,
                                      "attention_mask": out.attention_mask}))
    logprobs, _ = vocab_parallel_logprobs(logits[:, :-1], out.input_ids[:, 1:], pg_collection.tp,
                                          model.real_vocab_size, temperature)
    return logprobs[:, out.prompt_length - 1:] * out.response_mask


def assert_hf_mapping_round_trips(hf_dir: Path):
    """Map a Hugging Face checkpoint to the full Megatron state and back; every tensor must come
    back bit-identical under its name. Returns the checkpoint's ``(description, hf_state, full)``
    for further checks."""
    from megatron_rlhf.models.hf_config import read_hf_config
    from megatron_rlhf.models.hf_llama import full_state_to_hf, hf_to_full_state, load_hf_state

    description, _ = read_hf_config(hf_dir)
    hf_state = load_hf_state(hf_dir)
    full = hf_to_full_state(hf_state, description)
    back = full_state_to_hf(full, description)
    assert back.keys() == hf_state.keys(), hf_dir
    assert all(torch.equal(back[name], tensor) for name, tensor in hf_state.items()), hf_dir
    return description, hf_state, full


def random_lora_b(model, pgc) -> dict[str, torch.Tensor]:
    """Give every ``B`` layout-independent random values; return the model's full state."""
    from megatron_rlhf.models.lora import is_adapter_param
    from megatron_rlhf.models.weights import gather_full_state, load_full_state

    full = gather_full_state(model, pgc)
    generator = torch.Generator().manual_seed(11)
    for name in sorted(full):
        if is_adapter_param(name) and name.endswith("lora_b"):
            full[name] = torch.randn(full[name].shape, generator=generator) * 0.05
    load_full_state(model, pgc, full)
    return full
