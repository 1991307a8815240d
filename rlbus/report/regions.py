"""The fleet by region in a run's reports: ``summary.json``'s ``regions`` block, the HTML report's
"Regions" table and its region panels.

Sources, each optional:

* the trainers' metrics rows (``groups_by_region``, ``tokens_by_region``, ``staleness_by_region``,
  ``propagation_by_region``, ``dropped_stale_by_region``, ``groups_by_worker``);
* each region's WAN link counters, ``<run dir>/regions/<region>/link.json`` (``rlbus.link``);
* each region's replica status in the hub's store (``weightstore.replica.read_region_status``).

A run without regions has rows of one region (the workers' label, "local" by default) and no link
files: its block has one entry. Rows do not say which region a worker is in; ``worker_regions``
derives it from the steps' counts where they decide it, and a region with a worker they leave
undecided gets no worker count.
"""

from __future__ import annotations

import logging

from rlbus.report.data import RunData
from rlbus.report.panels import Panel, embed, figure, finish, moving_mean, pyplot, rates_panel, window_for
from rlbus.report.values import fmt_bytes, num

logger = logging.getLogger(__name__)

TITLES = {
    "region_throughput": "Completion tokens trained per second, per region",
    "region_propagation": "Propagation of weight versions, per region",
}


def _counts(value: object) -> dict[str, float]:
    """A ``{key: number}`` row entry with its numeric values only ({} for anything else)."""
    if not isinstance(value, dict):
        return {}
    return {str(k): float(v) for k, v in value.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v}


def worker_regions(rows: list[dict]) -> tuple[dict[str, str], dict[str, set[str]]]:
    """(worker -> region where the rows decide it, worker -> regions still possible where they do not).

    Each step's ``groups_by_worker`` and ``groups_by_region`` count the same groups, and a worker
    is in one region: a worker is in one of the regions of every step it trained in, in none whose
    remaining groups are fewer than its own, and alone in a region no other undecided worker of
    the step can be in. Applied until nothing changes."""
    steps = []
    for r in rows:
        by_worker, by_region = _counts(r.get("groups_by_worker")), _counts(r.get("groups_by_region"))
        if by_worker and by_region:
            steps.append((by_worker, by_region))
    candidates: dict[str, set[str]] = {}
    for by_worker, by_region in steps:
        for w in by_worker:
            candidates[w] = candidates.get(w, set(by_region)) & set(by_region)
    changed = True
    while changed:
        changed = False
        for by_worker, by_region in steps:
            left = dict(by_region)
            for w, n in by_worker.items():
                if len(candidates[w]) == 1:
                    region = next(iter(candidates[w]))
                    left[region] = left.get(region, 0.0) - n
            undecided = [w for w in by_worker if len(candidates[w]) > 1]
            for w in undecided:
                fits = {region for region in candidates[w] if left.get(region, 0.0) >= by_worker[w]}
                if fits != candidates[w]:
                    candidates[w], changed = fits, True
            for region, n in left.items():
                who = [w for w in undecided if region in candidates[w]]
                if n > 0 and len(who) == 1 and candidates[who[0]] != {region}:
                    candidates[who[0]], changed = {region}, True
    decided = {w: next(iter(c)) for w, c in candidates.items() if len(c) == 1}
    return decided, {w: c for w, c in candidates.items() if len(c) != 1}


def _increase(values: list[float]) -> float:
    """What a counter that restarts at zero (a restarted trainer's) added over ``values``."""
    total, prev = 0.0, 0.0
    for v in values:
        total += v - prev if v >= prev else v
        prev = v
    return total


