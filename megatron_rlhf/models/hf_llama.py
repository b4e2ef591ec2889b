"""Hugging Face Llama (``LlamaForCausalLM``) <-> megatron_rlhf full state, and their configs.

    description, hf_config = read_hf_config("llama-hf")      # config.json -> ModelDescription
    full_state = hf_to_full_state(load_hf_state("llama-hf"), description)
    load_full_state(model, pg_collection, full_state)          # then save_model_checkpoint
    ...
    hf_state = full_state_to_hf(gather_full_state(model, pg_collection), description)
    save_hf_checkpoint("llama-out", description, hf_state, base_config=hf_config)

Tensors (HF ``model.layers.<i>.`` -> megatron ``decoder.layers.<i>.``, local layer spec names):

    self_attn.{q,k,v}_proj     self_attention.linear_qkv   per query group [its q heads; k; v]
    self_attn.o_proj           self_attention.linear_proj
    mlp.{gate,up}_proj         mlp.linear_fc1              [gate; up]
    mlp.down_proj              mlp.linear_fc2
    input_layernorm            input_layernorm             (1)
    post_attention_layernorm   pre_mlp_layernorm           (2)
    model.embed_tokens         embedding.word_embeddings
    model.norm                 decoder.final_layernorm
    lm_head                    output_layer                absent when embeddings are tied

In the dist checkpoint the norms carry megatron's fused-norm keys, shared with Transformer Engine
layers: (1) ``self_attention.linear_qkv.layer_norm_weight``, (2)
``mlp.linear_fc1.layer_norm_weight``.

Rotary embeddings need no permutation: HF Llama rotates the two halves of each head
(``rotate_half``), which is megatron's ``rotary_interleaved=False`` (tests compare logits).
Only ``head='lm'`` models convert; safetensors only (pickled ``.bin`` files can run code).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from megatron_rlhf.models.checkpoint import ModelDescription

_EXPECTED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints carry
_INDEX = "model.safetensors.index.json"


def _positive_int(config: dict[str, Any], key: str, source: Path) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{source}: {key}={value!r} must be a positive integer")
    return value


def _rope_theta(config: dict[str, Any], source: Path) -> int:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{source}: rope_parameters/rope_scaling={params!r} must be an object")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"{source}: rope_type={kind!r} (scaled RoPE) is not supported; only "
                         "default rotary embeddings convert")
    theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or theta <= 0 or float(theta) != int(theta):
        raise ValueError(f"{source}: rope_theta={theta!r} must be a positive whole number")
    return int(theta)


def read_hf_config(hf_dir: str | Path) -> tuple[ModelDescription, dict[str, Any]]:
    """Read and check ``config.json`` of a Hugging Face Llama checkpoint.

    Returns:
        The description of the equivalent ``lm`` model (float16 becomes float32) and the raw
        config (keep it to export token ids and other non-architecture fields back).

    Raises:
        FileNotFoundError: ``config.json`` does not exist.
        ValueError: naming the field that is malformed or describes an unsupported model.
    """
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pass the directory save_pretrained wrote")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(config, dict) or config.get("model_type") != "llama":
        found = config.get("model_type") if isinstance(config, dict) else config
        raise ValueError(f"{path}: model_type={found!r}; only 'llama' (LlamaForCausalLM) converts")
    for key, expected in _EXPECTED.items():
        if config.get(key, expected) != expected:
            raise ValueError(f"{path}: {key}={config[key]!r} is not supported; need {expected!r}")
    heads = _positive_int(config, "num_attention_heads", path)
    hidden = _positive_int(config, "hidden_size", path)
    groups = config.get("num_key_value_heads") or heads
    if hidden % heads or not isinstance(groups, int) or groups < 1 or heads % groups:
        raise ValueError(f"{path}: num_attention_heads({heads}) must divide hidden_size({hidden}) "
                         f"and be a multiple of num_key_value_heads({groups})")
    if config.get("head_dim", hidden // heads) != hidden // heads:
        raise ValueError(f"{path}: head_dim={config['head_dim']} is not hidden_size/"
                         f"num_attention_heads={hidden // heads}, which megatron_rlhf assumes")
    eps = config.get("rms_norm_eps")
    if not isinstance(eps, float) or eps <= 0:
        raise ValueError(f"{path}: rms_norm_eps={eps!r} must be a positive float")
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    description = ModelDescription(
        num_layers=_positive_int(config, "num_hidden_layers", path), hidden_size=hidden,
        num_attention_heads=heads, num_query_groups=groups,
        ffn_hidden_size=_positive_int(config, "intermediate_size", path),
        vocab_size=_positive_int(config, "vocab_size", path),
        seq_length=_positive_int(config, "max_position_embeddings", path), head="lm",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)), norm_epsilon=eps,
        rotary_base=_rope_theta(config, path),
        params_dtype="bfloat16" if dtype == "bfloat16" else "float32")
    return description, config


def load_hf_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of ``model.safetensors`` (or of the shards its index names).

    Raises:
        FileNotFoundError: naming the missing file.
    """
    root = Path(hf_dir)
    if (root / _INDEX).is_file():
        names = sorted(set(json.loads((root / _INDEX).read_text())["weight_map"].values()))
    elif (root / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{root} has neither model.safetensors nor {_INDEX}: save the "
                                "model with save_pretrained(..., safe_serialization=True)")
    state: dict[str, torch.Tensor] = {}
    for name in names:
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root / name} (listed in {_INDEX}) does not exist")
        state.update(load_file(root / name))
    return state


