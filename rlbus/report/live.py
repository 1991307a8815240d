"""The live panel of ``rlbus run``: one row per policy, redrawn in place from its trainer's metrics.

``render_panel`` builds the panel from figures alone (the config's, the metrics rows, the consumer
lag); ``LiveProgress`` tails the metrics files and keeps it on screen with ``rich.live.Live``, the
supervisor's warnings and logs printed above it; ``LagPoller`` reads the trainers' consumer lag on
its own thread. ``build_progress`` picks it, or today's one line per step (``--plain``, or when
stdout is not a terminal: logs and CI read those lines).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TextIO

from rich import box
from rich.console import Console, ConsoleOptions, RenderableType, RenderResult
from rich.filesize import decimal
from rich.live import Live
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table

from rlbus.report.summary import MetricsTail, ProgressPrinter

logger = logging.getLogger(__name__)

WINDOW = 20
"""Recent rows the moving figures (mean reward, ETA, wait fraction) are taken over."""
LAG_INTERVAL_S = 5.0
LAG_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class PolicyFigures:
    """What the config and the preparation say about a policy."""

    name: str
    max_steps: int
    heldout_start: float | None  # held-out greedy accuracy measured before RL


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def _eta(fig: PolicyFigures, recent: Sequence[dict]) -> str:
    """Steps left at the step rate of the recent rows."""
    remaining = fig.max_steps - recent[-1]["step"] if recent else fig.max_steps
    if remaining <= 0:
        return "done"
    if len(recent) < 2:
        return "?"
    steps = recent[-1]["step"] - recent[0]["step"]
    seconds = recent[-1]["time"] - recent[0]["time"]
    if steps <= 0 or seconds <= 0:
        return "?"
    return _duration(remaining * seconds / steps)


def _heldout(fig: PolicyFigures, rows: Sequence[dict]) -> str:
    """The latest held-out score and the weight version it was measured on (v0: before RL)."""
    for row in reversed(rows):
        if row.get("heldout_accuracy") is not None:
            return f"{row['heldout_accuracy']:.3f} v{row['version']}"
    return "-" if fig.heldout_start is None else f"{fig.heldout_start:.3f} v0"


def _delta(rows: Sequence[dict]) -> str:
    """Size of the latest delta published (anchors are full weights, not deltas)."""
    for row in reversed(rows):
        if row.get("publish_kind", "delta") == "delta":
            return decimal(row["publish_bytes"])
    return "-"


def _policy_cells(fig: PolicyFigures, rows: Sequence[dict], lag: Mapping[str, int | None],
                  window: int) -> list[str]:
    recent = rows[-window:]
    lag_cell = "-" if fig.name not in lag else "?" if lag[fig.name] is None else f"{lag[fig.name]:,}"
    if not recent:
        return [fig.name, f"0/{fig.max_steps}", "-", "-", _heldout(fig, rows), _eta(fig, recent),
                "-", "-", "-", lag_cell, "-", "-"]
    last = recent[-1]
    mean = sum(r["reward_mean"] for r in recent) / len(recent)
    wait = sum(r["wait_s"] for r in recent) / max(1e-9, sum(r["step_wall_s"] for r in recent))
    return [
        fig.name,
        f"{last['step']}/{fig.max_steps}",
        f"{last['reward_mean']:.3f}",
        f"{mean:.3f}",
        _heldout(fig, rows),
        _eta(fig, recent),
        str(last["live_workers"]),
        f"{wait:.0%}",
        str(last["queued"]),
        lag_cell,
        f"{last['groups_dropped_stale']:,}",
        _delta(recent),
    ]


COLUMNS = ("policy", "step", "reward", "mean", "held-out", "ETA", "workers", "wait", "queued", "lag", "stale",
           "delta")
NARROW_DROPS = ("mean", "stale", "queued", "workers", "delta")
"""Columns left out, in this order, while the panel is wider than the terminal."""
_MIN_WIDTH = {"step": 9, "held-out": 10, "ETA": 6, "delta": 8}  # the panel keeps its width as figures grow


class _Fitted:
    """The panel with every column that fits the terminal's width."""

    def __init__(self, build: Callable[[list[str]], Panel]) -> None:
        self.build = build

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        dropped: list[str] = []
        panel = self.build(dropped)
        unbounded = options.update(max_width=10_000)  # a measurement is capped at the width it is given
        for name in NARROW_DROPS:
            if Measurement.get(console, unbounded, panel).maximum <= options.max_width:
                break
            dropped.append(name)
            panel = self.build(dropped)
        yield panel


