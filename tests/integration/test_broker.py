"""The Kafka layer against a real broker: producers, consumer groups, partition readers and
offsets behave the way workers and trainers rely on.

Waits are bounded by attempt counts (a safety net against hangs, not a speed requirement).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from broker.admin import cluster_id, end_offsets, ensure_topics, topic_partitions, wait_for_broker
from broker.codec import decode_group, encode_group
from broker.embedded import EmbeddedBroker, EmbeddedBrokerConfig
from broker.errors import BrokerError, BrokerUnavailable, KafkaPropertyError, TopicMissing
from broker.headers import group_headers
from broker.producer import Producer
from broker.reader import GroupReader, PartitionReader, Record
from broker.schema import SamplingParams, TrajectoryGroup
from broker.settings import KafkaConfig
from broker.topics import Topics
from tests.fixtures.helpers import make_header

pytestmark = pytest.mark.integration

POLL_S = 0.2
MAX_POLLS = 600  # 2 minutes of polling at most before a wait gives up


@pytest.fixture
def fast_config(kafka_config: KafkaConfig) -> KafkaConfig:
    """Shorter group timeouts: on Tansu a rebalance takes about session_timeout_ms / 2."""
    return kafka_config.model_copy(update={"session_timeout_ms": 4000, "heartbeat_interval_ms": 500})


def _group(i: int, n_tokens: int = 6, vocab_size: int = 50_000) -> TrajectoryGroup:
    rng = np.random.default_rng(i)
    header = make_header(
        run="it", group_id=f"g{i}", prompt_id=f"p{i}", task="arith",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n_tokens), rewards=[1.0, 0.0],
        finish_reasons=["stop", "length"], min_version=i, max_version=i, vocab_size=vocab_size, created_at=time.time(),
    )
    return TrajectoryGroup(
        header=header,
        prompt_tokens=rng.integers(0, vocab_size, 4, dtype=np.int32),
        completion_tokens=rng.integers(0, vocab_size, n_tokens, dtype=np.int32),
        completion_offsets=np.array([0, n_tokens // 2, n_tokens], dtype=np.int32),
        behaviour_logprobs=-rng.random(n_tokens, dtype=np.float32),
        token_versions=np.full(n_tokens, i, dtype=np.int32),
    )


def _produce(config: KafkaConfig, topic: str, records: list[tuple[int, bytes, list]]) -> None:
    producer = Producer(config)
    try:
        sent = [producer.produce(topic, value, key=b"k", partition=p, headers=h) for p, value, h in records]
        producer.flush(30)
        for delivery in sent:
            delivery.result()
    finally:
        producer.close()


def _read_until(readers: list, done: Callable[[], bool], sink: list[Record] | None = None) -> None:
    for _ in range(MAX_POLLS):
        if done():
            return
        for reader in readers:
            got = reader.read(64, POLL_S / len(readers))
            if sink is not None:
                sink.extend(got)
    raise AssertionError("condition not reached while reading; see the broker log for group activity")


def test_broker_advertises_loopback_and_topics_are_idempotent(kafka_config: KafkaConfig, kafka_broker, run_name):
    topics = Topics(run_name)
    plan = topics.plan(["main"], ["main"], prompt_partitions=32, trajectory_partitions=8)
    ensure_topics(kafka_config, plan)
    ensure_topics(kafka_config, plan)  # a second call (another process) changes nothing
    assert topic_partitions(kafka_config, topics.prompts("main")) == 32
    assert topic_partitions(kafka_config, topics.trajectories("main")) == 8
    with pytest.raises(TopicMissing, match="does not exist"):
        topic_partitions(kafka_config, f"{run_name}.nothing")
    brokers = AdminClient(kafka_config.admin_conf()).list_topics(timeout=10).brokers
    assert [f"{b.host}:{b.port}" for b in brokers.values()] == [kafka_broker.bootstrap]


def test_the_topics_rlbus_creates_carry_their_retention(kafka_config: KafkaConfig, run_name: str) -> None:
    """Records leave a run's topics when rlbus trims them, never by age or size (a broker that honours
    retention, as Apache Kafka does, would otherwise drop records no group has read while a run is paused);
    an operator's retention.ms is given to every topic."""
    config = kafka_config.model_copy(update={"topic_retention_ms": 7 * 24 * 3600 * 1000})
    topics = Topics(run_name)
    ensure_topics(kafka_config, {topics.control: 1, topics.trajectories("main"): 2})
    ensure_topics(config, {topics.prompts("main"): 2})
    admin = AdminClient(kafka_config.admin_conf())
    resources = [ConfigResource(ConfigResource.Type.TOPIC, t)
                 for t in (topics.control, topics.trajectories("main"), topics.prompts("main"))]
    settings = {r.name: {k: c.value for k, c in f.result(timeout=10).items()}
                for r, f in admin.describe_configs(resources).items()}
    for topic in (topics.control, topics.trajectories("main")):
        assert settings[topic]["retention.ms"] == "-1" and settings[topic]["retention.bytes"] == "-1"
        assert settings[topic]["cleanup.policy"] == "delete"
        assert settings[topic]["segment.bytes"] == str(64 * 1024 * 1024)
        assert settings[topic]["max.message.bytes"] == str(kafka_config.max_message_bytes)
    assert settings[topics.prompts("main")]["retention.ms"] == str(7 * 24 * 3600 * 1000)


