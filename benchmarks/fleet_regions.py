"""The fleet model against a measured run of a hub and two regions (``benchmarks.regions``).

    .venv/bin/python -m benchmarks.fleet_regions --measured RESULT.json [--json]

``RESULT.json`` is ``benchmarks.regions --json``'s output. The scenario is built from it and from the
run directory it names (``runs.regions``: its ``config.json``, ``metrics.jsonl`` and ``cpu.jsonl``):

* **regions**: the hub (trainer, curator, broker, store and its own workers, all local) and each
  region behind its link (``links``: round trip = 2 × the one-way delay, the rate), its workers
  following a replica that ``rlbus replica`` fills across the link
  (``benchmarks.fleet.sim.Store._relay``); the cut region's link cut at the trainer's version when it
  went down for the measured ``cut_s``;
* **CPU**: as the fleet model's calibration (the costs of ``fleet_costs.json``, one 2-core pool,
  workers at the run's nice level, the broker's polling at nice 0); the processes that setting did
  not have (the links, the relays) weigh as the run measured them (``cpu.jsonl``), in the background;
* **inputs taken from the run**: the bytes of a delta and of the full weights, completion tokens per
  group, the share of groups with signal (dynamic sampling), and the start-up (the first version's
  wait, which the model does not simulate: the predicted run's first step is given it, as
  ``benchmarks.fleet.model.predict`` adds ``startup_s``). In that start-up each replica's first pass
  copied version 0's full weights: the predicted links carry them too, though not in time (no arrival
  of version 0).
* **the run's end**: after the trainer's last step its last version is published and copied to the
  replicas (``settle``); the simulation goes on until it is in each, ``SETTLE_S`` at most.

The predicted run is written as a run directory and read back by ``benchmarks.regions.by_region``,
the code that reads the measured one, so both sides are the same figures. Error = |predicted −
measured| / measured. What the model does not produce is listed as such, not estimated.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.fleet.model import COSTS, background_cores, load_costs
from benchmarks.fleet.sim import Region, Scenario, Sim, WorkerSpec
from benchmarks.options import JsonOption
from benchmarks.regions import by_region
from consumers.fleet import Propagation

HUB = "local"
"""The simulation's name for the hub (its trainer's and curator's hops); ``hub`` in the measured run."""
SETTLE_S = 60.0
"""At most this long after the trainer's last step for its last version to be published and reach every replica."""
LIVE_WORKER_WINDOW_S = 30.0
"""``trainer.loop.LIVE_WORKER_WINDOW_S``: a worker is live while a group of it was trained this recently."""
EXTRA_ROLES = ("link-", "replica-")
"""Processes of the regions run that the calibration setting did not have (their CPU is background here)."""
COMPARED = [  # (key of by_region's or the result's figures, per region?)
    ("bytes_per_version_by_region", True), ("propagation_p50_s_by_region", True),
    ("propagation_p99_s_by_region", True), ("replica_lag_p50_s_by_region", True),
    ("replica_lag_p99_s_by_region", True), ("staleness_by_region", True), ("tokens_per_s_by_region", True),
    ("copies_per_version_by_region", True), ("groups_trained_by_region", True),
    ("groups_dropped_stale_by_region", True), ("version_at_restore", False), ("catch_up_s", False),
    ("replica_catch_up_s", False), ("stale_dropped_by_cut", False), ("stale_dropped_per_s_outside_cut", False),
    ("rl_s", False), ("trainer_wait", False), ("tokens_per_s", False), ("generated_tokens_per_s", False),
    ("groups_dropped_stale", False), ("duplicates", False),
]
CPU_COSTS = ("trainer_step_s", "publish_s", "gen_batch_s", "gen_group_s", "worker_group_s", "broker_group_s",
             "curator_prompt_s", "follow_s", "intake_group_s", "idle_reader_cores_at_20ms", "broker_idle_cores",
             "broker_growth_cores_per_prompt")
