"""The shared-prefix forward gives the plain forward's log-probs and gradients on real models."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from rlbus.examples.addition import build_model
from trainer.model import load_policy
from trainer.batch import collate
from trainer.loss import sequence_logprobs, shared_prefix_logprobs


def _group(
    rng: np.random.Generator, i: int, vocab: int, *, size: int | None = None, max_completion: int = 4
) -> TrajectoryGroup:
    size = int(rng.integers(1, 6)) if size is None else size
    prompt = rng.integers(3, vocab, size=int(rng.integers(1, 8))).astype(np.int32)
    completions = [rng.integers(3, vocab, size=int(rng.integers(0, max_completion + 1))).astype(np.int32)
                   for _ in range(size)]
    tokens = np.concatenate(completions).astype(np.int32)
    # Half the groups compare their samples in subgroups (labels in any order, not contiguous).
    subgroups = [int(x) for x in rng.integers(0, 3, size=size)] if rng.random() < 0.5 else None
    header = TrajectoryHeader(
        run="r", policy="main", group_id=f"g{i}", prompt_id=f"p{i}", task="addition", worker_id="w",
        sampling=SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=4), rewards=[float(x) for x in range(size)],
        finish_reasons=["stop"] * size, min_version=0, max_version=0, vocab_size=vocab, created_at=time.time(),
        subgroups=subgroups,
    )
    return TrajectoryGroup(
        header=header, prompt_tokens=prompt, completion_tokens=tokens,
        completion_offsets=np.cumsum([0] + [len(c) for c in completions]).astype(np.int32),
        behaviour_logprobs=np.zeros(len(tokens), np.float32), token_versions=np.zeros(len(tokens), np.int32),
    )


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_equals_the_plain_forward_in_value_and_gradient(tmp_path, arch) -> None:
    model_dir = build_model(tmp_path / arch, arch=arch, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    model, tok = load_policy(model_dir)
    vocab = len(tok)
    rng = np.random.default_rng(0)
    for trial in range(7):
        # The last trial has no completion token at all (every sample stopped before generating).
        longest = 4 if trial < 6 else 0
        groups = [_group(rng, i, vocab, max_completion=longest) for i in range(int(rng.integers(1, 6)))]
        batch = collate(groups, pad_id=tok.pad_token_id)
        if batch.input_ids.shape[1] < 2:
            continue
        completion = torch.zeros_like(batch.completion_mask, dtype=torch.bool)
        for row, (p_len, total) in enumerate(zip(batch.prompt_lengths, batch.attention_mask.sum(1), strict=True)):
            completion[row, p_len - 1 : total - 1] = True
        weights = torch.randn(batch.completion_mask.shape) * completion
        grads = []
        for fn in (
            lambda: sequence_logprobs(model, batch.input_ids, batch.attention_mask, temperature=0.7),
            lambda: shared_prefix_logprobs(model, batch, temperature=0.7),
        ):
            model.zero_grad(set_to_none=True)
            logp = fn()
            (logp * weights).sum().backward()
            grads.append((logp.detach() * completion, [p.grad.clone() for p in model.parameters()]))
        (plain, plain_grads), (shared, shared_grads) = grads
        torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5, msg=f"trial {trial}")
        assert bool((shared[~completion] == 0).all()), "positions outside completions must be zero"
        for a, b in zip(shared_grads, plain_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_prompt_runs_once_per_group(tmp_path) -> None:
    """Four samples of one prompt: the prompt runs through the model once (batch of one)."""
    model_dir = build_model(tmp_path / "m", hidden_size=32, layers=1, heads=2, intermediate_size=64)
    model, tok = load_policy(model_dir)
    group = _group(np.random.default_rng(1), 0, len(tok), size=4)
    batch = collate([group], pad_id=tok.pad_token_id)
    seen: list[tuple[int, int]] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        shared_prefix_logprobs(model, batch)
    finally:
        handle.remove()
    assert seen[0] == (1, len(group.prompt_tokens))
    assert all(rows == group.group_size for rows, _ in seen[1:])
