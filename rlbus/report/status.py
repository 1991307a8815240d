"""``rlbus status``: the fleet status document (``consumers.status``) as a table, as JSON, or served
over HTTP for autoscalers (``/status`` JSON, ``/metrics`` Prometheus text)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlbus.report.values import fmt_bytes


def _fmt(value, spec: str = "") -> str:
    return "–" if value is None else format(value, spec)


def render(doc: dict):
    """A rich renderable of the status document."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    parts = []
    rec = doc["recommendation"]
    head = Text(f"run {doc['run']}   trainer v{_fmt(doc['trainer_version'])}   wait "
                f"{_fmt(doc['trainer_wait_fraction'], '.0%')}   propagation {_fmt(doc['propagation_s'], '.1f')} s   "
                f"workers {len(doc['workers'])} (last {doc['window_s']:.0f} s)")
    parts.append(head)
    parts.append(Text(f"recommendation: {rec['action']} → {rec['target_workers']} workers ({rec['change']:+d}); "
                      f"{rec['reason']}", style="bold"))
    policies = Table(title="trainers", title_justify="left")
    for col in ("policy", "version", "step", "wait", "groups/s taken", "groups/s published", "propagation s",
                "status age s"):
        policies.add_column(col, justify="right")
    for name, p in doc["policies"].items():
        step = _fmt(p["trainer_step"]) + ("" if p["max_steps"] is None else f"/{p['max_steps']}")
        policies.add_row(name, _fmt(p["trainer_version"]), step, _fmt(p["trainer_wait_fraction"], ".0%"),
                         _fmt(p["trainer_groups_per_s"], ".2f"), _fmt(p["published_groups_per_s"], ".2f"),
                         _fmt(p["propagation_s"], ".1f"), _fmt(p["trainer_status_age_s"], ".0f"))
    parts.append(policies)
    workers = Table(title="live workers", title_justify="left")
    for col in ("worker", "region", "hardware", "engine", "groups/s", "versions", "last seen s"):
        workers.add_column(col)
    for w in doc["workers"]:
        workers.add_row(w["worker_id"], w["region"], w["hardware"], w["engine"], f"{w['groups_per_s']:.2f}",
                        ", ".join(f"{k} v{v}" for k, v in w["versions"].items()), f"{w['last_seen_s']:.0f}")
    parts.append(workers)
    if doc.get("regions"):
        parts.append(_regions_table(doc["regions"]))
    lag = Table(title="consumer lag", title_justify="left")
    for col in ("group", "topic", "partitions", "total"):
        lag.add_column(col)
    for group, g in doc["lag"].items():
        for topic, partitions in g["topics"].items():
            busy = {p: n for p, n in partitions.items() if n}
            lag.add_row(group, topic, " ".join(f"{p}:{n}" for p, n in busy.items()) or "all read",
                        str(sum(partitions.values())))
    parts.append(lag)
    return Group(*parts)


def _regions_table(regions: dict):
    """A row per region: its live workers and what they publish, its lag, its replica per policy."""
    from rich.table import Table

    table = Table(title="regions", title_justify="left")
    for col in ("region", "workers", "groups/s", "tokens/s", "traj. bytes/s", "version lag mean/max", "replica",
                "arrival p50/p99 s", "replica status age s"):
        table.add_column(col, justify="left" if col in ("region", "replica") else "right")
    for name, r in regions.items():
        rep = r["replica"] or {}
        pol = rep.get("policies") or {}
        table.add_row(
            name, str(len(r["workers"])), f"{r['groups_per_s']:.2f}", f"{r['tokens_per_s']:.0f}",
            fmt_bytes(r["bytes_per_s"]), f"{_fmt(r['version_lag_mean'], '.1f')}/{_fmt(r['version_lag_max'])}",
            " ".join(f"{p} v{_fmt(s['replica_version'])} (lag {_fmt(s['lag_versions'])})" for p, s in pol.items())
            or ("–" if r["replica"] is None else "no version yet"),
            " ".join(f"{_fmt(s['arrival_p50_s'], '.1f')}/{_fmt(s['arrival_p99_s'], '.1f')}" for s in pol.values())
            or "–",
            _fmt(rep.get("status_age_s"), ".0f"))
    return table


def prometheus_text(doc: dict) -> str:
    """The status's figures in the Prometheus text format."""
    rec = doc["recommendation"]
    run = doc["run"]
    lines = [
        "# HELP rlbus_fleet_recommended_workers Workers the scaling rule recommends.",
        "# TYPE rlbus_fleet_recommended_workers gauge",
        f'rlbus_fleet_recommended_workers{{run="{run}"}} {rec["target_workers"]}',
        "# HELP rlbus_fleet_live_workers Workers that published a group within the window.",
        "# TYPE rlbus_fleet_live_workers gauge",
        f'rlbus_fleet_live_workers{{run="{run}"}} {len(doc["workers"])}',
    ]
    if doc["trainer_wait_fraction"] is not None:
        lines += ["# TYPE rlbus_fleet_trainer_wait_fraction gauge",
                  f'rlbus_fleet_trainer_wait_fraction{{run="{run}"}} {doc["trainer_wait_fraction"]}']
    regions = doc.get("regions") or {}
    gauges = (("region_live_workers", "Workers of the region that published a group within the window.",
               lambda r: len(r["workers"])),
              ("region_tokens_per_s", "Completion tokens the region published per second.",
               lambda r: r["tokens_per_s"]),
              ("region_bytes_per_s", "Trajectory record bytes the region published per second.",
               lambda r: r["bytes_per_s"]))
    for metric, what, value in gauges if regions else ():
        lines += [f"# HELP rlbus_fleet_{metric} {what}", f"# TYPE rlbus_fleet_{metric} gauge"]
        lines += [f'rlbus_fleet_{metric}{{run="{run}",region="{name}"}} {value(r)}' for name, r in regions.items()]
    lines += ["# TYPE rlbus_fleet_consumer_lag gauge"]
    lines += [f'rlbus_fleet_consumer_lag{{run="{run}",group="{group}"}} {g["total"]}' for group, g in doc["lag"].items()]
    return "\n".join(lines) + "\n"


class _Cached:
    """The newest status, computed at most every ``every_s`` seconds, whoever asks."""

    def __init__(self, compute: Callable[[], dict], every_s: float) -> None:
        self.compute, self.every_s = compute, every_s
        self._lock = threading.Lock()
        self._doc: dict | None = None
        self._at = -float("inf")

    def get(self) -> dict:
        with self._lock:
            if self._doc is None or time.monotonic() - self._at >= self.every_s:
                self._doc, self._at = self.compute(), time.monotonic()
            return self._doc


def serve(port: int, compute: Callable[[], dict], *, every_s: float = 15.0, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """An HTTP server answering ``/status`` (the JSON document; KEDA's metrics-api scaler reads
    ``recommendation.target_workers``) and ``/metrics`` (Prometheus). Call ``serve_forever``."""
    cached = _Cached(compute, every_s)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            path = self.path.split("?")[0]
            if path not in ("/status", "/metrics"):
                self.send_error(404, "try /status or /metrics")
                return
            try:
                doc = cached.get()
            except Exception as exc:  # the broker or store is away: say so, keep serving
                self.send_error(503, f"status not readable: {exc}")
                return
            body = (json.dumps(doc) if path == "/status" else prometheus_text(doc)).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json" if path == "/status" else "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    return ThreadingHTTPServer((host, port), Handler)
