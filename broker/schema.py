"""Record schemas of the wire contract.

A ``PromptRecord`` is small and travels as zstd-compressed JSON. A ``TrajectoryGroup`` is a typed
header plus columnar numpy arrays; ``broker.codec`` turns it into bytes and back, validating.

Columns are ragged over the G samples of the group: ``completion_offsets`` (length G + 1) cuts the
flat per-token columns into samples, sample ``i`` owning ``[offsets[i], offsets[i+1])``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1

FinishReason = Literal["stop", "length", "abort"]


class SamplingParams(BaseModel):
    """Sampling parameters a worker used for one group."""

    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(ge=0.0, description="Softmax temperature; 0 means greedy.")
    top_p: float = Field(gt=0.0, le=1.0, description="Nucleus sampling mass.")
    max_new_tokens: int = Field(ge=1, description="Cap on generated tokens per sample.")


class ChatTurn(BaseModel):
    """One turn of a chat prompt."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class PromptRecord(BaseModel):
    """One prompt dispatched by the curator to the rollout workers."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    run: str
    policy: str
    prompt_id: str = Field(min_length=1)
    task: str = Field(min_length=1, description="Environment name that scores completions.")
    prompt: str = Field(description="Prompt text; workers tokenize it with the policy's tokenizer.")
    messages: list[ChatTurn] | None = Field(
        default=None,
        description="Chat turns, rendered by workers with the policy's chat template (prompt is then the last "
        "user turn, what the task sees); None: the prompt text is fed as it is.",
    )
    answer: str = Field(description="Reference answer the environment scores against.")
    group_size: int = Field(ge=1, description="Samples to generate for this prompt (G).")
    dispatched_at: float = Field(default_factory=time.time, description="Unix seconds.")
    dispatch_version: int = Field(ge=0, description="Trainer version when the curator dispatched.")
    prompt_key: str | None = Field(
        default=None,
        description="Stable identity of the dataset prompt across epochs (prompt_id is unique per "
        "dispatch); curator stages learn per key. Workers copy it into the group header.",
    )
    dispatch_versions: dict[str, int] = Field(
        default_factory=dict,
        description="Each policy of the workflow's newest announced version at dispatch (guard 2 per policy); "
        "``policy``'s is also ``dispatch_version``.",
    )


class RoutingShape(BaseModel):
    """The routing a mixture-of-experts policy records: ``top_k`` of ``num_experts`` experts in each of
    ``layers`` MoE layers (in the model's layer order), per token."""

    model_config = ConfigDict(extra="forbid")

    layers: int = Field(ge=1, description="MoE layers of the model, in order.")
    top_k: int = Field(ge=1, description="Experts selected per token and layer.")
    num_experts: int = Field(ge=2, le=32767, description="Experts per MoE layer; expert ids are < this.")

    @model_validator(mode="after")
    def _k_within_experts(self) -> RoutingShape:
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} exceeds num_experts={self.num_experts}")
        return self


class TrajectoryHeader(BaseModel):
    """Typed header of a trajectory group: everything but the per-token columns."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    run: str
    policy: str
    group_id: str = Field(min_length=1, description="Unique per (prompt, attempt); the dedupe key.")
    prompt_id: str = Field(min_length=1)
    prompt_key: str | None = Field(default=None, description="The PromptRecord's prompt_key.")
    task: str
    worker_id: str
    region: str = "local"
    hardware: str = "cpu"
    engine: str = "torch"
    sampling: SamplingParams
    rewards: list[float] = Field(min_length=1, description="One reward per sample.")
    finish_reasons: list[FinishReason] = Field(min_length=1)
    min_version: int = Field(ge=0, description="Oldest weight version that produced any token.")
    max_version: int = Field(ge=0, description="Newest weight version that produced any token.")
    vocab_size: int = Field(ge=1, description="Vocabulary size of the policy; token ids are < this.")
    created_at: float = Field(description="Unix seconds when generation started.")
    published_at: float = Field(default_factory=time.time, description="Unix seconds.")
    signature: str | None = Field(default=None, description="Hex HMAC-SHA256 when the fleet signs.")
    provenance: dict[str, list[int]] = Field(
        default_factory=dict,
        description="Other policies whose output this group's samples read (a verifier's judged answers): each "
        "with the [oldest, newest] version of theirs involved. The per-token versions are this policy's own.",
    )
    subgroups: list[int] | None = Field(
        default=None,
        description="Per sample, the set it is compared with for its advantage (the baseline is that set's mean "
        "reward); None: the whole group is one set. A verifier that judges G answers in one group, each several "
        "times, compares a verdict only with the other verdicts on the same answer.",
    )

    turns: list[list[list[int]]] | None = Field(
        default=None,
        description="Per sample of a multi-turn episode, each turn's generated tokens as [start, end) offsets in the "
        "sample's completion; the tokens between one turn's end and the next one's start are the environment's "
        "observation. None: single-turn samples.",
    )
    turn_nodes: list[list[int]] | None = Field(
        default=None,
        description="Per sample, per turn, the node of the group's trajectory graph the step is (the step_credit "
        "stage): the samples through a node share that step's advantage, the mean of their outcome advantages. "
        "None: every token of a sample has the sample's advantage.",
    )
    turn_advantages: list[list[float]] | None = Field(
        default=None,
        description="Per sample, per turn, a step-level advantage added to that turn's tokens (the step_credit "
        "stage's gigpo method: the turn's discounted return against the other steps taken from the same state).",
    )

    routing: RoutingShape | None = Field(
        default=None,
        description="A mixture-of-experts policy's routing shape: the group then carries ``routed_experts`` (the "
        "experts its engine selected per token and MoE layer). None: a dense policy, or routing not recorded.",
    )

    @property
    def group_size(self) -> int:
        return len(self.rewards)


MULTI_TURN_FIELDS = ("turns", "turn_nodes", "turn_advantages")
"""Header fields only multi-turn groups have."""
OPTIONAL_HEADER_FIELDS = (*MULTI_TURN_FIELDS, "routing")
"""Header fields a record leaves out when they are None (multi-turn, mixture-of-experts), so that the records
of single-turn dense policies are what they were before these fields existed."""


class ClaimRecord(BaseModel):
    """A trajectory group too large for a record (over ``kafka.max_message_bytes``): its encoded bytes
    are in the run's object store under ``key``, named by their SHA-256; the record carries this."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    run: str
    policy: str
    group_id: str = Field(min_length=1)
    key: str = Field(min_length=1, description="Object key in the run's store (claims/<unix s>-<sha256>).")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Of the encoded group's bytes.")
    size: int = Field(ge=1, description="Bytes of the encoded group.")


