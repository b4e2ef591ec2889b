"""Hugging Face ``config.json`` <-> :class:`ModelDescription` for the Llama and Qwen families.

    description, config = read_hf_config("Qwen2.5-0.5B-Instruct")   # refuses what cannot convert
    hf_config(description, base_config=config)                       # the config.json to write

Supported (each maps onto megatron-core options, no layer of our own):

    model_type  architectures (...ForCausalLM, ...ForSequenceClassification)  differs by
    llama       Llama...                           Llama-3 ``rope_type: llama3`` (``rope_scaling``)
    qwen2       Qwen2...                           bias on q/k/v (``add_qkv_bias``)
    qwen3       Qwen3...                           per-head q/k RMSNorm (``qk_layernorm``)

``...ForCausalLM`` becomes head ``lm``; ``...ForSequenceClassification`` with one label becomes head
``scalar`` (a reward model or critic). Refused, with the field named: other model types and
architectures, biases elsewhere, activations other than SiLU, sliding-window attention, RoPE
scalings other than Llama-3's with megatron's fixed frequency factors (1, 4) and original context
(8192), several labels.

A family is one ``register_hf_family(HFFamily(...))`` below: its names and how its layers and its
``config.json`` differ from Llama's, as data. ``FAMILIES`` is what converts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rlhf.models.checkpoint import ModelDescription
from megatron_rlhf.models.hf_tokenizer import read_json_object

CONFIG_FILE = "config.json"
# megatron's Llama-3 RoPE scaling fixes these (RotaryEmbedding._apply_scaling); factor is free.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class HFFamily:
    """One supported Hugging Face model family.

    Attributes:
        model_type: ``config.json``'s ``model_type``.
        causal_lm: the ``architectures`` name of its LM (head ``lm``).
        classifier: the ``architectures`` name of its sequence classifier (head ``scalar``).
        qkv_bias: the q/k/v projections carry a bias (no config field turns it off, so its
            ``config.json`` has no ``attention_bias`` to check).
        qk_norm: queries and keys are RMS-normalised per head.
        config_fields: fields an exported ``config.json`` of the family always holds, beside the
            architecture's.
        layer_types: an exported ``config.json`` lists ``layer_types`` (all full attention).
        implicit_head_dim: an exported ``config.json`` holds ``head_dim`` only where it differs
            from ``hidden_size / num_attention_heads``.
    """

    model_type: str
    causal_lm: str
    classifier: str
    qkv_bias: bool
    qk_norm: bool
    config_fields: Mapping[str, Any] = field(default_factory=dict)
    layer_types: bool = False
    implicit_head_dim: bool = False


FAMILIES: dict[str, HFFamily] = {}
"""``model_type`` -> family, filled by ``register_hf_family``."""


def register_hf_family(family: HFFamily) -> HFFamily:
    """Make ``family`` convert, both ways.

    Raises:
        ValueError: its ``model_type`` is already registered.
    """
    if family.model_type in FAMILIES:
        raise ValueError(f"Hugging Face family {family.model_type!r} is already registered")
    FAMILIES[family.model_type] = family
    return family


_QWEN_FIELDS = {"use_sliding_window": False, "sliding_window": None}
register_hf_family(HFFamily("llama", "LlamaForCausalLM", "LlamaForSequenceClassification",
                            qkv_bias=False, qk_norm=False,
                            config_fields={"attention_bias": False, "mlp_bias": False}))
register_hf_family(HFFamily("qwen2", "Qwen2ForCausalLM", "Qwen2ForSequenceClassification",
                            qkv_bias=True, qk_norm=False, config_fields=_QWEN_FIELDS,
                            layer_types=True, implicit_head_dim=True))
register_hf_family(HFFamily("qwen3", "Qwen3ForCausalLM", "Qwen3ForSequenceClassification",
                            qkv_bias=False, qk_norm=True,
                            config_fields={**_QWEN_FIELDS, "attention_bias": False},
                            layer_types=True))


def _positive_int(config: dict[str, Any], key: str, source: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: {key}={value!r} must be a positive integer")
    return value


def _rope(config: dict[str, Any], source: Path) -> tuple[int, float]:
    """(rotary base, Llama-3 scaling factor or 0)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters/rope_scaling={params!r} must be an object")
    kind = params.get("rope_type", params.get("type", "default"))
    factor = 0.0
    if kind == "llama3":
        for key, fixed in _LLAMA3_FIXED.items():
            if params.get(key) != fixed:
                raise ValueError(f"{source}: rope {key}={params.get(key)!r}; megatron's Llama-3 "
                                 f"RoPE scaling fixes it to {fixed}")
        factor = params.get("factor")
        if not isinstance(factor, int | float) or factor <= 0:
            raise ValueError(f"{source}: rope factor={factor!r} must be a positive number")
    elif kind != "default":
        raise ValueError(f"{source}: rope_type={kind!r} is not supported; only 'default' and "
                         "'llama3' rotary embeddings convert")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or theta <= 0 or float(theta) != int(theta):
        raise ValueError(f"{source}: rope_theta={theta!r} must be a positive whole number")
    return int(theta), float(factor)


