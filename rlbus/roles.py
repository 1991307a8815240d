"""Each process role, built from the run config and called: ``rlbus/`` parses and builds, the
packages (``trainer.role``, ``producers.role``, ``consumers.role``) assemble and run.

Each returns a process exit code. SIGTERM and SIGINT ask a role to stop gracefully.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
from pathlib import Path

from broker.admin import ensure_run_topics
from broker.topics import Topics
from rlbus.config import RunConfig, load_config, worker_descriptor
from weightstore.config import build_store, store_config_from_url

logger = logging.getLogger(__name__)


def stop_on_signals() -> threading.Event:
    """An event SIGTERM and SIGINT set: the role finishes what it holds and stops."""
    flag = threading.Event()

    def handler(signum, _frame):
        logger.info("received %s; stopping gracefully", signal.Signals(signum).name)
        flag.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return flag


def ensure_topics(cfg: RunConfig) -> None:
    ensure_run_topics(cfg.kafka, Topics(cfg.run.name), [cfg.run.policy], [cfg.run.policy])


def task_of(cfg: RunConfig):
    """The run's task, built with its params (``TaskError`` names what is wrong)."""
    from producers.tasks import load_task

    return load_task(cfg.run.task, cfg.run.task_params)


def preflight(cfg: RunConfig) -> None:
    """What `rlbus run` checks before it starts anything: the task loads, the checkpoint is one, the
    data files read with the configured fields. Each failure names the problem."""
    from consumers.dataset import read_rows

    task_of(cfg)
    if cfg.model.path is not None and cfg.model.path.startswith("s3://"):
        store = build_store(store_config_from_url(cfg.model.path))
        if not store.exists("config.json"):
            from trainer.model import CheckpointError

            raise CheckpointError(f"model.path {cfg.model.path} holds no config.json: not a checkpoint directory")
    elif cfg.model.path is not None:
        from trainer.model import check_checkpoint

        check_checkpoint(cfg.model.path)
    for path in (cfg.data.path, cfg.data.heldout_path):
        if path is not None:
            read_rows(path, cfg.data.fields)


def prepare(cfg: RunConfig, out: Path) -> dict:
    """Model + dataset and the held-out greedy score before RL (``reward_start``), written to
    ``out/prepare.json``. The model is ``model.path``, else the addition example's scratch model
    (with its warm-up); the data are ``data.path``, a reasoning-gym generator, or the example's."""
    from consumers.dataset import read_rows
    from producers.role import evaluate
    from rlbus.examples import addition

    preflight(cfg)
    task = task_of(cfg)
    model_path = cfg.model.path
    if model_path is not None and model_path.startswith("s3://"):
        from trainer.model import check_checkpoint
        from weightstore.modelfiles import fetch_checkpoint

        model_path = str(fetch_checkpoint(build_store(store_config_from_url(model_path)), Path(out) / "model"))
        check_checkpoint(model_path)
    train_path, heldout_path = cfg.data.path, cfg.data.heldout_path
    if cfg.data.reasoning_gym is not None:
        from producers.tasks.gym import write_reasoning_gym_dataset

        gym = cfg.data.reasoning_gym
        train, heldout = write_reasoning_gym_dataset(
            Path(out) / "data", dataset=gym.dataset, size=gym.size, n_heldout=gym.n_heldout,
            seed=cfg.run.seed if gym.seed is None else gym.seed, config=gym.config)
        train_path, heldout_path = str(train), str(heldout)
    result = addition.prepare(out, cfg.example, task=task, seed=cfg.run.seed, model_path=model_path,
                              train_path=train_path, heldout_path=heldout_path, fields=cfg.data.fields)
    score = evaluate(task=task, rows=read_rows(result["heldout_path"], cfg.data.fields),
                     max_new_tokens=cfg.sampling.max_new_tokens, seed=cfg.run.seed, model_dir=Path(result["model_dir"]))
    result["reward_start"] = score["accuracy"]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "prepare.json").write_text(json.dumps(result, indent=1))
    return result


def evaluate(cfg: RunConfig, *, data: Path, model_dir: Path | None) -> dict:
    """Greedy score of ``model_dir``, or of the newest weights in the run's store."""
    from consumers.dataset import read_rows
    from producers.role import evaluate as run_eval

    if model_dir is None and cfg.store is None:
        raise SystemExit("rlbus eval needs --store or --model-dir")
    store = build_store(cfg.store_config(Path.cwd())) if model_dir is None else None
    return run_eval(task=task_of(cfg), rows=read_rows(data, cfg.data.fields), max_new_tokens=cfg.sampling.max_new_tokens,
                    seed=cfg.run.seed, model_dir=model_dir, store=store, policy=cfg.run.policy)


def curator(cfg: RunConfig, *, dataset: Path, metrics_path: Path | None = None) -> int:
    from consumers.role import run_curator

    stop = stop_on_signals()
    ensure_topics(cfg)
    run_curator(
        kafka=cfg.kafka, topics=Topics(cfg.run.name), policy=cfg.run.policy, config=cfg.curator, dataset=dataset,
        fields=cfg.data.fields, task=task_of(cfg).name, stages=cfg.curator_stages, seed=cfg.run.seed,
        group_size=cfg.sampling.group_size, groups_per_step=cfg.trainer.groups_per_step,
        max_staleness=cfg.run.max_staleness, should_stop=stop.is_set, metrics_path=metrics_path,
    )
    return 0


def trainer(cfg: RunConfig, *, model_dir: Path, run_dir: Path) -> int:
    from trainer.role import run_trainer

    stop = stop_on_signals()
    ensure_topics(cfg)
    run_trainer(
        kafka=cfg.kafka, topics=Topics(cfg.run.name), policy=cfg.run.policy,
        store=build_store(cfg.store_config(run_dir / "store")), config=cfg.trainer, weights=cfg.weights,
        intake=cfg.intake, stages=cfg.trainer_stages, temperature=cfg.sampling.temperature,
        max_staleness=cfg.run.max_staleness, model_dir=model_dir, run_dir=run_dir,
        descriptor=worker_descriptor(cfg), should_stop=stop.is_set, signing_key=cfg.signing.load_key(),
    )
    return 0


def worker(*, store_url: str | None, config: Path | None, overrides: list[str], worker_id: str | None) -> int:
    """Attach to a run knowing only a broker and a store: the run's sections come from the store,
    the worker's own (Kafka, engine, worker, signing) from ``config``, the environment and ``overrides``."""
    from producers.role import run_worker
    from weightstore.modelfiles import read_run_descriptor

    local = load_config(config, overrides)
    if store_url is None and local.store is None:
        raise SystemExit("rlbus worker needs --store (the run's weight store URL), or store in its config")
    store = build_store(store_config_from_url(store_url) if store_url else local.store_config(Path.cwd()))
    cfg = load_config(config, overrides, base=read_run_descriptor(store, wait_s=300))
    return run_worker(
        kafka=cfg.kafka, topics=Topics(cfg.run.name), policy=cfg.run.policy, store=store,
        task=task_of(cfg), sampling=cfg.sampling, engine=cfg.engine, config=cfg.worker,
        max_staleness=cfg.run.max_staleness, worker_id=worker_id, signing_key=cfg.signing.load_key(),
    )
