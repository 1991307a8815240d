"""The producer of the Kafka layer: records out, each with a future of its acknowledgement.

librdkafka sends in the background and pipelines requests (bytes in flight, not round trips); a
thread of this object serves its delivery reports and completes each record's future. ``produce``
returns a ``concurrent.futures.Future``, ``send`` the same as an asyncio future, ``send_and_wait``
blocks until the broker acknowledged. Thread-safe.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass

from confluent_kafka import KafkaException

from broker.errors import BrokerError, BrokerUnavailable, DeliveryFailed
from broker.librdkafka import broker_error, new_producer
from broker.settings import KafkaConfig

logger = logging.getLogger(__name__)

Headers = list[tuple[str, bytes]]

_SERVE_S = 0.05
_QUEUE_FULL_WAIT_S = 60.0


@dataclass(frozen=True)
class Delivered:
    """Where the broker stored an acknowledged record."""

    topic: str
    partition: int
    offset: int


class Producer:
    """Sends records to any topic of the broker ``kafka`` names."""

    def __init__(self, kafka: KafkaConfig, *, name: str = "producer") -> None:
        self.address = kafka.bootstrap_servers
        self._producer = new_producer(kafka.producer_conf())
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kafka-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            self._producer.poll(_SERVE_S)  # runs the delivery callbacks

    def produce(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers | None = None,
        partition: int | None = None,
    ) -> Future[Delivered]:
        """Queue one record; the future completes when the broker acknowledged it, or fails with
        ``DeliveryFailed``. Waits (up to a minute) while librdkafka's queue is full."""
        if self._closed.is_set():
            raise BrokerError(f"producer to {self.address} is closed; cannot send to {topic}")
        future: Future[Delivered] = Future()

        def delivered(err, msg) -> None:  # on this object's thread
            if err is not None:
                future.set_exception(DeliveryFailed(topic, err.str(), retriable=bool(err.retriable())))
            else:
                future.set_result(Delivered(msg.topic(), msg.partition(), msg.offset()))

        extra = {} if partition is None else {"partition": partition}
        deadline = time.monotonic() + _QUEUE_FULL_WAIT_S
        while True:
            try:
                self._producer.produce(topic, value, key, headers=headers, on_delivery=delivered, **extra)
                return future
            except BufferError:  # librdkafka's queue is full: wait for acknowledgements
                if time.monotonic() > deadline:
                    raise BrokerUnavailable(self.address or "?", f"producer queue to {topic} stayed full "
                                            f"for {_QUEUE_FULL_WAIT_S:.0f} s") from None
                time.sleep(0.01)
            except KafkaException as exc:
                raise broker_error(exc, f"producing to {topic}", self.address) from None

    def send(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers | None = None,
        partition: int | None = None,
    ) -> asyncio.Future[Delivered]:
        """``produce`` for asyncio code: an awaitable of the acknowledgement (call it on the loop)."""
        return asyncio.wrap_future(self.produce(topic, value, key=key, headers=headers, partition=partition))

    def send_and_wait(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers | None = None,
        partition: int | None = None, timeout_s: float = 30.0,
    ) -> Delivered:
        """Send one record and block until it is acknowledged."""
        future = self.produce(topic, value, key=key, headers=headers, partition=partition)
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            raise DeliveryFailed(topic, f"no acknowledgement within {timeout_s:g} s") from None

    def flush(self, timeout_s: float = 30.0) -> None:
        """Block until every queued record was acknowledged or failed (their futures say which);
        raise ``DeliveryFailed`` when some are still pending after ``timeout_s``."""
        if self._closed.is_set():
            return  # close flushed already
        left = self._producer.flush(timeout_s)
        if left:
            raise DeliveryFailed("the broker", f"{left} record(s) still unacknowledged after {timeout_s:g} s")

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush what is queued (logged, not raised, when it cannot be), then stop. Safe to call twice."""
        if self._closed.is_set():
            return
        left = self._producer.flush(timeout_s)
        if left:
            logger.warning("closing a producer with %d record(s) unacknowledged after %.0f s", left, timeout_s)
        self._closed.set()
        self._thread.join(timeout=5)
        # Release librdkafka's handle now, not whenever the object is collected: a live handle keeps
        # reconnecting to a broker that may be gone.
        del self._producer
