"""``rlbus report``: one self-contained HTML file (plots embedded as PNG, no network) about a run,
read from its run directory or, for a run with nothing on local disk, from its store (where the
trainers mirror their metrics rows, ``weightstore.telemetry``)."""

from __future__ import annotations

import html
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from rlbus import report_panels, report_regions
from rlbus.report_panels import Panel, fmt_bytes, num
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

PANELS = (*report_panels.PANELS, *report_regions.PANELS)
TITLES = {**report_panels.TITLES, **report_regions.TITLES}


class ReportError(Exception):
    """The report's input cannot be read (no such run directory, a store with no policy)."""


@dataclass
class RunData:
    name: str
    source: str
    rows: dict[str, list[dict]]
    """Metrics rows per policy, first policy first, in version order."""
    summary: dict | None = None
    curator: dict[str, list[dict]] = field(default_factory=dict)
    manifests: dict[str, list[tuple[int, str, int]]] = field(default_factory=dict)
    """(version, kind, payload bytes) per policy, of the versions no metrics row describes."""
    notes: list[str] = field(default_factory=list)
    links: dict[str, dict] = field(default_factory=dict)
    """Each region's WAN link counters (``regions/<region>/link.json`` of a run directory)."""
    replicas: dict[str, dict] = field(default_factory=dict)
    """Each region's replica status in the hub's store."""

    def heldout(self, policy: str) -> list[tuple[float, float]]:
        """(version, held-out accuracy) known for ``policy``: summary.json's start and end, and rows'
        ``heldout_accuracy``."""
        found: dict[float, float] = {}
        info = ((self.summary or {}).get("policies") or {}).get(policy)
        if info is None and self.summary and policy == next(iter(self.rows)):
            info = self.summary  # a summary from before multi-policy runs: top-level keys
        if isinstance(info, dict):
            rows = self.rows.get(policy) or []
            last = num(rows[-1], "version") if rows else None
            start, end = num(info, "reward_start"), num(info, "reward_end")
            end_version = num(info, "reward_end_version")
            if start is not None:
                found[0.0] = start
            if end is not None and (end_version if end_version is not None else last) is not None:
                found[end_version if end_version is not None else last] = end
        for r in self.rows.get(policy) or []:
            v, acc = num(r, "version"), num(r, "heldout_accuracy")
            if v is not None and acc is not None:
                found[v] = acc
        return sorted(found.items())

    def publications(self, policy: str) -> list[tuple[float, str, float, float | None]]:
        """(version, kind, bytes written, full bytes) of every version known from rows or manifests."""
        out = {}
        for r in self.rows.get(policy) or []:
            v, b = num(r, "version"), num(r, "publish_bytes")
            if v is not None and b is not None:
                out[v] = (v, str(r.get("publish_kind", "delta")), b, num(r, "publish_full_bytes"))
        for v, kind, b in self.manifests.get(policy, []):
            if v not in out:
                out[float(v)] = (float(v), kind, float(b), float(b) if kind == "anchor" else None)
        return [out[v] for v in sorted(out)]

    def start_time(self) -> float | None:
        """Unix time the first trainer started (its first row's time less its wall_s)."""
        starts = [num(rs[0], "time") - (num(rs[0], "wall_s") or 0.0) for rs in self.rows.values()
                  if rs and num(rs[0], "time") is not None]
        return min(starts) if starts else None


def read_rows(path: Path, notes: list[str]) -> list[dict]:
    """The JSON rows of a JSONL file; a line that is not a JSON object (a crash mid-write) is skipped."""
    rows, bad = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict):
            rows.append(row)
        else:
            bad += 1
    if bad:
        notes.append(f"{path.name}: {bad} unreadable line(s) skipped")
    return rows


def _by_version(rows: list[dict]) -> list[dict]:
    return sorted(rows, key=lambda r: num(r, "version") if num(r, "version") is not None else -1)


