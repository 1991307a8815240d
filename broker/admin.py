"""Broker administration: wait until a broker answers, create topics, read partition counts.

Uses ``confluent_kafka.admin.AdminClient``. Every wait is bounded by a time cap and an attempt
cap with backoff; nothing here loops forever on a dead broker.
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, ClusterMetadata, NewTopic

from broker.errors import BrokerError, BrokerUnavailable, TopicMissing
from broker.librdkafka import new_admin, new_consumer
from broker.reader import Record
from broker.settings import KafkaConfig
from broker.topics import Topics

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 200
"""Attempt cap of every wait loop here (the time cap usually ends it first)."""

_FIRST_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0
_MAX_PROBE_S = 5.0
_STALL_WAITS = 2
"""Fetch waits (and half a second) without a record or the end after which a probe reads again, waiting longer."""
_WAIT_GROWTH = 2
"""Factor by which a stalled probe's fetch wait grows."""
_MAX_PROBE_WAIT_MS = 10_000
"""Longest fetch wait of a probe (the bound of kafka.advisory_fetch_max_wait_ms)."""


def _admin(config: KafkaConfig) -> AdminClient:
    # log_level 0: connection-refused noise while waiting is expected and reported by our errors.
    return new_admin({**config.admin_conf(), "log_level": 0})


def _probe_conf(config: KafkaConfig, group: str) -> dict:
    """A one-off consumer's settings; log_level 0 as for ``_admin``: a broker that is away is reported
    by our errors, not by the client library on every retry. It fetches with the advisory (long) wait:
    no step waits on it, and Tansu's s3 engine returns nothing from a fetch whose listing of a partition
    outlasts the wait."""
    return {**config.consumer_conf(group, advisory=True), "log_level": 0}


def _metadata(admin: AdminClient, timeout_s: float, topic: str | None = None) -> ClusterMetadata:
    return admin.list_topics(topic=topic, timeout=max(timeout_s, 0.01))


def wait_for_broker(config: KafkaConfig, timeout_s: float) -> None:
    """Return once the broker answers a metadata request; raise ``BrokerUnavailable`` after
    ``timeout_s`` seconds (or ``MAX_ATTEMPTS`` attempts) without an answer."""
    admin = _admin(config)
    deadline = time.monotonic() + timeout_s
    backoff_s = _FIRST_BACKOFF_S
    last_error = "no attempt made"
    for attempt in range(1, MAX_ATTEMPTS + 1):
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            break
        try:
            meta = _metadata(admin, min(remaining_s, _MAX_PROBE_S))
        except KafkaException as exc:
            last_error = str(exc.args[0] if exc.args else exc)
            logger.debug("broker %s not ready (attempt %s): %s", config.bootstrap_servers, attempt, last_error)
        else:
            if meta.brokers:
                logger.debug("broker %s answered after %s attempt(s)", config.bootstrap_servers, attempt)
                return
            last_error = "metadata listed no brokers"
        time.sleep(max(0.0, min(backoff_s, deadline - time.monotonic())))
        backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)
    raise BrokerUnavailable(
        config.bootstrap_servers, f"no metadata answer within {timeout_s:g} s (last error: {last_error})"
    )


def ensure_topics(config: KafkaConfig, topics: dict[str, int], timeout_s: float = 30) -> None:
    """Create the topics that do not exist yet with the given partition counts.

    Idempotent: an existing topic is left as it is (a warning names a topic with fewer partitions
    than asked). The topic's settings come from the config (``KafkaConfig.topic_settings``:
    ``max.message.bytes`` and retention); a broker that rejects them gets the topic without them.
    Returns once metadata lists every topic.
    """
    if not topics:
        return
    admin = _admin(config)
    deadline = time.monotonic() + timeout_s
    _create(admin, config, topics, deadline, with_config=True)
    _wait_listed(admin, config, topics, deadline, timeout_s)