"""The costs that are CPU work (``--cpu-scale`` multiplies them)."""
NOT_PREDICTED = {
    "trajectory_bytes_per_step_by_region": "the broker's hops carry no bytes (group sizes are not modelled)",
    "reward_start, reward_end, heldout_gain": "learning is not modelled",
    "groups_lost": "the model loses no record",
    "groups_trained_twice": "the model's trainer drops a prompt's second group as the intake does (never trains it)",
    "loopback, tokens_per_s_ratio, generated_tokens_per_s_ratio": "the baseline run is not simulated here",
    "replica lag of version 0": "copied in the start-up, which is not simulated (its bytes are counted)",
    "bytes of manifests, LATEST and HTTP on the store route": "the relay's transfers carry the chunks' bytes only",
    "stored_bytes_per_version, cut_s, cut_at_version, steps, workers": "inputs (the run's deltas, its cut, its size)",
}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_inputs(run_dir: Path) -> dict:
    """What the scenario takes from the measured run's directory."""
    if not (run_dir / "metrics.jsonl").exists():
        raise typer.BadParameter(f"{run_dir} has no metrics.jsonl: the result's runs.regions must name the run "
                                 "directory of benchmarks.regions (keep it, or run the benchmark again)")
    config, rows = json.loads((run_dir / "config.json").read_text()), _rows(run_dir / "metrics.jsonl")
    deltas = [r["publish_bytes"] for r in rows if r.get("publish_kind") == "delta"]
    dropped = rows[-1].get("stage/dynamic_sampling/dropped", 0)
    cpu = _rows(run_dir / "cpu.jsonl") if (run_dir / "cpu.jsonl").exists() else []
    extra = trainer_cpu = 0.0
    if len(cpu) > 1:
        span = cpu[-1]["time"] - cpu[0]["time"]
        extra = sum(v - cpu[0]["cpu_s"].get(k, 0.0) for k, v in cpu[-1]["cpu_s"].items()
                    if k.startswith(EXTRA_ROLES)) / span
        trainer_cpu = (cpu[-1]["cpu_s"]["trainer"] - cpu[0]["cpu_s"]["trainer"]) / len(rows)
    return {"hub_workers": config["local"]["workers"], "worker_nice": config["local"].get("worker_nice", 10),
            "region_workers": {r["name"]: r["workers"] for r in config["local"]["regions"]},
            "copy_workers": {r["name"]: r["replica"]["copy_workers"] for r in config["local"]["regions"]},
            "relay_poll_s": {r["name"]: r["replica"]["poll_interval_s"] for r in config["local"]["regions"]},
            "groups_per_step": config["trainer"]["groups_per_step"], "max_staleness": config["run"]["max_staleness"],
            "anchor_every": config["weights"]["anchor_every"], "chunk_bytes": config["weights"]["chunk_bytes"],
            "delta_bytes": statistics.fmean(deltas), "full_bytes": rows[0]["publish_full_bytes"],
            "tokens_per_group": sum(r["tokens"] for r in rows) / sum(r["groups"] for r in rows),
            "informative_fraction": rows[-1]["groups_trained"] / (rows[-1]["groups_trained"] + dropped),
            "startup_s": rows[0]["step_wall_s"], "startup_wait_s": rows[0]["wait_s"], "extra_cores": extra,
            "trainer_cpu_s_per_version": trainer_cpu}


def measured_extra(run_dir: Path) -> dict:
    """Figures of the measured run that ``benchmarks.regions`` does not print, from its ``summary.json``: the
    groups the intake dropped as copies of a prompt's group already taken, and the stale drops by region."""
    path = run_dir / "summary.json"
    if not path.exists():
        return {}
    summary = json.loads(path.read_text())
    return {"duplicates": summary.get("duplicates"), "groups_dropped_stale_by_region": {
        name: r["dropped_stale"] for name, r in summary.get("regions", {}).items() if "dropped_stale" in r}}


def trainer_cpu_per_version(c: dict, inputs: dict) -> float:
    """The trainer's CPU per version as the costs charge it: its step, its publication, the groups' intake."""
    return c["trainer_step_s"] + c["publish_s"] + c["intake_group_s"] * inputs["groups_per_step"] / inputs[
        "informative_fraction"]


def scenario(c: dict, measured: dict, inputs: dict, *, steps: int | None = None, seed: int = 0,
             cpu_scale: float = 1.0) -> Scenario:
    """The measured run as a scenario: its links, workers, steps and cut, on the calibration's CPU (each
    CPU cost × ``cpu_scale``: a machine that much slower per CPU-second)."""
    c = c | {k: c[k] * cpu_scale for k in CPU_COSTS if k in c}
    regions = {HUB: Region(HUB)}
    workers = [WorkerSpec(1.0, "host", region=HUB, nice=inputs["worker_nice"]) for _ in range(inputs["hub_workers"])]
    for name, link in measured["links"].items():
        cuts = [(measured["cut_at_version"], measured["cut_s"])] if name == measured.get("cut_region") else []
        regions[name] = Region(name, rtt_s=2 * link["delay_ms"] / 1000, wan_bytes_per_s=link["rate_mbit"] * 1e6 / 8,
                               reads_across=True, replication="relay", copy_workers=inputs["copy_workers"][name],
                               relay_poll_s=inputs["relay_poll_s"][name], cuts=cuts)
        workers += [WorkerSpec(1.0, "host", region=name, nice=inputs["worker_nice"])
                    for _ in range(inputs["region_workers"][name])]
    # As benchmarks.fleet.calibrate.calibration_scenario: the idle floor but the broker's polling (which
    # competes at nice 0 and grows with its log) in the background, with the links' and relays' measured CPU.
    background = background_cores(c, len(workers)) - c.get("broker_idle_cores", 0.0) + inputs["extra_cores"]
    fields = set(Scenario.__dataclass_fields__)
    return Scenario(**{**{k: v for k, v in c.items() if k in fields},
                       "groups_per_step": inputs["groups_per_step"], "max_staleness": inputs["max_staleness"],
                       "workers": workers, "cores": {"host": 2.0}, "background_cores": {"host": background},
                       "broker_polling": "broker_idle_cores" in c,
                       "pool_contention": {"host": c.get("contention", 0.0)},
                       "pool_busy_share": {"host": c.get("busy_share", 1.0)}, "trainer_pool": "host",
                       "curator_pool": "host", "broker_pool": "host", "regions": regions,
                       "informative_fraction": inputs["informative_fraction"], "delta_bytes": inputs["delta_bytes"],
                       "full_bytes": inputs["full_bytes"], "anchor_every": inputs["anchor_every"],
                       "chunk_bytes": inputs["chunk_bytes"], "steps": steps or measured["steps"], "warmup_steps": 0,
                       "seed": seed})


