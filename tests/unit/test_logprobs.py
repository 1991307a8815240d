"""The policy's log-probs at its trained tokens (plain or shared-prefix forward, the LM head in chunks
or whole, with or without activation checkpointing) equal the model's own forward in value and
gradient on real models; the entropy is that of the model's distribution."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from broker.schema import SamplingParams, TrajectoryGroup, TrajectoryHeader
from rlbus.examples.addition import build_model
from trainer.model import load_policy
from trainer.batch import collate
from trainer.logprobs import PolicyModel, checkpoint_layers, chunked_head_logprobs
from trainer.loss import sequence_logprobs


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


PATHS = {
    "plain, head in chunks": dict(shared_prefix=False, chunk_mib=0.001),
    "shared prefix, head in chunks": dict(shared_prefix=True, chunk_mib=0.001),
    "shared prefix, whole head": dict(shared_prefix=True, chunk_mib=0),
}


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_equals_the_models_own_forward_in_value_and_gradient(tmp_path, arch, checkpointing) -> None:
    model_dir = build_model(tmp_path / arch, arch=arch, hidden_size=32, layers=2, heads=2, intermediate_size=64)
    model, tok = load_policy(model_dir)
    reference, _ = load_policy(model_dir)
    if checkpointing:
        assert checkpoint_layers(model) == 2
    vocab = len(tok)
    rng = np.random.default_rng(0)
    for trial in range(7):
        # The last trial has no completion token at all (every sample stopped before generating).
        longest = 4 if trial < 6 else 0
        groups = [_group(rng, i, vocab, max_completion=longest) for i in range(int(rng.integers(1, 6)))]
        batch = collate(groups, pad_id=tok.pad_token_id)
        if batch.input_ids.shape[1] < 2:
            continue
        trained = batch.completion_mask > 0
        weights = torch.randn(batch.completion_mask.shape) * trained
        reference.zero_grad(set_to_none=True)
        expected = sequence_logprobs(reference, batch.input_ids, batch.attention_mask, temperature=0.7)
        (expected * weights).sum().backward()
        expected_grads = [p.grad.clone() for p in reference.parameters()]
        for name, settings in PATHS.items():
            model.zero_grad(set_to_none=True)
            logp, _ = PolicyModel(model, **settings)(batch, temperature=0.7)
            (logp * weights).sum().backward()
            torch.testing.assert_close(logp[trained], expected.detach()[trained], atol=1e-5, rtol=1e-5,
                                       msg=f"{name}, trial {trial}")
            assert bool((logp[~trained] == 0).all()), "positions outside the trained tokens must be zero"
            for p, g in zip(model.parameters(), expected_grads, strict=True):
                torch.testing.assert_close(p.grad if p.grad is not None else torch.zeros_like(g), g, atol=1e-5,
                                           rtol=1e-4, msg=name)


def test_chunked_head_entropy_softcap_and_bias_against_whole_logits() -> None:
    """Chunks of 3 rows against one softmax over whole logits: log-probs, entropies and the gradients
    of hidden states, weight and bias, with Gemma's soft cap and a sampling temperature."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=True)
    hidden = torch.randn(10, 16, requires_grad=True)
    targets = torch.randint(0, 50, (10,))
    upstream = torch.randn(10)
    z = head(hidden)
    capped = 5.0 * torch.tanh(z / 5.0) / 0.8
    whole = torch.log_softmax(capped, -1)
    expected_lp = whole.gather(1, targets[:, None]).squeeze(1)
    expected_entropy = -(whole.exp() * whole).sum(-1)
    grads = torch.autograd.grad((expected_lp * upstream).sum(), [hidden, head.weight, head.bias])
    chunk = 3 * 4 * 50 / (1 << 20)  # three rows of float32 logits
    lp, entropy = chunked_head_logprobs(hidden, head, targets, temperature=0.8, softcap=5.0, chunk_mib=chunk)
    torch.testing.assert_close(lp, expected_lp.detach())
    torch.testing.assert_close(entropy, expected_entropy.detach())
    got = torch.autograd.grad((lp * upstream).sum(), [hidden, head.weight, head.bias])
    for a, b in zip(got, grads, strict=True):
        torch.testing.assert_close(a, b)


def test_the_prompt_runs_once_per_group(tmp_path) -> None:
    """Four samples of one prompt: the prompt runs through the model once (batch of one)."""
    model_dir = build_model(tmp_path / "m", hidden_size=32, layers=1, heads=2, intermediate_size=64)
    model, tok = load_policy(model_dir)
    group = _group(np.random.default_rng(1), 0, len(tok), size=4)
    batch = collate([group], pad_id=tok.pad_token_id)
    seen: list[tuple[int, int]] = []
    handle = model.get_input_embeddings().register_forward_hook(lambda m, i, o: seen.append(tuple(i[0].shape)))
    try:
        PolicyModel(model, shared_prefix=True)(batch)
    finally:
        handle.remove()
    assert seen[0] == (1, len(group.prompt_tokens))
    assert all(rows == group.group_size for rows, _ in seen[1:])
