"""The producer of the Kafka layer: records out, each with a future of its acknowledgement.

librdkafka sends in the background and pipelines requests (bytes in flight, not round trips); a
thread of this object serves its delivery reports and completes each record's future. ``produce``
returns a ``concurrent.futures.Future``, ``send`` the same as an asyncio future, ``send_and_wait``
blocks until the broker acknowledged. Thread-safe.

A record the broker refused with a fault of its own (``SERVER_FAULTS``: Tansu answers "Unknown
broker error" while the object store under its log is down; Kafka's storage and replica errors) is
sent again, with a growing pause, while ``kafka.delivery_timeout_ms`` since it was first produced
has not passed: librdkafka retries only what it deems retriable, and an outage of the broker's
storage is one a role should ride through. Only then does its future fail (a resend made just
before that may take its own librdkafka timeout: twice ``delivery_timeout_ms`` at the most). A
resent record the broker did store before refusing is a duplicate, which downstream removes by
group id (as for librdkafka's own retries).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException

from broker.errors import BrokerError, BrokerUnavailable, DeliveryFailed
from broker.librdkafka import broker_error, new_producer
from broker.settings import KafkaConfig

logger = logging.getLogger(__name__)

Headers = list[tuple[str, bytes]]

_SERVE_S = 0.05
_QUEUE_FULL_WAIT_S = 60.0
_RESEND_PAUSE_S = (0.2, 5.0)  # the first pause before a resend, and the longest

SERVER_FAULTS = frozenset({
    KafkaError.UNKNOWN, KafkaError.KAFKA_STORAGE_ERROR, KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.NOT_ENOUGH_REPLICAS_AFTER_APPEND, KafkaError.REQUEST_TIMED_OUT, KafkaError.NETWORK_EXCEPTION,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
})  # fmt: skip
"""Delivery errors after which the same record is sent again (as are those librdkafka calls retriable)."""


def _settle(future: Future, *, result: Delivered | None = None, error: BaseException | None = None) -> None:
    """Complete ``future`` unless its waiter cancelled it meanwhile (a worker that gave up on a batch):
    completing a cancelled future raises, and on the serving thread that would stop every later report."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass


@dataclass(frozen=True)
class Delivered:
    """Where the broker stored an acknowledged record."""

    topic: str
    partition: int
    offset: int


@dataclass
class _Record:
    """One record until the broker acknowledges it or its time is up."""

    topic: str
    value: bytes
    key: bytes | None
    headers: Headers | None
    partition: int | None
    future: Future
    deadline: float
    sends: int = 0
    last_error: str = field(default="")


