"""The built-in single-turn tasks: math answers checked by math-verify, reasoning-gym's own verifiers."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from producers.tasks import AnswerError, TaskError, load_task
from producers.tasks.gym import ReasoningGymTask, write_reasoning_gym_dataset
from producers.tasks.math import MathTask, extract_answer


@pytest.mark.parametrize("completion, reference, reward", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{\\sqrt{2}+1}", "1+\\sqrt{2}", 1.0),
    ("Total: 1,234 apples\n#### 1,234", "1234", 1.0),
    ("The answer is -3.5.", "-7/2", 1.0),
    ("it is 0.75", "\\frac{3}{4}", 1.0),
    ("\\boxed{4} but then 5", "4", 1.0),  # the box wins over a later number
    ("x = 4", "5", 0.0),
    ("no number here", "3", 0.0),
])
def test_math_extracts_the_final_answer_and_checks_equivalence(completion: str, reference: str, reward: float) -> None:
    assert MathTask().score("", completion, reference) == reward


def test_math_extraction_and_hostile_input() -> None:
    assert extract_answer("\\fbox{a{b}c} and \\boxed{x^{2}}") == "x^{2}"
    assert extract_answer("#### 42\nmore") == "42"
    assert extract_answer("3/4 of 12") == "12" and extract_answer("half is 3/4") == "3/4"
    assert MathTask().score("", "9" * 1_000_000, "5") == 0.0  # a megabyte of digits ends, and scores 0
    with pytest.raises(ValueError, match="format_reward"):
        MathTask(format_reward=1.5)


def test_math_scores_the_same_from_several_threads() -> None:
    task = MathTask()
    cases = [("\\boxed{\\frac{1}{2}}", "0.5"), ("#### 7", "8"), ("it is -3", "-3"), ("\\boxed{2\\pi}", "2\\pi")]
    alone = [task.score("", c, r) for c, r in cases]
    results: dict[int, list[float]] = {}

    def worker(i: int) -> None:
        results[i] = [task.score("", c, r) for c, r in cases]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert alone == [1.0, 0.0, 1.0, 1.0] and all(r == alone for r in results.values())


def test_reasoning_gym_datasets_are_split_and_scored_by_their_own_verifier(tmp_path: Path) -> None:
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    train, heldout = write_reasoning_gym_dataset(tmp_path, dataset="basic_arithmetic", size=120, seed=3, n_heldout=10,
                                                 config=config)
    rows = {name: [json.loads(x) for x in path.read_text().splitlines()] for name, path in
            (("train", train), ("heldout", heldout))}
    assert len(rows["heldout"]) == 10 and rows["train"]
    assert not {r["prompt"] for r in rows["train"]} & {r["prompt"] for r in rows["heldout"]}
    task = load_task("producers.tasks.gym:ReasoningGymTask", {"dataset": "basic_arithmetic"})
    assert task.name == "reasoning_gym:basic_arithmetic"
    for row in rows["heldout"]:
        entry = json.loads(row["answer"])
        assert task.score(row["prompt"], f"thinking...\n<answer>{entry['answer']}</answer>", row["answer"]) == 1.0
        assert task.score(row["prompt"], f"{entry['answer']}", row["answer"]) == 1.0  # the last line
        assert task.score(row["prompt"], "<answer>not a number</answer>", row["answer"]) < 1.0
        assert task.demonstration(row["answer"]) == str(entry["answer"])
    with pytest.raises(AnswerError, match="not a reasoning-gym entry"):
        task.score("", "1", "{oops")
    with pytest.raises(AnswerError, match="lacks the entry's 'answer'"):
        task.score("", "1", "42")
    with pytest.raises(ValueError, match="no dataset 'no_such'"):
        ReasoningGymTask("no_such")
    with pytest.raises(TaskError, match="no dataset"):
        load_task("producers.tasks.gym:ReasoningGymTask", {"dataset": "no_such"})
    with pytest.raises(ValueError, match="distinct questions"):
        write_reasoning_gym_dataset(tmp_path / "small", dataset="basic_arithmetic", size=5, seed=0, n_heldout=5)
