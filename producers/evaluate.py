"""Greedy score of an engine's current weights on a dataset."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

from broker.schema import SamplingParams
from producers.engines import Engine
from producers.episodes import is_multi_turn, run_episodes
from producers.prompts import prompt_token_ids
from producers.tasks import Task

logger = logging.getLogger(__name__)


class Prompted(Protocol):
    """A dataset row: its prompt, chat turns and reference answer (``consumers.dataset.Row``)."""

    prompt: str
    answer: str
    messages: Sequence[Mapping[str, str]] | None


async def greedy_accuracy(
    engine: Engine,
    task: Task,
    rows: Sequence[Prompted],
    max_new_tokens: int,
    batch_size: int = 256,
) -> float:
    """Mean score of one greedy completion (a whole episode, for a multi-turn task) per row."""
    if not rows:
        raise ValueError("greedy_accuracy needs at least one dataset row")
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=max_new_tokens)
    total = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [prompt_token_ids(engine.tokenizer, r.prompt, r.messages) for r in chunk]
        if is_multi_turn(task):  # whole episodes: each turn greedy, the environment answering in between
            results = await run_episodes(engine, task, [(r.prompt, r.answer, t) for r, t in zip(chunk, prompts)], 1,
                                         greedy, max_context_tokens=engine.max_context_tokens)
        else:
            results = await engine.generate_batch(prompts, 1, greedy)
        total += sum(task.score(r.prompt, res[0].text, r.answer) for r, res in zip(chunk, results))
    accuracy = total / len(rows)
    logger.debug("greedy accuracy %.4f on %d rows at version %d", accuracy, len(rows), engine.version)
    return accuracy
