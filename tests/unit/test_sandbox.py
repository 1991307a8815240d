"""The code task's sandbox: hostile programs end as failed samples, leave nothing running, and the
caller goes on; honest programs are scored by the fraction of tests they pass."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from producers.tasks import AnswerError
from producers.tasks.code import CodeTask, extract_program
from producers.tasks.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_s=2, wall_s=5, memory_mb=256, max_output_bytes=64 * 1024)
ADD = json.dumps({"asserts": ["assert f(1) == 2", "assert f(2) == 3", "assert f(0) == 1", "assert f(-1) == 5"]})


def _sandboxed_processes() -> list[int]:
    """Processes whose working directory is a sandbox's (the directory is gone once a run ends)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if "rlbus-sandbox-" in os.readlink(f"/proc/{pid}/cwd"):
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.mark.parametrize("program, why", [
    ("while True:\n    pass", "an infinite loop"),
    ("import os\nwhile True:\n    os.fork()", "a fork bomb"),
    ("x = bytearray(10**10)\nblocks = []\nwhile True:\n    blocks.append(bytearray(10**7))", "a memory bomb"),
    ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "a 1 GB print"),
])
def test_a_hostile_program_fails_and_leaves_nothing_running(program: str, why: str) -> None:
    result = run_python(program, "assert True", limits=LIMITS)
    assert not result.passed, why
    assert len(result.stdout) <= LIMITS.max_output_bytes
    assert _sandboxed_processes() == []
    assert os.waitpid(os.spawnv(os.P_NOWAIT, "/bin/true", ["true"]), 0)[1] == 0  # this process still forks


def test_a_write_outside_its_directory_fails(tmp_path: Path) -> None:
    target = tmp_path / "outside.txt"
    for program in (f"open({str(target)!r}, 'w').write('x')", f"import os\nos.rename('program.py', {str(target)!r})",
                    f"import shutil\nshutil.copy('program.py', {str(target)!r})"):
        assert not run_python(program, "assert True", limits=LIMITS).passed
        assert not target.exists(), program
    assert run_python("open('mine.txt', 'w').write('ok')", "assert open('mine.txt').read() == 'ok'", limits=LIMITS).passed


def test_a_network_attempt_never_reaches_a_server() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted: list[socket.socket] = []

    def accept() -> None:
        for _ in range(40):
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    watcher = threading.Thread(target=accept)
    watcher.start()
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}))\ns.sendall(b'leak')"
    result = run_python(program, "assert True", limits=LIMITS)
    watcher.join()
    server.close()
    assert not result.passed and accepted == []


def test_an_early_exit_does_not_pass_the_tests() -> None:
    assert not run_python("import os\nos._exit(0)", "assert False", limits=LIMITS).passed
    assert not run_python("import sys\nsys.exit(0)", "assert False", limits=LIMITS).passed


def test_the_score_is_the_fraction_of_tests_passed() -> None:
    task = CodeTask(cpu_s=2, wall_s=5, memory_mb=256)
    right = "Sure.\n```python\ndef f(x):\n    return x + 1\n```\n"
    half = "```python\ndef f(x):\n    return 0\n```\nNo, this:\n```python\ndef f(x):\n    return x + 1 if x >= 1 else 9\n```"
    assert task.score("", right, ADD) == 0.75  # f(-1) == 5 is wrong for x + 1
    assert task.score("", half, ADD) == 0.5  # the last block is the program
    assert task.score("", "def f(x) return", ADD) == 0.0  # a syntax error
    io = json.dumps({"io": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "11"}]})
    assert task.score("", "import sys\nprint(sum(map(int, sys.stdin.read().split())))", io) == 0.5
    assert task.score("", right, json.dumps(["assert f(1) == 2"])) == 1.0  # a bare list of asserts
    assert extract_program("no fences") == "no fences"


@pytest.mark.parametrize("answer, message", [
    ("not json", "must be JSON"), ("{}", "needs 'asserts'"), ('{"asserts": []}', "no tests"),
    ('{"asserts": [1]}', "list of strings"), ('{"io": [{"input": "1"}]}', "'io' must be"),
])
def test_unusable_tests_are_answer_errors(answer: str, message: str) -> None:
    with pytest.raises(AnswerError, match=message):
        CodeTask().score("", "print(1)", answer)
