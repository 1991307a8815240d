"""Asynchronous against synchronous training on an uneven fleet: time to a target reward.

    .venv/bin/python -m benchmarks.async_vs_sync --json

Two real runs of ``rlbus run`` on the default config (same task, seed, model, batch size and
steps), each with 4 rollout workers whose generation speed is scaled by ``local.bench_worker_speeds``
(1, 1, 0.5, 0.25: a worker at speed f sleeps after each generation for its duration ×
(1/f − 1), standing for hardware f times as fast). The only difference between the runs is
``run.max_staleness``: η = 0 is synchronous on-policy training (each step waits for a batch
generated entirely by its own weights), η = ``--staleness`` is the asynchronous mode.

Every run keeps all its weight versions in its store; after the run (so the measurement never
slows the run), every ``--eval-every``-th version is rebuilt from the store and scored by greedy
accuracy on the held-out prompts, exactly as ``reward_start``/``reward_end`` are. A version's
time is the trainer's wall clock when it published it (``wall_s`` in ``metrics.jsonl``, counted
from the trainer's start, so worker start-up is included).

``target_reward`` defaults to 90% of the way from the held-out accuracy before RL to the lower of
the two runs' best evaluated accuracies, a level both runs reach. ``speedup_time_to_target`` is
the synchronous run's time to its first evaluated version at or above the target divided by the
asynchronous run's.

``--repeats N`` runs each mode N times (synchronous and asynchronous alternating, so slow drift of
the machine touches both) and prints ``{"repeats": [one result per pair, as above], "summary":
...}``: for the speed-up to the target and for the asynchronous trainer's wait fraction, each
pair's value (``values``), their ``median``, ``min``, ``max`` and ``spread`` (max − min).
``benchmarks.fleet_model --targets result.json`` calibrates against such a file.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.launch import REPO, launch_run
from benchmarks.options import JsonOption



def launch(config: Path, out: Path, name: str, staleness: int, speeds: list[float], extra: list[str]) -> Path:
    """Run ``rlbus run`` in a subprocess; returns its run directory."""
    sets = {
        "run.name": name,
        "local.dir": str(out),
        "run.max_staleness": str(staleness),
        "local.workers": str(len(speeds)),
        "local.bench_worker_speeds": json.dumps(speeds),
        "weights.keep_versions": "100000",  # keep every version: the evaluation rebuilds them afterwards
        "local.max_wall_s": "7200",  # the synchronous run takes far longer than a default run is allowed
    }
    return launch_run(config, out, name, sets, extra, label=f"η={staleness} speeds={speeds}: ")


def evaluate_versions(run_dir: Path, every: int) -> list[dict]:
    """Held-out greedy accuracy of every ``every``-th published version (and the last one)."""
    import torch

    from pydantic import TypeAdapter

    from consumers.dataset import read_rows
    from producers.engines.torch_engine import TorchEngine
    from producers.evaluate import greedy_accuracy
    from producers.tasks import load_task
    from weightstore.config import StoreConfig, build_store
    from weightstore.inspect import load_version

    torch.set_num_threads(2)
    cfg = json.loads((run_dir / "config.json").read_text())  # the run's config, secrets left out
    prep = json.loads((run_dir / "prepare.json").read_text())
    rows = read_rows(prep["heldout_path"])
    task = load_task(cfg["run"]["task"], cfg["run"].get("task_params"))
    store = build_store(TypeAdapter(StoreConfig).validate_python(cfg["store"]))
    metrics = {m["version"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    last = max(metrics)
    engine = TorchEngine(Path(prep["model_dir"]), seed=cfg["run"]["seed"])
    points = [{"version": 0, "wall_s": 0.0, "reward": prep["reward_start"]}]
    for version in [*range(every, last, every), last]:
        asyncio.run(engine.load_weights(load_version(store, cfg["run"]["policy"], version), version))
        reward = asyncio.run(greedy_accuracy(engine, task, rows, cfg["sampling"]["max_new_tokens"]))
        points.append({"version": version, "wall_s": round(metrics[version]["wall_s"], 2), "reward": reward})
    return points


def first_at(points: list[dict], target: float) -> dict | None:
    """The first evaluated version at or above ``target``."""
    return next((p for p in points if p["reward"] >= target), None)


def main(
    config: Annotated[Path, typer.Option(help="Run config of both runs.")] = REPO / "configs" / "default.toml",
    staleness: Annotated[int, typer.Option(help="η of the asynchronous run.")] = 4,
    speeds: Annotated[str, typer.Option(help="Speed factor of each worker, comma-separated.")] = "1,1,0.5,0.25",
    eval_every: Annotated[int, typer.Option(help="Evaluate every N-th version.")] = 20,
    target: Annotated[float | None, typer.Option(help="Target reward (default: see the module doc).")] = None,
    out: Annotated[Path, typer.Option(help="Parent directory of the runs.")] = REPO / "runs" / "async_vs_sync",
    sets: Annotated[list[str], typer.Option("--set", help="Extra override for both runs (KEY=VALUE).")] = [],  # noqa: B006
    only: Annotated[str | None, typer.Option(help="Run one mode, sync or async (for debugging).")] = None,
    json_out: JsonOption = False,
    repeats: Annotated[int, typer.Option(min=1, help="Run each mode N times; report each pair, the median and spread.")] = 1,
) -> None:
    """Asynchronous against synchronous training on an uneven fleet: time to a target reward."""
    if only not in (None, "sync", "async"):
        raise typer.BadParameter("--only takes sync or async")
    factors = [float(x) for x in speeds.split(",")]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = out.resolve() / stamp
    out.mkdir(parents=True)
    modes = {"sync": 0, "async": staleness}
    results = []
    for attempt in range(1, repeats + 1):
        runs = {}
        for mode, eta in modes.items():
            if only and mode != only:
                continue
            name = mode if repeats == 1 else f"{mode}-{attempt}"
            run_dir = launch(config, out, name, eta, factors, [*sets, "local.unique_suffix=false"])
            summary = json.loads((run_dir / "summary.json").read_text())
            points = evaluate_versions(run_dir, eval_every)
            runs[mode] = {"run_dir": str(run_dir), "summary": summary, "points": points}
            print(f"[{name}] wall {summary['wall_s']:.0f}s, reward {summary['reward_start']:.3f} -> "
                  f"{summary['reward_end']:.3f}, trainer wait {summary['trainer_wait_fraction']:.2f}",
                  file=sys.stderr, flush=True)
        results.append(report(runs, staleness=staleness, speeds=factors, eval_every=eval_every, target=target))
        if len(runs) == 2:
            r = results[-1]
            print(f"[pair {attempt}] speed-up to target {r['speedup_time_to_target']}, async trainer wait "
                  f"{r['async_trainer_wait_fraction']}", file=sys.stderr, flush=True)
    result = results[0] if repeats == 1 else {"repeats": results, "summary": summarize(results)}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=None if json_out else 1))


def summarize(results: list[dict]) -> dict:
    """Median and spread over the pairs of the figures the fleet model is calibrated on."""
    out = {}
    for key in ("speedup_time_to_target", "async_trainer_wait_fraction", "speedup_wall", "sync_trainer_wait_fraction"):
        values = [r[key] for r in results if r.get(key) is not None]
        if values:
            out[key] = {"values": values, "median": round(statistics.median(values), 3), "min": min(values),
                        "max": max(values), "spread": round(max(values) - min(values), 3)}
    return out


def report(runs: dict, *, staleness: int, speeds: list[float], eval_every: int, target: float | None) -> dict:
    result: dict = {"staleness": staleness, "speeds": speeds, "eval_every": eval_every, "cpu_count": os.cpu_count()}
    for mode, run in runs.items():
        s = run["summary"]
        result |= {
            f"{mode}_run_dir": run["run_dir"],
            f"{mode}_wall_s": s["wall_s"],
            f"{mode}_rl_wall_s": s["rl_wall_s"],
            f"{mode}_steps": s["versions_published"] - 1,
            f"{mode}_final_reward": s["reward_end"],
            f"{mode}_best_reward": max(p["reward"] for p in run["points"]),
            f"{mode}_trainer_wait_fraction": s["trainer_wait_fraction"],
            f"{mode}_groups_trained": s["groups_trained"],
            f"{mode}_groups_dropped_stale_fraction": round(
                s["groups_dropped_stale"] / max(1, s["groups_dropped_stale"] + s["groups_trained"]), 4),
            f"{mode}_curve": [[p["version"], p["wall_s"], round(p["reward"], 3)] for p in run["points"]],
        }
    if len(runs) == 2:
        start = runs["sync"]["summary"]["reward_start"]
        best = min(result["sync_best_reward"], result["async_best_reward"])
        target = target if target is not None else round(start + 0.9 * (best - start), 3)
        p_sync, p_async = first_at(runs["sync"]["points"], target), first_at(runs["async"]["points"], target)
        t_sync, t_async = (None if p is None else p["wall_s"] for p in (p_sync, p_async))
        result |= {
            "reward_start": start,
            "target_reward": target,
            "sync_time_to_target_s": t_sync,
            "async_time_to_target_s": t_async,
            # The speed-up splits into speed per step and steps needed: versions to the target tell how
            # much learning the staler asynchronous data costs.
            "sync_versions_to_target": None if p_sync is None else p_sync["version"],
            "async_versions_to_target": None if p_async is None else p_async["version"],
            "speedup_time_to_target": round(t_sync / t_async, 2) if t_sync and t_async else None,
            "speedup_wall": round(result["sync_rl_wall_s"] / result["async_rl_wall_s"], 2),
        }
    return result


if __name__ == "__main__":
    typer.run(main)
