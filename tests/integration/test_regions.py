"""A region's pieces over real servers: the WAN link in front of a real broker and a real S3 server,
the replicator that fills a region's store through it, and followers of a replica that lags or
fills out of order."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from broker.admin import ensure_topics
from broker.producer import Producer
from broker.reader import PartitionReader
from broker.settings import KafkaConfig
from rlbus.link import Link, LinkConfig, parse_address
from tests.fixtures.kafka import KafkaBrokerHandle
from weightstore.config import ReplicaConfig, S3StoreConfig, WeightsConfig, build_store
from weightstore.errors import NotFound
from weightstore.follow import WeightFollower
from weightstore.manifest import latest_key, manifest_key, read_manifest, weights_sha256
from weightstore.objectstore import LocalDirStore, ObjectStore
from weightstore.publish import WeightPublisher
from weightstore.replica import Replicator, read_region_status

pytestmark = pytest.mark.integration

POLICY = "main"


def states(n: int, seed: int = 0):
    """Weights of a small model before and after each of n - 1 AdamW steps on a real loss."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Flatten(), torch.nn.Linear(32 * 4, 96),
                                torch.nn.GELU(), torch.nn.Linear(96, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 64, (64, 4))
    y = x.sum(dim=1) % 64
    for i in range(n):
        if i:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        yield {k: v.detach().clone() for k, v in model.state_dict().items()}


def publish(store: ObjectStore, n: int, *, anchor_every: int = 5) -> tuple[WeightPublisher, dict[int, str]]:
    publisher = WeightPublisher(store, POLICY, WeightsConfig(anchor_every=anchor_every, keep_versions=100))
    hashes = {}
    for version, state in enumerate(states(n)):
        publisher.publish(version, state)
        hashes[version] = weights_sha256({k: v.to(torch.bfloat16) for k, v in state.items()})
    return publisher, hashes


def stored_bytes(store: ObjectStore, versions: range) -> int:
    """Bytes of what the versions' manifests name (each chunk once) and of the manifests."""
    chunks, total = {}, 0
    for v in versions:
        m = read_manifest(store, POLICY, v)
        chunks.update({c.key: c.size for c in m.chunks + m.delta_chunks})
        total += len(store.get(manifest_key(POLICY, v)).data)
    return total + sum(chunks.values())


def read_all(kafka: KafkaConfig, topic: str, at_least: int) -> list[bytes]:
    """Every record of ``topic`` (reading until ``at_least`` arrived, or 20 s)."""
    reader = PartitionReader(kafka, topic)
    got: list[bytes] = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        batch = [r.value for r in reader.read(100, 0.5)]
        got += batch
        if len(got) >= at_least and not batch:
            break
    reader.close()
    return got


@pytest.fixture
def link_to_s3(s3_store_config: S3StoreConfig):
    """A 20 ms link in front of the S3 server; the hub's store as a region reaches it through the link."""
    link = Link(LinkConfig(delay_ms=20), name="region")
    host, port = s3_store_config.endpoint_url.removeprefix("http://").split(":")
    link.add_route((host, int(port)))
    link.start()
    try:
        far = s3_store_config.model_copy(update={"endpoint_url": f"http://{link.address()}"})
        yield link, build_store(far)
    finally:
        link.stop()


def test_a_version_crosses_the_link_once_however_many_workers_follow_the_replica(
        s3_store_config: S3StoreConfig, link_to_s3, tmp_path) -> None:
    link, hub_far = link_to_s3
    hub = build_store(s3_store_config)
    replica = LocalDirStore(tmp_path / "replica")
    replicator = Replicator(hub_far, replica, [POLICY], region="eu", config=ReplicaConfig(keep_versions=4))
    followers = [WeightFollower(replica, POLICY, replica_wait_s=30) for _ in range(3)]
    publisher = WeightPublisher(hub, POLICY, WeightsConfig(anchor_every=5, keep_versions=100))
    for version, state in enumerate(states(12)):
        publisher.publish(version, state)
        assert [v for _, v in replicator.sync()] == [version]
        for f in followers:
            update = f.poll()
            assert update is not None and update.version == version
            assert weights_sha256(update.state_dict) == read_manifest(hub, POLICY, version).weights_sha256
    crossed, stored = link.stats()["bytes_down"], stored_bytes(hub, range(12))
    assert replicator.bytes_copied >= stored  # every chunk and manifest, plus the LATEST pointers
    # HTTP adds headers to each of the few objects of a version; three followers add nothing
    assert stored <= crossed < 2 * stored, (crossed, stored)
    assert replicator.chunks_skipped == 0 and replicator.versions_copied == 12
    # the replica keeps its newest 4 versions and their chain back to its anchor (v10's: v5)
    assert sorted(int(k.rsplit("/v", 1)[1].removesuffix(".json")) for k in replica.list(f"{POLICY}/manifests/")) \
        == [5, 6, 7, 8, 9, 10, 11]
    replicator.write_status()
    status = read_region_status(hub)["eu"]["policies"][POLICY]
    assert status["replica_version"] == 11 and status["lag_versions"] == 0 and status["arrival_p99_s"] is not None

    # The same three followers on the hub's store across the link: each version crosses three times.
    before = link.stats()["bytes_down"]
    updates = [WeightFollower(hub_far, POLICY).poll() for _ in range(3)]
    assert [u.version for u in updates] == [11] * 3
    assert link.stats()["bytes_down"] - before >= 3 * updates[0].bytes_downloaded


