"""The text-game environment (TextWorldExpress on the Java runtime): games generated from a seed,
gold episodes scoring 1, bad ones 0, the turn limit, and whole episodes of a model built here."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import pytest

from broker.schema import SamplingParams
from producers.engines.torch_engine import TorchEngine
from producers.episodes import EnvironmentTask, is_multi_turn, run_episodes
from producers.prompts import prompt_token_ids
from producers.tasks import AnswerError
from producers.tasks.textgame import Game, TextGameTask, commands_of, write_textgame_dataset
from producers.worker import pack_samples
from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer

pytestmark = pytest.mark.skipif(shutil.which("java") is None,
                                reason="no Java runtime: TextWorldExpress needs one (apt-get install "
                                       "openjdk-17-jre-headless; `make venv` installs it)")

GAMES = [{"name": "coin", "params": {"numLocations": 4, "numDistractorItems": 0, "includeDoors": 0}},
         {"name": "cookingworld", "params": {"numLocations": 1, "numIngredients": 1, "numDistractorItems": 0,
                                             "includeDoors": 0, "limitInventorySize": 0}}]


@pytest.fixture(scope="module")
def task() -> TextGameTask:
    task = TextGameTask(max_turns=12)
    yield task
    task.close()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], list[dict]]:
    train, heldout = write_textgame_dataset(tmp_path_factory.mktemp("games"), games=GAMES, n_train=8, n_heldout=4,
                                            seed=7, max_turns=12)
    return ([json.loads(x) for x in train.read_text().splitlines()],
            [json.loads(x) for x in heldout.read_text().splitlines()])


def test_games_come_from_the_seed_and_held_out_games_are_never_trained_on(tmp_path: Path, dataset) -> None:
    train, heldout = dataset
    assert len(train) == 8 and len(heldout) == 4
    assert sum(Game.from_answer(r["answer"]).name == "coin" for r in train) == 4
    assert {Game.from_answer(r["answer"]).fold for r in train} == {"train"}
    assert {Game.from_answer(r["answer"]).fold for r in heldout} == {"dev"}
    again, _ = write_textgame_dataset(tmp_path / "a", games=GAMES, n_train=8, n_heldout=4, seed=7, max_turns=12)
    assert [json.loads(x) for x in again.read_text().splitlines()] == train
    other, _ = write_textgame_dataset(tmp_path / "b", games=GAMES, n_train=8, n_heldout=4, seed=8, max_turns=12)
    assert [json.loads(x)["prompt_id"] for x in other.read_text().splitlines()] != [r["prompt_id"] for r in train]
    with pytest.raises(ValueError, match="no game 'zork'"):
        write_textgame_dataset(tmp_path / "c", games=[{"name": "zork"}], n_train=1, n_heldout=1, seed=0)


def test_a_gold_episode_scores_1_and_a_bad_one_0(task: TextGameTask, dataset) -> None:
    for row in dataset[0]:
        game = Game.from_answer(row["answer"])
        demo = task.demonstration(row["answer"])
        assert commands_of(demo) == [c for c in game.gold if c != "look around"], game
        assert task.score(row["prompt"], demo, row["answer"]) == 1.0, game
        assert task.score(row["prompt"], "inventory\n<obs>You have nothing.</obs>\nlook around\n", row["answer"]) == 0.0
        # Played turn by turn in the episode's own environment: the game ends with the last gold command.
        env = task.episode(row["prompt"], row["answer"])
        commands = commands_of(demo)
        answers = [env.observe(c + "\nand more") for c in commands]
        assert all(a is not None and not a.end and a.consumed == len(c) + 1 for a, c in zip(answers[:-1], commands))
        assert answers[-1].end and answers[-1].consumed == len(commands[-1]) + 1  # what came after is dropped
    with pytest.raises(AnswerError, match="write_textgame_dataset"):
        task.score("", "take coin\n", "not json")


def test_the_turn_limit_ends_the_episode_and_bounds_the_score(dataset) -> None:
    row = next(r for r in dataset[0] if Game.from_answer(r["answer"]).name == "cookingworld")
    short = TextGameTask(max_turns=2)
    try:
        demo = short.demonstration(row["answer"])
        assert len(commands_of(demo)) > 2 and short.score(row["prompt"], demo, row["answer"]) < 1.0
        wasted = "inventory\n<obs>.</obs>\n" * 2 + demo  # the gold commands come after the budget
        assert TextGameTask(max_turns=40).score(row["prompt"], wasted, row["answer"]) == 1.0
        assert short.score(row["prompt"], wasted, row["answer"]) == 0.0
    finally:
        short.close()


def test_episodes_of_a_model_record_their_turns_and_the_game_answers_between_them(tmp_path: Path, dataset) -> None:
    train, _ = dataset
    task = TextGameTask(max_turns=4, max_observation_chars=120)
    assert isinstance(task, EnvironmentTask) and is_multi_turn(task)
    texts = [r["prompt"] for r in train] + [task.demonstration(r["answer"]) for r in train]
    tokenizer = train_bpe_tokenizer(texts, vocab_size=400)
    model_dir = build_checkpoint(tmp_path / "m", tokenizer, hidden_size=32, layers=1, heads=2,
                                 max_position_embeddings=1024)
    engine = TorchEngine(model_dir, seed=0)
    rows = train[:2]
    prompts = [(r["prompt"], r["answer"], prompt_token_ids(engine.tokenizer, r["prompt"], None)) for r in rows]
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=6)
    results = asyncio.run(run_episodes(engine, task, prompts, 3, sampling, max_context_tokens=1024))
    try:
        for row, group in zip(rows, results):
            for r in group:
                assert 1 <= len(r.turns) <= task.max_turns
                for start, end in r.turns:  # turns are what the model generated; the rest is the game's
                    assert all(m == 1 for m in r.mask[start:end])
                between = [r.mask[end:start] for (_, end), (start, _) in zip(r.turns, r.turns[1:])]
                assert all(gap and not any(gap) for gap in between)
                zero_runs = sum(1 for j, m in enumerate(r.mask) if m == 0 and (j == 0 or r.mask[j - 1] == 1))
                assert r.text.count("<obs>") == zero_runs <= len(r.turns)  # an answer after each turn but the last
                assert 0.0 <= task.score(row["prompt"], r.text, row["answer"]) <= 1.0
        packed = pack_samples(results[0])
        assert int(packed["loss_mask"].sum()) == sum(e - s for r in results[0] for s, e in r.turns)
    finally:
        task.close()


def test_the_warm_up_trains_on_the_players_commands_only(tmp_path: Path, task: TextGameTask, dataset) -> None:
    from consumers.dataset import Row
    from trainer.warmup import _answer_batch

    row = next(r for r in dataset[0] if len(Game.from_answer(r["answer"]).gold) > 3)
    tokenizer = train_bpe_tokenizer([row["prompt"], task.demonstration(row["answer"])], vocab_size=300)
    ids, _, labels = _answer_batch(tokenizer, [Row(key="k", prompt=row["prompt"], answer=row["answer"])],
                                   task.demonstration_turns)
    trained = tokenizer.decode([int(t) for t, y in zip(ids[0], labels[0]) if y != -100])
    assert trained == "".join(text for text, mine in task.demonstration_turns(row["answer"]) if mine)
    assert "<obs>" not in trained and trained.endswith("\n")  # no game text, and no <eos>: the game ends it