def test_producer_to_a_consumer_group_with_headers_and_a_large_record(kafka_config: KafkaConfig, run_name: str) -> None:
    topic = Topics(run_name).trajectories("main")
    ensure_topics(kafka_config, {topic: 4})
    groups = [_group(i) for i in range(12)] + [_group(99, n_tokens=500_000)]  # one record of ~2.6 MB
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    records = [(i % 4, encode_group(g), group_headers(g.header, traceparent)) for i, g in enumerate(groups)]
    assert len(records[-1][1]) > 2 * 1024 * 1024  # over librdkafka's default fetch sizes
    _produce(kafka_config, topic, records)

    reader = GroupReader(kafka_config, f"{run_name}.train", [topic])
    received: list[Record] = []
    try:
        _read_until([reader], lambda: len(received) >= len(groups), received)
    finally:
        reader.close()
    decoded = {decode_group(r.value, vocab_size=50_000).header.group_id: r for r in received}
    assert sorted(decoded) == sorted(g.header.group_id for g in groups)
    big = decode_group(decoded["g99"].value)
    assert big.completion_tokens.tobytes() == groups[-1].completion_tokens.tobytes()
    headers = decoded["g7"].headers
    assert (headers["rlbus-policy"], headers["rlbus-min-version"], headers["traceparent"]) == ("main", "7", traceparent)
    assert abs(decoded["g7"].timestamp_ms / 1000 - time.time()) < 600  # the record's CreateTime, Unix ms


def test_group_members_share_partitions_and_one_takes_over(fast_config: KafkaConfig, run_name: str) -> None:
    topic = Topics(run_name).trajectories("main")
    ensure_topics(fast_config, {topic: 4})
    a = GroupReader(fast_config, f"{run_name}.train", [topic])
    try:
        _read_until([a], lambda: {p for _, p in a.assignment()} == {0, 1, 2, 3})
        b = GroupReader(fast_config, f"{run_name}.train", [topic])
        try:
            _read_until([a, b], lambda: len(a.assignment()) == 2 and len(b.assignment()) == 2)
            assert a.assignment() | b.assignment() == {(topic, p) for p in range(4)}
            # range: two contiguous partitions each
            assert sorted(sorted(p for _, p in r.assignment()) for r in (a, b)) == [[0, 1], [2, 3]]
        finally:
            b.close()
        _read_until([a], lambda: len(a.assignment()) == 4)
    finally:
        a.close()


def test_committed_offsets_survive_a_member_restart(fast_config: KafkaConfig, run_name: str) -> None:
    topic = Topics(run_name).trajectories("main")
    ensure_topics(fast_config, {topic: 1})
    _produce(fast_config, topic, [(0, f"m{i}".encode(), []) for i in range(10)])
    group = f"{run_name}.train"

    first = GroupReader(fast_config, group, [topic])
    seen: list[Record] = []
    try:
        _read_until([first], lambda: len(seen) >= 10, seen)
        assert first.commit({(topic, 0): seen[5].offset + 1})  # trained on m0..m5; m6..m9 in flight
        assert first.committed([(topic, 0)]) == {(topic, 0): 6}
    finally:
        first.close()

    second = GroupReader(fast_config, group, [topic])
    again: list[Record] = []
    try:
        _read_until([second], lambda: len(again) >= 4, again)
        for _ in range(5):  # nothing beyond the uncommitted four arrives
            assert second.read(10, POLL_S) == []
    finally:
        second.close()
    assert [r.value for r in again] == [b"m6", b"m7", b"m8", b"m9"]
    assert [r.value for r in seen] == [f"m{i}".encode() for i in range(10)]


