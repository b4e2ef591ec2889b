"""The config loader's path rule: what a YAML names for the run to read is relative to that
YAML's folder (like ``base:``), an override's is relative to the working directory, and both
end absolute, so a run's saved config.yaml loads from anywhere."""

from __future__ import annotations

import re
from dataclasses import fields, is_dataclass
from functools import reduce
from pathlib import Path

import pytest

from megatron_rlhf.config.loader import load_config, to_yaml
from megatron_rlhf.config.ppo_run import RunConfig
from megatron_rlhf.config.supervised_run import SFTConfig

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _yaml(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_paths_a_yaml_reads_are_relative_to_its_folder(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    _yaml(tmp_path / "configs" / "base" / "common.yaml",
          f"base: {EXAMPLES / 'ppo_tiny.yaml'}\nevaluation:\n  paths: [held_out.jsonl]\n  num_prompts: 8\n")
    config_file = _yaml(tmp_path / "configs" / "run.yaml",
                        "base: base/common.yaml\nprompts:\n  paths: [data/train.jsonl, "
                        "/abs/other.jsonl]\nmodels:\n  actor_checkpoint: ../ckpt/sft\n"
                        "tokenizer:\n  model_path: ~/tok.model\nrun_dir: runs/mine\n")
    monkeypatch.chdir(tmp_path / "configs" / "base")  # anywhere but the YAML's folder
    config = load_config(RunConfig, config_file)
    assert config.prompts.paths == [str(tmp_path / "configs" / "data" / "train.jsonl"),
                                    "/abs/other.jsonl"]
    assert config.evaluation.paths == [str(tmp_path / "configs" / "base" / "held_out.jsonl")]
    assert config.models.actor_checkpoint == str(tmp_path / "ckpt" / "sft")
    assert config.tokenizer.model_path == "~/tok.model"
    assert config.run_dir == "runs/mine"  # what the run writes: where it is launched


def test_override_paths_are_relative_to_the_working_directory_and_saved_absolute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    config = load_config(RunConfig, EXAMPLES / "ppo_tiny.yaml",
                         ["prompts.paths=[data/train.jsonl]", "models.reward_checkpoint=rm",
                          "reward.model_weight=1", "models.actor_checkpoint=''"])
    assert config.prompts.paths == [str(tmp_path / "data" / "train.jsonl")]
    assert (config.models.reward_checkpoint, config.models.actor_checkpoint) == (
        str(tmp_path / "rm"), "")
    saved = _yaml(tmp_path / "run" / "config.yaml", to_yaml(config))
    assert load_config(RunConfig, saved).prompts.paths == config.prompts.paths


def test_supervised_configs_follow_the_same_rule(tmp_path: Path) -> None:
    config_file = _yaml(tmp_path / "sft.yaml", f"base: {EXAMPLES / 'sft_tiny.yaml'}\n"
                        "data:\n  paths: [train.jsonl]\n  eval_paths: [test.jsonl]\n")
    config = load_config(SFTConfig, config_file)
    assert (config.data.paths, config.data.eval_paths) == (
        [str(tmp_path / "train.jsonl")], [str(tmp_path / "test.jsonl")])


def test_every_path_field_is_either_read_or_written() -> None:
    for schema in (RunConfig, SFTConfig):
        written = {*schema.OUTPUT_PATHS, "checkpoint.save_dir"}  # save_dir empty: no saves
        fields = _leaf_names(schema())
        pathlike = {name for name in fields if name.endswith(
            ("path", "paths", "_dir", "checkpoint", "resume_from"))}
        assert pathlike - written == set(schema.INPUT_PATHS), schema.__name__


@pytest.mark.parametrize("schema, example", [(RunConfig, "ppo_tiny.yaml"),
                                             (SFTConfig, "sft_tiny.yaml")])
def test_an_empty_path_is_refused_naming_the_field(schema: type, example: str) -> None:
    """An empty directory would put the run's files into the working directory."""
    for key in schema.OUTPUT_PATHS:
        with pytest.raises(ValueError, match=rf"^{key}='' names no directory; give one"):
            load_config(schema, EXAMPLES / example, [f"{key}=''"])
    lists = "prompts.paths" if schema is RunConfig else "data.paths"
    with pytest.raises(ValueError, match=rf"^{lists}\[1\]='' names no file"):
        load_config(schema, EXAMPLES / example, [f"{lists}=[a.jsonl,'']"])


@pytest.mark.parametrize("schema, example, key", [
    (RunConfig, "ppo_tiny.yaml", "checkpoint.save_dir"),
    (RunConfig, "ppo_tiny.yaml", "models.actor_checkpoint"),
    (SFTConfig, "sft_tiny.yaml", "model.init_checkpoint")])
def test_a_blank_optional_path_is_refused_and_an_empty_one_means_none(
        schema: type, example: str, key: str) -> None:
    """Spaces would name a directory " " in the working directory; empty means none."""
    with pytest.raises(ValueError, match=rf"^{key}=' ' is blank: leave it empty"):
        load_config(schema, EXAMPLES / example, [f"{key}=' '"])
    config = load_config(schema, EXAMPLES / example, [f"{key}=''"])
    assert reduce(getattr, key.split("."), config) == ""


def test_a_bad_value_and_an_unknown_key_are_told_apart() -> None:
    with pytest.raises(ValueError, match=r"override 'rollout.ppo_epochs=two': invalid value for "
                                         r"key 'rollout.ppo_epochs': Value 'two'"):
        load_config(RunConfig, EXAMPLES / "ppo_tiny.yaml", ["rollout.ppo_epochs=two"])
    with pytest.raises(ValueError, match=r"override 'rollout.ppo_epoch=2': unknown config key "
                                         r"'rollout.ppo_epoch'"):
        load_config(RunConfig, EXAMPLES / "ppo_tiny.yaml", ["rollout.ppo_epoch=2"])


def test_a_missing_base_file_names_the_yaml_that_refers_to_it(tmp_path: Path) -> None:
    run = _yaml(tmp_path / "configs" / "run.yaml", "base: common.yaml\nsteps: 2\n")
    base = run.resolve().parent / "common.yaml"
    with pytest.raises(ValueError, match=re.escape(f"{run.resolve()}: base: common.yaml ({base}) "
                                                   "does not exist")):
        load_config(RunConfig, run)


def _leaf_names(config: object, prefix: str = "") -> list[str]:
    names = []
    for item in fields(config):
        value = getattr(config, item.name)
        if is_dataclass(value):
            names += _leaf_names(value, f"{prefix}{item.name}.")
        else:
            names.append(f"{prefix}{item.name}")
    return names


def test_plain_optimizer_settings_take_their_roles_section(tmp_path: Path) -> None:
    """Settings built in Python as a plain OptimizerSettings (one object for both roles) are
    refused under their role's name, and the run's YAML loads back."""
    from megatron_rlhf.models.trainer import OptimizerSettings

    shared = OptimizerSettings(lr=0.5)
    config = RunConfig(actor_optimizer=shared, critic_optimizer=shared)
    assert type(config.actor_optimizer).SECTION == "actor_optimizer"
    assert type(config.critic_optimizer).SECTION == "critic_optimizer"
    assert config.actor_optimizer is not config.critic_optimizer
    assert (config.actor_optimizer.lr, config.critic_optimizer.lr) == (0.5, 0.5)
    (tmp_path / "config.yaml").write_text(to_yaml(config))
    assert load_config(RunConfig, tmp_path / "config.yaml").actor_optimizer.lr == 0.5


BOOLEAN_WORDS = [("generation.cuda_graphs", {"off": "off", "no": "off", "on": "on",
                                             "yes": "on", "auto": "auto"}),
                 ("checkpoint.resume", {"off": "off", "no": "off", "on": "latest",
                                        "yes": "latest"})]
"""Each field that takes one of YAML's boolean words, and what each word gives it."""


@pytest.mark.parametrize(("key", "words"), BOOLEAN_WORDS)
def test_yamls_boolean_words_give_the_values_they_stand_for(tmp_path: Path, key: str,
                                                            words: dict[str, str]) -> None:
    """``generation.cuda_graphs=off``, the documented value, was refused ("'False' must be
    'auto' or 'off'"): YAML reads off as false, on the command line and in files."""
    section, name = key.split(".")
    extra = ["checkpoint.save_dir=ckpt"] if key == "checkpoint.resume" else []
    for word, value in words.items():
        from_override = load_config(RunConfig, None, [f"{key}={word}", *extra])
        path = _yaml(tmp_path / f"{word}.yaml", f"{section}:\n  {name}: {word}\n")
        from_file = load_config(RunConfig, path, extra)
        saved = _yaml(tmp_path / f"saved_{word}.yaml", to_yaml(from_file))
        assert {getattr(getattr(c, section), name) for c in (
            from_override, from_file, load_config(RunConfig, saved))} == {value}, word


def test_every_field_that_takes_a_boolean_word_lists_it() -> None:
    """An enum-like string field (it refuses a made-up value) that accepts off, on, yes or no
    must be in its schema's BOOLEAN_WORDS, or YAML's booleans reach it as 'False'/'True'."""
    from megatron_rlhf.config.supervised_run import RMConfig

    for schema in (RunConfig, SFTConfig, RMConfig):
        default = schema()
        taking = set()
        for key in _leaf_names(default):
            section, _, name = key.rpartition(".")
            owner = default
            for part in filter(None, section.split(".")):
                owner = getattr(owner, part)
            if not isinstance(getattr(owner, name), str):
                continue
            try:
                load_config(schema, None, [f"{key}=not_a_value_zz"])
                continue  # free text: a path, a name
            except ValueError:
                pass
            for word in ("off", "on", "yes", "no"):
                try:
                    load_config(schema, None, [f"{key}='{word}'", "checkpoint.save_dir=c"]
                                if schema is RunConfig else [f"{key}='{word}'"])
                    taking.add(key)
                except ValueError:
                    pass
        assert taking == set(getattr(schema, "BOOLEAN_WORDS", {})), schema.__name__
