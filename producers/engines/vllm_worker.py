"""Runs inside vLLM's worker process: ``VLLMEngine`` names ``RlbusWorkerExtension`` as vLLM's
``worker_extension_cls``, and vLLM mixes it into its worker class, so its methods are callable with
``LLM.collective_rpc``.

Weights cross the process boundary as one safetensors file in shared memory (``/dev/shm`` when it
has room): the engine writes it, the worker maps it and streams the tensors into vLLM's in-place
reload (``Worker.reload_weights`` with a weights iterator, checkpoint format), which restores any
layout vLLM's kernels repacked the parameters into (on the CPU build the fused projections are
repacked, and a plain ``model.load_weights`` fails on them). Only a path travels over vLLM's RPC:
tensors passed as RPC arguments arrive as lists.

This module imports nothing of rlbus and nothing heavy: vLLM imports it in every worker. Importing
it runs its package's ``__init__`` too, which imports the interface (``producers.engines.base``,
``producers.config``: torch, which the worker has loaded already, and pydantic), not the engines.
"""

from __future__ import annotations


class RlbusWorkerExtension:
    """Methods vLLM adds to its worker (``self`` is the worker)."""

    def rlbus_load_weights(self, path: str, names: list[str]) -> int:
        """Load ``names`` from the safetensors file at ``path`` into the model, in place; the count."""
        from safetensors import safe_open

        with safe_open(path, framework="pt") as f:
            present = set(f.keys())
            absent = [n for n in names if n not in present]
            if absent:
                raise ValueError(f"{path} lacks {absent[:5]}; nothing was loaded")
            self.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names), is_checkpoint_format=True)
        return len(names)
