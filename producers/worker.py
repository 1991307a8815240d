"""The rollout worker: prompts in, trajectory groups out, weights followed in the background.

One worker is one member of the ``<run>.rollout`` consumer group on the prompt topics of the
workflows it serves (``<run>.prompts.<workflow>``), holding an engine for every policy they
involve, each following its own weight chain. For each batch of prompts of a workflow it makes
sure every policy's weights are fresh enough (each policy's η), runs the workflow, and publishes
each resulting group to its policy's topic; a prompt's offset is committed only after the broker
acknowledged every group made from it (at-least-once; trainers dedupe by group id). The
worker does not wait for acknowledgements or commits before its next batch, only while more than
``worker.max_unacked_bytes`` are unacknowledged (``AckedCommits``): a broker far away costs bytes
in flight, not round trips. It can be killed at any time: uncommitted prompts are redelivered to
another member.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from opentelemetry import trace
from opentelemetry.context import Context

from broker import metrics
from broker.admin import topic_partitions
from broker.codec import decode_prompt, encode_claim, encode_group
from broker.control import ControlReader
from broker.errors import BrokerError, DeliveryFailed, RecordError
from broker.headers import dlq_headers, group_headers
from broker.producer import Producer
from broker.reader import GroupReader, Partition, Record
from broker.schema import PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.settings import STOP_WAIT_S, KafkaConfig
from broker.topics import Topics
from broker.tracing import context_from, finished_span, traceparent, tracer
from producers.config import WorkerConfig, WorkflowSpec
from producers.engines import Engine, GenerationResult, routed_experts
from producers.prompts import PromptError
from producers.tasks import AnswerError, Task
from producers.follow import EngineFollower
from producers.workflows import PolicyRuntime, Produced, Workflow
from weightstore.claims import put_claim
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

MAX_DELIVERY_FAILURES = 5
"""Deliveries given up in a row (no batch acknowledged between them) before the worker stops with the
error: a broker that refuses every record, not one that is out of reach for a while."""


@dataclass
class WorkerStats:
    prompts: int = 0
    batches: int = 0
    groups_published: int = 0
    tokens_generated: int = 0
    rejected_prompts: int = 0
    claims: int = 0
    republished: int = 0
    delivery_failures: int = 0
    """Times the worker gave up on batches the broker did not acknowledge in time (and served on)."""
    started_at: float = field(default_factory=time.time)


class Outbox:
    """Published groups not yet announced as taken by their trainer (``ControlRecord.consumed_ids``),
    oldest first, up to ``max_bytes``: what a broker that lost its log needs again."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.evicted = 0
        self._kept: collections.OrderedDict[str, tuple[str, bytes, dict[str, str]]] = collections.OrderedDict()

    def keep(self, group_id: str, topic: str, value: bytes, headers: dict[str, str]) -> None:
        if self.max_bytes <= 0:
            return
        self.taken(group_id)
        self._kept[group_id] = (topic, value, headers)
        self.nbytes += len(value)
        while self.nbytes > self.max_bytes and self._kept:
            _, (_, old, _) = self._kept.popitem(last=False)
            self.nbytes -= len(old)
            self.evicted += 1

    def taken(self, group_id: str) -> None:
        kept = self._kept.pop(group_id, None)
        if kept is not None:
            self.nbytes -= len(kept[1])

    def items(self) -> list[tuple[str, str, bytes, dict[str, str]]]:
        return [(gid, topic, value, headers) for gid, (topic, value, headers) in self._kept.items()]


@dataclass
class _Batch:
    sent: list[asyncio.Future]
    offsets: dict[Partition, int]
    nbytes: int
    groups: int


