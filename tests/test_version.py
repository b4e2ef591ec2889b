"""One version: ``megatron_rlhf.__version__`` is what setup.py installs, the changelog's latest
release, and what the entry points print with ``--version``."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

import megatron_rlhf
from tests.scripts import REPO, load_script

ENTRY_POINTS = ("run_ppo", "run_pipeline", "run_arithmetic", "train_sft", "train_reward_model",
                "plan_placement", "calibrate", "convert_hf_to_megatron", "convert_megatron_to_hf")
"""The tools under tools/ a user runs that import the package (all but the plotting scripts and
make_tiny_hf, which run without it)."""


def test_the_version_is_a_release_number() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", megatron_rlhf.__version__), megatron_rlhf.__version__


def test_setup_reads_the_packages_version() -> None:
    printed = subprocess.run([sys.executable, "setup.py", "--version"], cwd=REPO, check=True,
                             capture_output=True, text=True).stdout.split()
    assert printed[-1] == megatron_rlhf.__version__


def test_the_changelogs_latest_release_is_the_version() -> None:
    releases = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (REPO / "CHANGELOG.md").read_text(),
                          re.MULTILINE)
    assert releases and releases[0] == megatron_rlhf.__version__


def test_run_ppo_prints_the_version_from_the_command_line() -> None:
    result = subprocess.run([sys.executable, "tools/run_ppo.py", "--version"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"run_ppo.py {megatron_rlhf.__version__}"


def test_make_tiny_hf_prints_the_version() -> None:
    result = subprocess.run([sys.executable, "tools/make_tiny_hf.py", "--version"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"make_tiny_hf.py {megatron_rlhf.__version__}"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_prints_the_version(name: str, capsys: pytest.CaptureFixture[str],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "tools"))  # train_sft imports supervised_cli
    tool = load_script(f"tools/{name}.py")
    entry = getattr(tool, "parse_args", None) or tool.main
    with pytest.raises(SystemExit) as exit_info:
        entry(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.split()[-1] == megatron_rlhf.__version__


def test_every_tool_that_imports_the_package_is_checked() -> None:
    importing = {path.stem for path in (REPO / "tools").glob("*.py")
                 if re.search(r"^from megatron_rlhf", path.read_text(), re.MULTILINE)}
    # gen_reference is a developer's tool; supervised_cli is train_sft's and
    # train_reward_model's shared parser
    assert importing - {"gen_reference", "supervised_cli"} == set(ENTRY_POINTS)
