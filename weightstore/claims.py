"""Claim check: trajectory groups too large for a Kafka record travel through the object store.

A worker whose encoded group is over ``kafka.max_message_bytes`` writes the bytes to the run's
store under ``claims/<unix seconds>-<sha256>`` (content-addressed, written once) and publishes a
small ``ClaimRecord`` in their place. The trainer's intake fetches the object, checks its size and
SHA-256 against the record (a tampered or missing object costs that record: DLQ), and decodes it as
it would the record itself, signature included. Once the offsets past a claim are committed the
trainer deletes its object; objects whose record never arrived (a worker that died between the
two writes) are deleted by ``sweep`` once older than the retention.
"""

from __future__ import annotations

import hashlib
import logging
import time

from broker.errors import RecordError
from broker.schema import ClaimRecord
from weightstore.errors import NotFound, PreconditionFailed
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

PREFIX = "claims/"


def put_claim(store: ObjectStore, *, run: str, policy: str, group_id: str, data: bytes,
              now: float | None = None) -> ClaimRecord:
    """Store ``data`` (an encoded group) and return the record that stands for it."""
    sha = hashlib.sha256(data).hexdigest()
    key = f"{PREFIX}{int(time.time() if now is None else now)}-{sha}"
    try:
        store.put(key, data, if_none_match=True)
    except PreconditionFailed:
        pass  # the same bytes under the same name: already there
    return ClaimRecord(run=run, policy=policy, group_id=group_id, key=key, sha256=sha, size=len(data))


def fetch_claim(store: ObjectStore, claim: ClaimRecord) -> bytes:
    """The stored bytes of ``claim``, checked; ``RecordError`` when missing or not the claimed bytes."""
    if not claim.key.startswith(PREFIX) or not claim.key.endswith(claim.sha256):
        raise RecordError(f"claim names {claim.key!r}, not a claim object of sha256 {claim.sha256[:12]}…")
    try:
        data = store.get(claim.key).data
    except NotFound:
        raise RecordError(f"claim-checked object {claim.key} is missing from {store.describe()}") from None
    if len(data) != claim.size or hashlib.sha256(data).hexdigest() != claim.sha256:
        raise RecordError(f"claim-checked object {claim.key} does not match its record (size {len(data)}, "
                          f"claimed {claim.size}): tampered or damaged")
    return data


def sweep(store: ObjectStore, max_age_s: float, now: float | None = None) -> int:
    """Delete claim objects older than ``max_age_s`` (orphans); returns how many."""
    cutoff = (time.time() if now is None else now) - max_age_s
    removed = 0
    for key in store.list(PREFIX):
        stamp = key[len(PREFIX):].split("-", 1)[0]
        if stamp.isdigit() and int(stamp) < cutoff:
            store.delete(key)
            removed += 1
    if removed:
        logger.info("deleted %d claim-checked objects older than %.0f s from %s", removed, max_age_s, store.describe())
    return removed