def test_a_group_redelivers_what_a_closed_member_did_not_commit(fast_config: KafkaConfig, run_name: str) -> None:
    topic = Topics(run_name).prompts("main")
    ensure_topics(fast_config, {topic: 4})
    keeper = GroupReader(fast_config, f"{run_name}.rollout", [topic])
    quitter = GroupReader(fast_config, f"{run_name}.rollout", [topic])
    try:
        _read_until([keeper, quitter], lambda: len(keeper.assignment()) == 2 and len(quitter.assignment()) == 2)
        # produced once the group is settled: nothing is read (and dropped) by the assignment wait above
        _produce(fast_config, topic, [(i % 4, f"p{i}".encode(), []) for i in range(20)])
        kept: list[Record] = []
        _read_until([keeper], lambda: len(kept) >= 10, kept)
        assert keeper.commit({(r.topic, r.partition): r.offset + 1 for r in kept})  # finished its prompts
        dropped: list[Record] = []
        _read_until([quitter], lambda: len(dropped) >= 10, dropped)
        quitter.close()  # closed WITHOUT committing: its prompts must come back
        redelivered: list[Record] = []
        _read_until([keeper], lambda: len(redelivered) >= 10, redelivered)
        assert len(keeper.assignment()) == 4
    finally:
        quitter.close()
        keeper.close()
    where = lambda records: sorted((r.partition, r.offset) for r in records)  # noqa: E731
    assert {r.partition for r in kept}.isdisjoint({r.partition for r in dropped})
    assert where(redelivered) == where(dropped)  # every uncommitted prompt, and no committed one


def _assigned_within(readers: list[GroupReader], seconds: float, sink: list[Record]) -> float | None:
    """Read until every reader holds partitions; the seconds it took, or None past ``seconds``."""
    start = time.monotonic()
    while time.monotonic() - start < seconds:
        for reader in readers:
            sink.extend(reader.read(64, POLL_S / len(readers)))
        if all(reader.assignment() for reader in readers):
            return time.monotonic() - start
    return None


def test_a_member_with_the_roles_settings_joins_in_half_a_session_timeout(kafka_config: KafkaConfig,
                                                                          run_name: str) -> None:
    """Tansu holds every join of a group for half its session timeout, at the first join and at each
    rebalance: with the settings every role uses (the defaults) a worker or trainer waits about that
    long for its partitions, not tens of seconds (23 s at librdkafka's default)."""
    session_s = kafka_config.session_timeout_ms / 1000
    assert session_s <= 6, "the roles' session timeout: Tansu holds each join of their groups half of it"
    topic = Topics(run_name).prompts("main")
    ensure_topics(kafka_config, {topic: 2})
    group = f"{run_name}.rollout"
    first = GroupReader(kafka_config, group, [topic])
    second = None
    try:
        assert _assigned_within([first], session_s, []) is not None, "no assignment within a session timeout"
        second = GroupReader(kafka_config, group, [topic])  # a rebalance: the first learns of it at a heartbeat
        bound_s = session_s + kafka_config.heartbeat_interval_ms / 1000
        assert _assigned_within([first, second], bound_s, []) is not None, "the rebalance outlasted its bound"
    finally:
        first.close()
        if second is not None:
            second.close()


