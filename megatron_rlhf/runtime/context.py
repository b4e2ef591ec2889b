"""What a run records about itself, passed explicitly: its timeline tracer, fault tracker and
memory meter.

    context = RunContext(Tracer(enabled=True), install_fault_tracker(FaultConfig(), 600),
                         MemoryMeter(enabled=True))
    with context.stage("step 3", signature=(3, rows)):   # fault record (checked across ranks)
        with context.span("generate", model="actor", microbatch=0):   # timing, memory, faults
            ...

The runner creates one per run and hands it to the engine, which the PPO trainer reaches through
its engine. ``RunContext()`` records nothing: its spans and stages are one shared no-op context,
so code built without a run (unit tests, tools) costs nothing. A span's peak memory goes to the
meter's per-stage peaks and, when tracing, onto the span in the timeline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_rlhf.runtime.faults import FaultTracker
from megatron_rlhf.runtime.memory_meter import MemoryMeter
from megatron_rlhf.runtime.tracing import Span, Tracer

_NULL = contextlib.nullcontext()


@dataclass
class RunContext:
    """The run's tracer and fault tracker.

    Attributes:
        tracer: this rank's timeline (disabled: no spans are recorded).
        faults: this rank's stage records and failure diagnosis, or None (stages are no-ops).
        memory: this rank's per-stage peak memory (disabled: nothing is measured).
    """

    tracer: Tracer = field(default_factory=Tracer)
    faults: FaultTracker | None = None
    memory: MemoryMeter = field(default_factory=MemoryMeter)

    def stage(self, name: str, signature: Sequence[Any] | None = None):
        """Mark ``name`` as this rank's stage for fault reports (a no-op without a tracker).

        With a ``signature`` (and ``faults.check_consistency``) this is a collective over the
        default group: call it where every rank runs the same code (SPMD).
        """
        if self.faults is None:
            return _NULL
        return self.faults.stage(name, signature)

    def span(self, stage: str, model: str = "", microbatch: int = -1):
        """Time ``stage`` on the tracer, measure its peak memory and mark it as this rank's
        stage for fault reports (``stage/model``); free when none of them is active.

        Yields the tracer's :class:`~megatron_rlhf.runtime.tracing.Span` when tracing (the code
        inside may set its ``work``), None otherwise.
        """
        marker = self.stage(f"{stage}/{model}" if model else stage)
        if not self.tracer.enabled and not self.memory.enabled:
            return marker
        return self._span(marker, stage, model, microbatch)

    @contextlib.contextmanager
    def _span(self, marker, stage: str, model: str, microbatch: int) -> Iterator[Span | None]:
        with marker, self.tracer.span(stage, model, microbatch) as span:
            with self.memory.stage(stage) as reading:
                yield span
            if span is not None and reading is not None:
                span.peak_bytes = reading.peak_bytes
