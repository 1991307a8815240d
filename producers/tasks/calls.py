"""What the environments that take tagged calls share (``sql``, ``shell``, ``multihop``; ``tool``'s
answers): a turn holds one call, ``<tag>...</tag>``, which the environment answers, or
``<answer>...</answer>``, which ends the episode; the reward is whether the last answer is the
reference (numbers compared as numbers, text case- and space-insensitively). Their data are one
generated item per row, held-out items from seeds no train row uses.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from producers.episodes import Observation

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
HELDOUT_SEEDS = 10_000_000
"""Train items come from seeds below this, held-out ones from seeds at or above it."""


def _as_number(text: str) -> float | None:
    try:
        value = float(text.replace(",", "").strip())
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def same_answer(given: str, reference: Any) -> bool:
    """Whether ``given`` is ``reference``: as numbers when both are, else as text up to case and spaces."""
    a, b = _as_number(given), _as_number(str(reference))
    if a is not None and b is not None:
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    return " ".join(given.lower().split()) == " ".join(str(reference).lower().split())


def answer_score(completion: str, reference: Any) -> float:
    """1 when the completion's last ``<answer>`` is the reference, else 0."""
    found = ANSWER.findall(completion)
    return 1.0 if found and same_answer(found[-1].strip(), reference) else 0.0


def tagged_call(turn: str, tag: str, respond: Callable[[str], str]) -> Observation | None:
    """The environment's answer to a turn: an ``<answer>`` (before any call) ends the episode there; a
    turn without ``</tag>`` ends it whole; else the call's content (after the last ``<tag>`` before
    ``</tag>``, or the turn's start) goes to ``respond``, whose text is appended."""
    close = f"</{tag}>"
    end, answered = turn.find(close), ANSWER.search(turn)
    if answered and (end < 0 or answered.start() < end):  # the answer ends the episode, and the turn there
        return Observation(consumed=answered.end(), text="", end=True)
    if end < 0:
        return None  # no call: the episode ends
    start = turn.rfind(f"<{tag}>", 0, end)
    content = turn[start + len(tag) + 2:end] if start >= 0 else turn[:end]
    return Observation(consumed=end + len(close), text=respond(content))


def write_seeded_splits(out_dir: Path, *, name: str, n_train: int, n_heldout: int, seed: int,
                        row: Callable[[int, random.Random], tuple[str, dict]]) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``heldout.jsonl``, one generated item per row: ``row(item_seed, rng)``
    gives its prompt and answer (JSON), ``rng`` drawn from ``seed``; held-out items come from seeds no
    train row uses. Returns both paths."""
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, count, base in (("train", n_train, 0), ("heldout", n_heldout, HELDOUT_SEEDS)):
        path = out_dir / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as fh:
            for k in range(count):
                item_seed = base + rng.randrange(HELDOUT_SEEDS)
                prompt, answer = row(item_seed, rng)
                fh.write(json.dumps({"prompt_id": f"{name}-{split}-{k}-{item_seed}", "prompt": prompt,
                                     "answer": json.dumps(answer)}) + "\n")
        paths.append(path)
    return paths[0], paths[1]