def test_a_follower_waits_for_a_version_whose_chunks_have_not_arrived(tmp_path) -> None:
    hub, replica = LocalDirStore(tmp_path / "hub"), LocalDirStore(tmp_path / "replica")
    publisher, hashes = publish(hub, 4)
    Replicator(hub, replica, [POLICY], region="eu").sync()
    follower = WeightFollower(replica, POLICY, replica_wait_s=60)
    assert follower.poll().version == 3
    *_, state = states(5)
    publisher.publish(4, state)
    # replication that keeps no order: the manifest and LATEST of v4 arrive before its chunks
    for key in (manifest_key(POLICY, 4), latest_key(POLICY)):
        replica.put(key, hub.get(key).data)
    for _ in range(3):
        assert follower.poll() is None
    assert follower.current_version == 3 and follower.replica_waits == 3
    assert weights_sha256(follower.state_dict) == hashes[3]
    for ref in read_manifest(hub, POLICY, 4).chunks:
        replica.put(ref.key, hub.get(ref.key).data)
    update = follower.poll()
    assert update.version == 4 and update.path == "delta" and follower.hub_fetches == 0
    assert weights_sha256(update.state_dict) == read_manifest(hub, POLICY, 4).weights_sha256


def test_an_announced_version_is_copied_without_asking_the_hubs_latest(tmp_path) -> None:
    hub, replica = LocalDirStore(tmp_path / "hub"), LocalDirStore(tmp_path / "replica")
    publisher, _ = publish(hub, 4)
    replicator = Replicator(hub, replica, [POLICY], region="eu")
    replicator.sync()
    *_, state = states(5)
    assert publisher.publish(4, state).kind == "delta"
    hub.delete(latest_key(POLICY))  # LATEST unreadable: only the announcement names v4
    assert replicator.sync() == []
    replicator.announce(POLICY, 4)
    assert replicator.sync() == [(POLICY, 4)]
    follower = WeightFollower(replica, POLICY, replica_wait_s=60)
    update = follower.poll()
    assert update.version == 4 and weights_sha256(update.state_dict) == read_manifest(hub, POLICY, 4).weights_sha256


def test_a_replica_that_lags_past_its_bound_sends_the_follower_to_the_hub(tmp_path) -> None:
    hub, replica = LocalDirStore(tmp_path / "hub"), LocalDirStore(tmp_path / "replica")
    publish(hub, 3)
    replicator = Replicator(hub, replica, [POLICY], region="eu")
    replicator.sync()
    publisher = WeightPublisher(hub, POLICY, WeightsConfig(anchor_every=5, keep_versions=100))
    for version, state in enumerate(states(8)):
        if version >= 3:
            publisher.publish(version, state)  # the replica stays at v2
    lonely = WeightFollower(replica, POLICY, replica_wait_s=0.3)  # no hub to fall back on
    follower = WeightFollower(replica, POLICY, replica_wait_s=0.3, hub=hub)
    for f in (lonely, follower):
        assert f.poll().version == 2
        assert f.poll(need=6) is None  # v6 is needed, the replica has v2: waited for, not yet overdue
    time.sleep(0.4)
    assert lonely.poll(need=6) is None and lonely.current_version == 2  # no hub: it goes on waiting
    update = follower.poll(need=6)
    assert update.version == 7 and follower.hub_fetches == 1 and follower.hub_bytes == update.bytes_downloaded
    replicator.sync()  # the replica catches up; the follower is back on it
    assert follower.poll() is None and follower.current_version == 7


