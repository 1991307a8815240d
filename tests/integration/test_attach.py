"""Workers attach with only a broker and a store, whatever the trainer's own client settings; with a
fleet key, the trainer takes signed groups and sends unsigned or forged ones to the DLQ."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from broker.codec import encode_group, encode_prompt
from broker.producer import Producer
from broker.reader import PartitionReader
from broker.schema import PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.topics import Topics
from consumers.intake import IntakeConfig, TrainerIntake
from tests.fixtures.helpers import wait_for
from tests.fixtures.policy import TEST_KAFKA

pytestmark = pytest.mark.integration

TRAINER_ONLY = [
    "kafka.partition_assignment_strategy=cooperative-sticky",  # never assigns on Tansu: a worker must not take it
    "kafka.enable_idempotence=true",
    "kafka.properties.statistics.interval.ms=0",
    "kafka.max_poll_interval_ms=600000",
    "intake.queue_max_groups=64",
]


def _prompts(kafka, topics: Topics, n: int) -> None:
    producer = Producer(kafka)
    for i in range(n):
        record = PromptRecord(run=topics.run, policy="main", prompt_id=f"p{i}", task="addition", prompt=f"{i}+1=",
                              answer=str(i + 1), group_size=2, dispatch_version=0)
        producer.produce(topics.prompts("main"), encode_prompt(record), key=record.prompt_id.encode())
    producer.close()


def _start(args: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "rlbus.cli", *args], stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=env)


def test_a_worker_attaches_to_a_run_whose_trainer_uses_settings_it_cannot(kafka_broker, run_name: str, tmp_path: Path,
                                                                         tiny_model_dir: Path) -> None:
    """The real trainer writes the run descriptor from a config with cooperative-sticky, idempotence and
    other client settings of its own; a worker given only --broker and --store joins and publishes."""
    store, topics = tmp_path / "store", Topics(run_name)
    sets = [f"run.name={run_name}", "sampling.group_size=2", "sampling.max_new_tokens=3", *TEST_KAFKA, *TRAINER_ONLY]
    trainer_log, worker_log = tmp_path / "trainer.log", tmp_path / "worker.log"
    trainer = _start(["trainer", "--broker", kafka_broker.bootstrap, "--store", str(store), "--model-dir",
                      str(tiny_model_dir), "--run-dir", str(tmp_path / "run"),
                      *[arg for s in sets for arg in ("--set", s)]], trainer_log)
    worker = None
    try:
        wait_for(lambda: (store / "rlbus-run.json").exists() and (store / "main" / "LATEST").exists(), 180,
                 "the trainer's run descriptor and weights v0", [trainer_log])
        from rlbus.config import load_config

        kafka = load_config(None, [f"kafka.bootstrap_servers={kafka_broker.bootstrap}"], environ={}).kafka
        _prompts(kafka, topics, 4)
        worker = _start(["worker", "--broker", kafka_broker.bootstrap, "--store", str(store), "--id", "w-attach"],
                        worker_log)
        reader = PartitionReader(kafka, topics.trajectories("main"))
        got: list = []
        try:
            wait_for(lambda: got.extend(reader.read(100, 0.5)) or len(got) >= 4, 180, "the worker's groups",
                     [trainer_log, worker_log])
        finally:
            reader.close()
        assert {r.headers["rlbus-policy"] for r in got} == {"main"}
    finally:
        for proc in (worker, trainer):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in (worker, trainer):
            if proc is not None:
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
    assert worker.returncode == 0, worker_log.read_text()[-3000:]
    assert "cooperative" not in worker_log.read_text()


def _group(run: str, prompt_id: str) -> TrajectoryGroup:
    header = TrajectoryHeader(
        run=run, policy="main", group_id=f"{prompt_id}/main", prompt_id=prompt_id, task="addition", worker_id="w",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2), rewards=[1.0, 0.0],
        finish_reasons=["stop", "stop"], min_version=0, max_version=0, vocab_size=64, created_at=time.time(),
    )
    return TrajectoryGroup(
        header=header, prompt_tokens=np.array([1, 2], np.int32), completion_tokens=np.array([3, 4], np.int32),
        completion_offsets=np.array([0, 1, 2], np.int32), behaviour_logprobs=np.array([-0.1, -0.2], np.float32),
        token_versions=np.zeros(2, np.int32),
    )


def test_with_a_fleet_key_unsigned_and_forged_groups_go_to_the_dlq_and_the_trainer_goes_on(policy_run) -> None:
    run, key = policy_run.topics.run, b"fleet-key"
    topic = policy_run.topics.trajectories("main")
    producer = Producer(policy_run.kafka)
    for value in (encode_group(_group(run, "p-unsigned")), encode_group(_group(run, "p-forged"), signing_key=b"other"),
                  encode_group(_group("another-run", "p-replayed"), signing_key=key),
                  encode_group(_group(run, "p-signed"), signing_key=key)):
        producer.send_and_wait(topic, value, partition=0)
    producer.close()
    with pytest.raises(ValueError, match="signing key"):
        TrainerIntake(policy_run.kafka, policy_run.topics, "main", IntakeConfig(require_signature=True),
                      max_staleness=4, vocab_size=64)
    # A key alone requires signatures (require_signature left at its default).
    intake = TrainerIntake(policy_run.kafka, policy_run.topics, "main", IntakeConfig(),
                           max_staleness=4, vocab_size=64, signing_key=key)
    intake.start()
    try:
        deadline, got = time.monotonic() + 60, []
        while not got and time.monotonic() < deadline:
            batch = intake.next_batch(3, version=0, timeout_s=1.0)
            got += [g.header.prompt_id for g in batch.groups] if batch else []
    finally:
        intake.close()
    assert got == ["p-signed"] and intake.stats.rejected == 3
    dlq = PartitionReader(policy_run.kafka, policy_run.topics.dlq)
    parked: list = []
    try:
        deadline = time.monotonic() + 30
        while len(parked) < 3 and time.monotonic() < deadline:
            parked += dlq.read(10, 1.0)
    finally:
        dlq.close()
    reasons = [r.headers["rlbus-dlq-reason"] for r in parked]
    assert "signature missing" in reasons[0] and "signature mismatch" in reasons[1], reasons
    assert "run 'another-run'" in reasons[2], reasons  # rightly signed, but replayed from another run


def test_a_worker_with_the_fleet_key_signs_what_it_publishes(policy_run, tmp_path: Path) -> None:
    key_file = tmp_path / "fleet.key"
    key_file.write_text("fleet-key\n")
    _prompts(policy_run.kafka, policy_run.topics, 3)
    worker = policy_run.worker("--set", f"signing.key_file={key_file}", worker_id="w-signed", log=tmp_path / "w.log")
    intake = TrainerIntake(policy_run.kafka, policy_run.topics, "main", IntakeConfig(require_signature=True),
                           max_staleness=4, vocab_size=64, signing_key=b"fleet-key")
    intake.start()
    try:
        deadline, got = time.monotonic() + 180, set()
        while len(got) < 3 and time.monotonic() < deadline:
            batch = intake.next_batch(3, version=0, timeout_s=1.0)
            got |= {g.header.prompt_id for g in batch.groups} if batch else set()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
        intake.close()
    assert got == {"p0", "p1", "p2"}, (tmp_path / "w.log").read_text()[-3000:]
    assert intake.stats.rejected == 0
