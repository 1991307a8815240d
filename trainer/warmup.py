"""Short supervised warm-up: just enough skill for RL to see non-zero rewards, not a solved task.

A randomly initialised model never emits a correct answer, so every group reward is 0 and GRPO
has no signal. The warm-up trains teacher-forced cross-entropy on ``prompt -> demonstration <eos>``
(the task's ``demonstration(answer)``: what a correct completion looks like; the answer itself when
the task has none; a multi-turn task's gold episode as pieces, ``(text, the model's?)``, trains on
the model's turns only, the environment's answers being context, with no ``<eos>``: the
environment ends an episode) and stops as soon as the mean score of greedy completions on ``eval_rows``
(taken from the *train* prompts), scored by the run's task, reaches ``target_accuracy``; then it
writes the weights back to ``model_dir``. It runs on the trainer's device (bfloat16 autocast on a
GPU that has it).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from consumers.dataset import Row
from trainer.model import load_policy, resolve_device

Score = Callable[[str, str, str], float]
"""A task's ``score(prompt, completion, answer)``."""

logger = logging.getLogger(__name__)


@dataclass
class WarmupReport:
    steps: int
    seconds: float
    accuracy: float
    """Mean score of greedy completions of the evaluation rows when the warm-up stopped."""
    reached: bool
    """Whether ``target_accuracy`` was reached before ``max_steps``."""


Demonstration = Callable[[str], "str | list[tuple[str, bool]]"]
"""A task's demonstration of an answer: the text, or (for an episode) pieces and whether each is the model's."""


def _answer_batch(
    tokenizer, rows: Sequence[Row], demonstration: Demonstration
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``prompt demonstration <eos>``; labels are -100 except on the demonstration and eos
    (for an episode given in pieces: on the model's pieces only, each tokenized alone as the episode
    is, and no eos)."""
    seqs, trained = [], []
    for row in rows:
        prompt = tokenizer(row.prompt)["input_ids"]
        shown = demonstration(row.answer)
        pieces = [(shown, True)] if isinstance(shown, str) else list(shown)
        seq, learn = list(prompt), [False] * len(prompt)
        for text, mine in pieces:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            seq += ids
            learn += [mine] * len(ids)
        if isinstance(shown, str):
            seq.append(tokenizer.eos_token_id)
            learn.append(True)
        seqs.append(seq)
        trained.append(learn)
    length = max(map(len, seqs))
    ids = torch.full((len(seqs), length), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (seq, learn) in enumerate(zip(seqs, trained)):
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        on = torch.tensor(learn)
        labels[i, : len(seq)][on] = ids[i, : len(seq)][on]
    return ids, mask, labels


def demonstration_text(shown: str | list[tuple[str, bool]]) -> str:
    """A demonstration as one text (an episode's pieces end to end)."""
    return shown if isinstance(shown, str) else "".join(text for text, _ in shown)


@torch.no_grad()
def greedy_score(
    model: torch.nn.Module, tokenizer, rows: Sequence[Row], score: Score, max_new_tokens: int, batch_size: int = 512
) -> float:
    """Mean score of the rows' greedy completions (special tokens removed)."""
    was_training = model.training
    model.eval()
    total = 0.0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        enc = tokenizer([r.prompt for r in chunk], padding=True, padding_side="left",
                        return_tensors="pt").to(model.device)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        total += sum(score(r.prompt, t, r.answer) for t, r in zip(texts, chunk))
    model.train(was_training)
    return total / max(len(rows), 1)


def supervised_warmup(
    model_dir: Path,
    train_rows: Sequence[Row],
    *,
    score: Score,
    target_accuracy: float,
    max_steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    eval_rows: Sequence[Row],
    eval_every_steps: int = 25,
    grad_clip: float = 1.0,
    demonstration: Demonstration | None = None,
    device: str = "auto",
    evaluate: Callable[[torch.nn.Module], float] | None = None,
) -> WarmupReport:
    """Train until the greedy score on ``eval_rows`` >= ``target_accuracy``; save to ``model_dir``.
    ``device``: the trainer's ('auto': cuda when present, else cpu). ``evaluate``: the score of the
    model as it is, instead of its greedy completions' (a multi-turn task's: whole episodes, the
    environment answering each turn)."""
    if not train_rows or not eval_rows:
        raise ValueError("supervised_warmup needs non-empty train_rows and eval_rows")
    started = time.perf_counter()
    where = torch.device(resolve_device(device))
    model, tokenizer = load_policy(model_dir, device=str(where))
    bf16 = where.type == "cuda" and torch.cuda.is_bf16_supported()
    rng = random.Random(seed)  # the only randomness: which train rows form each batch
    pool = list(train_rows)
    show = demonstration or (lambda answer: answer)
    max_new_tokens = max(len(tokenizer(demonstration_text(show(r.answer)), add_special_tokens=False)["input_ids"])
                         for r in eval_rows) + 1
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
    model.train()
    measure = evaluate or (lambda m: greedy_score(m, tokenizer, eval_rows, score, max_new_tokens))
    steps, accuracy = 0, measure(model)
    while accuracy < target_accuracy and steps < max_steps:
        ids, mask, labels = (t.to(where) for t in _answer_batch(tokenizer, rng.sample(pool, min(batch_size, len(pool))), show))
        with torch.autocast(where.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        steps += 1
        if steps % eval_every_steps == 0 or steps == max_steps:
            accuracy = measure(model)
            logger.info("warm-up step %d: loss %.4f, greedy accuracy %.3f", steps, loss.item(), accuracy)
    model.save_pretrained(model_dir)
    report = WarmupReport(steps, time.perf_counter() - started, accuracy, accuracy >= target_accuracy)
    logger.info("warm-up finished: %s", report)
    return report
