"""The operator's figures: propagation of a version to the live workers, and the scaling rule."""

from __future__ import annotations

import math

import pytest

from consumers.fleet import Propagation, recommend
from weightstore.telemetry import SEGMENT_ROWS, StoreTelemetry, read_status, read_store_metrics
from weightstore.objectstore import LocalDirStore


def test_propagation_is_the_slowest_live_worker_that_predates_the_version() -> None:
    p = Propagation()
    p.observe("a", 0, 1.0)
    p.observe("b", 0, 2.0)
    p.publish(1, 10.0)
    p.observe("a", 1, 12.0)
    assert p.latest({"a", "b"}) is None  # b has not used version 1 yet
    p.observe("b", 0, 13.0)  # still on version 0
    p.observe("c", 1, 14.0)  # joined after version 1 was published: not counted for it
    p.observe("b", 1, 15.5)
    p.observe("a", 1, 11.0)  # an earlier start on version 1 found late
    assert p.latest({"a", "b", "c"}) == (1, 5.5)
    assert p.latest({"a"}) == (1, 1.0)
    p.publish(2, 20.0)
    p.observe("a", 3, 21.0)  # newer than 2 counts as having 2
    p.observe("b", 2, 22.0)
    p.observe("c", 2, 26.0)
    assert p.latest({"a", "b", "c"}) == (2, 6.0)
    assert p.latest({"nobody"}) is None


def test_propagation_keeps_the_newest_versions_only() -> None:
    p = Propagation(keep=3)
    for v in range(10):
        p.publish(v, float(v))
    assert sorted(p.published) == [7, 8, 9]


@pytest.mark.parametrize("workers, wait", [(4, 0.2), (10, 0.5), (3, 0.11), (64, 0.9)])
def test_a_trainer_that_waits_over_ten_percent_gets_workers_by_the_rule(workers, wait) -> None:
    r = recommend(workers, wait)
    assert r.action == "add" and r.target_workers == math.ceil(workers / (1 - wait)) > workers
    assert r.as_dict()["change"] == r.target_workers - workers


def test_a_trainer_that_hardly_waits_sheds_the_workers_whose_groups_go_stale() -> None:
    r = recommend(10, 0.01, published_per_s=4.0, taken_per_s=2.0)
    assert (r.action, r.target_workers) == ("remove", math.ceil(1.1 * 10 * 2.0 / 4.0))
    assert recommend(10, 0.01, published_per_s=2.0, taken_per_s=2.0).action == "hold"  # no surplus
    assert recommend(10, 0.01, published_per_s=2.1, taken_per_s=2.0).action == "hold"  # surplus under the headroom
    assert recommend(10, 0.01).action == "hold"  # rates unknown
    assert recommend(10, 0.07, published_per_s=9.0, taken_per_s=1.0).action == "hold"  # between 5% and 10%
    assert recommend(1, 0.0, published_per_s=100.0, taken_per_s=1.0).target_workers == 1  # never below one
    assert recommend(0, 0.5).as_dict() == {"action": "add", "workers": 0, "target_workers": 1, "change": 1,
                                            "reason": "no live worker"}
    assert recommend(5, None).action == "hold"


def _row(version: int, wait: float = 1.0) -> dict:
    return {"policy": "main", "version": version, "step": version, "time": 100.0 + version, "wait_s": wait,
            "step_wall_s": 4.0, "groups": 8, "live_workers": 2, "propagation_s": 1.5, "propagated_version": version - 1,
            "reward_mean": 0.5}


def test_the_trainers_metrics_reach_the_store_in_segments_a_restart_never_overwrites(tmp_path) -> None:
    store = LocalDirStore(tmp_path)
    now = [0.0]
    first = StoreTelemetry(store, "main", max_steps=500, every_s=10.0, clock=lambda: now[0])
    for v in range(1, SEGMENT_ROWS + 31):
        now[0] += 1.0
        first.add(_row(v))
    # 130 rows at 1 s each: written at the first row, when a segment filled up (row 101) and 10 s after.
    assert [r["version"] for r in read_store_metrics(store, "main")] == list(range(1, 122))
    first.close()
    assert [r["version"] for r in read_store_metrics(store, "main")] == list(range(1, SEGMENT_ROWS + 31))
    status = read_status(store, "main")
    assert status["version"] == SEGMENT_ROWS + 30 and status["max_steps"] == 500
    assert status["wait_fraction"] == pytest.approx(0.25) and status["groups_per_s"] == pytest.approx(2.0)
    # A trainer resumed from a checkpoint at version 90 publishes from the store's latest on.
    again = StoreTelemetry(store, "main", every_s=10.0, clock=lambda: now[0])
    for v in range(SEGMENT_ROWS + 31, SEGMENT_ROWS + 36):
        again.add(_row(v, wait=2.0))
    again.close()
    assert [r["version"] for r in read_store_metrics(store, "main")] == list(range(1, SEGMENT_ROWS + 36))
    assert read_status(store, "main")["wait_fraction"] == pytest.approx(0.5)  # over the steps of the new trainer
    assert read_status(store, "other") is None and read_store_metrics(store, "other") == []


def _doc() -> dict:
    return {"run": "r1", "time": 0.0, "window_s": 60.0, "trainer_version": 12, "trainer_wait_fraction": 0.25,
            "propagation_s": 3.5,
            "recommendation": recommend(2, 0.25).as_dict(),
            "workers": [{"worker_id": "w-1", "region": "eu", "hardware": "h100", "engine": "vllm", "groups_per_s": 0.5,
                         "versions": {"main": 12}, "last_seen_s": 2.0}],
            "lag": {"r1.train.main": {"topics": {"r1.trajectories.main": {"0": 3, "1": 0}}, "total": 3}},
            "policies": {"main": {"trainer_version": 12, "trainer_step": 12, "max_steps": 100,
                                  "trainer_wait_fraction": 0.25, "trainer_groups_per_s": 1.0,
                                  "published_groups_per_s": 0.5, "propagation_s": 3.5, "trainer_status_age_s": 4.0}}}


def test_the_status_table_and_its_prometheus_text() -> None:
    from rich.console import Console

    from rlbus.report.status import prometheus_text, render

    console = Console(record=True, width=160)
    console.print(render(_doc()))
    text = console.export_text()
    assert "recommendation: add → 3 workers (+1)" in text and "w-1" in text and "eu" in text and "main v12" in text
    assert "12/100" in text and "0:3" in text and "25%" in text
    prom = prometheus_text(_doc())
    assert 'rlbus_fleet_recommended_workers{run="r1"} 3' in prom
    assert 'rlbus_fleet_consumer_lag{run="r1",group="r1.train.main"} 3' in prom
