"""Rank-aware logging: rank 0 speaks by default, every rank on request.

The library never prints. `get_logger(__name__)` returns a standard logger; `setup_logging` installs
one console handler whose records carry the global rank, and silences non-zero ranks unless
``all_ranks=True`` (``--verbose`` of the entry points, or ``MEGATRON_RLHF_LOG_ALL_RANKS=1``); a
record logged with ``extra={"any_rank": True}`` (what only that rank knows) passes on every rank.
`log_to_file` keeps the console to warnings and errors and sends the whole log to a file instead,
for the rest of the process (the main job's console is its summary, progress bars and report).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

_ROOT = "megatron_rlhf"
_FORMAT = logging.Formatter("[%(asctime)s rank%(rank)s %(levelname)s %(name)s] %(message)s",
                            "%H:%M:%S")
_log_file: Path | None = None


class _RankFilter(logging.Filter):
    def __init__(self, all_ranks: bool) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _current_rank()
        record.rank = rank
        return (self.all_ranks or rank == 0 or record.levelno >= logging.ERROR
                or getattr(record, "any_rank", False))


def _current_rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def setup_logging(level: str | int = "INFO", all_ranks: bool | None = None) -> None:
    """Configure the package logger once per process (idempotent).

    Args:
        level: logging level name or number.
        all_ranks: log from every rank, not only rank 0 (errors always pass). Defaults to the
            ``MEGATRON_RLHF_LOG_ALL_RANKS`` environment variable.
    """
    if all_ranks is None:
        all_ranks = os.environ.get("MEGATRON_RLHF_LOG_ALL_RANKS", "0") == "1"
    logger = logging.getLogger(_ROOT)
    logger.setLevel(level)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    console = logging.StreamHandler(sys.stderr)
    handlers: list[logging.Handler] = [console]
    if _log_file is not None:
        console.setLevel(logging.WARNING)
        # Opened at the first record: ranks that log nothing create nothing.
        handlers.append(logging.FileHandler(_log_file, encoding="utf-8", delay=True))
    for handler in handlers:
        handler.setFormatter(_FORMAT)
        handler.addFilter(_RankFilter(all_ranks))
        logger.addHandler(handler)
    logger.propagate = False


def log_to_file(path: str | os.PathLike[str]) -> None:
    """Keep the console to warnings and errors and write every record to ``path`` as well
    (appended; its folder is created), from the next `setup_logging` on (``initialize_runtime``
    and every stage call it) to the end of the process."""
    global _log_file
    _log_file = Path(path)
    _log_file.parent.mkdir(parents=True, exist_ok=True)


def get_logger(name: str) -> logging.Logger:
    """Return a logger under the package's root logger."""
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
