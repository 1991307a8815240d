"""``code``: the completion's Python program, run against the item's tests in a sandbox.

``answer`` is JSON, one of:

* ``{"asserts": ["assert add(1, 2) == 3", ...], "setup": "optional code run before them"}``
  (MBPP/HumanEval style): each assert is one test, run after the program in the same process;
* ``{"io": [{"input": "stdin text", "output": "expected stdout"}, ...]}`` (APPS/CodeContests style):
  the program runs once per case with that stdin; a case passes when its stdout matches (trailing
  spaces per line and trailing blank lines ignored);
* a bare list of assert strings, shorthand for ``{"asserts": [...]}``.

The program is the completion's last fenced code block (```python ... ``` or ``` ... ```), else the
whole completion. Every test runs in its own sandboxed subprocess (``producers.tasks.sandbox``);
the reward is the fraction of tests passed. A program that hangs, forks, floods its output, eats
memory, writes outside its directory or opens a socket fails its tests; the worker goes on.
"""

from __future__ import annotations

import json
import re
from typing import Any

from producers.tasks import AnswerError
from producers.tasks.sandbox import SandboxLimits, run_python

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.S | re.I)


def extract_program(completion: str) -> str:
    """The last fenced code block of ``completion``, else the completion itself."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


class CodeTask:
    """Fraction of the item's tests the completion's program passes."""

    name = "code"

    def __init__(self, *, cpu_s: int = 5, wall_s: float = 10.0, memory_mb: int = 512,
                 max_output_bytes: int = 1 << 20, max_tests: int = 50) -> None:
        if max_tests < 1:
            raise ValueError("max_tests must be at least 1")
        self.limits = SandboxLimits(cpu_s=cpu_s, wall_s=wall_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
        self.max_tests = max_tests

    def tests(self, answer: str) -> tuple[str, list[str], list[dict[str, str]]]:
        """(setup, asserts, io cases) of an item; ``AnswerError`` names what is wrong."""
        try:
            spec: Any = json.loads(answer)
        except json.JSONDecodeError:
            raise AnswerError("code: the answer must be JSON tests: {\"asserts\": [...]} or {\"io\": [...]}") from None
        if isinstance(spec, list):
            spec = {"asserts": spec}
        if not isinstance(spec, dict) or not ({"asserts", "io"} & set(spec)):
            raise AnswerError("code: the answer JSON needs 'asserts' (a list of assert statements) or 'io' (a list of "
                              "{input, output})")
        asserts, io, setup = spec.get("asserts", []), spec.get("io", []), spec.get("setup", "")
        if not isinstance(asserts, list) or not all(isinstance(a, str) for a in asserts):
            raise AnswerError("code: 'asserts' must be a list of strings")
        if not isinstance(io, list) or not all(isinstance(c, dict) and isinstance(c.get("input", ""), str)
                                               and isinstance(c.get("output"), str) for c in io):
            raise AnswerError("code: 'io' must be a list of {\"input\": str, \"output\": str}")
        if not isinstance(setup, str):
            raise AnswerError("code: 'setup' must be a string of code")
        if not asserts and not io:
            raise AnswerError("code: the item has no tests")
        return setup, asserts[: self.max_tests], io[: self.max_tests]

    def score(self, prompt: str, completion: str, answer: str) -> float:
        setup, asserts, io = self.tests(answer)
        program = extract_program(completion)
        passed = 0
        for test in asserts:
            passed += run_python(program, f"{setup}\n{test}\n", limits=self.limits).passed
        for case in io:
            result = run_python(program, stdin=case.get("input", ""), limits=self.limits)
            passed += result.passed and _lines(result.stdout) == _lines(case["output"])
        return passed / (len(asserts) + len(io))
