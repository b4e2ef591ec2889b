"""Hugging Face Llama / Llama-3 / Qwen2 / Qwen3 (LM and sequence-classification) <-> megatron:
converted models give transformers' outputs at TP=1 (one process), TP=2 and PP=2 (two ranks);
HF -> megatron checkpoint -> HF gives identical tensors; malformed inputs give errors that name the
problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.models import assert_hf_mapping_round_trips, full_logits
from tests.model_fixtures import whole_world_groups
from tests.multirank import run_on_ranks
from tools.make_tiny_hf import make_hf_model

_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}
_SIZES = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
          "rms_norm_eps": 1e-6, "initializer_range": 0.1, "pad_token_id": 0}
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
# name -> (config class, model class, config fields beyond _SIZES)
_CASES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 50000.0}),
    "llama3-tied": ("LlamaConfig", "LlamaForCausalLM",
                    {"rope_parameters": _LLAMA3_ROPE, "tie_word_embeddings": True}),
    "qwen2-tied": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 24, "rope_theta": 1000000.0}),
    "llama-rm": ("LlamaConfig", "LlamaForSequenceClassification", {"num_labels": 1}),
    "qwen2-rm": ("Qwen2Config", "Qwen2ForSequenceClassification", {"num_labels": 1}),
}


def _make_hf_model(directory: Path, case: str) -> torch.Tensor:
    """Save a random tiny model of ``case`` to ``directory``; return its outputs on ``_batch()``
    (logits ``[b, s, vocab]``, or the score of every position ``[b, s, 1]`` for a classifier)."""
    config_cls, model_cls, extra = _CASES[case]
    model = make_hf_model(directory, config_cls, model_cls, len(case), **_SIZES, **extra)
    with torch.no_grad():
        if hasattr(model, "score"):
            hidden = model.model(input_ids=_batch()["input_ids"]).last_hidden_state
            return model.score(hidden).float()
        return model(input_ids=_batch()["input_ids"]).logits.float()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _check_logits(checkpoint: str, layouts: list[tuple[int, int]],
                  expected: torch.Tensor) -> None:
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.models.gpt import build_gpt_model

    description = read_checkpoint_info(checkpoint).model
    for tp, pp in layouts:
        pgc = whole_world_groups(tp, pp)
        model = build_gpt_model(description.arch, description.build_options(), pgc)
        load_model_checkpoint(model, pgc, checkpoint)
        logits = full_logits(model, pgc, _batch())
        if logits is not None:
            torch.testing.assert_close(logits, expected, **_TOLERANCE,
                                       msg=lambda m, n=f"{checkpoint} tp{tp} pp{pp}": f"{n}: {m}")


def _convert_check_export(hf_dir: str, logits: torch.Tensor, out: str, convert_at: list[str],
                          layouts: list[tuple[int, int]], export_at: list[str]) -> None:
    from tools import convert_hf_to_megatron, convert_megatron_to_hf

    convert_hf_to_megatron.main(["--hf-dir", hf_dir, "--out", f"{out}/ckpt", *convert_at])
    _check_logits(f"{out}/ckpt", layouts, logits)
    convert_megatron_to_hf.main(["--ckpt", f"{out}/ckpt", "--out", f"{out}/hf", *export_at])


def _single_process_job(cases: list[tuple[str, torch.Tensor, str]]) -> None:
    for hf_dir, logits, out in cases:
        _convert_check_export(hf_dir, logits, out, [], [(1, 1)], [])
    _check_ac_share_from_tied(*next(c for c in cases if c[0].endswith("llama3-tied")))


def _check_ac_share_from_tied(hf_dir: str, logits: torch.Tensor, _out: str) -> None:
    """An AC-Share actor (untied LM head + value head) started from a tied HF model gives its
    logits: the LM head starts as the embedding, the value head keeps its initialisation."""
    from dataclasses import replace

    from megatron_rlhf.models.gpt import build_gpt_model
    from megatron_rlhf.models.hf_config import read_hf_config
    from megatron_rlhf.models.hf_llama import hf_to_full_state, load_hf_state
    from megatron_rlhf.models.weights import load_full_state

    description, _ = read_hf_config(hf_dir)
    pgc = whole_world_groups(1, 1)
    options = replace(description.build_options(), head="lm+scalar", tie_embeddings=False)
    model = build_gpt_model(description.arch, options, pgc)
    load_full_state(model, pgc, hf_to_full_state(load_hf_state(hf_dir), description),
                    new_head=True)
    output = full_logits(model, pgc, _batch())
    torch.testing.assert_close(output[..., :-1], logits, **_TOLERANCE)


def _two_rank_job(cases: list[tuple[str, torch.Tensor, str]]) -> None:
    # Saved at TP=2 and read at PP=2 or the reverse, so that both reshardings are exercised; a
    # tied embedding split over two stages has its own copy on the last stage.
    for index, (hf_dir, logits, out) in enumerate(cases):
        convert_at, export_at = (["--tp", "2"], ["--pp", "2"]) if index % 2 else (["--pp", "2"],
                                                                                  ["--tp", "2"])
        _convert_check_export(hf_dir, logits, out, convert_at, [(2, 1), (1, 2)], export_at)


def _assert_round_trip(hf_dir: Path, out: Path) -> None:
    import transformers

    original, exported = load_file(hf_dir / "model.safetensors"), load_file(
        out / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    before = transformers.AutoConfig.from_pretrained(hf_dir)
    after = transformers.AutoConfig.from_pretrained(out / "hf")
    for field in ("architectures", "hidden_size", "num_key_value_heads", "head_dim",
                  "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
                  "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters", "num_labels"):
        assert getattr(after, field, None) == getattr(before, field, None), field


def _cases(tmp_path: Path, names: list[str]) -> list[tuple[str, torch.Tensor, str]]:
    return [(str(tmp_path / f"hf_{name}"), _make_hf_model(tmp_path / f"hf_{name}", name),
             str(tmp_path / f"out_{name}")) for name in names]


@pytest.mark.multirank
def test_tp1_single_process_outputs_and_round_trip(tmp_path: Path) -> None:
    cases = _cases(tmp_path, list(_CASES))
    run_on_ranks(_single_process_job, world_size=1, args=(cases,), timeout_s=240)
    for hf_dir, _, out in cases:
        _assert_round_trip(Path(hf_dir), Path(out))


@pytest.mark.multirank
@pytest.mark.timeout(360)
def test_tp2_and_pp2_outputs_and_round_trip(tmp_path: Path) -> None:
    cases = _cases(tmp_path, ["llama", "llama3-tied", "qwen2-tied", "qwen3", "qwen2-rm"])
    run_on_ranks(_two_rank_job, world_size=2, args=(cases,), timeout_s=300)
    for hf_dir, _, out in cases:
        _assert_round_trip(Path(hf_dir), Path(out))


def test_mapping_is_exact_both_ways(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_config import read_hf_config
    from megatron_rlhf.models.hf_llama import hf_to_full_state, load_hf_state

    checked = {}
    for case in ("llama", "qwen2-tied", "qwen3", "llama-rm"):
        _make_hf_model(tmp_path / case, case)
        checked[case] = assert_hf_mapping_round_trips(tmp_path / case)
    # Qwen2, layer 1, query group 1 = [q heads 2, 3; k head 1; v head 1], 16 rows per head.
    description, hf_state, full = checked["qwen2-tied"]
    layer, qkv = "model.layers.1.self_attn.", "decoder.layers.1.self_attention.linear_qkv."
    torch.testing.assert_close(full[qkv + "weight"][64:96], hf_state[layer + "q_proj.weight"][32:])
    torch.testing.assert_close(full[qkv + "bias"][96:112], hf_state[layer + "k_proj.bias"][16:])
    assert description.arch.qkv_bias and description.tie_embeddings
    assert not description.arch.qk_norm
    qwen3, _ = read_hf_config(tmp_path / "qwen3")
    assert qwen3.arch.qk_norm and qwen3.arch.head_dim == 24
    assert qwen3.arch.rotary_base == 1000000
    reward, _ = read_hf_config(tmp_path / "llama-rm")
    assert reward.head == "scalar" and "output_layer.weight" in hf_to_full_state(
        load_hf_state(tmp_path / "llama-rm"), reward)


def _expect(error: type[Exception], *fragments: str):
    return pytest.raises(error, match=".*".join(fragments))


def test_unsupported_configs_are_refused_by_name(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_config import read_hf_config

    _make_hf_model(tmp_path, "llama")
    good = json.loads((tmp_path / "config.json").read_text())
    llama3 = {"rope_parameters": _LLAMA3_ROPE | {"high_freq_factor": 2.0}}
    for change, fragments in [
            ({"num_hidden_layers": "two"}, ("num_hidden_layers='two'",)),
            ({"model_type": "mistral"}, ("model_type='mistral'", "qwen3")),
            ({"architectures": ["LlamaModel"]}, ("LlamaModel", "LlamaForCausalLM")),
            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}},
             ("rope_type='yarn'",)),
            (llama3, ("high_freq_factor=2.0", "fixes it to 4.0")),
            ({"attention_bias": True}, ("attention_bias=True",)),
            ({"model_type": "qwen2", "architectures": None, "use_sliding_window": True},
             ("use_sliding_window=True",)),
            ({"architectures": ["LlamaForSequenceClassification"],
              "id2label": {"0": "a", "1": "b"}}, ("2 labels", "num_labels=1"))]:
        (tmp_path / "config.json").write_text(json.dumps(good | change))
        with _expect(ValueError, *fragments):
            read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with _expect(ValueError, "config.json is not JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").unlink()
    with _expect(FileNotFoundError, "config.json does not exist"):
        read_hf_config(tmp_path)


def test_missing_and_extra_tensors_are_named(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_config import read_hf_config
    from megatron_rlhf.models.hf_llama import hf_to_full_state, load_hf_state

    _make_hf_model(tmp_path, "qwen3")
    description, _ = read_hf_config(tmp_path)
    state = load_hf_state(tmp_path)
    del state["model.layers.1.self_attn.k_norm.weight"]
    with _expect(ValueError, "no tensor 'model.layers.1.self_attn.k_norm.weight'"):
        hf_to_full_state(state, description)
    state = load_hf_state(tmp_path) | {"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}
    with _expect(ValueError, "1 tensors with no megatron counterpart", "o_proj.bias"):
        hf_to_full_state(state, description)
    save_file({"extra.bias": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with _expect(ValueError, "no tensor 'model.embed_tokens.weight'"):
        hf_to_full_state(load_hf_state(tmp_path), description)
    (tmp_path / "model.safetensors").unlink()
    with _expect(FileNotFoundError, "neither model.safetensors", "safe_serialization=True"):
        load_hf_state(tmp_path)
