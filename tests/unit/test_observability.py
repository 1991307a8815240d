"""Where spans and metrics go: the local JSON-lines trace file, OTLP chosen by the standard OTEL_*
variables, and trace context carried from a prompt's headers to its group's and to a trainer step's
links."""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from broker.headers import TRACEPARENT
from broker.tracing import context_from, finished_span, links_to, span_context_of, traceparent
from rlbus.config import ConfigError
from rlbus.observability import JsonLinesSpanExporter, _otlp


@pytest.fixture
def spans_file(tmp_path, monkeypatch):
    """A real SDK tracer whose spans go to a JSON-lines file (what RLBUS_TRACES_FILE sets up)."""
    path = tmp_path / "spans.jsonl"
    provider = TracerProvider(resource=Resource.create({"service.name": "rlbus-test"}))
    provider.add_span_processor(SimpleSpanProcessor(JsonLinesSpanExporter(str(path))))
    monkeypatch.setattr(trace, "get_tracer", lambda *a, **k: provider.get_tracer("rlbus"))
    yield path
    provider.shutdown()


def _spans(path) -> dict[str, dict]:
    return {s["name"]: s for s in map(json.loads, path.read_text().splitlines())}


def test_a_prompts_trace_runs_from_its_headers_to_a_step_that_links_it(spans_file) -> None:
    with trace.get_tracer("rlbus").start_as_current_span("curator.dispatch", context=Context()):
        header = traceparent()
    assert header is not None and span_context_of(header) is not None
    generated = finished_span("worker.generate", parent=context_from({TRACEPARENT: header}), start_s=100.0,
                              end_s=101.5, attributes={"rlbus.prompt_id": "p1"})
    with trace.get_tracer("rlbus").start_as_current_span("worker.publish", context=trace.set_span_in_context(generated)):
        published = traceparent()
    finished_span("trainer.step", parent=None, start_s=102.0, end_s=103.0,
                  links=links_to([published, None, "not-a-traceparent"]), attributes={"rlbus.group_ids": ["p1/main"]})
    spans = _spans(spans_file)
    dispatch, generate, publish, step = (spans[n] for n in ("curator.dispatch", "worker.generate", "worker.publish",
                                                            "trainer.step"))
    assert dispatch["trace_id"] == generate["trace_id"] == publish["trace_id"] != step["trace_id"]
    assert (dispatch["parent"], generate["parent"], publish["parent"], step["parent"]) == \
        (None, dispatch["span_id"], generate["span_id"], None)
    assert step["links"] == [{"trace_id": publish["trace_id"], "span_id": publish["span_id"]}]
    assert (generate["start"], generate["end"]) == (100.0, 101.5)
    assert generate["service.name"] == "rlbus-test" and step["attributes"] == {"rlbus.group_ids": ["p1/main"]}
    assert set(dispatch) == {"trace_id", "span_id", "parent", "links", "name", "service.name", "start", "end",
                             "attributes"}


def test_headers_without_a_valid_traceparent_start_no_trace() -> None:
    for headers in (None, {}, {TRACEPARENT: "00-zz-00"}):
        assert not trace.get_current_span(context_from(headers)).get_span_context().is_valid
    assert links_to([None, "garbage"]) == []


@pytest.mark.parametrize("environ, traces, metrics", [
    ({}, None, None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, "http/protobuf", "http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "grpc", "grpc"),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, "http/protobuf", None),
    ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_METRICS_EXPORTER": "none"}, "http/protobuf", None),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_TRACES_EXPORTER": "none"}, None, "http/protobuf"),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL": "grpc"},
     "http/protobuf", "grpc"),
])
def test_otlp_follows_the_standard_variables(environ, traces, metrics) -> None:
    assert (_otlp("traces", environ), _otlp("metrics", environ)) == (traces, metrics)


def test_an_unknown_otlp_protocol_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="http/protobuf"):
        _otlp("traces", {"OTEL_EXPORTER_OTLP_ENDPOINT": "x", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_spans_and_metrics_reach_an_otlp_http_endpoint(monkeypatch) -> None:
    """A collector on loopback (a plain HTTP server) receives the process's spans and metrics as
    OTLP/HTTP protobuf when OTEL_EXPORTER_OTLP_ENDPOINT names it."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from opentelemetry import metrics
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    from broker.metrics import counter
    from rlbus.observability import configure

    received: dict[str, list[bytes]] = {}

    class Collector(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.setdefault(self.path, []).append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Collector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    # The global providers may be set once per process: let this test set its own.
    monkeypatch.setattr(trace, "_TRACER_PROVIDER_SET_ONCE", trace.Once())
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    monkeypatch.setattr(metrics._internal, "_METER_PROVIDER_SET_ONCE", metrics._internal.Once())
    monkeypatch.setattr(metrics._internal, "_METER_PROVIDER", None)
    counter.cache_clear()
    try:
        for name in ("RLBUS_TRACES_FILE", "RLBUS_METRICS_PORT", "OTEL_SERVICE_NAME", "OTEL_TRACES_EXPORTER",
                     "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_OTLP_PROTOCOL"):
            monkeypatch.delenv(name, raising=False)
        # The exporters read their endpoint from the process environment, as in a deployed role.
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{server.server_address[1]}")
        configure("worker")
        with trace.get_tracer("rlbus").start_as_current_span("worker.publish", attributes={"rlbus.group_id": "g1"}):
            pass
        counter("rlbus.worker.groups", "{group}", "Groups published").add(3, {"policy": "main"})
        trace.get_tracer_provider().force_flush()
        metrics.get_meter_provider().force_flush()
    finally:
        trace.get_tracer_provider().shutdown()
        metrics.get_meter_provider().shutdown()
        counter.cache_clear()
        server.shutdown()
    spans = ExportTraceServiceRequest.FromString(received["/v1/traces"][0])
    (resource,) = spans.resource_spans
    service = {a.key: a.value.string_value for a in resource.resource.attributes}["service.name"]
    assert service == "rlbus-worker"
    assert [s.name for s in resource.scope_spans[0].spans] == ["worker.publish"]
    exported = ExportMetricsServiceRequest.FromString(received["/v1/metrics"][-1])
    points = {m.name: m for rm in exported.resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    assert points["rlbus.worker.groups"].sum.data_points[0].as_int == 3
