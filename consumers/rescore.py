"""Re-scoring at the intake: the trainer runs the task's checker again on a group's completions.

A signature proves which fleet made a group, not that its rewards are right: a worker with a
broken checker, an old task version or a will of its own can claim any reward. With
``intake.rescore`` on, the intake takes the group's dataset row (by its ``prompt_key``, from the
trainer's own copy of the train dataset), checks that the group's prompt tokens are that row's,
decodes each completion with the policy's tokenizer (as the worker did) and scores it with the
run's task. Disagreements are counted per worker; ``replace`` trains on the checker's rewards,
``reject`` sends the group to the DLQ, ``count`` only counts.

Only groups whose rewards are the task's score of their completion can be re-scored: the
``single`` workflow and the solver of ``solver_verifier`` on a single-turn task (the trainer
decides by the role's held-out judge being the run's task). A group of such a policy that cannot
be re-scored (another task, subgroups, masked tokens, a prompt key the dataset lacks) is
*unscored*: counted, and under ``replace`` or ``reject`` sent to the DLQ, since nothing an honest
worker of that policy sends looks like it. Scoring runs on the intake's fetch thread, off the
training step; ``rescore_fraction`` checks a share of the groups (the same groups whatever
trainer reads them: the choice is a hash of the group id).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from broker.schema import TrajectoryGroup
from consumers.dataset import Row
from producers.prompts import PromptError, prompt_token_ids
from producers.tasks import AnswerError, Task

logger = logging.getLogger(__name__)


@dataclass
class Rescored:
    """The checker's word on one group."""

    rewards: list[float] | None
    """The checker's rewards, one per sample; None when the group could not be re-scored."""
    reason: str | None = None
    """Why the group is unscored, or how it disagrees; None when it agrees."""

    @property
    def agrees(self) -> bool:
        return self.reason is None

    @property
    def unscored(self) -> bool:
        return self.rewards is None


class Rescorer:
    """Re-scores the groups of one policy with ``task`` against the dataset ``rows``."""

    def __init__(self, task: Task, rows: Sequence[Row], tokenizer: Any, *, fraction: float = 1.0,
                 tolerance: float = 1e-6) -> None:
        self.task, self.tokenizer, self.fraction, self.tolerance = task, tokenizer, fraction, tolerance
        self.rows: dict[str, list[Row]] = {}
        for row in rows:
            same = self.rows.setdefault(row.key, [])
            if row not in same:
                same.append(row)
        self._prompt_tokens: dict[int, list[int] | PromptError] = {}  # by id() of a row kept in self.rows

    def sampled(self, group_id: str) -> bool:
        """Whether this group is among the ``fraction`` checked (the same answer for every copy)."""
        if self.fraction >= 1.0:
            return True
        digest = hashlib.sha256(group_id.encode()).digest()
        return int.from_bytes(digest[:8], "big") < self.fraction * 2**64

    def check(self, group: TrajectoryGroup) -> Rescored:
        header = group.header
        if header.task != self.task.name:
            return Rescored(None, f"group of task {header.task!r}, the run's task is {self.task.name!r}")
        if header.subgroups is not None:
            return Rescored(None, "group with subgroups (a verifier's), not the task's scores")
        if group.loss_mask is not None and not group.loss_mask.all():
            return Rescored(None, "group with masked tokens (a multi-turn episode's), not one completion each")
        if header.prompt_key is None or header.prompt_key not in self.rows:
            return Rescored(None, f"prompt key {header.prompt_key!r} is not a row of the trainer's dataset")
        offsets = group.completion_offsets
        texts = self.tokenizer.batch_decode(
            [group.completion_tokens[offsets[i]:offsets[i + 1]].tolist() for i in range(len(offsets) - 1)],
            skip_special_tokens=True)
        prompt_tokens = group.prompt_tokens.tolist()
        first = None
        for row in self.rows[header.prompt_key]:  # rows sharing a key: the first that agrees, else the first's word
            verdict = self._against(row, prompt_tokens, texts, header.rewards)
            if verdict.agrees:
                return verdict
            first = first or verdict
        return first

    def _against(self, row: Row, prompt_tokens: list[int], texts: list[str], claimed: list[float]) -> Rescored:
        expected = self._tokens_of(row)
        if isinstance(expected, PromptError):
            return Rescored(None, f"dataset row {row.key!r} cannot be tokenized here: {expected}")
        if prompt_tokens != expected:
            return Rescored(None, f"prompt tokens are not those of dataset row {row.key!r}")
        try:
            rewards = [float(self.task.score(row.prompt, text, row.answer)) for text in texts]
        except AnswerError as exc:
            return Rescored(None, f"dataset row {row.key!r} has an answer the task cannot use: {exc}")
        except Exception as exc:  # a completion the checker fails on: the group's fault, never the trainer's
            return Rescored(None, f"the task's checker failed on a completion: {type(exc).__name__}: {exc}")
        if len(rewards) != len(claimed) or any(abs(a - b) > self.tolerance for a, b in zip(rewards, claimed)):
            return Rescored(rewards, f"claimed rewards {_short(claimed)}, the task's checker gives {_short(rewards)}")
        return Rescored(rewards)

    def _tokens_of(self, row: Row) -> list[int] | PromptError:
        if id(row) not in self._prompt_tokens:
            try:
                self._prompt_tokens[id(row)] = prompt_token_ids(self.tokenizer, row.prompt, row.messages)
            except PromptError as exc:
                self._prompt_tokens[id(row)] = exc
        return self._prompt_tokens[id(row)]


def _short(values: Sequence[float]) -> str:
    return "[" + ", ".join(f"{v:.3g}" for v in values) + "]"
