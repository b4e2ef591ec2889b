"""A name -> entry registry, filled where each entry is defined (``register_*`` decorators).

Adding an estimator touches its own file only: the decorator puts it here, and the config's
checks read the names from the registry rather than from a second list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(dict[str, T], Generic[T]):
    """Name -> entry; ``kind`` names the entries in errors and ``origin`` says where an entry
    was defined."""

    def __init__(self, kind: str, origin: Callable[[T], str]) -> None:
        super().__init__()
        self.kind = kind
        self.origin = origin

    def add(self, name: str, entry: T) -> None:
        """Register ``entry`` as ``name``; a name already taken is refused with its owner."""
        if name in self:
            raise ValueError(f"{self.kind} {name!r} is already registered "
                             f"({self.origin(self[name])}); pick another name")
        self[name] = entry

    def lookup(self, name: str) -> T:
        """The entry registered as ``name``; an unknown one is refused with the registered."""
        if name not in self:
            raise ValueError(f"{self.kind} {name!r} is unknown; registered: {list(self)}")
        return self[name]
