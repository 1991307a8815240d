"""What calibration and projection share: the costs file, the idle CPU it implies, the versions to the
target at a mean staleness, and a scenario's prediction (a simulation's figures and time to the target)."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path

from benchmarks.fleet.sim import Scenario, Sim, WorkerSpec

COSTS = Path(__file__).parents[1] / "fleet_costs.json"
MIX = (1.0, 1.0, 0.5, 0.25)


def load_costs(path: Path = COSTS) -> dict:
    return json.loads(path.read_text())["costs"]


def versions_needed(mean_staleness: float, points: list[list[float]]) -> float:
    """Versions to the target at a mean staleness: the least-squares line through ``points`` (mean lag,
    versions), its slope at least 0 (stale data never teaches more). A line, not a path through each
    point: the points are medians of a few seeds whose versions to a target scatter by ±60 or more, so
    a neighbouring pair may come out in the wrong order."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx else 0.0
    return my + slope * (mean_staleness - mx)


def background_cores(c: dict, workers: int) -> float:
    """Idle fetch polling on one machine: trainer intake, curator control and feedback and each
    worker's prompt reader at the critical-path wait, each worker's control listener at its own."""
    per = c["idle_reader_cores_at_20ms"]
    return (3 + workers) * per * 0.02 / c["fetch_period_s"] + workers * per * 0.02 / c["listener_period_s"]


def base_scenario(c: dict, eta: int, workers: list[WorkerSpec], **kw) -> Scenario:
    """A scenario of the costs ``c`` (those a ``Scenario`` has), B = 32, η = ``eta`` and ``workers``; ``kw`` on top."""
    fields = {f.name for f in dataclasses.fields(Scenario)}
    base = {k: v for k, v in c.items() if k in fields}
    return Scenario(**{**base, "groups_per_step": 32, "max_staleness": eta, "workers": workers, **kw})


def predict(c: dict, scenario: Scenario) -> dict:
    r = Sim(scenario).run()
    versions = versions_needed(r["mean_staleness"], c["versions_to_target"])
    # The first version comes after the start-up (workers load the model and join), then one per step: the
    # simulated steps' own times as far as they go (a step's time changes over a run whose broker slows),
    # the mean step beyond.
    times, v = r["step_times"], max(1, round(versions))
    beyond = max(0, v - len(times)) * r["time_per_version_s"]
    return {"time_per_version_s": round(r["time_per_version_s"], 4),
            "trainer_wait_fraction": round(r["trainer_wait_fraction"], 3),
            "mean_staleness": round(r["mean_staleness"], 3), "versions_to_target": round(versions),
            "time_to_target_s": round(c.get("startup_s", 0.0) + times[min(v, len(times)) - 1] - times[0] + beyond, 1),
            "stale_dropped_fraction": round(r["stale_dropped_fraction"], 4),
            "cpu_busy_fraction": _busy(scenario, r["cpu_busy_fraction"]),
            "staleness_extrapolated": r["mean_staleness"] > max(x for x, _ in c["versions_to_target"]) + 0.05,
            "groups_by_worker": r["groups_by_worker"], "_raw": r}


def _busy(scenario: Scenario, busy: dict[str, float]) -> dict[str, float]:
    """Busy share of each shared pool's free cores, the worker machines' as one mean."""
    own = {w.pool for w in scenario.workers} - {scenario.trainer_pool, scenario.curator_pool, scenario.broker_pool}
    out = {k: round(v, 3) for k, v in busy.items() if k not in own}
    if own:
        out["workers_mean"] = round(statistics.fmean(busy[k] for k in own), 3)
    return out
