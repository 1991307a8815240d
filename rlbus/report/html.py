"""``rlbus report``: one self-contained HTML file (plots embedded as PNG, no network) about a run,
read from its run directory or its store (``rlbus.report.data``)."""

from __future__ import annotations

import html
import logging
import time
from pathlib import Path

from rlbus.report import panels as report_panels
from rlbus.report import regions as report_regions
from rlbus.report.data import ReportError, RunData, load_run_dir, load_store
from rlbus.report.panels import Panel
from rlbus.report.values import fmt_bytes, num
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

PANELS = (*report_panels.PANELS, *report_regions.PANELS)
TITLES = {**report_panels.TITLES, **report_regions.TITLES}


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
