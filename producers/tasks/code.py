"""``code``: the completion's Python program, run against the item's tests in a sandbox.

``answer`` is a JSON document, one of:

* ``{"asserts": ["assert add(1, 2) == 3", ...], "setup": "optional code run before the asserts"}``
  (MBPP/HumanEval style): each assert is one test, run after the program, in its namespace;
* ``{"io": [{"input": "stdin text", "output": "expected stdout"}, ...]}`` (APPS/CodeContests style):
  the program runs once per case with that stdin; a case passes when the program exits with status
  0 and its stdout matches, trailing whitespace of each line and trailing blank lines ignored;
* a bare list of assert strings, shorthand for ``{"asserts": [...]}``.

The program is the completion's last fenced code block (```python ... ``` or ``` ... ```; an
unclosed last fence runs to the end), else the whole completion. The reward is the fraction of
tests passed. All asserts of a sample share one sandboxed process (``producers.tasks.sandbox``):
if the setup fails, or the program fails before its asserts run, every assert fails; io cases get
one process each, so a program that hangs costs up to ``min(cases, max_tests) * wall_s``. A program
that hangs, forks, floods its output, eats memory, writes outside its directory or opens a socket
fails its tests; the worker goes on. A bad ``answer`` raises ``AnswerError`` (the prompt goes to
the DLQ).
"""

from __future__ import annotations

import json
import re
from dataclasses import fields
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producers.tasks import AnswerError
from producers.tasks.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```[^\n`]*\n(.*?)(?:```|\Z)", re.S)
_FORMS = 'write {"asserts": ["assert f(1) == 2", ...]}, {"io": [{"input": "...", "output": "..."}]} or a list of asserts'


class AssertTests(BaseModel):
    """Statements run after the program, in its namespace; each that does not raise is a pass."""

    model_config = ConfigDict(extra="forbid", strict=True)

    asserts: list[str] = Field(min_length=1, description="One test each, e.g. 'assert add(1, 2) == 3'.")
    setup: str = Field(default="", description="Code run after the program and before the asserts.")


class IoCase(BaseModel):
    """One run of the program: its stdin and the stdout it must print."""

    model_config = ConfigDict(extra="forbid", strict=True)

    input: str = Field(default="", description="The program's stdin.")
    output: str = Field(description="Expected stdout (trailing whitespace per line and trailing blank lines ignored).")


class IoTests(BaseModel):
    """Stdin/stdout cases, one run each."""

    model_config = ConfigDict(extra="forbid", strict=True)

    io: list[IoCase] = Field(min_length=1, description="The cases.")


def parse_tests(answer: str) -> AssertTests | IoTests:
    """The tests an item's ``answer`` holds; ``AnswerError`` says what is wrong with it."""
    try:
        doc: Any = json.loads(answer)
    except json.JSONDecodeError as exc:
        raise AnswerError(f"code task: the answer must be JSON tests ({exc}); {_FORMS}") from None
    if isinstance(doc, list):
        doc = {"asserts": doc}
    if not isinstance(doc, dict):
        raise AnswerError(f"code task: the answer is a JSON {type(doc).__name__}, not tests; {_FORMS}")
    try:
        return (IoTests if "io" in doc else AssertTests).model_validate(doc)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'answer'}: {e['msg']}" for e in exc.errors())
        raise AnswerError(f"code task: unusable tests in the answer ({problems}); {_FORMS}") from None


def extract_program(completion: str) -> str:
    """The last fenced code block of ``completion``, else the completion itself."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def same_output(actual: str, expected: str) -> bool:
    """Equal up to trailing whitespace on each line and trailing blank lines."""
    def lines(text: str) -> list[str]:
        kept = [line.rstrip() for line in text.splitlines()]
        while kept and not kept[-1]:
            kept.pop()
        return kept

    return lines(actual) == lines(expected)


class CodeTask:
    """Fraction of the item's tests the completion's program passes.

    Keyword params: ``max_tests`` (tests run per item, the first ones; default 50), ``isolate``
    (False drops namespaces, Landlock and the uid change for machines where they misbehave; the
    rlimits and the audit-hook guard remain) and the fields of ``SandboxLimits`` (``cpu_s``,
    ``wall_s``, ``memory_mb``, ``max_output_bytes``, ``max_processes``, ``max_file_mb``).
    """

    name = "code"

    def __init__(self, *, max_tests: int = 50, isolate: bool = True, **limits: Any) -> None:
        known = [f.name for f in fields(SandboxLimits)]
        unknown = sorted(set(limits) - set(known))
        if unknown:
            raise ValueError(f"code task: unknown parameter(s) {unknown}; known: max_tests, isolate, {', '.join(known)}")
        if isinstance(max_tests, bool) or not isinstance(max_tests, int) or max_tests < 1:
            raise ValueError(f"code task: max_tests={max_tests!r}; give a whole number >= 1")
        if not isinstance(isolate, bool):
            raise ValueError(f"code task: isolate={isolate!r}; give true or false")
        self.limits = SandboxLimits(**limits)
        self.max_tests, self.isolate = max_tests, isolate

    def score(self, prompt: str, completion: str, answer: str) -> float:
        tests = parse_tests(answer)
        program = extract_program(completion)
        if isinstance(tests, IoTests):
            cases = tests.io[: self.max_tests]
            return sum(self._passes(program, case) for case in cases) / len(cases)
        asserts = tests.asserts[: self.max_tests]
        checks = [tests.setup, *asserts] if tests.setup else asserts
        passed = run_python(program, checks=checks, limits=self.limits, isolate=self.isolate).passed_checks
        if tests.setup:  # index 0 is the setup: without it no assert counts
            passed = frozenset(i - 1 for i in passed if i) if 0 in passed else frozenset()
        return len(passed) / len(asserts)

    def _passes(self, program: str, case: IoCase) -> bool:
        result = run_python(program, stdin=case.input, limits=self.limits, isolate=self.isolate)
        return result.ok and same_output(result.stdout, case.output)
