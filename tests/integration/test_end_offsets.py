"""End offsets, lag and tail on the shipped Tansu binary with its log in SeaweedFS after 5,000 one-record
batches: there ListOffsets' "latest" is wrong (the batch with the newest timestamp, to the second) and
every fetch lists all of a partition's batch objects, yet ``broker.admin`` answers with what was produced."""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import TopicPartition

from broker.admin import end_offsets, ensure_topics, group_lag, tail
from broker.librdkafka import new_consumer, new_producer
from broker.retention import TansuS3Trimmer
from broker.settings import KafkaConfig

pytestmark = pytest.mark.integration

TOPIC, GROUP = "run.trajectories.main", "run.train.main"
BATCHES = {0: 2_000, 1: 1_500, 2: 1_500}
"""One-record batches per partition: 5,000 batch objects, every partition past the ~1,200 at which a
fetch with a 20 ms wait comes back empty. Spread so that Tansu stores them side by side."""


def _produce(kafka: KafkaConfig) -> dict[int, list[int]]:
    """``BATCHES`` records, each its own batch (linger.ms 0, batch.num.messages 1) while librdkafka
    pipelines them; one producer per partition, as Tansu stores one partition's batches one at a time.
    Returns the offsets acknowledged per partition."""
    acked: dict[int, list[int]] = {p: [] for p in BATCHES}
    errors: list[str] = []

    def produce(partition: int) -> None:
        # At most 8 batches in flight: Tansu stores them one at a time, and with hundreds queued at the broker
        # on a busy machine the last waited past request.timeout.ms and were sent again (written twice).
        producer = new_producer({**kafka.producer_conf(), "linger.ms": 0, "batch.num.messages": 1,
                                 "max.in.flight.requests.per.connection": 8})

        def report(err, message) -> None:  # type: ignore[no-untyped-def]
            if err is not None:
                errors.append(str(err))
            else:
                acked[partition].append(message.offset())

        for i in range(BATCHES[partition]):
            while True:
                try:
                    producer.produce(TOPIC, f"p{partition}-{i}".encode(), partition=partition, on_delivery=report)
                    break
                except BufferError:  # librdkafka's queue is full: let deliveries drain it
                    producer.poll(0.05)
            producer.poll(0)
        left = producer.flush(120)
        if left:
            errors.append(f"{left} records of partition {partition} not delivered")

    threads = [threading.Thread(target=produce, args=(p,)) for p in BATCHES]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    return acked


def test_end_offsets_lag_and_tail_are_what_was_produced_after_thousands_of_batch_objects(tansu_on_s3):
    kafka, log = tansu_on_s3
    ensure_topics(kafka, {TOPIC: len(BATCHES)})
    acked = _produce(kafka)
    assert {p: sorted(o) for p, o in acked.items()} == {p: list(range(n)) for p, n in BATCHES.items()}
    trimmer = TansuS3Trimmer(log)
    assert {p: len(trimmer.batches(TOPIC, p)) for p in BATCHES} == BATCHES  # one object per batch

    assert end_offsets(kafka, TOPIC) == BATCHES
    # Fetches set to wait less than the broker takes to list partition 0 (what a longer log makes of the
    # default wait) come back empty; the probe waits as long as the broker's listings take.
    assert end_offsets(kafka.model_copy(update={"advisory_fetch_max_wait_ms": 20}), TOPIC) == BATCHES

    committed = {0: 1_234, 1: BATCHES[1]}  # nothing committed on partition 2: its lag is all of it
    consumer = new_consumer(kafka.consumer_conf(GROUP))  # commits without joining: the group does not rebalance
    try:
        consumer.commit(offsets=[TopicPartition(TOPIC, p, o) for p, o in committed.items()], asynchronous=False)
    finally:
        consumer.close()
    assert group_lag(kafka, GROUP, TOPIC) == {0: BATCHES[0] - 1_234, 1: 0, 2: BATCHES[2]}

    last = sorted((r.partition, r.offset, r.value) for r in tail(kafka, TOPIC, 3))
    assert last == [(p, o, f"p{p}-{o}".encode()) for p, n in BATCHES.items() for o in range(n - 3, n)]