def _name(region: str) -> str:
    return "hub" if region == HUB else region


def settle(sim: Sim, cap_s: float = SETTLE_S) -> None:
    """The run's end after the trainer's last step: its last version is published and the relays copy it
    (the measured run's replicas held it 0.6 s and 1.7 s after the last step), ``cap_s`` at most."""
    if not sim.trainer.rows:
        return
    env, store, last = sim.env, sim.store, sim.trainer.rows[-1]["version"]
    end = env.now + cap_s
    while env.now < end and (last not in store.published_at or any(store.latest[n] < last for n in store.relay_hop)):
        env.run(until=min(end, env.now + 0.05))


def write_run(sim: Sim, inputs: dict, out: Path) -> None:
    """The simulated run as the files ``benchmarks.regions.by_region`` reads: metrics rows (with the
    trainer's propagation, replayed by its own ``Propagation`` over the groups trained), each region's
    link counters and cut, and its replica's arrivals. A relayed region's link also carries version 0's
    full weights, which its replica copied in the start-up (not simulated)."""
    sc, store, prop = sim.sc, sim.store, Propagation()
    region_of = {str(w.index): _name(w.spec.region) for w in sim.workers}
    published = sorted((v, t) for v, t in store.published_at.items() if v > 0)
    seen: dict[str, float] = {}
    rows, k = [], 0
    for i, r in enumerate(sim.trainer.rows):
        now = r["time"]
        while k < len(published) and published[k][1] <= now:
            prop.publish(*published[k])
            k += 1
        groups, lags = {}, {}
        for g, lag in zip(r["groups"], r["lags"], strict=True):
            w = str(g.worker)
            seen[w] = now
            prop.observe(w, g.min_version, g.created_at)
            groups[region_of[w]] = groups.get(region_of[w], 0) + 1
            lags.setdefault(region_of[w], []).append(lag)
        live = [w for w, t in seen.items() if now - t < LIVE_WORKER_WINDOW_S]
        reached = {n: prop.latest([w for w in live if region_of[w] == n]) for n in {region_of[w] for w in live}}
        v = r["version"]
        rows.append({
            "version": v, "time": now, "step_wall_s": inputs["startup_s"] if i == 0 else r["step_wall_s"],
            "wait_s": inputs["startup_wait_s"] if i == 0 else r["wait_s"], "groups_by_region": groups,
            "tokens_by_region": {n: g * inputs["tokens_per_group"] for n, g in groups.items()},
            "staleness_by_region": {n: sum(x) / len(x) for n, x in lags.items()},
            "propagation_by_region": {n: None if x is None else [x[0], x[1]] for n, x in reached.items()},
            "dropped_stale_by_region": {_name(n): d for n, d in r["dropped_stale_by_region"].items()},
            "publish_bytes": store.version_bytes(v), "publish_full_bytes": sc.full_bytes})
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    for name, region in sc.regions.items():
        if name == HUB:
            continue
        d = out / "regions" / name
        d.mkdir(parents=True, exist_ok=True)
        first = sc.full_bytes if region.replication == "relay" else 0.0
        link = {"routes": {"store": {"kafka": False, "bytes_down": store.wan[name].bytes_moved + first},
                           "broker": {"kafka": True, "bytes_up": 0, "bytes_down": 0}},
                "cuts": sim.cut_times.get(name, [])}
        (d / "link.json").write_text(json.dumps(link))
        (d / "arrivals.jsonl").write_text("".join(
            json.dumps({"version": v, "published_at": store.published_at[v], "arrived_at": t}) + "\n"
            for v, t in sorted(store.arrivals[name].items()) if v > 0))


