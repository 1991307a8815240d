"""What ``benchmarks.fleet_model``'s measuring options write into the costs file, each figure with its
source: the contention probe, the versions to the target from ``benchmarks.staleness``, the CPU split of
runs of different pace, and the costs of a finished run (with the calibration pairs' figures)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from benchmarks.fleet.calibrate import TARGET_REWARDS
from benchmarks.fleet.measure import (busy_share, cpu_costs, informative_by_window, measure, nearest_target, run_window,
                                      staleness_points, startup)
from benchmarks.fleet.model import MIX, background_cores, load_costs
from benchmarks.fleet.probe import measure_contention


def record_contention(costs: Path) -> dict:
    """This machine's contention into ``costs``; the probe's figures."""
    doc = json.loads(costs.read_text())
    probe = measure_contention()
    doc["costs"]["contention"] = probe["contention"]
    doc.setdefault("sources", {})["contention"] = (
        f"benchmarks.fleet_model --measure-contention: one torch thread alone {probe['alone_s']} s, beside a "
        f"second busy one {probe['beside_s']} s")
    costs.write_text(json.dumps(doc, indent=2) + "\n")
    return probe


def record_versions_to_target(costs: Path, staleness_from: Path) -> list[list[float]]:
    """The versions to the calibration pairs' target against the mean lag, from ``benchmarks.staleness
    --json`` output, into ``costs``; those points."""
    doc, result = json.loads(costs.read_text()), json.loads(staleness_from.read_text())
    target = statistics.median(TARGET_REWARDS)
    doc["costs"]["versions_to_target"] = staleness_points(result, target)
    key = str(nearest_target(result, target))
    doc["sources"]["versions_to_target"] = (
        f"benchmarks.staleness ({staleness_from}): versions to held-out {target} (the calibration pairs' target) "
        f"against the profiles' mean lag, median of {result.get('seeds', 1)} seeds: " + ", ".join(
            f"{name} (lag {p['lag_mean']}) {p['versions_to_targets'][key]}"
            for name, p in result["profiles"].items() if not p["overrides"]))
    costs.write_text(json.dumps(doc, indent=2) + "\n")
    return doc["costs"]["versions_to_target"]


def record_cpu(costs: Path, cpu_runs: list[Path], upto: int) -> dict:
    """The workers', broker's and curator's costs and the background from the per-process CPU of
    ``cpu_runs`` up to version ``upto``, into ``costs``; what ``cpu_costs`` measured."""
    doc = json.loads(costs.read_text())
    measured = cpu_costs([run_window(d, upto) for d in cpu_runs], doc["costs"])
    doc["costs"] |= measured["costs"]
    # The background as the model spreads it over readers (``background_cores``), matched to the measured total.
    readers = background_cores({**doc["costs"], "idle_reader_cores_at_20ms": 1.0}, len(MIX))
    doc["costs"]["idle_reader_cores_at_20ms"] = round(measured["background_cores"] / readers, 5)
    doc["cpu_measured"] = measured
    runs = ", ".join(str(d) for d in cpu_runs)
    for key in measured["costs"]:
        doc["sources"][key] = (f"benchmarks.fleet_model --measure-cpu {runs} --upto {upto}: least squares over the "
                               "runs' per-process CPU (cpu.jsonl) between a tenth of the versions and the last"
                               + ("; the broker's over ten equal pieces of each window, against the prompts "
                                  "dispatched in each and those already in the log" if key.startswith("broker") else "")
                               + "; see cpu_measured")
    doc["sources"]["idle_reader_cores_at_20ms"] = (
        f"the same runs: the idle CPU floor of workers, broker, curator and trainer together "
        f"({measured['background_cores']} cores, cpu_measured.idle_cores), spread over the readers as background_cores() does")
    costs.write_text(json.dumps(doc, indent=2) + "\n")
    return measured


def record_run(costs: Path, measure_dir: Path, pairs: Path | None) -> dict:
    """The costs of the finished run ``measure_dir`` into ``costs`` (with ``pairs``, the result.json of
    ``benchmarks.async_vs_sync --repeats N``: busy_share, startup_s and informative_by_window from its
    runs); what was measured (the file keeps its sources and ``cpu_measured`` besides)."""
    doc = measure(measure_dir, load_costs(costs))
    if pairs is not None:
        runs = [{m: Path(r.get(f"{m}_run_dir") or pairs.parent / f"{m}-{i}") for m in ("sync", "async")}
                for i, r in enumerate(json.loads(pairs.read_text())["repeats"], start=1)]
        doc["costs"]["busy_share"] = busy_share([r["sync"] for r in runs], [r["async"] for r in runs])
        doc["costs"]["startup_s"] = startup([d for r in runs for d in r.values()])
        doc["costs"]["informative_by_window"] = informative_by_window(runs, json.loads(pairs.read_text())["repeats"])
    previous = json.loads(costs.read_text())
    sources = previous.get("sources", {})
    if pairs is not None:
        sources["startup_s"] = (f"{pairs}: the first version's wall_s (from the trainer's start) in each run of the "
                                "pairs, median; time to the target = startup_s + the simulated steps' times to the versions needed")
        sources["informative_by_window"] = (
            f"{pairs}: groups trained / (trained + dropped by dynamic sampling) in each mode's runs after the first "
            "tenth, up to the version that reached the target (to_target) and over the whole run (whole_run), median "
            "over the pairs; the calibration takes the speed-up from to_target and the wait from whole_run")
    extra = {k: v for k, v in previous.items() if k == "cpu_measured"}  # --measure-cpu's record stays
    costs.write_text(json.dumps(doc | extra | {"sources": sources}, indent=2) + "\n")
    return doc
