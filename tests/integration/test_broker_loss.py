"""A broker that comes back without its log, with a real rollout worker attached: what the broker
had acknowledged is published again by the worker that made it, but for what its trainer announced
taking."""

from __future__ import annotations

import hashlib
import os
import signal
import time
from pathlib import Path

import pytest

from broker.admin import end_offsets
from broker.control import ControlAnnouncer
from broker.embedded import EmbeddedBroker, EmbeddedBrokerConfig
from broker.reader import PartitionReader
from rlbus.roles import ensure_topics
from tests.fixtures.policy import make_policy_run
from tests.integration.test_rollout_path import _prompts

pytestmark = pytest.mark.integration


def _wait(predicate, what: str, polls: int = 600):
    for _ in range(polls):
        if (value := predicate()):
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _records(kafka, topic: str, count: int) -> dict[str, str]:
    """group id -> sha256 of the first ``count`` records of ``topic``."""
    reader = PartitionReader(kafka, topic)
    got: dict[str, str] = {}
    try:
        for _ in range(600):
            for r in reader.read(64, 0.2):
                got[r.key.decode()] = hashlib.sha256(r.value).hexdigest()
            if len(got) >= count:
                break
    finally:
        reader.close()
    return got


def test_a_worker_publishes_again_what_a_broker_that_lost_its_log_had_acknowledged(
    tmp_path: Path, run_name: str, tiny_model_dir: Path
) -> None:
    broker = EmbeddedBroker(EmbeddedBrokerConfig(), tmp_path / "broker.log")
    run = make_policy_run(broker.start(), run_name, tmp_path, tiny_model_dir)
    topic = run.topics.trajectories("main")
    worker = None
    try:
        ids = _prompts(run, 6)
        worker = run.worker(worker_id="w-outbox", log=tmp_path / "worker.log")
        _wait(lambda: sum(end_offsets(run.kafka, topic).values()) >= 6, "the worker's 6 groups")
        before = _records(run.kafka, topic, 6)
        assert set(before) == {f"{p}/main" for p in ids}
        # The trainer announced taking two of them: those are not needed again.
        announcer = ControlAnnouncer(run.kafka, run.topics)
        announcer.version("main", 1, 2, consumed_ids=["p0", "p1"])
        announcer.close()
        time.sleep(5)  # the worker reads announcements with the advisory fetch wait

        os.kill(broker.pid, signal.SIGKILL)
        _wait(lambda: broker.poll() is not None, "the broker's death")
        broker.restart()
        ensure_topics(run.cfg)
        _wait(lambda: sum(end_offsets(run.kafka, topic).values()) >= 4, "the groups published again")
        after = _records(run.kafka, topic, 4)
        # The very records the old log held (same bytes), but for the two the trainer had taken.
        assert after == {g: d for g, d in before.items() if g not in ("p0/main", "p1/main")}
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=60) == 0
        log = (tmp_path / "worker.log").read_text()
        assert "publishing again the 4 groups" in log, log[-3000:]
    finally:
        if worker is not None and worker.poll() is None:
            worker.kill()
        broker.stop()
