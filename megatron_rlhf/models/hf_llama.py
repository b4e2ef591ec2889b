"""Hugging Face Llama / Qwen2 / Qwen3 / Qwen3-MoE / Mixtral tensors <-> megatron_rlhf full state,
and HF directories.

    description, config = read_hf_config("llama-hf")        # models/hf_config.py
    full_state = hf_to_full_state(load_hf_state("llama-hf"), description)
    load_full_state(model, pg_collection, full_state)          # then save_model_checkpoint
    ...
    hf_state = full_state_to_hf(gather_full_state(model, pg_collection), description)
    save_hf_checkpoint("llama-out", description, hf_state, base_config=config,
                       tokenizer_dir="llama-hf")

Tensors (HF ``model.layers.<i>.`` -> megatron ``decoder.layers.<i>.``, local layer spec names):

    self_attn.{q,k,v}_proj     self_attention.linear_qkv   per query group [its q heads; k; v]
                                                           (weight, and bias for Qwen2)
    self_attn.o_proj           self_attention.linear_proj
    self_attn.{q,k}_norm       self_attention.{q,k}_layernorm   (Qwen3)
    mlp.{gate,up}_proj         mlp.linear_fc1              [gate; up]
    mlp.down_proj              mlp.linear_fc2
    <moe>.gate                 mlp.router                  MoE: <moe> is mlp (Qwen3-MoE) or
    <moe>.experts.<e>.{gate,up} mlp.experts.local_experts.<e>.linear_fc1   block_sparse_moe
    <moe>.experts.<e>.down     mlp.experts.local_experts.<e>.linear_fc2   (Mixtral: w1, w3, w2)
    input_layernorm            input_layernorm             (1)
    post_attention_layernorm   pre_mlp_layernorm           (2)
    model.embed_tokens         embedding.word_embeddings
    model.norm                 decoder.final_layernorm
    lm_head                    output_layer                absent when embeddings are tied
    score                      output_layer                ...ForSequenceClassification (scalar)

In the dist checkpoint the norms carry megatron's fused-norm keys, shared with Transformer Engine
layers: (1) ``self_attention.linear_qkv.layer_norm_weight``, (2)
``mlp.linear_fc1.layer_norm_weight``.

Rotary embeddings need no permutation: HF rotates the two halves of each head (``rotate_half``),
which is megatron's ``rotary_interleaved=False`` (tests compare logits). Safetensors only
(pickled ``.bin`` files can run code). Experts are read and written one tensor each, as
``save_pretrained`` writes them (``transformers`` fuses them into 3-D tensors only in memory).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megatron_rlhf.models.description import ModelDescription
from megatron_rlhf.models.hf_config import CONFIG_FILE, HFExperts, family_of, hf_config
from megatron_rlhf.models.hf_tokenizer import TOKENIZER_FILES

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some older checkpoints carry
_INDEX = "model.safetensors.index.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")
_CHUNK = 1 << 24


def weight_files(hf_dir: str | Path) -> list[str]:
    """Names of the safetensors files of a checkpoint: ``model.safetensors`` or its index's shards.

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
    for name in names:
        if not (root / name).is_file():
            raise FileNotFoundError(f"{root / name} (listed in {_INDEX}) does not exist")
    return names


