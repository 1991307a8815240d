"""The rollout worker: prompts in, trajectory groups out, weights followed in the background.

One worker is one member of the ``<run>.rollout`` consumer group on ``<run>.prompts.<policy>``.
For each prompt it makes sure its weights are fresh enough, generates G samples, scores them and
publishes one TrajectoryGroup; only after the broker acknowledged that record does it commit the
prompt's offset (at-least-once; the trainer dedupes by group id). The acknowledgements of one batch
are awaited while the next one generates (``AckedCommits``). It can be killed at any time:
uncommitted prompts are redelivered to another member.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError, IllegalStateError, KafkaError
from opentelemetry import trace

from broker.codec import decode_prompt, encode_group
from broker.errors import RecordError
from broker.headers import dlq_headers, group_headers
from broker.schema import PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.settings import KafkaConfig
from broker.topics import Topics
from producers.config import WorkerConfig
from producers.control import ControlListener
from producers.engine import Engine, GenerationResult
from producers.envs import Environment
from producers.follower import WeightSync
from producers.tracing import current_traceparent

logger = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    prompts: int = 0
    batches: int = 0
    groups_published: int = 0
    tokens_generated: int = 0
    rejected_prompts: int = 0
    commit_failures: int = 0
    started_at: float = field(default_factory=time.time)


class AckedCommits:
    """Prompt offsets committed in batch order, each batch's only once the broker acknowledged
    every group generated from it. The worker generates its next batch while up to
    ``worker.max_unacked_batches`` batches wait here, so a broker far away costs no generation
    time. A batch whose acknowledgement fails fails every later one: nothing after a lost group is
    committed, and the prompts are redelivered."""

    def __init__(self, commit: Callable[[dict[TopicPartition, int]], Awaitable[None]]) -> None:
        self._commit = commit
        self._pending: collections.deque[asyncio.Task] = collections.deque()
        self.acknowledged = 0  # groups

    def add(self, sent: list[asyncio.Future], offsets: dict[TopicPartition, int]) -> None:
        """Track a batch: ``sent`` are the producer's delivery futures of its groups."""
        previous = self._pending[-1] if self._pending else None
        self._pending.append(asyncio.create_task(self._complete(previous, sent, offsets)))

    async def _complete(
        self, previous: asyncio.Task | None, sent: list[asyncio.Future], offsets: dict[TopicPartition, int]
    ) -> None:
        if previous is not None:
            await previous
        await asyncio.gather(*sent)
        self.acknowledged += len(sent)
        await self._commit(offsets)

    async def settle(self, keep: int) -> None:
        """Wait until at most ``keep`` batches are pending; a failed batch raises here."""
        while self._pending and (len(self._pending) > keep or self._pending[0].done()):
            await self._pending.popleft()

    async def abandon(self) -> None:
        """Stop waiting (the worker is failing): what is unacknowledged stays uncommitted."""
        for task in self._pending:
            task.cancel()
        await asyncio.gather(*self._pending, return_exceptions=True)
        self._pending.clear()


def pack_samples(results: list[GenerationResult]) -> dict[str, np.ndarray]:
    """A group's samples as the columns of a TrajectoryGroup: completions end to end, their
    offsets, and each token's behaviour log-prob and weights version."""
    offsets = np.zeros(len(results) + 1, np.int32)
    offsets[1:] = np.cumsum([len(r.tokens) for r in results])
    return {
        "completion_tokens": np.concatenate([np.asarray(r.tokens, np.int32) for r in results]),
        "completion_offsets": offsets,
        "behaviour_logprobs": np.concatenate([np.asarray(r.logprobs, np.float32) for r in results]),
        "token_versions": np.concatenate([np.asarray(r.versions, np.int32) for r in results]),
    }


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass
class WorkerClients:
    """A worker's started Kafka clients: prompt consumer (group member), producer, control listener."""

    consumer: AIOKafkaConsumer
    producer: AIOKafkaProducer
    control: ControlListener

    async def stop(self) -> None:
        await self.control.stop()
        await self.consumer.stop()  # leaves the group: partitions move at once
        await self.producer.stop()