def _store_side(store: ObjectStore, rows: dict[str, list[dict]], notes: list[str]) -> dict[str, list]:
    """Policies of ``store`` not yet in ``rows`` get the metrics mirrored there; every policy gets
    the manifests of the versions no row describes."""
    from weightstore.telemetry import read_store_metrics
    from weightstore.errors import StoreError
    from weightstore.manifest import list_policies, manifest_versions, read_manifest

    manifests: dict[str, list] = {}
    for policy in list_policies(store):
        if policy not in rows:
            rows[policy] = _by_version(read_store_metrics(store, policy))
        described = {num(r, "version") for r in rows[policy] if num(r, "publish_bytes") is not None}
        found = []
        for version in manifest_versions(store, policy):
            if float(version) in described:
                continue
            try:
                m = read_manifest(store, policy, version)
            except StoreError as exc:  # retention removed it meanwhile, or it is corrupt: one point less
                notes.append(f"manifest {policy} v{version} skipped: {exc}")
                continue
            found.append((version, m.kind, m.payload_bytes))
        manifests[policy] = found
    return manifests


def load_run_dir(run_dir: Path, store: ObjectStore | None = None) -> RunData:
    """A run directory: metrics files, summary.json, curator files and ``store/`` (or ``store``)."""
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a directory: give the run directory `rlbus run` printed "
                          "(runs/<run>), or --store URL for a run whose files are all in a store")
    notes: list[str] = []
    rows: dict[str, list[dict]] = {}
    files = [p for p in [run_dir / "metrics.jsonl"] if p.is_file()] + sorted(run_dir.glob("metrics.*.jsonl"))
    for path in files:
        got = read_rows(path, notes)
        name = str(got[0].get("policy")) if got and got[0].get("policy") else path.stem.partition(".")[2] or "main"
        rows[name] = _by_version(got)
    if store is None and (run_dir / "store").is_dir():
        from weightstore.objectstore import LocalDirStore

        store = LocalDirStore(run_dir / "store")
    manifests = _store_side(store, rows, notes) if store is not None else {}
    if not rows:
        raise ReportError(f"{run_dir} has no metrics.jsonl and no store/ with a policy: give the directory "
                          "`rlbus run` printed (runs/<run>), or --store URL for a run whose files are in a store")
    summary = None
    if (run_dir / "summary.json").is_file():
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except json.JSONDecodeError as exc:  # a report of what is left is still worth having
            notes.append(f"summary.json unreadable ({exc}): figures that need it are left out")
    if not isinstance(summary, dict):
        summary = None
        notes.append("no summary.json (the run has not finished, or it failed): held-out accuracy and the run's "
                     "total wall time are left out")
    curator = {p.stem: read_rows(p, notes) for p in sorted(run_dir.glob("curator*.jsonl"))}
    name = (summary or {}).get("run") or run_dir.resolve().name
    return RunData(name=str(name), source=f"run directory {run_dir.resolve()}", rows=rows, summary=summary,
                   curator=curator, manifests=manifests, notes=notes, links=report_regions.read_links(run_dir, notes),
                   replicas=report_regions.read_replicas(store, notes))


def load_store(store: ObjectStore) -> RunData:
    """A run known only by its store: the metrics rows its trainers mirrored there, and its manifests."""
    from weightstore.errors import StoreError
    from weightstore.modelfiles import read_run_descriptor

    notes = ["read from the store only: held-out accuracy (summary.json) and curator counters are in the run "
             "directory of `rlbus run`, which this report had no access to"]
    rows: dict[str, list[dict]] = {}
    manifests = _store_side(store, rows, notes)
    if not rows:
        raise ReportError(f"no policy in {store.describe()} (no <policy>/LATEST): pass the store URL the run's "
                          "trainer publishes to (s3://bucket/prefix as in its config), or a run directory")
    name = store.describe()
    try:
        name = read_run_descriptor(store).get("run", {}).get("name") or name
    except (StoreError, ValueError, AttributeError) as exc:  # it only names the run: go on without it
        logger.debug("no run descriptor in %s: %s", store.describe(), exc)
    return RunData(name=str(name), source=f"store {store.describe()}", rows=rows, manifests=manifests, notes=notes,
                   replicas=report_regions.read_replicas(store, notes))