def render_panel(run_name: str, figures: Sequence[PolicyFigures], rows: Mapping[str, Sequence[dict]],
                 lag: Mapping[str, int | None], *, elapsed_s: float | None = None,
                 window: int = WINDOW) -> RenderableType:
    """The panel: one row per policy of ``figures``.

    ``rows``: each policy's metrics rows, oldest first (older ones may be left out; the moving
    figures use the last ``window``, the held-out score the latest row that has one). ``lag``: each
    policy's consumer lag in records; None where it could not be read ("?"), absent while not yet
    read ("-").
    """
    cells = [dict(zip(COLUMNS, _policy_cells(fig, rows.get(fig.name, ()), lag, window))) for fig in figures]
    subtitle = None if elapsed_s is None else f"elapsed {_duration(elapsed_s)}"

    def build(dropped: list[str]) -> Panel:
        caption = (f"mean, ETA, wait: last {window} steps · held-out: at weight version vN, v0 before RL · "
                   "lag: records not committed by the trainer")
        if dropped:
            caption += f" · hidden (narrow terminal): {', '.join(dropped)}"
        table = Table(box=box.SIMPLE_HEAD, show_edge=False, collapse_padding=True, pad_edge=False,
                      header_style="bold", caption=caption, caption_justify="left", caption_style="dim")
        shown = [c for c in COLUMNS if c not in dropped]
        for name in shown:
            table.add_column(name, justify="left" if name in ("policy", "held-out", "delta") else "right",
                             no_wrap=True, min_width=_MIN_WIDTH.get(name))
        for row in cells:
            table.add_row(*(row[name] for name in shown))
        return Panel(table, title=f"rlbus run {run_name}", subtitle=subtitle, expand=False)

    return _Fitted(build)


class Progress(Protocol):
    """Shows the run's progress while the supervisor waits for its trainers."""

    def __enter__(self) -> Progress: ...

    def __exit__(self, *exc: object) -> None: ...

    def poll(self) -> None: ...


class PlainProgress:
    """One line per trainer step, as logs and CI want it."""

    def __init__(self, printers: list[ProgressPrinter]) -> None:
        self.printers = printers

    def __enter__(self) -> PlainProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def poll(self) -> None:
        for printer in self.printers:
            printer.poll()


class LagPoller:
    """Each policy's consumer lag (summed over partitions), read every ``interval_s`` on a thread of
    its own so a slow or absent broker never holds up the panel or the run."""

    def __init__(self, measure: Callable[[str], Mapping[int, int]], policies: Sequence[str],
                 interval_s: float = LAG_INTERVAL_S) -> None:
        self.measure = measure
        self.policies = list(policies)
        self.interval_s = interval_s
        self._lag: dict[str, int | None] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="rlbus-lag", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=0.5)  # a read in progress ends by its own timeout; nobody waits for it

    def snapshot(self) -> dict[str, int | None]:
        with self._lock:
            return dict(self._lag)

    def _loop(self) -> None:
        while not self._stop.is_set():
            for policy in self.policies:
                try:
                    lag: int | None = sum(self.measure(policy).values())
                except Exception as exc:  # noqa: BLE001 - a broker down or restarting shows as "?", never stops the run
                    logger.debug("consumer lag of %s unreadable: %s", policy, exc)
                    lag = None
                with self._lock:
                    self._lag[policy] = lag
            self._stop.wait(self.interval_s)


