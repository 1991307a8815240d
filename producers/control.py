"""Listener for ``<run>.control``: version announcements (wake the weight poller) and stop."""

from __future__ import annotations

import asyncio
import logging

from aiokafka import AIOKafkaConsumer, TopicPartition

from broker.control import CONTROL_PARTITIONS, decode_control
from broker.errors import RecordError
from broker.settings import KafkaConfig
from broker.topics import Topics

logger = logging.getLogger(__name__)


class ControlListener:
    """Reads control records published after it started (no consumer group: every reader sees all)."""

    def __init__(self, kafka: KafkaConfig, topics: Topics, policy: str) -> None:
        self.kafka, self.topics, self.policy = kafka, topics, policy
        self.version_announced = asyncio.Event()
        self.stopped = asyncio.Event()
        self.latest_version: int | None = None
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        kwargs = self.kafka.aiokafka_consumer_kwargs(group_id=None, advisory=True)
        kwargs["auto_offset_reset"] = "latest"
        self._consumer = AIOKafkaConsumer(**kwargs)
        await self._consumer.start()
        parts = [TopicPartition(self.topics.control, p) for p in range(CONTROL_PARTITIONS)]
        self._consumer.assign(parts)
        await self._consumer.seek_to_end(*parts)
        self._task = asyncio.create_task(self._listen())

    async def _listen(self) -> None:
        async for message in self._consumer:
            try:
                record = decode_control(message.value)
            except RecordError as exc:
                # Control is advisory (the store is the source of truth): skip what we cannot read.
                logger.warning("skipping control record at offset %d: %s", message.offset, exc)
                continue
            if record.run != self.topics.run:
                continue
            if record.kind == "stop":
                self.stopped.set()
            elif record.policy == self.policy:
                self.latest_version = max(self.latest_version or 0, record.version)
                self.version_announced.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()
