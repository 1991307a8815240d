"""Any decoder-only architecture transformers knows: the engine's cached decoding and the trainer's
shared-prefix forward and chunked LM head give the plain forward's log-probs, and the general paths
agree with them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from broker.schema import SamplingParams
from producers.engines.torch_engine import TorchEngine
from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer
from trainer.model import check_checkpoint, load_policy
from trainer.logprobs import check_fast_paths
from trainer.value import load_value_model

ARCHS = ["qwen3", "mistral", "gemma2", "phi3", "gpt2"]
SAMPLING = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=5)


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe_tokenizer([f"{a} plus {b} is {a + b}." for a in range(30) for b in range(30)], vocab_size=200)


def _plain_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    seq = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=seq, use_cache=False).logits[0].float(), dim=-1)
    at = torch.arange(len(prompt) - 1, seq.shape[1] - 1)
    return logp[at, seq[0, at + 1]]


@pytest.mark.parametrize("arch", ARCHS)
def test_fast_paths_agree_with_the_plain_forward(arch: str, tokenizer, tmp_path: Path) -> None:
    model_dir = build_checkpoint(tmp_path / arch, tokenizer, arch=arch, hidden_size=32, layers=2, heads=4, kv_heads=2)
    assert check_checkpoint(model_dir) == arch
    model, tok = load_policy(model_dir)
    engine = TorchEngine(model_dir, seed=0)
    assert engine.kv_cache  # the probe found cached decoding exact on this architecture
    prompts = [tok("3 plus 4 is")["input_ids"], tok("12 plus")["input_ids"]]
    cached = asyncio.run(engine.generate_batch(prompts, 2, SAMPLING))
    general = TorchEngine(model_dir, seed=0)
    general.kv_cache = False
    plain_path = asyncio.run(general.generate_batch(prompts, 2, SAMPLING))
    for prompt, samples, again in zip(prompts, cached, plain_path):
        for sample, other in zip(samples, again):
            assert sample.tokens == other.tokens  # same seed, same distribution: the same draws
            expected = _plain_logprobs(model, prompt, sample.tokens)
            assert torch.allclose(torch.tensor(sample.logprobs), expected, atol=1e-4)
            assert torch.allclose(torch.tensor(other.logprobs), expected, atol=1e-4)
    # The trainer's fast paths (LM head in chunks, soft-capped for gemma2; shared prefix) hold here.
    policy = check_fast_paths(model, model.get_input_embeddings().num_embeddings, tok.pad_token_id)
    assert policy.shared_prefix and not policy.own_forward
    # The value model (VAPO) loads this architecture's transformer with the policy's weights.
    value = load_value_model(model_dir)
    assert torch.equal(value.base.get_input_embeddings().weight, model.get_input_embeddings().weight)
    ids = torch.tensor([prompts[0]])
    assert value(ids, torch.ones_like(ids)).shape == (1, len(prompts[0]) - 1)


def test_a_directory_that_is_not_a_checkpoint_is_named(tmp_path: Path, tokenizer) -> None:
    from trainer.model import CheckpointError

    with pytest.raises(CheckpointError, match="not a directory"):
        check_checkpoint(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no config.json"):
        check_checkpoint(tmp_path)
    model_dir = build_checkpoint(tmp_path / "m", tokenizer, arch="qwen3", hidden_size=32, layers=1, heads=4)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="holds no weights"):
        check_checkpoint(model_dir)
