"""`rlbus run` with a trainer on two ranks (torchrun, FSDP2, gloo on the CPU): it trains through the
real broker and store, a rank killed mid-run ends the trainer, which is restarted from its sharded
checkpoint with no group trained twice on the weights' lineage, and the published weights load with
``from_pretrained`` and equal the trainer's own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch

from tests.e2e.test_run import ROOT, _cli, _cmdline, _started
from tests.fixtures.helpers import wait_for

pytestmark = pytest.mark.e2e


def _rank_pid(rank: int, run_dir: Path) -> int | None:
    """The trainer process of ``rank`` of the run in ``run_dir`` (a torchrun child: RANK in its environment)."""
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or "trainer" not in _cmdline(proc) or str(run_dir) not in _cmdline(proc):
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ and b"LOCAL_WORLD_SIZE=2" in environ:
            return int(proc.name)
    return None


def test_two_ranks_train_survive_a_killed_rank_and_publish_loadable_weights(tmp_path: Path) -> None:
    log = tmp_path / "run.log"
    steps, every = 40, 10
    with open(log, "wb") as out:
        proc = subprocess.Popen(_cli("run", str(ROOT / "configs/ci.toml"), "--set", f"local.dir={tmp_path}",
                                     "--set", "local.trainer_ranks=2", "--set", f"trainer.max_steps={steps}",
                                     "--set", f"trainer.checkpoint_every={every}", "--set", "trainer.groups_per_step=8",
                                     "--set", "trainer.micro_batch_tokens=256"),
                                stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                                cwd=ROOT)
    try:
        run_dir, rows = _started(log)
        wait_for(lambda: len(rows()) >= every + 3, 600, "steps past the first checkpoint")
        os.kill(wait_for(lambda: _rank_pid(1, run_dir), 30, "rank 1 of the trainer"), signal.SIGKILL)
        rc = proc.wait(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert rc == 0, log.read_text(errors="replace")[-4000:]
    trainer_log = (run_dir / "logs" / "trainer.log").read_text(errors="replace")
    assert "learner on 2 ranks (FSDP2)" in trainer_log
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer_restarts"] == 1
    history = rows()
    resumed = next(i for i in range(1, len(history)) if history[i]["step"] <= history[i - 1]["step"])
    ckpt = max(s for s in range(every, history[resumed - 1]["step"] + 1, every))
    assert history[resumed]["step"] == ckpt + 1 and history[-1]["step"] == steps
    lineage = [r for r in history[:resumed] if r["step"] <= ckpt] + history[resumed:]
    trained = [gid for r in lineage for gid in r["trained_group_ids"]]
    assert len(trained) == len(set(trained)) == 8 * steps

    # The newest published version is the final checkpoint's weights, and from_pretrained loads it.
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import load_latest_checkpoint
    from weightstore.config import build_store, store_config_from_url
    from weightstore.modelfiles import prepare_local_model

    checkpoint = load_latest_checkpoint(run_dir / "checkpoints" / "main")
    local, _, version = prepare_local_model(build_store(store_config_from_url(str(run_dir / "store"))), "main",
                                            tmp_path / "fetched", timeout_s=30)
    assert version == history[-1]["version"] == checkpoint.version
    published = AutoModelForCausalLM.from_pretrained(local, local_files_only=True, dtype=torch.float32)
    mine = AutoModelForCausalLM.from_pretrained(local, local_files_only=True, dtype=torch.float32)
    checkpoint.restore(mine)
    for name, tensor in mine.state_dict().items():  # published in bfloat16
        assert torch.equal(published.state_dict()[name], tensor.to(torch.bfloat16).float()), name
    verify = subprocess.run(_cli("weights", "verify", "--store", str(run_dir / "store"), "main", "--all"),
                            capture_output=True, text=True, cwd=ROOT)
    assert verify.returncode == 0, verify.stderr[-2000:]
