"""Built-in trainer-side stages: DAPO's dynamic sampling and overlong handling, PODS, replay."""

from __future__ import annotations

import collections
import logging
import math
import random
from dataclasses import dataclass

import numpy as np
from pydantic import Field, model_validator

from broker.schema import FinishReason, TrajectoryGroup
from consumers.stages.base import (
    GroupStage,
    StageConfig,
    replace_group,
    reward_spread,
    sample_lengths,
    select_samples,
)

logger = logging.getLogger(__name__)


class DynamicSampling(GroupStage):
    """DAPO dynamic sampling: drop groups whose rewards are all equal (every advantage is zero);
    the trainer keeps pulling groups until it has B that carry signal."""

    name = "dynamic_sampling"

    class Config(StageConfig):
        tolerance: float = Field(
            default=0.0, ge=0.0, description="Rewards whose max − min is at most this count as all equal."
        )

    def process(self, groups: list[TrajectoryGroup], *, version: int) -> list[TrajectoryGroup]:
        kept = [g for g in groups if reward_spread(g) > self.config.tolerance]
        self.count("dropped", len(groups) - len(kept))
        return kept


class OverlongFilter(GroupStage):
    """DAPO overlong filtering: samples cut off by the length limit get loss_mask 0 (their reward
    still shapes the group's advantages); the group is kept."""

    name = "overlong_filter"

    class Config(StageConfig):
        finish_reasons: list[FinishReason] = Field(
            default=["length"], min_length=1, description="Finish reasons whose samples are masked out."
        )

    def process(self, groups: list[TrajectoryGroup], *, version: int) -> list[TrajectoryGroup]:
        out = []
        for group in groups:
            hit = [i for i, r in enumerate(group.header.finish_reasons) if r in self.config.finish_reasons]
            if not hit:
                out.append(group)
                continue
            mask = group.loss_mask.copy()
            for i in hit:
                mask[group.sample(i)] = 0
            self.count("modified_samples", len(hit))
            out.append(replace_group(group, loss_mask=mask))
        return out


class SoftOverlongPunishment(GroupStage):
    """DAPO soft overlong punishment (eq. 13), added to each sample's reward.

    With |y| the completion length in tokens, L_max = ``max_length`` and L_cache = ``cache_length``:
    R(y) = 0 if |y| ≤ L_max − L_cache; ((L_max − L_cache) − |y|) / L_cache if
    L_max − L_cache < |y| ≤ L_max; −1 if |y| > L_max. The penalty is linear from 0 to −1 over the
    last L_cache tokens before the limit.
    """

    name = "soft_overlong"

    class Config(StageConfig):
        max_length: int = Field(ge=1, description="L_max: completion length in tokens where the penalty reaches −1.")
        cache_length: int = Field(ge=1, description="L_cache: tokens before L_max over which the penalty ramps.")

        @model_validator(mode="after")
        def _cache_fits(self) -> SoftOverlongPunishment.Config:
            if self.cache_length > self.max_length:
                raise ValueError(f"cache_length ({self.cache_length}) must not exceed max_length ({self.max_length})")
            return self

    def penalty(self, lengths: np.ndarray) -> np.ndarray:
        """R(y) for completion lengths ``lengths`` (float64)."""
        l_max, l_cache = self.config.max_length, self.config.cache_length
        lengths = np.asarray(lengths, dtype=np.float64)
        ramp = ((l_max - l_cache) - lengths) / l_cache
        return np.where(lengths <= l_max - l_cache, 0.0, np.where(lengths <= l_max, ramp, -1.0))

    def process(self, groups: list[TrajectoryGroup], *, version: int) -> list[TrajectoryGroup]:
        out = []
        for group in groups:
            pen = self.penalty(sample_lengths(group))
            if not np.any(pen):
                out.append(group)
                continue
            rewards = [float(r + p) for r, p in zip(group.header.rewards, pen)]
            self.count("modified_samples", int(np.count_nonzero(pen)))
            self.count("penalty_sum", float(pen.sum()))
            out.append(replace_group(group, header={"rewards": rewards}))
        return out


