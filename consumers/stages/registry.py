"""Stages named in a run config: ``StageSpec`` lists turned into stage objects, and applied in order.

A spec's ``type`` is a built-in name or the import path of a user stage, ``package.module:Class``
or ``package.module.Class``; its ``params`` are validated by that stage's own ``Config``.
"""

from __future__ import annotations

import importlib
import logging
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from broker.schema import TrajectoryGroup
from consumers.stages.base import GroupStage, PromptStage
from consumers.stages.credit import StepCredit
from consumers.stages.group_stages import (
    DynamicSampling,
    MaxVarianceDownsample,
    OverlongFilter,
    Replay,
    SoftOverlongPunishment,
)
from consumers.stages.prompt_stages import GresoSkip, SkipSolved

logger = logging.getLogger(__name__)

GROUP_STAGES: Mapping[str, type[GroupStage]] = {
    cls.name: cls
    for cls in (DynamicSampling, OverlongFilter, SoftOverlongPunishment, MaxVarianceDownsample, Replay, StepCredit)
}
PROMPT_STAGES: Mapping[str, type[PromptStage]] = {cls.name: cls for cls in (SkipSolved, GresoSkip)}


class StageError(ValueError):
    """A stage spec that cannot be built: unknown name, bad import path, wrong kind, bad params."""

    retriable = False


class StageSpec(BaseModel):
    """One data-algorithm stage of a run."""

    model_config = ConfigDict(extra="forbid")

    type: str = Field(
        min_length=1,
        description="Built-in stage name, or a user stage as 'package.module:Class' or 'package.module.Class'.",
    )
    params: dict[str, Any] = Field(default_factory=dict, description="Settings, validated by the stage's Config.")


def resolve_stage(type_name: str) -> type:
    """The class a spec's ``type`` names: a built-in of either kind, or an imported class."""
    builtin = GROUP_STAGES.get(type_name) or PROMPT_STAGES.get(type_name)
    if builtin is not None:
        return builtin
    if ":" in type_name:
        module_name, _, attr_path = type_name.partition(":")
    elif "." in type_name:
        module_name, _, attr_path = type_name.rpartition(".")
    else:
        names = ", ".join(sorted({*GROUP_STAGES, *PROMPT_STAGES}))
        raise StageError(
            f"unknown stage {type_name!r}: built-in stages are {names}; "
            "a user stage is named by its import path, 'package.module:Class'"
        )
    if not module_name or not attr_path:
        raise StageError(f"stage {type_name!r}: write a user stage as 'package.module:Class'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise StageError(
            f"stage {type_name!r}: cannot import module {module_name!r} ({exc}); is it on PYTHONPATH?"
        ) from exc
    for part in attr_path.split("."):
        if not hasattr(obj, part):
            raise StageError(f"stage {type_name!r}: module {module_name!r} has no attribute {attr_path!r}")
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise StageError(f"stage {type_name!r} is a {type(obj).__name__}, not a GroupStage or PromptStage class")
    return obj


def _build(specs: Sequence[StageSpec | Mapping[str, Any]], kind: type, other: type, where: str) -> list:
    stages = []
    for index, raw in enumerate(specs):
        spec = raw if isinstance(raw, StageSpec) else StageSpec.model_validate(raw)
        cls = resolve_stage(spec.type)
        if not issubclass(cls, kind):
            if issubclass(cls, other):
                hint = f"it is a {other.__name__}: list it with the {other.__name__} specs"
            else:
                hint = f"subclass {kind.__name__}"
            raise StageError(f"{where}[{index}] {spec.type!r} is not a {kind.__name__}; {hint}")
        try:
            config = cls.Config.model_validate(spec.params)
        except pydantic.ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'params'}: {e['msg']}" for e in exc.errors())
            raise StageError(f"{where}[{index}] {spec.type!r} has bad params: {problems}") from None
        stages.append(cls(config))
    return stages


def build_group_stages(specs: Sequence[StageSpec | Mapping[str, Any]]) -> list[GroupStage]:
    """Trainer-side stages, in the order given."""
    return _build(specs, GroupStage, PromptStage, "group stages")


def build_prompt_stages(specs: Sequence[StageSpec | Mapping[str, Any]]) -> list[PromptStage]:
    """Curator-side stages, in the order given."""
    return _build(specs, PromptStage, GroupStage, "prompt stages")


def apply_group_stages(
    stages: Sequence[GroupStage], groups: list[TrajectoryGroup], version: int
) -> list[TrajectoryGroup]:
    """Run ``groups`` through every stage in order; ``version`` is the trainer's current version. Each
    stage's time adds up in its ``seconds`` counter."""
    for stage in stages:
        started = time.perf_counter()
        groups = stage.process(groups, version=version)
        stage.count("seconds", time.perf_counter() - started)
    return groups


def admit_prompt(stages: Sequence[PromptStage], prompt_key: str, rng: random.Random) -> bool:
    """True when every stage admits the prompt (stages after the first refusal are not asked)."""
    return all(stage.admit(prompt_key, rng) for stage in stages)


def observe_prompt(stages: Sequence[PromptStage], prompt_key: str, rewards: list[float]) -> None:
    """Feed the rewards of a finished group of ``prompt_key`` to every stage."""
    for stage in stages:
        stage.observe(prompt_key, rewards)


def stage_metrics(stages: Sequence[GroupStage | PromptStage]) -> dict[str, float]:
    """Every stage's counters as flat ``<name>/<counter>`` keys; a repeated name gets ``#2``, ``#3``…"""
    seen: dict[str, int] = {}
    out: dict[str, float] = {}
    for stage in stages:
        seen[stage.name] = seen.get(stage.name, 0) + 1
        label = stage.name if seen[stage.name] == 1 else f"{stage.name}#{seen[stage.name]}"
        out.update({f"{label}/{key}": value for key, value in stage.report().items()})
    return out
