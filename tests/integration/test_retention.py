"""Bounded logs on the shipped Tansu binary with its log in SeaweedFS (``broker.retention``): the
trimmer deletes exactly the batch objects below the floors its holders give, readers go on from
there, and the end of the log does not move."""

from __future__ import annotations

import json

import pytest

from broker.admin import committed_offsets, end_offsets, ensure_topics
from broker.librdkafka import new_consumer
from broker.producer import Producer
from broker.reader import PartitionReader
from broker.retention import LogKeeper, TansuS3Trimmer, trajectory_floors
from broker.settings import KafkaConfig
from trainer.checkpoint import kept_offsets

pytestmark = pytest.mark.integration

TOPIC, GROUP = "run.trajectories.main", "run.train.main"
BATCHES = 30  # per partition, each its own batch (its own object in the bucket)


def _produce(kafka: KafkaConfig, per_batch: list[int]) -> dict[int, list[bytes]]:
    """Batches of the given sizes into each of the topic's two partitions, one at a time (one batch
    object each); the values sent, per partition, in offset order."""
    producer = Producer(kafka)
    sent: dict[int, list[bytes]] = {0: [], 1: []}
    try:
        for b, size in enumerate(per_batch):
            for partition in (0, 1):
                values = [f"p{partition}-b{b}-r{i}".encode() for i in range(size)]
                futures = [producer.produce(TOPIC, v, key=b"k", partition=partition) for v in values]
                for f in futures:
                    f.result(timeout=60)
                sent[partition] += values
    finally:
        producer.close()
    return sent


def _commit(kafka: KafkaConfig, offsets: dict[int, int]) -> None:
    from confluent_kafka import TopicPartition

    consumer = new_consumer(kafka.consumer_conf(GROUP))  # commits without joining: the group does not rebalance
    try:
        consumer.commit(offsets=[TopicPartition(TOPIC, p, o) for p, o in offsets.items()], asynchronous=False)
    finally:
        consumer.close()


def _read_all(kafka: KafkaConfig, partition_count: int, expect: int) -> dict[int, list[tuple[int, bytes]]]:
    reader = PartitionReader(kafka, TOPIC)
    got: dict[int, list[tuple[int, bytes]]] = {p: [] for p in range(partition_count)}
    try:
        for _ in range(300):
            for r in reader.read(256, 0.2):
                got[r.partition].append((r.offset, r.value))
            if sum(map(len, got.values())) >= expect:
                break
        for r in reader.read(256, 0.5):  # anything more would show here
            got[r.partition].append((r.offset, r.value))
    finally:
        reader.close()
    return got


def test_batches_below_the_floors_leave_the_bucket_and_readers_go_on_from_the_first_left(tansu_on_s3, tmp_path):
    kafka, log = tansu_on_s3
    ensure_topics(kafka, {TOPIC: 2})
    sizes = [1 + (b % 3) for b in range(BATCHES)]  # batches of 1, 2 and 3 records
    sent = _produce(kafka, sizes)
    total = sum(sizes)
    ends = end_offsets(kafka, TOPIC)
    assert ends == {0: total, 1: total}
    keeper = LogKeeper(log, kafka, lambda: {}, name="test")
    trimmer = keeper.trimmer
    assert isinstance(trimmer, TansuS3Trimmer)
    bases = {p: [base for base, _ in trimmer.batches(TOPIC, p)] for p in (0, 1)}
    assert all(len(b) >= BATCHES and b[0] == 0 for b in bases.values()), bases  # one object per batch at least

    # The group committed at offset 25 on partition 0 and 45 on partition 1; the trainer's checkpoints
    # hold partition 1 lower, at 34 (the older of the two), and partition 0 higher.
    _commit(kafka, {0: 25, 1: 45})
    assert committed_offsets(kafka, GROUP, TOPIC) == {0: 25, 1: 45}
    checkpoints = tmp_path / "checkpoints"
    for version, offsets in ((40, {0: 50, 1: 40}), (30, {0: 30, 1: 34})):
        (checkpoints / f"v{version:08d}").mkdir(parents=True)
        (checkpoints / f"v{version:08d}" / "meta.json").write_text(
            json.dumps({"version": version, "offsets": {TOPIC: {str(p): o for p, o in offsets.items()}}}))
    keeper.floors = trajectory_floors(kafka, GROUP, [TOPIC, r"^[^.]+\.run\.trajectories\.main$"],
                                      lambda: kept_offsets(checkpoints))
    floors = {0: 25, 1: 34}
    assert keeper.floors() == {(TOPIC, p): f for p, f in floors.items()}

    moved = keeper.trim_once()
    # What is left starts at the batch that holds the floor (its base at or below it, the next above).
    first_left = {p: max(b for b in bases[p] if b <= floors[p]) for p in (0, 1)}
    assert 0 < first_left[0] <= 25 and 0 < first_left[1] <= 34
    assert moved == {(TOPIC, p): first_left[p] for p in (0, 1)}
    for p in (0, 1):
        assert [base for base, _ in trimmer.batches(TOPIC, p)] == [b for b in bases[p] if b >= first_left[p]]
    assert keeper.trim_once() == {}  # nothing new below the floors: nothing deleted again

    # The end did not move; a reader from the beginning starts at the first batch left and misses nothing after it.
    assert end_offsets(kafka, TOPIC) == ends
    got = _read_all(kafka, 2, expect=sum(total - first_left[p] for p in (0, 1)))
    for p in (0, 1):
        assert [o for o, _ in got[p]] == list(range(first_left[p], total))
        assert [v for _, v in got[p]] == sent[p][first_left[p]:]