def hf_family(config: dict[str, Any], source: Path) -> tuple[HFFamily, str]:
    """The family and head (``lm`` or ``scalar``) a ``config.json`` describes.

    Raises:
        ValueError: an unsupported ``model_type``, architecture or number of labels.
    """
    family = FAMILIES.get(config.get("model_type"))
    if family is None:
        raise ValueError(f"{source}: model_type={config.get('model_type')!r} is not supported; "
                         f"convertible (registered): {sorted(FAMILIES)}")
    architectures = config.get("architectures") or [family.causal_lm]
    if architectures not in ([family.causal_lm], [family.classifier]):
        raise ValueError(f"{source}: architectures={architectures!r}; a {family.model_type} "
                         f"checkpoint converts as [{family.causal_lm!r}] or "
                         f"[{family.classifier!r}]")
    if architectures == [family.causal_lm]:
        return family, "lm"
    labels = config.get("num_labels", len(config.get("id2label") or {0: None}))
    if labels != 1:
        raise ValueError(f"{source}: {family.classifier} with {labels} labels; a reward model or "
                         "critic has one (num_labels=1)")
    return family, "scalar"


def _check_plain(config: dict[str, Any], family: HFFamily, source: Path) -> None:
    expected = {"hidden_act": "silu", "mlp_bias": False, "use_sliding_window": False}
    if not family.qkv_bias:  # a family with the bias always has it, and no such field
        expected["attention_bias"] = False
    for key, value in expected.items():
        if config.get(key, value) != value:
            raise ValueError(f"{source}: {key}={config[key]!r} is not supported; need {value!r}")
    layer_types = config.get("layer_types") or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"{source}: layer_types={sorted(set(layer_types))}; only "
                         "'full_attention' layers convert")


def read_hf_config(hf_dir: str | Path) -> tuple[ModelDescription, dict[str, Any]]:
    """Read and check ``config.json`` of a Llama / Qwen2 / Qwen3 checkpoint.

    Returns:
        The equivalent model's description (float16 becomes float32) and the raw config (keep it
        to export token ids and other non-architecture fields back).

    Raises:
        FileNotFoundError: ``config.json`` does not exist.
        ValueError: naming the field that is malformed or describes an unsupported model.
    """
    path = Path(hf_dir) / CONFIG_FILE
    config = read_json_object(path)
    family, head = hf_family(config, path)
    _check_plain(config, family, path)
    heads = _positive_int(config, "num_attention_heads", path)
    hidden = _positive_int(config, "hidden_size", path)
    groups = config.get("num_key_value_heads") or heads
    if not isinstance(groups, int) or groups < 1 or heads % groups:
        raise ValueError(f"{path}: num_attention_heads({heads}) must be a multiple of "
                         f"num_key_value_heads({groups})")
    head_dim = config.get("head_dim") or hidden // heads
    if not isinstance(head_dim, int) or head_dim < 1 or ("head_dim" not in config
                                                          and hidden % heads):
        raise ValueError(f"{path}: head_dim={head_dim!r} must be a positive integer (or "
                         f"num_attention_heads({heads}) must divide hidden_size({hidden}))")
    eps = config.get("rms_norm_eps")
    if not isinstance(eps, float) or eps <= 0:
        raise ValueError(f"{path}: rms_norm_eps={eps!r} must be a positive float")
    rotary_base, scaling = _rope(config, path)
    tie = bool(config.get("tie_word_embeddings", False)) and head == "lm"
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    description = ModelDescription(
        num_layers=_positive_int(config, "num_hidden_layers", path), hidden_size=hidden,
        num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=_positive_int(config, "intermediate_size", path),
        vocab_size=_positive_int(config, "vocab_size", path),
        seq_length=_positive_int(config, "max_position_embeddings", path), head=head,
        tie_embeddings=tie, norm_epsilon=eps, rotary_base=rotary_base,
        params_dtype="bfloat16" if dtype == "bfloat16" else "float32",
        qkv_bias=family.qkv_bias, qk_norm=family.qk_norm, head_dim=head_dim,
        rope_scaling_factor=scaling)
    return description, config