def _create(
    admin: AdminClient, config: KafkaConfig, topics: dict[str, int], deadline: float, *, with_config: bool
) -> None:
    topic_config = config.topic_settings() if with_config else {}
    new = [NewTopic(name, n, config.replication_factor, config=topic_config) for name, n in topics.items()]
    remaining_s = max(deadline - time.monotonic(), 0.1)
    futures = admin.create_topics(new, operation_timeout=remaining_s, request_timeout=remaining_s)
    retry_plain: dict[str, int] = {}
    for name, future in futures.items():
        try:
            future.result(timeout=max(deadline - time.monotonic(), 0.1))
            logger.info("created topic %s with %s partitions", name, topics[name])
        except KafkaException as exc:
            err: KafkaError = exc.args[0]
            if err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                logger.debug("topic %s already exists", name)
            elif with_config and err.code() in (KafkaError.INVALID_CONFIG, KafkaError.POLICY_VIOLATION):
                logger.warning("broker rejected the settings %s for %s (%s); creating it without them: its own "
                               "defaults apply (retention among them)", topic_config, name, err.str())
                retry_plain[name] = topics[name]
            elif err.code() in (KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError.REQUEST_TIMED_OUT):
                raise BrokerUnavailable(config.bootstrap_servers, f"creating topic {name}: {err.str()}") from None
            else:
                raise BrokerError(
                    f"could not create topic {name!r} with {topics[name]} partitions and replication "
                    f"factor {config.replication_factor}: {err.str()}; check the broker's topic policy "
                    "and that replication_factor does not exceed the number of brokers"
                ) from None
        except TimeoutError:
            raise BrokerUnavailable(config.bootstrap_servers, f"creating topic {name} timed out") from None
    if retry_plain:
        _create(admin, config, retry_plain, deadline, with_config=False)


def _wait_listed(
    admin: AdminClient, config: KafkaConfig, topics: dict[str, int], deadline: float, timeout_s: float
) -> None:
    backoff_s = _FIRST_BACKOFF_S
    missing: list[str] = list(topics)
    for _ in range(MAX_ATTEMPTS):
        remaining_s = deadline - time.monotonic()
        if remaining_s <= 0:
            break
        try:
            listed = _metadata(admin, min(remaining_s, _MAX_PROBE_S)).topics
        except KafkaException as exc:
            logger.debug("metadata request failed while waiting for topics: %s", exc)
            listed = {}
        missing = [t for t in topics if t not in listed or listed[t].error is not None or not listed[t].partitions]
        if not missing:
            for name, want in topics.items():
                have = len(listed[name].partitions)
                if have < want:
                    logger.warning("topic %s has %s partitions, fewer than the %s asked for", name, have, want)
            return
        time.sleep(max(0.0, min(backoff_s, deadline - time.monotonic())))
        backoff_s = min(backoff_s * 2, _MAX_BACKOFF_S)
    raise BrokerUnavailable(
        config.bootstrap_servers, f"topics {missing} not listed in metadata within {timeout_s:g} s after creation"
    )


def cluster_id(config: KafkaConfig, timeout_s: float = 30.0) -> str | None:
    """The id of the cluster the broker answers as (a broker whose storage was wiped starts a new
    one; the embedded one takes a new id at each start on memory:// storage)."""
    try:
        return _metadata(_admin(config), timeout_s).cluster_id
    except KafkaException as exc:
        raise BrokerUnavailable(config.bootstrap_servers, f"metadata request failed: {exc}") from None


def ensure_run_topics(
    config: KafkaConfig, topics: Topics, workflows: list[str], policies: list[str], *, wait_s: float = 60
) -> None:
    """Wait for the broker, then create every topic of the run that does not exist yet
    (``Topics.plan``, with the partition counts of ``config``)."""
    wait_for_broker(config, timeout_s=wait_s)
    ensure_topics(config, topics.plan(workflows, policies, prompt_partitions=config.prompt_partitions,
                                      trajectory_partitions=config.trajectory_partitions))


def committed_offsets(config: KafkaConfig, group: str, topic: str, timeout_s: float = 30) -> dict[int, int | None]:
    """Offsets consumer group ``group`` committed on each partition of ``topic`` (None where none),
    read without joining the group."""
    partitions = topic_partitions(config, topic, timeout_s)
    consumer = new_consumer(_probe_conf(config, group))  # never subscribes: the group does not rebalance
    try:
        got = consumer.committed([TopicPartition(topic, p) for p in range(partitions)], timeout=timeout_s)
    except KafkaException as exc:
        raise BrokerUnavailable(config.bootstrap_servers, f"reading the offsets of {group}: {exc}") from None
    finally:
        consumer.close()
    return {tp.partition: (tp.offset if tp.offset >= 0 else None) for tp in got}


def group_lag(config: KafkaConfig, group: str, topic: str, timeout_s: float = 10) -> dict[int, int]:
    """Records of ``topic`` that consumer group ``group`` has not committed past, per partition (a
    partition it never committed on counts from its start: the group reads it from there)."""
    committed = committed_offsets(config, group, topic, timeout_s)
    return {p: max(0, end - (committed.get(p) or 0)) for p, end in end_offsets(config, topic, timeout_s).items()}


