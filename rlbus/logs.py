"""Process-wide logging and tracing set-up, done once per process with its role tag."""

from __future__ import annotations

import json
import logging
import os
import sys
import time


class _JsonFormatter(logging.Formatter):
    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 3),
            "role": self.role,
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure_logging(role: str) -> None:
    """Role-tagged logs on stderr; ``RLBUS_LOG_JSON=1`` for JSON lines, ``RLBUS_LOG_LEVEL`` for level."""
    handler = logging.StreamHandler(sys.stderr)
    if os.environ.get("RLBUS_LOG_JSON") == "1":
        handler.setFormatter(_JsonFormatter(role))
    else:
        fmt = logging.Formatter(f"%(asctime)s {role}[{os.getpid()}] %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
        fmt.converter = time.localtime
        handler.setFormatter(fmt)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("RLBUS_LOG_LEVEL", "INFO").upper())
    for noisy in ("botocore", "urllib3", "s3transfer", "transformers", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    _configure_tracing(role)


def _configure_tracing(role: str) -> None:
    """An SDK tracer provider so trace context is real and rides in Kafka headers.

    Spans are exported only when ``RLBUS_TRACES_FILE`` names a file (JSON lines, one per span).
    """
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = TracerProvider(resource=Resource.create({"service.name": f"rlbus-{role}"}))
    path = os.environ.get("RLBUS_TRACES_FILE")
    if path:
        out = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the process
        provider.add_span_processor(
            BatchSpanProcessor(ConsoleSpanExporter(out=out, formatter=lambda s: s.to_json(indent=None) + "\n"))
        )
    trace.set_tracer_provider(provider)