def _figures(data: RunData) -> tuple[list[tuple[str, str]], list[list[str]]]:
    """The run's figures (label, value) and a table row per policy."""
    s = data.summary or {}
    all_rows = [r for rs in data.rows.values() for r in rs]
    workers = set(s.get("worker_ids") or [])
    for r in all_rows:
        workers.update(r.get("workers_seen") or [])
        workers.update((r.get("groups_by_worker") or {}) if isinstance(r.get("groups_by_worker"), dict) else [])
    times = [t for t in (num(r, "time") for r in all_rows) if t is not None]
    start = data.start_time()
    wall = num(s, "wall_s")
    wall_text = (f"{wall:,.0f} s (whole run)" if wall is not None else
                 f"{max(times) - start:,.0f} s (trainer, first to last step)" if times and start is not None else "—")
    run_figures = [("run", data.name), ("source", data.source), ("wall time", wall_text),
                   ("workers", f"{len(workers)}" + (f" ({', '.join(sorted(map(str, workers))[:12])})"
                                                     if workers else "")),
                   ("policies", ", ".join(data.rows))]
    if s.get("ended_note"):  # the wall budget ended the run
        run_figures.append(("ended", str(s["ended_note"])))
    for key, label in (("trainer_restarts", "trainer restarts"), ("broker_restarts", "broker restarts"),
                       ("worker_restarts", "worker restarts"), ("resumes", "resumes"),
                       ("storage_restarts", "broker storage restarts")):
        if key in s:
            run_figures.append((label, str(s[key])))

    def total(rows: list[dict], key: str) -> float:
        return sum(num(r, key) or 0.0 for r in rows)

    table = []
    for policy, rows in data.rows.items():
        last = rows[-1] if rows else {}
        wall_s = total(rows, "step_wall_s")
        deltas = [b for _, k, b, _ in data.publications(policy) if k == "delta"]
        held = data.heldout(policy)

        def count(key: str) -> str:
            return f"{int(num(last, key)):,}" if num(last, key) is not None else "—"

        table.append([
            policy, f"{len(rows):,}", str(int(num(last, "version"))) if num(last, "version") is not None else "—",
            count("groups_trained"), count("groups_dropped_stale"), count("groups_rejected"),
            f"{total(rows, 'tokens') / wall_s:,.0f}" if wall_s > 0 else "—",
            f"{total(rows, 'wait_s') / wall_s:.1%}" if wall_s > 0 else "—",
            fmt_bytes(sum(deltas) / len(deltas)) if deltas else "—",
            f"{held[0][1]:.3f} → {held[-1][1]:.3f}" if len(held) > 1 else "—",
        ])
    return run_figures, table


_COLUMNS = ["policy", "steps", "last version", "groups trained", "dropped stale", "rejected", "tokens/s",
            "trainer wait", "mean delta", "held-out accuracy"]

_CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1320px; }
h1 { font-size: 22px; margin: 0 0 12px; } h2 { font-size: 16px; margin: 0 0 6px; }
table { border-collapse: collapse; margin: 0 0 14px; font-size: 14px; }
td, th { border: 1px solid #ccc; padding: 3px 10px; text-align: left; }
th { background: #f2f2f2; } td.num { text-align: right; }
.grid { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; }
.panel { border: 1px solid #ddd; border-radius: 6px; padding: 10px; }
.wide { grid-column: 1 / span 2; }
.panel img { width: 100%; height: auto; }
.note { color: #666; font-size: 13px; margin: 4px 0; } .nodata { color: #a33; font-size: 14px; }
"""


def _panel_html(panel: Panel) -> str:
    e = html.escape
    body = f'<img alt="{e(panel.title)}" src="data:image/png;base64,{panel.image_b64}">' if panel.image_b64 else ""
    if panel.note:
        body += f'<p class="{"note" if panel.image_b64 else "nodata"}">{e(panel.note)}</p>'
    return f'<div class="panel{" wide" if panel.wide else ""}"><h2>{e(panel.title)}</h2>{body}</div>'


def _regions_html(data: RunData) -> str:
    """The "Regions" table (one row in a run without regions), or nothing when no source has a region."""
    e = html.escape
    figures, unattributed = report_regions.region_figures(data.rows, links=data.links, replicas=data.replicas)
    if not figures:
        return ""
    head = "".join(f"<th>{e(c)}</th>" for c in report_regions.COLUMNS)
    body = "".join("<tr>" + "".join(f'<td{"" if i == 0 else " class=num"}>{e(v)}</td>' for i, v in enumerate(row))
                   + "</tr>" for row in report_regions.table(figures))
    notes = [n for n in [report_regions.unattributed_note(unattributed)] if n]
    if not data.links and (len(figures) > 1 or data.replicas):
        notes.append("no link counters: they come from regions/<region>/link.json in the run directory of a "
                     "`rlbus run` with local.regions")
    return (f"<h2>Regions</h2>\n<table><tr>{head}</tr>{body}</table>\n"
            + "".join(f'<p class="note">{e(n)}</p>' for n in notes) + "\n")


def render(data: RunData) -> str:
    """The report of ``data`` as one HTML document."""
    e = html.escape
    run_figures, table = _figures(data)
    panels = []
    for make in PANELS:
        try:
            panels.append(make(data))
        except (TypeError, ValueError, KeyError, AttributeError) as exc:  # odd rows cost one panel, not the report
            logger.warning("report panel %s failed on this run's data: %s", make.__name__, exc)
            panels.append(Panel(TITLES[make.__name__], note=f"no data: values it could not plot ({exc})"))
    run_table = "".join(f"<tr><th>{e(k)}</th><td>{e(v)}</td></tr>" for k, v in run_figures)
    head = "".join(f"<th>{e(c)}</th>" for c in _COLUMNS)
    body = "".join("<tr>" + "".join(f'<td{"" if i == 0 else " class=num"}>{e(v)}</td>' for i, v in enumerate(row))
                   + "</tr>" for row in table)
    notes = "".join(f'<p class="note">{e(n)}</p>' for n in data.notes)
    return (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>rlbus report: {e(data.name)}</title>'
        f"<style>{_CSS}</style></head><body>\n<h1>rlbus report: {e(data.name)}</h1>\n"
        f"<table>{run_table}</table>\n<table><tr>{head}</tr>{body}</table>\n{notes}\n{_regions_html(data)}"
        f'<div class="grid">\n' + "\n".join(_panel_html(p) for p in panels) + "\n</div>\n"
        f'<p class="note">written {e(time.strftime("%Y-%m-%d %H:%M:%S"))} by rlbus report</p></body></html>\n'
    )


def write_html_report(run_dir: Path | None = None, *, store_url: str | None = None, store: ObjectStore | None = None,
                      out: Path | None = None) -> Path:
    """Write the report of a run directory (``store`` or ``store_url``: its store, when not
    ``run_dir/store``) or, with a store alone, of a run's store; to ``out`` (default
    ``run_dir/report.html``, or ``report.html`` here). Returns the path written."""
    if run_dir is None and store_url is None and store is None:
        raise ReportError("nothing to report on: give a run directory (runs/<run>) or --store URL")
    if store is None and store_url is not None:
        from weightstore.config import build_store, store_config_from_url

        store = build_store(store_config_from_url(store_url))
    data = load_run_dir(run_dir, store) if run_dir is not None else load_store(store)
    out = out if out is not None else (run_dir / "report.html" if run_dir is not None else Path("report.html"))
    out.write_text(render(data), encoding="utf-8")
    return out