class AckedCommits:
    """Prompt offsets committed in batch order, each batch's only once the broker acknowledged
    every record sent for it (its groups, and the DLQ copies of its malformed prompts) and for every
    batch before it. ``settle`` waits only while more than a given number of bytes are
    unacknowledged, so the worker generates while its records travel. A batch whose delivery fails
    fails every later one: nothing after a lost record is committed, and those prompts are
    redelivered."""

    def __init__(self, commit: Callable[[dict[Partition, int]], object]) -> None:
        self._commit = commit
        self._batches: collections.deque[_Batch] = collections.deque()
        self.unacked_bytes = 0
        self.acknowledged = 0  # groups
        self.committed: dict[Partition, int] = {}
        """The offsets of every batch acknowledged so far, merged: what the group should hold."""

    def add(self, sent: list[asyncio.Future], offsets: dict[Partition, int], nbytes: int, groups: int) -> None:
        """Track a batch: ``sent`` are the futures of its records' acknowledgements."""
        self._batches.append(_Batch(sent, offsets, nbytes, groups))
        self.unacked_bytes += nbytes

    async def settle(self, max_unacked_bytes: int) -> None:
        """Commit every batch acknowledged (with all before it); wait while more than
        ``max_unacked_bytes`` are unacknowledged. A failed batch raises here, on every call."""
        while self._batches:
            head = self._batches[0]
            if self.unacked_bytes <= max_unacked_bytes and not all(f.done() for f in head.sent):
                return
            if head.sent:
                await asyncio.wait(head.sent)  # unlike gather, a cancelled caller leaves them be
            for sent in head.sent:
                sent.result()  # the first failure fails this batch, and every later one with it
            self._batches.popleft()
            self.unacked_bytes -= head.nbytes
            self.acknowledged += head.groups
            self.committed.update(head.offsets)
            self._commit(head.offsets)

    def abandon(self) -> int:
        """Stop tracking what is in flight: it stays uncommitted. Returns the batches dropped."""
        dropped = len(self._batches)
        for batch in self._batches:
            for sent in batch.sent:
                sent.cancel()
        self._batches.clear()
        self.unacked_bytes = 0
        return dropped


def pack_samples(results: list[GenerationResult]) -> dict[str, np.ndarray]:
    """A group's samples as the columns of a TrajectoryGroup: completions end to end, their
    offsets, and each token's behaviour log-prob, weights version and loss mask."""
    offsets = np.zeros(len(results) + 1, np.int32)
    offsets[1:] = np.cumsum([len(r.tokens) for r in results])
    return {
        "completion_tokens": np.concatenate([np.asarray(r.tokens, np.int32) for r in results]),
        "completion_offsets": offsets,
        "behaviour_logprobs": np.concatenate([np.asarray(r.logprobs, np.float32) for r in results]),
        "token_versions": np.concatenate([np.asarray(r.versions, np.int32) for r in results]),
        "loss_mask": np.concatenate([np.asarray(r.mask if r.mask is not None else [1] * len(r.tokens), np.uint8)
                                     for r in results]),
    }


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class WorkerClients:
    """A worker's Kafka clients: the prompt reader (a group member), the producer, the control reader."""

    prompts: GroupReader
    producer: Producer
    control: ControlReader

    def close(self) -> None:
        self.control.close()
        self.prompts.close()  # its partitions move at once, or after its session expires (kafka.leave_group_on_close)
        self.producer.close(STOP_WAIT_S)


def connect_worker(kafka: KafkaConfig, topics: Topics, streams: list[str]) -> WorkerClients:
    """Create the clients, reading the prompt topics of ``streams`` (workflow names). Joining
    ``<run>.rollout`` takes seconds and goes on in the background, so a worker does this first and
    loads its models meanwhile."""
    producer = Producer(kafka, name="groups")
    try:
        control = ControlReader(kafka, topics, from_beginning=False, advisory=True)
    except BaseException:
        producer.close()
        raise
    try:
        prompts = GroupReader(kafka, topics.rollout_group, [topics.prompts(s) for s in streams])
    except BaseException:
        control.close()
        producer.close()
        raise
    return WorkerClients(prompts, producer, control)


