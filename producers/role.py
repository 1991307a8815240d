"""The rollout worker role and held-out evaluation, assembled from their settings.

A worker knows only a broker, a store and its settings: it joins the rollout group while it
fetches, for every policy its workflows involve, the model files and the newest weights from the
store and loads an engine, then serves prompts until SIGTERM/SIGINT or the run's end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

from broker.settings import KafkaConfig
from broker.topics import Topics
from producers.config import EngineConfig, SamplingConfig, WorkerConfig, WorkflowSpec
from producers.evaluate import Prompted
from producers.tasks import Task
from weightstore.objectstore import ObjectStore

logger = logging.getLogger(__name__)

TORCH_THREADS = 1
"""A worker's intra-op threads (fleet machines run one worker per core, or a GPU)."""


def run_worker(
    *,
    kafka: KafkaConfig,
    topics: Topics,
    workflows: list[WorkflowSpec],
    policies: dict[str, tuple[SamplingConfig, int]],
    store: ObjectStore,
    task: Task,
    engine: EngineConfig,
    config: WorkerConfig,
    worker_id: str | None = None,
    signing_key: bytes | None = None,
) -> int:
    """Serve the prompts of ``workflows`` until SIGTERM/SIGINT or the run's end; returns an exit code.
    ``policies``: each policy the workflows involve → (its sampling, its η)."""
    import torch

    torch.set_num_threads(TORCH_THREADS)
    return asyncio.run(_serve(kafka, topics, workflows, policies, store, task, engine, config, worker_id,
                              signing_key))


async def _serve(kafka, topics, specs, policies, store, task, engine_config, config, worker_id, signing_key) -> int:
    from producers.engines import build_engine
    from producers.follow import EngineFollower
    from producers.workflows import load_workflow
    from producers.worker import RolloutWorker, ServedPolicy, ServedWorkflow, WorkerClients, connect_worker
    from weightstore.modelfiles import prepare_local_model

    workflows = [ServedWorkflow(spec, load_workflow(spec)) for spec in specs]
    hub = None
    if config.hub_store is not None:
        from weightstore.config import build_store

        hub = build_store(config.hub_store)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Joining the consumer group takes seconds: it goes on while the models are fetched and loaded.
    connecting = asyncio.create_task(asyncio.to_thread(connect_worker, kafka, topics, [s.name for s in specs]))
    served: dict[str, ServedPolicy] = {}
    with tempfile.TemporaryDirectory(prefix="rlbus-worker-") as cache:
        try:
            for name, (sampling, max_staleness) in policies.items():
                model_dir, follower, version = await asyncio.to_thread(
                    prepare_local_model, store, name, Path(cache), timeout_s=config.sync_timeout_s,
                    replica_wait_s=config.replica_wait_s, hub=hub,
                )
                engine = await asyncio.to_thread(build_engine, engine_config, model_dir)
                engine.version = version
                sync = EngineFollower(follower, engine, poll_interval_s=config.weights_poll_interval_s,
                                  sync_timeout_s=config.sync_timeout_s,
                                  refresh_before_generation=config.refresh_before_generation)
                served[name] = ServedPolicy(engine, sync, sampling.params(), max_staleness)
            clients = await connecting
        except BaseException:
            started = (await asyncio.gather(connecting, return_exceptions=True))[0]
            if isinstance(started, WorkerClients):
                await asyncio.to_thread(started.close)
            raise
        worker = RolloutWorker(
            kafka=kafka, topics=topics, workflows=workflows, policies=served, task=task, config=config,
            worker_id=worker_id, signing_key=signing_key, clients=clients, store=store,
        )
        started_at = time.time()
        try:
            stats = await worker.run(stop)
        finally:
            for policy in served.values():  # vLLM's engine processes stop with the worker
                await asyncio.to_thread(policy.engine.close)
        followers = [p.weights.follower for p in served.values()]
        logger.info("worker ran %.0fs: %d prompts in %d batches, %d groups, %d weight syncs, "
                    "%d idle announcements skipped, %d polls found the replica incomplete, %d versions (%d bytes) "
                    "fetched from the hub", time.time() - started_at, stats.prompts, stats.batches,
                    stats.groups_published, sum(p.weights.syncs for p in served.values()),
                    sum(p.weights.idle_skips for p in served.values()), sum(f.replica_waits for f in followers),
                    sum(f.hub_fetches for f in followers), sum(f.hub_bytes for f in followers))
    return 0


