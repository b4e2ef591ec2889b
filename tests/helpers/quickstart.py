"""docs/quickstart.md's commands as the tests run them: read from the page, at tiny size.

Shared by tests/test_quickstart.py, which runs the page's commands, and tests/engine/
test_pipeline.py, which checks the chained run of the page's main command (SFT -> reward model
-> PPO) further; both use the one run of the main command that ``tests/conftest.py``'s
session fixture ``quickstart_main_job`` makes.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

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


def make_workdir(root: Path) -> Path:
    """A scratch directory linking the repository's tools/, examples/ and scripts/ (so what the
    commands write lands in it)."""
    for name in ("tools", "examples", "scripts"):
        (root / name).symlink_to(REPO / name)
    return root


def run_page_command(command: str, cwd: Path, run_dir: Path | None = None,
                timeout: float = 240) -> subprocess.CompletedProcess:
    """Run one of the page's commands in ``cwd``, without the suite's rendezvous variables;
    ``timeout`` is its budget (the tests' timeouts allow for it: 270 s for one, 510 s for
    two)."""
    env = {k: v for k, v in tool_env().items() if k not in RENDEZVOUS}
    shell = command.startswith(("for ", "printf "))
    args = ["bash", "-c", command] if shell else argv(command, run_dir)
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def succeeded(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"{shlex.join(result.args)}\n{result.stderr[-4000:]}"


@dataclass(frozen=True)
class MainJob:
    """The page's main command, run once: its process and the scratch directory it ran in
    (its run directory is ``workdir / "runs" / "main"``)."""

    result: subprocess.CompletedProcess
    workdir: Path

    @property
    def run_dir(self) -> Path:
        return self.workdir / "runs" / "main"


def run_main_job(workdir: Path) -> MainJob:
    """Run the page's main command (``bash scripts/run_main.sh``, tiny flags added) in
    ``workdir``; it must succeed."""
    main = commands()["Two commands"][0]
    assert main.startswith("bash scripts/run_main.sh")
    result = run_page_command(main, workdir)
    succeeded(result)
    return MainJob(result, workdir)
