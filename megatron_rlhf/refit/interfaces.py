"""The one thing the engine asks of weight synchronisation."""

from __future__ import annotations

from abc import ABC, abstractmethod


class WeightSync(ABC):
    """Copies a trained model's current weights into another copy of it (e.g. its shadow).

    Built once per (source, destination) pair, on every rank of the job; ``sync`` is then called
    after each training round, again on every rank.
    """

    @abstractmethod
    def sync(self) -> None:
        """Make the destination's weights equal to the source's.

        Collective over the default process group: every rank calls it, including ranks that
        hold neither model.
        """
