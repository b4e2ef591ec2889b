"""Hugging Face ``config.json`` <-> :class:`ModelDescription` for the Llama, Qwen and Mixtral
families: the mapping of the architecture record (``topology.models.ArchSpec``) to its fields,
:func:`read_hf_config` one way and :func:`hf_config` the other.

    description, config = read_hf_config("Qwen2.5-0.5B-Instruct")   # refuses what cannot convert
    hf_config(description, base_config=config)                       # the config.json to write

Supported (each maps onto megatron-core options, no layer of our own):

    model_type  architectures (...ForCausalLM, ...ForSequenceClassification)  differs by
    llama       Llama...                           Llama-3 ``rope_type: llama3`` (``rope_scaling``)
    qwen2       Qwen2...                           bias on q/k/v (``add_qkv_bias``)
    qwen3       Qwen3...                           per-head q/k RMSNorm (``qk_layernorm``)
    qwen3_moe   Qwen3Moe...                        Qwen3's, every MLP mixture-of-experts (MoE)
    mixtral     Mixtral...                         Llama's, every MLP mixture-of-experts

MoE layers are megatron's (``models/moe.py``): a softmax over every expert's router logit, the
top-k experts, their weights renormalised to sum to 1 (Mixtral; Qwen3-MoE with
``norm_topk_prob``) or not (``moe_router_pre_softmax``), no token dropping.

``...ForCausalLM`` becomes head ``lm``; ``...ForSequenceClassification`` with one label becomes head
``scalar`` (a reward model or critic). Refused, with the field named: other model types and
architectures, biases elsewhere, activations other than SiLU, sliding-window attention, RoPE
scalings other than Llama-3's with megatron's fixed frequency factors (1, 4) and original context
(8192), several labels; for MoE families dense layers among the MoE ones (``decoder_sparse_step``,
``mlp_only_layers``), router jitter, shared experts, Mixtral's sliding window.

A family is one ``register_hf_family(HFFamily(...))`` below: its names and how its layers and its
``config.json`` differ from Llama's, as data. ``FAMILIES`` is what converts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_rlhf.models.description import ModelDescription
from megatron_rlhf.models.hf_tokenizer import read_json_object
from megatron_rlhf.topology.models import ArchSpec, ExpertSpec

CONFIG_FILE = "config.json"
# megatron's Llama-3 RoPE scaling fixes these (RotaryEmbedding._apply_scaling); factor is free.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class HFExperts:
    """How a mixture-of-experts family names and configures its experts.

    Attributes:
        block: the MoE block under ``model.layers.<i>.`` (router ``<block>.gate``, experts
            ``<block>.experts.<e>.``).
        gate, up, down: an expert's SwiGLU projections.
        count: the ``config.json`` field of the number of experts (the other spelling of
            :data:`EXPERT_COUNT_FIELDS` is read too).
        width: the field of an expert's width.
        renormalize: the field that turns the top-k weights' renormalisation on; "" where the
            family always renormalises.
        required: fields that, where present, must hold the value given (with why).
    """

    block: str
    gate: str
    up: str
    down: str
    count: str
    width: str
    renormalize: str = ""
    required: Mapping[str, tuple[Any, str]] = field(default_factory=dict)


EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts")
_NO_SHARED = {"shared_expert_intermediate_size": (0, "no shared expert")}


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
        experts: every MLP is a mixture of experts, named and configured so; None: dense.
    """

    model_type: str
    causal_lm: str
    classifier: str
    qkv_bias: bool
    qk_norm: bool
    config_fields: Mapping[str, Any] = field(default_factory=dict)
    layer_types: bool = False
    implicit_head_dim: bool = False
    experts: HFExperts | None = None


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
_ALL_MOE = "every layer's MLP a mixture of experts"
register_hf_family(HFFamily(
    "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeForSequenceClassification", qkv_bias=False,
    qk_norm=True, config_fields={**_QWEN_FIELDS, "attention_bias": False,
                                 "decoder_sparse_step": 1, "mlp_only_layers": []},
    experts=HFExperts("mlp", "gate_proj", "up_proj", "down_proj", count="num_experts",
                      width="moe_intermediate_size", renormalize="norm_topk_prob",
                      required={"decoder_sparse_step": (1, _ALL_MOE),
                                "mlp_only_layers": ([], _ALL_MOE), **_NO_SHARED})))
register_hf_family(HFFamily(
    "mixtral", "MixtralForCausalLM", "MixtralForSequenceClassification", qkv_bias=False,
    qk_norm=False, config_fields={"sliding_window": None, "router_jitter_noise": 0.0},
    experts=HFExperts("block_sparse_moe", "w1", "w3", "w2", count="num_local_experts",
                      width="intermediate_size",
                      required={"router_jitter_noise": (0.0, "no router jitter"),
                                "sliding_window": (None, "full attention"), **_NO_SHARED})))


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


def _experts(config: dict[str, Any], family: HFFamily, source: Path) -> ExpertSpec | None:
    """The experts of a ``config.json`` (None for a dense family)."""
    experts = family.experts
    if experts is None:
        return None
    for key, (value, why) in experts.required.items():
        if config.get(key) not in (None, value):
            raise ValueError(f"{source}: {key}={config[key]!r} is not supported; need {value!r} "
                             f"({why})")
    count_key = next((k for k in (experts.count, *EXPERT_COUNT_FIELDS) if k in config),
                     experts.count)
    count = _positive_int(config, count_key, source)
    topk = _positive_int(config, "num_experts_per_tok", source)
    if topk > count:
        raise ValueError(f"{source}: num_experts_per_tok={topk} exceeds {count_key}={count}")
    renormalize = config.get(experts.renormalize, False) if experts.renormalize else True
    if not isinstance(renormalize, bool):
        raise ValueError(f"{source}: {experts.renormalize}={renormalize!r} must be true or false")
    return ExpertSpec(num_experts=count, topk=topk,
                      ffn_hidden_size=_positive_int(config, experts.width, source),
                      renormalize_topk=renormalize)


