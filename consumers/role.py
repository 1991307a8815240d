"""The curator role, assembled from its settings."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from broker.retention import LogConfig, LogKeeper, prompt_floors
from broker.settings import KafkaConfig
from broker.topics import Topics
from consumers.curator import Curator, CuratorConfig, CuratorStats
from consumers.dataset import DatasetFields, read_rows
from consumers.stages import StageSpec
from consumers.turns import Turns

logger = logging.getLogger(__name__)


def run_curator(
    *,
    kafka: KafkaConfig,
    topics: Topics,
    workflow: str,
    config: CuratorConfig,
    dataset: Path,
    fields: DatasetFields,
    task: str,
    stages: list[StageSpec],
    seed: int,
    group_size: int,
    windows: dict[str, int],
    turns: Turns | None,
    should_stop: Callable[[], bool],
    metrics_path: Path | None = None,
    log: LogConfig | None = None,
    run_policies: list[str] | None = None,
) -> CuratorStats:
    """Dispatch the prompts of ``dataset`` to the workflow ``workflow``'s prompt topic until the run ends or
    ``should_stop()``; ``windows`` are its policies' admission windows, primary first. ``log``: how the
    prompt topic is trimmed behind the rollout group and the control topic behind the latest
    announcement of each of ``run_policies`` (default: the workflow's) (``broker.retention``); None:
    not trimmed."""
    curator = Curator(
        kafka, topics, workflow, config, rows=read_rows(dataset, fields), task=task, group_size=group_size,
        windows=windows, turns=turns, seed=seed, stages=stages, metrics_path=metrics_path,
    )
    prompts = prompt_floors(kafka, topics.rollout_group, topics.prompts(workflow))
    policies = sorted(run_policies or windows)
    floors = lambda: prompts() | curator.control_floors(policies)  # noqa: E731
    keeper = LogKeeper(log, kafka, floors, name=f"curator {workflow}").start()
    try:
        stats = curator.run(should_stop)
    finally:
        keeper.close()
    logger.info("curator done: %d dispatched, %d consumed", stats.dispatched, stats.consumed)
    return stats
