"""``textgame``: text games from TextWorldExpress (coin collector, cooking world, ...) as episodes of
many turns, generated offline from a seed.

Each prompt is one game: which game, its size parameters, its seed and fold, and its gold actions are
the row's ``answer`` (JSON, written by ``write_textgame_dataset``); the prompt text is the task and
the first observation. Every turn the model writes one command and a newline::

    <obs>You are in the kitchen. ... actions: look around, move east, take coin</obs>
    take coin
    <obs>You take the coin.</obs>

The environment (``TextGameTask.episode``) plays the command in the game and answers with the next
``<obs>`` block (masked out of the loss); the episode ends when the game is won or lost (what the
model wrote past that command is dropped), or after ``max_turns`` commands. Reward: the game's own
score at the end, in [0, 1] (coin collector: 1 for the coin; cooking world: a share per recipe step
done, 1 for the eaten meal). ``score`` replays the
commands of a transcript in a fresh game, so it needs nothing but the transcript.

The games run in the Java 17 runtime (``java`` on PATH): one JVM per task, shared by its episodes
under a lock, each step replaying the episode's commands from the game's start (a step is about a
millisecond).
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from producers.episodes import Observation, TurnDemonstrations
from producers.tasks import AnswerError

logger = logging.getLogger(__name__)

GAMES = ("coin", "cookingworld", "twc", "mapreader", "arithmetic", "sorting", "simonsays", "peckingorder")
WALKED = {"coin": ("move", "open door", "take coin")}
"""Games whose generated gold path is a random walk (a different one each time), with the verbs a
shortest win needs."""
OBS_OPEN, OBS_CLOSE = "<obs>", "</obs>"
_OBS = re.compile(re.escape(OBS_OPEN) + r".*?" + re.escape(OBS_CLOSE) + r"\n?", re.S)


class GameUnavailable(RuntimeError):
    """The games cannot run here; the message says what to install."""


def _need_java() -> None:
    if shutil.which("java") is None:
        raise GameUnavailable("textgame needs a Java 17 runtime on PATH for TextWorldExpress: install it "
                              "(Debian: apt-get install openjdk-17-jre-headless), or `make venv` does it")
    try:
        import textworld_express  # noqa: F401
    except ImportError as exc:
        raise GameUnavailable(f"textgame needs the textworld-express package ({exc}): pip install -e .") from None


def game_params(params: dict[str, Any] | str | None) -> str:
    """TextWorldExpress's parameter string (``numLocations=4,includeDoors=0``) from a dict or a string."""
    if params is None:
        return ""
    if isinstance(params, str):
        return params
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(params.items()))


@dataclass(frozen=True)
class Game:
    """One generated game: what the JVM needs to start it again, and its gold commands."""

    name: str
    params: str
    seed: int
    fold: str
    gold: tuple[str, ...] = ()

    @classmethod
    def from_answer(cls, answer: str) -> Game:
        try:
            doc = json.loads(answer)
            return cls(name=str(doc["game"]), params=str(doc["params"]), seed=int(doc["seed"]), fold=str(doc["fold"]),
                       gold=tuple(doc.get("gold", ())))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise AnswerError("textgame: the answer is not a game in JSON ({game, params, seed, fold, gold}); "
                              "write the dataset with write_textgame_dataset") from None

    def to_answer(self) -> str:
        return json.dumps({"game": self.name, "params": self.params, "seed": self.seed, "fold": self.fold,
                           "gold": list(self.gold)}, sort_keys=True)


@dataclass
class Step:
    observation: str
    actions: list[str]
    score: float
    done: bool
    state: tuple[str, str] = ("", "")
    """What the player sees and holds (the room's description, the inventory): equal states are one."""

    @classmethod
    def of(cls, observation: str, infos: dict, done: bool) -> Step:
        return cls(observation, sorted(infos["validActions"]), float(infos["score"]), bool(done),
                   (str(infos.get("look", "")), str(infos.get("inventory", ""))))


