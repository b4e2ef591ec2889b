"""Who logs where: rank 0's records on the console by default, every rank's on request, and with
a log file the console keeps warnings while the file keeps everything."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatron_rlhf.runtime import logging as rank_logging


@pytest.fixture
def restored() -> Iterator[None]:
    """Put the package logger back as it was, without a log file."""
    root = logging.getLogger("megatron_rlhf")
    level, handlers, propagate = root.level, list(root.handlers), root.propagate
    yield
    rank_logging._log_file = None
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    root.propagate = propagate


def emit(rank: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> str:
    """What one INFO and one WARNING record of ``rank`` print on the console (the rank is set
    where the filter reads it: an earlier test may leave a process group of rank 0 behind)."""
    monkeypatch.setattr(rank_logging, "_current_rank", lambda: rank)
    logger = rank_logging.get_logger("tests.logging")
    logger.info("an info record")
    logger.warning("a warning record")
    return capsys.readouterr().err


def test_only_rank_0_logs_unless_every_rank_is_asked_to(
        restored: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    rank_logging.setup_logging("INFO", all_ranks=False)
    assert "rank0 INFO" in emit(0, monkeypatch, capsys)
    assert emit(1, monkeypatch, capsys) == ""
    rank_logging.setup_logging("INFO", all_ranks=True)  # --verbose
    assert "rank1 INFO" in emit(1, monkeypatch, capsys)


def test_a_log_file_takes_the_records_the_console_keeps_warnings(
        restored: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture) -> None:
    rank_logging.log_to_file(tmp_path / "run" / "log.txt")
    rank_logging.setup_logging("INFO", all_ranks=False)
    console = emit(0, monkeypatch, capsys)
    assert "a warning record" in console and "an info record" not in console
    assert emit(1, monkeypatch, capsys) == ""
    monkeypatch.setattr(rank_logging, "_current_rank", lambda: 0)
    rank_logging.setup_logging("INFO", all_ranks=False)  # a later stage keeps the file
    rank_logging.get_logger("tests.logging").info("a later stage")
    for handler in logging.getLogger("megatron_rlhf").handlers:
        handler.flush()
    log = (tmp_path / "run" / "log.txt").read_text()
    assert log.count("rank0 INFO megatron_rlhf.tests.logging] an info record") == 1
    assert "a warning record" in log and "a later stage" in log and "rank1" not in log
