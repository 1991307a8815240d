"""The readers of the Kafka layer: a consumer-group member and a group-less partition reader.

Both hand out ``Record``s in offset order per partition, repairing the offsets a fetch skipped on
Tansu 0.6 (``broker.fetch.ContiguousReader``). Errors the client reports on the way are logged and
counted when librdkafka recovers from them by itself, and raised as ``BrokerError`` when fatal.
Every call on the underlying consumer is serialized, so one reader may be used from several
threads (e.g. ``read`` in a worker thread, ``commit`` from the event loop).

Both read topics by name and, beside them, by pattern: a regular expression that starts with ``^``
(librdkafka's convention; e.g. ``broker.topics.Topics.trajectories_pattern``). A topic that comes
to match it later is read too, found within ``discover_every_s``.
"""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, KafkaError, KafkaException, Message, TopicPartition

from broker import metrics
from broker.errors import BrokerError, TopicMissing
from broker.fetch import ContiguousReader
from broker.headers import parse_headers
from broker.librdkafka import broker_error, new_admin, new_consumer
from broker.settings import STOP_WAIT_S, KafkaConfig

logger = logging.getLogger(__name__)

Partition = tuple[str, int]
"""(topic, partition)."""

LOG_CHECK_S = 2.0
"""How often a group-less reader with nothing to read asks for the broker's cluster id."""
LAG_EVERY_S = 10.0
"""How often a group member reports its lag (``rlbus.consumer.lag``)."""
_READ_SLICE_S = 0.1
"""Longest a read holds the consumer at a time, so a commit from another thread never waits long."""
DISCOVER_EVERY_S = 30.0
"""How often a reader looks for new topics matching its pattern, by default (MirrorMaker 2 looks
for new topics to copy every 30 s in ``infra/regions/mirrormaker2.properties``)."""
UNASSIGNED_WARN_SESSIONS = 5
"""A group member waiting this many session timeouts for its partitions says so: on Tansu 0.6 a join
takes half of one, and a member that went without leaving is expired after one."""


def is_pattern(topic: str) -> bool:
    """Whether a subscription entry is a regular expression (librdkafka's convention) rather than a name."""
    return topic.startswith("^")


@dataclass(frozen=True)
class Record:
    """One record as a reader hands it out."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: dict[str, str]
    timestamp_ms: int
    """The record's CreateTime (or LogAppendTime), Unix ms."""

    @classmethod
    def of(cls, message: Message) -> Record:
        """The record a client's message (one without an error) holds."""
        return cls(topic=message.topic(), partition=message.partition(), offset=message.offset(),
                   key=message.key(), value=message.value() or b"", headers=parse_headers(message.headers()),
                   timestamp_ms=message.timestamp()[1])


class _Reader:
    def __init__(self, kafka: KafkaConfig, conf: dict) -> None:
        self.address = kafka.bootstrap_servers
        self.commit_failures = 0
        self.client_errors = 0
        self._lock = threading.RLock()
        self._consumer = new_consumer(conf)
        self._contiguous = ContiguousReader(self._consumer)
        self._closed = False
        self.cluster_id: str | None = None
        """The id of the cluster whose log this reader reads (None until first known)."""
        self.log_losses = 0
        """Times the broker came back as another cluster: the log read before was lost."""

    @property
    def gaps_repaired(self) -> int:
        return self._contiguous.gaps_repaired

    def _cluster_changed(self, timeout_s: float, what: str, client=None) -> bool:
        """Ask the broker its cluster id, through ``client`` (default: this reader's consumer): True
        (logged, counted in ``log_losses``) when it is not the one known before. A broker that does not
        answer tells nothing yet."""
        with self._lock:
            try:
                now = (client or self._consumer).list_topics(timeout=timeout_s).cluster_id
            except KafkaException as exc:
                logger.warning("%s: cluster id not readable: %s", what, exc)
                return False
        before, self.cluster_id = self.cluster_id, now
        if before is None or now == before:
            return False
        self.log_losses += 1
        logger.warning("%s: the broker answers as cluster %r, was %r: the log read so far is gone; reading the "
                       "new one from its start", what, now, before)
        return True

    def read(self, max_records: int, timeout_s: float) -> list[Record]:
        """Up to ``max_records`` records: waits at most ``timeout_s`` for the first, then takes what
        has already arrived without waiting again."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            with self._lock:
                if self._closed:
                    raise BrokerError("read from a closed reader")
                try:
                    messages = self._contiguous.read(max_records, max(0.0, min(remaining, _READ_SLICE_S)))
                except KafkaException as exc:
                    raise broker_error(exc, "reading", self.address) from None
            records = [r for m in messages if (r := self._record(m)) is not None]
            if records or remaining <= _READ_SLICE_S:
                return records

    def _record(self, message: Message) -> Record | None:
        err = message.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                return None
            if err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART and is_pattern(message.topic() or ""):
                # librdkafka reports a pattern that matches no topic yet as a missing topic; it is
                # not one (no region's mirror exists yet, say), and a matching topic is read once it appears.
                logger.debug("no topic matches %s yet", message.topic())
                return None
            if err.fatal():
                raise broker_error(err, "reading", self.address)
            self.client_errors += 1
            logger.warning("reader on %s: %s (the client retries)", message.topic(), err.str())
            return None
        return Record.of(message)

    def close(self) -> None:
        """Close the client. Safe to call twice."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._consumer.close()