class Simulator:
    """One TextWorldExpress JVM; ``play`` starts a game and plays commands in it, under a lock."""

    def __init__(self, step_limit: int = 200) -> None:
        _need_java()
        from textworld_express import TextWorldExpressEnv

        logging.getLogger("py4j").setLevel(logging.WARNING)  # its gateway logs every start and stop at INFO
        self._env = TextWorldExpressEnv(envStepLimit=step_limit)
        self._loaded: tuple[str, str] | None = None
        self._lock = threading.Lock()

    def play(self, game: Game, commands: list[str], *, gold: bool = False) -> tuple[Step, list[str]]:
        """The game after ``commands`` from its start (each one's step, the last returned), and its gold
        commands when ``gold``."""
        with self._lock:
            load = (game.name, game.params) != self._loaded
            obs, infos = self._env.reset(seed=game.seed, gameFold=game.fold, gameName=game.name if load else None,
                                         gameParams=game.params if load else None, generateGoldPath=gold)
            self._loaded = (game.name, game.params)
            golden = list(self._env.getGoldActionSequence()) if gold else []
            step = Step.of(obs, infos, infos["done"])
            for command in commands:
                if step.done:
                    break
                obs, _, done, infos = self._env.step(command)
                step = Step.of(obs, infos, done)
            return step, golden

    def shortest_win(self, game: Game, *, max_depth: int, verbs: tuple[str, ...]) -> list[str] | None:
        """The shortest commands that win ``game`` using only commands starting with ``verbs``
        (breadth first over distinct states, commands in sorted order: the same answer every time),
        or None when none wins within ``max_depth``."""
        start, _ = self.play(game, [])
        seen, frontier = {start.state}, [([], start)]
        for _ in range(max_depth):
            following = []
            for path, step in frontier:
                for command in (a for a in step.actions if a.startswith(verbs)):
                    after, _ = self.play(game, path + [command])
                    if after.done and after.score >= 1.0:
                        return path + [command]
                    if not after.done and after.state not in seen:
                        seen.add(after.state)
                        following.append((path + [command], after))
            frontier = following
        return None

    def task_description(self) -> str:
        with self._lock:
            return str(self._env.getTaskDescription())

    def seeds(self, fold: str) -> list[int]:
        with self._lock:
            if (fold := fold.lower()) == "train":
                return self._env.getValidSeedsTrain()
            return self._env.getValidSeedsDev() if fold == "dev" else self._env.getValidSeedsTest()

    def close(self) -> None:
        with self._lock:
            self._env.close()
            self._env.close = lambda: None  # its __del__ closes again, into a pipe already shut


def _command(turn: str) -> tuple[str, int]:
    """A turn's command (its first line, stripped) and the characters of the turn it takes."""
    end = turn.find("\n")
    return (turn.strip(), len(turn)) if end < 0 else (turn[:end].strip(), end + 1)


def commands_of(transcript: str) -> list[str]:
    """The commands of a transcript, in order: the first line of each turn between observations."""
    turns = _OBS.split(transcript)
    if turns and not turns[-1].strip():
        turns = turns[:-1]
    return [_command(t)[0] for t in turns]


DEFAULT_GAMES = ({"name": "coin", "params": {"numLocations": 4, "numDistractorItems": 0, "includeDoors": 0}},)


class TextGameTask(TurnDemonstrations):
    """TextWorldExpress games, one per prompt; one command per turn; the game's score is the reward.

    ``games``: what ``write_example_dataset`` generates (``{"name", "params"}`` each, spread evenly);
    ``n_train``: train games it writes; ``brief``: each observation cut to its first sentence (where
    the player is, or what the command did) before the commands on offer, for small contexts."""

    name = "textgame"

    def __init__(self, *, max_turns: int = 20, list_actions: bool = True, max_observation_chars: int = 800,
                 brief: bool = False, games: list[dict[str, Any]] | None = None, n_train: int = 1000) -> None:
        if max_turns < 1 or max_observation_chars < 1 or n_train < 1:
            raise ValueError("max_turns, max_observation_chars and n_train must be at least 1")
        self.max_turns, self.list_actions, self.max_observation_chars = max_turns, list_actions, max_observation_chars
        self.brief, self.games, self.n_train = brief, list(games or DEFAULT_GAMES), n_train
        for spec in self.games:
            if not isinstance(spec, dict) or spec.get("name") not in GAMES:
                raise ValueError(f"textgame: game {spec!r} is not one of {', '.join(GAMES)} (as {{name, params}})")
        _need_java()
        self._sim: Simulator | None = None
        self._started = threading.Lock()

    @property
    def simulator(self) -> Simulator:
        with self._started:
            if self._sim is None:
                self._sim = Simulator(step_limit=self.max_turns + 1)
            return self._sim

    def observation(self, step: Step) -> str:
        """The ``<obs>`` block of a step (its text, then the commands the game accepts there)."""
        text = " ".join(step.observation.split())
        if self.brief:
            text = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0]
        if self.list_actions and not step.done:
            text += "\nactions: " + ", ".join(step.actions)
        return f"{OBS_OPEN}{text[: self.max_observation_chars]}{OBS_CLOSE}\n"

    def episode(self, prompt: str, answer: str) -> GameEpisode:
        return GameEpisode(self, Game.from_answer(answer))

    def score(self, prompt: str, completion: str, answer: str) -> float:
        commands = commands_of(completion)[: self.max_turns]
        step, _ = self.simulator.play(Game.from_answer(answer), commands)
        return min(1.0, max(0.0, step.score))

    def demonstration_turns(self, answer: str) -> list[tuple[str, bool]]:
        """The gold episode as (text, the model's?) pieces: each gold command, the game's answer to it."""
        game = Game.from_answer(answer)
        gold = [c for c in game.gold if c != "look around"] or list(game.gold)
        parts = []
        for k, command in enumerate(gold):
            parts.append((command + "\n", True))
            if k + 1 < len(gold):
                parts.append((self.observation(self.simulator.play(game, gold[: k + 1])[0]), False))
        return parts

    def write_example_dataset(self, out_dir: Path, config, *, seed: int) -> tuple[Path, Path]:
        """`rlbus prepare`'s data for this task: ``n_train`` games of ``games``, ``config.n_heldout``
        held out (the example section's)."""
        return write_textgame_dataset(out_dir, games=self.games, n_train=self.n_train, n_heldout=config.n_heldout,
                                      seed=seed, max_turns=self.max_turns, task=self)

    def close(self) -> None:
        if self._sim is not None:
            self._sim.close()


