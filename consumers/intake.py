"""Trainer intake: a consumer group per policy that turns trajectory records into batches.

The group reads the policy's topic, ``<run>.trajectories.<policy>``, and every region's mirror of it
that MirrorMaker 2 makes under its default replication policy, ``<region>.<run>.trajectories.<policy>``
(by pattern: a region whose topic appears while the trainer runs is read from its first record).
Offsets are kept per (topic, partition); a group that arrives on several of them is trained once.

A background thread owns the group reader: it reads, decodes (a record that fails, or a group of
another run or policy, goes to ``<run>.dlq`` with the reason), and feeds a bounded queue, pausing
the partitions while the queue is full. ``next_batch`` applies the staleness gate, dedupe and the
version check (a group claiming weights newer than the trainer's goes to the DLQ) and hands out B
groups with the offsets they cover; those offsets are committed only when the trainer calls
``commit`` after the step they fed was published. Rejections found by the trainer thread and
commits go to the fetch thread through one ordered queue, so a rejected record is parked in the DLQ
before any offset past it is committed.

With ``intake.rescore`` on, the fetch thread also runs the task's checker again on each group
(``consumers.rescore``) and counts, per worker, the groups whose claimed rewards it does not give.

A record too large to copy to the DLQ (over ``kafka.max_message_bytes``, published by a producer
with a higher limit) costs that record, never the trainer: its DLQ entry carries the reason, the
source offset and its size (``rlbus-dlq-omitted-bytes``), without the bytes.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from broker import metrics
from broker.codec import decode_claim, decode_group, is_claim
from broker.errors import RecordError
from broker.headers import TRACEPARENT, dlq_headers
from broker.producer import Producer
from broker.reader import GroupReader, Partition, Record
from broker.schema import ClaimRecord, TrajectoryGroup
from broker.settings import KafkaConfig
from broker.topics import Topics
from consumers.rescore import Rescorer
from weightstore.claims import fetch_claim, sweep
from weightstore.errors import StoreError
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)


class IntakeConfig(BaseModel):
    """Settings of the trainer's intake."""

    model_config = ConfigDict(extra="forbid")

    queue_max_groups: int = Field(default=512, ge=1, description="Decoded groups held before pausing.")
    poll_timeout_s: float = Field(default=0.1, gt=0, description="Consumer poll wait, seconds.")
    dedupe_window: int = Field(default=200_000, ge=1, description="Group ids remembered for dedupe.")
    claim_retention_s: float = Field(
        default=7 * 24 * 3600, gt=0,
        description="Claim-checked groups (too large for a record, kept in the object store) are deleted this "
        "long after they were written: keep it at least the trajectory topic's retention, since a resumed trainer "
        "reads again from its checkpoint.",
    )
    require_signature: bool | None = Field(
        default=None,
        description="Send unsigned groups to the DLQ. None (the default): whenever the fleet has a signing key "
        "([signing] key or key_file); false lets unsigned groups in beside signed ones (a fleet moving to a "
        "key). Groups that carry a signature are checked whenever a key is set.",
    )
    rescore: Literal["off", "count", "replace", "reject"] = Field(
        default="off",
        description="Run the task's checker again on each group's completions (the trainer needs the train dataset, "
        "`rlbus trainer --dataset`) and count disagreements per worker: count only, replace the claimed rewards with "
        "the checker's, or reject the group to the DLQ. Policies whose rewards are not the task's score (a verifier, "
        "multi-turn tasks) are not re-scored.",
    )
    rescore_fraction: float = Field(
        default=1.0, gt=0.0, le=1.0,
        description="Share of groups re-scored (chosen by a hash of the group id): spot checks for costly checkers.",
    )
    rescore_tolerance: float = Field(
        default=1e-6, ge=0.0, description="Largest difference between a claimed and a re-scored reward that agrees.",
    )
    mirrored_topics: bool = Field(
        default=True,
        description="Also read the regions' mirrors of the trajectory topic, <region>.<run>.trajectories.<policy>: "
        "what MirrorMaker 2 copies from a region's own Kafka cluster under its default replication policy. "
        "Off: the policy's own topic only.",
    )
    mirror_discovery_s: float = Field(
        default=30.0, gt=0,
        description="How often the intake looks for a region's mirrored trajectory topic that appeared, seconds "
        "(librdkafka's topic.metadata.refresh.interval.ms; each look is one metadata request for every topic). "
        "A topic found joins the group's assignment at the next rebalance and is read from its first record.",
    )


