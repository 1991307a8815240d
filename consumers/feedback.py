"""The curator's view of the trajectory topic: which prompts came back, from whom, with what rewards.

The curator reads ``<run>.trajectories.<policy>`` from the beginning with a reader of its own
(every partition, outside any consumer group, nothing committed): after a restart it reads the
history again, so prompt stages rebuild what they learned. It needs only each group's header; a
record that does not decode is counted and skipped here (the trainer intake parks it in the DLQ
with the reason).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from broker.codec import decode_group
from broker.errors import RecordError
from broker.reader import PartitionReader
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

    def __init__(self, kafka: KafkaConfig, topics: Topics, policy: str) -> None:
        self.topic = topics.trajectories(policy)
        self.run = topics.run
        self.stats = FeedbackStats()
        self._reader = PartitionReader(kafka, self.topic, start="beginning")

    def poll(self, timeout_s: float, max_records: int = 512) -> list[TrajectoryHeader]:
        """Headers of the groups that arrived, waiting at most ``timeout_s`` for the first."""
        headers = []
        for record in self._reader.read(max_records, timeout_s):
            try:
                header = decode_group(record.value).header
            except RecordError as exc:
                self.stats.undecodable += 1
                logger.debug("feedback skips %s[%d]@%d: %s", self.topic, record.partition, record.offset, exc)
                continue
            if header.run != self.run:
                continue
            self.stats.groups += 1
            headers.append(header)
        return headers

    def close(self) -> None:
        self._reader.close()