def topic_partitions(config: KafkaConfig, topic: str, timeout_s: float = 10) -> int:
    """Number of partitions of ``topic``; raises ``TopicMissing`` when the broker does not know it."""
    admin = _admin(config)
    try:
        listed: dict[str, Any] = _metadata(admin, timeout_s).topics
    except KafkaException as exc:
        raise BrokerUnavailable(config.bootstrap_servers, f"metadata request failed: {exc}") from None
    meta = listed.get(topic)
    if meta is None or meta.error is not None or not meta.partitions:
        raise TopicMissing(topic, config.bootstrap_servers)
    return len(meta.partitions)


def topics_matching(config: KafkaConfig, subscription: list[str], timeout_s: float = 10) -> list[str]:
    """The topics the broker has that a subscription names: a name, or a pattern starting with ``^`` as
    librdkafka reads it."""
    admin = _admin(config)
    try:
        listed = _metadata(admin, timeout_s).topics
    except KafkaException as exc:
        raise BrokerUnavailable(config.bootstrap_servers, f"metadata request failed: {exc}") from None
    patterns = [re.compile(s) for s in subscription if s.startswith("^")]
    return sorted(t for t, meta in listed.items() if meta.error is None and meta.partitions
                  and (t in subscription or any(p.match(t) for p in patterns)))


def end_offsets(config: KafkaConfig, topic: str, timeout_s: float = 10) -> dict[int, int]:
    """Offset after the last record of every partition of ``topic`` (its length when nothing was
    deleted), as the broker's fetch responses give it, so it is right on Tansu too.

    ListOffsets' "latest" serves only as where to start reading: Tansu 0.6 answers it with (base offset
    of one recent batch + 1), on its s3 engine of the batch with the newest timestamp, to the second (4,870
    after 5,000 one-record batches). Each partition is read from there to its end; on Apache Kafka that
    reads one record.
    """
    return _ends(config, topic, timeout_s)[0]


def _ends(config: KafkaConfig, topic: str, timeout_s: float) -> tuple[dict[int, int], int]:
    """``end_offsets``, and the fetch wait (ms) that read every partition to its end."""
    deadline = time.monotonic() + timeout_s
    consumer = _probe(config, config.advisory_fetch_max_wait_ms)
    try:
        meta = consumer.list_topics(timeout=timeout_s).topics.get(topic)  # no topic arg: never auto-creates
        if meta is None or meta.error is not None or not meta.partitions:
            raise TopicMissing(topic, config.bootstrap_servers)
        starts: dict[int, int] = {}
        slowest_s = 0.0
        for p in sorted(meta.partitions):
            asked = time.monotonic()
            _, high = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            slowest_s = max(slowest_s, time.monotonic() - asked)
            starts[p] = max(high - 1, 0)  # a partition it calls empty is read too: one fetch says so
    except KafkaException as exc:
        raise BrokerUnavailable(config.bootstrap_servers, f"reading end offsets of {topic}: {exc}") from None
    finally:
        consumer.close()
    # Tansu's s3 engine lists a partition's batch objects on each ListOffsets (two of them: "earliest" and
    # "latest") as on each Fetch, so a fetch that waits as long as the slowest round trip is not given up
    # before its listing is done (5,000 objects: 0.28 s; a fetch waiting 80 ms got nothing, 120 ms did).
    wait_ms = max(config.advisory_fetch_max_wait_ms, round(slowest_s * 1000))
    return _read_to_end(config, topic, starts, min(wait_ms, _MAX_PROBE_WAIT_MS), deadline)


def _probe(config: KafkaConfig, wait_ms: int) -> Consumer:
    conf = _probe_conf(config, f"rlbus-probe-{uuid.uuid4().hex}")  # never joins or commits
    return new_consumer({**conf, "enable.partition.eof": True, "fetch.wait.max.ms": wait_ms})


