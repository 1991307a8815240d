"""The live panel of `rlbus run`: what it shows per policy, and when the run prints lines instead."""

from __future__ import annotations

import io
import json
import sys
import time

from rich.console import Console
from typer.testing import CliRunner

from rlbus.config import RunConfig
from rlbus.report.live import LagPoller, LiveProgress, PlainProgress, PolicyFigures, build_progress, render_panel


def _row(step: int, *, reward: float = 0.5, t: float | None = None, **extra) -> dict:
    return {"policy": "main", "version": step, "step": step, "reward_mean": reward,
            "time": 1000.0 + step if t is None else t, "wait_s": 0.25, "step_wall_s": 1.0, "live_workers": 2,
            "queued": 3, "groups_dropped_stale": 1, "publish_bytes": 140_213, "publish_kind": "delta", **extra}


def _text(renderable) -> str:
    console = Console(record=True, width=120, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


def _cells(text: str, policy: str) -> list[str]:
    """The words of the panel's row of ``policy``."""
    lines = [line.strip("│ ").split() for line in text.splitlines()]
    found = [words for words in lines if words and words[0] == policy]
    assert len(found) == 1, text
    return found[0]


def test_one_policy_shows_step_rewards_heldout_eta_fleet_and_delta() -> None:
    rows = [_row(s, reward=0.5 + s / 1000, t=1000.0 + 0.5 * s) for s in range(1, 401)]
    text = _text(render_panel("demo", [PolicyFigures("main", 900, 0.31)], {"main": rows}, {"main": 12}))
    mean = sum(0.5 + s / 1000 for s in range(381, 401)) / 20
    # 500 steps left at 2 steps/s over the last 20 rows: 4m10s.
    assert _cells(text, "main") == ["main", "400/900", "0.900", f"{mean:.3f}", "0.310", "v0", "4m10s", "2", "25%",
                                    "3", "12", "1", "140.2", "kB"]
    assert "rlbus run demo" in text


def test_two_policies_one_row_each_and_the_latest_heldout_score() -> None:
    solver = [_row(s) for s in range(1, 11)]
    verifier = [_row(1, heldout_accuracy=0.4), _row(2, heldout_accuracy=0.52), _row(3, wait_s=0.0)]
    text = _text(render_panel("demo", [PolicyFigures("solver", 100, 0.3), PolicyFigures("verifier", 50, 0.2)],
                              {"solver": solver, "verifier": verifier}, {"solver": 0, "verifier": 7}))
    assert _cells(text, "solver")[:7] == ["solver", "10/100", "0.500", "0.500", "0.300", "v0", "1m30s"]
    assert _cells(text, "verifier")[:6] == ["verifier", "3/50", "0.500", "0.500", "0.520", "v2"]
    assert _cells(text, "verifier")[10] == "7"  # its own lag


def test_lag_unknown_shows_a_question_mark_and_unmeasured_a_dash() -> None:
    figures = [PolicyFigures("a", 10, None), PolicyFigures("b", 10, None)]
    text = _text(render_panel("demo", figures, {"a": [_row(1)], "b": [_row(1)]}, {"a": None}))
    assert _cells(text, "a")[9] == "?"
    assert _cells(text, "b")[9] == "-"
    assert _cells(text, "a")[4] == "-"  # no held-out score measured


def test_eta_from_the_recent_step_rate_then_done() -> None:
    fig = [PolicyFigures("main", 1000, 0.3)]
    slow_then_fast = [_row(s, t=10.0 * s) for s in range(1, 100)] + [_row(s, t=990 + 0.1 * s) for s in range(100, 121)]
    assert _cells(_text(render_panel("d", fig, {"main": slow_then_fast}, {})), "main")[6] == "1m28s"  # 880 × 0.1 s
    assert _cells(_text(render_panel("d", fig, {"main": [_row(5)]}, {})), "main")[6] == "?"  # one row: no rate yet
    finished = [_row(999), _row(1000)]
    assert _cells(_text(render_panel("d", fig, {"main": finished}, {})), "main")[6] == "done"
    assert _cells(_text(render_panel("d", fig, {}, {})), "main")[:3] == ["main", "0/1000", "-"]


def test_delta_is_the_latest_delta_not_an_anchor() -> None:
    rows = [_row(1, publish_bytes=2_000), _row(2, publish_bytes=1_060_000, publish_kind="anchor")]
    text = _text(render_panel("d", [PolicyFigures("main", 10, 0.3)], {"main": rows}, {}))
    assert _cells(text, "main")[-2:] == ["2.0", "kB"]


def test_a_narrow_terminal_hides_the_least_needed_columns_and_says_so() -> None:
    figures, rows = [PolicyFigures("main", 900, 0.3)], {"main": [_row(s) for s in range(1, 30)]}
    wide, narrow = (Console(record=True, width=w, file=io.StringIO()) for w in (120, 80))
    for console in (wide, narrow):
        console.print(render_panel("demo", figures, rows, {"main": 4}))
    wide_text, narrow_text = wide.export_text(), narrow.export_text()
    assert "mean" in _header(wide_text) and "hidden" not in wide_text
    assert _header(narrow_text) == ["policy", "step", "reward", "held-out", "ETA", "workers", "wait", "lag", "delta"]
    assert _cells(narrow_text, "main") == ["main", "29/900", "0.500", "0.300", "v0", "14m31s", "2", "25%", "4", "140.2",
                                           "kB"]
    assert "hidden (narrow terminal): mean, stale, queued" in " ".join(narrow_text.replace("│", "").split())
    assert max(len(line) for line in narrow_text.splitlines()) <= 80


def _header(text: str) -> list[str]:
    return next(line.strip("│ ").split() for line in text.splitlines() if "policy" in line)


def test_plain_lines_when_stdout_is_not_a_terminal(tmp_path, monkeypatch, capsys) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("TERM", "xterm")
    cfg, prep = RunConfig(), {"policies": {"main": {"reward_start": 0.3}}}
    files = {"main": tmp_path / "metrics.jsonl"}
    assert isinstance(build_progress(cfg, prep, files, plain=False, stdout=Tty()), LiveProgress)
    assert isinstance(build_progress(cfg, prep, files, plain=True, stdout=Tty()), PlainProgress)
    plain = build_progress(cfg, prep, files, plain=False, stdout=io.StringIO())
    assert isinstance(plain, PlainProgress)
    files["main"].write_text(json.dumps(_row(1, tokens_per_s=900.0, wall_s=1.0)) + "\n")
    with plain:
        plain.poll()
    assert capsys.readouterr().out.splitlines()[1].split() == ["1", "0.500", "1", "900", "2", "140213", "1.0"]


def test_live_panel_tails_the_file_keeps_the_heldout_score_and_prints_warnings_above(tmp_path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(_row(s, **({"heldout_accuracy": 0.7} if s == 2 else {}))) + "\n"
                            for s in range(1, 31)) + '{"partial')
    out = io.StringIO()
    lag = LagPoller(lambda policy: {0: 2, 1: 3}, ["main"], interval_s=60)
    progress = LiveProgress("demo", [PolicyFigures("main", 100, 0.3)], {"main": path}, lag,
                            console=Console(file=out, force_terminal=True, width=120))
    with progress:
        deadline = time.monotonic() + 10
        while not lag.snapshot() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("warning: worker-1 exited with -9", file=sys.stderr)
        progress.poll()
    screen = out.getvalue()
    assert "warning: worker-1 exited with -9" in screen
    final = screen[screen.rindex("rlbus run demo"):]  # the last panel drawn
    # The held-out score of step 2 is shown though the window holds steps 11-30; lag 2 + 3.
    assert _cells(final, "main") == ["main", "30/100", "0.500", "0.500", "0.700", "v2", "1m10s", "2", "25%", "3", "5",
                                     "1", "140.2", "kB"]


def test_lag_poller_reports_a_failed_read_as_unknown() -> None:
    calls = []

    def measure(policy: str) -> dict[int, int]:
        calls.append(policy)
        raise RuntimeError("broker down")

    lag = LagPoller(measure, ["main"], interval_s=60)
    lag.start()
    deadline = time.monotonic() + 10
    while "main" not in lag.snapshot() and time.monotonic() < deadline:
        time.sleep(0.01)
    lag.stop()
    assert lag.snapshot() == {"main": None} and calls == ["main"]


def test_run_offers_plain() -> None:
    from rlbus.cli import app

    help_text = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200", "NO_COLOR": "1"}).output
    assert "--plain" in help_text


def test_dumb_terminal_gets_lines(tmp_path, monkeypatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setenv("TERM", "dumb")
    progress = build_progress(RunConfig(), {"policies": {"main": {"reward_start": 0.3}}},
                              {"main": tmp_path / "m.jsonl"}, plain=False, stdout=Tty())
    assert isinstance(progress, PlainProgress)
