"""Runs a learner for the rank tests (``test_ranks.py``), under ``torchrun`` or alone: fixed groups
per step, a checkpoint at one step, a resume from a checkpoint directory, and a rank that kills
itself at a step. Rank 0 writes each step's figures and the final weights' checksums as JSON."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch


def groups_for(step: int, vocab: int) -> list:
    """Ragged groups (prompts 2–9 tokens, completions 1–12), rewards that differ in every group."""
    import time

    from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader

    rng = np.random.default_rng(1000 + step)
    out = []
    for g in range(4):
        size = 4
        lengths = [int(x) for x in rng.integers(1, 13, size=size)]
        tokens = rng.integers(4, vocab, size=sum(lengths)).astype(np.int32)
        header = TrajectoryHeader(
            run="r", policy="main", group_id=f"s{step}g{g}", prompt_id=f"p{g}", task="t", worker_id="w",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=12),
            rewards=[float(x) for x in rng.permutation(size) / size], finish_reasons=["stop"] * size,
            min_version=0, max_version=0, vocab_size=vocab, created_at=time.time())
        out.append(TrajectoryGroup(
            header=header, prompt_tokens=rng.integers(4, vocab, size=int(rng.integers(2, 10))).astype(np.int32),
            completion_tokens=tokens, completion_offsets=np.cumsum([0, *lengths]).astype(np.int32),
            behaviour_logprobs=rng.uniform(-5, -3, size=len(tokens)).astype(np.float32),
            token_versions=np.zeros(len(tokens), np.int32)))
    return out


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
    if ranks.rank != 0:
        if die and die[0] == ranks.rank:
            step = learner.step

            def dying(groups, at):
                if at == die[1]:
                    os.kill(os.getpid(), signal.SIGKILL)
                return step(groups, at)

            learner.step = dying
        learner.follow()
        return
    rows = []
    out = Path(spec["out"])
    try:
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
    finally:
        learner.stop()


if __name__ == "__main__":
    main()
