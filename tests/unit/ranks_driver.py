"""Runs a learner for the rank tests (``test_ranks.py``), under ``torchrun`` or alone: fixed groups
per step, a checkpoint at one step, a resume from a checkpoint directory, and a rank that kills
itself at a step. Rank 0 writes each step's figures and the final weights' checksums as JSON."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch


def groups_for(step: int, vocab: int) -> list:
    """Four ragged groups, their rewards different in every group, a new draw each step."""
    from tests.unit.test_microbatch import _groups

    return _groups(vocab, n=4, seed=1000 + step)


def main() -> None:
    spec = json.loads(sys.argv[1])
    from trainer.checkpoint import load_latest_checkpoint
    from trainer.config import TrainerConfig
    from trainer.learner import build_learner
    from trainer.ranks import join_ranks

    torch.manual_seed(0)
    config = TrainerConfig.model_validate(spec.get("config", {}))
    ranks, device = join_ranks("cpu")
    learner, _ = build_learner(config, Path(spec["model_dir"]), temperature=1.0, device=device, ranks=ranks)
    die = spec.get("die")  # [rank, step]: that rank kills itself when that step comes
    if die and die[0] == ranks.rank:
        real_step = learner.step

        def dying(groups, at):
            if at == die[1]:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_step(groups, at)

        learner.step = dying
    if ranks.rank != 0:
        learner.serve()
        return
    rows = []
    out = Path(spec["out"])
    ckpt = load_latest_checkpoint(Path(spec["resume"])) if spec.get("resume") else None
    learner.restore(None if ckpt is None else ckpt.path)
    start = 0 if ckpt is None else ckpt.version
    vocab = learner.lm.get_input_embeddings().num_embeddings
    for step in range(start, spec["steps"]):
        result = learner.step(groups_for(step, vocab), step)
        rows.append({"step": step, "loss": result.loss, "grad_norm": result.grad_norm, **result.stats})
        out.write_text(json.dumps({"rows": rows}))
        if spec.get("save_at") == step + 1:
            learner.save(Path(spec["save_dir"]), version=step + 1, offsets={"t": {0: step + 1}},
                         extra={"step": step + 1}, keep=2)
    weights = learner.weights(torch.float32)
    out.write_text(json.dumps({"rows": rows, "weights": {k: float(v.double().sum()) for k, v in weights.items()},
                               "describe": learner.describe()}))
    learner.stop()  # as the trainer does: not on an error (the other ranks fail when this process is gone)


if __name__ == "__main__":
    main()
