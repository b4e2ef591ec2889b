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
``run_tests.sh`` is this suite. The main command runs once per session (tests/conftest.py's
``quickstart_main_job``); tests/engine/test_pipeline.py checks the same run's chain further.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers.launch import REPO
from tests.helpers.quickstart import (
    NPROC,
    TINY,
    MainJob,
    argv,
    commands,
    run_page_command,
    succeeded,
)


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
def workdir(quickstart_workdir: Path) -> Path:
    """Where the commands run (tests/conftest.py makes it, and runs the main command there once
    for this module and tests/engine/test_pipeline.py)."""
    return quickstart_workdir


@pytest.fixture(scope="module")
def main_job(quickstart_main_job: MainJob) -> subprocess.CompletedProcess:
    return quickstart_main_job.result


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
    succeeded(run_page_command(write_prompts, workdir))
    assert len((workdir / "my_prompts.jsonl").read_text().splitlines()) == 16
    succeeded(run_page_command(ppo + " evaluation.num_prompts=16", workdir,
                               workdir / "runs" / "main"))
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
    succeeded(run_page_command(make, workdir))
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
    succeeded(run_page_command(grpo, workdir))
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