def check_weight_files(hf_dir: str | Path) -> list[str]:
    """:func:`weight_files`, each checked to be as long as its header says (reads the headers
    only, so a truncated download is named before any process group exists).

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: naming a file that is truncated or has no readable header.
    """
    names = weight_files(hf_dir)
    for name in names:
        path = Path(hf_dir) / name
        size = path.stat().st_size
        try:
            with open(path, "rb") as stream:
                (header_size,) = struct.unpack("<Q", stream.read(8))
                header = json.loads(stream.read(min(header_size, size)))
            ends = [entry["data_offsets"][1] for key, entry in header.items()
                    if key != "__metadata__"]
        except (struct.error, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
            raise ValueError(f"{path} is not a readable safetensors file (its header: {exc}); "
                             "download or save it again") from exc
        described = 8 + header_size + max(ends, default=0)
        if size != described:
            raise ValueError(f"{path} is truncated: it has {size} bytes, its header describes "
                             f"{described}; download or save it again")
    return names


def recorded_sha256(path: Path) -> tuple[str, str] | None:
    """The sha256 a download recorded for a file, and where it was recorded; None if none was.

    ``hf download --local-dir`` keeps the LFS etag (the file's sha256) as the second line of
    ``<dir>/.cache/huggingface/download/<name>.metadata``, trusted while the file is not newer
    than the record (as huggingface_hub does: a model saved over it again is not corrupt). A
    snapshot in the hub cache links to a blob named by its sha256.
    """
    metadata = path.parent / ".cache" / "huggingface" / "download" / f"{path.name}.metadata"
    if metadata.is_file():
        lines = metadata.read_text().splitlines()
        try:
            fresh = len(lines) >= 3 and path.stat().st_mtime - 1 <= float(lines[2])
        except ValueError:
            fresh = False
        if fresh and _SHA256.fullmatch(lines[1]):
            return lines[1], str(metadata)
    if path.is_symlink() and _SHA256.fullmatch(path.resolve().name):
        return path.resolve().name, f"the name of the hub cache's blob {path.resolve()}"
    return None


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        while chunk := stream.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _check_recorded_sha256(path: Path) -> None:
    recorded = recorded_sha256(path)
    if recorded is None:
        return
    expected, where = recorded
    actual = file_sha256(path)
    if actual != expected:
        raise ValueError(f"{path} has sha256 {actual[:12]}..., but its download recorded "
                         f"{expected[:12]}... ({where}): the file is corrupt; download it again")


def load_hf_state(hf_dir: str | Path) -> dict[str, torch.Tensor]:
    """Read every tensor of ``model.safetensors`` (or of the shards its index names), each file
    checked against the sha256 its download recorded, where it recorded one.

    Raises:
        FileNotFoundError: naming the missing file.
        ValueError: naming a file that is truncated, unreadable or differs from its recorded
            sha256.
    """
    state: dict[str, torch.Tensor] = {}
    for name in check_weight_files(hf_dir):
        path = Path(hf_dir) / name
        _check_recorded_sha256(path)
        try:
            state.update(load_file(path))
        except SafetensorError as exc:
            raise ValueError(f"{path} is not a readable safetensors file ({exc}); download or "
                             "save it again") from exc
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
                             f"counterpart, e.g. {left[:4]}: not a model of a supported family "
                             "(docs/models.md)")


def _dims(d: ModelDescription) -> tuple[int, int, int, int, int]:
    """(hidden, ffn, query groups, head dim, query rows per group) of a Llama-family model."""
    a = d.arch
    q_rows = a.num_attention_heads // a.num_query_groups * a.head_dim
    return a.hidden_size, a.ffn_hidden_size, a.num_query_groups, a.head_dim, q_rows


def _check_head(description: ModelDescription) -> None:
    if description.head not in ("lm", "scalar"):
        raise ValueError(f"head={description.head!r}: only 'lm' (...ForCausalLM) and 'scalar' "
                         "(...ForSequenceClassification) models convert")


