"""Rank-aware logging: rank 0 speaks by default, every rank on request.

The library never prints. `get_logger(__name__)` returns a standard logger; `setup_logging` installs
one handler whose records carry the global rank, and silences non-zero ranks unless
``all_ranks=True`` (or ``MEGATRON_RLHF_LOG_ALL_RANKS=1``).
"""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "megatron_rlhf"


class _RankFilter(logging.Filter):
    def __init__(self, all_ranks: bool) -> None:
        super().__init__()
        self.all_ranks = all_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        rank = _current_rank()
        record.rank = rank
        return self.all_ranks or rank == 0 or record.levelno >= logging.ERROR


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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("[%(asctime)s rank%(rank)s %(levelname)s %(name)s] %(message)s", "%H:%M:%S")
    )
    handler.addFilter(_RankFilter(all_ranks))
    logger.addHandler(handler)
    logger.propagate = False


def get_logger(name: str) -> logging.Logger:
    """Return a logger under the package's root logger."""
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return logging.getLogger(name)
