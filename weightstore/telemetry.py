"""A trainer's metrics in the run's object store, for operators and reports that have no access
to the trainer's disk (a compose or Kubernetes run): the trainer writes them, ``rlbus status``
and ``rlbus report --store`` read them there. The rows are the trainer's ``metrics.jsonl`` rows;
this module only stores and reads them.

Layout under ``<policy>/telemetry/``:

* ``metrics/<first version, 8 digits>.jsonl``: the metrics rows (as in the run directory's
  ``metrics.jsonl``) in segments of ``SEGMENT_ROWS``; a segment is written again as it grows, and a
  restarted trainer starts a new one at its first version (versions only move forward, so it never
  overwrites what an earlier trainer wrote);
* ``status.json``: the newest figures (version, step, wait fraction and groups/s over the recent
  steps, live workers, propagation), written with each segment.

Writes happen at most every ``every_s`` seconds and at close; a failed write is logged and retried
with the next one: telemetry never holds up training.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from collections.abc import Callable

from weightstore.errors import NotFound, StoreError
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

SEGMENT_ROWS = 100
RECENT_ROWS = 20
"""Steps the status's rates are taken over."""


def metrics_prefix(policy: str) -> str:
    return f"{policy}/telemetry/metrics/"


def status_key(policy: str) -> str:
    return f"{policy}/telemetry/status.json"


def status_of(rows: list[dict], *, max_steps: int | None = None) -> dict:
    """The status document of a trainer whose newest metrics rows are ``rows``."""
    last, recent = rows[-1], rows[-RECENT_ROWS:]
    wall = sum(r["step_wall_s"] for r in recent)
    return {
        "policy": last["policy"], "version": last["version"], "step": last.get("step", last["version"]),
        "max_steps": max_steps, "time": last["time"],
        "wait_fraction": sum(r["wait_s"] for r in recent) / wall if wall > 0 else None,
        "groups_per_s": sum(r["groups"] for r in recent) / wall if wall > 0 else None,
        "live_workers": last.get("live_workers"), "propagation_s": last.get("propagation_s"),
        "propagated_version": last.get("propagated_version"), "reward_mean": last.get("reward_mean"),
    }


class StoreTelemetry:
    """Mirrors one trainer's metrics rows into the store."""

    def __init__(self, store: ObjectStore, policy: str, *, max_steps: int | None = None, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.policy, self.max_steps, self.every_s, self.clock = store, policy, max_steps, every_s, clock
        self._segment: list[dict] = []
        self._recent: collections.deque[dict] = collections.deque(maxlen=RECENT_ROWS)
        self._dirty = False
        self._last = -float("inf")

    def add(self, row: dict) -> None:
        if len(self._segment) >= SEGMENT_ROWS and self._flush():  # a full segment is dropped only once written
            self._segment = []
        self._segment.append(row)
        self._recent.append(row)
        self._dirty = True
        if self.clock() - self._last >= self.every_s:
            self._flush()

    def close(self) -> None:
        self._flush()

    def _flush(self) -> bool:
        """Write the segment and the status; False when the store refused (retried with the next row)."""
        if not self._dirty or not self._segment:
            return True
        key = f"{metrics_prefix(self.policy)}{self._segment[0]['version']:08d}.jsonl"
        body = "".join(json.dumps(r) + "\n" for r in self._segment).encode()
        try:
            self.store.put(key, body)
            self.store.put(status_key(self.policy), json.dumps(status_of(list(self._recent), max_steps=self.max_steps)).encode())
        except StoreError as exc:
            logger.warning("writing the trainer's metrics to the store failed (%s); retrying with the next ones", exc)
            return False
        self._dirty, self._last = False, self.clock()
        return True


def read_store_metrics(store: ObjectStore, policy: str) -> list[dict]:
    """Every metrics row a trainer of ``policy`` mirrored into ``store``, in version order."""
    rows: list[dict] = []
    for key in sorted(store.list(metrics_prefix(policy))):
        text = store.get(key).data.decode()
        rows.extend(json.loads(line) for line in text.splitlines() if line.strip())
    return sorted(rows, key=lambda r: r["version"])


def read_status(store: ObjectStore, policy: str) -> dict | None:
    """The newest status a trainer of ``policy`` wrote, or None."""
    try:
        return json.loads(store.get(status_key(policy)).data)
    except NotFound:
        return None
