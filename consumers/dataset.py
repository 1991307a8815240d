"""The one reader of prompt datasets: JSONL or Parquet rows, with the field names a config maps.

Every role that reads a dataset (the curator, the warm-up, held-out evaluation) reads it here, with
the same rules. A row has a prompt (text, or chat ``messages`` rendered later with the checkpoint's
chat template), a reference answer (a string or a number; a list or an object, such as a program's
tests or a generator's entry, is passed on as JSON for the task to read) and an optional id that
names the row across epochs (``line<N>`` when absent). A bad row is reported with its file and
line (or row number) and what to change.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file and line."""

    retriable = False


class DatasetFields(BaseModel):
    """How a dataset's rows map to prompts: field names and prompt rendering."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = Field(default="prompt", description="Field holding the prompt text.")
    messages: str = Field(
        default="messages",
        description="Field holding a chat prompt: a list of {role, content}; used when a row has it, "
        "rendered with the checkpoint's chat template.",
    )
    answer: str = Field(
        default="answer",
        description="Field holding the reference answer: a string or number, or a list/object (tests, an "
        "entry) passed to the task as JSON.",
    )
    id: str = Field(default="prompt_id", description="Field naming a row across epochs; optional in the data.")
    chat: bool = Field(
        default=False,
        description="Render plain-text prompts as one user turn with the checkpoint's chat template "
        "(chat-tuned checkpoints); false feeds the text as it is.",
    )
    system_prompt: str | None = Field(
        default=None, description="A system turn put before every chat prompt (with chat or messages)."
    )
    format: Literal["auto", "jsonl", "parquet"] = Field(
        default="auto", description="File format; auto: by suffix (.jsonl/.json → JSONL, .parquet → Parquet)."
    )


@dataclass(frozen=True)
class Row:
    """One prompt of a dataset."""

    key: str
    """Stable identity of the prompt: its id field, or ``line<N>``."""
    prompt: str
    """The prompt text (for a chat prompt: its last user turn), what tasks see."""
    answer: str
    messages: tuple[dict[str, str], ...] | None = None
    """The chat turns to render with the chat template; None: feed ``prompt`` as it is."""


def read_rows(path: str | Path, fields: DatasetFields | None = None) -> list[Row]:
    """Every row of a dataset; raises ``DatasetError`` at the first bad one."""
    fields = fields or DatasetFields()
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset {path} does not exist or is not a file")
    rows = [_row(fields, f"{path}:{n}", n, obj) for n, obj in _records(path, _format(path, fields))]
    if not rows:
        raise DatasetError(f"{path} holds no prompts")
    return rows


def _format(path: Path, fields: DatasetFields) -> str:
    if fields.format != "auto":
        return fields.format
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    if suffix in (".parquet", ".pq"):
        return "parquet"
    raise DatasetError(f"dataset {path}: cannot tell the format from {suffix!r}; name it .jsonl or .parquet, "
                       "or set data.fields.format")


def _records(path: Path, fmt: str) -> Iterator[tuple[int, Any]]:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for a file that is not Parquet
            raise DatasetError(f"dataset {path}: not a readable Parquet file ({exc})") from None
        yield from enumerate(table.to_pylist(), start=1)
        return
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{path}:{lineno}: not valid JSON ({exc.msg}); one object per line") from None


def _row(fields: DatasetFields, where: str, n: int, obj: Any) -> Row:
    if not isinstance(obj, dict):
        raise DatasetError(f"{where}: expected an object, got {type(obj).__name__}")
    messages = _messages(fields, where, obj.get(fields.messages))
    if messages is None:
        prompt = obj.get(fields.prompt)
        if not isinstance(prompt, str):
            raise DatasetError(f"{where}: field {fields.prompt!r} (data.fields.prompt) missing or not a string, and "
                               f"no {fields.messages!r} list; fields present: {sorted(obj)}")
        if fields.chat:
            messages = (*_system(fields), {"role": "user", "content": prompt})
    else:
        users = [m["content"] for m in messages if m["role"] == "user"]
        if not users:
            raise DatasetError(f"{where}: {fields.messages!r} has no user turn")
        prompt = users[-1]
    answer = obj.get(fields.answer)
    if answer is None or isinstance(answer, bool):
        raise DatasetError(f"{where}: field {fields.answer!r} (data.fields.answer) missing; fields present: "
                           f"{sorted(obj)}")
    if not isinstance(answer, str):
        answer = answer if isinstance(answer, int | float) else _json(where, fields.answer, answer)
    key = obj.get(fields.id)
    if key is not None and (isinstance(key, bool) or not isinstance(key, str | int)):
        raise DatasetError(f"{where}: field {fields.id!r} (data.fields.id) must be a string or an integer")
    return Row(key=str(key) if key is not None else f"line{n}", prompt=prompt, answer=str(answer), messages=messages)


def _system(fields: DatasetFields) -> tuple[dict[str, str], ...]:
    return ({"role": "system", "content": fields.system_prompt},) if fields.system_prompt else ()


def _messages(fields: DatasetFields, where: str, value: Any) -> tuple[dict[str, str], ...] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise DatasetError(f"{where}: {fields.messages!r} must be a non-empty list of {{role, content}}")
    turns = []
    for i, turn in enumerate(value):
        if not (isinstance(turn, dict) and turn.get("role") in ROLES and isinstance(turn.get("content"), str)):
            raise DatasetError(f"{where}: {fields.messages}[{i}] must be {{role: one of {list(ROLES)}, content: str}}")
        turns.append({"role": turn["role"], "content": turn["content"]})
    if turns[0]["role"] != "system":
        turns = [*_system(fields), *turns]
    return tuple(turns)


def _json(where: str, name: str, value: Any) -> str:
    try:
        return json.dumps(value, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: field {name!r} cannot be passed on as JSON ({exc})") from None
