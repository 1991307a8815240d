"""Staleness guards 2 (worker) and 3 (trainer intake) on real parts.

Guard 1 (curator admission) is tested in tests/integration/test_curator.py; the whole system at
η = 0 in tests/e2e/test_sync.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from broker.codec import encode_group
from broker.producer import Producer
from broker.reader import Record
from broker.schema import PromptRecord, SamplingParams, TrajectoryGroup, TrajectoryHeader
from broker.settings import KafkaConfig
from broker.topics import Topics
from consumers.intake import IntakeConfig, TrainerIntake
from producers.config import WorkerConfig, WorkflowSpec
from producers.engines.torch_engine import TorchEngine
from producers.follow import StaleWeightsError, EngineFollower
from producers.worker import RolloutWorker, ServedPolicy, ServedWorkflow
from producers.workflows import load_workflow
from rlbus.examples.addition import AdditionTask
from trainer.model import load_policy
from weightstore.config import WeightsConfig
from weightstore.follow import WeightFollower
from weightstore.manifest import read_manifest
from weightstore.objectstore import LocalDirStore
from weightstore.publish import WeightPublisher

pytestmark = pytest.mark.integration


def _publish_versions(store: LocalDirStore, model_dir: Path, versions: range, policy: str = "main") -> None:
    model, _ = load_policy(model_dir)
    publisher = WeightPublisher(store, policy, WeightsConfig())
    for version in versions:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        publisher.publish(version, model.state_dict())


def _sync(store: LocalDirStore, model_dir: Path, timeout_s: float = 10.0, *, refresh: bool = False,
          policy: str = "main") -> EngineFollower:
    engine = TorchEngine(model_dir, seed=0, version=0)
    follower = WeightFollower(store, policy)
    return EngineFollower(follower, engine, poll_interval_s=0.05, sync_timeout_s=timeout_s, refresh_before_generation=refresh)


@pytest.mark.parametrize("eta", [0, 2])
def test_worker_syncs_before_generating_with_weights_too_old(tmp_path: Path, tiny_model_dir: Path, eta: int) -> None:
    """Guard 2: a worker on v0 asked for a prompt dispatched at v6 moves to at least v(6 − η) first."""
    store = LocalDirStore(tmp_path / "store")
    _publish_versions(store, tiny_model_dir, range(0, 7))
    sync = _sync(store, tiny_model_dir)
    assert sync.engine.version == 0
    asyncio.run(sync.ensure_fresh(required_version=6, max_staleness=eta))
    assert sync.engine.version >= 6 - eta
    assert sync.engine.version == 6  # it takes the newest there is, not the oldest allowed


def test_worker_within_budget_generates_without_syncing(tmp_path: Path, tiny_model_dir: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    _publish_versions(store, tiny_model_dir, range(0, 1))
    sync = _sync(store, tiny_model_dir)
    asyncio.run(sync.ensure_fresh(required_version=3, max_staleness=4))
    assert sync.engine.version == 0 and sync.syncs == 0


def test_worker_refuses_to_generate_when_fresh_weights_never_come(tmp_path: Path, tiny_model_dir: Path) -> None:
    store = LocalDirStore(tmp_path / "store")
    _publish_versions(store, tiny_model_dir, range(0, 2))
    sync = _sync(store, tiny_model_dir, timeout_s=1.0)
    with pytest.raises(StaleWeightsError, match="needs ≥ v5"):
        asyncio.run(sync.ensure_fresh(required_version=9, max_staleness=4))
    assert sync.engine.version == 1


def test_a_worker_that_cannot_build_the_newest_version_waits_for_the_trainers_repair_anchor(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """A damaged chunk on the delta chain of the newest version: the worker's guard keeps its
    weights and retries (it died of the IntegrityError, and with it every worker of the fleet), and
    moves as soon as the trainer republishes its weights as an anchor under the next version."""
    store = LocalDirStore(tmp_path / "store")
    model, _ = load_policy(tiny_model_dir)
    publisher = WeightPublisher(store, "main", WeightsConfig(anchor_every=100))
    sync = _sync(store, tiny_model_dir, timeout_s=120)
    for version in range(3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        publisher.publish(version, model.state_dict())
        if version == 1:
            asyncio.run(sync.ensure_fresh(required_version=1, max_staleness=0))
    assert sync.engine.version == 1
    chunk = read_manifest(store, "main", 2).chunks[0]
    store.put(chunk.key, bytes([store.get(chunk.key).data[0] ^ 1]) + store.get(chunk.key).data[1:])

    async def scenario() -> None:
        waiting = asyncio.create_task(sync.ensure_fresh(required_version=2, max_staleness=0))
        await asyncio.sleep(1.0)
        assert not waiting.done() and sync.engine.version == 1  # still alive, on its weights
        info = await asyncio.to_thread(publisher.publish, 3, model.state_dict(), anchor=True)
        assert info.kind == "anchor"
        await asyncio.wait_for(waiting, 60)

    asyncio.run(scenario())
    assert sync.engine.version == 3


def test_refresh_moves_to_the_newest_version(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Before a generation the worker asks the store for LATEST, announced or not."""
    store = LocalDirStore(tmp_path / "store")
    _publish_versions(store, tiny_model_dir, range(0, 4))
    sync = _sync(store, tiny_model_dir, refresh=True)
    asyncio.run(sync.refresh())
    assert sync.engine.version == 3 and sync.syncs == 1
    asyncio.run(sync.refresh())  # nothing new: nothing loaded
    assert sync.syncs == 1


