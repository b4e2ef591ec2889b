"""Path settings that cannot be empty or blank: a directory a run writes into or a cache (an
empty value would put the run's files into the working directory), the entries of a list of
files, and an optional path, where empty means "none" but spaces would name a directory " "."""

from __future__ import annotations

from collections.abc import Sequence
from functools import reduce
from typing import Any


def _value(config: Any, key: str) -> Any:
    return reduce(getattr, key.split("."), config)


def check_paths(config: Any, required: Sequence[str], optional: Sequence[str]) -> None:
    """Refuse an empty or blank value of each dotted key in ``required``; under ``optional``,
    an empty entry of a list of paths and a blank but non-empty single path (empty: none).

    Raises:
        ValueError: naming the field (and the entry's index).
    """
    for key in required:
        value = _value(config, key)
        if not str(value).strip():
            raise ValueError(f"{key}={value!r} names no directory; give one, or leave {key} out "
                             "for its default")
    for key in optional:
        value = _value(config, key)
        if not isinstance(value, list | tuple):
            if value and not str(value).strip():
                raise ValueError(f"{key}={value!r} is blank: leave it empty ('') for none, or "
                                 "give the path")
            continue
        for index, entry in enumerate(value):
            if not str(entry).strip():
                raise ValueError(f"{key}[{index}]={entry!r} names no file; remove the entry or "
                                 "give the path")