async def connect_worker(kafka: KafkaConfig, topics: Topics, policy: str) -> WorkerClients:
    """Start the clients; the consumer's start includes joining ``<run>.rollout`` (seconds), so a
    worker starts this while it loads its model. Clients started before a failure are stopped."""
    consumer = AIOKafkaConsumer(topics.prompts(policy), **kafka.aiokafka_consumer_kwargs(f"{topics.run}.rollout"))
    producer = AIOKafkaProducer(**kafka.aiokafka_producer_kwargs())
    control = ControlListener(kafka, topics, policy)
    started: list = []
    try:
        for client in (producer, consumer, control):
            await client.start()
            started.append(client)
    except BaseException:
        for client in reversed(started):
            await client.stop()
        raise
    return WorkerClients(consumer, producer, control)


class RolloutWorker:
    """Consumes prompts of one policy, generates, scores, publishes groups."""

    def __init__(
        self,
        *,
        kafka: KafkaConfig,
        topics: Topics,
        policy: str,
        engine: Engine,
        env: Environment,
        weights: WeightSync,
        sampling: SamplingParams,
        max_staleness: int,
        config: WorkerConfig,
        worker_id: str | None = None,
        signing_key: bytes | None = None,
        clients: WorkerClients | None = None,
    ) -> None:
        self.kafka, self.topics, self.policy = kafka, topics, policy
        self.engine, self.env, self.weights = engine, env, weights
        self.sampling, self.max_staleness, self.config = sampling, max_staleness, config
        self.worker_id = worker_id or default_worker_id()
        self.signing_key = signing_key
        self.stats = WorkerStats()
        self._clients = clients
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None
        self._acks = AckedCommits(self._commit)

    async def run(self, stop: asyncio.Event) -> WorkerStats:
        """Serve prompts until ``stop`` is set or the run announces its end."""
        clients = self._clients or await connect_worker(self.kafka, self.topics, self.policy)
        self._clients = None  # stopped below: a worker runs once
        consumer, producer, control = clients.consumer, clients.producer, clients.control
        self._consumer, self._producer = consumer, producer
        follow = asyncio.create_task(self.weights.follow(stop, control.version_announced))
        watch = asyncio.create_task(self._watch_control(control, stop))
        logger.info("worker %s serving %s", self.worker_id, self.topics.prompts(self.policy))
        try:
            await self.weights.ensure_fresh(0, self.max_staleness)
            while not stop.is_set():
                batches = await consumer.getmany(
                    timeout_ms=self.config.fetch_timeout_ms,
                    max_records=self.config.max_prompts_per_poll,
                )
                records = [(tp, r) for tp, rs in batches.items() for r in rs]
                if records:
                    await self._serve(records)
                else:
                    await self._acks.settle(0)  # nothing to generate: finish what is in flight
            await self._acks.settle(0)
        except BaseException:
            await self._acks.abandon()
            raise
        finally:
            follow.cancel()
            watch.cancel()
            await asyncio.gather(follow, watch, return_exceptions=True)
            await clients.stop()
            self.stats.groups_published = self._acks.acknowledged
            logger.info(
                "worker %s stopped: %d groups published, %d tokens",
                self.worker_id,
                self.stats.groups_published,
                self.stats.tokens_generated,
            )
        return self.stats

    async def _watch_control(self, control: ControlListener, stop: asyncio.Event) -> None:
        await control.stopped.wait()
        logger.info("run %s announced its end; stopping", self.topics.run)
        stop.set()

    async def _serve(self, records: list[tuple[TopicPartition, ConsumerRecord]]) -> None:
        """Generate for a batch of prompts at once and publish every group; their offsets are committed
        once the broker acknowledged them, while the next batch may already generate."""
        commits: dict[TopicPartition, int] = {}
        prompts: list[PromptRecord] = []
        for tp, record in records:
            commits[tp] = max(commits.get(tp, 0), record.offset + 1)
            try:
                prompts.append(decode_prompt(record.value))
            except RecordError as exc:
                # A malformed prompt must not stop the fleet: park it in the DLQ and move on.
                self.stats.rejected_prompts += 1
                await self._producer.send_and_wait(
                    self.topics.dlq,
                    value=record.value,
                    key=tp.topic.encode(),
                    headers=dlq_headers(exc.reason, tp.topic, tp.partition, record.offset),
                )
        sent: list[asyncio.Future] = []
        if prompts:
            if self.weights.refresh_before_generation:
                await self.weights.refresh()
            await self.weights.ensure_fresh(max(p.dispatch_version for p in prompts), self.max_staleness)
            groups = await self._generate(prompts)
            tracer = trace.get_tracer(__name__)
            for group in groups:
                attrs = {"rlbus.group_id": group.header.group_id, "rlbus.min_version": group.header.min_version}
                with tracer.start_as_current_span("rollout.group", attributes=attrs):
                    sent.append(
                        await self._producer.send(
                            self.topics.trajectories(self.policy),
                            value=encode_group(group, signing_key=self.signing_key),
                            key=group.header.group_id.encode(),
                            headers=group_headers(group.header, current_traceparent()),
                        )
                    )
        self._acks.add(sent, commits)
        await self._acks.settle(self.config.max_unacked_batches)

    async def _commit(self, offsets: dict[TopicPartition, int]) -> None:
        try:
            await self._consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            # A partition moved to another member: it will redeliver; dedupe removes the copy.
            self.stats.commit_failures += 1
            logger.warning("commit of %s failed (%s); those prompts will be redelivered", offsets, exc)

    async def _generate(self, prompts: list[PromptRecord]) -> list[TrajectoryGroup]:
        """Generate every prompt's group; headers say when the batch started and when it was done
        (``created_at``, ``published_at``): the curator estimates this worker's speed from them."""
        started = time.time()
        self.stats.batches += 1
        done: list[tuple[PromptRecord, list[int], list[GenerationResult]]] = []
        by_size: dict[int, list[PromptRecord]] = {}
        for prompt in prompts:
            by_size.setdefault(prompt.group_size, []).append(prompt)
        for size, same in by_size.items():
            tokens = [self.engine.tokenizer(p.prompt)["input_ids"] for p in same]
            with self.weights.generating():
                results = await self.engine.generate_batch(tokens, size, self.sampling)
            done.extend(zip(same, tokens, results))
        if self.config.throttle < 1.0:
            await asyncio.sleep((time.time() - started) * (1.0 / self.config.throttle - 1.0))
        return [self._group(p, t, r, started) for p, t, r in done]

    def _group(
        self, prompt: PromptRecord, prompt_tokens: list[int], results: list[GenerationResult], started: float
    ) -> TrajectoryGroup:
        rewards = [self.env.score(prompt.prompt, r.text, prompt.answer) for r in results]
        self.stats.prompts += 1
        arrays = pack_samples(results)
        versions = arrays["token_versions"]
        self.stats.tokens_generated += len(versions)
        header = TrajectoryHeader(
            run=prompt.run,
            policy=self.policy,
            group_id=f"{prompt.prompt_id}/{self.policy}",
            prompt_id=prompt.prompt_id,
            prompt_key=prompt.prompt_key,
            task=prompt.task,
            worker_id=self.worker_id,
            region=self.config.region,
            hardware=self.config.hardware,
            engine=self.engine.name,
            sampling=self.sampling,
            rewards=rewards,
            finish_reasons=[r.finish_reason for r in results],
            min_version=int(versions.min()) if len(versions) else self.engine.version,
            max_version=int(versions.max()) if len(versions) else self.engine.version,
            vocab_size=self.engine.vocab_size,
            created_at=started,
        )
        return TrajectoryGroup(header=header, prompt_tokens=np.asarray(prompt_tokens, np.int32), **arrays)
