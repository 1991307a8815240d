"""Bounded logs: what every reader that needs it has passed leaves the broker's log.

A run's prompt and trajectory topics grow by a batch per produced batch for as long as the run lasts,
and Tansu's s3 engine lists a partition's whole ``records/`` prefix on every Fetch and ListOffsets:
a run on a durable log slows down step after step (and past ~16k objects in a partition its fetches
return nothing). Kafka's time and size retention does not fit either: it deletes by age, not by
whether the trainer (and its checkpoints) are past a record, and Tansu ignores it.

So the roles that own a topic trim it themselves, up to a **floor** per partition: nothing at or
above the floor is ever removed.

* a trajectory topic (and the regions' mirrors of it): its trainer trims it; the floor is the lowest
  of the trainer group's committed offset and the offsets of every checkpoint the trainer keeps
  (a trainer resumes from its newest checkpoint and seeks there; an older one is read when the newest
  cannot be);
* a prompt topic: its curator trims it; the floor is the rollout group's committed offset (a prompt
  below it produced its group, which is in the trajectory topic).

A partition on which a floor's group has committed nothing is not trimmed. Readers outside any group
(the curator's feedback, ``rlbus status``'s tails) read what is left: a feedback reader that lags
behind the trainer may skip groups (pass-rate statistics, not training data).

How records leave depends on the broker (``LogConfig.trim``):

* ``delete_records``: Kafka's DeleteRecords (Apache Kafka, Redpanda, MSK): the log start moves to the
  floor;
* ``tansu_s3``: Tansu 0.6's s3 storage engine, which implements neither DeleteRecords (the broker
  panics in it) nor retention: the trimmer deletes the batch objects (``clusters/<cluster>/topics/
  <topic>/partitions/<partition:010>/records/<base offset:020>.batch``) whose records all lie below
  the floor, straight from the bucket. A reader positioned below what is left is moved to the first
  batch left by the broker (no out-of-range error). This couples rlbus to that layout:
  ``tests/integration/test_retention.py`` checks it against the shipped binary;
* ``off``: nothing is removed.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from broker.reader import Partition
from broker.settings import KafkaConfig

logger = logging.getLogger(__name__)

Floors = dict[Partition, int]

_BATCH = re.compile(r"(\d{20})\.batch$")


class LogConfig(BaseModel):
    """How the run's prompt and trajectory logs are kept bounded (``broker.retention``)."""

    model_config = ConfigDict(extra="forbid")

    trim: Literal["auto", "off", "delete_records", "tansu_s3"] = Field(
        default="auto",
        description="How consumed records leave the log: 'delete_records' (Kafka's DeleteRecords: Apache Kafka, "
        "Redpanda, MSK), 'tansu_s3' (delete Tansu's batch objects from its bucket: Tansu implements neither "
        "DeleteRecords nor retention), 'off'. 'auto': 'tansu_s3' under `rlbus run` when its embedded broker's "
        "log is on SeaweedFS (local.broker_storage), else 'off' (a broker of your own keeps its own retention).",
    )
    every_s: float = Field(
        default=10.0, gt=0,
        description="Seconds between two trims. What a partition holds beyond its floor is what arrived since the "
        "last trim, and on Tansu's s3 engine every fetch lists it all: a trim is one listing per partition whose "
        "floor moved.",
    )
    tansu_storage: str = Field(
        default="s3://tansu/", description="tansu_s3: Tansu's --storage-engine URL (s3://BUCKET/)."
    )
    tansu_cluster: str = Field(
        default="rlbus", description="tansu_s3: the broker's cluster id (Tansu's --kafka-cluster-id)."
    )
    endpoint_url: str | None = Field(
        default=None,
        description="tansu_s3: the S3 endpoint of Tansu's bucket; unset: AWS_ENDPOINT_URL, as the broker reads it. "
        "Credentials: the two fields below, else the AWS_* environment, as the broker reads them.",
    )
    access_key_id: str | None = Field(default=None, description="tansu_s3: access key of Tansu's bucket.")
    secret_access_key: SecretStr | None = Field(
        default=None, description="tansu_s3: its secret (RLBUS_LOG__SECRET_ACCESS_KEY; never logged)."
    )


