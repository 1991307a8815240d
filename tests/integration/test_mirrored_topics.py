"""The regions' MirrorMaker 2 mirrors of a trajectory topic on the real broker.

Under MirrorMaker 2's default replication policy the hub holds a region's trajectories as
``<region>.<run>.trajectories.<policy>``, a topic MirrorMaker creates when it first copies one.
The trainer's intake and the curator's feedback read those beside the policy's own topic.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from broker.admin import committed_offsets, ensure_topics
from broker.codec import encode_group
from broker.producer import Producer
from broker.reader import GroupReader
from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.settings import KafkaConfig
from broker.topics import Topics
from consumers.feedback import FeedbackReader
from consumers.intake import IntakeConfig, TrainerIntake

pytestmark = pytest.mark.integration

DISCOVER_S = 1.0
"""How often the readers look for new mirrors here (30 s by default, MirrorMaker's own pace)."""


@pytest.fixture
def kafka(kafka_config: KafkaConfig) -> KafkaConfig:
    """Shorter group timeouts: on Tansu a rebalance (one comes with each new mirror) takes about
    session_timeout_ms / 2."""
    return kafka_config.model_copy(update={"session_timeout_ms": 4000, "heartbeat_interval_ms": 500})


@pytest.fixture
def topics(run_name: str) -> Topics:
    """A run name with a '-', which the mirrors' pattern escapes, as librdkafka must read it."""
    return Topics(f"{run_name}-r_1")


def _group(topics: Topics, prompt_id: str) -> TrajectoryGroup:
    header = TrajectoryHeader(
        run=topics.run, policy="main", group_id=f"{prompt_id}/main", prompt_id=prompt_id, task="addition",
        worker_id="w-us-east", region="us-east", sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2),
        rewards=[1.0, 0.0], finish_reasons=["stop", "stop"], min_version=0, max_version=0, vocab_size=64,
        created_at=time.time(),
    )
    return TrajectoryGroup(
        header=header, prompt_tokens=np.array([1, 2], np.int32), completion_tokens=np.array([3, 4], np.int32),
        completion_offsets=np.array([0, 1, 2], np.int32), behaviour_logprobs=np.array([-0.1, -0.2], np.float32),
        token_versions=np.zeros(2, np.int32),
    )


def _produce(kafka: KafkaConfig, topics: Topics, topic: str, placed: dict[str, int]) -> None:
    """Groups of ``placed`` (prompt id → partition) into ``topic``, in that order."""
    producer = Producer(kafka)
    try:
        for prompt_id, partition in placed.items():
            producer.send_and_wait(topic, encode_group(_group(topics, prompt_id)), key=prompt_id.encode(),
                                   partition=partition)
    finally:
        producer.close()


def _train(intake: TrainerIntake, delivered: list[str], offsets: dict, until, timeout_s: float = 120.0) -> None:
    """Take batches as a trainer does (offsets committed after each 'step') until ``until()``."""
    deadline = time.monotonic() + timeout_s
    while not until() and time.monotonic() < deadline:
        batch = intake.next_batch(8, version=0, timeout_s=1.0)
        if batch is None:
            continue
        delivered += [g.header.prompt_id for g in batch.groups]
        offsets.update(batch.offsets)
        intake.commit(batch.offsets)


def test_the_intake_reads_a_regions_mirror_that_appears_after_it_started(kafka: KafkaConfig, topics: Topics) -> None:
    """The hub's own topic and ``us-east.<run>.trajectories.main``, made (as MirrorMaker makes it)
    after the trainer joined: every group is delivered once, one that came on both included, and
    the group's committed offsets cover both topics."""
    own, mirror = topics.trajectories("main"), f"us-east.{topics.trajectories('main')}"
    ensure_topics(kafka, {own: 2})
    _produce(kafka, topics, own, {"h0": 0, "h1": 1, "h2": 0, "both": 1})
    intake = TrainerIntake(kafka, topics, "main", IntakeConfig(mirror_discovery_s=DISCOVER_S), max_staleness=4,
                           vocab_size=64)
    intake.start()
    delivered: list[str] = []
    offsets: dict[tuple[str, int], int] = {}
    try:
        _train(intake, delivered, offsets, lambda: {"h0", "h1", "h2", "both"} <= set(delivered))
        assert sorted(delivered) == ["both", "h0", "h1", "h2"]
        ensure_topics(kafka, {mirror: 2})
        _produce(kafka, topics, mirror, {"e0": 0, "both": 0, "e1": 1, "e2": 1, "e3": 1})
        ends = {(own, 0): 2, (own, 1): 2, (mirror, 0): 2, (mirror, 1): 3}
        _train(intake, delivered, offsets, lambda: all(offsets.get(k) == v for k, v in ends.items()))
    finally:
        intake.close()  # commits still queued are made first
    assert sorted(delivered) == ["both", "e0", "e1", "e2", "e3", "h0", "h1", "h2"]  # each once
    assert intake.stats.duplicates >= 1  # the mirror's copy of "both", at least
    group = topics.trainer_group("main")
    assert committed_offsets(kafka, group, own) == {0: 2, 1: 2}
    assert committed_offsets(kafka, group, mirror) == {0: 2, 1: 3}


