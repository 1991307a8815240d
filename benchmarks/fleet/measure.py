"""Costs read from finished runs: a run directory's step costs (``measure``), the calibration pairs'
busy share, start-up and share of informative groups, the per-process CPU split of runs of different pace
(``run_window``, ``cpu_costs``), and the versions to a target against the mean lag from
``benchmarks.staleness``."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import typer

from benchmarks.fleet.probe import intake_cost
from rlbus.report.summary import read_metrics

LOADED = re.compile(r"weights v(\d+) loaded via (\S+) \((\d+) bytes, ([0-9.]+)s\)")
WORKER_TOTALS = re.compile(r"worker ran ([0-9.]+)s: (\d+) prompts in (\d+) batches")


def _rows(run_dir: Path) -> list[dict]:
    """A finished run's metrics rows, the start-up (first tenth) left out."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    if len(rows) < 10:
        raise typer.BadParameter(f"{run_dir}/metrics.jsonl has {len(rows)} rows; measure a finished run")
    return rows[len(rows) // 10:]


def nearest_target(result: dict, target: float) -> float:
    """The target of a ``benchmarks.staleness`` result within 0.005 of ``target``."""
    key = min(result["targets"], key=lambda t: abs(t - target))
    if abs(key - target) > 0.005:
        raise typer.BadParameter(f"the staleness result has targets {result['targets']}, none at {target}: run "
                                 f"benchmarks.staleness --target {target}")
    return key


def staleness_points(result: dict, target: float) -> list[list[float]]:
    """Versions to ``target`` against the mean lag, from ``benchmarks.staleness --json`` (its
    profiles without overrides; the median over seeds, a seed that never reached the target counted
    as later than any that did, so at most a minority of them may miss it)."""
    key = nearest_target(result, target)
    points = []
    for name, profile in result["profiles"].items():
        if profile["overrides"]:
            continue
        reached = profile["versions_to_targets"][str(key)]
        median = statistics.median(math.inf if v is None else v for v in reached)
        if not math.isfinite(median):
            raise typer.BadParameter(f"profile {name}: {reached.count(None)} of {len(reached)} seeds never reached "
                                     f"{key} in {result['steps']} versions: run benchmarks.staleness with more --steps")
        points.append([profile["lag_mean"], round(median, 1)])
    return sorted(points)


def informative_by_window(pairs: list[dict[str, Path]], results: list[dict]) -> dict:
    """Groups trained / (trained + dropped by dynamic sampling) in each mode, median over the pairs, in
    two windows after the start-up (the first tenth): up to the version where the run reached its
    target, and the whole run."""
    def fraction(rows: list[dict]) -> float:
        trained = rows[-1]["groups_trained"] - rows[0]["groups_trained"]
        dropped = rows[-1].get("stage/dynamic_sampling/dropped", 0) - rows[0].get("stage/dynamic_sampling/dropped", 0)
        return trained / max(1, trained + dropped)

    out: dict[str, dict[str, float]] = {"to_target": {}, "whole_run": {}}
    for mode in ("sync", "async"):
        to_target, whole = [], []
        for pair, result in zip(pairs, results, strict=True):
            rows = _rows(pair[mode])
            whole.append(fraction(rows))
            to_target.append(fraction([r for r in rows if r["version"] <= result[f"{mode}_versions_to_target"]]))
        out["to_target"][mode] = round(statistics.median(to_target), 3)
        out["whole_run"][mode] = round(statistics.median(whole), 3)
    return out


def startup(run_dirs: list[Path]) -> float:
    """Seconds from the trainer's start to its first version (workers start, load the model, join
    their group and generate the first batch), median over the runs."""
    firsts = [read_metrics(d / "metrics.jsonl")[0]["wall_s"] for d in run_dirs]
    return round(statistics.median(firsts), 2)


def busy_share(sync_dirs: list[Path], async_dirs: list[Path]) -> float:
    """A nice-0 thread's share of a core on the saturated machine: the trainer's step alone (a
    synchronous run's trainer trains while every worker waits for its weights) over the same step
    on the busy machine (an asynchronous run), median over the pairs."""
    ratios = [statistics.median(r["train_s"] for r in _rows(s)) / statistics.median(r["train_s"] for r in _rows(a))
              for s, a in zip(sync_dirs, async_dirs, strict=True)]
    return round(statistics.median(ratios), 3)


def measure(run_dir: Path, base: dict) -> dict:
    """Costs of a finished ``rlbus run`` directory, over ``base`` for what a run does not record."""
    rows = _rows(run_dir)
    med = lambda key: statistics.median(r[key] for r in rows if r.get(key) is not None)  # noqa: E731
    trained = rows[-1]["groups_trained"] - rows[0]["groups_trained"] + rows[0]["groups"]
    skipped = rows[-1].get("stage/dynamic_sampling/dropped", 0) - rows[0].get("stage/dynamic_sampling/dropped", 0)
    loads = [m.groups() for log in sorted((run_dir / "logs").glob("worker-*.log"))
             for m in LOADED.finditer(log.read_text(errors="replace"))]
    deltas = [(int(b), float(s)) for _, path, b, s in loads if path == "delta"] or [(int(b), float(s)) for *_, b, s in loads]
    costs = dict(base)
    costs |= {"trainer_step_s": round(med("train_s"), 4), "publish_s": round(med("publish_s"), 4),
              "informative_fraction": round(trained / max(1, trained + skipped), 3)}
    if deltas:
        costs["follow_s"] = round(statistics.median(s for _, s in deltas), 4)
    tokens = sum(r["tokens"] for r in rows) / max(1, sum(r["groups"] for r in rows))
    costs["intake_group_s"] = round(intake_cost(round(tokens)), 6)
    config = json.loads((run_dir / "config.json").read_text()) if (run_dir / "config.json").exists() else {}
    speeds = (config.get("local") or {}).get("bench_worker_speeds")
    span = rows[-1]["time"] - rows[0]["time"]
    by_worker: dict[str, int] = {}
    for r in rows:
        for w, k in (r.get("groups_by_worker") or {}).items():
            by_worker[w] = by_worker.get(w, 0) + k
    observed = {
        "rows": len(rows), "s_per_version": round(med("step_wall_s"), 4),
        "trainer_wait_fraction": round(sum(r["wait_s"] for r in rows) / sum(r["step_wall_s"] for r in rows), 3),
        "mean_staleness": round(sum(int(k) * v for r in rows for k, v in r["staleness_counts"].items())
                                / max(1, sum(v for r in rows for v in r["staleness_counts"].values())), 3),
        "propagation_s_median": round(med("propagation_s"), 3) if any(r.get("propagation_s") for r in rows) else None,
        "tokens_per_group": round(tokens, 1),
        "trained_groups_per_s_by_worker": {w: round(k / span, 2) for w, k in sorted(by_worker.items())},
        "weight_loads": len(loads), "delta_bytes_median": statistics.median(b for b, _ in deltas) if deltas else None,
        "worker_speeds": speeds,
    }
    return {"provisional": False, "measured_from": str(run_dir), "observed": observed, "costs": costs,
            "note": "trainer_step_s, publish_s, follow_s and informative_fraction measured from the run (wall "
                    "times: re-measure on a quiet machine; a synchronous run's trainer step and publication run alone), "
                    "intake_group_s by decoding groups of the run's size; the CPU split of generation, worker, broker and curator "
                    "work, polling and latencies kept from the previous costs file (a run directory does not record them)"}


def _at(series: list[tuple[float, dict]], t: float, key: str) -> float:
    """A cumulative counter of ``series`` ((time, row) in time order) at time ``t``, linearly
    interpolated between the rows around it."""
    pts = [(ts, row[key]) for ts, row in series if key in row]
    if not pts:
        return 0.0
    if t <= pts[0][0]:
        return float(pts[0][1])
    for (t0, v0), (t1, v1) in zip(pts, pts[1:], strict=False):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0) if t1 > t0 else float(v1)
    return float(pts[-1][1])


