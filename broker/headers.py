"""Kafka record headers: routing facts readable without decoding the value, the W3C trace
context, and the dead-letter details.

Header values are UTF-8 bytes. ``parse_headers`` reads what librdkafka hands out (a list of
``(str, bytes | None)``, or None when a record has no headers) into ``{name: text}``.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping

from broker.schema import TrajectoryHeader

logger = logging.getLogger(__name__)

SCHEMA_VERSION = "rlbus-schema-version"
POLICY = "rlbus-policy"
MIN_VERSION = "rlbus-min-version"
TRACEPARENT = "traceparent"
DLQ_REASON = "rlbus-dlq-reason"
DLQ_SOURCE_TOPIC = "rlbus-dlq-source-topic"
DLQ_SOURCE_PARTITION = "rlbus-dlq-source-partition"
DLQ_SOURCE_OFFSET = "rlbus-dlq-source-offset"
DLQ_REJECTED_AT = "rlbus-dlq-rejected-at"
DLQ_OMITTED_BYTES = "rlbus-dlq-omitted-bytes"
"""Set when the rejected record was too large to copy: its size; the bytes stay at the source offset."""

MAX_REASON_CHARS = 2000
"""DLQ reasons are cut to this many characters so headers stay small."""

_TRACEPARENT = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")

Headers = Iterable[tuple[str, bytes | None]] | Mapping[str, bytes | str | None] | None


def is_traceparent(value: str) -> bool:
    """True when ``value`` has the W3C ``traceparent`` shape (version-traceid-spanid-flags)."""
    if not _TRACEPARENT.fullmatch(value):
        return False
    _, trace_id, span_id, _ = value.split("-")
    return value[:2] != "ff" and trace_id != "0" * 32 and span_id != "0" * 16


def group_headers(header: TrajectoryHeader, traceparent: str | None) -> list[tuple[str, bytes]]:
    """Headers of a trajectory-group record. A malformed ``traceparent`` is left out (logged):
    tracing never blocks publishing."""
    out = [
        (SCHEMA_VERSION, str(header.schema_version).encode()),
        (POLICY, header.policy.encode()),
        (MIN_VERSION, str(header.min_version).encode()),
    ]
    if traceparent is not None:
        if is_traceparent(traceparent):
            out.append((TRACEPARENT, traceparent.encode()))
        else:
            logger.warning("dropping malformed traceparent %r of group %s", traceparent, header.group_id)
    return out


def dlq_headers(reason: str, source_topic: str, partition: int, offset: int,
                omitted_bytes: int | None = None) -> list[tuple[str, bytes]]:
    """Headers of a dead-letter record: why it was rejected and where it came from (and, when the
    record was too large to copy, its size)."""
    if len(reason) > MAX_REASON_CHARS:
        reason = reason[: MAX_REASON_CHARS - 3] + "..."
    headers = [
        (DLQ_REASON, reason.encode()),
        (DLQ_SOURCE_TOPIC, source_topic.encode()),
        (DLQ_SOURCE_PARTITION, str(int(partition)).encode()),
        (DLQ_SOURCE_OFFSET, str(int(offset)).encode()),
        (DLQ_REJECTED_AT, f"{time.time():.3f}".encode()),
    ]
    if omitted_bytes is not None:
        headers.append((DLQ_OMITTED_BYTES, str(int(omitted_bytes)).encode()))
    return headers


def parse_headers(headers: Headers) -> dict[str, str]:
    """Headers as ``{name: text}``; a repeated name keeps its last value, a null value reads ''."""
    if headers is None:
        return {}
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    for key, value in items:
        if value is None:
            out[key] = ""
        elif isinstance(value, str):
            out[key] = value
        else:
            out[key] = bytes(value).decode("utf-8", errors="replace")
    return out
