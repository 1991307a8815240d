"""Environments score completions; datasets are JSONL files of prompts with reference answers.

A dataset line is ``{"prompt_id": str, "prompt": str, "answer": str}``.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Protocol, runtime_checkable

logger = logging.getLogger(__name__)

DATASET_KEYS = ("prompt_id", "prompt", "answer")


@runtime_checkable
class Environment(Protocol):
    """Scores one completion of one prompt."""

    name: str

    def score(self, prompt: str, completion: str, answer: str) -> float:
        """1.0 when ``completion`` (decoded text, special tokens removed) is correct, else 0.0."""
        ...


class AdditionEnv:
    """``a+b=`` prompts; the completion must be the decimal sum and nothing else."""

    name = "addition"

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return 1.0 if completion.strip() == answer.strip() else 0.0


def get_environment(name: str) -> Environment:
    """The environment registered under ``name``."""
    registry: dict[str, type] = {AdditionEnv.name: AdditionEnv}
    if name not in registry:
        raise KeyError(f"unknown environment {name!r}; known environments: {sorted(registry)}")
    return registry[name]()


def write_addition_dataset(
    out_dir: Path,
    *,
    seed: int,
    max_operand: int,
    n_heldout: int,
    min_operand: int = 0,
) -> tuple[Path, Path]:
    """Write every ``a+b=`` with ``min_operand <= a, b < max_operand``, split into train/held-out.

    The split is a seeded shuffle of distinct prompts, so no held-out prompt appears in train.
    Returns the paths of ``train.jsonl`` and ``heldout.jsonl``.
    """
    pairs = [(a, b) for a in range(min_operand, max_operand) for b in range(min_operand, max_operand)]
    if not 0 <= n_heldout < len(pairs):
        raise ValueError(f"n_heldout={n_heldout} must be in [0, {len(pairs)}) for {len(pairs)} prompts")
    random.Random(seed).shuffle(pairs)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = out_dir / "train.jsonl", out_dir / "heldout.jsonl"
    splits = pairs[n_heldout:], pairs[:n_heldout]
    for path, split in zip(paths, splits):
        with path.open("w") as f:
            for a, b in split:
                row = {"prompt_id": f"add-{a}-{b}", "prompt": f"{a}+{b}=", "answer": str(a + b)}
                f.write(json.dumps(row) + "\n")
    logger.info("wrote %d train and %d held-out addition prompts to %s", *map(len, splits), out_dir)
    return paths


def read_dataset(path: Path) -> list[dict]:
    """Rows of a JSONL dataset, each with string ``prompt_id``, ``prompt`` and ``answer``."""
    rows = []
    with Path(path).open() as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg}); one object per line") from e
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            bad = [k for k in DATASET_KEYS if not isinstance(row.get(k), str)]
            if bad:
                raise ValueError(f"{path}:{lineno}: keys {bad} missing or not strings; need {DATASET_KEYS}")
            rows.append(row)
    return rows
