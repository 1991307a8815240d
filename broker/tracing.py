"""W3C trace context across the topics: one prompt is one trace.

The curator's dispatch span starts the trace and rides in the prompt record's ``traceparent``
header; the worker's generation span (one per prompt, over the batch it was generated in) and its
publish span continue it, and the publish span's context rides in the trajectory group's header;
the trainer's step span links to the publish span of every group it trained on (a step has many
parents, so links, not a parent). Spans are exported as ``rlbus.logs`` configures the process.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Link, Span, SpanContext

from broker.headers import TRACEPARENT, is_traceparent

TRACER = "rlbus"


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER)


def traceparent(span: Span | None = None) -> str | None:
    """The ``traceparent`` of ``span`` (default: the active one); None when tracing is not set up."""
    ctx = trace.set_span_in_context(span) if span is not None else None
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=ctx)
    return carrier.get(TRACEPARENT)


def context_from(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The trace context a record's headers carry (an empty one when they carry none)."""
    value = (headers or {}).get(TRACEPARENT)
    if value is None or not is_traceparent(value):
        return otel_context.Context()
    return propagate.extract({TRACEPARENT: value}, context=otel_context.Context())


def span_context_of(value: str | None) -> SpanContext | None:
    """The remote span a ``traceparent`` names, or None."""
    if value is None or not is_traceparent(value):
        return None
    ctx = trace.get_current_span(propagate.extract({TRACEPARENT: value}, context=otel_context.Context()))
    span_context = ctx.get_span_context()
    return span_context if span_context.is_valid else None


def finished_span(name: str, *, parent: otel_context.Context | None, start_s: float, end_s: float,
                  attributes: Mapping[str, Any] | None = None, links: Sequence[Link] = ()) -> Span:
    """A span over [start_s, end_s] (Unix seconds) that already happened, under ``parent``."""
    span = tracer().start_span(name, context=parent if parent is not None else otel_context.Context(),
                               start_time=int(start_s * 1e9), attributes=dict(attributes or {}), links=list(links))
    span.end(end_time=int(end_s * 1e9))
    return span


def links_to(traceparents: Iterable[str | None]) -> list[Link]:
    """Span links to each span a ``traceparent`` names (the malformed and missing ones left out)."""
    return [Link(sc) for sc in (span_context_of(t) for t in traceparents) if sc is not None]