def test_idle_worker_follows_announcements_only_while_generating(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With refresh_before_generation an announced version is applied during a generation (in-flight
    update), never while the worker is idle; an always-following worker applies it at once."""
    store = LocalDirStore(tmp_path / "store")
    _publish_versions(store, tiny_model_dir, range(0, 3))

    async def scenario(sync: EngineFollower) -> tuple[int, int]:
        stop, announced = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(sync.follow(stop, announced))
        announced.set()
        for _ in range(200):  # the idle announcement has been seen (and skipped, or applied)
            await asyncio.sleep(0.01)
            if sync.idle_skips or sync.syncs:
                break
        idle_version = sync.engine.version
        with sync.generating():
            announced.set()
            for _ in range(1000):
                await asyncio.sleep(0.01)
                if sync.engine.version == 2:
                    break
            busy_version = sync.engine.version
        stop.set()
        announced.set()
        await task
        return idle_version, busy_version

    lazy = _sync(store, tiny_model_dir, refresh=True)
    assert asyncio.run(scenario(lazy)) == (0, 2)
    assert lazy.idle_skips >= 1
    eager = _sync(store, tiny_model_dir, refresh=False)
    assert asyncio.run(scenario(eager)) == (2, 2)
    assert eager.idle_skips == 0


def test_a_worker_keeps_each_policys_own_bound(tmp_path: Path, tiny_model_dir: Path) -> None:
    """Guard 2 per policy: before a solver_verifier batch dispatched when both trainers were at v6, the
    verifier (η = 0) moves to v6 while the solver (η = 10) may stay on v0; each policy's tokens carry
    its own versions, and the verifier's group names the solver versions it judged."""
    store = LocalDirStore(tmp_path / "store")
    for policy in ("solver", "verifier"):
        _publish_versions(store, tiny_model_dir, range(0, 7), policy=policy)
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2)
    served = {
        name: ServedPolicy(sync.engine, sync, sampling, eta)
        for name, eta in (("solver", 10), ("verifier", 0))
        for sync in [_sync(store, tiny_model_dir, policy=name)]
    }
    spec = WorkflowSpec(name="solve", type="solver_verifier", roles={"solver": "solver", "verifier": "verifier"},
                        params={"template": "{prompt}{completion}=", "accept": "1", "reject": "0"})
    flow = ServedWorkflow(spec, load_workflow(spec))
    worker = RolloutWorker(kafka=KafkaConfig(), topics=Topics("r"), workflows=[flow], policies=served,
                           task=AdditionTask(), config=WorkerConfig())
    prompt = PromptRecord(run="r", policy="solve", prompt_id="p0", task="addition", prompt="2+3=", answer="5",
                          group_size=4, dispatch_version=6, dispatch_versions={"solver": 6, "verifier": 6})
    record = Record(topic="r.prompts.solve", partition=0, offset=0, key=b"p0", value=b"", headers={}, timestamp_ms=0)
    ((_, groups, _),) = asyncio.run(worker._run_workflow(flow, [(record, prompt)]))
    assert served["solver"].engine.version == 0 and served["verifier"].engine.version == 6
    solver, verifier = groups
    assert (solver.header.policy, solver.header.min_version, solver.header.max_version) == ("solver", 0, 0)
    assert (verifier.header.policy, verifier.header.min_version, verifier.header.max_version) == ("verifier", 6, 6)
    assert set(verifier.token_versions.tolist()) == {6} and verifier.header.provenance == {"solver": [0, 0]}
    assert solver.header.group_id == "p0/solver" and verifier.header.group_id == "p0/verifier"


