"""Worker → trajectory topic → trainer intake on a real broker, with a real tiny model.

The workers here are the real ``rlbus worker`` command in subprocesses, attached with nothing
but --broker and --store, as a user attaches one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
import signal
import subprocess
import time

import numpy as np
import pytest
from broker.admin import committed_offsets
from broker.codec import decode_group, encode_group, encode_prompt
from broker.errors import DeliveryFailed
from broker.producer import Producer
from broker.reader import GroupReader, PartitionReader
from broker.schema import PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader
from consumers.intake import IntakeConfig, TrainerIntake
from producers.worker import AckedCommits
from tests.fixtures.helpers import read_topic

pytestmark = pytest.mark.integration


def _prompts(run, n: int, group_size: int = 4) -> list[str]:
    producer = Producer(run.kafka)
    ids, sent = [], []
    for i in range(n):
        a, b = i % 10, (3 * i) % 10
        rec = PromptRecord(run=run.topics.run, policy="main", prompt_id=f"p{i}", task="addition",
                           prompt=f"{a}+{b}=", answer=str(a + b), group_size=group_size, dispatch_version=0)
        sent.append(producer.produce(run.topics.prompts("main"), encode_prompt(rec), key=rec.prompt_id.encode()))
        ids.append(rec.prompt_id)
    producer.close()
    assert all(s.result() for s in sent)
    return ids


@contextmanager
def _intake(run, vocab: int = 64, store=None) -> Iterator[TrainerIntake]:
    """A started trainer intake of policy ``main``, closed when the block ends (its stats stay readable)."""
    intake = TrainerIntake(run.kafka, run.topics, "main", IntakeConfig(), max_staleness=4, vocab_size=vocab,
                           store=store)
    intake.start()
    try:
        yield intake
    finally:
        intake.close()


@contextmanager
def _stopped_at_exit(worker: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """``worker`` (`rlbus worker`), stopped as an operator stops it when the block ends: SIGTERM,
    then up to 60 s to drain and exit (its exit status is then ``worker.returncode``)."""
    try:
        yield worker
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)


def _collect(intake: TrainerIntake, want: set[str], timeout_s: float) -> dict[str, TrajectoryGroup]:
    got: dict[str, TrajectoryGroup] = {}
    deadline = time.monotonic() + timeout_s
    while set(got) < want and time.monotonic() < deadline:
        batch = intake.next_batch(len(want), version=0, timeout_s=2.0)
        for g in batch.groups if batch else []:
            got[g.header.prompt_id] = g
    return got


def test_worker_publishes_groups_the_intake_receives(policy_run, tmp_path) -> None:
    ids = _prompts(policy_run, 6)
    worker = policy_run.worker(worker_id="w-a", log=tmp_path / "w.log")
    with _intake(policy_run) as intake, _stopped_at_exit(worker):
        got = _collect(intake, set(ids), timeout_s=180)
    assert set(got) == set(ids), (tmp_path / "w.log").read_text()[-3000:]
    assert worker.returncode == 0, "worker did not drain and exit cleanly on SIGTERM"
    # Before exiting, the worker committed every prompt whose group the broker acknowledged.
    assert _committed_prompts(policy_run) == len(ids)
    for pid, group in got.items():
        h = group.header
        assert h.worker_id == "w-a" and h.group_size == 4 and h.min_version == h.max_version == 0
        assert set(h.rewards) <= {0.0, 1.0}
        assert (group.token_versions == 0).all()
        assert np.all(group.behaviour_logprobs <= 0)
        assert h.sampling.max_new_tokens == 3
        assert max(np.diff(group.completion_offsets)) <= 3
    # Each generated batch (one created_at) went to one partition: one produced batch, not one per group.
    where = {decode_group(r.value).header.prompt_id: r.partition
             for r in read_topic(policy_run.kafka, policy_run.topics.trajectories("main"))}
    batches: dict[float, set[int]] = {}
    for pid, group in got.items():
        batches.setdefault(group.header.created_at, set()).add(where[pid])
    assert all(len(parts) == 1 for parts in batches.values()), batches


def _committed_prompts(run) -> int:
    """Prompt offsets committed by the workers' consumer group, over every partition."""
    offsets = committed_offsets(run.kafka, f"{run.topics.run}.rollout", run.topics.prompts("main"))
    return sum(o or 0 for o in offsets.values())


