"""Greedy accuracy of an engine's current weights on a dataset."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from broker.schema import SamplingParams
from producers.engine import Engine
from producers.envs import Environment

logger = logging.getLogger(__name__)


async def greedy_accuracy(
    engine: Engine,
    env: Environment,
    dataset_rows: Sequence[dict],
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Mean score of one greedy completion per row (rows carry ``prompt`` and ``answer``)."""
    if not dataset_rows:
        raise ValueError("greedy_accuracy needs at least one dataset row")
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)
    total = 0.0
    for start in range(0, len(dataset_rows), batch_size):
        rows = dataset_rows[start : start + batch_size]
        prompts = [engine.tokenizer(r["prompt"])["input_ids"] for r in rows]
        results = await engine.generate_batch(prompts, 1, greedy)
        total += sum(env.score(r["prompt"], res[0].text, r["answer"]) for r, res in zip(rows, results))
    accuracy = total / len(dataset_rows)
    logger.debug("greedy accuracy %.4f on %d rows at version %d", accuracy, len(dataset_rows), engine.version)
    return accuracy