def _group(run: str, gid: str, min_version: int) -> TrajectoryGroup:
    header = TrajectoryHeader(
        run=run, policy="main", group_id=gid, prompt_id=gid, task="addition", worker_id="w",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=2), rewards=[0.0, 1.0],
        finish_reasons=["stop", "stop"], min_version=min_version, max_version=min_version + 1,
        vocab_size=64, created_at=time.time(),
    )
    return TrajectoryGroup(
        header=header, prompt_tokens=np.array([1, 2], np.int32), completion_tokens=np.array([3, 4], np.int32),
        completion_offsets=np.array([0, 1, 2], np.int32), behaviour_logprobs=np.array([-0.1, -0.2], np.float32),
        token_versions=np.array([min_version, min_version + 1], np.int32),
    )


def test_intake_drops_and_counts_groups_older_than_the_bound(policy_run) -> None:
    """Guard 3: at trainer version 10 with η = 4, a group whose oldest token is v5 is dropped and
    counted; v6 (lag exactly η) is trained on."""
    producer = Producer(policy_run.kafka)
    versions = {"g-v0": 0, "g-v5": 5, "g-v6": 6, "g-v9": 9}  # each group's tokens are v and v + 1
    for gid, v in versions.items():
        producer.send_and_wait(policy_run.topics.trajectories("main"),
                               encode_group(_group(policy_run.topics.run, gid, v)), key=gid.encode())
    producer.close()
    intake = TrainerIntake(policy_run.kafka, policy_run.topics, "main", IntakeConfig(), max_staleness=4, vocab_size=64)
    intake.start()
    kept, dropped, consumed = [], 0, 0
    try:
        deadline = time.monotonic() + 60
        while consumed < len(versions) and time.monotonic() < deadline:
            batch = intake.next_batch(len(versions), version=10, timeout_s=1.0)
            if batch is None:
                continue
            kept += [g.header.group_id for g in batch.groups]
            dropped += batch.dropped_stale
            consumed += len(batch.groups) + batch.dropped_stale
    finally:
        intake.close()
    assert sorted(kept) == ["g-v6", "g-v9"]
    assert dropped == 2 and intake.stats.dropped_stale == 2


def test_after_a_resume_staleness_counts_from_the_checkpoint(policy_run) -> None:
    """Guard 3 across a resume: checkpoint at v10 (step 10), the store had reached v14 before the
    crash, so the resumed trainer is at v15. Groups generated by v6..v13 are within η = 4 steps of
    the checkpoint's weights and are trained on; counted by version labels alone (15 − v) those
    from v6..v10 were dropped as stale. v2 is 8 steps behind and is dropped."""
    from trainer.loop import Fork, TrainerState

    producer = Producer(policy_run.kafka)
    versions = {"g-v2": 2, "g-v6": 6, "g-v8": 8, "g-v10": 10, "g-v13": 13}
    for gid, v in versions.items():
        producer.send_and_wait(policy_run.topics.trajectories("main"),
                               encode_group(_group(policy_run.topics.run, gid, v)), key=gid.encode())
    producer.close()
    state = TrainerState(version=15, step=10, fork=Fork(version=10, step=10, resumed_at=15))
    intake = TrainerIntake(policy_run.kafka, policy_run.topics, "main", IntakeConfig(), max_staleness=4, vocab_size=64)
    intake.start()
    kept, consumed = [], 0
    try:
        deadline = time.monotonic() + 60
        while consumed < len(versions) and time.monotonic() < deadline:
            batch = intake.next_batch(len(versions), version=state.version, timeout_s=1.0, lag=state.lag)
            if batch is None:
                continue
            kept += [g.header.group_id for g in batch.groups]
            consumed += len(batch.groups) + batch.dropped_stale
    finally:
        intake.close()
    assert sorted(kept) == ["g-v10", "g-v13", "g-v6", "g-v8"] and intake.stats.dropped_stale == 1


