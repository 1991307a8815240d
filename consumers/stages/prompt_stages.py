"""Built-in curator-side stages: skip prompts the policy has solved, or that keep giving no signal.

``prompt_key`` identifies a dataset prompt across epochs (not one dispatch); the curator calls
``admit`` before dispatching it and ``observe`` with the rewards of each group that comes back.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

from pydantic import Field, model_validator

from consumers.stages.base import PromptStage, StageConfig

logger = logging.getLogger(__name__)


@dataclass
class _Success:
    ewma: float = 0.0
    observations: int = 0


class SkipSolved(PromptStage):
    """Skip prompts whose exponentially weighted mean reward reached ``threshold``.

    Per prompt: the first group's mean reward starts the average, each later one updates it as
    ``ewma ← alpha · mean + (1 − alpha) · ewma``. A prompt is skipped once it has at least
    ``min_observations`` groups and ``ewma ≥ threshold``, except with probability ``recheck_prob``,
    which lets its estimate fall again if the policy forgets it.
    """

    name = "skip_solved"
    counter_names = ("admitted", "skipped", "observed", "rechecked")

    class Config(StageConfig):
        alpha: float = Field(default=0.5, gt=0.0, le=1.0, description="Weight of the newest group's mean reward.")
        threshold: float = Field(
            default=0.9, description="Mean reward (in reward units) at which a prompt counts as solved."
        )
        min_observations: int = Field(default=2, ge=1, description="Groups seen before a prompt may be skipped.")
        recheck_prob: float = Field(
            default=0.0, ge=0.0, le=1.0, description="Chance to dispatch a solved prompt anyway."
        )

    def __init__(self, config: SkipSolved.Config | None = None) -> None:
        super().__init__(config)
        self._success: dict[str, _Success] = {}

    def success(self, prompt_key: str) -> float | None:
        """The prompt's current average reward; None before its first group."""
        state = self._success.get(prompt_key)
        return None if state is None else state.ewma

    def admit(self, prompt_key: str, rng: random.Random) -> bool:
        state = self._success.get(prompt_key)
        solved = (
            state is not None
            and state.observations >= self.config.min_observations
            and state.ewma >= self.config.threshold
        )
        if solved and self.config.recheck_prob > 0 and rng.random() < self.config.recheck_prob:
            self.count("rechecked")
            solved = False
        self.count("skipped" if solved else "admitted")
        return not solved

    def observe(self, prompt_key: str, rewards: list[float]) -> None:
        if not rewards:
            return
        mean = sum(rewards) / len(rewards)
        state = self._success.setdefault(prompt_key, _Success())
        alpha = 1.0 if state.observations == 0 else self.config.alpha
        state.ewma = alpha * mean + (1.0 - alpha) * state.ewma
        state.observations += 1
        self.count("observed")


class GresoSkip(PromptStage):
    """GRESO-style selective rollout: skip prompts whose recent groups all had zero reward variance.

    With z the prompt's streak of consecutive zero-variance groups and p = 1 − ``base_skip_prob``
    (GRESO's exploration probability, held fixed here), the prompt is skipped with probability
    min(1 − p^z, ``max_skip_prob``); one group with differing rewards resets z to 0. The draw uses
    only the ``rng`` passed to ``admit``, so a seeded rng gives the same decisions.
    """

    name = "greso"

    class Config(StageConfig):
        base_skip_prob: float = Field(
            default=0.5, ge=0.0, le=1.0, description="Skip probability after one zero-variance group."
        )
        max_skip_prob: float = Field(
            default=0.9, ge=0.0, le=1.0, description="Cap on the skip probability; below 1 every prompt is retried sometimes."
        )
        tolerance: float = Field(
            default=0.0, ge=0.0, description="Rewards whose max − min is at most this count as zero variance."
        )

        @model_validator(mode="after")
        def _cap_covers_base(self) -> GresoSkip.Config:
            if self.max_skip_prob < self.base_skip_prob:
                raise ValueError(
                    f"max_skip_prob ({self.max_skip_prob}) must be at least base_skip_prob ({self.base_skip_prob})"
                )
            return self

    def __init__(self, config: GresoSkip.Config | None = None) -> None:
        super().__init__(config)
        self._streak: dict[str, int] = {}

    def streak(self, prompt_key: str) -> int:
        """Consecutive zero-variance groups of the prompt, most recent last."""
        return self._streak.get(prompt_key, 0)

    def skip_probability(self, prompt_key: str) -> float:
        z = self.streak(prompt_key)
        if z == 0:
            return 0.0
        return min(1.0 - (1.0 - self.config.base_skip_prob) ** z, self.config.max_skip_prob)

    def admit(self, prompt_key: str, rng: random.Random) -> bool:
        prob = self.skip_probability(prompt_key)
        skip = prob > 0 and rng.random() < prob
        self.count("skipped" if skip else "admitted")
        return not skip

    def observe(self, prompt_key: str, rewards: list[float]) -> None:
        if not rewards:
            return
        if max(rewards) - min(rewards) <= self.config.tolerance:
            self._streak[prompt_key] = self._streak.get(prompt_key, 0) + 1
        else:
            self._streak.pop(prompt_key, None)
        self.count("observed")
