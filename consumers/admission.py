"""Admission control at the source (guard 1), per policy.

Each prompt a workflow dispatches comes back as one group for every policy it involves. For each
policy ``p``, in flight = dispatched − consumed by p's trainer (trained, or dropped by a gate, as its
version announcements say), and may not exceed p's window, (η_p + 1) × groups per step of p. The
curator dispatches only what every policy still running admits: the slowest trainer bounds the
workflow. A policy whose trainer finished no longer bounds it (workers go on using its final
weights for the others). When the policies take turns (``consumers.turns``), only the active one
bounds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from broker.schema import ControlRecord
from consumers.turns import Turns


@dataclass
class PolicyWindow:
    """What the curator knows of one policy's trainer."""

    window: int
    consumed: int = 0
    version: int = 0
    finished: bool = False


class Admission:
    """Per-policy admission windows of one workflow's prompt topic."""

    def __init__(self, windows: dict[str, int], turns: Turns | None = None) -> None:
        """``windows``: policy → its window, (η + 1) × groups per step; the first is the primary.
        ``turns``: the policies train one at a time, by this rule."""
        if not windows:
            raise ValueError("admission needs at least one policy")
        if any(w < 1 for w in windows.values()):
            raise ValueError(f"admission windows must be at least 1: {windows}")
        self.policies = {name: PolicyWindow(window) for name, window in windows.items()}
        self.primary = next(iter(windows))
        self.turns = turns

    def observe(self, record: ControlRecord) -> None:
        """Take a control record into account (records of other policies are ignored)."""
        state = self.policies.get(record.policy)
        if state is None:
            return
        if record.kind == "finished":
            state.finished = True
        if record.kind in ("version", "finished"):
            state.consumed = max(state.consumed, record.groups_consumed)
            state.version = max(state.version, record.version)

    def in_flight(self, dispatched: int) -> dict[str, int]:
        return {name: dispatched - s.consumed for name, s in self.policies.items()}

    def free(self, dispatched: int) -> int:
        """How many more prompts may be dispatched now (0 when any running policy's window is full)."""
        running = [n for n, s in self.policies.items() if not s.finished]
        if self.turns is not None:
            active = self.turns.active({n: s.version for n, s in self.policies.items()},
                                       {n for n, s in self.policies.items() if s.finished})
            running = [n for n in self.policies if n == active]
        if not running:
            return 0
        in_flight = self.in_flight(dispatched)
        return max(0, min(self.policies[n].window - in_flight[n] for n in running))

    @property
    def window(self) -> int:
        """The tightest window (the most prompts ever in flight)."""
        return min(s.window for s in self.policies.values())

    @property
    def all_finished(self) -> bool:
        return all(s.finished for s in self.policies.values())

    @property
    def consumed(self) -> int:
        """Prompts every running policy is done with (the primary's count when all finished)."""
        running = [s.consumed for s in self.policies.values() if not s.finished]
        return min(running) if running else self.policies[self.primary].consumed

    def dispatch_versions(self) -> dict[str, int]:
        """Each policy's newest announced version: stamped on a prompt for the workers' guard 2."""
        return {name: s.version for name, s in self.policies.items()}
