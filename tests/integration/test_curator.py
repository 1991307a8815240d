"""The curator against a real broker: admission (guard 1), feedback-driven prompt stages, routing.

The test plays the fleet and the trainer with real Kafka clients and the real codec: it takes the
prompts the curator dispatches, publishes one trajectory group per prompt, and announces on the
control topic how many groups the trainer consumed, as ``PolicyTrainer`` does.
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from broker.admin import ensure_topics
from broker.codec import decode_prompt, encode_group
from broker.control import CONTROL_PARTITIONS, ControlAnnouncer
from broker.producer import Producer
from broker.reader import GroupReader
from broker.schema import PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.settings import KafkaConfig
from broker.topics import Topics
from consumers.curator import Curator, CuratorConfig
from consumers.dataset import read_rows
from consumers.stages import StageSpec

pytestmark = pytest.mark.integration

SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2)


def _group(prompt: PromptRecord, rewards: list[float], worker: str, started: float) -> TrajectoryGroup:
    n = len(rewards)
    header = TrajectoryHeader(
        run=prompt.run, policy=prompt.policy, group_id=f"{prompt.prompt_id}/{prompt.policy}",
        prompt_id=prompt.prompt_id, prompt_key=prompt.prompt_key, task=prompt.task, worker_id=worker,
        sampling=SAMPLING, rewards=rewards, finish_reasons=["stop"] * n, min_version=0, max_version=0,
        vocab_size=16, created_at=started, published_at=started + 0.01,
    )
    return TrajectoryGroup(
        header=header, prompt_tokens=np.array([1, 2], np.int32), completion_tokens=np.full(n, 3, np.int32),
        completion_offsets=np.arange(n + 1, dtype=np.int32), behaviour_logprobs=np.zeros(n, np.float32),
        token_versions=np.zeros(n, np.int32),
    )


class FakeFleetAndTrainer:
    """Serves every prompt at once and reports it consumed: the loop around the curator."""

    def __init__(self, kafka: KafkaConfig, topics: Topics, rewards_of) -> None:
        self.kafka, self.topics, self.rewards_of = kafka, topics, rewards_of
        self.reader = GroupReader(kafka, f"{topics.run}.rollout", [topics.prompts("main")])
        self.producer = Producer(kafka)
        self.announcer = ControlAnnouncer(kafka, topics)
        self.seen: list[PromptRecord] = []
        self.partitions: list[int] = []
        self.max_in_flight = 0
        self.announced_consumed = 0

    def serve(self, until_prompts: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.seen) < until_prompts and time.monotonic() < deadline:
            for record in self.reader.read(1, 0.2):
                self._serve_one(record)
        assert len(self.seen) >= until_prompts, f"only {len(self.seen)} prompts arrived in {timeout_s}s"

    def _serve_one(self, record) -> None:
        prompt = decode_prompt(record.value)
        self.seen.append(prompt)
        self.partitions.append(record.partition)
        dispatched = int(prompt.prompt_id[1:]) + 1
        self.max_in_flight = max(self.max_in_flight, dispatched - (len(self.seen) - 1))
        group = _group(prompt, self.rewards_of(prompt.prompt_key), "w-test", time.time())
        self.producer.send_and_wait(self.topics.trajectories("main"), encode_group(group),
                                    key=group.header.group_id.encode(), timeout_s=10)
        self.announced_consumed = len(self.seen)
        self.announcer.version("main", len(self.seen), self.announced_consumed)

    def close(self) -> None:
        self.reader.close()
        self.producer.close()
        self.announcer.close()


def _start(kafka: KafkaConfig, run_name: str, tmp_path: Path, rows: list[dict], eta: int = 0,
           stages: list | None = None) -> tuple[Curator, threading.Event, threading.Thread, Topics]:
    topics = Topics(run_name)
    ensure_topics(kafka, {topics.prompts("main"): 4, topics.trajectories("main"): 2,
                          topics.control: CONTROL_PARTITIONS, topics.dlq: 1})
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    curator = Curator(kafka, topics, "main", CuratorConfig(), rows=read_rows(data), task="addition",
                      stages=[StageSpec.model_validate(s) for s in stages or []], group_size=4,
                      windows={"main": (eta + 1) * 2})
    stop = threading.Event()
    thread = threading.Thread(target=curator.run, args=(stop.is_set,), daemon=True)
    thread.start()
    return curator, stop, thread, topics


def _await_feedback(curator: Curator, groups: int, timeout_s: float = 30.0) -> None:
    """The curator reads feedback on its own schedule: wait until it has seen ``groups``."""
    deadline = time.monotonic() + timeout_s
    while curator.stats.feedback < groups and time.monotonic() < deadline:
        time.sleep(0.1)


def _serve_then_stop(curator: Curator, stop: threading.Event, thread: threading.Thread,
                     fleet: FakeFleetAndTrainer, *, prompts: int, timeout_s: float) -> None:
    try:
        fleet.serve(until_prompts=prompts, timeout_s=timeout_s)
        _await_feedback(curator, prompts)
    finally:
        stop.set()
        thread.join(30)
        fleet.close()


def _rows(keys: list[str]) -> list[dict]:
    return [{"prompt_id": k, "prompt": f"{i}+1=", "answer": str(i + 1)} for i, k in enumerate(keys)]


def test_admission_never_exceeds_the_window(kafka_config: KafkaConfig, run_name: str, tmp_path: Path) -> None:
    """Guard 1: with η = 0 and B = 2, at most 2 prompts are out before the trainer reports them
    consumed; a trainer that stops reporting stops the dispatching."""
    curator, stop, thread, topics = _start(kafka_config, run_name, tmp_path, _rows(["a", "b", "c", "d"]))
    fleet = FakeFleetAndTrainer(kafka_config, topics, lambda key: [0.0, 1.0, 0.0, 1.0])
    try:
        fleet.serve(until_prompts=12, timeout_s=60)
        assert fleet.max_in_flight <= curator.window == 2
        # The trainer now reports nothing more: one window is out, and no prompt after it.
        time.sleep(3.0)
        assert curator.stats.dispatched == fleet.announced_consumed + curator.window
    finally:
        stop.set()
        thread.join(30)
        fleet.close()
    assert not thread.is_alive()


def test_solved_prompts_are_skipped_from_feedback(kafka_config: KafkaConfig, run_name: str, tmp_path: Path) -> None:
    keys = ["solved", "open-1", "open-2", "open-3"]
    stages = [{"type": "skip_solved", "params": {"threshold": 0.9, "min_observations": 1}}]
    curator, stop, thread, topics = _start(kafka_config, run_name, tmp_path, _rows(keys), stages=stages)
    fleet = FakeFleetAndTrainer(kafka_config, topics, lambda key: [1.0] * 4 if key == "solved" else [0.0, 1.0, 1.0, 0.0])
    _serve_then_stop(curator, stop, thread, fleet, prompts=30, timeout_s=90)
    counts = Counter(p.prompt_key for p in fleet.seen)
    # Feedback can trail a dispatch or two; after that the solved prompt never comes back.
    assert counts["solved"] <= 3, counts
    assert all(counts[k] >= 8 for k in keys[1:]), counts
    later = [p.prompt_key for p in fleet.seen[12:]]
    assert "solved" not in later
    metrics = curator.metrics()
    assert metrics["stage/skip_solved/skipped"] >= 4
    assert metrics["skipped"] == metrics["stage/skip_solved/skipped"]
    assert metrics["feedback_groups"] >= 25


def test_router_learns_the_worker_and_spreads_prompts(kafka_config: KafkaConfig, run_name: str, tmp_path: Path) -> None:
    """Explicit partitions: every partition is probed, the worker's speed is learned from headers."""
    curator, stop, thread, topics = _start(kafka_config, run_name, tmp_path, _rows(["a", "b", "c", "d"]), eta=3)
    fleet = FakeFleetAndTrainer(kafka_config, topics, lambda key: [0.0, 1.0, 0.0, 1.0])
    _serve_then_stop(curator, stop, thread, fleet, prompts=24, timeout_s=60)
    assert set(fleet.partitions) == {0, 1, 2, 3}
    report = curator.metrics()
    assert report["routing/worker/w-test/rate"] > 0
    assert report["routing/worker/w-test/served"] >= 20
