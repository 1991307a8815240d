"""The curator: reads a dataset and dispatches prompts under admission control (guard 1).

In-flight prompts = dispatched − consumed by the trainer (trained, dropped stale or rejected, as
announced on the control topic). The curator never lets that exceed (η + 1) × groups per step, so
no prompt can be generated with weights older than the staleness budget allows (AReaL's rule).
With η = 0 this is synchronous training: the next batch is dispatched only after the step that
consumed the previous one was published.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

from confluent_kafka import KafkaException, Producer
from pydantic import BaseModel, Field

from broker.admin import end_offsets
from broker.codec import encode_prompt
from broker.schema import PromptRecord
from broker.settings import KafkaConfig
from broker.topics import Topics
from consumers.control import ControlReader

logger = logging.getLogger(__name__)


class CuratorConfig(BaseModel):
    """Settings of the prompt curator."""

    dataset_path: str = Field(description="JSONL file with one {prompt_id, prompt, answer} per line.")
    task: str = Field(description="Environment that scores this dataset's prompts.")
    epochs: int | None = Field(default=None, ge=1, description="Passes over the data; None = until stopped.")
    seed: int = Field(default=0, description="Seed of the per-epoch shuffle.")
    poll_interval_s: float = Field(default=0.05, gt=0, description="Control-topic poll wait, seconds.")


class DatasetError(ValueError):
    retriable = False


def read_prompts(path: Path) -> list[dict]:
    """Read a JSONL prompt dataset; every malformed line is reported with its number."""
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append({"prompt": str(row["prompt"]), "answer": str(row["answer"])})
            except (ValueError, KeyError, TypeError) as exc:
                raise DatasetError(
                    f"{path}:{lineno}: expected a JSON object with 'prompt' and 'answer' ({exc})"
                ) from exc
    if not rows:
        raise DatasetError(f"{path} holds no prompts")
    return rows


@dataclass
class CuratorStats:
    dispatched: int = 0
    consumed: int = 0
    trainer_version: int = 0


class Curator:
    """Dispatches prompts of one policy to ``<run>.prompts.<policy>``."""

    def __init__(
        self,
        kafka: KafkaConfig,
        topics: Topics,
        policy: str,
        config: CuratorConfig,
        *,
        group_size: int,
        groups_per_step: int,
        max_staleness: int,
    ) -> None:
        self.kafka, self.topics, self.policy, self.config = kafka, topics, policy, config
        self.group_size, self.groups_per_step, self.max_staleness = group_size, groups_per_step, max_staleness
        self.rows = read_prompts(Path(config.dataset_path))
        self.stats = CuratorStats()

    @property
    def window(self) -> int:
        """Largest number of prompts in flight: (η + 1) × groups per step."""
        return (self.max_staleness + 1) * self.groups_per_step

    def _already_dispatched(self) -> int:
        """Prompts this run dispatched before (restart): the prompt topic's record count."""
        return sum(end_offsets(self.kafka, self.topics.prompts(self.policy)).values())

    def _prompt(self, index: int) -> PromptRecord:
        epoch, pos = divmod(index, len(self.rows))
        order = list(range(len(self.rows)))
        random.Random(self.config.seed * 1_000_003 + epoch).shuffle(order)
        row = self.rows[order[pos]]
        return PromptRecord(
            run=self.topics.run,
            policy=self.policy,
            prompt_id=f"p{index}",
            task=self.config.task,
            prompt=row["prompt"],
            answer=row["answer"],
            group_size=self.group_size,
            dispatch_version=self.stats.trainer_version,
        )

    def run(self, should_stop) -> CuratorStats:
        """Dispatch until the run's stop record, the dataset's end, or ``should_stop()``."""
        producer = Producer(self.kafka.confluent_producer_conf())
        control = ControlReader(self.kafka, self.topics, from_beginning=True)
        self.stats.dispatched = self._already_dispatched()
        limit = None if self.config.epochs is None else self.config.epochs * len(self.rows)
        topic = self.topics.prompts(self.policy)
        logger.info("curator: %d prompts, window %d, resuming at %d", len(self.rows), self.window, self.stats.dispatched)
        try:
            while not should_stop():
                control.poll(self.config.poll_interval_s)
                if control.stopped is not None:
                    logger.info("curator: run stopped (%s)", control.stopped.reason)
                    break
                if (state := control.latest.get(self.policy)) is not None:
                    self.stats.consumed = state.groups_consumed
                    self.stats.trainer_version = state.version
                free = self.window - (self.stats.dispatched - self.stats.consumed)
                if limit is not None:
                    free = min(free, limit - self.stats.dispatched)
                    if free <= 0 and self.stats.dispatched >= limit and self.stats.consumed >= limit:
                        logger.info("curator: dataset exhausted after %d prompts", limit)
                        break
                for _ in range(max(free, 0)):
                    record = self._prompt(self.stats.dispatched)
                    producer.produce(topic, value=encode_prompt(record), key=record.prompt_id.encode())
                    self.stats.dispatched += 1
                if free > 0 and producer.flush(30) != 0:
                    raise KafkaException(f"prompts to {topic} not acknowledged within 30s")
        finally:
            producer.flush(30)
            control.close()
        return self.stats
