"""A hub and two regions on one machine, against the same workers all on loopback, in one invocation.

    python -m benchmarks.regions --json [--steps 900] [--cut-at-step 300] [--cut-s 120]

Two `rlbus run`s of ``configs/regions.toml`` (the default model and task):

* **regions**: the hub (broker, trainer, curator, the weights on a SeaweedFS server, one worker) and
  two regions, eu-west (2 workers, 50 ms one way, 200 Mbit/s) and ap-south (2 workers, 150 ms,
  50 Mbit/s), each behind an emulated WAN link (``rlbus link``) that carries everything between it and
  the hub, and each following its own replica of the weights that ``rlbus replica`` fills across the
  link. ap-south's link is cut once the trainer logged ``--cut-at-step``, for ``--cut-s``.
* **loopback**: the same five workers, all on loopback, following the hub's store directly.

Everything is read back from the runs' own records: the trainer's metrics rows (groups, tokens,
staleness and propagation by region, the group ids trained and the prompt ids taken), the links'
counters (``regions/<region>/link.json``), the replicas' arrival logs (``arrivals.jsonl``), the
curator's counters and each run's summary. Keys:

* ``regions``; per region (hub → region is *down*): ``bytes_per_version_by_region`` (bytes of the
  weight store's route over the link per version published), ``copies_per_version_by_region`` (that
  ÷ the bytes the trainer stored per version: one copy is 1.0), ``trajectory_bytes_per_step_by_region``
  (region → hub, the broker's route, per trainer step), ``tokens_per_s_by_region`` (completion tokens
  trained per second of RL), ``groups_trained_by_region``, ``propagation_p50_s_by_region`` /
  ``propagation_p99_s_by_region`` (publication to every live worker of the region generating with
  the version, as the trainer sees it), ``replica_lag_p50_s_by_region`` / ``replica_lag_p99_s_by_region``
  (publication to the version's arrival in the region's replica; ap-south's without the cut's
  versions, which are in ``cut``), ``staleness_by_region``;
* the run: ``reward_start``, ``reward_end``, ``trainer_wait``, ``groups_lost`` (prompts dispatched
  over a minute before the curator's last count that no step took), ``groups_trained_twice``,
  ``tokens_per_s`` and ``tokens_per_s_ratio`` (regions ÷ loopback, trained tokens), the same for the
  tokens the workers generated (``generated_tokens_per_s_ratio``, from the workers' logs);
* the cut: ``cut_s`` (measured), ``stale_dropped_by_cut`` (the cut region's groups dropped as too
  stale from the cut's start until it caught up), ``stale_dropped_per_s_outside_cut`` (its rate the
  rest of the run), ``catch_up_s`` (from the link's return until every live worker of the region
  generated with a version at least as new as the hub's when the link came back), ``replica_catch_up_s``
  (until the replica held that version);
* ``loopback``: the baseline's figures.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated

import typer

from benchmarks.options import JsonOption

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "configs" / "regions.toml"
LOST_AFTER_S = 60.0
"""A prompt dispatched this long before the curator's last count and never taken is lost."""


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _quantile(values: list[float], q: float) -> float | None:
    values = sorted(values)
    return None if not values else round(values[min(len(values) - 1, int(q * len(values)))], 3)


def run(out: Path, name: str, sets: list[str]) -> Path:
    """One `rlbus run` of the regions config with ``sets``; its run directory."""
    log = out / f"{name}.log"
    cmd = [sys.executable, "-m", "rlbus.cli", "run", str(CONFIG), "--plain", "--set", f"local.dir={out / name}",
           "--set", f"run.name={name}"]
    for item in sets:
        cmd += ["--set", item]
    started = time.monotonic()
    with open(log, "wb") as fh:
        rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=REPO,
                            env=dict(os.environ, PYTHONUNBUFFERED="1")).returncode
    text = log.read_text(errors="replace")
    if rc != 0:
        raise SystemExit(f"the {name} run failed (exit {rc}); log {log}:\n{text[-3000:]}")
    print(f"[{name}] done in {time.monotonic() - started:.0f}s", file=sys.stderr, flush=True)
    return Path(re.search(r"directory (\S+)", text).group(1))


