"""A fleet model, calibrated on this machine and checked: asynchronous against synchronous
training from 4 workers on two shared cores to 1,000 workers in four regions.

    .venv/bin/python -m benchmarks.fleet_model --json           # calibration + projections
    .venv/bin/python -m benchmarks.fleet_model --measure RUN_DIR # costs of a finished rlbus run

The mechanism is ``benchmarks.fleet_sim`` (a SimPy discrete-event simulation of curator,
workers, broker, trainer and store; its docstring says what each does). This module feeds it the
costs of ``benchmarks/fleet_costs.json`` (``sources`` there says where each comes from) and:

1. **Calibration**: the 2-core setting of ``benchmarks.async_vs_sync`` (default config: B = 32,
   η = 0 and 4, workers at speeds 1, 1, 0.5, 0.25 at nice 10 throttled by sleeping, trainer,
   curator and broker at nice 0, all on one 2-core pool, the idle CPU floor measured by
   ``--measure-cpu`` taken off the top but for the embedded broker's polling, which grows with its
   log and competes at nice 0: ``broker_polling``). Each window is simulated over its own length
   (to past the target, and the pairs' whole run), since the broker slows as its log grows. Time
   to the target = ``startup_s`` + the simulated steps' times to version ``versions``
   (``time_per_version_s`` each beyond them), versions = ``versions_needed(mean staleness)``: the line through the
   staleness benchmark's versions to the same target at mean lags 0, 1 and the asynchronous runs'
   own lags (``--staleness-from``). Each figure is predicted with the share of informative groups
   of the window it is measured over (``informative_by_window``). Compared with the measured
   speed-ups (``benchmarks.async_vs_sync --repeats 3``: 2.96, 2.15, 2.48, median 2.48) and
   asynchronous trainer waits (0.505, 0.505, 0.504); ``calibration_*_error`` = |predicted −
   median measured| / median measured, ≤ 0.20. ``mechanism`` sets figures the model is not fitted
   on (each worker's prompts per batch and share of steps, the mean staleness) beside the runs'.
2. **Projection (a)**: the same costs, each worker on a machine of its own (one core, nothing
   shared), the trainer and the services (broker, curator) on machines of their own; 4, 16 and
   64 workers, half at speed 1, a quarter at 0.5, a quarter at 0.25.
3. **Projection (b)**: 1,000 workers in 4 regions (RTT 100–300 ms, WAN 10–1 Gbit/s), 10% of
   workers preempted per hour, weights of a model of ``FleetAssumptions.params`` parameters
   moved as deltas (README's measured bytes per parameter) or as full bf16 weights; every
   assumption is printed with the result.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.fleet_sim import Region, Scenario, Sim, WorkerSpec
from rlbus.report.summary import read_metrics

COSTS = Path(__file__).with_name("fleet_costs.json")
FIGURES = Path(__file__).with_name("figures")
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
MIX = (1.0, 1.0, 0.5, 0.25)
GBIT = 1e9 / 8


def load_costs(path: Path = COSTS) -> dict:
    return json.loads(path.read_text())["costs"]


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


def _common(c: dict, eta: int, workers: list[WorkerSpec], **kw) -> Scenario:
    fields = {f.name for f in dataclasses.fields(Scenario)}
    base = {k: v for k, v in c.items() if k in fields}
    return Scenario(**{**base, "groups_per_step": 32, "max_staleness": eta, "workers": workers, **kw})


def calibration_scenario(c: dict, eta: int, *, steps: int = 220, seed: int = 0) -> Scenario:
    """This machine: everything on one 2-core pool (benchmarks.async_vs_sync's setting)."""
    workers = [WorkerSpec(speed, "host", nice=10) for speed in MIX]
    # The embedded broker's polling, growing with its log, competes with the other processes
    # (broker_polling); the rest of the idle floor is the machine's background.
    polling = "broker_idle_cores" in c
    background = background_cores(c, len(MIX)) - c.get("broker_idle_cores", 0.0)
    return _common(c, eta, workers, cores={"host": 2.0}, background_cores={"host": background}, broker_polling=polling,
                   pool_contention={"host": c.get("contention", 0.0)}, pool_busy_share={"host": c.get("busy_share", 1.0)},
                   trainer_pool="host", curator_pool="host", broker_pool="host", steps=steps, seed=seed)


def dedicated_scenario(c: dict, eta: int, n: int, *, steps: int = 220, seed: int = 0) -> Scenario:
    """Projection (a): each worker on a one-core machine of its own; trainer and services apart."""
    workers = [WorkerSpec(MIX[i % 4], f"w{i}", nice=0) for i in range(n)]
    # The broker's idle polling grows with the readers (background_cores): the services machine is given
    # those cores on top of 4, so that it never limits.
    cores = {"trainer": 2.0, "services": 4.0 + background_cores(c, n), **{f"w{i}": 1.0 for i in range(n)}}
    # The embedded broker's growth with its log (broker_growth_cores_per_prompt) is left out: the services
    # machine's spare cores absorb it.
    return _common(c, eta, workers, cores=cores, background_cores={"services": background_cores(c, n)},
                   prompt_partitions=max(32, n), broker_growth_cores_per_prompt=0.0,
                   trainer_pool="trainer", curator_pool="services", broker_pool="services", steps=steps, seed=seed)


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


def compare(sync: dict, asyn: dict) -> float:
    return round(sync["time_to_target_s"] / asyn["time_to_target_s"], 3)


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


def projection_a(c: dict, sizes=(4, 16, 64), steps: int = 220) -> list[dict]:
    out = []
    for n in sizes:
        sync, asyn = (predict(c, dedicated_scenario(c, eta, n, steps=steps)) for eta in (0, 4))
        out.append({"workers": n, "sync": _public(sync), "async": _public(asyn), "speedup_time_to_target": compare(sync, asyn)})
    return out


def _public(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith("_") and k != "groups_by_worker"}


@dataclass(frozen=True)
class FleetAssumptions:
    """Projection (b). None of these is measured by rlbus: they are stated, and printed."""

    params: float = 7.6e9  # a 7B-class model (Qwen2.5-7B's 7.6B parameters)
    groups_per_step: int = 1024
    max_staleness: int = 4
    trainer_step_s: float = 60.0  # one optimizer step on its own cluster
    gen_batch_s: float = 120.0  # long reasoning rollouts on one GPU: the batch's longest sequence...
    gen_group_s: float = 10.0  # ...plus 10 s of decode throughput per group of 8 samples
    encode_gb_per_s: float = 0.59  # README, one core: publish cost per GB of weights
    apply_gb_per_s: float = 0.98  # README, one core: a worker's apply cost per GB
    regions: tuple = (("us", 0.10, 10.0), ("eu", 0.15, 5.0), ("ap", 0.20, 2.5), ("sa", 0.30, 1.0))  # (name, RTT s, Gbit/s)
    mirror_s: float = 1.0  # MirrorMaker 2 lag each way
    replication_lag_s: float = 5.0  # object-store replication lag before the copy starts
    replica_gbps: float = 100.0  # a regional replica bucket's aggregate bandwidth
    worker_gbps: float = 10.0  # a worker's NIC
    preempted_per_hour: float = 0.10
    replace_s: float = 300.0  # a new spot machine boots and starts its engine
    rebalance_s: float = 10.0
    hop_latency_s: float = 0.01  # Apache Kafka answers a fetch at once: linger + network
    steps: int = 30
    warmup_steps: int = 8


def fleet_scenario(c: dict, a: FleetAssumptions, n: int, *, eta: int | None = None, full_weights: bool = False,
                   preempt: bool = True, seed: int = 0) -> Scenario:
    regions = {"local": Region("local")}
    for name, rtt, gbps in a.regions:
        regions[name] = Region(name, rtt_s=rtt, wan_bytes_per_s=gbps * GBIT, mirror_s=a.mirror_s,
                               replication_lag_s=a.replication_lag_s, replica_bytes_per_s=a.replica_gbps * GBIT,
                               worker_bytes_per_s=a.worker_gbps * GBIT, store_rtt_s=0.01)
    names = [r[0] for r in a.regions]
    # Two "cores" per worker machine: its GPU generates, one host core applies deltas.
    workers = [WorkerSpec(MIX[i % 4], f"w{i}", region=names[(i // 4) % len(names)], nice=0, throttled=False)
               for i in range(n)]  # every region gets the whole speed mix
    full = a.params * c["full_bytes_per_param"]
    return Scenario(
        groups_per_step=a.groups_per_step, max_staleness=a.max_staleness if eta is None else eta, workers=workers,
        cores={"trainer": 2.0, "services": 16.0, **{f"w{i}": 2.0 for i in range(n)}},
        trainer_step_s=a.trainer_step_s, publish_s=full / 1e9 / a.encode_gb_per_s,
        gen_batch_s=a.gen_batch_s, gen_group_s=a.gen_group_s, informative_fraction=c["informative_fraction"],
        follow_s=full / 1e9 / a.apply_gb_per_s, trainer_pool="trainer", curator_pool="services",
        broker_pool="services", max_prompts_per_poll=c["max_prompts_per_poll"], hop_latency_s=a.hop_latency_s,
        prompt_partitions=max(32, n),  # kafka.prompt_partitions: one per worker at least
        assignment="sticky",  # infra/: Apache Kafka with cooperative-sticky assignment
        regions=regions, delta_bytes=a.params * c["delta_bytes_per_param"], full_bytes=full,
        anchor_every=c["anchor_every"], full_weights=full_weights, rebalance_s=a.rebalance_s, replace_s=a.replace_s,
        preempt_per_worker_per_s=a.preempted_per_hour / 3600 if preempt else 0.0,
        steps=a.steps, warmup_steps=a.warmup_steps, seed=seed, max_time_s=a.steps * 20 * a.trainer_step_s)


def _fleet_row(sc: Scenario, r: dict) -> dict:
    per_region = {}
    for name, region in sc.regions.items():
        if name == "local":
            continue
        prop = r["propagation"].get(name, {})
        per_region[name] = {"wan_gb_per_version": round(r["wan_bytes_per_version"][name] / 1e9, 3),
                            "to_workers_gb_per_version": round(r["replica_bytes_per_version"][name] / 1e9, 2),
                            "p99_reach_s": None if not prop else round(prop["p99_reach_s_median"], 1),
                            "p99_reach_s_max": None if not prop else round(prop["p99_reach_s_max"], 1)}
    amortized = sc.full_bytes if sc.full_weights else sc.delta_bytes + sc.full_bytes / sc.anchor_every
    return {"workers": len(sc.workers), "full_weights": sc.full_weights, "eta": sc.max_staleness,
            "wan_gb_per_version_with_anchors": round(amortized / 1e9, 3),
            "steps": r["steps"], "time_per_version_s": round(r["time_per_version_s"], 1),
            "trainer_wait_fraction": round(r["trainer_wait_fraction"], 3), "mean_staleness": round(r["mean_staleness"], 2),
            "stale_dropped_fraction": round(r["stale_dropped_fraction"], 4), "preemptions": r["preemptions"],
            "regions": per_region}


def projection_b(c: dict, a: FleetAssumptions, sizes=(125, 250, 500, 1000, 2000)) -> dict:
    def one(n: int, **kw) -> dict:
        sc = fleet_scenario(c, a, n, **kw)
        row = _fleet_row(sc, Sim(sc).run())
        print(f"[fleet] {n} workers {kw}: wait {row['trainer_wait_fraction']:.2f}, "
              f"{row['time_per_version_s']:.0f} s/version", file=sys.stderr, flush=True)
        return row

    return {"assumptions": dataclasses.asdict(a) | {"delta_bytes": a.params * c["delta_bytes_per_param"],
                                                    "full_bytes": a.params * c["full_bytes_per_param"],
                                                    "informative_fraction": c["informative_fraction"]},
            "by_fleet_size": [one(n) for n in sizes],
            "full_weights_1000": one(1000, full_weights=True),
            "sync_1000": one(1000, eta=0)}


def markdown(cal: dict, pa: list[dict], pb: dict) -> str:
    lines = ["| setting | predicted | measured | error |", "|---|---|---|---|",
             f"| 2 cores, speed-up to target | {cal['predicted_speedup_time_to_target']:.2f}× | "
             f"{cal['target_speedup_time_to_target']['median']:.2f}× (runs {', '.join(map(str, cal['target_speedup_time_to_target']['runs']))}) | "
             f"{cal['calibration_speedup_error']:.0%} |",
             f"| 2 cores, async trainer wait | {cal['predicted_async_trainer_wait_fraction']:.0%} | "
             f"{cal['target_async_trainer_wait_fraction']['median']:.1%} | {cal['calibration_wait_error']:.0%} |", "",
             "| workers, own machines | sync s/version | async s/version | async wait | async staleness | "
             "sync / async time to target |", "|---|---|---|---|---|---|"]
    for row in pa:
        lines.append(f"| {row['workers']} | {row['sync']['time_per_version_s']:.3f} | {row['async']['time_per_version_s']:.3f} "
                     f"| {row['async']['trainer_wait_fraction']:.0%} | {row['async']['mean_staleness']:.2f}"
                     f"{'*' if row['async']['staleness_extrapolated'] else ''} | "
                     f"{row['sync']['time_to_target_s']:.0f} s / {row['async']['time_to_target_s']:.0f} s = "
                     f"{row['speedup_time_to_target']:.2f}× |")
    names = [r[0] for r in pb["assumptions"]["regions"]]
    lines += ["", "| workers (4 regions) | weights | s/version | trainer wait | mean staleness | GB per version "
              "over each region's WAN (anchors amortized) | GB per version, replica to a region's workers (mean) | "
              f"s to 99% of workers ({', '.join(names)}) |", "|---|---|---|---|---|---|---|---|"]
    for row in [*pb["by_fleet_size"], pb["full_weights_1000"], pb["sync_1000"]]:
        kind = ("full" if row["full_weights"] else "deltas") + (", sync (η = 0)" if row["eta"] == 0 else "")
        regions = row["regions"].values()
        reach = " / ".join("—" if g["p99_reach_s"] is None else f"{g['p99_reach_s']:.0f}" for g in regions)
        to_workers = statistics.fmean(g["to_workers_gb_per_version"] for g in regions)
        lines.append(f"| {row['workers']} | {kind} | {row['time_per_version_s']:.0f} | {row['trainer_wait_fraction']:.0%} "
                     f"| {row['mean_staleness']:.2f} | {row['wan_gb_per_version_with_anchors']:.2f} | {to_workers:.0f} "
                     f"| {reach} |")
    return "\n".join(lines)


def plots(cal: dict, pa: list[dict], pb: dict, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    n = [r["workers"] for r in pa]
    ax1.plot(n, [r["sync"]["time_to_target_s"] for r in pa], "o-", label="synchronous (η = 0)")
    ax1.plot(n, [r["async"]["time_to_target_s"] for r in pa], "o-", label="asynchronous (η = 4)")
    ax1.axhline(cal["predicted"]["async"]["time_to_target_s"], ls=":", c="grey", label="async, 4 workers on 2 shared cores")
    ax1.set(xscale="log", xlabel="workers, each on its own machine", ylabel="predicted time to target (s)",
            title="(a) the default task, own machines")
    ax1.set_xticks(n, [str(x) for x in n])
    ax1.minorticks_off()
    ax1.legend()
    rows = pb["by_fleet_size"]
    ax2.plot([r["workers"] for r in rows], [r["trainer_wait_fraction"] for r in rows], "o-")
    ax2.set(xscale="log", xlabel="workers (4 regions, 10%/h preempted)", ylabel="trainer wait fraction",
            title=f"(b) {pb['assumptions']['params'] / 1e9:.1f}B model, B = {pb['assumptions']['groups_per_step']}, η = 4")
    ax2.set_xticks([r["workers"] for r in rows], [str(r["workers"]) for r in rows])
    ax2.minorticks_off()
    fig.tight_layout()
    first = out / "fleet_time_to_target_and_wait.png"
    fig.savefig(first, dpi=110)
    plt.close(fig)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    delta, full = pb["by_fleet_size"][[r["workers"] for r in rows].index(1000)], pb["full_weights_1000"]
    names = list(delta["regions"])
    x = range(len(names))
    for shift, row, label in ((-0.2, delta, "deltas"), (0.2, full, "full weights")):
        ax1.bar([i + shift - 0.1 for i in x], [row["wan_gb_per_version_with_anchors"]] * len(names), 0.2,
                label=f"{label}: over the WAN (anchors amortized)")
        ax1.bar([i + shift + 0.1 for i in x], [row["regions"][r]["to_workers_gb_per_version"] for r in names], 0.2,
                label=f"{label}: replica to the region's workers", alpha=0.6)
    ax1.set(yscale="log", ylabel="GB per version", title="weight bytes per region per step, 1,000 workers")
    ax1.set_xticks(list(x), names)
    ax1.legend(fontsize=7)
    for row, label in ((delta, "deltas"), (full, "full weights")):
        ax2.plot(names, [row["regions"][r]["p99_reach_s"] or float("nan") for r in names], "o-", label=label)
    ax2.set(yscale="log", ylabel="s from publication to 99% of the region's workers", title="version propagation, 1,000 workers")
    ax2.legend()
    fig.tight_layout()
    second = out / "fleet_weights_by_region.png"
    fig.savefig(second, dpi=110)
    plt.close(fig)
    return [str(first), str(second)]


LOADED = re.compile(r"weights v(\d+) loaded via (\S+) \((\d+) bytes, ([0-9.]+)s\)")


def _rows(run_dir: Path) -> list[dict]:
    """A finished run's metrics rows, the start-up (first tenth) left out."""
    rows = read_metrics(run_dir / "metrics.jsonl")
    if len(rows) < 10:
        raise typer.BadParameter(f"{run_dir}/metrics.jsonl has {len(rows)} rows; measure a finished run")
    return rows[len(rows) // 10:]


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


WORKER_TOTALS = re.compile(r"worker ran ([0-9.]+)s: (\d+) prompts in (\d+) batches")


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


PROBE = """
import sys, time, torch
torch.set_num_threads(1)
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(d_model=128, nhead=4, dim_feedforward=512, batch_first=True)
x = torch.randn(32, 16, 128)
def once():
    layer(x).square().mean().backward()
for _ in range(5):
    once()
if sys.argv[1] == "spin":
    end = time.monotonic() + float(sys.argv[2])
    while time.monotonic() < end:
        once()
else:
    times = []
    for _ in range(int(sys.argv[2])):
        t = time.perf_counter()
        for _ in range(20):
            once()
        times.append(time.perf_counter() - t)
    print(sorted(times)[len(times) // 2])
"""


def measure_contention(rounds: int = 15) -> dict:
    """The slowdown of one CPU-bound thread (a transformer layer's forward and backward, one torch
    thread, as the trainer and the workers run) while a second one runs beside it, against alone:
    ``contention`` = t_beside / t_alone − 1 (0 on cores that share nothing; a small VM's vCPUs share
    physical cores and caches). Run it on a quiet machine."""
    import subprocess

    def timed() -> float:
        out = subprocess.run([sys.executable, "-c", PROBE, "time", str(rounds)], capture_output=True, text=True,
                             check=True)
        return float(out.stdout.strip())

    alone = timed()
    spinner = subprocess.Popen([sys.executable, "-c", PROBE, "spin", str(10 * alone * rounds / 20 + 30)])
    try:
        time.sleep(3.0)  # the spinner is past its start-up
        beside = timed()
    finally:
        spinner.kill()
        spinner.wait()
    return {"alone_s": round(alone, 4), "beside_s": round(beside, 4), "contention": round(beside / alone - 1.0, 3)}


def intake_cost(tokens_per_group: int, group_size: int = 8, seconds: float = 2.0) -> float:
    """CPU seconds the trainer's intake spends decoding and checking one group of this shape
    (``decode_group`` as the intake calls it; the Kafka client's own work is left out)."""
    import numpy as np

    from broker.codec import decode_group, encode_group
    from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader

    rng, n = np.random.default_rng(0), max(group_size, tokens_per_group)
    per = n // group_size
    values = []
    for i in range(64):
        header = TrajectoryHeader(
            run="probe", policy="main", group_id=f"g{i}", prompt_id=f"p{i}", task="addition", worker_id="worker-0",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=per), rewards=[1.0, 0.0] * (group_size // 2),
            finish_reasons=["stop"] * group_size, min_version=1, max_version=1, vocab_size=64, created_at=time.time())
        values.append(encode_group(TrajectoryGroup(
            header=header, prompt_tokens=rng.integers(0, 64, 10).astype(np.int32),
            completion_tokens=rng.integers(0, 64, per * group_size).astype(np.int32),
            completion_offsets=np.arange(0, per * group_size + 1, per, dtype=np.int32),
            behaviour_logprobs=-rng.random(per * group_size).astype(np.float32),
            token_versions=np.ones(per * group_size, np.int32))))
    count, start = 0, time.process_time()
    while time.process_time() - start < seconds:
        decode_group(values[count % len(values)], vocab_size=64)
        count += 1
    return (time.process_time() - start) / count


def main(
    json_out: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    costs: Annotated[Path, typer.Option(help="Costs file.")] = COSTS,
    measure_dir: Annotated[Path | None, typer.Option("--measure", help="Write the costs of this finished run directory to --costs and stop.")] = None,
    contention: Annotated[bool, typer.Option("--measure-contention", help="Measure the CPU contention of this machine into --costs and stop.")] = False,
    pairs: Annotated[Path | None, typer.Option("--busy-share-from", help="With --measure: the result.json of `benchmarks.async_vs_sync --repeats N`, whose pairs give busy_share and startup_s.")] = None,
    cpu_runs: Annotated[list[Path] | None, typer.Option("--measure-cpu", help="Finished runs of the calibration setting at different pace (a synchronous and an asynchronous one; repeatable) whose per-process CPU (cpu.jsonl) gives the workers', broker's and curator's costs and the background; written to --costs.")] = None,
    upto: Annotated[int, typer.Option(help="With --measure-cpu: measure up to this version (about where the runs reach their target).")] = 500,
    staleness_from: Annotated[Path | None, typer.Option("--staleness-from", help="`benchmarks.staleness --json` output: its versions to the calibration pairs' target (the median of TARGET_REWARDS) against the mean lag become versions_to_target in --costs.")] = None,
    targets: Annotated[Path | None, typer.Option(help="result.json of `benchmarks.async_vs_sync --repeats N` to calibrate against.")] = None,
    quick: Annotated[bool, typer.Option(help="Fewer steps and seeds (a smoke run).")] = False,
    figures: Annotated[Path, typer.Option(help="Where the plots go.")] = FIGURES,
) -> None:
    """Calibrate the fleet model on this machine's measured figures, then project."""
    if contention:
        doc = json.loads(costs.read_text())
        probe = measure_contention()
        doc["costs"]["contention"] = probe["contention"]
        doc.setdefault("sources", {})["contention"] = (
            f"benchmarks.fleet_model --measure-contention: one torch thread alone {probe['alone_s']} s, beside a "
            f"second busy one {probe['beside_s']} s")
        costs.write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(probe, indent=1))
        return
    if staleness_from is not None:
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
        print(json.dumps(doc["costs"]["versions_to_target"]))
        return
    if cpu_runs:
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
        print(json.dumps(measured, indent=1))
        return
    if measure_dir is not None:
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
        print(json.dumps(doc, indent=1))
        return
    c = load_costs(costs)
    goal, pair_steps = TARGETS, PAIR_STEPS
    if targets is not None:
        doc = json.loads(targets.read_text())
        goal = {k: doc["summary"][k]["values"] for k in TARGETS}
        pair_steps = doc["repeats"][0]["async_steps"]
    steps, seeds = (80, (0,)) if quick else (220, (0, 1, 2))
    a = FleetAssumptions(steps=12, warmup_steps=4) if quick else FleetAssumptions()
    cal = calibrate(c, seeds, steps if quick else None, goal, pair_steps)
    pa = projection_a(c, steps=steps)
    pb = projection_b(c, a, sizes=(250, 1000) if quick else (125, 250, 500, 1000, 2000))
    table = markdown(cal, pa, pb)
    result = {**cal, "projection_own_machines": pa, "projection_fleet": pb, "table_markdown": table,
              "plots": plots(cal, pa, pb, figures), "costs_provisional": json.loads(costs.read_text()).get("provisional")}
    if json_out:
        print(json.dumps(result))
    else:
        print(table)
        print(json.dumps({k: v for k, v in cal.items()}, indent=1))


if __name__ == "__main__":
    typer.run(main)
