"""Per-rank timelines of a run: which stage of which model ran when, as Chrome trace events.

    tracer = Tracer(enabled=True)
    with tracer.span("generate", model="shadow_actor", microbatch=0):
        ...
    write_chrome_trace(tracer, "run/timeline.json")   # collective: rank 0 writes all ranks

Code that records spans receives the tracer inside a ``runtime.context.RunContext``. With tracing
off, ``span`` returns one shared ``nullcontext``: no clock reads, no records. On a GPU a span
waits for the device at both ends.
The JSON loads in chrome://tracing or Perfetto (one process row per rank) and
``tools/plot_timeline.py`` draws it as a PNG.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

_NULL = contextlib.nullcontext()


@dataclass
class Span:
    """One interval of work on this rank, in wall-clock seconds (comparable across ranks), its
    peak memory in bytes when the run measures memory (``runtime.memory``), and what the stage
    ran when it says so."""

    stage: str
    model: str
    microbatch: int
    start: float
    end: float
    peak_bytes: int | None = None
    work: dict[str, Any] | None = None
    """Counts of what ran, JSON-serialisable, set by the code inside the span (the engine's
    ``generate`` span: its generation micro-batches); written into the trace event's args."""


@dataclass
class Tracer:
    """Collects this rank's spans."""

    enabled: bool = False
    spans: list[Span] = field(default_factory=list)

    @contextlib.contextmanager
    def _span(self, stage: str, model: str, microbatch: int) -> Iterator[Span]:
        start = _device_clock()
        span = Span(stage, model, microbatch, start, start)
        try:
            yield span
        finally:
            span.end = _device_clock()
            self.spans.append(span)

    def span(self, stage: str, model: str = "", microbatch: int = -1):
        """A context manager timing one stage; yields its :class:`Span` (None when disabled)."""
        if not self.enabled:
            return _NULL
        return self._span(stage, model, microbatch)

    def seconds_by_stage(self) -> dict[str, float]:
        """Total seconds per stage on this rank."""
        totals: dict[str, float] = {}
        for span in self.spans:
            totals[span.stage] = totals.get(span.stage, 0.0) + span.end - span.start
        return totals

    def busy_seconds(self, stages: set[str] | None = None) -> float:
        """Seconds covered by at least one span of ``stages`` (all stages when None)."""
        busy, cursor = 0.0, float("-inf")
        chosen = [s for s in self.spans if stages is None or s.stage in stages]
        for span in sorted(chosen, key=lambda s: s.start):
            start = max(span.start, cursor)
            if span.end > start:
                busy += span.end - start
                cursor = span.end
        return busy


def _device_clock() -> float:
    """Wall-clock seconds once this rank's GPU has finished the work queued so far.

    CUDA kernels run asynchronously: without the wait a span would measure how long the host
    took to queue its work. Waiting at span boundaries serialises host and device, which is the
    price of a true timeline (tracing is off by default). CUDA events would time the device
    without the wait but give durations only, not times comparable across ranks. Only the
    current stream is waited for: a device-wide synchronize would also wait for NCCL's streams,
    where a send left in flight completes only when its receiver, perhaps still training, takes
    it.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    return time.time()


def chrome_trace_events(spans_by_rank: list[list[dict]]) -> list[dict]:
    """Chrome trace "complete" events, one process id per rank, microseconds from the first."""
    origin = min((span["start"] for spans in spans_by_rank for span in spans), default=0.0)
    events = []
    for rank, spans in enumerate(spans_by_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank,
                       "args": {"name": f"rank {rank}"}})
        for span in spans:
            events.append({
                "name": f"{span['stage']}" + (f" {span['model']}" if span["model"] else ""),
                "cat": span["stage"], "ph": "X", "pid": rank, "tid": 0,
                "ts": (span["start"] - origin) * 1e6, "dur": (span["end"] - span["start"]) * 1e6,
                "args": {"model": span["model"], "microbatch": span["microbatch"],
                         **_optional(span)},
            })
    return events


def _optional(span: dict) -> dict:
    """The span's optional fields that are set."""
    return {name: span[name] for name in ("peak_bytes", "work") if span.get(name) is not None}


def write_chrome_trace(tracer: Tracer, path: str | Path) -> None:
    """Gather every rank's spans and write one Chrome trace file on rank 0 (collective)."""
    spans = [asdict(span) for span in tracer.spans]
    gathered: list = [None] * dist.get_world_size()
    # World: rank 0 writes the spans of every rank.
    dist.all_gather_object(gathered, spans, group=dist.group.WORLD)
    if dist.get_rank() == 0:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps({"traceEvents": chrome_trace_events(gathered)}))