class TrimFailed(RuntimeError):
    """A trim that could not be done; the records stay (the next trim tries again)."""


def committed_floors(kafka: KafkaConfig, group: str, topics: Iterable[str], timeout_s: float = 30.0) -> Floors:
    """The offsets ``group`` committed on every partition of ``topics`` where it committed one."""
    from broker.admin import committed_offsets

    floors: Floors = {}
    for topic in topics:
        for partition, offset in committed_offsets(kafka, group, topic, timeout_s).items():
            if offset is not None:
                floors[(topic, partition)] = offset
    return floors


def lowest(*floors: Floors) -> Floors:
    """Per partition, the lowest floor; a partition missing from any of ``floors`` is left out (a
    holder that has no offset there holds all of it)."""
    if not floors:
        return {}
    keys = set(floors[0]).intersection(*floors[1:])
    return {k: min(f[k] for f in floors) for k in keys}


class Trimmer:
    """Removes records below given floors; ``trim`` returns the records removed per partition (as far
    as the method can tell: Tansu's batch objects do not say how many records they hold, so there it is
    the offsets the log start moved by)."""

    def trim(self, floors: Floors) -> dict[Partition, int]:
        raise NotImplementedError


class DeleteRecordsTrimmer(Trimmer):
    """Kafka's DeleteRecords: the log start of each partition moves up to its floor."""

    def __init__(self, kafka: KafkaConfig, timeout_s: float = 30.0) -> None:
        self.kafka, self.timeout_s = kafka, timeout_s
        self._start: dict[Partition, int] = {}

    def trim(self, floors: Floors) -> dict[Partition, int]:
        from confluent_kafka import KafkaException, TopicPartition

        from broker.admin import _admin

        todo = [TopicPartition(t, p, o) for (t, p), o in floors.items() if o > self._start.get((t, p), 0)]
        if not todo:
            return {}
        futures = _admin(self.kafka).delete_records(todo, request_timeout=self.timeout_s)
        moved: dict[Partition, int] = {}
        for tp, future in futures.items():
            try:
                low = future.result().low_watermark
            except KafkaException as exc:
                raise TrimFailed(f"DeleteRecords on {tp.topic}[{tp.partition}] failed: {exc} (a broker that does "
                                 "not implement it needs log.trim = 'off' or, for Tansu on S3, 'tansu_s3')") from None
            key = (tp.topic, tp.partition)
            moved[key] = low - self._start.get(key, 0)
            self._start[key] = low
        return moved