def _read_to_end(
    config: KafkaConfig, topic: str, starts: dict[int, int], wait_ms: int, deadline: float,
    keep: Callable[[Message], None] | None = None, stops: dict[int, int] | None = None,
) -> tuple[dict[int, int], int]:
    """Read each partition of ``topic`` from its offset in ``starts`` until it reports its end (or
    reaches its offset in ``stops``), handing every record to ``keep``. Returns the offset after the last
    record or at the end each partition reported, and the fetch wait (ms) that got there.

    Tansu's s3 engine lists every batch object of a partition on each fetch and answers nothing at all
    when that listing outlasts the fetch's wait: a partition that brings neither a record nor its end
    within a few waits is read again, from where it was, by a consumer whose fetches wait
    ``_WAIT_GROWTH`` times longer (up to ``_MAX_PROBE_WAIT_MS``). Bounded by ``deadline`` alone.
    """
    at = dict(starts)
    ends = dict.fromkeys(starts, 0)
    pending = {p for p in starts if stops is None or at[p] < stops[p]}
    while pending and time.monotonic() < deadline:
        consumer = _probe(config, wait_ms)
        try:
            consumer.assign([TopicPartition(topic, p, at[p]) for p in sorted(pending)])
            stalled = _poll(consumer, pending, at, ends, deadline, wait_ms, keep, stops)
        except KafkaException as exc:
            raise BrokerUnavailable(config.bootstrap_servers, f"reading {topic} to its end: {exc}") from None
        finally:
            consumer.close()
        if stalled and wait_ms < _MAX_PROBE_WAIT_MS:
            wait_ms = min(wait_ms * _WAIT_GROWTH, _MAX_PROBE_WAIT_MS)
            logger.info("fetches of %s partitions %s brought nothing; reading them again with a %s ms wait",
                        topic, sorted(pending), wait_ms)
    if pending:
        raise BrokerUnavailable(
            config.bootstrap_servers, f"partitions {sorted(pending)} of {topic} not read to their end in time"
        )
    return ends, wait_ms


def _poll(
    consumer: Consumer, pending: set[int], at: dict[int, int], ends: dict[int, int], deadline: float,
    wait_ms: int, keep: Callable[[Message], None] | None, stops: dict[int, int] | None,
) -> bool:
    """Poll until every pending partition is done or the deadline; True when one stalled first (nothing
    for ``_STALL_WAITS`` fetch waits and half a second). A partition that reported its end is paused: fetching
    its new records kept a slow broker (Tansu with its log in S3) from ever bringing the others to their
    end while a curator wrote to them."""
    stall_s = _STALL_WAITS * wait_ms / 1000 + 0.5
    heard = dict.fromkeys(pending, time.monotonic())
    while pending:
        now = time.monotonic()
        if now >= deadline:
            return False
        if now - min(heard[p] for p in pending) > stall_s:
            return True
        message = consumer.poll(min(deadline - now, 0.5))
        if message is None:
            continue
        p, err = message.partition(), message.error()
        if err is not None and err.code() != KafkaError._PARTITION_EOF:
            raise KafkaException(err)
        if p not in pending:  # a record fetched before its partition was done and paused
            continue
        heard[p] = time.monotonic()
        if err is None:
            at[p] = message.offset() + 1
            ends[p] = max(ends[p], at[p])
            if keep is not None:
                keep(message)
            done = stops is not None and at[p] >= stops[p]
        else:
            ends[p] = max(ends[p], message.offset())  # the end its fetch response gave
            done = True
        if done:
            pending.discard(p)
            consumer.pause([TopicPartition(message.topic(), p)])
    return False


def tail(config: KafkaConfig, topic: str, per_partition: int, timeout_s: float = 10,
         since_ms: int | None = None) -> list[Record]:
    """The last ``per_partition`` records of each partition of ``topic`` (fewer where a partition
    holds fewer), read outside any group; for operators' views such as ``rlbus status``.
    ``since_ms``: only records stamped at or after this time (ms since the epoch), found by the
    broker's time index, so a slow log is not read from further back than needed."""
    ends, wait_ms = _ends(config, topic, timeout_s)
    consumer = _probe(config, wait_ms)
    try:
        first = {}
        if since_ms is not None:
            found = consumer.offsets_for_times([TopicPartition(topic, p, since_ms) for p in ends], timeout=timeout_s)
            # -1: no record that recent, so nothing to read there.
            first = {tp.partition: (tp.offset if tp.offset >= 0 else ends[tp.partition]) for tp in found}
        starts = {}
        for p, end in ends.items():
            low, _ = consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=timeout_s)
            starts[p] = min(max(low, 0, end - per_partition, first.get(p, 0)), end)
    except KafkaException as exc:
        raise BrokerUnavailable(config.bootstrap_servers, f"reading the tail of {topic}: {exc}") from None
    finally:
        consumer.close()
    records: list[Record] = []
    _read_to_end(config, topic, starts, wait_ms, time.monotonic() + timeout_s,
                 lambda message: records.append(Record.of(message)), stops=ends)
    return records
