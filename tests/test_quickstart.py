"""The quickstart's commands work as written, at tiny size.

Every command in a ``bash`` block of docs/quickstart.md is read from the page, not copied here.
Each runs in a scratch directory that links the repository's tools/, examples/ and scripts/
(so what the commands write lands there), with tiny-size flags added after the script's name
(fewer steps and prompts, 2 ranks; every other flag and override is the page's). The main command's
console is also checked: a set-up summary, progress bars and the report, no warnings and no log
records (those go to ``<run-dir>/log.txt``).

What runs: the main job, PPO on your own prompts from its models, making the tiny Hugging Face
directories, and GRPO. What is only parsed and configured, being run elsewhere: the main job under
another placement and on your own data file (the main command's entry point), and PPO from the
Hugging Face directories (tests/engine/test_hf_ppo.py runs that configuration).
``run_tests.sh`` is this suite.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.launch import REPO, tool_env

PAGE = REPO / "docs" / "quickstart.md"
RENDEZVOUS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "TORCHELASTIC_RUN_ID")
TINY = {
    "run_pipeline.py": (["--sft-steps", "2", "--rm-steps", "2", "--ppo-steps", "1"],
                        ["evaluation.num_prompts=16"]),
    "run_ppo.py": (["--steps", "1"], ["rollout.prompts_per_step=4", "rollout.ppo_epochs=1",
                                      "rollout.num_minibatches=1"]),
}
"""Per script: flags put right after its name, and overrides put after the page's own."""
NPROC = 2
"""Ranks of every command (the page's are 4 or 2; ``scripts/run_main.sh`` takes ``NPROC``):
tiny size, and half the start-up of 4 rank processes on a 2-core machine."""
RUN_S = 240
"""Budget of one command (the tests' timeouts allow for it: 270 s for one, 510 s for two)."""


def commands() -> dict[str, list[str]]:
    """Section heading -> the shell commands of its ``bash`` blocks (continuations joined)."""
    found: dict[str, list[str]] = {}
    section, in_block, pending = "", False, ""
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line[3:]
        elif line.startswith("```"):
            in_block = line == "```bash" and not in_block
        elif in_block:
            pending += line.strip()
            if pending.endswith("\\"):
                pending = pending[:-1]
            else:
                found.setdefault(section, []).append(pending)
                pending = ""
    return found


def argv(command: str, run_dir: Path | None = None) -> list[str]:
    """The command as an argv for this interpreter, tiny flags added; ``$RUN`` is ``run_dir``."""
    words = shlex.split(command.replace("$RUN", str(run_dir)), comments=True)
    if words[:2] == ["bash", "scripts/run_main.sh"]:
        words = ["torchrun", "--standalone", "--nproc-per-node", "4", "tools/run_pipeline.py",
                 "--run-dir", "runs/main", *words[2:]]
    if words[0] == "torchrun":
        words = [sys.executable, "-m", "torch.distributed.run", *words[1:]]
        words[words.index("--nproc-per-node") + 1] = str(NPROC)
    elif words[0] == "python":
        words = [sys.executable, *words[1:]]
    script = next((i for i, w in enumerate(words) if w.startswith("tools/")), None)
    flags, overrides = TINY.get(Path(words[script]).name, ([], [])) if script else ([], [])
    if script is not None:
        words[script + 1:script + 1] = flags
    return words + overrides


def script_args(command: str, script: str) -> list[str]:
    """What the command (tiny flags added) passes to ``tools/<script>``."""
    words = argv(command)
    return words[words.index(f"tools/{script}") + 1:]