def test_shuffled_replication_never_gets_half_a_version_loaded(tmp_path) -> None:
    hub, replica = LocalDirStore(tmp_path / "hub"), LocalDirStore(tmp_path / "replica")
    # one copier: a version's objects land 10 ms apart, a window the follower's polls see
    replicator = Replicator(hub, replica, [POLICY], region="eu",
                            config=ReplicaConfig(order="shuffled", shuffle_pause_s=0.01, copy_workers=1))
    follower = WeightFollower(replica, POLICY, replica_wait_s=60)
    loaded: list[tuple[int, str]] = []
    done = threading.Event()

    def follow() -> None:
        while not done.is_set() or follower.current_version != 15:
            update = follower.poll()
            if update is not None:
                loaded.append((update.version, weights_sha256(update.state_dict)))
            time.sleep(0.003)

    thread = threading.Thread(target=follow)
    thread.start()
    publisher = WeightPublisher(hub, POLICY, WeightsConfig(anchor_every=5, keep_versions=100))
    want = {}
    for version, state in enumerate(states(16)):
        publisher.publish(version, state)
        want[version] = read_manifest(hub, POLICY, version).weights_sha256
        replicator.sync()
    done.set()
    thread.join(60)
    assert loaded and loaded[-1][0] == 15
    assert all(sha == want[v] for v, sha in loaded)  # every version it loaded was whole and verified
    assert follower.replica_waits > 0  # the shuffled order did show it incomplete versions


def test_a_replica_the_hubs_retention_passed_mid_copy_catches_up_from_the_anchor(tmp_path) -> None:
    """A replica copying deltas (a slow link, a cut just healed) while the hub publishes on and its
    retention deletes them: the pass fails on a missing chunk, and the replica then copies the
    target's anchor and what follows, or the next pass the hub's newest, never the same gone deltas
    pass after pass (a region that stayed behind for good)."""
    hub, replica = LocalDirStore(tmp_path / "hub"), LocalDirStore(tmp_path / "replica")
    replicator = Replicator(hub, replica, [POLICY], region="eu",
                            config=ReplicaConfig(order="shuffled", shuffle_pause_s=0.02))
    publisher = WeightPublisher(hub, POLICY, WeightsConfig(anchor_every=10, keep_versions=5))
    # each version moves one row of the embedding: a delta costs little beside an anchor, so the delta
    # path from what the replica holds is the one it plans, as in a long run
    all_states = [next(states(1))]
    for version in range(1, 15):
        state = {k: v.clone() for k, v in all_states[-1].items()}
        state["0.weight"][version] += 0.5
        all_states.append(state)
    for version in range(3):
        publisher.publish(version, all_states[version])
    assert replicator.sync()[-1] == (POLICY, 2)
    for version in range(3, 10):
        publisher.publish(version, all_states[version])  # v0's chain: all kept
    before = set(replica.list(f"{POLICY}/"))
    failed: list[Exception] = []

    def copy() -> None:
        try:
            replicator.sync()
        except Exception as exc:  # noqa: BLE001 - the assertion below says what it was
            failed.append(exc)

    copying = threading.Thread(target=copy)
    copying.start()
    deadline = time.monotonic() + 30
    while set(replica.list(f"{POLICY}/")) == before and time.monotonic() < deadline:
        time.sleep(0.002)
    # The copy has begun. v10 is an anchor; the hub keeps v10..v14 and deletes v1..v9, what the pass
    # planned; the delta path v3..v14 (known manifests, then v10's delta on v9) stays the cheapest.
    for version in range(10, 15):
        publisher.publish(version, all_states[version])
    copying.join(60)
    passes = 0
    while replicator.state[POLICY].version != 14 and passes < 5:
        passes += 1
        try:
            replicator.sync()
        except NotFound as exc:
            failed.append(exc)
    assert replicator.state[POLICY].version == 14, (passes, failed)
    update = WeightFollower(replica, POLICY, replica_wait_s=30).poll()
    assert update.version == 14 and weights_sha256(update.state_dict) == read_manifest(hub, POLICY, 14).weights_sha256


