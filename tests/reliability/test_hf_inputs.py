"""Initial checkpoints that would train silently wrong are refused before any process group: a
reward model without a scalar head, a policy without an LM head, a Hugging Face directory without
its tokenizer, and safetensors files that are truncated or whose bytes differ from the checksum
their download recorded. One process, no process group."""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest
from safetensors.torch import load_file

from megatron_rlhf.builder.sources import fresh_heads, resolve_sources
from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.engine.run.build import check_checkpoint_tokenizers
from megatron_rlhf.engine.run.runner import run_tokenizer
from megatron_rlhf.models.checkpoint import INFO_FILE, CheckpointInfo, ModelDescription
from megatron_rlhf.models.hf_import import FULL_STATE_FILE, cached_full_state
from megatron_rlhf.models.hf_llama import load_hf_state
from megatron_rlhf.topology.models import ArchSpec
from tools.make_tiny_hf import make_tiny_qwen_pair

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ppo_hf_tiny.yaml"
EMPTY = "''"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Qwen2 policy and reward model (``...ForCausalLM``, ``...ForSequenceClassification``)."""
    actor, reward, _ = make_tiny_qwen_pair(tmp_path_factory.mktemp("hf"))
    return actor, reward


def _config(actor: Path | str = "", reward: Path | str = "", *overrides: str) -> RunConfig:
    return load_config(RunConfig, str(_EXAMPLE), [f"models.actor_checkpoint={actor or EMPTY}",
                                                  f"models.reward_checkpoint={reward or EMPTY}",
                                                  *overrides])


def _our_checkpoint(path: Path, head: str, role: str) -> Path:
    """A megatron_rlhf checkpoint's ``megatron_rlhf.json`` (all that resolving reads)."""
    path.mkdir(parents=True)
    arch = ArchSpec("t", 2, 64, 4, 320, 128, 128, gated_mlp=True, num_query_groups=2)
    info = CheckpointInfo(model=ModelDescription(arch, head=head),
                          tp_size=1, pp_size=1, metadata={"role": role})
    (path / INFO_FILE).write_text(json.dumps(asdict(info)))
    return path


def test_a_reward_model_without_a_scalar_head_is_refused(tiny: tuple[Path, Path],
                                                         tmp_path: Path) -> None:
    actor, reward = tiny
    with pytest.raises(ValueError, match=r"models.reward_checkpoint=.*qwen-policy is a "
                       r"Qwen2ForCausalLM checkpoint \(head 'lm'\); the reward model needs a "
                       r"trained scalar head: .*ForSequenceClassification .*num_labels=1"):
        resolve_sources(_config(actor, actor))
    sft = _our_checkpoint(tmp_path / "sft", "lm", "sft")
    with pytest.raises(ValueError, match=r"models.reward_checkpoint=.*sft is a megatron_rlhf "
                       r"'sft' checkpoint \(head 'lm'\); the reward model needs a trained scalar "
                       r"head: .*tools/train_reward_model.py"):
        resolve_sources(_config(actor, sft))
    with pytest.raises(ValueError, match=r"models.actor_checkpoint=.*qwen-rm is a "
                       r"Qwen2ForSequenceClassification checkpoint \(head 'scalar'\); the actor "
                       r"needs an LM head"):
        resolve_sources(_config(reward, reward))
    sources = resolve_sources(_config(actor, reward))
    assert sources["reward"].description.head == "scalar" and fresh_heads(_config(actor, reward),
                                                                          sources) == []


def test_a_value_head_started_on_the_sft_trunk_is_reported(tiny: tuple[Path, Path]) -> None:
    actor, _ = tiny
    config = _config(actor, "", "placement.ac_share=true", "reward.rule=synthetic",
                     "reward.model_weight=0")
    notes = fresh_heads(config, resolve_sources(config))
    assert len(notes) == 1
    assert notes[0].startswith(f"actor: the value head is new (drawn from models.init_seed="
                               f"{config.models.init_seed}); the rest comes from "
                               f"models.actor_checkpoint={actor}")


def _without_tokenizer(model: Path, bare: Path) -> Path:
    """A copy of the HF directory ``model`` with its weights and config only."""
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(model / name, bare / name)
    return bare


def test_a_hugging_face_directory_without_tokenizer_json_is_refused(tiny: tuple[Path, Path],
                                                                    tmp_path: Path) -> None:
    actor, reward = tiny
    bare = _without_tokenizer(actor, tmp_path / "bare")
    config = _config(bare, reward)
    with pytest.raises(FileNotFoundError, match=r"models.actor_checkpoint=.*bare has no "
                       r"tokenizer.json, so its token ids are unknown: write it with "
                       r"AutoTokenizer.from_pretrained\(<the model's hub name or directory>\)"
                       r".save_pretrained\('.*bare'\) \(transformers\) or Tokenizer.save\("
                       r"'.*bare/tokenizer.json'\) \(tokenizers\), or name the tokenizer with "
                       r"tokenizer.hf_dir"):
        run_tokenizer(config, resolve_sources(config))
    named = _config(bare, reward, f"tokenizer.hf_dir={actor}")
    assert run_tokenizer(named, resolve_sources(named)).vocab_size == 300