def _layer_pairs(d: ModelDescription, i: int) -> list[tuple[str, str, tuple[int, ...]]]:
    """(HF name, megatron name, shape) of layer ``i``'s tensors that map one to one."""
    h, f, groups, head_dim, q_rows = _dims(d)
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    pairs = [(hf + "self_attn.o_proj.weight", mg + "self_attention.linear_proj.weight",
              (h, groups * q_rows)),
             (hf + "input_layernorm.weight", mg + "input_layernorm.weight", (h,)),
             (hf + "post_attention_layernorm.weight", mg + "pre_mlp_layernorm.weight", (h,))]
    if d.arch.qk_norm:
        pairs += [(hf + f"self_attn.{x}_norm.weight", mg + f"self_attention.{x}_layernorm.weight",
                   (head_dim,)) for x in "qk"]
    experts = _experts(d)
    if experts is None:
        return [*pairs, (hf + "mlp.down_proj.weight", mg + "mlp.linear_fc2.weight", (h, f))]
    block, ours = f"{hf}{experts.block}.", d.arch.experts
    pairs.append((block + "gate.weight", mg + "mlp.router.weight", (ours.num_experts, h)))
    return pairs + [(f"{block}experts.{e}.{experts.down}.weight",
                     f"{mg}mlp.experts.local_experts.{e}.linear_fc2.weight",
                     (h, ours.ffn_hidden_size)) for e in range(ours.num_experts)]


def _experts(d: ModelDescription) -> HFExperts | None:
    return family_of(d).experts if d.arch.experts else None


def _glu_pairs(d: ModelDescription, i: int) -> list[tuple[str, str, str, int]]:
    """(HF gate, HF up, megatron ``linear_fc1`` = [gate; up], width) of layer ``i``'s SwiGLU
    MLPs: the dense one, or every expert's."""
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}.mlp."
    experts = _experts(d)
    if experts is None:
        return [(hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight",
                 mg + "linear_fc1.weight", d.arch.ffn_hidden_size)]
    block = f"{hf}{experts.block}.experts."
    ours = d.arch.experts
    return [(f"{block}{e}.{experts.gate}.weight", f"{block}{e}.{experts.up}.weight",
             f"{mg}experts.local_experts.{e}.linear_fc1.weight", ours.ffn_hidden_size)
            for e in range(ours.num_experts)]


def _top_pairs(d: ModelDescription) -> list[tuple[str, str, tuple[int, ...]]]:
    pairs = [("model.embed_tokens.weight", "embedding.word_embeddings.weight",
              (d.arch.vocab_size, d.arch.hidden_size)),
             ("model.norm.weight", "decoder.final_layernorm.weight", (d.arch.hidden_size,))]
    if d.head == "scalar":
        pairs.append(("score.weight", "output_layer.weight", (1, d.arch.hidden_size)))
    elif not d.tie_embeddings:
        pairs.append(("lm_head.weight", "output_layer.weight",
                      (d.arch.vocab_size, d.arch.hidden_size)))
    return pairs


def _qkv_to_megatron(tensors: _Tensors, d: ModelDescription, prefix: str,
                     kind: str) -> torch.Tensor:
    """[q; k; v] of one layer (``kind`` weight or bias), regrouped per query group."""
    h, _, groups, head_dim, q_rows = _dims(d)
    cols = (h,) if kind == "weight" else ()
    rows_of = {"q": q_rows, "k": head_dim, "v": head_dim}
    parts = [tensors.take(f"{prefix}self_attn.{x}_proj.{kind}", groups * rows, *cols)
             .reshape(groups, rows, *cols) for x, rows in rows_of.items()]
    return torch.cat(parts, dim=1).reshape(-1, *cols)


def _qkv_to_hf(qkv: torch.Tensor, d: ModelDescription, prefix: str,
               kind: str) -> dict[str, torch.Tensor]:
    _, _, groups, head_dim, q_rows = _dims(d)
    parts = qkv.reshape(groups, q_rows + 2 * head_dim, *qkv.shape[1:]).split(
        [q_rows, head_dim, head_dim], dim=1)
    return {f"{prefix}self_attn.{x}_proj.{kind}": part.reshape(-1, *qkv.shape[1:])
            for x, part in zip("qkv", parts, strict=True)}


def _qkv_kinds(d: ModelDescription) -> tuple[str, ...]:
    return ("weight", "bias") if d.arch.qkv_bias else ("weight",)