def test_a_group_on_the_pattern_takes_the_mirror_and_leaves_look_alikes(kafka: KafkaConfig, topics: Topics) -> None:
    """Topics that only look like mirrors (two labels in front, another policy, another run, a
    policy name with a suffix) are not assigned to a group reading the policy's topics."""
    own = topics.trajectories("main")
    strays = [f"a.b.{own}", f"us-east.{topics.trajectories('critic')}", f"us-east.x{own}", f"us-east.{own}-x"]
    ensure_topics(kafka, {own: 1, f"us-east.{own}": 2, **{t: 1 for t in strays}})
    reader = GroupReader(kafka, topics.trainer_group("main"), [own, topics.trajectories_pattern("main")],
                         discover_every_s=DISCOVER_S)
    try:
        deadline = time.monotonic() + 60
        while not reader.assignment() and time.monotonic() < deadline:
            reader.read(8, 0.5)
        assert reader.assignment() == {(own, 0), (f"us-east.{own}", 0), (f"us-east.{own}", 1)}
        assert reader.client_errors == 0
    finally:
        reader.close()


def test_the_curators_feedback_reads_a_regions_mirror_that_appears_later(kafka: KafkaConfig, topics: Topics) -> None:
    own, mirror = topics.trajectories("main"), f"us-east.{topics.trajectories('main')}"
    ensure_topics(kafka, {own: 2})
    _produce(kafka, topics, own, {"h0": 0, "h1": 1})
    feedback = FeedbackReader(kafka, topics, "main", discover_every_s=DISCOVER_S)
    seen: list[str] = []
    try:
        deadline = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < deadline:
            seen += [h.prompt_id for h in feedback.poll(0.5)]
        ensure_topics(kafka, {mirror: 2, f"a.b.{own}": 1})
        _produce(kafka, topics, f"a.b.{own}", {"stray": 0})
        _produce(kafka, topics, mirror, {"e0": 0, "e1": 1, "e2": 1})
        while len(seen) < 5 and time.monotonic() < deadline + 60:
            seen += [h.prompt_id for h in feedback.poll(0.5)]
        reading = feedback.reading
    finally:
        feedback.close()
    assert sorted(seen) == ["e0", "e1", "e2", "h0", "h1"]
    assert reading == sorted([own, mirror])  # the stray, there as early as the mirror, is not read


def test_a_trainer_checkpoints_and_resumes_from_the_offsets_of_its_topic_and_a_mirror(policy_run, tmp_path) -> None:
    """A step trained on groups of the hub's topic and of a region's mirror: the checkpoint keeps the
    offsets of both, and the trainer resumed from it trains on what came after, on both, only."""
    import json

    from rlbus.config import worker_descriptor
    from trainer.checkpoint import load_latest_checkpoint
    from trainer.config import TrainerConfig
    from trainer.role import run_trainer
    from weightstore.config import WeightsConfig
    from weightstore.objectstore import LocalDirStore

    topics, kafka = policy_run.topics, policy_run.kafka
    own, mirror = topics.trajectories("main"), f"us-east.{topics.trajectories('main')}"
    ensure_topics(kafka, {mirror: 2})
    run_dir = tmp_path / "run"

    def train(steps: int) -> list[str]:
        run_trainer(
            kafka=kafka, topics=topics, policy="main", store=LocalDirStore(policy_run.store_url),
            config=TrainerConfig(max_steps=steps, groups_per_step=3, idle_timeout_s=120), weights=WeightsConfig(),
            intake=IntakeConfig(mirror_discovery_s=DISCOVER_S), stages=[], temperature=1.0, max_staleness=4,
            model_dir=policy_run.model_dir, run_dir=run_dir, metrics_path=run_dir / "metrics.jsonl",
            descriptor=worker_descriptor(policy_run.cfg), should_stop=lambda: False)
        rows = (run_dir / "metrics.jsonl").read_text().splitlines()
        return sorted(g.split("/")[0] for g in json.loads(rows[-1])["trained_group_ids"])

    _produce(kafka, topics, own, {"h0": 0, "h1": 1})
    _produce(kafka, topics, mirror, {"e0": 1})
    assert train(1) == ["e0", "h0", "h1"]
    ckpt = load_latest_checkpoint(run_dir / "checkpoints" / "main")
    assert ckpt.offsets == {own: {0: 1, 1: 1}, mirror: {1: 1}}

    _produce(kafka, topics, mirror, {"e1": 0, "e2": 1})
    _produce(kafka, topics, own, {"h2": 1})
    assert train(2) == ["e1", "e2", "h2"]
    ckpt = load_latest_checkpoint(run_dir / "checkpoints" / "main")
    assert ckpt.offsets == {own: {0: 1, 1: 2}, mirror: {0: 1, 1: 2}}
    assert committed_offsets(kafka, topics.trainer_group("main"), mirror) == {0: 1, 1: 2}


def test_a_resume_keeps_the_checkpoints_offsets_of_each_topic_that_still_holds_them(kafka: KafkaConfig,
                                                                                 topics: Topics) -> None:
    """Per topic: a region's mirror the broker no longer has (the region left) and one whose offsets
    lie past its end (not the log they were read from) are left out, so the trainer reads them
    from their committed offsets; the others' are kept."""
    from trainer.role import _offsets_in_log

    own = topics.trajectories("main")
    kept, emptied, gone = (f"{region}.{own}" for region in ("us-east", "eu", "ap"))
    ensure_topics(kafka, {own: 1, kept: 1, emptied: 1})
    _produce(kafka, topics, own, {"h0": 0, "h1": 0})
    _produce(kafka, topics, kept, {"e0": 0})
    offsets = {(own, 0): 2, (kept, 0): 1, (emptied, 0): 5, (gone, 0): 3}
    assert _offsets_in_log(kafka, own, offsets) == {(own, 0): 2, (kept, 0): 1}
