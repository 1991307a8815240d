"""Live progress lines from the trainer's metrics, and the end-of-run summary and plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weightstore.objectstore import ObjectStore


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        if line.strip():
            rows.append(json.loads(line))
    return rows


class MetricsTail:
    """Reads the rows a metrics file gained since the last ``poll`` (complete lines only)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pos = 0

    def poll(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, encoding="utf-8") as fh:
            fh.seek(self._pos)
            chunk = fh.read()
        complete = chunk[: chunk.rfind("\n") + 1]
        self._pos += len(complete.encode())
        return [json.loads(line) for line in complete.splitlines() if line.strip()]


class ProgressPrinter:
    """Tails a policy's metrics file and prints one line per trainer step (``label``: the policy
    name, printed first, when a run has several)."""

    def __init__(self, path: Path, label: str | None = None) -> None:
        self.label = label
        self._tail = MetricsTail(path)
        self._header = False

    def poll(self) -> None:
        for m in self._tail.poll():
            prefix = "" if self.label is None else f"{self.label:>10} "
            if not self._header:
                print(("" if self.label is None else f"{'policy':>10} ") +
                      f"{'version':>7} {'reward':>7} {'stale':>6} {'tok/s':>8} {'workers':>7} {'delta':>9} {'wall_s':>7}",
                      flush=True)
                self._header = True
            print(
                f"{prefix}{m['version']:>7} {m['reward_mean']:>7.3f} {m['groups_dropped_stale']:>6} "
                f"{m['tokens_per_s']:>8.0f} {m['live_workers']:>7} {m['publish_bytes']:>9} {m['wall_s']:>7.1f}",
                flush=True,
            )


def _smooth(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i - max(0, i - window + 1) + 1) for i in range(len(values))]


