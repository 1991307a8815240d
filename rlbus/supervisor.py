"""The embedded local stack: broker, store, a curator per workflow, a trainer per policy and N
workers as processes.

The curators are essential: if one dies unexpectedly the run stops and the supervisor prints
which one and the tail of its log. A trainer that dies is restarted from its newest checkpoint
(``local.trainer_restarts`` times at most); the embedded broker is started again on its address
with the run's topics (``local.broker_restarts`` times at most): on memory:// storage it comes back
empty, as a new cluster, and the roles ride through (the curator dispatches again what was lost).
The run ends when every trainer finished. Rollout workers are expendable by design
(preemptible capacity): a worker that dies is reported, its prompts are redelivered by the broker,
and the run goes on as long as the trainer keeps receiving groups.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from broker.embedded import EmbeddedBroker, die_with_parent
from rlbus.config import RunConfig, secret_environment, without_secrets
from rlbus.regions import StepCuts, last_step
from rlbus.report.html import write_html_report
from rlbus.report.live import build_progress
from rlbus.report.summary import write_report
from rlbus.roles import ensure_topics
from weightstore.config import build_store

logger = logging.getLogger(__name__)

CREDENTIALS = "seaweedfs-credentials.json"
"""In the run directory: the keys (and the last endpoint) of the run's SeaweedFS server."""
DURABLE_FETCH_MAX_WAIT_MS = 100
"""kafka.fetch_max_wait_ms with the embedded broker's log on SeaweedFS: Tansu's s3 engine returns nothing
from a fetch whose listing of the partition outlasts the wait (broker.retention keeps the listings short)."""
DURABLE_OBJECTS_WARN = 400
"""Batch objects a trajectory partition may keep between trims before `rlbus run` warns (see
_warn_of_long_trajectory_logs)."""
BUDGET_GRACE_S = 120.0
"""When a run reaches local.max_wall_s: how long its trainers get to finish their step and checkpoint."""
EXIT_BUDGET = 3
"""`rlbus run`'s exit status when the wall budget ended the run (summary and report written): 1 is a
failure, 2 bad input."""


def _own_s3_store(store, credentials: Path) -> bool:
    """Whether ``store`` (from a run's config.json) is the bucket on the run's own SeaweedFS server."""
    if getattr(store, "type", None) != "s3" or not credentials.is_file():
        return False
    return store.endpoint_url == json.loads(credentials.read_text()).get("endpoint")


def _terminate(children: list[Child], grace_s: float) -> list[Child]:
    """SIGTERM to each child still running, then SIGKILL to those not gone ``grace_s`` later; those."""
    for child in children:
        if child.proc.poll() is None:
            child.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    killed = []
    for child in children:
        try:
            child.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
            killed.append(child)
    return killed


@dataclass
class Child:
    role: str  # its log's name: "trainer", "far-0", "link-far"
    proc: subprocess.Popen
    log_path: Path
    essential: bool
    carries: bool = False  # a region's link or replica: others' traffic goes through it, so it stops last

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class RunFailed(RuntimeError):
    retriable = False


class CpuMeter:
    """CPU seconds each process of the run has used, by role, sampled from ``/proc`` (Linux; elsewhere
    it records nothing). Every ``every_s`` it appends ``{"time", "cpu_s": {role: seconds}}`` to
    ``path`` (``cpu.jsonl`` in the run directory): cumulative per role, processes that ended and
    restarted ones included, so the CPU of any window of the run is a difference of two rows. A
    process that ends between samples loses the CPU of its last ``every_s`` at most."""

    def __init__(self, path: Path, every_s: float = 5.0) -> None:
        self.path, self.every_s = path, every_s
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.last: dict[tuple[str, int], float] = {}  # (role, pid) -> its newest reading
        self._next = 0.0

    def cpu_seconds(self, pid: int) -> float | None:
        """CPU seconds (user + system) the process ``pid`` has used so far; None once it is gone."""
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        return (int(fields[11]) + int(fields[12])) / self.tick  # utime + stime (fields 14, 15 of stat)

    def sample(self, processes: dict[str, list[int]], *, force: bool = False) -> None:
        """Read the processes (role -> pids; call it before the children are reaped) and write a row
        when one is due or ``force``."""
        for role, pids in processes.items():
            for pid in pids:
                if (cpu := self.cpu_seconds(pid)) is not None:
                    self.last[(role, pid)] = cpu
        now = time.time()
        if (now < self._next and not force) or not self.last:
            return
        self._next = now + self.every_s
        totals: dict[str, float] = {}
        for (role, _pid), cpu in self.last.items():
            totals[role] = round(totals.get(role, 0.0) + cpu, 2)
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"time": now, "cpu_s": totals}) + "\n")


