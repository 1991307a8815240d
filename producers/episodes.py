"""Multi-turn episodes: the model generates, the task's environment answers, the model goes on.

A multi-turn task adds ``max_turns`` and an environment to the single-turn interface. Either the
environment is stateless (``MultiTurnTask.observe(prompt, turn, answer)``: a tool that answers each
call alone), or each episode gets its own (``EnvironmentTask.episode(prompt, answer)``, an
``Environment`` whose ``observe(turn)`` sees the turns in order: a game, a shell, a database). Given
the text of one generated turn, ``observe`` returns an ``Observation`` (how much of the turn is kept,
and the environment's answer to append, or that the episode ends there) or None when the episode
is over with the whole turn. ``run_episodes`` drives G episodes per prompt, batched turn by turn
over every episode still running:

* a turn is cut where the environment says it ends (e.g. after ``</tool_call>``), the last turn
  too; tokens generated past that point are dropped, so the model is trained only on what the
  environment saw;
* observation tokens are appended with ``loss_mask`` 0 (never trained on), behaviour log-prob 0,
  and the version of the turn before them (so they never make a sample look staler than it is);
* each turn's tokens carry the weights version that produced them: ``between_turns`` lets the
  worker move to newer weights before a turn, so later turns may come from later versions.

One episode becomes one sample of the TrajectoryGroup: its completion is every turn and
observation end to end, its ``turns`` the token spans each turn generated, its reward the task's
``score`` of the whole transcript.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from broker.schema import SamplingParams
from producers.engines import Engine, GenerationResult
from producers.tasks import Task


@dataclass(frozen=True)
class Observation:
    """The environment's answer to one turn."""

    consumed: int
    """Characters of the turn's text that belong to it; the rest is dropped (it went past a call)."""
    text: str
    """Appended after the turn as observation tokens (masked out of the loss)."""
    end: bool = False
    """The episode ends with this turn's first ``consumed`` characters (a game won or lost, an answer
    given); ``text`` is not appended."""


@runtime_checkable
class MultiTurnTask(Task, Protocol):
    """A task whose episodes take several turns; ``score`` sees the whole transcript."""

    max_turns: int

    def observe(self, prompt: str, turn: str, answer: str) -> Observation | None:
        """The environment's answer to ``turn`` (the text the model generated this turn), or None
        when the episode ends with it."""
        ...


@runtime_checkable
class Environment(Protocol):
    """One episode's environment: it sees that episode's turns, in order."""

    def observe(self, turn: str) -> Observation | None:
        """The answer to ``turn`` (the text the model generated this turn), or None when the episode
        ends with it."""
        ...


@runtime_checkable
class EnvironmentTask(Task, Protocol):
    """A task whose every episode runs in an environment of its own; ``score`` sees the whole
    transcript (each turn and each observation, end to end)."""

    max_turns: int

    def episode(self, prompt: str, answer: str) -> Environment:
        """A fresh environment for one episode of ``prompt``; the task closes it (``close``, when it
        has one) once the episode is over."""
        ...


def is_multi_turn(task: Task) -> bool:
    """Whether ``task``'s samples are episodes of several turns."""
    return isinstance(task, MultiTurnTask | EnvironmentTask)


class _Stateless:
    """A ``MultiTurnTask``'s environment for one episode: each turn answered on its own."""

    def __init__(self, task: MultiTurnTask, prompt: str, answer: str) -> None:
        self.task, self.prompt, self.answer = task, prompt, answer

    def observe(self, turn: str) -> Observation | None:
        return self.task.observe(self.prompt, turn, self.answer)


def _environment(task: Task, prompt: str, answer: str) -> Environment:
    if isinstance(task, EnvironmentTask):
        return task.episode(prompt, answer)
    return _Stateless(task, prompt, answer)


@dataclass
class _Episode:
    context: list[int]
    env: Environment
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[tuple[int, int]] = field(default_factory=list)
    finish: str = "stop"
    running: bool = True

    def end(self, finish: str | None = None) -> None:
        self.running = False
        if finish is not None:
            self.finish = finish
        close = getattr(self.env, "close", None)
        if close is not None:
            close()


def _token_prefix(tokenizer, tokens: list[int], chars: int) -> int:
    """The fewest leading tokens whose decoded text covers ``chars`` characters of the turn."""
    for j in range(1, len(tokens) + 1):
        if len(tokenizer.decode(tokens[:j], skip_special_tokens=True)) >= chars:
            return j
    return len(tokens)


async def run_episodes(
    engine: Engine,
    task: MultiTurnTask | EnvironmentTask,
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
    episodes = [[_Episode(list(p[2]), _environment(task, p[0], p[1])) for _ in range(n)] for p in prompts]
    try:
        for turn in range(task.max_turns):
            live = [e for group in episodes for e in group if e.running]
            if not live:
                break
            if turn and between_turns is not None:
                await between_turns(turn)
            results = await engine.generate_batch([e.context for e in live], 1, sampling)
            # The environments answer side by side, off the event loop (a shell command, a query, a game step).
            seen = await asyncio.gather(*(asyncio.to_thread(e.env.observe, r.text) for e, (r,) in zip(live, results)))
            for episode, (result,), observation in zip(live, results, seen):
                _take_turn(tokenizer, episode, result, observation, last=turn + 1 == task.max_turns,
                           sampling=sampling, max_context_tokens=max_context_tokens, engine_version=engine.version)
    finally:
        for episode in (e for group in episodes for e in group if e.running):
            episode.end()
    return [[_result(tokenizer, e) for e in group] for group in episodes]


def _take_turn(tokenizer, episode: _Episode, result: GenerationResult, observation: Observation | None, *,
               last: bool, sampling: SamplingParams, max_context_tokens: int, engine_version: int) -> None:
    """Append one generated turn (cut where the environment's ``observation`` says it ends) and the
    environment's answer."""
    if observation is None or observation.consumed >= len(result.text):
        keep = len(result.tokens)  # the whole turn, with the stop token that ended it (trained like the rest)
    else:
        keep = _token_prefix(tokenizer, result.tokens, observation.consumed)
    generated = result.tokens[:keep]
    if keep:
        episode.turns.append((len(episode.tokens), len(episode.tokens) + keep))
    episode.tokens += generated
    episode.logprobs += result.logprobs[:keep]
    episode.versions += result.versions[:keep]
    episode.mask += [1] * keep
    episode.context += generated
    # A turn cut where the environment said it ends ended there, whatever stopped its generation after.
    episode.finish = "stop" if keep < len(result.tokens) and result.finish_reason != "abort" else result.finish_reason
    if observation is None or observation.end or last or result.finish_reason == "abort":
        episode.end()
        return
    seen = tokenizer(observation.text, add_special_tokens=False)["input_ids"]
    if len(episode.context) + len(seen) + sampling.max_new_tokens > max_context_tokens:
        episode.end("length")
        return
    version = episode.versions[-1] if episode.versions else engine_version
    episode.tokens += seen
    episode.logprobs += [0.0] * len(seen)
    episode.versions += [version] * len(seen)
    episode.mask += [0] * len(seen)
    episode.context += seen


def _result(tokenizer, episode: _Episode) -> GenerationResult:
    text = tokenizer.decode(episode.tokens, skip_special_tokens=True)
    return GenerationResult(tokens=episode.tokens, logprobs=episode.logprobs, versions=episode.versions,
                            finish_reason=episode.finish, text=text, mask=episode.mask, turns=episode.turns)
