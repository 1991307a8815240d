"""``shell``: questions about a generated file tree, answered by running shell commands turn by turn
(the operating-system tasks of AgentBench).

Each prompt is one file tree (logs, data files, notes and sources, generated from a seed) and one
question about it; the row's ``answer`` (JSON, written by ``write_shell_dataset``) holds the seed,
the reference commands and the answer. Every turn the model either runs a command::

    <bash>grep -c ERROR logs/api.log</bash>
    <output>3</output>                      (appended by the environment, masked out of the loss)

or answers, ``<answer>3</answer>``, which ends the episode (so do a turn without either, and
``max_turns``). Some questions take two commands, the second using the first one's output. Reward:
1 when the last answer equals the reference (numbers as numbers, text case- and space-insensitively).

Every command runs in the code sandbox (``producers.tasks.sandbox``: its own namespaces, a fresh
uid, Landlock, CPU, memory, process and file-size limits, no network), in a fresh copy of the tree
on which the episode's earlier commands are replayed first (but those that ran out of time), so
what one command changes the next one sees. A command is stopped after ``command_timeout_s``; its
output (stdout and stderr) is cut to ``max_observation_chars``. The commands need ``exec`` inside
the sandbox: where the machine has no Landlock the sandbox's Python-level guard refuses it, and the
task says so instead of scoring 0.
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

from producers.episodes import Observation, TurnDemonstrations
from producers.tasks import AnswerError
from producers.tasks.calls import answer_score, tagged_call, write_seeded_splits
from producers.tasks.sandbox import SandboxError, SandboxLimits, run_python

BASH_OPEN, BASH_CLOSE = "<bash>", "</bash>"
TIMED_OUT = "command timed out"
"""What the model reads of a command stopped after its time (the runner below writes the same)."""
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma", "theta", "lambda", "zeta"]
LEVELS = ["INFO", "INFO", "INFO", "WARN", "ERROR"]
NAMES = ["api", "db", "auth", "cache", "queue", "mail", "search", "billing"]

_RUNNER = r'''
import json, os, subprocess, sys
spec = json.loads(sys.stdin.read())
os.mkdir("tree")
for path, text in spec["files"].items():
    os.makedirs(os.path.join("tree", os.path.dirname(path)), exist_ok=True)
    with open(os.path.join("tree", path), "w") as fh:
        fh.write(text)
def run(command):
    # Output goes to a file beside the tree (the file-size limit bounds it), not to memory.
    with open("out", "wb") as out:
        try:
            done = subprocess.run(["/bin/sh", "-c", command], stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, cwd="tree", timeout=spec["timeout_s"])
        except subprocess.TimeoutExpired:
            return "command timed out"
    with open("out", "rb") as fh:
        text = fh.read(spec["max_chars"] * 4).decode("utf-8", "replace")
    return text + (f"(exit status {done.returncode})" if done.returncode else "")
for command in spec["before"]:
    run(command)
sys.stdout.write(run(spec["command"])[: spec["max_chars"]])
'''


def file_tree(seed: int) -> dict[str, str]:
    """The files of tree ``seed``: path → text."""
    rng = random.Random(seed)
    files = {}
    for name in rng.sample(NAMES, rng.randint(3, 6)):
        lines = [f"{rng.choice(LEVELS)} {name} {rng.choice(WORDS)} {rng.randrange(1000)}"
                 for _ in range(rng.randint(3, 40))]
        files[f"logs/{name}.log"] = "\n".join(lines) + "\n"
    files["logs/README"] = "rotated weekly\n"
    for name in rng.sample(WORDS, rng.randint(2, 5)):
        numbers = [str(rng.randrange(1, 100)) for _ in range(rng.randint(2, 40))]
        files[f"data/{name}{rng.randrange(10, 100)}.txt"] = "\n".join(numbers) + "\n"
    for name in rng.sample(WORDS, rng.randint(1, 3)):
        files[f"notes/{name}.md"] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 40))) + "\n"
    return files


def _lines(text: str) -> int:
    return text.count("\n")


def _total(text: str) -> str:
    return str(sum(int(x) for x in text.split()))


def questions(files: dict[str, str], rng: random.Random) -> list[tuple[str, list[str], str]]:
    """(question, reference commands, answer) about the tree ``files``; a two-command question's
    second command takes the first one's output in place of ``{0}``. No answer is common across
    trees (a test bounds the commonest): a policy that answers without running anything must not
    find one that is often right."""
    logs = sorted(p for p in files if p.endswith(".log"))
    data = sorted(p for p in files if p.startswith("data/"))
    log, numbers = rng.choice(logs), rng.choice(data)
    errors = [line.split()[-1] for line in files[log].splitlines() if line.startswith("ERROR")]
    largest = max(data, key=lambda p: (len(files[p]), p))
    tie_free = sum(len(files[p]) == len(files[largest]) for p in data) == 1
    out = [
        ("How many lines do the .log files in logs have in all?", ["cat logs/*.log | wc -l"],
         str(sum(_lines(files[p]) for p in logs))),
        (f"How many lines does {log} have?", [f"wc -l < {log}"], str(_lines(files[log]))),
        (f"What is the sum of the numbers in {numbers}?", [f"awk '{{s += $1}} END {{print s}}' {numbers}"],
         _total(files[numbers])),
    ]
    if errors:
        out.append((f"What is the sum of the last numbers of the ERROR lines of {log}?",
                    [f"grep ERROR {log} | awk '{{s += $NF}} END {{print s}}'"], str(sum(map(int, errors)))))
    if tie_free:  # `ls -S` orders equal sizes by name in no portable way
        out += [("Which file in data is the largest?", ["ls -S data | head -n 1"], largest.split("/")[1]),
                ("What is the sum of the numbers in the largest file in data?",
                 ["ls -S data | head -n 1", "awk '{s += $1} END {print s}' data/{0}"], _total(files[largest]))]
    return out


class ShellTask(TurnDemonstrations):
    """Questions about a generated file tree; the model runs commands (``<bash>``) then answers."""

    name = "shell"

    def __init__(self, *, max_turns: int = 5, command_timeout_s: float = 2.0, max_observation_chars: int = 300,
                 n_train: int = 1000) -> None:
        if min(max_turns, max_observation_chars, n_train) < 1 or command_timeout_s <= 0:
            raise ValueError("max_turns, max_observation_chars and n_train must be at least 1, command_timeout_s > 0")
        self.max_turns, self.timeout_s = max_turns, command_timeout_s
        self.max_observation_chars, self.n_train = max_observation_chars, n_train
        self.limits = SandboxLimits(cpu_s=max(1.0, command_timeout_s), wall_s=command_timeout_s * (max_turns + 2) + 5,
                                    memory_mb=512, max_processes=32, max_file_mb=4,
                                    max_output_bytes=max(4096, 4 * max_observation_chars))

    @staticmethod
    def _item(answer: str) -> dict:
        try:
            item = json.loads(answer)
            int(item["seed"]), str(item["answer"]), list(item["commands"])
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise AnswerError("shell: the answer is not {seed, commands, answer} JSON; write the dataset with "
                              "write_shell_dataset") from None
        return item

    def run(self, seed: int, before: list[str], command: str) -> str:
        """``command``'s output in a fresh tree ``seed`` after ``before`` (output as the model reads it)."""
        spec = {"files": file_tree(seed), "before": before, "command": command, "timeout_s": self.timeout_s,
                "max_chars": self.max_observation_chars}
        result = run_python(_RUNNER, stdin=json.dumps(spec), limits=self.limits)
        if "guard-fs" in result.isolation:
            raise SandboxError("the shell task runs commands with exec, which the sandbox refuses on a machine without "
                               "Landlock (Linux 5.13+): run its workers on such a kernel")
        if result.timed_out:
            return TIMED_OUT
        if result.returncode != 0:
            raise SandboxError(f"the shell runner failed (exit {result.returncode}): {result.stderr[-500:]}")
        return result.stdout[: self.max_observation_chars]

    def episode(self, prompt: str, answer: str) -> ShellEpisode:
        return ShellEpisode(self, int(self._item(answer)["seed"]))

    def score(self, prompt: str, completion: str, answer: str) -> float:
        return answer_score(completion, self._item(answer)["answer"])

    @functools.lru_cache(maxsize=4096)  # noqa: B019 (a task lives as long as its worker)
    def demonstration_turns(self, answer: str) -> list[tuple[str, bool]]:
        """The reference episode as (text, the model's?) pieces: each command, its output, the answer."""
        item, parts, value, done = self._item(answer), [], "", []
        for command in item["commands"]:
            command = command.replace("{0}", value.strip())
            output = self.run(int(item["seed"]), done, command)
            parts += [(f"{BASH_OPEN}{command}{BASH_CLOSE}", True), (_output(output), False)]
            done.append(command)
            value = output
        return parts + [(f"<answer>{item['answer']}</answer>", True)]

    def write_example_dataset(self, out_dir: Path, config, *, seed: int) -> tuple[Path, Path]:
        """`rlbus prepare`'s data: ``n_train`` questions, ``config.n_heldout`` held out."""
        return write_shell_dataset(out_dir, n_train=self.n_train, n_heldout=config.n_heldout, seed=seed)