def test_nothing_is_trimmed_where_a_holder_has_no_offset(tansu_on_s3, tmp_path):
    """No commit on a partition (the group never read it) holds all of it; a checkpoint that cannot be
    read stops the round rather than guessing."""
    kafka, log = tansu_on_s3
    ensure_topics(kafka, {TOPIC: 2})
    _produce(kafka, [1] * 6)
    _commit(kafka, {0: 4})
    floors = trajectory_floors(kafka, GROUP, [TOPIC], lambda: kept_offsets(tmp_path / "none"))
    keeper = LogKeeper(log, kafka, floors, name="test")
    assert keeper.trim_once() == {(TOPIC, 0): 4}
    assert [base for base, _ in keeper.trimmer.batches(TOPIC, 1)] == list(range(6))

    broken = tmp_path / "broken" / "v00000001"
    broken.mkdir(parents=True)
    (broken / "meta.json").write_text("{not json")
    from broker.retention import TrimFailed

    with pytest.raises(TrimFailed, match="unreadable"):
        LogKeeper(log, kafka, trajectory_floors(kafka, GROUP, [TOPIC], lambda: kept_offsets(broken.parent)),
                  name="test").trim_once()


def test_the_control_topic_keeps_what_a_reader_from_the_beginning_learns(tansu_on_s3):
    """The curator's floor on the control topic: below the oldest of each policy's latest
    announcement everything may go, and a reader from the beginning still learns every policy's
    latest version, who finished, and the stop."""
    from broker.control import ControlAnnouncer, ControlReader
    from broker.topics import Topics

    kafka, log = tansu_on_s3
    topics = Topics("run")
    ensure_topics(kafka, {topics.control: 1})
    announcer = ControlAnnouncer(kafka, topics)
    for version in range(1, 9):
        announcer.version("a", version, groups_consumed=10 * version)
        if version <= 3:
            announcer.version("b", version, groups_consumed=version)
    announcer.finished("b", 3, groups_consumed=3, reason="done")  # offset 11
    announcer.version("a", 9, groups_consumed=90)
    first = ControlReader(kafka, topics)
    try:
        for _ in range(100):
            first.poll(0.2)
            if first.latest.get("a") is not None and first.latest["a"].version == 9:
                break
        assert first.floor(["a", "b", "c"]) is None  # c never announced: its history is all there is
        assert first.floor(["a", "b"]) == 11  # b's latest record (finished); a's is above
    finally:
        first.close()
    keeper = LogKeeper(log, kafka, lambda: {(topics.control, 0): 11}, name="test")
    assert keeper.trim_once() == {(topics.control, 0): 11}
    announcer.stop("a", 9, reason="operator")
    announcer.close()
    again = ControlReader(kafka, topics)
    try:
        for _ in range(100):
            again.poll(0.2)
            if again.stopped is not None:
                break
        assert {p: r.version for p, r in again.latest.items()} == {"a": 9, "b": 3}
        assert again.finished == {"b"} and again.stopped is not None
        assert again.floor(["a", "b"]) == 11  # the stop (offset 13) holds nothing lower
    finally:
        again.close()
