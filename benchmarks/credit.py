"""Outcome advantages against step-level credit (the step_credit stage, SALT) on a multi-turn environment.

    .venv/bin/python -m benchmarks.credit --json

Two real ``rlbus run``s of ``--config`` (default ``configs/textgame.toml``), one after the other,
everything else equal (seed, model, warm-up, data, workers, algorithm, steps): ``outcome`` trains
every turn of an episode on the episode's group advantage, ``steplevel`` adds the step_credit stage
(``--merge``: its history or state graph). After each run every ``--eval-every``-th version is
rebuilt from the store and played greedily on the held-out games (``benchmarks.async_vs_sync``'s
``evaluate_versions``).

Figures: ``outcome_reward_end`` and ``steplevel_reward_end`` (held-out score of each run's last
version), each run's ``versions_to_target`` and ``time_to_target_s`` (first evaluated version at or
above ``--target``; None when never reached), ``turns_per_episode`` (mean over the run's trained
episodes), and the stage's cost: ``stage_s_per_step`` (the step_credit stage's time per trainer
step) beside ``step_s`` (a trainer step's wall time) and their ratio ``stage_share``.
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


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return sorted(rows, key=lambda r: r["step"])


def one_run(config: Path, out: Path, variant: str, merge: str, eval_every: int, target: float,
            extra: list[str]) -> dict:
    stages = [{"type": "dynamic_sampling"}]
    if variant == "steplevel":
        stages.append({"type": "step_credit", "params": {"merge": merge}})
    name = f"{config.stem}-{variant}"
    sets = {"run.name": name, "local.dir": str(out), "trainer_stages": json.dumps(stages),
            "weights.keep_versions": "100000", "local.unique_suffix": "false"}
    run_dir = launch_run(config, out, name, sets, extra, label=f"{variant}: ")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = _rows(run_dir)
    points = evaluate_versions(run_dir, eval_every)
    hit = first_at(points, target)
    turns = [r["turns_mean"] for r in rows if r.get("turns_mean") is not None]
    stage_s = rows[-1].get("stage/step_credit/seconds")
    step_s = statistics.fmean(r["step_wall_s"] for r in rows)
    result = {
        "variant": variant, "run_dir": str(run_dir), "reward_start": summary["reward_start"],
        "reward_end": points[-1]["reward"], "best_reward": max(p["reward"] for p in points),
        "versions_to_target": None if hit is None else hit["version"],
        "time_to_target_s": None if hit is None else hit["wall_s"],
        "turns_per_episode": round(statistics.fmean(turns), 2) if turns else None,
        "steps": len(rows), "step_s": round(step_s, 3), "rl_wall_s": summary["rl_wall_s"],
        "stage_s_per_step": None if stage_s is None else round(stage_s / len(rows), 5),
        "curve": [[p["version"], p["wall_s"], round(p["reward"], 3)] for p in points],
    }
    if stage_s is not None:
        result["stage_share"] = round(stage_s / len(rows) / step_s, 5)
    print(f"[{name}] end {result['reward_end']:.3f}, to {target}: v{result['versions_to_target']}", file=sys.stderr,
          flush=True)
    return result


def main(
    config: Annotated[Path, typer.Option(help="Run config of a multi-turn task.")] = REPO / "configs" / "textgame.toml",
    merge: Annotated[str, typer.Option(help="The stage's graph: history or state.")] = "history",
    target: Annotated[float, typer.Option(help="Target held-out reward.")] = 0.7,
    eval_every: Annotated[int, typer.Option(help="Evaluate every N-th version.")] = 10,
    out: Annotated[Path, typer.Option(help="Parent directory of the runs.")] = REPO / "runs" / "credit",
    sets: Annotated[list[str], typer.Option("--set", help="Extra override for both runs (KEY=VALUE).")] = [],  # noqa: B006
    json_out: JsonOption = False,
) -> None:
    """Outcome advantages against step-level credit, same environment and seeds."""
    if merge not in ("history", "state"):
        raise typer.BadParameter(f"--merge {merge!r}: history or state")
    out = out.resolve() / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True)
    runs = {v: one_run(config.resolve(), out, v, merge, eval_every, target, sets) for v in ("outcome", "steplevel")}
    result = {
        "config": config.name, "merge": merge, "target_reward": target, "eval_every": eval_every,
        "outcome_reward_end": runs["outcome"]["reward_end"], "steplevel_reward_end": runs["steplevel"]["reward_end"],
        "outcome_versions_to_target": runs["outcome"]["versions_to_target"],
        "steplevel_versions_to_target": runs["steplevel"]["versions_to_target"],
        "stage_share": runs["steplevel"].get("stage_share"), "runs": runs,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=None if json_out else 1))


if __name__ == "__main__":
    typer.run(main)
