"""Two policies trained together (solver + verifier): concurrent against alternating trainers.

    .venv/bin/python -m benchmarks.multi_policy --json

Two real runs of ``rlbus run`` on ``configs/solver_verifier.toml`` (same task, seed, models, batch
sizes and steps), on the same machine in one invocation. The only difference is
``run.schedule``: ``concurrent`` (both trainers consume their topics and step at once) or
``alternating`` (one trainer active at a time, ``run.alternate_steps`` steps per turn, the other
paused, as sequential multi-agent training does; the workers keep running the workflow for both).

After each run (so the measurement never slows it), every ``--eval-every``-th version of each policy
is rebuilt from the store and scored by greedy decoding on that policy's held-out rows, exactly as
its ``reward_start``/``reward_end`` are: the solver's accuracy on held-out prompts, the verifier's
accuracy on the fixed, balanced set of judged answers. A version's time is its trainer's clock
when it published it, counted from the first trainer's start.

Each policy's target defaults to 90% of the way from its held-out score before RL to the lower of
the two runs' best evaluated scores, a level both runs reach; a run's time to targets is when the
later of its two policies first reached its target. ``speedup`` is the alternating run's time to
targets divided by the concurrent run's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.launch import REPO, launch_run
from benchmarks.options import JsonOption

POLICIES = ("solver", "verifier")


def launch(config: Path, out: Path, name: str, extra: list[str]) -> Path:
    """Run ``rlbus run`` in a subprocess with ``run.schedule = name``; returns its run directory."""
    sets = {"run.name": name, "local.dir": str(out), "local.unique_suffix": "false", "run.schedule": name,
            "weights.keep_versions": "100000", "local.max_wall_s": "3600"}
    return launch_run(config, out, name, sets, extra)


def evaluate_versions(run_dir: Path, every: int) -> dict[str, list[dict]]:
    """Per policy: held-out greedy score of every ``every``-th published version (and the last),
    with the time it was published (seconds since the first trainer started)."""
    import torch

    from consumers.dataset import DatasetFields, read_rows
    from producers.engines.torch_engine import TorchEngine
    from producers.evaluate import greedy_accuracy
    from producers.workflows import load_workflow
    from rlbus.config import load_config
    from rlbus.roles import task_of
    from weightstore.config import build_store
    from weightstore.inspect import load_version

    torch.set_num_threads(2)
    cfg = load_config(run_dir / "config.json", environ={})
    prep = json.loads((run_dir / "prepare.json").read_text())
    store = build_store(cfg.store_config(run_dir / "store"))
    task = task_of(cfg)
    rows = {p.name: [json.loads(x) for x in cfg.metrics_file(run_dir, p.name).read_text().splitlines()]
            for p in cfg.policy_list()}
    start = min(r["time"] - r["wall_s"] for policy_rows in rows.values() for r in policy_rows[:1])
    points: dict[str, list[dict]] = {}
    for spec in cfg.workflow_list():
        flow = load_workflow(spec)
        for role, name in spec.roles.items():
            info = prep["policies"][name]
            data = read_rows(info["eval_path"], DatasetFields())
            judge = flow.judge(role, task)
            metrics = {m["version"]: m for m in rows[name]}
            last = max(metrics)
            engine = TorchEngine(Path(info["model_dir"]), seed=cfg.run.seed)
            max_new = cfg.policy(name).sampling.max_new_tokens
            points[name] = [{"version": 0, "t_s": 0.0, "reward": info["reward_start"]}]
            for version in [*range(every, last, every), last]:
                asyncio.run(engine.load_weights(load_version(store, name, version), version))
                reward = asyncio.run(greedy_accuracy(engine, judge, data, max_new))
                points[name].append({"version": version, "t_s": round(metrics[version]["time"] - start, 2),
                                     "reward": round(reward, 4)})
    return points


def first_at(points: list[dict], target: float) -> dict | None:
    return next((p for p in points if p["reward"] >= target), None)


def report(runs: dict[str, dict], targets: dict[str, float] | None) -> dict:
    result: dict = {"cpu_count": os.cpu_count()}
    for mode, run in runs.items():
        s = run["summary"]
        result |= {f"{mode}_wall_s": s["wall_s"]}
        for name in POLICIES:
            p = s["policies"][name]
            result |= {f"{mode}_{name}_reward_end": p["reward_end"],
                       f"{mode}_{name}_best": max(x["reward"] for x in run["points"][name]),
                       f"{mode}_{name}_curve": [[x["version"], x["t_s"], x["reward"]] for x in run["points"][name]]}
    concurrent = runs["concurrent"]["summary"]["policies"]
    result |= {"solver_reward_start": concurrent["solver"]["reward_start"],
               "solver_reward_end": concurrent["solver"]["reward_end"],
               "verifier_accuracy_start": concurrent["verifier"]["reward_start"],
               "verifier_accuracy_end": concurrent["verifier"]["reward_end"],
               "verifier_reward_end": concurrent["verifier"]["reward_end"]}
    if len(runs) < 2:
        return result
    if targets is None:
        targets = {}
        for name in POLICIES:
            start = concurrent[name]["reward_start"]
            best = min(result[f"{mode}_{name}_best"] for mode in runs)
            targets[name] = round(start + 0.9 * (best - start), 3)
    result["targets"] = targets
    for mode, run in runs.items():
        reached = {name: first_at(run["points"][name], targets[name]) for name in POLICIES}
        times = [None if p is None else p["t_s"] for p in reached.values()]
        result |= {f"{mode}_{name}_time_to_target_s": t for name, t in zip(POLICIES, times)}
        result[f"{mode}_time_to_targets_s"] = None if None in times else max(times)
    t_c, t_a = result["concurrent_time_to_targets_s"], result["alternating_time_to_targets_s"]
    result["speedup"] = round(t_a / t_c, 2) if t_c and t_a else None
    return result


def main(
    config: Annotated[Path, typer.Option(help="Run config of both runs.")] = REPO / "configs" / "solver_verifier.toml",
    eval_every: Annotated[int, typer.Option(help="Evaluate every N-th version of each policy.")] = 25,
    solver_target: Annotated[float | None, typer.Option(help="Solver's held-out target (default: see the module doc).")] = None,
    verifier_target: Annotated[float | None, typer.Option(help="Verifier's held-out target.")] = None,
    out: Annotated[Path, typer.Option(help="Parent directory of the runs.")] = REPO / "runs" / "multi_policy",
    sets: Annotated[list[str], typer.Option("--set", help="Extra override for both runs (KEY=VALUE).")] = [],  # noqa: B006
    json_out: JsonOption = False,
) -> None:
    """Solver + verifier: concurrent against alternating trainers, time until both reach their targets."""
    if (solver_target is None) != (verifier_target is None):
        raise typer.BadParameter("give both --solver-target and --verifier-target, or neither")
    out = out.resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    runs = {}
    for mode in ("concurrent", "alternating"):
        run_dir = launch(config, out, mode, sets)
        summary = json.loads((run_dir / "summary.json").read_text())
        runs[mode] = {"run_dir": str(run_dir), "summary": summary, "points": evaluate_versions(run_dir, eval_every)}
        print(f"[{mode}] wall {summary['wall_s']:.0f}s; " + ", ".join(
            f"{n} {p['reward_start']:.3f} -> {p['reward_end']:.3f}" for n, p in summary["policies"].items()),
            file=sys.stderr, flush=True)
    targets = None if solver_target is None else {"solver": solver_target, "verifier": verifier_target}
    result = report(runs, targets)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=None if json_out else 1))


if __name__ == "__main__":
    typer.run(main)
