"""A fleet model, calibrated on this machine and checked: asynchronous against synchronous
training from 4 workers on two shared cores to 1,000 workers in four regions.

    .venv/bin/python -m benchmarks.fleet_model --json           # calibration + projections
    .venv/bin/python -m benchmarks.fleet_model --measure RUN_DIR # costs of a finished rlbus run

The mechanism is ``benchmarks.fleet.sim`` (a SimPy discrete-event simulation of curator,
workers, broker, trainer and store; its docstring says what each does). This module feeds it the
costs of ``benchmarks/fleet_costs.json`` (``sources`` there says where each comes from) and, through
the package ``benchmarks/fleet/`` (one module a concern: its ``__init__`` lists them), makes:

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

import json
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.fleet.calibrate import PAIR_STEPS, TARGETS, calibrate
from benchmarks.fleet.model import COSTS, load_costs
from benchmarks.fleet.project import FleetAssumptions, projection_a, projection_b
from benchmarks.fleet.record import record_contention, record_cpu, record_run, record_versions_to_target
from benchmarks.fleet.render import markdown, plots
from benchmarks.options import JsonOption

FIGURES = Path(__file__).with_name("figures")


def main(
    json_out: JsonOption = False,
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
        print(json.dumps(record_contention(costs), indent=1))
        return
    if staleness_from is not None:
        print(json.dumps(record_versions_to_target(costs, staleness_from)))
        return
    if cpu_runs:
        print(json.dumps(record_cpu(costs, cpu_runs, upto), indent=1))
        return
    if measure_dir is not None:
        print(json.dumps(record_run(costs, measure_dir, pairs), indent=1))
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
