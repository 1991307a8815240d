"""The fleet by region in a run's report: ``summary.json``'s ``regions`` block (from the metrics rows,
each region's link counters and its replica's status in the hub's store) and the HTML report's
"Regions" table; a run without regions has one line, and rows without region keys none."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.report.html import write_html_report
from rlbus.report.regions import region_figures, worker_regions
from rlbus.report.summary import write_report
from tests.unit.test_html_report import has_plot, make_run_dir, panels, publish, write_jsonl
from weightstore.objectstore import LocalDirStore
from weightstore.replica import Replicator, status_key

PREP = {"policies": {"main": {"reward_start": 0.3}}, "warmup_steps": 0, "warmup_seconds": 0.0}
EVALUATIONS = {"main": {"accuracy": 0.8, "version": 4}}

# Four steps of 2 s. Workers eu-0 and eu-1 are in region eu, us-0 in us; the trainer restarts before
# step 4, so its count of groups dropped stale starts again from zero there.
STEPS = [
    # groups_by_worker, groups_by_region, tokens_by_region, staleness_by_region, propagation_by_region, dropped
    ({"eu-0": 2, "us-0": 1}, {"eu": 2, "us": 1}, {"eu": 100, "us": 40}, {"eu": 0.5, "us": 1.0},
     {"eu": None, "us": None}, {}),
    ({"eu-0": 1, "eu-1": 1, "us-0": 2}, {"eu": 2, "us": 2}, {"eu": 80, "us": 90}, {"eu": 1.0, "us": 2.0},
     {"eu": [1, 0.5], "us": [1, 3.0]}, {"us": 1}),
    ({"eu-1": 3}, {"eu": 3}, {"eu": 150}, {"eu": 0.0}, {"eu": [2, 0.7], "us": [1, 3.5]}, {"us": 2}),
    ({"us-0": 1, "eu-0": 1}, {"us": 1, "eu": 1}, {"us": 30, "eu": 20}, {"us": 3.0, "eu": 1.0},
     {"eu": [3, 0.9], "us": [3, 6.0]}, {"us": 1}),
]
LINK = {"name": "eu", "time": 1010.0, "delay_ms": 50, "rate_mbit": 100, "bytes_down": 5_000_000, "bytes_up": 80_000,
        "connections": 7, "open_connections": 0, "drops": 2, "cut": False, "cut_seconds": 3.5, "routes": {}}


def region_rows() -> list[dict]:
    rows = []
    for i, (by_worker, by_region, tokens, stale, reached, dropped) in enumerate(STEPS):
        v = i + 1
        rows.append({"policy": "main", "version": v, "step": v, "reward_mean": 0.5, "groups": sum(by_region.values()),
                     "groups_trained": 4 * v, "groups_dropped_stale": 0, "tokens": 500, "wait_s": 0.5,
                     "step_wall_s": 2.0, "wall_s": 2.0 * v, "time": 1000.0 + 2.0 * v,
                     "workers_seen": sorted(by_worker), "groups_by_worker": by_worker, "groups_by_region": by_region,
                     "tokens_by_region": tokens, "staleness_by_region": stale, "propagation_by_region": reached,
                     "dropped_stale_by_region": dropped})
    return rows


def two_region_run(tmp_path: Path) -> tuple[Path, LocalDirStore]:
    """A run directory with the rows above, eu's link counters, and eu's replica status in the store."""
    run_dir = tmp_path / "regions-run"
    run_dir.mkdir()
    write_jsonl(run_dir / "metrics.jsonl", region_rows())
    (run_dir / "regions" / "eu").mkdir(parents=True)
    (run_dir / "regions" / "eu" / "link.json").write_text(json.dumps(LINK))
    (run_dir / "regions" / "us").mkdir()  # a region whose link wrote nothing (yet)
    store = LocalDirStore(run_dir / "store")
    publish(store, "main", versions=5)
    replicator = Replicator(store, LocalDirStore(tmp_path / "eu-replica"), ["main"], region="eu")
    replicator.sync()
    store.put(status_key("eu"), json.dumps(replicator.status()).encode())  # as its replicator writes it
    return run_dir, store


def test_the_summary_breaks_the_fleet_down_by_region(tmp_path: Path) -> None:
    run_dir, store = two_region_run(tmp_path)
    summary = write_report(run_dir, prep=PREP, evaluations=EVALUATIONS, metrics={"main": run_dir / "metrics.jsonl"},
                           wall_s=10.0, store=store)
    assert json.loads((run_dir / "summary.json").read_text())["regions"] == summary["regions"]
    eu, us = summary["regions"]["eu"], summary["regions"]["us"]
    assert set(summary["regions"]) == {"eu", "us"} and summary["regions_unattributed_workers"] == []
    # groups and tokens summed over the steps; tokens/s over the 8 s of steps
    assert (eu["groups_trained"], eu["tokens"], us["groups_trained"], us["tokens"]) == (8, 350, 4, 160)
    assert eu["tokens_per_s"] == pytest.approx(350 / 8, abs=0.05) and us["tokens_per_s"] == pytest.approx(20.0)
    # staleness: the steps' means weighted by their groups
    assert eu["staleness_mean"] == pytest.approx((0.5 * 2 + 1.0 * 2 + 0.0 * 3 + 1.0 * 1) / 8)
    assert us["staleness_mean"] == pytest.approx((1.0 * 1 + 2.0 * 2 + 3.0 * 1) / 4)
    # dropped stale: 0 -> 1 -> 2, then a restarted trainer's 1
    assert (eu["dropped_stale"], us["dropped_stale"]) == (0, 3)
    # propagation over distinct versions, the newest figure of each: eu {1: 0.5, 2: 0.7, 3: 0.9}, us {1: 3.5, 3: 6.0}
    assert (eu["propagation_versions"], eu["propagation_p50_s"], eu["propagation_p99_s"]) == (3, 0.7, 0.9)
    assert (us["propagation_versions"], us["propagation_p50_s"], us["propagation_p99_s"]) == (2, 6.0, 6.0)
    # workers: the steps' counts decide every worker's region
    assert (eu["workers"], eu["worker_ids"], us["workers"], us["worker_ids"]) == (2, ["eu-0", "eu-1"], 1, ["us-0"])
    # eu's link: 5 versions published (0..4), 4 trainer steps; us has no link.json
    assert eu["link"] == {"bytes_down": 5_000_000, "bytes_up": 80_000, "cut_seconds": 3.5, "drops": 2,
                          "delay_ms": 50, "rate_mbit": 100, "bytes_down_per_version": 1_000_000,
                          "bytes_up_per_step": 20_000}
    assert "link" not in us and "replica" not in us
    # eu's replica, as its replicator wrote its status into the hub's store
    replica = eu["replica"]["policies"]["main"]
    assert (replica["replica_version"], replica["hub_version"], replica["lag_versions"]) == (4, 4, 0)
    assert replica["arrival_p50_s"] is not None and replica["arrival_p99_s"] >= replica["arrival_p50_s"]
    assert eu["replica"]["versions_copied"] == 5 and eu["replica"]["bytes_copied"] > 0

    page = write_html_report(run_dir, store=store).read_text()
    table = page.split("<h2>Regions</h2>")[1].split("</table>")[0]
    cells = [row.split("</td>")[0] for row in table.split("<tr>")[2:]]
    assert cells == ["<td>eu", "<td>us"]
    eu_row = table.split("<tr>")[2]
    for cell in ("2", "8", "44", "0.50", "0", "0.7 / 0.9", "main v4 (lag 0)", "5 MB (1 MB)", "80 kB (20 kB)", "3.5"):
        assert f"<td class=num>{cell}</td>" in eu_row, (cell, eu_row)
    found = panels(page)
    assert has_plot(found["region_throughput"]) and has_plot(found["region_propagation"])


def test_workers_the_rows_do_not_place_are_left_out_of_their_possible_regions_and_named(tmp_path: Path) -> None:
    rows = {"main": [
        {"version": 1, "step_wall_s": 1.0, "groups_by_worker": {"a": 1, "b": 1}, "groups_by_region": {"x": 1, "y": 1}},
        {"version": 2, "step_wall_s": 1.0, "groups_by_worker": {"c": 2}, "groups_by_region": {"z": 2}},
    ]}
    assert worker_regions(rows["main"]) == ({"c": "z"}, {"a": {"x", "y"}, "b": {"x", "y"}})
    figures, unattributed = region_figures(rows)
    assert unattributed == ["a", "b"]
    assert "workers" not in figures["x"] and "workers" not in figures["y"]
    assert figures["z"]["worker_ids"] == ["c"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    write_jsonl(run_dir / "metrics.jsonl", [{**r, "policy": "main", "reward_mean": 0.1, "time": 1000.0 + r["version"]}
                                           for r in rows["main"]])
    page = write_html_report(run_dir).read_text()
    assert "do not decide the region of worker(s) a, b" in page


def test_a_run_without_regions_has_one_line_and_rows_without_region_keys_none(tmp_path: Path) -> None:
    run_dir = make_run_dir(tmp_path)
    metrics = {"main": run_dir / "metrics.jsonl", "critic": run_dir / "metrics.critic.jsonl"}
    prep = {"policies": {"main": {"reward_start": 0.3}, "critic": {"reward_start": 0.5}}, "warmup_steps": 0,
            "warmup_seconds": 0.0}
    evaluations = {"main": {"accuracy": 0.8}, "critic": {"accuracy": 0.7}}
    summary = write_report(run_dir, prep=prep, evaluations=evaluations, metrics=metrics, wall_s=30.0)
    local = summary["regions"]["local"]
    assert list(summary["regions"]) == ["local"]  # both policies' groups in the one region
    assert (local["groups_trained"], local["workers"], local["worker_ids"]) == (2 * 12 * 4, 2, ["w-0", "w-1"])
    assert local["tokens_per_s"] == pytest.approx(2 * 300 / 2.0)  # two policies' 300 tokens per 2 s step
    assert "link" not in local and "replica" not in local and "regions_notes" not in summary

    (tmp_path / "older").mkdir()
    older = make_run_dir(tmp_path / "older", newer=False)
    summary = write_report(older, prep=prep, evaluations=evaluations,
                           metrics={"main": older / "metrics.jsonl", "critic": older / "metrics.critic.jsonl"},
                           wall_s=30.0)
    assert "regions" not in summary
