"""`rlbus status` on a crafted fleet, real broker and store: live workers from the trajectory topic's
tail, the trainer's version and wait from the store, lag per consumer group, propagation, and the
scaling rule, the fleet by region; as JSON from the CLI and served over HTTP."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from broker.codec import encode_group
from broker.producer import Producer
from consumers.status import RunShape, fleet_status
from tests.integration.test_rollout_path import _group
from trainer.model import load_policy
from weightstore.telemetry import StoreTelemetry
from weightstore.config import LocalStoreConfig, WeightsConfig, build_store
from weightstore.manifest import read_manifest
from weightstore.publish import WeightPublisher
from weightstore.replica import status_key

pytestmark = pytest.mark.integration

WAIT = 0.3


def _crafted(run, store) -> dict[str, int]:
    """Three workers in three regions and a trainer that waits 30% of its time; returns the record
    bytes each region published."""
    model, _ = load_policy(run.model_dir)
    WeightPublisher(store, "main", WeightsConfig()).publish(1, model.state_dict())
    v1 = read_manifest(store, "main", 1).created_at
    fleet = [("w-eu", "eu-west", "h100", 0, v1 - 3.0), ("w-us", "us-east", "a10g", 0, v1 - 2.0),
             ("w-eu", "eu-west", "h100", 1, v1 + 2.0), ("w-us", "us-east", "a10g", 1, v1 + 5.0),
             ("w-late", "ap-south", "l4", 1, v1 + 1.0)]  # joined after v1: not counted for its propagation
    producer = Producer(run.kafka)
    sizes: dict[str, int] = {}
    for i, (worker, region, hardware, version, created) in enumerate(fleet):
        group = _group(run, f"p{i}", vocab=64)
        group.header = group.header.model_copy(update={
            "worker_id": worker, "region": region, "hardware": hardware, "min_version": version,
            "max_version": version, "created_at": created, "published_at": created + 0.5})
        group.token_versions = np.full(len(group.completion_tokens), version, np.int32)
        record = encode_group(group)
        sizes[region] = sizes.get(region, 0) + len(record)
        producer.send_and_wait(run.topics.trajectories("main"), record, key=group.header.group_id.encode())
    producer.close()
    telemetry = StoreTelemetry(store, "main", max_steps=100)
    for step in range(1, 6):
        telemetry.add({"policy": "main", "version": step, "step": step, "time": time.time(), "wait_s": WAIT * 2.0,
                       "step_wall_s": 2.0, "groups": 2, "live_workers": 3, "propagation_s": None,
                       "propagated_version": None, "reward_mean": 0.4})
    telemetry.close()
    return sizes


def test_status_sees_the_fleet_and_recommends_by_the_rule(policy_run) -> None:
    store = build_store(LocalStoreConfig(type="local", path=policy_run.store_url))
    sizes = _crafted(policy_run, store)
    replica = {"region": "eu-west", "time": time.time(), "bytes_copied": 4096, "errors": 0,
               "policies": {"main": {"replica_version": 0, "hub_version": 1, "lag_versions": 1,
                                     "arrival_p50_s": 0.8, "arrival_p99_s": 2.5, "arrival_s": [[0, 0.8]]}}}
    store.put(status_key("eu-west"), json.dumps(replica).encode())  # as eu-west's replicator writes it
    shape = RunShape(run=policy_run.topics.run, policies=["main"], streams=["main"])
    doc = fleet_status(policy_run.kafka, store, shape, window_s=120)
    workers = {w["worker_id"]: w for w in doc["workers"]}
    assert set(workers) == {"w-eu", "w-us", "w-late"}
    assert (workers["w-eu"]["region"], workers["w-eu"]["hardware"], workers["w-eu"]["versions"]) == \
        ("eu-west", "h100", {"main": 1})
    assert workers["w-us"]["groups_per_s"] == pytest.approx(2 / 120, abs=1e-4)
    assert doc["trainer_version"] == 1 and doc["trainer_wait_fraction"] == pytest.approx(WAIT)
    assert doc["propagation_s"] == pytest.approx(5.0, abs=0.01)  # the slowest worker live before v1
    assert doc["policies"]["main"]["propagated_version"] == 1
    # by region: each region's workers, its groups (3 completion tokens each), bytes, lag behind v1, replica
    regions = doc["regions"]
    assert list(regions) == ["ap-south", "eu-west", "us-east"]
    assert [regions[r]["workers"] for r in regions] == [["w-late"], ["w-eu"], ["w-us"]]
    assert regions["eu-west"]["groups_per_s"] == pytest.approx(2 / 120, abs=1e-4)
    assert regions["eu-west"]["tokens_per_s"] == pytest.approx(6 / 120, abs=0.01)
    assert {r: regions[r]["bytes_per_s"] for r in regions} == {r: pytest.approx(n / 120, abs=0.1)
                                                              for r, n in sizes.items()}
    assert (regions["us-east"]["version_lag_mean"], regions["us-east"]["version_lag_max"]) == (0.5, 1)
    assert regions["ap-south"]["version_lag_max"] == 0 and regions["ap-south"]["replica"] is None
    assert regions["eu-west"]["replica"]["policies"]["main"]["lag_versions"] == 1
    trainer_group = f"{shape.run}.train.main"
    assert doc["lag"][trainer_group]["total"] == 5  # nothing committed: every group waits
    reason = doc["recommendation"].pop("reason")
    assert doc["recommendation"] == {"action": "add", "workers": 3, "target_workers": math.ceil(3 / (1 - WAIT)),
                                     "change": math.ceil(3 / (1 - WAIT)) - 3}
    assert reason.startswith("the trainer waits 30% of its time (over 10%)"), reason

    # The same from the CLI, as an operator runs it.
    out = subprocess.run([sys.executable, "-m", "rlbus.cli", "status", "--broker", policy_run.kafka.bootstrap_servers,
                          "--store", policy_run.store_url, "--json", "--window", "120"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    cli = json.loads(out.stdout)
    for key in ("lag", "workers", "trainer_version", "trainer_wait_fraction", "propagation_s", "recommendation",
                "regions"):
        assert key in cli
    assert cli["recommendation"]["target_workers"] == 5 and len(cli["workers"]) == 3

    # Served for autoscalers: /status for KEDA's metrics-api scaler, /metrics for Prometheus.
    from rlbus.report.status import serve

    server = serve(0, lambda: fleet_status(policy_run.kafka, store, shape, window_s=120), host="127.0.0.1")
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        served = json.loads(urllib.request.urlopen(f"{base}/status", timeout=60).read())
        assert served["recommendation"]["target_workers"] == 5
        text = urllib.request.urlopen(f"{base}/metrics", timeout=60).read().decode()
        assert f'rlbus_fleet_recommended_workers{{run="{shape.run}"}} 5' in text
    finally:
        server.shutdown()


def test_status_of_a_store_without_a_run_says_what_to_pass(tmp_path) -> None:
    out = subprocess.run([sys.executable, "-m", "rlbus.cli", "status", "--broker", "127.0.0.1:1",
                          "--store", str(tmp_path), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "holds no rlbus run" in out.stderr and "--store" in out.stderr


def test_status_against_a_broker_that_is_away_says_so_once(policy_run) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "rlbus.cli", "status", "--broker", f"127.0.0.1:{port}",
                          "--store", policy_run.store_url, "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    assert "no Kafka broker answered" in out.stderr and "--broker" in out.stderr
    assert len(out.stderr.splitlines()) <= 3, out.stderr[:2000]  # no client library log on every retry