@dataclass
class _Item:
    record: Record
    group: TrajectoryGroup | None  # None: a record already handled (sent to the DLQ)
    log: int = 0  # the reader's log_losses when it was read: offsets of a lost log are never committed

    @property
    def partition(self) -> Partition:
        """(topic, partition) the record was read from."""
        return self.record.topic, self.record.partition


@dataclass
class Batch:
    groups: list[TrajectoryGroup]
    offsets: dict[Partition, int]  # (topic, partition) -> next offset to commit
    dropped_stale: int = 0
    duplicates: int = 0
    rejected: int = 0
    wait_s: float = 0.0
    consumed_ids: list[str] = field(default_factory=list)
    """Prompt ids of every group taken off the topic: delivered, stale or a copy (not rejected ones)."""
    from_lost_log: list[str] = field(default_factory=list)
    """Group ids of those read before the broker lost its log (for audits)."""
    traceparents: dict[str, str] = field(default_factory=dict)
    """Group id → the trace context its record carried (the worker's publish span), for delivered groups."""


@dataclass
class IntakeStats:
    received: int = 0
    rejected: int = 0
    dropped_stale: int = 0
    duplicates: int = 0
    delivered: int = 0
    claims: int = 0
    rejected_reasons: collections.Counter = field(default_factory=collections.Counter)
    rescored: collections.Counter = field(default_factory=collections.Counter)
    """Groups re-scored, by worker id."""
    disagreements: collections.Counter = field(default_factory=collections.Counter)
    """Re-scored groups whose claimed rewards the checker does not give, by worker id."""
    unscored: collections.Counter = field(default_factory=collections.Counter)
    """Groups sampled for re-scoring that could not be re-scored, by worker id."""
    dropped_stale_by_region: collections.Counter = field(default_factory=collections.Counter)
    """``dropped_stale`` by the region of the worker that made the group (since this trainer started)."""

    COUNTS: ClassVar[tuple[str, ...]] = ("received", "rejected", "dropped_stale", "duplicates", "delivered", "claims")

    def counts(self) -> dict[str, int]:
        """The run-long counters, for a checkpoint: a trainer resumed from it counts on from them."""
        return {name: getattr(self, name) for name in self.COUNTS}

    def restore(self, counts: dict[str, int]) -> None:
        for name in self.COUNTS:
            setattr(self, name, int(counts.get(name, 0)))


class IntakeClosed(RuntimeError):
    retriable = False


