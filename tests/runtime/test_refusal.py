"""An entry point's refusal under torchrun: rank 0 says why at once, the others only after a
grace in which torchrun stops them once rank 0 has exited."""

from __future__ import annotations

import time

import pytest

from megatron_rlhf.runtime.refusal import refuse


def test_rank_zero_says_why_at_once(monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "0")
    start = time.monotonic()
    assert refuse("run_ppo", "bad configuration: rollout.batch", grace_s=30.0) == 2
    assert time.monotonic() - start < 5.0
    assert capsys.readouterr().err == "run_ppo: bad configuration: rollout.batch\n"


def test_another_rank_waits_then_names_itself(monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RANK", "3")
    start = time.monotonic()
    assert refuse("run_ppo", "no prompts", grace_s=0.5) == 2
    assert time.monotonic() - start >= 0.5
    assert capsys.readouterr().err == "run_ppo: rank 3: no prompts\n"