async def _commit_order(run) -> None:
    topic = run.topics.prompts("main")
    reader = GroupReader(run.kafka, f"{run.topics.run}.rollout", [topic])
    producer = Producer(run.kafka)
    try:
        tp = (topic, 0)
        for i in range(8):  # a member commits only offsets of what it read
            producer.send_and_wait(topic, b"prompt %d" % i, partition=0)
        read = 0
        for _ in range(300):  # joined the group, holds the partition and read it: commits are accepted
            if tp in reader.assignment() and read >= 8:
                break
            read += len(await asyncio.to_thread(reader.read, 8, 0.2))
        else:
            raise AssertionError(f"never assigned {tp} or read its 8 records: {reader.assignment()}, {read}")
        commits: list[int] = []

        def commit(offsets: dict) -> None:
            commits.append(offsets[tp])  # recorded when a commit starts
            assert reader.commit(offsets)

        def committed() -> int | None:
            return reader.committed([tp])[tp]

        acks = AckedCommits(commit)
        loop = asyncio.get_running_loop()
        first = loop.create_future()  # the first batch's acknowledgement comes last
        acks.add([first], {tp: 2}, nbytes=100, groups=1)
        second = producer.send(run.topics.trajectories("main"), b"group", partition=0)
        acks.add([second], {tp: 4}, nbytes=100, groups=1)
        await second
        await acks.settle(1000)  # within the byte bound: returns at once
        assert commits == [] and committed() is None  # batch 2 acknowledged, but behind batch 1
        with pytest.raises(TimeoutError):  # over the bound: waits for the acknowledgement
            await asyncio.wait_for(acks.settle(150), timeout=0.5)
        first.set_result(None)
        await acks.settle(0)
        assert commits == [2, 4] and committed() == 4 and acks.acknowledged == 2 and acks.unacked_bytes == 0

        lost = loop.create_future()  # a delivery that fails: that batch and every later one stay uncommitted
        acks.add([lost], {tp: 6}, nbytes=100, groups=1)
        fourth = producer.send(run.topics.trajectories("main"), b"group", partition=0)
        acks.add([fourth], {tp: 8}, nbytes=100, groups=1)
        await fourth
        lost.set_exception(DeliveryFailed(topic, "test"))
        with pytest.raises(DeliveryFailed):
            await acks.settle(0)  # the lost batch
        with pytest.raises(DeliveryFailed):
            await acks.settle(0)  # the batch after it, acknowledged, fails with it
        assert commits == [2, 4] and committed() == 4
    finally:
        producer.close()
        reader.close()


def test_prompt_offsets_are_committed_in_batch_order_after_their_groups_are_acknowledged(policy_run) -> None:
    asyncio.run(_commit_order(policy_run))


def test_prompts_of_a_killed_worker_are_redelivered(policy_run, tmp_path) -> None:
    ids = _prompts(policy_run, 30)
    # A slow worker (at 1/100 of its speed) holds prompts uncommitted when it is killed.
    slow = policy_run.worker("--set", "worker.bench_speed=0.01", "--set", "worker.max_prompts_per_poll=2", worker_id="w-slow", log=tmp_path / "slow.log")
    with _intake(policy_run) as intake:
        first: dict[str, TrajectoryGroup] = {}
        deadline = time.monotonic() + 180
        while not first and time.monotonic() < deadline:
            batch = intake.next_batch(1, version=0, timeout_s=1.0)
            first = {g.header.prompt_id: g for g in batch.groups} if batch else {}
        assert first, (tmp_path / "slow.log").read_text()[-3000:]
        slow.send_signal(signal.SIGKILL)
        slow.wait(timeout=30)
        with _stopped_at_exit(policy_run.worker(worker_id="w-fast", log=tmp_path / "fast.log")):
            rest = _collect(intake, set(ids) - set(first), timeout_s=180)
    assert set(first) | set(rest) == set(ids), (tmp_path / "fast.log").read_text()[-3000:]
    # Groups the slow worker published before it died count; what it held uncommitted went to w-fast.
    assert "w-fast" in {g.header.worker_id for g in rest.values()}
    assert {g.header.worker_id for g in first.values()} == {"w-slow"}


