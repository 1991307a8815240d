"""FSDP2 across real ranks (torchrun, gloo on the CPU) against one rank on the same data: the loss
trajectory of 20 steps, the value model and the KL reference, sharded checkpoints resumed on another
number of ranks, gathered weights equal to one rank's, and a rank killed mid-run ending the step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlbus.examples.addition import build_model

REPO = Path(__file__).resolve().parents[2]
# Several micro-batches per rank (and stand-ins on the rank with fewer), the shared prefix, AdamW.
CONFIG = {"lr": 3e-3, "micro_batch_tokens": 40, "grad_clip": 1.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("ranks") / "m", hidden_size=32, layers=2, heads=2, intermediate_size=64)


def _run(ranks: int, spec: dict, tmp: Path, name: str, *, expect_ok: bool = True) -> dict:
    out = tmp / f"{name}.json"
    args = ["-m", "tests.unit.ranks_driver", json.dumps({**spec, "out": str(out)})]
    launch = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, *launch, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    if expect_ok:
        assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    else:
        assert proc.returncode != 0, "the run should have failed"
    result = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    result["log"] = proc.stdout + proc.stderr
    return result


def _close(a: list[dict], b: list[dict], keys=("loss", "grad_norm")) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        for key in keys:
            assert (key in ra) == (key in rb), (ra["step"], key)
            if key in ra:  # the policy's figures are absent while the value model pretrains
                assert rb[key] == pytest.approx(ra[key], rel=2e-3, abs=2e-5), (ra["step"], key)


def test_two_ranks_train_as_one_and_their_checkpoints_resume_on_either(model_dir: Path, tmp_path: Path) -> None:
    base = {"model_dir": str(model_dir), "config": CONFIG, "steps": 20, "save_at": 10}
    one = _run(1, {**base, "save_dir": str(tmp_path / "ck1")}, tmp_path, "one")
    two = _run(2, {**base, "save_dir": str(tmp_path / "ck2")}, tmp_path, "two")
    assert "2 ranks (FSDP2)" in two["describe"]
    assert len(one["rows"]) == 20 and one["rows"][-1]["loss"] != one["rows"][0]["loss"]
    _close(one["rows"], two["rows"])
    for name, total in one["weights"].items():  # the weights gathered for publication, tensor by tensor
        assert two["weights"][name] == pytest.approx(total, rel=1e-3, abs=1e-3), name
    # A checkpoint of two ranks resumes on one, and one of one rank on two: the same trajectory.
    on_one = _run(1, {**base, "save_at": None, "resume": str(tmp_path / "ck2")}, tmp_path, "resumed-on-one")
    on_two = _run(2, {**base, "save_at": None, "resume": str(tmp_path / "ck1")}, tmp_path, "resumed-on-two")
    _close(one["rows"][10:], on_one["rows"])
    _close(one["rows"][10:], on_two["rows"])


def test_the_value_model_and_the_kl_reference_shard_too(model_dir: Path, tmp_path: Path) -> None:
    config = {**CONFIG, "algorithm": "vapo", "kl_coef": 0.1, "value": {"pretrain_steps": 2}}
    base = {"model_dir": str(model_dir), "config": config, "steps": 6}
    one = _run(1, base, tmp_path, "one")
    two = _run(2, base, tmp_path, "two")
    _close(one["rows"], two["rows"], keys=("loss", "grad_norm", "value_loss", "kl_ref"))
    assert "policy_frozen" in one["rows"][0] and "policy_frozen" not in one["rows"][-1]
    assert all("kl_ref" in r and "value_loss" in r for r in one["rows"][2:])


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_that_dies_ends_the_step_and_the_run(model_dir: Path, tmp_path: Path, rank: int) -> None:
    """Rank 1 dies inside step 5 (rank 0 is in its collectives), or rank 0 does (rank 1 is): the
    other fails at once instead of waiting, torchrun ends, and the checkpoint before is whole."""
    spec = {"model_dir": str(model_dir), "config": CONFIG, "steps": 20, "save_at": 3,
            "save_dir": str(tmp_path / "ck"), "die": [rank, 5]}
    dead = _run(2, spec, tmp_path, "dead", expect_ok=False)
    assert [r["step"] for r in dead["rows"]] == [0, 1, 2, 3, 4]  # step 5 never completed on rank 0
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if not p.name.startswith(".")) == ["v00000003"]
    # The trainer resumes from the checkpoint and trains the steps again.
    resumed = _run(2, {**spec, "die": None, "save_at": None, "steps": 6, "resume": str(tmp_path / "ck")}, tmp_path,
                   "resumed")
    _close(dead["rows"][3:5], resumed["rows"][:2])
