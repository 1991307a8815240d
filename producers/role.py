"""The rollout worker role and held-out evaluation, assembled from their settings.

A worker knows only a broker, a store and its settings: it joins the rollout group while it
fetches the model files and the newest weights from the store and loads its engine, then serves
prompts until SIGTERM/SIGINT or the run's end.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from broker.settings import KafkaConfig
from broker.topics import Topics
from producers.config import EngineConfig, SamplingConfig, WorkerConfig
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
    policy: str,
    store: ObjectStore,
    task: Task,
    sampling: SamplingConfig,
    engine: EngineConfig,
    config: WorkerConfig,
    max_staleness: int,
    worker_id: str | None = None,
    signing_key: bytes | None = None,
) -> int:
    """Serve prompts of ``policy`` until SIGTERM/SIGINT or the run's end; returns an exit code."""
    import torch

    torch.set_num_threads(TORCH_THREADS)
    return asyncio.run(_serve(kafka, topics, policy, store, task, sampling, engine, config, max_staleness,
                              worker_id, signing_key))


async def _serve(kafka, topics, policy, store, task, sampling, engine_config, config, max_staleness, worker_id,
                 signing_key) -> int:
    from producers.engine import build_engine
    from producers.weight_sync import WeightSync
    from producers.worker import RolloutWorker, WorkerClients, connect_worker
    from weightstore.modelfiles import prepare_local_model

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # Joining the consumer group takes seconds: it goes on while the model is fetched and loaded.
    connecting = asyncio.create_task(asyncio.to_thread(connect_worker, kafka, topics, policy))
    with tempfile.TemporaryDirectory(prefix="rlbus-worker-") as cache:
        try:
            model_dir, follower, version = await asyncio.to_thread(
                prepare_local_model, store, policy, Path(cache), timeout_s=config.sync_timeout_s
            )
            engine = await asyncio.to_thread(build_engine, engine_config, model_dir)
            clients = await connecting
        except BaseException:
            started = (await asyncio.gather(connecting, return_exceptions=True))[0]
            if isinstance(started, WorkerClients):
                await asyncio.to_thread(started.close)
            raise
        engine.version = version
        sync = WeightSync(follower, engine, poll_interval_s=config.weights_poll_interval_s,
                          sync_timeout_s=config.sync_timeout_s,
                          refresh_before_generation=config.refresh_before_generation)
        worker = RolloutWorker(
            kafka=kafka, topics=topics, policy=policy, engine=engine, task=task, weights=sync,
            sampling=sampling.params(), max_staleness=max_staleness, config=config, worker_id=worker_id,
            signing_key=signing_key, clients=clients,
        )
        started_at = time.time()
        stats = await worker.run(stop)
        logger.info("worker ran %.0fs: %d prompts in %d batches, %d groups, %d weight syncs, "
                    "%d idle announcements skipped", time.time() - started_at, stats.prompts, stats.batches,
                    stats.groups_published, sync.syncs, sync.idle_skips)
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
) -> dict:
    """Greedy score of ``model_dir``, or of the newest weights of ``policy`` in ``store``."""
    import torch

    from producers.engine import TorchEngine
    from producers.evaluate import greedy_accuracy
    from weightstore.modelfiles import prepare_local_model

    torch.set_num_threads(2)
    version = None
    with tempfile.TemporaryDirectory(prefix="rlbus-eval-") as tmp:
        if model_dir is None:
            if store is None or policy is None:
                raise ValueError("evaluate needs a model directory, or a store and a policy")
            model_dir, _, version = prepare_local_model(store, policy, Path(tmp), timeout_s=30)
        engine = TorchEngine(model_dir, seed=seed, version=version or 0)
        accuracy = asyncio.run(greedy_accuracy(engine, task, rows, max_new_tokens))
    return {"accuracy": accuracy, "version": version, "prompts": len(rows)}
