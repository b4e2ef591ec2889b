"""LoRA adapters (``models.lora``) as a Hugging Face PEFT adapter directory, and merged.

    full = gather_full_state(model, pg_collection)          # base and adapters, TP=1 layout
    save_peft_adapter("out/adapter", full, description, lora_config, base="path/to/hf-base")
    # peft: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), "out/adapter")
    merged = merge_adapters(full, lora_config.scaling)       # W + (alpha / r) B A, a plain model

megatron fuses what Hugging Face keeps apart, and one adapter on a fused layer is several
adapters in PEFT's names that share ``A``: ``linear_qkv``'s ``B`` splits into the rows of
``q_proj``, ``k_proj`` and ``v_proj`` (megatron's grouped layout, as the weight splits), a
SwiGLU ``linear_fc1``'s into ``gate_proj`` and ``up_proj``; each HF layer's ``lora_A`` is the
fused layer's ``A``. The product ``B A`` of every HF layer is then exactly the rows of the fused
layer's, so the PEFT model computes what the megatron one does. Routed experts' adapters do not
export (PEFT names no fused expert layers).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from megatron_rlhf.models.description import ModelDescription
from megatron_rlhf.models.hf_llama import _qkv_to_hf  # the qkv rows' one layout
from megatron_rlhf.models.lora import ADAPTER, LoRAConfig, is_adapter_param, load_full_adapters
from megatron_rlhf.models.options import PEFT_ADAPTER_CONFIG as ADAPTER_CONFIG
from megatron_rlhf.models.options import PEFT_ADAPTER_WEIGHTS as ADAPTER_WEIGHTS

PEFT_PREFIX = "base_model.model."
"""Where PEFT's ``LoraModel`` puts the HF model's names in its adapter file."""
_HF_TARGETS = {"linear_qkv": ("q_proj", "k_proj", "v_proj"), "linear_proj": ("o_proj",),
               "linear_fc1": ("gate_proj", "up_proj"), "linear_fc2": ("down_proj",)}
_HF_MODULE = {"self_attention.linear_qkv": "self_attn", "self_attention.linear_proj": "self_attn",
              "mlp.linear_fc1": "mlp", "mlp.linear_fc2": "mlp"}


def merge_adapters(full_state: dict[str, torch.Tensor], scaling: float
                   ) -> dict[str, torch.Tensor]:
    """The plain full state ``W + scaling * B A`` of a full state with adapters (in fp32, then
    the weight's dtype); the input is left unchanged."""
    merged = {k: v for k, v in full_state.items() if not is_adapter_param(k)}
    for name, lora_a in full_state.items():
        if not name.endswith(f".{ADAPTER}.lora_a"):
            continue
        layer = name[:-len(f".{ADAPTER}.lora_a")]
        weight = merged[f"{layer}.weight"]
        delta = full_state[f"{layer}.{ADAPTER}.lora_b"].float() @ lora_a.float()
        merged[f"{layer}.weight"] = (weight.float() + scaling * delta).to(weight.dtype)
    return merged


def peft_adapter_state(full_state: dict[str, torch.Tensor], description: ModelDescription
                       ) -> dict[str, torch.Tensor]:
    """PEFT's tensors (``base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight``,
    ...) of the adapters in a full state (:func:`full_adapters_from_peft` reads them back).

    Raises:
        ValueError: the state holds expert adapters, or none at all.
    """
    out: dict[str, torch.Tensor] = {}
    ffn = description.arch.ffn_hidden_size
    for name, lora_a in full_state.items():
        if not name.endswith(f".{ADAPTER}.lora_a"):
            continue
        layer = name[:-len(f".{ADAPTER}.lora_a")]
        lora_b = full_state[f"{layer}.{ADAPTER}.lora_b"]
        if ".experts." in layer:
            raise ValueError(f"{layer}: routed experts' adapters have no PEFT names; train "
                             "without experts.* in models.lora.target_modules to export")
        index, local = layer.removeprefix("decoder.layers.").split(".", 1)
        prefix = f"{PEFT_PREFIX}model.layers.{index}.{_HF_MODULE[local]}."
        leaf = local.rsplit(".", 1)[-1]
        if leaf == "linear_qkv":
            rows = _qkv_to_hf(lora_b, description, "", "lora_B.weight")
            parts = {hf.split(".", 1)[1].split(".")[0]: b for hf, b in rows.items()}
        elif leaf == "linear_fc1" and lora_b.shape[0] == 2 * ffn:
            parts = dict(zip(("gate_proj", "up_proj"), lora_b.chunk(2), strict=True))
        else:
            parts = {_HF_TARGETS[leaf][-1]: lora_b}
        for hf_name, b in parts.items():
            out[f"{prefix}{hf_name}.lora_A.weight"] = lora_a.clone()  # a file tensor each
            out[f"{prefix}{hf_name}.lora_B.weight"] = b.contiguous()
    if not out:
        raise ValueError("the full state holds no adapters to export")
    return out


def save_peft_adapter(out_dir: str | Path, full_state: dict[str, torch.Tensor],
                      description: ModelDescription, config: LoRAConfig, base: str = "",
                      dtype: torch.dtype | None = None) -> Path:
    """Write ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT saves a LoRA
    adapter of a causal LM.

    Args:
        out_dir: the directory to create or fill.
        full_state: the adapted model's full state (``weights.gather_full_state``).
        description: the model (its architecture splits ``linear_qkv``).
        config: the adapters' rank, alpha and dropout.
        base: ``base_model_name_or_path``: the Hugging Face model the adapter applies to.
        dtype: the tensors' dtype in the file (default: as held).

    Raises:
        FileExistsError: ``out_dir`` already holds an adapter.
    """
    out = Path(out_dir)
    if (out / ADAPTER_WEIGHTS).exists():
        raise FileExistsError(f"{out} already holds an adapter; choose an empty directory")
    tensors = peft_adapter_state(full_state, description)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    targets = sorted({name.split(".")[-3] for name in tensors})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": config.rank, "lora_alpha": config.alpha, "lora_dropout": config.dropout,
        "target_modules": targets, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "use_dora": False, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(adapter_config, indent=2) + "\n")
    return out