def read_hf_config(hf_dir: str | Path) -> tuple[ModelDescription, dict[str, Any]]:
    """Read and check ``config.json`` of a checkpoint of a registered family.

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
    arch = ArchSpec(
        "hf", num_layers=_positive_int(config, "num_hidden_layers", path),
        hidden_size=hidden, num_attention_heads=heads,
        vocab_size=_positive_int(config, "vocab_size", path),
        seq_length=_positive_int(config, "max_position_embeddings", path),
        ffn_hidden_size=_positive_int(config, "intermediate_size", path), gated_mlp=True,
        num_query_groups=groups, rotary_base=rotary_base, head_dim=head_dim,
        qk_norm=family.qk_norm, qkv_bias=family.qkv_bias, norm_epsilon=eps,
        rope_scaling_factor=scaling, experts=_experts(config, family, path))
    description = ModelDescription(arch, head=head, tie_embeddings=tie,
                                   params_dtype="bfloat16" if dtype == "bfloat16" else "float32")
    return description, config


def family_of(description: ModelDescription, model_type: str | None = None) -> HFFamily:
    """The family whose layers compute what ``description`` describes: ``model_type``'s (the
    original ``config.json``'s) when it does, else the first registered one that does.

    Raises:
        ValueError: no family computes it (a QKV bias with QK normalisation, experts with a QKV
            bias or a shared expert, top-k weights not renormalised without QK normalisation).
    """
    preferred = FAMILIES.get(model_type) if model_type else None
    if preferred is not None and _computes(preferred, description):
        return preferred
    for family in FAMILIES.values():
        if _computes(family, description):
            return family
    a = description.arch
    moe = (f", {a.experts.num_experts} experts (shared_ffn_size={a.experts.shared_ffn_size}, "
           f"renormalize_topk={a.experts.renormalize_topk})" if a.experts else "")
    raise ValueError(f"qkv_bias={a.qkv_bias} with qk_norm={a.qk_norm}{moe} is no Hugging Face "
                     f"family of {sorted(FAMILIES)}")


def _computes(family: HFFamily, d: ModelDescription) -> bool:
    a = d.arch
    if (family.qkv_bias, family.qk_norm) != (a.qkv_bias, a.qk_norm):
        return False
    if family.experts is None or a.experts is None:
        return family.experts is None and a.experts is None
    return not a.experts.shared_ffn_size and (a.experts.renormalize_topk
                                              or bool(family.experts.renormalize))


def _expert_fields(a: ArchSpec, experts: HFExperts | None) -> dict[str, Any]:
    if experts is None or a.experts is None:
        return {}
    fields = {experts.count: a.experts.num_experts, "num_experts_per_tok": a.experts.topk,
              experts.width: a.experts.ffn_hidden_size}
    if experts.renormalize:
        fields[experts.renormalize] = a.experts.renormalize_topk
    return fields


def _rope_fields(a: ArchSpec) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": float(a.rotary_base), "rope_type": "default"}
    if a.rope_scaling_factor:
        params |= {"rope_type": "llama3", "factor": a.rope_scaling_factor, **_LLAMA3_FIXED}
    return {"rope_theta": float(a.rotary_base), "rope_parameters": params,
            "rope_scaling": dict(params) if a.rope_scaling_factor else None}


def hf_config(description: ModelDescription,
              base_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` of the Hugging Face model equivalent to ``description``.

    Args:
        description: an ``lm`` or ``scalar`` model's description.
        base_config: an original ``config.json``; its other fields (token ids, ...) are kept.

    Raises:
        ValueError: the head is ``lm+scalar``, or the layers match no family.
    """
    d, a = description, description.arch
    if not a.gated_mlp:
        raise ValueError(f"arch {a.name!r}: gated_mlp=false; every Hugging Face family here has "
                         "SwiGLU MLPs")
    family = family_of(description, (base_config or {}).get("model_type"))
    if d.head not in ("lm", "scalar"):
        raise ValueError(f"head={d.head!r}: only 'lm' (...ForCausalLM) and 'scalar' "
                         "(...ForSequenceClassification) models export")
    base = {k: v for k, v in (base_config or {}).items() if k != "torch_dtype"}
    if base.get("model_type") != family.model_type:  # another family's extra fields would lie
        base = {k: v for k, v in base.items() if k.endswith("token_id")}
    base = {k: v for k, v in base.items() if k not in EXPERT_COUNT_FIELDS}  # one spelling
    config = {**base, "model_type": family.model_type,
              "hidden_size": a.hidden_size, "intermediate_size": a.ffn_hidden_size,
              "num_hidden_layers": a.num_layers, "num_attention_heads": a.num_attention_heads,
              "num_key_value_heads": a.num_query_groups, "head_dim": a.head_dim,
              "vocab_size": a.vocab_size, "max_position_embeddings": a.seq_length,
              "rms_norm_eps": a.norm_epsilon, **_rope_fields(a),
              "tie_word_embeddings": d.tie_embeddings, "hidden_act": "silu",
              "dtype": d.params_dtype, **family.config_fields,
              **_expert_fields(a, family.experts)}
    if family.layer_types:
        config["layer_types"] = ["full_attention"] * a.num_layers
    if family.implicit_head_dim and a.head_dim * a.num_attention_heads == a.hidden_size:
        del config["head_dim"]  # e.g. Qwen2Config has no such field unless it differs
    if d.head == "lm":
        config["architectures"] = [family.causal_lm]
        return config
    return config | {"architectures": [family.classifier], "num_labels": 1,
                     "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
