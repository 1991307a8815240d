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
* regions: per region, its live workers, the groups, completion tokens and trajectory bytes it
  published per second, how many versions its groups lag the trainer, and its replica's status in
  the store (``weightstore.replica``); ``region_status`` computes it;
* a scaling recommendation by the rule of ``consumers.fleet.recommend``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

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
from weightstore.replica import read_region_status

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


@dataclass(frozen=True)
class Seen:
    """One trajectory group of the tail: its header, its completion tokens and its record's bytes."""

    header: TrajectoryHeader
    tokens: int
    record_bytes: int


def _recent_groups(kafka: KafkaConfig, shape: RunShape, since: float) -> list[Seen]:
    """The groups published since ``since`` (a claim check's group is in the store: not counted)."""
    topics = Topics(shape.run)
    seen = []
    for policy in shape.policies:
        try:
            records = tail(kafka, topics.trajectories(policy), TAIL_RECORDS, READ_TIMEOUT_S, since_ms=int(since * 1000))
        except TopicMissing:
            continue
        for record in records:
            if is_claim(record.value) or record.timestamp_ms / 1000 < since:
                continue
            try:
                group = decode_group(record.value)
            except RecordError:
                continue  # the trainer parks it in the DLQ; nothing to learn about the fleet from it
            seen.append(Seen(group.header, len(group.completion_tokens), len(record.value)))
    return seen


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
    propagation_s, recommendation, policies, regions)."""
    now = time.time() if now is None else now
    seen = _recent_groups(kafka, shape, now - window_s)
    headers = [g.header for g in seen]
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
        "regions": region_status(seen, {p: policies[p]["trainer_version"] for p in policies},
                                 _replicas(store), window_s=window_s, now=now),
    }


def _replicas(store: ObjectStore) -> dict[str, dict]:
    try:
        return read_region_status(store)
    except StoreError as exc:  # the replicas' status is advisory: the rest of the status stands
        logger.warning("the regions' replica status is unreadable in %s: %s", store.describe(), exc)
        return {}


@dataclass
class _Region:
    workers: set[str] = field(default_factory=set)
    groups: int = 0
    tokens: int = 0
    record_bytes: int = 0
    lags: list[int] = field(default_factory=list)


def region_status(seen: list[Seen], trainer_versions: dict[str, int | None], replicas: dict[str, dict], *,
                  window_s: float, now: float) -> dict[str, dict]:
    """Per region (of the groups ``seen`` in the last ``window_s`` and of the ``replicas``' status
    documents): live workers, groups, completion tokens and trajectory bytes per second, the
    version lag of its groups (their policy's trainer version less their ``min_version``, where
    that version is known), and its replica's versions, lag and arrival times per policy."""
    regions: dict[str, _Region] = {}
    for g in seen:
        r = regions.setdefault(g.header.region, _Region())
        r.workers.add(g.header.worker_id)
        r.groups += 1
        r.tokens += g.tokens
        r.record_bytes += g.record_bytes
        trainer = trainer_versions.get(g.header.policy)
        if trainer is not None:
            r.lags.append(max(0, trainer - g.header.min_version))
    out = {}
    for name in sorted(set(regions) | set(replicas)):
        r = regions.get(name, _Region())
        out[name] = {
            "workers": sorted(r.workers), "groups_per_s": round(r.groups / window_s, 4),
            "tokens_per_s": round(r.tokens / window_s, 2), "bytes_per_s": round(r.record_bytes / window_s, 1),
            "version_lag_mean": round(sum(r.lags) / len(r.lags), 3) if r.lags else None,
            "version_lag_max": max(r.lags) if r.lags else None,
            "replica": None if name not in replicas else _replica(replicas[name], now),
        }
    return out


def _replica(doc: dict, now: float) -> dict:
    keys = ("replica_version", "hub_version", "lag_versions", "arrival_p50_s", "arrival_p99_s")
    policies = doc.get("policies") if isinstance(doc.get("policies"), dict) else {}
    at = doc.get("time")
    return {"status_age_s": round(now - at, 1) if isinstance(at, (int, float)) else None,
            "bytes_copied": doc.get("bytes_copied"), "errors": doc.get("errors"),
            "policies": {p: {k: st.get(k) for k in keys} for p, st in policies.items() if isinstance(st, dict)}}
