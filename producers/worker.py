"""The rollout worker: prompts in, trajectory groups out, weights followed in the background.

One worker is one member of the ``<run>.rollout`` consumer group on ``<run>.prompts.<policy>``.
For each prompt it makes sure its weights are fresh enough, generates G samples, scores them and
publishes one TrajectoryGroup; only after the broker acknowledged that record does it commit the
prompt's offset (at-least-once; the trainer dedupes by group id). It can be killed at any time:
uncommitted prompts are redelivered to another member.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
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
    groups_published: int = 0
    tokens_generated: int = 0
    rejected_prompts: int = 0
    commit_failures: int = 0
    started_at: float = field(default_factory=time.time)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


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
    ) -> None:
        self.kafka, self.topics, self.policy = kafka, topics, policy
        self.engine, self.env, self.weights = engine, env, weights
        self.sampling, self.max_staleness, self.config = sampling, max_staleness, config
        self.worker_id = worker_id or default_worker_id()
        self.signing_key = signing_key
        self.stats = WorkerStats()
        self._consumer: AIOKafkaConsumer | None = None
        self._producer: AIOKafkaProducer | None = None

    async def run(self, stop: asyncio.Event) -> WorkerStats:
        """Serve prompts until ``stop`` is set or the run announces its end."""
        consumer = AIOKafkaConsumer(
            self.topics.prompts(self.policy),
            **self.kafka.aiokafka_consumer_kwargs(f"{self.topics.run}.rollout"),
        )
        producer = AIOKafkaProducer(**self.kafka.aiokafka_producer_kwargs())
        control = ControlListener(self.kafka, self.topics, self.policy)
        await producer.start()
        await consumer.start()
        await control.start()
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
                for tp, records in batches.items():
                    for record in records:
                        if stop.is_set():
                            break  # not committed: redelivered to another member
                        await self._serve(tp, record.offset, record.value)
        finally:
            follow.cancel()
            watch.cancel()
            await asyncio.gather(follow, watch, return_exceptions=True)
            await control.stop()
            await consumer.stop()  # leaves the group: partitions move at once
            await producer.stop()
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

    async def _serve(self, tp: TopicPartition, offset: int, value: bytes) -> None:
        try:
            prompt = decode_prompt(value)
        except RecordError as exc:
            # A malformed prompt must not stop the fleet: park it in the DLQ and move on.
            self.stats.rejected_prompts += 1
            await self._producer.send_and_wait(
                self.topics.dlq,
                value=value,
                key=tp.topic.encode(),
                headers=dlq_headers(exc.reason, tp.topic, tp.partition, offset),
            )
            await self._commit(tp, offset)
            return
        tracer = trace.get_tracer(__name__)
        with tracer.start_as_current_span("rollout.group", attributes={"rlbus.prompt_id": prompt.prompt_id}):
            await self.weights.ensure_fresh(prompt.dispatch_version, self.max_staleness)
            group = await self._generate(prompt)
            await self._producer.send_and_wait(
                self.topics.trajectories(self.policy),
                value=encode_group(group, signing_key=self.signing_key),
                key=group.header.group_id.encode(),
                headers=group_headers(group.header, current_traceparent()),
            )
        self.stats.groups_published += 1
        await self._commit(tp, offset)

    async def _commit(self, tp: TopicPartition, offset: int) -> None:
        try:
            await self._consumer.commit({tp: offset + 1})
        except (CommitFailedError, IllegalStateError, KafkaError) as exc:
            # The partition moved to another member: it will redeliver; dedupe removes the copy.
            self.stats.commit_failures += 1
            logger.warning("commit of %s@%d failed (%s); prompt will be redelivered", tp, offset, exc)

    async def _generate(self, prompt: PromptRecord) -> TrajectoryGroup:
        started = time.time()
        prompt_tokens = self.engine.tokenizer(prompt.prompt)["input_ids"]
        results: list[GenerationResult] = await self.engine.generate(
            prompt_tokens, prompt.group_size, self.sampling
        )
        if self.config.throttle < 1.0:
            await asyncio.sleep((time.time() - started) * (1.0 / self.config.throttle - 1.0))
        rewards = [self.env.score(prompt.prompt, r.text, prompt.answer) for r in results]
        self.stats.prompts += 1
        tokens = np.concatenate([np.asarray(r.tokens, np.int32) for r in results])
        self.stats.tokens_generated += len(tokens)
        versions = np.concatenate([np.asarray(r.versions, np.int32) for r in results])
        offsets = np.zeros(len(results) + 1, np.int32)
        offsets[1:] = np.cumsum([len(r.tokens) for r in results])
        header = TrajectoryHeader(
            run=prompt.run,
            policy=self.policy,
            group_id=f"{prompt.prompt_id}/{self.policy}",
            prompt_id=prompt.prompt_id,
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
        return TrajectoryGroup(
            header=header,
            prompt_tokens=np.asarray(prompt_tokens, np.int32),
            completion_tokens=tokens,
            completion_offsets=offsets,
            behaviour_logprobs=np.concatenate([np.asarray(r.logprobs, np.float32) for r in results]),
            token_versions=versions,
        )
