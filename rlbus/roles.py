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


def prepare(cfg: RunConfig, out: Path) -> dict:
    """Model + dataset (the addition example's where the config names none) and the held-out
    greedy score before RL (``reward_start``); written to ``out/prepare.json``."""
    from consumers.dataset import read_rows
    from producers.role import evaluate
    from producers.tasks import load_task
    from rlbus.examples import addition

    task = load_task(cfg.run.task)
    result = addition.prepare(out, cfg.example, task=task, seed=cfg.run.seed, model_path=cfg.model.path,
                              train_path=cfg.data.path, heldout_path=cfg.data.heldout_path)
    score = evaluate(task=task, rows=read_rows(result["heldout_path"]), max_new_tokens=cfg.sampling.max_new_tokens,
                     seed=cfg.run.seed, model_dir=Path(result["model_dir"]))
    result["reward_start"] = score["accuracy"]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "prepare.json").write_text(json.dumps(result, indent=1))
    return result


def evaluate(cfg: RunConfig, *, data: Path, model_dir: Path | None) -> dict:
    """Greedy score of ``model_dir``, or of the newest weights in the run's store."""
    from consumers.dataset import read_rows
    from producers.role import evaluate as run_eval
    from producers.tasks import load_task

    if model_dir is None and cfg.store is None:
        raise SystemExit("rlbus eval needs --store or --model-dir")
    store = build_store(cfg.store_config(Path.cwd())) if model_dir is None else None
    return run_eval(task=load_task(cfg.run.task), rows=read_rows(data), max_new_tokens=cfg.sampling.max_new_tokens,
                    seed=cfg.run.seed, model_dir=model_dir, store=store, policy=cfg.run.policy)


def curator(cfg: RunConfig, *, dataset: Path, metrics_path: Path | None = None) -> int:
    from consumers.role import run_curator
    from producers.tasks import load_task

    stop = stop_on_signals()
    ensure_topics(cfg)
    run_curator(
        kafka=cfg.kafka, topics=Topics(cfg.run.name), policy=cfg.run.policy, config=cfg.curator, dataset=dataset,
        task=load_task(cfg.run.task).name, stages=cfg.curator_stages, seed=cfg.run.seed,
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
    from producers.tasks import load_task
    from weightstore.modelfiles import read_run_descriptor

    local = load_config(config, overrides)
    if store_url is None and local.store is None:
        raise SystemExit("rlbus worker needs --store (the run's weight store URL), or store in its config")
    store = build_store(store_config_from_url(store_url) if store_url else local.store_config(Path.cwd()))
    cfg = load_config(config, overrides, base=read_run_descriptor(store, wait_s=300))
    return run_worker(
        kafka=cfg.kafka, topics=Topics(cfg.run.name), policy=cfg.run.policy, store=store,
        task=load_task(cfg.run.task), sampling=cfg.sampling, engine=cfg.engine, config=cfg.worker,
        max_staleness=cfg.run.max_staleness, worker_id=worker_id, signing_key=cfg.signing.load_key(),
    )
