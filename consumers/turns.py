"""Alternating training: the policies of a run take turns, as sequential multi-agent systems train.

With ``run.schedule = "alternating"`` one trainer is active at a time: each takes
``run.alternate_steps`` optimizer steps, then hands over to the next policy in declaration order.
Workers keep running every workflow (an episode needs all its policies), so the groups of a paused
policy wait in its topic and are trained on, or dropped as stale, when its turn comes. The curator
admits prompts for the active policy only; otherwise the paused one's full window would stop
dispatch for all.

Who is active follows from the versions each trainer announced: a policy's completed turns are
``version // steps``; the active one is the first policy, in order, among those still running with
the fewest completed turns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from broker.control import ControlReader
from broker.settings import KafkaConfig
from broker.topics import Topics

logger = logging.getLogger(__name__)


class Turns:
    """The turn rule over announced versions."""

    def __init__(self, order: list[str], steps: int) -> None:
        if steps < 1:
            raise ValueError("alternate_steps must be at least 1")
        self.order, self.steps = list(order), steps

    def active(self, versions: dict[str, int], finished: set[str]) -> str | None:
        """The policy whose turn it is (None when every policy finished)."""
        running = [p for p in self.order if p not in finished]
        if not running:
            return None
        rounds = {p: versions.get(p, 0) // self.steps for p in running}
        low = min(rounds.values())
        return next(p for p in running if rounds[p] == low)


class TurnGate:
    """A trainer's wait for its turn, from the control topic (the other trainers' announcements)."""

    def __init__(self, kafka: KafkaConfig, topics: Topics, policy: str, turns: Turns) -> None:
        self.policy, self.turns = policy, turns
        self._control = ControlReader(kafka, topics, from_beginning=True)
        self.waited_s = 0.0

    def wait(self, version: int, should_stop: Callable[[], bool]) -> None:
        """Return once ``policy`` (at ``version``) may take its next step, or when asked to stop."""
        started = time.monotonic()
        while not should_stop():
            versions = {name: record.version for name, record in self._control.latest.items()}
            versions[self.policy] = version  # its own progress, whether or not announced yet
            if self.turns.active(versions, self._control.finished - {self.policy}) == self.policy:
                break
            self._control.poll(0.2)
        waited = time.monotonic() - started
        if waited > 1.0:
            logger.info("%s waited %.1fs for its turn", self.policy, waited)
        self.waited_s += waited

    def close(self) -> None:
        self._control.close()