def family_of(description: ModelDescription, model_type: str | None = None) -> HFFamily:
    """The family whose layers compute what ``description`` describes: ``model_type``'s (the
    original ``config.json``'s) when it does, else the first registered one that does.

    Raises:
        ValueError: no family has both a QKV bias and QK normalisation.
    """
    layers = (description.qkv_bias, description.qk_norm)
    preferred = FAMILIES.get(model_type) if model_type else None
    if preferred is not None and (preferred.qkv_bias, preferred.qk_norm) == layers:
        return preferred
    for family in FAMILIES.values():
        if (family.qkv_bias, family.qk_norm) == layers:
            return family
    raise ValueError(f"qkv_bias={description.qkv_bias} with qk_norm={description.qk_norm} is no "
                     f"Hugging Face family of {sorted(FAMILIES)}")


def _rope_fields(d: ModelDescription) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": float(d.rotary_base), "rope_type": "default"}
    if d.rope_scaling_factor:
        params |= {"rope_type": "llama3", "factor": d.rope_scaling_factor, **_LLAMA3_FIXED}
    return {"rope_theta": float(d.rotary_base), "rope_parameters": params,
            "rope_scaling": dict(params) if d.rope_scaling_factor else None}


def hf_config(description: ModelDescription,
              base_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` of the Hugging Face model equivalent to ``description``.

    Args:
        description: an ``lm`` or ``scalar`` model's description.
        base_config: an original ``config.json``; its other fields (token ids, ...) are kept.

    Raises:
        ValueError: the head is ``lm+scalar``, or the layers match no family.
    """
    d, family = description, family_of(description, (base_config or {}).get("model_type"))
    if d.head not in ("lm", "scalar"):
        raise ValueError(f"head={d.head!r}: only 'lm' (...ForCausalLM) and 'scalar' "
                         "(...ForSequenceClassification) models export")
    base = {k: v for k, v in (base_config or {}).items() if k != "torch_dtype"}
    if base.get("model_type") != family.model_type:  # another family's extra fields would lie
        base = {k: v for k, v in base.items() if k.endswith("token_id")}
    config = {**base, "model_type": family.model_type,
              "hidden_size": d.hidden_size, "intermediate_size": d.ffn_hidden_size,
              "num_hidden_layers": d.num_layers, "num_attention_heads": d.num_attention_heads,
              "num_key_value_heads": d.num_query_groups, "head_dim": d.head_dim,
              "vocab_size": d.vocab_size, "max_position_embeddings": d.seq_length,
              "rms_norm_eps": d.norm_epsilon, **_rope_fields(d),
              "tie_word_embeddings": d.tie_embeddings, "hidden_act": "silu",
              "dtype": d.params_dtype, **family.config_fields}
    if family.layer_types:
        config["layer_types"] = ["full_attention"] * d.num_layers
    if family.implicit_head_dim and d.head_dim * d.num_attention_heads == d.hidden_size:
        del config["head_dim"]  # e.g. Qwen2Config has no such field unless it differs
    if d.head == "lm":
        config["architectures"] = [family.causal_lm]
        return config
    return config | {"architectures": [family.classifier], "num_labels": 1,
                     "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
