"""The dataset reader: JSONL and Parquet, mapped field names, chat prompts, structured answers."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from consumers.dataset import DatasetError, DatasetFields, Row, read_rows

ROWS = [
    {"id": 7, "question": "What is 2+3?", "solution": 5},
    {"id": "b", "question": "Name a prime.", "solution": "2"},
]
MAPPED = DatasetFields(prompt="question", answer="solution", id="id")


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_jsonl_and_parquet_give_the_same_rows_through_a_field_mapping(tmp_path: Path) -> None:
    parquet = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([{**r, "id": str(r["id"]), "solution": str(r["solution"])} for r in ROWS]), parquet)
    expected = [Row("7", "What is 2+3?", "5"), Row("b", "Name a prime.", "2")]
    assert read_rows(_jsonl(tmp_path / "d.jsonl", ROWS), MAPPED) == expected
    assert read_rows(parquet, MAPPED) == expected
    with pytest.raises(DatasetError, match=r"d.jsonl:1: field 'prompt' \(data.fields.prompt\) missing .*'question'"):
        read_rows(tmp_path / "d.jsonl")  # the default mapping names the field the data lacks
    (tmp_path / "d.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="cannot tell the format"):
        read_rows(tmp_path / "d.csv")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        read_rows(tmp_path / "bad.parquet")


def test_structured_answers_are_passed_on_as_json(tmp_path: Path) -> None:
    tests = {"asserts": ["assert f(1) == 2"], "setup": ""}
    (row,) = read_rows(_jsonl(tmp_path / "c.jsonl", [{"prompt": "Write f.", "answer": tests}]))
    assert json.loads(row.answer) == tests


def test_chat_prompts_come_from_messages_or_from_text_with_chat_on(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "2+2?"}]
    fields = DatasetFields(system_prompt="Be brief.")
    (row,) = read_rows(_jsonl(tmp_path / "m.jsonl", [{"messages": messages, "answer": "4"}]), fields)
    assert row.prompt == "2+2?"  # what the task sees: the last user turn
    assert row.messages == ({"role": "system", "content": "Be brief."}, *messages)
    (plain,) = read_rows(_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2?", "answer": 4}]), fields)
    assert plain.messages is None  # text is fed as it is unless chat is on
    chat = fields.model_copy(update={"chat": True})
    (wrapped,) = read_rows(tmp_path / "p.jsonl", chat)
    assert wrapped.messages == ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"})
    for bad, message in (([{"role": "robot", "content": "x"}], r"messages\[0\] must be"),
                         ([{"role": "system", "content": "x"}], "no user turn"), ("hi", "non-empty list")):
        _jsonl(tmp_path / "bad.jsonl", [{"messages": bad, "answer": "1"}])
        with pytest.raises(DatasetError, match=message):
            read_rows(tmp_path / "bad.jsonl")