def hf_to_full_state(hf_state: dict[str, torch.Tensor], description: ModelDescription,
                     source: str = "the Hugging Face checkpoint") -> dict[str, torch.Tensor]:
    """Map HF tensors of a registered family to a full state (megatron names, TP=1/PP=1
    layout; experts by their global index).

    Raises:
        ValueError: a tensor is missing, has the wrong shape, or has no megatron counterpart.
    """
    _check_head(description)
    d, tensors = description, _Tensors(hf_state, source)
    h = d.arch.hidden_size
    full = {mg: tensors.take(hf, *shape) for hf, mg, shape in _top_pairs(d)}
    for i in range(d.arch.num_layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in _qkv_kinds(d):
            full[mg + f"self_attention.linear_qkv.{kind}"] = _qkv_to_megatron(tensors, d, hf, kind)
        for gate, up, fc1, width in _glu_pairs(d, i):
            full[fc1] = torch.cat([tensors.take(gate, width, h), tensors.take(up, width, h)])
        full |= {m: tensors.take(name, *shape) for name, m, shape in _layer_pairs(d, i)}
    if d.head == "lm" and d.tie_embeddings and "lm_head.weight" in hf_state:
        tensors.take("lm_head.weight", d.arch.vocab_size, h)  # a tied copy: the embedding is it
    tensors.check_all_used()
    return full


def full_state_to_hf(full_state: dict[str, torch.Tensor],
                     description: ModelDescription) -> dict[str, torch.Tensor]:
    """Map a full state (as ``gather_full_state`` returns it) to HF tensors of the first
    registered family that computes ``description`` (``hf_config.family_of``).

    Raises:
        ValueError: the head does not convert, or a tensor is missing or misshapen.
    """
    _check_head(description)
    d, tensors = description, _Tensors(full_state, "the megatron full state")
    h, _, groups, head_dim, q_rows = _dims(d)
    hf = {name: tensors.take(mg, *shape) for name, mg, shape in _top_pairs(d)}
    for i in range(d.arch.num_layers):
        out, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for kind in _qkv_kinds(d):
            cols = (h,) if kind == "weight" else ()
            qkv = tensors.take(mg + f"self_attention.linear_qkv.{kind}",
                               groups * (q_rows + 2 * head_dim), *cols)
            hf |= _qkv_to_hf(qkv, d, out, kind)
        for gate, up, fc1, width in _glu_pairs(d, i):
            hf[gate], hf[up] = tensors.take(fc1, 2 * width, h).chunk(2)
        hf |= {name: tensors.take(m, *shape) for name, m, shape in _layer_pairs(d, i)}
    tensors.check_all_used()
    return hf


def save_hf_checkpoint(out_dir: str | Path, description: ModelDescription,
                       hf_state: dict[str, torch.Tensor],
                       base_config: dict[str, Any] | None = None,
                       tokenizer_dir: str | Path | None = None) -> None:
    """Write ``config.json`` and ``model.safetensors`` (in ``description.params_dtype``).

    Args:
        out_dir: the directory to create or fill.
        description: the model the tensors belong to.
        hf_state: HF tensors, as :func:`full_state_to_hf` returns them.
        base_config: the source ``config.json``; its non-architecture fields are kept.
        tokenizer_dir: a directory whose tokenizer files (and ``generation_config.json``) are
            copied next to the model, so that ``from_pretrained`` finds the tokenizer too.

    Raises:
        FileExistsError: ``out_dir`` already holds a model.
    """
    out = Path(out_dir)
    if (out / "model.safetensors").exists() or (out / _INDEX).exists():
        raise FileExistsError(f"{out} already holds a model; choose an empty directory")
    config = hf_config(description, base_config)
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES if tokenizer_dir is not None else ():
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    dtype = getattr(torch, description.params_dtype)
    save_file({name: t.to(dtype).contiguous() for name, t in hf_state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
