"""``single``: one policy samples G completions (or multi-turn episodes) per prompt; the task scores them."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from broker.schema import PromptRecord
from producers.engines import GenerationResult
from producers.episodes import is_multi_turn, run_episodes
from producers.prompts import PromptError, prompt_token_ids
from producers.tasks import AnswerError, Task
from producers.workflows import PolicyRuntime, Produced, single_row


def score_all(task: Task, prompt: PromptRecord, results: Sequence[GenerationResult]) -> list[float] | AnswerError:
    """The task's reward of each sample; the ``AnswerError`` when the prompt's answer is unusable."""
    try:
        return [task.score(prompt.prompt, r.text, prompt.answer) for r in results]
    except AnswerError as exc:
        return exc


async def sample(
    policy: PolicyRuntime, task: Task, prompts: Sequence[tuple[PromptRecord, list[int]]], n: int
) -> list[list[GenerationResult]]:
    """``n`` completions (episodes, for a multi-turn task) of each (prompt, its tokens), batched."""
    engine = policy.engine
    if is_multi_turn(task):
        return await run_episodes(engine, task, [(p.prompt, p.answer, t) for p, t in prompts], n, policy.sampling,
                                  max_context_tokens=engine.max_context_tokens, between_turns=policy.between_turns)
    return await engine.generate_batch([t for _, t in prompts], n, policy.sampling)


async def sample_and_score(
    policy: PolicyRuntime, task: Task, prompts: Sequence[PromptRecord]
) -> list[tuple[list[int], list[GenerationResult], list[float]] | Exception]:
    """Tokenize, generate G samples per prompt (G from each record) and score them off the event loop
    (a code task runs programs). Per prompt: (prompt tokens, samples, rewards), or the error that
    makes it unusable."""
    out: list[Any] = [None] * len(prompts)
    by_size: dict[int, list[tuple[int, PromptRecord, list[int]]]] = {}
    for i, prompt in enumerate(prompts):
        try:
            tokens = prompt_token_ids(policy.engine.tokenizer, prompt.prompt, prompt.messages)
        except PromptError as exc:
            out[i] = exc
            continue
        by_size.setdefault(prompt.group_size, []).append((i, prompt, tokens))
    done = []
    for size, same in by_size.items():
        results = await sample(policy, task, [(p, t) for _, p, t in same], size)
        done.extend((i, p, t, r) for (i, p, t), r in zip(same, results))
    scored = await asyncio.gather(*(asyncio.to_thread(score_all, task, p, r) for _, p, _, r in done))
    for (i, _, tokens, results), rewards in zip(done, scored):
        out[i] = rewards if isinstance(rewards, AnswerError) else (tokens, results, rewards)
    return out


class SingleWorkflow:
    """Today's rollout: one policy, its G samples, the task's rewards."""

    roles = ("policy",)

    async def run(
        self, prompts: Sequence[PromptRecord], policies: Mapping[str, PolicyRuntime], task: Task
    ) -> list[list[Produced] | Exception]:
        policy = policies["policy"]
        out: list[list[Produced] | Exception] = []
        for item in await sample_and_score(policy, task, prompts):
            if isinstance(item, Exception):
                out.append(item)
            else:
                tokens, results, rewards = item
                out.append([Produced(policy.name, tokens, results, rewards)])
        return out

    async def role_rows(self, role: str, rows: Sequence[Any], policies: Mapping[str, PolicyRuntime], task: Task,
                           *, seed: int) -> list[dict[str, Any]]:
        return [single_row(r) for r in rows]

    def judge(self, role: str, task: Task) -> Task:
        return task
