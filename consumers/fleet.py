"""What an operator asks of a fleet: how long a weight version takes to reach the workers, and
whether to add or remove workers. The trainer and ``rlbus status`` compute both the same way, the
trainer from the groups it reads, ``rlbus status`` from the tail of the trajectory topics and the
store's manifests.

Propagation of version v: for each live worker that was already working when v was published,
the time from publishing v to the start of its first generation on v or newer (a group's
``created_at`` with ``min_version >= v``: every token of it came from v or later, so the worker had
v loaded when it began); the version's figure is the slowest such worker. It mixes the trainer's
clock (publication) with the workers' (``created_at``): machines should run NTP.

Scaling: a trainer that waits for groups more than 10% of its time needs more workers, G' =
⌈G / (1 − w)⌉ (the fleet's rate scales with its size, and the trainer would then wait no longer
than it computes); one that waits under 5% may have too many: when the fleet publishes more
groups per second than the trainer takes (the surplus goes stale), G' = ⌈1.1 · G · taken /
published⌉ keeps 10% headroom over what the trainer takes, and the rest can go.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ADD_ABOVE = 0.10
"""Trainer wait fraction above which the recommendation is to add workers."""
REMOVE_BELOW = 0.05
"""Trainer wait fraction below which the fleet may be too large."""
HEADROOM = 1.1
"""Workers kept over what the trainer takes when removing."""


class Propagation:
    """When each of the newest ``keep`` versions reached the workers that were live when it was published."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self.published: dict[int, float] = {}
        self.first_seen: dict[str, float] = {}
        self.reached: dict[int, dict[str, float]] = {}

    def publish(self, version: int, at: float) -> None:
        self.published[version] = at
        for old in sorted(self.published)[:-self.keep]:
            self.published.pop(old)
            self.reached.pop(old, None)

    def observe(self, worker: str, min_version: int, created_at: float) -> None:
        """A group of ``worker`` generated from ``created_at`` on weights ``min_version`` or newer."""
        self.first_seen[worker] = min(self.first_seen.get(worker, created_at), created_at)
        for version in self.published:
            if version <= min_version:
                reached = self.reached.setdefault(version, {})
                reached[worker] = min(reached.get(worker, created_at), created_at)

    def latest(self, live: set[str] | list[str]) -> tuple[int, float] | None:
        """(version, seconds) of the newest version every live worker that predates it has used."""
        for version in sorted(self.published, reverse=True):
            at = self.published[version]
            workers = {w for w in live if self.first_seen.get(w, math.inf) < at}
            reached = self.reached.get(version, {})
            if workers and workers <= reached.keys():
                return version, max(0.0, max(reached[w] for w in workers) - at)
        return None


@dataclass(frozen=True)
class Recommendation:
    action: str
    """add, remove or hold."""
    workers: int
    """Workers now."""
    target_workers: int
    """Workers recommended."""
    reason: str

    @property
    def change(self) -> int:
        return self.target_workers - self.workers

    def as_dict(self) -> dict:
        return {"action": self.action, "workers": self.workers, "target_workers": self.target_workers,
                "change": self.change, "reason": self.reason}


def recommend(workers: int, wait_fraction: float | None, *, published_per_s: float | None = None,
              taken_per_s: float | None = None) -> Recommendation:
    """The scaling rule of the module docstring. ``published_per_s``: groups the fleet publishes;
    ``taken_per_s``: groups the trainer takes (both over the same recent window)."""
    if wait_fraction is None:
        return Recommendation("hold", workers, workers, "the trainer's wait fraction is not known yet")
    w = min(max(wait_fraction, 0.0), 0.99)
    if workers == 0:
        return Recommendation("add", 0, 1, "no live worker")
    if w > ADD_ABOVE:
        target = math.ceil(workers / (1.0 - w))
        return Recommendation("add", workers, target,
                              f"the trainer waits {w:.0%} of its time (over {ADD_ABOVE:.0%}): ⌈{workers}/(1−{w:.2f})⌉")
    if w < REMOVE_BELOW:
        if published_per_s and taken_per_s is not None and published_per_s > taken_per_s:
            target = max(1, math.ceil(HEADROOM * workers * taken_per_s / published_per_s))
            if target < workers:
                return Recommendation(
                    "remove", workers, target,
                    f"the trainer waits {w:.0%} (under {REMOVE_BELOW:.0%}) and takes {taken_per_s:.2f} of the "
                    f"{published_per_s:.2f} groups/s the fleet publishes: ⌈{HEADROOM}·{workers}·{taken_per_s:.2f}/"
                    f"{published_per_s:.2f}⌉")
        return Recommendation("hold", workers, workers,
                              f"the trainer waits {w:.0%} (under {REMOVE_BELOW:.0%}) and takes what the fleet publishes")
    return Recommendation("hold", workers, workers,
                          f"the trainer waits {w:.0%}, between {REMOVE_BELOW:.0%} and {ADD_ABOVE:.0%}")