def test_a_trainer_resumes_past_a_manifest_whose_latest_swap_a_crash_stopped(policy_run, tmp_path: Path) -> None:
    """A crash between writing v4's manifest and swapping LATEST (still at v3): the restarted trainer
    publishes after v4, as a delta on it (it published v4 again and failed on the conflict)."""
    from rlbus.config import worker_descriptor
    from trainer.config import TrainerConfig
    from trainer.role import run_trainer
    from weightstore.config import WeightsConfig
    from weightstore.manifest import latest_key, read_manifest
    from weightstore.objectstore import LocalDirStore
    from weightstore.publish import WeightPublisher

    store = LocalDirStore(Path(policy_run.store_url))
    model, _ = load_policy(policy_run.model_dir)
    publisher = WeightPublisher(store, "main", WeightsConfig())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for version in (1, 2, 3, 4):
        for t in state.values():
            t.add_(1e-3)
        if version == 4:
            at_v3 = store.get(latest_key("main")).data
        publisher.publish(version, state)
    store.put(latest_key("main"), at_v3)  # as if the crash came before the swap
    cfg = policy_run.cfg
    version = run_trainer(
        kafka=policy_run.kafka, topics=policy_run.topics, policy="main", store=store,
        config=TrainerConfig(max_steps=1), weights=WeightsConfig(), intake=IntakeConfig(), stages=[],
        temperature=1.0, max_staleness=4, model_dir=policy_run.model_dir, run_dir=tmp_path,
        metrics_path=tmp_path / "metrics.jsonl", descriptor=worker_descriptor(cfg), should_stop=lambda: True)  # publish, then stop
    assert version == 5
    manifest = read_manifest(store, "main", 5)
    assert manifest.kind == "delta" and manifest.base_version == 4