def evaluate(
    *,
    task: Task,
    rows: Sequence[Prompted],
    max_new_tokens: int,
    seed: int,
    model_dir: Path | None = None,
    store: ObjectStore | None = None,
    policy: str | None = None,
    device: str = "auto",
) -> dict:
    """Greedy score of ``model_dir``, or of the newest weights of ``policy`` in ``store``, with the torch
    engine on ``device`` (the engine's setting)."""
    import torch

    from producers.engines.torch_engine import TorchEngine
    from producers.evaluate import greedy_accuracy
    from weightstore.modelfiles import prepare_local_model

    torch.set_num_threads(2)
    version = None
    with tempfile.TemporaryDirectory(prefix="rlbus-eval-") as tmp:
        if model_dir is None:
            if store is None or policy is None:
                raise ValueError("evaluate needs a model directory, or a store and a policy")
            model_dir, _, version = prepare_local_model(store, policy, Path(tmp), timeout_s=30)
        engine = TorchEngine(model_dir, seed=seed, version=version or 0, device=device)
        accuracy = asyncio.run(greedy_accuracy(engine, task, rows, max_new_tokens))
    return {"accuracy": accuracy, "version": version, "prompts": len(rows)}


def _base_runtimes(workflow: WorkflowSpec, policies: dict[str, tuple[Path, SamplingConfig]], seed: int,
                   device: str = "auto"):
    """The workflow, and an engine (on ``device``) on each policy's base model bound to its role."""
    import torch

    from producers.engines.torch_engine import TorchEngine
    from producers.workflows import PolicyRuntime, load_workflow

    torch.set_num_threads(2)
    engines = {name: TorchEngine(model_dir, seed=seed, device=device) for name, (model_dir, _) in policies.items()}
    runtimes = {role: PolicyRuntime(name, engines[name], policies[name][1].params())
                for role, name in workflow.roles.items()}
    return load_workflow(workflow), runtimes


async def _role_rows(flow, workflow: WorkflowSpec, runtimes, task: Task, rows: Sequence[Prompted], seed: int,
                     roles: Sequence[str] | None) -> dict[str, list[dict]]:
    return {name: await flow.role_rows(role, rows, runtimes, task, seed=seed)
            for role, name in workflow.roles.items() if roles is None or role in roles}


def build_role_rows(
    *,
    workflow: WorkflowSpec,
    policies: dict[str, tuple[Path, SamplingConfig]],
    task: Task,
    rows: Sequence[Prompted],
    seed: int,
    roles: Sequence[str] | None = None,
    device: str = "auto",
) -> dict[str, list[dict]]:
    """The rows each role of ``workflow`` (or each of ``roles``) is judged on, built from dataset
    ``rows`` with the base models; keyed by the policy that plays the role.
    ``policies``: policy → (its base model directory, its sampling)."""
    flow, runtimes = _base_runtimes(workflow, policies, seed, device)
    return asyncio.run(_role_rows(flow, workflow, runtimes, task, rows, seed, roles))


def prepare_heldout(
    *,
    workflow: WorkflowSpec,
    policies: dict[str, tuple[Path, SamplingConfig]],
    task: Task,
    rows: Sequence[Prompted],
    seed: int,
    out_dir: Path,
    device: str = "auto",
) -> dict[str, dict]:
    """Each policy of ``workflow``: the held-out rows it is judged on (written to
    ``out_dir/heldout.<policy>.jsonl``, standard field names) and its greedy score there before RL.
    ``policies``: policy → (its base model directory, its sampling)."""
    from producers.evaluate import greedy_accuracy

    flow, runtimes = _base_runtimes(workflow, policies, seed, device)
    judged = asyncio.run(_role_rows(flow, workflow, runtimes, task, rows, seed, None))
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, dict] = {}
    for role, name in workflow.roles.items():
        path = out_dir / f"heldout.{name}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in judged[name]))
        rows_of_role = [SimpleNamespace(prompt=r["prompt"], answer=r["answer"], messages=r.get("messages"))
                        for r in judged[name]]
        # Greedy decoding: the draws the role rows took from the engine's generator do not matter.
        score = asyncio.run(greedy_accuracy(runtimes[role].engine, flow.judge(role, task), rows_of_role,
                                            policies[name][1].max_new_tokens))
        result[name] = {"eval_path": str(path), "reward_start": score, "eval_prompts": len(judged[name])}
        logger.info("%s (%s): %d held-out rows, greedy score %.3f", name, role, len(judged[name]), score)
    return result
