"""The curator role, assembled from its settings."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

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
    stream: str,
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
) -> CuratorStats:
    """Dispatch the prompts of ``dataset`` to the workflow stream ``stream`` until the run ends or
    ``should_stop()``; ``windows`` are its policies' admission windows, primary first."""
    curator = Curator(
        kafka, topics, stream, config, rows=read_rows(dataset, fields), task=task, group_size=group_size,
        windows=windows, turns=turns, seed=seed, stages=stages, metrics_path=metrics_path,
    )
    stats = curator.run(should_stop)
    logger.info("curator done: %d dispatched, %d consumed", stats.dispatched, stats.consumed)
    return stats