def max_variance_subset(rewards: list[float], m: int) -> list[int]:
    """Indices (ascending) of the m rewards with the largest variance: the bottom m−k and the top k
    of the sorted rewards, for the best k in 0..m (first best k on ties)."""
    n = len(rewards)
    if m >= n:
        return list(range(n))
    order = np.argsort(np.asarray(rewards, dtype=np.float64), kind="stable")
    values = np.asarray(rewards, dtype=np.float64)[order]
    best_k, best_var = 0, -math.inf
    for k in range(m + 1):
        chosen = np.concatenate([values[: m - k], values[n - k :]])
        var = float(chosen.var())
        if var > best_var:
            best_k, best_var = k, var
    return sorted(int(i) for i in np.concatenate([order[: m - best_k], order[n - best_k :]]))


class MaxVarianceDownsample(GroupStage):
    """PODS max-variance down-sampling: keep m of the n samples of each group, those whose rewards
    have the largest variance.

    Why top/bottom: m²·Var is convex in any one member x, (m−1)x² − 2x·Σothers + c, so a member lying between two non-members swaps for one of them without lowering Var: some optimum is bottom m−k ∪ top k.
    """

    name = "pods"
    counter_names = ("dropped", "added", "modified_samples", "dropped_samples")

    class Config(StageConfig):
        keep: int = Field(ge=2, description="m: samples kept per group; groups of at most m samples pass unchanged.")

    def process(self, groups: list[TrajectoryGroup], *, version: int) -> list[TrajectoryGroup]:
        out = []
        for group in groups:
            if group.group_size <= self.config.keep:
                out.append(group)
                continue
            keep = max_variance_subset(group.header.rewards, self.config.keep)
            self.count("dropped_samples", group.group_size - len(keep))
            out.append(select_samples(group, keep))
        return out


@dataclass
class _Buffered:
    group: TrajectoryGroup
    uses: int = 0


class Replay(GroupStage):
    """Replay of recent groups with signal: for each round with K incoming groups whose rewards
    differ, add round(ratio × K) (half up) buffered groups that are still within the staleness
    bound (``version − min_version ≤ max_staleness``) and were replayed fewer than ``max_uses``
    times. A copy's group id gets the suffix ``/replay<use>`` so dedupe keeps it."""

    name = "replay"
    counter_names = ("dropped", "added", "modified_samples", "expired", "evicted")

    class Config(StageConfig):
        max_staleness: int = Field(ge=0, description="Versions a replayed group may lag the trainer (η).")
        ratio: float = Field(
            default=0.25, ge=0.0, le=4.0, description="Replayed groups per incoming group with signal."
        )
        capacity: int = Field(default=256, ge=1, description="Groups held in the buffer; the oldest leave first.")
        max_uses: int = Field(default=1, ge=1, description="Times one group may be replayed.")
        seed: int = Field(default=0, description="Seed of the draw among eligible buffered groups.")

    def __init__(self, config: Replay.Config | None = None) -> None:
        super().__init__(config)
        self._buffer: collections.deque[_Buffered] = collections.deque()
        self._rng = random.Random(self.config.seed)

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    def process(self, groups: list[TrajectoryGroup], *, version: int) -> list[TrajectoryGroup]:
        fresh = [b for b in self._buffer if version - b.group.header.min_version <= self.config.max_staleness]
        self.count("expired", len(self._buffer) - len(fresh))  # only older from here on: evict now
        kept = [g for g in groups if reward_spread(g) > 0]
        wanted = math.floor(self.config.ratio * len(kept) + 0.5)
        drawn = self._rng.sample(fresh, min(wanted, len(fresh)))
        replayed = []
        for entry in drawn:
            entry.uses += 1
            gid = f"{entry.group.header.group_id}/replay{entry.uses}"
            replayed.append(replace_group(entry.group, header={"group_id": gid}))
        self._buffer = collections.deque(b for b in fresh if b.uses < self.config.max_uses)
        for group in kept:
            self._buffer.append(_Buffered(group))
            if len(self._buffer) > self.config.capacity:
                self._buffer.popleft()
                self.count("evicted")
        self.count("added", len(replayed))
        if replayed:
            logger.debug(
                "replay: %d groups added at version %d, %d buffered", len(replayed), version, len(self._buffer)
            )
        return groups + replayed
