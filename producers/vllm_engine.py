"""``VLLMEngine``: the ``Engine`` protocol over vLLM's offline ``LLM`` class (GPU, optional).

vLLM is imported only when this engine is built (``EngineConfig.type = "vllm"``); the rest of
rlbus never needs it. Written against vLLM's documented API (``LLM``, ``SamplingParams``,
``TokensPrompt``, ``LLM.apply_model``, the ``logprobs_mode`` engine argument) and not exercised by
the CPU test-suite.

Differences from ``TorchEngine``, by design of the offline API:

* Weight swaps happen *between* ``generate`` calls, not between decoding steps: a swap waits for
  the generation in flight, so every token of one call carries one version. Never half-applied.
* Behaviour log-probs come from vLLM with ``logprobs_mode="processed_logprobs"``: the sampled
  token's log-probability after temperature scaling. With ``top_p == 1`` this is exactly
  ``TorchEngine``'s definition; with ``top_p < 1`` vLLM reports it after truncation, which
  overstates pi_behav slightly (a warning is logged once).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from broker.schema import SamplingParams
from producers.config import EngineConfig
from producers.engine import GenerationResult

logger = logging.getLogger(__name__)


class VLLMEngine:
    """Batched sampling with vLLM; same contract as ``TorchEngine`` (see module notes)."""

    name = "vllm"

    def __init__(self, model_dir: Path, config: EngineConfig, *, version: int = 0) -> None:
        try:
            from vllm import LLM
        except ImportError as e:  # the optional dependency is the only thing missing
            raise ImportError("engine type 'vllm' needs vLLM: pip install 'rlbus[gpu]' on a GPU host") from e
        self._llm = LLM(
            model=str(model_dir),
            tokenizer=str(model_dir),
            dtype=config.compute_dtype,
            seed=config.seed if config.seed is not None else 0,
            gpu_memory_utilization=config.gpu_memory_utilization,
            max_model_len=config.max_model_len,
            logprobs_mode="processed_logprobs",
        )
        self.tokenizer = self._llm.get_tokenizer()
        self.vocab_size: int = int(self._llm.llm_engine.model_config.get_vocab_size())
        self.max_context_tokens: int = int(self._llm.llm_engine.model_config.max_model_len)
        self.version = version
        self._lock = threading.Lock()  # one generate call or one weight swap at a time
        self._warned_top_p = False

    async def generate(
        self, prompt_tokens: list[int], n: int, sampling: SamplingParams
    ) -> list[GenerationResult]:
        return (await self.generate_batch([prompt_tokens], n, sampling))[0]

    async def generate_batch(
        self, prompts: Sequence[list[int]], n: int, sampling: SamplingParams
    ) -> list[list[GenerationResult]]:
        return await asyncio.to_thread(self._generate, [list(p) for p in prompts], n, sampling)

    def _generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingParams
    ) -> list[list[GenerationResult]]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        if sampling.top_p < 1.0 and not self._warned_top_p:
            logger.warning("vLLM reports log-probs after top-p truncation (top_p=%s)", sampling.top_p)
            self._warned_top_p = True
        params = VllmSamplingParams(
            n=n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
        )
        with self._lock:
            version = self.version
            outputs = self._llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
            )
        results = []
        for request in outputs:
            group = []
            for c in request.outputs:
                tokens = list(c.token_ids)
                logprobs = [float(step[tok].logprob) for tok, step in zip(tokens, c.logprobs or [])]
                if len(logprobs) != len(tokens):
                    raise RuntimeError(f"vLLM returned {len(logprobs)} log-probs for {len(tokens)} tokens")
                reason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
                group.append(GenerationResult(tokens, logprobs, [version] * len(tokens), reason, c.text))
            results.append(group)
        return results

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        await asyncio.to_thread(self._swap, dict(state_dict), version)

    def _swap(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        weights = [(name, tensor.detach().cpu()) for name, tensor in state_dict.items()]

        def load(model: torch.nn.Module) -> int:
            model.load_weights(weights=weights)
            return len(weights)

        with self._lock:
            self._llm.apply_model(load)
            previous, self.version = self.version, version
        logger.info("vLLM weights swapped from version %d to %d", previous, version)
