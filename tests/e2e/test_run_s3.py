"""The same loop with the weights in S3 (a SeaweedFS server over HTTP on loopback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures.s3 import ACCESS_KEY_ID, REGION, SECRET_ACCESS_KEY

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]


def test_run_with_an_s3_store(s3_endpoint: str, s3_bucket: str, tmp_path: Path) -> None:
    env = dict(
        os.environ,
        AWS_ENDPOINT_URL=s3_endpoint,
        AWS_ACCESS_KEY_ID=ACCESS_KEY_ID,
        AWS_SECRET_ACCESS_KEY=SECRET_ACCESS_KEY,
        AWS_REGION=REGION,
        PYTHONUNBUFFERED="1",
    )
    store = f"s3://{s3_bucket}/runs/e2e"
    steps = 6
    proc = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "run", str(ROOT / "configs/ci.toml"), "--store", store,
         "--set", f"local.dir={tmp_path}", "--set", f"trainer.max_steps={steps}", "--set", "local.workers=1"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions_published"] == steps + 1
    assert summary["reward_end_version"] == steps  # the final evaluation read the newest version from S3
    assert not (run_dir / "store").exists(), "weights must go to S3, not to a local directory"

    listing = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "weights", "ls", "--store", store],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert listing.returncode == 0, listing.stderr
    assert f"{steps:>7} delta" in listing.stdout or f"{steps:>7} anchor" in listing.stdout
    assert "<- LATEST" in listing.stdout
    verify = subprocess.run(
        [sys.executable, "-m", "rlbus.cli", "weights", "verify", "--store", store, "main"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=120,
    )
    assert verify.returncode == 0, verify.stderr
    assert json.loads(verify.stdout)["ok"] is True
