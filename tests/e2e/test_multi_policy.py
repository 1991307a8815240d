"""`rlbus run configs/solver_verifier.toml`, cut short: two policies, each with its own topic,
trainer and weight chain; a worker attached by hand with --workflow (the run's only worker) is seen
by both trainers, and stops by itself when both have finished."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_run import _cli
from tests.fixtures.helpers import wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).parents[2]
STEPS = 30
POLICIES = ("solver", "verifier")


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


@pytest.fixture(scope="module")
def finished(tmp_path_factory: pytest.TempPathFactory) -> dict:
    runs = tmp_path_factory.mktemp("runs")
    log = runs / "run.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    sets = [f"local.dir={runs}", "local.workers=0", f"trainer.max_steps={STEPS}", "trainer.groups_per_step=8",
            "kafka.session_timeout_ms=6000", "kafka.heartbeat_interval_ms=1000"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(_cli("run", str(ROOT / "configs/solver_verifier.toml"),
                                     *[arg for s in sets for arg in ("--set", s)]),
                                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        text = lambda: log.read_text(errors="replace")  # noqa: E731
        broker = wait_for(lambda: re.search(r"broker at (\S+)", text()), 120, "the broker address").group(1)
        run_dir = Path(wait_for(lambda: re.search(r"directory (\S+)", text()), 10, "the run dir").group(1))
        metrics = {p: run_dir / ("metrics.jsonl" if p == "solver" else f"metrics.{p}.jsonl") for p in POLICIES}
        wait_for(lambda: (run_dir / "store" / "rlbus-run.json").exists() or proc.poll() is not None, 600,
                 "the run descriptor in the store")
        with open(runs / "hand-worker.log", "wb") as out:
            hand = subprocess.Popen(_cli("worker", "--broker", broker, "--store", str(run_dir / "store"), "--id",
                                         "hand-1", "--workflow", "solve", "--set", "kafka.session_timeout_ms=6000"),
                                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        try:
            rc = proc.wait(timeout=900)
            hand_rc = hand.wait(timeout=120)  # the run's end reaches it on the control topic
        finally:
            if hand.poll() is None:
                hand.send_signal(signal.SIGKILL)
                hand.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log.read_text()[-5000:]
    assert hand_rc == 0, (runs / "hand-worker.log").read_text()[-3000:]
    return {"run_dir": run_dir, "summary": json.loads((run_dir / "summary.json").read_text()),
            "metrics": {p: _rows(m) for p, m in metrics.items()}}


def test_each_policy_has_its_own_trainer_and_chain(finished: dict) -> None:
    s, run_dir = finished["summary"], finished["run_dir"]
    assert set(s["policies"]) == set(POLICIES)
    assert s["reward_start"] == s["policies"]["solver"]["reward_start"]  # top-level keys: the first policy
    for policy in POLICIES:
        p, rows = s["policies"][policy], finished["metrics"][policy]
        assert p["versions_published"] == STEPS + 1 and p["groups_trained"] == STEPS * 8
        assert {r["policy"] for r in rows} == {policy}
        # Its trainer read only its own topic: a group of the other policy there would be rejected.
        assert rows[-1]["groups_rejected"] == 0
        verify = subprocess.run(_cli("weights", "verify", "--store", str(run_dir / "store"), policy),
                                capture_output=True, text=True, cwd=ROOT)
        assert verify.returncode == 0, verify.stdout + verify.stderr
    listing = subprocess.run(_cli("weights", "ls", "--store", str(run_dir / "store")), capture_output=True, text=True,
                             cwd=ROOT)
    assert "policy solver" in listing.stdout and "policy verifier" in listing.stdout
    assert (run_dir / "logs" / "trainer-solver.log").exists() and (run_dir / "logs" / "trainer-verifier.log").exists()
    assert (run_dir / "reward.png").stat().st_size > 1000


def test_a_worker_attached_by_hand_is_seen_by_both_trainers(finished: dict) -> None:
    for policy in POLICIES:
        assert any("hand-1" in r["workers_seen"] for r in finished["metrics"][policy]), policy
