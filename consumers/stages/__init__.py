"""Data algorithms as composable stages: trainer-side group stages and curator-side prompt stages."""

from __future__ import annotations

from consumers.stages.base import (
    GroupStage,
    PromptStage,
    StageConfig,
    check_consistent,
    replace_group,
    reward_spread,
    sample_lengths,
    select_samples,
)
from consumers.stages.group_stages import (
    DynamicSampling,
    MaxVarianceDownsample,
    OverlongFilter,
    Replay,
    SoftOverlongPunishment,
    max_variance_subset,
)
from consumers.stages.prompt_stages import GresoSkip, SkipSolved
from consumers.stages.registry import (
    GROUP_STAGES,
    PROMPT_STAGES,
    StageError,
    StageSpec,
    admit_prompt,
    apply_group_stages,
    build_group_stages,
    build_prompt_stages,
    observe_prompt,
    resolve_stage,
    stage_metrics,
)

__all__ = [
    "GROUP_STAGES",
    "PROMPT_STAGES",
    "DynamicSampling",
    "GresoSkip",
    "GroupStage",
    "MaxVarianceDownsample",
    "OverlongFilter",
    "PromptStage",
    "Replay",
    "SkipSolved",
    "SoftOverlongPunishment",
    "StageConfig",
    "StageError",
    "StageSpec",
    "admit_prompt",
    "apply_group_stages",
    "build_group_stages",
    "build_prompt_stages",
    "check_consistent",
    "max_variance_subset",
    "observe_prompt",
    "replace_group",
    "resolve_stage",
    "reward_spread",
    "sample_lengths",
    "select_samples",
    "stage_metrics",
]
