"""`rlbus run` with vLLM as the rollout engine (its CPU build, which `make` installs): the run's
own worker and one attached by hand with `--set engine.type=vllm` generate through vLLM, follow
every published version through its weight updates, and the policy gains on held-out prompts."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.e2e.test_run import ROOT, _cli
from tests.fixtures.helpers import wait_for
from tests.unit.test_engine_contract import _vllm_or_skip

pytestmark = pytest.mark.e2e

VLLM = ["--set", "engine.type=vllm", "--set", "engine.enforce_eager=true"]


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    _vllm_or_skip()
    runs = tmp_path_factory.mktemp("vllm-runs")
    log = runs / "run.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _cli("run", str(ROOT / "configs/ci.toml"), "--set", f"local.dir={runs}", "--set", "local.workers=1",
                 "--set", "trainer.max_steps=200", "--set", "intake.rescore=count", *VLLM),
            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
        )
    hand = None
    try:
        text = lambda: log.read_text(errors="replace")  # noqa: E731
        broker = wait_for(lambda: re.search(r"broker at (\S+)", text()), 120, "the broker address").group(1)
        run_dir = Path(wait_for(lambda: re.search(r"directory (\S+)", text()), 10, "the run dir").group(1))
        wait_for(lambda: (run_dir / "metrics.jsonl").exists() or proc.poll() is not None, 400, "the first step")
        hand_log = runs / "hand-worker.log"
        with open(hand_log, "wb") as out:
            hand = subprocess.Popen(_cli("worker", "--broker", broker, "--store", str(run_dir / "store"),
                                         "--id", "hand-vllm", *VLLM),
                                    stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        rc = proc.wait(timeout=900)
        hand.wait(timeout=120)  # the run's end tells attached workers to stop
    finally:
        for p in (proc, hand):
            if p is not None and p.poll() is None:
                p.kill()
    assert rc == 0, text()[-5000:]
    return {"summary": json.loads((run_dir / "summary.json").read_text()), "run_dir": run_dir,
            "hand_log": hand_log.read_text(errors="replace")}


def test_the_policy_gains_on_held_out_prompts_with_vllm_workers(vllm_run: dict) -> None:
    s = vllm_run["summary"]
    assert s["reward_end"] >= s["reward_start"] + 0.1, s
    assert {"local-0", "hand-vllm"} <= set(s["worker_ids"]), s["worker_ids"]


def test_every_vllm_worker_generated_with_vllm_and_followed_the_published_versions(vllm_run: dict) -> None:
    run_dir = vllm_run["run_dir"]
    for name, text in (("local-0", (run_dir / "logs" / "worker-0.log").read_text(errors="replace")),
                       ("hand-vllm", vllm_run["hand_log"])):
        swaps = [int(v) for v in re.findall(r"vLLM weights swapped from version \d+ to (\d+)", text)]
        assert len(swaps) >= 10 and swaps == sorted(swaps), (name, swaps[:20])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_worker: dict[str, int] = {}
    for r in rows:
        for worker, n in r["groups_by_worker"].items():
            by_worker[worker] = by_worker.get(worker, 0) + n
    assert by_worker.get("hand-vllm", 0) > 0 and by_worker.get("local-0", 0) > 0, by_worker
    # The trainer re-scored the vLLM workers' groups from its own data: every reward true.
    assert rows[-1]["reward_disagreements"] == {} and rows[-1]["groups_unscored"] == {}, rows[-1]
