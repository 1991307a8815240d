"""Each ``trainer.algorithm`` preset on the same task, machine and seed: time and versions to a target.

    .venv/bin/python -m benchmarks.algorithms --json

One real ``rlbus run`` per preset (``grpo``, ``dapo``, ``dr_grpo``, ``vapo``; ``--algorithms``) of
each ``--config`` (default ``configs/default.toml``; ``configs/arithmetic.toml`` is the reasoning-gym
task), one after the other, everything else equal: the run's seed, model, warm-up, workers, batch
size, steps and data stages. After each run every ``--eval-every``-th version is rebuilt from the
store and scored by greedy accuracy on the held-out prompts, as ``benchmarks.async_vs_sync`` does
(``evaluate_versions``); a version's time is the trainer's wall clock when it published it.

Per config and algorithm: ``time_to_target_s`` and ``versions_to_target`` (the first evaluated
version at or above ``--target``; None when never reached), ``final_reward``, ``best_reward``,
``wall_s``, ``trainer_wait_fraction``, and for a run with a value model its explained variance
(``explained_variance_end``: the mean of the last 50 steps; ``explained_variance_after_pretraining``:
the first step that trained the policy).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.async_vs_sync import evaluate_versions, first_at
from benchmarks.launch import REPO, launch_run
from benchmarks.options import JsonOption

ALGORITHMS = ("grpo", "dapo", "dr_grpo", "vapo")


def value_figures(run_dir: Path) -> dict:
    """The value model's explained variance from the run's metrics (empty without a value model)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    rows.sort(key=lambda r: r["step"])
    ev = [(r["step"], r["loss_explained_variance"], bool(r.get("loss_policy_frozen")))
          for r in rows if r.get("loss_explained_variance") is not None]
    if not ev:
        return {}
    trained = [v for _, v, frozen in ev if not frozen]
    return {"explained_variance_after_pretraining": round(trained[0], 3) if trained else None,
            "explained_variance_end": round(statistics.fmean(v for _, v, _ in ev[-50:]), 3),
            "value_pretraining_steps": sum(frozen for _, _, frozen in ev)}


def one_run(config: Path, out: Path, algorithm: str, eval_every: int, target: float, extra: list[str]) -> dict:
    name = f"{config.stem}-{algorithm}"
    sets = {"run.name": name, "local.dir": str(out), "trainer.algorithm": algorithm,
            "weights.keep_versions": "100000", "local.max_wall_s": "3600", "local.unique_suffix": "false"}
    run_dir = launch_run(config, out, name, sets, extra, label=f"{algorithm}: ")
    summary = json.loads((run_dir / "summary.json").read_text())
    points = evaluate_versions(run_dir, eval_every)
    hit = first_at(points, target)
    result = {
        "config": config.name, "algorithm": algorithm, "run_dir": str(run_dir),
        "time_to_target_s": None if hit is None else hit["wall_s"],
        "versions_to_target": None if hit is None else hit["version"],
        "reward_start": summary["reward_start"], "final_reward": summary["reward_end"],
        "best_reward": max(p["reward"] for p in points), "wall_s": summary["wall_s"],
        "rl_wall_s": summary["rl_wall_s"], "steps": summary["versions_published"] - 1,
        "trainer_wait_fraction": summary["trainer_wait_fraction"],
        **value_figures(run_dir),
        "curve": [[p["version"], p["wall_s"], round(p["reward"], 3)] for p in points],
    }
    print(f"[{name}] to {target}: {result['time_to_target_s']} s / v{result['versions_to_target']}, final "
          f"{result['final_reward']:.3f}", file=sys.stderr, flush=True)
    return result


def main(
    configs: Annotated[list[Path], typer.Option("--config", help="Run config (repeat for several).")] = [  # noqa: B006
        REPO / "configs" / "default.toml"],
    algorithms: Annotated[str, typer.Option(help="Presets to run, comma-separated.")] = ",".join(ALGORITHMS),
    target: Annotated[float, typer.Option(help="Target held-out reward.")] = 0.8,
    eval_every: Annotated[int, typer.Option(help="Evaluate every N-th version.")] = 20,
    out: Annotated[Path, typer.Option(help="Parent directory of the runs.")] = REPO / "runs" / "algorithms",
    sets: Annotated[list[str], typer.Option("--set", help="Extra override for every run (KEY=VALUE).")] = [],  # noqa: B006
    json_out: JsonOption = False,
) -> None:
    """Each trainer.algorithm preset on the same task, machine and seed: time and versions to a target."""
    chosen = [a.strip() for a in algorithms.split(",") if a.strip()]
    unknown = sorted(set(chosen) - set(ALGORITHMS))
    if unknown:
        raise typer.BadParameter(f"unknown algorithms {unknown}; choose from {', '.join(ALGORITHMS)}")
    out = out.resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    rows = [one_run(config.resolve(), out, algorithm, eval_every, target, sets)
            for config in configs for algorithm in chosen]
    result = {"target_reward": target, "eval_every": eval_every, "runs": rows}
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=None if json_out else 1))


if __name__ == "__main__":
    typer.run(main)
