"""Topic names of one run namespace.

``<run>.prompts.<workflow>``, ``<run>.trajectories.<policy>``, ``<run>.control``, ``<run>.dlq``.
Run and policy names are restricted to letters, digits, ``_`` and ``-`` so a topic name always
splits back into its parts at the dots.

Where a region runs its own Kafka cluster and MirrorMaker 2 copies its topics to the hub under the
default replication policy, the hub holds a region's trajectories as
``<region>.<run>.trajectories.<policy>`` (``infra/regions/mirrormaker2.properties``); the trainer
reads those beside its own topic, by ``trajectories_pattern``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

MAX_TOPIC_CHARS = 249
"""Kafka's limit on the length of a topic name."""

_PART = re.compile(r"[A-Za-z0-9_-]+")
_LONGEST_KIND = ".trajectories."


def check_name_part(value: str, what: str) -> str:
    """Return ``value`` if it can be a dot-separated part of a topic name, else raise ValueError."""
    if not isinstance(value, str) or not _PART.fullmatch(value):
        raise ValueError(
            f"invalid {what} name {value!r}: use only letters, digits, '_' and '-' "
            "(it becomes part of a Kafka topic name; dots separate the parts)"
        )
    return value


class Topics:
    """Names of every topic of the run ``run``."""

    def __init__(self, run: str) -> None:
        self.run = check_name_part(run, "run")
        # Leave room for the kind and at least a one-character policy name.
        if len(run) + len(_LONGEST_KIND) + 1 > MAX_TOPIC_CHARS:
            raise ValueError(
                f"run name is {len(run)} characters; topic names are limited to {MAX_TOPIC_CHARS}, "
                f"so use a run name of at most {MAX_TOPIC_CHARS - len(_LONGEST_KIND) - 1} characters"
            )

    def prompts(self, workflow: str) -> str:
        """Prompt topic of a workflow (a single-policy run's one workflow is named after its policy)."""
        return self._name("prompts", check_name_part(workflow, "workflow"))

    def trajectories(self, policy: str) -> str:
        """Trajectory topic of a policy: one record per group of G samples."""
        return self._name("trajectories", check_name_part(policy, "policy"))

    def trajectories_pattern(self, policy: str) -> str:
        """Regular expression of the policy's mirrored trajectory topics, ``<region>.<run>.trajectories.<policy>``
        with one dot-free region label in front, anchored at both ends. It starts with ``^``, so a
        librdkafka subscription takes it as a pattern (and picks up a region's topic that appears
        later); it means the same to Python's ``re`` and to librdkafka's regex engine."""
        return f"^{self._mirror_body(policy)}$"

    def mirror_region(self, topic: str, policy: str) -> str | None:
        """The region a mirrored trajectory topic of ``policy`` comes from (``us-east`` for
        ``us-east.<run>.trajectories.<policy>``); None for any other topic, the policy's own included."""
        match = re.fullmatch(self._mirror_body(policy), topic)
        return None if match is None else topic.split(".", 1)[0]

    def _mirror_body(self, policy: str) -> str:
        return rf"[^.]+\.{re.escape(self.trajectories(policy))}"

    def trainer_group(self, policy: str) -> str:
        """Consumer group of a policy's trainer on its trajectory topic."""
        return f"{self.run}.train.{check_name_part(policy, 'policy')}"

    @property
    def rollout_group(self) -> str:
        """Consumer group of the rollout workers on the prompt topics."""
        return f"{self.run}.rollout"

    @property
    def control(self) -> str:
        """Version announcements and stop signals."""
        return f"{self.run}.control"

    @property
    def dlq(self) -> str:
        """Dead-letter queue: records that failed validation, with the reason in headers."""
        return f"{self.run}.dlq"

    def plan(
        self,
        workflows: Iterable[str],
        policies: Iterable[str],
        *,
        prompt_partitions: int,
        trajectory_partitions: int,
    ) -> dict[str, int]:
        """Every topic of the run with its partition count, ready for ``admin.ensure_topics``."""
        plan = {self.control: 1, self.dlq: 1}
        plan |= {self.prompts(s): prompt_partitions for s in workflows}
        plan |= {self.trajectories(p): trajectory_partitions for p in policies}
        return plan

    def _name(self, kind: str, part: str) -> str:
        name = f"{self.run}.{kind}.{part}"
        if len(name) > MAX_TOPIC_CHARS:
            raise ValueError(
                f"topic name {name[:40]}... is {len(name)} characters, over Kafka's limit of "
                f"{MAX_TOPIC_CHARS}; shorten the run or policy name"
            )
        return name

    def __repr__(self) -> str:
        return f"Topics(run={self.run!r})"