def run_window(run_dir: Path, upto: int, pieces: int = 10) -> dict:
    """What one finished run did and the CPU each of its processes used between the end of its
    start-up (the first tenth of the versions) and version ``upto``: from ``metrics.jsonl``,
    ``curator.jsonl`` (prompts each worker served, as the router counts them), ``cpu.jsonl`` (the
    supervisor's per-process CPU) and each worker's closing log line (prompts per batch)."""
    if not (run_dir / "cpu.jsonl").is_file():
        raise typer.BadParameter(f"{run_dir} has no cpu.jsonl: measure a run made by this version of rlbus run")
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["version"] <= upto]
    first, last = rows[len(rows) // 10], rows[-1]
    t0, t1 = first["time"], last["time"]
    cpu = [(r["time"], r["cpu_s"]) for r in read_metrics(run_dir / "cpu.jsonl")]
    cur = [(r["time"], r) for r in read_metrics(run_dir / "curator.jsonl")]
    if cpu[-1][0] < t1 or cur[-1][0] < t1:
        raise typer.BadParameter(f"{run_dir}: cpu.jsonl or curator.jsonl ends before version {upto}")
    workers = {}
    for log in sorted((run_dir / "logs").glob("worker-*.log")):
        text = log.read_text(errors="replace")
        totals = WORKER_TOTALS.search(text)
        if totals is None:
            raise typer.BadParameter(f"{log} has no closing line ('worker ran ...'): the worker did not stop cleanly")
        name = f"local-{log.stem.split('-', 1)[1]}"
        served = _at(cur, t1, f"routing/worker/{name}/served") - _at(cur, t0, f"routing/worker/{name}/served")
        per_batch = int(totals[2]) / int(totals[3])
        loads = len(LOADED.findall(text)) * served / max(1, int(totals[2]))  # the window's share of them
        workers[name] = {"cpu_s": _at(cpu, t1, log.stem) - _at(cpu, t0, log.stem), "prompts": served,
                         "batches": served / per_batch, "loads": loads}
    span = t1 - t0
    # The broker's load grows with its log: the window in ``pieces`` equal spans, each with the prompts
    # dispatched in it, the mean number dispatched before (the log's size, in prompts) and the broker's CPU.
    cuts = [t0 + span * i / pieces for i in range(pieces + 1)]
    log = [_at(cur, t, "dispatched") for t in cuts]
    broker = [{"span_s": b - a, "prompts": log[i + 1] - log[i], "log_prompts": (log[i] + log[i + 1]) / 2,
               "cpu_s": _at(cpu, b, "broker") - _at(cpu, a, "broker")}
              for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))]
    return {"run": str(run_dir), "span_s": span, "versions": last["version"] - first["version"], "broker_pieces": broker,
            "prompts": log[-1] - log[0],
            "groups": sum(w["prompts"] for w in workers.values()),
            "cpu_s": {role: _at(cpu, t1, role) - _at(cpu, t0, role) for role in ("trainer", "curator", "broker")},
            "workers": workers}


