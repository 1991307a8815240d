"""The curator's view of the trajectory topic: which prompts came back, from whom, with what rewards.

The curator reads ``<run>.trajectories.<policy>`` from the beginning with its own consumer
(manually assigned partitions, nothing committed): after a restart it reads the history again,
so prompt stages rebuild what they learned. It needs only each group's header; a record that does
not decode is counted and skipped here (the trainer intake parks it in the DLQ with the reason).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from broker.codec import decode_group
from broker.errors import RecordError
from broker.fetch import ContiguousReader
from broker.schema import TrajectoryHeader
from broker.settings import KafkaConfig
from broker.topics import Topics

logger = logging.getLogger(__name__)


@dataclass
class FeedbackStats:
    groups: int = 0
    undecodable: int = 0


class FeedbackReader:
    """Headers of the trajectory groups of one policy, in arrival order per partition."""

    def __init__(self, kafka: KafkaConfig, topics: Topics, policy: str, *, metadata_timeout_s: float = 30.0) -> None:
        self.topic = topics.trajectories(policy)
        self.run = topics.run
        self.stats = FeedbackStats()
        self._consumer = Consumer(kafka.confluent_consumer_conf(f"{topics.run}.curator-feedback.{uuid.uuid4().hex[:8]}"))
        metadata = self._consumer.list_topics(self.topic, timeout=metadata_timeout_s).topics.get(self.topic)
        if metadata is None or metadata.error is not None or not metadata.partitions:
            self._consumer.close()
            raise RuntimeError(
                f"trajectory topic {self.topic} has no partitions ({metadata.error if metadata else 'missing'}); "
                "create the run's topics first (every rlbus role does on start)"
            )
        self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in sorted(metadata.partitions)])
        self._reader = ContiguousReader(self._consumer)

    def poll(self, timeout_s: float, max_records: int = 512) -> list[TrajectoryHeader]:
        """Headers of the groups that arrived, waiting at most ``timeout_s`` for the first."""
        headers = []
        for message in self._reader.read(max_records, timeout_s):
            if message.error() is not None:
                logger.warning("feedback consumer: %s", message.error())
                continue
            try:
                header = decode_group(message.value()).header
            except RecordError as exc:
                self.stats.undecodable += 1
                logger.debug("feedback skips %s[%d]@%d: %s", self.topic, message.partition(), message.offset(), exc)
                continue
            if header.run != self.run:
                continue
            self.stats.groups += 1
            headers.append(header)
        return headers

    def close(self) -> None:
        self._consumer.close()
