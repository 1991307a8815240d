"""Each process role, built from the run config and called: ``rlbus/`` parses and builds, the
packages (``trainer.role``, ``producers.role``, ``consumers.role``) assemble and run.

Each returns a process exit code. SIGTERM and SIGINT ask a role to stop gracefully.
"""

from __future__ import annotations

import json
import logging
import os
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
    ensure_run_topics(cfg.kafka, Topics(cfg.run.name), [w.name for w in cfg.workflow_list()],
                      [p.name for p in cfg.policy_list()])


def task_of(cfg: RunConfig):
    """The run's task, built with its params (``TaskError`` names what is wrong)."""
    from producers.tasks import load_task

    return load_task(cfg.run.task, cfg.run.task_params)


def turns_of(cfg: RunConfig):
    """The turn rule when the run's trainers alternate (None when they train concurrently)."""
    if cfg.run.schedule != "alternating" or len(cfg.policy_list()) < 2:
        return None
    from consumers.turns import Turns

    return Turns([p.name for p in cfg.policy_list()], cfg.run.alternate_steps)


def preflight(cfg: RunConfig) -> None:
    """What `rlbus run` checks before it starts anything: the task and the workflows load, every
    policy's checkpoint is one, the data files read with the configured fields. Each failure names
    the problem."""
    from consumers.dataset import read_rows
    from producers.workflows import load_workflow

    task_of(cfg)
    for spec in cfg.workflow_list():
        load_workflow(spec)
    for path in dict.fromkeys(p.model.path for p in cfg.policy_list() if p.model.path is not None):
        if path.startswith("s3://"):
            store = build_store(store_config_from_url(path))
            if not store.exists("config.json"):
                from trainer.model import CheckpointError

                raise CheckpointError(f"model.path {path} holds no config.json: not a checkpoint directory")
        else:
            from trainer.model import check_checkpoint

            check_checkpoint(path)
    for path in (cfg.data.path, cfg.data.heldout_path):
        if path is not None:
            read_rows(path, cfg.data.fields)


def _local_model(path: str | None, out: Path, fetched: dict[str, str]) -> str | None:
    """A local checkpoint directory for ``path`` (an s3:// prefix is fetched once into ``out``)."""
    if path is None or not path.startswith("s3://"):
        return path
    if path not in fetched:
        from trainer.model import check_checkpoint
        from weightstore.modelfiles import fetch_checkpoint

        dest = Path(out) / ("model" if not fetched else f"model-{len(fetched)}")
        fetched[path] = str(fetch_checkpoint(build_store(store_config_from_url(path)), dest))
        check_checkpoint(fetched[path])
    return fetched[path]


def prepare(cfg: RunConfig, out: Path) -> dict:
    """Models + dataset and each policy's held-out greedy score before RL (``reward_start``), written to
    ``out/prepare.json``. A policy's model is its ``model.path``, else the addition example's scratch
    model (with its warm-up); the data are ``data.path``, a reasoning-gym generator, or the example's.
    The top-level keys describe the first policy; ``policies`` has every policy's model directory,
    held-out rows (``eval_path``) and ``reward_start``."""
    from consumers.dataset import read_rows
    from producers.role import prepare_heldout
    from rlbus.examples import addition

    preflight(cfg)
    task = task_of(cfg)
    fetched: dict[str, str] = {}
    paths = {p.name: _local_model(p.model.path, out, fetched) for p in cfg.policy_list()}
    train_path, heldout_path = cfg.data.path, cfg.data.heldout_path
    if cfg.data.reasoning_gym is not None:
        from producers.tasks.gym import write_reasoning_gym_dataset

        gym = cfg.data.reasoning_gym
        train, heldout = write_reasoning_gym_dataset(
            Path(out) / "data", dataset=gym.dataset, size=gym.size, n_heldout=gym.n_heldout,
            seed=cfg.run.seed if gym.seed is None else gym.seed, config=gym.config)
        train_path, heldout_path = str(train), str(heldout)
    scratch = None in paths.values()
    result = addition.prepare(out, cfg.example, task=task, seed=cfg.run.seed,
                              model_path=None if scratch else next(iter(paths.values())),
                              train_path=train_path, heldout_path=heldout_path, fields=cfg.data.fields,
                              device=cfg.policy().trainer.device, turn_tokens=cfg.policy().sampling.max_new_tokens)
    model_dirs = {name: path or result["model_dir"] for name, path in paths.items()}
    rows = read_rows(result["heldout_path"], cfg.data.fields)
    policies: dict[str, dict] = {}
    for spec in cfg.workflow_list():
        involved = {name: (Path(model_dirs[name]), cfg.policy(name).sampling) for name in spec.policies}
        warmups = _warm_up_roles(cfg, spec, involved, task, read_rows(result["train_path"], cfg.data.fields), out)
        for name, (model_dir, report) in warmups.items():
            model_dirs[name] = str(model_dir)
            involved[name] = (model_dir, involved[name][1])
            result.setdefault("role_warmups", {})[name] = report
        for name, held in prepare_heldout(workflow=spec, policies=involved, task=task, rows=rows, seed=cfg.run.seed,
                                          out_dir=Path(out) / "data", device=cfg.engine.device).items():
            policies[name] = {"model_dir": model_dirs[name], **held}
    first = cfg.policy().name
    result.update(model_dir=model_dirs[first], reward_start=policies[first]["reward_start"], policies=policies)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "prepare.json").write_text(json.dumps(result, indent=1))
    return result