def _group(run, prompt_id: str, vocab: int, token: int = 5) -> TrajectoryGroup:
    header = TrajectoryHeader(
        run=run.topics.run, policy="main", group_id=f"{prompt_id}/main", prompt_id=prompt_id, task="addition",
        worker_id="crafted", sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2),
        rewards=[1.0, 0.0], finish_reasons=["stop", "length"], min_version=0, max_version=0,
        vocab_size=vocab, created_at=time.time(),
    )
    return TrajectoryGroup(
        header=header, prompt_tokens=np.array([1, 2], np.int32), completion_tokens=np.array([3, 4, token], np.int32),
        completion_offsets=np.array([0, 1, 3], np.int32), behaviour_logprobs=np.array([-0.1, -0.2, -0.3], np.float32),
        token_versions=np.zeros(3, np.int32),
    )


def test_malformed_records_go_to_the_dlq_and_the_trainer_goes_on(policy_run) -> None:
    topic = policy_run.topics.trajectories("main")
    producer = Producer(policy_run.kafka)
    garbage = b"\x00not a trajectory group"
    producer.send_and_wait(topic, garbage, key=b"x", partition=0)
    too_big_vocab = encode_group(_group(policy_run, "p-bad-vocab", vocab=10_000, token=100))
    producer.send_and_wait(topic, too_big_vocab, key=b"y", partition=0)
    good = _group(policy_run, "p-good", vocab=64)
    producer.send_and_wait(topic, encode_group(good), key=b"z", partition=0)
    producer.close()

    with _intake(policy_run, vocab=64) as intake:
        got = _collect(intake, {"p-good"}, timeout_s=60)
    assert set(got) == {"p-good"}
    assert intake.stats.rejected == 2

    parked = _read_dlq(policy_run, 2)
    assert [r.value for r in parked] == [garbage, too_big_vocab]
    reasons = [r.headers["rlbus-dlq-reason"] for r in parked]
    assert "magic" in reasons[0].lower() or "short" in reasons[0].lower()
    assert "vocab" in reasons[1].lower()
    assert all(r.headers["rlbus-dlq-source-topic"] == topic for r in parked)


def test_a_record_over_the_size_limit_costs_one_record_not_the_trainer(policy_run) -> None:
    """20 MB on the trajectory topic (a producer with a higher limit than the run's): its DLQ copy
    cannot carry the bytes, so it carries the reason and where they are; the intake goes on."""
    topic = policy_run.topics.trajectories("main")
    limit = policy_run.kafka.max_message_bytes
    big = Producer(policy_run.kafka.model_copy(update={"max_message_bytes": 3 * limit}))
    huge = b"\x00" * (2 * limit + 12345)
    big.send_and_wait(topic, huge, key=b"huge", partition=0)
    big.send_and_wait(topic, encode_group(_group(policy_run, "p-after-huge", vocab=64)), key=b"ok", partition=0)
    big.close()

    with _intake(policy_run, vocab=64) as intake:
        got = _collect(intake, {"p-after-huge"}, timeout_s=60)
    assert set(got) == {"p-after-huge"} and intake.stats.rejected == 1
    (parked,) = _read_dlq(policy_run, 1)
    assert parked.value in (None, b"")
    assert parked.headers["rlbus-dlq-omitted-bytes"] == str(len(huge))
    assert parked.headers["rlbus-dlq-source-offset"] == "0" and "max_message_bytes" in parked.headers["rlbus-dlq-reason"]


def test_groups_of_another_run_or_claiming_future_versions_are_never_trained(policy_run) -> None:
    topic = policy_run.topics.trajectories("main")
    other_run = _group(policy_run, "p-other-run", vocab=64)
    other_run.header = other_run.header.model_copy(update={"run": "someone-else"})
    future = _group(policy_run, "p-future", vocab=64)
    future.header = future.header.model_copy(update={"min_version": 10**6, "max_version": 10**6})
    future.token_versions = np.full(3, 10**6, np.int32)
    producer = Producer(policy_run.kafka)
    for group in (other_run, future, _group(policy_run, "p-fine", vocab=64)):
        producer.send_and_wait(topic, encode_group(group), key=group.header.group_id.encode(), partition=0)
    producer.close()

    with _intake(policy_run, vocab=64) as intake:
        got = _collect(intake, {"p-fine"}, timeout_s=60)
        # The trainer is at version 0: the future group stays out at any later call too.
        again = intake.next_batch(8, version=0, timeout_s=1.0)
    assert set(got) == {"p-fine"} and (again is None or not again.groups)
    assert intake.stats.rejected == 2
    reasons = " | ".join(r.headers["rlbus-dlq-reason"] for r in _read_dlq(policy_run, 2))
    assert "run 'someone-else'" in reasons and "version 1000000, above the trainer's 0" in reasons, reasons


