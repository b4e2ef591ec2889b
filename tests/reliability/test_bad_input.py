"""Bad input is refused before any distributed work, with a message naming the problem and the
fix: contradictory checkpoint and fault settings, unknown placements, resuming with nothing to
resume from or with another model or tokenizer, a reward model trained with another tokenizer,
corrupted run state, empty or over-long prompts; and the exit status of tools/run_ppo.py says
which kind of failure ended a run."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_rlhf.builder.sources import resolve_sources
from megatron_rlhf.config.loader import load_config
from megatron_rlhf.config.ppo_run import CheckpointConfig, RunConfig
from megatron_rlhf.data.prompts import PromptStream
from megatron_rlhf.engine.run.build import check_checkpoint_tokenizers
from megatron_rlhf.engine.run.checkpointing import check_compatible, read_rl_state
from megatron_rlhf.engine.step.step_metrics import nonfinite_report
from megatron_rlhf.models.checkpoint import INFO_FILE, CheckpointInfo, ModelDescription
from megatron_rlhf.runtime import refusal
from megatron_rlhf.runtime.checkpoint_store import commit, hash_files
from megatron_rlhf.runtime.faults import FaultConfig, RankFailure
from megatron_rlhf.topology.models import ArchSpec
from tools import run_ppo as run_ppo_tool

TINY = "examples/ppo_tiny.yaml"


@pytest.mark.parametrize("overrides, message", [
    (["placement.strategy=bogus"], "placement.strategy='bogus' is unknown: choose one of"),
    (["checkpoint.save_interval=5"], "checkpoint.save_interval=5 needs a checkpoint.save_dir "
                                     "(--save-dir)"),
    (["checkpoint.resume=true"], "checkpoint.resume=latest (--resume) looks for the latest "
                                 "checkpoint in checkpoint.save_dir; set --save-dir"),
    (["checkpoint.keep_last=-1"], "checkpoint.keep_last=-1 must be >= 0 (0 keeps all)"),
    (["checkpoint.resume_from=/x/step_00000001", "checkpoint.resume_skip=[optim]"],
     "checkpoint.resume_skip has ['optim'], which are not pieces of a checkpoint; choose from "
     "['optimizer', "),
    (["checkpoint.resume_skip=[rng]"], "checkpoint.resume_skip=['rng'] applies to a resume, and "
                                       "this run starts fresh"),
    (["faults.on_nan=ignore"], "faults.on_nan='ignore': use one of ('skip', 'stop')"),
    (["faults.grace_s=-1"], "faults.grace_s=-1.0 must be >= 0"),
    (["placement.distributed_optimizer=false"],
     "placement.distributed_optimizer=false but actor_optimizer.distributed_optimizer=true: the "
     "actor's optimizer is built from the second and its memory is planned from the first"),
    (["placement.distributed_optimizer=false", "actor_optimizer.distributed_optimizer=false"],
     "placement.distributed_optimizer=false but critic_optimizer.distributed_optimizer=true"),
    (["placement.parallel.critic.distributed_optimizer=false"],
     "placement.parallel.critic.distributed_optimizer=false but "
     "critic_optimizer.distributed_optimizer=true"),
])
def test_contradictory_settings_name_the_field_and_the_fix(overrides: list[str],
                                                           message: str) -> None:
    with pytest.raises(ValueError) as error:
        load_config(RunConfig, TINY, overrides)
    assert message in str(error.value)


def test_an_empty_override_value_says_how_to_write_an_empty_string() -> None:
    with pytest.raises(ValueError) as error:
        load_config(RunConfig, TINY, ["models.reward_checkpoint="])
    assert "for an empty string write models.reward_checkpoint=''" in str(error.value)
    config = load_config(RunConfig, TINY, ["models.reward_checkpoint=''"])
    assert config.models.reward_checkpoint == ""


@pytest.mark.parametrize("override, message, empty", [
    ("prompts.paths=", "prompts.paths has no value; for an empty list write prompts.paths=[]",
     "prompts.paths=[]"),
    ("models.offload=", "models.offload has no value; for an empty mapping write "
     "models.offload={}", "models.offload={}"),
    ("steps=", "steps has no value; give one, e.g. steps=20", None),
])
def test_an_empty_override_says_how_to_write_an_empty_value_of_its_type(
        override: str, message: str, empty: str | None) -> None:
    with pytest.raises(ValueError) as error:
        load_config(RunConfig, TINY, [override])
    assert str(error.value) == f"override {override!r}: {message}"
    if empty is not None:
        load_config(RunConfig, TINY, [empty])


@pytest.mark.parametrize("override, message", [
    ("actor_optimizer.lr=-1", "actor_optimizer.lr=-1.0 must be positive"),
    ("critic_optimizer.min_lr=1", "critic_optimizer.min_lr=1.0 must be in [0, lr=0.001]"),
    ("critic_optimizer.lr_schedule=step", "critic_optimizer.lr_schedule='step' is not one of"),
])
def test_optimizer_refusals_name_the_section_the_user_wrote(override: str, message: str) -> None:
    with pytest.raises(ValueError) as error:
        load_config(RunConfig, TINY, [override])
    assert str(error.value).startswith(message)


def test_optimizer_settings_are_those_of_the_role_and_only_trained_roles_have_them() -> None:
    config = load_config(RunConfig, TINY, ["actor_optimizer.lr=0.5", "critic_optimizer.lr=0.25"])
    assert (config.optimizer("actor").lr, config.optimizer("critic").lr) == (0.5, 0.25)
    with pytest.raises(ValueError, match="'ref' is not trained"):
        config.optimizer("ref")


def _tool(argv: list[str], capsys: pytest.CaptureFixture) -> tuple[int, str]:
    code = run_ppo_tool.main(argv)
    return code, capsys.readouterr().err


def test_the_tool_exits_2_on_bad_input_before_distributed_work(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, err = _tool(["--resume"], capsys)
    assert code == 2 and "bad configuration: checkpoint.resume=latest (--resume)" in err
    code, err = _tool(["--resume", "--save-dir", str(tmp_path / "empty")], capsys)
    assert code == 2 and "--resume: no complete checkpoint in checkpoint.save_dir=" in err
    code, err = _tool(["rollout.max_prompt_length=2"], capsys)
    assert code == 2 and "prompts are longer than rollout.max_prompt_length=2 tokens" in err
    with pytest.raises(SystemExit) as error:
        run_ppo_tool.parse_args(["--placement", "sideways"])
    assert error.value.code == 2
    assert "invalid choice: 'sideways'" in capsys.readouterr().err


def test_a_fresh_run_leaves_another_runs_checkpoints_alone(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A second run into the same --save-dir, without --resume, used to prune the first run's
    later checkpoints at its first save; now it stops before any work and names the fixes."""
    save_dir = tmp_path / "ck"
    for step in (1, 2, 3):
        final = save_dir / f"step_{step:08d}"
        temp = save_dir / f"{final.name}.tmp-test"
        temp.mkdir(parents=True)
        (temp / "rl_state.json").write_text("{}")
        commit(temp, final, step, hash_files(temp, ["rl_state.json"]))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    code, err = _tool(["--steps", "1", "--save-dir", str(save_dir), "--save-interval", "1",
                       "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert f"checkpoint.save_dir={save_dir} holds 3 complete checkpoints" in err
    assert "continue that run with --resume (or --resume auto" in err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_an_unusable_save_dir_is_refused_before_the_first_step(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    code, err = _tool(["--save-dir", str(afile), "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2 and f"checkpoint.save_dir (--save-dir)={afile} is an existing file" in err
    code, err = _tool(["--save-dir", str(afile / "ck"), "--run-dir", str(tmp_path / "run")],
                      capsys)
    assert code == 2 and "checkpoint.save_dir (--save-dir)=" in err and "cannot be created" in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("argv, resume, overrides", [
    (["--resume"], "latest", []),
    (["--resume", "auto"], "auto", []),
    (["--resume", "steps=3"], "latest", ["steps=3"]),
    ([], None, []),
])
def test_resume_flag_forms(argv: list[str], resume: str | None, overrides: list[str]) -> None:
    _, parsed = run_ppo_tool.parse_args(argv)
    assert [o for o in parsed if o.startswith("checkpoint.resume")] == (
        [f"checkpoint.resume={resume}"] if resume else [])
    assert [o for o in parsed if not o.startswith("checkpoint.")] == overrides


def test_resume_flag_refuses_other_words(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as error:
        run_ppo_tool.parse_args(["--resume", "sometimes"])
    assert error.value.code == 2
    assert "argument --resume: 'sometimes' is not 'auto'" in capsys.readouterr().err


def test_the_tool_exits_1_when_a_rank_fails(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture) -> None:
    from megatron_rlhf.engine.run import runner

    def failing_run(config):
        raise RankFailure("rank 2 stopped in stage 'step 3' 31 s ago (pid 7 is gone)")

    monkeypatch.setattr(runner, "run_ppo", failing_run)
    code, err = _tool([], capsys)
    assert code == 1 and "rank 2 stopped in stage 'step 3'" in err


def test_empty_prompts_are_refused() -> None:
    with pytest.raises(ValueError, match="the prompt set is empty; check the data paths"):
        PromptStream([], batch_size=1, seed=0)
    with pytest.raises(ValueError, match=r"prompts \[1\] are empty after tokenisation; drop them"):
        PromptStream([[5, 6], [], [7]], batch_size=1, seed=0)
    with pytest.raises(ValueError, match=r"rollout.prompts_per_step\(4\) exceeds the 2 prompts"):
        PromptStream([[5], [6]], batch_size=4, seed=0)


def _rl_state(path: Path, config: RunConfig, fingerprint: str = "abc123") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    state = {"format_version": 1, "tokenizer_fingerprint": fingerprint,
             "config": json.loads(json.dumps(asdict(config)))}
    (path / "rl_state.json").write_text(json.dumps(state))
    return path


def test_resume_refuses_another_model_or_tokenizer_and_warns_of_other_changes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    saved = RunConfig()
    path = _rl_state(tmp_path / "step_00000004", saved)
    check_compatible(path, saved, "abc123")
    other_arch = replace(saved, models=replace(saved.models, arch="small"))
    with pytest.raises(ValueError, match="was saved with models.arch='tiny'; this run has "
                       "'small'. Resume with the checkpoint's value, or start a new run"):
        check_compatible(path, other_arch, "abc123")
    with pytest.raises(ValueError, match="trained with another tokenizer .*sha256 abc123, this "
                       "run's is def456"):
        check_compatible(path, saved, "def456")
    mapping = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 512,
               "seq_length": 128, "ffn_hidden_size": 256}
    given_as_mapping = replace(saved, models=replace(saved.models, arch=mapping))
    with pytest.raises(ValueError) as error:
        check_compatible(path, given_as_mapping, "abc123")
    assert "was saved with models.arch='tiny'; this run has {'num_layers': 2, " in str(error.value)
    assert "None" not in str(error.value)
    logger = logging.getLogger("megatron_rlhf.engine.run.checkpointing")
    logger.addHandler(caplog.handler)
    try:
        check_compatible(path, replace(saved, steps=99), "abc123")  # may change silently
        assert not caplog.records
        changed = replace(saved, rollout=replace(saved.rollout, ppo_epochs=3))
        check_compatible(path, changed, "abc123")
    finally:
        logger.removeHandler(caplog.handler)
    assert "rollout.ppo_epochs: 1 -> 3" in caplog.text


def test_corrupted_run_state_is_refused(tmp_path: Path) -> None:
    (tmp_path / "rl_state.json").write_text('{"format_version": 1')
    with pytest.raises(ValueError, match="rl_state.json cannot be read"):
        read_rl_state(tmp_path)
    (tmp_path / "rl_state.json").write_text('{"format_version": 7}')
    with pytest.raises(ValueError, match="not format_version=1; use the release that wrote it"):
        read_rl_state(tmp_path)


def _model_checkpoint(path: Path, fingerprint: str, role: str = "reward") -> Path:
    path.mkdir(parents=True)
    head = "scalar" if role == "reward" else "lm"
    arch = ArchSpec("t", 2, 64, 4, 512, 64, 128, gated_mlp=True)
    info = CheckpointInfo(model=ModelDescription(arch, head=head),
                          tp_size=1, pp_size=1,
                          metadata={"role": role, "tokenizer_fingerprint": fingerprint})
    (path / INFO_FILE).write_text(json.dumps(asdict(info)))
    return path


def test_a_reward_model_trained_with_another_tokenizer_is_refused(tmp_path: Path) -> None:
    reward = _model_checkpoint(tmp_path / "rm", "f" * 64)
    config = RunConfig()
    config.models.reward_checkpoint = str(reward)
    def ours(fingerprint: str, vocab_size: int = 512) -> SimpleNamespace:
        return SimpleNamespace(fingerprint=fingerprint, source="tok.model", vocab_size=vocab_size)

    with pytest.raises(ValueError, match=r"reward checkpoint .*rm was made with another "
                       r"tokenizer \(fingerprint ffffffffffff\.\.\., this run's tok.model is "
                       r"000000000000\.\.\.\); use the tokenizer saved with that checkpoint"):
        check_checkpoint_tokenizers(resolve_sources(config), ours("0" * 64))
    check_checkpoint_tokenizers(resolve_sources(config), ours("f" * 64))
    with pytest.raises(ValueError, match=r"reward checkpoint .*rm embeds 512 tokens but the "
                       r"tokenizer tok.model has 600; use the checkpoint's own tokenizer"):
        check_checkpoint_tokenizers(resolve_sources(config), ours("f" * 64, 600))
    config.models.reward_checkpoint = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="checkpoint directory .*missing does not exist"):
        resolve_sources(config)
    config.models.reward_checkpoint = str(_model_checkpoint(tmp_path / "bad", "f" * 64))
    (tmp_path / "bad" / INFO_FILE).write_text("{")
    with pytest.raises(ValueError, match="is not JSON .*; the checkpoint is corrupted"):
        resolve_sources(config)


def test_nonfinite_metrics_name_the_model_and_the_stage() -> None:
    sources = {"rm_scores": "reward", "values": "shadow_critic", "kl": "actor and ref"}
    nan = float("nan")
    assert nonfinite_report({"kl": 0.1, "actor/pg_loss": 0.2}, sources) == []
    assert nonfinite_report({"nonfinite/rm_scores": 3.0, "reward_mean": nan, "kl": nan},
                            sources) == ["3 NaN/Inf values in rm_scores (model 'reward', stage "
                                         "'experience')"]
    assert nonfinite_report({"actor/grad_norm": nan, "policy_loss": nan, "kl": float("inf")},
                            sources) == [
        "non-finite gradients (model 'actor', stage 'training')",
        "kl=inf (model 'actor and ref', stage 'experience')"]


def test_fault_config_defaults_stop_on_nan_and_check_consistency() -> None:
    config = FaultConfig()
    assert config.on_nan == "stop" and config.check_consistency
    assert CheckpointConfig().keep_last == 2


def _prompt_file(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": prompt}) + "\n" for prompt in prompts))
    return path


def _suggested(setting: str, message: str) -> int:
    match = re.search(rf"{re.escape(setting)}=(\d+)", message)
    assert match, f"{setting} not suggested in: {message}"
    return int(match.group(1))


def test_the_prompt_length_refusal_gives_values_that_work(tmp_path: Path) -> None:
    from megatron_rlhf.engine.run.runner import load_prompts
    from megatron_rlhf.models.tokenizer import load_tokenizer

    words = "the cat sat on the mat and looked at the dog".split()
    texts = [" ".join(words[:n]) for n in range(2, len(words) + 1)] * 4
    data = _prompt_file(tmp_path / "prompts.jsonl", texts)
    overrides = [f"prompts.paths=[{data}]", "prompts.split.sft=0", "prompts.split.rm=0",
                 "prompts.split.ppo=1", "rollout.prompts_per_step=4", "rollout.max_prompt_length=8"]
    config = load_config(RunConfig, TINY, overrides)
    tokenizer = load_tokenizer(config.tokenizer)
    with pytest.raises(ValueError) as error:
        load_prompts(config, tokenizer)
    message = str(error.value)
    assert "longer than rollout.max_prompt_length=8 tokens" in message
    assert "BOS and the chat template add up to 1)" in message
    reader_limit = _suggested("prompts.reader.max_prompt_tokens", message)
    assert reader_limit == 7
    kept = load_prompts(replace(config, prompts=replace(
        config.prompts, reader=replace(config.prompts.reader, max_prompt_tokens=reader_limit))),
        tokenizer)
    assert kept.prompts and max(map(len, kept.prompts)) <= 8
    longest = _suggested("rollout.max_prompt_length", message.split(";", 1)[1])
    widened = load_prompts(replace(config, rollout=replace(config.rollout,
                                                           max_prompt_length=longest)), tokenizer)
    assert len(widened.prompts) == len(texts)


def test_synthetic_prompts_too_long_are_not_sent_to_the_reader(
        capsys: pytest.CaptureFixture) -> None:
    code, err = _tool(["rollout.max_prompt_length=6"], capsys)
    assert code == 2 and "longer than rollout.max_prompt_length=6 tokens" in err
    assert "; set rollout.max_prompt_length=" in err and "prompts.reader" not in err


def test_too_few_prompts_names_the_ppo_share_of_the_split(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    data = _prompt_file(tmp_path / "prompts.jsonl", [f"prompt number {i}" for i in range(40)])
    code, err = _tool([f"prompts.paths=[{data}]", "prompts.split.sft=0.4", "prompts.split.rm=0.3",
                       "prompts.split.ppo=0.3"], capsys)
    assert code == 2
    assert re.search(r"rollout.prompts_per_step\(16\) exceeds the (\d+) prompts available "
                     r"\(PPO uses only the ppo share of prompts.paths, prompts.split.ppo=0.3: "
                     r"\1 of the 40 good records \(sft \d+, rm \d+, ppo \1\); raise "
                     r"prompts.split.ppo to use more of them\)", err), err


def test_a_ppo_run_on_a_prompt_file_uses_every_record_of_it(tmp_path: Path) -> None:
    """The InstructGPT split belongs to the chain's configs: a user's prompt file is PPO's."""
    from megatron_rlhf.engine.run.runner import load_prompts
    from megatron_rlhf.models.tokenizer import load_tokenizer

    data = _prompt_file(tmp_path / "prompts.jsonl", [f"prompt number {i}" for i in range(40)])
    config = load_config(RunConfig, TINY, [f"prompts.paths=[{data}]"])
    assert len(load_prompts(config, load_tokenizer(config.tokenizer)).prompts) == 40


def test_a_model_checkpoint_given_to_resume_points_to_models_actor_checkpoint(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    sft = _model_checkpoint(tmp_path / "sft" / "checkpoint", "f" * 64, role="actor")
    (sft / "manifest.json").write_text(json.dumps({"format_version": 1, "files": {}}))
    code, err = _tool([f"checkpoint.resume_from={sft}"], capsys)
    assert code == 2
    assert (f"checkpoint.resume_from={sft} is the checkpoint of one model (role 'actor'), not of "
            f"a PPO run, so there is no run to continue: start a new run from it with "
            f"models.actor_checkpoint={sft} and no checkpoint.resume_from") in err


def test_a_ppo_run_checkpoint_given_as_a_model_names_its_models(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    step = tmp_path / "ckpt" / "step_00000004"
    for role in ("actor", "critic"):
        _model_checkpoint(step / role, "f" * 64, role="actor")
    _rl_state(step, RunConfig())
    (step / "manifest.json").write_text(json.dumps({"format_version": 1, "files": {}}))
    code, err = _tool([f"models.actor_checkpoint={step}"], capsys)
    assert code == 2 and "unfinished" not in err and "did not finish" not in err
    assert (f"{step} is a checkpoint of a whole PPO run, not of one model: its models are in "
            f"['actor', 'critic']; name one of them (e.g. models.actor_checkpoint={step}/actor) "
            f"to start a new run from it, or continue that run with "
            f"checkpoint.resume_from={step}") in err


def test_the_memory_check_on_cpu_uses_this_machines_memory(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    host_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    code, err = _tool(["models.arch=llama-13b"], capsys)
    # 13.02e9 parameters: 18 bytes each fully sharded (218.2 GiB), or 6 with the optimizer on
    # the host (72.7 GiB), the least any placement of one device needs
    assert code == 2 and "actor needs ~72.7 GiB per device" in err
    assert "or weights and grads with the optimizer on the host" in err
    assert f"but pool 'local' has {round(host_gib, 1):g} GiB" in err


def test_a_refusal_is_said_by_rank_0_and_by_another_rank_only_after_the_grace(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """Under torchrun the grace is ended by the agent stopping the group once rank 0 exits
    (next test); a rank alone past it names itself."""
    monkeypatch.setattr(refusal, "REFUSAL_GRACE_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    code, err = _tool(["placement.strategy=bogus"], capsys)
    assert code == 2 and err.startswith("run_ppo: rank 1: bad configuration: placement.strategy")
    code, err = _tool(["rollout.max_prompt_length=2"], capsys)
    assert code == 2 and err.startswith("run_ppo: rank 1: ")
    monkeypatch.setenv("RANK", "0")
    code, err = _tool(["placement.strategy=bogus"], capsys)
    assert code == 2 and "run_ppo: bad configuration: placement.strategy='bogus'" in err


@pytest.mark.multirank
def test_under_torchrun_a_refusal_is_printed_once() -> None:
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", "tools/run_ppo.py",
                           "placement.strategy=bogus"],
                          cwd=repo, capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert done.stderr.count("run_ppo: bad configuration: placement.strategy='bogus'") == 1


@pytest.mark.parametrize("overrides, message", [
    (["steps=-1"], "steps=-1 must be >= 0 (0 only evaluates the initial policy)"),
    (["generation.max_new_tokens=0"],
     "generation.max_new_tokens=0 leaves PPO no response to score; give at least 1"),
    (["rollout.max_staleness=3"], "rollout.max_staleness=3 is used only with "
                                  "rollout.async_rollout=true; set that too, or drop max_staleness"),
    (["evaluation.paths=[/data/held_out.jsonl]"],
     "evaluation.paths=['/data/held_out.jsonl'] is read only when evaluation.num_prompts > 0, and "
     "it is 0 (evaluation off); set evaluation.num_prompts (e.g. 64), or drop evaluation.paths"),
    (["ptx.paths=[/data/sft.jsonl]"], "ptx.paths is used only by PPO-ptx, which ptx.coef=0 turns "
                                      "off; set ptx.coef > 0 (e.g. ptx.coef=0.5), or drop "
                                      "ptx.paths"),
    (["ptx.rows=4"], "ptx.rows is used only by PPO-ptx, which ptx.coef=0 turns off"),
])
def test_a_meaningless_or_ignored_setting_is_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError) as error:
        load_config(RunConfig, TINY, overrides)
    assert message in str(error.value)


def test_the_prompt_length_refusal_for_conversations_counts_the_template(tmp_path: Path) -> None:
    """A conversation's tokens for prompts.reader.max_prompt_tokens already hold the chat
    template (and its generation prompt): the hint says so, adds nothing for it, suggests a
    limit only when it keeps some prompts, and that limit keeps them."""
    from megatron_rlhf.engine.run.runner import load_prompts
    from megatron_rlhf.models.hf_tokenizer import HFTokenizer
    from tools.make_tiny_hf import make_hf_tokenizer

    make_hf_tokenizer(tmp_path / "tok", "qwen")
    words = "the cat sat on the mat and looked at the dog".split()
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": " ".join(words[:n])}]}) + "\n"
        for n in range(2, len(words) + 1)) * 2)
    config = load_config(RunConfig, TINY, [f"prompts.paths=[{data}]", "rollout.prompts_per_step=4",
                                           f"tokenizer.hf_dir={tmp_path / 'tok'}",
                                           "rollout.max_prompt_length=60"])
    tokenizer = HFTokenizer.load(tmp_path / "tok")
    with pytest.raises(ValueError) as error:
        load_prompts(config, tokenizer)
    message = str(error.value)
    assert ("it counts a conversation through the chat template, its generation prompt "
            "included; the rollout adds up to 0 more)") in message, message
    reader_limit = _suggested("prompts.reader.max_prompt_tokens", message)
    kept = load_prompts(replace(config, prompts=replace(
        config.prompts, reader=replace(config.prompts.reader, max_prompt_tokens=reader_limit))),
        tokenizer)
    assert 0 < len(kept.prompts) == int(re.search(r"keeps (\d+) of", message)[1])
    assert max(map(len, kept.prompts)) <= 60
    # with every conversation too long, a limit that would drop them all is not suggested
    config = replace(config, rollout=replace(config.rollout, max_prompt_length=20))
    with pytest.raises(ValueError) as error:
        load_prompts(config, tokenizer)
    assert "prompts.reader.max_prompt_tokens" not in str(error.value)
