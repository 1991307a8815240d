"""M2PO-style masking of the tokens with the largest second moment of the log ratio."""

from __future__ import annotations

import time

import numpy as np
import torch

from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from rlbus.examples.addition import build_model
from trainer.model import load_policy
from trainer.config import TrainerConfig
from trainer.loss import m2po_mask
from trainer.step import train_step


def test_removes_largest_second_moments_until_mean_is_under_threshold() -> None:
    # m2 = [0.01, 0.25, 0.09, 0.0]: mean 0.0875; without 0.25 -> 0.0333; without 0.09 too -> 0.005.
    log_ratio = torch.tensor([[0.1, 0.5, -0.3, 0.0]])
    out = m2po_mask(log_ratio, torch.ones(1, 4), threshold=0.01)
    assert out.tolist() == [[1.0, 0.0, 0.0, 1.0]]


def test_masked_positions_are_ignored_and_stay_masked() -> None:
    log_ratio = torch.tensor([[0.1, 9.0, 0.0, 0.05]])
    mask = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    out = m2po_mask(log_ratio, mask, threshold=0.01)  # mean over live tokens 0.00417 <= 0.01
    assert out.tolist() == mask.tolist()


def test_everything_masked_when_no_prefix_fits() -> None:
    out = m2po_mask(torch.full((2, 3), 2.0), torch.ones(2, 3), threshold=0.1)
    assert float(out.sum()) == 0.0


def _group(prompt, completions, rewards, vocab) -> TrajectoryGroup:
    tokens = np.concatenate([np.asarray(c, np.int32) for c in completions])
    offsets = np.cumsum([0] + [len(c) for c in completions]).astype(np.int32)
    header = TrajectoryHeader(
        run="r", policy="main", group_id="g", prompt_id="p", task="addition", worker_id="w",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=3), rewards=rewards,
        finish_reasons=["stop"] * len(completions), min_version=0, max_version=0, vocab_size=vocab,
        created_at=time.time(),
    )
    return TrajectoryGroup(header=header, prompt_tokens=np.asarray(prompt, np.int32), completion_tokens=tokens,
                           completion_offsets=offsets, behaviour_logprobs=np.full(len(tokens), -0.01, np.float32),
                           token_versions=np.zeros(len(tokens), np.int32))


def test_train_step_applies_the_mask_and_reports_it(tmp_path) -> None:
    model_dir = build_model(tmp_path / "m", hidden_size=32, layers=1, heads=2, intermediate_size=64)
    model, tok = load_policy(model_dir)
    ids = tok("3+4=")["input_ids"]
    seven, eos = tok("7", add_special_tokens=False)["input_ids"], tok.eos_token_id
    group = _group(ids, [seven + [eos], [eos], seven + [eos]], [1.0, 0.0, 1.0], len(tok))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A random model's log-probs are far from the recorded -0.01: a tight threshold masks tokens.
    result = train_step(model, opt, [group], TrainerConfig(m2po_threshold=1e-3), pad_id=tok.pad_token_id, temperature=1.0)
    assert result.stats["m2po_masked_tokens"] > 0
    loose = train_step(model, opt, [group], TrainerConfig(m2po_threshold=1e6), pad_id=tok.pad_token_id, temperature=1.0)
    assert loose.stats["m2po_masked_tokens"] == 0
