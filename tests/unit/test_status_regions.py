"""``rlbus status`` by region: the figures of ``consumers.status.region_status`` from the groups of
the trajectory tail and the replicas' status documents, and the status view's regions table and
Prometheus gauges. (tests/integration/test_status.py reads the same from a real broker.)"""

from __future__ import annotations

import pytest
from rich.console import Console

from broker.schema import SamplingParams, TrajectoryHeader
from consumers.fleet import recommend
from consumers.status import Seen, region_status
from rlbus.report.status import prometheus_text, render

WINDOW = 10.0


def seen(worker: str, region: str, min_version: int, tokens: int, size: int, policy: str = "main") -> Seen:
    header = TrajectoryHeader(
        run="r1", policy=policy, group_id=f"{worker}-{min_version}-{tokens}/{policy}", prompt_id="p", task="addition",
        worker_id=worker, region=region, sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=8),
        rewards=[1.0, 0.0], finish_reasons=["stop", "stop"], min_version=min_version, max_version=min_version,
        vocab_size=64, created_at=100.0)
    return Seen(header, tokens, size)


REPLICA = {"region": "eu", "time": 195.0, "bytes_copied": 1000, "objects_copied": 3, "versions_copied": 2,
           "errors": 1, "policies": {"main": {"replica_version": 11, "hub_version": 12, "lag_versions": 1,
                                              "arrival_p50_s": 1.5, "arrival_p99_s": 4.0, "arrival_s": [[11, 1.5]]}}}


def test_region_status_sums_each_regions_groups_tokens_bytes_and_lag() -> None:
    groups = [seen("eu-0", "eu", 12, 30, 1000), seen("eu-1", "eu", 10, 50, 3000), seen("eu-0", "eu", 11, 20, 1000),
              seen("us-0", "us", 9, 40, 2000), seen("us-0", "us", 5, 10, 500, policy="critic")]
    replicas = {"eu": REPLICA, "ap": {"region": "ap", "time": 190.0}}
    regions = region_status(groups, {"main": 12, "critic": None}, replicas, window_s=WINDOW, now=200.0)
    assert list(regions) == ["ap", "eu", "us"]  # ap: a replica whose region published nothing in the window
    eu, us, ap = regions["eu"], regions["us"], regions["ap"]
    assert eu["workers"] == ["eu-0", "eu-1"] and us["workers"] == ["us-0"] and ap["workers"] == []
    assert (eu["groups_per_s"], eu["tokens_per_s"], eu["bytes_per_s"]) == (0.3, 10.0, 500.0)
    assert (us["groups_per_s"], us["tokens_per_s"], us["bytes_per_s"]) == (0.2, 5.0, 250.0)
    assert eu["version_lag_mean"] == pytest.approx((0 + 2 + 1) / 3) and eu["version_lag_max"] == 2
    assert (us["version_lag_mean"], us["version_lag_max"]) == (3, 3)  # the critic's trainer version is not known
    assert eu["replica"] == {"status_age_s": 5.0, "bytes_copied": 1000, "errors": 1, "policies": {"main": {
        "replica_version": 11, "hub_version": 12, "lag_versions": 1, "arrival_p50_s": 1.5, "arrival_p99_s": 4.0}}}
    assert us["replica"] is None and ap["replica"]["policies"] == {}
    assert (ap["groups_per_s"], ap["version_lag_mean"]) == (0.0, None)


def test_the_status_view_prints_the_regions_and_serves_their_gauges() -> None:
    regions = region_status([seen("eu-0", "eu", 12, 30, 4000), seen("us-0", "us", 9, 40, 2000)], {"main": 12},
                            {"eu": REPLICA}, window_s=WINDOW, now=200.0)
    doc = {"run": "r1", "time": 200.0, "window_s": WINDOW, "trainer_version": 12, "trainer_wait_fraction": 0.25,
           "propagation_s": 3.5, "recommendation": recommend(2, 0.25).as_dict(), "workers": [], "lag": {},
           "policies": {}, "regions": regions}
    console = Console(record=True, width=200)
    console.print(render(doc))
    text = console.export_text()
    assert "regions" in text
    eu = next(line for line in text.splitlines() if line.lstrip("│ ").startswith("eu "))
    for cell in ("0.10", "400 B", "0.0/0", "main v11 (lag 1)", "1.5/4.0"):
        assert cell in eu, (cell, eu)
    prom = prometheus_text(doc)
    assert 'rlbus_fleet_region_live_workers{run="r1",region="eu"} 1' in prom
    assert 'rlbus_fleet_region_tokens_per_s{run="r1",region="us"} 4.0' in prom
    # a status without regions (an older document) still renders
    del doc["regions"]
    console.print(render(doc))
    assert "region_" not in prometheus_text(doc)
