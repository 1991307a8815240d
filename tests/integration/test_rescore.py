"""Re-scoring at the intake on the real broker: a real worker's groups agree with the checker; groups of
a worker that lies about its rewards are counted against it, rejected to the DLQ, or trained with the
checker's rewards, as ``intake.rescore`` says."""

from __future__ import annotations

import signal
import time

import pytest

from broker.codec import encode_group, encode_prompt
from broker.producer import Producer
from broker.schema import PromptRecord, TrajectoryGroup
from consumers.dataset import Row
from consumers.intake import IntakeConfig, TrainerIntake
from consumers.rescore import Rescorer
from rlbus.examples.addition import AdditionTask
from tests.integration.test_rollout_path import _read_dlq
from tests.unit.test_rescore import _with
from trainer.model import load_policy

pytestmark = pytest.mark.integration

ROWS = [Row(key=f"row-{a}-{b}", prompt=f"{a}+{b}=", answer=str(a + b)) for a, b in ((1, 2), (3, 4), (5, 0), (2, 2), (6, 1))]


def _intake(run, mode: str) -> TrainerIntake:
    _, tokenizer = load_policy(run.model_dir)
    intake = TrainerIntake(run.kafka, run.topics, "main", IntakeConfig(rescore=mode), max_staleness=4, vocab_size=64,
                           rescorer=Rescorer(AdditionTask(), ROWS, tokenizer))
    intake.start()
    return intake


def _delivered(intake: TrainerIntake, want: int, timeout_s: float) -> dict[str, TrajectoryGroup]:
    got: dict[str, TrajectoryGroup] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < want and time.monotonic() < deadline:
        batch = intake.next_batch(want, version=0, timeout_s=2.0)
        got.update((g.header.group_id, g) for g in (batch.groups if batch else []))
    return got


def test_rewards_are_checked_again_at_the_intake_and_disagreements_counted_per_worker(policy_run, tmp_path) -> None:
    producer = Producer(policy_run.kafka)
    for i, row in enumerate(ROWS):
        record = PromptRecord(run=policy_run.topics.run, policy="main", prompt_id=f"p{i}", prompt_key=row.key,
                              task="addition", prompt=row.prompt, answer=row.answer, group_size=4, dispatch_version=0)
        producer.send_and_wait(policy_run.topics.prompts("main"), encode_prompt(record), key=record.prompt_id.encode())
    worker = policy_run.worker(worker_id="w-honest", log=tmp_path / "w.log")
    counting = _intake(policy_run, "count")
    try:
        honest = _delivered(counting, len(ROWS), timeout_s=180)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
    assert len(honest) == len(ROWS), (tmp_path / "w.log").read_text()[-3000:]

    # A liar flips every reward of copies of the honest groups; another claims a row its prompt is not.
    trajectories = policy_run.topics.trajectories("main")
    lies = [_with(g, group_id=f"lie-{g.header.prompt_id}", worker_id="liar", rewards=[1.0 - r for r in g.header.rewards])
            for g in honest.values()]
    first = next(iter(honest.values()))
    swapped = _with(first, group_id="swapped", worker_id="swapper",
                    prompt_key=next(r.key for r in ROWS if r.key != first.header.prompt_key))
    for group in (*lies, swapped):
        producer.send_and_wait(trajectories, encode_group(group), key=group.header.group_id.encode())
    producer.close()
    try:
        counted = _delivered(counting, len(lies) + 1, timeout_s=60)
    finally:
        counting.close()
    assert set(counted) == {g.header.group_id for g in (*lies, swapped)}  # count only: all trained on
    stats = counting.stats
    assert dict(stats.rescored) == {"w-honest": len(ROWS), "liar": len(ROWS)}
    assert dict(stats.disagreements) == {"liar": len(ROWS)}  # the real worker's rewards all agree
    assert dict(stats.unscored) == {"swapper": 1}

    rejecting = _intake(policy_run, "reject")  # nothing was committed: it reads the topic again from its start
    try:
        kept = _delivered(rejecting, len(ROWS), timeout_s=60)
        parked = _read_dlq(policy_run, len(lies) + 1)
    finally:
        rejecting.close()
    assert set(kept) == set(honest)
    reasons = sorted(r.headers["rlbus-dlq-reason"] for r in parked)
    assert len(reasons) == len(lies) + 1
    assert sum(r.startswith("rewards disagree with the task's checker: claimed rewards") for r in reasons) == len(lies)
    assert sum(r.startswith("cannot be re-scored: prompt tokens are not those of dataset row") for r in reasons) == 1

    replacing = _intake(policy_run, "replace")
    try:
        trained = _delivered(replacing, 2 * len(ROWS), timeout_s=60)
        parked = _read_dlq(policy_run, 2 * (len(lies) + 1) + 1, timeout_s=15)
    finally:
        replacing.close()
    assert set(trained) == set(honest) | {g.header.group_id for g in lies}
    for lie in lies:  # trained with what the checker gives: the honest rewards of the same completions
        assert trained[lie.header.group_id].header.rewards == honest[f"{lie.header.prompt_id}/main"].header.rewards
    assert len(parked) == len(lies) + 1 + 1  # the swapped group again, nothing else
