"""Spans of a run's timeline: what the code inside a span records reaches the trace events."""

from __future__ import annotations

import json

from megatron_rlhf.runtime.context import RunContext
from megatron_rlhf.runtime.memory_meter import MemoryMeter
from megatron_rlhf.runtime.tracing import Span, Tracer, chrome_trace_events


def test_a_span_carries_its_work_into_the_trace_event_args() -> None:
    context = RunContext(Tracer(enabled=True))
    work = {"tp_rank": 0, "micro_batches": [{"rows": 2, "prompt_width": 9, "forwards": 3,
                                             "kv_cache": True}]}
    with context.span("generate", "actor", 0) as span:
        span.work = work
    with context.span("train", "actor", 0):
        pass
    spans = [vars(s) for s in context.tracer.spans]
    events = [e for e in chrome_trace_events([spans]) if e["ph"] == "X"]
    assert events[0]["args"] == {"model": "actor", "microbatch": 0, "work": work}
    assert "work" not in events[1]["args"]
    assert json.loads(json.dumps(events))[0]["args"]["work"] == work


def test_a_span_yields_none_when_not_tracing() -> None:
    for context in (RunContext(), RunContext(memory=MemoryMeter(enabled=True, cuda=False))):
        with context.span("generate", "actor", 0) as span:
            assert span is None
        assert context.tracer.spans == []
    assert Span("generate", "actor", 0, 0.0, 1.0).work is None
