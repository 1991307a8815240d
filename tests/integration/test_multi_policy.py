"""Two policies through one workflow on the real broker: a solver_verifier worker attached by hand
publishes each policy's groups to that policy's topic, and killing it in the middle of an episode
loses no prompt of either policy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.codec import encode_prompt
from broker.producer import Producer
from broker.schema import PromptRecord, TrajectoryGroup
from broker.topics import Topics
from consumers.intake import IntakeConfig, TrainerIntake
from rlbus.config import RunConfig, load_config
from tests.fixtures.policy import TEST_KAFKA

pytestmark = pytest.mark.integration

POLICIES = ("solver", "verifier")
WORKFLOW = ('workflows=[{"name": "solve", "type": "solver_verifier", "roles": {"solver": "solver", '
            '"verifier": "verifier"}, "params": {"template": "{completion}={prompt}", "accept": "+", "reject": "-"}}]')


@pytest.fixture
def two_policies(kafka_broker, run_name: str, tmp_path: Path, tiny_model_dir: Path) -> Iterator[tuple[RunConfig, str]]:
    """A run of two policies, topics created, each policy's files and version 0 in a local store, and
    the run descriptor a worker attaches with."""
    from rlbus.config import worker_descriptor
    from rlbus.roles import ensure_topics
    from trainer.model import load_policy
    from weightstore.config import LocalStoreConfig, WeightsConfig, build_store
    from weightstore.modelfiles import publish_model_files, write_run_descriptor
    from weightstore.publish import WeightPublisher

    cfg = load_config(None, [
        f"run.name={run_name}", f"kafka.bootstrap_servers={kafka_broker.bootstrap}", "sampling.max_new_tokens=3",
        "sampling.group_size=4", 'policies=[{"name": "solver"}, {"name": "verifier", "max_staleness": 1}]',
        WORKFLOW, *TEST_KAFKA], environ={})
    store_dir = tmp_path / "store"
    store = build_store(LocalStoreConfig(type="local", path=str(store_dir)))
    ensure_topics(cfg)
    model, _ = load_policy(tiny_model_dir)
    for policy in POLICIES:
        publish_model_files(store, policy, tiny_model_dir)
        WeightPublisher(store, policy, WeightsConfig()).publish(0, model.state_dict())
    write_run_descriptor(store, worker_descriptor(cfg))
    yield cfg, str(store_dir)


def _worker(cfg: RunConfig, store: str, *args: str, worker_id: str, log: Path) -> subprocess.Popen:
    kafka = [arg for setting in TEST_KAFKA for arg in ("--set", setting)]
    cmd = [sys.executable, "-m", "rlbus.cli", "worker", "--broker", cfg.kafka.bootstrap_servers, "--store", store,
           "--id", worker_id, "--workflow", "solve", *kafka, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env)


def _prompts(cfg: RunConfig, n: int) -> list[str]:
    topics = Topics(cfg.run.name)
    producer = Producer(cfg.kafka)
    sent, ids = [], []
    for i in range(n):
        a, b = i % 10, (7 * i) % 10
        rec = PromptRecord(run=cfg.run.name, policy="solve", prompt_id=f"p{i}", task="addition", prompt=f"{a}+{b}=",
                           answer=str(a + b), group_size=4, dispatch_version=0,
                           dispatch_versions={"solver": 0, "verifier": 0})
        sent.append(producer.produce(topics.prompts("solve"), encode_prompt(rec), key=rec.prompt_id.encode()))
        ids.append(rec.prompt_id)
    producer.close()
    assert all(s.result() for s in sent)
    return ids


def _collect(intakes: dict[str, TrainerIntake], want: dict[str, set[str]],
             timeout_s: float) -> dict[str, dict[str, TrajectoryGroup]]:
    """Groups per policy until each has the prompts ``want`` names for it (or the time is up)."""
    got: dict[str, dict[str, TrajectoryGroup]] = {p: {} for p in intakes}
    deadline = time.monotonic() + timeout_s
    while any(not want[p] <= set(g) for p, g in got.items()) and time.monotonic() < deadline:
        for policy, intake in intakes.items():
            batch = intake.next_batch(max(1, len(want[policy])), version=0, timeout_s=0.5)
            for g in batch.groups if batch else []:
                got[policy][g.header.prompt_id] = g
    return got


def test_a_killed_solver_verifier_worker_loses_no_prompt_of_either_policy(two_policies, tmp_path: Path) -> None:
    cfg, store = two_policies
    ids = _prompts(cfg, 24)
    intakes = {p: TrainerIntake(cfg.kafka, Topics(cfg.run.name), p, IntakeConfig(), max_staleness=4, vocab_size=64)
               for p in POLICIES}
    for intake in intakes.values():
        intake.start()
    # At 1/20 of its speed the worker spends most of its life between generating a batch and
    # publishing it: a SIGKILL lands in the middle of an episode.
    slow = _worker(cfg, store, "--set", "worker.bench_speed=0.05", "--set", "worker.max_prompts_per_poll=2",
                   worker_id="w-slow", log=tmp_path / "slow.log")
    try:
        first: dict[str, dict[str, TrajectoryGroup]] = {p: {} for p in POLICIES}
        deadline = time.monotonic() + 180
        while not first["solver"] and time.monotonic() < deadline:
            for policy, groups in _collect(intakes, {p: set(ids) for p in POLICIES}, timeout_s=1).items():
                first[policy] |= groups
        assert first["solver"], (tmp_path / "slow.log").read_text()[-3000:]
        slow.send_signal(signal.SIGKILL)
        slow.wait(timeout=30)
        fast = _worker(cfg, store, worker_id="w-fast", log=tmp_path / "fast.log")
        try:
            rest = _collect(intakes, {p: set(ids) - set(first[p]) for p in POLICIES}, timeout_s=240)
        finally:
            fast.send_signal(signal.SIGTERM)
            rc = fast.wait(timeout=60)
    finally:
        for intake in intakes.values():
            intake.close()
    log = (tmp_path / "fast.log").read_text()[-3000:]
    assert rc == 0, log
    for policy in POLICIES:
        groups = {**first[policy], **rest[policy]}
        assert set(groups) == set(ids), (policy, sorted(set(ids) - set(groups)), log)
        assert {g.header.policy for g in groups.values()} == {policy}
        assert intakes[policy].stats.rejected == 0  # nothing of the other policy on its topic
    assert {g.header.worker_id for g in rest["verifier"].values()} >= {"w-fast"}
    verifier = next(iter(rest["verifier"].values()))
    assert set(verifier.header.provenance) == {"solver"} and verifier.loss_mask.min() == 0