def quantile(values: list[float], q: float) -> float | None:
    """The nearest-rank ``q`` quantile (as the replicator's status takes its own), or None."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


def _propagation(rows: list[dict]) -> dict[str, dict[float, float]]:
    """Region -> {version: seconds} of ``propagation_by_region``, the newest row's figure per version."""
    out: dict[str, dict[float, float]] = {}
    for r in rows:
        reached = r.get("propagation_by_region")
        for region, pair in (reached.items() if isinstance(reached, dict) else ()):
            if isinstance(pair, (list, tuple)) and len(pair) == 2 and all(
                    isinstance(x, (int, float)) and not isinstance(x, bool) for x in pair):
                out.setdefault(str(region), {})[float(pair[0])] = float(pair[1])
    return out


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def region_figures(rows: dict[str, list[dict]], *, links: dict[str, dict] | None = None,
                   replicas: dict[str, dict] | None = None) -> tuple[dict[str, dict], list[str]]:
    """(the ``regions`` block, workers the rows leave unattributed) of a run whose metrics rows per
    policy are ``rows``. Every policy's groups count; rates are over the RL wall time (the longest
    policy's sum of ``step_wall_s``); ``link`` figures per version published and per trainer step
    of all policies together. Empty when no source has a region."""
    links, replicas = links or {}, replicas or {}
    everything = [r for rs in rows.values() for r in rs]
    wall = max((sum(num(r, "step_wall_s") or 0.0 for r in rs) for rs in rows.values()), default=0.0)
    versions = sum(max((num(r, "version") or 0.0 for r in rs), default=-1.0) + 1 for rs in rows.values() if rs)
    steps = sum(max((num(r, "step") if num(r, "step") is not None else num(r, "version") or 0.0 for r in rs),
                    default=0.0) for rs in rows.values())
    decided, undecided = worker_regions(everything)
    unsure = set().union(*undecided.values()) if undecided else set()
    anywhere = any(not c for c in undecided.values())  # rows that contradict themselves: any region may be short
    propagation = {policy: _propagation(rs) for policy, rs in rows.items()}
    names = {region for r in everything for key in ("groups_by_region", "tokens_by_region", "dropped_stale_by_region")
             for region in _counts(r.get(key))} | set(links) | set(replicas)
    names |= {region for by in propagation.values() for region in by}
    out = {}
    for region in sorted(names):
        groups = sum(_counts(r.get("groups_by_region")).get(region, 0.0) for r in everything)
        tokens = sum(_counts(r.get("tokens_by_region")).get(region, 0.0) for r in everything)
        weighted = [(_counts(r.get("staleness_by_region")).get(region), _counts(r.get("groups_by_region")).get(region))
                    for r in everything]
        weighted = [(s, n) for s, n in weighted if s is not None and n]
        dropped = sum(_increase([_counts(r.get("dropped_stale_by_region")).get(region, 0.0) for r in rs
                                 if isinstance(r.get("dropped_stale_by_region"), dict)]) for rs in rows.values())
        seconds = [s for by in propagation.values() for s in by.get(region, {}).values()]
        fig: dict = {
            "groups_trained": int(groups), "tokens": int(tokens),
            "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
            "staleness_mean": _round(sum(s * n for s, n in weighted) / sum(n for _, n in weighted), 3)
            if weighted else None,
            "dropped_stale": int(dropped), "propagation_versions": len(seconds),
            "propagation_p50_s": _round(quantile(seconds, 0.5), 3),
            "propagation_p99_s": _round(quantile(seconds, 0.99), 3),
        }
        if not anywhere and region not in unsure:
            fig["worker_ids"] = sorted(w for w, r in decided.items() if r == region)
            fig["workers"] = len(fig["worker_ids"])
        if region in links:
            fig["link"] = _link(links[region], versions, steps)
        if region in replicas:
            fig["replica"] = _replica(replicas[region])
        out[region] = fig
    return out, sorted(undecided)


def _link(stats: dict, versions: float, steps: float) -> dict:
    down, up = num(stats, "bytes_down"), num(stats, "bytes_up")
    return {"bytes_down": None if down is None else int(down), "bytes_up": None if up is None else int(up),
            "cut_seconds": num(stats, "cut_seconds"),
            "drops": None if num(stats, "drops") is None else int(num(stats, "drops")),
            "delay_ms": num(stats, "delay_ms"), "rate_mbit": num(stats, "rate_mbit"),
            "bytes_down_per_version": int(down / versions) if down is not None and versions > 0 else None,
            "bytes_up_per_step": int(up / steps) if up is not None and steps > 0 else None}