class TrainerIntake:
    """Consumer group ``<run>.train.<policy>`` on ``<run>.trajectories.<policy>`` and its regions' mirrors."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: Topics,
        policy: str,
        config: IntakeConfig,
        *,
        max_staleness: int,
        vocab_size: int,
        signing_key: bytes | None = None,
        store: ObjectStore | None = None,
        rescorer: Rescorer | None = None,
    ) -> None:
        """``store``: the run's object store, where groups too large for a record are (claim check).
        ``rescorer``: re-scores groups as ``config.rescore`` says (None: no re-scoring)."""
        if config.require_signature and signing_key is None:
            raise ValueError("intake.require_signature needs the fleet's signing key ([signing] key or key_file)")
        if rescorer is not None and config.rescore == "off":
            raise ValueError("a rescorer for an intake whose rescore is 'off'")
        self.rescorer = rescorer
        self.require_signature = signing_key is not None if config.require_signature is None else config.require_signature
        self.kafka, self.topics, self.policy, self.config = kafka, topics, policy, config
        self.max_staleness, self.vocab_size, self.signing_key = max_staleness, vocab_size, signing_key
        self.store = store
        self._next_sweep = 0.0
        self.topic = topics.trajectories(policy)
        """The policy's own trajectory topic (the group also reads its mirrors: ``subscription``)."""
        self.subscription = [self.topic] + ([topics.trajectories_pattern(policy)] if config.mirrored_topics else [])
        self.stats = IntakeStats()
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        # ("commit", offsets) and ("reject", (record, reason)), in the order the trainer made them.
        self._actions: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._paused = False
        self._closed = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._reader: GroupReader | None = None
        self._dlq: Producer | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self, resume_offsets: dict[Partition, int] | None = None) -> None:
        """Join the group; ``resume_offsets`` (from a checkpoint, per (topic, partition)) override
        committed offsets."""
        if any(not isinstance(k, tuple) for k in resume_offsets or {}):
            raise TypeError("resume offsets are keyed by (topic, partition), got keys like "
                            f"{list(resume_offsets)[:3]!r}")
        self._dlq = Producer(self.kafka, name="dlq")
        self._reader = GroupReader(
            self.kafka, self.topics.trainer_group(self.policy), self.subscription, start_offsets=resume_offsets,
            on_revoke=self._on_revoke, discover_every_s=self.config.mirror_discovery_s,
        )
        self._thread = threading.Thread(target=self._fetch_loop, name=f"intake-{self.policy}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._dlq is not None:
            self._dlq.close(10)

    # -- trainer side ----------------------------------------------------------------------
    def next_batch(self, size: int, version: int, timeout_s: float,
                   lag: Callable[[int], int] | None = None) -> Batch | None:
        """Up to ``size`` fresh, unique groups; None if none arrived within ``timeout_s``.

        ``version`` is the newest the trainer published; ``lag(v)`` how many steps the trainer's
        weights are past those of version ``v`` (default ``version - v``; a resumed trainer knows
        better, see ``trainer.loop.TrainerState.lag``)."""
        started = time.monotonic()
        deadline = started + timeout_s
        batch = Batch(groups=[], offsets={})
        with self._cond:
            while len(batch.groups) < size:
                if self._error is not None:
                    raise IntakeClosed(f"intake of {self.topic} failed: {self._error}") from self._error
                if self._closed.is_set():
                    raise IntakeClosed(f"intake of {self.topic} is closed")
                if not self._queue:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    self._cond.wait(timeout=min(remaining, 0.5))
                    continue
                item = self._queue.popleft()
                if item.log == self.log_losses:
                    batch.offsets[item.partition] = item.record.offset + 1
                elif item.group is not None:
                    batch.from_lost_log.append(item.group.header.group_id)
                self._admit(item, version, lag or (lambda v: version - v), batch)
        batch.wait_s = time.monotonic() - started
        if not batch.groups and not batch.offsets:
            return None
        return batch

    def _admit(self, item: _Item, version: int, lag: Callable[[int], int], batch: Batch) -> None:
        group = item.group
        if group is None:
            batch.rejected += 1
            return
        header = group.header
        if header.max_version <= version:  # a forged claim names no prompt of this run
            batch.consumed_ids.append(header.prompt_id)
        if header.group_id in self._seen:
            batch.duplicates += 1
            self.stats.duplicates += 1
            return
        if header.max_version > version:
            # No worker can hold weights the trainer has not published: a forged or foreign claim.
            batch.rejected += 1
            self._actions.put(("reject", (item.record, f"group claims version {header.max_version}, above the "
                                                       f"trainer's {version}")))
            return
        if lag(header.min_version) > self.max_staleness:
            # Guard 3: too stale for the loss to correct; count it, never train on it.
            batch.dropped_stale += 1
            self.stats.dropped_stale += 1
            self.stats.dropped_stale_by_region[header.region] += 1
            return
        self._seen[header.group_id] = None
        if len(self._seen) > self.config.dedupe_window:
            self._seen.popitem(last=False)
        batch.groups.append(group)
        if TRACEPARENT in item.record.headers:
            batch.traceparents[header.group_id] = item.record.headers[TRACEPARENT]
        self.stats.delivered += 1

    def seen_ids(self) -> list[str]:
        """The group ids dedupe remembers (those delivered for training), oldest first: a checkpoint
        keeps them, so that a resumed trainer still drops copies of groups its weights learned from
        (a worker killed between publishing a group and committing its prompt makes one)."""
        with self._cond:
            return list(self._seen)

    def remember(self, group_ids: list[str]) -> None:
        """Take up the dedupe memory a checkpoint kept (``seen_ids``)."""
        with self._cond:
            for group_id in group_ids[-self.config.dedupe_window:]:
                self._seen[group_id] = None

    def forget(self, group_ids: list[str]) -> None:
        """Drop groups from the dedupe memory: delivered, then not trained (a trainer stopped before
        its batch was full), so that copies read again after a resume are trained on."""
        with self._cond:
            for group_id in group_ids:
                self._seen.pop(group_id, None)

    def commit(self, offsets: dict[Partition, int]) -> None:
        """Commit offsets (asynchronously, on the fetch thread) once their step is published."""
        if offsets:
            self._actions.put(("commit", dict(offsets)))

    # -- fetch thread ----------------------------------------------------------------------
    def _on_revoke(self, partitions: list[Partition]) -> None:
        revoked = set(partitions)
        with self._cond:
            # Their records will be redelivered to the new owner; never train twice on them here.
            self._queue = collections.deque(i for i in self._queue if i.partition not in revoked)

    def _fetch_loop(self) -> None:
        try:
            while not self._closed.is_set():
                self._drain_actions()
                self._sweep_claims()
                records = self._reader.read(64, self.config.poll_timeout_s)
                items = [self._handle(r) for r in records]
                if items:
                    with self._cond:
                        self._queue.extend(items)
                        self._cond.notify_all()
                self._maybe_pause()
            self._drain_actions()
        except BaseException as exc:  # surfaced to the trainer by next_batch
            logger.exception("intake fetch loop failed")
            self._error = exc
            with self._cond:
                self._cond.notify_all()
        finally:
            self._reader.close()

    def _handle(self, record: Record) -> _Item:
        self.stats.received += 1
        try:
            value, claim = self._claimed(record.value, record.topic)
            group = decode_group(
                value,
                vocab_size=self.vocab_size,
                signing_key=self.signing_key,
                require_signature=self.require_signature,
            )
        except RecordError as exc:
            self._reject(record, exc.reason)
            return _Item(record, None, self.log_losses)
        reason = self._misplaced(group, claim, record.topic) or self._rescore(group)
        if reason is not None:
            self._reject(record, reason)
            return _Item(record, None, self.log_losses)
        return _Item(record, group, self.log_losses)

    def _rescore(self, group: TrajectoryGroup) -> str | None:
        """Re-score the group (when sampled); the reason to reject it, or None. Under ``replace`` the
        group leaves with the checker's rewards."""
        header = group.header
        if self.rescorer is None or not self.rescorer.sampled(header.group_id):
            return None
        verdict = self.rescorer.check(group)
        worker, mode = header.worker_id, self.config.rescore
        if verdict.unscored:
            self.stats.unscored[worker] += 1
            logger.warning("group %s of worker %s not re-scored: %s", header.group_id, worker, verdict.reason)
            return None if mode == "count" else f"cannot be re-scored: {verdict.reason}"
        self.stats.rescored[worker] += 1
        if verdict.agrees:
            return None
        self.stats.disagreements[worker] += 1
        logger.warning("group %s of worker %s: %s", header.group_id, worker, verdict.reason)
        if mode == "reject":
            return f"rewards disagree with the task's checker: {verdict.reason}"
        if mode == "replace":
            group.header = header.model_copy(update={"rewards": verdict.rewards})
        return None

    def _misplaced(self, group: TrajectoryGroup, claim: ClaimRecord | None, topic: str) -> str | None:
        """Why a well-formed group does not belong on ``topic`` (the policy's or a mirror of it), or None."""
        header = group.header
        if claim is not None and claim.group_id != header.group_id:
            return f"claim record names group {claim.group_id!r}, its object holds {header.group_id!r}"
        if header.run != self.topics.run:
            return f"group of run {header.run!r} on {topic}"
        if header.policy != self.policy:
            return f"group of policy {header.policy!r} on {topic}"
        return None

    def _claimed(self, value: bytes | None, topic: str) -> tuple[bytes | None, ClaimRecord | None]:
        """The group's bytes: the record's own, or for a claim record the object it names (checked)."""
        if not is_claim(value):
            return value, None
        claim = decode_claim(value)
        if claim.run != self.topics.run or claim.policy != self.policy:
            raise RecordError(f"claim record of run {claim.run!r} policy {claim.policy!r} on {topic}")
        if self.store is None:
            raise RecordError("a claim-checked group, and this intake has no object store to fetch it from")
        self.stats.claims += 1
        return fetch_claim(self.store, claim), claim

    def _sweep_claims(self) -> None:
        if self.store is None or time.monotonic() < self._next_sweep:
            return
        self._next_sweep = time.monotonic() + min(3600.0, self.config.claim_retention_s / 10)
        try:
            sweep(self.store, self.config.claim_retention_s)
        except StoreError as exc:  # retention can wait for the next round; training cannot
            logger.warning("sweeping old claim-checked objects failed: %s", exc)

    def _reject(self, record: Record, reason: str) -> None:
        """Park the bytes in the DLQ, acknowledged, before their offset can be committed (only the
        reason and the source offset when the bytes are over the size a record may have)."""
        self.stats.rejected += 1
        self.stats.rejected_reasons[reason.split(":")[0]] += 1
        metrics.dlq("trainer", reason)
        value, omitted = record.value, None
        if value is not None and len(value) > self.kafka.max_message_bytes:
            value, omitted = b"", len(value)
            reason = (f"{reason} (record of {omitted} bytes, over kafka.max_message_bytes: not copied, "
                      f"it stays at the source offset until retention)")
        logger.warning("rejected %s[%d]@%d: %s", record.topic, record.partition, record.offset, reason)
        self._dlq.send_and_wait(
            self.topics.dlq, value, key=record.topic.encode(),
            headers=dlq_headers(reason, record.topic, record.partition, record.offset, omitted),
        )

    def _drain_actions(self) -> None:
        """Carry out the trainer's rejections and commits in order; consecutive commits merge."""
        merged: dict[Partition, int] = {}
        while True:
            try:
                kind, arg = self._actions.get_nowait()
            except queue.Empty:
                break
            if kind == "commit":
                merged.update(arg)
                continue
            self._commit(merged)
            merged = {}
            self._reject(*arg)
        self._commit(merged)

    def _commit(self, offsets: dict[Partition, int]) -> None:
        if not offsets:
            return
        # A commit that fails (a rebalance moved the partition) is logged by the reader: the new
        # owner reads those groups again and dedupe removes the copies. Not waited for: this thread
        # reads and decodes, and a broker under load answers a commit in tens of ms (closing the
        # reader still waits for commits in flight).
        self._reader.commit(offsets, wait=False)

    def _maybe_pause(self) -> None:
        with self._cond:
            size = len(self._queue)
        if not self._paused and size >= self.config.queue_max_groups:
            self._reader.pause()
            self._paused = True
        elif self._paused and size <= self.config.queue_max_groups // 2:
            self._reader.resume()
            self._paused = False

    @property
    def log_losses(self) -> int:
        """Times the broker came back without the log this intake read (another cluster id)."""
        return 0 if self._reader is None else self._reader.log_losses

    @property
    def cluster_id(self) -> str | None:
        """The cluster id of the broker whose log the intake reads (None before its first assignment)."""
        return None if self._reader is None else self._reader.cluster_id

    @property
    def queued(self) -> int:
        with self._cond:
            return len(self._queue)
