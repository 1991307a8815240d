"""The two kinds of data-algorithm stage, and helpers that rebuild trajectory groups.

A ``GroupStage`` runs on the trainer side, on groups as they arrive and before they count towards
the batch of B: it may drop groups, return modified copies, or add groups. A ``PromptStage`` runs in
the curator: it decides whether a prompt is dispatched this time, and learns from the rewards of the
groups that come back. Each stage class has a nested pydantic ``Config`` and is built as
``Stage(config)``; its ``report()`` returns cumulative counters (every group stage reports what it
dropped and added).

Stages never write into the arrays of a group they were given (decoded columns may be read-only
views of the record): a modified group is a new ``TrajectoryGroup`` built with ``replace_group`` or
``select_samples``.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict

from broker.schema import TrajectoryGroup
from broker.validate import turns_problem

FLAT_COLUMNS = ("completion_tokens", "behaviour_logprobs", "token_versions", "loss_mask")
"""Per-token columns that ``completion_offsets`` cuts into samples."""


class StageConfig(BaseModel):
    """Settings of a stage without parameters; stages with parameters subclass this."""

    model_config = ConfigDict(extra="forbid")


class _Counted:
    """Config handling and cumulative counters shared by both kinds of stage."""

    name: ClassVar[str]
    Config: ClassVar[type[BaseModel]] = StageConfig
    counter_names: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "name" not in cls.__dict__:
            cls.name = cls.__name__

    def __init__(self, config: BaseModel | None = None) -> None:
        if config is None:
            config = self.Config()
        elif not isinstance(config, self.Config):
            raise TypeError(f"{type(self).__name__} takes a {self.Config.__qualname__}, got {type(config).__name__}")
        self.config = config
        self._counts: dict[str, float] = {key: 0.0 for key in self.counter_names}

    def count(self, key: str, amount: float = 1.0) -> None:
        """Add ``amount`` to the cumulative counter ``key``."""
        self._counts[key] = self._counts.get(key, 0.0) + float(amount)

    def report(self) -> dict[str, float]:
        """Cumulative counters since the stage was built."""
        return dict(self._counts)


class GroupStage(_Counted, ABC):
    """Trainer-side stage over the groups of one intake round."""

    counter_names = ("dropped", "added", "modified_samples")

    @abstractmethod
    def process(self, groups: list[TrajectoryGroup], *, version: int) -> list[TrajectoryGroup]:
        """Groups to go on with; ``version`` is the trainer's current weight version."""


class PromptStage(_Counted, ABC):
    """Curator-side stage: admission of prompts and feedback from their finished groups."""

    counter_names = ("admitted", "skipped", "observed")

    @abstractmethod
    def admit(self, prompt_key: str, rng: random.Random) -> bool:
        """False: skip this prompt this time. Random draws come only from ``rng``."""

    def observe(self, prompt_key: str, rewards: list[float]) -> None:
        """Feedback: the rewards of one finished group of ``prompt_key``. Default: ignored."""
        self.count("observed")


def reward_spread(group: TrajectoryGroup) -> float:
    """Largest minus smallest reward within one set of compared samples (the group, or its most
    spread subgroup); 0 means every advantage is zero."""
    sets: dict[int, list[float]] = {}
    labels = group.header.subgroups or [0] * group.group_size
    for label, reward in zip(labels, group.header.rewards):
        sets.setdefault(label, []).append(reward)
    return float(max(max(r) - min(r) for r in sets.values()))


def sample_lengths(group: TrajectoryGroup) -> np.ndarray:
    """Completion length in tokens of every sample (int64 [G])."""
    return np.diff(group.completion_offsets.astype(np.int64))