def _replica(doc: dict) -> dict:
    policies = doc.get("policies") if isinstance(doc.get("policies"), dict) else {}
    keys = ("replica_version", "hub_version", "lag_versions", "arrival_p50_s", "arrival_p99_s")
    return {"time": num(doc, "time"), "bytes_copied": doc.get("bytes_copied"),
            "versions_copied": doc.get("versions_copied"), "errors": doc.get("errors"),
            "policies": {str(p): {k: s.get(k) for k in keys} for p, s in policies.items() if isinstance(s, dict)}}


def unattributed_note(workers: list[str]) -> str | None:
    if not workers:
        return None
    return (f"regions: the metrics rows do not decide the region of worker(s) {', '.join(workers[:12])} (its steps' "
            "counts by worker and by region leave it open), so the regions they may be in show no worker count")


# ---------------------------------------------------------------------------------------------- HTML

COLUMNS = ["region", "workers", "groups trained", "tokens/s", "staleness", "dropped stale",
           "propagation p50 / p99 s", "replica", "arrival p50 / p99 s", "link ↓ (per version)", "link ↑ (per step)",
           "cut s", "drops"]


def _f(value, spec: str = ",.0f") -> str:
    return "—" if value is None else format(value, spec)


def table(figures: dict[str, dict]) -> list[list[str]]:
    """The "Regions" table's rows (``COLUMNS``)."""
    out = []
    for region, f in figures.items():
        link, replica = f.get("link") or {}, f.get("replica") or {}
        pol = replica.get("policies") or {}
        out.append([
            region, _f(f.get("workers")), _f(f["groups_trained"]), _f(f["tokens_per_s"]),
            _f(f["staleness_mean"], ".2f"), _f(f["dropped_stale"]),
            "—" if f["propagation_p50_s"] is None else f"{f['propagation_p50_s']:.1f} / {f['propagation_p99_s']:.1f}",
            "; ".join(f"{p} v{_f(s.get('replica_version'), '')} (lag {_f(s.get('lag_versions'), '')})"
                      for p, s in pol.items()) or "—",
            "; ".join(f"{_f(s.get('arrival_p50_s'), '.1f')} / {_f(s.get('arrival_p99_s'), '.1f')}"
                      for s in pol.values()) or "—",
            "—" if link.get("bytes_down") is None else
            f"{fmt_bytes(link['bytes_down'])} ({fmt_bytes(link['bytes_down_per_version'] or 0)})",
            "—" if link.get("bytes_up") is None else
            f"{fmt_bytes(link['bytes_up'])} ({fmt_bytes(link['bytes_up_per_step'] or 0)})",
            _f(link.get("cut_seconds"), ".1f"), _f(link.get("drops"), ""),
        ])
    return out


def region_throughput(data: RunData) -> Panel:
    events: list[tuple[float, str, float]] = []
    for rows in data.rows.values():
        for r in rows:
            t = num(r, "time")
            if t is not None:
                events += [(t, region, n) for region, n in _counts(r.get("tokens_by_region")).items()]
    return rates_panel(data, TITLES["region_throughput"], events, ylabel="completion tokens trained / s", unit=" tokens",
                       no_data="no data: the metrics rows have no tokens_by_region (written by newer trainers)")


def region_propagation(data: RunData) -> Panel:
    panel = Panel(TITLES["region_propagation"])
    fig, (ax,) = figure()
    plotted = 0
    for policy, rows in data.rows.items():
        for region, by_version in sorted(_propagation(rows).items()):
            xs = sorted(by_version)
            ys = [by_version[v] for v in xs]
            label = f"{policy}: {region}" if len(data.rows) > 1 else region
            color = f"C{plotted % 10}"
            ax.plot(xs, ys, ".", color=color, ms=3, alpha=0.5)
            ax.plot(xs, moving_mean(ys, window_for(len(ys))), color=color, lw=2, label=f"{label} ({len(xs)} versions)")
            plotted += 1
    if not plotted:
        pyplot().close(fig)
        panel.note = ("no data: the metrics rows have no propagation_by_region (written by newer trainers, once a "
                      "version reached every live worker of a region)")
        return panel
    ax.set_ylim(bottom=0)
    finish(ax, "weight version", "publish → slowest live worker of the region (s)")
    panel.image_b64 = embed(fig)
    return panel


PANELS = (region_throughput, region_propagation)