class _Released:
    """Stands in for a consumer released without closing it: every call fails as on a closed one."""

    def __getattr__(self, name: str):
        raise RuntimeError("Consumer closed")


class GroupReader(_Reader):
    """A member of consumer group ``group`` on ``topics`` (names, and patterns: see the module).

    Offsets are committed only when ``commit`` is called, with the offsets given (the next offset
    to read, per partition). ``start_offsets`` (e.g. from a checkpoint) override the committed
    offsets of those partitions the first time they are assigned. ``on_assign`` and ``on_revoke``
    are called with the partitions that move, on the thread that reads. A topic that comes to match
    a pattern is found at the client's next metadata refresh (every ``discover_every_s``) and
    rebalances the group to take it in. ``close`` leaves the group or just goes, per
    ``kafka.leave_group_on_close``.
    """

    def __init__(
        self,
        kafka: KafkaConfig,
        group: str,
        topics: list[str],
        *,
        start_offsets: Mapping[Partition, int] | None = None,
        on_assign: Callable[[list[Partition]], None] | None = None,
        on_revoke: Callable[[list[Partition]], None] | None = None,
        discover_every_s: float = DISCOVER_EVERY_S,
    ) -> None:
        conf = kafka.consumer_conf(group)
        conf["on_commit"] = self._committed_async
        if any(is_pattern(t) for t in topics):  # librdkafka matches patterns at each metadata refresh
            conf["topic.metadata.refresh.interval.ms"] = max(1, round(discover_every_s * 1000))
        super().__init__(kafka, conf)
        self.group = group
        self._admin_conf = kafka.admin_conf()
        self._beginning_to_commit: list[TopicPartition] = []  # assigned on a new log: committed after the poll
        self._cooperative = kafka.partition_assignment_strategy == "cooperative-sticky"
        self._start = dict(start_offsets or {})
        self._on_assign, self._on_revoke = on_assign, on_revoke
        self._assigned: set[Partition] = set()
        self._read_end: dict[Partition, int] = {}
        self._next_lag = time.monotonic() + LAG_EVERY_S
        self._leave_on_close = kafka.leave_group_on_close
        self._commit_wait_s = min(kafka.request_timeout_ms / 1000, STOP_WAIT_S)  # at close
        self._commits_in_flight = 0
        self._session_s = kafka.session_timeout_ms / 1000
        self._waiting_since: float | None = time.monotonic()  # for an assignment: joining, or rebalancing
        self._warned_waiting = False
        self._consumer.subscribe(topics, on_assign=self._assign, on_revoke=self._revoke, on_lost=self._revoke)

    def assignment(self) -> set[Partition]:
        """Partitions this member holds now."""
        return set(self._assigned)

    def _assign(self, consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            start = self._start.pop((tp.topic, tp.partition), None)
            if start is not None:
                tp.offset = start
        self._contiguous.forget(partitions)
        for tp in partitions:
            self._read_end.pop((tp.topic, tp.partition), None)
        # Inside a callback of the consumer's own poll, no blocking call may be made on that consumer:
        # confluent-kafka keeps one call state per thread and handle, a nested call clears it, and the
        # next callback of the same poll then aborts the process (CallState_get: Assertion `cs != NULL').
        # So the cluster id is asked by a client of its own, and the commit below waits for the poll's end.
        lost = self._cluster_changed(10, self.group, new_admin({**self._admin_conf, "log_level": 0}))
        if lost:
            # The group's offsets on the new log may be ones members committed from the old log
            # before they rejoined (past the new log's end: reading there would skip records).
            # Start these partitions at their beginning and commit that, so no later owner starts
            # past it either.
            for tp in partitions:
                tp.offset = OFFSET_BEGINNING
        if self._cooperative:
            consumer.incremental_assign(partitions)
        else:
            consumer.assign(partitions)
        if lost:
            self._beginning_to_commit += [TopicPartition(tp.topic, tp.partition) for tp in partitions]
        moved = [(tp.topic, tp.partition) for tp in partitions]
        self._assigned |= set(moved)
        waited = time.monotonic() - (self._waiting_since or time.monotonic())
        if self._warned_waiting:
            logger.warning("%s: assigned after waiting %.0f s", self.group, waited)
        self._waiting_since, self._warned_waiting = None, False
        logger.info("%s: assigned %s (waited %.1f s)", self.group, sorted(moved), waited)
        if self._on_assign is not None:
            self._on_assign(moved)

    def _commit_beginning(self) -> None:
        """Commit the start of the partitions assigned on a new log (after the poll that assigned them)."""
        partitions, self._beginning_to_commit = self._beginning_to_commit, []
        consumer = self._consumer
        starts = []
        for tp in partitions:
            if (tp.topic, tp.partition) not in self._assigned:
                continue  # moved on again since: its new owner commits it
            try:
                low, _ = consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=10)
            except KafkaException as exc:
                logger.warning("%s: %s[%d] start not readable (%s); its committed offset stays", self.group,
                               tp.topic, tp.partition, exc)
                continue
            starts.append(TopicPartition(tp.topic, tp.partition, max(low, 0)))
        if starts:
            try:
                consumer.commit(offsets=starts, asynchronous=False)
            except KafkaException as exc:
                self.commit_failures += 1
                logger.warning("%s: committing the new log's start failed: %s", self.group, exc)

    def read(self, max_records: int, timeout_s: float) -> list[Record]:
        records = super().read(max_records, timeout_s)
        if self._beginning_to_commit:
            with self._lock:
                self._commit_beginning()
        for r in records:
            key = (r.topic, r.partition)
            self._read_end[key] = max(self._read_end.get(key, 0), r.offset + 1)
        waited = time.monotonic() - (self._waiting_since or time.monotonic())
        if waited > UNASSIGNED_WARN_SESSIONS * self._session_s and not self._warned_waiting:
            self._warned_waiting = True
            logger.warning(
                "%s: no partitions assigned %.0f s after joining or after the group began to rebalance (over %d "
                "session timeouts): the group may be stuck. Tansu 0.6 keeps a group so, until it forgets it "
                "(memory:// storage: a restart), once its leader sent LeaveGroup while it rebalanced (a member "
                "with kafka.leave_group_on_close, or another Kafka client)", self.group, waited,
                UNASSIGNED_WARN_SESSIONS)
        if time.monotonic() >= self._next_lag:
            self._next_lag = time.monotonic() + LAG_EVERY_S
            self._report_lag()
        return records

    def lag(self) -> dict[Partition, int]:
        """Records of each partition this member holds that it has not read yet: the high watermark
        of the client's last fetch response (no round trip: asking the broker takes one per
        partition on the reading thread, the latency of every record behind it on a loaded broker)
        minus the next offset to read. Partitions not fetched yet are left out."""
        out: dict[Partition, int] = {}
        with self._lock:
            for topic, partition in sorted(self._assigned):
                try:
                    low, high = self._consumer.get_watermark_offsets(TopicPartition(topic, partition), cached=True)
                except KafkaException:
                    continue
                if high >= 0:
                    out[(topic, partition)] = max(0, high - self._read_end.get((topic, partition), max(low, 0)))
        return out

    def _report_lag(self) -> None:
        by_topic: dict[str, int] = {}
        for (topic, _), records in self.lag().items():
            by_topic[topic] = by_topic.get(topic, 0) + records
        for topic, records in by_topic.items():
            metrics.lag(self.group, topic, records)

    def _revoke(self, consumer, partitions: list[TopicPartition]) -> None:
        self._contiguous.forget(partitions)
        moved = [(tp.topic, tp.partition) for tp in partitions]
        self._revoked(moved)

    def _revoked(self, moved: list[Partition]) -> None:
        self._assigned -= set(moved)
        if self._waiting_since is None and not self._assigned:
            self._waiting_since = time.monotonic()
        logger.info("%s: revoked %s", self.group, sorted(moved))
        if self._on_revoke is not None:
            self._on_revoke(moved)

    def close(self) -> None:
        """Leave the group (``kafka.leave_group_on_close``: the broker moves the partitions at once), or
        go without leaving, as a killed member would: the partitions held go to ``on_revoke``, the
        commits sent without waiting are answered, and the client is released; the broker moves the
        partitions once it expires this member, after ``kafka.session_timeout_ms`` (on Tansu 0.6 a
        leader's LeaveGroup while its group rebalances leaves the group stuck: see ``KafkaConfig``).
        Safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._leave_on_close:
                self._consumer.close()
                return
            self._await_commits()
            if self._assigned:
                self._revoked(sorted(self._assigned))
            consumer = self._consumer
            self._consumer = self._contiguous.consumer = _Released()
            # confluent-kafka destroys a consumer it frees unclosed without its consumer close
            # (RD_KAFKA_DESTROY_F_NO_CONSUMER_CLOSE): no LeaveGroup, no revocation at the broker.
            others = sys.getrefcount(consumer) - 2  # this name and the call's argument
            if others > 0:
                logger.warning("%s: the client is still referenced %d more times: it stays in the group until "
                               "freed (or it leaves after max_poll_interval_ms)", self.group, others)
            del consumer
        logger.info("%s: gone without leaving; the broker moves its partitions after the session timeout "
                    "(%.0f s)", self.group, self._session_s)

    def _await_commits(self) -> None:
        """Serve the answers to the commits in flight (``commit(wait=False)``), up to a request
        timeout: a released client drops them, and their records would be read again. Fetching is
        paused; records already fetched are dropped uncommitted (their next owner reads them)."""
        if not self._commits_in_flight:
            return
        deadline = time.monotonic() + self._commit_wait_s
        try:
            self._consumer.pause(self._consumer.assignment())
            while self._commits_in_flight and time.monotonic() < deadline:
                self._consumer.poll(0.05)
        except KafkaException as exc:  # closing anyway: what was not committed is read again
            logger.warning("%s: waiting for commits in flight failed: %s", self.group, exc)
        if self._commits_in_flight:
            logger.warning("%s: %d commits unanswered after %.0f s; their records will be read again",
                           self.group, self._commits_in_flight, self._commit_wait_s)

    def commit(self, offsets: Mapping[Partition, int], *, wait: bool = True) -> bool:
        """Commit ``offsets``. ``wait=False`` returns at once (the result is logged when it arrives,
        during a later read). False when the commit failed, e.g. because a rebalance moved a
        partition: its new owner reads those records again (downstream dedupes them)."""
        # Never past what this member read of the partition since it was (re)assigned: an offset
        # from before a reassignment, above all one from a log the broker lost, would skip records.
        past = {k: o for k, o in offsets.items() if o > self._read_end.get(k, 0)}
        if past:
            logger.info("%s: not committing %s: past what this member read since its assignment (%s); "
                        "those records are read again if the partition moves", self.group, past,
                        {k: self._read_end.get(k) for k in past})
            offsets = {k: o for k, o in offsets.items() if k not in past}
        if not offsets:
            return True
        tps = [TopicPartition(t, p, o) for (t, p), o in sorted(offsets.items())]
        with self._lock:
            try:
                self._consumer.commit(offsets=tps, asynchronous=not wait)
                if not wait:
                    self._commits_in_flight += 1
                return True
            except KafkaException as exc:
                self.commit_failures += 1
                logger.warning("%s: commit of %s failed: %s; those records will be read again",
                               self.group, dict(offsets), broker_error(exc, "committing", self.address))
                return False

    def _committed_async(self, err, partitions) -> None:
        self._commits_in_flight = max(0, self._commits_in_flight - 1)
        if err is not None:
            self.commit_failures += 1
            logger.warning("%s: commit failed: %s; those records will be read again", self.group, err.str())

    def committed(self, partitions: list[Partition], timeout_s: float = 30.0) -> dict[Partition, int | None]:
        """The group's committed offsets of ``partitions`` (None where it has none)."""
        with self._lock:
            try:
                got = self._consumer.committed([TopicPartition(t, p) for t, p in partitions], timeout=timeout_s)
            except KafkaException as exc:
                raise broker_error(exc, "reading committed offsets", self.address) from None
        return {(tp.topic, tp.partition): (tp.offset if tp.offset >= 0 else None) for tp in got}

    def rewind(self, timeout_s: float = 30.0) -> dict[Partition, int]:
        """Go back to the group's committed offset on every partition this member holds (the start of
        the partition where nothing is committed): what was read past it is read again. For a member
        that gave up on records it read (their results were not delivered), so that no later commit
        passes over them. Returns the offsets it went back to."""
        with self._lock:
            held = [TopicPartition(t, p) for t, p in sorted(self._assigned)]
            if not held:
                return {}
            try:
                committed = self._consumer.committed(held, timeout=timeout_s)
                back = {}
                for tp in committed:
                    offset = tp.offset if tp.offset >= 0 else OFFSET_BEGINNING
                    self._consumer.seek(TopicPartition(tp.topic, tp.partition, offset))
                    back[(tp.topic, tp.partition)] = offset
            except KafkaException as exc:
                raise broker_error(exc, "going back to the committed offsets", self.address) from None
            self._contiguous.forget(held)
            for key, offset in back.items():
                self._read_end[key] = max(offset, 0)
        logger.info("%s: back at the committed offsets %s", self.group, back)
        return back

    def pause(self) -> None:
        """Stop fetching every assigned partition (records already fetched are still read)."""
        with self._lock:
            self._consumer.pause(self._consumer.assignment())

    def resume(self) -> None:
        with self._lock:
            self._consumer.resume(self._consumer.assignment())