def _trained_or_dropped(intake: TrainerIntake, records: int, timeout_s: float = 60) -> list[str]:
    """Prompt ids of the groups delivered for training until ``records`` were delivered or dropped
    as copies."""
    trained: list[str] = []
    deadline = time.monotonic() + timeout_s
    while intake.stats.duplicates + len(trained) < records and time.monotonic() < deadline:
        batch = intake.next_batch(8, version=0, timeout_s=1.0)
        trained += [g.header.prompt_id for g in batch.groups] if batch else []
    return trained


def test_a_group_delivered_twice_is_trained_once(policy_run) -> None:
    """The same group id on two partitions (a worker's retry after a lost acknowledgement, or a
    replay): the second copy is counted as a duplicate and never reaches a batch."""
    topic = policy_run.topics.trajectories("main")
    producer = Producer(policy_run.kafka)
    twice = encode_group(_group(policy_run, "p-twice", vocab=64))
    producer.send_and_wait(topic, twice, key=b"a", partition=0)
    producer.send_and_wait(topic, twice, key=b"b", partition=1)
    producer.send_and_wait(topic, encode_group(_group(policy_run, "p-once", vocab=64)), key=b"c", partition=2)
    producer.close()

    with _intake(policy_run, vocab=64) as intake:
        trained = _trained_or_dropped(intake, 3)
    assert sorted(trained) == ["p-once", "p-twice"] and intake.stats.duplicates == 1


def test_a_resumed_intake_still_drops_copies_of_groups_trained_before_the_checkpoint(policy_run) -> None:
    """A worker killed between publishing a group and committing its prompt makes a second copy
    (the prompt is redelivered). With the first copy trained before a checkpoint and the second
    after it, a resumed trainer trained it twice (its dedupe memory was lost with it, 3 groups in a
    chaos run); the checkpoint now keeps that memory."""
    topic = policy_run.topics.trajectories("main")
    producer = Producer(policy_run.kafka)
    copy = encode_group(_group(policy_run, "p-again", vocab=64))
    producer.send_and_wait(topic, copy, key=b"a", partition=0)
    with _intake(policy_run, vocab=64) as first:
        assert set(_collect(first, {"p-again"}, timeout_s=60)) == {"p-again"}
        kept = first.seen_ids()  # what the checkpoint keeps
    producer.send_and_wait(topic, copy, key=b"b", partition=1)
    producer.send_and_wait(topic, encode_group(_group(policy_run, "p-new", vocab=64)), key=b"c", partition=2)
    producer.close()
    resumed = TrainerIntake(policy_run.kafka, policy_run.topics, "main", IntakeConfig(), max_staleness=4,
                            vocab_size=64)
    resumed.remember(kept)
    resumed.start({(topic, 0): 1})  # from the checkpoint's offsets: past the first copy
    try:
        trained = _trained_or_dropped(resumed, 2)
    finally:
        resumed.close()
    assert trained == ["p-new"] and resumed.stats.duplicates == 1


def test_groups_over_the_record_limit_travel_through_the_store(policy_run, tmp_path) -> None:
    """Claim check, through the real worker: with a record limit below a group's size every group
    goes to the store and its record carries the reference; the intake fetches and checks them."""
    from weightstore.claims import PREFIX
    from weightstore.objectstore import LocalDirStore

    store = LocalDirStore(Path(policy_run.store_url))
    ids = _prompts(policy_run, 3, group_size=256)  # 256 samples: over 1 KiB even if each stops after one token
    worker = policy_run.worker("--set", "kafka.max_message_bytes=1024", worker_id="w-claims", log=tmp_path / "w.log")
    with _intake(policy_run, vocab=64, store=store) as intake, _stopped_at_exit(worker):
        got = _collect(intake, set(ids), timeout_s=180)
    assert set(got) == set(ids), (tmp_path / "w.log").read_text()[-3000:]
    assert intake.stats.claims == 3 and intake.stats.rejected == 0
    assert len(store.list(PREFIX)) == 3
    assert all(g.header.worker_id == "w-claims" and len(g.header.rewards) == 256 for g in got.values())
    assert all(len(store.get(key).data) > 1024 for key in store.list(PREFIX))