def _output(text: str) -> str:
    return f"\n<output>{text}</output>\n"


class ShellEpisode:
    """One episode's shell: the commands run so far (replayed before each new one)."""

    def __init__(self, task: ShellTask, seed: int) -> None:
        self.task, self.seed, self.commands = task, seed, []

    def observe(self, turn: str) -> Observation | None:
        return tagged_call(turn, "bash", self._run)

    def _run(self, command: str) -> str:
        output = self.task.run(self.seed, self.commands, command)
        if output != TIMED_OUT:  # replaying a command that ran out of time would only take that time again
            self.commands.append(command)
        return _output(output)


def write_shell_dataset(out_dir: Path, *, n_train: int, n_heldout: int, seed: int) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``heldout.jsonl``: one generated tree per row, each with one question;
    held-out trees come from seeds no train row uses."""

    def row(tree_seed: int, rng: random.Random) -> tuple[str, dict]:
        question, commands, value = rng.choice(questions(file_tree(tree_seed), rng))
        return (f"Files: logs/, data/, notes/ in the current directory.\nQuestion: {question}\n",
                {"seed": tree_seed, "commands": commands, "answer": value})

    return write_seeded_splits(out_dir, name="shell", n_train=n_train, n_heldout=n_heldout, seed=seed, row=row)
