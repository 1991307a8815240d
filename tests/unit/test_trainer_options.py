"""Learner options: bf16 autocast and activation checkpointing change how a step is computed, not what it learns."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from rlbus.examples.addition import build_model
from trainer.config import TrainerConfig
from trainer.logprobs import checkpoint_layers
from trainer.model import load_policy, resolve_device
from trainer.step import autocast_dtype, train_step


def _groups(vocab: int) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(0)
    out = []
    for g in range(3):
        lengths = [3, 2, 4, 1]
        tokens = rng.integers(4, vocab, size=sum(lengths)).astype(np.int32)
        header = TrajectoryHeader(
            run="r", policy="main", group_id=f"g{g}", prompt_id=f"p{g}", task="t", worker_id="w",
            sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), rewards=[0.0, 1.0, 1.0, 0.0],
            finish_reasons=["stop"] * 4, min_version=0, max_version=0, vocab_size=vocab, created_at=time.time())
        out.append(TrajectoryGroup(
            header=header, prompt_tokens=rng.integers(4, vocab, size=3).astype(np.int32), completion_tokens=tokens,
            completion_offsets=np.cumsum([0, *lengths]).astype(np.int32),
            behaviour_logprobs=np.full(len(tokens), -2.0, np.float32), token_versions=np.zeros(len(tokens), np.int32)))
    return out


def _step(model_dir: Path, config: TrainerConfig, *, checkpointing: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model, tok = load_policy(model_dir)
    if checkpointing:
        checkpoint_layers(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    result = train_step(model, optimizer, _groups(len(tok)), config, pad_id=tok.pad_token_id, temperature=1.0)
    assert result.samples == 12 and np.isfinite(result.loss)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_autocast_and_gradient_checkpointing(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "m", hidden_size=32, layers=2, heads=2, intermediate_size=64)
    start = {k: v.clone() for k, v in load_policy(model_dir)[0].state_dict().items()}
    plain = _step(model_dir, TrainerConfig())
    moved = max(float((plain[k] - start[k]).abs().max()) for k in start)
    assert moved > 0
    for shared in (True, False):  # checkpointing composes with the shared prefix: same update, less memory
        recomputed = _step(model_dir, TrainerConfig(shared_prefix=shared), checkpointing=True)
        assert all(torch.allclose(plain[k], recomputed[k], atol=1e-6) for k in plain), shared
    mixed = _step(model_dir, TrainerConfig(autocast_dtype="bfloat16"))
    for k in plain:  # bf16 forward: the same update up to bf16 rounding of the activations
        assert torch.allclose(plain[k] - start[k], mixed[k] - start[k], atol=0.05 * moved + 1e-3), k
    assert resolve_device("cpu") == "cpu" and resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")


def test_autocast_auto_is_bfloat16_on_gpus_that_have_it_and_none_on_cpus() -> None:
    config = TrainerConfig()
    assert config.autocast_dtype == "auto"
    assert autocast_dtype(config, torch.device("cpu")) is None
    assert autocast_dtype(TrainerConfig(autocast_dtype="bfloat16"), torch.device("cpu")) is torch.bfloat16
    assert autocast_dtype(TrainerConfig(autocast_dtype="none"), torch.device("cuda")) is None
    if torch.cuda.is_available():
        expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else None
        assert autocast_dtype(config, torch.device("cuda")) is expected