class PartitionReader(_Reader):
    """Reads every partition of ``topic`` from its beginning or its end, outside any consumer group:
    every such reader sees every record, and nothing is committed. ``advisory``: fetches wait
    ``kafka.advisory_fetch_max_wait_ms`` (for readers no step waits on). ``pattern``: also every
    topic whose name matches it, each found within ``discover_every_s`` of its creation (a look at
    the broker's topic list) and read from ``start`` as well."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topic: str,
        *,
        start: Literal["beginning", "end"] = "beginning",
        advisory: bool = False,
        metadata_timeout_s: float = 30.0,
        pattern: str | None = None,
        discover_every_s: float = DISCOVER_EVERY_S,
    ) -> None:
        if pattern is not None and not is_pattern(pattern):
            raise ValueError(f"pattern {pattern!r} must start with '^' (a regular expression of topic names)")
        conf = kafka.consumer_conf(f"rlbus-reader-{uuid.uuid4().hex[:12]}", advisory=advisory)  # never joined
        super().__init__(kafka, conf)
        self.topic = topic
        try:
            cluster = self._consumer.list_topics(topic, timeout=metadata_timeout_s)
        except KafkaException as exc:
            self._consumer.close()
            raise broker_error(exc, f"reading the metadata of {topic}", self.address) from None
        meta = cluster.topics.get(topic)
        if meta is None or meta.error is not None or not meta.partitions:
            self._consumer.close()
            raise TopicMissing(topic, self.address or "?")
        self._offset = OFFSET_BEGINNING if start == "beginning" else OFFSET_END
        self.partitions = sorted(meta.partitions)
        self.topics = {topic: self.partitions}
        """Every topic read, with its partitions: ``topic`` and those found by ``pattern``."""
        self._consumer.assign([TopicPartition(topic, p, self._offset) for p in self.partitions])
        self.cluster_id = cluster.cluster_id
        self._next_check = time.monotonic() + LOG_CHECK_S
        self._pattern, self._discover_every_s = pattern, discover_every_s
        self._next_discovery = 0.0

    def read(self, max_records: int, timeout_s: float) -> list[Record]:
        """``_Reader.read``; with nothing to read, at most every ``LOG_CHECK_S``, it asks whether the
        broker lost its log: one that comes back empty answers fetches past the new log's end with
        nothing (Tansu), and the reader would wait there until the new log grew past its old
        position, skipping what came before. It then reads the new log from its start (``topic``;
        the pattern's topics as they are found again there)."""
        if self._pattern is not None and time.monotonic() >= self._next_discovery:
            self._discover()
        records = super().read(max_records, timeout_s)
        if not records and time.monotonic() >= self._next_check:
            self._next_check = time.monotonic() + LOG_CHECK_S
            if self._cluster_changed(5, f"reader of {self.topic}"):
                with self._lock:
                    self._contiguous.forget()
                    self.topics = {self.topic: self.partitions}
                    self._consumer.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in self.partitions])
                self._next_discovery = 0.0
        return records

    def _discover(self) -> None:
        """Start reading the topics that match the pattern and are not read yet."""
        self._next_discovery = time.monotonic() + self._discover_every_s
        with self._lock:
            try:
                listed = self._consumer.list_topics(timeout=5).topics  # no topic named: never creates one
            except KafkaException as exc:  # the next look may find them; reading goes on meanwhile
                logger.warning("reader of %s: the topic list is not readable (%s); looking again in %.0fs",
                               self.topic, exc, self._discover_every_s)
                return
            found = {name: sorted(meta.partitions) for name, meta in listed.items()
                     if name not in self.topics and meta.error is None and meta.partitions
                     and re.search(self._pattern, name)}
            if found:
                self._consumer.incremental_assign(
                    [TopicPartition(t, p, self._offset) for t, parts in found.items() for p in parts])
                self.topics |= found
        if found:
            logger.info("reader of %s: reading %s too (they match %s)", self.topic, sorted(found), self._pattern)