def generated_tokens(run_dir: Path) -> dict[str, int]:
    """Tokens each worker generated, by its log's closing line (region = the log name's prefix)."""
    out: dict[str, int] = {}
    for log in (run_dir / "logs").glob("*.log"):
        found = re.findall(r"worker (\S+) stopped: \d+ groups published, (\d+) tokens", log.read_text(errors="replace"))
        if found:
            out[log.stem] = sum(int(n) for _, n in found)
    return out


def common(run_dir: Path) -> dict:
    """What both runs report."""
    rows = _rows(run_dir / "metrics.jsonl")
    summary = json.loads((run_dir / "summary.json").read_text())
    rl_s = sum(r["step_wall_s"] for r in rows)
    trained = [g for r in rows for g in r["trained_group_ids"]]
    taken = {p for r in rows for p in r.get("consumed_prompt_ids", [])}
    curator = _rows(run_dir / "curator.jsonl")
    settled = max((r["dispatched"] for r in curator if r["time"] <= curator[-1]["time"] - LOST_AFTER_S), default=0)
    tokens = generated_tokens(run_dir)
    return {
        "reward_start": summary["reward_start"], "reward_end": summary["reward_end"],
        "heldout_gain": round(summary["reward_end"] - summary["reward_start"], 3),
        "steps": len(rows), "rl_s": round(rl_s, 1), "trainer_wait": summary.get("trainer_wait_fraction"),
        "groups_trained": len(trained), "groups_trained_twice": len(trained) - len(set(trained)),
        "groups_lost": sum(1 for n in range(settled) if f"p{n}" not in taken),
        "groups_dropped_stale": summary.get("groups_dropped_stale"),
        "tokens_per_s": round(sum(r["tokens"] for r in rows) / rl_s, 1),
        "generated_tokens_per_s": round(sum(tokens.values()) / rl_s, 1),
        "workers": len(tokens),
    }


def by_region(run_dir: Path, cut_region: str | None) -> dict:
    """The per-region figures and the cut's cost, from the regions run's directory."""
    rows = _rows(run_dir / "metrics.jsonl")
    rl_s = sum(r["step_wall_s"] for r in rows)
    versions = rows[-1]["version"] + 1
    stored = sum(r["publish_bytes"] for r in rows) + rows[0].get("publish_full_bytes", 0)  # v0: the full weights
    regions = sorted({g for r in rows for g in r["groups_by_region"]})
    out: dict = {"regions": regions, "versions": versions, "stored_bytes_per_version": round(stored / versions)}
    keys = ("bytes_per_version", "copies_per_version", "trajectory_bytes_per_step", "tokens_per_s", "groups_trained",
            "propagation_p50_s", "propagation_p99_s", "replica_lag_p50_s", "replica_lag_p99_s", "staleness")
    figures = {k: {} for k in keys}
    cut = None
    for region in regions:
        link_file = run_dir / "regions" / region / "link.json"
        arrivals = _rows(run_dir / "regions" / region / "arrivals.jsonl")
        if link_file.exists():
            link = json.loads(link_file.read_text())
            store_route = next(r for r in link["routes"].values() if not r["kafka"])
            broker_route = next(r for r in link["routes"].values() if r["kafka"])
            figures["bytes_per_version"][region] = round(store_route["bytes_down"] / versions)
            figures["copies_per_version"][region] = round(store_route["bytes_down"] / stored, 3)
            figures["trajectory_bytes_per_step"][region] = round(broker_route["bytes_up"] / len(rows))
            if region == cut_region and link["cuts"]:
                cut = link["cuts"][0]
        groups = sum(r["groups_by_region"].get(region, 0) for r in rows)
        figures["groups_trained"][region] = groups
        figures["tokens_per_s"][region] = round(sum(r["tokens_by_region"].get(region, 0) for r in rows) / rl_s, 1)
        lags = [(r["staleness_by_region"][region], r["groups_by_region"][region]) for r in rows
                if region in r["staleness_by_region"]]
        figures["staleness"][region] = round(sum(s * n for s, n in lags) / max(1, sum(n for _, n in lags)), 3)
        reached = {}
        for r in rows:
            if (v := r["propagation_by_region"].get(region)) is not None:
                reached[v[0]] = v[1]
        in_cut = (lambda t: cut is not None and cut[0] <= t <= (cut[1] or t)) if region == cut_region else (lambda t: False)
        figures["propagation_p50_s"][region] = _quantile(list(reached.values()), 0.5)
        figures["propagation_p99_s"][region] = _quantile(list(reached.values()), 0.99)
        replica = [a["arrived_at"] - a["published_at"] for a in arrivals if not in_cut(a["published_at"])]
        figures["replica_lag_p50_s"][region] = _quantile(replica, 0.5)
        figures["replica_lag_p99_s"][region] = _quantile(replica, 0.99)
    out |= {f"{k}_by_region": v for k, v in figures.items()}
    if cut is not None:
        out |= cut_cost(rows, cut, cut_region, _rows(run_dir / "regions" / cut_region / "arrivals.jsonl"))
    return out


