"""The curator: reads a dataset and dispatches a workflow's prompts under admission control (guard 1).

One curator serves one workflow's prompt topic, ``<run>.prompts.<workflow>``. Per policy the
workflow involves, in-flight prompts = dispatched − consumed by that policy's trainer (trained,
dropped stale or rejected, as announced on the control topic); the curator never lets that exceed
the policy's (η + 1) × groups per step (``consumers.admission``), so no prompt can be generated with
weights older than the staleness budget allows (AReaL's rule), and the slowest trainer bounds the
dispatch. With η = 0 this is synchronous training: the next batch is dispatched only after the
step that consumed the previous one was published.

It also reads the trajectory topic of the workflow's primary policy (``consumers.feedback``): the
rewards of each finished group feed the prompt stages (skip solved prompts, GRESO), and who served
what, how fast, feeds the router that picks each prompt's partition (``consumers.routing``).

The curator tracks each prompt until every trainer of the workflow announced taking its group
(``ControlRecord.consumed_ids``). When the broker comes back without its log (it answers as another
cluster, which its control reader notices), it recreates the topics and dispatches the prompts it still
tracks again, under their own ids, so that no prompt is lost and a trainer that already took one
drops the copy by its group id.

Each dispatch gets a unique ``prompt_id`` (``p<n>``, n counting dispatches over the run, so a
restarted curator continues the sequence); the dataset row travels as ``prompt_key`` (the row's
``prompt_id`` field). The data cursor walks the shuffled dataset epoch by epoch; prompts a stage
skips advance it without a dispatch. After a restart the cursor resumes at the dispatch count.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from opentelemetry.context import Context
from pydantic import BaseModel, ConfigDict, Field

from broker import metrics
from broker.admin import end_offsets, ensure_run_topics, topic_partitions
from broker.codec import encode_prompt
from broker.control import ControlReader
from broker.headers import TRACEPARENT
from broker.producer import Producer
from broker.schema import ControlRecord, PromptRecord
from broker.settings import STOP_WAIT_S, KafkaConfig
from broker.topics import Topics
from broker.tracing import traceparent, tracer
from consumers.admission import Admission
from consumers.dataset import Row
from consumers.feedback import FeedbackReader
from consumers.routing import RoutingConfig, build_router
from consumers.turns import Turns
from consumers.stages import PromptStage, StageSpec, admit_prompt, build_prompt_stages, observe_prompt, stage_metrics

logger = logging.getLogger(__name__)


class CuratorConfig(BaseModel):
    """Settings of the prompt curator."""

    model_config = ConfigDict(extra="forbid")

    epochs: int | None = Field(default=None, ge=1, description="Passes over the data; None = until stopped.")
    poll_interval_s: float = Field(default=0.05, gt=0, description="Control-topic poll wait, seconds.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="How prompts are spread over partitions.")
    report_every_s: float = Field(default=10.0, gt=0, description="Seconds between two metrics rows.")


@dataclass
class CuratorStats:
    dispatched: int = 0
    consumed: int = 0
    trainer_version: int = 0
    cursor: int = 0
    skipped: int = 0
    forced: int = 0
    feedback: int = 0
    broker_losses: int = 0
    redispatched: int = 0


class DataCursor:
    """The curator's walk over its dataset: epoch by epoch, each epoch in an order shuffled by
    ``seed`` and the epoch's number; rows the prompt ``stages`` do not admit (their draws from a
    generator seeded with ``seed``) are passed over and counted in ``stats.skipped``, and a whole pass of skips dispatches
    the next row anyway (``stats.forced``). ``stats.cursor`` is the position: a resumed curator
    sets it to the prompts already dispatched."""

    def __init__(self, rows: list[Row], seed: int, stages: list[PromptStage], stats: CuratorStats) -> None:
        self.rows, self.seed, self.stages, self.stats = rows, seed, stages, stats
        self.rng = random.Random(seed)
        self._orders: dict[int, list[int]] = {}

    def row(self, cursor: int) -> Row:
        epoch, pos = divmod(cursor, len(self.rows))
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self.rows[self._orders[epoch][pos]]

    def next(self, limit: int | None = None) -> Row | None:
        """The next row the stages admit; None at ``limit`` (the end of the data)."""
        skipped_in_a_row = 0
        while limit is None or self.stats.cursor < limit:
            row = self.row(self.stats.cursor)
            self.stats.cursor += 1
            if admit_prompt(self.stages, row.key, self.rng):
                return row
            self.stats.skipped += 1
            skipped_in_a_row += 1
            if skipped_in_a_row >= len(self.rows):
                self.stats.forced += 1
                logger.warning("curator: every prompt is skipped by the stages; dispatching %s anyway", row.key)
                return row
        return None


class Curator:
    """Dispatches the prompts of one workflow to ``<run>.prompts.<workflow>``."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: Topics,
        workflow: str,
        config: CuratorConfig,
        *,
        rows: list[Row],
        task: str,
        group_size: int,
        windows: dict[str, int],
        turns: Turns | None = None,
        seed: int = 0,
        stages: list[StageSpec] | None = None,
        metrics_path: Path | None = None,
    ) -> None:
        """``windows``: each policy of the workflow → its admission window, (η + 1) × groups per step,
        the primary (whose groups feed the stages) first; ``turns``: the trainers take turns, and only
        the active one's window counts. ``task`` is the name stamped on every
        prompt; ``seed`` drives the per-epoch shuffle and the stages' draws; ``metrics_path`` (a
        JSONL file) receives the curator's counters."""
        if not rows:
            raise ValueError("the curator needs at least one dataset row")
        self.kafka, self.topics, self.workflow, self.config = kafka, topics, workflow, config
        self._control: ControlReader | None = None  # the run's control topic, once run() reads it
        self.admission = Admission(windows, turns)
        self.group_size = group_size
        self.rows, self.task, self.metrics_path = list(rows), task, metrics_path
        self.stages = build_prompt_stages(stages or [])
        self.stats = CuratorStats()
        self.data = DataCursor(self.rows, seed, self.stages, self.stats)
        # prompt id -> (its record, its headers, the policies whose trainers have not announced taking its group)
        self._outstanding: dict[str, tuple[bytes, list[tuple[str, bytes]], set[str]]] = {}

    @property
    def window(self) -> int:
        """Largest number of prompts in flight: the tightest policy's (η + 1) × groups per step."""
        return self.admission.window

    def _catch_up(self) -> None:
        """A trainer that consumed more prompts than this workflow's topic ever held resumed on a new
        broker (the old log is gone): count those as dispatched, and go on in the data from there,
        so in flight (dispatched − consumed) never goes negative and opens the window wide."""
        consumed = max(s.consumed for s in self.admission.policies.values())
        if consumed > self.stats.dispatched:
            logger.warning("curator: the trainers consumed %d prompts, %d were dispatched on this broker (a resumed "
                           "run on a new one): dispatching on from %d", consumed, self.stats.dispatched, consumed)
            self.stats.dispatched = self.stats.cursor = consumed

    def _settle(self, record: ControlRecord) -> None:
        """Stop tracking the prompts whose groups a trainer announced it took off its topic."""
        for prompt_id in record.consumed_ids:
            entry = self._outstanding.get(prompt_id)
            if entry is not None:
                entry[2].discard(record.policy)
                if not entry[2]:
                    del self._outstanding[prompt_id]

    def _redispatch(self, producer: Producer, topic: str) -> None:
        """The broker lost its log (prompts, groups, announcements): recreate the run's topics and
        dispatch again, under their own ids, the prompts no trainer still running has announced
        taking (a trainer that already trained one drops the copy by its group id). They are not
        counted as new dispatches: in flight stays what it was."""
        self.stats.broker_losses += 1
        ensure_run_topics(self.kafka, self.topics, [self.workflow], list(self.admission.policies))
        running = {name for name, s in self.admission.policies.items() if not s.finished}
        again = [(pid, value, headers) for pid, (value, headers, pending) in self._outstanding.items() if pending & running]
        logger.warning("curator: the broker lost its log; dispatching %d prompts again that no trainer took yet",
                       len(again))
        sent = []
        for prompt_id, value, headers in again:  # the same trace: its dispatch span is the first attempt's
            partition = self.router.choose(time.monotonic())
            sent.append(producer.produce(topic, value, key=prompt_id.encode(), partition=partition, headers=headers))
            self.router.dispatched(prompt_id, partition, time.monotonic())
        producer.flush(30)
        for delivery in sent:
            delivery.result()
        self.stats.redispatched += len(again)
        metrics.counter("rlbus.curator.redispatched", "{prompt}", "Prompts dispatched again after the broker lost "
                        "its log").add(len(again), {"workflow": self.workflow})

    def control_floors(self, policies: list[str]) -> dict[tuple[str, int], int]:
        """How far the control topic may be trimmed (``broker.retention``): a curator started again reads
        it from the beginning for the latest record of each of the run's ``policies`` (and the stop), so
        everything below the oldest of those may go; nothing before this curator read one of each."""
        control = self._control
        floor = None if control is None else control.floor(policies)
        return {} if floor is None else {(self.topics.control, 0): floor}

    def _already_dispatched(self) -> int:
        """Prompts this run dispatched before (restart): the prompt topic's record count."""
        return sum(end_offsets(self.kafka, self.topics.prompts(self.workflow)).values())

    def _record(self, row: Row) -> PromptRecord:
        versions = self.admission.dispatch_versions()
        return PromptRecord(
            run=self.topics.run,
            policy=self.workflow,
            prompt_id=f"p{self.stats.dispatched}",
            prompt_key=row.key,
            task=self.task,
            prompt=row.prompt,
            messages=None if row.messages is None else [dict(m) for m in row.messages],
            answer=row.answer,
            group_size=self.group_size,
            dispatch_version=versions[self.admission.primary],
            dispatch_versions=versions,
        )

    def _dispatch_span(self, record: PromptRecord, partition: int) -> list[tuple[str, bytes]]:
        """Start the prompt's trace: its dispatch span, whose context the record's headers carry."""
        attributes = {"rlbus.prompt_id": record.prompt_id, "rlbus.prompt_key": record.prompt_key or "",
                      "rlbus.workflow": self.workflow, "rlbus.partition": partition,
                      "rlbus.dispatch_version": record.dispatch_version}
        with tracer().start_as_current_span("curator.dispatch", context=Context(), attributes=attributes):
            parent = traceparent()
        return [] if parent is None else [(TRACEPARENT, parent.encode())]

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {
            "dispatched": s.dispatched, "consumed": s.consumed, "trainer_version": s.trainer_version,
            "cursor": s.cursor, "skipped": s.skipped, "forced": s.forced, "feedback_groups": s.feedback,
            "broker_losses": s.broker_losses, "redispatched": s.redispatched, "outstanding": len(self._outstanding),
            **{f"stage/{k}": v for k, v in stage_metrics(self.stages).items()},
            **{f"routing/{k}": v for k, v in self.router.report().items()},
        }

    def _report(self) -> None:
        row = {"time": time.time(), **self.metrics()}
        logger.info("curator: %s", {k: v for k, v in row.items() if not k.startswith("routing/worker")})
        if self.metrics_path is not None:
            with open(self.metrics_path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")

    def _feedback(self, feedback: FeedbackReader) -> None:
        now = time.monotonic()
        for header in feedback.poll(0):
            self.stats.feedback += 1
            self.router.returned(header.prompt_id, header.worker_id, header.created_at, header.published_at, now)
            if header.prompt_key is not None:
                observe_prompt(self.stages, header.prompt_key, header.rewards)

    def run(self, should_stop) -> CuratorStats:
        """Dispatch until the run's stop record, the dataset's end, or ``should_stop()``."""
        topic = self.topics.prompts(self.workflow)
        partitions = topic_partitions(self.kafka, topic, timeout_s=30)
        producer = Producer(self.kafka, name="prompts")
        self.router = build_router(self.config.routing, partitions)
        control = self._control = ControlReader(self.kafka, self.topics, from_beginning=True)
        feedback = FeedbackReader(self.kafka, self.topics, self.admission.primary)
        self.stats.dispatched = self.stats.cursor = self._already_dispatched()
        limit = None if self.config.epochs is None else self.config.epochs * len(self.rows)
        logger.info("curator: %d prompts, window %d, %d partitions routed by %s, resuming at %d",
                    len(self.rows), self.window, partitions, self.config.routing.type, self.stats.dispatched)
        next_report = time.monotonic() + self.config.report_every_s
        try:
            while not should_stop():
                for record in control.poll(self.config.poll_interval_s):
                    self.admission.observe(record)
                    self._settle(record)
                if control.log_losses > self.stats.broker_losses:
                    self._redispatch(producer, topic)
                self._catch_up()
                if control.stopped is not None:
                    logger.info("curator: run stopped (%s)", control.stopped.reason)
                    break
                if self.admission.all_finished:
                    logger.info("curator: the trainers of %s finished", ", ".join(self.admission.policies))
                    break
                self.stats.consumed = self.admission.consumed
                self.stats.trainer_version = self.admission.policies[self.admission.primary].version
                self._feedback(feedback)
                free = self.admission.free(self.stats.dispatched)
                sent = []
                while len(sent) < free and (row := self.data.next(limit)) is not None:
                    record = self._record(row)
                    partition = self.router.choose(time.monotonic())
                    value = encode_prompt(record)
                    headers = self._dispatch_span(record, partition)
                    sent.append(producer.produce(topic, value, key=record.prompt_id.encode(), partition=partition,
                                                 headers=headers))
                    self._outstanding[record.prompt_id] = (value, headers, set(self.admission.policies))
                    self.router.dispatched(record.prompt_id, partition, time.monotonic())
                    self.stats.dispatched += 1
                if sent:
                    producer.flush(30)
                    for delivery in sent:
                        delivery.result()  # a prompt the broker did not take stops the curator
                    metrics.counter("rlbus.curator.dispatched", "{prompt}", "Prompts dispatched").add(
                        len(sent), {"workflow": self.workflow})
                metrics.gauge("rlbus.curator.in_flight", "{prompt}", "Prompts dispatched and not consumed").set(
                    self.stats.dispatched - self.stats.consumed, {"workflow": self.workflow})
                if limit is not None and self.stats.cursor >= limit and self.stats.consumed >= self.stats.dispatched:
                    logger.info("curator: dataset exhausted after %d prompts (%d dispatched)", limit, self.stats.dispatched)
                    break
                if time.monotonic() >= next_report:
                    self._report()
                    next_report = time.monotonic() + self.config.report_every_s
        finally:
            producer.close(STOP_WAIT_S)
            control.close()
            feedback.close()
        self._report()
        return self.stats