def predict(c: dict, measured: dict, inputs: dict, *, steps: int | None = None, seed: int = 0,
            cpu_scale: float = 1.0) -> dict:
    """The simulated run's figures, as ``by_region`` reads them, and the run's (as ``benchmarks.regions.common``
    and ``measured_extra`` read them)."""
    sim = Sim(scenario(c, measured, inputs, steps=steps, seed=seed, cpu_scale=cpu_scale))
    sim.run()
    generated = sum(w.groups for w in sim.workers)  # by the last step (the measured count goes a little further)
    settle(sim)
    with tempfile.TemporaryDirectory(prefix="fleet-regions-") as tmp:
        write_run(sim, inputs, Path(tmp))
        rows = _rows(Path(tmp) / "metrics.jsonl")
        figures = by_region(Path(tmp), measured.get("cut_region"))
    rl_s = sum(r["step_wall_s"] for r in rows)
    trained = sum(len(r["lags"]) for r in sim.trainer.rows)
    figures |= {"rl_s": round(rl_s, 1), "trainer_wait": round(sum(r["wait_s"] for r in rows) / rl_s, 3),
                "tokens_per_s": round(trained * inputs["tokens_per_group"] / rl_s, 1),
                "generated_tokens_per_s": round(generated * inputs["tokens_per_group"] / rl_s, 1),
                "groups_dropped_stale": sim.trainer.dropped_stale, "duplicates": sim.trainer.duplicates,
                "groups_dropped_stale_by_region": {_name(n): sim.trainer.dropped_by_region.get(n, 0)
                                                   for n in sim.sc.regions}}
    return figures


def compare(predicted: dict, measured: dict) -> list[dict]:
    """One row per figure (and region): predicted, measured, relative error; None where either is missing."""
    out = []
    for key, per_region in COMPARED:
        pairs = ([(r, predicted.get(key, {}).get(r), measured.get(key, {}).get(r)) for r in measured.get(key, {})]
                 if per_region else [(None, predicted.get(key), measured.get(key))])
        for region, p, m in pairs:
            if p is None and m is None:
                continue
            error = None if p is None or m is None or m == 0 else round(abs(p - m) / abs(m), 3)
            out.append({"figure": key.removesuffix("_by_region"), "region": region, "predicted": p, "measured": m,
                        "error": error})
    return out


def table(rows: list[dict]) -> str:
    def cell(x) -> str:
        return "—" if x is None else f"{x:.3g}" if isinstance(x, float) else str(x)

    lines = ["| figure | region | predicted | measured | error |", "|---|---|---|---|---|"]
    lines += [f"| {r['figure']} | {r['region'] or ''} | {cell(r['predicted'])} | {cell(r['measured'])} | "
              f"{'—' if r['error'] is None else format(r['error'], '.0%')} |" for r in rows]
    return "\n".join(lines)


def main(
    measured_path: Annotated[Path, typer.Option("--measured", help="benchmarks.regions --json output.")],
    json_out: JsonOption = False,
    costs: Annotated[Path, typer.Option(help="Costs file.")] = COSTS,
    seed: Annotated[int, typer.Option(help="Simulation seed.")] = 0,
    cpu_scale: Annotated[float, typer.Option(help="Multiply every CPU cost (a machine this much slower per CPU-second; "
                                                  "the output suggests the run's trainer's ratio).")] = 1.0,
) -> None:
    """Simulate the measured regions run and print predicted against measured."""
    measured = json.loads(measured_path.read_text())
    run_dir = Path(measured["runs"]["regions"])
    inputs = run_inputs(run_dir)
    measured |= measured_extra(run_dir)
    c = load_costs(costs)
    predicted = predict(c, measured, inputs, seed=seed, cpu_scale=cpu_scale)
    rows = compare(predicted, measured)
    ratio = inputs["trainer_cpu_s_per_version"] / trainer_cpu_per_version(c, inputs)
    result = {"comparison": rows, "not_predicted": NOT_PREDICTED, "inputs_from_the_run": inputs,
              "cpu_scale": cpu_scale, "trainer_cpu_ratio": round(ratio, 2),
              "measured_from": str(measured_path), "seed": seed}
    if json_out:
        print(json.dumps(result))
    else:
        print(table(rows))
        print("\nnot predicted: " + "; ".join(f"{k}: {v}" for k, v in NOT_PREDICTED.items()))
        print("inputs taken from the run: " + json.dumps({k: round(v, 4) if isinstance(v, float) else v
                                                          for k, v in inputs.items()}))
        charged = trainer_cpu_per_version(c, inputs)
        print(f"CPU costs × {cpu_scale}; the run's trainer spent {ratio:.2f}× the CPU per version that the costs "
              f"charge ({inputs['trainer_cpu_s_per_version']:.3f} s against {charged:.3f} s)")


if __name__ == "__main__":
    typer.run(main)
