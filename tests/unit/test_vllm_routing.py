"""``VLLMEngine`` and a mixture-of-experts policy's routing (R3), on the vLLM build installed here.

vLLM returns the experts it routed each position to (``enable_return_routed_experts``) only from its
Model Runner V2, which needs Triton with a backend for the device; vLLM's CPU build has none (no
triton-cpu wheel), so there the engine generates an MoE policy's tokens, from the same model as
transformers, and records no routing: ``routing_shape``, ``routing`` and ``prompt_routing`` are None,
and the trainer routes live. The last test fails the day this build can return the routed experts,
so that the engine is wired to them (issue 43).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from broker.schema import SamplingParams
from producers.config import EngineConfig
from producers.engines import build_engine
from rlbus.examples.scratch import build_checkpoint, train_bpe_tokenizer
from tests.unit.test_engine_contract import _vllm_or_skip, plain_logprobs
from trainer.model import load_policy

PROMPTS = [[5, 17, 33, 40, 41], [7, 8, 9], [100, 3, 57, 12, 90, 91, 92, 20, 4]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = train_bpe_tokenizer([f"{a} plus {b} is {a + b}." for a in range(30) for b in range(30)],
                                    vocab_size=200)
    # head_dim 32: vLLM's CPU attention takes 32, 64, 80, 96, 112, 128, 256.
    return build_checkpoint(tmp_path_factory.mktemp("vllm-moe") / "m", tokenizer, arch="qwen3_moe", hidden_size=64,
                            layers=2, heads=2, intermediate_size=128, max_position_embeddings=128, seed=3,
                            num_experts=4, top_k=2)


@pytest.fixture(scope="module")
def engine(model_dir: Path):
    _vllm_or_skip()
    engine = build_engine(EngineConfig(type="vllm", compute_dtype="float32", seed=0, device="cpu", max_model_len=128,
                                       enforce_eager=True, kv_cache_gib=0.25), model_dir)
    yield engine
    engine.close()


def test_vllm_generates_an_moe_policy_and_records_no_routing_on_the_cpu_build(engine, model_dir: Path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA host: vLLM's CUDA build may return routed experts, which the engine does not request yet")
    greedy = SamplingParams(temperature=0.0, top_p=1.0, max_new_tokens=8)
    results = asyncio.run(engine.generate_batch(PROMPTS, 2, greedy))
    model, _ = load_policy(model_dir)
    assert engine.routing_shape is None
    for prompt, samples in zip(PROMPTS, results, strict=True):
        for r in samples:
            assert r.tokens and len(r.logprobs) == len(r.tokens)
            assert r.routing is None and r.prompt_routing is None  # the trainer routes these groups live
            with torch.no_grad():  # greedy: each token is the argmax of the same MoE model in transformers
                logits = model(torch.tensor([prompt + r.tokens])).logits[0, len(prompt) - 1 : -1]
            assert logits.argmax(-1).tolist() == r.tokens
            assert plain_logprobs(model, prompt, r.tokens, 1.0) == pytest.approx(r.logprobs, abs=1e-4)


def test_this_vllm_cpu_build_cannot_return_routed_experts(model_dir: Path):
    _vllm_or_skip()
    if torch.cuda.is_available():
        pytest.skip("a CUDA host: this checks vLLM's CPU build")
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), dtype="float32", max_model_len=128, enforce_eager=True,
                      enable_return_routed_experts=True)
    try:
        args.create_engine_config()
    except ValueError as exc:  # "AuxOutput Connector requires Model Runner V2", or "... V2 requires Triton"
        assert "Model Runner V2" in str(exc)
    else:
        pytest.fail("this vLLM build accepts enable_return_routed_experts: make VLLMEngine request them for a "
                    "mixture-of-experts model and fill GenerationResult.routing / prompt_routing (issue 43)")
