"""``rlbus status``: a fleet seen from outside, with nothing but the broker and the store.

* lag: records each consumer group has not committed past, per partition (the trainers' groups on
  the trajectory topics, the workers' group on the prompt topics);
* the trainers: the newest version in the store, and from the status each trainer mirrors into the
  store (``weightstore.telemetry``) its wait fraction and the groups/s it takes;
* live workers: the tail of the trajectory topics (groups published in the last ``window_s``),
  with each worker's region, hardware, engine, groups/s and the newest weight version it
  generates with;
* propagation: the time from publishing a version (its manifest) to the last live worker using it
  (``consumers.fleet.Propagation``);
* a scaling recommendation by the rule of ``consumers.fleet.recommend``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from broker.admin import group_lag, tail
from broker.codec import decode_group, is_claim
from broker.errors import RecordError, TopicMissing
from broker.schema import TrajectoryHeader
from broker.settings import KafkaConfig
from broker.topics import Topics
from consumers.fleet import Propagation, recommend
from weightstore.telemetry import read_status
from weightstore.errors import StoreError
from weightstore.manifest import read_latest, read_manifest
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

TAIL_RECORDS = 500
"""Records read from the end of each trajectory partition."""
MANIFESTS_READ = 32
"""Newest versions whose publication times are read for propagation."""
READ_TIMEOUT_S = 60.0
"""Longest wait for one topic's offsets or tail: a Tansu broker whose log is in S3 takes seconds to
read the end of every partition of a topic that is being written (measured 4-8 s for 32 partitions)."""


@dataclass
class RunShape:
    """What status needs to know of a run: its name, policies and prompt streams."""

    run: str
    policies: list[str]
    streams: list[str]


def lag_of(kafka: KafkaConfig, shape: RunShape) -> dict[str, dict]:
    topics = Topics(shape.run)
    groups = {topics.trainer_group(p): topics.trajectories(p) for p in shape.policies}
    out: dict[str, dict] = {}
    for group, topic in [*groups.items(), *((topics.rollout_group, topics.prompts(s)) for s in shape.streams)]:
        try:
            partitions = group_lag(kafka, group, topic, READ_TIMEOUT_S)
        except TopicMissing:
            continue
        out.setdefault(group, {"topics": {}, "total": 0})
        out[group]["topics"][topic] = {str(p): n for p, n in sorted(partitions.items())}
        out[group]["total"] += sum(partitions.values())
    return out


def _recent_headers(kafka: KafkaConfig, shape: RunShape, since: float) -> list[TrajectoryHeader]:
    topics = Topics(shape.run)
    headers = []
    for policy in shape.policies:
        try:
            records = tail(kafka, topics.trajectories(policy), TAIL_RECORDS, READ_TIMEOUT_S, since_ms=int(since * 1000))
        except TopicMissing:
            continue
        for record in records:
            if is_claim(record.value) or record.timestamp_ms / 1000 < since:
                continue
            try:
                headers.append(decode_group(record.value).header)
            except RecordError:
                continue  # the trainer parks it in the DLQ; nothing to learn about the fleet from it
    return headers


def _publication_times(store: ObjectStore, policy: str) -> tuple[int | None, dict[int, float]]:
    latest = read_latest(store, policy)
    if latest is None:
        return None, {}
    newest = latest[0].version
    times = {}
    for version in range(max(0, newest - MANIFESTS_READ + 1), newest + 1):
        try:
            times[version] = read_manifest(store, policy, version).created_at
        except StoreError:
            continue  # deleted by retention, or not there
    return newest, times


def fleet_status(kafka: KafkaConfig, store: ObjectStore, shape: RunShape, *, window_s: float = 60.0,
                 now: float | None = None) -> dict:
    """The status document (keys: run, time, lag, workers, trainer_version, trainer_wait_fraction,
    propagation_s, recommendation, policies)."""
    now = time.time() if now is None else now
    headers = _recent_headers(kafka, shape, now - window_s)
    workers: dict[str, dict] = {}
    for h in sorted(headers, key=lambda h: h.published_at):
        w = workers.setdefault(h.worker_id, {"worker_id": h.worker_id, "groups": 0, "versions": {}})
        w["groups"] += 1
        w.update(region=h.region, hardware=h.hardware, engine=h.engine, last_seen_s=round(now - h.published_at, 1))
        w["versions"][h.policy] = h.max_version
    for w in workers.values():
        w["groups_per_s"] = round(w.pop("groups") / window_s, 4)
    live = set(workers)
    policies = {}
    for policy in shape.policies:
        newest, published = _publication_times(store, policy)
        propagation = Propagation(keep=MANIFESTS_READ)
        for version, at in published.items():
            propagation.publish(version, at)
        for h in headers:
            if h.policy == policy:
                propagation.observe(h.worker_id, h.min_version, h.created_at)
        reached = propagation.latest({h.worker_id for h in headers if h.policy == policy})
        trainer = read_status(store, policy) or {}
        age = None if "time" not in trainer else round(now - trainer["time"], 1)
        policies[policy] = {
            "trainer_version": newest, "trainer_step": trainer.get("step"), "max_steps": trainer.get("max_steps"),
            "trainer_wait_fraction": trainer.get("wait_fraction"), "trainer_groups_per_s": trainer.get("groups_per_s"),
            "trainer_status_age_s": age, "reward_mean": trainer.get("reward_mean"),
            "propagated_version": None if reached is None else reached[0],
            "propagation_s": None if reached is None else round(reached[1], 3),
            "published_groups_per_s": round(sum(1 for h in headers if h.policy == policy) / window_s, 4),
        }
    first = policies[shape.policies[0]] if shape.policies else {}
    waits = [p["trainer_wait_fraction"] for p in policies.values() if p["trainer_wait_fraction"] is not None]
    taken = [p["trainer_groups_per_s"] for p in policies.values() if p["trainer_groups_per_s"] is not None]
    advice = recommend(len(live), max(waits) if waits else None,
                       published_per_s=sum(p["published_groups_per_s"] for p in policies.values()),
                       taken_per_s=sum(taken) if taken else None)
    return {
        "run": shape.run,
        "time": now,
        "window_s": window_s,
        "lag": lag_of(kafka, shape),
        "workers": sorted(workers.values(), key=lambda w: w["worker_id"]),
        "trainer_version": first.get("trainer_version"),
        "trainer_wait_fraction": None if not waits else max(waits),
        "propagation_s": first.get("propagation_s"),
        "recommendation": advice.as_dict(),
        "policies": policies,
    }