class Producer:
    """Sends records to any topic of the broker ``kafka`` names."""

    def __init__(self, kafka: KafkaConfig, *, name: str = "producer") -> None:
        self.address = kafka.bootstrap_servers
        self.resent = 0
        """Records sent again after a fault of the broker (``SERVER_FAULTS``)."""
        self._delivery_s = kafka.delivery_timeout_ms / 1000
        self._producer = new_producer(kafka.producer_conf())
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._due: list[tuple[float, int, _Record]] = []  # resends, by when
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._serve, name=f"kafka-{name}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            self._producer.poll(_SERVE_S)  # runs the delivery callbacks
            self._resend_due()

    def produce(
        self, topic: str, value: bytes, *, key: bytes | None = None, headers: Headers | None = None,
        partition: int | None = None,
    ) -> Future[Delivered]:
        """Queue one record; the future completes when the broker acknowledged it, or fails with
        ``DeliveryFailed`` (after the resends the module describes). Waits (up to a minute) while
        librdkafka's queue is full."""
        if self._closed.is_set():
            raise BrokerError(f"producer to {self.address} is closed; cannot send to {topic}")
        record = _Record(topic, value, key, headers, partition, Future(),
                         deadline=time.monotonic() + self._delivery_s)
        deadline = time.monotonic() + _QUEUE_FULL_WAIT_S
        while not self._submit(record):  # librdkafka's queue is full: wait for acknowledgements
            if time.monotonic() > deadline:
                raise BrokerUnavailable(self.address or "?", f"producer queue to {topic} stayed full "
                                        f"for {_QUEUE_FULL_WAIT_S:.0f} s") from None
            time.sleep(0.01)
        return record.future

    def _submit(self, record: _Record) -> bool:
        """Hand ``record`` to librdkafka; False while its queue is full. Raises what it refuses."""
        extra = {} if record.partition is None else {"partition": record.partition}
        try:
            self._producer.produce(record.topic, record.value, record.key, headers=record.headers,
                                   on_delivery=lambda err, msg: self._delivered(record, err, msg), **extra)
        except BufferError:
            return False
        except KafkaException as exc:
            raise broker_error(exc, f"producing to {record.topic}", self.address) from None
        record.sends += 1
        return True

    def _delivered(self, record: _Record, err: KafkaError | None, msg) -> None:
        """librdkafka's report on ``record`` (on whichever thread polled): done, failed, or due again."""
        if record.future.done():
            return  # its waiter gave up on it (cancelled): nothing is told
        if err is None:
            _settle(record.future, result=Delivered(msg.topic(), msg.partition(), msg.offset()))
            return
        record.last_error = err.str()
        pause = min(_RESEND_PAUSE_S[0] * 2 ** (record.sends - 1), _RESEND_PAUSE_S[1])
        again = (err.retriable() or err.code() in SERVER_FAULTS) and not err.fatal()
        if not again or self._closed.is_set() or time.monotonic() + pause > record.deadline:
            detail = f"{err.str()} (sent {record.sends} time{'s' if record.sends != 1 else ''})"
            _settle(record.future, error=DeliveryFailed(record.topic, detail, retriable=again))
            return
        if record.sends == 1:
            logger.warning("the broker at %s refused a record to %s (%s); sending it again for up to %.0f s",
                           self.address, record.topic, err.str(), record.deadline - time.monotonic())
        with self._lock:
            heapq.heappush(self._due, (time.monotonic() + pause, next(self._order), record))

    def _resend_due(self) -> None:
        now = time.monotonic()
        while True:
            with self._lock:
                if not self._due or self._due[0][0] > now:
                    return
                _, _, record = heapq.heappop(self._due)
            try:
                sent = self._submit(record)
            except BrokerError as exc:
                _settle(record.future, error=DeliveryFailed(record.topic, f"{record.last_error}; then {exc}"))
                continue
            if not sent:  # the queue is full: the next turn
                with self._lock:
                    heapq.heappush(self._due, (now + _SERVE_S, next(self._order), record))
                return
            self.resent += 1

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
        left = self._drain(timeout_s)
        if left:
            raise DeliveryFailed("the broker", f"{left} record(s) still unacknowledged after {timeout_s:g} s")

    def _drain(self, timeout_s: float) -> int:
        """Wait until nothing is queued in librdkafka or due for a resend; how many are left."""
        deadline = time.monotonic() + timeout_s
        while True:
            queued = self._producer.flush(max(0.0, min(_SERVE_S * 4, deadline - time.monotonic())))
            with self._lock:
                left = queued + len(self._due)
            if not left or time.monotonic() >= deadline:
                return left
            if not queued:
                time.sleep(_SERVE_S)  # resends wait for their pause

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush what is queued (logged, not raised, when it cannot be), then stop. Safe to call twice."""
        if self._closed.is_set():
            return
        left = self._drain(timeout_s)
        if left:
            logger.warning("closing a producer with %d record(s) unacknowledged after %.0f s", left, timeout_s)
        self._closed.set()
        self._thread.join(timeout=5)
        with self._lock:
            unsent, self._due = self._due, []
        for _, _, record in unsent:
            _settle(record.future, error=DeliveryFailed(record.topic, f"{record.last_error}; the producer closed"))
        # Release librdkafka's handle now, not whenever the object is collected: a live handle keeps
        # reconnecting to a broker that may be gone.
        del self._producer
