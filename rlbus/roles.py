"""One function per process role: build the components from the config and run them.

Each returns a process exit code. SIGTERM and SIGINT ask a role to stop gracefully.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import tempfile
import threading
import time
from pathlib import Path

from broker import admin
from broker.admin import wait_for_broker
from broker.topics import Topics
from rlbus.config import RunConfig, load_config, worker_descriptor
from weightstore.config import build_store, store_config_from_url

logger = logging.getLogger(__name__)


def _stop_flag() -> threading.Event:
    flag = threading.Event()

    def handler(signum, _frame):
        logger.info("received %s; stopping gracefully", signal.Signals(signum).name)
        flag.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return flag


def ensure_run_topics(cfg: RunConfig) -> None:
    admin.ensure_run_topics(cfg.kafka_config(), Topics(cfg.run.name), [cfg.run.policy], [cfg.run.policy])


# -- prepare -----------------------------------------------------------------------------------
def run_prepare(cfg: RunConfig, out: Path) -> dict:
    """Base model + dataset + warm-up, and the held-out greedy accuracy before RL (reward_start)."""
    import torch

    from producers.engine import TorchEngine
    from producers.envs import get_environment, read_dataset, write_addition_dataset
    from producers.evaluate import greedy_accuracy
    from trainer.basemodel import build_base_model
    from trainer.warmup import supervised_warmup

    torch.set_num_threads(2)
    out = Path(out)
    if cfg.data.path:
        train_path, heldout_path = Path(cfg.data.path), Path(cfg.data.heldout_path or cfg.data.path)
    else:
        train_path, heldout_path = write_addition_dataset(
            out / "data", seed=cfg.run.seed, max_operand=cfg.data.max_operand, n_heldout=cfg.data.n_heldout
        )
    m = cfg.model
    model_dir = build_base_model(
        out / "base", arch=m.arch, hidden_size=m.hidden_size, layers=m.layers, heads=m.heads,
        intermediate_size=m.intermediate_size, max_position_embeddings=m.max_position_embeddings, seed=m.seed,
    )
    train_rows, heldout_rows = read_dataset(train_path), read_dataset(heldout_path)
    w = m.warmup
    report = supervised_warmup(
        model_dir, train_rows, target_accuracy=w.target_accuracy, max_steps=w.max_steps, batch_size=w.batch_size,
        lr=w.lr, seed=cfg.run.seed, eval_rows=train_rows[: w.eval_prompts], eval_every_steps=w.eval_every_steps,
    )
    engine = TorchEngine(model_dir, seed=cfg.run.seed)
    env = get_environment(cfg.run.task)
    reward_start = asyncio.run(greedy_accuracy(engine, env, heldout_rows, cfg.sampling.max_new_tokens))
    result = {
        "model_dir": str(model_dir),
        "train_path": str(train_path),
        "heldout_path": str(heldout_path),
        "warmup_steps": report.steps,
        "warmup_seconds": round(report.seconds, 2),
        "warmup_train_accuracy": report.accuracy,
        "reward_start": reward_start,
    }
    (out / "prepare.json").write_text(json.dumps(result, indent=1))
    return result


# -- eval --------------------------------------------------------------------------------------
def run_eval(cfg: RunConfig, *, data: Path, store_url: str | None, model_dir: Path | None) -> dict:
    """Greedy accuracy of --model-dir, or of the newest weights in the store (loaded from there)."""
    import torch

    from producers.engine import TorchEngine
    from producers.envs import get_environment, read_dataset
    from producers.follower import prepare_local_model

    torch.set_num_threads(2)
    version = None
    with tempfile.TemporaryDirectory(prefix="rlbus-eval-") as tmp:
        if model_dir is None:
            if not store_url:
                raise SystemExit("rlbus eval needs --store or --model-dir")
            store = build_store(store_config_from_url(store_url))
            model_dir, _, version = prepare_local_model(store, cfg.run.policy, Path(tmp), timeout_s=30)
        engine = TorchEngine(model_dir, seed=cfg.run.seed, version=version or 0)
        rows = read_dataset(data)
        from producers.evaluate import greedy_accuracy

        accuracy = asyncio.run(greedy_accuracy(engine, get_environment(cfg.run.task), rows, cfg.sampling.max_new_tokens))
    return {"accuracy": accuracy, "version": version, "prompts": len(rows)}


# -- curator -----------------------------------------------------------------------------------
def run_curator(cfg: RunConfig, *, dataset: Path, metrics_path: Path | None = None) -> int:
    from consumers.curator import Curator

    stop = _stop_flag()
    ensure_run_topics(cfg)
    curator = Curator(
        cfg.kafka_config(), Topics(cfg.run.name), cfg.run.policy,
        cfg.curator_config(str(dataset), None if metrics_path is None else str(metrics_path)),
        group_size=cfg.sampling.group_size, groups_per_step=cfg.trainer.groups_per_step,
        max_staleness=cfg.run.max_staleness,
    )
    stats = curator.run(stop.is_set)
    logger.info("curator done: %d dispatched, %d consumed", stats.dispatched, stats.consumed)
    return 0


# -- trainer -----------------------------------------------------------------------------------
def run_trainer(cfg: RunConfig, *, model_dir: Path, run_dir: Path) -> int:
    import torch

    from broker.control import ControlAnnouncer
    from consumers.intake import TrainerIntake
    from consumers.stages import build_group_stages
    from trainer.basemodel import load_policy
    from trainer.checkpoint import load_latest_checkpoint
    from trainer.loop import PolicyTrainer, TrainerState
    from weightstore.modelfiles import publish_model_files, write_run_descriptor
    from weightstore.publish import WeightPublisher

    torch.set_num_threads(1)
    torch.manual_seed(cfg.trainer.seed)
    stop = _stop_flag()
    ensure_run_topics(cfg)
    kafka, topics, policy = cfg.kafka_config(), Topics(cfg.run.name), cfg.run.policy
    store = build_store(store_config_from_url(cfg.store.url or str(run_dir / "store")))
    model, tokenizer = load_policy(model_dir, "float32")
    t = cfg.trainer
    optimizer = torch.optim.AdamW(model.parameters(), lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    publish_model_files(store, policy, model_dir)
    write_run_descriptor(store, worker_descriptor(cfg))

    publisher = WeightPublisher(store, policy, cfg.weights, publisher_id=f"trainer-{cfg.run.name}")
    state = TrainerState(version=0)
    resume_offsets = None
    ckpt = load_latest_checkpoint(run_dir / "checkpoints" / policy)
    if ckpt is not None:
        ckpt.restore(model, optimizer)
        state = TrainerState(version=ckpt.version, groups_trained=ckpt.extra.get("groups_trained", 0),
                             groups_consumed=ckpt.extra.get("groups_consumed", 0))
        resume_offsets = {int(p): o for p, o in ckpt.offsets.get(topics.trajectories(policy), {}).items()}
        state.offsets = dict(resume_offsets)
        logger.info("resumed from checkpoint at version %d", ckpt.version)
    from weightstore.follow import WeightFollower

    latest = WeightFollower(store, policy).latest_version()
    if latest is not None and latest >= state.version:
        # Versions only move forward: the resumed weights become the next version (as an anchor).
        state.version = latest + 1
    announcer = ControlAnnouncer(kafka, topics)
    intake = TrainerIntake(kafka, topics, policy, cfg.intake, max_staleness=cfg.run.max_staleness,
                           vocab_size=len(tokenizer))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    trainer = PolicyTrainer(
        policy=policy, config=t, model=model, optimizer=optimizer, pad_id=pad_id,
        temperature=cfg.sampling.temperature, intake=intake, publisher=publisher, announcer=announcer,
        run_dir=run_dir, idle_timeout_s=cfg.run.idle_timeout_s, stages=build_group_stages(cfg.trainer_stages),
    )
    trainer.publish(state)
    intake.start(resume_offsets)
    try:
        state = trainer.run(state, stop.is_set)
        trainer.checkpoint(state)
    finally:
        try:
            trainer.close()  # publications still queued finish (and commit) before the intake closes
        finally:
            intake.close()
    announcer.stop(policy, state.version, reason="trainer finished" if not stop.is_set() else "trainer stopped")
    logger.info("trainer done at version %d, %d groups trained", state.version, state.groups_trained)
    return 0


# -- worker ------------------------------------------------------------------------------------
def run_worker(
    *, broker: str | None, store_url: str, config: Path | None, sets: list[str], region: str | None,
    worker_id: str | None,
) -> int:
    """Attach to a run knowing only the broker and the store: everything else comes from the store."""
    import torch

    from producers.engine import build_engine
    from producers.envs import get_environment
    from producers.follower import WeightSync, prepare_local_model
    from producers.worker import RolloutWorker, WorkerClients, connect_worker
    from weightstore.modelfiles import read_run_descriptor

    torch.set_num_threads(1)
    store = build_store(store_config_from_url(store_url))
    descriptor = read_run_descriptor(store, wait_s=300)
    overrides = list(sets)
    if broker:
        overrides.append(f"kafka.bootstrap_servers={json.dumps(broker)}")
    if region:
        overrides.append(f"worker.region={json.dumps(region)}")
    cfg = load_config(config, overrides, base=descriptor)
    kafka, topics, policy = cfg.kafka_config(), Topics(cfg.run.name), cfg.run.policy
    wait_for_broker(kafka, timeout_s=60)

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # Joining the consumer group takes seconds: do it while the model is fetched and loaded.
        connecting = asyncio.create_task(asyncio.to_thread(connect_worker, kafka, topics, policy))
        with tempfile.TemporaryDirectory(prefix="rlbus-worker-") as cache:
            try:
                model_dir, follower, version = await asyncio.to_thread(
                    prepare_local_model, store, policy, Path(cache), timeout_s=cfg.worker.sync_timeout_s
                )
                engine = await asyncio.to_thread(build_engine, cfg.engine, model_dir)
                clients = await connecting
            except BaseException:
                connecting.cancel()
                started = (await asyncio.gather(connecting, return_exceptions=True))[0]
                if isinstance(started, WorkerClients):
                    started.close()
                raise
            engine.version = version
            sync = WeightSync(follower, engine, poll_interval_s=cfg.worker.weights_poll_interval_s,
                              sync_timeout_s=cfg.worker.sync_timeout_s,
                              refresh_before_generation=cfg.worker.refresh_before_generation)
            worker = RolloutWorker(
                kafka=kafka, topics=topics, policy=policy, engine=engine, env=get_environment(cfg.run.task),
                weights=sync, sampling=cfg.sampling.params(), max_staleness=cfg.run.max_staleness,
                config=cfg.worker, worker_id=worker_id, clients=clients,
            )
            started = time.time()
            stats = await worker.run(stop)
            logger.info("worker ran %.0fs: %d prompts in %d batches, %d groups, %d weight syncs, "
                        "%d idle announcements skipped", time.time() - started, stats.prompts, stats.batches,
                        stats.groups_published, sync.syncs, sync.idle_skips)
        return 0

    return asyncio.run(main())
