"""What a run report reads: ``RunData`` (metrics rows, summary, curator rows, manifests, region links
and replicas), from a run directory or, for a run with nothing on local disk, from its store (where
the trainers mirror their metrics rows, ``weightstore.telemetry``)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from rlbus.report.values import num
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)


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
                   curator=curator, manifests=manifests, notes=notes, links=read_links(run_dir, notes),
                   replicas=read_replicas(store, notes))


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
                   replicas=read_replicas(store, notes))


def read_links(run_dir: Path, notes: list[str]) -> dict[str, dict]:
    """Each region's link counters (``<run_dir>/regions/<region>/link.json``), by region."""
    links = {}
    for path in sorted(run_dir.glob("regions/*/link.json")):
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:  # a link killed mid-write: the region's other figures remain
            notes.append(f"{path.relative_to(run_dir)} unreadable ({exc}): that region's link counters are left out")
            continue
        if isinstance(doc, dict):
            links[path.parent.name] = doc
    return links


def read_replicas(store: ObjectStore | None, notes: list[str]) -> dict[str, dict]:
    """Each region's replica status in the hub's ``store``, by region (none without a store)."""
    if store is None:
        return {}
    from weightstore.errors import StoreError
    from weightstore.replica import read_region_status

    try:
        return read_region_status(store)
    except StoreError as exc:  # the replicas' status is advisory: the report goes on without it
        notes.append(f"replica status unreadable in {store.describe()} ({exc}): replica figures are left out")
        return {}