def replace_group(
    group: TrajectoryGroup, *, header: dict[str, Any] | None = None, **columns: np.ndarray
) -> TrajectoryGroup:
    """A new group: header fields from ``header`` and columns from ``columns`` replace the old ones.

    Unreplaced columns are shared with ``group`` (stages never write into arrays). The signature is
    cleared: it covered the group as the worker published it.
    """
    names = (*FLAT_COLUMNS, "prompt_tokens", "completion_offsets", "routed_experts")
    unknown = set(columns) - set(names)
    if unknown:
        raise TypeError(f"replace_group: unknown columns {sorted(unknown)}")
    new_header = group.header.model_copy(update={**(header or {}), "signature": None})
    fields = {name: columns.get(name, getattr(group, name)) for name in names}
    new = TrajectoryGroup(header=new_header, **fields)
    check_consistent(new)
    return new


def select_samples(group: TrajectoryGroup, keep: Sequence[int]) -> TrajectoryGroup:
    """A new group with only samples ``keep`` (in that order): offsets, rewards, finish reasons and
    every per-token column are cut together. ``min_version``/``max_version`` stay as they were,
    still a valid (conservative) bound for the samples kept."""
    idx = np.asarray(keep, dtype=np.int64)
    if idx.size == 0:
        raise ValueError(f"select_samples: group {group.header.group_id} needs at least one sample kept")
    if idx.min() < 0 or idx.max() >= group.group_size:
        raise IndexError(f"select_samples: indices {idx.tolist()} outside 0..{group.group_size - 1}")
    offsets = group.completion_offsets.astype(np.int64)
    starts, ends = offsets[idx], offsets[idx + 1]
    tokens = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in zip(starts, ends)])
    new_offsets = np.concatenate([[0], np.cumsum(ends - starts)]).astype(group.completion_offsets.dtype)
    header = {
        "rewards": [group.header.rewards[i] for i in idx],
        "finish_reasons": [group.header.finish_reasons[i] for i in idx],
    }
    for name in ("subgroups", "turns", "turn_nodes", "turn_advantages"):
        per_sample = getattr(group.header, name)
        if per_sample is not None:
            header[name] = [per_sample[i] for i in idx]
    flat = {name: getattr(group, name)[tokens] for name in FLAT_COLUMNS}
    if group.routed_experts is not None:  # the prompt's rows, then the kept tokens' (broker.schema)
        prompt_rows = len(group.prompt_tokens) - 1
        flat["routed_experts"] = np.concatenate([group.routed_experts[:prompt_rows],
                                                 group.routed_experts[prompt_rows + tokens]])
    return replace_group(group, header=header, completion_offsets=new_offsets, **flat)


def check_consistent(group: TrajectoryGroup) -> None:
    """Raise ``ValueError`` unless offsets, rewards, finish reasons and flat columns agree."""
    offsets, n = group.completion_offsets, group.group_size
    gid = group.header.group_id
    if len(group.header.rewards) != n or len(group.header.finish_reasons) != n:
        raise ValueError(
            f"group {gid}: {n} samples by offsets but {len(group.header.rewards)} rewards "
            f"and {len(group.header.finish_reasons)} finish reasons"
        )
    if group.header.subgroups is not None and len(group.header.subgroups) != n:
        raise ValueError(f"group {gid}: {n} samples but {len(group.header.subgroups)} subgroups")
    if n < 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
        raise ValueError(f"group {gid}: completion_offsets must start at 0 and never decrease")
    problem = turns_problem(group.header, np.diff(offsets.astype(np.int64)))
    if problem:
        raise ValueError(f"group {gid}: {problem}")
    for name in FLAT_COLUMNS:
        size = len(getattr(group, name))
        if size != int(offsets[-1]):
            raise ValueError(f"group {gid}: column {name} has {size} tokens, offsets say {int(offsets[-1])}")
    if group.routed_experts is not None and len(group.routed_experts) != len(group.prompt_tokens) - 1 + int(offsets[-1]):
        raise ValueError(f"group {gid}: routed_experts has {len(group.routed_experts)} rows, the prompt and tokens "
                         f"{len(group.prompt_tokens) - 1 + int(offsets[-1])}")