ROLE_WARMUP_PROMPTS = 2000
"""Train prompts a role's warm-up demonstrations are built from (the verifier judges the base solver's
answers to them)."""


def _warm_up_roles(cfg: RunConfig, spec, involved: dict, task, train_rows: list, out: Path) -> dict:
    """The policies of workflow ``spec`` that have a ``warmup``, each trained on its role's
    demonstrations in its own copy of its base model: policy → (model directory, report)."""
    import shutil

    from consumers.dataset import Row
    from producers.role import build_role_rows
    from producers.workflows import load_workflow
    from trainer.warmup import supervised_warmup

    roles = {role: name for role, name in spec.roles.items() if cfg.policy(name).warmup is not None}
    if not roles:
        return {}
    demos = build_role_rows(workflow=spec, policies=involved, task=task, rows=train_rows[:ROLE_WARMUP_PROMPTS],
                            seed=cfg.run.seed, roles=list(roles), device=cfg.engine.device)
    flow, done = load_workflow(spec), {}
    for role, name in roles.items():
        w = cfg.policy(name).warmup
        rows = [Row(key=d["prompt_id"], prompt=d["prompt"], answer=d["answer"],
                    messages=None if d.get("messages") is None else tuple(d["messages"])) for d in demos[name]]
        model_dir = Path(out) / f"base-{name}"
        shutil.rmtree(model_dir, ignore_errors=True)
        shutil.copytree(involved[name][0], model_dir)
        report = supervised_warmup(model_dir, rows, score=flow.judge(role, task).score, target_accuracy=w.target_accuracy,
                                   max_steps=w.max_steps, batch_size=w.batch_size, lr=w.lr, seed=cfg.run.seed,
                                   eval_rows=rows[: w.eval_prompts], eval_every_steps=w.eval_every_steps,
                                   device=cfg.policy(name).trainer.device)
        logger.info("%s (%s) warmed up on %d demonstrations: %d steps, %.1fs, score %.3f", name, role, len(rows),
                    report.steps, report.seconds, report.accuracy)
        done[name] = (model_dir, {"steps": report.steps, "seconds": round(report.seconds, 2),
                                  "train_accuracy": report.accuracy, "demonstrations": len(rows)})
    return done