class GameEpisode:
    """One episode's game: the commands played so far."""

    def __init__(self, task: TextGameTask, game: Game) -> None:
        self.task, self.game, self.commands = task, game, []

    def observe(self, turn: str) -> Observation | None:
        command, used = _command(turn)
        self.commands.append(command)
        step, _ = self.task.simulator.play(self.game, self.commands)
        if step.done:  # won or lost: the episode ends with this command
            return Observation(consumed=used, text="", end=True)
        return Observation(consumed=used, text=self.task.observation(step))


def write_textgame_dataset(out_dir: Path, *, games: list[dict[str, Any]], n_train: int, n_heldout: int, seed: int,
                           max_turns: int = 20, task: TextGameTask | None = None) -> tuple[Path, Path]:
    """Write ``train.jsonl`` (games of the train fold) and ``heldout.jsonl`` (of the dev fold: games
    never trained on), each spread evenly over ``games`` (``{"name": "coin", "params": {...}}``), the
    seeds drawn with ``seed``; prompts show observations as ``task`` does (default: a full one).
    Games whose shortest win is longer than ``max_turns`` are skipped."""
    own = task is None
    task = task or TextGameTask(max_turns=max_turns)
    sim = task.simulator
    rng = random.Random(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, fold, count in (("train", "train", n_train), ("heldout", "dev", n_heldout)):
        rows = []
        for k, spec in enumerate(games):
            name = spec["name"]
            if name not in GAMES:
                raise ValueError(f"textgame: no game {name!r}; games: {', '.join(GAMES)}")
            params = game_params(spec.get("params"))
            want = count // len(games) + (1 if k < count % len(games) else 0)
            pool = sorted(int(s) for s in sim.seeds(fold))  # the JVM lists them in no fixed order
            rng.shuffle(pool)
            for game_seed in pool:
                if sum(r["game"] == name for r in rows) >= want:
                    break
                game = Game(name=name, params=params, seed=int(game_seed), fold=fold)
                try:
                    start, gold = sim.play(game, [], gold=name not in WALKED)
                except Exception as exc:  # py4j raises the JVM's error for parameters the game refuses
                    raise ValueError(f"textgame {name} with params {params!r}: {exc}") from None
                if name in WALKED:  # the game's own gold path is a random walk: the shortest one instead
                    gold = sim.shortest_win(game, max_depth=max_turns, verbs=WALKED[name]) or []
                    if not gold:
                        continue
                if len([c for c in gold if c != "look around"]) > max_turns:
                    continue
                game = Game(name=name, params=params, seed=int(game_seed), fold=fold, gold=tuple(gold))
                prompt = f"{sim.task_description()}\n{task.observation(start)}"
                rows.append({"game": name, "prompt_id": f"{name}-{fold}-{game_seed}", "prompt": prompt,
                             "answer": game.to_answer()})
            got = sum(r["game"] == name for r in rows)
            if got < want:
                raise ValueError(f"textgame {name} with params {params!r}: only {got} {fold}-fold games of {want} have "
                                 f"a win within max_turns={max_turns}: ask for fewer or raise max_turns")
        path = out_dir / f"{split}.jsonl"
        with path.open("w", encoding="utf-8") as fh:
            for row in rows:
                fh.write(json.dumps({k: row[k] for k in ("prompt_id", "prompt", "answer")}) + "\n")
        paths.append(path)
        logger.info("wrote %d %s games to %s", len(rows), split, path)
    if own:
        task.close()
    return paths[0], paths[1]