def cut_cost(rows: list[dict], cut: list[float], region: str, arrivals: list[dict]) -> dict:
    start, end = cut
    at_restore = max((r["version"] for r in rows if r["time"] <= end), default=0)
    caught = next((r["time"] for r in rows if r["time"] > end and (v := r["propagation_by_region"].get(region))
                   and v[0] >= at_restore), None)
    replica = next((a["arrived_at"] for a in arrivals if a["arrived_at"] > end and a["version"] >= at_restore), None)
    window_end = caught or rows[-1]["time"]

    def dropped(t: float) -> int:  # the trainer's count (cumulative) in the last row at or before t
        return max((r["dropped_stale_by_region"].get(region, 0) for r in rows if r["time"] <= t), default=0)

    in_window = dropped(window_end) - dropped(start)
    outside_s = rows[-1]["time"] - rows[0]["time"] - (window_end - start)
    outside = dropped(rows[-1]["time"]) - in_window
    return {
        "cut_region": region, "cut_s": round(end - start, 1), "cut_at_version": max(
            (r["version"] for r in rows if r["time"] <= start), default=0), "version_at_restore": at_restore,
        "stale_dropped_by_cut": in_window,
        "stale_dropped_per_s_outside_cut": round(outside / outside_s, 3) if outside_s > 0 else None,
        "catch_up_s": None if caught is None else round(caught - end, 1),
        "replica_catch_up_s": None if replica is None else round(replica - end, 1),
    }


def main(
    steps: Annotated[int, typer.Option(help="Trainer steps of each run.")] = 900,
    cut_at_step: Annotated[int, typer.Option(help="ap-south's link is cut once the trainer logged this step.")] = 300,
    cut_s: Annotated[float, typer.Option(help="How long the cut lasts, seconds.")] = 120.0,
    out: Annotated[Path | None, typer.Option(help="Directory for the runs (default: a temporary one).")] = None,
    json_out: JsonOption = False,
) -> None:
    """Three regions (a hub and two behind shaped, cut links) against the same workers on loopback."""
    from rlbus.config import load_config

    out = out or Path(tempfile.mkdtemp(prefix="rlbus-regions-"))
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(CONFIG, [], environ={})
    regions = [r.model_dump(mode="json") for r in cfg.local.regions]
    cut_region = regions[-1]["name"]
    regions[-1]["link"]["cuts"] = [{"at_step": cut_at_step, "for_s": cut_s}]
    workers = cfg.local.workers + sum(r["workers"] for r in regions)
    base = [f"trainer.max_steps={steps}"]
    spread = run(out, "regions", base + [f"local.regions={json.dumps(regions)}"])
    loop = run(out, "loopback", base + ["local.regions=[]", f"local.workers={workers}"])
    result = {"steps": steps, "workers": workers,
              "links": {r["name"]: {k: r["link"][k] for k in ("delay_ms", "rate_mbit")} for r in regions},
              **by_region(spread, cut_region), **common(spread), "loopback": common(loop)}
    result["tokens_per_s_ratio"] = round(result["tokens_per_s"] / result["loopback"]["tokens_per_s"], 3)
    result["generated_tokens_per_s_ratio"] = round(
        result["generated_tokens_per_s"] / result["loopback"]["generated_tokens_per_s"], 3)
    result["runs"] = {"regions": str(spread), "loopback": str(loop)}
    print(json.dumps(result, indent=None if json_out else 1))


if __name__ == "__main__":
    typer.run(main)
