"""The one reader of prompt datasets: JSONL files of ``{"prompt", "answer"[, "prompt_id"]}`` rows.

Every role that reads a dataset (the curator, the warm-up, held-out evaluation) reads it here, with
the same rules: ``prompt`` is a string, ``answer`` a string or a number, ``prompt_id`` (optional)
names the row across epochs (``line<N>`` when absent). A bad line is reported with its number.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and line."""

    retriable = False


@dataclass(frozen=True)
class Row:
    """One prompt of a dataset."""

    key: str
    """Stable identity of the prompt: its ``prompt_id``, or ``line<N>``."""
    prompt: str
    answer: str


def read_rows(path: str | Path) -> list[Row]:
    """Every row of a JSONL dataset; raises ``DatasetError`` at the first bad line."""
    path = Path(path)
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DatasetError(f"dataset {path} does not exist") from None
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            rows.append(_row(path, lineno, line))
    if not rows:
        raise DatasetError(f"{path} holds no prompts")
    return rows


def _row(path: Path, lineno: int, line: str) -> Row:
    where = f"{path}:{lineno}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{where}: not valid JSON ({exc.msg}); one object per line") from None
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    prompt, answer, key = obj.get("prompt"), obj.get("answer"), obj.get("prompt_id")
    if not isinstance(prompt, str):
        raise DatasetError(f"{where}: 'prompt' missing or not a string")
    if isinstance(answer, bool) or not isinstance(answer, str | int | float):
        raise DatasetError(f"{where}: 'answer' missing or not a string or number")
    if key is not None and not isinstance(key, str | int):
        raise DatasetError(f"{where}: 'prompt_id' must be a string or an integer")
    return Row(key=str(key) if key is not None else f"line{lineno}", prompt=prompt, answer=str(answer))