def test_every_client_behind_a_kafka_route_goes_through_the_link(kafka_broker: KafkaBrokerHandle,
                                                                 run_name: str) -> None:
    link = Link(LinkConfig(delay_ms=10), name="eu")
    link.add_route(parse_address(kafka_broker.bootstrap), kafka=True)
    link.start()
    topic = f"{run_name}.trajectories.main"
    far, near = KafkaConfig(bootstrap_servers=link.address()), KafkaConfig(bootstrap_servers=kafka_broker.bootstrap)
    try:
        ensure_topics(near, {topic: 2})
        producer = Producer(far)
        values = [os.urandom(20_000) for _ in range(20)]  # incompressible
        for i, value in enumerate(values):
            producer.produce(topic, value, key=str(i).encode())
        producer.flush(60)
        producer.close()
        assert link.stats()["bytes_up"] > sum(map(len, values))  # the records crossed the link
        assert sorted(read_all(far, topic, len(values))) == sorted(values)
        stats = link.stats()
        assert stats["bytes_down"] > sum(map(len, values)) and stats["kafka_addresses_rewritten"] > 0

        link.cut()  # a cut link holds what is sent until it comes back
        producer = Producer(far)
        producer.produce(topic, b"sent during the cut", key=b"cut")
        time.sleep(2.0)
        assert b"sent during the cut" not in read_all(near, topic, len(values))
        link.restore()
        producer.flush(60)
        producer.close()
        assert b"sent during the cut" in read_all(near, topic, len(values) + 1)
        assert link.stats()["cut_seconds"] >= 2.0
    finally:
        link.stop()


def test_a_member_that_gave_up_on_what_it_read_goes_back_to_its_committed_offsets(kafka_config: KafkaConfig,
                                                                                  run_name: str) -> None:
    from broker.reader import GroupReader

    topic = f"{run_name}.prompts.main"
    ensure_topics(kafka_config, {topic: 1})
    producer = Producer(kafka_config)
    for i in range(10):
        producer.produce(topic, f"p{i}".encode(), key=b"k")
    producer.flush(60)
    producer.close()
    reader = GroupReader(kafka_config, f"{run_name}.rollout", [topic])
    try:
        got: list = []
        deadline = time.monotonic() + 60
        while len(got) < 10 and time.monotonic() < deadline:
            got += reader.read(10, 0.5)
        reader.commit({(topic, 0): got[3].offset + 1})  # p0..p3 delivered; p4..p9 were given up
        assert reader.rewind() == {(topic, 0): got[3].offset + 1}
        again: list = []
        deadline = time.monotonic() + 60
        while len(again) < 6 and time.monotonic() < deadline:
            again += reader.read(10, 0.5)
        assert [r.value for r in again] == [f"p{i}".encode() for i in range(4, 10)]
    finally:
        reader.close()


def test_a_record_its_waiter_gave_up_on_does_not_stop_the_producer(run_name: str) -> None:
    from concurrent.futures import wait

    from broker.errors import DeliveryFailed

    closed = KafkaConfig(bootstrap_servers="127.0.0.1:9", delivery_timeout_ms=1000)  # nothing listens there
    producer = Producer(closed)
    try:
        abandoned = producer.produce(f"{run_name}.t", b"a")
        abandoned.cancel()  # as a worker abandons the batches it gives up on
        wait([abandoned], timeout=1)
        time.sleep(2.5)  # its delivery report (a failure) arrives for a cancelled future
        later = producer.produce(f"{run_name}.t", b"b")
        with pytest.raises(DeliveryFailed):
            later.result(timeout=30)  # the producer's thread still reports
    finally:
        producer.close(timeout_s=1)


def test_connections_a_lossy_link_drops_are_made_again_and_nothing_is_lost(kafka_broker: KafkaBrokerHandle,
                                                                           run_name: str) -> None:
    link = Link(LinkConfig(delay_ms=5, drops_per_min=240), name="lossy")  # a connection reset every 0.25 s
    link.add_route(parse_address(kafka_broker.bootstrap), kafka=True)
    link.start()
    topic = f"{run_name}.trajectories.main"
    far = KafkaConfig(bootstrap_servers=link.address())
    try:
        ensure_topics(KafkaConfig(bootstrap_servers=kafka_broker.bootstrap), {topic: 2})
        producer = Producer(far)
        values = [os.urandom(2000) for _ in range(40)]
        for i, value in enumerate(values):
            producer.produce(topic, value, key=str(i).encode())
            time.sleep(0.1)  # over four seconds: through a dozen drops
        producer.flush(60)
        producer.close()
        got = read_all(KafkaConfig(bootstrap_servers=kafka_broker.bootstrap), topic, len(values))
        assert set(values) <= set(got)  # every record arrived (a resent one may arrive twice)
        assert link.stats()["drops"] >= 3 and link.stats()["connections"] > 3  # dropped, and made again
    finally:
        link.stop()