def test_a_reward_directory_without_tokenizer_json_is_warned_of(
        tiny: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    actor, reward = tiny
    bare = _without_tokenizer(reward, tmp_path / "bare-rm")
    config = _config(actor, bare)
    sources = resolve_sources(config)
    logger = logging.getLogger("megatron_rlhf.engine.run.build")
    logger.addHandler(caplog.handler)
    try:
        check_checkpoint_tokenizers(sources, run_tokenizer(config, sources))
    finally:
        logger.removeHandler(caplog.handler)
    assert f"reward checkpoint {bare} ships no tokenizer.json: nothing shows it was trained " \
        f"with this run's tokenizer {actor}" in caplog.text


def _flip_byte(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def _download_metadata(directory: Path, name: str, sha256: str) -> None:
    """What ``huggingface_hub`` (``hf download --local-dir``) records of a downloaded file."""
    from huggingface_hub._local_folder import write_download_metadata

    write_download_metadata(directory, name, "0" * 40, sha256)


def test_a_truncated_safetensors_file_is_named_before_any_process_group(
        tiny: tuple[Path, Path], tmp_path: Path) -> None:
    actor, reward = tiny
    cut = tmp_path / "cut"
    shutil.copytree(actor, cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    truncated = rf"{weights} is truncated: it has \d+ bytes, its header describes \d+; " \
        "download or save it again"
    with pytest.raises(ValueError, match=truncated):
        resolve_sources(_config(cut, reward))
    with pytest.raises(ValueError, match=truncated):
        load_hf_state(cut)
    shutil.copyfile(actor / "model.safetensors", weights)
    weights.write_bytes(weights.read_bytes().replace(b'"F32"', b'"F3X"', 1))
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file \("):
        load_hf_state(cut)


def test_a_flipped_byte_is_caught_by_the_downloads_checksum(tiny: tuple[Path, Path],
                                                            tmp_path: Path) -> None:
    import hashlib

    actor, _ = tiny
    flipped = tmp_path / "flipped"
    shutil.copytree(actor, flipped)
    weights = flipped / "model.safetensors"
    _download_metadata(flipped, "model.safetensors",
                       hashlib.sha256(weights.read_bytes()).hexdigest())
    cache = tmp_path / "cache"
    cached_full_state(flipped, cache)  # intact: converts
    mtime = weights.stat().st_mtime
    _flip_byte(weights, 10)  # a data byte: the header still parses
    os.utime(weights, (mtime, mtime))  # bit rot leaves the time; a newer save voids the record
    with pytest.raises(ValueError, match=rf"{weights} has sha256 [0-9a-f]{{12}}\.\.\., but its "
                       r"download recorded [0-9a-f]{12}\.\.\. \(.*model.safetensors.metadata\): "
                       r"the file is corrupt; download it again"):
        cached_full_state(flipped, cache)


def test_a_flipped_byte_is_caught_by_the_hub_caches_blob_name(tiny: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    import hashlib

    actor, _ = tiny
    weights = (actor / "model.safetensors").read_bytes()
    blob = tmp_path / "blobs" / hashlib.sha256(weights).hexdigest()
    blob.parent.mkdir()
    blob.write_bytes(weights)
    snapshot = tmp_path / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    shutil.copyfile(actor / "config.json", snapshot / "config.json")
    (snapshot / "model.safetensors").symlink_to(blob)
    load_hf_state(snapshot)
    _flip_byte(blob, 10)
    with pytest.raises(ValueError, match=r"model.safetensors has sha256 [0-9a-f]{12}\.\.\., but "
                       r"its download recorded [0-9a-f]{12}\.\.\. \(the name of the hub cache's "
                       r"blob .*blobs/[0-9a-f]{64}\): the file is corrupt; download it again"):
        load_hf_state(snapshot)


def test_a_corrupt_conversion_cache_entry_is_converted_again(
        tiny: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    actor, _ = tiny
    entry = cached_full_state(actor, tmp_path)
    original = {name: tensor.clone() for name, tensor in load_file(entry).items()}
    _flip_byte(entry, 10)
    logger = logging.getLogger("megatron_rlhf.models.hf_import")
    logger.addHandler(caplog.handler)
    try:
        assert cached_full_state(actor, tmp_path) == entry
    finally:
        logger.removeHandler(caplog.handler)
    assert "is corrupt (its sha256 differs from the one recorded when it was written); " \
        "converting again" in caplog.text
    again = load_file(entry)
    assert all((again[name] == tensor).all() for name, tensor in original.items())
    assert entry.name == FULL_STATE_FILE
