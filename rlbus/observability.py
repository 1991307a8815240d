"""OpenTelemetry for one process: where its spans and metrics go.

Spans (see ``broker.tracing`` for what they are):
* ``RLBUS_TRACES_FILE=PATH``: one JSON object per span per line, appended (every process of a
  local run may share the file): ``trace_id``, ``span_id``, ``parent`` (span id or null),
  ``links`` ([{trace_id, span_id}]), ``name``, ``service.name``, ``start``/``end`` (Unix s),
  ``attributes``;
* OTLP when the standard variables ask for it: ``OTEL_TRACES_EXPORTER=otlp``, or an endpoint in
  ``OTEL_EXPORTER_OTLP_ENDPOINT``/``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; the protocol from
  ``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` (``http/protobuf``, the default, or ``grpc``); the
  exporter reads the rest of the ``OTEL_EXPORTER_OTLP_*`` settings (headers, certificates) itself.
  ``OTEL_TRACES_EXPORTER=none`` turns OTLP off.

Metrics (instruments in ``broker.metrics``): a Prometheus scrape endpoint on ``--metrics-port``
(``RLBUS_METRICS_PORT``; address ``RLBUS_METRICS_ADDR``, default 0.0.0.0), and OTLP like spans
(``OTEL_METRICS_EXPORTER``, ``OTEL_EXPORTER_OTLP_METRICS_*``, every ``OTEL_METRIC_EXPORT_INTERVAL``
ms). The service is ``rlbus-<role>`` unless ``OTEL_SERVICE_NAME`` names another.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

logger = logging.getLogger(__name__)


class JsonLinesSpanExporter(SpanExporter):
    """Appends one flat JSON object per span to a file; each line goes out in one write, so that
    several processes can share the file."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with self._lock:
            for span in spans:
                os.write(self._fd, (json.dumps(span_record(span)) + "\n").encode())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1


def span_record(span: ReadableSpan) -> dict:
    ctx = span.get_span_context()
    return {
        "trace_id": f"{ctx.trace_id:032x}",
        "span_id": f"{ctx.span_id:016x}",
        "parent": None if span.parent is None else f"{span.parent.span_id:016x}",
        "links": [{"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
                  for link in span.links],
        "name": span.name,
        "service.name": span.resource.attributes.get("service.name"),
        "start": span.start_time / 1e9 if span.start_time else None,
        "end": span.end_time / 1e9 if span.end_time else None,
        "attributes": {k: list(v) if isinstance(v, tuple) else v for k, v in (span.attributes or {}).items()},
    }


def _otlp(kind: str, environ: Mapping[str, str]) -> str | None:
    """``grpc`` or ``http/protobuf`` when OTLP export of ``kind`` (traces, metrics) is asked for, else None."""
    chosen = environ.get(f"OTEL_{kind.upper()}_EXPORTER")
    if chosen is not None:
        names = {n.strip() for n in chosen.split(",")}
        if "otlp" not in names:
            return None
    elif not (environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or environ.get(f"OTEL_EXPORTER_OTLP_{kind.upper()}_ENDPOINT")):
        return None
    protocol = (environ.get(f"OTEL_EXPORTER_OTLP_{kind.upper()}_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "http/protobuf")
    if protocol not in ("grpc", "http/protobuf"):
        from rlbus.config import ConfigError

        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: rlbus exports OTLP as 'http/protobuf' or 'grpc'")
    return protocol


def configure(role: str, *, metrics_port: int | None = None) -> None:
    """Set up this process's tracer and meter providers for ``role`` from the process environment
    (the OTLP exporters read their own ``OTEL_EXPORTER_OTLP_*`` settings there too)."""
    from opentelemetry import metrics, trace
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    environ = os.environ
    resource = Resource.create({"service.name": environ.get("OTEL_SERVICE_NAME") or f"rlbus-{role}",
                                "rlbus.role": role})
    tracer_provider = TracerProvider(resource=resource)
    path = environ.get("RLBUS_TRACES_FILE")
    if path:
        tracer_provider.add_span_processor(BatchSpanProcessor(JsonLinesSpanExporter(path)))
    protocol = _otlp("traces", environ)
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol is not None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    if protocol is not None:
        tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(tracer_provider)

    readers = []
    port = metrics_port if metrics_port is not None else environ.get("RLBUS_METRICS_PORT")
    if port is not None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import start_http_server

        try:
            start_http_server(int(port), addr=environ.get("RLBUS_METRICS_ADDR", "0.0.0.0"))
        except (OSError, ValueError) as exc:
            from rlbus.config import ConfigError

            raise ConfigError(f"metrics port {port!r} (--metrics-port or RLBUS_METRICS_PORT): {exc}; "
                              "give a free port, or leave it out") from None
        readers.append(PrometheusMetricReader())
        logger.info("metrics for Prometheus on port %s (/metrics)", port)
    protocol = _otlp("metrics", environ)
    if protocol is not None:
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        readers.append(PeriodicExportingMetricReader(OTLPMetricExporter()))
    metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
