"""The plots of the HTML run report, one function per panel. Each takes a ``RunData`` and returns a
``Panel``: a PNG (base64) or, where the run has no data for it, the reason. The panels of the fleet
by region are in ``rlbus.report.regions``."""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass

from rlbus.report.data import RunData
from rlbus.report.values import fmt_bytes, num


TITLES = {
    "reward": "Train reward and held-out accuracy",
    "wait_fraction": "Trainer wait fraction",
    "staleness": "Staleness of trained groups (versions behind the trainer)",
    "throughput": "Throughput per worker",
    "publish_bytes": "Bytes published per weight version",
    "propagation": "Propagation of weight versions to the workers",
    "curator": "Curator: prompts dispatched, consumed, skipped",
}
"""Each panel's title, by the name of the function that draws it."""


@dataclass
class Panel:
    title: str
    image_b64: str | None = None
    """PNG of the plot, base64; None when there is no data."""
    note: str | None = None
    """Why there is no plot, or what a plot leaves out."""
    wide: bool = False


def points(rows: list[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    """(x, y) of the rows that have both keys as numbers."""
    pairs = [(num(r, x), num(r, y)) for r in rows]
    pairs = [(a, b) for a, b in pairs if a is not None and b is not None]
    return [a for a, _ in pairs], [b for _, b in pairs]


def moving_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def window_for(n: int) -> int:
    return max(1, min(25, n // 15))


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figure(wide: bool = False, ncols: int = 1):
    plt = pyplot()
    fig, axes = plt.subplots(1, ncols, figsize=(12.8, 4.0) if wide else (6.4, 3.8), squeeze=False)
    return fig, list(axes[0])


def embed(fig) -> str:
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def finish(ax, xlabel: str, ylabel: str, legend: str = "best") -> None:
    """Labels, grid and the legend: ``best`` inside, ``right`` or ``below`` outside the axes."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if not ax.get_legend_handles_labels()[0]:
        return
    if legend == "right":
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif legend == "below":
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    else:
        ax.legend(fontsize="small")


def _label(data: RunData, policy: str, what: str) -> str:
    return f"{policy}: {what}" if len(data.rows) > 1 else what


def reward(data: RunData) -> Panel:
    panel = Panel(TITLES["reward"], wide=True)
    fig, (ax,) = figure(wide=True)
    plotted, heldout_seen = False, False
    for i, (policy, rows) in enumerate(data.rows.items()):
        color = f"C{i}"
        xs, ys = points(rows, "version", "reward_mean")
        if xs:
            w = window_for(len(ys))
            ax.plot(xs, ys, color=color, alpha=0.3, lw=1, label=_label(data, policy, "train reward (per step)"))
            ax.plot(xs, moving_mean(ys, w), color=color, lw=2, label=_label(data, policy, f"train reward, mean of {w}"))
            plotted = True
        held = data.heldout(policy)
        if held:
            ax.scatter([v for v, _ in held], [a for _, a in held], color=color, edgecolor="black", s=60, zorder=3,
                       marker="D", label=_label(data, policy, "held-out greedy accuracy"))
            heldout_seen = plotted = True
    if not plotted:
        pyplot().close(fig)
        panel.note = "no data: no metrics rows with reward_mean and no held-out scores"
        return panel
    ax.set_ylim(-0.02, 1.02)
    finish(ax, "weight version (trainer step)", "reward / accuracy", legend="right")
    panel.image_b64 = embed(fig)
    if not heldout_seen:
        panel.note = ("no held-out accuracy: it comes from summary.json (written when `rlbus run` finishes) or "
                      "from metrics rows with heldout_accuracy, and this run has neither")
    return panel


def series_panel(data: RunData, title: str, series, *, raw: dict, labels: tuple[str, str], no_data: str,
                 ylim: dict, axes: tuple[str, str]) -> Panel:
    """A panel titled ``title``: one series per policy, each point drawn faint (``raw``: its plot style) and its moving
    mean over it. ``series(rows)`` gives a policy's (xs, ys); ``labels`` are the two legend entries, with
    ``{n}`` the number of points and ``{w}`` the mean's window; ``no_data`` the note when no policy has a point."""
    panel = Panel(title)
    fig, (ax,) = figure()
    for i, (policy, rows) in enumerate(data.rows.items()):
        xs, ys = series(rows)
        if not xs:
            continue
        w = window_for(len(ys))
        ax.plot(xs, ys, color=f"C{i}", **raw, label=_label(data, policy, labels[0].format(n=len(xs))))
        ax.plot(xs, moving_mean(ys, w), color=f"C{i}", lw=2, label=_label(data, policy, labels[1].format(w=w)))
    if not ax.lines:
        pyplot().close(fig)
        panel.note = no_data
        return panel
    ax.set_ylim(**ylim)
    finish(ax, *axes)
    panel.image_b64 = embed(fig)
    return panel


def _wait_fractions(rows: list[dict]) -> tuple[list[float], list[float]]:
    pairs = [(num(r, "version"), num(r, "wait_s"), num(r, "step_wall_s")) for r in rows]
    pairs = [(v, w / s) for v, w, s in pairs if v is not None and w is not None and s]
    return [v for v, _ in pairs], [f for _, f in pairs]


def wait_fraction(data: RunData) -> Panel:
    return series_panel(data, TITLES["wait_fraction"], _wait_fractions, raw={"alpha": 0.3, "lw": 1},
                        labels=("per step", "mean of {w} steps"),
                        no_data="no data: no metrics rows with wait_s and step_wall_s",
                        ylim={"bottom": -0.02, "top": 1.02},
                        axes=("weight version (trainer step)", "time waiting for groups / step time"))


def _lag_counts(rows: list[dict]) -> dict[int, float]:
    """Groups trained per staleness, summed over the rows' ``staleness_counts`` ({"lag": n})."""
    counts: dict[int, float] = {}
    for r in rows:
        sc = r.get("staleness_counts")
        for lag, n in (sc.items() if isinstance(sc, dict) else ()):
            if str(lag).lstrip("-").isdigit() and isinstance(n, (int, float)):
                counts[int(lag)] = counts.get(int(lag), 0) + n
    return counts


def staleness(data: RunData) -> Panel:
    panel = Panel(TITLES["staleness"], wide=True)
    counts = {policy: _lag_counts(rows) for policy, rows in data.rows.items()}
    have_hist = any(counts.values())
    have_over = any(points(rows, "version", key)[0] for rows in data.rows.values()
                    for key in ("staleness_mean", "staleness_max"))
    if not (have_hist or have_over):
        panel.note = "no data: no metrics rows with staleness_counts, staleness_mean or staleness_max"
        return panel
    fig, axes = figure(wide=True, ncols=int(have_hist) + int(have_over))
    hist = axes[0] if have_hist else None
    over = axes[-1] if have_over else None
    for i, (policy, rows) in enumerate(data.rows.items()):
        if hist is not None and counts[policy]:
            total, lags, width = sum(counts[policy].values()) or 1, sorted(counts[policy]), 0.8 / len(data.rows)
            hist.bar([lag - 0.4 + width * (i + 0.5) for lag in lags], [counts[policy][lag] / total for lag in lags],
                     width=width, color=f"C{i}", label=_label(data, policy, f"{int(total):,} groups"))
        if over is None:
            continue
        xs, means = points(rows, "version", "staleness_mean")
        if xs:
            w = window_for(len(means))
            over.plot(xs, moving_mean(means, w), color=f"C{i}", lw=2,
                      label=_label(data, policy, f"mean (of {w} steps)"))
        xs, maxes = points(rows, "version", "staleness_max")
        if xs:
            over.plot(xs, maxes, color=f"C{i}", lw=0.8, alpha=0.6, drawstyle="steps-post",
                      label=_label(data, policy, "max in step"))
    if hist is not None:
        hist.set_title("distribution", fontsize="medium")
        hist.xaxis.get_major_locator().set_params(integer=True)
        finish(hist, "staleness (versions)", "share of trained groups")
    else:
        panel.note = ("no data for the distribution: the metrics rows have no staleness_counts "
                      "(written by newer trainers)")
    if over is not None:
        over.set_title("over steps", fontsize="medium")
        over.yaxis.get_major_locator().set_params(integer=True)
        finish(over, "weight version (trainer step)", "staleness (versions)")
    panel.image_b64 = embed(fig)
    return panel


def rates_panel(data: RunData, title: str, events: list[tuple[float, str, float]], *, ylabel: str, unit: str,
                no_data: str) -> Panel:
    """A panel titled ``title``: for each key of ``events`` ((time, key, amount)), its amount per second in up to 25 equal
    bins from the earlier of the run's start and the first event, its total (in ``unit``) in the legend."""
    panel = Panel(title)
    if not events:
        panel.note = no_data
        return panel
    times = [t for t, _, _ in events]
    t0 = min(times + ([data.start_time()] if data.start_time() is not None else []))
    bins = max(1, min(25, len(set(times)) // 4))
    width = max(max(times) - t0, 1e-6) / bins
    keys = sorted({k for _, k, _ in events})
    fig, (ax,) = figure()
    for i, key in enumerate(keys):
        rate = [0.0] * bins
        for t, k, n in events:
            if k == key:
                rate[min(bins - 1, int((t - t0) / width))] += n / width
        ax.stairs(rate, [width * j for j in range(bins + 1)], baseline=None, color=f"C{i % 10}", lw=1.5,
                  label=f"{key} ({int(sum(r * width for r in rate)):,}{unit})")
    finish(ax, f"wall time since the trainer started (s; bins of {width:.3g} s)", ylabel)
    if len(keys) > 8:
        ax.legend(fontsize="x-small", ncol=2)
    panel.image_b64 = embed(fig)
    if len(data.rows) > 1:
        panel.note = f"{unit.strip() or 'groups'} of every policy together"
    return panel


def throughput(data: RunData) -> Panel:
    events: list[tuple[float, str, float]] = []
    for rows in data.rows.values():
        for r in rows:
            t, by_worker = num(r, "time"), r.get("groups_by_worker")
            if t is None or not isinstance(by_worker, dict):
                continue
            events += [(t, str(w), float(n)) for w, n in by_worker.items() if isinstance(n, (int, float))]
    return rates_panel(data, TITLES["throughput"], events, ylabel="groups trained / s", unit="",
                       no_data="no data: the metrics rows have no groups_by_worker (written by newer trainers)")


def publish_bytes(data: RunData) -> Panel:
    panel = Panel(TITLES["publish_bytes"])
    fig, (ax,) = figure()
    plotted = False
    for i, policy in enumerate(data.rows):
        pubs = data.publications(policy)
        for kind, marker, size in (("delta", ".", 12), ("anchor", "^", 50)):
            sel = [(v, b) for v, k, b, _ in pubs if k == kind]
            if sel:
                ax.scatter([v for v, _ in sel], [b for _, b in sel], marker=marker, s=size, color=f"C{i}",
                           edgecolor="black" if kind == "anchor" else None, zorder=3 if kind == "anchor" else 2,
                           label=_label(data, policy, f"{kind}s ({len(sel)})"))
                plotted = True
        fulls = [f for _, _, _, f in pubs if f]
        if fulls:
            ax.axhline(fulls[-1], color=f"C{i}", ls="--", lw=1,
                       label=_label(data, policy, f"full weights {fmt_bytes(fulls[-1])}"))
    if not plotted:
        pyplot().close(fig)
        panel.note = "no data: no metrics rows with publish_bytes and no manifests in a store"
        return panel
    if any(k == "anchor" and full and b > full for policy in data.rows for _, k, b, full in data.publications(policy)):
        panel.note = "an anchor's bytes include the patch from the version before it, which followers that are " \
                     "current download instead of the full weights"
    from matplotlib.ticker import FuncFormatter

    sizes = [b for policy in data.rows for _, _, b, _ in data.publications(policy) if b > 0]
    if sizes and max(sizes) > 30 * min(sizes):  # e.g. a large model's tiny deltas next to its anchors
        ax.set_yscale("log")
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda *_: ""))
    else:
        ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(FuncFormatter(fmt_bytes))
    finish(ax, "weight version", "bytes written" + (" (log scale)" if ax.get_yscale() == "log" else ""),
            legend="below")
    panel.image_b64 = embed(fig)
    return panel


def _propagation_times(rows: list[dict]) -> tuple[list[float], list[float]]:
    by_version: dict[float, float] = {}
    for r in rows:
        v, s = num(r, "propagated_version"), num(r, "propagation_s")
        if v is not None and s is not None:
            by_version[v] = s
    xs = sorted(by_version)
    return xs, [by_version[v] for v in xs]


def propagation(data: RunData) -> Panel:
    return series_panel(data, TITLES["propagation"], _propagation_times,
                        raw={"marker": ".", "linestyle": "none", "ms": 3, "alpha": 0.5},
                        labels=("{n} versions", "mean of {w}"),
                        no_data="no data: the metrics rows have no propagation_s (written by newer trainers, once a "
                        "version reached every live worker)",
                        ylim={"bottom": 0}, axes=("weight version", "publish → slowest live worker uses it (s)"))


def curator(data: RunData) -> Panel:
    panel = Panel(TITLES["curator"])
    if not any(data.curator.values()):
        panel.note = "no data: no curator*.jsonl (the curator writes it in a run directory only)"
        return panel
    fig, (ax,) = figure()
    t0 = data.start_time()
    for i, (name, rows) in enumerate(data.curator.items()):
        start = t0 if t0 is not None else min((num(r, "time") or math.inf) for r in rows)
        for key, style in (("dispatched", "-"), ("consumed", "--"), ("skipped", ":")):
            xs, ys = points(rows, "time", key)
            if xs:
                prefix = f"{name}: " if len(data.curator) > 1 else ""
                ax.plot([x - start for x in xs], ys, style, color=f"C{i}", lw=1.5, label=f"{prefix}{key}")
    finish(ax, "wall time since the trainer started (s)", "prompts (cumulative)")
    panel.image_b64 = embed(fig)
    return panel


PANELS = (reward, wait_fraction, throughput, staleness, publish_bytes, propagation, curator)