def evaluate(cfg: RunConfig, *, data: Path, model_dir: Path | None, policy: str | None = None,
             prepared: bool = False) -> dict:
    """Greedy score of ``model_dir``, or of the newest weights of ``policy`` (default: the first) in
    the run's store, judged as its workflow judges that policy's role. ``prepared``: ``data`` is a
    held-out file `rlbus prepare` wrote (standard field names), not one read with ``data.fields``."""
    from consumers.dataset import DatasetFields, read_rows
    from producers.role import evaluate as run_eval
    from producers.workflows import load_workflow

    if model_dir is None and cfg.store is None:
        raise SystemExit("rlbus eval needs --store or --model-dir")
    spec = cfg.policy(policy)
    workflow = next(w for w in cfg.workflow_list() if spec.name in w.policies)
    role = next(r for r, name in workflow.roles.items() if name == spec.name)
    judge = load_workflow(workflow).judge(role, task_of(cfg))
    store = build_store(cfg.store_config(Path.cwd())) if model_dir is None else None
    rows = read_rows(data, DatasetFields() if prepared else cfg.data.fields)
    return run_eval(task=judge, rows=rows, max_new_tokens=spec.sampling.max_new_tokens, seed=cfg.run.seed,
                    model_dir=model_dir, store=store, policy=spec.name, device=cfg.engine.device)


def curator(cfg: RunConfig, *, dataset: Path, metrics_path: Path | None = None, workflow: str | None = None) -> int:
    """The curator of one workflow's prompt stream (default: the first workflow)."""
    from consumers.role import run_curator

    spec = cfg.workflow(workflow)
    policies = [cfg.policy(name) for name in spec.policies]
    stop = stop_on_signals()
    ensure_topics(cfg)
    run_curator(
        kafka=cfg.kafka, topics=Topics(cfg.run.name), workflow=spec.name, config=cfg.curator, dataset=dataset,
        fields=cfg.data.fields, task=task_of(cfg).name, stages=cfg.curator_stages, seed=cfg.run.seed,
        group_size=policies[0].sampling.group_size,
        windows={p.name: (p.max_staleness + 1) * p.trainer.groups_per_step for p in policies},
        turns=turns_of(cfg), should_stop=stop.is_set, metrics_path=metrics_path, log=cfg.log,
        run_policies=[p.name for p in cfg.policy_list()],
    )
    return 0


def trainer(cfg: RunConfig, *, model_dir: Path, run_dir: Path, policy: str | None = None,
            dataset: Path | None = None) -> int:
    """The trainer of one policy (default: the first); ``dataset``: the train dataset the curator
    reads, for re-scoring groups (``intake.rescore``)."""
    from trainer.role import run_trainer

    spec = cfg.policy(policy)
    rescore = _rescore_with(cfg, spec.name, dataset)
    stop = stop_on_signals()
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 is the trainer's only Kafka client
        ensure_topics(cfg)
    run_trainer(
        kafka=cfg.kafka, topics=Topics(cfg.run.name), policy=spec.name,
        store=build_store(cfg.store_config(run_dir / "store")), config=spec.trainer, weights=cfg.weights,
        intake=cfg.intake, stages=spec.trainer_stages, temperature=spec.sampling.temperature,
        max_staleness=spec.max_staleness, model_dir=model_dir, run_dir=run_dir,
        metrics_path=cfg.metrics_file(run_dir, spec.name), descriptor=worker_descriptor(cfg),
        should_stop=stop.is_set, signing_key=cfg.signing.load_key(), turns=turns_of(cfg), rescore=rescore,
        log=cfg.log,
    )
    return 0


def _rescore_with(cfg: RunConfig, policy: str, dataset: Path | None):
    """The task and dataset rows the intake of ``policy`` re-scores with; None when ``intake.rescore``
    is off or the policy's rewards are not the task's score of one completion (it says so)."""
    if cfg.intake.rescore == "off":
        return None
    if dataset is None:
        raise SystemExit("intake.rescore needs the train dataset at the trainer: pass `rlbus trainer --dataset` "
                         "(the file the curator reads), or set intake.rescore = \"off\"")
    from consumers.dataset import read_rows
    from producers.episodes import is_multi_turn
    from producers.workflows import load_workflow

    task = task_of(cfg)
    bound = [(w, role) for w in cfg.workflow_list() for role, name in w.roles.items() if name == policy]
    other = [f"{w.name}/{role}" for w, role in bound if load_workflow(w).judge(role, task) is not task]
    if is_multi_turn(task) or other:
        why = f"roles {other} are not scored by the task" if other else f"task {task.name!r} is multi-turn"
        logger.warning("intake.rescore = %s: policy %s is not re-scored (%s)", cfg.intake.rescore, policy, why)
        return None
    return task, read_rows(dataset, cfg.data.fields)