@dataclass
class ServedPolicy:
    """One policy on this worker: its engine, the weights it follows, how it samples, its η."""

    engine: Engine
    weights: EngineFollower
    sampling: SamplingParams
    max_staleness: int


@dataclass
class ServedWorkflow:
    spec: WorkflowSpec
    workflow: Workflow


class RolloutWorker:
    """Consumes the prompts of its workflows, runs them over its policies, publishes groups."""

    def __init__(
        self,
        *,
        kafka: KafkaConfig,
        topics: Topics,
        workflows: list[ServedWorkflow],
        policies: dict[str, ServedPolicy],
        task: Task,
        config: WorkerConfig,
        worker_id: str | None = None,
        signing_key: bytes | None = None,
        clients: WorkerClients | None = None,
        store: ObjectStore | None = None,
    ) -> None:
        """``store``: the run's object store, where a group too large for a record goes (claim
        check); without it such a group fails at send."""
        self.kafka, self.topics, self.task, self.config = kafka, topics, task, config
        self.workflows = {topics.prompts(w.spec.name): w for w in workflows}
        self.policies = policies
        missing = {p for w in workflows for p in w.spec.policies} - set(policies)
        if missing:
            raise ValueError(f"the worker serves workflows that need policies {sorted(missing)} it has no engine for")
        self.worker_id = worker_id or default_worker_id()
        self.signing_key = signing_key
        self.store = store
        self.stats = WorkerStats()
        self._clients = clients
        self.outbox = Outbox(config.outbox_max_bytes)
        self._log_losses = 0
        self._next_partition: dict[str, int] = {}  # trajectory topic -> the partition of the next batch
        self._partition_counts: dict[str, int] = {}

    async def _batch_partition(self, topic: str) -> int | None:
        """The partition every group of one batch goes to: the topic's partitions in turn, from a
        random one. One partition per batch makes the batch one produced batch (one object on Tansu's
        s3 engine, one entry its memory engine walks on every fetch) instead of one per group; the
        trainer reads every partition, and nothing reads a trajectory's key. The partition count is
        asked once, by a client of its own (the producer's handle is not called from two threads);
        while the broker cannot say, None: the producer's partitioner places the groups by key, and
        the next batch asks again."""
        count = self._partition_counts.get(topic)
        if count is None:
            try:
                count = await asyncio.to_thread(topic_partitions, self.kafka, topic)
            except BrokerError as exc:
                logger.warning("worker %s: the partitions of %s are unknown (%s); this batch goes by key",
                               self.worker_id, topic, exc)
                return None
            self._partition_counts[topic] = count
        at = self._next_partition.get(topic)
        at = random.randrange(count) if at is None else (at + 1) % count
        self._next_partition[topic] = at
        return at

    async def run(self, stop: asyncio.Event) -> WorkerStats:
        """Serve prompts until ``stop`` is set or the run is over for every policy served."""
        streams = [w.spec.name for w in self.workflows.values()]
        clients = self._clients or await asyncio.to_thread(connect_worker, self.kafka, self.topics, streams)
        self._clients = None  # closed below: a worker runs once
        acks = AckedCommits(lambda offsets: clients.prompts.commit(offsets, wait=False))
        announced = {name: asyncio.Event() for name in self.policies}
        tasks = [asyncio.create_task(p.weights.follow(stop, announced[name])) for name, p in self.policies.items()]
        tasks.append(asyncio.create_task(self._listen(clients.control, announced, stop)))
        logger.info("worker %s serving %s", self.worker_id, ", ".join(self.workflows))
        try:
            for policy in self.policies.values():
                await policy.weights.ensure_fresh(0, policy.max_staleness)
            failures, acked = 0, 0  # deliveries given up since the broker last acknowledged a batch
            while not stop.is_set():
                records = await asyncio.to_thread(
                    clients.prompts.read, self.config.max_prompts_per_poll, self.config.fetch_timeout_ms / 1000
                )
                if clients.prompts.log_losses != self._log_losses:
                    self._log_losses = clients.prompts.log_losses
                    await self._republish(clients.producer)
                try:
                    if records:
                        await self._serve(records, clients.producer, acks)
                    else:
                        await acks.settle(0)  # nothing to generate: finish what is in flight
                    if acks.acknowledged > acked:  # the broker takes records again
                        failures, acked = 0, acks.acknowledged
                except DeliveryFailed as exc:
                    failures += 1
                    if failures > MAX_DELIVERY_FAILURES:
                        raise
                    await self._gave_up(exc, acks, clients)
            await acks.settle(0)
            # The commits above are sent without waiting; this one lands before the worker leaves.
            await asyncio.to_thread(clients.prompts.commit, acks.committed)
        except BaseException:
            acks.abandon()
            raise
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.to_thread(clients.close)
            self.stats.groups_published = acks.acknowledged
            logger.info(
                "worker %s stopped: %d groups published, %d tokens, %d commit failures, %d groups published again "
                "after a broker lost its log, %d dropped from the outbox, %d deliveries given up",
                self.worker_id,
                self.stats.groups_published,
                self.stats.tokens_generated,
                clients.prompts.commit_failures,
                self.stats.republished,
                self.outbox.evicted,
                self.stats.delivery_failures,
            )
        return self.stats

    async def _listen(self, control: ControlReader, announced: dict[str, asyncio.Event], stop: asyncio.Event) -> None:
        """A policy's version announcements wake its weight follower (only its own); the run's stop,
        or every served policy's trainer finishing, stops the worker."""
        while not stop.is_set():
            for record in await asyncio.to_thread(control.poll, 0.5):
                if record.kind == "version" and record.policy in announced:
                    announced[record.policy].set()
                for prompt_id in record.consumed_ids:
                    self.outbox.taken(f"{prompt_id}/{record.policy}")
            if control.over(set(self.policies)):
                logger.info("run %s is over for %s; stopping", self.topics.run, ", ".join(self.policies))
                stop.set()

    async def _republish(self, producer: Producer) -> None:
        """The broker came back without its log: publish again every group no trainer announced
        taking (the curator dispatches their prompts again too; the trainer keeps one copy)."""
        kept = self.outbox.items()
        logger.warning("worker %s: the broker lost its log; publishing again the %d groups no trainer announced "
                       "taking", self.worker_id, len(kept))
        sent = [producer.send(topic, value, key=gid.encode(), headers=headers) for gid, topic, value, headers in kept]
        for delivery in sent:
            await delivery
        self.stats.republished += len(sent)

    async def _gave_up(self, exc: DeliveryFailed, acks: AckedCommits, clients: WorkerClients) -> None:
        """A batch's records were not acknowledged in ``kafka.delivery_timeout_ms`` (the broker out of
        reach: a cut link): the worker drops that batch and every later one uncommitted, goes back to
        its committed offsets so that no later commit passes over them, and serves on. Those prompts
        are read again, here or by the partitions' next owner; a group that lands after all is a
        duplicate the trainer drops by its id."""
        dropped = acks.abandon()
        self.stats.delivery_failures += 1
        logger.warning("worker %s: %s; %d batches left uncommitted (their prompts are read again), serving on",
                       self.worker_id, exc, dropped)
        try:
            await asyncio.to_thread(clients.prompts.rewind)
        except BrokerError as error:  # still out of reach: a rebalance puts the partitions back where committed
            logger.warning("worker %s: could not go back to the committed offsets (%s)", self.worker_id, error)

    async def _serve(self, records: list[Record], producer: Producer, acks: AckedCommits) -> None:
        """Run a batch of prompts through their workflows and publish every group; their offsets are
        committed once the broker acknowledged them, while the next batch may already generate."""
        offsets: dict[Partition, int] = {}
        by_topic: dict[str, list[tuple[Record, PromptRecord]]] = {}
        sent: list[asyncio.Future] = []
        nbytes = 0

        def reject(record: Record, reason: str) -> None:
            # A bad prompt must not stop the fleet: park it in the DLQ (committed with its batch once
            # the DLQ acknowledged it) and move on.
            nonlocal nbytes
            self.stats.rejected_prompts += 1
            metrics.dlq("worker", reason)
            headers = dlq_headers(reason, record.topic, record.partition, record.offset)
            sent.append(producer.send(self.topics.dlq, record.value, key=record.topic.encode(), headers=headers))
            nbytes += len(record.value)

        for record in records:
            where = (record.topic, record.partition)
            offsets[where] = max(offsets.get(where, 0), record.offset + 1)
            try:
                by_topic.setdefault(record.topic, []).append((record, decode_prompt(record.value)))
            except RecordError as exc:
                reject(record, getattr(exc, "reason", str(exc)))
        groups: list[tuple[TrajectoryGroup, Context]] = []
        for topic, todo in by_topic.items():
            for record, outcome, generated in await self._run_workflow(self.workflows[topic], todo):
                if isinstance(outcome, AnswerError):
                    reject(record, f"task {self.task.name}: {outcome}")
                elif isinstance(outcome, PromptError):
                    reject(record, outcome.reason)
                else:
                    groups.extend((group, generated) for group in outcome)
        batch_partitions: dict[str, int | None] = {}
        for group, generated in groups:
            attrs = {"rlbus.group_id": group.header.group_id, "rlbus.prompt_id": group.header.prompt_id,
                     "rlbus.policy": group.header.policy, "rlbus.worker_id": self.worker_id,
                     "rlbus.min_version": group.header.min_version, "rlbus.max_version": group.header.max_version}
            with tracer().start_as_current_span("worker.publish", context=generated, attributes=attrs):
                value = encode_group(group, signing_key=self.signing_key)
                if len(value) > self.kafka.max_message_bytes and self.store is not None:
                    claim = await asyncio.to_thread(put_claim, self.store, run=group.header.run,
                                                    policy=group.header.policy, group_id=group.header.group_id,
                                                    data=value)
                    value = encode_claim(claim)
                    self.stats.claims += 1
                topic, headers = self.topics.trajectories(group.header.policy), group_headers(group.header, traceparent())
                if topic not in batch_partitions:
                    batch_partitions[topic] = await self._batch_partition(topic)
                sent.append(producer.send(topic, value, key=group.header.group_id.encode(), headers=headers,
                                          partition=batch_partitions[topic]))
                self.outbox.keep(group.header.group_id, topic, value, headers)
                nbytes += len(value)
            metrics.counter("rlbus.worker.groups", "{group}", "Groups published").add(1, {"policy": group.header.policy})
        acks.add(sent, offsets, nbytes, len(groups))
        await acks.settle(self.config.max_unacked_bytes)

    async def _run_workflow(
        self, served: ServedWorkflow, todo: list[tuple[Record, PromptRecord]]
    ) -> list[tuple[Record, list[TrajectoryGroup] | Exception, Context]]:
        """Bring each policy of the workflow to fresh-enough weights (guard 2, per policy), run it, and
        turn what it produced into groups. Headers say when the batch started and when it was done
        (``created_at``, ``published_at``): the curator estimates this worker's speed from them. Each
        prompt gets its generation span over the batch, in the trace its record's headers carry."""
        for name in served.spec.policies:  # each once, whatever roles it plays
            policy = self.policies[name]
            if policy.weights.refresh_before_generation:
                await policy.weights.refresh()
            required = max(p.dispatch_versions.get(name, p.dispatch_version if p.policy == name else 0) for _, p in todo)
            await policy.weights.ensure_fresh(required, policy.max_staleness)
        runtimes = {role: PolicyRuntime(name, self.policies[name].engine, self.policies[name].sampling,
                                        between_turns=self._between_turns(self.policies[name].weights))
                    for role, name in served.spec.roles.items()}
        started = time.time()
        self.stats.batches += 1
        with contextlib.ExitStack() as generating:
            for name in served.spec.policies:
                generating.enter_context(self.policies[name].weights.generating())
            outcomes = await served.workflow.run([p for _, p in todo], runtimes, self.task)
        if self.config.bench_speed < 1.0:
            await asyncio.sleep((time.time() - started) * (1.0 / self.config.bench_speed - 1.0))
        ended = time.time()
        metrics.histogram("rlbus.worker.generate.duration", "s", "Generation time per batch").record(
            ended - started, {"workflow": served.spec.name})
        versions = {f"rlbus.version.{name}": self.policies[name].engine.version for name in served.spec.policies}
        out: list[tuple[Record, list[TrajectoryGroup] | Exception, Context]] = []
        for (record, prompt), outcome in zip(todo, outcomes, strict=True):
            span = finished_span("worker.generate", parent=context_from(record.headers), start_s=started, end_s=ended,
                                 attributes={"rlbus.prompt_id": prompt.prompt_id, "rlbus.worker_id": self.worker_id,
                                             "rlbus.region": self.config.region, "rlbus.hardware": self.config.hardware,
                                             "rlbus.workflow": served.spec.name, "rlbus.batch_prompts": len(todo),
                                             "rlbus.failed": isinstance(outcome, Exception), **versions})
            generated = trace.set_span_in_context(span)
            if isinstance(outcome, Exception):
                out.append((record, outcome, generated))
            else:
                self.stats.prompts += 1
                out.append((record, [self._group(prompt, produced, started) for produced in outcome], generated))
        return out

    @staticmethod
    def _between_turns(weights: EngineFollower):
        async def refresh(turn: int) -> None:
            """Before each later turn of an episode, move to the newest weights when the worker refreshes
            before generating (the turn's tokens then carry that version)."""
            if weights.refresh_before_generation:
                await weights.refresh()

        return refresh

    def _group(self, prompt: PromptRecord, produced: Produced, started: float) -> TrajectoryGroup:
        policy = self.policies[produced.policy]
        arrays = pack_samples(produced.results)
        versions = arrays["token_versions"]
        tokens = int(arrays["loss_mask"].sum())
        self.stats.tokens_generated += tokens
        metrics.counter("rlbus.worker.tokens", "{token}", "Tokens generated").add(tokens, {"policy": produced.policy})
        routed = routed_experts(produced.results, len(produced.prompt_tokens), policy.engine.routing_shape)
        header = TrajectoryHeader(
            run=prompt.run,
            policy=produced.policy,
            group_id=f"{prompt.prompt_id}/{produced.policy}",
            prompt_id=prompt.prompt_id,
            prompt_key=prompt.prompt_key,
            task=prompt.task,
            worker_id=self.worker_id,
            region=self.config.region,
            hardware=self.config.hardware,
            engine=policy.engine.name,
            sampling=policy.sampling,
            rewards=produced.rewards,
            finish_reasons=[r.finish_reason for r in produced.results],
            min_version=int(versions.min()) if len(versions) else policy.engine.version,
            max_version=int(versions.max()) if len(versions) else policy.engine.version,
            vocab_size=policy.engine.vocab_size,
            created_at=started,
            provenance=produced.provenance,
            subgroups=produced.subgroups,
            turns=[[list(span) for span in r.turns or ()] for r in produced.results]
            if any(r.turns is not None for r in produced.results) else None,
            routing=None if routed is None else policy.engine.routing_shape,
        )
        return TrajectoryGroup(header=header, prompt_tokens=np.asarray(produced.prompt_tokens, np.int32),
                               routed_experts=routed, **arrays)
