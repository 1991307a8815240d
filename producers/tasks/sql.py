"""``sql``: questions about a generated SQLite database, answered by querying it turn by turn.

Each prompt is one database (a few tables of people, departments and projects, generated from a
seed) and one question about it; the row's ``answer`` (JSON, written by ``write_sql_dataset``)
holds the seed, the question's reference SQL and its answer. Every turn the model either queries::

    <sql>SELECT COUNT(*) FROM employees WHERE department = 'Sales'</sql>
    <result>4</result>                      (appended by the environment, masked out of the loss)

or answers, ``<answer>4</answer>``, which ends the episode (so do a turn without either, and
``max_turns``). Questions take one query (a total, a lookup) or two (the floor of a
person's department, when the join is not written). Reward: 1 when the last answer equals the
reference (numbers as numbers, text case- and space-insensitively), else 0.

The database is the episode's own, in memory, read-only (``PRAGMA query_only``); a query is cut
after ``max_steps`` SQLite virtual-machine steps and its result after ``max_rows`` rows and
``max_observation_chars`` characters. A failing query is answered with SQLite's error, as a real
database would; it never ends the episode.
"""

from __future__ import annotations

import json
import random
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from producers.episodes import Observation, TurnDemonstrations
from producers.tasks import AnswerError
from producers.tasks.calls import answer_score, tagged_call, write_seeded_splits

