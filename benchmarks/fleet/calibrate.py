"""Calibration: the 2-core setting of ``benchmarks.async_vs_sync`` simulated from the costs, against the
speed-ups and trainer waits those runs measured (``benchmarks.fleet_model``'s docstring says how)."""

from __future__ import annotations

import math
import statistics

from benchmarks.fleet.model import MIX, background_cores, base_scenario, predict, versions_needed
from benchmarks.fleet.sim import Scenario, WorkerSpec

TARGETS = {"speedup_time_to_target": [2.96, 2.15, 2.48], "async_trainer_wait_fraction": [0.505, 0.505, 0.504]}
"""Measured by ``benchmarks.async_vs_sync --repeats 3`` on the 2-core machine (README)."""
PAIR_STEPS = 900
"""Those runs' length in versions (the asynchronous wait is measured over the whole run)."""
MECHANISM = {"sync": {"prompts_per_batch": [3.22, 3.21, 1.86, 1.12], "steps_with_worker": [1.0, 1.0, 0.98, 0.56],
                      "mean_staleness": 0.0},
             "async": {"prompts_per_batch": [12.64, 12.44, 6.97, 2.25], "steps_with_worker": [0.99, 0.99, 0.84, 0.46],
                       "mean_staleness": 1.386}}
"""The same pairs, per worker (speeds 1, 1, 0.5, 0.25); see ``calibrate``."""
ALONG_THE_RUN = {"sync": [0.517, 0.426, 0.539, 0.713, 0.744, 0.849, 1.033, 1.318, 1.707],
                 "async": [0.267, 0.182, 0.199, 0.236, 0.261, 0.266, 0.281, 0.317, 0.394]}
"""The same pairs' seconds per version in each 100 versions (metrics.jsonl step_wall_s), mean of the three."""
TARGET_REWARDS = [0.851, 0.849, 0.856]
"""The held-out accuracy those pairs' times to the target are counted to."""


def calibration_scenario(c: dict, eta: int, *, steps: int = 220, seed: int = 0) -> Scenario:
    """This machine: everything on one 2-core pool (benchmarks.async_vs_sync's setting)."""
    workers = [WorkerSpec(speed, "host", nice=10) for speed in MIX]
    # The embedded broker's polling, growing with its log, competes with the other processes
    # (broker_polling); the rest of the idle floor is the machine's background.
    polling = "broker_idle_cores" in c
    background = background_cores(c, len(MIX)) - c.get("broker_idle_cores", 0.0)
    return base_scenario(c, eta, workers, cores={"host": 2.0}, background_cores={"host": background},
                         broker_polling=polling, pool_contention={"host": c.get("contention", 0.0)},
                         pool_busy_share={"host": c.get("busy_share", 1.0)}, trainer_pool="host", curator_pool="host",
                         broker_pool="host", steps=steps, seed=seed)


