"""The control topic ``<run>.control``: version announcements and the end of the run.

Announcements are a fast path beside the weightstore, which stays the source of truth for
versions; ``ControlReader`` is the one reader every role uses (the curator from the beginning, to
learn what the trainer consumed; workers from the end, to wake their weight follower).
"""

from __future__ import annotations

import json
import logging

from pydantic import ValidationError

from broker.errors import RecordError
from broker.producer import Producer
from broker.reader import PartitionReader
from broker.schema import ControlRecord
from broker.settings import KafkaConfig
from broker.topics import Topics

logger = logging.getLogger(__name__)

CONTROL_PARTITIONS = 1
"""One partition keeps announcements in order for every reader."""


def encode_control(record: ControlRecord) -> bytes:
    return record.model_dump_json().encode()


def decode_control(data: bytes) -> ControlRecord:
    try:
        return ControlRecord.model_validate(json.loads(data))
    except (ValueError, ValidationError) as exc:
        raise RecordError(f"malformed control record: {exc}") from exc


class ControlAnnouncer:
    """Publishes version announcements and the end of the run; every send is acknowledged."""

    def __init__(self, kafka: KafkaConfig, topics: Topics) -> None:
        self.topics = topics
        self._producer = Producer(kafka, name="control")

    def send(self, record: ControlRecord, timeout_s: float = 30.0) -> None:
        self._producer.send_and_wait(
            self.topics.control, encode_control(record), key=record.kind.encode(), timeout_s=timeout_s
        )

    def version(self, policy: str, version: int, groups_consumed: int, consumed_ids: list[str] | None = None) -> None:
        self.send(ControlRecord(kind="version", run=self.topics.run, policy=policy, version=version,
                                groups_consumed=groups_consumed, consumed_ids=list(consumed_ids or [])))

    def finished(self, policy: str, version: int, groups_consumed: int, reason: str) -> None:
        """The trainer of ``policy`` is done; the run is over once every policy finished."""
        self.send(ControlRecord(kind="finished", run=self.topics.run, policy=policy, version=version,
                                groups_consumed=groups_consumed, reason=reason))

    def stop(self, policy: str, version: int, reason: str, timeout_s: float = 30.0) -> None:
        """End the whole run now, whatever its trainers are doing."""
        self.send(ControlRecord(kind="stop", run=self.topics.run, policy=policy, version=version, reason=reason),
                  timeout_s=timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        self._producer.close(timeout_s)


def announce_stop(kafka: KafkaConfig, topics: Topics, policy: str, reason: str, timeout_s: float = 30.0) -> None:
    """Send the run's stop record (``ControlAnnouncer.stop``) with a producer of its own."""
    announcer = ControlAnnouncer(kafka, topics)
    try:
        announcer.stop(policy, 0, reason, timeout_s=timeout_s)
    finally:
        announcer.close(timeout_s=1.0)  # acknowledged, or not within timeout_s: waiting on helps no one


class ControlReader:
    """Reads the run's control records; keeps the newest announcement per policy, which policies
    finished, and the stop.

    ``from_beginning=False`` sees only what is announced after it started. ``advisory``: it polls
    with the long fetch wait of readers no step waits on.
    """

    def __init__(self, kafka: KafkaConfig, topics: Topics, *, from_beginning: bool = True,
                 advisory: bool = False) -> None:
        self.topics = topics
        self._reader = PartitionReader(kafka, topics.control, start="beginning" if from_beginning else "end",
                                       advisory=advisory)
        self.latest: dict[str, ControlRecord] = {}
        self.finished: set[str] = set()
        self.stopped: ControlRecord | None = None
        self._offsets: dict[str, int] = {}  # policy -> offset of its latest record; "" -> the stop's
        self._losses = 0

    @property
    def log_losses(self) -> int:
        """Times the broker came back without its log (``PartitionReader.log_losses``)."""
        return self._reader.log_losses

    def poll(self, timeout_s: float) -> list[ControlRecord]:
        """Read what arrived (waiting at most ``timeout_s`` for the first record); returns the new
        records of this run."""
        new = []
        for record in self._reader.read(256, timeout_s):
            if self._reader.log_losses != self._losses:  # offsets of a log that is gone
                self._losses, self._offsets = self._reader.log_losses, {}
            try:
                control = decode_control(record.value)
            except RecordError as exc:
                # Advisory: the weightstore is the source of truth for versions.
                logger.warning("skipping control record at offset %d: %s", record.offset, exc)
                continue
            if control.run != self.topics.run:
                continue
            if control.kind == "stop":
                self.stopped = control
                self._offsets.setdefault("", record.offset)
            else:
                self.latest[control.policy] = control
                self._offsets[control.policy] = record.offset
                if control.kind == "finished":
                    self.finished.add(control.policy)
            new.append(control)
        return new

    def floor(self, policies: list[str]) -> int | None:
        """The lowest offset a reader from the beginning needs to learn what this one knows of
        ``policies`` (their latest records, the stop): what lies below it may leave the log. None until
        every one of them announced something."""
        if not policies or any(p not in self._offsets for p in policies):
            return None
        return min(o for p, o in self._offsets.items() if p in policies or p == "")

    def over(self, policies: list[str] | set[str]) -> bool:
        """Whether the run is over for a reader that needs ``policies``: stopped, or all of them finished."""
        return self.stopped is not None or set(policies) <= self.finished

    def close(self) -> None:
        self._reader.close()
