"""Hugging Face Llama <-> megatron: converted models give HF's logits at TP=1 (one process), TP=2
and PP=2 (two ranks); HF -> megatron checkpoint -> HF gives identical tensors; malformed inputs
give errors that name the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model_fixtures import whole_world_groups
from tests.models.test_checkpoint import full_logits
from tests.multirank import run_on_ranks

_TOLERANCE = {"rtol": 1e-4, "atol": 1e-4}


def _make_hf_model(directory: Path, tie: bool) -> torch.Tensor:
    """Save a random GQA LlamaForCausalLM to ``directory``; return its logits on ``_batch()``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=50000.0,
                         tie_word_embeddings=tie, initializer_range=0.1)
    torch.manual_seed(3 + tie)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # ones by default: make a swapped norm visible
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(directory, safe_serialization=True)
    with torch.no_grad():
        return model(input_ids=_batch()["input_ids"]).logits.float()


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _check_logits(checkpoint: str, layouts: list[tuple[int, int]],
                  expected: torch.Tensor) -> None:
    from megatron_rlhf.models.checkpoint import load_model_checkpoint, read_checkpoint_info
    from megatron_rlhf.models.gpt import build_gpt_model

    description = read_checkpoint_info(checkpoint).model
    for tp, pp in layouts:
        pgc = whole_world_groups(tp, pp)
        model = build_gpt_model(description, description.build_options(), pgc)
        load_model_checkpoint(model, pgc, checkpoint)
        logits = full_logits(model, pgc, _batch())
        if logits is not None:
            torch.testing.assert_close(logits, expected, **_TOLERANCE,
                                       msg=lambda m, n=f"tp{tp} pp{pp}": f"{n}: {m}")


def _convert_check_export(hf_dir: str, logits: torch.Tensor, out: str, convert_at: list[str],
                          layouts: list[tuple[int, int]], export_at: list[str]) -> None:
    from tools import convert_hf_to_megatron, convert_megatron_to_hf

    convert_hf_to_megatron.main(["--hf-dir", hf_dir, "--out", f"{out}/ckpt", *convert_at])
    _check_logits(f"{out}/ckpt", layouts, logits)
    convert_megatron_to_hf.main(["--ckpt", f"{out}/ckpt", "--out", f"{out}/hf", *export_at])


def _single_process_job(hf_dir: str, logits: torch.Tensor, out: str) -> None:
    _convert_check_export(hf_dir, logits, out, [], [(1, 1)], [])


def _two_rank_job(cases: list[tuple[str, torch.Tensor, str]]) -> None:
    (untied, untied_logits, untied_out), (tied, tied_logits, tied_out) = cases
    _convert_check_export(untied, untied_logits, untied_out, ["--tp", "2"], [(2, 1), (1, 2)],
                          ["--pp", "2"])
    # A tied embedding split over two stages: the last stage holds its own copy.
    _convert_check_export(tied, tied_logits, tied_out, ["--pp", "2"], [(2, 1), (1, 2)], [])


def _assert_round_trip(hf_dir: Path, out: Path) -> None:
    from transformers import LlamaConfig

    original, exported = load_file(hf_dir / "model.safetensors"), load_file(
        out / "hf" / "model.safetensors")
    assert exported.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    before, after = LlamaConfig.from_pretrained(hf_dir), LlamaConfig.from_pretrained(out / "hf")
    for field in ("hidden_size", "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings",
                  "max_position_embeddings", "bos_token_id", "eos_token_id", "rope_parameters"):
        assert getattr(after, field) == getattr(before, field), field
    info = json.loads((out / "ckpt" / "megatron_rlhf.json").read_text())
    assert info["model"]["rotary_base"] == 50000 and info["model"]["norm_epsilon"] == 1e-6


@pytest.mark.multirank
def test_tp1_single_process_logits_and_round_trip(tmp_path: Path) -> None:
    logits = _make_hf_model(tmp_path / "hf", tie=False)
    run_on_ranks(_single_process_job, world_size=1,
                 args=(str(tmp_path / "hf"), logits, str(tmp_path / "out")), timeout_s=120)
    _assert_round_trip(tmp_path / "hf", tmp_path / "out")


@pytest.mark.multirank
def test_tp2_and_pp2_logits_and_round_trip_with_tied_embeddings(tmp_path: Path) -> None:
    cases = [(str(tmp_path / f"hf_{kind}"), _make_hf_model(tmp_path / f"hf_{kind}", tie),
              str(tmp_path / f"out_{kind}")) for kind, tie in (("untied", False), ("tied", True))]
    run_on_ranks(_two_rank_job, world_size=2, args=(cases,), timeout_s=150)
    for hf_dir, _, out in cases:
        _assert_round_trip(Path(hf_dir), Path(out))


def test_mapping_is_exact_both_ways(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_llama import (
        full_state_to_hf,
        hf_to_full_state,
        load_hf_state,
        read_hf_config,
    )

    _make_hf_model(tmp_path, tie=False)
    description, _ = read_hf_config(tmp_path)
    hf_state = load_hf_state(tmp_path)
    full = hf_to_full_state(hf_state, description)
    qkv = full["decoder.layers.1.self_attention.linear_qkv.weight"]
    # Query group 1 = [q heads 2, 3; k head 1; v head 1], 16 rows per head.
    torch.testing.assert_close(qkv[64:96], hf_state["model.layers.1.self_attn.q_proj.weight"][32:])
    torch.testing.assert_close(qkv[96:112], hf_state["model.layers.1.self_attn.k_proj.weight"][16:])
    back = full_state_to_hf(full, description)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in hf_state.items())


def _expect(error: type[Exception], *fragments: str):
    return pytest.raises(error, match=".*".join(fragments))


def test_malformed_config_and_missing_tensors_are_named(tmp_path: Path) -> None:
    from megatron_rlhf.models.hf_llama import hf_to_full_state, load_hf_state, read_hf_config

    _make_hf_model(tmp_path, tie=False)
    good = json.loads((tmp_path / "config.json").read_text())
    for change, fragments in [({"num_hidden_layers": "two"}, ("num_hidden_layers='two'",)),
                              ({"model_type": "mistral"}, ("model_type='mistral'",)),
                              ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
                               ("rope_type='llama3'",)),
                              ({"attention_bias": True}, ("attention_bias=True",))]:
        (tmp_path / "config.json").write_text(json.dumps(good | change))
        with _expect(ValueError, *fragments):
            read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{oops")
    with _expect(ValueError, "config.json is not JSON"):
        read_hf_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(good))
    description, _ = read_hf_config(tmp_path)
    state = load_hf_state(tmp_path)
    del state["model.layers.1.mlp.up_proj.weight"]
    with _expect(ValueError, "no tensor 'model.layers.1.mlp.up_proj.weight'"):
        hf_to_full_state(state, description)
    save_file({"extra.bias": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with _expect(ValueError, "no tensor 'model.embed_tokens.weight'"):
        hf_to_full_state(load_hf_state(tmp_path), description)
    (tmp_path / "model.safetensors").unlink()
    with _expect(FileNotFoundError, "neither model.safetensors", "safe_serialization=True"):
        load_hf_state(tmp_path)