class LiveProgress:
    """The panel, redrawn at each ``poll``; what is printed to stdout or stderr meanwhile (the
    supervisor's warnings, log records) goes above it."""

    def __init__(self, run_name: str, figures: Sequence[PolicyFigures], metrics_files: Mapping[str, Path],
                 lag: LagPoller, *, console: Console | None = None, window: int = WINDOW,
                 started: float | None = None, clock: Callable[[], float] = time.time) -> None:
        self.run_name = run_name
        self.figures = list(figures)
        self.tails = {name: MetricsTail(path) for name, path in metrics_files.items()}
        self.rows: dict[str, deque[dict]] = {name: deque(maxlen=window) for name in metrics_files}
        self.heldout: dict[str, dict] = {}  # the latest row with a held-out score, kept when it leaves the window
        self.lag = lag
        self.window = window
        self.clock = clock
        self.started = clock() if started is None else started
        self.live = Live(self._render(), console=console or Console(), auto_refresh=False,
                         redirect_stdout=True, redirect_stderr=True)
        self._streams: list[tuple[logging.StreamHandler, Any]] = []

    def _render(self) -> RenderableType:
        rows: dict[str, list[dict]] = {}
        for name, recent in self.rows.items():
            held = self.heldout.get(name)
            older = held is not None and all(held is not row for row in recent)
            rows[name] = ([held] if older else []) + list(recent)
        return render_panel(self.run_name, self.figures, rows, self.lag.snapshot(),
                            elapsed_s=self.clock() - self.started, window=self.window)

    def __enter__(self) -> LiveProgress:
        stderr = sys.stderr
        self.live.start(refresh=True)
        if sys.stderr is not stderr:  # log records written to the old stderr would tear the panel
            for handler in logging.getLogger().handlers:
                if isinstance(handler, logging.StreamHandler) and handler.stream is stderr:
                    self._streams.append((handler, handler.setStream(sys.stderr)))
        self.lag.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.lag.stop()
        for handler, stream in self._streams:
            handler.setStream(stream)
        self._streams.clear()
        self.live.stop()  # the last panel stays on screen

    def poll(self) -> None:
        for name, tail in self.tails.items():
            for row in tail.poll():
                self.rows[name].append(row)
                if row.get("heldout_accuracy") is not None:
                    self.heldout[name] = row
        self.live.update(self._render(), refresh=True)


def use_plain(plain: bool, stdout: TextIO) -> bool:
    """Lines rather than the panel: asked for, or stdout is a file, a pipe or a dumb terminal."""
    return plain or not stdout.isatty() or os.environ.get("TERM") == "dumb"


def build_progress(cfg: Any, prep: dict, metrics_files: Mapping[str, Path], *, plain: bool,
                   started: float | None = None, stdout: TextIO | None = None) -> Progress:
    """Today's lines or the live panel for the run ``cfg`` (a ``RunConfig``) with ``prep`` (its
    ``prepare.json``), which began at ``started`` (epoch seconds)."""
    several = len(metrics_files) > 1
    if use_plain(plain, stdout or sys.stdout):
        return PlainProgress([ProgressPrinter(path, label=name if several else None)
                              for name, path in metrics_files.items()])
    from broker.admin import group_lag
    from broker.topics import Topics

    topics = Topics(cfg.run.name)

    def measure(policy: str) -> dict[int, int]:
        return group_lag(cfg.kafka, topics.trainer_group(policy), topics.trajectories(policy), timeout_s=LAG_TIMEOUT_S)

    figures = [PolicyFigures(p.name, p.trainer.max_steps, prep["policies"][p.name].get("reward_start"))
               for p in cfg.policy_list()]
    return LiveProgress(cfg.run.name, figures, metrics_files, LagPoller(measure, [f.name for f in figures]),
                        started=started)