class _Tensors:
    """Hands out checkpoint tensors by name and shape, and remembers which were used."""

    def __init__(self, state: dict[str, torch.Tensor], source: str) -> None:
        self.state, self.source, self.used = state, source, set()

    def take(self, name: str, *shape: int) -> torch.Tensor:
        if name not in self.state:
            raise ValueError(f"{self.source} has no tensor {name!r} (shape {list(shape)}); the "
                             "checkpoint is incomplete or does not match config.json")
        tensor = self.state[name]
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{self.source}: {name} has shape {list(tensor.shape)}, the config "
                             f"implies {list(shape)}")
        self.used.add(name)
        return tensor

    def check_all_used(self) -> None:
        left = sorted(n for n in set(self.state) - self.used if not n.endswith(_IGNORED_SUFFIXES))
        if left:
            raise ValueError(f"{self.source} has {len(left)} tensors with no megatron "
                             f"counterpart, e.g. {left[:4]}: not a plain LlamaForCausalLM")


def _dims(d: ModelDescription) -> tuple[int, int, int, int, int]:
    """(hidden, ffn, query groups, head dim, query rows per group) of a Llama model."""
    head_dim = d.hidden_size // d.num_attention_heads
    q_rows = d.num_attention_heads // d.num_query_groups * head_dim
    return d.hidden_size, d.ffn_hidden_size, d.num_query_groups, head_dim, q_rows


def _check_lm(description: ModelDescription) -> None:
    if description.head != "lm":
        raise ValueError(f"head={description.head!r}: only LM-head models map to "
                         "LlamaForCausalLM")


