"""W3C trace context for trajectory records: one episode is one trace."""

from __future__ import annotations

from opentelemetry import propagate


def current_traceparent() -> str | None:
    """The ``traceparent`` of the active span, or None when tracing is not set up."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent")
