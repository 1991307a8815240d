"""The code task and its sandbox: hostile programs end as failed samples, leave nothing running and
the caller goes on; honest programs score the fraction of tests they pass; unusable tests are
answer errors."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from producers.tasks import AnswerError, load_task
from producers.tasks.code import CodeTask, extract_program
from producers.tasks.sandbox import SandboxLimits, run_python

LIMITS = SandboxLimits(cpu_s=1, wall_s=4, memory_mb=256, max_output_bytes=64 * 1024)
PARAMS = dataclasses.asdict(LIMITS)
RUNS_TO_THE_END = json.dumps(["assert True"])
"""Tests any program passes if it ends normally: a hostile one must score 0 against them."""
PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture
def orphans() -> Iterator[Callable[[], list[int]]]:
    """Makes this process the subreaper of what it starts, so any process a run leaves behind
    becomes its child, whatever session or group it moved to; yields the function that lists them."""
    libc = ctypes.CDLL(None, use_errno=True)
    before = set(_live_children())  # children of this test process already (a session's broker...)

    def new_children() -> list[int]:
        return [pid for pid in _live_children() if pid not in before]

    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    try:
        yield new_children
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        for pid in new_children():  # only what a run left behind: never the session's own processes
            os.kill(pid, 9)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)


def _live_children() -> list[int]:
    found = []
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/stat") as f:
                state, ppid = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:
            continue
        if int(ppid) == os.getpid() and state != "Z":
            found.append(int(name))
    return found


def _still_forks() -> bool:
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7


HOSTILE = {
    "an infinite loop": "while True:\n    pass",
    "a sleeper": "import time\ntime.sleep(600)",
    "a fork bomb": "import os\nwhile True:\n    os.fork()",
    "a fork bomb that leaves its session": "import os, time\nwhile True:\n    if os.fork() == 0:\n        os.setsid()",
    "a huge allocation": "x = bytearray(10**10)",
    "a growing list": "blocks = []\nwhile True:\n    blocks.append(bytearray(10**6))",
    "a 1 GB print": "for _ in range(10**5):\n    print('x' * 10**4)",
}


@pytest.mark.parametrize("why", HOSTILE)
def test_a_hostile_program_scores_zero_and_leaves_nothing_running(why: str, orphans) -> None:
    assert CodeTask(**PARAMS).score("", HOSTILE[why], RUNS_TO_THE_END) == 0.0, why
    assert orphans() == [], why
    assert _still_forks()


def test_output_past_the_cap_is_cut_and_the_run_killed(orphans) -> None:
    result = run_python(HOSTILE["a 1 GB print"], limits=LIMITS)
    assert result.output_truncated and not result.ok
    assert 0 < len(result.stdout) <= LIMITS.max_output_bytes
    assert orphans() == []


def test_a_hanging_program_times_out() -> None:
    result = run_python(HOSTILE["a sleeper"], limits=LIMITS)
    assert result.timed_out and result.killed_by_signal == 9 and not result.ok


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "guard only"])
def test_a_write_outside_its_directory_fails(tmp_path: Path, isolate: bool) -> None:
    target = tmp_path / "outside.txt"
    task = CodeTask(isolate=isolate, **PARAMS)
    for program in (f"open({str(target)!r}, 'w').write('x')",
                    f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')",
                    f"import os\nopen('mine', 'w').close()\nos.rename('mine', {str(target)!r})",
                    f"import shutil\nopen('mine', 'w').close()\nshutil.copy('mine', {str(target)!r})"):
        assert task.score("", program, RUNS_TO_THE_END) == 0.0, program
        assert not target.exists(), program
    inside = "open('mine.txt', 'w').write('ok')\nassert open('mine.txt').read() == 'ok'"
    assert task.score("", inside, RUNS_TO_THE_END) == 1.0


@pytest.mark.parametrize("isolate", [True, False], ids=["isolated", "guard only"])
def test_a_network_attempt_never_reaches_a_server(isolate: bool) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        io = json.dumps({"io": [{"input": "", "output": "connected"}]})
        assert CodeTask(isolate=isolate, **PARAMS).score("", program, io) == 0.0
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # no connection is waiting to be accepted
            server.accept()


def test_the_callers_environment_does_not_reach_the_program(monkeypatch) -> None:
    monkeypatch.setenv("RLBUS_SECRET", "s3cr3t")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    result = run_python("import os\nprint(sorted(os.environ))", limits=LIMITS)
    assert result.ok and "RLBUS" not in result.stdout and "AWS" not in result.stdout


ADD_ONE = json.dumps({"asserts": ["assert f(1) == 2", "assert f(2) == 3", "assert f(0) == 1", "assert f(-1) == 0"]})


def test_the_score_is_the_fraction_of_asserts_passed() -> None:
    task = CodeTask(**PARAMS)
    assert task.score("", "Sure.\n```python\ndef f(x):\n    return x + 1\n```\nDone.", ADD_ONE) == 1.0
    half = "```python\ndef f(x):\n    return 0\n```\nNo, this:\n```\ndef f(x):\n    return x + 1 if x > 0 else 7\n```"
    assert task.score("", half, ADD_ONE) == 0.5  # the last block is the program
    assert task.score("", "def f(x) return x + 1", ADD_ONE) == 0.0  # a syntax error
    assert task.score("", "def f(x):\n    return x + 1", json.dumps(["assert f(1) == 2"])) == 1.0  # a bare list
    with_setup = json.dumps({"setup": "g = lambda x: f(x) * 2", "asserts": ["assert g(1) == 4", "assert g(2) == 0"]})
    assert task.score("", "def f(x):\n    return x + 1", with_setup) == 0.5
    broken_setup = json.dumps({"setup": "raise ValueError", "asserts": ["assert True"]})
    assert task.score("", "def f(x):\n    return x", broken_setup) == 0.0


@pytest.mark.parametrize("program", ["import os\nos._exit(0)", "import sys\nsys.exit(0)",
                                     "import sys\ndef f(x):\n    sys.exit(0)",
                                     "import builtins\nbuiltins.exec = lambda *a, **k: None\ndef f(x):\n    return None"])
def test_a_program_that_dodges_its_asserts_passes_none(program: str) -> None:
    assert CodeTask(**PARAMS).score("", program, ADD_ONE) == 0.0


def test_io_cases_compare_stdout_and_need_a_clean_exit() -> None:
    task = CodeTask(**PARAMS)
    adder = "```python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())), ' ')\n\n```"
    cases = json.dumps({"io": [{"input": "1 2\n", "output": "3\n\n"}, {"input": "5 5", "output": "10"},
                               {"input": "2 2", "output": "5"}, {"output": "0"}]})
    assert task.score("", adder, cases) == 0.75  # 2 + 2 is not 5
    crasher = "import sys\nprint(sum(map(int, sys.stdin.read().split())))\nraise SystemExit(3)"
    assert task.score("", crasher, cases) == 0.0


def test_tasks_score_from_several_threads_at_once() -> None:
    task = CodeTask(**PARAMS)
    programs = ["def f(x):\n    return x + 1", "def f(x):\n    return 0"] * 4
    with ThreadPoolExecutor(4) as pool:
        scores = list(pool.map(lambda p: task.score("", p, ADD_ONE), programs))
    assert scores == [1.0, 0.25] * 4


def test_extract_program() -> None:
    assert extract_program("no fences at all") == "no fences at all"
    assert extract_program("a\n```py\none\n```\nb\n```python\ntwo\n```\n") == "two\n"
    assert extract_program("```python\ncut off by max_tokens") == "cut off by max_tokens"


@pytest.mark.parametrize("answer, problem", [
    ("not json", "must be JSON"),
    ("{}", "asserts: Field required"),
    ('{"asserts": []}', "at least 1 item"),
    ("[]", "at least 1 item"),
    ('{"io": []}', "at least 1 item"),
    ('{"asserts": [1]}', "asserts.0: Input should be a valid string"),
    ('{"io": [{"input": "1"}]}', "io.0.output: Field required"),
    ('{"asserts": ["assert True"], "io": []}', "Extra inputs are not permitted"),
    ('"assert True"', "a JSON str, not tests"),
])
def test_unusable_tests_are_answer_errors(answer: str, problem: str) -> None:
    with pytest.raises(AnswerError, match=problem):
        CodeTask().score("", "print(1)", answer)


@pytest.mark.parametrize("params, problem", [
    ({"cpu_s": 0}, "cpu_s=0"), ({"memory_mb": "lots"}, "memory_mb='lots'"), ({"max_tests": 0}, "max_tests=0"),
    ({"wall": 3}, r"unknown parameter\(s\) \['wall'\]"), ({"isolate": "yes"}, "isolate='yes'"),
])
def test_bad_limits_are_refused_with_the_field_named(params: dict, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        CodeTask(**params)


def test_the_run_config_builds_the_task() -> None:
    task = load_task("producers.tasks.code:CodeTask", {"wall_s": 5, "cpu_s": 2})
    assert task.name == "code" and task.score("", "def f(x):\n    return x + 1", ADD_ONE) == 1.0


def test_a_program_runs_at_most_max_processes_at_once() -> None:
    program = ("import os, time\nstarted = 0\ntry:\n    while started < 50:\n        if os.fork() == 0:\n"
               "            time.sleep(60)\n        started += 1\nexcept OSError:\n    pass\nprint(started)")
    result = run_python(program, limits=SandboxLimits(cpu_s=1, wall_s=4, memory_mb=256, max_processes=4))
    if "nproc" not in result.isolation:
        pytest.skip(f"no process limit on this machine (layers: {sorted(result.isolation)})")
    assert result.ok and result.stdout.split() == ["3"]  # the program and 3 children