def test_a_tampered_or_missing_claim_checked_object_costs_that_record(policy_run) -> None:
    from broker.codec import encode_claim
    from weightstore.claims import put_claim, sweep
    from weightstore.objectstore import LocalDirStore

    store = LocalDirStore(Path(policy_run.store_url))
    topic = policy_run.topics.trajectories("main")
    claims = {}
    for pid in ("p-tampered", "p-missing", "p-intact"):
        group = _group(policy_run, pid, vocab=64)
        claims[pid] = put_claim(store, run=policy_run.topics.run, policy="main", group_id=group.header.group_id,
                                data=encode_group(group))
    path = Path(policy_run.store_url) / claims["p-tampered"].key
    data = path.read_bytes()
    path.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    store.delete(claims["p-missing"].key)
    producer = Producer(policy_run.kafka)
    for pid, claim in claims.items():
        producer.send_and_wait(topic, encode_claim(claim), key=pid.encode(), partition=0)
    producer.close()

    with _intake(policy_run, vocab=64, store=store) as intake:
        got = _collect(intake, {"p-intact"}, timeout_s=60)
    assert set(got) == {"p-intact"} and intake.stats.rejected == 2
    reasons = " | ".join(r.headers["rlbus-dlq-reason"] for r in _read_dlq(policy_run, 2))
    assert "tampered" in reasons and "missing" in reasons, reasons
    # Retention: objects older than it go (the orphaned and the rest alike), younger ones stay.
    assert sweep(store, max_age_s=3600) == 0
    assert sweep(store, max_age_s=3600, now=time.time() + 7200) == 2 and store.list("claims/") == []


def _read_dlq(run, n: int, timeout_s: float = 30.0) -> list:
    dlq = PartitionReader(run.kafka, run.topics.dlq)
    parked = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(parked) < n and time.monotonic() < deadline:
            parked += dlq.read(10, 1.0)
    finally:
        dlq.close()
    return parked


def test_prompts_a_task_cannot_use_go_to_the_dlq_and_the_worker_goes_on(policy_run, tmp_path) -> None:
    """A code task given tests that are not JSON, and a chat prompt for a tokenizer without a chat
    template: both prompts are parked with the reason; the good prompt beside them is served."""
    producer = Producer(policy_run.kafka)
    topic = policy_run.topics.prompts("main")
    good = PromptRecord(run=policy_run.topics.run, policy="main", prompt_id="ok", task="code",
                        prompt="1+1=", answer='{"asserts": ["assert True"]}', group_size=2, dispatch_version=0)
    bad_tests = good.model_copy(update={"prompt_id": "bad-tests", "answer": "not json"})
    chat = good.model_copy(update={"prompt_id": "chat", "messages": [{"role": "user", "content": "1+1="}]})
    for record in (bad_tests, chat, good):
        producer.send_and_wait(topic, encode_prompt(record), key=record.prompt_id.encode(), partition=0)
    producer.close()
    worker = policy_run.worker("--set", "run.task=code", "--set", 'run.task_params={"wall_s": 5, "cpu_s": 2}',
                               worker_id="w-code", log=tmp_path / "w.log")
    with _intake(policy_run) as intake, _stopped_at_exit(worker):
        parked = _read_dlq(policy_run, 2, timeout_s=180)
        served = _collect(intake, {"ok"}, timeout_s=120)
    reasons = [r.headers["rlbus-dlq-reason"] for r in parked]
    assert len(parked) == 2, (tmp_path / "w.log").read_text()[-3000:]
    assert any("must be JSON" in why for why in reasons) and any("chat template" in why for why in reasons), reasons
    assert set(served) == {"ok"} and served["ok"].header.task == "code"
