"""Does a run keep its pace with the embedded broker's log on SeaweedFS? The same config on
``memory://`` (the baseline) and on SeaweedFS (``local.broker_storage``), in one invocation:

    .venv/bin/python -m benchmarks.durable_log --steps 600 --runs 2 --json

Per run, from its ``metrics.jsonl`` (the trainer's clock when it finished each step): seconds per
step over steps 51–150 (``early_s_per_step``) and over the last 100 (``late_s_per_step``), their ratio
(``slowdown``: the log holds its pace when it stays at or under 1.3), the RL wall time (first to last
step), the same per group the trainer took from the log (``*_ms_per_group``: trained or dropped; as a
policy learns, DAPO's dynamic sampling drops more groups and a step takes more of them, so seconds per
step grow on any log; ``*_groups_per_step`` shows by how much), the whole run's wall time (summary.json, prepare and the final evaluation included), groups
dropped as too stale, and the held-out gain. Per storage: the mean over its runs; and the cost of
the durable log, its mean RL wall time over memory's. ``--analyze STORAGE=RUN_DIR`` (repeatable)
reads finished runs instead of starting new ones.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from benchmarks.launch import REPO, launch_run
from benchmarks.options import JsonOption

EARLY = (51, 150)
LATE_STEPS = 100
HOLDS = 1.3


def pace(rows: list[dict], early: tuple[int, int] = EARLY) -> dict:
    """The pace of a run from its trainer's metrics rows (``metrics.jsonl``, or the store's copy): seconds a
    step, milliseconds a group taken from the log and groups taken a step, over steps ``early`` (51–150)
    and over the last 100, and their ratios."""
    times = {r["step"]: r["time"] for r in rows}  # a resumed run rewrites no step: the last row of a step wins
    by_step = {r["step"]: r for r in rows}
    steps = sorted(times)
    if not steps or steps[-1] < early[1] + 1 or early[0] - 1 not in times:
        raise ValueError(f"{len(steps)} steps; the figures need steps {early[0] - 1} to {early[1] + 1} at least")

    def through(step: int) -> int:
        """Groups the trainer took from the log by the end of ``step``: trained, or dropped by its stages
        or as too stale (the counters are the run's totals)."""
        r = by_step[step]
        staged = sum(v for k, v in r.items() if k.startswith("stage/") and k.endswith("/dropped"))
        return r["groups_trained"] + r["groups_dropped_stale"] + staged

    def window(first: int, last: int) -> tuple[float, float, float]:
        """Seconds a step, ms a group taken, groups taken a step, from the end of step ``first - 1`` to
        the end of step ``last``."""
        seconds, taken = times[last] - times[first - 1], max(1, through(last) - through(first - 1))
        return seconds / (last - first + 1), 1000 * seconds / taken, taken / (last - first + 1)

    end = steps[-1]
    first, late = window(*early), window(end - LATE_STEPS + 1, end)
    return {
        "steps": end, "early_steps": list(early), "early_s_per_step": round(first[0], 3),
        "late_s_per_step": round(late[0], 3), "slowdown": round(late[0] / first[0], 3),
        "early_ms_per_group": round(first[1], 2), "late_ms_per_group": round(late[1], 2),
        "slowdown_per_group": round(late[1] / first[1], 3), "early_groups_per_step": round(first[2], 1),
        "late_groups_per_step": round(late[2], 1),
        "rl_wall_s": round(times[end] - times[steps[0]], 1),
    }


def run_figures(run_dir: Path) -> dict:
    """The pace of one finished run (its metrics rows and summary)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    try:
        figures = pace(rows)
    except ValueError as exc:
        raise SystemExit(f"{run_dir}: {exc}") from None
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"run_dir": str(run_dir)} | figures | {
        "wall_s": summary["wall_s"], "groups_dropped_stale": summary["groups_dropped_stale"],
        "reward_start": summary["reward_start"], "reward_end": summary["reward_end"],
    }


def mean_of(runs: list[dict]) -> dict:
    keys = ("early_s_per_step", "late_s_per_step", "slowdown", "early_ms_per_group", "late_ms_per_group",
            "slowdown_per_group", "early_groups_per_step", "late_groups_per_step", "rl_wall_s", "wall_s",
            "groups_dropped_stale", "reward_end")
    return {k: round(statistics.fmean(r[k] for r in runs), 3) for k in keys} | {"runs": len(runs)}


def main(
    config: Annotated[Path, typer.Option(help="Run config.")] = REPO / "configs/ci.toml",
    steps: Annotated[int, typer.Option(help="Trainer steps per run (over 150).")] = 600,
    runs: Annotated[int, typer.Option(help="Runs per storage, alternating.")] = 1,
    out: Annotated[Path, typer.Option(help="Directory of the runs.")] = Path("runs/bench-durable-log"),
    analyze: Annotated[Optional[list[str]], typer.Option(
        help="STORAGE=RUN_DIR of a finished run to read instead of running (repeatable).")] = None,
    extra: Annotated[Optional[list[str]], typer.Option("--set", help="More --set KEY=VALUE for every run.")] = None,
    as_json: JsonOption = False,
) -> None:
    by_storage: dict[str, list[dict]] = {"memory": [], "seaweedfs": []}
    if analyze:
        for item in analyze:
            storage, _, path = item.partition("=")
            by_storage.setdefault(storage, []).append(run_figures(Path(path)))
    else:
        out.mkdir(parents=True, exist_ok=True)
        for i in range(runs):
            for storage in by_storage:  # alternating, so a drift of the machine's speed hits both
                name = f"{storage}-{i}"
                sets = {"run.name": name, "local.dir": str(out.resolve()), "local.unique_suffix": "false",
                        "local.broker_storage": storage, "trainer.max_steps": str(steps),
                        "local.max_wall_s": str(max(3600, steps * 10))}
                run_dir = launch_run(config, out, name, sets, list(extra or []), label=f"{storage}: ")
                by_storage[storage].append(run_figures(run_dir))
    means = {s: mean_of(r) for s, r in by_storage.items() if r}
    result = {"config": str(config), "runs": by_storage, "mean": means}
    if "memory" in means and "seaweedfs" in means:
        result["durable_cost"] = round(means["seaweedfs"]["rl_wall_s"] / means["memory"]["rl_wall_s"] - 1, 3)
    if as_json:
        print(json.dumps(result, indent=1))
        return
    print(f"{'storage':<10} {'runs':>4} {'s/step 51-150':>14} {'s/step last 100':>16} {'slowdown':>9} "
          f"{'ms/group 51-150':>16} {'ms/group last 100':>18} {'slowdown':>9} {'groups/step':>12} {'RL wall s':>10} "
          f"{'stale drops':>12} {'held-out end':>13}")
    for storage, m in means.items():
        print(f"{storage:<10} {m['runs']:>4} {m['early_s_per_step']:>14.3f} {m['late_s_per_step']:>16.3f} "
              f"{m['slowdown']:>9.2f} {m['early_ms_per_group']:>16.1f} {m['late_ms_per_group']:>18.1f} "
              f"{m['slowdown_per_group']:>9.2f} "
              f"{str(m['early_groups_per_step']) + '->' + str(m['late_groups_per_step']):>12} "
              f"{m['rl_wall_s']:>10.1f} {m['groups_dropped_stale']:>12.0f} "
              f"{m['reward_end']:>13.3f}")
    if "durable_cost" in result:
        print(f"durable log's cost over memory, RL wall time: {result['durable_cost']:+.1%}")
    print(f"the log holds its pace when its cost a group taken stays flat (slowdown a group <= {HOLDS}); a step's "
          "slowdown is that times the growth of the groups a step takes")
    sys.stdout.flush()


if __name__ == "__main__":
    typer.run(main)
