"""reasoning-gym tasks: datasets written as disjoint train and held-out JSONL files, each entry
scored by its generator's own verifier on the model's final answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producers.tasks import AnswerError, TaskError, load_task
from producers.tasks.gym import ReasoningGymTask, write_reasoning_gym_dataset

DATASETS = {
    "leg_counting": {"min_animals": 1, "max_animals": 2},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "chain_sum": {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 2},
}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_written_datasets_are_disjoint_and_their_answers_score_one(tmp_path: Path, dataset: str) -> None:
    train, heldout = write_reasoning_gym_dataset(tmp_path, dataset=dataset, size=80, seed=5, n_heldout=8,
                                                 config=DATASETS[dataset])
    train_rows, heldout_rows = _rows(train), _rows(heldout)
    assert len(heldout_rows) == 8 and train_rows
    assert not {r["prompt"] for r in train_rows} & {r["prompt"] for r in heldout_rows}
    ids = [r["prompt_id"] for r in train_rows + heldout_rows]
    assert len(set(ids)) == len(ids) and all(i.startswith(f"{dataset}-") for i in ids)
    task = load_task("producers.tasks.gym:ReasoningGymTask", {"dataset": dataset})
    assert task.name == f"reasoning_gym:{dataset}"
    for row in heldout_rows + train_rows[:4]:
        entry = json.loads(row["answer"])
        assert entry["question"] == row["prompt"] and entry["metadata"]["source_dataset"] == dataset
        assert task.score(row["prompt"], f"thinking...\n<answer>{entry['answer']}</answer>", row["answer"]) == 1.0
        assert task.score(row["prompt"], f"so:\n  {entry['answer']}  \n\n", row["answer"]) == 1.0
        assert task.score(row["prompt"], "<answer>a lot</answer>", row["answer"]) < 1.0
        assert task.score(row["prompt"], "", row["answer"]) == 0.0


def test_the_last_answer_tags_win_over_the_last_line() -> None:
    task = ReasoningGymTask("basic_arithmetic", answer_tag="final")
    assert task.model_answer("<final>1</final> then <final> 2 </final>\nsomething else") == "2"
    assert task.model_answer("<answer>3</answer>\n4\n\n") == "4"  # other tags are text
    assert task.model_answer("  \n") == ""


def test_a_verifier_that_never_ends_scores_zero(tmp_path: Path) -> None:
    _, heldout = write_reasoning_gym_dataset(tmp_path, dataset="countdown", size=4, seed=0, n_heldout=1)
    row = _rows(heldout)[0]
    task = ReasoningGymTask("countdown", timeout_s=2)
    assert task.score(row["prompt"], "<answer>9**9**9</answer>", row["answer"]) == 0.0  # sympy would compute forever
    assert task.score(row["prompt"], f"<answer>{json.loads(row['answer'])['answer']}</answer>", row["answer"]) == 1.0


def test_unusable_answers_datasets_and_params_are_refused(tmp_path: Path) -> None:
    task = ReasoningGymTask("chain_sum")
    with pytest.raises(AnswerError, match="not a reasoning-gym entry"):
        task.score("", "1", "{oops")
    for answer in ("42", '["answer"]', '{"answer": "1"}'):
        with pytest.raises(AnswerError, match="lacks the entry's 'answer' and 'metadata'"):
            task.score("", "1", answer)
    with pytest.raises(ValueError, match=r"no dataset 'leg_count'; e\.g\. .*leg_counting"):
        ReasoningGymTask("leg_count")
    with pytest.raises(TaskError, match="no dataset 'no_such'; e.g. "):
        load_task("producers.tasks.gym:ReasoningGymTask", {"dataset": "no_such"})
    with pytest.raises(ValueError, match="answer_tag"):
        ReasoningGymTask("chain_sum", answer_tag="<b>")
    with pytest.raises(ValueError, match="no dataset 'no_such'"):
        write_reasoning_gym_dataset(tmp_path, dataset="no_such", size=10, seed=0, n_heldout=1)
    with pytest.raises(ValueError, match="distinct questions"):
        write_reasoning_gym_dataset(tmp_path, dataset="chain_sum", size=5, seed=0, n_heldout=5)
