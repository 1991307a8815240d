"""The sorting example: its dataset, its task by short name, and the example choosing it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlbus.config import RunConfig
from rlbus.examples import addition
from rlbus.examples.sorting import SortTask, write_dataset
from rlbus.roles import task_of


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_dataset_holds_distinct_strings_split_without_overlap(tmp_path: Path) -> None:
    train, heldout = write_dataset(tmp_path, seed=3, length=3, n_prompts=50, n_heldout=10)
    rows, held = _rows(train), _rows(heldout)
    assert (len(rows), len(held)) == (40, 10)
    prompts = [r["prompt"] for r in rows + held]
    assert len(set(prompts)) == 50 and not {r["prompt"] for r in rows} & {r["prompt"] for r in held}
    for r in rows + held:
        digits = r["prompt"].removesuffix("=")
        assert len(digits) == 3 and digits.isdigit() and r["answer"] == "".join(sorted(digits))
    again, _ = write_dataset(tmp_path / "again", seed=3, length=3, n_prompts=50, n_heldout=10)
    assert again.read_text() == train.read_text()  # the seed fixes the data
    # Fewer strings exist than asked for: all of them.
    small, _ = write_dataset(tmp_path / "small", seed=0, length=2, n_prompts=1000, n_heldout=5)
    assert len(_rows(small)) == 95
    with pytest.raises(ValueError, match="at least 2 digits"):
        write_dataset(tmp_path, seed=0, length=1, n_prompts=5, n_heldout=1)
    with pytest.raises(ValueError, match="n_heldout=100"):
        write_dataset(tmp_path, seed=0, length=2, n_prompts=1000, n_heldout=100)


def test_run_task_sort_scores_exact_sorts_and_brings_its_own_data(tmp_path: Path) -> None:
    cfg = RunConfig.model_validate({"run": {"task": "sort"}, "example": {"sort_length": 5, "sort_prompts": 30,
                                                                        "n_heldout": 6}})
    task = task_of(cfg)
    assert isinstance(task, SortTask) and task.name == "sort"
    assert task.score("3142=", " 1234", "1234") == 1.0 and task.score("3142=", "1243", "1234") == 0.0
    result = addition.prepare(tmp_path, cfg.example, task=task, seed=0, model_path="given")
    rows = _rows(Path(result["train_path"]))
    assert len(rows) == 24 and all(len(r["prompt"]) == 6 and r["prompt"][-1] == "=" for r in rows)
    # A task without data of its own (math, without data.path) gets the addition example's.
    math = task_of(RunConfig.model_validate({"run": {"task": "math"}}))
    plus = addition.prepare(tmp_path / "plus", addition.AdditionConfig(max_operand=4, n_heldout=3), task=math,
                            seed=0, model_path="given")
    assert {r["prompt"] for r in _rows(Path(plus["train_path"]))} <= {f"{a}+{b}=" for a in range(4) for b in range(4)}