def full_adapters_from_peft(tensors: dict[str, torch.Tensor], arch) -> dict[str, torch.Tensor]:
    """The full-state adapters (``decoder.layers.<i>...adapter.lora_a``/``lora_b``) of PEFT's
    tensors: the inverse of :func:`peft_adapter_state`.

    Raises:
        ValueError: a fused layer's PEFT adapters do not share ``A`` (megatron's one adapter on
            ``linear_qkv`` or ``linear_fc1`` has one), or a layer is missing some of them.
    """
    a = arch
    groups, head_dim = a.num_query_groups, a.head_dim or a.hidden_size // a.num_attention_heads
    q_rows = a.num_attention_heads // groups * head_dim
    out: dict[str, torch.Tensor] = {}
    layers = sorted({name.removeprefix(f"{PEFT_PREFIX}model.layers.").split(".")[0]
                     for name in tensors})
    for index in layers:
        for local, hf_names in (("self_attention.linear_qkv", ("q_proj", "k_proj", "v_proj")),
                                ("self_attention.linear_proj", ("o_proj",)),
                                ("mlp.linear_fc1", ("gate_proj", "up_proj")),
                                ("mlp.linear_fc2", ("down_proj",))):
            prefix = f"{PEFT_PREFIX}model.layers.{index}.{_HF_MODULE[local]}."
            names = [f"{prefix}{hf}.lora_A.weight" for hf in hf_names]
            present = [n in tensors for n in names]
            if not any(present):
                continue
            if not all(present):
                raise ValueError(f"layer {index}: the PEFT adapter has only some of "
                                 f"{list(hf_names)}, which megatron fuses into one layer")
            lora_a = tensors[names[0]]
            if any(not torch.equal(tensors[n], lora_a) for n in names[1:]):
                raise ValueError(f"layer {index}: the PEFT adapters of {list(hf_names)} have "
                                 "different lora_A matrices; megatron's fused layer has one "
                                 "adapter, whose A they must share")
            bs = [tensors[f"{prefix}{hf}.lora_B.weight"] for hf in hf_names]
            if local.endswith("linear_qkv"):
                parts = [b.reshape(groups, rows, -1)
                         for b, rows in zip(bs, (q_rows, head_dim, head_dim), strict=True)]
                lora_b = torch.cat(parts, dim=1).reshape(-1, lora_a.shape[0])
            else:
                lora_b = torch.cat(bs)
            layer = f"decoder.layers.{index}.{local}.{ADAPTER}"
            out[f"{layer}.lora_a"], out[f"{layer}.lora_b"] = lora_a, lora_b
    if not out:
        raise ValueError("the PEFT adapter holds no LoRA tensors of a Llama-family layer")
    return out


def read_peft_adapter(directory: str | Path, arch, config: LoRAConfig,
                      section: str = "models.lora") -> dict[str, torch.Tensor]:
    """Read a PEFT LoRA adapter directory as full-state adapters for a model of ``arch`` (its
    ``num_query_groups`` and head size split ``q_proj``, ``k_proj``, ``v_proj``) with
    ``config``; ``section`` names the settings in the messages (``model.lora`` in SFT and RM).

    Raises:
        ValueError: no adapter there, its ``r`` or ``lora_alpha`` differ from ``config``'s
            (``LoRAConfig.check_adapter_dir``), or its layers do not map
            (:func:`full_adapters_from_peft`).
    """
    from safetensors.torch import load_file

    replace(config, init_adapter_dir=str(directory)).check_adapter_dir(section)
    return full_adapters_from_peft(load_file(str(Path(directory).expanduser() / ADAPTER_WEIGHTS)),
                                   arch)


def load_peft_adapter(model: torch.nn.Module, pg_collection, arch, config: LoRAConfig,
                      section: str = "models.lora") -> None:
    """Start ``model``'s adapters (``apply_lora`` added them, after its base was loaded) from
    ``config.init_adapter_dir``: what PPO's actor and SFT and RM models do. Collective over the
    model's TP and PP groups (``load_full_adapters``).

    Raises:
        ValueError: see :func:`read_peft_adapter`; the adapter's layers are not the model's.
    """
    adapters = read_peft_adapter(config.init_adapter_dir, arch, config, section)
    try:
        load_full_adapters(model, pg_collection, adapters)
    except ValueError as error:
        raise ValueError(f"{section}.init_adapter_dir={config.init_adapter_dir}: {error}; "
                         f"compare {section}.target_modules") from None
