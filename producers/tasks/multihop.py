"""``multihop``: questions whose answer takes several searches of a local corpus, one per turn.

The corpus is generated from ``seed``: people born in cities, cities in countries, people working
for companies, companies based in cities, one short document per fact. A question asks for what
one fact gives (where was X born?) or what a chain of two gives (in which country was X born: the
city first, then its country; where is the company X works for based). Every turn the model either
searches::

    <search>Ilo Vantu born</search>
    <results>[1] Ilo Vantu was born in Karsa.</results>     (the environment's, masked out of the loss)

or answers, ``<answer>Dremia</answer>``, which ends the episode (so do a turn without either, and
``max_turns``). Search is BM25 (``bm25s``) over the corpus, ``top_k`` documents. Reward: 1 when the
last answer equals the reference (case- and space-insensitively), else 0. Held-out questions are
about people no train question names: the fact about the person is found by searching, never
remembered (a second hop, a city's country or a company's city, may also be one a train question
took). Places and companies grow with ``people``, so no answer is common enough to guess.

The corpus is a function of ``seed`` and ``people``: every worker builds the same one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from producers.episodes import Observation, TurnDemonstrations
from producers.tasks import AnswerError
from producers.tasks.calls import answer_score, tagged_call
from producers.tasks.tool import Corpus

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
_SYLLABLES = ["ka", "lo", "mi", "ra", "ve", "no", "ti", "sa", "du", "re", "po", "li", "an", "or", "el", "un"]


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


def _distinct(rng: random.Random, count: int, make) -> list[str]:
    out: list[str] = []
    while len(out) < count:
        name = make()
        if name not in out:
            out.append(name)
    return out


class World:
    """The facts of corpus ``seed``: who was born where, works for whom; where cities and companies are."""

    def __init__(self, seed: int, people: int) -> None:
        rng = random.Random(seed)
        # Places and companies grow with the people: with a few of each, one answer is right often
        # enough that a policy guesses it instead of searching.
        countries = _distinct(rng, max(6, people // 5), lambda: _name(rng, 3))
        cities = _distinct(rng, max(18, people // 3), lambda: _name(rng, 2))
        companies = _distinct(rng, max(10, people // 4),
                              lambda: _name(rng, 2) + " " + rng.choice(["Labs", "Works", "Group"]))
        names = _distinct(rng, people, lambda: f"{_name(rng, 2)} {_name(rng, 2)}")
        self.country = {c: rng.choice(countries) for c in cities}
        self.based = {c: rng.choice(cities) for c in companies}
        self.born = {p: rng.choice(cities) for p in names}
        self.works = {p: rng.choice(companies) for p in names}
        self.people = names

    def documents(self) -> list[str]:
        docs = [f"{p} was born in {c}." for p, c in self.born.items()]
        docs += [f"{p} works for {c}." for p, c in self.works.items()]
        docs += [f"{c} is a city in {k}." for c, k in self.country.items()]
        docs += [f"{c} is based in {k}." for c, k in self.based.items()]
        return docs

    def questions(self, person: str) -> list[tuple[str, list[str], str]]:
        """(question, the searches that find it, answer) about ``person``."""
        city, company = self.born[person], self.works[person]
        return [
            (f"Where was {person} born?", [f"{person} born"], city),
            (f"In which country was {person} born?", [f"{person} born", f"{city} city"], self.country[city]),
            (f"In which city is the company {person} works for based?", [f"{person} works", f"{company} based"],
             self.based[company]),
        ]


class MultiHopTask(TurnDemonstrations):
    """Searches of a generated corpus (``<search>``), one per turn, then an answer."""

    name = "multihop"

    def __init__(self, *, seed: int = 0, people: int = 400, max_turns: int = 4, top_k: int = 1,
                 max_observation_chars: int = 300, n_heldout_people: int = 100) -> None:
        if min(people, max_turns, top_k, max_observation_chars) < 1 or not 0 < n_heldout_people < people:
            raise ValueError("people, max_turns, top_k and max_observation_chars must be at least 1, and "
                             "n_heldout_people between 1 and people - 1")
        self.seed, self.max_turns, self.max_observation_chars = seed, max_turns, max_observation_chars
        self.n_heldout_people = n_heldout_people
        self.world = World(seed, people)
        self.corpus = Corpus.of(self.world.documents(), top_k)

    def observe(self, prompt: str, turn: str, answer: str) -> Observation | None:
        return tagged_call(turn, "search", lambda query: _results(self.search(query)))

    def search(self, query: str) -> str:
        return self.corpus.search(query)[: self.max_observation_chars]

    @staticmethod
    def _item(answer: str) -> dict:
        try:
            item = json.loads(answer)
            str(item["answer"]), list(item["searches"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise AnswerError("multihop: the answer is not {searches, answer} JSON; write the dataset with "
                              "MultiHopTask.write_example_dataset") from None
        return item

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return answer_score(completion, self._item(answer)["answer"])

    def demonstration_turns(self, answer: str) -> list[tuple[str, bool]]:
        """The reference episode as (text, the model's?) pieces: each search, its results, the answer."""
        item = self._item(answer)
        parts = [p for q in item["searches"] for p in ((f"{SEARCH_OPEN}{q}{SEARCH_CLOSE}", True),
                                                       (_results(self.search(q)), False))]
        return parts + [(f"<answer>{item['answer']}</answer>", True)]

    def write_example_dataset(self, out_dir: Path, config, *, seed: int) -> tuple[Path, Path]:
        """Every question about each person: train about all but the last ``n_heldout_people`` people,
        held out (``config.n_heldout`` rows, at most) about those; the corpus is the task's own."""
        rng = random.Random(seed)
        people = list(self.world.people)
        held_people = people[len(people) - self.n_heldout_people:]
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        paths = []
        for split, who in (("train", people[: len(people) - self.n_heldout_people]), ("heldout", held_people)):
            rows = [(p, k, q) for p in who for k, q in enumerate(self.world.questions(p))]
            rng.shuffle(rows)
            if split == "heldout":
                rows = rows[: config.n_heldout]
            path = out_dir / f"{split}.jsonl"
            with path.open("w", encoding="utf-8") as fh:
                for person, k, (question, searches, value) in rows:
                    fh.write(json.dumps({"prompt_id": f"multihop-{self.seed}-{person.replace(' ', '_')}-{k}",
                                         "prompt": f"Question: {question}\n",
                                         "answer": json.dumps({"searches": searches, "answer": value})}) + "\n")
            paths.append(path)
        return paths[0], paths[1]


def _results(text: str) -> str:
    return f"\n<results>{text}</results>\n"
