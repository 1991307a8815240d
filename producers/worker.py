"""The rollout worker: prompts in, trajectory groups out, weights followed in the background.

One worker is one member of the ``<run>.rollout`` consumer group on ``<run>.prompts.<policy>``.
For each batch of prompts it makes sure its weights are fresh enough, generates G samples per
prompt, scores them and publishes one TrajectoryGroup each; a prompt's offset is committed only
after the broker acknowledged its group (at-least-once; the trainer dedupes by group id). The
worker does not wait for acknowledgements or commits before its next batch, only while more than
``worker.max_unacked_bytes`` are unacknowledged (``AckedCommits``): a broker far away costs bytes
in flight, not round trips. It can be killed at any time: uncommitted prompts are redelivered to
another member.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from opentelemetry import trace

from broker.codec import decode_prompt, encode_group
from broker.control import ControlReader
from broker.errors import RecordError
from broker.headers import dlq_headers, group_headers
from broker.producer import Producer
from broker.reader import GroupReader, Partition, Record
from broker.schema import PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.settings import KafkaConfig
from broker.topics import Topics
from producers.config import WorkerConfig
from producers.engine import Engine, GenerationResult
from producers.episodes import MultiTurnTask, run_episodes
from producers.prompts import PromptError, prompt_token_ids
from producers.weight_sync import WeightSync
from producers.tasks import AnswerError, Task
from producers.tracing import current_traceparent

logger = logging.getLogger(__name__)


@dataclass
class WorkerStats:
    prompts: int = 0
    batches: int = 0
    groups_published: int = 0
    tokens_generated: int = 0
    rejected_prompts: int = 0
    started_at: float = field(default_factory=time.time)


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

    def abandon(self) -> None:
        """Stop tracking (the worker is failing): what is unacknowledged stays uncommitted."""
        for batch in self._batches:
            for sent in batch.sent:
                sent.cancel()
        self._batches.clear()
        self.unacked_bytes = 0


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
        self.prompts.close()  # leaves the group: its partitions move at once
        self.producer.close()


def connect_worker(kafka: KafkaConfig, topics: Topics, policy: str) -> WorkerClients:
    """Create the clients. Joining ``<run>.rollout`` takes seconds and goes on in the background,
    so a worker does this first and loads its model meanwhile."""
    producer = Producer(kafka, name="groups")
    try:
        control = ControlReader(kafka, topics, from_beginning=False, advisory=True)
    except BaseException:
        producer.close()
        raise
    try:
        prompts = GroupReader(kafka, f"{topics.run}.rollout", [topics.prompts(policy)])
    except BaseException:
        control.close()
        producer.close()
        raise
    return WorkerClients(prompts, producer, control)


class RolloutWorker:
    """Consumes prompts of one policy, generates, scores, publishes groups."""

    def __init__(
        self,
        *,
        kafka: KafkaConfig,
        topics: Topics,
        policy: str,
        engine: Engine,
        task: Task,
        weights: WeightSync,
        sampling: SamplingParams,
        max_staleness: int,
        config: WorkerConfig,
        worker_id: str | None = None,
        signing_key: bytes | None = None,
        clients: WorkerClients | None = None,
    ) -> None:
        self.kafka, self.topics, self.policy = kafka, topics, policy
        self.engine, self.task, self.weights = engine, task, weights
        self.sampling, self.max_staleness, self.config = sampling, max_staleness, config
        self.worker_id = worker_id or default_worker_id()
        self.signing_key = signing_key
        self.stats = WorkerStats()
        self._clients = clients

    async def run(self, stop: asyncio.Event) -> WorkerStats:
        """Serve prompts until ``stop`` is set or the run announces its end."""
        clients = self._clients or await asyncio.to_thread(connect_worker, self.kafka, self.topics, self.policy)
        self._clients = None  # closed below: a worker runs once
        acks = AckedCommits(lambda offsets: clients.prompts.commit(offsets, wait=False))
        announced = asyncio.Event()
        follow = asyncio.create_task(self.weights.follow(stop, announced))
        listen = asyncio.create_task(self._listen(clients.control, announced, stop))
        logger.info("worker %s serving %s", self.worker_id, self.topics.prompts(self.policy))
        try:
            await self.weights.ensure_fresh(0, self.max_staleness)
            while not stop.is_set():
                records = await asyncio.to_thread(
                    clients.prompts.read, self.config.max_prompts_per_poll, self.config.fetch_timeout_ms / 1000
                )
                if records:
                    await self._serve(records, clients.producer, acks)
                else:
                    await acks.settle(0)  # nothing to generate: finish what is in flight
            await acks.settle(0)
            # The commits above are sent without waiting; this one lands before the worker leaves.
            await asyncio.to_thread(clients.prompts.commit, acks.committed)
        except BaseException:
            acks.abandon()
            raise
        finally:
            follow.cancel()
            listen.cancel()
            await asyncio.gather(follow, listen, return_exceptions=True)
            await asyncio.to_thread(clients.close)
            self.stats.groups_published = acks.acknowledged
            logger.info(
                "worker %s stopped: %d groups published, %d tokens, %d commit failures",
                self.worker_id,
                self.stats.groups_published,
                self.stats.tokens_generated,
                clients.prompts.commit_failures,
            )
        return self.stats

    async def _listen(self, control: ControlReader, announced: asyncio.Event, stop: asyncio.Event) -> None:
        """Version announcements wake the weight follower; the run's end stops the worker."""
        while not stop.is_set():
            for record in await asyncio.to_thread(control.poll, 0.5):
                if record.kind == "stop":
                    logger.info("run %s announced its end; stopping", self.topics.run)
                    stop.set()
                elif record.policy == self.policy:
                    announced.set()

    async def _serve(self, records: list[Record], producer: Producer, acks: AckedCommits) -> None:
        """Generate for a batch of prompts at once and publish every group; their offsets are
        committed once the broker acknowledged them, while the next batch may already generate."""
        offsets: dict[Partition, int] = {}
        todo: list[tuple[Record, PromptRecord, list[int]]] = []
        sent: list[asyncio.Future] = []
        nbytes = 0

        def reject(record: Record, reason: str) -> None:
            # A bad prompt must not stop the fleet: park it in the DLQ (committed with its batch once
            # the DLQ acknowledged it) and move on.
            nonlocal nbytes
            self.stats.rejected_prompts += 1
            headers = dlq_headers(reason, record.topic, record.partition, record.offset)
            sent.append(producer.send(self.topics.dlq, record.value, key=record.topic.encode(), headers=headers))
            nbytes += len(record.value)

        for record in records:
            where = (record.topic, record.partition)
            offsets[where] = max(offsets.get(where, 0), record.offset + 1)
            try:
                prompt = decode_prompt(record.value)
                todo.append((record, prompt, prompt_token_ids(self.engine.tokenizer, prompt.prompt, prompt.messages)))
            except (RecordError, PromptError) as exc:
                reject(record, getattr(exc, "reason", str(exc)))
        groups: list[TrajectoryGroup] = []
        if todo:
            if self.weights.refresh_before_generation:
                await self.weights.refresh()
            await self.weights.ensure_fresh(max(p.dispatch_version for _, p, _ in todo), self.max_staleness)
            for record, outcome in await self._generate(todo):
                if isinstance(outcome, AnswerError):
                    reject(record, f"task {self.task.name}: {outcome}")
                else:
                    groups.append(outcome)
            tracer = trace.get_tracer(__name__)
            for group in groups:
                attrs = {"rlbus.group_id": group.header.group_id, "rlbus.min_version": group.header.min_version}
                with tracer.start_as_current_span("rollout.group", attributes=attrs):
                    value = encode_group(group, signing_key=self.signing_key)
                    sent.append(producer.send(
                        self.topics.trajectories(self.policy), value, key=group.header.group_id.encode(),
                        headers=group_headers(group.header, current_traceparent()),
                    ))
                    nbytes += len(value)
        acks.add(sent, offsets, nbytes, len(groups))
        await acks.settle(self.config.max_unacked_bytes)

    async def _generate(
        self, todo: list[tuple[Record, PromptRecord, list[int]]]
    ) -> list[tuple[Record, TrajectoryGroup | AnswerError]]:
        """Generate every prompt's group; headers say when the batch started and when it was done
        (``created_at``, ``published_at``): the curator estimates this worker's speed from them.
        A prompt whose reference answer the task cannot use comes back as its ``AnswerError``."""
        started = time.time()
        self.stats.batches += 1
        done: list[tuple[Record, PromptRecord, list[int], list[GenerationResult]]] = []
        by_size: dict[int, list[tuple[Record, PromptRecord, list[int]]]] = {}
        for item in todo:
            by_size.setdefault(item[1].group_size, []).append(item)
        for size, same in by_size.items():
            with self.weights.generating():
                if isinstance(self.task, MultiTurnTask):
                    results = await run_episodes(
                        self.engine, self.task, [(p.prompt, p.answer, t) for _, p, t in same], size, self.sampling,
                        max_context_tokens=self.engine.max_context_tokens, between_turns=self._between_turns)
                else:
                    results = await self.engine.generate_batch([t for _, _, t in same], size, self.sampling)
            done.extend((r, p, t, res) for (r, p, t), res in zip(same, results))
        if self.config.bench_speed < 1.0:
            await asyncio.sleep((time.time() - started) * (1.0 / self.config.bench_speed - 1.0))
        # Scoring may take long (a code task runs programs): it runs on threads, off the event loop,
        # so weight following, control records and acknowledgements go on meanwhile.
        scored = await asyncio.gather(*(asyncio.to_thread(self._score, prompt, results) for _, prompt, _, results in done))
        out: list[tuple[Record, TrajectoryGroup | AnswerError]] = []
        for (record, prompt, tokens, results), rewards in zip(done, scored):
            if isinstance(rewards, AnswerError):
                out.append((record, rewards))
            else:
                out.append((record, self._group(prompt, tokens, results, rewards, started)))
        return out

    def _score(self, prompt: PromptRecord, results: list[GenerationResult]) -> list[float] | AnswerError:
        """The task's reward of each sample; the ``AnswerError`` when the prompt's answer is unusable."""
        try:
            return [self.task.score(prompt.prompt, r.text, prompt.answer) for r in results]
        except AnswerError as exc:
            return exc

    async def _between_turns(self, turn: int) -> None:
        """Before each later turn of an episode, move to the newest weights when the worker refreshes
        before generating (the turn's tokens then carry that version)."""
        if self.weights.refresh_before_generation:
            await self.weights.refresh()

    def _group(
        self, prompt: PromptRecord, prompt_tokens: list[int], results: list[GenerationResult], rewards: list[float],
        started: float,
    ) -> TrajectoryGroup:
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
