"""The same loop with the weights in S3 (a SeaweedFS server over HTTP on loopback), ended by its wall budget."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.supervisor import EXIT_BUDGET
from tests.fixtures.s3 import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]


def test_a_run_on_an_s3_store_that_reaches_its_wall_budget_ends_with_its_results(
        s3_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:
    """Weights in S3, and a wall budget far short of the steps asked for: the run is stopped as `rlbus stop`
    stops it, its newest version (read from S3) is scored, summary and report say the budget ended it, the
    trainer's checkpoint holds the step it reached, and the exit status is neither a success nor a crash."""
    env = dict(
        os.environ,
        AWS_ENDPOINT_URL=s3_endpoint,
        AWS_ACCESS_KEY_ID=ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY,
        AWS_REGION=REGION,
        PYTHONUNBUFFERED="1",
    )
    store = f"s3://{s3_bucket}/runs/e2e"
    steps = 100_000  # never reached: the budget ends the run
    proc = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "run", str(ROOT / "configs/ci.toml"), "--store", store,
         "--set", f"local.dir={tmp_path}", "--set", f"trainer.max_steps={steps}", "--set", "local.workers=1",
         "--set", "local.max_wall_s=60"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )
    assert proc.returncode == EXIT_BUDGET, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "wall budget" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["ended"] == "wall_budget"
    reached = summary["policies"]["main"]["steps"]
    assert f"main at step {reached} of {steps}" in summary["ended_note"]
    newest = summary["versions_published"] - 1
    assert summary["reward_end_version"] == newest  # the final evaluation read the newest version from S3
    assert 0 <= summary["reward_end"] <= 1
    assert "stopped by its wall budget" in (run_dir / "report.html").read_text()
    newest_checkpoint = sorted((run_dir / "checkpoints" / "main").glob("v*/meta.json"))[-1]
    assert json.loads(newest_checkpoint.read_text())["extra"]["step"] == reached
    assert not (run_dir / "store").exists(), "weights must go to S3, not to a local directory"

    listing = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "weights", "ls", "--store", store],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert listing.returncode == 0, listing.stderr
    assert f"{newest:>7} delta" in listing.stdout or f"{newest:>7} anchor" in listing.stdout
    assert "<- LATEST" in listing.stdout
    verify = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "weights", "verify", "--store", store, "main"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert verify.returncode == 0, verify.stderr
    assert json.loads(verify.stdout)["ok"] is True