def cpu_costs(windows: list[dict], c: dict) -> dict:
    """Per-process CPU of runs of different pace (a synchronous and an asynchronous run of the same
    setting) split into what the fleet model charges, by least squares over the runs (``c``: the
    costs measured otherwise):

    * each worker: ``idle × span + gen_batch_s × batches + per_prompt × prompts`` on top of its
      weight loads (``follow_s`` each); ``per_prompt`` = ``gen_group_s`` (kept from the engine
      probe: it only decides which part falls before ``published_at``) + ``worker_group_s``;
    * the broker: ``idle × span + broker_growth_cores_per_prompt × prompts in the log × span +
      broker_group_s × prompts`` (a prompt record and a group record each), over each window's
      ``broker_pieces``: the embedded broker's load grows with its log;
    * the curator: ``idle × span + curator_prompt_s × prompts dispatched``;
    * the trainer: ``idle × span`` on top of its steps, publications and intake decoding
      (``trainer_step_s``, ``publish_s``, ``intake_group_s``).

    The idle terms (client and broker sides of held fetches, heartbeats, timers) add up to the
    machine's background: ``background_cores``."""
    import numpy as np

    def solve(a: list[list[float]], b: list[float], what: str) -> list[float]:
        a = np.array(a, dtype=float)
        scaled = a / np.abs(a).max(axis=0)  # columns of different units: the rank of their shapes
        if np.linalg.matrix_rank(scaled, tol=1e-3) < a.shape[1]:
            raise ValueError(f"the runs do not separate the {what} costs (their counts are proportional); measure runs "
                             "of different pace (a synchronous and an asynchronous one)")
        return [float(v) for v in np.linalg.lstsq(a, np.array(b, dtype=float), rcond=None)[0]]

    w_idle, batch_s, prompt_s = solve(
        [[w["span_s"], x["batches"], x["prompts"]] for w in windows for x in w["workers"].values()],
        [x["cpu_s"] - c["follow_s"] * x["loads"] for w in windows for x in w["workers"].values()], "workers'")

    pieces = [p for w in windows for p in w["broker_pieces"]]
    shape = [[p["span_s"], p["span_s"] * p["log_prompts"], p["prompts"]] for p in pieces]
    b_idle, growth, broker_s = solve(shape, [p["cpu_s"] for p in pieces], "broker")
    broker_rms = float(np.sqrt(np.mean([((np.dot(x, [b_idle, growth, broker_s]) - p["cpu_s"]) / p["cpu_s"]) ** 2
                                        for x, p in zip(shape, pieces, strict=True)])))
    growth = max(0.0, growth)  # a broker whose load does not grow fits about 0, either side
    c_idle, curator_s = solve([[w["span_s"], w["prompts"]] for w in windows], [w["cpu_s"]["curator"] for w in windows],
                              "curator")
    per_version = c["trainer_step_s"] + c["publish_s"]
    t_idle = sum(w["cpu_s"]["trainer"] - w["versions"] * per_version - w["groups"] * c["intake_group_s"]
                 for w in windows) / sum(w["span_s"] for w in windows)
    n_workers = len(windows[0]["workers"])
    fitted = {"gen_batch_s": batch_s, "worker_group_s": prompt_s - c["gen_group_s"],
              "broker_group_s": broker_s, "curator_prompt_s": curator_s}
    bad = [k for k, v in fitted.items() if v <= 0]
    if bad:
        raise ValueError(f"the runs do not separate {bad} (fitted ≤ 0: {fitted}); measure runs of more "
                         "different pace (a synchronous and an asynchronous one) on a quiet machine")
    return {"costs": {k: round(v, 5) for k, v in fitted.items()} | {"broker_growth_cores_per_prompt": round(growth, 9),
                                                                   "broker_idle_cores": round(b_idle, 4)},
            "idle_cores": {"worker_each": round(w_idle, 4), "broker": round(b_idle, 4),
                           "curator": round(c_idle, 4), "trainer": round(t_idle, 4)},
            "background_cores": round(w_idle * n_workers + b_idle + c_idle + max(0.0, t_idle), 4),
            "broker_fit_relative_rms": round(broker_rms, 4),
            "windows": [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in w.items()
                         if k not in ("workers", "broker_pieces")}
                        | {"workers": {n: {k: round(v, 2) for k, v in x.items()} for n, x in w["workers"].items()}}
                        for w in windows]}
