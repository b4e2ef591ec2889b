"""A user's tool or environment that raises stops a 2-rank ``tools/run_ppo.py`` run under
torchrun with one line per rank at most, no traceback: the line names the tool or environment,
the record, the exception's type and message, and the file:line of the user's code that raised.

Each rank's output is read from torchrun's per-rank log files (``--redirects 3``), apart from the
launcher's own report, which always carries a ``ChildFailedError`` traceback of torchrun's when a
worker exits non-zero. The tool's run makes the tiny random policy call it: its tokenizer has the
whole call as one piece (``tokenizer.user_defined_symbols``) in a vocabulary of 12. The other
entry points that run PPO (``run_pipeline``, ``run_arithmetic``) are checked in one process, their
stages replaced by one that raises.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.launch import REPO, tool_env

TOOL = '''
def boom(arguments, record):
    raise ValueError("the sandbox is down")
'''

ENVIRONMENT = '''
class Boom:
    def __init__(self, record):
        self.record = record

    def reset(self):
        return None

    def step(self, response):
        raise RuntimeError("the board caught fire")
'''

CALL = '<tool_call>{"name":"boom","arguments":{}}</tool_call>'

SMALL_RUN = ["steps=1", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=2",
             "rollout.num_minibatches=1", "rollout.ppo_epochs=1", "generation.max_new_tokens=8",
             "rollout.max_turns=2", "rollout.max_episode_tokens=32"]


def _run(tmp_path: Path, overrides: list[str]) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run ``tools/run_ppo.py`` on 2 ranks; the process and each rank's stderr."""
    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "--log-dir", str(logs), "--redirects", "3",
               str(REPO / "tools" / "run_ppo.py"), "--config",
               str(REPO / "examples" / "ppo_grpo_tiny.yaml"), *SMALL_RUN,
               f"run_dir={tmp_path / 'run'}", *overrides]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240,
                          env=tool_env(PYTHONPATH=f"{REPO}:{tmp_path}"))
    ranks = sorted(logs.rglob("stderr.log"), key=lambda path: path.parent.name)
    assert len(ranks) == 2, (done.stderr, list(logs.rglob("*")))
    return done, [path.read_text() for path in ranks]


def _check_one_line_per_rank(done: subprocess.CompletedProcess, ranks: list[str],
                             expected: str) -> None:
    assert done.returncode == 1, done.stderr[-3000:]
    for rank, text in enumerate(ranks):
        assert "Traceback" not in text, f"rank {rank}:\n{text}"
        said = [line for line in text.splitlines() if line.startswith("run_ppo:")]
        assert len(said) <= 1, f"rank {rank}:\n{text}"
    named = [rank for rank, text in enumerate(ranks) if re.search(expected, text, re.M)]
    assert named, f"no rank said {expected!r}:\n" + "\n".join(ranks)


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_raising_tool_stops_the_run_with_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "boom_tools.py").write_text(TOOL)
    (tmp_path / "corpus.txt").write_text("ab ba ab\nba ab ba ab\nab ab ba\n" * 20)
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "ab ba ab", "answer": "1"}\n' * 8)
    done, ranks = _run(tmp_path, [
        f"tokenizer.corpus_path={tmp_path / 'corpus.txt'}", "tokenizer.vocab_size=12",
        f"tokenizer.cache_dir={tmp_path / 'tokenizers'}",
        f"tokenizer.user_defined_symbols=['{CALL}']",
        f"prompts.paths=[{tmp_path / 'prompts.jsonl'}]", "prompts.split.sft=0",
        "prompts.split.rm=0", "prompts.split.ppo=1",
        "rollout.tools=[{name: 'boom_tools:boom'}]", "rollout.tool_on_error=error",
        "rollout.tool_workers=1"])
    _check_one_line_per_rank(done, ranks, (
        r"^run_ppo: rank \d: tool 'boom' raised ValueError: the sandbox is down on prompt "
        r"record #\d+ \(\{\"prompt\": \"ab ba ab\", \"answer\": \"1\"\}\); call: .*; raised at "
        + re.escape(f"{tmp_path / 'boom_tools.py'}:3") + "; fix the tool"))


@pytest.mark.multirank
@pytest.mark.timeout(300)
def test_a_raising_environment_stops_the_run_with_one_line_naming_it(tmp_path: Path) -> None:
    (tmp_path / "boom_env.py").write_text(ENVIRONMENT)
    done, ranks = _run(tmp_path, ["rollout.environment={name: 'boom_env:Boom'}"])
    _check_one_line_per_rank(done, ranks, (
        r"^run_ppo: rank \d: rollout.environment 'boom_env:Boom' on prompt record #\d+: "
        r"step\(\) raised RuntimeError: the board caught fire \(\{\"prompt\": .*\); raised at "
        + re.escape(f"{tmp_path / 'boom_env.py'}:10") + "$"))


@pytest.mark.parametrize(("script", "patched", "argv"), [
    ("run_pipeline", ("run_pipeline",), ["--verbose"]),
    ("run_arithmetic", ("initialize_runtime", "run_sft", "run_ppo"), [])])
def test_the_other_ppo_entry_points_say_it_in_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
        script: str, patched: tuple[str, ...], argv: list[str]) -> None:
    from megatron_rlhf.rewards.tools import ToolError
    from tests.scripts import load_script

    monkeypatch.syspath_prepend(str(REPO / "tools"))  # their sibling modules
    tool = load_script(f"tools/{script}.py")

    def fails(*args: object, **kwargs: object) -> None:
        raise ToolError("tool 'boom' raised ValueError: the sandbox is down on prompt record #7")

    for name in patched:
        monkeypatch.setattr(tool, name, fails if name == patched[-1] else lambda *a, **k: None)
    monkeypatch.setenv("RANK", "1")
    assert tool.main([*argv, "--run-dir", str(tmp_path / "run")]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.endswith(f"{script}: rank 1: tool 'boom' raised ValueError: the sandbox is down on "
                        "prompt record #7\n"), err