def calibrate(c: dict, seeds: tuple[int, ...] = (0, 1, 2), steps: int | None = None, targets: dict = TARGETS,
              pair_steps: int = PAIR_STEPS) -> dict:
    """The 2-core setting, each mode over ``seeds``, against the measured figures. Each window is
    simulated over its own length (the broker slows as its log grows): past the most versions to
    the target, and the pairs' ``pair_steps``; ``steps`` sets both (a shorter smoke run)."""
    # Each figure from costs of the window it is measured over: the speed-up from the versions up to the
    # target, the wait (benchmarks.async_vs_sync's, over the whole run) from the whole run; the share of
    # groups with signal is each mode's own in that window (``informative_by_window``).
    windows = c.get("informative_by_window", {})
    length = {"to_target": steps or math.ceil(1.1 * max(y for _, y in c["versions_to_target"])),
              "whole_run": steps or pair_steps}

    def scenario(mode: str, window: str, seed: int) -> Scenario:
        inf = windows.get(window, {}).get(mode, c["informative_fraction"])
        return calibration_scenario(c | {"informative_fraction": inf}, 0 if mode == "sync" else 4,
                                    steps=length[window], seed=seed)

    runs = {mode: [predict(c, scenario(mode, "to_target", s)) for s in seeds] for mode in ("sync", "async")}
    whole = [predict(c, scenario("async", "whole_run", s)) for s in seeds] if "whole_run" in windows else runs["async"]
    mean = {mode: {k: statistics.fmean(r[k] for r in rs) for k in ("time_per_version_s", "trainer_wait_fraction",
                                                                     "mean_staleness", "time_to_target_s")}
            for mode, rs in runs.items()}
    speedup = mean["sync"]["time_to_target_s"] / mean["async"]["time_to_target_s"]
    wait = statistics.fmean(r["trainer_wait_fraction"] for r in whole)
    t_speed, t_wait = (statistics.median(targets[k]) for k in ("speedup_time_to_target", "async_trainer_wait_fraction"))
    return {
        "calibration_speedup_error": round(abs(speedup - t_speed) / t_speed, 3),
        "calibration_wait_error": round(abs(wait - t_wait) / t_wait, 3),
        "predicted_speedup_time_to_target": round(speedup, 3),
        "predicted_async_trainer_wait_fraction": round(wait, 3),
        "informative_fraction_used": {mode: {w: windows.get(w, {}).get(mode, c["informative_fraction"])
                                             for w in ("to_target", "whole_run")} for mode in ("sync", "async")},
        "target_speedup_time_to_target": {"median": t_speed, "runs": targets["speedup_time_to_target"]},
        "target_async_trainer_wait_fraction": {"median": t_wait, "runs": targets["async_trainer_wait_fraction"]},
        "predicted": {mode: {k: round(v, 4) for k, v in m.items()} | {
            "versions_to_target": round(versions_needed(m["mean_staleness"], c["versions_to_target"])),
            "cpu_busy_fraction_of_free_cores": runs[mode][0]["cpu_busy_fraction"]["host"]} for mode, m in mean.items()},
        "measured_for_comparison": {"sync_s_per_version_to_target": [0.652, 0.576, 0.545],
                                    "async_s_per_version_to_target": [0.238, 0.238, 0.22],
                                    "sync_versions_to_target": [540, 460, 500], "async_versions_to_target": [500, 520, 500]},
        # Figures the model is not fitted on, each worker's (speeds 1, 1, 0.5, 0.25): prompts per batch (the
        # workers' closing log lines) and the share of steps that trained a group of it (metrics.jsonl), the
        # median over the pairs' runs; the asynchronous runs' mean staleness (1.367, 1.393, 1.386).
        "mechanism": {mode: {
            "prompts_per_batch": {"predicted": [round(statistics.fmean(r["_raw"]["prompts_per_batch"][i] for r in rs), 2)
                                                for i in range(len(MIX))], "measured": MECHANISM[mode]["prompts_per_batch"]},
            "steps_with_worker": {"predicted": [round(statistics.fmean(r["_raw"]["steps_with_worker"][i] for r in rs), 2)
                                                for i in range(len(MIX))], "measured": MECHANISM[mode]["steps_with_worker"]},
            "mean_staleness": {"predicted": round(statistics.fmean(r["mean_staleness"] for r in rs), 3),
                               "measured": MECHANISM[mode]["mean_staleness"]},
        } for mode, rs in (("sync", runs["sync"]), ("async", whole))},
        # Seconds per version in each 100 simulated versions (the synchronous to-target runs, the asynchronous
        # whole runs), mean over the seeds, beside the pairs'.
        "s_per_version_by_100_versions": {mode: {"predicted": by_100(rs), "measured": ALONG_THE_RUN[mode][:len(by_100(rs))]}
                                          for mode, rs in (("sync", runs["sync"]), ("async", whole))},
        "seeds": list(seeds), "steps": length,
        "background_cores": round(background_cores(c, len(MIX)), 3),
    }


def by_100(runs: list[dict]) -> list[float]:
    """Mean seconds per version in each whole 100 versions of ``runs`` (their simulated step times)."""
    steps = [[b - a for a, b in zip(t, t[1:], strict=False)] for t in (r["_raw"]["step_times"] for r in runs)]
    n = min(len(s) for s in steps) // 100
    return [round(statistics.fmean(x for s in steps for x in s[100 * k:100 * (k + 1)]), 3) for k in range(n)]
