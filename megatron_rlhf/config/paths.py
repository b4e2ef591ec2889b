"""Path settings that cannot be empty: a directory a run writes into or a cache (an empty value
would put the run's files into the working directory), and the entries of a list of files."""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce
from typing import Any


def _value(config: Any, key: str) -> Any:
    return reduce(getattr, key.split("."), config)


def check_paths(config: Any, required: Sequence[str], lists: Sequence[str]) -> None:
    """Refuse an empty or blank value of each dotted key in ``required`` and an empty entry in
    each list of paths under ``lists`` (keys whose value is not a list are skipped).

    Raises:
        ValueError: naming the field (and the entry's index).
    """
    for key in required:
        value = _value(config, key)
        if not str(value).strip():
            raise ValueError(f"{key}={value!r} names no directory; give one, or leave {key} out "
                             "for its default")
    for key in lists:
        value = _value(config, key)
        if not isinstance(value, list | tuple):
            continue
        for index, entry in enumerate(value):
            if not str(entry).strip():
                raise ValueError(f"{key}[{index}]={entry!r} names no file; remove the entry or "
                                 "give the path")
