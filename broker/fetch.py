"""Reading a confluent-kafka consumer without waiting for a full batch.

``Consumer.consume(num_messages=n, timeout=t)`` returns only when n messages arrived or t passed,
so a consumer that asks for 64 records on a topic carrying a few waits the whole ``t`` on every
call. ``consume_available`` waits at most ``timeout_s`` for the first message, then takes what the
client has already fetched, without waiting again.
"""

from __future__ import annotations

from confluent_kafka import Consumer, Message


def consume_available(consumer: Consumer, max_records: int, timeout_s: float) -> list[Message]:
    """Up to ``max_records`` messages: the first within ``timeout_s``, the rest only if already here."""
    first = consumer.poll(timeout_s)
    if first is None:
        return []
    if max_records <= 1:
        return [first]
    return [first, *consumer.consume(num_messages=max_records - 1, timeout=0)]