FIRST = ["Ada", "Ben", "Cleo", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivo", "Jade", "Kai", "Lea", "Milo", "Nia",
         "Otto", "Pia", "Quin", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Xia", "Yara", "Zed"]
DEPARTMENTS = ["Sales", "Research", "Support", "Finance", "Legal", "Design"]
CITIES = ["Oslo", "Lima", "Rome", "Kyiv", "Pune", "Kobe", "Reno", "Bern", "Doha", "Riga", "Baku", "Nice", "Cork",
          "Graz", "Faro", "Bari", "Agra", "Hue", "Suva", "Apia", "Male", "Lodz", "Turku", "Split"]
SCHEMA = ("Tables: employees(name, department, city, salary); departments(name, floor); "
          "projects(title, owner, budget).")


@dataclass(frozen=True)
class Database:
    """One generated database: its rows, rebuilt from the seed wherever it is needed."""

    seed: int
    employees: list[tuple[str, str, str, int]]
    departments: list[tuple[str, int]]
    projects: list[tuple[str, str, int]]

    @classmethod
    def generate(cls, seed: int, *, n_employees: int = 12) -> Database:
        rng = random.Random(seed)
        names = rng.sample(FIRST, min(n_employees, len(FIRST)))
        departments = rng.sample(DEPARTMENTS, 4)
        floors = rng.sample(range(1, 60), len(departments))
        employees = [(n, rng.choice(departments), rng.choice(CITIES), rng.randrange(30, 121) * 1000) for n in names]
        owners = rng.sample(names, min(4, len(names)))
        projects = [(f"P{rng.randrange(100, 1000)}", o, rng.randrange(1, 50) * 1000) for o in owners]
        return cls(seed, employees, list(zip(departments, floors)), projects)

    def connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(":memory:", check_same_thread=False)
        db.execute("CREATE TABLE employees (name TEXT, department TEXT, city TEXT, salary INTEGER)")
        db.execute("CREATE TABLE departments (name TEXT, floor INTEGER)")
        db.execute("CREATE TABLE projects (title TEXT, owner TEXT, budget INTEGER)")
        db.executemany("INSERT INTO employees VALUES (?, ?, ?, ?)", self.employees)
        db.executemany("INSERT INTO departments VALUES (?, ?)", self.departments)
        db.executemany("INSERT INTO projects VALUES (?, ?, ?)", self.projects)
        db.commit()
        db.execute("PRAGMA query_only = ON")
        return db


def questions(db: Database, rng: random.Random) -> list[tuple[str, list[str]]]:
    """(question, reference queries in order) pairs about ``db``; the last query's single value is
    the answer. Two-query questions need the first one's value in the second. No answer is one a
    policy could guess without querying (a small count, one of a few floors or cities): RL would
    learn to guess it."""
    person, dept = rng.choice(db.employees), rng.choice(db.departments)
    project = rng.choice(db.projects)
    staffed = rng.choice(sorted({e[1] for e in db.employees}))
    name = person[0]
    return [
        (f"What is the total salary of the employees in {staffed}?",
         [f"SELECT SUM(salary) FROM employees WHERE department = '{staffed}'"]),
        (f"Which city does {name} live in?", [f"SELECT city FROM employees WHERE name = '{name}'"]),
        (f"What is the salary of {name}?", [f"SELECT salary FROM employees WHERE name = '{name}'"]),
        (f"On which floor is {dept[0]}?", [f"SELECT floor FROM departments WHERE name = '{dept[0]}'"]),
        (f"What is the budget of project {project[0]}?", [f"SELECT budget FROM projects WHERE title = '{project[0]}'"]),
        (f"On which floor does {name} work?", [f"SELECT department FROM employees WHERE name = '{name}'",
                                               "SELECT floor FROM departments WHERE name = '{0}'"]),
        (f"Which city does the owner of project {project[0]} live in?",
         [f"SELECT owner FROM projects WHERE title = '{project[0]}'", "SELECT city FROM employees WHERE name = '{0}'"]),
    ]


class SqlTask(TurnDemonstrations):
    """Questions about a generated SQLite database; the model queries (``<sql>``) then answers."""

    name = "sql"

    def __init__(self, *, max_turns: int = 5, max_rows: int = 10, max_steps: int = 100_000,
                 max_observation_chars: int = 300, n_train: int = 4000) -> None:
        if min(max_turns, max_rows, max_steps, max_observation_chars, n_train) < 1:
            raise ValueError("max_turns, max_rows, max_steps, max_observation_chars and n_train must be at least 1")
        self.max_turns, self.max_rows, self.max_steps = max_turns, max_rows, max_steps
        self.max_observation_chars, self.n_train = max_observation_chars, n_train

    @staticmethod
    def _item(answer: str) -> dict:
        try:
            item = json.loads(answer)
            int(item["seed"]), str(item["answer"]), list(item["queries"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise AnswerError("sql: the answer is not {seed, queries, answer} JSON; write the dataset with "
                              "write_sql_dataset") from None
        return item

    def episode(self, prompt: str, answer: str) -> SqlEpisode:
        return SqlEpisode(self, Database.generate(int(self._item(answer)["seed"])).connect())

    def run(self, db: sqlite3.Connection, query: str) -> str:
        """The result of ``query`` as the model reads it: rows of ``|``-separated values, or the error."""
        steps = [0]

        def bounded() -> int:
            steps[0] += 1
            return 1 if steps[0] * 1000 > self.max_steps else 0

        db.set_progress_handler(bounded, 1000)
        try:
            rows = db.execute(query).fetchmany(self.max_rows + 1)
        except sqlite3.Error as exc:
            text = "error: query stopped after too many steps" if "interrupted" in str(exc) else f"error: {exc}"
            return text[: self.max_observation_chars]
        finally:
            db.set_progress_handler(None, 0)
        lines = [" | ".join(str(v) for v in row) for row in rows[: self.max_rows]]
        if len(rows) > self.max_rows:
            lines.append(f"... (more than {self.max_rows} rows)")
        return ("\n".join(lines) or "no rows")[: self.max_observation_chars]

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return answer_score(completion, self._item(answer)["answer"])

    def demonstration_turns(self, answer: str) -> list[tuple[str, bool]]:
        """The reference episode as (text, the model's?) pieces: each query, its result, the answer."""
        item = self._item(answer)
        db, parts, value = Database.generate(int(item["seed"])).connect(), [], ""
        try:
            for query in item["queries"]:
                query = query.replace("{0}", value)
                result = self.run(db, query)
                parts += [(f"<sql>{query}</sql>", True), (_result(result), False)]
                value = result
        finally:
            db.close()
        return parts + [(f"<answer>{item['answer']}</answer>", True)]

    def write_example_dataset(self, out_dir: Path, config, *, seed: int) -> tuple[Path, Path]:
        """`rlbus prepare`'s data: ``n_train`` questions, ``config.n_heldout`` held out."""
        return write_sql_dataset(out_dir, n_train=self.n_train, n_heldout=config.n_heldout, seed=seed)


def _result(text: str) -> str:
    return f"\n<result>{text}</result>\n"


class SqlEpisode:
    """One episode's database connection."""

    def __init__(self, task: SqlTask, db: sqlite3.Connection) -> None:
        self.task, self.db = task, db

    def observe(self, turn: str) -> Observation | None:
        return tagged_call(turn, "sql", lambda query: _result(self.task.run(self.db, query)))

    def close(self) -> None:
        self.db.close()


def write_sql_dataset(out_dir: Path, *, n_train: int, n_heldout: int, seed: int) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``heldout.jsonl``: one generated database per row, each with one
    question; held-out databases are generated from seeds no train row uses."""

    def row(db_seed: int, rng: random.Random) -> tuple[str, dict]:
        db = Database.generate(db_seed)
        question, queries = rng.choice(questions(db, rng))
        conn, value = db.connect(), ""
        try:
            for query in queries:
                value = str(conn.execute(query.replace("{0}", value)).fetchall()[0][0])
        finally:
            conn.close()
        return f"{SCHEMA}\nQuestion: {question}\n", {"seed": db_seed, "queries": queries, "answer": value}

    return write_seeded_splits(out_dir, name="sql", n_train=n_train, n_heldout=n_heldout, seed=seed, row=row)
