"""What every inference engine keeps: the ``Engine`` protocol, ``GenerationResult``, the request checks
and ``BatchedEngine``, the generation entry points both engines share.

Behaviour log-probabilities
---------------------------
``GenerationResult.logprobs[t]`` is the log-probability of the sampled token under the distribution
it was drawn from: ``softmax(logits_t / T)`` restricted to the top-p nucleus (the fewest most
likely tokens whose mass reaches ``top_p``) and renormalised. With ``top_p = 1`` (the default) this
is exactly what the trainer recomputes with a teacher-forced forward pass at temperature ``T``, so
fresh samples give pi_prox / pi_behav = 1; with ``top_p < 1`` the ratio of a fresh sample is the
nucleus's mass (< 1): the true probability of the sampler that produced it. Both engines report
this (vLLM's ``processed_logprobs``). For greedy decoding (``T = 0``) it is the log-probability
under the plain (``T = 1``) softmax.

Weight versions
---------------
``load_weights`` swaps the weights between two decoding steps, under the same lock that guards
each step, so a step runs entirely on the old or entirely on the new weights. Every token records
the version that was live for the step that sampled it; tokens after a swap carry the new version
while the KV cache built so far is kept (in-flight weight update). ``VLLMEngine`` differs here: an
update waits for the generation in flight, which finishes on the old weights
(``producers.engines.vllm_engine``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from broker.schema import FinishReason, RoutingShape, SamplingParams

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@dataclass
class GenerationResult:
    """One sampled completion. ``tokens``, ``logprobs`` and ``versions`` have equal length."""

    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: FinishReason
    text: str
    mask: list[int] | None = None
    """Per token, 1 = generated (trained on), 0 = an environment's observation; None: all generated."""
    turns: list[tuple[int, int]] | None = None
    """A multi-turn episode's turns: each one's generated tokens as [start, end) in ``tokens``."""
    routing: np.ndarray | None = None
    """A mixture-of-experts policy's routing (the engine's ``routing_shape``): int16 [len(tokens), layers, top_k], row
    t the experts selected at the position that predicted token t, each row's in increasing order. None: a
    dense policy, or an engine that does not record it."""
    prompt_routing: np.ndarray | None = None
    """int16 [len(prompt) - 1, layers, top_k], as ``routing``: the prompt's positions 0..len(prompt) - 2 in the
    pass over the prompt (the prompt's last position predicts token 0: ``routing[0]``). The same for every
    sample of a prompt."""


@runtime_checkable
class Engine(Protocol):
    """What a rollout worker needs from an inference engine."""

    name: str
    version: int
    vocab_size: int
    max_context_tokens: int
    """Longest prompt + completion the engine takes, in tokens (multi-turn episodes stop before it)."""
    routing_shape: RoutingShape | None
    """The routing its results carry (a mixture-of-experts policy's), or None: none recorded."""
    tokenizer: Any

    async def generate(
        self, prompt_tokens: list[int], n: int, sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Sample ``n`` completions of one prompt."""
        ...

    async def generate_batch(
        self, prompts: Sequence[list[int]], n: int, sampling: SamplingParams
    ) -> list[list[GenerationResult]]:
        """Sample ``n`` completions of each prompt, batched; one list per prompt, in order."""
        ...

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace all weights atomically (never half-applied); later tokens get ``version``. A
        mismatched state dict is refused with ValueError and nothing changes."""
        ...

    def abort_all(self) -> None:
        """End every generation in flight after its current step, with finish reason 'abort'."""
        ...

    def close(self) -> None:
        """Release what the engine holds outside this process."""
        ...


def check_request(prompts: Sequence[list[int]], n: int) -> None:
    """What every engine refuses: no prompt, an empty one, or ``n < 1``."""
    if n < 1 or not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError(f"need n >= 1 and non-empty prompts, got n={n}, {len(prompts)} prompts")


def by_prompt(flat: list[GenerationResult], n: int) -> list[list[GenerationResult]]:
    """Samples in prompt order, ``n`` each, as one list per prompt."""
    return [flat[i : i + n] for i in range(0, len(flat), n)]


def refuse_mismatch(version: int, unexpected: list[str], missing: list[str], bad_shape: list[str]) -> None:
    """ValueError naming what does not fit, when anything does not: the update is not applied."""
    if unexpected or missing or bad_shape:
        raise ValueError(
            f"refusing weights for version {version}: unexpected {unexpected[:5]}, "
            f"missing {missing[:5]}, wrong shape {bad_shape[:5]}; nothing was changed"
        )


def routed_experts(samples: Sequence[GenerationResult], prompt_length: int,
                   shape: RoutingShape | None) -> np.ndarray | None:
    """A group's ``routed_experts`` (``broker.schema.TrajectoryGroup``) from its samples, for the engine's
    ``shape`` (None: a dense policy, no routing): the prompt's rows (the first sample's), then each sample's
    token rows; the rows a sample did not record (an episode assembled from several passes) are -1, which the
    trainer routes live."""
    if shape is None:
        return None

    def unrecorded(rows: int) -> np.ndarray:
        return np.full((rows, shape.layers, shape.top_k), -1, dtype=np.int16)

    prompt = samples[0].prompt_routing
    parts = [prompt if prompt is not None and len(prompt) == prompt_length - 1 else unrecorded(prompt_length - 1)]
    parts += [s.routing if s.routing is not None and len(s.routing) == len(s.tokens) else unrecorded(len(s.tokens))
              for s in samples]
    return np.concatenate(parts)


def stop_token_ids(config: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a completion: the model's EOS id(s) and the tokenizer's."""
    eos = getattr(config, "eos_token_id", None)
    ids = set(eos if isinstance(eos, list) else [eos]) | {tokenizer.eos_token_id}
    return sorted(i for i in ids if i is not None)


class BatchedEngine:
    """The entry points of an engine whose work is one blocking call per batch, run off the event
    loop: ``_run(prompts, n, sampling)`` returns the samples in prompt order, ``n`` each, and ends
    early (finish reason 'abort') when ``_abort_epoch`` moves while it runs; ``_swap(state_dict,
    version)`` replaces the weights or refuses them (ValueError) with nothing changed."""

    _abort_epoch = 0
    routing_shape: RoutingShape | None = None
    """The routing its results carry (``GenerationResult.routing``); None: none (a dense policy)."""

    def _run(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[GenerationResult]:
        raise NotImplementedError

    async def generate(
        self, prompt_tokens: list[int], n: int, sampling: SamplingParams
    ) -> list[GenerationResult]:
        """Sample ``n`` completions of one prompt."""
        return (await self.generate_batch([prompt_tokens], n, sampling))[0]

    async def generate_batch(
        self, prompts: Sequence[list[int]], n: int, sampling: SamplingParams
    ) -> list[list[GenerationResult]]:
        """Sample ``n`` completions of each prompt, batched; one list per prompt, in order."""
        check_request(prompts, n)
        return by_prompt(await asyncio.to_thread(self._run, [list(p) for p in prompts], n, sampling), n)

    def abort_all(self) -> None:
        """End every generation in flight after its current step, with finish reason 'abort'."""
        self._abort_epoch += 1

    def _swap(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Replace all weights atomically (``_swap``, off the event loop); a mismatch is refused."""
        await asyncio.to_thread(self._swap, state_dict, version)