def _warn_of_long_trajectory_logs(cfg: RunConfig) -> None:
    """The trajectory log is trimmed no further back than the oldest kept checkpoint (a trainer may
    rewind to it): about checkpoint_every x checkpoints_kept steps of groups, one batch object each on
    Tansu's s3 engine, whose every fetch lists them all (configs/ci.toml with checkpoint_every 100 went
    from 30 to 55 ms a group, 1.27 to 2.53 s a step, by step 375, at ~860 objects a partition)."""
    for p in cfg.policy_list():
        t = p.trainer
        objects = t.checkpoint_every * t.checkpoints_kept * t.groups_per_step / cfg.kafka.trajectory_partitions
        if objects > DURABLE_OBJECTS_WARN:
            print(f"warning: policy {p.name}'s trajectory log keeps up to ~{objects:,.0f} batch objects a partition "
                  f"between trims (trainer.checkpoint_every {t.checkpoint_every} x checkpoints_kept "
                  f"{t.checkpoints_kept} x groups_per_step {t.groups_per_step} / {cfg.kafka.trajectory_partitions} "
                  f"partitions); Tansu's s3 engine lists them on every fetch and slows: checkpoint more often",
                  file=sys.stderr, flush=True)


def _children(pid: int) -> list[int]:
    """The direct children of process ``pid`` (none once it is gone)."""
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