@dataclass
class TrajectoryGroup:
    """All G samples of one prompt for one policy: header + columns."""

    header: TrajectoryHeader
    prompt_tokens: np.ndarray  # int32 [P]
    completion_tokens: np.ndarray  # int32 [T] flat over samples
    completion_offsets: np.ndarray  # int32 [G + 1]
    behaviour_logprobs: np.ndarray  # float32 [T]
    token_versions: np.ndarray  # int32 [T]
    loss_mask: np.ndarray = field(default=None)  # uint8 [T]; 1 = trained on (None -> all ones)
    routed_experts: np.ndarray | None = None
    """int16 [P - 1 + T, layers, top_k] when the header has ``routing`` (else None), P = len(prompt_tokens):
    the experts selected at each input position that predicts a token. Row p < P - 1: the prompt's position
    p (the prompt pass, shared by the group's samples); row P - 1 + t: completion token t (flat over the
    samples, as ``completion_tokens``), the selection at the position that predicted it (for a sample's
    first token the prompt's last position, else the sample's previous token; for an observation token
    of a multi-turn episode, the pass that read the previous position). Each row holds its experts in
    increasing order, or is all -1: not recorded (the trainer routes that position itself)."""

    def __post_init__(self) -> None:
        if self.loss_mask is None:
            self.loss_mask = np.ones(len(self.completion_tokens), dtype=np.uint8)

    @property
    def group_size(self) -> int:
        return len(self.completion_offsets) - 1

    def sample(self, i: int) -> slice:
        """Slice of the flat token columns that belongs to sample ``i``."""
        return slice(int(self.completion_offsets[i]), int(self.completion_offsets[i + 1]))


COLUMNS: tuple[tuple[str, type], ...] = (
    ("prompt_tokens", np.int32),
    ("completion_tokens", np.int32),
    ("completion_offsets", np.int32),
    ("behaviour_logprobs", np.float32),
    ("token_versions", np.int32),
    ("loss_mask", np.uint8),
)
"""Column names and dtypes in wire order."""


class ControlRecord(BaseModel):
    """Announcements on ``<run>.control``: a fast path beside polling the weightstore.

    ``version``: the trainer of ``policy`` published weights ``version`` and has consumed
    ``groups_consumed`` groups in total (trained, or dropped by a gate). ``finished``: the trainer of
    ``policy`` is done (its last version and count); a run is over when every policy finished, or at
    ``stop``, which ends it at once.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    kind: Literal["version", "finished", "stop"]
    run: str
    policy: str
    version: int = Field(ge=0)
    groups_consumed: int = Field(default=0, ge=0)
    consumed_ids: list[str] = Field(
        default_factory=list,
        description="Prompt ids whose groups the trainer took off its topic since its previous announcement "
        "(trained, dropped by a gate, or a copy of one it has): the curator stops tracking them, and re-dispatches "
        "the prompts it still tracks when the broker loses its log.",
    )
    sent_at: float = Field(default_factory=time.time)
    reason: str = ""
