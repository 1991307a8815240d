"""``solver_verifier``: the solver samples G answers, the verifier judges each; both policies learn.

The solver is rewarded by the task's checker, as in ``single``. The verifier reads each answer
(the ``template`` filled with the prompt and the answer) and generates a verdict: its last
``accept`` or ``reject`` word counts, so it may reason first (``solve_first``: it is shown solving
the problem itself, then judging). Its reward is 1 when the verdict agrees with the checker (an
answer is correct when the checker gives it at least ``correct_at``), 0 otherwise (no verdict
counts as wrong). With ``balanced`` (the default), a right verdict on an answer of the majority
class among the answers judged together (a worker's batch of prompts) earns minority/majority
instead of 1, so that a constant verdict earns the same whichever class dominates: while the
solver is weak most answers are wrong, and a verifier rewarded plainly learns to reject
everything (it did, in 400 steps, from a warm-up that judged 58% of a balanced set right) instead
of learning to judge. The weights carry through to the update only when the verifier's trainer
does not rescale advantages per group (``advantage_scale = "none"``): a group whose answers are all
of one class would otherwise get its scale back.

The verifier's group for one prompt holds its verdicts on the G solver answers, ``verdicts``
per answer. Their prompts differ after the question, so the group's prompt is the tokens all of
them share, and each sample's completion is the rest of its own prompt (masked out of the loss,
stamped with the verifier's version) followed by the verdict. With several verdicts per answer,
the verdicts on one answer form a subgroup: a verdict's advantage compares it with the other
verdicts on the same answer only (GRPO per judged answer), so that how hard an answer is to
judge, and which class it is of, does not leak into the baseline; with one verdict per answer
the G verdicts are compared with each other. The solver's versions that produced the answers
travel in the group's provenance.

Held out, the verifier is judged on a fixed, balanced set built once from the base models: for
each held-out prompt, the reference answer and ``heldout_answers`` base-solver samples, labelled by
the checker, as many correct as wrong ones; a constant verdict scores 0.5 on it. The same builder
over train prompts gives the verifier's warm-up demonstrations (the policy's ``warmup``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from broker.schema import PromptRecord
from producers.engines import GenerationResult
from producers.prompts import PromptError, prompt_token_ids
from producers.tasks import AnswerError, Task
from producers.workflows import PolicyRuntime, Produced, single_row
from producers.workflows.single import sample_and_score

logger = logging.getLogger(__name__)

DEFAULT_TEMPLATE = (
    "{prompt}\n\nProposed answer: {completion}\n\nIs the proposed answer correct? Reply yes or no.\n"
)


class VerdictTask:
    """Scores a verdict against the expected one (``answer`` is a demonstration ending in the accept
    or the reject word)."""

    name = "verdict"

    def __init__(self, accept: str, reject: str) -> None:
        self.accept, self.reject = accept, reject
        self._words = re.compile("|".join(f"({_word(w)})" for w in (accept, reject)), re.IGNORECASE)

    def verdict(self, completion: str) -> bool | None:
        """The last verdict word of ``completion`` (whole words: 'no' is not in 'not'): True for
        accept, False for reject, None for none."""
        last = None
        for last in self._words.finditer(completion):
            pass
        return None if last is None else last.group(1) is not None

    def score(self, prompt: str, completion: str, answer: str) -> float:
        expected = self.verdict(answer)
        return 1.0 if expected is not None and self.verdict(completion) == expected else 0.0


def _word(word: str) -> str:
    """A pattern for ``word`` that does not match inside a longer word."""
    before = r"(?<![A-Za-z0-9])" if word[:1].isalnum() else ""
    after = r"(?![A-Za-z0-9])" if word[-1:].isalnum() else ""
    return before + re.escape(word) + after


def _common_prefix(sequences: Sequence[Sequence[int]]) -> int:
    first = sequences[0]
    n = min(len(s) for s in sequences)
    for i in range(n):
        if any(s[i] != first[i] for s in sequences):
            return i
    return n


class SolverVerifierWorkflow:
    roles = ("solver", "verifier")

    def __init__(self, template: str = DEFAULT_TEMPLATE, accept: str = "yes", reject: str = "no",
                 correct_at: float = 1.0, heldout_answers: int = 4, solve_first: bool = False,
                 balanced: bool = True, verdicts: int = 1) -> None:
        if "{completion}" not in template:
            raise ValueError("template needs a {completion} field (where the solver's answer goes)")
        try:
            template.format(prompt="", completion="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"template {template!r} takes only {{prompt}} and {{completion}}: {exc}") from None
        a, r = accept.strip().lower(), reject.strip().lower()
        if not a or not r or a in r or r in a:
            raise ValueError(f"accept {accept!r} and reject {reject!r} must be non-empty and neither part of the other")
        if heldout_answers < 1:
            raise ValueError("heldout_answers must be at least 1")
        if verdicts < 1:
            raise ValueError("verdicts (verdicts sampled per answer) must be at least 1")
        self.template, self.correct_at, self.heldout_answers = template, correct_at, heldout_answers
        self.solve_first, self.balanced, self.n_verdicts = solve_first, balanced, verdicts
        self.verdicts = VerdictTask(accept.strip(), reject.strip())

    def verifier_prompt(self, prompt: PromptRecord | Any, completion: str) -> tuple[str, list[dict[str, str]] | None]:
        """The verifier's prompt text, and its chat turns when the question came as chat."""
        text = self.template.format(prompt=prompt.prompt, completion=completion.strip())
        return text, (None if prompt.messages is None else [{"role": "user", "content": text}])

    async def run(
        self, prompts: Sequence[PromptRecord], policies: Mapping[str, PolicyRuntime], task: Task
    ) -> list[list[Produced] | Exception]:
        solver, verifier = policies["solver"], policies["verifier"]
        solved = await sample_and_score(solver, task, prompts)
        out: list[Any] = list(solved)
        candidates: list[tuple[int, list[list[int]]]] = []
        for i, item in enumerate(solved):
            if isinstance(item, Exception):
                continue
            try:
                tokens = [prompt_token_ids(verifier.engine.tokenizer, *self.verifier_prompt(prompts[i], r.text))
                          for r in item[1]]
            except PromptError as exc:
                out[i] = PromptError(f"verifier: {exc}")
                continue
            candidates.append((i, tokens))
        flat = [t for _, tokens in candidates for t in tokens]
        verdicts = (await verifier.engine.generate_batch(flat, self.n_verdicts, verifier.sampling)) if flat else []
        correct = [r >= self.correct_at for i, _ in candidates for r in solved[i][2]]
        weights = self._class_weights(correct) if self.balanced else {True: 1.0, False: 1.0}
        at = 0
        for i, tokens in candidates:
            prompt_tokens, answers, rewards = solved[i]
            judged = verdicts[at : at + len(tokens)]
            at += len(tokens)
            out[i] = [Produced(solver.name, prompt_tokens, answers, rewards),
                      self._verifier_group(verifier.name, verifier.engine.version, tokens, judged, answers, rewards,
                                           weights)]
        return out

    def _verifier_group(self, policy: str, version: int, prompts: list[list[int]],
                        verdicts: list[list[GenerationResult]], answers: list[GenerationResult],
                        rewards: list[float], weights: dict[bool, float]) -> Produced:
        shared = _common_prefix(prompts)
        samples, scores, subgroups = [], [], []
        for k, (tokens, judged, reward) in enumerate(zip(prompts, verdicts, rewards)):
            rest = tokens[shared:]
            ok = reward >= self.correct_at
            for verdict in judged:
                stamp = verdict.versions[0] if verdict.versions else version
                samples.append(GenerationResult(
                    tokens=rest + verdict.tokens, logprobs=[0.0] * len(rest) + verdict.logprobs,
                    versions=[stamp] * len(rest) + verdict.versions, finish_reason=verdict.finish_reason,
                    text=verdict.text, mask=[0] * len(rest) + [1] * len(verdict.tokens)))
                scores.append(weights[ok] if self.verdicts.verdict(verdict.text) == ok else 0.0)
                subgroups.append(k)
        solver_versions = [v for a in answers for v in a.versions]
        provenance = {"solver": [min(solver_versions), max(solver_versions)]} if solver_versions else {}
        return Produced(policy, prompts[0][:shared], samples, scores, provenance,
                        subgroups if self.n_verdicts > 1 else None)

    @staticmethod
    def _class_weights(correct: list[bool]) -> dict[bool, float]:
        """The reward of a right verdict per class: 1 for the minority, minority/majority for the majority."""
        n_correct = sum(correct)
        n_wrong = len(correct) - n_correct
        if not n_correct or not n_wrong:
            return {True: 1.0, False: 1.0}
        return {True: min(n_correct, n_wrong) / n_correct, False: min(n_correct, n_wrong) / n_wrong}

    async def role_rows(self, role: str, rows: Sequence[Any], policies: Mapping[str, PolicyRuntime], task: Task,
                           *, seed: int) -> list[dict[str, Any]]:
        if role == "solver":
            return [single_row(r) for r in rows]
        solver = policies["solver"].engine
        sampling = policies["solver"].sampling
        show = getattr(task, "demonstration", None) or (lambda answer: answer)
        prompts = [prompt_token_ids(solver.tokenizer, r.prompt, r.messages) for r in rows]
        samples = await solver.generate_batch(prompts, self.heldout_answers, sampling)
        labelled: dict[bool, list[tuple[Any, str]]] = {True: [], False: []}
        for row, answers in zip(rows, samples):
            texts = [show(row.answer), *(a.text for a in answers)]
            scores = await asyncio.gather(*(asyncio.to_thread(_safe_score, task, row, t) for t in texts))
            for text, score in zip(texts, scores):
                if score is not None:
                    labelled[score >= self.correct_at].append((row, text))
        rng = random.Random(seed)
        n = min(len(labelled[True]), len(labelled[False]))
        if n == 0:
            logger.warning("verifier held-out set: %d correct and %d wrong answers; it cannot be balanced, so it "
                           "keeps them all", len(labelled[True]), len(labelled[False]))
        chosen = [(ok, item) for ok, items in labelled.items()
                  for item in (rng.sample(items, n) if n else items)]
        rng.shuffle(chosen)
        out = []
        for k, (ok, (row, text)) in enumerate(chosen):
            prompt, messages = self.verifier_prompt(row, text)
            verdict = self.verdicts.accept if ok else self.verdicts.reject
            item = {"prompt_id": f"{row.key}/judge{k}", "prompt": prompt,
                    "answer": f"{show(row.answer)}{verdict}" if self.solve_first else verdict}
            if messages is not None:
                item["messages"] = messages
            out.append(item)
        return out

    def judge(self, role: str, task: Task) -> Task:
        return task if role == "solver" else self.verdicts


def _safe_score(task: Task, row: Any, text: str) -> float | None:
    try:
        return task.score(row.prompt, text, row.answer)
    except AnswerError:
        return None
