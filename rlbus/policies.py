"""The policies of a run and the workflows that use them, as the run config declares them.

A run without ``[[policies]]`` has one policy, ``run.policy``, configured by the top-level
``[model]``, ``[trainer]``, ``[sampling]``, ``run.max_staleness`` and ``trainer_stages``. With
``[[policies]]``, each entry names a policy and may override any of those for itself: its
``trainer`` and ``sampling`` tables are laid over the top-level ones (so ``[trainer]`` holds what
all policies share), its ``model``, ``max_staleness`` and ``trainer_stages`` replace them.

A run without ``[[workflows]]`` and one policy runs the ``single`` workflow named after the policy,
on ``<run>.prompts.<policy>``, as a single-policy run always has. Each policy is
used by at most one workflow: a policy's admission window is counted by one curator.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic._internal._utils import deep_update

from consumers.stages import StageSpec
from producers.config import SamplingConfig, WorkflowSpec
from trainer.config import ModelConfig, TrainerConfig, WarmupConfig


class PolicySpec(BaseModel):
    """One policy of a multi-policy run: its own topic, trainer, checkpoints and weight chain."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]+$", description="Policy name: <run>.trajectories.<name>, its chain in the store.")
    model: ModelConfig | None = Field(default=None, description="Its checkpoint; None: the run's [model].")
    trainer: dict[str, Any] = Field(default_factory=dict, description="Trainer settings laid over the run's [trainer].")
    sampling: dict[str, Any] = Field(default_factory=dict, description="Sampling settings laid over the run's [sampling].")
    max_staleness: int | None = Field(default=None, ge=0, description="Its η; None: run.max_staleness.")
    trainer_stages: list[StageSpec] | None = Field(default=None, description="Its data stages; None: the run's.")
    warmup: WarmupConfig | None = Field(
        default=None,
        description="A supervised warm-up of its base model on its role's demonstrations before RL (a verifier: "
        "the base solver's answers on train prompts, labelled by the checker), stopping at target_accuracy; "
        "None: none.",
    )


@dataclass(frozen=True)
class Policy:
    """A policy with every setting resolved."""

    name: str
    model: ModelConfig
    trainer: TrainerConfig
    sampling: SamplingConfig
    max_staleness: int
    trainer_stages: list[StageSpec]
    warmup: WarmupConfig | None = None


def _layered(model: type[BaseModel], base: BaseModel, overrides: dict[str, Any], where: str) -> Any:
    """``overrides`` over the fields ``base`` was given (those left out take their defaults again, or the
    preset of an ``algorithm`` the overrides name)."""
    try:
        return model.model_validate(deep_update(base.model_dump(exclude_unset=True), overrides))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise ValueError(f"{where}: {problems}") from None


def _with_budget(trainer: TrainerConfig, sampling: SamplingConfig) -> TrainerConfig:
    """Dr. GRPO's constant loss normaliser defaults to the policy's generation budget."""
    if trainer.loss_norm_tokens is not None:
        return trainer
    return trainer.model_copy(update={"loss_norm_tokens": sampling.max_new_tokens})


def resolve_policies(cfg: Any) -> list[Policy]:
    """Every policy of the run config ``cfg`` (a ``RunConfig``), first policy first."""
    if not cfg.policies:
        return [Policy(cfg.run.policy, cfg.model, _with_budget(cfg.trainer, cfg.sampling), cfg.sampling,
                       cfg.run.max_staleness, list(cfg.trainer_stages))]
    out = []
    for i, spec in enumerate(cfg.policies):
        where = f"policies.{i} ({spec.name})"
        sampling = _layered(SamplingConfig, cfg.sampling, spec.sampling, f"{where}.sampling")
        out.append(Policy(
            name=spec.name,
            model=spec.model or cfg.model,
            trainer=_with_budget(_layered(TrainerConfig, cfg.trainer, spec.trainer, f"{where}.trainer"), sampling),
            sampling=sampling,
            max_staleness=cfg.run.max_staleness if spec.max_staleness is None else spec.max_staleness,
            trainer_stages=list(cfg.trainer_stages if spec.trainer_stages is None else spec.trainer_stages),
            warmup=spec.warmup,
        ))
    return out


def resolve_workflows(cfg: Any) -> list[WorkflowSpec]:
    """Every workflow of the run config ``cfg``; checks that each policy is used exactly once."""
    policies = [p.name for p in resolve_policies(cfg)]
    if len(set(policies)) != len(policies):
        raise ValueError(f"policies {policies}: each policy name may appear once")
    if not cfg.workflows:
        if len(policies) > 1:
            raise ValueError(f"a run with several policies ({', '.join(policies)}) needs [[workflows]] that say "
                             "which policy plays which role, e.g. type = 'solver_verifier', "
                             "roles = { solver = 'a', verifier = 'b' }")
        return [WorkflowSpec(name=policies[0], type="single", roles={"policy": policies[0]})]
    names = [w.name for w in cfg.workflows]
    if len(set(names)) != len(names):
        raise ValueError(f"workflows {names}: each workflow name may appear once (it names a prompt topic)")
    used: dict[str, str] = {}
    for workflow in cfg.workflows:
        for policy in workflow.policies:
            if policy not in policies:
                raise ValueError(f"workflow {workflow.name!r} binds policy {policy!r}, which the run does not declare "
                                 f"(its policies: {', '.join(policies)})")
            if policy in used:
                raise ValueError(f"policy {policy!r} is used by workflows {used[policy]!r} and {workflow.name!r}: a "
                                 "policy's admission window is counted by one curator, so give each workflow its own")
            used[policy] = workflow.name
    idle = [p for p in policies if p not in used]
    if idle:
        raise ValueError(f"policies {idle} are in no workflow: bind them to a role or remove them")
    return list(cfg.workflows)