def hf_to_full_state(hf_state: dict[str, torch.Tensor], description: ModelDescription,
                     source: str = "the Hugging Face checkpoint") -> dict[str, torch.Tensor]:
    """Map HF Llama tensors to a full state (megatron names, TP=1/PP=1 layout).

    Raises:
        ValueError: a tensor is missing, has the wrong shape, or has no megatron counterpart.
    """
    _check_lm(description)
    d, tensors = description, _Tensors(hf_state, source)
    h, f, groups, head_dim, q_rows = _dims(d)
    full = {"embedding.word_embeddings.weight": tensors.take("model.embed_tokens.weight",
                                                             d.vocab_size, h),
            "decoder.final_layernorm.weight": tensors.take("model.norm.weight", h)}
    for i in range(d.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        q = tensors.take(hf + "self_attn.q_proj.weight", groups * q_rows, h)
        k = tensors.take(hf + "self_attn.k_proj.weight", groups * head_dim, h)
        v = tensors.take(hf + "self_attn.v_proj.weight", groups * head_dim, h)
        qkv = [q.reshape(groups, q_rows, h), k.reshape(groups, head_dim, h),
               v.reshape(groups, head_dim, h)]
        full[mg + "self_attention.linear_qkv.weight"] = torch.cat(qkv, dim=1).reshape(-1, h)
        full[mg + "self_attention.linear_proj.weight"] = tensors.take(
            hf + "self_attn.o_proj.weight", h, groups * q_rows)
        full[mg + "mlp.linear_fc1.weight"] = torch.cat([
            tensors.take(hf + "mlp.gate_proj.weight", f, h),
            tensors.take(hf + "mlp.up_proj.weight", f, h)])
        full[mg + "mlp.linear_fc2.weight"] = tensors.take(hf + "mlp.down_proj.weight", h, f)
        full[mg + "input_layernorm.weight"] = tensors.take(hf + "input_layernorm.weight", h)
        full[mg + "pre_mlp_layernorm.weight"] = tensors.take(
            hf + "post_attention_layernorm.weight", h)
    if not d.tie_embeddings:
        full["output_layer.weight"] = tensors.take("lm_head.weight", d.vocab_size, h)
    elif "lm_head.weight" in hf_state:  # a tied copy; the embedding is the weight
        tensors.take("lm_head.weight", d.vocab_size, h)
    tensors.check_all_used()
    return full


def full_state_to_hf(full_state: dict[str, torch.Tensor],
                     description: ModelDescription) -> dict[str, torch.Tensor]:
    """Map a full state (as ``gather_full_state`` returns it) to HF Llama tensors.

    Raises:
        ValueError: the model has no LM head, or a tensor is missing or misshapen.
    """
    _check_lm(description)
    d, tensors = description, _Tensors(full_state, "the megatron full state")
    h, f, groups, head_dim, q_rows = _dims(d)
    hf = {"model.embed_tokens.weight": tensors.take("embedding.word_embeddings.weight",
                                                    d.vocab_size, h),
          "model.norm.weight": tensors.take("decoder.final_layernorm.weight", h)}
    for i in range(d.num_layers):
        out, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        qkv = tensors.take(mg + "self_attention.linear_qkv.weight",
                           groups * (q_rows + 2 * head_dim), h).reshape(groups, -1, h)
        q, k, v = qkv.split([q_rows, head_dim, head_dim], dim=1)
        hf[out + "self_attn.q_proj.weight"] = q.reshape(-1, h)
        hf[out + "self_attn.k_proj.weight"] = k.reshape(-1, h)
        hf[out + "self_attn.v_proj.weight"] = v.reshape(-1, h)
        hf[out + "self_attn.o_proj.weight"] = tensors.take(
            mg + "self_attention.linear_proj.weight", h, groups * q_rows)
        gate, up = tensors.take(mg + "mlp.linear_fc1.weight", 2 * f, h).chunk(2)
        hf[out + "mlp.gate_proj.weight"], hf[out + "mlp.up_proj.weight"] = gate, up
        hf[out + "mlp.down_proj.weight"] = tensors.take(mg + "mlp.linear_fc2.weight", h, f)
        hf[out + "input_layernorm.weight"] = tensors.take(mg + "input_layernorm.weight", h)
        hf[out + "post_attention_layernorm.weight"] = tensors.take(
            mg + "pre_mlp_layernorm.weight", h)
    if not d.tie_embeddings:
        hf["lm_head.weight"] = tensors.take("output_layer.weight", d.vocab_size, h)
    tensors.check_all_used()
    return hf


def hf_config(description: ModelDescription,
              base_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """``config.json`` of the HF Llama equivalent to ``description``.

    Args:
        description: an ``lm`` model's description.
        base_config: an original ``config.json``; its other fields (token ids, ...) are kept.
    """
    d = description
    base = {k: v for k, v in (base_config or {}).items() if k != "torch_dtype"}
    return {**base, "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": d.hidden_size, "intermediate_size": d.ffn_hidden_size,
            "num_hidden_layers": d.num_layers, "num_attention_heads": d.num_attention_heads,
            "num_key_value_heads": d.num_query_groups,
            "head_dim": d.hidden_size // d.num_attention_heads, "vocab_size": d.vocab_size,
            "max_position_embeddings": d.seq_length, "rms_norm_eps": d.norm_epsilon,
            "rope_theta": float(d.rotary_base),
            "rope_parameters": {"rope_theta": float(d.rotary_base), "rope_type": "default"},
            "tie_word_embeddings": d.tie_embeddings, "hidden_act": "silu",
            "attention_bias": False, "mlp_bias": False, "dtype": d.params_dtype}


def save_hf_checkpoint(out_dir: str | Path, description: ModelDescription,
                       hf_state: dict[str, torch.Tensor],
                       base_config: dict[str, Any] | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (in ``description.params_dtype``).

    Raises:
        FileExistsError: ``out_dir`` already holds a model.
    """
    out = Path(out_dir)
    if (out / "model.safetensors").exists() or (out / _INDEX).exists():
        raise FileExistsError(f"{out} already holds a model; choose an empty directory")
    out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, description.params_dtype)
    save_file({name: t.to(dtype).contiguous() for name, t in hf_state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(description, base_config)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
