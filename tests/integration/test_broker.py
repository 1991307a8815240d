"""The wire contract against a real broker: the client libraries, consumer groups and offsets
behave the way workers and trainers rely on.

Waits are bounded by attempt counts (a safety net against hangs, not a speed requirement).
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from confluent_kafka import Consumer, Message, Producer
from confluent_kafka import TopicPartition as CTopicPartition
from confluent_kafka.admin import AdminClient

from broker.admin import end_offsets, ensure_topics, topic_partitions, wait_for_broker
from broker.codec import decode_group, encode_group
from broker.embedded import EmbeddedBroker, EmbeddedBrokerConfig
from broker.errors import BrokerUnavailable, TopicMissing
from broker.headers import group_headers, parse_headers
from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.settings import KafkaConfig
from broker.topics import Topics

pytestmark = pytest.mark.integration

POLL_S = 0.2
MAX_POLLS = 600  # 2 minutes of polling at most before a wait gives up


@pytest.fixture
def fast_config(kafka_config: KafkaConfig) -> KafkaConfig:
    """Shorter group timeouts: on Tansu a rebalance takes about session_timeout_ms / 2."""
    return kafka_config.model_copy(update={"session_timeout_ms": 4000, "heartbeat_interval_ms": 500})


def _group(i: int, n_tokens: int = 6, vocab_size: int = 50_000) -> TrajectoryGroup:
    rng = np.random.default_rng(i)
    header = TrajectoryHeader(
        run="it",
        policy="main",
        group_id=f"g{i}",
        prompt_id=f"p{i}",
        task="arith",
        worker_id="w",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=n_tokens),
        rewards=[1.0, 0.0],
        finish_reasons=["stop", "length"],
        min_version=i,
        max_version=i,
        vocab_size=vocab_size,
        created_at=time.time(),
    )
    return TrajectoryGroup(
        header=header,
        prompt_tokens=rng.integers(0, vocab_size, 4, dtype=np.int32),
        completion_tokens=rng.integers(0, vocab_size, n_tokens, dtype=np.int32),
        completion_offsets=np.array([0, n_tokens // 2, n_tokens], dtype=np.int32),
        behaviour_logprobs=-rng.random(n_tokens, dtype=np.float32),
        token_versions=np.full(n_tokens, i, dtype=np.int32),
    )


async def _produce(config: KafkaConfig, topic: str, records: list[tuple[int, bytes, list]]) -> None:
    producer = AIOKafkaProducer(**config.aiokafka_producer_kwargs())
    await producer.start()
    try:
        for partition, value, headers in records:
            await producer.send_and_wait(topic, value, key=b"k", partition=partition, headers=headers)
    finally:
        await producer.stop()


def _poll_until(consumers: list[Consumer], done: Callable[[], bool], sink: list[Message] | None = None) -> None:
    for _ in range(MAX_POLLS):
        if done():
            return
        for consumer in consumers:
            message = consumer.poll(POLL_S / len(consumers))
            if message is not None and message.error() is None and sink is not None:
                sink.append(message)
    raise AssertionError("condition not reached while polling; see the broker log for group activity")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_broker_advertises_loopback_and_topics_are_idempotent(kafka_config: KafkaConfig, kafka_broker, run_name):
    topics = Topics(run_name)
    plan = topics.plan(["main"], ["main"], prompt_partitions=32, trajectory_partitions=8)
    ensure_topics(kafka_config, plan)
    ensure_topics(kafka_config, plan)  # a second call (another process) changes nothing
    assert topic_partitions(kafka_config, topics.prompts("main")) == 32
    assert topic_partitions(kafka_config, topics.trajectories("main")) == 8
    with pytest.raises(TopicMissing, match="does not exist"):
        topic_partitions(kafka_config, f"{run_name}.nothing")
    brokers = AdminClient(kafka_config.confluent_admin_conf()).list_topics(timeout=10).brokers
    assert [f"{b.host}:{b.port}" for b in brokers.values()] == [kafka_broker.bootstrap]


def test_aiokafka_producer_to_confluent_consumer_group(kafka_config: KafkaConfig, run_name: str) -> None:
    topic = Topics(run_name).trajectories("main")
    ensure_topics(kafka_config, {topic: 4})
    groups = [_group(i) for i in range(12)] + [_group(99, n_tokens=400_000)]  # one record of ~2.4 MB
    traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    records = [(i % 4, encode_group(g), group_headers(g.header, traceparent)) for i, g in enumerate(groups)]
    assert len(records[-1][1]) > 2 * 1024 * 1024  # over librdkafka and aiokafka defaults
    asyncio.run(_produce(kafka_config, topic, records))

    consumer = Consumer(kafka_config.confluent_consumer_conf(f"{run_name}.train"))
    consumer.subscribe([topic])
    received: list[Message] = []
    try:
        _poll_until([consumer], lambda: len(received) >= len(groups), received)
    finally:
        consumer.close()
    decoded = {decode_group(m.value(), vocab_size=50_000).header.group_id: m for m in received}
    assert sorted(decoded) == sorted(g.header.group_id for g in groups)
    big = decode_group(decoded["g99"].value())
    assert big.completion_tokens.tobytes() == groups[-1].completion_tokens.tobytes()
    headers = parse_headers(decoded["g7"].headers())
    assert (headers["rlbus-policy"], headers["rlbus-min-version"], headers["traceparent"]) == ("main", "7", traceparent)


def test_confluent_consumers_share_partitions_and_one_takes_over(fast_config: KafkaConfig, run_name: str) -> None:
    topic = Topics(run_name).trajectories("main")
    ensure_topics(fast_config, {topic: 4})
    assigned: dict[str, set[int]] = {"a": set(), "b": set()}

    def track(name: str) -> dict:
        def on_assign(_c: Consumer, parts: list[CTopicPartition]) -> None:
            assigned[name] = {p.partition for p in parts}

        def on_revoke(_c: Consumer, _parts: list[CTopicPartition]) -> None:
            assigned[name] = set()

        return {"on_assign": on_assign, "on_revoke": on_revoke}

    a = Consumer(fast_config.confluent_consumer_conf(f"{run_name}.train"))
    b = Consumer(fast_config.confluent_consumer_conf(f"{run_name}.train"))
    try:
        a.subscribe([topic], **track("a"))
        _poll_until([a], lambda: assigned["a"] == {0, 1, 2, 3})
        b.subscribe([topic], **track("b"))
        _poll_until([a, b], lambda: len(assigned["a"]) == 2 and len(assigned["b"]) == 2)
        assert assigned["a"] | assigned["b"] == {0, 1, 2, 3}  # range: two contiguous partitions each
        assert sorted(map(sorted, assigned.values())) == [[0, 1], [2, 3]]
        b.close()
        _poll_until([a], lambda: assigned["a"] == {0, 1, 2, 3})
    finally:
        a.close()


def test_committed_offsets_survive_a_consumer_restart(fast_config: KafkaConfig, run_name: str) -> None:
    kafka_config = fast_config
    topic = Topics(run_name).trajectories("main")
    ensure_topics(kafka_config, {topic: 1})
    asyncio.run(_produce(kafka_config, topic, [(0, f"m{i}".encode(), []) for i in range(10)]))
    group_id = f"{run_name}.train"

    first = Consumer(kafka_config.confluent_consumer_conf(group_id))
    first.subscribe([topic])
    seen: list[Message] = []
    try:
        _poll_until([first], lambda: len(seen) >= 10, seen)
        first.commit(message=seen[5], asynchronous=False)  # trained on m0..m5; m6..m9 in flight
    finally:
        first.close()

    second = Consumer(kafka_config.confluent_consumer_conf(group_id))
    second.subscribe([topic])
    again: list[Message] = []
    try:
        _poll_until([second], lambda: len(again) >= 4, again)
        for _ in range(5):  # nothing beyond the uncommitted four arrives
            assert second.poll(POLL_S) is None
    finally:
        second.close()
    assert [m.value() for m in again] == [b"m6", b"m7", b"m8", b"m9"]
    assert [m.value() for m in seen] == [f"m{i}".encode() for i in range(10)]


async def _aiokafka_group_redelivery(config: KafkaConfig, topic: str, group_id: str) -> tuple[list, list, list]:
    workers = [AIOKafkaConsumer(**config.aiokafka_consumer_kwargs(group_id)) for _ in range(2)]
    for worker in workers:
        worker.subscribe([topic])
        await worker.start()
    keeper, quitter = workers
    try:
        for _ in range(MAX_POLLS):  # both joined: the four partitions split two and two
            if len(keeper.assignment()) == 2 and len(quitter.assignment()) == 2:
                break
            await asyncio.sleep(POLL_S)
        else:
            raise AssertionError(f"group never split: {keeper.assignment()} / {quitter.assignment()}")
        kept = await _take(keeper, 10)
        await keeper.commit()  # the keeper finished its prompts
        dropped = await _take(quitter, 10)
        await quitter.stop()  # closed WITHOUT committing: its prompts must come back
        redelivered = await _take(keeper, 10)
        assert len(keeper.assignment()) == 4
        return kept, dropped, redelivered
    finally:
        for worker in workers:
            await worker.stop()


async def _take(consumer: AIOKafkaConsumer, n: int) -> list[tuple[int, int]]:
    got: list[tuple[int, int]] = []
    for _ in range(MAX_POLLS):
        if len(got) >= n:
            return got
        batches = await consumer.getmany(timeout_ms=int(POLL_S * 1000))
        got += [(m.partition, m.offset) for messages in batches.values() for m in messages]
    raise AssertionError(f"received {len(got)} of {n} records")


def test_aiokafka_consumer_group_redelivers_what_a_closed_member_did_not_commit(
    fast_config: KafkaConfig, run_name: str
) -> None:
    topic = Topics(run_name).prompts("main")
    ensure_topics(fast_config, {topic: 4})
    asyncio.run(_produce(fast_config, topic, [(i % 4, f"p{i}".encode(), []) for i in range(20)]))
    kept, dropped, redelivered = asyncio.run(_aiokafka_group_redelivery(fast_config, topic, f"{run_name}.rollout"))
    assert {p for p, _ in kept}.isdisjoint({p for p, _ in dropped})
    assert sorted(redelivered) == sorted(dropped)  # every uncommitted prompt, and no committed one


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


def test_end_offsets_count_every_record_even_in_batches(kafka_config: KafkaConfig, run_name: str) -> None:
    topic = Topics(run_name).prompts("main")
    ensure_topics(kafka_config, {topic: 3})
    producer = Producer(kafka_config.confluent_producer_conf())
    for _ in range(5):  # queued together: one batch of five records
        producer.produce(topic, b"p", partition=0)
    assert producer.flush(30) == 0
    for _ in range(3):
        producer.produce(topic, b"p", partition=0)
    producer.produce(topic, b"p", partition=1)
    assert producer.flush(30) == 0
    assert end_offsets(kafka_config, topic) == {0: 8, 1: 1, 2: 0}
    with pytest.raises(TopicMissing):
        end_offsets(kafka_config, f"{run_name}.nothing")

