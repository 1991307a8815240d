"""Control topic access for the trainer and the curator (confluent-kafka, synchronous)."""

from __future__ import annotations

import logging
import uuid

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, Consumer, KafkaException, Producer, TopicPartition

from broker.control import CONTROL_PARTITIONS, decode_control, encode_control
from broker.errors import RecordError
from broker.fetch import ContiguousReader
from broker.schema import ControlRecord
from broker.settings import KafkaConfig
from broker.topics import Topics

logger = logging.getLogger(__name__)


class ControlAnnouncer:
    """Publishes version announcements and the end of the run; every send is acknowledged."""

    def __init__(self, kafka: KafkaConfig, topics: Topics) -> None:
        self.topics = topics
        self._producer = Producer(kafka.confluent_producer_conf())

    def send(self, record: ControlRecord, timeout_s: float = 30.0) -> None:
        self._producer.produce(self.topics.control, value=encode_control(record), key=record.kind.encode())
        if self._producer.flush(timeout_s) != 0:
            raise KafkaException(f"control record not acknowledged within {timeout_s}s")

    def version(self, policy: str, version: int, groups_consumed: int) -> None:
        self.send(
            ControlRecord(
                kind="version", run=self.topics.run, policy=policy, version=version,
                groups_consumed=groups_consumed,
            )
        )

    def stop(self, policy: str, version: int, reason: str) -> None:
        self.send(ControlRecord(kind="stop", run=self.topics.run, policy=policy, version=version, reason=reason))


class ControlReader:
    """Reads ``<run>.control`` from the beginning (or the end); keeps the newest state per policy."""

    def __init__(self, kafka: KafkaConfig, topics: Topics, *, from_beginning: bool = True) -> None:
        self.topics = topics
        conf = kafka.confluent_consumer_conf(f"{topics.run}.control-reader.{uuid.uuid4().hex[:8]}")
        self._consumer = Consumer(conf)
        start = OFFSET_BEGINNING if from_beginning else OFFSET_END
        self._consumer.assign([TopicPartition(topics.control, p, start) for p in range(CONTROL_PARTITIONS)])
        self._reader = ContiguousReader(self._consumer)  # a skipped record could be the run's stop
        self.latest: dict[str, ControlRecord] = {}
        self.stopped: ControlRecord | None = None

    def poll(self, timeout_s: float) -> bool:
        """Read what arrived; True when anything new was seen."""
        changed = False
        for message in self._reader.read(256, timeout_s):
            if message.error() is not None:
                continue
            try:
                record = decode_control(message.value())
            except RecordError as exc:
                # Control is advisory; the weightstore is the source of truth for versions.
                logger.warning("skipping control record at offset %d: %s", message.offset(), exc)
                continue
            if record.run != self.topics.run:
                continue
            if record.kind == "stop":
                self.stopped = record
            else:
                self.latest[record.policy] = record
            changed = True
        return changed

    def close(self) -> None:
        self._consumer.close()
