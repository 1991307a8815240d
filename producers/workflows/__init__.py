"""Workflows: what a rollout worker runs for one prompt, over one or more policies.

A workflow names the *roles* it needs (``single`` one, ``policy``; ``solver_verifier`` two,
``solver`` and ``verifier``); the run config binds each role to one of its policies. For a batch of
prompts, the worker hands the workflow each role's ``PolicyRuntime`` (engine, sampling, weights)
and the run's task; the workflow generates and scores, and returns for each prompt one
``Produced`` group per policy involved, which the worker publishes to that policy's trajectory
topic. Every token carries the version of its own policy's weights that produced it; the versions
of the other policies an episode used travel in the group's provenance.

A workflow also says how each role is evaluated on held-out data (``role_rows`` and
``judge``): the solver by the task on the held-out prompts, the verifier by its verdicts on a fixed
set of judged answers.

Built in: ``single`` (``producers.workflows.single:SingleWorkflow``) and ``solver_verifier``
(``producers.workflows.solver_verifier:SolverVerifierWorkflow``); any other by import path
``package.module:Class``, built with the spec's ``params``.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from broker.schema import PromptRecord, SamplingParams
from producers.config import BUILTIN_WORKFLOWS, WorkflowSpec
from producers.tasks import Task

if TYPE_CHECKING:
    from producers.engines import Engine, GenerationResult


class WorkflowError(ValueError):
    """A workflow reference that cannot be loaded, or roles that do not fit it."""

    retriable = False


@dataclass
class PolicyRuntime:
    """What a workflow may use of one policy on this worker."""

    name: str
    engine: Engine
    sampling: SamplingParams
    between_turns: Callable[[int], Awaitable[None]] | None = None
    """Called before each later turn of a multi-turn episode (moves the engine to newer weights)."""


@dataclass
class Produced:
    """One policy's group for one prompt: G samples after a shared prompt, with their rewards.

    A sample's ``mask`` marks tokens that are not the policy's own (environment observations, or
    another policy's text a verifier reads): they are never trained on."""

    policy: str
    prompt_tokens: list[int]
    results: list[GenerationResult]
    rewards: list[float]
    provenance: dict[str, list[int]] = field(default_factory=dict)
    """Other policies that contributed, each with the [oldest, newest] version of theirs involved."""
    subgroups: list[int] | None = None
    """Per sample, the set of samples its advantage compares it with (None: the whole group)."""


@runtime_checkable
class Workflow(Protocol):
    """Generates and scores one batch of prompts over the policies bound to its roles."""

    roles: tuple[str, ...]

    async def run(
        self, prompts: Sequence[PromptRecord], policies: Mapping[str, PolicyRuntime], task: Task
    ) -> list[list[Produced] | Exception]:
        """For each prompt (in order): its groups, one per policy involved, or the error
        (``AnswerError``/``PromptError``) that makes it unusable; it then goes to the DLQ."""
        ...

    async def role_rows(self, role: str, rows: Sequence[Any], policies: Mapping[str, PolicyRuntime], task: Task,
                           *, seed: int) -> list[dict[str, Any]]:
        """The rows ``role`` is judged on (``prompt``, ``answer``, optional ``messages``), built from
        dataset ``rows`` and the base models (``policies``, by role): from held-out rows, its held-out
        set; from train rows, its warm-up demonstrations."""
        ...

    def judge(self, role: str, task: Task) -> Task:
        """The task that scores ``role``'s greedy completions of its held-out rows."""
        ...


def load_workflow(spec: WorkflowSpec) -> Workflow:
    """The workflow ``spec`` names, built with its params; its roles checked against ``spec.roles``."""
    ref = spec.import_path
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise WorkflowError(f"workflow {spec.name!r}: type {spec.type!r} is unknown: use one of {sorted(BUILTIN_WORKFLOWS)} "
                            "or an import path 'package.module:Class'")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise WorkflowError(f"workflow {spec.name!r}: cannot load {ref!r} ({exc})") from exc
    try:
        workflow = cls(**spec.params)
    except (TypeError, ValueError) as exc:
        raise WorkflowError(f"workflow {spec.name!r} ({ref}) with params {spec.params}: {exc}") from exc
    if not isinstance(workflow, Workflow):
        raise WorkflowError(f"workflow {spec.name!r}: {ref} needs 'roles', 'run', 'role_rows' and 'judge'")
    if set(spec.roles) != set(workflow.roles):
        raise WorkflowError(f"workflow {spec.name!r} ({spec.type}) has the roles {list(workflow.roles)}; "
                            f"roles binds {sorted(spec.roles)}: bind each of its roles to a policy")
    return workflow


def single_row(row: Any) -> dict[str, Any]:
    """A dataset row (``consumers.dataset.Row``) as a held-out JSON row."""
    out: dict[str, Any] = {"prompt_id": row.key, "prompt": row.prompt, "answer": row.answer}
    if row.messages is not None:
        out["messages"] = [dict(m) for m in row.messages]
    return out