def test_members_that_go_mid_join_do_not_stall_the_next(fast_config: KafkaConfig, run_name: str) -> None:
    """A member that closes while its group is forming (during its own first join, or during the
    rebalance a new member's join began) must not stall the others: Tansu kept such a group waiting
    for good when its leader sent LeaveGroup (no member was assigned again until the broker
    restarted). A member now goes as a killed one would; the broker expires it after a session
    timeout, and the next member gets every partition, with the records nobody committed, within a
    few session timeouts."""
    topic = Topics(run_name).prompts("main")
    ensure_topics(fast_config, {topic: 2})
    _produce(fast_config, topic, [(i % 2, f"p{i}".encode(), []) for i in range(4)])
    group = f"{run_name}.rollout"
    session_s = fast_config.session_timeout_ms / 1000
    deadline_s = 4 * session_s  # expiry (one), the next join (a half), its sync, and slack
    first = GroupReader(fast_config, group, [topic])
    second = third = None
    try:
        assert _assigned_within([first], session_s / 4, []) is None  # its join is held at the broker
        first.close()  # the leader of a forming group goes
        second = GroupReader(fast_config, group, [topic])
        read: list[Record] = []
        assert _assigned_within([second], deadline_s, read) is not None, "the group stalled after a member went"
        _read_until([second], lambda: len(read) >= 4, read)

        third = GroupReader(fast_config, group, [topic])  # the group rebalances, led by second
        assert _assigned_within([second, third], session_s / 4, []) is None
        second.close()  # mid-rebalance, uncommitted
        again: list[Record] = []
        assert _assigned_within([third], deadline_s, again) is not None, "the group stalled after its leader went"
        _read_until([third], lambda: len(again) >= 4, again)
        assert len(third.assignment()) == 2
    finally:
        for reader in (first, second, third):
            if reader is not None:
                reader.close()
    assert sorted(r.value for r in again) == sorted(r.value for r in read) == [f"p{i}".encode() for i in range(4)]


def test_a_partition_reader_from_the_end_sees_only_what_comes_after_it(kafka_config: KafkaConfig, run_name) -> None:
    topic = Topics(run_name).control
    ensure_topics(kafka_config, {topic: 1})
    _produce(kafka_config, topic, [(0, b"before", [])])
    late = PartitionReader(kafka_config, topic, start="end")
    early = PartitionReader(kafka_config, topic, start="beginning")
    try:
        assert late.read(10, 1.0) == []  # assigned at the end; it also fetched once
        _produce(kafka_config, topic, [(0, b"after", [])])
        late_seen: list[Record] = []
        early_seen: list[Record] = []
        _read_until([late], lambda: len(late_seen) >= 1, late_seen)
        _read_until([early], lambda: len(early_seen) >= 2, early_seen)
    finally:
        late.close()
        early.close()
    assert [r.value for r in late_seen] == [b"after"]
    assert [r.value for r in early_seen] == [b"before", b"after"]
    with pytest.raises(TopicMissing):
        PartitionReader(kafka_config, f"{run_name}.nothing")


def test_client_errors_come_out_as_broker_errors(kafka_config: KafkaConfig, run_name: str) -> None:
    topic = Topics(run_name).dlq
    ensure_topics(kafka_config, {topic: 1})
    small = kafka_config.model_copy(update={"max_message_bytes": 1024})
    producer = Producer(small)
    try:
        with pytest.raises(BrokerError, match=topic):
            producer.send_and_wait(topic, b"x" * 200_000)  # over the producer's limit: refused, named
    finally:
        producer.close()
    with pytest.raises(KafkaPropertyError, match="ssl_key_location"):
        Producer(kafka_config.model_copy(update={"properties": {"ssl_key_location": "/k.pem"}}))
    tuned = kafka_config.model_copy(update={"properties": {"queue.buffering.max.messages": 1000}})
    Producer(tuned).close()  # a property librdkafka knows passes through


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_wait_for_broker_on_a_closed_port() -> None:
    address = f"127.0.0.1:{_free_port()}"
    with pytest.raises(BrokerUnavailable, match=address) as info:
        wait_for_broker(KafkaConfig(bootstrap_servers=address), timeout_s=1.5)
    assert info.value.retriable


def test_embedded_broker_lifecycle_and_startup_failure(tmp_path: Path) -> None:
    broker = EmbeddedBroker(EmbeddedBrokerConfig(), tmp_path / "broker.log")
    with broker:
        assert broker.address.startswith("127.0.0.1:")
        pid = broker.pid
        wait_for_broker(KafkaConfig(bootstrap_servers=broker.address), timeout_s=10)
    assert broker.pid is None and pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped
    failing = EmbeddedBroker(EmbeddedBrokerConfig(binary="/bin/false"), tmp_path / "false.log")
    with pytest.raises(RuntimeError, match="exited with code 1"):
        failing.start()


