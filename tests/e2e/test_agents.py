"""Multi-turn environments through the whole loop: `rlbus run` of the text-game and SQL configs, cut
short: episodes played by the workers, their turns carried in the records, the step_credit stage's
graph at the trainer, and held-out scores of whole episodes before and after."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]


def _run(config: str, tmp_path: Path, *sets: str) -> Path:
    args = [sys.executable, "-m", "rlbus.cli", "run", str(ROOT / "configs" / config), "--set", f"local.dir={tmp_path}",
            "--set", "local.unique_suffix=false", "--set", "trainer.max_steps=6", "--set", "trainer.groups_per_step=4",
            "--set", "example.n_heldout=16", *(x for s in sets for x in ("--set", s))]
    done = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return next(p for p in tmp_path.iterdir() if (p / "summary.json").exists())


def _check(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["turns_mean"] is not None and r["turns_mean"] >= 1 for r in rows)
    last = rows[-1]
    # The groups that passed dynamic sampling went through the graph (groups trained because the stages
    # dropped too many carry no advantage to spread); its nodes are at most its steps.
    assert 0 < last["stage/step_credit/modified_samples"] <= 6 * 4 * 8
    assert 0 < last["stage/step_credit/nodes"] <= last["stage/step_credit/steps"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["reward_start"] is not None and summary["reward_end"] is not None
    return rows


@pytest.mark.skipif(shutil.which("java") is None, reason="no Java runtime for TextWorldExpress")
def test_text_games_train_through_the_loop_with_step_credit(tmp_path: Path) -> None:
    params = {"max_turns": 8, "brief": True, "n_train": 64,
              "games": [{"name": "coin", "params": {"numLocations": 4, "numDistractorItems": 0, "includeDoors": 0}}]}
    rows = _check(_run("textgame.toml", tmp_path, f"run.task_params={json.dumps(params)}",
                       "example.warmup.max_steps=60"))
    assert max(r["turns_mean"] for r in rows) > 1  # games of several commands


def test_sql_questions_train_through_the_loop_with_step_credit(tmp_path: Path) -> None:
    _check(_run("sql.toml", tmp_path, 'run.task_params={"max_turns": 4, "n_train": 200}',
                "example.warmup.max_steps=40"))