def test_a_trainer_stopped_by_a_signal_leaves_the_run_going_and_rlbus_stop_ends_it(policy_run, tmp_path: Path) -> None:
    """A trainer stopped by a signal (a restarted container, a rescheduled pod) checkpoints and leaves
    without ending the run: no `finished` record, so the curator and the workers wait for the trainer
    started again. `rlbus stop` ends the run for every role."""
    import subprocess
    import sys

    from broker.control import ControlReader
    from rlbus.config import worker_descriptor
    from trainer.checkpoint import load_latest_checkpoint
    from trainer.config import TrainerConfig
    from trainer.role import run_trainer

    store = LocalDirStore(Path(policy_run.store_url))
    run_trainer(
        kafka=policy_run.kafka, topics=policy_run.topics, policy="main", store=store,
        config=TrainerConfig(max_steps=10), weights=WeightsConfig(), intake=IntakeConfig(), stages=[],
        temperature=1.0, max_staleness=4, model_dir=policy_run.model_dir, run_dir=tmp_path,
        metrics_path=tmp_path / "metrics.jsonl", descriptor=worker_descriptor(policy_run.cfg),
        should_stop=lambda: True)
    assert load_latest_checkpoint(tmp_path / "checkpoints" / "main") is not None, "the stopped trainer left no checkpoint to resume from"
    control = ControlReader(policy_run.kafka, policy_run.topics, from_beginning=True)
    try:
        seen = [r.kind for r in control.poll(5.0)] + [r.kind for r in control.poll(1.0)]
        assert "version" in seen and "finished" not in seen, seen
        assert not control.over(["main"])
        done = subprocess.run([sys.executable, "-m", "rlbus.cli", "stop", "--broker",
                               policy_run.kafka.bootstrap_servers, "--store", policy_run.store_url, "--reason", "test"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        deadline = time.monotonic() + 30
        while not control.over(["main"]) and time.monotonic() < deadline:
            control.poll(0.5)
        assert control.stopped is not None and control.stopped.reason == "test"
    finally:
        control.close()


def test_a_trainer_stopped_while_its_batch_fills_stops_at_once_and_the_resumed_one_trains_those_groups(
        policy_run, tmp_path: Path) -> None:
    """The fleet stops first (`docker compose down` stops the workers before the trainer), so a trainer
    stopped while its batch is part full must not wait for the rest: it stops without that step, and
    the groups it had read are neither lost nor taken for copies by the trainer that resumes."""
    import json
    import threading

    from rlbus.config import worker_descriptor
    from tests.integration.test_rollout_path import _group
    from trainer.config import TrainerConfig
    from trainer.role import run_trainer

    store = LocalDirStore(Path(policy_run.store_url))
    topic = policy_run.topics.trajectories("main")
    producer = Producer(policy_run.kafka)
    for n in range(2):
        producer.send_and_wait(topic, encode_group(_group(policy_run, f"p-half-{n}", vocab=64)), partition=n)
    stop = threading.Event()
    done: dict = {}
    run_dir = tmp_path / "run"  # created by the trainer

    def train(groups_per_step: int, should_stop) -> None:
        try:
            done["version"] = run_trainer(
                kafka=policy_run.kafka, topics=policy_run.topics, policy="main", store=store,
                config=TrainerConfig(max_steps=1, groups_per_step=groups_per_step, idle_timeout_s=60),
                weights=WeightsConfig(),
                intake=IntakeConfig(), stages=[], temperature=1.0, max_staleness=4, model_dir=policy_run.model_dir,
                run_dir=run_dir, metrics_path=run_dir / "metrics.jsonl",
                descriptor=worker_descriptor(policy_run.cfg), should_stop=should_stop)
        except BaseException as exc:  # surfaced below
            done["error"] = exc

    first = threading.Thread(target=train, args=(4, stop.is_set), daemon=True)
    first.start()
    time.sleep(8)  # the two groups are read; the batch waits for two more that never come
    stop.set()
    first.join(timeout=60)
    assert not first.is_alive(), "the stopped trainer went on waiting for a full batch"
    assert "error" not in done, done
    assert not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().strip()
    train(2, lambda: False)  # resumes from the stopped trainer's checkpoint
    producer.close()
    assert "error" not in done, done
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert sorted(rows[-1]["trained_group_ids"]) == ["p-half-0/main", "p-half-1/main"], rows


def test_a_trainer_without_fresh_groups_republishes_its_weights_as_an_anchor(policy_run, tmp_path: Path) -> None:
    """Once groups have flowed, ``repair_anchor_after_s`` without a fresh one: the trainer publishes
    its weights again, as a full anchor under the next version, without a step (a fleet stuck
    before a version it cannot build waited for fresh groups nobody could make, and no later anchor
    ever came). Then it trains on."""
    import threading

    from rlbus.config import worker_descriptor
    from tests.integration.test_rollout_path import _group
    from trainer.config import TrainerConfig
    from trainer.role import run_trainer
    from weightstore.manifest import manifest_versions

    store = LocalDirStore(Path(policy_run.store_url))
    topic = policy_run.topics.trajectories("main")
    producer = Producer(policy_run.kafka)
    producer.send_and_wait(topic, encode_group(_group(policy_run, "p-first", vocab=64)), partition=0)
    config = TrainerConfig(max_steps=2, groups_per_step=1, repair_anchor_after_s=2.0, checkpoint_every=100)
    done: dict = {}

    def train() -> None:
        try:
            done["version"] = run_trainer(
                kafka=policy_run.kafka, topics=policy_run.topics, policy="main", store=store, config=config,
                weights=WeightsConfig(anchor_every=100), intake=IntakeConfig(), stages=[], temperature=1.0,
                max_staleness=4, model_dir=policy_run.model_dir, run_dir=tmp_path / "run",  # created by the trainer
                metrics_path=tmp_path / "run" / "metrics.jsonl", descriptor=worker_descriptor(policy_run.cfg),
                should_stop=lambda: False)
        except BaseException as exc:  # surfaced below
            done["error"] = exc

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while 3 not in manifest_versions(store, "main") and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.2)
    producer.send_and_wait(topic, encode_group(_group(policy_run, "p-second", vocab=64)), partition=1)
    producer.close()
    thread.join(timeout=120)
    assert "error" not in done, done
    kinds = {v: read_manifest(store, "main", v).kind for v in manifest_versions(store, "main")}
    # v0 the fixture's, v1 the trainer's weights at start (on top of the stored v0), v2 the first
    # step, v3 the repair (the same weights, in full), v4 the second step.
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["version"], r["repair_anchors"]) for r in rows] == [(1, 2, 0), (2, 4, 1)], rows
    assert kinds[2] == "delta" and kinds[3] == "anchor" and done["version"] == 4, kinds
    assert read_manifest(store, "main", 3).weights_sha256 == read_manifest(store, "main", 2).weights_sha256