class Supervisor:
    def __init__(self, cfg: RunConfig, *, plain: bool = False) -> None:
        self.cfg = cfg.model_copy(deep=True)
        self.plain = plain  # one line per trainer step instead of the live panel (also when stdout is no terminal)
        self.children: list[Child] = []
        self.broker: EmbeddedBroker | None = None
        self.restarts = dict.fromkeys(("trainer", "broker", "worker", "storage"), 0)  # this invocation's
        self._earlier: dict[str, int] = {}
        self.s3 = None  # the run's SeaweedFS server (the broker's log, the weights), when it has one
        self._workers: dict[str, tuple[list[str], int, dict | None]] = {}  # log name -> (args, nice, env): to start
        # one again
        self._env = secret_environment(cfg)  # secrets reach the processes in their environment, not on disk
        self.cpu: CpuMeter | None = None
        self.step_cuts = StepCuts()  # the regions' link cuts that start at a trainer step

    def _spawn(
        self, role: str, args: list[str], *, essential: bool, log_name: str | None = None, nice: int = 0,
        ranks: int = 1, secrets: dict[str, str] | None = None,
    ) -> Child:
        """``secrets``: the child's secret variables instead of the run's (a region's processes have their own)."""
        log_path = self.log_dir / f"{log_name or role}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
                   **(self._env if secrets is None else secrets))

        def setup() -> None:  # runs in the child before exec
            die_with_parent()  # a killed supervisor takes its processes with it
            if nice:
                os.nice(nice)

        # Several ranks: torchrun on this machine starts them (its rendezvous on a free local port).
        launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, *launch, "-m", "rlbus.cli", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=os.getcwd(),
                preexec_fn=setup,
            )
        child = Child(role=log_name or role, proc=proc, log_path=log_path, essential=essential,
                      carries=role in ("link", "replica"))
        self.children.append(child)
        return child

    def _prepare(self) -> dict:
        """Base model + warm-up + dataset + held-out accuracy before RL, in a child process."""
        child = self._spawn("prepare", ["prepare", "--config", str(self.config_file), "--out", str(self.run_dir)], essential=True)
        rc = child.proc.wait()
        self.children.remove(child)
        if rc != 0:
            raise RunFailed(f"prepare failed (exit {rc}); log {child.log_path}:\n{child.tail()}")
        return json.loads((self.run_dir / "prepare.json").read_text())

    def run(self, resume: Path | None = None) -> dict | None:
        """Run, or with ``resume`` continue the run in that directory: same name, topics, store and
        checkpoints; its base model and data are reused, each trainer resumes from its newest
        checkpoint, curators and workers start afresh. A run that used the embedded broker gets a
        new one (the old one's records died with it: prompts in flight are dispatched anew)."""
        started = time.time()
        cfg = self.cfg
        try:
            self._directory(cfg, resume)
        except RunFailed as exc:
            print(f"run {cfg.run.name}: {exc}", file=sys.stderr, flush=True)
            return None
        print(f"rlbus run {cfg.run.name}: {'resuming in' if resume else 'directory'} {self.run_dir}", flush=True)
        self._counts_file = self.run_dir / "restarts.json"  # the run's restarts, across --resume
        self._earlier = json.loads(self._counts_file.read_text()) if resume and self._counts_file.is_file() else {}
        if resume:
            self._earlier["resumes"] = self._earlier.get("resumes", 0) + 1
        self._save_counts()
        broker: EmbeddedBroker | None = None
        try:
            env = self._local_s3(cfg)
            if not cfg.kafka.bootstrap_servers:
                broker = self.broker = EmbeddedBroker(cfg.embedded_broker, log_path=self.log_dir / "broker.log",
                                                      env=env)
                cfg.kafka = cfg.kafka.with_broker(broker.start())
                print(f"embedded Kafka-protocol broker at {cfg.kafka.bootstrap_servers}", flush=True)
            cfg.store = cfg.store_config(self.run_dir / "store")
            self.config_file = self.run_dir / "config.json"
            self.config_file.write_text(json.dumps(without_secrets(cfg), indent=1))
            # The local workers attach like any worker (broker and store; the rest from the run
            # descriptor) and take this run's own Kafka client settings and signing key.
            self.worker_file = self.run_dir / "worker.json"
            self.worker_file.write_text(json.dumps({k: v for k, v in without_secrets(cfg).items()
                                                    if k in ("kafka", "signing", "store")}, indent=1))
            ensure_topics(cfg)
            prepared = self.run_dir / "prepare.json"
            prep = json.loads(prepared.read_text()) if resume and prepared.is_file() else self._prepare()
            print(
                f"base model ready: warm-up {prep['warmup_steps']} steps in {prep['warmup_seconds']:.1f}s, "
                f"held-out greedy accuracy before RL {prep['reward_start']:.3f}",
                flush=True,
            )
            summary = self._train(cfg, prep, started)
        except (RunFailed, KeyboardInterrupt) as exc:
            print(f"run {cfg.run.name} failed: {exc}", file=sys.stderr, flush=True)
            self._announce_stop(cfg, f"rlbus run ended early: {exc or 'interrupted'}")
            return None
        finally:
            self._stop_all()
            if broker is not None:
                broker.stop()
            if self.s3 is not None:
                self.s3.stop()
        return summary

    def _local_s3(self, cfg: RunConfig) -> dict[str, str]:
        """Start the run's SeaweedFS server (in its directory: a --resume finds its data) when the
        embedded broker's log (local.broker_storage) or the weights (local.weight_store) go on it,
        and point them at it; the broker's extra environment. Its credentials are the run's own
        (``seaweedfs-credentials.json``, readable by its owner only), for tools and hand-attached
        workers; the local roles get the secret in their environment."""
        log_on_it = not cfg.kafka.bootstrap_servers and cfg.local.broker_storage == "seaweedfs"
        weights_on_it = cfg.store is None and cfg.local.weight_store == "seaweedfs"
        if not (log_on_it or weights_on_it):
            return {}
        from weightstore.config import S3StoreConfig
        from weightstore.embedded import EmbeddedS3

        credentials = self.run_dir / CREDENTIALS
        if not credentials.is_file():
            credentials.touch(mode=0o600)
            credentials.write_text(json.dumps({"access_key_id": "rlbus-local", "secret_access_key": secrets.token_hex(16)}))
        saved = json.loads(credentials.read_text())
        keys = {k: saved[k] for k in ("access_key_id", "secret_access_key")}
        self.s3 = EmbeddedS3(self.run_dir / "seaweedfs", access_key_id=keys["access_key_id"],
                             secret_access_key=keys["secret_access_key"], log_path=self.log_dir / "seaweedfs.log",
                             buckets=("tansu", "weights"))
        endpoint = self.s3.start()
        credentials.write_text(json.dumps({**keys, "endpoint": endpoint}))
        if weights_on_it:
            cfg.store = S3StoreConfig(type="s3", bucket="weights", prefix=cfg.run.name, endpoint_url=endpoint,
                                      region="us-east-1", addressing_style="path", **keys)
            self._env = secret_environment(cfg)
            print(f"weights on SeaweedFS at {endpoint} (s3://weights/{cfg.run.name})", flush=True)
        if not log_on_it:
            return {}
        print(f"broker log on SeaweedFS at {endpoint}", flush=True)
        cfg.embedded_broker.storage_url = "s3://tansu/"
        if "fetch_max_wait_ms" not in cfg.kafka.model_fields_set:  # a fetch's listing outlasts 20 ms there
            cfg.kafka.fetch_max_wait_ms = DURABLE_FETCH_MAX_WAIT_MS
        if cfg.log.trim == "auto":  # the roles delete the batch objects every reader passed (broker.retention)
            cfg.log = cfg.log.model_copy(update={
                "trim": "tansu_s3", "tansu_storage": "s3://tansu/", "tansu_cluster": cfg.embedded_broker.cluster_id
                or "rlbus", "endpoint_url": endpoint, "access_key_id": keys["access_key_id"],
                "secret_access_key": SecretStr(keys["secret_access_key"])})
            self._env = secret_environment(cfg)
            _warn_of_long_trajectory_logs(cfg)
        return self.s3.aws_environment()

    def _directory(self, cfg: RunConfig, resume: Path | None) -> None:
        """Make the run directory, or take up the one to resume."""
        if resume is not None:
            self.run_dir = resume.resolve()
            cfg.run.name = self.run_dir.name
            if (self.run_dir / "summary.json").exists():
                raise RunFailed(f"{self.run_dir} holds a finished run (summary.json): nothing to resume")
            if (self.run_dir / "logs" / "broker.log").exists():
                cfg.kafka.bootstrap_servers = None  # it ran on the embedded broker: start a new one
            if _own_s3_store(cfg.store, self.run_dir / CREDENTIALS):
                cfg.store = None  # on the run's SeaweedFS server, which starts again on other ports
        else:
            if cfg.local.unique_suffix:
                cfg.run.name = f"{cfg.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            self.run_dir = Path(cfg.local.dir).resolve() / cfg.run.name
            if self.run_dir.exists():
                raise RunFailed(f"{self.run_dir} exists: continue that run with `rlbus run --resume {self.run_dir}`, "
                                "or give this one another run.name")
        self.log_dir = self.run_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.cpu = CpuMeter(self.run_dir / "cpu.jsonl")

    def _processes(self) -> dict[str, list[int]]:
        """The run's processes by role (a worker's log name is its role; a trainer's ranks are its
        launcher's children), the embedded broker's and the run's SeaweedFS server's too."""
        out: dict[str, list[int]] = {}
        for child in self.children:
            out.setdefault(child.role, []).extend([child.proc.pid, *_children(child.proc.pid)])
        if self.broker is not None and self.broker.pid is not None:
            out["broker"] = [self.broker.pid]
        if self.s3 is not None and self.s3.proc is not None:  # the run's own SeaweedFS server
            out["seaweedfs"] = [self.s3.proc.pid, *_children(self.s3.proc.pid)]
        return out

    def _train(self, cfg: RunConfig, prep: dict, started: float) -> dict:
        common = ["--config", str(self.config_file)]
        policies, workflows = cfg.policy_list(), cfg.workflow_list()
        several, flows = len(policies) > 1, len(workflows) > 1
        trainer_args = {
            f"trainer-{p.name}" if several else "trainer":
            ["trainer", *common, "--policy", p.name, "--model-dir", prep["policies"][p.name]["model_dir"],
             "--run-dir", str(self.run_dir), "--dataset", prep["train_path"]]
            for p in policies
        }
        trainers = [self._spawn("trainer", args, essential=True, log_name=name, ranks=cfg.local.trainer_ranks)
                    for name, args in trainer_args.items()]
        for w in workflows:
            metrics = self.run_dir / (f"curator.{w.name}.jsonl" if flows else "curator.jsonl")
            self._spawn("curator", ["curator", *common, "--workflow", w.name, "--dataset", prep["train_path"],
                                    "--metrics", str(metrics)],
                        essential=True, log_name=f"curator-{w.name}" if flows else "curator")
        for i in range(cfg.local.workers):
            speed = cfg.local.bench_worker_speeds
            bench = [] if speed is None else ["--set", f"worker.bench_speed={speed[i]}"]
            self._workers[f"worker-{i}"] = (["worker", "--config", str(self.worker_file), "--id", f"local-{i}", *bench],
                                            cfg.local.worker_nice, None)
            self._spawn_worker(f"worker-{i}")
        for spec in cfg.local.regions:
            self._start_region(cfg, spec)
        metrics_files = {p.name: cfg.metrics_file(self.run_dir, p.name) for p in policies}
        deadline, budget_ended = started + cfg.local.max_wall_s, False
        with build_progress(cfg, prep, metrics_files, plain=self.plain, started=started) as progress:
            while True:
                self.cpu.sample(self._processes())  # before poll() reaps a child that ended
                if all(t.proc.poll() == 0 for t in trainers):
                    break
                time.sleep(0.5)
                progress.poll()
                if self.step_cuts.pending or self.step_cuts.active:
                    self.step_cuts.tick(last_step(metrics_files[policies[0].name]))
                for i, t in enumerate(trainers):
                    if t.proc.returncode not in (None, 0):
                        n = self._restart("trainer", cfg.local.trainer_restarts,
                                          f"{t.role} exited with {t.proc.returncode} after {cfg.local.trainer_restarts} "
                                          f"restarts; log {t.log_path}:\n{t.tail()}")
                        print(f"warning: {t.role} exited with {t.proc.returncode}; restarting it from its newest "
                              f"checkpoint (restart {n} of {cfg.local.trainer_restarts})", file=sys.stderr, flush=True)
                        self.children.remove(t)
                        trainers[i] = self._spawn("trainer", trainer_args[t.role], essential=True, log_name=t.role,
                                                  ranks=cfg.local.trainer_ranks)
                self._check_children(ignore=trainers)
                if time.time() > deadline:
                    budget_ended = True
                    self._stop_at_budget(cfg, trainers)
                    break
            progress.poll()
            self.cpu.sample(self._processes(), force=True)
        for t in trainers:
            if t.proc.returncode != 0 and not budget_ended:
                raise RunFailed(f"{t.role} exited with {t.proc.returncode}; log {t.log_path}:\n{t.tail()}")
        self._stop_all()
        evaluations = {p.name: self._evaluate(p.name, prep["policies"][p.name]["eval_path"]) for p in policies}
        store = build_store(cfg.store)
        budget = {"max_wall_s": cfg.local.max_wall_s,
                  "max_steps": {p.name: p.trainer.max_steps for p in policies}} if budget_ended else None
        summary = write_report(self.run_dir, prep=prep, evaluations=evaluations, metrics=metrics_files,
                               wall_s=time.time() - started, store=store, budget=budget, **self.counts())
        # stderr: the summary JSON stays the last thing on stdout
        print(f"report: {write_html_report(self.run_dir, store=store)}", file=sys.stderr, flush=True)
        return summary

    def _stop_at_budget(self, cfg: RunConfig, trainers: list[Child]) -> None:
        """The run reached ``local.max_wall_s``: stopped as ``rlbus stop`` stops it (the stop record ends
        the curators and every worker, hand-attached ones too), the trainers by SIGTERM, so each finishes
        its step, checkpoints and publishes what it holds (``BUDGET_GRACE_S`` at most, then SIGKILL: the
        newest version in the store is what gets scored)."""
        print(f"run {cfg.run.name} reached its wall budget local.max_wall_s={cfg.local.max_wall_s:.0f}s: stopping "
              "it, then scoring its newest version on the held-out set", file=sys.stderr, flush=True)
        self._announce_stop(cfg, f"the run reached its wall budget local.max_wall_s={cfg.local.max_wall_s:.0f}s")
        for t in _terminate(trainers, BUDGET_GRACE_S):
            print(f"warning: {t.role} did not stop within {BUDGET_GRACE_S:.0f}s of the budget; killing it (its "
                  f"newest published version is scored); log {t.log_path}", file=sys.stderr, flush=True)
            if t.proc.returncode != 0:
                print(f"warning: {t.role} exited with {t.proc.returncode} when stopped at the budget; log "
                      f"{t.log_path}", file=sys.stderr, flush=True)

    def _restart(self, kind: str, budget: int, spent: str) -> int:
        """Count one restart of ``kind`` (kept on disk at once); RunFailed(``spent``) when ``budget``
        restarts of it were made already. The restart's number."""
        if self.restarts[kind] >= budget:
            raise RunFailed(spent)
        self.restarts[kind] += 1
        self._save_counts()
        return self.restarts[kind]

    def counts(self) -> dict[str, int]:
        """Restarts of the whole run: this invocation's and those before a --resume."""
        now = {f"{kind}_restarts": n for kind, n in self.restarts.items()}
        keys = {*now, *self._earlier}
        return {k: self._earlier.get(k, 0) + now.get(k, 0) for k in sorted(keys)}

    def _save_counts(self) -> None:
        self._counts_file.write_text(json.dumps(self.counts()))

    def _evaluate(self, policy: str, data: str) -> dict:
        """Greedy score of the policy's newest weights in the store on its prepared held-out rows."""
        final = subprocess.run(
            [sys.executable, "-m", "rlbus.cli", "eval", "--config", str(self.config_file), "--policy", policy,
             "--data", data, "--prepared"],
            capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="2", **self._env),
        )
        with open(self.log_dir / "eval.log", "a") as log:
            log.write(final.stderr)
        if final.returncode != 0:
            raise RunFailed(f"final evaluation of {policy} failed:\n{final.stderr[-3000:]}")
        return json.loads(final.stdout.strip().splitlines()[-1])

    def _check_children(self, ignore: list[Child]) -> None:
        self._check_storage()
        rc = None if self.broker is None else self.broker.poll()
        if rc is not None:
            storage = self.cfg.embedded_broker.storage_url
            lost = ("every record it held is lost (memory:// storage)" if storage.startswith("memory:")
                    else f"its log stays in {storage}")
            budget = self.cfg.local.broker_restarts
            n = self._restart("broker", budget, f"the embedded broker exited unexpectedly with {rc} after {budget} "
                              f"restarts; {lost}. The run stops here; log {self.broker.log_path}:\n"
                              f"{self.broker.log_tail()}")
            print(f"warning: the embedded broker exited with {rc}; {lost}. Starting it again at "
                  f"{self.cfg.kafka.bootstrap_servers} (restart {n} of {budget})", file=sys.stderr, flush=True)
            self.broker.restart()
            ensure_topics(self.cfg)
        for child in list(self.children):
            rc = child.proc.poll()
            if rc is None or child in ignore:
                continue
            self.children.remove(child)
            if child.essential and rc != 0:
                raise RunFailed(f"{child.role} exited unexpectedly with {rc}; log {child.log_path}:\n{child.tail()}")
            if rc == 0:
                logger.info("%s finished", child.role)  # e.g. after the run's stop record
                continue
            name, budget = child.log_path.stem, self.cfg.local.worker_restarts
            again = name in self._workers and self.restarts["worker"] < budget
            n = self._restart("worker", budget, "") if again else 0
            print(f"warning: {name} exited with {rc} (work it held is redelivered); "
                  + (f"starting it again (restart {n} of {budget} for the local workers); " if again else "")
                  + f"log {child.log_path}", file=sys.stderr, flush=True)
            if again:
                self._spawn_worker(name)

    def _check_storage(self) -> None:
        """The run's SeaweedFS server, when it died: started again on its directory and ports (its
        data are on disk), within the broker's restart budget."""
        rc = None if self.s3 is None or self.s3.proc is None else self.s3.proc.poll()
        if rc is None:
            return
        budget = self.cfg.local.broker_restarts
        n = self._restart("storage", budget, f"the run's SeaweedFS server exited with {rc} after {budget} restarts; "
                          f"log {self.s3.log_path}:\n{self.s3.log_tail()}")
        print(f"warning: the run's SeaweedFS server exited with {rc}; starting it again on its directory "
              f"(restart {n} of {budget})", file=sys.stderr, flush=True)
        self.s3.restart()

    def _spawn_worker(self, name: str) -> Child:
        args, nice, secrets = self._workers[name]
        return self._spawn("worker", args, essential=False, log_name=name, nice=nice, secrets=secrets)

    def _start_region(self, cfg: RunConfig, spec) -> None:
        """A region's link, replicator and workers (``rlbus.regions``); the link and the replicator are
        essential (a region without them is cut for good), its workers expendable as any."""
        from rlbus.regions import link_args, plan_region, wait_for_link

        if getattr(cfg.store, "endpoint_url", None) is None:
            raise RunFailed(f"region {spec.name}: a link stands in front of an S3 endpoint (store.endpoint_url); "
                            "the run's store has none")
        directory = self.run_dir / "regions" / spec.name
        directory.mkdir(parents=True, exist_ok=True)
        stats = directory / "link.json"
        stats.unlink(missing_ok=True)
        link = self._spawn("link", link_args(spec, cfg.kafka.bootstrap_servers.split(",")[0], cfg.store.endpoint_url,
                                             stats), essential=True, log_name=f"link-{spec.name}", secrets={})
        try:
            links, control_port = wait_for_link(stats, link.proc)
        except RuntimeError as exc:
            raise RunFailed(f"region {spec.name}: {exc}; log {link.log_path}:\n{link.tail()}") from None
        self.step_cuts.add(spec, control_port)
        region = plan_region(cfg, spec, self.run_dir, links=links, hub_store=cfg.store)
        if region.replica_args is not None:
            self._spawn("replica", region.replica_args, essential=True, log_name=f"replica-{spec.name}",
                        secrets=region.env)
        for name, args in region.workers.items():
            self._workers[name] = (args, cfg.local.worker_nice, region.env)
            self._spawn_worker(name)
        print(f"region {spec.name}: link {', '.join(f'{t} -> {a}' for t, a in links.items())}, "
              f"{spec.workers} workers, replication {spec.replication}", flush=True)

    def _announce_stop(self, cfg: RunConfig, reason: str) -> None:
        """The run's stop record, so workers attached by hand end with it (the trainers stopped here
        only leave the run; their stop does not end it)."""
        if not cfg.kafka.bootstrap_servers:
            return  # the broker never started: nothing can be attached
        if self.broker is not None and self.broker.poll() is not None:
            return  # the run's own broker is gone (why the run stops): no one could read the record
        from broker.control import announce_stop
        from broker.errors import BrokerError
        from broker.topics import Topics

        try:
            announce_stop(cfg.kafka, Topics(cfg.run.name), cfg.policy().name, reason, timeout_s=10)
        except BrokerError as exc:
            logger.warning("the run's stop record was not sent (%s): workers attached by hand go on polling", exc)

    def _stop_all(self, grace_s: float = 20.0) -> None:
        """SIGTERM (workers drain and leave their group), then SIGKILL after the grace period. The
        regions' links and replicas go last: a far worker drains through its link."""
        for children in ([c for c in self.children if not c.carries], [c for c in self.children if c.carries]):
            for child in _terminate(children, grace_s):
                logger.warning("%s did not stop in %.0fs; killing it", child.role, grace_s)
        self.children.clear()
