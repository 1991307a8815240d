"""Multi-turn episodes: the model generates, the task's environment answers, the model goes on.

A multi-turn task (``MultiTurnTask``) adds ``observe`` to the single-turn interface: given the
text of one generated turn it returns an ``Observation`` (how much of the turn is kept, and the
environment's answer to append) or None when the episode is over. ``run_episodes`` drives G
episodes per prompt, batched turn by turn over every episode still running:

* a turn is cut where the environment says it ends (e.g. after ``</tool_call>``); tokens generated
  past that point are dropped, so the model is trained only on what the environment saw;
* observation tokens are appended with ``loss_mask`` 0 (never trained on), behaviour log-prob 0,
  and the version of the turn before them (so they never make a sample look staler than it is);
* each turn's tokens carry the weights version that produced them: ``between_turns`` lets the
  worker move to newer weights before a turn, so later turns may come from later versions.

One episode becomes one sample of the TrajectoryGroup: its completion is every turn and
observation end to end, its reward the task's ``score`` of the whole transcript.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from broker.schema import SamplingParams
from producers.engine import Engine, GenerationResult
from producers.tasks import Task


@dataclass(frozen=True)
class Observation:
    """The environment's answer to one turn."""

    consumed: int
    """Characters of the turn's text that belong to it; the rest is dropped (it went past a call)."""
    text: str
    """Appended after the turn as observation tokens (masked out of the loss)."""


@runtime_checkable
class MultiTurnTask(Task, Protocol):
    """A task whose episodes take several turns; ``score`` sees the whole transcript."""

    max_turns: int

    def observe(self, prompt: str, turn: str, answer: str) -> Observation | None:
        """The environment's answer to ``turn`` (the text the model generated this turn), or None
        when the episode ends with it."""
        ...


@dataclass
class _Episode:
    context: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    mask: list[int]
    finish: str = "stop"
    running: bool = True


def _token_prefix(tokenizer, tokens: list[int], chars: int) -> int:
    """The fewest leading tokens whose decoded text covers ``chars`` characters of the turn."""
    for j in range(1, len(tokens) + 1):
        if len(tokenizer.decode(tokens[:j], skip_special_tokens=True)) >= chars:
            return j
    return len(tokens)


async def run_episodes(
    engine: Engine,
    task: MultiTurnTask,
    prompts: Sequence[tuple[str, str, list[int]]],
    n: int,
    sampling: SamplingParams,
    *,
    max_context_tokens: int,
    between_turns: Callable[[int], Awaitable[None]] | None = None,
) -> list[list[GenerationResult]]:
    """``n`` episodes of each (prompt text, answer, prompt tokens); one list of results per prompt,
    each result a whole episode with its ``mask``. An episode ends when the task says so, after
    ``task.max_turns`` turns, or when its context would pass ``max_context_tokens``."""
    tokenizer = engine.tokenizer
    episodes = [[_Episode(list(p[2]), [], [], [], []) for _ in range(n)] for p in prompts]
    for turn in range(task.max_turns):
        live = [(i, e) for i, group in enumerate(episodes) for e in group if e.running]
        if not live:
            break
        if turn and between_turns is not None:
            await between_turns(turn)
        results = await engine.generate_batch([e.context for _, e in live], 1, sampling)
        for (i, episode), (result,) in zip(live, results):
            text, answer = prompts[i][0], prompts[i][1]
            observation = task.observe(text, result.text, answer) if turn + 1 < task.max_turns else None
            keep = len(result.tokens) if observation is None else _token_prefix(tokenizer, result.tokens,
                                                                                 observation.consumed)
            generated = result.tokens[:keep]
            episode.tokens += generated
            episode.logprobs += result.logprobs[:keep]
            episode.versions += result.versions[:keep]
            episode.mask += [1] * keep
            episode.context += generated
            episode.finish = result.finish_reason
            if observation is None or result.finish_reason == "abort":
                episode.running = False
                continue
            seen = tokenizer(observation.text, add_special_tokens=False)["input_ids"]
            if len(episode.context) + len(seen) + sampling.max_new_tokens > max_context_tokens:
                episode.running, episode.finish = False, "length"
                continue
            version = episode.versions[-1] if episode.versions else engine.version
            episode.tokens += seen
            episode.logprobs += [0.0] * len(seen)
            episode.versions += [version] * len(seen)
            episode.mask += [0] * len(seen)
            episode.context += seen
    return [[_result(tokenizer, e) for e in group] for group in episodes]


def _result(tokenizer, episode: _Episode) -> GenerationResult:
    text = tokenizer.decode(episode.tokens, skip_special_tokens=True)
    return GenerationResult(tokens=episode.tokens, logprobs=episode.logprobs, versions=episode.versions,
                            finish_reason=episode.finish, text=text, mask=episode.mask)
