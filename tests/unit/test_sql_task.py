"""The SQL environment: databases and questions from a seed, reference episodes scoring 1, wrong
ones 0, the database read-only and bounded, and the turn budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producers.episodes import EnvironmentTask, is_multi_turn
from producers.tasks import AnswerError
from producers.tasks.sql import Database, SqlTask, write_sql_dataset
from tests.fixtures.answers import assert_no_answer_is_common


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    train, heldout = write_sql_dataset(tmp_path_factory.mktemp("sql"), n_train=60, n_heldout=20, seed=3)
    return ([json.loads(x) for x in train.read_text().splitlines()],
            [json.loads(x) for x in heldout.read_text().splitlines()])


def test_databases_and_questions_come_from_the_seed_and_held_out_databases_are_new(tmp_path: Path, rows) -> None:
    train, heldout = rows
    assert len(train) == 60 and len(heldout) == 20
    again, _ = write_sql_dataset(tmp_path / "a", n_train=60, n_heldout=20, seed=3)
    assert [json.loads(x) for x in again.read_text().splitlines()] == train
    seeds = lambda split: {json.loads(r["answer"])["seed"] for r in split}  # noqa: E731
    assert not seeds(train) & seeds(heldout)
    assert Database.generate(5) == Database.generate(5) != Database.generate(6)
    # Both kinds of question are there: one query, and two where the second needs the first's value.
    assert {len(json.loads(r["answer"])["queries"]) for r in train} == {1, 2}


def test_no_answer_is_common_enough_to_be_guessed(tmp_path: Path) -> None:
    # A policy that answers without querying must not find an answer that is often right: RL would
    # learn to guess it (small counts and a few floors did that) instead of to query.
    train, _ = write_sql_dataset(tmp_path, n_train=2000, n_heldout=10, seed=1)
    rows = [json.loads(json.loads(x)["answer"]) for x in train.read_text().splitlines()]
    assert_no_answer_is_common((("", str(row["answer"]).lower()) for row in rows), overall=0.03, per_kind=0.03)


def test_a_reference_episode_scores_1_and_a_wrong_one_0(rows) -> None:
    task = SqlTask()
    assert isinstance(task, EnvironmentTask) and is_multi_turn(task)
    for row in rows[0]:
        demo = task.demonstration(row["answer"])
        assert task.score(row["prompt"], demo, row["answer"]) == 1.0
        assert task.score(row["prompt"], demo.replace("<answer>", "<answer>x"), row["answer"]) == 0.0
        assert task.score(row["prompt"], "<sql>SELECT 1</sql>", row["answer"]) == 0.0
        # Played turn by turn: each query answered with its result; the answer ends the episode.
        env = task.episode(row["prompt"], row["answer"])
        turns = [t + "</sql>" for t in demo.split("</sql>")[:-1]]
        for turn in turns:
            seen = env.observe(turn.split("<result>")[-1].split("</result>")[-1].lstrip() + " more text")
            assert seen is not None and seen.text.startswith("\n<result>") and seen.text in demo
        done = env.observe(f"<answer>{json.loads(row['answer'])['answer']}</answer> and more")
        assert done.end and done.consumed == len(f"<answer>{json.loads(row['answer'])['answer']}</answer>")
        env.close()
    with pytest.raises(AnswerError, match="write_sql_dataset"):
        task.score("", "<answer>1</answer>", "{}")


def test_the_database_is_read_only_and_every_query_is_bounded(rows) -> None:
    task = SqlTask(max_rows=3, max_steps=20_000, max_observation_chars=200)
    env = task.episode(rows[0][0]["prompt"], rows[0][0]["answer"])
    try:
        assert "readonly" in env.observe("<sql>DELETE FROM employees</sql>").text
        assert "more than 3 rows" in env.observe("<sql>SELECT name FROM employees</sql>").text
        endless = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
        assert "too many steps" in env.observe(f"<sql>{endless}</sql>").text
        assert "no such table" in env.observe("<sql>SELECT * FROM secrets</sql>").text
        assert len(env.observe("<sql>SELECT printf('%.500c', 'x')</sql>").text) <= 200 + len("\n<result></result>\n")
        assert env.observe("<sql>SELECT COUNT(*) FROM employees</sql>").text == "\n<result>12</result>\n"
        assert env.observe("I give up") is None  # no query and no answer: the episode ends
    finally:
        env.close()