def test_the_embedded_broker_stops_at_once_with_clients_connected(tmp_path: Path, run_name: str) -> None:
    """With a group member connected (as at the end of every run) the broker exits by itself when
    stopped (on SIGTERM Tansu waited for the connections and was killed after the grace)."""
    broker = EmbeddedBroker(EmbeddedBrokerConfig(), tmp_path / "broker.log")
    config = KafkaConfig(bootstrap_servers=broker.start())
    topic = Topics(run_name).prompts("main")
    ensure_topics(config, {topic: 1})
    producer = Producer(config)
    producer.send_and_wait(topic, b"x")
    reader = GroupReader(config, f"{run_name}.g", [topic])
    try:
        deadline = time.monotonic() + 30
        while not reader.read(1, 0.5) and time.monotonic() < deadline:
            pass
        broker.stop()
    finally:
        reader.close()
        producer.close(1)
    assert broker.exit_code == 0, broker.exit_code


def test_end_offsets_count_every_record_even_in_batches(kafka_config: KafkaConfig, run_name: str) -> None:
    topic = Topics(run_name).prompts("main")
    ensure_topics(kafka_config, {topic: 3})
    producer = Producer(kafka_config)
    for _ in range(5):  # queued together: one batch of five records
        producer.produce(topic, b"p", partition=0)
    producer.flush(30)
    for _ in range(3):
        producer.produce(topic, b"p", partition=0)
    producer.produce(topic, b"p", partition=1)
    producer.close()
    assert end_offsets(kafka_config, topic) == {0: 8, 1: 1, 2: 0}
    with pytest.raises(TopicMissing):
        end_offsets(kafka_config, f"{run_name}.nothing")



def _read_count(reader, want: int, polls: int = MAX_POLLS) -> list[Record]:
    got: list[Record] = []
    for _ in range(polls):
        got += reader.read(64, POLL_S)
        if len(got) >= want:
            break
    return got


def test_clients_ride_through_a_broker_that_comes_back_without_its_log(tmp_path: Path, run_name: str) -> None:
    """The embedded broker on memory:// is SIGKILLed and started again on its address: it answers as
    a new cluster with empty topics. A group member that committed offsets of the old log before it
    rejoined, and a group-less reader past the new log's end, both read the new log from its start
    (Tansu answers a fetch past the end with nothing: both waited there for good, skipping the new
    records); each counts the loss once, and the broker answers with a new cluster id."""
    broker = EmbeddedBroker(EmbeddedBrokerConfig(), tmp_path / "broker.log")
    config = KafkaConfig(bootstrap_servers=broker.start(), session_timeout_ms=4000, heartbeat_interval_ms=500)
    topic = Topics(run_name).prompts("main")
    try:
        ensure_topics(config, {topic: 2})
        producer = Producer(config)
        for i in range(20):
            producer.send_and_wait(topic, f"old-{i}".encode(), partition=i % 2)
        member = GroupReader(config, f"{run_name}.g", [topic])
        reader = PartitionReader(config, topic)
        old = _read_count(member, 20)
        assert len(old) == 20 and len(_read_count(reader, 20)) == 20
        old_offsets = {(r.topic, r.partition): r.offset + 1 for r in old}
        member.commit(old_offsets)
        first_cluster = cluster_id(config)

        os.kill(broker.pid, 9)
        deadline = time.monotonic() + 30
        while broker.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        broker.restart()
        ensure_topics(config, {topic: 2})
        # Members that did not notice yet commit what they read from the old log.
        member.commit(old_offsets, wait=False)
        for i in range(6):
            producer.send_and_wait(topic, f"new-{i}".encode(), partition=i % 2)

        assert cluster_id(config) != first_cluster
        new_by_member = _read_count(member, 6)
        new_by_reader = _read_count(reader, 6)
        assert sorted(r.value for r in new_by_member) == sorted(f"new-{i}".encode() for i in range(6))
        assert sorted(r.value for r in new_by_reader) == sorted(f"new-{i}".encode() for i in range(6))
        assert member.log_losses == 1 and reader.log_losses == 1
        # No offset of the old log is left in the group: a later member would start past new records.
        committed = member.committed([(topic, 0), (topic, 1)])
        assert all(o is not None and o <= 3 for o in committed.values()), committed
        member.close()
        reader.close()
        producer.close()
    finally:
        broker.stop()