def worker(*, store_url: str | None, config: Path | None, overrides: list[str], worker_id: str | None,
           workflows: list[str] | None = None) -> int:
    """Attach to a run knowing only a broker and a store: the run's sections come from the store,
    the worker's own (Kafka, engine, worker, signing) from ``config``, the environment and ``overrides``.
    It serves ``workflows`` (names; None: every workflow of the run)."""
    from producers.role import run_worker
    from weightstore.modelfiles import read_run_descriptor

    local = load_config(config, overrides)
    if store_url is None and local.store is None:
        raise SystemExit("rlbus worker needs --store (the run's weight store URL), or store in its config")
    store = build_store(store_config_from_url(store_url) if store_url else local.store_config(Path.cwd()))
    from weightstore.errors import NotFound

    try:
        descriptor = read_run_descriptor(store, wait_s=300)
    except NotFound as exc:  # the wrong --store, or a run not started yet: a message, not a traceback
        raise SystemExit(str(exc)) from None
    cfg = load_config(config, overrides, base=descriptor)
    specs = [cfg.workflow(name) for name in workflows] if workflows else cfg.workflow_list()
    policies = {p.name: (p.sampling, p.max_staleness) for p in (cfg.policy(n) for s in specs for n in s.policies)}
    return run_worker(
        kafka=cfg.kafka, topics=Topics(cfg.run.name), workflows=specs, policies=policies, store=store,
        task=task_of(cfg), engine=cfg.engine, config=cfg.worker, worker_id=worker_id,
        signing_key=cfg.signing.load_key(),
    )


def replica(cfg: RunConfig) -> int:
    """Fill the region's store (``store``) from the hub's (``worker.hub_store``) until SIGTERM/SIGINT:
    the run's policies come from the run descriptor in the hub's store."""
    from weightstore.errors import NotFound
    from weightstore.modelfiles import read_run_descriptor
    from weightstore.replica import Replicator

    if cfg.store is None or cfg.worker.hub_store is None:
        raise SystemExit("rlbus replica needs --store (the region's store) and --hub-store (the hub's)")
    hub, replica_store = build_store(cfg.worker.hub_store), build_store(cfg.store)
    try:
        descriptor = read_run_descriptor(hub, wait_s=300)
    except NotFound as exc:
        raise SystemExit(str(exc)) from None
    run = load_config(None, [], environ={}, base=descriptor)
    policies = [p.name for p in run.policy_list()]
    logger.info("region %s: replicating %s from %s into %s", cfg.worker.region, ", ".join(policies),
                hub.describe(), replica_store.describe())
    stop = stop_on_signals()
    replicator = Replicator(hub, replica_store, policies, region=cfg.worker.region, config=cfg.replica)
    if cfg.kafka.bootstrap_servers:  # the hub's announcements wake it at once (else it polls LATEST only)
        threading.Thread(target=_announcements, args=(cfg.kafka, Topics(run.run.name), replicator, stop),
                         name="replica-announcements", daemon=True).start()
    replicator.run(stop.is_set)
    return 0


def _announcements(kafka, topics: Topics, replicator, stop: threading.Event) -> None:
    """Hand the hub's version announcements to ``replicator`` until ``stop``; a broker that cannot be
    read (a cut link) only delays the replica to its polling of LATEST."""
    from broker.control import ControlReader
    from broker.errors import BrokerError

    reader = None
    while not stop.is_set():
        try:
            # advisory: the long fetch wait of readers no step waits on (announcements only hasten copies)
            reader = reader or ControlReader(kafka, topics, from_beginning=False, advisory=True)
            for record in reader.poll(1.0):
                if record.kind == "version":
                    replicator.announce(record.policy, record.version)
        except BrokerError as exc:
            logger.warning("version announcements not readable (%s); the replica polls LATEST meanwhile", exc)
            if reader is not None:
                reader.close()
            reader = None
            stop.wait(5.0)
    if reader is not None:
        reader.close()