def tool(name: str) -> ModuleType:
    """``tools/<name>.py`` as a module."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(REPO / "tools"))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quickstart")
    for name in ("tools", "examples", "scripts"):
        (root / name).symlink_to(REPO / name)
    return root


def run(command: str, cwd: Path, run_dir: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in tool_env().items() if k not in RENDEZVOUS}
    shell = command.startswith(("for ", "printf "))
    args = ["bash", "-c", command] if shell else argv(command, run_dir)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=RUN_S)


def succeeded(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{shlex.join(result.args)}\n{result.stderr[-4000:]}"


@pytest.fixture(scope="module")
def main_job(workdir: Path) -> subprocess.CompletedProcess:
    main = commands()["Two commands"][0]
    assert main.startswith("bash scripts/run_main.sh")
    result = run(main, workdir)
    succeeded(result)
    return result


@pytest.mark.timeout(270)
def test_the_main_command_ends_with_the_report(main_job: subprocess.CompletedProcess,
                                               workdir: Path) -> None:
    report = main_job.stdout
    for line in ("SFT: step 2,", "reward model: step 2,", "held-out prompts, rule score",
                 "PPO final (after 1 steps)", "reward hacking:", "wall clock: SFT"):
        assert line in report, report
    assert (workdir / "runs" / "main" / "curves.png").is_file()


@pytest.mark.timeout(270)
def test_the_main_console_is_summary_progress_bars_and_report(
        main_job: subprocess.CompletedProcess, workdir: Path) -> None:
    console = (main_job.stdout + main_job.stderr).replace("\r", "\n").splitlines()
    warnings = [line for line in console if "Warning" in line or "warnings.warn" in line]
    assert not warnings, "\n".join(warnings)
    records = [line for line in console if re.match(r"\[\d\d:\d\d:\d\d rank\d+ (INFO|DEBUG)", line)]
    assert not records, "\n".join(records[:10])
    assert console.count(f"run_pipeline: {NPROC} ranks, placement separation, seed 0") == 1
    for stage in ("sft:", "rm:", "ppo:"):
        assert any(line.startswith(stage) and "step" in line for line in console), stage
    log = (workdir / "runs" / "main" / "log.txt").read_text()
    assert "rank0 INFO megatron_rlhf.supervised.loop] sft: checkpoint written" in log
    assert "rank1 " not in log, "only rank 0 logs without --verbose"


@pytest.mark.timeout(510)
def test_ppo_on_your_own_prompts_from_the_main_job(main_job: subprocess.CompletedProcess,
                                                    workdir: Path) -> None:
    write_prompts, ppo = commands()["Your own data"][1:]
    succeeded(run(write_prompts, workdir))
    assert len((workdir / "my_prompts.jsonl").read_text().splitlines()) == 16
    succeeded(run(ppo + " evaluation.num_prompts=16", workdir, workdir / "runs" / "main"))
    metrics = (workdir / "runs" / "my_prompts" / "metrics.jsonl").read_text()
    assert '"step": 0' in metrics


@pytest.mark.timeout(270)
def test_your_own_hugging_face_model(workdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The directories are made as the page says and the PPO command configures a run from them;
    tests/engine/test_hf_ppo.py runs that configuration (examples/ppo_hf_tiny.yaml with these
    three overrides, TP=2 on 2 ranks) and checks what it exports."""
    from megatron_rlhf.config.loader import load_config
    from megatron_rlhf.config.ppo_run import RunConfig

    make, ppo = commands()["Your own Hugging Face model"]
    succeeded(run(make, workdir))
    monkeypatch.chdir(workdir)  # the command's paths are relative to where it runs
    args, overrides = tool("run_ppo").parse_args(script_args(ppo, "run_ppo.py"))
    config = load_config(RunConfig, args.config, overrides)
    made = workdir / "runs" / "hf-tiny"
    assert Path(config.models.actor_checkpoint) == made / "qwen-policy"
    assert Path(config.models.reward_checkpoint) == made / "qwen-rm"
    assert [Path(path) for path in config.prompts.paths] == [made / "prompts.jsonl"]
    assert all((made / name / "config.json").is_file() for name in ("qwen-policy", "qwen-rm"))
    assert config.placement.tp == 2 and config.models.export_hf


@pytest.mark.timeout(270)
def test_grpo(workdir: Path) -> None:
    (grpo,) = commands()["GRPO and the other critic-free algorithms"]
    succeeded(run(grpo, workdir))
    metrics = (workdir / "runs" / "ppo_tiny" / "metrics.jsonl").read_text()  # ppo_tiny.yaml's
    assert '"step": 0' in metrics and "critic/" not in metrics, "a critic-free run trains no critic"


def test_the_other_main_commands_parse() -> None:
    """The main job under another placement and on your own file: the same entry point as the
    main command, with flags its parser must accept."""
    (placement,) = commands()["Another placement"]
    data = commands()["Your own data"][0]
    parse_args = tool("run_pipeline").parse_args
    assert parse_args(script_args(placement, "run_pipeline.py")).placement == "interleaving"
    assert parse_args(script_args(data, "run_pipeline.py")).data == ["my_prefs.jsonl"]


def test_every_command_of_the_page_is_covered() -> None:
    """A command added to the quickstart needs a test here."""
    assert {section: len(found) for section, found in commands().items()} == {
        "Two commands": 2, "Another placement": 1, "Your own data": 3,
        "Your own Hugging Face model": 2, "GRPO and the other critic-free algorithms": 1}
    assert commands()["Two commands"][1].startswith("bash scripts/run_tests.sh")


def test_tiny_flags_go_before_the_pages_overrides() -> None:
    words = argv("torchrun --standalone --nproc-per-node 4 tools/run_ppo.py --algorithm grpo "
                 "rollout.samples_per_prompt=4")
    script = words.index("tools/run_ppo.py")
    assert words[script + 1:script + 3] == ["--steps", "1"]
    assert words[-4:] == ["rollout.samples_per_prompt=4", *TINY["run_ppo.py"][1]]
    assert os.path.basename(words[0]).startswith("python")
    assert words[words.index("--nproc-per-node") + 1] == str(NPROC)
