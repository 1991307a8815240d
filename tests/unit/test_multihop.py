"""Multi-hop search: a corpus and questions from a seed, held-out questions about other people,
reference episodes (two searches for two-hop questions) scoring 1 and wrong ones 0."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

from producers.episodes import MultiTurnTask
from producers.tasks.multihop import MultiHopTask
from tests.fixtures.answers import assert_no_answer_is_common


def test_questions_take_one_or_two_searches_of_a_corpus_built_from_the_seed(tmp_path: Path) -> None:
    task = MultiHopTask(seed=3, people=60, n_heldout_people=10)
    assert isinstance(task, MultiTurnTask)
    assert MultiHopTask(seed=3, people=60, n_heldout_people=10).world.documents() == task.world.documents()
    assert MultiHopTask(seed=4, people=60, n_heldout_people=10).world.documents() != task.world.documents()
    train, heldout = task.write_example_dataset(tmp_path, SimpleNamespace(n_heldout=20), seed=0)
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    held = [json.loads(x) for x in heldout.read_text().splitlines()]
    assert len(rows) == 50 * 3 and len(held) == 20
    asked = lambda split: {r["prompt_id"].rsplit("-", 1)[0] for r in split}  # noqa: E731
    assert not asked(rows) & asked(held)  # held-out questions are about people never asked about in training
    assert {len(json.loads(r["answer"])["searches"]) for r in rows} == {1, 2}
    for row in rows + held:
        demo = task.demonstration(row["answer"])
        assert task.score(row["prompt"], demo, row["answer"]) == 1.0, demo
        assert task.score(row["prompt"], demo.replace("<answer>", "<answer>no "), row["answer"]) == 0.0


def test_each_search_is_answered_with_the_best_documents_and_an_answer_ends_the_episode() -> None:
    task = MultiHopTask(seed=3, people=60, n_heldout_people=10, max_observation_chars=60)
    person = task.world.people[0]
    seen = task.observe("", f"<search>{person} born</search> then more", "")
    assert seen is not None and seen.consumed == len(f"<search>{person} born</search>")
    assert f"{person} was born in {task.world.born[person]}." in seen.text
    assert len(task.observe("", "<search>" + "x " * 100 + "</search>", "").text) <= 60 + len("\n<results></results>\n")
    assert task.observe("", "<answer>Karsa</answer><search>x</search>", "").end
    assert task.observe("", "no search at all", "") is None


def test_no_answer_is_common_enough_to_be_guessed(tmp_path: Path) -> None:
    # A policy that answers without searching must not find an answer that is often right, overall or
    # for one kind of question (with 6 countries, one was the answer to 40% of the country questions).
    task = MultiHopTask()
    train, _ = task.write_example_dataset(tmp_path, SimpleNamespace(n_heldout=10), seed=0)
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    # the question up to the person's name
    pairs = [(re.sub(r"(company|was) .*", "", r["prompt"]), json.loads(r["answer"])["answer"]) for r in rows]
    assert assert_no_answer_is_common(pairs, overall=0.03, per_kind=0.08) == 3
