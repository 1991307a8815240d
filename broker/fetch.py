"""Reading a confluent-kafka consumer without waiting for a full batch.

``Consumer.consume(num_messages=n, timeout=t)`` returns only when n messages arrived or t passed,
so a consumer that asks for 64 records on a topic carrying a few waits the whole ``t`` on every
call. ``consume_available`` waits at most ``timeout_s`` for the first message, then takes what the
client has already fetched, without waiting again.

``ContiguousReader`` on top of it repairs offsets a consumer would skip on Tansu 0.6 (see there).
"""

from __future__ import annotations

import logging
import time

from confluent_kafka import Consumer, KafkaException, Message, TopicPartition

logger = logging.getLogger(__name__)


def consume_available(consumer: Consumer, max_records: int, timeout_s: float) -> list[Message]:
    """Up to ``max_records`` messages: the first within ``timeout_s``, the rest only if already here."""
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    if max_records <= 1:
        return [first]
    return [first, *consumer.consume(max_records - 1, 0)]


class ContiguousReader:
    """Hands out each partition's records in offset order, without gaps.

    Tansu 0.6 can make a later batch of a partition readable before an earlier one when several
    producers append at once; a fetch in between skips the earlier offset for good. rlbus writes
    no transactions and compacts no topic, so offsets within a partition are contiguous: a record
    past the next expected offset means the ones between are not readable yet. The reader seeks
    back and reads again, and only after ``give_up_s`` accepts the gap (logged, counted).
    """

    def __init__(self, consumer: Consumer, *, give_up_s: float = 5.0) -> None:
        self.consumer, self.give_up_s = consumer, give_up_s
        self._next: dict[tuple[str, int], int] = {}
        self._gap_since: dict[tuple[str, int], float] = {}
        self._sought: set[tuple[str, int]] = set()
        self.gaps_repaired = 0
        self.gaps_skipped = 0
        self.restarts = 0
        """Partitions seen starting over at a lower offset (a broker that lost its log)."""

    def forget(self, partitions: list[TopicPartition] | None = None) -> None:
        """Drop what is known of ``partitions`` (all when None): call it on assign and revoke."""
        if partitions is None:
            self._next.clear()
            self._gap_since.clear()
            self._sought.clear()
            return
        for tp in partitions:
            self._next.pop((tp.topic, tp.partition), None)
            self._gap_since.pop((tp.topic, tp.partition), None)
            self._sought.discard((tp.topic, tp.partition))

    def read(self, max_records: int, timeout_s: float) -> list[Message]:
        out: list[Message] = []
        reread: set[tuple[str, int]] = set()
        for message in consume_available(self.consumer, max_records, timeout_s):
            if message.error() is not None:
                out.append(message)
                continue
            key, offset = (message.topic(), message.partition()), message.offset()
            if key in reread:
                continue  # read again after the seek
            expected = self._next.get(key)
            if expected is not None and offset < expected:
                if key in self._sought:
                    continue  # delivered before the seek that re-reads this partition
                # Not a re-read: the partition starts over (the broker lost its log and the client
                # reset to the new log's beginning). Its records are new ones.
                logger.warning("%s[%d]: offset %d after %d: the partition's log started over; reading it from there",
                               key[0], key[1], offset, expected - 1)
                self.restarts += 1
                self._gap_since.pop(key, None)
                expected = None
            if expected is not None and offset > expected:
                since = self._gap_since.setdefault(key, time.monotonic())
                if time.monotonic() - since < self.give_up_s:
                    try:
                        self.consumer.seek(TopicPartition(key[0], key[1], expected))
                        reread.add(key)
                        self._sought.add(key)
                        continue
                    except KafkaException as exc:
                        logger.debug("seek of %s[%d] to %d failed: %s", key[0], key[1], expected, exc)
                        continue
                logger.warning("%s[%d]: offsets %d..%d never became readable in %.0fs; going on without them",
                               key[0], key[1], expected, offset - 1, self.give_up_s)
                self.gaps_skipped += 1
                self._gap_since.pop(key, None)
            elif key in self._gap_since:
                self.gaps_repaired += 1
                self._gap_since.pop(key, None)
            self._sought.discard(key)
            self._next[key] = offset + 1
            out.append(message)
        return out
