"""The curator's view of the trajectory topic: which prompts came back, from whom, with what rewards.

The curator reads ``<run>.trajectories.<policy>`` from the beginning with a reader of its own (every
partition, outside any consumer group, nothing committed): after a restart it reads the history
again, so prompt stages rebuild what they learned. It reads the regions' mirrors of it
(``<region>.<run>.trajectories.<policy>``, MirrorMaker 2's default replication policy) as well, each
from its beginning once found: groups of a region's workers come back there, and without them the
router would take those workers for gone. A group read on both is seen twice (as a group a worker
published twice is): stages and router take feedback as it comes. It needs only each group's header;
a record that does not decode is counted and skipped here (the trainer intake parks it in the DLQ
with the reason).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from broker.codec import decode_group
from broker.errors import RecordError
from broker.reader import DISCOVER_EVERY_S, PartitionReader
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

    def __init__(self, kafka: KafkaConfig, topics: Topics, policy: str, *,
                 discover_every_s: float = DISCOVER_EVERY_S) -> None:
        """``discover_every_s``: how often to look for a region's mirrored topic that appeared."""
        self.topic = topics.trajectories(policy)
        self.run = topics.run
        self.stats = FeedbackStats()
        self._reader = PartitionReader(kafka, self.topic, start="beginning",
                                       pattern=topics.trajectories_pattern(policy), discover_every_s=discover_every_s)

    def poll(self, timeout_s: float, max_records: int = 512) -> list[TrajectoryHeader]:
        """Headers of the groups that arrived, waiting at most ``timeout_s`` for the first."""
        headers = []
        for record in self._reader.read(max_records, timeout_s):
            try:
                header = decode_group(record.value).header
            except RecordError as exc:
                self.stats.undecodable += 1
                logger.debug("feedback skips %s[%d]@%d: %s", record.topic, record.partition, record.offset, exc)
                continue
            if header.run != self.run:
                continue
            self.stats.groups += 1
            headers.append(header)
        return headers

    @property
    def reading(self) -> list[str]:
        """The topics read: the policy's own and the regions' mirrors found so far."""
        return sorted(self._reader.topics)

    def close(self) -> None:
        self._reader.close()
