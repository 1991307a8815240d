"""The shell environment: file trees and questions from a seed, reference episodes scoring 1, wrong
ones 0, commands that see what earlier ones did, and the sandbox's limits on each command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from producers.episodes import EnvironmentTask
from producers.tasks import AnswerError
from producers.tasks.shell import ShellTask, file_tree, write_shell_dataset
from tests.fixtures.answers import assert_no_answer_is_common


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    train, heldout = write_shell_dataset(tmp_path_factory.mktemp("sh"), n_train=40, n_heldout=10, seed=2)
    held = [json.loads(x) for x in heldout.read_text().splitlines()]
    train_rows = [json.loads(x) for x in train.read_text().splitlines()]
    seeds = lambda split: {json.loads(r["answer"])["seed"] for r in split}  # noqa: E731
    assert len(train_rows) == 40 and len(held) == 10 and not seeds(train_rows) & seeds(held)
    return train_rows


def test_trees_and_questions_come_from_the_seed(tmp_path: Path, rows) -> None:
    again, _ = write_shell_dataset(tmp_path, n_train=40, n_heldout=10, seed=2)
    assert [json.loads(x) for x in again.read_text().splitlines()] == rows
    assert file_tree(9) == file_tree(9) != file_tree(10)
    assert {len(json.loads(r["answer"])["commands"]) for r in rows} == {1, 2}


def test_no_answer_is_common_enough_to_be_guessed(tmp_path: Path) -> None:
    # A policy that answers without running a command must not find an answer that is often right,
    # overall or for one kind of question: RL would learn to guess it instead of to look (counts of
    # 3-6 log files and of 3-15 lines did that: '3' was 8.1% of 2,000 rows, '12' 30% of one kind).
    train, _ = write_shell_dataset(tmp_path, n_train=2000, n_heldout=10, seed=1)
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    pairs = [(re.sub(r"\S+/\S+", "PATH", r["prompt"]), json.loads(r["answer"])["answer"]) for r in rows]
    assert assert_no_answer_is_common(pairs, overall=0.03, per_kind=0.08) >= 5


def test_a_reference_episode_scores_1_and_a_wrong_one_0(rows) -> None:
    task = ShellTask()
    assert isinstance(task, EnvironmentTask)
    for row in rows[:12]:
        demo = task.demonstration(row["answer"])
        assert task.score(row["prompt"], demo, row["answer"]) == 1.0, demo
        assert task.score(row["prompt"], demo.replace("<answer>", "<answer>9"), row["answer"]) == 0.0
        assert task.score(row["prompt"], "<bash>ls</bash>", row["answer"]) == 0.0
    with pytest.raises(AnswerError, match="write_shell_dataset"):
        task.score("", "<answer>1</answer>", "[]")


def test_each_command_sees_the_episodes_earlier_ones_and_runs_inside_its_limits(rows) -> None:
    task = ShellTask(command_timeout_s=1.0, max_observation_chars=100)
    env = task.episode(rows[0]["prompt"], rows[0]["answer"])
    assert env.observe("<bash>mkdir made && echo kept > made/it</bash> and more").consumed == len(
        "<bash>mkdir made && echo kept > made/it</bash>")
    assert "kept" in env.observe("<bash>cat made/it</bash>").text  # a fresh sandbox, the earlier command replayed
    assert "command timed out" in env.observe("<bash>sleep 30</bash>").text
    assert "Permission denied" in env.observe("<bash>echo x > /tmp/outside</bash>").text
    assert len(env.observe("<bash>yes</bash>").text) <= 100 + len("\n<output></output>\n")
    assert "exit status 3" in env.observe("<bash>exit 3</bash>").text
    forks = env.observe("<bash>for i in $(seq 100); do sleep 5 & done; wait</bash>").text
    assert "fork" in forks.lower() or "resource" in forks.lower() or "timed out" in forks  # at most 32 processes
    assert env.observe("<answer>4</answer> <bash>ls</bash>").end and env.observe("no command") is None