def _plot(run_dir: Path, curves: dict[str, tuple[list[dict], float, float]]) -> Path:
    """One train-reward curve per policy (raw and smoothed) with its held-out scores at both ends."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    window = 10
    several = len(curves) > 1
    for i, (name, (rows, reward_start, reward_end)) in enumerate(curves.items()):
        color = f"C{i}"
        label = f"{name}: " if several else ""
        versions = [r["version"] for r in rows]
        rewards = [r["reward_mean"] for r in rows]
        ax.plot(versions, rewards, color=color, alpha=0.35, lw=1, label=f"{label}train reward (sampled)")
        ax.plot(versions, _smooth(rewards, window), color=color, lw=2, label=f"{label}train reward, mean of {window}")
        if versions:
            ax.scatter([0, versions[-1]], [reward_start, reward_end], color=color, edgecolor="black", zorder=3,
                       label=f"{label}held-out greedy score")
    ax.set_xlabel("weight version (trainer step)")
    ax.set_ylabel("reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small")
    ax.set_title(run_dir.name)
    out = run_dir / "reward.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _policy_summary(rows: list[dict], reward_start: float, evaluation: dict) -> dict:
    last = rows[-1] if rows else {}
    return {
        "reward_start": reward_start,
        "reward_end": evaluation["accuracy"],
        "reward_end_version": evaluation.get("version"),
        "versions_published": last.get("version", 0) + 1 if rows else 1,
        "groups_trained": last.get("groups_trained", 0),
        "groups_dropped_stale": last.get("groups_dropped_stale", 0),
        "steps": last.get("step", len(rows)) if rows else 0,
    }


def budget_note(max_wall_s: float, steps: dict[str, tuple[int, int | None]]) -> str:
    """In words: the wall budget ended the run, at which steps of how many (policy -> (step, max_steps))."""
    at = ", ".join(f"{name} at step {step}" + (f" of {of}" if of else "") for name, (step, of) in steps.items())
    return (f"stopped by its wall budget (local.max_wall_s = {max_wall_s:.0f} s): {at}; the held-out score is of "
            "the newest version published by then")


def write_report(run_dir: Path, *, prep: dict, evaluations: dict[str, dict], metrics: dict[str, Path],
                 wall_s: float, trainer_restarts: int = 0, broker_restarts: int = 0, worker_restarts: int = 0,
                 resumes: int = 0, storage_restarts: int = 0, store: ObjectStore | None = None,
                 budget: dict | None = None) -> dict:
    """``summary.json`` and ``reward.png``. The top-level keys describe the first policy (as in a
    single-policy run); ``policies`` has every policy's figures; ``regions`` the fleet by region
    (``rlbus.report.regions.region_figures``: the rows, ``regions/<region>/link.json``, and the
    replicas' status in ``store``, the hub's, when given). ``budget``: the run's wall budget ended it
    (``{"max_wall_s", "max_steps": {policy: steps}}``); ``ended`` says so and ``ended_note`` in words."""
    from rlbus.report.data import read_links, read_replicas
    from rlbus.report.regions import region_figures, unattributed_note

    per_policy = {name: read_metrics(path) for name, path in metrics.items()}
    first = next(iter(metrics))
    rows = per_policy[first]
    last = rows[-1] if rows else {}
    delta_rows = [r for r in rows if r.get("publish_kind") == "delta"]
    workers = sorted({w for rs in per_policy.values() for r in rs for w in r.get("workers_seen", [])})
    policies = {name: _policy_summary(per_policy[name], prep["policies"][name]["reward_start"], evaluations[name])
                for name in metrics}
    summary = {
        "run": run_dir.name,
        "reward_start": policies[first]["reward_start"],
        "reward_end": policies[first]["reward_end"],
        "reward_end_version": policies[first]["reward_end_version"],
        "wall_s": round(wall_s, 1),
        "workers": len(workers),
        "worker_ids": workers,
        "versions_published": policies[first]["versions_published"],
        "groups_trained": policies[first]["groups_trained"],
        "groups_dropped_stale": policies[first]["groups_dropped_stale"],
        "groups_rejected": last.get("groups_rejected", 0),
        "duplicates": last.get("duplicates", 0),
        "tokens_per_s": round(sum(r["tokens"] for r in rows) / max(1e-9, sum(r["step_wall_s"] for r in rows)), 1) if rows else 0.0,
        "trainer_wait_fraction": round(sum(r["wait_s"] for r in rows) / max(1e-9, sum(r["step_wall_s"] for r in rows)), 3) if rows else 0.0,
        "delta_bytes_mean": int(sum(r["publish_bytes"] for r in delta_rows) / len(delta_rows)) if delta_rows else 0,
        "full_bytes": last.get("publish_full_bytes", 0),
        "warmup_steps": prep["warmup_steps"],
        "warmup_seconds": prep["warmup_seconds"],
        "rl_wall_s": round(sum(r["step_wall_s"] for r in rows), 1),
        "trainer_restarts": trainer_restarts,
        "worker_restarts": worker_restarts,
        "broker_restarts": broker_restarts,
        "resumes": resumes,
        "storage_restarts": storage_restarts,
        "policies": policies,
        "ended": "finished" if budget is None else "wall_budget",
    }
    if budget is not None:
        summary["ended_note"] = budget_note(budget["max_wall_s"], {
            name: (policies[name]["steps"], budget["max_steps"].get(name)) for name in policies})
    notes: list[str] = []
    regions, unattributed = region_figures(per_policy, links=read_links(run_dir, notes),
                                           replicas=read_replicas(store, notes))
    if regions:
        summary["regions"] = regions
        summary["regions_unattributed_workers"] = unattributed
        notes += [n for n in [unattributed_note(unattributed)] if n]
    if notes:
        summary["regions_notes"] = notes
    summary["reward_png"] = str(_plot(run_dir, {name: (per_policy[name], p["reward_start"], p["reward_end"])
                                                for name, p in policies.items()}))
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1), flush=True)
    return summary
