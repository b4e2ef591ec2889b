"""Peak memory of each stage on this rank: CUDA allocator statistics, or counted tensor bytes.

    meter = MemoryMeter(enabled=True)
    meter.track(offloader)                 # anything with resident_bytes(): model state
    with meter.stage("generate") as reading:
        meter.observe(transient=kv_bytes)  # CPU: state now resident + a counted transient
    reading.peak_bytes, meter.take()       # {"generate": peak bytes since the last take}

On a GPU the peak is ``torch.cuda.max_memory_allocated`` over the stage (the allocator's counter is
reset when a stage begins), so it holds everything the stage allocated. On the CPU there is no
allocator to ask: the peak is the largest ``observe`` of the stage, that is the bytes of model
state the tracked sources hold at the moments the code reports (a stage's start and end, and
where a model has just been brought back or is about to be sent away) plus the transient tensors
it names (the KV cache of generation). Activations and data rows are not counted on the CPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch


class HoldsState(Protocol):
    """Something that knows the bytes of model state it holds on the device now."""

    def resident_bytes(self) -> int:
        """Bytes resident now."""


@dataclass
class Reading:
    """The peak of one running (then finished) stage, bytes."""

    stage: str
    peak_bytes: int = 0


_NULL_READING = contextlib.nullcontext(None)


class MemoryMeter:
    """Per-stage peak memory of this rank.

    Args:
        enabled: measure at all (a disabled meter's stages and observations are free).
        cuda: read the CUDA allocator (default: whenever CUDA is available); else count the
            tracked sources' bytes.
    """

    def __init__(self, enabled: bool = False, cuda: bool | None = None) -> None:
        self.enabled = enabled
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self._sources: list[HoldsState] = []
        self._open: list[Reading] = []
        self._peaks: dict[str, int] = {}

    def track(self, source: HoldsState) -> None:
        """Count ``source``'s resident bytes in every CPU observation."""
        self._sources.append(source)

    def stage(self, name: str):
        """A context manager measuring ``name``; yields its :class:`Reading` (None if
        disabled). Stages nest: an outer stage's peak includes its inner stages'."""
        if not self.enabled:
            return _NULL_READING
        return self._stage(name)

    @contextlib.contextmanager
    def _stage(self, name: str) -> Iterator[Reading]:
        reading = Reading(name)
        if self.cuda:
            self._raise_open(torch.cuda.max_memory_allocated())  # before the counter restarts
            torch.cuda.reset_peak_memory_stats()
        self._open.append(reading)
        self.observe()
        try:
            yield reading
        finally:
            self.observe()
            if self.cuda:
                self._raise_open(torch.cuda.max_memory_allocated())
            self._open.remove(reading)
            self._peaks[name] = max(self._peaks.get(name, 0), reading.peak_bytes)

    def observe(self, transient: int = 0) -> None:
        """CPU: raise the running stages' peaks to the tracked state plus ``transient`` bytes
        alive now. On a GPU the allocator already sees both: nothing to do."""
        if not self.enabled or self.cuda or not self._open:
            return
        self._raise_open(sum(source.resident_bytes() for source in self._sources) + transient)

    def _raise_open(self, nbytes: int) -> None:
        for reading in self._open:
            reading.peak_bytes = max(reading.peak_bytes, nbytes)

    def take(self) -> dict[str, int]:
        """Peak bytes per stage finished since the last call, and start afresh."""
        peaks, self._peaks = self._peaks, {}
        return peaks
