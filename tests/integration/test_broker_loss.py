"""A broker that comes back without its log, with a real rollout worker attached: what the broker
had acknowledged is published again by the worker that made it, but for what its trainer announced
taking."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from broker.admin import end_offsets
from broker.control import ControlAnnouncer
from broker.embedded import EmbeddedBroker, EmbeddedBrokerConfig
from broker.reader import PartitionReader
from rlbus.roles import ensure_topics
from tests.fixtures.policy import make_policy_run
from tests.integration.test_rollout_path import _prompts

pytestmark = pytest.mark.integration


def _wait(predicate, what: str, polls: int = 600):
    for _ in range(polls):
        if (value := predicate()):
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _records(kafka, topic: str, count: int) -> dict[str, str]:
    """group id -> sha256 of the first ``count`` records of ``topic``."""
    reader = PartitionReader(kafka, topic)
    got: dict[str, str] = {}
    try:
        for _ in range(600):
            for r in reader.read(64, 0.2):
                got[r.key.decode()] = hashlib.sha256(r.value).hexdigest()
            if len(got) >= count:
                break
    finally:
        reader.close()
    return got


def test_a_worker_publishes_again_what_a_broker_that_lost_its_log_had_acknowledged(
    tmp_path: Path, run_name: str, tiny_model_dir: Path
) -> None:
    broker = EmbeddedBroker(EmbeddedBrokerConfig(), tmp_path / "broker.log")
    run = make_policy_run(broker.start(), run_name, tmp_path, tiny_model_dir)
    topic = run.topics.trajectories("main")
    worker = None
    try:
        ids = _prompts(run, 6)
        worker = run.worker(worker_id="w-outbox", log=tmp_path / "worker.log")
        _wait(lambda: sum(end_offsets(run.kafka, topic).values()) >= 6, "the worker's 6 groups")
        before = _records(run.kafka, topic, 6)
        assert set(before) == {f"{p}/main" for p in ids}
        # The trainer announced taking two of them: those are not needed again.
        announcer = ControlAnnouncer(run.kafka, run.topics)
        announcer.version("main", 1, 2, consumed_ids=["p0", "p1"])
        announcer.close()
        time.sleep(5)  # the worker reads announcements with the advisory fetch wait

        os.kill(broker.pid, signal.SIGKILL)
        _wait(lambda: broker.poll() is not None, "the broker's death")
        broker.restart()
        ensure_topics(run.cfg)
        _wait(lambda: sum(end_offsets(run.kafka, topic).values()) >= 4, "the groups published again")
        after = _records(run.kafka, topic, 4)
        # The very records the old log held (same bytes), but for the two the trainer had taken.
        assert after == {g: d for g, d in before.items() if g not in ("p0/main", "p1/main")}
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
        log = (tmp_path / "worker.log").read_text()
        assert "publishing again the 4 groups" in log, log[-3000:]
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        broker.stop()


def test_records_sent_while_the_brokers_storage_is_down_are_acknowledged_when_it_returns(tmp_path: Path) -> None:
    """Tansu on SeaweedFS answers "Unknown broker error" (not retriable to librdkafka) while SeaweedFS
    is down: the producer sends those records again until the storage is back, each is acknowledged
    and read once; a record whose delivery time runs out during the outage fails, saying how often it
    was sent (and is in the log at most once)."""
    from broker.errors import DeliveryFailed
    from broker.producer import Producer
    from broker.settings import KafkaConfig
    from weightstore.embedded import EmbeddedS3

    s3 = EmbeddedS3(tmp_path / "s3", access_key_id="rlbus-test", secret_access_key="rlbus-test-secret",
                    buckets=("tansu",))
    s3.start()
    broker = EmbeddedBroker(EmbeddedBrokerConfig(storage_url="s3://tansu/"), tmp_path / "broker.log",
                            env=s3.aws_environment())
    try:
        kafka = KafkaConfig().with_broker(broker.start())
        from broker.admin import ensure_topics as create

        create(kafka, {"t": 1})
        producer = Producer(kafka)
        short = Producer(kafka.model_copy(update={"delivery_timeout_ms": 8_000}))  # Tansu answers in ~3 s
        producer.send_and_wait("t", b"before", key=b"0")
        s3.kill()
        pending = [producer.produce("t", f"during-{i}".encode(), key=str(i + 1).encode()) for i in range(3)]
        doomed = short.produce("t", b"doomed", key=b"x")
        # Sent once and timed out in flight, or refused and sent again until its time ran out: either
        # way it fails within its delivery time, saying how often it went (Tansu refused in about 3 s here;
        # on CI no answer came within the 8 s).
        with pytest.raises(DeliveryFailed, match=r"sent [1-9] times?\)"):
            doomed.result(timeout=60)
        _wait(lambda: producer.resent >= 3, "the records to be sent again")
        assert not any(f.done() for f in pending)
        s3.restart()
        offsets = sorted(f.result(timeout=120).offset for f in pending)
        assert len(set(offsets)) == 3
        read = PartitionReader(kafka, "t")
        try:
            got, during = [], {b"during-0", b"during-1", b"during-2"}
            for _ in range(100):
                got += [r.value for r in read.read(64, 0.2)]
                if during <= set(got):
                    break
            got += [r.value for r in read.read(64, 0.5)]  # a late copy of anything would show here
        finally:
            read.close()
        # The failed record's last send may have timed out in flight and still been written when the
        # storage came back: not acknowledged is not "not written" (at least once; readers deduplicate).
        assert got[0] == b"before" and got.count(b"doomed") <= 1
        assert sorted(v for v in got[1:] if v != b"doomed") == sorted(during)
        producer.close()
        short.close()
    finally:
        broker.stop()
        s3.stop()
