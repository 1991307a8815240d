"""The ``math`` task: the final answer a completion gives, equal to the reference for math-verify;
answers that make sympy compute forever score 0 instead of stalling the caller."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from producers.tasks import AnswerError, load_task
from producers.tasks.math import MathTask, extract_answer


@pytest.fixture(scope="module")
def task() -> MathTask:
    return MathTask()


@pytest.mark.parametrize("text, extracted", [
    ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
    ("\\boxed{\\sqrt{2}+1}", "\\sqrt{2}+1"),
    ("\\fbox{a{b}c} and then \\boxed{x^{2}}", "x^{2}"),
    ("\\boxed{3} then \\boxed{unclosed", "3"),
    ("work\n#### 1,234\nbye", "1,234"),
    ("The answer is -3.5.", "-3.5"),
    ("half is 3/4", "3/4"),
    ("we owe 1,234,567 dollars", "1,234,567"),
    ("no digits at all", None),
])
def test_extract_answer_takes_the_box_then_hashes_then_the_last_number(text: str, extracted: str | None) -> None:
    assert extract_answer(text) == extracted


@pytest.mark.parametrize("completion, reference, reward", [
    ("so the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{\\sqrt{2}+1}", "1+\\sqrt{2}", 1.0),
    ("Total: 1,234 apples\n#### 1,234", "1234", 1.0),
    ("The answer is -3.5.", "-7/2", 1.0),
    ("it is 0.75", "\\frac{3}{4}", 1.0),
    ("\\boxed{4} but then 5", "4", 1.0),
    ("x = 4", "5", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("I do not know", "3", 0.0),
    ("", "3", 0.0),
])
def test_rewards_equivalent_answers(task: MathTask, completion: str, reference: str, reward: float) -> None:
    assert task.score("", completion, reference) == reward


def test_format_reward_goes_to_wrong_but_extractable_answers() -> None:
    task = load_task("producers.tasks.math:MathTask", {"format_reward": 0.1})
    assert [task.score("", c, "5") for c in ("\\boxed{5}", "\\boxed{6}", "no answer")] == [1.0, 0.1, 0.0]


def test_hostile_completions_end_and_score_zero() -> None:
    task = MathTask(timeout_s=3)
    assert task.score("", "9" * 1_000_000, "5") == 0.0
    assert task.score("", "\\boxed{" * 20_000, "5") == 0.0
    for tower in ("\\boxed{10^{10^{10}}}", "\\boxed{9^{9^{9}}}", "\\boxed{(1+x)^{100000}}"):
        assert task.score("", tower, "5") == 0.0
    assert task.score("", "\\boxed{2}", "2.0") == 1.0  # the task goes on after a killed worker


def test_scores_from_threads_equal_scores_in_sequence(task: MathTask) -> None:
    cases = [("\\boxed{\\frac{1}{2}}", "0.5"), ("#### 7", "8"), ("it is -3", "-3"), ("\\boxed{2\\pi}", "2\\pi"),
             ("\\boxed{x^2-1}", "(x-1)(x+1)"), ("\\boxed{0.333}", "\\frac{1}{3}")] * 3
    alone = [task.score("", c, r) for c, r in cases]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda case: task.score("", *case), cases))
    assert together == alone == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0] * 3


def test_bad_reference_and_bad_params_are_refused(task: MathTask) -> None:
    with pytest.raises(AnswerError, match="reference answer is empty"):
        task.score("", "\\boxed{1}", "  ")
    with pytest.raises(ValueError, match="format_reward"):
        MathTask(format_reward=1.5)
    with pytest.raises(ValueError, match="timeout_s"):
        MathTask(timeout_s=1)