class TansuS3Trimmer(Trimmer):
    """Tansu 0.6's s3 engine: deletes the batch objects whose records all lie below the floor (a batch
    ends where the next one begins, so the last object of a partition is never deleted)."""

    def __init__(self, config: LogConfig) -> None:
        import boto3

        match = re.fullmatch(r"s3://([^/]+)/?", config.tansu_storage)
        if match is None:
            raise ValueError(f"log.tansu_storage {config.tansu_storage!r} is not an s3://BUCKET/ URL (Tansu's "
                             "--storage-engine; Tansu 0.6 keeps its log at the bucket's root)")
        self.bucket, self.root = match.group(1), f"clusters/{config.tansu_cluster}/topics"
        endpoint = config.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        secret = config.secret_access_key
        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name=os.environ.get("AWS_REGION", "us-east-1"),
                               aws_access_key_id=config.access_key_id,
                               aws_secret_access_key=None if secret is None else secret.get_secret_value())
        self._start: dict[Partition, int] = {}  # the first batch left, as far as this trimmer knows
        self._floor: dict[Partition, int] = {}  # the floor it last trimmed to

    def batches(self, topic: str, partition: int) -> list[tuple[int, str]]:
        """(base offset, key) of every batch object of a partition, in offset order."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = f"{self.root}/{topic}/partitions/{partition:010d}/records/"
        found = []
        try:
            for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    match = _BATCH.search(obj["Key"])
                    if match is not None:
                        found.append((int(match.group(1)), obj["Key"]))
        except (BotoCoreError, ClientError) as exc:
            raise TrimFailed(f"listing s3://{self.bucket}/{prefix} failed: {exc}") from None
        return sorted(found)

    def trim(self, floors: Floors) -> dict[Partition, int]:
        from botocore.exceptions import BotoCoreError, ClientError

        moved: dict[Partition, int] = {}
        for (topic, partition), floor in sorted(floors.items()):
            if floor <= self._floor.get((topic, partition), 0):  # trimmed to this floor already
                continue
            batches = self.batches(topic, partition)
            # A batch is wholly below the floor when the next one starts at or below it.
            doomed = [key for (_, key), (following, _) in zip(batches, batches[1:]) if following <= floor]
            for at in range(0, len(doomed), 1000):  # DeleteObjects takes at most 1,000 keys
                chunk = doomed[at:at + 1000]
                try:
                    answer = self.s3.delete_objects(Bucket=self.bucket,
                                                    Delete={"Objects": [{"Key": k} for k in chunk], "Quiet": True})
                except (BotoCoreError, ClientError) as exc:
                    raise TrimFailed(f"deleting {len(chunk)} batches of {topic}[{partition}] failed: {exc}") from None
                if answer.get("Errors"):
                    raise TrimFailed(f"deleting batches of {topic}[{partition}]: {answer['Errors'][:3]}")
            self._floor[(topic, partition)] = floor
            start = batches[len(doomed)][0] if batches else 0
            if start > self._start.get((topic, partition), 0):
                moved[(topic, partition)] = start - self._start.get((topic, partition), 0)
                self._start[(topic, partition)] = start
        return moved


def build_trimmer(config: LogConfig, kafka: KafkaConfig) -> Trimmer | None:
    if config.trim == "delete_records":
        return DeleteRecordsTrimmer(kafka)
    if config.trim == "tansu_s3":  # "auto" was resolved by `rlbus run`; anywhere else it is "off"
        return TansuS3Trimmer(config)
    return None


class LogKeeper:
    """A role's background thread that trims its topics every ``config.every_s`` up to ``floors()``
    (which raises ``TrimFailed`` or a broker error to skip a round). ``trimmed`` counts what left."""

    def __init__(self, config: LogConfig | None, kafka: KafkaConfig, floors: Callable[[], Floors], *,
                 name: str) -> None:
        """``config`` None: nothing is trimmed."""
        config = config or LogConfig(trim="off")
        self.config, self.floors, self.name = config, floors, name
        self.trimmer = build_trimmer(config, kafka)
        self.trimmed = 0
        self.failures = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> LogKeeper:
        if self.trimmer is not None:
            self._thread = threading.Thread(target=self._loop, name=f"log-keeper-{self.name}", daemon=True)
            self._thread.start()
        return self

    def trim_once(self) -> dict[Partition, int]:
        """One round: the floors, then the trim; what left per partition."""
        if self.trimmer is None:
            return {}
        moved = self.trimmer.trim(self.floors())
        self.trimmed += sum(moved.values())
        if any(moved.values()):
            logger.info("%s: log trimmed by %d offsets over %d partitions (%d in all)", self.name,
                        sum(moved.values()), sum(1 for v in moved.values() if v), self.trimmed)
        return moved

    def _loop(self) -> None:
        while not self._stop.wait(self.config.every_s):
            try:
                self.trim_once()
            except Exception as exc:  # noqa: BLE001 - a trim can wait for the next round; the role cannot
                self.failures += 1
                logger.warning("%s: log not trimmed this round (%s); records stay until the next (%d failed so far)",
                               self.name, exc, self.failures)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None



def trajectory_floors(kafka: KafkaConfig, group: str, subscription: list[str],
                      checkpoints: Callable[[], Floors | None]) -> Callable[[], Floors]:
    """A trainer's floors: its group's committed offsets on the topics it subscribes to (its own and
    the mirrors the broker has), held down to ``checkpoints()``: the lowest offsets any checkpoint it
    keeps resumes at (None: it keeps none, and resumes from its group's offsets)."""

    def floors() -> Floors:
        from broker.admin import topics_matching

        committed = committed_floors(kafka, group, topics_matching(kafka, subscription))
        held = checkpoints()
        return committed if held is None else lowest(committed, held)

    return floors


def prompt_floors(kafka: KafkaConfig, group: str, topic: str) -> Callable[[], Floors]:
    """A curator's floors: what the rollout group committed on its prompt topic."""
    return lambda: committed_floors(kafka, group, [topic])
